//! Buffers: device-local and host-visible allocations, uploads through a staging
//! buffer, and weight matrices bound in row ranges that respect the device's
//! `maxStorageBufferRange` (lavapipe: 128 MiB) and offset alignment.

use smoe_proto::DType;
use vulkano::buffer::{Buffer, BufferContents, BufferCreateInfo, BufferUsage, Subbuffer};
use vulkano::command_buffer::{AutoCommandBufferBuilder, CommandBufferUsage, CopyBufferInfo};
use vulkano::memory::allocator::{AllocationCreateInfo, MemoryTypeFilter};
use vulkano::sync::{GpuFuture, Sharing};

use super::context::VulkanContext;
use super::VulkanError;
use crate::tensor::WeightView;

/// Maps any displayable Vulkan failure to a [`VulkanError`] naming what was being done.
pub fn verr<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> VulkanError {
    move |e| VulkanError::Vulkan(format!("{what}: {e}"))
}

fn create_info(ctx: &VulkanContext, usage: BufferUsage) -> BufferCreateInfo {
    let fam = ctx.families();
    let sharing =
        if fam.len() > 1 { Sharing::Concurrent(fam.into_iter().collect()) } else { Sharing::Exclusive };
    BufferCreateInfo { usage, sharing, ..Default::default() }
}

/// A buffer of `len` elements (at least one) in memory chosen by `filter`; `what`
/// names it in errors.
fn buffer<T: BufferContents>(
    ctx: &VulkanContext,
    len: u64,
    usage: BufferUsage,
    filter: MemoryTypeFilter,
    what: &'static str,
) -> Result<Subbuffer<[T]>, VulkanError> {
    Buffer::new_slice::<T>(
        ctx.memory.clone(),
        create_info(ctx, usage | BufferUsage::TRANSFER_DST | BufferUsage::TRANSFER_SRC),
        AllocationCreateInfo { memory_type_filter: filter, ..Default::default() },
        len.max(1),
    )
    .map_err(verr(what))
}

/// A device-local buffer of `len` elements (at least one).
pub fn device_buffer<T: BufferContents>(
    ctx: &VulkanContext,
    len: u64,
    usage: BufferUsage,
) -> Result<Subbuffer<[T]>, VulkanError> {
    buffer(ctx, len, usage, MemoryTypeFilter::PREFER_DEVICE, "allocating device memory")
}

/// A host-visible, coherent buffer of `len` elements (at least one) that the host
/// writes and reads through vulkano's checked mappings.
pub fn host_buffer<T: BufferContents>(
    ctx: &VulkanContext,
    len: u64,
    usage: BufferUsage,
) -> Result<Subbuffer<[T]>, VulkanError> {
    let filter = MemoryTypeFilter::PREFER_HOST | MemoryTypeFilter::HOST_RANDOM_ACCESS;
    buffer(ctx, len, usage, filter, "allocating host-visible memory")
}

/// A buffer of `len` elements (at least one) that the host writes and the kernels read
/// every layer (routing data): device-local memory the host can map where the device
/// has it (resizable BAR, unified memory), else host memory. Kernels read host memory
/// across the bus with a round trip per read, which costs far more than the host's
/// writes through a device-local mapping (`vulkan kernels` measures both).
pub fn upload_buffer<T: BufferContents>(
    ctx: &VulkanContext,
    len: u64,
    usage: BufferUsage,
) -> Result<Subbuffer<[T]>, VulkanError> {
    let filter = MemoryTypeFilter::PREFER_DEVICE | MemoryTypeFilter::HOST_SEQUENTIAL_WRITE;
    buffer(ctx, len, usage, filter, "allocating host-writable device memory")
}

/// Copies `bytes` into the start of `dst` through a staging buffer (start-up only: it
/// waits for the copy).
pub fn upload(ctx: &VulkanContext, dst: &Subbuffer<[u8]>, bytes: &[u8]) -> Result<(), VulkanError> {
    upload_with(ctx, dst, bytes.len(), |off, stage| stage.copy_from_slice(&bytes[off..off + stage.len()]))
}

