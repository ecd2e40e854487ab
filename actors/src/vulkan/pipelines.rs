//! The compute pipelines: SPIR-V (compiled by `build.rs` from `shaders/`) loaded into
//! shader modules, one pipeline per kernel, all sharing the activation descriptor set
//! layout (set 1: the activation arena and the routing buffer). The matmul kernels are
//! specialized by a [`MatmulTuning`] and come in one set per weight type ([`DType`]),
//! built when a type is first asked for.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use smoe_proto::DType;
use vulkano::descriptor_set::layout::{
    DescriptorSetLayout, DescriptorSetLayoutBinding, DescriptorSetLayoutCreateInfo, DescriptorType,
};
use vulkano::device::physical::SubgroupFeatures;
use vulkano::device::Device;
use vulkano::pipeline::compute::ComputePipelineCreateInfo;
use vulkano::pipeline::layout::{PipelineDescriptorSetLayoutCreateInfo, PipelineLayoutCreateInfo};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineLayout, PipelineShaderStageCreateInfo};
use vulkano::shader::{ShaderModule, ShaderModuleCreateInfo, ShaderStages, SpecializationConstant};

use super::VulkanError;

include!(concat!(env!("OUT_DIR"), "/spirv_table.rs"));

/// Invocations per workgroup of every kernel (`WG_SIZE` in `shaders/common.glsl`) but the
/// m=1 matmul kernels.
const WG_SIZE: u32 = 256;

/// Invocations per workgroup of the m=1 matmul kernels (matvec, gate/up, expert down).
/// On the H200, 128 against 256 took the Q4_K and Q6_K LM-head matvecs (151936 × 2048)
/// from 124 and 149 to 119 and 143.5 us and the 235B-shape Q4_K expert FFN from 77-79 to
/// 75-77 us, bf16 and Q4_K at the 30B shape unchanged; the batched kernels keep 256, since
/// Q6_K's 64-token FFN took 1,150 us at 128 against 1,050
/// (`bench/results/gpu-q4k-probes-h200-2026-12-02.txt`). The batched kernels' tests
/// against the m=1 ones compare the two sizes.
const M1_WG: u32 = 128;

/// Invocations per workgroup of the front gate/up ([`Kernels::gate_up_front`]). Its
/// workgroups are one an SM (all must be resident at once), so each is large enough to
/// keep an SM's loads in flight; the batched kernels' 256 and the m=1 kernels' 128 are
/// sized for many workgroups an SM. Not yet tuned on a GPU.
pub const FRONT_WG: u32 = 512;

/// Most inputs of a front that forms its input's RMSNorm itself (`NORM_IN` of
/// `shaders/matmul.comp`: the normed row sits in workgroup memory, 16 KiB at most, so
/// the front fits the 32 KiB every device offers).
pub const FRONT_MAX_NORM: usize = 4096;

/// Weight chunks each lane of the front gate/up loads before using them (the chunk
/// kernels': float types, Q8_0, Q4_0; the slice kernels take one slice at a time). Its
/// one workgroup an SM has a fraction of the standalone gate/up's warps to hide memory
/// latency with, so each lane keeps more loads in flight, as the `vulkan moe` probe's
/// fused block did (eight chunks of each matrix). Not yet tuned on a GPU.
pub const FRONT_UNROLL: u32 = 8;

