//! The CUDA backend: the driver API through cudarc's `sys` layer, opened at run time.
//!
//! * **No crash without a GPU.** cudarc's dynamic loading panics at the first driver call
//!   when libcuda is absent, so [`is_available`] and [`CudaBackend::new`] probe for the
//!   library (and for every driver symbol this file calls) before touching it; a machine
//!   with no driver or no device gets [`BackendError::Unavailable`].
//! * **Kernels, once per process.** The module is loaded once per device and kept for the
//!   life of the process (its primary context stays retained, so the handles never go
//!   stale): the embedded sm_90 cubin when the device is a 9.x part, else the embedded PTX
//!   (JIT by the driver), else NVRTC compiles the embedded source for the device's
//!   architecture (once per architecture).
//! * **Raw addresses, caller's stream.** Allocations are plain `cuMemAlloc` pointers with no
//!   event tracking; every operation is queued on the stream the caller names
//!   (`Stream(raw CUstream)`), and `Stream::DEFAULT` is a non-blocking stream this backend
//!   owns. Kernel arguments are the `*Args` struct by value, the kernel's single parameter.
//! * **No host synchronisation on the index path.** Uploads go through a pinned staging
//!   ring, so `upload` returns as soon as the bytes are staged, without waiting for the
//!   stream; the ring holds at least four of the largest upload seen (up to 256 MiB), so it
//!   only waits when the device is that far behind, and once when it grows. Launches and
//!   fills never wait. Only `download`, `synchronize`, `alloc_zeroed` (which must hand out
//!   zeroed memory to every stream) and event timing wait.
//! * **Graphs.** [`CudaBackend::begin_capture`] / [`GraphCapture::end`] record work queued
//!   on a stream into a [`CudaGraph`]; because every batch-dependent value lives behind a
//!   persistent pointer, [`CudaGraph::replay`] runs the same launches on new contents.

use super::{Backend, BackendError, BackendKind, DeviceAllocation, Stream};
use crate::index::shape::{check_launch, launch_shape, LaunchShape};
use crate::index::{DevicePtr, Launch};
use cudarc::driver::sys;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CStr};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

const KIND: BackendKind = BackendKind::Cuda;

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

/// Largest pinned staging ring. Uploads up to a quarter of it go through the ring; larger
/// ones are plain pageable copies, which the driver may stage with a wait.
const STAGING_MAX_BYTES: usize = 256 << 20;
/// The ring holds at least this many of the largest upload seen, so a step's uploads wait
/// only when the device is that many uploads behind (backpressure, not a per-call wait).
const STAGING_DEPTH: usize = 4;
const STAGING_MIN_BYTES: usize = 4 << 20;
/// Staged regions start on this boundary (keeps the DMA engine on its fast path).
const STAGING_ALIGN: usize = 256;
/// Retired staging regions are polled; beyond this many outstanding the oldest is waited for.
const STAGING_MAX_PENDING: usize = 4096;

// ---- probing ------------------------------------------------------------------------

