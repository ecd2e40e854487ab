//! `smoe-pipeline serve` configuration: bad keys and values are refused at start with the
//! key named, flags override the file, the example smoe.toml is valid, and with no
//! configuration at all the daemon serves the built-in demo model.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;

use std::path::Path;
use std::time::Duration;

use common::{run_err, run_ok};
use daemon::{request, Daemon};

/// Runs `serve --config FILE ARGS --print-config` on `toml` expecting failure; returns stderr.
fn refused(toml: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("smoe.toml");
    std::fs::write(&file, toml).unwrap();
    let mut all = vec!["serve", "--config", file.to_str().unwrap(), "--print-config"];
    all.extend_from_slice(args);
    run_err(&all)
}

#[test]
fn unknown_key_is_refused_by_name() {
    let err = refused("chunk_sise = 32\n", &[]);
    assert!(err.contains("unknown field `chunk_sise`"), "{err}");
    let err = refused("[sampling]\ntemprature = 0.5\n", &[]);
    assert!(err.contains("sampling.temprature"), "{err}");
}

#[test]
fn wrong_type_is_refused_by_name() {
    let err = refused("chunk_size = \"big\"\n", &[]);
    assert!(err.contains("key `chunk_size`") && err.contains("invalid type"), "{err}");
    let err = refused("listen = 8080\n", &[]);
    assert!(err.contains("key `listen`"), "{err}");
}

#[test]
fn out_of_range_values_are_refused_by_name() {
    for (toml, key) in [
        ("chunk_size = 0\n", "`chunk_size`"),
        ("max_sessions = 0\n", "`max_sessions`"),
        ("queue_depth = 0\n", "`queue_depth`"),
        ("shutdown_grace = -1.0\n", "`shutdown_grace`"),
        ("listen = \"not an address\"\n", "`listen`"),
        ("io = \"floppy\"\n", "`io`"),
        ("backend = \"tpu\"\n", "`backend`"),
        ("ring_slots = 4\nring_bytes = 65536\n", "`ring_slots`"),
        ("ring_slots = 0\n", "`ring_slots` (--ring-slots): must be between 1 and 16777216, got 0"),
        ("queue_depth = 100000\n", "`queue_depth` (--queue-depth): must be between 1 and 1024"),
        ("ring_bytes = \"12 parsecs\"\n", "key `ring_bytes`"),
        ("ring_bytes = 0\n", "`ring_bytes` (--ring-bytes)"),
        ("max_body_bytes = \"2GiB\"\n", "`max_body_bytes` (--max-body-bytes): must be between 1KiB and 1GiB"),
        ("idle_timeout = 0.0\n", "`idle_timeout` (--idle-timeout)"),
        ("header_read_timeout = -3.0\n", "`header_read_timeout`"),
        ("body_read_timeout = 1e9\n", "`body_read_timeout`"),
        ("max_connections = 0\n", "`max_connections` (--max-connections)"),
        ("state_snapshots = 65\n", "`state_snapshots` (--state-snapshots): must be between 0 and 64, got 65"),
        ("state_snapshots = -1\n", "key `state_snapshots`"),
        ("lookahead = 65537\n", "`lookahead` (--lookahead): must be between 0 and 65536, got 65537"),
        ("lookahead = -1\n", "key `lookahead`"),
        ("lookahead = \"all\"\n", "key `lookahead`"),
        ("[sampling]\ntop_p = 1.5\n", "`sampling.top_p`"),
    ] {
        let err = refused(toml, &[]);
        assert!(err.contains(key), "{toml:?}: {err}");
    }
    // Flags are checked like file values.
    let err = refused("", &["--chunk-size", "0"]);
    assert!(err.contains("`chunk_size`"), "{err}");
    let err = refused("", &["--queue-depth", "100000"]);
    assert!(err.contains("`queue_depth` (--queue-depth)"), "{err}");
    let err = refused("", &["--state-snapshots", "1000"]);
    assert!(err.contains("`state_snapshots` (--state-snapshots)"), "{err}");
    let err = refused("", &["--lookahead", "100000"]);
    assert!(err.contains("`lookahead` (--lookahead)"), "{err}");
    let err = refused("chunk_size = [1\n", &[]);
    assert!(err.contains("TOML parse error"), "{err}");
}

