//! `vulkan chain`: what a dependent dispatch costs with the executor's pipeline barrier
//! between two kernels, against no barrier and a completion count in device memory that
//! the next kernel's workgroups wait on (`shaders/chain.comp`), with that kernel's weight
//! reads issued before or after its wait. Links are m=1 f32 matvecs of 2048 columns, each
//! reading the previous one's output; their matrices are distinct (twelve links of 2048
//! rows hold 192 MiB, more than the L2 cache). The command buffers are recorded raw
//! (vulkano's builder derives a barrier between every two dispatches that share a written
//! buffer) and submitted with one raw queue submission. Two more orderings, both with
//! barriers, put an RMSNorm of each link's input in a dispatch of its own or fold it into
//! the link (what a norm dispatch fewer saves). A last ordering runs each chain as one
//! dispatch of a few resident workgroups meeting at a grid barrier after every link (what
//! a layer fused into one dispatch would pay per dependent step). Two more record the
//! barrier chain through vulkano's `AutoCommandBufferBuilder`, as the executor's
//! `Recorder` does, which derives the barriers itself: with every link's weights in one
//! binding, and with each link binding its own weights (a decode step's dispatches each
//! read weights the command buffer has not touched yet, and vulkano puts an all-commands,
//! all-memory barrier before a buffer range's first use). The footprint orderings put a
//! barrier between links that alternate two pipelines of the same kernel declaring
//! different amounts of unused shared memory: what a change of the SM's L1/shared split
//! between two dependent dispatches costs (a decode step's kernels declare 1 to 23 KiB).
//! The null orderings (at 16 rows only) chain links that do nothing, of 1 to 37,984
//! workgroups, with and without barriers: what a dependent dispatch costs by its workgroup
//! count alone (a decode step's nulled kernels cost ~4.6 µs each in situ at full clock;
//! session 40's ~10 µs was read at a low SM clock).

use std::sync::Arc;

use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, CommandBuffer, CommandBufferUsage, PrimaryAutoCommandBuffer,
    PrimaryCommandBufferAbstract,
};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::compute::ComputePipelineCreateInfo;
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint, PipelineShaderStageCreateInfo};
use vulkano::shader::SpecializationConstant;
use vulkano::sync::fence::{Fence, FenceCreateInfo};
use vulkano::sync::{AccessFlags, PipelineStages};

use smoe_actors::vulkan::harness::{device_buffer, upload};
use smoe_actors::vulkan::VulkanContext;

use crate::fail;
use crate::kernels::fill;
use crate::raw;

/// Links per chain (a decode layer records about twelve dependent dispatches).
const LINKS: usize = 12;
/// Columns of every link's matrix (`COLS4` vec4s in `shaders/chain.comp`).
const COLS: usize = 2048;
/// Floats per input/output region of `io` (links alternate between regions 0 and 1; a
/// separate RMSNorm writes region 2).
const REGION: usize = 8192;

/// `mode` bits of `shaders/chain.comp` (its `MODE_*`).
const MODE_WAIT: u32 = 1;
const MODE_EARLY: u32 = 2;
const MODE_NORM: u32 = 4;
const MODE_NORM_ONLY: u32 = 8;
const MODE_PERSIST: u32 = 16;
const MODE_POLL_LOAD: u32 = 32;
const MODE_NULL: u32 = 64;
/// Workgroups of a persistent chain at most, by default (one per SM of an H100/H200 and
/// fewer: all resident at once, which the grid barrier needs); [`Order::Persist`] also
/// runs with two per SM.
const PERSIST_GROUPS: usize = 128;

