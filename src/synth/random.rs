//! The seeded random weights every synthetic model starts from, streamed tensor by
//! tensor in bounded memory, with an optional [`Shaper`] that rewrites rows before they
//! are written (the `trained` routing profile).

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_actors::cpu::quantize::encode_rows;
use smoe_proto::DType;

use crate::vault_writer::TensorSource;

/// Elements generated per step (at least one row).
const STEP: usize = 1 << 18;

/// Rewrites rows of a tensor after they are drawn and before they are written.
pub trait Shaper {
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
    vals: Vec<f32>,
    bytes: Vec<u8>,
}

impl<'a> RandomSource<'a> {
    /// Weights drawn from `seed`, rewritten by `shaper` when given.
    pub fn new(seed: u64, shaper: Option<&'a dyn Shaper>) -> Self {
        RandomSource { seed, shaper, vals: Vec::with_capacity(STEP), bytes: Vec::new() }
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
        let mut rng = tensor_rng(self.seed, name);
        let (lo, hi) = value_range(name, shape);
        let cols = (*shape.last().unwrap_or(&1)).max(1);
        let total: usize = shape.iter().product();
        let step_rows = (STEP / cols).max(1);
        let mut row = 0;
        while row * cols < total {
            let n = (step_rows * cols).min(total - row * cols);
            self.vals.clear();
            self.vals.extend((0..n).map(|_| rng.random_range(lo..hi)));
            if let Some(shaper) = self.shaper {
                shaper.shape(name, shape, row, &mut self.vals);
            }
            self.bytes.clear();
            encode_rows(&self.vals, cols, to, &mut self.bytes)?;
            emit(&self.bytes)?;
            row += n / cols;
        }
        Ok(())
    }
}