#[test]
fn flags_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("smoe.toml");
    std::fs::write(&file, "chunk_size = 8\nmax_queue = 3\n[sampling]\ntemperature = 0.0\n").unwrap();
    let out = run_ok(&["serve", "--config", file.to_str().unwrap(), "--chunk-size", "16", "--print-config"]);
    assert!(out.contains("chunk_size = 16"), "{out}");
    assert!(out.contains("max_queue = 3"), "{out}");
    assert!(out.contains("temperature = 0.0"), "{out}");
}

#[test]
fn sizes_take_units() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("smoe.toml");
    std::fs::write(&file, "ring_bytes = \"12GiB\"\n").unwrap();
    let out = run_ok(&["serve", "--config", file.to_str().unwrap(), "--print-config"]);
    assert!(out.contains("ring_bytes = \"12GiB\""), "{out}");
    std::fs::write(&file, "ring_bytes = 1073741824\n").unwrap();
    let out = run_ok(&["serve", "--config", file.to_str().unwrap(), "--print-config"]);
    assert!(out.contains("ring_bytes = \"1GiB\""), "{out}");
    let out =
        run_ok(&["serve", "--config", file.to_str().unwrap(), "--ring-bytes", "512M", "--print-config"]);
    assert!(out.contains("ring_bytes = \"512MiB\""), "{out}");
}

#[test]
fn example_config_is_valid() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("smoe.toml");
    let out = run_ok(&["serve", "--config", example.to_str().unwrap(), "--print-config"]);
    assert!(out.contains("chunk_size = 512"), "{out}");
}

#[test]
fn missing_vault_is_a_clean_error() {
    let err = run_err(&["serve", "--vault", "/nonexistent/vault", "--listen", "127.0.0.1:0"]);
    assert!(err.contains("/nonexistent/vault"), "{err}");
}

#[test]
fn no_config_serves_the_demo_model() {
    let cache = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(&[], &[("XDG_CACHE_HOME", cache.path())]);
    let models = request(&d.url, "GET", "/v1/models", "");
    assert!(models.contains("smoe-demo-tiny-random") && models.contains("random-weight demo"), "{models}");
    assert!(d.log().contains("tiny random-weight demo model"), "{}", d.log());
    // It chats (the README's first request).
    let body = r#"{"model": "smoe-demo-tiny-random", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}"#;
    let reply: serde_json::Value =
        serde_json::from_str(&request(&d.url, "POST", "/v1/chat/completions", body)).unwrap();
    let choice = &reply["choices"][0];
    assert!(choice["message"]["content"].is_string(), "{reply}");
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()), "{reply}");
    assert!(reply["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{reply}");
    let (status, _) = d.terminate(Duration::from_secs(30));
    assert!(status.success());
    // Second start: the vault made on the first is reused.
    let mut d = Daemon::start(&[], &[("XDG_CACHE_HOME", cache.path())]);
    assert!(!d.log().contains("first run"), "{}", d.log());
    assert!(request(&d.url, "GET", "/health", "").contains("\"ok\""));
    d.terminate(Duration::from_secs(30));
}

/// Production code embeds no test fixture (the demo model is built from `synth` and
/// `assets/demo/`).
#[test]
fn the_binary_embeds_nothing_from_tests() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut todo = vec![repo.join("src"), repo.join("actors/src"), repo.join("proto/src")];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                // Unit tests (a `#[cfg(test)]` module at the end of a file) may.
                for (i, line) in text.lines().enumerate().take_while(|(_, l)| l.trim() != "#[cfg(test)]") {
                    let embeds = line.contains("include_bytes!(") || line.contains("include_str!(");
                    assert!(!(embeds && line.contains("tests/")), "{}:{}: {line}", p.display(), i + 1);
                }
            }
        }
    }
}
