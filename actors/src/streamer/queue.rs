//! The streamer's two queues: demand reads are always taken before speculative ones,
//! a queued speculative read can be promoted to demand when its expert becomes needed
//! (it is moved, never read twice) or cancelled when it is not. The queue also keeps the
//! streamer's busy time: a read is in flight from leaving the queue to [`IoQueue::done`].

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

use smoe_proto::{Priority, ReadRequest};

use super::busy::BusyClock;

#[derive(Default)]
struct Queues {
    demand: VecDeque<ReadRequest>,
    speculative: VecDeque<ReadRequest>,
    shutdown: bool,
}

/// A two-level blocking queue of read requests.
#[derive(Default)]
pub struct IoQueue {
    q: Mutex<Queues>,
    cv: Condvar,
    busy: BusyClock,
}

impl IoQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a request by its priority.
    pub fn push(&self, req: ReadRequest) {
        let mut q = self.lock();
        match req.priority {
            Priority::Demand => q.demand.push_back(req),
            Priority::Speculative => q.speculative.push_back(req),
        }
        drop(q);
        self.cv.notify_one();
    }

    /// Moves the queued speculative read into `slot` to the demand queue (if it has not
    /// been started yet).
    pub fn promote(&self, slot: u32) {
        let mut q = self.lock();
        if let Some(i) = q.speculative.iter().position(|r| r.slot == slot) {
            let mut req = q.speculative.remove(i).expect("index in range");
            req.priority = Priority::Demand;
            q.demand.push_front(req);
        }
    }

    /// Removes the queued speculative read into `slot`; false when there is none (it
    /// has started, or was never queued).
    pub fn cancel(&self, slot: u32) -> bool {
        let mut q = self.lock();
        match q.speculative.iter().position(|r| r.slot == slot) {
            Some(i) => q.speculative.remove(i).is_some(),
            None => false,
        }
    }

    /// The next request, which is in flight from now on.
    fn take(&self, q: &mut Queues) -> Option<ReadRequest> {
        let r = q.demand.pop_front().or_else(|| q.speculative.pop_front())?;
        self.busy.begin();
        Some(r)
    }

    /// The next request without waiting.
    pub fn try_pop(&self) -> Option<ReadRequest> {
        self.take(&mut self.lock())
    }

    /// A request taken off the queue has been handed back (done or failed).
    pub fn done(&self) {
        self.busy.end();
    }

    /// Time during which at least one request was in flight.
    pub fn busy_time(&self) -> std::time::Duration {
        self.busy.total()
    }

    /// The next request, waiting for one; `None` once shut down.
    pub fn pop(&self) -> Option<ReadRequest> {
        let mut q = self.lock();
        loop {
            if q.shutdown {
                return None;
            }
            if let Some(r) = self.take(&mut q) {
                return Some(r);
            }
            q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Wakes every waiting worker and makes `pop` return `None`.
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.cv.notify_all();
    }

    /// Lengths of the demand and speculative queues.
    pub fn depths(&self) -> (usize, usize) {
        let q = self.lock();
        (q.demand.len(), q.speculative.len())
    }
}
