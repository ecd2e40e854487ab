//! CPU reference kernels. Every batched kernel is a sibling of its m=1 kernel: it calls
//! the same per-row function, so a row's result never depends on how many rows were
//! computed together, on the thread count, or on the order rows were scheduled.
//!
//! Dot products use a fixed 16-lane accumulation (element `i` goes to lane `i % 16`,
//! lanes are combined in a fixed tree, the tail is added last in order); parallel work
//! only ever splits output rows, never one reduction.

use rayon::prelude::*;
use smoe_proto::DType;

use super::fused::{self, Fused};
use super::quant::QuantMatrix;
use crate::tensor::{bf16_to_f32, WeightData, WeightView};

const LANES: usize = 16;
/// Matrices with fewer multiply-adds than this are computed on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;

#[inline(always)]
fn combine(acc: [f32; LANES]) -> f32 {
    let mut a = acc;
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            a[i] += a[i + width];
        }
        width /= 2;
    }
    a[0]
}

/// Whether the running CPU has AVX2 (checked once, cached by the standard library).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
}

/// Dot product of an f32 row with `x`, in the fixed lane order. On CPUs with AVX2 the
/// same code is compiled 8 lanes wide; the per-lane arithmetic and the combination
/// order are unchanged (Rust never contracts to FMA), so results are bitwise equal.
#[inline]
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 is present.
        return unsafe { dot_f32_avx2(w, x) };
    }
    dot_f32_lanes(w, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_f32_avx2(w: &[f32], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = w.len() / LANES * LANES;
    // Lanes 0..8 and 8..16 of the 16-lane accumulator, multiply then add (no FMA).
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i < n {
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(xp.add(i))));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(wp.add(i + 8)), _mm256_loadu_ps(xp.add(i + 8))));
        i += LANES;
    }
    finish_avx2(a0, a1, w[n..].iter().zip(&x[n..]).map(|(a, b)| a * b))
}

/// Combines the two 8-lane halves in the fixed tree of [`combine`], then adds the
/// tail products in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn finish_avx2(
    a0: std::arch::x86_64::__m256,
    a1: std::arch::x86_64::__m256,
    tail: impl Iterator<Item = f32>,
) -> f32 {
    let mut acc = [0.0f32; LANES];
    std::arch::x86_64::_mm256_storeu_ps(acc.as_mut_ptr(), a0);
    std::arch::x86_64::_mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
    let mut s = combine(acc);
    for p in tail {
        s += p;
    }
    s
}

/// Dot product of a bf16 row with `x`, widening each weight exactly to f32 first; the
/// same lane order as [`dot_f32`].
#[inline]
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 is present.
        return unsafe { dot_bf16_avx2(w, x) };
    }
    dot_bf16_lanes(w, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_bf16_avx2(w: &[u16], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = w.len() / LANES * LANES;
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i < n {
        // Widen 16 bf16 weights exactly: zero-extend to 32 bits, shift into the high half.
        let wv = _mm256_loadu_si256(wp.add(i) as *const __m256i);
        let lo =
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(wv)), 16));
        let hi = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm256_extracti128_si256(wv, 1)),
            16,
        ));
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(lo, _mm256_loadu_ps(xp.add(i))));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(hi, _mm256_loadu_ps(xp.add(i + 8))));
        i += LANES;
    }
    finish_avx2(a0, a1, w[n..].iter().zip(&x[n..]).map(|(a, b)| bf16_to_f32(*a) * b))
}

#[inline(always)]
fn dot_f32_lanes(w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0.0f32; LANES];
    let wc = w.chunks_exact(LANES);
    let xc = x.chunks_exact(LANES);
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (wb, xb) in wc.zip(xc) {
        for i in 0..LANES {
            acc[i] += wb[i] * xb[i];
        }
    }
    let mut s = combine(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += a * b;
    }
    s
}

#[inline(always)]
fn dot_bf16_lanes(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0.0f32; LANES];
    let wc = w.chunks_exact(LANES);
    let xc = x.chunks_exact(LANES);
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (wb, xb) in wc.zip(xc) {
        for i in 0..LANES {
            acc[i] += bf16_to_f32(wb[i]) * xb[i];
        }
    }
    let mut s = combine(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += bf16_to_f32(*a) * b;
    }
    s
}

/// The matrix behind a view of a block format (or f16), for the kernels of
/// [`super::quant`].
///
/// # Panics
/// If the view's bytes are not its rows (views made by `WeightView::from_bytes` are).
#[inline]
fn quant<'a>(w: &WeightView<'a>, dtype: DType, bytes: &'a [u8]) -> QuantMatrix<'a> {
    QuantMatrix::new(dtype.ggml(), bytes, w.rows, w.cols)
        .unwrap_or_else(|e| panic!("an inconsistent weight view: {e}"))
}

