//! [`VulkanPass`]: the model definition over [`VulkanBackend`] on the executor thread.
//! vulkano's command-buffer builders are not `Send`, so the backend lives on one thread
//! (a [`ThreadActor`]) and this handle sends it plain messages and waits for replies.

use std::sync::Arc;

use super::allocator::{ArenaRegistry, VulkanAllocator};
use super::backend::VulkanBackend;
use super::context::{DeviceInfo, VulkanContext};
use super::experts::ExpertPath;
use super::kv::VulkanKvCache;
use super::replay::Emit;
use super::VulkanError;
use smoe_proto::{ClaimEvent, ClaimTally, VramSnapshot};

use crate::contract::{ForwardError, ForwardPass, KvState};
use crate::engine::{Engine, VramSize};
use crate::executor::Pass;
use crate::mailbox::{SpawnError, ThreadActor};
use crate::model::Model;
use crate::profile::PhaseProfile;

/// A request to the executor thread.
enum Job {
    /// Run a block: the cache (its device buffers are shared), the tokens, what to hand
    /// back, the bet depth, whether to trace, and the buffers the reply fills (moved back
    /// and forth, so a step allocates nothing).
    Forward {
        kv: VulkanKvCache,
        tokens: Vec<u32>,
        emit: Emit,
        spec_depth: usize,
        trace: bool,
        logits: Vec<f32>,
        union_sizes: Vec<usize>,
    },
    NewKv,
    ExpertPath(ExpertPath),
    /// Start or stop the phase profile.
    SetProfiling(bool),
    /// Send the phase profile.
    Profile,
    /// Send the VRAM tier's counters and slot states.
    Vram,
}

/// The executor thread's answer.
enum Reply {
    Forward {
        result: Result<(), ForwardError>,
        kv: VulkanKvCache,
        tokens: Vec<u32>,
        logits: Vec<f32>,
        greedy: Option<u32>,
        union_sizes: Vec<usize>,
        tally: ClaimTally,
        trace: Vec<ClaimEvent>,
    },
    NewKv(Result<VulkanKvCache, ForwardError>),
    ExpertPath(Result<(), VulkanError>),
    SetProfiling(Result<(), ForwardError>),
    Profile(Option<PhaseProfile>),
    Vram(Option<VramSnapshot>),
}

/// What the executor thread owns: the pass over the device.
struct Worker {
    pass: Pass<VulkanBackend>,
}

fn serve(ex: &mut Worker, job: Job) -> Reply {
    match job {
        Job::Forward { mut kv, tokens, emit, spec_depth, trace, mut logits, mut union_sizes } => {
            let pass = &mut ex.pass;
            pass.moe_mut().set_spec_depth(spec_depth);
            pass.backend_mut().set_greedy_only(emit == Emit::Greedy);
            if trace {
                pass.moe_mut().enable_trace();
            }
            let result = pass.backend_mut().record_state_ops(&kv);
            let result = result.and_then(|()| pass.run(&mut kv, &tokens, emit != Emit::Nothing).map(|_| ()));
            // The logits change hands, not bytes (a vocabulary's row is ~600 KB).
            logits.clear();
            if result.is_ok() && emit == Emit::Logits {
                pass.backend_mut().swap_logits(&mut logits);
            }
            let greedy = pass.backend_mut().take_greedy();
            union_sizes.clone_from_slice(pass.moe().union_sizes());
            Reply::Forward {
                result,
                kv,
                tokens,
                logits,
                greedy,
                union_sizes,
                tally: pass.moe().tally(),
                trace: pass.moe_mut().take_trace(),
            }
        }
        Job::NewKv => Reply::NewKv(ex.pass.new_kv()),
        Job::ExpertPath(p) => Reply::ExpertPath(ex.pass.backend_mut().set_path(p)),
        Job::SetProfiling(on) => Reply::SetProfiling(ex.pass.set_profiling(on)),
        Job::Profile => Reply::Profile(ex.pass.profile()),
        Job::Vram => Reply::Vram(ex.pass.backend_mut().vram()),
    }
}

