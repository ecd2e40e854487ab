//! Opening a vault: the manifest is parsed and checked against the files next to it,
//! the resident tensors are memory-mapped (their checksums are verified in the
//! background, see [`integrity`]), and the blob index is kept for the streamer that
//! reads the experts. Every file is opened through [`files`]: only regular files inside
//! the vault directory.

pub mod files;
pub mod integrity;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use smoe_proto::{
    DType, ExpertKey, ExpertLayout, Manifest, TensorEntry, VaultError, BLOB_ALIGN, FORMAT_VERSION,
    MANIFEST_FILE,
};

use crate::tensor::WeightView;
use integrity::ResidentCheck;

/// An opened, validated vault.
pub struct Vault {
    dir: PathBuf,
    manifest: Manifest,
    resident: Arc<Mmap>,
    resident_check: Arc<ResidentCheck>,
    /// For each decoder layer, the index into `manifest.experts.layers` (MoE layers only).
    layer_slot: Vec<Option<usize>>,
}

/// A resident tensor resolved once at load: where it is and its shape.
#[derive(Clone, Debug)]
pub struct TensorRef {
    offset: usize,
    /// Byte length (checked against the shape and type when the vault opened).
    len: usize,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl TensorRef {
    /// The tensor's byte offset in the resident file: unique per tensor, so backends key
    /// their device copies by it.
    pub fn key(&self) -> usize {
        self.offset
    }
}

/// Where one expert blob lives on disk.
#[derive(Clone, Debug)]
pub struct BlobLocation {
    /// Absolute path of the layer file.
    pub file: PathBuf,
    /// Offset of the blob (multiple of [`BLOB_ALIGN`]).
    pub offset: u64,
    /// Payload length covered by the checksum.
    pub len: u64,
    /// Bytes to read so the read stays O_DIRECT-aligned.
    pub stride: u64,
    /// Expected crc32c of the payload.
    pub crc32c: u32,
}

fn manifest_err(file: &Path, reason: impl Into<String>) -> VaultError {
    VaultError::Manifest { file: file.to_path_buf(), reason: reason.into() }
}

impl Vault {
    /// Opens the vault in `dir`, checking the format version, the manifest against the
    /// model configuration, the file sizes and where every tensor and blob lies, and
    /// starts verifying the resident tensors' checksums in the background
    /// ([`Vault::resident_check`]).
    pub fn open(dir: impl AsRef<Path>) -> Result<Vault, VaultError> {
        let dir = dir.as_ref().to_path_buf();
        let manifest = read_manifest(&dir)?;
        let layer_slot = check_manifest(&dir, &manifest)?;
        for l in &manifest.experts.layers {
            check_file_len(&dir, &l.file, l.file_len)?;
        }
        let rfile = check_file_len(&dir, &manifest.resident.file, manifest.resident.file_len)?;
        let rpath = dir.join(&manifest.resident.file);
        // SAFETY: the vault is treated as immutable while open; the map is read-only.
        let resident = unsafe { Mmap::map(&rfile) }.map_err(|e| VaultError::Io {
            file: rpath.clone(),
            offset: 0,
            source: e,
        })?;
        let resident = Arc::new(resident);
        let resident_check = ResidentCheck::start(resident.clone(), manifest.resident.tensors.clone(), rpath);
        Ok(Vault { dir, manifest, resident, resident_check, layer_slot })
    }

    /// The vault directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Layout of the expert blobs of decoder layer `layer`.
    pub fn expert_layout(&self, layer: usize) -> Result<&ExpertLayout, VaultError> {
        match self.layer_slot.get(layer).copied().flatten() {
            Some(i) => Ok(&self.manifest.experts.layers[i].layout),
            None => Err(VaultError::NotMoeLayer { layer }),
        }
    }

    /// The largest blob stride of any MoE layer: the bytes one ring slot holds.
    pub fn max_blob_stride(&self) -> u64 {
        self.manifest.experts.max_blob_stride()
    }

    /// Looks up a resident tensor by name, checking its shape; the returned reference
    /// is turned into a view with [`Vault::view`].
    pub fn resolve(&self, name: &str, shape: &[usize]) -> Result<TensorRef, VaultError> {
        let mpath = self.dir.join(MANIFEST_FILE);
        let t: &TensorEntry = self
            .manifest
            .resident
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| manifest_err(&mpath, format!("resident tensor `{name}` is missing")))?;
        if t.shape != shape {
            return Err(manifest_err(
                &mpath,
                format!("resident tensor `{name}` has shape {:?}, the model needs {shape:?}", t.shape),
            ));
        }
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => return Err(manifest_err(&mpath, format!("tensor `{name}` is not 1-D or 2-D"))),
        };
        let (offset, len) = (t.offset as usize, t.len as usize);
        Ok(TensorRef { offset, len, dtype: t.dtype, rows, cols })
    }

    /// A view of a resolved resident tensor.
    pub fn view(&self, r: &TensorRef) -> WeightView<'_> {
        WeightView::from_bytes(r.dtype, &self.resident[r.offset..r.offset + r.len], r.rows, r.cols)
    }

    /// Where the blob of `key` is stored.
    pub fn blob(&self, key: ExpertKey) -> Result<BlobLocation, VaultError> {
        let none = || VaultError::NoSuchExpert { layer: key.layer, expert: key.expert };
        let li = self.layer_slot.get(key.layer as usize).copied().flatten().ok_or_else(none)?;
        let layer = &self.manifest.experts.layers[li];
        let entry = layer.blobs.get(key.expert as usize).ok_or_else(none)?;
        let layout = &layer.layout;
        Ok(BlobLocation {
            file: self.dir.join(&layer.file),
            offset: entry.offset,
            len: layout.blob_len,
            stride: layout.blob_stride,
            crc32c: entry.crc32c,
        })
    }
}

