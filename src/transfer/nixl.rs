//! The NIXL engine: KV moved with the transfer library vLLM (NixlConnector), Dynamo and SGLang
//! run for prefill/decode disaggregation, so a v4pool worker speaks what a PD fleet already
//! runs (UCX: RDMA across hosts, TCP or shared memory on one, CUDA copies on a GPU).
//!
//! NIXL is opened at run time from its C API library, `libnixl_capi.so` (PyPI's `nixl-cu13`
//! wheel ships it, without a header): `$V4POOL_NIXL_LIB`, then the default soname. Nothing
//! links it; without it every call returns [`EngineError::NixlUnavailable`] and the rest of the
//! crate is unaffected. The declarations below are written by hand from NIXL's public C API
//! (`src/bindings/rust/wrapper.h` in ai-dynamo/nixl) for the **1.5.x** ABI: the agent-config
//! struct passed by pointer changes layout after 1.5.2, so the library version is pinned (see
//! `docs/nixl.md`).
//!
//! How the [`TransferEngine`] calls map onto NIXL:
//! * **register** — the region as one descriptor of a DRAM or VRAM registration list
//!   ([`NixlMem`], chosen from the pool's backend), on the agent that owns that side.
//! * **exchange** — each agent's metadata (its name and UCX connection info) is loaded into the
//!   other, and the handshake bytes are delivered unchanged. Registrations made later travel
//!   as fresh metadata before the next post.
//! * **post** — every span of the call becomes one descriptor pair of **one** NIXL write
//!   request, tagged with a notification naming the ticket.
//! * **poll** — drives progress (no progress thread: the agents are created with it off, so
//!   no core spins): the request's status on the initiator, and the receiving agent's
//!   notifications, which arrive only after the request's bytes. A ticket is complete when
//!   both are in.
//!
//! Two shapes: [`NixlEngine::pair`] holds both agents (both pools in this process, the shape
//! [`handoff`](fn@super::handoff) drives), [`NixlEngine::to_peer`] holds the initiator only, the receiver
//! being a [`NixlAgent`] in another process that registers its own memory and sends its
//! metadata over the caller's channel; there the receiver learns of completion from
//! [`NixlAgent::notifications`].

use super::engine::{EngineError, MemRegion, RegionId, Registry, Side, Span, TransferEngine, TransferTicket};
use crate::backend::{Backend, BackendKind};
use std::collections::{BTreeMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

type Status = c_int;
type Handle = *mut c_void;

const SUCCESS: Status = 0;
const IN_PROG: Status = 1;
const MEM_DRAM: c_int = 0;
const MEM_VRAM: c_int = 1;
/// `FILE_SEG`: a descriptor's address is a file offset and its device id the file descriptor
/// (the POSIX and GDS plugins).
const MEM_FILE: c_int = 4;
const XFER_READ: c_int = 0;
const XFER_WRITE: c_int = 1;
/// The notification prefix of a posted ticket (`v4pool:<agent>:<ticket>`).
const NOTIF_PREFIX: &str = "v4pool:";

/// `nixl_capi_agent_config_t` of NIXL 1.5.x (offsets checked against the 1.5.1 library's
/// reads: bools at 0 and 1, port at 4, sync mode at 8, delays at 16 and 24, telemetry at 32).
#[repr(C)]
struct AgentConfig {
    enable_prog_thread: bool,
    enable_listen_thread: bool,
    listen_port: c_int,
    thread_sync: c_int,
    num_workers: c_uint,
    pthr_delay_us: u64,
    lthr_delay_us: u64,
    capture_telemetry: bool,
}

extern "C" {
    // NIXL 1.5.x hands out metadata buffers allocated with `malloc` and agent names with
    // `strdup`: the caller frees them with the C library's `free`.
    fn free(p: *mut c_void);
}

struct Nixl {
    _lib: libloading::Library,
    is_stub: unsafe extern "C" fn() -> bool,
    create_configured_agent: unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Handle) -> Status,
    destroy_agent: unsafe extern "C" fn(Handle) -> Status,
    get_local_md: unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> Status,
    load_remote_md: unsafe extern "C" fn(Handle, *const c_void, usize, *mut *mut c_char) -> Status,
    invalidate_remote_md: unsafe extern "C" fn(Handle, *const c_char) -> Status,
    create_params: unsafe extern "C" fn(*mut Handle) -> Status,
    params_add: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> Status,
    destroy_params: unsafe extern "C" fn(Handle) -> Status,
    create_backend: unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> Status,
    destroy_backend: unsafe extern "C" fn(Handle) -> Status,
    create_opt_args: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy_opt_args: unsafe extern "C" fn(Handle) -> Status,
    opt_args_add_backend: unsafe extern "C" fn(Handle, Handle) -> Status,
    opt_args_set_notif_msg: unsafe extern "C" fn(Handle, *const c_void, usize) -> Status,
    opt_args_set_has_notif: unsafe extern "C" fn(Handle, bool) -> Status,
    register_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    deregister_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    create_reg_dlist: unsafe extern "C" fn(c_int, *mut Handle) -> Status,
    reg_dlist_add_desc: unsafe extern "C" fn(Handle, usize, usize, u64, *const c_void, usize) -> Status,
    destroy_reg_dlist: unsafe extern "C" fn(Handle) -> Status,
    create_xfer_dlist: unsafe extern "C" fn(c_int, *mut Handle) -> Status,
    xfer_dlist_add_desc: unsafe extern "C" fn(Handle, usize, usize, u64) -> Status,
    destroy_xfer_dlist: unsafe extern "C" fn(Handle) -> Status,
    create_xfer_req:
        unsafe extern "C" fn(Handle, c_int, Handle, Handle, *const c_char, *mut Handle, Handle) -> Status,
    post_xfer_req: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    get_xfer_status: unsafe extern "C" fn(Handle, Handle) -> Status,
    release_xfer_req: unsafe extern "C" fn(Handle, Handle) -> Status,
    destroy_xfer_req: unsafe extern "C" fn(Handle) -> Status,
    create_notif_map: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy_notif_map: unsafe extern "C" fn(Handle) -> Status,
    get_notifs: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    notif_map_size: unsafe extern "C" fn(Handle, *mut usize) -> Status,
    notif_map_get_agent_at: unsafe extern "C" fn(Handle, usize, *mut *const c_char) -> Status,
    notif_map_get_notifs_size: unsafe extern "C" fn(Handle, *const c_char, *mut usize) -> Status,
    notif_map_get_notif:
        unsafe extern "C" fn(Handle, *const c_char, usize, *mut *const c_void, *mut usize) -> Status,
    notif_map_clear: unsafe extern "C" fn(Handle) -> Status,
    mem_type_to_string: unsafe extern "C" fn(c_int, *mut *const c_char) -> Status,
}

