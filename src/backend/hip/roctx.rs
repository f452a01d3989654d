//! Profiler ranges on HIP (roctx), and the hook that routes [`crate::profiling`] ranges there.

/// `libroctx64.so`, opened on first use; without either (or without the feature) a no-op.
#[cfg(feature = "profiling")]
mod roctx {
    use super::super::api::{open_first, sym};
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
pub(super) fn install_profiling_hooks() {
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
