//! The streamer: reads expert blobs from the vault's layer files straight into ring
//! slots. io_uring with O_DIRECT (registered buffers where the slot memory allows) is
//! the default; a pool of threads doing O_DIRECT `pread` is the fallback where
//! io_uring cannot be set up, or when forced. Demand reads are always issued before
//! speculative ones. Every blob's checksum is verified after its read; a failed,
//! short or corrupt read fails only the request that needed it.
//!
//! The streamer is an actor on its own threads: it owns the io_uring instance and the
//! open files and receives typed [`ReadRequest`] messages through its queue.

mod busy;
mod pread;
pub mod queue;
mod uring;

use std::fs::File;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use smoe_proto::{ExpertKey, ReadRequest, VaultError};

use crate::blob_check::verify_blob;
use crate::vault::files::open_direct;
use crate::vault::{BlobLocation, Vault};
use queue::IoQueue;

/// Receives the streamer's results: where to read to, and what happened.
pub trait LoadSink: Send + Sync {
    /// Start of `slot`'s memory (at least the blob stride long, 16 KiB-aligned).
    fn slot_ptr(&self, slot: u32) -> *mut u8;
    /// Bytes of `slot`'s memory (its size class's stride).
    fn slot_len(&self, slot: u32) -> usize;
    /// Number of slots (for the kernel's table of registered buffers).
    fn n_slots(&self) -> usize;
    /// Called once per request, after the read and checksum.
    fn complete(&self, req: ReadRequest, result: Result<(), VaultError>, latency: Duration);
}

/// Which I/O path to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IoChoice {
    /// io_uring, falling back to pread if the kernel refuses it.
    Auto,
    /// io_uring only (an error if unavailable).
    IoUring,
    /// The pread thread pool.
    Pread,
}

impl std::str::FromStr for IoChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(IoChoice::Auto),
            "io-uring" | "io_uring" => Ok(IoChoice::IoUring),
            "pread" => Ok(IoChoice::Pread),
            _ => Err(format!("unknown I/O path {s:?}: use auto, io-uring or pread")),
        }
    }
}

/// The I/O path actually in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// io_uring.
    IoUring,
    /// pread thread pool.
    Pread,
}

impl IoMode {
    /// Name for logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            IoMode::IoUring => "io-uring",
            IoMode::Pread => "pread",
        }
    }
}

/// A fault to inject into reads, for tests of the error paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The read returns half the bytes.
    ShortRead,
    /// The read fails with EIO.
    Eio,
}

/// Injects `kind` into the next `count` reads of `key`.
#[derive(Debug)]
pub struct FaultInjector {
    key: ExpertKey,
    kind: FaultKind,
    remaining: AtomicU32,
}

impl FaultInjector {
    /// Fails the next `count` reads of `key` with `kind`.
    pub fn new(key: ExpertKey, kind: FaultKind, count: u32) -> Self {
        FaultInjector { key, kind, remaining: AtomicU32::new(count) }
    }

    fn take(&self, key: ExpertKey) -> Option<FaultKind> {
        if key != self.key {
            return None;
        }
        self.remaining.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| r.checked_sub(1)).ok()?;
        Some(self.kind)
    }
}

/// Streamer settings.
#[derive(Clone, Debug)]
pub struct StreamerOptions {
    /// I/O path.
    pub io: IoChoice,
    /// Reads in flight at once (io_uring) or reader threads (pread).
    pub queue_depth: usize,
    /// Optional injected faults (tests).
    pub fault: Option<Arc<FaultInjector>>,
}

impl Default for StreamerOptions {
    fn default() -> Self {
        StreamerOptions { io: IoChoice::Auto, queue_depth: 8, fault: None }
    }
}

/// The vault's layer files, opened once (with O_DIRECT where the filesystem allows).
pub(crate) struct BlobFiles {
    vault: Arc<Vault>,
    files: Vec<Option<File>>,
}

impl BlobFiles {
    fn open(vault: Arc<Vault>) -> Result<BlobFiles, VaultError> {
        let mut files: Vec<Option<File>> =
            (0..vault.manifest().model.num_hidden_layers).map(|_| None).collect();
        let mut warned = false;
        for l in &vault.manifest().experts.layers {
            let (file, direct) = open_direct(vault.dir(), &l.file)?;
            if !direct && !warned {
                tracing::warn!(
                    "{}: O_DIRECT not supported by this filesystem; using buffered reads",
                    vault.dir().join(&l.file).display()
                );
                warned = true;
            }
            files[l.layer] = Some(file);
        }
        Ok(BlobFiles { vault, files })
    }

