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

use crate::common;
use crate::nixl_common;
use crate::transfer_common;

use common::{case_seed, Rng};
use nixl_common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_common::*;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::Pool;
use v4pool::transfer::engine::{EngineError, MemRegion, RegionId, Side, Span};
use v4pool::transfer::nixl::{self, NixlAgent, NixlEngine, NixlMem, NixlOptions};
use v4pool::transfer::{handoff, Endpoint, HandoffError, LocalEngine, TransferEngine};

const TOKENS: [i64; 3] = [8 << 10, 128 << 10, 1 << 20];

/// The loopback UCX settings of docs/nixl.md, where the environment sets none.
const UCX_LOOPBACK: &[(&str, &str)] =
    &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo"), ("UCX_MEM_EVENTS", "no"), ("UCX_MODULES", "^ib*")];

fn nixl_or_skip(test: &str) -> bool {
    transfer_common::nixl_or_skip(module_path!(), test, UCX_LOOPBACK)
}

fn blocks_for(tokens: i64) -> i64 {
    (tokens + 255) / 256 + 4
}

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

fn options() -> NixlOptions {
    NixlOptions::default().with_wait_timeout(Duration::from_secs(30))
}

#[test]
fn nixl_handoffs_between_two_host_pools() {
    // Two 1M-token pools of 4.2 GB at a time (held before a child may run the body).
    let _large = common::large_pools();
    if !nixl_or_skip("nixl_handoffs_between_two_host_pools") {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    for (i, &tokens) in TOKENS.iter().enumerate() {
        let mut rng = Rng::new(case_seed("nixl_pair", i as u64));
        let (sender, _) = v4_pool(host(), &model, blocks_for(tokens), 2);
        let (receiver, _) = v4_pool(host(), &model, blocks_for(tokens), 2);
        poison_pool(&receiver);
        let req = random_request(&sender, tokens, &mut rng);
        let counts = receiver.counts().unwrap();
        let mut engine = NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &options()).unwrap();
        let t = Instant::now();
        let out = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req)
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
                handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req2).unwrap();
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
    let (s, _) = v4_pool(host(), &model, 40, 2);
    let req = random_request(&s, 8 << 10, &mut Rng::new(case_seed("nixl_refusals", 0)));
    let mut engine = NixlEngine::pair(NixlMem::Dram, NixlMem::Dram, &options()).unwrap();
    // Mismatched layouts: refused before the receiver allocates or any byte moves.
    let (r0, _) = v4_pool(host(), &ModelShape::v4_flash(0).unwrap(), 40, 2);
    poison_pool(&r0);
    let (before, image) = (r0.counts().unwrap(), read(&r0, &all_ranges(&r0)));
    let err = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r0), &req).unwrap_err();
    assert!(matches!(err, HandoffError::LayoutMismatch { .. }), "{err}");
    assert_counts(&r0, before, "layout mismatch");
    assert!(read(&r0, &all_ranges(&r0)) == image, "layout mismatch: receiver bytes changed");
    // No room: fewer free blocks than the request holds.
    let (small, _) = v4_pool(host(), &model, 8, 2);
    let before = small.counts().unwrap();
    let err = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&small), &req).unwrap_err();
    assert!(matches!(err, HandoffError::NoRoom { blocks: 32, .. }), "{err}");
    assert_counts(&small, before, "no room");
    // The engine is still good after both refusals.
    let (r, _) = v4_pool(host(), &model, 40, 2);
    poison_pool(&r);
    let out = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r), &req).unwrap();
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

