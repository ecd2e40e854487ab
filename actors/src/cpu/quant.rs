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
//! **Dot products** multiply f32 activations (activations are never quantised). Plain
//! types (f32, f16, bf16) are the 16-lane order of `kernels::dot_f32`: element `i` goes
//! to lane `i % 16`, lanes are combined in a fixed tree, the tail is added last in order.
//! Block formats form each weight with one rounding and multiply it in with a fused
//! multiply-add, in the order of [`super::fused`] (the dequantised row's dot product up to
//! f32 rounding, not bitwise). On CPUs with AVX2 and FMA each block format forms its
//! quants and factors eight at a time in registers, the same values as the plain-Rust
//! path, so both give the same bits; the same routine, storing instead of multiplying, is
//! the AVX2 decoder and forms [`Fused`] rows for many tokens. [`QuantMatrix::row_dots`]
//! decodes a row once for several activation vectors (the token-batched sibling), each
//! result bitwise the single dot product.

use rayon::prelude::*;
use smoe_proto::ggml::{GgmlType, QK_K};

use super::fused::{self, Fused};
use super::kernels::{dot_bf16, dot_f32};
use crate::tensor::bf16_to_f32;

/// Lanes of the fixed accumulation order (those of `kernels::dot_f32`).
pub(super) const LANES: usize = 16;
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

    /// The fused weights (`fused`'s) of whole rows of a block format into `into`; `false`
    /// for the plain types, whose weights are their values.
    fn fuse_rows(self, isa: Isa, bytes: &[u8], into: &mut Fused) -> bool {
        match self {
            Kernel::F32 | Kernel::F16 | Kernel::Bf16 => return false,
            Kernel::Q8_0 => fuse_blocks::<Q8_0>(isa, bytes, into),
            Kernel::Q4_0 => fuse_blocks::<Q4_0>(isa, bytes, into),
            Kernel::Q4K => fuse_blocks::<Q4K>(isa, bytes, into),
            Kernel::Q5K => fuse_blocks::<Q5K>(isa, bytes, into),
            Kernel::Q6K => fuse_blocks::<Q6K>(isa, bytes, into),
        }
        true
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
/// [`Isa::detect`], on a CPU that has AVX2, FMA and F16C (every AVX2 CPU made since 2013).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// 8-wide AVX2 with FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The widest path the running CPU supports (feature checks are cached by std).
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if fused::avx2::present() {
            return Isa::Avx2;
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
/// registers: for plain types bitwise `kernels::dot_f32` of the widened row, for block
/// formats the order of [`super::fused`].
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

    /// The fused weights of rows `rs` of a block-format matrix into `into` (`cols` a row),
    /// whose [`fused::dots`] are then bitwise this matrix's [`QuantMatrix::row_dots`];
    /// `false`, leaving `into` alone, for the plain types.
    ///
    /// # Panics
    /// If `rs` is not a range of rows.
    pub fn fuse_rows(&self, rs: std::ops::Range<usize>, into: &mut Fused) -> bool {
        assert!(rs.start <= rs.end && rs.end <= self.rows, "rows {rs:?} of {}", self.rows);
        let bytes = &self.data[rs.start * self.row_bytes..rs.end * self.row_bytes];
        self.kernel.fuse_rows(Isa::detect(), bytes, into)
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
pub(super) fn combine(acc: &[f32; LANES]) -> f32 {
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
        Isa::Avx2 => unsafe { avx2::dot_f16(bytes, x) },
        Isa::Portable => dot_plain(bytes, x, 2, f16_le),
    }
}

// ---------------------------------------------------------------------------------------
// Block formats.

/// One ggml block format: its geometry and its factors (each group's quants, scale and
/// min), formed in plain Rust or in AVX2 registers with the same values.
trait BlockFormat {
    /// Elements per block.
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// Elements per group (one scale and min each): 16 or 32, an even number per block.
    const GROUP: usize;
    /// Whether the groups have mins (weights `a·q − b`; otherwise `a·q`).
    const MINS: bool;
    /// One block's quants (`ELEMS` exact values) into `q`, each group's scale and min
    /// (zero without mins) into `a` and `m`, as ggml forms them.
    fn factors(b: &[u8], q: &mut [f32], a: &mut [f32], m: &mut [f32]);
    /// [`BlockFormat::factors`] in registers: each group handed to `sink` in element
    /// order (elements `at..at + ELEMS` of the row), the same values.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `b` holds `BYTES` bytes and `sink` takes elements up
    /// to `at + ELEMS` (see [`avx2::Sink`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn factors_avx2<S: avx2::Sink>(b: &[u8], at: usize, sink: &mut S);
}

/// A block's factors in plain Rust, in stack buffers.
struct BlockFactors {
    q: [f32; QK_K],
    a: [f32; QK_K / 16],
    m: [f32; QK_K / 16],
}

impl BlockFactors {
    /// The factors of block `b` of format `F`.
    #[inline(always)]
    fn of<F: BlockFormat>(b: &[u8]) -> Self {
        let mut f = BlockFactors { q: [0.0; QK_K], a: [0.0; QK_K / 16], m: [0.0; QK_K / 16] };
        let groups = F::ELEMS / F::GROUP;
        F::factors(b, &mut f.q[..F::ELEMS], &mut f.a[..groups], &mut f.m[..groups]);
        f
    }

    /// The weights of block `b` of format `F` into `out` (`F::ELEMS` values): the
    /// products' (`fused::weight`) when `fused`, else ggml's dequantised `a·q − b` (two
    /// roundings, in that order; `b` is zero without mins, which leaves `a·q`) — the plain
    /// Rust of `fused::avx2::Sink::group`.
    #[inline(always)]
    fn weights<F: BlockFormat>(b: &[u8], out: &mut [f32], fused: bool) {
        let f = Self::of::<F>(b);
        for (i, o) in out.iter_mut().enumerate() {
            let (a, q, m) = (f.a[i / F::GROUP], f.q[i], f.m[i / F::GROUP]);
            *o = if fused { fused::weight(a, q, m, F::MINS) } else { a * q - m };
        }
    }
}

/// Decodes whole blocks to ggml's weights `a·q − b` (two roundings, in that order; `b` is
/// zero without mins, which leaves `a·q` unchanged): plain Rust or AVX2, the same bits.
fn decode_blocks<F: BlockFormat>(isa: Isa, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), bytes.len() / F::BYTES * F::ELEMS, "the output must hold the blocks' elements");
    match isa {
        Isa::Portable => {
            for (b, o) in bytes.chunks_exact(F::BYTES).zip(out.chunks_exact_mut(F::ELEMS)) {
                BlockFactors::weights::<F>(b, o, false);
            }
        }
        // SAFETY: `Isa::detect` found AVX2 and FMA; `out` holds the blocks' elements (above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::decode_blocks::<F>(bytes, out) },
    }
}