/// The library names tried, in order: `$V4POOL_NIXL_LIB`, then the soname.
fn candidates() -> Vec<String> {
    let mut names = Vec::new();
    if let Some(p) = std::env::var_os("V4POOL_NIXL_LIB") {
        names.push(p.to_string_lossy().into_owned());
    }
    names.push("libnixl_capi.so".to_string());
    names
}

fn load() -> Result<Nixl, String> {
    let mut tried = Vec::new();
    for name in candidates() {
        // SAFETY: loading the library runs NIXL's initialisers, which have no preconditions.
        let lib = match unsafe { libloading::Library::new(&name) } {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
        };
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
        return Ok(n);
    }
    Err(format!("libnixl_capi not found ({})", tried.join("; ")))
}

fn nixl() -> Result<&'static Nixl, EngineError> {
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

fn check(call: &'static str, r: Status) -> Result<(), EngineError> {
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

fn cstring(call: &'static str, s: &str) -> Result<CString, EngineError> {
    CString::new(s).map_err(|_| EngineError::Nixl { call, message: format!("{s:?} contains a NUL byte") })
}

/// What kind of memory a region is, as NIXL registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NixlMem {
    /// Host memory (`DRAM_SEG`).
    Dram,
    /// Memory of CUDA device `n` (`VRAM_SEG`; UCX's cuda_copy / cuda_ipc transports).
    Vram(u32),
}

impl NixlMem {
    /// The memory kind of a pool on `backend`; `device` is the CUDA ordinal (ignored for
    /// host memory). HIP memory has no transport in the CUDA build of NIXL this targets.
    pub fn for_backend(backend: &dyn Backend, device: u32) -> Result<NixlMem, EngineError> {
        match backend.kind() {
            BackendKind::Host => Ok(NixlMem::Dram),
            BackendKind::Cuda => Ok(NixlMem::Vram(device)),
            BackendKind::Hip => Err(EngineError::Nixl {
                call: "register",
                message: "HIP memory: the CUDA build of NIXL (nixl-cu13) has no ROCm transport".into(),
            }),
        }
    }

    fn seg(self) -> (c_int, u64) {
        match self {
            NixlMem::Dram => (MEM_DRAM, 0),
            NixlMem::Vram(d) => (MEM_VRAM, u64::from(d)),
        }
    }
}

/// What a descriptor names: memory, or a range of an open file (`FILE_SEG`: the address is
/// an offset, the device id the descriptor). Files are crate-internal: only the shared
/// tier's POSIX I/O ([`super::nixl_file`]) registers them, for the span of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Seg {
    Mem(NixlMem),
    File(c_int),
}

impl Seg {
    fn raw(self) -> (c_int, u64) {
        match self {
            Seg::Mem(m) => m.seg(),
            // A valid descriptor is non-negative (checked where it is registered).
            Seg::File(fd) => (MEM_FILE, fd as u64),
        }
    }
}

/// A transfer's direction, from the initiator's local descriptors' point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XferOp {
    /// Remote → local (`NIXL_READ`).
    Read,
    /// Local → remote (`NIXL_WRITE`).
    Write,
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

/// How agents are made.
#[derive(Clone, Debug)]
pub struct NixlOptions {
    /// UCX backend parameters (`ucx_error_handling_mode=none` for shared memory, per NIXL's
    /// UCX plugin). Default: `$V4POOL_NIXL_UCX_PARAMS` as `key=value,key=value`, else none.
    pub backend_params: Vec<(String, String)>,
    /// How long [`TransferEngine::wait`] polls before giving up (a peer gone mid-transfer).
    pub wait_timeout: Duration,
}

impl Default for NixlOptions {
    fn default() -> Self {
        let backend_params = std::env::var("V4POOL_NIXL_UCX_PARAMS")
            .unwrap_or_default()
            .split(',')
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.trim().to_string(), v.trim().to_string())))
            .filter(|(k, _)| !k.is_empty())
            .collect();
        NixlOptions { backend_params, wait_timeout: Duration::from_secs(60) }
    }
}

/// A walk over a NIXL 1.5 metadata blob (`nixlSerDes`: after the `nixlSerDes|` header, each
/// field is its tag, a little-endian u64 length, that many bytes and a `|`).
struct MdReader<'a> {
    md: &'a [u8],
    at: usize,
}

impl<'a> MdReader<'a> {
    fn refuse(&self, reason: &'static str) -> EngineError {
        EngineError::NixlMetadata { reason, at: self.at, len: self.md.len() }
    }

