//! The scheduler: a kameo actor that admits generation jobs into a bounded queue and
//! feeds them, one at a time, to a dedicated compute thread that owns the forward pass
//! and the session store (prefix reuse). Tokens flow back to each caller through its
//! own channel; a caller that drops its receiver cancels its job.

pub mod sessions;
mod worker;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kameo::actor::{Actor, ActorRef};
use kameo::message::{Context, Message};
use smoe_proto::metric_names::{ACTIVE_REQUESTS, QUEUE_LENGTH};
use tokio::sync::mpsc::UnboundedSender;

use crate::executor::Executor;
use smoe_proto::{JobEvent, JobFailure};

use crate::generation::GenerateRequest;

/// Scheduler limits.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerOptions {
    /// Jobs that may wait behind the running one.
    pub max_queue: usize,
    /// Token streams (with KV caches) kept for prefix reuse.
    pub max_sessions: usize,
}

/// One generation job.
pub struct Job {
    /// What to generate. The prompt must be non-empty.
    pub request: GenerateRequest,
    /// Where the job's events go; dropping the receiver cancels the job.
    pub events: UnboundedSender<JobEvent>,
}

/// Why a job was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full; try again after `retry_after`.
    QueueFull {
        /// Suggested wait.
        retry_after: Duration,
    },
    /// The scheduler is shutting down.
    ShuttingDown,
}

/// A job waiting for or running on the compute thread.
struct Queued {
    job: Job,
    admitted: Instant,
    cancel: Arc<AtomicBool>,
}

/// The scheduler actor.
pub struct Scheduler {
    opts: SchedulerOptions,
    queue: VecDeque<Queued>,
    running: Option<Arc<AtomicBool>>,
    work: flume::Sender<Queued>,
    accepting: bool,
    mean_job: Duration,
}

impl Actor for Scheduler {
    type Args = (Executor, SchedulerOptions);
    type Error = std::io::Error;

    async fn on_start((forward, opts): Self::Args, me: ActorRef<Self>) -> Result<Self, Self::Error> {
        let (work, jobs) = flume::unbounded();
        std::thread::Builder::new()
            .name("smoe-compute".into())
            .spawn(move || worker::run(forward, opts.max_sessions, jobs, me))?;
        metrics::gauge!(QUEUE_LENGTH).set(0.0);
        metrics::gauge!(ACTIVE_REQUESTS).set(0.0);
        Ok(Scheduler {
            opts,
            queue: VecDeque::new(),
            running: None,
            work,
            accepting: true,
            mean_job: Duration::from_secs(1),
        })
    }
}

impl Scheduler {
    /// Starts the next live queued job if the compute thread is idle.
    fn dispatch(&mut self) {
        while self.running.is_none() {
            let Some(q) = self.queue.pop_front() else { break };
            if q.job.events.is_closed() {
                continue;
            }
            self.running = Some(q.cancel.clone());
            if self.work.send(q).is_err() {
                self.running = None;
            }
        }
        self.publish();
    }

    fn publish(&self) {
        metrics::gauge!(QUEUE_LENGTH).set(self.queue.len() as f64);
        metrics::gauge!(ACTIVE_REQUESTS).set(self.running.is_some() as u8 as f64);
    }

    /// The wait to suggest to a refused client: the queue ahead at the mean job time.
    fn retry_after(&self) -> Duration {
        let ahead = self.queue.len() as u32 + 1;
        (self.mean_job * ahead).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }
}

/// Admits a job (reply: `Err` when the queue is full or the server is stopping).
pub struct Submit(pub Job);

impl Message<Submit> for Scheduler {
    type Reply = Result<(), SubmitError>;

    async fn handle(&mut self, Submit(job): Submit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if !self.accepting {
            return Err(SubmitError::ShuttingDown);
        }
        self.queue.retain(|q| !q.job.events.is_closed());
        if self.running.is_some() && self.queue.len() >= self.opts.max_queue {
            return Err(SubmitError::QueueFull { retry_after: self.retry_after() });
        }
        // Watch for the caller going away while the job waits, to free its place at once.
        let events = job.events.clone();
        let me = ctx.actor_ref().clone();
        tokio::spawn(async move {
            events.closed().await;
            let _ = me.tell(CallerGone).await;
        });
        self.queue.push_back(Queued {
            job,
            admitted: Instant::now(),
            cancel: Arc::new(AtomicBool::new(false)),
        });
        self.dispatch();
        Ok(())
    }
}

/// Sent when a job's caller dropped its receiver: queued jobs without a caller leave.
struct CallerGone;

impl Message<CallerGone> for Scheduler {
    type Reply = ();

    async fn handle(&mut self, _: CallerGone, _: &mut Context<Self, Self::Reply>) {
        let before = self.queue.len();
        self.queue.retain(|q| !q.job.events.is_closed());
        if self.queue.len() < before {
            tracing::debug!("dropped {} queued job(s) whose caller went away", before - self.queue.len());
            self.publish();
        }
    }
}

/// Sent by the compute thread when it finished a job.
pub struct WorkerIdle {
    busy_for: Duration,
}

impl Message<WorkerIdle> for Scheduler {
    type Reply = ();

    async fn handle(&mut self, msg: WorkerIdle, _: &mut Context<Self, Self::Reply>) {
        self.running = None;
        // Exponential moving average of job time, for Retry-After.
        self.mean_job = self.mean_job.mul_f64(0.8) + msg.busy_for.mul_f64(0.2);
        self.dispatch();
    }
}

/// Stops admitting jobs; queued and running jobs go on.
pub struct Drain;

impl Message<Drain> for Scheduler {
    type Reply = ();

    async fn handle(&mut self, _: Drain, _: &mut Context<Self, Self::Reply>) {
        self.accepting = false;
    }
}

/// Stops admitting jobs and cancels every queued and running job.
pub struct CancelAll;

impl Message<CancelAll> for Scheduler {
    type Reply = ();

    async fn handle(&mut self, _: CancelAll, _: &mut Context<Self, Self::Reply>) {
        self.accepting = false;
        for q in self.queue.drain(..) {
            let _ = q.job.events.send(JobEvent::Failed(JobFailure::Cancelled));
        }
        if let Some(c) = &self.running {
            c.store(true, Ordering::Relaxed);
        }
        self.publish();
    }
}

/// What the scheduler is doing now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, kameo::Reply)]
pub struct SchedulerStatus {
    /// Jobs waiting.
    pub queued: usize,
    /// Jobs computing (0 or 1).
    pub running: usize,
    /// Whether new jobs are admitted.
    pub accepting: bool,
}

/// Asks for a [`SchedulerStatus`].
pub struct Status;

impl Message<Status> for Scheduler {
    type Reply = SchedulerStatus;

    async fn handle(&mut self, _: Status, _: &mut Context<Self, Self::Reply>) -> SchedulerStatus {
        SchedulerStatus {
            queued: self.queue.len(),
            running: self.running.is_some() as usize,
            accepting: self.accepting,
        }
    }
}
