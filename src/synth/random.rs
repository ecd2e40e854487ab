//! The seeded random weights every synthetic model starts from, streamed tensor by
//! tensor in bounded memory, with an optional [`Shaper`] that rewrites rows before they
//! are written (the `trained` routing profile).
//!
//! A tensor is drawn in steps of whole rows, on every core ([`encode_steps`]). Each value
//! takes exactly one 32-bit word of the tensor's ChaCha8 stream, so a step starts its own
//! copy of the generator at its first element's word position and draws exactly the
//! values a single pass over the tensor would.

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_actors::cpu::quantize::encode_rows;
use smoe_proto::DType;

use crate::vault_writer::{encode_steps, TensorSource};

/// Elements generated per step (at least one row): 1 MiB of values and at most 1 MiB of
/// encoded bytes, so with [`encode_steps`]' batches at most 4 MiB per thread.
const STEP: usize = 1 << 18;

/// Rewrites rows of a tensor after they are drawn and before they are written (from any
/// thread, steps of one tensor at once).
pub trait Shaper: Sync {
    /// Shapes rows `first_row..` of tensor `name` (of `shape`; a 1-D tensor is one row)
    /// held in `rows`, `shape.last()` values per row, in place.
    fn shape(&self, name: &str, shape: &[usize], first_row: usize, rows: &mut [f32]);
}

/// The random generator of one tensor: its seed depends only on the model seed and the
/// tensor's name, so every tensor can be drawn alone and in any order.
fn tensor_rng(seed: u64, name: &str) -> ChaCha8Rng {
    let tensor_seed =
        name.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    ChaCha8Rng::seed_from_u64(tensor_seed)
}

/// The range tensor `name` is drawn from: uniform with the variance of N(0, 1/fan_in)
/// for matrices (a larger scale for router gates, so routing is decisive), N(0, 1)-like
/// embeddings, norm weights in [0.5, 1.5] (and the hybrid family's other vectors, but its
/// DeltaNet log decay rates in [−3, 0]).
fn value_range(name: &str, shape: &[usize]) -> (f32, f32) {
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    if name.ends_with("linear_attn.A_log") {
        // DeltaNet decay rates A = exp(A_log) in [0.05, 1].
        (-3.0, 0.0)
    } else if shape.len() == 1 {
        (0.5, 1.5)
    } else if name.ends_with("embed_tokens.weight") {
        (-1.7, 1.7)
    } else if name.ends_with("mlp.gate.weight") {
        let a = 4.0 * (3.0 / fan_in).sqrt();
        (-a, a)
    } else {
        let a = (3.0 / fan_in).sqrt();
        (-a, a)
    }
}

/// The random values of a whole (small) tensor, as [`RandomSource`] draws them before
/// shaping.
pub fn random_values(seed: u64, name: &str, shape: &[usize]) -> Vec<f32> {
    let mut rng = tensor_rng(seed, name);
    let (lo, hi) = value_range(name, shape);
    (0..shape.iter().product::<usize>()).map(|_| rng.random_range(lo..hi)).collect()
}

/// Seeded random weights (see [`value_range`]), optionally shaped.
pub struct RandomSource<'a> {
    seed: u64,
    shaper: Option<&'a dyn Shaper>,
    /// Elements per step ([`STEP`]; tests take smaller steps).
    step: usize,
}

impl<'a> RandomSource<'a> {
    /// Weights drawn from `seed`, rewritten by `shaper` when given.
    pub fn new(seed: u64, shaper: Option<&'a dyn Shaper>) -> Self {
        RandomSource { seed, shaper, step: STEP }
    }
}

impl TensorSource for RandomSource<'_> {
    fn stream(
        &mut self,
        name: &str,
        shape: &[usize],
        to: DType,
        emit: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (rng, shaper) = (tensor_rng(self.seed, name), self.shaper);
        let (lo, hi) = value_range(name, shape);
        let cols = (*shape.last().unwrap_or(&1)).max(1);
        let total: usize = shape.iter().product();
        let step = (self.step / cols).max(1) * cols;
        // Step `s`: its values (one word of the stream each), shaped and encoded.
        let draw = |vals: &mut Vec<f32>, s: usize| -> Result<Vec<u8>> {
            let first = s * step;
            let mut rng = rng.clone();
            rng.set_word_pos(first as u128);
            vals.clear();
            vals.extend((0..step.min(total - first)).map(|_| rng.random_range(lo..hi)));
            if let Some(shaper) = shaper {
                shaper.shape(name, shape, first / cols, vals);
            }
            let mut bytes = Vec::new();
            encode_rows(vals, cols, to, &mut bytes)?;
            Ok(bytes)
        };
        encode_steps(total.div_ceil(step), draw, emit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Quant;
    use crate::synth::preset;
    use crate::synth::trained::{Targets, TrainedProfile};
    use crate::vault_writer::{write_vault, VaultSpec};

    /// Every file under `dir` with its bytes, by path relative to `dir`, sorted.
    fn files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
        let (mut v, mut dirs) = (Vec::new(), vec![dir.to_path_buf()]);
        while let Some(d) = dirs.pop() {
            for p in std::fs::read_dir(d).unwrap().map(|e| e.unwrap().path()) {
                if p.is_dir() {
                    dirs.push(p);
                } else {
                    v.push((p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap()));
                }
            }
        }
        v.sort();
        v
    }

    /// The files of preset `name`'s vault (2 layers, Q4_K_M) drawn with `step` on a pool
    /// of `threads`.
    fn vault(name: &str, trained: bool, threads: usize, step: usize) -> Vec<(String, Vec<u8>)> {
        let mut cfg = preset(name).unwrap();
        cfg.num_hidden_layers = 2;
        let profile = trained.then(|| TrainedProfile::new(&cfg, 5, Targets::default()).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("v");
        let spec = VaultSpec {
            out: &out,
            cfg: &cfg,
            dtype: DType::Bf16,
            quant: Some(Quant::Q4KM),
            keep_resident: false,
            force: false,
            tokenizer_dir: None,
            tokenizer_files: Vec::new(),
            label: "test",
        };
        let mut src = RandomSource::new(5, profile.as_ref().map(|p| p as &dyn Shaper));
        src.step = step;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| write_vault(&spec, &mut src)).unwrap();
        files(&out)
    }

    #[test]
    fn steps_drawn_on_several_threads_give_the_bytes_of_one_pass() {
        // `small` stores Q4_K/Q6_K experts; every tensor of it fits one default step, so
        // one thread and the default step draw each tensor in a single pass.
        let one_pass = vault("small", false, 1, STEP);
        assert!(one_pass.iter().any(|(f, _)| f.starts_with("experts")));
        // Steps of 3 rows of 256 (and of whole rows of the wider and narrower tensors),
        // many batches per tensor, some ending short.
        assert!(vault("small", false, 3, 3 * 256) == one_pass, "3 threads, short steps");
        assert!(vault("small", false, 1, 3 * 256) == one_pass, "1 thread, short steps");
    }

    #[test]
    fn a_shaped_vault_does_not_depend_on_the_thread_count() {
        let one = vault("tiny", true, 1, 64 * 3);
        assert!(vault("tiny", true, 4, 64 * 3) == one);
    }
}
