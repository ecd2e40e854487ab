//! The ring cache: a fixed set of aligned slots, allocated once, that hold expert blobs
//! read by the streamer and retained until LRU eviction.
//!
//! * Slots come in size classes, one per blob stride of the vault ([`classes`]): a
//!   layer's experts take slots of its class only, and eviction picks within the class.
//! * Claims that find their expert resident take a reference without any lock: a
//!   (layer, expert) → slot table of atomics, then a compare-exchange on the slot's
//!   reference count, then a check that the slot still has that identity.
//! * Misses take the allocation lock (only misses do), pick an EMPTY slot or else the
//!   least recently used idle slot (reference count 0, READY or CONSUMED), give it the
//!   new identity and a fresh LRU tick, and send a demand read to the streamer.
//! * Waiting for a read: the claiming thread blocks on a condition variable that the
//!   streamer signals whenever a read completes (no spinning; the wait costs no CPU).
//! * Nothing ever wipes the ring: expert weights are immutable, so a retained slot can
//!   never be stale, across tokens, requests and sessions.

pub mod budget;
pub mod classes;
mod lookahead;
pub mod memory;
mod publish;
pub mod slots;

pub use classes::{RingSize, SlotClass};
pub use publish::GaugePublisher;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use smoe_proto::metric_names::{
    BLOB_READS, LOOKAHEAD_BYTES, LOOKAHEAD_USED, LOOKAHEAD_USED_BYTES, READ_BYTES, READ_ERRORS,
    READ_LATENCY_SECONDS, RING_EVICTIONS, RING_HITS, RING_MISSES, SPEC_BETS, SPEC_BETS_USED,
};
use smoe_proto::stats::SLOT_STATES;
use smoe_proto::{
    ClaimInfo, ExpertHandle, ExpertKey, ExpertSource, Lookahead, Priority, ReadRequest, RingSnapshot,
    SlotOwner, VaultError,
};

use crate::streamer::{IoMode, LoadSink, Streamer, StreamerError, StreamerOptions};
use crate::vault::Vault;
use memory::{SlotAllocator, SlotArena};
use slots::*;

/// No slot holds this key.
const NO_SLOT: u32 = u32::MAX;

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    bytes_read: AtomicU64,
    blob_reads: AtomicU64,
    bets_issued: AtomicU64,
    bets_used: AtomicU64,
    bet_bytes: AtomicU64,
    lookahead_reads: AtomicU64,
    lookahead_bytes: AtomicU64,
    lookahead_used: AtomicU64,
    lookahead_used_bytes: AtomicU64,
    lookahead_cancelled: AtomicU64,
    read_errors: AtomicU64,
}

/// The slots of one size class: their memory and where they start in the slot table.
struct ClassSlots {
    /// The slot memory: one arena, or several of `per_arena` slots each (the last may
    /// hold fewer) where the allocator caps one arena's bytes.
    arenas: Vec<Box<dyn SlotArena>>,
    per_arena: usize,
    first: u32,
    plan: SlotClass,
}

