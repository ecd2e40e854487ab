//! One generation request end to end: prefill the prompt, then decode token by token,
//! sampling each next token and handing it (with its logits) to the caller.

use std::time::{Duration, Instant};

use crate::forward::{Forward, ForwardError, KvCache};
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
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-sequence token was generated.
    Eos,
    /// The caller asked to stop.
    Stopped,
}

/// Timings and counts of one request.
#[derive(Clone, Debug, Default)]
pub struct GenerateStats {
    /// Prompt tokens run through the model.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Time from the start until the first token was sampled.
    pub ttft: Duration,
    /// Time spent after the first token.
    pub decode_time: Duration,
}

impl GenerateStats {
    /// Tokens decoded after the first one (the first comes out of prefill).
    pub fn decode_tokens(&self) -> usize {
        self.generated_tokens.saturating_sub(1)
    }

    /// Decode throughput in tokens per second.
    pub fn decode_tok_s(&self) -> f64 {
        let s = self.decode_time.as_secs_f64();
        if s > 0.0 {
            self.decode_tokens() as f64 / s
        } else {
            0.0
        }
    }
}

/// Runs `req`. `kv` may already hold a prefix of `req.prompt` (prefix reuse: its
/// positions must be exactly `prompt[..kv.len()]`, and `kv.len() < prompt.len()`); only
/// the rest of the prompt is prefilled. `on_token(id, logits)` is called for every
/// generated token, with the logits that produced it; returning `false` stops
/// generation.
pub fn generate(
    fwd: &mut Forward,
    kv: &mut KvCache,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32, &[f32]) -> bool,
) -> Result<(FinishReason, GenerateStats), ForwardError> {
    let start = Instant::now();
    let vocab = fwd.model().cfg.vocab_size;
    if let Some(&id) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ForwardError::TokenOutOfVocab { id, vocab });
    }
    assert!(kv.len() < req.prompt.len(), "the KV cache must hold a strict prefix of the prompt");
    let needed = req.prompt.len() + req.max_tokens.saturating_sub(1);
    if needed > fwd.model().max_context {
        return Err(ForwardError::ContextFull { needed, max: fwd.model().max_context });
    }
    let eos = fwd.model().cfg.eos_token_ids.clone();
    let mut sampler = Sampler::new(req.sampling.clone(), vocab);
    let mut history = req.prompt.clone();
    let mut stats = GenerateStats { prefill_tokens: req.prompt.len() - kv.len(), ..Default::default() };
    let (last, body) = req.prompt.split_last().expect("non-empty prompt");
    for &t in &body[kv.len()..] {
        fwd.forward(kv, &[t], false)?;
    }
    let mut next = *last;
    let mut first_at = None;
    let reason = loop {
        if stats.generated_tokens == req.max_tokens {
            break FinishReason::Length;
        }
        let logits = fwd.forward(kv, &[next], true)?.expect("logits requested");
        let tok = sampler.sample(logits, &history);
        stats.generated_tokens += 1;
        if first_at.is_none() {
            first_at = Some(Instant::now());
            stats.ttft = start.elapsed();
        }
        history.push(tok);
        if !on_token(tok, logits) {
            break FinishReason::Stopped;
        }
        if !req.ignore_eos && eos.contains(&tok) {
            break FinishReason::Eos;
        }
        next = tok;
    };
    stats.decode_time = first_at.map(|t| t.elapsed()).unwrap_or_default();
    Ok((reason, stats))
}
