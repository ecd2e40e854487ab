//! One generation request end to end: prefill the prompt layer-major in chunks, then
//! decode token by token, sampling each next token and handing it (with its logits)
//! to the caller.
//!
//! Prefill runs every prompt token except the last through [`ForwardPass::forward`] in
//! blocks of up to `max_rows` tokens (the chunk size; 1 is token-serial replay). The
//! last prompt token goes through the ordinary decode step, so the LM head and the
//! sampler run only where a token is emitted. The cache may keep its states at the end of
//! each chunk ([`KvState::snapshot`]) for later prefix reuse.

use std::time::Instant;

use smoe_proto::{FinishReason, GenerateStats};

use crate::contract::{ForwardError, ForwardPass, KvState};
use crate::sampler::{Sampler, SamplingParams};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Gate ranks beyond top-k queued as speculative prefetches during decode.
    pub spec_depth: usize,
    /// Hand each generated token's logits to the caller. Without it, a plain greedy
    /// request ([`Sampler::is_plain_greedy`]) takes each token's greedy choice from the
    /// pass ([`ForwardPass::forward_greedy`]) and the caller gets empty logits.
    pub logits: bool,
}

/// Runs `req`. `kv` may already hold a prefix of `req.prompt` (prefix reuse: its
/// positions must be exactly `prompt[..kv.len()]`, and `kv.len() < prompt.len()`); only
/// the rest of the prompt is prefilled, in chunks of `fwd.max_rows()` tokens.
/// `cancelled()` is asked before every prefill chunk: when it says yes, generation stops
/// there with [`FinishReason::Stopped`] (`kv` keeps the chunks already run, a valid
/// prefix of the prompt). `on_token(id, logits)` is called for every generated token,
/// with the logits that produced it (empty where `req.logits` is off and the pass chose
/// the greedy token itself); returning `false` stops generation.
pub fn generate<P: ForwardPass>(
    fwd: &mut P,
    kv: &mut P::Kv,
    req: &GenerateRequest,
    cancelled: impl Fn() -> bool,
    mut on_token: impl FnMut(u32, &[f32]) -> bool,
) -> Result<(FinishReason, GenerateStats), ForwardError> {
    let start = Instant::now();
    let vocab = fwd.model().cfg.vocab_size;
    fwd.model().check_tokens(&req.prompt)?;
    assert!(kv.len() < req.prompt.len(), "the KV cache must hold a strict prefix of the prompt");
    fwd.model().check_context(req.prompt.len() + req.max_tokens.saturating_sub(1))?;
    let eos = fwd.model().cfg.eos_token_ids.clone();
    let moe_layers = fwd.model().cfg.moe_layers();
    let mut sampler = Sampler::new(req.sampling.clone(), vocab);
    let mut history = req.prompt.clone();
    let cached = kv.len();
    let mut stats = GenerateStats { prefill_tokens: req.prompt.len() - cached, ..Default::default() };
    let (last, body) = req.prompt.split_last().expect("non-empty prompt");
    let before = fwd.tally();
    fwd.set_spec_depth(0);
    let chunk = fwd.max_rows();
    let mut stopped = false;
    for block in body[kv.len()..].chunks(chunk) {
        stopped = cancelled();
        if stopped {
            break;
        }
        fwd.forward(kv, block, false)?;
        kv.snapshot();
        let sizes = fwd.last_union_sizes();
        stats.prefill_unions.push(moe_layers.iter().map(|&l| sizes[l]).collect());
    }
    stats.prefill_time = start.elapsed();
    if stopped {
        stats.prefill_claims = fwd.tally().since(&before);
        stats.prefill_tokens = kv.len() - cached;
        return Ok((FinishReason::Stopped, stats));
    }
    fwd.set_spec_depth(req.spec_depth);
    let mut next = *last;
    let greedy = !req.logits && sampler.is_plain_greedy();
    // When the first token was sampled, and the claims up to then.
    let mut first = None;
    let reason = loop {
        if stats.generated_tokens == req.max_tokens {
            break FinishReason::Length;
        }
        let (tok, logits) = if greedy {
            (fwd.forward_greedy(kv, &[next])?, &[][..])
        } else {
            let logits = fwd.forward(kv, &[next], true)?.expect("logits requested");
            (sampler.sample(logits, &history), logits)
        };
        let sampled_at = Instant::now();
        let wanted = on_token(tok, logits);
        stats.generated_tokens += 1;
        if first.is_none() {
            stats.ttft = sampled_at - start;
            first = Some((sampled_at, fwd.tally()));
        }
        history.push(tok);
        if !wanted {
            break FinishReason::Stopped;
        }
        if !req.ignore_eos && eos.contains(&tok) {
            break FinishReason::Eos;
        }
        next = tok;
    };
    fwd.set_spec_depth(0);
    let end = fwd.tally();
    match &first {
        Some((at, tally)) => {
            stats.decode_time = at.elapsed();
            stats.prefill_claims = tally.since(&before);
            stats.decode_claims = end.since(tally);
        }
        None => stats.prefill_claims = end.since(&before),
    }
    Ok((reason, stats))
}