/// Why the driver cannot be used, or `Ok` once `cuInit` succeeded. Probed once.
fn driver_ready() -> Result<(), String> {
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
pub fn device_count() -> Result<usize, BackendError> {
    driver_ready().map_err(unavailable)?;
    let mut n = 0;
    // SAFETY: the driver is initialised; `n` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

fn unavailable(reason: String) -> BackendError {
    BackendError::Unavailable { backend: KIND, reason }
}

fn error_text(r: sys::CUresult) -> String {
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

fn check(call: &'static str, r: sys::CUresult) -> Result<(), BackendError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver { backend: KIND, call, message: error_text(r) })
    }
}

// ---- kernel images ------------------------------------------------------------------

/// Where the loaded module came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleSource {
    /// The embedded sm_90 cubin.
    Cubin,
    /// The embedded PTX, JIT-compiled by the driver.
    Ptx,
    /// The embedded CUDA source, compiled at run time by NVRTC for `arch` (e.g. 90).
    Nvrtc { arch: u32 },
}

/// The kernel images the build embedded (see `crate::kernels`).
struct EmbeddedImages {
    cubin_sm90: Option<&'static [u8]>,
    /// PTX text, not NUL-terminated.
    ptx: Option<&'static [u8]>,
    source: &'static str,
}

fn embedded_images() -> EmbeddedImages {
    EmbeddedImages {
        cubin_sm90: crate::kernels::sm90_cubin(),
        ptx: crate::kernels::sm90_ptx(),
        source: crate::kernels::SOURCE,
    }
}

/// NVRTC output per architecture, compiled once per process.
fn nvrtc_ptx(source: &str, arch: u32) -> Result<Arc<Vec<u8>>, BackendError> {
    static CACHE: OnceLock<Mutex<HashMap<u32, Arc<Vec<u8>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ptx) = map.get(&arch) {
        return Ok(ptx.clone());
    }
    // SAFETY: only tries to open libnvrtc by its candidate names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(unavailable("no usable embedded kernel image and libnvrtc is not installed".into()));
    }
    if source.contains('\0') {
        return Err(BackendError::Compile {
            backend: KIND,
            log: "embedded source contains a NUL byte".into(),
        });
    }
    // NVRTC wants a `'static` architecture string; there are few, so leaking one per
    // architecture compiled is bounded.
    let arch_flag: &'static str = Box::leak(format!("compute_{arch}").into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch_flag),
        name: Some(crate::kernels::SOURCE_NAME.into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| BackendError::Compile { backend: KIND, log: e.to_string() })?;
    let mut image = ptx.to_src().into_bytes();
    image.push(0);
    let image = Arc::new(image);
    map.insert(arch, image.clone());
    Ok(image)
}

// ---- per-device state (process-wide) ----------------------------------------------------

/// What one device contributes, shared by every backend on it: the primary context
/// (retained for the process), the module and its kernels.
struct Device {
    ordinal: i32,
    ctx: sys::CUcontext,
    name: String,
    cc: (i32, i32),
    /// The module, or why it could not be loaded (kept so every launch reports it).
    module: Result<LoadedModule, String>,
}

struct LoadedModule {
    source: ModuleSource,
    /// Parallel to `Launch::SYMBOLS`; `None` when the module lacks the symbol.
    functions: Vec<Option<sys::CUfunction>>,
}

// SAFETY: the handles are driver objects usable from any thread once the context is
// current; nothing here is mutated after construction.
unsafe impl Send for Device {}
// SAFETY: as above; all fields are read-only after construction.
unsafe impl Sync for Device {}

fn device(ordinal: i32) -> Result<Arc<Device>, BackendError> {
    static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<Device>>>> = OnceLock::new();
    driver_ready().map_err(unavailable)?;
    let count = device_count()?;
    if ordinal < 0 || ordinal as usize >= count {
        return Err(unavailable(format!("no CUDA device {ordinal} ({count} present)")));
    }
    let devices = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = devices.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(open_device(ordinal)?);
    map.insert(ordinal, d.clone());
    Ok(d)
}

fn open_device(ordinal: i32) -> Result<Device, BackendError> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: driver initialised; ordinal checked against the count; out-pointer valid.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
    let mut name_buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer is 256 bytes and the driver writes at most `len` bytes, NUL included.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), 256, dev) })?;
    // SAFETY: the driver NUL-terminated the name inside the buffer.
    let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }.to_string_lossy().into_owned();
    let attr = |a: sys::CUdevice_attribute, call: &'static str| -> Result<i32, BackendError> {
        let mut v = 0;
        // SAFETY: valid device handle and out-pointer.
        check(call, unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) })?;
        Ok(v)
    };
    let major =
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute")?;
    let minor =
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute")?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid device; the primary context is retained once here and never released,
    // so module handles stay valid for the process.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
    // SAFETY: `ctx` was just retained.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
    let module = load_module((major, minor)).map_err(|e| e.to_string());
    Ok(Device { ordinal, ctx, name, cc: (major, minor), module })
}

