//! Shared-tier bench (CUDA): a V4-Flash prefix (fp8 and flashmla-v4 rows, FP8 indexer) of
//! 128K and 1M tokens, committed on a GPU pool, published — every block's unit and the
//! checkpoint ending the prefix — to the shared file tier through `std::fs` ([`StdFs`]) and
//! through NIXL's POSIX plugin ([`NixlPosix`], libaio unless `$V4POOL_NIXL_POSIX_PARAMS`
//! says otherwise), then restored by the admission of the hit on a fresh, poisoned pool:
//! GB/s of each, beside the host tier's spill (eviction from HBM) and restore (admission)
//! of the same prefix in the same run. Every restore is checked byte for byte against what
//! was written (every unit, and the checkpoint image), on a destination poisoned first.
//!
//! Method: wall-clock time of `complete_inflight` (publish, fsync on, as in production), of
//! `evict_all` (host spill) and of `admit` + `complete_inflight` (restores); median of
//! `--reps` (default 3) fresh writers, each into a fresh folder. A restore is timed twice:
//! **cold**, after `posix_fadvise(DONTNEED)` on every entry file (the page cache dropped, so
//! the bytes come from the device under `--dir`), and **warm**, right after (the page
//! cache's copy). The file system of `--dir` is printed: on tmpfs both are memory copies.
//!
//! `cargo bench --bench shared_tier -- --bench [--dir PATH] [--reps N] [--tokens 128k,1m]`.
//! `--dir`: where the tier's folders go (default: a fresh folder under /tmp); the bench
//! creates and removes its own folder inside. Without `--bench` (`cargo test --benches`) it
//! returns at once. Without a CUDA device it prints SKIP and runs the same check on the host
//! backend at a tiny shape (1K tokens, one rep); with `V4POOL_REQUIRE_GPU=1` it fails
//! instead. NIXL is `$V4POOL_NIXL_LIB` (docs/nixl.md): without it the NIXL rows print SKIP,
//! or fail with `V4POOL_REQUIRE_NIXL=1`.

#[allow(unused_imports)] // the shared bench helpers re-export items this bench does not need
mod common;

use common::{bench_requested, fmt_bytes, median, Rng};
use std::error::Error;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use v4pool::backend::cuda::CudaBackend;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::manager::{chain_hashes, BlockHash, FixedPolicy, KvManager, ManagerConfig, Namespace};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};
use v4pool::transfer::host_tier::{read_units, write_units};
use v4pool::transfer::nixl_file::posix_params_from_env;
use v4pool::transfer::{nixl, NixlPosix, SharedTier, SharedTierConfig, StdFs, TierIo};

type Res<T> = Result<T, Box<dyn Error>>;
const BLOCK: u64 = 256;
const FORMATS: [KvDtype; 2] = [KvDtype::Fp8, KvDtype::FlashMlaV4];
/// The word destinations are filled with before a restore (never zero: a zeroed pool would
/// pass a check against zeroed originals).
const POISON: u32 = 0xa5c3_5a3c;

extern "C" {
    // glibc; declared here because the crate has no libc dependency.
    fn posix_fadvise(fd: i32, offset: i64, len: i64, advice: i32) -> i32;
}
/// Linux's POSIX_FADV_DONTNEED.
const FADV_DONTNEED: i32 = 4;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Io {
    StdFs,
    Nixl,
}

impl Io {
    fn name(self) -> &'static str {
        match self {
            Io::StdFs => "std-fs",
            Io::Nixl => "nixl-posix",
        }
    }
}

struct Args {
    dir: PathBuf,
    reps: usize,
    tokens: Vec<u64>,
}

