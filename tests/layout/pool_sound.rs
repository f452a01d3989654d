//! The pool under misuse (issue 10, points 1 and 6), on the host backend: every public entry
//! checks positions, blocks, runs and specs against the plane and answers a typed error,
//! writing nothing; an image of another layout is refused even when its length matches.
//! Each case crashed, wrote out of bounds or was accepted at abfc315.

use crate::pool_common;

use pool_common::{pattern, small_pool, small_spec, RATIOS, WIDTHS};
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::checkpoint::{CheckpointError, CheckpointImage, LayoutId, Loc, Region, RegionCopy};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolError, PoolSpec};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

/// Every byte of every plane.
fn planes(pool: &Pool) -> Vec<Vec<u8>> {
    (0..pool.num_planes())
        .map(|p| {
            let mut buf = vec![0u8; pool.plane_bytes(p).unwrap() as usize];
            pool.read_plane(p, 0, &mut buf).unwrap();
            buf
        })
        .collect()
}

/// A pool whose planes hold random bytes (so a stray write shows).
fn filled_pool() -> Pool {
    let pool = small_pool(12, 4);
    for p in 0..pool.num_planes() {
        let n = pool.plane_bytes(p).unwrap() as usize;
        pool.write_plane(p, 0, &pattern(p as u64 + 11, n)).unwrap();
    }
    pool
}

#[test]
fn copy_regions_checks_every_run_and_moves_exactly_the_bytes() {
    let pool = filled_pool();
    let before = planes(&pool);
    let plane0 = pool.plane_bytes(0).unwrap();
    let at = |region, offset| Loc { region, offset };
    type Case = (RegionCopy, fn(&PoolError) -> bool);
    let bad: Vec<Case> = vec![
        (
            RegionCopy { src: at(Region::Plane(0), plane0 - 8), dst: at(Region::Plane(0), 0), bytes: 16 },
            |e| matches!(e, PoolError::OutOfRange { .. }),
        ),
        (RegionCopy { src: at(Region::Plane(0), 0), dst: at(Region::Plane(1), u64::MAX), bytes: 2 }, |e| {
            matches!(e, PoolError::OutOfRange { .. })
        }),
        (RegionCopy { src: at(Region::Plane(2), 0), dst: at(Region::Plane(0), 0), bytes: 1 }, |e| {
            matches!(e, PoolError::NoSuchPlane { plane: 2, .. })
        }),
        (RegionCopy { src: at(Region::Indexer(1), 0), dst: at(Region::Plane(0), 0), bytes: 1 }, |e| {
            matches!(e, PoolError::NoSuchRegion { .. })
        }),
        (RegionCopy { src: at(Region::Plane(0), 0), dst: at(Region::Plane(0), 8), bytes: 16 }, |e| {
            matches!(e, PoolError::SelfOverlap { index: 1 })
        }),
    ];
    let good = RegionCopy { src: at(Region::Plane(0), 64), dst: at(Region::Plane(1), 0), bytes: 32 };
    for (run, check) in bad {
        // A good run first: nothing of a refused list is queued.
        let e = pool.copy_regions(&[good, run]).expect_err("refused");
        assert!(check(&e), "{run:?}: {e:?}");
        assert_eq!(planes(&pool), before, "{run:?} wrote something");
    }
    pool.copy_regions(&[good]).unwrap();
    let mut want = before.clone();
    want[1][..32].copy_from_slice(&before[0][64..96]);
    assert_eq!(planes(&pool), want);
}

#[test]
fn init_positions_refuses_what_is_not_a_live_slot() {
    let pool = filled_pool();
    let before = planes(&pool);
    let live = pool.with_boundary(|b| b.live_positions()).unwrap();
    let total = pool.spec().geometry.slot_positions;
    for bad in
        [-1..0, live.start - 1..live.start, total..total + 1, live.start..total + 1, i64::MAX - 1..i64::MAX]
    {
        let e = pool.init_positions(bad.clone()).expect_err("refused");
        assert!(matches!(e, PoolError::NotLive { .. }), "{bad:?}: {e:?}");
    }
    assert_eq!(planes(&pool), before, "a refused init wrote");
    // A live position is initialised: its arena differs now, nothing outside the slot does.
    pool.init_positions(live.start..live.start + 1).unwrap();
    assert_ne!(planes(&pool), before);
}

