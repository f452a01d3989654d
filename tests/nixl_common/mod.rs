//! Shared by the NIXL tests: the two-process handoff (this test binary re-run as the
//! receiver, talking over a Unix socket), and spans between registered ranges.
#![allow(dead_code)]

use crate::transfer_common::*;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use v4pool::backend::Backend;
use v4pool::model::ModelShape;
use v4pool::pool::BlockHandle;
use v4pool::pool::Pool;
use v4pool::transfer::engine::{EngineError, MemRegion, RegionId, Side, Span};
use v4pool::transfer::nixl::{NixlAgent, NixlEngine, NixlMem, NixlOptions};
use v4pool::transfer::{coalesce, Endpoint, HandoffError, Rebound, RequestKv, TransferEngine};

/// The backend a receiver's pool lives on: `cuda` (device 0) or the host.
/// `bytes` over `d`, in GB/s.
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

pub fn backend_named(name: &str) -> Arc<dyn Backend> {
    match name {
        "cuda" => Arc::new(v4pool::backend::cuda::CudaBackend::new(0).expect("CUDA device 0")),
        _ => Arc::new(v4pool::backend::host::HostBackend::new()),
    }
}

// ---- two processes -------------------------------------------------------------------------
//
// The sender (this process) and the receiver (a child) talk over a Unix socket in
// length-prefixed frames: the receiver checks the sender's hello (layout id and wire shape)
// and answers with its own, reserves a slot and the blocks, registers its pool with its own
// agent and sends its metadata and the reserved units' addresses; the sender posts one NIXL
// request and sends digests of what it sent; the receiver, having driven progress until the
// request's notification arrived, compares and checks every byte outside the request.

pub fn send_frame(s: &mut UnixStream, bytes: &[u8]) {
    s.write_all(&(bytes.len() as u64).to_le_bytes()).unwrap();
    s.write_all(bytes).unwrap();
}

pub fn recv_frame(s: &mut UnixStream) -> Option<Vec<u8>> {
    recv_frame_after(s, &[])
}

/// A frame whose first `got` bytes were already read.
pub fn recv_frame_after(s: &mut UnixStream, got: &[u8]) -> Option<Vec<u8>> {
    let mut n = [0u8; 8];
    n[..got.len()].copy_from_slice(got);
    s.read_exact(&mut n[got.len()..]).ok()?;
    let mut v = vec![0u8; u64::from_le_bytes(n) as usize];
    s.read_exact(&mut v).ok()?;
    Some(v)
}

pub fn ranges_to_bytes(r: &[(u64, u64)]) -> Vec<u8> {
    r.iter().flat_map(|&(a, n)| a.to_le_bytes().into_iter().chain(n.to_le_bytes())).collect()
}

pub fn ranges_from_bytes(b: &[u8]) -> Vec<(u64, u64)> {
    let w: Vec<u64> = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
    w.chunks_exact(2).map(|p| (p[0], p[1])).collect()
}

/// SipHash (fixed keys, so the same in both processes) of `ranges` of `pool`, concatenated,
/// read range by range.
pub fn digest(pool: &Pool, ranges: &[(u64, u64)]) -> u64 {
    let mut h = DefaultHasher::new();
    for &r in ranges {
        h.write(&read(pool, &[r]));
    }
    h.finish()
}

/// A request's units on `pool`: its blocks (in table order), then its slot.
pub fn unit_ranges(pool: &Pool, blocks: &[BlockHandle], position: i64) -> Vec<(u64, u64)> {
    let mut r = Vec::new();
    for b in blocks {
        r.extend(block_ranges(pool, b.id));
    }
    r.extend(slot_ranges(pool, position));
    r
}

/// How the child receiver behaves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// Receive the request.
    Receive,
    /// Exit right after sending its metadata; the sender loads it after the exit.
    Vanish,
    /// The same, the sender having loaded the metadata before the exit (gone before the post).
    VanishLate,
}

pub struct Peer {
    /// The receiver's process.
    pub child: Child,
    /// The channel to it.
    pub sock: UnixStream,
    dir: std::path::PathBuf,
}

