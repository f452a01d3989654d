//! GPU bench (CUDA) of the §9 DSpark window gather: fp8 two-plane (dequantising) and bf16
//! one-plane gathers of a V4-Flash-DSpark draft layer's ring (drafts dense, ring 133 = window
//! 128 + 5 draft tokens) at batches 1, 64, 256, 1,024 with Wd = 128, and Wd = 133 (the whole
//! ring) at batch 256; each beside an empty kernel's graph replay and a memset of the bytes the
//! gather writes, measured in the same run.
//!
//! Method (as benches/gpu.rs): the median of the device time between two events around one
//! graph replay, after warm-up; before every repetition, outside the events, a 256 MiB memset
//! evicts L2 and the next batch is staged (batches rotate: distinct slots of a 1,024-slot pool,
//! random anchors, so reads come from DRAM as in a decode step). Every configuration is first
//! checked: sequences on slots with fresh random rows are compared with the host reference's
//! row formula and dequantisation.
//!
//! Grep-able: `window_gather <variant> B=<B> Wd=<Wd> v4pool_us=… memset_us=… empty_us=…`.
//! `cargo bench --bench window_gather` (passes `--bench`); without it the binary returns.

mod common;

use common::graph::{GraphTimer, GRAPH_REPS as REPS, GRAPH_WARM as WARM, S};
use common::{bench_requested, fmt_bytes, Rng};
use std::error::Error;
use std::sync::Arc;
use v4pool::backend::cuda::{self, CudaBackend};
use v4pool::backend::Backend;
use v4pool::model::{DraftMode, ModelShape};
use v4pool::pool::ArenaLayout;
use v4pool::pool::{Pool, PoolSpec, SlotLease};
use v4pool::raw::index::host::dequant_fp8_row;
use v4pool::raw::index::Launch;
use v4pool::sizing::{IndexerDtype, KvDtype, KvSpec};
use v4pool::state::gather::{GatherCapacity, GatherSeq, WindowGather};

type Res<T> = Result<T, Box<dyn Error>>;

const SLOTS: i64 = 1024;
const SPEC_STEPS: i64 = 5;
const ROTATE: usize = 4;
/// Sequences whose rows are checked against the host formula before timing.
const CHECKED: usize = 4;

/// A V4-Flash-DSpark (dense drafts) pool of `slots` slots, all leased.
fn pool(dev: Arc<dyn Backend>, fp8: bool, slots: i64) -> Res<(Arc<Pool>, Vec<SlotLease>)> {
    let model = ModelShape::v4_flash_dspark(SPEC_STEPS, DraftMode::Dense)?;
    let kv = if fp8 { KvDtype::Fp8 } else { KvDtype::Bf16 };
    let widths = kv.plane_widths();
    let arena = ArenaLayout::for_model(&model, &widths)?;
    let probe = model
        .geometry_spec(0, 0)
        .arena_rows(arena.arena_rows())
        .slot_align_rows(arena.slot_align_rows())
        .build()?;
    // One slot span beyond the slots: a few blocks beside them (the gather reads no block).
    let blocks = (probe.slot_rows / probe.envelope_rows).min(16);
    let geometry = probe.with_capacity(blocks, slots, Some((slots + 1) * probe.slot_rows))?;
    let kv = KvSpec::new(&model, kv, IndexerDtype::Fp8, None)?;
    let spec = PoolSpec::new(geometry, widths, arena, None, model.csa_layers())?.with_kv_spec(kv)?;
    let pool = Arc::new(Pool::new(dev, spec, S)?);
    let leases = (0..slots).map(|_| pool.alloc_slot()).collect::<Result<Vec<_>, _>>()?;
    Ok((pool, leases))
}

