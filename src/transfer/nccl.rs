//! The two-GPU engine: NCCL point-to-point send/receive between two devices of one process
//! (one communicator per device from `ncclCommInitAll`, both driven from the calling
//! thread inside one NCCL group, which is what NCCL requires of a single thread driving
//! several devices).
//!
//! NCCL is opened at run time, like the CUDA driver: nothing links it, a machine without it
//! builds and runs the crate, and [`NcclEngine::new`] returns
//! [`EngineError::NcclUnavailable`] instead of panicking. cudarc 0.19's `nccl` bindings were
//! the first choice, but its dynamic loader only tries `libnccl.so`, `libnccl.so.<CUDA
//! major>` and a few fixed majors — never `libnccl.so.2`, the name NCCL ships under (system
//! packages without `-dev`, the `nvidia-nccl-cu13` wheel) — and panics at the first call when
//! none is found. The handful of entry points used here have had a stable C ABI since NCCL
//! 2.7, so they are looked up with `libloading` from `$V4POOL_NCCL_LIB`, `libnccl.so.2`,
//! then `libnccl.so`.
//!
//! Set `NCCL_NVLS_ENABLE=0` in the environment of anything that creates an engine on the
//! lent two-GPU machines (NVLink multicast is kept off there).

use super::engine::{EngineError, MemRegion, RegionId, Registry, Side, Span, TransferEngine, TransferTicket};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, DeviceAllocation, Stream};
use cudarc::driver::sys;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

type Comm = *mut c_void;
type NcclResult = c_int;
/// `ncclUint8`.
const NCCL_UINT8: c_int = 1;
/// Bytes of the handshake buffer each side sends: a 4-byte length, then the message.
pub const HANDSHAKE_BYTES: usize = 16 << 10;

struct Nccl {
    _lib: libloading::Library,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, sys::CUstream) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, sys::CUstream) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
}

fn load() -> Result<Nccl, String> {
    let mut names: Vec<String> = Vec::new();
    if let Ok(p) = std::env::var("V4POOL_NCCL_LIB") {
        names.push(p);
    }
    names.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
    let (lib, name) = unsafe { crate::dylib::open_first("libnccl", &names) }?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's C entry point of this signature (nccl.h).
            *unsafe { lib.get($name) }.map_err(|e| format!("{name} lacks a symbol: {e}"))?
        };
    }
    Ok(Nccl {
        get_version: sym!(b"ncclGetVersion\0"),
        comm_init_all: sym!(b"ncclCommInitAll\0"),
        comm_destroy: sym!(b"ncclCommDestroy\0"),
        group_start: sym!(b"ncclGroupStart\0"),
        group_end: sym!(b"ncclGroupEnd\0"),
        send: sym!(b"ncclSend\0"),
        recv: sym!(b"ncclRecv\0"),
        error_string: sym!(b"ncclGetErrorString\0"),
        _lib: lib,
    })
}

fn nccl() -> Result<&'static Nccl, EngineError> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| EngineError::NcclUnavailable(e.clone()))
}

/// Whether NCCL can be loaded (probe only: creates nothing).
pub fn is_available() -> bool {
    nccl().is_ok()
}

/// The loaded NCCL's version code (e.g. 22703 for 2.27.3).
pub fn version() -> Result<i32, EngineError> {
    let n = nccl()?;
    let mut v = 0;
    // SAFETY: a plain out-pointer.
    check(n, "ncclGetVersion", unsafe { (n.get_version)(&mut v) })?;
    Ok(v)
}

fn check(n: &Nccl, call: &'static str, r: NcclResult) -> Result<(), EngineError> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static NUL-terminated string for every result code.
    let text = unsafe { std::ffi::CStr::from_ptr((n.error_string)(r)) }.to_string_lossy().into_owned();
    Err(EngineError::Nccl { call, message: format!("{text} ({r})") })
}

fn cu(call: &'static str, r: sys::CUresult) -> Result<(), EngineError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(EngineError::Nccl { call, message: format!("{r:?}") })
    }
}

/// NCCL between two CUDA devices of this process: `Local` regions live on the first device
/// (rank 0, the sender), `Remote` regions on the second (rank 1, the receiver).
pub struct NcclEngine {
    nccl: &'static Nccl,
    comms: [Comm; 2],
    ctxs: [sys::CUcontext; 2],
    streams: [sys::CUstream; 2],
    backends: [Arc<dyn Backend>; 2],
    scratch: Vec<(usize, DeviceAllocation)>,
    registry: Registry,
    next_ticket: u64,
}

