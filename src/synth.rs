//! `smoe-pipeline synth`: writes a random-weight vault at the shapes of real models,
//! directly (no checkpoint, no Python), in bounded memory. Used for scale benchmarks,
//! and by tests for vaults of arbitrary shape. Weights are seeded per tensor, so a
//! (preset, layers, seed) triple always gives the same vault.

use std::path::PathBuf;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_actors::cpu::quantize::encode_rows;
use smoe_proto::{DType, Manifest, ModelConfig};

use crate::quant::Quant;
use crate::vault_writer::{step_elems, write_vault, TensorSource, VaultSpec};

/// Names of the built-in presets.
pub const PRESETS: &[&str] = &["tiny", "small", "qwen3-30b-a3b", "qwen3-235b-a22b"];

/// The model configuration of a preset (full depth).
pub fn preset(name: &str) -> Result<ModelConfig> {
    let qwen3 = |hidden, layers, heads, experts_inter, inter| ModelConfig {
        architecture: "Qwen3MoeForCausalLM".into(),
        hidden_size: hidden,
        intermediate_size: inter,
        moe_intermediate_size: experts_inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: 4,
        head_dim: 128,
        vocab_size: 151936,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        max_position_embeddings: 40960,
        num_experts: 128,
        num_experts_per_tok: 8,
        norm_topk_prob: true,
        decoder_sparse_step: 1,
        mlp_only_layers: vec![],
        tie_word_embeddings: false,
        eos_token_ids: vec![151645, 151643],
    };
    Ok(match name {
        "tiny" => ModelConfig {
            architecture: "Qwen3MoeForCausalLM".into(),
            hidden_size: 64,
            intermediate_size: 128,
            moe_intermediate_size: 32,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            vocab_size: 512,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_position_embeddings: 4096,
            num_experts: 16,
            num_experts_per_tok: 4,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
            tie_word_embeddings: false,
            eos_token_ids: vec![],
        },
        // The smallest shape whose expert rows are whole K-quant blocks (256 elements), so
        // `--quant q4_k_m` and friends store Q4_K/Q5_K/Q6_K rather than their fallbacks.
        "small" => ModelConfig {
            hidden_size: 256,
            intermediate_size: 512,
            moe_intermediate_size: 256,
            head_dim: 64,
            ..preset("tiny")?
        },
        "qwen3-30b-a3b" => qwen3(2048, 48, 32, 768, 6144),
        "qwen3-235b-a22b" => qwen3(4096, 94, 64, 1536, 12288),
        _ => bail!("unknown preset {name:?}; choose one of {PRESETS:?}"),
    })
}

/// Options of `synth`.
pub struct SynthOptions {
    /// Vault directory to write.
    pub out: PathBuf,
    /// Preset name.
    pub preset: String,
    /// Keep only the first N layers.
    pub layers: Option<usize>,
    /// Random seed.
    pub seed: u64,
    /// Element type of resident weight matrices (and of the experts without `quant`).
    pub dtype: DType,
    /// How the expert matrices are quantised.
    pub quant: Option<Quant>,
    /// Directory to copy tokenizer files from.
    pub tokenizer: Option<PathBuf>,
    /// Overwrite an existing vault.
    pub force: bool,
}

/// Seeded random weights: uniform with the variance of N(0, 1/fan_in) for matrices (a
/// larger scale for router gates, so routing is decisive), N(0, 1)-like embeddings,
/// and norm weights in [0.5, 1.5].
struct RandomSource {
    seed: u64,
    vals: Vec<f32>,
    bytes: Vec<u8>,
}

/// Elements generated per step.
const STEP: usize = 1 << 18;

impl TensorSource for RandomSource {
    fn stream(
        &mut self,
        name: &str,
        shape: &[usize],
        to: DType,
        emit: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let tensor_seed = name
            .bytes()
            .fold(self.seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        let mut rng = ChaCha8Rng::seed_from_u64(tensor_seed);
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let (lo, hi) = if shape.len() == 1 {
            (0.5, 1.5)
        } else if name.ends_with("embed_tokens.weight") {
            (-1.7, 1.7)
        } else if name.ends_with("mlp.gate.weight") {
            let a = 4.0 * (3.0 / fan_in).sqrt();
            (-a, a)
        } else {
            let a = (3.0 / fan_in).sqrt();
            (-a, a)
        };
        let cols = shape.last().copied().unwrap_or(1);
        let mut left: usize = shape.iter().product();
        while left > 0 {
            let n = left.min(step_elems(cols, STEP));
            self.vals.clear();
            self.vals.extend((0..n).map(|_| rng.random_range(lo..hi)));
            self.bytes.clear();
            encode_rows(&self.vals, cols, to, &mut self.bytes)?;
            emit(&self.bytes)?;
            left -= n;
        }
        Ok(())
    }
}

/// Writes the synthetic vault; returns its manifest.
pub fn synth(opts: &SynthOptions) -> Result<Manifest> {
    let mut cfg = preset(&opts.preset)?;
    if let Some(n) = opts.layers {
        if n == 0 || n > cfg.num_hidden_layers {
            bail!("--layers must be in 1..={} for preset {}", cfg.num_hidden_layers, opts.preset);
        }
        cfg.num_hidden_layers = n;
    }
    if let Some(dir) = &opts.tokenizer {
        if !dir.join("tokenizer.json").exists() {
            bail!("--tokenizer {}: no tokenizer.json there", dir.display());
        }
    }
    let spec = VaultSpec {
        out: &opts.out,
        cfg: &cfg,
        dtype: opts.dtype,
        quant: opts.quant,
        force: opts.force,
        tokenizer_dir: opts.tokenizer.as_deref(),
        tokenizer_files: Vec::new(),
        label: "synthesising",
    };
    write_random(&spec, opts.seed)
}

/// Writes the vault `spec` describes with random weights drawn from `seed` (the same
/// spec and seed always give the same vault); returns its manifest.
pub fn write_random(spec: &VaultSpec, seed: u64) -> Result<Manifest> {
    write_vault(spec, &mut RandomSource { seed, vals: Vec::with_capacity(STEP), bytes: Vec::new() })
}
