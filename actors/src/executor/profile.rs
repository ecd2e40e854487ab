//! [`Profiled`]: any backend with host timers around its operations, for the phase
//! profile ([`crate::profile`]). Each operation's host time goes to its phase; the gaps
//! the MoE step spends between operations go to the host-only phases they are (the
//! router stage before the routing upload, the ring claims before an expert batch). The
//! backend is told each operation's phase, so one that times the device marks it there.

use std::time::Instant;

use smoe_proto::{ExpertHandle, GateInput, RouteJob};

use crate::contract::{Backend, Flush, ForwardError, Plane, Write};
use crate::profile::{Phase, PhaseProfile, Regime};
use crate::vault::TensorRef;

/// A backend whose operations are timed into a profile, for one block.
pub struct Profiled<'a, B: Backend> {
    b: &'a mut B,
    profile: &'a mut PhaseProfile,
    regime: Regime,
    /// When the previous operation returned.
    last: Instant,
}

impl<'a, B: Backend> Profiled<'a, B> {
    /// Times `b`'s operations for a block of `rows` tokens into `profile`.
    pub fn new(b: &'a mut B, profile: &'a mut PhaseProfile, rows: usize) -> Self {
        Profiled { b, profile, regime: Regime::of(rows), last: Instant::now() }
    }

    /// Runs `f` on the backend as phase `phase`, after counting the gap since the previous
    /// operation as `gap` (a host-only phase) where given.
    fn op<T>(
        &mut self,
        gap: Option<Phase>,
        phase: Phase,
        f: impl FnOnce(&mut B) -> Result<T, ForwardError>,
    ) -> Result<T, ForwardError> {
        let t0 = Instant::now();
        if let Some(g) = gap {
            let t = self.profile.phase_mut(self.regime, g);
            t.calls += 1;
            t.host += t0 - self.last;
        }
        self.b.phase(self.regime, phase)?;
        let r = f(self.b);
        let t1 = Instant::now();
        let t = self.profile.phase_mut(self.regime, phase);
        t.calls += 1;
        t.host += t1 - t0;
        self.last = t1;
        r
    }
}

/// The phase of a projection, told apart by its planes: the attention block's projections
/// write q/k/v or read the attention output; a dense block's down projection reads the
/// hidden plane.
fn projection_phase(src: Plane, dst: Plane) -> Phase {
    match (src, dst) {
        (Plane::Hidden, _) => Phase::DenseFfn,
        _ => Phase::Attention,
    }
}

