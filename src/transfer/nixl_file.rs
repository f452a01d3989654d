//! The shared tier's bytes through NIXL's POSIX plugin: the second [`TierIo`] (`docs/fleet.md`
//! "The second I/O path"), so a fleet that runs NIXL moves tier files with the same library
//! (io_uring or libaio underneath, whichever the plugin finds) that moves its KV between
//! workers.
//!
//! * **One agent per I/O object**, with one POSIX backend and no peer: a storage plugin's
//!   "remote" side is the agent itself, each file a `FILE_SEG` descriptor whose address is an
//!   offset and whose device id is the file descriptor.
//! * **Per call**, the memory side (the entry's header and the tier's staging buffer) is
//!   registered as `DRAM_SEG` and the file's range as `FILE_SEG`, one request of two (write)
//!   or one (read) descriptor pairs is posted and polled to its end, and both registrations
//!   are dropped. The staging buffer is not registered once for the tier's life because the
//!   tier grows (frees and reallocates) it without telling its I/O: a registration that
//!   outlived its memory would let NIXL match a later buffer at the same address against it.
//!   For the POSIX plugin a registration only records the range (no pinning), so this costs
//!   two map updates per call.
//! * **Never given up on**: a request is polled until NIXL says it is done or failed, like a
//!   `std::fs` read on a hung mount blocks. Returning early would hand back a buffer the
//!   kernel may still fill (reads) or read (writes).
//! * Names, `O_EXCL` creation, `fsync`, renames, removals and scans stay POSIX calls on the
//!   mount, in [`SharedTier`](super::SharedTier) and here.

use super::engine::EngineError;
use super::nixl::{NixlAgent, NixlMem, Seg, XferOp};
use super::shared_tier::{TierIo, TierReader};
use super::tier_files::open_regular;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// [`TierIo`] over NIXL's POSIX plugin (see the module docs).
#[derive(Clone)]
pub struct NixlPosix {
    agent: Arc<Mutex<NixlAgent>>,
}

impl std::fmt::Debug for NixlPosix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlPosix").finish_non_exhaustive()
    }
}

