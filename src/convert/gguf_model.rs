//! A GGUF model as the engine's model: the [`ModelConfig`] from llama.cpp's metadata keys,
//! and llama.cpp's tensor names mapped to the vault's (HuggingFace) names, each expert's
//! slice cut from the stacked `ffn_*_exps` tensors.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use smoe_actors::cpu::quant::dequantize_row;
use smoe_proto::{DType, GgmlType, Manifest, ModelConfig};

use super::gguf::GgufFile;
use super::{gguf_tokenizer, STREAM_BYTES};
use crate::vault_writer::{write_vault, TensorSource, VaultSpec};

/// GGUF architectures (`general.architecture`) this build converts, with the
/// HuggingFace architecture each becomes.
pub const SUPPORTED_ARCHITECTURES: &[(&str, &str)] = &[("qwen3moe", "Qwen3MoeForCausalLM")];

/// llama.cpp's RoPE base when `<arch>.rope.freq_base` is absent (`llama-model.cpp`).
const DEFAULT_ROPE_BASE: f64 = 10000.0;

/// Token texts llama.cpp treats as end of generation whatever the ids in the metadata
/// (`llama-vocab.cpp`, the `special_eog_ids` list; the entries a `gpt2` vocabulary of the
/// supported families holds).
const END_OF_GENERATION_TOKENS: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"];

/// Per decoder layer: HuggingFace name (after `model.layers.N.`) → llama.cpp name
/// (after `blk.N.`), both without `.weight`.
const LAYER_TENSORS: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate", "ffn_gate_inp"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Per expert: HuggingFace matrix name → llama.cpp's stacked tensor of all experts.
const EXPERT_TENSORS: &[(&str, &str)] =
    &[("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")];

/// Whole-model tensors: HuggingFace name → llama.cpp name.
const MODEL_TENSORS: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Where a vault tensor is in a GGUF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufSlice {
    /// The GGUF tensor.
    pub tensor: String,
    /// For a stacked expert tensor, which expert's slice.
    pub expert: Option<usize>,
}

/// The GGUF tensor (and expert slice) holding the vault tensor `name`, or `None` for a
/// name the model does not have.
pub fn gguf_slice(name: &str) -> Option<GgufSlice> {
    if let Some((_, g)) = MODEL_TENSORS.iter().find(|(hf, _)| *hf == name) {
        return Some(GgufSlice { tensor: g.to_string(), expert: None });
    }
    let rest = name.strip_prefix("model.layers.")?.strip_suffix(".weight")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if let Some(e) = rest.strip_prefix("mlp.experts.") {
        let (expert, part) = e.split_once('.')?;
        let (_, g) = EXPERT_TENSORS.iter().find(|(hf, _)| *hf == part)?;
        return Some(GgufSlice {
            tensor: format!("blk.{layer}.{g}.weight"),
            expert: Some(expert.parse().ok()?),
        });
    }
    let (_, g) = LAYER_TENSORS.iter().find(|(hf, _)| *hf == rest)?;
    Some(GgufSlice { tensor: format!("blk.{layer}.{g}.weight"), expert: None })
}

/// The GGUF tensors a model of `cfg` reads, with their row-major shapes: the tensor
/// [`gguf_slice`] maps each vault tensor to, and the stacked `[experts, rows, cols]`
/// expert tensors of every MoE layer.
pub fn gguf_tensors(cfg: &ModelConfig) -> BTreeMap<String, Vec<u64>> {
    let mut tensors: BTreeMap<String, Vec<u64>> = crate::vault_writer::resident_tensors(cfg)
        .into_iter()
        .filter_map(|(name, shape)| {
            Some((gguf_slice(&name)?.tensor, shape.iter().map(|&d| d as u64).collect()))
        })
        .collect();
    let (e, h, mi) = (cfg.num_experts as u64, cfg.hidden_size as u64, cfg.moe_intermediate_size as u64);
    for l in cfg.moe_layers() {
        for (_, g) in EXPERT_TENSORS {
            let shape = if *g == "ffn_down_exps" { vec![e, h, mi] } else { vec![e, mi, h] };
            tensors.insert(format!("blk.{l}.{g}.weight"), shape);
        }
    }
    tensors
}

