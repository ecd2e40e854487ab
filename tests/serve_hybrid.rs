//! `smoe-pipeline serve` on a hybrid model (Qwen3.5-MoE: DeltaNet layers whose recurrent
//! state cannot be cut back): a second turn extending the first resumes from its live
//! state, a prompt that diverges inside a stored stream resumes from the longest state
//! snapshot at or below the divergence, `cached_tokens` says what was reused, and every
//! such turn generates exactly what a fresh run of the whole prompt does; on the CPU and
//! on the Vulkan backend (lavapipe in CI), whose states and snapshots live on the device.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;
#[path = "serve/http.rs"]
mod http;
#[cfg(feature = "vulkan")]
mod vulkan;

use common::*;
use daemon::Daemon;
use http::post;
use serde_json::{json, Value};

/// Greedy completion of `prompt` (token ids): (text, cached_tokens, prompt_tokens).
fn complete(d: &Daemon, prompt: &[u32], max_tokens: usize) -> (String, u64, u64) {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let r = post(&d.url, "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{r:?}\n{}", d.log());
    let v: Value = r.json();
    let usage = &v["usage"];
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn a_hybrid_session_resumes_from_its_state_and_matches_a_fresh_run() {
    resumes_and_matches_a_fresh_run("cpu");
}

#[cfg(feature = "vulkan")]
#[test]
fn a_hybrid_session_on_vulkan_resumes_from_its_state_and_matches_a_fresh_run() {
    if vulkan::context().is_some() {
        resumes_and_matches_a_fresh_run("vulkan");
    }
}

/// The turns of the test on `backend`.
fn resumes_and_matches_a_fresh_run(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("q35_f32", dir.path(), &[]);
    // Turn 1's generated ids, from the command line (greedy decoding is deterministic).
    let (p1, _) = golden_cases("q35_f32").remove(1);
    let lpath = dir.path().join("l.safetensors");
    let g1 = id_list(&generate_json(&vault, &p1, 8, &lpath, &["--backend", backend])["token_ids"]);
    // One stored session, chunks of 8 tokens: snapshots every 16 positions or more.
    let v = vault.to_str().unwrap();
    let args =
        ["--vault", v, "--backend", backend, "--max-sessions", "1", "--chunk-size", "8", "--model-name", "m"];
    let d = Daemon::start(&args, &[]);
    let log = d.log();
    assert!(log.contains(&format!("backend {backend}")), "{log}");
    assert!(log.contains("DeltaNet states") && log.contains("state snapshots"), "{log}");
    let unrelated = [7u32; 3];

    // Turn 2 extends turn 1 (its prompt, its reply, new text): everything turn 1 ran is
    // reused through the live state.
    let (_, cached, _) = complete(&d, &p1, 8);
    assert_eq!(cached, 0);
    let turn2: Vec<u32> = p1.iter().chain(&g1).chain(&[11, 12, 13]).copied().collect();
    let (reply2, cached2, n2) = complete(&d, &turn2, 8);
    assert_eq!(cached2 as usize, p1.len() + g1.len() - 1, "turn 2 reuses all turn 1 ran");
    assert_eq!(n2 as usize, turn2.len());

    // A prompt diverging inside the stored stream resumes from a snapshot.
    let cut = p1.len() - 3;
    let diverged: Vec<u32> = p1[..cut].iter().chain(&[21, 22, 23, 24]).copied().collect();
    let (reply3, cached3, _) = complete(&d, &diverged, 8);
    assert!(cached3 > 0 && (cached3 as usize) < cut, "resumes from a snapshot below {cut}: {cached3}");
    assert!((cut - cached3 as usize) < 2 * 16, "the snapshot is one of the newest: {cached3}");

    // Fresh runs (the only session recycled first) give the same text.
    for (prompt, reply) in [(&turn2, &reply2), (&diverged, &reply3)] {
        assert_eq!(complete(&d, &unrelated, 1).1, 0);
        let (fresh, cached, _) = complete(&d, prompt, 8);
        assert_eq!(cached, 0);
        assert_eq!(&fresh, reply, "a resumed session generates what a fresh run does");
    }
}

/// `--state-snapshots 0`: a stored session keeps only its live state, so a prompt that
/// diverges inside its stream reuses nothing (and the log says what a session costs).
#[test]
fn without_state_snapshots_a_diverging_prompt_starts_over() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("q35_f32", dir.path(), &[]);
    let (p1, _) = golden_cases("q35_f32").remove(1);
    let v = vault.to_str().unwrap();
    let args = [
        "--vault",
        v,
        "--max-sessions",
        "1",
        "--chunk-size",
        "8",
        "--model-name",
        "m",
        "--state-snapshots",
        "0",
    ];
    let d = Daemon::start(&args, &[]);
    assert!(d.log().contains("up to 0 state snapshots 0.0 MiB"), "{}", d.log());
    assert_eq!(complete(&d, &p1, 4).1, 0);
    let diverged: Vec<u32> = p1[..p1.len() - 3].iter().chain(&[21, 22, 23, 24]).copied().collect();
    assert_eq!(complete(&d, &diverged, 4).1, 0);
}
