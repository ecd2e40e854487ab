//! `vulkan stats`: the driver's pipeline statistics of the matmul-family kernels and of
//! the decode step's other kernels.

use std::ptr;
use std::sync::Arc;

use ash::vk;
use vulkano::device::Device;
use vulkano::pipeline::PipelineLayout;
use vulkano::shader::{ShaderModule, ShaderModuleCreateInfo};
use vulkano::VulkanObject;

use smoe_actors::vulkan::harness::MatmulTuning;
use smoe_actors::vulkan::{spirv, Kernel, Kernels, Spec, TypedKernels, VulkanContext};
use smoe_proto::DType;

use crate::attention::SHAPE;
use crate::fail;
use crate::kernels::TYPES;

/// What a driver reports about one executable (a compiled shader stage) of a pipeline.
pub(crate) struct Executable {
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) subgroup_size: u32,
    /// (name, description, value) of every statistic, in the driver's order.
    pub(crate) stats: Vec<(String, String, String)>,
}

/// A driver-written, NUL-terminated name or description.
fn text(s: Result<&std::ffi::CStr, std::ffi::FromBytesUntilNulError>) -> String {
    s.map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| "?".into())
}

/// Fails on any result but `SUCCESS` and `INCOMPLETE` (fewer entries written than exist;
/// not expected, as the count cannot change between the two calls of the count-then-fill
/// idiom, and what was written is kept).
fn check(what: &str, r: vk::Result) -> Result<(), String> {
    match r {
        vk::Result::SUCCESS | vk::Result::INCOMPLETE => Ok(()),
        e => Err(format!("{what}: {e:?}")),
    }
}

/// The count-then-fill idiom: `call(count, null)` for the count, then `call(count,
/// array)` with that many default structures (their sType set); `what` names the call
/// in errors.
fn enumerate<T: Default + Clone>(
    what: &str,
    mut call: impl FnMut(&mut u32, *mut T) -> vk::Result,
) -> Result<Vec<T>, String> {
    let mut n = 0u32;
    check(what, call(&mut n, ptr::null_mut()))?;
    let mut items = vec![T::default(); n as usize];
    check(what, call(&mut n, items.as_mut_ptr()))?;
    items.truncate(n as usize);
    Ok(items)
}

/// The executables of `pipeline` (created with `CAPTURE_STATISTICS_KHR` on `device`,
/// which has VK_KHR_pipeline_executable_properties and `pipelineExecutableInfo` enabled)
/// and their statistics.
fn executables(device: &Device, pipeline: vk::Pipeline) -> Result<Vec<Executable>, String> {
    let f = &device.fns().khr_pipeline_executable_properties;
    let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
    // SAFETY: the extension is enabled on `device` (checked by the caller) and `pipeline`
    // is a live pipeline of it; `enumerate` passes a null array or one of `n` structures.
    let props = enumerate("vkGetPipelineExecutablePropertiesKHR", |n, out| unsafe {
        (f.get_pipeline_executable_properties_khr)(device.handle(), &info, n, out)
    })?;
    let mut out = Vec::new();
    for (i, p) in props.iter().enumerate() {
        let exe = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(i as u32);
        // SAFETY: as above; `i` is below the executable count the driver reported.
        let stats = enumerate("vkGetPipelineExecutableStatisticsKHR", |n, out| unsafe {
            (f.get_pipeline_executable_statistics_khr)(device.handle(), &exe, n, out)
        })?;
        let stats = stats
            .iter()
            .map(|s| {
                use vk::PipelineExecutableStatisticFormatKHR as F;
                // SAFETY: `format` names the union member the driver wrote.
                let value = unsafe {
                    match s.format {
                        F::BOOL32 => (s.value.b32 != vk::FALSE).to_string(),
                        F::INT64 => s.value.i64.to_string(),
                        F::UINT64 => s.value.u64.to_string(),
                        F::FLOAT64 => s.value.f64.to_string(),
                        other => format!("(format {other:?}: raw {:#x})", s.value.u64),
                    }
                };
                (text(s.name_as_c_str()), text(s.description_as_c_str()), value)
            })
            .collect();
        out.push(Executable {
            name: text(p.name_as_c_str()),
            description: text(p.description_as_c_str()),
            subgroup_size: p.subgroup_size,
            stats,
        });
    }
    Ok(out)
}