/// `ROUTER_T` of `shaders/router.glsl` for a router weight of `dtype`: 0 f32, 1 bf16,
/// 2 f16; `None` for the types it does not read.
pub fn router_type(dtype: DType) -> Option<u32> {
    match dtype {
        DType::F32 => Some(0),
        DType::Bf16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// How the matmul kernels split their work (`shaders/matmul.comp`'s specialization
/// constants). `lanes` is part of the summation order, so every kernel of one backend
/// instance uses the same value; the rest only moves work between invocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulTuning {
    /// Lanes that split one dot product (a power of two, 2..=64).
    pub lanes: u32,
    /// Rows per lane group of the m=1 kernels (1..=4).
    pub rows_m1: u32,
    /// Weight chunks each lane loads before using them (1..=8): the m=1 expert kernels
    /// and wide matvec (an LM head), and at most 2 of them the batched kernels.
    pub unroll: u32,
    /// The same for the m=1 dense matvec (1..=8): a layer's q/k/v, output projection
    /// and router. The slice kernels (Q4_K, Q5_K, Q6_K) take one slice at a time
    /// whatever either says.
    pub unroll_dense: u32,
    /// Rows per lane group of the m=1 expert down projection (1..=4): its rows are short
    /// (the expert intermediate size), so more of them per workgroup keep a token's
    /// experts in one wave of workgroups.
    pub rows_down: u32,
    /// Rows per lane group of the wide m=1 matvec (1..=4): matrices of at least
    /// [`super::record::WIDE_ROWS`] rows, an LM head, where more rows share each load of
    /// the input.
    pub rows_wide: u32,
    /// Rows per lane group of the token-batched kernels for float weights (1..=4;
    /// prefill's dense and expert products): each lane's load of a pass's inputs (4
    /// tokens' for float weights, 8 for block formats) serves this many rows.
    pub rows_batched: u32,
    /// The same for weights in ggml block formats (1..=4), whose dequantisation holds more
    /// registers per row.
    pub rows_batched_blocks: u32,
}

impl MatmulTuning {
    /// The backend's tuning (what [`Default`] gives), as a constant for tables of
    /// tunings. One row per lane group and one chunk per load gave the fastest bf16 expert
    /// gate/up (15.7 us against 16.8 us for 2 rows / 2 chunks) and the lowest
    /// small-matvec floor on the H200, within 0.5 us of the best on the q_proj-sized
    /// matvec and 3% on the LM head; 4 rows per lane group gave the fastest expert down
    /// projection (9.9-10.0 us against 10.6-10.7 us for 1 row)
    /// (`bench/results/vulkan-h200-kernels-2026-11-29d.txt`, `-29e.txt`). Two chunks in
    /// the dense m=1 matvec alone made resident greedy decode of the 3-layer bf16 q30
    /// synth 1-4% faster in three runs (means 1,641-1,687 -> 1,703-1,719 tok/s; 4 and 8
    /// chunks no faster), where two everywhere had been level
    /// (`bench/results/gpu-decode-unroll-prefetch-h200-2026-12-02.txt`). Four rows per
    /// lane group in the wide matvec took the Q6_K LM head (a Q4_K_M vault's) from
    /// 139.8-140.6 to 121.1 us at 151936 × 2048 and from 268.3-268.8 to 230.7 us at
    /// 151936 × 4096, Q8_0 and Q4_0 8-10% faster, Q4_K and bf16 level or faster (Q4_K 3 rows:
    /// 104.8 against 109.1-109.4 us; `bench/results/gpu-lm-head-rows-h200-2026-12-03.txt`).
    /// Rows per lane group in the batched kernels took the H200's 511-token resident
    /// prefill of the 3-layer q30 synth from 15,666-15,790 tok/s at 1 row to 18,786-19,188
    /// at 2, 19,802-20,427 at 3 and 16,402-16,717 at 4 (bf16), and its Q4_K_M twin from
    /// 10,472-10,500 to 13,930-14,582 at 2 and ~13,500 at 3 and 4, ids identical
    /// (`bench/results/gpu-prefill-batched-rows-h200-2026-12-04.txt`).
    pub const DEFAULT: MatmulTuning = MatmulTuning {
        lanes: 32,
        rows_m1: 1,
        unroll: 1,
        unroll_dense: 2,
        rows_down: 4,
        rows_wide: 4,
        rows_batched: 3,
        rows_batched_blocks: 2,
    };
}

impl Default for MatmulTuning {
    /// [`MatmulTuning::DEFAULT`].
    fn default() -> Self {
        MatmulTuning::DEFAULT
    }
}

/// One kernel: its pipeline and layout.
#[derive(Clone)]
pub struct Kernel {
    /// The SPIR-V module it was built from (`shaders/shaders.txt`).
    pub module: String,
    /// What it was specialised for, if anything.
    pub spec: Option<Spec>,
    /// The compute pipeline.
    pub pipeline: Arc<ComputePipeline>,
    /// Its layout (set 0: the kernel's weights or caches; set 1: activations).
    pub layout: Arc<PipelineLayout>,
}

/// How a matmul-family kernel (`shaders/matmul.comp`) splits its work: specialization
/// constants 0 to 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// Rows per lane group.
    pub rows: u32,
    /// Weight chunks each lane loads before using them.
    pub unroll: u32,
    /// Lanes that split one dot product.
    pub lanes: u32,
    /// Invocations per workgroup.
    pub wg: u32,
}

