//! The CPU backend's per-session cache in host memory: keys and values of every
//! attention layer, `[position][kv_head][head_dim]`, and for hybrid models each DeltaNet
//! layer's conv state (`[kernel − 1][channel]`, oldest input first) and recurrent state
//! (`[value head][key dim][value dim]`).

use crate::contract::KvState;
use crate::model::{MixerRefs, Model};

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
            len: 0,
        }
    }

    /// Whether the cache holds recurrent state (which cannot be cut back).
    fn recurrent(&self) -> bool {
        self.rec.iter().any(|r| !r.is_empty())
    }
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) -> usize {
        if !self.recurrent() {
            self.len = self.len.min(len);
        } else if len < self.len || self.dirty {
            // No state of an earlier position is kept: start over.
            self.conv.iter_mut().chain(self.rec.iter_mut()).for_each(|s| s.fill(0.0));
            self.len = 0;
            self.dirty = false;
        }
        self.len
    }
    fn advance(&mut self, n: usize) {
        self.len += n;
        self.dirty = false;
    }
}
