//! Causal softmax attention of a block of query tokens against the KV cache, with every
//! key and value row read once for several queries.
//!
//! For query `q` at position `p` the result is, in this order: `s_j = dot_f32(q, k_j) ·
//! scale` for `j ≤ p`, the softmax of `s` ([`softmax_inplace`]), then `o = Σ_j s_j · v_j`
//! summed in `j` order from zero, each element multiplied then added. A query's result
//! does not depend on which other queries share its pass, so a token attends alike in a
//! prefill block and in token-serial decode.
//!
//! A 2048-token CPU prefill spent about half its time here. A task takes up to [`TOKENS`]
//! consecutive tokens and the query heads of one key/value head (all of them, unless that
//! leaves threads idle, as in decode), and walks the keys in chunks of [`KEYS`] rows, so
//! each key and value row is read once per task; four keys' scores are formed at once
//! ([`dot_f32_x4`]), and a chunk of value rows is weighed into 64 outputs held in
//! registers. Blocking alone measured level; the vector loops gave the
//! gain (`bench/results/cpu-attention-2026-12-05.txt`).

use rayon::prelude::*;

use super::kernels::{dot_f32, dot_f32_x4, softmax_inplace, SyncPtr};

/// Query tokens a task takes.
const TOKENS: usize = 4;
/// Key (or value) rows a chunk holds for all the task's queries.
const KEYS: usize = 32;

