//! Prometheus metrics: the recorder (with explicit histogram buckets), descriptions of
//! every metric the daemon and the engine export (all registered at start, so each
//! series exists from the first scrape), the `/metrics` route and the per-request
//! counter. Metric names come from [`smoe_proto::metric_names`]; the engine sets the
//! values (its ring publishes its gauges itself), so `/metrics` only renders.

use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics::Unit;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use smoe_actors::ring::RingCache;
use smoe_proto::metric_names::*;
use smoe_proto::stats::{IO_QUEUES, SLOT_STATES, VRAM_SLOT_STATES};
use smoe_proto::Manifest;

use super::state::AppState;

/// Buckets for time to first token (seconds).
const TTFT_BUCKETS: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Buckets for the time between tokens (seconds).
const TOKEN_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Buckets for one expert read (seconds).
const READ_BUCKETS: &[f64] =
    &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];
/// Buckets for experts per MoE layer per prefill chunk.
const UNION_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Counters: (name, unit, help).
const COUNTERS: &[(&str, Unit, &str)] = &[
    (RING_HITS, Unit::Count, "Expert claims served from the ring without a read"),
    (RING_MISSES, Unit::Count, "Expert claims that needed a demand read"),
    (RING_EVICTIONS, Unit::Count, "Ring slots recycled for another expert"),
    (READ_BYTES, Unit::Bytes, "Bytes read from the vault (demand and speculative)"),
    (BLOB_READS, Unit::Count, "Expert blobs read from the vault"),
    (READ_ERRORS, Unit::Count, "Expert reads that failed"),
    (SPEC_BETS, Unit::Count, "Speculative expert reads issued"),
    (SPEC_BETS_USED, Unit::Count, "Speculative expert reads later claimed"),
    (LOOKAHEAD_BYTES, Unit::Bytes, "Bytes read ahead for the next MoE layer of a prefill chunk"),
    (LOOKAHEAD_USED, Unit::Count, "Lookahead reads later claimed"),
    (LOOKAHEAD_USED_BYTES, Unit::Bytes, "Bytes of the lookahead reads later claimed (the rest was wasted)"),
    (READ_BUSY_MICROSECONDS, Unit::Microseconds, "Time with at least one expert read in flight"),
    (VRAM_HITS, Unit::Count, "Expert claims read from the copy the VRAM tier held"),
    (VRAM_FILLS, Unit::Count, "Experts copied from the ring into the VRAM tier"),
    (VRAM_EVICTIONS, Unit::Count, "VRAM tier slots refilled with another expert"),
    (VRAM_FREQUENCY_EVICTIONS, Unit::Count, "VRAM tier evictions whose slot the frequency ranking picked"),
    (PREFILL_TOKENS, Unit::Count, "Prompt tokens run through the model (suffix beyond the reused prefix)"),
    (DECODE_TOKENS, Unit::Count, "Tokens generated"),
    (CACHED_PROMPT_TOKENS, Unit::Count, "Prompt tokens reused from a stored session instead of prefilled"),
];

/// Gauges without labels: (name, help).
const GAUGES: &[(&str, &str)] = &[
    (QUEUE_LENGTH, "Requests waiting for the compute thread"),
    (ACTIVE_REQUESTS, "Requests being computed"),
    (SESSIONS, "Token streams stored for prefix reuse"),
];

/// Histograms: (name, unit, help, buckets).
const HISTOGRAMS: &[(&str, Unit, &str, &[f64])] = &[
    (TTFT_SECONDS, Unit::Seconds, "Time from admission to the first generated token", TTFT_BUCKETS),
    (TOKEN_LATENCY_SECONDS, Unit::Seconds, "Time between consecutive generated tokens", TOKEN_BUCKETS),
    (READ_LATENCY_SECONDS, Unit::Seconds, "Latency of one expert blob read", READ_BUCKETS),
    (UNION_SIZE, Unit::Count, "Distinct experts per MoE layer per prefill chunk", UNION_BUCKETS),
];

