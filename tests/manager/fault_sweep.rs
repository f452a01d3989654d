//! The fault sweep: every operation that moves the boundary, relocates, checkpoints,
//! restores, hands off or spills to / restores from the host tier, run once per backend call
//! it makes with exactly that call failing. After each error the pool is as before (split,
//! free counts, every held handle current, every held byte where its handle says), the host
//! tier and the receiver hold nothing new, no device or host allocation is leaked, and the
//! same operation then succeeds. The shared tier's publish and restore too: a failed publish
//! leaves no file (nor a temporary one), a failed restore no block allocated.

use crate::fault_common;
use crate::manager_common;

use fault_common::{Call, FaultBackend, CALLS};
use manager_common::{block_ranges, pattern, read, slot_ranges, write};
use std::sync::Arc;
use v4pool::backend::{Backend, Stream};
use v4pool::pool::BoundaryChange;
use v4pool::pool::{BlockHandle, SlotHandle};
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sizing::IndexerDtype;
use v4pool::transfer::{handoff, Endpoint, HostTier, LocalEngine, RequestKv};
use v4pool::transfer::{EntryKind, SharedKey, SharedTier, SharedTierConfig};

use manager_common::pool_common::{self, RATIOS, WIDTHS};

fn spec(positions: i64, slots: i64) -> PoolSpec {
    pool_common::small_spec(&RATIOS, &WIDTHS, IndexerDtype::Fp8, positions, slots)
}

/// A pool on `b` of 8 positions, 3 of them slots initially.
fn pool(b: &Arc<FaultBackend>) -> Pool {
    Pool::new(b.clone() as Arc<dyn Backend>, spec(8, 3), Stream::DEFAULT).expect("pool")
}

/// Everything a pool holds, as the test knows it: held blocks and slots with their bytes.
struct World {
    blocks: Vec<(BlockHandle, Vec<u8>)>,
    slots: Vec<(SlotHandle, Vec<u8>)>,
}

impl World {
    /// Hold every block, free those at `free_blocks` (by rank), hold every slot but the
    /// first, and write every held byte with a pattern.
    fn fill(pool: &Pool, free_blocks: &[usize], seed: u64) -> World {
        let mut held = Vec::new();
        while let Ok(g) = pool.alloc_block() {
            held.push(g.handle);
        }
        let mut blocks = Vec::new();
        for (i, h) in held.into_iter().enumerate() {
            if free_blocks.contains(&i) {
                pool.free_block(h).expect("free");
            } else {
                let r = block_ranges(pool, h.id);
                let bytes = pattern(seed ^ u64::from(h.id) << 8, r.iter().map(|x| x.2 as usize).sum());
                write(pool, &r, &bytes);
                blocks.push((h, bytes));
            }
        }
        let mut leases = Vec::new();
        while let Ok(l) = pool.alloc_slot() {
            leases.push(l);
        }
        // The lowest group stays vacant, so retiring the top groups relocates held slots.
        if !leases.is_empty() {
            pool.free_slot(leases.remove(0).handle).expect("free");
        }
        let mut slots = Vec::new();
        for l in leases {
            let r = slot_ranges(pool, l.position);
            let bytes =
                pattern(seed ^ 0xa5 ^ (l.position as u64) << 16, r.iter().map(|x| x.2 as usize).sum());
            write(pool, &r, &bytes);
            slots.push((l.handle, bytes));
        }
        World { blocks, slots }
    }

    /// Every held handle current, every held byte where its handle says.
    fn check(&self, pool: &Pool, what: &str) {
        for (h, bytes) in &self.blocks {
            pool.check_block(*h).unwrap_or_else(|e| panic!("{what}: block {h:?} stale: {e}"));
            assert!(read(pool, &block_ranges(pool, h.id)) == *bytes, "{what}: block {} lost bytes", h.id);
        }
        for (h, bytes) in &self.slots {
            let pos = pool.slot_position(*h).unwrap_or_else(|e| panic!("{what}: slot {h:?} stale: {e}"));
            assert!(read(pool, &slot_ranges(pool, pos)) == *bytes, "{what}: slot at {pos} lost bytes");
        }
    }

