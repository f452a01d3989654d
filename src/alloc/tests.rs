//! One test per rule of §5.1 and §5.2, plus the handle rules.

use super::*;

const H1: BlockHash = 0xA11CE;
const H2: BlockHash = 0xB0B;
const H3: BlockHash = 0xC0FFEE;

/// A pool whose blocks `ids` were allocated, published with `hash_base + id`, and freed in the
/// given order: they sit in the cached queue in that order.
fn cached_pool(n: u32, ids: &[u32], hash_base: BlockHash) -> BlockPool {
    let mut p = BlockPool::new(n).unwrap();
    for _ in 0..n {
        p.alloc().unwrap();
    }
    for &id in ids {
        p.publish(id, hash_base + u64::from(id), 256).unwrap();
    }
    for &id in ids {
        p.free(id).unwrap();
    }
    p
}

fn unchanged<T: Clone + PartialEq + std::fmt::Debug, E: std::fmt::Debug>(
    pool: &mut T,
    op: impl FnOnce(&mut T) -> Result<(), E>,
) -> E {
    let before = pool.clone();
    let err = op(pool).expect_err("operation should be refused");
    assert_eq!(*pool, before, "a refused operation changed the pool ({err:?})");
    err
}

// ---- BlockPool: pop / allocate ----------------------------------------------------------------

#[test]
fn pop_takes_lowest_vacant_and_does_not_mark_used() {
    let mut p = BlockPool::new(5).unwrap();
    assert_eq!(p.pop().unwrap(), 0);
    assert_eq!(p.pop().unwrap(), 1);
    assert!(p.is_popped(0).unwrap());
    assert!(!p.is_free(0).unwrap());
    assert_eq!(p.ref_count(0).unwrap(), 0);
    assert_eq!(p.num_free(), 3);
    // Not used: free refuses it; allocate completes it.
    assert_eq!(p.free(0), Err(AllocError::BlockNotHeld { id: 0 }));
    assert_eq!(p.allocate(0).unwrap(), None);
    assert_eq!(p.ref_count(0).unwrap(), 1);
    // Freed low ids come back before higher ones.
    p.free(0).unwrap();
    assert_eq!(p.pop().unwrap(), 0);
}

#[test]
fn pop_prefers_vacant_then_least_recently_freed_cached() {
    // Freed 3, 1, 2 with hashes: cached in that order; 0 and 4 have no hash.
    let mut p = cached_pool(5, &[3, 1, 2], 100);
    p.free(4).unwrap();
    p.free(0).unwrap();
    assert_eq!(p.free_order(), vec![0, 4, 3, 1, 2]);
    let order: Vec<u32> = (0..5).map(|_| p.pop().unwrap()).collect();
    assert_eq!(order, vec![0, 4, 3, 1, 2]);
    assert_eq!(p.pop(), Err(AllocError::NoFreeBlocks));
    assert_eq!(AllocError::NoFreeBlocks.to_string(), "No free blocks available");
}

#[test]
fn content_is_lost_when_handed_out_again_not_when_freed() {
    let mut p = BlockPool::new(1).unwrap();
    let g = p.alloc().unwrap();
    assert_eq!(g.evicted, None);
    p.publish(0, H1, 200).unwrap();
    p.free(0).unwrap();
    // Freed: still findable, content intact.
    assert_eq!(p.lookup(H1), Some(0));
    assert_eq!((p.hash(0).unwrap(), p.tokens(0).unwrap()), (Some(H1), 200));
    // Handed out again: the index entry goes, reported; content cleared.
    let id = p.pop().unwrap();
    assert_eq!(p.allocate(id).unwrap(), Some(H1));
    assert_eq!(p.lookup(H1), None);
    assert_eq!((p.hash(0).unwrap(), p.tokens(0).unwrap()), (None, 0));
}

