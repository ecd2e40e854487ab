//! The executor thread and [`VulkanForward`], the handle the rest of the engine uses.

use std::sync::Arc;
use std::thread::JoinHandle;

use smoe_proto::ExpertSource;

use super::allocator::{ArenaRegistry, VulkanAllocator};
use super::context::{DeviceInfo, VulkanContext};
use super::kv::{KvLayer, VulkanKvCache};
use super::runner::{ExpertPath, Runner};
use super::{VulkanError, VulkanForwardError};
use crate::engine::Engine;
use crate::forward::{ClaimEvent, ClaimTally, ForwardError};
use crate::forward_pass::ForwardPass;
use crate::model::Model;

struct ForwardJob {
    kv: Arc<Vec<KvLayer>>,
    start: usize,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    union_sizes: Vec<usize>,
    tally: ClaimTally,
    spec_depth: usize,
    want_logits: bool,
    trace: bool,
}

struct ForwardDone {
    result: Result<bool, VulkanForwardError>,
    job: ForwardJob,
    trace: Vec<ClaimEvent>,
}

enum Job {
    Forward(Box<ForwardJob>, flume::Sender<ForwardDone>),
    NewKv(flume::Sender<Result<VulkanKvCache, VulkanError>>),
    ExpertPath(ExpertPath, flume::Sender<Result<(), VulkanError>>),
}

fn serve(mut runner: Runner, jobs: flume::Receiver<Job>) {
    for job in jobs.iter() {
        match job {
            Job::Forward(mut f, reply) => {
                if f.trace {
                    runner.trace.get_or_insert_with(Vec::new);
                }
                runner.spec_depth = f.spec_depth;
                let result = runner.forward(&f.kv, f.start, &f.tokens, &mut f.logits, f.want_logits);
                f.union_sizes.clone_from(&runner.union_sizes);
                f.tally = runner.tally;
                let trace = runner.trace.as_mut().map(std::mem::take).unwrap_or_default();
                let _ = reply.send(ForwardDone { result, job: *f, trace });
            }
            Job::NewKv(reply) => {
                let _ = reply.send(runner.new_kv());
            }
            Job::ExpertPath(p, reply) => {
                let _ = reply.send(runner.set_path(p));
            }
        }
    }
}

/// Runs blocks of tokens through the model on a Vulkan device, taking experts from an
/// [`ExpertSource`]: the same behaviour and method shapes as
/// [`Forward`](crate::forward::Forward), with the KV cache on the device.
pub struct VulkanForward {
    jobs: Option<flume::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    model: Arc<Model>,
    max_rows: usize,
    info: DeviceInfo,
    job: Option<Box<ForwardJob>>,
    trace: Option<Vec<ClaimEvent>>,
}

