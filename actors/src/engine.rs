//! Assembling an engine from a vault: the validated vault, the resident model, and the
//! ring cache (with its streamer) that every forward pass takes experts from.

use std::path::Path;
use std::sync::Arc;

use smoe_proto::VaultError;

use crate::model::Model;
use crate::ring::memory::SlotAllocator;
use crate::ring::{RingCache, RingError, RingOptions};
use crate::state_book::DEFAULT_STATE_SNAPSHOTS;
use crate::streamer::StreamerOptions;
use crate::vault::Vault;

pub use crate::ring::RingSize;

/// Default ring budget when none is configured.
pub const DEFAULT_RING_BYTES: u64 = 4 << 30;

/// How much device memory the Vulkan backend's VRAM tier (device-local copies of the
/// experts its kernels multiply) takes: config key and flag `vram_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VramSize {
    /// What the device can spare: its device-local heap minus what the pass holds
    /// (dense weights, activations, staging), the KV caches of `sessions` sessions and a
    /// margin of max(512 MiB, 5% of the heap). None on a device whose memory is the
    /// host's (integrated GPUs, lavapipe), where kernels already read ring slots at
    /// memory speed.
    Auto {
        /// Sessions whose KV caches the device must still hold.
        sessions: usize,
    },
    /// Exactly this many bytes (at most every expert's copy; 0 turns the tier off).
    Bytes(u64),
}

/// Settings of an engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Longest sequence a session may hold.
    pub max_context: usize,
    /// DeltaNet state snapshots a session keeps for prefix reuse (hybrid models).
    pub state_snapshots: usize,
    /// Ring size.
    pub ring: RingSize,
    /// Streamer settings.
    pub streamer: StreamerOptions,
    /// The VRAM tier of a Vulkan pass (the CPU backend has none).
    pub vram: VramSize,
    /// Workgroups of a Vulkan pass's fused MoE front (router, ranking and expert gate/up
    /// of a device-routed decode step in one dispatch, which needs them all resident at
    /// once; 0: off; `None`: the device's SM count where the driver reports it, one
    /// workgroup an SM, else off): config key and flag `moe_front_groups`.
    pub moe_front_groups: Option<u32>,
    /// Experts of the next MoE layer a prefill block reads ahead while a layer computes
    /// (0: off); see [`crate::executor::moe::MoeStep::set_lookahead`].
    pub lookahead: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_context: 8192,
            state_snapshots: DEFAULT_STATE_SNAPSHOTS,
            ring: RingSize::Bytes(DEFAULT_RING_BYTES),
            streamer: StreamerOptions::default(),
            vram: VramSize::Auto { sessions: 1 },
            moe_front_groups: None,
            lookahead: 0,
        }
    }
}

/// Why an engine could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The vault is unreadable or inconsistent.
    #[error(transparent)]
    Vault(#[from] VaultError),
    /// The ring or streamer could not start.
    #[error(transparent)]
    Ring(#[from] RingError),
}

/// A loaded model with its ring cache (cloning shares them).
#[derive(Clone)]
pub struct Engine {
    /// The vault.
    pub vault: Arc<Vault>,
    /// Resident weights.
    pub model: Arc<Model>,
    /// The ring cache all forward passes share.
    pub ring: Arc<RingCache>,
    /// Experts of the next MoE layer the engine's passes read ahead (0: off).
    pub lookahead: usize,
}

impl Engine {
    /// Opens the vault in `dir` and starts the ring with slot memory from `allocator`.
    pub fn open(
        dir: &Path,
        opts: &EngineOptions,
        allocator: &dyn SlotAllocator,
    ) -> Result<Engine, EngineError> {
        let vault = Arc::new(Vault::open(dir)?);
        let mut model = Model::load(vault.clone(), opts.max_context)?;
        model.state_snapshots = opts.state_snapshots;
        let model = Arc::new(model);
        let ring = Arc::new(RingCache::new(
            vault.clone(),
            allocator,
            &RingOptions { size: opts.ring, streamer: opts.streamer.clone() },
        )?);
        Ok(Engine { vault, model, ring, lookahead: opts.lookahead })
    }
}