#[test]
fn allocate_refuses_a_referenced_block_and_out_of_range() {
    let mut p = BlockPool::new(3).unwrap();
    p.alloc().unwrap();
    p.claim(0).unwrap();
    let e = unchanged(&mut p, |p| p.allocate(0).map(drop));
    assert_eq!(e, AllocError::BlockReferenced { id: 0, ref_count: 2 });
    let e = unchanged(&mut p, |p| p.allocate(3).map(drop));
    assert_eq!(e, AllocError::BlockOutOfRange { id: 3, num_blocks: 3 });
}

#[test]
fn allocate_of_a_free_id_directly_takes_it_off_the_free_set() {
    let mut p = BlockPool::new(4).unwrap();
    p.allocate(2).unwrap();
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.free_order(), vec![0, 1, 3]);
    assert_eq!((0..3).map(|_| p.pop().unwrap()).collect::<Vec<_>>(), vec![0, 1, 3]);
}

// ---- claim / publish / free / lookup ----------------------------------------------------------

#[test]
fn claim_shares_a_used_block_and_revives_a_cached_one_with_its_content() {
    let mut p = cached_pool(3, &[0, 1], 10);
    p.claim(2).unwrap();
    assert_eq!(p.ref_count(2).unwrap(), 2);
    // Cached block 0: back to ref 1 with hash and tokens, off the free list.
    p.claim(0).unwrap();
    assert_eq!(p.ref_count(0).unwrap(), 1);
    assert_eq!((p.hash(0).unwrap(), p.tokens(0).unwrap()), (Some(10), 256));
    assert_eq!(p.lookup(10), Some(0));
    assert_eq!(p.free_order(), vec![1]);
    // Freeing it again puts it at the LRU tail, behind 1.
    p.free(0).unwrap();
    assert_eq!(p.free_order(), vec![1, 0]);
    assert_eq!(p.pop().unwrap(), 1);
}

#[test]
fn publish_repoints_a_hash_and_the_old_holder_reports_nothing_later() {
    let mut p = BlockPool::new(3).unwrap();
    p.alloc().unwrap();
    p.alloc().unwrap();
    p.publish(0, H1, 256).unwrap();
    p.publish(1, H1, 256).unwrap();
    assert_eq!(p.lookup(H1), Some(1));
    assert_eq!(p.hash(0).unwrap(), Some(H1), "block 0 keeps its hash field");
    p.free(0).unwrap();
    assert_eq!(p.free_order(), vec![2, 0], "0 has a hash, so it is cached");
    // Handing 0 out again evicts nothing: it no longer owns H1's entry.
    assert_eq!(p.allocate(0).unwrap(), None);
    assert_eq!(p.lookup(H1), Some(1));
}

#[test]
fn republishing_a_block_drops_its_old_index_entry() {
    let mut p = BlockPool::new(1).unwrap();
    p.alloc().unwrap();
    assert_eq!(p.publish(0, H1, 1).unwrap(), None);
    assert_eq!(p.publish(0, H1, 2).unwrap(), None, "same hash: nothing dropped");
    assert_eq!(p.publish(0, H2, 3).unwrap(), Some(H1));
    assert_eq!((p.lookup(H1), p.lookup(H2)), (None, Some(0)));
}

#[test]
fn publish_needs_a_held_block() {
    let mut p = BlockPool::new(2).unwrap();
    let e = unchanged(&mut p, |p| p.publish(1, H1, 1).map(drop));
    assert_eq!(e, AllocError::BlockNotHeld { id: 1 });
    let e = unchanged(&mut p, |p| p.publish(2, H1, 1).map(drop));
    assert_eq!(e, AllocError::BlockOutOfRange { id: 2, num_blocks: 2 });
}

#[test]
fn free_counts_down_and_frees_at_zero() {
    let mut p = BlockPool::new(2).unwrap();
    p.alloc().unwrap();
    p.claim(0).unwrap();
    p.free(0).unwrap();
    assert_eq!((p.ref_count(0).unwrap(), p.is_free(0).unwrap()), (1, false));
    p.free(0).unwrap();
    assert_eq!((p.ref_count(0).unwrap(), p.is_free(0).unwrap()), (0, true));
    assert_eq!(p.free_order(), vec![0, 1], "no hash: vacant");
    let e = unchanged(&mut p, |p| p.free(0));
    assert_eq!(e, AllocError::BlockNotHeld { id: 0 });
}

