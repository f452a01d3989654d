//! The shared tier (files in a directory every engine mounts) on the host backend, small
//! pools: a prefix one manager committed restores on another byte-exact (blocks, window rows,
//! compressor state written by the state-update kernel); torn, truncated, corrupt,
//! foreign-layout, other-key and half-written entries are misses that never reach the pool
//! and leave nothing allocated; two writers of one key in two processes racing a reader that
//! only ever sees one writer's whole entry; capacity bounded with LRU-by-mtime eviction; the
//! directory removed mid-run leaves the engine serving (misses) with nothing leaked.
//! `tests/tiers/shared_tier_fleet.rs` runs the V4-Flash two-process prefixes (8K / 128K / 1M).
//!
//! Every test runs once per I/O (`tests/tier_io`: `std_fs::*` over `std::fs`, `nixl_posix::*`
//! over NIXL's POSIX plugin, skipped visibly without the library).

use crate::common;
use crate::hostile_fs;
use crate::tier_common;
use crate::tier_io;

use hostile_fs::{mkfifo, outside_file, within_5s, TempDir};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tier_common::manager_common::*;
use tier_common::*;
use tier_io::Io;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{FixedPolicy, KvManager};
use v4pool::pool::BlockHandle;
use v4pool::pool::Pool;
use v4pool::transfer::{EntryKind, HostTierError, SharedKey, SharedTier, SharedTierConfig};
use v4pool::VariantName;

fn host() -> Arc<HostBackend> {
    Arc::new(HostBackend::new())
}

/// A fresh directory for one test and I/O (both I/O's tests run side by side in one process).
fn temp_dir(tag: &str, io: Io) -> TempDir {
    TempDir::new(&format!("v4pool-shared-{tag}-{}", io.name()))
}

/// `pool` carved the way a manager would (as many blocks as one slot leaves), for the tests
/// that drive a tier without a manager.
fn carved(pool: Arc<Pool>) -> Arc<Pool> {
    let blocks = pool.with_boundary(|b| b.max_blocks_beside(1)).unwrap();
    pool.resize(blocks, 1).unwrap();
    pool
}

fn shared_config(dir: &Path, budget: u64) -> SharedTierConfig {
    SharedTierConfig::new(dir.to_path_buf(), budget).with_sync(false)
}

/// A manager as `tiered` builds it (3 fixed slots, checkpoints every 2 blocks and rolling),
/// with the shared tier in `dir` over `io` and a host tier of `host_units` units.
fn fleet_manager(pool: Arc<Pool>, dir: &Path, host_units: u64, io: Io) -> KvManager {
    fleet_manager_probed(pool, dir, host_units, io).0
}

/// [`fleet_manager`], with a handle on its NIXL I/O (when `io` is NIXL's) to check it holds
/// no registration after a call.
fn fleet_manager_probed(
    pool: Arc<Pool>,
    dir: &Path,
    host_units: u64,
    io: Io,
) -> (KvManager, Option<v4pool::transfer::NixlPosix>) {
    let shared = shared_config(dir, 64 << 20);
    let config =
        config(2, true).with_host_tier_bytes(host_units * unit_bytes(&pool)).with_shared_tier(shared.clone());
    let mut m = KvManager::new(pool, config, Box::new(FixedPolicy::new(3))).expect("manager");
    let probe = if io != Io::StdFs { io.install(&mut m, &shared) } else { None };
    (m, probe)
}

/// Every block and slot back in the pool once the cache is emptied.
fn drained(m: &mut KvManager) {
    m.complete_inflight().unwrap();
    m.check_invariants().unwrap();
    m.evict_all().unwrap();
    let c = m.pool().counts().unwrap();
    assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "something stayed held");
}

/// The entry file of `key` in `dir` for pools of `pool`'s layout.
fn entry_path(pool: &Pool, dir: &Path, key: SharedKey) -> PathBuf {
    SharedTier::new(pool, &shared_config(dir, 64 << 20)).unwrap().path_of(&key)
}

fn ckpt_key(t: &Turn, blocks: usize) -> SharedKey {
    SharedKey { kind: EntryKind::Checkpoint, hash: hashes(&t.tokens)[blocks - 1].0 }
}

fn block_key(t: &Turn, block: usize) -> SharedKey {
    SharedKey { kind: EntryKind::Block, hash: hashes(&t.tokens)[block].0 }
}

fn a_prefix_one_manager_committed_restores_on_another(io: Io) {
    let dir = temp_dir("restore", io);
    for pool_of in [small_pool, state_pool] {
        let _ = std::fs::remove_dir_all(dir.0.join(v4pool::transfer::shared_tier::TIER_DIR));
        let mut a = fleet_manager(pool_of(host(), 24), &dir.0, 0, io);
        let turn = turn(&mut a, 1);
        let s = a.stats();
        // Five prompt-and-output blocks, the checkpoints at 512, 768, 1,024 and 1,280.
        assert_eq!((s.shared_published_blocks, s.shared_published_checkpoints), (5, 4), "{s:?}");
        assert_eq!(s.shared_write_failures, 0);
        // Another manager on another pool, its memory poisoned: the whole prefix comes from
        // the files, blocks and the slot image (state and windows) byte for byte.
        let mut b = fleet_manager(pool_of(host(), 24), &dir.0, 0, io);
        poison_blocks(&b, 0xbad);
        assert_eq!(b.match_prefix(&hashes(&turn.tokens[..1400])), 1280);
        let r = rehit(&mut b, &turn, 1280);
        let s = b.stats();
        assert_eq!((s.shared_restored_blocks, s.shared_restored_checkpoints), (5, 1), "{s:?}");
        assert_eq!(s.shared_restored_bytes, (5 + u64::from(b.units_per_checkpoint())) * unit_bytes(b.pool()));
        assert_eq!(s.shared_refused, 0);
        // It continues like any request, and nothing is republished: the entries are there.
        run_to(&mut b, r, &turn.tokens, 1500, 700);
        b.finish(r).unwrap();
        assert_eq!(b.stats().shared_published_blocks, 0, "{:?}", b.stats());
        drained(&mut b);
        drained(&mut a);
    }
}

