//! The §9 DSpark window gather on the host backend (the kernels' reference) through the
//! pool-level handle: V4-Flash and V4-Pro, MTP rings 129..133, fp8 two planes and bf16 one
//! plane, class rings and carried (`state_window`) windows, batches 1..1024, anchors near 0
//! (zero rows) and large, compared with the window computed from the spec's formulas; typed
//! errors before any launch; and the kernel source itself (the C++ emulation) against the
//! host reference on random raw inputs with poisoned outputs.

use crate::common;
use crate::gather_common;

use common::{case_seed, Rng};
use gather_common::{batch, expected, fill, model_pool, models, source_layers};
use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;
use v4pool::backend::Stream;
use v4pool::pool::Pool;
use v4pool::raw::index::host::run_launch;
use v4pool::raw::index::shape::launch_shape;
use v4pool::raw::index::{Launch, WindowGatherArgs};
use v4pool::state::gather::{GatherCapacity, GatherError, GatherSeq};

fn host_pool(model: &v4pool::model::ModelShape, fp8: bool) -> Arc<Pool> {
    model_pool(Arc::new(common::host()), model, fp8, 4, 3)
}

#[test]
fn gathers_every_source_as_the_spec_says() {
    let mut rng = Rng::new(case_seed("window-gather-host", 0));
    for model in models() {
        for fp8 in [true, false] {
            let pool = host_pool(&model, fp8);
            let leases: Vec<_> = (0..3).map(|_| pool.alloc_slot().unwrap()).collect();
            fill(&pool, &leases, &mut rng);
            let ring = pool.spec().geometry.ring_slots as usize;
            let mut g = pool.window_gather(GatherCapacity::new(1024, ring)).unwrap();
            for layer in source_layers(&model) {
                for (n, wd) in [(1, ring), (5, 128), (1024, 2), (3, 1)] {
                    let b = batch(&mut rng, &leases, n, wd);
                    assert_eq!(g.stage(&b).unwrap(), n);
                    g.gather(layer, wd).unwrap();
                    let got = g.read_output().unwrap();
                    let want = expected(&pool, layer, &b, wd);
                    assert!(
                        got == want,
                        "{} fp8={fp8} layer {layer} n={n} wd={wd}: first difference at element {:?}",
                        model.name,
                        got.iter().zip(&want).position(|(a, b)| a != b)
                    );
                }
            }
            println!("ok {} fp8={fp8} ring {ring}: layers {:?}", model.name, source_layers(&model));
        }
    }
}

#[test]
fn pads_and_rows_past_the_batch_are_never_written() {
    let mut rng = Rng::new(case_seed("window-gather-pads", 0));
    let model = v4pool::model::ModelShape::v4_flash(1).unwrap();
    let pool = host_pool(&model, true);
    let leases: Vec<_> = (0..3).map(|_| pool.alloc_slot().unwrap()).collect();
    fill(&pool, &leases, &mut rng);
    let (cap, wd, layer) = (8, 7, source_layers(&model)[1]);
    let g0 = pool.window_gather(GatherCapacity::new(cap, 0)).unwrap();
    let mut g = g0;
    let be = pool.backend();
    let out = be.alloc_zeroed((cap * wd * 1024) as u64).unwrap();
    for n in [8, 3, 0, 5] {
        let poison = vec![0xa5u8; cap * wd * 1024];
        // SAFETY: a live allocation of exactly these bytes.
        unsafe { be.upload(out.ptr, &poison, Stream::DEFAULT).unwrap() };
        let b = batch(&mut rng, &leases, n, wd);
        g.stage(&b).unwrap();
        // SAFETY: `out` holds max_seqs × wd rows of this backend, apart from the pool.
        unsafe { g.gather_into(layer, wd, out.ptr).unwrap() };
        let mut got = vec![0u8; cap * wd * 1024];
        // SAFETY: as above.
        unsafe { be.download(&mut got, out.ptr, Stream::DEFAULT).unwrap() };
        let split = n * wd * 1024;
        let want: Vec<u8> = expected(&pool, layer, &b, wd).iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert!(got[..split] == want[..], "batch of {n}: the staged rows differ");
        assert!(got[split..].iter().all(|&x| x == 0xa5), "batch of {n}: a pad row was written");
    }
    be.synchronize(Stream::DEFAULT).unwrap();
    // SAFETY: the stream is drained; nothing uses `out` again.
    unsafe { be.free(out) };
}

