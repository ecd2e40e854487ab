//! Request bodies of `/v1/completions` and `/v1/chat/completions`, and their checks:
//! every parameter is either honoured, or refused with a 400 that names it. Unknown
//! parameters are refused too, so a client never silently gets something it did not ask
//! for.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;

/// The body of either endpoint (one struct, so unknown fields can be refused; which
/// fields belong to which endpoint is checked by [`GenerationBody::check_endpoint`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationBody {
    /// Model id.
    pub model: String,
    /// Chat messages (chat endpoint).
    pub messages: Option<Vec<ChatMessage>>,
    /// Prompt: a string or an array of token ids (completions endpoint).
    pub prompt: Option<Value>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Newer name of `max_tokens` (chat).
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Nucleus threshold.
    pub top_p: Option<f32>,
    /// Extension: keep the K most likely tokens.
    pub top_k: Option<i64>,
    /// Extension: HuggingFace-style repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Sampler seed.
    pub seed: Option<i64>,
    /// Stop strings: a string or an array of strings.
    pub stop: Option<Value>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices (only 1).
    pub n: Option<i64>,
    /// Refused unless 0 (use `repetition_penalty`).
    pub presence_penalty: Option<f32>,
    /// Refused unless 0 (use `repetition_penalty`).
    pub frequency_penalty: Option<f32>,
    /// Refused unless off.
    pub logprobs: Option<Value>,
    /// Refused unless off.
    pub top_logprobs: Option<Value>,
    /// Refused unless empty.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Completions: refused if true.
    pub echo: Option<bool>,
    /// Completions: refused unless empty.
    pub suffix: Option<String>,
    /// Completions: refused unless 1.
    pub best_of: Option<i64>,
    /// Refused unless `{"type": "text"}`.
    pub response_format: Option<Value>,
    /// Refused unless empty.
    pub tools: Option<Vec<Value>>,
    /// Refused unless `none` or `auto`.
    pub tool_choice: Option<Value>,
    /// Accepted and ignored (no tools).
    #[serde(rename = "parallel_tool_calls")]
    _parallel_tool_calls: Option<IgnoredAny>,
    /// Extension: keep generating past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// Accepted and ignored.
    #[serde(rename = "user")]
    _user: Option<IgnoredAny>,
    /// Accepted and ignored.
    #[serde(rename = "metadata")]
    _metadata: Option<IgnoredAny>,
    /// Accepted and ignored (nothing is stored).
    #[serde(rename = "store")]
    _store: Option<IgnoredAny>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    pub include_usage: Option<bool>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `developer` (rendered as `system`), `user` or `assistant`.
    pub role: String,
    /// Text, or an array of `{"type": "text", "text": ...}` parts.
    pub content: Option<Value>,
    /// Accepted and ignored.
    #[serde(rename = "name")]
    _name: Option<IgnoredAny>,
}

/// Which endpoint a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// What to feed the tokenizer or the model.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids as given.
    Ids(Vec<u32>),
}

/// A chat message reduced to what the template needs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TemplateMessage {
    /// Role.
    pub role: String,
    /// Text content.
    pub content: String,
}

/// Parses a request body, turning JSON and shape errors into 400s.
pub fn parse_body(bytes: &[u8]) -> Result<GenerationBody, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_body("the request body is empty; send a JSON object"));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "the request body is not valid JSON"
        } else {
            "invalid request"
        };
        ApiError::bad_body(format!("{what}: {e}"))
    })
}

