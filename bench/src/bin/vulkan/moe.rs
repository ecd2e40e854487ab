//! `vulkan moe [DEVICE] [EXPERTS] [LAYERS] [GROUPS ...]`: a decode step's MoE block
//! (RMSNorm, router, ranking, expert gate/up + SiLU, down + combine + residual; m=1,
//! bf16, Qwen3-30B-A3B's hidden 2048 and expert intermediate 768, top 8 of EXPERTS,
//! default 128) fused into one dispatch of GROUPS resident workgroups meeting at two grid
//! barriers (`shaders/moe_block.comp`; by default one and two an SM where the driver
//! reports its SM count, else 132, 264 and 528), against the same per-row code as five dependent
//! dispatches ordered by pipeline barriers, as the executor records a device-routed
//! block. Blocks cycle through LAYERS layers of distinct weights (default 3: 3.6 GB at
//! 128 experts, more than the L2 cache), each block routing its own input. Both orderings'
//! final residuals are checked byte for byte, and the first block against an f64
//! reference on the host; then µs a block and GB/s of the weights a block reads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::CommandBuffer;
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::compute::ComputePipelineCreateInfo;
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint, PipelineShaderStageCreateInfo};
use vulkano::shader::ShaderModule;
use vulkano::sync::fence::{Fence, FenceCreateInfo};
use vulkano::sync::{AccessFlags, PipelineStages};

use smoe_actors::vulkan::harness::{device_buffer, upload};
use smoe_actors::vulkan::VulkanContext;

use crate::fail;
use crate::kernels::weights;
use crate::raw;

/// Hidden size (`shaders/moe_block.comp`'s H).
const H: usize = 2048;
/// Expert intermediate size (its I).
const I: usize = 768;
/// Experts per token (its K).
const K: usize = 8;
/// Experts the kernel ranks at most.
const MAX_E: usize = 256;
/// Where the io buffer holds the ranked experts (after x, xn, the logits and h).
const IO_SEL: usize = 2 * H + MAX_E + K * I;
/// Floats of the io buffer: the above, the ranked experts and their weights.
const IO_LEN: usize = IO_SEL + 2 * K;
/// The kernel's `phase` that runs the whole block.
const PERSIST: u32 = 5;
/// Blocks per timed command buffer.
const BLOCKS: usize = 48;

/// The push constants of `shaders/moe_block.comp`.
#[derive(Clone, Copy, Default, vulkano::buffer::BufferContents)]
#[repr(C)]
struct Params {
    layer4: u32,
    ne: u32,
    phase: u32,
    bar: u32,
    stop: u32,
}

/// How a block's stages are ordered.
#[derive(Clone, Copy, PartialEq)]
enum Order {
    /// Five dispatches with a pipeline barrier after each (the executor's way).
    Phases,
    /// One dispatch of this many workgroups with grid barriers.
    Persist(u32),
    /// [`Order::Persist`] returning after stage `stop` (1: the norm; 2: the
    /// router and its grid barrier; 3: the ranking, gate/up and its grid barrier): what
    /// the block's prefixes take (wrong results; timed only).
    Prefix(u32, u32),
}

impl Order {
    /// How the output names this ordering.
    fn label(self) -> String {
        match self {
            Order::Phases => "five dispatches, pipeline barriers".into(),
            Order::Persist(g) => format!("one dispatch of {g} workgroups, two grid barriers"),
            Order::Prefix(g, stop) => format!(
                "one dispatch of {g} workgroups, only up to {}",
                ["", "the norm", "the router's grid barrier", "the gate/up's grid barrier"][stop as usize]
            ),
        }
    }
}

/// bf16 bits of `n` of the tests' pseudo-random weights (rounded toward zero).
fn bf16_fill(n: usize, seed: u64) -> Vec<u16> {
    weights(seed).take(n).map(|v| (v.to_bits() >> 16) as u16).collect()
}

