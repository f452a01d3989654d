//! [`CudaBackend`]: the [`Backend`] trait on the driver API. Allocations are plain
//! `cuMemAlloc` pointers with no event tracking; every operation is queued on the stream the
//! caller names (`Stream(raw CUstream)`), and `Stream::DEFAULT` is a non-blocking stream this
//! backend owns.

use super::driver::{check, error_text, unavailable, CudaStaging};
use super::module::{candidates, device, load_image, resolve, Device, ModuleSource};
use super::KIND;
use crate::backend::launch::{DeviceLaunch, NO_PARAMS};
use crate::backend::size::{to_usize, word_bytes};
use crate::backend::staging::{self, stages, StagingRing};
use crate::backend::{
    heap, Backend, BackendError, BackendKind, BackendResult, DeviceAllocation, HostAllocation, HostMem,
    Stream,
};
use crate::index::{DevicePtr, Launch};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What every clone of a backend (and its graphs and events) shares.
pub(super) struct Inner {
    pub(super) device: Arc<Device>,
    /// The backend's own stream (`Stream::DEFAULT`).
    pub(super) own_stream: sys::CUstream,
    staging: Mutex<StagingRing<CudaStaging>>,
    /// Launch the index builders as programmatic dependents of the kernel before them
    /// ([`CudaBackend::set_overlapped_launches`]).
    overlap: AtomicBool,
}

// SAFETY: the stream and device handles are usable from any thread with the context
// current (every entry point makes it current); the staging ring is behind a mutex.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// The CUDA backend on one device. Cheap to clone (clones share the stream and staging).
#[derive(Clone)]
pub struct CudaBackend {
    // `pub(super)`: graph.rs adds the capture and event constructors (it builds on this file;
    // this file never names graph.rs).
    pub(super) inner: Arc<Inner>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.inner.device;
        f.debug_struct("CudaBackend")
            .field("ordinal", &d.ordinal)
            .field("name", &d.name)
            .field("compute_capability", &d.cc)
            .field("module", &d.module.as_ref().map(|m| m.source))
            .finish()
    }
}