    /// Follow the moves a boundary change reports.
    fn follow(&mut self, c: &BoundaryChange) {
        for m in &c.block_moves {
            let b = self.blocks.iter_mut().find(|b| b.0 == m.old).expect("a moved block is held");
            b.0 = m.new;
        }
        for m in &c.slot_moves {
            let s = self.slots.iter_mut().find(|s| s.0 == m.old).expect("a moved slot is held");
            s.0 = m.new;
        }
    }
}

/// Run `case` unarmed to count its backend calls, then once per call with that call failing.
/// `case(backend, fail)` builds its world, arms `fail` around the operation alone, checks,
/// and returns the calls the operation made. Returns the points swept.
fn sweep(name: &str, case: impl Fn(&Arc<FaultBackend>, Option<(Call, u64)>) -> [u64; 10]) -> u64 {
    let counts = case(&FaultBackend::new(), None);
    let mut points = 0;
    for (i, &kind) in CALLS.iter().enumerate() {
        for n in 1..=counts[i] {
            let b = FaultBackend::new();
            case(&b, Some((kind, n)));
            points += 1;
        }
    }
    println!("{name}: {points} injection points ({counts:?})");
    assert!(points > 0, "{name} made no backend call: the sweep proves nothing");
    points
}

/// A V4.1-Flash pool on `b` in the packed layout (288-B compressed rows in 528-B plane rows):
/// 6 blocks and 2 slots at the split, in a plane of 4 slot positions.
fn packed_pool(b: &Arc<FaultBackend>) -> Pool {
    use v4pool::sizing::{KvDtype, PoolLayout};
    let layout = PoolLayout::new(
        &v4pool::model::ModelShape::v41_flash(0).unwrap(),
        KvDtype::FlashMlaV41Fp4,
        IndexerDtype::Fp8,
    )
    .expect("layout");
    let g = &layout.geometry;
    let geometry = layout.carve(6, 2, 4 * g.slot_rows).expect("carve");
    let spec = PoolSpec::from_layout(&layout, geometry).expect("spec");
    Pool::new(b.clone() as Arc<dyn Backend>, spec, Stream::DEFAULT).expect("pool")
}

/// One boundary move under the sweep on a pool `make` builds: refused whole on a failure, then
/// done on a retry.
fn boundary_case(
    make: fn(&Arc<FaultBackend>) -> Pool,
    b: &Arc<FaultBackend>,
    fail: Option<(Call, u64)>,
    free_blocks: &[usize],
    prepare: impl Fn(&Pool),
    op: impl Fn(&Pool) -> Result<BoundaryChange, v4pool::pool::PoolError>,
) -> [u64; 10] {
    let p = make(b);
    prepare(&p);
    let mut w = World::fill(&p, free_blocks, 7);
    let before = p.counts().unwrap();
    let live = b.host.live_allocations();
    b.arm(fail);
    let r = op(&p);
    let fired = b.disarm();
    let counts = b.counts();
    if fail.is_none() {
        let c = r.expect("the unarmed move succeeds");
        assert!(!c.block_moves.is_empty() || !c.slot_moves.is_empty(), "the move relocates nothing");
        w.follow(&c);
        w.check(&p, "unarmed move");
        return counts;
    }
    assert!(fired, "{fail:?} was not reached");
    let e = r.expect_err("a failed backend call fails the move");
    let what = format!("after {fail:?} ({e})");
    assert_eq!(p.counts().unwrap(), before, "{what}: the split or the free counts changed");
    assert_eq!(b.host.live_allocations(), live, "{what}: an allocation leaked");
    w.check(&p, &what);
    // Later calls work: the same move now succeeds and moves every byte.
    let c = op(&p).unwrap_or_else(|e| panic!("{what}: the retry failed: {e}"));
    w.follow(&c);
    w.check(&p, &format!("{what}, retried"));
    counts
}