    /// The value of the field at the cursor, which must carry `tag`.
    fn field(&mut self, tag: &str) -> Result<&'a [u8], EngineError> {
        let rest = &self.md[self.at..];
        let after_tag = rest
            .strip_prefix(tag.as_bytes())
            .ok_or_else(|| self.refuse("a field's tag is not the one due"))?;
        let (len, value) =
            after_tag.split_first_chunk::<8>().ok_or_else(|| self.refuse("cut short in a field's length"))?;
        let len = usize::try_from(u64::from_le_bytes(*len))
            .map_err(|_| self.refuse("a field's length is past usize"))?;
        if value.len() <= len {
            return Err(self.refuse("a field's value runs past the end"));
        }
        if value[len] != b'|' {
            return Err(self.refuse("a field does not end with '|'"));
        }
        self.at += tag.len() + 8 + len + 1;
        Ok(&value[..len])
    }

    /// A field holding a little-endian u64 count.
    fn count(&mut self, tag: &str) -> Result<u64, EngineError> {
        let v = self.field(tag)?;
        let v: [u8; 8] = v.try_into().map_err(|_| self.refuse("a count is not 8 bytes"))?;
        Ok(u64::from_le_bytes(v))
    }

    /// A field whose value must be non-empty (NIXL refuses empty names, types and lists).
    fn text(&mut self, tag: &str) -> Result<&'a [u8], EngineError> {
        let v = self.field(tag)?;
        if v.is_empty() {
            return Err(self.refuse("an empty name or value"));
        }
        Ok(v)
    }
}

/// Bytes of NIXL's `nixlBasicDesc` (address, length, device id).
const NIXL_BASIC_DESC_BYTES: usize = 24;

/// Check that `md` is one whole NIXL 1.5 metadata blob, field by field as NIXL 1.5's
/// `loadRemoteMD` reads it (header; `Agent`; `Conns` then that many backend `t`/`c` pairs;
/// `MemSection`; `nixlSecElms` sections of a `bknd` and a descriptor list `nixlDList` with its
/// `t` memory type, `n` descriptors and each descriptor), ending exactly at its end; returns
/// the agent name. A blob NIXL would refuse after it had loaded the peer's connection must
/// never reach it: NIXL 1.5.1 then drops its record of the connection without closing it, so
/// every later load of that peer, valid or not, is an invalid parameter and no call undoes it.
/// What remains for NIXL to refuse is a well-formed blob whose contents its backend cannot
/// use (a corrupt remote key); see docs/nixl.md.
pub fn check_metadata(md: &[u8]) -> Result<&str, EngineError> {
    const HEADER: &[u8] = b"nixlSerDes|";
    let mut r = MdReader { md, at: 0 };
    if !md.starts_with(HEADER) {
        return Err(r.refuse("no nixlSerDes header"));
    }
    r.at = HEADER.len();
    let name = std::str::from_utf8(r.text("Agent")?).map_err(|_| r.refuse("the agent name is not UTF-8"))?;
    for _ in 0..r.count("Conns")? {
        r.text("t")?;
        r.text("c")?;
    }
    if r.field("")? != b"MemSection" {
        return Err(r.refuse("no MemSection after the connections"));
    }
    for _ in 0..r.count("nixlSecElms")? {
        r.text("bknd")?;
        let list = r.text("nixlDList")?;
        if r.field("t")?.len() != 4 {
            return Err(r.refuse("a memory type is not 4 bytes"));
        }
        let n = r.count("n")?;
        if n == 0 {
            return Err(r.refuse("an empty descriptor list"));
        }
        match list {
            b"nixlSDList" => {
                for _ in 0..n {
                    if r.field("")?.len() < NIXL_BASIC_DESC_BYTES {
                        return Err(r.refuse("a descriptor shorter than its address, length and device"));
                    }
                }
            }
            b"nixlBDList" => {
                let want = usize::try_from(n).ok().and_then(|n| n.checked_mul(NIXL_BASIC_DESC_BYTES));
                if Some(r.field("")?.len()) != want {
                    return Err(r.refuse("a basic descriptor list of the wrong length"));
                }
            }
            _ => return Err(r.refuse("an unknown descriptor list type")),
        }
    }
    if r.at != md.len() {
        return Err(r.refuse("bytes after the last section"));
    }
    Ok(name)
}

/// A unique agent name in this process (NIXL keys peers by name).
fn agent_name(role: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("v4pool-{}-{}-{role}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One NIXL agent with one backend — UCX ([`NixlAgent::new`]), or a storage plugin such as
/// POSIX for the shared tier — its progress thread off (progress is driven by the calls
/// below). Usable on its own as the receiving end in another process.
pub struct NixlAgent {
    nixl: &'static Nixl,
    agent: Handle,
    backend: Handle,
    /// Optional arguments naming the UCX backend, for registrations and plain requests.
    opt: Handle,
    notif_map: Handle,
    name: String,
    /// Registered `(what, addr, len)` (deregistered on drop).
    registered: Vec<(Seg, u64, u64)>,
    /// Peers whose metadata is loaded.
    peers: HashSet<String>,
}

// SAFETY: the handles are owned by the agent and used only through `&mut self` (or `&self`
// calls NIXL documents as read-only, `get_local_md`); the agent is created with thread-sync
// mode NONE, which allows use from any one thread at a time.
unsafe impl Send for NixlAgent {}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent").field("name", &self.name).field("registered", &self.registered).finish()
    }
}

impl NixlAgent {
    /// An agent named `name` (unique among the agents it will talk to; `None`: a fresh name)
    /// with a UCX backend.
    pub fn new(name: Option<&str>, options: &NixlOptions) -> Result<NixlAgent, EngineError> {
        NixlAgent::with_plugin(name, c"UCX", &options.backend_params)
    }

