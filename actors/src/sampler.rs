//! Token sampling: repetition penalty → temperature → top-k → top-p, driven by a
//! seeded generator so a seed reproduces a run. A temperature below 1e-4 is greedy.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Temperatures below this are treated as greedy argmax.
pub const GREEDY_BELOW: f32 = 1e-4;

/// How to choose the next token from logits.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; below [`GREEDY_BELOW`] means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1.0 = off).
    pub top_p: f32,
    /// HuggingFace-style repetition penalty over the prompt and generated tokens (1.0 = off).
    pub repetition_penalty: f32,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Checks the ranges; returns the offending parameter's name and why.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        Ok(())
    }
}

/// A seeded sampler with scratch sized for the vocabulary.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    scratch: Vec<f32>,
    order: Vec<u32>,
    seen: Vec<bool>,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab` tokens.
    pub fn new(params: SamplingParams, vocab: usize) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            scratch: vec![0.0; vocab],
            order: Vec::with_capacity(vocab),
            seen: vec![false; vocab],
        }
    }

    /// Whether [`Sampler::sample`] is [`argmax`] of the logits as they are (greedy, no
    /// repetition penalty): then a pass's greedy choice is the sample.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.temperature < GREEDY_BELOW && self.params.repetition_penalty == 1.0
    }

    /// Chooses the next token from `logits`, given the tokens seen so far (prompt and
    /// generated) for the repetition penalty.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.is_plain_greedy() {
            // Nothing changes the logits: no copy.
            return argmax(logits) as u32;
        }
        let p = &self.params;
        let s = &mut self.scratch;
        s.copy_from_slice(logits);
        if p.repetition_penalty != 1.0 {
            // Applied once per distinct token.
            for &t in history {
                let t = t as usize;
                if t < s.len() && !self.seen[t] {
                    self.seen[t] = true;
                    s[t] = if s[t] < 0.0 { s[t] * p.repetition_penalty } else { s[t] / p.repetition_penalty };
                }
            }
            for &t in history {
                if let Some(v) = self.seen.get_mut(t as usize) {
                    *v = false;
                }
            }
        }
        if p.temperature < GREEDY_BELOW {
            return argmax(s) as u32;
        }
        for v in s.iter_mut() {
            *v /= p.temperature;
        }
        // Candidates sorted by descending logit, ties by lower id.
        self.order.clear();
        self.order.extend(0..s.len() as u32);
        self.order.sort_by(|&a, &b| s[b as usize].total_cmp(&s[a as usize]).then(a.cmp(&b)));
        if p.top_k > 0 && p.top_k < self.order.len() {
            self.order.truncate(p.top_k);
        }
        let max = s[self.order[0] as usize];
        let mut total = 0.0f64;
        for &t in &self.order {
            let e = ((s[t as usize] - max) as f64).exp();
            s[t as usize] = e as f32;
            total += e;
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0f64;
            let mut keep = 0;
            for &t in &self.order {
                cum += s[t as usize] as f64 / total;
                keep += 1;
                if cum >= p.top_p as f64 {
                    break;
                }
            }
            self.order.truncate(keep.max(1));
            total = self.order.iter().map(|&t| s[t as usize] as f64).sum();
        }
        let mut r = self.rng.random::<f64>() * total;
        for &t in &self.order {
            r -= s[t as usize] as f64;
            if r <= 0.0 {
                return t;
            }
        }
        *self.order.last().expect("at least one candidate")
    }
}

/// Lanes of [`block_max`]'s running maxima (independent comparisons the compiler keeps
/// in vector registers).
const LANES: usize = 16;

/// Values per block of [`argmax`]'s first pass.
const BLOCK: usize = 1024;

/// Index of the largest value; ties go to the lower index, NaNs are never chosen (unless
/// the first value is one: then 0, as a scan keeping the first maximum gives).
pub fn argmax(x: &[f32]) -> usize {
    let Some(&first) = x.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    // The first block holding the largest value, from each block's maximum (a scan
    // comparing each value with the best so far waits on every comparison), then the
    // value's first index in it.
    let (mut max, mut at) = (first, 0);
    for (b, block) in x.chunks(BLOCK).enumerate() {
        let m = block_max(block, first);
        if m > max {
            (max, at) = (m, b * BLOCK);
        }
    }
    at + x[at..].iter().position(|&v| v == max).expect("the maximum is one of the values")
}

/// The largest of `init` and the values of `block` (NaNs skipped), over independent lanes.
fn block_max(block: &[f32], init: f32) -> f32 {
    let mut lanes = [init; LANES];
    let mut chunks = block.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    lanes.iter().chain(chunks.remainder()).fold(init, |m, &v| if v > m { v } else { m })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax_after_penalty() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 4.0, ..Default::default() }, 3);
        assert_eq!(s.sample(&[1.0, 3.0, 2.0], &[]), 1);
        assert_eq!(s.sample(&[1.0, 3.0, 2.0], &[1]), 2);
    }

    #[test]
    fn argmax_is_the_first_maximum_of_a_scan() {
        let scan = |x: &[f32]| (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b });
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for len in [1, 15, 16, 17, 100, 1000, 3000] {
            for _ in 0..50 {
                // Few distinct values (ties), signed zeros, infinities and NaNs.
                let pool = [0.0, -0.0, 1.0, -1.0, 2.5, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
                let x: Vec<f32> = (0..len).map(|_| pool[rng.random_range(0..pool.len())]).collect();
                assert_eq!(argmax(&x), scan(&x), "{x:?}");
            }
        }
        // The maximum only in later blocks: -0.0 (first) and 0.0 tie.
        let mut x = vec![-1.0f32; 3000];
        (x[5], x[2100], x[2500]) = (f32::NAN, -0.0, 0.0);
        assert_eq!(argmax(&x), 2100);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams { temperature: 1.0, top_k: 3, seed: 9, ..Default::default() };
        let run = || {
            let mut s = Sampler::new(params.clone(), 50);
            (0..20).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        let mut top: Vec<usize> = (0..50).collect();
        top.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        assert!(a.iter().all(|t| top[..3].contains(&(*t as usize))));
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let mut s =
            Sampler::new(SamplingParams { temperature: 0.7, top_p: 1e-6, seed: 3, ..Default::default() }, 4);
        assert_eq!(s.sample(&[0.1, 0.2, 5.0, 0.3], &[]), 2);
    }
}