/// The case: hold 8 blocks, free the lowest 4, resize to 4 blocks.
#[test]
fn a_failed_relocation_leaves_the_pool_as_it_was() {
    // Seen failing before the fix: `num_blocks` was already 4 after the error and every
    // held handle stale.
    let points = sweep("resize", |b, fail| {
        boundary_case(
            pool,
            b,
            fail,
            &[0, 1, 2, 3],
            |_| {},
            |p| {
                let c = p.counts().unwrap();
                p.resize(4, c.num_slots)
            },
        )
    });
    assert!(points >= 2);
}

#[test]
fn every_boundary_move_is_all_or_nothing() {
    // Slots grow over the top blocks (held ones relocate below).
    sweep("grow_slots", |b, fail| boundary_case(pool, b, fail, &[0, 2], |_| {}, |p| p.grow_slots(1)));
    // Slots shrink (the low held slots relocate up into the vacant one).
    sweep("shrink_slots", |b, fail| boundary_case(pool, b, fail, &[], |_| {}, |p| p.shrink_slots(1)));
    // Blocks shrink (the top held blocks relocate down).
    sweep("shrink_blocks", |b, fail| {
        boundary_case(pool, b, fail, &[1, 3, 4], |_| {}, |p| p.shrink_blocks(3))
    });
    // Blocks grow over slots after a shrink made room to move into.
    sweep("grow_blocks_shrinking_slots", |b, fail| {
        boundary_case(pool, b, fail, &[0], |_| {}, |p| p.grow_blocks_shrinking_slots(1))
    });
}

#[test]
fn every_boundary_move_is_all_or_nothing_in_the_packed_v41_layout() {
    let p = packed_pool(&FaultBackend::new());
    assert!(p.spec().geometry.packed_rows.is_some());
    let c = p.counts().unwrap();
    println!("packed pool: {c:?}");
    // Blocks shrink (the top held blocks relocate down, their fp4 rows with them).
    sweep("packed shrink_blocks", |b, fail| {
        boundary_case(packed_pool, b, fail, &[0, 2], |_| {}, |p| p.shrink_blocks(2))
    });
    // Slots shrink (the low held slot relocates up into the vacant one).
    sweep("packed shrink_slots", |b, fail| {
        boundary_case(packed_pool, b, fail, &[], |_| {}, |p| p.shrink_slots(1))
    });
}

#[test]
fn checkpoint_and_restore_fail_cleanly() {
    sweep("checkpoint", |b, fail| {
        let p = pool(b);
        let w = World::fill(&p, &[], 11);
        let slot = w.slots[0].0;
        let live = b.host.live_allocations();
        b.arm(fail);
        let r = p.checkpoint(slot);
        let fired = b.disarm();
        let counts = b.counts();
        if fail.is_some() {
            assert!(fired && r.is_err(), "{fail:?}: {r:?}");
        }
        assert_eq!(b.host.live_allocations(), live, "{fail:?}: leaked");
        w.check(&p, &format!("checkpoint, {fail:?}"));
        p.checkpoint(slot).expect("a later checkpoint works");
        counts
    });
    sweep("restore", |b, fail| {
        let p = pool(b);
        let mut w = World::fill(&p, &[], 13);
        let (from, to) = (w.slots[0].0, w.slots[1].0);
        let image = p.checkpoint(from).expect("image");
        let live = b.host.live_allocations();
        b.arm(fail);
        let r = p.restore(to, &image);
        let fired = b.disarm();
        let counts = b.counts();
        if fail.is_some() {
            assert!(fired && r.is_err(), "{fail:?}: {r:?}");
        }
        assert_eq!(b.host.live_allocations(), live, "{fail:?}: leaked");
        // The restored slot may be part-written (documented: restore again); the rest holds.
        w.slots.remove(1);
        w.check(&p, &format!("restore, {fail:?}"));
        p.restore(to, &image).expect("a later restore works");
        assert!(p.checkpoint(to).expect("image").bytes() == image.bytes(), "restored bytes differ");
        counts
    });
}