/// The model configuration from `g`'s metadata (`<arch>.*` keys, the token list) and
/// which tensors it has (tied embeddings, dense layers).
pub fn model_config(g: &GgufFile) -> Result<ModelConfig> {
    let arch = g.architecture()?;
    let Some(&(_, hf_arch)) = SUPPORTED_ARCHITECTURES.iter().find(|(a, _)| *a == arch) else {
        let known: Vec<&str> = SUPPORTED_ARCHITECTURES.iter().map(|(a, _)| *a).collect();
        bail!("GGUF architecture (general.architecture) is {arch:?}; this build converts {known:?}");
    };
    let key = |k: &str| format!("{arch}.{k}");
    let num = |k: &str| -> Result<usize> { Ok(g.get_u64(&key(k))? as usize) };
    let opt_num = |k: &str| -> Result<Option<usize>> { g.get(&key(k)).map(|_| num(k)).transpose() };
    let hidden = num("embedding_length")?;
    let heads = num("attention.head_count")?;
    if heads == 0 {
        bail!("GGUF {} is 0", key("attention.head_count"));
    }
    let head_dim = opt_num("attention.key_length")?.unwrap_or(hidden / heads);
    for k in ["attention.value_length", "rope.dimension_count"] {
        if let Some(v) = opt_num(k)?.filter(|&v| v != head_dim) {
            bail!("GGUF {} is {v} but the head dimension is {head_dim}; only full-width heads and RoPE are supported", key(k));
        }
    }
    if let Ok(kind) = g.get_str(&key("rope.scaling.type")) {
        if kind != "none" {
            bail!("GGUF {} is {kind:?}; only unscaled RoPE is supported", key("rope.scaling.type"));
        }
    }
    let used = num("expert_used_count")?;
    let ff = opt_num("feed_forward_length")?.unwrap_or(0);
    // llama.cpp's fallback when the key is absent (`models/qwen3moe.cpp`).
    let moe_ff = match opt_num("expert_feed_forward_length")? {
        Some(n) => n,
        None if used > 0 => ff / used,
        None => 0,
    };
    let layers = num("block_count")?;
    // Checked before anything loops over the layers (`validate` checks it again).
    if layers > smoe_proto::model_config::MAX_LAYERS {
        bail!(
            "GGUF {} is {layers}; at most {} layers are supported",
            key("block_count"),
            smoe_proto::model_config::MAX_LAYERS
        );
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let mut eos: Vec<u32> = Vec::new();
    for k in ["eos", "eot", "eom"] {
        let k = format!("tokenizer.ggml.{k}_token_id");
        if g.get(&k).is_some() {
            eos.push(g.get_u64(&k)? as u32);
        }
    }
    for (id, t) in tokens.iter().enumerate() {
        if END_OF_GENERATION_TOKENS.contains(t) && !eos.contains(&(id as u32)) {
            eos.push(id as u32);
        }
    }
    let has = |name: String| g.tensor(&name).is_ok();
    let cfg = ModelConfig {
        architecture: hf_arch.to_string(),
        hidden_size: hidden,
        intermediate_size: ff,
        moe_intermediate_size: moe_ff,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: opt_num("attention.head_count_kv")?.unwrap_or(heads),
        head_dim,
        vocab_size: tokens.len(),
        // Stored as an f32 (1e-6 reads as 9.99999997e-7): kept as stored.
        rms_norm_eps: g.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
        rope_theta: match g.get(&key("rope.freq_base")) {
            Some(_) => g.get_f64(&key("rope.freq_base"))?,
            None => DEFAULT_ROPE_BASE,
        },
        max_position_embeddings: num("context_length")?,
        num_experts: num("expert_count")?,
        num_experts_per_tok: used,
        // No key says it: llama.cpp's qwen3moe graph always renormalises the top-k
        // weights (`build_moe_ffn(..., LLM_FFN_SILU, true /* norm_w */, ...)` in
        // `src/models/qwen3moe.cpp`), and transformers' GGUF loader defaults it to true.
        norm_topk_prob: true,
        decoder_sparse_step: 1,
        // A layer without a router is a dense SwiGLU layer (ffn_gate/ffn_up/ffn_down).
        mlp_only_layers: (0..layers).filter(|l| !has(format!("blk.{l}.ffn_gate_inp.weight"))).collect(),
        tie_word_embeddings: !has("output.weight".into()),
        eos_token_ids: eos,
        hybrid: None,
    };
    cfg.validate().map_err(|e| anyhow::anyhow!("the model the GGUF metadata describes is invalid: {e}"))?;
    check_tensors(g, &cfg)?;
    Ok(cfg)
}

/// Checks that `g` holds exactly the tensors a model of `cfg` reads (as llama.cpp's
/// loader does: an extra tensor, such as an attention bias, is something the model
/// would compute with), each of the shape `cfg` implies and of a type the engine
/// computes with.
fn check_tensors(g: &GgufFile, cfg: &ModelConfig) -> Result<()> {
    let want = gguf_tensors(cfg);
    let extra: Vec<&str> =
        g.tensors().iter().map(|t| t.name.as_str()).filter(|n| !want.contains_key(*n)).collect();
    if !extra.is_empty() {
        bail!(
            "the GGUF file holds {} tensor(s) a {} model does not use: {}",
            extra.len(),
            cfg.architecture,
            extra.join(", ")
        );
    }
    for (name, shape) in &want {
        let t = g.tensor(name).context("the GGUF file is incomplete")?;
        if t.shape() != *shape {
            bail!("GGUF tensor {name} has shape {:?}, the metadata implies {shape:?}", t.shape());
        }
    }
    Ok(g.check_supported()?)
}

/// Converts the GGUF model at `path` (for a split model its first part) into the vault
/// `out`; returns the manifest written.
pub fn convert(path: &Path, out: &Path, force: bool) -> Result<Manifest> {
    let g = GgufFile::open(path)?;
    let context = || format!("cannot convert {}", path.display());
    let cfg = model_config(&g).with_context(context)?;
    let tokenizer_files = gguf_tokenizer::tokenizer_files(&g).with_context(context)?;
    let files: Vec<String> = g.parts().iter().map(|p| p.path.display().to_string()).collect();
    eprintln!("reading the GGUF model {}", files.join(", "));
    let spec = VaultSpec {
        out,
        cfg: &cfg,
        // Not used: the source keeps every tensor's own type.
        dtype: DType::F32,
        quant: None,
        keep_resident: false,
        force,
        tokenizer_dir: None,
        tokenizer_files,
        label: "converting",
    };
    write_vault(&spec, &mut GgufSource::new(&g))
}

/// A GGUF file as a tensor source: every matrix (and each expert's slice of the stacked
/// expert tensors) kept in its GGUF format, its bytes copied, never requantised; vectors
/// (norm weights), which the engine reads as f32, dequantised to f32 (exactly) when the
/// GGUF stores them otherwise.
pub struct GgufSource<'a> {
    g: &'a GgufFile,
    buf: Vec<u8>,
    row: Vec<f32>,
}

