//! `smoe-pipeline convert`: a HuggingFace checkpoint directory or a GGUF file becomes a
//! vault — a manifest, one file of resident tensors, one file of aligned expert blobs per
//! MoE layer, and the tokenizer files. Tensors are streamed in fixed-size steps, a few per
//! thread at a time, so memory stays bounded whatever the checkpoint's size.

pub mod checkpoint;
pub mod gguf;
pub mod gguf_model;
pub mod gguf_tokenizer;
pub mod hf_config;
pub mod layout;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use smoe_actors::cpu::quantize::encode_rows;
use smoe_proto::{DType, Manifest, ModelConfig};

use crate::quant::Quant;
use crate::vault_writer::{encode_steps, write_vault, TensorSource, VaultSpec};

use checkpoint::{Checkpoint, SrcDtype};

/// Elements converted per step when streaming a tensor.
const STREAM_ELEMS: usize = 1 << 20;
/// Bytes handed on per step when streaming a tensor.
const STREAM_BYTES: usize = 4 << 20;

/// Converts the raw little-endian bytes of `src` (whole rows of `cols` elements of `from`)
/// to `to`, appending to `out`: copied when the types agree, else widened exactly to f32
/// (through `vals`) and stored by [`encode_rows`].
fn convert_elems(
    src: &[u8],
    from: SrcDtype,
    to: DType,
    cols: usize,
    vals: &mut Vec<f32>,
    out: &mut Vec<u8>,
) -> Result<()> {
    let widen: fn(&[u8]) -> f32 = match (from, to) {
        (SrcDtype::F32, DType::F32) | (SrcDtype::Bf16, DType::Bf16) | (SrcDtype::F16, DType::F16) => {
            out.extend_from_slice(src);
            return Ok(());
        }
        (SrcDtype::F32, _) => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        (SrcDtype::Bf16, _) => |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        (SrcDtype::F16, _) => |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
    };
    vals.clear();
    vals.extend(src.chunks_exact(from.size()).map(widen));
    Ok(encode_rows(vals, cols, to, out)?)
}

/// Elements converted per step for rows of `cols` elements: whole rows (so block formats
/// can be quantised), about [`STREAM_ELEMS`] of them, at least one row.
fn step_elems(cols: usize) -> usize {
    let cols = cols.max(1);
    (STREAM_ELEMS / cols).max(1) * cols
}

/// What a conversion reads.
pub enum Source {
    /// A HuggingFace checkpoint directory.
    Hf(PathBuf),
    /// A GGUF file (the first part of a split model).
    Gguf(PathBuf),
}

/// Options of one conversion.
pub struct ConvertOptions {
    /// The model to convert.
    pub source: Source,
    /// Vault directory to create.
    pub out: PathBuf,
    /// Element type of a HuggingFace checkpoint's weight matrices; `None` keeps bf16
    /// checkpoints bf16 and converts everything else to f32 (both exact). A GGUF's
    /// tensors keep their formats.
    pub dtype: Option<DType>,
    /// How the expert matrices (and, unless `keep_resident`, the resident ones) are
    /// quantised (`None`: stored as `dtype`).
    pub quant: Option<Quant>,
    /// Store resident weight matrices as `dtype` even under `quant`.
    pub keep_resident: bool,
    /// Overwrite an existing vault.
    pub force: bool,
}

/// A checkpoint as a tensor source: each tensor is streamed from its memory map in
/// fixed-size steps converted on every core ([`encode_steps`]), its rows taken as
/// [`layout::recipe`] says.
struct CheckpointSource<'a> {
    ckpt: &'a Checkpoint,
    cfg: &'a ModelConfig,
}

impl TensorSource for CheckpointSource<'_> {
    fn stream(
        &mut self,
        name: &str,
        shape: &[usize],
        to: DType,
        emit: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let recipe = layout::recipe(self.cfg, self.ckpt, name, shape)?;
        let cols = shape.last().copied().unwrap_or(1);
        if recipe.add_one && to != DType::F32 {
            bail!("internal error: the zero-centred norm `{name}` must be stored as f32");
        }
        for (src, ranges) in &recipe.parts {
            let (info, bytes) = self.ckpt.tensor(src)?;
            let (from, add_one) = (info.dtype, recipe.add_one);
            let row_bytes = cols * from.size();
            let step = step_elems(cols) * from.size();
            for rows in ranges {
                let part = &bytes[rows.start * row_bytes..rows.end * row_bytes];
                let convert = |vals: &mut Vec<f32>, s: usize| -> Result<Vec<u8>> {
                    let mut out = Vec::new();
                    convert_elems(
                        &part[s * step..part.len().min((s + 1) * step)],
                        from,
                        to,
                        cols,
                        vals,
                        &mut out,
                    )
                    .with_context(|| format!("tensor `{name}`"))?;
                    if add_one {
                        for b in out.chunks_exact_mut(4) {
                            let v = 1.0 + f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                            b.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    Ok(out)
                };
                encode_steps(part.len().div_ceil(step), convert, emit)?;
            }
        }
        Ok(())
    }
}

/// Says which checkpoint tensors the engine does not run (a vision tower, multi-token
/// prediction heads): they are left out of the vault.
fn log_skipped(ckpt: &Checkpoint) {
    let count = |f: &dyn Fn(&str) -> bool| ckpt.tensors.keys().filter(|n| f(n)).count();
    let vision = count(&|n| n.starts_with("model.visual.") || n.starts_with("visual."));
    let mtp = count(&|n| n.starts_with("mtp."));
    if vision > 0 {
        eprintln!("skipping {vision} vision tensors (the engine runs the text model)");
    }
    if mtp > 0 {
        eprintln!("skipping {mtp} multi-token-prediction (MTP) tensors");
    }
}

/// Runs a conversion; returns the manifest written.
pub fn convert(opts: &ConvertOptions) -> Result<Manifest> {
    match &opts.source {
        Source::Hf(dir) => convert_hf(dir, opts),
        Source::Gguf(path) => gguf_model::convert(path, &opts.out, opts.force),
    }
}

/// Converts the HuggingFace checkpoint in `hf`.
fn convert_hf(hf: &Path, opts: &ConvertOptions) -> Result<Manifest> {
    let cfg = hf_config::read_model_config(hf)?;
    let ckpt = Checkpoint::open(hf)?;
    let files: Vec<String> = ckpt
        .shards
        .iter()
        .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned())
        .collect();
    eprintln!("reading the checkpoint {}: {}", hf.display(), files.join(", "));
    log_skipped(&ckpt);
    let all_bf16 = ckpt.tensors.values().filter(|t| t.shape.len() == 2).all(|t| t.dtype == SrcDtype::Bf16);
    let dtype = opts.dtype.unwrap_or(if all_bf16 { DType::Bf16 } else { DType::F32 });
    let spec = VaultSpec {
        out: &opts.out,
        cfg: &cfg,
        dtype,
        quant: opts.quant,
        keep_resident: opts.keep_resident,
        force: opts.force,
        tokenizer_dir: Some(hf),
        tokenizer_files: Vec::new(),
        label: "converting",
    };
    let mut src = CheckpointSource { ckpt: &ckpt, cfg: &cfg };
    write_vault(&spec, &mut src)
}
