//! The MoE step, once for every backend: route the block through the router stage;
//! claim the union from the ring in union order (in waves when the ring cannot hold the
//! whole union at once, each wave's reads announced together as the previous wave's
//! slots are released), handing the claimed blobs to the backend in its batches; count
//! and trace every claim; withdraw the rest of the announcements when a claim fails;
//! combine the expert outputs; then queue a decode step's bets and record the union.
//! A prefill block's layer, once routed, also reads ahead for the next MoE layer
//! (`Lookahead`).

use std::sync::Arc;

use smoe_proto::{ClaimEvent, ClaimInfo, ClaimTally, ExpertHandle, ExpertKey, ExpertSource, RouteJob};

use super::lookahead::Lookahead;
use crate::contract::{Backend, Flush, ForwardError};
use crate::model::Model;
use crate::router::Router;
use crate::vault::TensorRef;

/// The MoE step's state: the router stage, the claims, and the union sizes.
pub struct MoeStep {
    router: Router,
    claims: Claims,
    spec_depth: usize,
    union_sizes: Vec<usize>,
    /// Experts per token.
    k: usize,
    /// Whether this pass's steps route on the backend's device.
    on_device: bool,
    /// Per decoder layer, the experts a device-routed pass ranked (top-k, then bets).
    device_ranks: Vec<Vec<u16>>,
    lookahead: Lookahead,
}

/// The claim side of the step: the handles the backend may still read, and the claim
/// accounting.
struct Claims {
    experts: Arc<dyn ExpertSource>,
    /// Per decoder layer, the most blobs held at once (the slots the ring has for the
    /// layer's experts: holding more would wait forever).
    hold_limits: Vec<usize>,
    /// Claimed blobs the backend may still read, from union position `held_from` on.
    handles: Vec<ExpertHandle>,
    held_from: usize,
    /// Union positions `..announced` hold an announcement (until claimed).
    announced: usize,
    tally: ClaimTally,
    trace: Option<Vec<ClaimEvent>>,
}

impl MoeStep {
    /// The step for blocks of up to `max_rows` tokens of `model`, claiming from
    /// `experts`, which can hand out `hold_limits[layer]` blobs of a layer at once.
    pub fn new(
        model: &Arc<Model>,
        experts: Arc<dyn ExpertSource>,
        max_rows: usize,
        hold_limits: Vec<usize>,
    ) -> Self {
        let c = &model.cfg;
        let job =
            RouteJob::new(max_rows, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob);
        MoeStep {
            router: Router::spawn(Arc::clone(model), Arc::clone(&experts), job),
            claims: Claims {
                experts,
                hold_limits,
                handles: Vec::with_capacity(c.num_experts),
                held_from: 0,
                announced: 0,
                tally: ClaimTally::default(),
                trace: None,
            },
            spec_depth: 0,
            union_sizes: vec![0; c.num_hidden_layers],
            k: c.experts_per_token(),
            on_device: false,
            device_ranks: vec![Vec::new(); c.num_hidden_layers],
            lookahead: Lookahead::new(model),
        }
    }

    /// Claim accounting since the step was created.
    pub fn tally(&self) -> ClaimTally {
        self.claims.tally
    }

    /// For each decoder layer, the union size of the last pass (0 for dense layers).
    pub fn union_sizes(&self) -> &[usize] {
        &self.union_sizes
    }

    /// Gate ranks beyond top-k that a single-token step queues as bets.
    pub fn spec_depth(&self) -> usize {
        self.spec_depth
    }

    /// Gate ranks beyond top-k that a single-token step queues as bets (0 disables).
    pub fn set_spec_depth(&mut self, depth: usize) {
        self.spec_depth = depth;
    }

    /// Sets the experts of the next MoE layer a prefill block reads ahead while a layer
    /// computes (0 turns lookahead off).
    pub fn set_lookahead(&mut self, depth: usize) {
        self.lookahead.set_depth(depth);
    }

    /// Starts recording every claim.
    pub fn enable_trace(&mut self) {
        self.claims.trace.get_or_insert_with(Vec::new);
    }

    /// The claims recorded since the last call, in execution order.
    pub fn take_trace(&mut self) -> Vec<ClaimEvent> {
        self.claims.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether a pass over `m` tokens may run its steps with the routing on `b`'s device
    /// ([`crate::contract::Backend::route_on_device`]): one token, no claim trace (a
    /// device-routed step claims nothing from the ring), and a backend that can.
    pub fn may_route_on_device<B: Backend>(&self, b: &mut B, m: usize) -> bool {
        m == 1 && self.claims.trace.is_none() && b.routes_on_device()
    }

    /// Called before a pass's first layer; `on_device`: its steps route on the device.
    pub fn begin_pass(&mut self, on_device: bool) {
        self.union_sizes.fill(0);
        self.on_device = on_device;
    }

    /// After the sync point ending a device-routed pass: whether it held (when not,
    /// the pass must run again host-routed). When it held, each layer's experts count
    /// as claims served without a read, its union size is recorded and its bets are
    /// queued, as a host-routed step would have.
    pub fn settle_device<B: Backend>(&mut self, b: &mut B) -> Result<bool, ForwardError> {
        self.device_ranks.iter_mut().for_each(Vec::clear);
        if !b.device_routes(&mut self.device_ranks)? {
            return Ok(false);
        }
        let k = self.k;
        for (l, ranks) in self.device_ranks.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            self.union_sizes[l] = k;
            for _ in 0..k {
                self.claims.tally.add(ClaimInfo { hit: true, bytes: 0, bet_used: false });
            }
            for &e in &ranks[k..] {
                self.claims.experts.prefetch(ExpertKey::new(l, e as usize));
            }
        }
        Ok(true)
    }

