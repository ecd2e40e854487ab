//! Checking a vault's bytes against its checksums. Opening a vault checks its structure
//! only (manifest, file sizes, offsets), so start-up never pays for reading everything
//! resident; the resident tensors' checksums are verified by a background thread that
//! `Vault::open` starts ([`ResidentCheck`]), whose verdict the engine's users consult,
//! and `smoe-pipeline check` verifies everything, expert blobs included
//! ([`Vault::verify_experts`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use memmap2::Mmap;
use smoe_proto::{ExpertKey, TensorEntry, VaultError};

use super::{files, Vault};
use crate::blob_check::{pread_full, verify_blob};
use crate::ring::memory::{HostAllocator, SlotAllocator};

/// A resident tensor whose bytes do not match its checksum.
#[derive(Clone, Debug)]
struct TensorFault {
    name: String,
    offset: u64,
}

/// The checksum verification of the resident tensors, running in the background.
pub struct ResidentCheck {
    file: PathBuf,
    total: u64,
    done: AtomicU64,
    faults: Mutex<Option<Vec<TensorFault>>>,
    finished: Condvar,
}

impl ResidentCheck {
    /// Starts checking `tensors` in `map` (the resident file `file`) on a thread of its
    /// own (on the caller's thread if none can be started).
    pub fn start(map: Arc<Mmap>, tensors: Vec<TensorEntry>, file: PathBuf) -> Arc<ResidentCheck> {
        let check = Arc::new(ResidentCheck {
            file,
            total: tensors.iter().map(|t| t.len).sum(),
            done: AtomicU64::new(0),
            faults: Mutex::new(None),
            finished: Condvar::new(),
        });
        let c = check.clone();
        let run = move || c.run(&map, &tensors);
        let thread = std::thread::Builder::new().name("smoe-vault-check".into());
        if let Err(e) = thread.spawn(run.clone()) {
            tracing::warn!("cannot start the background vault check ({e}); checking now");
            run();
        }
        check
    }

    fn run(&self, map: &[u8], tensors: &[TensorEntry]) {
        let start = Instant::now();
        let mut faults = Vec::new();
        for t in tensors {
            let bytes = &map[t.offset as usize..(t.offset + t.len) as usize];
            if crc32c::crc32c(bytes) != t.crc32c {
                tracing::error!("{}", self.error(&TensorFault { name: t.name.clone(), offset: t.offset }));
                faults.push(TensorFault { name: t.name.clone(), offset: t.offset });
            }
            self.done.fetch_add(t.len, Ordering::Relaxed);
        }
        if faults.is_empty() {
            tracing::info!(
                "resident tensors verified: {:.1} MB in {:.2} s",
                self.total as f64 / 1e6,
                start.elapsed().as_secs_f64()
            );
        }
        *self.lock() = Some(faults);
        self.finished.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<TensorFault>>> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn error(&self, f: &TensorFault) -> VaultError {
        VaultError::TensorChecksum { name: f.name.clone(), file: self.file.clone(), offset: f.offset }
    }

    /// Bytes checked so far, and in all.
    pub fn progress(&self) -> (u64, u64) {
        (self.done.load(Ordering::Relaxed), self.total)
    }

    /// `None` while the check runs; then `Ok`, or the first tensor that failed.
    pub fn status(&self) -> Option<Result<(), VaultError>> {
        self.lock().as_ref().map(|faults| faults.first().map_or(Ok(()), |f| Err(self.error(f))))
    }

    /// Waits for the check; every tensor that failed, in file order.
    pub fn faults(&self) -> Vec<VaultError> {
        let mut g = self.lock();
        while g.is_none() {
            g = self.finished.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.iter().flatten().map(|f| self.error(f)).collect()
    }

    /// Waits for the check; `Err` with the first tensor that failed.
    pub fn wait(&self) -> Result<(), VaultError> {
        self.faults().into_iter().next().map_or(Ok(()), Err)
    }
}

impl Vault {
    /// The background verification of the resident tensors.
    pub fn resident_check(&self) -> &Arc<ResidentCheck> {
        &self.resident_check
    }

    /// Bytes of expert blobs (payloads), what [`Vault::verify_experts`] reads.
    pub fn expert_bytes(&self) -> u64 {
        let experts = self.manifest.model.num_experts as u64;
        self.manifest.experts.layers.iter().map(|l| experts * l.layout.blob_len).sum()
    }

    /// Reads every expert blob and checks its length and checksum, reporting each
    /// payload's bytes to `progress` and each bad blob to `fault`. `Err` only when the
    /// check cannot go on (a layer file cannot be opened, the buffer cannot be had).
    pub fn verify_experts(
        &self,
        progress: &mut dyn FnMut(u64),
        fault: &mut dyn FnMut(VaultError),
    ) -> Result<(), VaultError> {
        let stride = self.max_blob_stride() as usize;
        // One slot of aligned memory, as the ring's, so O_DIRECT reads work.
        let arena = HostAllocator.allocate(1, stride).map_err(|e| VaultError::Io {
            file: self.dir.clone(),
            offset: 0,
            source: e,
        })?;
        // SAFETY: the arena holds one slot of `stride` bytes, owned here.
        let buf = unsafe { std::slice::from_raw_parts_mut(arena.base(), stride) };
        for l in &self.manifest.experts.layers {
            let (file, _) = files::open_direct(&self.dir, &l.file)?;
            for e in 0..l.blobs.len() {
                let key = ExpertKey { layer: l.layer as u16, expert: e as u16 };
                let loc = self.blob(key)?;
                let buf = &mut buf[..loc.stride as usize];
                let checked = pread_full(&file, buf, loc.offset)
                    .map_err(|source| VaultError::Io { file: loc.file.clone(), offset: loc.offset, source })
                    .and_then(|got| verify_blob(key, &loc, got, buf));
                if let Err(err) = checked {
                    fault(err);
                }
                progress(loc.len);
            }
        }
        Ok(())
    }
}
