//! The `trained` routing profile: weights built so that the engine's exact routing (the
//! softmax top-k of the real gate matvec on the real hidden state) behaves like a
//! trained model's — balanced expert load, strong token-to-token locality, unions that
//! grow slowly with chunk size — while the arithmetic stays the model's.
//!
//! How the weights do it. A few dimensions of the residual stream are reserved for
//! routing and written only where said here: a constant *bias* dimension, an *own*
//! subspace `F` and a *strong* subspace `G`; every other writer of the residual stream
//! (attention output of layers ≥ 1, every expert's and dense FFN's down projection) has
//! zero rows there.
//! - Embedding row of token `v`: 1 on the bias dimension, a random direction of fixed
//!   norm in `F`, a random direction in `G` for the fraction of the vocabulary that
//!   routes by itself ("strong" tokens, zero otherwise), and its random values elsewhere
//!   rescaled so every row has RMS 1 (so RMSNorm scales all tokens alike).
//! - Layer 0 attention makes the context: queries and keys read only the bias dimension,
//!   so after `q_norm`/`k_norm` they are one constant vector whose energy sits on a band
//!   of RoPE pairs — the scores then depend only on the distance between positions and
//!   form a causal window of ~[`WINDOW`] positions ([`calibrate::design_window`]). Values
//!   copy `F`; the output projection adds `γ` times the windowed average back into `F`.
//!   So a token's `F` part is its own direction plus `γ` times its recent context, which
//!   drifts slowly along any token sequence (prompt or generated).
//! - Router gate rows of every MoE layer read only `F` and `G`: independent random rows
//!   of equal norm per part (the load balances by symmetry), divided by that layer's
//!   `post_attention_layernorm` weights so the norm does not bend them.
//!
//! `γ` sets the correlation of adjacent tokens' gate logits, the strong fraction dilutes
//! it for some pairs; both are solved from the target overlap and coverage
//! ([`calibrate::solve`]). Routing is driven by layer 0's context and each layer's own
//! random rows, so every MoE layer has the same statistics, independently drawn.

use std::ops::Range;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_proto::ModelConfig;

use super::calibrate::{self, Curves, Solution, Window};
use super::random::{random_values, Shaper};

/// Effective number of previous positions the routing context averages over. Larger
/// windows drift more slowly: smaller unions per chunk at the same adjacent overlap.
pub const WINDOW: f64 = 40.0;

/// Standard deviation of a strong token's gate logits from its strong part, relative to
/// an ordinary token's gate logits.
const STRONG_GAIN: f64 = 3.0;

/// Standard deviation of an ordinary token's gate logits at unit hidden RMS.
const LOGIT_STD: f64 = 3.0;

/// Target routing statistics of the `trained` profile.
#[derive(Clone, Copy, Debug)]
pub struct Targets {
    /// Mean fraction of a token's top-k experts that the next token also uses.
    pub overlap: f64,
    /// Mean fraction of the next token's top-k within the current token's top-2k.
    pub coverage: f64,
}

impl Default for Targets {
    /// The figures measured on a trained Qwen3-235B-A22B (46.4% overlap, 63.7% coverage
    /// by the top-16).
    fn default() -> Self {
        Targets { overlap: 0.46, coverage: 0.64 }
    }
}

/// The dimensions of the residual stream reserved for routing.
struct Layout {
    /// The constant dimension queries and keys of layer 0 read.
    bias: usize,
    /// Each token's own part, plus its context after layer 0.
    own: Range<usize>,
    /// The strong tokens' part.
    strong: Range<usize>,
}

impl Layout {
    fn new(cfg: &ModelConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let own = cfg.kv_dim().min(3 * h / 8).min(96);
        let strong = (h / 4).min(64);
        if own < 8 || strong < 4 || 1 + own + strong + 4 > h {
            bail!(
                "the trained routing profile needs a hidden size of at least 32 and 8 key/value dimensions \
                 (this model: hidden {h}, key/value {})",
                cfg.kv_dim()
            );
        }
        Ok(Layout { bias: 0, own: 1..1 + own, strong: 1 + own..1 + own + strong })
    }

    /// All reserved dimensions.
    fn reserved(&self) -> Range<usize> {
        self.bias..self.strong.end
    }
}

/// The `trained` profile of one model and seed: a [`Shaper`] over the random weights.
pub struct TrainedProfile {
    layout: Layout,
    head_dim: usize,
    heads_per_kv: usize,
    window: Window,
    /// Query/key norm weight that gives the window its sharpness.
    qk_norm: f32,
    solution: Solution,
    targets: Targets,
    /// Gate scale of the own and strong parts.
    scale_own: f32,
    scale_strong: f32,
    /// Layer 0's `input_layernorm` weights.
    input_norm0: Vec<f32>,
    /// Each layer's `post_attention_layernorm` weights.
    post_norms: Vec<Vec<f32>>,
    /// Every token's own direction (`vocab × own`, unit norm, a tight frame).
    own_dirs: Vec<f32>,
    /// Per token: its row in `strong_dirs`, or `u32::MAX` for an ordinary token.
    strong_index: Vec<u32>,
    /// The strong tokens' directions (`strong tokens × strong`, a tight frame).
    strong_dirs: Vec<f32>,
}

