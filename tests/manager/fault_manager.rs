//! The fault sweep through the request-level manager: an admission whose hit is restored
//! from a checkpoint (from HBM, or from the host tier), an eviction into the host tier, and a
//! commit that stores a checkpoint, each run once per backend call it makes with exactly
//! that call failing. After each error the manager passes its invariant checks, the pool's
//! free counts return once the manager holds nothing, and the same scenario then completes
//! byte-exact.

use crate::fault_common;
use crate::tier_common;

use fault_common::{Call, FaultBackend, CALLS};
use std::sync::Arc;
use tier_common::manager_common::*;
use tier_common::*;
use v4pool::backend::Backend;
use v4pool::manager::KvManager;

/// Sweep `case` as `fault_sweep.rs` does: count the calls unarmed, then fail each in turn.
fn sweep(name: &str, case: impl Fn(&Arc<FaultBackend>, Option<(Call, u64)>) -> [u64; 10]) {
    let counts = case(&FaultBackend::new(), None);
    let mut points = 0;
    for (i, &kind) in CALLS.iter().enumerate() {
        for n in 1..=counts[i] {
            case(&FaultBackend::new(), Some((kind, n)));
            points += 1;
        }
    }
    println!("{name}: {points} injection points ({counts:?})");
    assert!(points > 0, "{name} made no backend call");
}

/// A tiered manager on `b` that has run conversation 1 to its end.
fn world(b: &Arc<FaultBackend>) -> (KvManager, Turn) {
    let pool = small_pool(b.clone() as Arc<dyn Backend>, 40);
    let mut m = tiered(pool, 64);
    let t = turn(&mut m, 1);
    (m, t)
}

/// Everything is released and the manager holds only cache: counts back to `free`.
fn settle(m: &mut KvManager) {
    m.evict_all().expect("evict");
    m.check_invariants().expect("invariants");
    let c = m.pool().counts().expect("counts");
    assert_eq!(c.free_blocks, c.num_blocks, "blocks leaked: {c:?}");
}

/// Arm `fail` around `op`; check the outcome is an error when the fault fired, and that the
/// manager's invariants hold either way. Returns (calls made, whether `op` failed).
fn armed<R>(
    b: &FaultBackend,
    fail: Option<(Call, u64)>,
    m: &mut KvManager,
    op: impl FnOnce(&mut KvManager) -> Result<R, v4pool::manager::ManagerError>,
) -> ([u64; 10], bool) {
    b.arm(fail);
    let r = op(m);
    let fired = b.disarm();
    let counts = b.counts();
    if fail.is_some() {
        assert!(fired, "{fail:?} not reached");
    }
    m.check_invariants().unwrap_or_else(|e| panic!("after {fail:?}: invariants: {e}"));
    (counts, r.is_err())
}

/// The conversation again: whatever hits (perhaps shorter after a failure) is byte-exact.
fn hit_again(m: &mut KvManager, t: &Turn) {
    let id = m.add_request(1400, hashes(&t.tokens));
    let adm = m.admit(id).expect("admit");
    if adm.hit_tokens > 0 {
        let want = &t.images.iter().find(|(k, _)| *k == adm.hit_tokens).expect("an image").1;
        same(&read(m.pool(), &image_ranges(m.pool(), adm.slot.position)), want, "restored image");
    }
    m.complete_inflight().expect("complete");
    m.finish(id).expect("finish");
}

#[test]
fn an_admission_restoring_a_checkpoint_fails_cleanly() {
    sweep("admit (HBM hit)", |b, fail| {
        let (mut m, t) = world(b);
        let id = m.add_request(1400, hashes(&t.tokens));
        let (counts, failed) = armed(b, fail, &mut m, |m| m.admit(id));
        if failed {
            assert!(m.slot(id).expect("request").is_none(), "a failed admission holds a slot");
            let _ = m.finish(id);
            let b2 = rehit(&mut m, &t, 1280);
            m.finish(b2).expect("finish");
        } else {
            m.complete_inflight().expect("complete");
            m.finish(id).expect("finish");
        }
        settle(&mut m);
        counts
    });
}

#[test]
fn spilling_to_and_restoring_from_the_host_tier_fails_cleanly() {
    sweep("evict_all (spill)", |b, fail| {
        let (mut m, t) = world(b);
        let (counts, _) = armed(b, fail, &mut m, |m| m.evict_all());
        // Whatever reached the tier hits; what did not was dropped (a miss, never wrong bytes).
        hit_again(&mut m, &t);
        settle(&mut m);
        counts
    });
    sweep("admit (tier hit)", |b, fail| {
        let (mut m, t) = world(b);
        m.evict_all().expect("evict");
        poison_blocks(&m, 0xbad);
        let id = m.add_request(1400, hashes(&t.tokens));
        let (counts, failed) = armed(b, fail, &mut m, |m| m.admit(id));
        if failed {
            assert!(m.slot(id).expect("request").is_none(), "a failed admission holds a slot");
            let _ = m.finish(id);
        } else {
            m.complete_inflight().expect("complete");
            m.finish(id).expect("finish");
        }
        // Later calls work: the conversation hits again (perhaps shorter), byte-exact.
        hit_again(&mut m, &t);
        settle(&mut m);
        counts
    });
}

#[test]
fn a_commit_storing_a_checkpoint_fails_cleanly() {
    sweep("commit (store)", |b, fail| {
        let pool = small_pool(b.clone() as Arc<dyn Backend>, 40);
        let mut m = tiered(pool, 64);
        let t = tokens(3, 1500, 0);
        let id = m.add_request(1000, hashes(&t));
        m.admit(id).expect("admit");
        run_to(&mut m, id, &t, 500, 700);
        // The next commit reaches 512 tokens: a checkpoint point.
        let done = m.computed_tokens(id).expect("request");
        let n = 512 - done;
        m.allocate(id, n).expect("allocate");
        let slot = m.slot(id).expect("slot").expect("running");
        let table = m.block_table(id).expect("table");
        forward(m.pool(), slot, &table, &t, done as usize, 512);
        let (counts, failed) = armed(b, fail, &mut m, |m| {
            m.commit(id, n)?;
            m.complete_inflight()
        });
        if failed {
            // The request may go on; its tokens are committed or not, never half.
            let now = m.computed_tokens(id).expect("request");
            assert!(now == done || now == 512, "computed tokens {now}");
            if now == done {
                m.commit(id, n).expect("a later commit");
            }
            m.complete_inflight().expect("complete");
        }
        run_to(&mut m, id, &t, 1500, 700);
        m.finish(id).expect("finish");
        settle(&mut m);
        counts
    });
}