fn the_host_tier_is_asked_before_the_shared_tier(io: Io) {
    let dir = temp_dir("order", io);
    let mut a = fleet_manager(state_pool(host(), 24), &dir.0, 64, io);
    let turn = turn(&mut a, 1);
    // HBM → host tier: the same manager's hit comes back from host memory, not the files.
    a.evict_all().unwrap();
    poison_blocks(&a, 3);
    let r = rehit(&mut a, &turn, 1280);
    let s = a.stats();
    assert_eq!((s.tier_restored_blocks, s.tier_restored_checkpoints), (5, 1), "{s:?}");
    assert_eq!((s.shared_restored_blocks, s.shared_restored_checkpoints), (0, 0), "{s:?}");
    a.finish(r).unwrap();
    // With the host tier emptied the same hit comes from the shared tier.
    a.evict_all().unwrap();
    a.clear_host_tier();
    poison_blocks(&a, 4);
    let r = rehit(&mut a, &turn, 1280);
    let s = a.stats();
    assert_eq!((s.shared_restored_blocks, s.shared_restored_checkpoints), (5, 1), "{s:?}");
    a.finish(r).unwrap();
    drained(&mut a);
}

/// Damage an entry file in place (`unit`: bytes of one unit, what "extended" appends, so the
/// file still looks like whole units).
fn damage(path: &Path, how: &str, unit: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    match how {
        "payload" => {
            let at = bytes.len() - 7;
            bytes[at] ^= 0x10;
        }
        "header" => bytes[13] ^= 1,
        "truncated" => bytes.truncate(bytes.len() - 100),
        "torn" => bytes.truncate(bytes.len() / 2),
        "extended" => {
            let more = bytes[bytes.len() - unit as usize..].to_vec();
            bytes.extend(more);
        }
        "empty" => bytes.clear(),
        _ => unreachable!(),
    }
    std::fs::write(path, bytes).unwrap();
}

fn refused_entries_are_misses_and_never_reach_the_pool(io: Io) {
    let dir = temp_dir("refused", io);
    let mut a = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
    let turn = turn(&mut a, 1);
    drained(&mut a);
    let ck = ckpt_key(&turn, 5);
    let path = entry_path(a.pool(), &dir.0, ck);
    let good = std::fs::read(&path).unwrap();
    let b_pool = carved(state_pool(host(), 24));
    // Directly: every damage is refused with a typed error, nothing allocated, the file gone.
    for how in ["payload", "header", "truncated", "torn", "extended", "empty"] {
        std::fs::write(&path, &good).unwrap();
        damage(&path, how, unit_bytes(a.pool()));
        let mut t = io.tier(&b_pool, &shared_config(&dir.0, 64 << 20)).unwrap();
        let before = b_pool.counts().unwrap();
        let r = t.restore(&b_pool, &ck);
        assert!(matches!(r, Err(HostTierError::Corrupt { .. })), "{how}: {r:?}");
        assert_eq!(r.unwrap_err().variant_name(), "Corrupt");
        assert_eq!(b_pool.counts().unwrap(), before, "{how}: blocks stayed allocated");
        assert!(!path.exists(), "{how}: a refused entry stays");
        assert_eq!(t.stats().corrupt, 1, "{how}");
    }
    // Through a manager: the checkpoint at 1,280 damaged, the hit ends at 1,024 (restored
    // exactly); the damaged entry counted and removed.
    for how in ["payload", "header", "extended"] {
        std::fs::write(&path, &good).unwrap();
        damage(&path, how, unit_bytes(a.pool()));
        let mut b = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
        poison_blocks(&b, 5);
        let r = rehit(&mut b, &turn, 1024);
        let s = b.stats();
        assert_eq!(s.shared_refused, 1, "{how}: {s:?}");
        assert!(!path.exists(), "{how}");
        b.finish(r).unwrap();
        drained(&mut b);
    }
    // A truncated or torn file does not even look whole: a miss without a read.
    for how in ["truncated", "torn"] {
        std::fs::write(&path, &good).unwrap();
        damage(&path, how, unit_bytes(a.pool()));
        let mut b = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
        assert_eq!(b.match_prefix(&hashes(&turn.tokens[..1400])), 1024, "{how}");
        let r = rehit(&mut b, &turn, 1024);
        b.finish(r).unwrap();
        drained(&mut b);
    }
    // A block in the middle refused: the chain stops before it, and with no checkpoint
    // below the restored blocks the hit is the 512-token one.
    std::fs::write(&path, &good).unwrap();
    let blk = entry_path(a.pool(), &dir.0, block_key(&turn, 2));
    damage(&blk, "payload", unit_bytes(a.pool()));
    let mut b = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
    let r = rehit(&mut b, &turn, 512);
    assert_eq!(b.stats().shared_refused, 1);
    b.finish(r).unwrap();
    drained(&mut b);
}