/// Load one kind of image into the current context (no symbol lookup).
fn load_image(source: ModuleSource) -> Result<sys::CUmodule, BackendError> {
    let images = embedded_images();
    let missing = |what: &str| unavailable(format!("this build embeds no {what}"));
    match source {
        ModuleSource::Cubin => {
            let cubin = images.cubin_sm90.ok_or_else(|| missing("sm_90 cubin"))?;
            // The driver reads the ELF in place: give it an 8-byte aligned copy.
            let mut aligned = vec![0u64; cubin.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..cubin.len()].copy_from_slice(cubin);
            // SAFETY: a complete cubin embedded by the build, alive for the call.
            unsafe { module_from_image(aligned.as_ptr().cast()) }
        }
        ModuleSource::Ptx => {
            let mut image = images.ptx.ok_or_else(|| missing("PTX"))?.to_vec();
            image.push(0);
            // SAFETY: `image` is NUL-terminated PTX text, alive for the call.
            unsafe { module_from_image(image.as_ptr().cast()) }
        }
        ModuleSource::Nvrtc { arch } => {
            let image = nvrtc_ptx(images.source, arch)?;
            // SAFETY: NVRTC output, NUL-terminated, alive for the call.
            unsafe { module_from_image(image.as_ptr().cast()) }
        }
    }
}

/// The images worth trying on a device, best first: a cubin runs on its major architecture
/// at an equal or higher minor; sm_90 PTX JIT-compiles for 9.0 and newer; NVRTC targets the
/// device itself.
fn candidates(cc: (i32, i32)) -> Vec<ModuleSource> {
    let images = embedded_images();
    let mut v = Vec::new();
    if images.cubin_sm90.is_some() && cc.0 == 9 {
        v.push(ModuleSource::Cubin);
    }
    if images.ptx.is_some() && cc.0 >= 9 {
        v.push(ModuleSource::Ptx);
    }
    v.push(ModuleSource::Nvrtc { arch: (cc.0 * 10 + cc.1).max(0) as u32 });
    v
}

/// Load the best image for a device of compute capability `cc` into the current context.
/// `V4POOL_CUDA_MODULE=cubin|ptx|nvrtc` restricts the choice to one kind (to run everything
/// through the PTX JIT or NVRTC path on a device the cubin would serve).
fn load_module(cc: (i32, i32)) -> Result<LoadedModule, BackendError> {
    let forced = std::env::var("V4POOL_CUDA_MODULE").ok();
    let wanted = |source: &ModuleSource| {
        matches!(
            (forced.as_deref(), source),
            (None, _)
                | (Some("cubin"), ModuleSource::Cubin)
                | (Some("ptx"), ModuleSource::Ptx)
                | (Some("nvrtc"), ModuleSource::Nvrtc { .. })
        )
    };
    let mut errors = Vec::new();
    for source in candidates(cc).into_iter().filter(wanted) {
        match load_image(source) {
            Ok(m) => return resolve(m, source),
            Err(e) => errors.push(format!("{source:?}: {e}")),
        }
    }
    if let Some(f) = &forced {
        errors.push(format!("V4POOL_CUDA_MODULE={f} (one of cubin, ptx, nvrtc) allowed no other image"));
    }
    Err(unavailable(format!("no kernel image loads on sm_{}{}: {}", cc.0, cc.1, errors.join("; "))))
}

/// # Safety
/// `image` points to a complete cubin, fatbin or NUL-terminated PTX, and a context is current.
unsafe fn module_from_image(image: *const c_void) -> Result<sys::CUmodule, BackendError> {
    let mut m: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the caller's contract; `m` is a valid out-pointer.
    check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut m, image) })?;
    Ok(m)
}

fn resolve(module: sys::CUmodule, source: ModuleSource) -> Result<LoadedModule, BackendError> {
    let functions = Launch::SYMBOLS
        .iter()
        .map(|sym| {
            let c = std::ffi::CString::new(*sym).ok()?;
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `module` is loaded; `c` is a NUL-terminated name; out-pointer valid.
            let r = unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) };
            (r == sys::CUresult::CUDA_SUCCESS).then_some(f)
        })
        .collect();
    Ok(LoadedModule { source, functions })
}

// ---- the backend --------------------------------------------------------------------

/// Pinned host memory uploads are staged through, reused as a ring.
struct Staging {
    base: *mut u8,
    capacity: usize,
    head: usize,
    /// Regions still being copied: `[start, end)` and the event recorded after the copy.
    pending: VecDeque<(usize, usize, sys::CUevent)>,
    /// Retired events, reused.
    spare_events: Vec<sys::CUevent>,
}

struct Inner {
    device: Arc<Device>,
    /// The backend's own stream (`Stream::DEFAULT`).
    own_stream: sys::CUstream,
    staging: Mutex<Staging>,
}