/// Reads and parses the manifest of the vault in `dir` ([`parse_manifest`]).
pub fn read_manifest(dir: &Path) -> Result<Manifest, VaultError> {
    let mpath = dir.join(MANIFEST_FILE);
    let text = files::read_member(dir, MANIFEST_FILE, files::MAX_METADATA_BYTES).map_err(|e| {
        manifest_err(
            &mpath,
            format!(
                "cannot read the vault manifest ({e}); is this a directory made by `smoe-pipeline convert`?"
            ),
        )
    })?;
    parse_manifest(&text, &mpath)
}

/// Parses the manifest text read from `mpath`, checking its format version and model
/// configuration (not the files it names: [`check_manifest`] and [`Vault::open`] do).
pub fn parse_manifest(text: &[u8], mpath: &Path) -> Result<Manifest, VaultError> {
    let version: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| manifest_err(mpath, format!("not valid JSON: {e}")))?;
    match version.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v == FORMAT_VERSION as u64 => {}
        Some(v) => {
            return Err(VaultError::Version {
                file: mpath.to_path_buf(),
                found: u32::try_from(v).unwrap_or(u32::MAX),
                expected: FORMAT_VERSION,
            })
        }
        None => return Err(manifest_err(mpath, "missing `format_version`")),
    }
    let manifest =
        Manifest::from_json(version).map_err(|e| manifest_err(mpath, format!("malformed manifest: {e}")))?;
    manifest.model.validate().map_err(|e| manifest_err(mpath, format!("model config: {e}")))?;
    Ok(manifest)
}

/// Opens the vault member `name` and checks that it is `len` bytes long, as the
/// manifest says.
fn check_file_len(dir: &Path, name: &str, len: u64) -> Result<std::fs::File, VaultError> {
    let path = dir.join(name);
    let file = files::open_member(dir, name, 0)?;
    let actual =
        file.metadata().map_err(|e| manifest_err(&path, format!("cannot read its size: {e}")))?.len();
    if actual != len {
        return Err(manifest_err(
            &path,
            format!(
                "file is {actual} bytes but the manifest says {len}; the vault is truncated or was modified — re-run `smoe-pipeline convert`"
            ),
        ));
    }
    Ok(file)
}

/// Checks the manifest of the vault in `dir` for consistency, taking the file sizes it
/// states as given ([`Vault::open`] compares them with the files): the expert index
/// against the model, every layout, and where every blob and resident tensor lies.
/// Returns the decoder-layer → expert-index map.
pub fn check_manifest(dir: &Path, m: &Manifest) -> Result<Vec<Option<usize>>, VaultError> {
    let mpath = dir.join(MANIFEST_FILE);
    let cfg = &m.model;
    let moe = cfg.moe_layers();
    let listed: Vec<usize> = m.experts.layers.iter().map(|l| l.layer).collect();
    if listed != moe {
        return Err(manifest_err(
            &mpath,
            format!("expert index lists layers {listed:?} but the model's MoE layers are {moe:?}"),
        ));
    }
    let mut map = vec![None; cfg.num_hidden_layers];
    for (i, l) in m.experts.layers.iter().enumerate() {
        map[l.layer] = Some(i);
        let layout = &l.layout;
        let want = ExpertLayout::new(layout.types(), cfg.hidden_size, cfg.moe_intermediate_size);
        if want.as_ref() != Some(layout) {
            return Err(manifest_err(
                &mpath,
                format!(
                    "the expert layout of layer {} does not match the model's expert shape stored as {}",
                    l.layer,
                    layout.types().map(DType::name).join("/")
                ),
            ));
        }
        if l.blobs.len() != cfg.num_experts {
            return Err(manifest_err(
                &mpath,
                format!(
                    "layer {} lists {} blobs, the model has {} experts",
                    l.layer,
                    l.blobs.len(),
                    cfg.num_experts
                ),
            ));
        }
        for (e, b) in l.blobs.iter().enumerate() {
            let end = b.offset.checked_add(layout.blob_stride);
            if b.offset % BLOB_ALIGN != 0 || end.is_none_or(|end| end > l.file_len) {
                return Err(manifest_err(
                    &dir.join(&l.file),
                    format!(
                        "blob of expert {e} at offset {} is misaligned or past the end of the file",
                        b.offset
                    ),
                ));
            }
        }
    }
    let r = &m.resident;
    for t in &r.tensors {
        let end = t.offset.checked_add(t.len).filter(|&e| e <= r.file_len);
        if end.is_none() || t.byte_len() != Some(t.len) || t.offset % 64 != 0 {
            return Err(manifest_err(
                &dir.join(&r.file),
                format!(
                    "tensor `{}` entry (offset {}, len {}) does not fit its shape of {} {:?} or the file",
                    t.name, t.offset, t.len, t.dtype, t.shape
                ),
            ));
        }
    }
    Ok(map)
}
