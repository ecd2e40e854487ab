//! The io_uring I/O path: one thread keeps up to `queue_depth` O_DIRECT reads in
//! flight, taking demand requests before speculative ones, and verifies each blob as
//! its completion arrives. The ring gets a sparse table of fixed buffers (one entry per
//! slot, up to the kernel's limit) and each slot is registered on its first read, so reads
//! use `ReadFixed` and start-up pins no slot memory: registering a buffer faults in and
//! pins its pages, which for the whole ring at once took seconds per GiB.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use smoe_proto::ReadRequest;

use super::queue::IoQueue;
use super::{finish_read, BlobFiles, FaultInjector, LoadSink};

/// Most buffers the kernel accepts in one registration.
const MAX_FIXED_BUFFERS: usize = 16384;
/// How long the worker waits for a completion before looking for new requests.
const POLL: Duration = Duration::from_micros(200);

pub(super) struct UringWorker {
    ring: IoUring,
    depth: usize,
    /// Per slot, whether it is registered as a fixed buffer yet; `None` when the kernel
    /// gave no buffer table or refused a registration (reads are then unregistered).
    registered: Option<Vec<bool>>,
}

struct InFlight {
    req: ReadRequest,
    started: Instant,
}

impl UringWorker {
    /// Sets up the ring with an empty fixed-buffer table of one entry per slot when
    /// possible; no slot memory is touched.
    pub(super) fn new(depth: usize, sink: &dyn LoadSink) -> std::io::Result<Self> {
        let ring = IoUring::new((depth as u32).next_power_of_two().max(8))?;
        let registered = buffer_table(&ring, sink);
        Ok(UringWorker { ring, depth, registered })
    }

    /// The fixed-buffer index for a read into `slot`, registering the slot on its first
    /// use; `None` for an unregistered read.
    fn fixed_buffer(&mut self, sink: &dyn LoadSink, slot: u32) -> Option<u16> {
        let registered = self.registered.as_mut()?;
        if !registered[slot as usize] {
            let iov = libc::iovec { iov_base: sink.slot_ptr(slot).cast(), iov_len: sink.slot_len(slot) };
            // SAFETY: the slot memory outlives the ring (the ring cache owns both and drops
            // the streamer first).
            if let Err(e) = unsafe { self.ring.submitter().register_buffers_update(slot, &[iov], None) } {
                tracing::info!("io_uring buffer registration refused ({e}); using unregistered reads");
                self.registered = None;
                return None;
            }
            registered[slot as usize] = true;
        }
        Some(slot as u16)
    }

    /// Starts `req`, just taken off `queue` (which hears when a failed start ends it).
    fn push(
        &mut self,
        queue: &IoQueue,
        files: &BlobFiles,
        sink: &dyn LoadSink,
        req: ReadRequest,
        slab: &mut [Option<InFlight>],
    ) {
        let (file, loc) = match files.locate(req.key) {
            Ok(x) => x,
            Err(e) => {
                sink.complete(req, Err(e), Duration::ZERO);
                return queue.done();
            }
        };
        let idx = slab.iter().position(Option::is_none).expect("a free in-flight entry");
        let fd = types::Fd(file.as_raw_fd());
        let ptr = sink.slot_ptr(req.slot);
        let len = loc.stride as u32;
        let entry = match self.fixed_buffer(sink, req.slot) {
            Some(index) => opcode::ReadFixed::new(fd, ptr, len, index).offset(loc.offset).build(),
            None => opcode::Read::new(fd, ptr, len).offset(loc.offset).build(),
        };
        slab[idx] = Some(InFlight { req, started: Instant::now() });
        // SAFETY: the slot memory stays valid and untouched by others until the
        // completion is reaped (the slot is LOADING and owned by this request).
        if unsafe { self.ring.submission().push(&entry.user_data(idx as u64)) }.is_err() {
            slab[idx] = None;
            let err = std::io::Error::other("io_uring submission queue full");
            let loc_err = smoe_proto::VaultError::Io { file: loc.file, offset: loc.offset, source: err };
            sink.complete(req, Err(loc_err), Duration::ZERO);
            queue.done();
        }
    }

    /// Worker loop; returns when the queue shuts down and no read is in flight.
    pub(super) fn run(
        mut self,
        queue: &IoQueue,
        files: &BlobFiles,
        sink: &dyn LoadSink,
        fault: Option<&FaultInjector>,
    ) {
        let mut slab: Vec<Option<InFlight>> = (0..self.depth).map(|_| None).collect();
        let mut inflight = 0usize;
        loop {
            while inflight < self.depth {
                match queue.try_pop() {
                    Some(req) => {
                        self.push(queue, files, sink, req, &mut slab);
                        inflight = slab.iter().filter(|s| s.is_some()).count();
                    }
                    None => break,
                }
            }
            if inflight == 0 {
                match queue.pop() {
                    Some(req) => {
                        self.push(queue, files, sink, req, &mut slab);
                        inflight = slab.iter().filter(|s| s.is_some()).count();
                        continue;
                    }
                    None => return,
                }
            }
            let ts = types::Timespec::from(POLL);
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => tracing::error!("io_uring_enter failed: {e}"),
            }
            let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (idx, res) in done {
                let Some(f) = slab.get_mut(idx as usize).and_then(Option::take) else { continue };
                inflight -= 1;
                let result = files.locate(f.req.key).and_then(|(_, loc)| {
                    let got =
                        if res < 0 { Err(std::io::Error::from_raw_os_error(-res)) } else { Ok(res as u64) };
                    // SAFETY: the read into this slot has completed; the slot is still
                    // LOADING and owned by this request.
                    let slot =
                        unsafe { std::slice::from_raw_parts(sink.slot_ptr(f.req.slot), loc.stride as usize) };
                    finish_read(f.req.key, &loc, got, slot, fault)
                });
                sink.complete(f.req, result, f.started.elapsed());
                queue.done();
            }
        }
    }
}

/// An empty (sparse) table of one fixed buffer per slot, all unregistered; `None` when
/// the slots cannot be registered.
fn buffer_table(ring: &IoUring, sink: &dyn LoadSink) -> Option<Vec<bool>> {
    let n = sink.n_slots();
    if n == 0 || n > MAX_FIXED_BUFFERS {
        return None;
    }
    match ring.submitter().register_buffers_sparse(n as u32) {
        Ok(()) => Some(vec![false; n]),
        Err(e) => {
            tracing::info!("io_uring buffer table refused ({e}); using unregistered reads");
            None
        }
    }
}
