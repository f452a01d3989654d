//! [`HipBackend`]: the [`Backend`] trait on the HIP runtime.

use super::api::{init_and_count, unavailable, HipApi, HipStaging};
use super::event::HipEvent;
use super::module::{device_arch, device_name, module_for, LoadedModule, ModuleOrigin};
use super::roctx::install_profiling_hooks;
use super::{Raw, HIP_ERROR_OUT_OF_MEMORY, HIP_STREAM_NON_BLOCKING, KIND};
use crate::backend::launch::DeviceLaunch;
use crate::backend::size::{to_usize, word_bytes};
use crate::backend::staging::{self, stages, StagingDriver, StagingRing};
use crate::backend::{
    heap, Backend, BackendError, BackendKind, BackendResult, DeviceAllocation, HostAllocation, HostMem,
    Stream,
};
use crate::index::{DevicePtr, Launch};
use std::ffi::c_int;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A `hipStream_t` the backend owns.
struct OwnedStream(Raw);

// SAFETY: a hipStream_t may be used from any thread; the backend destroys it once, in Drop.
unsafe impl Send for OwnedStream {}
// SAFETY: as above; HIP serialises work submitted to one stream.
unsafe impl Sync for OwnedStream {}

/// The HIP backend on one device. See the module docs.
pub struct HipBackend {
    api: &'static HipApi,
    ordinal: c_int,
    name: String,
    arch: Option<String>,
    stream: OwnedStream,
    module: Arc<LoadedModule>,
    staging: Mutex<StagingRing<HipStaging>>,
}

impl fmt::Debug for HipBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HipBackend")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("module", &self.module.origin)
            .finish()
    }
}

/// Number of HIP devices, or why there are none to count ([`BackendError::Unavailable`]).
pub fn device_count() -> BackendResult<usize> {
    let (_, count) = init_and_count()?;
    Ok(usize::try_from(count).unwrap_or(0))
}

impl HipBackend {
    /// True when the HIP runtime loads and reports at least one device. Never panics.
    pub fn is_available() -> bool {
        init_and_count().is_ok()
    }

    /// The backend on device `ordinal`: opens the runtime, creates the backend's stream and
    /// loads (or reuses) the device's kernel module. Without ROCm or a GPU:
    /// [`BackendError::Unavailable`].
    pub fn new(ordinal: usize) -> BackendResult<Self> {
        let (api, count) = init_and_count()?;
        install_profiling_hooks();
        let ordinal = c_int::try_from(ordinal)
            .ok()
            .filter(|&o| o < count)
            .ok_or_else(|| unavailable(format!("device {ordinal} requested, {count} present")))?;
        // SAFETY: `ordinal` is in range.
        api.check(unsafe { (api.set_device)(ordinal) }, "hipSetDevice")?;
        let name = device_name(api, ordinal)?;
        let arch = device_arch(api, ordinal);
        let mut raw: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        api.check(
            unsafe { (api.stream_create_with_flags)(&mut raw, HIP_STREAM_NON_BLOCKING) },
            "hipStreamCreateWithFlags",
        )?;
        let stream = OwnedStream(raw);
        let module = match module_for(api, ordinal, arch.as_deref()) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: the stream was created above and has no work.
                let _ = unsafe { (api.stream_destroy)(stream.0) };
                return Err(e);
            }
        };
        Ok(HipBackend {
            api,
            ordinal,
            name,
            arch,
            stream,
            module,
            staging: Mutex::new(StagingRing::default()),
        })
    }

    /// The arch string the device reported (`None`: could not be read safely).
    pub fn arch(&self) -> Option<&str> {
        self.arch.as_deref()
    }

    /// Whether the module came from an embedded object or from hiprtc.
    pub fn module_origin(&self) -> &ModuleOrigin {
        &self.module.origin
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        // Validated non-negative in `new`.
        usize::try_from(self.ordinal).unwrap_or(0)
    }

    /// The raw `hipStream_t` that `stream` names (the backend's own for `Stream::DEFAULT`).
    pub fn raw_stream(&self, stream: Stream) -> u64 {
        self.resolve(stream) as u64
    }

    /// A timing event (`hipEventDefault`) on this backend's device.
    pub fn event(&self) -> BackendResult<HipEvent> {
        self.bind()?;
        let mut event: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; default flags keep timing enabled.
        self.api.check(unsafe { (self.api.event_create)(&mut event) }, "hipEventCreate")?;
        Ok(HipEvent { api: self.api, ordinal: self.ordinal, own_stream: self.stream.0 as u64, event })
    }

    /// Make this backend's device current on the calling thread (HIP's current device is
    /// per thread, and the backend may be called from any thread).
    fn bind(&self) -> BackendResult<()> {
        // SAFETY: the ordinal was validated in `new`.
        self.api.check(unsafe { (self.api.set_device)(self.ordinal) }, "hipSetDevice")
    }

    fn resolve(&self, stream: Stream) -> Raw {
        if stream == Stream::DEFAULT {
            self.stream.0
        } else {
            stream.0 as Raw
        }
    }

    fn sync_raw(&self, raw: Raw) -> BackendResult<()> {
        // SAFETY: `raw` is this backend's stream or one the caller owns.
        self.api.check(unsafe { (self.api.stream_synchronize)(raw) }, "hipStreamSynchronize")
    }
}

