//! Quantisation of f32 rows into ggml block formats, for vaults made from a bf16/f32
//! checkpoint: Q8_0, Q4_0 (as gguf-py's `gguf.quants.quantize`, byte for byte) and Q4_K,
//! Q5_K, Q6_K (llama.cpp's reference `quantize_row_*_ref`: `make_qkx2_quants` for Q4_K
//! and Q5_K, `make_qx_quants` for Q6_K — what `llama-quantize` does without an
//! importance matrix).
//!
//! The arithmetic is the C reference's without FMA contraction, operation for operation
//! (`nearest_int` is ggml's round-half-to-even bit trick); a llama.cpp binary built
//! with FMA may pick a different quant where two choices tie within an ulp. Q4_0 rounds
//! as gguf-py does, emulating the FMA rounding of its reference (`x·id + 8.5` evaluated
//! in f64, then rounded to f32 and truncated).

use half::f16;
use rayon::prelude::*;
use smoe_proto::ggml::{GgmlType, QK_K};
use smoe_proto::DType;

use super::quant::{scale_min_k4, QuantError};

/// Below this a group is all zeros (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Appends the blocks of `row` quantised to `ty` (Q8_0, Q4_0, Q4_K, Q5_K or Q6_K) to
/// `out`. `row.len()` must be a whole number of blocks.
pub fn quantize_row(ty: GgmlType, row: &[f32], out: &mut Vec<u8>) -> Result<(), QuantError> {
    let block: fn(&[f32], &mut Vec<u8>) = match ty {
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        _ => return Err(QuantError::Unsupported { ty }),
    };
    if ty.row_bytes(row.len()).is_none() {
        return Err(QuantError::Blocks { ty, cols: row.len() });
    }
    for b in row.chunks_exact(ty.block_elems()) {
        block(b, out);
    }
    Ok(())
}

/// Appends `vals` — whole rows of `cols` values — stored as `to`: f32 as is, bf16 and
/// f16 rounded to nearest even, a block format quantised row by row with
/// [`quantize_row`] (what the vault writer stores and the benchmarks measure), rows on
/// every core.
pub fn encode_rows(vals: &[f32], cols: usize, to: DType, out: &mut Vec<u8>) -> Result<(), QuantError> {
    match to {
        DType::F32 => vals.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::Bf16 => {
            vals.iter().for_each(|v| out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes()))
        }
        DType::F16 => vals.iter().for_each(|v| push_f16(out, *v)),
        _ => {
            // Rows are independent: quantised in parallel, each into its own place, so the
            // bytes are those of a row-by-row pass.
            let (ty, cols) = (to.ggml(), cols.max(1));
            let row_bytes = ty.row_bytes(cols).ok_or(QuantError::Blocks { ty, cols })?;
            if !vals.len().is_multiple_of(cols) {
                return Err(QuantError::Blocks { ty, cols: vals.len() % cols });
            }
            let start = out.len();
            out.resize(start + vals.len() / cols * row_bytes, 0);
            out[start..].par_chunks_mut(row_bytes).zip(vals.par_chunks(cols)).try_for_each_init(
                || Vec::with_capacity(row_bytes),
                |buf, (dst, row)| {
                    buf.clear();
                    quantize_row(ty, row, buf)?;
                    dst.copy_from_slice(buf);
                    Ok(())
                },
            )?;
        }
    }
    Ok(())
}

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The f16 rounding of `v`, back in f32 (a stored scale as the decoder sees it).
fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// `1/d`, or 0 for a zero scale.
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Q8_0: `d = max|x| / 127`, `q = round(x / d)` (half away from zero).
fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    push_f16(out, d);
    out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
}

/// Q4_0: `d = max / −8` for the value of largest magnitude (first one on ties),
/// `q = min(15, trunc(x·id + 8.5))`.
fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = inverse(d);
    push_f16(out, d);
    let q = |v: f32| ((((v as f64) * (id as f64) + 8.5) as f32).trunc() as u8).min(15);
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

