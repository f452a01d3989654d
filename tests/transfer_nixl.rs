//! Request handoff over NIXL (UCX), between two host pools: 8K, 128K and 1M-token V4-Flash
//! requests, with two agents in this process (the unchanged `handoff()`) and with the
//! receiver in a second process (this test binary, re-run as a child). The receiver's blocks
//! (every plane and indexer layer), whole slot and window rows byte-identical to the
//! sender's (random bytes, receiver poisoned first, every byte outside the request still
//! poisoned); refusals (mismatched layouts, no room, the peer gone) leave nothing allocated;
//! without the library every NIXL call is a typed error and the rest of v4pool works.
//!
//! The library is `$V4POOL_NIXL_LIB` (else `libnixl_capi.so` on the loader path). Without it
//! the tests print SKIP, unless `V4POOL_REQUIRE_NIXL=1`. UCX runs over TCP loopback unless the
//! environment says otherwise (`UCX_TLS`, `UCX_NET_DEVICES`; shared memory: `UCX_TLS=shm` and
//! `V4POOL_NIXL_UCX_PARAMS=ucx_error_handling_mode=none`); see docs/nixl.md.

mod common;
mod transfer_common;

use common::{case_seed, Rng};
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_common::*;
use v4pool::alloc::BlockHandle;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::Pool;
use v4pool::transfer::engine::{EngineError, MemRegion, RegionId, Side, Span};
use v4pool::transfer::nixl::{self, NixlAgent, NixlEngine, NixlMem, NixlOptions};
use v4pool::transfer::{
    coalesce, handoff, Endpoint, HandoffError, LocalEngine, Rebound, RequestKv, TransferEngine,
};

const TOKENS: [i64; 3] = [8 << 10, 128 << 10, 1 << 20];

/// The loopback UCX settings of docs/nixl.md, where the environment sets none.
const UCX_LOOPBACK: &[(&str, &str)] =
    &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo"), ("UCX_MEM_EVENTS", "no"), ("UCX_MODULES", "^ib*")];

fn nixl_or_skip(test: &str) -> bool {
    transfer_common::nixl_or_skip(test, UCX_LOOPBACK)
}

fn blocks_for(tokens: i64) -> i64 {
    (tokens + 255) / 256 + 4
}

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