impl<B: Backend> Backend for Profiled<'_, B> {
    type Kv = B::Kv;
    fn new_kv(&self) -> Result<B::Kv, ForwardError> {
        self.b.new_kv()
    }
    fn embed(&mut self, embed: &TensorRef, tokens: &[u32]) -> Result<(), ForwardError> {
        self.op(None, Phase::Embed, |b| b.embed(embed, tokens))
    }
    fn rmsnorm(&mut self, w: &TensorRef, src: Plane, dst: Plane, rows: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::Norm, |b| b.rmsnorm(w, src, dst, rows))
    }
    fn project_group(
        &mut self,
        group: &[(&TensorRef, Plane)],
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        self.op(None, Phase::Attention, |b| b.project_group(group, src, rows))
    }
    fn project(
        &mut self,
        w: &TensorRef,
        src: Plane,
        dst: Plane,
        rows: usize,
        write: Write,
    ) -> Result<(), ForwardError> {
        self.op(None, projection_phase(src, dst), |b| b.project(w, src, dst, rows, write))
    }
    fn qk_norm_rope(
        &mut self,
        layer: usize,
        q_norm: &TensorRef,
        k_norm: &TensorRef,
        kv: &mut B::Kv,
        start: usize,
        rows: usize,
    ) -> Result<(), ForwardError> {
        self.op(None, Phase::Attention, |b| b.qk_norm_rope(layer, q_norm, k_norm, kv, start, rows))
    }
    fn attention(&mut self, layer: usize, kv: &B::Kv, start: usize, rows: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::Attention, |b| b.attention(layer, kv, start, rows))
    }
    fn conv1d(
        &mut self,
        layer: usize,
        w: &TensorRef,
        kv: &mut B::Kv,
        rows: usize,
    ) -> Result<(), ForwardError> {
        self.op(None, Phase::DeltaNet, |b| b.conv1d(layer, w, kv, rows))
    }
    fn delta_rule(
        &mut self,
        layer: usize,
        a_log: &TensorRef,
        dt_bias: &TensorRef,
        kv: &mut B::Kv,
        rows: usize,
    ) -> Result<(), ForwardError> {
        self.op(None, Phase::DeltaNet, |b| b.delta_rule(layer, a_log, dt_bias, kv, rows))
    }
    fn gated_rmsnorm(&mut self, w: &TensorRef, rows: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::DeltaNet, |b| b.gated_rmsnorm(w, rows))
    }
    fn sigmoid_mul(&mut self, dst: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::Attention, |b| b.sigmoid_mul(dst, gate, rows))
    }
    fn gated_add(&mut self, src: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::DenseFfn, |b| b.gated_add(src, gate, rows))
    }
    fn swiglu(
        &mut self,
        gate: &TensorRef,
        up: &TensorRef,
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        self.op(None, Phase::DenseFfn, |b| b.swiglu(gate, up, src, rows))
    }
    fn route_input(
        &mut self,
        gate: &TensorRef,
        rows: usize,
        job: &mut RouteJob,
    ) -> Result<GateInput, ForwardError> {
        self.op(None, Phase::RouterGate, |b| b.route_input(gate, rows, job))
    }
    fn begin_pass(
        &mut self,
        kv: &Self::Kv,
        rows: usize,
        device_bets: Option<usize>,
        logits: bool,
    ) -> Result<(), ForwardError> {
        // The pass's set-up (the position upload) counts with the embedding.
        self.op(None, Phase::Embed, |b| b.begin_pass(kv, rows, device_bets, logits))
    }
    fn routes_on_device(&mut self) -> bool {
        self.b.routes_on_device()
    }
    fn route_on_device(&mut self, layer: usize, gate: &TensorRef, bets: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::DeviceMoe, |b| b.route_on_device(layer, gate, bets))
    }
    // The state copies come at a pass's start, before its first phase, so they are not
    // timed as one.
    fn keep_states(&mut self, kv: &B::Kv) -> Result<(), ForwardError> {
        self.b.keep_states(kv)
    }
    fn restore_states(&mut self, kv: &B::Kv) -> Result<(), ForwardError> {
        self.b.restore_states(kv)
    }
    fn device_routes(&mut self, ranks: &mut [Vec<u16>]) -> Result<bool, ForwardError> {
        self.b.device_routes(ranks)
    }
    fn route_output(&mut self, job: &mut RouteJob) -> Result<(), ForwardError> {
        self.op(Some(Phase::RouterStage), Phase::RoutingUpload, |b| b.route_output(job))
    }
    fn expert_batch(&self, rows: usize) -> usize {
        self.b.expert_batch(rows)
    }
    fn experts(
        &mut self,
        layer: usize,
        plan: &RouteJob,
        first: usize,
        blobs: &[ExpertHandle],
        flush: Flush,
    ) -> Result<bool, ForwardError> {
        self.op(Some(Phase::Claims), Phase::Experts, |b| b.experts(layer, plan, first, blobs, flush))
    }
    fn combine(&mut self, plan: &RouteJob, rows: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::Combine, |b| b.combine(plan, rows))
    }
    fn lm_head(&mut self, norm: &TensorRef, lm_head: &TensorRef, row: usize) -> Result<(), ForwardError> {
        self.op(None, Phase::LmHead, |b| b.lm_head(norm, lm_head, row))
    }
    fn last_logits(&self) -> &[f32] {
        self.b.last_logits()
    }
    fn finish(&mut self) -> Result<(), ForwardError> {
        self.op(None, Phase::Finish, |b| b.finish())
    }
    fn abandon(&mut self) {
        self.b.abandon()
    }
    fn phase(&mut self, regime: Regime, phase: Phase) -> Result<(), ForwardError> {
        self.b.phase(regime, phase)
    }
    fn set_device_timing(&mut self, on: bool) -> Result<bool, ForwardError> {
        self.b.set_device_timing(on)
    }
    fn take_device_times(&mut self, into: &mut PhaseProfile) {
        self.b.take_device_times(into)
    }
}
