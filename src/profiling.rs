//! Profiler ranges around pool operations: NVTX on CUDA, roctx on HIP; a no-op when the
//! `profiling` feature is off (the guard is then an empty struct and every call inlines away).
//!
//! ```
//! let _r = v4pool::raw::profiling::range("pool.decode_indices");
//! // ... the work the range covers; it ends when `_r` drops.
//! ```
//!
//! With the feature on, the first range decides where ranges go, once per process:
//!
//! 1. **NVTX injection** (`NVTX_INJECTION64_PATH` names a tool library: Nsight Systems and
//!    Nsight Compute set it when they launch the process). CUDA 13 ships no
//!    libnvToolsExt — NVTX v3 is header-only and the header talks to the tool directly — so
//!    this module does what the header does: it opens the library, calls its
//!    `InitializeInjectionNvtx2` with an export table, and the tool fills in the core
//!    module's `nvtxRangePushA` / `nvtxRangePop` slots.
//! 2. **libnvToolsExt.so.1** (CUDA 12 and older), whose `nvtxRangePushA` / `nvtxRangePop`
//!    forward to whatever tool is attached.
//! 3. Nothing: ranges are no-ops.
//!
//! roctx (HIP) ranges are pushed through [`install_roctx_hooks`], which the HIP backend
//! calls once it has opened `librocprofiler-sdk-roctx.so` / `libroctx64.so`; both kinds of
//! range are pushed when both are present.
//!
//! What is verified: the NVTX protocol follows the NVTX v3 header's layout (export table
//! ids, module ids, core callback ids); with no tool attached every path is a no-op. That an
//! Nsight tool actually shows the ranges has not been observed on the H200 (nsys there
//! produces no reports).

use std::ffi::{c_char, c_int};

/// `int (*)(const char*)`: the signature of both `nvtxRangePushA` and `roctxRangePushA`.
pub type RangePushFn = unsafe extern "C" fn(*const c_char) -> c_int;
/// `int (*)(void)`: the signature of both `nvtxRangePop` and `roctxRangePop`.
pub type RangePopFn = unsafe extern "C" fn() -> c_int;

/// Ends its range when dropped. Zero-sized with the feature off.
#[must_use = "the range ends when the guard drops"]
pub struct RangeGuard {
    #[cfg(feature = "profiling")]
    pushed: imp::Pushed,
}

/// Open a named range on this thread; it closes when the returned guard drops.
#[inline]
pub fn range(name: &str) -> RangeGuard {
    #[cfg(feature = "profiling")]
    {
        RangeGuard { pushed: imp::push(name) }
    }
    #[cfg(not(feature = "profiling"))]
    {
        let _ = name;
        RangeGuard {}
    }
}

impl Drop for RangeGuard {
    #[inline]
    fn drop(&mut self) {
        #[cfg(feature = "profiling")]
        imp::pop(&self.pushed);
    }
}

/// **Hook for the HIP backend**: route ranges to roctx as well. Call once with
/// `roctxRangePushA` / `roctxRangePop` from the loaded roctx library (which must then stay
/// loaded for the process). Later calls are ignored; a no-op with the feature off.
///
/// # Safety
/// Both functions must stay callable for the rest of the process and have the C signatures
/// of `roctxRangePushA` / `roctxRangePop`.
pub unsafe fn install_roctx_hooks(push: RangePushFn, pop: RangePopFn) {
    #[cfg(feature = "profiling")]
    imp::install_roctx(push, pop);
    #[cfg(not(feature = "profiling"))]
    let _ = (push, pop);
}

/// Where ranges go in this process: "nvtx-injection", "libnvToolsExt", "roctx", several
/// joined by '+', or "none" (always "none" with the feature off).
pub fn sink() -> String {
    #[cfg(feature = "profiling")]
    {
        imp::sink()
    }
    #[cfg(not(feature = "profiling"))]
    {
        "none".to_string()
    }
}

#[cfg(feature = "profiling")]
mod imp {
    use super::{RangePopFn, RangePushFn};
    use std::ffi::{c_uint, c_void, CString};
    use std::sync::atomic::{AtomicPtr, Ordering};
    use std::sync::OnceLock;

    /// Which sinks a guard pushed to, so its drop pops exactly those.
    pub struct Pushed {
        nvtx: bool,
        roctx: bool,
    }

    #[derive(Clone, Copy)]
    struct Hooks {
        push: RangePushFn,
        pop: RangePopFn,
        what: &'static str,
    }

    static NVTX: OnceLock<Option<Hooks>> = OnceLock::new();
    static ROCTX: OnceLock<Hooks> = OnceLock::new();

    pub fn install_roctx(push: RangePushFn, pop: RangePopFn) {
        let _ = ROCTX.set(Hooks { push, pop, what: "roctx" });
    }

