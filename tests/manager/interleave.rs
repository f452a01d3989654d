//! Another thread acting at the worst moment, made deterministic with hooks (no sleeps): a
//! transfer engine or a backend call that, just before the bytes move, frees low blocks and
//! moves the boundary so the blocks being copied would relocate. The bytes must end where
//! the handles say. Also: a build after the boundary moved under a staged batch, and
//! host-tier units and handoff peers of another layout.

use crate::fault_common;
use crate::manager_common;

use fault_common::{Call, FaultBackend};
use manager_common::{block_ranges, pattern, read, write};
use std::sync::{Arc, Mutex};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::pool::BlockHandle;
use v4pool::pool::{DecodeCapacity, DecodeError, DecodeSeq, Pool, PoolError, PoolSpec};
use v4pool::sizing::IndexerDtype;
use v4pool::transfer::engine::{EngineError, MemRegion, RegionId, Side, Span, TransferTicket};
use v4pool::transfer::{handoff, Endpoint, HostTier, HostTierError, LocalEngine, RequestKv, TransferEngine};

use manager_common::pool_common::{self, RATIOS, WIDTHS};

fn spec(positions: i64, slots: i64, ring: i64) -> PoolSpec {
    pool_common::small_spec_with(&RATIOS, &WIDTHS, IndexerDtype::Fp8, positions, ring, slots, None, None)
}

fn pool_on(b: Arc<dyn Backend>) -> Arc<Pool> {
    Arc::new(Pool::new(b, spec(8, 2, 11), Stream::DEFAULT).expect("pool"))
}

fn fill_block(pool: &Pool, id: u32, seed: u64) -> Vec<u8> {
    let r = block_ranges(pool, id);
    let bytes = pattern(seed ^ u64::from(id) << 20, r.iter().map(|x| x.2 as usize).sum());
    write(pool, &r, &bytes);
    bytes
}

/// What another thread does at the worst moment: free the low blocks it held and shrink the
/// block region to what stays held, so every held block above moves down; then grow the
/// region back, take the ids the moved blocks left and scribble on them. Returns the move's
/// result.
fn move_under(pool: &Pool, low: Vec<BlockHandle>) -> Result<(), PoolError> {
    for h in low {
        pool.free_block(h)?;
    }
    let c = pool.counts()?;
    let held = c.num_blocks - c.free_blocks;
    pool.resize(held, c.num_slots)?;
    pool.grow_blocks(c.num_blocks - held)?;
    while let Ok(g) = pool.alloc_block() {
        let r = block_ranges(pool, g.handle.id);
        write(pool, &r, &pattern(0xdead, r.iter().map(|x| x.2 as usize).sum()));
    }
    Ok(())
}

/// A local engine that runs a hook once, just before it moves the bytes.
struct HookEngine {
    inner: LocalEngine,
    hook: Option<Box<dyn FnOnce()>>,
}

impl TransferEngine for HookEngine {
    fn name(&self) -> &'static str {
        "hook"
    }
    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError> {
        // SAFETY: forwarded with the caller's promise.
        unsafe { self.inner.register(side, region) }
    }
    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError> {
        self.inner.deregister(id)
    }
    fn exchange(&mut self, a: &[u8], b: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        self.inner.exchange(a, b)
    }
    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError> {
        if let Some(h) = self.hook.take() {
            h();
        }
        self.inner.post(spans)
    }
    fn poll(&mut self, t: TransferTicket) -> Result<bool, EngineError> {
        self.inner.poll(t)
    }
}

