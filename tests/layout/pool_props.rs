//! State-machine property tests of the host pool: random sequences of allocate / free /
//! write a pattern / grow / shrink / relocate / checkpoint / restore. After every step no
//! live block overlaps a live slot or another block, every byte written into a live block or
//! slot is still there, and every invalid operation returns an error and changes nothing.

use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use v4pool::backend::Backend;
use v4pool::pool::BoundaryChange;
use v4pool::pool::Pool;
use v4pool::pool::{BlockHandle, SlotHandle};

use crate::pool_common;
use pool_common::{pattern, read, WIDTHS};

const POSITIONS: i64 = 12;

/// A small pool: ratios [0,4,128,4,128,0], ring 11, a 3-field arena in two planes.
fn small_pool(initial_slots: i64) -> Pool {
    pool_common::small_pool(POSITIONS, initial_slots)
}

fn small_pool_on(backend: Arc<dyn Backend>, initial_slots: i64) -> Pool {
    pool_common::small_pool_on(backend, POSITIONS, initial_slots)
}

/// Bytes of a block in both planes (its envelope rows).
fn block_ranges(pool: &Pool, id: u32) -> Vec<(usize, u64, u64)> {
    let g = &pool.spec().geometry;
    WIDTHS.iter().enumerate().map(|(p, &w)| (p, u64::from(id) * g.block_bytes(w), g.block_bytes(w))).collect()
}

/// Bytes of a slot position in both planes.
fn slot_ranges(pool: &Pool, position: i64) -> Vec<(usize, u64, u64)> {
    let g = &pool.spec().geometry;
    let (start, _) = g.slot_span(position).expect("position");
    WIDTHS.iter().enumerate().map(|(p, &w)| (p, start as u64 * w, g.slot_bytes(w))).collect()
}

fn write(pool: &Pool, ranges: &[(usize, u64, u64)], bytes: &[u8]) {
    let mut at = 0usize;
    for &(p, off, len) in ranges {
        pool.write_plane(p, off, &bytes[at..at + len as usize]).expect("write");
        at += len as usize;
    }
}

#[derive(Clone, Debug)]
enum Op {
    AllocBlock,
    FreeBlock(usize),
    DoubleFreeBlock(usize),
    AllocSlot,
    FreeSlot(usize),
    StaleSlot(usize),
    GrowSlots(u32),
    ShrinkSlots(u32),
    GrowBlocks(u32),
    GrowBlocksShrinkingSlots(u32),
    ShrinkBlocks(u32),
    CheckpointRestore(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::AllocBlock),
        2 => any::<usize>().prop_map(Op::FreeBlock),
        1 => any::<usize>().prop_map(Op::DoubleFreeBlock),
        3 => Just(Op::AllocSlot),
        2 => any::<usize>().prop_map(Op::FreeSlot),
        1 => any::<usize>().prop_map(Op::StaleSlot),
        2 => (1u32..4).prop_map(Op::GrowSlots),
        2 => (1u32..4).prop_map(Op::ShrinkSlots),
        2 => (1u32..20).prop_map(Op::GrowBlocks),
        1 => (1u32..20).prop_map(Op::GrowBlocksShrinkingSlots),
        2 => (1u32..20).prop_map(Op::ShrinkBlocks),
        1 => any::<usize>().prop_map(Op::CheckpointRestore),
    ]
}

struct Model {
    blocks: Vec<(BlockHandle, Vec<u8>)>,
    slots: Vec<(SlotHandle, i64, Vec<u8>)>,
    freed_blocks: Vec<BlockHandle>,
    freed_slots: Vec<SlotHandle>,
    seed: u64,
}

impl Model {
    fn apply(&mut self, ch: &BoundaryChange) {
        for m in &ch.block_moves {
            let b = self.blocks.iter_mut().find(|b| b.0 == m.old).expect("moved block is held");
            b.0 = m.new;
        }
        for m in &ch.slot_moves {
            let s = self.slots.iter_mut().find(|s| s.0 == m.old).expect("moved slot is held");
            assert_eq!(s.1, m.from_position);
            s.0 = m.new;
            s.1 = m.to_position;
        }
    }
}

fn snapshot(pool: &Pool) -> (u32, u32, u32, u32, u32) {
    let c = pool.counts().expect("counts");
    (c.num_blocks, c.num_slots, c.free_blocks, c.free_slots, c.max_blocks)
}

