//! The manager's host tier on the host backend: directed cases (spill → hit → restore
//! byte-exact; a full tier drops the least recent prefix, which then misses; a restore
//! without room shortens the hit) and a property test of random admit / step / complete /
//! preempt / finish / evict / boundary-move sequences over a small pool and a small tier.

use crate::tier_common;

use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use tier_common::manager_common::*;
use tier_common::*;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{
    BlockHash, ElasticPolicy, FixedPolicy, KvManager, ManagerError, ManagerStats, RequestId, SplitPolicy,
};

fn host() -> Arc<HostBackend> {
    Arc::new(HostBackend::new())
}

#[test]
fn spill_then_hit_restores_byte_exact() {
    // The host backend's tier memory is ordinary memory (the CUDA test checks page-locked).
    let pool = small_pool(host(), 24);
    assert!(!v4pool::transfer::HostTier::<u64>::new(&pool, 1 << 20).unwrap().pinned());
    spill_hit_restore(small_pool(host(), 24));
    spill_hit_restore(state_pool(host(), 24));
}

/// Everything is returned at the end: no reference, no slot and (after eviction) no block
/// held; the tier within its budget and holding exactly what it counts.
fn drained(m: &mut KvManager, budget_units: u64) {
    m.complete_inflight().unwrap();
    m.check_invariants().unwrap();
    m.evict_all().unwrap();
    let c = m.pool().counts().unwrap();
    assert_eq!(c.free_blocks, c.num_blocks, "eviction returned every block");
    assert_eq!(c.free_slots, c.num_slots, "every slot returned");
    let s = m.stats();
    assert_eq!((s.cached_blocks, s.checkpoints_held), (0, 0));
    let unit = unit_bytes(m.pool());
    let upc = u64::from(m.units_per_checkpoint());
    assert_eq!(s.tier_resident_bytes, (s.tier_resident_blocks + upc * s.tier_resident_checkpoints) * unit);
    assert!(s.tier_resident_bytes <= budget_units * unit, "tier over budget: {s:?}");
}

#[test]
fn a_full_tier_drops_the_least_recent_prefix_which_then_misses() {
    // Exactly one conversation's entries (5 blocks, 4 one-unit checkpoints) fit.
    let mut m = tiered(small_pool(host(), 24), 9);
    assert_eq!(m.units_per_checkpoint(), 1, "the budget above assumes one-unit checkpoints");
    let a = turn(&mut m, 1);
    let b = turn(&mut m, 2);
    // A finished first: the LRU evicts (spills) it first, and B's spills push it out. Each
    // chain's interior checkpoints (superseded, never restored) spill before any chain's
    // blocks; the chain's deepest (its rolling one at 1,280) and its deepest coarse one (768,
    // its prompt end: `CkptNode::coarse`) are not interior. So the tier ends with B's two, B's
    // 5 blocks and A's 2 shallowest blocks — A without a checkpoint to end a hit at.
    m.evict_all().unwrap();
    let s = m.stats();
    assert_eq!((s.tier_spilled_blocks, s.tier_spilled_checkpoints), (10, 8), "{s:?}");
    assert_eq!(s.tier_host_evictions, 9, "{s:?}");
    assert_eq!((s.tier_resident_blocks, s.tier_resident_checkpoints), (7, 2), "{s:?}");
    m.check_invariants().unwrap();
    poison_blocks(&m, 7);
    assert_eq!(m.match_prefix(&hashes(&a.tokens[..1400])), 0, "a dropped prefix must not match");
    let ra = rehit(&mut m, &a, 0);
    let rb = rehit(&mut m, &b, 1280);
    let s = m.stats();
    assert_eq!((s.tier_restored_blocks, s.tier_restored_checkpoints), (5, 1), "{s:?}");
    m.finish(ra).unwrap();
    m.finish(rb).unwrap();
    drained(&mut m, 9);
}

