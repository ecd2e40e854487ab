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