#[test]
fn lookup_of_an_unknown_hash_is_none() {
    let p = cached_pool(2, &[0], 7);
    assert_eq!(p.lookup(7), Some(0));
    assert_eq!(p.lookup(8), None);
}

#[test]
fn clear_index_forgets_free_content_keeps_held_content_and_makes_free_vacant() {
    // 0 held with H1; 1, 2 cached (freed 2 then 1); 3 vacant.
    let mut p = BlockPool::new(4).unwrap();
    for _ in 0..4 {
        p.alloc().unwrap();
    }
    p.publish(0, H1, 5).unwrap();
    p.publish(1, H2, 6).unwrap();
    p.publish(2, H3, 7).unwrap();
    for id in [2, 1, 3] {
        p.free(id).unwrap();
    }
    assert_eq!(p.free_order(), vec![3, 2, 1]);
    p.clear_index();
    assert_eq!((p.lookup(H1), p.lookup(H2), p.lookup(H3)), (None, None, None));
    assert_eq!((p.hash(0).unwrap(), p.tokens(0).unwrap()), (Some(H1), 5));
    assert_eq!((p.hash(1).unwrap(), p.tokens(1).unwrap()), (None, 0));
    assert_eq!(p.free_order(), vec![1, 2, 3], "all vacant, lowest first");
    // The held block no longer owns an entry: handing it out later reports nothing.
    p.free(0).unwrap();
    assert_eq!(p.free_order(), vec![1, 2, 3, 0], "it still has a hash: cached");
    assert_eq!(p.allocate(0).unwrap(), None);
}

// ---- raw units --------------------------------------------------------------------------------

#[test]
fn reserve_units_takes_pop_order_or_nothing() {
    let mut p = cached_pool(4, &[1], 50);
    p.free(2).unwrap();
    // Free: vacant 2, cached 1.
    let before = p.clone();
    assert_eq!(p.reserve_units(3, 9), None);
    assert_eq!(p, before);
    let r = p.reserve_units(2, 9).unwrap();
    assert_eq!(r.ids, vec![2, 1]);
    assert_eq!(r.evicted, vec![51], "the cached unit's index entry is dropped");
    assert_eq!(p.raw_unit(1).unwrap(), Some(RawUnit { owner: 9, piece: 1 }));
    assert_eq!(p.raw_unit(2).unwrap(), Some(RawUnit { owner: 9, piece: 0 }));
    assert_eq!(p.reserve_units(0, 9), Some(Reservation { ids: vec![], evicted: vec![] }));
}

#[test]
fn raw_units_refuse_free_claim_publish() {
    let mut p = BlockPool::new(2).unwrap();
    let r = p.reserve_units(1, 4).unwrap();
    let id = r.ids[0];
    let raw = AllocError::RawUnit { id, owner: 4 };
    assert_eq!(unchanged(&mut p, |p| p.free(id)), raw);
    assert_eq!(unchanged(&mut p, |p| p.claim(id)), raw);
    assert_eq!(unchanged(&mut p, |p| p.publish(id, H1, 1).map(drop)), raw);
    let h = p.current_handle(id).unwrap();
    assert_eq!(unchanged(&mut p, |p| p.free_handle(h)), raw);
}

