//! ggml block formats on the CPU: exact dequantisation and fused dot products.
//!
//! Supported: f32, f16, bf16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K (the formats of Q8_0,
//! Q4_0, Q4_K_M and Q5_K_M GGUF files).
//!
//! **Dequantisation** reproduces ggml's `dequantize_row_*` (and gguf-py's
//! `gguf.quants.dequantize`, which transformers uses to load a GGUF) bit for bit: f16
//! scales widened exactly, then the same f32 operations in the same order — for example
//! Q4_K's `(d·sc)·q − dmin·m` and Q6_K's `(d·sc)·q`. Rust never contracts `a·b − c` into
//! an FMA, so the results are those of the unfused C reference and of gguf-py (a C build
//! that contracts to FMA could differ in the last bit).
//!
//! **Dot products** dequantise in registers and multiply f32 activations (activations are
//! never quantised). [`dot_row`] is bitwise equal to
//! `kernels::dot_f32(&dequantized_row, x)`: element `i` goes to lane `i % 16`, lanes are
//! combined by `dot_f32` itself, and the tail (only f32/f16/bf16 rows can have one) is
//! added last in order. On CPUs with AVX2 each block format has an 8-wide variant doing
//! the same operations per element, so both paths give the same bits; the same routine,
//! storing the weights it forms instead of multiplying them, is the AVX2 decoder.
//! [`QuantMatrix::row_dots`] decodes a row once for several activation vectors (the
//! token-batched sibling), each result bitwise the single dot product.

use rayon::prelude::*;
use smoe_proto::ggml::{GgmlType, QK_K};

use super::kernels::{dot_bf16, dot_f32};
use crate::tensor::bf16_to_f32;

/// Lanes of the fixed accumulation order (those of `kernels::dot_f32`).
const LANES: usize = 16;
/// Matrices with fewer stored elements than this are computed on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;

/// A quantised row or matrix that cannot be used as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The element type has no CPU kernel.
    #[error("tensor type {ty} has no CPU kernel (supported: {})", GgmlType::supported_names())]
    Unsupported {
        /// The type asked for.
        ty: GgmlType,
    },
    /// The byte length does not hold the expected number of elements.
    #[error(
        "{ty} data of {bytes} bytes does not hold {rows} row(s) of {cols} elements \
         ({ty} stores blocks of {} elements in {} bytes)",
        ty.block_elems(),
        ty.block_bytes()
    )]
    Size {
        /// Element type.
        ty: GgmlType,
        /// Bytes given.
        bytes: usize,
        /// Rows expected.
        rows: usize,
        /// Elements per row expected.
        cols: usize,
    },
    /// A row length that is not a whole number of blocks.
    #[error("{cols} elements are not a whole number of {ty} blocks ({} elements each)", ty.block_elems())]
    Blocks {
        /// Element type.
        ty: GgmlType,
        /// Elements given.
        cols: usize,
    },
    /// A row index past the last row.
    #[error("row {row} is out of range: the matrix has {rows} rows")]
    Row {
        /// Row asked for.
        row: usize,
        /// Rows of the matrix.
        rows: usize,
    },
    /// An activation or output vector has the wrong length.
    #[error("{what} has {found} elements, expected {expected}")]
    Length {
        /// Which vector (`"input"` or `"output"`).
        what: &'static str,
        /// Length required by the matrix.
        expected: usize,
        /// Length given.
        found: usize,
    },
}

