//! Command-line interface definitions.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use smoe_actors::executor::BackendKind;
use smoe_actors::streamer::IoChoice;

use crate::quant::Quant;
use crate::settings::ByteSize;

/// smoe-pipeline: run mixture-of-experts models larger than memory by streaming
/// routed experts from NVMe.
#[derive(Parser, Debug)]
#[command(name = "smoe-pipeline", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Convert a HuggingFace checkpoint directory or a GGUF file into a vault.
    Convert(ConvertArgs),
    /// Generate text from a vault.
    Generate(GenerateArgs),
    /// Run the OpenAI-compatible HTTP daemon (see README: Serve).
    Serve(Box<ServeArgs>),
    /// Check that layer-major prefill is byte-identical to token-serial replay.
    Verify(VerifyArgs),
    /// Read a whole vault and verify every checksum (resident tensors and expert blobs).
    Check(CheckArgs),
    /// Write a random-weight vault at the shape of a real model.
    Synth(SynthArgs),
    /// List the Vulkan devices (index for --device, memory heaps, key limits).
    Devices(DevicesArgs),
    /// Show a GGUF file: metadata, tensors, and whether smoe-pipeline computes with
    /// every tensor type in it.
    GgufInfo(GgufInfoArgs),
}

/// Arguments of `gguf-info`.
#[derive(Args, Debug)]
pub struct GgufInfoArgs {
    /// GGUF file; for a split model its first part (`*-00001-of-0000N.gguf`).
    #[arg(long)]
    pub gguf: PathBuf,
    /// Also print the first values of this tensor's first row, dequantised.
    #[arg(long)]
    pub tensor: Option<String>,
}

/// Arguments of `synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Directory to write: a vault, or with `--format hf` a HuggingFace checkpoint.
    #[arg(long, required_unless_present = "vault")]
    pub out: Option<PathBuf>,
    /// Model shape: tiny, tiny-e128, tiny-e512, small, qwen3-30b-a3b, qwen3-235b-a22b, or
    /// the hybrid tiny-hybrid, qwen3-next-80b-a3b, qwen3.5-397b-a17b.
    #[arg(long, required_unless_present = "vault")]
    pub preset: Option<String>,
    /// Keep only the first N layers (so the model fits the disk at hand).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Element type of resident weight matrices (and of the experts without --quant).
    #[arg(long, value_parser = ["f32", "bf16"], default_value = "bf16")]
    pub dtype: String,
    /// Quantise the weights: q8_0, q4_0, q4_k_m, q5_k_m or q6_k (llama.cpp's mixes of
    /// those names, for the routed experts and the resident matrices; router gates and
    /// norms stay unquantised).
    #[arg(long, value_enum)]
    pub quant: Option<Quant>,
    /// With --quant: quantise only the routed experts; resident matrices keep --dtype.
    #[arg(long, requires = "quant")]
    pub keep_resident: bool,
    /// Copy tokenizer files from this directory.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Overwrite an existing vault or checkpoint at --out.
    #[arg(long)]
    pub force: bool,
    /// How tokens route: uniform (independent random gates) or trained (load-balanced,
    /// with token-to-token locality like a trained model; see README).
    #[arg(long, value_enum, default_value_t = RoutingProfile::Uniform)]
    pub routing: RoutingProfile,
    /// Trained routing: target fraction of a token's top-k experts the next token also
    /// uses (default 0.46).
    #[arg(long)]
    pub overlap: Option<f64>,
    /// Trained routing: target fraction of the next token's top-k within the current
    /// token's top-2k (default 0.64).
    #[arg(long)]
    pub coverage: Option<f64>,
    /// What to write: a vault, or a HuggingFace checkpoint directory (for `convert --hf`
    /// and other engines' converters).
    #[arg(long, value_enum, default_value_t = SynthFormat::Vault)]
    pub format: SynthFormat,
    /// With --format hf: largest safetensors shard in MB.
    #[arg(long, default_value_t = 4000, value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_mb: u64,
    /// Measure the routing (load spread, adjacent overlap, coverage, chunk unions) of the
    /// vault just written, or of --vault.
    #[arg(long)]
    pub stats: bool,
    /// With --stats: measure this vault instead of writing one.
    #[arg(long, requires = "stats", conflicts_with_all = ["out", "preset"])]
    pub vault: Option<PathBuf>,
    /// With --stats: prompts, one per line (a JSON array of token ids, or text tokenized
    /// with the vault's tokenizer); default: random token ids.
    #[arg(long, requires = "stats")]
    pub prompts: Option<PathBuf>,
    /// With --stats and no --prompts: how many random prompts.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub stats_prompts: u64,
    /// With --stats and no --prompts: tokens per random prompt.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(2..))]
    pub stats_len: u64,
    /// With --stats: print the statistics as one JSON object instead of a table.
    #[arg(long, requires = "stats")]
    pub json: bool,
}

/// How a synthetic model routes (`synth --routing`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutingProfile {
    /// Independent random router gates and embeddings.
    Uniform,
    /// Weights built for a trained model's routing statistics.
    Trained,
}