    /// An agent with one backend of `plugin` (`UCX`, `POSIX`, ...), made with `params`.
    pub(crate) fn with_plugin(
        name: Option<&str>,
        plugin: &CStr,
        params_in: &[(String, String)],
    ) -> Result<NixlAgent, EngineError> {
        let n = nixl()?;
        let name = name.map(str::to_string).unwrap_or_else(|| agent_name("agent"));
        let cname = cstring("create_configured_agent", &name)?;
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 0,
            capture_telemetry: false,
        };
        let mut a = NixlAgent {
            nixl: n,
            agent: std::ptr::null_mut(),
            backend: std::ptr::null_mut(),
            opt: std::ptr::null_mut(),
            notif_map: std::ptr::null_mut(),
            name,
            registered: Vec::new(),
            peers: HashSet::new(),
        };
        // SAFETY: a NUL-terminated name, a config of the 1.5.x layout, an out-pointer.
        check("create_configured_agent", unsafe {
            (n.create_configured_agent)(cname.as_ptr(), &cfg, &mut a.agent)
        })?;
        // From here `a` owns what is created: its Drop releases it on any early return.
        let mut params: Handle = std::ptr::null_mut();
        // SAFETY: an out-pointer.
        check("create_params", unsafe { (n.create_params)(&mut params) })?;
        let added = (|| {
            for (k, v) in params_in {
                let (k, v) = (cstring("params_add", k)?, cstring("params_add", v)?);
                // SAFETY: a live params object, NUL-terminated strings (copied by NIXL).
                check("params_add", unsafe { (n.params_add)(params, k.as_ptr(), v.as_ptr()) })?;
            }
            // SAFETY: a live agent and params object; the plugin name is NUL-terminated.
            check("create_backend", unsafe {
                (n.create_backend)(a.agent, plugin.as_ptr(), params, &mut a.backend)
            })
        })();
        // SAFETY: created above, used by nothing after this.
        unsafe { (n.destroy_params)(params) };
        added?;
        // SAFETY: out-pointers; then a live opt-args object and backend handle.
        unsafe {
            check("create_opt_args", (n.create_opt_args)(&mut a.opt))?;
            check("opt_args_add_backend", (n.opt_args_add_backend)(a.opt, a.backend))?;
            check("create_notif_map", (n.create_notif_map)(&mut a.notif_map))?;
        }
        Ok(a)
    }

    /// The agent's name (what a peer's requests and notifications name it by).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many ranges are registered with the agent now.
    pub fn registrations(&self) -> usize {
        self.registered.len()
    }

    fn reg_call(&self, what: Seg, addr: u64, len: u64, register: bool) -> Result<(), EngineError> {
        let n = self.nixl;
        let call = if register { "register_mem" } else { "deregister_mem" };
        let (seg, dev) = what.raw();
        let mut list: Handle = std::ptr::null_mut();
        // SAFETY: an out-pointer.
        check("create_reg_dlist", unsafe { (n.create_reg_dlist)(seg, &mut list) })?;
        // SAFETY: a live list; no per-descriptor metadata. The registration itself only
        // records the range (the caller of `register` vouched for it).
        let r = unsafe {
            check(
                "reg_dlist_add_desc",
                (n.reg_dlist_add_desc)(list, addr as usize, len as usize, dev, std::ptr::null(), 0),
            )
        }
        .and_then(|()| {
            // SAFETY: live agent, list and opt args.
            let r = unsafe {
                if register {
                    (n.register_mem)(self.agent, list, self.opt)
                } else {
                    (n.deregister_mem)(self.agent, list, self.opt)
                }
            };
            check(call, r)
        });
        // SAFETY: created above; NIXL copied what it keeps.
        unsafe { (n.destroy_reg_dlist)(list) };
        r
    }

    /// Register `len` bytes at `addr` as `mem` with this agent (a peer can write them once it
    /// has loaded this agent's metadata taken afterwards).
    ///
    /// # Safety
    /// The range must be live memory of that kind (and device), stay live until
    /// [`NixlAgent::deregister`] or the agent is dropped, and no code may rely on its bytes
    /// while a peer may be writing them.
    pub unsafe fn register(&mut self, mem: NixlMem, addr: u64, len: u64) -> Result<(), EngineError> {
        // SAFETY: the caller's promise, forwarded.
        unsafe { self.register_seg(Seg::Mem(mem), addr, len) }
    }

    /// [`NixlAgent::register`] of memory or of a file range.
    ///
    /// # Safety
    /// As [`NixlAgent::register`] for memory; for a file, `fd` stays open until the range is
    /// deregistered.
    pub(crate) unsafe fn register_seg(&mut self, what: Seg, addr: u64, len: u64) -> Result<(), EngineError> {
        if len == 0 || addr.checked_add(len).is_none() || matches!(what, Seg::File(fd) if fd < 0) {
            return Err(EngineError::Nixl {
                call: "register_mem",
                message: format!("bad range {addr:#x}+{len} of {what:?}"),
            });
        }
        self.reg_call(what, addr, len, true)?;
        self.registered.push((what, addr, len));
        Ok(())
    }

    /// Deregister a range registered with exactly these arguments.
    pub fn deregister(&mut self, mem: NixlMem, addr: u64, len: u64) -> Result<(), EngineError> {
        self.deregister_seg(Seg::Mem(mem), addr, len)
    }

    /// [`NixlAgent::deregister`] of memory or of a file range.
    pub(crate) fn deregister_seg(&mut self, what: Seg, addr: u64, len: u64) -> Result<(), EngineError> {
        let i = self.registered.iter().position(|&r| r == (what, addr, len)).ok_or_else(|| {
            EngineError::Nixl {
                call: "deregister_mem",
                message: format!("{addr:#x}+{len} is not registered with {}", self.name),
            }
        })?;
        self.reg_call(what, addr, len, false)?;
        self.registered.swap_remove(i);
        Ok(())
    }

    /// This agent's metadata (name, connection info, registrations so far): the bytes a peer
    /// loads with [`NixlAgent::load_peer`].
    pub fn metadata(&self) -> Result<Vec<u8>, EngineError> {
        let (mut data, mut len): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a live agent, out-pointers.
        check("get_local_md", unsafe { (self.nixl.get_local_md)(self.agent, &mut data, &mut len) })?;
        // SAFETY: NIXL returned `len` bytes at `data`, allocated with malloc, ours to free.
        let out = unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec();
        // SAFETY: as above, freed once.
        unsafe { free(data) };
        Ok(out)
    }

    /// Load (or refresh) a peer's metadata; returns the peer's name. A peer already loaded is
    /// forgotten first, so registrations it dropped are dropped here too.
    ///
    /// A refused load leaves nothing behind, so a valid copy loads afterwards: the blob is
    /// checked whole first ([`check_metadata`]: NIXL 1.5.1 cannot undo a load it refuses
    /// after taking the peer's connection), and whatever NIXL kept of one it refuses anyway is
    /// invalidated under the peer's name.
    pub fn load_peer(&mut self, md: &[u8]) -> Result<String, EngineError> {
        let named = check_metadata(md)?.to_string();
        // A refresh: forget the peer first (NIXL refuses a blob whose registrations differ
        // from the ones it holds for the name).
        if self.peers.contains(&named) {
            self.forget_peer(&named)?;
        }
        let mut name: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live agent, `md` readable for its length, an out-pointer.
        let loaded = check("load_remote_md", unsafe {
            (self.nixl.load_remote_md)(self.agent, md.as_ptr() as *const c_void, md.len(), &mut name)
        });
        if let Err(e) = loaded {
            if let Ok(n) = CString::new(named) {
                // Whatever part of the peer NIXL kept; it may have kept nothing (an error then,
                // not one to report over the refusal itself).
                // SAFETY: a live agent, a NUL-terminated name.
                let _ = unsafe { (self.nixl.invalidate_remote_md)(self.agent, n.as_ptr()) };
            }
            return Err(e);
        }
        // SAFETY: NIXL returned a strdup'd NUL-terminated name, ours to free.
        let s = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        // SAFETY: as above, freed once.
        unsafe { free(name as *mut c_void) };
        self.peers.insert(s.clone());
        Ok(s)
    }

    /// Drop a peer's metadata (and its connection).
    pub fn forget_peer(&mut self, peer: &str) -> Result<(), EngineError> {
        let c = cstring("invalidate_remote_md", peer)?;
        // SAFETY: a live agent, a NUL-terminated name.
        check("invalidate_remote_md", unsafe { (self.nixl.invalidate_remote_md)(self.agent, c.as_ptr()) })?;
        self.peers.remove(peer);
        Ok(())
    }

    /// Create and post one write request of `spans` `(local addr, remote addr, len)` from this
    /// agent's `local` memory to `peer`'s `remote` memory, with notification `notif`.
    ///
    /// # Safety
    /// Every local range lies in memory this agent registered, every remote range in memory
    /// `peer` registered (as its loaded metadata says), and none of it is freed before the
    /// request completes or is released.
    unsafe fn write(
        &mut self,
        peer: &str,
        (local, remote): (NixlMem, NixlMem),
        spans: &[(u64, u64, u64)],
        notif: &[u8],
    ) -> Result<Handle, EngineError> {
        // SAFETY: the caller's promise, forwarded.
        unsafe { self.request(peer, XferOp::Write, (Seg::Mem(local), Seg::Mem(remote)), spans, Some(notif)) }
    }

    /// Create and post one request of `op` over `spans` `(local, remote, len)` between this
    /// agent's `local` descriptors and `peer`'s `remote` ones (for a storage plugin the peer
    /// is this agent itself), with notification `notif` if any (storage plugins have none).
    ///
    /// # Safety
    /// As [`NixlAgent::write`]; for a read, nothing reads or writes the local ranges until
    /// the request has completed or been released.
    pub(crate) unsafe fn request(
        &mut self,
        peer: &str,
        op: XferOp,
        (local, remote): (Seg, Seg),
        spans: &[(u64, u64, u64)],
        notif: Option<&[u8]>,
    ) -> Result<Handle, EngineError> {
        let n = self.nixl;
        let cpeer = cstring("create_xfer_req", peer)?;
        let (mut l, mut r, mut opt, mut req): (Handle, Handle, Handle, Handle) =
            (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        let code = match op {
            XferOp::Read => XFER_READ,
            XferOp::Write => XFER_WRITE,
        };
        let result = (|| {
            let ((ls, ld), (rs, rd)) = (local.raw(), remote.raw());
            // SAFETY: out-pointers, then live lists, opt args and agent; the caller's promise
            // covers the ranges; NIXL copies the notification bytes.
            unsafe {
                check("create_xfer_dlist", (n.create_xfer_dlist)(ls, &mut l))?;
                check("create_xfer_dlist", (n.create_xfer_dlist)(rs, &mut r))?;
                for &(src, dst, len) in spans {
                    check("xfer_dlist_add_desc", (n.xfer_dlist_add_desc)(l, src as usize, len as usize, ld))?;
                    check("xfer_dlist_add_desc", (n.xfer_dlist_add_desc)(r, dst as usize, len as usize, rd))?;
                }
                check("create_opt_args", (n.create_opt_args)(&mut opt))?;
                check("opt_args_add_backend", (n.opt_args_add_backend)(opt, self.backend))?;
                if let Some(notif) = notif {
                    check(
                        "opt_args_set_notif_msg",
                        (n.opt_args_set_notif_msg)(opt, notif.as_ptr() as *const c_void, notif.len()),
                    )?;
                    check("opt_args_set_has_notif", (n.opt_args_set_has_notif)(opt, true))?;
                }
                check(
                    "create_xfer_req",
                    (n.create_xfer_req)(self.agent, code, l, r, cpeer.as_ptr(), &mut req, opt),
                )?;
                let posted = (n.post_xfer_req)(self.agent, req, opt);
                if posted != SUCCESS && posted != IN_PROG {
                    // A request whose post failed moves nothing; if NIXL will not release
                    // it, it stays with the agent (freed when the agent is destroyed).
                    let _ = self.drop_request(req);
                    req = std::ptr::null_mut();
                    check("post_xfer_req", posted)?;
                }
            }
            Ok(req)
        })();
        // SAFETY: each was created above (or is null and skipped); the request keeps copies.
        unsafe {
            for (h, f) in [(l, n.destroy_xfer_dlist), (r, n.destroy_xfer_dlist), (opt, n.destroy_opt_args)] {
                if !h.is_null() {
                    f(h);
                }
            }
        }
        result
    }

    /// Whether `req` is done: `Ok(false)` in progress, an error if it failed.
    pub(crate) fn status(&mut self, req: Handle) -> Result<bool, EngineError> {
        // SAFETY: a live agent and a request it created.
        match unsafe { (self.nixl.get_xfer_status)(self.agent, req) } {
            SUCCESS => Ok(true),
            IN_PROG => Ok(false),
            r => check("get_xfer_status", r).map(|()| false),
        }
    }

    /// Release and destroy a request (cancelling it if still in flight). Returns `false`
    /// when NIXL could not cancel it: the request is left alive (it may still write), to be
    /// released again later.
    ///
    /// # Safety
    /// `req` was created by this agent; after `true` it is not used again.
    pub(crate) unsafe fn drop_request(&mut self, req: Handle) -> bool {
        // SAFETY: the caller's promise; release before destroy, as NIXL requires.
        unsafe {
            if (self.nixl.release_xfer_req)(self.agent, req) != SUCCESS {
                return false;
            }
            (self.nixl.destroy_xfer_req)(req);
        }
        true
    }

    /// Notifications received since the last call, as `(sender agent, message)`. Also drives
    /// this agent's progress (a receiver over TCP must make progress for bytes to land).
    pub fn notifications(&mut self) -> Result<Vec<(String, Vec<u8>)>, EngineError> {
        let n = self.nixl;
        let m = self.notif_map;
        let mut out = Vec::new();
        // SAFETY: a live agent and map, no opt args; then reads of the map NIXL filled, whose
        // strings and buffers live until the map is cleared (after the copies below).
        unsafe {
            check("get_notifs", (n.get_notifs)(self.agent, m, std::ptr::null_mut()))?;
            let mut agents = 0;
            check("notif_map_size", (n.notif_map_size)(m, &mut agents))?;
            for i in 0..agents {
                let mut who: *const c_char = std::ptr::null();
                check("notif_map_get_agent_at", (n.notif_map_get_agent_at)(m, i, &mut who))?;
                let mut count = 0;
                check("notif_map_get_notifs_size", (n.notif_map_get_notifs_size)(m, who, &mut count))?;
                let from = CStr::from_ptr(who).to_string_lossy().into_owned();
                for j in 0..count {
                    let (mut data, mut len): (*const c_void, usize) = (std::ptr::null(), 0);
                    check("notif_map_get_notif", (n.notif_map_get_notif)(m, who, j, &mut data, &mut len))?;
                    let bytes = if len == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(data as *const u8, len).to_vec()
                    };
                    out.push((from.clone(), bytes));
                }
            }
            check("notif_map_clear", (n.notif_map_clear)(m))?;
        }
        Ok(out)
    }
}

