//! What the executor reports about one generation job: how it ended, its timings and
//! claim accounting, and the events a job sends its requester. Plain data.

use std::time::Duration;

use crate::ClaimTally;

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
    /// Prompt tokens run through the model (the part not already in the KV cache).
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Time from the start until the first token was sampled.
    pub ttft: Duration,
    /// Time spent on the prompt tokens before the last one (the layer-major part).
    pub prefill_time: Duration,
    /// Time spent after the first token.
    pub decode_time: Duration,
    /// Expert claims up to the first token: every prompt token, the last one's step
    /// included, so exactly the steps timed by `ttft` (the chunks run before a stop when
    /// prefill was cancelled).
    pub prefill_claims: ClaimTally,
    /// Expert claims after the first token: exactly the [`Self::decode_tokens`] steps
    /// timed by `decode_time`.
    pub decode_claims: ClaimTally,
    /// For each prefill chunk, the union size of every MoE layer (in layer order).
    pub prefill_unions: Vec<Vec<usize>>,
}

impl GenerateStats {
    /// Tokens decoded after the first one (the first comes out of prefill).
    pub fn decode_tokens(&self) -> usize {
        self.generated_tokens.saturating_sub(1)
    }

    /// Decode throughput in tokens per second.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_tokens(), self.decode_time)
    }

    /// Prompt throughput in tokens per second, up to the first token.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prefill_tokens, self.ttft)
    }
}

fn rate(n: usize, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        n as f64 / t.as_secs_f64()
    }
}

/// What a job reports, in order: `Started`, `Token`s, then `Finished` or `Failed`.
#[derive(Debug)]
pub enum JobEvent {
    /// The job reached the compute thread.
    Started {
        /// Prompt length.
        prompt_tokens: usize,
        /// Prompt tokens reused from a stored session (not prefilled).
        cached_tokens: usize,
    },
    /// A generated token.
    Token(u32),
    /// Generation ended normally (`Stopped` when the receiver went away).
    Finished {
        /// Why it ended.
        reason: FinishReason,
        /// Counts and timings.
        stats: GenerateStats,
    },
    /// Generation could not run or was cut short.
    Failed(JobFailure),
}

/// Why a job failed.
#[derive(Debug, PartialEq, Eq)]
pub enum JobFailure {
    /// The request is invalid for this engine (context too long, token out of
    /// vocabulary, empty prompt).
    Invalid(String),
    /// The engine failed (read error, internal fault).
    Internal(String),
    /// The server cancelled it (shutdown).
    Cancelled,
}
