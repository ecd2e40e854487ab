//! [`VulkanBackend`]: the [`Backend`] operations recorded into command buffers on the
//! executor thread. Operations append to the current recording; the sync points submit
//! it (after the work still in flight and any staging upload) and wait: one host sync
//! per MoE layer (the router's logits come back) and one at the end of a pass.

use std::sync::Arc;
use std::time::Instant;

use smoe_proto::{ExpertHandle, GateInput, RouteJob, VramSnapshot};
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::PrimaryAutoCommandBuffer;
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::sync::GpuFuture;

use super::allocator::ArenaRegistry;
use super::arena::Arena;
use super::attention::{AttentionArgs, AttentionShape};
use super::buffers::{device_buffer, host_buffer, verr};
use super::context::VulkanContext;
use super::delta::MAX_KEY_DIM;
use super::device_route::{DeviceRoutes, HeldNorm};
use super::experts::{ExpertPath, ExpertState};
use super::kv::{KvLayer, VulkanKvCache};
use super::pipelines::{Kernels, MatmulTuning, FRONT_MAX_NORM};
use super::record::{set0, MatmulArgs, Projection, Recorder, FLAG_ACCUMULATE};
use super::replay::{Emit, Replays, Shape};
use super::timing::{lock, DeviceTimer, SharedTimer};
use super::vram::VramTier;
use super::weights::{device_embeds, DeviceModel};
use super::VulkanError;
use crate::contract::{project_each, Backend, Flush, ForwardError, KvState, Plane, Write};
use crate::engine::VramSize;
use crate::model::{MixerRefs, Model};
use crate::profile::{Phase, PhaseProfile, Regime};
use crate::vault::TensorRef;

/// Most experts per layer the ranking kernel (`route.comp`) holds.
const MAX_EXPERTS: usize = 1024;

/// Device state of one forward pass (lives on the executor thread).
pub struct VulkanBackend {
    pub(super) ctx: Arc<VulkanContext>,
    pub(super) kernels: Arc<Kernels>,
    pub(super) model: Arc<Model>,
    pub(super) weights: DeviceModel,
    pub(super) a: Arena,
    pub(super) act: Subbuffer<[f32]>,
    act_set: Arc<DescriptorSet>,
    /// Host-visible: embeddings in, rankings and logits out.
    pub(super) io: Subbuffer<[f32]>,
    /// Where in `io` the rankings (rows of the arena's `routed`) and the logits lie.
    pub(super) io_routed: usize,
    io_logits: usize,
    /// Where in `io` the greedy choice comes back (one word, the index's bits).
    io_greedy: usize,
    /// The set binding `io` for the kernel that writes the greedy choice.
    greedy_set: Arc<DescriptorSet>,
    /// The recording in progress.
    rec: Option<Recorder>,
    /// A staging upload to run before `rec`.
    pub(super) transfer: Option<Arc<PrimaryAutoCommandBuffer>>,
    /// Work submitted but not waited for (staged batches of the current layer).
    pending: Option<Box<dyn GpuFuture>>,
    /// The last pass's logits (empty with `greedy_only`).
    logits: Vec<f32>,
    /// Passes keep only their greedy choice, not their logits.
    greedy_only: bool,
    /// The last pass's greedy choice, with `greedy_only`.
    greedy: Option<u32>,
    /// The routing buffer and expert-blob bindings.
    pub(super) ex: ExpertState,
    /// Device-routed decode steps, while the VRAM tier holds every expert.
    pub(super) routes: Option<DeviceRoutes>,
    /// Kept command buffers of device-routed decode steps.
    pub(super) replays: Replays,
    /// Device timestamps, while profiling.
    pub(super) timer: Option<SharedTimer>,
    /// A phase marked while nothing was being recorded: stamped when the next recording
    /// starts, once the pass has said whether it replays a kept one (which stamps nothing).
    phase_due: Option<(Regime, Phase)>,
    /// An m=1 norm not yet recorded: a fused MoE front may form it itself.
    pub(super) held_norm: Option<HeldNorm>,
}