fn check(pool: &Pool, model: &Model) {
    let g = pool.spec().geometry.clone();
    let c = pool.counts().expect("counts");
    let slot_floor = (g.slot_positions - i64::from(c.num_slots)) * g.slot_rows;
    assert!(i64::from(c.num_blocks) * g.envelope_rows <= slot_floor, "blocks reach into the slot region");
    let mut ids = HashMap::new();
    for (h, bytes) in &model.blocks {
        assert!(h.id < c.num_blocks, "live block {} >= num_blocks {}", h.id, c.num_blocks);
        assert!(ids.insert(h.id, ()).is_none(), "two holders share block {}", h.id);
        pool.check_block(*h).expect("held handle is current");
        assert_eq!(&read(pool, &block_ranges(pool, h.id)), bytes, "block {} lost bytes", h.id);
    }
    let mut positions = HashMap::new();
    for (h, pos, bytes) in &model.slots {
        assert_eq!(pool.slot_position(*h).expect("held slot"), *pos);
        assert!(pool.spec().geometry.slot_positions - i64::from(c.num_slots) <= *pos);
        assert!(positions.insert(*pos, ()).is_none(), "two slots at position {pos}");
        assert_eq!(&read(pool, &slot_ranges(pool, *pos)), bytes, "slot at {pos} lost bytes");
    }
}

fn run(ops: Vec<Op>, initial_slots: i64) {
    run_on(small_pool(initial_slots), ops);
}

fn run_on(pool: Pool, ops: Vec<Op>) {
    let mut m = Model { blocks: vec![], slots: vec![], freed_blocks: vec![], freed_slots: vec![], seed: 1 };
    let image_bytes = pool.checkpoint_image_bytes().expect("image bytes") as usize;
    for op in ops {
        m.seed += 1;
        let before = snapshot(&pool);
        match op {
            Op::AllocBlock => match pool.alloc_block() {
                Ok(grant) => {
                    let r = block_ranges(&pool, grant.handle.id);
                    let bytes = pattern(m.seed, r.iter().map(|x| x.2 as usize).sum());
                    write(&pool, &r, &bytes);
                    m.blocks.push((grant.handle, bytes));
                }
                Err(_) => {
                    assert_eq!(before.2, 0, "alloc_block failed with free blocks");
                    assert_eq!(snapshot(&pool), before);
                }
            },
            Op::FreeBlock(i) if !m.blocks.is_empty() => {
                let (h, _) = m.blocks.swap_remove(i % m.blocks.len());
                pool.free_block(h).expect("free held block");
                m.freed_blocks.push(h);
            }
            Op::DoubleFreeBlock(i) if !m.freed_blocks.is_empty() => {
                let h = m.freed_blocks[i % m.freed_blocks.len()];
                assert!(pool.free_block(h).is_err(), "double free accepted");
                assert!(pool.check_block(h).is_err(), "use after free accepted");
                assert_eq!(snapshot(&pool), before);
            }
            Op::AllocSlot => match pool.alloc_slot() {
                Ok(lease) => {
                    let r = slot_ranges(&pool, lease.position);
                    let bytes = pattern(m.seed, r.iter().map(|x| x.2 as usize).sum());
                    write(&pool, &r, &bytes);
                    m.slots.push((lease.handle, lease.position, bytes));
                }
                Err(_) => {
                    assert_eq!(before.3, 0, "alloc_slot failed with free slots");
                    assert_eq!(snapshot(&pool), before);
                }
            },
            Op::FreeSlot(i) if !m.slots.is_empty() => {
                let (h, _, _) = m.slots.swap_remove(i % m.slots.len());
                pool.free_slot(h).expect("free held slot");
                m.freed_slots.push(h);
            }
            Op::StaleSlot(i) if !m.freed_slots.is_empty() => {
                let h = m.freed_slots[i % m.freed_slots.len()];
                assert!(pool.free_slot(h).is_err(), "double free of a slot accepted");
                assert!(pool.slot_position(h).is_err(), "stale slot handle resolved");
                assert_eq!(snapshot(&pool), before);
            }
            Op::GrowSlots(n)
            | Op::ShrinkSlots(n)
            | Op::GrowBlocks(n)
            | Op::GrowBlocksShrinkingSlots(n)
            | Op::ShrinkBlocks(n) => {
                let r = match op {
                    Op::GrowSlots(_) => pool.grow_slots(n),
                    Op::ShrinkSlots(_) => pool.shrink_slots(n),
                    Op::GrowBlocks(_) => pool.grow_blocks(n),
                    Op::GrowBlocksShrinkingSlots(_) => pool.grow_blocks_shrinking_slots(n),
                    _ => pool.shrink_blocks(n),
                };
                match r {
                    Ok(ch) => m.apply(&ch),
                    Err(_) => assert_eq!(snapshot(&pool), before, "a refused move changed the split"),
                }
            }
            Op::CheckpointRestore(i) if !m.slots.is_empty() => {
                // Checkpoint slot A, restore into a fresh slot B: B's image ranges equal A's,
                // and every byte of B outside them is what B held before.
                let a = i % m.slots.len();
                let image = pool.checkpoint(m.slots[a].0).expect("checkpoint");
                assert_eq!(image.bytes().len(), image_bytes);
                if let Ok(lease) = pool.alloc_slot() {
                    let r = slot_ranges(&pool, lease.position);
                    let before_b = read(&pool, &r);
                    pool.restore(lease.handle, &image).expect("restore");
                    let after_b = read(&pool, &r);
                    let ranges = pool.checkpoint_ranges().expect("ranges");
                    let mut expect = before_b.clone();
                    let src = &m.slots[a].2;
                    let mut plane_base = 0usize;
                    for (p, pr) in ranges.iter().enumerate() {
                        for &(off, len) in pr {
                            let (o, l) = (plane_base + off as usize, len as usize);
                            expect[o..o + l].copy_from_slice(&src[o..o + l]);
                        }
                        plane_base += r[p].2 as usize;
                    }
                    assert_eq!(after_b, expect, "restore wrote outside its ranges or missed bytes");
                    m.slots.push((lease.handle, lease.position, after_b));
                }
            }
            _ => {}
        }
        check(&pool, &m);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 150 } else { 1000 }))]
    #[test]
    fn nothing_lost_across_random_sequences(ops in prop::collection::vec(op(), 1..60), slots in 0i64..6) {
        run(ops, slots);
    }
}

