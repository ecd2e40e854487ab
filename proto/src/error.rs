//! Errors raised while reading a vault: every variant names the file (and where it
//! applies the layer, expert and byte offset) so the user knows what to fix.

use std::path::PathBuf;

/// A vault could not be read, or what was read is not what the manifest promises.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    /// An operating-system I/O error on a vault file.
    #[error("I/O error on {file} at offset {offset}: {source}")]
    Io {
        /// File being read.
        file: PathBuf,
        /// Byte offset of the failed read.
        offset: u64,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An expert blob's checksum does not match the manifest.
    #[error(
        "checksum mismatch for layer {layer} expert {expert} in {file} at offset {offset} \
         (expected crc32c {expected:#010x}, found {found:#010x}); the vault is corrupt — \
         re-run `smoe-pipeline convert`"
    )]
    BlobChecksum {
        /// Decoder layer of the blob.
        layer: u16,
        /// Expert index of the blob.
        expert: u16,
        /// Blob file.
        file: PathBuf,
        /// Offset of the blob in the file.
        offset: u64,
        /// Checksum recorded in the manifest.
        expected: u32,
        /// Checksum of the bytes read.
        found: u32,
    },
    /// A read returned fewer bytes than the blob holds (truncated file or short read).
    #[error(
        "short read for layer {layer} expert {expert} in {file} at offset {offset}: \
         wanted {wanted} bytes, got {got}; the file is truncated — re-run `smoe-pipeline convert`"
    )]
    ShortRead {
        /// Decoder layer of the blob.
        layer: u16,
        /// Expert index of the blob.
        expert: u16,
        /// Blob file.
        file: PathBuf,
        /// Offset of the blob in the file.
        offset: u64,
        /// Bytes requested.
        wanted: u64,
        /// Bytes obtained.
        got: u64,
    },
    /// A resident tensor's checksum does not match the manifest.
    #[error("checksum mismatch for resident tensor `{name}` in {file} at offset {offset}; the vault is corrupt — re-run `smoe-pipeline convert`")]
    TensorChecksum {
        /// Tensor name.
        name: String,
        /// Resident file.
        file: PathBuf,
        /// Offset of the tensor in the file.
        offset: u64,
    },
    /// The manifest was written by an incompatible version of the format.
    #[error("{file}: vault format version {found} is not supported (this build reads version {expected}); re-run `smoe-pipeline convert` with this build")]
    Version {
        /// Manifest file.
        file: PathBuf,
        /// Version found.
        found: u32,
        /// Version this build reads.
        expected: u32,
    },
    /// The manifest is unreadable or disagrees with the files next to it.
    #[error("{file}: {reason}")]
    Manifest {
        /// File the problem was found in.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A decoder layer without routed experts was asked for its expert layout.
    #[error("decoder layer {layer} has no routed experts in this vault")]
    NotMoeLayer {
        /// The layer asked for.
        layer: usize,
    },
    /// The requested expert does not exist in this vault.
    #[error("layer {layer} expert {expert} is not in the vault")]
    NoSuchExpert {
        /// Requested layer.
        layer: u16,
        /// Requested expert.
        expert: u16,
    },
}
