//! Exactness on the host backend: a request resumed from checkpoints (a multi-turn hit and a
//! preemption) ends with slot state and window rows byte-identical to an uninterrupted run;
//! checkpoint images carry the layout id.

use crate::manager_common;

use manager_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::checkpoint::{CheckpointError, CheckpointImage};
use v4pool::manager::{ElasticPolicy, KvManager, ManagerError, StoredCheckpoint};
use v4pool::pool::PoolError;

#[test]
fn resumed_request_is_byte_identical_to_an_uninterrupted_run() {
    exactness(Arc::new(HostBackend::new()));
}

#[test]
fn checkpoint_images_carry_the_layout_id() {
    let t = tokens(3, 1400, 0);
    let pool = state_pool(Arc::new(HostBackend::new()), 40);
    let mut m = KvManager::new(pool.clone(), config(2, true), Box::new(ElasticPolicy::default())).unwrap();
    let a = m.add_request(1400, hashes(&t));
    m.admit(a).unwrap();
    run_to(&mut m, a, &t, 1024, 512);
    let h = hashes(&t)[3];
    let pos = m.slot(a).unwrap().unwrap().position;
    let at_1024 = read(&pool, &image_ranges(&pool, pos));
    let stored = m.export_checkpoint(&h).expect("export");
    assert_eq!(stored.image.layout_id(), pool.layout_id());
    assert_eq!(stored.image.bytes().len() as u64, pool.checkpoint_image_bytes().unwrap());
    same(stored.image.bytes(), &at_1024, "exported image");
    m.finish(a).unwrap();
    // Another layout (ring 13): a typed error, nothing changes.
    let other = state_pool_ring(Arc::new(HostBackend::new()), 40, 13);
    assert_ne!(other.layout_id(), pool.layout_id());
    let mut o = KvManager::new(other, config(2, true), Box::new(ElasticPolicy::default())).unwrap();
    let before = o.pool().counts().unwrap();
    assert!(matches!(
        o.import_checkpoint(&stored),
        Err(ManagerError::Checkpoint(CheckpointError::ForeignLayout { .. }))
    ));
    assert_eq!(o.pool().counts().unwrap(), before);
    // A short image: refused by the pool's restore, the slot given back.
    m.unindex(h).unwrap();
    let counts = pool.counts().unwrap();
    let mut short = stored.image.bytes().to_vec();
    short.pop();
    let bad = StoredCheckpoint { hash: h, image: CheckpointImage::new(pool.layout_id().clone(), short) };
    assert!(matches!(m.import_checkpoint(&bad), Err(ManagerError::Pool(PoolError::BufferSize { .. }))));
    assert_eq!(pool.counts().unwrap().free_slots, counts.free_slots);
    m.check_invariants().unwrap();
    // Import it back, and a new request restores the same bytes from it.
    assert_eq!(m.checkpoint_state(&h), None);
    assert!(m.import_checkpoint(&stored).expect("import"));
    m.complete_inflight().unwrap();
    m.check_invariants().unwrap();
    let b = m.add_request(1100, hashes(&t[..1100]));
    let adm = m.admit(b).unwrap();
    assert_eq!(adm.hit_tokens, 1024);
    m.complete_inflight().unwrap();
    same(&read(&pool, &image_ranges(&pool, adm.slot.position)), &at_1024, "imported image restored");
    m.finish(b).unwrap();
    m.check_invariants().unwrap();
}

/// Allocation evicts least-recently-used cached blocks only for the shortfall, and refuses
/// without evicting anything when even full eviction could not make room.
#[test]
fn allocation_refuses_before_evicting_and_evicts_only_the_shortfall() {
    use v4pool::manager::FixedPolicy;
    let pool = state_pool(Arc::new(HostBackend::new()), 10);
    let mut m = KvManager::new(pool.clone(), config(0, false), Box::new(FixedPolicy::new(2))).unwrap();
    let total = pool.counts().unwrap().num_blocks as u64;
    let t = tokens(5, 256, 0);
    let a = m.add_request(100_000, hashes(&t));
    m.admit(a).unwrap();
    run_to(&mut m, a, &t, 256, 256);
    m.finish(a).unwrap();
    let h = hashes(&t)[0];
    assert_eq!(m.block_refs(&h), Some(0), "kept cached after finish");
    let b = m.add_request(100_000, Vec::new());
    m.admit(b).unwrap();
    m.allocate(b, (total - 1) * BLOCK).unwrap();
    assert_eq!(m.block_refs(&h), Some(0), "free blocks went first");
    match m.allocate(b, (total + 1) * BLOCK) {
        Err(ManagerError::OutOfBlocks { need: 2, available: 1 }) => {}
        other => panic!("expected OutOfBlocks {{ need: 2, available: 1 }}, got {other:?}"),
    }
    assert_eq!(m.block_refs(&h), Some(0), "a refused allocation evicted nothing");
    m.check_invariants().unwrap();
    m.allocate(b, total * BLOCK).unwrap();
    assert_eq!(m.block_refs(&h), None, "the shortfall evicted the cached block");
    assert_eq!(m.stats().evicted_blocks, 1);
    m.finish(b).unwrap();
    m.check_invariants().unwrap();
}