impl GenerationBody {
    /// Refuses fields of the other endpoint and features this server does not have.
    pub fn check_endpoint(&self, endpoint: Endpoint) -> Result<(), ApiError> {
        match endpoint {
            Endpoint::Chat => {
                if self.prompt.is_some() {
                    return Err(ApiError::invalid(
                        "prompt",
                        "chat completions take `messages`, not `prompt`",
                    ));
                }
                for (set, name) in [
                    (self.echo.is_some(), "echo"),
                    (self.suffix.is_some(), "suffix"),
                    (self.best_of.is_some(), "best_of"),
                ] {
                    if set {
                        return Err(ApiError::invalid(name, format!("`{name}` belongs to /v1/completions")));
                    }
                }
            }
            Endpoint::Completions => {
                if self.messages.is_some() {
                    return Err(ApiError::invalid(
                        "messages",
                        "completions take `prompt`; send `messages` to /v1/chat/completions",
                    ));
                }
                if self.max_completion_tokens.is_some() {
                    return Err(ApiError::invalid(
                        "max_completion_tokens",
                        "use `max_tokens` with /v1/completions",
                    ));
                }
                if self.echo == Some(true) {
                    return Err(ApiError::invalid("echo", "`echo` is not supported"));
                }
                if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
                    return Err(ApiError::invalid("suffix", "`suffix` (insertion) is not supported"));
                }
                if self.best_of.is_some_and(|b| b != 1) {
                    return Err(ApiError::invalid("best_of", "only best_of = 1 is supported"));
                }
            }
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n", "only n = 1 is supported"));
        }
        for (v, name) in
            [(self.presence_penalty, "presence_penalty"), (self.frequency_penalty, "frequency_penalty")]
        {
            if v.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(
                    name,
                    format!(
                        "`{name}` is not supported (only 0); use the `repetition_penalty` extension instead"
                    ),
                ));
            }
        }
        let truthy = |v: &Option<Value>| match v {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(_) => true,
        };
        if truthy(&self.logprobs) || truthy(&self.top_logprobs) {
            return Err(ApiError::invalid("logprobs", "log probabilities are not supported"));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid("logit_bias", "`logit_bias` is not supported"));
        }
        if let Some(f) = &self.response_format {
            if f.get("type").and_then(Value::as_str) != Some("text") {
                return Err(ApiError::invalid("response_format", "only {\"type\": \"text\"} is supported"));
            }
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid("tools", "tool calling is not supported"));
        }
        if let Some(c) = &self.tool_choice {
            if !matches!(c.as_str(), Some("none") | Some("auto")) {
                return Err(ApiError::invalid("tool_choice", "tool calling is not supported"));
            }
        }
        if self.stream_options.is_some() && self.stream != Some(true) {
            return Err(ApiError::invalid("stream_options", "`stream_options` needs `stream: true`"));
        }
        Ok(())
    }

    /// The prompt of a completions request.
    pub fn prompt_input(&self) -> Result<PromptInput, ApiError> {
        let bad = || {
            ApiError::invalid(
                "prompt",
                "`prompt` must be a string or an array of token ids (one prompt per request)",
            )
        };
        let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
            items
                .iter()
                .map(|v| {
                    v.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| {
                        ApiError::invalid(
                            "prompt",
                            format!("token ids must be non-negative integers, got {v}"),
                        )
                    })
                })
                .collect()
        };
        match &self.prompt {
            None => Err(ApiError::invalid("prompt", "`prompt` is required")),
            Some(Value::String(s)) => Ok(PromptInput::Text(s.clone())),
            Some(Value::Array(items)) => match items.first() {
                None => Err(ApiError::invalid("prompt", "the prompt is empty")),
                Some(Value::Number(_)) => Ok(PromptInput::Ids(ids(items)?)),
                Some(Value::String(s)) if items.len() == 1 => Ok(PromptInput::Text(s.clone())),
                Some(Value::Array(inner)) if items.len() == 1 => Ok(PromptInput::Ids(ids(inner)?)),
                Some(Value::String(_)) | Some(Value::Array(_)) => Err(ApiError::invalid(
                    "prompt",
                    "batched prompts are not supported: send one prompt per request",
                )),
                Some(_) => Err(bad()),
            },
            Some(_) => Err(bad()),
        }
    }

    /// The messages of a chat request, with content flattened to text.
    pub fn chat_messages(&self) -> Result<Vec<TemplateMessage>, ApiError> {
        let msgs =
            self.messages.as_ref().ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        if msgs.is_empty() {
            return Err(ApiError::invalid("messages", "`messages` must hold at least one message"));
        }
        msgs.iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "user" | "assistant" => m.role.clone(),
                    "developer" => "system".to_string(),
                    other => {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].role"),
                            format!("unsupported role `{other}`: use system, developer, user or assistant"),
                        ))
                    }
                };
                Ok(TemplateMessage { role, content: content_text(&m.content, i)? })
            })
            .collect()
    }

    /// The stop strings.
    pub fn stops(&self) -> Result<Vec<String>, ApiError> {
        let stops: Vec<String> = match &self.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::invalid("stop", "`stop` must be a string or an array of strings")
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::invalid("stop", "`stop` must be a string or an array of strings"))
            }
        };
        if stops.len() > 16 {
            return Err(ApiError::invalid("stop", "at most 16 stop strings"));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        Ok(stops)
    }

    /// `max_tokens` (or `max_completion_tokens`) if given; must be at least 1.
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        let (v, name) = match (self.max_tokens, self.max_completion_tokens) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    "give `max_tokens` or `max_completion_tokens`, not both",
                ))
            }
            (Some(v), None) => (v, "max_tokens"),
            (None, Some(v)) => (v, "max_completion_tokens"),
            (None, None) => return Ok(None),
        };
        if v < 1 {
            return Err(ApiError::invalid(name, format!("`{name}` must be at least 1, got {v}")));
        }
        Ok(Some(usize::try_from(v).unwrap_or(usize::MAX)))
    }
}

/// The text of a message's `content`.
fn content_text(content: &Option<Value>, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            &param,
                            "only text content parts ({\"type\": \"text\"}) are supported",
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid(&param, "`content` must be a string or an array of text parts")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> Result<GenerationBody, ApiError> {
        parse_body(json.as_bytes())
    }

    #[test]
    fn malformed_and_unknown_fields_are_400() {
        assert_eq!(body("{\"model\": ").unwrap_err().status, 400);
        let e = body(r#"{"model":"m","prompt":"x","temprature":1}"#).unwrap_err();
        assert!(e.message.contains("temprature"), "{}", e.message);
        assert_eq!(body("").unwrap_err().status, 400);
    }

    #[test]
    fn prompts_and_stops() {
        let b = body(r#"{"model":"m","prompt":[1,2,3],"stop":"x"}"#).unwrap();
        assert_eq!(b.prompt_input().unwrap(), PromptInput::Ids(vec![1, 2, 3]));
        assert_eq!(b.stops().unwrap(), vec!["x".to_string()]);
        let b = body(r#"{"model":"m","prompt":[[4,5]],"stop":["a","b"]}"#).unwrap();
        assert_eq!(b.prompt_input().unwrap(), PromptInput::Ids(vec![4, 5]));
        assert_eq!(b.stops().unwrap().len(), 2);
        assert!(body(r#"{"model":"m","prompt":[1,-2]}"#).unwrap().prompt_input().is_err());
        assert!(body(r#"{"model":"m","prompt":["a","b"]}"#).unwrap().prompt_input().is_err());
    }

    #[test]
    fn refused_parameters_name_themselves() {
        let e = body(r#"{"model":"m","prompt":"x","max_tokens":-3}"#).unwrap().max_tokens().unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = body(r#"{"model":"m","prompt":"x","presence_penalty":0.5}"#)
            .unwrap()
            .check_endpoint(Endpoint::Completions)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("presence_penalty"));
        let b = body(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#);
        assert_eq!(b.unwrap().chat_messages().unwrap()[0].content, "hi");
    }
}