// SAFETY: the raw handles (communicators, contexts, streams) are owned by the engine and only
// used through `&mut self`; NCCL and the driver allow use from any thread one at a time.
unsafe impl Send for NcclEngine {}

impl std::fmt::Debug for NcclEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEngine").field("backends", &self.backends).finish()
    }
}

impl NcclEngine {
    /// Communicators between the devices of `local` (sender) and `remote` (receiver), which
    /// must differ (two pools on one GPU use [`super::LocalEngine`]).
    pub fn new(local: &CudaBackend, remote: &CudaBackend) -> Result<NcclEngine, EngineError> {
        let n = nccl()?;
        let ords = [local.ordinal() as c_int, remote.ordinal() as c_int];
        if ords[0] == ords[1] {
            return Err(EngineError::NcclUnavailable(format!(
                "both sides are device {}: NCCL needs one device per rank",
                ords[0]
            )));
        }
        let mut ctxs = [std::ptr::null_mut(); 2];
        let mut streams = [std::ptr::null_mut(); 2];
        for i in 0..2 {
            let mut dev = 0;
            // SAFETY: the backends exist, so the driver is initialised; plain out-pointers.
            // The primary contexts stay retained for the process (as the backend's do).
            unsafe {
                cu("cuDeviceGet", sys::cuDeviceGet(&mut dev, ords[i]))?;
                cu("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctxs[i], dev))?;
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctxs[i]))?;
                cu(
                    "cuStreamCreate",
                    sys::cuStreamCreate(&mut streams[i], sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                )?;
            }
        }
        let mut comms = [std::ptr::null_mut(); 2];
        // SAFETY: `comms` has room for two communicators, `ords` lists two devices.
        check(n, "ncclCommInitAll", unsafe { (n.comm_init_all)(comms.as_mut_ptr(), 2, ords.as_ptr()) })?;
        Ok(NcclEngine {
            nccl: n,
            comms,
            ctxs,
            streams,
            backends: [Arc::new(local.clone()), Arc::new(remote.clone())],
            scratch: Vec::new(),
            registry: Registry::default(),
            next_ticket: 0,
        })
    }

    /// Queue `(rank, ptr)` sends and `(rank, ptr)` receives of `len` bytes as one group.
    ///
    /// # Safety
    /// Every pointer names `len` bytes of live memory on its rank's device.
    unsafe fn group(&self, ops: &[(usize, bool, u64, u64)]) -> Result<(), EngineError> {
        let n = self.nccl;
        // SAFETY: no preconditions.
        check(n, "ncclGroupStart", unsafe { (n.group_start)() })?;
        let mut first_err = Ok(());
        for &(rank, is_send, ptr, len) in ops {
            let peer = (1 - rank) as c_int;
            let (comm, stream) = (self.comms[rank], self.streams[rank]);
            let len = len as usize;
            // SAFETY: the caller's promise on `ptr`; communicator and stream belong to `rank`.
            let r = unsafe {
                if is_send {
                    (n.send)(ptr as *const c_void, len, NCCL_UINT8, peer, comm, stream)
                } else {
                    (n.recv)(ptr as *mut c_void, len, NCCL_UINT8, peer, comm, stream)
                }
            };
            if first_err.is_ok() {
                first_err = check(n, if is_send { "ncclSend" } else { "ncclRecv" }, r);
            }
        }
        // A group is always closed, even after a failed enqueue.
        // SAFETY: no preconditions.
        let end = check(n, "ncclGroupEnd", unsafe { (n.group_end)() });
        first_err.and(end)
    }

    fn synchronize(&self) -> Result<(), EngineError> {
        for i in 0..2 {
            // SAFETY: our own context and stream.
            unsafe {
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctxs[i]))?;
                cu("cuStreamSynchronize", sys::cuStreamSynchronize(self.streams[i]))?;
            }
        }
        Ok(())
    }

    /// A scratch buffer of `HANDSHAKE_BYTES` on `rank`'s device (kept for the engine's life).
    fn scratch(&mut self, rank: usize) -> Result<u64, EngineError> {
        let a = self.backends[rank].alloc_zeroed(HANDSHAKE_BYTES as u64)?;
        let ptr = a.ptr;
        self.scratch.push((rank, a));
        Ok(ptr)
    }
}

