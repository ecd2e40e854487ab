//! Lookahead: reads, while a prefill block's layer computes, experts that the next MoE
//! layer is predicted to route to, into ring slots no claim needs now, so that the disk
//! keeps working between two layers' reads. A lookahead read is speculative (it queues
//! behind every demand read), never evicts a referenced or loading slot, a slot of its
//! own layer or another unclaimed lookahead read, and is withdrawn once its layer is
//! routed without it: still queued, it is dropped unread; read already, its slot becomes
//! the first to be evicted. It never changes what a claim returns.

use std::sync::atomic::Ordering;

use smoe_proto::{ExpertKey, Lookahead, Priority, ReadRequest};

use super::slots::*;
use super::{RingCache, Shared, NO_SLOT};

impl Shared {
    /// Whether a lookahead read of `key` must leave idle slot `s` alone: it holds an
    /// expert of `key`'s own layer (the layer the read is for) or an unclaimed
    /// lookahead read.
    pub(super) fn spared_by_lookahead(&self, s: &Slot, key: ExpertKey) -> bool {
        let held = s.key.load(Ordering::Acquire);
        (held != NO_KEY && unpack(held).layer == key.layer)
            || s.origin.load(Ordering::Acquire) == ORIGIN_LOOKAHEAD
    }
}

impl RingCache {
    /// Queues a speculative read of `key` ahead of its layer's routing, into a slot that
    /// [`Shared::pick_victim`] may take for it.
    pub(super) fn read_ahead(&self, key: ExpertKey) -> Lookahead {
        let sh = &self.shared;
        let Some(entry) = sh.lookup.get(sh.index(key)) else { return Lookahead::Refused };
        if entry.load(Ordering::Acquire) != NO_SLOT {
            return Lookahead::Resident;
        }
        let g = sh.lock_alloc();
        if entry.load(Ordering::Acquire) != NO_SLOT {
            return Lookahead::Resident;
        }
        let Some(idx) = sh.pick_victim(&g, key, true) else { return Lookahead::Refused };
        sh.assign(&g, idx, key, 0, ORIGIN_LOOKAHEAD);
        drop(g);
        sh.c.lookahead_reads.fetch_add(1, Ordering::Relaxed);
        self.streamer.submit(ReadRequest { slot: idx, key, priority: Priority::Speculative });
        Lookahead::Queued
    }

    /// Withdraws the lookahead read of `key` (its layer was routed without it, or the
    /// pass ended first). A read still queued is dropped and its slot emptied; one in
    /// flight or done stays, marked wasted and first in line for eviction. Nothing
    /// happens when `key` is not an unclaimed lookahead read, or when a claim or an
    /// announcement holds its slot.
    pub(super) fn drop_lookahead(&self, key: ExpertKey) {
        let sh = &self.shared;
        let Some(entry) = sh.lookup.get(sh.index(key)) else { return };
        let g = sh.lock_alloc();
        let idx = entry.load(Ordering::Acquire);
        if idx == NO_SLOT {
            return;
        }
        let slot = &sh.slots[idx as usize];
        if slot.origin.load(Ordering::Acquire) != ORIGIN_LOOKAHEAD || !slot.try_begin_recycle() {
            return;
        }
        // RECYCLING is set: no claim can take a reference until it is cleared.
        if slot.state.load(Ordering::Acquire) == LOADING && self.streamer.cancel(idx) {
            entry.store(NO_SLOT, Ordering::Release);
            slot.key.store(NO_KEY, Ordering::Release);
            slot.origin.store(ORIGIN_RETAINED, Ordering::Release);
            slot.tick.store(0, Ordering::Relaxed);
            slot.transition(LOADING, EMPTY);
            sh.c.lookahead_reads.fetch_sub(1, Ordering::Relaxed);
            sh.c.lookahead_cancelled.fetch_add(1, Ordering::Relaxed);
        } else {
            slot.origin.store(ORIGIN_WASTED, Ordering::Release);
            slot.tick.store(0, Ordering::Relaxed);
        }
        slot.refs.store(0, Ordering::Release);
        drop(g);
    }
}
