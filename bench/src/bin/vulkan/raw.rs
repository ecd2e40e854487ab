//! Raw command buffers for the dependency experiments (`chain.rs`, `moe.rs`): recorded
//! without vulkano's derived barriers (each experiment places its own), submitted with one
//! raw queue submission and waited for on a fence, and a buffer read back to the host.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ash::vk;
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, CommandBuffer, CommandBufferBeginInfo, CommandBufferLevel, CommandBufferUsage,
    CopyBufferInfo, PrimaryCommandBufferAbstract, RecordingCommandBuffer,
};
use vulkano::pipeline::layout::PipelineDescriptorSetLayoutCreateInfo;
use vulkano::pipeline::{PipelineLayout, PipelineShaderStageCreateInfo};
use vulkano::shader::{ShaderModule, ShaderModuleCreateInfo};
use vulkano::sync::fence::Fence;
use vulkano::sync::{AccessFlags, DependencyInfo, GpuFuture, MemoryBarrier, PipelineStages};
use vulkano::VulkanObject;

use smoe_actors::vulkan::harness::host_buffer;
use smoe_actors::vulkan::{spirv, VulkanContext};

use crate::fail;

/// A primary command buffer on the compute queue's family, to be submitted many times.
pub fn recording(ctx: &VulkanContext) -> RecordingCommandBuffer {
    let begin = CommandBufferBeginInfo { usage: CommandBufferUsage::MultipleSubmit, ..Default::default() };
    RecordingCommandBuffer::new(
        ctx.commands.clone(),
        ctx.compute.queue_family_index(),
        CommandBufferLevel::Primary,
        begin,
    )
    .expect("recording")
}

/// A memory barrier from `src` (its `src_access` writes) to compute shaders' reads and
/// writes: the executor's barrier between two dependent dispatches.
pub fn to_compute(src: PipelineStages, src_access: AccessFlags) -> DependencyInfo {
    DependencyInfo {
        memory_barriers: [MemoryBarrier {
            src_stages: src,
            src_access,
            dst_stages: PipelineStages::COMPUTE_SHADER,
            dst_access: AccessFlags::SHADER_READ | AccessFlags::SHADER_WRITE,
            ..Default::default()
        }]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

/// Submits `cb` on the compute queue and waits for it on `fence`; the wall time.
pub fn submit_wait(ctx: &VulkanContext, cb: &CommandBuffer, fence: &Fence) -> Duration {
    let fns = ctx.device.fns();
    let handle = cb.handle();
    let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&handle));
    let t = Instant::now();
    // SAFETY: the command buffer is not executing (every submission is waited for), and
    // nothing else uses the queue in these programs meanwhile.
    let r = unsafe { (fns.v1_0.queue_submit)(ctx.compute.handle(), 1, &submit, fence.handle()) };
    assert_eq!(r, vk::Result::SUCCESS, "queue submit");
    fence.wait(None).expect("fence wait");
    let d = t.elapsed();
    // SAFETY: the fence's submission has completed.
    unsafe { fence.reset() }.expect("fence reset");
    d
}

/// Seconds each of `cbs` takes, the median of seven rounds that run them in turn, after
/// 300 ms of the first alone (the GPU clocks up).
pub fn median_seconds(ctx: &VulkanContext, cbs: &[&CommandBuffer], fence: &Fence) -> Vec<f64> {
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        submit_wait(ctx, cbs[0], fence);
    }
    let mut times = vec![Vec::new(); cbs.len()];
    for _ in 0..7 {
        for (t, cb) in times.iter_mut().zip(cbs) {
            t.push(submit_wait(ctx, cb, fence).as_secs_f64());
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[3]
        })
        .collect()
}

/// The bytes of device buffer `buf`, copied to the host.
pub fn read_back(ctx: &VulkanContext, buf: &Subbuffer<[u8]>) -> Vec<u8> {
    let host = host_buffer::<u8>(ctx, buf.len(), BufferUsage::empty()).expect("readback");
    let mut b = AutoCommandBufferBuilder::primary(
        ctx.commands.clone(),
        ctx.compute.queue_family_index(),
        CommandBufferUsage::OneTimeSubmit,
    )
    .expect("builder");
    b.copy_buffer(CopyBufferInfo::buffers(buf.clone(), host.clone())).expect("copy");
    b.build()
        .expect("build")
        .execute(ctx.compute.clone())
        .expect("execute")
        .then_signal_fence_and_flush()
        .expect("flush")
        .wait(None)
        .expect("wait");
    let bytes = host.read().expect("read");
    bytes.to_vec()
}

/// The shader module `name` (`shaders/spv/NAME.spv` as the executor loads it) and a
/// pipeline layout made from its entry point's reflection.
pub fn module_and_layout(ctx: &VulkanContext, name: &str) -> (Arc<ShaderModule>, Arc<PipelineLayout>) {
    let d = &ctx.device;
    let words = spirv(name).unwrap_or_else(|e| fail(1, e.to_string()));
    // SAFETY: SPIR-V compiled by glslc from this repository's shaders.
    let module =
        unsafe { ShaderModule::new(d.clone(), ShaderModuleCreateInfo::new(&words)) }.expect("module");
    let stage = PipelineShaderStageCreateInfo::new(module.entry_point("main").expect("main"));
    let layout = PipelineLayout::new(
        d.clone(),
        PipelineDescriptorSetLayoutCreateInfo::from_stages([&stage])
            .into_pipeline_layout_create_info(d.clone())
            .expect("layout info"),
    )
    .expect("layout");
    (module, layout)
}
