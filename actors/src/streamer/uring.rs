//! The io_uring I/O path: one thread keeps up to `queue_depth` O_DIRECT reads in
//! flight, taking demand requests before speculative ones, and verifies each blob as
//! its completion arrives. Slots are registered as fixed buffers when the ring allows
//! (one buffer per slot, up to the kernel's limit), so reads use `ReadFixed`.

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
    fixed: bool,
}

struct InFlight {
    req: ReadRequest,
    started: Instant,
}

impl UringWorker {
    /// Sets up the ring; registers the slots as fixed buffers when possible.
    pub(super) fn new(depth: usize, sink: &dyn LoadSink) -> std::io::Result<Self> {
        let ring = IoUring::new((depth as u32).next_power_of_two().max(8))?;
        let fixed = register_slots(&ring, sink);
        Ok(UringWorker { ring, depth, fixed })
    }

    fn push(
        &mut self,
        files: &BlobFiles,
        sink: &dyn LoadSink,
        req: ReadRequest,
        slab: &mut [Option<InFlight>],
    ) {
        let (file, loc) = match files.locate(req.key) {
            Ok(x) => x,
            Err(e) => return sink.complete(req, Err(e), Duration::ZERO),
        };
        let idx = slab.iter().position(Option::is_none).expect("a free in-flight entry");
        let fd = types::Fd(file.as_raw_fd());
        let ptr = sink.slot_ptr(req.slot);
        let len = loc.stride as u32;
        let entry = if self.fixed {
            opcode::ReadFixed::new(fd, ptr, len, req.slot as u16).offset(loc.offset).build()
        } else {
            opcode::Read::new(fd, ptr, len).offset(loc.offset).build()
        };
        slab[idx] = Some(InFlight { req, started: Instant::now() });
        // SAFETY: the slot memory stays valid and untouched by others until the
        // completion is reaped (the slot is LOADING and owned by this request).
        if unsafe { self.ring.submission().push(&entry.user_data(idx as u64)) }.is_err() {
            slab[idx] = None;
            let err = std::io::Error::other("io_uring submission queue full");
            let loc_err = smoe_proto::VaultError::Io { file: loc.file, offset: loc.offset, source: err };
            sink.complete(req, Err(loc_err), Duration::ZERO);
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
                        self.push(files, sink, req, &mut slab);
                        inflight = slab.iter().filter(|s| s.is_some()).count();
                    }
                    None => break,
                }
            }
            if inflight == 0 {
                match queue.pop() {
                    Some(req) => {
                        self.push(files, sink, req, &mut slab);
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
            }
        }
    }
}

/// Registers one fixed buffer per slot; false if the slots cannot be registered.
fn register_slots(ring: &IoUring, sink: &dyn LoadSink) -> bool {
    let (n, bytes) = sink.geometry();
    if n == 0 || n > MAX_FIXED_BUFFERS || bytes > (1 << 30) {
        return false;
    }
    let iovecs: Vec<libc::iovec> =
        (0..n).map(|i| libc::iovec { iov_base: sink.slot_ptr(i as u32).cast(), iov_len: bytes }).collect();
    // SAFETY: the slot memory outlives the ring (the ring cache owns both and drops the
    // streamer first).
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => true,
        Err(e) => {
            tracing::info!("io_uring buffer registration refused ({e}); using unregistered reads");
            false
        }
    }
}
