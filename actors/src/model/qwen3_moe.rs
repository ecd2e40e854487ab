//! Qwen3-MoE (and its dense-layer variants), top-down as the paper reads, over any
//! [`Backend`]: embed; per decoder layer, RMSNorm → attention (q/k/v projections,
//! per-head q/k RMSNorm and RoPE, causal attention over the cache, output projection
//! added to the residual) → RMSNorm → dense SwiGLU or the MoE step, added to the
//! residual; the final norm and LM head only where a token is emitted.

use crate::contract::{Backend, ForwardError, KvState, Plane, Write};
use crate::executor::moe::MoeStep;
use crate::model::{FfnRefs, LayerRefs, Model};

/// Runs `tokens` (at positions `kv.len()..`) through every layer, appending their keys
/// and values to `kv`; returns the last token's logits when `want_logits`. On failure
/// the backend's recorded work is abandoned and `kv` keeps its length.
pub fn forward<'b, B: Backend>(
    b: &'b mut B,
    moe: &mut MoeStep,
    model: &Model,
    kv: &mut B::Kv,
    tokens: &[u32],
    want_logits: bool,
) -> Result<Option<&'b [f32]>, ForwardError> {
    let start = kv.len();
    let m = tokens.len();
    let run = layers(b, moe, model, kv, tokens).and_then(|()| match want_logits {
        true => b.lm_head(&model.norm, &model.lm_head, m - 1),
        false => b.finish(),
    });
    if run.is_err() {
        b.abandon();
    }
    moe.end_pass();
    run?;
    debug_assert_eq!(kv.len(), start);
    kv.advance(m);
    Ok(want_logits.then(|| b.last_logits()))
}

/// Embedding and every decoder layer.
fn layers<B: Backend>(
    b: &mut B,
    moe: &mut MoeStep,
    model: &Model,
    kv: &mut B::Kv,
    tokens: &[u32],
) -> Result<(), ForwardError> {
    let (start, m) = (kv.len(), tokens.len());
    moe.begin_pass();
    b.embed(&model.embed, tokens)?;
    for (l, layer) in model.layers.iter().enumerate() {
        b.rmsnorm(&layer.input_norm, Plane::X, Plane::Xn, m)?;
        attention(b, l, layer, kv, start, m)?;
        b.rmsnorm(&layer.post_norm, Plane::X, Plane::Xn, m)?;
        match &layer.ffn {
            FfnRefs::Dense { gate, up, down } => {
                b.swiglu(gate, up, Plane::Xn, m)?;
                b.project(down, Plane::Hidden, Plane::X, m, Write::Add)?;
            }
            FfnRefs::Moe { router } => moe.run(b, l, router, start, m)?,
        }
    }
    Ok(())
}

/// Grouped-query attention with per-head q/k RMSNorm and RoPE; the output
/// projection is added to the residual stream.
fn attention<B: Backend>(
    b: &mut B,
    l: usize,
    layer: &LayerRefs,
    kv: &mut B::Kv,
    start: usize,
    m: usize,
) -> Result<(), ForwardError> {
    b.project(&layer.q, Plane::Xn, Plane::Q, m, Write::Set)?;
    b.project(&layer.k, Plane::Xn, Plane::K, m, Write::Set)?;
    b.project(&layer.v, Plane::Xn, Plane::V, m, Write::Set)?;
    b.qk_norm_rope(l, &layer.q_norm, &layer.k_norm, kv, start, m)?;
    b.attention(l, kv, start, m)?;
    b.project(&layer.o, Plane::Attn, Plane::X, m, Write::Add)
}