impl VulkanForward {
    /// Starts the executor thread for blocks of up to `max_rows` tokens: uploads the
    /// resident weights and allocates every device buffer. `arenas` are the ring arenas
    /// whose slots the kernels read in place (blobs from elsewhere are copied);
    /// `hold_limit` is how many blobs `experts` can hand out at once (the ring's slots).
    pub fn new(
        ctx: Arc<VulkanContext>,
        arenas: ArenaRegistry,
        model: Arc<Model>,
        experts: Arc<dyn ExpertSource>,
        max_rows: usize,
        hold_limit: usize,
    ) -> Result<VulkanForward, VulkanError> {
        let (tx, rx) = flume::unbounded();
        let (ready_tx, ready_rx) = flume::bounded(1);
        let info = ctx.info.clone();
        let m = Arc::clone(&model);
        let thread = std::thread::Builder::new()
            .name("smoe-vulkan".into())
            .spawn(move || match Runner::new(ctx, arenas, m, experts, max_rows, hold_limit) {
                Ok(r) => {
                    let _ = ready_tx.send(Ok(()));
                    serve(r, rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| VulkanError::Vulkan(format!("starting the executor thread: {e}")))?;
        ready_rx.recv().map_err(|_| VulkanError::ExecutorGone)??;
        let cfg = &model.cfg;
        let job = ForwardJob {
            kv: Arc::new(Vec::new()),
            start: 0,
            tokens: Vec::with_capacity(max_rows),
            logits: Vec::with_capacity(cfg.vocab_size),
            union_sizes: vec![0; cfg.num_hidden_layers],
            tally: ClaimTally::default(),
            spec_depth: 0,
            want_logits: false,
            trace: false,
        };
        Ok(VulkanForward {
            jobs: Some(tx),
            thread: Some(thread),
            model,
            max_rows: max_rows.max(1),
            info,
            job: Some(Box::new(job)),
            trace: None,
        })
    }

    /// A forward pass over `engine`'s model and ring, whose slots `alloc` allocated.
    pub fn for_engine(
        ctx: Arc<VulkanContext>,
        alloc: &VulkanAllocator,
        engine: &Engine,
        max_rows: usize,
    ) -> Result<VulkanForward, VulkanError> {
        VulkanForward::new(
            ctx,
            alloc.registry(),
            engine.model.clone(),
            engine.ring.clone(),
            max_rows,
            engine.ring.n_slots(),
        )
    }

    fn send(&self, job: Job) -> Result<(), VulkanError> {
        self.jobs.as_ref().ok_or(VulkanError::ExecutorGone)?.send(job).map_err(|_| VulkanError::ExecutorGone)
    }

    /// An empty KV cache on the device.
    pub fn new_kv(&self) -> Result<VulkanKvCache, VulkanError> {
        let (tx, rx) = flume::bounded(1);
        self.send(Job::NewKv(tx))?;
        rx.recv().map_err(|_| VulkanError::ExecutorGone)?
    }

    /// The model this pass runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The device it runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// Largest block of tokens one call accepts.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Chooses where expert kernels read blobs: in place from the ring, or staged into
    /// device-local layer slots for prefill blocks (the default where the device has
    /// its own memory) or for every block. On single-heap devices a staged path first
    /// allocates the two layer slots (there it only serves to check staging).
    pub fn set_expert_path(&self, path: ExpertPath) -> Result<(), VulkanError> {
        let (tx, rx) = flume::bounded(1);
        self.send(Job::ExpertPath(path, tx))?;
        rx.recv().map_err(|_| VulkanError::ExecutorGone)?
    }

    /// Starts recording every expert claim (see [`VulkanForward::take_trace`]).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The claims recorded since the last call, in execution order.
    pub fn take_trace(&mut self) -> Vec<ClaimEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// For each decoder layer, how many distinct experts the last call's tokens were
    /// routed to (0 for dense layers).
    pub fn last_union_sizes(&self) -> &[usize] {
        self.job.as_ref().map(|j| j.union_sizes.as_slice()).unwrap_or(&[])
    }

    /// Claim accounting since this pass was created.
    pub fn tally(&self) -> ClaimTally {
        self.job.as_ref().map(|j| j.tally).unwrap_or_default()
    }

    /// Sets how many gate ranks beyond top-k a single-token (decode) step queues as
    /// speculative prefetches for the next token (0 disables).
    pub fn set_spec_depth(&mut self, depth: usize) {
        if let Some(j) = self.job.as_mut() {
            j.spec_depth = depth;
        }
    }

    /// Runs `tokens` (at positions `kv.len()..`) through every layer, appending their
    /// keys and values to `kv`. When `want_logits`, returns the logits of the last token.
    pub fn forward(
        &mut self,
        kv: &mut VulkanKvCache,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, VulkanForwardError> {
        let mut job = self.job.take().ok_or(VulkanError::ExecutorGone)?;
        job.kv = kv.layers.clone();
        job.start = kv.len;
        job.tokens.clear();
        job.tokens.extend_from_slice(tokens);
        job.want_logits = want_logits;
        job.trace = self.trace.is_some();
        let (tx, rx) = flume::bounded(1);
        self.send(Job::Forward(job, tx))?;
        let done = rx.recv().map_err(|_| VulkanError::ExecutorGone)?;
        self.job = Some(Box::new(done.job));
        if let Some(t) = self.trace.as_mut() {
            t.extend(done.trace);
        }
        done.result?;
        kv.len += tokens.len();
        let job = self.job.as_ref().expect("just returned");
        Ok(want_logits.then_some(job.logits.as_slice()))
    }
}

impl Drop for VulkanForward {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl From<VulkanForwardError> for ForwardError {
    fn from(e: VulkanForwardError) -> Self {
        match e {
            VulkanForwardError::Forward(e) => e,
            VulkanForwardError::Vulkan(e) => ForwardError::Device(e.to_string()),
        }
    }
}

impl ForwardPass for VulkanForward {
    type Kv = VulkanKvCache;
    fn model(&self) -> &Arc<Model> {
        VulkanForward::model(self)
    }
    fn max_rows(&self) -> usize {
        VulkanForward::max_rows(self)
    }
    fn new_kv(&self) -> Result<VulkanKvCache, ForwardError> {
        VulkanForward::new_kv(self).map_err(|e| ForwardError::Device(e.to_string()))
    }
    fn forward(
        &mut self,
        kv: &mut VulkanKvCache,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        Ok(VulkanForward::forward(self, kv, tokens, want_logits)?)
    }
    fn last_union_sizes(&self) -> &[usize] {
        VulkanForward::last_union_sizes(self)
    }
    fn tally(&self) -> ClaimTally {
        VulkanForward::tally(self)
    }
    fn set_spec_depth(&mut self, depth: usize) {
        VulkanForward::set_spec_depth(self, depth)
    }
    fn enable_trace(&mut self) {
        VulkanForward::enable_trace(self)
    }
    fn take_trace(&mut self) -> Vec<ClaimEvent> {
        VulkanForward::take_trace(self)
    }
}
