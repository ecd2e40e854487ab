//! Which lengths a session's cache can return to: the bookkeeping of DeltaNet state
//! snapshots, one type for both backends. A recurrent state cannot be cut back, so a
//! cache holding one keeps copies of its states at earlier lengths (at the end of prefill
//! chunks) and returns to the longest one within a shorter prefix, or to nothing. The
//! book decides which copies to take, keep and load; the backend only carries out the
//! [`StateOp`]s it queues, on the host at once (CPU) or on the device before the
//! session's next block (Vulkan).

/// Snapshots a session keeps by default (the `state_snapshots` setting).
pub const DEFAULT_STATE_SNAPSHOTS: usize = 4;

/// Fewest positions between two snapshots (a token-serial prefill would otherwise copy
/// the states after every token).
pub const SNAPSHOT_SPACING: usize = 16;

/// A copy the backend makes of a session's DeltaNet states (every layer's conv and
/// recurrent state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateOp {
    /// Clear the states (a new or restarted session).
    Zero,
    /// Copy the states into snapshot slot `i`.
    Save(usize),
    /// Copy snapshot slot `i` back into the states.
    Load(usize),
}

/// The lengths a session's cache holds and can return to, and the state copies that
/// carry them out. A cache without recurrent state cuts anywhere and keeps no snapshot;
/// one with it keeps at most `capacity` snapshots, the newest, at least
/// [`SNAPSHOT_SPACING`] positions apart, in slots `0..capacity`.
#[derive(Clone, Debug)]
pub struct StateBook {
    recurrent: bool,
    capacity: usize,
    len: usize,
    /// A pass is changing the states in place: they may be ahead of `len`.
    changing: bool,
    /// (length, slot) of each snapshot.
    snaps: Vec<(usize, usize)>,
    /// Copies not yet carried out, in order.
    ops: Vec<StateOp>,
}

impl StateBook {
    /// An empty cache's book, keeping up to `capacity` snapshots; one with recurrent
    /// state starts by clearing it.
    pub fn new(recurrent: bool, capacity: usize) -> Self {
        let ops = if recurrent { vec![StateOp::Zero] } else { Vec::new() };
        StateBook { recurrent, capacity, len: 0, changing: false, snaps: Vec::new(), ops }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions [`StateBook::truncate`]`(len)` would keep: `len` or all the cache holds
    /// where it can cut anywhere or keeps its live states, else the longest snapshot at or
    /// below `len` (0 without one).
    pub fn reusable(&self, len: usize) -> usize {
        if !self.recurrent || (len >= self.len && !self.changing) {
            return self.len.min(len);
        }
        self.snaps.iter().map(|s| s.0).filter(|&l| l <= len).max().unwrap_or(0)
    }

    /// Cuts back to at most `len` positions (to a snapshot, or to nothing, with recurrent
    /// state: later snapshots are dropped and a [`StateOp::Load`] or [`StateOp::Zero`]
    /// queued); returns the positions kept.
    pub fn truncate(&mut self, len: usize) -> usize {
        let keep = self.reusable(len);
        if self.recurrent && (keep < self.len || self.changing) {
            self.snaps.retain(|s| s.0 <= keep);
            let op = match self.snaps.iter().find(|s| s.0 == keep) {
                Some(&(_, slot)) => StateOp::Load(slot),
                None => StateOp::Zero,
            };
            self.ops.push(op);
            self.changing = false;
        }
        self.len = keep;
        self.len
    }

    /// Keeps the states at the current length, as [`crate::contract::KvState::snapshot`]
    /// says: queues a [`StateOp::Save`] into a free slot, or (all taken) the oldest
    /// snapshot's.
    pub fn snapshot(&mut self) {
        let len = self.len;
        let near = self.snaps.iter().any(|s| s.0 + SNAPSHOT_SPACING > len);
        if !self.recurrent || self.changing || self.capacity == 0 || len == 0 || near {
            return;
        }
        let slot = if self.snaps.len() < self.capacity {
            (0..self.capacity).find(|i| self.snaps.iter().all(|s| s.1 != *i)).expect("a free slot")
        } else {
            let oldest = (0..self.snaps.len()).min_by_key(|&i| self.snaps[i].0).expect("full");
            self.snaps.swap_remove(oldest).1
        };
        self.ops.push(StateOp::Save(slot));
        self.snaps.push((len, slot));
    }

    /// Records that a pass is changing the states in place (a failed pass leaves them
    /// ahead of the length, so [`StateBook::truncate`] must return to a snapshot).
    pub fn states_changing(&mut self) {
        self.changing = true;
    }

    /// Records that `n` more positions were filled.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
        self.changing = false;
    }