fn foreign_other_key_and_half_written_entries_are_misses(io: Io) {
    let dir = temp_dir("foreign", io);
    let other = temp_dir("foreign-other", io);
    let mut a = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
    let turn = turn(&mut a, 1);
    drained(&mut a);
    let ck = ckpt_key(&turn, 5);
    let path = entry_path(a.pool(), &dir.0, ck);
    // The same key published by a pool of another layout (ring 13), its file put where this
    // layout's entry lives: a whole, well-formed entry of another layout.
    let foreign_pool = carved(state_pool_ring(host(), 24, 13));
    assert_ne!(foreign_pool.layout_id(), a.pool().layout_id());
    let mut ft = io.tier(&foreign_pool, &shared_config(&other.0, 64 << 20)).unwrap();
    let blocks: Vec<BlockHandle> =
        (0..a.units_per_checkpoint()).map(|_| foreign_pool.alloc_block().unwrap().handle).collect();
    assert!(ft.publish(&foreign_pool, ck, &blocks).unwrap());
    let foreign_file = ft.path_of(&ck);
    assert_ne!(foreign_file.parent(), path.parent(), "layouts share a folder");
    // Only the length is this layout's when the units match; otherwise contains() already says no.
    let foreign_bytes = std::fs::read(&foreign_file).unwrap();
    let b_pool = carved(state_pool(host(), 24));
    let mut t = io.tier(&b_pool, &shared_config(&dir.0, 64 << 20)).unwrap();
    std::fs::write(&path, &foreign_bytes).unwrap();
    let before = b_pool.counts().unwrap();
    let r = t.restore(&b_pool, &ck);
    assert!(matches!(r, Err(HostTierError::ForeignLayout { .. })), "{r:?}");
    assert_eq!(b_pool.counts().unwrap(), before);
    assert_eq!(t.stats().foreign, 1);
    // Another key's whole entry under this key's name: refused.
    let blk0 = entry_path(a.pool(), &dir.0, block_key(&turn, 0));
    let blk1 = entry_path(a.pool(), &dir.0, block_key(&turn, 1));
    let saved = std::fs::read(&blk1).unwrap();
    std::fs::copy(&blk0, &blk1).unwrap();
    let r = t.restore(&b_pool, &block_key(&turn, 1));
    assert!(matches!(r, Err(HostTierError::Corrupt { what: "another key's entry" })), "{r:?}");
    std::fs::write(&blk1, saved).unwrap();
    // A writer's temporary file (not renamed yet) is invisible; the entry is a miss.
    std::fs::remove_file(&path).ok();
    let tmp = path.with_file_name(format!(".tmp-{}-99999-1", path.file_name().unwrap().to_str().unwrap()));
    std::fs::write(&tmp, &foreign_bytes).unwrap();
    assert!(!t.contains(&ck));
    assert!(matches!(t.restore(&b_pool, &ck), Err(HostTierError::NotHeld)));
    // Through a manager: the checkpoint at 1,280 is not there, the hit ends at 1,024.
    let mut b = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
    let r = rehit(&mut b, &turn, 1024);
    b.finish(r).unwrap();
    drained(&mut b);
    // A stale temporary file (a dead writer's) is removed by the next capacity scan.
    let old = SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options().append(true).open(&tmp).unwrap().set_modified(old).unwrap();
    let t = io.tier(&b_pool, &shared_config(&dir.0, 64 << 20)).unwrap();
    assert!(!tmp.exists() && t.stats().stale_temps == 1, "{:?}", t.stats());
}

/// Bytes under `dir` (every file, recursively).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dir_bytes(&e.path())
            } else {
                m.len()
            }
        })
        .sum()
}

fn capacity_is_bounded_least_recently_used_first(io: Io) {
    let dir = temp_dir("capacity", io);
    let pool = carved(small_pool(host(), 24));
    let b = pool.alloc_block().unwrap().handle;
    let probe = SharedTier::new(&pool, &shared_config(&dir.0, 1 << 30)).unwrap();
    let entry = probe.head_bytes() + probe.unit_bytes();
    drop(probe);
    // Ten entries' room; forty published.
    let budget = 10 * entry;
    let mut t = io.tier(&pool, &shared_config(&dir.0, budget)).unwrap();
    let key = |i: u128| SharedKey { kind: EntryKind::Block, hash: i << 64 | 0x5151 };
    let day_ago = SystemTime::now() - Duration::from_secs(86_400);
    for i in 0..40u128 {
        assert!(t.publish(&pool, key(i), &[b]).unwrap());
        // Publication order is recency order (explicit mtimes: no clock granularity).
        let f = std::fs::File::options().append(true).open(t.path_of(&key(i))).unwrap();
        f.set_modified(day_ago + Duration::from_secs(i as u64)).unwrap();
        // Entry 0 is used all along: always the most recent.
        assert!(t.touch(&key(0)));
        let on_disk = dir_bytes(&dir.0);
        assert!(on_disk <= budget + budget / 8 + entry, "{on_disk} B on disk over {budget} B");
    }
    let s = t.stats();
    assert!(s.evicted >= 30 && s.scans > 1, "{s:?}");
    assert!(t.contains(&key(0)), "the most recently used entry was evicted");
    assert!(!t.contains(&key(1)), "the least recently used entry survived");
    assert!(t.contains(&key(39)));
    // The LRU order lists the survivors oldest first, entry 0 last.
    let order = t.lru_order();
    assert_eq!(order.last(), Some(&key(0)));
    assert!(order.len() <= 10);
    // An entry larger than the whole budget is refused before anything is written.
    let many: Vec<BlockHandle> = (0..11).map(|_| pool.alloc_block().unwrap().handle).collect();
    let r = t.publish(&pool, key(100), &many);
    assert!(matches!(r, Err(HostTierError::TooLarge { .. })), "{r:?}");
    assert!(!t.contains(&key(100)));
}

