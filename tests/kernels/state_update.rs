//! The §8 compressor-state update through the pool (`Pool::state_update` → `StateUpdate`) on
//! the host backend: random forwards and inputs (finite, never zero) over poisoned planes;
//! after every launch the whole planes equal the planes before with exactly the §8 rows
//! written in (so every untouched byte is verified), at V4-Flash and V4-Pro shapes, fp8 two
//! planes and bf16 one plane, MTP rings 129–133, batches up to 1,024 (a small arena with
//! the same field names), then every refusal as its typed error with nothing written.

use crate::common;
use crate::state_common;

use state_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Backend;
use v4pool::model::ModelShape;
use v4pool::raw::index::ElemType;
use v4pool::sizing::KvDtype;
use v4pool::state::update::{Compressor, StateUpdateCapacity, StateUpdateError};
use v4pool::Class;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

#[test]
fn v4_shapes_write_exactly_the_last_k_rows() {
    // (model, kv layout, spec steps → ring 128 + k).
    let cases = [
        ("flash fp8 k=1", ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8),
        ("pro fp8 k=3", ModelShape::v4_pro(3).unwrap(), KvDtype::Fp8),
        ("flash bf16 k=5", ModelShape::v4_flash(5).unwrap(), KvDtype::Bf16),
        ("pro bf16 k=2", ModelShape::v4_pro(2).unwrap(), KvDtype::Bf16),
    ];
    for (i, (what, model, kv)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(0x51ed_2700_0000_0001 + i as u64 * 0x9e37_79b9);
        let pool = v4_pool(host(), &model, kv, 3);
        let leases: Vec<_> = (0..3).map(|_| pool.alloc_slot().unwrap()).collect();
        poison(&pool, &mut rng);
        // Decode-shaped (1..=k+1 tokens each), then a prefill-shaped forward (up to 300).
        let cap = StateUpdateCapacity::new(3, 900);
        let decode = forward(&mut rng, &leases, model.spec_steps + 1, 1_000_000);
        run_forward(&pool, &mut rng, &decode, cap, &format!("{what} decode"));
        let prefill = forward(&mut rng, &leases, 300, 5000);
        run_forward(&pool, &mut rng, &prefill, cap, &format!("{what} prefill"));
    }
}

#[test]
fn large_batches_on_a_small_arena() {
    for (i, (bs, widths, k)) in
        [(1024usize, &[64u64, 32][..], 1u64), (700, &[128][..], 4)].into_iter().enumerate()
    {
        let mut rng = Rng::new(0x0bad_cafe_0000_0011 + i as u64);
        let pool = small_pool(host(), widths, k, None, bs as i64 + 3);
        let leases: Vec<_> = (0..bs).map(|_| pool.alloc_slot().unwrap()).collect();
        poison(&pool, &mut rng);
        let seqs = forward(&mut rng, &leases, 2, 1_000_000);
        let cap = StateUpdateCapacity::new(1024, 2048);
        run_forward(&pool, &mut rng, &seqs, cap, &format!("small arena bs={bs}"));
    }
}

#[test]
fn plans_keep_the_last_k_positions_and_pad_to_capacity() {
    let pool = small_pool(host(), &[128], 1, None, 4);
    let leases: Vec<_> = (0..2).map(|_| pool.alloc_slot().unwrap()).collect();
    let mut upd = pool.state_update(StateUpdateCapacity::new(2, 300)).unwrap();
    // Sequence 0: 200 tokens of a fresh prefill; sequence 1: 3 decode tokens at 1,000,000.
    let s0: Vec<i64> = (0..200).collect();
    let s1: Vec<i64> = (999_998..1_000_001).collect();
    let seqs = vec![
        Seq { lease: leases[0], first_token: 0, positions: s0, context_len: 200 },
        Seq { lease: leases[1], first_token: 200, positions: s1, context_len: 1_000_001 },
    ];
    assert_eq!(upd.stage(&views(&seqs)).unwrap(), [8 + 3, 128 + 3]);
    let csa = upd.read_plan(Class::Csa).unwrap();
    assert_eq!(csa.len(), 4 * 16, "CSA capacity: min(300, 2 x 8) rows");
    let p0 = leases[0].position as i32;
    let p1 = leases[1].position as i32;
    assert_eq!(&csa[..8], &[192, 0, 192, p0, 193, 0, 193, p0]);
    assert_eq!(&csa[4 * 8..4 * 11], &[200, 1, 999_998, p1, 201, 1, 999_999, p1, 202, 1, 1_000_000, p1]);
    assert!(csa[4 * 11..].chunks(4).all(|r| r[2] == -1), "pads carry position -1");
    let hca = upd.read_plan(Class::Hca).unwrap();
    assert_eq!(hca.len(), 4 * 256);
    assert_eq!(&hca[..4], &[72, 0, 72, p0]);
    assert!(hca[4 * 131..].chunks(4).all(|r| r[2] == -1));
    // A smaller batch re-pads what the last one left live.
    let one = vec![Seq { lease: leases[1], first_token: 0, positions: vec![5], context_len: 6 }];
    assert_eq!(upd.stage(&views(&one)).unwrap(), [1, 1]);
    let csa = upd.read_plan(Class::Csa).unwrap();
    assert_eq!(&csa[..4], &[0, 0, 5, p1]);
    assert!(csa[4..].chunks(4).all(|r| r[2] == -1));
    assert!(upd.read_plan(Class::Hca).unwrap()[4..].chunks(4).all(|r| r[2] == -1));
}

