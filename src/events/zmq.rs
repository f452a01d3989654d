//! libzmq (the ZeroMQ library vLLM's pyzmq, Dynamo and llm-d speak to) loaded at run time:
//! twelve hand-written declarations of its stable C API (`zmq.h`, libzmq 4.x, soname
//! `libzmq.so.5`), opened with `libloading` as the CUDA, HIP and NIXL libraries are — so
//! v4pool builds and links anywhere and an engine without libzmq gets a typed error, not a
//! link failure. `V4POOL_ZMQ_LIB` names the library when it is not on the loader path.
//!
//! Only what the publisher and its test subscriber need: a context, PUB / SUB / ROUTER /
//! DEALER sockets, bind / connect, a few options, multipart send and receive, poll.

use super::EventsError;
use std::ffi::{c_char, c_int, c_short, c_void, CStr, CString};
use std::sync::OnceLock;

pub(crate) const PUB: c_int = 1;
pub(crate) const SUB: c_int = 2;
pub(crate) const DEALER: c_int = 5;
pub(crate) const ROUTER: c_int = 6;
const SNDMORE: c_int = 2;
const SUBSCRIBE: c_int = 6;
const RCVMORE: c_int = 13;
const LINGER: c_int = 17;
const MAXMSGSIZE: c_int = 22;
const SNDHWM: c_int = 23;
const RCVTIMEO: c_int = 27;
const LAST_ENDPOINT: c_int = 32;
const POLLIN: c_short = 1;

#[repr(C)]
struct PollItem {
    socket: *mut c_void,
    fd: c_int,
    events: c_short,
    revents: c_short,
}

type CtxNew = unsafe extern "C" fn() -> *mut c_void;
type CtxTerm = unsafe extern "C" fn(*mut c_void) -> c_int;
type SocketFn = unsafe extern "C" fn(*mut c_void, c_int) -> *mut c_void;
type Close = unsafe extern "C" fn(*mut c_void) -> c_int;
type Endpoint = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;
type SetOpt = unsafe extern "C" fn(*mut c_void, c_int, *const c_void, usize) -> c_int;
type GetOpt = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut usize) -> c_int;
type SendFn = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
type Recv = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> c_int;
type Poll = unsafe extern "C" fn(*mut PollItem, c_int, std::ffi::c_long) -> c_int;
type Errno = unsafe extern "C" fn() -> c_int;
type StrError = unsafe extern "C" fn(c_int) -> *const c_char;

struct Zmq {
    ctx_new: CtxNew,
    ctx_term: CtxTerm,
    socket: SocketFn,
    close: Close,
    bind: Endpoint,
    connect: Endpoint,
    setsockopt: SetOpt,
    getsockopt: GetOpt,
    send: SendFn,
    recv: Recv,
    poll: Poll,
    errno: Errno,
    strerror: StrError,
    _lib: libloading::Library,
}

fn load() -> Result<Zmq, String> {
    // An explicit library is the only one tried: a wrong path is an error, not a fallback.
    let names: Vec<String> = match std::env::var("V4POOL_ZMQ_LIB") {
        Ok(lib) => vec![lib],
        Err(_) => vec!["libzmq.so.5".to_string(), "libzmq.so".to_string()],
    };
    // SAFETY: loading libzmq runs its initialisers, which have no preconditions.
    let (lib, name) = unsafe { crate::dylib::open_first("libzmq", &names) }?;
    macro_rules! sym {
        ($s:literal) => {
            // SAFETY: the symbol is libzmq's C entry point of the declared signature
            // (zmq.h, libzmq 4.x).
            *unsafe { lib.get(concat!("zmq_", $s, "\0").as_bytes()) }
                .map_err(|e| format!("{name} lacks zmq_{}: {e}", $s))?
        };
    }
    Ok(Zmq {
        ctx_new: sym!("ctx_new"),
        ctx_term: sym!("ctx_term"),
        socket: sym!("socket"),
        close: sym!("close"),
        bind: sym!("bind"),
        connect: sym!("connect"),
        setsockopt: sym!("setsockopt"),
        getsockopt: sym!("getsockopt"),
        send: sym!("send"),
        recv: sym!("recv"),
        poll: sym!("poll"),
        errno: sym!("errno"),
        strerror: sym!("strerror"),
        _lib: lib,
    })
}

fn zmq() -> Result<&'static Zmq, EventsError> {
    static LIB: OnceLock<Result<Zmq, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| EventsError::ZmqUnavailable(e.clone()))
}