#[test]
fn release_units_validates_everything_first() {
    let mut p = BlockPool::new(6).unwrap();
    let a = p.reserve_units(3, 1).unwrap().ids;
    let b = p.reserve_units(2, 2).unwrap().ids;
    assert_eq!((a.clone(), b.clone()), (vec![0, 1, 2], vec![3, 4]));
    // Wrong owner on the last id: nothing released, not even the first two.
    let e = unchanged(&mut p, |p| p.release_units(&[0, 1, 3], 1));
    assert_eq!(
        e,
        AllocError::UnitMismatch { id: 3, owner: 1, piece: 2, found: Some(RawUnit { owner: 2, piece: 0 }) }
    );
    // Wrong order.
    let e = unchanged(&mut p, |p| p.release_units(&[1, 0, 2], 1));
    assert_eq!(
        e,
        AllocError::UnitMismatch { id: 1, owner: 1, piece: 0, found: Some(RawUnit { owner: 1, piece: 1 }) }
    );
    // Not a unit at all; out of range.
    let e = unchanged(&mut p, |p| p.release_units(&[5], 2));
    assert_eq!(e, AllocError::UnitMismatch { id: 5, owner: 2, piece: 0, found: None });
    let e = unchanged(&mut p, |p| p.release_units(&[9], 2));
    assert_eq!(e, AllocError::BlockOutOfRange { id: 9, num_blocks: 6 });
    p.release_units(&a, 1).unwrap();
    assert_eq!(p.free_order(), vec![0, 1, 2, 5]);
    assert_eq!(p.raw_unit(0).unwrap(), None);
    p.release_units(&b, 2).unwrap();
    assert_eq!(p.num_free(), 6);
}

// ---- extend / retire_top ----------------------------------------------------------------------

#[test]
fn extend_takes_up_to_max_blocks() {
    let mut p = BlockPool::with_max_blocks(2, 5).unwrap();
    assert_eq!(p.extend(2), 2);
    assert_eq!(p.extend(7), 1);
    assert_eq!(p.extend(1), 0);
    assert_eq!((p.num_blocks(), p.num_free()), (5, 5));
    assert_eq!(p.free_order(), vec![0, 1, 2, 3, 4]);
    assert_eq!(
        BlockPool::with_max_blocks(3, 2).unwrap_err(),
        AllocError::MaxBelowNum { max_blocks: 2, num_blocks: 3 }
    );
    assert_eq!(
        unchanged(&mut p, |p| p.set_max_blocks(4)),
        AllocError::MaxBelowNum { max_blocks: 4, num_blocks: 5 }
    );
}

#[test]
fn retire_top_of_an_empty_pool_is_none() {
    let mut p = BlockPool::new(0).unwrap();
    assert_eq!(p.retire_top(), None);
}

#[test]
fn retire_top_drops_a_free_top_and_evicts_its_hash() {
    let mut p = cached_pool(3, &[2], 70);
    assert_eq!(p.retire_top(), Some(BlockRetired { retired: 2, moved_to: None, evicted: Some(72) }));
    assert_eq!((p.num_blocks(), p.num_free(), p.max_blocks()), (2, 0, 3));
    assert_eq!(p.lookup(72), None);
    // It comes back blank.
    assert_eq!(p.extend(1), 1);
    assert_eq!((p.hash(2).unwrap(), p.free_order()), (None, vec![2]));
}

#[test]
fn retire_top_moves_a_held_top_to_the_lowest_vacant() {
    let mut p = BlockPool::new(4).unwrap();
    for _ in 0..4 {
        p.alloc().unwrap();
    }
    p.claim(3).unwrap();
    p.publish(3, H1, 99).unwrap();
    p.free(1).unwrap();
    p.free(2).unwrap();
    let old = p.current_handle(3).unwrap();
    let r = p.retire_top().unwrap();
    assert_eq!(r, BlockRetired { retired: 3, moved_to: Some(1), evicted: None });
    assert_eq!((p.ref_count(1).unwrap(), p.hash(1).unwrap(), p.tokens(1).unwrap()), (2, Some(H1), 99));
    assert_eq!(p.lookup(H1), Some(1), "the index follows");
    assert_eq!(p.free_order(), vec![2]);
    assert!(matches!(p.check(old), Err(AllocError::StaleHandle { .. })));
    p.check(p.current_handle(1).unwrap()).unwrap();
}

#[test]
fn retire_top_into_a_cached_destination_evicts_the_destination_hash() {
    // 0 and 1 cached (hashes 40, 41), 2 held with H1.
    let mut p = cached_pool(3, &[0, 1], 40);
    p.publish(2, H1, 1).unwrap();
    let r = p.retire_top().unwrap();
    assert_eq!(r, BlockRetired { retired: 2, moved_to: Some(0), evicted: Some(40) });
    assert_eq!((p.lookup(40), p.lookup(H1)), (None, Some(0)));
}

