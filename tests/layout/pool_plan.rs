//! A pool carved from a real plan (V4-Flash, V4-Pro): its overhead at production sizes, its
//! transfer regions, its checkpoint image against `checkpoint.rs`, and state initialisation.

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::checkpoint::CheckpointLayout;
use v4pool::model::ModelShape;
use v4pool::pool::{DecodeCapacity, DecodeError, Overhead, Pool, PoolError, PoolSpec};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};
use v4pool::transfer::{Alloc, TransferConfig};

fn flash_pool(budget: u64, seqs: i64, k: i64) -> (Pool, v4pool::sizing::Plan) {
    let model = ModelShape::v4_flash(k).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget)).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    (Pool::new(backend, PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap(), p)
}

#[test]
fn overhead_stays_under_one_percent_at_production_sizes() {
    for (model, topk) in [(ModelShape::v4_flash(1).unwrap(), 512), (ModelShape::v4_pro(1).unwrap(), 1024)] {
        for budget_gib in [80u64, 100, 140] {
            let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, budget_gib << 30))
                .unwrap();
            let spec = PoolSpec::from_plan(&p).unwrap();
            // Persistent decode buffers for the largest batch: 256 sequences with one draft
            // token each, contexts to 1M tokens, all CSA layers in one translate-pack.
            let cap = DecodeCapacity::new(256, 512, (1 << 20) / 256 + 1, 128, topk);
            let o = Overhead::estimate(&spec, Some(cap)).unwrap();
            assert!(o.index_bytes > 0 && o.host_bytes > 0 && o.descriptor_bytes > 0);
            assert!(
                o.fraction() < 0.01,
                "{} at {budget_gib} GiB: overhead {:.3} % ({} index + {} descriptors + {} host of {} plane bytes)",
                model.name,
                o.fraction() * 100.0,
                o.index_bytes,
                o.descriptor_bytes,
                o.host_bytes,
                o.plane_bytes
            );
            // The indexer the estimate prices equals what the plan budgeted for it.
            assert!(o.indexer_bytes <= p.indexer_total_bytes);
            assert!(o.plane_bytes <= p.planes_total_bytes);
        }
    }
}

#[test]
fn a_decode_refusal_reaches_the_caller_typed() {
    // The decode path's refusal crosses into the pool's error as itself, so a caller matches
    // the variant rather than parsing a message.
    let model = ModelShape::v4_flash(1).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 4, 3 << 30)).unwrap();
    let spec = PoolSpec::from_plan(&p).unwrap();
    let cap = DecodeCapacity::new(4, 8, 4, 128, -1);
    match Overhead::estimate(&spec, Some(cap)) {
        Err(PoolError::Decode(d)) => assert!(matches!(*d, DecodeError::NegativeTopk(-1)), "{d:?}"),
        other => panic!("expected a decode refusal: {other:?}"),
    }
}

#[test]
fn checkpoint_image_agrees_with_the_checkpoint_module() {
    let (pool, p) = flash_pool(3 << 30, 4, 1);
    let ck = CheckpointLayout::for_pool(&p.layout).unwrap();
    assert_eq!(pool.checkpoint_ranges().unwrap(), ck.plane_ranges);
    assert_eq!(pool.checkpoint_image_bytes().unwrap(), ck.image_bytes);
    // The worked number of pool-runtime §6 for Flash k=1 fp8.
    assert_eq!(ck.image_bytes, 5_568_000);
}

#[test]
fn new_slots_start_with_zero_kv_and_minus_infinity_scores() {
    let (pool, _) = flash_pool(3 << 30, 4, 0);
    // Scribble over the whole of position's rows first: initialisation must overwrite it.
    let lease = pool.alloc_slot().unwrap();
    let g = pool.spec().geometry.clone();
    for (field, expect) in [
        ("csa_main_kv", 0.0f32),
        ("csa_main_score", f32::NEG_INFINITY),
        ("hca_main_score", f32::NEG_INFINITY),
    ] {
        let (ptr, view) = pool.state_view(field).unwrap();
        let plane = pool.plane_ptr(view.plane).unwrap();
        // Last layer, this position, a few elements from the start and the end.
        let layer = view.dims[0] - 1;
        let per_layer = view.strides[0];
        let elems: u64 = view.dims[2..].iter().product();
        for e in [0, 1, elems / 2, elems - 1] {
            let off = ptr - plane + 4 * (layer * per_layer + lease.position as u64 * view.strides[1] + e);
            let mut w = [0u8; 4];
            pool.read_plane(view.plane, off, &mut w).unwrap();
            assert_eq!(f32::from_ne_bytes(w), expect, "{field} layer {layer} element {e}");
        }
    }
    assert!(g.live_positions().contains(&lease.position));
}

