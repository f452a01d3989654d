//! Shared by the host-tier manager tests (host backend and CUDA): a manager over the small
//! pool with a host tier of a given number of block units, and the spill → hit → restore
//! scenario checked byte for byte.
#![allow(dead_code)]

// The suite declares manager_common beside this module (one copy per binary).
pub(crate) use crate::manager_common;

use manager_common::*;
use std::sync::Arc;
use v4pool::manager::{FixedPolicy, KvManager};
use v4pool::pool::Pool;
use v4pool::transfer::HostTier;

/// Bytes of one block unit of `pool` in the host tier (every plane and indexer layer).
pub fn unit_bytes(pool: &Pool) -> u64 {
    HostTier::<u64>::new(pool, 1).expect("tier").unit_bytes()
}

/// A manager over a fresh small pool (3 fixed slots, a permanent checkpoint every 2 blocks
/// and rolling ones) whose host tier holds `units` block units.
pub fn tiered(pool: Arc<Pool>, units: u64) -> KvManager {
    let config = config(2, true).with_host_tier_bytes(units * unit_bytes(&pool));
    KvManager::new(pool, config, Box::new(FixedPolicy::new(3))).expect("manager")
}

/// What a finished conversation left: its tokens, and the slot image and block contents at
/// each checkpointed token (512, 768, 1,024, 1,280).
pub struct Turn {
    pub tokens: Vec<u32>,
    pub images: Vec<(u64, Vec<u8>)>,
}

/// Run a conversation of `family` (prompt 1,000, decoded to 1,500) to its end and finish it,
/// recording the slot image at every block boundary it checkpoints.
pub fn turn(m: &mut KvManager, family: u64) -> Turn {
    let t = tokens(family, 1500, 0);
    let a = m.add_request(1000, hashes(&t));
    assert_eq!(m.admit(a).expect("admit").hit_tokens, 0);
    let mut images = Vec::new();
    for to in [512u64, 768, 1024, 1280] {
        run_to(m, a, &t, to, 700);
        let pool = m.pool().clone();
        let pos = m.slot(a).unwrap().unwrap().position;
        images.push((to, read(&pool, &image_ranges(&pool, pos))));
    }
    run_to(m, a, &t, 1500, 700);
    m.finish(a).expect("finish");
    m.check_invariants().expect("invariants");
    Turn { tokens: t, images }
}

/// Overwrite every block of the pool with bytes no test wrote (only while no request runs).
pub fn poison_blocks(m: &KvManager, seed: u64) {
    let pool = m.pool();
    let c = pool.counts().expect("counts");
    assert_eq!(c.free_blocks, c.num_blocks, "poisoning needs every block free");
    for id in 0..c.num_blocks {
        let r = block_ranges(pool, id);
        let n = r.iter().map(|x| x.2 as usize).sum();
        write(pool, &r, &pattern(seed ^ u64::from(id), n));
    }
}

/// Admit the conversation again (prompt 1,400) and check what came back: the hit ends at
/// `want_hit`, the restored slot image equals the image the first run had there, and the
/// hit's blocks hold the first run's bytes. The request is left running.
pub fn rehit(m: &mut KvManager, turn: &Turn, want_hit: u64) -> v4pool::manager::RequestId {
    let b = m.add_request(1400, hashes(&turn.tokens));
    let adm = m.admit(b).expect("admit");
    assert_eq!(adm.hit_tokens, want_hit, "hit length");
    m.complete_inflight().expect("complete");
    m.check_invariants().expect("invariants");
    let pool = m.pool().clone();
    if want_hit > 0 {
        let want = &turn.images.iter().find(|(t, _)| *t == want_hit).expect("a recorded image").1;
        same(&read(&pool, &image_ranges(&pool, adm.slot.position)), want, "restored slot image");
    }
    let table = m.block_table(b).expect("table");
    let hs = hashes(&turn.tokens);
    for (k, &id) in table.iter().enumerate() {
        same(&read(&pool, &block_ranges(&pool, id as u32)), &block_content(&pool, &hs[k]), "restored block");
    }
    b
}

/// Spill → hit → restore, byte-exact: a finished conversation's blocks and checkpoints are
/// evicted from HBM into the tier, HBM is poisoned, and the same conversation hits its last
/// checkpoint (1,280 tokens) with every block and the slot image restored exactly. `pool`:
/// a fresh [`small_pool`] or [`state_pool`] (state written by the state-update kernel).
pub fn spill_hit_restore(pool: Arc<Pool>) {
    let mut m = tiered(pool, 64);
    let upc = u64::from(m.units_per_checkpoint());
    let turn = turn(&mut m, 1);
    m.evict_all().expect("evict");
    let s = m.stats();
    assert_eq!(s.cached_blocks, 0);
    assert_eq!((s.tier_resident_blocks, s.tier_resident_checkpoints), (5, 4), "{s:?}");
    assert_eq!(s.tier_spilled_blocks, 5);
    assert_eq!(s.tier_resident_bytes, (5 + 4 * upc) * unit_bytes(m.pool()));
    assert_eq!(s.tier_host_evictions, 0);
    poison_blocks(&m, 0xdead);
    assert_eq!(m.match_prefix(&hashes(&turn.tokens[..1400])), 1280, "host-resident prefix matches");
    let b = rehit(&mut m, &turn, 1280);
    let s = m.stats();
    assert_eq!((s.tier_restored_blocks, s.tier_restored_checkpoints), (5, 1), "{s:?}");
    assert_eq!(s.tier_restored_bytes, (5 + upc) * unit_bytes(m.pool()));
    assert_eq!((s.tier_resident_blocks, s.tier_resident_checkpoints), (0, 3), "{s:?}");
    assert_eq!(s.tier_shortened_hits, 0);
    // The restored request continues like any other.
    run_to(&mut m, b, &turn.tokens, 1500, 700);
    m.finish(b).expect("finish");
    m.check_invariants().expect("invariants");
}
