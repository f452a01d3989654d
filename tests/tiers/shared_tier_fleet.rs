//! The shared tier across processes at V4-Flash scale (host backend, FP8 KV and indexer): a
//! prefix of 8K, 128K or 1M tokens one engine committed restores on an engine in another
//! process (this test binary re-run as a child) byte-exact — every block's unit (both planes
//! and the indexer cache) and the checkpoint (window rows and compressor state) — onto a
//! poisoned pool, with nothing left held afterwards. At 8K: a corrupt block entry in the
//! middle of the prefix, a truncated checkpoint entry and a pool of another layout are
//! misses (hit 0), never wrong bytes.
//!
//! Memory: a 1M-token prefix is 4,096 blocks of 1.04 MiB (4.3 GB of pool); the writer's pool
//! is dropped before the reader starts at 1M (two at once would need 9 GB), while at 8K and
//! 128K both pools are alive at once. The files (4.3 GB at 1M) go to the system's temporary
//! directory and are removed. A size whose files would not fit the disk's free space (with a
//! margin: CI's machines have had as little as a few GB free while other steps download) is
//! skipped with a printed SKIP line naming the bytes, or fails with `V4POOL_REQUIRE_DISK=1`; a
//! disk that fills during the write (another process took the space) is reported the same way,
//! never as a pass.
//!
//! Runs once per I/O (`tests/tier_io`): `std_fs::*` over `std::fs`, `nixl_posix::*` over
//! NIXL's POSIX plugin (skipped visibly without the library); the two never run at once
//! (memory, and the printed GB/s).

use crate::common;
use crate::tier_io;
use crate::transfer_common;

use common::Rng;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tier_io::Io;
use transfer_common::{block_ranges, poison_pool, read, slot_ranges, v4_pool, write};
use v4pool::backend::host::HostBackend;
use v4pool::backend::Backend;
use v4pool::manager::{chain_hashes, BlockHash, FixedPolicy, KvManager, ManagerConfig, Namespace};
use v4pool::model::ModelShape;
use v4pool::transfer::shared_tier::{checksum, TIER_DIR};
use v4pool::transfer::{EntryKind, SharedKey, SharedTier, SharedTierConfig};

const TOKENS: [u64; 3] = [8 << 10, 128 << 10, 1 << 20];
const BLOCK: u64 = 256;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

/// The conversation's tokens: a prefix of `n` and one more block.
fn tokens(seed: u64, n: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n + BLOCK).map(|_| r.next_u64() as u32).collect()
}

fn hashes(t: &[u32]) -> Vec<BlockHash> {
    chain_hashes(Namespace::from_label("deepseek-v4-flash@fleet-test"), None, t, BLOCK as usize)
}

/// A manager over a fresh V4-Flash pool (`mtp` MTP layers: 1, or 0 for another layout) with
/// room for `tokens` of prefix and its checkpoint, one slot, checkpoints only at prompt ends,
/// and the shared tier in `dir` over `io`.
fn engine(dir: &Path, tokens: u64, mtp: usize, io: Io) -> KvManager {
    let model = ModelShape::v4_flash(mtp as i64).unwrap();
    let blocks = (tokens / BLOCK) as i64 + 8;
    let (pool, _) = v4_pool(host(), &model, blocks, 1);
    let unit: u64 = block_ranges(&pool, 0).iter().map(|r| r.1).sum();
    // Twice the prefix: no eviction in these tests (tests/tiers/shared_tier.rs has them).
    let shared = SharedTierConfig::new(dir.to_path_buf(), 2 * (blocks as u64 + 8) * (unit + 4096));
    let config = ManagerConfig::default()
        .with_checkpoint_every(0)
        .with_rolling(false)
        .with_host_tier_bytes(0)
        .with_shared_tier(shared.clone());
    let mut m = KvManager::new(Arc::new(pool), config, Box::new(FixedPolicy::new(1))).unwrap();
    if io != Io::StdFs {
        io.install(&mut m, &shared);
    }
    m
}

/// The checksum of every block of `table` (its whole unit) and of the slot's checkpoint image
/// (the carried compressor state and the window rows), in order.
fn digest(m: &KvManager, id: v4pool::manager::RequestId) -> u128 {
    let pool = m.pool();
    let mut sums: Vec<u8> = Vec::new();
    for b in m.block_table(id).unwrap() {
        sums.extend(checksum(&read(pool, &block_ranges(pool, b as u32))).to_le_bytes());
    }
    let slot = m.slot(id).unwrap().unwrap();
    sums.extend(checksum(pool.checkpoint(slot.handle).unwrap().bytes()).to_le_bytes());
    checksum(&sums)
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Free bytes for an unprivileged writer on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-parameter of the right type.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    assert_eq!(rc, 0, "statvfs {}", dir.display());
    st.f_bavail as u64 * st.f_frsize as u64
}

