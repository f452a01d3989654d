//! Opening the CUDA driver without crashing: the library and every entry point this backend
//! calls are probed before the first call (cudarc's dynamic loading panics on a missing
//! symbol), errors become [`BackendError`]s, and the pinned staging ring's driver calls.

use super::KIND;
use crate::backend::staging::StagingDriver;
use crate::backend::{BackendError, BackendResult};
use crate::index::DevicePtr;
use cudarc::driver::sys;
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

/// Every driver entry point this file calls. cudarc resolves each one lazily and panics
/// when a symbol is missing, so they are all checked up front.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamIsCapturing",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemGetInfo_v2",
    "cuMemsetD8Async",
    "cuMemsetD32Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuGraphInstantiateWithFlags",
    "cuGraphUpload",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuEventElapsedTime_v2",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Why the driver cannot be used, or `Ok` once `cuInit` succeeded. Probed once.
pub(super) fn driver_ready() -> Result<(), String> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY.get_or_init(probe_driver).clone()
}

fn probe_driver() -> Result<(), String> {
    // SAFETY: only tries to open the library by its candidate names; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda (the NVIDIA driver library) is not installed".into());
    }
    // SAFETY: the library is present (checked above), so `culib` returns it instead of
    // panicking; looking a symbol up calls nothing.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = DRIVER_SYMBOLS
        .iter()
        .copied()
        // SAFETY: a symbol lookup; the pointer is never called through this type.
        .filter(|name| unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(format!("the driver lacks {} (needs a CUDA 12.8+ driver)", missing.join(", ")));
    }
    // SAFETY: every symbol is present; cuInit has no pointer arguments.
    let r = unsafe { sys::cuInit(0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuInit failed: {}", error_text(r)));
    }
    Ok(())
}

/// Whether a CUDA driver and at least one device are present. Probe only: never panics,
/// opens no context.
pub fn is_available() -> bool {
    device_count().map(|n| n > 0).unwrap_or(false)
}

/// Number of CUDA devices, or why there are none to count.
pub fn device_count() -> BackendResult<usize> {
    driver_ready().map_err(unavailable)?;
    let mut n = 0;
    // SAFETY: the driver is initialised; `n` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(super) fn unavailable(reason: String) -> BackendError {
    BackendError::Unavailable { backend: KIND, reason }
}

pub(super) fn error_text(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string owned by the driver (or
    // leave it null for an unknown code); the strings are read before returning.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
        let read = |p: *const std::ffi::c_char| {
            if p.is_null() {
                None
            } else {
                Some(CStr::from_ptr(p).to_string_lossy().into_owned())
            }
        };
        match (read(name), read(text)) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n,
            _ => format!("CUresult {}", r as i32),
        }
    }
}

pub(super) fn check(call: &'static str, r: sys::CUresult) -> BackendResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver { backend: KIND, call, message: error_text(r) })
    }
}

/// The driver calls of the pinned staging ring ([`crate::backend::staging`]). Every call
/// runs with the backend's context current (the backend binds it before locking the ring).
pub(super) struct CudaStaging;

impl StagingDriver for CudaStaging {
    type Event = sys::CUevent;
    type Stream = sys::CUstream;

    fn alloc_pinned(&self, bytes: usize) -> BackendResult<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: context current (the caller bound it); valid out-pointer.
        let r = unsafe { sys::cuMemAllocHost_v2(&mut p, bytes) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(BackendError::OutOfMemory {
                backend: KIND,
                bytes: bytes as u64,
                message: format!("pinned staging buffer: {}", error_text(r)),
            });
        }
        Ok(p.cast())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) -> BackendResult<()> {
        // SAFETY: the caller's contract: our pinned buffer, no copy still reads it.
        check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr.cast()) })
    }

    fn create_event(&self) -> BackendResult<sys::CUevent> {
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(ev)
    }

    unsafe fn destroy_event(&self, event: sys::CUevent) {
        // SAFETY: the caller's contract: a live event, not used after.
        unsafe { sys::cuEventDestroy_v2(event) };
    }

    unsafe fn event_done(&self, event: sys::CUevent) -> bool {
        // SAFETY: the caller's contract: a live event.
        let r = unsafe { sys::cuEventQuery(event) };
        r == sys::CUresult::CUDA_SUCCESS
    }

    unsafe fn wait_event(&self, event: sys::CUevent) -> BackendResult<()> {
        // SAFETY: the caller's contract: a live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event) })
    }

    unsafe fn record(&self, event: sys::CUevent, stream: sys::CUstream) -> BackendResult<()> {
        // SAFETY: the caller's contract: live event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event, stream) })
    }

    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: sys::CUstream,
    ) -> BackendResult<()> {
        // SAFETY: the caller's contract on both ranges and the stream.
        check("cuMemcpyHtoDAsync_v2", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream) })
    }

    unsafe fn sync_stream(&self, stream: sys::CUstream) -> BackendResult<()> {
        // SAFETY: the caller's contract: a live stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })
    }
}
