//! Writing a directory all at once: its contents go into a staging directory beside the
//! target (`.NAME.partial-PID`, same filesystem), which replaces the target only when
//! complete and synced (`renameat2(RENAME_EXCHANGE)` where the filesystem has it, else
//! two renames). A run that fails removes its staging directory; one that was killed
//! leaves it behind, and the next run for the same target removes it.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

/// A staging directory that becomes `target` on [`Staging::commit`], and is removed if
/// dropped before.
pub struct Staging {
    target: PathBuf,
    path: PathBuf,
    committed: bool,
}

/// Staging directory names for a target named `name` start with this; the writer's
/// process id follows.
fn partial_prefix(name: &str) -> String {
    format!(".{name}.partial-")
}

impl Staging {
    /// Creates a fresh staging directory for `target` (creating `target`'s parent if
    /// needed), after removing those of earlier runs that are no longer running.
    pub fn begin(target: &Path) -> Result<Staging> {
        let name = target
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| anyhow!("{} does not name a directory to write", target.display()))?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
        remove_stale(&parent, name);
        let path = parent.join(format!("{}{}", partial_prefix(name), std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Staging { target: target.to_path_buf(), path, committed: false })
    }

    /// Where to write the contents.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Syncs the staging directory and puts it in the target's place (replacing what
    /// was there, which the caller has vetted).
    pub fn commit(mut self) -> Result<()> {
        sync_tree(&self.path)?;
        if self.target.exists() {
            let old = exchange(&self.path, &self.target)?;
            std::fs::remove_dir_all(&old)
                .with_context(|| format!("cannot remove the replaced {}", old.display()))?;
        } else {
            std::fs::rename(&self.path, &self.target).with_context(|| {
                format!("cannot move {} to {}", self.path.display(), self.target.display())
            })?;
        }
        self.committed = true;
        if let Some(parent) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync(parent)?;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Swaps `staging` into `target`; returns where the old target now is.
fn exchange(staging: &Path, target: &Path) -> Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| anyhow!("{p:?} has a NUL byte"))
    };
    let (a, b) = (c(staging)?, c(target)?);
    // SAFETY: two valid NUL-terminated paths, relative to the working directory.
    let r = unsafe {
        libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE)
    };
    if r == 0 {
        return Ok(staging.to_path_buf());
    }
    let err = std::io::Error::last_os_error();
    if !matches!(err.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::ENOTSUP)) {
        bail!("cannot swap {} into {}: {err}", staging.display(), target.display());
    }
    // No atomic exchange here: move the old target aside, then the new one in.
    let aside = PathBuf::from(format!("{}.replaced", staging.display()));
    std::fs::rename(target, &aside).with_context(|| format!("cannot move {} aside", target.display()))?;
    std::fs::rename(staging, target)
        .with_context(|| format!("cannot move {} to {}", staging.display(), target.display()))?;
    Ok(aside)
}

/// Removes staging directories for `name` in `parent` whose process is gone.
fn remove_stale(parent: &Path, name: &str) {
    let prefix = partial_prefix(name);
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(pid) = file
            .to_str()
            .and_then(|f| f.strip_prefix(prefix.as_str()))
            .and_then(|p| p.trim_end_matches(".replaced").parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!("removing {} left by an interrupted run", e.path().display());
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// `fsync` of every file and directory under `dir`, and of `dir`.
fn sync_tree(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            sync_tree(&p)?;
        } else {
            sync(&p)?;
        }
    }
    sync(dir)
}

/// `fsync` of one file or directory.
fn sync(p: &Path) -> Result<()> {
    File::open(p).and_then(|f| f.sync_all()).with_context(|| format!("cannot sync {}", p.display()))
}
