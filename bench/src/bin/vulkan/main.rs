//! Vulkan backend measurements.
//!
//! `vulkan kernels [DEVICE] [TYPE ...] [TUNING ...] [SHAPE]`: per-kernel figures at a
//! model's expert shape (`SHAPES`: Qwen3-30B-A3B by default, hidden 2048, expert
//! intermediate 768; `qwen3-235b-a22b`: 4096, 1536; 8 experts per token) for each matmul
//! tuning given (`LANES,ROWS,UNROLL[,ROWS_DOWN[,UNROLL_DENSE]]`; else those in `TUNINGS`)
//! and each weight type named (`bf16`, `q4_k`, ...; else those in `TYPES`; block formats
//! hold reference-quantised weights and their GB/s count quantised bytes): the memory-read
//! ceiling and the chained-dispatch floor (also with a change of kernel at every
//! dispatch); achieved GB/s of the m=1 expert FFN (a token's 8 experts in one gate/up +
//! SiLU and one down dispatch, as the executor records them, and each half alone) and of
//! the m=1 dense matvec, with weights in device-local memory and (first tuning) in
//! host-visible memory where ring slots live, and with the routing data in host memory;
//! and GFLOP/s of the batched expert FFN at 64 tokens per expert. Enough distinct weights
//! are cycled that the L2 cache does not hold them.
//!
//! `vulkan delta [DEVICE]`: the gated delta rule's step and its batched sibling (64 and
//! 512 rows) at Qwen3.5-397B-A17B's and Qwen3-Next-80B-A3B's DeltaNet shapes, in GB/s of
//! the recurrent state read and written once per row.
//!
//! `vulkan attention [DEVICE] [PREFILL_TOKENS] [CONTEXT ...]`: the attention kernels at
//! Qwen3-30B-A3B's shape (32 query heads, 4 KV heads, head_dim 128): the decode step at
//! each CONTEXT (default 512 and 4096) and a prefill block of PREFILL_TOKENS (default 512;
//! 0: none) from position 0, in µs per layer and GB/s of K+V read (GFLOP/s for prefill).
//!
//! `vulkan chain [DEVICE]`: what a dependent dispatch costs: a chain of m=1 matvecs
//! ordered by pipeline barriers against completion counts in device memory, and with an
//! RMSNorm of each link's input as a dispatch of its own or folded into the link
//! (`chain.rs`).
//!
//! `vulkan moe [DEVICE] [EXPERTS] [LAYERS] [GROUPS ...]`: a decode step's MoE block (norm,
//! router, ranking, gate/up, down + combine) as one dispatch of GROUPS resident
//! workgroups with grid barriers against five dependent dispatches (`moe.rs`).
//!
//! `vulkan route [DEVICE]`: the router's ranking kernels (one token, its decode-step
//! form with the tier tables, and a 512-token block) at 128, 256 and 512 experts
//! (`route.rs`).
//!
//! `vulkan stats [DEVICE] [TUNING ...]`: what the driver reports about each compiled
//! matmul-family kernel and the decode step's other kernels (registers, spill/local
//! memory, shared memory, ... as the driver names them) through
//! VK_KHR_pipeline_executable_properties, for the default tuning and any given ones,
//! specialised as the backend specialises them. vulkano does not expose
//! `CAPTURE_STATISTICS`, so these pipelines are created with raw calls. A device without
//! the extension (lavapipe) gets a one-line error and exit status 2.
//!
//! `vulkan diag VAULT [DEVICE]`: which ring sizes, block sizes and expert paths
//! reproduce token-serial logits bit for bit, and the CPU backend's distance.
//!
//! `vulkan e2e VAULT [PROMPT] [DECODE] [CHUNK] [STREAM_SLOTS] [DEVICE] [MODES]`: prefill
//! and decode tokens/s, CPU vs Vulkan, with every expert held in the ring (`resident`)
//! and with a ring of STREAM_SLOTS slots (`streamed` from the vault); MODES is
//! `resident`, `streamed` or `both` (the default); an optional 8th argument picks the
//! expert path (`zero-copy`, `staged-prefill`, `staged`).

mod attention;
mod chain;
mod delta;
mod e2e;
mod kernels;
mod moe;
mod raw;
mod route;
mod stats;

use kernels::{kernels, SHAPES, TUNINGS, TUNING_SYNTAX, TYPES};
use smoe_actors::vulkan::harness::MatmulTuning;
use smoe_proto::DType;

/// Prints `error: MSG` and ends the program with status `code`.
fn fail(code: i32, msg: String) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(code)
}

/// Weight types named after the device (`args[2..]`, those that are a type's name).
fn parse_types(args: &[String]) -> Vec<DType> {
    args.iter().skip(2).filter_map(|t| DType::from_name(t)).collect()
}

