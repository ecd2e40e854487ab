//! Borrowed, typed views of weight matrices (resident tensors or expert blob parts).

use smoe_proto::DType;

/// Elements of a row-major weight matrix in its stored type.
#[derive(Clone, Copy, Debug)]
pub enum WeightData<'a> {
    /// binary32 elements.
    F32(&'a [f32]),
    /// bfloat16 elements as raw bits.
    Bf16(&'a [u16]),
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
    /// the element size (vault offsets are 64-byte aligned) and hold exactly
    /// `rows × cols` elements.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8], rows: usize, cols: usize) -> Self {
        let n = rows * cols;
        let data = match dtype {
            DType::F32 => WeightData::F32(&bytemuck::cast_slice(bytes)[..n]),
            DType::Bf16 => WeightData::Bf16(&bytemuck::cast_slice(bytes)[..n]),
        };
        WeightView { data, rows, cols }
    }

    /// Row `r` converted to f32 into `out` (used for embedding lookups).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match self.data {
            WeightData::F32(d) => out.copy_from_slice(&d[r * c..(r + 1) * c]),
            WeightData::Bf16(d) => {
                for (o, &b) in out.iter_mut().zip(&d[r * c..(r + 1) * c]) {
                    *o = bf16_to_f32(b);
                }
            }
        }
    }

    /// Elements as f32 when the matrix is a 1-D f32 vector (norm weights).
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match self.data {
            WeightData::F32(d) => Some(d),
            WeightData::Bf16(_) => None,
        }
    }
}

/// Widens bfloat16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}
