//! The hybrid family — Qwen3-Next and Qwen3.5-MoE — top-down over any [`Backend`]:
//! embed; per decoder layer, zero-centred RMSNorm → gated attention (every fourth layer,
//! typically) or gated DeltaNet (the others) → residual → RMSNorm → routed experts plus
//! the gated shared expert → residual; the final norm and LM head only where a token is
//! emitted ([`super::forward`]). The vault holds the zero-centred norms as `1 + w`, so
//! they run as plain RMSNorms.
//!
//! A DeltaNet layer keeps a conv state and a recurrent state per session instead of keys
//! and values. A block of many tokens runs through it row by row in the single-token
//! step's own order, so layer-major prefill is byte-identical to token-serial replay.

use crate::contract::{Backend, ForwardError, Plane, Write};
use crate::executor::moe::MoeStep;
use crate::model::{qwen3_moe, AttentionRefs, DeltaNetRefs, FfnRefs, MixerRefs, Model, SharedExpertRefs};

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
        b.rmsnorm(&layer.input_norm, Plane::X, Plane::Xn, m)?;
        match &layer.mixer {
            MixerRefs::Attention(attn) => gated_attention(b, l, attn, kv, start, m)?,
            MixerRefs::DeltaNet(dn) => gated_delta_net(b, l, dn, kv, m)?,
        }
        b.rmsnorm(&layer.post_norm, Plane::X, Plane::Xn, m)?;
        qwen3_moe::feed_forward(b, moe, l, &layer.ffn, start, m)?;
        if let FfnRefs::Moe { shared: Some(shared), .. } = &layer.ffn {
            shared_expert(b, shared, m)?;
        }
    }
    Ok(())
}

/// Attention whose output is gated, head dim by head dim, by `σ(output_gate · x)` before
/// the output projection (added to the residual).
fn gated_attention<B: Backend>(
    b: &mut B,
    l: usize,
    attn: &AttentionRefs,
    kv: &mut B::Kv,
    start: usize,
    m: usize,
) -> Result<(), ForwardError> {
    qwen3_moe::attention(b, l, attn, kv, start, m)?;
    if attn.output_gate.is_some() {
        b.sigmoid_mul(Plane::Attn, Plane::Gate, m)?;
    }
    b.project(&attn.o, Plane::Attn, Plane::X, m, Write::Add)
}

/// Gated DeltaNet: the input projection, the causal convolution and SiLU over
/// `q | k | v`, the gated delta rule over the recurrent state, the gated RMSNorm with
/// `z`, and the output projection (added to the residual).
fn gated_delta_net<B: Backend>(
    b: &mut B,
    l: usize,
    dn: &DeltaNetRefs,
    kv: &mut B::Kv,
    m: usize,
) -> Result<(), ForwardError> {
    b.project(&dn.in_proj, Plane::Xn, Plane::Lin, m, Write::Set)?;
    b.conv1d(l, &dn.conv, kv, m)?;
    b.delta_rule(l, &dn.a_log, &dn.dt_bias, kv, m)?;
    b.gated_rmsnorm(&dn.norm, m)?;
    b.project(&dn.out_proj, Plane::Core, Plane::X, m, Write::Add)
}

/// The shared expert every token runs, scaled by `σ(shared_expert_gate · x)` and added
/// to the residual (after the routed experts).
fn shared_expert<B: Backend>(b: &mut B, s: &SharedExpertRefs, m: usize) -> Result<(), ForwardError> {
    b.swiglu(&s.gate, &s.up, Plane::Xn, m)?;
    b.project(&s.down, Plane::Hidden, Plane::Shared, m, Write::Set)?;
    b.project(&s.gate_logit, Plane::Xn, Plane::SharedGate, m, Write::Set)?;
    b.gated_add(Plane::Shared, Plane::SharedGate, m)
}
