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

    // A long streaming request in flight when SIGTERM arrives: it is cancelled after the
    // grace, its stream ends with an error event and [DONE], and the daemon exits 0.
    let addr = d.url.trim_start_matches("http://").to_string();
    let mut conn = TcpStream::connect(&addr).unwrap();
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
    while !line.starts_with("data: {") {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the stream ended before its first event");
        assert!(!line.starts_with("HTTP/1.1 4"), "refused: {line}");
    }
    let (status, took) = d.terminate(Duration::from_secs(GRACE_S + 15));
    assert!(status.success(), "exit status {status:?}\n{}", d.log());
    assert!(
        took >= Duration::from_secs(GRACE_S) - Duration::from_millis(200),
        "exited before the grace: {took:?}"
    );
    let rest: Vec<String> =
        reader.lines().map_while(Result::ok).filter(|l| l.starts_with("data: ")).collect();
    let tail = rest.iter().rev().take(2).cloned().collect::<Vec<_>>();
    assert_eq!(tail.first().map(String::as_str), Some("data: [DONE]"), "{tail:?}");
    assert!(tail[1].contains("shutting down"), "{tail:?}");
    println!("in-flight request cancelled; daemon exited 0 {took:?} after SIGTERM (grace {GRACE_S} s)");
}