/// `Some(reason)` when `need` bytes of entries (plus a 1 GiB margin for the rest of the
/// machine) do not fit the free space under `dir`; with `V4POOL_REQUIRE_DISK=1`, a failure.
fn disk_short(dir: &Path, need: u64, what: &str) -> Option<String> {
    let free = free_bytes(dir);
    if free >= need + (1 << 30) {
        return None;
    }
    let why = format!(
        "{what}: the entries need {:.2} GB and {:.2} GB are free under {} (margin 1 GiB)",
        need as f64 / 1e9,
        free as f64 / 1e9,
        dir.display()
    );
    assert!(std::env::var("V4POOL_REQUIRE_DISK").as_deref() != Ok("1"), "V4POOL_REQUIRE_DISK=1: {why}");
    Some(why)
}

/// The writer: commit a prefix of `n` tokens with random bytes in every block and in the
/// whole slot, and publish it (complete_inflight). Returns the manager (the request
/// finished, its blocks cached) and the prefix's digest; `Err` (why) when the disk has no
/// room for the entries (see the module docs).
fn commit_prefix(dir: &Path, n: u64, seed: u64, io: Io) -> Result<(KvManager, u128), String> {
    let t = tokens(seed, n);
    let mut m = engine(dir, n, 1, io);
    let unit: u64 = block_ranges(m.pool(), 0).iter().map(|r| r.1).sum();
    let slot_bytes: u64 = slot_ranges(m.pool(), 0).iter().map(|r| r.1).sum();
    let need = (n / BLOCK) * (unit + 4096) + slot_bytes + 4096;
    if let Some(why) = disk_short(dir, need, &format!("{n} tokens over {}", io.name())) {
        return Err(why);
    }
    let a = m.add_request(n, hashes(&t[..n as usize]));
    assert_eq!(m.admit(a).unwrap().hit_tokens, 0);
    m.allocate(a, n).unwrap();
    let mut rng = Rng::new(seed ^ 0xfeed);
    let pool = m.pool().clone();
    for b in m.block_table(a).unwrap() {
        let r = block_ranges(&pool, b as u32);
        write(&pool, &r, &rng.bytes(r.iter().map(|x| x.1 as usize).sum()));
    }
    let slot = m.slot(a).unwrap().unwrap();
    let r = slot_ranges(&pool, slot.position);
    write(&pool, &r, &rng.bytes(r.iter().map(|x| x.1 as usize).sum()));
    m.commit(a, n).unwrap();
    let t0 = Instant::now();
    m.complete_inflight().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let s = m.stats();
    if s.shared_write_failures > 0 {
        // Only a disk that filled under the write is a skip; any other failure fails.
        if let Some(why) =
            disk_short(dir, 64 * unit, &format!("{n} tokens over {}, after the write", io.name()))
        {
            return Err(format!(
                "the disk filled during the write ({} entries failed); {why}",
                s.shared_write_failures
            ));
        }
    }
    assert_eq!((s.shared_published_blocks, s.shared_published_checkpoints), (n / BLOCK, 1), "{s:?}");
    assert_eq!(s.shared_write_failures, 0);
    println!(
        "writer ({}): {n} tokens: published {} blocks and 1 checkpoint, {:.2} GB in {secs:.2} s ({:.2} GB/s, \
         fsync on)",
        io.name(),
        n / BLOCK,
        s.shared_published_bytes as f64 / 1e9,
        gbps(s.shared_published_bytes, secs)
    );
    let want = digest(&m, a);
    m.finish(a).unwrap();
    Ok((m, want))
}

