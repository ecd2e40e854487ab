//! The built-in demo model, so that `smoe-pipeline serve` with no configuration starts a
//! working daemon on a fresh machine: the `tiny` preset of `synth` (Qwen3-MoE layout,
//! seeded random weights) with its vocabulary sized to a tiny byte-level BPE tokenizer
//! with a ChatML chat template (embedded from `assets/demo/`), written as a vault to the
//! user's cache directory on first run.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use smoe_proto::{DType, ModelConfig};
use tokenizers::Tokenizer;

use crate::synth;
use crate::vault_writer::VaultSpec;

/// Model id of the demo model.
pub const MODEL_ID: &str = "smoe-demo-tiny-random";

/// What the demo model is, for logs and `/v1/models`.
pub const LABEL: &str =
    "tiny random-weight demo model (the `synth` tiny preset: Qwen3-MoE layout, seeded random weights); \
its output is gibberish. Serve a real model with --vault VAULT or `vault` in the config";

/// The `synth` preset the demo model has the shape of.
const PRESET: &str = "tiny";
/// Seed of the demo model's weights.
const SEED: u64 = 0;
/// Element type of the demo model's weight matrices.
const DTYPE: DType = DType::Bf16;
/// The tokenizer's file.
const TOKENIZER_JSON: &[u8] = include_bytes!("../../assets/demo/tokenizer.json");
/// The tokenizer files, embedded at build time.
const TOKENIZER_FILES: &[(&str, &[u8])] = &[
    ("tokenizer.json", TOKENIZER_JSON),
    ("tokenizer_config.json", include_bytes!("../../assets/demo/tokenizer_config.json")),
];
/// The tokens that end a demo reply (ChatML's end of turn, end of text).
const EOS_TOKENS: &[&str] = &["<|im_end|>", "<|endoftext|>"];

/// The demo vault, made on first use: `$XDG_CACHE_HOME/smoe-pipeline/demo/vault-<stamp>`
/// (or `~/.cache/...`), where the stamp covers the model config, the weights' seed and
/// type, the tokenizer files and the vault format.
pub fn ensure() -> Result<PathBuf> {
    let cfg = config()?;
    let root = cache_root()?.join("demo");
    let mut crc = crc32c::crc32c_append(smoe_proto::FORMAT_VERSION, &serde_json::to_vec(&cfg)?);
    crc = crc32c::crc32c_append(crc, format!("{SEED} {}", DTYPE.name()).as_bytes());
    for (name, bytes) in TOKENIZER_FILES {
        crc = crc32c::crc32c_append(crc32c::crc32c_append(crc, name.as_bytes()), bytes);
    }
    let vault = root.join(format!("vault-{crc:08x}"));
    if vault.join(smoe_proto::MANIFEST_FILE).exists() {
        return Ok(vault);
    }
    tracing::info!("making the demo vault in {} (first run)", vault.display());
    let staging = root.join(format!("staging-{}", std::process::id()));
    let made = build(&cfg, &staging, &vault);
    let _ = std::fs::remove_dir_all(&staging);
    made.with_context(|| format!("cannot make the demo vault in {}", root.display()))?;
    Ok(vault)
}

/// The demo model's tokenizer (embedded).
pub fn tokenizer() -> Result<Tokenizer> {
    Tokenizer::from_bytes(TOKENIZER_JSON).map_err(|e| anyhow!("the demo tokenizer is broken: {e}"))
}

/// The demo model: the preset, with the tokenizer's vocabulary and end-of-turn tokens.
fn config() -> Result<ModelConfig> {
    let tok = tokenizer()?;
    let mut cfg = synth::preset(PRESET)?;
    cfg.vocab_size = tok.get_vocab_size(true);
    cfg.eos_token_ids = EOS_TOKENS.iter().filter_map(|t| tok.token_to_id(t)).collect();
    Ok(cfg)
}

/// Writes the tokenizer files and the vault of `cfg` under `staging`, and moves the vault
/// to `vault`.
fn build(cfg: &ModelConfig, staging: &Path, vault: &Path) -> Result<()> {
    let tok_dir = staging.join("tokenizer");
    std::fs::create_dir_all(&tok_dir).with_context(|| format!("cannot create {}", tok_dir.display()))?;
    for (name, bytes) in TOKENIZER_FILES {
        std::fs::write(tok_dir.join(name), bytes)
            .with_context(|| format!("cannot write {}", tok_dir.join(name).display()))?;
    }
    let out = staging.join("vault");
    let spec = VaultSpec {
        out: &out,
        cfg,
        dtype: DTYPE,
        quant: None,
        keep_resident: false,
        force: true,
        tokenizer_dir: Some(&tok_dir),
        tokenizer_files: Vec::new(),
        label: "making the demo model",
    };
    synth::write_random(&spec, SEED)?;
    if let Err(e) = std::fs::rename(&out, vault) {
        // Another daemon may have finished first.
        if !vault.join(smoe_proto::MANIFEST_FILE).exists() {
            return Err(anyhow!("cannot move {} to {}: {e}", out.display(), vault.display()));
        }
    }
    Ok(())
}

/// `$XDG_CACHE_HOME/smoe-pipeline`, else `$HOME/.cache/smoe-pipeline`.
fn cache_root() -> Result<PathBuf> {
    let base = match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
        (Some(x), _) if !x.is_empty() => PathBuf::from(x),
        (_, Some(h)) if !h.is_empty() => PathBuf::from(h).join(".cache"),
        _ => return Err(anyhow!("neither XDG_CACHE_HOME nor HOME is set: cannot place the demo model")),
    };
    Ok(base.join("smoe-pipeline"))
}
