//! The Vulkan backend (vulkano), a peer of the CPU backend: [`VulkanBackend`] implements
//! the [`Backend`](crate::contract::Backend) operations with compute shaders
//! (`shaders/`), reading experts through the VRAM tier (device-local copies of the
//! experts it multiplies, filled from the ring) on devices with their own memory, or
//! ring slots in host-visible memory in place, or staging a prefill layer's union into
//! device-local layer slots. [`VulkanPass`] runs the shared model definition over it.
//!
//! vulkano's command-buffer builders are not `Send`, so all recording and submission
//! happens on one executor thread that owns the device state; [`VulkanPass`] sends it
//! jobs through its mailbox and waits for the reply.
//!
//! Numerics: every kernel has a fixed reduction order per output element that does not
//! depend on how many tokens one dispatch covers, so the batched kernels are
//! byte-identical to the m=1 kernels and layer-major prefill is byte-identical to
//! token-serial replay on this backend. Results differ from the CPU backend only by
//! rounding (different summation trees, GPU `exp`/`sqrt`).

mod allocator;
mod arena;
pub mod attention;
mod backend;
mod buffers;
mod context;
pub mod delta;
mod device_route;
mod experts;
mod kv;
mod pipelines;
pub mod record;
pub mod replacement;
mod replay;
mod thread;
mod timing;
mod vram;
mod weights;

#[cfg(feature = "test-harness")]
pub mod harness;

pub use allocator::{ArenaRegistry, VulkanAllocator};
pub use backend::VulkanBackend;
pub use context::{list_devices, DeviceInfo, VulkanContext};
pub use experts::ExpertPath;
pub use kv::VulkanKvCache;
pub use pipelines::{spirv, Kernel, Kernels, Spec, Tiling, TypedKernels};
pub use thread::VulkanPass;

use crate::contract::ForwardError;

/// Why the Vulkan backend could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum VulkanError {
    /// The Vulkan loader is missing or unusable.
    #[error("cannot load Vulkan ({0}); install the loader and a driver (Debian: `apt-get install libvulkan1 mesa-vulkan-drivers`, or your GPU vendor's driver), or use --backend cpu")]
    NoLoader(String),
    /// No usable device.
    #[error("no usable Vulkan device: {0}; install a Vulkan driver (mesa-vulkan-drivers, or your GPU vendor's driver), pick another with --device, or use --backend cpu")]
    NoDevice(String),
    /// The model needs something the kernels or the device do not support.
    #[error("the Vulkan backend cannot run this model: {0}; use --backend cpu")]
    Unsupported(String),
    /// A setting the device cannot honour (the message names it).
    #[error("invalid setting {0}")]
    Setting(String),
    /// A Vulkan call failed.
    #[error("Vulkan error while {0}")]
    Vulkan(String),
    /// The executor thread is gone (it stopped after an earlier failure).
    #[error("the Vulkan executor thread has stopped")]
    ExecutorGone,
}

impl From<VulkanError> for ForwardError {
    fn from(e: VulkanError) -> Self {
        ForwardError::Device(e.to_string())
    }
}
