//! CUDA graphs and timing events: [`CudaBackend::begin_capture`](super::CudaBackend::begin_capture)
//! / [`GraphCapture::end`] record work queued on a stream into a [`CudaGraph`]; because every
//! batch-dependent value lives behind a persistent pointer, [`CudaGraph::replay`] runs the same
//! launches on new contents. [`CudaEvent`] times work on a stream.

use super::backend::{bind, CudaBackend, Inner};
use super::driver::check;
use crate::backend::{BackendResult, Stream};
use cudarc::driver::sys;
use std::fmt;
use std::sync::Arc;

impl CudaBackend {
    /// Start recording the work queued on `stream` into a graph. Until [`GraphCapture::end`]
    /// nothing runs; uploads, downloads and allocation are refused on that stream (and
    /// allocation is illegal on this thread) while capturing.
    pub fn begin_capture(&self, stream: Stream) -> BackendResult<GraphCapture> {
        bind(&self.inner.device)?;
        let raw = self.inner.stream(stream);
        // SAFETY: context current. Thread-local mode: other threads (other tests, the
        // engine's allocator) may keep calling the driver while this stream records.
        check("cuStreamBeginCapture_v2", unsafe {
            sys::cuStreamBeginCapture_v2(raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        })?;
        Ok(GraphCapture { inner: self.inner.clone(), stream: raw, ended: false })
    }

    /// A timing event (created with `CU_EVENT_DEFAULT`: the default-flag path that records
    /// timestamps).
    pub fn event(&self) -> BackendResult<CudaEvent> {
        bind(&self.inner.device)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        Ok(CudaEvent { inner: self.inner.clone(), event: ev })
    }
}

/// A stream being recorded; [`GraphCapture::end`] turns it into a [`CudaGraph`]. Dropped
/// without `end`, the capture is ended and discarded.
pub struct GraphCapture {
    pub(super) inner: Arc<Inner>,
    pub(super) stream: sys::CUstream,
    pub(super) ended: bool,
}

impl GraphCapture {
    /// Stop recording, instantiate and upload the graph.
    pub fn end(mut self) -> BackendResult<CudaGraph> {
        self.ended = true;
        bind(&self.inner.device)?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: this stream is capturing (begin_capture succeeded) on this thread.
        check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(self.stream, &mut graph) })?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is the captured graph; out-pointer valid.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(e) = check("cuGraphInstantiateWithFlags", r) {
            // SAFETY: the graph is ours and not instantiated.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        let g = CudaGraph { inner: self.inner.clone(), graph, exec };
        // SAFETY: a valid executable graph; prepares its launch on the capture stream.
        check("cuGraphUpload", unsafe { sys::cuGraphUpload(exec, self.stream) })?;
        Ok(g)
    }
}

impl Drop for GraphCapture {
    fn drop(&mut self) {
        if !self.ended {
            let _ = bind(&self.inner.device);
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: ends the capture begun on this stream and discards what it recorded.
            unsafe {
                if sys::cuStreamEndCapture(self.stream, &mut graph) == sys::CUresult::CUDA_SUCCESS
                    && !graph.is_null()
                {
                    sys::cuGraphDestroy(graph);
                }
            }
        }
    }
}

/// An instantiated graph: replays the captured launches on the buffers' current contents.
pub struct CudaGraph {
    inner: Arc<Inner>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are driver objects usable from any thread with the context
// current; `replay` binds it. Concurrent launches of one exec are serialised by the driver.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

impl CudaGraph {
    /// Queue one replay on `stream` (`Stream::DEFAULT`: the backend's own); no host wait.
    pub fn replay(&self, stream: Stream) -> BackendResult<()> {
        bind(&self.inner.device)?;
        // SAFETY: a valid executable graph; the buffers it names are the caller's to keep alive.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, self.inner.stream(stream)) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let _ = bind(&self.inner.device);
        // SAFETY: the handles are ours; the driver defers destruction of an exec still running.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

impl fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaGraph").finish_non_exhaustive()
    }
}

impl fmt::Debug for GraphCapture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphCapture").field("ended", &self.ended).finish_non_exhaustive()
    }
}

/// A timing event (`CU_EVENT_DEFAULT`).
pub struct CudaEvent {
    pub(super) inner: Arc<Inner>,
    pub(super) event: sys::CUevent,
}

// SAFETY: an event handle is usable from any thread with the context current.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Record at the current end of `stream`'s queue.
    pub fn record(&self, stream: Stream) -> BackendResult<()> {
        bind(&self.inner.device)?;
        // SAFETY: a live event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.event, self.inner.stream(stream)) })
    }

    /// Wait until the recorded work has run.
    pub fn synchronize(&self) -> BackendResult<()> {
        bind(&self.inner.device)?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.event) })
    }

    /// Whether the work recorded before this event has run (no wait).
    pub fn is_complete(&self) -> BackendResult<bool> {
        bind(&self.inner.device)?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|_| false),
        }
    }

    /// Milliseconds from this event to `end` (waits for `end`).
    pub fn elapsed_ms(&self, end: &CudaEvent) -> BackendResult<f32> {
        end.synchronize()?;
        let mut ms = 0f32;
        // SAFETY: two live timing events of the same context, both recorded.
        check("cuEventElapsedTime_v2", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, self.event, end.event)
        })?;
        Ok(ms)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let _ = bind(&self.inner.device);
        // SAFETY: the event is ours; the driver defers destruction while it is pending.
        unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaEvent").finish_non_exhaustive()
    }
}
