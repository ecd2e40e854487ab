//! The simplest expert source: every claim reads the blob from its layer file with a
//! positioned read and verifies its checksum. No caching. Used by tools and as the
//! baseline the ring cache is checked against.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use smoe_proto::{ExpertHandle, ExpertKey, ExpertSource, SlotOwner, VaultError};

use crate::vault::{BlobLocation, Vault};

/// Reads every claimed blob from disk (no retention).
pub struct BlobReader {
    vault: Arc<Vault>,
    bytes_read: AtomicU64,
    blob_reads: AtomicU64,
}

/// One blob read into its own buffer; the handle's slot owner.
struct OwnedBlob {
    buf: Vec<u64>,
}

impl SlotOwner for OwnedBlob {
    fn slot_bytes(&self, _slot: u32) -> &[u8] {
        bytemuck::cast_slice(&self.buf)
    }
    fn release(&self, _slot: u32) {}
}

impl BlobReader {
    /// A reader over `vault`'s blob files.
    pub fn new(vault: Arc<Vault>) -> Self {
        BlobReader {
            vault,
            bytes_read: AtomicU64::new(0),
            blob_reads: AtomicU64::new(0),
        }
    }

    /// Bytes read from disk so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Blobs read from disk so far.
    pub fn blob_reads(&self) -> u64 {
        self.blob_reads.load(Ordering::Relaxed)
    }
}

/// Verifies a freshly read blob's length and checksum, naming the blob on failure.
pub fn verify_blob(
    key: ExpertKey,
    loc: &BlobLocation,
    got: u64,
    payload: &[u8],
) -> Result<(), VaultError> {
    if got < loc.len {
        return Err(VaultError::ShortRead {
            layer: key.layer,
            expert: key.expert,
            file: loc.file.clone(),
            offset: loc.offset,
            wanted: loc.len,
            got,
        });
    }
    let found = crc32c::crc32c(&payload[..loc.len as usize]);
    if found != loc.crc32c {
        return Err(VaultError::BlobChecksum {
            layer: key.layer,
            expert: key.expert,
            file: loc.file.clone(),
            offset: loc.offset,
            expected: loc.crc32c,
            found,
        });
    }
    Ok(())
}

/// Reads as much of `buf` as the file holds at `offset`, retrying on interruption;
/// returns the byte count (short only at end of file).
pub fn pread_full(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<u64> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done as u64)
}

impl ExpertSource for BlobReader {
    fn claim(&self, key: ExpertKey) -> Result<ExpertHandle, VaultError> {
        let loc = self.vault.blob(key)?;
        let io = |e| VaultError::Io {
            file: loc.file.clone(),
            offset: loc.offset,
            source: e,
        };
        let file = File::open(&loc.file).map_err(io)?;
        let mut buf = vec![0u64; loc.len.div_ceil(8) as usize];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        let got = pread_full(&file, &mut bytes[..loc.len as usize], loc.offset).map_err(io)?;
        verify_blob(key, &loc, got, bytes)?;
        self.bytes_read.fetch_add(loc.len, Ordering::Relaxed);
        self.blob_reads.fetch_add(1, Ordering::Relaxed);
        Ok(ExpertHandle::new(
            Arc::new(OwnedBlob { buf }),
            0,
            key,
            loc.len as usize,
        ))
    }
}
