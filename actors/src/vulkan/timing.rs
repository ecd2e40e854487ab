//! Device timestamps for the phase profile ([`crate::profile`]): while profiling, the
//! backend writes a timestamp into the command buffer at every phase change and one at
//! the end of every command buffer; after each host wait (when everything submitted has
//! run) the timestamps are read back, each gap between consecutive marks of one command
//! buffer is added to the phase that began it, and the gaps between consecutive compute
//! command buffers are the device's idle time. The recorder also stamps the end of every
//! dispatch and copy ([`DeviceTimer::kernel`]), so each kernel's share is known too. Off
//! by default: without a profile, nothing is written.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vulkano::command_buffer::{AutoCommandBufferBuilder, PrimaryAutoCommandBuffer};
use vulkano::query::{QueryPool, QueryPoolCreateInfo, QueryResultFlags, QueryType};
use vulkano::sync::PipelineStage;

use super::buffers::verr;
use super::context::VulkanContext;
use super::VulkanError;
use crate::profile::{Phase, PhaseProfile, Regime};

/// Timestamps the pool holds between two host waits (a decode step of a 94-layer model
/// stamps ~1,500); marks beyond it are dropped until the next read.
const QUERIES: u32 = 8192;

/// What a timestamp marks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    /// The start of a phase.
    Phase(Regime, Phase),
    /// The end of a command buffer.
    End(Regime),
    /// The end of a dispatch of kernel `names[i]`.
    Kernel(Regime, usize),
}

/// The marks of one command buffer: (query, mark), in recording order.
type Marks = Vec<(u32, Mark)>;

/// The timestamps a kept decode recording writes (`super::replay`): its queries and
/// what each marks, counted again every time the recording is replayed.
#[derive(Clone, Debug)]
pub struct KeptStamps(Marks);

/// A backend's timer, shared with its recorders (which stamp every dispatch).
pub type SharedTimer = Arc<Mutex<DeviceTimer>>;

/// The timer behind `t` (a panic while it was held leaves nothing half-written that
/// matters: at worst one profile's figures).
pub fn lock(t: &SharedTimer) -> MutexGuard<'_, DeviceTimer> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device timer of one backend.
pub struct DeviceTimer {
    pool: Arc<QueryPool>,
    /// Nanoseconds per timestamp tick.
    period_ns: f64,
    /// Next free query.
    next: u32,
    /// The phase being recorded.
    current: Option<(Regime, Phase)>,
    /// Marks of the compute recording in progress.
    open: Marks,
    /// Marks of the staging upload in progress (transfer queue).
    open_transfer: Marks,
    /// Submitted command buffers' marks, in submission order (whether on the transfer queue).
    submitted: Vec<(bool, Marks)>,
    /// Timestamp at the end of the last compute command buffer read in this block.
    last_end: Option<u64>,
    /// Device times and waits not yet taken.
    acc: PhaseProfile,
    /// Kernel names seen, indexed by [`Mark::Kernel`].
    names: Vec<String>,
}

impl DeviceTimer {
    /// A timer on `ctx`'s device, or `None` where its compute queue (or, with one, its
    /// transfer queue) cannot write timestamps or the host cannot reset queries.
    pub fn new(ctx: &VulkanContext) -> Result<Option<SharedTimer>, VulkanError> {
        let p = ctx.device.physical_device();
        let families = p.queue_family_properties();
        let stamps = ctx.families().iter().all(|&f| families[f as usize].timestamp_valid_bits.is_some());
        if !stamps || !ctx.device.enabled_features().host_query_reset {
            return Ok(None);
        }
        let pool = QueryPool::new(
            ctx.device.clone(),
            QueryPoolCreateInfo {
                query_count: QUERIES,
                ..QueryPoolCreateInfo::query_type(QueryType::Timestamp)
            },
        )
        .map_err(verr("creating a timestamp query pool"))?;
        // SAFETY: nothing uses the new pool's queries yet.
        unsafe { pool.reset(0..QUERIES) }.map_err(verr("resetting timestamp queries"))?;
        Ok(Some(Arc::new(Mutex::new(DeviceTimer {
            pool,
            period_ns: p.properties().timestamp_period as f64,
            next: 0,
            current: None,
            open: Vec::new(),
            open_transfer: Vec::new(),
            submitted: Vec::new(),
            last_end: None,
            acc: PhaseProfile::default(),
            names: Vec::new(),
        }))))
    }

