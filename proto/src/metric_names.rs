//! The name of every Prometheus metric smoe-pipeline exports, and of their labels. The
//! stages that emit a metric and the daemon that registers and describes it both use
//! these constants, so each name is written once; `grafana/dashboards/smoe-pipeline.json`
//! queries them by these names.

// Ring cache.

/// Counter: expert claims served from the ring without a read on their behalf.
pub const RING_HITS: &str = "smoe_ring_hits_total";
/// Counter: expert claims that needed a demand read.
pub const RING_MISSES: &str = "smoe_ring_misses_total";
/// Counter: idle ring slots recycled for another expert.
pub const RING_EVICTIONS: &str = "smoe_ring_evictions_total";
/// Gauge: ring slots per state; label [`LABEL_STATE`], one of
/// [`SLOT_STATES`](crate::stats::SLOT_STATES).
pub const RING_SLOTS: &str = "smoe_ring_slots";
/// Counter: speculative expert reads issued (bets on the next token).
pub const SPEC_BETS: &str = "smoe_spec_bets_total";
/// Counter: speculative expert reads that a claim later used.
pub const SPEC_BETS_USED: &str = "smoe_spec_bets_used_total";
/// Counter: bytes read ahead for the next MoE layer of a prefill block (`lookahead`).
pub const LOOKAHEAD_BYTES: &str = "smoe_lookahead_bytes_total";
/// Counter: lookahead reads that a claim used.
pub const LOOKAHEAD_USED: &str = "smoe_lookahead_used_total";
/// Counter: bytes of the lookahead reads that a claim used (the rest of
/// [`LOOKAHEAD_BYTES`] was wasted).
pub const LOOKAHEAD_USED_BYTES: &str = "smoe_lookahead_used_bytes_total";

// The Vulkan backend's VRAM tier (device-memory copies of experts).

/// Counter: expert claims whose kernels read the expert's copy already in the VRAM tier.
pub const VRAM_HITS: &str = "smoe_vram_hits_total";
/// Counter: experts copied from their ring slot into the VRAM tier (a claim the tier
/// did not hold); hits + fills = expert claims on the GPU while the tier is on.
pub const VRAM_FILLS: &str = "smoe_vram_fills_total";
/// Counter: VRAM tier slots that held an expert and were refilled with another.
pub const VRAM_EVICTIONS: &str = "smoe_vram_evictions_total";
/// Counter: of [`VRAM_EVICTIONS`], those whose slot the tier's frequency ranking picked
/// (the duel between recency and frequency had frequency ahead).
pub const VRAM_FREQUENCY_EVICTIONS: &str = "smoe_vram_frequency_evictions_total";
/// Gauge: VRAM tier slots per state; label [`LABEL_STATE`], one of
/// [`VRAM_SLOT_STATES`](crate::stats::VRAM_SLOT_STATES).
pub const VRAM_SLOTS: &str = "smoe_vram_slots";
/// Gauge: bytes of device memory the VRAM tier holds (0: the tier is off).
pub const VRAM_BYTES: &str = "smoe_vram_bytes";

// Streamer.

/// Counter: bytes read from the vault (demand and speculative).
pub const READ_BYTES: &str = "smoe_read_bytes_total";
/// Counter: expert blobs read from the vault.
pub const BLOB_READS: &str = "smoe_blob_reads_total";
/// Counter: expert reads that failed (I/O error, short read, checksum).
pub const READ_ERRORS: &str = "smoe_read_errors_total";
/// Histogram: seconds of one expert blob read.
pub const READ_LATENCY_SECONDS: &str = "smoe_read_latency_seconds";
/// Counter: microseconds during which at least one expert read was in flight (the
/// disk's busy time as the streamer sees it; a counter of whole microseconds, since
/// counters count integers).
pub const READ_BUSY_MICROSECONDS: &str = "smoe_read_busy_microseconds_total";
/// Gauge: reads waiting in the streamer's queues; label [`LABEL_QUEUE`], one of
/// [`IO_QUEUES`](crate::stats::IO_QUEUES).
pub const IO_QUEUE_DEPTH: &str = "smoe_io_queue_depth";

