//! Following one job: its token events become text pieces (detokenized, cut at stop
//! strings) handed to a sink, then an outcome with the finish reason and usage. Shared by
//! streaming and non-streaming responses.

use smoe_proto::{FinishReason, JobEvent, JobFailure};
use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::stops::{Scan, StopMatcher};
use crate::tokenizer::Detokenizer;

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Tokens generated (up to and including the one that completed a stop string).
    pub completion_tokens: usize,
    /// Prompt tokens reused from a stored session.
    pub cached_tokens: usize,
}

impl Usage {
    /// The OpenAI `usage` object.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// How a job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Completed; `finish_reason` is `stop` or `length`.
    Done {
        /// OpenAI finish reason.
        finish_reason: &'static str,
        /// Token counts.
        usage: Usage,
    },
    /// The sink refused more text (the client went away).
    Abandoned,
    /// The job failed.
    Failed(ApiError),
}

/// Follows `events` to the end, passing text to `emit` (which returns false to give up).
pub async fn drive(
    mut events: UnboundedReceiver<JobEvent>,
    tok: &Tokenizer,
    stops: Vec<String>,
    mut emit: impl FnMut(String) -> bool,
) -> Outcome {
    let mut usage = Usage::default();
    let mut detok = Detokenizer::new(tok);
    let mut matcher = StopMatcher::new(stops);
    while let Some(ev) = events.recv().await {
        match ev {
            JobEvent::Started { prompt_tokens, cached_tokens } => {
                usage.prompt_tokens = prompt_tokens;
                usage.cached_tokens = cached_tokens;
            }
            JobEvent::Token(id) => {
                usage.completion_tokens += 1;
                let piece = match detok.push(id) {
                    Ok(p) => p,
                    Err(e) => return Outcome::Failed(ApiError::internal(format!("{e:#}"))),
                };
                match matcher.push(&piece) {
                    Scan::Emit(text) => {
                        if !text.is_empty() && !emit(text) {
                            return Outcome::Abandoned;
                        }
                    }
                    Scan::Stop(text) => {
                        if !text.is_empty() && !emit(text) {
                            return Outcome::Abandoned;
                        }
                        return Outcome::Done { finish_reason: "stop", usage };
                    }
                }
            }
            JobEvent::Finished { reason, .. } => {
                let rest = match detok.flush() {
                    Ok(r) => r,
                    Err(e) => return Outcome::Failed(ApiError::internal(format!("{e:#}"))),
                };
                let (mut text, stopped) = match matcher.push(&rest) {
                    Scan::Emit(t) => (t, false),
                    Scan::Stop(t) => (t, true),
                };
                if !stopped {
                    text.push_str(&matcher.finish());
                }
                if !text.is_empty() && !emit(text) {
                    return Outcome::Abandoned;
                }
                let finish_reason = match reason {
                    FinishReason::Length if !stopped => "length",
                    _ => "stop",
                };
                return Outcome::Done { finish_reason, usage };
            }
            JobEvent::Failed(f) => {
                return Outcome::Failed(match f {
                    JobFailure::Invalid(m) => ApiError::invalid("", m),
                    JobFailure::Internal(m) => ApiError::internal(m),
                    JobFailure::Cancelled => ApiError::shutting_down(),
                })
            }
        }
    }
    Outcome::Failed(ApiError::internal("the compute thread stopped before the request finished"))
}