/// The fused weights (`fused::weight`) of whole blocks into `into`, resized to the
/// blocks' elements.
fn fuse_blocks<F: BlockFormat>(isa: Isa, bytes: &[u8], into: &mut Fused) {
    into.resize(bytes.len() / F::BYTES * F::ELEMS, 0.0);
    match isa {
        Isa::Portable => {
            for (b, o) in bytes.chunks_exact(F::BYTES).zip(into.chunks_exact_mut(F::ELEMS)) {
                BlockFactors::weights::<F>(b, o, true);
            }
        }
        // SAFETY: `Isa::detect` found AVX2 and FMA; `into` holds the blocks' elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::fuse_blocks::<F>(bytes, into) },
    }
}

/// The dot products (`fused`'s order) of one row of block format `F` with `N` vectors.
fn dot_blocks<F: BlockFormat, const N: usize>(isa: Isa, bytes: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let elems = bytes.len() / F::BYTES * F::ELEMS;
    assert!(xs.iter().all(|x| x.len() == elems), "every vector must have the row's {elems} elements");
    match isa {
        Isa::Portable => {
            let mut acc = [[0.0f32; LANES]; N];
            let mut w = [0.0f32; QK_K];
            for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
                BlockFactors::weights::<F>(b, &mut w[..F::ELEMS], true);
                for (acc, x) in acc.iter_mut().zip(xs) {
                    fused::accumulate(acc, &w[..F::ELEMS], &x[k * F::ELEMS..(k + 1) * F::ELEMS]);
                }
            }
            acc.map(|a| combine(&a))
        }
        // SAFETY: `Isa::detect` found AVX2 and FMA; every vector holds the row's elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_blocks::<F, N>(bytes, xs) },
    }
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
    const GROUP: usize = 32;
    const MINS: bool = false;

    fn factors(b: &[u8], q: &mut [f32], a: &mut [f32], m: &mut [f32]) {
        for (q, &v) in q.iter_mut().zip(&b[2..34]) {
            *q = (v as i8) as f32;
        }
        (a[0], m[0]) = (scale_at(b, 0), 0.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factors_avx2<S: avx2::Sink>(b: &[u8], at: usize, sink: &mut S) {
        use std::arch::x86_64::*;
        let p = b.as_ptr().add(2);
        let q = std::array::from_fn(|c| {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * c) as *const __m128i)))
        });
        sink.group::<4, false>(q, scale_at(b, 0), 0.0, at);
    }
}

