//! Finding a Vulkan device and opening it: the loader, the instance, the physical
//! device chosen by index, its compute (and, where the device has one, transfer) queue,
//! and the allocators every other part of the backend uses.

use std::sync::Arc;

use vulkano::command_buffer::allocator::StandardCommandBufferAllocator;
use vulkano::descriptor_set::allocator::StandardDescriptorSetAllocator;
use vulkano::device::physical::{PhysicalDevice, PhysicalDeviceType};
use vulkano::device::{
    Device, DeviceCreateInfo, DeviceExtensions, DeviceFeatures, Queue, QueueCreateInfo, QueueFlags,
};
use vulkano::instance::{Instance, InstanceCreateFlags, InstanceCreateInfo};
use vulkano::memory::allocator::StandardMemoryAllocator;
use vulkano::memory::MemoryPropertyFlags;
use vulkano::{Version, VulkanLibrary};

use super::VulkanError;

/// What `smoe-pipeline devices` prints about one physical device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    /// Index to pass as `--device`.
    pub index: usize,
    /// Driver-reported name.
    pub name: String,
    /// Discrete, integrated, virtual, CPU or other.
    pub kind: String,
    /// Vulkan version the device supports.
    pub api_version: String,
    /// Driver name, where reported.
    pub driver: String,
    /// Memory heaps: (bytes, device-local).
    pub heaps: Vec<(u64, bool)>,
    /// Whether some memory type is both device-local and host-visible on every heap
    /// (integrated GPUs and CPU drivers): experts are then used where they are read.
    pub unified_memory: bool,
    /// Largest range one storage-buffer descriptor may bind.
    pub max_storage_buffer_range: u64,
    /// Largest single allocation, where reported.
    pub max_allocation: Option<u64>,
    /// Shared memory per workgroup.
    pub max_shared_memory: u32,
    /// Invocations per workgroup.
    pub max_invocations: u32,
    /// Subgroup width, where reported.
    pub subgroup_size: Option<u32>,
    /// Streaming multiprocessors, where the driver reports them (NVIDIA's
    /// VK_NV_shader_sm_builtins): how many workgroups of a kernel that needs all of its
    /// workgroups resident at once (one an SM, as `moe_front_groups` sets the fused MoE
    /// front's) a dispatch may have.
    pub sm_count: Option<u32>,
    /// Whether the device can run this backend (Vulkan 1.2 and a compute queue).
    pub usable: bool,
}

/// Loads the Vulkan loader and creates an instance, with errors that name the fix.
fn instance() -> Result<Arc<Instance>, VulkanError> {
    let library = VulkanLibrary::new().map_err(|e| VulkanError::NoLoader(e.to_string()))?;
    Instance::new(
        library,
        InstanceCreateInfo {
            flags: InstanceCreateFlags::ENUMERATE_PORTABILITY,
            application_name: Some("smoe-pipeline".into()),
            ..Default::default()
        },
    )
    .map_err(|e| VulkanError::NoLoader(format!("cannot create a Vulkan instance: {e}")))
}

fn physical_devices() -> Result<Vec<Arc<PhysicalDevice>>, VulkanError> {
    let inst = instance()?;
    let devs: Vec<_> = inst
        .enumerate_physical_devices()
        .map_err(|e| VulkanError::NoDevice(format!("cannot enumerate devices: {e}")))?
        .collect();
    if devs.is_empty() {
        return Err(VulkanError::NoDevice("the Vulkan loader found no device".into()));
    }
    Ok(devs)
}

fn compute_family(p: &PhysicalDevice) -> Option<u32> {
    p.queue_family_properties()
        .iter()
        .position(|q| q.queue_flags.contains(QueueFlags::COMPUTE))
        .map(|i| i as u32)
}

/// A family with transfer but neither graphics nor compute (a DMA engine), if any.
fn transfer_family(p: &PhysicalDevice) -> Option<u32> {
    p.queue_family_properties()
        .iter()
        .position(|q| {
            q.queue_flags.contains(QueueFlags::TRANSFER)
                && !q.queue_flags.intersects(QueueFlags::COMPUTE | QueueFlags::GRAPHICS)
        })
        .map(|i| i as u32)
}

/// Whether every device-local heap is also reachable through a host-visible,
/// device-local memory type (one physical memory: lavapipe, integrated GPUs).
fn is_unified(p: &PhysicalDevice) -> bool {
    let mp = p.memory_properties();
    let both = MemoryPropertyFlags::DEVICE_LOCAL | MemoryPropertyFlags::HOST_VISIBLE;
    mp.memory_heaps.iter().enumerate().all(|(hi, h)| {
        !h.flags.contains(vulkano::memory::MemoryHeapFlags::DEVICE_LOCAL)
            || mp.memory_types.iter().any(|t| t.heap_index as usize == hi && t.property_flags.contains(both))
    }) && mp.memory_heaps.len() == 1
}