impl Drop for NixlAgent {
    fn drop(&mut self) {
        for (what, addr, len) in std::mem::take(&mut self.registered) {
            let _ = self.reg_call(what, addr, len, false);
        }
        let n = self.nixl;
        // SAFETY: each handle was created by this agent (null ones skipped) and is destroyed
        // once; the backend handle is a wrapper the agent's destruction does not free.
        unsafe {
            if !self.notif_map.is_null() {
                (n.destroy_notif_map)(self.notif_map);
            }
            if !self.opt.is_null() {
                (n.destroy_opt_args)(self.opt);
            }
            if !self.agent.is_null() {
                (n.destroy_agent)(self.agent);
            }
            if !self.backend.is_null() {
                (n.destroy_backend)(self.backend);
            }
        }
    }
}

/// The notification a ticket's request carries: `v4pool:<initiator>:<ticket>`.
pub fn ticket_notification(initiator: &str, ticket: TransferTicket) -> Vec<u8> {
    format!("{NOTIF_PREFIX}{initiator}:{}", ticket.0).into_bytes()
}

struct Pending {
    req: Handle,
    /// The initiator's status said done.
    done: bool,
    /// The receiving agent saw the notification (pair mode), or nobody here waits for it.
    delivered: bool,
}

/// A [`TransferEngine`] over NIXL. See the module docs.
pub struct NixlEngine {
    local: NixlAgent,
    /// The receiving agent (pair mode), or `None` when the receiver is another process.
    remote: Option<NixlAgent>,
    peer: Option<String>,
    mems: (NixlMem, NixlMem),
    registry: Registry,
    /// Remote registrations changed since the peer's metadata was last loaded.
    remote_stale: bool,
    /// A remote region was deregistered since then: the peer's metadata is reloaded from
    /// scratch, because NIXL merges a reload into what it holds and would keep the dropped
    /// region's descriptor (and its remote key), which a later region at an overlapping
    /// address could be matched against.
    remote_dropped: bool,
    next_ticket: u64,
    pending: BTreeMap<u64, Pending>,
    /// Requests given up on (a wait that timed out) that NIXL could not cancel: they may
    /// still write, so no region is deregistered while any is here.
    stuck: Vec<Handle>,
    wait_timeout: Duration,
}