/// The attention geometry of a layer.
pub(super) struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (each serving `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

thread_local! {
    /// A rayon worker's scores: one row per query of its task, as long as the keys.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Attention of `rows` query tokens at positions `start..start + rows` (`q`: `rows ×
/// heads·head_dim`) against keys and values `k`, `v` (`position × kv_heads·head_dim`,
/// holding at least `start + rows` positions) into `out` (like `q`).
pub(super) fn causal(h: &Heads, q: &[f32], k: &[f32], v: &[f32], start: usize, rows: usize, out: &mut [f32]) {
    let (hd, group) = (h.head_dim, h.heads / h.kv_heads);
    let (qd, kvd) = (h.heads * hd, h.kv_heads * hd);
    assert!(
        q.len() >= rows * qd
            && out.len() >= rows * qd
            && k.len() >= (start + rows) * kvd
            && v.len() >= (start + rows) * kvd
    );
    let scale = 1.0 / (hd as f32).sqrt();
    let blocks = rows.div_ceil(TOKENS);
    // A task takes all heads of a group, unless that would leave threads idle (decode: one
    // block of one token): then the fewest parts of a group that occupy every thread.
    let threads = rayon::current_num_threads();
    let parts = (1..=group).find(|d| group % d == 0 && blocks * h.kv_heads * d >= threads).unwrap_or(group);
    let per = group / parts;
    let out = SyncPtr(out.as_mut_ptr());
    let task = |i: usize| {
        let (b, g, part) = (i / (h.kv_heads * parts), i / parts % h.kv_heads, i % parts);
        let tokens = b * TOKENS..((b + 1) * TOKENS).min(rows);
        // The task's queries, token-major: (token t, head g·group + part·per + e).
        let first = g * group + part * per;
        let queries: Vec<(usize, usize)> =
            tokens.clone().flat_map(|t| (0..per).map(move |e| (t, first + e))).collect();
        let keys = |t: usize| start + t + 1;
        let n = keys(tokens.end - 1);
        SCORES.with_borrow_mut(|sc| {
            sc.clear();
            sc.resize(queries.len() * n, 0.0);
            // Every query's keys in chunks of KEYS, a chunk for all queries before the next.
            let chunks = |f: &mut dyn FnMut(usize, usize, usize, std::ops::Range<usize>)| {
                for j0 in (0..n).step_by(KEYS) {
                    for (r, &(t, hh)) in queries.iter().enumerate() {
                        f(r, t, hh, j0..(j0 + KEYS).min(keys(t)));
                    }
                }
            };
            chunks(&mut |r, t, hh, js| {
                let qh = &q[t * qd + hh * hd..t * qd + (hh + 1) * hd];
                score_keys(qh, k, kvd, g * hd, js, scale, &mut sc[r * n..r * n + n]);
            });
            for (r, &(t, _)) in queries.iter().enumerate() {
                softmax_inplace(&mut sc[r * n..r * n + keys(t)]);
            }
            let mut o = vec![0.0f32; queries.len() * hd];
            chunks(&mut |r, _, _, js| {
                weigh_values(&mut o[r * hd..(r + 1) * hd], &sc[r * n..r * n + n], v, kvd, g * hd, js)
            });
            for (r, &(t, hh)) in queries.iter().enumerate() {
                // SAFETY: (token, head) pairs are disjoint across tasks, and `out` holds
                // `rows × qd` elements (checked above).
                unsafe {
                    std::ptr::copy_nonoverlapping(o[r * hd..].as_ptr(), out.get().add(t * qd + hh * hd), hd);
                }
            }
        });
    };
    let tasks = blocks * h.kv_heads * parts;
    if rows * qd * (start + rows) < 1 << 16 {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// `s[j] = dot_f32(q, k_j) · scale` for each key row `k_j` (`q.len()` values at
/// `j·stride + off` of `k`) of `js`.
fn score_keys(
    q: &[f32],
    k: &[f32],
    stride: usize,
    off: usize,
    js: std::ops::Range<usize>,
    scale: f32,
    s: &mut [f32],
) {
    let hd = q.len();
    let row = |j: usize| &k[j * stride + off..j * stride + off + hd];
    let mut j = js.start;
    while j + 4 <= js.end {
        let d = dot_f32_x4(q, [row(j), row(j + 1), row(j + 2), row(j + 3)]);
        for (i, d) in d.into_iter().enumerate() {
            s[j + i] = d * scale;
        }
        j += 4;
    }
    for (j, s) in s[..js.end].iter_mut().enumerate().skip(j) {
        *s = dot_f32(q, row(j)) * scale;
    }
}

/// `o[d] += p[j] · v[j·stride + off + d]` for each `j` of `js` in order, each element
/// multiplied then added (so a vector lane does what the scalar loop does).
fn weigh_values(o: &mut [f32], p: &[f32], v: &[f32], stride: usize, off: usize, js: std::ops::Range<usize>) {
    assert!(js.end <= p.len() && (js.end == 0 || (js.end - 1) * stride + off + o.len() <= v.len()));
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the rows are in bounds (checked above).
        return unsafe { weigh_values_avx2(o, p, v, stride, off, js) };
    }
    for j in js {
        for (od, &vd) in o.iter_mut().zip(&v[j * stride + off..]) {
            *od += p[j] * vd;
        }
    }
}

/// [`weigh_values`] with 64 elements of `o` held in eight registers while the rows pass.
///
/// # Safety
/// AVX2 is present; every row `j` of `js` holds `o.len()` values at `j·stride + off`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn weigh_values_avx2(
    o: &mut [f32],
    p: &[f32],
    v: &[f32],
    stride: usize,
    off: usize,
    js: std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    const W: usize = 64;
    let whole = o.len() / W * W;
    for d0 in (0..whole).step_by(W) {
        let op = o.as_mut_ptr().add(d0);
        let mut acc: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(op.add(8 * i)));
        for j in js.clone() {
            let pj = _mm256_set1_ps(p[j]);
            let vp = v.as_ptr().add(j * stride + off + d0);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pj, _mm256_loadu_ps(vp.add(8 * i))));
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(op.add(8 * i), *a);
        }
    }
    for j in js {
        for (od, &vd) in o[whole..].iter_mut().zip(&v[j * stride + off + whole..]) {
            *od += p[j] * vd;
        }
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

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn a_block_of_tokens_attends_as_each_token_alone() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        // Head widths with and without a 16- and 64-element tail; one and four heads a group.
        for (heads, kv_heads, head_dim) in [(8, 2, 24), (4, 4, 64), (8, 2, 136), (2, 1, 128)] {
            let h = Heads { heads, kv_heads, head_dim };
            let (qd, kvd) = (heads * head_dim, kv_heads * head_dim);
            let (start, rows) = (37, 11);
            let q = rand_vec(&mut rng, rows * qd);
            let (k, v) = (rand_vec(&mut rng, (start + rows) * kvd), rand_vec(&mut rng, (start + rows) * kvd));
            let mut block = vec![0.0; rows * qd];
            causal(&h, &q, &k, &v, start, rows, &mut block);
            for t in 0..rows {
                let mut one = vec![0.0; qd];
                causal(&h, &q[t * qd..(t + 1) * qd], &k, &v, start + t, 1, &mut one);
                assert_eq!(
                    bits(&one),
                    bits(&block[t * qd..(t + 1) * qd]),
                    "{heads}/{kv_heads}×{head_dim} token {t}"
                );
            }
        }
    }

    #[test]
    fn four_keys_score_as_dot_f32_and_values_weigh_as_the_scalar_loop() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for hd in [8, 16, 24, 64, 128, 136] {
            let q = rand_vec(&mut rng, hd);
            let k = rand_vec(&mut rng, 9 * hd);
            let mut s = vec![0.0; 9];
            score_keys(&q, &k, hd, 0, 0..9, 0.25, &mut s);
            let one: Vec<f32> = (0..9).map(|j| dot_f32(&q, &k[j * hd..(j + 1) * hd]) * 0.25).collect();
            assert_eq!(bits(&s), bits(&one), "scores, head {hd}");
            let p = rand_vec(&mut rng, 9);
            let mut o = rand_vec(&mut rng, hd);
            let mut scalar = o.clone();
            weigh_values(&mut o, &p, &k, hd, 0, 2..9);
            for j in 2..9 {
                for (d, od) in scalar.iter_mut().enumerate() {
                    *od += p[j] * k[j * hd + d];
                }
            }
            assert_eq!(bits(&o), bits(&scalar), "values, head {hd}");
        }
    }
}
