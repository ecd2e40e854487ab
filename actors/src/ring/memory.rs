//! Slot memory: one allocation holding every ring slot, supplied by the compute
//! backend so that slots live where the backend can read them without a copy (plain
//! aligned memory for the CPU backend; host-visible buffers for a GPU backend).

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
}

/// Plain host memory for the CPU backend: an anonymous mapping, so pages are zeroed
/// lazily by the kernel instead of being written at start-up.
pub struct HostAllocator;

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
        let map_len = size.checked_add(SLOT_ALIGN).ok_or_else(oom)?;
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let map = map.cast::<u8>();
        let ptr = map.wrapping_add(map.align_offset(SLOT_ALIGN));
        Ok(Box::new(HostArena { map, map_len, ptr, slot_bytes, n_slots }))
    }
}