    /// Writes a timestamp into `cb` (when a query is free, keeping one for the end).
    fn stamp(
        &mut self,
        cb: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
        mark: Mark,
        transfer: bool,
    ) -> Result<(), VulkanError> {
        let reserve = if matches!(mark, Mark::End(_)) { 0 } else { 2 };
        if self.next + reserve >= QUERIES {
            return Ok(());
        }
        let q = self.next;
        // SAFETY: query `q` was reset on the host after its last use (`collect`) and is
        // written once before the next reset.
        unsafe { cb.write_timestamp(self.pool.clone(), q, PipelineStage::AllCommands) }
            .map_err(verr("recording a timestamp"))?;
        self.next += 1;
        if transfer { &mut self.open_transfer } else { &mut self.open }.push((q, mark));
        Ok(())
    }

    /// Enters `phase` of a block in `regime`, marking its start in the compute recording
    /// `cb` when it changes or `cb` has no mark yet. Without `cb` (a pass that replays a
    /// kept recording, whose own commands are discarded) only the phase changes.
    pub fn enter(
        &mut self,
        regime: Regime,
        phase: Phase,
        cb: Option<&mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>>,
    ) -> Result<(), VulkanError> {
        if self.current == Some((regime, phase)) && !self.open.is_empty() {
            return Ok(());
        }
        self.current = Some((regime, phase));
        match cb {
            Some(cb) => self.stamp(cb, Mark::Phase(regime, phase), false),
            None => Ok(()),
        }
    }