    /// The copies not yet carried out, in order.
    pub fn ops(&self) -> &[StateOp] {
        &self.ops
    }

    /// Takes the copies to carry out now (a backend that copies at once).
    pub fn take_ops(&mut self) -> Vec<StateOp> {
        std::mem::take(&mut self.ops)
    }

    /// Records that the queued copies were carried out.
    pub fn ops_done(&mut self) {
        self.ops.clear();
    }

    /// The states and every snapshot may be lost or half-written (a failed device
    /// submission): the cache starts over, empty, with no reusable prefix, rather than
    /// ever resuming from a corrupt copy. Returns the snapshots forgotten.
    pub fn forget(&mut self) -> usize {
        let lost = self.snaps.len();
        self.snaps.clear();
        self.ops.clear();
        if self.recurrent {
            self.ops.push(StateOp::Zero);
            self.len = 0;
        }
        self.changing = false;
        lost
    }

    /// Snapshots kept.
    pub fn snapshots(&self) -> usize {
        self.snaps.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A book of `cap` snapshots that ran blocks of `chunk` up to `len`, snapshotting
    /// after each, its copies carried out.
    fn ran(cap: usize, chunk: usize, len: usize) -> StateBook {
        let mut b = StateBook::new(true, cap);
        assert_eq!(b.take_ops(), [StateOp::Zero]);
        while b.len() < len {
            b.advance(chunk.min(len - b.len()));
            b.snapshot();
        }
        b.ops_done();
        b
    }

    #[test]
    fn snapshots_are_spaced_and_the_oldest_makes_room() {
        let mut b = StateBook::new(true, 2);
        b.take_ops();
        let mut saves = Vec::new();
        for _ in 0..8 {
            b.advance(8);
            b.snapshot();
            saves.extend(b.take_ops());
        }
        // At 8, 24 (16 on is too near 8), 40 (into 8's slot), 56 (into 24's slot).
        assert_eq!(saves, [StateOp::Save(0), StateOp::Save(1), StateOp::Save(0), StateOp::Save(1)]);
        assert_eq!((b.snapshots(), b.reusable(50), b.reusable(39)), (2, 40, 0));
    }

    #[test]
    fn truncate_returns_to_the_longest_snapshot_within_the_prefix() {
        let mut b = ran(4, 8, 64);
        // Snapshots at 8, 24, 40, 56; live state at 64.
        assert_eq!((b.reusable(70), b.reusable(64), b.reusable(63), b.reusable(23)), (64, 64, 56, 8));
        assert_eq!(b.truncate(45), 40);
        assert_eq!(b.take_ops(), [StateOp::Load(2)]);
        assert_eq!((b.snapshots(), b.reusable(60)), (3, 40));
        assert_eq!(b.truncate(7), 0);
        assert_eq!(b.take_ops(), [StateOp::Zero]);
        assert_eq!(b.snapshots(), 0);
    }

    #[test]
    fn a_failed_pass_returns_to_a_snapshot_and_forget_to_nothing() {
        let mut b = ran(4, 8, 30);
        b.states_changing();
        // The states ran ahead of 30: not even 30 itself is reusable.
        assert_eq!(b.reusable(30), 24);
        b.snapshot();
        assert!(b.ops().is_empty(), "no snapshot of states in flux");
        assert_eq!(b.truncate(30), 24);
        assert_eq!(b.take_ops(), [StateOp::Load(1)]);
        assert_eq!(b.forget(), 2);
        assert_eq!((b.len(), b.reusable(30), b.ops()), (0, 0, &[StateOp::Zero][..]));
    }

    #[test]
    fn without_recurrent_state_or_slots_nothing_is_kept() {
        let mut b = StateBook::new(false, 4);
        assert!(b.ops().is_empty());
        b.advance(40);
        b.snapshot();
        assert_eq!((b.truncate(13), b.ops()), (13, &[][..]));
        let mut b = ran(0, 8, 40);
        assert_eq!((b.snapshots(), b.reusable(39), b.truncate(39)), (0, 0, 0));
    }
}
