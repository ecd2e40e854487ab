//! `smoe-pipeline convert`: a HuggingFace checkpoint directory becomes a vault — a
//! manifest, one file of resident tensors, one file of aligned expert blobs per MoE
//! layer, and the tokenizer files. Tensors are streamed through a fixed-size buffer,
//! so memory stays bounded whatever the checkpoint's size.

pub mod checkpoint;
pub mod hf_config;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use smoe_proto::{
    align_up, BlobEntry, DType, ExpertIndex, ExpertLayout, LayerBlobs, Manifest, ModelConfig, ResidentIndex,
    TensorEntry, FORMAT_VERSION, MANIFEST_FILE,
};

use checkpoint::{Checkpoint, SrcDtype};

/// Tokenizer and generation files copied into the vault when present.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];

/// Name of the resident tensor file inside a vault.
pub const RESIDENT_FILE: &str = "resident.bin";

/// Elements converted per step when streaming a tensor.
const STREAM_ELEMS: usize = 1 << 20;

/// Converts `n` elements of `src` (raw little-endian bytes of `from`) to `to`,
/// appending to `out`. Widening is exact; narrowing f32 → bf16 rounds to nearest even.
fn convert_elems(src: &[u8], from: SrcDtype, to: DType, out: &mut Vec<u8>) {
    let f32_at = |i: usize| -> f32 {
        match from {
            SrcDtype::F32 => f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().unwrap_or_default()),
            SrcDtype::Bf16 => half::bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32(),
            SrcDtype::F16 => half::f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32(),
        }
    };
    let n = src.len() / if from == SrcDtype::F32 { 4 } else { 2 };
    match (from, to) {
        (SrcDtype::F32, DType::F32) | (SrcDtype::Bf16, DType::Bf16) => out.extend_from_slice(src),
        (_, DType::F32) => (0..n).for_each(|i| out.extend_from_slice(&f32_at(i).to_le_bytes())),
        (_, DType::Bf16) => {
            (0..n).for_each(|i| out.extend_from_slice(&half::bf16::from_f32(f32_at(i)).to_le_bytes()))
        }
    }
}

/// Writes bytes while tracking the file offset.
struct Sink {
    w: BufWriter<File>,
    path: PathBuf,
    pos: u64,
}

impl Sink {
    fn create(path: PathBuf) -> Result<Sink> {
        let f = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Sink { w: BufWriter::with_capacity(1 << 22, f), path, pos: 0 })
    }

    fn write(&mut self, b: &[u8]) -> Result<()> {
        self.w.write_all(b).with_context(|| format!("cannot write {}", self.path.display()))?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> Result<()> {
        let zeros = vec![0u8; (align_up(self.pos, align) - self.pos) as usize];
        self.write(&zeros)
    }

    fn finish(mut self) -> Result<u64> {
        self.w.flush().with_context(|| format!("cannot write {}", self.path.display()))?;
        Ok(self.pos)
    }
}

/// Options of one conversion.
pub struct ConvertOptions {
    /// HuggingFace checkpoint directory.
    pub hf: PathBuf,
    /// Vault directory to create.
    pub out: PathBuf,
    /// Element type of weight matrices; `None` keeps bf16 checkpoints bf16 and
    /// converts everything else to f32 (both exact).
    pub dtype: Option<DType>,
    /// Overwrite an existing vault.
    pub force: bool,
}

struct Converter<'a> {
    ckpt: &'a Checkpoint,
    dtype: DType,
    bar: ProgressBar,
    buf: Vec<u8>,
}

impl Converter<'_> {
    /// Streams tensor `name` (checked against `shape`) into `sink` as `to`; returns its
    /// crc32c.
    fn stream(&mut self, name: &str, shape: &[usize], to: DType, sink: &mut Sink) -> Result<u32> {
        let (info, bytes) = self.ckpt.get(name, shape)?;
        let es = if info.dtype == SrcDtype::F32 { 4 } else { 2 };
        let mut crc = 0u32;
        for chunk in bytes.chunks(STREAM_ELEMS * es) {
            self.buf.clear();
            convert_elems(chunk, info.dtype, to, &mut self.buf);
            crc = crc32c::crc32c_append(crc, &self.buf);
            sink.write(&self.buf)?;
            self.bar.inc(chunk.len() as u64);
        }
        Ok(crc)
    }

    fn resident(
        &mut self,
        name: &str,
        shape: &[usize],
        sink: &mut Sink,
        index: &mut Vec<TensorEntry>,
    ) -> Result<()> {
        sink.pad_to(64)?;
        let offset = sink.pos;
        let to = if shape.len() == 1 { DType::F32 } else { self.dtype };
        let crc32c = self.stream(name, shape, to, sink)?;
        index.push(TensorEntry {
            name: name.to_string(),
            dtype: to,
            shape: shape.to_vec(),
            offset,
            len: sink.pos - offset,
            crc32c,
        });
        Ok(())
    }
}