/// Fresh random bytes in the window rows of the first CHECKED leases (valid fp8 rows: no NaN
/// values, plausible scales).
fn fill(pool: &Pool, leases: &[SlotLease], rng: &mut Rng) -> Res<()> {
    let g = &pool.spec().geometry;
    for l in &leases[..CHECKED] {
        for (p, &w) in pool.spec().plane_widths.iter().enumerate() {
            let mut bytes: Vec<u8> =
                (0..(g.slot_rows - g.arena_rows) as u64 * w).map(|_| (rng.next_u64() >> 40) as u8).collect();
            if w == 512 {
                for row in bytes.chunks_exact_mut(512) {
                    row[..448].iter_mut().filter(|b| **b & 0x7f == 0x7f).for_each(|b| *b ^= 1);
                    for t in 0..7 {
                        row[448 + 2 * t] = 100 + (rng.next_u64() % 50) as u8;
                    }
                }
            }
            pool.write_slot(l.handle, p, g.arena_rows as u64 * w, &bytes)?;
        }
    }
    Ok(())
}

/// `n` sequences on distinct slots (the first CHECKED of them the filled ones), random anchors.
fn batch(rng: &mut Rng, leases: &[SlotLease], n: usize) -> Vec<GatherSeq> {
    let mut order: Vec<usize> = (0..leases.len()).collect();
    for i in (CHECKED + 1..order.len()).rev() {
        order.swap(i, CHECKED + (rng.next_u64() % (i - CHECKED + 1) as u64) as usize);
    }
    (0..n)
        .map(|i| {
            GatherSeq::new(
                leases[order[i]].handle,
                if i == 1 { 3 } else { (rng.next_u64() % 1_000_000) as i64 },
                None,
            )
        })
        .collect()
}

/// The first CHECKED sequences' rows of `g`'s last gather against the spec: zeros below
/// position 0, else the row `window_params.index` names, dequantised by the host reference.
fn check(pool: &Pool, g: &WindowGather, layer: usize, b: &[GatherSeq], wd: usize) -> Res<()> {
    let spec = pool.spec();
    let geo = &spec.geometry;
    let params = geo.window_params(geo.ratios[layer])?;
    let got = g.read_output()?;
    let got: &[u8] = bytemuck::cast_slice(&got);
    for (i, s) in b.iter().take(CHECKED).enumerate() {
        let pos = pool.slot_position(s.slot)?;
        for k in 0..wd {
            let p = s.anchor - (wd as i64 - 1) + k as i64;
            let mut want = vec![0u8; 1024];
            if p >= 0 {
                let row = (geo.layer_base_row(layer)? + params.index(pos, p)) as u64;
                if spec.plane_widths.len() == 2 {
                    let (mut nope, mut rope) = (vec![0u8; 512], vec![0u8; 128]);
                    pool.read_plane(0, row * 512, &mut nope)?;
                    pool.read_plane(1, row * 128, &mut rope)?;
                    dequant_fp8_row(&nope, &rope, &mut want);
                } else {
                    pool.read_plane(0, row * 1024, &mut want)?;
                }
            }
            let at = (i * wd + k) * 1024;
            if got[at..at + 1024] != want[..] {
                return Err(format!("check failed: sequence {i} window row {k} (position {p})").into());
            }
        }
    }
    Ok(())
}

