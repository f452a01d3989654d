//! The HIP backend (AMD GPUs, MI300 = gfx942 first): the same [`Backend`](crate::backend::Backend) as CUDA and host.
//!
//! Nothing of ROCm is linked: `libamdhip64` is opened at run time with `libloading`, and
//! `libhiprtc` only when a run-time compile is needed, so the crate builds and runs on a
//! machine without ROCm, where [`HipBackend::new`] returns [`BackendError::Unavailable`](crate::backend::BackendError::Unavailable).
//! `V4POOL_HIP_RUNTIME=/path/to/lib.so` names the runtime file to open instead of searching
//! for libamdhip64 (CI points it at the runtime double of `tests/hip_double/`, docs/amd.md);
//! hiprtc is then looked for under its own names first, then in that file.
//!
//! # Which code runs
//!
//! build.rs embeds gfx942 and gfx90a code objects when clang-19 is present
//! ([`embedded_code_objects`](crate::raw::hip::embedded_code_objects)). A device whose arch matches one of them loads it; any other
//! AMD GPU gets the embedded kernel source compiled by hiprtc for its own arch string, once per
//! process and arch. `V4POOL_HIP_FORCE_HIPRTC=1` takes the hiprtc path even when an object
//! matches (the smoke script runs both); `V4POOL_HIP_ARCH=gfx…` overrides the arch the device
//! reports. The module is loaded once per device per process and shared by every backend
//! on that device.
//!
//! # The arch string
//!
//! HIP has no attribute for it, and `hipDeviceProp_t` changed layout across ROCm versions.
//! We call the versioned entry point `hipGetDevicePropertiesR0600` (ROCm ≥ 6.0, whose name
//! pins its struct layout; `hipGetDeviceProperties` is a macro over it) with an 8 KiB zeroed
//! buffer — far above the struct's 1472 bytes — and read `gcnArchName` at its offset
//! `GCN_ARCH_NAME_OFFSET`; the text is accepted only if it looks like `gfx…` and is
//! NUL-terminated in its 256 bytes. When that entry point is missing or the text fails the
//! check, the arch is unknown: each embedded object is offered to `hipModuleLoadData`
//! (the runtime refuses one that does not fit the device) and, failing that, hiprtc compiles
//! for the current device's default target.
//!
//! # Streams
//!
//! Work goes on the caller's `hipStream_t`; [`Stream::DEFAULT`](crate::backend::Stream::DEFAULT) is a non-blocking stream this
//! backend owns. Every call first makes the backend's device current on the calling thread.
//! Uploads up to 64 MiB go through the pinned staging ring both device backends share
//! (`backend::staging`), so `upload` returns without waiting for the stream; the host
//! waits only in `download`, `synchronize`, `alloc_zeroed` (zeros must be in place for every
//! stream), larger uploads and event timing. Launches go through the same
//! [`crate::raw::launch`] preparation as CUDA's: checked with
//! [`crate::index::shape::check_launch`] first, grid from
//! [`crate::index::shape::launch_shape`].
//!
//! Files: `api.rs` (the runtime and hiprtc entry points, opened at run time; the staging
//! ring's driver calls), `module.rs` (arch detection, code objects, module loading),
//! `backend.rs` ([`HipBackend`] and its [`Backend`](crate::backend::Backend)
//! implementation), `event.rs` (timing events), `roctx.rs` (profiler ranges), `elf.rs`
//! (reading code objects).

pub(crate) mod api;
mod backend;
pub(crate) mod elf;
mod event;
pub(crate) mod module;
pub(crate) mod roctx;

// The loader's internals are public under `crate::raw::hip` only (tests and tools reach them
// there); what an engine holds is the backend, its events and where its module came from.
pub use backend::{device_count, HipBackend};
pub use event::HipEvent;
pub use module::ModuleOrigin;

use super::BackendKind;
use crate::index::Launch;
use std::ffi::{c_int, c_uint, c_void};

const KIND: BackendKind = BackendKind::Hip;

/// Every kernel symbol the backend looks up when it loads a module (a module lacking one is
/// [`BackendError::MissingKernel`](crate::backend::BackendError::MissingKernel)); the code-object test checks exactly this list.
pub(crate) const KERNEL_SYMBOLS: [&str; Launch::SYMBOLS.len()] = Launch::SYMBOLS;

/// Offset of `gcnArchName[256]` in `hipDeviceProp_tR0600` (ROCm 6.x/7.x `hip_runtime_api.h`:
/// `name[256]`, `uuid`, `luid[8]`, … 63 `reserved` and 32 `hipReserved` ints, then
/// `gcnArchName`), the struct being 1472 bytes on x86-64.
pub(crate) const GCN_ARCH_NAME_OFFSET: usize = 1160;
const GCN_ARCH_NAME_LEN: usize = 256;
/// Bytes handed to `hipGetDevicePropertiesR0600`: room for the struct to grow many times over.
const DEVICE_PROP_BUFFER_BYTES: usize = 8192;

const HIP_SUCCESS: c_int = 0;
const HIP_ERROR_OUT_OF_MEMORY: c_int = 2;
const HIP_ERROR_NOT_FOUND: c_int = 500;
const HIP_STREAM_NON_BLOCKING: c_uint = 1;
const HIP_EVENT_DISABLE_TIMING: c_uint = 2;

type Raw = *mut c_void;
type HipErr = c_int;
#[cfg(test)]
mod tests {
    use super::api::library_candidates;
    use super::module::parse_arch_name;
    use super::roctx::{roctx_pop, roctx_push};
    use super::*;

    #[test]
    fn arch_names_are_validated() {
        let field = |s: &[u8]| {
            let mut f = [0u8; GCN_ARCH_NAME_LEN];
            f[..s.len()].copy_from_slice(s);
            f
        };
        assert_eq!(
            parse_arch_name(&field(b"gfx942:sramecc+:xnack-")).as_deref(),
            Some("gfx942:sramecc+:xnack-")
        );
        assert_eq!(parse_arch_name(&field(b"gfx90a")).as_deref(), Some("gfx90a"));
        assert_eq!(parse_arch_name(&field(b"")), None);
        assert_eq!(parse_arch_name(&field(b"gfx")), None);
        assert_eq!(parse_arch_name(&field(b"AMD Instinct MI300X")), None);
        assert_eq!(parse_arch_name(&field(b"gfx9 42")), None);
        // Not NUL-terminated within the field: the layout guess was wrong.
        assert_eq!(parse_arch_name(&[b'g'; GCN_ARCH_NAME_LEN]), None);
    }

    #[test]
    fn library_candidates_try_the_loader_path_and_opt_rocm() {
        let c = library_candidates(&["libamdhip64.so"]);
        assert!(c.iter().any(|n| n == "libamdhip64.so"));
        assert!(c.iter().any(|n| n == "/opt/rocm/lib/libamdhip64.so"));
    }

    #[test]
    fn roctx_without_library_is_a_no_op() {
        roctx_push("v4pool test range");
        roctx_push("embedded\0nul");
        roctx_pop();
        roctx_pop();
    }
}
