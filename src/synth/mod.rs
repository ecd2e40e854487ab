//! `smoe-pipeline synth`: writes a random-weight model at the shapes of real models,
//! directly (no checkpoint, no Python), in bounded memory — as a vault, or as a
//! HuggingFace checkpoint directory ([`hf`]) that other engines' converters read too.
//! Used for scale benchmarks, and by tests for vaults of arbitrary shape. Weights are
//! seeded per tensor, so a (preset, layers, seed, routing) tuple always gives the same
//! model.
//!
//! Two routing profiles: `uniform` (independent random weights: every token routes
//! afresh, a 64-token chunk touches nearly every expert) and `trained` ([`trained`]:
//! weights built so that the engine's exact routing shows a trained model's load
//! balance and token-to-token locality). `--stats` measures either on a prompt set
//! ([`crate::routing_stats`]).

mod calibrate;
mod hf;
mod random;
mod trained;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use smoe_proto::{human_bytes, DType, HybridConfig, LayerType, Manifest, ModelConfig};

use crate::cli::{RoutingProfile, SynthArgs, SynthFormat};
use crate::quant::Quant;
use crate::routing_stats;
use crate::vault_writer::{write_vault, VaultSpec};
use random::{RandomSource, Shaper};
use trained::{Targets, TrainedProfile};

/// Names of the built-in presets.
pub const PRESETS: &[&str] = &[
    "tiny",
    "tiny-e128",
    "tiny-e512",
    "small",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "tiny-hybrid",
    "qwen3-next-80b-a3b",
    "qwen3.5-397b-a17b",
];

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
        hybrid: None,
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
            hybrid: None,
        },
        // Tiny, with Qwen3's routing geometry (128 experts, top-8) and 32-wide heads:
        // for routing statistics in seconds.
        "tiny-e128" => ModelConfig {
            moe_intermediate_size: 16,
            head_dim: 32,
            num_experts: 128,
            num_experts_per_tok: 8,
            ..preset("tiny")?
        },
        // Tiny, with Qwen3-Next's routing geometry (512 experts, top-10): for the device
        // ranking's sorting path in seconds.
        "tiny-e512" => ModelConfig { num_experts: 512, num_experts_per_tok: 10, ..preset("tiny-e128")? },
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
        // The hybrid family: 3 gated-DeltaNet layers to 1 gated-attention layer, a shared
        // expert beside the routed ones.
        "tiny-hybrid" => ModelConfig {
            architecture: "Qwen3_5MoeForCausalLM".into(),
            intermediate_size: 0,
            hybrid: Some(hybrid(4, 2, 4, 16, 16, 32, vec![])),
            ..preset("tiny")?
        },
        // Qwen/Qwen3-Next-80B-A3B-Instruct's config.json.
        "qwen3-next-80b-a3b" => ModelConfig {
            architecture: "Qwen3NextForCausalLM".into(),
            hidden_size: 2048,
            intermediate_size: 5120,
            moe_intermediate_size: 512,
            num_hidden_layers: 48,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            rope_theta: 1e7,
            max_position_embeddings: 262144,
            num_experts: 512,
            num_experts_per_tok: 10,
            hybrid: Some(hybrid(48, 16, 32, 128, 128, 512, vec![])),
            ..qwen3(2048, 48, 16, 512, 5120)
        },
        // Qwen/Qwen3.5-397B-A17B's text model.
        "qwen3.5-397b-a17b" => ModelConfig {
            architecture: "Qwen3_5MoeForCausalLM".into(),
            hidden_size: 4096,
            intermediate_size: 0,
            moe_intermediate_size: 1024,
            num_hidden_layers: 60,
            num_attention_heads: 32,
            num_key_value_heads: 2,
            head_dim: 256,
            vocab_size: 248320,
            rope_theta: 1e7,
            max_position_embeddings: 262144,
            num_experts: 512,
            num_experts_per_tok: 10,
            eos_token_ids: vec![],
            hybrid: Some(hybrid(60, 16, 64, 128, 128, 1024, vec![11, 11, 10])),
            ..qwen3(4096, 60, 32, 1024, 0)
        },
        _ => bail!("unknown preset {name:?}; choose one of {PRESETS:?}"),
    })
}