// SAFETY: see `NixlAgent`; the request handles are owned and used through `&mut self`.
unsafe impl Send for NixlEngine {}

impl std::fmt::Debug for NixlEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlEngine")
            .field("local", &self.local)
            .field("remote", &self.remote)
            .field("mems", &self.mems)
            .finish()
    }
}

impl NixlEngine {
    /// Two agents in this process: `Local` regions on the first (the initiator, of memory
    /// kind `local`), `Remote` regions on the second (of kind `remote`).
    pub fn pair(local: NixlMem, remote: NixlMem, options: &NixlOptions) -> Result<NixlEngine, EngineError> {
        let a = NixlAgent::new(Some(&agent_name("send")), options)?;
        let b = NixlAgent::new(Some(&agent_name("recv")), options)?;
        Ok(NixlEngine::build(a, Some(b), None, (local, remote), options))
    }

    /// The initiator end, `agent`, writing into a peer agent of another process whose
    /// metadata is `peer_md`. `Remote` registrations name the peer's memory (which the peer
    /// registered itself; reload its metadata with [`NixlEngine::reload_peer`] after it
    /// registers more). [`TransferEngine::exchange`] is refused: the handshake goes over the
    /// channel that carried the metadata.
    pub fn to_peer(
        mut agent: NixlAgent,
        peer_md: &[u8],
        mems: (NixlMem, NixlMem),
        options: &NixlOptions,
    ) -> Result<NixlEngine, EngineError> {
        let peer = agent.load_peer(peer_md)?;
        Ok(NixlEngine::build(agent, None, Some(peer), mems, options))
    }