fn args() -> Res<Args> {
    let mut dir = None;
    let mut reps = 3;
    let mut tokens = vec![128 << 10, 1 << 20];
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dir" => dir = Some(PathBuf::from(it.next().ok_or("--dir needs a path")?)),
            "--reps" => reps = it.next().ok_or("--reps needs a count")?.parse()?,
            "--tokens" => {
                let list = it.next().ok_or("--tokens needs a list")?;
                tokens = list
                    .split(',')
                    .map(|t| {
                        let t = t.trim().to_ascii_lowercase();
                        let (n, scale) = match t.strip_suffix('k') {
                            Some(n) => (n, 1 << 10),
                            None => t.strip_suffix('m').map_or((t.as_str(), 1), |n| (n, 1 << 20)),
                        };
                        n.parse::<u64>().map(|n| n * scale)
                    })
                    .collect::<Result<_, _>>()?;
                if tokens.iter().any(|&t| t == 0 || t % BLOCK != 0) {
                    return Err(format!("--tokens {list}: whole blocks of {BLOCK} tokens").into());
                }
            }
            // `--bench` (cargo's) and anything the harness adds.
            _ => {}
        }
    }
    if reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    let dir = dir.unwrap_or_else(std::env::temp_dir);
    Ok(Args { dir, reps, tokens })
}

/// The file system type of the mount holding `dir` (longest mount point that prefixes it).
fn fs_type(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mut best: Option<(usize, String)> = None;
    for l in mounts.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 3 || !dir.starts_with(f[1]) {
            continue;
        }
        if best.as_ref().is_none_or(|b| f[1].len() > b.0) {
            best = Some((f[1].len(), format!("{} on {}", f[2], f[1])));
        }
    }
    best.map_or_else(|| "unknown".into(), |b| b.1)
}

/// A pool of `blocks` blocks and one slot for V4-Flash (one MTP layer) with `kv` rows.
fn pool(b: Arc<dyn Backend>, kv: KvDtype, blocks: i64) -> Res<Pool> {
    let model = ModelShape::v4_flash(1)?;
    let layout = PoolLayout::new(&model, kv, IndexerDtype::Fp8)?;
    let g = &layout.geometry;
    let rows = blocks * g.envelope_rows + 2 * (g.slot_rows + g.slot_align_rows.max(1));
    let spec = PoolSpec::from_layout(&layout, layout.carve(blocks, 1, rows)?)?;
    Ok(Pool::new(b, spec, Stream::DEFAULT)?)
}

/// Fill every byte of `pool` (planes and indexer) with [`POISON`].
fn poison(pool: &Pool) -> Res<()> {
    let mut ranges: Vec<(u64, u64)> =
        (0..pool.num_planes()).map(|p| Ok((pool.plane_ptr(p)?, pool.plane_bytes(p)?))).collect::<Res<_>>()?;
    if let Some(base) = pool.indexer_ptr() {
        for (parts, &off) in pool.indexer_parts().iter().zip(pool.indexer_offsets()) {
            let per_block: u64 = parts.iter().map(|p| p.block_bytes).sum();
            ranges.push((base + off, per_block * pool.indexer_blocks()));
        }
    }
    for (addr, len) in ranges {
        // SAFETY: the pool's own planes and indexer; lengths are multiples of 4.
        unsafe { pool.backend().fill_u32(addr, len / 4, POISON, pool.stream())? };
    }
    Ok(pool.backend().synchronize(pool.stream())?)
}

/// The conversation: a prefix of `n` tokens and one more block (so the hit is the prefix).
fn hashes(seed: u64, n: u64) -> Vec<BlockHash> {
    let mut r = Rng::new(seed);
    let t: Vec<u32> = (0..n + BLOCK).map(|_| r.next_u64() as u32).collect();
    chain_hashes(Namespace::from_label("deepseek-v4-flash@tier-bench"), None, &t, BLOCK as usize)
}