/// How consecutive links are ordered.
#[derive(Clone, Copy, PartialEq)]
enum Order {
    /// A pipeline barrier between links (the executor's way).
    Barrier,
    /// A barrier after every `span` links and none inside a span, where each link waits
    /// on the previous one's completion count, loading its weights after the wait
    /// (`early` false) or before it.
    Count { early: bool, span: usize },
    /// No barrier and no wait: the links overlap freely (wrong results; the lower bound).
    Free,
    /// Barriers, and before each link a dispatch of one workgroup writing the RMSNorm of
    /// its input, which the link reads.
    NormApart,
    /// Barriers, and each link forms the RMSNorm of its input itself (every subgroup
    /// alone): the same bytes as [`Order::NormApart`] with half the dispatches.
    NormFolded,
    /// One dispatch a chain: resident workgroups take every link's rows in turn and meet
    /// at a grid barrier after each, loading their next link's first rows before the wait
    /// (`early`) or after it, polling the barrier's count by an atomic load (`load`) or an
    /// atomic add of 0; at most `groups` workgroups.
    Persist { early: bool, load: bool, groups: usize },
    /// Barriers derived by vulkano's auto command buffer builder (the executor's way of
    /// recording), every link's weights bound at once (`own_weights` false) or each link
    /// binding only its own matrix, first used by that link.
    Auto { own_weights: bool },
    /// Barriers, the links alternating a pipeline declaring `a` KiB of unused shared
    /// memory and one declaring `b` KiB (both from [`FOOTPRINT_KIB`]; the same pipeline
    /// is bound again at every link when they are equal).
    Footprint { a: u32, b: u32 },
    /// Links that do nothing, of `groups` workgroups each, with a barrier between links
    /// (`barrier`) or none: what launching a dependent dispatch of that many workgroups
    /// costs, apart from any work.
    Null { groups: u32, barrier: bool },
}

/// The shared-memory footprints (KiB) the footprint orderings' pipelines declare; the
/// first is none (the kernel's own pipeline).
const FOOTPRINT_KIB: [u32; 8] = [0, 2, 4, 8, 16, 24, 32, 44];

impl Order {
    /// How the output names this ordering.
    fn label(self) -> String {
        match self {
            Order::Barrier => "pipeline barrier".into(),
            Order::Count { early, span } => format!(
                "count, weights {} the wait, {}",
                if early { "before" } else { "after" },
                if span >= LINKS { "no barrier".into() } else { format!("a barrier every {span} links") }
            ),
            Order::Free => "no ordering (lower bound, wrong results)".into(),
            Order::NormApart => "barrier, an RMSNorm dispatch before each link (per link and norm)".into(),
            Order::NormFolded => "barrier, the RMSNorm folded into each link".into(),
            Order::Persist { early, load, groups } => format!(
                "one dispatch, grid barrier per link polled by {}, next weights {} the wait{}",
                if load { "atomic loads" } else { "atomic adds" },
                if early { "before" } else { "after" },
                if groups == PERSIST_GROUPS {
                    String::new()
                } else {
                    format!(", at most {groups} workgroups")
                }
            ),
            Order::Auto { own_weights } => format!(
                "vulkano's derived barriers, {}",
                if own_weights { "each link binding its own weights" } else { "the weights bound once" }
            ),
            Order::Footprint { a, b } => {
                format!("barrier, links alternating {a} KiB and {b} KiB of unused shared memory")
            }
            Order::Null { groups, barrier } => format!(
                "{}, null links of {groups} workgroups (no work)",
                if barrier { "barrier" } else { "no ordering" }
            ),
        }
    }

    /// The kernel's `mode` bits for this ordering.
    fn mode(self) -> u32 {
        match self {
            Order::Barrier
            | Order::Free
            | Order::NormApart
            | Order::Auto { .. }
            | Order::Footprint { .. } => 0,
            Order::Count { early, .. } => MODE_WAIT | if early { MODE_EARLY } else { 0 },
            Order::NormFolded => MODE_NORM,
            Order::Persist { early, load, .. } => {
                MODE_PERSIST | if early { MODE_EARLY } else { 0 } | if load { MODE_POLL_LOAD } else { 0 }
            }
            Order::Null { .. } => MODE_NULL,
        }
    }

