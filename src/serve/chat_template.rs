//! Rendering chat messages into a prompt with the checkpoint's Jinja chat template
//! (`chat_template` in `tokenizer_config.json`), the way HuggingFace's
//! `apply_chat_template(..., add_generation_prompt=True)` does, or with a built-in
//! ChatML template when the checkpoint has none.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value;
use smoe_actors::vault::files;

use super::request::TemplateMessage;

/// ChatML, the format of Qwen models, for checkpoints without a template.
pub const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Where the template came from, for logs.
    pub origin: String,
}

impl ChatTemplate {
    /// The template of the vault in `dir` (from its `tokenizer_config.json`), or ChatML.
    pub fn load(dir: &Path) -> Result<ChatTemplate> {
        let name = "tokenizer_config.json";
        let path = dir.join(name);
        let cfg: Value = match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            _ => serde_json::from_slice(&files::read_member(dir, name, files::MAX_METADATA_BYTES)?)
                .with_context(|| format!("{} is not valid JSON", path.display()))?,
        };
        let token = |key: &str| match &cfg[key] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
            _ => String::new(),
        };
        let (source, origin) = match &cfg["chat_template"] {
            Value::String(s) => (s.clone(), format!("{} (chat_template)", path.display())),
            // Several named templates: take "default".
            Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(|s| (s.to_string(), format!("{} (chat_template \"default\")", path.display())))
                .ok_or_else(|| anyhow!("{}: chat_template lists no \"default\" template", path.display()))?,
            _ => (CHATML.to_string(), "built-in ChatML (the vault has no chat_template)".to_string()),
        };
        ChatTemplate::new(source, token("bos_token"), token("eos_token"), origin)
            .with_context(|| format!("cannot compile the chat template of {}", path.display()))
    }

    /// Compiles `source` with HuggingFace's Jinja settings and helpers.
    pub fn new(source: String, bos: String, eos: String, origin: String) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source).map_err(|e| anyhow!("{e:#}"))?;
        Ok(ChatTemplate { env, bos, eos, origin })
    }

    /// The prompt for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, String> {
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| match e.kind() {
            // The template refused the conversation (e.g. a role it does not allow).
            ErrorKind::InvalidOperation => {
                e.detail().unwrap_or("the chat template refused the messages").to_string()
            }
            _ => format!("the chat template failed: {e}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage { role: role.into(), content: content.into() }
    }

    #[test]
    fn chatml_renders_like_transformers() {
        let t = ChatTemplate::new(CHATML.into(), String::new(), String::new(), "test".into()).unwrap();
        let text = t.render(&[msg("system", "Be brief."), msg("user", "Hi")]).unwrap();
        assert_eq!(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_becomes_a_message() {
        let src = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new(), "test".into()).unwrap();
        assert_eq!(t.render(&[msg("system", "x")]).unwrap_err(), "System role not supported");
    }

    #[test]
    fn python_string_methods_work() {
        let src =
            "{% for m in messages %}{{ m.content.strip().split('</think>')[-1].lstrip('\\n') }}{% endfor %}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new(), "test".into()).unwrap();
        assert_eq!(t.render(&[msg("user", " a</think>\nb ")]).unwrap(), "b");
    }

    #[test]
    fn qwen3_template_renders_like_transformers() {
        let golden: Value =
            serde_json::from_str(include_str!("../../tests/serve/qwen3_chat_template.json")).unwrap();
        let src = golden["template"].as_str().unwrap().to_string();
        let eos = golden["eos_token"].as_str().unwrap().to_string();
        let t = ChatTemplate::new(src, String::new(), eos, "qwen3".into()).unwrap();
        for case in golden["cases"].as_array().unwrap() {
            let msgs: Vec<TemplateMessage> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| msg(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            assert_eq!(t.render(&msgs).unwrap(), case["rendered"].as_str().unwrap(), "{msgs:?}");
        }
    }
}
