//! The CPU backend's per-session cache: keys and values of every attention layer in
//! host memory, `[position][kv_head][head_dim]`.

use crate::contract::KvState;
use crate::model::Model;

/// Per-session key/value cache: `[position][kv_head][head_dim]` per layer.
pub struct KvCache {
    pub(super) k: Vec<Vec<f32>>,
    pub(super) v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// An empty cache able to hold `model.max_context` positions.
    pub fn new(model: &Model) -> Self {
        let n = model.max_context * model.cfg.kv_dim();
        let layers = model.cfg.num_hidden_layers;
        KvCache {
            k: (0..layers).map(|_| vec![0.0; n]).collect(),
            v: (0..layers).map(|_| vec![0.0; n]).collect(),
            len: 0,
        }
    }
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