fn the_directory_removed_mid_run_leaves_the_engine_serving(io: Io) {
    let dir = temp_dir("removed", io);
    let (mut a, probe) = fleet_manager_probed(state_pool(host(), 24), &dir.0, 0, io);
    let first = turn(&mut a, 1);
    drained(&mut a);
    std::fs::remove_dir_all(&dir.0).unwrap();
    // Publications fail (counted), hits miss, the engine runs on.
    let second = turn(&mut a, 2);
    let s = a.stats();
    assert!(s.shared_write_failures > 0, "{s:?}");
    drained(&mut a);
    let r = rehit(&mut a, &first, 0);
    a.finish(r).unwrap();
    drained(&mut a);
    assert!(!dir.0.exists(), "the tier recreated a vanished mount point");
    // A new manager cannot open a missing directory: a typed error, not a panic.
    let e = KvManager::new(
        state_pool(host(), 24),
        config(2, true).with_shared_tier(shared_config(&dir.0, 1 << 20)),
        Box::new(FixedPolicy::new(3)),
    )
    .unwrap_err();
    assert_eq!(e.variant_name(), "Io", "{e}");
    let e = io.tier(&carved(state_pool(host(), 24)), &shared_config(&dir.0, 1 << 20)).unwrap_err();
    assert_eq!(e.variant_name(), "Io", "{e}");
    // The directory back (the mount restored): publishing resumes.
    std::fs::create_dir_all(&dir.0).unwrap();
    let before = a.stats().shared_published_blocks;
    let _third = turn(&mut a, 3);
    assert!(a.stats().shared_published_blocks > before, "{:?}", a.stats());
    drained(&mut a);
    let _ = second;
    // Nothing of NIXL's left behind by the failed and the successful calls.
    if let Some(p) = probe {
        assert_eq!(p.registrations(), 0, "NIXL registrations leaked");
    }
}

per_io!(
    a_prefix_one_manager_committed_restores_on_another,
    the_host_tier_is_asked_before_the_shared_tier,
    refused_entries_are_misses_and_never_reach_the_pool,
    foreign_other_key_and_half_written_entries_are_misses,
    capacity_is_bounded_least_recently_used_first,
    the_directory_removed_mid_run_leaves_the_engine_serving,
    two_writers_of_one_key_and_a_reader_in_three_processes,
);

// ---- two writers of one key, in two processes, and a reader -------------------------------

const WRITER_KEYS: u128 = 6;

/// The bytes writer `w` publishes for block entry `k`: every byte of the unit differs
/// between the two writers.
fn writer_bytes(pool: &Pool, w: u64, k: u128) -> Vec<u8> {
    let n = unit_bytes(pool) as usize;
    pattern(0x77 ^ (w << 40) ^ (k as u64), n)
}

/// Write `bytes` over the whole unit of `block` (every plane and indexer layer).
fn write_unit(pool: &Pool, block: BlockHandle, bytes: &[u8]) {
    let mut at = 0;
    for (addr, len) in unit_ranges(pool, block.id) {
        // SAFETY: the ranges are the pool's own block unit (planes and indexer layers).
        unsafe { pool.backend().upload(addr, &bytes[at..at + len as usize], pool.stream()).unwrap() };
        at += len as usize;
    }
    pool.backend().synchronize(pool.stream()).unwrap();
}

fn read_unit(pool: &Pool, block: BlockHandle) -> Vec<u8> {
    let mut out = Vec::new();
    for (addr, len) in unit_ranges(pool, block.id) {
        let mut buf = vec![0u8; len as usize];
        // SAFETY: as in `write_unit`.
        unsafe { pool.backend().download(&mut buf, addr, pool.stream()).unwrap() };
        out.extend(buf);
    }
    out
}

/// Device ranges of block `id`'s unit: every plane, then every indexer layer.
fn unit_ranges(pool: &Pool, id: u32) -> Vec<(u64, u64)> {
    let g = &pool.spec().geometry;
    let mut out = Vec::new();
    for (p, &w) in pool.spec().plane_widths.iter().enumerate() {
        out.push((pool.plane_ptr(p).unwrap() + u64::from(id) * g.block_bytes(w), g.block_bytes(w)));
    }
    if let Some(base) = pool.indexer_ptr() {
        for (parts, &off) in pool.indexer_parts().iter().zip(pool.indexer_offsets()) {
            for part in parts {
                out.push((
                    base + off + part.offset(u64::from(id), pool.indexer_blocks()).unwrap(),
                    part.block_bytes,
                ));
            }
        }
    }
    out
}

fn writer_key(k: u128) -> SharedKey {
    SharedKey { kind: EntryKind::Block, hash: k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1 }
}

