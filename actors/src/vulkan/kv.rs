//! The key/value cache on the device: per layer, f32 keys and values laid out
//! `[position][kv_head][head_dim]` as in the CPU cache, with the descriptor sets the
//! RoPE/append and attention kernels bind.

use std::sync::Arc;

use vulkano::buffer::Subbuffer;
use vulkano::descriptor_set::DescriptorSet;

/// One layer's cache buffers and the sets that bind them.
pub struct KvLayer {
    /// Set of the QK-norm/RoPE/append kernel (norm weights, RoPE tables, K, V).
    pub rope: Arc<DescriptorSet>,
    /// Set of the attention kernel (K, V).
    pub attn: Arc<DescriptorSet>,
    pub(super) _k: Subbuffer<[f32]>,
    pub(super) _v: Subbuffer<[f32]>,
}

/// A session's key/value cache in device memory. Clones share the device buffers (the
/// executor thread gets one for each block it runs).
#[derive(Clone)]
pub struct VulkanKvCache {
    /// Per decoder layer; `None` for DeltaNet layers (not yet run on Vulkan).
    pub(super) layers: Arc<Vec<Option<KvLayer>>>,
    pub(super) len: usize,
}

impl VulkanKvCache {
    pub(super) fn new(layers: Arc<Vec<Option<KvLayer>>>) -> Self {
        VulkanKvCache { layers, len: 0 }
    }
}

impl crate::contract::KvState for VulkanKvCache {
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) -> usize {
        self.len = self.len.min(len);
        self.len
    }
    fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
