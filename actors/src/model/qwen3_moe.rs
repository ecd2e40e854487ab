//! Qwen3-MoE (and its dense-layer variants), top-down as the paper reads, over any
//! [`Backend`]: embed; per decoder layer, RMSNorm → attention (q/k/v projections,
//! per-head q/k RMSNorm and RoPE, causal attention over the cache, output projection
//! added to the residual) → RMSNorm → dense SwiGLU or the MoE step, added to the
//! residual; the final norm and LM head only where a token is emitted
//! ([`super::forward`]).

use crate::contract::{Backend, ForwardError, Plane, Write};
use crate::executor::moe::MoeStep;
use crate::model::{AttentionRefs, FfnRefs, MixerRefs, Model};

/// Embedding and every decoder layer for `m` tokens at positions `start..`.
pub(super) fn layers<B: Backend>(
    b: &mut B,
    moe: &mut MoeStep,
    model: &Model,
    kv: &mut B::Kv,
    tokens: &[u32],
    start: usize,
) -> Result<(), ForwardError> {
    let m = tokens.len();
    b.embed(&model.embed, tokens)?;
    for (l, layer) in model.layers.iter().enumerate() {
        let MixerRefs::Attention(attn) = &layer.mixer else {
            return Err(ForwardError::Device(format!("layer {l} of a Qwen3-MoE model is not attention")));
        };
        b.rmsnorm(&layer.input_norm, Plane::X, Plane::Xn, m)?;
        attention(b, l, attn, kv, start, m)?;
        b.project(&attn.o, Plane::Attn, Plane::X, m, Write::Add)?;
        b.rmsnorm(&layer.post_norm, Plane::X, Plane::Xn, m)?;
        feed_forward(b, moe, l, &layer.ffn, start, m)?;
    }
    Ok(())
}

/// Grouped-query attention with per-head q/k RMSNorm and RoPE, into [`Plane::Attn`]
/// (before the output projection); a gated layer's output gate is projected alongside
/// q, k and v, into [`Plane::Gate`].
pub(super) fn attention<B: Backend>(
    b: &mut B,
    l: usize,
    attn: &AttentionRefs,
    kv: &mut B::Kv,
    start: usize,
    m: usize,
) -> Result<(), ForwardError> {
    b.project_group(&attn.input_projections(), Plane::Xn, m)?;
    b.qk_norm_rope(l, &attn.q_norm, &attn.k_norm, kv, start, m)?;
    b.attention(l, kv, start, m)
}

/// The dense SwiGLU MLP or the routed experts (the MoE step), added to the residual.
pub(super) fn feed_forward<B: Backend>(
    b: &mut B,
    moe: &mut MoeStep,
    l: usize,
    ffn: &FfnRefs,
    start: usize,
    m: usize,
) -> Result<(), ForwardError> {
    match ffn {
        FfnRefs::Dense { gate, up, down } => {
            b.swiglu(gate, up, Plane::Xn, m)?;
            b.project(down, Plane::Hidden, Plane::X, m, Write::Add)
        }
        FfnRefs::Moe { router, .. } => moe.run(b, l, router, start, m),
    }
}