    /// The file and location of `key`'s blob.
    fn locate(&self, key: ExpertKey) -> Result<(&File, BlobLocation), VaultError> {
        let loc = self.vault.blob(key)?;
        let file = self.files[key.layer as usize]
            .as_ref()
            .ok_or(VaultError::NoSuchExpert { layer: key.layer, expert: key.expert })?;
        Ok((file, loc))
    }
}

/// Turns a finished read (bytes obtained, or the error) into the request's result:
/// injected faults, short reads and checksum mismatches become errors naming the blob.
pub(crate) fn finish_read(
    key: ExpertKey,
    loc: &BlobLocation,
    got: std::io::Result<u64>,
    slot: &[u8],
    fault: Option<&FaultInjector>,
) -> Result<(), VaultError> {
    let got = match fault.and_then(|f| f.take(key)) {
        Some(FaultKind::Eio) => Err(std::io::Error::from_raw_os_error(libc::EIO)),
        Some(FaultKind::ShortRead) => got.map(|n| n.min(loc.len / 2)),
        None => got,
    };
    let got = got.map_err(|e| VaultError::Io { file: loc.file.clone(), offset: loc.offset, source: e })?;
    verify_blob(key, loc, got, slot)
}

/// Why the streamer could not start.
#[derive(Debug, thiserror::Error)]
pub enum StreamerError {
    /// io_uring was forced but cannot be used here.
    #[error("io_uring is not available ({0}); set io = \"pread\" (or --io pread)")]
    NoIoUring(std::io::Error),
    /// A layer file could not be opened.
    #[error(transparent)]
    Vault(#[from] VaultError),
    /// An I/O thread could not be started (too many threads for this system).
    #[error("cannot start a streamer thread ({0}); lower queue_depth (--queue-depth)")]
    Thread(std::io::Error),
}

/// A running streamer.
pub struct Streamer {
    queue: Arc<IoQueue>,
    threads: Vec<JoinHandle<()>>,
    mode: IoMode,
}

impl Streamer {
    /// Opens the vault's layer files and starts the I/O threads.
    pub fn start(
        vault: Arc<Vault>,
        sink: Arc<dyn LoadSink>,
        opts: &StreamerOptions,
    ) -> Result<Streamer, StreamerError> {
        let files = Arc::new(BlobFiles::open(vault)?);
        let queue = Arc::new(IoQueue::default());
        let depth = opts.queue_depth.max(1);
        let uring = match opts.io {
            IoChoice::Pread => None,
            IoChoice::IoUring => {
                Some(uring::UringWorker::new(depth, sink.as_ref()).map_err(StreamerError::NoIoUring)?)
            }
            IoChoice::Auto => match uring::UringWorker::new(depth, sink.as_ref()) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!("io_uring unavailable ({e}); falling back to the pread thread pool");
                    None
                }
            },
        };
        let mode = if uring.is_some() { IoMode::IoUring } else { IoMode::Pread };
        // Threads join the streamer as they start, so a failed start stops those
        // already running (through `Drop`).
        let mut streamer = Streamer { queue: queue.clone(), threads: Vec::new(), mode };
        match uring {
            Some(worker) => {
                let (q, f, s, fault) = (queue, files, sink, opts.fault.clone());
                streamer
                    .threads
                    .push(spawn("smoe-uring", move || worker.run(&q, &f, s.as_ref(), fault.as_deref()))?);
            }
            None => {
                for i in 0..depth {
                    let (q, f, s, fault) = (queue.clone(), files.clone(), sink.clone(), opts.fault.clone());
                    streamer.threads.push(spawn(&format!("smoe-pread-{i}"), move || {
                        pread::run(&q, &f, s.as_ref(), fault.as_deref())
                    })?);
                }
            }
        }
        Ok(streamer)
    }

    /// Queues a read.
    pub fn submit(&self, req: ReadRequest) {
        self.queue.push(req);
    }

    /// Promotes a queued speculative read into `slot` to demand.
    pub fn promote(&self, slot: u32) {
        self.queue.promote(slot);
    }

    /// Drops the queued speculative read into `slot`; false when it has started (or
    /// there is none).
    pub fn cancel(&self, slot: u32) -> bool {
        self.queue.cancel(slot)
    }

    /// Time during which at least one read was in flight, since start.
    pub fn busy_time(&self) -> std::time::Duration {
        self.queue.busy_time()
    }

    /// The I/O path in use.
    pub fn mode(&self) -> IoMode {
        self.mode
    }

    /// Lengths of the demand and speculative queues.
    pub fn queue_depths(&self) -> (usize, usize) {
        self.queue.depths()
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, StreamerError> {
    std::thread::Builder::new().name(name.to_string()).spawn(f).map_err(StreamerError::Thread)
}

impl Drop for Streamer {
    fn drop(&mut self) {
        self.queue.shutdown();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