// SAFETY: the stream and device handles are usable from any thread with the context
// current (every entry point makes it current); the staging ring is behind a mutex.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// The CUDA backend on one device. Cheap to clone (clones share the stream and staging).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
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
    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
        let ordinal = i32::try_from(ordinal).map_err(|_| unavailable(format!("no CUDA device {ordinal}")))?;
        let device = device(ordinal)?;
        bind(&device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the context is current; a non-blocking stream does not order against the
        // legacy default stream, so it can be captured while others run.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        let staging = Staging {
            base: std::ptr::null_mut(),
            capacity: 0,
            head: 0,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        };
        Ok(CudaBackend {
            inner: Arc::new(Inner { device, own_stream: stream, staging: Mutex::new(staging) }),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.inner.device.ordinal as usize
    }

    /// `(major, minor)`, e.g. `(9, 0)` on an H200.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.device.cc
    }

    /// Which image the kernels came from, or why none could be loaded.
    pub fn module_source(&self) -> Result<ModuleSource, BackendError> {
        match &self.inner.device.module {
            Ok(m) => Ok(m.source),
            Err(e) => Err(unavailable(e.clone())),
        }
    }

    /// Try every image this device could use, independently of the one loaded: load it,
    /// resolve every kernel symbol, run `v4pool_empty` from it, unload. Each entry is the
    /// image and its load time in milliseconds (for NVRTC, compile included unless an
    /// earlier call compiled it), or why it failed.
    pub fn probe_images(&self) -> Vec<(ModuleSource, Result<f64, BackendError>)> {
        candidates(self.inner.device.cc)
            .into_iter()
            .map(|source| (source, self.probe_image(source)))
            .collect()
    }

    fn probe_image(&self, source: ModuleSource) -> Result<f64, BackendError> {
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
            unsafe { self.launch_raw::<u8>(f, [1, 1, 1], [1, 1, 1], None, own)? };
            // SAFETY: our own live stream.
            check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(own) })
        })();
        // SAFETY: the probe's own module; the stream that ran its kernel is idle (or the
        // launch never happened).
        let unloaded = check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) });
        result.and(unloaded).map(|_| ms)
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64), BackendError> {
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

    fn bind(&self) -> Result<(), BackendError> {
        bind(&self.inner.device)
    }

    fn function(&self, launch: &Launch) -> Result<sys::CUfunction, BackendError> {
        let symbol = launch.symbol();
        let module = self.inner.device.module.as_ref().map_err(|e| unavailable(e.clone()))?;
        Launch::SYMBOLS
            .iter()
            .position(|s| *s == symbol)
            .and_then(|i| module.functions.get(i).copied().flatten())
            .ok_or(BackendError::MissingKernel { backend: KIND, symbol })
    }

    fn is_capturing(&self, stream: sys::CUstream) -> Result<bool, BackendError> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: context current; `stream` is the caller's live stream or ours.
        check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Start recording the work queued on `stream` into a graph. Until [`GraphCapture::end`]
    /// nothing runs; uploads, downloads and allocation are refused on that stream (and
    /// allocation is illegal on this thread) while capturing.
    pub fn begin_capture(&self, stream: Stream) -> Result<GraphCapture, BackendError> {
        self.bind()?;
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
    pub fn event(&self) -> Result<CudaEvent, BackendError> {
        self.bind()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        Ok(CudaEvent { inner: self.inner.clone(), event: ev })
    }

    /// Launch with an explicit shape: the kernel's single by-value parameter is `args`.
    ///
    /// # Safety
    /// The kernel's pointers cover what it reads and writes; `T` is the kernel's parameter type.
    unsafe fn launch_raw<T>(
        &self,
        f: sys::CUfunction,
        grid: [u32; 3],
        block: [u32; 3],
        args: Option<&T>,
        stream: sys::CUstream,
    ) -> Result<(), BackendError> {
        let mut arg_ptr: *mut c_void = match args {
            Some(a) => (a as *const T).cast_mut().cast(),
            None => std::ptr::null_mut(),
        };
        let params: *mut *mut c_void = if args.is_some() { &mut arg_ptr } else { std::ptr::null_mut() };
        // SAFETY: `params` holds one pointer to the by-value argument struct (read by the
        // driver during the call, which copies it); pointer validity is the caller's contract.
        check("cuLaunchKernel", unsafe {
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
        })
    }
}

fn bind(device: &Device) -> Result<(), BackendError> {
    // SAFETY: the primary context is retained for the process.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(device.ctx) })
}

impl Inner {
    fn stream(&self, stream: Stream) -> sys::CUstream {
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
            let staging = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
            for (_, _, ev) in staging.pending.drain(..) {
                sys::cuEventSynchronize(ev);
                sys::cuEventDestroy_v2(ev);
            }
            for ev in staging.spare_events.drain(..) {
                sys::cuEventDestroy_v2(ev);
            }
            if !staging.base.is_null() {
                sys::cuMemFreeHost(staging.base.cast());
            }
            sys::cuStreamDestroy_v2(self.own_stream);
        }
    }
}

