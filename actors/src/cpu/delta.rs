//! CPU kernels of the hybrid family's DeltaNet layers, one row (token) at a time: a
//! block of rows calls them row by row in order, so every row gets the bytes the
//! single-token step gives it. Work is split only across independent value heads.

use rayon::prelude::*;

use super::kernels::{dot_f32, rmsnorm_inplace, silu};

/// Recurrent-state floats below which a row's heads run on the calling thread.
const PAR_STATE: usize = 1 << 16;

/// `σ(x) = 1 / (1 + e^−x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `softplus(x) = ln(1 + eˣ)`, and `x` itself above 20 (torch's threshold).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One step of the causal depthwise convolution and SiLU over one row's `x` (the
/// channels, replaced by the output), with `taps` `[channel][kernel]` and the conv state
/// `[kernel − 1][channel]` (oldest input first), which rolls by this row's input.
pub fn conv1d_step(x: &mut [f32], taps: &[f32], state: &mut [f32], kernel: usize) {
    let c = x.len();
    let hist = kernel - 1;
    for (ch, xv) in x.iter_mut().enumerate() {
        let w = &taps[ch * kernel..(ch + 1) * kernel];
        let mut acc = 0.0f32;
        for j in 0..hist {
            acc += w[j] * state[j * c + ch];
        }
        acc += w[hist] * *xv;
        for j in 1..hist {
            state[(j - 1) * c + ch] = state[j * c + ch];
        }
        if hist > 0 {
            state[(hist - 1) * c + ch] = *xv;
        }
        *xv = silu(acc);
    }
}

/// `x · 1/√(Σx² + 1e-6)` in place, then times `scale` (the L2 norm of the FLA library
/// that transformers follows).
pub fn l2norm_inplace(x: &mut [f32], scale: f32) {
    let inv = 1.0 / (dot_f32(x, x) + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v = *v * inv * scale;
    }
}

/// The shape of one DeltaNet layer's delta rule.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of the key heads; value head `h` reads key head
    /// `h / (v_heads / k_heads)`).
    pub v_heads: usize,
    /// Width of a query/key head.
    pub k_dim: usize,
    /// Width of a value head.
    pub v_dim: usize,
}

/// The per-row inputs of one value head.
pub struct HeadInput<'a> {
    /// L2-normed, scaled query of the head's key head.
    pub q: &'a [f32],
    /// L2-normed key of the head's key head.
    pub k: &'a [f32],
    /// The head's value.
    pub v: &'a [f32],
    /// `β = σ(b)`.
    pub beta: f32,
    /// `exp(g)`, the state's decay.
    pub decay: f32,
}

/// One value head's step of the gated delta rule on its state `s` (`[k_dim][v_dim]`):
/// decay, read `Sᵀk` (`mem`), write `k ⊗ β(v − Sᵀk)`, read `Sᵀq` into `out`; sums run over
/// the key dim in order (transformers' `torch_recurrent_gated_delta_rule`).
pub fn delta_head(s: &mut [f32], x: &HeadInput<'_>, mem: &mut [f32], out: &mut [f32]) {
    let dv = out.len();
    mem.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(x.k) {
        for (sv, m) in row.iter_mut().zip(mem.iter_mut()) {
            *sv *= x.decay;
            *m += *sv * ki;
        }
    }
    for (m, &vv) in mem.iter_mut().zip(x.v) {
        *m = (vv - *m) * x.beta;
    }
    out.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(x.k).zip(x.q) {
        for ((sv, &d), o) in row.iter_mut().zip(mem.iter()).zip(out.iter_mut()) {
            *sv += ki * d;
            *o += *sv * qi;
        }
    }
}

/// One row's inputs to the gated delta rule of a layer.
pub struct DeltaRow<'a> {
    /// The row's normalised queries then keys, `[2][k_heads][k_dim]`.
    pub qk: &'a [f32],
    /// The row's values, `[v_heads][v_dim]`.
    pub v: &'a [f32],
    /// The row's β inputs per value head.
    pub b: &'a [f32],
    /// The row's decay inputs per value head.
    pub a: &'a [f32],
    /// The layer's log decay rates per value head.
    pub a_log: &'a [f32],
    /// The layer's time-step biases per value head.
    pub dt_bias: &'a [f32],
}