/// The value of bf16 bits `b`.
fn bf16(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// The residual before the first block.
fn initial_x() -> Vec<f32> {
    (0..H).map(|i| ((i % 97) as f32 - 48.0) / 48.0).collect()
}

/// The pipeline, one weight buffer per layer and the shared buffers.
struct Block {
    ctx: Arc<VulkanContext>,
    module: Arc<ShaderModule>,
    pipeline: Arc<ComputePipeline>,
    /// Per layer: its weights, io, the barrier counts and the norm weights.
    sets: Vec<Arc<DescriptorSet>>,
    /// The kernel's io buffer (`IO_LEN` floats).
    io: Subbuffer<[u8]>,
    /// The grid barriers' counts, two a block.
    counts: Subbuffer<[u32]>,
    /// Experts.
    ne: usize,
    /// Layer 0's weights on the host (the reference).
    layer0: Vec<u16>,
    /// The RMSNorm weights.
    norm: Vec<f32>,
}

impl Block {
    /// The kernel and `layers` layers of `ne` experts' pseudo-random weights on the device.
    fn new(ctx: Arc<VulkanContext>, ne: usize, layers: usize) -> Block {
        let d = &ctx.device;
        let (module, layout) = raw::module_and_layout(&ctx, "moe_block");
        let stage = PipelineShaderStageCreateInfo::new(module.entry_point("main").expect("main"));
        let pipeline = ComputePipeline::new(
            d.clone(),
            None,
            ComputePipelineCreateInfo::stage_layout(stage, layout.clone()),
        )
        .expect("pipeline");
        let per_layer = ne * H + ne * 3 * I * H;
        let bytes = (per_layer * 2) as u64;
        if bytes > ctx.info.max_storage_buffer_range {
            fail(
                2,
                format!(
                    "a layer of {ne} experts is {bytes} bytes, more than this device binds at once ({}); name at most {} EXPERTS",
                    ctx.info.max_storage_buffer_range,
                    ctx.info.max_storage_buffer_range / ((H + 3 * I * H) * 2) as u64
                ),
            );
        }
        let norm: Vec<f32> = (0..H).map(|i| 0.5 + (i % 7) as f32 / 8.0).collect();
        let dev = |data: &[u8]| {
            let buf =
                device_buffer::<u8>(&ctx, data.len() as u64, BufferUsage::STORAGE_BUFFER).expect("buffer");
            upload(&ctx, &buf, data).expect("upload");
            buf
        };
        let nw = dev(bytemuck::cast_slice(&norm));
        let io = dev(bytemuck::cast_slice(&vec![0f32; IO_LEN]));
        let counts = device_buffer::<u32>(
            &ctx,
            (2 * BLOCKS) as u64,
            BufferUsage::STORAGE_BUFFER | BufferUsage::TRANSFER_DST,
        )
        .expect("counts");
        let mut layer0 = Vec::new();
        let sets = (0..layers)
            .map(|l| {
                let w = bf16_fill(per_layer, 11 + l as u64);
                let buf = dev(bytemuck::cast_slice(&w));
                if l == 0 {
                    layer0 = w;
                }
                DescriptorSet::new(
                    ctx.descriptors.clone(),
                    pipeline.layout().set_layouts()[0].clone(),
                    [
                        WriteDescriptorSet::buffer(0, buf),
                        WriteDescriptorSet::buffer(1, io.clone()),
                        WriteDescriptorSet::buffer(2, counts.clone()),
                        WriteDescriptorSet::buffer(3, nw.clone()),
                    ],
                    [],
                )
                .expect("set")
            })
            .collect();
        Block { ctx, module, pipeline, sets, io, counts, ne, layer0, norm }
    }

    /// `blocks` blocks, block b on layer b % layers, ordered as `order` says.
    fn record(&self, blocks: usize, order: Order) -> Arc<CommandBuffer> {
        let ctx = &self.ctx;
        let mut cb = raw::recording(ctx);
        let barrier = raw::to_compute;
        let layout = self.pipeline.layout();
        let ne = self.ne as u32;
        // SAFETY: the kernel's indices are bounded by the push constants (ne ≤ MAX_E, the
        // layer's weights in its own binding, barrier counts below 2 · BLOCKS), which
        // match the buffers' sizes; the counts are zeroed first.
        unsafe {
            cb.fill_buffer_unchecked(&self.counts, 0);
            cb.pipeline_barrier_unchecked(&barrier(
                PipelineStages::ALL_TRANSFER,
                AccessFlags::TRANSFER_WRITE,
            ));
            cb.bind_pipeline_compute_unchecked(&self.pipeline);
            let stop = if let Order::Prefix(_, stop) = order { stop } else { 0 };
            // (phase, workgroups) of each dispatch of a block.
            let dispatches: Vec<(u32, u32)> = match order {
                Order::Persist(g) | Order::Prefix(g, _) => vec![(PERSIST, g)],
                Order::Phases => {
                    vec![(0, 1), (1, ne.div_ceil(8)), (2, 1), (3, (K * I / 8) as u32), (4, (H / 8) as u32)]
                }
            };
            for b in 0..blocks {
                let set = &self.sets[b % self.sets.len()];
                cb.bind_descriptor_sets_unchecked(
                    PipelineBindPoint::Compute,
                    layout,
                    0,
                    &[set.as_raw()],
                    &[],
                );
                let p = Params { layer4: 0, ne, phase: 0, bar: (2 * b) as u32, stop };
                for &(phase, groups) in &dispatches {
                    cb.push_constants_unchecked(layout, 0, &Params { phase, ..p });
                    cb.dispatch_unchecked([groups, 1, 1]);
                    cb.pipeline_barrier_unchecked(&barrier(
                        PipelineStages::COMPUTE_SHADER,
                        AccessFlags::SHADER_WRITE,
                    ));
                }
            }
            Arc::new(cb.end().expect("end"))
        }
    }

    /// The io buffer after `blocks` blocks from the initial residual.
    fn result(&self, blocks: usize, order: Order, fence: &Fence) -> Vec<f32> {
        let mut io = vec![0f32; IO_LEN];
        io[..H].copy_from_slice(&initial_x());
        upload(&self.ctx, &self.io, bytemuck::cast_slice(&io)).expect("upload");
        raw::submit_wait(&self.ctx, &self.record(blocks, order), fence);
        bytemuck::cast_slice(&raw::read_back(&self.ctx, &self.io)).to_vec()
    }

    /// One block of layer 0 from the initial residual in f64: the ranked experts and the
    /// residual after it.
    fn reference(&self) -> (Vec<usize>, Vec<f64>) {
        let w = &self.layer0;
        let x: Vec<f64> = initial_x().iter().map(|&v| v as f64).collect();
        let ms = x.iter().map(|v| v * v).sum::<f64>() / H as f64;
        let r = 1.0 / (ms + 1e-6).sqrt();
        let xn: Vec<f64> = x.iter().zip(&self.norm).map(|(v, n)| *n as f64 * (v * r)).collect();
        let dot = |at: usize, v: &[f64]| v.iter().enumerate().map(|(j, x)| bf16(w[at + j]) * x).sum::<f64>();
        let logits: Vec<f64> = (0..self.ne).map(|e| dot(e * H, &xn)).collect();
        let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
        let mut ranked: Vec<usize> = (0..self.ne).collect();
        ranked.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        ranked.truncate(K);
        let p: Vec<f64> = ranked.iter().map(|&e| (logits[e] - mx).exp()).collect();
        let sum: f64 = p.iter().sum();
        let expert = |e: usize| self.ne * H + e * 3 * I * H;
        let h: Vec<Vec<f64>> = ranked
            .iter()
            .map(|&e| {
                (0..I)
                    .map(|j| {
                        let g = dot(expert(e) + j * H, &xn);
                        let u = dot(expert(e) + I * H + j * H, &xn);
                        g / (1.0 + (-g).exp()) * u
                    })
                    .collect()
            })
            .collect();
        let out = (0..H)
            .map(|i| {
                x[i] + (0..K)
                    .map(|k| p[k] / sum * dot(expert(ranked[k]) + 2 * I * H + i * I, &h[k]))
                    .sum::<f64>()
            })
            .collect();
        (ranked, out)
    }
}

/// Runs the comparison on device `index` and prints µs a block for each ordering.
pub fn moe(index: usize, ne: usize, layers: usize, groups: &[u32]) {
    if !(K..=MAX_E).contains(&ne) {
        fail(2, format!("EXPERTS must be {K} to {MAX_E}, not {ne}"));
    }
    if layers == 0 {
        fail(2, "LAYERS must be at least 1".into());
    }
    let ctx = VulkanContext::new(index).unwrap_or_else(|e| fail(1, e.to_string()));
    // The device's SM count where the driver reports it (VK_NV_shader_sm_builtins): what
    // an executor path would size a resident grid by.
    let pr = ctx.device.physical_device().properties();
    let sms = pr.shader_sm_count;
    println!(
        "device: {} (SMs {:?}, warps an SM {:?}: VK_NV_shader_sm_builtins)",
        ctx.info.name, sms, pr.shader_warps_per_sm
    );
    // GROUPS by default: one and two workgroups an SM, or 132, 264 and 528 (an H100's or
    // H200's 1, 2 and 4) where the driver does not say.
    let groups: Vec<u32> = match (groups.is_empty(), sms) {
        (false, _) => groups.to_vec(),
        (true, Some(n)) => vec![n, 2 * n],
        (true, None) => vec![132, 264, 528],
    };
    let groups = &groups[..];
    let fence = Fence::new(ctx.device.clone(), FenceCreateInfo::default()).expect("fence");
    let b = Block::new(ctx.clone(), ne, layers);
    // What the driver reports about the kernel (registers and shared memory decide how
    // many workgroups an SM holds, so which GROUPS can all be resident).
    let dev = &ctx.device;
    if dev.enabled_extensions().khr_pipeline_executable_properties
        && dev.enabled_features().pipeline_executable_info
    {
        match crate::stats::pipeline_stats(dev, &b.module, b.pipeline.layout(), None) {
            Ok(exes) => {
                for e in exes {
                    let stats: Vec<String> = e.stats.iter().map(|(n, _, v)| format!("{n} {v}")).collect();
                    println!("moe_block `{}` (subgroup {}): {}", e.name, e.subgroup_size, stats.join(", "));
                }
            }
            Err(e) => println!("moe_block statistics: {e}"),
        }
    }
    let (ranked, want) = b.reference();
    let one = b.result(1, Order::Phases, &fence);
    let got_ranked: Vec<usize> = one[IO_SEL..][..K].iter().map(|v| v.to_bits() as usize).collect();
    let err = (0..H).map(|i| (one[i] as f64 - want[i]).abs()).fold(0.0, f64::max);
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    println!(
        "first block against the f64 reference: experts {} ({:?}), max |error| {err:.3e} of max |x| {scale:.3}",
        if got_ranked == ranked { "equal" } else { "DIFFER" },
        got_ranked
    );
    let reference = b.result(BLOCKS, Order::Phases, &fence);
    let mut orders = vec![Order::Phases];
    for &g in groups {
        // Workgroups that are not all resident at once make the grid barrier give up
        // after its polls (slowly): such an ordering is reported and not timed.
        let o = Order::Persist(g);
        let t = Instant::now();
        let same = b.result(BLOCKS, o, &fence)[..H] == reference[..H];
        let slow = t.elapsed() > Duration::from_secs(2);
        println!(
            "{}: residual after {BLOCKS} blocks {} the phases'{}",
            o.label(),
            if same { "byte-identical to" } else { "DIFFERS from" },
            if slow { " and took over 2 s: not all resident, not timed" } else { "" }
        );
        if same && !slow {
            orders.push(o);
        }
    }
    let prefixes: Vec<Order> = orders
        .iter()
        .filter_map(|o| match *o {
            Order::Persist(g) => Some((1..=3).map(move |stop| Order::Prefix(g, stop))),
            _ => None,
        })
        .flatten()
        .collect();
    orders.extend(prefixes);
    let cbs: Vec<Arc<CommandBuffer>> = orders.iter().map(|&o| b.record(BLOCKS, o)).collect();
    let raws: Vec<&CommandBuffer> = cbs.iter().map(|cb| &**cb).collect();
    let times = raw::median_seconds(&ctx, &raws, &fence);
    let bytes = ((ne * H + K * 3 * I * H) * 2) as f64;
    let mut base = 0.0;
    for (o, t) in orders.iter().zip(times) {
        let per = t / BLOCKS as f64;
        if *o == Order::Phases {
            base = per;
        }
        println!(
            "{ne} experts, {layers} layers: {}: {:.2} us a block, {:.0} GB/s of weights ({:.2}x the phases)",
            o.label(),
            per * 1e6,
            bytes / per / 1e9,
            base / per
        );
    }
}
