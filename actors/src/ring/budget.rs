//! Sizing the default ring from the memory at hand: what the system can still give
//! (`MemAvailable`, or less where a cgroup v1/v2 limit or an address-space limit says
//! so), minus the resident tensors (mapped, and touched by every token), the KV caches
//! of the sessions kept, and a margin for everything else (activations, the runtime,
//! the page cache the mapping needs) — so that the ring's slots, which fill up as
//! experts are read, never push the process into swapping or the OOM killer. The
//! arithmetic is logged (and shown when it does not leave room for a single slot).

use std::fmt;
use std::path::Path;

use smoe_proto::{Manifest, ModelConfig};

/// Smallest margin kept free, in bytes.
const MIN_MARGIN: u64 = 512 << 20;
/// Share of the available memory kept free (1 / this).
const MARGIN_SHARE: u64 = 10;

/// Memory the process may still take, and who says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure comes from (`MemAvailable`, `cgroup v2 memory.max`, ...).
    pub source: String,
}

/// Reads what is available under `root` (`/` on a live system; a directory with the
/// same layout in tests): the least of `MemAvailable` (`proc/meminfo`), the headroom
/// under the process's cgroup memory limit (v2 `memory.max` − `memory.current`, v1
/// `memory.limit_in_bytes` − `memory.usage_in_bytes`, both less reclaimable inactive
/// file pages), and the address space left under `RLIMIT_AS`. `None` when none is
/// readable.
pub fn available(root: &Path) -> Option<Available> {
    let mut candidates = Vec::new();
    let meminfo = std::fs::read_to_string(root.join("proc/meminfo")).unwrap_or_default();
    if let Some(kb) = meminfo_kb(&meminfo, "MemAvailable:") {
        candidates.push(Available { bytes: kb * 1024, source: "MemAvailable".into() });
    }
    candidates.extend(cgroup_headroom(root));
    // The address-space limit is the live process's own.
    if root == Path::new("/") {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        candidates.extend(address_space_left(meminfo_kb(&status, "VmSize:")));
    }
    candidates.into_iter().min_by_key(|a| a.bytes)
}

/// The value of `key` (in kB) in a `/proc/meminfo`-style text.
fn meminfo_kb(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// A number in a cgroup file (`None` for `max` or unreadable).
fn cgroup_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The value of `key` in a cgroup `memory.stat`.
fn stat_value(dir: &Path, key: &str) -> u64 {
    let text = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0)
}