fn run() -> Res<()> {
    let be = CudaBackend::new(0)?;
    println!("device: {}, window gather bench (V4-Flash-DSpark dense drafts, ring 133)", be.device_name());
    println!(
        "method: median of {REPS} graph replays after {WARM} warm-up, a 256 MiB memset before each (cold L2)"
    );
    let t = GraphTimer::new(&be)?;
    let empty = t.capture(|| {
        // SAFETY: the empty kernel touches nothing.
        unsafe { t.be.launch(&Launch::Empty, S)? };
        Ok(())
    })?;
    let scratch = be.alloc_zeroed(SLOTS as u64 * 133 * 1024)?;
    let mut rng = Rng::new(0x5eed_9a7e);
    for (variant, fp8) in [("fp8", true), ("bf16", false)] {
        let (pool, leases) = pool(Arc::new(be.clone()), fp8, SLOTS)?;
        fill(&pool, &leases, &mut rng)?;
        let layer = *ModelShape::v4_flash_dspark(SPEC_STEPS, DraftMode::Dense)?
            .draft_layers
            .first()
            .ok_or("no draft")?;
        for (n, wd) in [(1, 128), (64, 128), (256, 128), (1024, 128), (256, 133)] {
            let mut g = pool.window_gather(GatherCapacity::new(n, wd))?;
            let batches: Vec<Vec<GatherSeq>> = (0..ROTATE).map(|_| batch(&mut rng, &leases, n)).collect();
            g.stage(&batches[0])?;
            g.gather(layer, wd)?;
            check(&pool, &g, layer, &batches[0], wd)?;
            let out = g.output().ok_or("no output")?;
            let launch = g.gather_launch(layer, wd, out.ptr)?;
            let graph = t.capture(|| {
                // SAFETY: the launch names the pool's planes and the handle's buffers, which
                // outlive the graph (dropped at the end of this iteration, first).
                unsafe { t.be.launch(&launch, S)? };
                Ok(())
            })?;
            let g = std::cell::RefCell::new(g);
            let (us, p10, p90) =
                t.replay(&graph, |i| Ok(g.borrow_mut().stage(&batches[i % ROTATE]).map(|_| ())?))?;
            let written = (n * wd * 1024) as u64;
            let memset = t.capture(|| {
                // SAFETY: the scratch buffer holds SLOTS × 133 rows ≥ n × wd.
                unsafe { t.be.fill_u32(scratch.ptr, written / 4, 0x5a5a_5a5a, S)? };
                Ok(())
            })?;
            let (memset_us, ..) = t.replay(&memset, |_| Ok(()))?;
            let (empty_us, ..) = t.replay(&empty, |_| Ok(()))?;
            println!(
                "window_gather {variant} B={n} Wd={wd} v4pool_us={us:.2} memset_us={memset_us:.2} empty_us={empty_us:.2} \
                 p10_us={p10:.2} p90_us={p90:.2} written={} ratio_memset={:.2}",
                fmt_bytes(written),
                us / memset_us
            );
            drop(graph);
            be.synchronize(S)?;
        }
    }
    be.synchronize(S)?;
    // SAFETY: the stream is drained and no graph names these any more.
    unsafe {
        be.free(scratch);
        t.release();
    }
    Ok(())
}

/// The bench's pools, batches and check on the host backend (no GPU): a dry run of everything
/// but the timing, with a few slots.
fn host_check() -> Res<()> {
    let mut rng = Rng::new(0x5eed_9a7e);
    let layer =
        *ModelShape::v4_flash_dspark(SPEC_STEPS, DraftMode::Dense)?.draft_layers.first().ok_or("no draft")?;
    for fp8 in [true, false] {
        let (pool, leases) = pool(Arc::new(v4pool::backend::host::HostBackend::new()), fp8, 8)?;
        fill(&pool, &leases, &mut rng)?;
        for (n, wd) in [(1, 128), (6, 133)] {
            let mut g = pool.window_gather(GatherCapacity::new(n, wd))?;
            let b = batch(&mut rng, &leases, n);
            g.stage(&b)?;
            g.gather(layer, wd)?;
            check(&pool, &g, layer, &b, wd)?;
            println!("host check ok: fp8={fp8} B={n} Wd={wd}");
        }
    }
    Ok(())
}

fn main() {
    if std::env::args().any(|a| a == "--host-check") {
        if let Err(e) = host_check() {
            eprintln!("window_gather host check failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    if !bench_requested() {
        println!("window_gather bench: run with --bench (cargo bench --bench window_gather)");
        return;
    }
    if !cuda::is_available() {
        let why = cuda::device_count().err().map_or("no device".to_string(), |e| e.to_string());
        if std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("window_gather bench: V4POOL_REQUIRE_GPU=1 but no CUDA device: {why}");
            std::process::exit(1);
        }
        println!("window_gather bench: SKIPPED — no CUDA device ({why})");
        return;
    }
    if let Err(e) = run() {
        eprintln!("window_gather bench failed: {e}");
        std::process::exit(1);
    }
}