/// A manager over a fresh pool with room for `n` tokens of prefix and its checkpoint; a
/// host tier of `host_bytes` (0: none) and the shared tier in `dir` over `io`.
fn engine(b: &Arc<dyn Backend>, kv: KvDtype, n: u64, host_bytes: u64, dir: &Path, io: Io) -> Res<KvManager> {
    let blocks = (n / BLOCK) as i64 + 8;
    let p = pool(b.clone(), kv, blocks)?;
    let shared = SharedTierConfig::new(dir.to_path_buf(), u64::MAX / 4);
    let config = ManagerConfig::default()
        .with_checkpoint_every(0)
        .with_rolling(false)
        .with_host_tier_bytes(host_bytes)
        .with_shared_tier(shared.clone());
    let mut m = KvManager::new(Arc::new(p), config, Box::new(FixedPolicy::new(1)))?;
    if io == Io::Nixl {
        let t = SharedTier::with_io(m.pool(), &shared, Box::new(nixl_io()?))?;
        m.set_shared_tier(Some(Box::new(t)))?;
    }
    Ok(m)
}

/// The POSIX plugin's parameters: `$V4POOL_NIXL_POSIX_PARAMS`, else libaio (the queue the
/// bench is asked about; the plugin's own pick varies with what the machine has).
fn nixl_params() -> Vec<(String, String)> {
    let p = posix_params_from_env();
    if p.is_empty() {
        vec![("use_aio".into(), "true".into())]
    } else {
        p
    }
}

fn nixl_io() -> Res<NixlPosix> {
    Ok(NixlPosix::new(&nixl_params())?)
}

/// The slot's device ranges (every plane) at `position`.
fn slot_ranges(pool: &Pool, position: i64) -> Res<Vec<(u64, u64)>> {
    let g = pool.geometry()?;
    let (row, _) = g.slot_span(position)?;
    let widths = &pool.spec().plane_widths;
    widths
        .iter()
        .enumerate()
        .map(|(p, &w)| Ok((pool.plane_ptr(p)? + row as u64 * w, g.slot_bytes(w))))
        .collect()
}

/// Drop the page cache's copy of every file under `dir` (written and synced already).
fn drop_cache(dir: &Path) -> Res<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            drop_cache(&e.path())?;
        } else {
            let f = std::fs::File::open(e.path())?;
            // SAFETY: an open descriptor; advice only.
            let r = unsafe { posix_fadvise(f.as_raw_fd(), 0, 0, FADV_DONTNEED) };
            if r != 0 {
                return Err(format!("posix_fadvise({}): {r}", e.path().display()).into());
            }
        }
    }
    Ok(())
}

/// What a prefix was written with: its units (part-major, as the tiers store them) and its
/// checkpoint image.
struct Original<'a> {
    units: &'a [u8],
    checkpoint: Vec<u8>,
}

/// Admit the prefix (and one block more) on `m`, timed with the copies it queued; check the
/// hit is the whole prefix and its bytes are `want`'s. Returns seconds.
fn admit_checked(m: &mut KvManager, seed: u64, n: u64, want: &Original<'_>, what: &str) -> Res<f64> {
    let id = m.add_request(n + BLOCK, hashes(seed, n));
    let t = Instant::now();
    let hit = m.admit(id)?.hit_tokens;
    m.complete_inflight()?;
    let secs = t.elapsed().as_secs_f64();
    if hit != n {
        return Err(format!("{what}: hit {hit} of {n} tokens").into());
    }
    let blocks = m.block_handles(id)?;
    let got = read_units(m.pool(), &blocks[..(n / BLOCK) as usize])?;
    if got != want.units {
        let at = got.iter().zip(want.units).position(|(a, b)| a != b);
        return Err(format!("{what}: restored units differ from the originals (first at byte {at:?})").into());
    }
    let slot = m.slot(id)?.ok_or("no slot after admission")?;
    if m.pool().checkpoint(slot.handle)?.bytes() != want.checkpoint.as_slice() {
        return Err(format!("{what}: the restored checkpoint differs from the original").into());
    }
    m.finish(id)?;
    Ok(secs)
}

#[derive(Default)]
struct Times {
    publish: Vec<f64>,
    cold: Vec<f64>,
    warm: Vec<f64>,
    host_spill: Vec<f64>,
    host_restore: Vec<f64>,
    bytes: u64,
    host_bytes: u64,
}

