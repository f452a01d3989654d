//! NIXL's C API as this crate declares it: the status and memory-type codes, the 1.5.x
//! agent-config struct, the function table resolved from `libnixl_capi.so` at run time, and
//! the loader and status checks every call goes through.
//!
//! Separate from the agent and the engine because this is the one place that must match the
//! library's ABI (pinned to 1.5.x, `docs/nixl.md`); everything above it is safe Rust over
//! this table.

use super::EngineError;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

pub(super) type Status = c_int;
pub(super) type Handle = *mut c_void;

pub(super) const SUCCESS: Status = 0;
pub(super) const IN_PROG: Status = 1;
pub(super) const MEM_DRAM: c_int = 0;
pub(super) const MEM_VRAM: c_int = 1;
/// `FILE_SEG`: a descriptor's address is a file offset and its device id the file descriptor
/// (the POSIX and GDS plugins).
pub(super) const MEM_FILE: c_int = 4;
pub(super) const XFER_READ: c_int = 0;
pub(super) const XFER_WRITE: c_int = 1;
/// The notification prefix of a posted ticket (`v4pool:<agent>:<ticket>`).
pub(super) const NOTIF_PREFIX: &str = "v4pool:";

/// `nixl_capi_agent_config_t` of NIXL 1.5.x (offsets checked against the 1.5.1 library's
/// reads: bools at 0 and 1, port at 4, sync mode at 8, delays at 16 and 24, telemetry at 32).
#[repr(C)]
pub(super) struct AgentConfig {
    pub(super) enable_prog_thread: bool,
    pub(super) enable_listen_thread: bool,
    pub(super) listen_port: c_int,
    pub(super) thread_sync: c_int,
    pub(super) num_workers: c_uint,
    pub(super) pthr_delay_us: u64,
    pub(super) lthr_delay_us: u64,
    pub(super) capture_telemetry: bool,
}

extern "C" {
    // NIXL 1.5.x hands out metadata buffers allocated with `malloc` and agent names with
    // `strdup`: the caller frees them with the C library's `free`.
    pub(super) fn free(p: *mut c_void);
}

pub(super) struct Nixl {
    _lib: libloading::Library,
    pub(super) is_stub: unsafe extern "C" fn() -> bool,
    pub(super) create_configured_agent:
        unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Handle) -> Status,
    pub(super) destroy_agent: unsafe extern "C" fn(Handle) -> Status,
    pub(super) get_local_md: unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> Status,
    pub(super) load_remote_md: unsafe extern "C" fn(Handle, *const c_void, usize, *mut *mut c_char) -> Status,
    pub(super) invalidate_remote_md: unsafe extern "C" fn(Handle, *const c_char) -> Status,
    pub(super) create_params: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(super) params_add: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> Status,
    pub(super) destroy_params: unsafe extern "C" fn(Handle) -> Status,
    pub(super) create_backend: unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> Status,
    pub(super) destroy_backend: unsafe extern "C" fn(Handle) -> Status,
    pub(super) create_opt_args: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(super) destroy_opt_args: unsafe extern "C" fn(Handle) -> Status,
    pub(super) opt_args_add_backend: unsafe extern "C" fn(Handle, Handle) -> Status,
    pub(super) opt_args_set_notif_msg: unsafe extern "C" fn(Handle, *const c_void, usize) -> Status,
    pub(super) opt_args_set_has_notif: unsafe extern "C" fn(Handle, bool) -> Status,
    pub(super) register_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    pub(super) deregister_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    pub(super) create_reg_dlist: unsafe extern "C" fn(c_int, *mut Handle) -> Status,
    pub(super) reg_dlist_add_desc:
        unsafe extern "C" fn(Handle, usize, usize, u64, *const c_void, usize) -> Status,
    pub(super) destroy_reg_dlist: unsafe extern "C" fn(Handle) -> Status,
    pub(super) create_xfer_dlist: unsafe extern "C" fn(c_int, *mut Handle) -> Status,
    pub(super) xfer_dlist_add_desc: unsafe extern "C" fn(Handle, usize, usize, u64) -> Status,
    pub(super) destroy_xfer_dlist: unsafe extern "C" fn(Handle) -> Status,
    pub(super) create_xfer_req:
        unsafe extern "C" fn(Handle, c_int, Handle, Handle, *const c_char, *mut Handle, Handle) -> Status,
    pub(super) post_xfer_req: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    pub(super) get_xfer_status: unsafe extern "C" fn(Handle, Handle) -> Status,
    pub(super) release_xfer_req: unsafe extern "C" fn(Handle, Handle) -> Status,
    pub(super) destroy_xfer_req: unsafe extern "C" fn(Handle) -> Status,
    pub(super) create_notif_map: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(super) destroy_notif_map: unsafe extern "C" fn(Handle) -> Status,
    pub(super) get_notifs: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    pub(super) notif_map_size: unsafe extern "C" fn(Handle, *mut usize) -> Status,
    pub(super) notif_map_get_agent_at: unsafe extern "C" fn(Handle, usize, *mut *const c_char) -> Status,
    pub(super) notif_map_get_notifs_size: unsafe extern "C" fn(Handle, *const c_char, *mut usize) -> Status,
    pub(super) notif_map_get_notif:
        unsafe extern "C" fn(Handle, *const c_char, usize, *mut *const c_void, *mut usize) -> Status,
    pub(super) notif_map_clear: unsafe extern "C" fn(Handle) -> Status,
    pub(super) mem_type_to_string: unsafe extern "C" fn(c_int, *mut *const c_char) -> Status,
}

