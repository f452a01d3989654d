//! Kernel images and per-device state: the module is loaded once per device and kept for
//! the life of the process (its primary context stays retained, so the handles never go
//! stale) — the embedded sm_90 cubin when the device is a 9.x part, else the embedded PTX
//! (JIT by the driver), else NVRTC compiles the embedded source for the device's
//! architecture (once per architecture).

use super::driver::{check, device_count, driver_ready, unavailable};
use super::KIND;
use crate::backend::{BackendError, BackendResult};
use crate::index::Launch;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

/// Where the loaded module came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleSource {
    /// The embedded sm_90 cubin.
    Cubin,
    /// The embedded PTX, JIT-compiled by the driver.
    Ptx,
    /// The embedded CUDA source, compiled at run time by NVRTC for `arch` (e.g. 90).
    Nvrtc {
        /// Compute capability as `major * 10 + minor`.
        arch: u32,
    },
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
fn nvrtc_ptx(source: &str, arch: u32) -> BackendResult<Arc<Vec<u8>>> {
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

/// What one device contributes, shared by every backend on it: the primary context
/// (retained for the process), the module and its kernels.
pub(super) struct Device {
    pub(super) ordinal: i32,
    pub(super) ctx: sys::CUcontext,
    pub(super) name: String,
    pub(super) cc: (i32, i32),
    /// The module, or why it could not be loaded (kept so every launch reports it).
    pub(super) module: Result<LoadedModule, String>,
}

pub(super) struct LoadedModule {
    pub(super) source: ModuleSource,
    /// Parallel to `Launch::SYMBOLS`; `None` when the module lacks the symbol.
    pub(super) functions: Vec<Option<sys::CUfunction>>,
}

// SAFETY: the handles are driver objects usable from any thread once the context is
// current; nothing here is mutated after construction.
unsafe impl Send for Device {}
// SAFETY: as above; all fields are read-only after construction.
unsafe impl Sync for Device {}

pub(super) fn device(ordinal: i32) -> BackendResult<Arc<Device>> {
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

fn open_device(ordinal: i32) -> BackendResult<Device> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: driver initialised; ordinal checked against the count; out-pointer valid.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
    let mut name_buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer is 256 bytes and the driver writes at most `len` bytes, NUL included.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), 256, dev) })?;
    // SAFETY: the driver NUL-terminated the name inside the buffer.
    let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }.to_string_lossy().into_owned();
    let attr = |a: sys::CUdevice_attribute, call: &'static str| -> BackendResult<i32> {
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
pub(super) fn load_image(source: ModuleSource) -> BackendResult<sys::CUmodule> {
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
pub(super) fn candidates(cc: (i32, i32)) -> Vec<ModuleSource> {
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
fn load_module(cc: (i32, i32)) -> BackendResult<LoadedModule> {
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
unsafe fn module_from_image(image: *const c_void) -> BackendResult<sys::CUmodule> {
    let mut m: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the caller's contract; `m` is a valid out-pointer.
    check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut m, image) })?;
    Ok(m)
}

pub(super) fn resolve(module: sys::CUmodule, source: ModuleSource) -> BackendResult<LoadedModule> {
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
