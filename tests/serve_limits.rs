//! `smoe-pipeline serve` at its limits, over raw HTTP: every error is OpenAI-style JSON
//! (413 for bodies over `max_body_bytes` included), 500s keep server paths out of the
//! response (the log has them), prompts too long for the context by their byte length
//! alone are refused before they are tokenized, slow heads and bodies and idle
//! connections time out, and connections beyond `max_connections` get a JSON 503.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;
#[path = "serve/http.rs"]
mod http;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use daemon::Daemon;
use http::{exchange, get, post};

/// Starts the daemon on `vault` with `extra` flags.
fn start(vault: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--vault", vault.to_str().unwrap()];
    args.extend_from_slice(extra);
    Daemon::start(&args, &[])
}

/// Asserts an OpenAI-style error object with `status`; returns its `error` member.
fn api_error(r: &http::Reply, status: u16) -> serde_json::Value {
    assert_eq!(r.status, status, "{r:?}");
    assert!(r.header("content-type").is_some_and(|t| t.starts_with("application/json")), "{r:?}");
    let e = r.json()["error"].clone();
    assert!(e["message"].is_string() && e["type"].is_string(), "{r:?}");
    e
}

#[test]
fn bodies_over_the_limit_get_json_413() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let d = start(&vault, &[]);
    // Over the default limit (8 MiB), declared up front.
    let big = format!("{{\"model\":\"moe_all.vault\",\"prompt\":\"{}\"}}", "a".repeat(9 << 20));
    let e = api_error(&post(&d.url, "/v1/completions", &big), 413);
    assert_eq!(e["code"], "request_too_large");
    assert!(e["message"].as_str().unwrap().contains("`max_body_bytes` = 8MiB"), "{e}");
    drop(d);

    let d = start(&vault, &["--max-body-bytes", "4KiB"]);
    let body = format!("{{\"model\":\"moe_all.vault\",\"prompt\":\"{}\"}}", "a".repeat(5000));
    api_error(&post(&d.url, "/v1/chat/completions", &body), 413);
    // Chunked, without a length: cut off once past the limit.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        http::addr(&d.url)
    );
    let mut raw = head.into_bytes();
    raw.extend_from_slice(format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()).as_bytes());
    api_error(&exchange(&d.url, &raw), 413);
    // Under the limit still works.
    let r = post(&d.url, "/v1/completions", r#"{"model":"moe_all.vault","prompt":"Hello","max_tokens":2}"#);
    assert_eq!(r.status, 200, "{r:?}");
}

#[test]
fn extractor_and_route_errors_are_json() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let d = start(&vault, &[]);
    // axum's own rejection of a path parameter that is not UTF-8.
    let e = api_error(&get(&d.url, "/v1/models/%FF"), 400);
    assert_eq!(e["type"], "invalid_request_error");
    api_error(&get(&d.url, "/no/such/route"), 404);
    api_error(&get(&d.url, "/v1/completions"), 405);
}