/// Names and shapes of every resident tensor the model needs, in file order.
fn resident_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let mut v = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        v.push((format!("{p}.input_layernorm.weight"), vec![h]));
        v.push((format!("{p}.self_attn.q_proj.weight"), vec![cfg.q_dim(), h]));
        v.push((format!("{p}.self_attn.k_proj.weight"), vec![cfg.kv_dim(), h]));
        v.push((format!("{p}.self_attn.v_proj.weight"), vec![cfg.kv_dim(), h]));
        v.push((format!("{p}.self_attn.o_proj.weight"), vec![h, cfg.q_dim()]));
        v.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
        v.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        if cfg.is_moe_layer(l) {
            v.push((format!("{p}.mlp.gate.weight"), vec![cfg.num_experts, h]));
        } else {
            let i = cfg.intermediate_size;
            v.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            v.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            v.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
    }
    v.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        v.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    v
}

/// File name of a layer's expert blobs inside a vault.
pub fn expert_file_name(layer: usize) -> String {
    format!("experts/layer_{layer:03}.bin")
}

/// Runs a conversion; returns the manifest written.
pub fn convert(opts: &ConvertOptions) -> Result<Manifest> {
    let cfg = hf_config::read_model_config(&opts.hf)?;
    let ckpt = Checkpoint::open(&opts.hf)?;
    let dtype = match opts.dtype {
        Some(d) => d,
        None => {
            let all_bf16 =
                ckpt.tensors.values().filter(|t| t.shape.len() == 2).all(|t| t.dtype == SrcDtype::Bf16);
            if all_bf16 {
                DType::Bf16
            } else {
                DType::F32
            }
        }
    };
    prepare_out_dir(&opts.out, opts.force)?;
    let total: u64 = ckpt.tensors.values().map(|t| (t.end - t.start) as u64).sum();
    let bar = ProgressBar::new(total).with_message("converting");
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut conv = Converter { ckpt: &ckpt, dtype, bar, buf: Vec::with_capacity(STREAM_ELEMS * 4) };

    let mut sink = Sink::create(opts.out.join(RESIDENT_FILE))?;
    let mut tensors = Vec::new();
    for (name, shape) in resident_tensors(&cfg) {
        conv.resident(&name, &shape, &mut sink, &mut tensors)?;
    }
    sink.pad_to(64)?;
    let resident = ResidentIndex { file: RESIDENT_FILE.into(), file_len: sink.finish()?, tensors };

    let layout = ExpertLayout::new(dtype, cfg.hidden_size, cfg.moe_intermediate_size);
    let mut layers = Vec::new();
    for l in cfg.moe_layers() {
        let file = expert_file_name(l);
        let mut sink = Sink::create(opts.out.join(&file))?;
        let mut blobs = Vec::with_capacity(cfg.num_experts);
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        for e in 0..cfg.num_experts {
            let offset = sink.pos;
            let p = format!("model.layers.{l}.mlp.experts.{e}");
            let mut crc = 0u32;
            for (part, shape, lay) in [
                ("gate_proj", [i, h], layout.gate),
                ("up_proj", [i, h], layout.up),
                ("down_proj", [h, i], layout.down),
            ] {
                let pad = (offset + lay.offset - sink.pos) as usize;
                let zeros = vec![0u8; pad];
                crc = crc32c::crc32c_append(crc, &zeros);
                sink.write(&zeros)?;
                let (info, bytes) = ckpt.get(&format!("{p}.{part}.weight"), &shape)?;
                let es = if info.dtype == SrcDtype::F32 { 4 } else { 2 };
                for chunk in bytes.chunks(STREAM_ELEMS * es) {
                    conv.buf.clear();
                    convert_elems(chunk, info.dtype, dtype, &mut conv.buf);
                    crc = crc32c::crc32c_append(crc, &conv.buf);
                    sink.write(&conv.buf)?;
                    conv.bar.inc(chunk.len() as u64);
                }
            }
            debug_assert_eq!(sink.pos - offset, layout.blob_len);
            sink.pad_to(smoe_proto::BLOB_ALIGN)?;
            blobs.push(BlobEntry { offset, crc32c: crc });
        }
        layers.push(LayerBlobs { layer: l, file, file_len: sink.finish()?, blobs });
    }
    conv.bar.finish_and_clear();

    let mut tokenizer_files = Vec::new();
    for name in TOKENIZER_FILES {
        let src = opts.hf.join(name);
        if src.exists() {
            std::fs::copy(&src, opts.out.join(name))
                .with_context(|| format!("cannot copy {}", src.display()))?;
            tokenizer_files.push(name.to_string());
        }
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        model: cfg,
        resident,
        experts: ExpertIndex { layout, layers },
        tokenizer_files,
    };
    write_manifest(&opts.out, &manifest)?;
    Ok(manifest)
}

/// Writes `manifest.json` last, so a vault whose conversion was interrupted has no
/// manifest and is rejected on open.
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    let path = dir.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(m)?;
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Creates the vault directory (and `experts/`), refusing to overwrite an existing
/// vault unless `force`.
pub fn prepare_out_dir(out: &Path, force: bool) -> Result<()> {
    if out.join(MANIFEST_FILE).exists() {
        if !force {
            bail!("{} already holds a vault; pass --force to overwrite it", out.display());
        }
        std::fs::remove_file(out.join(MANIFEST_FILE))?;
    }
    std::fs::create_dir_all(out.join("experts")).with_context(|| format!("cannot create {}", out.display()))
}
