//! Replaying a decode step's command buffer. A device-routed one-token pass
//! ([`super::device_route`]) is one submission whose commands depend only on the
//! session's cache, the bets its steps rank and what it hands back (together its
//! [`Shape`]): everything that changes
//! from token to token is data the host writes before the submission (the token, its
//! position, the VRAM tier's slot table) or the device writes itself (the routing). So
//! the first such pass of a session records and keeps its command buffer, and later ones
//! run the operations for their host-side effects only (the recorder discards the
//! commands) and submit the kept buffer: no recording, no building, no barrier
//! computation on the host per token, and (with nothing else in flight) one raw queue
//! submission whose fence the host polls. While the phase profile times the device, the
//! kept buffer holds the pass's timestamps too ([`KeptStamps`]): they are read back after
//! every replay, so a profiled decode runs as fast as an unprofiled one.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use vulkano::command_buffer::{
    CommandBufferSubmitInfo, CommandBufferUsage, PrimaryAutoCommandBuffer, SubmitInfo,
};
use vulkano::sync::fence::{Fence, FenceCreateInfo};

use super::buffers::verr;
use super::context::VulkanContext;
use super::VulkanError;

use super::kv::{KvLayer, VulkanKvCache};
use super::timing::KeptStamps;

/// Command buffers kept at once (sessions decoding in turn on one pass).
const KEPT: usize = 8;

/// How long the host polls a replayed step's fence before it blocks on it.
const SPIN: Duration = Duration::from_millis(20);

/// What a pass hands back of its last token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emit {
    /// Nothing (a prefill chunk).
    Nothing,
    /// Its logits.
    Logits,
    /// Only its greedy choice, chosen on the device.
    Greedy,
}

/// What a replayable pass's commands depend on besides its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The bets each device-routed step ranks beyond top-k.
    pub bets: usize,
    /// What the pass hands back.
    pub emit: Emit,
    /// Whether it writes the phase profile's timestamps.
    pub timed: bool,
}

/// A command buffer to submit again, and the timestamps it writes (with the profile).
pub type KeptBuffer = (Arc<PrimaryAutoCommandBuffer>, Option<KeptStamps>);

/// A kept command buffer and what it was recorded for.
struct Kept {
    /// The session's cache (its buffers are bound in the recording).
    kv: Weak<Vec<Option<KvLayer>>>,
    shape: Shape,
    buffer: KeptBuffer,
}

/// What the current pass does with its recording.
enum Mode {
    /// Records and submits as usual.
    Record,
    /// Records a buffer to keep for (cache, shape).
    Capture(Weak<Vec<Option<KvLayer>>>, Shape),
    /// Discards its commands and submits this kept buffer.
    Replay(KeptBuffer),
}

/// The kept command buffers of one backend and the current pass's mode.
pub struct Replays {
    kept: Vec<Kept>,
    mode: Mode,
    /// The fence replayed submissions signal (made on first use, reset before each).
    fence: Option<Arc<Fence>>,
}

impl Default for Replays {
    fn default() -> Self {
        Replays { kept: Vec::new(), mode: Mode::Record, fence: None }
    }
}

impl Replays {
    /// Starts a pass on `kv`'s session: a replayable one (a device-routed one-token
    /// pass) of `shape`, or not.
    pub fn begin(&mut self, kv: &VulkanKvCache, shape: Option<Shape>) {
        self.mode = match shape {
            None => Mode::Record,
            Some(shape) => {
                let same = |k: &&Kept| {
                    k.shape == shape && k.kv.upgrade().is_some_and(|a| Arc::ptr_eq(&a, &kv.layers))
                };
                match self.kept.iter().find(same) {
                    Some(k) => Mode::Replay(k.buffer.clone()),
                    None => Mode::Capture(Arc::downgrade(&kv.layers), shape),
                }
            }
        };
    }

    /// Whether the current pass's commands are discarded (a kept buffer runs instead).
    pub fn replaying(&self) -> bool {
        matches!(self.mode, Mode::Replay(_))
    }

