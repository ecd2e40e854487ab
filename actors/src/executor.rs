//! The GPU-executor stage as the rest of the engine sees it: one forward pass on the
//! backend the user chose (the CPU reference, or Vulkan compute), opened together with
//! the engine so the ring's slot memory comes from that backend's allocator.

use std::path::Path;
use std::sync::Arc;

use crate::engine::{Engine, EngineError, EngineOptions};
use crate::forward::{ClaimEvent, ClaimTally, Forward, ForwardError, KvCache};
use crate::forward_pass::{ForwardPass, KvState};
use crate::model::Model;
use crate::ring::memory::HostAllocator;

/// Which compute backend runs the math.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The CPU reference kernels.
    Cpu,
    /// Vulkan compute on device `device` (see `smoe-pipeline devices`).
    Vulkan,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "vulkan" => Ok(Backend::Vulkan),
            _ => Err(format!("unknown backend {s:?}: use cpu or vulkan")),
        }
    }
}

/// Why the executor could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The engine (vault, ring, streamer) could not open.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The Vulkan backend could not start.
    #[cfg(feature = "vulkan")]
    #[error(transparent)]
    Vulkan(#[from] crate::vulkan::VulkanError),
    /// This build has no Vulkan backend.
    #[cfg(not(feature = "vulkan"))]
    #[error("this build has no Vulkan backend (built without the `vulkan` feature); use --backend cpu")]
    NoVulkan,
}

/// A forward pass on the chosen backend.
pub enum Executor {
    /// CPU reference.
    Cpu(Box<Forward>),
    /// Vulkan compute.
    #[cfg(feature = "vulkan")]
    Vulkan(Box<crate::vulkan::VulkanForward>),
}

/// A KV cache of the executor's backend.
pub enum ExecutorKv {
    /// Host memory.
    Cpu(KvCache),
    /// Device memory.
    #[cfg(feature = "vulkan")]
    Vulkan(crate::vulkan::VulkanKvCache),
}

impl Executor {
    /// Opens the vault in `dir` with ring slots from `backend`'s allocator and starts a
    /// forward pass for blocks of up to `max_rows` tokens on device `device`.
    pub fn open(
        dir: &Path,
        opts: &EngineOptions,
        backend: Backend,
        device: usize,
        max_rows: usize,
    ) -> Result<(Engine, Executor), ExecutorError> {
        match backend {
            Backend::Cpu => {
                let engine = Engine::open(dir, opts, &HostAllocator)?;
                let fwd = engine.forward(max_rows);
                Ok((engine, Executor::Cpu(Box::new(fwd))))
            }
            #[cfg(feature = "vulkan")]
            Backend::Vulkan => {
                use crate::vulkan::{VulkanAllocator, VulkanContext, VulkanForward};
                let ctx = VulkanContext::new(device)?;
                let alloc = VulkanAllocator::new(ctx.clone());
                let engine = Engine::open(dir, opts, &alloc)?;
                let fwd = VulkanForward::for_engine(ctx, &alloc, &engine, max_rows)?;
                Ok((engine, Executor::Vulkan(Box::new(fwd))))
            }
            #[cfg(not(feature = "vulkan"))]
            Backend::Vulkan => {
                let _ = device;
                Err(ExecutorError::NoVulkan)
            }
        }
    }
}

impl KvState for ExecutorKv {
    fn len(&self) -> usize {
        match self {
            ExecutorKv::Cpu(k) => k.len(),
            #[cfg(feature = "vulkan")]
            ExecutorKv::Vulkan(k) => k.len(),
        }
    }
    fn truncate(&mut self, len: usize) {
        match self {
            ExecutorKv::Cpu(k) => k.truncate(len),
            #[cfg(feature = "vulkan")]
            ExecutorKv::Vulkan(k) => k.truncate(len),
        }
    }
}

/// Runs the same expression on whichever pass the executor holds.
macro_rules! each {
    ($self:expr, $f:ident => $e:expr) => {
        match $self {
            Executor::Cpu($f) => $e,
            #[cfg(feature = "vulkan")]
            Executor::Vulkan($f) => $e,
        }
    };
}

impl ForwardPass for Executor {
    type Kv = ExecutorKv;
    fn model(&self) -> &Arc<Model> {
        each!(self, f => f.model())
    }
    fn max_rows(&self) -> usize {
        each!(self, f => f.max_rows())
    }
    fn new_kv(&self) -> Result<ExecutorKv, ForwardError> {
        match self {
            Executor::Cpu(f) => Ok(ExecutorKv::Cpu(KvCache::new(f.model()))),
            #[cfg(feature = "vulkan")]
            Executor::Vulkan(f) => {
                f.new_kv().map(ExecutorKv::Vulkan).map_err(|e| ForwardError::Device(e.to_string()))
            }
        }
    }
    fn forward(
        &mut self,
        kv: &mut ExecutorKv,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        match (self, kv) {
            (Executor::Cpu(f), ExecutorKv::Cpu(kv)) => f.forward(kv, tokens, want_logits),
            #[cfg(feature = "vulkan")]
            (Executor::Vulkan(f), ExecutorKv::Vulkan(kv)) => {
                ForwardPass::forward(&mut **f, kv, tokens, want_logits)
            }
            #[cfg(feature = "vulkan")]
            _ => Err(ForwardError::Device("a KV cache of another backend was passed to the executor".into())),
        }
    }
    fn last_union_sizes(&self) -> &[usize] {
        each!(self, f => f.last_union_sizes())
    }
    fn tally(&self) -> ClaimTally {
        each!(self, f => f.tally())
    }
    fn set_spec_depth(&mut self, depth: usize) {
        each!(self, f => f.set_spec_depth(depth))
    }
    fn enable_trace(&mut self) {
        each!(self, f => f.enable_trace())
    }
    fn take_trace(&mut self) -> Vec<ClaimEvent> {
        each!(self, f => f.take_trace())
    }
}