/// Runs blocks of tokens through the model on a Vulkan device: the model definition
/// and MoE step shared with every backend, with the cache on the device.
pub struct VulkanPass {
    actor: ThreadActor<Job, Reply>,
    ctx: Arc<VulkanContext>,
    arenas: ArenaRegistry,
    model: Arc<Model>,
    max_rows: usize,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    union_sizes: Vec<usize>,
    tally: ClaimTally,
    /// The VRAM tier's setting and the fused MoE front's workgroups (siblings get the
    /// same).
    device: (VramSize, Option<u32>),
    spec_depth: usize,
    trace: Option<Vec<ClaimEvent>>,
}

impl VulkanPass {
    /// A pass over `engine`'s model and ring, whose slots `alloc` allocated, for blocks
    /// of up to `max_rows` tokens, with `device`'s VRAM tier setting and fused MoE front
    /// workgroups ([`crate::engine::EngineOptions`]): uploads the resident weights and
    /// allocates every device buffer on the executor thread.
    pub fn for_engine(
        ctx: Arc<VulkanContext>,
        alloc: &VulkanAllocator,
        engine: &Engine,
        max_rows: usize,
        device: (VramSize, Option<u32>),
    ) -> Result<VulkanPass, VulkanError> {
        VulkanPass::start(ctx, alloc.registry(), engine, max_rows, device)
    }

    /// Another pass on the same device over `engine` (whose ring this pass's allocator
    /// made), for blocks of up to `max_rows` tokens, with a VRAM tier of its own of the
    /// same setting.
    pub fn sibling(&self, engine: &Engine, max_rows: usize) -> Result<VulkanPass, VulkanError> {
        VulkanPass::start(self.ctx.clone(), self.arenas.clone(), engine, max_rows, self.device)
    }

    fn start(
        ctx: Arc<VulkanContext>,
        arenas: ArenaRegistry,
        engine: &Engine,
        max_rows: usize,
        device: (VramSize, Option<u32>),
    ) -> Result<VulkanPass, VulkanError> {
        let model = engine.model.clone();
        let (c, a, e) = (ctx.clone(), arenas.clone(), engine.clone());
        let init = move || {
            let backend = VulkanBackend::new(c, a, e.model.clone(), max_rows, device)?;
            Ok(Worker { pass: Pass::for_engine(backend, &e, max_rows) })
        };
        let actor = ThreadActor::spawn("vulkan", init, serve).map_err(|e| match e {
            SpawnError::Init(e) => e,
            e => VulkanError::Vulkan(format!("starting the executor thread: {e}")),
        })?;
        let layers = model.cfg.num_hidden_layers;
        Ok(VulkanPass {
            actor,
            ctx,
            arenas,
            max_rows: max_rows.max(1),
            logits: Vec::with_capacity(model.cfg.vocab_size),
            tokens: Vec::with_capacity(max_rows),
            union_sizes: vec![0; layers],
            tally: ClaimTally::default(),
            device,
            spec_depth: 0,
            trace: None,
            model,
        })
    }