/// Why libzmq cannot be loaded, or `None` when it can.
pub fn unavailable_reason() -> Option<String> {
    match zmq() {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// The error of the last failed call, as libzmq describes it.
fn last_error(z: &Zmq, call: &'static str) -> EventsError {
    // SAFETY: no arguments; `zmq_strerror` returns a static NUL-terminated string.
    let message = unsafe {
        let n = (z.errno)();
        CStr::from_ptr((z.strerror)(n)).to_string_lossy().into_owned()
    };
    EventsError::Zmq { call, message }
}

/// A libzmq context (terminated on drop, after its sockets are closed).
pub(crate) struct Context {
    z: &'static Zmq,
    ctx: *mut c_void,
}

// SAFETY: a libzmq context is thread-safe (zmq.h: "contexts are thread safe").
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn new() -> Result<Context, EventsError> {
        let z = zmq()?;
        // SAFETY: no arguments.
        let ctx = unsafe { (z.ctx_new)() };
        if ctx.is_null() {
            return Err(last_error(z, "zmq_ctx_new"));
        }
        Ok(Context { z, ctx })
    }

    /// A socket of `kind` with linger 0 (closing never waits for unsent messages).
    pub(crate) fn socket(self: &std::sync::Arc<Self>, kind: c_int) -> Result<Socket, EventsError> {
        // SAFETY: a live context.
        let s = unsafe { (self.z.socket)(self.ctx, kind) };
        if s.is_null() {
            return Err(last_error(self.z, "zmq_socket"));
        }
        let sock = Socket { z: self.z, s, _ctx: self.clone() };
        sock.set_int(LINGER, 0)?;
        Ok(sock)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every socket holds an Arc of this context, so all are closed by now.
        unsafe { (self.z.ctx_term)(self.ctx) };
    }
}

/// One libzmq socket, used by one thread at a time (closed on drop).
pub(crate) struct Socket {
    z: &'static Zmq,
    s: *mut c_void,
    _ctx: std::sync::Arc<Context>,
}

// SAFETY: a libzmq socket may move between threads as long as one thread uses it at a time
// (zmq.h); `Socket` is not `Sync` and every call takes it by reference from its owner.
unsafe impl Send for Socket {}

fn cstring(s: &str) -> Result<CString, EventsError> {
    CString::new(s).map_err(|_| EventsError::BadEndpoint(s.to_string()))
}

impl Socket {
    fn check(&self, call: &'static str, rc: c_int) -> Result<c_int, EventsError> {
        if rc < 0 {
            Err(last_error(self.z, call))
        } else {
            Ok(rc)
        }
    }

    fn set_int(&self, opt: c_int, v: c_int) -> Result<(), EventsError> {
        // SAFETY: a live socket; the option value is a C int of the size given.
        let rc = unsafe {
            (self.z.setsockopt)(self.s, opt, (&v as *const c_int).cast(), std::mem::size_of::<c_int>())
        };
        self.check("zmq_setsockopt", rc).map(drop)
    }

    /// Peers sending a frame longer than `bytes` are disconnected (`ZMQ_MAXMSGSIZE`, an
    /// int64): libzmq checks each inbound frame's header against it before allocating the
    /// frame — subscriptions and ZMTP commands included, on every socket type — so a peer
    /// never makes this side hold more than `bytes` for a frame. Set before bind / connect
    /// (libzmq reads it when a connection's engine starts).
    pub(crate) fn set_max_inbound_frame(&self, bytes: usize) -> Result<(), EventsError> {
        let v = i64::try_from(bytes).unwrap_or(i64::MAX);
        // SAFETY: a live socket; the option value is an int64 of the size given.
        let rc = unsafe {
            (self.z.setsockopt)(self.s, MAXMSGSIZE, (&v as *const i64).cast(), std::mem::size_of::<i64>())
        };
        self.check("zmq_setsockopt", rc).map(drop)
    }

    /// The send high-water mark (messages queued per peer before new ones are dropped).
    pub(crate) fn set_send_hwm(&self, n: i32) -> Result<(), EventsError> {
        self.set_int(SNDHWM, n)
    }

    /// Receive calls time out after `ms` (an error then; -1: wait forever).
    pub(crate) fn set_recv_timeout(&self, ms: i32) -> Result<(), EventsError> {
        self.set_int(RCVTIMEO, ms)
    }

    /// Subscribe a SUB socket to messages whose first frame starts with `prefix`.
    pub(crate) fn subscribe(&self, prefix: &[u8]) -> Result<(), EventsError> {
        // SAFETY: a live socket; the value is `prefix.len()` readable bytes.
        let rc = unsafe { (self.z.setsockopt)(self.s, SUBSCRIBE, prefix.as_ptr().cast(), prefix.len()) };
        self.check("zmq_setsockopt", rc).map(drop)
    }

    pub(crate) fn bind(&self, endpoint: &str) -> Result<(), EventsError> {
        let c = cstring(endpoint)?;
        // SAFETY: a live socket and a NUL-terminated string.
        let rc = unsafe { (self.z.bind)(self.s, c.as_ptr()) };
        self.check("zmq_bind", rc).map(drop)
    }

    pub(crate) fn connect(&self, endpoint: &str) -> Result<(), EventsError> {
        let c = cstring(endpoint)?;
        // SAFETY: a live socket and a NUL-terminated string.
        let rc = unsafe { (self.z.connect)(self.s, c.as_ptr()) };
        self.check("zmq_connect", rc).map(drop)
    }

    /// The endpoint the socket last bound (a wildcard port resolved).
    pub(crate) fn last_endpoint(&self) -> Result<String, EventsError> {
        let mut buf = [0u8; 1024];
        let mut len = buf.len();
        // SAFETY: a live socket; `buf` has `len` writable bytes, `len` is updated.
        let rc = unsafe { (self.z.getsockopt)(self.s, LAST_ENDPOINT, buf.as_mut_ptr().cast(), &mut len) };
        self.check("zmq_getsockopt", rc)?;
        let text = &buf[..len.min(buf.len())];
        Ok(String::from_utf8_lossy(text.split(|&b| b == 0).next().unwrap_or(&[])).into_owned())
    }

    /// Send `frames` as one multipart message.
    pub(crate) fn send_multipart(&self, frames: &[&[u8]]) -> Result<(), EventsError> {
        for (i, f) in frames.iter().enumerate() {
            let flags = if i + 1 < frames.len() { SNDMORE } else { 0 };
            // SAFETY: a live socket; `f` is `f.len()` readable bytes, copied by libzmq.
            let rc = unsafe { (self.z.send)(self.s, f.as_ptr().cast(), f.len(), flags) };
            self.check("zmq_send", rc)?;
        }
        Ok(())
    }

    /// Receive one multipart message of at most `max_frames` frames, each at most
    /// `max_frame` bytes. A longer frame or message is an error, and the rest of that message
    /// is read and dropped (so the next call starts at a message boundary). Only the bytes
    /// received are kept: a peer sending many short frames costs what it sends, not
    /// `max_frame` each. An error on the receive timeout.
    pub(crate) fn recv_multipart(
        &self,
        max_frame: usize,
        max_frames: usize,
    ) -> Result<Vec<Vec<u8>>, EventsError> {
        let mut frames = Vec::new();
        let mut buf = vec![0u8; max_frame];
        let mut refused = None;
        loop {
            // SAFETY: a live socket; `buf` has `max_frame` writable bytes.
            let n = unsafe { (self.z.recv)(self.s, buf.as_mut_ptr().cast(), buf.len(), 0) };
            let n = self.check("zmq_recv", n)? as usize;
            if refused.is_none() {
                if n > max_frame {
                    refused = Some(format!("a frame of {n} bytes (at most {max_frame})"));
                } else if frames.len() == max_frames {
                    refused = Some(format!("more than {max_frames} frames"));
                } else {
                    frames.push(buf[..n].to_vec());
                }
            }
            let mut more: c_int = 0;
            let mut len = std::mem::size_of::<c_int>();
            // SAFETY: a live socket; `more` is a C int of `len` bytes.
            let rc =
                unsafe { (self.z.getsockopt)(self.s, RCVMORE, (&mut more as *mut c_int).cast(), &mut len) };
            self.check("zmq_getsockopt", rc)?;
            if more == 0 {
                return match refused {
                    None => Ok(frames),
                    Some(message) => Err(EventsError::Zmq { call: "zmq_recv", message }),
                };
            }
        }
    }

    /// Whether a message is waiting, within `timeout_ms`.
    pub(crate) fn poll_in(&self, timeout_ms: i64) -> Result<bool, EventsError> {
        let mut item = PollItem { socket: self.s, fd: 0, events: POLLIN, revents: 0 };
        // SAFETY: one poll item naming a live socket.
        let rc = unsafe { (self.z.poll)(&mut item, 1, timeout_ms as std::ffi::c_long) };
        Ok(self.check("zmq_poll", rc)? > 0 && item.revents & POLLIN != 0)
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        // SAFETY: a live socket, closed once.
        unsafe { (self.z.close)(self.s) };
    }
}
