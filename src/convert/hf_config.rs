//! Reading a HuggingFace `config.json` (and `generation_config.json`) into the engine's
//! [`ModelConfig`], accepting both key styles seen in the wild: released checkpoints
//! (`num_experts`, `rope_theta`) and transformers 5 (`num_local_experts`,
//! `rope_parameters`). The hybrid family (Qwen3-Next, Qwen3.5-MoE) adds its DeltaNet and
//! shared-expert keys; a Qwen3.5-MoE vision-language checkpoint's text model is read from
//! its `text_config`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use smoe_proto::{HybridConfig, LayerType, ModelConfig};

/// Architectures this build can run.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
];

/// Which family an architecture belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3-MoE.
    Qwen3Moe,
    /// Qwen3-Next (`qwen3_next`): hybrid, fused DeltaNet projections on disk.
    Qwen3Next,
    /// Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`): hybrid, split projections on
    /// disk, every layer MoE, top-k weights always renormalised.
    Qwen35Moe,
}

impl Family {
    /// The family of a `config.json` architecture name.
    pub fn of(architecture: &str) -> Option<Family> {
        match architecture {
            "Qwen3MoeForCausalLM" => Some(Family::Qwen3Moe),
            "Qwen3NextForCausalLM" => Some(Family::Qwen3Next),
            "Qwen3_5MoeForCausalLM" | "Qwen3_5MoeForConditionalGeneration" => Some(Family::Qwen35Moe),
            _ => None,
        }
    }
}

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