fn two_writers_of_one_key_and_a_reader_in_three_processes(io: Io) {
    let dir = temp_dir("writers", io);
    let pool = carved(small_pool(host(), 24));
    let until = SystemTime::now() + Duration::from_millis(1500);
    let deadline = until.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis().to_string();
    let spawn = |w: &str| {
        common::child_test(module_path!(), "child_shared_writer")
            .env("V4POOL_SHARED_DIR", &dir.0)
            .env("V4POOL_SHARED_WRITER", w)
            .env("V4POOL_SHARED_UNTIL", &deadline)
            .env("V4POOL_TIER_IO", io.name())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let kids = [spawn("1"), spawn("2")];
    // The reader: restore every key over and over while both rewrite them; every restored
    // unit is one writer's whole bytes (a refusal is a miss, never a mix).
    let mut t = io.tier(&pool, &shared_config(&dir.0, 1 << 30)).unwrap();
    let want: Vec<[Vec<u8>; 2]> =
        (0..WRITER_KEYS).map(|k| [writer_bytes(&pool, 1, k), writer_bytes(&pool, 2, k)]).collect();
    let (mut seen, mut misses) = ([0u64; 2], 0u64);
    while SystemTime::now() < until + Duration::from_millis(300) {
        for k in 0..WRITER_KEYS {
            match t.restore(&pool, &writer_key(k)) {
                Ok(blocks) => {
                    let got = read_unit(&pool, blocks[0]);
                    let w = want[k as usize].iter().position(|x| *x == got);
                    let w = w.unwrap_or_else(|| panic!("key {k}: restored bytes are neither writer's"));
                    seen[w] += 1;
                    pool.free_block(blocks[0]).unwrap();
                }
                Err(HostTierError::NotHeld | HostTierError::Corrupt { .. } | HostTierError::Io { .. }) => {
                    misses += 1
                }
                Err(e) => panic!("key {k}: {e}"),
            }
        }
    }
    for k in kids {
        let out = k.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "writer failed:\n{text}");
        println!("{}", text.lines().find(|l| l.starts_with("writer")).unwrap_or(""));
    }
    let c = pool.counts().unwrap();
    assert_eq!(c.free_blocks, c.num_blocks, "the reader leaked blocks");
    println!(
        "reader: {} restores of writer 1, {} of writer 2, {misses} misses; {:?}",
        seen[0],
        seen[1],
        t.stats()
    );
    assert!(seen[0] + seen[1] > 0, "the reader never restored anything");
    // Once both are done every entry is whole: one writer's bytes.
    for k in 0..WRITER_KEYS {
        let blocks = t.restore(&pool, &writer_key(k)).unwrap();
        assert!(want[k as usize].contains(&read_unit(&pool, blocks[0])));
        pool.free_block(blocks[0]).unwrap();
    }
    // No temporary file is left behind.
    let mut stack = vec![dir.0.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            if e.metadata().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                assert!(!e.file_name().to_string_lossy().starts_with(".tmp-"), "left: {:?}", e.path());
            }
        }
    }
}

/// One writer of `two_writers_of_one_key_and_a_reader_in_three_processes`: until the
/// deadline, remove and republish every key with its own bytes (so the two writers' renames
/// race each other and the reader).
#[test]
#[ignore = "run as a child process by two_writers_of_one_key_and_a_reader_in_three_processes"]
fn child_shared_writer() {
    let (Ok(dir), Ok(w), Ok(until)) = (
        std::env::var("V4POOL_SHARED_DIR"),
        std::env::var("V4POOL_SHARED_WRITER"),
        std::env::var("V4POOL_SHARED_UNTIL"),
    ) else {
        println!("SKIP: child_shared_writer runs only as a child of the two-writer test");
        return;
    };
    let w: u64 = w.parse().unwrap();
    let until = SystemTime::UNIX_EPOCH + Duration::from_millis(until.parse().unwrap());
    let pool = carved(small_pool(host(), 24));
    let mut t = Io::from_env().tier(&pool, &shared_config(Path::new(&dir), 1 << 30)).unwrap();
    let blocks: Vec<BlockHandle> = (0..WRITER_KEYS)
        .map(|k| {
            let b = pool.alloc_block().unwrap().handle;
            write_unit(&pool, b, &writer_bytes(&pool, w, k));
            b
        })
        .collect();
    let mut rounds = 0u64;
    while SystemTime::now() < until {
        for k in 0..WRITER_KEYS {
            t.evict(&writer_key(k));
            t.publish(&pool, writer_key(k), &[blocks[k as usize]]).unwrap();
        }
        rounds += 1;
    }
    println!("writer {w}: {rounds} rounds of {WRITER_KEYS} keys; {:?}", t.stats());
}

/// NIXL's POSIX I/O on its own: the `FILE_SEG` code declared is the library's, a file it
/// writes is the bytes given (read back by `std::fs`), a file `std::fs` wrote reads back
/// through it at any offset, a read past the end is refused, an existing name is not
/// overwritten, and no call leaves a registration behind.
#[test]
fn nixl_posix_moves_the_bytes() {
    if !Io::NixlPosix.runs("nixl_posix_moves_the_bytes") {
        return;
    }
    use v4pool::transfer::{NixlPosix, TierIo};
    assert_eq!(v4pool::transfer::nixl::mem_type_name(v4pool::transfer::nixl::FILE_SEG).unwrap(), "FILE");
    let dir = temp_dir("nixl-bytes", Io::NixlPosix);
    let io = NixlPosix::from_env().unwrap();
    let head = pattern(1, 93);
    let body = pattern(2, (3 << 20) + 17);
    let path = dir.0.join("entry");
    io.write_file(&path, &head, &body, true).unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    assert!(on_disk[..93] == head[..] && on_disk[93..] == body[..], "written bytes differ");
    let e = io.write_file(&path, &head, &body, false).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(std::fs::read(&path).unwrap(), on_disk, "an existing file was changed");
    let mut r = io.open(&path).unwrap();
    assert_eq!(r.len(), on_disk.len() as u64);
    for (at, n) in [(0usize, 80usize), (93, body.len()), (4097, 65_536), (on_disk.len() - 1, 1)] {
        let mut got = vec![0u8; n];
        r.read_exact_at(at as u64, &mut got).unwrap();
        assert!(got[..] == on_disk[at..at + n], "read of {n} at {at}");
    }
    let mut past = vec![0u8; 2];
    let e = r.read_exact_at(on_disk.len() as u64 - 1, &mut past).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert!(matches!(io.open(&dir.0.join("absent")), Err(e) if e.kind() == std::io::ErrorKind::NotFound));
    drop(r);
    assert_eq!(io.registrations(), 0);
}

