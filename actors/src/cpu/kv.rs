//! The CPU backend's per-session cache in host memory: keys and values of every
//! attention layer, `[position][kv_head][head_dim]`, and for hybrid models each DeltaNet
//! layer's conv state (`[kernel − 1][channel]`, oldest input first) and recurrent state
//! (`[value head][key dim][value dim]`), with up to [`STATE_SNAPSHOTS`] copies of those
//! states at earlier lengths to return to.

use crate::contract::{KvState, SNAPSHOT_SPACING, STATE_SNAPSHOTS};
use crate::model::{MixerRefs, Model};

/// The DeltaNet states at one length: every layer's conv state then recurrent state,
/// concatenated in layer order.
struct Snapshot {
    len: usize,
    states: Vec<f32>,
}

/// Per-session cache of one model.
pub struct KvCache {
    /// Keys per layer (empty for DeltaNet layers).
    pub(super) k: Vec<Vec<f32>>,
    /// Values per layer (empty for DeltaNet layers).
    pub(super) v: Vec<Vec<f32>>,
    /// Conv state per layer (empty for attention layers).
    pub(super) conv: Vec<Vec<f32>>,
    /// Recurrent state per layer (empty for attention layers).
    pub(super) rec: Vec<Vec<f32>>,
    /// Whether a pass changed the states since the last [`KvState::advance`] (a failed
    /// pass leaves them ahead of `len`).
    pub(super) dirty: bool,
    snapshots: Vec<Snapshot>,
    len: usize,
}

impl KvCache {
    /// An empty cache able to hold `model.max_context` positions.
    pub fn new(model: &Model) -> Self {
        let c = &model.cfg;
        let n = model.max_context * c.kv_dim();
        let (conv, rec) = c.hybrid.as_ref().map_or((0, 0), |h| (h.conv_state_len(), h.recurrent_state_len()));
        let per_layer = |attn: usize, linear: usize| -> Vec<Vec<f32>> {
            let size = |m: &MixerRefs| match m {
                MixerRefs::Attention(_) => attn,
                MixerRefs::DeltaNet(_) => linear,
            };
            model.layers.iter().map(|l| vec![0.0; size(&l.mixer)]).collect()
        };
        KvCache {
            k: per_layer(n, 0),
            v: per_layer(n, 0),
            conv: per_layer(0, conv),
            rec: per_layer(0, rec),
            dirty: false,
            snapshots: Vec::new(),
            len: 0,
        }
    }

    /// Whether the cache holds recurrent state (which cannot be cut back).
    fn recurrent(&self) -> bool {
        self.rec.iter().any(|r| !r.is_empty())
    }

    /// Every DeltaNet state, in snapshot order.
    fn states(&mut self) -> impl Iterator<Item = &mut Vec<f32>> {
        self.conv.iter_mut().zip(self.rec.iter_mut()).flat_map(|(c, r)| [c, r])
    }

    /// Returns the states to the snapshot of length `len` (0: the empty states).
    fn restore(&mut self, len: usize) {
        let mut snaps = std::mem::take(&mut self.snapshots);
        snaps.retain(|s| s.len <= len);
        match snaps.iter().find(|s| s.len == len) {
            Some(snap) => {
                let mut at = 0;
                for s in self.states() {
                    let n = s.len();
                    s.copy_from_slice(&snap.states[at..at + n]);
                    at += n;
                }
            }
            None => self.states().for_each(|s| s.fill(0.0)),
        }
        self.snapshots = snaps;
        self.len = len;
        self.dirty = false;
    }
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        self.len
    }
    fn reusable(&self, len: usize) -> usize {
        if !self.recurrent() || (len >= self.len && !self.dirty) {
            return self.len.min(len);
        }
        self.snapshots.iter().map(|s| s.len).filter(|&l| l <= len).max().unwrap_or(0)
    }
    fn truncate(&mut self, len: usize) -> usize {
        let keep = self.reusable(len);
        if !self.recurrent() {
            self.len = keep;
        } else if keep < self.len || self.dirty {
            self.restore(keep);
        }
        self.len
    }
    fn snapshot(&mut self) {
        let len = self.len;
        if !self.recurrent() || self.dirty || len == 0 {
            return;
        }
        if self.snapshots.iter().any(|s| s.len + SNAPSHOT_SPACING > len) {
            return;
        }
        let mut snap = match self.snapshots.len() < STATE_SNAPSHOTS {
            true => Snapshot { len, states: Vec::new() },
            // Full: the oldest gives its buffer.
            false => {
                let oldest = (0..self.snapshots.len()).min_by_key(|&i| self.snapshots[i].len).expect("full");
                self.snapshots.swap_remove(oldest)
            }
        };
        snap.len = len;
        snap.states.clear();
        for s in self.states() {
            snap.states.extend_from_slice(s);
        }
        self.snapshots.push(snap);
    }
    fn advance(&mut self, n: usize) {
        self.len += n;
        self.dirty = false;
    }
}