impl VulkanBackend {
    /// Uploads the resident weights of `model` and sizes everything for `max_rows`
    /// tokens; `arenas` are the ring arenas whose slots kernels read in place; `vram`
    /// sizes the VRAM tier, `front_groups` sets the fused MoE front's workgroups
    /// ([`crate::engine::EngineOptions::moe_front_groups`]; `None`: the device's SM
    /// count where reported, else off).
    pub fn new(
        ctx: Arc<VulkanContext>,
        arenas: ArenaRegistry,
        model: Arc<Model>,
        max_rows: usize,
        (vram, front_groups): (VramSize, Option<u32>),
    ) -> Result<VulkanBackend, VulkanError> {
        let c = model.cfg.clone();
        AttentionShape::of(&c).check()?;
        if let Some(dk) = c.hybrid.as_ref().map(|h| h.linear_key_head_dim).filter(|&d| d > MAX_KEY_DIM) {
            return Err(VulkanError::Unsupported(format!("linear_key_head_dim {dk} > {MAX_KEY_DIM}")));
        }
        let m = max_rows.max(1);
        let kernels = Arc::new(Kernels::new(&ctx.device, MatmulTuning::default())?);
        kernels.attention.split_for(AttentionShape::of(&c))?;
        let a = Arena::new(&model, m)?;
        let act = device_buffer::<f32>(&ctx, a.len as u64, BufferUsage::STORAGE_BUFFER)?;
        let weights = DeviceModel::upload(&ctx, &kernels, &model)?;
        let tier = VramTier::new(&ctx, &model, vram, weights.bytes() + act.size())?;
        let ex = ExpertState::new(&ctx, &model, m, arenas, tier)?;
        let io_routed = m * c.hidden_size;
        let io_logits = io_routed + a.routed_len(m.max(c.num_hidden_layers));
        if c.num_experts > MAX_EXPERTS {
            return Err(VulkanError::Unsupported(format!("{} experts > {MAX_EXPERTS}", c.num_experts)));
        }
        let io_greedy = io_logits + c.vocab_size;
        // The device-routed steps' ranking kernel and the greedy choice write here directly.
        let io = host_buffer::<f32>(&ctx, io_greedy as u64 + 1, BufferUsage::STORAGE_BUFFER)?;
        // Zeroed once: the host clears a fused front's give-up marks after reading them.
        io.write().map_err(verr("clearing the readback buffer"))?.fill(0.0);
        let greedy_set = set0(&ctx, &kernels.argmax_final, &[io.clone().into_bytes()])?;
        // One workgroup an SM is what the front was timed at (bench/README.md); a device
        // that does not report its SMs does not get it unasked.
        let front_groups = front_groups.unwrap_or_else(|| ctx.info.sm_count.unwrap_or(0));
        let routes = DeviceRoutes::new(&ctx, &kernels, &model, ex.vram.as_ref(), &io, front_groups)?;
        let act_set = DescriptorSet::new(
            ctx.descriptors.clone(),
            kernels.act_layout.clone(),
            [WriteDescriptorSet::buffer(0, act.clone()), WriteDescriptorSet::buffer(1, ex.route_buf.clone())],
            [],
        )
        .map_err(verr("creating the activation set"))?;
        Ok(VulkanBackend {
            weights,
            a,
            act,
            act_set,
            io,
            io_routed,
            io_logits,
            io_greedy,
            greedy_set,
            rec: None,
            transfer: None,
            pending: None,
            logits: Vec::with_capacity(c.vocab_size),
            greedy_only: false,
            greedy: None,
            ex,
            routes,
            replays: Replays::default(),
            timer: None,
            phase_due: None,
            held_norm: None,
            kernels,
            ctx,
            model,
        })
    }

    /// Whether the passes from now on keep their logits (off) or only their greedy choice
    /// (on: [`VulkanBackend::take_greedy`]), chosen on the device (`shaders/argmax.comp`)
    /// so the logits stay there.
    pub fn set_greedy_only(&mut self, on: bool) {
        self.greedy_only = on;
    }

    /// The last pass's greedy choice, when it was asked for only that.
    pub fn take_greedy(&mut self) -> Option<u32> {
        self.greedy.take()
    }

