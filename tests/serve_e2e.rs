//! `smoe-pipeline serve` end to end: the real `openai` Python client against a daemon on
//! loopback (tests/serve/test_openai.py), then a graceful SIGTERM.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;

use std::time::Duration;

use daemon::{python, Daemon};

#[test]
fn openai_client_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    let mut d = Daemon::start(
        &[
            "--vault",
            vault.to_str().unwrap(),
            "--api-key",
            "test-key",
            "--max-context",
            "512",
            "--max-sessions",
            "2",
        ],
        &[],
    );
    python(&d, "test_openai.py", &[&d.url, "test-key"], Duration::from_secs(300));
    let (status, took) = d.terminate(Duration::from_secs(30));
    assert!(status.success(), "exit status {status:?}\n{}", d.log());
    assert!(d.log().contains("shutting down"), "{}", d.log());
    println!("idle daemon exited {took:?} after SIGTERM");
}