/// Installs the global recorder and registers every metric; returns the render handle.
pub fn install() -> Result<PrometheusHandle> {
    let mut b = PrometheusBuilder::new();
    for (name, _, _, buckets) in HISTOGRAMS {
        b = b
            .set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)
            .context("histogram buckets")?;
    }
    let handle = b.install_recorder().context("cannot install the metrics recorder")?;
    for (name, unit, help) in COUNTERS {
        metrics::describe_counter!(*name, *unit, *help);
        metrics::counter!(*name).increment(0);
    }
    for (name, help) in GAUGES {
        metrics::describe_gauge!(*name, *help);
        metrics::gauge!(*name).set(0.0);
    }
    metrics::describe_gauge!(RING_SLOTS, "Ring slots by state (empty, loading, ready, consumed)");
    for state in SLOT_STATES {
        metrics::gauge!(RING_SLOTS, LABEL_STATE => state).set(0.0);
    }
    metrics::describe_gauge!(
        VRAM_SLOTS,
        "VRAM tier slots by state (empty, filled, in_use: read or written by device work in flight)"
    );
    for state in VRAM_SLOT_STATES {
        metrics::gauge!(VRAM_SLOTS, LABEL_STATE => state).set(0.0);
    }
    metrics::describe_gauge!(VRAM_BYTES, Unit::Bytes, "Device memory of the VRAM tier (0: off)");
    metrics::gauge!(VRAM_BYTES).set(0.0);
    metrics::describe_gauge!(IO_QUEUE_DEPTH, "Reads queued by queue (demand, speculative)");
    for queue in IO_QUEUES {
        metrics::gauge!(IO_QUEUE_DEPTH, LABEL_QUEUE => queue).set(0.0);
    }
    for (name, unit, help, _) in HISTOGRAMS {
        metrics::describe_histogram!(*name, *unit, *help);
        let _ = metrics::histogram!(*name);
    }
    metrics::describe_counter!(REQUESTS, "API requests by endpoint and HTTP status");
    for endpoint in ["/v1/chat/completions", "/v1/completions"] {
        metrics::counter!(REQUESTS, LABEL_ENDPOINT => endpoint, LABEL_STATUS => "200").increment(0);
    }
    Ok(handle)
}

/// Publishes what the served vault stores: tensors and bytes per element type (resident
/// tensors and expert matrices), the bytes of one expert read and of one ring slot.
pub fn publish_vault(manifest: &Manifest, ring: &RingCache) {
    metrics::describe_gauge!(
        VAULT_TENSORS,
        "Tensors the vault stores, by element type and kind (resident, experts)"
    );
    metrics::describe_gauge!(VAULT_BYTES, Unit::Bytes, "Bytes the vault stores, by element type and kind");
    for (dtype, share) in manifest.format_mix() {
        let counts =
            [(share.resident_tensors, share.resident_bytes), (share.expert_matrices, share.expert_bytes)];
        for (kind, (n, bytes)) in VAULT_KINDS.into_iter().zip(counts).filter(|(_, (n, _))| *n > 0) {
            let labels = [(LABEL_DTYPE, dtype.name()), (LABEL_KIND, kind)];
            metrics::gauge!(VAULT_TENSORS, &labels).set(n as f64);
            metrics::gauge!(VAULT_BYTES, &labels).set(bytes as f64);
        }
    }
    metrics::describe_gauge!(
        EXPERT_BYTES,
        Unit::Bytes,
        "Payload bytes of one expert blob (one read), averaged over layers"
    );
    metrics::gauge!(EXPERT_BYTES).set(manifest.experts.mean_blob_len() as f64);
    metrics::describe_gauge!(
        RING_SLOT_BYTES,
        Unit::Bytes,
        "Bytes of one ring slot (the largest blob stride)"
    );
    metrics::gauge!(RING_SLOT_BYTES).set(manifest.experts.max_blob_stride() as f64);
    metrics::describe_gauge!(RING_BYTES, Unit::Bytes, "Bytes of ring slot memory over every size class");
    metrics::gauge!(RING_BYTES).set(ring.ring_bytes() as f64);
    metrics::describe_gauge!(
        RING_CLASS_SLOTS,
        "Ring slots per size class (one class per blob stride of the vault), by slot size in bytes"
    );
    for c in ring.classes() {
        metrics::gauge!(RING_CLASS_SLOTS, LABEL_SLOT_BYTES => c.stride.to_string()).set(c.slots as f64);
    }
}

/// `GET /metrics`: renders every metric.
pub async fn render(State(st): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render())
        .into_response()
}

/// Middleware counting API requests by endpoint and status.
pub async fn count_requests(req: Request, next: Next) -> Response {
    let endpoint = match req.extensions().get::<MatchedPath>() {
        Some(p) if p.as_str().starts_with("/v1/") => p.as_str().to_string(),
        Some(_) => return next.run(req).await,
        None => "unmatched".to_string(),
    };
    let resp = next.run(req).await;
    metrics::counter!(REQUESTS, LABEL_ENDPOINT => endpoint, LABEL_STATUS => resp.status().as_u16().to_string())
        .increment(1);
    resp
}
