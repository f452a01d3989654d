//! The CUDA backend: the driver API through cudarc's `sys` layer, opened at run time.
//!
//! * **No crash without a GPU.** cudarc's dynamic loading panics at the first driver call
//!   when libcuda is absent, so [`is_available`] and [`CudaBackend::new`] probe for the
//!   library (and for every driver symbol this file calls) before touching it; a machine
//!   with no driver or no device gets [`BackendError::Unavailable`](crate::backend::BackendError::Unavailable).
//! * **Kernels, once per process.** The module is loaded once per device and kept for the
//!   life of the process (its primary context stays retained, so the handles never go
//!   stale): the embedded sm_90 cubin when the device is a 9.x part, else the embedded PTX
//!   (JIT by the driver), else NVRTC compiles the embedded source for the device's
//!   architecture (once per architecture).
//! * **Raw addresses, caller's stream.** Allocations are plain `cuMemAlloc` pointers with no
//!   event tracking; every operation is queued on the stream the caller names
//!   (`Stream(raw CUstream)`), and `Stream::DEFAULT` is a non-blocking stream this backend
//!   owns. Kernel arguments are the `*Args` struct by value, the kernel's single parameter.
//! * **No host synchronisation on the index path.** Uploads go through the pinned staging
//!   ring both device backends share (`backend::staging`), so `upload` returns as
//!   soon as the bytes are staged, without waiting for the stream; the ring holds at least
//!   four of the largest upload seen (up to 256 MiB), so it only waits when the device is
//!   that far behind, and once when it grows. Launches and
//!   fills never wait. Only `download`, `synchronize`, `alloc_zeroed` (which must hand out
//!   zeroed memory to every stream) and event timing wait.
//! * **Graphs.** [`CudaBackend::begin_capture`] / [`GraphCapture::end`] record work queued
//!   on a stream into a [`CudaGraph`]; because every batch-dependent value lives behind a
//!   persistent pointer, [`CudaGraph::replay`] runs the same launches on new contents.
//!
//! Files: `driver.rs` (probing, errors, the staging ring's driver calls), `module.rs`
//! (kernel images, per-device state), `backend.rs` ([`CudaBackend`] and its [`Backend`]
//! implementation), `graph.rs` (graphs and timing events).
//!
//! [`Backend`]: crate::backend::Backend

mod backend;
mod driver;
mod graph;
mod module;

pub use backend::CudaBackend;
pub use driver::{device_count, is_available};
pub use graph::{CudaEvent, CudaGraph, GraphCapture};
pub use module::ModuleSource;

use super::BackendKind;

const KIND: BackendKind = BackendKind::Cuda;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, BackendError, Stream};
    use crate::index::Launch;

    #[test]
    fn probing_never_panics() {
        // On a machine without the driver this must be an error value, not a crash.
        let available = is_available();
        match CudaBackend::new(0) {
            Ok(b) => assert!(available, "{b:?}"),
            Err(BackendError::Unavailable { backend, .. }) => {
                assert_eq!(backend, BackendKind::Cuda);
                assert!(!available);
            }
            Err(e) => panic!("unexpected error {e}"),
        }
        assert!(matches!(CudaBackend::new(1 << 20), Err(BackendError::Unavailable { .. })));
    }

    /// A kernel launched as a programmatic dependent must wait for its predecessor before it
    /// touches its output: each one in the overlapped set exists and opens with the wait, or
    /// opens with the trigger alone and waits later in its body (the CSA translate-pack, whose
    /// pre-wait loads are the contract's inputs complete before the previous kernel starts).
    #[test]
    fn overlapped_kernels_wait_first() {
        let src = crate::kernels::SOURCE;
        for sym in backend::OVERLAPPED_KERNELS {
            assert!(Launch::SYMBOLS.contains(&sym), "{sym} is no launch symbol");
            let at = src.find(&format!("void {sym}(")).unwrap_or_else(|| panic!("{sym} not in the source"));
            // This kernel's text only: up to the next entry point, so a wait in a later
            // kernel does not count for this one.
            let rest = &src[at..];
            let body = &rest[..rest[1..].find("extern \"C\"").map_or(rest.len(), |e| e + 1)];
            let open = body.find('{').expect("kernel body");
            let first = body[open + 1..].trim_start();
            let split = first.starts_with("v4p_overlap_trigger();") && body.contains("v4p_overlap_wait();");
            assert!(
                first.starts_with("v4p_overlap_begin();") || split,
                "{sym} does not open with v4p_overlap_begin() (or the trigger, then a wait)"
            );
        }
    }

    #[test]
    fn invalid_launches_are_rejected_before_the_driver() {
        let bad = crate::index::RowScatterArgs { num_tokens: -1, ..Default::default() };
        if let Ok(b) = CudaBackend::new(0) {
            // SAFETY: rejected by the host-side check; nothing reaches the device.
            let r = unsafe { b.launch(&Launch::RowScatter(bad), Stream::DEFAULT) };
            assert!(matches!(r, Err(BackendError::InvalidLaunch { .. })), "{r:?}");
        }
    }
}
