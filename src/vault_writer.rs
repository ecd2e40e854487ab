//! Writing a vault: the resident tensor file, one file of 16 KiB-aligned expert blobs
//! per MoE layer, the tokenizer files, and the manifest. Everything is written into a
//! staging directory beside the target, which takes the target's place only when complete
//! ([`Staging`]): a failed run leaves the target as it was and removes what it wrote.
//! Tensor bytes come from a [`TensorSource`] in bounded chunks: a checkpoint being
//! converted, or the random generator of `synth`. Both encode a tensor's steps on every
//! core and hand them on in order ([`encode_steps`]).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::atomic_dir::Staging;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use smoe_proto::{
    align_up, tensor_bytes, BlobEntry, DType, ExpertIndex, ExpertLayout, LayerBlobs, LayerType, Manifest,
    ModelConfig, ResidentIndex, TensorEntry, BLOB_ALIGN, FORMAT_VERSION, MANIFEST_FILE,
};

use crate::quant::Quant;

/// Name of the resident tensor file inside a vault.
pub const RESIDENT_FILE: &str = "resident.bin";

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

/// Where tensor data comes from.
pub trait TensorSource {
    /// The element type tensor `name` of `shape` is stored in when the vault's weight type
    /// is `dtype`: by default `dtype` for matrices, f32 for vectors (norms) and the
    /// DeltaNet convolution taps. Asked for
    /// every resident tensor, and for each expert matrix of a layer through expert 0's
    /// (every expert of a layer shares one layout).
    fn dtype(&self, name: &str, shape: &[usize], dtype: DType) -> DType {
        resident_dtype(name, shape, dtype)
    }

    /// Streams tensor `name` (which must have `shape`) converted to `to`, handing the
    /// bytes to `emit` in chunks of bounded size, each a whole number of rows (so block
    /// formats are quantised row by row: `cpu::quantize::encode_rows`).
    fn stream(
        &mut self,
        name: &str,
        shape: &[usize],
        to: DType,
        emit: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()>;
}

/// Steps of a tensor [`encode_steps`] has in flight per thread.
const STEPS_PER_THREAD: usize = 2;

/// Encodes steps `0..steps` of a tensor on every core (rayon) and hands their bytes to
/// `emit` in step order, so the bytes do not depend on the number of threads:
/// `encode(vals, s)` returns step `s`'s bytes, `vals` being a scratch buffer of values it
/// may use (one per rayon job). Steps go in batches of [`STEPS_PER_THREAD`] per thread,
/// so at most that many steps' bytes per thread wait to be written. As in a serial loop,
/// the first failing step's error is returned after the steps before it were emitted.
pub fn encode_steps(
    steps: usize,
    encode: impl Fn(&mut Vec<f32>, usize) -> Result<Vec<u8>> + Sync,
    emit: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let batch = STEPS_PER_THREAD * rayon::current_num_threads();
    for first in (0..steps).step_by(batch) {
        let encoded: Vec<Result<Vec<u8>>> =
            (first..steps.min(first + batch)).into_par_iter().map_init(Vec::new, &encode).collect();
        for bytes in encoded {
            emit(&bytes?)?;
        }
    }
    Ok(())
}

/// Writes bytes while tracking the file offset and a progress bar.
struct Sink<'a> {
    w: BufWriter<File>,
    path: PathBuf,
    pos: u64,
    bar: &'a ProgressBar,
}

impl<'a> Sink<'a> {
    fn create(path: PathBuf, bar: &'a ProgressBar) -> Result<Sink<'a>> {
        let f = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Sink { w: BufWriter::with_capacity(1 << 22, f), path, pos: 0, bar })
    }