    /// Whether a barrier follows link `i` (of a chain, counted over the whole buffer).
    fn barrier_after(self, i: usize) -> bool {
        match self {
            Order::Barrier
            | Order::NormApart
            | Order::NormFolded
            | Order::Persist { .. }
            | Order::Auto { .. }
            | Order::Footprint { .. } => true,
            Order::Count { span, .. } => span < LINKS && (i + 1).is_multiple_of(span),
            Order::Null { barrier, .. } => barrier,
            Order::Free => false,
        }
    }
}

/// The push constants of `shaders/chain.comp`.
#[derive(Clone, Copy, Default, vulkano::buffer::BufferContents)]
#[repr(C)]
struct Params {
    rows: u32,
    w_off4: u32,
    in_off: u32,
    out_off: u32,
    wait_idx: u32,
    wait_for: u32,
    sig_idx: u32,
    mode: u32,
}

/// The push constants of link `i` of chain `k` (of links over `rows` rows), reading its
/// input at io offset `in_off` and ordered as `order` says.
fn link(rows: usize, k: usize, i: usize, in_off: u32, order: Order) -> Params {
    let sig = (k * LINKS + i + 1) as u32;
    Params {
        rows: rows as u32,
        w_off4: (i * rows * COLS / 4) as u32,
        in_off,
        out_off: (((i + 1) % 2) * REGION) as u32,
        wait_idx: sig - 1,
        wait_for: if sig == 1 { 0 } else { rows.div_ceil(4) as u32 },
        sig_idx: sig,
        mode: order.mode(),
    }
}

/// A chain's pipeline and buffers: the links' weights, their inputs and outputs (`io`),
/// and one completion count per link of the longest buffer recorded.
struct Chain {
    ctx: Arc<VulkanContext>,
    /// The kernel declaring each of [`FOOTPRINT_KIB`] of unused shared memory, in that
    /// order: the first (none) serves every ordering but [`Order::Footprint`].
    footprints: Vec<Arc<ComputePipeline>>,
    set: Arc<DescriptorSet>,
    /// Per link, a set binding only that link's matrix (for [`Order::Auto`]).
    link_sets: Vec<Arc<DescriptorSet>>,
    io: Subbuffer<[u8]>,
    counts: Subbuffer<[u32]>,
}

/// A recorded chain: raw, or built by vulkano's auto command buffer builder.
enum Recorded {
    Raw(CommandBuffer),
    Auto(Arc<PrimaryAutoCommandBuffer>),
}

impl Recorded {
    /// The command buffer to submit.
    fn raw(&self) -> &CommandBuffer {
        match self {
            Recorded::Raw(cb) => cb,
            Recorded::Auto(cb) => cb.as_raw(),
        }
    }
}

/// A device-local storage buffer holding `data`.
fn device_local<T: bytemuck::Pod>(ctx: &VulkanContext, data: &[T]) -> Subbuffer<[u8]> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let buf =
        device_buffer::<u8>(ctx, bytes.len() as u64, BufferUsage::STORAGE_BUFFER).expect("device buffer");
    upload(ctx, &buf, bytes).expect("upload");
    buf
}

/// The io regions' values before a chain (the first link's input).
fn initial_io() -> Vec<f32> {
    (0..3 * REGION).map(|i| ((i % 97) as f32 - 48.0) / 48.0).collect()
}

