//! Fewer launches, the same bytes (docs/forward.md, "Fewer launches"): one whole decode step of
//! V4-Flash, V4-Pro and V4.1-Flash on the host backend in the per-layer order (one launch per
//! write), with each layer's writes in one `v4pool_write_batch`, and with every state update in
//! one batch at the end; the three pools, poisoned alike beforehand, must end byte for byte
//! equal (planes, indexer cache, the decode path's buffers). The batch kernel's source itself
//! (the C++ emulation) runs the fused order too. And the batch's refusals.

use crate::common;
use crate::step_common;

use std::sync::Arc;
use step_common::{
    count_kinds, path_outputs, poison_pool, pool_bytes, step_pool, Holdings, Kind, Order, StepData, StepRig,
};
use v4pool::backend::host::HostBackend;
use v4pool::backend::Stream;
use v4pool::model::ModelShape;
use v4pool::pool::WriteBatchError;
use v4pool::raw::index::{Launch, WriteItem, WRITE_BATCH_MAX_ITEMS};
use v4pool::sizing::KvDtype;
use v4pool::VariantName;

const SEQS: usize = 3;

/// The models and row formats the step runs at.
fn cases() -> Vec<(ModelShape, KvDtype)> {
    vec![
        (ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8),
        (ModelShape::v4_flash(1).unwrap(), KvDtype::Bf16),
        (ModelShape::v4_pro(1).unwrap(), KvDtype::Fp8),
        (ModelShape::v41_flash(1).unwrap(), KvDtype::Bf16),
        // FlashMLA's rows: the 584-B paged V4 format (pages of 64 and of 2) and the 528-B V4.1 one.
        (ModelShape::v4_flash(1).unwrap(), KvDtype::FlashMlaV4),
        (ModelShape::v4_flash(1).unwrap(), KvDtype::FlashMlaV4P2),
        (ModelShape::v41_flash(1).unwrap(), KvDtype::FlashMlaV41),
    ]
}

/// Contexts that close CSA and HCA entries at the step (256: both at its last token; 1,024
/// with two tokens: 1,023 closes neither, 1,024 both) beside a random one the pool's eight
/// blocks hold.
fn contexts(seed: u64) -> Vec<i64> {
    let mut rng = v4pool::sim::Rng::new(seed);
    vec![256, 1024, rng.range(3, 2_000)]
}

fn host_pool(model: &ModelShape, kv: KvDtype) -> Arc<v4pool::pool::Pool> {
    step_pool(Arc::new(HostBackend::new()), model, kv, SEQS as i64 + 1, 2 * SEQS as i64 + 2)
}

/// What one step leaves: the pool's bytes, the decode path's buffers, launches per kind.
type StepResult = (Vec<Vec<u8>>, Vec<Vec<i32>>, Vec<(Kind, usize)>);

/// Run one step in `order` on a fresh poisoned pool; `emulate` runs the batches through the
/// kernel source instead of the host reference; `fm_path` builds the FlashMLA decode path.
/// Returns the pool's bytes and the path's.
fn run(
    model: &ModelShape,
    kv: KvDtype,
    tps: usize,
    order: Order,
    emulate: Option<common::EmuLaunch>,
    fm_path: bool,
) -> StepResult {
    let pool = host_pool(model, kv);
    poison_pool(&pool, 0x5eed_0000 + tps as u64);
    let held = Holdings::take(&pool, SEQS);
    let mut data =
        StepData::new(&pool, model.num_hidden_layers, tps, contexts(7), model.index_topk as usize, 11);
    // `fm_path`: the decode path in FlashMLA's convention (the builder and the packs write
    // FlashMLA's operands; V4 in FlashMLA's rows).
    data.flashmla_path = fm_path;
    let mut rig = StepRig::new(&pool, &held, &data);
    let launches = rig.launches(order);
    for l in &launches {
        match (emulate, l.kind) {
            // SAFETY: the rig's own launches (its buffers and its pool's host memory).
            (Some(emu), Kind::Batch) => unsafe { common::run_reference_or_emulated(&l.launch, emu, false) },
            // SAFETY: as above.
            _ => unsafe { pool.backend().launch(&l.launch, Stream::DEFAULT).expect("launch") },
        }
    }
    let out = (pool_bytes(&pool), path_outputs(&rig.path), count_kinds(&launches));
    drop(rig);
    out
}

#[test]
fn fused_orders_write_what_the_per_layer_order_writes() {
    fused_orders_match(cases(), false);
}

#[test]
fn the_flashmla_decode_path_step_is_the_same_in_every_order() {
    // The FlashMLA-mode builder and packs inside the step: every order's pool bytes and every
    // FlashMLA operand buffer equal to the per-layer order's.
    fused_orders_match(
        vec![
            (ModelShape::v4_flash(1).unwrap(), KvDtype::FlashMlaV4),
            (ModelShape::v4_flash(1).unwrap(), KvDtype::FlashMlaV4P2),
        ],
        true,
    );
}

fn fused_orders_match(cases: Vec<(ModelShape, KvDtype)>, fm_path: bool) {
    for (model, kv) in cases {
        for tps in [1usize, 2] {
            let (want, want_path, kinds) = run(&model, kv, tps, Order::PerLayer, None, fm_path);
            let per_layer: usize = kinds.iter().map(|k| k.1).sum();
            for order in [Order::Fused, Order::StateAtEnd] {
                let (got, got_path, kinds) = run(&model, kv, tps, order, None, fm_path);
                let fused: usize = kinds.iter().map(|k| k.1).sum();
                assert!(fused < per_layer, "{}: {fused} launches, per layer {per_layer}", model.name);
                assert!(
                    got_path == want_path,
                    "{} {kv:?} tps {tps} {order:?}: path buffers differ",
                    model.name
                );
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    if let Some(at) = g.iter().zip(w).position(|(a, b)| a != b) {
                        panic!("{} {kv:?} tps {tps} {order:?}: region {i} differs at byte {at}", model.name);
                    }
                }
            }
        }
    }
}