/// What `synth` writes (`synth --format`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthFormat {
    /// A vault, ready to run.
    Vault,
    /// A HuggingFace checkpoint directory.
    Hf,
}

/// Arguments of `verify`.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Vault directory made by `convert` or `synth`.
    #[arg(long)]
    pub vault: PathBuf,
    /// Prompts to check, one per line: a JSON array of token ids, or text (tokenized
    /// with the vault's tokenizer). Default: generated prompts of lengths 1, 2, around
    /// each chunk boundary (c-1, c, c+1, c+2, 2c+1) and 1037 tokens.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Chunk sizes to compare against token-serial replay.
    #[arg(long, value_delimiter = ',', default_value = "1,7,64")]
    pub chunk_sizes: Vec<usize>,
    /// Greedy tokens generated and compared per prompt.
    #[arg(long, default_value_t = 32)]
    pub tokens: usize,
    /// Ring slots (default: 4 GiB worth, at most every expert).
    #[arg(long)]
    pub ring_slots: Option<usize>,
    /// VRAM tier of each Vulkan pass (serial and each chunk size), with an optional
    /// unit: device-local copies of the experts the kernels multiply (default: off).
    #[arg(long)]
    pub vram_bytes: Option<ByteSize>,
    /// Workgroups of the Vulkan backend's fused MoE front (router, ranking and expert
    /// gate/up of a decode step in one dispatch; all must run at once: one an SM, at most
    /// the SM count `devices` prints; 0: off). Default: that SM count where the driver
    /// reports it (NVIDIA), else off.
    #[arg(long)]
    pub moe_front_groups: Option<u32>,
    /// I/O path: auto, io-uring or pread.
    #[arg(long, default_value = "auto")]
    pub io: smoe_actors::streamer::IoChoice,
    /// Compute backend to check: cpu or vulkan (both paths run on it).
    #[arg(long, default_value = "cpu")]
    pub backend: smoe_actors::executor::BackendKind,
    /// Vulkan device index.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

/// Arguments of `check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Vault directory to check.
    #[arg(long)]
    pub vault: PathBuf,
}

/// Arguments of `devices`.
#[derive(Args, Debug)]
pub struct DevicesArgs {
    /// Print one JSON array instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `convert`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["hf", "gguf"])))]
pub struct ConvertArgs {
    /// HuggingFace model directory (config.json, *.safetensors, tokenizer files).
    #[arg(long)]
    pub hf: Option<PathBuf>,
    /// GGUF model file (llama.cpp's format); for a split model its first part
    /// (`*-00001-of-0000N.gguf`). Tensors keep their formats, the tokenizer and chat
    /// template come from the GGUF's metadata.
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// Vault directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Element type of a HuggingFace checkpoint's resident weight matrices, and of the
    /// experts without --quant: f32 or bf16 (default: bf16 for bf16 checkpoints, else f32).
    #[arg(long, value_parser = ["f32", "bf16"], conflicts_with = "gguf")]
    pub dtype: Option<String>,
    /// Quantise while converting: q8_0, q4_0, q4_k_m, q5_k_m or q6_k (llama.cpp's mixes
    /// of those names, for the routed experts and the resident matrices; router gates and
    /// norms stay unquantised). Not with --gguf, whose tensors keep their formats.
    #[arg(long, value_enum, conflicts_with = "gguf")]
    pub quant: Option<Quant>,
    /// With --quant: quantise only the routed experts; resident matrices keep --dtype.
    #[arg(long, requires = "quant")]
    pub keep_resident: bool,
    /// Overwrite an existing vault at --out.
    #[arg(long)]
    pub force: bool,
}

/// Arguments of `generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Vault directory made by `convert`.
    #[arg(long)]
    pub vault: PathBuf,
    /// Prompt text (tokenized with the vault's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature (below 1e-4: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (ids, text, stats) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Write the logits of every generated token to this safetensors file.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Engine and I/O settings.
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Write one JSON line per expert claim (pos, rows, layer, expert, hit, bytes).
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Prefill strategy.
    #[arg(long, value_enum, default_value_t = PrefillMode::LayerMajor)]
    pub prefill: PrefillMode,
    /// Print where the time goes (per phase of the layer loop, prefill and decode
    /// separately: host timers, and device timestamps and waits on Vulkan) to stderr, and
    /// with --json add it to the stats.
    #[arg(long)]
    pub profile: bool,
    /// Run the request once on a throwaway session first (fills the ring, builds the GPU
    /// kernels, wakes the device clocks), so the stats, the profile and the trace describe
    /// a warm engine.
    #[arg(long)]
    pub warmup: bool,
}