#[test]
fn block_copy_runs_refuse_ids_off_the_plane() {
    let pool = small_pool(12, 4);
    let max = pool.indexer_blocks() as u32;
    for (from, to) in [(u32::MAX, 0), (0, u32::MAX), (max, 0), (0, max)] {
        let e = pool.block_copy_runs(from, to).expect_err("refused");
        assert!(matches!(e, PoolError::NoSuchBlock { .. }), "({from}, {to}): {e:?}");
    }
    let g = &pool.spec().geometry;
    for r in pool.block_copy_runs(max - 1, 0).unwrap().iter().take(WIDTHS.len()) {
        let base = pool.plane_ptr(0).unwrap();
        let end = base + WIDTHS.iter().map(|&w| g.plane_bytes(w)).sum::<u64>() + 256;
        assert!(r.src >= base && r.src + r.bytes <= end, "{r:?} off the planes");
    }
}

#[test]
fn edited_specs_are_refused_before_anything_is_carved() {
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let spec = small_spec(&RATIOS, &WIDTHS, IndexerDtype::Fp8, 12, 4);
    type Edit = fn(&mut PoolSpec);
    let edits: [(&str, Edit); 6] = [
        ("plane_rows doubled", |s| s.geometry.plane_rows *= 2),
        ("slot_positions raised", |s| s.geometry.slot_positions += 5),
        ("slot_rows shrunk", |s| s.geometry.slot_rows -= 1),
        ("plane widths doubled", |s| s.plane_widths.iter_mut().for_each(|w| *w *= 2)),
        ("a plane dropped", |s| s.plane_widths.truncate(1)),
        ("csa layers edited", |s| s.csa_layers.push(5)),
    ];
    for (what, edit) in edits {
        let mut s = spec.clone();
        edit(&mut s);
        let e = Pool::new(backend.clone(), s, Stream::DEFAULT).expect_err(what);
        assert!(
            matches!(
                e,
                PoolError::InconsistentSpec { .. } | PoolError::Geometry(_) | PoolError::ArenaMismatch { .. }
            ),
            "{what}: {e:?}"
        );
    }
    // A plan's spec keeps its §6 layout id only while it is what the plan made.
    let p = plan(
        &ModelShape::v4_flash(0).unwrap(),
        &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 1, 96 << 20),
    )
    .unwrap();
    let mut s = PoolSpec::from_plan(&p).unwrap();
    s.indexer = Some(IndexerDtype::Fp4);
    let e = Pool::new(backend, s, Stream::DEFAULT).expect_err("indexer edited");
    assert!(matches!(e, PoolError::InconsistentSpec { .. }), "{e:?}");
}