impl CudaBackend {
    /// The backend on device `ordinal`, or `Unavailable` when there is no driver or device.
    pub fn new(ordinal: usize) -> BackendResult<Self> {
        let ordinal = i32::try_from(ordinal).map_err(|_| unavailable(format!("no CUDA device {ordinal}")))?;
        let device = device(ordinal)?;
        bind(&device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the context is current; a non-blocking stream does not order against the
        // legacy default stream, so it can be captured while others run.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        let overlap = device.cc.0 >= 9;
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                device,
                own_stream: stream,
                staging: Mutex::new(StagingRing::default()),
                overlap: AtomicBool::new(overlap),
            }),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.device.ordinal as usize
    }

    /// `(major, minor)`, e.g. `(9, 0)` on an H200.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.device.cc
    }

    /// Whether the index builders (decode, prefill, HCA offsets, CSA translate-pack) are
    /// launched with programmatic stream serialization: the next one may launch while the
    /// kernel before it in the stream still runs, and waits in its first instruction
    /// (`griddepcontrol.wait`, `v4p_overlap_begin` in the kernels) until that kernel has
    /// finished and its writes are visible. Stream order is kept for every memory access;
    /// what overlaps is the launch, block scheduling and the prologue, about 1–2 µs per
    /// kernel in a graph of per-layer packs. On by default on compute capability 9.0 and
    /// later (every image the backend loads there is built for sm_90+, where the wait
    /// exists); off before, where the kernels compile without it. Captured graphs keep the
    /// setting they were captured with.
    pub fn overlapped_launches(&self) -> bool {
        self.inner.overlap.load(Ordering::Relaxed)
    }

    /// Turn [`overlapped_launches`](Self::overlapped_launches) on or off for later launches
    /// of every clone of this backend (benchmarks compare both). Refused on a device before
    /// compute capability 9.0: the kernels there have no wait, so overlapping would race.
    pub fn set_overlapped_launches(&self, on: bool) -> BackendResult<()> {
        if on && self.inner.device.cc.0 < 9 {
            return Err(unavailable(format!(
                "overlapped launches need compute capability 9.0 or later (device has {}.{})",
                self.inner.device.cc.0, self.inner.device.cc.1
            )));
        }
        self.inner.overlap.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Which image the kernels came from, or why none could be loaded.
    pub fn module_source(&self) -> BackendResult<ModuleSource> {
        match &self.inner.device.module {
            Ok(m) => Ok(m.source),
            Err(e) => Err(unavailable(e.clone())),
        }
    }

    /// Try every image this device could use, independently of the one loaded: load it,
    /// resolve every kernel symbol, run `v4pool_empty` from it, unload. Each entry is the
    /// image and its load time in milliseconds (for NVRTC, compile included unless an
    /// earlier call compiled it), or why it failed.
    pub fn probe_images(&self) -> Vec<(ModuleSource, BackendResult<f64>)> {
        candidates(self.inner.device.cc)
            .into_iter()
            .map(|source| (source, self.probe_image(source)))
            .collect()
    }

    fn probe_image(&self, source: ModuleSource) -> BackendResult<f64> {
        self.bind()?;
        let t0 = std::time::Instant::now();
        let module = load_image(source)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let loaded = resolve(module, source)?;
        let result = (|| {
            for (sym, f) in Launch::SYMBOLS.iter().zip(&loaded.functions) {
                if f.is_none() {
                    return Err(BackendError::MissingKernel { backend: KIND, symbol: sym });
                }
            }
            let empty = Launch::SYMBOLS.iter().position(|s| *s == Launch::Empty.symbol());
            let f = empty
                .and_then(|i| loaded.functions[i])
                .ok_or(BackendError::MissingKernel { backend: KIND, symbol: Launch::Empty.symbol() })?;
            let own = self.inner.own_stream;
            // SAFETY: the empty kernel takes no parameters and touches nothing.
            unsafe { self.launch_raw(f, [1, 1, 1], [1, 1, 1], NO_PARAMS, own, false)? };
            // SAFETY: our own live stream.
            check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(own) })
        })();
        // SAFETY: the probe's own module; the stream that ran its kernel is idle (or the
        // launch never happened).
        let unloaded = check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) });
        result.and(unloaded).map(|_| ms)
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory_info(&self) -> BackendResult<(u64, u64)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: context current; valid out-pointers.
        check("cuMemGetInfo_v2", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    /// The raw `CUstream` a [`Stream`] names here (`Stream::DEFAULT` is the backend's own).
    pub fn raw_stream(&self, stream: Stream) -> u64 {
        self.inner.stream(stream) as u64
    }

    fn bind(&self) -> BackendResult<()> {
        bind(&self.inner.device)
    }

    /// Queue one copy between page-locked host memory and the device on `stream` (nothing
    /// for 0 bytes), with the context current.
    fn queue_dma(
        &self,
        call: &'static str,
        len: usize,
        stream: Stream,
        copy: impl FnOnce(sys::CUstream) -> sys::CUresult,
    ) -> BackendResult<()> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        check(call, copy(self.inner.stream(stream)))
    }

    /// The loaded module's function for a prepared launch.
    fn function(&self, launch: &DeviceLaunch<'_>) -> BackendResult<sys::CUfunction> {
        let module = self.inner.device.module.as_ref().map_err(|e| unavailable(e.clone()))?;
        module
            .functions
            .get(launch.index)
            .copied()
            .flatten()
            .ok_or(BackendError::MissingKernel { backend: KIND, symbol: launch.symbol() })
    }

    fn is_capturing(&self, stream: sys::CUstream) -> BackendResult<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: context current; `stream` is the caller's live stream or ours.
        check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Launch `f` with an explicit shape; `params` is the driver's `kernelParams` (see
    /// [`DeviceLaunch::params`]). `overlap`: as a programmatic dependent of the kernel before
    /// it in the stream (see [`overlapped_launches`](Self::overlapped_launches)).
    ///
    /// # Safety
    /// `params` is null or points at one pointer to the kernel's by-value argument struct,
    /// alive for the call; the kernel's pointers cover what it reads and writes. With
    /// `overlap`, the kernel waits (`v4p_overlap_begin`) before its first global access.
    unsafe fn launch_raw(
        &self,
        f: sys::CUfunction,
        grid: [u32; 3],
        block: [u32; 3],
        params: *mut *mut c_void,
        stream: sys::CUstream,
        overlap: bool,
    ) -> BackendResult<()> {
        if !overlap {
            // SAFETY: the caller's contract (the driver copies the argument struct during the call).
            return check("cuLaunchKernel", unsafe {
                sys::cuLaunchKernel(
                    f,
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    0,
                    stream,
                    params,
                    std::ptr::null_mut(),
                )
            });
        }
        // SAFETY: an all-zero attribute is a valid union value; the fields that matter are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid[0],
            gridDimY: grid[1],
            gridDimZ: grid[2],
            blockDimX: block[0],
            blockDimY: block[1],
            blockDimZ: block[2],
            sharedMemBytes: 0,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: the caller's contract; `config` and `attr` live across the call.
        check("cuLaunchKernelEx", unsafe { sys::cuLaunchKernelEx(&config, f, params, std::ptr::null_mut()) })
    }
}