    /// Exchanges the last pass's logits (see [`Backend::last_logits`]) with `into`'s
    /// buffer, whose contents the next pass's logits replace.
    pub fn swap_logits(&mut self, into: &mut Vec<f32>) {
        std::mem::swap(&mut self.logits, into);
    }

    /// Picks the expert path; a staged path on a device without separate device memory
    /// (where the default reads ring slots in place) allocates the layer slots first.
    pub fn set_path(&mut self, path: ExpertPath) -> Result<(), VulkanError> {
        self.ex.set_path(&self.ctx, &self.model, path)
    }

    /// The recording in progress (started on first use).
    pub(super) fn rec(&mut self) -> Result<&mut Recorder, VulkanError> {
        if self.rec.is_none() {
            let mut rec =
                Recorder::new(&self.ctx, self.kernels.clone(), self.act_set.clone(), self.replays.usage())?;
            rec.discard = self.replays.replaying();
            rec.timer = self.timer.clone();
            if let (Some(t), Some((regime, phase))) = (&self.timer, self.phase_due.take()) {
                lock(t).enter(regime, phase, rec.stampable())?;
            }
            self.rec = Some(rec);
        }
        let rec = self.rec.as_mut().expect("just started");
        if let Some(held) = self.held_norm.take() {
            // Another kernel comes first: the norm is recorded after all.
            record_norm(rec, self.a, self.model.cfg.rms_norm_eps, held.set, Plane::X, Plane::Xn, 1)?;
        }
        Ok(rec)
    }

    /// Submits the recording after the work still in flight and, where one is pending,
    /// after the staging upload (on the transfer queue where the device has one: it
    /// waits for nothing else, so it overlaps the work in flight, and the recording waits
    /// for it through a semaphore). With `wait` the host waits for everything; otherwise
    /// the submission stays in flight and the next one is ordered after it.
    pub(super) fn submit(&mut self, wait: bool) -> Result<(), VulkanError> {
        self.rec()?;
        let mut rec = self.rec.take().expect("just started");
        if let Some(t) = &self.timer {
            lock(t).end(&mut rec.cb)?;
        }
        let replay = self.replays.take_replay();
        if let (Some(timer), Some((_, Some(stamps)))) = (&self.timer, &replay) {
            lock(timer).replayed(stamps);
        }
        let cb = match replay {
            // A kept decode buffer with nothing before it: submitted as it is.
            Some((kept, _)) if wait && self.pending.is_none() && self.transfer.is_none() => {
                let t = Instant::now();
                self.replays.run(&self.ctx, kept)?;
                return self.finished(t);
            }
            Some((kept, _)) => kept,
            None => {
                let cb = rec.cb.build().map_err(verr("finishing a command buffer"))?;
                let timer = self.timer.clone();
                self.replays.keep(&cb, || timer.and_then(|t| lock(&t).last_stamps()));
                cb
            }
        };
        let e = verr("running a layer step");
        let now = || vulkano::sync::now(self.ctx.device.clone()).boxed();
        let start = self.pending.take().unwrap_or_else(now);
        let start = match (self.transfer.take(), &self.ctx.transfer) {
            (Some(t), Some(q)) => {
                let upload = now()
                    .then_execute(q.clone(), t)
                    .map_err(&e)?
                    .then_signal_semaphore_and_flush()
                    .map_err(verr("submitting a staging upload"))?;
                start.join(upload).boxed()
            }
            (Some(t), None) => start.then_execute(self.ctx.compute.clone(), t).map_err(&e)?.boxed(),
            (None, _) => start,
        };
        let run = start.then_execute(self.ctx.compute.clone(), cb).map_err(&e)?;
        if wait {
            let fence = run.then_signal_fence_and_flush().map_err(verr("submitting a layer step"))?;
            let t = Instant::now();
            fence.wait(None).map_err(verr("waiting for a layer step"))?;
            self.finished(t)?;
        } else {
            let f = run.then_signal_semaphore_and_flush().map_err(verr("submitting a layer step"))?;
            self.pending = Some(f.boxed());
        }
        Ok(())
    }