impl Staging {
    /// Make `[start, start+len)` free: retire finished copies, wait for overlapping ones.
    fn reclaim(&mut self, start: usize, len: usize) -> Result<(), BackendError> {
        let end = start + len;
        let mut i = 0;
        while i < self.pending.len() {
            let (s, e, ev) = self.pending[i];
            let overlaps = s < end && start < e;
            // SAFETY: `ev` is a live event this ring created and recorded.
            let done = unsafe { sys::cuEventQuery(ev) } == sys::CUresult::CUDA_SUCCESS;
            let too_many = i == 0 && self.pending.len() > STAGING_MAX_PENDING;
            if done || overlaps || too_many {
                if !done {
                    // SAFETY: as above. Only reached when the ring has wrapped onto a
                    // region still being copied, i.e. the device is a whole ring behind.
                    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev) })?;
                }
                self.pending.remove(i);
                self.spare_events.push(ev);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Grow to hold `len` bytes, after every outstanding copy from the old buffer finished.
    fn grow(&mut self, len: usize) -> Result<(), BackendError> {
        let capacity = (STAGING_DEPTH * len).next_power_of_two().clamp(STAGING_MIN_BYTES, STAGING_MAX_BYTES);
        self.reclaim(0, usize::MAX / 2)?;
        if !self.base.is_null() {
            // SAFETY: every copy that read the old buffer has completed (reclaim waited).
            check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(self.base.cast()) })?;
            self.base = std::ptr::null_mut();
            self.capacity = 0;
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: context current (the caller bound it); valid out-pointer.
        let r = unsafe { sys::cuMemAllocHost_v2(&mut p, capacity) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(BackendError::OutOfMemory {
                backend: KIND,
                bytes: capacity as u64,
                message: format!("pinned staging buffer: {}", error_text(r)),
            });
        }
        self.base = p.cast();
        self.capacity = capacity;
        self.head = 0;
        Ok(())
    }

    fn event(&mut self) -> Result<sys::CUevent, BackendError> {
        if let Some(ev) = self.spare_events.pop() {
            return Ok(ev);
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(ev)
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        KIND
    }

    fn device_name(&self) -> String {
        self.inner.device.name.clone()
    }

    fn alloc_zeroed(&self, bytes: u64) -> Result<DeviceAllocation, BackendError> {
        self.bind()?;
        let size = usize::try_from(bytes.max(1)).map_err(|_| BackendError::OutOfMemory {
            backend: KIND,
            bytes,
            message: "exceeds usize".into(),
        })?;
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

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> Result<(), BackendError> {
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
        if src.len() > STAGING_MAX_BYTES / STAGING_DEPTH {
            // SAFETY: the caller's contract on `dst`; for pageable memory the driver returns
            // once `src` has been consumed.
            return check("cuMemcpyHtoDAsync_v2", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), raw)
            });
        }
        let mut st = self.inner.staging.lock().unwrap_or_else(|e| e.into_inner());
        if src.len() * STAGING_DEPTH > st.capacity {
            st.grow(src.len())?;
        }
        let len = src.len().div_ceil(STAGING_ALIGN) * STAGING_ALIGN;
        let mut start = st.head;
        if start + len > st.capacity {
            start = 0;
        }
        st.reclaim(start, len)?;
        // SAFETY: `[start, start+len)` lies in the pinned buffer (len <= capacity/DEPTH
        // rounded up to the alignment, which divides the capacity) and no pending copy reads it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), st.base.add(start), src.len()) };
        let ev = st.event()?;
        // SAFETY: the staged bytes stay untouched until `ev` completes (reclaim checks it);
        // `dst` is the caller's contract.
        let queued = unsafe {
            check(
                "cuMemcpyHtoDAsync_v2",
                sys::cuMemcpyHtoDAsync_v2(dst, st.base.add(start).cast(), src.len(), raw),
            )
            .and_then(|_| check("cuEventRecord", sys::cuEventRecord(ev, raw)))
        };
        match queued {
            Ok(()) => {
                st.pending.push_back((start, start + len, ev));
                st.head = start + len;
                Ok(())
            }
            Err(e) => {
                st.spare_events.push(ev);
                Err(e)
            }
        }
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> Result<(), BackendError> {
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

    unsafe fn copy(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: Stream,
    ) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let n = usize::try_from(bytes)
            .map_err(|_| BackendError::InvalidLaunch { kernel: "copy", reason: format!("{bytes} bytes") })?;
        // SAFETY: the caller's contract: both ranges live and disjoint.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, n, self.inner.stream(stream))
        })
    }

    unsafe fn fill_u32(
        &self,
        dst: DevicePtr,
        count: u64,
        value: u32,
        stream: Stream,
    ) -> Result<(), BackendError> {
        if count == 0 {
            return Ok(());
        }
        self.bind()?;
        let n = usize::try_from(count).map_err(|_| BackendError::InvalidLaunch {
            kernel: "fill_u32",
            reason: format!("{count} words"),
        })?;
        // SAFETY: the caller's contract: `dst .. dst + 4*count` is live and 4-byte aligned.
        check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(dst, value, n, self.inner.stream(stream)) })
    }

    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> Result<(), BackendError> {
        check_launch(launch)
            .map_err(|e| BackendError::InvalidLaunch { kernel: launch.symbol(), reason: e.to_string() })?;
        // Empty launches still run one block (never skipped) so a captured graph keeps
        // its nodes whatever the batch held at capture time.
        let LaunchShape { grid, block } = launch_shape(launch);
        self.bind()?;
        let f = self.function(launch)?;
        let raw = self.inner.stream(stream);
        // SAFETY (all arms): each struct is the `#[repr(C)]` parameter its kernel declares;
        // pointer coverage is the caller's contract.
        unsafe {
            match launch {
                Launch::Decode(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::Prefill(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::HcaOffsets(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::CsaPack(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::RingWrite(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::RowScatter(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::FillRuns(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::CopyRuns(a) => self.launch_raw(f, grid, block, Some(a), raw),
                Launch::Empty => self.launch_raw::<u8>(f, grid, block, None, raw),
            }
        }
    }

    fn synchronize(&self, stream: Stream) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: a live stream (ours, or the caller's by contract).
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.inner.stream(stream)) })
    }
}

// ---- graphs ---------------------------------------------------------------------------

/// A stream being recorded; [`GraphCapture::end`] turns it into a [`CudaGraph`]. Dropped
/// without `end`, the capture is ended and discarded.
pub struct GraphCapture {
    inner: Arc<Inner>,
    stream: sys::CUstream,
    ended: bool,
}

impl GraphCapture {
    /// Stop recording, instantiate and upload the graph.
    pub fn end(mut self) -> Result<CudaGraph, BackendError> {
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
    pub fn replay(&self, stream: Stream) -> Result<(), BackendError> {
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

// ---- timing ---------------------------------------------------------------------------

/// A timing event (`CU_EVENT_DEFAULT`).
pub struct CudaEvent {
    inner: Arc<Inner>,
    event: sys::CUevent,
}

// SAFETY: an event handle is usable from any thread with the context current.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Record at the current end of `stream`'s queue.
    pub fn record(&self, stream: Stream) -> Result<(), BackendError> {
        bind(&self.inner.device)?;
        // SAFETY: a live event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.event, self.inner.stream(stream)) })
    }

    /// Wait until the recorded work has run.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        bind(&self.inner.device)?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.event) })
    }

    /// Whether the work recorded before this event has run (no wait).
    pub fn is_complete(&self) -> Result<bool, BackendError> {
        bind(&self.inner.device)?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|_| false),
        }
    }

    /// Milliseconds from this event to `end` (waits for `end`).
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32, BackendError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