// ---- issue 43: the shared tier and the store tier as a hostile caller sees them ------------

/// `bytes`' header rewritten to hold `units` units with `payload` (the format of
/// `docs/fleet.md`, every checksum recomputed: a forgery only the unit rule can refuse).
fn forge(bytes: &[u8], units: u32, payload: &[u8]) -> Vec<u8> {
    use v4pool::transfer::shared_tier::checksum;
    let head_len = 80 + u32::from_le_bytes(bytes[32..36].try_into().unwrap()) as usize;
    let mut h = bytes[..head_len].to_vec();
    h[12..16].copy_from_slice(&units.to_le_bytes());
    h[40..48].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[48..64].copy_from_slice(&checksum(payload).to_le_bytes());
    let mut covered = h[..64].to_vec();
    covered.extend_from_slice(&h[80..]);
    h[64..80].copy_from_slice(&checksum(&covered).to_le_bytes());
    h.extend_from_slice(payload);
    h
}

#[test]
fn defect43_row1_the_scan_never_follows_a_link_nor_removes_others_files() {
    let root = temp_dir("d43-row1", Io::StdFs);
    let pool = carved(small_pool(host(), 24));
    let entry_name = format!("b{:032x}", 0xabcdu128);
    // (a) The tier's folder is a link to a folder outside: the tier is refused, and nothing
    // there is touched (before: notes.txt, an hour old, was removed as a stale temp file).
    let (v, t) = (root.0.join("V"), root.0.join("T"));
    outside_file(&v.join("a/b/notes.txt"), 10);
    outside_file(&v.join("a/b").join(&entry_name), 4096);
    std::fs::create_dir_all(&t).unwrap();
    std::os::unix::fs::symlink(&v, t.join(v4pool::transfer::shared_tier::TIER_DIR)).unwrap();
    let r = SharedTier::new(&pool, &shared_config(&t, 1024));
    assert!(v.join("a/b/notes.txt").exists(), "a file outside the tier was removed (tier folder a link)");
    assert!(v.join("a/b").join(&entry_name).exists(), "an outside entry-named file was removed");
    assert_eq!(r.map(drop).unwrap_err().variant_name(), "Io", "a linked tier folder was used");
    // (b) A real tier folder holding a linked layout folder and, in this layout's folder, a
    // linked shard folder and a stray file of no one's: a scan over budget removes none of
    // them, and a publication into the linked shard is refused, writing nothing there.
    let t2 = root.0.join("T2");
    std::fs::create_dir_all(&t2).unwrap();
    let probe = SharedTier::new(&pool, &shared_config(&t2, 1 << 30)).unwrap();
    let layout_dir = probe.layout_dir().to_path_buf();
    drop(probe);
    let (v1, v2) = (root.0.join("V1"), root.0.join("V2"));
    for v in [&v1, &v2] {
        outside_file(&v.join("ab/notes.txt"), 10);
        outside_file(&v.join("ab").join(&entry_name), 4096);
        outside_file(&v.join("notes.txt"), 10);
        outside_file(&v.join(&entry_name), 4096);
    }
    let tier_dir = t2.join(v4pool::transfer::shared_tier::TIER_DIR);
    std::os::unix::fs::symlink(&v1, tier_dir.join("00000000deadbeef")).unwrap();
    std::os::unix::fs::symlink(&v2, layout_dir.join("cd")).unwrap();
    let stray = layout_dir.join("ef/notes.txt");
    outside_file(&stray, 10);
    let tier = SharedTier::new(&pool, &shared_config(&t2, 1024)).unwrap();
    assert!(tier.stats().scans == 1 && tier.stats().evicted == 0, "{:?}", tier.stats());
    for v in [&v1, &v2] {
        for f in
            [v.join("ab/notes.txt"), v.join("ab").join(&entry_name), v.join("notes.txt"), v.join(&entry_name)]
        {
            assert!(f.exists(), "{} outside the tier was removed by the scan", f.display());
        }
    }
    assert!(stray.exists(), "a file the tier never writes was removed from its folder");
    let key = SharedKey { kind: EntryKind::Block, hash: 0xcd << 120 | 5 };
    let b = pool.alloc_block().unwrap().handle;
    let mut roomy = SharedTier::new(&pool, &shared_config(&t2, 1 << 30)).unwrap();
    let r = roomy.publish(&pool, key, &[b]);
    let written: Vec<_> = std::fs::read_dir(&v2).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(written.len(), 3, "a publication wrote through a linked shard folder: {written:?}");
    assert_eq!(r.map(drop).unwrap_err().variant_name(), "Io");
    // (c) This layout's own folder a link: refused, nothing outside touched.
    std::fs::remove_dir_all(&tier_dir).unwrap();
    std::fs::create_dir_all(&tier_dir).unwrap();
    std::os::unix::fs::symlink(&v1, &layout_dir).unwrap();
    let r = SharedTier::new(&pool, &shared_config(&t2, 1024));
    assert!(v1.join("notes.txt").exists() && v1.join(&entry_name).exists(), "outside files removed");
    assert_eq!(r.map(drop).unwrap_err().variant_name(), "Io", "a linked layout folder was used");
}