    fn build(
        local: NixlAgent,
        remote: Option<NixlAgent>,
        peer: Option<String>,
        mems: (NixlMem, NixlMem),
        options: &NixlOptions,
    ) -> NixlEngine {
        NixlEngine {
            local,
            remote,
            peer,
            mems,
            registry: Registry::default(),
            remote_stale: false,
            remote_dropped: false,
            next_ticket: 0,
            pending: BTreeMap::new(),
            stuck: Vec::new(),
            wait_timeout: options.wait_timeout,
        }
    }

    /// The initiating agent's name.
    pub fn agent_name(&self) -> &str {
        self.local.name()
    }

    /// Load the peer's fresh metadata (peer mode).
    pub fn reload_peer(&mut self, md: &[u8]) -> Result<(), EngineError> {
        self.peer = Some(self.local.load_peer(md)?);
        Ok(())
    }

    /// Requests posted and not yet completed (each holds NIXL resources).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Load the receiving agent's current metadata into the initiator (pair mode).
    fn refresh_remote(&mut self) -> Result<(), EngineError> {
        if let Some(b) = &self.remote {
            let md = b.metadata()?;
            if self.remote_dropped {
                if let Some(p) = self.peer.take() {
                    self.local.forget_peer(&p)?;
                }
            }
            self.peer = Some(self.local.load_peer(&md)?);
        }
        self.remote_stale = false;
        self.remote_dropped = false;
        Ok(())
    }

    /// Forget ticket `t`'s request; one NIXL cannot cancel is kept in `stuck`.
    fn finish(&mut self, t: u64) {
        if let Some(p) = self.pending.remove(&t) {
            // SAFETY: created by the local agent; forgotten here unless it stays stuck.
            if !unsafe { self.local.drop_request(p.req) } {
                self.stuck.push(p.req);
            }
        }
    }

    /// Try again to release requests NIXL could not cancel.
    fn release_stuck(&mut self) {
        let mut still = Vec::new();
        for req in std::mem::take(&mut self.stuck) {
            // SAFETY: created by the local agent, not released yet.
            if !unsafe { self.local.drop_request(req) } {
                still.push(req);
            }
        }
        self.stuck = still;
    }
}

