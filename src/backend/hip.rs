//! The HIP backend (AMD GPUs, MI300 = gfx942 first): the same [`Backend`] as CUDA and host.
//!
//! Nothing of ROCm is linked: `libamdhip64` is opened at run time with `libloading`, and
//! `libhiprtc` only when a run-time compile is needed, so the crate builds and runs on a
//! machine without ROCm, where [`HipBackend::new`] returns [`BackendError::Unavailable`].
//!
//! # Which code runs
//!
//! build.rs embeds gfx942 and gfx90a code objects when clang-19 is present
//! ([`embedded_code_objects`]). A device whose arch matches one of them loads it; any other
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
//! [`GCN_ARCH_NAME_OFFSET`]; the text is accepted only if it looks like `gfx…` and is
//! NUL-terminated in its 256 bytes. When that entry point is missing or the text fails the
//! check, the arch is unknown: each embedded object is offered to `hipModuleLoadData`
//! (the runtime refuses one that does not fit the device) and, failing that, hiprtc compiles
//! for the current device's default target.
//!
//! # Streams
//!
//! Work goes on the caller's `hipStream_t`; [`Stream::DEFAULT`] is a non-blocking stream this
//! backend owns. Every call first makes the backend's device current on the calling thread.
//! Uploads up to 256 MiB are staged in pinned buffers recycled by events, so `upload` returns
//! without waiting for the stream; the host waits only in `download`, `synchronize`,
//! `alloc_zeroed` (zeros must be in place for every stream), larger uploads and event timing.
//! Launches are checked with [`check_launch`] first and take their grid from
//! [`launch_shape`], exactly as the CUDA backend does.

#[path = "elf.rs"]
pub mod elf;

use super::{Backend, BackendError, BackendKind, DeviceAllocation, Stream};
use crate::index::shape::{check_launch, launch_shape, LaunchShape};
use crate::index::{DevicePtr, Launch};
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

const KIND: BackendKind = BackendKind::Hip;

/// Every kernel symbol the backend looks up when it loads a module (a module lacking one is
/// [`BackendError::MissingKernel`]); the code-object test checks exactly this list.
pub const KERNEL_SYMBOLS: [&str; 9] = Launch::SYMBOLS;

/// Offset of `gcnArchName[256]` in `hipDeviceProp_tR0600` (ROCm 6.x/7.x `hip_runtime_api.h`:
/// `name[256]`, `uuid`, `luid[8]`, … 63 `reserved` and 32 `hipReserved` ints, then
/// `gcnArchName`), the struct being 1472 bytes on x86-64.
pub const GCN_ARCH_NAME_OFFSET: usize = 1160;
const GCN_ARCH_NAME_LEN: usize = 256;
/// Bytes handed to `hipGetDevicePropertiesR0600`: room for the struct to grow many times over.
const DEVICE_PROP_BUFFER_BYTES: usize = 8192;

const HIP_SUCCESS: c_int = 0;
const HIP_ERROR_OUT_OF_MEMORY: c_int = 2;
const HIP_ERROR_NOT_FOUND: c_int = 500;
const HIP_STREAM_NON_BLOCKING: c_uint = 1;
const HIP_ERROR_NOT_READY: c_int = 600;
const HIP_EVENT_DISABLE_TIMING: c_uint = 2;

/// Uploads up to this size are staged in pinned memory, so `upload` returns without waiting
/// for the stream; larger ones are pageable copies followed by a wait.
const STAGING_MAX_BYTES: usize = 256 << 20;
/// Smallest staging buffer (most uploads are a decode step's few KiB of metadata).
const STAGING_MIN_BYTES: usize = 64 << 10;
/// Staging buffers kept at most; past this the least recently used one is waited for.
const STAGING_MAX_BUFFERS: usize = 32;

type Raw = *mut c_void;
type HipErr = c_int;