#[test]
fn refusals_are_typed_and_write_nothing() {
    let mut rng = Rng::new(0x7e57_0000_0000_0042);
    let pool = small_pool(host(), &[64, 32], 2, None, 6);
    let leases: Vec<_> = (0..4).map(|_| pool.alloc_slot().unwrap()).collect();
    let gone = pool.alloc_slot().unwrap();
    pool.free_slot(gone.handle).unwrap();
    poison(&pool, &mut rng);
    let before = planes(&pool);
    let cap = StateUpdateCapacity::new(3, 16);
    let mut upd = pool.state_update(cap).unwrap();
    let seq = |lease, positions: Vec<i64>, ctx| Seq { lease, first_token: 0, positions, context_len: ctx };
    let stage = |upd: &mut v4pool::state::update::StateUpdate, seqs: Vec<Seq>| upd.stage(&views(&seqs));

    let e = stage(&mut upd, vec![seq(leases[0], vec![10], 10)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::PastContext { position: 10, context_len: 10, .. }), "{e}");
    let e = stage(&mut upd, vec![seq(leases[0], vec![-1], 10)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::NegativePosition { position: -1, .. }), "{e}");
    let e = stage(&mut upd, vec![seq(leases[0], vec![8, 9, 8], 10)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::DuplicatePosition { position: 8, .. }), "{e}");
    let e = stage(&mut upd, vec![seq(leases[0], vec![9], 10), seq(leases[0], vec![4], 5)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::SharedSlot { first: 0, second: 1, .. }), "{e}");
    let four: Vec<Seq> = leases.iter().map(|&l| seq(l, vec![1], 2)).collect();
    let e = stage(&mut upd, four).unwrap_err();
    assert!(matches!(e, StateUpdateError::OverCapacity { what: "sequences", got: 4, max: 3 }), "{e}");
    // 17 tokens in the last 128 positions: more HCA rows than max_tokens = 16.
    let e = stage(&mut upd, vec![seq(leases[0], (0..17).collect(), 17)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::OverCapacity { got: 17, max: 16, .. }), "{e}");
    let e = stage(&mut upd, vec![seq(leases[0], vec![(1 << 32) - 1], 1 << 32)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::NotI32 { what: "position", .. }), "{e}");
    // A first token row that wraps (seen failing before the fix: usize::MAX - 1 staged plan
    // row -2, before the engine's buffer).
    for first_token in [usize::MAX - 1, usize::MAX, i32::MAX as usize] {
        let s = Seq { lease: leases[0], first_token, positions: vec![8, 9], context_len: 10 };
        let e = stage(&mut upd, vec![s]).unwrap_err();
        assert!(matches!(e, StateUpdateError::NotI32 { what: "token row", .. }), "{first_token}: {e}");
    }
    // A freed slot's lease is stale.
    let e = stage(&mut upd, vec![seq(gone, vec![1], 2)]).unwrap_err();
    assert!(matches!(e, StateUpdateError::Pool(_)), "{e}");

    // Launch refusals, with a valid staged forward.
    upd.stage(&views(&[seq(leases[0], vec![3, 4], 5)])).unwrap();
    let i = inputs(&mut rng, Compressor::CsaMain, 16, 2, ElemType::Bf16, ElemType::F32);
    let (allocs, view) = upload(pool.backend().as_ref(), &i);
    // SAFETY (every call below): the inputs live on the pool's backend with these shapes;
    // each call is refused before it launches.
    unsafe {
        let e = upd.update(Compressor::CsaMain, 2, &view).unwrap_err();
        assert!(matches!(e, StateUpdateError::NoSuchLayer { layer: 2, layers: 2, .. }), "{e}");
        let e = upd.update(Compressor::CsaIdx, 0, &view).unwrap_err();
        assert!(matches!(e, StateUpdateError::DimMismatch { expected: 8, got: 16 }), "{e}");
        let short = view.with_rows(1);
        let e = upd.update(Compressor::CsaMain, 0, &short).unwrap_err();
        assert!(matches!(e, StateUpdateError::InputTooSmall { what: "rows", got: 1, needed: 2 }), "{e}");
        let narrow = view.with_kv_row_stride(15);
        let e = upd.update(Compressor::CsaMain, 0, &narrow).unwrap_err();
        assert!(matches!(e, StateUpdateError::InputTooSmall { what: "kv_row_stride", .. }), "{e}");
        // The staged slot freed after staging: restage first.
        pool.free_slot(leases[0].handle).unwrap();
        let e = upd.update(Compressor::CsaMain, 0, &view).unwrap_err();
        assert!(matches!(e, StateUpdateError::Restage { now: None, .. }), "{e}");
    }
    free(pool.backend().as_ref(), allocs);
    assert!(diff(&before, &planes(&pool)).is_none(), "a refused call wrote to the planes");

    // A ring smaller than K (CSA fields of 6 rows < 8).
    let small = small_pool(host(), &[128], 0, Some(6), 3);
    let l = small.alloc_slot().unwrap();
    let mut upd = small.state_update(cap).unwrap();
    upd.stage(&views(&[seq(l, vec![4], 5)])).unwrap();
    let (allocs, view) = upload(small.backend().as_ref(), &i);
    // SAFETY: as above.
    let e = unsafe { upd.update(Compressor::CsaMain, 0, &view) }.unwrap_err();
    assert!(matches!(e, StateUpdateError::RingTooSmall { ring: 6, window: 8, .. }), "{e}");
    free(small.backend().as_ref(), allocs);

    // A pool without the fields (the index pools' one-field arena).
    let bare = common::index_pool(host(), vec![4, 128], 4, 4);
    let mut upd = bare.state_update(cap).unwrap();
    let l = bare.alloc_slot().unwrap();
    upd.stage(&views(&[seq(l, vec![4], 5)])).unwrap();
    let e = upd.launch(Compressor::HcaMain, 0, &view).unwrap_err();
    assert!(matches!(e, StateUpdateError::Pool(v4pool::pool::PoolError::Arena(_))), "{e}");
}