/// The kernels launched as programmatic dependents when overlapped launches are on: exactly
/// those whose first statement is `v4p_overlap_begin();` (they wait for the kernel before them
/// before any global access; a unit test checks the embedded source), or
/// `v4p_overlap_trigger();` with a later `v4p_overlap_wait();` (the CSA translate-pack and the
/// write batch: before the wait they load only inputs their contracts require complete before
/// the kernel preceding them starts, and store nothing). The forward's writers (KV rows, index
/// keys, state update) joined for issue 34: a decode step is a chain of them. Any other kernel, the
/// ones other modules add included, keeps plain stream order.
pub(super) const OVERLAPPED_KERNELS: [&str; 12] = [
    "v4pool_decode_indices",
    "v4pool_prefill_indices",
    "v4pool_prefill_indices_short",
    "v4pool_prefill_indices_pair",
    "v4pool_hca_offsets",
    "v4pool_csa_translate_pack",
    "v4pool_csa_translate_pack_staged",
    "v4pool_csa_translate_pack_staged_x4",
    "v4pool_kv_rows",
    "v4pool_index_keys",
    "v4pool_update_compressor_states",
    "v4pool_write_batch",
];

pub(super) fn bind(device: &Device) -> BackendResult<()> {
    // SAFETY: the primary context is retained for the process.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(device.ctx) })
}