/// A hybrid shape of `layers` layers (every fourth full attention), DeltaNet heads
/// `k_heads`/`v_heads` of `k_dim`/`v_dim`, conv kernel 4, partial RoPE 0.25, a shared
/// expert of `shared` and the interleaved mrope sections `mrope`.
fn hybrid(
    layers: usize,
    k_heads: usize,
    v_heads: usize,
    k_dim: usize,
    v_dim: usize,
    shared: usize,
    mrope: Vec<usize>,
) -> HybridConfig {
    HybridConfig {
        layer_types: (0..layers)
            .map(|l| match (l + 1).is_multiple_of(4) {
                true => LayerType::FullAttention,
                false => LayerType::LinearAttention,
            })
            .collect(),
        linear_num_key_heads: k_heads,
        linear_num_value_heads: v_heads,
        linear_key_head_dim: k_dim,
        linear_value_head_dim: v_dim,
        linear_conv_kernel_dim: 4,
        partial_rotary_factor: 0.25,
        mrope_interleaved: !mrope.is_empty(),
        mrope_section: mrope,
        shared_expert_intermediate_size: shared,
    }
}

/// How the synthetic model routes.
#[derive(Clone, Copy, Debug)]
pub enum Routing {
    /// Independent random weights.
    Uniform,
    /// The `trained` profile, aiming at these statistics.
    Trained(Targets),
}

/// What to write.
#[derive(Clone, Copy, Debug)]
pub enum Format {
    /// A vault.
    Vault,
    /// A HuggingFace checkpoint directory with shards of at most this many bytes.
    Hf {
        /// Largest shard in bytes.
        shard_bytes: u64,
    },
}

/// Options of `synth`.
pub struct SynthOptions {
    /// Directory to write.
    pub out: PathBuf,
    /// Preset name.
    pub preset: String,
    /// Keep only the first N layers.
    pub layers: Option<usize>,
    /// Random seed.
    pub seed: u64,
    /// Element type of resident weight matrices (and of the experts without `quant`).
    pub dtype: DType,
    /// How the expert matrices (and, unless `keep_resident`, the resident ones) are
    /// quantised.
    pub quant: Option<Quant>,
    /// Store resident weight matrices as `dtype` even under `quant`.
    pub keep_resident: bool,
    /// Directory to copy tokenizer files from.
    pub tokenizer: Option<PathBuf>,
    /// Overwrite an existing vault or checkpoint.
    pub force: bool,
    /// Routing profile.
    pub routing: Routing,
    /// Output format.
    pub format: Format,
}

/// Writes the synthetic model; returns a one-line summary of what was written.
pub fn synth(opts: &SynthOptions) -> Result<String> {
    let mut cfg = preset(&opts.preset)?;
    if let Some(n) = opts.layers {
        if n == 0 || n > cfg.num_hidden_layers {
            bail!("--layers must be in 1..={} for preset {}", cfg.num_hidden_layers, opts.preset);
        }
        cfg.num_hidden_layers = n;
        if let Some(h) = cfg.hybrid.as_mut() {
            h.layer_types.truncate(n);
        }
    }
    if cfg.hybrid.is_some() && !matches!(opts.routing, Routing::Uniform) {
        bail!(
            "preset {}: the trained routing profile shapes Qwen3-MoE models only; use --routing uniform",
            opts.preset
        );
    }
    if cfg.hybrid.is_some() && matches!(opts.format, Format::Hf { .. }) {
        bail!("preset {}: --format hf writes Qwen3-MoE checkpoints only; write a vault", opts.preset);
    }
    if let Some(dir) = &opts.tokenizer {
        if !dir.join("tokenizer.json").exists() {
            bail!("--tokenizer {}: no tokenizer.json there", dir.display());
        }
    }
    let profile = match opts.routing {
        Routing::Uniform => None,
        Routing::Trained(targets) => {
            let p = TrainedProfile::new(&cfg, opts.seed, targets)?;
            eprintln!("{}", p.describe());
            Some(p)
        }
    };
    let mut src = RandomSource::new(opts.seed, profile.as_ref().map(|p| p as &dyn Shaper));
    let spec = VaultSpec {
        out: &opts.out,
        cfg: &cfg,
        dtype: opts.dtype,
        quant: opts.quant,
        keep_resident: opts.keep_resident,
        force: opts.force,
        tokenizer_dir: opts.tokenizer.as_deref(),
        tokenizer_files: Vec::new(),
        label: "synthesising",
    };
    match opts.format {
        Format::Vault => {
            let m = write_vault(&spec, &mut src)?;
            Ok(format!(
                "wrote synthetic vault {} ({} layers, {} experts, {} per read; {})",
                opts.out.display(),
                m.model.num_hidden_layers,
                m.experts.layers.len() * m.model.num_experts,
                human_bytes(m.experts.mean_blob_len()),
                m.format_summary()
            ))
        }
        Format::Hf { shard_bytes } => {
            let shards = hf::write_hf(&spec, shard_bytes, &mut src)?;
            Ok(format!(
                "wrote synthetic checkpoint {} ({} layers, {} safetensors file(s)); make a vault with \
                 `smoe-pipeline convert --hf {}`",
                opts.out.display(),
                cfg.num_hidden_layers,
                shards.len(),
                opts.out.display()
            ))
        }
    }
}