#[test]
fn retire_top_refuses_a_raw_top_and_a_held_top_with_nowhere_to_go() {
    let mut p = BlockPool::new(2).unwrap();
    p.alloc().unwrap();
    p.reserve_units(1, 3).unwrap();
    let before = p.clone();
    assert_eq!(p.retire_top(), None);
    assert_eq!(p, before);
    let mut p = BlockPool::new(2).unwrap();
    p.alloc().unwrap();
    p.alloc().unwrap();
    let before = p.clone();
    assert_eq!(p.retire_top(), None);
    assert_eq!(p, before);
}

// ---- block handles ----------------------------------------------------------------------------

#[test]
fn block_handles_catch_double_free_stale_and_foreign_use() {
    let mut p = BlockPool::new(2).unwrap();
    let mut q = BlockPool::new(2).unwrap();
    assert_ne!(p.pool_id(), q.pool_id());
    let h = p.alloc().unwrap().handle;
    assert_eq!(h.pool, p.pool_id());
    p.check(h).unwrap();
    let e = unchanged(&mut q, |q| q.free_handle(h));
    assert_eq!(e, AllocError::ForeignHandle { what: "block", handle_pool: p.pool_id(), pool: q.pool_id() });
    p.free_handle(h).unwrap();
    let e = unchanged(&mut p, |p| p.free_handle(h));
    assert_eq!(e, AllocError::DoubleFree { what: "block", id: h.id, generation: h.generation });
    assert_eq!(p.check(h), Err(AllocError::NotHeld { what: "block", id: h.id }));
    // Handed out again: the old handle is stale.
    let h2 = p.alloc().unwrap().handle;
    assert_eq!(h2.id, h.id);
    assert_eq!(h2.generation, h.generation + 1);
    let e = unchanged(&mut p, |p| p.free_handle(h));
    assert_eq!(
        e,
        AllocError::StaleHandle { what: "block", id: h.id, generation: h.generation, current: h2.generation }
    );
    // A claim of a free block is a new handing out; a claim of a held one is not.
    p.free_handle(h2).unwrap();
    let h3 = p.claim_handle(h2.id).unwrap();
    assert_eq!(h3.generation, h2.generation + 1);
    assert_eq!(p.claim_handle(h2.id).unwrap(), h3);
}

#[test]
fn a_retired_id_invalidates_its_handles_even_after_extend() {
    let mut p = BlockPool::new(2).unwrap();
    p.alloc().unwrap();
    let top = p.alloc().unwrap().handle;
    p.free_handle(top).unwrap();
    p.retire_top().unwrap();
    assert!(matches!(p.check(top), Err(AllocError::StaleHandle { .. })));
    p.extend(1);
    let again = p.alloc().unwrap().handle;
    assert_eq!(again.id, top.id);
    assert_ne!(again.generation, top.generation);
    assert!(matches!(p.free_handle(top), Err(AllocError::StaleHandle { .. })));
}

#[test]
fn cached_queue_stays_bounded_under_churn() {
    // A long-lived cached head and one block freed and claimed over and over.
    let mut p = cached_pool(4, &[0, 1], 0);
    for _ in 0..if cfg!(miri) { 1_000 } else { 10_000 } {
        p.claim(1).unwrap();
        p.free(1).unwrap();
    }
    assert!(p.cached_queue_len() <= 2 * 4 + 17, "cached queue grew to {}", p.cached_queue_len());
    assert_eq!(p.free_order(), vec![0, 1]);
}

// ---- SlotPool ---------------------------------------------------------------------------------

#[test]
fn slot_pop_takes_lowest_vacant_and_release_returns_it() {
    let mut s = SlotPool::new(4).unwrap();
    assert_eq!((s.pop().unwrap(), s.pop().unwrap(), s.pop().unwrap()), (0, 1, 2));
    s.release(1).unwrap();
    s.release(0).unwrap();
    assert_eq!(s.free_order(), vec![0, 1, 3]);
    assert_eq!(s.pop().unwrap(), 0);
    assert_eq!(unchanged(&mut s, |s| s.release(3)), AllocError::NotHeld { what: "slot", id: 3 });
    assert_eq!(unchanged(&mut s, |s| s.release(4)), AllocError::GroupOutOfRange { group: 4, num_groups: 4 });
    s.pop().unwrap();
    s.pop().unwrap();
    assert_eq!(unchanged(&mut s, |s| s.pop().map(drop)), AllocError::NoFreeSlots);
}