impl std::fmt::Display for Tiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Tiling { rows, unroll, lanes, wg } = self;
        write!(f, "rows {rows}, unroll {unroll}, lanes {lanes}, workgroup {wg}")
    }
}

/// A kernel's specialization constants, by what they mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spec {
    /// A matmul-family kernel (`shaders/matmul.comp`).
    Matmul(Tiling),
    /// A front gate/up (`shaders/matmul.comp` with `FRONT`): the matmul's tiling, then
    /// the router's weight type (constant 4; `router_type`) and, where the front forms
    /// its input's RMSNorm itself, the normed row's vec4s (constant 5, `NORM_IN`; 0:
    /// none).
    Front(Tiling, u32, u32),
    /// The split attention kernel's shape (`shaders/attention.comp`'s `HD`, `GQ`, `SR`,
    /// `PR`; [`super::attention::AttentionKernels::split_for`]).
    Attention([u32; 4]),
}

impl Spec {
    /// The constants, with ids from 0.
    pub fn constants(&self) -> Vec<u32> {
        match *self {
            Spec::Matmul(t) => vec![t.rows, t.unroll, t.lanes, t.wg],
            Spec::Front(t, router, norm) => vec![t.rows, t.unroll, t.lanes, t.wg, router, norm],
            Spec::Attention(c) => c.to_vec(),
        }
    }
}

impl Kernel {
    /// How a matmul-family kernel splits its work; `None` for the others.
    pub fn tiling(&self) -> Option<Tiling> {
        match self.spec {
            Some(Spec::Matmul(t) | Spec::Front(t, ..)) => Some(t),
            _ => None,
        }
    }

    /// Output rows one workgroup computes: lane groups × rows per lane group for the
    /// matmul kernels, 1 for the others.
    pub fn rows_per_wg(&self) -> u32 {
        self.tiling().map_or(1, |t| t.wg / t.lanes * t.rows)
    }

    /// Rows one lane group computes: the matmul kernels' rows per lane group, 1 for the
    /// others.
    pub fn rows_per_lane_group(&self) -> u32 {
        self.tiling().map_or(1, |t| t.rows)
    }

    /// Layout of the kernel's own descriptor set (set 0).
    pub fn set0(&self) -> Arc<DescriptorSetLayout> {
        self.layout.set_layouts()[0].clone()
    }
}

/// The dense and expert kernels of one weight type (`shaders/matmul.comp` built for it).
#[derive(Clone)]
pub struct TypedKernels {
    /// m=1 matrix-vector product.
    pub matvec: Kernel,
    /// `matvec` with `MatmulTuning::rows_wide` rows per lane group, for matrices of at least
    /// [`super::record::WIDE_ROWS`] rows (the same bytes: rows per lane group never change
    /// a summation order).
    pub matvec_wide: Kernel,
    /// Token-batched sibling of `matvec`.
    pub matmul: Kernel,
    /// m=1 fused gate/up projection with SiLU.
    pub gate_up: Kernel,
    /// Token-batched sibling of `gate_up`.
    pub gate_up_batched: Kernel,
    /// The m=1 expert down projection: `matvec` with `MatmulTuning::rows_down` rows
    /// per lane group (its batched sibling is `matmul`).
    pub down: Kernel,
    /// The embedding lookup, for the types the host does not widen (every type but f32
    /// and bf16): rows widened or dequantised on the device.
    pub embed: Option<Kernel>,
    /// Q6_K only: `matvec` and `matvec_wide` for matrices in the padded block layout
    /// (`matvec_q6_k_padded`, `super::buffers::Q6K_PADDED_BLOCK`).
    pub padded: Option<[Kernel; 2]>,
}

