//! `synth --format hf`: the synthetic model as a HuggingFace checkpoint directory —
//! `config.json` in the released Qwen3-MoE key style, `generation_config.json`, the
//! weights in safetensors shards (`model-0000N-of-0000M.safetensors` and
//! `model.safetensors.index.json`, or one `model.safetensors` when everything fits one
//! shard) and the tokenizer files — so `smoe-pipeline convert --hf` and llama.cpp's
//! `convert_hf_to_gguf.py` read the same weights. Tensors are streamed from the source
//! into each shard after its header, so memory stays bounded.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Map, Value};
use smoe_proto::{tensor_bytes, DType, ModelConfig};

use crate::vault_writer::{resident_tensors, TensorSource, VaultSpec, TOKENIZER_FILES};

/// One tensor of the checkpoint.
struct Entry {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
}

impl Entry {
    fn bytes(&self) -> u64 {
        tensor_bytes(self.dtype, &self.shape).unwrap_or(0)
    }
}

/// Every tensor of the model: the resident tensors in vault order, then each MoE layer's
/// experts. Norms (1-D) are f32, as in the vault, so converting gives back the same
/// bytes; matrices are `dtype`.
fn entries(cfg: &ModelConfig, dtype: DType) -> Vec<Entry> {
    let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let entry = |(name, shape): (String, Vec<usize>)| {
        let dtype = if shape.len() == 1 { DType::F32 } else { dtype };
        Entry { name, shape, dtype }
    };
    let mut out: Vec<Entry> = resident_tensors(cfg).into_iter().map(entry).collect();
    for l in cfg.moe_layers() {
        for e in 0..cfg.num_experts {
            for (part, shape) in [("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])] {
                out.push(entry((format!("model.layers.{l}.mlp.experts.{e}.{part}.weight"), shape.to_vec())));
            }
        }
    }
    out
}

/// safetensors' and torch's names of an element type a checkpoint holds.
fn hf_names(d: DType) -> Result<(&'static str, &'static str)> {
    match d {
        DType::F32 => Ok(("F32", "float32")),
        DType::Bf16 => Ok(("BF16", "bfloat16")),
        DType::F16 => Ok(("F16", "float16")),
        _ => bail!("a HuggingFace checkpoint holds f32, bf16 or f16 weights, not {d}"),
    }
}

/// Groups `entries` into shards of at most `shard_bytes` (a larger tensor gets a shard
/// of its own).
fn shards(entries: &[Entry], shard_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut size) = (0, 0u64);
    for (i, e) in entries.iter().enumerate() {
        if i > start && size + e.bytes() > shard_bytes {
            out.push(start..i);
            (start, size) = (i, 0);
        }
        size += e.bytes();
    }
    if start < entries.len() {
        out.push(start..entries.len());
    }
    out
}

/// Writes one safetensors file holding `entries`, streaming their bytes from `src`.
fn write_shard(path: &Path, entries: &[Entry], src: &mut dyn TensorSource, bar: &ProgressBar) -> Result<()> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for e in entries {
        let end = offset + e.bytes();
        header.insert(
            e.name.clone(),
            json!({ "dtype": hf_names(e.dtype)?.0, "shape": e.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut text = serde_json::to_string(&Value::Object(header))?;
    while (8 + text.len()) % 8 != 0 {
        text.push(' ');
    }
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    let fail = || format!("cannot write {}", path.display());
    w.write_all(&(text.len() as u64).to_le_bytes()).with_context(fail)?;
    w.write_all(text.as_bytes()).with_context(fail)?;
    for e in entries {
        let mut written = 0u64;
        src.stream(&e.name, &e.shape, e.dtype, &mut |b| {
            written += b.len() as u64;
            bar.inc(b.len() as u64);
            w.write_all(b).with_context(fail)
        })?;
        if written != e.bytes() {
            bail!("internal error: tensor {} streamed {written} bytes, expected {}", e.name, e.bytes());
        }
    }
    w.flush().with_context(fail)
}

/// `config.json` in the key style of the released Qwen3-MoE checkpoints.
fn config_json(cfg: &ModelConfig, torch_dtype: &str) -> Value {
    json!({
        "architectures": [cfg.architecture],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "eos_token_id": cfg.eos_token_ids.first(),
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": cfg.num_hidden_layers,
        "mlp_only_layers": cfg.mlp_only_layers,
        "model_type": "qwen3_moe",
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "num_attention_heads": cfg.num_attention_heads,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "output_router_logits": false,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": null,
        "rope_theta": cfg.rope_theta,
        "router_aux_loss_coef": 0.001,
        "sliding_window": null,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": cfg.vocab_size,
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Writes the checkpoint `spec` describes (into `spec.out`, in shards of at most
/// `shard_bytes`) from `src`; returns the shard file names.
pub fn write_hf(spec: &VaultSpec<'_>, shard_bytes: u64, src: &mut dyn TensorSource) -> Result<Vec<String>> {
    let out = spec.out;
    if out.join("config.json").exists() && !spec.force {
        bail!("{} already holds a checkpoint; pass --force to overwrite it", out.display());
    }
    if spec.quant.is_some() {
        bail!(
            "--quant quantises a vault's experts; quantise when converting the checkpoint (convert --quant)"
        );
    }
    let torch_dtype = hf_names(spec.dtype)?.1;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let entries = entries(spec.cfg, spec.dtype);
    let groups = shards(&entries, shard_bytes.max(1));
    let names: Vec<String> = if groups.len() == 1 {
        vec!["model.safetensors".into()]
    } else {
        (1..=groups.len()).map(|i| format!("model-{i:05}-of-{:05}.safetensors", groups.len())).collect()
    };
    let total: u64 = entries.iter().map(Entry::bytes).sum();
    let bar = ProgressBar::new(total).with_message(spec.label.to_string());
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut weight_map = Map::new();
    for (group, name) in groups.iter().zip(&names) {
        write_shard(&out.join(name), &entries[group.clone()], src, &bar)?;
        for e in &entries[group.clone()] {
            weight_map.insert(e.name.clone(), json!(name));
        }
    }
    bar.finish_and_clear();
    if groups.len() > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        write_json(&out.join("model.safetensors.index.json"), &index)?;
    }
    write_json(&out.join("config.json"), &config_json(spec.cfg, torch_dtype))?;
    // Ours, not the tokenizer directory's: the end-of-sequence ids are the model's.
    let mut gen = json!({ "do_sample": false });
    if !spec.cfg.eos_token_ids.is_empty() {
        gen["eos_token_id"] = json!(spec.cfg.eos_token_ids);
    }
    write_json(&out.join("generation_config.json"), &gen)?;
    if let Some(dir) = spec.tokenizer_dir {
        for name in TOKENIZER_FILES.iter().filter(|n| **n != "generation_config.json") {
            let from = dir.join(name);
            if from.exists() {
                std::fs::copy(&from, out.join(name))
                    .with_context(|| format!("cannot copy {}", from.display()))?;
            }
        }
    }
    Ok(names)
}