impl ClassSlots {
    /// Allocates `plan`'s slots with `allocator`, in as few arenas as its cap allows.
    fn allocate(allocator: &dyn SlotAllocator, plan: SlotClass, first: u32) -> Result<ClassSlots, RingError> {
        let cap = allocator.max_arena_bytes().map_or(plan.slots, |m| m / plan.stride);
        let per_arena = cap.clamp(1, plan.slots.max(1));
        let arenas = (0..plan.slots)
            .step_by(per_arena)
            .map(|s| {
                let n = per_arena.min(plan.slots - s);
                allocator.allocate(n, plan.stride).map_err(|source| RingError::Alloc {
                    slots: n,
                    bytes: plan.stride,
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ClassSlots { arenas, per_arena, first, plan })
    }

    fn range(&self) -> std::ops::Range<usize> {
        self.first as usize..self.first as usize + self.plan.slots
    }
}

/// Ring state shared by claimers and the streamer.
struct Shared {
    slots: Vec<Slot>,
    lookup: Vec<AtomicU32>,
    n_experts: usize,
    classes: Vec<ClassSlots>,
    /// The size class of each slot.
    slot_class: Vec<u8>,
    /// The size class of each decoder layer's experts (0 for layers without experts).
    layer_class: Vec<u8>,
    /// Payload bytes of one blob, per decoder layer (0 for layers without experts).
    blob_len: Vec<usize>,
    clock: AtomicU64,
    alloc: Mutex<()>,
    done: Mutex<()>,
    done_cv: Condvar,
    waiting_for_slot: AtomicU32,
    c: Counters,
}

impl Shared {
    fn index(&self, key: ExpertKey) -> usize {
        key.layer as usize * self.n_experts + key.expert as usize
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn lock_alloc(&self) -> MutexGuard<'_, ()> {
        self.alloc.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lock-free: takes a reference to the slot holding `key`, if any.
    fn try_ref(&self, key: ExpertKey) -> Option<u32> {
        let idx = self.lookup[self.index(key)].load(Ordering::Acquire);
        if idx == NO_SLOT {
            return None;
        }
        let slot = &self.slots[idx as usize];
        if !slot.try_ref() {
            return None;
        }
        if slot.key.load(Ordering::Acquire) != pack(key) || slot.state.load(Ordering::Acquire) == EMPTY {
            self.release_ref(idx);
            return None;
        }
        Some(idx)
    }

    fn release_ref(&self, idx: u32) {
        if self.slots[idx as usize].unref() == 0 && self.waiting_for_slot.load(Ordering::Acquire) > 0 {
            self.notify();
        }
    }

    fn notify(&self) {
        drop(self.done.lock().unwrap_or_else(|p| p.into_inner()));
        self.done_cv.notify_all();
    }

    /// The slot memory of `slot`: its class's arena at the slot's place in it.
    fn slot_mem(&self, slot: u32) -> (*mut u8, usize) {
        let c = &self.classes[self.slot_class[slot as usize] as usize];
        let i = (slot - c.first) as usize;
        let arena = &c.arenas[i / c.per_arena];
        let bytes = arena.slot_bytes();
        // SAFETY: `slot` lies in the class's range, so its arena holds slot
        // i % per_arena and the offset is inside it.
        (unsafe { arena.base().add(i % c.per_arena * bytes) }, bytes)
    }

    /// Under the allocation lock: among the slots of `key`'s size class, an EMPTY idle
    /// slot, else the least recently used idle READY/CONSUMED slot, marked RECYCLING.
    /// `None` when every slot of the class is referenced or loading. A read ahead
    /// (`lookahead`) spares, besides, the slots of its own layer and every unclaimed
    /// lookahead read.
    fn pick_victim(&self, _guard: &MutexGuard<'_, ()>, key: ExpertKey, lookahead: bool) -> Option<u32> {
        let range = self.classes[self.layer_class[key.layer as usize] as usize].range();
        loop {
            let mut best: Option<(u64, u32)> = None;
            for (i, s) in self.slots.iter().enumerate().skip(range.start).take(range.len()) {
                if s.refs.load(Ordering::Acquire) != 0 || (lookahead && self.spared_by_lookahead(s, key)) {
                    continue;
                }
                let st = s.state.load(Ordering::Acquire);
                let rank = match st {
                    EMPTY => 0,
                    READY | CONSUMED => s.tick.load(Ordering::Relaxed).max(1),
                    _ => continue,
                };
                if best.is_none_or(|(r, _)| rank < r) {
                    best = Some((rank, i as u32));
                    if rank == 0 {
                        break;
                    }
                }
            }
            let (_, i) = best?;
            if self.slots[i as usize].try_begin_recycle() {
                return Some(i);
            }
        }
    }

    /// Under the allocation lock, on a slot marked RECYCLING: evicts its old identity,
    /// gives it `key` in LOADING state with `refs` references and `origin`.
    fn assign(&self, _guard: &MutexGuard<'_, ()>, idx: u32, key: ExpertKey, refs: u32, origin: u8) {
        let slot = &self.slots[idx as usize];
        let old = slot.key.load(Ordering::Acquire);
        if old != NO_KEY {
            self.lookup[self.index(unpack(old))].store(NO_SLOT, Ordering::Release);
        }
        let evicted = slot.transition(READY, EMPTY) || slot.transition(CONSUMED, EMPTY);
        if evicted {
            self.c.evictions.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(RING_EVICTIONS).increment(1);
        }
        slot.key.store(pack(key), Ordering::Release);
        slot.failed_key.store(NO_KEY, Ordering::Release);
        slot.origin.store(origin, Ordering::Release);
        slot.tick.store(self.tick(), Ordering::Relaxed);
        let ok = slot.transition(EMPTY, LOADING);
        debug_assert!(ok, "a recycled slot must be EMPTY");
        self.lookup[self.index(key)].store(idx, Ordering::Release);
        slot.refs.store(refs, Ordering::Release);
    }

    /// The slot whose read of `key` failed while an announcement held it, with that
    /// announcement's pin taken over (the failed read left the lookup, so a claim or a
    /// withdrawal would otherwise miss the pin and its reference).
    fn failed_announcement(&self, key: ExpertKey) -> Option<u32> {
        let k = pack(key);
        let i = self.slots.iter().position(|s| s.failed_key.load(Ordering::Acquire) == k && s.take_pin())?;
        Some(i as u32)
    }

    /// Blocks until `idx` is no longer LOADING; returns the read's error if it failed.
    fn wait_loaded(&self, idx: u32) -> Result<(), VaultError> {
        let slot = &self.slots[idx as usize];
        if slot.state.load(Ordering::Acquire) == LOADING {
            let mut g = self.done.lock().unwrap_or_else(|p| p.into_inner());
            while slot.state.load(Ordering::Acquire) == LOADING {
                g = self.done_cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
        }
        if slot.state.load(Ordering::Acquire) == EMPTY {
            let err = slot.error.lock().unwrap_or_else(|p| p.into_inner()).take();
            return Err(err.unwrap_or_else(|| VaultError::Manifest {
                file: Default::default(),
                reason: "the read of this expert failed (reported to another claim)".into(),
            }));
        }
        Ok(())
    }
}

impl SlotOwner for Shared {
    fn slot_bytes(&self, slot: u32) -> &[u8] {
        let (ptr, len) = self.slot_mem(slot);
        // SAFETY: the caller holds a reference, so the slot is READY/CONSUMED and no
        // read writes into it; the arena outlives every handle (handles hold `Shared`).
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    fn release(&self, slot: u32) {
        self.release_ref(slot);
    }
}

impl LoadSink for Shared {
    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        self.slot_mem(slot).0
    }

    fn slot_len(&self, slot: u32) -> usize {
        self.slot_mem(slot).1
    }

    fn n_slots(&self) -> usize {
        self.slots.len()
    }

    fn complete(&self, req: ReadRequest, result: Result<(), VaultError>, latency: Duration) {
        let slot = &self.slots[req.slot as usize];
        metrics::histogram!(READ_LATENCY_SECONDS).record(latency.as_secs_f64());
        match result {
            Ok(()) => {
                let n = self.blob_len[req.key.layer as usize] as u64;
                self.c.bytes_read.fetch_add(n, Ordering::Relaxed);
                self.c.blob_reads.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(READ_BYTES).increment(n);
                metrics::counter!(BLOB_READS).increment(1);
                match slot.origin.load(Ordering::Acquire) {
                    ORIGIN_BET if req.priority == Priority::Speculative => {
                        self.c.bet_bytes.fetch_add(n, Ordering::Relaxed);
                    }
                    ORIGIN_LOOKAHEAD | ORIGIN_WASTED => {
                        self.c.lookahead_bytes.fetch_add(n, Ordering::Relaxed);
                        metrics::counter!(LOOKAHEAD_BYTES).increment(n);
                    }
                    _ => {}
                }
                slot.transition(LOADING, READY);
            }
            Err(e) => {
                tracing::error!("{e}");
                self.c.read_errors.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(READ_ERRORS).increment(1);
                *slot.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                let g = self.lock_alloc();
                self.lookup[self.index(req.key)].store(NO_SLOT, Ordering::Release);
                slot.failed_key.store(pack(req.key), Ordering::Release);
                slot.key.store(NO_KEY, Ordering::Release);
                slot.origin.store(ORIGIN_RETAINED, Ordering::Release);
                slot.transition(LOADING, EMPTY);
                drop(g);
            }
        }
        self.notify();
    }
}

/// Ring cache settings.
#[derive(Clone, Debug)]
pub struct RingOptions {
    /// The ring's size, split over the vault's slot size classes: at least one slot per
    /// class ([`RingError::NoSlots`] otherwise), at most all experts of the vault (more
    /// would never be used).
    pub size: RingSize,
    /// Streamer settings.
    pub streamer: StreamerOptions,
}

/// Why a ring cache could not start.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The slot memory could not be allocated.
    #[error("cannot allocate {slots} ring slots of {bytes} bytes: {source}; lower ring_slots / ring_bytes")]
    Alloc {
        /// Slots requested.
        slots: usize,
        /// Bytes per slot.
        bytes: usize,
        /// The allocator's error.
        source: std::io::Error,
    },
    /// The ring size leaves a size class without a slot (a byte budget below one expert
    /// blob of each class, or fewer slots than classes).
    #[error("{}", no_slots_message(*bytes, *classes))]
    NoSlots {
        /// Bytes of one slot of every class together.
        bytes: usize,
        /// Number of size classes (distinct blob strides).
        classes: usize,
    },
    /// The streamer could not start.
    #[error(transparent)]
    Streamer(#[from] StreamerError),
}

fn no_slots_message(bytes: usize, classes: usize) -> String {
    if classes == 1 {
        format!(
            "the ring must hold at least one expert, and one slot takes {bytes} bytes: set `ring_bytes` \
             (--ring-bytes) to at least that, or `ring_slots` (--ring-slots) to at least 1"
        )
    } else {
        format!(
            "the ring must hold at least one expert of each of the vault's {classes} slot sizes (one per blob \
             size), which takes {bytes} bytes: set `ring_bytes` (--ring-bytes) to at least that, or \
             `ring_slots` (--ring-slots) to at least {classes}"
        )
    }
}

/// The ring cache: an [`ExpertSource`] that retains experts in a fixed set of slots
/// and reads misses through the streamer.
pub struct RingCache {
    // Field order matters: the streamer (which writes into slot memory) stops first.
    streamer: Streamer,
    shared: Arc<Shared>,
}

impl RingCache {
    /// Allocates the slots with `allocator` and starts the streamer over `vault`.
    pub fn new(
        vault: Arc<Vault>,
        allocator: &dyn SlotAllocator,
        opts: &RingOptions,
    ) -> Result<RingCache, RingError> {
        let cfg = &vault.manifest().model;
        let plan = classes::plan_for(vault.manifest(), opts.size)?;
        let mut blob_len = vec![0; cfg.num_hidden_layers];
        for l in &vault.manifest().experts.layers {
            blob_len[l.layer] = l.layout.blob_len as usize;
        }
        let (mut class_slots, mut slot_class, mut layer_class) =
            (Vec::new(), Vec::new(), vec![0u8; cfg.num_hidden_layers]);
        for (ci, c) in plan.into_iter().enumerate() {
            for &l in &c.layers {
                layer_class[l] = ci as u8;
            }
            let first = slot_class.len() as u32;
            slot_class.extend(std::iter::repeat_n(ci as u8, c.slots));
            class_slots.push(ClassSlots::allocate(allocator, c, first)?);
        }
        let n = slot_class.len();
        let shared = Arc::new(Shared {
            slots: (0..n).map(|_| Slot::new()).collect(),
            lookup: (0..cfg.num_hidden_layers * cfg.num_experts).map(|_| AtomicU32::new(NO_SLOT)).collect(),
            n_experts: cfg.num_experts,
            classes: class_slots,
            slot_class,
            layer_class,
            blob_len,
            clock: AtomicU64::new(0),
            alloc: Mutex::new(()),
            done: Mutex::new(()),
            done_cv: Condvar::new(),
            waiting_for_slot: AtomicU32::new(0),
            c: Counters::default(),
        });
        let streamer = Streamer::start(vault, shared.clone(), &opts.streamer)?;
        let summary: Vec<String> = shared
            .classes
            .iter()
            .map(|c| match c.arenas.len() {
                1 => format!("{} slots × {} bytes", c.plan.slots, c.plan.stride),
                n => format!("{} slots × {} bytes in {n} allocations", c.plan.slots, c.plan.stride),
            })
            .collect();
        tracing::info!("ring: {}, I/O via {}", summary.join(" + "), streamer.mode().name());
        Ok(RingCache { streamer, shared })
    }

    /// The size classes: slot size, layers served and slots of each, largest slot first.
    pub fn classes(&self) -> Vec<SlotClass> {
        self.shared.classes.iter().map(|c| c.plan.clone()).collect()
    }

    /// Bytes of slot memory over every class.
    pub fn ring_bytes(&self) -> u64 {
        self.shared.classes.iter().map(|c| (c.plan.slots * c.plan.stride) as u64).sum()
    }

    /// For each decoder layer, the slots its experts can use (its class's slots; 0 for
    /// layers without experts): a MoE step never holds more of a layer's blobs at once.
    pub fn layer_slots(&self) -> Vec<usize> {
        let sh = &self.shared;
        let mut out = vec![0; sh.layer_class.len()];
        for c in &sh.classes {
            for &l in &c.plan.layers {
                out[l] = c.plan.slots;
            }
        }
        out
    }

    /// Number of slots.
    pub fn n_slots(&self) -> usize {
        self.shared.slots.len()
    }

    /// Bytes of slot memory resident in RAM now: slots are faulted in (and, on the
    /// io_uring path, registered) on their first read, so this grows from 0 at start-up
    /// to the whole ring as slots are used. 0 where the kernel cannot tell (e.g. a GPU
    /// driver's mapping).
    pub fn resident_bytes(&self) -> u64 {
        let classes = &self.shared.classes;
        classes
            .iter()
            .flat_map(|c| &c.arenas)
            .map(|a| memory::resident_bytes(a.base(), a.n_slots() * a.slot_bytes()))
            .sum()
    }

    /// The I/O path in use.
    pub fn io_mode(&self) -> IoMode {
        self.streamer.mode()
    }

    /// A snapshot of the counters, the slot states and the streamer's queues.
    pub fn stats(&self) -> RingSnapshot {
        let c = &self.shared.c;
        let mut slots = [0u64; 4];
        for s in &self.shared.slots {
            slots[s.state.load(Ordering::Relaxed) as usize] += 1;
        }
        let (demand, speculative) = self.streamer.queue_depths();
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RingSnapshot {
            hits: r(&c.hits),
            misses: r(&c.misses),
            evictions: r(&c.evictions),
            bytes_read: r(&c.bytes_read),
            blob_reads: r(&c.blob_reads),
            bets_issued: r(&c.bets_issued),
            bets_used: r(&c.bets_used),
            bet_bytes: r(&c.bet_bytes),
            lookahead_reads: r(&c.lookahead_reads),
            lookahead_bytes: r(&c.lookahead_bytes),
            lookahead_used: r(&c.lookahead_used),
            lookahead_used_bytes: r(&c.lookahead_used_bytes),
            lookahead_cancelled: r(&c.lookahead_cancelled),
            read_errors: r(&c.read_errors),
            read_busy_ns: self.streamer.busy_time().as_nanos() as u64,
            slots,
            io_queue_depth: [demand as u64, speculative as u64],
        }
    }

    /// Checks the ring's structural invariants: every identified slot is of its expert's
    /// size class and is the one its key maps to, no key maps to a slot with another identity (so no expert is in two
    /// slots and no slot has two identities), and, when `idle` (no handle or
    /// announcement alive), no references are held (reads may still be in flight).
    /// Returns a description of the first violation.
    pub fn check_invariants(&self, idle: bool) -> Result<(), String> {
        let sh = &self.shared;
        let _g = sh.lock_alloc();
        for (i, s) in sh.slots.iter().enumerate() {
            let key = s.key.load(Ordering::Acquire);
            let state = s.state.load(Ordering::Acquire);
            if key == NO_KEY {
                if state != EMPTY {
                    return Err(format!(
                        "slot {i} has no identity but state {}",
                        SLOT_STATES[state as usize]
                    ));
                }
                continue;
            }
            if sh.layer_class[unpack(key).layer as usize] != sh.slot_class[i] {
                return Err(format!(
                    "slot {i} holds {}, whose blobs belong to another size class",
                    unpack(key)
                ));
            }
            let mapped = sh.lookup[sh.index(unpack(key))].load(Ordering::Acquire);
            if mapped != i as u32 {
                return Err(format!(
                    "slot {i} holds {} but the lookup maps it to slot {mapped}",
                    unpack(key)
                ));
            }
            if idle && (s.refs.load(Ordering::Acquire) != 0 || s.pins.load(Ordering::Acquire) != 0) {
                return Err(format!("slot {i} still referenced while idle"));
            }
        }
        for (k, l) in sh.lookup.iter().enumerate() {
            let idx = l.load(Ordering::Acquire);
            if idx == NO_SLOT {
                continue;
            }
            let key = sh.slots[idx as usize].key.load(Ordering::Acquire);
            if key == NO_KEY || sh.index(unpack(key)) != k {
                return Err(format!("lookup entry {k} points at slot {idx}, which holds another expert"));
            }
        }
        Ok(())
    }

    /// Queues a low-priority read of `key` as a bet on the next token. Never evicts a
    /// referenced or loading slot and never reads an expert that is already present or
    /// on its way; returns whether a read was issued.
    pub fn bet(&self, key: ExpertKey) -> bool {
        let sh = &self.shared;
        if sh.lookup[sh.index(key)].load(Ordering::Acquire) != NO_SLOT {
            return false;
        }
        let g = sh.lock_alloc();
        if sh.lookup[sh.index(key)].load(Ordering::Acquire) != NO_SLOT {
            return false;
        }
        let Some(idx) = sh.pick_victim(&g, key, false) else { return false };
        sh.assign(&g, idx, key, 0, ORIGIN_BET);
        drop(g);
        sh.c.bets_issued.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(SPEC_BETS).increment(1);
        self.streamer.submit(ReadRequest { slot: idx, key, priority: Priority::Speculative });
        true
    }

    /// Finds or starts loading `key`, returning a slot with one reference taken for the
    /// caller; `None` if every slot is referenced or loading and `wait` is false.
    fn acquire(&self, key: ExpertKey, wait: bool) -> Option<u32> {
        let sh = &self.shared;
        loop {
            if let Some(idx) = sh.try_ref(key) {
                sh.slots[idx as usize].tick.store(sh.tick(), Ordering::Relaxed);
                if matches!(
                    sh.slots[idx as usize].origin.load(Ordering::Acquire),
                    ORIGIN_BET | ORIGIN_LOOKAHEAD
                ) {
                    self.streamer.promote(idx);
                }
                return Some(idx);
            }
            let g = sh.lock_alloc();
            if sh.lookup[sh.index(key)].load(Ordering::Acquire) != NO_SLOT {
                continue; // raced with another loader: take a reference to its slot
            }
            if let Some(idx) = sh.pick_victim(&g, key, false) {
                sh.assign(&g, idx, key, 1, ORIGIN_DEMAND);
                drop(g);
                self.streamer.submit(ReadRequest { slot: idx, key, priority: Priority::Demand });
                return Some(idx);
            }
            drop(g);
            if !wait {
                return None;
            }
            // Every slot is referenced or loading: wait for a release or a completion.
            sh.waiting_for_slot.fetch_add(1, Ordering::AcqRel);
            let guard = sh.done.lock().unwrap_or_else(|p| p.into_inner());
            let _ = sh.done_cv.wait_timeout(guard, Duration::from_millis(5));
            sh.waiting_for_slot.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl ExpertSource for RingCache {
    fn claim(&self, key: ExpertKey) -> Result<ExpertHandle, VaultError> {
        let sh = &self.shared;
        let idx = match sh.lookup.get(sh.index(key)).map(|l| l.load(Ordering::Acquire)) {
            None => return Err(VaultError::NoSuchExpert { layer: key.layer, expert: key.expert }),
            // An announcement already holds a reference for this claim: take it over.
            Some(i)
                if i != NO_SLOT
                    && sh.slots[i as usize].key.load(Ordering::Acquire) == pack(key)
                    && sh.slots[i as usize].take_pin() =>
            {
                i
            }
            Some(_) => match sh.failed_announcement(key) {
                Some(i) => i,
                None => self.acquire(key, true).expect("waiting acquire returns a slot"),
            },
        };
        if let Err(e) = sh.wait_loaded(idx) {
            sh.release_ref(idx);
            return Err(e);
        }
        let slot = &sh.slots[idx as usize];
        slot.transition(READY, CONSUMED);
        let info = match slot.origin.swap(ORIGIN_RETAINED, Ordering::AcqRel) {
            ORIGIN_DEMAND => {
                ClaimInfo { hit: false, bytes: sh.blob_len[key.layer as usize] as u64, bet_used: false }
            }
            ORIGIN_BET => ClaimInfo { hit: true, bytes: 0, bet_used: true },
            ORIGIN_LOOKAHEAD => {
                let n = sh.blob_len[key.layer as usize] as u64;
                sh.c.lookahead_used.fetch_add(1, Ordering::Relaxed);
                sh.c.lookahead_used_bytes.fetch_add(n, Ordering::Relaxed);
                metrics::counter!(LOOKAHEAD_USED).increment(1);
                metrics::counter!(LOOKAHEAD_USED_BYTES).increment(n);
                ClaimInfo { hit: true, bytes: 0, bet_used: false }
            }
            _ => ClaimInfo { hit: true, bytes: 0, bet_used: false },
        };
        if info.hit {
            sh.c.hits.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(RING_HITS).increment(1);
        } else {
            sh.c.misses.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(RING_MISSES).increment(1);
        }
        if info.bet_used {
            sh.c.bets_used.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(SPEC_BETS_USED).increment(1);
        }
        let owner: Arc<dyn SlotOwner> = sh.clone();
        Ok(ExpertHandle::new(owner, idx, key, sh.blob_len[key.layer as usize]).with_info(info))
    }

    fn announce(&self, key: ExpertKey) -> bool {
        let sh = &self.shared;
        if sh.index(key) >= sh.lookup.len() {
            return false;
        }
        match self.acquire(key, false) {
            Some(idx) => {
                sh.slots[idx as usize].pins.fetch_add(1, Ordering::AcqRel);
                true
            }
            None => false,
        }
    }

    fn prefetch(&self, key: ExpertKey) {
        self.bet(key);
    }

    fn lookahead(&self, key: ExpertKey) -> Lookahead {
        self.read_ahead(key)
    }

    fn withdraw_lookahead(&self, key: ExpertKey) {
        self.drop_lookahead(key);
    }

    fn withdraw(&self, key: ExpertKey) {
        let sh = &self.shared;
        let Some(idx) = sh.lookup.get(sh.index(key)).map(|l| l.load(Ordering::Acquire)) else { return };
        if idx != NO_SLOT && sh.slots[idx as usize].take_pin() {
            sh.release_ref(idx);
        } else if let Some(i) = sh.failed_announcement(key) {
            sh.release_ref(i);
        }
    }
}
