//! The phase profile of forward passes (`generate --profile`): where a block's wall time
//! goes, per regime (prefill blocks, decode steps) and per phase of the layer loop —
//! attention, the router's round trip, the expert uploads and dispatches, the combine —
//! with host timers on every backend and, where the backend measures them, device
//! timestamps and the host's waits for the device. Off by default; when off nothing is
//! timed.

use std::fmt;
use std::time::Duration;

/// Which kind of block a phase ran in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Regime {
    /// A block of more than one token (layer-major prefill).
    Prefill,
    /// A single-token step.
    Decode,
}

impl Regime {
    /// Both regimes, in report order.
    pub const ALL: [Regime; 2] = [Regime::Prefill, Regime::Decode];

    /// The regime of a block of `rows` tokens.
    pub fn of(rows: usize) -> Regime {
        if rows > 1 {
            Regime::Prefill
        } else {
            Regime::Decode
        }
    }
}

/// A phase of the layer loop. Host-only phases (the router stage, the ring claims)
/// happen between backend operations and have no device time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Embedding lookup.
    Embed,
    /// RMSNorms before attention and before the feed-forward block.
    Norm,
    /// Full attention: q/k/v projections, q/k norm and RoPE, attention over the cache,
    /// output projection.
    Attention,
    /// A gated-DeltaNet layer's own operations: the causal conv1d, the delta rule and the
    /// gated norm (its projections count as attention).
    DeltaNet,
    /// A dense layer's SwiGLU feed-forward block.
    DenseFfn,
    /// The router gate on the device and the logits' trip back to the host (a sync
    /// point: the host waits for everything recorded before it).
    RouterGate,
    /// Top-k and union on the router stage (host, between the gate and the routing
    /// upload).
    RouterStage,
    /// Writing the routing (pair lists, weights) for the expert kernels.
    RoutingUpload,
    /// Claiming union experts from the ring (host; waits for reads when streamed).
    Claims,
    /// Copying claimed experts into device memory (the device tier's fills, or staging).
    ExpertUpload,
    /// The expert kernels (gate/up and down dispatches).
    Experts,
    /// Adding the weighted expert outputs to the residual stream.
    Combine,
    /// A one-token MoE step routed on the device: gate, top-k, the experts the device
    /// holds and the combine, with no sync point.
    DeviceMoe,
    /// Final norm, LM head and the logits' trip back (a sync point).
    LmHead,
    /// The end of a block without logits (a sync point).
    Finish,
}

impl Phase {
    /// Every phase, in layer-loop order.
    pub const ALL: [Phase; 15] = [
        Phase::Embed,
        Phase::Norm,
        Phase::Attention,
        Phase::DeltaNet,
        Phase::DenseFfn,
        Phase::RouterGate,
        Phase::RouterStage,
        Phase::RoutingUpload,
        Phase::Claims,
        Phase::ExpertUpload,
        Phase::Experts,
        Phase::Combine,
        Phase::DeviceMoe,
        Phase::LmHead,
        Phase::Finish,
    ];

    /// The phase's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::Norm => "norm",
            Phase::Attention => "attention",
            Phase::DeltaNet => "deltanet (conv, delta rule, gated norm)",
            Phase::DenseFfn => "dense ffn",
            Phase::RouterGate => "router gate + readback",
            Phase::RouterStage => "router top-k/union",
            Phase::RoutingUpload => "routing upload",
            Phase::Claims => "ring claims",
            Phase::ExpertUpload => "expert upload",
            Phase::Experts => "expert dispatches",
            Phase::Combine => "combine",
            Phase::DeviceMoe => "moe routed on the device",
            Phase::LmHead => "lm head + readback",
            Phase::Finish => "finish",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The times of one phase in one regime.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    /// Times the phase was entered (backend operations, or gaps for host-only phases).
    pub calls: u64,
    /// Host time in the phase (recording, host work, and waits).
    #[serde(serialize_with = "secs")]
    pub host: Duration,
    /// Of `host`, the time blocked waiting for the device.
    #[serde(serialize_with = "secs")]
    pub wait: Duration,
    /// Device time between the phase's first and last timestamps in each command buffer.
    #[serde(serialize_with = "secs")]
    pub device: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The phase times of one regime.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct RegimeProfile {
    /// Blocks run.
    pub blocks: u64,
    /// Tokens in those blocks.
    pub tokens: u64,
    /// Wall time of the blocks (each forward call, start to end).
    #[serde(serialize_with = "secs")]
    pub wall: Duration,
    /// Device time between command buffers (the device waiting for the host), where the
    /// backend measures it.
    #[serde(serialize_with = "secs")]
    pub device_idle: Duration,
    /// Blocks that ran a command buffer kept from an earlier block instead of recording
    /// their own (Vulkan decode steps, `actors/src/vulkan/replay.rs`).
    pub replayed: u64,
    /// Per phase, indexed as [`Phase::ALL`].
    pub phases: Vec<PhaseTimes>,
    /// Per kernel, where the backend stamps every dispatch, in first-run order.
    pub kernels: Vec<KernelTimes>,
}

/// The device time of one kernel (a shader module) in one regime: from the end of the
/// command before each of its dispatches to the end of the dispatch, so the barrier
/// wait and launch count with the kernel that waited.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct KernelTimes {
    /// The kernel: its module (`attention_split`, `rmsnorm`, ...), with the weight shape
    /// (rows x cols) for the matmul family (`matvec_bf16 512x2048`); `copy` for copies.
    pub name: String,
    /// Dispatches recorded.
    pub dispatches: u64,
    /// Their device time.
    #[serde(serialize_with = "secs")]
    pub device: Duration,
}

