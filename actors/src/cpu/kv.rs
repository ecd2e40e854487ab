//! The CPU backend's per-session cache in host memory: keys and values of every
//! attention layer, `[position][kv_head][head_dim]`, and for hybrid models each DeltaNet
//! layer's conv state (`[kernel − 1][channel]`, oldest input first) and recurrent state
//! (`[value head][key dim][value dim]`), with the snapshots of those states its
//! [`StateBook`] keeps (copied at once, on the host).

use crate::contract::KvState;
use crate::model::{MixerRefs, Model};
use crate::state_book::{StateBook, StateOp};

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
    /// The lengths the cache holds and can return to.
    pub(super) book: StateBook,
    /// Snapshot slots: every DeltaNet state concatenated in layer order (conv then
    /// recurrent), each allocated when first used.
    slots: Vec<Vec<f32>>,
}

impl KvCache {
    /// An empty cache able to hold `model.max_context` positions, keeping up to
    /// `model.state_snapshots` snapshots of its DeltaNet states.
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
        let rec = per_layer(0, rec);
        let recurrent = rec.iter().any(|r| !r.is_empty());
        let mut book = StateBook::new(recurrent, model.state_snapshots);
        // The states start zeroed.
        book.ops_done();
        KvCache {
            k: per_layer(n, 0),
            v: per_layer(n, 0),
            conv: per_layer(0, conv),
            rec,
            book,
            slots: vec![Vec::new(); model.state_snapshots],
        }
    }

    /// Every DeltaNet state, in snapshot order.
    fn states(&mut self) -> impl Iterator<Item = &mut Vec<f32>> {
        self.conv.iter_mut().zip(self.rec.iter_mut()).flat_map(|(c, r)| [c, r])
    }

    /// Carries out the copies the book queued.
    fn copy_states(&mut self) {
        for op in self.book.take_ops() {
            match op {
                StateOp::Zero => self.states().for_each(|s| s.fill(0.0)),
                StateOp::Save(i) => {
                    let mut slot = std::mem::take(&mut self.slots[i]);
                    slot.clear();
                    for s in self.states() {
                        slot.extend_from_slice(s);
                    }
                    self.slots[i] = slot;
                }
                StateOp::Load(i) => {
                    let slot = std::mem::take(&mut self.slots[i]);
                    let mut at = 0;
                    for s in self.states() {
                        let n = s.len();
                        s.copy_from_slice(&slot[at..at + n]);
                        at += n;
                    }
                    self.slots[i] = slot;
                }
            }
        }
    }
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        self.book.len()
    }
    fn reusable(&self, len: usize) -> usize {
        self.book.reusable(len)
    }
    fn truncate(&mut self, len: usize) -> usize {
        let kept = self.book.truncate(len);
        self.copy_states();
        kept
    }
    fn snapshot(&mut self) {
        self.book.snapshot();
        self.copy_states();
    }
    fn advance(&mut self, n: usize) {
        self.book.advance(n);
    }
}
