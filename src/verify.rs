//! `smoe-pipeline verify`: the identity gate as a command. Every prompt is run by
//! token-serial replay and by layer-major prefill at each chunk size; the logits of
//! every generated position must be bitwise identical and the greedy tokens equal.

use std::path::Path;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use smoe_actors::contract::ForwardPass;
use smoe_actors::engine::{EngineOptions, RingSize, VramSize, DEFAULT_RING_BYTES};
use smoe_actors::executor::Executor;
use smoe_actors::generation::{generate, GenerateRequest};
use smoe_actors::sampler::SamplingParams;
use smoe_actors::streamer::StreamerOptions;

use crate::cli::VerifyArgs;
use crate::tokenizer;

/// Length of the long prompt in the default set (at least 1000 tokens).
const LONG_PROMPT: usize = 1037;

/// A greedy run's logits (one row per generated token) and token ids.
struct Run {
    logits: Vec<f32>,
    ids: Vec<u32>,
}

fn greedy(fwd: &mut Executor, prompt: &[u32], tokens: usize) -> Result<Run> {
    let mut kv = fwd.new_kv()?;
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        spec_depth: 0,
        logits: true,
    };
    let mut run = Run { logits: Vec::new(), ids: Vec::new() };
    generate(
        fwd,
        &mut kv,
        &req,
        || false,
        |id, logits| {
            run.ids.push(id);
            run.logits.extend_from_slice(logits);
            true
        },
    )?;
    Ok(run)
}

/// The default prompt set: lengths around every chunk boundary plus one long prompt,
/// with deterministic pseudo-random ids.
fn default_prompts(chunks: &[usize], vocab: usize) -> Vec<Vec<u32>> {
    let mut lens = vec![1, 2, LONG_PROMPT];
    for &c in chunks {
        lens.extend([c.saturating_sub(1), c, c + 1, c + 2, 2 * c + 1]);
    }
    lens.retain(|&l| l >= 1);
    lens.sort_unstable();
    lens.dedup();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    lens.into_iter().map(|n| (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()).collect()
}

/// Reads a prompt file: one prompt per line, a JSON array of token ids or text
/// (tokenized with `vault`'s tokenizer).
pub(crate) fn read_prompts(path: &Path, vault: &Path) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut tok = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let ids = if line.trim_start().starts_with('[') {
            serde_json::from_str::<Vec<u32>>(line)
                .with_context(|| format!("{}:{}: not a JSON array of token ids", path.display(), i + 1))?
        } else {
            if tok.is_none() {
                tok = Some(tokenizer::load(vault)?);
            }
            tokenizer::encode(tok.as_ref().expect("loaded above"), line)?
        };
        if ids.is_empty() {
            bail!("{}:{}: empty prompt", path.display(), i + 1);
        }
        out.push(ids);
    }
    Ok(out)
}

/// Runs `verify`; fails if any comparison differs.
pub fn run(args: &VerifyArgs) -> Result<()> {
    if args.chunk_sizes.contains(&0) {
        bail!("--chunk-sizes: every chunk size must be at least 1");
    }
    if args.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let probe = smoe_actors::vault::Vault::open(&args.vault)?;
    let vocab = probe.manifest().model.vocab_size;
    drop(probe);
    let prompts = match &args.prompts {
        Some(p) => read_prompts(p, &args.vault)?,
        None => default_prompts(&args.chunk_sizes, vocab),
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    if let Some(n) = args.ring_slots {
        crate::settings::RING_SLOTS.check_usize(n)?;
    }
    if let Some(n) = args.moe_front_groups {
        crate::settings::MOE_FRONT_GROUPS.check(u64::from(n))?;
    }
    let opts = EngineOptions {
        max_context: longest + args.tokens,
        ring: args.ring_slots.map_or(RingSize::Bytes(DEFAULT_RING_BYTES), RingSize::Slots),
        streamer: StreamerOptions { io: args.io, ..Default::default() },
        vram: VramSize::Bytes(args.vram_bytes.map_or(0, |b| b.0)),
        moe_front_groups: args.moe_front_groups,
        ..Default::default()
    };
    // Token-serial replay (blocks of one) and one layer-major pass per chunk size, all
    // on the same backend and sharing one engine's ring.
    let (engine, mut serial) = Executor::open(&args.vault, &opts, args.backend, args.device, 1)?;
    let mut layer_major = Vec::new();
    for &chunk in &args.chunk_sizes {
        layer_major.push(serial.sibling(&engine, chunk)?);
    }
    if engine.model.max_context < longest + args.tokens {
        bail!(
            "the longest prompt ({longest} tokens) plus {} generated tokens exceeds the model's context ({})",
            args.tokens,
            engine.model.max_context
        );
    }
    println!("{:>8} {:>6} {:>14} {:>10} {:>12}", "prompt", "chunk", "logits", "tokens", "first diff");
    let mut failures = 0;
    for prompt in &prompts {
        let reference = greedy(&mut serial, prompt, args.tokens)?;
        for (&chunk, fwd) in args.chunk_sizes.iter().zip(layer_major.iter_mut()) {
            let run = greedy(fwd, prompt, args.tokens)?;
            let same_logits = reference.logits.len() == run.logits.len()
                && reference.logits.iter().zip(&run.logits).all(|(a, b)| a.to_bits() == b.to_bits());
            let same_ids = reference.ids == run.ids;
            let first = reference.ids.iter().zip(&run.ids).position(|(a, b)| a != b);
            let max_diff =
                reference.logits.iter().zip(&run.logits).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            let logits = if same_logits { "identical".to_string() } else { format!("max|d|={max_diff:.2e}") };
            let tokens = if same_ids { "identical" } else { "DIFFER" };
            let diff = first.map_or("-".to_string(), |p| p.to_string());
            println!("{:>8} {:>6} {:>14} {:>10} {:>12}", prompt.len(), chunk, logits, tokens, diff);
            if !same_logits || !same_ids {
                failures += 1;
            }
        }
    }
    let total = prompts.len() * args.chunk_sizes.len();
    println!("{} passed, {} failed", total - failures, failures);
    if failures > 0 {
        bail!("{failures} of {total} layer-major runs differ from token-serial replay");
    }
    Ok(())
}
