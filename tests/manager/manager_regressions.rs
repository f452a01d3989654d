//! Regressions the simulator found in the manager's store path, each pinned by a small
//! host-backend scenario that fails on the code before its fix.
//!
//! * A store whose own room-making evicts the very block it was to attach to (the storer
//!   holds a private duplicate; the indexed block of that hash sat unreferenced at the head
//!   of the LRU): the checkpoint must not attach to the evicted block's node. Before the fix
//!   `begin_store` attached to the stale node index, which the new checkpoint node itself
//!   had reused, and the manager panicked ("node … is not a block").
//! * A store whose room-making gives an idle slot back to blocks, relocating the storer's
//!   slot: the image must be copied from the slot's new position. Before the fix it was
//!   copied from the retired position (block rows by then), and a later hit restored those
//!   bytes instead of the request's state.
//! * Two elastic-policy inputs the multiturn mix showed wrong: a finished chain's superseded
//!   checkpoints are evicted before its deepest one, and the cache share the policy keeps
//!   against new slots is measured in prompt tokens served, not in admissions that hit.
//! * Two retention inputs the long-prompt sweep (`scripts/retention_sweep.py`) showed losing
//!   to a coarser cadence: a finer checkpoint demoted the coarse one below it, and a chain's
//!   restores spread over fine points left its coarse points unproven — under pressure a
//!   request diverging at a coarse point found it evicted where `reuse_4096` kept it.

use crate::manager_common;

use manager_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{CkptState, ElasticPolicy, FixedPolicy, KvManager};

/// Slot positions of the small pool: 2 slots and 7 blocks at start-up, one checkpoint in
/// one block unit, one slot worth 2 blocks.
const POSITIONS: i64 = 8;

fn manager(policy: Box<dyn v4pool::manager::SplitPolicy>) -> KvManager {
    let pool = small_pool(Arc::new(HostBackend::new()), POSITIONS);
    // Checkpoints only at prompt ends: the scenarios choose exactly which commit stores.
    KvManager::new(pool, config(0, false), policy).expect("manager")
}

fn free_blocks(m: &KvManager) -> u32 {
    m.pool().counts().expect("counts").free_blocks
}

#[test]
fn a_store_does_not_attach_to_the_block_its_own_room_making_evicted() {
    let mut m = manager(Box::new(FixedPolicy::new(3)));
    let units = m.units_per_checkpoint();
    // A and B share their first block; A's prompt ends at block 2 (no store at block 1),
    // B's at block 1 (a store there).
    let ta = tokens(1, 2 * BLOCK as usize + 1, BLOCK as usize);
    let tb = tokens(2, BLOCK as usize + 1, BLOCK as usize);
    let (ha, hb) = (hashes(&ta), hashes(&tb));
    assert_eq!(ha[0], hb[0]);
    let a = m.add_request(ta.len() as u64, ha.clone());
    let b = m.add_request(tb.len() as u64, hb.clone());
    assert_eq!(m.admit(a).expect("admit A").hit_tokens, 0);
    assert_eq!(m.admit(b).expect("admit B").hit_tokens, 0);
    // A commits the shared block first: it is indexed as A's, with no checkpoint.
    m.allocate(a, BLOCK).expect("allocate A");
    m.commit(a, BLOCK).expect("commit A");
    assert_eq!(m.checkpoint_state(&ha[0]), None);
    m.finish(a).expect("finish A");
    // The shared block is now the LRU's only entry. B computes its own copy (private: the
    // hash is taken), and C holds every free block but one unit short of a checkpoint.
    m.allocate(b, BLOCK).expect("allocate B");
    let c = m.add_request(64 * BLOCK, Vec::new());
    m.admit(c).expect("admit C");
    let take = free_blocks(&m) + 1 - units;
    m.allocate(c, u64::from(take) * BLOCK).expect("allocate C");
    assert_eq!(free_blocks(&m), units - 1);
    // B's prompt end: the store's room-making evicts the LRU head — the block the store
    // was about to attach to.
    m.commit(b, BLOCK).expect("commit B");
    m.check_invariants().expect("invariants after the store");
    assert_eq!(m.stats().evicted_blocks, 1, "the shared block was evicted for the units");
    // No checkpoint on a block that is gone; nothing held for one either.
    assert_eq!(m.block_refs(&hb[0]), None);
    assert_eq!(m.checkpoint_state(&hb[0]), None);
    assert_eq!(m.stats().checkpoints_held, 0);
    assert_eq!(free_blocks(&m), units, "no unit was taken for a store that did not happen");
    m.complete_inflight().expect("complete");
    for id in [b, c] {
        m.finish(id).expect("finish");
    }
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants at the end");
    let counts = m.pool().counts().expect("counts");
    assert_eq!(counts.free_blocks, counts.num_blocks, "every block back");
}

