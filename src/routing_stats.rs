//! Routing statistics of a vault on a prompt set, measured by running the engine: each
//! prompt goes through the CPU reference one token at a time with the claim trace on
//! (a single token's claims are its top-k experts in rank order) and a speculative
//! depth of k (the router's bets are its gate ranks k+1..2k, recorded here instead of
//! read). Nothing here routes: the experts are the ones the engine claimed and ranked.
//!
//! Reported per MoE layer: the spread of expert load (coefficient of variation, and the
//! busiest and idlest expert against the mean), the adjacent-token top-k overlap, the
//! coverage of the next token's top-k by the current token's top-2k, and the mean union
//! of consecutive chunks of 16, 64 and 256 tokens (what a layer-major prefill chunk of
//! that size claims: its routing is byte-identical to this replay).

use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use smoe_actors::contract::ForwardPass;
use smoe_actors::cpu::CpuBackend;
use smoe_actors::engine::{Engine, EngineOptions, RingSize, DEFAULT_RING_BYTES};
use smoe_actors::executor::Pass;
use smoe_actors::ring::memory::HostAllocator;
use smoe_proto::{ExpertHandle, ExpertKey, ExpertSource, VaultError};

/// Chunk sizes whose unions are reported.
pub const CHUNK_SIZES: [usize; 3] = [16, 64, 256];

/// Most bytes of ring the measurement takes to hold every expert (beyond it, the
/// engine's default ring).
const RING_CAP: u64 = 8 << 30;

/// The ring, with the router's bets recorded instead of read.
struct BetRecorder {
    ring: Arc<dyn ExpertSource>,
    bets: Mutex<Vec<ExpertKey>>,
}

impl ExpertSource for BetRecorder {
    fn claim(&self, key: ExpertKey) -> Result<ExpertHandle, VaultError> {
        self.ring.claim(key)
    }
    fn announce(&self, key: ExpertKey) -> bool {
        self.ring.announce(key)
    }
    fn prefetch(&self, key: ExpertKey) {
        self.bets.lock().unwrap_or_else(|e| e.into_inner()).push(key);
    }
    fn withdraw(&self, key: ExpertKey) {
        self.ring.withdraw(key)
    }
}

/// One MoE layer's statistics.
#[derive(Clone, Debug, Serialize)]
pub struct LayerStats {
    /// Decoder layer.
    pub layer: usize,
    /// Standard deviation of the per-expert top-k counts over their mean.
    pub load_cv: f64,
    /// The busiest expert's count over the mean.
    pub load_max: f64,
    /// The idlest expert's count over the mean.
    pub load_min: f64,
    /// Mean fraction of a token's top-k that the next token also uses.
    pub overlap: f64,
    /// Mean fraction of the next token's top-k within the current token's top-2k.
    pub coverage: f64,
    /// Mean union size of consecutive chunks of [`CHUNK_SIZES`] tokens (None when no
    /// prompt holds a whole chunk).
    pub unions: Vec<Option<f64>>,
}

/// The statistics of a vault on a prompt set.
#[derive(Clone, Debug, Serialize)]
pub struct RoutingStats {
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts routed per token.
    pub top_k: usize,
    /// Prompts run.
    pub prompts: usize,
    /// Tokens run.
    pub tokens: usize,
    /// Chunk sizes of [`LayerStats::unions`].
    pub chunk_sizes: Vec<usize>,
    /// Per MoE layer.
    pub layers: Vec<LayerStats>,
}

/// `n` prompts of `len` uniformly random token ids (seeded): no locality in the ids, so
/// whatever locality the routing shows comes from the model.
pub fn random_prompts(vocab: usize, n: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| (0..len).map(|_| rng.random_range(0..vocab as u32)).collect()).collect()
}

/// Each token's ranked experts (top-k, then ranks k+1..2k) for each MoE layer:
/// `[layer][token][rank]`.
type Ranked = Vec<Vec<Vec<u16>>>;

/// Runs `prompt` token by token; returns its ranked experts per MoE layer.
fn route_prompt(
    pass: &mut Pass<CpuBackend>,
    bets: &BetRecorder,
    moe_layers: &[usize],
    prompt: &[u32],
) -> Result<Ranked> {
    let mut kv = pass.new_kv()?;
    let mut out: Ranked = vec![Vec::with_capacity(prompt.len()); moe_layers.len()];
    for &tok in prompt {
        pass.forward(&mut kv, &[tok], false)?;
        let claims = pass.take_trace();
        let bet_keys = std::mem::take(&mut *bets.bets.lock().unwrap_or_else(|e| e.into_inner()));
        for (slot, &layer) in moe_layers.iter().enumerate() {
            let mut ranked: Vec<u16> =
                claims.iter().filter(|c| c.layer == layer).map(|c| c.expert as u16).collect();
            ranked.extend(bet_keys.iter().filter(|b| b.layer as usize == layer).map(|b| b.expert));
            out[slot].push(ranked);
        }
    }
    Ok(out)
}

