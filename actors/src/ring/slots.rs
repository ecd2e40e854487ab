//! Per-slot metadata and its state machine. Every state change is an atomic
//! compare-exchange:
//!
//! EMPTY → LOADING → READY → CONSUMED, and READY/CONSUMED → EMPTY only by eviction of
//! an idle slot (reference count 0), LOADING → EMPTY when a read fails.
//!
//! A slot being recycled has the RECYCLING bit set in its reference count (set by a
//! compare-exchange from 0), which makes every concurrent attempt to take a reference
//! fail until the slot carries its new identity.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use smoe_proto::{ExpertKey, VaultError};

/// Slot holds nothing.
pub const EMPTY: u8 = 0;
/// A read into the slot is in flight.
pub const LOADING: u8 = 1;
/// The slot holds a verified blob that no claim has used yet.
pub const READY: u8 = 2;
/// The slot holds a verified blob that has been claimed at least once (retained).
pub const CONSUMED: u8 = 3;

/// Bit of the reference count marking a slot that is being given a new identity.
pub const RECYCLING: u32 = 1 << 31;
/// Key value of a slot with no identity.
pub const NO_KEY: u32 = u32::MAX;

/// How the slot's current contents arrived, until the first claim uses them.
pub const ORIGIN_RETAINED: u8 = 0;
/// Read on demand; the first claim counts as the miss that paid for it.
pub const ORIGIN_DEMAND: u8 = 1;
/// Read as a speculative bet; the first claim counts as a used bet.
pub const ORIGIN_BET: u8 = 2;
/// Read ahead for the next layer of a prefill block; the first claim counts as used
/// lookahead. Until then no other lookahead read may evict it.
pub const ORIGIN_LOOKAHEAD: u8 = 3;
/// Read ahead for a layer whose routing then did not choose it (withdrawn while its
/// read was in flight or done): a claim counts as a plain hit, and its bytes as wasted
/// lookahead.
pub const ORIGIN_WASTED: u8 = 4;

/// Packs a key into the slot's atomic identity word.
pub fn pack(key: ExpertKey) -> u32 {
    ((key.layer as u32) << 16) | key.expert as u32
}

/// Unpacks an identity word.
pub fn unpack(v: u32) -> ExpertKey {
    ExpertKey { layer: (v >> 16) as u16, expert: v as u16 }
}

/// Metadata of one ring slot.
pub struct Slot {
    /// One of [`EMPTY`], [`LOADING`], [`READY`], [`CONSUMED`].
    pub state: AtomicU8,
    /// Live references (handles and announcements), plus [`RECYCLING`].
    pub refs: AtomicU32,
    /// Announcements holding a reference that a claim will take over.
    pub pins: AtomicU32,
    /// Packed identity, or [`NO_KEY`].
    pub key: AtomicU32,
    /// Last use, from the ring's clock (higher is more recent).
    pub tick: AtomicU64,
    /// How the contents arrived (see the `ORIGIN_*` constants).
    pub origin: AtomicU8,
    /// The error of the last failed read, for the claim waiting on it.
    pub error: Mutex<Option<VaultError>>,
    /// Packed identity of the last failed read ([`NO_KEY`] once the slot is reused): an
    /// announcement pinned before the failure finds its slot here, since the lookup no
    /// longer maps the expert to it.
    pub failed_key: AtomicU32,
}

impl Slot {
    /// An empty slot.
    pub fn new() -> Self {
        Slot {
            state: AtomicU8::new(EMPTY),
            refs: AtomicU32::new(0),
            pins: AtomicU32::new(0),
            key: AtomicU32::new(NO_KEY),
            tick: AtomicU64::new(0),
            origin: AtomicU8::new(ORIGIN_RETAINED),
            error: Mutex::new(None),
            failed_key: AtomicU32::new(NO_KEY),
        }
    }

    /// Takes a reference unless the slot is being recycled.
    pub fn try_ref(&self) -> bool {
        let mut r = self.refs.load(Ordering::Acquire);
        loop {
            if r & RECYCLING != 0 {
                return false;
            }
            match self.refs.compare_exchange_weak(r, r + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => r = now,
            }
        }
    }

    /// Drops a reference; returns the count left.
    pub fn unref(&self) -> u32 {
        let prev = self.refs.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & !RECYCLING > 0, "slot reference count underflow");
        prev - 1
    }

    /// Marks an idle slot for recycling (reference count 0 → RECYCLING).
    pub fn try_begin_recycle(&self) -> bool {
        self.refs.compare_exchange(0, RECYCLING, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Takes over one announcement's reference, if any.
    pub fn take_pin(&self) -> bool {
        let mut p = self.pins.load(Ordering::Acquire);
        while p > 0 {
            match self.pins.compare_exchange_weak(p, p - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => p = now,
            }
        }
        false
    }

    /// Moves the state from `from` to `to`; false if it was not `from`.
    pub fn transition(&self, from: u8, to: u8) -> bool {
        self.state.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

impl Default for Slot {
    fn default() -> Self {
        Self::new()
    }
}