/// One row of the gated delta rule over every value head: `state` is
/// `[v_head][k_dim][v_dim]`, `mem` scratch of `v_heads · v_dim`; the output goes to `out`
/// (`[v_head][v_dim]`).
pub fn delta_row(sh: DeltaShape, x: &DeltaRow<'_>, state: &mut [f32], mem: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (sh.k_dim, sh.v_dim);
    let group = sh.v_heads / sh.k_heads;
    let kd = sh.k_heads * dk;
    let head = |h: usize, s: &mut [f32], m: &mut [f32], o: &mut [f32]| {
        let kh = h / group;
        let g = -x.a_log[h].exp() * softplus(x.a[h] + x.dt_bias[h]);
        let input = HeadInput {
            q: &x.qk[kh * dk..(kh + 1) * dk],
            k: &x.qk[kd + kh * dk..kd + (kh + 1) * dk],
            v: &x.v[h * dv..(h + 1) * dv],
            beta: sigmoid(x.b[h]),
            decay: g.exp(),
        };
        delta_head(s, &input, m, o);
    };
    if state.len() < PAR_STATE {
        let heads =
            state.chunks_exact_mut(dk * dv).zip(mem.chunks_exact_mut(dv)).zip(out.chunks_exact_mut(dv));
        heads.enumerate().for_each(|(h, ((s, m), o))| head(h, s, m, o));
    } else {
        let heads = state
            .par_chunks_exact_mut(dk * dv)
            .zip(mem.par_chunks_exact_mut(dv))
            .zip(out.par_chunks_exact_mut(dv));
        heads.enumerate().for_each(|(h, ((s, m), o))| head(h, s, m, o));
    }
}

/// The gated RMSNorm of one row: each head of `x` (heads of `w.len()`) RMS-normed with
/// weight `w`, then times `silu(z)`.
pub fn gated_rmsnorm_row(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    for (head, zh) in x.chunks_exact_mut(w.len()).zip(z.chunks_exact(w.len())) {
        rmsnorm_inplace(head, w, eps);
        for (v, &zv) in head.iter_mut().zip(zh) {
            *v *= silu(zv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_state_rolls_the_last_inputs() {
        // One channel, kernel 3: out = w0·x[t−2] + w1·x[t−1] + w2·x[t], then SiLU.
        let taps = [0.5, -1.0, 2.0];
        let mut state = [0.0; 2];
        let mut outs = Vec::new();
        for x in [1.0f32, 2.0, 3.0] {
            let mut v = [x];
            conv1d_step(&mut v, &taps, &mut state, 3);
            outs.push(v[0]);
        }
        let want = [silu(2.0), silu(-1.0 + 4.0), silu(0.5 - 2.0 + 6.0)];
        assert_eq!(outs, want);
        assert_eq!(state, [2.0, 3.0]);
    }

    #[test]
    fn delta_rule_matches_the_definition() {
        // k = e0, β = 1, no decay: the state learns v at row 0, and reading with q = e0
        // returns v.
        let mut s = vec![0.0; 2 * 2];
        let (mut mem, mut out) = (vec![0.0; 2], vec![0.0; 2]);
        let x = HeadInput { q: &[1.0, 0.0], k: &[1.0, 0.0], v: &[3.0, -4.0], beta: 1.0, decay: 1.0 };
        delta_head(&mut s, &x, &mut mem, &mut out);
        assert_eq!(out, [3.0, -4.0]);
        assert_eq!(s, [3.0, -4.0, 0.0, 0.0]);
        // Writing the same pair again changes nothing (the delta is zero).
        delta_head(&mut s, &x, &mut mem, &mut out);
        assert_eq!(s, [3.0, -4.0, 0.0, 0.0]);
    }
}
