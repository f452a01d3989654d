//! Timing events on a HIP device.

use super::api::HipApi;
use super::Raw;
use crate::backend::{BackendResult, Stream};
use std::ffi::c_int;
use std::fmt;

/// A timing event; see [`HipBackend::event`](super::HipBackend::event).
pub struct HipEvent {
    pub(super) api: &'static HipApi,
    pub(super) ordinal: c_int,
    /// The creating backend's own stream, for `Stream::DEFAULT`.
    pub(super) own_stream: u64,
    pub(super) event: Raw,
}

// SAFETY: a hipEvent_t is usable from any thread once its device is made current.
unsafe impl Send for HipEvent {}
// SAFETY: as above.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    fn bind(&self) -> BackendResult<()> {
        // SAFETY: the ordinal was validated when the backend was created.
        self.api.check(unsafe { (self.api.set_device)(self.ordinal) }, "hipSetDevice")
    }

    /// Record at the current end of `stream`'s queue.
    pub fn record(&self, stream: Stream) -> BackendResult<()> {
        self.bind()?;
        let raw = if stream == Stream::DEFAULT { self.own_stream } else { stream.0 };
        // SAFETY: a live event; the stream is the backend's or the caller's.
        self.api.check(unsafe { (self.api.event_record)(self.event, raw as Raw) }, "hipEventRecord")
    }

    /// Wait until the recorded work has run.
    pub fn synchronize(&self) -> BackendResult<()> {
        self.bind()?;
        // SAFETY: a live event.
        self.api.check(unsafe { (self.api.event_synchronize)(self.event) }, "hipEventSynchronize")
    }

    /// Milliseconds from this event to `end` (waits for `end`).
    pub fn elapsed_ms(&self, end: &HipEvent) -> BackendResult<f32> {
        end.synchronize()?;
        let mut ms = 0f32;
        // SAFETY: two live timing events, both recorded.
        self.api.check(
            unsafe { (self.api.event_elapsed_time)(&mut ms, self.event, end.event) },
            "hipEventElapsedTime",
        )?;
        Ok(ms)
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: our event, destroyed once; HIP defers destruction while it is pending.
        let _ = unsafe { (self.api.event_destroy)(self.event) };
    }
}

impl fmt::Debug for HipEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HipEvent").field("ordinal", &self.ordinal).finish_non_exhaustive()
    }
}
