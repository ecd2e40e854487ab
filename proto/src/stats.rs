//! Plain-data snapshots of engine state. The engine takes them and publishes them; the
//! application (CLI statistics, the daemon's metrics) reads these, never a stage itself.

/// Names of the ring slot states, indexed by state value (as
/// [`RingSnapshot::slots`] is): a slot goes empty → loading → ready → consumed, and back
/// to empty only by eviction or a failed read.
pub const SLOT_STATES: [&str; 4] = ["empty", "loading", "ready", "consumed"];

/// Names of the streamer's read queues, indexed as [`RingSnapshot::io_queue_depth`] is:
/// demand reads are always served before speculative ones.
pub const IO_QUEUES: [&str; 2] = ["demand", "speculative"];

/// Names of the VRAM tier's slot states, indexed as [`VramSnapshot::slots`] is: empty
/// (never filled, or dropped after a failed pass), filled (holds an expert, idle), in use
/// (read or written by device work the host has not yet waited for).
pub const VRAM_SLOT_STATES: [&str; 3] = ["empty", "filled", "in_use"];

/// The Vulkan backend's VRAM tier at one moment: counters (monotonic since the pass
/// started) and levels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct VramSnapshot {
    /// Expert claims whose kernels read the copy the tier held.
    pub hits: u64,
    /// Experts copied from their ring slot into the tier.
    pub fills: u64,
    /// Slots refilled with another expert.
    pub evictions: u64,
    /// Of `evictions`, those whose slot the frequency ranking picked (the rest: the
    /// recency ranking; see the tier's replacement).
    pub frequency_evictions: u64,
    /// Slots per state, indexed as [`VRAM_SLOT_STATES`].
    pub slots: [u64; 3],
    /// Device memory the tier's slots take, in bytes.
    pub bytes: u64,
}

/// The ring cache and its streamer at one moment: counters (monotonic since start) and
/// levels (`slots`, `io_queue_depth`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RingSnapshot {
    /// Claims satisfied without a read on their behalf.
    pub hits: u64,
    /// Claims that needed a demand read.
    pub misses: u64,
    /// Idle slots recycled for another expert.
    pub evictions: u64,
    /// Bytes read from disk (demand and speculative).
    pub bytes_read: u64,
    /// Blobs read from disk (demand and speculative).
    pub blob_reads: u64,
    /// Speculative reads issued.
    pub bets_issued: u64,
    /// Speculative reads later claimed.
    pub bets_used: u64,
    /// Bytes read speculatively.
    pub bet_bytes: u64,
    /// Lookahead reads issued (reads for the next layer of a prefill block, ahead of
    /// its routing), less those withdrawn before they started.
    pub lookahead_reads: u64,
    /// Bytes read by lookahead reads.
    pub lookahead_bytes: u64,
    /// Lookahead reads a claim then used.
    pub lookahead_used: u64,
    /// Bytes of the lookahead reads a claim used (`lookahead_bytes` less this is
    /// wasted, or not yet used).
    pub lookahead_used_bytes: u64,
    /// Lookahead reads withdrawn before they started (nothing read).
    pub lookahead_cancelled: u64,
    /// Reads that failed (I/O error, short read, checksum).
    pub read_errors: u64,
    /// Nanoseconds during which at least one read was in flight (the streamer's busy
    /// time: from taking a request off its queue to handing back the verified blob).
    pub read_busy_ns: u64,
    /// Slots per state, indexed as [`SLOT_STATES`].
    pub slots: [u64; 4],
    /// Reads waiting per queue, indexed as [`IO_QUEUES`].
    pub io_queue_depth: [u64; 2],
}