/// `W[r] · x` for one row. A block-format row is decoded in registers by
/// [`QuantMatrix::row_dot`] (the order of [`super::fused`]).
#[inline]
pub fn row_dot(w: &WeightView<'_>, r: usize, x: &[f32]) -> f32 {
    let c = w.cols;
    match w.data {
        WeightData::F32(d) => dot_f32(&d[r * c..(r + 1) * c], x),
        WeightData::Bf16(d) => dot_bf16(&d[r * c..(r + 1) * c], x),
        WeightData::Quant { dtype, bytes } => quant(w, dtype, bytes).row_dot(r, x),
    }
}

/// [`dot_f32`] of `w` with four vectors at once, each bitwise the single dot product.
#[inline]
pub(super) fn dot_f32_x4(w: &[f32], xs: [&[f32]; 4]) -> [f32; 4] {
    assert!(xs.iter().all(|x| x.len() == w.len()), "four vectors of the row's length");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 is present; every vector has `w.len()` elements.
        return unsafe {
            dot4_avx2(w, xs, |p, i| {
                let v = std::arch::x86_64::_mm256_loadu_ps(p.add(i));
                (v, std::arch::x86_64::_mm256_loadu_ps(p.add(i + 8)))
            })
        };
    }
    xs.map(|x| dot_f32(w, x))
}

/// `W[r] · x` for four vectors at once, each bitwise equal to [`row_dot`] (a block-format
/// row is decoded once for the four).
#[inline]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn row_dot4(w: &WeightView<'_>, r: usize, xs: [&[f32]; 4]) -> [f32; 4] {
    let row = r * w.cols..(r + 1) * w.cols;
    match w.data {
        WeightData::Quant { dtype, bytes } => quant(w, dtype, bytes).row_dots(r, xs),
        WeightData::F32(d) => dot_f32_x4(&d[row], xs),
        // SAFETY: AVX2 is present; every vector has `cols` elements.
        #[cfg(target_arch = "x86_64")]
        WeightData::Bf16(d) if has_avx2() => unsafe { dot4_avx2(&d[row], xs, |p, i| widen16_avx2(p.add(i))) },
        _ => xs.map(|x| row_dot(w, r, x)),
    }
}

/// Row `r` of `w` as f32 into `out` (`cols` values; embedding lookups): widened exactly,
/// or dequantised bitwise as ggml does.
///
/// # Panics
/// If `r` is not a row or `out` does not have `cols` elements (tokens are checked
/// against the vocabulary before they are embedded).
pub fn row_to_f32(w: &WeightView<'_>, r: usize, out: &mut [f32]) {
    if let WeightData::Quant { dtype, bytes } = w.data {
        quant(w, dtype, bytes).dequantize_row(r, out).unwrap_or_else(|e| panic!("embedding row {r}: {e}"));
    } else {
        let widened = w.widen_row(r, out);
        debug_assert!(widened, "f32 and bf16 rows are widened");
    }
}

/// Widens 16 bf16 values at `p` to two vectors of 8 f32 (exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen16_avx2(p: *const u16) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
    use std::arch::x86_64::*;
    let wv = _mm256_loadu_si256(p as *const __m256i);
    let lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(wv)), 16));
    let hi =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(wv, 1)), 16));
    (lo, hi)
}

/// Four dot products of one weight row (elements of type `E`, loaded 16 at a time as
/// f32 by `load`) with four vectors, each in the exact lane order of the m=1 kernels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot4_avx2<E: Copy + Into<Widen>>(
    w: &[E],
    xs: [&[f32]; 4],
    load: impl Fn(*const E, usize) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256),
) -> [f32; 4] {
    use std::arch::x86_64::*;
    let n = w.len() / LANES * LANES;
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let wp = w.as_ptr();
    let mut i = 0;
    while i < n {
        let (lo, hi) = load(wp, i);
        for (a, x) in acc.iter_mut().zip(&xs) {
            a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(lo, _mm256_loadu_ps(x.as_ptr().add(i))));
            a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(hi, _mm256_loadu_ps(x.as_ptr().add(i + 8))));
        }
        i += LANES;
    }
    let mut out = combine4_avx2(acc);
    for (o, x) in out.iter_mut().zip(xs) {
        for (e, b) in w[n..].iter().zip(&x[n..]) {
            *o += (*e).into().0 * b;
        }
    }
    out
}

