//! `POST /v1/completions` and `POST /v1/chat/completions`: read the body, check the
//! request and build the prompt (on the blocking pool, see [`Admission`]), admit a job
//! into the scheduler, and answer with one JSON object or a stream of server-sent events
//! ending in `data: [DONE]`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kameo::error::SendError;
use serde_json::{json, Value};
use smoe_actors::generation::GenerateRequest;
use smoe_actors::scheduler::{Job, Submit, SubmitError};
use tokenizers::Tokenizer;
use tokio::sync::mpsc;

use super::admission::Admission;
use super::chat_template::ChatTemplate;
use super::drive::{drive, Outcome, Usage};
use super::error::ApiError;
use super::prompt_bound::PromptBound;
use super::request::{parse_body, Endpoint, PromptInput};
use super::state::{AppState, RequestDefaults, ServedModel};

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(st): State<Arc<AppState>>,
    Extension(adm): Extension<Arc<Admission>>,
    body: Body,
) -> Response {
    complete(st, adm, body, Endpoint::Chat).await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub async fn text(
    State(st): State<Arc<AppState>>,
    Extension(adm): Extension<Arc<Admission>>,
    body: Body,
) -> Response {
    complete(st, adm, body, Endpoint::Completions).await.unwrap_or_else(IntoResponse::into_response)
}

/// What checking a request and building its prompt needs.
pub struct Intake<'a> {
    /// The served model (id, context, vocabulary).
    pub model: &'a ServedModel,
    /// The vault's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The chat template.
    pub template: &'a ChatTemplate,
    /// Request defaults.
    pub defaults: &'a RequestDefaults,
    /// Bytes-to-tokens bound of the tokenizer.
    pub bound: &'a PromptBound,
}

impl<'a> Intake<'a> {
    /// The intake of a running server.
    fn of(st: &'a AppState, adm: &'a Admission) -> Intake<'a> {
        Intake {
            model: &st.model,
            tokenizer: &st.tokenizer,
            template: &st.template,
            defaults: &st.defaults,
            bound: &adm.bound,
        }
    }
}

/// A checked request, ready to run.
pub struct Plan {
    request: GenerateRequest,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
}

async fn complete(
    st: Arc<AppState>,
    adm: Arc<Admission>,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    adm.vault_ok()?;
    let body = adm.read_body(body).await?;
    let plan = {
        let (st, work_adm) = (st.clone(), adm.clone());
        adm.off_runtime(move || plan(&Intake::of(&st, &work_adm), &body, endpoint)).await??
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let Plan { request, stops, stream, include_usage } = plan;
    match st.scheduler.ask(Submit(Job { request, events: tx })).await {
        Ok(()) => {}
        Err(SendError::HandlerError(SubmitError::QueueFull { retry_after })) => {
            return Err(ApiError::queue_full(retry_after))
        }
        Err(SendError::HandlerError(SubmitError::ShuttingDown)) => return Err(ApiError::shutting_down()),
        Err(_) => return Err(ApiError::shutting_down()),
    }
    let shape = Shape::new(endpoint, &st.model.id);
    if stream {
        return Ok(stream_response(st, rx, stops, shape, include_usage));
    }
    let mut text = String::new();
    let outcome = drive(rx, &st.tokenizer, stops, |piece| {
        text.push_str(&piece);
        true
    })
    .await;
    match outcome {
        Outcome::Done { finish_reason, usage } => {
            Ok(Json(shape.whole(&text, finish_reason, usage)).into_response())
        }
        Outcome::Failed(e) => Err(e),
        Outcome::Abandoned => Err(ApiError::internal("the response was abandoned")),
    }
}

/// Parses `body` and checks it against the endpoint, the model and the context (by the
/// prompt's byte length first, then by its tokens), and builds the job. CPU-bound: runs
/// on the blocking pool.
pub fn plan(st: &Intake, body: &[u8], endpoint: Endpoint) -> Result<Plan, ApiError> {
    let b = parse_body(body)?;
    b.check_endpoint(endpoint)?;
    if b.model != st.model.id {
        return Err(ApiError::unknown_model(&b.model, &st.model.id));
    }
    let encode = |text: &str, special: bool| {
        st.bound.check(text.len(), st.model.max_context).map_err(ApiError::context_exceeded)?;
        st.tokenizer
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ApiError::internal(format!("cannot tokenize the prompt: {e}")))
    };
    let (prompt, param) = match endpoint {
        Endpoint::Chat => {
            let text =
                st.template.render(&b.chat_messages()?).map_err(|m| ApiError::invalid("messages", m))?;
            (encode(&text, false)?, "messages")
        }
        Endpoint::Completions => match b.prompt_input()? {
            PromptInput::Text(s) => (encode(&s, true)?, "prompt"),
            PromptInput::Ids(ids) => (ids, "prompt"),
        },
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(param, "the prompt is empty (it has no tokens)"));
    }
    if let Some(id) = prompt.iter().find(|&&t| t as usize >= st.model.vocab) {
        return Err(ApiError::invalid(
            param,
            format!("token id {id} is out of the vocabulary (ids 0..{})", st.model.vocab - 1),
        ));
    }
    // Generating n tokens needs prompt + n - 1 positions (the last token is never fed).
    let ctx = st.model.max_context;
    if prompt.len() > ctx {
        return Err(ApiError::context_exceeded(format!(
            "this model's maximum context length is {ctx} tokens, but the prompt has {} tokens",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len() + 1;
    let max_tokens = match b.max_tokens()? {
        Some(n) if n > room => {
            return Err(ApiError::context_exceeded(format!(
            "this model's maximum context length is {ctx} tokens, but {} prompt tokens plus max_tokens {n} \
                 need {}; lower max_tokens to at most {room} or shorten the prompt",
            prompt.len(),
            prompt.len() + n - 1
        )))
        }
        Some(n) => n,
        None => st.defaults.max_tokens.min(room),
    };
    let mut sampling = st.defaults.sampling.clone();
    if let Some(t) = b.temperature {
        sampling.temperature = t;
    }
    if let Some(p) = b.top_p {
        sampling.top_p = p;
    }
    if let Some(k) = b.top_k {
        // -1 means off, as in vLLM.
        sampling.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            _ => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be >= 0 (or -1 for off), got {k}"),
                ))
            }
        };
    }
    if let Some(r) = b.repetition_penalty {
        sampling.repetition_penalty = r;
    }
    sampling.seed = match b.seed {
        Some(s) => s as u64,
        None if st.defaults.fixed_seed => sampling.seed,
        None => rand::random(),
    };
    sampling.validate().map_err(|m| {
        let param = m.split_whitespace().next().unwrap_or_default().to_string();
        ApiError::invalid(&param, m)
    })?;
    Ok(Plan {
        request: GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            ignore_eos: b.ignore_eos.unwrap_or(false),
            spec_depth: st.defaults.spec_depth,
            logits: false,
        },
        stops: b.stops()?,
        stream: b.stream.unwrap_or(false),
        include_usage: b.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
    })
}

