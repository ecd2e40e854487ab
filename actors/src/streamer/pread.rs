//! The fallback I/O path: each worker thread takes the next request (demand first) and
//! reads the whole blob stride with a positioned read into the slot.

use std::time::Instant;

use super::queue::IoQueue;
use super::{finish_read, BlobFiles, FaultInjector, LoadSink};
use crate::blob_check::pread_full;

/// Worker loop; returns when the queue shuts down.
pub(super) fn run(queue: &IoQueue, files: &BlobFiles, sink: &dyn LoadSink, fault: Option<&FaultInjector>) {
    while let Some(req) = queue.pop() {
        let started = Instant::now();
        let result = files.locate(req.key).and_then(|(file, loc)| {
            // SAFETY: the slot is LOADING and owned by this request; its memory is at
            // least one stride long and nobody else touches it until `complete`.
            let slot =
                unsafe { std::slice::from_raw_parts_mut(sink.slot_ptr(req.slot), loc.stride as usize) };
            let got = pread_full(file, slot, loc.offset);
            finish_read(req.key, &loc, got, slot, fault)
        });
        sink.complete(req, result, started.elapsed());
        queue.done();
    }
}
