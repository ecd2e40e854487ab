//! Settings shared by the command line and the `serve` config file: one table of
//! ranges, one validation and one conversion to engine options (with the default ring
//! sized from the memory available), so that a flag and the config key of the same name
//! accept exactly the same values and fail with the same message (naming both spellings
//! and the allowed range). Sizes take units ([`ByteSize`]).

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smoe_actors::engine::{EngineOptions, RingSize, VramSize, DEFAULT_RING_BYTES};
use smoe_actors::executor::BackendKind;
use smoe_actors::ring::budget::{self, RingBudget, RingNeeds};
use smoe_actors::streamer::{IoChoice, StreamerOptions};
use smoe_actors::vault::read_manifest;

/// The allowed range of one integer setting, named by its config key (the flag is the
/// key with `-` for `_`).
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    /// Config key.
    pub key: &'static str,
    /// Smallest allowed value.
    pub min: u64,
    /// Largest allowed value.
    pub max: u64,
}

impl Limit {
    /// `Err` naming the key, the flag and the range when `value` is outside it.
    pub fn check(&self, value: impl Into<u64>) -> Result<()> {
        let v = value.into();
        if v < self.min || v > self.max {
            bail!(
                "invalid setting {}: must be between {} and {}, got {v}",
                name(self.key),
                self.min,
                self.max
            );
        }
        Ok(())
    }

    /// [`Limit::check`] for a `usize`.
    pub fn check_usize(&self, value: usize) -> Result<()> {
        self.check(value as u64)
    }
}

/// How a setting is named in errors: the config key and the flag.
pub fn name(key: &str) -> String {
    format!("`{key}` (--{})", key.replace('_', "-"))
}

/// Vulkan device index.
pub const DEVICE: Limit = Limit { key: "device", min: 0, max: 255 };
/// Positions per session (prompt + completion).
pub const MAX_CONTEXT: Limit = Limit { key: "max_context", min: 2, max: 1 << 20 };
/// Ring slots.
pub const RING_SLOTS: Limit = Limit { key: "ring_slots", min: 1, max: 1 << 24 };
/// Reads in flight (io_uring) or reader threads (pread).
pub const QUEUE_DEPTH: Limit = Limit { key: "queue_depth", min: 1, max: 1024 };
/// Prompt tokens per layer-major prefill chunk.
pub const CHUNK_SIZE: Limit = Limit { key: "chunk_size", min: 1, max: 65536 };
/// Speculative gate ranks per decode token.
pub const SPEC_DEPTH: Limit = Limit { key: "spec_depth", min: 0, max: 1024 };
/// Experts of the next MoE layer read ahead per prefill layer (at most every expert a
/// layer can have: expert ids are 16-bit).
pub const LOOKAHEAD: Limit = Limit { key: "lookahead", min: 0, max: 65536 };
/// Workgroups of the Vulkan backend's fused MoE front (at most one dispatch's).
pub const MOE_FRONT_GROUPS: Limit = Limit { key: "moe_front_groups", min: 0, max: 65535 };
/// DeltaNet state snapshots per session (each as large as the session's states).
pub const STATE_SNAPSHOTS: Limit = Limit { key: "state_snapshots", min: 0, max: 64 };

/// A size in bytes, written as a whole number with an optional unit: none or `B`
/// (bytes); `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB` (powers of 1024); `KB`, `MB`, `GB`,
/// `TB` (powers of 1000). Units are case-insensitive and may follow a space. In TOML it
/// is a string (`"12GiB"`) or an integer (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

/// Units accepted by [`ByteSize`], with their factors (binary units first, so that
/// [`ByteSize`]'s `Display` prefers them).
const UNITS: &[(&str, u64)] = &[
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("T", 1 << 40),
    ("G", 1 << 30),
    ("M", 1 << 20),
    ("K", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("B", 1),
];

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, unit) = (&t[..split], t[split..].trim());
        let bad = || {
            format!(
                "{s:?} is not a size: give a whole number with an optional unit, such as 4096, 512MiB or 12G"
            )
        };
        let n: u64 = if digits.is_empty() { return Err(bad()) } else { digits.parse().map_err(|_| bad())? };
        let factor = match unit {
            "" => 1,
            u => UNITS.iter().find(|(name, _)| name.eq_ignore_ascii_case(u)).ok_or_else(bad)?.1,
        };
        n.checked_mul(factor)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} is too large (at most 2^64 - 1 bytes)"))
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the size exactly (`12GiB`), else bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = UNITS[..4].iter().find(|(_, k)| self.0 >= *k && self.0.is_multiple_of(*k));
        match unit {
            Some((name, k)) => write!(f, "{}{name}", self.0 / k),
            None => write!(f, "{}", self.0),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a size: bytes as an integer, or a string such as \"12GiB\"")]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Everything that shapes an engine, as given by flags or config keys.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSettings {
    /// Positions per session.
    pub max_context: usize,
    /// Ring slots, if given.
    pub ring_slots: Option<usize>,
    /// Ring bytes, if given.
    pub ring_bytes: Option<ByteSize>,
    /// Bytes of the Vulkan backend's VRAM tier, if given.
    pub vram_bytes: Option<ByteSize>,
    /// Workgroups of the Vulkan backend's fused MoE front, if given.
    pub moe_front_groups: Option<u32>,
    /// I/O path.
    pub io: IoChoice,
    /// Reads in flight or reader threads.
    pub queue_depth: usize,
    /// Prompt tokens per prefill chunk.
    pub chunk_size: usize,
    /// Speculative gate ranks per decode token.
    pub spec_depth: usize,
    /// Experts of the next MoE layer read ahead per prefill layer.
    pub lookahead: usize,
    /// Compute backend.
    pub backend: BackendKind,
    /// Vulkan device index.
    pub device: usize,
    /// DeltaNet state snapshots a session keeps for prefix reuse (hybrid models).
    pub state_snapshots: usize,
}