/// Every pipeline of the backend.
pub struct Kernels {
    device: Arc<Device>,
    tuning: MatmulTuning,
    /// The kernels of each weight type (indexed as [`DType::ALL`]), built on first use:
    /// a model pays start-up only for the types it holds.
    typed: [OnceLock<TypedKernels>; DType::ALL.len()],
    /// Row RMSNorm.
    pub rmsnorm: Kernel,
    /// Per-head QK RMSNorm, RoPE and the K/V append.
    pub qk_rope: Kernel,
    /// Causal GQA attention (split and fused paths).
    pub attention: super::attention::AttentionKernels,
    /// Weighted MoE combine with the residual add.
    pub accumulate: Kernel,
    /// The router's softmax and top-k ranking of each token.
    pub route: Kernel,
    /// The ranking of a device-routed decode step, with its expert tables.
    pub route_table: Kernel,
    /// The greedy choice of a logits row: each block's best value and index.
    pub argmax: Kernel,
    /// The greedy choice of a logits row: the best of the blocks', to the host.
    pub argmax_final: Kernel,
    /// The hybrid layers' kernels.
    pub delta: super::delta::DeltaKernels,
    /// The activation set layout shared by every kernel.
    pub act_layout: Arc<DescriptorSetLayout>,
}

/// The SPIR-V words of module `name` (a `shaders/` file compiled by `build.rs`, e.g.
/// `matvec_bf16`), as the pipelines here load them; for tools that build their own
/// pipelines from the same modules (the bench's `vulkan stats`).
pub fn spirv(name: &str) -> Result<Vec<u32>, VulkanError> {
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

/// Builds kernel `name`, specialised as `spec` says.
pub(crate) fn kernel(
    device: &Arc<Device>,
    act: &Arc<DescriptorSetLayout>,
    name: &str,
    spec: Option<Spec>,
) -> Result<Kernel, VulkanError> {
    let words = spirv(name)?;
    // SAFETY: the words are SPIR-V produced by glslc from this repository's shaders.
    let module = unsafe { ShaderModule::new(device.clone(), ShaderModuleCreateInfo::new(&words)) }
        .map_err(|e| verr(name)(&e))?;
    let constants = spec.iter().flat_map(|v| v.constants().into_iter().enumerate());
    let entry = module
        .specialize(constants.map(|(i, c)| (i as u32, SpecializationConstant::U32(c))).collect())
        .map_err(|e| verr(name)(&e))?
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
    Ok(Kernel { module: name.to_string(), spec, pipeline, layout })
}

impl Kernels {
    /// Builds every pipeline on `device`, the matmul kernels split as `tuning` says.
    pub fn new(device: &Arc<Device>, tuning: MatmulTuning) -> Result<Kernels, VulkanError> {
        let t = tuning;
        if !t.lanes.is_power_of_two()
            || !(2..=64).contains(&t.lanes)
            || !(1..=4).contains(&t.rows_m1)
            || !(1..=4).contains(&t.rows_down)
            || !(1..=4).contains(&t.rows_wide)
            || !(1..=4).contains(&t.rows_batched)
            || !(1..=4).contains(&t.rows_batched_blocks)
            || !(1..=8).contains(&t.unroll)
            || !(1..=8).contains(&t.unroll_dense)
        {
            return Err(VulkanError::Unsupported(format!("matmul tuning {t:?}")));
        }
        let p = device.physical_device().properties();
        let ops = p.subgroup_supported_operations.unwrap_or_default();
        let stages = p.subgroup_supported_stages.unwrap_or_default();
        if !ops.contains(SubgroupFeatures::BASIC | SubgroupFeatures::SHUFFLE)
            || !stages.contains(ShaderStages::COMPUTE)
        {
            return Err(VulkanError::Unsupported(
                "the device lacks subgroup shuffles in compute shaders".into(),
            ));
        }
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
        let k = |name: &str| kernel(device, &act_layout, name, None);
        Ok(Kernels {
            device: device.clone(),
            tuning,
            typed: Default::default(),
            rmsnorm: k("rmsnorm")?,
            qk_rope: k("qk_rope")?,
            attention: super::attention::AttentionKernels::new(device, &act_layout)?,
            accumulate: k("accumulate")?,
            route: k("route")?,
            route_table: k("route_table")?,
            argmax: k("argmax")?,
            argmax_final: k("argmax_final")?,
            delta: super::delta::DeltaKernels::new(device, &act_layout)?,
            act_layout,
        })
    }

    /// The m=1 expert down projection of weights of `dtype` with the MoE combine of a
    /// decode step's `k` experts ([`super::record::FLAG_COMBINE`]): `down`'s module and
    /// rows per lane group, `k` lane groups per workgroup; `None` where such a workgroup
    /// is larger than the device allows.
    pub fn down_combine(&self, dtype: DType, k: usize) -> Result<Option<Kernel>, VulkanError> {
        let t = self.tuning;
        let wg = k as u64 * t.lanes as u64;
        let limits = self.device.physical_device().properties();
        if wg > limits.max_compute_work_group_invocations as u64
            || wg > limits.max_compute_work_group_size[0] as u64
        {
            return Ok(None);
        }
        let spec =
            Spec::Matmul(Tiling { rows: t.rows_down, unroll: t.unroll, lanes: t.lanes, wg: wg as u32 });
        Ok(Some(kernel(&self.device, &self.act_layout, &format!("matvec_{}", dtype.name()), Some(spec))?))
    }

    /// The front of a device-routed decode step whose gate/up weights are `dtype` and
    /// whose router's are `router` (`gate_up_front_*`: `shaders/matmul.comp` with
    /// `FRONT`): the router, the ranking and the gate/up in one dispatch, the gate/up
    /// tuned as `gate_up` but for `FRONT_UNROLL`, `FRONT_WG` invocations a workgroup
    /// (fewer where the device allows fewer); with `norm` inputs (not 0), the front forms
    /// the RMSNorm of its input row itself (`FRONT_MAX_NORM` inputs at most); `None` for a
    /// router type it does not read. Built on each call (the caller keeps it).
    pub fn gate_up_front(
        &self,
        dtype: DType,
        router: DType,
        norm: usize,
    ) -> Result<Option<Kernel>, VulkanError> {
        let Some(router) = router_type(router) else { return Ok(None) };
        let t = self.tuning;
        let wg = FRONT_WG.min(self.device.physical_device().properties().max_compute_work_group_invocations);
        let tiling = Tiling { rows: t.rows_m1, unroll: FRONT_UNROLL, lanes: t.lanes, wg };
        let spec = Spec::Front(tiling, router, norm.div_ceil(4) as u32);
        Ok(Some(kernel(
            &self.device,
            &self.act_layout,
            &format!("gate_up_front_{}", dtype.name()),
            Some(spec),
        )?))
    }

    /// The kernels for weights of `dtype` (module suffix: the type's manifest name),
    /// built on the first call for that type.
    pub fn typed(&self, dtype: DType) -> Result<&TypedKernels, VulkanError> {
        let i = DType::ALL.iter().position(|&d| d == dtype).expect("DType::ALL lists every type");
        if let Some(t) = self.typed[i].get() {
            return Ok(t);
        }
        let (t, ty) = (self.tuning, dtype.name());
        let build = |name: String, rows: u32, unroll: u32, wg: u32| {
            kernel(
                &self.device,
                &self.act_layout,
                &name,
                Some(Spec::Matmul(Tiling { rows, unroll, lanes: t.lanes, wg })),
            )
        };
        let rows_batched = if dtype.is_block() { t.rows_batched_blocks } else { t.rows_batched };
        let built = TypedKernels {
            matvec: build(format!("matvec_{ty}"), t.rows_m1, t.unroll_dense, M1_WG)?,
            matvec_wide: build(format!("matvec_{ty}"), t.rows_wide, t.unroll, M1_WG)?,
            matmul: build(format!("matmul_{ty}"), rows_batched, t.unroll.min(2), WG_SIZE)?,
            gate_up: build(format!("gate_up_{ty}"), t.rows_m1, t.unroll, M1_WG)?,
            gate_up_batched: build(format!("gate_up_batched_{ty}"), rows_batched, t.unroll.min(2), WG_SIZE)?,
            down: build(format!("matvec_{ty}"), t.rows_down, t.unroll, M1_WG)?,
            embed: match dtype {
                DType::F32 | DType::Bf16 => None,
                _ => Some(kernel(&self.device, &self.act_layout, &format!("embed_{ty}"), None)?),
            },
            padded: match dtype {
                DType::Q6K => Some([
                    build(format!("matvec_{ty}_padded"), t.rows_m1, t.unroll_dense, M1_WG)?,
                    build(format!("matvec_{ty}_padded"), t.rows_wide, t.unroll, M1_WG)?,
                ]),
                _ => None,
            },
        };
        // Another thread may have built them meanwhile; either copy is the same.
        Ok(self.typed[i].get_or_init(|| built))
    }
}
