//! The vault's on-disk format: the manifest (`manifest.json`) that indexes the resident
//! tensors and the per-(layer, expert) blobs. The reader lives in `smoe-actors`, the
//! writer in the application's converter; both speak these types.

use serde::{Deserialize, Serialize};

use crate::ModelConfig;

/// Version of the vault format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// File name of the manifest inside a vault directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Alignment of every expert blob inside its file (and of the blob stride).
pub const BLOB_ALIGN: u64 = 16 * 1024;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// bfloat16 (the top half of an f32).
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    /// Name as written in the manifest and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
}

/// Top-level index of a vault.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Must equal [`FORMAT_VERSION`].
    pub format_version: u32,
    /// The model the vault holds.
    pub model: ModelConfig,
    /// Where the resident (always in memory) tensors are.
    pub resident: ResidentIndex,
    /// Where the routed-expert blobs are.
    pub experts: ExpertIndex,
    /// Tokenizer files copied next to the manifest (may be empty).
    pub tokenizer_files: Vec<String>,
}

/// The file holding the resident tensors and its index.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResidentIndex {
    /// File name relative to the vault directory.
    pub file: String,
    /// Total size of the file in bytes.
    pub file_len: u64,
    /// One entry per tensor, in file order.
    pub tensors: Vec<TensorEntry>,
}

/// One resident tensor: a dense row-major array at an aligned offset.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// Canonical HuggingFace tensor name (e.g. `model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Byte offset in the resident file (64-byte aligned).
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// crc32c of the bytes.
    pub crc32c: u32,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where one matrix sits inside an expert blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartLayout {
    /// Byte offset from the start of the blob (64-byte aligned).
    pub offset: u64,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
}

/// Layout shared by every expert blob of the vault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertLayout {
    /// Element type of the three matrices.
    pub dtype: DType,
    /// `gate_proj` [moe_intermediate, hidden].
    pub gate: PartLayout,
    /// `up_proj` [moe_intermediate, hidden].
    pub up: PartLayout,
    /// `down_proj` [hidden, moe_intermediate].
    pub down: PartLayout,
    /// Bytes of payload in one blob (what the checksum covers).
    pub blob_len: u64,
    /// Distance between consecutive blobs in a layer file: `blob_len` rounded up to
    /// [`BLOB_ALIGN`]. Reads fetch whole strides so O_DIRECT can be used.
    pub blob_stride: u64,
}

/// Index of all expert blobs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertIndex {
    /// Layout of every blob.
    pub layout: ExpertLayout,
    /// One entry per MoE layer, in layer order.
    pub layers: Vec<LayerBlobs>,
}

/// The blobs of one MoE layer, stored in one file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerBlobs {
    /// Decoder layer index.
    pub layer: usize,
    /// File name relative to the vault directory.
    pub file: String,
    /// Total size of the file in bytes.
    pub file_len: u64,
    /// One entry per expert, in expert order.
    pub blobs: Vec<BlobEntry>,
}

/// One (layer, expert) blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobEntry {
    /// Byte offset in the layer file (multiple of [`BLOB_ALIGN`]).
    pub offset: u64,
    /// crc32c of the blob's `blob_len` payload bytes.
    pub crc32c: u32,
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: u64, align: u64) -> u64 {
    (n + align - 1) & !(align - 1)
}

impl ExpertLayout {
    /// Computes the layout for experts of the given shape and element type.
    pub fn new(dtype: DType, hidden: usize, inter: usize) -> Self {
        let part = (hidden * inter * dtype.size()) as u64;
        let step = align_up(part, 64);
        let gate = PartLayout { offset: 0, rows: inter, cols: hidden };
        let up = PartLayout { offset: step, rows: inter, cols: hidden };
        let down = PartLayout { offset: 2 * step, rows: hidden, cols: inter };
        let blob_len = 2 * step + part;
        ExpertLayout { dtype, gate, up, down, blob_len, blob_stride: align_up(blob_len, BLOB_ALIGN) }
    }
}