impl EngineSettings {
    /// Checks every value's range; the error names the key and the flag.
    pub fn validate(&self) -> Result<()> {
        DEVICE.check_usize(self.device)?;
        MAX_CONTEXT.check_usize(self.max_context)?;
        if self.ring_slots.is_some() && self.ring_bytes.is_some() {
            bail!("invalid setting: give {} or {}, not both", name("ring_slots"), name("ring_bytes"));
        }
        if let Some(n) = self.ring_slots {
            RING_SLOTS.check_usize(n)?;
        }
        if self.ring_bytes == Some(ByteSize(0)) {
            bail!("invalid setting {}: must be at least one expert blob, got 0", name("ring_bytes"));
        }
        QUEUE_DEPTH.check_usize(self.queue_depth)?;
        CHUNK_SIZE.check_usize(self.chunk_size)?;
        SPEC_DEPTH.check_usize(self.spec_depth)?;
        LOOKAHEAD.check_usize(self.lookahead)?;
        STATE_SNAPSHOTS.check_usize(self.state_snapshots)?;
        if let Some(n) = self.moe_front_groups {
            MOE_FRONT_GROUPS.check(u64::from(n))?;
        }
        Ok(())
    }

    /// Engine options (validated first) for the vault in `vault`, whose KV caches are
    /// kept for `sessions` sessions (also on the device, beside the VRAM tier). Without `ring_slots` or `ring_bytes` the ring is
    /// sized from the memory available ([`RingBudget`]; the arithmetic is logged), and
    /// refused when not even one slot fits.
    pub fn engine_options(&self, vault: &Path, sessions: usize) -> Result<EngineOptions> {
        self.validate()?;
        let ring = match (self.ring_slots, self.ring_bytes) {
            (Some(n), _) => RingSize::Slots(n),
            (None, Some(b)) => RingSize::Bytes(b.0),
            (None, None) => self.default_ring(vault, sessions)?,
        };
        if self.vram_bytes.is_some() && self.backend != BackendKind::Vulkan {
            tracing::warn!("{} sizes the Vulkan backend's VRAM tier: ignored on the CPU", name("vram_bytes"));
        }
        if self.moe_front_groups.is_some() && self.backend != BackendKind::Vulkan {
            tracing::warn!("{} sets a Vulkan kernel: ignored on the CPU", name("moe_front_groups"));
        }
        Ok(EngineOptions {
            max_context: self.max_context,
            state_snapshots: self.state_snapshots,
            ring,
            streamer: StreamerOptions { io: self.io, queue_depth: self.queue_depth, fault: None },
            // Unset: what the device can spare beside the sessions' KV caches.
            vram: self.vram_bytes.map_or(VramSize::Auto { sessions }, |b| VramSize::Bytes(b.0)),
            lookahead: self.lookahead,
            moe_front_groups: self.moe_front_groups,
        })
    }

    /// The default ring: what the memory available leaves beside the resident tensors,
    /// the KV caches and a margin (on Vulkan at most [`DEFAULT_RING_BYTES`]: its slots are
    /// host-visible driver memory, pinned and allocated whole at start-up, so more is
    /// left to an explicit `ring_bytes`).
    fn default_ring(&self, vault: &Path, sessions: usize) -> Result<RingSize> {
        let Some(available) = budget::available(Path::new("/")) else {
            tracing::warn!(
                "cannot tell how much memory is available: the ring gets {DEFAULT_RING_BYTES} bytes"
            );
            return Ok(RingSize::Bytes(DEFAULT_RING_BYTES));
        };
        let manifest = read_manifest(vault)?;
        let needs = RingNeeds::of(&manifest, self.max_context, self.state_snapshots, sessions);
        let cap = (self.backend == BackendKind::Vulkan).then_some(DEFAULT_RING_BYTES);
        let plan = RingBudget::plan(needs, available, cap);
        if plan.slots == 0 {
            bail!(
                "not enough memory for the expert ring, which needs at least one slot of {} bytes: {plan}; free \
                 memory, lower {} or the sessions kept, or set {} / {} to size the ring yourself",
                needs.slot_bytes,
                name("max_context"),
                name("ring_slots"),
                name("ring_bytes")
            );
        }
        tracing::info!("ring sized from the memory available: {plan}");
        Ok(RingSize::Bytes(plan.ring_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_units() {
        let p = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(p("4096"), Ok(4096));
        assert_eq!(p("1G"), Ok(1 << 30));
        assert_eq!(p("12GiB"), Ok(12 << 30));
        assert_eq!(p("512 mib"), Ok(512 << 20));
        assert_eq!(p("2GB"), Ok(2_000_000_000));
        assert_eq!(p("7b"), Ok(7));
        for bad in ["", "G", "1.5G", "-1", "12 parsecs", "99999999999T"] {
            assert!(p(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(ByteSize(12 << 30).to_string(), "12GiB");
        assert_eq!(ByteSize(1000).to_string(), "1000");
        assert_eq!(ByteSize(3 << 10).to_string(), "3KiB");
    }

    #[test]
    fn errors_name_key_flag_and_range() {
        let e = QUEUE_DEPTH.check(100_000u64).unwrap_err().to_string();
        assert!(e.contains("`queue_depth` (--queue-depth)") && e.contains("between 1 and 1024"), "{e}");
    }
}