#[test]
fn clearing_the_tier_and_unindexing_drop_host_entries() {
    let mut m = tiered(small_pool(host(), 24), 64);
    let a = turn(&mut m, 1);
    m.evict_all().unwrap();
    let hs = hashes(&a.tokens[..1400]);
    // Unindexing the checkpoint at 1,280 drops its host copy: the match ends at 1,024.
    m.unindex(hs[4]).unwrap();
    assert_eq!(m.stats().tier_resident_checkpoints, 3);
    assert_eq!(m.match_prefix(&hs), 1024);
    m.check_invariants().unwrap();
    assert_eq!(m.clear_host_tier(), 5 + 3);
    let s = m.stats();
    assert_eq!((s.tier_resident_blocks, s.tier_resident_checkpoints, s.tier_resident_bytes), (0, 0, 0));
    assert_eq!(m.match_prefix(&hs), 0);
    rehit(&mut m, &a, 0);
    m.check_invariants().unwrap();
}

#[test]
fn a_restore_without_room_shortens_the_hit_cleanly() {
    let mut m = tiered(small_pool(host(), 24), 64);
    let a = turn(&mut m, 1);
    m.evict_all().unwrap();
    poison_blocks(&m, 9);
    // A request holds all but 3 blocks: the hit at 1,280 needs 6 (5 blocks, 1 checkpoint
    // unit), 1,024 needs 5, 768 needs 4; 512 needs 3 and is the one that comes back. (The
    // pool's block count follows the slot's size, which the arena's alignment rounds.)
    let total = m.pool().counts().unwrap().num_blocks as u64;
    let hog = m.add_request(total * BLOCK, Vec::new());
    m.admit(hog).unwrap();
    m.allocate(hog, (total - 3) * BLOCK).unwrap();
    let held = m.stats();
    let r = rehit(&mut m, &a, 512);
    let s = m.stats();
    assert_eq!(s.tier_shortened_hits, held.tier_shortened_hits + 1, "{s:?}");
    assert_eq!((s.tier_restored_blocks, s.tier_restored_checkpoints), (2, 1), "{s:?}");
    assert_eq!((s.tier_resident_blocks, s.tier_resident_checkpoints), (3, 3), "the rest stays on the host");
    assert_eq!(m.pool().counts().unwrap().free_blocks, 0);
    // No room at all (the hog takes the last 3, evicting the restored part to the tier
    // again): the hit is 0, and the tier still holds the whole conversation.
    m.finish(r).unwrap();
    m.allocate(hog, total * BLOCK).unwrap();
    let s = m.stats();
    assert_eq!((s.tier_resident_blocks, s.tier_resident_checkpoints), (5, 4), "{s:?}");
    let r = rehit(&mut m, &a, 0);
    assert_eq!(m.stats().tier_shortened_hits, s.tier_shortened_hits + 1);
    assert_eq!(m.stats().tier_resident_blocks, 5);
    m.finish(r).unwrap();
    // With the room back, the whole hit comes back exactly.
    m.finish(hog).unwrap();
    m.check_invariants().unwrap();
    let r = rehit(&mut m, &a, 1280);
    m.finish(r).unwrap();
    drained(&mut m, 64);
}