    /// After the host waited (since `t`) for everything submitted: the VRAM tier learns
    /// that its fills are in place and no slot is in use, and the profile counts the wait
    /// and collects the finished stamps.
    fn finished(&mut self, t: Instant) -> Result<(), VulkanError> {
        if let Some(v) = self.ex.vram.as_mut() {
            v.settle();
        }
        if let Some(timer) = &self.timer {
            let mut timer = lock(timer);
            timer.waited(t.elapsed());
            timer.collect()?;
        }
        Ok(())
    }

    /// While profiling, marks the start of `phase` (of a block in `regime`) in the
    /// recording in progress, or in the next one to start ([`VulkanBackend::phase_due`]).
    pub(super) fn mark(&mut self, regime: Regime, phase: Phase) -> Result<(), VulkanError> {
        // A held norm stays held across the mark (the fused front that forms it comes
        // in the next phase); one recorded after all counts in the phase after its own.
        if let Some(t) = self.timer.clone() {
            match self.rec.as_mut() {
                Some(rec) => lock(&t).enter(regime, phase, rec.stampable())?,
                None => self.phase_due = Some((regime, phase)),
            }
        }
        Ok(())
    }

    /// The VRAM tier's counters and slot states, when the tier is on.
    pub fn vram(&self) -> Option<VramSnapshot> {
        self.ex.vram.as_ref().map(VramTier::snapshot)
    }

    /// Records the router gate (weight `gate`) of `rows` rows of [`Plane::Xn`] into the
    /// arena's router logits.
    pub(super) fn record_gate(&mut self, gate: &TensorRef, rows: usize) -> Result<(), ForwardError> {
        let ne = self.model.cfg.num_experts as u32;
        let args =
            MatmulArgs { out_off: self.a.router, out_stride: ne, ..self.args(Plane::Xn, Plane::Xn, rows) };
        self.rec()?;
        let rec = self.rec.as_mut().expect("started");
        Ok(self.weights.matrix(gate)?.record(rec, args, rows > 1)?)
    }

    /// Records the MoE combine of `rows` rows, the routing weights at `w_off` of the
    /// routing buffer.
    pub(super) fn record_combine(&mut self, rows: usize, w_off: u32) -> Result<(), ForwardError> {
        let (h, k) = (self.model.cfg.hidden_size as u32, self.model.cfg.num_experts_per_tok as u32);
        let a = self.a;
        let kacc = self.kernels.accumulate.clone();
        let push = [h, k, a.yk, a.at(Plane::X), w_off];
        Ok(self.rec()?.dispatch(&kacc, None, push, [h.div_ceil(256), rows as u32, 1])?)
    }

    /// Matmul arguments reading plane `src` and writing plane `dst` for `rows` rows.
    fn args(&self, src: Plane, dst: Plane, rows: usize) -> MatmulArgs {
        let a = &self.a;
        MatmulArgs {
            m: rows as u32,
            x_off: a.at(src),
            x_stride: a.width(src),
            out_off: a.at(dst),
            out_stride: a.width(dst),
            ..Default::default()
        }
    }
}

impl Backend for VulkanBackend {
    type Kv = VulkanKvCache;

    fn new_kv(&self) -> Result<VulkanKvCache, ForwardError> {
        let c = &self.model.cfg;
        let n = (self.model.max_context * c.kv_dim()) as u64;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for lr in &self.model.layers {
            let MixerRefs::Attention(attn) = &lr.mixer else {
                layers.push(None);
                continue;
            };
            let k = device_buffer::<f32>(&self.ctx, n, BufferUsage::STORAGE_BUFFER)?;
            let v = device_buffer::<f32>(&self.ctx, n, BufferUsage::STORAGE_BUFFER)?;
            let (kb, vb) = (k.clone().reinterpret::<[u8]>(), v.clone().reinterpret::<[u8]>());
            let w = &self.weights;
            let bufs = [
                w.vector(&attn.q_norm)?.0.clone(),
                w.vector(&attn.k_norm)?.0.clone(),
                w.rope_cos.clone(),
                w.rope_sin.clone(),
                kb.clone(),
                vb.clone(),
            ];
            let rope = super::record::set0(&self.ctx, &self.kernels.qk_rope, &bufs)?;
            let attn = super::record::set0(&self.ctx, &self.kernels.attention.fused, &[kb, vb])?;
            layers.push(Some(KvLayer { rope, attn, _k: k, _v: v }));
        }
        Ok(VulkanKvCache::new(Arc::new(layers), self.new_delta_states()?, self.model.state_snapshots))
    }

