//! The manager's eviction policy seam (`KvManager::set_eviction_policy`) on the host backend:
//! the default LRU takes the least recently used cached prefix, a most-recently-used policy
//! plugged in takes the newest instead, and a policy that picks nothing is a typed refusal —
//! with the manager's invariants holding after each.

use crate::manager_common;

use manager_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{Candidate, EvictionPolicy, FixedPolicy, KvManager, ManagerError, NodeId};

/// Newest first: the last candidate of the recency list.
#[derive(Debug)]
struct Mru;

impl EvictionPolicy for Mru {
    fn name(&self) -> &'static str {
        "mru"
    }
    fn victim(&self, candidates: &mut dyn Iterator<Item = Candidate>) -> Option<NodeId> {
        candidates.last().map(|c| c.id)
    }
}

/// Chooses nothing.
#[derive(Debug)]
struct Refuses;

impl EvictionPolicy for Refuses {
    fn name(&self) -> &'static str {
        "refuses"
    }
    fn victim(&self, _: &mut dyn Iterator<Item = Candidate>) -> Option<NodeId> {
        None
    }
}

fn free_blocks(m: &KvManager) -> u32 {
    m.pool().counts().expect("counts").free_blocks
}

/// Two finished one-block prompts cached (A before B, each with its checkpoint), then a
/// request that needs one block more than is free. Returns the manager, A's and B's hits
/// before, and the result of that allocation.
fn scenario(
    policy: Option<Box<dyn EvictionPolicy>>,
) -> (KvManager, [u64; 2], [u64; 2], Result<(), ManagerError>) {
    let pool = small_pool(Arc::new(HostBackend::new()), 8);
    let mut m = KvManager::new(pool, config(0, false), Box::new(FixedPolicy::new(2))).expect("manager");
    if let Some(p) = policy {
        m.set_eviction_policy(p);
    }
    let mut hs = Vec::new();
    for family in [1, 2] {
        let t = tokens(family, BLOCK as usize + 1, 0);
        let h = hashes(&t);
        let id = m.add_request(t.len() as u64, h.clone());
        m.admit(id).expect("admit");
        run_to(&mut m, id, &t, BLOCK, BLOCK);
        m.finish(id).expect("finish");
        hs.push(h);
    }
    let before = [m.match_prefix(&hs[0]), m.match_prefix(&hs[1])];
    let c = m.add_request(64 * BLOCK, Vec::new());
    m.admit(c).expect("admit C");
    let r = m.allocate(c, u64::from(free_blocks(&m) + 1) * BLOCK);
    let after = [m.match_prefix(&hs[0]), m.match_prefix(&hs[1])];
    (m, before, after, r)
}

#[test]
fn lru_evicts_the_least_recently_used_prefix() {
    let (m, before, after, r) = scenario(None);
    r.expect("allocate");
    assert_eq!(m.eviction_policy_name(), "lru");
    assert_eq!(before, [BLOCK, BLOCK], "both prefixes hit before");
    assert_eq!(after, [0, BLOCK], "A, the older, went first");
    m.check_invariants().expect("invariants");
}

#[test]
fn a_plugged_in_policy_chooses_the_victim() {
    let (m, before, after, r) = scenario(Some(Box::new(Mru)));
    r.expect("allocate");
    assert_eq!(m.eviction_policy_name(), "mru");
    assert_eq!(before, [BLOCK, BLOCK]);
    assert_eq!(after, [BLOCK, 0], "B, the newer, went first");
    m.check_invariants().expect("invariants");
}

#[test]
fn a_policy_that_chooses_nothing_is_refused() {
    let (m, before, after, r) = scenario(Some(Box::new(Refuses)));
    assert!(matches!(r, Err(ManagerError::Config(_))), "{r:?}");
    assert_eq!(before, after, "nothing evicted");
    m.check_invariants().expect("invariants");
}
