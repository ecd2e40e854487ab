//! Ring slot memory for the Vulkan backend: each arena is one host-visible, coherent
//! (host-cached where the device offers it) buffer that the streamer reads expert blobs
//! into directly and that kernels bind in place, so a claimed expert reaches the GPU
//! without a CPU copy.

use std::sync::{Arc, Mutex};

use vulkano::buffer::{Buffer, BufferCreateInfo, BufferUsage, Subbuffer};
use vulkano::memory::allocator::{AllocationCreateInfo, MemoryAllocatePreference, MemoryTypeFilter};
use vulkano::memory::MemoryPropertyFlags;
use vulkano::sync::Sharing;

use super::context::VulkanContext;
use crate::ring::memory::{SlotAllocator, SlotArena, SLOT_ALIGN};

struct ArenaEntry {
    id: u64,
    base: usize,
    len: usize,
    buffer: Subbuffer<[u8]>,
}

/// The arenas an allocator has handed out, so the executor can find the buffer (and
/// offset) behind a blob's bytes.
#[derive(Clone, Default)]
pub struct ArenaRegistry {
    inner: Arc<Mutex<(u64, Vec<ArenaEntry>)>>,
}

impl ArenaRegistry {
    /// The buffer range holding `bytes`, when they lie inside an arena of this registry.
    pub fn locate(&self, bytes: &[u8]) -> Option<Subbuffer<[u8]>> {
        let p = bytes.as_ptr() as usize;
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.1.iter().find(|a| p >= a.base && p + bytes.len() <= a.base + a.len).map(|a| {
            let off = a.buffer.offset() + (p - a.base) as u64;
            let whole = Subbuffer::from(a.buffer.buffer().clone());
            whole.slice(off..off + bytes.len().max(4) as u64)
        })
    }

    fn add(&self, base: usize, len: usize, buffer: Subbuffer<[u8]>) -> u64 {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        let id = g.0;
        g.1.push(ArenaEntry { id, base, len, buffer });
        id
    }

    fn remove(&self, id: u64) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).1.retain(|a| a.id != id);
    }
}

/// [`SlotAllocator`] handing out host-visible Vulkan buffers.
pub struct VulkanAllocator {
    ctx: Arc<VulkanContext>,
    registry: ArenaRegistry,
}

impl VulkanAllocator {
    /// An allocator on `ctx`'s device.
    pub fn new(ctx: Arc<VulkanContext>) -> Self {
        VulkanAllocator { ctx, registry: ArenaRegistry::default() }
    }

    /// The registry of the arenas this allocator made.
    pub fn registry(&self) -> ArenaRegistry {
        self.registry.clone()
    }
}

struct VulkanArena {
    base: *mut u8,
    slot_bytes: usize,
    n_slots: usize,
    id: u64,
    registry: ArenaRegistry,
    // Keeps the memory (and its mapping) alive.
    _buffer: Subbuffer<[u8]>,
}

// SAFETY: the mapping is plain shared memory; slot access is coordinated by the ring.
unsafe impl Send for VulkanArena {}
unsafe impl Sync for VulkanArena {}

// SAFETY: `base` points into a live mapping of at least `n_slots * slot_bytes` bytes
// that stays mapped until the buffer (held here) is dropped.
unsafe impl SlotArena for VulkanArena {
    fn base(&self) -> *mut u8 {
        self.base
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn n_slots(&self) -> usize {
        self.n_slots
    }
}

impl Drop for VulkanArena {
    fn drop(&mut self) {
        self.registry.remove(self.id);
    }
}

impl SlotAllocator for VulkanAllocator {
    fn allocate(&self, n_slots: usize, slot_bytes: usize) -> std::io::Result<Box<dyn SlotArena>> {
        let err = |m: String| std::io::Error::new(std::io::ErrorKind::OutOfMemory, m);
        let size = n_slots
            .checked_mul(slot_bytes)
            .filter(|&s| s > 0)
            .ok_or_else(|| err("ring of zero bytes".into()))?;
        if let Some(max) = self.ctx.info.max_allocation.filter(|&m| (size + SLOT_ALIGN) as u64 > m) {
            return Err(err(format!(
                "the device allocates at most {max} bytes at once but the ring needs {size}"
            )));
        }
        let fam = self.ctx.families();
        let sharing =
            if fam.len() > 1 { Sharing::Concurrent(fam.into_iter().collect()) } else { Sharing::Exclusive };
        let buffer = Buffer::new_slice::<u8>(
            self.ctx.memory.clone(),
            BufferCreateInfo {
                usage: BufferUsage::STORAGE_BUFFER | BufferUsage::TRANSFER_SRC,
                sharing,
                ..Default::default()
            },
            AllocationCreateInfo {
                memory_type_filter: MemoryTypeFilter {
                    required_flags: MemoryPropertyFlags::HOST_VISIBLE | MemoryPropertyFlags::HOST_COHERENT,
                    preferred_flags: MemoryPropertyFlags::HOST_CACHED,
                    not_preferred_flags: MemoryPropertyFlags::empty(),
                },
                allocate_preference: MemoryAllocatePreference::AlwaysAllocate,
                ..Default::default()
            },
            (size + SLOT_ALIGN) as u64,
        )
        .map_err(|e| err(format!("Vulkan host-visible buffer of {size} bytes: {e}")))?;
        let ptr = buffer.mapped_slice().map_err(|e| err(format!("mapping the ring buffer: {e}")))?;
        let start = ptr.as_ptr() as *mut u8 as usize;
        let pad = start.next_multiple_of(SLOT_ALIGN) - start;
        let base = (start + pad) as *mut u8;
        let arena_buf = buffer.clone().slice(pad as u64..(pad + size) as u64);
        let id = self.registry.add(base as usize, size, arena_buf);
        Ok(Box::new(VulkanArena {
            base,
            slot_bytes,
            n_slots,
            id,
            registry: self.registry.clone(),
            _buffer: buffer,
        }))
    }

    /// The device's largest single allocation, less the alignment padding each arena
    /// takes (a larger ring size class is split over several arenas).
    fn max_arena_bytes(&self) -> Option<usize> {
        self.ctx.info.max_allocation.map(|m| (m as usize).saturating_sub(SLOT_ALIGN))
    }
}
