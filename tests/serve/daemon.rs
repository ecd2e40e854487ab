//! Helpers for the `serve` tests: start the daemon on a free loopback port, run the
//! Python client tests against it, stop it with SIGTERM.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running daemon; killed on drop if still running.
pub struct Daemon {
    child: Child,
    /// Base URL, e.g. `http://127.0.0.1:40123`.
    pub url: String,
    log: Arc<Mutex<String>>,
}

impl Daemon {
    /// Starts `smoe-pipeline serve --listen 127.0.0.1:0 ARGS` and waits (at most 120 s)
    /// for its "listening on" line.
    pub fn start(args: &[&str], env: &[(&str, &Path)]) -> Daemon {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_smoe-pipeline"));
        cmd.arg("serve").args(["--listen", "127.0.0.1:0"]).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .env("RUST_BACKTRACE", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("listening on http://") {
                    let _ = tx.send(line[i + "listening on ".len()..].trim().to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let url = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(u) => u,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the daemon did not start:\n{}", log.lock().unwrap());
            }
        };
        Daemon { child, url, log }
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the daemon logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Sends SIGTERM and waits up to `within` for the exit; returns the status and the
    /// time it took.
    pub fn terminate(&mut self, within: Duration) -> (ExitStatus, Duration) {
        let t = Instant::now();
        let ok = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().unwrap().success();
        assert!(ok, "kill -TERM failed");
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return (s, t.elapsed());
            }
            if t.elapsed() > within {
                let _ = self.child.kill();
                panic!("the daemon did not exit within {within:?} of SIGTERM:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `tests/serve/NAME`.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve").join(name)
}

/// Runs `python3 tests/serve/SCRIPT ARGS` (at most `limit`), asserting success; prints
/// its output and, on failure, the daemon's log.
pub fn python(daemon: &Daemon, name: &str, args: &[&str], limit: Duration) {
    let child = Command::new("python3")
        .arg(script(name))
        .args(args)
        .env("PYTHONUNBUFFERED", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs (scripts/test.sh installs what the tests need)");
    let pid = child.id();
    let t = Instant::now();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            rx.recv().unwrap().unwrap()
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(
        out.status.success(),
        "{name} failed ({:?} after {:?}):\n{text}\n--- daemon log ---\n{}",
        out.status,
        t.elapsed(),
        daemon.log()
    );
}

/// `method path` with the JSON `body` (none when empty) over plain HTTP/1.1; asserts
/// status 200 and returns the response body.
pub fn request(url: &str, method: &str, path: &str, body: &str) -> String {
    let addr = url.trim_start_matches("http://");
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let content = if body.is_empty() {
        String::new()
    } else {
        format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len())
    };
    write!(c, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{content}Connection: close\r\n\r\n{body}")
        .unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    resp.split_once("\r\n\r\n").unwrap().1.to_string()
}
