//! A client that goes away is noticed by `serve` while its request waits in the queue
//! (it leaves the queue at once) and while its prompt is prefilled (prefill stops at the
//! next chunk), for streaming and non-streaming requests alike: closed requests do not
//! raise `smoe_prefill_tokens_total` by their prompt length.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;
#[path = "serve/http.rs"]
mod http;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use daemon::Daemon;

/// Prompt length of the abandoned requests (the fixture's context is 4096).
const PROMPT: usize = 4000;

/// `smoe_prefill_tokens_total`.
fn prefilled(url: &str) -> f64 {
    let m = http::get(url, "/metrics").body;
    let line = m.lines().find(|l| l.starts_with("smoe_prefill_tokens_total ")).expect("the prefill counter");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// `(queued, running)` from `/health`.
fn health(url: &str) -> (u64, u64) {
    let h = http::get(url, "/health").json();
    (h["queued"].as_u64().unwrap(), h["running"].as_u64().unwrap())
}

/// Waits (at most 20 s) until `/health` says `want`.
fn wait_health(url: &str, want: (u64, u64), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let h = health(url);
        if h == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: /health stays at (queued, running) = {h:?}, wanted {want:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends a completion request of `prompt_len` token ids; for a stream, waits for the
/// 200 headers. The connection stays open until the returned stream is dropped.
fn open(url: &str, prompt_len: usize, max_tokens: usize, stream: bool) -> TcpStream {
    let ids: Vec<String> = (0..prompt_len).map(|i| ((i * 7) % 440).to_string()).collect();
    let body = format!(
        "{{\"model\":\"moe_all.vault\",\"prompt\":[{}],\"max_tokens\":{max_tokens},\"ignore_eos\":true,\"stream\":{stream}}}",
        ids.join(",")
    );
    let mut c = http::connect(url);
    c.write_all(http::post_head(url, "/v1/completions", body.len()).as_bytes()).unwrap();
    c.write_all(body.as_bytes()).unwrap();
    if stream {
        let mut r = BufReader::new(c.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    }
    c
}

#[test]
fn gone_clients_leave_the_queue_and_stop_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    // Chunks of 4 tokens: a 4000-token prefill takes seconds, so a disconnect lands in it.
    let d =
        Daemon::start(&["--vault", vault.to_str().unwrap(), "--chunk-size", "4", "--max-queue", "4"], &[]);

    for stream in [true, false] {
        let before = prefilled(&d.url);
        // Queued behind a long generation, then gone.
        let blocker = open(&d.url, 3, 4000, true);
        wait_health(&d.url, (0, 1), "the blocker runs");
        let queued = open(&d.url, PROMPT, 1, stream);
        wait_health(&d.url, (1, 1), "the request waits");
        drop(queued);
        wait_health(&d.url, (0, 1), "the abandoned request leaves the queue");
        drop(blocker);
        wait_health(&d.url, (0, 0), "the blocker stops");
        let spent = prefilled(&d.url) - before;
        assert!(
            spent < PROMPT as f64,
            "stream {stream}: {spent} tokens prefilled for a request gone while queued"
        );

        // Running its prefill, then gone.
        let before = prefilled(&d.url);
        let running = open(&d.url, PROMPT, 1, stream);
        wait_health(&d.url, (0, 1), "the request runs");
        drop(running);
        wait_health(&d.url, (0, 0), "the abandoned prefill stops");
        let spent = prefilled(&d.url) - before;
        assert!(
            spent < PROMPT as f64 / 2.0,
            "stream {stream}: {spent} of {PROMPT} tokens prefilled after the client left"
        );
        println!(
            "stream {stream}: {spent} of {PROMPT} prompt tokens prefilled before the disconnect stopped it"
        );
    }
}
