//! Opening the files a manifest names, without trusting it: a name must be a relative
//! path that stays inside the vault directory (symbolic links included), and the file
//! must be a regular file. A FIFO or a device is refused without blocking (it is opened
//! with `O_NONBLOCK` and checked with `fstat` before anything is read from it).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use smoe_proto::{VaultError, MANIFEST_FILE};

/// Largest metadata file read whole (`manifest.json`, `tokenizer_config.json`; a
/// 235B-parameter vault's manifest is about 1 MB).
pub const MAX_METADATA_BYTES: u64 = 64 << 20;

/// The path of `name` inside the vault `dir`, once it is known to stay inside it.
pub fn member_path(dir: &Path, name: &str) -> Result<PathBuf, VaultError> {
    let outside = |why: &str| {
        VaultError::Manifest {
        file: dir.join(MANIFEST_FILE),
        reason: format!(
            "names the file {name:?}, {why}; the manifest is corrupt or was not written by `smoe-pipeline convert`"
        ),
    }
    };
    let rel = Path::new(name);
    if name.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(outside("which is not a plain relative path inside the vault directory"));
    }
    let path = dir.join(rel);
    let io =
        |e: std::io::Error| VaultError::Manifest { file: path.clone(), reason: format!("cannot open: {e}") };
    let real = std::fs::canonicalize(&path).map_err(io)?;
    let root = std::fs::canonicalize(dir).map_err(io)?;
    if !real.starts_with(&root) {
        return Err(outside(&format!("which leads outside the vault directory (to {})", real.display())));
    }
    Ok(path)
}

/// Opens the vault member `name` for reading with extra `open(2)` flags (`O_DIRECT`),
/// refusing anything but a regular file inside the vault.
pub fn open_member(dir: &Path, name: &str, flags: i32) -> Result<File, VaultError> {
    let path = member_path(dir, name)?;
    let io = |e: std::io::Error| VaultError::Io { file: path.clone(), offset: 0, source: e };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(io)?;
    let kind = file.metadata().map_err(io)?.file_type();
    if !kind.is_file() {
        let what = match () {
            _ if kind.is_fifo() => "a FIFO",
            _ if kind.is_char_device() || kind.is_block_device() => "a device",
            _ if kind.is_socket() => "a socket",
            _ if kind.is_dir() => "a directory",
            _ => "not a regular file",
        };
        return Err(VaultError::Manifest {
            file: path.clone(),
            reason: format!("is {what}; a vault holds only regular files"),
        });
    }
    // Reads must block as usual (io_uring answers EAGAIN on O_NONBLOCK files).
    // SAFETY: fcntl on a descriptor this function owns.
    let fl = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if fl < 0 || unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
        return Err(io(std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// Reads the small vault member `name` whole, refusing one longer than `limit` bytes.
pub fn read_member(dir: &Path, name: &str, limit: u64) -> Result<Vec<u8>, VaultError> {
    let file = open_member(dir, name, 0)?;
    let path = dir.join(name);
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| VaultError::Io {
        file: path.clone(),
        offset: 0,
        source: e,
    })?;
    if bytes.len() as u64 > limit {
        return Err(VaultError::Manifest { file: path, reason: format!("is larger than {limit} bytes") });
    }
    Ok(bytes)
}

/// Opens the layer file `name` for direct reads (`O_DIRECT`), or buffered where the
/// filesystem refuses `O_DIRECT`; the flag says which.
pub fn open_direct(dir: &Path, name: &str) -> Result<(File, bool), VaultError> {
    match open_member(dir, name, libc::O_DIRECT) {
        Ok(f) => Ok((f, true)),
        Err(VaultError::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            Ok((open_member(dir, name, 0)?, false))
        }
        Err(e) => Err(e),
    }
}