/// One rep for one I/O: a writer commits and publishes the prefix (and, with `host`, spills
/// it to its host tier and restores it from there); a fresh reader restores it cold, then warm.
#[allow(clippy::too_many_arguments)]
fn rep(
    b: &Arc<dyn Backend>,
    kv: KvDtype,
    n: u64,
    seed: u64,
    data: &[u8],
    dir: &Path,
    io: Io,
    host: bool,
    out: &mut Times,
) -> Res<()> {
    std::fs::create_dir_all(dir)?;
    let units = n / BLOCK;
    let unit_bytes = data.len() as u64 / units;
    // Room for the prefix and its checkpoint (a checkpoint is a few units).
    let host_bytes = if host { (units + 16) * unit_bytes } else { 0 };
    let mut w = engine(b, kv, n, host_bytes, dir, io)?;
    let a = w.add_request(n, hashes(seed, n)[..units as usize].to_vec());
    if w.admit(a)?.hit_tokens != 0 {
        return Err("a fresh writer hit".into());
    }
    w.allocate(a, n)?;
    let pool = w.pool().clone();
    write_units(&pool, &w.block_handles(a)?, data)?;
    let slot = w.slot(a)?.ok_or("no slot")?;
    let mut rng = Rng::new(seed ^ 0x5107);
    for (addr, len) in slot_ranges(&pool, slot.position)? {
        // SAFETY: the slot's own rows in the pool's planes.
        unsafe { pool.backend().upload(addr, &rng.bytes(len as usize), pool.stream())? };
    }
    pool.backend().synchronize(pool.stream())?;
    w.commit(a, n)?;
    let t = Instant::now();
    w.complete_inflight()?;
    out.publish.push(t.elapsed().as_secs_f64());
    let s = w.stats();
    if (s.shared_published_blocks, s.shared_published_checkpoints, s.shared_write_failures) != (units, 1, 0) {
        return Err(format!("{}: published {s:?}", io.name()).into());
    }
    out.bytes = s.shared_published_bytes;
    let want = Original { units: data, checkpoint: pool.checkpoint(slot.handle)?.bytes().to_vec() };
    w.finish(a)?;
    if host {
        let t = Instant::now();
        w.evict_all()?;
        out.host_spill.push(t.elapsed().as_secs_f64());
        let s0 = w.stats();
        if (s0.tier_spilled_blocks, s0.tier_spilled_checkpoints) != (units, 1) {
            return Err(format!("host spill: {s0:?}").into());
        }
        poison(&pool)?;
        let secs = admit_checked(&mut w, seed, n, &want, "host tier")?;
        let s1 = w.stats();
        if s1.tier_restored_blocks != units || s1.shared_restored_blocks != 0 {
            return Err(format!("host restore came from elsewhere: {s1:?}").into());
        }
        out.host_restore.push(secs);
        out.host_bytes = s0.tier_spilled_bytes;
    }
    drop(w);
    drop(pool);
    let mut r = engine(b, kv, n, 0, dir, io)?;
    poison(r.pool())?;
    drop_cache(dir)?;
    out.cold.push(admit_checked(&mut r, seed, n, &want, "shared tier (cold)")?);
    r.evict_all()?;
    poison(r.pool())?;
    out.warm.push(admit_checked(&mut r, seed, n, &want, "shared tier (warm)")?);
    let s = r.stats();
    if (s.shared_restored_blocks, s.shared_restored_checkpoints, s.shared_refused) != (2 * units, 2, 0) {
        return Err(format!("{}: restored {s:?}", io.name()).into());
    }
    r.evict_all()?;
    let c = r.pool().counts()?;
    if (c.free_blocks, c.free_slots) != (c.num_blocks, c.num_slots) {
        return Err("the reader holds something after finishing".into());
    }
    Ok(())
}

fn gbs(bytes: u64, secs: &mut [f64]) -> f64 {
    bytes as f64 / median(secs) / 1e9
}

