//! A real Prometheus (Debian's `prometheus`, started here on loopback) scrapes
//! `smoe-pipeline serve`; every PromQL expression of grafana/dashboards/smoe-pipeline.json
//! must return data after some traffic (tests/serve/test_prometheus.py).

mod common;
#[path = "serve/daemon.rs"]
mod daemon;

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use daemon::{python, Daemon};

/// A Prometheus process, killed on drop.
struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn dashboard_queries_return_data_from_a_real_prometheus() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let promtool = Command::new("promtool")
        .args(["check", "config"])
        .arg(repo.join("grafana/prometheus.yml"))
        .output()
        .expect("promtool runs (scripts/test.sh installs Debian's prometheus package)");
    assert!(promtool.status.success(), "{}", String::from_utf8_lossy(&promtool.stderr));

    let dir = tempfile::tempdir().unwrap();
    let vault = common::convert("moe_all", dir.path(), &[]);
    // A ring much smaller than the model's 24 experts (reads and evictions on every token),
    // and speculative prefetch on.
    let d =
        Daemon::start(&["--vault", vault.to_str().unwrap(), "--ring-slots", "6", "--spec-depth", "2"], &[]);
    let target = d.url.trim_start_matches("http://");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: smoe-pipeline\n    \
             static_configs:\n      - targets: [\"{target}\"]\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let prom = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus runs (scripts/test.sh installs Debian's prometheus package)"),
    );
    let dashboard = repo.join("grafana/dashboards/smoe-pipeline.json");
    python(
        &d,
        "test_prometheus.py",
        &[&d.url, &format!("http://127.0.0.1:{port}"), dashboard.to_str().unwrap()],
        Duration::from_secs(300),
    );
    drop(prom);
}