/// Four 16-lane accumulators (lanes 0..8 and 8..16 each) combined in [`combine`]'s tree,
/// `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))` of `lᵢ = lane i + lane i+8`, the four side by
/// side after a 4 × 4 transpose: each bitwise [`combine`] of its lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn combine4_avx2(acc: [[std::arch::x86_64::__m256; 2]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    // lᵢ, then lᵢ + lᵢ₊₄ (the 8-wide halves added).
    let b = acc.map(|a| {
        let s = _mm256_add_ps(a[0], a[1]);
        _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1))
    });
    // Transpose: t[i] holds element i of the four b.
    let (x0, x1) = (_mm_unpacklo_ps(b[0], b[1]), _mm_unpackhi_ps(b[0], b[1]));
    let (x2, x3) = (_mm_unpacklo_ps(b[2], b[3]), _mm_unpackhi_ps(b[2], b[3]));
    let t = [_mm_movelh_ps(x0, x2), _mm_movehl_ps(x2, x0), _mm_movelh_ps(x1, x3), _mm_movehl_ps(x3, x1)];
    let mut out = [0.0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), _mm_add_ps(_mm_add_ps(t[0], t[2]), _mm_add_ps(t[1], t[3])));
    out
}

/// An element widened exactly to f32 (for the tails of the vector kernels).
#[cfg(target_arch = "x86_64")]
struct Widen(f32);

#[cfg(target_arch = "x86_64")]
impl From<f32> for Widen {
    fn from(v: f32) -> Self {
        Widen(v)
    }
}

#[cfg(target_arch = "x86_64")]
impl From<u16> for Widen {
    fn from(b: u16) -> Self {
        Widen(bf16_to_f32(b))
    }
}

/// m=1 matvec: `out[r] = W[r] · x`.
pub fn matvec(w: &WeightView<'_>, x: &[f32], out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.cols);
    debug_assert_eq!(out.len(), w.rows);
    if w.rows * w.cols < PAR_THRESHOLD {
        for (r, o) in out.iter_mut().enumerate() {
            *o = row_dot(w, r, x);
        }
    } else {
        let block = row_block(w);
        out.par_chunks_mut(block).enumerate().for_each(|(b, chunk)| {
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = row_dot(w, b * block + i, x);
            }
        });
    }
}

fn row_block(w: &WeightView<'_>) -> usize {
    (PAR_THRESHOLD / w.cols.max(1)).clamp(1, 256)
}

/// Tokens from which [`matmul`] decodes a block-format matrix's rows once for all of them
/// (below it, each group of four decodes them in registers again).
const DECODE_ONCE: usize = 8;

