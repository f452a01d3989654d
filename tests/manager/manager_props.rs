//! State-machine property tests of the manager on the host backend: random interleavings of
//! add / admit (with hits) / allocate+forward+commit (with checkpoints) / complete /
//! preempt / finish / unindex / evict / boundary moves (elastic slot growth and rebalance).
//!
//! After every step: the manager's invariants hold (references equal holders, the LRU holds
//! exactly the unreferenced cached blocks and ready unpinned checkpoints, every held pool
//! block is accounted for); every running request's slot image and committed blocks read
//! back exactly as written; every restore reproduces the image its storing request had at
//! that token (a checkpoint whose units were reused would not). At the end every reference
//! is gone and eviction returns every block.

use crate::manager_common;

use manager_common::*;
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{
    BlockHash, ElasticPolicy, FixedPolicy, KvManager, ManagerError, RequestId, SplitPolicy,
};

#[derive(Clone, Debug)]
enum Op {
    Add { family: u64, len: usize, prompt_pct: u64 },
    Admit(usize),
    Step(usize, u64),
    Complete,
    Preempt(usize),
    Finish(usize),
    Rebalance,
    EvictAll,
    Unindex(usize, usize),
    SetSlots(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0u64..3, 1usize..1800, 30u64..100).prop_map(|(family, len, prompt_pct)| Op::Add { family, len, prompt_pct }),
        3 => (0usize..16).prop_map(Op::Admit),
        8 => (0usize..16, prop_oneof![Just(1u64), 1u64..700]).prop_map(|(i, c)| Op::Step(i, c)),
        2 => Just(Op::Complete),
        1 => (0usize..16).prop_map(Op::Preempt),
        2 => (0usize..16).prop_map(Op::Finish),
        1 => Just(Op::Rebalance),
        1 => Just(Op::EvictAll),
        1 => (0usize..16, 0usize..8).prop_map(|(i, k)| Op::Unindex(i, k)),
        1 => (1u32..8).prop_map(Op::SetSlots),
    ]
}

struct Req {
    id: RequestId,
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
    live: bool,
}

struct World {
    m: KvManager,
    reqs: Vec<Req>,
    /// The image a slot has at the end of each full block (deterministic in the tokens).
    images: HashMap<BlockHash, Vec<u8>>,
    /// What each running request's slot image must read back as.
    shadow: HashMap<usize, Vec<u8>>,
    seen: Vec<BlockHash>,
    restores: u64,
}

impl World {
    /// A fresh world over manager `m`: no requests, nothing seen.
    fn new(m: KvManager) -> World {
        World {
            m,
            reqs: Vec::new(),
            images: HashMap::new(),
            shadow: HashMap::new(),
            seen: Vec::new(),
            restores: 0,
        }
    }

    fn pick(&self, i: usize) -> Option<usize> {
        let live: Vec<usize> = (0..self.reqs.len()).filter(|&k| self.reqs[k].live).collect();
        (!live.is_empty()).then(|| live[i % live.len()])
    }

    fn image_of(&self, k: usize) -> Vec<u8> {
        let pool = self.m.pool();
        let pos = self.m.slot(self.reqs[k].id).unwrap().unwrap().position;
        read(pool, &image_ranges(pool, pos))
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add { family, len, prompt_pct } => {
                let tokens = tokens(family, len, 600);
                let hashes = hashes(&tokens);
                self.seen.extend(hashes.iter().copied());
                let prompt = (len as u64 * prompt_pct / 100).max(1);
                let id = self.m.add_request(prompt, hashes.clone());
                self.reqs.push(Req { id, tokens, hashes, live: true });
            }
            Op::Admit(i) => {
                let Some(k) = self.pick(i) else { return };
                let id = self.reqs[k].id;
                if self.m.slot(id).unwrap().is_some() {
                    assert!(matches!(self.m.admit(id), Err(ManagerError::AlreadyRunning(_))));
                    return;
                }
                match self.m.admit(id) {
                    Ok(adm) => {
                        let image = self.image_of(k);
                        let hit = (adm.hit_tokens / BLOCK) as usize;
                        if hit > 0 {
                            self.restores += 1;
                            let want = &self.images[&self.reqs[k].hashes[hit - 1]];
                            same(&image, want, "restored image");
                        }
                        self.shadow.insert(k, image);
                    }
                    Err(ManagerError::NoSlot) | Err(ManagerError::OutOfBlocks { .. }) => {}
                    Err(e) => panic!("admit: {e}"),
                }
            }
            Op::Step(i, chunk) => {
                let Some(k) = self.pick(i) else { return };
                let id = self.reqs[k].id;
                let Some(slot) = self.m.slot(id).unwrap() else { return };
                let done = self.m.computed_tokens(id).unwrap();
                let len = self.reqs[k].tokens.len() as u64;
                if done >= len {
                    return;
                }
                let n = self.m.prefill_stop(id, chunk).unwrap().max(1).min(len - done);
                match self.m.allocate(id, n) {
                    Ok(()) => {}
                    Err(ManagerError::OutOfBlocks { .. }) => return,
                    Err(e) => panic!("allocate: {e}"),
                }
                let slot = self.m.slot(id).unwrap().unwrap_or(slot);
                let table = self.m.block_table(id).unwrap();
                let pool = self.m.pool().clone();
                forward(&pool, slot, &table, &self.reqs[k].tokens, done as usize, (done + n) as usize);
                let image = self.image_of(k);
                let after = done + n;
                if after % BLOCK == 0 {
                    let h = self.reqs[k].hashes[(after / BLOCK) as usize - 1];
                    let want = self.images.entry(h).or_insert_with(|| image.clone());
                    same(&image, want, "image of one prefix computed twice");
                }
                self.shadow.insert(k, image);
                self.m.commit(id, n).unwrap();
            }
            Op::Complete => self.m.complete_inflight().unwrap(),
            Op::Preempt(i) => {
                let Some(k) = self.pick(i) else { return };
                let id = self.reqs[k].id;
                if self.m.slot(id).unwrap().is_none() {
                    assert!(matches!(self.m.preempt(id), Err(ManagerError::NotRunning(_))));
                    return;
                }
                self.m.preempt(id).unwrap();
                self.shadow.remove(&k);
            }
            Op::Finish(i) => {
                let Some(k) = self.pick(i) else { return };
                let id = self.reqs[k].id;
                self.m.finish(id).unwrap();
                self.reqs[k].live = false;
                self.shadow.remove(&k);
                assert!(matches!(self.m.finish(id), Err(ManagerError::UnknownRequest(_))));
            }
            Op::Rebalance => self.m.rebalance().unwrap(),
            Op::SetSlots(n) => {
                self.m.set_slots(n).unwrap();
            }
            Op::EvictAll => {
                self.m.evict_all().unwrap();
            }
            Op::Unindex(i, b) => {
                let Some(k) = self.pick(i) else { return };
                if let Some(h) = self.reqs[k].hashes.get(b).copied() {
                    self.m.unindex(h).unwrap();
                }
            }
        }
    }

    /// Nothing lost: every running request's slot image and committed blocks read back.
    fn check(&self) {
        self.m.check_invariants().unwrap_or_else(|e| panic!("invariant: {e}"));
        let pool = self.m.pool();
        for (&k, want) in &self.shadow {
            same(&self.image_of(k), want, "running slot image");
            let id = self.reqs[k].id;
            let full = (self.m.computed_tokens(id).unwrap() / BLOCK) as usize;
            let table = self.m.block_table(id).unwrap();
            for (&id, h) in table.iter().zip(&self.reqs[k].hashes).take(full) {
                same(&read(pool, &block_ranges(pool, id as u32)), &block_content(pool, h), "committed block");
            }
        }
    }
}

