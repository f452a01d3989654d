//! Which code runs on a device: its arch string, the embedded code objects, hiprtc, and the
//! module loaded once per device per process.

use super::api::{rtc, HipApi};
use super::{
    Raw, DEVICE_PROP_BUFFER_BYTES, GCN_ARCH_NAME_LEN, GCN_ARCH_NAME_OFFSET, HIP_ERROR_NOT_FOUND, HIP_SUCCESS,
    KERNEL_SYMBOLS, KIND,
};
use crate::backend::{BackendError, BackendResult};
use std::ffi::{c_int, CString};
use std::sync::{Arc, Mutex};

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
pub(super) fn device_arch(api: &HipApi, ordinal: c_int) -> Option<String> {
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
pub(super) struct LoadedModule {
    pub(super) functions: [Raw; KERNEL_SYMBOLS.len()],
    pub(super) origin: ModuleOrigin,
}

// SAFETY: hipModule_t/hipFunction_t handles are process-wide and HIP calls on them are
// thread-safe; the module is never unloaded, so the handles stay valid.
unsafe impl Send for LoadedModule {}
// SAFETY: as above; the handles are only read.
unsafe impl Sync for LoadedModule {}

/// Code objects compiled by hiprtc, once per arch per process (leaked: a handful at most).
fn compiled_for(arch: Option<&str>) -> BackendResult<&'static [u8]> {
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
fn load_module(api: &HipApi, image: &[u8], origin: ModuleOrigin) -> BackendResult<LoadedModule> {
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
fn choose_module(api: &HipApi, arch: Option<&str>) -> BackendResult<LoadedModule> {
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
pub(super) fn module_for(
    api: &HipApi,
    ordinal: c_int,
    arch: Option<&str>,
) -> BackendResult<Arc<LoadedModule>> {
    static MODULES: Mutex<Vec<(c_int, Arc<LoadedModule>)>> = Mutex::new(Vec::new());
    let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = modules.iter().find(|(o, _)| *o == ordinal) {
        return Ok(Arc::clone(m));
    }
    let module = Arc::new(choose_module(api, arch)?);
    modules.push((ordinal, Arc::clone(&module)));
    Ok(module)
}

/// The device's marketing name (e.g. "AMD Instinct MI300X").
pub(super) fn device_name(api: &HipApi, ordinal: c_int) -> BackendResult<String> {
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