    fn embed(&mut self, embed: &TensorRef, tokens: &[u32]) -> Result<(), ForwardError> {
        let h = self.model.cfg.hidden_size;
        let m = tokens.len();
        let x = self.a.at(Plane::X);
        let w = self.model.w(embed);
        if device_embeds(w.dtype()) {
            // The ids go to the start of the routing buffer: the previous pass has
            // completed (every pass ends with a host sync), and this one rewrites the
            // buffer only after its first sync point, when this recording has run.
            self.ex.route_buf.write().map_err(verr("writing token ids"))?[..m].copy_from_slice(tokens);
            let a = MatmulArgs { m: m as u32, out_off: x, out_stride: h as u32, ..Default::default() };
            self.rec()?;
            let rec = self.rec.as_mut().expect("started");
            return Ok(self.weights.matrix(embed)?.embed(rec, a)?);
        }
        {
            let mut io = self.io.write().map_err(verr("writing embeddings"))?;
            for (t, &tok) in tokens.iter().enumerate() {
                let widened = w.widen_row(tok as usize, &mut io[t * h..(t + 1) * h]);
                debug_assert!(widened, "f32 and bf16 rows are widened on the host");
            }
        }
        let x = x as u64;
        let (src, dst) =
            (self.io.clone().slice(0..(m * h) as u64), self.act.clone().slice(x..x + (m * h) as u64));
        Ok(self.rec()?.copy(src, dst)?)
    }

    fn rmsnorm(&mut self, w: &TensorRef, src: Plane, dst: Plane, rows: usize) -> Result<(), ForwardError> {
        let (vector, set) = self.weights.vector(w)?;
        let set = set.clone();
        let folds = self.routes.as_ref().is_some_and(DeviceRoutes::folds_norms);
        if folds
            && rows == 1
            && (src, dst) == (Plane::X, Plane::Xn)
            && self.a.width(src) as usize <= FRONT_MAX_NORM
        {
            // Recorded by the next recording, unless a fused front forms it.
            let vector = vector.clone();
            self.rec()?;
            self.held_norm = Some(HeldNorm { vector, set });
            return Ok(());
        }
        let (a, eps) = (self.a, self.model.cfg.rms_norm_eps);
        Ok(record_norm(self.rec()?, a, eps, set, src, dst, rows)?)
    }

    fn project(
        &mut self,
        w: &TensorRef,
        src: Plane,
        dst: Plane,
        rows: usize,
        write: Write,
    ) -> Result<(), ForwardError> {
        let mut args = self.args(src, dst, rows);
        if write == Write::Add {
            args.flags = FLAG_ACCUMULATE;
        }
        self.rec()?;
        let rec = self.rec.as_mut().expect("started");
        Ok(self.weights.matrix(w)?.record(rec, args, rows > 1)?)
    }

    fn project_group(
        &mut self,
        group: &[(&TensorRef, Plane)],
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        self.rec()?;
        let stack = group.first().and_then(|(w, _)| self.weights.stack(w));
        let Some(stack) = stack.filter(|s| rows == 1 && s.splits.len() < group.len()) else {
            return project_each(self, group, src, rows);
        };
        // One m=1 dispatch over the stack (its members lead the group): each member's rows
        // go to its plane; the members after it alone.
        let n = stack.splits.len() + 1;
        let mut args = self.args(src, group[0].1, rows);
        for (slot, (&row, (_, dst))) in args.stack.iter_mut().zip(stack.splits.iter().zip(&group[1..n])) {
            *slot = (row, self.a.at(*dst));
        }
        stack.w.record(self.rec.as_mut().expect("started"), args, false)?;
        project_each(self, &group[n..], src, rows)
    }