// ---- property test ------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// A conversation of `family` (families share their first 600 tokens), `len` tokens, the
    /// prompt `pct` % of them; admitted at once when a slot is free.
    Add(u64, usize, u64),
    /// Admit a waiting request.
    Admit(usize),
    /// Allocate, forward and commit the next chunk (at most `u64` tokens, cut at the next
    /// checkpoint point, or at the next block boundary once decoding) of a running request.
    Step(usize, u64),
    Complete,
    Preempt(usize),
    Finish(usize),
    /// Evict every unreferenced block and checkpoint (they spill).
    EvictAll,
    /// Move the boundary (relocations while the tier holds entries).
    SetSlots(u32),
    /// §6 `unindex` of the checkpoint ending at a request's `k`-th block (in HBM or the tier).
    Unindex(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..3, 300usize..1800, 40u64..100).prop_map(|(f, n, p)| Op::Add(f, n, p)),
        2 => (0usize..12).prop_map(Op::Admit),
        10 => (0usize..12, 1u64..1024).prop_map(|(i, c)| Op::Step(i, c)),
        2 => Just(Op::Complete),
        1 => (0usize..12).prop_map(Op::Preempt),
        3 => (0usize..12).prop_map(Op::Finish),
        2 => Just(Op::EvictAll),
        1 => (2u32..6).prop_map(Op::SetSlots),
        1 => (0usize..12, 0usize..7).prop_map(|(i, k)| Op::Unindex(i, k)),
    ]
}

/// The model: each request's tokens; the slot image each block boundary has (a function of
/// the tokens, recorded the first time any request computes it); what every running
/// request's slot image must read back as.
struct Model {
    m: KvManager,
    reqs: Vec<(RequestId, Vec<u32>, bool)>,
    images: HashMap<BlockHash, Vec<u8>>,
    slots: HashMap<usize, Vec<u8>>,
    budget: u64,
}

impl Model {
    /// The `i`-th (mod count) live request, running or not, or only those running or not.
    fn live(&self, i: usize, running: Option<bool>) -> Option<usize> {
        let live: Vec<usize> = (0..self.reqs.len())
            .filter(|&k| self.reqs[k].2 && running.is_none_or(|r| r == self.slots.contains_key(&k)))
            .collect();
        (!live.is_empty()).then(|| live[i % live.len()])
    }

    fn slot_image(&self, k: usize) -> Option<Vec<u8>> {
        let pos = self.m.slot(self.reqs[k].0).unwrap()?.position;
        Some(read(self.m.pool(), &image_ranges(self.m.pool(), pos)))
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add(family, len, pct) => {
                let t = tokens(family, len, 600);
                let id = self.m.add_request((len as u64 * pct / 100).max(1), hashes(&t));
                self.reqs.push((id, t, true));
                self.apply(&Op::Admit(self.reqs.len() - 1));
            }
            Op::Admit(i) => {
                let Some(k) = self.live(i, Some(false)) else { return };
                match self.m.admit(self.reqs[k].0) {
                    Ok(adm) => {
                        let image = self.slot_image(k).unwrap();
                        if adm.hit_tokens > 0 {
                            // Served from HBM or brought back from the tier: the image the
                            // storing request had at that token, byte for byte.
                            let h = hashes(&self.reqs[k].1)[(adm.hit_tokens / BLOCK) as usize - 1];
                            same(&image, &self.images[&h], "restored slot image");
                        }
                        self.slots.insert(k, image);
                    }
                    Err(ManagerError::NoSlot | ManagerError::OutOfBlocks { .. }) => {}
                    Err(e) => panic!("admit: {e}"),
                }
            }
            Op::Step(i, chunk) => {
                let Some(k) = self.live(i, Some(true)) else { return };
                let id = self.reqs[k].0;
                let done = self.m.computed_tokens(id).unwrap();
                let len = self.reqs[k].1.len() as u64;
                if done >= len {
                    return;
                }
                let mut n = self.m.prefill_stop(id, chunk).unwrap();
                if n == 0 {
                    n = chunk.min(BLOCK - done % BLOCK);
                }
                let n = n.min(len - done);
                match self.m.allocate(id, n) {
                    Ok(()) => {}
                    Err(ManagerError::OutOfBlocks { .. }) => return,
                    Err(e) => panic!("allocate: {e}"),
                }
                let lease = self.m.slot(id).unwrap().unwrap();
                let table = self.m.block_table(id).unwrap();
                let pool = self.m.pool().clone();
                forward(&pool, lease, &table, &self.reqs[k].1, done as usize, (done + n) as usize);
                let image = self.slot_image(k).unwrap();
                if (done + n) % BLOCK == 0 {
                    let h = hashes(&self.reqs[k].1)[((done + n) / BLOCK) as usize - 1];
                    same(self.images.entry(h).or_insert_with(|| image.clone()), &image, "one prefix twice");
                }
                self.slots.insert(k, image);
                self.m.commit(id, n).unwrap();
            }
            Op::Complete => self.m.complete_inflight().unwrap(),
            Op::Preempt(i) => {
                let Some(k) = self.live(i, Some(true)) else { return };
                self.slots.remove(&k);
                self.m.preempt(self.reqs[k].0).unwrap();
            }
            Op::Finish(i) => {
                let Some(k) = self.live(i, None) else { return };
                self.m.finish(self.reqs[k].0).unwrap();
                self.reqs[k].2 = false;
                self.slots.remove(&k);
            }
            Op::EvictAll => {
                self.m.evict_all().unwrap();
            }
            Op::SetSlots(n) => {
                self.m.set_slots(n).unwrap();
            }
            Op::Unindex(i, k) => {
                let Some(r) = self.live(i, None) else { return };
                if let Some(&h) = hashes(&self.reqs[r].1).get(k) {
                    self.m.unindex(h).unwrap();
                }
            }
        }
    }

    /// Invariants (the tier's included), and every running request's slot image and full
    /// blocks (restored ones among them) read back exactly.
    fn check(&self) {
        self.m.check_invariants().unwrap_or_else(|e| panic!("invariant: {e}"));
        let pool = self.m.pool();
        for (&k, want) in &self.slots {
            same(&self.slot_image(k).unwrap(), want, "running slot image");
            let id = self.reqs[k].0;
            let full = (self.m.computed_tokens(id).unwrap() / BLOCK) as usize;
            let hs = hashes(&self.reqs[k].1);
            for (&b, h) in self.m.block_table(id).unwrap().iter().zip(&hs).take(full) {
                same(&read(pool, &block_ranges(pool, b as u32)), &block_content(pool, h), "block");
            }
        }
        let s = self.m.stats();
        assert!(s.tier_resident_bytes <= self.budget * unit_bytes(pool), "tier over budget");
    }
}

