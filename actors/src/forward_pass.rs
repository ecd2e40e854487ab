//! What every backend's forward pass offers the generation loop and the scheduler: run
//! a block of tokens through all layers against a KV cache of its own kind, and report
//! the routing and claim accounting of what it ran.

use std::sync::Arc;

use crate::forward::{ClaimEvent, ClaimTally, Forward, ForwardError, KvCache};
use crate::model::Model;

/// A per-session KV cache that can be cut back to a prefix.
pub trait KvState: Send {
    /// Positions held.
    fn len(&self) -> usize;
    /// Whether no position is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Keeps only the first `len` positions.
    fn truncate(&mut self, len: usize);
}

/// A backend's forward pass (CPU reference or GPU executor).
pub trait ForwardPass: Send {
    /// The KV cache this pass runs against.
    type Kv: KvState;
    /// The model being run.
    fn model(&self) -> &Arc<Model>;
    /// Largest block of tokens one call accepts (the prefill chunk size).
    fn max_rows(&self) -> usize;
    /// A new, empty KV cache for one session.
    fn new_kv(&self) -> Result<Self::Kv, ForwardError>;
    /// Runs `tokens` at positions `kv.len()..`; returns the last token's logits when asked.
    fn forward(
        &mut self,
        kv: &mut Self::Kv,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError>;
    /// Union size per decoder layer in the last call (0 for dense layers).
    fn last_union_sizes(&self) -> &[usize];
    /// Claim accounting since creation.
    fn tally(&self) -> ClaimTally;
    /// Speculative prefetch depth for single-token steps.
    fn set_spec_depth(&mut self, depth: usize);
    /// Starts recording expert claims.
    fn enable_trace(&mut self);
    /// The claims recorded since the last call.
    fn take_trace(&mut self) -> Vec<ClaimEvent>;
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        KvCache::len(self)
    }
    fn truncate(&mut self, len: usize) {
        KvCache::truncate(self, len)
    }
}

impl ForwardPass for Forward {
    type Kv = KvCache;
    fn model(&self) -> &Arc<Model> {
        Forward::model(self)
    }
    fn max_rows(&self) -> usize {
        Forward::max_rows(self)
    }
    fn new_kv(&self) -> Result<KvCache, ForwardError> {
        Ok(KvCache::new(Forward::model(self)))
    }
    fn forward(
        &mut self,
        kv: &mut KvCache,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        Forward::forward(self, kv, tokens, want_logits)
    }
    fn last_union_sizes(&self) -> &[usize] {
        Forward::last_union_sizes(self)
    }
    fn tally(&self) -> ClaimTally {
        Forward::tally(self)
    }
    fn set_spec_depth(&mut self, depth: usize) {
        Forward::set_spec_depth(self, depth)
    }
    fn enable_trace(&mut self) {
        Forward::enable_trace(self)
    }
    fn take_trace(&mut self) -> Vec<ClaimEvent> {
        Forward::take_trace(self)
    }
}
