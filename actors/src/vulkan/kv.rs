//! The key/value cache on the device: per attention layer, f32 keys and values laid out
//! `[position][kv_head][head_dim]` as in the CPU cache, with the descriptor sets the
//! RoPE/append and attention kernels bind; for hybrid models the DeltaNet states
//! ([`DeltaStates`]) and the book of what the cache can return to ([`StateBook`]).

use std::sync::Arc;

use vulkano::buffer::Subbuffer;
use vulkano::descriptor_set::DescriptorSet;

use super::delta::DeltaStates;
use crate::state_book::StateBook;

/// One layer's cache buffers and the sets that bind them.
pub struct KvLayer {
    /// Set of the QK-norm/RoPE/append kernel (norm weights, RoPE tables, K, V).
    pub rope: Arc<DescriptorSet>,
    /// Set of the attention kernels (K, V; the split and fused paths share its layout).
    pub attn: Arc<DescriptorSet>,
    pub(super) _k: Subbuffer<[f32]>,
    pub(super) _v: Subbuffer<[f32]>,
}

/// A session's cache in device memory. Clones share the device buffers (the executor
/// thread gets one for each block it runs, and records the state copies its book asks
/// for before the block).
#[derive(Clone)]
pub struct VulkanKvCache {
    /// Per decoder layer; `None` for DeltaNet layers.
    pub(super) layers: Arc<Vec<Option<KvLayer>>>,
    /// The DeltaNet states (hybrid models).
    pub(super) states: Option<Arc<DeltaStates>>,
    pub(super) book: StateBook,
}

impl VulkanKvCache {
    pub(super) fn new(
        layers: Arc<Vec<Option<KvLayer>>>,
        states: Option<Arc<DeltaStates>>,
        snapshots: usize,
    ) -> Self {
        let book = StateBook::new(states.is_some(), snapshots);
        VulkanKvCache { layers, states, book }
    }

    /// Bytes of device memory of the DeltaNet states (each snapshot takes as much again).
    pub fn state_bytes(&self) -> u64 {
        self.states.as_ref().map_or(0, |s| s.bytes())
    }
}

impl crate::contract::KvState for VulkanKvCache {
    fn len(&self) -> usize {
        self.book.len()
    }
    fn truncate(&mut self, len: usize) -> usize {
        self.book.truncate(len)
    }
    fn reusable(&self, len: usize) -> usize {
        self.book.reusable(len)
    }
    fn snapshot(&mut self) {
        self.book.snapshot();
    }
    fn advance(&mut self, n: usize) {
        self.book.advance(n);
    }
}