#[test]
fn the_per_layer_order_writes_every_row_it_names() {
    // Against an unwritten pool: the step changes the bytes the runs name and nothing else
    // the runs do not name (the runs are the geometry's and the arena's, not a kernel's).
    for (model, kv) in cases() {
        let pool = host_pool(&model, kv);
        poison_pool(&pool, 3);
        // Slots are initialised as they are handed out: the snapshot comes after.
        let held = Holdings::take(&pool, SEQS);
        let before = pool_bytes(&pool);
        let data =
            StepData::new(&pool, model.num_hidden_layers, 2, contexts(9), model.index_topk as usize, 5);
        let mut rig = StepRig::new(&pool, &held, &data);
        let launches = rig.launches(Order::PerLayer);
        // SAFETY: the rig's own launches.
        unsafe { rig.queue(&launches, Stream::DEFAULT) };
        let after = pool_bytes(&pool);
        let runs = rig.written_runs(&data);
        // Map each run to (region, offset): planes by their base, the indexer cache by its.
        let mut bases: Vec<(u64, usize)> =
            (0..pool.num_planes()).map(|p| (pool.plane_ptr(p).unwrap(), p)).collect();
        if let Some(ptr) = pool.indexer_ptr() {
            bases.push((ptr, pool.num_planes()));
        }
        let mut named: Vec<Vec<bool>> = after.iter().map(|r| vec![false; r.len()]).collect();
        for r in &runs {
            let &(base, region) = bases.iter().filter(|(b, _)| *b <= r.src).max_by_key(|(b, _)| *b).unwrap();
            let off = (r.src - base) as usize;
            named[region][off..off + r.bytes as usize].iter_mut().for_each(|n| *n = true);
        }
        for (region, (a, b)) in after.iter().zip(&before).enumerate() {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    x == y || named[region][i],
                    "{}: region {region} byte {i} changed outside the runs",
                    model.name
                );
            }
        }
        // And most named bytes changed (a random poison byte may equal the written one).
        let total: usize = runs.iter().map(|r| r.bytes as usize).sum();
        let changed: usize =
            after.iter().zip(&before).map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count()).sum();
        assert!(changed * 10 > total * 9, "{}: {changed} of {total} named bytes changed", model.name);
    }
}

#[test]
fn the_batch_kernel_source_matches_the_host_reference() {
    let Some((_lib, emu)) = common::emulation_entry("write_batch") else {
        return;
    };
    for (model, kv) in cases() {
        let (want, _, _) = run(&model, kv, 2, Order::Fused, None, false);
        for order in [Order::Fused, Order::StateAtEnd] {
            let (got, _, _) = run(&model, kv, 2, order, Some(emu), false);
            assert!(got == want, "{} {kv:?} {order:?}: the emulated batch kernel differs", model.name);
        }
    }
}

#[test]
fn batches_refuse_what_they_cannot_carry() {
    let model = ModelShape::v4_flash(1).unwrap();
    let pool = host_pool(&model, KvDtype::Fp8);
    for cap in [0, WRITE_BATCH_MAX_ITEMS + 1] {
        let e = pool.write_batch(cap).unwrap_err();
        assert!(matches!(e, WriteBatchError::Capacity { .. }), "{e:?}");
    }
    let held = Holdings::take(&pool, SEQS);
    let data = StepData::new(&pool, model.num_hidden_layers, 1, contexts(1), 512, 2);
    let mut rig = StepRig::new(&pool, &held, &data);
    let launches = rig.launches(Order::PerLayer);
    let writes: Vec<Launch> = launches.iter().filter(|l| l.kind == Kind::State).map(|l| l.launch).collect();
    let pack = launches.iter().find(|l| l.kind == Kind::Pack).unwrap().launch;
    let mut b = pool.write_batch(4).unwrap();
    assert!(matches!(b.set(&[]), Err(WriteBatchError::Count { .. })));
    assert!(matches!(b.set(&writes[..5]), Err(WriteBatchError::Count { got: 5, cap: 4 })));
    let e = b.set(&[writes[0], pack]).unwrap_err();
    assert!(matches!(e, WriteBatchError::NotAWrite { index: 1, .. }), "{e:?}");
    assert_eq!(e.variant_name(), "NotAWrite");
    let mut bad = writes[0];
    if let Launch::StateUpdate(a) = &mut bad {
        a.num_rows = -1;
    }
    let e = b.set(&[writes[1], bad]).unwrap_err();
    assert!(matches!(e, WriteBatchError::Invalid { index: 1, .. }), "{e:?}");
    assert_eq!(e.variant_name(), "Negative");
    // A table that does not tile the grid as the items' own kernels do is the host
    // reference's error, not a silent partial write.
    let Launch::WriteBatch(good) = b.set(&writes[..2]).unwrap() else { panic!("a write batch") };
    for args in [good.with_num_blocks(good.num_blocks + 1), good.with_num_items(1)] {
        // SAFETY: the batch's own table; the items are the rig's launches.
        let r = unsafe { pool.backend().launch(&Launch::WriteBatch(args), Stream::DEFAULT) };
        assert!(r.is_err(), "{args:?} ran");
    }
    assert!(WriteItem::of(&Launch::Empty).is_none());
    assert_eq!(WriteItem::of(&writes[0]).and_then(|i| i.launch()), Some(writes[0]));
}