/// The POSIX plugin's parameters from `$V4POOL_NIXL_POSIX_PARAMS` (`key=value,key=value`,
/// e.g. `use_uring=true` or `use_aio=true`; none: the plugin picks its queue).
pub fn posix_params_from_env() -> Vec<(String, String)> {
    std::env::var("V4POOL_NIXL_POSIX_PARAMS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.trim().to_string(), v.trim().to_string())))
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

fn io_err(e: EngineError) -> io::Error {
    io::Error::other(e)
}

impl NixlPosix {
    /// An agent with a POSIX backend made with `params` (see [`posix_params_from_env`]).
    /// [`EngineError::NixlUnavailable`] without the library.
    pub fn new(params: &[(String, String)]) -> Result<NixlPosix, EngineError> {
        let agent = NixlAgent::with_plugin(None, c"POSIX", params)?;
        Ok(NixlPosix { agent: Arc::new(Mutex::new(agent)) })
    }

    /// [`NixlPosix::new`] with `$V4POOL_NIXL_POSIX_PARAMS`.
    pub fn from_env() -> Result<NixlPosix, EngineError> {
        NixlPosix::new(&posix_params_from_env())
    }

    /// Ranges registered with the agent now: 0 between calls (every call drops its own).
    pub fn registrations(&self) -> usize {
        self.agent.lock().map_or(usize::MAX, |a| a.registrations())
    }
}

/// Move `pieces` `(memory, file offset)` between memory and the file `fd` in one NIXL request
/// of `op`, to its end.
///
/// # Safety
/// Each memory slice stays live and untouched by anything else until this returns (for a
/// read, the pieces' memory is written); `fd` is open for the direction.
unsafe fn transfer(
    agent: &Mutex<NixlAgent>,
    op: XferOp,
    fd: i32,
    pieces: &[(u64, u64, u64)],
) -> io::Result<()> {
    let pieces: Vec<(u64, u64, u64)> = pieces.iter().copied().filter(|p| p.2 > 0).collect();
    let (Some(lo), Some(hi)) = (pieces.iter().map(|p| p.1).min(), pieces.iter().map(|p| p.1 + p.2).max())
    else {
        return Ok(());
    };
    let mut a = agent.lock().map_err(|_| io::Error::other("the NIXL agent's lock is poisoned"))?;
    let file = Seg::File(fd);
    let mem = Seg::Mem(NixlMem::Dram);
    let mut done: Vec<(Seg, u64, u64)> = Vec::new();
    let outcome = (|| {
        // SAFETY: the caller's promises: live memory, an open descriptor, both held until
        // this function returns, after every registration below is dropped.
        unsafe {
            a.register_seg(file, lo, hi - lo).map_err(io_err)?;
            done.push((file, lo, hi - lo));
            for &(addr, _, len) in &pieces {
                a.register_seg(mem, addr, len).map_err(io_err)?;
                done.push((mem, addr, len));
            }
        }
        let name = a.name().to_string();
        // SAFETY: every range was registered just above; the request is polled to its end
        // below before any of them is dropped.
        let req = unsafe { a.request(&name, op, (mem, file), &pieces, None) }.map_err(io_err)?;
        let status = loop {
            match a.status(req) {
                Ok(true) => break Ok(()),
                Ok(false) => std::thread::yield_now(),
                Err(e) => break Err(io_err(e)),
            }
        };
        // Done or failed: the request touches no byte any more. One NIXL will not release
        // stays with the agent (freed with it); nothing of ours is at risk.
        // SAFETY: created above, not used after this.
        let _ = unsafe { a.drop_request(req) };
        status
    })();
    for (what, addr, len) in done.into_iter().rev() {
        let _ = a.deregister_seg(what, addr, len);
    }
    outcome
}

impl TierIo for NixlPosix {
    fn write_file(&self, path: &Path, head: &[u8], body: &[u8], sync: bool) -> io::Result<()> {
        self.write_pieces(path, &[head, body], sync)
    }

    fn write_pieces(&self, path: &Path, pieces: &[&[u8]], sync: bool) -> io::Result<()> {
        let f = fs::OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        // Each piece at its offset in the file, all in one request.
        let mut at = 0u64;
        let ranges: Vec<(u64, u64, u64)> = pieces
            .iter()
            .map(|p| {
                at += p.len() as u64;
                (p.as_ptr() as u64, at - p.len() as u64, p.len() as u64)
            })
            .collect();
        // SAFETY: every piece is borrowed for this call; `f` is open for writing and outlives
        // the call.
        unsafe { transfer(&self.agent, XferOp::Write, f.as_raw_fd(), &ranges)? };
        // A short write the plugin did not report would leave a file readers refuse as torn;
        // report it here instead, so the tier never renames it into place.
        let want = at;
        let got = f.metadata()?.len();
        if got != want {
            return Err(io::Error::other(format!("NIXL POSIX wrote {got} of {want} bytes")));
        }
        if sync {
            f.sync_data()?;
        }
        Ok(())
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn TierReader>> {
        // Never blocking on a FIFO nor following a link, as `StdFs`.
        let file = open_regular(path, false)?;
        let len = file.metadata()?.len();
        Ok(Box::new(NixlReader { agent: self.agent.clone(), file, len }))
    }
}

struct NixlReader {
    agent: Arc<Mutex<NixlAgent>>,
    file: fs::File,
    len: u64,
}

impl TierReader for NixlReader {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        // The contract: an error if the file ends first (NIXL would read short silently).
        if offset.checked_add(dst.len() as u64).is_none_or(|end| end > self.len) {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        let pieces = [(dst.as_mut_ptr() as u64, offset, dst.len() as u64)];
        // SAFETY: `dst` is borrowed mutably for this call; the file is open for reading.
        unsafe { transfer(&self.agent, XferOp::Read, self.file.as_raw_fd(), &pieces) }
    }
}
