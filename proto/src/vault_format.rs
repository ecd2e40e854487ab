//! The vault's on-disk format: the manifest (`manifest.json`) that indexes the resident
//! tensors and the per-(layer, expert) blobs. The reader lives in `smoe-actors`, the
//! writer in the application's converter; both speak these types.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{GgmlType, ModelConfig};

/// Version of the vault format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// File name of the manifest inside a vault directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Alignment of every expert blob inside its file (and of the blob stride).
pub const BLOB_ALIGN: u64 = 16 * 1024;

/// Element type of a stored tensor: a plain float type, or a ggml block format (a row is
/// a run of fixed-size blocks, each decoding to a fixed number of elements; see
/// [`GgmlType`]). Serialised lower-case (`f32`, `bf16`, `f16`, `q8_0`, `q4_0`, `q4_k`,
/// `q5_k`, `q6_k`); the block formats are those of Q8_0, Q4_0, Q4_K_M and Q5_K_M GGUF
/// files, stored byte-for-byte as ggml lays them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    /// IEEE 754 binary32.
    #[serde(rename = "f32")]
    F32,
    /// bfloat16 (the top half of an f32).
    #[serde(rename = "bf16")]
    Bf16,
    /// IEEE 754 binary16.
    #[serde(rename = "f16")]
    F16,
    /// ggml Q8_0: blocks of 32 elements, an f16 scale and 8-bit quants.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// ggml Q4_0: blocks of 32 elements, an f16 scale and 4-bit quants.
    #[serde(rename = "q4_0")]
    Q4_0,
    /// ggml Q4_K: super-blocks of 256 elements, 4-bit quants with 6-bit sub-block scales
    /// and mins.
    #[serde(rename = "q4_k")]
    Q4K,
    /// ggml Q5_K: as Q4_K with a fifth bit per element.
    #[serde(rename = "q5_k")]
    Q5K,
    /// ggml Q6_K: super-blocks of 256 elements, 6-bit quants with 8-bit sub-block scales.
    #[serde(rename = "q6_k")]
    Q6K,
}

impl DType {
    /// Every element type a vault may hold.
    pub const ALL: [DType; 8] =
        [DType::F32, DType::Bf16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4K, DType::Q5K, DType::Q6K];

    /// Name as written in the manifest and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }

    /// The type named `name` (case-insensitive, so ggml's `q4_K` is accepted too).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name().eq_ignore_ascii_case(name))
    }

    /// The ggml type with this layout.
    pub fn ggml(self) -> GgmlType {
        match self {
            DType::F32 => GgmlType::F32,
            DType::Bf16 => GgmlType::Bf16,
            DType::F16 => GgmlType::F16,
            DType::Q8_0 => GgmlType::Q8_0,
            DType::Q4_0 => GgmlType::Q4_0,
            DType::Q4K => GgmlType::Q4K,
            DType::Q5K => GgmlType::Q5K,
            DType::Q6K => GgmlType::Q6K,
        }
    }

    /// The vault type of a ggml type, or `None` for a type a vault cannot hold.
    pub fn from_ggml(ty: GgmlType) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml() == ty)
    }

    /// Elements one block decodes to (1 for the plain float types).
    pub fn block_elems(self) -> usize {
        self.ggml().block_elems()
    }

    /// Whether rows are stored in blocks of more than one element (a quantised format).
    pub fn is_block(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of one row of `cols` elements, or `None` when `cols` is not a whole number
    /// of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        self.ggml().row_bytes(cols)
    }

    /// Bytes of a `rows × cols` matrix, or `None` when a row is not a whole number of
    /// blocks or the size overflows.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> Option<u64> {
        (self.row_bytes(cols)? as u64).checked_mul(rows as u64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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

    /// Bytes the tensor occupies (see [`tensor_bytes`]).
    pub fn byte_len(&self) -> Option<u64> {
        tensor_bytes(self.dtype, &self.shape)
    }
}

/// Where one matrix sits inside an expert blob, and how it is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartLayout {
    /// Byte offset from the start of the blob (64-byte aligned).
    pub offset: u64,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Element type of the matrix (a Q4_K_M expert keeps `down_proj` in another format
    /// than `gate_proj` and `up_proj`).
    pub dtype: DType,
}