#[test]
fn bad_input_is_a_typed_error_before_any_launch() {
    let model = v4pool::model::ModelShape::v4_flash_dspark(3, v4pool::model::DraftMode::Absent).unwrap();
    let pool = host_pool(&model, true);
    let a = pool.alloc_slot().unwrap();
    let ring = pool.spec().geometry.ring_slots as usize;
    let mut g = pool.window_gather(GatherCapacity::new(2, 4)).unwrap();
    let seq = |anchor, context_len| GatherSeq::new(a.handle, anchor, context_len);
    let csa = model.ratios.iter().position(|&r| r == 4).unwrap();
    assert!(matches!(g.stage(&[seq(5, None); 3]), Err(GatherError::TooManySeqs { got: 3, cap: 2 })));
    assert!(matches!(g.stage(&[seq(-1, None)]), Err(GatherError::NegativeAnchor { seq: 0, anchor: -1 })));
    assert!(matches!(
        g.stage(&[seq(1, Some(2)), seq(9, Some(9))]),
        Err(GatherError::AnchorPastContext { seq: 1, anchor: 9, context_len: 9 })
    ));
    g.stage(&[seq(9, Some(10))]).unwrap();
    assert!(matches!(g.gather(csa, 0), Err(GatherError::EmptyWindow)));
    assert!(matches!(g.gather(csa, 5), Err(GatherError::WindowExceedsOutput { draft_window: 5, cap: 4 })));
    assert!(matches!(
        g.gather_launch(csa, ring + 1, 0x1000),
        Err(GatherError::WindowExceedsRing { ring_slots, .. }) if ring_slots == ring as i64
    ));
    assert!(matches!(g.gather(999, 2), Err(GatherError::NoSuchLayer { layer: 999, .. })));
    let mut no_out = pool.window_gather(GatherCapacity::new(2, 0)).unwrap();
    assert!(matches!(no_out.gather(csa, 2), Err(GatherError::NoOutput)));
    // A lease freed after staging: the gather refuses it; staging it again too.
    g.gather(csa, 3).unwrap();
    pool.free_slot(a.handle).unwrap();
    assert!(matches!(g.gather(csa, 3), Err(GatherError::StaleLease { seq: 0, .. })));
    assert!(matches!(g.stage(&[seq(9, None)]), Err(GatherError::StaleLease { seq: 0, .. })));
    // A pool without carried windows has no ring for an absent layer id; a bf16 pool's is fine.
    let plain = host_pool(&v4pool::model::ModelShape::v4_flash(1).unwrap(), false);
    let l = plain.spec().geometry.num_layers;
    assert!(matches!(plain.gather_source(l), Err(GatherError::NoSuchLayer { .. })));
    assert!(!plain.gather_source(csa).unwrap().is_fp8() && pool.gather_source(csa).unwrap().is_fp8());
    let draft = model.absent_layers()[0];
    assert!(!pool.gather_source(draft).unwrap().is_fp8(), "a carried window is bf16 in every pool");
}

// ---- the kernel source itself (C++ emulation) against the host reference ------------------

type EmuLaunch = unsafe extern "C" fn(*const c_char, *const c_void, *const u32, u32) -> i32;

