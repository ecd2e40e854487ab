//! The one summation order of every CPU product on a ggml block format (m=1, several
//! vectors at once, or rows decoded once for many tokens), on every instruction set.
//!
//! A block format stores each group of 16 or 32 elements as small integer quants `q`
//! with a scale `a` and, for Q4_K/Q5_K, a min `b`. A product forms each weight with one
//! rounding and multiplies it in with a fused multiply-add:
//!
//! - the weight: `fma(a, q, −b)` where the group has a min, `a·q` otherwise (which is
//!   ggml's own dequantised weight; with a min ggml rounds twice, `a·q − b`, so a fused
//!   weight can differ from it in the last bit);
//! - element `i` of the row goes to lane `i % 16`: `acc = fma(w, x, acc)`;
//! - the lanes are combined in the fixed tree of the plain types (`quant::combine`).
//!
//! `accumulate` and `dots` are that order in plain Rust (`f32::mul_add` is a fused
//! multiply-add on every target), `avx2::Dot` the same operations eight lanes wide on
//! weights formed in registers, so all give the same bits; [`Fused`] holds rows' weights
//! formed once for many tokens.

use super::quant::{combine, LANES};

/// Forms a weight as every product does: `fma(a, q, −b)` with a min, `a·q` without.
#[inline(always)]
pub(super) fn weight(a: f32, q: f32, b: f32, mins: bool) -> f32 {
    if mins {
        a.mul_add(q, -b)
    } else {
        a * q
    }
}

/// Multiplies fused weights `w` into lanes `acc` (`w` and `x` start at a lane-chunk
/// boundary of the row and are whole chunks): the plain-Rust order.
#[inline(always)]
pub(super) fn accumulate(acc: &mut [f32; LANES], w: &[f32], x: &[f32]) {
    for (wc, xc) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = wc[l].mul_add(xc[l], acc[l]);
        }
    }
}

/// The dot products of fused weights `w` (a whole number of 16-lane chunks) with `N`
/// vectors, in the order above: each bitwise the in-register product of the stored row.
pub fn dots<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
    assert!(
        w.len().is_multiple_of(LANES) && xs.iter().all(|x| x.len() == w.len()),
        "fused rows are whole lane chunks, as long as the vectors"
    );
    #[cfg(target_arch = "x86_64")]
    if avx2::present() {
        // SAFETY: AVX2 and FMA are present; every vector holds `w.len()` values.
        return unsafe { avx2::fused_dots(w, xs) };
    }
    xs.map(|x| {
        let mut acc = [0.0f32; LANES];
        accumulate(&mut acc, w, x);
        combine(&acc)
    })
}

/// Rows of a block-format matrix with their weights formed once (f32, `rows × cols`),
/// for products with many tokens through [`dots`].
pub type Fused = Vec<f32>;