#[test]
fn defect43_row2_two_tiers_in_one_process_publish_the_same_keys() {
    // Tiers in one process (the two; four make a collision likelier on a busy machine).
    const WRITERS: usize = 4;
    let dir = temp_dir("d43-row2", Io::StdFs);
    let key =
        |i: u128| SharedKey { kind: EntryKind::Block, hash: i.wrapping_mul(0x9e37_79b9_7f4a_7c15) << 8 | i };
    for round in 0..30 {
        let barrier = Arc::new(std::sync::Barrier::new(WRITERS));
        let writers: Vec<_> = (0..WRITERS)
            .map(|_| {
                let (barrier, dir) = (barrier.clone(), dir.0.clone());
                std::thread::spawn(move || {
                    let pool = carved(small_pool(host(), 24));
                    let mut t = SharedTier::new(&pool, &shared_config(&dir, 1 << 30)).unwrap();
                    let b = pool.alloc_block().unwrap().handle;
                    barrier.wait();
                    let failed: Vec<u128> =
                        (0..200u128).filter(|&i| t.publish(&pool, key(i), &[b]).is_err()).collect();
                    failed
                })
            })
            .collect();
        let failed: Vec<Vec<u128>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
        let pool = carved(small_pool(host(), 24));
        let mut t = SharedTier::new(&pool, &shared_config(&dir.0, 1 << 30)).unwrap();
        let missing: Vec<u128> = (0..200u128).filter(|&i| !t.contains(&key(i))).collect();
        assert!(missing.is_empty(), "round {round}: keys with no entry: {missing:?}");
        assert!(failed.iter().all(|f| f.is_empty()), "round {round}: publications failed: {failed:?}");
        for i in 0..200u128 {
            assert!(t.evict(&key(i)));
        }
    }
}

#[test]
fn defect43_row4_a_unit_count_that_does_not_fit_the_key_is_corrupt() {
    let io = Io::StdFs;
    let dir = temp_dir("d43-row4", io);
    let mut a = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
    let turn = turn(&mut a, 1);
    drained(&mut a);
    let ub = unit_bytes(a.pool()) as usize;
    let upc = a.units_per_checkpoint();
    let ck = ckpt_key(&turn, 5);
    let path = entry_path(a.pool(), &dir.0, ck);
    let good = std::fs::read(&path).unwrap();
    let head_len = good.len() - upc as usize * ub;
    let payload = &good[head_len..];
    let mut longer = payload.to_vec();
    longer.extend_from_slice(&payload[payload.len() - ub..]);
    let forged_ckpts =
        [forge(&good, upc - 1, &payload[..payload.len() - ub]), forge(&good, upc + 1, &longer)];
    let blk = entry_path(a.pool(), &dir.0, block_key(&turn, 2));
    let good_blk = std::fs::read(&blk).unwrap();
    let mut doubled = good_blk[head_len..].to_vec();
    doubled.extend_from_slice(&good_blk[head_len..]);
    let forged_blk = forge(&good_blk, 2, &doubled);
    // Directly: each forgery is Corrupt, counted, removed, nothing allocated.
    let b_pool = carved(state_pool(host(), 24));
    for (what, p, bytes) in [
        ("checkpoint of units - 1", &path, &forged_ckpts[0]),
        ("checkpoint of units + 1", &path, &forged_ckpts[1]),
        ("block of 2 units", &blk, &forged_blk),
    ] {
        std::fs::write(p, bytes).unwrap();
        let mut t = io.tier(&b_pool, &shared_config(&dir.0, 64 << 20)).unwrap();
        let before = b_pool.counts().unwrap();
        let key = if p == &path { ck } else { block_key(&turn, 2) };
        let r = t.restore(&b_pool, &key);
        assert!(matches!(r, Err(HostTierError::Corrupt { .. })), "{what}: {r:?}");
        assert_eq!(b_pool.counts().unwrap(), before, "{what}: blocks stayed allocated");
        assert!(!p.exists(), "{what}: the forged entry stays");
        assert_eq!(t.stats().corrupt, 1, "{what}");
    }
    std::fs::write(&blk, &good_blk).unwrap();
    // Through a manager: the forged checkpoint ends the hit at 1,024 (admit works, the entry
    // goes); the forged block ends it at 512, and nothing leaks. (With one unit a checkpoint,
    // as here, the units − 1 forgery is an empty entry the walk's `contains` already skips.)
    for forged in forged_ckpts.iter().filter(|f| f.len() > head_len) {
        std::fs::write(&path, forged).unwrap();
        let mut b = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
        let r = rehit(&mut b, &turn, 1024);
        assert_eq!(b.stats().shared_refused, 1, "{:?}", b.stats());
        assert!(!path.exists(), "the forged checkpoint stays");
        b.finish(r).unwrap();
        drained(&mut b);
    }
    std::fs::write(&path, &good).unwrap();
    std::fs::write(&blk, &forged_blk).unwrap();
    let mut b = fleet_manager(state_pool(host(), 24), &dir.0, 0, io);
    let r = rehit(&mut b, &turn, 512);
    assert_eq!(b.stats().shared_refused, 1, "{:?}", b.stats());
    assert!(!blk.exists(), "the forged block stays");
    b.finish(r).unwrap();
    drained(&mut b);
}

/// [`v4pool::transfer::StdFs`] that records the largest read asked and refuses any read over
/// 1 MiB (so the unfixed tier does not read the sparse file whole).
#[derive(Debug, Clone, Default)]
struct Counting(Arc<std::sync::atomic::AtomicU64>);

struct CountingReader(Box<dyn v4pool::transfer::TierReader>, Arc<std::sync::atomic::AtomicU64>);

impl v4pool::transfer::TierReader for CountingReader {
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        self.1.fetch_max(dst.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if dst.len() > 1 << 20 {
            return Err(std::io::Error::other("a read of the whole claimed payload"));
        }
        self.0.read_exact_at(offset, dst)
    }
}