impl PartLayout {
    /// Bytes of the matrix (`rows` rows of `cols` elements of `dtype`; the columns are a
    /// whole number of blocks in every layout made by [`ExpertLayout::new`]).
    pub fn bytes(&self) -> u64 {
        self.dtype.matrix_bytes(self.rows, self.cols).unwrap_or(0)
    }

    /// The bytes of this matrix inside `blob`.
    pub fn slice<'a>(&self, blob: &'a [u8]) -> &'a [u8] {
        &blob[self.offset as usize..(self.offset + self.bytes()) as usize]
    }
}

/// Layout of every expert blob of one MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertLayout {
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
    /// One entry per MoE layer, in layer order.
    pub layers: Vec<LayerBlobs>,
}

impl ExpertIndex {
    /// The largest blob stride of any layer (what one ring slot must hold), 0 without
    /// MoE layers.
    pub fn max_blob_stride(&self) -> u64 {
        self.layers.iter().map(|l| l.layout.blob_stride).max().unwrap_or(0)
    }

    /// Payload bytes of one expert blob, averaged over the MoE layers (what a read of
    /// one expert costs), 0 without MoE layers.
    pub fn mean_blob_len(&self) -> u64 {
        let total: u64 = self.layers.iter().map(|l| l.layout.blob_len).sum();
        total.checked_div(self.layers.len() as u64).unwrap_or(0)
    }
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
    /// Layout of every blob of the layer (layers may differ: a Q4_K_M file keeps some
    /// layers' `down_proj` in Q6_K and others' in Q4_K).
    pub layout: ExpertLayout,
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

/// Bytes of a row-major tensor of `shape` stored as `dtype`: rows of the last axis's
/// length, as many as the other axes hold; `None` when a row is not a whole number of
/// blocks or the size overflows.
pub fn tensor_bytes(dtype: DType, shape: &[usize]) -> Option<u64> {
    let (cols, outer) = shape.split_last().map_or((1, &[][..]), |(c, o)| (*c, o));
    let rows = outer.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    dtype.matrix_bytes(rows, cols)
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: u64, align: u64) -> u64 {
    (n + align - 1) & !(align - 1)
}

/// [`align_up`], `None` where the result does not fit in a `u64`.
pub fn checked_align_up(n: u64, align: u64) -> Option<u64> {
    Some(n.checked_add(align - 1)? & !(align - 1))
}

impl ExpertLayout {
    /// The layout for experts of the given shape with `gate_proj`, `up_proj` and
    /// `down_proj` stored as `types` (in that order), or `None` when a part's rows are not
    /// a whole number of its type's blocks.
    pub fn new(types: [DType; 3], hidden: usize, inter: usize) -> Option<Self> {
        let [g, u, d] = types;
        let gate = PartLayout { offset: 0, rows: inter, cols: hidden, dtype: g };
        let up = PartLayout {
            offset: checked_align_up(g.matrix_bytes(inter, hidden)?, 64)?,
            rows: inter,
            cols: hidden,
            dtype: u,
        };
        let down_at = checked_align_up(up.offset.checked_add(u.matrix_bytes(inter, hidden)?)?, 64)?;
        let down = PartLayout { offset: down_at, rows: hidden, cols: inter, dtype: d };
        let blob_len = down_at.checked_add(d.matrix_bytes(hidden, inter)?)?;
        let blob_stride = checked_align_up(blob_len, BLOB_ALIGN)?;
        Some(ExpertLayout { gate, up, down, blob_len, blob_stride })
    }

