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
use smoe_proto::metric_names::*;
use smoe_proto::stats::{IO_QUEUES, SLOT_STATES};

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
