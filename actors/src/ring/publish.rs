//! Publishing the ring's levels: a thread takes a [`RingSnapshot`] every period and sets
//! the gauges that show slots per state, reads waiting per queue and the slot memory
//! resident in RAM. (Counters need no
//! publishing: the ring counts them where they happen.)

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use smoe_proto::metric_names::{IO_QUEUE_DEPTH, LABEL_QUEUE, LABEL_STATE, RING_RESIDENT_BYTES, RING_SLOTS};
use smoe_proto::stats::{IO_QUEUES, SLOT_STATES};
use smoe_proto::RingSnapshot;

use super::RingCache;

/// The thread publishing a ring's gauges; dropping it stops the thread.
pub struct GaugePublisher {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl RingCache {
    /// Publishes this ring's level gauges now and then every `period`, until the
    /// returned publisher or the ring is dropped.
    pub fn publish_gauges(self: &Arc<Self>, period: Duration) -> std::io::Result<GaugePublisher> {
        let ring: Weak<RingCache> = Arc::downgrade(self);
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("smoe-ring-gauges".into()).spawn(move || loop {
            match ring.upgrade() {
                Some(r) => {
                    set_gauges(&r.stats());
                    metrics::gauge!(RING_RESIDENT_BYTES).set(r.resident_bytes() as f64);
                }
                None => break,
            }
            if stopped.recv_timeout(period) != Err(RecvTimeoutError::Timeout) {
                break;
            }
        })?;
        Ok(GaugePublisher { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for GaugePublisher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sets the level gauges from `s`.
fn set_gauges(s: &RingSnapshot) {
    for (state, n) in SLOT_STATES.iter().zip(s.slots) {
        metrics::gauge!(RING_SLOTS, LABEL_STATE => *state).set(n as f64);
    }
    for (queue, n) in IO_QUEUES.iter().zip(s.io_queue_depth) {
        metrics::gauge!(IO_QUEUE_DEPTH, LABEL_QUEUE => *queue).set(n as f64);
    }
}
