//! Counts and hashes a careless or hostile scheduler passes the manager: wrap-arounds are
//! refused with a typed error and change nothing; a request whose block hashes repeat is
//! refused before it holds anything. Each case failed before its fix (commit took computed
//! tokens from 5 to 2; allocate returned Ok with one block; a repeated hash hit three times
//! on one block).

use crate::manager_common;

use manager_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{BlockHash, FixedPolicy, KvManager, ManagerError};

fn manager() -> KvManager {
    let pool = small_pool(Arc::new(HostBackend::new()), 8);
    KvManager::new(pool, config(0, false), Box::new(FixedPolicy::new(2))).expect("manager")
}

#[test]
fn wrapping_counts_are_refused() {
    let mut m = manager();
    let a = m.add_request(10, Vec::new());
    m.admit(a).expect("admit");
    m.allocate(a, 5).expect("allocate");
    m.commit(a, 5).expect("commit");
    let table = m.block_table(a).expect("table");
    let r = m.commit(a, u64::MAX - 2);
    assert!(matches!(r, Err(ManagerError::Overflow(_))), "{r:?}");
    assert_eq!(m.computed_tokens(a).expect("request"), 5, "a refused commit changed the count");
    let r = m.allocate(a, u64::MAX);
    assert!(matches!(r, Err(ManagerError::Overflow(_))), "{r:?}");
    assert_eq!(m.block_table(a).expect("table"), table, "a refused allocate changed the table");
    // Back-pressure for a request owing u64::MAX blocks: not admitted (before the fix the
    // sum wrapped and said yes).
    assert!(!m.may_admit(u64::MAX).expect("view"));
    assert!(!m.may_admit(u64::MAX - 3).expect("view"));
    m.check_invariants().expect("invariants");
    // Later calls work.
    m.allocate(a, 300).expect("allocate");
    m.commit(a, 300).expect("commit");
    assert_eq!(m.computed_tokens(a).expect("request"), 305);
}

#[test]
fn repeated_hashes_in_one_request_are_refused() {
    let mut m = manager();
    // A first request computes and indexes one block under hash h.
    let t = tokens(1, 3 * BLOCK as usize, 0);
    let hs = hashes(&t);
    let a = m.add_request(t.len() as u64, hs.clone());
    m.admit(a).expect("admit");
    run_to(&mut m, a, &t, 3 * BLOCK, 512);
    m.finish(a).expect("finish");
    let before = m.pool().counts().expect("counts");
    // A request whose hashes repeat one value.
    let same: Vec<BlockHash> = vec![hs[0]; 3];
    let b = m.add_request(3 * BLOCK + 1, same);
    let r = m.admit(b);
    assert!(
        matches!(r, Err(ManagerError::RepeatedHash { first: 0, again: 1 })),
        "{:?}",
        r.map(|a| a.hit_tokens)
    );
    assert_eq!(m.pool().counts().expect("counts"), before, "a refused admission holds something");
    m.check_invariants().expect("invariants");
    // extend_hashes refuses a repeat too, changing nothing.
    let c = m.add_request(10, vec![hs[1]]);
    let r = m.extend_hashes(c, &[hs[2], hs[1]]);
    assert!(matches!(r, Err(ManagerError::RepeatedHash { first: 0, again: 2 })), "{r:?}");
    m.extend_hashes(c, &[hs[2]]).expect("a distinct hash is taken");
    m.check_invariants().expect("invariants");
}
