//! The streamer's busy time: wall time during which at least one read is in flight
//! (taken off the queue and not yet handed back), whatever the number in flight. Over a
//! phase, busy time / wall time is the share of it the disk was kept working.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use smoe_proto::metric_names::READ_BUSY_MICROSECONDS;

#[derive(Default)]
struct State {
    in_flight: u32,
    since: Option<Instant>,
    total: Duration,
    /// Whole microseconds of `total` already added to the metric.
    published_us: u64,
}

/// Accumulates busy time from the starts and ends of reads.
#[derive(Default)]
pub struct BusyClock {
    s: Mutex<State>,
}

impl BusyClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.s.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A read started.
    pub fn begin(&self) {
        let mut s = self.lock();
        if s.in_flight == 0 {
            s.since = Some(Instant::now());
        }
        s.in_flight += 1;
    }

    /// A read ended (completed or failed).
    pub fn end(&self) {
        let mut s = self.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight > 0 {
            return;
        }
        if let Some(t) = s.since.take() {
            s.total += t.elapsed();
            let us = s.total.as_micros() as u64;
            metrics::counter!(READ_BUSY_MICROSECONDS).increment(us - s.published_us);
            s.published_us = us;
        }
    }

    /// Busy time so far, including the interval running now.
    pub fn total(&self) -> Duration {
        let s = self.lock();
        s.total + s.since.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_reads_count_once() {
        let c = BusyClock::default();
        assert_eq!(c.total(), Duration::ZERO);
        c.begin();
        c.begin();
        std::thread::sleep(Duration::from_millis(20));
        c.end();
        std::thread::sleep(Duration::from_millis(20));
        c.end();
        let busy = c.total();
        assert!(busy >= Duration::from_millis(40) && busy < Duration::from_millis(400), "{busy:?}");
        // Idle time does not count.
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(c.total(), busy);
        c.begin();
        std::thread::sleep(Duration::from_millis(10));
        assert!(c.total() >= busy + Duration::from_millis(10), "a running interval counts");
        c.end();
    }
}