fn emu() -> Option<(libloading::Library, EmuLaunch)> {
    let Some(path) = v4pool::raw::kernels::host_emulation_library() else {
        assert!(
            !std::env::var("V4POOL_REQUIRE_DEVICE_BUILD").is_ok_and(|v| v == "1"),
            "V4POOL_REQUIRE_DEVICE_BUILD=1 but build.rs built no host-emulation library"
        );
        println!("SKIP: no host-emulation library (build.rs found no clang)");
        return None;
    };
    // SAFETY: the library is ours (build.rs built it from kernels/).
    let lib = unsafe { libloading::Library::new(path) }.expect("load the emulation library");
    // SAFETY: the symbol has exactly this signature (kernels/v4pool_emulation.cpp).
    let f =
        unsafe { *lib.get::<EmuLaunch>(b"v4pool_emu_launch_gather\0").expect("v4pool_emu_launch_gather") };
    Some((lib, f))
}

/// `bytes` in 16-B aligned storage (the kernel's vector accesses need the alignment).
fn aligned(bytes: &[u8]) -> Vec<u128> {
    let mut v = vec![0u128; bytes.len() / 16];
    bytemuck::cast_slice_mut::<u128, u8>(&mut v).copy_from_slice(bytes);
    v
}

#[test]
fn gather_kernels_match_the_host_reference() {
    let Some((_lib, launch)) = emu() else { return };
    let mut rng = Rng::new(case_seed("window-gather-emulated", 0));
    let mut zero_rows = 0;
    for case in 0..40 {
        let fp8 = case % 2 == 0;
        // A ring of a random geometry shape: 2..4 slots of `slot_rows` rows, ring 5..13.
        let ring = rng.range(5, 13);
        let stride = if rng.chance(0.5) { ring } else { rng.range(1, ring) };
        let runs = (ring + stride - 1) / stride;
        let run_rows = stride * rng.range(1, 3);
        let ring_start = rng.range(0, 4);
        let slot_rows = ring_start + (runs - 1) * run_rows + stride + rng.range(0, 3);
        let params =
            v4pool::WindowParams { ring_start, slot_rows, ring_slots: ring, ring_stride: stride, run_rows };
        let slots = rng.range(2, 4);
        let view_rows = slots * slot_rows;
        let bs = rng.range(0, 6) as usize;
        let wd = rng.range(1, ring) as i32;
        let slot_of: Vec<i32> =
            (0..bs).map(|_| if rng.chance(0.2) { -1 } else { rng.range(0, slots - 1) as i32 }).collect();
        let anchors: Vec<i64> = (0..bs)
            .map(|_| if rng.chance(0.4) { rng.range(0, i64::from(wd)) } else { rng.range(0, 100_000) })
            .collect();
        zero_rows += anchors.iter().filter(|&&a| a < i64::from(wd) - 1).count();
        let mut nope = rng.bytes(view_rows as usize * if fp8 { 512 } else { 1024 });
        if fp8 {
            for (r, row) in nope.chunks_exact_mut(512).enumerate() {
                for t in 0..7 {
                    row[448 + 2 * t] = if (r + t) % 11 == 0 { 0 } else { rng.range(90, 160) as u8 };
                }
            }
        }
        let rope = aligned(&rng.bytes(view_rows as usize * 128));
        let nope = aligned(&nope);
        let out_len = bs * wd as usize * 1024;
        let run = |out: &mut [u128], emulated: bool| {
            let args = WindowGatherArgs::default()
                .with_params(params)
                .with_pool(nope.as_ptr() as u64)
                .with_rope(if fp8 { rope.as_ptr() as u64 } else { 0 })
                .with_state_slot_per_seq(slot_of.as_ptr() as u64)
                .with_anchor_pos(anchors.as_ptr() as u64)
                .with_out(out.as_mut_ptr() as u64)
                .with_view_rows(view_rows)
                .with_num_seqs(bs as i32)
                .with_draft_window(wd);
            let l = if fp8 { Launch::WindowGatherFp8(args) } else { Launch::WindowGather(args) };
            if emulated {
                let shape = launch_shape(&l);
                let sym = CString::new(l.symbol()).unwrap();
                let bytes = v4pool::raw::launch::kernel_argument(&l);
                // SAFETY: the pointers cover what the kernel touches (sizes above).
                let rc = unsafe {
                    launch(sym.as_ptr(), bytes.as_ptr().cast(), shape.grid.as_ptr(), shape.block[0])
                };
                assert_eq!(rc, 0);
            } else {
                // SAFETY: as above.
                unsafe { run_launch(&l) }
                    .unwrap_or_else(|e| panic!("case {case}: host reference refused: {e}"));
            }
        };
        // Poisoned, 16-B aligned outputs (the kernel moves 16-B vectors).
        let mut h = aligned(&vec![0x5au8; out_len]);
        let mut d = h.clone();
        run(&mut h, false);
        run(&mut d, true);
        let h: &[u8] = bytemuck::cast_slice(&h);
        assert!(
            h == bytemuck::cast_slice::<u128, u8>(&d),
            "case {case} (fp8={fp8}): kernel and host reference differ"
        );
        for (b, &s) in slot_of.iter().enumerate() {
            let rows = &h[b * wd as usize * 1024..(b + 1) * wd as usize * 1024];
            assert_eq!(s < 0, rows.iter().all(|&x| x == 0x5a), "case {case}: sequence {b} pad {}", s < 0);
        }
    }
    assert!(zero_rows > 0, "no case reached a zero row");
}