#[test]
fn a_boundary_move_during_a_handoff_cannot_strand_its_bytes() {
    // Seen failing before the fix: the move went through between reservation and copy,
    // handoff returned Ok with handles the move had made stale, and the bytes landed in ids
    // that had become gap.
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let (s, r) = (pool_on(b.clone()), pool_on(b.clone()));
    let blocks: Vec<BlockHandle> = (0..3).map(|_| s.alloc_block().unwrap().handle).collect();
    let want: Vec<Vec<u8>> = blocks.iter().map(|h| fill_block(&s, h.id, 1)).collect();
    let slot = s.alloc_slot().unwrap();
    let req = RequestKv { blocks: blocks.clone(), slot: slot.handle, context_len: 700 };
    // The receiver's low blocks are held by another request, to be freed at the worst moment.
    let low: Vec<BlockHandle> = (0..3).map(|_| r.alloc_block().unwrap().handle).collect();
    let seen = Arc::new(Mutex::new(None));
    let (r2, seen2) = (r.clone(), seen.clone());
    let mut engine = HookEngine {
        inner: LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT),
        hook: Some(Box::new(move || *seen2.lock().unwrap() = Some(move_under(&r2, low)))),
    };
    let out = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r), &req).expect("handoff");
    let moved = seen.lock().unwrap().take().expect("the hook ran");
    for (h, bytes) in out.blocks.iter().zip(&want) {
        r.check_block(*h).expect("a handoff handle is current");
        assert!(read(&r, &block_ranges(&r, h.id)) == *bytes, "bytes not where the handle says");
    }
    assert!(matches!(moved, Err(PoolError::BoundaryPinned { .. })), "the move was not held off: {moved:?}");
    // Once the handoff is over the move goes through, and the bytes follow the handles.
    let c = r.counts().unwrap();
    let change = r.resize(c.num_blocks - c.free_blocks, c.num_slots).expect("move after");
    for (h, bytes) in out.blocks.iter().zip(&want) {
        let h = change.block_moves.iter().find(|m| m.old == *h).map_or(*h, |m| m.new);
        assert!(read(&r, &block_ranges(&r, h.id)) == *bytes);
    }
}

/// The move's result, the units as they came back (handle, expected bytes), their pool.
type TierCase = (Result<(), PoolError>, Vec<(BlockHandle, Vec<u8>)>, Arc<Pool>);

/// Spill (or restore) with the worst-moment move hooked before the first host copy. Returns
/// the move's result, the units as they came back (handle, expected bytes) and their pool:
/// for a spill, a fresh pool of the same layout they were restored into.
fn tier_case(restore: bool) -> TierCase {
    let fb = FaultBackend::new();
    let pool = pool_on(fb.clone());
    let low: Vec<BlockHandle> = (0..3).map(|_| pool.alloc_block().unwrap().handle).collect();
    let blocks: Vec<BlockHandle> = (0..3).map(|_| pool.alloc_block().unwrap().handle).collect();
    let want: Vec<Vec<u8>> = blocks.iter().map(|h| fill_block(&pool, h.id, 2)).collect();
    let mut tier = HostTier::<u64>::new(&pool, 1 << 20).expect("tier");
    let seen = Arc::new(Mutex::new(None));
    let (p2, seen2) = (pool.clone(), seen.clone());
    let hook = move || *seen2.lock().unwrap() = Some(move_under(&p2, low));
    let got = if restore {
        tier.spill(&pool, 9, &blocks).expect("spill");
        for &h in &blocks {
            pool.free_block(h).unwrap();
        }
        fb.hook_before(Call::UploadHost, 1, hook);
        tier.restore(&pool, &9).expect("restore")
    } else {
        fb.hook_before(Call::DownloadHost, 1, hook);
        tier.spill(&pool, 9, &blocks).expect("spill");
        assert!(!fb.hook_pending());
        // What the tier holds, restored into a fresh pool of the same layout.
        let fresh = pool_on(fb.clone());
        let got = tier.restore(&fresh, &9).expect("restore");
        let moved = seen.lock().unwrap().take().expect("the hook ran");
        return (moved, got.into_iter().zip(want).collect(), fresh);
    };
    let moved = seen.lock().unwrap().take().expect("the hook ran");
    (moved, got.into_iter().zip(want).collect(), pool)
}