// The MoE step.

/// Histogram: distinct experts per MoE layer per prefill chunk (the union's size).
pub const UNION_SIZE: &str = "smoe_union_size";

// Scheduler.

/// Gauge: jobs waiting for the compute thread.
pub const QUEUE_LENGTH: &str = "smoe_queue_length";
/// Gauge: jobs being computed.
pub const ACTIVE_REQUESTS: &str = "smoe_active_requests";
/// Gauge: token streams held in the session store for prefix reuse.
pub const SESSIONS: &str = "smoe_sessions";
/// Histogram: seconds from admission to the first generated token.
pub const TTFT_SECONDS: &str = "smoe_ttft_seconds";
/// Histogram: seconds between consecutive generated tokens.
pub const TOKEN_LATENCY_SECONDS: &str = "smoe_token_latency_seconds";
/// Counter: prompt tokens run through the model (the suffix beyond the reused prefix).
pub const PREFILL_TOKENS: &str = "smoe_prefill_tokens_total";
/// Counter: tokens generated.
pub const DECODE_TOKENS: &str = "smoe_decode_tokens_total";
/// Counter: prompt tokens served from a stored session instead of being prefilled.
pub const CACHED_PROMPT_TOKENS: &str = "smoe_cached_prompt_tokens_total";

// The vault (set once when the daemon opens it).

/// Gauge: tensors the vault stores; labels [`LABEL_DTYPE`] (the element type, e.g.
/// `bf16`, `q4_k`) and [`LABEL_KIND`] (`resident` tensors or `experts` matrices, three
/// per expert).
pub const VAULT_TENSORS: &str = "smoe_vault_tensors";
/// Gauge: bytes the vault stores; labels as [`VAULT_TENSORS`].
pub const VAULT_BYTES: &str = "smoe_vault_bytes";
/// Gauge: payload bytes of one expert blob (one read), averaged over the MoE layers.
pub const EXPERT_BYTES: &str = "smoe_expert_bytes";
/// Gauge: bytes of one ring slot (the largest blob stride of the vault).
pub const RING_SLOT_BYTES: &str = "smoe_ring_slot_bytes";
/// Gauge: bytes of ring slot memory over every size class.
pub const RING_BYTES: &str = "smoe_ring_bytes";
/// Gauge: ring slots per size class (one class per distinct blob stride of the vault);
/// label [`LABEL_SLOT_BYTES`].
pub const RING_CLASS_SLOTS: &str = "smoe_ring_class_slots";
/// Gauge: bytes of ring slot memory resident in RAM (slots are faulted in and pinned on
/// their first read, not at start-up).
pub const RING_RESIDENT_BYTES: &str = "smoe_ring_resident_bytes";

// HTTP daemon.

/// Counter: API requests; labels [`LABEL_ENDPOINT`] and [`LABEL_STATUS`].
pub const REQUESTS: &str = "smoe_requests_total";

// Labels.

/// Label of [`RING_SLOTS`] and [`VRAM_SLOTS`]: the slot state.
pub const LABEL_STATE: &str = "state";
/// Label of [`IO_QUEUE_DEPTH`]: the queue.
pub const LABEL_QUEUE: &str = "queue";
/// Label of [`VAULT_TENSORS`] and [`VAULT_BYTES`]: the element type.
pub const LABEL_DTYPE: &str = "dtype";
/// Label of [`VAULT_TENSORS`] and [`VAULT_BYTES`]: one of [`VAULT_KINDS`].
pub const LABEL_KIND: &str = "kind";
/// Label of [`RING_CLASS_SLOTS`]: bytes of one slot of the class.
pub const LABEL_SLOT_BYTES: &str = "slot_bytes";
/// Values of [`LABEL_KIND`]: resident tensors, expert matrices.
pub const VAULT_KINDS: [&str; 2] = ["resident", "experts"];
/// Label of [`REQUESTS`]: the route (`/v1/...`, or `unmatched`).
pub const LABEL_ENDPOINT: &str = "endpoint";
/// Label of [`REQUESTS`]: the HTTP status code.
pub const LABEL_STATUS: &str = "status";