#[test]
fn without_the_library_every_call_is_a_typed_error() {
    for (lib, why) in [("/nonexistent/libnixl_capi.so", "not found"), ("libm.so.6", "lacks nixl_capi_")] {
        let mut c = common::child_test(module_path!(), "child_without_nixl");
        c.env("V4POOL_NIXL_LIB", lib).env("V4POOL_NIXL_EXPECT", why);
        // Nothing else on the loader path may provide the soname.
        c.env_remove("LD_LIBRARY_PATH");
        let text = common::run_child_test(c, "without the library");
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
    let (s, _) = v4_pool(b.clone(), &model, 12, 2);
    let (r, _) = v4_pool(b.clone(), &model, 12, 2);
    poison_pool(&r);
    let req = random_request(&s, 2 << 10, &mut Rng::new(3));
    let mut e = LocalEngine::new(b.clone(), b, Stream::DEFAULT);
    let out = handoff(&mut e, &Endpoint::new(&s), &Endpoint::new(&r), &req).unwrap();
    check_received("local-without-nixl", 2 << 10, &s, &r, &req, &out);
    println!("child_without_nixl: OK ({why})");
}

#[test]
fn nixl_handoffs_between_two_processes() {
    // Two 1M-token pools of 4.2 GB at a time (held before a child may run the body).
    let _large = common::large_pools();
    if !nixl_or_skip("nixl_handoffs_between_two_processes") {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    for (i, &tokens) in TOKENS.iter().enumerate() {
        let mut rng = Rng::new(case_seed("nixl_2proc", i as u64));
        let (sender, _) = v4_pool(host(), &model, blocks_for(tokens), 2);
        let req = random_request(&sender, tokens, &mut rng);
        // The sender's memory is only read: checked where hashing it twice is cheap.
        let before = (tokens < 1 << 20).then(|| digest(&sender, &all_ranges(&sender)));
        let mut peer = spawn_receiver(
            module_path!(),
            &format!("ok{i}"),
            tokens,
            blocks_for(tokens),
            1,
            Mode::Receive,
            "host",
        );
        let verdict = send_to_child(&sender, &req, &mut peer, Mode::Receive)
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
    let (sender, _) = v4_pool(host(), &model, 40, 2);
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
        let mut peer = spawn_receiver(module_path!(), tag, 8 << 10, blocks, mtp, mode, "host");
        let t = Instant::now();
        let r = send_to_child(&sender, &req, &mut peer, mode);
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
    let mut peer = spawn_receiver(module_path!(), "sendergone", 8 << 10, 40, 1, Mode::Receive, "host");
    let s = &mut peer.sock;
    let mut hello = Endpoint::new(&sender).hello();
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
    as_child_receiver(module_path!(), UCX_LOOPBACK);
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

/// A peer's metadata refused (cut short, padded) and then loaded whole: the retry loads.
/// Seen failing before the fix: NIXL had taken the peer's connection from the short copy and
/// dropped its record of it on refusing the rest, so every later load of the valid metadata
/// was "invalid parameter", for good.
#[test]
fn a_refused_peer_metadata_does_not_stick() {
    if !nixl_or_skip("a_refused_peer_metadata_does_not_stick") {
        return;
    }
    let opts = options();
    let mut a = NixlAgent::new(None, &opts).unwrap();
    let mut b = NixlAgent::new(None, &opts).unwrap();
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` outlives both agents' use of it (deregistered on drop, before `buf`).
    unsafe { a.register(NixlMem::Dram, buf.as_mut_ptr() as u64, 8192).unwrap() };
    let md = a.metadata().unwrap();
    assert_eq!(nixl::check_metadata(&md).unwrap(), a.name());
    let mut padded = md.clone();
    padded.extend_from_slice(b"garbage");
    for round in 0..2 {
        for bad in [&md[..md.len() - 1], &md[..md.len() / 2], &md[..30], &padded[..]] {
            let r = b.load_peer(bad);
            assert!(
                matches!(r, Err(EngineError::NixlMetadata { .. })),
                "round {round}, {} B: {r:?}",
                bad.len()
            );
        }
        assert_eq!(b.load_peer(&md).expect("the whole metadata loads after a refusal"), a.name());
        // A refresh of the loaded peer loads too.
        assert_eq!(b.load_peer(&md).unwrap(), a.name());
        b.forget_peer(a.name()).expect("the peer is loaded");
    }
    drop((a, b));
    drop(buf);
}

// ---- the NIXL scripts: every path they touch is an argument --------------------------------

/// The checkout's `scripts/NAME`.
fn script(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").join(name)
}

/// `scripts/nixl-gpu.sh --bins DIR` run from outside the checkout, with stand-in test
/// binaries that check they were given the unpacked bundle: no `.gpu/` folder, no packing
/// script. Seen failing before the fix: the script read `.gpu/nixl-1.5.1.tar.xz` and
/// `.gpu/tests/` of its working directory, ignored its arguments, and exited 1.
#[test]
fn nixl_gpu_takes_its_paths_as_arguments() {
    let dir = std::env::temp_dir().join(format!("v4pool-nixl-gpu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let lib = dir.join("stage/.nixl_cu13.mesonpy.libs");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(dir.join("bins/tests")).unwrap();
    std::fs::write(lib.join("libnixl_capi.so"), b"").unwrap();
    let tar = std::process::Command::new("tar")
        .args(["-cJf", "../bins/nixl-1.5.1.tar.xz", ".nixl_cu13.mesonpy.libs"])
        .current_dir(dir.join("stage"))
        .status()
        .unwrap();
    assert!(tar.success());
    // The suite binaries that hold gpu_transfer_nixl and transfer_nixl (run with a filter).
    for (name, rc) in [("gpu", 0), ("tiers", 0)] {
        let body = format!(
            "#!/bin/sh\ntest -f \"$V4POOL_NIXL_LIB\" || exit 3\necho \"test result: ok. {name}\"\nexit {rc}\n"
        );
        let p = dir.join("bins/tests").join(name);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let run = |args: &[&str]| {
        std::process::Command::new("bash")
            .arg(script("nixl-gpu.sh"))
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    let r = run(&["--bins", "bins", "--out", "out"]);
    let text = String::from_utf8_lossy(&r.stdout).into_owned() + &String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(0), "{text}");
    assert_eq!(text.matches("test result: ok").count(), 3, "{text}");
    for log in ["gpu_transfer_nixl", "gpu_transfer_nixl-tls", "transfer_nixl"] {
        assert!(dir.join("out").join(format!("{log}.log")).is_file(), "{log}.log: {text}");
    }
    // A missing binary or bundle, an unknown argument: exit 2 with a line saying so.
    let r = run(&["--bins", "bins", "--bundle", "none.tar.xz"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("none.tar.xz"));
    assert_eq!(run(&["--nope"]).status.code(), Some(2));
    assert_eq!(run(&[]).status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `scripts/nixl-bundle.sh /absolute/path.tar.xz` writes there. Seen failing before the fix:
/// it wrote to `<checkout>//absolute/path.tar.xz` (tar: Cannot write) and exited 2. Needs the
/// pinned wheel `.ci/run` downloads into target/nixl-1.5.1 (skips without it).
#[test]
fn nixl_bundle_writes_an_absolute_output_path() {
    let wheel = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/nixl-1.5.1/nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl");
    if !wheel.is_file() {
        assert!(std::env::var_os("V4POOL_REQUIRE_NIXL").is_none(), "no wheel at {}", wheel.display());
        println!("SKIP nixl_bundle_writes_an_absolute_output_path: no wheel at {}", wheel.display());
        return;
    }
    let dir = std::env::temp_dir().join(format!("v4pool-nixl-bundle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("deep/nixl.tar.xz");
    let r = std::process::Command::new("bash").arg(script("nixl-bundle.sh")).arg(&out).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let list = std::process::Command::new("tar").arg("-tJf").arg(&out).output().unwrap();
    let names = String::from_utf8_lossy(&list.stdout);
    assert!(names.lines().any(|l| l == ".nixl_cu13.mesonpy.libs/libnixl_capi.so"), "{names}");
    let _ = std::fs::remove_dir_all(&dir);
}
