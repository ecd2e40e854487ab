//! What every request handler shares.

use kameo::actor::ActorRef;
use metrics_exporter_prometheus::PrometheusHandle;
use smoe_actors::sampler::SamplingParams;
use smoe_actors::scheduler::Scheduler;
use tokenizers::Tokenizer;

use super::chat_template::ChatTemplate;

/// The served model as `/v1/models` shows it.
pub struct ServedModel {
    /// Model id clients must send.
    pub id: String,
    /// Unix time the daemon started.
    pub created: u64,
    /// Longest sequence (prompt + completion).
    pub max_context: usize,
    /// Vocabulary size (token ids are below it).
    pub vocab: usize,
    /// A note shown to clients (the demo model says what it is).
    pub description: Option<String>,
}

/// Defaults for what a request leaves out.
pub struct RequestDefaults {
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Whether `sampling.seed` is fixed by the config (else each request draws one).
    pub fixed_seed: bool,
    /// Completion length.
    pub max_tokens: usize,
    /// Speculative prefetch depth during decode.
    pub spec_depth: usize,
}

/// Shared state of the HTTP server.
pub struct AppState {
    /// The scheduler actor.
    pub scheduler: ActorRef<Scheduler>,
    /// The vault's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
    /// The served model.
    pub model: ServedModel,
    /// Request defaults.
    pub defaults: RequestDefaults,
    /// Bearer token required on `/v1/*`, if any.
    pub api_key: Option<String>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
}