thread_local! {
    /// A rayon worker's block of rows' fused weights ([`matmul`] with [`DECODE_ONCE`]
    /// tokens).
    static DECODED: std::cell::RefCell<Fused> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Batched sibling of [`matvec`]: `out[t][r] = W[r] · xs[t]` for `m` rows of `xs`
/// (`xs` is `m × cols`, `out` is `m × rows`). Each element is computed by the same
/// [`row_dot`] as the m=1 kernel; blocks of weight rows are reused across tokens. A
/// block-format matrix (not f16: F16C widens it as it goes) with `DECODE_ONCE` tokens
/// or more has each block of rows' weights formed once ([`QuantMatrix::fuse_rows`]) and
/// multiplied by [`fused::dots`], the very accumulation of the in-register product, so
/// the bytes are those of [`row_dot`]; with AVX2 four tokens at a time go over a block's
/// fused rows a chunk of columns at a time (`super::panels`), the same operations in the
/// same order.
pub fn matmul(w: &WeightView<'_>, xs: &[f32], m: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(xs.len(), m * cols);
    debug_assert_eq!(out.len(), m * rows);
    if m == 1 {
        return matvec(w, xs, out);
    }
    let block = row_block(w);
    let nblocks = rows.div_ceil(block);
    // Each block of weight rows is one task; it writes a disjoint column strip of `out`.
    let out = Strip { ptr: SyncPtr(out.as_mut_ptr()), rows };
    // The block-format matrix whose rows are decoded once for all the tokens, if any.
    let decode_once = match w.data {
        WeightData::Quant { dtype, bytes } if dtype.is_block() && m >= DECODE_ONCE => {
            Some(quant(w, dtype, bytes))
        }
        _ => None,
    };
    let xs = &xs[..m * cols];
    #[cfg(target_arch = "x86_64")]
    let panels =
        (decode_once.is_some() && fused::avx2::present()).then(|| super::panels::Panels::new(xs, m, cols));
    let work = |b: usize| {
        let (r0, r1) = (b * block, ((b + 1) * block).min(rows));
        if let Some(q) = &decode_once {
            DECODED.with_borrow_mut(|w| {
                assert!(q.fuse_rows(r0..r1, w), "a block format fuses its rows");
                let row = |r: usize| &w[(r - r0) * cols..(r - r0 + 1) * cols];
                let dot = |r: usize, x: &[f32]| {
                    let [v] = fused::dots(row(r), [x]);
                    v
                };
                #[cfg(target_arch = "x86_64")]
                if let Some(p) = &panels {
                    // SAFETY: `Panels` are made only where AVX2 and FMA are present.
                    let four = |t: usize, _: [&[f32]; 4], put: &mut dyn FnMut(usize, [f32; 4])| unsafe {
                        super::panels::fused_rows4(w, r1 - r0, p, t, |r, v| put(r0 + r, v))
                    };
                    return out.rows_times(r0..r1, xs, cols, four, dot);
                }
                let four = |_: usize, x: [&[f32]; 4], put: &mut dyn FnMut(usize, [f32; 4])| {
                    (r0..r1).for_each(|r| put(r, fused::dots(row(r), x)))
                };
                out.rows_times(r0..r1, xs, cols, four, dot);
            });
            return;
        }
        let four = |_: usize, x: [&[f32]; 4], put: &mut dyn FnMut(usize, [f32; 4])| {
            (r0..r1).for_each(|r| put(r, row_dot4(w, r, x)))
        };
        out.rows_times(r0..r1, xs, cols, four, |r, x| row_dot(w, r, x));
    };
    if rows * cols * m < PAR_THRESHOLD {
        (0..nblocks).for_each(work);
    } else {
        (0..nblocks).into_par_iter().for_each(work);
    }
}

/// [`matmul`]'s output (`m × rows`), written by tasks that own disjoint row ranges.
#[derive(Clone, Copy)]
struct Strip {
    ptr: SyncPtr,
    rows: usize,
}

impl Strip {
    /// Rows `rs` times each of the vectors of `xs` (`cols` elements each), by `four`
    /// (tokens `t..t + 4` given, with the rows of `xs`, every row of `rs` `put` once) and
    /// `dot` (one row, one vector), into output columns `rs`, which the calling task owns
    /// (no other task writes them meanwhile).
    fn rows_times(
        self,
        rs: std::ops::Range<usize>,
        xs: &[f32],
        cols: usize,
        four: impl Fn(usize, [&[f32]; 4], &mut dyn FnMut(usize, [f32; 4])),
        dot: impl Fn(usize, &[f32]) -> f32,
    ) {
        let m = xs.len().checked_div(cols).unwrap_or(0);
        assert!(xs.len() == m * cols && rs.end <= self.rows, "a strip out of bounds");
        let put = |t: usize, r: usize, v: f32| {
            assert!(rs.contains(&r), "row {r} outside the task's rows {rs:?}");
            // SAFETY: `t < m` and `r < rows`, and (t, r) pairs are disjoint across tasks
            // since their row ranges are.
            unsafe { *self.ptr.get().add(t * self.rows + r) = v };
        };
        // Four tokens share each pass over a weight row (one load and widening of the
        // weights feeds four dot products); each dot product is still the m=1 one.
        let mut t = 0;
        while t + 4 <= m {
            let x = |i: usize| &xs[(t + i) * cols..(t + i + 1) * cols];
            four(t, [x(0), x(1), x(2), x(3)], &mut |r, v| {
                for (i, v) in v.into_iter().enumerate() {
                    put(t + i, r, v);
                }
            });
            t += 4;
        }
        for t in t..m {
            let x = &xs[t * cols..(t + 1) * cols];
            for r in rs.clone() {
                put(t, r, dot(r, x));
            }
        }
    }
}

/// A raw pointer that may be shared across rayon tasks writing disjoint elements.
#[derive(Clone, Copy)]
pub(super) struct SyncPtr(pub(super) *mut f32);
// SAFETY: used only for writes to disjoint indices, joined before the borrow ends.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    /// The pointer (a method, so closures capture the whole `SyncPtr`).
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// RMSNorm of one row: `out[i] = w[i] * (x[i] / sqrt(mean(x²) + eps))`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = dot_f32(x, x) / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * r);
    }
}

/// In-place RMSNorm of one row.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = dot_f32(x, x) / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = wi * (*xi * r);
    }
}