/// Creates a compute pipeline of `module` (entry `main`, specialization constants 0 to 3
/// = `spec`, none without it) with `layout`, as `Kernels::new` does but with
/// `CAPTURE_STATISTICS_KHR`, and returns what the driver reports about it; the pipeline is
/// destroyed before returning.
pub(crate) fn pipeline_stats(
    device: &Device,
    module: &ShaderModule,
    layout: &PipelineLayout,
    spec: Option<Vec<u32>>,
) -> Result<Vec<Executable>, String> {
    let entries: Vec<vk::SpecializationMapEntry> = (0..spec.as_ref().map_or(0, |s| s.len() as u32))
        .map(|i| vk::SpecializationMapEntry::default().constant_id(i).offset(4 * i).size(4))
        .collect();
    let data: Vec<u8> = spec.iter().flatten().flat_map(|v| v.to_ne_bytes()).collect();
    let spec_info = vk::SpecializationInfo::default().map_entries(&entries).data(&data);
    let stage = vk::PipelineShaderStageCreateInfo::default()
        .stage(vk::ShaderStageFlags::COMPUTE)
        .module(module.handle())
        .name(c"main")
        .specialization_info(&spec_info);
    let info = vk::ComputePipelineCreateInfo::default()
        .flags(vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR)
        .stage(stage)
        .layout(layout.handle())
        .base_pipeline_index(-1);
    let fns = device.fns();
    let mut pipeline = vk::Pipeline::null();
    // SAFETY: `module` and `layout` are live objects of `device` (the layout was made from
    // the same module's reflection by `Kernels::new`), `info` and everything it points to
    // (stage, specialization entries and data, the entry name) outlive the call, the
    // pipelineExecutableInfo feature that CAPTURE_STATISTICS_KHR needs is enabled (checked
    // by the caller), and one create info writes one pipeline.
    let r = unsafe {
        (fns.v1_0.create_compute_pipelines)(
            device.handle(),
            vk::PipelineCache::null(),
            1,
            &info,
            ptr::null(),
            &mut pipeline,
        )
    };
    if r != vk::Result::SUCCESS {
        return Err(format!("vkCreateComputePipelines: {r:?}"));
    }
    let out = executables(device, pipeline);
    // SAFETY: `pipeline` was created above, no command buffer uses it, and it is destroyed
    // once.
    unsafe { (fns.v1_0.destroy_pipeline)(device.handle(), pipeline, ptr::null()) };
    out
}

/// Prints what the driver reports about `kernel` (built from its module with its own
/// specialization constants and layout, plus `CAPTURE_STATISTICS_KHR`), headed by its
/// module name and `what`; adds each statistic's description to `legend` on first sight.
fn print_kernel(dev: &Arc<Device>, kernel: &Kernel, what: &str, legend: &mut Vec<(String, String)>) {
    let name = &kernel.module;
    let spec = kernel.spec.as_ref().map(Spec::constants);
    let words = spirv(name).unwrap_or_else(|e| fail(1, e.to_string()));
    // SAFETY: the words are SPIR-V produced by glslc from this repository's shaders, the
    // modules `Kernels::new` loads.
    let module = unsafe { ShaderModule::new(dev.clone(), ShaderModuleCreateInfo::new(&words)) }
        .unwrap_or_else(|e| fail(1, format!("shader module `{name}`: {e}")));
    println!("{name}{what}:");
    let exes = pipeline_stats(dev, &module, &kernel.layout, spec)
        .unwrap_or_else(|e| fail(1, format!("{name}: {e}")));
    if exes.is_empty() {
        println!("  (the driver reports no executables)");
    }
    for e in exes {
        println!("  executable `{}` (subgroup {}): {}", e.name, e.subgroup_size, e.description);
        if e.stats.is_empty() {
            println!("    (no statistics)");
        }
        for (stat, desc, value) in e.stats {
            println!("    {stat}: {value}");
            if !legend.iter().any(|(n, _)| *n == stat) {
                legend.push((stat, desc));
            }
        }
    }
}