#[test]
fn a_store_copies_from_its_slot_after_room_making_relocated_it() {
    // Elastic: short blocks are found by giving idle slots back, which relocates held slots
    // above the new top.
    let mut m = manager(Box::new(ElasticPolicy::default().with_headroom(2)));
    let units = m.units_per_checkpoint();
    assert_eq!(m.pool().counts().expect("counts").num_slots, 2);
    // B's prompt blocks will leave fewer free blocks than a checkpoint's units, with nothing
    // cached: the store at B's prompt end must give the idle slot back.
    let blocks = free_blocks(&m) + 1 - units;
    let tb = tokens(2, blocks as usize * BLOCK as usize + 1, 0);
    let hb = hashes(&tb);
    let stored = blocks as usize;
    // A takes the first slot, B the next; A leaves, so B's slot sits beyond a vacant one and
    // is the one a shrink moves.
    let a = m.add_request(BLOCK, Vec::new());
    let b = m.add_request(tb.len() as u64, hb.clone());
    m.admit(a).expect("admit A");
    let before = m.admit(b).expect("admit B").slot.position;
    m.finish(a).expect("finish A");
    m.allocate(b, u64::from(blocks) * BLOCK).expect("allocate B");
    assert!(free_blocks(&m) < units && m.view().expect("view").evictable_blocks == 0);
    // B's state at its prompt end: a pattern written into its slot image.
    let image = pattern(0x5107e, image_ranges(m.pool(), before).iter().map(|r| r.2 as usize).sum());
    write(m.pool(), &image_ranges(m.pool(), before), &image);
    m.commit(b, stored as u64 * BLOCK).expect("commit B");
    let after = m.slot(b).expect("B").expect("running").position;
    assert_ne!(after, before, "the store's room-making relocated B's slot");
    same(&read(m.pool(), &image_ranges(m.pool(), after)), &image, "B's image moved with its slot");
    assert_eq!(m.checkpoint_state(&hb[stored - 1]), Some(CkptState::Copying));
    m.complete_inflight().expect("complete");
    m.check_invariants().expect("invariants after the store");
    // B leaves; its slot is poisoned so a restore cannot pass by reading B's leftovers.
    m.finish(b).expect("finish B");
    let poison = pattern(0xbad, image.len());
    write(m.pool(), &image_ranges(m.pool(), after), &poison);
    // C re-sends B's prompt and more: it hits B's checkpoint, and its restored slot holds
    // B's image at that token.
    let tc = tokens(2, (stored + 1) * BLOCK as usize, 0);
    let c = m.add_request(tc.len() as u64, hashes(&tc));
    let adm = m.admit(c).expect("admit C");
    assert_eq!(adm.hit_tokens, stored as u64 * BLOCK, "C hits B's prompt-end checkpoint");
    m.complete_inflight().expect("complete");
    same(&read(m.pool(), &image_ranges(m.pool(), adm.slot.position)), &image, "restored image");
    m.finish(c).expect("finish C");
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants at the end");
}

