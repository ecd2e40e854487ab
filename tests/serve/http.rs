//! Raw HTTP/1.1 for the `serve` tests that need control over the bytes on the wire
//! (slow, partial, oversized or abandoned requests).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// A parsed response.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body text.
    pub body: String,
}

impl Reply {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

/// `host:port` of a daemon URL.
pub fn addr(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

/// Opens a connection with a 60 s read timeout.
pub fn connect(url: &str) -> TcpStream {
    let c = TcpStream::connect(addr(url)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c
}

/// The head of a request (`Connection: close`) with a JSON body of `len` bytes.
pub fn post_head(url: &str, path: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n",
        addr(url)
    )
}

/// Sends `raw` on a fresh connection and reads the whole response.
pub fn exchange(url: &str, raw: &[u8]) -> Reply {
    let mut c = connect(url);
    // The server may answer (413) before reading everything: ignore a reset write.
    let _ = c.write_all(raw);
    read_reply(&mut c)
}

/// POSTs `body` as JSON to `path`.
pub fn post(url: &str, path: &str, body: &str) -> Reply {
    let mut raw = post_head(url, path, body.len()).into_bytes();
    raw.extend_from_slice(body.as_bytes());
    exchange(url, &raw)
}

/// GETs `path`.
pub fn get(url: &str, path: &str) -> Reply {
    exchange(
        url,
        format!("GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", addr(url)).as_bytes(),
    )
}

/// Reads one response from `c` (until the connection closes, or the declared length).
pub fn read_reply(c: &mut TcpStream) -> Reply {
    let mut r = BufReader::new(c);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status =
        line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (n, v) = l.split_once(':').unwrap();
        headers.push((n.to_ascii_lowercase(), v.trim().to_string()));
    }
    let len = headers.iter().find(|(n, _)| n == "content-length").map(|(_, v)| v.parse::<usize>().unwrap());
    let mut body = Vec::new();
    match len {
        Some(n) => {
            body.resize(n, 0);
            r.read_exact(&mut body).unwrap();
        }
        None => {
            let _ = r.read_to_end(&mut body);
        }
    }
    Reply { status, headers, body: String::from_utf8_lossy(&body).into_owned() }
}