/// `vulkan stats`: the driver's statistics for every matmul-family kernel, specialised
/// for the default tuning and then each of `extra`, and for the decode step's other
/// kernels (default tuning only: they take none).
pub fn stats(device: usize, extra: &[MatmulTuning]) {
    let ctx = VulkanContext::new(device).unwrap_or_else(|e| fail(1, e.to_string()));
    let dev = &ctx.device;
    if !dev.enabled_extensions().khr_pipeline_executable_properties
        || !dev.enabled_features().pipeline_executable_info
    {
        fail(
            2,
            format!(
                "device {device} ({}, {}) does not support VK_KHR_pipeline_executable_properties; its driver reports no pipeline statistics (run this on the GPU's own driver)",
                ctx.info.name, ctx.info.driver
            ),
        );
    }
    println!(
        "device: {} ({}, Vulkan {}, subgroup {:?})",
        ctx.info.name, ctx.info.driver, ctx.info.api_version, ctx.info.subgroup_size
    );
    let d = MatmulTuning::default();
    let mut tunings = vec![d];
    for &t in extra {
        if !tunings.contains(&t) {
            tunings.push(t);
        }
    }
    // Statistic name -> the driver's description, in first-seen order.
    let mut legend: Vec<(String, String)> = Vec::new();
    // Building each tuning's kernels checks the tuning as the backend does, before any
    // output; each kernel names its module, specialization and layout.
    let built: Vec<(MatmulTuning, Kernels)> = tunings
        .into_iter()
        .map(|t| (t, Kernels::new(dev, t).unwrap_or_else(|e| fail(2, format!("tuning {t:?}: {e}")))))
        .collect();
    for (t, kernels) in built {
        let default = if t == d { " (default)" } else { "" };
        println!("== tuning {t:?}{default}");
        let sets: Vec<&TypedKernels> = TYPES
            .iter()
            .map(|&d| kernels.typed(d).unwrap_or_else(|e| fail(1, format!("{d} kernels: {e}"))))
            .collect();
        let typed = |pick: fn(&TypedKernels) -> &Kernel| sets.iter().map(|t| pick(t)).collect::<Vec<_>>();
        let all = [
            ("", typed(|t| &t.matvec)),
            ("", typed(|t| &t.matmul)),
            ("", typed(|t| &t.gate_up)),
            ("", typed(|t| &t.gate_up_batched)),
            (" as the expert down projection", typed(|t| &t.down)),
            (" as the wide matvec (an LM head)", typed(|t| &t.matvec_wide)),
        ];
        for (role, kernel) in all.iter().flat_map(|(role, ks)| ks.iter().map(move |k| (role, k))) {
            let Some(Spec::Matmul(tiling)) = kernel.spec else {
                fail(1, format!("{} has no matmul specialization", kernel.module))
            };
            let what = format!("{role} ({tiling})");
            print_kernel(dev, kernel, &what, &mut legend);
        }
        if t == d {
            // The other kernels of a decode step (and of prefill), once: what each declares
            // and holds decides how the driver splits an SM's L1 and shared memory when
            // consecutive dispatches differ (bench/README.md, the null decode step).
            let split = kernels
                .attention
                .split_for(SHAPE)
                .unwrap_or_else(|e| fail(1, format!("attention_split: {e}")));
            let a = &kernels.attention;
            let others = [
                (&kernels.rmsnorm, ""),
                (&kernels.qk_rope, ""),
                (&*split, &format!(" (Qwen3-30B-A3B's shape: {SHAPE:?})")),
                (&a.combine, ""),
                (&a.fused, ""),
                (&kernels.route, ""),
                (&kernels.route_table, ""),
                (&kernels.accumulate, ""),
                (&kernels.argmax, ""),
                (&kernels.argmax_final, ""),
            ];
            for (kernel, what) in others {
                print_kernel(dev, kernel, what, &mut legend);
            }
            // The fused MoE front of each type (with a bf16 router, the synth vaults'), as it
            // runs after a norm and forming the norm itself: its registers and shared
            // memory decide whether its workgroups, one an SM, fit.
            for &ty in TYPES {
                for norm in [0, 2048] {
                    let front = kernels
                        .gate_up_front(ty, DType::Bf16, norm)
                        .unwrap_or_else(|e| fail(1, format!("{ty} front: {e}")));
                    let Some(front @ Kernel { spec: Some(Spec::Front(tiling, _, _)), .. }) = front else {
                        continue;
                    };
                    let how = if norm > 0 { format!(", forming a norm of {norm}") } else { String::new() };
                    print_kernel(dev, &front, &format!(" (the fused front: {tiling}{how})"), &mut legend);
                }
            }
        }
    }
    if !legend.is_empty() {
        println!("== statistics, as the driver describes them");
        for (stat, desc) in legend {
            println!("{stat}: {desc}");
        }
    }
}