#[test]
fn a_failed_handoff_leaves_both_pools_as_they_were() {
    sweep("handoff", |b, fail| {
        let (s, r) = (pool(b), pool(b));
        let w = World::fill(&s, &[0, 2, 5], 17);
        let req = RequestKv {
            blocks: w.blocks.iter().take(3).map(|x| x.0).collect(),
            slot: w.slots[0].0,
            context_len: 700,
        };
        let rw = World::fill(&r, &[0, 1, 2, 3, 4, 5], 19);
        let before = r.counts().unwrap();
        let live = b.host.live_allocations();
        let mut engine = LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT);
        b.arm(fail);
        let out = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r), &req);
        let fired = b.disarm();
        let counts = b.counts();
        w.check(&s, "sender");
        rw.check(&r, "receiver");
        if fail.is_some() {
            assert!(fired, "{fail:?} not reached");
            let e = out.expect_err("a failed call fails the handoff");
            assert_eq!(r.counts().unwrap(), before, "after {fail:?} ({e}): the receiver holds something new");
            assert_eq!(b.host.live_allocations(), live, "after {fail:?}: leaked");
        } else {
            out.expect("unarmed handoff");
            return counts;
        }
        let out =
            handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r), &req).expect("a later handoff");
        for (a, nb) in req.blocks.iter().zip(&out.blocks) {
            assert!(read(&r, &block_ranges(&r, nb.id)) == read(&s, &block_ranges(&s, a.id)));
        }
        counts
    });
}

#[test]
fn host_tier_spill_and_restore_fail_cleanly() {
    sweep("spill", |b, fail| {
        let p = pool(b);
        let w = World::fill(&p, &[1], 23);
        let mut tier = HostTier::<u64>::new(&p, 64 << 20).expect("tier");
        let blocks: Vec<BlockHandle> = w.blocks.iter().take(3).map(|x| x.0).collect();
        let live = b.host.live_allocations();
        b.arm(fail);
        let r = tier.spill(&p, 1, &blocks);
        let fired = b.disarm();
        let counts = b.counts();
        w.check(&p, "spill");
        if fail.is_some() {
            assert!(fired && r.is_err(), "{fail:?}: {r:?}");
            assert!(!tier.contains(&1) && tier.used_units() == 0, "{fail:?}: the tier kept a part entry");
            assert_eq!(b.host.live_allocations(), live, "{fail:?}: leaked");
            tier.spill(&p, 1, &blocks).expect("a later spill works");
        } else {
            r.expect("spill");
        }
        // What came back is what went out.
        let want: Vec<Vec<u8>> = w.blocks.iter().take(3).map(|x| x.1.clone()).collect();
        for &h in &blocks {
            p.free_block(h).unwrap();
        }
        let got = tier.restore(&p, &1).expect("restore");
        for (h, bytes) in got.iter().zip(&want) {
            assert!(read(&p, &block_ranges(&p, h.id)) == *bytes, "spilled bytes differ");
        }
        counts
    });
    sweep("tier restore", |b, fail| {
        let p = pool(b);
        let w = World::fill(&p, &[1], 29);
        let mut tier = HostTier::<u64>::new(&p, 64 << 20).expect("tier");
        let blocks: Vec<BlockHandle> = w.blocks.iter().take(3).map(|x| x.0).collect();
        let want: Vec<Vec<u8>> = w.blocks.iter().take(3).map(|x| x.1.clone()).collect();
        tier.spill(&p, 1, &blocks).expect("spill");
        for &h in &blocks {
            p.free_block(h).unwrap();
        }
        let before = p.counts().unwrap();
        let live = b.host.live_allocations();
        b.arm(fail);
        let r = tier.restore(&p, &1);
        let fired = b.disarm();
        let counts = b.counts();
        if fail.is_some() {
            assert!(fired && r.is_err(), "{fail:?}: {r:?}");
            assert!(tier.contains(&1), "{fail:?}: the entry was dropped");
            assert_eq!(p.counts().unwrap(), before, "{fail:?}: restored blocks leaked");
            assert_eq!(b.host.live_allocations(), live, "{fail:?}: leaked");
        }
        let got = if fail.is_some() { tier.restore(&p, &1).expect("a later restore") } else { r.unwrap() };
        for (h, bytes) in got.iter().zip(&want) {
            assert!(read(&p, &block_ranges(&p, h.id)) == *bytes, "restored bytes differ");
        }
        counts
    });
}

