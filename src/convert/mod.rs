//! `smoe-pipeline convert`: a HuggingFace checkpoint directory becomes a vault — a
//! manifest, one file of resident tensors, one file of aligned expert blobs per MoE
//! layer, and the tokenizer files. Tensors are streamed through a fixed-size buffer,
//! so memory stays bounded whatever the checkpoint's size.

pub mod checkpoint;
pub mod gguf;
pub mod hf_config;

use std::path::PathBuf;

use anyhow::Result;
use smoe_proto::{DType, Manifest};

use crate::vault_writer::{write_vault, TensorSource, VaultSpec};

use checkpoint::{Checkpoint, SrcDtype};

/// Elements converted per step when streaming a tensor.
const STREAM_ELEMS: usize = 1 << 20;

/// Converts the raw little-endian bytes of `src` (elements of `from`) to `to`,
/// appending to `out`. Widening is exact; narrowing f32 → bf16 rounds to nearest even.
fn convert_elems(src: &[u8], from: SrcDtype, to: DType, out: &mut Vec<u8>) {
    let f32_at = |i: usize| -> f32 {
        match from {
            SrcDtype::F32 => f32::from_le_bytes([src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3]]),
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

/// A checkpoint as a tensor source: each tensor is streamed from its memory map
/// through a fixed-size conversion buffer.
struct CheckpointSource<'a> {
    ckpt: &'a Checkpoint,
    buf: Vec<u8>,
}

impl TensorSource for CheckpointSource<'_> {
    fn stream(
        &mut self,
        name: &str,
        shape: &[usize],
        to: DType,
        emit: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (info, bytes) = self.ckpt.get(name, shape)?;
        let es = if info.dtype == SrcDtype::F32 { 4 } else { 2 };
        for chunk in bytes.chunks(STREAM_ELEMS * es) {
            self.buf.clear();
            convert_elems(chunk, info.dtype, to, &mut self.buf);
            emit(&self.buf)?;
        }
        Ok(())
    }
}

/// Runs a conversion; returns the manifest written.
pub fn convert(opts: &ConvertOptions) -> Result<Manifest> {
    let cfg = hf_config::read_model_config(&opts.hf)?;
    let ckpt = Checkpoint::open(&opts.hf)?;
    let files: Vec<String> = ckpt
        .shards
        .iter()
        .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned())
        .collect();
    eprintln!("reading the checkpoint {}: {}", opts.hf.display(), files.join(", "));
    let all_bf16 = ckpt.tensors.values().filter(|t| t.shape.len() == 2).all(|t| t.dtype == SrcDtype::Bf16);
    let dtype = opts.dtype.unwrap_or(if all_bf16 { DType::Bf16 } else { DType::F32 });
    let spec = VaultSpec {
        out: &opts.out,
        cfg: &cfg,
        dtype,
        force: opts.force,
        tokenizer_dir: Some(&opts.hf),
        label: "converting",
    };
    write_vault(&spec, &mut CheckpointSource { ckpt: &ckpt, buf: Vec::with_capacity(STREAM_ELEMS * 4) })
}
