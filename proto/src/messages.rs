//! Typed messages between stages. Messages carry slot indices and handles, never
//! expert bytes.

use crate::ExpertKey;

/// Urgency of a blob read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// Needed by the computation now (or already known to be needed): always served first.
    Demand,
    /// A bet on the next token's routing; served only when no demand read waits.
    Speculative,
}

/// A request to the streamer: read `key`'s blob into ring slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Destination slot (already in LOADING state and owned by this read).
    pub slot: u32,
    /// The blob to read.
    pub key: ExpertKey,
    /// Queue to use.
    pub priority: Priority,
}

/// How a claim was satisfied, reported on its handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimInfo {
    /// True when no read was issued on behalf of this claim (the expert was retained in
    /// the ring, or arrived through a speculative bet).
    pub hit: bool,
    /// Bytes read from disk on behalf of this claim (0 for a hit).
    pub bytes: u64,
    /// True when the expert arrived through a speculative bet that this claim used.
    pub bet_used: bool,
}

/// Cumulative expert-claim accounting of one forward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClaimTally {
    /// Expert claims made.
    pub claims: u64,
    /// Claims that needed no read.
    pub hits: u64,
    /// Claims that needed a demand read.
    pub misses: u64,
    /// Bytes read on behalf of claims.
    pub bytes: u64,
}

impl ClaimTally {
    /// Counts one claim.
    pub fn add(&mut self, info: ClaimInfo) {
        self.claims += 1;
        self.bytes += info.bytes;
        if info.hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
    }

    /// The change from `earlier` to `self`.
    pub fn since(&self, earlier: &ClaimTally) -> ClaimTally {
        ClaimTally {
            claims: self.claims - earlier.claims,
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes: self.bytes - earlier.bytes,
        }
    }
}

/// One expert claim, as recorded by `--trace-out` (and read back by the benchmarks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClaimEvent {
    /// Position of the first token of the block that claimed the expert.
    pub pos: usize,
    /// Tokens in that block (1 in token-serial decode).
    pub rows: usize,
    /// Decoder layer.
    pub layer: usize,
    /// Expert index.
    pub expert: usize,
    /// Whether no read was issued on behalf of this claim.
    pub hit: bool,
    /// Bytes read on behalf of this claim.
    pub bytes: u64,
}

impl ClaimEvent {
    /// The event of claiming expert `expert` of `layer` for the block of `rows` tokens
    /// starting at `pos`.
    pub fn new(pos: usize, rows: usize, layer: usize, expert: usize, info: ClaimInfo) -> Self {
        ClaimEvent { pos, rows, layer, expert, hit: info.hit, bytes: info.bytes }
    }
}
