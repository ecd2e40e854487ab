//! The arithmetic behind the `trained` routing profile's parameters: the attention
//! window RoPE can make from a constant query and key, the routing statistics of
//! correlated Gaussian gate logits, and the solve from target statistics to the
//! profile's context gain and share of self-routing tokens.
//!
//! The model these numbers describe (see [`super::trained`]): a token's router input is
//! `x = f_t + γ·c_t` (its own random part plus the gain times a causal, windowed average
//! of the previous tokens' parts), and a fraction of the vocabulary adds a strong
//! token-specific part on top. Adjacent router inputs of two ordinary tokens then
//! correlate by `ρ(γ)`, which is known from the window's weights; with random router rows
//! the gate logits of the two tokens are Gaussian vectors with that correlation, whose
//! top-k overlap and top-2k coverage are tabulated by Monte Carlo.

use std::ops::Range;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Largest context gain: beyond it the context dwarfs everything else in the residual
/// stream for no gain in correlation.
const MAX_GAIN: f64 = 200.0;

/// Largest softmax sharpness the window may use: beyond it the score differences of
/// neighbouring positions approach f32 rounding of the attention dot products.
const MAX_SHARPNESS: f64 = 200.0;

/// A causal attention window made from RoPE alone: queries and keys that are the same
/// constant vector, with their energy spread evenly over the pairs `band`, score
/// position `t − Δ` at `sharpness · mean_{i∈band} cos(Δ·θ_i)`.
pub struct Window {
    /// RoPE pairs (indices into the first half of a head) the queries and keys use.
    pub band: Range<usize>,
    /// Softmax sharpness: the score of the current position.
    pub sharpness: f64,
    /// Steady-state weights of position `t − Δ` for `Δ = 0..horizon`, summing to 1.
    pub weights: Vec<f64>,
    /// Effective number of positions averaged, `(Σw)² / Σw²`.
    pub n_eff: f64,
    /// Weight on positions more than four effective lengths back.
    pub far_mass: f64,
}

/// The RoPE frequencies of a head, as the engine computes them (in f64 here).
fn inv_freq(head_dim: usize, rope_theta: f64) -> Vec<f64> {
    (0..head_dim / 2).map(|i| 1.0 / rope_theta.powf((2 * i) as f64 / head_dim as f64)).collect()
}

/// Softmax weights `exp(s·(K(Δ) − 1))` of the kernel `kernel`, normalised.
fn softmax_weights(kernel: &[f64], s: f64) -> Vec<f64> {
    let w: Vec<f64> = kernel.iter().map(|k| (s * (k - 1.0)).exp()).collect();
    let sum: f64 = w.iter().sum();
    w.into_iter().map(|v| v / sum).collect()
}

fn n_eff(w: &[f64]) -> f64 {
    1.0 / w.iter().map(|v| v * v).sum::<f64>()
}