/// Headroom under the cgroup memory limits of the process (v2 or v1): the least over
/// its group and the groups above it, since each level's limit applies.
fn cgroup_headroom(root: &Path) -> Option<Available> {
    let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mut best: Option<Available> = None;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (version, base, limit, usage, inactive) = if controllers.is_empty() {
            (2, root.join("sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                1,
                root.join("sys/fs/cgroup/memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        } else {
            continue;
        };
        // Inside a cgroup namespace the listed path may not exist under the mount: then
        // the mount's root is the group.
        let mut dir = base.join(path.trim_start_matches('/'));
        if !dir.is_dir() {
            dir = base.clone();
        }
        loop {
            if let (Some(lim), Some(used)) =
                (cgroup_number(&dir.join(limit)), cgroup_number(&dir.join(usage)))
            {
                // v1 says "no limit" with a huge number (v2 with `max`).
                if lim < 1 << 60 {
                    let working = used.saturating_sub(stat_value(&dir, inactive));
                    let left = Available {
                        bytes: lim.saturating_sub(working),
                        source: format!("cgroup v{version} {limit} {lim} − {working} in use"),
                    };
                    if best.as_ref().is_none_or(|b| left.bytes < b.bytes) {
                        best = Some(left);
                    }
                }
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    best
}

/// Address space left under `RLIMIT_AS`, given the process's current size in kB.
fn address_space_left(vm_size_kb: Option<u64>) -> Option<Available> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let used = vm_size_kb.unwrap_or(0) * 1024;
    Some(Available {
        bytes: lim.rlim_cur.saturating_sub(used),
        source: format!("RLIMIT_AS {}", lim.rlim_cur),
    })
}

/// What one session's cache holds, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionBytes {
    /// f32 keys and values of every attention layer at `max_context` positions.
    pub kv: u64,
    /// f32 conv and recurrent states of every DeltaNet layer.
    pub states: u64,
    /// Up to `state_snapshots` copies of the states, for prefix reuse.
    pub snapshots: u64,
}

impl SessionBytes {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.kv + self.states + self.snapshots
    }
}

/// What one session's cache holds at `max_context` positions (the context is capped at
/// the model's trained context, as the model does) with `state_snapshots` snapshots of
/// its DeltaNet states.
pub fn session_bytes(cfg: &ModelConfig, max_context: usize, state_snapshots: usize) -> SessionBytes {
    let ctx = max_context.clamp(1, cfg.max_position_embeddings.max(1)) as u64;
    let f32_bytes = std::mem::size_of::<f32>() as u64;
    let attention = cfg.attention_layers().len() as u64;
    let states = cfg.hybrid.as_ref().map_or(0, |h| {
        let linear = cfg.num_hidden_layers as u64 - attention;
        linear * (h.conv_state_len() + h.recurrent_state_len()) as u64 * f32_bytes
    });
    SessionBytes {
        kv: ctx * cfg.kv_dim() as u64 * attention * 2 * f32_bytes,
        states,
        snapshots: states * state_snapshots as u64,
    }
}

/// Bytes of one session's cache ([`session_bytes`] in all).
pub fn kv_cache_bytes(cfg: &ModelConfig, max_context: usize, state_snapshots: usize) -> u64 {
    session_bytes(cfg, max_context, state_snapshots).total()
}

/// What the ring has to share memory with, and what a slot takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingNeeds {
    /// Resident tensor bytes.
    pub resident: u64,
    /// KV cache bytes of every session kept.
    pub kv: u64,
    /// Bytes of one slot (the blob stride).
    pub slot_bytes: u64,
    /// Slots that hold every expert of the vault.
    pub all_slots: usize,
}

impl RingNeeds {
    /// The needs of `manifest`'s model with `sessions` KV caches of `max_context`
    /// positions and `state_snapshots` state snapshots each.
    pub fn of(manifest: &Manifest, max_context: usize, state_snapshots: usize, sessions: usize) -> RingNeeds {
        RingNeeds {
            resident: manifest.resident.file_len,
            kv: kv_cache_bytes(&manifest.model, max_context, state_snapshots) * sessions as u64,
            slot_bytes: manifest.experts.max_blob_stride().max(1),
            all_slots: manifest.experts.layers.len() * manifest.model.num_experts,
        }
    }
}

/// The default ring, with the arithmetic that chose it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingBudget {
    /// Memory available, and its source.
    pub available: Available,
    /// What else takes memory, and the slot size.
    pub needs: RingNeeds,
    /// Bytes kept free for everything else.
    pub margin: u64,
    /// Slots chosen (0: not even one fits).
    pub slots: usize,
}

impl RingBudget {
    /// The ring that fits in `available` beside `needs` and the margin, holding at most
    /// every expert and at most `cap` bytes (if any).
    pub fn plan(needs: RingNeeds, available: Available, cap: Option<u64>) -> RingBudget {
        let margin = (available.bytes / MARGIN_SHARE).max(MIN_MARGIN);
        let left = available.bytes.saturating_sub(needs.resident + needs.kv + margin);
        let bytes = cap.map_or(left, |c| left.min(c));
        let slots = ((bytes / needs.slot_bytes) as usize).min(needs.all_slots.max(1));
        RingBudget { available, needs, margin, slots }
    }

    /// The ring in bytes.
    pub fn ring_bytes(&self) -> u64 {
        self.slots as u64 * self.needs.slot_bytes
    }
}

/// Bytes in the largest binary unit that keeps a digit before the point.
fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