/// Run the reader in a child process; its report line.
fn reader(dir: &Path, n: u64, seed: u64, mtp: usize, io: Io) -> String {
    let out = common::child_test(module_path!(), "child_fleet_reader")
        .env("V4POOL_FLEET_DIR", dir)
        .env("V4POOL_FLEET_TOKENS", n.to_string())
        .env("V4POOL_FLEET_SEED", seed.to_string())
        .env("V4POOL_FLEET_MTP", mtp.to_string())
        .env("V4POOL_TIER_IO", io.name())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "reader failed:\n{text}");
    let line = text.lines().find_map(|l| l.find("reader: hit=").map(|at| &l[at..]));
    line.unwrap_or_else(|| panic!("no report:\n{text}")).to_string()
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    let at =
        line.find(&format!("{name}=")).unwrap_or_else(|| panic!("{name} not in {line}")) + name.len() + 1;
    line[at..].split_whitespace().next().unwrap()
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp(tag: &str, io: Io) -> TempDir {
    let d = std::env::temp_dir().join(format!("v4pool-fleet-{tag}-{}-{}", io.name(), std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

fn a_prefix_committed_in_one_process_restores_in_another(io: Io) {
    // The I/Os' runs one at a time (two 1M-token pools would need 9 GB).
    let _one = common::large_pools();
    for (i, &n) in TOKENS.iter().enumerate() {
        let dir = temp(&format!("{n}"), io);
        let seed = 0x35_0000 + i as u64;
        let (writer, want) = match commit_prefix(&dir.0, n, seed, io) {
            Ok(w) => w,
            Err(why) => {
                println!("SKIP: {why}");
                continue;
            }
        };
        // Two pools at once in two processes, except at 1M (memory: see the module docs).
        let writer = if n >= 1 << 20 {
            drop(writer);
            None
        } else {
            Some(writer)
        };
        let line = reader(&dir.0, n, seed, 1, io);
        println!("{line}");
        assert_eq!(field(&line, "hit"), n.to_string(), "{line}");
        assert_eq!(field(&line, "digest"), format!("{want:032x}"), "the restored bytes differ: {line}");
        assert_eq!(field(&line, "refused"), "0");
        if let Some(mut w) = writer {
            w.evict_all().unwrap();
            let c = w.pool().counts().unwrap();
            assert_eq!(c.free_blocks, c.num_blocks);
        }
        if n == TOKENS[0] {
            refusals(&dir.0, n, seed, io);
        }
    }
}

per_io!(a_prefix_committed_in_one_process_restores_in_another);

/// At 8K: a corrupt block in the middle, a truncated checkpoint and another layout: misses.
fn refusals(dir: &Path, n: u64, seed: u64, io: Io) {
    // Another layout (no MTP layer) finds nothing of this one's.
    let line = reader(dir, n, seed, 0, io);
    assert_eq!(field(&line, "hit"), "0", "{line}");
    println!("another layout: {line}");
    let pool = engine(dir, n, 1, Io::StdFs).pool().clone();
    let tier = SharedTier::new(&pool, &SharedTierConfig::new(dir, 1 << 40).with_sync(false)).unwrap();
    let hs = hashes(&tokens(seed, n)[..n as usize]);
    let mid = tier.path_of(&SharedKey { kind: EntryKind::Block, hash: hs[hs.len() / 2].0 });
    let mut bytes = std::fs::read(&mid).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 4;
    std::fs::write(&mid, bytes).unwrap();
    let line = reader(dir, n, seed, 1, io);
    println!("corrupt block: {line}");
    assert_eq!((field(&line, "hit"), field(&line, "refused")), ("0", "1"), "{line}");
    assert!(!mid.exists(), "the corrupt entry stays");
    let ck = tier.path_of(&SharedKey { kind: EntryKind::Checkpoint, hash: hs[hs.len() - 1].0 });
    let len = std::fs::metadata(&ck).unwrap().len();
    std::fs::File::options().write(true).open(&ck).unwrap().set_len(len - 4096).unwrap();
    let line = reader(dir, n, seed, 1, io);
    println!("truncated checkpoint: {line}");
    assert_eq!(field(&line, "hit"), "0", "{line}");
    assert!(dir.join(TIER_DIR).exists());
}

/// The reader half, in a child process: a fresh poisoned pool admits the prefix and one
/// more block, and reports the hit and the digest of what was restored; then everything
/// goes back.
#[test]
#[ignore = "run as a child process by {std_fs,nixl_posix}::a_prefix_committed_in_one_process_restores_in_another"]
fn child_fleet_reader() {
    let (Ok(dir), Ok(n), Ok(seed), Ok(mtp)) = (
        std::env::var("V4POOL_FLEET_DIR"),
        std::env::var("V4POOL_FLEET_TOKENS"),
        std::env::var("V4POOL_FLEET_SEED"),
        std::env::var("V4POOL_FLEET_MTP"),
    ) else {
        println!("SKIP: child_fleet_reader runs only as a child of the fleet test");
        return;
    };
    let (n, seed, mtp): (u64, u64, usize) = (n.parse().unwrap(), seed.parse().unwrap(), mtp.parse().unwrap());
    let io = Io::from_env();
    let mut m = engine(Path::new(&dir), n, mtp, io);
    poison_pool(m.pool());
    let t = tokens(seed, n);
    let b = m.add_request(n + BLOCK, hashes(&t));
    let t0 = Instant::now();
    let hit = m.admit(b).unwrap().hit_tokens;
    let secs = t0.elapsed().as_secs_f64();
    m.complete_inflight().unwrap();
    m.check_invariants().unwrap();
    let d = digest(&m, b);
    let s = m.stats();
    m.finish(b).unwrap();
    m.evict_all().unwrap();
    let c = m.pool().counts().unwrap();
    assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "the reader holds something");
    println!(
        "reader: hit={hit} digest={d:032x} refused={} restored_blocks={} restored_checkpoints={} \
         admit_s={secs:.3} restore_gbps={:.2} io={}",
        s.shared_refused,
        s.shared_restored_blocks,
        s.shared_restored_checkpoints,
        gbps(s.shared_restored_bytes, secs),
        io.name()
    );
}
