//! The compute thread: owns the forward pass and the session store, runs one job at a
//! time, streams its tokens back and records the latency and token metrics.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Instant;

use kameo::actor::ActorRef;
use smoe_proto::metric_names::{
    CACHED_PROMPT_TOKENS, DECODE_TOKENS, PREFILL_TOKENS, SESSIONS, TOKEN_LATENCY_SECONDS, TTFT_SECONDS,
};

use super::sessions::SessionStore;
use super::{JobEvent, JobFailure, Queued, Scheduler, WorkerIdle};
use crate::contract::{ForwardError, ForwardPass, KvState};
use crate::executor::{Executor, ExecutorKv};
use crate::generation::generate;

/// Runs jobs from `jobs` until the scheduler goes away.
pub(super) fn run(
    mut fwd: Executor,
    max_sessions: usize,
    jobs: flume::Receiver<Queued>,
    scheduler: ActorRef<Scheduler>,
) {
    let mut store = SessionStore::new(max_sessions);
    metrics::gauge!(SESSIONS).set(0.0);
    while let Ok(q) = jobs.recv() {
        let start = Instant::now();
        run_job(&mut fwd, &mut store, q);
        metrics::gauge!(SESSIONS).set(store.len() as f64);
        if scheduler.tell(WorkerIdle { busy_for: start.elapsed() }).blocking_send().is_err() {
            break;
        }
    }
}

/// Runs one job to its end, checking its cache back into the store.
fn run_job(fwd: &mut Executor, store: &mut SessionStore<ExecutorKv>, q: Queued) {
    let Queued { job, admitted, cancel } = q;
    let req = &job.request;
    if req.prompt.is_empty() {
        let _ = job.events.send(JobEvent::Failed(JobFailure::Invalid("the prompt is empty".into())));
        return;
    }
    let checkout = match store.checkout(&req.prompt, || fwd.new_kv()) {
        Ok(c) => c,
        Err(e) => {
            let _ = job.events.send(JobEvent::Failed(JobFailure::Internal(e.to_string())));
            return;
        }
    };
    let (mut kv, cached) = (checkout.cache, checkout.cached);
    let _ = job.events.send(JobEvent::Started { prompt_tokens: req.prompt.len(), cached_tokens: cached });
    let mut generated = Vec::new();
    let mut last: Option<Instant> = None;
    let outcome =
        catch_unwind(AssertUnwindSafe(|| {
            generate(
                fwd,
                &mut kv,
                req,
                || cancel.load(Ordering::Relaxed) || job.events.is_closed(),
                |id, _| {
                    let now = Instant::now();
                    match last {
                        None => metrics::histogram!(TTFT_SECONDS)
                            .record(now.duration_since(admitted).as_secs_f64()),
                        Some(t) => metrics::histogram!(TOKEN_LATENCY_SECONDS)
                            .record(now.duration_since(t).as_secs_f64()),
                    }
                    last = Some(now);
                    generated.push(id);
                    !cancel.load(Ordering::Relaxed) && job.events.send(JobEvent::Token(id)).is_ok()
                },
            )
        }));
    let event = match outcome {
        Ok(Ok((reason, stats))) => {
            metrics::counter!(PREFILL_TOKENS).increment(stats.prefill_tokens as u64);
            metrics::counter!(DECODE_TOKENS).increment(stats.generated_tokens as u64);
            metrics::counter!(CACHED_PROMPT_TOKENS).increment(cached as u64);
            let mut tokens = req.prompt.clone();
            tokens.extend_from_slice(&generated);
            store.checkin(tokens, kv);
            if cancel.load(Ordering::Relaxed) {
                JobEvent::Failed(JobFailure::Cancelled)
            } else {
                JobEvent::Finished { reason, stats }
            }
        }
        Ok(Err(e)) => {
            kv.truncate(0);
            store.checkin(Vec::new(), kv);
            JobEvent::Failed(match e {
                ForwardError::ContextFull { .. } | ForwardError::TokenOutOfVocab { .. } => {
                    JobFailure::Invalid(e.to_string())
                }
                _ => JobFailure::Internal(e.to_string()),
            })
        }
        Err(panic) => {
            // The cache may be half-written: recycle it empty.
            kv.truncate(0);
            store.checkin(Vec::new(), kv);
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!("the engine panicked while generating: {what}");
            JobEvent::Failed(JobFailure::Internal(format!("the engine failed: {what}")))
        }
    };
    let _ = job.events.send(event);
}
