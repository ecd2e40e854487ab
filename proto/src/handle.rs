//! Expert identities and the handles through which stages share expert bytes.
//!
//! A handle is a counted reference to a slot that holds one expert's blob. While any
//! handle to a slot is alive the slot cannot be evicted; dropping the last one makes it
//! evictable again. Messages between stages carry handles, never bytes.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::{ClaimInfo, VaultError};

/// Identity of one routed expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Decoder layer.
    pub layer: u16,
    /// Expert index within the layer.
    pub expert: u16,
}

impl ExpertKey {
    /// Builds a key from layer and expert indices.
    pub fn new(layer: usize, expert: usize) -> Self {
        ExpertKey { layer: layer as u16, expert: expert as u16 }
    }
}

impl fmt::Display for ExpertKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {} expert {}", self.layer, self.expert)
    }
}

/// Owner of the slot memory behind handles (the ring cache, or a simple reader).
pub trait SlotOwner: Send + Sync {
    /// The bytes of `slot` (at least the blob it holds; a handle keeps its blob's
    /// length). Only called while a reference to the slot is held, so the bytes cannot
    /// change underneath the caller.
    fn slot_bytes(&self, slot: u32) -> &[u8];
    /// Drops one reference to `slot`.
    fn release(&self, slot: u32);
}

/// A counted reference to one expert's blob bytes, valid until dropped.
pub struct ExpertHandle {
    owner: Arc<dyn SlotOwner>,
    slot: u32,
    key: ExpertKey,
    len: usize,
    info: ClaimInfo,
}

impl ExpertHandle {
    /// Wraps a reference the owner has already counted for `slot`; the handle releases
    /// it on drop. `len` is the blob's payload length.
    pub fn new(owner: Arc<dyn SlotOwner>, slot: u32, key: ExpertKey, len: usize) -> Self {
        ExpertHandle { owner, slot, key, len, info: ClaimInfo::default() }
    }

    /// Records how the claim that produced this handle was satisfied.
    pub fn with_info(mut self, info: ClaimInfo) -> Self {
        self.info = info;
        self
    }

    /// How the claim that produced this handle was satisfied.
    pub fn info(&self) -> ClaimInfo {
        self.info
    }

    /// The expert this handle refers to.
    pub fn key(&self) -> ExpertKey {
        self.key
    }

    /// The slot index holding the expert.
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Deref for ExpertHandle {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.owner.slot_bytes(self.slot)[..self.len]
    }
}

impl Drop for ExpertHandle {
    fn drop(&mut self) {
        self.owner.release(self.slot);
    }
}

impl fmt::Debug for ExpertHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExpertHandle({}, slot {})", self.key, self.slot)
    }
}

/// Anything that can produce expert handles: the ring cache in the engine, a plain
/// blob reader in tools and tests.
pub trait ExpertSource: Send + Sync {
    /// Returns a handle to `key`'s blob, reading it if it is not held already. Blocks
    /// until the bytes are valid (checksum verified).
    fn claim(&self, key: ExpertKey) -> Result<ExpertHandle, VaultError>;

    /// Announces that `key` will be claimed soon (its demand is already known), so a
    /// source that reads asynchronously can start now. Never changes what `claim`
    /// returns; sources that read synchronously ignore it.
    /// Returns true when the source took a reference for the coming claim (the claim
    /// then consumes it); false when it could not (no slot free), in which case the
    /// caller should stop announcing until it has claimed what it announced.
    fn announce(&self, _key: ExpertKey) -> bool {
        false
    }

    /// Queues a low-priority speculative read of `key` (a bet that the next token will
    /// need it). Never delays demand reads and never changes what `claim` returns.
    fn prefetch(&self, _key: ExpertKey) {}

    /// Gives back the reference of an announced expert that will not be claimed (for
    /// example when the computation failed part-way).
    fn withdraw(&self, _key: ExpertKey) {}

    /// Queues a low-priority read of `key` ahead of its layer's routing (a prediction
    /// that the layer will route to it), into a slot no claim needs now. Never delays
    /// demand reads and never changes what `claim` returns; sources that read
    /// synchronously refuse.
    fn lookahead(&self, _key: ExpertKey) -> Lookahead {
        Lookahead::Refused
    }

    /// Withdraws the lookahead read of `key`: its layer was routed without it (or will
    /// not be routed). A read not started yet is dropped.
    fn withdraw_lookahead(&self, _key: ExpertKey) {}
}

/// What became of a lookahead read ([`ExpertSource::lookahead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookahead {
    /// The read was queued.
    Queued,
    /// The expert is present or on its way already: nothing to read.
    Resident,
    /// No slot may be taken for it now (nor, this layer, for any other).
    Refused,
}