fn options() -> NixlOptions {
    NixlOptions { wait_timeout: Duration::from_secs(30), ..NixlOptions::default() }
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

#[test]
fn nixl_handoffs_between_two_host_pools() {
    if !nixl_or_skip("nixl_handoffs_between_two_host_pools") {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    for (i, &tokens) in TOKENS.iter().enumerate() {
        let mut rng = Rng::new(case_seed("nixl_pair", i as u64));
        let (sender, id) = v4_pool(host(), &model, blocks_for(tokens), 2);
        let (receiver, id2) = v4_pool(host(), &model, blocks_for(tokens), 2);
        poison_pool(&receiver);
        let req = random_request(&sender, tokens, &mut rng);
        let counts = receiver.counts().unwrap();
        let mut engine = NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &options()).unwrap();
        let t = Instant::now();
        let out = handoff(&mut engine, &Endpoint::new(&sender, &id), &Endpoint::new(&receiver, &id2), &req)
            .unwrap_or_else(|e| panic!("{tokens}: {e}"));
        let total = t.elapsed();
        assert_eq!(engine.in_flight(), 0);
        let words = check_received("nixl-pair", tokens, &sender, &receiver, &req, &out);
        let c = receiver.counts().unwrap();
        assert_eq!(
            (c.free_blocks, c.free_slots),
            (counts.free_blocks - out.blocks.len() as u32, counts.free_slots - 1)
        );
        println!(
            "nixl-pair: {tokens} tokens, {} blocks, {} spans in one request, {:.1} MiB: transfer {:.2} ms \
             ({:.2} GB/s), whole handoff {:.2} ms; bytes, window rows, untouched words ({words}) OK",
            out.blocks.len(),
            out.spans,
            out.bytes as f64 / (1 << 20) as f64,
            out.transfer_time.as_secs_f64() * 1e3,
            gbps(out.bytes, out.transfer_time),
            total.as_secs_f64() * 1e3,
        );
        // The same engine again (a second request): registrations and metadata refreshed.
        if i == 0 {
            let req2 = random_request(&sender, 1 << 10, &mut rng);
            let out2 =
                handoff(&mut engine, &Endpoint::new(&sender, &id), &Endpoint::new(&receiver, &id2), &req2)
                    .unwrap();
            let sp = sender.slot_position(req2.slot).unwrap();
            let ids: Vec<u32> = req2.blocks.iter().map(|b| b.id).collect();
            let got: Vec<u32> = out2.blocks.iter().map(|b| b.id).collect();
            assert!(
                request_bytes(&sender, &ids, sp) == request_bytes(&receiver, &got, out2.slot.position),
                "second handoff on one engine"
            );
        }
    }
}

fn assert_counts(pool: &Pool, before: v4pool::pool::PoolCounts, what: &str) {
    let c = pool.counts().unwrap();
    assert_eq!(
        (c.free_blocks, c.free_slots, c.num_blocks, c.num_slots),
        (before.free_blocks, before.free_slots, before.num_blocks, before.num_slots),
        "{what}: the receiver holds something new"
    );
}

#[test]
fn nixl_refusals_leave_nothing_allocated() {
    if !nixl_or_skip("nixl_refusals_leave_nothing_allocated") {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    let (s, id) = v4_pool(host(), &model, 40, 2);
    let req = random_request(&s, 8 << 10, &mut Rng::new(case_seed("nixl_refusals", 0)));
    let mut engine = NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &options()).unwrap();
    // Mismatched layouts: refused before the receiver allocates or any byte moves.
    let (r0, id0) = v4_pool(host(), &ModelShape::v4_flash(0).unwrap(), 40, 2);
    poison_pool(&r0);
    let (before, image) = (r0.counts().unwrap(), read(&r0, &all_ranges(&r0)));
    let err = handoff(&mut engine, &Endpoint::new(&s, &id), &Endpoint::new(&r0, &id0), &req).unwrap_err();
    assert!(matches!(err, HandoffError::LayoutMismatch { .. }), "{err}");
    assert_counts(&r0, before, "layout mismatch");
    assert!(read(&r0, &all_ranges(&r0)) == image, "layout mismatch: receiver bytes changed");
    // No room: fewer free blocks than the request holds.
    let (small, _) = v4_pool(host(), &model, 8, 2);
    let before = small.counts().unwrap();
    let err = handoff(&mut engine, &Endpoint::new(&s, &id), &Endpoint::new(&small, &id), &req).unwrap_err();
    assert!(matches!(err, HandoffError::NoRoom { blocks: 32, .. }), "{err}");
    assert_counts(&small, before, "no room");
    // The engine is still good after both refusals.
    let (r, _) = v4_pool(host(), &model, 40, 2);
    poison_pool(&r);
    let out = handoff(&mut engine, &Endpoint::new(&s, &id), &Endpoint::new(&r, &id), &req).unwrap();
    check_received("nixl-after-refusals", 8 << 10, &s, &r, &req, &out);
    // Spans the engine must refuse itself (outside a region, read-side remote): nothing posted.
    let mut buf = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    let a = MemRegion { addr: buf.as_mut_ptr() as u64, len: 4096, item_len: 4096 };
    let b = MemRegion { addr: dst.as_mut_ptr() as u64, len: 4096, item_len: 4096 };
    // SAFETY: both buffers outlive the engine's use of them (deregistered below).
    let (ra, rb) =
        unsafe { (engine.register(Side::Local, a).unwrap(), engine.register(Side::Remote, b).unwrap()) };
    let bad = Span { src: ra, dst: rb, src_off: 4000, dst_off: 0, len: 200 };
    assert!(matches!(engine.post(&[bad]), Err(EngineError::OutOfRegion { .. })));
    let wrong = Span { src: rb, dst: ra, src_off: 0, dst_off: 0, len: 16 };
    assert!(matches!(engine.post(&[wrong]), Err(EngineError::WrongSide { .. })));
    assert_eq!(engine.in_flight(), 0);
    let ok = engine.post(&[Span { src: ra, dst: rb, src_off: 96, dst_off: 8, len: 3000 }]).unwrap();
    engine.wait(ok).unwrap();
    assert!(
        dst[8..3008].iter().all(|&x| x == 7)
            && dst[..8].iter().all(|&x| x == 0)
            && dst[3008..].iter().all(|&x| x == 0)
    );
    engine.deregister(ra).unwrap();
    engine.deregister(rb).unwrap();
    assert!(matches!(engine.deregister(RegionId(ra.0)), Err(EngineError::UnknownRegion(_))));
    drop(buf);
    println!("nixl-pair: refusals OK (layout mismatch, no room, bad spans), engine usable after");
}

// ---- the library absent (in a child process: the load is once per process) ----------------

fn child(test: &str, envs: &[(&str, &str)]) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--ignored", "--nocapture", "--test-threads", "1"]);
    for (k, v) in envs {
        c.env(k, v);
    }
    c
}

