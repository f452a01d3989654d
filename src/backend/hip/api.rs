//! The HIP runtime and hiprtc, opened at run time with `libloading` (nothing of ROCm is
//! linked), and the pinned staging ring's driver calls.

use super::{HipErr, Raw, HIP_ERROR_OUT_OF_MEMORY, HIP_EVENT_DISABLE_TIMING, HIP_SUCCESS, KIND};
use crate::backend::staging::StagingDriver;
use crate::backend::{BackendError, BackendResult};
use crate::index::DevicePtr;
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

/// Candidate names of a library: `$ROCM_PATH/lib`, `$HIP_PATH/lib`, the loader's own search
/// path (which `ldconfig` entries of a ROCm install cover), then `/opt/rocm/lib`.
pub(super) fn library_candidates(stems: &[&str]) -> Vec<String> {
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

pub(super) fn open_first(stems: &[&str]) -> Result<Library, String> {
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

/// `V4POOL_HIP_RUNTIME`: the one file to open as the HIP runtime instead of searching for
/// libamdhip64 (a ROCm install elsewhere, or the project's runtime double of
/// `tests/hip_double/`). Unset or empty: the search of [`library_candidates`].
pub(super) const RUNTIME_ENV: &str = "V4POOL_HIP_RUNTIME";

fn runtime_override() -> Option<String> {
    std::env::var(RUNTIME_ENV).ok().filter(|p| !p.is_empty())
}

/// Open `path` and nothing else: a named runtime that fails to load is reported, never
/// replaced by another one found on the search path.
fn open_exactly(path: &str) -> Result<Library, String> {
    // SAFETY: opening a library runs its initialisers; the user named this file as the HIP
    // runtime.
    unsafe { Library::new(path) }.map_err(|e| format!("{RUNTIME_ENV}={path} could not be loaded: {e}"))
}

/// Copy a function pointer out of `lib`.
///
/// # Safety
/// `T` must be the exact C signature of `name`, and the pointer must not outlive `lib`.
pub(super) unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    // SAFETY: forwarded to the caller (signature and lifetime).
    unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("{name}: {e}"))
}