/// One pinned buffer and the event that marks its last copy done.
impl Drop for HipBackend {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; HIP frees the stream once its work is done.
        let _ = self.bind();
        let staging = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
        staging.release(&HipStaging(self.api));
        // SAFETY: the backend's own stream, destroyed once.
        let _ = unsafe { (self.api.stream_destroy)(self.stream.0) };
    }
}

// SAFETY: allocations and pinned host memory come from the HIP runtime at the sizes asked
// (errors returned otherwise); copies and launches are queued as their contracts state.
unsafe impl Backend for HipBackend {
    fn kind(&self) -> BackendKind {
        KIND
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation> {
        self.bind()?;
        // hipMalloc(0) returns null; a 256-byte minimum keeps every allocation a real address.
        let size = to_usize(KIND, "alloc_zeroed", "bytes", bytes.max(256))?;
        let mut ptr: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (self.api.malloc)(&mut ptr, size) };
        if rc == HIP_ERROR_OUT_OF_MEMORY {
            return Err(BackendError::OutOfMemory { backend: KIND, bytes, message: self.api.message(rc) });
        }
        self.api.check(rc, "hipMalloc")?;
        // Zero on the backend's stream and wait, so the zeros are in place before any stream
        // of the caller's can touch the allocation.
        let zeroed = (|| {
            // SAFETY: `ptr` holds `size` bytes just allocated.
            let rc = unsafe { (self.api.memset_async)(ptr, 0, size, self.stream.0) };
            self.api.check(rc, "hipMemsetAsync")?;
            self.sync_raw(self.stream.0)
        })();
        if let Err(e) = zeroed {
            // SAFETY: allocated above; no work that succeeded can still use it.
            let _ = unsafe { (self.api.free)(ptr) };
            return Err(e);
        }
        Ok(DeviceAllocation { ptr: ptr as DevicePtr, bytes })
    }

