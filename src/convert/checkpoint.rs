//! A HuggingFace safetensors checkpoint opened for streaming: every shard is
//! memory-mapped and only its header is parsed; tensor bytes are read from the maps on
//! demand, so converting never loads a whole file into memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

/// Element types a checkpoint tensor may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SrcDtype {
    /// binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// binary16.
    F16,
}

impl SrcDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            SrcDtype::F32 => 4,
            SrcDtype::Bf16 | SrcDtype::F16 => 2,
        }
    }
}

/// One tensor's place in a shard.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Index of the shard in [`Checkpoint::shards`].
    pub shard: usize,
    /// Element type.
    pub dtype: SrcDtype,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub start: usize,
    /// End of the byte range.
    pub end: usize,
}

/// Index of a sharded checkpoint: tensor name → shard file.
const INDEX_FILE: &str = "model.safetensors.index.json";
/// The file of a single-file checkpoint.
const SINGLE_FILE: &str = "model.safetensors";

/// The safetensors files that hold the model in `dir`: the shards [`INDEX_FILE`] names
/// (each must exist), else [`SINGLE_FILE`], else the `model-*.safetensors` shards.
fn model_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text =
            std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json.get("weight_map").and_then(|m| m.as_object()).with_context(|| {
            format!("{}: field `weight_map` is missing or not an object", index.display())
        })?;
        let mut names: Vec<&str> = map
            .values()
            .map(|v| v.as_str())
            .collect::<Option<_>>()
            .with_context(|| format!("{}: `weight_map` values must be file names", index.display()))?;
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            bail!("{}: `weight_map` is empty", index.display());
        }
        let files: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            bail!(
                "{} names the shard {}, which is missing; download every shard the index lists",
                index.display(),
                missing.display()
            );
        }
        return Ok(files);
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model-") && n.ends_with(".safetensors"))
        })
        .collect();
    if files.is_empty() {
        bail!("no {INDEX_FILE}, {SINGLE_FILE} or model-*.safetensors in {}", dir.display());
    }
    files.sort();
    Ok(files)
}

/// The tensors the header of the safetensors file `path` (shard `shard`, bytes `map`)
/// lists, with their extents in `map` (checked to lie inside it).
pub fn read_header(path: &Path, shard: usize, map: &[u8]) -> Result<Vec<(String, TensorInfo)>> {
    let (header_len, meta) = SafeTensors::read_metadata(map)
        .with_context(|| format!("{} is not a valid safetensors file", path.display()))?;
    let base = 8 + header_len;
    let mut tensors = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = match info.dtype {
            Dtype::F32 => SrcDtype::F32,
            Dtype::BF16 => SrcDtype::Bf16,
            Dtype::F16 => SrcDtype::F16,
            other => bail!(
                "{}: tensor `{name}` has dtype {other:?}; supported dtypes are F32, BF16 and F16",
                path.display()
            ),
        };
        let (s, e) = info.data_offsets;
        let (Some(start), Some(end)) = (base.checked_add(s), base.checked_add(e)) else {
            bail!("{}: tensor `{name}` has data offsets {s}..{e} that overflow", path.display());
        };
        if start > end || end > map.len() {
            bail!(
                "{}: tensor `{name}` has data offsets {s}..{e} outside the file's {} data bytes",
                path.display(),
                map.len().saturating_sub(base)
            );
        }
        tensors.push((name.clone(), TensorInfo { shard, dtype, shape: info.shape.clone(), start, end }));
    }
    Ok(tensors)
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    /// Shard file paths.
    pub shards: Vec<PathBuf>,
    maps: Vec<Mmap>,
    /// Every tensor by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: the files [`model_files`] picks. Other safetensors
    /// files (`consolidated.safetensors`, adapters, ...) are not read.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let shards = model_files(dir)?;
        let mut maps = Vec::with_capacity(shards.len());
        let mut tensors = BTreeMap::new();
        for (si, path) in shards.iter().enumerate() {
            let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the checkpoint is read-only input; it must not change during conversion.
            let map =
                unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
            for (name, t) in read_header(path, si, &map)? {
                if let Some(first) = tensors.insert(name.clone(), t) {
                    bail!(
                        "tensor `{name}` is in two files of the checkpoint: {} and {}",
                        shards[first.shard].display(),
                        path.display()
                    );
                }
            }
            maps.push(map);
        }
        Ok(Checkpoint { shards, maps, tensors })
    }

    /// Looks up `name`, whatever its shape.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let info = self.tensors.get(name).with_context(|| {
            format!("tensor `{name}` is missing from the checkpoint ({} shard(s))", self.shards.len())
        })?;
        Ok((info, &self.maps[info.shard][info.start..info.end]))
    }
}
