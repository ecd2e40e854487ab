//! The router stage: exact routing of a block of tokens at one MoE layer — the gate
//! matvec (or the executor's device-computed gate logits), softmax, top-k in a defined
//! order, the union of routed experts in first-use order, and each expert announced to
//! the ring/streamer the moment it first enters the union, so its read starts while
//! later tokens are still being routed. Single-token decode steps also pick gate ranks
//! k+1..k+N as speculative bets, which the executor queues once its claims are done.
//!
//! The router is a thread actor with a typed mailbox (it blocks on the gate math, so it
//! is not a tokio task): the executor sends a [`RouteJob`] (moved, not copied) and
//! receives it back holding the plan. Of the ring's side effects it owns announcements
//! only; claims, withdrawals and bets belong to the executor's MoE step, which holds the
//! handles while its kernels read the slots.

pub mod rank;

use std::sync::Arc;

use smoe_proto::{ExpertKey, ExpertSource, GateInput, RouteJob};

use crate::cpu::kernels::matmul;
use crate::mailbox::ThreadActor;
use crate::model::{FfnRefs, Model};

/// Tokens whose gate logits are computed together before they are routed: small, so
/// the first announcements go out early; the batched matmul is byte-identical per row
/// to the single-token one, so the block size changes nothing but timing.
const GATE_BLOCK: usize = 16;

/// The router stopped (its thread panicked or was shut down).
#[derive(Debug, thiserror::Error)]
#[error("the router stage stopped; restart the engine")]
pub struct RouterStopped;

/// A handle to one router thread, serving one executor. It keeps the executor's routing
/// job between layers; once the router has stopped (or never started), every call fails
/// with [`RouterStopped`].
pub struct Router {
    actor: Option<ThreadActor<Box<RouteJob>, Box<RouteJob>>>,
    job: Option<Box<RouteJob>>,
}

impl Router {
    /// Starts a router for `model` that announces to `experts`, with `job` as the
    /// executor's routing job. A thread that cannot start is logged, and the router is
    /// stopped from the outset.
    pub fn spawn(model: Arc<Model>, experts: Arc<dyn ExpertSource>, job: RouteJob) -> Router {
        let actor = ThreadActor::spawn(
            "router",
            || Ok::<_, std::convert::Infallible>(()),
            move |_, mut job: Box<RouteJob>| {
                run(&model, experts.as_ref(), &mut job);
                job
            },
        );
        let actor = actor.map_err(|e| tracing::error!("starting the router thread: {e}")).ok();
        Router { actor, job: Some(Box::new(job)) }
    }

    /// The job to fill before [`Router::route`]: set its request (see
    /// [`RouteJob::request`]) and input (`None` once the router has stopped).
    pub fn job_mut(&mut self) -> Option<&mut RouteJob> {
        self.actor.as_ref()?;
        self.job.as_deref_mut()
    }

    /// Routes the job as filled; returns it holding the plan.
    pub fn route(&mut self) -> Result<&mut RouteJob, RouterStopped> {
        let (Some(actor), Some(job)) = (self.actor.as_ref(), self.job.take()) else {
            return Err(RouterStopped);
        };
        match actor.call(job) {
            Ok(job) => Ok(self.job.insert(job)),
            Err(_) => {
                self.actor = None;
                Err(RouterStopped)
            }
        }
    }
}

/// Routes every token of `job`, in token order.
fn run(model: &Model, experts: &dyn ExpertSource, job: &mut RouteJob) {
    job.begin();
    let rows = job.rows();
    let gate = match (job.input(), &model.layers[job.layer()].ffn) {
        (GateInput::Hidden, FfnRefs::Moe { router, .. }) => Some(model.w(router)),
        _ => None,
    };
    for t0 in (0..rows).step_by(GATE_BLOCK) {
        let t1 = (t0 + GATE_BLOCK).min(rows);
        if let Some(w) = &gate {
            let (x, logits) = job.gate_planes(t0, t1);
            matmul(w, x, t1 - t0, logits);
        }
        for t in t0..t1 {
            route_token(job, t, experts);
        }
    }
    job.finish();
}

/// Ranks token `t` from its logits (overwritten with probabilities) unless the executor
/// ranked it on its device, and announces each
/// expert the moment it first enters the union, so its read starts while later tokens
/// are still being routed.
fn route_token(job: &mut RouteJob, t: usize, experts: &dyn ExpertSource) {
    let (k, norm, layer) = (job.k(), job.norm_topk_prob(), job.layer());
    if job.input() != GateInput::Ranked {
        let (logits, ranked, weights) = job.rank_slots(t);
        rank::route(logits, k, norm, ranked, weights);
    }
    job.admit(t, |e| experts.announce(ExpertKey::new(layer, e as usize)));
}
