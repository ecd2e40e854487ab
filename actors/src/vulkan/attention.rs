//! Causal GQA attention on the device (`shaders/attention.comp`): one canonical
//! split-softmax form (chunks of [`CHUNK`] positions aligned to absolute positions, each
//! chunk's max, exponentials, sum and weighted values in position order, the chunks
//! merged in chunk order) computed two ways that give every row the same bytes:
//!
//! - the **split** path (small blocks: decode): one workgroup per (chunk, row tile, KV
//!   head) writes each chunk's partials to the arena's partials region, then one
//!   workgroup per (head, token) merges them;
//! - the **fused** path (layer-major prefill): one workgroup per (row tile, KV head) runs
//!   the chunks of its rows in order and merges each as it goes.
//!
//! A row tile holds up to [`MAX_TILE_ROWS`] (token, query head) rows of one KV head, so
//! each staged K/V slice serves the group's query heads and several tokens (the split
//! path's tiles hold one token's group: [`AttentionShape::split_rows`]).

use std::sync::{Arc, Mutex};

use vulkano::descriptor_set::layout::DescriptorSetLayout;
use vulkano::descriptor_set::DescriptorSet;
use vulkano::device::Device;

use super::pipelines::{kernel, Kernel, Spec};
use super::record::Recorder;
use super::VulkanError;

/// Positions per softmax chunk (`CH` in `shaders/attention.comp`): part of the arithmetic.
pub const CHUNK: usize = 64;

/// Largest head_dim the kernels take (`MAX_HD`); it must also be a multiple of 4.
pub const MAX_HEAD_DIM: usize = 256;

/// Most rows of a tile (`MAX_ROWS`).
pub const MAX_TILE_ROWS: usize = 32;

/// Blocks of at most this many tokens take the split path. The partials region holds
/// `min(max_rows, SPLIT_TOKENS) · heads · ⌈max_context / CHUNK⌉` records of
/// `head_dim + 4` floats ([`AttentionShape::partial_floats`]), allocated once with the
/// arena: 8.25 MiB for one token of Qwen3-30B-A3B's 32 heads of 128 at a 32768-position
/// context, 130 MiB for Qwen3.5's 32 heads of 256 at 262144 positions.
pub const SPLIT_TOKENS: usize = 1;

/// The attention kernels.
pub struct AttentionKernels {
    /// Layer-major prefill: each workgroup runs its rows' chunks in order.
    pub fused: Kernel,
    /// Decode: merges a row's partials in chunk order.
    pub combine: Kernel,
    /// Decode: one workgroup per chunk writes the chunk's partials; built per attention
    /// shape ([`AttentionKernels::split_for`]).
    split: Mutex<Vec<(AttentionShape, Arc<Kernel>)>>,
    device: Arc<Device>,
    act: Arc<DescriptorSetLayout>,
}

impl AttentionKernels {
    /// Builds the pipelines on `device` with the activation set layout `act` (the split
    /// kernel when a shape first asks for it).
    pub(super) fn new(device: &Arc<Device>, act: &Arc<DescriptorSetLayout>) -> Result<Self, VulkanError> {
        Ok(AttentionKernels {
            fused: kernel(device, act, "attention", None)?,
            combine: kernel(device, act, "attention_combine", None)?,
            split: Mutex::new(Vec::new()),
            device: device.clone(),
            act: act.clone(),
        })
    }

    /// The split kernel specialised to `shape` (`shaders/attention.comp`'s `HD`, `GQ`,
    /// `SR`, `PR`: head_dim, query heads per KV head, score and PV rows per invocation of
    /// a [`AttentionShape::split_rows`] tile), built on first use; a backend asks for its
    /// model's shape when it starts, so no decode step waits for the driver's compiler.
    pub fn split_for(&self, shape: AttentionShape) -> Result<Arc<Kernel>, VulkanError> {
        shape.check()?;
        let mut built = self.split.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = built.iter().find(|(s, _)| *s == shape) {
            return Ok(k.clone());
        }
        let rows = shape.split_rows();
        let spec = [
            shape.head_dim,
            shape.heads / shape.kv_heads,
            rows.div_ceil(4),
            rows.div_ceil(shape.pv_pass_rows()),
        ];
        let spec = Spec::Attention(spec.map(|v| v as u32));
        let k = Arc::new(kernel(&self.device, &self.act, "attention_split", Some(spec))?);
        built.push((shape, k.clone()));
        Ok(k)
    }
}