impl Chain {
    /// The pipeline and buffers for chains of `reps` runs of [`LINKS`] links of `rows` rows.
    fn new(ctx: Arc<VulkanContext>, rows: usize, reps: usize) -> Chain {
        let d = &ctx.device;
        let (module, layout) = raw::module_and_layout(&ctx, "chain");
        let footprints = FOOTPRINT_KIB
            .iter()
            .map(|&kib| {
                let pad = (kib * 256).max(1);
                let entry = module
                    .specialize([(0, SpecializationConstant::U32(pad))].into_iter().collect())
                    .expect("specialize")
                    .entry_point("main")
                    .expect("main");
                let info = ComputePipelineCreateInfo::stage_layout(
                    PipelineShaderStageCreateInfo::new(entry),
                    layout.clone(),
                );
                ComputePipeline::new(d.clone(), None, info).expect("footprint pipeline")
            })
            .collect();
        let w = device_local(&ctx, &fill(LINKS * rows * COLS, 7));
        let io = device_local(&ctx, &initial_io());
        let counts = device_buffer::<u32>(&ctx, (reps * LINKS + 1) as u64, BufferUsage::STORAGE_BUFFER)
            .expect("counts");
        let nw = device_local(&ctx, &(0..COLS).map(|i| 0.5 + (i % 7) as f32 / 8.0).collect::<Vec<_>>());
        let set_for = |w: Subbuffer<[u8]>| {
            DescriptorSet::new(
                ctx.descriptors.clone(),
                layout.set_layouts()[0].clone(),
                [
                    WriteDescriptorSet::buffer(0, w),
                    WriteDescriptorSet::buffer(1, io.clone()),
                    WriteDescriptorSet::buffer(2, counts.clone()),
                    WriteDescriptorSet::buffer(3, nw.clone()),
                ],
                [],
            )
            .expect("set")
        };
        let link = (rows * COLS * 4) as u64;
        let link_sets =
            (0..LINKS as u64).map(|i| set_for(w.clone().slice(i * link..(i + 1) * link))).collect();
        let set = set_for(w);
        Chain { ctx, footprints, set, link_sets, io, counts }
    }

    /// The kernel with no unused shared memory, which every ordering but
    /// [`Order::Footprint`] runs.
    fn pipeline(&self) -> &Arc<ComputePipeline> {
        &self.footprints[0]
    }

    /// `reps` chains of [`LINKS`] links over `rows` rows, ordered as `order` says.
    fn record(&self, rows: usize, reps: usize, order: Order) -> Recorded {
        if let Order::Auto { own_weights } = order {
            return Recorded::Auto(self.record_auto(rows, reps, own_weights));
        }
        let ctx = &self.ctx;
        let mut cb = raw::recording(ctx);
        let barrier = raw::to_compute;
        let layout = self.pipeline().layout();
        // The two pipelines a footprint ordering alternates.
        let alternate = match order {
            Order::Footprint { a, b } => Some([a, b].map(|kib| {
                let at = FOOTPRINT_KIB.iter().position(|&f| f == kib).expect("a listed footprint");
                &self.footprints[at]
            })),
            _ => None,
        };
        let groups = rows.div_ceil(4) as u32;
        // SAFETY: every index the kernel forms is bounded by the push constants, which
        // are derived from the sizes the buffers were made with; the counts are zeroed
        // before the first link and each link of the chain adds to its own.
        unsafe {
            cb.fill_buffer_unchecked(&self.counts, 0);
            cb.pipeline_barrier_unchecked(&barrier(
                PipelineStages::ALL_TRANSFER,
                AccessFlags::TRANSFER_WRITE,
            ));
            cb.bind_pipeline_compute_unchecked(self.pipeline());
            cb.bind_descriptor_sets_unchecked(
                PipelineBindPoint::Compute,
                layout,
                0,
                &[self.set.as_raw()],
                &[],
            );
            for k in 0..reps {
                if let Order::Persist { groups: most, .. } = order {
                    // Links alternate between io regions 0 and 1, as the dispatched ones do.
                    let wgs = groups.min(most as u32);
                    let p = Params {
                        rows: rows as u32,
                        in_off: 0,
                        out_off: REGION as u32,
                        wait_idx: (k * LINKS + 1) as u32,
                        wait_for: wgs,
                        sig_idx: LINKS as u32,
                        mode: order.mode(),
                        ..Default::default()
                    };
                    cb.push_constants_unchecked(layout, 0, &p);
                    cb.dispatch_unchecked([wgs, 1, 1]);
                    cb.pipeline_barrier_unchecked(&barrier(
                        PipelineStages::COMPUTE_SHADER,
                        AccessFlags::SHADER_WRITE,
                    ));
                    continue;
                }
                for i in 0..LINKS {
                    let mut in_off = ((i % 2) * REGION) as u32;
                    if order == Order::NormApart {
                        let norm = Params {
                            in_off,
                            out_off: (2 * REGION) as u32,
                            mode: MODE_NORM_ONLY,
                            ..Default::default()
                        };
                        cb.push_constants_unchecked(layout, 0, &Params { rows: 1, ..norm });
                        cb.dispatch_unchecked([1, 1, 1]);
                        cb.pipeline_barrier_unchecked(&barrier(
                            PipelineStages::COMPUTE_SHADER,
                            AccessFlags::SHADER_WRITE,
                        ));
                        in_off = (2 * REGION) as u32;
                    }
                    if let Some(pair) = &alternate {
                        cb.bind_pipeline_compute_unchecked(pair[i % 2]);
                    }
                    cb.push_constants_unchecked(layout, 0, &link(rows, k, i, in_off, order));
                    let wgs = match order {
                        Order::Null { groups: g, .. } => g,
                        _ => groups,
                    };
                    cb.dispatch_unchecked([wgs, 1, 1]);
                    if order.barrier_after(k * LINKS + i) {
                        cb.pipeline_barrier_unchecked(&barrier(
                            PipelineStages::COMPUTE_SHADER,
                            AccessFlags::SHADER_WRITE,
                        ));
                    }
                }
            }
            Recorded::Raw(cb.end().expect("end"))
        }
    }