impl Inner {
    /// The raw stream a [`Stream`] names (`Stream::DEFAULT` is the backend's own).
    pub(super) fn stream(&self, stream: Stream) -> sys::CUstream {
        if stream == Stream::DEFAULT {
            self.own_stream
        } else {
            stream.0 as sys::CUstream
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; the worst case is a leaked stream or buffer.
        let _ = bind(&self.device);
        // SAFETY: no clone of this backend is left (this is the last Arc), so nothing else
        // queues on the own stream; waiting first lets the staged copies finish before the
        // pinned buffer they read is freed.
        unsafe {
            sys::cuStreamSynchronize(self.own_stream);
            self.staging.get_mut().unwrap_or_else(|e| e.into_inner()).release(&CudaStaging);
            sys::cuStreamDestroy_v2(self.own_stream);
        }
    }
}

// SAFETY: allocations and pinned host memory come from the CUDA driver at the sizes asked
// (errors returned otherwise); copies and launches are queued as their contracts state.
unsafe impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        KIND
    }

    fn device_name(&self) -> String {
        self.inner.device.name.clone()
    }

    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation> {
        self.bind()?;
        let size = to_usize(KIND, "alloc_zeroed", "bytes", bytes.max(1))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: context current; valid out-pointer. cuMemAlloc aligns to at least 256 B.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, size) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(BackendError::OutOfMemory { backend: KIND, bytes, message: error_text(r) });
        }
        check("cuMemAlloc_v2", r)?;
        let own = self.inner.own_stream;
        // SAFETY: `ptr .. ptr+size` was just allocated. The wait makes the zeros visible to
        // every stream the caller may use next (ours is not ordered with theirs).
        let zeroed = unsafe {
            check("cuMemsetD8Async", sys::cuMemsetD8Async(ptr, 0, size, own))
                .and_then(|_| check("cuStreamSynchronize", sys::cuStreamSynchronize(own)))
        };
        if let Err(e) = zeroed {
            // SAFETY: nothing else knows the pointer yet.
            unsafe { sys::cuMemFree_v2(ptr) };
            return Err(e);
        }
        Ok(DeviceAllocation { ptr, bytes })
    }

    unsafe fn free(&self, alloc: DeviceAllocation) {
        if self.bind().is_ok() {
            // SAFETY: the caller's contract: no queued work uses it. Errors cannot be
            // reported by this signature; a failure leaks the allocation.
            unsafe { sys::cuMemFree_v2(alloc.ptr) };
        }
    }

    fn alloc_host(&self, bytes: u64) -> BackendResult<HostAllocation> {
        let n = to_usize(KIND, "alloc_host", "bytes", bytes)?;
        if n == 0 {
            return heap::alloc(KIND, 0);
        }
        self.bind()?;
        // Page-locked in this backend's context, like the staging ring's.
        staging::alloc_host(&CudaStaging, n)
    }

    unsafe fn free_host(&self, alloc: HostAllocation) {
        if alloc.pinned && self.bind().is_err() {
            return;
        }
        // SAFETY: the caller's contract: from `alloc_host`, no copy queued; context current.
        unsafe { staging::free_host(&CudaStaging, alloc) }
    }

    unsafe fn upload_host(&self, dst: DevicePtr, src: HostMem, stream: Stream) -> BackendResult<()> {
        // SAFETY: the caller's contract: `dst` in a live allocation, `src` page-locked and
        // untouched until the stream has run the copy (a DMA, not staged).
        self.queue_dma("cuMemcpyHtoDAsync_v2", src.len(), stream, |raw| unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), raw)
        })
    }

    unsafe fn download_host(&self, dst: HostMem, src: DevicePtr, stream: Stream) -> BackendResult<()> {
        // SAFETY: the caller's contract: `src` in a live allocation, `dst` page-locked and
        // untouched until the stream has been synchronised.
        self.queue_dma("cuMemcpyDtoHAsync_v2", dst.len(), stream, |raw| unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_ptr().cast(), src, dst.len(), raw)
        })
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> BackendResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let raw = self.inner.stream(stream);
        if self.is_capturing(raw)? {
            // A captured copy would replay stale staging bytes: uploads happen outside graphs.
            return Err(BackendError::Driver {
                backend: KIND,
                call: "upload",
                message: "the stream is capturing a graph; upload before capture or replay".into(),
            });
        }
        if !stages(src.len()) {
            // SAFETY: the caller's contract on `dst`; for pageable memory the driver returns
            // once `src` has been consumed.
            return check("cuMemcpyHtoDAsync_v2", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), raw)
            });
        }
        let mut staging = self.inner.staging.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the caller's contract on `dst`; `raw` is our stream or the caller's live one;
        // the context is current (bound above).
        unsafe { staging.upload(&CudaStaging, dst, src, raw) }
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> BackendResult<()> {
        self.bind()?;
        let raw = self.inner.stream(stream);
        if self.is_capturing(raw)? {
            return Err(BackendError::Driver {
                backend: KIND,
                call: "download",
                message: "the stream is capturing a graph; a download waits, which capture forbids".into(),
            });
        }
        if !dst.is_empty() {
            // SAFETY: the caller's contract on `src`; `dst` is a live, exclusive host buffer
            // that the copy completes into before the synchronize below returns.
            check("cuMemcpyDtoHAsync_v2", unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), raw)
            })?;
        }
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw) })
    }

    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: Stream) -> BackendResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let n = to_usize(KIND, "copy", "bytes", bytes)?;
        // SAFETY: the caller's contract: both ranges live and disjoint.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, n, self.inner.stream(stream))
        })
    }

    unsafe fn fill_u32(&self, dst: DevicePtr, count: u64, value: u32, stream: Stream) -> BackendResult<()> {
        if count == 0 {
            return Ok(());
        }
        self.bind()?;
        // The byte count must exist too (the words are 4 bytes each).
        word_bytes(KIND, "fill_u32", count)?;
        let n = to_usize(KIND, "fill_u32", "count", count)?;
        // SAFETY: the caller's contract: `dst .. dst + 4*count` is live and 4-byte aligned.
        check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(dst, value, n, self.inner.stream(stream)) })
    }

    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()> {
        // Checked before the driver; empty launches still run one block (never skipped) so
        // a captured graph keeps its nodes whatever the batch held at capture time.
        let mut prepared = DeviceLaunch::prepare(launch)?;
        self.bind()?;
        let f = self.function(&prepared)?;
        let raw = self.inner.stream(stream);
        let (grid, block) = (prepared.shape.grid, prepared.shape.block);
        let overlap = self.overlapped_launches() && OVERLAPPED_KERNELS.contains(&launch.symbol());
        // SAFETY: `params` points at the `#[repr(C)]` argument struct the kernel declares,
        // inside `launch`, alive for the call; pointer coverage is the caller's contract; an
        // overlapped kernel waits before its first global access.
        unsafe { self.launch_raw(f, grid, block, prepared.params(), raw, overlap) }
    }

    fn synchronize(&self, stream: Stream) -> BackendResult<()> {
        self.bind()?;
        // SAFETY: a live stream (ours, or the caller's by contract).
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.inner.stream(stream)) })
    }
}
