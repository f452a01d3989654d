//! Concurrency stress of the host pool: worker threads allocate slots and blocks, write a
//! pattern over every byte of them, read it back and free them, while a mover thread grows and
//! shrinks the boundary (relocating held slots and blocks) the whole time. Every byte a worker
//! wrote must read back intact wherever its slot or block has moved; a slot handed out just
//! after a boundary move must not be wiped by that move's state initialisation.
//!
//! Holders learn where their slot or block went from the moves the mover publishes (as an
//! engine re-points its requests from a `BoundaryChange`); a handle relocated away is stale
//! until then, and the worker waits for the move to be published.
//!
//! Workers run for `V4POOL_STRESS_SECS` seconds (default 5) and at least until the mover has
//! relocated held slots and blocks a few times.

use crate::pool_common;

use pool_common::{pattern, small_pool, WIDTHS};
// The tests' generator (`tests/common` wraps it; this binary does not load `common`).
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use v4pool::checkpoint::CheckpointImage;
use v4pool::pool::{BlockHandle, SlotHandle};
use v4pool::pool::{Pool, PoolError};
use v4pool::sim::Rng;

const WORKERS: u64 = 4;
const POSITIONS: i64 = 40;

/// Where relocated handles went, as the mover publishes them.
#[derive(Default)]
struct Forward {
    slots: Mutex<HashMap<SlotHandle, SlotHandle>>,
    blocks: Mutex<HashMap<BlockHandle, BlockHandle>>,
}

/// Run `op` on the current handle of what `h` was, following published moves; a stale handle
/// whose move is not published yet is retried (the mover publishes right after the move).
fn with_current<H: Copy + Eq + std::hash::Hash + std::fmt::Debug>(
    h: &mut H,
    map: &Mutex<HashMap<H, H>>,
    mut op: impl FnMut(H) -> Result<(), PoolError>,
) {
    for _ in 0..1_000_000 {
        match op(*h) {
            Ok(()) => return,
            Err(PoolError::Alloc(_)) => match map.lock().unwrap().get(h) {
                Some(&next) => *h = next,
                None => std::thread::yield_now(),
            },
            Err(e) => panic!("{h:?}: {e}"),
        }
    }
    panic!("{h:?}: stale and never forwarded");
}

struct Held<H> {
    handle: H,
    /// Per plane, the bytes written over the whole slot or block.
    bytes: Vec<Vec<u8>>,
    /// A slot's checkpoint image, taken right after the write.
    image: Option<CheckpointImage>,
}

fn worker(pool: &Pool, fwd: &Forward, k: u64, stop: &AtomicBool, checked: &AtomicU64) {
    let g = pool.spec().geometry.clone();
    let slot_len: Vec<usize> = WIDTHS.iter().map(|&w| g.slot_bytes(w) as usize).collect();
    let block_len: Vec<usize> = WIDTHS.iter().map(|&w| g.block_bytes(w) as usize).collect();
    let mut slots: Vec<Held<SlotHandle>> = Vec::new();
    let mut blocks: Vec<Held<BlockHandle>> = Vec::new();
    let mut rng = Rng::new(k);
    let mut next = move || rng.next_u64();
    let verify_slot = |s: &mut Held<SlotHandle>| {
        for (p, want) in s.bytes.iter().enumerate() {
            let mut got = vec![0u8; want.len()];
            with_current(&mut s.handle, &fwd.slots, |h| pool.read_slot(h, p, 0, &mut got));
            assert!(got == *want, "worker {k}: slot {:?} plane {p} lost bytes", s.handle);
        }
        checked.fetch_add(1, Ordering::Relaxed);
    };
    let verify_block = |b: &mut Held<BlockHandle>| {
        for (p, want) in b.bytes.iter().enumerate() {
            let mut got = vec![0u8; want.len()];
            with_current(&mut b.handle, &fwd.blocks, |h| pool.read_block(h, p, 0, &mut got));
            assert!(got == *want, "worker {k}: block {:?} plane {p} lost bytes", b.handle);
        }
        checked.fetch_add(1, Ordering::Relaxed);
    };
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let seed = (k << 40) | i;
        match next() % 7 {
            0 if slots.len() < 5 => {
                if let Ok(lease) = pool.alloc_slot() {
                    let mut s = Held { handle: lease.handle, bytes: Vec::new(), image: None };
                    for (p, &len) in slot_len.iter().enumerate() {
                        let bytes = pattern(seed ^ p as u64, len);
                        with_current(&mut s.handle, &fwd.slots, |h| pool.write_slot(h, p, 0, &bytes));
                        s.bytes.push(bytes);
                    }
                    let mut image = None;
                    with_current(&mut s.handle, &fwd.slots, |h| {
                        image = Some(pool.checkpoint(h)?);
                        Ok(())
                    });
                    s.image = image;
                    slots.push(s);
                }
            }
            1 if blocks.len() < 5 => {
                if let Ok(grant) = pool.alloc_block() {
                    let mut b = Held { handle: grant.handle, bytes: Vec::new(), image: None };
                    for (p, &len) in block_len.iter().enumerate() {
                        let bytes = pattern(seed ^ (p as u64 + 7), len);
                        with_current(&mut b.handle, &fwd.blocks, |h| pool.write_block(h, p, 0, &bytes));
                        b.bytes.push(bytes);
                    }
                    blocks.push(b);
                }
            }
            2 if !slots.is_empty() => {
                let n = (next() % slots.len() as u64) as usize;
                let mut s = slots.swap_remove(n);
                verify_slot(&mut s);
                with_current(&mut s.handle, &fwd.slots, |h| pool.free_slot(h));
            }
            3 if !blocks.is_empty() => {
                let n = (next() % blocks.len() as u64) as usize;
                let mut b = blocks.swap_remove(n);
                verify_block(&mut b);
                with_current(&mut b.handle, &fwd.blocks, |h| pool.free_block(h));
            }
            // Checkpoint and restore a held slot in place: the image is the one taken after
            // the write, and the restore leaves the slot as it was, wherever it has moved.
            4 if !slots.is_empty() => {
                let n = (next() % slots.len() as u64) as usize;
                let s = &mut slots[n];
                let want = s.image.clone().expect("image");
                let mut got = None;
                with_current(&mut s.handle, &fwd.slots, |h| {
                    got = Some(pool.checkpoint(h)?);
                    Ok(())
                });
                assert!(got.as_ref() == Some(&want), "worker {k}: slot {:?} checkpoint changed", s.handle);
                with_current(&mut s.handle, &fwd.slots, |h| pool.restore(h, &want));
                verify_slot(s);
            }
            _ => {
                slots.iter_mut().for_each(verify_slot);
                blocks.iter_mut().for_each(verify_block);
            }
        }
    }
    for mut s in slots {
        verify_slot(&mut s);
        with_current(&mut s.handle, &fwd.slots, |h| pool.free_slot(h));
    }
    for mut b in blocks {
        verify_block(&mut b);
        with_current(&mut b.handle, &fwd.blocks, |h| pool.free_block(h));
    }
}