    pub fn sink() -> String {
        let parts: Vec<&str> =
            [nvtx().map(|h| h.what), ROCTX.get().map(|h| h.what)].into_iter().flatten().collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("+")
        }
    }

    fn nvtx() -> Option<Hooks> {
        *NVTX.get_or_init(|| load_injection().or_else(load_libnvtoolsext))
    }

    pub fn push(name: &str) -> Pushed {
        let (nvtx, roctx) = (nvtx(), ROCTX.get().copied());
        if nvtx.is_none() && roctx.is_none() {
            return Pushed { nvtx: false, roctx: false };
        }
        // A name with an interior NUL is cut there rather than dropped.
        let cut = name.split('\0').next().unwrap_or("");
        let Ok(c) = CString::new(cut) else {
            return Pushed { nvtx: false, roctx: false };
        };
        for h in [nvtx, roctx].into_iter().flatten() {
            // SAFETY: the hook has the C signature `int(const char*)` (checked when it was
            // installed) and copies the string before returning; `c` outlives the call.
            unsafe { (h.push)(c.as_ptr()) };
        }
        Pushed { nvtx: nvtx.is_some(), roctx: roctx.is_some() }
    }

    pub fn pop(p: &Pushed) {
        let hooks = [p.nvtx.then(nvtx).flatten(), p.roctx.then(|| ROCTX.get().copied()).flatten()];
        for h in hooks.into_iter().flatten() {
            // SAFETY: `int(void)`, installed for the life of the process.
            unsafe { (h.pop)() };
        }
    }

    // ---- NVTX v3 injection (the protocol of nvtxDetail/nvtxInit.h) -----------------

    /// `NVTX_ETID_CALLBACKS` and `NVTX_ETID_VERSIONINFO`.
    const ETID_CALLBACKS: u32 = 1;
    const ETID_VERSIONINFO: u32 = 3;
    /// Callback-table sizes of modules 1..=6: CORE, CUDA, OPENCL, CUDART, CORE2, SYNC.
    const MODULE_SIZES: [usize; 6] = [16, 9, 15, 7, 16, 7];
    const SLOT_COUNT: usize = 16 + 9 + 15 + 7 + 16 + 7;
    /// Core module ids of `nvtxRangePushA` and `nvtxRangePop` (`NVTX_CBID_CORE_*`).
    const CORE_RANGE_PUSH_A: usize = 9;
    const CORE_RANGE_POP: usize = 11;
    const NVTX_VERSION: u32 = 3;

    #[repr(C)]
    struct ExportTableCallbacks {
        struct_size: usize,
        get_module_function_table:
            unsafe extern "C" fn(c_uint, *mut *mut *mut *mut c_void, *mut c_uint) -> i32,
    }

    #[repr(C)]
    struct ExportTableVersionInfo {
        struct_size: usize,
        version: u32,
        reserved0: u32,
        set_injection_nvtx_version: unsafe extern "C" fn(u32),
    }

    static CALLBACKS: ExportTableCallbacks = ExportTableCallbacks {
        struct_size: std::mem::size_of::<ExportTableCallbacks>(),
        get_module_function_table,
    };
    static VERSION_INFO: ExportTableVersionInfo = ExportTableVersionInfo {
        struct_size: std::mem::size_of::<ExportTableVersionInfo>(),
        version: NVTX_VERSION,
        reserved0: 0,
        set_injection_nvtx_version,
    };

    /// Pointers to the function-pointer slots the tool writes (all modules back to back),
    /// handed out as each module's table. Slots and table are leaked once: the tool may keep
    /// the addresses for the life of the process.
    static SLOT_PTRS: AtomicPtr<*mut *mut c_void> = AtomicPtr::new(std::ptr::null_mut());

    unsafe extern "C" fn set_injection_nvtx_version(_version: u32) {}

    unsafe extern "C" fn get_module_function_table(
        module: c_uint,
        out_table: *mut *mut *mut *mut c_void,
        out_size: *mut c_uint,
    ) -> i32 {
        let index = module as usize;
        let ptrs = SLOT_PTRS.load(Ordering::Acquire);
        if index == 0 || index > MODULE_SIZES.len() || ptrs.is_null() {
            return 0;
        }
        let offset: usize = MODULE_SIZES[..index - 1].iter().sum();
        // SAFETY: `ptrs` holds SLOT_COUNT entries and `offset + size <= SLOT_COUNT`; the
        // out-pointers are the tool's, null-checked.
        unsafe {
            if !out_table.is_null() {
                *out_table = ptrs.add(offset);
            }
            if !out_size.is_null() {
                *out_size = MODULE_SIZES[index - 1] as c_uint;
            }
        }
        1
    }

    unsafe extern "C" fn get_export_table(etid: u32) -> *const c_void {
        match etid {
            ETID_CALLBACKS => (&CALLBACKS as *const ExportTableCallbacks).cast(),
            ETID_VERSIONINFO => (&VERSION_INFO as *const ExportTableVersionInfo).cast(),
            _ => std::ptr::null(),
        }
    }

    fn load_injection() -> Option<Hooks> {
        let path = std::env::var_os("NVTX_INJECTION64_PATH")?;
        // SAFETY: opening the profiler's own injection library, which it designed to be
        // loaded into the profiled process; its initialisers are the tool's.
        let lib = unsafe { libloading::Library::new(&path) }.ok()?;
        type Init = unsafe extern "C" fn(unsafe extern "C" fn(u32) -> *const c_void) -> i32;
        // SAFETY: the NVTX v3 entry point of an injection library has this signature.
        let init: Init = *unsafe { lib.get::<Init>(b"InitializeInjectionNvtx2\0") }.ok()?;
        let slots: &'static mut [*mut c_void] =
            Box::leak(vec![std::ptr::null_mut(); SLOT_COUNT].into_boxed_slice());
        let base = slots.as_mut_ptr();
        // SAFETY: `base .. base + SLOT_COUNT` is the leaked slice.
        let ptrs: Vec<*mut *mut c_void> = (0..SLOT_COUNT).map(|i| unsafe { base.add(i) }).collect();
        let ptrs: &'static mut [*mut *mut c_void] = Box::leak(ptrs.into_boxed_slice());
        SLOT_PTRS.store(ptrs.as_mut_ptr(), Ordering::Release);
        // SAFETY: the tables the tool may call back into are static or leaked; the library
        // stays loaded (leaked below) so what it writes stays callable.
        if unsafe { init(get_export_table) } != 1 {
            return None;
        }
        std::mem::forget(lib);
        // SAFETY: the slots are read after the tool's single-threaded initialisation.
        let (push, pop) = unsafe { (*base.add(CORE_RANGE_PUSH_A), *base.add(CORE_RANGE_POP)) };
        if push.is_null() || pop.is_null() {
            return None;
        }
        // SAFETY: the tool filled the core slots with its `nvtxRangePushA` / `nvtxRangePop`
        // implementations, which have these signatures.
        let (push, pop) = unsafe {
            (
                std::mem::transmute::<*mut c_void, RangePushFn>(push),
                std::mem::transmute::<*mut c_void, RangePopFn>(pop),
            )
        };
        Some(Hooks { push, pop, what: "nvtx-injection" })
    }

    fn load_libnvtoolsext() -> Option<Hooks> {
        // SAFETY: NVIDIA's NVTX v2 library; its initialisers only read the environment.
        let lib = unsafe { libloading::Library::new("libnvToolsExt.so.1") }.ok()?;
        // SAFETY: the exported NVTX C API has these signatures.
        let push: RangePushFn = *unsafe { lib.get::<RangePushFn>(b"nvtxRangePushA\0") }.ok()?;
        // SAFETY: as above.
        let pop: RangePopFn = *unsafe { lib.get::<RangePopFn>(b"nvtxRangePop\0") }.ok()?;
        // Kept loaded for the process: the function pointers above point into it.
        std::mem::forget(lib);
        Some(Hooks { push, pop, what: "libnvToolsExt" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicI32, Ordering};

    static DEPTH: AtomicI32 = AtomicI32::new(0);
    static PUSHES: AtomicI32 = AtomicI32::new(0);
    static BAD_NAMES: AtomicI32 = AtomicI32::new(0);

    unsafe extern "C" fn fake_push(name: *const c_char) -> c_int {
        // SAFETY: `range` passes a NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(name) };
        if !matches!(s.to_bytes(), b"test.outer" | b"test.inner") {
            BAD_NAMES.fetch_add(1, Ordering::SeqCst);
        }
        PUSHES.fetch_add(1, Ordering::SeqCst);
        DEPTH.fetch_add(1, Ordering::SeqCst)
    }

    unsafe extern "C" fn fake_pop() -> c_int {
        DEPTH.fetch_sub(1, Ordering::SeqCst)
    }

    #[test]
    fn ranges_nest_and_close() {
        // SAFETY: the fakes are plain functions with the roctx signatures.
        unsafe { install_roctx_hooks(fake_push, fake_pop) };
        {
            let _a = range("test.outer");
            let _b = range("test.inner\0cut");
        }
        assert_eq!(DEPTH.load(Ordering::SeqCst), 0, "every push is popped");
        assert_eq!(BAD_NAMES.load(Ordering::SeqCst), 0, "names arrive NUL-terminated, cut at a NUL");
        if cfg!(feature = "profiling") {
            assert_eq!(PUSHES.load(Ordering::SeqCst), 2);
            assert!(sink().contains("roctx"), "{}", sink());
        } else {
            assert_eq!(PUSHES.load(Ordering::SeqCst), 0, "a no-op with the feature off");
            assert_eq!(sink(), "none");
        }
    }
}
