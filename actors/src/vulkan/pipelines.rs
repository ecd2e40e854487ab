//! The compute pipelines: SPIR-V (compiled by `build.rs` from `shaders/`) loaded into
//! shader modules, one pipeline per kernel, all sharing the activation descriptor set
//! layout (set 1: the activation arena and the routing buffer).

use std::collections::BTreeMap;
use std::sync::Arc;

use vulkano::descriptor_set::layout::{
    DescriptorSetLayout, DescriptorSetLayoutBinding, DescriptorSetLayoutCreateInfo, DescriptorType,
};
use vulkano::device::Device;
use vulkano::pipeline::compute::ComputePipelineCreateInfo;
use vulkano::pipeline::layout::{PipelineDescriptorSetLayoutCreateInfo, PipelineLayoutCreateInfo};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineLayout, PipelineShaderStageCreateInfo};
use vulkano::shader::{ShaderModule, ShaderModuleCreateInfo, ShaderStages};

use super::VulkanError;

include!(concat!(env!("OUT_DIR"), "/spirv_table.rs"));

/// One kernel: its pipeline and layout.
#[derive(Clone)]
pub struct Kernel {
    /// The compute pipeline.
    pub pipeline: Arc<ComputePipeline>,
    /// Its layout (set 0: the kernel's weights or caches; set 1: activations).
    pub layout: Arc<PipelineLayout>,
}

impl Kernel {
    /// Layout of the kernel's own descriptor set (set 0).
    pub fn set0(&self) -> Arc<DescriptorSetLayout> {
        self.layout.set_layouts()[0].clone()
    }
}

/// The weight element types the dense and expert kernels come in.
#[derive(Clone)]
pub struct TypedKernels {
    /// m=1 matrix-vector product.
    pub matvec: Kernel,
    /// Token-batched sibling of `matvec`.
    pub matmul: Kernel,
    /// m=1 fused gate/up projection with SiLU.
    pub gate_up: Kernel,
    /// Token-batched sibling of `gate_up`.
    pub gate_up_batched: Kernel,
}

/// Every pipeline of the backend.
pub struct Kernels {
    /// Kernels reading f32 weights.
    pub f32: TypedKernels,
    /// Kernels reading bf16 weights.
    pub bf16: TypedKernels,
    /// Row RMSNorm.
    pub rmsnorm: Kernel,
    /// Per-head QK RMSNorm, RoPE and the K/V append.
    pub qk_rope: Kernel,
    /// Causal GQA attention.
    pub attention: Kernel,
    /// Weighted MoE combine with the residual add.
    pub accumulate: Kernel,
    /// The activation set layout shared by every kernel.
    pub act_layout: Arc<DescriptorSetLayout>,
}

fn spirv(name: &str) -> Result<Vec<u32>, VulkanError> {
    let bytes = SPIRV
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
        .ok_or_else(|| VulkanError::Vulkan(format!("no SPIR-V module `{name}` was built")))?;
    Ok(bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect())
}

fn verr(what: &str) -> impl Fn(&dyn std::fmt::Display) -> VulkanError + '_ {
    move |e| VulkanError::Vulkan(format!("{what}: {e}"))
}

fn kernel(device: &Arc<Device>, act: &Arc<DescriptorSetLayout>, name: &str) -> Result<Kernel, VulkanError> {
    let words = spirv(name)?;
    // SAFETY: the words are SPIR-V produced by glslc from this repository's shaders.
    let module = unsafe { ShaderModule::new(device.clone(), ShaderModuleCreateInfo::new(&words)) }
        .map_err(|e| verr(name)(&e))?;
    let entry = module
        .entry_point("main")
        .ok_or_else(|| VulkanError::Vulkan(format!("shader `{name}` has no main")))?;
    let stage = PipelineShaderStageCreateInfo::new(entry);
    let mut info = PipelineDescriptorSetLayoutCreateInfo::from_stages([&stage]);
    if info.set_layouts.is_empty() {
        info.set_layouts.push(DescriptorSetLayoutCreateInfo::default());
    }
    let set0 =
        DescriptorSetLayout::new(device.clone(), info.set_layouts[0].clone()).map_err(|e| verr(name)(&e))?;
    let layout = PipelineLayout::new(
        device.clone(),
        PipelineLayoutCreateInfo {
            set_layouts: vec![set0, act.clone()],
            push_constant_ranges: info.push_constant_ranges,
            ..Default::default()
        },
    )
    .map_err(|e| verr(name)(&e))?;
    let pipeline = ComputePipeline::new(
        device.clone(),
        None,
        ComputePipelineCreateInfo::stage_layout(stage, layout.clone()),
    )
    .map_err(|e| verr(name)(&e))?;
    // Every kernel writes the activation arena; vulkano places barriers from these
    // reflected accesses, so a kernel whose write went unseen would race its successor.
    let writes_act = pipeline
        .descriptor_binding_requirements()
        .get(&(1, 0))
        .is_some_and(|r| r.descriptors.values().any(|d| !d.memory_write.is_empty()));
    if !writes_act {
        return Err(VulkanError::Vulkan(format!(
            "checking kernel `{name}`: its write to the activation arena is not visible to barrier tracking"
        )));
    }
    Ok(Kernel { pipeline, layout })
}

impl Kernels {
    /// Builds every pipeline on `device`.
    pub fn new(device: &Arc<Device>) -> Result<Kernels, VulkanError> {
        let storage = |_| DescriptorSetLayoutBinding {
            stages: ShaderStages::COMPUTE,
            ..DescriptorSetLayoutBinding::descriptor_type(DescriptorType::StorageBuffer)
        };
        let bindings: BTreeMap<u32, DescriptorSetLayoutBinding> = (0..2).map(|b| (b, storage(b))).collect();
        let act_layout = DescriptorSetLayout::new(
            device.clone(),
            DescriptorSetLayoutCreateInfo { bindings, ..Default::default() },
        )
        .map_err(|e| verr("activation set layout")(&e))?;
        let k = |name: &str| kernel(device, &act_layout, name);
        let typed = |t: &str| -> Result<TypedKernels, VulkanError> {
            Ok(TypedKernels {
                matvec: k(&format!("matvec_{t}"))?,
                matmul: k(&format!("matmul_{t}"))?,
                gate_up: k(&format!("gate_up_{t}"))?,
                gate_up_batched: k(&format!("gate_up_batched_{t}"))?,
            })
        };
        Ok(Kernels {
            f32: typed("f32")?,
            bf16: typed("bf16")?,
            rmsnorm: k("rmsnorm")?,
            qk_rope: k("qk_rope")?,
            attention: k("attention")?,
            accumulate: k("accumulate")?,
            act_layout,
        })
    }
}