#[test]
fn a_boundary_move_during_a_spill_cannot_change_what_is_spilled() {
    // Seen failing before the fix: the move relocated the blocks after their ids were read,
    // the slot scribbled over the old rows, and the tier kept the scribble.
    let (moved, got, pool) = tier_case(false);
    for (h, bytes) in got {
        assert!(read(&pool, &block_ranges(&pool, h.id)) == bytes, "the tier holds other bytes");
    }
    assert!(matches!(moved, Err(PoolError::BoundaryPinned { .. })), "the move was not held off: {moved:?}");
}

#[test]
fn a_boundary_move_during_a_tier_restore_cannot_strand_its_bytes() {
    // Seen failing before the fix: restore returned handles the move had made stale, its
    // bytes in rows a slot then took.
    let (moved, got, pool) = tier_case(true);
    for (h, bytes) in got {
        pool.check_block(h).expect("a restored handle is current");
        assert!(read(&pool, &block_ranges(&pool, h.id)) == bytes, "bytes not where the handle says");
    }
    assert!(matches!(moved, Err(PoolError::BoundaryPinned { .. })), "the move was not held off: {moved:?}");
}

#[test]
fn a_unit_of_another_layout_is_refused() {
    // Seen failing before the fix: a unit spilled from a pool of another layout (another
    // ring, same unit bytes) restored into this one.
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let a = Arc::new(Pool::new(b.clone(), spec(8, 2, 11), Stream::DEFAULT).unwrap());
    let other = Arc::new(Pool::new(b, spec(8, 2, 13), Stream::DEFAULT).unwrap());
    assert_ne!(a.layout_id(), other.layout_id());
    let mut tier = HostTier::<u64>::new(&a, 1 << 20).unwrap();
    let h = a.alloc_block().unwrap().handle;
    fill_block(&a, h.id, 3);
    tier.spill(&a, 1, &[h]).unwrap();
    let before = other.counts().unwrap();
    let r = tier.restore(&other, &1);
    assert!(matches!(r, Err(HostTierError::ForeignLayout { .. })), "{r:?}");
    assert_eq!(other.counts().unwrap(), before);
    assert!(tier.contains(&1));
    tier.restore(&a, &1).expect("its own pool restores it");
}

fn cap() -> DecodeCapacity {
    DecodeCapacity::new(2, 2, 8, 8, 4)
}

/// A pool of 8 positions, 2 slots: enough blocks for a staged table at high ids.
fn decode_pool() -> Arc<Pool> {
    pool_on(Arc::new(HostBackend::new()))
}

#[test]
fn a_build_after_the_blocks_shrank_under_a_staged_table_is_refused() {
    // Seen failing before the fix: `build` returned Ok and an HCA destination row lay in a
    // live slot.
    let pool = decode_pool();
    let n = pool.counts().unwrap().num_blocks as i32;
    let live = pool.geometry().unwrap().live_positions();
    for resident in [false, true] {
        let mut path = pool.decode_path(cap()).unwrap();
        let table = [0, n - 1];
        let batch = [DecodeSeq::new(live.end - 1, 300, 1, &table)];
        if resident {
            path.write_block_table(0, 0, &table).unwrap();
            path.stage_resident(&batch).unwrap();
        } else {
            path.stage(&batch).unwrap();
        }
        path.build().expect("a build at the staged split");
        let c1 = pool.shrink_blocks(2).unwrap();
        let c2 = pool.grow_slots(1).unwrap();
        let r = path.build();
        assert!(matches!(r, Err(DecodeError::StaleBlock { seq: 0, .. })), "resident {resident}: {r:?}");
        // Restaged inside the region, it builds again.
        let fresh = [0, 1];
        if resident {
            path.write_block_table(0, 0, &fresh).unwrap();
            path.build().expect("the rewritten resident table builds");
        } else {
            let batch = [DecodeSeq::new(live.end - 1, 300, 1, &fresh)];
            path.stage(&batch).unwrap();
            path.build().expect("restaged");
        }
        // Back to the old split for the next round.
        let _ = (c1, c2);
        pool.shrink_slots(1).unwrap();
        pool.grow_blocks(2).unwrap();
    }
}

