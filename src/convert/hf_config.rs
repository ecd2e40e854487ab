//! Reading a HuggingFace `config.json` (and `generation_config.json`) into the engine's
//! [`ModelConfig`], accepting both key styles seen in the wild: released checkpoints
//! (`num_experts`, `rope_theta`) and transformers 5 (`num_local_experts`,
//! `rope_parameters`).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use smoe_proto::ModelConfig;

/// Architectures this build can run.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["Qwen3MoeForCausalLM"];

struct Fields<'a> {
    json: &'a Value,
    file: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn usize_any(&self, keys: &[&str]) -> Result<Option<usize>> {
        for key in keys {
            if let Some(v) = self.get(key) {
                let n = v.as_u64().with_context(|| {
                    format!(
                        "{}: field `{key}` must be a non-negative integer, found {v}",
                        self.file.display()
                    )
                })?;
                return Ok(Some(n as usize));
            }
        }
        Ok(None)
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.usize_any(&[key])?
            .with_context(|| format!("{}: required field `{key}` is missing", self.file.display()))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64().with_context(|| {
                    format!("{}: field `{key}` must be a number, found {v}", self.file.display())
                })
            })
            .transpose()
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().with_context(|| {
                format!("{}: field `{key}` must be true or false, found {v}", self.file.display())
            }),
        }
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// Token ids in an `eos_token_id` field (an integer or a list of integers).
fn eos_ids(v: Option<&Value>, file: &Path) -> Result<Vec<u32>> {
    let bad = || format!("{}: field `eos_token_id` must be an integer or a list of integers", file.display());
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(|x| x.as_u64().map(|n| n as u32).with_context(bad)).collect(),
        Some(x) => Ok(vec![x.as_u64().with_context(bad)? as u32]),
    }
}

/// Parses `dir/config.json` (and `dir/generation_config.json` when present).
pub fn read_model_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    if !path.exists() {
        bail!(
            "{} is missing: point --hf at a HuggingFace model directory (config.json + *.safetensors)",
            path.display()
        );
    }
    let json = read_json(&path)?;
    if !json.is_object() {
        bail!("{}: expected a JSON object", path.display());
    }
    let f = Fields { json: &json, file: &path };
    let arch = match f.get("architectures") {
        Some(Value::Array(a)) => a.first().and_then(|v| v.as_str()).unwrap_or("").to_string(),
        _ => String::new(),
    };
    if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        let model_type = f.get("model_type").and_then(|v| v.as_str()).unwrap_or("?");
        bail!(
            "{}: field `architectures` is {arch:?} (model_type {model_type:?}); this build supports {SUPPORTED_ARCHITECTURES:?}",
            path.display()
        );
    }
    if f.bool("attention_bias", false)? {
        bail!(
            "{}: field `attention_bias` is true; attention projections with bias are not supported",
            path.display()
        );
    }
    let rope_params = f.get("rope_parameters").or_else(|| f.get("rope_scaling"));
    let mut rope_theta = f.f64("rope_theta")?;
    if let Some(rp) = rope_params {
        let kind =
            rp.get("rope_type").or_else(|| rp.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
        if kind != "default" {
            bail!(
                "{}: field `rope_parameters.rope_type` is {kind:?}; only \"default\" RoPE is supported",
                path.display()
            );
        }
        if rope_theta.is_none() {
            rope_theta = rp.get("rope_theta").and_then(|v| v.as_f64());
        }
    }
    let rope_theta = rope_theta.with_context(|| {
        format!("{}: neither `rope_theta` nor `rope_parameters.rope_theta` is set", path.display())
    })?;
    let hidden = f.usize("hidden_size")?;
    let heads = f.usize("num_attention_heads")?;
    if heads == 0 {
        bail!("{}: field `num_attention_heads` must be positive", path.display());
    }
    let mlp_only_layers = match f.get("mlp_only_layers") {
        None => Vec::new(),
        Some(v) => serde_json::from_value::<Vec<usize>>(v.clone()).with_context(|| {
            format!("{}: field `mlp_only_layers` must be a list of layer indices", path.display())
        })?,
    };
    let mut eos = eos_ids(f.get("eos_token_id"), &path)?;
    let gpath = dir.join("generation_config.json");
    if gpath.exists() {
        let g = read_json(&gpath)?;
        for id in eos_ids(g.get("eos_token_id"), &gpath)? {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let cfg = ModelConfig {
        architecture: arch,
        hidden_size: hidden,
        intermediate_size: f.usize_any(&["intermediate_size"])?.unwrap_or(0),
        moe_intermediate_size: f.usize("moe_intermediate_size")?,
        num_hidden_layers: f.usize("num_hidden_layers")?,
        num_attention_heads: heads,
        num_key_value_heads: f.usize_any(&["num_key_value_heads"])?.unwrap_or(heads),
        head_dim: f.usize_any(&["head_dim"])?.unwrap_or(hidden / heads),
        vocab_size: f.usize("vocab_size")?,
        rms_norm_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        rope_theta,
        max_position_embeddings: f.usize_any(&["max_position_embeddings"])?.unwrap_or(32768),
        num_experts: f.usize_any(&["num_experts", "num_local_experts"])?.with_context(|| {
            format!("{}: neither `num_experts` nor `num_local_experts` is set", path.display())
        })?,
        num_experts_per_tok: f.usize("num_experts_per_tok")?,
        norm_topk_prob: f.bool("norm_topk_prob", false)?,
        decoder_sparse_step: f.usize_any(&["decoder_sparse_step"])?.unwrap_or(1),
        mlp_only_layers,
        tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
        eos_token_ids: eos,
    };
    cfg.validate().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(cfg)
}
