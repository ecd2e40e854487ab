//! ggml tensor element types: the ids GGUF files store, their names, and the geometry of
//! their blocks. A quantised row is a run of fixed-size blocks, each decoding to a fixed
//! number of elements; `row_bytes` is what one row of `cols` elements occupies.
//!
//! The ids are ggml's `enum ggml_type` (ids 4, 5, 31–33 and 36–38 belong to retired
//! types and are unknown here). Block geometry is ggml's `ggml-common.h`; note that
//! gguf-py's table gives `Q8_1` 40 bytes (an old layout with f32 scales) while ggml's
//! block is 36 bytes — `Q8_1` is an activation format that never appears in model files.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Elements per K-quant super-block (`QK_K`).
pub const QK_K: usize = 256;

/// A ggml tensor element type. Serialised by its ggml name (`"q4_K"`, `"bf16"`, ...),
/// so a vault manifest can record the format of each tensor it keeps byte-for-byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GgmlType {
    /// IEEE 754 binary32 (id 0).
    #[serde(rename = "f32")]
    F32,
    /// IEEE 754 binary16 (id 1).
    #[serde(rename = "f16")]
    F16,
    /// 32 elements: f16 scale, 4-bit quants offset by 8 (id 2).
    #[serde(rename = "q4_0")]
    Q4_0,
    /// 32 elements: f16 scale and min, 4-bit quants (id 3).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// 32 elements: f16 scale, 5-bit quants offset by 16 (id 6).
    #[serde(rename = "q5_0")]
    Q5_0,
    /// 32 elements: f16 scale and min, 5-bit quants (id 7).
    #[serde(rename = "q5_1")]
    Q5_1,
    /// 32 elements: f16 scale, 8-bit signed quants (id 8).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 32 elements: f16 scale and scaled sum, 8-bit quants; an activation format (id 9).
    #[serde(rename = "q8_1")]
    Q8_1,
    /// K-quant, 2 bits (id 10).
    #[serde(rename = "q2_K")]
    Q2K,
    /// K-quant, 3 bits (id 11).
    #[serde(rename = "q3_K")]
    Q3K,
    /// K-quant, 4 bits: 256 elements in 8 sub-blocks with 6-bit scales and mins (id 12).
    #[serde(rename = "q4_K")]
    Q4K,
    /// K-quant, 5 bits: as Q4_K plus one high bit per element (id 13).
    #[serde(rename = "q5_K")]
    Q5K,
    /// K-quant, 6 bits: 256 elements in 16 sub-blocks with 8-bit scales (id 14).
    #[serde(rename = "q6_K")]
    Q6K,
    /// K-quant, 8 bits with f32 scale; an activation format (id 15).
    #[serde(rename = "q8_K")]
    Q8K,
    /// i-quant IQ2_XXS (id 16).
    #[serde(rename = "iq2_xxs")]
    Iq2Xxs,
    /// i-quant IQ2_XS (id 17).
    #[serde(rename = "iq2_xs")]
    Iq2Xs,
    /// i-quant IQ3_XXS (id 18).
    #[serde(rename = "iq3_xxs")]
    Iq3Xxs,
    /// i-quant IQ1_S (id 19).
    #[serde(rename = "iq1_s")]
    Iq1S,
    /// i-quant IQ4_NL (id 20).
    #[serde(rename = "iq4_nl")]
    Iq4Nl,
    /// i-quant IQ3_S (id 21).
    #[serde(rename = "iq3_s")]
    Iq3S,
    /// i-quant IQ2_S (id 22).
    #[serde(rename = "iq2_s")]
    Iq2S,
    /// i-quant IQ4_XS (id 23).
    #[serde(rename = "iq4_xs")]
    Iq4Xs,
    /// 8-bit signed integer (id 24).
    #[serde(rename = "i8")]
    I8,
    /// 16-bit signed integer (id 25).
    #[serde(rename = "i16")]
    I16,
    /// 32-bit signed integer (id 26).
    #[serde(rename = "i32")]
    I32,
    /// 64-bit signed integer (id 27).
    #[serde(rename = "i64")]
    I64,
    /// IEEE 754 binary64 (id 28).
    #[serde(rename = "f64")]
    F64,
    /// i-quant IQ1_M (id 29).
    #[serde(rename = "iq1_m")]
    Iq1M,
    /// bfloat16, the top half of an f32 (id 30).
    #[serde(rename = "bf16")]
    Bf16,
    /// Ternary TQ1_0 (id 34).
    #[serde(rename = "tq1_0")]
    Tq1_0,
    /// Ternary TQ2_0 (id 35).
    #[serde(rename = "tq2_0")]
    Tq2_0,
    /// Microscaling FP4 (id 39).
    #[serde(rename = "mxfp4")]
    Mxfp4,
    /// NVIDIA FP4 with FP8 sub-block scales (id 40).
    #[serde(rename = "nvfp4")]
    Nvfp4,
    /// 1-bit sign quant (id 41).
    #[serde(rename = "q1_0")]
    Q1_0,
}