impl<'a> GgufSource<'a> {
    /// A source reading `g`, whose tensors [`model_config`] has checked.
    pub fn new(g: &'a GgufFile) -> Self {
        GgufSource { g, buf: Vec::new(), row: Vec::new() }
    }

    /// The GGUF tensor holding vault tensor `name`, and the bytes of its slice.
    fn slice(&self, name: &str) -> Result<(GgmlType, &'a [u8])> {
        let s = gguf_slice(name).with_context(|| format!("no GGUF tensor holds {name}"))?;
        let t = self.g.tensor(&s.tensor)?;
        let data = self.g.tensor_data(&s.tensor)?;
        Ok(match s.expert {
            None => (t.ty, data),
            Some(e) => {
                let per = data.len() / t.dims.last().map_or(1, |&n| n as usize);
                (
                    t.ty,
                    data.get(e * per..(e + 1) * per)
                        .with_context(|| format!("{} has no expert {e}", s.tensor))?,
                )
            }
        })
    }
}

impl TensorSource for GgufSource<'_> {
    fn dtype(&self, name: &str, shape: &[usize], _default: DType) -> DType {
        match self.slice(name) {
            // Every type model_config let through (GgmlType::SUPPORTED) has a DType.
            Ok((ty, _)) if shape.len() > 1 => DType::from_ggml(ty).unwrap_or(DType::F32),
            _ => DType::F32,
        }
    }

    fn stream(
        &mut self,
        name: &str,
        shape: &[usize],
        to: DType,
        emit: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (ty, bytes) = self.slice(name)?;
        if DType::from_ggml(ty) == Some(to) {
            return bytes.chunks(STREAM_BYTES).try_for_each(&mut *emit);
        }
        if to != DType::F32 {
            bail!("internal error: GGUF tensor for {name} ({ty}) cannot be stored as {}", to.name());
        }
        let cols = shape.last().copied().unwrap_or(1);
        let row_bytes = ty.row_bytes(cols).with_context(|| format!("{name}: rows of {cols} {ty} values"))?;
        self.row.resize(cols, 0.0);
        let rows_per_chunk = (STREAM_BYTES / (4 * cols)).max(1);
        for chunk in bytes.chunks(row_bytes * rows_per_chunk) {
            self.buf.clear();
            for row in chunk.chunks(row_bytes) {
                dequantize_row(ty, row, &mut self.row).with_context(|| format!("dequantising {name}"))?;
                self.buf.extend(self.row.iter().flat_map(|v| v.to_le_bytes()));
            }
            emit(&self.buf)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use smoe_actors::model::Model;
    use smoe_actors::vault::Vault;

    use super::*;
    use crate::convert::gguf::tests::{gstr, strings, u32b, Builder};

    const H: u64 = 32;
    const HEADS: u64 = 2;
    const EXPERTS: u64 = 2;
    const MOE_FF: u64 = 32;
    const FF: u64 = 64;
    const TOKENS: [&str; 4] = ["a", "b", "ab", "<|im_end|>"];

    /// A two-layer qwen3moe model: layer 0 dense (no router), layer 1 MoE, tied
    /// embeddings, no `key_length` (head_dim = hidden / heads) and no `rope.freq_base`.
    fn model() -> Builder {
        let f32b = |v: f32| v.to_le_bytes().to_vec();
        let mut types = u32b(5);
        types.extend(4u64.to_le_bytes());
        [1i32, 1, 1, 3].iter().for_each(|t| types.extend(t.to_le_bytes()));
        let mut b = Builder::new()
            .kv(b"qwen3moe.embedding_length", 4, u32b(H as u32))
            .kv(b"qwen3moe.block_count", 4, u32b(2))
            .kv(b"qwen3moe.attention.head_count", 4, u32b(HEADS as u32))
            .kv(b"qwen3moe.expert_count", 4, u32b(EXPERTS as u32))
            .kv(b"qwen3moe.expert_used_count", 4, u32b(1))
            .kv(b"qwen3moe.expert_feed_forward_length", 4, u32b(MOE_FF as u32))
            .kv(b"qwen3moe.feed_forward_length", 4, u32b(FF as u32))
            .kv(b"qwen3moe.context_length", 4, u32b(64))
            .kv(b"qwen3moe.attention.layer_norm_rms_epsilon", 6, f32b(1e-6))
            .kv(b"tokenizer.ggml.model", 8, gstr(b"gpt2"))
            .kv(b"tokenizer.ggml.pre", 8, gstr(b"qwen2"))
            .kv(b"tokenizer.ggml.tokens", 9, strings(&TOKENS))
            .kv(b"tokenizer.ggml.token_type", 9, types)
            .kv(b"tokenizer.ggml.merges", 9, strings(&["a b"]))
            .kv(b"tokenizer.ggml.eos_token_id", 4, u32b(1))
            .tensor("token_embd.weight", &[H, TOKENS.len() as u64], GgmlType::F32)
            .tensor("output_norm.weight", &[H], GgmlType::F32);
        for l in 0..2 {
            let t = |n: &str| format!("blk.{l}.{n}.weight");
            let hd = H / HEADS;
            b = b
                .tensor(&t("attn_norm"), &[H], GgmlType::F32)
                .tensor(&t("attn_q"), &[H, H], GgmlType::Bf16)
                .tensor(&t("attn_k"), &[H, H], GgmlType::F16)
                .tensor(&t("attn_v"), &[H, H], GgmlType::F32)
                .tensor(&t("attn_output"), &[H, H], GgmlType::Bf16)
                .tensor(&t("attn_q_norm"), &[hd], GgmlType::F32)
                .tensor(&t("attn_k_norm"), &[hd], GgmlType::F32)
                .tensor(&t("ffn_norm"), &[H], GgmlType::F16);
            b = if l == 0 {
                b.tensor(&t("ffn_gate"), &[H, FF], GgmlType::F32)
                    .tensor(&t("ffn_up"), &[H, FF], GgmlType::F32)
                    .tensor(&t("ffn_down"), &[FF, H], GgmlType::F32)
            } else {
                b.tensor(&t("ffn_gate_inp"), &[H, EXPERTS], GgmlType::F32)
                    .tensor(&t("ffn_gate_exps"), &[H, MOE_FF, EXPERTS], GgmlType::Bf16)
                    .tensor(&t("ffn_up_exps"), &[H, MOE_FF, EXPERTS], GgmlType::Bf16)
                    .tensor(&t("ffn_down_exps"), &[MOE_FF, H, EXPERTS], GgmlType::Bf16)
            };
        }
        b
    }

    #[test]
    fn every_vault_tensor_has_a_gguf_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let g = GgufFile::open(&model().write(dir.path(), "m.gguf")).unwrap();
        let mut cfg = model_config(&g).unwrap();
        cfg.tie_word_embeddings = false;
        for (name, _) in crate::vault_writer::resident_tensors(&cfg) {
            assert!(gguf_slice(&name).is_some(), "{name}");
        }
        let s = gguf_slice("model.layers.7.mlp.experts.12.down_proj.weight").unwrap();
        assert_eq!(s, GgufSlice { tensor: "blk.7.ffn_down_exps.weight".into(), expert: Some(12) });
        assert_eq!(gguf_slice("model.layers.1.mlp.experts.x.down_proj.weight"), None);
        assert_eq!(gguf_slice("model.layers.1.self_attn.q_proj.bias"), None);
        assert_eq!(gguf_tensors(&cfg)["output.weight"], [TOKENS.len() as u64, H]);
    }

    #[test]
    fn config_dense_layers_tied_embeddings_and_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let g = GgufFile::open(&model().write(dir.path(), "m.gguf")).unwrap();
        let cfg = model_config(&g).unwrap();
        assert_eq!(cfg.mlp_only_layers, [0]);
        assert_eq!(cfg.moe_layers(), [1]);
        assert!(cfg.tie_word_embeddings && cfg.norm_topk_prob);
        assert_eq!((cfg.head_dim, cfg.num_key_value_heads), ((H / HEADS) as usize, HEADS as usize));
        assert_eq!((cfg.intermediate_size, cfg.moe_intermediate_size), (FF as usize, MOE_FF as usize));
        assert_eq!(cfg.rope_theta, DEFAULT_ROPE_BASE);
        assert_eq!(cfg.rms_norm_eps, 1e-6f32);
        assert_eq!((cfg.vocab_size, cfg.max_position_embeddings), (4, 64));
        // tokenizer.ggml.eos_token_id, then <|im_end|> by name.
        assert_eq!(cfg.eos_token_ids, [1, 3]);
    }

    /// The converted vault opens, every tensor resolves at the shape the engine needs,
    /// the matrices keep their types, norms are f32 (an f16 one dequantised), and the
    /// tokenizer loads.
    #[test]
    fn converts_to_a_vault_the_engine_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = model().write(dir.path(), "m.gguf");
        let out = dir.path().join("vault");
        let m = convert(&path, &out, false).unwrap();
        assert_eq!(m.experts.layers[0].layout.types(), [DType::Bf16; 3]);
        let dtype = |n: &str| m.resident.tensors.iter().find(|t| t.name == n).unwrap().dtype;
        assert_eq!(dtype("model.layers.0.self_attn.q_proj.weight"), DType::Bf16);
        assert_eq!(dtype("model.layers.0.self_attn.k_proj.weight"), DType::F16);
        assert_eq!(dtype("model.layers.0.post_attention_layernorm.weight"), DType::F32);
        let vault = Arc::new(Vault::open(&out).unwrap());
        Model::load(vault, 64).unwrap();
        let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        assert_eq!(tok.encode("abab<|im_end|>", true).unwrap().get_ids(), [2, 2, 3]);
    }

    /// Every expert's gate/up/down slices are the GGUF's bytes unchanged (a Q4_K_M-like
    /// file: Q4_K gate/up, Q6_K down), each blob's checksum holds, and the resident
    /// matrices keep their GGUF types and bytes.
    #[test]
    fn expert_slices_and_resident_matrices_keep_the_gguf_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf_q4_k_m/model.gguf");
        let out = dir.path().join("vault");
        let m = convert(&path, &out, false).unwrap();
        let g = GgufFile::open(&path).unwrap();
        for layer in &m.experts.layers {
            let file = std::fs::read(out.join(&layer.file)).unwrap();
            assert_eq!(layer.layout.types(), [DType::Q4K, DType::Q4K, DType::Q6K]);
            for (e, blob) in layer.blobs.iter().enumerate() {
                let b = &file[blob.offset as usize..(blob.offset + layer.layout.blob_len) as usize];
                assert_eq!(crc32c::crc32c(b), blob.crc32c);
                for ((part, p), (_, gname)) in layer.layout.parts().into_iter().zip(EXPERT_TENSORS) {
                    let stacked = g.tensor_data(&format!("blk.{}.{gname}.weight", layer.layer)).unwrap();
                    let per = stacked.len() / m.model.num_experts;
                    assert!(
                        p.slice(b) == &stacked[e * per..(e + 1) * per],
                        "layer {} expert {e} {part}",
                        layer.layer
                    );
                }
            }
        }
        let resident = std::fs::read(out.join(&m.resident.file)).unwrap();
        for t in &m.resident.tensors {
            let s = gguf_slice(&t.name).unwrap();
            let ty = g.tensor(&s.tensor).unwrap().ty;
            let bytes = &resident[t.offset as usize..(t.offset + t.len) as usize];
            if t.shape.len() == 2 {
                assert_eq!(t.dtype.ggml(), ty, "{}", t.name);
                assert!(bytes == g.tensor_data(&s.tensor).unwrap(), "{}", t.name);
            } else {
                assert_eq!(t.dtype, DType::F32, "{}", t.name);
            }
        }
    }

    #[test]
    fn files_the_model_does_not_match_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = |b: Builder| -> String {
            let g = GgufFile::open(&b.write(dir.path(), "m.gguf")).unwrap();
            format!("{:#}", model_config(&g).unwrap_err())
        };
        let e = err(model().tensor("blk.0.attn_q.bias", &[H], GgmlType::F32));
        assert!(e.contains("does not use: blk.0.attn_q.bias"), "{e}");
        let e = err(model().kv(b"qwen3moe.attention.key_length", 4, u32b(8)));
        assert!(e.contains("has shape [32, 32], the metadata implies [16, 32]"), "{e}");
        let e = err(model().kv(b"qwen3moe.rope.scaling.type", 8, gstr(b"yarn")));
        assert!(e.contains("rope.scaling.type is \"yarn\""), "{e}");
        let mut no_layers = model();
        no_layers.kv.retain(|(k, ..)| k != b"qwen3moe.block_count");
        assert!(err(no_layers).contains("qwen3moe.block_count is missing"));
    }
}
