//! The host tier on the host backend: random sequences of spill / restore / evict / touch
//! against a model of what each key holds and of the recency order. Restored units are
//! byte-exact (every plane and indexer layer, random bytes), evictions follow LRU exactly,
//! an entry larger than the budget is refused without evicting anything, and a restore
//! without room leaves the pool and the tier as they were.

use crate::common;
use crate::transfer_common;

use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use transfer_common::*;
use v4pool::backend::host::HostBackend;
use v4pool::model::ModelShape;
use v4pool::pool::BlockHandle;
use v4pool::pool::Pool;
use v4pool::transfer::{HostTier, HostTierError};

#[derive(Clone, Debug)]
enum Op {
    /// Spill `n` freshly written blocks under a new key.
    Spill(usize, u64),
    /// Restore the i-th held key (mod count).
    Restore(usize),
    Evict(usize),
    Touch(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..7, any::<u64>()).prop_map(|(n, s)| Op::Spill(n, s)),
        3 => (0usize..8).prop_map(Op::Restore),
        1 => (0usize..8).prop_map(Op::Evict),
        1 => (0usize..8).prop_map(Op::Touch),
    ]
}

fn pool() -> Pool {
    pool_kv(v4pool::sizing::KvDtype::Fp8)
}

fn pool_kv(kv: v4pool::sizing::KvDtype) -> Pool {
    // Small V4-Flash pool: 10 blocks; the tier holds 5 units.
    pool_of(Arc::new(HostBackend::new()), &ModelShape::v4_flash(1).unwrap(), kv, 10, 1).0
}

fn bytes(seed: u64, n: usize) -> Vec<u8> {
    common::Rng::new(seed).bytes(n)
}

fn run(ops: Vec<Op>) {
    run_on(pool(), ops)
}

fn run_on(pool: Pool, ops: Vec<Op>) {
    let mut tier: HostTier<u64> = HostTier::new(&pool, 0).unwrap();
    assert_eq!(tier.capacity_units(), 0);
    let unit = HostTier::<u64>::new(&pool, 1).unwrap().unit_bytes();
    tier = HostTier::new(&pool, unit * 5 + unit / 2).unwrap();
    assert_eq!(tier.capacity_units(), 5);
    // Model: key → bytes per unit; recency oldest first.
    let mut held: HashMap<u64, Vec<Vec<u8>>> = HashMap::new();
    let mut lru: Vec<u64> = Vec::new();
    let mut next_key = 0u64;
    for op in ops {
        match op {
            Op::Spill(n, seed) => {
                let free = pool.counts().unwrap().free_blocks as usize;
                let n = n.min(free);
                let blocks: Vec<BlockHandle> = (0..n).map(|_| pool.alloc_block().unwrap().handle).collect();
                let data: Vec<Vec<u8>> = blocks
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let r = block_ranges(&pool, b.id);
                        let d = bytes(seed ^ ((i as u64 + 1) * 0x9e37_79b9), total(&r));
                        write(&pool, &r, &d);
                        d
                    })
                    .collect();
                let key = next_key;
                next_key += 1;
                let r = tier.spill(&pool, key, &blocks);
                if n as u64 > tier.capacity_units() {
                    assert!(matches!(r, Err(HostTierError::TooLarge { .. })));
                } else {
                    let evicted = r.unwrap();
                    // LRU: the oldest entries, just enough of them.
                    let mut want = Vec::new();
                    let mut used: usize = held.values().map(Vec::len).sum();
                    while used + n > 5 {
                        let k = lru.remove(0);
                        used -= held.remove(&k).unwrap().len();
                        want.push(k);
                    }
                    assert_eq!(evicted, want);
                    held.insert(key, data);
                    lru.push(key);
                }
                // The pool's copies are scratch now: poison them and give them back.
                for b in blocks {
                    let r = block_ranges(&pool, b.id);
                    write(&pool, &r, &bytes(!seed, total(&r)));
                    pool.free_block(b).unwrap();
                }
            }
            Op::Restore(i) | Op::Evict(i) | Op::Touch(i) if lru.is_empty() => {
                let _ = i;
                assert!(matches!(tier.restore(&pool, &u64::MAX), Err(HostTierError::NotHeld)));
            }
            Op::Restore(i) => {
                let key = lru[i % lru.len()];
                let before = pool.counts().unwrap();
                // Take away room so some restores must be refused without a trace.
                let hog: Vec<BlockHandle> =
                    (0..(i % 3) * 4).filter_map(|_| pool.alloc_block().ok()).map(|g| g.handle).collect();
                let free = pool.counts().unwrap().free_blocks as usize;
                let need = held[&key].len();
                match tier.restore(&pool, &key) {
                    Ok(blocks) => {
                        assert!(need <= free);
                        let want = held.remove(&key).unwrap();
                        lru.retain(|&k| k != key);
                        assert_eq!(blocks.len(), want.len());
                        for (b, w) in blocks.iter().zip(&want) {
                            assert!(read(&pool, &block_ranges(&pool, b.id)) == *w, "restored bytes differ");
                        }
                        for b in blocks {
                            pool.free_block(b).unwrap();
                        }
                    }
                    Err(HostTierError::NoRoom { units, .. }) => {
                        assert!(need > free);
                        assert_eq!(units, need);
                        assert!(tier.contains(&key));
                        assert_eq!(pool.counts().unwrap().free_blocks as usize, free);
                    }
                    Err(e) => panic!("{e}"),
                }
                for b in hog {
                    pool.free_block(b).unwrap();
                }
                assert_eq!(pool.counts().unwrap().free_blocks, before.free_blocks);
            }
            Op::Evict(i) => {
                let key = lru.remove(i % lru.len());
                held.remove(&key);
                assert!(tier.evict(&key));
                assert!(!tier.evict(&key));
            }
            Op::Touch(i) => {
                let key = lru.remove(i % lru.len());
                lru.push(key);
                assert!(tier.touch(&key));
            }
        }
        assert_eq!(tier.lru_order(), lru);
        assert_eq!(tier.used_units() as usize, held.values().map(Vec::len).sum::<usize>());
        for (k, v) in &held {
            assert_eq!(tier.units_of(k), Some(v.len()));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn spill_and_restore_are_byte_exact_and_lru(ops in prop::collection::vec(op(), 1..40)) {
        run(ops);
    }
}