/// The library names tried, in order: `$V4POOL_NIXL_LIB`, then the soname.
pub(super) fn candidates() -> Vec<String> {
    let mut names = Vec::new();
    if let Some(p) = std::env::var_os("V4POOL_NIXL_LIB") {
        names.push(p.to_string_lossy().into_owned());
    }
    names.push("libnixl_capi.so".to_string());
    names
}

pub(super) fn load() -> Result<Nixl, String> {
    // SAFETY: loading the library runs NIXL's initialisers, which have no preconditions.
    let (lib, name) = unsafe { crate::dylib::open_first("libnixl_capi", &candidates()) }?;
    macro_rules! sym {
        ($s:literal) => {
            // SAFETY: the symbol is NIXL's C entry point of the declared signature
            // (wrapper.h of the 1.5.x C API).
            *unsafe { lib.get(concat!("nixl_capi_", $s, "\0").as_bytes()) }
                .map_err(|e| format!("{name} lacks nixl_capi_{}: {e}", $s))?
        };
    }
    let n = Nixl {
        is_stub: sym!("is_stub"),
        create_configured_agent: sym!("create_configured_agent"),
        destroy_agent: sym!("destroy_agent"),
        get_local_md: sym!("get_local_md"),
        load_remote_md: sym!("load_remote_md"),
        invalidate_remote_md: sym!("invalidate_remote_md"),
        create_params: sym!("create_params"),
        params_add: sym!("params_add"),
        destroy_params: sym!("destroy_params"),
        create_backend: sym!("create_backend"),
        destroy_backend: sym!("destroy_backend"),
        create_opt_args: sym!("create_opt_args"),
        destroy_opt_args: sym!("destroy_opt_args"),
        opt_args_add_backend: sym!("opt_args_add_backend"),
        opt_args_set_notif_msg: sym!("opt_args_set_notif_msg"),
        opt_args_set_has_notif: sym!("opt_args_set_has_notif"),
        register_mem: sym!("register_mem"),
        deregister_mem: sym!("deregister_mem"),
        create_reg_dlist: sym!("create_reg_dlist"),
        reg_dlist_add_desc: sym!("reg_dlist_add_desc"),
        destroy_reg_dlist: sym!("destroy_reg_dlist"),
        create_xfer_dlist: sym!("create_xfer_dlist"),
        xfer_dlist_add_desc: sym!("xfer_dlist_add_desc"),
        destroy_xfer_dlist: sym!("destroy_xfer_dlist"),
        create_xfer_req: sym!("create_xfer_req"),
        post_xfer_req: sym!("post_xfer_req"),
        get_xfer_status: sym!("get_xfer_status"),
        release_xfer_req: sym!("release_xfer_req"),
        destroy_xfer_req: sym!("destroy_xfer_req"),
        create_notif_map: sym!("create_notif_map"),
        destroy_notif_map: sym!("destroy_notif_map"),
        get_notifs: sym!("get_notifs"),
        notif_map_size: sym!("notif_map_size"),
        notif_map_get_agent_at: sym!("notif_map_get_agent_at"),
        notif_map_get_notifs_size: sym!("notif_map_get_notifs_size"),
        notif_map_get_notif: sym!("notif_map_get_notif"),
        notif_map_clear: sym!("notif_map_clear"),
        mem_type_to_string: sym!("mem_type_to_string"),
        _lib: lib,
    };
    // SAFETY: no arguments, no preconditions.
    if unsafe { (n.is_stub)() } {
        return Err(format!("{name} is NIXL's stub build (no transfer backends)"));
    }
    Ok(n)
}

pub(super) fn nixl() -> Result<&'static Nixl, EngineError> {
    static LIB: OnceLock<Result<Nixl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| EngineError::NixlUnavailable(e.clone()))
}

/// Whether the NIXL C API can be loaded (probe only: creates nothing).
pub fn is_available() -> bool {
    nixl().is_ok()
}

/// Why NIXL cannot be loaded, or `None` when it can.
pub fn unavailable_reason() -> Option<String> {
    match nixl() {
        Ok(_) => None,
        Err(EngineError::NixlUnavailable(m)) => Some(m),
        Err(e) => Some(e.to_string()),
    }
}

pub(super) fn check(call: &'static str, r: Status) -> Result<(), EngineError> {
    if r == SUCCESS {
        return Ok(());
    }
    let what = match r {
        -1 => "invalid parameter",
        -2 => "backend error (NIXL prints the reason on stderr)",
        -3 => "invalid state",
        -4 => "exception",
        -5 => "no telemetry",
        -6 => "not found (peer metadata not loaded, or no backend serves the request)",
        1 => "still in progress",
        _ => "unknown status",
    };
    Err(EngineError::Nixl { call, message: format!("{what} ({r})") })
}

pub(super) fn cstring(call: &'static str, s: &str) -> Result<CString, EngineError> {
    CString::new(s).map_err(|_| EngineError::Nixl { call, message: format!("{s:?} contains a NUL byte") })
}

/// The name NIXL gives memory type `code` (`nixl_capi_mem_type_to_string`): a check that the
/// codes declared here are the library's (`4` must be `FILE`).
pub fn mem_type_name(code: i32) -> Result<String, EngineError> {
    let n = nixl()?;
    let mut s: *const c_char = std::ptr::null();
    // SAFETY: an out-pointer; NIXL points it at a static string.
    check("mem_type_to_string", unsafe { (n.mem_type_to_string)(code, &mut s) })?;
    // SAFETY: a NUL-terminated static string of the library.
    Ok(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

/// The memory type code of `FILE_SEG` as declared here (for [`mem_type_name`]'s check).
pub const FILE_SEG: i32 = MEM_FILE;