/// Every file under `dir`, recursively (entries and temporary files alike).
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Units of one checkpoint entry of `p` (the shared tier refuses any other count under a
/// checkpoint's key).
fn units(p: &Pool) -> usize {
    p.spec().checkpoint_layout().expect("checkpoint layout").units_per_checkpoint as usize
}

#[test]
fn shared_tier_publish_and_restore_fail_cleanly() {
    let dir = std::env::temp_dir().join(format!("v4pool-fault-shared-{}", std::process::id()));
    let key = SharedKey { kind: EntryKind::Checkpoint, hash: 0x35 };
    let fresh = || {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        SharedTierConfig::new(dir.clone(), 64 << 20).with_sync(false)
    };
    sweep("shared publish", |b, fail| {
        let p = pool(b);
        let w = World::fill(&p, &[1], 31);
        let blocks: Vec<BlockHandle> = w.blocks.iter().take(units(&p)).map(|x| x.0).collect();
        let live = b.host.live_allocations();
        let mut tier = SharedTier::new(&p, &fresh()).expect("tier");
        b.arm(fail);
        let r = tier.publish(&p, key, &blocks);
        let fired = b.disarm();
        let counts = b.counts();
        w.check(&p, "shared publish");
        if fail.is_some() {
            assert!(fired && r.is_err(), "{fail:?}: {r:?}");
            assert!(!tier.contains(&key), "{fail:?}: a failed publish left an entry");
            assert!(files_under(&dir).is_empty(), "{fail:?}: files left: {:?}", files_under(&dir));
            assert!(tier.publish(&p, key, &blocks).expect("a later publish works"));
        } else {
            assert!(r.expect("publish"));
        }
        // What a restore brings back is what was published.
        let want: Vec<Vec<u8>> = w.blocks.iter().take(units(&p)).map(|x| x.1.clone()).collect();
        for &h in &blocks {
            p.free_block(h).unwrap();
        }
        let got = tier.restore(&p, &key).expect("restore");
        for (h, bytes) in got.iter().zip(&want) {
            assert!(read(&p, &block_ranges(&p, h.id)) == *bytes, "published bytes differ");
        }
        drop(tier);
        assert_eq!(b.host.live_allocations(), live, "{fail:?}: the tier's staging leaked");
        counts
    });
    sweep("shared restore", |b, fail| {
        let p = pool(b);
        let w = World::fill(&p, &[1], 37);
        let blocks: Vec<BlockHandle> = w.blocks.iter().take(units(&p)).map(|x| x.0).collect();
        let want: Vec<Vec<u8>> = w.blocks.iter().take(units(&p)).map(|x| x.1.clone()).collect();
        let mut tier = SharedTier::new(&p, &fresh()).expect("tier");
        assert!(tier.publish(&p, key, &blocks).expect("publish"));
        for &h in &blocks {
            p.free_block(h).unwrap();
        }
        let before = p.counts().unwrap();
        b.arm(fail);
        let r = tier.restore(&p, &key);
        let fired = b.disarm();
        let counts = b.counts();
        if fail.is_some() {
            assert!(fired && r.is_err(), "{fail:?}: {r:?}");
            assert!(tier.contains(&key), "{fail:?}: a device failure dropped the entry");
            assert_eq!(p.counts().unwrap(), before, "{fail:?}: restored blocks leaked");
        }
        let got = if fail.is_some() { tier.restore(&p, &key).expect("a later restore") } else { r.unwrap() };
        for (h, bytes) in got.iter().zip(&want) {
            assert!(read(&p, &block_ranges(&p, h.id)) == *bytes, "restored bytes differ");
        }
        counts
    });
    let _ = std::fs::remove_dir_all(&dir);
}