#[test]
fn slot_extend_adds_vacant_groups_on_top() {
    let mut s = SlotPool::new(1).unwrap();
    s.pop().unwrap();
    s.extend(2).unwrap();
    assert_eq!((s.num_groups(), s.num_free(), s.free_order()), (3, 2, vec![1, 2]));
    assert!(matches!(unchanged(&mut s, |s| s.extend(MAX_IDS)), AllocError::TooManyIds { .. }));
}

#[test]
fn slot_retire_top_drops_a_vacant_top() {
    let mut s = SlotPool::new(3).unwrap();
    s.pop().unwrap();
    assert_eq!(s.retire_top(), Some(SlotRetired { retired: 2, relocated_to: None }));
    assert_eq!((s.num_groups(), s.num_free()), (2, 1));
    let mut e = SlotPool::new(0).unwrap();
    assert_eq!(e.retire_top(), None);
}

#[test]
fn slot_retire_top_relocates_a_held_top_to_the_lowest_vacant() {
    let mut s = SlotPool::new(4).unwrap();
    let hs: Vec<SlotHandle> = (0..4).map(|_| s.alloc().unwrap()).collect();
    s.free_handle(hs[2]).unwrap();
    s.free_handle(hs[1]).unwrap();
    let r = s.retire_top().unwrap();
    assert_eq!(r, SlotRetired { retired: 3, relocated_to: Some(1) });
    assert!(matches!(s.check(hs[3]), Err(AllocError::StaleHandle { .. })));
    let moved = s.current_handle(1).unwrap();
    s.check(moved).unwrap();
    assert_ne!(moved.generation, hs[1].generation, "the old holder of group 1 is stale too");
    assert_eq!((s.free_order(), s.num_free()), (vec![2], 1));
}

#[test]
fn slot_retire_top_refuses_pinned_or_targetless_tops() {
    let mut s = SlotPool::new(2).unwrap();
    s.pop().unwrap();
    s.pop().unwrap();
    let before = s.clone();
    assert_eq!(s.retire_top(), None, "held top, nothing vacant");
    assert_eq!(s, before);
    s.release(0).unwrap();
    s.pin(1).unwrap();
    let before = s.clone();
    assert_eq!(s.retire_top(), None, "pinned top");
    assert_eq!(s, before);
    assert_eq!(unchanged(&mut s, |s| s.release(1)), AllocError::GroupPinned { group: 1 });
    s.unpin(1).unwrap();
    assert_eq!(unchanged(&mut s, |s| s.unpin(1)), AllocError::GroupNotPinned { group: 1 });
    assert_eq!(s.retire_top(), Some(SlotRetired { retired: 1, relocated_to: Some(0) }));
}

#[test]
fn slot_handles_catch_double_free_stale_and_foreign_use() {
    let mut s = SlotPool::new(1).unwrap();
    let mut t = SlotPool::new(1).unwrap();
    let h = s.alloc().unwrap();
    let e = unchanged(&mut t, |t| t.free_handle(h));
    assert_eq!(e, AllocError::ForeignHandle { what: "slot", handle_pool: s.pool_id(), pool: t.pool_id() });
    s.free_handle(h).unwrap();
    let e = unchanged(&mut s, |s| s.free_handle(h));
    assert_eq!(e, AllocError::DoubleFree { what: "slot", id: 0, generation: h.generation });
    let h2 = s.alloc().unwrap();
    let e = unchanged(&mut s, |s| s.free_handle(h));
    assert_eq!(
        e,
        AllocError::StaleHandle { what: "slot", id: 0, generation: h.generation, current: h2.generation }
    );
    s.check(h2).unwrap();
}