    /// Called once the backend has synced at the end of a pass (or abandoned it): no
    /// blob is read any more.
    pub fn end_pass(&mut self) {
        self.claims.handles.clear();
        self.lookahead.withdraw(self.claims.experts.as_ref());
    }

    /// Runs the MoE block of decoder layer `l` (router gate `gate`) for the `m` rows of
    /// [`Plane::Xn`](crate::contract::Plane::Xn) at positions `start..`, adding its
    /// output to the residual stream.
    pub fn run<B: Backend>(
        &mut self,
        b: &mut B,
        l: usize,
        gate: &TensorRef,
        start: usize,
        m: usize,
    ) -> Result<(), ForwardError> {
        if self.on_device {
            return b.route_on_device(l, gate, self.spec_depth);
        }
        let job = self.router.job_mut().ok_or(ForwardError::RouterStopped)?;
        job.request(l, m, self.spec_depth);
        let input = b.route_input(gate, m, job)?;
        job.set_input(input);
        // The backend has synced: nothing reads the previous layer's blobs any more.
        self.claims.handles.clear();
        let job = self.router.route().map_err(|_| ForwardError::RouterStopped)?;
        b.route_output(job)?;
        let job: &RouteJob = job;
        let n = job.union().len();
        let claims = &mut self.claims;
        self.lookahead.routed(claims.experts.as_ref(), job, m);
        if let Err(e) = claims.claim_union(b, job, l, start, m) {
            let failed = claims.held_from + claims.handles.len();
            for &e in &job.union()[(failed + 1).min(claims.announced)..claims.announced] {
                claims.experts.withdraw(ExpertKey::new(l, e as usize));
            }
            b.abandon();
            claims.handles.clear();
            return Err(e);
        }
        b.combine(job, m)?;
        for &e in job.bets() {
            claims.experts.prefetch(ExpertKey::new(l, e as usize));
        }
        self.union_sizes[l] = n;
        if m > 1 {
            metrics::histogram!(smoe_proto::metric_names::UNION_SIZE).record(n as f64);
        }
        Ok(())
    }
}

impl Claims {
    /// Claims the union in order and hands the blobs to the backend in its batches. On
    /// a failed claim of member `ui`, returns with `held_from + handles.len() == ui`.
    fn claim_union<B: Backend>(
        &mut self,
        b: &mut B,
        job: &RouteJob,
        l: usize,
        start: usize,
        m: usize,
    ) -> Result<(), ForwardError> {
        let n = job.union().len();
        let batch = b.expert_batch(m).max(1);
        self.held_from = 0;
        self.announced = job.announced();
        // First union position not yet handed to the backend.
        let mut first = 0;
        for ui in 0..n {
            if ui >= self.announced
                && self.handles.len() >= self.hold_limits.get(l).copied().unwrap_or(1).max(1)
            {
                // A wave: the ring could not take another claim while all our handles
                // are alive, so the batch so far runs to completion and they go first.
                b.experts(l, job, first, &self.handles[first - self.held_from..], Flush::Wait)?;
                self.release(ui);
                first = ui;
                // The next wave's reads start together (not one claim at a time):
                // announce ahead until the ring refuses.
                self.announced = ui;
                while self.announced < n
                    && self.experts.announce(ExpertKey::new(l, job.union()[self.announced] as usize))
                {
                    self.announced += 1;
                }
            } else if ui > first && ui % batch == 0 {
                if b.experts(l, job, first, &self.handles[first - self.held_from..], Flush::Overlap)? {
                    self.release(ui);
                }
                first = ui;
            }
            let e = job.union()[ui] as usize;
            let blob = self.experts.claim(ExpertKey::new(l, e))?;
            self.tally.add(blob.info());
            if let Some(trace) = self.trace.as_mut() {
                trace.push(ClaimEvent::new(start, m, l, e, blob.info()));
            }
            self.handles.push(blob);
        }
        if first < n && b.experts(l, job, first, &self.handles[first - self.held_from..], Flush::Last)? {
            self.release(n);
        }
        Ok(())
    }

    /// Drops every held handle; the next claim is union position `next`.
    fn release(&mut self, next: usize) {
        self.handles.clear();
        self.held_from = next;
    }
}