/// Opens `vault` on the CPU reference and measures its routing on `prompts`.
pub fn measure(
    vault: &Path,
    prompts: &[Vec<u32>],
    progress: &indicatif::ProgressBar,
) -> Result<RoutingStats> {
    if prompts.is_empty() {
        bail!("no prompts to measure the routing on");
    }
    let probe = smoe_actors::vault::Vault::open(vault)?;
    let stride = probe.max_blob_stride();
    let cfg = probe.manifest().model.clone();
    drop(probe);
    let all = (cfg.moe_layers().len() * cfg.num_experts) as u64;
    let ring = if all * stride <= RING_CAP {
        RingSize::Slots(all as usize)
    } else {
        RingSize::Bytes(DEFAULT_RING_BYTES)
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let opts = EngineOptions { max_context: longest, ring, ..Default::default() };
    let engine = Engine::open(vault, &opts, &HostAllocator)?;
    let bets = Arc::new(BetRecorder { ring: engine.ring.clone(), bets: Mutex::new(Vec::new()) });
    let backend = CpuBackend::new(engine.model.clone(), 1);
    let mut pass = Pass::new(backend, engine.model.clone(), bets.clone(), 1, engine.ring.layer_slots());
    let k = cfg.num_experts_per_tok;
    pass.set_spec_depth(k);
    pass.enable_trace();
    let moe_layers = cfg.moe_layers();
    let mut routed: Vec<Ranked> = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        engine.model.check_tokens(prompt).map_err(|e| anyhow::anyhow!("prompt: {e}"))?;
        routed.push(route_prompt(&mut pass, &bets, &moe_layers, prompt)?);
        progress.inc(prompt.len() as u64);
    }
    let layers = moe_layers
        .iter()
        .enumerate()
        .map(|(slot, &layer)| {
            let per_prompt: Vec<&Vec<Vec<u16>>> = routed.iter().map(|r| &r[slot]).collect();
            layer_stats(layer, &per_prompt, cfg.num_experts, k)
        })
        .collect();
    Ok(RoutingStats {
        experts: cfg.num_experts,
        top_k: k,
        prompts: prompts.len(),
        tokens: prompts.iter().map(Vec::len).sum(),
        chunk_sizes: CHUNK_SIZES.to_vec(),
        layers,
    })
}

/// The statistics of one layer from each prompt's ranked experts.
fn layer_stats(layer: usize, prompts: &[&Vec<Vec<u16>>], experts: usize, k: usize) -> LayerStats {
    let mut counts = vec![0u64; experts];
    let (mut overlap, mut coverage, mut pairs) = (0.0, 0.0, 0usize);
    let mut unions = vec![(0usize, 0usize); CHUNK_SIZES.len()];
    let mut seen = vec![false; experts];
    for tokens in prompts {
        for t in tokens.iter() {
            t[..k].iter().for_each(|&e| counts[e as usize] += 1);
        }
        for w in tokens.windows(2) {
            let next = &w[1][..k];
            overlap += next.iter().filter(|e| w[0][..k].contains(e)).count() as f64 / k as f64;
            coverage += next.iter().filter(|e| w[0].contains(e)).count() as f64 / k as f64;
            pairs += 1;
        }
        for (n, acc) in CHUNK_SIZES.iter().zip(unions.iter_mut()) {
            for chunk in tokens.chunks_exact(*n) {
                seen.fill(false);
                chunk.iter().flat_map(|t| &t[..k]).for_each(|&e| seen[e as usize] = true);
                acc.0 += seen.iter().filter(|s| **s).count();
                acc.1 += 1;
            }
        }
    }
    let mean = counts.iter().sum::<u64>() as f64 / experts as f64;
    let var = counts.iter().map(|&c| (c as f64 - mean).powi(2)).sum::<f64>() / experts as f64;
    let rel = |c: Option<&u64>| c.map_or(0.0, |&c| c as f64 / mean.max(f64::MIN_POSITIVE));
    LayerStats {
        layer,
        load_cv: var.sqrt() / mean.max(f64::MIN_POSITIVE),
        load_max: rel(counts.iter().max()),
        load_min: rel(counts.iter().min()),
        overlap: overlap / pairs.max(1) as f64,
        coverage: coverage / pairs.max(1) as f64,
        unions: unions.iter().map(|&(sum, n)| (n > 0).then(|| sum as f64 / n as f64)).collect(),
    }
}

impl RoutingStats {
    /// The statistics as a text table, one row per MoE layer and their mean.
    pub fn table(&self) -> String {
        let mut s = format!(
            "routing of {} prompts, {} tokens ({} experts, top-{}; coverage by the top-{})\n",
            self.prompts,
            self.tokens,
            self.experts,
            self.top_k,
            (2 * self.top_k).min(self.experts)
        );
        s += &format!(
            "{:>6} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "layer", "load cv", "max/mean", "min/mean", "overlap", "coverage"
        );
        for n in &self.chunk_sizes {
            s += &format!(" {:>9}", format!("union@{n}"));
        }
        s.push('\n');
        let mean = |f: &dyn Fn(&LayerStats) -> f64| {
            self.layers.iter().map(f).sum::<f64>() / self.layers.len().max(1) as f64
        };
        let mut rows: Vec<(String, [f64; 5], Vec<Option<f64>>)> = self
            .layers
            .iter()
            .map(|l| {
                (
                    l.layer.to_string(),
                    [l.load_cv, l.load_max, l.load_min, l.overlap, l.coverage],
                    l.unions.clone(),
                )
            })
            .collect();
        let union_mean = (0..self.chunk_sizes.len())
            .map(|i| {
                let v: Vec<f64> = self.layers.iter().filter_map(|l| l.unions[i]).collect();
                (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
            })
            .collect();
        rows.push((
            "mean".into(),
            [
                mean(&|l| l.load_cv),
                mean(&|l| l.load_max),
                mean(&|l| l.load_min),
                mean(&|l| l.overlap),
                mean(&|l| l.coverage),
            ],
            union_mean,
        ));
        for (name, v, unions) in rows {
            s += &format!(
                "{name:>6} {:>8.3} {:>8.2} {:>8.2} {:>7.1}% {:>7.1}%",
                v[0],
                v[1],
                v[2],
                100.0 * v[3],
                100.0 * v[4]
            );
            for u in unions {
                s += &match u {
                    Some(u) => format!(" {u:>9.1}"),
                    None => format!(" {:>9}", "-"),
                };
            }
            s.push('\n');
        }
        s
    }
}