#[test]
fn transfer_regions_declare_both_planes_and_follow_the_split() {
    let (pool, _) = flash_pool(3 << 30, 4, 1);
    let cfg = TransferConfig::new(true, 1);
    let r = pool.transfer_regions(&cfg).unwrap();
    assert_eq!(r.slot_regions.len(), 2);
    assert_eq!(r.expected_slot_regions(), 2);
    let g = pool.geometry().unwrap();
    // Unit g of the slot region is the slot start of physical_slot(g), in both planes.
    for (p, region) in r.slot_regions.iter().enumerate() {
        assert_eq!(region.alloc, Alloc::Planes);
        let w = pool.spec().plane_widths[p];
        let plane_off = pool.plane_ptr(p).unwrap() - pool.plane_ptr(0).unwrap();
        for group in 0..g.num_slots {
            let (start, _) = g.slot_span(g.physical_slot(group).unwrap()).unwrap();
            assert_eq!(region.unit_offset(group).unwrap(), plane_off + start as u64 * w);
        }
    }
    // After the boundary moves, the regions are rebuilt at the new split.
    pool.grow_slots(2).unwrap();
    let r2 = pool.transfer_regions(&cfg).unwrap();
    assert_eq!(
        r2.slot_regions[0].total_bytes,
        r.slot_regions[0].total_bytes + 2 * r.slot_regions[0].unit_bytes
    );
    // FP4 indexers cannot be described to a connector.
    let model = ModelShape::v4_flash(1).unwrap();
    let p4 = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp4, 2, 2 << 30)).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let pool4 = Pool::new(backend, PoolSpec::from_plan(&p4).unwrap(), Stream::DEFAULT).unwrap();
    assert!(pool4.transfer_regions(&cfg).is_err());
}

#[test]
fn pool_is_send_and_sync_and_works_from_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Pool>();
    let (pool, _) = flash_pool(2 << 30, 8, 0);
    let pool = Arc::new(pool);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let b = pool.alloc_block().unwrap().handle;
                    pool.free_block(b).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let c = pool.counts().unwrap();
    assert_eq!(c.free_blocks, c.num_blocks);
}

/// defect43 row 18: the bindings' plan request (`PlanOptions`, what Python and C size with)
/// defaulted to fp8 rows for every model, so `v4.1-flash` was `KvDtypeUnsupported` there while
/// the CLI picked `flashmla-v41`. Without a dtype every entry point takes the family's one
/// default (`KvDtype::default_for`), and the same speculative steps
/// (`model::DEFAULT_SPEC_STEPS`).
#[test]
fn plan_options_default_to_the_familys_rows() {
    use v4pool::model::ModelFamily;
    use v4pool::plan_report::PlanOptions;
    for (model, family, kv) in
        [("v4-flash", ModelFamily::V4, KvDtype::Fp8), ("v4.1-flash", ModelFamily::V41, KvDtype::FlashMlaV41)]
    {
        assert_eq!(KvDtype::default_for(family), kv, "{model}");
        let o = PlanOptions::new(model, 8 << 30, 16);
        assert_eq!(o.spec_steps, v4pool::model::DEFAULT_SPEC_STEPS);
        let report = o.report().unwrap_or_else(|e| panic!("{model} at the defaults: {e}"));
        assert_eq!(report.plan.layout.kv, kv, "{model}");
        assert_eq!(report.plan.layout.model.spec_steps, v4pool::model::DEFAULT_SPEC_STEPS, "{model}");
        // The defaults are the plan the library makes at the family's dtype.
        let shape = ModelShape::by_name(model, v4pool::model::DEFAULT_SPEC_STEPS).unwrap();
        let direct = plan(&shape, &PlanRequest::new(kv, IndexerDtype::Fp8, 16, 8 << 30)).unwrap();
        assert_eq!((report.plan.num_blocks, report.plan.num_slots), (direct.num_blocks, direct.num_slots));
    }
}