/// SiLU activation `x · σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// In-place numerically stable softmax.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn batched_matmul_is_byte_identical_to_matvec() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for &(rows, cols, m) in
            &[(1, 1, 1), (3, 17, 5), (33, 31, 7), (257, 129, 3), (600, 333, 13), (1031, 65, 2)]
        {
            let wf = rand_vec(&mut rng, rows * cols);
            let wb: Vec<u16> = wf.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let xs = rand_vec(&mut rng, m * cols);
            for data in [WeightData::F32(&wf), WeightData::Bf16(&wb)] {
                let w = WeightView { data, rows, cols };
                let mut batched = vec![0.0; m * rows];
                matmul(&w, &xs, m, &mut batched);
                for t in 0..m {
                    let mut single = vec![0.0; rows];
                    matvec(&w, &xs[t * cols..(t + 1) * cols], &mut single);
                    let a: &[u32] = bytemuck::cast_slice(&single);
                    let b: &[u32] = bytemuck::cast_slice(&batched[t * rows..(t + 1) * rows]);
                    assert_eq!(a, b, "rows {rows} cols {cols} m {m} token {t}");
                }
            }
        }
    }

    #[test]
    fn quantised_batched_matmul_is_byte_identical_to_matvec_and_close_to_the_dequantised_matrix() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for dtype in DType::ALL.into_iter().filter(|d| !matches!(d, DType::F32 | DType::Bf16)) {
            // Shapes on both sides of the parallel threshold, m around the 4-token groups
            // and on both sides of DECODE_ONCE (a last block of rows shorter than the rest).
            for &(rows, cols, m) in &[
                (3, 256, 5),
                (33, 512, 7),
                (257, 256, 3),
                (129, 768, 13),
                (40, 1024, 1),
                (70, 512, 8),
                (300, 256, 16),
                // Three column chunks of a K-blocked product (the last one partial).
                (20, 1280, 9),
            ] {
                let wf = rand_vec(&mut rng, rows * cols);
                let mut bytes = Vec::new();
                super::super::quantize::encode_rows(&wf, cols, dtype, &mut bytes).unwrap();
                let w = WeightView::from_bytes(dtype, &bytes, rows, cols);
                let mut deq = vec![0.0; rows * cols];
                for r in 0..rows {
                    row_to_f32(&w, r, &mut deq[r * cols..(r + 1) * cols]);
                }
                let plain = WeightView { data: WeightData::F32(&deq), rows, cols };
                let xs = rand_vec(&mut rng, m * cols);
                let mut batched = vec![0.0; m * rows];
                matmul(&w, &xs, m, &mut batched);
                let mut reference = vec![0.0; m * rows];
                matmul(&plain, &xs, m, &mut reference);
                for t in 0..m {
                    let mut single = vec![0.0; rows];
                    matvec(&w, &xs[t * cols..(t + 1) * cols], &mut single);
                    let a: &[u32] = bytemuck::cast_slice(&single);
                    let b: &[u32] = bytemuck::cast_slice(&batched[t * rows..(t + 1) * rows]);
                    assert_eq!(a, b, "{dtype} rows {rows} cols {cols} m {m} token {t}: batched vs m=1");
                    // f16 is a plain type (bitwise); a block format forms each weight with
                    // one rounding and multiplies it in by an fma (`cpu::fused`).
                    for (r, (&s, &f)) in single.iter().zip(&reference[t * rows..(t + 1) * rows]).enumerate() {
                        let ok = if dtype == DType::F16 {
                            s.to_bits() == f.to_bits()
                        } else {
                            (s - f).abs() <= 1e-5 * f.abs().max(1.0)
                        };
                        assert!(
                            ok,
                            "{dtype} rows {rows} cols {cols} m {m} token {t} row {r}: {s} vs dequantised {f}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn vector_width_does_not_change_dot_products() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for n in [1, 7, 16, 33, 511, 2048, 3001] {
            let a = rand_vec(&mut rng, n);
            let b = rand_vec(&mut rng, n);
            let ab: Vec<u16> = a.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            assert_eq!(dot_f32(&a, &b).to_bits(), dot_f32_lanes(&a, &b).to_bits(), "n={n}");
            assert_eq!(dot_bf16(&ab, &b).to_bits(), dot_bf16_lanes(&ab, &b).to_bits(), "n={n}");
        }
    }

    #[test]
    fn dot_matches_f64_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for n in [0, 1, 15, 16, 17, 100, 1000] {
            let a = rand_vec(&mut rng, n);
            let b = rand_vec(&mut rng, n);
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_f32(&a, &b) as f64 - exact).abs() < 1e-4, "n={n}");
        }
    }
}