/// [`upload`] of `len` bytes that `fill(offset, part)` writes straight into each staging
/// part (bytes `offset .. offset + part.len()` of the upload), so a layout the device
/// reads differently from the host's is never built whole in host memory.
fn upload_with(
    ctx: &VulkanContext,
    dst: &Subbuffer<[u8]>,
    len: usize,
    mut fill: impl FnMut(usize, &mut [u8]),
) -> Result<(), VulkanError> {
    const STAGE: usize = 64 << 20;
    for off in (0..len).step_by(STAGE) {
        let n = STAGE.min(len - off);
        let stage = host_buffer::<u8>(ctx, n as u64, BufferUsage::TRANSFER_SRC)?;
        fill(off, &mut stage.write().map_err(verr("mapping a staging buffer"))?);
        let (off, part) = (off as u64, n as u64);
        let mut cb = AutoCommandBufferBuilder::primary(
            ctx.commands.clone(),
            ctx.compute.queue_family_index(),
            CommandBufferUsage::OneTimeSubmit,
        )
        .map_err(verr("recording an upload"))?;
        cb.copy_buffer(CopyBufferInfo::buffers(stage, dst.clone().slice(off..off + part)))
            .map_err(verr("recording an upload"))?;
        let cb = cb.build().map_err(verr("recording an upload"))?;
        vulkano::sync::now(ctx.device.clone())
            .then_execute(ctx.compute.clone(), cb)
            .map_err(verr("submitting an upload"))?
            .then_signal_fence_and_flush()
            .map_err(verr("submitting an upload"))?
            .wait(None)
            .map_err(verr("waiting for an upload"))?;
    }
    Ok(())
}

/// A device-local f32 vector initialised from `data`.
pub fn upload_f32(ctx: &VulkanContext, data: &[f32]) -> Result<Subbuffer<[u8]>, VulkanError> {
    let buf = device_buffer::<u8>(ctx, (data.len() * 4) as u64, BufferUsage::STORAGE_BUFFER)?;
    upload(ctx, &buf, bytemuck::cast_slice(data))?;
    Ok(buf)
}

/// Rows `row0..row0 + rows` of a weight matrix, bound as one storage-buffer range.
#[derive(Clone)]
pub struct WeightRange {
    /// First row.
    pub row0: usize,
    /// Rows in the range.
    pub rows: usize,
    /// The bytes of those rows.
    pub bytes: Subbuffer<[u8]>,
}

/// A row-major weight matrix on the device, split into ranges the device can bind.
#[derive(Clone)]
pub struct DeviceWeight {
    /// Element type.
    pub dtype: DType,
    /// Q6_K blocks padded to [`Q6K_PADDED_BLOCK`] bytes (only its m=1 products run, by
    /// `matvec_q6_k_padded`).
    pub padded: bool,
    /// Rows (outputs).
    pub rows: usize,
    /// Columns (inputs).
    pub cols: usize,
    /// Row ranges covering all rows, in order.
    pub ranges: Vec<WeightRange>,
}

/// Most output rows one matmul dispatch covers (65535 workgroups of at least 4 rows:
/// 256 invocations, at most 64 lanes a row, at least one row per lane group).
pub const MAX_DISPATCH_ROWS: usize = 65535 * 4;

