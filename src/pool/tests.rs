//! The pool's state machine on the host backend, sized for Miri (`scripts/miri.sh`): slots
//! and blocks handed out, written, relocated by boundary moves, checkpointed and restored,
//! and two threads racing allocation against boundary moves. Miri checks every raw-pointer
//! copy and fill the host backend runs for them, and the locking for data races.

use super::{Pool, PoolError, PoolSpec};
use crate::arena::{ArenaLayout, Dtype, Fill, StateField};
use crate::backend::host::HostBackend;
use crate::backend::Stream;
use crate::sizing::IndexerDtype;
use crate::GeometrySpec;
use std::sync::Arc;

const WIDTHS: [u64; 2] = [32, 16];

/// A tiny pool: ratios [0,4,128], ring 2, one 4-row field a plane, `positions` slot positions.
fn tiny_pool(positions: i64, slots: i64) -> Pool {
    let field = |name: &str, fill| StateField {
        name: name.into(),
        layers: 1,
        shape: vec![4, 4],
        dtype: Dtype::F32,
        fill,
        carried: true,
        align: 256,
    };
    let arena =
        ArenaLayout::new(vec![field("kv", Fill::Zero), field("score", Fill::NegInf)], &WIDTHS).unwrap();
    let probe = GeometrySpec::new(vec![0, 4, 128], 0, 0, 2, 256)
        .arena_rows(arena.arena_rows())
        .slot_align_rows(arena.slot_align_rows())
        .build()
        .unwrap();
    let rows = positions * probe.slot_rows;
    let blocks = (positions - slots) * probe.slot_rows / probe.envelope_rows;
    let geometry = probe.with_capacity(blocks, slots, Some(rows)).unwrap();
    let spec = PoolSpec::new(geometry, WIDTHS.to_vec(), arena, Some(IndexerDtype::Fp8), vec![1]).unwrap();
    Pool::new(Arc::new(HostBackend::new()), spec, Stream::DEFAULT).unwrap()
}

/// Random bytes for a seed (the crate's one generator); equal seeds give equal bytes.
fn bytes(seed: u8, len: usize) -> Vec<u8> {
    crate::rng::Rng::new(u64::from(seed)).bytes(len)
}

#[test]
fn slots_and_blocks_keep_their_bytes_across_moves_and_checkpoints() {
    let pool = tiny_pool(12, 2);
    let g = pool.spec().geometry.clone();
    let a = pool.alloc_slot().unwrap();
    let b = pool.alloc_slot().unwrap();
    let blk = pool.alloc_block().unwrap().handle;
    let slot_len = g.slot_bytes(WIDTHS[1]) as usize;
    let block_len = g.block_bytes(WIDTHS[0]) as usize;
    pool.write_slot(b.handle, 1, 0, &bytes(7, slot_len)).unwrap();
    pool.write_block(blk, 0, 0, &bytes(9, block_len)).unwrap();
    // Free slot a, shrink by one: b (the top group) moves into a's group.
    pool.free_slot(a.handle).unwrap();
    let change = pool.shrink_slots(1).unwrap();
    let moved = change.slot_moves.first().map_or(b.handle, |m| m.new);
    let mut back = vec![0u8; slot_len];
    pool.read_slot(moved, 1, 0, &mut back).unwrap();
    assert_eq!(back, bytes(7, slot_len));
    // Grow the slots back: the new position's state is initialised, the block kept.
    let change = pool.grow_slots(1).unwrap();
    let blk = change.block_moves.iter().find(|m| m.old == blk).map_or(blk, |m| m.new);
    let mut back = vec![0u8; block_len];
    pool.read_block(blk, 0, 0, &mut back).unwrap();
    assert_eq!(back, bytes(9, block_len));
    // Checkpoint the moved slot, restore it into a fresh one: same image.
    let image = pool.checkpoint(moved).unwrap();
    let c = pool.alloc_slot().unwrap();
    pool.restore(c.handle, &image).unwrap();
    assert_eq!(pool.checkpoint(c.handle).unwrap(), image);
    assert!(matches!(pool.init_positions(-1..0), Err(PoolError::NotLive { .. })));
    assert!(matches!(pool.block_copy_runs(u32::MAX, 0), Err(PoolError::NoSuchBlock { .. })));
}

#[test]
fn allocation_races_boundary_moves_without_losing_bytes() {
    let pool = Arc::new(tiny_pool(12, 1));
    let slot_len = pool.spec().geometry.slot_bytes(WIDTHS[0]) as usize;
    let mover = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for i in 0..6 {
                let _ = if i % 2 == 0 { pool.grow_slots(1) } else { pool.shrink_slots(1) };
            }
        })
    };
    for i in 0..6u8 {
        // A slot handed out while the boundary moves is initialised before it is handed
        // out, so the holder's write is never wiped; a pinned-by-holding slot is not moved
        // by a shrink that has a vacant group below (here: none is freed meanwhile).
        if let Ok(lease) = pool.alloc_slot() {
            let want = bytes(i, slot_len);
            let r = pool.write_slot(lease.handle, 0, 0, &want);
            let mut back = vec![0u8; slot_len];
            if r.is_ok() && pool.read_slot(lease.handle, 0, 0, &mut back).is_ok() {
                assert_eq!(back, want);
            }
            let _ = pool.free_slot(lease.handle);
        }
    }
    mover.join().unwrap();
}