#[test]
fn gather_launch_shape_and_host_checks() {
    use v4pool::raw::index::shape::{check_launch, LaunchError, GATHER_ROWS_PER_BLOCK};
    let params = v4pool::WindowParams {
        ring_start: 3,
        slot_rows: 200,
        ring_slots: 133,
        ring_stride: 133,
        run_rows: 133,
    };
    let a = WindowGatherArgs::default()
        .with_params(params)
        .with_pool(0x1000)
        .with_rope(0x2000)
        .with_state_slot_per_seq(0x3000)
        .with_anchor_pos(0x4000)
        .with_out(0x5000)
        .with_view_rows(1000)
        .with_num_seqs(1024)
        .with_draft_window(128);
    let s = launch_shape(&Launch::WindowGatherFp8(a));
    assert_eq!(s.grid, [1024, 128 / GATHER_ROWS_PER_BLOCK, 1]);
    assert_eq!(s.block, [256, 1, 1]);
    assert_eq!(launch_shape(&Launch::WindowGather(a.with_draft_window(133))).grid[1], 17);
    assert_eq!(check_launch(&Launch::WindowGatherFp8(a)), Ok(()));
    assert_eq!(
        check_launch(&Launch::WindowGatherFp8(a.with_draft_window(134))),
        Err(LaunchError::WindowExceedsRing { class: "window gather", win: 134, ring_slots: 133 })
    );
    assert!(check_launch(&Launch::WindowGatherFp8(a.with_draft_window(0))).is_err());
    assert!(matches!(
        check_launch(&Launch::WindowGather(a)),
        Err(LaunchError::UnexpectedBuffer { field: "rope", .. })
    ));
    assert!(matches!(
        check_launch(&Launch::WindowGatherFp8(a.with_rope(0))),
        Err(LaunchError::MissingBuffer { field: "rope" })
    ));
    assert!(matches!(
        check_launch(&Launch::WindowGatherFp8(a.with_out(0x5008))),
        Err(LaunchError::Misaligned { field: "out", .. })
    ));
    // An empty grid is one block that returns, and needs no buffers.
    let empty = a
        .with_num_seqs(0)
        .with_pool(0)
        .with_state_slot_per_seq(0)
        .with_anchor_pos(0)
        .with_out(0)
        .with_rope(0);
    assert_eq!(check_launch(&Launch::WindowGather(empty)), Ok(()));
    assert_eq!(launch_shape(&Launch::WindowGather(empty)).grid[0], 1);
    // SAFETY: an empty grid touches nothing.
    unsafe { run_launch(&Launch::WindowGather(empty)) }.unwrap();
}

