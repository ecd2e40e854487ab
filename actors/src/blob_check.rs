//! Checks applied to every blob read: the length obtained and the checksum, with
//! errors naming the layer, expert, file and offset.

use std::fs::File;
use std::os::unix::fs::FileExt;

use smoe_proto::{ExpertKey, VaultError};

use crate::vault::BlobLocation;

/// Verifies a freshly read blob's length and checksum, naming the blob on failure.
pub fn verify_blob(key: ExpertKey, loc: &BlobLocation, got: u64, payload: &[u8]) -> Result<(), VaultError> {
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
