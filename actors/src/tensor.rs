//! Borrowed, typed views of weight matrices (resident tensors or expert blob parts).

use smoe_proto::DType;

/// Elements of a row-major weight matrix in its stored type.
#[derive(Clone, Copy, Debug)]
pub enum WeightData<'a> {
    /// binary32 elements.
    F32(&'a [f32]),
    /// bfloat16 elements as raw bits.
    Bf16(&'a [u16]),
    /// Rows stored in a ggml block format or as f16, as their raw little-endian bytes:
    /// row `r` is `bytes[r * row_bytes..(r + 1) * row_bytes]` with
    /// `row_bytes = dtype.row_bytes(cols)`. A backend's kernels decode them.
    Quant {
        /// The stored type (never f32 or bf16, which have their own variants).
        dtype: DType,
        /// Exactly `rows × row_bytes` bytes.
        bytes: &'a [u8],
    },
}

/// A row-major `rows × cols` weight matrix.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// The elements.
    pub data: WeightData<'a>,
    /// Number of rows (outputs of a matvec).
    pub rows: usize,
    /// Number of columns (inputs of a matvec).
    pub cols: usize,
}

impl<'a> WeightView<'a> {
    /// Views `bytes` as a `rows × cols` matrix of `dtype`. The bytes must be aligned to
    /// the element size (vault offsets are 64-byte aligned), and hold at least the
    /// matrix, whose rows are a whole number of `dtype` blocks; the vault checks both for
    /// every tensor and blob part when it opens.
    ///
    /// # Panics
    /// If `bytes` does not hold the matrix as described.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8], rows: usize, cols: usize) -> Self {
        let n = rows * cols;
        let data = match dtype {
            DType::F32 => WeightData::F32(&bytemuck::cast_slice(bytes)[..n]),
            DType::Bf16 => WeightData::Bf16(&bytemuck::cast_slice(bytes)[..n]),
            _ => {
                let len = dtype
                    .matrix_bytes(rows, cols)
                    .unwrap_or_else(|| panic!("{cols} columns are not a whole number of {dtype} blocks"));
                WeightData::Quant { dtype, bytes: &bytes[..len as usize] }
            }
        };
        WeightView { data, rows, cols }
    }

    /// The stored element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            WeightData::F32(_) => DType::F32,
            WeightData::Bf16(_) => DType::Bf16,
            WeightData::Quant { dtype, .. } => dtype,
        }
    }

    /// The stored bytes of the matrix (little-endian elements or ggml blocks).
    pub fn bytes(&self) -> &'a [u8] {
        match self.data {
            WeightData::F32(d) => bytemuck::cast_slice(d),
            WeightData::Bf16(d) => bytemuck::cast_slice(d),
            WeightData::Quant { bytes, .. } => bytes,
        }
    }

    /// Row `r` widened to f32 into `out` (embedding lookups) when the matrix holds f32 or
    /// bf16 elements; returns false, writing nothing, for the other types, which a
    /// backend's kernels decode (the CPU's `cpu::kernels::row_to_f32`).
    #[must_use]
    pub fn widen_row(&self, r: usize, out: &mut [f32]) -> bool {
        let c = self.cols;
        match self.data {
            WeightData::F32(d) => out.copy_from_slice(&d[r * c..(r + 1) * c]),
            WeightData::Bf16(d) => {
                for (o, &b) in out.iter_mut().zip(&d[r * c..(r + 1) * c]) {
                    *o = bf16_to_f32(b);
                }
            }
            WeightData::Quant { .. } => return false,
        }
        true
    }

    /// Elements as f32 when the matrix is a 1-D f32 vector (norm weights).
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match self.data {
            WeightData::F32(d) => Some(d),
            WeightData::Bf16(_) | WeightData::Quant { .. } => None,
        }
    }
}

/// Widens bfloat16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}