/// Move the boundary at random until told to stop, counting moves applied and slots and
/// blocks relocated.
fn mover(pool: &Pool, fwd: &Forward, stop: &AtomicBool, applied: &AtomicU64, relocated: &AtomicU64) {
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    while !stop.load(Ordering::Relaxed) {
        let x = rng.next_u64();
        let n = (x >> 32) as u32 % 3 + 1;
        let c = pool.counts().expect("counts");
        let (held_slots, held_blocks) = (c.num_slots - c.free_slots, c.num_blocks - c.free_blocks);
        // Shrinks cut to just above what is held, so held tops have to move.
        let r = match x % 6 {
            0 => pool.grow_slots(n),
            1 => pool.resize(c.num_blocks, (held_slots + n - 1).min(c.num_slots)),
            2 => pool.grow_blocks(n * 4),
            3 => pool.resize((held_blocks + n - 1).min(c.num_blocks), c.num_slots),
            4 => pool.grow_blocks_shrinking_slots(n * 4),
            _ => pool.shrink_slots(n),
        };
        match r {
            Ok(change) => {
                applied.fetch_add(1, Ordering::Relaxed);
                relocated.fetch_add(
                    (change.slot_moves.len() + change.block_moves.len()) as u64,
                    Ordering::Relaxed,
                );
                fwd.slots.lock().unwrap().extend(change.slot_moves.iter().map(|m| (m.old, m.new)));
                fwd.blocks.lock().unwrap().extend(change.block_moves.iter().map(|m| (m.old, m.new)));
                // Let the workers allocate into what the move freed.
                std::thread::yield_now();
            }
            // A refused move changes nothing (no room, nowhere to relocate to).
            Err(PoolError::Boundary(_)) => {}
            Err(e) => panic!("mover: {e}"),
        }
    }
}

#[test]
fn bytes_survive_concurrent_allocation_and_boundary_moves() {
    let secs: f64 = std::env::var("V4POOL_STRESS_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(5.0);
    let pool = Arc::new(small_pool(POSITIONS, 12));
    let fwd = Arc::new(Forward::default());
    let (stop_mover, stop_workers) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let [checked, applied, relocated] = [(); 3].map(|()| Arc::new(AtomicU64::new(0)));
    let mv = {
        let (pool, fwd, stop, a, r) =
            (pool.clone(), fwd.clone(), stop_mover.clone(), applied.clone(), relocated.clone());
        std::thread::spawn(move || mover(&pool, &fwd, &stop, &a, &r))
    };
    let workers: Vec<_> = (0..WORKERS)
        .map(|k| {
            let (pool, fwd, stop, checked) =
                (pool.clone(), fwd.clone(), stop_workers.clone(), checked.clone());
            std::thread::spawn(move || worker(&pool, &fwd, k, &stop, &checked))
        })
        .collect();
    // Run for the time asked, and on until held things were relocated a few times (a
    // minute at most: a starved mover must not hang the test).
    let start = std::time::Instant::now();
    while start.elapsed().as_secs_f64() < secs
        || (relocated.load(Ordering::Relaxed) < 100 && start.elapsed().as_secs() < 60)
    {
        if workers.iter().any(|w| w.is_finished()) {
            break; // a worker failed: stop and report it
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    stop_workers.store(true, Ordering::Relaxed);
    let mut failed = None;
    for w in workers {
        if let Err(e) = w.join() {
            failed.get_or_insert(e);
        }
    }
    stop_mover.store(true, Ordering::Relaxed);
    mv.join().expect("mover");
    if let Some(e) = failed {
        std::panic::resume_unwind(e);
    }
    let c = pool.counts().expect("counts");
    let (applied, relocated) = (applied.load(Ordering::Relaxed), relocated.load(Ordering::Relaxed));
    println!(
        "{WORKERS} workers for {:.1} s: {} holdings verified; {applied} boundary moves, {relocated} relocations",
        start.elapsed().as_secs_f64(),
        checked.load(Ordering::Relaxed)
    );
    assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "everything was freed");
    assert!(
        relocated >= 20,
        "the mover must have relocated held things ({applied} moves, {relocated} relocations)"
    );
}