    fn qk_norm_rope(
        &mut self,
        layer: usize,
        _q_norm: &TensorRef,
        _k_norm: &TensorRef,
        kv: &mut VulkanKvCache,
        _start: usize,
        rows: usize,
    ) -> Result<(), ForwardError> {
        // The layer's norm weights are bound in its cache set (see `new_kv`).
        let c = &self.model.cfg;
        let (hd, nh, nkv) = (c.head_dim as u32, c.num_attention_heads as u32, c.num_key_value_heads as u32);
        let a = self.a;
        let push = [
            hd,
            nh,
            nkv,
            a.at(Plane::Q),
            a.at(Plane::K),
            a.at(Plane::V),
            self.ex.pos_word as u32,
            c.rms_norm_eps.to_bits(),
            self.model.rope.half as u32,
        ];
        // The position is the routing buffer's position word (written by `begin_pass`).
        let (k, set) = (self.kernels.qk_rope.clone(), kv_layer(kv, layer)?.rope.clone());
        Ok(self.rec()?.dispatch(&k, Some(set), push, [nh + nkv, rows as u32, 1])?)
    }

    fn attention(
        &mut self,
        layer: usize,
        kv: &VulkanKvCache,
        start: usize,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let a = self.a;
        // The position word was written at the start of the pass (`begin_pass`).
        let args = AttentionArgs {
            shape: AttentionShape::of(&self.model.cfg),
            q_off: a.at(Plane::Q),
            out_off: a.at(Plane::Attn),
            start: start as u32,
            pos_word: self.ex.pos_word as u32,
            tokens: rows as u32,
            part_off: a.attn_partials,
            part_chunks: AttentionShape::partial_chunks(self.model.max_context) as u32,
        };
        let (kernels, set) = (self.kernels.clone(), kv_layer(kv, layer)?.attn.clone());
        Ok(args.record(self.rec()?, &kernels.attention, set, args.split_by_default())?)
    }

    fn conv1d(
        &mut self,
        layer: usize,
        _taps: &TensorRef,
        kv: &mut VulkanKvCache,
        rows: usize,
    ) -> Result<(), ForwardError> {
        // The layer's taps are bound in its state set (see `new_kv`).
        self.record_conv1d(layer, kv, rows)
    }

    fn delta_rule(
        &mut self,
        layer: usize,
        _a_log: &TensorRef,
        _dt_bias: &TensorRef,
        kv: &mut VulkanKvCache,
        rows: usize,
    ) -> Result<(), ForwardError> {
        // The layer's parameters are bound in its state set (see `new_kv`).
        self.record_delta_rule(layer, kv, rows)
    }

    fn gated_rmsnorm(&mut self, w: &TensorRef, rows: usize) -> Result<(), ForwardError> {
        self.record_gated_rmsnorm(w, rows)
    }

