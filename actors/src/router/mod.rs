//! The router stage: exact routing of a block of tokens at one MoE layer — the gate
//! matvec (or the executor's device-computed gate logits), softmax, top-k in a defined
//! order, the union of routed experts in first-use order, and each expert announced to
//! the ring/streamer the moment it first enters the union, so its read starts while
//! later tokens are still being routed. Single-token decode steps also pick gate ranks
//! k+1..k+N as speculative bets, which the executor queues once its claims are done.
//!
//! The router is an actor on its own thread with a typed mailbox: the executor sends a
//! [`RouteJob`] (moved, not copied) and receives it back holding the plan. It owns the
//! announcement side of the expert source; claims stay with the executor, which holds
//! the handles while its kernels read the slots.

mod plan;
mod rank;

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use smoe_proto::ExpertSource;

pub use plan::{GateInput, RouteJob};

use crate::kernels::matmul;
use crate::model::Model;

/// Tokens whose gate logits are computed together before they are routed: small, so
/// the first announcements go out early; the batched matmul is byte-identical per row
/// to the single-token one, so the block size changes nothing but timing.
const GATE_BLOCK: usize = 16;

/// How long either side polls its mailbox before blocking. A decode step routes once
/// per MoE layer, and a thread wake-up costs about as much as routing one token.
const POLL: Duration = Duration::from_micros(50);

/// The router stopped (its thread panicked or was shut down).
#[derive(Debug, thiserror::Error)]
#[error("the router stage stopped; restart the engine")]
pub struct RouterStopped;

/// A handle to one router thread, serving one executor. It keeps the executor's routing
/// job between layers; once the router has stopped (or never started), every call fails
/// with [`RouterStopped`].
pub struct Router {
    jobs: Option<flume::Sender<Box<RouteJob>>>,
    plans: Option<flume::Receiver<Box<RouteJob>>>,
    thread: Option<JoinHandle<()>>,
    job: Option<Box<RouteJob>>,
}

impl Router {
    /// Starts a router for `model` that announces to `experts`, with `job` as the
    /// executor's routing job. A thread that cannot start is logged, and the router is
    /// stopped from the outset.
    pub fn spawn(model: Arc<Model>, experts: Arc<dyn ExpertSource>, job: RouteJob) -> Router {
        let (jobs, inbox) = flume::bounded::<Box<RouteJob>>(1);
        let (reply, plans) = flume::bounded(1);
        let thread = std::thread::Builder::new().name("smoe-router".into()).spawn(move || {
            while let Ok(mut job) = recv_polling(&inbox) {
                run(&model, experts.as_ref(), &mut job);
                if reply.send(job).is_err() {
                    break;
                }
            }
        });
        let job = Some(Box::new(job));
        match thread {
            Ok(t) => Router { jobs: Some(jobs), plans: Some(plans), thread: Some(t), job },
            Err(e) => {
                tracing::error!("starting the router thread: {e}");
                Router { jobs: None, plans: None, thread: None, job }
            }
        }
    }

    /// Routes the job after `fill` has set its request (see [`RouteJob::request`]) and
    /// input; returns it holding the plan.
    pub fn route(&mut self, fill: impl FnOnce(&mut RouteJob)) -> Result<&mut RouteJob, RouterStopped> {
        let (Some(jobs), Some(plans), Some(mut job)) = (&self.jobs, &self.plans, self.job.take()) else {
            return Err(RouterStopped);
        };
        fill(&mut job);
        match jobs.send(job).ok().and_then(|()| recv_polling(plans).ok()) {
            Some(job) => Ok(self.job.insert(job)),
            None => {
                self.jobs = None;
                Err(RouterStopped)
            }
        }
    }

    /// The last routed job (`None` once the router has stopped).
    pub fn job(&self) -> Option<&RouteJob> {
        self.job.as_deref()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Routes every token of `job`, in token order.
fn run(model: &Model, experts: &dyn ExpertSource, job: &mut RouteJob) {
    job.begin();
    let rows = job.rows();
    match job.input().clone() {
        GateInput::Hidden(gate) => {
            let w = model.w(&gate);
            for t0 in (0..rows).step_by(GATE_BLOCK) {
                let t1 = (t0 + GATE_BLOCK).min(rows);
                let (x, logits) = job.gate_planes(t0, t1);
                matmul(&w, x, t1 - t0, logits);
                for t in t0..t1 {
                    job.route_token(t, experts);
                }
            }
        }
        GateInput::Logits => {
            for t in 0..rows {
                job.route_token(t, experts);
            }
        }
    }
    job.finish();
}

/// Receives from `rx`, polling for [`POLL`] before blocking.
fn recv_polling<T>(rx: &flume::Receiver<T>) -> Result<T, flume::RecvError> {
    let until = Instant::now() + POLL;
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(flume::TryRecvError::Disconnected) => return Err(flume::RecvError::Disconnected),
            Err(flume::TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
            Err(flume::TryRecvError::Empty) => return rx.recv(),
        }
    }
}
