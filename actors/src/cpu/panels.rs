//! Token-batched products on fused block-format rows taken a chunk of columns at a time
//! (K-blocked), so that the tokens' inputs stay in L1 while a block of rows streams past.
//!
//! A batched product runs four tokens per pass over a weight row (each weight load feeds
//! four dot products). Over whole rows, the four input rows (4 × `cols` f32, 32 KiB at
//! 2048 columns) do not fit beside the row in a 32 KiB L1, and inputs `cols × 4` bytes
//! apart share L1 sets, so every pass reloaded them from L2. Here the inputs are copied
//! once per product into [`Panels`] (chunk `c` of every token side by side), and the four
//! dot products of every row of a block are taken chunk by chunk, the sixteen-lane
//! accumulators kept between chunks. A lane still receives the same `fma`s in the same
//! order as in [`super::fused::dots`], so every result has its bytes.
//!
//! Only the fused rows of the block formats (rows decoded once for many tokens) use it:
//! on bf16 rows, whose passes are bound by widening the weights, it measured level end to
//! end (`bench/results/cpu-panels-2026-12-05.txt`).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::quant::LANES;

/// Columns per chunk: four tokens' chunk is 8 KiB.
const KC: usize = 512;

/// The inputs of a batched product laid out for it: chunk `c` (columns `c·KC..`) of token
/// `t` at `(c·m + t)·KC`.
pub(super) struct Panels {
    data: Vec<f32>,
    m: usize,
    cols: usize,
}

impl Panels {
    /// `xs` (`m` rows of `cols`) in chunks.
    pub(super) fn new(xs: &[f32], m: usize, cols: usize) -> Self {
        assert_eq!(xs.len(), m * cols, "m rows of cols inputs");
        let chunks = cols.div_ceil(KC);
        let mut data = vec![0.0; chunks * m * KC];
        for c in 0..chunks {
            let part = c * KC..((c + 1) * KC).min(cols);
            for t in 0..m {
                let at = (c * m + t) * KC;
                data[at..at + part.len()].copy_from_slice(&xs[t * cols..][part.clone()]);
            }
        }
        Panels { data, m, cols }
    }
}

thread_local! {
    /// A rayon worker's accumulators: four tokens' sixteen lanes (as lanes 0..8 and 8..16)
    /// for each row of its block.
    static ACC: RefCell<Vec<[[__m256; 2]; 4]>> = const { RefCell::new(Vec::new()) };
}

/// The dot products of `rows` fused rows (`w`, `cols` each) with tokens `t..t + 4` of
/// `panels`, each `put(row, [four results])` as [`super::fused::dots`] gives it.
///
/// # Safety
/// AVX2 and FMA are present.
///
/// # Panics
/// If `w` does not hold `rows` rows of the panels' columns, the columns are not whole
/// lane chunks, or `t + 4` exceeds the panels' tokens.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fused_rows4(
    w: &[f32],
    rows: usize,
    panels: &Panels,
    t: usize,
    mut put: impl FnMut(usize, [f32; 4]),
) {
    let cols = panels.cols;
    assert!(
        w.len() >= rows * cols && cols.is_multiple_of(LANES) && t + 4 <= panels.m,
        "{rows} fused rows of {cols} columns, tokens {t}..{} of {}",
        t + 4,
        panels.m
    );
    // Taken out of the thread-local for the loop (a closure's code would not be compiled
    // with this function's target features).
    let mut acc = ACC.take();
    acc.clear();
    acc.resize(rows, [[_mm256_setzero_ps(); 2]; 4]);
    let mut c0 = 0;
    while c0 < cols {
        let kc = KC.min(cols - c0);
        let xp = panels.data.as_ptr().add((c0 / KC * panels.m + t) * KC);
        for (r, a) in acc.iter_mut().enumerate() {
            let wp = w.as_ptr().add(r * cols + c0);
            let mut lanes = *a;
            let mut i = 0;
            while i < kc {
                let (w0, w1) = (_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(wp.add(i + 8)));
                for (v, l) in lanes.iter_mut().enumerate() {
                    let x = xp.add(v * KC + i);
                    l[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), l[0]);
                    l[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), l[1]);
                }
                i += LANES;
            }
            *a = lanes;
        }
        c0 += kc;
    }
    for (r, a) in acc.iter().enumerate() {
        put(r, a.map(|a| super::fused::avx2::sum(a)));
    }
    ACC.set(acc);
}