/// A prefill path on `pool` with one 10-token chunk staged whose table reads the top block.
fn staged_prefill(pool: &Arc<Pool>) -> v4pool::pool::PrefillPath {
    use v4pool::pool::{PrefillCapacity, PrefillSeq};
    let n = pool.counts().unwrap().num_blocks as i32;
    let live = pool.geometry().unwrap().live_positions();
    let cap = PrefillCapacity::new(1, 64, 8, 8, 4);
    let mut path = pool.prefill_path(cap).unwrap();
    let table = [0, n - 1];
    let batch = [PrefillSeq::new(live.end - 1, 290, 10, &table)];
    path.stage(&batch).unwrap();
    path
}

#[test]
fn a_prefill_build_after_the_blocks_shrank_is_refused() {
    let pool = decode_pool();
    let mut path = staged_prefill(&pool);
    path.build().expect("a build at the staged split");
    pool.shrink_blocks(2).unwrap();
    pool.grow_slots(1).unwrap();
    let r = path.build();
    assert!(matches!(r, Err(DecodeError::StaleBlock { seq: 0, .. })), "{r:?}");
}

#[test]
fn a_csa_pack_after_the_blocks_shrank_under_a_staged_table_is_refused() {
    // Seen failing before the fix: `pack_decode` (and the raw `csa_pack`) returned Ok after
    // the block region shrank under the staged tables, writing CSA rows of blocks that had
    // become gap or slot rows; `build` already refused the same batch.
    use v4pool::pool::{CsaTopk, TopkRows};
    let pool = decode_pool();
    let n = pool.counts().unwrap().num_blocks;
    let held: Vec<BlockHandle> = (0..n).map(|_| pool.alloc_block().unwrap().handle).collect();
    let table: Vec<i32> = held.iter().map(|h| h.id as i32).collect();
    let live = pool.geometry().unwrap().live_positions();
    let context_len = i64::from(n) * 256 - 48;
    let cap = DecodeCapacity::new(1, 1, n as usize, 8, 4);
    let mut path = pool.decode_path(cap).unwrap();
    let batch = [DecodeSeq::new(live.end - 1, context_len, 1, &table)];
    path.stage(&batch).unwrap();
    path.build().expect("a build at the staged split");
    let topk = CsaTopk::new(&pool, 1, 4).unwrap();
    let ids = [0i32, 1, 2, 3];
    topk.pack_decode(&path, TopkRows::I32(&ids), 4).expect("a pack at the staged split");
    for &h in &held[1..] {
        pool.free_block(h).unwrap();
    }
    pool.shrink_blocks(n - 1).unwrap();
    let r = topk.pack_decode(&path, TopkRows::I32(&ids), 4);
    assert!(
        matches!(r, Err(v4pool::pool::TopkError::Decode(DecodeError::StaleBlock { seq: 0, .. }))),
        "{r:?}"
    );
    assert!(matches!(path.build(), Err(DecodeError::StaleBlock { seq: 0, .. })));
}

#[test]
fn a_prefill_csa_pack_after_the_blocks_shrank_is_refused() {
    // Seen failing before the fix: as the decode pack, `pack_prefill` returned Ok.
    use v4pool::pool::{CsaTopk, TopkError, TopkRows};
    let pool = decode_pool();
    let path = staged_prefill(&pool);
    let topk = CsaTopk::new(&pool, 64, 4).unwrap();
    let ids: Vec<i32> = (0..10).flat_map(|_| [0, 1, 2, 3]).collect();
    topk.pack_prefill(&path, TopkRows::I32(&ids), 4).expect("a pack at the staged split");
    pool.shrink_blocks(2).unwrap();
    let r = topk.pack_prefill(&path, TopkRows::I32(&ids), 4);
    assert!(matches!(r, Err(TopkError::Decode(DecodeError::StaleBlock { seq: 0, .. }))), "{r:?}");
}
