//! The parse entry points of every input smoe-pipeline reads from outside, for the fuzz
//! targets (`fuzz/`) and the property tests (`tests/fuzz_parsers.rs`). Each takes raw
//! bytes, runs the parser and the checks and derivations the program then applies to
//! what it parsed, and returns `Ok` or an error: it must never panic, hang, or allocate
//! more than the input's length justifies, whatever the bytes.

use std::path::Path;
use std::sync::LazyLock;

use anyhow::{anyhow, Context, Result};
use smoe_actors::ring::budget::RingNeeds;
use smoe_actors::sampler::SamplingParams;
use smoe_actors::state_book::DEFAULT_STATE_SNAPSHOTS;
use tokenizers::Tokenizer;

use crate::config::Config;
use crate::convert::{checkpoint, gguf::GgufFile, gguf_model, gguf_tokenizer};
use crate::serve::chat_template::{ChatTemplate, CHATML};
use crate::serve::completions::{plan, Intake};
use crate::serve::demo;
use crate::serve::prompt_bound::PromptBound;
use crate::serve::request::Endpoint;
use crate::serve::state::{RequestDefaults, ServedModel};

/// A vault's `manifest.json`: parsed, checked for consistency as `Vault::open` checks it
/// (taking the file sizes it states as the files' sizes), summarised, and sized for a
/// ring as the default ring is.
pub fn manifest(bytes: &[u8]) -> Result<()> {
    let dir = Path::new("vault");
    let mpath = dir.join(smoe_proto::MANIFEST_FILE);
    let m = smoe_actors::vault::parse_manifest(bytes, &mpath)?;
    smoe_actors::vault::check_manifest(dir, &m)?;
    let _ = (m.format_summary(), m.experts.max_blob_stride(), m.experts.mean_blob_len());
    let _ = RingNeeds::of(&m, 4096, DEFAULT_STATE_SNAPSHOTS, 4);
    Ok(())
}

/// A `serve` config file (`smoe.toml`): parsed, validated, and its effective config
/// (`--print-config`) parsed back to the same config.
pub fn config_toml(bytes: &[u8]) -> Result<()> {
    let text = std::str::from_utf8(bytes).context("the config file is not UTF-8")?;
    let c = Config::parse(text, "fuzz.toml")?;
    c.validate()?;
    let shown = c.to_toml()?;
    let again = Config::parse(&shown, "the printed config")
        .with_context(|| format!("the printed config does not parse back:\n{shown}"))?;
    if again.to_toml()? != shown {
        return Err(anyhow!("the printed config changes when parsed back:\n{shown}"));
    }
    Ok(())
}

/// What a request body is checked against: the demo model's tokenizer, ChatML, a
/// 256-token context and default sampling.
struct DemoIntake {
    model: ServedModel,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    defaults: RequestDefaults,
    bound: PromptBound,
}

static DEMO: LazyLock<DemoIntake> = LazyLock::new(|| {
    let tokenizer = demo::tokenizer().expect("the embedded demo tokenizer loads");
    let model = ServedModel {
        id: demo::MODEL_ID.to_string(),
        created: 0,
        max_context: 256,
        vocab: tokenizer.get_vocab_size(true),
        description: None,
    };
    let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into(), "ChatML".into())
        .expect("ChatML compiles");
    let defaults = RequestDefaults {
        sampling: SamplingParams::default(),
        fixed_seed: true,
        max_tokens: 16,
        spec_depth: 0,
    };
    let bound = PromptBound::of(&tokenizer);
    DemoIntake { model, tokenizer, template, defaults, bound }
});

/// An HTTP request body of `/v1/chat/completions` (`chat`) or `/v1/completions`: parsed
/// and checked, its prompt rendered and tokenized, as the server does before queueing
/// the job (on the demo model, id [`demo_model_id`]).
pub fn request_body(bytes: &[u8], chat: bool) -> Result<()> {
    let d = &*DEMO;
    let intake = Intake {
        model: &d.model,
        tokenizer: &d.tokenizer,
        template: &d.template,
        defaults: &d.defaults,
        bound: &d.bound,
    };
    let endpoint = if chat { Endpoint::Chat } else { Endpoint::Completions };
    plan(&intake, bytes, endpoint).map_err(|e| anyhow!("{}: {}", e.status, e.message))?;
    Ok(())
}

/// The model id [`request_body`] accepts.
pub fn demo_model_id() -> &'static str {
    demo::MODEL_ID
}

/// A safetensors file (`convert --hf`): the header parsed and every tensor's bytes
/// located.
pub fn safetensors(bytes: &[u8]) -> Result<()> {
    for (_, t) in checkpoint::read_header(Path::new("model.safetensors"), 0, bytes)? {
        let _ = &bytes[t.start..t.end];
    }
    Ok(())
}

/// A GGUF file (`convert --gguf`): the header, metadata and tensor infos parsed, every
/// tensor's bytes located, and the model configuration and tokenizer files built from it.
pub fn gguf(bytes: &[u8]) -> Result<()> {
    let g = GgufFile::from_bytes(Path::new("model.gguf"), bytes)?;
    for t in g.tensors() {
        g.tensor_data(&t.name)?;
    }
    gguf_model::model_config(&g)?;
    gguf_tokenizer::tokenizer_files(&g)?;
    Ok(())
}
