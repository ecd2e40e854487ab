//! Slot memory: allocations holding the ring's slots (one per size class, or several
//! where the backend caps one allocation), supplied by the compute backend so that slots
//! live where the backend can read them without a copy (plain aligned memory for the CPU
//! backend; host-visible buffers for a GPU backend).

/// Alignment of every slot (O_DIRECT needs at least the logical block size).
pub const SLOT_ALIGN: usize = smoe_proto::BLOB_ALIGN as usize;

/// A contiguous block of `n_slots × slot_bytes` bytes, each slot [`SLOT_ALIGN`]-aligned.
///
/// # Safety
/// `base()` must stay valid and fixed for the arena's lifetime, and the block must be
/// at least `n_slots() * slot_bytes()` bytes.
pub unsafe trait SlotArena: Send + Sync {
    /// Start of slot 0.
    fn base(&self) -> *mut u8;
    /// Size of one slot (a multiple of [`SLOT_ALIGN`]).
    fn slot_bytes(&self) -> usize;
    /// Number of slots.
    fn n_slots(&self) -> usize;
}

/// Makes slot arenas; each backend supplies its own.
pub trait SlotAllocator: Send + Sync {
    /// Allocates `n_slots` slots of `slot_bytes` bytes each.
    fn allocate(&self, n_slots: usize, slot_bytes: usize) -> std::io::Result<Box<dyn SlotArena>>;

    /// The most slot bytes one arena may hold (a device's largest single allocation), or
    /// `None` for no limit: the ring splits a larger size class over several arenas.
    fn max_arena_bytes(&self) -> Option<usize> {
        None
    }
}

/// Plain host memory for the CPU backend: an anonymous mapping, so pages are zeroed
/// lazily by the kernel on each slot's first read instead of being written at start-up.
/// Huge pages are used where the host has them: reserved huge pages (`MAP_HUGETLB`) when
/// enough are free, else transparent huge pages are asked for (`MADV_HUGEPAGE`), so a
/// slot's first read faults in 2 MiB at a time and expert reads miss the TLB less.
pub struct HostAllocator;

/// Size of a huge page on the hosts we run on (x86-64 and aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

struct HostArena {
    map: *mut u8,
    map_len: usize,
    ptr: *mut u8,
    slot_bytes: usize,
    n_slots: usize,
}

// SAFETY: the arena is a plain heap block; slot access is coordinated by the ring's
// reference counts and states.
unsafe impl Send for HostArena {}
unsafe impl Sync for HostArena {}

// SAFETY: `ptr` lies in a live mapping with at least `n_slots * slot_bytes` bytes after
// it, until drop.
unsafe impl SlotArena for HostArena {
    fn base(&self) -> *mut u8 {
        self.ptr
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn n_slots(&self) -> usize {
        self.n_slots
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        // SAFETY: mapped in `HostAllocator::allocate` with this length.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

impl SlotAllocator for HostAllocator {
    fn allocate(&self, n_slots: usize, slot_bytes: usize) -> std::io::Result<Box<dyn SlotArena>> {
        let oom = || std::io::Error::new(std::io::ErrorKind::OutOfMemory, "cannot allocate the ring's slots");
        let size = n_slots.checked_mul(slot_bytes).filter(|&s| s > 0).ok_or_else(oom)?;
        let huge_len = size.checked_next_multiple_of(HUGE_PAGE).ok_or_else(oom)?;
        let (map, map_len) = match anonymous_map(huge_len, libc::MAP_HUGETLB) {
            Ok(map) => {
                tracing::info!("ring slots in reserved huge pages ({huge_len} bytes)");
                (map, huge_len)
            }
            Err(_) => {
                let map_len = size.checked_add(SLOT_ALIGN).ok_or_else(oom)?;
                let map = anonymous_map(map_len, 0)?;
                // SAFETY: advice on a mapping made just above; failure only means no
                // transparent huge pages.
                if unsafe { libc::madvise(map.cast(), map_len, libc::MADV_HUGEPAGE) } != 0 {
                    tracing::debug!("no transparent huge pages for the ring slots");
                }
                (map, map_len)
            }
        };
        let ptr = map.wrapping_add(map.align_offset(SLOT_ALIGN));
        Ok(Box::new(HostArena { map, map_len, ptr, slot_bytes, n_slots }))
    }
}

/// A fresh private anonymous read-write mapping of `len` bytes with extra `flags`.
fn anonymous_map(len: usize, flags: libc::c_int) -> std::io::Result<*mut u8> {
    // SAFETY: a new mapping at an address the kernel picks; checked for failure below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(map.cast())
}

/// Bytes of `len` bytes from `base` that are resident in memory (`mincore`), rounded to
/// whole pages; 0 when the kernel cannot tell.
pub fn resident_bytes(base: *const u8, len: usize) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let start = base as usize & !(page - 1);
    let span = (base as usize + len).next_multiple_of(page) - start;
    let mut vec = vec![0u8; span / page];
    // SAFETY: `vec` has one byte per page of the span; mincore only reads the page tables.
    if unsafe { libc::mincore(start as *mut libc::c_void, span, vec.as_mut_ptr()) } != 0 {
        return 0;
    }
    vec.iter().filter(|&&b| b & 1 != 0).count() as u64 * page as u64
}