/// Every format, size and I/O on `b`; `Ok(())` when every restore was byte-exact.
fn run(b: Arc<dyn Backend>, args: &Args, tokens: &[u64], reps: usize, ios: &[Io]) -> Res<()> {
    let root = args.dir.join(format!("v4pool-tier-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    println!("# tier directory {} ({}), fsync on, {reps} rep(s)", root.display(), fs_type(&root));
    let result = (|| -> Res<()> {
        for kv in FORMATS {
            for &n in tokens {
                let units = n / BLOCK;
                let unit_bytes: u64 = {
                    let p = pool(b.clone(), kv, 1)?;
                    let t = SharedTier::with_io(
                        &p,
                        &SharedTierConfig::new(root.clone(), 1 << 40).with_sync(false),
                        Box::new(StdFs) as Box<dyn TierIo>,
                    )?;
                    t.unit_bytes()
                };
                let seed = 0x35c0 + n + kv as u64;
                let data = Rng::new(seed).bytes((units * unit_bytes) as usize);
                let mut host = Times::default();
                for &io in ios {
                    let mut t = Times::default();
                    for i in 0..reps {
                        let dir = root.join(format!("{}-{n}-{}-{i}", kv.name(), io.name()));
                        let r = rep(&b, kv, n, seed, &data, &dir, io, io == ios[0], &mut t);
                        let _ = std::fs::remove_dir_all(&dir);
                        r.map_err(|e| format!("{} {n} tokens over {}: {e}", kv.name(), io.name()))?;
                    }
                    println!(
                        "{:<11} {n:>8} tokens {:<10}: {} ({units} blocks + 1 checkpoint): publish {:.2} GB/s, \
                         restore cold {:.2} GB/s, warm {:.2} GB/s, byte-exact",
                        kv.name(),
                        io.name(),
                        fmt_bytes(t.bytes),
                        gbs(t.bytes, &mut t.publish),
                        gbs(t.bytes, &mut t.cold),
                        gbs(t.bytes, &mut t.warm),
                    );
                    if io == ios[0] {
                        host = t;
                    }
                }
                println!(
                    "{:<11} {n:>8} tokens {:<10}: {}: spill {:.2} GB/s, restore {:.2} GB/s, byte-exact",
                    kv.name(),
                    "host tier",
                    fmt_bytes(host.host_bytes),
                    gbs(host.host_bytes, &mut host.host_spill),
                    gbs(host.host_bytes, &mut host.host_restore),
                );
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&root);
    result
}

/// The I/Os to measure: std::fs, and NIXL when its library is there.
fn ios() -> Res<Vec<Io>> {
    match nixl::unavailable_reason() {
        None => {
            println!("# NIXL POSIX params {:?}", nixl_params());
            Ok(vec![Io::StdFs, Io::Nixl])
        }
        Some(why) => {
            if std::env::var("V4POOL_REQUIRE_NIXL").is_ok_and(|v| v == "1") {
                return Err(format!("V4POOL_REQUIRE_NIXL=1 but NIXL is unavailable: {why}").into());
            }
            println!("SKIP: NIXL POSIX rows: NIXL unavailable ({why})");
            Ok(vec![Io::StdFs])
        }
    }
}

fn main() -> Res<()> {
    if !bench_requested() {
        return Ok(());
    }
    let args = args()?;
    match CudaBackend::new(0) {
        Ok(gpu) => {
            println!("# shared-tier bench on CUDA device 0");
            let ios = ios()?;
            run(Arc::new(gpu), &args, &args.tokens, args.reps, &ios)
        }
        Err(e) => {
            if std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                return Err(format!("V4POOL_REQUIRE_GPU=1 but no CUDA device: {e}").into());
            }
            println!("SKIP: no CUDA device ({e}); shared-tier bench: host-backend check at 1K tokens");
            let ios = ios()?;
            run(Arc::new(HostBackend::new()), &args, &[4 * BLOCK], 1, &ios)?;
            println!("host-backend check OK (not a measurement)");
            Ok(())
        }
    }
}