/// Candidate names of a library: `$ROCM_PATH/lib`, `$HIP_PATH/lib`, the loader's own search
/// path (which `ldconfig` entries of a ROCm install cover), then `/opt/rocm/lib`.
fn library_candidates(stems: &[&str]) -> Vec<String> {
    let mut dirs: Vec<String> = ["ROCM_PATH", "HIP_PATH"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .filter(|d| !d.is_empty())
        .map(|d| format!("{d}/lib/"))
        .collect();
    dirs.push(String::new());
    dirs.push("/opt/rocm/lib/".to_owned());
    dirs.iter().flat_map(|d| stems.iter().map(move |s| format!("{d}{s}"))).collect()
}

fn open_first(stems: &[&str]) -> Result<Library, String> {
    let mut first_error = None;
    for name in library_candidates(stems) {
        // SAFETY: opening a ROCm library runs its initialisers; these are the vendor's own
        // libraries, loaded under their published names.
        match unsafe { Library::new(&name) } {
            Ok(lib) => return Ok(lib),
            Err(e) => {
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    Err(format!(
        "{} not found (tried {} in $ROCM_PATH/lib, $HIP_PATH/lib, the loader path, /opt/rocm/lib): {}",
        stems.first().copied().unwrap_or("library"),
        stems.join(", "),
        first_error.unwrap_or_default()
    ))
}

/// Copy a function pointer out of `lib`.
///
/// # Safety
/// `T` must be the exact C signature of `name`, and the pointer must not outlive `lib`.
unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    // SAFETY: forwarded to the caller (signature and lifetime).
    unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("{name}: {e}"))
}

/// The HIP runtime functions the backend calls, resolved once per process.
struct HipApi {
    init: unsafe extern "C" fn(c_uint) -> HipErr,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> HipErr,
    set_device: unsafe extern "C" fn(c_int) -> HipErr,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> HipErr,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipErr,
    get_device_properties_r0600: Option<unsafe extern "C" fn(*mut c_void, c_int) -> HipErr>,
    malloc: unsafe extern "C" fn(*mut Raw, usize) -> HipErr,
    free: unsafe extern "C" fn(Raw) -> HipErr,
    memset_async: unsafe extern "C" fn(Raw, c_int, usize, Raw) -> HipErr,
    memset_d32_async: unsafe extern "C" fn(Raw, c_int, usize, Raw) -> HipErr,
    memcpy_htod_async: unsafe extern "C" fn(Raw, Raw, usize, Raw) -> HipErr,
    memcpy_dtoh_async: unsafe extern "C" fn(Raw, Raw, usize, Raw) -> HipErr,
    memcpy_dtod_async: unsafe extern "C" fn(Raw, Raw, usize, Raw) -> HipErr,
    stream_create_with_flags: unsafe extern "C" fn(*mut Raw, c_uint) -> HipErr,
    stream_destroy: unsafe extern "C" fn(Raw) -> HipErr,
    stream_synchronize: unsafe extern "C" fn(Raw) -> HipErr,
    module_load_data: unsafe extern "C" fn(*mut Raw, *const c_void) -> HipErr,
    module_get_function: unsafe extern "C" fn(*mut Raw, Raw, *const c_char) -> HipErr,
    module_unload: unsafe extern "C" fn(Raw) -> HipErr,
    #[allow(clippy::type_complexity)]
    module_launch_kernel: unsafe extern "C" fn(
        Raw,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Raw,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> HipErr,
    get_error_string: unsafe extern "C" fn(HipErr) -> *const c_char,
    event_create: unsafe extern "C" fn(*mut Raw) -> HipErr,
    event_create_with_flags: unsafe extern "C" fn(*mut Raw, c_uint) -> HipErr,
    event_query: unsafe extern "C" fn(Raw) -> HipErr,
    /// `hipHostMalloc`, or `hipHostAlloc` where a later ROCm dropped the former; without
    /// either, uploads are pageable copies followed by a wait.
    host_malloc: Option<unsafe extern "C" fn(*mut Raw, usize, c_uint) -> HipErr>,
    host_free: unsafe extern "C" fn(Raw) -> HipErr,
    event_record: unsafe extern "C" fn(Raw, Raw) -> HipErr,
    event_synchronize: unsafe extern "C" fn(Raw) -> HipErr,
    event_elapsed_time: unsafe extern "C" fn(*mut f32, Raw, Raw) -> HipErr,
    event_destroy: unsafe extern "C" fn(Raw) -> HipErr,
    /// Keeps every pointer above valid; never dropped (the table lives in a static).
    _lib: Library,
}

impl HipApi {
    fn load() -> Result<HipApi, String> {
        let lib =
            open_first(&["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"])?;
        // SAFETY: each signature below is the one `hip_runtime_api.h` declares (hipError_t
        // is a C enum = int; handles are pointers; hipDevice_t is int); the pointers live as
        // long as `lib`, which the table owns.
        unsafe {
            Ok(HipApi {
                init: sym(&lib, "hipInit")?,
                get_device_count: sym(&lib, "hipGetDeviceCount")?,
                set_device: sym(&lib, "hipSetDevice")?,
                device_get: sym(&lib, "hipDeviceGet")?,
                device_get_name: sym(&lib, "hipDeviceGetName")?,
                get_device_properties_r0600: sym(&lib, "hipGetDevicePropertiesR0600").ok(),
                malloc: sym(&lib, "hipMalloc")?,
                free: sym(&lib, "hipFree")?,
                memset_async: sym(&lib, "hipMemsetAsync")?,
                memset_d32_async: sym(&lib, "hipMemsetD32Async")?,
                memcpy_htod_async: sym(&lib, "hipMemcpyHtoDAsync")?,
                memcpy_dtoh_async: sym(&lib, "hipMemcpyDtoHAsync")?,
                memcpy_dtod_async: sym(&lib, "hipMemcpyDtoDAsync")?,
                stream_create_with_flags: sym(&lib, "hipStreamCreateWithFlags")?,
                stream_destroy: sym(&lib, "hipStreamDestroy")?,
                stream_synchronize: sym(&lib, "hipStreamSynchronize")?,
                module_load_data: sym(&lib, "hipModuleLoadData")?,
                module_get_function: sym(&lib, "hipModuleGetFunction")?,
                module_unload: sym(&lib, "hipModuleUnload")?,
                module_launch_kernel: sym(&lib, "hipModuleLaunchKernel")?,
                get_error_string: sym(&lib, "hipGetErrorString")?,
                event_create: sym(&lib, "hipEventCreate")?,
                event_create_with_flags: sym(&lib, "hipEventCreateWithFlags")?,
                event_query: sym(&lib, "hipEventQuery")?,
                host_malloc: sym(&lib, "hipHostMalloc").or_else(|_| sym(&lib, "hipHostAlloc")).ok(),
                host_free: sym(&lib, "hipHostFree")?,
                event_record: sym(&lib, "hipEventRecord")?,
                event_synchronize: sym(&lib, "hipEventSynchronize")?,
                event_elapsed_time: sym(&lib, "hipEventElapsedTime")?,
                event_destroy: sym(&lib, "hipEventDestroy")?,
                _lib: lib,
            })
        }
    }

    fn message(&self, code: HipErr) -> String {
        // SAFETY: hipGetErrorString accepts any value and returns a static string (or null).
        let text = unsafe { (self.get_error_string)(code) };
        if text.is_null() {
            return format!("hipError {code}");
        }
        // SAFETY: non-null, NUL-terminated and static per the HIP documentation.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{text} (hipError {code})")
    }

    fn check(&self, code: HipErr, call: &'static str) -> Result<(), BackendError> {
        if code == HIP_SUCCESS {
            Ok(())
        } else {
            Err(BackendError::Driver { backend: KIND, call, message: self.message(code) })
        }
    }
}

fn unavailable(reason: impl Into<String>) -> BackendError {
    BackendError::Unavailable { backend: KIND, reason: reason.into() }
}

fn api() -> Result<&'static HipApi, BackendError> {
    static API: OnceLock<Result<HipApi, String>> = OnceLock::new();
    API.get_or_init(HipApi::load).as_ref().map_err(|e| unavailable(e.clone()))
}

/// `hipInit` and the device count; `Unavailable` when there is no runtime, driver or GPU.
fn init_and_count() -> Result<(&'static HipApi, c_int), BackendError> {
    let api = api()?;
    // SAFETY: plain C calls with valid out-pointers.
    let init = unsafe { (api.init)(0) };
    if init != HIP_SUCCESS {
        return Err(unavailable(format!("hipInit failed: {}", api.message(init))));
    }
    let mut count: c_int = 0;
    // SAFETY: as above.
    let rc = unsafe { (api.get_device_count)(&mut count) };
    if rc != HIP_SUCCESS {
        return Err(unavailable(format!("hipGetDeviceCount failed: {}", api.message(rc))));
    }
    if count < 1 {
        return Err(unavailable("no HIP device"));
    }
    Ok((api, count))
}

/// The hiprtc functions, opened only when a run-time compile is needed.
struct RtcApi {
    create_program: unsafe extern "C" fn(
        *mut Raw,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile_program: unsafe extern "C" fn(Raw, c_int, *const *const c_char) -> c_int,
    get_code_size: unsafe extern "C" fn(Raw, *mut usize) -> c_int,
    get_code: unsafe extern "C" fn(Raw, *mut c_char) -> c_int,
    get_log_size: unsafe extern "C" fn(Raw, *mut usize) -> c_int,
    get_log: unsafe extern "C" fn(Raw, *mut c_char) -> c_int,
    destroy_program: unsafe extern "C" fn(*mut Raw) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    _lib: Library,
}

impl RtcApi {
    fn load() -> Result<RtcApi, String> {
        // ROCm 5 shipped hiprtc inside libamdhip64.
        let lib = open_first(&[
            "libhiprtc.so",
            "libhiprtc.so.7",
            "libhiprtc.so.6",
            "libhiprtc.so.5",
            "libamdhip64.so",
        ])?;
        // SAFETY: signatures as in `hiprtc.h` (hiprtcResult is a C enum = int, a program is a
        // pointer); the table owns `lib`.
        unsafe {
            Ok(RtcApi {
                create_program: sym(&lib, "hiprtcCreateProgram")?,
                compile_program: sym(&lib, "hiprtcCompileProgram")?,
                get_code_size: sym(&lib, "hiprtcGetCodeSize")?,
                get_code: sym(&lib, "hiprtcGetCode")?,
                get_log_size: sym(&lib, "hiprtcGetProgramLogSize")?,
                get_log: sym(&lib, "hiprtcGetProgramLog")?,
                destroy_program: sym(&lib, "hiprtcDestroyProgram")?,
                get_error_string: sym(&lib, "hiprtcGetErrorString")?,
                _lib: lib,
            })
        }
    }

    fn message(&self, code: c_int) -> String {
        // SAFETY: hiprtcGetErrorString returns a static string for any value (or null).
        let text = unsafe { (self.get_error_string)(code) };
        if text.is_null() {
            return format!("hiprtcResult {code}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        format!("{} (hiprtcResult {code})", unsafe { CStr::from_ptr(text) }.to_string_lossy())
    }

    fn check(&self, code: c_int, call: &'static str) -> Result<(), BackendError> {
        if code == 0 {
            Ok(())
        } else {
            Err(BackendError::Driver { backend: KIND, call, message: self.message(code) })
        }
    }

    /// Compile `source` for `arch` (`None`: hiprtc's default, the current device).
    fn compile(&self, source: &str, arch: Option<&str>) -> Result<Vec<u8>, BackendError> {
        let compile_error = |log: String| BackendError::Compile { backend: KIND, log };
        let source = CString::new(source).map_err(|_| compile_error("kernel source contains NUL".into()))?;
        let name = CString::new(crate::kernels::SOURCE_NAME).unwrap_or_default();
        let mut options = vec![CString::from(c"-O3")];
        if let Some(arch) = arch {
            options.push(
                CString::new(format!("--offload-arch={arch}"))
                    .map_err(|_| compile_error(format!("arch {arch:?} contains NUL")))?,
            );
        }
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut program: Raw = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings that outlive the call; no headers.
        let rc = unsafe {
            (self.create_program)(
                &mut program,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.check(rc, "hiprtcCreateProgram")?;
        let result = self.compile_created(program, &option_ptrs);
        // SAFETY: `program` was created above and is destroyed once.
        let _ = unsafe { (self.destroy_program)(&mut program) };
        result
    }

    fn compile_created(&self, program: Raw, options: &[*const c_char]) -> Result<Vec<u8>, BackendError> {
        let count = c_int::try_from(options.len())
            .map_err(|_| BackendError::Compile { backend: KIND, log: "too many hiprtc options".into() })?;
        // SAFETY: `program` is live; `options` holds `count` valid C strings.
        let rc = unsafe { (self.compile_program)(program, count, options.as_ptr()) };
        if rc != 0 {
            let log = self.log(program).unwrap_or_default();
            return Err(BackendError::Compile { backend: KIND, log: format!("{}\n{log}", self.message(rc)) });
        }
        let mut size = 0usize;
        // SAFETY: live program, valid out-pointer.
        self.check(unsafe { (self.get_code_size)(program, &mut size) }, "hiprtcGetCodeSize")?;
        let mut code = vec![0u8; size];
        // SAFETY: `code` has the `size` bytes hiprtc reported.
        self.check(unsafe { (self.get_code)(program, code.as_mut_ptr().cast()) }, "hiprtcGetCode")?;
        Ok(code)
    }

    fn log(&self, program: Raw) -> Result<String, BackendError> {
        let mut size = 0usize;
        // SAFETY: live program, valid out-pointer.
        self.check(unsafe { (self.get_log_size)(program, &mut size) }, "hiprtcGetProgramLogSize")?;
        let mut log = vec![0u8; size.max(1)];
        // SAFETY: `log` holds at least the reported size.
        self.check(unsafe { (self.get_log)(program, log.as_mut_ptr().cast()) }, "hiprtcGetProgramLog")?;
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        Ok(String::from_utf8_lossy(&log[..end]).into_owned())
    }
}

fn rtc() -> Result<&'static RtcApi, BackendError> {
    static RTC: OnceLock<Result<RtcApi, String>> = OnceLock::new();
    RTC.get_or_init(RtcApi::load).as_ref().map_err(|e| unavailable(format!("hiprtc: {e}")))
}

/// Compile the embedded kernel source ([`crate::kernels::SOURCE`]) with hiprtc for `arch`
/// (e.g. `gfx942`; `None`: hiprtc's default, the current device), returning the code object.
/// Needs only the hiprtc library, not a GPU. [`BackendError::Unavailable`] without hiprtc.
pub fn hiprtc_compile(arch: Option<&str>) -> Result<Vec<u8>, BackendError> {
    hiprtc_compile_source(crate::kernels::SOURCE, arch)
}

/// [`hiprtc_compile`] for any source (tests use a broken one to see the log come back).
pub fn hiprtc_compile_source(source: &str, arch: Option<&str>) -> Result<Vec<u8>, BackendError> {
    rtc()?.compile(source, arch)
}

/// The code objects build.rs embedded, as `(arch, bytes)`; empty when it had no clang 19+.
pub fn embedded_code_objects() -> Vec<(&'static str, &'static [u8])> {
    [("gfx942", crate::kernels::gfx942_code_object()), ("gfx90a", crate::kernels::gfx90a_code_object())]
        .into_iter()
        .filter_map(|(arch, obj)| obj.map(|o| (arch, o)))
        .collect()
}

/// Accept `gcnArchName` text only if it reads like `gfx<id>[:feature±…]`.
pub fn parse_arch_name(raw: &[u8]) -> Option<String> {
    let end = raw.iter().position(|&b| b == 0)?;
    let text = std::str::from_utf8(&raw[..end]).ok()?;
    let processor = text.split(':').next()?;
    let ok_processor = processor.len() > 3
        && processor.starts_with("gfx")
        && processor.bytes().all(|b| b.is_ascii_alphanumeric());
    let ok_rest = text.bytes().all(|b| b.is_ascii_alphanumeric() || b":+-_".contains(&b));
    (ok_processor && ok_rest).then(|| text.to_owned())
}

/// The device's arch string (e.g. `gfx942:sramecc+:xnack-`), or `None` when it cannot be read
/// safely (see the module docs).
fn device_arch(api: &HipApi, ordinal: c_int) -> Option<String> {
    if let Ok(arch) = std::env::var("V4POOL_HIP_ARCH") {
        if !arch.is_empty() {
            return Some(arch);
        }
    }
    let get = api.get_device_properties_r0600?;
    // u64 storage keeps the buffer 8-byte aligned like the struct.
    let mut buffer = vec![0u64; DEVICE_PROP_BUFFER_BYTES / 8];
    // SAFETY: the buffer is zeroed, aligned and over five times the struct's size.
    let rc = unsafe { get(buffer.as_mut_ptr().cast(), ordinal) };
    if rc != HIP_SUCCESS {
        return None;
    }
    let bytes: &[u8] = bytemuck::cast_slice(&buffer);
    parse_arch_name(bytes.get(GCN_ARCH_NAME_OFFSET..GCN_ARCH_NAME_OFFSET + GCN_ARCH_NAME_LEN)?)
}

/// Where a device's module came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModuleOrigin {
    /// An object build.rs embedded, for this arch.
    Embedded(&'static str),
    /// hiprtc, for this arch (`None`: hiprtc's default target).
    Hiprtc(Option<String>),
}

/// A loaded module and its kernels, in [`KERNEL_SYMBOLS`] order.
struct LoadedModule {
    functions: [Raw; KERNEL_SYMBOLS.len()],
    origin: ModuleOrigin,
}

// SAFETY: hipModule_t/hipFunction_t handles are process-wide and HIP calls on them are
// thread-safe; the module is never unloaded, so the handles stay valid.
unsafe impl Send for LoadedModule {}
// SAFETY: as above; the handles are only read.
unsafe impl Sync for LoadedModule {}

/// Code objects compiled by hiprtc, once per arch per process (leaked: a handful at most).
fn compiled_for(arch: Option<&str>) -> Result<&'static [u8], BackendError> {
    static COMPILED: Mutex<Vec<(Option<String>, &'static [u8])>> = Mutex::new(Vec::new());
    let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, code)) = compiled.iter().find(|(a, _)| a.as_deref() == arch) {
        return Ok(code);
    }
    let code: &'static [u8] = Box::leak(rtc()?.compile(crate::kernels::SOURCE, arch)?.into_boxed_slice());
    compiled.push((arch.map(str::to_owned), code));
    Ok(code)
}

/// `hipModuleLoadData` on a copy of `image` in 8-byte-aligned memory (an embedded slice has
/// byte alignment only), then every kernel of [`KERNEL_SYMBOLS`].
fn load_module(api: &HipApi, image: &[u8], origin: ModuleOrigin) -> Result<LoadedModule, BackendError> {
    let mut aligned = vec![0u64; image.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..image.len()].copy_from_slice(image);
    let mut module: Raw = std::ptr::null_mut();
    // SAFETY: `aligned` holds a complete code object and outlives the call (HIP copies it).
    api.check(unsafe { (api.module_load_data)(&mut module, aligned.as_ptr().cast()) }, "hipModuleLoadData")?;
    let mut functions = [std::ptr::null_mut(); KERNEL_SYMBOLS.len()];
    let looked_up = (|| {
        for (slot, symbol) in functions.iter_mut().zip(KERNEL_SYMBOLS) {
            let name =
                CString::new(symbol).map_err(|_| BackendError::MissingKernel { backend: KIND, symbol })?;
            // SAFETY: `module` was just loaded; `name` is a valid C string.
            let rc = unsafe { (api.module_get_function)(slot, module, name.as_ptr()) };
            if rc == HIP_ERROR_NOT_FOUND || (rc == HIP_SUCCESS && slot.is_null()) {
                return Err(BackendError::MissingKernel { backend: KIND, symbol });
            }
            api.check(rc, "hipModuleGetFunction")?;
        }
        Ok(())
    })();
    if let Err(e) = looked_up {
        // SAFETY: loaded above; no function of it was handed out.
        let _ = unsafe { (api.module_unload)(module) };
        return Err(e);
    }
    Ok(LoadedModule { functions, origin })
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Pick and load the module for the current device (see the module docs for the order).
fn choose_module(api: &HipApi, arch: Option<&str>) -> Result<LoadedModule, BackendError> {
    let processor = arch.map(|a| a.split(':').next().unwrap_or(a));
    let mut notes = Vec::new();
    if !env_flag("V4POOL_HIP_FORCE_HIPRTC") {
        for (object_arch, image) in embedded_code_objects() {
            if processor.is_some_and(|p| p != object_arch) {
                continue;
            }
            match load_module(api, image, ModuleOrigin::Embedded(object_arch)) {
                Ok(module) => return Ok(module),
                Err(e @ BackendError::MissingKernel { .. }) => return Err(e),
                Err(e) => notes.push(format!("embedded {object_arch}: {e}")),
            }
        }
    }
    // A failure here also reports why the embedded objects were passed over.
    let image = compiled_for(arch).map_err(|e| match e {
        BackendError::Compile { backend, log } if !notes.is_empty() => {
            BackendError::Compile { backend, log: format!("{}\n{log}", notes.join("\n")) }
        }
        BackendError::Unavailable { backend, reason } if !notes.is_empty() => {
            BackendError::Unavailable { backend, reason: format!("{}; {reason}", notes.join("; ")) }
        }
        other => other,
    })?;
    load_module(api, image, ModuleOrigin::Hiprtc(arch.map(str::to_owned)))
}

/// The module of device `ordinal`, loaded on first use and kept for the process.
fn module_for(api: &HipApi, ordinal: c_int, arch: Option<&str>) -> Result<Arc<LoadedModule>, BackendError> {
    static MODULES: Mutex<Vec<(c_int, Arc<LoadedModule>)>> = Mutex::new(Vec::new());
    let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = modules.iter().find(|(o, _)| *o == ordinal) {
        return Ok(Arc::clone(m));
    }
    let module = Arc::new(choose_module(api, arch)?);
    modules.push((ordinal, Arc::clone(&module)));
    Ok(module)
}

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
    staging: Mutex<Staging>,
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
pub fn device_count() -> Result<usize, BackendError> {
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
    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
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
        Ok(HipBackend { api, ordinal, name, arch, stream, module, staging: Mutex::new(Staging::default()) })
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
    pub fn event(&self) -> Result<HipEvent, BackendError> {
        self.bind()?;
        let mut event: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; default flags keep timing enabled.
        self.api.check(unsafe { (self.api.event_create)(&mut event) }, "hipEventCreate")?;
        Ok(HipEvent { api: self.api, ordinal: self.ordinal, own_stream: self.stream.0 as u64, event })
    }

    /// Make this backend's device current on the calling thread (HIP's current device is
    /// per thread, and the backend may be called from any thread).
    fn bind(&self) -> Result<(), BackendError> {
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

    fn sync_raw(&self, raw: Raw) -> Result<(), BackendError> {
        // SAFETY: `raw` is this backend's stream or one the caller owns.
        self.api.check(unsafe { (self.api.stream_synchronize)(raw) }, "hipStreamSynchronize")
    }
}

/// One pinned buffer and the event that marks its last copy done.
struct StagingBuffer {
    host: *mut u8,
    capacity: usize,
    event: Raw,
    /// A copy from it may still be running (until `event` completes).
    in_flight: bool,
    /// Upload counter when last used, to find the least recently used buffer.
    last_use: u64,
}

/// Pinned staging buffers for uploads: the source is copied into a free buffer, the device
/// copy is queued from there and an event marks when the buffer may be reused, so `upload`
/// never waits for the stream (unless every buffer is busy).
#[derive(Default)]
struct Staging {
    buffers: Vec<StagingBuffer>,
    uploads: u64,
}

// SAFETY: the pinned pointers and events are process-wide HIP objects, only touched under the
// backend's mutex.
unsafe impl Send for Staging {}

impl Staging {
    fn is_free(api: &HipApi, b: &mut StagingBuffer) -> Result<bool, BackendError> {
        if b.in_flight {
            // SAFETY: a live event.
            let rc = unsafe { (api.event_query)(b.event) };
            if rc == HIP_ERROR_NOT_READY {
                return Ok(false);
            }
            api.check(rc, "hipEventQuery")?;
            b.in_flight = false;
        }
        Ok(true)
    }

    fn allocate(api: &HipApi, capacity: usize) -> Result<StagingBuffer, BackendError> {
        let host_malloc = api.host_malloc.ok_or_else(|| unavailable("no hipHostMalloc"))?;
        let mut host: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags 0 = hipHostMallocDefault.
        let rc = unsafe { host_malloc(&mut host, capacity, 0) };
        if rc == HIP_ERROR_OUT_OF_MEMORY {
            let message = format!("pinned staging buffer: {}", api.message(rc));
            return Err(BackendError::OutOfMemory { backend: KIND, bytes: capacity as u64, message });
        }
        api.check(rc, "hipHostMalloc")?;
        let mut event: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a sync-only event needs no timing.
        let rc = unsafe { (api.event_create_with_flags)(&mut event, HIP_EVENT_DISABLE_TIMING) };
        if let Err(e) = api.check(rc, "hipEventCreateWithFlags") {
            // SAFETY: allocated just above, unused.
            let _ = unsafe { (api.host_free)(host) };
            return Err(e);
        }
        Ok(StagingBuffer { host: host.cast(), capacity, event, in_flight: false, last_use: 0 })
    }

    fn free(api: &HipApi, b: StagingBuffer) {
        // SAFETY: the buffer's event is complete or waited for here; both objects are ours
        // and released once.
        unsafe {
            if b.in_flight {
                let _ = (api.event_synchronize)(b.event);
            }
            let _ = (api.event_destroy)(b.event);
            let _ = (api.host_free)(b.host.cast());
        }
    }

    /// A buffer of at least `len` bytes no copy is using, by index.
    fn acquire(&mut self, api: &HipApi, len: usize) -> Result<usize, BackendError> {
        let mut best: Option<usize> = None;
        for i in 0..self.buffers.len() {
            let b = &mut self.buffers[i];
            if b.capacity >= len && Self::is_free(api, b)? {
                best = match best {
                    Some(j) if self.buffers[j].capacity <= self.buffers[i].capacity => Some(j),
                    _ => Some(i),
                };
            }
        }
        if let Some(i) = best {
            return Ok(i);
        }
        let capacity = len.next_power_of_two().max(STAGING_MIN_BYTES);
        if self.buffers.len() < STAGING_MAX_BUFFERS {
            self.buffers.push(Self::allocate(api, capacity)?);
            return Ok(self.buffers.len() - 1);
        }
        // Every buffer is busy or too small: replace the least recently used one.
        let lru = (0..self.buffers.len()).min_by_key(|&i| self.buffers[i].last_use).unwrap_or(0);
        let fresh = Self::allocate(api, capacity)?;
        let old = std::mem::replace(&mut self.buffers[lru], fresh);
        Self::free(api, old);
        Ok(lru)
    }

    /// # Safety
    /// `dst .. dst + src.len()` lies in a live device allocation; `stream` is live.
    unsafe fn upload(
        &mut self,
        api: &HipApi,
        dst: DevicePtr,
        src: &[u8],
        stream: Raw,
    ) -> Result<(), BackendError> {
        let i = self.acquire(api, src.len())?;
        self.uploads += 1;
        let b = &mut self.buffers[i];
        b.last_use = self.uploads;
        // SAFETY: the buffer holds `capacity >= src.len()` pinned bytes that no copy uses.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), b.host, src.len()) };
        // SAFETY: the caller's contract on `dst`; the pinned source stays untouched until the
        // event recorded next completes.
        let rc = unsafe { (api.memcpy_htod_async)(dst as Raw, b.host.cast(), src.len(), stream) };
        api.check(rc, "hipMemcpyHtoDAsync")?;
        b.in_flight = true;
        // SAFETY: a live event and stream.
        let rc = unsafe { (api.event_record)(b.event, stream) };
        if rc != HIP_SUCCESS {
            // Without the event the buffer's reuse cannot be ordered: wait for the copy.
            // SAFETY: a live stream.
            api.check(unsafe { (api.stream_synchronize)(stream) }, "hipStreamSynchronize")?;
            b.in_flight = false;
        }
        Ok(())
    }

    fn release(&mut self, api: &HipApi) {
        for b in self.buffers.drain(..) {
            Self::free(api, b);
        }
    }
}

/// A timing event; see [`HipBackend::event`].
pub struct HipEvent {
    api: &'static HipApi,
    ordinal: c_int,
    /// The creating backend's own stream, for `Stream::DEFAULT`.
    own_stream: u64,
    event: Raw,
}

// SAFETY: a hipEvent_t is usable from any thread once its device is made current.
unsafe impl Send for HipEvent {}
// SAFETY: as above.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    fn bind(&self) -> Result<(), BackendError> {
        // SAFETY: the ordinal was validated when the backend was created.
        self.api.check(unsafe { (self.api.set_device)(self.ordinal) }, "hipSetDevice")
    }

    /// Record at the current end of `stream`'s queue.
    pub fn record(&self, stream: Stream) -> Result<(), BackendError> {
        self.bind()?;
        let raw = if stream == Stream::DEFAULT { self.own_stream } else { stream.0 };
        // SAFETY: a live event; the stream is the backend's or the caller's.
        self.api.check(unsafe { (self.api.event_record)(self.event, raw as Raw) }, "hipEventRecord")
    }

    /// Wait until the recorded work has run.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: a live event.
        self.api.check(unsafe { (self.api.event_synchronize)(self.event) }, "hipEventSynchronize")
    }

    /// Milliseconds from this event to `end` (waits for `end`).
    pub fn elapsed_ms(&self, end: &HipEvent) -> Result<f32, BackendError> {
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

fn device_name(api: &HipApi, ordinal: c_int) -> Result<String, BackendError> {
    let mut device: c_int = 0;
    // SAFETY: valid out-pointer, ordinal in range.
    api.check(unsafe { (api.device_get)(&mut device, ordinal) }, "hipDeviceGet")?;
    let mut name = [0u8; 256];
    // SAFETY: the buffer's length is passed; HIP NUL-terminates within it.
    api.check(
        unsafe { (api.device_get_name)(name.as_mut_ptr().cast(), name.len() as c_int, device) },
        "hipDeviceGetName",
    )?;
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).trim().to_owned())
}

fn usize_len(bytes: u64, kernel: &'static str) -> Result<usize, BackendError> {
    usize::try_from(bytes).map_err(|_| BackendError::InvalidLaunch {
        kernel,
        reason: format!("{bytes} bytes do not fit this host's size_t"),
    })
}

impl Drop for HipBackend {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; HIP frees the stream once its work is done.
        let _ = self.bind();
        let staging = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
        staging.release(self.api);
        // SAFETY: the backend's own stream, destroyed once.
        let _ = unsafe { (self.api.stream_destroy)(self.stream.0) };
    }
}

impl Backend for HipBackend {
    fn kind(&self) -> BackendKind {
        KIND
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn alloc_zeroed(&self, bytes: u64) -> Result<DeviceAllocation, BackendError> {
        self.bind()?;
        // hipMalloc(0) returns null; a 256-byte minimum keeps every allocation a real address.
        let size = usize_len(bytes.max(256), "alloc_zeroed")?;
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

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let raw = self.resolve(stream);
        if src.len() <= STAGING_MAX_BYTES && self.api.host_malloc.is_some() {
            let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the caller's contract on `dst`; `raw` is a live stream.
            return unsafe { staging.upload(self.api, dst, src, raw) };
        }
        // SAFETY: the caller promises `dst` covers `src.len()` bytes; HIP only reads `src`.
        let rc = unsafe { (self.api.memcpy_htod_async)(dst as Raw, src.as_ptr() as Raw, src.len(), raw) };
        self.api.check(rc, "hipMemcpyHtoDAsync")?;
        // HIP does not promise that an async copy from pageable memory has read `src` when it
        // returns; waiting is what lets us return "src may be reused".
        self.sync_raw(raw)
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> Result<(), BackendError> {
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
        let len = usize_len(bytes, "copy")?;
        self.bind()?;
        // SAFETY: the caller promises both ranges are live and disjoint.
        let rc = unsafe { (self.api.memcpy_dtod_async)(dst as Raw, src as Raw, len, self.resolve(stream)) };
        self.api.check(rc, "hipMemcpyDtoDAsync")
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
        if dst % 4 != 0 {
            return Err(BackendError::InvalidLaunch {
                kernel: "fill_u32",
                reason: format!("destination {dst:#x} is not 4-byte aligned"),
            });
        }
        let count = usize_len(count, "fill_u32")?;
        self.bind()?;
        // hipMemsetD32Async takes the word as an int: same bits.
        let word = c_int::from_ne_bytes(value.to_ne_bytes());
        // SAFETY: the caller promises `dst .. dst + 4 * count` is live.
        let rc = unsafe { (self.api.memset_d32_async)(dst as Raw, word, count, self.resolve(stream)) };
        self.api.check(rc, "hipMemsetD32Async")
    }

    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> Result<(), BackendError> {
        let symbol = launch.symbol();
        let index = KERNEL_SYMBOLS
            .iter()
            .position(|s| *s == symbol)
            .ok_or(BackendError::MissingKernel { backend: KIND, symbol })?;
        check_launch(launch)
            .map_err(|e| BackendError::InvalidLaunch { kernel: symbol, reason: e.to_string() })?;
        // Every dimension is >= 1: a launch with no work is one block that returns at once.
        let LaunchShape { grid, block } = launch_shape(launch);
        self.bind()?;
        // The kernel's single by-value parameter: kernelParams = [&args].
        let args: *mut c_void = match launch {
            Launch::Decode(a) => a as *const _ as Raw,
            Launch::Prefill(a) => a as *const _ as Raw,
            Launch::HcaOffsets(a) => a as *const _ as Raw,
            Launch::CsaPack(a) => a as *const _ as Raw,
            Launch::RingWrite(a) => a as *const _ as Raw,
            Launch::RowScatter(a) => a as *const _ as Raw,
            Launch::FillRuns(a) => a as *const _ as Raw,
            Launch::CopyRuns(a) => a as *const _ as Raw,
            Launch::Empty => std::ptr::null_mut(),
        };
        let mut params = [args];
        let params_ptr = if args.is_null() { std::ptr::null_mut() } else { params.as_mut_ptr() };
        // SAFETY: the function belongs to the loaded module; `params` points at the `#[repr(C)]`
        // argument struct the kernel declares, alive until the call returns (HIP copies
        // arguments at launch); the caller promises the pointers inside it are valid.
        let rc = unsafe {
            (self.api.module_launch_kernel)(
                self.module.functions[index],
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                0,
                self.resolve(stream),
                params_ptr,
                std::ptr::null_mut(),
            )
        };
        self.api.check(rc, "hipModuleLaunchKernel")
    }

    fn synchronize(&self, stream: Stream) -> Result<(), BackendError> {
        self.bind()?;
        self.sync_raw(self.resolve(stream))
    }
}

/// roctx ranges (the `profiling` feature): `librocprofiler-sdk-roctx.so`, else the older
/// `libroctx64.so`, opened on first use; without either (or without the feature) a no-op.
#[cfg(feature = "profiling")]
mod roctx {
    use super::{open_first, sym};
    use libloading::Library;
    use std::ffi::{c_char, c_int, CString};
    use std::sync::OnceLock;

    pub(super) struct Roctx {
        pub push: unsafe extern "C" fn(*const c_char) -> c_int,
        pub pop: unsafe extern "C" fn() -> c_int,
        _lib: Library,
    }

    pub(super) fn get() -> Option<&'static Roctx> {
        static ROCTX: OnceLock<Option<Roctx>> = OnceLock::new();
        ROCTX
            .get_or_init(|| {
                let lib = open_first(&[
                    "librocprofiler-sdk-roctx.so",
                    "librocprofiler-sdk-roctx.so.1",
                    "libroctx64.so",
                    "libroctx64.so.4",
                ])
                .ok()?;
                // SAFETY: `int roctxRangePushA(const char*)` and `int roctxRangePop(void)`
                // per roctx.h; the table owns `lib`.
                unsafe {
                    Some(Roctx {
                        push: sym(&lib, "roctxRangePushA").ok()?,
                        pop: sym(&lib, "roctxRangePop").ok()?,
                        _lib: lib,
                    })
                }
            })
            .as_ref()
    }

    /// The name up to its first NUL (a range name is display text).
    pub(super) fn c_name(name: &str) -> CString {
        let cut = name.split('\0').next().unwrap_or("");
        CString::new(cut).unwrap_or_default()
    }
}

/// Hand roctx to [`crate::profiling`] so pool ranges reach it too (once; a no-op without the
/// `profiling` feature or without a roctx library).
fn install_profiling_hooks() {
    #[cfg(feature = "profiling")]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if let Some(r) = roctx::get() {
                // SAFETY: both pointers come from the roctx library, which the static table
                // keeps loaded for the rest of the process; signatures as roctx.h declares.
                unsafe { crate::profiling::install_roctx_hooks(r.push, r.pop) };
            }
        });
    }
}

/// Open a roctx range named `name` (no-op without the `profiling` feature or roctx).
#[inline]
pub fn roctx_push(name: &str) {
    #[cfg(feature = "profiling")]
    if let Some(r) = roctx::get() {
        let name = roctx::c_name(name);
        // SAFETY: a valid C string; roctx copies it.
        let _ = unsafe { (r.push)(name.as_ptr()) };
    }
    #[cfg(not(feature = "profiling"))]
    let _ = name;
}

/// Close the innermost roctx range (no-op without the `profiling` feature or roctx).
#[inline]
pub fn roctx_pop() {
    #[cfg(feature = "profiling")]
    if let Some(r) = roctx::get() {
        // SAFETY: plain C call; popping with no open range returns an error code, no UB.
        let _ = unsafe { (r.pop)() };
    }
}

#[cfg(test)]
mod tests {
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