/// The supported types, as the kernels dispatch on them (the one place that maps a
/// [`GgmlType`] to code; a test keeps it in step with [`GgmlType::SUPPORTED`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Kernel {
    /// The kernel of `ty`, or `None` when the type has none.
    fn of(ty: GgmlType) -> Option<Kernel> {
        Some(match ty {
            GgmlType::F32 => Kernel::F32,
            GgmlType::F16 => Kernel::F16,
            GgmlType::Bf16 => Kernel::Bf16,
            GgmlType::Q8_0 => Kernel::Q8_0,
            GgmlType::Q4_0 => Kernel::Q4_0,
            GgmlType::Q4K => Kernel::Q4K,
            GgmlType::Q5K => Kernel::Q5K,
            GgmlType::Q6K => Kernel::Q6K,
            _ => return None,
        })
    }

    /// Checks that `bytes` bytes hold exactly `rows × cols` elements of `ty`; returns the
    /// kernel and the bytes of one row.
    fn check(ty: GgmlType, bytes: usize, rows: usize, cols: usize) -> Result<(Kernel, usize), QuantError> {
        let kernel = Kernel::of(ty).ok_or(QuantError::Unsupported { ty })?;
        match ty.row_bytes(cols) {
            Some(rb) if rows.checked_mul(rb) == Some(bytes) => Ok((kernel, rb)),
            _ => Err(QuantError::Size { ty, bytes, rows, cols }),
        }
    }

    /// Decodes a row whose size is known to match, on the widest instructions the CPU has.
    fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        self.dequantize_on(Isa::detect(), bytes, out)
    }

    /// [`Kernel::dequantize`] on the instructions of `isa` (every `isa` gives the same bits).
    fn dequantize_on(self, isa: Isa, bytes: &[u8], out: &mut [f32]) {
        match self {
            Kernel::F32 => decode_plain(bytes, out, 4, f32_le),
            Kernel::F16 => decode_plain(bytes, out, 2, f16_le),
            Kernel::Bf16 => decode_plain(bytes, out, 2, bf16_le),
            Kernel::Q8_0 => decode_blocks::<Q8_0>(isa, bytes, out),
            Kernel::Q4_0 => decode_blocks::<Q4_0>(isa, bytes, out),
            Kernel::Q4K => decode_blocks::<Q4K>(isa, bytes, out),
            Kernel::Q5K => decode_blocks::<Q5K>(isa, bytes, out),
            Kernel::Q6K => decode_blocks::<Q6K>(isa, bytes, out),
        }
    }

    /// The fused dot product of a row whose size is known to match `x`, on the widest
    /// instructions the CPU has.
    fn dot(self, bytes: &[u8], x: &[f32]) -> f32 {
        self.dot_on(Isa::detect(), bytes, x)
    }

    /// [`Kernel::dot`] on the instructions of `isa` (every `isa` gives the same bits).
    fn dot_on(self, isa: Isa, bytes: &[u8], x: &[f32]) -> f32 {
        let [d] = self.dots_on(isa, bytes, [x]);
        d
    }

    /// The dot products of one row with `N` vectors (each of the row's length), each
    /// bitwise the single [`Kernel::dot_on`]; a block format decodes the row once for all.
    fn dots_on<const N: usize>(self, isa: Isa, bytes: &[u8], xs: [&[f32]; N]) -> [f32; N] {
        match self {
            // The f32/bf16 kernels pick their own width; unaligned rows go element-wise.
            Kernel::F32 => xs.map(|x| match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(w) => dot_f32(w, x),
                Err(_) => dot_plain(bytes, x, 4, f32_le),
            }),
            Kernel::Bf16 => xs.map(|x| match bytemuck::try_cast_slice::<u8, u16>(bytes) {
                Ok(w) => dot_bf16(w, x),
                Err(_) => dot_plain(bytes, x, 2, bf16_le),
            }),
            Kernel::F16 => xs.map(|x| dot_f16(isa, bytes, x)),
            Kernel::Q8_0 => dot_blocks::<Q8_0, N>(isa, bytes, xs),
            Kernel::Q4_0 => dot_blocks::<Q4_0, N>(isa, bytes, xs),
            Kernel::Q4K => dot_blocks::<Q4K, N>(isa, bytes, xs),
            Kernel::Q5K => dot_blocks::<Q5K, N>(isa, bytes, xs),
            Kernel::Q6K => dot_blocks::<Q6K, N>(isa, bytes, xs),
        }
    }
}

/// The instructions a fused dot product may use. `Avx2` is made only by
/// [`Isa::detect`], on a CPU that has AVX2 (`f16c`: and F16C).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// 8-wide AVX2 (multiply, then add: never FMA).
    #[cfg(target_arch = "x86_64")]
    Avx2 {
        /// F16C conversions are available too.
        f16c: bool,
    },
}

impl Isa {
    /// The widest path the running CPU supports (feature checks are cached by std).
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            return Isa::Avx2 { f16c: std::is_x86_feature_detected!("f16c") };
        }
        Isa::Portable
    }
}

/// Dequantises one row of `ty` (`bytes`, a whole number of blocks) into `out`, bitwise
/// as ggml's `dequantize_row_*` computes it. `out.len()` is the row's element count.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let (kernel, _) = Kernel::check(ty, bytes.len(), 1, out.len())?;
    kernel.dequantize(bytes, out);
    Ok(())
}

/// Dot product of one row of `ty` (`bytes`) with f32 activations `x`, dequantising in
/// registers; bitwise equal to `kernels::dot_f32` of the dequantised row with `x`.
pub fn dot_row(ty: GgmlType, bytes: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    let (kernel, _) = Kernel::check(ty, bytes.len(), 1, x.len())?;
    Ok(kernel.dot(bytes, x))
}