/// What [`GgmlType`] knows about one type: ggml id, ggml name, elements per block,
/// bytes per block.
struct Traits {
    id: u32,
    name: &'static str,
    block_elems: usize,
    block_bytes: usize,
}

const fn t(id: u32, name: &'static str, block_elems: usize, block_bytes: usize) -> Traits {
    Traits { id, name, block_elems, block_bytes }
}

impl GgmlType {
    /// Every known type, in id order.
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::Iq2Xxs,
        GgmlType::Iq2Xs,
        GgmlType::Iq3Xxs,
        GgmlType::Iq1S,
        GgmlType::Iq4Nl,
        GgmlType::Iq3S,
        GgmlType::Iq2S,
        GgmlType::Iq4Xs,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::Iq1M,
        GgmlType::Bf16,
        GgmlType::Tq1_0,
        GgmlType::Tq2_0,
        GgmlType::Mxfp4,
        GgmlType::Nvfp4,
        GgmlType::Q1_0,
    ];

    /// The types smoe-pipeline can dequantise and multiply exactly: f32, f16, bf16 and
    /// the block formats of Q4_K_M/Q5_K_M/Q8_0/Q4_0 files.
    pub const SUPPORTED: [GgmlType; 8] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    fn traits(self) -> Traits {
        use GgmlType::*;
        match self {
            F32 => t(0, "f32", 1, 4),
            F16 => t(1, "f16", 1, 2),
            Q4_0 => t(2, "q4_0", 32, 2 + 16),
            Q4_1 => t(3, "q4_1", 32, 2 + 2 + 16),
            Q5_0 => t(6, "q5_0", 32, 2 + 4 + 16),
            Q5_1 => t(7, "q5_1", 32, 2 + 2 + 4 + 16),
            Q8_0 => t(8, "q8_0", 32, 2 + 32),
            Q8_1 => t(9, "q8_1", 32, 2 + 2 + 32),
            Q2K => t(10, "q2_K", QK_K, QK_K / 16 + QK_K / 4 + 2 + 2),
            Q3K => t(11, "q3_K", QK_K, QK_K / 8 + QK_K / 4 + 12 + 2),
            Q4K => t(12, "q4_K", QK_K, 2 + 2 + 12 + QK_K / 2),
            Q5K => t(13, "q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2),
            Q6K => t(14, "q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
            Q8K => t(15, "q8_K", QK_K, 4 + QK_K + QK_K / 16 * 2),
            Iq2Xxs => t(16, "iq2_xxs", QK_K, 2 + QK_K / 8 * 2),
            Iq2Xs => t(17, "iq2_xs", QK_K, 2 + QK_K / 8 * 2 + QK_K / 32),
            Iq3Xxs => t(18, "iq3_xxs", QK_K, 2 + QK_K / 4 + QK_K / 8),
            Iq1S => t(19, "iq1_s", QK_K, 2 + QK_K / 8 + QK_K / 16),
            Iq4Nl => t(20, "iq4_nl", 32, 2 + 16),
            Iq3S => t(21, "iq3_s", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            Iq2S => t(22, "iq2_s", QK_K, 2 + QK_K / 4 + QK_K / 16),
            Iq4Xs => t(23, "iq4_xs", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => t(24, "i8", 1, 1),
            I16 => t(25, "i16", 1, 2),
            I32 => t(26, "i32", 1, 4),
            I64 => t(27, "i64", 1, 8),
            F64 => t(28, "f64", 1, 8),
            Iq1M => t(29, "iq1_m", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            Bf16 => t(30, "bf16", 1, 2),
            Tq1_0 => t(34, "tq1_0", QK_K, 2 + 4 * 13),
            Tq2_0 => t(35, "tq2_0", QK_K, 2 + 64),
            Mxfp4 => t(39, "mxfp4", 32, 1 + 16),
            Nvfp4 => t(40, "nvfp4", 64, 4 + 32),
            Q1_0 => t(41, "q1_0", 128, 2 + 16),
        }
    }

    /// The type with ggml id `id`, or `None` for an unknown or retired id.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|ty| ty.id() == id)
    }

    /// The type named `name` (ggml's spelling, e.g. `q4_K`; case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|ty| ty.name().eq_ignore_ascii_case(name))
    }

    /// ggml's id of this type, as stored in a GGUF tensor info.
    pub fn id(self) -> u32 {
        self.traits().id
    }

    /// ggml's name of this type (`f32`, `q8_0`, `q4_K`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Elements one block decodes to (1 for the plain element types).
    pub fn block_elems(self) -> usize {
        self.traits().block_elems
    }

    /// Bytes one block occupies.
    pub fn block_bytes(self) -> usize {
        self.traits().block_bytes
    }

    /// Bytes of one row of `cols` elements, or `None` when `cols` is not a whole number
    /// of blocks or the size does not fit in `usize`.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let tr = self.traits();
        if !cols.is_multiple_of(tr.block_elems) {
            return None;
        }
        (cols / tr.block_elems).checked_mul(tr.block_bytes)
    }

    /// Whether smoe-pipeline's kernels dequantise and multiply this type (see
    /// [`GgmlType::SUPPORTED`]).
    pub fn is_supported(self) -> bool {
        GgmlType::SUPPORTED.contains(&self)
    }

    /// The names of the supported types, comma-separated (for error messages).
    pub fn supported_names() -> String {
        GgmlType::SUPPORTED.map(GgmlType::name).join(", ")
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_names_and_sizes_match_ggml() {
        for (ty, id, elems, bytes) in [
            (GgmlType::F32, 0, 1, 4),
            (GgmlType::F16, 1, 1, 2),
            (GgmlType::Q4_0, 2, 32, 18),
            (GgmlType::Q4_1, 3, 32, 20),
            (GgmlType::Q5_0, 6, 32, 22),
            (GgmlType::Q5_1, 7, 32, 24),
            (GgmlType::Q8_0, 8, 32, 34),
            (GgmlType::Q8_1, 9, 32, 36),
            (GgmlType::Q2K, 10, 256, 84),
            (GgmlType::Q3K, 11, 256, 110),
            (GgmlType::Q4K, 12, 256, 144),
            (GgmlType::Q5K, 13, 256, 176),
            (GgmlType::Q6K, 14, 256, 210),
            (GgmlType::Q8K, 15, 256, 292),
            (GgmlType::Iq2Xxs, 16, 256, 66),
            (GgmlType::Iq2Xs, 17, 256, 74),
            (GgmlType::Iq3Xxs, 18, 256, 98),
            (GgmlType::Iq1S, 19, 256, 50),
            (GgmlType::Iq4Nl, 20, 32, 18),
            (GgmlType::Iq3S, 21, 256, 110),
            (GgmlType::Iq2S, 22, 256, 82),
            (GgmlType::Iq4Xs, 23, 256, 136),
            (GgmlType::I8, 24, 1, 1),
            (GgmlType::I16, 25, 1, 2),
            (GgmlType::I32, 26, 1, 4),
            (GgmlType::I64, 27, 1, 8),
            (GgmlType::F64, 28, 1, 8),
            (GgmlType::Iq1M, 29, 256, 56),
            (GgmlType::Bf16, 30, 1, 2),
            (GgmlType::Tq1_0, 34, 256, 54),
            (GgmlType::Tq2_0, 35, 256, 66),
            (GgmlType::Mxfp4, 39, 32, 17),
            (GgmlType::Nvfp4, 40, 64, 36),
            (GgmlType::Q1_0, 41, 128, 18),
        ] {
            assert_eq!((ty.id(), ty.block_elems(), ty.block_bytes()), (id, elems, bytes), "{ty}");
            assert_eq!(GgmlType::from_id(id), Some(ty));
            assert_eq!(GgmlType::from_name(ty.name()), Some(ty));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 42, 1000] {
            assert_eq!(GgmlType::from_id(retired), None);
        }
    }

    #[test]
    fn all_lists_every_type_once() {
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
    }

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(GgmlType::Q4K.row_bytes(2048), Some(8 * 144));
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::Q4K.row_bytes(2050), None);
        assert_eq!(GgmlType::F16.row_bytes(7), Some(14));
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
    }

    #[test]
    fn serde_uses_ggml_names() {
        assert_eq!(serde_json::to_string(&GgmlType::Q4K).unwrap(), "\"q4_K\"");
        assert_eq!(serde_json::from_str::<GgmlType>("\"bf16\"").unwrap(), GgmlType::Bf16);
        assert!(GgmlType::Q6K.is_supported() && !GgmlType::Q3K.is_supported());
        assert_eq!(GgmlType::supported_names(), "f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K");
    }
}