/// The engine flags of `generate` and `serve`. A flag left out takes the value of the
/// config key of the same name: for `generate` its default, for `serve` the config
/// file's (the defaults are [`Config`](crate::config::Config)'s).
#[derive(Args, Debug, Clone, Default)]
pub struct EngineFlags {
    /// Longest sequence (prompt + generated tokens) a session holds, which sizes its KV
    /// cache. Default 8192.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Ring slots (each holds one expert). Default: what the memory available leaves
    /// beside the resident tensors and KV caches, at most every expert.
    #[arg(long, conflicts_with = "ring_bytes")]
    pub ring_slots: Option<usize>,
    /// Ring size (instead of --ring-slots), with an optional unit: 4096, 512MiB, 12G.
    /// Default: as for --ring-slots.
    #[arg(long)]
    pub ring_bytes: Option<ByteSize>,
    /// Vulkan VRAM tier (device-local copies of experts, filled from the ring), with an
    /// optional unit; 0 turns it off. Default: what the device can spare (off where the
    /// GPU's memory is the host's).
    #[arg(long)]
    pub vram_bytes: Option<ByteSize>,
    /// Workgroups of the Vulkan backend's fused MoE front (router, ranking and expert
    /// gate/up of a decode step in one dispatch; all must run at once: one an SM, at most
    /// the SM count `devices` prints; 0: off). Default: that SM count where the driver
    /// reports it (NVIDIA), else off.
    #[arg(long)]
    pub moe_front_groups: Option<u32>,
    /// I/O path: auto (io_uring, falling back to pread), io-uring, or pread. Default auto.
    #[arg(long)]
    pub io: Option<IoChoice>,
    /// Reads in flight (io_uring) or reader threads (pread). Default 8.
    #[arg(long)]
    pub queue_depth: Option<usize>,
    /// Prompt tokens per layer-major prefill chunk. Default 512.
    #[arg(long)]
    pub chunk_size: Option<usize>,
    /// Gate ranks beyond top-k queued as speculative prefetches during decode (0: off).
    /// Default 0.
    #[arg(long)]
    pub spec_depth: Option<usize>,
    /// Experts of the next MoE layer a prefill chunk reads ahead while a layer computes
    /// (0: off), 0-65536. Default 0.
    #[arg(long)]
    pub lookahead: Option<usize>,
    /// Compute backend: cpu (the reference) or vulkan. Default cpu.
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// Vulkan device index (see `smoe-pipeline devices`). Default 0.
    #[arg(long)]
    pub device: Option<usize>,
}

/// How the prompt is run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    /// Chunks of --chunk-size tokens, layer by layer, each union expert read once.
    LayerMajor,
    /// One token at a time through the decode step (the reference replay).
    Serial,
}

impl PrefillMode {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PrefillMode::LayerMajor => "layer-major",
            PrefillMode::Serial => "serial",
        }
    }
}

/// Arguments of `serve`. Every flag overrides the config file key of the same name.
#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// TOML config file (see smoe.toml); without it, built-in defaults.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Vault to serve (default: the built-in tiny demo model).
    #[arg(long)]
    pub vault: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1:8080).
    #[arg(long)]
    pub listen: Option<String>,
    /// Model id to serve under (default: the vault directory name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Log filter (error, warn, info, debug, trace).
    #[arg(long)]
    pub log_level: Option<String>,
    /// Engine and I/O settings.
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Token streams kept with their KV caches for prefix reuse.
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// DeltaNet state snapshots each kept session holds (hybrid models), 0-64.
    #[arg(long)]
    pub state_snapshots: Option<usize>,
    /// Requests that may wait behind the running one (more get 429).
    #[arg(long)]
    pub max_queue: Option<usize>,
    /// Seconds in-flight requests get to finish after SIGTERM/Ctrl-C.
    #[arg(long)]
    pub shutdown_grace: Option<f64>,
    /// Largest request body, with an optional unit (larger gets 413).
    #[arg(long)]
    pub max_body_bytes: Option<ByteSize>,
    /// Seconds a request's head may take once its first byte arrived.
    #[arg(long)]
    pub header_read_timeout: Option<f64>,
    /// Seconds a request's body may take (slower gets 408).
    #[arg(long)]
    pub body_read_timeout: Option<f64>,
    /// Seconds a connection may sit without a request before it is closed.
    #[arg(long)]
    pub idle_timeout: Option<f64>,
    /// Open connections at once (more get 503).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;
    use crate::config::Config;

    /// What the help of `generate --FLAG` gives as the default (`... Default 8192.`).
    fn stated_default(flag: &str) -> String {
        let cli = Cli::command();
        let generate = cli.find_subcommand("generate").expect("generate");
        let arg = generate.get_arguments().find(|a| a.get_id() == flag).expect(flag);
        let help = arg.get_help().expect(flag).to_string();
        let (_, value) = help.rsplit_once("Default ").unwrap_or_else(|| panic!("--{flag}: {help}"));
        value.trim_end_matches('.').to_string()
    }

    /// The engine flags' help gives the defaults of the config keys they stand for.
    #[test]
    fn help_states_the_engine_defaults() {
        let c = Config::default();
        let numbers = ["max_context", "queue_depth", "chunk_size", "spec_depth", "lookahead", "device"];
        let values = [c.max_context, c.queue_depth, c.chunk_size, c.spec_depth, c.lookahead, c.device];
        assert_eq!(numbers.map(stated_default), values.map(|v| v.to_string()));
        assert_eq!(stated_default("io").parse(), Ok(c.io));
        assert_eq!(stated_default("backend").parse(), Ok(c.backend));
    }
}