/// Tunings given after the device (`args[2..]`, besides weight types), as
/// [`TUNING_SYNTAX`] writes them (ROWS_DOWN defaults to ROWS, the fields after it to the
/// backend's defaults); a malformed one ends the program with status 2.
fn parse_tunings(args: &[String]) -> Vec<MatmulTuning> {
    let d = MatmulTuning::default();
    args.iter()
        .skip(2)
        .filter(|t| DType::from_name(t).is_none() && !SHAPES.iter().any(|s| s.name == t.as_str()))
        .map(|t| {
            let v: Result<Vec<u32>, _> = t.split(',').map(str::parse).collect();
            let v = match v {
                Ok(v) if (3..=8).contains(&v.len()) => v,
                _ => fail(2, format!("tuning `{t}` is not {TUNING_SYNTAX} (numbers)")),
            };
            let at = |i: usize, or: u32| v.get(i).copied().unwrap_or(or);
            MatmulTuning {
                lanes: v[0],
                rows_m1: v[1],
                unroll: v[2],
                rows_down: at(3, v[1]),
                unroll_dense: at(4, d.unroll_dense),
                rows_wide: at(5, d.rows_wide),
                rows_batched: at(6, d.rows_batched),
                rows_batched_blocks: at(7, d.rows_batched_blocks),
            }
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("kernels") => {
            // Optional weight types and tunings after the device: q4_k LANES,ROWS,UNROLL ...
            let picked = parse_tunings(&args);
            let tunings = if picked.is_empty() { TUNINGS } else { &picked[..] };
            let named = parse_types(&args);
            let types = if named.is_empty() { TYPES } else { &named[..] };
            let shape =
                args.iter().skip(2).find_map(|a| SHAPES.iter().find(|s| s.name == a)).unwrap_or(&SHAPES[0]);
            kernels(args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0), tunings, types, shape)
        }
        Some("attention") => {
            let num = |i: usize, what: &str| {
                args[i].parse().unwrap_or_else(|_| fail(2, format!("{what} `{}` is not a number", args[i])))
            };
            let device = if args.len() > 1 { num(1, "DEVICE") } else { 0 };
            let prefill = if args.len() > 2 { num(2, "PREFILL_TOKENS") } else { 512 };
            let mut contexts: Vec<usize> = (3..args.len()).map(|i| num(i, "CONTEXT")).collect();
            if contexts.contains(&0) {
                fail(2, "a CONTEXT must be at least 1".into());
            }
            if contexts.is_empty() {
                contexts = vec![512, 4096];
            }
            attention::attention(device, prefill, &contexts)
        }
        Some("chain") => chain::chain(args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0)),
        Some("moe") => {
            let num = |i: usize, what: &str, or: usize| {
                args.get(i).map_or(or, |a| {
                    a.parse().unwrap_or_else(|_| fail(2, format!("{what} `{a}` is not a number")))
                })
            };
            let groups: Vec<u32> = (4..args.len())
                .map(|i| match u32::try_from(num(i, "GROUPS", 0)) {
                    Ok(g) if g > 0 => g,
                    _ => fail(2, format!("GROUPS `{}` must be 1 to {}", args[i], u32::MAX)),
                })
                .collect();
            moe::moe(num(1, "DEVICE", 0), num(2, "EXPERTS", 128), num(3, "LAYERS", 3), &groups)
        }
        Some("delta") => delta::delta(args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0)),
        Some("route") => route::route(args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0)),
        Some("stats") => {
            let device = args.get(1).map_or(Ok(0), |s| s.parse());
            let device = device.unwrap_or_else(|_| fail(2, format!("DEVICE `{}` is not a number", args[1])));
            stats::stats(device, &parse_tunings(&args))
        }
        Some("e2e") if args.len() >= 2 => e2e::e2e(&args[1..]),
        Some("diag") if args.len() >= 2 => e2e::diag(&args[1..]),
        _ => {
            let shapes: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
            eprintln!(
                "usage: vulkan kernels [DEVICE] [TYPE ...] [{TUNING_SYNTAX} ...] [{}] | vulkan attention [DEVICE] [PREFILL_TOKENS] [CONTEXT ...] | vulkan chain [DEVICE] | vulkan moe [DEVICE] [EXPERTS] [LAYERS] [GROUPS ...] | vulkan delta [DEVICE] | vulkan route [DEVICE] | vulkan stats [DEVICE] [{TUNING_SYNTAX} ...] | vulkan e2e VAULT [PROMPT] [DECODE] [CHUNK] [STREAM_SLOTS] [DEVICE] [MODES] [PATH] | vulkan diag VAULT [DEVICE]",
                shapes.join("|")
            );
            std::process::exit(2);
        }
    }
}