impl v4pool::transfer::TierIo for Counting {
    fn write_file(&self, path: &Path, head: &[u8], body: &[u8], sync: bool) -> std::io::Result<()> {
        v4pool::transfer::StdFs.write_file(path, head, body, sync)
    }
    fn open(&self, path: &Path) -> std::io::Result<Box<dyn v4pool::transfer::TierReader>> {
        Ok(Box::new(CountingReader(v4pool::transfer::StdFs.open(path)?, self.0.clone())))
    }
}

#[test]
fn defect43_row5_a_sparse_entry_past_the_budget_is_refused_unread() {
    let dir = temp_dir("d43-row5", Io::StdFs);
    let pool = carved(state_pool(host(), 24));
    let mut m = fleet_manager(state_pool(host(), 24), &dir.0, 0, Io::StdFs);
    let turn = turn(&mut m, 1);
    drained(&mut m);
    let ck = ckpt_key(&turn, 5);
    let path = entry_path(&pool, &dir.0, ck);
    let good = std::fs::read(&path).unwrap();
    let ub = unit_bytes(&pool);
    let head_len = good.len() as u64 - u64::from(m.units_per_checkpoint()) * ub;
    // The tier first: its opening scan would evict the oversized file before the restore.
    let io = Counting::default();
    let mut t = SharedTier::with_io(&pool, &shared_config(&dir.0, 64 << 20), Box::new(io.clone())).unwrap();
    // A header claiming 256 MiB of units over a sparse file of that length (budget 64 MiB).
    let units = ((256u64 << 20) / ub) as u32;
    let mut h = forge(&good, units, &[]);
    h[40..48].copy_from_slice(&(u64::from(units) * ub).to_le_bytes());
    let mut covered = h[..64].to_vec();
    covered.extend_from_slice(&h[80..]);
    h[64..80].copy_from_slice(&v4pool::transfer::shared_tier::checksum(&covered).to_le_bytes());
    std::fs::write(&path, &h).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(head_len + u64::from(units) * ub)
        .unwrap();
    let r = t.restore(&pool, &ck);
    let largest = io.0.load(std::sync::atomic::Ordering::Relaxed);
    assert!(largest <= head_len, "a read of {largest} B for a header of {head_len} B: the claim was read");
    assert!(matches!(r, Err(HostTierError::Corrupt { .. })), "{r:?}");
    assert!(!path.exists(), "the refused entry stays");
}

#[test]
fn defect43_row6_a_fifo_at_an_entry_name_is_refused_unopened() {
    let dir = temp_dir("d43-row6", Io::StdFs);
    let pool = carved(small_pool(host(), 24));
    let t = SharedTier::new(&pool, &shared_config(&dir.0, 64 << 20)).unwrap();
    let key = SharedKey { kind: EntryKind::Block, hash: 0x42 << 120 | 9 };
    let path = t.path_of(&key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    mkfifo(&path);
    let t = Arc::new(std::sync::Mutex::new(t));
    let (tt, p) = (t.clone(), pool.clone());
    let r = within_5s(&path, move || {
        tt.lock().unwrap().restore(&p, &key).map(drop).map_err(|e| e.variant_name())
    });
    let r = r.expect("restore blocked in open on a FIFO at the entry's name");
    assert_eq!(r, Err("Corrupt"));
    assert_eq!(pool.counts().unwrap().free_blocks, pool.counts().unwrap().num_blocks);
    mkfifo(&path);
    let tt = t.clone();
    let touched = within_5s(&path, move || tt.lock().unwrap_or_else(|e| e.into_inner()).touch(&key));
    assert!(!touched.expect("touch blocked in open on a FIFO at the entry's name"));
    assert!(!t.lock().unwrap_or_else(|e| e.into_inner()).contains(&key));
}

/// A key-value store in memory (the Mooncake Store's calls, for the store tier's tests).
#[derive(Debug, Default)]
struct MemStore(std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>);

impl v4pool::transfer::KvStore for MemStore {
    fn register_buffer(&self, _: u64, _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn unregister_buffer(&self, _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn exist(&self, keys: &[String]) -> std::io::Result<Vec<bool>> {
        let m = self.0.lock().unwrap();
        Ok(keys.iter().map(|k| m.contains_key(k)).collect())
    }
    fn size(&self, key: &str) -> std::io::Result<Option<u64>> {
        Ok(self.0.lock().unwrap().get(key).map(|v| v.len() as u64))
    }
    fn put(&self, key: &str, data: &[u8]) -> std::io::Result<()> {
        self.0.lock().unwrap().insert(key.to_string(), data.to_vec());
        Ok(())
    }
    fn get_into(&self, key: &str, dst: &mut [u8]) -> std::io::Result<()> {
        let m = self.0.lock().unwrap();
        let v = m.get(key).ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
        if v.len() != dst.len() {
            return Err(std::io::Error::other("size"));
        }
        dst.copy_from_slice(v);
        Ok(())
    }
    fn remove(&self, key: &str) -> std::io::Result<bool> {
        Ok(self.0.lock().unwrap().remove(key).is_some())
    }
}

#[test]
fn defect43_row7_a_store_tier_of_unbounded_capacity_restores() {
    use v4pool::transfer::StoreTier;
    let pool = carved(small_pool(host(), 24));
    let b = pool.alloc_block().unwrap().handle;
    let key = SharedKey { kind: EntryKind::Block, hash: 0x77 };
    let mut t = StoreTier::new(&pool, Box::new(MemStore::default()), u64::MAX).unwrap();
    assert!(t.publish(&pool, key, &[b]).unwrap());
    let r = t.restore(&pool, &key);
    assert!(r.is_ok(), "a published entry was refused: {r:?}");
    assert!(t.contains(&key), "the entry was removed");
    assert_eq!(r.unwrap().len(), 1);
}
