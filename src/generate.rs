//! `smoe-pipeline generate`: one prompt in, streamed text (or one JSON object) out.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::startup::open_engine;
use anyhow::{bail, Context, Result};
use serde_json::json;
use smoe_actors::contract::ForwardPass;
use smoe_actors::generation::{generate, GenerateRequest};
use smoe_actors::sampler::SamplingParams;
use smoe_proto::stats::{SLOT_STATES, VRAM_SLOT_STATES};
use smoe_proto::RingSnapshot;

use crate::cli::{GenerateArgs, PrefillMode};
use crate::settings::EngineSettings;
use crate::tokenizer::{self, Detokenizer};

/// Runs `generate` with parsed arguments.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let settings = EngineSettings::from(&args.engine);
    let rows = match args.prefill {
        PrefillMode::LayerMajor => settings.chunk_size,
        PrefillMode::Serial => 1,
    };
    let opts = settings.engine_options(&args.vault, 1)?;
    let (engine, mut fwd) = open_engine(&args.vault, &opts, settings.backend, settings.device, rows)?;
    let model = Arc::clone(&engine.model);
    let tok = match &args.prompt {
        Some(_) => Some(tokenizer::load(&args.vault)?),
        None => tokenizer::load(&args.vault).ok(),
    };
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => tokenizer::encode(tok.as_ref().context("tokenizer")?, text)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty: give at least one token");
    }
    model.check_tokens(&prompt).map_err(|e| anyhow::anyhow!("--prompt-ids: {e}"))?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
    };
    sampling.validate().map_err(|e| anyhow::anyhow!("invalid sampling option: {e}"))?;
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: args.max_tokens,
        sampling,
        ignore_eos: args.ignore_eos,
        spec_depth: settings.spec_depth,
        logits: args.logits_out.is_some(),
    };

    if args.warmup {
        let mut kv = fwd.new_kv()?;
        generate(&mut fwd, &mut kv, &req, || false, |_, _| true)?;
    }
    if args.trace_out.is_some() {
        fwd.enable_trace();
    }
    // The VRAM tier's counters before this request (after the warm-up).
    let vram_start = fwd.vram().unwrap_or_default();
    if args.profile {
        fwd.set_profiling(true)?;
    }
    let mut kv = fwd.new_kv()?;
    let mut detok = tok.as_ref().map(Detokenizer::new);
    let mut ids = Vec::new();
    let mut logits_rows: Vec<f32> = Vec::new();
    let keep_logits = args.logits_out.is_some();
    let mut out = std::io::stdout().lock();
    let mut stream_err = None;
    // The process's disk reads (/proc/self/io) at the start, at the first token and at
    // the end: every read, expert blobs and resident pages alike. The ring's counters at
    // the start and at the first token give the prefill's share of them, over a window
    // (the TTFT, give or take the snapshots) that brackets both snapshots.
    let io_start = process_read_bytes();
    let mut io_first = None;
    let window_start = Instant::now();
    let ring_start = engine.ring.stats();
    let mut ring_first = None;
    let (reason, stats) = generate(
        &mut fwd,
        &mut kv,
        &req,
        || false,
        |id, logits| {
            if ids.is_empty() {
                io_first = process_read_bytes();
                ring_first = Some((engine.ring.stats(), Instant::now()));
            }
            ids.push(id);
            if keep_logits {
                logits_rows.extend_from_slice(logits);
            }
            if let Some(d) = detok.as_mut() {
                match d.push(id) {
                    Ok(piece) if !args.json => {
                        let _ = write!(out, "{piece}");
                        let _ = out.flush();
                    }
                    Ok(_) => {}
                    Err(e) => stream_err = Some(e),
                }
            }
            stream_err.is_none()
        },
    )?;
    let io_end = process_read_bytes();
    if let Some(e) = stream_err {
        return Err(e);
    }
    // The resident checksums were verified in the background meanwhile.
    engine.vault.resident_check().wait()?;
    if let Some(path) = &args.logits_out {
        write_logits(path, &logits_rows, ids.len(), model.cfg.vocab_size)?;
    }
    if let Some(path) = &args.trace_out {
        write_trace(path, &fwd.take_trace())?;
    }
    let profile = fwd.profile();
    if let Some(p) = &profile {
        eprint!("{p}");
    }
    let ring = engine.ring.stats();
    let (ring_at_first, first_at) = ring_first.unwrap_or_else(|| (ring.clone(), Instant::now()));
    let prefill_io = prefill_io(&ring_start, &ring_at_first, first_at - window_start);
    let manifest = engine.vault.manifest();
    let all: Vec<usize> = stats.prefill_unions.iter().flatten().copied().collect();
    let union_mean = if all.is_empty() { 0.0 } else { all.iter().sum::<usize>() as f64 / all.len() as f64 };
    let union_max = all.iter().copied().max().unwrap_or(0);
    let slot_states: serde_json::Map<String, serde_json::Value> =
        SLOT_STATES.iter().zip(ring.slots).map(|(n, c)| (n.to_string(), json!(c))).collect();
    // The VRAM tier (Vulkan, when on; else null): this request's counters (hits + fills =
    // its expert claims) and the slots at the end.
    let vram = fwd.vram().map(|v| {
        let slots: serde_json::Map<String, serde_json::Value> =
            VRAM_SLOT_STATES.iter().zip(v.slots).map(|(n, c)| (n.to_string(), json!(c))).collect();
        let s = &vram_start;
        json!({
            "bytes": v.bytes,
            "hits": v.hits - s.hits,
            "fills": v.fills - s.fills,
            "evictions": v.evictions - s.evictions,
            "frequency_evictions": v.frequency_evictions - s.frequency_evictions,
            "slots": slots,
        })
    });
    let text = match &detok {
        Some(d) => d.text()?,
        None => String::new(),
    };
    if args.json {
        let mut v = json!({
            "prompt_ids": prompt,
            "token_ids": ids,
            "text": text,
            "finish_reason": format!("{reason:?}").to_lowercase(),
            "stats": {
                "ttft_ms": stats.ttft.as_secs_f64() * 1e3,
                "prefill_tokens": stats.prefill_tokens,
                "prefill_tok_s": stats.prefill_tok_s(),
                "prefill_mode": args.prefill.name(),
                "chunk_size": rows,
                "prefill_blob_reads": stats.prefill_claims.misses,
                "prefill_bytes_read": stats.prefill_claims.bytes,
                "prefill_ring_hits": stats.prefill_claims.hits,
                "prefill_unions": stats.prefill_unions,
                "union_mean": union_mean,
                "union_max": union_max,
                "decode_tokens": stats.decode_tokens(),
                "decode_tok_s": stats.decode_tok_s(),
                "decode_blob_reads": stats.decode_claims.misses,
                "decode_ring_hits": stats.decode_claims.hits,
                "decode_bytes_read": stats.decode_claims.bytes,
                "process_read_bytes_prefill": io_first.zip(io_start).map(|(b, a)| b - a),
                "process_read_bytes_decode": io_end.zip(io_first).map(|(b, a)| b - a),
                "spec_depth": settings.spec_depth,
                "bets_issued": ring.bets_issued,
                "bets_used": ring.bets_used,
                "bet_bytes": ring.bet_bytes,
                "bytes_read": ring.bytes_read,
                "blob_reads": ring.blob_reads,
                "ring_hits": ring.hits,
                "ring_misses": ring.misses,
                "ring_evictions": ring.evictions,
                "ring_slots": engine.ring.n_slots(),
                "ring_bytes": engine.ring.ring_bytes(),
                "ring_classes": engine.ring.classes().iter().map(|c| json!({
                    "slot_bytes": c.stride, "slots": c.slots, "layers": c.layers,
                })).collect::<Vec<_>>(),
                "slot_states": slot_states,
                "io": engine.ring.io_mode().name(),
                "bytes_per_expert": manifest.experts.mean_blob_len(),
                "ring_slot_bytes": engine.vault.max_blob_stride(),
                "format_mix": manifest.format_mix(),
                "profile": profile,
            }
        });
        v["stats"]["vram"] = vram.unwrap_or(serde_json::Value::Null);
        let reads = json!({
            "lookahead": settings.lookahead,
            "lookahead_reads": ring.lookahead_reads,
            "lookahead_bytes": ring.lookahead_bytes,
            "lookahead_used": ring.lookahead_used,
            "lookahead_used_bytes": ring.lookahead_used_bytes,
            "lookahead_wasted_bytes": ring.lookahead_bytes.saturating_sub(ring.lookahead_used_bytes),
            "lookahead_cancelled": ring.lookahead_cancelled,
            "read_busy_ms": ring.read_busy_ns as f64 / 1e6,
            "prefill_io": prefill_io,
        });
        for (key, value) in reads.as_object().into_iter().flatten() {
            v["stats"][key] = value.clone();
        }
        writeln!(out, "{v}")?;
    } else if detok.is_none() {
        writeln!(out, "{}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","))?;
    } else if let Some(d) = detok.as_mut() {
        writeln!(out, "{}", d.flush()?)?;
    }
    Ok(())
}