    fn sigmoid_mul(&mut self, dst: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError> {
        self.record_sigmoid_mul(dst, gate, rows)
    }

    fn gated_add(&mut self, src: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError> {
        self.record_gated_add(src, gate, rows)
    }

    fn swiglu(
        &mut self,
        gate: &TensorRef,
        up: &TensorRef,
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let base = self.args(src, Plane::Hidden, rows);
        // Rows of the result are `Plane::Hidden`'s width apart (as `project` reads them),
        // which exceeds the gate's rows where a hybrid model's shared expert and dense
        // layers differ in size.
        let g = &self.weights.matrix(gate)?.w;
        if g.rows > base.out_stride as usize {
            return Err(ForwardError::Device(format!(
                "a SwiGLU block of {} rows does not fit the hidden plane ({} wide)",
                g.rows, base.out_stride
            )));
        }
        let dtype = g.dtype;
        self.rec()?;
        let rec = self.rec.as_mut().expect("started");
        let gu = self.weights.gate_up(&self.ctx, &self.kernels, gate, up)?;
        for ((row0, n), set) in &gu.ranges {
            let a = MatmulArgs { rows: *n, cols: base.x_stride, out_off: base.out_off + row0, ..base };
            rec.matmul(Projection::GateUp, dtype, rows > 1, set.clone(), a)?;
        }
        Ok(())
    }

    fn route_input(
        &mut self,
        gate: &TensorRef,
        rows: usize,
        job: &mut RouteJob,
    ) -> Result<GateInput, ForwardError> {
        let (ne, k, ranks) = (self.model.cfg.num_experts, job.k(), job.ranks());
        self.record_gate(gate, rows)?;
        let a = self.a;
        let push = [
            ne as u32,
            k as u32,
            ranks as u32,
            job.norm_topk_prob() as u32,
            a.router,
            a.routed,
            a.routed_stride,
        ];
        let n = a.routed_len(rows) as u64;
        let (r0, io0) = (a.routed as u64, self.io_routed as u64);
        let (act, io, route) = (self.act.clone(), self.io.clone(), self.kernels.route.clone());
        let rec = self.rec()?;
        rec.dispatch(&route, None, push, [1, rows as u32, 1])?;
        rec.copy(act.slice(r0..r0 + n), io.slice(io0..io0 + n))?;
        self.submit(true)?;
        let io = self.io.read().map_err(verr("reading the router's ranking"))?;
        let (row, layer) = (a.routed_stride as usize, job.layer());
        for t in 0..rows {
            let r = &io[self.io_routed + t * row..self.io_routed + (t + 1) * row];
            let (ids, weights) = job.ranks_mut(t);
            for (id, e) in ids.iter_mut().zip(&r[..ranks]) {
                *id = u16::try_from(e.to_bits()).ok().filter(|&e| (e as usize) < ne).ok_or_else(|| {
                    ForwardError::Device(format!(
                        "layer {layer}: the router ranked no expert for row {t} (its gate logits are not numbers)"
                    ))
                })?;
            }
            weights.copy_from_slice(&r[ne..ne + k]);
        }
        Ok(GateInput::Ranked)
    }

    fn route_output(&mut self, job: &mut RouteJob) -> Result<(), ForwardError> {
        Ok(self.ex.write_routing(&self.model, job)?)
    }

    fn expert_batch(&self, rows: usize) -> usize {
        self.ex.batch(rows)
    }

    fn experts(
        &mut self,
        layer: usize,
        plan: &RouteJob,
        first: usize,
        blobs: &[ExpertHandle],
        flush: Flush,
    ) -> Result<bool, ForwardError> {
        debug_assert!(self.transfer.is_none(), "a staging upload was left unsubmitted");
        self.transfer = self.record_experts(layer, plan.rows(), first, blobs)?;
        match flush {
            Flush::Last => Ok(false),
            Flush::Overlap => self.submit(false).map(|()| false).map_err(Into::into),
            Flush::Wait => self.submit(true).map(|()| true).map_err(Into::into),
        }
    }

    fn combine(&mut self, plan: &RouteJob, rows: usize) -> Result<(), ForwardError> {
        self.record_combine(rows, (rows * plan.k()) as u32)
    }

    fn lm_head(&mut self, norm: &TensorRef, lm_head: &TensorRef, row: usize) -> Result<(), ForwardError> {
        let c = &self.model.cfg;
        let (h, vocab, eps) = (c.hidden_size as u32, c.vocab_size, c.rms_norm_eps);
        let a = self.a;
        let set = self.weights.vector(norm)?.1.clone();
        let last = a.at(Plane::X) + row as u32 * h;
        self.rec()?.rmsnorm(set, h, 1, last, h, a.at(Plane::Xn), h, eps)?;
        let args = MatmulArgs { out_off: a.logits, out_stride: 0, ..self.args(Plane::Xn, Plane::Xn, 1) };
        let rec = self.rec.as_mut().expect("started");
        self.weights.matrix(lm_head)?.record(rec, args, false)?;
        self.logits.clear();
        if self.greedy_only {
            rec.argmax(self.greedy_set.clone(), vocab as u32, a.logits, a.argmax, self.io_greedy as u32)?;
            self.submit(true)?;
            let io = self.io.read().map_err(verr("reading the greedy choice"))?;
            self.greedy = Some(io[self.io_greedy].to_bits());
            return Ok(());
        }
        let (lo, io0, v) = (a.logits as u64, self.io_logits as u64, vocab as u64);
        rec.copy(self.act.clone().slice(lo..lo + v), self.io.clone().slice(io0..io0 + v))?;
        self.submit(true)?;
        let io = self.io.read().map_err(verr("reading logits"))?;
        self.logits.extend_from_slice(&io[self.io_logits..self.io_logits + vocab]);
        Ok(())
    }

    fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    fn finish(&mut self) -> Result<(), ForwardError> {
        Ok(self.submit(true)?)
    }

    fn abandon(&mut self) {
        self.rec = None;
        self.held_norm = None;
        self.transfer = None;
        // Dropping the work in flight waits for it, so no kernel or upload still reads a
        // blob whose handle goes next.
        self.pending = None;
        if let Some(v) = self.ex.vram.as_mut() {
            v.abandon();
        }
        if let Some(r) = self.routes.as_mut() {
            r.abandon();
        }
        self.replays.abandon();
        self.phase_due = None;
        if let Some(t) = self.timer.clone() {
            let mut t = lock(&t);
            t.discard();
            if let Err(e) = t.collect() {
                tracing::warn!("profile: dropping device timing after a failed pass: {e}");
                self.timer = None;
            }
        }
    }

    fn begin_pass(
        &mut self,
        kv: &VulkanKvCache,
        rows: usize,
        device_bets: Option<usize>,
        logits: bool,
    ) -> Result<(), ForwardError> {
        // With the profile, a pass keeps or replays its timestamps with its commands, so
        // it starts with every query free (they are the same ones at every replay).
        let timed = self.timer.as_ref().map(|t| lock(t).idle());
        // A session's pending state copies (a prefix reuse's snapshot load) are recorded
        // ahead of the pass, so that pass records afresh.
        let replayable = rows == 1 && timed != Some(false) && kv.book.ops().is_empty();
        let emit = match (logits, self.greedy_only) {
            (false, _) => Emit::Nothing,
            (true, false) => Emit::Logits,
            (true, true) => Emit::Greedy,
        };
        let shape = |bets| Shape { bets, emit, timed: timed.is_some() };
        self.replays.begin(kv, device_bets.filter(|_| replayable).map(shape));
        // The block's position is data, not a push constant, so a kept recording serves
        // every position: the host writes it into the routing buffer's position word,
        // which the RoPE and attention kernels read (the previous pass has completed).
        self.ex.route_buf.write().map_err(verr("writing the position"))?[self.ex.pos_word] = kv.len() as u32;
        Ok(())
    }

    fn routes_on_device(&mut self) -> bool {
        self.routes.is_some()
    }

    fn route_on_device(&mut self, layer: usize, gate: &TensorRef, bets: usize) -> Result<(), ForwardError> {
        self.record_device_route(layer, gate, bets)
    }

    fn keep_states(&mut self, kv: &VulkanKvCache) -> Result<(), ForwardError> {
        self.record_kept_states(kv, true)
    }

    fn restore_states(&mut self, kv: &VulkanKvCache) -> Result<(), ForwardError> {
        self.record_kept_states(kv, false)
    }

    fn device_routes(&mut self, ranks: &mut [Vec<u16>]) -> Result<bool, ForwardError> {
        self.read_device_routes(ranks)
    }

    fn phase(&mut self, regime: Regime, phase: Phase) -> Result<(), ForwardError> {
        Ok(self.mark(regime, phase)?)
    }

    fn set_device_timing(&mut self, on: bool) -> Result<bool, ForwardError> {
        self.timer = if on { DeviceTimer::new(&self.ctx)? } else { None };
        self.replays.forget_timed();
        Ok(self.timer.is_some())
    }

    fn take_device_times(&mut self, into: &mut PhaseProfile) {
        if let Some(t) = &self.timer {
            lock(t).take(into);
        }
    }
}

/// Attention layer `layer`'s cache.
fn kv_layer(kv: &VulkanKvCache, layer: usize) -> Result<&KvLayer, ForwardError> {
    kv.layers.get(layer).and_then(Option::as_ref).ok_or_else(|| {
        ForwardError::Device(format!("layer {layer} has no key/value cache (it is not an attention layer)"))
    })
}

/// Records the RMSNorm of `rows` rows of `src` into `dst` (weights bound in `set`).
fn record_norm(
    rec: &mut Recorder,
    a: Arena,
    eps: f32,
    set: Arc<DescriptorSet>,
    src: Plane,
    dst: Plane,
    rows: usize,
) -> Result<(), VulkanError> {
    let n = a.width(src);
    rec.rmsnorm(set, n, rows as u32, a.at(src), n, a.at(dst), a.width(dst), eps)
}
