//! The V4.1 indexer cache in the pool: one FP8 plane part per KV owner (layers 2, 8, 14, 20)
//! of `block_size / ratio` rows at 132 B (16,896 B per block for the ratio-2 owners, 33,792
//! for owner 20: 84,480 B per page, the plan's price), sized for every block the plane can
//! hold; its rows survive a handoff between two V4.1 pools and a host-tier spill / restore
//! byte-exact (random bytes in every plane and indexer byte, receivers poisoned).

use crate::common;
use crate::transfer_common;

use common::{case_seed, Rng};
use std::sync::Arc;
use transfer_common::*;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::Pool;
use v4pool::sizing::{IndexerDtype, IndexerPart, KvDtype, PoolLayout};
use v4pool::transfer::{handoff, Endpoint, HostTier, LocalEngine, RequestKv};

fn v41(backend: Arc<dyn Backend>, blocks: i64, slots: i64) -> Pool {
    pool_of(backend, &ModelShape::v41_flash(0).unwrap(), KvDtype::Bf16, blocks, slots).0
}

#[test]
fn the_v41_indexer_is_one_part_per_kv_owner_at_the_plans_price() {
    let pool = v41(Arc::new(HostBackend::new()), 6, 2);
    assert_eq!(pool.spec().csa_layers, vec![2, 8, 14, 20]);
    let parts: Vec<IndexerPart> = pool.indexer_parts()[0].clone();
    let bytes: Vec<u64> = parts.iter().map(|p| p.block_bytes).collect();
    assert_eq!(bytes, vec![16_896, 16_896, 16_896, 33_792]);
    assert_eq!(parts.iter().map(|p| p.prefix).collect::<Vec<_>>(), vec![0, 16_896, 33_792, 50_688]);
    assert_eq!(bytes.iter().sum::<u64>(), 84_480);
    // The plan charges the same per page.
    let layout =
        PoolLayout::new(&ModelShape::v41_flash(0).unwrap(), KvDtype::Bf16, IndexerDtype::Fp8).unwrap();
    assert_eq!(layout.indexer_block_bytes().unwrap(), 84_480);
    assert_eq!(pool.indexer_parts().len(), 1);
    assert!(pool.indexer_blocks() >= 6);
    let alloc = pool.overhead(0).unwrap().indexer_bytes;
    assert!(alloc >= 84_480 * pool.indexer_blocks(), "{alloc} B for {} blocks", pool.indexer_blocks());
    // The checkpoint unit and the transfer regions carry the same parts.
    let ck = v4pool::checkpoint::CheckpointLayout::for_pool(&layout).unwrap();
    assert_eq!(ck.page_bytes, layout.page_bytes().unwrap());
    assert_eq!(ck.page_bytes, 640 * 1024 + 84_480);
    let on = v4pool::pool::regions::TransferConfig::new(true, 1);
    let regions = pool.transfer_regions(&on).unwrap();
    let ix: Vec<(String, u64, u64)> =
        regions.block_regions[1..].iter().map(|r| (r.role.clone(), r.base, r.unit_bytes)).collect();
    let nb = pool.indexer_blocks();
    let want: Vec<(String, u64, u64)> =
        [(2, 0, 16_896), (8, 16_896, 16_896), (14, 33_792, 16_896), (20, 50_688, 33_792)]
            .into_iter()
            .map(|(l, p, b)| (format!("dsv4.csa_indexer.layer_{l}"), p * nb, b))
            .collect();
    assert_eq!(ix, want);
    // No two blocks of two owners share a byte.
    let mut ranges: Vec<(u64, u64)> =
        (0..pool.indexer_blocks() as u32).flat_map(|b| block_ranges(&pool, b)).collect();
    ranges.sort_unstable();
    assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
}

fn request(pool: &Pool, n: usize, rng: &mut Rng) -> RequestKv {
    let slot = pool.alloc_slot().unwrap();
    let blocks: Vec<_> = (0..n).map(|_| pool.alloc_block().unwrap().handle).collect();
    for &b in &blocks {
        let r = block_ranges(pool, b.id);
        write(pool, &r, &rng.bytes(total(&r)));
    }
    let r = slot_ranges(pool, slot.position);
    write(pool, &r, &rng.bytes(total(&r)));
    RequestKv { blocks, slot: slot.handle, context_len: n as u64 * 256 - 5 }
}