/// Flips a bit of every `every`-th byte of `file`, starting at its first.
fn corrupt(file: &Path, every: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    for b in bytes.iter_mut().step_by(every) {
        *b ^= 0x40;
    }
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn engine_failures_keep_server_paths_out_of_responses() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    // Corrupt every expert blob of layer 0: the first request fails its read.
    corrupt(&vault.join("experts/layer_000.bin"), 4096);
    let d = Daemon::start(&["--vault", vault.to_str().unwrap()], &[]);
    let r = post(&d.url, "/v1/completions", r#"{"model":"moe_all.vault","prompt":"Hello","max_tokens":2}"#);
    let e = api_error(&r, 500);
    let msg = e["message"].as_str().unwrap();
    let here = dir.path().to_str().unwrap();
    assert!(!r.body.contains(here) && !r.body.contains("layer_000.bin"), "server path sent: {}", r.body);
    let id =
        msg.split("error id ").nth(1).and_then(|s| s.split(';').next()).unwrap_or_else(|| panic!("{msg}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(d.log().contains(id) && d.log().contains("layer_000.bin")) {
        assert!(Instant::now() < deadline, "the log lacks error {id} with its detail:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn prompts_too_long_by_bytes_are_refused_before_tokenizing() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let d = start(&vault, &[]);
    // moe_all: 4096 positions; its tokens cover at most 13 bytes (`<|endoftext|>`), times 3
    // for NFC, so more than 4096 × 39 bytes cannot fit.
    let prompt = "ab ".repeat(60_000);
    let body = format!("{{\"model\":\"moe_all.vault\",\"prompt\":\"{prompt}\"}}");
    let e = api_error(&post(&d.url, "/v1/completions", &body), 400);
    assert_eq!(e["code"], "context_length_exceeded");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("180000 bytes") && msg.contains("at most 39 bytes"), "{msg}");
    // Within the bound, the token count decides.
    let body = format!("{{\"model\":\"moe_all.vault\",\"prompt\":\"{}\"}}", "ab ".repeat(20_000));
    let msg = api_error(&post(&d.url, "/v1/completions", &body), 400)["message"].clone();
    assert!(msg.as_str().unwrap().contains("the prompt has"), "{msg}");
}

/// Seconds until the server closes `c` (reads and discards whatever it sends first).
fn closed_after(c: &mut TcpStream, since: Instant) -> f64 {
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => return since.elapsed().as_secs_f64(),
            Ok(_) => {}
        }
    }
}

#[test]
fn slow_heads_and_idle_connections_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let d = start(&vault, &["--header-read-timeout", "1", "--idle-timeout", "3"]);
    // Nothing sent: idle.
    let t = Instant::now();
    let idle = closed_after(&mut http::connect(&d.url), t);
    assert!((2.5..8.0).contains(&idle), "an idle connection closed after {idle} s");
    // Half a head: the header timeout, counted from its first byte.
    let mut c = http::connect(&d.url);
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let slow = closed_after(&mut c, t);
    assert!((0.8..2.5).contains(&slow), "a half-sent head closed after {slow} s");
    // Kept alive after a request, then idle.
    let mut c = http::connect(&d.url);
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_eq!(http::read_reply(&mut c).status, 200);
    let t = Instant::now();
    let kept = closed_after(&mut c, t);
    assert!((2.5..8.0).contains(&kept), "a kept-alive connection closed after {kept} s");
}

#[test]
fn slow_bodies_get_json_408() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let d = start(&vault, &["--body-read-timeout", "1"]);
    let mut c = http::connect(&d.url);
    let t = Instant::now();
    c.write_all(http::post_head(&d.url, "/v1/completions", 100).as_bytes()).unwrap();
    c.write_all(b"{\"model\": ").unwrap();
    let e = api_error(&http::read_reply(&mut c), 408);
    assert_eq!(e["code"], "request_timeout");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn connections_over_the_limit_get_json_503() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let d = start(&vault, &["--max-connections", "2"]);
    let held = [http::connect(&d.url), http::connect(&d.url)];
    let mut third = http::connect(&d.url);
    let e = api_error(&http::read_reply(&mut third), 503);
    assert_eq!(e["code"], "too_many_connections");
    drop(held);
    // Once the server has seen them close, connections are accepted again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = get(&d.url, "/health");
        if r.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {r:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_corrupt_resident_tensor_found_in_the_background_stops_serving() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    corrupt(&vault.join("resident.bin"), usize::MAX);
    let d = start(&vault, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&d.url, "/health").status != 503 {
        assert!(Instant::now() < deadline, "still healthy:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(get(&d.url, "/health").body.contains("vault_corrupt"));
    let r = post(&d.url, "/v1/completions", r#"{"model":"moe_all.vault","prompt":"Hello","max_tokens":2}"#);
    assert!(!r.body.contains("resident.bin"), "{r:?}");
    api_error(&r, 500);
    assert!(
        d.log().contains("checksum mismatch for resident tensor `model.embed_tokens.weight`"),
        "{}",
        d.log()
    );
}