    unsafe fn free(&self, alloc: DeviceAllocation) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: the caller promises no queued work uses it (trait contract).
        let _ = unsafe { (self.api.free)(alloc.ptr as Raw) };
    }

    fn alloc_host(&self, bytes: u64) -> BackendResult<HostAllocation> {
        let n = to_usize(KIND, "alloc_host", "bytes", bytes)?;
        if n == 0 || self.api.host_malloc.is_none() {
            // Without hipHostMalloc: ordinary memory, copied by the waiting paths below.
            return heap::alloc(KIND, bytes);
        }
        self.bind()?;
        staging::alloc_host(&HipStaging(self.api), n)
    }

    unsafe fn free_host(&self, alloc: HostAllocation) {
        if alloc.pinned && self.bind().is_err() {
            return;
        }
        // SAFETY: the caller's contract: from `alloc_host`, no copy queued; device current.
        unsafe { staging::free_host(&HipStaging(self.api), alloc) }
    }

    unsafe fn upload_host(&self, dst: DevicePtr, src: HostMem, stream: Stream) -> BackendResult<()> {
        if src.is_empty() || self.api.host_malloc.is_none() {
            // SAFETY: the caller's contract; `alloc_host` gave ordinary memory: copy and wait.
            return unsafe { self.upload(dst, src.as_slice(), stream) };
        }
        self.bind()?;
        // SAFETY: the caller's contract: `dst` in a live allocation, `src` page-locked and
        // untouched until the stream has run the copy (a DMA, not staged, no wait).
        unsafe { HipStaging(self.api).copy_to_device(dst, src.as_ptr(), src.len(), self.resolve(stream)) }
    }

    unsafe fn download_host(&self, dst: HostMem, src: DevicePtr, stream: Stream) -> BackendResult<()> {
        if dst.is_empty() || self.api.host_malloc.is_none() {
            // SAFETY: the caller's contract; ordinary memory: copy and wait.
            return unsafe { self.download(dst.as_mut_slice(), src, stream) };
        }
        self.bind()?;
        // SAFETY: the caller's contract: `src` in a live allocation, `dst` page-locked and
        // untouched until the stream has been synchronised.
        let (ptr, len) = (dst.as_ptr().cast(), dst.len());
        let rc = unsafe { (self.api.memcpy_dtoh_async)(ptr, src as Raw, len, self.resolve(stream)) };
        self.api.check(rc, "hipMemcpyDtoHAsync")
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> BackendResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let raw = self.resolve(stream);
        if stages(src.len()) && self.api.host_malloc.is_some() {
            let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the caller's contract on `dst`; `raw` is a live stream; the device is
            // current (bound above).
            return unsafe { staging.upload(&HipStaging(self.api), dst, src, raw) };
        }
        // SAFETY: the caller promises `dst` covers `src.len()` bytes; HIP only reads `src`.
        let rc = unsafe { (self.api.memcpy_htod_async)(dst as Raw, src.as_ptr() as Raw, src.len(), raw) };
        self.api.check(rc, "hipMemcpyHtoDAsync")?;
        // HIP does not promise that an async copy from pageable memory has read `src` when it
        // returns; waiting is what lets us return "src may be reused".
        self.sync_raw(raw)
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> BackendResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let raw = self.resolve(stream);
        // SAFETY: the caller promises `src` covers `dst.len()` bytes; `dst` is writable.
        let rc = unsafe { (self.api.memcpy_dtoh_async)(dst.as_mut_ptr().cast(), src as Raw, dst.len(), raw) };
        self.api.check(rc, "hipMemcpyDtoHAsync")?;
        self.sync_raw(raw)
    }

    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: Stream) -> BackendResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        let len = to_usize(KIND, "copy", "bytes", bytes)?;
        self.bind()?;
        // SAFETY: the caller promises both ranges are live and disjoint.
        let rc = unsafe { (self.api.memcpy_dtod_async)(dst as Raw, src as Raw, len, self.resolve(stream)) };
        self.api.check(rc, "hipMemcpyDtoDAsync")
    }

    unsafe fn fill_u32(&self, dst: DevicePtr, count: u64, value: u32, stream: Stream) -> BackendResult<()> {
        if count == 0 {
            return Ok(());
        }
        if dst % 4 != 0 {
            return Err(BackendError::InvalidLaunch {
                kernel: "fill_u32",
                reason: format!("destination {dst:#x} is not 4-byte aligned"),
            });
        }
        word_bytes(KIND, "fill_u32", count)?;
        let count = to_usize(KIND, "fill_u32", "count", count)?;
        self.bind()?;
        // hipMemsetD32Async takes the word as an int: same bits.
        let word = c_int::from_ne_bytes(value.to_ne_bytes());
        // SAFETY: the caller promises `dst .. dst + 4 * count` is live.
        let rc = unsafe { (self.api.memset_d32_async)(dst as Raw, word, count, self.resolve(stream)) };
        self.api.check(rc, "hipMemsetD32Async")
    }

    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()> {
        // Every dimension is >= 1: a launch with no work is one block that returns at once.
        let mut prepared = DeviceLaunch::prepare(launch)?;
        let function = *self
            .module
            .functions
            .get(prepared.index)
            .ok_or(BackendError::MissingKernel { backend: KIND, symbol: prepared.symbol() })?;
        let (grid, block) = (prepared.shape.grid, prepared.shape.block);
        self.bind()?;
        // SAFETY: the function belongs to the loaded module; `params` points at the
        // `#[repr(C)]` argument struct the kernel declares, alive until the call returns (HIP
        // copies arguments at launch); the caller promises the pointers inside it are valid.
        let rc = unsafe {
            (self.api.module_launch_kernel)(
                function,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                0,
                self.resolve(stream),
                prepared.params(),
                std::ptr::null_mut(),
            )
        };
        self.api.check(rc, "hipModuleLaunchKernel")
    }

    fn synchronize(&self, stream: Stream) -> BackendResult<()> {
        self.bind()?;
        self.sync_raw(self.resolve(stream))
    }
}