impl TransferEngine for NcclEngine {
    fn name(&self) -> &'static str {
        "nccl"
    }

    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError> {
        Ok(self.registry.insert(side, region))
    }

    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError> {
        self.registry.remove(id)
    }

    fn exchange(&mut self, local_msg: &[u8], remote_msg: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        let max = HANDSHAKE_BYTES - 4;
        for m in [local_msg, remote_msg] {
            if m.len() > max {
                return Err(EngineError::MessageTooLong { len: m.len(), max });
            }
        }
        if self.scratch.is_empty() {
            for rank in [0, 0, 1, 1] {
                self.scratch(rank)?;
            }
        }
        // scratch: rank 0 send, rank 0 receive, rank 1 send, rank 1 receive.
        let p: Vec<u64> = self.scratch.iter().map(|(_, a)| a.ptr).collect();
        for (rank, msg, at) in [(0, local_msg, p[0]), (1, remote_msg, p[2])] {
            let mut framed = vec![0u8; HANDSHAKE_BYTES];
            framed[..4].copy_from_slice(&(msg.len() as u32).to_le_bytes());
            framed[4..4 + msg.len()].copy_from_slice(msg);
            // SAFETY: `at` is a live scratch buffer of HANDSHAKE_BYTES on `rank`'s device.
            unsafe { self.backends[rank].upload(at, &framed, Stream::DEFAULT)? };
            self.backends[rank].synchronize(Stream::DEFAULT)?;
        }
        let h = HANDSHAKE_BYTES as u64;
        // SAFETY: all four are live scratch buffers of `h` bytes on their ranks' devices.
        unsafe {
            self.group(&[(0, true, p[0], h), (1, false, p[3], h), (1, true, p[2], h), (0, false, p[1], h)])?
        };
        self.synchronize()?;
        let mut got = [Vec::new(), Vec::new()];
        for (rank, at, out) in [(1, p[3], 0), (0, p[1], 1)] {
            let mut framed = vec![0u8; HANDSHAKE_BYTES];
            // SAFETY: as above.
            unsafe { self.backends[rank].download(&mut framed, at, Stream::DEFAULT)? };
            let len = (u32::from_le_bytes([framed[0], framed[1], framed[2], framed[3]]) as usize).min(max);
            got[out] = framed[4..4 + len].to_vec();
        }
        let [at_remote, at_local] = got;
        Ok((at_remote, at_local))
    }

    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError> {
        let resolved = self.registry.resolve(spans)?;
        let ops: Vec<(usize, bool, u64, u64)> = resolved
            .iter()
            .flat_map(|&(src, dst, len)| [(0, true, src, len), (1, false, dst, len)])
            .filter(|op| op.3 > 0)
            .collect();
        // SAFETY: every range lies in a registered region (checked by `resolve`), which the
        // registrant promised is live memory of that side's device.
        unsafe { self.group(&ops)? };
        let t = TransferTicket(self.next_ticket);
        self.next_ticket += 1;
        Ok(t)
    }

    fn poll(&mut self, ticket: TransferTicket) -> Result<bool, EngineError> {
        if ticket.0 >= self.next_ticket {
            return Err(EngineError::UnknownTicket(ticket));
        }
        // Work on one stream completes in order, so "both streams idle" covers every ticket.
        for i in 0..2 {
            // SAFETY: our own context and stream.
            let r = unsafe {
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctxs[i]))?;
                sys::cuStreamQuery(self.streams[i])
            };
            match r {
                sys::CUresult::CUDA_SUCCESS => {}
                sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(false),
                e => return Err(EngineError::Nccl { call: "cuStreamQuery", message: format!("{e:?}") }),
            }
        }
        Ok(true)
    }
}

impl Drop for NcclEngine {
    fn drop(&mut self) {
        let _ = self.synchronize();
        for (rank, a) in self.scratch.drain(..) {
            // SAFETY: the streams are drained; nothing else holds the scratch addresses.
            unsafe { self.backends[rank].free(a) };
        }
        for c in self.comms {
            if !c.is_null() {
                // SAFETY: created by ncclCommInitAll, destroyed once.
                unsafe { (self.nccl.comm_destroy)(c) };
            }
        }
        for i in 0..2 {
            // SAFETY: our own streams, idle after the synchronize above.
            unsafe {
                sys::cuCtxSetCurrent(self.ctxs[i]);
                sys::cuStreamDestroy_v2(self.streams[i]);
            }
        }
    }
}