/// Heads and head size of a model's attention layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Floats per head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// The shape of `c`'s attention layers.
    pub fn of(c: &smoe_proto::ModelConfig) -> Self {
        AttentionShape { heads: c.num_attention_heads, kv_heads: c.num_key_value_heads, head_dim: c.head_dim }
    }

    /// Checks that the kernels take this shape.
    pub fn check(&self) -> Result<(), VulkanError> {
        let s = self;
        if s.head_dim == 0 || s.head_dim > MAX_HEAD_DIM || !s.head_dim.is_multiple_of(4) {
            return Err(VulkanError::Unsupported(format!(
                "head_dim {} (the attention kernels take multiples of 4 up to {MAX_HEAD_DIM})",
                s.head_dim
            )));
        }
        if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return Err(VulkanError::Unsupported(format!(
                "{} query heads over {} KV heads",
                s.heads, s.kv_heads
            )));
        }
        Ok(())
    }

    /// Rows one pass of the PV step covers: its 256 invocations take 4 dims of a row each.
    fn pv_pass_rows(&self) -> usize {
        256 / (self.head_dim / 4)
    }

    /// Rows per tile: the PV step gives each invocation 4 rows of 4 dims.
    pub fn tile_rows(&self) -> usize {
        MAX_TILE_ROWS.min(4 * self.pv_pass_rows())
    }

    /// Rows per tile of the split path: one token's query heads (at most a full tile), so
    /// a decode step's tile has no empty rows and the split kernel is specialised to them.
    pub fn split_rows(&self) -> usize {
        self.tile_rows().min(self.heads / self.kv_heads)
    }

    /// Chunk records per row in the partials region for a `max_context` cache.
    pub fn partial_chunks(max_context: usize) -> usize {
        max_context.div_ceil(CHUNK)
    }

    /// Floats of the partials region for blocks of up to `max_rows` tokens and a
    /// `max_context` cache (0 when no block takes the split path).
    pub fn partial_floats(&self, max_rows: usize, max_context: usize) -> usize {
        max_rows.min(SPLIT_TOKENS) * self.heads * Self::partial_chunks(max_context) * (self.head_dim + 4)
    }
}

/// One attention dispatch: `tokens` rows of queries at activation offset `q_off` (token t
/// at position `start + t`, rows of `heads · head_dim`), outputs at `out_off`, the cache
/// bound in the set given to [`AttentionArgs::record`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs {
    /// The heads.
    pub shape: AttentionShape,
    /// Activation offset of token 0's queries (a multiple of 4).
    pub q_off: u32,
    /// Activation offset of token 0's output (a multiple of 4).
    pub out_off: u32,
    /// Position of token 0 (checked against the partials region; the kernels read it
    /// from the routing buffer's word `pos_word`, which the caller writes before the
    /// dispatch runs, so a recording does not depend on it).
    pub start: u32,
    /// Routing-buffer word holding the position.
    pub pos_word: u32,
    /// Tokens.
    pub tokens: u32,
    /// Activation offset of the partials region (a multiple of 4).
    pub part_off: u32,
    /// Chunk records per row in the partials region ([`AttentionShape::partial_chunks`]).
    pub part_chunks: u32,
}

impl AttentionArgs {
    /// Whether the default path for this block is the split one.
    pub fn split_by_default(&self) -> bool {
        self.tokens as usize <= SPLIT_TOKENS
    }

    /// Records the attention of the block with the cache `set` (K, V): the split path
    /// (`split`; the partials region must hold `tokens` rows) or the fused one; both give
    /// the same bytes.
    pub fn record(
        &self,
        rec: &mut Recorder,
        k: &AttentionKernels,
        set: Arc<DescriptorSet>,
        split: bool,
    ) -> Result<(), VulkanError> {
        let s = self.shape;
        s.check()?;
        if !(self.q_off | self.out_off | self.part_off).is_multiple_of(4) {
            return Err(VulkanError::Vulkan("attention offsets must be multiples of 4 floats".into()));
        }
        let rows = if split { s.split_rows() } else { s.tile_rows() } as u32;
        let group = (s.heads / s.kv_heads) as u32;
        let tiles = (self.tokens * group).div_ceil(rows);
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let push = [
            s.head_dim as u32,
            s.heads as u32,
            s.kv_heads as u32,
            self.q_off,
            self.out_off,
            self.pos_word,
            scale.to_bits(),
            self.tokens,
            rows,
            self.part_off,
            self.part_chunks,
        ];
        if !split {
            return rec.dispatch(&k.fused, Some(set), push, [1, tiles, s.kv_heads as u32]);
        }
        let chunks = (self.start + self.tokens).div_ceil(CHUNK as u32);
        if chunks > self.part_chunks {
            return Err(VulkanError::Vulkan(format!(
                "attention over {chunks} chunks with room for {} partials",
                self.part_chunks
            )));
        }
        // A workgroup per chunk the cache can hold (those past the block's positions
        // return at once): the dispatch does not depend on the position.
        rec.dispatch(&*k.split_for(s)?, Some(set), push, [self.part_chunks, tiles, s.kv_heads as u32])?;
        rec.dispatch(&k.combine, None, push, [s.heads as u32, self.tokens, 1])
    }
}