    /// The device it runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.ctx.info
    }

    /// Chooses where expert kernels read blobs: in place from the ring, or staged into
    /// device-local layer slots for prefill blocks (the default where the device has
    /// its own memory) or for every block. On single-heap devices a staged path first
    /// allocates the two layer slots (there it only serves to check staging).
    pub fn set_expert_path(&self, path: ExpertPath) -> Result<(), VulkanError> {
        match self.actor.call(Job::ExpertPath(path)) {
            Ok(Reply::ExpertPath(r)) => r,
            _ => Err(VulkanError::ExecutorGone),
        }
    }

    /// Runs a block on the executor thread (see [`Job::Forward`]); returns the last
    /// token's greedy choice when `emit` asks for it (its logits, when asked for, are
    /// then in `self.logits`).
    fn run(
        &mut self,
        kv: &mut VulkanKvCache,
        tokens: &[u32],
        emit: Emit,
    ) -> Result<Option<u32>, ForwardError> {
        // Bad blocks are refused here, before the executor records the state copies the
        // cache waits for: a failed block makes a cache with recurrent state start over.
        self.model.check_block(kv.len(), tokens, self.max_rows)?;
        let mut batch = std::mem::take(&mut self.tokens);
        batch.clear();
        batch.extend_from_slice(tokens);
        let job = Job::Forward {
            kv: kv.clone(),
            tokens: batch,
            emit,
            spec_depth: self.spec_depth,
            trace: self.trace.is_some(),
            logits: std::mem::take(&mut self.logits),
            union_sizes: std::mem::take(&mut self.union_sizes),
        };
        let gone = || ForwardError::Device(VulkanError::ExecutorGone.to_string());
        let Reply::Forward { result, kv: done, tokens, logits, greedy, union_sizes, tally, trace } =
            self.actor.call(job).map_err(|_| gone())?
        else {
            return Err(gone());
        };
        self.tokens = tokens;
        self.logits = logits;
        self.union_sizes = union_sizes;
        self.tally = tally;
        if let Some(t) = self.trace.as_mut() {
            t.extend(trace);
        }
        match &result {
            Ok(_) => kv.book.ops_done(),
            Err(e) => {
                // The block's state copies and its states on the device may be half
                // done: the session never resumes from them.
                let lost = kv.book.forget();
                if kv.states.is_some() {
                    tracing::warn!(
                        "a hybrid session's block failed ({e}): its DeltaNet states and {lost} state \
                         snapshots on the device are dropped; its next request reuses no prefix"
                    );
                }
            }
        }
        result?;
        kv.advance(done.len() - kv.len());
        Ok(greedy)
    }
}

impl ForwardPass for VulkanPass {
    type Kv = VulkanKvCache;
    fn model(&self) -> &Arc<Model> {
        &self.model
    }
    fn max_rows(&self) -> usize {
        self.max_rows
    }
    fn new_kv(&self) -> Result<VulkanKvCache, ForwardError> {
        match self.actor.call(Job::NewKv) {
            Ok(Reply::NewKv(r)) => r,
            _ => Err(VulkanError::ExecutorGone.into()),
        }
    }
    fn forward(
        &mut self,
        kv: &mut VulkanKvCache,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        self.run(kv, tokens, if want_logits { Emit::Logits } else { Emit::Nothing })?;
        Ok(want_logits.then_some(self.logits.as_slice()))
    }
    fn forward_greedy(&mut self, kv: &mut VulkanKvCache, tokens: &[u32]) -> Result<u32, ForwardError> {
        self.run(kv, tokens, Emit::Greedy)?
            .ok_or_else(|| ForwardError::Device("the executor returned no greedy choice".into()))
    }
    fn last_union_sizes(&self) -> &[usize] {
        &self.union_sizes
    }
    fn tally(&self) -> ClaimTally {
        self.tally
    }
    fn vram(&self) -> Option<VramSnapshot> {
        match self.actor.call(Job::Vram) {
            Ok(Reply::Vram(v)) => v,
            _ => None,
        }
    }
    fn set_spec_depth(&mut self, depth: usize) {
        self.spec_depth = depth;
    }
    fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }
    fn take_trace(&mut self) -> Vec<ClaimEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }
    fn set_profiling(&mut self, on: bool) -> Result<(), ForwardError> {
        match self.actor.call(Job::SetProfiling(on)) {
            Ok(Reply::SetProfiling(r)) => r,
            _ => Err(VulkanError::ExecutorGone.into()),
        }
    }
    fn profile(&mut self) -> Option<PhaseProfile> {
        match self.actor.call(Job::Profile) {
            Ok(Reply::Profile(p)) => p,
            _ => None,
        }
    }
}