/// Rows per bound range so that each range fits `max_range` bytes and starts at an
/// offset that is a multiple of `align` bytes.
pub fn rows_per_range(row_bytes: u64, max_range: u64, align: u64) -> Option<usize> {
    let fit = max_range / row_bytes.max(1);
    // Smallest row count whose byte size is a multiple of the alignment.
    let step = align / gcd(align, row_bytes.max(1));
    let rows = fit.min(MAX_DISPATCH_ROWS as u64) / step * step;
    (rows > 0).then_some(rows as usize)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Bytes of a Q6_K block in the padded device layout: its 210 bytes, then 14 zero bytes,
/// so that every block and each of its parts starts on a 16-byte boundary and the m=1
/// kernel reads them by whole vectors (on an H100 the Q6_K LM head's matvec took 107 µs
/// instead of 124 with such loads). The same weights, so the same bytes of every product.
pub const Q6K_PADDED_BLOCK: usize = 224;

/// Bytes in the padded layout of `stored` bytes of whole Q6_K blocks.
fn padded_q6k_len(stored: usize) -> usize {
    stored / DType::Q6K.row_bytes(DType::Q6K.block_elems()).expect("one block") * Q6K_PADDED_BLOCK
}

/// Bytes `off .. off + out.len()` of Q6_K blocks `src` with every block padded to
/// [`Q6K_PADDED_BLOCK`] bytes, into `out`.
fn pad_q6k(src: &[u8], off: usize, out: &mut [u8]) {
    let block = DType::Q6K.row_bytes(DType::Q6K.block_elems()).expect("one block");
    let mut p = 0;
    while p < out.len() {
        let (b, within) = ((off + p) / Q6K_PADDED_BLOCK, (off + p) % Q6K_PADDED_BLOCK);
        let n = (Q6K_PADDED_BLOCK - within).min(out.len() - p);
        let data = block.saturating_sub(within).min(n);
        if data > 0 {
            let at = b * block + within;
            out[p..p + data].copy_from_slice(&src[at..at + data]);
        }
        out[p + data..p + n].fill(0);
        p += n;
    }
}

impl DeviceWeight {
    /// Uploads `w` to device-local memory; `padded` (Q6_K only) in the padded layout.
    pub fn upload(
        ctx: &VulkanContext,
        w: &WeightView<'_>,
        padded: bool,
    ) -> Result<DeviceWeight, VulkanError> {
        let dtype = w.dtype();
        if padded && dtype != DType::Q6K {
            return Err(VulkanError::Unsupported(format!("a padded layout of {dtype} weights")));
        }
        let bytes = w.bytes();
        let len = if padded { padded_q6k_len(bytes.len()) } else { bytes.len() };
        // Padded so that every bound range can be a whole number of 32-bit words.
        let buf =
            device_buffer::<u8>(ctx, (len as u64 + 4).next_multiple_of(16), BufferUsage::STORAGE_BUFFER)?;
        match padded {
            true => upload_with(ctx, &buf, len, |off, part| pad_q6k(bytes, off, part))?,
            false => upload(ctx, &buf, bytes)?,
        }
        DeviceWeight::from_buffer(ctx, dtype, w.rows, w.cols, buf, padded)
    }

    /// Describes `buf` (holding `rows × cols` elements of `dtype` from its start, padded
    /// to a multiple of 4 bytes; `padded`: Q6_K blocks of [`Q6K_PADDED_BLOCK`] bytes) in
    /// bindable row ranges.
    pub fn from_buffer(
        ctx: &VulkanContext,
        dtype: DType,
        rows: usize,
        cols: usize,
        buf: Subbuffer<[u8]>,
        padded: bool,
    ) -> Result<DeviceWeight, VulkanError> {
        let row_bytes = dtype.row_bytes(cols).ok_or_else(|| {
            VulkanError::Unsupported(format!("{cols} columns are not a whole number of {dtype} blocks"))
        })?;
        let row_bytes = if padded { padded_q6k_len(row_bytes) } else { row_bytes } as u64;
        let props = ctx.device.physical_device().properties();
        let align = props.min_storage_buffer_offset_alignment.as_devicesize().max(4);
        let per =
            rows_per_range(row_bytes, props.max_storage_buffer_range as u64, align).ok_or_else(|| {
                VulkanError::Unsupported(format!(
                    "a weight row of {row_bytes} bytes exceeds the device's storage-buffer range ({} bytes)",
                    props.max_storage_buffer_range
                ))
            })?;
        let mut ranges = Vec::new();
        let mut row0 = 0;
        while row0 < rows {
            let n = per.min(rows - row0);
            let (a, b) = (row0 as u64 * row_bytes, (row0 + n) as u64 * row_bytes);
            let end = b.next_multiple_of(4).min(buf.len());
            ranges.push(WeightRange { row0, rows: n, bytes: buf.clone().slice(a..end) });
            row0 += n;
        }
        Ok(DeviceWeight { dtype, padded, rows, cols, ranges })
    }
}

#[cfg(test)]
mod tests {
    use super::{pad_q6k, Q6K_PADDED_BLOCK};

    /// Padding Q6_K blocks in staging parts of any size (parts that start and end inside
    /// a block's bytes or its padding) gives the padded layout: each block's 210 bytes,
    /// then zeros.
    #[test]
    fn q6k_padding_in_parts_is_each_block_then_zeros() {
        let blocks = 5;
        let src: Vec<u8> = (0..210 * blocks).map(|i| (i % 251) as u8 + 1).collect();
        let len = blocks * Q6K_PADDED_BLOCK;
        for part in [len, 1, 7, 100, 211, 224, 333] {
            let mut out = vec![0xAA; len];
            for off in (0..len).step_by(part) {
                let n = part.min(len - off);
                pad_q6k(&src, off, &mut out[off..off + n]);
            }
            for b in 0..blocks {
                let at = b * Q6K_PADDED_BLOCK;
                assert_eq!(out[at..at + 210], src[b * 210..b * 210 + 210], "part {part}, block {b}");
                assert!(
                    out[at + 210..at + Q6K_PADDED_BLOCK].iter().all(|&x| x == 0),
                    "part {part}, block {b}"
                );
            }
        }
    }
}