#[test]
fn v41_indexer_rows_survive_a_handoff() {
    for (i, n) in [1usize, 4].into_iter().enumerate() {
        let mut rng = Rng::new(case_seed("v41-indexer-handoff", i as u64));
        let (b0, b1): (Arc<dyn Backend>, Arc<dyn Backend>) =
            (Arc::new(HostBackend::new()), Arc::new(HostBackend::new()));
        // Different block counts: the receiver's indexer layers sit at other offsets.
        let (sender, receiver) = (v41(b0.clone(), 7, 1), v41(b1.clone(), 5, 3));
        assert_ne!(sender.indexer_blocks(), receiver.indexer_blocks());
        let r = all_ranges(&receiver);
        write(&receiver, &r, &rng.bytes(total(&r)));
        let req = request(&sender, n, &mut rng);
        let mut engine = LocalEngine::new(b0, b1, Stream::DEFAULT);
        let out = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req).unwrap();
        for (a, b) in req.blocks.iter().zip(&out.blocks) {
            let (sr, rr) = (block_ranges(&sender, a.id), block_ranges(&receiver, b.id));
            // Planes first, then the four owners' index rows.
            assert_eq!(rr.len(), 1 + 4);
            assert!(read(&receiver, &rr[1..]) == read(&sender, &sr[1..]), "n={n}: indexer rows differ");
            assert!(read(&receiver, &rr) == read(&sender, &sr), "n={n}: block bytes differ");
        }
    }
}

#[test]
fn v41_indexer_rows_survive_a_host_tier_spill_and_restore() {
    let pool = v41(Arc::new(HostBackend::new()), 8, 1);
    let mut rng = Rng::new(case_seed("v41-indexer-tier", 0));
    let unit = HostTier::<u64>::new(&pool, 1).unwrap().unit_bytes();
    // A unit is a block: its envelope rows and its 84,480 indexer bytes.
    let g = &pool.spec().geometry;
    assert_eq!(unit, g.block_bytes(1024) + 84_480);
    let mut tier: HostTier<u64> = HostTier::new(&pool, unit * 4).unwrap();
    let blocks: Vec<_> = (0..3).map(|_| pool.alloc_block().unwrap().handle).collect();
    let data: Vec<Vec<u8>> = blocks
        .iter()
        .map(|b| {
            let r = block_ranges(&pool, b.id);
            let d = rng.bytes(total(&r));
            write(&pool, &r, &d);
            d
        })
        .collect();
    tier.spill(&pool, 7, &blocks).unwrap();
    for b in blocks {
        let r = block_ranges(&pool, b.id);
        write(&pool, &r, &rng.bytes(total(&r)));
        pool.free_block(b).unwrap();
    }
    // Take the lowest ids so the restore lands elsewhere.
    let hog: Vec<_> = (0..2).map(|_| pool.alloc_block().unwrap().handle).collect();
    let restored = tier.restore(&pool, &7).unwrap();
    for (b, want) in restored.iter().zip(&data) {
        assert!(read(&pool, &block_ranges(&pool, b.id)) == *want, "restored block {} differs", b.id);
    }
    drop(hog);
}

/// At production sizes (100 GiB, 256 sequences) the indexer a V4.1 pool allocates is what
/// the plan budgeted for it, never more, and planes plus indexer stay inside the budget.
#[test]
fn the_v41_indexer_stays_inside_the_plans_budget() {
    use v4pool::pool::{Overhead, PoolSpec};
    use v4pool::sizing::{plan, PlanRequest};
    for model in [ModelShape::v41_flash(0).unwrap(), ModelShape::v41_flash_dspark(5).unwrap()] {
        let budget = 100u64 << 30;
        let p = plan(&model, &PlanRequest::new(KvDtype::Bf16, IndexerDtype::Fp8, 256, budget)).unwrap();
        let spec = PoolSpec::from_plan(&p).unwrap();
        assert_eq!(spec.csa_layers, vec![2, 8, 14, 20]);
        let o = Overhead::estimate(&spec, None).unwrap();
        assert!(o.indexer_bytes > 0, "{}: no indexer", model.name);
        assert!(
            o.indexer_bytes <= p.indexer_total_bytes,
            "{}: {} > {}",
            model.name,
            o.indexer_bytes,
            p.indexer_total_bytes
        );
        assert!(o.plane_bytes <= p.planes_total_bytes);
        assert!(o.indexer_bytes + o.plane_bytes <= budget);
    }
}