fn run_child(mut c: Command, what: &str) -> String {
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what}: child failed:\n{text}");
    assert!(text.contains("1 passed"), "{what}: the child test did not run:\n{text}");
    text
}

#[test]
fn without_the_library_every_call_is_a_typed_error() {
    for (lib, why) in [("/nonexistent/libnixl_capi.so", "not found"), ("libm.so.6", "lacks nixl_capi_")] {
        let mut c = child("child_without_nixl", &[("V4POOL_NIXL_LIB", lib), ("V4POOL_NIXL_EXPECT", why)]);
        // Nothing else on the loader path may provide the soname.
        c.env_remove("LD_LIBRARY_PATH");
        let text = run_child(c, "without the library");
        assert!(text.contains("child_without_nixl: OK"), "{text}");
    }
}

#[test]
#[ignore = "run as a child process by without_the_library_every_call_is_a_typed_error"]
fn child_without_nixl() {
    // Run directly (`--include-ignored`), not by its parent: nothing to be a child of.
    let Ok(expect) = std::env::var("V4POOL_NIXL_EXPECT") else {
        println!("SKIP: child_without_nixl runs only as the child of without_the_library_every_call_is_a_typed_error");
        return;
    };
    assert!(!nixl::is_available());
    let why = nixl::unavailable_reason().unwrap();
    assert!(why.contains(&expect), "{why}");
    let unavailable = |r: Result<(), EngineError>| match r {
        Err(EngineError::NixlUnavailable(m)) => assert!(m.contains(&expect), "{m}"),
        other => panic!("expected NixlUnavailable, got {other:?}"),
    };
    unavailable(NixlAgent::new(None, &NixlOptions::default()).map(drop));
    unavailable(NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &NixlOptions::default()).map(drop));
    // The rest of v4pool is unaffected: a handoff through the in-process engine.
    let model = ModelShape::v4_flash(1).unwrap();
    let b = host();
    let (s, id) = v4_pool(b.clone(), &model, 12, 2);
    let (r, _) = v4_pool(b.clone(), &model, 12, 2);
    poison_pool(&r);
    let req = random_request(&s, 2 << 10, &mut Rng::new(3));
    let mut e = LocalEngine::new(b.clone(), b, Stream::DEFAULT);
    let out = handoff(&mut e, &Endpoint::new(&s, &id), &Endpoint::new(&r, &id), &req).unwrap();
    check_received("local-without-nixl", 2 << 10, &s, &r, &req, &out);
    println!("child_without_nixl: OK ({why})");
}

// ---- two processes -------------------------------------------------------------------------
//
// The sender (this process) and the receiver (a child) talk over a Unix socket in
// length-prefixed frames: the receiver checks the sender's hello (layout id and wire shape)
// and answers with its own, reserves a slot and the blocks, registers its pool with its own
// agent and sends its metadata and the reserved units' addresses; the sender posts one NIXL
// request and sends digests of what it sent; the receiver, having driven progress until the
// request's notification arrived, compares and checks every byte outside the request.

fn send_frame(s: &mut UnixStream, bytes: &[u8]) {
    s.write_all(&(bytes.len() as u64).to_le_bytes()).unwrap();
    s.write_all(bytes).unwrap();
}

