//! The allocator hot path: no heap allocation in steady state (checked here, in every run) and
//! its speed (an ignored test; run `cargo test --release --test layout alloc_speed:: --
//! --ignored --nocapture`). Its counting allocator is the `layout` suite's global allocator:
//! it counts per thread and forwards every call to the system allocator unchanged, so the
//! suite's other tests neither see it nor move its counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::time::Instant;

use v4pool::raw::alloc::{BlockHandle, BlockPool, SlotPool};
// The tests' generator, reached directly: this file counts allocations and needs no more.
use v4pool::sim::Rng;

/// Counts allocations made by the current thread (other test threads do not interfere).
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a
// const-initialised thread-local Cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    // Forwarded, not left to the default (`alloc` and then zeroing every byte): a large zeroed
    // allocation must stay lazily committed, as the system allocator gives it, for the
    // suite's other tests (host_backend_memory reads the resident set after one of 4 GiB).
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// A pool half held, then random frees and allocations, some blocks published so the cached
/// queue turns too.
fn churn(pool: &mut BlockPool, held: &mut Vec<BlockHandle>, rounds: usize, rng: &mut Rng) {
    for _ in 0..rounds {
        let i = (rng.next_u64() % held.len() as u64) as usize;
        let h = held.swap_remove(i);
        if rng.next_u64() % 4 == 0 {
            pool.publish_handle(h, rng.next_u64() % 1024, 256).unwrap();
        }
        pool.free_handle(h).unwrap();
        held.push(black_box(pool.alloc().unwrap()).handle);
    }
}

#[test]
fn steady_state_alloc_and_free_do_not_allocate() {
    let mut pool = BlockPool::new(4096).unwrap();
    let mut held: Vec<BlockHandle> = (0..2048).map(|_| pool.alloc().unwrap().handle).collect();
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    // Warm up: the prefix index reaches its size, the queues their capacity.
    churn(&mut pool, &mut held, 50_000, &mut rng);
    let before = allocs();
    churn(&mut pool, &mut held, 50_000, &mut rng);
    // Publishing a hash into the warmed index may still rehash rarely; alloc and free alone
    // must not allocate at all.
    let mid = allocs();
    for _ in 0..50_000 {
        let h = pool.alloc().unwrap().handle;
        pool.free_handle(h).unwrap();
    }
    assert_eq!(allocs(), mid, "alloc/free allocated");
    assert!(mid - before <= 2, "churn allocated {} times", mid - before);

    let mut slots = SlotPool::new(256).unwrap();
    let hs: Vec<_> = (0..128).map(|_| slots.alloc().unwrap()).collect();
    for h in hs {
        slots.free_handle(h).unwrap();
    }
    let before = allocs();
    for _ in 0..10_000 {
        let h = slots.alloc().unwrap();
        slots.free_handle(h).unwrap();
    }
    assert_eq!(allocs(), before, "slot alloc/free allocated");
}

#[test]
#[ignore = "timing; run in release"]
fn alloc_free_speed() {
    for &n in &[1024u32, 131_072] {
        let mut pool = BlockPool::new(n).unwrap();
        let iters = 2_000_000u32;
        // Best case: one block in and out (the lowest vacant id); best of three runs.
        let mut one = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            for _ in 0..iters {
                let h = pool.alloc().unwrap().handle;
                pool.free_handle(black_box(h)).unwrap();
            }
            one = one.min(t.elapsed().as_nanos() as f64 / f64::from(iters));
        }
        // Realistic: half the pool held, random frees and allocations.
        let mut held: Vec<BlockHandle> = (0..n / 2).map(|_| pool.alloc().unwrap().handle).collect();
        let mut rng = Rng::new(0x2545_F491_4F6C_DD1D);
        let t = Instant::now();
        churn(&mut pool, &mut held, iters as usize, &mut rng);
        let mixed = t.elapsed().as_nanos() as f64 / f64::from(iters);
        let mut slots = SlotPool::new(n).unwrap();
        let mut slot = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            for _ in 0..iters {
                let h = slots.alloc().unwrap();
                slots.free_handle(black_box(h)).unwrap();
            }
            slot = slot.min(t.elapsed().as_nanos() as f64 / f64::from(iters));
        }
        println!(
            "{n} blocks: alloc+free {one:.1} ns; random churn (free+alloc, 1/4 published) {mixed:.1} ns; slot alloc+free {slot:.1} ns"
        );
    }
}