/// The HIP runtime functions the backend calls, resolved once per process.
pub(super) struct HipApi {
    pub(super) init: unsafe extern "C" fn(c_uint) -> HipErr,
    pub(super) get_device_count: unsafe extern "C" fn(*mut c_int) -> HipErr,
    pub(super) set_device: unsafe extern "C" fn(c_int) -> HipErr,
    pub(super) device_get: unsafe extern "C" fn(*mut c_int, c_int) -> HipErr,
    pub(super) device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipErr,
    pub(super) get_device_properties_r0600: Option<unsafe extern "C" fn(*mut c_void, c_int) -> HipErr>,
    pub(super) malloc: unsafe extern "C" fn(*mut Raw, usize) -> HipErr,
    pub(super) free: unsafe extern "C" fn(Raw) -> HipErr,
    pub(super) memset_async: unsafe extern "C" fn(Raw, c_int, usize, Raw) -> HipErr,
    pub(super) memset_d32_async: unsafe extern "C" fn(Raw, c_int, usize, Raw) -> HipErr,
    pub(super) memcpy_htod_async: unsafe extern "C" fn(Raw, Raw, usize, Raw) -> HipErr,
    pub(super) memcpy_dtoh_async: unsafe extern "C" fn(Raw, Raw, usize, Raw) -> HipErr,
    pub(super) memcpy_dtod_async: unsafe extern "C" fn(Raw, Raw, usize, Raw) -> HipErr,
    pub(super) stream_create_with_flags: unsafe extern "C" fn(*mut Raw, c_uint) -> HipErr,
    pub(super) stream_destroy: unsafe extern "C" fn(Raw) -> HipErr,
    pub(super) stream_synchronize: unsafe extern "C" fn(Raw) -> HipErr,
    pub(super) module_load_data: unsafe extern "C" fn(*mut Raw, *const c_void) -> HipErr,
    pub(super) module_get_function: unsafe extern "C" fn(*mut Raw, Raw, *const c_char) -> HipErr,
    pub(super) module_unload: unsafe extern "C" fn(Raw) -> HipErr,
    #[allow(clippy::type_complexity)]
    pub(super) module_launch_kernel: unsafe extern "C" fn(
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
    pub(super) get_error_string: unsafe extern "C" fn(HipErr) -> *const c_char,
    pub(super) event_create: unsafe extern "C" fn(*mut Raw) -> HipErr,
    pub(super) event_create_with_flags: unsafe extern "C" fn(*mut Raw, c_uint) -> HipErr,
    pub(super) event_query: unsafe extern "C" fn(Raw) -> HipErr,
    /// `hipHostMalloc`, or `hipHostAlloc` where a later ROCm dropped the former; without
    /// either, uploads are pageable copies followed by a wait.
    pub(super) host_malloc: Option<unsafe extern "C" fn(*mut Raw, usize, c_uint) -> HipErr>,
    pub(super) host_free: unsafe extern "C" fn(Raw) -> HipErr,
    pub(super) event_record: unsafe extern "C" fn(Raw, Raw) -> HipErr,
    pub(super) event_synchronize: unsafe extern "C" fn(Raw) -> HipErr,
    pub(super) event_elapsed_time: unsafe extern "C" fn(*mut f32, Raw, Raw) -> HipErr,
    pub(super) event_destroy: unsafe extern "C" fn(Raw) -> HipErr,
    /// Keeps every pointer above valid; never dropped (the table lives in a static).
    pub(super) _lib: Library,
}

impl HipApi {
    fn load() -> Result<HipApi, String> {
        let lib = match runtime_override() {
            Some(path) => open_exactly(&path)?,
            None => {
                open_first(&["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"])?
            }
        };
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

    pub(super) fn message(&self, code: HipErr) -> String {
        // SAFETY: hipGetErrorString accepts any value and returns a static string (or null).
        let text = unsafe { (self.get_error_string)(code) };
        if text.is_null() {
            return format!("hipError {code}");
        }
        // SAFETY: non-null, NUL-terminated and static per the HIP documentation.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{text} (hipError {code})")
    }

    pub(super) fn check(&self, code: HipErr, call: &'static str) -> BackendResult<()> {
        if code == HIP_SUCCESS {
            Ok(())
        } else {
            Err(BackendError::Driver { backend: KIND, call, message: self.message(code) })
        }
    }
}

pub(super) fn unavailable(reason: impl Into<String>) -> BackendError {
    BackendError::Unavailable { backend: KIND, reason: reason.into() }
}

pub(super) fn api() -> BackendResult<&'static HipApi> {
    static API: OnceLock<Result<HipApi, String>> = OnceLock::new();
    API.get_or_init(HipApi::load).as_ref().map_err(|e| unavailable(e.clone()))
}

/// `hipInit` and the device count; `Unavailable` when there is no runtime, driver or GPU.
pub(super) fn init_and_count() -> BackendResult<(&'static HipApi, c_int)> {
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
pub(super) struct RtcApi {
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
        // ROCm 5 shipped hiprtc inside libamdhip64: the runtime named by V4POOL_HIP_RUNTIME
        // takes that place when no libhiprtc is found.
        let stems = ["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5", "libamdhip64.so"];
        let lib = match runtime_override() {
            Some(path) => {
                open_first(&stems[..4]).or_else(|e| open_exactly(&path).map_err(|e2| format!("{e}; {e2}")))?
            }
            None => open_first(&stems)?,
        };
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

    fn check(&self, code: c_int, call: &'static str) -> BackendResult<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(BackendError::Driver { backend: KIND, call, message: self.message(code) })
        }
    }

    /// Compile `source` for `arch` (`None`: hiprtc's default, the current device).
    pub(super) fn compile(&self, source: &str, arch: Option<&str>) -> BackendResult<Vec<u8>> {
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

    fn compile_created(&self, program: Raw, options: &[*const c_char]) -> BackendResult<Vec<u8>> {
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

    fn log(&self, program: Raw) -> BackendResult<String> {
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

pub(super) fn rtc() -> BackendResult<&'static RtcApi> {
    static RTC: OnceLock<Result<RtcApi, String>> = OnceLock::new();
    RTC.get_or_init(RtcApi::load).as_ref().map_err(|e| unavailable(format!("hiprtc: {e}")))
}

/// Compile the embedded kernel source ([`crate::kernels::SOURCE`]) with hiprtc for `arch`
/// (e.g. `gfx942`; `None`: hiprtc's default, the current device), returning the code object.
/// Needs only the hiprtc library, not a GPU. [`BackendError::Unavailable`] without hiprtc.
pub fn hiprtc_compile(arch: Option<&str>) -> BackendResult<Vec<u8>> {
    hiprtc_compile_source(crate::kernels::SOURCE, arch)
}

/// [`hiprtc_compile`] for any source (tests use a broken one to see the log come back).
pub fn hiprtc_compile_source(source: &str, arch: Option<&str>) -> BackendResult<Vec<u8>> {
    rtc()?.compile(source, arch)
}

/// The staging ring's driver calls on the HIP runtime (only built when `hipHostMalloc` exists;
/// see [`HipApi::host_malloc`]). Every call runs with the backend's device current.
pub(super) struct HipStaging(pub(super) &'static HipApi);

impl StagingDriver for HipStaging {
    type Event = Raw;
    type Stream = Raw;

    fn alloc_pinned(&self, bytes: usize) -> BackendResult<*mut u8> {
        let api = self.0;
        let host_malloc = api.host_malloc.ok_or_else(|| unavailable("no hipHostMalloc"))?;
        let mut host: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags 0 = hipHostMallocDefault.
        let rc = unsafe { host_malloc(&mut host, bytes, 0) };
        if rc == HIP_ERROR_OUT_OF_MEMORY {
            let message = format!("pinned staging buffer: {}", api.message(rc));
            return Err(BackendError::OutOfMemory { backend: KIND, bytes: bytes as u64, message });
        }
        api.check(rc, "hipHostMalloc")?;
        Ok(host.cast())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) -> BackendResult<()> {
        // SAFETY: the caller's contract: our pinned buffer, no copy still reads it.
        self.0.check(unsafe { (self.0.host_free)(ptr.cast()) }, "hipHostFree")
    }

    fn create_event(&self) -> BackendResult<Raw> {
        let mut event: Raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a sync-only event needs no timing.
        let rc = unsafe { (self.0.event_create_with_flags)(&mut event, HIP_EVENT_DISABLE_TIMING) };
        self.0.check(rc, "hipEventCreateWithFlags")?;
        Ok(event)
    }

    unsafe fn destroy_event(&self, event: Raw) {
        // SAFETY: the caller's contract: a live event, not used after.
        let _ = unsafe { (self.0.event_destroy)(event) };
    }

    unsafe fn event_done(&self, event: Raw) -> bool {
        // SAFETY: the caller's contract: a live event.
        let rc = unsafe { (self.0.event_query)(event) };
        // hipErrorNotReady and failures alike are "not yet"; a later wait reports a failure.
        rc == HIP_SUCCESS
    }

    unsafe fn wait_event(&self, event: Raw) -> BackendResult<()> {
        // SAFETY: the caller's contract: a live event.
        self.0.check(unsafe { (self.0.event_synchronize)(event) }, "hipEventSynchronize")
    }

    unsafe fn record(&self, event: Raw, stream: Raw) -> BackendResult<()> {
        // SAFETY: the caller's contract: live event and stream.
        self.0.check(unsafe { (self.0.event_record)(event, stream) }, "hipEventRecord")
    }

    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Raw,
    ) -> BackendResult<()> {
        // SAFETY: the caller's contract on both ranges and the stream.
        let rc = unsafe { (self.0.memcpy_htod_async)(dst as Raw, src.cast_mut().cast(), len, stream) };
        self.0.check(rc, "hipMemcpyHtoDAsync")
    }

    unsafe fn sync_stream(&self, stream: Raw) -> BackendResult<()> {
        // SAFETY: the caller's contract: a live stream.
        self.0.check(unsafe { (self.0.stream_synchronize)(stream) }, "hipStreamSynchronize")
    }
}