/// ggml's `nearest_int`: round half to even through the f32 mantissa (exact for
/// |v| < 2²², which the callers guarantee for finite input).
fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// ggml's `make_qkx2_quants`: the scale and (negated) min of `x` quantised to
/// `0..=nmax` minimising the `weights`-weighted squared error over a grid of trial
/// scales; the quants go to `l`.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = if x[i] < min { x[i] } else { min };
        max = if x[i] > max { x[i] } else { max };
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        l[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights: the scale of
/// `x` quantised symmetrically to `−nmax..nmax` (stored as `l + nmax` in `l`), searched
/// over 19 trial scales for the least `x²`-weighted error.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let clampq = |v: f32| nearest_int(v).clamp(-nmax, nmax - 1);
    // Σ w·x·q and Σ w·q² with w = x², for the quants of `iscale`.
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = clampq(iscale * v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (li, &v) in l.iter_mut().zip(x) {
        *li = (clampq(iscale * v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (li, &v) in l.iter_mut().zip(x) {
                *li = (clampq(iscale * v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// The shared part of Q4_K and Q5_K: per 32-element sub-block a scale and min from
/// `make_qkx2_quants`, both quantised to 6 bits against the block's largest; then every
/// element requantised against the stored (f16-rounded) scales into `l` (`0..=nmax`).
/// Appends `d`, `dmin` and the 12 packed scale bytes.
fn k4_scales(x: &[f32], nmax: i32, rmin: f32, nstep: i32, l: &mut [u8; QK_K], out: &mut Vec<u8>) {
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    let mut weights = [0.0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(nmax, xs, &weights, &mut l[32 * j..32 * j + 32], rmin, 0.1, nstep);
        (scales[j], mins[j]) = (s, m);
        max_scale = if s > max_scale { s } else { max_scale };
        max_min = if m > max_min { m } else { max_min };
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (max_scale / 63.0, max_min / 63.0);
    push_f16(out, d);
    push_f16(out, dmin);
    out.extend_from_slice(&packed);
    let (d, dmin) = (f16_round(d), f16_round(dmin));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let d = d * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

/// Q4_K: `k4_scales` with 4-bit quants; group `g` stores elements `64g..64g+32` in the
/// low nibbles of `qs[32g..32g+32]` and `64g+32..64g+64` in the high nibbles.
fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; QK_K];
    k4_scales(x, 15, -1.0, 20, &mut l, out);
    for g in l.chunks_exact(64) {
        out.extend((0..32).map(|i| g[i] | (g[i + 32] << 4)));
    }
}

/// Q5_K: `k4_scales` with 5-bit quants: the low 4 bits as in Q4_K, bit 4 of element
/// `64g + i` (`64g + 32 + i`) in bit `2g` (`2g + 1`) of `qh[i]`.
fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; QK_K];
    k4_scales(x, 31, -0.5, 15, &mut l, out);
    let mut qh = [0u8; 32];
    for (g, lg) in l.chunks_exact(64).enumerate() {
        for i in 0..32 {
            qh[i] |= ((lg[i] >> 4) << (2 * g)) | ((lg[i + 32] >> 4) << (2 * g + 1));
        }
    }
    out.extend_from_slice(&qh);
    for g in l.chunks_exact(64) {
        out.extend((0..32).map(|i| (g[i] & 0x0F) | ((g[i + 32] & 0x0F) << 4)));
    }
}

/// Q6_K: 16 sub-blocks of 16 with `make_qx_quants` scales, quantised to i8 against the
/// largest; elements requantised to `−32..32` against the stored scales and packed as
/// `ql` (low nibbles), `qh` (2 high bits), then the scales and `d`.
fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = s;
        }
    }
    if max_abs < GROUP_MAX_EPS {
        out.extend_from_slice(&[0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16_round(1.0 / iscale);
    let sc: [i8; 16] = scales.map(|s| nearest_int(iscale * s).min(127) as i8);
    for (j, &s) in sc.iter().enumerate() {
        let dj = d * s as f32;
        if dj == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / dj).clamp(-32, 31) + 32) as i8;
        }
    }
    let l = l.map(|v| v as u8);
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for (n, half) in l.chunks_exact(128).enumerate() {
        for i in 0..32 {
            let q = [half[i], half[i + 32], half[i + 64], half[i + 96]];
            ql[64 * n + i] = (q[0] & 0x0F) | ((q[2] & 0x0F) << 4);
            ql[64 * n + i + 32] = (q[1] & 0x0F) | ((q[3] & 0x0F) << 4);
            qh[32 * n + i] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.map(|s| s as u8));
    push_f16(out, 1.0 / iscale);
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::quant::dequantize_row;
    use super::*;

    const TYPES: [GgmlType; 5] =
        [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

    #[test]
    fn rows_quantised_in_parallel_are_the_row_by_row_bytes() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (rows, cols) = (37, 512);
        let vals: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        for ty in TYPES {
            let dtype = DType::from_ggml(ty).unwrap();
            let mut serial = Vec::new();
            for row in vals.chunks(cols) {
                quantize_row(ty, row, &mut serial).unwrap();
            }
            let mut parallel = vec![7u8; 3];
            encode_rows(&vals, cols, dtype, &mut parallel).unwrap();
            assert_eq!(&parallel[..3], &[7, 7, 7], "{ty}: bytes before are kept");
            assert!(parallel[3..] == serial[..], "{ty}");
            let err = encode_rows(&vals[..cols + 256], cols, dtype, &mut parallel).unwrap_err();
            assert!(matches!(err, QuantError::Blocks { cols: 256, .. }), "{ty}: a partial row: {err}");
        }
    }

    /// The K-quant bytes of fixed rows (smooth, spiky, constant-signed and tiny values),
    /// as FNV-1a hashes of the reference search (`bench/results/quant-rmse-2026-11-30.txt`:
    /// the same RMSE as llama-quantize on every tensor): a faster search must give the
    /// same bytes.
    #[test]
    fn k_quant_bytes_match_the_reference_search() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let cols = 512;
        let mut vals: Vec<f32> = (0..48 * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for (i, v) in vals.iter_mut().enumerate() {
            match (i / cols) % 4 {
                1 => *v *= if i % 97 == 0 { 40.0 } else { 1.0 },
                2 => *v = v.abs() + 0.5,
                3 => *v *= 1e-3,
                _ => {}
            }
        }
        let fnv = |b: &[u8]| {
            b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
        };
        for (ty, want) in
            [(GgmlType::Q4K, 2_213_894_497_304_557_125u64), (GgmlType::Q5K, 8_546_285_991_056_747_518u64)]
        {
            let mut out = Vec::new();
            for row in vals.chunks(cols) {
                quantize_row(ty, row, &mut out).unwrap();
            }
            assert_eq!(fnv(&out), want, "{ty}: bytes differ from the reference search's");
        }
    }

    fn fixture(name: &str) -> Vec<u8> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant_blocks");
        std::fs::read(dir.join(name)).unwrap()
    }

    /// gguf-py's quantisation of the fixture rows, byte for byte.
    #[test]
    fn q8_0_and_q4_0_match_gguf_py() {
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let input: Vec<f32> = fixture(&format!("{}.quant_in", ty.name()))
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let mut out = Vec::new();
            quantize_row(ty, &input, &mut out).unwrap();
            let want = fixture(&format!("{}.quant", ty.name()));
            let first = out.iter().zip(&want).position(|(a, b)| a != b);
            assert_eq!((out.len(), first), (want.len(), None), "{ty}: byte {first:?} differs from gguf-py");
        }
    }

    /// Quantise, dequantise: the error stays within what each format can hold, relative
    /// to the block's range, and shrinks with more bits.
    #[test]
    fn round_trip_error_is_bounded() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let n = 4 * QK_K;
        // (type, bound on RMS error / RMS value) for normal data.
        for (ty, bound) in [
            // Measured: 0.0052-0.0057, 0.017-0.021, 0.036, 0.071, 0.085-0.089.
            (GgmlType::Q8_0, 0.008),
            (GgmlType::Q6K, 0.025),
            (GgmlType::Q5K, 0.045),
            (GgmlType::Q4K, 0.085),
            (GgmlType::Q4_0, 0.1),
        ] {
            for scale in [1e-3f32, 1.0, 300.0] {
                let x: Vec<f32> = (0..n)
                    .map(|_| {
                        let (a, b): (f32, f32) = (rng.random(), rng.random());
                        scale * (-2.0 * a.max(1e-12).ln()).sqrt() * (std::f32::consts::TAU * b).cos()
                    })
                    .collect();
                let mut q = Vec::new();
                quantize_row(ty, &x, &mut q).unwrap();
                assert_eq!(Some(q.len()), ty.row_bytes(n));
                let mut y = vec![0.0; n];
                dequantize_row(ty, &q, &mut y).unwrap();
                let err = x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
                let norm = x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
                let rel = (err / norm).sqrt();
                assert!(rel < bound, "{ty} scale {scale}: relative RMS error {rel}");
            }
        }
    }

    #[test]
    fn zeros_and_constants_round_trip_exactly_where_the_format_can() {
        for ty in TYPES {
            let n = ty.block_elems();
            for x in [vec![0.0f32; n], vec![-0.5f32; n]] {
                let mut q = Vec::new();
                quantize_row(ty, &x, &mut q).unwrap();
                let mut y = vec![1.0; n];
                dequantize_row(ty, &q, &mut y).unwrap();
                for (a, b) in x.iter().zip(&y) {
                    assert!((a - b).abs() <= 1e-3, "{ty}: {a} came back as {b}");
                }
            }
        }
    }

    #[test]
    fn rejects_other_types_and_partial_blocks() {
        let mut out = Vec::new();
        assert_eq!(
            quantize_row(GgmlType::Q3K, &[0.0; 256], &mut out),
            Err(QuantError::Unsupported { ty: GgmlType::Q3K })
        );
        assert!(matches!(quantize_row(GgmlType::Q4K, &[0.0; 255], &mut out), Err(QuantError::Blocks { .. })));
        assert!(out.is_empty());
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (v, want) in [(0.5f32, 0), (1.5, 2), (2.5, 2), (-0.5, 0), (-1.5, -2), (3.49, 3), (-7.51, -8)] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }
}