fn info(index: usize, p: &PhysicalDevice) -> DeviceInfo {
    let pr = p.properties();
    let kind = match pr.device_type {
        PhysicalDeviceType::DiscreteGpu => "discrete GPU",
        PhysicalDeviceType::IntegratedGpu => "integrated GPU",
        PhysicalDeviceType::VirtualGpu => "virtual GPU",
        PhysicalDeviceType::Cpu => "CPU",
        _ => "other",
    };
    let v = p.api_version();
    DeviceInfo {
        index,
        name: pr.device_name.clone(),
        kind: kind.into(),
        api_version: format!("{}.{}.{}", v.major, v.minor, v.patch),
        driver: pr.driver_name.clone().unwrap_or_default(),
        heaps: p
            .memory_properties()
            .memory_heaps
            .iter()
            .map(|h| (h.size, h.flags.contains(vulkano::memory::MemoryHeapFlags::DEVICE_LOCAL)))
            .collect(),
        unified_memory: is_unified(p),
        max_storage_buffer_range: pr.max_storage_buffer_range as u64,
        max_allocation: pr.max_memory_allocation_size,
        max_shared_memory: pr.max_compute_shared_memory_size,
        max_invocations: pr.max_compute_work_group_invocations,
        subgroup_size: pr.subgroup_size,
        sm_count: pr.shader_sm_count,
        usable: v >= Version::V1_2 && compute_family(p).is_some(),
    }
}

/// Lists every Vulkan device the loader sees.
pub fn list_devices() -> Result<Vec<DeviceInfo>, VulkanError> {
    Ok(physical_devices()?.iter().enumerate().map(|(i, p)| info(i, p)).collect())
}

/// An opened device with its queues and allocators.
pub struct VulkanContext {
    /// The logical device.
    pub device: Arc<Device>,
    /// Queue all kernels run on.
    pub compute: Arc<Queue>,
    /// A dedicated transfer queue (DMA engine), where the device has one.
    pub transfer: Option<Arc<Queue>>,
    /// Buffer memory.
    pub memory: Arc<StandardMemoryAllocator>,
    /// Descriptor sets.
    pub descriptors: Arc<StandardDescriptorSetAllocator>,
    /// Command buffers.
    pub commands: Arc<StandardCommandBufferAllocator>,
    /// What the device is.
    pub info: DeviceInfo,
}

impl VulkanContext {
    /// Opens device `index` (as listed by [`list_devices`]).
    pub fn new(index: usize) -> Result<Arc<VulkanContext>, VulkanError> {
        let devs = physical_devices()?;
        let p = devs.get(index).cloned().ok_or_else(|| {
            VulkanError::NoDevice(format!(
                "there is no Vulkan device {index} (found {}: see `smoe-pipeline devices`)",
                devs.len()
            ))
        })?;
        let info = info(index, &p);
        if !info.usable {
            return Err(VulkanError::NoDevice(format!(
                "device {index} ({}) supports Vulkan {} without what this backend needs (Vulkan 1.2 and a compute queue)",
                info.name, info.api_version
            )));
        }
        let cf = compute_family(&p).expect("checked usable");
        let tf = transfer_family(&p);
        let mut queue_create_infos = vec![QueueCreateInfo { queue_family_index: cf, ..Default::default() }];
        if let Some(tf) = tf {
            queue_create_infos.push(QueueCreateInfo { queue_family_index: tf, ..Default::default() });
        }
        // Pipeline statistics (registers, spills) for the bench's `vulkan stats`, where the
        // driver offers them; no pipeline of the backend asks for them.
        let stats = p.supported_extensions().khr_pipeline_executable_properties
            && p.supported_features().pipeline_executable_info;
        // Host resets of timestamp queries, for the phase profile's device times.
        let host_query_reset = p.supported_features().host_query_reset;
        let create = DeviceCreateInfo {
            queue_create_infos,
            enabled_extensions: DeviceExtensions {
                khr_pipeline_executable_properties: stats,
                ..DeviceExtensions::empty()
            },
            enabled_features: DeviceFeatures {
                pipeline_executable_info: stats,
                host_query_reset,
                ..DeviceFeatures::empty()
            },
            ..Default::default()
        };
        let (device, mut queues) = Device::new(p, create)
            .map_err(|e| VulkanError::NoDevice(format!("cannot open device {index}: {e}")))?;
        let compute = queues.next().expect("one queue per family asked for");
        let transfer = tf.and_then(|_| queues.next());
        Ok(Arc::new(VulkanContext {
            memory: Arc::new(StandardMemoryAllocator::new_default(device.clone())),
            descriptors: Arc::new(StandardDescriptorSetAllocator::new(device.clone(), Default::default())),
            commands: Arc::new(StandardCommandBufferAllocator::new(device.clone(), Default::default())),
            device,
            compute,
            transfer,
            info,
        }))
    }

    /// Queue families that buffers shared between the compute and transfer queues use.
    pub fn families(&self) -> Vec<u32> {
        let mut f = vec![self.compute.queue_family_index()];
        if let Some(t) = &self.transfer {
            f.push(t.queue_family_index());
        }
        f
    }
}