impl TransferEngine for NixlEngine {
    fn name(&self) -> &'static str {
        "nixl"
    }

    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError> {
        match (side, self.remote.as_mut()) {
            // SAFETY: the caller's promise on the region, forwarded.
            (Side::Local, _) => unsafe { self.local.register(self.mems.0, region.addr, region.len)? },
            (Side::Remote, Some(b)) => {
                // SAFETY: as above.
                unsafe { b.register(self.mems.1, region.addr, region.len)? };
                self.remote_stale = true;
            }
            // The peer registered its own memory; NIXL checks every remote descriptor
            // against the peer's loaded metadata when the request is created.
            (Side::Remote, None) => {}
        }
        Ok(self.registry.insert(side, region))
    }

    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError> {
        let (side, r) = self.registry.get(id)?;
        self.release_stuck();
        if !self.pending.is_empty() || !self.stuck.is_empty() {
            return Err(EngineError::Nixl {
                call: "deregister_mem",
                message: format!(
                    "{} transfers in flight, {} that could not be cancelled",
                    self.pending.len(),
                    self.stuck.len()
                ),
            });
        }
        match (side, self.remote.as_mut()) {
            (Side::Local, _) => self.local.deregister(self.mems.0, r.addr, r.len)?,
            (Side::Remote, Some(b)) => {
                b.deregister(self.mems.1, r.addr, r.len)?;
                self.remote_stale = true;
                self.remote_dropped = true;
            }
            (Side::Remote, None) => {}
        }
        self.registry.remove(id)
    }

    fn exchange(&mut self, local_msg: &[u8], remote_msg: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        let Some(b) = self.remote.as_mut() else {
            return Err(EngineError::Nixl {
                call: "exchange",
                message:
                    "an engine to another process's agent carries no handshake: send it over the channel \
                          that carried the peer's metadata"
                        .into(),
            });
        };
        // Each agent learns the other (name, connection info) before any KV byte moves.
        let md_a = self.local.metadata()?;
        b.load_peer(&md_a)?;
        self.refresh_remote()?;
        Ok((local_msg.to_vec(), remote_msg.to_vec()))
    }

    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError> {
        let resolved: Vec<(u64, u64, u64)> =
            self.registry.resolve(spans)?.into_iter().filter(|s| s.2 > 0).collect();
        let t = TransferTicket(self.next_ticket);
        if resolved.is_empty() {
            self.next_ticket += 1;
            return Ok(t);
        }
        if self.remote_stale || self.peer.is_none() {
            self.refresh_remote()?;
        }
        let peer = self.peer.clone().ok_or_else(|| EngineError::Nixl {
            call: "create_xfer_req",
            message: "no peer metadata loaded (call exchange first)".into(),
        })?;
        let notif = ticket_notification(self.local.name(), t);
        // SAFETY: every range lies in a registered region (checked by `resolve`) that the
        // registrant promised stays live; deregistration waits for no request in flight.
        let req = unsafe { self.local.write(&peer, self.mems, &resolved, &notif)? };
        self.next_ticket += 1;
        self.pending.insert(t.0, Pending { req, done: false, delivered: self.remote.is_none() });
        Ok(t)
    }

    fn poll(&mut self, ticket: TransferTicket) -> Result<bool, EngineError> {
        if ticket.0 >= self.next_ticket {
            return Err(EngineError::UnknownTicket(ticket));
        }
        // Progress for every request in flight, and the receiver's notifications.
        let keys: Vec<u64> = self.pending.keys().copied().collect();
        for k in keys {
            let req = self.pending[&k].req;
            match self.local.status(req) {
                Ok(done) => {
                    if let Some(p) = self.pending.get_mut(&k) {
                        p.done |= done;
                    }
                }
                Err(e) => {
                    self.finish(k);
                    if k == ticket.0 {
                        return Err(e);
                    }
                }
            }
        }
        if let Some(b) = self.remote.as_mut() {
            let me = self.local.name().to_string();
            for (from, msg) in b.notifications()? {
                if from != me {
                    continue;
                }
                let t = std::str::from_utf8(&msg)
                    .ok()
                    .and_then(|s| s.strip_prefix(NOTIF_PREFIX))
                    .and_then(|s| s.rsplit_once(':'))
                    .and_then(|(_, t)| t.parse::<u64>().ok());
                if let Some(p) = t.and_then(|t| self.pending.get_mut(&t)) {
                    p.delivered = true;
                }
            }
        }
        let complete: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.done && p.delivered).map(|(&k, _)| k).collect();
        for k in complete {
            self.finish(k);
        }
        // Completed (now or earlier) tickets are no longer pending.
        Ok(!self.pending.contains_key(&ticket.0))
    }

    fn wait(&mut self, ticket: TransferTicket) -> Result<(), EngineError> {
        let start = Instant::now();
        while !self.poll(ticket)? {
            if start.elapsed() > self.wait_timeout {
                self.finish(ticket.0);
                let cancelled = if self.stuck.is_empty() {
                    "cancelled"
                } else {
                    "NOT cancelled: it may still write, and the engine keeps every region registered"
                };
                return Err(EngineError::Nixl {
                    call: "wait",
                    message: format!(
                        "transfer not complete after {:?} (peer gone?); {cancelled}",
                        self.wait_timeout
                    ),
                });
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Drop for NixlEngine {
    fn drop(&mut self) {
        // Let requests in flight finish (bounded), then release what is left before the
        // agents deregister their memory.
        let deadline = Instant::now() + Duration::from_secs(5).min(self.wait_timeout);
        while let Some(&k) = self.pending.keys().next() {
            if Instant::now() > deadline || self.poll(TransferTicket(k)).is_err() {
                self.finish(k);
            }
        }
        // What NIXL still cannot cancel ends with the agent (its destruction tears down the
        // UCX worker and every request on it).
        self.release_stuck();
        // The agents deregister their memory when they drop (receiver first: fields in order).
        if let Some(b) = self.remote.take() {
            drop(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `nixlSerDes` field: tag, u64 length, value, `|`.
    fn field(out: &mut Vec<u8>, tag: &str, value: &[u8]) {
        out.extend_from_slice(tag.as_bytes());
        out.extend_from_slice(&(value.len() as u64).to_le_bytes());
        out.extend_from_slice(value);
        out.push(b'|');
    }

    /// A blob of NIXL 1.5.1's layout (what `get_local_md` wrote for an agent with one UCX
    /// connection and two registered DRAM ranges, byte values aside).
    fn blob() -> Vec<u8> {
        let mut md = b"nixlSerDes|".to_vec();
        field(&mut md, "Agent", b"peer-7");
        field(&mut md, "Conns", &1u64.to_le_bytes());
        field(&mut md, "t", b"UCX");
        field(&mut md, "c", &[0x20; 48]);
        field(&mut md, "", b"MemSection");
        field(&mut md, "nixlSecElms", &1u64.to_le_bytes());
        field(&mut md, "bknd", b"UCX");
        field(&mut md, "nixlDList", b"nixlSDList");
        field(&mut md, "t", &0u32.to_le_bytes());
        field(&mut md, "n", &2u64.to_le_bytes());
        field(&mut md, "", &[1; 33]);
        field(&mut md, "", &[2; 33]);
        md
    }

    #[test]
    fn a_whole_blob_is_read_and_every_cut_refused() {
        let md = blob();
        assert_eq!(check_metadata(&md).unwrap(), "peer-7");
        for cut in 0..md.len() {
            let r = check_metadata(&md[..cut]);
            assert!(matches!(r, Err(EngineError::NixlMetadata { .. })), "cut at {cut}: {r:?}");
        }
        let mut padded = md.clone();
        padded.push(b'x');
        assert!(
            matches!(check_metadata(&padded), Err(EngineError::NixlMetadata { reason, .. }) if reason.contains("after"))
        );
        // A length that runs past the end, a section list NIXL would refuse as empty.
        let mut long = md.clone();
        long[16] = 0xff; // the Agent field's length
        assert!(check_metadata(&long).is_err());
        let mut empty = b"nixlSerDes|".to_vec();
        field(&mut empty, "Agent", b"p");
        field(&mut empty, "Conns", &0u64.to_le_bytes());
        field(&mut empty, "", b"MemSection");
        field(&mut empty, "nixlSecElms", &0u64.to_le_bytes());
        assert_eq!(check_metadata(&empty).unwrap(), "p");
        empty.truncate(empty.len() - (11 + 8 + 8 + 1)); // the nixlSecElms field, again with one section
        field(&mut empty, "nixlSecElms", &1u64.to_le_bytes());
        field(&mut empty, "bknd", b"UCX");
        field(&mut empty, "nixlDList", b"nixlSDList");
        field(&mut empty, "t", &0u32.to_le_bytes());
        field(&mut empty, "n", &0u64.to_le_bytes());
        assert!(
            matches!(check_metadata(&empty), Err(EngineError::NixlMetadata { reason, .. }) if reason.contains("empty"))
        );
    }
}
