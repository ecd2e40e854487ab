//! `vulkan delta`: the gated delta rule's one-row step and its row-wise batched sibling
//! against the card's memory bandwidth, at Qwen3.5-397B-A17B's and Qwen3-Next-80B-A3B's
//! DeltaNet shapes.

use smoe_actors::vulkan::harness::{DeltaArgs, KernelHarness};
use smoe_actors::vulkan::VulkanContext;

use super::kernels::{fill, report, time};

/// (name, key heads, value heads, key dim, value dim).
const SHAPES: &[(&str, usize, usize, usize, usize)] =
    &[("qwen3.5-397b-a17b", 16, 64, 128, 128), ("qwen3-next-80b-a3b", 16, 32, 128, 128)];

/// Layers whose states are cycled so the L2 cache does not hold them (16 × 4 MiB at the
/// larger shape).
const LAYERS: usize = 16;

/// `vulkan delta [DEVICE]`: per shape, the step (one row per layer, the decode step) and
/// the batched kernel at 64 and 512 rows per layer (layer-major prefill). GB/s count the
/// recurrent state read and written once per row: what token-serial steps must move, so
/// the batched figures show what keeping the state on chip across a block's rows gains.
pub fn delta(device: usize) {
    let ctx = VulkanContext::new(device).expect("device");
    println!("device: {} ({})", ctx.info.name, ctx.info.driver);
    for &(name, nk, nv, dk, dv) in SHAPES {
        let width = 2 * nk * dk + 2 * nv * dv + 2 * nv;
        let max_rows = 512;
        let core = max_rows * width;
        let h = KernelHarness::new(ctx.clone(), core + max_rows * nv * dv, 16).expect("harness");
        h.write_act(0, &fill(max_rows * width, 5)).expect("inputs");
        let state = fill(nv * dk * dv, 6);
        let (a_log, dt_bias) = (fill(nv, 7), fill(nv, 8));
        let sets: Vec<_> =
            (0..LAYERS).map(|_| h.delta_state(&a_log, &dt_bias, &state).expect("state").0).collect();
        let state_bytes = (nv * dk * dv * 4) as f64;
        for rows in [1usize, 64, 512] {
            let a = DeltaArgs::packed([nk, nv, dk, dv], width, core, rows);
            let secs = time(&h, |r| {
                sets.iter().try_for_each(|s| a.record(r, h.delta_kernels(), s.clone(), rows > 1))
            }) / LAYERS as f64;
            let kind = if rows == 1 { "step".to_string() } else { format!("batched, {rows} rows") };
            report(&format!("delta rule {name} {kind}, per layer"), secs, 2.0 * state_bytes * rows as f64);
        }
    }
}