fn recv_frame(s: &mut UnixStream) -> Option<Vec<u8>> {
    recv_frame_after(s, &[])
}

/// A frame whose first `got` bytes were already read.
fn recv_frame_after(s: &mut UnixStream, got: &[u8]) -> Option<Vec<u8>> {
    let mut n = [0u8; 8];
    n[..got.len()].copy_from_slice(got);
    s.read_exact(&mut n[got.len()..]).ok()?;
    let mut v = vec![0u8; u64::from_le_bytes(n) as usize];
    s.read_exact(&mut v).ok()?;
    Some(v)
}

fn ranges_to_bytes(r: &[(u64, u64)]) -> Vec<u8> {
    r.iter().flat_map(|&(a, n)| a.to_le_bytes().into_iter().chain(n.to_le_bytes())).collect()
}

fn ranges_from_bytes(b: &[u8]) -> Vec<(u64, u64)> {
    let w: Vec<u64> = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
    w.chunks_exact(2).map(|p| (p[0], p[1])).collect()
}

/// SipHash (fixed keys, so the same in both processes) of `ranges` of `pool`, concatenated,
/// read range by range.
fn digest(pool: &Pool, ranges: &[(u64, u64)]) -> u64 {
    let mut h = DefaultHasher::new();
    for &r in ranges {
        h.write(&read(pool, &[r]));
    }
    h.finish()
}

/// A request's units on `pool`: its blocks (in table order), then its slot.
fn unit_ranges(pool: &Pool, blocks: &[BlockHandle], position: i64) -> Vec<(u64, u64)> {
    let mut r = Vec::new();
    for b in blocks {
        r.extend(block_ranges(pool, b.id));
    }
    r.extend(slot_ranges(pool, position));
    r
}

/// How the child receiver behaves.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Receive the request.
    Receive,
    /// Exit right after sending its metadata; the sender loads it after the exit.
    Vanish,
    /// The same, the sender having loaded the metadata before the exit (gone before the post).
    VanishLate,
}

struct Peer {
    child: Child,
    sock: UnixStream,
    dir: std::path::PathBuf,
}