impl RegimeProfile {
    /// Adds `dispatches` dispatches of kernel `name` that took `device` in all.
    pub fn add_kernel(&mut self, name: &str, dispatches: u64, device: Duration) {
        let i = match self.kernels.iter().position(|k| k.name == name) {
            Some(i) => i,
            None => {
                self.kernels.push(KernelTimes { name: name.to_string(), ..Default::default() });
                self.kernels.len() - 1
            }
        };
        self.kernels[i].dispatches += dispatches;
        self.kernels[i].device += device;
    }
}

/// The phase profile of every block run since profiling was turned on.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PhaseProfile {
    /// Whether device times and waits were measured (a backend with device timestamps).
    pub device_timed: bool,
    /// Prefill blocks, then decode steps (as [`Regime::ALL`]).
    pub regimes: Vec<RegimeProfile>,
}

impl Default for PhaseProfile {
    fn default() -> Self {
        let regime =
            RegimeProfile { phases: vec![PhaseTimes::default(); Phase::ALL.len()], ..Default::default() };
        PhaseProfile { device_timed: false, regimes: vec![regime; Regime::ALL.len()] }
    }
}

impl PhaseProfile {
    /// The times of `regime`.
    pub fn regime(&self, regime: Regime) -> &RegimeProfile {
        &self.regimes[regime as usize]
    }

    /// The times of `regime`, to add to.
    pub fn regime_mut(&mut self, regime: Regime) -> &mut RegimeProfile {
        &mut self.regimes[regime as usize]
    }

    /// The times of `phase` in `regime`, to add to.
    pub fn phase_mut(&mut self, regime: Regime, phase: Phase) -> &mut PhaseTimes {
        &mut self.regimes[regime as usize].phases[phase.index()]
    }
}

impl fmt::Display for PhaseProfile {
    /// One table per regime that ran: per phase, calls, host and device milliseconds,
    /// waits, and each one's share of the regime's wall time.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for regime in Regime::ALL {
            let r = self.regime(regime);
            if r.blocks == 0 {
                continue;
            }
            let wall = ms(r.wall).max(1e-9);
            let rate = r.tokens as f64 / r.wall.as_secs_f64().max(1e-12);
            let replayed = if r.replayed > 0 { format!(" ({} replayed)", r.replayed) } else { String::new() };
            writeln!(
                f,
                "{regime:?}: {} blocks{replayed}, {} tokens, wall {:.2} ms ({rate:.1} tok/s)",
                r.blocks,
                r.tokens,
                ms(r.wall)
            )?;
            writeln!(f, "| phase | calls | host ms | host % | wait ms | device ms | device % | ms/block |")?;
            writeln!(f, "| --- | --- | --- | --- | --- | --- | --- | --- |")?;
            let (mut host, mut device) = (Duration::ZERO, Duration::ZERO);
            // Device-only phases (an upload marked in a command buffer) have no calls.
            let ran = |t: &&PhaseTimes| t.calls > 0 || !t.device.is_zero();
            for (p, t) in Phase::ALL.iter().zip(&r.phases).filter(|(_, t)| ran(t)) {
                host += t.host;
                device += t.device;
                let dev = |v: f64| if self.device_timed { format!("{v:.3}") } else { "-".into() };
                writeln!(
                    f,
                    "| {} | {} | {:.3} | {:.1} | {} | {} | {} | {:.3} |",
                    p.name(),
                    t.calls,
                    ms(t.host),
                    100.0 * ms(t.host) / wall,
                    dev(ms(t.wait)),
                    dev(ms(t.device)),
                    dev(100.0 * ms(t.device) / wall),
                    ms(t.host) / r.blocks as f64,
                )?;
            }
            let other = r.wall.saturating_sub(host);
            writeln!(
                f,
                "| (outside phases) | | {:.3} | {:.1} | | | | |",
                ms(other),
                100.0 * ms(other) / wall
            )?;
            if self.device_timed {
                writeln!(
                    f,
                    "device busy {:.3} ms ({:.1}% of wall), idle between submissions {:.3} ms",
                    ms(device),
                    100.0 * ms(device) / wall,
                    ms(r.device_idle)
                )?;
            }
            if !r.kernels.is_empty() {
                writeln!(f, "| kernel | dispatches | device ms | device % | us/dispatch | us/block |")?;
                writeln!(f, "| --- | --- | --- | --- | --- | --- |")?;
                let mut ks: Vec<&KernelTimes> = r.kernels.iter().collect();
                ks.sort_by_key(|k| std::cmp::Reverse(k.device));
                for k in ks {
                    let d = ms(k.device);
                    writeln!(
                        f,
                        "| {} | {} | {d:.3} | {:.1} | {:.1} | {:.1} |",
                        k.name,
                        k.dispatches,
                        100.0 * d / wall,
                        1e3 * d / k.dispatches.max(1) as f64,
                        1e3 * d / r.blocks as f64
                    )?;
                }
            }
        }
        Ok(())
    }
}
