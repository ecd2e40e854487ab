//! `vulkan route`: the router's ranking kernels (`shaders/route.comp`) by expert count:
//! one token (the plain ranking, and `route_table`, a decode step's ranking with its
//! tier tables when the fused front is off) and a 512-token prefill block (a workgroup a
//! token), at Qwen3-MoE's 128 experts, 256, and the hybrids' 512 (top-10).

use smoe_actors::vulkan::harness::{KernelHarness, RouteTableArgs};
use smoe_actors::vulkan::VulkanContext;

use super::kernels::{fill, time};

/// Tokens of the prefill block.
const BLOCK: u32 = 512;

/// `vulkan route [DEVICE]`: µs a dispatch, each run back to back with its barriers.
pub fn route(device: usize) {
    let ctx = VulkanContext::new(device).expect("device");
    println!("device: {} ({})", ctx.info.name, ctx.info.driver);
    for (ne, k) in [(128u32, 8u32), (256, 8), (512, 10)] {
        let (out, stride) = (BLOCK * ne, ne + k + 1);
        let h = KernelHarness::new(ctx.clone(), (out + BLOCK * stride) as usize, 256).expect("harness");
        h.write_act(0, &fill((BLOCK * ne) as usize, 3)).expect("logits");
        for rows in [1, BLOCK] {
            let secs = time(&h, h.record_route(ne, k, k, true, rows, out));
            println!("route, {ne} experts, top-{k}, {rows} token(s): {:.2} us", secs * 1e6);
        }
        // Every expert in tier buffer 0.
        let slots: Vec<u32> = (0..ne).flat_map(|e| [0, e << 12]).collect();
        let a = RouteTableArgs {
            ne,
            k,
            ranks: k,
            norm: true,
            in_off: 0,
            out_off: out,
            out_stride: stride,
            slot_off: 0,
            buffers: 1,
            tab_out: 0,
            groups: [1, 1],
            io_out: 0,
        };
        let record = h.record_route_table(a, &slots).expect("route_table").record;
        println!("route_table, {ne} experts, top-{k}: {:.2} us", time(&h, record) * 1e6);
    }
}