/// The ring's reads from `start` to `first` (the first token), snapshots taken within a
/// window of `ttft` (the TTFT, give or take the snapshots): the streamer's busy time and
/// its share of that window, and what lookahead read, used and wasted.
fn prefill_io(start: &RingSnapshot, first: &RingSnapshot, ttft: Duration) -> serde_json::Value {
    let busy_ns = first.read_busy_ns - start.read_busy_ns;
    let (read, used) = (
        first.lookahead_bytes - start.lookahead_bytes,
        first.lookahead_used_bytes - start.lookahead_used_bytes,
    );
    json!({
        "bytes_read": first.bytes_read - start.bytes_read,
        "read_busy_ms": busy_ns as f64 / 1e6,
        "read_busy_share": if ttft.is_zero() { 0.0 } else { busy_ns as f64 / ttft.as_nanos() as f64 },
        "lookahead_reads": first.lookahead_reads - start.lookahead_reads,
        "lookahead_bytes": read,
        "lookahead_used": first.lookahead_used - start.lookahead_used,
        "lookahead_used_bytes": used,
        "lookahead_wasted_bytes": read.saturating_sub(used),
        "lookahead_cancelled": first.lookahead_cancelled - start.lookahead_cancelled,
    })
}

/// Bytes this process has caused to be read from storage (`read_bytes` of
/// `/proc/self/io`), or `None` where that file is missing.
fn process_read_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines().find_map(|l| l.strip_prefix("read_bytes:")).and_then(|v| v.trim().parse().ok())
}

/// Writes one JSON line per expert claim.
fn write_trace(path: &Path, events: &[smoe_proto::ClaimEvent]) -> Result<()> {
    let mut text = String::new();
    for e in events {
        text.push_str(&serde_json::to_string(e)?);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Writes `rows × vocab` f32 logits as a safetensors file with one tensor `logits`.
fn write_logits(path: &Path, data: &[f32], rows: usize, vocab: usize) -> Result<()> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![rows, vocab], bytes)
        .context("building the logits tensor")?;
    safetensors::serialize_to_file([("logits", view)], None, path)
        .with_context(|| format!("cannot write {}", path.display()))
}