    /// Marks the end of a dispatch (or copy) of kernel `name` in the compute recording `cb`.
    pub fn kernel(
        &mut self,
        name: &str,
        cb: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<(), VulkanError> {
        let i = self.names.iter().position(|n| n == name).unwrap_or_else(|| {
            self.names.push(name.to_string());
            self.names.len() - 1
        });
        self.stamp(cb, Mark::Kernel(self.regime(), i), false)
    }

    /// Marks the start of an expert upload in the staging command buffer `cb`.
    pub fn mark_upload(
        &mut self,
        cb: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<(), VulkanError> {
        let r = self.regime();
        self.stamp(cb, Mark::Phase(r, Phase::ExpertUpload), true)
    }

    fn regime(&self) -> Regime {
        self.current.map_or(Regime::Decode, |c| c.0)
    }

    /// Ends the staging command buffer `cb` (about to be built).
    pub fn end_upload(
        &mut self,
        cb: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<(), VulkanError> {
        if self.open_transfer.is_empty() {
            return Ok(());
        }
        self.stamp(cb, Mark::End(self.regime()), true)?;
        let marks = std::mem::take(&mut self.open_transfer);
        self.submitted.push((true, marks));
        Ok(())
    }

    /// Ends the compute recording `cb` (about to be built and submitted).
    pub fn end(
        &mut self,
        cb: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<(), VulkanError> {
        if self.open.is_empty() {
            return Ok(());
        }
        self.stamp(cb, Mark::End(self.regime()), false)?;
        let marks = std::mem::take(&mut self.open);
        self.submitted.push((false, marks));
        Ok(())
    }

    /// Counts `d` as the host waiting for the device in the current phase.
    pub fn waited(&mut self, d: Duration) {
        if let Some((r, p)) = self.current {
            self.acc.phase_mut(r, p).wait += d;
        }
    }

    /// Forgets the recording in progress (it was discarded, never submitted).
    pub fn discard(&mut self) {
        self.open.clear();
        self.open_transfer.clear();
    }

    /// Whether a pass starting now may capture or replay a timed recording: every
    /// query is free (all were read back at the last host wait) and nothing is being
    /// recorded, so its queries are the same ones at every replay.
    pub fn idle(&self) -> bool {
        self.next == 0 && self.open.is_empty() && self.open_transfer.is_empty()
    }

    /// The stamps of the compute recording just ended ([`DeviceTimer::end`]), to keep
    /// with it.
    pub fn last_stamps(&self) -> Option<KeptStamps> {
        self.submitted.iter().rev().find(|(transfer, _)| !transfer).map(|(_, m)| KeptStamps(m.clone()))
    }

    /// A kept recording with `stamps` was submitted again: its timestamps are read back
    /// at the next host wait, as a recording's are, and the block counts as replayed.
    pub fn replayed(&mut self, stamps: &KeptStamps) {
        let Some(&(_, first)) = stamps.0.first() else { return };
        let regime = match first {
            Mark::Phase(r, _) | Mark::End(r) | Mark::Kernel(r, _) => r,
        };
        self.acc.regime_mut(regime).replayed += 1;
        self.next = self.next.max(stamps.0.iter().map(|&(q, _)| q + 1).max().unwrap_or(0));
        self.submitted.push((false, stamps.0.clone()));
    }

    /// Reads the timestamps of every submitted command buffer (all have run: called
    /// after a host wait) and resets the queries.
    pub fn collect(&mut self) -> Result<(), VulkanError> {
        if self.next == 0 {
            return Ok(());
        }
        let mut ts = vec![0u64; self.next as usize];
        // Queries of a discarded recording were never written: their results stay 0 and
        // no mark names them.
        self.pool
            .get_results(0..self.next, &mut ts, QueryResultFlags::empty())
            .map_err(verr("reading timestamps"))?;
        let ns = |ticks: u64| Duration::from_nanos((ticks as f64 * self.period_ns) as u64);
        for (transfer, marks) in self.submitted.drain(..) {
            // The phase each gap belongs to: the last phase mark before it.
            let mut phase = None;
            for w in marks.windows(2) {
                let ((q0, m0), (q1, m1)) = (w[0], w[1]);
                let gap = ns(ts[q1 as usize].saturating_sub(ts[q0 as usize]));
                if let Mark::Phase(r, p) = m0 {
                    phase = Some((r, p));
                }
                if let Some((r, p)) = phase {
                    self.acc.phase_mut(r, p).device += gap;
                }
                if let Mark::Kernel(r, k) = m1 {
                    self.acc.regime_mut(r).add_kernel(&self.names[k], 1, gap);
                }
            }
            if transfer {
                continue;
            }
            if let (Some(end), Some(&(q, Mark::Phase(r, _)))) = (self.last_end, marks.first()) {
                self.acc.regime_mut(r).device_idle += ns(ts[q as usize].saturating_sub(end));
            }
            self.last_end = marks.last().map(|&(q, _)| ts[q as usize]);
        }
        // SAFETY: every submitted command buffer has completed (the caller waited), and
        // the recording in progress holds no query yet (`open` is empty at a wait).
        unsafe { self.pool.reset(0..self.next) }.map_err(verr("resetting timestamp queries"))?;
        self.next = 0;
        Ok(())
    }

    /// Adds the times measured since the last call to `into`; the next block's idle time
    /// starts afresh (the time between blocks is the caller's).
    pub fn take(&mut self, into: &mut PhaseProfile) {
        for (dst, src) in into.regimes.iter_mut().zip(&mut self.acc.regimes) {
            dst.device_idle += std::mem::take(&mut src.device_idle);
            dst.replayed += std::mem::take(&mut src.replayed);
            for k in std::mem::take(&mut src.kernels) {
                dst.add_kernel(&k.name, k.dispatches, k.device);
            }
            for (d, s) in dst.phases.iter_mut().zip(&mut src.phases) {
                d.device += std::mem::take(&mut s.device);
                d.wait += std::mem::take(&mut s.wait);
            }
        }
        self.last_end = None;
        self.current = None;
    }
}