/// A borrowed row-major `rows × cols` matrix stored in a ggml type (e.g. a GGUF tensor
/// kept byte-for-byte), validated once so that its products cannot fail.
#[derive(Clone, Copy, Debug)]
pub struct QuantMatrix<'a> {
    ty: GgmlType,
    kernel: Kernel,
    data: &'a [u8],
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl<'a> QuantMatrix<'a> {
    /// Views `data` as `rows × cols` elements of `ty`; fails if the type has no kernel or
    /// the byte length is not exactly that of `rows` rows of `cols` elements.
    pub fn new(ty: GgmlType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        let (kernel, row_bytes) = Kernel::check(ty, data.len(), rows, cols)?;
        Ok(QuantMatrix { ty, kernel, data, rows, cols, row_bytes })
    }

    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Number of rows (outputs of a matvec).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (inputs of a matvec).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored bytes of row `r`, or `None` past the last row.
    pub fn row(&self, r: usize) -> Option<&'a [u8]> {
        (r < self.rows).then(|| &self.data[r * self.row_bytes..(r + 1) * self.row_bytes])
    }

    /// `W[r] · x`, bitwise [`dot_row`] of row `r`.
    ///
    /// # Panics
    /// If `r` is not a row or `x` does not have `cols` elements (callers check shapes once
    /// per matrix, as the f32 kernels do).
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        let [d] = self.row_dots(r, [x]);
        d
    }

    /// `W[r] · xs[t]` for `N` vectors at once: a block format decodes the row once for
    /// all of them, and each result is bitwise [`QuantMatrix::row_dot`] — the sibling
    /// for token-batched kernels.
    ///
    /// # Panics
    /// As [`QuantMatrix::row_dot`], for any of the vectors.
    pub fn row_dots<const N: usize>(&self, r: usize, xs: [&[f32]; N]) -> [f32; N] {
        assert!(xs.iter().all(|x| x.len() == self.cols), "every vector must have {} elements", self.cols);
        let row = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
        self.kernel.dots_on(Isa::detect(), row, xs)
    }

    /// Row `r` dequantised into `out` (`cols` elements), e.g. for an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), QuantError> {
        let row = self.row(r).ok_or(QuantError::Row { row: r, rows: self.rows })?;
        if out.len() != self.cols {
            return Err(QuantError::Length { what: "output", expected: self.cols, found: out.len() });
        }
        self.kernel.dequantize(row, out);
        Ok(())
    }

    /// `out[r] = W[r] · x` for every row, each element the m=1 [`dot_row`]; parallel
    /// over blocks of rows for large matrices (never over one reduction), so the result
    /// does not depend on the thread count.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) -> Result<(), QuantError> {
        if x.len() != self.cols {
            return Err(QuantError::Length { what: "input", expected: self.cols, found: x.len() });
        }
        if out.len() != self.rows {
            return Err(QuantError::Length { what: "output", expected: self.rows, found: out.len() });
        }
        let (rb, kernel, isa) = (self.row_bytes, self.kernel, Isa::detect());
        if self.rows.saturating_mul(self.cols) < PAR_THRESHOLD {
            for (o, w) in out.iter_mut().zip(self.data.chunks_exact(rb)) {
                *o = kernel.dot_on(isa, w, x);
            }
        } else {
            let block = (PAR_THRESHOLD / self.cols.max(1)).clamp(1, 256);
            out.par_chunks_mut(block).zip(self.data.par_chunks(block.saturating_mul(rb))).for_each(
                |(o, w)| {
                    for (o, w) in o.iter_mut().zip(w.chunks_exact(rb)) {
                        *o = kernel.dot_on(isa, w, x);
                    }
                },
            );
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Plain element types (f32, f16, bf16): rows of any length, so a tail may follow the lanes.

/// Little-endian f32 at the start of `b`.
#[inline(always)]
fn f32_le(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Little-endian f16 at the start of `b`, widened exactly.
#[inline(always)]
fn f16_le(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Widens f16 bits exactly, as `half::f16::to_f32` and F16C do (NaNs come back quiet,
/// payload kept); plain integer code, so it inlines into every kernel.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from(h >> 10) & 0x1F;
    let man = u32::from(h & 0x03FF);
    let magnitude = match exp {
        // Zero and subnormals: man · 2⁻²⁴, exact in f32.
        0 => (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        0x1F if man == 0 => 0x7F80_0000,
        0x1F => 0x7FC0_0000 | (man << 13),
        _ => ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// Little-endian bf16 at the start of `b`, widened exactly.
#[inline(always)]
fn bf16_le(b: &[u8]) -> f32 {
    bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Widens a row of plain elements of `size` bytes, each read by `elem`.
fn decode_plain(bytes: &[u8], out: &mut [f32], size: usize, elem: fn(&[u8]) -> f32) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(size)) {
        *o = elem(b);
    }
}

/// Sums the 16 lanes in `kernels::dot_f32`'s own fixed tree: `dot_f32(acc, 1)` adds each
/// lane times 1.0 (exact) to a zero lane (exact: a lane that starts at +0.0 can never
/// become −0.0), then combines the lanes as every dot product does.
#[inline(always)]
fn combine(acc: &[f32; LANES]) -> f32 {
    dot_f32(acc, &[1.0; LANES])
}

/// Lane-ordered dot product of a plain row read element by element (the portable path for
/// f16, and for f32/bf16 rows not aligned to their element size).
fn dot_plain(bytes: &[u8], x: &[f32], size: usize, elem: fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let bc = bytes.chunks_exact(LANES * size);
    let xc = x.chunks_exact(LANES);
    let (bt, xt) = (bc.remainder(), xc.remainder());
    for (b, xs) in bc.zip(xc) {
        for i in 0..LANES {
            acc[i] += elem(&b[i * size..]) * xs[i];
        }
    }
    let mut s = combine(&acc);
    for (b, xv) in bt.chunks_exact(size).zip(xt) {
        s += elem(b) * xv;
    }
    s
}

/// f16 rows: converted 16 at a time with F16C where the CPU has it (exact, as `half`).
fn dot_f16(isa: Isa, bytes: &[u8], x: &[f32]) -> f32 {
    match isa {
        // SAFETY: `Isa::detect` found AVX2 and F16C; `bytes` holds `x.len()` f16 values.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 { f16c: true } => unsafe { avx2::dot_f16(bytes, x) },
        _ => dot_plain(bytes, x, 2, f16_le),
    }
}

// ---------------------------------------------------------------------------------------
// Block formats.

/// One ggml block format: its geometry, its exact decoder, and its AVX2 accumulator.
trait BlockFormat {
    /// Elements per block (a multiple of 16, so blocks never split a lane group).
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// Decodes one block (`BYTES` bytes) into `out` (`ELEMS` values), as ggml does.
    fn decode(b: &[u8], out: &mut [f32]);
    /// Decodes one block in registers, bitwise as [`BlockFormat::decode`], and hands its
    /// weights to `acc` 16 at a time in element order (elements `at..at + ELEMS` of the
    /// row): an accumulator multiplies them into its vectors, a store writes them out.
    ///
    /// # Safety
    /// The CPU must have AVX2; `b` holds `BYTES` bytes and `acc` takes elements up to
    /// `at + ELEMS` (see [`avx2::Sink`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn accumulate_avx2<S: avx2::Sink>(b: &[u8], at: usize, acc: &mut S);
}

/// Decodes whole blocks: the scalar decoder, or its AVX2 sibling (the same bits).
fn decode_blocks<F: BlockFormat>(isa: Isa, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), bytes.len() / F::BYTES * F::ELEMS, "the output must hold the blocks' elements");
    match isa {
        Isa::Portable => {
            for (b, o) in bytes.chunks_exact(F::BYTES).zip(out.chunks_exact_mut(F::ELEMS)) {
                F::decode(b, o);
            }
        }
        // SAFETY: `Isa::detect` found AVX2; `out` holds the blocks' elements (above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 { .. } => unsafe { avx2::decode_blocks::<F>(bytes, out) },
    }
}

/// The fused dot products of one row of block format `F` with `N` vectors.
fn dot_blocks<F: BlockFormat, const N: usize>(isa: Isa, bytes: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let elems = bytes.len() / F::BYTES * F::ELEMS;
    assert!(xs.iter().all(|x| x.len() == elems), "every vector must have the row's {elems} elements");
    match isa {
        Isa::Portable => dot_blocks_portable::<F, N>(bytes, xs),
        // SAFETY: `Isa::detect` found AVX2; every vector holds the row's elements (above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 { .. } => unsafe { avx2::dot_blocks::<F, N>(bytes, xs) },
    }
}

/// The portable fused dot products: each block decoded into a stack buffer by the very
/// decoder of [`dequantize_row`], then multiplied into each vector's lanes.
fn dot_blocks_portable<F: BlockFormat, const N: usize>(bytes: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let mut acc = [[0.0f32; LANES]; N];
    let mut w = [0.0f32; QK_K];
    let w = &mut w[..F::ELEMS];
    for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
        F::decode(b, w);
        for (acc, x) in acc.iter_mut().zip(xs) {
            let xb = &x[k * F::ELEMS..(k + 1) * F::ELEMS];
            for (wc, xc) in w.chunks_exact(LANES).zip(xb.chunks_exact(LANES)) {
                for i in 0..LANES {
                    acc[i] += wc[i] * xc[i];
                }
            }
        }
    }
    acc.map(|a| combine(&a))
}

/// The f16 scale stored at byte `at` of a block, widened exactly.
#[inline(always)]
fn scale_at(b: &[u8], at: usize) -> f32 {
    f16_le(&b[at..])
}

/// Q8_0: `d: f16`, `qs: [i8; 32]`; `y = q·d`.
struct Q8_0;

impl BlockFormat for Q8_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 34;

    fn decode(b: &[u8], out: &mut [f32]) {
        let d = scale_at(b, 0);
        for (o, &q) in out.iter_mut().zip(&b[2..34]) {
            *o = (q as i8) as f32 * d;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<S: avx2::Sink>(b: &[u8], at: usize, acc: &mut S) {
        use std::arch::x86_64::*;
        let d = _mm256_set1_ps(scale_at(b, 0));
        for c in 0..2 {
            let q = _mm_loadu_si128(b.as_ptr().add(2 + 16 * c) as *const __m128i);
            let (lo, hi) = avx2::i8x16_to_f32(q);
            acc.add(_mm256_mul_ps(lo, d), _mm256_mul_ps(hi, d), at + 16 * c);
        }
    }
}

/// Q4_0: `d: f16`, `qs: [u8; 16]`; element `j` is the low nibble of `qs[j]`, element
/// `j + 16` the high nibble; `y = (nibble − 8)·d`.
struct Q4_0;

impl BlockFormat for Q4_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 18;

    fn decode(b: &[u8], out: &mut [f32]) {
        let d = scale_at(b, 0);
        for (j, &q) in b[2..18].iter().enumerate() {
            out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<S: avx2::Sink>(b: &[u8], at: usize, acc: &mut S) {
        use std::arch::x86_64::*;
        let d = _mm256_set1_ps(scale_at(b, 0));
        let q = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
        let eight = _mm_set1_epi8(8);
        for (c, nib) in avx2::nibbles(q).into_iter().enumerate() {
            let (lo, hi) = avx2::i8x16_to_f32(_mm_sub_epi8(nib, eight));
            acc.add(_mm256_mul_ps(lo, d), _mm256_mul_ps(hi, d), at + 16 * c);
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block's 12 packed
/// scale bytes (ggml's `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The (scale, min) pairs of the two 32-element sub-blocks of 64-element group `g` of a
/// Q4_K/Q5_K block: `(d·sc, dmin·m)` as ggml computes them.
#[inline(always)]
fn k4_group_scales(b: &[u8], g: usize) -> [(f32, f32); 2] {
    let (d, dmin) = (scale_at(b, 0), scale_at(b, 2));
    let (sc1, m1) = scale_min_k4(2 * g, &b[4..16]);
    let (sc2, m2) = scale_min_k4(2 * g + 1, &b[4..16]);
    [(d * sc1 as f32, dmin * m1 as f32), (d * sc2 as f32, dmin * m2 as f32)]
}

/// Q4_K: `d, dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`. Group `g` (64 elements)
/// reads `qs[32g..32g+32]`: low nibbles with sub-block `2g`, then high nibbles with
/// `2g+1`; `y = (d·sc)·q − dmin·m`.
struct Q4K;

impl BlockFormat for Q4K {
    const ELEMS: usize = QK_K;
    const BYTES: usize = 144;

    fn decode(b: &[u8], out: &mut [f32]) {
        for (g, y) in out.chunks_exact_mut(64).enumerate() {
            let [(d1, m1), (d2, m2)] = k4_group_scales(b, g);
            let q = &b[16 + 32 * g..16 + 32 * g + 32];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<S: avx2::Sink>(b: &[u8], at: usize, acc: &mut S) {
        use std::arch::x86_64::*;
        let q = b.as_ptr().add(16);
        for g in 0..4 {
            // Elements 64g + 0..32 are the 32 bytes' low nibbles, 64g + 32..64 the high.
            let [lo, hi] = avx2::nibbles32(_mm256_loadu_si256(q.add(32 * g) as *const __m256i));
            avx2::k4_group(acc, [lo, hi], k4_group_scales(b, g), at + 64 * g);
        }
    }
}

/// Q5_K: Q4_K's layout plus `qh: [u8; 32]` before `qs`; bit `2g` (low nibbles) or
/// `2g+1` (high nibbles) of `qh[l]` adds 16 to the quant;
/// `y = (d·sc)·(nibble + 16·bit) − dmin·m`.
struct Q5K;

impl BlockFormat for Q5K {
    const ELEMS: usize = QK_K;
    const BYTES: usize = 176;

    fn decode(b: &[u8], out: &mut [f32]) {
        let qh = &b[16..48];
        for (g, y) in out.chunks_exact_mut(64).enumerate() {
            let [(d1, m1), (d2, m2)] = k4_group_scales(b, g);
            let ql = &b[48 + 32 * g..48 + 32 * g + 32];
            let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<S: avx2::Sink>(b: &[u8], at: usize, acc: &mut S) {
        use std::arch::x86_64::*;
        let p = b.as_ptr();
        let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
        for g in 0..4 {
            let [lo, hi] = avx2::nibbles32(_mm256_loadu_si256(p.add(48 + 32 * g) as *const __m256i));
            let (bit1, bit2) = (1u8 << (2 * g), 2u8 << (2 * g));
            let q = [avx2::add_high_bit(lo, qh, bit1), avx2::add_high_bit(hi, qh, bit2)];
            avx2::k4_group(acc, q, k4_group_scales(b, g), at + 64 * g);
        }
    }
}

/// Q6_K: `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16`. Each 128-element
/// half `n` has four 32-element groups `k`: the low (`k` = 0, 1) or high (`k` = 2, 3)
/// nibbles of `ql[64n + 32(k&1) + l]` with bits `2k..2k+2` of `qh[32n + l]` on top, minus
/// 32; element `l` uses scale `scales[8n + 2k + l/16]`; `y = (d·sc)·q`.
struct Q6K;

impl Q6K {
    /// `d·sc` for the 16 elements starting at element `16·c` of the block (c in 0..16),
    /// `d` being the block's scale.
    #[inline(always)]
    fn scale(b: &[u8], d: f32, c: usize) -> f32 {
        let (n, k, h) = (c / 8, (c / 2) % 4, c % 2);
        d * (b[192 + 8 * n + 2 * k + h] as i8) as f32
    }
}

impl BlockFormat for Q6K {
    const ELEMS: usize = QK_K;
    const BYTES: usize = 210;

    fn decode(b: &[u8], out: &mut [f32]) {
        let d = scale_at(b, 208);
        for (c, y) in out.chunks_exact_mut(16).enumerate() {
            let (n, k, h) = (c / 8, (c / 2) % 4, c % 2);
            let ds = Q6K::scale(b, d, c);
            for (i, y) in y.iter_mut().enumerate() {
                let l = 16 * h + i;
                let ql = b[64 * n + 32 * (k & 1) + l];
                let low = if k < 2 { ql & 0x0F } else { ql >> 4 };
                let high = (b[128 + 32 * n + l] >> (2 * k)) & 3;
                *y = ds * ((low | (high << 4)) as i8 - 32) as f32;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<S: avx2::Sink>(b: &[u8], at: usize, acc: &mut S) {
        use std::arch::x86_64::*;
        let (m4, three, bias) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3), _mm256_set1_epi8(32));
        let d = scale_at(b, 208);
        let p = b.as_ptr();
        // A block half n at a time: its 64 ql and 32 qh bytes in three 32-byte loads, each
        // group k's 32 quants formed at once, then used 16 at a time (c = 8n + 2k + h, in
        // order, as the decoder's chunks).
        for n in 0..2 {
            let ql = [0, 32].map(|o| _mm256_loadu_si256(p.add(64 * n + o) as *const __m256i));
            let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
            for k in 0..4 {
                // Only the nibble half group k uses (`nibbles32(..)[k / 2]` forms both and
                // measured 1.3x slower at 16 tokens: cpu-q6k-wide-2026-12-03.txt).
                let low = match k {
                    0 | 1 => _mm256_and_si256(ql[k], m4),
                    _ => _mm256_and_si256(_mm256_srli_epi16(ql[k & 1], 4), m4),
                };
                // Bits 2k..2k+2 of each byte (the 16-bit shift's spill-over is masked off).
                let high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), three);
                let q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), bias);
                for (h, q) in avx2::halves(q).into_iter().enumerate() {
                    let c = 8 * n + 2 * k + h;
                    let (lo, hi) = avx2::i8x16_to_f32(q);
                    let ds = _mm256_set1_ps(Q6K::scale(b, d, c));
                    acc.add(_mm256_mul_ps(ds, lo), _mm256_mul_ps(ds, hi), at + 16 * c);
                }
            }
        }
    }
}

/// The AVX2 (8-wide) paths: lanes 0..8 and 8..16 of the 16-lane accumulator as two
/// vectors, multiply then add (no FMA), combined like the portable path.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{combine, f16_le, BlockFormat, LANES};

    /// `N` vectors and their 16-lane accumulators (lanes 0..8 and 8..16 each).
    pub(super) struct Acc<const N: usize> {
        xs: [*const f32; N],
        sums: [[__m256; 2]; N],
    }

    /// Where a block's weights go, 16 at a time (lanes 0..8 as `w0`, 8..16 as `w1`) for
    /// elements `at..at + 16` of the row.
    pub(super) trait Sink {
        /// Takes the weights of elements `at..at + 16`.
        ///
        /// # Safety
        /// AVX2 is present and the sink's memory holds element `at + 15`.
        unsafe fn add(&mut self, w0: __m256, w1: __m256, at: usize);
    }

    impl<const N: usize> Sink for Acc<N> {
        /// Adds `w · x[at..at + 16]` lane by lane to every vector's accumulator.
        #[inline(always)]
        unsafe fn add(&mut self, w0: __m256, w1: __m256, at: usize) {
            for (s, x) in self.sums.iter_mut().zip(self.xs) {
                s[0] = _mm256_add_ps(s[0], _mm256_mul_ps(w0, _mm256_loadu_ps(x.add(at))));
                s[1] = _mm256_add_ps(s[1], _mm256_mul_ps(w1, _mm256_loadu_ps(x.add(at + 8))));
            }
        }
    }

    /// The decoded weights written to a row of f32 (the vectorised decoder).
    struct Store(*mut f32);

    impl Sink for Store {
        #[inline(always)]
        unsafe fn add(&mut self, w0: __m256, w1: __m256, at: usize) {
            _mm256_storeu_ps(self.0.add(at), w0);
            _mm256_storeu_ps(self.0.add(at + 8), w1);
        }
    }

    impl<const N: usize> Acc<N> {
        /// Zero accumulators for `xs`.
        #[inline(always)]
        unsafe fn new(xs: [&[f32]; N]) -> Self {
            Acc { xs: xs.map(|x| x.as_ptr()), sums: [[_mm256_setzero_ps(); 2]; N] }
        }

        /// Each vector's lanes combined in the fixed tree.
        #[inline(always)]
        unsafe fn sums(&self) -> [f32; N] {
            self.sums.map(|s| {
                let mut lanes = [0.0f32; LANES];
                _mm256_storeu_ps(lanes.as_mut_ptr(), s[0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), s[1]);
                combine(&lanes)
            })
        }
    }

    /// The low and high nibbles of 16 bytes.
    #[inline(always)]
    pub(super) unsafe fn nibbles(q: __m128i) -> [__m128i; 2] {
        let m = _mm_set1_epi8(0x0F);
        [_mm_and_si128(q, m), _mm_and_si128(_mm_srli_epi16(q, 4), m)]
    }

    /// Hands `acc` the weights `d·q − m` of elements `at..at + 16` for 16 unsigned quants
    /// `q` (Q4_K/Q5_K's element formula, the same two roundings as the scalar decoder).
    ///
    /// # Safety
    /// AVX2 is present and `acc` takes elements up to `at + 16`.
    #[inline(always)]
    pub(super) unsafe fn scale_sub_add<S: Sink>(acc: &mut S, q: __m128i, d: f32, m: f32, at: usize) {
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        let (lo, hi) = u8x16_to_f32(q);
        acc.add(_mm256_sub_ps(_mm256_mul_ps(d, lo), m), _mm256_sub_ps(_mm256_mul_ps(d, hi), m), at);
    }

    /// `q + 16` where `qh & bit` is set (Q5_K's fifth bit), bytewise.
    #[inline(always)]
    pub(super) unsafe fn add_high_bit(q: __m256i, qh: __m256i, bit: u8) -> __m256i {
        let bit = _mm256_set1_epi8(bit as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }

    /// The low and high nibbles of 32 bytes.
    #[inline(always)]
    pub(super) unsafe fn nibbles32(q: __m256i) -> [__m256i; 2] {
        let m = _mm256_set1_epi8(0x0F);
        [_mm256_and_si256(q, m), _mm256_and_si256(_mm256_srli_epi16(q, 4), m)]
    }

    /// The first and second 16 bytes of 32.
    #[inline(always)]
    pub(super) unsafe fn halves(q: __m256i) -> [__m128i; 2] {
        [_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)]
    }

    /// One 64-element group of a Q4_K / Q5_K block: its 32 low quants `q[0]` (elements
    /// `at..at + 32`, sub-block scale and min `dm[0]`) then its 32 high ones `q[1]`, 16 at
    /// a time in element order.
    ///
    /// # Safety
    /// AVX2 is present and `acc` takes elements up to `at + 64`.
    #[inline(always)]
    pub(super) unsafe fn k4_group<S: Sink>(acc: &mut S, q: [__m256i; 2], dm: [(f32, f32); 2], at: usize) {
        for (j, (q, (d, m))) in q.into_iter().zip(dm).enumerate() {
            for (h, q) in halves(q).into_iter().enumerate() {
                scale_sub_add(acc, q, d, m, at + 32 * j + 16 * h);
            }
        }
    }

    /// 16 unsigned bytes as two vectors of 8 f32 (exact).
    #[inline(always)]
    pub(super) unsafe fn u8x16_to_f32(q: __m128i) -> (__m256, __m256) {
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))),
        )
    }

    /// 16 signed bytes as two vectors of 8 f32 (exact).
    #[inline(always)]
    pub(super) unsafe fn i8x16_to_f32(q: __m128i) -> (__m256, __m256) {
        (
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))),
        )
    }

    /// AVX2 sibling of `dot_blocks_portable`.
    ///
    /// # Safety
    /// AVX2 is present; every vector holds `bytes.len() / F::BYTES * F::ELEMS` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot_blocks<F: BlockFormat, const N: usize>(
        bytes: &[u8],
        xs: [&[f32]; N],
    ) -> [f32; N] {
        let mut acc = Acc::new(xs);
        for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
            F::accumulate_avx2(b, k * F::ELEMS, &mut acc);
        }
        acc.sums()
    }

    /// AVX2 sibling of `decode_blocks`: each block decoded in registers (bitwise the
    /// scalar decoder) and stored.
    ///
    /// # Safety
    /// AVX2 is present; `out` holds `bytes.len() / F::BYTES * F::ELEMS` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode_blocks<F: BlockFormat>(bytes: &[u8], out: &mut [f32]) {
        let mut store = Store(out.as_mut_ptr());
        for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
            F::accumulate_avx2(b, k * F::ELEMS, &mut store);
        }
    }

    /// f16 rows, 16 values per step through F16C, then the tail in order.
    ///
    /// # Safety
    /// AVX2 and F16C are present; `bytes` holds `x.len()` f16 values.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot_f16(bytes: &[u8], x: &[f32]) -> f32 {
        let n = x.len() / LANES * LANES;
        let mut acc = Acc::new([x]);
        let p = bytes.as_ptr();
        let mut i = 0;
        while i < n {
            let w0 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i));
            let w1 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i + 16) as *const __m128i));
            acc.add(w0, w1, i);
            i += LANES;
        }
        let [mut s] = acc.sums();
        for (b, xv) in bytes[2 * n..].chunks_exact(2).zip(&x[n..]) {
            s += f16_le(b) * xv;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every supported type.
    const TYPES: [GgmlType; 8] = GgmlType::SUPPORTED;

    /// Random valid rows: random bytes with every f16 scale replaced by a finite value
    /// of moderate size (so products stay finite).
    fn random_row(rng: &mut ChaCha8Rng, ty: GgmlType, cols: usize) -> Vec<u8> {
        let n = ty.row_bytes(cols).unwrap();
        let mut b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        let f16_at = |rng: &mut ChaCha8Rng, b: &mut [u8], at: usize| {
            let v = f16::from_f32(rng.random_range(-2.0f32..2.0));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        };
        let bb = ty.block_bytes();
        match ty {
            GgmlType::F32 => {
                for c in b.chunks_exact_mut(4) {
                    c.copy_from_slice(&rng.random_range(-2.0f32..2.0).to_le_bytes());
                }
            }
            GgmlType::F16 | GgmlType::Bf16 => {
                for c in b.chunks_exact_mut(2) {
                    let v = rng.random_range(-2.0f32..2.0);
                    let bits = if ty == GgmlType::F16 {
                        f16::from_f32(v).to_bits()
                    } else {
                        half::bf16::from_f32(v).to_bits()
                    };
                    c.copy_from_slice(&bits.to_le_bytes());
                }
            }
            GgmlType::Q8_0 | GgmlType::Q4_0 => (0..n / bb).for_each(|k| f16_at(rng, &mut b, k * bb)),
            GgmlType::Q4K | GgmlType::Q5K => (0..n / bb).for_each(|k| {
                f16_at(rng, &mut b, k * bb);
                f16_at(rng, &mut b, k * bb + 2);
            }),
            GgmlType::Q6K => (0..n / bb).for_each(|k| f16_at(rng, &mut b, k * bb + 208)),
            _ => unreachable!(),
        }
        b
    }

    fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn portable_dot(ty: GgmlType, bytes: &[u8], x: &[f32]) -> f32 {
        Kernel::of(ty).unwrap().dot_on(Isa::Portable, bytes, x)
    }

    #[test]
    fn fused_dot_is_bitwise_dequantize_then_dot_f32() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        for ty in TYPES {
            let be = ty.block_elems().max(1);
            for blocks in [1, 2, 3, 8, 11] {
                let cols = if be == 1 { [1, 15, 16, 17, 100, 2051][blocks % 6] } else { blocks * be };
                for _ in 0..20 {
                    let row = random_row(&mut rng, ty, cols);
                    let x = rand_vec(&mut rng, cols);
                    let mut w = vec![0.0; cols];
                    dequantize_row(ty, &row, &mut w).unwrap();
                    let want = dot_f32(&w, &x).to_bits();
                    assert_eq!(dot_row(ty, &row, &x).unwrap().to_bits(), want, "{ty} cols {cols}");
                    assert_eq!(portable_dot(ty, &row, &x).to_bits(), want, "{ty} portable cols {cols}");
                }
            }
        }
    }

    #[test]
    fn unaligned_plain_rows_take_the_portable_path() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for ty in [GgmlType::F32, GgmlType::Bf16, GgmlType::F16] {
            let cols = 37;
            let row = random_row(&mut rng, ty, cols);
            let mut shifted = vec![0u8; row.len() + 1];
            shifted[1..].copy_from_slice(&row);
            let x = rand_vec(&mut rng, cols);
            let a = dot_row(ty, &row, &x).unwrap();
            let b = dot_row(ty, &shifted[1..], &x).unwrap();
            assert_eq!(a.to_bits(), b.to_bits(), "{ty}");
        }
    }

    #[test]
    fn matvec_rows_are_dot_rows_serial_and_parallel() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        for ty in TYPES {
            // Small (serial) and large enough to run in parallel.
            for (rows, cols) in [(3, 256), (300, 512)] {
                let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, ty, cols)).collect();
                let m = QuantMatrix::new(ty, &data, rows, cols).unwrap();
                let x = rand_vec(&mut rng, cols);
                let mut out = vec![0.0; rows];
                m.matvec(&x, &mut out).unwrap();
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(o.to_bits(), dot_row(ty, m.row(r).unwrap(), &x).unwrap().to_bits(), "{ty}");
                }
                let mut w = vec![0.0; cols];
                m.dequantize_row(rows - 1, &mut w).unwrap();
                assert_eq!(out[rows - 1].to_bits(), dot_f32(&w, &x).to_bits());
            }
        }
    }

    /// The AVX2 decoder (the accumulate routines storing their weights) gives the scalar
    /// decoder's bits for every format.
    #[test]
    fn every_isa_dequantizes_to_the_same_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for ty in TYPES {
            let cols = 3 * ty.block_elems().max(16);
            let row = random_row(&mut rng, ty, cols);
            let kernel = Kernel::of(ty).unwrap();
            let (mut portable, mut detected) = (vec![0.0f32; cols], vec![1.0f32; cols]);
            kernel.dequantize_on(Isa::Portable, &row, &mut portable);
            kernel.dequantize_on(Isa::detect(), &row, &mut detected);
            let (a, b): (&[u32], &[u32]) = (bytemuck::cast_slice(&portable), bytemuck::cast_slice(&detected));
            assert_eq!(a, b, "{ty}");
        }
    }

    /// gguf-py's dequantisation of random valid blocks (tests/fixtures/make_quant_blocks.py),
    /// reproduced bit for bit; the fused dot product on the same rows matches too.
    #[test]
    fn dequantize_matches_gguf_py_golden_blocks() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant_blocks");
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for ty in TYPES {
            let blocks = std::fs::read(dir.join(format!("{}.blocks", ty.name()))).unwrap();
            let golden: Vec<u32> = std::fs::read(dir.join(format!("{}.f32", ty.name())))
                .unwrap()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let mut out = vec![0.0f32; golden.len()];
            dequantize_row(ty, &blocks, &mut out).unwrap();
            let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            let first_diff = bits.iter().zip(&golden).position(|(a, b)| a != b);
            assert_eq!(first_diff, None, "{ty}: element {first_diff:?} differs from gguf-py");
            let x = rand_vec(&mut rng, out.len());
            assert_eq!(dot_row(ty, &blocks, &x).unwrap().to_bits(), dot_f32(&out, &x).to_bits(), "{ty}");
        }
    }

    #[test]
    fn f16_widening_matches_half_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            assert_eq!(f16_to_f32(h).to_bits(), f16::from_bits(h).to_f32().to_bits(), "{h:#06x}");
        }
    }

    #[test]
    fn kernels_cover_exactly_the_supported_types() {
        for ty in GgmlType::ALL {
            assert_eq!(Kernel::of(ty).is_some(), ty.is_supported(), "{ty}");
        }
    }

    #[test]
    fn row_dots_are_bitwise_row_dot_for_each_vector() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for ty in TYPES {
            let cols = if ty.block_elems() == 1 { 37 } else { 3 * ty.block_elems() };
            let rows = 3;
            let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, ty, cols)).collect();
            let m = QuantMatrix::new(ty, &data, rows, cols).unwrap();
            let xs: Vec<Vec<f32>> = (0..4).map(|_| rand_vec(&mut rng, cols)).collect();
            let group = [&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]];
            for r in 0..rows {
                let four = m.row_dots(r, group).map(f32::to_bits);
                let portable = m.kernel.dots_on(Isa::Portable, m.row(r).unwrap(), group).map(f32::to_bits);
                let single = group.map(|x| m.row_dot(r, x).to_bits());
                assert_eq!((four, portable), (single, single), "{ty} row {r}");
            }
        }
    }

    #[test]
    fn known_values() {
        // Q8_0: d = 0.5, q = -3 → -1.5.
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = (-3i8) as u8;
        let mut out = vec![0.0; 32];
        dequantize_row(GgmlType::Q8_0, &b, &mut out).unwrap();
        assert_eq!((out[0], out[1]), (-1.5, 0.0));
        // Q4_0: qs[0] = 0x9F → element 0 is (15 − 8)·d, element 16 is (9 − 8)·d.
        let mut b = vec![0x88u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2] = 0x9F;
        dequantize_row(GgmlType::Q4_0, &b, &mut out).unwrap();
        assert_eq!((out[0], out[16], out[1]), (14.0, 2.0, 0.0));
    }

    #[test]
    fn bad_sizes_and_types_are_errors() {
        let mut out = vec![0.0; 256];
        assert_eq!(
            dequantize_row(GgmlType::Q4K, &[0; 143], &mut out),
            Err(QuantError::Size { ty: GgmlType::Q4K, bytes: 143, rows: 1, cols: 256 })
        );
        assert!(matches!(dot_row(GgmlType::Q8_0, &[0; 34], &[0.0; 31]), Err(QuantError::Size { .. })));
        let e = dot_row(GgmlType::Q3K, &[0; 110], &[0.0; 256]).unwrap_err();
        assert_eq!(e, QuantError::Unsupported { ty: GgmlType::Q3K });
        assert!(e.to_string().contains("q3_K") && e.to_string().contains("q6_K"), "{e}");
        assert!(QuantMatrix::new(GgmlType::Q8_0, &[0; 68], 3, 32).is_err());
        let m = QuantMatrix::new(GgmlType::Q8_0, &[0; 68], 2, 32).unwrap();
        assert!(m.matvec(&[0.0; 31], &mut [0.0; 2]).is_err());
        assert!(m.matvec(&[0.0; 32], &mut [0.0; 3]).is_err());
        assert!(m.row(2).is_none());
        assert_eq!(m.dequantize_row(2, &mut [0.0; 32]), Err(QuantError::Row { row: 2, rows: 2 }));
        assert!(m.dequantize_row(1, &mut [0.0; 31]).is_err());
        assert_eq!((m.ty(), m.rows(), m.cols()), (GgmlType::Q8_0, 2, 32));
    }
}
