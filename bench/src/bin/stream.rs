//! Streaming bandwidth: sustained MB/s of expert reads through the ring (announce a
//! window of experts, then claim them, as prefill does) for io_uring and pread at
//! several queue depths, against the raw O_DIRECT bandwidth of the same files on the
//! same disk (sequential 4 MiB reads, like `fio --rw=read --bs=4m --direct=1`, and
//! random blob-sized reads at queue depth 1).
//!
//! Usage: `stream VAULT [BLOBS_PER_RUN] [RING_SLOTS]`

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use smoe_actors::ring::memory::{HostAllocator, SlotAllocator};
use smoe_actors::ring::{RingCache, RingOptions, RingSize};
use smoe_actors::streamer::{IoChoice, StreamerOptions};
use smoe_actors::vault::Vault;
use smoe_proto::{ExpertKey, ExpertSource};

fn mbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e6
}

/// Sequential O_DIRECT reads of every layer file in 4 MiB requests.
fn raw_sequential(vault: &Vault, limit: u64) -> f64 {
    let arena = HostAllocator.allocate(1, 4 << 20).expect("buffer");
    // SAFETY: one 4 MiB slot, exclusively ours.
    let buf = unsafe { std::slice::from_raw_parts_mut(arena.base(), 4 << 20) };
    let (mut total, start) = (0u64, Instant::now());
    'files: for l in &vault.manifest().experts.layers {
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(vault.dir().join(&l.file))
            .expect("open");
        let mut off = 0;
        while off < l.file_len {
            let n = f.read_at(buf, off).expect("read");
            if n == 0 {
                break;
            }
            off += n as u64;
            total += n as u64;
            if total >= limit {
                break 'files;
            }
        }
    }
    mbps(total, start.elapsed().as_secs_f64())
}

/// Random blob reads with O_DIRECT pread at queue depth 1.
fn raw_random(vault: &Vault, keys: &[ExpertKey]) -> f64 {
    let stride = vault.max_blob_stride() as usize;
    let arena = HostAllocator.allocate(1, stride).expect("buffer");
    // SAFETY: one slot, exclusively ours.
    let buf = unsafe { std::slice::from_raw_parts_mut(arena.base(), stride) };
    let (mut total, start) = (0u64, Instant::now());
    for &k in keys {
        let loc = vault.blob(k).expect("blob");
        let f = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&loc.file).expect("open");
        total += f.read_at(buf, loc.offset).expect("read") as u64;
    }
    mbps(total, start.elapsed().as_secs_f64())
}

/// Streams `keys` through a fresh ring: announce a window, claim it, repeat.
fn ring_stream(vault: &Arc<Vault>, keys: &[ExpertKey], slots: usize, io: IoChoice, qd: usize) -> (f64, u64) {
    let opts = RingOptions {
        size: RingSize::Slots(slots),
        streamer: StreamerOptions { io, queue_depth: qd, fault: None },
    };
    let ring = RingCache::new(vault.clone(), &HostAllocator, &opts).expect("ring");
    let window = (2 * qd).clamp(1, slots / 2);
    let start = Instant::now();
    for w in keys.chunks(window) {
        let announced = w.iter().take_while(|&&k| ring.announce(k)).count();
        for &k in w {
            drop(ring.claim(k).expect("claim"));
        }
        assert!(announced <= w.len());
    }
    let s = ring.stats();
    (mbps(s.bytes_read, start.elapsed().as_secs_f64()), s.blob_reads)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: stream VAULT [BLOBS_PER_RUN] [RING_SLOTS]");
        std::process::exit(2);
    };
    let vault = Arc::new(Vault::open(path).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    }));
    let m = vault.manifest();
    let mut all: Vec<ExpertKey> = m
        .experts
        .layers
        .iter()
        .flat_map(|l| (0..m.model.num_experts).map(move |e| ExpertKey::new(l.layer, e)))
        .collect();
    let per_run: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(256).min(all.len());
    let slots: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(64);
    let blob = m.experts.layers.iter().map(|l| l.layout.blob_len).max().unwrap_or(0);
    println!(
        "vault {path}: {} expert blobs of {:.2} MB; {per_run} blobs per run ({:.2} GB), ring {slots} slots",
        all.len(),
        blob as f64 / 1e6,
        (per_run as u64 * blob) as f64 / 1e9
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    all.shuffle(&mut rng);
    let seq = raw_sequential(&vault, per_run as u64 * blob);
    let rnd = raw_random(&vault, &all[..per_run.min(64)]);
    println!("raw O_DIRECT sequential 4 MiB reads: {seq:>8.0} MB/s");
    println!("raw O_DIRECT random blob reads, QD1: {rnd:>8.0} MB/s");
    println!("{:<10} {:>3} {:>10} {:>8} {:>8} {:>7}", "path", "qd", "MB/s", "vs seq", "vs rand", "blobs");
    for (name, io) in [("io-uring", IoChoice::IoUring), ("pread", IoChoice::Pread)] {
        for qd in [1, 4, 16] {
            all.shuffle(&mut rng);
            let (r, n) = ring_stream(&vault, &all[..per_run], slots, io, qd);
            println!(
                "{name:<10} {qd:>3} {r:>10.0} {:>7.0}% {:>7.0}% {n:>7}",
                100.0 * r / seq,
                100.0 * r / rnd
            );
        }
    }
}
