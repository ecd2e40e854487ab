//! The built-in demo model, so that `smoe-pipeline serve` with no configuration starts a
//! working daemon on a fresh machine: a tiny random-weight Qwen3-MoE checkpoint (with a
//! tiny BPE tokenizer and a ChatML chat template) is embedded in the binary, written to
//! the user's cache directory on first run and converted into a vault there.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};

use crate::convert::{self, ConvertOptions};

/// Model id of the demo model.
pub const MODEL_ID: &str = "smoe-demo-tiny-random";

/// What the demo model is, for logs and `/v1/models`.
pub const LABEL: &str =
    "tiny random-weight demo model (Qwen3-MoE layout: 3 layers, 8 experts, 448-token vocabulary); \
its output is gibberish. Serve a real model with --vault VAULT or `vault` in the config";

/// The checkpoint files, embedded at build time.
const FILES: &[(&str, &[u8])] = &[
    ("config.json", include_bytes!("../../tests/fixtures/moe_all/config.json")),
    ("generation_config.json", include_bytes!("../../tests/fixtures/moe_all/generation_config.json")),
    ("model.safetensors", include_bytes!("../../tests/fixtures/moe_all/model.safetensors")),
    ("tokenizer.json", include_bytes!("../../tests/fixtures/moe_all/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../tests/fixtures/moe_all/tokenizer_config.json")),
];

/// The demo vault, made on first use: `$XDG_CACHE_HOME/smoe-pipeline/demo/vault-<stamp>`
/// (or `~/.cache/...`), where the stamp covers the embedded files and the vault format.
pub fn ensure() -> Result<PathBuf> {
    let root = cache_root()?.join("demo");
    let mut crc = smoe_proto::FORMAT_VERSION;
    for (name, bytes) in FILES {
        crc = crc32c::crc32c_append(crc32c::crc32c_append(crc, name.as_bytes()), bytes);
    }
    let vault = root.join(format!("vault-{crc:08x}"));
    if vault.join(smoe_proto::MANIFEST_FILE).exists() {
        return Ok(vault);
    }
    tracing::info!("making the demo vault in {} (first run)", vault.display());
    let staging = root.join(format!("staging-{}", std::process::id()));
    let made = build(&staging, &vault);
    let _ = std::fs::remove_dir_all(&staging);
    made.with_context(|| format!("cannot make the demo vault in {}", root.display()))?;
    Ok(vault)
}

/// Writes the checkpoint under `staging`, converts it, and moves the vault to `vault`.
fn build(staging: &Path, vault: &Path) -> Result<()> {
    let hf = staging.join("hf");
    std::fs::create_dir_all(&hf).with_context(|| format!("cannot create {}", hf.display()))?;
    for (name, bytes) in FILES {
        std::fs::write(hf.join(name), bytes)
            .with_context(|| format!("cannot write {}", hf.join(name).display()))?;
    }
    let out = staging.join("vault");
    convert::convert(&ConvertOptions { hf, out: out.clone(), dtype: None, force: true })?;
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