/// The keys the text model reads: a vision-language checkpoint's `text_config` over its
/// top-level keys (which hold, e.g., `tie_word_embeddings`), else the top level.
fn text_keys(json: &Value) -> Value {
    match (json.as_object(), json.get("text_config").and_then(Value::as_object)) {
        (Some(top), Some(text)) => {
            let mut merged: Map<String, Value> = top.clone();
            merged.remove("text_config");
            merged.extend(text.iter().map(|(k, v)| (k.clone(), v.clone())));
            Value::Object(merged)
        }
        _ => json.clone(),
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
    let top = read_json(&path)?;
    if !top.is_object() {
        bail!("{}: expected a JSON object", path.display());
    }
    let arch = match top.get("architectures") {
        Some(Value::Array(a)) => a.first().and_then(|v| v.as_str()).unwrap_or("").to_string(),
        _ => String::new(),
    };
    let Some(family) = Family::of(&arch) else {
        let model_type = top.get("model_type").and_then(|v| v.as_str()).unwrap_or("?");
        bail!(
            "{}: field `architectures` is {arch:?} (model_type {model_type:?}); this build supports {SUPPORTED_ARCHITECTURES:?}",
            path.display()
        );
    };
    let json = text_keys(&top);
    let f = Fields { json: &json, file: &path };
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
    let layers = f.usize("num_hidden_layers")?;
    let hybrid = match family {
        Family::Qwen3Moe => None,
        Family::Qwen3Next | Family::Qwen35Moe => Some(hybrid_config(&f, rope_params, layers)?),
    };
    // Qwen3.5-MoE has no dense layers and always renormalises the top-k weights
    // (transformers deletes those keys from its config).
    let qwen35 = family == Family::Qwen35Moe;
    // transformers' `Qwen3NextConfig` defaults `head_dim` to 256, Qwen3-MoE's to
    // hidden / heads.
    let head_dim_default = if hybrid.is_some() { 256 } else { hidden / heads };
    let cfg = ModelConfig {
        architecture: arch,
        hidden_size: hidden,
        intermediate_size: if qwen35 { 0 } else { f.usize_any(&["intermediate_size"])?.unwrap_or(0) },
        moe_intermediate_size: f.usize("moe_intermediate_size")?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: f.usize_any(&["num_key_value_heads"])?.unwrap_or(heads),
        head_dim: f.usize_any(&["head_dim"])?.unwrap_or(head_dim_default),
        vocab_size: f.usize("vocab_size")?,
        rms_norm_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        rope_theta,
        max_position_embeddings: f.usize_any(&["max_position_embeddings"])?.unwrap_or(32768),
        num_experts: f.usize_any(&["num_experts", "num_local_experts"])?.with_context(|| {
            format!("{}: neither `num_experts` nor `num_local_experts` is set", path.display())
        })?,
        num_experts_per_tok: f.usize("num_experts_per_tok")?,
        norm_topk_prob: qwen35 || f.bool("norm_topk_prob", hybrid.is_some())?,
        decoder_sparse_step: if qwen35 { 1 } else { f.usize_any(&["decoder_sparse_step"])?.unwrap_or(1) },
        mlp_only_layers: if qwen35 { Vec::new() } else { mlp_only_layers },
        tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
        eos_token_ids: eos,
        hybrid,
    };
    cfg.validate().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(cfg)
}

/// The hybrid family's keys, with transformers' `Qwen3NextConfig` defaults where a key
/// is absent. `rope` is the `rope_parameters` (or `rope_scaling`) object.
fn hybrid_config(f: &Fields<'_>, rope: Option<&Value>, layers: usize) -> Result<HybridConfig> {
    let file = f.file.display();
    if !f.bool("attn_output_gate", true)? {
        bail!("{file}: field `attn_output_gate` is false; only gated attention (transformers' only form) is supported");
    }
    let layer_types = match f.get("layer_types") {
        Some(Value::Array(types)) => types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full_attention") => Ok(LayerType::FullAttention),
                Some("linear_attention") => Ok(LayerType::LinearAttention),
                _ => bail!(
                    "{file}: field `layer_types[{i}]` is {t}; expected \"full_attention\" or \"linear_attention\""
                ),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(v) => bail!("{file}: field `layer_types` must be a list of layer types, found {v}"),
        None => {
            let interval = f.usize_any(&["full_attention_interval"])?.unwrap_or(4);
            if interval == 0 {
                bail!("{file}: field `full_attention_interval` must be positive");
            }
            (0..layers)
                .map(|i| match (i + 1).is_multiple_of(interval) {
                    true => LayerType::FullAttention,
                    false => LayerType::LinearAttention,
                })
                .collect()
        }
    };
    // `partial_rotary_factor` lives in `rope_parameters` (transformers 5) or at the top.
    let rope_f = |key: &str| rope.and_then(|r| r.get(key)).filter(|v| !v.is_null());
    let partial_rotary_factor = match rope_f("partial_rotary_factor") {
        Some(v) => v.as_f64().with_context(|| {
            format!("{file}: field `rope_parameters.partial_rotary_factor` must be a number, found {v}")
        })?,
        None => f.f64("partial_rotary_factor")?.unwrap_or(0.25),
    };
    let mrope_section = match rope_f("mrope_section") {
        None => Vec::new(),
        Some(v) => serde_json::from_value::<Vec<usize>>(v.clone()).with_context(|| {
            format!("{file}: field `rope_parameters.mrope_section` must be a list of sizes, found {v}")
        })?,
    };
    let mrope_interleaved = match rope_f("mrope_interleaved") {
        None => false,
        Some(v) => v.as_bool().with_context(|| {
            format!("{file}: field `rope_parameters.mrope_interleaved` must be true or false, found {v}")
        })?,
    };
    let or = |key: &str, default: usize| -> Result<usize> { Ok(f.usize_any(&[key])?.unwrap_or(default)) };
    Ok(HybridConfig {
        layer_types,
        linear_num_key_heads: or("linear_num_key_heads", 16)?,
        linear_num_value_heads: or("linear_num_value_heads", 32)?,
        linear_key_head_dim: or("linear_key_head_dim", 128)?,
        linear_value_head_dim: or("linear_value_head_dim", 128)?,
        linear_conv_kernel_dim: or("linear_conv_kernel_dim", 4)?,
        partial_rotary_factor,
        mrope_section,
        mrope_interleaved,
        shared_expert_intermediate_size: or("shared_expert_intermediate_size", 512)?,
    })
}
