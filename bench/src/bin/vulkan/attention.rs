//! `vulkan attention`: the attention kernels at Qwen3-30B-A3B's shape (32 query heads,
//! 4 KV heads, head_dim 128): the decode step (m=1, the split path) at a few contexts and
//! a layer-major prefill block from position 0 (the fused path), in µs per layer and GB/s
//! of the K and V bytes the rows attend to (each cached position once per layer).

use smoe_actors::vulkan::harness::{AttentionArgs, AttentionShape, KernelHarness};
use smoe_actors::vulkan::VulkanContext;

use super::kernels::{fill, time};

/// Qwen3-30B-A3B's attention heads.
pub const SHAPE: AttentionShape = AttentionShape { heads: 32, kv_heads: 4, head_dim: 128 };

/// Layers whose caches are cycled so the L2 cache does not hold them (8 × 16 MiB at a
/// 4096-position context).
const LAYERS: usize = 8;

/// `vulkan attention [DEVICE] [PREFILL_TOKENS] [CONTEXT ...]`: decode at each CONTEXT
/// (default 512 and 4096) and prefill of PREFILL_TOKENS (default 512; 0: none) from
/// position 0; smaller sizes keep a CPU driver (lavapipe) quick.
pub fn attention(device: usize, prefill: usize, contexts: &[usize]) {
    let ctx = VulkanContext::new(device).expect("device");
    println!("device: {} ({})", ctx.info.name, ctx.info.driver);
    let sh = SHAPE;
    let (qd, kvd) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    let capacity = contexts.iter().copied().max().unwrap_or(0).max(prefill);
    let chunks = AttentionShape::partial_chunks(capacity);
    // Query and output rows for the larger of the prefill block and a decode step.
    let rows = prefill.max(1);
    let (out, part) = (rows * qd, 2 * rows * qd);
    let h = KernelHarness::new(ctx.clone(), part + sh.partial_floats(1, capacity), 16).expect("harness");
    h.write_act(0, &fill(rows * qd, 3)).expect("queries");
    let sets: Vec<_> = (0..LAYERS as u64)
        .map(|l| {
            let (k, v) = (fill(capacity * kvd, 10 + 2 * l), fill(capacity * kvd, 11 + 2 * l));
            h.kv_cache(&k, &v).expect("cache")
        })
        .collect();
    let args = |start: usize, tokens: usize| AttentionArgs {
        shape: sh,
        q_off: 0,
        out_off: out as u32,
        start: start as u32,
        pos_word: 0,
        tokens: tokens as u32,
        part_off: part as u32,
        part_chunks: chunks as u32,
    };
    let kv_bytes = |positions: usize| (positions * kvd * 4 * 2) as f64;
    let per_layer = |a: AttentionArgs| {
        h.write_position(&a).expect("position");
        let k = h.attention_kernels();
        time(&h, |r| sets.iter().try_for_each(|s| a.record(r, k, s.clone(), a.split_by_default())))
            / LAYERS as f64
    };
    for &n in contexts {
        let secs = per_layer(args(n - 1, 1));
        println!(
            "attention decode m=1, context {n}, per layer: {:.1} us, {:.0} GB/s of K+V",
            secs * 1e6,
            kv_bytes(n) / secs / 1e9
        );
    }
    if prefill > 0 {
        let secs = per_layer(args(0, prefill));
        // Each row's scores and weighted values: 4 flops per (row, position, dim).
        let pairs = (prefill * (prefill + 1) / 2) as f64;
        let flops = 4.0 * pairs * (sh.heads * sh.head_dim) as f64;
        println!(
            "attention prefill m={prefill} from 0, per layer: {:.1} us, {:.0} GB/s of K+V, {:.0} GFLOP/s",
            secs * 1e6,
            kv_bytes(prefill) / secs / 1e9,
            flops / secs / 1e9
        );
    }
}
