//! The executor stage: runs the model definition on the backend the user chose (the
//! CPU reference, or Vulkan compute), opened together with the engine so the ring's
//! slot memory comes from that backend's allocator. [`moe`] is the MoE step every
//! backend shares; [`Pass`] is the model definition over one backend.

mod lookahead;
pub mod moe;
mod pass;
mod profile;

use std::path::Path;
use std::sync::Arc;

pub use pass::Pass;

use smoe_proto::{ClaimEvent, ClaimTally, VramSnapshot};

use crate::contract::{ForwardError, ForwardPass, KvState};
use crate::cpu::{CpuBackend, KvCache};
use crate::engine::{Engine, EngineError, EngineOptions};
use crate::model::Model;
use crate::profile::PhaseProfile;
use crate::ring::memory::HostAllocator;

/// Which compute backend runs the math (config key and flag `backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The CPU reference kernels.
    Cpu,
    /// Vulkan compute on device `device` (see `smoe-pipeline devices`).
    Vulkan,
}

impl BackendKind {
    /// Its name, as the `backend` key and flag take it.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Vulkan => "vulkan",
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [BackendKind::Cpu, BackendKind::Vulkan]
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown backend {s:?}: use cpu or vulkan"))
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

/// The model definition on the CPU backend.
pub type CpuPass = Pass<CpuBackend>;

/// A CPU pass over `engine`'s model and ring for blocks of up to `max_rows` tokens,
/// reading ahead as the engine says.
pub fn cpu_pass(engine: &Engine, max_rows: usize) -> CpuPass {
    Pass::for_engine(CpuBackend::new(engine.model.clone(), max_rows), engine, max_rows)
}

/// A forward pass on the chosen backend.
pub enum Executor {
    /// CPU reference.
    Cpu(Box<CpuPass>),
    /// Vulkan compute (on its own thread).
    #[cfg(feature = "vulkan")]
    Vulkan(Box<crate::vulkan::VulkanPass>),
}

/// A cache of the executor's backend.
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
        backend: BackendKind,
        device: usize,
        max_rows: usize,
    ) -> Result<(Engine, Executor), ExecutorError> {
        match backend {
            BackendKind::Cpu => {
                let engine = Engine::open(dir, opts, &HostAllocator)?;
                let pass = cpu_pass(&engine, max_rows);
                Ok((engine, Executor::Cpu(Box::new(pass))))
            }
            #[cfg(feature = "vulkan")]
            BackendKind::Vulkan => {
                use crate::vulkan::{VulkanAllocator, VulkanContext, VulkanPass};
                let ctx = VulkanContext::new(device)?;
                let alloc = VulkanAllocator::new(ctx.clone());
                let engine = Engine::open(dir, opts, &alloc)?;
                let pass = VulkanPass::for_engine(
                    ctx,
                    &alloc,
                    &engine,
                    max_rows,
                    (opts.vram, opts.moe_front_groups),
                )?;
                Ok((engine, Executor::Vulkan(Box::new(pass))))
            }
            #[cfg(not(feature = "vulkan"))]
            BackendKind::Vulkan => {
                let _ = device;
                Err(ExecutorError::NoVulkan)
            }
        }
    }

    /// Another pass on the same backend and device over `engine` (the one this pass
    /// was opened with: they share its ring), for blocks of up to `max_rows` tokens.
    pub fn sibling(&self, engine: &Engine, max_rows: usize) -> Result<Executor, ExecutorError> {
        match self {
            Executor::Cpu(_) => Ok(Executor::Cpu(Box::new(cpu_pass(engine, max_rows)))),
            #[cfg(feature = "vulkan")]
            Executor::Vulkan(v) => Ok(Executor::Vulkan(Box::new(v.sibling(engine, max_rows)?))),
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
    fn truncate(&mut self, len: usize) -> usize {
        match self {
            ExecutorKv::Cpu(k) => k.truncate(len),
            #[cfg(feature = "vulkan")]
            ExecutorKv::Vulkan(k) => k.truncate(len),
        }
    }
    fn reusable(&self, len: usize) -> usize {
        match self {
            ExecutorKv::Cpu(k) => k.reusable(len),
            #[cfg(feature = "vulkan")]
            ExecutorKv::Vulkan(k) => k.reusable(len),
        }
    }
    fn snapshot(&mut self) {
        match self {
            ExecutorKv::Cpu(k) => k.snapshot(),
            #[cfg(feature = "vulkan")]
            ExecutorKv::Vulkan(k) => k.snapshot(),
        }
    }
    fn advance(&mut self, n: usize) {
        match self {
            ExecutorKv::Cpu(k) => k.advance(n),
            #[cfg(feature = "vulkan")]
            ExecutorKv::Vulkan(k) => k.advance(n),
        }
    }
}

/// A cache of one backend handed to the other's pass.
#[cfg(feature = "vulkan")]
fn wrong_kv() -> ForwardError {
    ForwardError::Device("a cache of another backend was passed to the executor".into())
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
            Executor::Cpu(f) => f.new_kv().map(ExecutorKv::Cpu),
            #[cfg(feature = "vulkan")]
            Executor::Vulkan(f) => f.new_kv().map(ExecutorKv::Vulkan),
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
            (Executor::Vulkan(f), ExecutorKv::Vulkan(kv)) => f.forward(kv, tokens, want_logits),
            #[cfg(feature = "vulkan")]
            _ => Err(wrong_kv()),
        }
    }
    fn forward_greedy(&mut self, kv: &mut ExecutorKv, tokens: &[u32]) -> Result<u32, ForwardError> {
        match (self, kv) {
            (Executor::Cpu(f), ExecutorKv::Cpu(kv)) => f.forward_greedy(kv, tokens),
            #[cfg(feature = "vulkan")]
            (Executor::Vulkan(f), ExecutorKv::Vulkan(kv)) => f.forward_greedy(kv, tokens),
            #[cfg(feature = "vulkan")]
            _ => Err(wrong_kv()),
        }
    }
    fn last_union_sizes(&self) -> &[usize] {
        each!(self, f => f.last_union_sizes())
    }
    fn tally(&self) -> ClaimTally {
        each!(self, f => f.tally())
    }
    fn vram(&self) -> Option<VramSnapshot> {
        each!(self, f => f.vram())
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
    fn set_profiling(&mut self, on: bool) -> Result<(), ForwardError> {
        each!(self, f => f.set_profiling(on))
    }
    fn profile(&mut self) -> Option<PhaseProfile> {
        each!(self, f => f.profile())
    }
}