impl fmt::Display for RingBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} available ({}) − {} resident tensors − {} KV cache − {} margin → {} of {} slots of {} ({})",
            human(self.available.bytes),
            self.available.source,
            human(self.needs.resident),
            human(self.needs.kv),
            human(self.margin),
            self.slots,
            self.needs.all_slots,
            human(self.needs.slot_bytes),
            human(self.ring_bytes()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake root with `files` (path, text).
    fn root(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    const MEMINFO: (&str, &str) = ("proc/meminfo", "MemTotal: 24000000 kB\nMemAvailable:   20000000 kB\n");

    #[test]
    fn the_tightest_limit_wins() {
        let r = root(&[MEMINFO]);
        assert_eq!(
            available(r.path()).unwrap(),
            Available { bytes: 20_000_000 * 1024, source: "MemAvailable".into() }
        );
        // cgroup v2: 8 GiB limit, 3 GiB in use of which 1 GiB is reclaimable file cache.
        let r = root(&[
            MEMINFO,
            ("proc/self/cgroup", "0::/svc\n"),
            ("sys/fs/cgroup/svc/memory.max", "8589934592\n"),
            ("sys/fs/cgroup/svc/memory.current", "3221225472\n"),
            ("sys/fs/cgroup/svc/memory.stat", "anon 2147483648\ninactive_file 1073741824\n"),
        ]);
        let a = available(r.path()).unwrap();
        assert_eq!(a.bytes, 6 << 30);
        assert!(a.source.starts_with("cgroup v2 memory.max"), "{a:?}");
        // A parent's limit applies too (v1, no limit on the group itself).
        let r = root(&[
            MEMINFO,
            ("proc/self/cgroup", "4:memory:/jobs/one\n"),
            ("sys/fs/cgroup/memory/jobs/one/memory.limit_in_bytes", "9223372036854771712\n"),
            ("sys/fs/cgroup/memory/jobs/one/memory.usage_in_bytes", "1000\n"),
            ("sys/fs/cgroup/memory/jobs/memory.limit_in_bytes", "4294967296\n"),
            ("sys/fs/cgroup/memory/jobs/memory.usage_in_bytes", "1073741824\n"),
        ]);
        assert_eq!(available(r.path()).unwrap().bytes, 3 << 30);
        // cgroup v1 in a namespace (the group is the mount root), no limit: MemAvailable.
        let r = root(&[
            MEMINFO,
            ("proc/self/cgroup", "4:memory:/docker/abc\n1:cpu:/\n"),
            ("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("sys/fs/cgroup/memory/memory.usage_in_bytes", "100\n"),
        ]);
        assert_eq!(available(r.path()).unwrap().source, "MemAvailable");
        let r = root(&[
            MEMINFO,
            ("proc/self/cgroup", "4:memory:/docker/abc\n"),
            ("sys/fs/cgroup/memory/memory.limit_in_bytes", "2147483648\n"),
            ("sys/fs/cgroup/memory/memory.usage_in_bytes", "1073741824\n"),
        ]);
        assert_eq!(available(r.path()).unwrap().bytes, 1 << 30);
        assert_eq!(available(root(&[]).path()), None);
    }

    #[test]
    fn the_ring_gets_what_is_left() {
        let avail = |gib: u64| Available { bytes: gib << 30, source: "test".into() };
        let needs = RingNeeds { resident: 2 << 30, kv: 6 << 20, slot_bytes: 64 << 20, all_slots: 1000 };
        // 20 GiB − 2 GiB resident − 6 MiB KV − 2 GiB margin: 255 slots of 64 MiB, or every
        // expert where fewer.
        let b = RingBudget::plan(needs, avail(20), None);
        assert_eq!((b.margin, b.slots), (2 << 30, 255), "{b}");
        assert_eq!(RingBudget::plan(RingNeeds { all_slots: 24, ..needs }, avail(20), None).slots, 24);
        // 5 GiB − 2 GiB − 6 MiB − 512 MiB (the smallest margin) = 2554 MiB: 39 slots.
        assert_eq!(RingBudget::plan(needs, avail(5), None).slots, 39);
        assert_eq!(RingBudget::plan(needs, avail(5), Some(1 << 30)).slots, 16);
        let b = RingBudget::plan(needs, avail(2), None);
        assert_eq!(b.slots, 0);
        let text = b.to_string();
        assert!(
            text.contains("2.00 GiB available (test) − 2.00 GiB resident tensors − 6.0 MiB KV"),
            "{text}"
        );
    }
}