    /// The barrier chain recorded as the executor records (vulkano's builder deriving
    /// every barrier): [`Order::Auto`].
    fn record_auto(&self, rows: usize, reps: usize, own_weights: bool) -> Arc<PrimaryAutoCommandBuffer> {
        let ctx = &self.ctx;
        let mut b = AutoCommandBufferBuilder::primary(
            ctx.commands.clone(),
            ctx.compute.queue_family_index(),
            CommandBufferUsage::MultipleSubmit,
        )
        .expect("builder");
        let layout = self.pipeline().layout().clone();
        let groups = rows.div_ceil(4) as u32;
        let order = Order::Auto { own_weights };
        b.fill_buffer(self.counts.clone(), 0).expect("fill");
        b.bind_pipeline_compute(self.pipeline().clone()).expect("bind pipeline");
        for k in 0..reps {
            for i in 0..LINKS {
                let p = link(rows, k, i, ((i % 2) * REGION) as u32, order);
                // Each link's own matrix is bound at its start.
                let (set, p) = if own_weights {
                    (self.link_sets[i].clone(), Params { w_off4: 0, ..p })
                } else {
                    (self.set.clone(), p)
                };
                b.bind_descriptor_sets(PipelineBindPoint::Compute, layout.clone(), 0, set).expect("bind set");
                b.push_constants(layout.clone(), 0, p).expect("push");
                // SAFETY: as the raw recording's dispatches.
                unsafe { b.dispatch([groups, 1, 1]) }.expect("dispatch");
            }
        }
        b.build().expect("build")
    }

    /// The bytes of the links' io regions (0 and 1; not a separate norm's) after one chain.
    fn result(&self, rows: usize, order: Order, fence: &Fence) -> Vec<u32> {
        upload(&self.ctx, &self.io, bytemuck::cast_slice(&initial_io())).expect("upload");
        raw::submit_wait(&self.ctx, self.record(rows, 1, order).raw(), fence);
        let bytes = raw::read_back(&self.ctx, &self.io);
        bytemuck::cast_slice(&bytes[..2 * REGION * 4]).to_vec()
    }
}