/// Writes the vault `spec` describes with random weights drawn from `seed` (the same
/// spec and seed always give the same vault); returns its manifest.
pub fn write_random(spec: &VaultSpec, seed: u64) -> Result<Manifest> {
    write_vault(spec, &mut RandomSource::new(seed, None))
}

/// The options of a `synth` command line that writes a model.
fn options(a: &SynthArgs, out: &Path, preset: &str) -> Result<SynthOptions> {
    let routing = match a.routing {
        RoutingProfile::Uniform => {
            if a.overlap.is_some() || a.coverage.is_some() {
                bail!("--overlap and --coverage set the trained profile's targets: add --routing trained");
            }
            Routing::Uniform
        }
        RoutingProfile::Trained => {
            let d = Targets::default();
            Routing::Trained(Targets {
                overlap: a.overlap.unwrap_or(d.overlap),
                coverage: a.coverage.unwrap_or(d.coverage),
            })
        }
    };
    let format = match a.format {
        SynthFormat::Vault => Format::Vault,
        SynthFormat::Hf => {
            if a.stats {
                bail!(
                    "--stats measures a vault, and --format hf writes a checkpoint: convert it first \
                     (smoe-pipeline convert --hf {}), then run synth --stats --vault VAULT",
                    out.display()
                );
            }
            Format::Hf { shard_bytes: a.shard_mb.saturating_mul(1_000_000) }
        }
    };
    Ok(SynthOptions {
        out: out.to_path_buf(),
        preset: preset.to_string(),
        layers: a.layers,
        seed: a.seed,
        dtype: DType::from_name(&a.dtype).unwrap_or(DType::Bf16),
        quant: a.quant,
        keep_resident: a.keep_resident,
        tokenizer: a.tokenizer.clone(),
        force: a.force,
        routing,
        format,
    })
}

/// Runs `synth`: writes the model (unless `--vault` names one to measure), then with
/// `--stats` measures its routing.
pub fn run(a: &SynthArgs) -> Result<()> {
    let vault = match (&a.vault, &a.out, &a.preset) {
        (Some(v), _, _) => v.clone(),
        (None, Some(out), Some(preset)) => {
            let summary = synth(&options(a, out, preset)?)?;
            eprintln!("{summary}");
            out.clone()
        }
        _ => bail!("give --out DIR --preset NAME to write a model, or --stats --vault VAULT to measure one"),
    };
    if !a.stats {
        return Ok(());
    }
    let prompts = match &a.prompts {
        Some(p) => crate::verify::read_prompts(p, &vault)?,
        None => {
            let probe = smoe_actors::vault::Vault::open(&vault)
                .with_context(|| format!("cannot open the vault {} to measure", vault.display()))?;
            let vocab = probe.manifest().model.vocab_size;
            routing_stats::random_prompts(vocab, a.stats_prompts as usize, a.stats_len as usize, a.seed)
        }
    };
    let tokens = prompts.iter().map(Vec::len).sum::<usize>() as u64;
    let bar = indicatif::ProgressBar::new(tokens).with_message("measuring the routing");
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tokens eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let stats = routing_stats::measure(&vault, &prompts, &bar)?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string(&stats)?);
    } else {
        print!("{}", stats.table());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vault_writer::resident_tensors;

    /// Parameters of a preset's text model: resident tensors plus every routed expert.
    fn parameters(cfg: &ModelConfig) -> f64 {
        let resident: usize = resident_tensors(cfg).iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        let experts =
            cfg.moe_layers().len() * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size;
        (resident + experts) as f64
    }

    #[test]
    fn every_preset_is_valid_and_the_real_ones_have_their_sizes() {
        for name in PRESETS {
            preset(name).unwrap().validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        // Total parameters as the model cards give them (text model, no MTP/vision).
        for (name, billions) in [
            ("qwen3-30b-a3b", 30.5),
            ("qwen3-235b-a22b", 235.1),
            ("qwen3-next-80b-a3b", 79.7),
            ("qwen3.5-397b-a17b", 395.0),
        ] {
            let got = parameters(&preset(name).unwrap()) / 1e9;
            assert!(
                (got - billions).abs() / billions < 0.02,
                "{name}: {got:.1}B parameters, expected ~{billions}B"
            );
        }
    }
}