fn run_model(ops: &[Op], units: u64, elastic: bool) -> ManagerStats {
    // 14 blocks at 3 slots: two long conversations already evict.
    let pool = small_pool(host(), 16);
    let config = config(2, true).with_host_tier_bytes(units * unit_bytes(&pool));
    let policy: Box<dyn SplitPolicy> = if elastic {
        Box::new(ElasticPolicy::default().with_headroom(1).with_max_slots(6))
    } else {
        Box::new(FixedPolicy::new(3))
    };
    let m = KvManager::new(pool, config, policy).unwrap();
    let mut w = Model { m, reqs: Vec::new(), images: HashMap::new(), slots: HashMap::new(), budget: units };
    for op in ops {
        w.apply(op);
        w.check();
    }
    for k in 0..w.reqs.len() {
        if w.reqs[k].2 {
            w.m.finish(w.reqs[k].0).unwrap();
        }
    }
    w.m.complete_inflight().unwrap();
    for (_, t, _) in &w.reqs {
        for h in hashes(t) {
            assert!(matches!(w.m.block_refs(&h), None | Some(0)), "a finished run left a reference");
        }
    }
    let s = w.m.stats();
    drained(&mut w.m, units);
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn spills_and_restores_lose_nothing(
        ops in proptest::collection::vec(op(), 20..80),
        units in prop_oneof![Just(2u64), Just(6), Just(16)],
        elastic in any::<bool>(),
    ) {
        run_model(&ops, units, elastic);
    }
}