/// `n` random directions of `d` dimensions drawn from `rng`, made a tight frame.
fn frame(rng: &mut ChaCha8Rng, n: usize, d: usize) -> Vec<f32> {
    let mut v: Vec<f64> = (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect();
    calibrate::tight_frame(&mut v, d);
    v.into_iter().map(|x| x as f32).collect()
}

/// Scales `v` to Euclidean norm `norm` (a zero vector stays zero).
fn set_norm(v: &mut [f32], norm: f64) {
    let n = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 * norm / n) as f32);
    }
}

impl TrainedProfile {
    /// Designs the profile of `cfg` for weights drawn from `seed`.
    pub fn new(cfg: &ModelConfig, seed: u64, targets: Targets) -> Result<Self> {
        for (name, v) in [("overlap", targets.overlap), ("coverage", targets.coverage)] {
            if !(v > 0.0 && v < 1.0) {
                bail!("--{name} must be a fraction between 0 and 1, got {v}");
            }
        }
        let (k, experts) = (cfg.num_experts_per_tok, cfg.num_experts);
        if experts < 2 * k {
            bail!("the trained routing profile needs at least 2·top-k experts ({experts} < 2·{k})");
        }
        let layout = Layout::new(cfg)?;
        let horizon = cfg.max_position_embeddings.clamp(1024, 16384);
        let window = calibrate::design_window(cfg.head_dim, cfg.rope_theta, WINDOW, horizon)?;
        let curves = Curves::new(experts, k);
        let solution = calibrate::solve(&curves, &window, targets.overlap, targets.coverage, STRONG_GAIN);
        let var = calibrate::input_variance(&window.weights, solution.gamma);
        let norm = |name: String| random_values(seed, &name, &[cfg.hidden_size]);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0074_7261_696e_6564);
        let own_dirs = frame(&mut rng, cfg.vocab_size, layout.own.len());
        let mut strong_index = vec![u32::MAX; cfg.vocab_size];
        let mut strong = 0u32;
        for slot in strong_index.iter_mut() {
            if rng.random::<f64>() < solution.strong_frac {
                *slot = strong;
                strong += 1;
            }
        }
        let strong_dirs = frame(&mut rng, strong as usize, layout.strong.len());
        Ok(TrainedProfile {
            own_dirs,
            strong_index,
            strong_dirs,
            head_dim: cfg.head_dim,
            heads_per_kv: cfg.num_attention_heads / cfg.num_key_value_heads.max(1),
            qk_norm: (window.sharpness / (cfg.head_dim as f64).sqrt()).sqrt() as f32,
            scale_own: (LOGIT_STD / var.sqrt()) as f32,
            scale_strong: (LOGIT_STD * STRONG_GAIN) as f32,
            input_norm0: norm("model.layers.0.input_layernorm.weight".into()),
            post_norms: (0..cfg.num_hidden_layers)
                .map(|l| norm(format!("model.layers.{l}.post_attention_layernorm.weight")))
                .collect(),
            layout,
            window,
            solution,
            targets,
        })
    }

    /// What was designed, for the user.
    pub fn describe(&self) -> String {
        let s = &self.solution;
        let t = &self.targets;
        let missed = if (s.overlap - t.overlap).abs() + (s.coverage - t.coverage).abs() > 0.02 {
            format!(
                "\nwarning: overlap {:.1}% with coverage {:.1}% is out of this profile's reach; it aims at the closest pair above",
                100.0 * t.overlap,
                100.0 * t.coverage
            )
        } else {
            String::new()
        };
        format!(
            "trained routing: context window {:.1} positions (RoPE pairs {}..{}, sharpness {:.1}, {:.1e} of the \
             weight beyond 4 windows), context gain {:.2}, strong tokens {:.0}% of the vocabulary; predicted \
             adjacent overlap {:.1}%, top-2k coverage {:.1}%",
            self.window.n_eff,
            self.window.band.start,
            self.window.band.end,
            self.window.sharpness,
            self.window.far_mass,
            s.gamma,
            100.0 * s.strong_frac,
            100.0 * s.overlap,
            100.0 * s.coverage
        ) + &missed
    }

    /// Embedding rows: the bias, the token's own direction, its strong direction (strong
    /// tokens only), and its random values elsewhere, every row with RMS 1.
    fn embedding(&self, first: usize, rows: &mut [f32], h: usize) {
        let l = &self.layout;
        let (own, strong) = (l.own.len(), l.strong.len());
        for (i, row) in rows.chunks_exact_mut(h).enumerate() {
            let v = first + i;
            row[l.bias] = 1.0;
            row[l.own.clone()].copy_from_slice(&self.own_dirs[v * own..(v + 1) * own]);
            set_norm(&mut row[l.own.clone()], (own as f64).sqrt());
            let s = self.strong_index[v] as usize;
            let is_strong = s != u32::MAX as usize;
            if is_strong {
                row[l.strong.clone()].copy_from_slice(&self.strong_dirs[s * strong..(s + 1) * strong]);
                set_norm(&mut row[l.strong.clone()], (strong as f64).sqrt());
            } else {
                row[l.strong.clone()].fill(0.0);
            }
            let used = 1 + own + if is_strong { strong } else { 0 };
            set_norm(&mut row[l.strong.end..], ((h - used) as f64).sqrt());
        }
    }

    /// Layer 0's query or key projection: every head is the window's constant vector,
    /// read from the bias dimension.
    fn query_key(&self, first: usize, rows: &mut [f32], h: usize) {
        let (hd, band) = (self.head_dim, &self.window.band);
        // RMS 1 over the head, spread evenly over the band's first components.
        let amp = (hd as f64 / band.len() as f64).sqrt() as f32 / self.input_norm0[self.layout.bias];
        for (i, row) in rows.chunks_exact_mut(h).enumerate() {
            row.fill(0.0);
            if band.contains(&((first + i) % hd)) {
                row[self.layout.bias] = amp;
            }
        }
    }

    /// Layer 0's value projection: value row `r` copies own dimension `r`.
    fn value(&self, first: usize, rows: &mut [f32], h: usize) {
        let own = &self.layout.own;
        for (i, row) in rows.chunks_exact_mut(h).enumerate() {
            let r = first + i;
            if r < own.len() {
                row.fill(0.0);
                row[own.start + r] = 1.0 / self.input_norm0[own.start + r];
            }
        }
    }

    /// Layer 0's output projection: own dimension `r` gains γ times the first head of
    /// value row `r`'s group; other reserved dimensions get nothing.
    fn context_out(&self, first: usize, rows: &mut [f32], cols: usize) {
        let (own, hd) = (&self.layout.own, self.head_dim);
        for (i, row) in rows.chunks_exact_mut(cols).enumerate() {
            let d = first + i;
            if self.layout.reserved().contains(&d) {
                row.fill(0.0);
                if own.contains(&d) {
                    let r = d - own.start;
                    row[(r / hd) * self.heads_per_kv * hd + r % hd] = self.solution.gamma as f32;
                }
            }
        }
    }

    /// A writer of the residual stream: no rows in the reserved dimensions.
    fn keep_out(&self, first: usize, rows: &mut [f32], cols: usize) {
        let reserved = self.layout.reserved();
        let (lo, hi) = (reserved.start.max(first), reserved.end.min(first + rows.len() / cols));
        if lo < hi {
            rows[(lo - first) * cols..(hi - first) * cols].fill(0.0);
        }
    }

    /// Layer `layer`'s router gate: unit-norm random rows in the own and strong parts.
    fn gate(&self, layer: usize, rows: &mut [f32], h: usize) {
        let l = &self.layout;
        let w = &self.post_norms[layer];
        for row in rows.chunks_exact_mut(h) {
            for (part, scale) in [(l.own.clone(), self.scale_own), (l.strong.clone(), self.scale_strong)] {
                set_norm(&mut row[part.clone()], scale as f64);
                part.for_each(|d| row[d] /= w[d]);
            }
            row[..l.own.start].fill(0.0);
            row[l.strong.end..].fill(0.0);
        }
    }
}

