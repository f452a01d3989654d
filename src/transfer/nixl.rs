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
//! How the [`TransferEngine`](super::engine::TransferEngine) calls map onto NIXL:
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

mod engine;
mod ffi;
mod metadata;

pub use engine::{ticket_notification, NixlEngine};
use ffi::{
    check, cstring, free, nixl, AgentConfig, Handle, Nixl, IN_PROG, MEM_DRAM, MEM_FILE, MEM_VRAM, SUCCESS,
    XFER_READ, XFER_WRITE,
};
pub use ffi::{is_available, mem_type_name, unavailable_reason, FILE_SEG};
pub use metadata::check_metadata;

use super::engine::EngineError;
use crate::backend::{Backend, BackendKind};
use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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

/// How agents are made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NixlOptions {
    /// UCX backend parameters (`ucx_error_handling_mode=none` for shared memory, per NIXL's
    /// UCX plugin). Default: `$V4POOL_NIXL_UCX_PARAMS` as `key=value,key=value`, else none.
    pub backend_params: Vec<(String, String)>,
    /// How long [`TransferEngine::wait`](super::engine::TransferEngine::wait) polls before giving up (a peer gone mid-transfer).
    pub wait_timeout: Duration,
}

crate::setters::with_setters!(NixlOptions {
    with_backend_params(backend_params: Vec<(String, String)>),
    with_wait_timeout(wait_timeout: Duration),
});

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