    /// How the current pass's command buffer is recorded.
    pub fn usage(&self) -> CommandBufferUsage {
        match self.mode {
            Mode::Capture(..) => CommandBufferUsage::MultipleSubmit,
            _ => CommandBufferUsage::OneTimeSubmit,
        }
    }

    /// At the pass's submission: the kept buffer to run instead of the recording, if
    /// replaying. The pass then goes back to recording (a second submission in one
    /// pass, which a replayable pass never makes, records as usual).
    pub fn take_replay(&mut self) -> Option<KeptBuffer> {
        match std::mem::replace(&mut self.mode, Mode::Record) {
            Mode::Replay(kept) => Some(kept),
            m => {
                self.mode = m;
                None
            }
        }
    }

    /// At the pass's submission of its recording `cb`, which wrote `stamps`: kept when
    /// the pass captures.
    pub fn keep(&mut self, cb: &Arc<PrimaryAutoCommandBuffer>, stamps: impl FnOnce() -> Option<KeptStamps>) {
        if let Mode::Capture(kv, shape) = std::mem::replace(&mut self.mode, Mode::Record) {
            self.kept.retain(|k| k.kv.strong_count() > 0);
            if self.kept.len() == KEPT {
                self.kept.remove(0);
            }
            self.kept.push(Kept { kv, shape, buffer: (cb.clone(), stamps()) });
        }
    }

    /// Drops the kept buffers that write timestamps (the profile's query pool they
    /// write is being replaced).
    pub fn forget_timed(&mut self) {
        self.kept.retain(|k| !k.shape.timed);
    }

    /// Drops every kept buffer (the steps they record are no longer the ones to run).
    pub fn forget(&mut self) {
        self.kept.clear();
    }

    /// Runs the kept buffer `cb` and waits for it, with nothing submitted before it
    /// still in flight and nothing to wait for: one queue submission and one fence,
    /// without vulkano's future chain and its per-resource bookkeeping (on the H200 a
    /// replayed step then takes ~20 µs to submit, and decode runs ~5% faster).
    pub fn run(&mut self, ctx: &VulkanContext, cb: Arc<PrimaryAutoCommandBuffer>) -> Result<(), VulkanError> {
        let fence = match &self.fence {
            Some(f) => {
                // SAFETY: the fence is not in use: the last submission that signalled it
                // was waited for before `run` returned.
                unsafe { f.reset() }.map_err(verr("resetting the replay fence"))?;
                f.clone()
            }
            None => {
                let f = Arc::new(
                    Fence::new(ctx.device.clone(), FenceCreateInfo::default())
                        .map_err(verr("creating the replay fence"))?,
                );
                self.fence = Some(f.clone());
                f
            }
        };
        let info =
            SubmitInfo { command_buffers: vec![CommandBufferSubmitInfo::new(cb)], ..Default::default() };
        // SAFETY: the buffer was recorded for multiple submission and is not executing
        // (every earlier submission of it was waited for); it and every resource it uses
        // stay alive (it holds them, and `kept` holds it) until the fence wait below
        // returns; no other work is in flight (the backend only replays with nothing
        // pending), so the buffers it accesses are in the state it was recorded for, and
        // the host touches none of them until the wait returns.
        ctx.compute
            .with(|mut q| unsafe { q.submit(&[info], Some(&fence)) })
            .map_err(verr("submitting a replayed decode step"))?;
        // A decode step takes about a millisecond: polling the fence for a while wakes
        // the host sooner than a blocking wait does (on the H200 decode runs ~5% faster).
        let spin_until = Instant::now() + SPIN;
        while !fence.is_signaled().map_err(verr("polling the replay fence"))? {
            if Instant::now() >= spin_until {
                return fence.wait(None).map_err(verr("waiting for a replayed decode step"));
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// The pass was abandoned: nothing of it is kept.
    pub fn abandon(&mut self) {
        self.mode = Mode::Record;
    }
}