#[test]
fn a_slot_relocated_after_staging_is_refused_until_restaged_with_its_new_lease() {
    let model = v4pool::model::ModelShape::v4_flash_dspark(3, v4pool::model::DraftMode::Absent).unwrap();
    let pool = host_pool(&model, false);
    let csa = model.ratios.iter().position(|&r| r == 4).unwrap();
    // Hold only the lowest slot position and shrink to one slot: the boundary relocates it
    // (a relocation re-issues the lease, so the staged one goes stale). The test requires
    // the move, so it cannot pass vacuously.
    let n = pool.counts().unwrap().num_slots;
    let leases: Vec<_> = (0..n).map(|_| pool.alloc_slot().unwrap()).collect();
    let held = leases.iter().map(|l| l.handle).min_by_key(|&h| pool.slot_position(h).unwrap()).unwrap();
    let mut g = pool.window_gather(GatherCapacity::new(1, 4)).unwrap();
    g.stage(&[GatherSeq::new(held, 7, None)]).unwrap();
    g.gather(csa, 4).unwrap();
    for l in leases.iter().filter(|l| l.handle != held) {
        pool.free_slot(l.handle).unwrap();
    }
    let change = pool.shrink_slots(n - 1).unwrap();
    let moved = change.slot_moves.iter().find(|m| m.old == held).expect("the held slot is relocated");
    assert!(matches!(g.gather(csa, 4), Err(GatherError::StaleLease { seq: 0, .. })));
    g.stage(&[GatherSeq::new(moved.new, 7, None)]).unwrap();
    g.gather(csa, 4).unwrap();
}

#[test]
fn gather_into_host_equals_the_gather_and_outputs_the_launch_reads_are_refused() {
    // The engine-output path the bindings use for a CPU tensor (`gather_into_host`) writes
    // exactly the handle's gather into a poisoned buffer, pad sequences' rows untouched; and
    // `check_output` (what the bindings run before the unsafe `gather_into`) refuses short,
    // misaligned and aliasing outputs with a typed error.
    for fp8 in [true, false] {
        let model = v4pool::model::ModelShape::v4_flash(1).unwrap();
        let pool = host_pool(&model, fp8);
        let leases: Vec<_> = (0..3).map(|_| pool.alloc_slot().unwrap()).collect();
        let mut rng = Rng::new(case_seed("gather-into-host", u64::from(fp8)));
        fill(&pool, &leases, &mut rng);
        let wd = 64;
        let mut g = pool.window_gather(GatherCapacity::new(4, wd)).unwrap();
        g.stage(&batch(&mut rng, &leases, 3, wd)).unwrap();
        for layer in source_layers(&model) {
            let mut out = vec![0xbeefu16; 4 * wd * 512];
            g.gather_into_host(layer, wd, &mut out).unwrap();
            g.gather(layer, wd).unwrap();
            let want = g.read_output().unwrap();
            assert_eq!(want.len(), 3 * wd * 512);
            assert!(out[..want.len()] == want[..], "fp8 {fp8} layer {layer}: differs from the gather");
            assert!(out[want.len()..].iter().all(|&v| v == 0xbeef), "a pad sequence's rows were written");
            assert!(matches!(
                g.gather_into_host(layer, wd, &mut out[..100]),
                Err(GatherError::BadOutput { .. })
            ));
        }
        let bytes = 4 * wd as u64 * 1024;
        let fresh = vec![0u128; (bytes / 16) as usize];
        let ok = fresh.as_ptr() as u64;
        g.check_output(wd, ok, bytes).unwrap();
        for (out, len, why) in [
            (ok, bytes - 16, "short"),
            (ok + 8, bytes - 16, "misaligned"),
            (pool.plane_ptr(0).unwrap() + 4096, bytes, "inside plane 0"),
            (pool.plane_ptr(pool.num_planes() - 1).unwrap() - 16, bytes, "reaching into the last plane"),
            (g.output().unwrap().ptr, bytes, "the handle's own output"),
            (u64::MAX - 15, bytes, "wrapping"),
        ] {
            assert!(matches!(g.check_output(wd, out, len), Err(GatherError::BadOutput { .. })), "{why}");
        }
    }
}