/// Q4_0: `d: f16`, `qs: [u8; 16]`; element `j` is the low nibble of `qs[j]`, element
/// `j + 16` the high nibble; `y = (nibble − 8)·d`.
struct Q4_0;

impl BlockFormat for Q4_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 18;
    const GROUP: usize = 32;
    const MINS: bool = false;

    fn factors(b: &[u8], q: &mut [f32], a: &mut [f32], m: &mut [f32]) {
        for (j, &v) in b[2..18].iter().enumerate() {
            q[j] = ((v & 0x0F) as i32 - 8) as f32;
            q[j + 16] = ((v >> 4) as i32 - 8) as f32;
        }
        (a[0], m[0]) = (scale_at(b, 0), 0.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factors_avx2<S: avx2::Sink>(b: &[u8], at: usize, sink: &mut S) {
        use std::arch::x86_64::*;
        let (p, mask, eight) = (b.as_ptr().add(2), _mm256_set1_epi32(0x0F), _mm256_set1_epi32(8));
        let v = [0, 8].map(|o| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i)));
        let f = |n: __m256i| _mm256_cvtepi32_ps(_mm256_sub_epi32(n, eight));
        let lo = v.map(|v| f(_mm256_and_si256(v, mask)));
        let hi = v.map(|v| f(_mm256_srli_epi32(v, 4)));
        sink.group::<4, false>([lo[0], lo[1], hi[0], hi[1]], scale_at(b, 0), 0.0, at);
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

/// Every sub-block's scale `d·sc` into `a` and min `dmin·m` into `m` (8 each) of a
/// Q4_K/Q5_K block, as ggml computes them.
#[inline(always)]
fn k4_scales(b: &[u8], a: &mut [f32], m: &mut [f32]) {
    let (d, dmin) = (scale_at(b, 0), scale_at(b, 2));
    for j in 0..8 {
        let (sc, mn) = scale_min_k4(j, &b[4..16]);
        (a[j], m[j]) = (d * sc as f32, dmin * mn as f32);
    }
}

/// The factors of a Q4_K block (`qh` none) or a Q5_K block (`qh` its 32 high-bit bytes,
/// `qs` after them): quant `l` of group `g` is the low nibble of `qs[32g + l]` (sub-block
/// `2g`) or the high one (element `l + 32`, sub-block `2g + 1`), plus 16 where bit `2g`
/// or `2g + 1` of `qh[l]` is set.
#[inline(always)]
fn k4_factors(b: &[u8], qh: Option<&[u8]>, q: &mut [f32], a: &mut [f32], m: &mut [f32]) {
    k4_scales(b, a, m);
    let qs = &b[if qh.is_some() { 48 } else { 16 }..];
    for (g, y) in q.chunks_exact_mut(64).enumerate() {
        for (l, &v) in qs[32 * g..32 * g + 32].iter().enumerate() {
            let bit = |i: usize| qh.map_or(0, |h| 16 * ((h[l] >> i) & 1));
            (y[l], y[l + 32]) = (((v & 0x0F) + bit(2 * g)) as f32, ((v >> 4) + bit(2 * g + 1)) as f32);
        }
    }
}

/// Q4_K: `d, dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`. Group `g` (64 elements)
/// reads `qs[32g..32g+32]`: low nibbles with sub-block `2g`, then high nibbles with
/// `2g+1`; `y = (d·sc)·q − dmin·m`.
struct Q4K;

impl BlockFormat for Q4K {
    const ELEMS: usize = QK_K;
    const BYTES: usize = 144;
    const GROUP: usize = 32;
    const MINS: bool = true;

    fn factors(b: &[u8], q: &mut [f32], a: &mut [f32], m: &mut [f32]) {
        k4_factors(b, None, q, a, m);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factors_avx2<S: avx2::Sink>(b: &[u8], at: usize, sink: &mut S) {
        avx2::k4_factors::<S, false>(b, at, sink)
    }
}

/// Q5_K: Q4_K's layout plus `qh: [u8; 32]` before `qs`; bit `2g` (low nibbles) or
/// `2g+1` (high nibbles) of `qh[l]` adds 16 to the quant;
/// `y = (d·sc)·(nibble + 16·bit) − dmin·m`.
struct Q5K;

impl BlockFormat for Q5K {
    const ELEMS: usize = QK_K;
    const BYTES: usize = 176;
    const GROUP: usize = 32;
    const MINS: bool = true;

    fn factors(b: &[u8], q: &mut [f32], a: &mut [f32], m: &mut [f32]) {
        k4_factors(b, Some(&b[16..48]), q, a, m);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factors_avx2<S: avx2::Sink>(b: &[u8], at: usize, sink: &mut S) {
        avx2::k4_factors::<S, true>(b, at, sink)
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
    const GROUP: usize = 16;
    const MINS: bool = false;

    fn factors(b: &[u8], q: &mut [f32], a: &mut [f32], m: &mut [f32]) {
        let d = scale_at(b, 208);
        for (c, y) in q.chunks_exact_mut(16).enumerate() {
            let (n, k, h) = (c / 8, (c / 2) % 4, c % 2);
            (a[c], m[c]) = (Q6K::scale(b, d, c), 0.0);
            for (i, y) in y.iter_mut().enumerate() {
                let l = 16 * h + i;
                let ql = b[64 * n + 32 * (k & 1) + l];
                let low = if k < 2 { ql & 0x0F } else { ql >> 4 };
                let high = (b[128 + 32 * n + l] >> (2 * k)) & 3;
                *y = ((low | (high << 4)) as i8 - 32) as f32;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factors_avx2<S: avx2::Sink>(b: &[u8], at: usize, sink: &mut S) {
        use std::arch::x86_64::*;
        let (m4, three, bias) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3), _mm256_set1_epi8(32));
        let d = scale_at(b, 208);
        let p = b.as_ptr();
        // A block half n at a time: its 64 ql and 32 qh bytes in three 32-byte loads, each
        // group k's 32 quants formed at once, then used 16 at a time (c = 8n + 2k + h, in
        // order).
        for n in 0..2 {
            let ql = [0, 32].map(|o| _mm256_loadu_si256(p.add(64 * n + o) as *const __m256i));
            let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
            for k in 0..4 {
                // Only the nibble half group k uses (forming both measured 1.3x slower at
                // 16 tokens: cpu-q6k-wide-2026-12-03.txt).
                let low = match k {
                    0 | 1 => _mm256_and_si256(ql[k], m4),
                    _ => _mm256_and_si256(_mm256_srli_epi16(ql[k & 1], 4), m4),
                };
                // Bits 2k..2k+2 of each byte (the 16-bit shift's spill-over is masked off).
                let high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), three);
                let q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), bias);
                for (h, q) in
                    [_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)].into_iter().enumerate()
                {
                    let c = 8 * n + 2 * k + h;
                    let v = [q, _mm_srli_si128(q, 8)].map(|q| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
                    sink.group::<2, false>(v, Q6K::scale(b, d, c), 0.0, at + 16 * c);
                }
            }
        }
    }
}

/// The AVX2 + FMA paths of the block formats (the sinks and the order are `fused`'s)
/// and of f16 rows.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub(super) use super::super::fused::avx2::Sink;
    use super::super::fused::avx2::{Dot, Weights};
    use super::{combine, f16_le, BlockFormat, LANES};

    /// Every sub-block's `(d·sc, dmin·m)` of a Q4_K/Q5_K block (bitwise `k4_scales`):
    /// the 12 packed scale bytes unpacked as ggml's `utmp` words, then widened and
    /// multiplied eight at a time (calling the scalar `k4_scales` instead made the m=1
    /// Q4_K product 1.3x slower, 2026-12-05).
    #[inline(always)]
    pub(super) unsafe fn k4_scales(b: &[u8]) -> ([f32; 8], [f32; 8]) {
        let w = |i: usize| u32::from_le_bytes([b[4 + 4 * i], b[5 + 4 * i], b[6 + 4 * i], b[7 + 4 * i]]);
        let (w0, w1, w2) = (w(0), w(1), w(2));
        let (k1, k2, k3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
        let sc = (w0 & k1) as u64 | (((w2 & k2) | (((w0 >> 6) & k3) << 4)) as u64) << 32;
        let mn = (w1 & k1) as u64 | ((((w2 >> 4) & k2) | (((w1 >> 6) & k3) << 4)) as u64) << 32;
        let widen = |v: u64, f: f32| {
            let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(f), q));
            out
        };
        (widen(sc, f16_le(b)), widen(mn, f16_le(&b[2..])))
    }

    /// `k4_factors` in registers (`HIGH`: Q5_K, its qh bytes before `qs`): quants from
    /// 8-byte zero-extending loads, a mask or shift per 8, the fifth bit added per lane.
    ///
    /// # Safety
    /// As `BlockFormat::factors_avx2`.
    #[inline(always)]
    pub(super) unsafe fn k4_factors<S: Sink, const HIGH: bool>(b: &[u8], at: usize, sink: &mut S) {
        let (a, m) = k4_scales(b);
        let (p, mask, one) = (b.as_ptr(), _mm256_set1_epi32(0x0F), _mm256_set1_epi32(1));
        let load = |o: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i));
        let qh: [__m256i; 4] = std::array::from_fn(|c| if HIGH { load(16 + 8 * c) } else { one });
        let qs = if HIGH { 48 } else { 16 };
        for g in 0..4 {
            // Bytes 8c..8c+8 of the group: elements 64g + 8c.. (low nibbles) and
            // 64g + 32 + 8c.. (high nibbles).
            let v: [__m256i; 4] = std::array::from_fn(|c| load(qs + 32 * g + 8 * c));
            // The nibble, plus 16 where bit `bit` of the lane's qh byte is set.
            let quant = |n: __m256i, h: __m256i, bit: i32| {
                let n = if HIGH {
                    let h = _mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(bit)), one);
                    _mm256_add_epi32(n, _mm256_slli_epi32(h, 4))
                } else {
                    n
                };
                _mm256_cvtepi32_ps(n)
            };
            let lo = std::array::from_fn(|c| quant(_mm256_and_si256(v[c], mask), qh[c], 2 * g as i32));
            let hi = std::array::from_fn(|c| quant(_mm256_srli_epi32(v[c], 4), qh[c], 2 * g as i32 + 1));
            sink.group::<4, true>(lo, a[2 * g], m[2 * g], at + 64 * g);
            sink.group::<4, true>(hi, a[2 * g + 1], m[2 * g + 1], at + 64 * g + 32);
        }
    }

    /// `dot_blocks` on AVX2: each block's weights formed in registers and multiplied in.
    ///
    /// # Safety
    /// AVX2 and FMA are present; every vector holds `bytes.len() / F::BYTES * F::ELEMS`
    /// values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_blocks<F: BlockFormat, const N: usize>(
        bytes: &[u8],
        xs: [&[f32]; N],
    ) -> [f32; N] {
        let mut dot = Dot::new(xs);
        for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
            F::factors_avx2(b, k * F::ELEMS, &mut dot);
        }
        dot.finish()
    }

    /// `decode_blocks` on AVX2: ggml's weights formed and stored.
    ///
    /// # Safety
    /// AVX2 and FMA are present; `out` holds `bytes.len() / F::BYTES * F::ELEMS` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn decode_blocks<F: BlockFormat>(bytes: &[u8], out: &mut [f32]) {
        let mut store = Weights::<false>(out.as_mut_ptr());
        for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
            F::factors_avx2(b, k * F::ELEMS, &mut store);
        }
    }

    /// `fuse_blocks` on AVX2: the fused weights formed and stored.
    ///
    /// # Safety
    /// AVX2 and FMA are present; `out` holds `bytes.len() / F::BYTES * F::ELEMS` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fuse_blocks<F: BlockFormat>(bytes: &[u8], out: &mut [f32]) {
        let mut store = Weights::<true>(out.as_mut_ptr());
        for (k, b) in bytes.chunks_exact(F::BYTES).enumerate() {
            F::factors_avx2(b, k * F::ELEMS, &mut store);
        }
    }

    /// f16 rows, 16 values per step through F16C (the 16-lane order of the plain types),
    /// then the tail in order.
    ///
    /// # Safety
    /// AVX2 and F16C are present; `bytes` holds `x.len()` f16 values.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot_f16(bytes: &[u8], x: &[f32]) -> f32 {
        let n = x.len() / LANES * LANES;
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (p, xp) = (bytes.as_ptr(), x.as_ptr());
        let mut i = 0;
        while i < n {
            let w0 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i));
            let w1 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i + 16) as *const __m128i));
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, _mm256_loadu_ps(xp.add(i))));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, _mm256_loadu_ps(xp.add(i + 8))));
            i += LANES;
        }
        let mut lanes = [0.0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), a0);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a1);
        let mut s = combine(&lanes);
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

    /// The dot product of the dequantised row, in f64, and the sum of its terms' magnitudes.
    fn reference(w: &[f32], x: &[f32]) -> (f64, f64) {
        w.iter()
            .zip(x)
            .fold((0.0, 0.0), |(s, a), (&w, &x)| (s + w as f64 * x as f64, a + (w as f64 * x as f64).abs()))
    }

    /// Plain rows: bitwise `dot_f32` of the widened row. Block formats: `fused`'s order,
    /// the same bits on every instruction set; without mins bitwise `fused::dots` of the
    /// dequantised row, with mins (Q4_K, Q5_K) within f32 rounding of its exact dot product.
    #[test]
    fn fused_dot_is_the_dequantized_rows_on_every_isa() {
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
                    let got = dot_row(ty, &row, &x).unwrap();
                    assert_eq!(
                        portable_dot(ty, &row, &x).to_bits(),
                        got.to_bits(),
                        "{ty} portable cols {cols}"
                    );
                    if be == 1 {
                        assert_eq!(got.to_bits(), dot_f32(&w, &x).to_bits(), "{ty} cols {cols}");
                    } else if !matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
                        // Without mins the fused weight is ggml's dequantised one.
                        assert_eq!(got.to_bits(), fused::dots(&w, [&x])[0].to_bits(), "{ty} cols {cols}");
                    } else {
                        let (want, scale) = reference(&w, &x);
                        let err = (got as f64 - want).abs();
                        assert!(
                            err <= 4e-7 * scale.max(1e-30),
                            "{ty} cols {cols}: {got} vs {want} (scale {scale})"
                        );
                    }
                }
            }
        }
    }

    /// Rows' weights formed once for many tokens give the in-register products' bits, and
    /// either instruction set forms the same weights.
    #[test]
    fn fused_rows_are_bitwise_the_row_dots() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for ty in TYPES.into_iter().filter(|t| t.block_elems() > 1) {
            let (rows, cols) = (5, 3 * ty.block_elems());
            let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, ty, cols)).collect();
            let m = QuantMatrix::new(ty, &data, rows, cols).unwrap();
            let xs: Vec<Vec<f32>> = (0..4).map(|_| rand_vec(&mut rng, cols)).collect();
            let group = [&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]];
            let (mut w, mut portable) = (Fused::new(), Fused::new());
            assert!(m.fuse_rows(1..rows, &mut w));
            assert!(m.kernel.fuse_rows(Isa::Portable, &data[m.row_bytes..], &mut portable));
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w), bits(&portable), "{ty}");
            for r in 1..rows {
                let row = &w[(r - 1) * cols..r * cols];
                let want = m.row_dots(r, group).map(f32::to_bits);
                assert_eq!(fused::dots(row, group).map(f32::to_bits), want, "{ty} row {r}");
                assert_eq!(fused::dots(row, [group[2]])[0].to_bits(), want[2], "{ty} row {r}");
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
            }
        }
    }

    /// The AVX2 decoder (the factor routines storing their weights) gives the scalar
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
    /// reproduced bit for bit; the fused dot product on the same rows is its dot product
    /// up to f32 rounding.
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
            let (got, (want, scale)) = (dot_row(ty, &blocks, &x).unwrap(), reference(&out, &x));
            assert!((got as f64 - want).abs() <= 4e-7 * scale.max(1e-30), "{ty}: {got} vs {want}");
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