fn run(ops: &[Op], elastic: bool, rolling: bool) {
    let pool = small_pool(Arc::new(HostBackend::new()), 24);
    let policy: Box<dyn SplitPolicy> = if elastic {
        Box::new(ElasticPolicy::default().with_headroom(1).with_max_slots(6))
    } else {
        Box::new(FixedPolicy::new(3))
    };
    let m = KvManager::new(pool, config(2, rolling), policy).unwrap();
    let mut w = World::new(m);
    for op in ops {
        w.apply(op);
        w.check();
    }
    // Refcounts return to zero; eviction returns every block.
    for k in 0..w.reqs.len() {
        if w.reqs[k].live {
            w.m.finish(w.reqs[k].id).unwrap();
        }
    }
    w.m.complete_inflight().unwrap();
    for h in &w.seen {
        assert!(matches!(w.m.block_refs(h), None | Some(0)), "a finished run left a reference");
    }
    w.m.check_invariants().unwrap();
    w.m.evict_all().unwrap();
    let c = w.m.pool().counts().unwrap();
    assert_eq!(c.free_blocks, c.num_blocks, "eviction returned every block");
    assert_eq!(w.m.stats().checkpoints_held, 0);
    assert_eq!(w.m.stats().cached_blocks, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_interleavings_lose_nothing(
        ops in proptest::collection::vec(op(), 1..60),
        elastic in any::<bool>(),
        rolling in any::<bool>(),
    ) {
        run(&ops, elastic, rolling);
    }
}

/// A fixed sequence that must hit, restore, evict and move the boundary (so the property
/// test's generator is known to reach those paths).
#[test]
fn a_scripted_run_reaches_every_path() {
    let mut ops = Vec::new();
    for f in 0..3 {
        ops.push(Op::Add { family: f, len: 1700, prompt_pct: 60 });
    }
    for round in 0..3 {
        for i in 0..6 {
            ops.push(Op::Admit(i));
        }
        for _ in 0..12 {
            for i in 0..6 {
                ops.push(Op::Step(i, 512));
                ops.push(Op::Complete);
            }
        }
        ops.push(Op::SetSlots(2 + round as u32 * 2));
        ops.push(Op::Preempt(round));
        ops.push(Op::Complete);
        ops.push(Op::Rebalance);
        ops.push(Op::Add { family: round as u64, len: 1750, prompt_pct: 95 });
        ops.push(Op::Finish(0));
    }
    let pool = small_pool(Arc::new(HostBackend::new()), 24);
    let m = KvManager::new(
        pool,
        config(2, true),
        Box::new(ElasticPolicy::default().with_headroom(1).with_max_slots(6)),
    )
    .unwrap();
    let mut w = World::new(m);
    for op in &ops {
        w.apply(op);
        w.check();
    }
    let s = w.m.stats();
    println!("{s:?} restores checked {}", w.restores);
    assert!(w.restores > 0 && s.hits > 0, "no hit: {s:?}");
    assert!(s.evicted_blocks + s.evicted_checkpoints > 0, "nothing evicted: {s:?}");
    assert!(s.boundary_moves > 0, "no boundary move: {s:?}");
    // Retention under pressure ran: checkpoints superseded while their requests ran (their
    // restores above still reproduce the stored images).
    assert!(s.superseded_checkpoints > 0, "nothing superseded: {s:?}");
    assert!(s.block_relocations + s.slot_relocations > 0, "no relocation: {s:?}");
}