    fn write(&mut self, b: &[u8]) -> Result<()> {
        self.w.write_all(b).with_context(|| format!("cannot write {}", self.path.display()))?;
        self.pos += b.len() as u64;
        self.bar.inc(b.len() as u64);
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

    /// Streams one tensor from `src`; returns the crc32c of its bytes, continued from `crc`.
    fn tensor(
        &mut self,
        src: &mut dyn TensorSource,
        name: &str,
        shape: &[usize],
        to: DType,
        crc: u32,
    ) -> Result<u32> {
        let mut crc = crc;
        src.stream(name, shape, to, &mut |b| {
            crc = crc32c::crc32c_append(crc, b);
            self.write(b)
        })?;
        Ok(crc)
    }
}

/// Names and shapes of every resident tensor the model needs, in file order.
pub fn resident_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let mut v = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mut t = |name: &str, shape: Vec<usize>| v.push((format!("{p}.{name}"), shape));
        t("input_layernorm.weight", vec![h]);
        match (cfg.layer_type(l), &cfg.hybrid) {
            (LayerType::LinearAttention, Some(hy)) => {
                let nv = hy.linear_num_value_heads;
                t("linear_attn.in_proj.weight", vec![hy.in_proj_dim(), h]);
                t("linear_attn.conv1d.weight", vec![hy.conv_dim(), hy.linear_conv_kernel_dim]);
                t("linear_attn.A_log", vec![nv]);
                t("linear_attn.dt_bias", vec![nv]);
                t("linear_attn.norm.weight", vec![hy.linear_value_head_dim]);
                t("linear_attn.out_proj.weight", vec![h, hy.value_dim()]);
            }
            _ => {
                t("self_attn.q_proj.weight", vec![cfg.q_dim(), h]);
                if cfg.hybrid.is_some() {
                    t("self_attn.output_gate.weight", vec![cfg.q_dim(), h]);
                }
                t("self_attn.k_proj.weight", vec![cfg.kv_dim(), h]);
                t("self_attn.v_proj.weight", vec![cfg.kv_dim(), h]);
                t("self_attn.o_proj.weight", vec![h, cfg.q_dim()]);
                t("self_attn.q_norm.weight", vec![hd]);
                t("self_attn.k_norm.weight", vec![hd]);
            }
        }
        t("post_attention_layernorm.weight", vec![h]);
        if cfg.is_moe_layer(l) {
            t("mlp.gate.weight", vec![cfg.num_experts, h]);
            let si = cfg.hybrid.as_ref().map_or(0, |hy| hy.shared_expert_intermediate_size);
            if si > 0 {
                t("mlp.shared_expert.gate_proj.weight", vec![si, h]);
                t("mlp.shared_expert.up_proj.weight", vec![si, h]);
                t("mlp.shared_expert.down_proj.weight", vec![h, si]);
                t("mlp.shared_expert_gate.weight", vec![1, h]);
            }
        } else {
            let i = cfg.intermediate_size;
            t("mlp.gate_proj.weight", vec![i, h]);
            t("mlp.up_proj.weight", vec![i, h]);
            t("mlp.down_proj.weight", vec![h, i]);
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

/// Element type a resident tensor is stored in: norms and other vectors (1-D) and the
/// DeltaNet convolution taps always f32, other matrices `dtype`.
pub fn resident_dtype(name: &str, shape: &[usize], dtype: DType) -> DType {
    if shape.len() == 1 || name.ends_with("linear_attn.conv1d.weight") {
        DType::F32
    } else {
        dtype
    }
}

/// The type resident tensor `name` of `shape` is written in: the quantisation scheme's
/// (unless the spec keeps resident matrices), else the source's choice for `spec.dtype`.
fn resident_type(spec: &VaultSpec<'_>, src: &dyn TensorSource, name: &str, shape: &[usize]) -> DType {
    let cfg = spec.cfg;
    spec.quant
        .filter(|_| !spec.keep_resident)
        .and_then(|q| q.resident_type(name, shape, cfg.num_hidden_layers, cfg.tie_word_embeddings))
        .unwrap_or_else(|| src.dtype(name, shape, spec.dtype))
}

/// Bytes the vault's data files will hold (for the progress bar).
fn total_bytes(spec: &VaultSpec<'_>, layouts: &[ExpertLayout], src: &dyn TensorSource) -> u64 {
    let cfg = spec.cfg;
    let resident: u64 = resident_tensors(cfg)
        .iter()
        .filter_map(|(n, s)| tensor_bytes(resident_type(spec, src, n, s), s))
        .sum();
    resident + layouts.iter().map(|l| cfg.num_experts as u64 * l.blob_stride).sum::<u64>()
}

/// What to write.
pub struct VaultSpec<'a> {
    /// Vault directory.
    pub out: &'a Path,
    /// The model.
    pub cfg: &'a ModelConfig,
    /// Element type of resident weight matrices (norms are always f32), and of the
    /// expert matrices unless `quant` says otherwise.
    pub dtype: DType,
    /// How the expert matrices, and the resident weight matrices unless `keep_resident`,
    /// are quantised (`None`: stored as `dtype`).
    pub quant: Option<Quant>,
    /// Store the resident weight matrices as `dtype` even when `quant` is set.
    pub keep_resident: bool,
    /// Overwrite an existing vault.
    pub force: bool,
    /// Directory to copy tokenizer files from.
    pub tokenizer_dir: Option<&'a Path>,
    /// Tokenizer files to write (name, contents), e.g. made from a GGUF's metadata.
    pub tokenizer_files: Vec<(&'static str, String)>,
    /// Progress bar label.
    pub label: &'a str,
}

/// Writes a complete vault from `src`; returns its manifest.
pub fn write_vault(spec: &VaultSpec<'_>, src: &mut dyn TensorSource) -> Result<Manifest> {
    let (cfg, dtype) = (spec.cfg, spec.dtype);
    let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let layouts = cfg
        .moe_layers()
        .into_iter()
        .map(|l| {
            let types = spec.quant.map_or_else(
                || {
                    [("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])].map(
                        |(part, shape)| {
                            src.dtype(&format!("model.layers.{l}.mlp.experts.0.{part}.weight"), &shape, dtype)
                        },
                    )
                },
                |q| q.expert_types(l, cfg.num_hidden_layers, h, i),
            );
            ExpertLayout::new(types, h, i).with_context(|| {
                format!(
                    "layer {l}: experts of {i}×{h} cannot be stored as {}",
                    types.map(DType::name).join("/")
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    check_out_dir(spec.out, spec.force)?;
    let staging = Staging::begin(spec.out)?;
    let out = staging.path();
    let experts = out.join("experts");
    std::fs::create_dir(&experts).with_context(|| format!("cannot create {}", experts.display()))?;
    let bar = ProgressBar::new(total_bytes(spec, &layouts, src)).with_message(spec.label.to_string());
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut sink = Sink::create(out.join(RESIDENT_FILE), &bar)?;
    let mut tensors = Vec::new();
    for (name, shape) in resident_tensors(cfg) {
        sink.pad_to(64)?;
        let offset = sink.pos;
        let to = resident_type(spec, src, &name, &shape);
        let crc32c = sink.tensor(src, &name, &shape, to, 0)?;
        tensors.push(TensorEntry { name, dtype: to, shape, offset, len: sink.pos - offset, crc32c });
    }
    sink.pad_to(64)?;
    let resident = ResidentIndex { file: RESIDENT_FILE.into(), file_len: sink.finish()?, tensors };

    let mut layers = Vec::new();
    for (l, layout) in cfg.moe_layers().into_iter().zip(layouts) {
        let file = expert_file_name(l);
        let mut sink = Sink::create(out.join(&file), &bar)?;
        let mut blobs = Vec::with_capacity(cfg.num_experts);
        for e in 0..cfg.num_experts {
            let offset = sink.pos;
            let p = format!("model.layers.{l}.mlp.experts.{e}");
            let mut crc = 0u32;
            for (part, lay) in layout.parts() {
                let zeros = vec![0u8; (offset + lay.offset - sink.pos) as usize];
                crc = crc32c::crc32c_append(crc, &zeros);
                sink.write(&zeros)?;
                crc =
                    sink.tensor(src, &format!("{p}.{part}.weight"), &[lay.rows, lay.cols], lay.dtype, crc)?;
            }
            if sink.pos - offset != layout.blob_len {
                bail!("internal error: expert blob of layer {l} expert {e} has the wrong length");
            }
            sink.pad_to(BLOB_ALIGN)?;
            blobs.push(BlobEntry { offset, crc32c: crc });
        }
        layers.push(LayerBlobs { layer: l, file, file_len: sink.finish()?, layout, blobs });
    }
    bar.finish_and_clear();

    let mut tokenizer_files = Vec::new();
    for (name, text) in &spec.tokenizer_files {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        tokenizer_files.push(name.to_string());
    }
    if let Some(dir) = spec.tokenizer_dir {
        for name in TOKENIZER_FILES {
            let from = dir.join(name);
            if from.exists() {
                std::fs::copy(&from, out.join(name))
                    .with_context(|| format!("cannot copy {}", from.display()))?;
                tokenizer_files.push(name.to_string());
            }
        }
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        model: cfg.clone(),
        resident,
        experts: ExpertIndex { layers },
        tokenizer_files,
    };
    let path = out.join(MANIFEST_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(&manifest)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    staging.commit()?;
    Ok(manifest)
}

/// Refuses to replace what is at `out` unless it is nothing, an empty directory, an
/// unfinished vault (no valid manifest, only names a vault holds: what an interrupted
/// run of an older build left), or — with `force` — a vault. Anything else is left alone,
/// even with `force`.
fn check_out_dir(out: &Path, force: bool) -> Result<()> {
    let meta = match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => bail!("cannot inspect {}: {e}", out.display()),
        Ok(m) => m,
    };
    if !meta.is_dir() {
        bail!(
            "{} exists and is not a directory (a symbolic link is not followed); choose another --out",
            out.display()
        );
    }
    if holds_vault(out) {
        if !force {
            bail!("{} already holds a vault; pass --force to overwrite it", out.display());
        }
        return Ok(());
    }
    let entries = std::fs::read_dir(out).with_context(|| format!("cannot list {}", out.display()))?;
    for e in entries {
        let name = e?.file_name();
        let name = name.to_string_lossy();
        let ours = name == MANIFEST_FILE || name == RESIDENT_FILE || name == "experts";
        if !ours && !TOKENIZER_FILES.contains(&name.as_ref()) {
            bail!(
                "{} is not a vault but holds `{name}`; choose another --out or empty it (it is not \
                 overwritten, even with --force)",
                out.display()
            );
        }
    }
    Ok(())
}

/// Whether `dir` holds a vault: a regular `manifest.json` that is JSON with a format
/// version (of any version: a vault of another build is still one).
fn holds_vault(dir: &Path) -> bool {
    let path = dir.join(MANIFEST_FILE);
    if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let Ok(text) = std::fs::read(&path) else { return false };
    serde_json::from_slice::<serde_json::Value>(&text).is_ok_and(|m| m["format_version"].is_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_emitted_in_order_up_to_the_first_error() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        // Steps 30 and 17 fail: 17's error comes back, after exactly the steps before it.
        let encode = |_: &mut Vec<f32>, s: usize| -> Result<Vec<u8>> {
            match s {
                17 | 30 => bail!("step {s} failed"),
                _ => Ok(vec![s as u8; s % 3]),
            }
        };
        let mut got = Vec::new();
        let err = pool.install(|| {
            encode_steps(50, encode, &mut |b| {
                got.push(b.to_vec());
                Ok(())
            })
        });
        assert_eq!(err.unwrap_err().to_string(), "step 17 failed");
        assert_eq!(got, (0..17).map(|s| vec![s as u8; s % 3]).collect::<Vec<_>>());
    }
}