fn flash_pool(indexer: IndexerDtype) -> Pool {
    let p = plan(&ModelShape::v4_flash(0).unwrap(), &PlanRequest::new(KvDtype::Fp8, indexer, 2, 96 << 20))
        .unwrap();
    Pool::new(Arc::new(HostBackend::new()), PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap()
}

/// `image` offered to a held slot of `pool`: refused as a foreign layout naming both ids, the
/// slot unchanged.
fn assert_foreign(pool: &Pool, image: &CheckpointImage) {
    let lease = pool.alloc_slot().unwrap();
    let before = pool.checkpoint(lease.handle).unwrap();
    assert_eq!(before.bytes().len(), image.bytes().len(), "the lengths match: only the id tells");
    match pool.restore(lease.handle, image) {
        Err(PoolError::Checkpoint(CheckpointError::ForeignLayout { pool: p, image: i })) => {
            assert_eq!((p.as_str(), i.as_str()), (pool.layout_id().as_str(), image.layout_id().as_str()));
        }
        other => panic!("restored a foreign image: {other:?}"),
    }
    assert_eq!(pool.checkpoint(lease.handle).unwrap(), before, "a refused restore wrote");
    pool.free_slot(lease.handle).unwrap();
}

#[test]
fn restore_refuses_an_image_of_another_layout() {
    // fp8-indexer image into an fp4-indexer pool.
    let (fp8, fp4) = (flash_pool(IndexerDtype::Fp8), flash_pool(IndexerDtype::Fp4));
    assert_ne!(fp8.layout_id(), fp4.layout_id());
    let slot = fp8.alloc_slot().unwrap();
    let image = fp8.checkpoint(slot.handle).unwrap();
    assert_eq!(image.layout_id(), fp8.layout_id());
    assert_foreign(&fp4, &image);
    // Ratios in another order: same arena, same image length, another model.
    let swapped = [0, 128, 4, 128, 4, 0];
    let other = Pool::new(
        Arc::new(HostBackend::new()),
        small_spec(&swapped, &WIDTHS, IndexerDtype::Fp8, 12, 4),
        Stream::DEFAULT,
    )
    .unwrap();
    let pool = small_pool(12, 4);
    let lease = other.alloc_slot().unwrap();
    assert_foreign(&pool, &other.checkpoint(lease.handle).unwrap());
    // An import under a made-up id is refused; under the pool's id, with the right length, it
    // restores byte for byte.
    let (id, bytes) = image.into_parts();
    assert_foreign(&fp8, &CheckpointImage::new(LayoutId::new(format!("{id}x")), bytes.clone()));
    let short = CheckpointImage::new(id.clone(), bytes[1..].to_vec());
    assert!(matches!(fp8.restore(slot.handle, &short), Err(PoolError::BufferSize { .. })));
    let fresh = fp8.alloc_slot().unwrap();
    let src = pattern(5, bytes.len());
    fp8.restore(fresh.handle, &CheckpointImage::new(id.clone(), src.clone())).unwrap();
    assert_eq!(fp8.checkpoint(fresh.handle).unwrap().bytes(), &src[..]);
    // The device-pointer form checks the id before it touches the pointer.
    let tmp = fp8.backend().alloc_zeroed(bytes.len() as u64).unwrap();
    // SAFETY: `tmp` holds a whole image, lives past the call, and is disjoint from the planes.
    let r = unsafe { fp8.restore_from(fresh.handle, tmp.ptr, fp4.layout_id()) };
    assert!(matches!(r, Err(PoolError::Checkpoint(CheckpointError::ForeignLayout { .. }))), "{r:?}");
    // SAFETY: the refused call queued nothing.
    unsafe { fp8.backend().free(tmp) };
    assert_eq!(fp8.checkpoint(fresh.handle).unwrap().bytes(), &src[..]);
}

#[test]
fn slot_and_block_access_stays_inside_what_is_held() {
    let pool = small_pool(12, 4);
    let g = pool.spec().geometry.clone();
    let lease = pool.alloc_slot().unwrap();
    let block = pool.alloc_block().unwrap().handle;
    let slot_bytes = g.slot_bytes(WIDTHS[0]);
    assert!(matches!(
        pool.write_slot(lease.handle, 0, slot_bytes - 1, &[1, 2]),
        Err(PoolError::OutOfRange { .. })
    ));
    assert!(matches!(pool.write_slot(lease.handle, 0, u64::MAX, &[1]), Err(PoolError::OutOfRange { .. })));
    assert!(matches!(pool.write_slot(lease.handle, 2, 0, &[1]), Err(PoolError::NoSuchPlane { .. })));
    let block_bytes = g.block_bytes(WIDTHS[1]);
    assert!(matches!(pool.read_block(block, 1, block_bytes, &mut [0]), Err(PoolError::OutOfRange { .. })));
    // Written and read back where they are held; freed handles are refused.
    let bytes = pattern(3, slot_bytes as usize);
    pool.write_slot(lease.handle, 0, 0, &bytes).unwrap();
    let mut back = vec![0u8; bytes.len()];
    pool.read_slot(lease.handle, 0, 0, &mut back).unwrap();
    assert_eq!(back, bytes);
    pool.free_slot(lease.handle).unwrap();
    pool.free_block(block).unwrap();
    assert!(matches!(pool.write_slot(lease.handle, 0, 0, &[1]), Err(PoolError::Alloc(_))));
    assert!(matches!(pool.write_block(block, 0, 0, &[1]), Err(PoolError::Alloc(_))));
}

/// defect43 row 11: a page larger than the plane was `Ok` with 0 pages (and a view of
/// `[0, 2^63 − 1, 1, row]` through Python and C): refused as `NotPageable`, from every page
/// size past what the plane holds from the view's page; the page sizes that fit still answer.
#[test]
fn page_views_refuse_pages_larger_than_the_plane() {
    let pool = small_pool(12, 4);
    let rows = pool.geometry().unwrap().plane_rows;
    for page_rows in [i64::MAX, rows + 1, 1 << 40] {
        match pool.page_view(0, 0, page_rows) {
            Err(PoolError::NotPageable { .. }) => {}
            other => panic!("page of {page_rows} rows on a {rows}-row plane: {other:?}"),
        }
    }
    let v = pool.page_view(0, 0, 4).unwrap();
    assert!(v.pages >= 1 && v.pages * 4 <= rows, "{v:?}");
}