    /// The three matrices with their tensor names (`gate_proj`, `up_proj`, `down_proj`),
    /// in blob order.
    pub fn parts(&self) -> [(&'static str, &PartLayout); 3] {
        [("gate_proj", &self.gate), ("up_proj", &self.up), ("down_proj", &self.down)]
    }

    /// The element types of the three matrices, in blob order.
    pub fn types(&self) -> [DType; 3] {
        [self.gate.dtype, self.up.dtype, self.down.dtype]
    }
}

/// What a vault keeps in one element type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FormatShare {
    /// Resident tensors of this type.
    pub resident_tensors: u64,
    /// Bytes of those tensors.
    pub resident_bytes: u64,
    /// Expert matrices of this type (three per expert: gate, up, down).
    pub expert_matrices: u64,
    /// Bytes of those matrices (payload, without blob padding).
    pub expert_bytes: u64,
}

impl Manifest {
    /// The vault's format mix: for each element type it holds, how many resident tensors
    /// and expert matrices are stored in it and their bytes.
    pub fn format_mix(&self) -> BTreeMap<DType, FormatShare> {
        let mut mix = BTreeMap::<DType, FormatShare>::new();
        for t in &self.resident.tensors {
            let s = mix.entry(t.dtype).or_default();
            s.resident_tensors += 1;
            s.resident_bytes += t.len;
        }
        let experts = self.model.num_experts as u64;
        for l in &self.experts.layers {
            for (_, p) in l.layout.parts() {
                let s = mix.entry(p.dtype).or_default();
                s.expert_matrices += experts;
                s.expert_bytes += experts * p.bytes();
            }
        }
        mix
    }

    /// One line naming the format mix, e.g. `resident f32 ×97 (1.2 MiB), bf16 ×50
    /// (30.1 MiB); experts q4_k ×12288 (42.0 MiB), q6_k ×3072 (15.1 MiB)`.
    pub fn format_summary(&self) -> String {
        let mix = self.format_mix();
        let list = |f: fn(&FormatShare) -> (u64, u64)| {
            let items: Vec<String> = mix
                .iter()
                .map(|(d, s)| (d, f(s)))
                .filter(|(_, (n, _))| *n > 0)
                .map(|(d, (n, b))| format!("{d} ×{n} ({})", human_bytes(b)))
                .collect();
            if items.is_empty() {
                "none".to_string()
            } else {
                items.join(", ")
            }
        };
        format!(
            "resident {}; experts {}",
            list(|s| (s.resident_tensors, s.resident_bytes)),
            list(|s| (s.expert_matrices, s.expert_bytes))
        )
    }

    /// Reads a manifest from its JSON. Manifests written before each expert part and
    /// layer carried its own element type (one `experts.layout` with one `dtype`) are
    /// read unchanged: their layout is given to every layer, its type to every part.
    pub fn from_json(mut v: Value) -> Result<Manifest, serde_json::Error> {
        upgrade_shared_layout(&mut v);
        serde_json::from_value(v)
    }
}

/// `bytes` with a binary unit: `812 B`, `4.0 KiB`, `1.5 MiB`, `2.3 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let (mut v, mut unit) = (bytes as f64 / 1024.0, UNITS[0]);
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        (v, unit) = (v / 1024.0, u);
    }
    format!("{v:.1} {unit}")
}