fn spawn_receiver(tag: &str, tokens: i64, blocks: i64, mtp: u32, mode: Mode) -> Peer {
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
    ];
    let mut c = child("child_nixl_receiver", &[]);
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
    fn finish(self, what: &str, vanished: bool) -> String {
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
fn send_to_child(
    sender: &Pool,
    id: &str,
    req: &RequestKv,
    peer: &mut Peer,
    mode: Mode,
) -> Result<String, String> {
    let Peer { child, sock: s, .. } = peer;
    let me = Endpoint::new(sender, id);
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
    let opts = NixlOptions { wait_timeout: Duration::from_secs(20), ..NixlOptions::default() };
    let agent = NixlAgent::new(None, &opts).map_err(|e| e.to_string())?;
    let mut engine =
        NixlEngine::to_peer(agent, &md, (NixlMem::Dram, NixlMem::Dram), &opts).map_err(|e| e.to_string())?;
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

#[test]
fn nixl_handoffs_between_two_processes() {
    if !nixl_or_skip("nixl_handoffs_between_two_processes") {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    for (i, &tokens) in TOKENS.iter().enumerate() {
        let mut rng = Rng::new(case_seed("nixl_2proc", i as u64));
        let (sender, id) = v4_pool(host(), &model, blocks_for(tokens), 2);
        let req = random_request(&sender, tokens, &mut rng);
        // The sender's memory is only read: checked where hashing it twice is cheap.
        let before = (tokens < 1 << 20).then(|| digest(&sender, &all_ranges(&sender)));
        let mut peer = spawn_receiver(&format!("ok{i}"), tokens, blocks_for(tokens), 1, Mode::Receive);
        let verdict = send_to_child(&sender, &id, &req, &mut peer, Mode::Receive)
            .unwrap_or_else(|e| panic!("{tokens}: {e}"));
        let text = peer.finish("two-process handoff", false);
        assert!(verdict.starts_with("OK"), "{tokens}: receiver says {verdict}\n{text}");
        println!("nixl-2proc: {tokens} tokens: receiver: {verdict}");
        if let Some(before) = before {
            assert_eq!(digest(&sender, &all_ranges(&sender)), before, "the sender's bytes changed");
        }
    }
}

#[test]
fn nixl_two_process_refusals_and_the_peer_gone() {
    if !nixl_or_skip("nixl_two_process_refusals_and_the_peer_gone") {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    let (sender, id) = v4_pool(host(), &model, 40, 2);
    let req = random_request(&sender, 8 << 10, &mut Rng::new(case_seed("nixl_2proc_refusals", 0)));
    let counts = sender.counts().unwrap();
    let image = read(&sender, &all_ranges(&sender));
    let cases = [
        ("layout", 40, 0, Mode::Receive, "LAYOUT"),
        ("noroom", 8, 1, Mode::Receive, "NOROOM"),
        ("vanish", 40, 1, Mode::Vanish, "load_remote_md failed"),
        ("vanish-late", 40, 1, Mode::VanishLate, "transfer:"),
    ];
    for (tag, blocks, mtp, mode, want) in cases {
        let mut peer = spawn_receiver(tag, 8 << 10, blocks, mtp, mode);
        let t = Instant::now();
        let r = send_to_child(&sender, &id, &req, &mut peer, mode);
        let err = r.expect_err(tag);
        assert!(err.contains(want), "{tag}: {err}");
        let text = peer.finish(tag, mode != Mode::Receive);
        if mode == Mode::Receive {
            assert!(text.contains("receiver: refused, nothing held"), "{tag}: {text}");
        }
        println!("nixl-2proc: {tag}: refused in {:.2} s: {err}", t.elapsed().as_secs_f64());
        // The sender still holds its request, bytes unchanged.
        assert_eq!(sender.counts().unwrap(), counts);
        assert!(read(&sender, &all_ranges(&sender)) == image, "{tag}: sender bytes changed");
    }
    // The sender gone after the receiver reserved: the receiver releases everything.
    let mut peer = spawn_receiver("sendergone", 8 << 10, 40, 1, Mode::Receive);
    let s = &mut peer.sock;
    let mut hello = Endpoint::new(&sender, &id).hello();
    hello.extend_from_slice(format!("\n{}", req.blocks.len()).as_bytes());
    send_frame(s, &hello);
    for _ in 0..5 {
        recv_frame(s).unwrap(); // hello, metadata, block, slot and pool ranges
    }
    let text = peer.finish("sender gone", false);
    assert!(text.contains("receiver: sender gone, reservation released, nothing held"), "{text}");
    println!("nixl-2proc: sender gone: the receiver released its reservation");
}

/// The receiver half, run in a child process by the two tests above.
#[test]
#[ignore = "run as a child process by the two-process NIXL tests"]
fn child_nixl_receiver() {
    if std::env::var_os("V4POOL_NIXL_PEER_SOCK").is_none() {
        println!("SKIP: child_nixl_receiver runs only as the child of the two-process NIXL tests");
        return;
    }
    assert!(nixl_or_skip("child_nixl_receiver"), "the parent found the library");
    let var = |k: &str| std::env::var(k).unwrap();
    let mut s = UnixStream::connect(var("V4POOL_NIXL_PEER_SOCK")).unwrap();
    let blocks: i64 = var("V4POOL_NIXL_PEER_BLOCKS").parse().unwrap();
    let mtp: i64 = var("V4POOL_NIXL_PEER_MTP").parse().unwrap();
    let tokens: i64 = var("V4POOL_NIXL_PEER_TOKENS").parse().unwrap();
    let mode = var("V4POOL_NIXL_PEER_MODE");
    let (pool, id) = v4_pool(host(), &ModelShape::v4_flash(mtp).unwrap(), blocks, 2);
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
    let me = Endpoint::new(&pool, &id);
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
        unsafe { agent.register(NixlMem::Dram, a, len).unwrap() };
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
fn untouched_pool(pool: &Pool) -> (u64, u64) {
    let bytes = read(pool, &all_ranges(pool));
    let poisoned =
        bytes.chunks_exact(4).filter(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == POISON).count();
    (poisoned as u64, bytes.len() as u64 / 4)
}

/// Spans copying each `(src, dst)` range pair (equal lengths) between the registered regions
/// that contain them.
/// `(address, bytes)`.
type Range = (u64, u64);

fn spans_between(
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

fn register_all(e: &mut NixlEngine, side: Side, ranges: &[(u64, u64)]) -> Vec<(u64, u64, RegionId)> {
    ranges
        .iter()
        .map(|&(a, n)| {
            // SAFETY: the callers' ranges are a pool's memory or a live buffer, both kept alive
            // and deregistered (engine dropped) before they are freed.
            (a, n, unsafe { e.register(side, MemRegion { addr: a, len: n, item_len: n }).unwrap() })
        })
        .collect()
}

/// Offload through the engine: a request's block units written into a DRAM buffer of another
/// agent (the spill, local → remote, what the trait's spans do), then — the blocks freed —
/// written back into fresh blocks by a second engine with the roles swapped (the trait has no
/// read), byte-exact.
#[test]
fn nixl_offload_to_a_dram_agent_and_back() {
    if !nixl_or_skip("nixl_offload_to_a_dram_agent_and_back") {
        return;
    }
    let (pool, _) = v4_pool(host(), &ModelShape::v4_flash(1).unwrap(), 24, 2);
    let req = random_request(&pool, 4 << 10, &mut Rng::new(case_seed("nixl_offload", 0)));
    let units: Vec<Vec<(u64, u64)>> = req.blocks.iter().map(|b| block_ranges(&pool, b.id)).collect();
    let unit_bytes: u64 = units[0].iter().map(|r| r.1).sum();
    let want: Vec<Vec<u8>> = units.iter().map(|u| read(&pool, u)).collect();
    let mut buf = vec![0x5au8; (unit_bytes as usize) * units.len()];
    let base = buf.as_mut_ptr() as u64;
    // Unit i's ranges, packed in the buffer from i * unit_bytes.
    let packed = |u: &[(u64, u64)], i: usize| {
        let mut at = base + i as u64 * unit_bytes;
        u.iter()
            .map(|&(_, n)| {
                at += n;
                (at - n, n)
            })
            .collect::<Vec<_>>()
    };
    let opts = options();
    let mut spill = NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &opts).unwrap();
    spill.exchange(b"spill", b"tier").unwrap();
    let l = register_all(&mut spill, Side::Local, &all_ranges(&pool));
    let r = register_all(&mut spill, Side::Remote, &[(base, buf.len() as u64)]);
    let pairs: Vec<_> =
        units.iter().enumerate().flat_map(|(i, u)| u.iter().copied().zip(packed(u, i))).collect();
    let spans = spans_between(&pairs, &l, &r);
    let t = spill.post(&spans).unwrap();
    spill.wait(t).unwrap();
    drop(spill);
    assert!(buf.chunks(unit_bytes as usize).zip(&want).all(|(a, b)| a == &b[..]), "the spilled units differ");
    for b in &req.blocks {
        pool.free_block(*b).unwrap();
    }
    poison_pool(&pool);
    let fresh: Vec<_> = (0..units.len()).map(|_| pool.alloc_block().unwrap().handle).collect();
    let mut restore = NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &opts).unwrap();
    restore.exchange(b"tier", b"restore").unwrap();
    let l = register_all(&mut restore, Side::Local, &[(base, buf.len() as u64)]);
    let r = register_all(&mut restore, Side::Remote, &all_ranges(&pool));
    let pairs: Vec<_> = units
        .iter()
        .enumerate()
        .flat_map(|(i, u)| packed(u, i).into_iter().zip(block_ranges(&pool, fresh[i].id)))
        .collect();
    let spans = spans_between(&pairs, &l, &r);
    let t = restore.post(&spans).unwrap();
    restore.wait(t).unwrap();
    drop(restore);
    for (i, b) in fresh.iter().enumerate() {
        assert!(read(&pool, &block_ranges(&pool, b.id)) == want[i], "restored unit {i} differs");
    }
    println!(
        "nixl-offload: {} units of {} KiB spilled to a DRAM agent and restored into fresh blocks, {} spans each way",
        units.len(),
        unit_bytes >> 10,
        spans.len()
    );
}