/// The window of about `target` effective positions with the least weight far back, over
/// a context of `horizon` positions.
pub fn design_window(head_dim: usize, rope_theta: f64, target: f64, horizon: usize) -> Result<Window> {
    let inv = inv_freq(head_dim, rope_theta);
    // Pairs whose period exceeds the horizon add a constant to every score: useless.
    let end = inv.iter().position(|&t| t * (horizon as f64) < 1.0).unwrap_or(inv.len());
    let mut best: Option<Window> = None;
    for start in 0..end {
        let band = start..end;
        let kernel: Vec<f64> = (0..horizon)
            .map(|d| band.clone().map(|i| (d as f64 * inv[i]).cos()).sum::<f64>() / band.len() as f64)
            .collect();
        // n_eff falls as the sharpness grows: bisect in log space.
        let (mut lo, mut hi) = (1e-3f64, MAX_SHARPNESS);
        if n_eff(&softmax_weights(&kernel, hi)) > target || n_eff(&softmax_weights(&kernel, lo)) < target {
            continue;
        }
        for _ in 0..60 {
            let mid = (lo * hi).sqrt();
            if n_eff(&softmax_weights(&kernel, mid)) > target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let weights = softmax_weights(&kernel, hi);
        let far = (4.0 * target) as usize;
        let far_mass = weights.iter().skip(far).sum::<f64>();
        if best.as_ref().is_none_or(|b| far_mass < b.far_mass) {
            best = Some(Window { band, sharpness: hi, n_eff: n_eff(&weights), weights, far_mass });
        }
    }
    match best {
        Some(w) => Ok(w),
        None => bail!(
            "head_dim {head_dim} with rope_theta {rope_theta} gives no RoPE window of about {target} positions; \
             the trained routing profile needs one"
        ),
    }
}

/// Top-k overlap and top-2k coverage of two Gaussian logit vectors with correlation ρ,
/// tabulated at `ρ = i / (len − 1)`.
pub struct Curves {
    overlap: Vec<f64>,
    coverage: Vec<f64>,
}

/// Points of the ρ grid.
const GRID: usize = 51;
/// Monte Carlo samples per point (the same samples at every ρ, so the curves are smooth).
const SAMPLES: usize = 2000;

/// Indices of the `n` largest values of `v` (in any order), in `out`.
fn top_n(v: &[f64], n: usize, idx: &mut Vec<usize>, out: &mut Vec<bool>) {
    idx.clear();
    idx.extend(0..v.len());
    idx.select_nth_unstable_by(n - 1, |&a, &b| v[b].total_cmp(&v[a]));
    out.clear();
    out.resize(v.len(), false);
    idx[..n].iter().for_each(|&i| out[i] = true);
}

/// A standard normal value (Box–Muller).
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u: f64 = 1.0 - rng.random::<f64>();
    let v: f64 = rng.random();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

impl Curves {
    /// The curves for `experts` experts and top-`k` routing (coverage by the top `2k`).
    pub fn new(experts: usize, k: usize) -> Self {
        let wide = (2 * k).min(experts);
        let mut rng = ChaCha8Rng::seed_from_u64(0xc0ffee);
        let (mut overlap, mut coverage) = (vec![0.0; GRID], vec![0.0; GRID]);
        let (mut a, mut b) = (vec![0.0; experts], vec![0.0; experts]);
        let mut noise = vec![0.0; experts];
        let (mut idx, mut top_a, mut wide_a, mut top_b) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..SAMPLES {
            a.iter_mut().for_each(|x| *x = normal(&mut rng));
            noise.iter_mut().for_each(|x| *x = normal(&mut rng));
            top_n(&a, k, &mut idx, &mut top_a);
            top_n(&a, wide, &mut idx, &mut wide_a);
            for i in 0..GRID {
                let rho = i as f64 / (GRID - 1) as f64;
                let c = (1.0 - rho * rho).sqrt();
                b.iter_mut().zip(a.iter().zip(&noise)).for_each(|(y, (x, n))| *y = rho * x + c * n);
                top_n(&b, k, &mut idx, &mut top_b);
                let both = |s: &[bool]| s.iter().zip(&top_b).filter(|(x, y)| **x && **y).count() as f64;
                overlap[i] += both(&top_a) / (k * SAMPLES) as f64;
                coverage[i] += both(&wide_a) / (k * SAMPLES) as f64;
            }
        }
        Curves { overlap, coverage }
    }

    fn at(table: &[f64], rho: f64) -> f64 {
        let x = rho.clamp(0.0, 1.0) * (GRID - 1) as f64;
        let i = (x.floor() as usize).min(GRID - 2);
        let f = x - i as f64;
        table[i] * (1.0 - f) + table[i + 1] * f
    }
}

/// The correlation of adjacent ordinary tokens' router inputs for context gain `gamma`:
/// `x_t = Σ_j α_j f_{t−j}` with `α_0 = 1 + γ·w_0`, `α_j = γ·w_j`.
pub fn adjacent_correlation(weights: &[f64], gamma: f64) -> f64 {
    let alpha = |j: usize| gamma * weights[j] + if j == 0 { 1.0 } else { 0.0 };
    let num: f64 = (0..weights.len() - 1).map(|j| alpha(j) * alpha(j + 1)).sum();
    num / input_variance(weights, gamma)
}

/// The variance of an ordinary token's router input per unit variance of its own part.
pub fn input_variance(weights: &[f64], gamma: f64) -> f64 {
    (0..weights.len()).map(|j| (gamma * weights[j] + if j == 0 { 1.0 } else { 0.0 }).powi(2)).sum()
}

/// The profile's parameters for a pair of target statistics.
#[derive(Clone, Copy, Debug)]
pub struct Solution {
    /// Fraction of the vocabulary whose tokens route by their own strong part.
    pub strong_frac: f64,
    /// Correlation of adjacent ordinary tokens' router inputs.
    pub rho: f64,
    /// Context gain γ.
    pub gamma: f64,
    /// Predicted adjacent top-k overlap.
    pub overlap: f64,
    /// Predicted top-2k coverage of the next token's top-k.
    pub coverage: f64,
}

/// Chooses the strong-token fraction and the context gain whose predicted overlap and
/// coverage come closest to the targets. A strong token's router input has `1 + gain²`
/// times an ordinary token's variance, so its correlation with a neighbour is diluted
/// by `1/√(1 + gain²)` (and by `1/(1 + gain²)` between two strong tokens).
pub fn solve(curves: &Curves, window: &Window, overlap: f64, coverage: f64, strong_gain: f64) -> Solution {
    let (c1, c2) = (1.0 / (1.0 + strong_gain * strong_gain).sqrt(), 1.0 / (1.0 + strong_gain * strong_gain));
    let mix = |table: &[f64], rho: f64, q: f64| {
        (1.0 - q).powi(2) * Curves::at(table, rho)
            + 2.0 * q * (1.0 - q) * Curves::at(table, rho * c1)
            + q * q * Curves::at(table, rho * c2)
    };
    let w = &window.weights;
    let rho_max = adjacent_correlation(w, MAX_GAIN);
    let mut best: Option<(f64, Solution)> = None;
    for i in 0..=60 {
        let q = i as f64 / 100.0;
        let (mut lo, mut hi) = (0.0, rho_max);
        for _ in 0..50 {
            let mid = 0.5 * (lo + hi);
            if mix(&curves.overlap, mid, q) < overlap {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let rho = 0.5 * (lo + hi);
        let s = Solution {
            strong_frac: q,
            rho,
            gamma: 0.0,
            overlap: mix(&curves.overlap, rho, q),
            coverage: mix(&curves.coverage, rho, q),
        };
        let err = (s.overlap - overlap).abs() + (s.coverage - coverage).abs();
        if best.as_ref().is_none_or(|(e, _)| err < *e) {
            best = Some((err, s));
        }
    }
    let (_, mut s) = best.expect("the grid is not empty");
    let (mut lo, mut hi) = (0.0f64, MAX_GAIN);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if adjacent_correlation(w, mid) < s.rho {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    s.gamma = 0.5 * (lo + hi);
    s
}

/// Makes the `n × d` row-major vectors in `rows` a centred, isotropic set of unit
/// vectors (a tight frame: `Σ v vᵀ = n/d · I`, `Σ v = 0`), by alternately centring,
/// whitening (through the Cholesky factor of their second moment) and normalising.
/// Sums of such vectors over a context window then point every way alike, so a
/// finite vocabulary does not favour the experts of its mean or its main axes.
pub fn tight_frame(rows: &mut [f64], d: usize) {
    let n = rows.len() / d;
    if n < d {
        return normalise_rows(rows, d);
    }
    for _ in 0..4 {
        let mut mean = vec![0.0; d];
        rows.chunks_exact(d).for_each(|r| mean.iter_mut().zip(r).for_each(|(m, x)| *m += x / n as f64));
        rows.chunks_exact_mut(d).for_each(|r| r.iter_mut().zip(&mean).for_each(|(x, m)| *x -= m));
        let mut c = vec![0.0; d * d];
        for r in rows.chunks_exact(d) {
            for i in 0..d {
                for j in 0..=i {
                    c[i * d + j] += r[i] * r[j] / n as f64;
                }
            }
        }
        // c = L·Lᵀ (lower triangle); then each row v becomes L⁻¹·v.
        for j in 0..d {
            let s = c[j * d + j] - (0..j).map(|k| c[j * d + k].powi(2)).sum::<f64>();
            c[j * d + j] = s.max(1e-300).sqrt();
            for i in j + 1..d {
                let s = c[i * d + j] - (0..j).map(|k| c[i * d + k] * c[j * d + k]).sum::<f64>();
                c[i * d + j] = s / c[j * d + j];
            }
        }
        for r in rows.chunks_exact_mut(d) {
            for i in 0..d {
                let s = r[i] - (0..i).map(|k| c[i * d + k] * r[k]).sum::<f64>();
                r[i] = s / c[i * d + i];
            }
        }
        normalise_rows(rows, d);
    }
}

fn normalise_rows(rows: &mut [f64], d: usize) {
    for r in rows.chunks_exact_mut(d) {
        let n = r.iter().map(|x| x * x).sum::<f64>().sqrt();
        if n > 0.0 {
            r.iter_mut().for_each(|x| *x /= n);
        }
    }
}