/// The receiver: the caller's binary run again for `child_nixl_receiver` of `module` (the
/// caller's `module_path!()`), told over `$V4POOL_NIXL_PEER_*` what to hold.
pub fn spawn_receiver(
    module: &str,
    tag: &str,
    tokens: i64,
    blocks: i64,
    mtp: u32,
    mode: Mode,
    backend: &str,
) -> Peer {
    let dir = std::env::temp_dir().join(format!("v4pool-nixl-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let listener = UnixListener::bind(&path).unwrap();
    let envs = [
        ("V4POOL_NIXL_PEER_SOCK", path.to_str().unwrap().to_string()),
        ("V4POOL_NIXL_PEER_BLOCKS", blocks.to_string()),
        ("V4POOL_NIXL_PEER_MTP", mtp.to_string()),
        ("V4POOL_NIXL_PEER_TOKENS", tokens.to_string()),
        ("V4POOL_NIXL_PEER_MODE", format!("{mode:?}")),
        ("V4POOL_NIXL_PEER_BACKEND", backend.to_string()),
    ];
    let mut c = crate::common::child_test(module, "child_nixl_receiver");
    for (k, v) in &envs {
        c.env(k, v);
    }
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let (sock, _) = listener.accept().unwrap();
    Peer { child, sock, dir }
}

impl Peer {
    /// Wait for the receiver; unless it exited early on purpose (`vanished`), its test must
    /// have run and passed.
    pub fn finish(self, what: &str, vanished: bool) -> String {
        let Peer { child, sock, dir } = self;
        drop(sock);
        let out = child.wait_with_output().unwrap();
        let _ = std::fs::remove_dir_all(dir);
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what}: receiver failed:\n{text}");
        assert!(vanished || text.contains("1 passed"), "{what}: the receiver test did not run:\n{text}");
        text
    }
}

/// Sender side of one two-process handoff. Returns the receiver's last frame.
pub fn send_to_child(sender: &Pool, req: &RequestKv, peer: &mut Peer, mode: Mode) -> Result<String, String> {
    let Peer { child, sock: s, .. } = peer;
    // Both pools are of one kind (host, or CUDA device 0), the receiver's chosen the same way.
    let mem = NixlMem::for_backend(sender.backend().as_ref(), 0).map_err(|e| e.to_string())?;
    let me = Endpoint::new(sender);
    let mut hello = me.hello();
    hello.extend_from_slice(format!("\n{}", req.blocks.len()).as_bytes());
    send_frame(s, &hello);
    let theirs = recv_frame(s).ok_or("receiver closed before its hello")?;
    if let Some(e) = theirs.strip_prefix(b"ERR ") {
        return Err(String::from_utf8_lossy(e).into_owned());
    }
    me.check_peer(&theirs, true).map_err(|e| format!("sender refused: {e}"))?;
    let reply = recv_frame(s).ok_or("receiver closed before its reservation")?;
    if let Some(e) = reply.strip_prefix(b"ERR ") {
        return Err(String::from_utf8_lossy(e).into_owned());
    }
    let md = reply;
    let blocks = ranges_from_bytes(&recv_frame(s).ok_or("no block ranges")?);
    let slot = ranges_from_bytes(&recv_frame(s).ok_or("no slot ranges")?);
    let whole = ranges_from_bytes(&recv_frame(s).ok_or("no pool ranges")?);
    // The receiver gone (its process exited) before its metadata is loaded, or after.
    let mut gone = || assert!(child.wait().unwrap().success());
    if mode == Mode::Vanish {
        gone();
    }
    let opts = NixlOptions::default().with_wait_timeout(Duration::from_secs(20));
    let agent = NixlAgent::new(None, &opts).map_err(|e| e.to_string())?;
    let mut engine = NixlEngine::to_peer(agent, &md, (mem, mem), &opts).map_err(|e| e.to_string())?;
    if mode == Mode::VanishLate {
        send_frame(s, b"loaded");
        gone();
    }
    assert!(matches!(engine.exchange(b"a", b"b"), Err(EngineError::Nixl { call: "exchange", .. })));
    // Regions: the sender's planes and indexer pools; the receiver's likewise, only recorded
    // (the child registered them with its own agent).
    let local = register_all(&mut engine, Side::Local, &all_ranges(sender));
    let remote = register_all(&mut engine, Side::Remote, &whole);
    let sp = sender.slot_position(req.slot).unwrap();
    let src = unit_ranges(sender, &req.blocks, sp);
    let dst: Vec<(u64, u64)> = blocks.iter().chain(&slot).copied().collect();
    assert_eq!(src.len(), dst.len());
    let pairs: Vec<_> = src.into_iter().zip(dst).collect();
    let spans = spans_between(&pairs, &local, &remote);
    let bytes: u64 = spans.iter().map(|s| s.len).sum();
    let t = Instant::now();
    let posted = engine.post(&spans).and_then(|tk| engine.wait(tk));
    let took = t.elapsed();
    posted.map_err(|e| format!("transfer: {e}"))?;
    println!(
        "nixl-2proc: {} blocks, {} spans in one request, {:.1} MiB in {:.2} ms ({:.2} GB/s)",
        req.blocks.len(),
        spans.len(),
        bytes as f64 / (1 << 20) as f64,
        took.as_secs_f64() * 1e3,
        gbps(bytes, took)
    );
    let d1 = digest(sender, &unit_ranges(sender, &req.blocks, sp));
    let d2 = digest(sender, &window_ranges(sender, sp));
    send_frame(s, format!("{d1} {d2} {}", engine.agent_name()).as_bytes());
    let last = recv_frame(s).ok_or("receiver closed before its verdict")?;
    Ok(String::from_utf8_lossy(&last).into_owned())
}

/// The body of a binary's `child_nixl_receiver` test: the receiver half when run as the child
/// of a two-process test, else a visible skip (`.gpu/run` passes `--include-ignored`).
pub fn as_child_receiver(module: &str, ucx_defaults: &[(&str, &str)]) {
    if std::env::var_os("V4POOL_NIXL_PEER_SOCK").is_none() {
        println!("SKIP: child_nixl_receiver runs only as the child of a two-process NIXL test");
        return;
    }
    // The parent passed `nixl_or_skip` with this environment, so this runs here, never again.
    assert!(nixl_or_skip(module, "child_nixl_receiver", ucx_defaults), "the parent found the library");
    receiver_main();
}

/// The receiver half of a two-process handoff: what `child_nixl_receiver` runs in the child
/// (the pool on `$V4POOL_NIXL_PEER_BACKEND`: `host` or `cuda`, device 0).
pub fn receiver_main() {
    let var = |k: &str| std::env::var(k).unwrap();
    let mut s = UnixStream::connect(var("V4POOL_NIXL_PEER_SOCK")).unwrap();
    let blocks: i64 = var("V4POOL_NIXL_PEER_BLOCKS").parse().unwrap();
    let mtp: i64 = var("V4POOL_NIXL_PEER_MTP").parse().unwrap();
    let tokens: i64 = var("V4POOL_NIXL_PEER_TOKENS").parse().unwrap();
    let mode = var("V4POOL_NIXL_PEER_MODE");
    let backend = backend_named(&var("V4POOL_NIXL_PEER_BACKEND"));
    let mem = NixlMem::for_backend(backend.as_ref(), 0).unwrap();
    let (pool, _) = v4_pool(backend, &ModelShape::v4_flash(mtp).unwrap(), blocks, 2);
    poison_pool(&pool);
    let counts = pool.counts().unwrap();
    // `reserved`: a slot was taken and given back (taking one initialises its bytes), so
    // only the counts are compared; otherwise every byte must still be poison.
    let nothing_held = |why: &str, reserved: bool| {
        assert_eq!(pool.counts().unwrap(), counts, "{why}: the receiver holds something");
        let (poisoned, words) = untouched_pool(&pool);
        assert!(reserved || poisoned == words, "{why}: receiver bytes changed ({poisoned}/{words} poisoned)");
        println!("receiver: {why}, nothing held");
    };
    let hello = recv_frame(&mut s).unwrap();
    let cut = hello.iter().rposition(|&b| b == b'\n').unwrap();
    let n: usize = std::str::from_utf8(&hello[cut + 1..]).unwrap().parse().unwrap();
    let me = Endpoint::new(&pool);
    if let Err(e) = me.check_peer(&hello[..cut], false) {
        let tag = if matches!(e, HandoffError::LayoutMismatch { .. }) { "LAYOUT" } else { "SHAPE" };
        send_frame(&mut s, format!("ERR {tag}: {e}").as_bytes());
        nothing_held("refused", false);
        return;
    }
    send_frame(&mut s, &me.hello());
    // All-or-nothing reservation.
    let slot = pool.alloc_slot().unwrap();
    let mut got = Vec::new();
    for _ in 0..n {
        match pool.alloc_block() {
            Ok(b) => got.push(b.handle),
            Err(e) => {
                for b in got {
                    pool.free_block(b).unwrap();
                }
                pool.free_slot(slot.handle).unwrap();
                send_frame(&mut s, format!("ERR NOROOM for {n} blocks: {e}").as_bytes());
                nothing_held("refused", true);
                return;
            }
        }
    }
    let mut agent = NixlAgent::new(None, &NixlOptions::default()).unwrap();
    let whole = all_ranges(&pool);
    for &(a, len) in &whole {
        // SAFETY: the pool's own memory, alive until the agent is dropped below.
        unsafe { agent.register(mem, a, len).unwrap() };
    }
    let mut block_r = Vec::new();
    for b in &got {
        block_r.extend(block_ranges(&pool, b.id));
    }
    send_frame(&mut s, &agent.metadata().unwrap());
    send_frame(&mut s, &ranges_to_bytes(&block_r));
    send_frame(&mut s, &ranges_to_bytes(&slot_ranges(&pool, slot.position)));
    send_frame(&mut s, &ranges_to_bytes(&whole));
    if mode.starts_with("Vanish") {
        if mode == "VanishLate" {
            recv_frame(&mut s).unwrap(); // the sender has loaded the metadata
        }
        println!("receiver: vanishing");
        std::process::exit(0);
    }
    // Drive progress until the request's notification arrives, watching the socket.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut from = None;
    let mut stash = Vec::new();
    s.set_nonblocking(true).unwrap();
    while from.is_none() {
        for (who, msg) in agent.notifications().unwrap() {
            if msg.starts_with(b"v4pool:") {
                from = Some(who);
            }
        }
        // EOF: the sender is gone. A byte: the sender's digests frame began (kept).
        let mut probe = [0u8; 1];
        let r =
            if stash.is_empty() { s.read(&mut probe) } else { Err(std::io::ErrorKind::WouldBlock.into()) };
        if let Ok(1) = r {
            stash.push(probe[0]);
        }
        if let Ok(0) = r {
            drop(agent);
            for b in got {
                pool.free_block(b).unwrap();
            }
            pool.free_slot(slot.handle).unwrap();
            nothing_held("sender gone, reservation released", true);
            return;
        }
        assert!(Instant::now() < deadline, "no notification in 60 s");
    }
    s.set_nonblocking(false).unwrap();
    let digests = String::from_utf8(recv_frame_after(&mut s, &stash).unwrap()).unwrap();
    let d: Vec<&str> = digests.split(' ').collect();
    assert_eq!(Some(d[2]), from.as_deref(), "the notification names the sender's agent");
    let out = Rebound {
        blocks: got.clone(),
        slot,
        context_len: tokens as u64,
        spans: 0,
        bytes: 0,
        transfer_time: Duration::ZERO,
    };
    let bytes_ok = digest(&pool, &unit_ranges(&pool, &got, out.slot.position)).to_string() == d[0];
    let window_ok = digest(&pool, &window_ranges(&pool, out.slot.position)).to_string() == d[1];
    let (poisoned, words) = untouched_outside(&pool, &out);
    let verdict = if bytes_ok && window_ok && poisoned == words {
        format!("OK: {n} blocks and the slot byte-identical, window rows identical, {words} words outside untouched")
    } else {
        format!("FAIL: bytes {bytes_ok}, window rows {window_ok}, untouched {poisoned}/{words}")
    };
    send_frame(&mut s, verdict.as_bytes());
    println!("receiver: {verdict}");
    assert!(verdict.starts_with("OK"));
}

/// Poisoned words of the whole pool, and all its words.
pub fn untouched_pool(pool: &Pool) -> (u64, u64) {
    let bytes = read(pool, &all_ranges(pool));
    let poisoned =
        bytes.chunks_exact(4).filter(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == POISON).count();
    (poisoned as u64, bytes.len() as u64 / 4)
}

/// Spans copying each `(src, dst)` range pair (equal lengths) between the registered regions
/// that contain them.
/// `(address, bytes)`.
pub type Range = (u64, u64);

pub fn spans_between(
    pairs: &[(Range, Range)],
    local: &[(u64, u64, RegionId)],
    remote: &[(u64, u64, RegionId)],
) -> Vec<Span> {
    let find = |regs: &[(u64, u64, RegionId)], addr: u64| {
        let r = regs.iter().find(|r| (r.0..r.0 + r.1).contains(&addr)).unwrap();
        (r.2, addr - r.0)
    };
    let spans: Vec<Span> = pairs
        .iter()
        .map(|&((sa, sn), (da, dn))| {
            assert_eq!(sn, dn);
            let ((s, so), (d, doff)) = (find(local, sa), find(remote, da));
            Span { src: s, dst: d, src_off: so, dst_off: doff, len: sn }
        })
        .collect();
    coalesce(&spans)
}

pub fn register_all(e: &mut NixlEngine, side: Side, ranges: &[(u64, u64)]) -> Vec<(u64, u64, RegionId)> {
    ranges
        .iter()
        .map(|&(a, n)| {
            // SAFETY: the callers' ranges are a pool's memory or a live buffer, both kept alive
            // and deregistered (engine dropped) before they are freed.
            (a, n, unsafe { e.register(side, MemRegion { addr: a, len: n, item_len: n }).unwrap() })
        })
        .collect()
}