/// Runs the experiment on device `index` and prints µs per link for each ordering.
pub fn chain(index: usize) {
    let ctx = VulkanContext::new(index).unwrap_or_else(|e| fail(1, e.to_string()));
    println!("device: {}", ctx.info.name);
    let fence = Fence::new(ctx.device.clone(), FenceCreateInfo::default()).expect("fence");
    let count = |early, span| Order::Count { early, span };
    let orders = [
        Order::Barrier,
        count(false, LINKS),
        count(true, LINKS),
        count(true, 2),
        count(true, 3),
        Order::Free,
        Order::NormApart,
        Order::NormFolded,
        Order::Persist { early: false, load: false, groups: PERSIST_GROUPS },
        Order::Persist { early: true, load: false, groups: PERSIST_GROUPS },
        Order::Persist { early: false, load: true, groups: PERSIST_GROUPS },
        Order::Persist { early: true, load: true, groups: PERSIST_GROUPS },
        Order::Persist { early: true, load: false, groups: 2 * PERSIST_GROUPS },
        Order::Auto { own_weights: false },
        Order::Auto { own_weights: true },
        // The same pipeline at every link, then a change of footprint at every link.
        Order::Footprint { a: 0, b: 0 },
        Order::Footprint { a: 24, b: 24 },
        Order::Footprint { a: 44, b: 44 },
        Order::Footprint { a: 0, b: 2 },
        Order::Footprint { a: 0, b: 4 },
        Order::Footprint { a: 0, b: 8 },
        Order::Footprint { a: 0, b: 16 },
        Order::Footprint { a: 0, b: 24 },
        Order::Footprint { a: 0, b: 32 },
        Order::Footprint { a: 0, b: 44 },
        Order::Footprint { a: 2, b: 4 },
        Order::Footprint { a: 8, b: 16 },
        Order::Footprint { a: 24, b: 32 },
        Order::Footprint { a: 24, b: 44 },
    ];
    // Null links' cost does not depend on the rows, so they run with the first size only,
    // over a decode step's grids: a norm's 1 workgroup, a router's 32, an output
    // projection's 512, q/k/v's 1,280, a Qwen3 LM head's 9,496 (16 rows a workgroup), and
    // 151,936 rows at this kernel's 4 a workgroup.
    let nulls = [1u32, 32, 132, 512, 1280, 4096, 9496, 37984]
        .into_iter()
        .flat_map(|groups| [true, false].map(|barrier| Order::Null { groups, barrier }));
    let orders_first: Vec<Order> = orders.into_iter().chain(nulls).collect();
    for rows in [16usize, 512, 2048] {
        let orders = if rows == 16 { &orders_first[..] } else { &orders[..] };
        let reps = 64;
        let c = Chain::new(ctx.clone(), rows, reps);
        let reference = c.result(rows, Order::Barrier, &fence);
        let normed = c.result(rows, Order::NormApart, &fence);
        for &order in orders {
            let expected = match order {
                Order::Free | Order::Barrier | Order::NormApart | Order::Null { .. } => continue,
                Order::NormFolded => &normed,
                Order::Count { .. }
                | Order::Persist { .. }
                | Order::Auto { .. }
                | Order::Footprint { .. } => &reference,
            };
            if c.result(rows, order, &fence) != *expected {
                println!("rows {rows}: {}: results DIFFER from its reference (the barrier chain, or the separate norm)", order.label());
            }
        }
        let cbs: Vec<Recorded> = orders.iter().map(|&o| c.record(rows, reps, o)).collect();
        let raws: Vec<&CommandBuffer> = cbs.iter().map(Recorded::raw).collect();
        let times = raw::median_seconds(&c.ctx, &raws, &fence);
        let bytes = (rows * COLS * 4) as f64;
        for (order, t) in orders.iter().zip(times) {
            let per = t / (reps * LINKS) as f64;
            if let Order::Null { .. } = order {
                println!("{}: {:.2} us per link", order.label(), per * 1e6);
                continue;
            }
            println!(
                "rows {rows} x {COLS} f32 ({:.2} MB/link): {}: {:.2} us per link, {:.0} GB/s",
                bytes / 1e6,
                order.label(),
                per * 1e6,
                bytes / per / 1e9
            );
        }
    }
}