/// defect43 row 9 (the library's side; the Python views are `test_view_dtype_is_the_row_formats`):
/// a plan's spec carries its row format, and a plane's one element type is read from it —
/// bf16 where the plane holds bf16 values alone, none (bytes) where encodings or scales share it.
#[test]
fn a_plans_planes_name_their_element_type_from_the_row_format() {
    use v4pool::format::Elem;
    let v4 = ModelShape::v4_flash(0).unwrap();
    let v41 = ModelShape::by_name("v4.1-flash", 0).unwrap();
    let cases: [(&ModelShape, KvDtype, &[Option<Elem>]); 5] = [
        (&v4, KvDtype::Fp8, &[None, Some(Elem::Bf16)]),
        (&v4, KvDtype::Bf16, &[Some(Elem::Bf16)]),
        (&v4, KvDtype::FlashMlaV4, &[None]),
        (&v41, KvDtype::FlashMlaV41, &[None]),
        (&v41, KvDtype::FlashMlaV41Fp4, &[None]),
    ];
    for (model, kv, want) in cases {
        let p = plan(model, &PlanRequest::new(kv, IndexerDtype::Fp8, 4, 1 << 30)).unwrap();
        let spec = PoolSpec::from_plan(&p).unwrap();
        assert_eq!(spec.row_format().map(|f| f.id), Some(kv.row_format()), "{kv:?}");
        let got: Vec<Option<Elem>> = (0..spec.plane_widths.len()).map(|i| spec.plane_elem(i)).collect();
        assert_eq!(got, want, "{kv:?}");
        assert_eq!(spec.plane_elem(spec.plane_widths.len()), None, "{kv:?}: a plane it lacks");
    }
}

#[test]
fn the_pool_carries_the_plans_kv_spec_and_capacities_default_to_it() {
    // V4.1-Flash in its default rows: the pool's spec is the plan's, what the writer and the
    // capacities read; a pool from parts without one is refused by name, not by widths.
    let model = ModelShape::v41_flash(1).unwrap();
    let req = PlanRequest::new(KvDtype::FlashMlaV41Fp4, IndexerDtype::Fp8, 4, 4 << 30);
    let p = plan(&model, &req).unwrap();
    let pool = Arc::new(
        Pool::new(Arc::new(HostBackend::new()), PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap(),
    );
    let kv = *pool.kv_spec().unwrap();
    assert_eq!(kv, p.kv_spec().unwrap());
    assert_eq!((kv.window(), kv.index_topk(), kv.spec_steps()), (128, model.index_topk as i32, 1));
    assert_eq!(kv.row_format().name, "flashmla-v41");
    assert_eq!(kv.compressed_format().map(|f| f.name), Some("flashmla-v41-fp4"));
    assert_eq!(kv.packed(), pool.spec().geometry.packed_rows);
    let d = DecodeCapacity::for_pool(&pool, 4, 8, 16).unwrap();
    assert_eq!((d.win, d.index_topk), (kv.window(), kv.index_topk()));
    let pc = v4pool::pool::PrefillCapacity::for_pool(&pool, 2, 64, 16).unwrap();
    assert_eq!((pc.win, pc.index_topk, pc.max_hca_entries), (kv.window(), kv.index_topk(), None));
    let w = pool.kv_row_writer(v4pool::pool::RowWriteCapacity::new(8)).unwrap();
    assert_eq!(w.row_format_code(), kv.row_format().id.kernel_code());
    assert_eq!(w.compressed_format_code(), v4pool::format::RowFormatId::FlashMlaV41Fp4.kernel_code());
    // The same parts without the spec: bytes only.
    let s = pool.spec();
    let parts = || {
        PoolSpec::new(
            s.geometry.clone(),
            s.plane_widths.clone(),
            s.arena.clone(),
            s.indexer,
            s.csa_layers.clone(),
        )
        .unwrap()
    };
    let bare = Arc::new(Pool::new(Arc::new(HostBackend::new()), parts(), Stream::DEFAULT).unwrap());
    assert!(matches!(DecodeCapacity::for_pool(&bare, 4, 8, 16), Err(PoolError::NoKvSpec)));
    assert!(bare.kv_row_writer(v4pool::pool::RowWriteCapacity::new(8)).is_err());
    // A spec whose row format is not the planes' is refused.
    let v4 = v4pool::sizing::KvSpec::new(
        &ModelShape::v4_flash(0).unwrap(),
        KvDtype::Bf16,
        IndexerDtype::Fp8,
        None,
    )
    .unwrap();
    assert!(matches!(parts().with_kv_spec(v4), Err(PoolError::InconsistentSpec { .. })));
}