#[test]
fn a_handle_from_another_pool_is_refused() {
    let a = small_pool(2);
    let b = small_pool(2);
    let hb = b.alloc_block().expect("block").handle;
    let before = snapshot(&a);
    assert!(a.free_block(hb).is_err());
    assert!(a.check_block(hb).is_err());
    let sb = b.alloc_slot().expect("slot").handle;
    assert!(a.free_slot(sb).is_err());
    assert_eq!(snapshot(&a), before);
}

#[test]
fn a_new_slot_has_initialised_state_even_over_old_block_bytes() {
    // Give the slot region's rows to blocks, scribble, then take them back as a slot: the
    // arena must read 0 / -inf, not block bytes.
    let pool = small_pool(0);
    let c = pool.counts().expect("counts");
    let g = pool.spec().geometry.clone();
    let top = c.num_blocks - 1;
    let r = block_ranges(&pool, top);
    write(&pool, &r, &pattern(99, r.iter().map(|x| x.2 as usize).sum()));
    pool.shrink_blocks(c.num_blocks - g.max_blocks_beside(1) as u32).expect("shrink");
    pool.grow_slots(1).expect("grow");
    let lease = pool.alloc_slot().expect("slot");
    let (ptr, view) = pool.state_view("csa_score").expect("view");
    let plane = pool.plane_ptr(view.plane).expect("plane");
    let mut word = [0u8; 4];
    let off = ptr - plane + lease.position as u64 * view.strides[1] * 4;
    pool.read_plane(view.plane, off, &mut word).expect("read");
    assert_eq!(f32::from_ne_bytes(word), f32::NEG_INFINITY);
}

/// The same state machine on a GPU backend (CUDA, or HIP with `V4POOL_BACKEND=hip`): the
/// pool's copies, fills and checkpoints run as device kernels there. Skips without a device;
/// fails instead with `V4POOL_REQUIRE_GPU=1`.
#[test]
fn nothing_lost_on_the_gpu() {
    let hip = std::env::var("V4POOL_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("hip"));
    let kind = if hip { v4pool::backend::BackendKind::Hip } else { v4pool::backend::BackendKind::Cuda };
    let backend = match v4pool::backend::open(kind) {
        Ok(b) => b,
        Err(e) => {
            assert!(
                !std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1"),
                "V4POOL_REQUIRE_GPU=1 but no {kind} device: {e}"
            );
            println!("SKIP: no {kind} device ({e}) in nothing_lost_on_the_gpu");
            return;
        }
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(&(prop::collection::vec(op(), 1..60), 0i64..6), |(ops, slots)| {
            run_on(small_pool_on(backend.clone(), slots), ops);
            Ok(())
        })
        .expect("state machine on the device");
}

/// Checkpoints and restores from several threads at once: each thread's descriptor upload
/// and launch stay paired, so every image comes back exactly.
#[test]
fn concurrent_checkpoints_stay_exact() {
    let pool = Arc::new(small_pool(8));
    let image_bytes = pool.checkpoint_image_bytes().expect("image bytes") as usize;
    let handles: Vec<_> = (0..4u64)
        .map(|k| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let a = pool.alloc_slot().expect("slot a");
                let b = pool.alloc_slot().expect("slot b");
                for i in 0..100u64 {
                    let r = slot_ranges(&pool, a.position);
                    write(&pool, &r, &pattern(k * 1000 + i, r.iter().map(|x| x.2 as usize).sum()));
                    let image = pool.checkpoint(a.handle).expect("checkpoint");
                    assert_eq!(image.bytes().len(), image_bytes);
                    pool.restore(b.handle, &image).expect("restore");
                    let back = pool.checkpoint(b.handle).expect("checkpoint b");
                    assert_eq!(image, back, "thread {k} round {i}: image changed on its way");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread");
    }
}