#[test]
fn spill_and_restore_are_byte_exact_in_flashmla_v4_paged_rows() {
    // A block is whole 584-B pages: its unit is the same contiguous range as in a uniform plane.
    for kv in [v4pool::sizing::KvDtype::FlashMlaV4, v4pool::sizing::KvDtype::FlashMlaV4P2] {
        run_on(
            pool_kv(kv),
            vec![
                Op::Spill(1, 1),
                Op::Spill(2, 2),
                Op::Restore(0),
                Op::Spill(3, 3),
                Op::Evict(0),
                Op::Restore(1),
            ],
        );
    }
}

#[test]
fn spill_and_restore_are_byte_exact_in_the_packed_v41_layout() {
    // V4.1's 288-B compressed rows packed in 528-B plane rows: a block is still whole plane rows.
    let pool = pool_of(
        Arc::new(HostBackend::new()),
        &ModelShape::v41_flash(0).unwrap(),
        v4pool::sizing::KvDtype::FlashMlaV41Fp4,
        10,
        1,
    )
    .0;
    assert!(pool.spec().geometry.packed_rows.is_some());
    run_on(
        pool,
        vec![Op::Spill(1, 1), Op::Spill(2, 2), Op::Restore(0), Op::Spill(3, 3), Op::Evict(0), Op::Restore(1)],
    );
}

#[test]
fn fragmented_entries_restore_exactly() {
    // Fill the tier with 1-unit entries, free every other one, then spill 2 units: they land
    // in two extents, and still come back exactly.
    run(vec![
        Op::Spill(1, 1),
        Op::Spill(1, 2),
        Op::Spill(1, 3),
        Op::Spill(1, 4),
        Op::Spill(1, 5),
        Op::Evict(0),
        Op::Evict(1),
        Op::Spill(2, 6),
        Op::Restore(3),
        Op::Spill(6, 7),
        Op::Spill(5, 8),
        Op::Restore(0),
    ]);
    let pool = pool();
    let unit = HostTier::<u64>::new(&pool, 1).unwrap().unit_bytes();
    let mut tier = HostTier::new(&pool, 3 * unit).unwrap();
    let b: Vec<BlockHandle> = (0..3).map(|_| pool.alloc_block().unwrap().handle).collect();
    for (k, blk) in b.iter().enumerate() {
        tier.spill(&pool, k as u64, std::slice::from_ref(blk)).unwrap();
    }
    assert!(tier.evict(&0) && tier.evict(&2));
    tier.spill(&pool, 9, &[b[0], b[2]]).unwrap();
    assert_eq!(tier.extents_of(&9), Some(2));
    assert!(matches!(tier.spill(&pool, 9, &[b[1]]), Err(HostTierError::AlreadyHeld)));
}

/// The backend calls the tier stands on: `alloc_host` is zeroed (and, on the host backend,
/// ordinary memory), `upload_host` / `download_host` move bytes exactly in stream order, and
/// an empty allocation is fine.
#[test]
fn backend_host_memory_round_trips() {
    use v4pool::backend::{Backend, Stream};
    let b = HostBackend::new();
    let n = 3 * 4096 + 17;
    let h = b.alloc_host(n as u64).unwrap();
    assert!(!h.pinned && h.bytes == n);
    // SAFETY: `h` is `n` bytes of this backend's host memory, used by nothing else.
    let host = unsafe { std::slice::from_raw_parts_mut(h.ptr, n) };
    assert!(host.iter().all(|&x| x == 0), "alloc_host is zeroed");
    let data = bytes(42, n);
    host.copy_from_slice(&data);
    let dev = b.alloc_zeroed(n as u64).unwrap();
    // SAFETY: `dev` and `h` are live allocations of `n` bytes; synchronised before reuse.
    unsafe {
        b.upload_host(dev.ptr, h.range(0, n).unwrap(), Stream::DEFAULT).unwrap();
        b.synchronize(Stream::DEFAULT).unwrap();
        std::ptr::write_bytes(h.ptr, 0, n);
        b.download_host(h.range(0, n).unwrap(), dev.ptr, Stream::DEFAULT).unwrap();
        b.synchronize(Stream::DEFAULT).unwrap();
    }
    // SAFETY: as above; the copies are done.
    assert!(unsafe { std::slice::from_raw_parts(h.ptr, n) } == data.as_slice());
    // A range inside the allocation starts at its offset; one past its end, or whose end
    // overflows, is refused with the numbers asked for.
    let at = 4093;
    let r = h.range(at, n - at).unwrap();
    assert!(r.as_ptr() == h.ptr.wrapping_add(at) && r.len() == n - at);
    assert!(h.range(n, 0).unwrap().is_empty());
    let err = h.range(at, n - at + 1).unwrap_err();
    assert_eq!((err.offset, err.len, err.bytes), (at, n - at + 1, n));
    assert!(h.range(1, usize::MAX).is_err() && h.range(n + 1, 0).is_err());
    // SAFETY: nothing uses either any more.
    unsafe {
        b.free(dev);
        b.free_host(h);
        b.free_host(b.alloc_host(0).unwrap());
    }
}
