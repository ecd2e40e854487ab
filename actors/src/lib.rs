//! The stages of smoe-pipeline: vault access, expert sources, the CPU reference
//! kernels and forward pass, the router stage and sampling. Later stages (streamer, ring cache,
//! scheduler, GPU executor) are actors built on these.

pub mod blob_check;
pub mod cpu;
pub mod engine;
pub mod executor;
pub mod forward;
pub mod forward_pass;
pub mod generation;
pub mod kernels;
pub mod model;
pub mod ring;
pub mod router;
pub mod sampler;
pub mod scheduler;
pub mod streamer;
pub mod tensor;
pub mod vault;
#[cfg(feature = "vulkan")]
pub mod vulkan;