impl Shaper for TrainedProfile {
    fn shape(&self, name: &str, shape: &[usize], first: usize, rows: &mut [f32]) {
        let cols = *shape.last().unwrap_or(&1);
        if name == "model.embed_tokens.weight" {
            return self.embedding(first, rows, cols);
        }
        let Some((layer, part)) = name.strip_prefix("model.layers.").and_then(|r| r.split_once('.')) else {
            return;
        };
        let Ok(layer) = layer.parse::<usize>() else { return };
        match (layer, part) {
            (0, "self_attn.q_proj.weight" | "self_attn.k_proj.weight") => self.query_key(first, rows, cols),
            (0, "self_attn.v_proj.weight") => self.value(first, rows, cols),
            (0, "self_attn.o_proj.weight") => self.context_out(first, rows, cols),
            (0, "self_attn.q_norm.weight" | "self_attn.k_norm.weight") => rows.fill(self.qk_norm),
            (_, "self_attn.o_proj.weight" | "mlp.down_proj.weight") => self.keep_out(first, rows, cols),
            (_, "mlp.gate.weight") => self.gate(layer, rows, cols),
            (_, p) if p.starts_with("mlp.experts.") && p.ends_with(".down_proj.weight") => {
                self.keep_out(first, rows, cols)
            }
            _ => {}
        }
    }
}