/// The AVX2 + FMA paths: sixteen lanes as two vectors, the same operations as [`dots`].
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::quant::{combine, LANES};

    /// Whether the running CPU has AVX2, FMA and F16C (checks cached by std).
    #[inline(always)]
    pub(crate) fn present() -> bool {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }

    /// Where a block's groups go, in element order: each as `C` vectors of quants (exact
    /// f32), its scale `a` and min `b` (zero without mins).
    pub(crate) trait Sink {
        /// Whether the sink takes the products' weights ([`super::weight`]); otherwise
        /// ggml's dequantised `a·q − b` (two roundings, in that order; `b` is zero without
        /// mins, which leaves `a·q`).
        const FUSED: bool;

        /// Takes the weights of elements `at..at + 8·C` of the row (`at` a multiple of 16).
        ///
        /// # Safety
        /// AVX2 and FMA are present and the sink's memory holds element `at + 8·C − 1`.
        unsafe fn take<const C: usize>(&mut self, w: [__m256; C], at: usize);

        /// Takes a group: its weights formed from quants `q`, scale `a` and min `b`.
        ///
        /// # Safety
        /// As [`Sink::take`].
        #[inline(always)]
        unsafe fn group<const C: usize, const MINS: bool>(
            &mut self,
            q: [__m256; C],
            a: f32,
            b: f32,
            at: usize,
        ) {
            let w = if Self::FUSED {
                weights::<C, MINS>(q, a, b)
            } else {
                let (a, b) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
                q.map(|q| _mm256_sub_ps(_mm256_mul_ps(a, q), b))
            };
            self.take(w, at);
        }
    }

    /// A group's weights, formed as [`super::weight`] does.
    #[inline(always)]
    unsafe fn weights<const C: usize, const MINS: bool>(q: [__m256; C], a: f32, b: f32) -> [__m256; C] {
        let a = _mm256_set1_ps(a);
        if MINS {
            let nb = _mm256_set1_ps(-b);
            q.map(|q| _mm256_fmadd_ps(a, q, nb))
        } else {
            q.map(|q| _mm256_mul_ps(a, q))
        }
    }

    /// `N` vectors and their 16-lane accumulators (lanes 0..8 and 8..16).
    pub(crate) struct Dot<const N: usize> {
        xs: [*const f32; N],
        acc: [[__m256; 2]; N],
    }

    impl<const N: usize> Dot<N> {
        /// Zero accumulators for `xs`.
        #[inline(always)]
        pub(crate) unsafe fn new(xs: [&[f32]; N]) -> Self {
            Dot { xs: xs.map(|x| x.as_ptr()), acc: [[_mm256_setzero_ps(); 2]; N] }
        }

        /// Adds fused weights `w` (16 of them, lanes 0..8 and 8..16) at element `at`.
        #[inline(always)]
        unsafe fn add(&mut self, w: [__m256; 2], at: usize) {
            for (acc, x) in self.acc.iter_mut().zip(self.xs) {
                acc[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x.add(at)), acc[0]);
                acc[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x.add(at + 8)), acc[1]);
            }
        }

        /// Each vector's result.
        #[inline(always)]
        pub(crate) unsafe fn finish(&self) -> [f32; N] {
            self.acc.map(|a| sum(a))
        }
    }

    impl<const N: usize> Sink for Dot<N> {
        const FUSED: bool = true;

        #[inline(always)]
        unsafe fn take<const C: usize>(&mut self, w: [__m256; C], at: usize) {
            for h in 0..C / 2 {
                self.add([w[2 * h], w[2 * h + 1]], at + 16 * h);
            }
        }
    }

    /// Weights written to a row of f32: with `FUSED` the products' (a [`super::Fused`]
    /// row), without it ggml's dequantised ones.
    pub(crate) struct Weights<const FUSED: bool>(pub(crate) *mut f32);

    impl<const FUSED: bool> Sink for Weights<FUSED> {
        const FUSED: bool = FUSED;

        #[inline(always)]
        unsafe fn take<const C: usize>(&mut self, w: [__m256; C], at: usize) {
            for (c, w) in w.into_iter().enumerate() {
                _mm256_storeu_ps(self.0.add(at + 8 * c), w);
            }
        }
    }

    /// [`super::dots`] on AVX2 (its own loop: through [`Dot`] the compiler kept the
    /// four vectors' accumulators in memory, 1.2x slower at 16 tokens).
    ///
    /// # Safety
    /// AVX2 and FMA are present; `w` is whole lane chunks and every vector holds
    /// `w.len()` values.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn fused_dots<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let (wp, n) = (w.as_ptr(), w.len());
        let mut i = 0;
        while i < n {
            let (w0, w1) = (_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(wp.add(i + 8)));
            for (a, x) in acc.iter_mut().zip(&xs) {
                a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x.as_ptr().add(i)), a[0]);
                a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.as_ptr().add(i + 8)), a[1]);
            }
            i += LANES;
        }
        acc.map(|a| sum(a))
    }

    /// A 16-lane accumulator (lanes 0..8 and 8..16) combined in the fixed tree.
    #[inline(always)]
    pub(crate) unsafe fn sum(a: [__m256; 2]) -> f32 {
        let mut lanes = [0.0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a[1]);
        combine(&lanes)
    }
}