/// A fixed sequence that must spill, restore from the tier and have the tier drop entries
/// (so the generator's paths are known to be reachable).
#[test]
fn a_scripted_run_spills_restores_and_drops() {
    // One conversation at a time, families in turn (sharing their first 600 tokens), all
    // evicted after each: the tier (8 units) holds one conversation's entries (its 5 full
    // blocks, 3 checkpoints), so each spill drops the previous family's entries. (A chain's
    // never-restored interior checkpoints are spilled first, so a smaller tier would drop
    // the shared 512-token checkpoint before the next family could hit it.)
    let mut ops = Vec::new();
    for round in 0..7u64 {
        ops.push(Op::Add(round % 3, 1500, 70));
        ops.push(Op::Admit(0));
        for _ in 0..8 {
            ops.push(Op::Step(0, 512));
            ops.push(Op::Complete);
        }
        ops.push(Op::Finish(0));
        ops.push(Op::EvictAll);
    }
    let s = run_model(&ops, 8, false);
    println!("{s:?}");
    assert!(s.tier_spilled_blocks > 0 && s.tier_spilled_checkpoints > 0, "{s:?}");
    assert!(s.tier_restored_blocks > 0 && s.tier_restored_checkpoints > 0, "{s:?}");
    assert!(s.tier_host_evictions > 0, "{s:?}");
}

#[test]
fn a_budget_below_one_unit_is_refused_and_zero_means_no_tier() {
    let pool = small_pool(host(), 24);
    let unit = unit_bytes(&pool);
    let config = config(2, true).with_host_tier_bytes(unit - 1);
    let r = KvManager::new(pool, config, Box::new(FixedPolicy::new(3)));
    assert!(matches!(r, Err(ManagerError::Config(_))), "{r:?}");
    // No tier: evicted blocks are dropped and nothing is counted.
    let mut m = tiered(small_pool(host(), 24), 0);
    let a = turn(&mut m, 1);
    m.evict_all().unwrap();
    let s = m.stats();
    assert!(s.evicted_blocks > 0);
    assert_eq!((s.tier_spilled_blocks, s.tier_resident_blocks, s.tier_resident_bytes), (0, 0, 0));
    assert_eq!(m.clear_host_tier(), 0);
    rehit(&mut m, &a, 0);
}

/// Admission prices a hit that must come back from the tier (issue 35): its blocks and
/// checkpoint units are need, not room. `may_admit` with the blocks past the hit counted
/// neither, so a request was admitted whose hit could not come back beside the running ones.
#[test]
fn admission_counts_what_a_tier_hit_brings_back() {
    let mut m = tiered(small_pool(host(), 24), 64);
    let upc = u64::from(m.units_per_checkpoint());
    let t = turn(&mut m, 1);
    m.evict_all().unwrap();
    // The second turn (prompt 1,400: 6 blocks) hits 1,280 tokens (5 blocks + a checkpoint),
    // all of it in the tier.
    let b = m.add_request(1400, hashes(&t.tokens));
    assert!(m.may_admit_request(b).unwrap(), "an empty pool admits it");
    // A running request holds all but 6 blocks: 1 block past the hit plus 4 of decode room
    // fit, the 5 blocks and the checkpoint coming back do not.
    let free = u64::from(m.pool().counts().unwrap().free_blocks);
    let filler = tokens(9, ((free - 6) * BLOCK) as usize, 0);
    let c = m.add_request(filler.len() as u64, hashes(&filler));
    m.admit(c).unwrap();
    m.allocate(c, filler.len() as u64).unwrap();
    assert_eq!(u64::from(m.pool().counts().unwrap().free_blocks), 6);
    assert!(m.may_admit(1).unwrap(), "the old check passes");
    assert!(!m.may_admit_request(b).unwrap(), "5 blocks + {upc} checkpoint units must come back");
    m.check_invariants().unwrap();
    m.finish(c).unwrap();
    assert!(m.may_admit_request(b).unwrap());
    assert!(matches!(m.may_admit_request(c), Err(ManagerError::UnknownRequest(_))));
}