#[test]
fn a_finished_chain_gives_up_its_superseded_checkpoints_first() {
    // Before the fix a finished request's checkpoints entered the LRU deepest first, each
    // just before its block: the deepest checkpoint (the one the chain's next turn restores
    // from) was the eviction head, and the interior ones, which only a request diverging
    // inside the chain can use, outlived it (the multiturn mix held 2.6 GB of checkpoints,
    // a whole slot image per 8 blocks).
    let (mut m, ta) = two_checkpoint_chain(3);
    let units = m.units_per_checkpoint();
    let ha = hashes(&ta);
    assert_eq!(m.checkpoint_state(&ha[0]), Some(CkptState::Ready));
    assert_eq!(m.checkpoint_state(&ha[1]), Some(CkptState::Ready));
    // C needs one checkpoint's units more than are free: one LRU entry goes.
    let c = squeeze(&mut m, units);
    assert_eq!(m.stats().evicted_checkpoints, 1);
    assert_eq!(m.checkpoint_state(&ha[0]), None, "the superseded checkpoint went first");
    assert_eq!(m.checkpoint_state(&ha[1]), Some(CkptState::Ready), "the deepest one stays");
    assert_eq!(m.match_prefix(&ha), 2 * BLOCK, "the chain's next turn still hits all of it");
    m.finish(c).expect("finish C");
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants at the end");
}

#[test]
fn the_cache_share_the_policy_sees_counts_prompt_tokens_not_admissions() {
    // Before, `hit_per_mille` counted admissions that hit at all: on multiturn, where every
    // conversation opens with a shared system prompt, 0.98 of admissions hit and the
    // elastic policy kept 69 % of the block capacity as cache against new slots, while the
    // cache served 0.70 of the prompt tokens (520 requests completed against no_reuse's 546).
    let (mut m, ta) = two_checkpoint_chain(5);
    assert_eq!(m.view().expect("view").hit_per_mille, 0);
    // B re-sends A's two blocks and two more: one admission of two, and it hits.
    let tb = tokens(5, 4 * BLOCK as usize + 1, 0);
    let b = m.add_request(tb.len() as u64, hashes(&tb));
    assert_eq!(m.admit(b).expect("admit B").hit_tokens, 2 * BLOCK);
    let admitted = ta.len() as u64 + tb.len() as u64;
    let share = m.view().expect("view").hit_per_mille;
    assert_eq!(u64::from(share), 2 * BLOCK * 1000 / admitted, "tokens served over tokens admitted");
    assert!(share < 500, "half the admissions hit, a third of the prompt tokens: {share}");
    m.complete_inflight().expect("complete");
    m.finish(b).expect("finish B");
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants at the end");
}

/// A manager storing a checkpoint at every block, after request A (tokens of `family`, two
/// blocks and one token) prefilled block by block and finished: A's checkpoints at blocks 1
/// and 2 are ready and cached. Returns the manager and A's tokens.
fn two_checkpoint_chain(family: u64) -> (KvManager, Vec<u32>) {
    let pool = small_pool(Arc::new(HostBackend::new()), POSITIONS);
    let mut m = KvManager::new(pool, config(1, false), Box::new(FixedPolicy::new(2))).expect("manager");
    let ta = tokens(family, 2 * BLOCK as usize + 1, 0);
    let a = m.add_request(ta.len() as u64, hashes(&ta));
    m.admit(a).expect("admit A");
    prefill_blocks(&mut m, a, 2);
    m.finish(a).expect("finish A");
    (m, ta)
}

/// A manager with a checkpoint at every block (coarse every fourth block and at prompt ends)
/// on a pool roomy enough for a six-block chain and its six checkpoints beside two slots.
fn every_block(rolling: bool) -> KvManager {
    let pool = small_pool(Arc::new(HostBackend::new()), 16);
    KvManager::new(pool, config(1, rolling), Box::new(FixedPolicy::new(2))).expect("manager")
}

/// Allocate and commit `blocks` more blocks of `id`, one at a time, each store completed.
fn prefill_blocks(m: &mut KvManager, id: v4pool::manager::RequestId, blocks: usize) {
    for _ in 0..blocks {
        m.allocate(id, BLOCK).expect("allocate");
        m.commit(id, BLOCK).expect("commit");
        m.complete_inflight().expect("complete");
    }
}

