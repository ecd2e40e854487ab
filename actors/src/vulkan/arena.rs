//! The activation arena: one device buffer holding every activation plane of the
//! largest block, plus the backend's own regions (router logits, per-pair expert
//! outputs, logits), at fixed offsets.

use crate::contract::Plane;
use crate::model::Model;

use super::attention::AttentionShape;
use super::record::argmax_floats;
use super::VulkanError;

/// Offsets (f32 elements) of the regions of the activation arena, and each plane's row
/// width.
#[derive(Clone, Copy, Debug)]
pub struct Arena {
    planes: [(u32, u32); 12],
    /// Router logits, `rows × experts`.
    pub router: u32,
    /// Each token's ranking (`route.comp`), rows of [`Arena::routed_stride`]: as many
    /// rows as a block has tokens or the model has layers (a device-routed decode step
    /// keeps every layer's).
    pub routed: u32,
    /// Elements per row of `routed`: ranked experts (up to one per expert), top-k
    /// weights, a device-routed step's miss count, and whether its fused front gave up
    /// at its grid barrier (in the host's readback copy).
    pub routed_stride: u32,
    /// Per-(token, rank) expert outputs, `rows · k × hidden`.
    pub yk: u32,
    /// Logits of one row.
    pub logits: u32,
    /// The attention kernels' chunk partials (see [`AttentionShape::partial_floats`]).
    pub attn_partials: u32,
    /// The greedy choice's block pairs (see [`argmax_floats`]).
    pub argmax: u32,
    /// Elements in all.
    pub len: u32,
}

impl Arena {
    /// The layout for blocks of up to `m` tokens of `model`.
    pub fn new(model: &Model, m: usize) -> Result<Arena, VulkanError> {
        let c = &model.cfg;
        let k = c.num_experts_per_tok.max(1);
        let width = |p: Plane| p.width(c);
        // The hidden region also holds every pair's expert intermediate at once.
        let size = |p: Plane| match p {
            Plane::Hidden => (m * width(p)).max(m * k * c.moe_intermediate_size),
            p => m * width(p),
        };
        let mut off = 0u64;
        let mut take = |n: usize| {
            let at = off;
            off = (off + n as u64).next_multiple_of(16);
            at as u32
        };
        let mut planes = [(0, 0); 12];
        for p in Plane::ALL {
            planes[p as usize] = (take(size(p)), width(p) as u32);
        }
        let router = take(m * c.num_experts);
        let routed_stride = c.num_experts + k + 2;
        let routed = take(m.max(c.num_hidden_layers) * routed_stride);
        let yk = take(m * k * c.hidden_size);
        let logits = take(c.vocab_size);
        let attn_partials = take(AttentionShape::of(c).partial_floats(m, model.max_context));
        let argmax = take(argmax_floats(c.vocab_size));
        if off > u32::MAX as u64 / 2 {
            return Err(VulkanError::Unsupported(format!(
                "activations for {m} rows need {off} floats; lower the chunk size"
            )));
        }
        Ok(Arena {
            planes,
            router,
            routed,
            routed_stride: routed_stride as u32,
            yk,
            logits,
            attn_partials,
            argmax,
            len: off as u32,
        })
    }

    /// Elements of the `routed` rows of a block of `rows` tokens.
    pub fn routed_len(&self, rows: usize) -> usize {
        rows * self.routed_stride as usize
    }

    /// Offset of plane `p`'s row 0.
    pub fn at(&self, p: Plane) -> u32 {
        self.planes[p as usize].0
    }

    /// Elements per row of plane `p`.
    pub fn width(&self, p: Plane) -> u32 {
        self.planes[p as usize].1
    }
}