/// Streams `events` as server-sent events. A client that goes away drops the stream; the
/// task notices at once (even while the job is queued or prefilling and sends nothing)
/// and drops the job's channel, which takes the job out of the queue or stops it at the
/// next prefill chunk or token.
fn stream_response(
    st: Arc<AppState>,
    events: mpsc::UnboundedReceiver<smoe_proto::JobEvent>,
    stops: Vec<String>,
    shape: Shape,
    include_usage: bool,
) -> Response {
    let (out, out_rx) = mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        let send = |v: Value| out.send(Event::default().data(v.to_string())).is_ok();
        if shape.endpoint == Endpoint::Chat
            && !send(shape.chunk(json!({"role": "assistant", "content": ""}), None))
        {
            return;
        }
        let outcome = tokio::select! {
            o = drive(events, &st.tokenizer, stops, |piece| send(shape.piece(&piece))) => o,
            _ = out.closed() => Outcome::Abandoned,
        };
        match outcome {
            Outcome::Done { finish_reason, usage } => {
                let last = match shape.endpoint {
                    Endpoint::Chat => shape.chunk(json!({}), Some(finish_reason)),
                    Endpoint::Completions => shape.text_chunk("", Some(finish_reason)),
                };
                send(last);
                if include_usage {
                    send(shape.usage_chunk(usage));
                }
            }
            Outcome::Abandoned => return,
            Outcome::Failed(e) => {
                send(e.body());
            }
        }
        let _ = out.send(Event::default().data("[DONE]"));
    });
    let body = futures_util::stream::unfold(out_rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}

/// The JSON shapes of one response.
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Shape {
    fn new(endpoint: Endpoint, model: &str) -> Shape {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        Shape {
            endpoint,
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            model: model.to_string(),
        }
    }

    /// The non-streaming response.
    fn whole(&self, text: &str, finish_reason: &str, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason})
            }
        };
        json!({
            "id": self.id,
            "object": match self.endpoint { Endpoint::Chat => "chat.completion", Endpoint::Completions => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.json(),
        })
    }

    /// A streamed piece of text.
    fn piece(&self, text: &str) -> Value {
        match self.endpoint {
            Endpoint::Chat => self.chunk(json!({"content": text}), None),
            Endpoint::Completions => self.text_chunk(text, None),
        }
    }

    /// A chat chunk with `delta`.
    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }

    /// A completions chunk.
    fn text_chunk(&self, text: &str, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason}],
        })
    }

    /// The final chunk carrying `usage` (with `stream_options.include_usage`).
    fn usage_chunk(&self, usage: Usage) -> Value {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage.json(),
        })
    }
}