/// Make `n` block ids' room for a new request: exactly `n` units leave the LRU's head.
fn squeeze(m: &mut KvManager, n: u32) -> v4pool::manager::RequestId {
    let c = m.add_request(64 * BLOCK, Vec::new());
    m.admit(c).expect("admit the squeezing request");
    let take = free_blocks(m) + n;
    m.allocate(c, u64::from(take) * BLOCK).expect("allocate");
    c
}

#[test]
fn a_fine_checkpoint_does_not_demote_the_coarse_one_below_it() {
    // A: prompt ends at block 2 (coarse), decodes to block 3 (a rolling, fine checkpoint).
    // Before, the rolling one superseded the prompt end's: under pressure the prompt end went
    // first, and a request diverging there (as a coarser cadence would serve it) missed.
    let mut m = every_block(true);
    let units = m.units_per_checkpoint();
    let ta = tokens(11, 3 * BLOCK as usize + 1, 0);
    let ha = hashes(&ta);
    let a = m.add_request(2 * BLOCK + 1, ha[..2].to_vec());
    m.admit(a).expect("admit A");
    prefill_blocks(&mut m, a, 2);
    m.extend_hashes(a, &ha[2..3]).expect("A's decoded block");
    prefill_blocks(&mut m, a, 1);
    for (k, h) in ha.iter().enumerate() {
        assert_eq!(m.checkpoint_state(h), Some(CkptState::Ready), "A's checkpoint at block {}", k + 1);
    }
    m.finish(a).expect("finish A");
    // Two checkpoints' room: the fine one at block 1 (superseded) and the chain's deepest.
    let c = squeeze(&mut m, 2 * units);
    assert_eq!(m.stats().evicted_checkpoints, 2);
    assert_eq!(m.checkpoint_state(&ha[1]), Some(CkptState::Ready), "the coarse prompt end stays");
    // A request that shares A's prompt and diverges after it restores the prompt end.
    let tb = tokens(12, 3 * BLOCK as usize + 1, 0);
    let mut tb2 = ta[..2 * BLOCK as usize].to_vec();
    tb2.extend_from_slice(&tb[2 * BLOCK as usize..]);
    assert_eq!(m.match_prefix(&hashes(&tb2)), 2 * BLOCK);
    m.finish(c).expect("finish C");
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants at the end");
}

#[test]
fn a_restore_from_a_fine_checkpoint_proves_the_coarse_one_below_it() {
    // A's six-block prompt stores at every block: coarse at 4 and 6 (its end), fine at the
    // rest; finished, 1-5 are superseded. B shares five blocks and restores the fine one at
    // 5. A coarse cadence would have restored the one at 4 — a use after the chain went past
    // it, which proves it a reuse point. Before, nothing counted for it: it stayed at the
    // evicted-first end and went before A's chain end.
    let mut m = every_block(false);
    let units = m.units_per_checkpoint();
    let ta = tokens(13, 6 * BLOCK as usize + 1, 5 * BLOCK as usize);
    let ha = hashes(&ta);
    let a = m.add_request(ta.len() as u64, ha.clone());
    m.admit(a).expect("admit A");
    prefill_blocks(&mut m, a, 6);
    m.finish(a).expect("finish A");
    let tb = tokens(14, 6 * BLOCK as usize + 1, 5 * BLOCK as usize);
    let hb = hashes(&tb);
    assert_eq!(hb[..5], ha[..5]);
    let b = m.add_request(tb.len() as u64, hb);
    assert_eq!(m.admit(b).expect("admit B").hit_tokens, 5 * BLOCK, "B restores the fine checkpoint at 5");
    m.complete_inflight().expect("complete");
    // Four checkpoints' room: the superseded fine ones at 1-3, then A's chain end.
    let c = squeeze(&mut m, 4 * units);
    assert_eq!(m.checkpoint_state(&ha[0]), None, "the superseded fine checkpoints went first");
    assert_eq!(m.checkpoint_state(&ha[5]), None, "then A's chain end");
    assert_eq!(m.checkpoint_state(&ha[3]), Some(CkptState::Ready), "the coarse one B passed through stays");
    for id in [b, c] {
        m.finish(id).expect("finish");
    }
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants at the end");
}
