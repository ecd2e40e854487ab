//! `smoe-pipeline devices`: the Vulkan devices this machine has, with their memory and
//! the limits the Vulkan backend works within.

use anyhow::Result;

use crate::cli::DevicesArgs;

/// Runs `devices`.
#[cfg(feature = "vulkan")]
pub fn run(args: &DevicesArgs) -> Result<()> {
    let devs = smoe_actors::vulkan::list_devices()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&devs)?);
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for d in &devs {
        println!("{}: {} ({}, Vulkan {}, driver {})", d.index, d.name, d.kind, d.api_version, d.driver);
        for (i, (size, local)) in d.heaps.iter().enumerate() {
            println!("   heap {i}: {:.1} GiB{}", gib(*size), if *local { " device-local" } else { "" });
        }
        println!(
            "   unified memory: {}; max storage-buffer range {} MiB; max allocation {}; shared memory {} KiB; {} invocations/workgroup; subgroup {}",
            if d.unified_memory { "yes (experts read in place, no staging)" } else { "no (prefill stages experts)" },
            d.max_storage_buffer_range >> 20,
            d.max_allocation.map(|b| format!("{:.1} GiB", gib(b))).unwrap_or_else(|| "unknown".into()),
            d.max_shared_memory >> 10,
            d.max_invocations,
            d.subgroup_size.map(|s| s.to_string()).unwrap_or_else(|| "unknown".into()),
        );
        if let Some(n) = d.sm_count {
            println!(
                "   {n} SMs: the fused MoE front's workgroups (`moe_front_groups`), one an SM: {n} by default, at most {n}"
            );
        }
        if !d.usable {
            println!("   not usable: needs Vulkan 1.2 and a compute queue");
        }
    }
    Ok(())
}

/// Runs `devices` in a build without the Vulkan backend.
#[cfg(not(feature = "vulkan"))]
pub fn run(_args: &DevicesArgs) -> Result<()> {
    anyhow::bail!(
        "this build has no Vulkan backend (rebuild with the `vulkan` feature), or use --backend cpu"
    )
}