/// Rewrites the early manifest shape (one `experts.layout` with a `dtype` for all three
/// parts) into the current one (a layout per layer, a `dtype` per part).
fn upgrade_shared_layout(v: &mut Value) {
    let Some(experts) = v.get_mut("experts").and_then(Value::as_object_mut) else { return };
    let Some(mut layout) = experts.remove("layout") else { return };
    if let Some(obj) = layout.as_object_mut() {
        if let Some(dtype) = obj.remove("dtype") {
            for part in ["gate", "up", "down"] {
                if let Some(p) = obj.get_mut(part).and_then(Value::as_object_mut) {
                    p.entry("dtype").or_insert_with(|| dtype.clone());
                }
            }
        }
    }
    for layer in experts.get_mut("layers").and_then(Value::as_array_mut).into_iter().flatten() {
        if let Some(l) = layer.as_object_mut() {
            l.entry("layout").or_insert_with(|| layout.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_have_lower_case_names_and_ggml_twins() {
        for d in DType::ALL {
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<DType>(&json).unwrap(), d);
            assert_eq!(DType::from_name(&d.name().to_uppercase()), Some(d));
            assert_eq!(DType::from_ggml(d.ggml()), Some(d));
            assert!(d.ggml().is_supported(), "{d}");
            assert_eq!(d.name(), d.ggml().name().to_lowercase());
        }
        assert_eq!(DType::from_name("q4_K"), Some(DType::Q4K));
        assert_eq!(DType::from_ggml(GgmlType::Q3K), None);
        assert_eq!(DType::Q4K.row_bytes(512), Some(288));
        assert_eq!(DType::Q4K.row_bytes(100), None);
        assert_eq!(DType::Bf16.matrix_bytes(3, 5), Some(30));
        assert_eq!(tensor_bytes(DType::Q8_0, &[2, 3, 64]), Some(6 * 68));
        assert_eq!(tensor_bytes(DType::F32, &[7]), Some(28));
    }

    #[test]
    fn byte_counts_read_with_binary_units() {
        assert_eq!(human_bytes(812), "812 B");
        assert_eq!(human_bytes(4096), "4.0 KiB");
        assert_eq!(human_bytes(3 << 19), "1.5 MiB");
        assert_eq!(human_bytes(5 << 40), "5.0 TiB");
    }

    #[test]
    fn part_offsets_are_aligned_and_sized_by_each_parts_type() {
        let l = ExpertLayout::new([DType::Q4K, DType::Q4K, DType::Q6K], 512, 768).unwrap();
        assert_eq!((l.gate.offset, l.up.offset), (0, align_up(768 * 288, 64)));
        assert_eq!(l.down.offset, align_up(l.up.offset + 768 * 288, 64));
        assert_eq!(l.blob_len, l.down.offset + 512 * 630);
        assert_eq!(l.blob_stride, align_up(l.blob_len, BLOB_ALIGN));
        assert_eq!(l.types(), [DType::Q4K, DType::Q4K, DType::Q6K]);
        // Columns that are not whole blocks have no layout.
        assert!(ExpertLayout::new([DType::Q4K; 3], 64, 32).is_none());
        // A uniform plain type keeps the original layout: three equal, 64-byte aligned steps.
        let b = ExpertLayout::new([DType::Bf16; 3], 64, 33).unwrap();
        let part = 64 * 33 * 2;
        assert_eq!((b.up.offset, b.down.offset, b.blob_len), (4224, 8448, 8448 + part));
    }

    #[test]
    fn manifests_with_one_shared_layout_are_read_unchanged() {
        let part = |offset: u64, rows: usize, cols: usize| serde_json::json!({"offset": offset, "rows": rows, "cols": cols});
        let legacy = serde_json::json!({
            "format_version": FORMAT_VERSION,
            "model": {
                "architecture": "Qwen3MoeForCausalLM", "hidden_size": 64, "intermediate_size": 128,
                "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "rms_norm_eps": 1e-6,
                "rope_theta": 1e6, "max_position_embeddings": 4096, "num_experts": 1,
                "num_experts_per_tok": 1, "norm_topk_prob": true, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "tie_word_embeddings": false, "eos_token_ids": []
            },
            "resident": {"file": "resident.bin", "file_len": 0, "tensors": []},
            "experts": {
                "layout": {
                    "dtype": "bf16",
                    "gate": part(0, 32, 64), "up": part(4096, 32, 64), "down": part(8192, 64, 32),
                    "blob_len": 12288, "blob_stride": 16384
                },
                "layers": [
                    {"layer": 0, "file": "experts/layer_000.bin", "file_len": 16384, "blobs": [{"offset": 0, "crc32c": 7}]},
                    {"layer": 1, "file": "experts/layer_001.bin", "file_len": 16384, "blobs": [{"offset": 0, "crc32c": 9}]}
                ]
            },
            "tokenizer_files": []
        });
        let m = Manifest::from_json(legacy).unwrap();
        let want = ExpertLayout::new([DType::Bf16; 3], 64, 32).unwrap();
        assert_eq!(m.experts.layers.len(), 2);
        assert!(m.experts.layers.iter().all(|l| l.layout == want));
        assert_eq!(m.experts.max_blob_stride(), 16384);
        // What is written now reads back as is.
        let again = Manifest::from_json(serde_json::to_value(&m).unwrap()).unwrap();
        assert_eq!(again.experts.layers[1].layout, want);
        assert!(serde_json::to_value(&m).unwrap()["experts"].get("layout").is_none());
    }
}
