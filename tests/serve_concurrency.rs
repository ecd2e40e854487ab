//! `smoe-pipeline serve` under load: N clients at once all complete or get 429 with a
//! Retry-After, a disconnecting client cancels its generation, memory stays bounded
//! (tests/serve/test_concurrency.py); then SIGTERM with a request in flight exits 0
//! within the shutdown grace.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use daemon::{python, Daemon};

const MAX_QUEUE: &str = "2";
const GRACE_S: u64 = 2;

#[test]
fn concurrency_cancellation_and_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let grace = GRACE_S.to_string();
    let mut d = Daemon::start(
        &["--vault", vault.to_str().unwrap(), "--max-queue", MAX_QUEUE, "--shutdown-grace", &grace],
        &[],
    );
    python(&d, "test_concurrency.py", &[&d.url, &d.pid().to_string(), MAX_QUEUE], Duration::from_secs(400));

    // Two long streaming requests in flight when SIGTERM arrives (one running, one queued
    // behind it): they get the grace, then are cancelled; each stream ends with [DONE]
    // (the queued one after an error event), and the daemon exits 0.
    let addr = d.url.trim_start_matches("http://").to_string();
    let running = open_stream(&addr);
    let queued = open_stream(&addr);
    let (status, took) = d.terminate(Duration::from_secs(GRACE_S + 15));
    assert!(status.success(), "exit status {status:?}\n{}", d.log());
    assert!(
        took >= Duration::from_secs(GRACE_S) - Duration::from_millis(200),
        "exited before the grace: {took:?}"
    );
    for (name, stream) in [("running", running), ("queued", queued)] {
        let events: Vec<String> =
            stream.lines().map_while(Result::ok).filter(|l| l.starts_with("data: ")).collect();
        assert_eq!(events.last().map(String::as_str), Some("data: [DONE]"), "{name}: {events:?}");
        if name == "queued" {
            assert!(events[events.len() - 2].contains("shutting down"), "{name}: {events:?}");
        }
    }
    println!("in-flight requests cancelled; daemon exited 0 {took:?} after SIGTERM (grace {GRACE_S} s)");
}

/// Sends a long streaming completion request; returns the stream after its 200 headers.
fn open_stream(addr: &str) -> BufReader<TcpStream> {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body =
        r#"{"model":"moe_all.vault","prompt":"Hello","max_tokens":4000,"ignore_eos":true,"stream":true}"#;
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "refused: {line}");
    while line.trim_end() != "" {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the connection closed in the headers");
    }
    reader
}
