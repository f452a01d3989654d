//! Host-side costs of the pool: allocators and boundary moves (ns/op), plan and layout
//! construction, and the host's O(batch) share of a decode step (staging), in µs.
//!
//! `cargo bench --bench host` (cargo passes `--bench`); without `--bench` (e.g. under
//! `cargo test --benches`) it returns at once. Each figure is the median over several runs
//! of a timed loop of many iterations (`std::time::Instant`, `black_box` on inputs and
//! results); min and max over the runs are printed beside it.

mod common;
#[path = "../tests/common/mod.rs"]
mod tests_common;

use common::{bench_requested, fmt_bytes, median, met, random_decode_batch, Rng};
use std::error::Error;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;
use v4pool::backend::host::HostBackend;
use v4pool::geometry::{GeometrySpec, UnifiedPoolGeometry};
use v4pool::model::ModelShape;
use v4pool::pool::Boundary;
use v4pool::pool::{DecodeCapacity, DecodeSeq, Pool};
use v4pool::raw::alloc::{BlockPool, SlotHandle, SlotPool};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, Plan, PlanRequest};

type Res<T> = Result<T, Box<dyn Error>>;

const RUNS: usize = 9;
const GIB: u64 = 1 << 30;
/// Target for one block alloc+free pair.
const BLOCK_PAIR_TARGET_NS: f64 = 100.0;

/// Median, min, max of per-op time over runs, in ns.
struct Stat {
    med: f64,
    min: f64,
    max: f64,
}

/// Run `body(iters)` `RUNS` times (after one warm-up run); each run's time over `ops` ops.
fn measure(ops: u64, mut body: impl FnMut() -> Res<()>) -> Res<Stat> {
    body()?;
    let mut v = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t0 = Instant::now();
        body()?;
        v.push(t0.elapsed().as_nanos() as f64 / ops as f64);
    }
    let med = median(&mut v);
    Ok(Stat { med, min: v[0], max: v[v.len() - 1] })
}

fn row(name: &str, s: &Stat, unit: &str, note: &str) {
    let k = if unit == "µs" { 1e-3 } else { 1.0 };
    println!(
        "  {name:<58} {:>10.1} {unit:<5} [min {:>9.1}, max {:>9.1}] {note}",
        s.med * k,
        s.min * k,
        s.max * k
    );
}

fn flash_plan(seqs: i64, budget: u64) -> Res<Plan> {
    let m = ModelShape::v4_flash(1)?;
    Ok(plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget))?)
}

/// A host pool for the staging bench: V4-Flash's layers, block size and ring with `g`'s block
/// and slot counts, but 16-byte rows and a one-field arena (the tests' index pool). Staging
/// reads only the pool's live positions and block count (and the layer pattern's classes); a
/// pool of the plan itself would take its whole budget of host address space.
fn staging_pool(g: &UnifiedPoolGeometry) -> Res<Arc<Pool>> {
    let spec = GeometrySpec::new(g.ratios.clone(), g.num_blocks, g.num_slots, g.ring_slots, g.block_size);
    tests_common::try_index_pool_of(Arc::new(HostBackend::new()), spec)
}

fn allocators() -> Res<bool> {
    println!("\n== allocators (ns per op pair; {RUNS} runs, median [min, max])");
    // Block pool at production size, half its blocks held, the rest free.
    let n: u32 = 500_000;
    let mut blocks = BlockPool::new(n)?;
    let mut held = Vec::new();
    for _ in 0..n / 2 {
        held.push(blocks.alloc()?.handle);
    }
    const PAIRS: u64 = 2_000_000;
    let pair = measure(PAIRS, || {
        for _ in 0..PAIRS {
            let g = blocks.alloc()?;
            blocks.free_handle(black_box(g.handle))?;
        }
        Ok(())
    })?;
    let ok = pair.med < BLOCK_PAIR_TARGET_NS;
    row(
        "block alloc+free pair (500k blocks, half held)",
        &pair,
        "ns",
        &format!("target < {BLOCK_PAIR_TARGET_NS} ns: {}", met(ok)),
    );

    // Churn: 256 allocations, then their frees in random order (a decode step's worth).
    let mut rng = Rng::new(1);
    let mut order: Vec<usize> = (0..256).collect();
    let mut batch = Vec::with_capacity(256);
    const ROUNDS: u64 = 8_000;
    let churn = measure(ROUNDS * 256, || {
        for _ in 0..ROUNDS {
            batch.clear();
            for _ in 0..256 {
                batch.push(blocks.alloc()?.handle);
            }
            rng.shuffle(&mut order);
            for &i in &order {
                blocks.free_handle(black_box(batch[i]))?;
            }
        }
        Ok(())
    })?;
    row("block alloc×256 then free×256 shuffled (per pair)", &churn, "ns", "");

    let n: u32 = 1024;
    let mut slots = SlotPool::new(n)?;
    for _ in 0..n / 2 {
        slots.alloc()?;
    }
    let spair = measure(PAIRS, || {
        for _ in 0..PAIRS {
            let h = slots.alloc()?;
            slots.free_handle(black_box(h))?;
        }
        Ok(())
    })?;
    row("slot alloc+free pair (1,024 groups, half held)", &spair, "ns", "");
    Ok(ok)
}

fn boundary() -> Res<()> {
    println!("\n== boundary (V4-Flash fp8, 100 GiB plan, 256 slots; ns per operation pair)");
    let p = flash_plan(256, 100 * GIB)?;
    let mut b = Boundary::new(&p.geometry)?;
    const CYCLES: u64 = 20_000;
    // Without relocations: the group that comes and goes is vacant.
    let plain = measure(CYCLES, || {
        for _ in 0..CYCLES {
            let c = b.grow_slots(1)?;
            black_box(&c);
            let c = b.shrink_slots(1)?;
            if !c.slot_moves.is_empty() {
                return Err("unexpected relocation".into());
            }
            black_box(&c);
        }
        Ok(())
    })?;
    row("grow_slots(1) + shrink_slots(1), no relocation", &plain, "ns", "");

    // With one relocation per cycle: every group held; grow one slot, hold it, free a
    // random lower group, shrink: the top group's request moves into the freed one.
    let mut handles: Vec<SlotHandle> = Vec::new();
    while b.slots().num_free() > 0 {
        handles.push(b.alloc_slot()?);
    }
    handles.sort_by_key(|h| h.group);
    let ns = b.num_slots() as usize;
    let mut rng = Rng::new(2);
    let reloc = measure(CYCLES, || {
        for _ in 0..CYCLES {
            b.grow_slots(1)?;
            let top = b.alloc_slot()?;
            let g = rng.range(0, ns as i64) as usize;
            b.free_slot(handles[g])?;
            let c = b.shrink_slots(1)?;
            match c.slot_moves.as_slice() {
                [m] if m.old == top && m.new.group as usize == g => handles[g] = m.new,
                _ => return Err(format!("expected one move of {top:?} to group {g}: {c:?}").into()),
            }
            black_box(&c);
        }
        Ok(())
    })?;
    row("grow_slots(1) + alloc + free + shrink_slots(1) with 1 move", &reloc, "ns", "");
    let only = measure(CYCLES, || {
        for _ in 0..CYCLES {
            b.grow_slots(1)?;
            let top = b.alloc_slot()?;
            b.free_slot(black_box(top))?;
            b.shrink_slots(1)?;
        }
        Ok(())
    })?;
    row("  same without the move (grow + alloc + free top + shrink)", &only, "ns", "");
    println!("  → one slot relocation's bookkeeping ≈ {:.0} ns", reloc.med - only.med);
    Ok(())
}

fn plans() -> Res<()> {
    println!("\n== plan and layout construction (µs per call)");
    let flash = ModelShape::v4_flash(1)?;
    let pro = ModelShape::v4_pro(1)?;
    for (name, m, budget) in [("V4-Flash", &flash, 100 * GIB), ("V4-Pro", &pro, 100 * GIB)] {
        let req = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, budget);
        let p = plan(m, &req)?;
        const N: u64 = 2_000;
        let s = measure(N, || {
            for _ in 0..N {
                black_box(plan(black_box(m), black_box(&req))?);
            }
            Ok(())
        })?;
        row(
            &format!("sizing::plan {name} fp8/fp8, 256 seqs, 100 GiB"),
            &s,
            "µs",
            &format!("(plane_rows {}, {} blocks)", p.plane_rows, p.num_blocks),
        );
        let spec = p.geometry.spec();
        let g = measure(N, || {
            for _ in 0..N {
                black_box(UnifiedPoolGeometry::new(black_box(spec.clone()))?);
            }
            Ok(())
        })?;
        row(&format!("UnifiedPoolGeometry::new {name} (the plan's carve)"), &g, "µs", "");
    }
    Ok(())
}

fn staging() -> Res<()> {
    println!("\n== decode staging on the host backend (µs per step; the host's share of a decode step)");
    let p = flash_plan(1024, 100 * GIB)?;
    let pool = staging_pool(&p.geometry)?;
    let g = &pool.spec().geometry;
    // The image holds whole block-table rows (capacity columns), so its size follows
    // batch × longest context, not batch alone: one short-context row shows the difference.
    for (batch, max_ctx) in
        [(1usize, 1_000_000i64), (64, 1_000_000), (256, 1_000_000), (1024, 1_000_000), (256, 32_768)]
    {
        let max_blocks = (max_ctx + g.block_size - 1) / g.block_size;
        let cap = DecodeCapacity::new(batch, batch, max_blocks as usize, 128, 512);
        let mut bufs = pool.decode_path(cap)?;
        // Several input sets, staged in rotation.
        let mut rng = Rng::new(3 + batch as u64);
        // (slot positions, contexts, block tables) per input set
        let sets: Vec<_> = (0..4).map(|_| random_decode_batch(&mut rng, g, batch, 1, max_ctx)).collect();
        let seqs: Vec<Vec<DecodeSeq<'_>>> = sets
            .iter()
            .map(|(pos, ctx, tables)| {
                (0..batch).map(|i| DecodeSeq::new(pos[i], ctx[i], 1, &tables[i])).collect()
            })
            .collect();
        let n: u64 = if batch >= 256 { 400 } else { 4_000 };
        let mut k = 0usize;
        let s = measure(n, || {
            for _ in 0..n {
                k = (k + 1) % seqs.len();
                black_box(bufs.stage(black_box(&seqs[k]))?);
            }
            Ok(())
        })?;
        // Metadata image: everything before the index buffers (block tables dominate).
        let meta = 4 * batch as u64 * (1 + 1 + 2 + 3) + 12 + 4 * batch as u64 * max_blocks as u64;
        row(
            &format!("DecodePath::stage, batch {batch}, contexts ≤ {max_ctx}"),
            &s,
            "µs",
            &format!("(~{} staged, block tables {} cols)", fmt_bytes(meta), max_blocks),
        );
        // Resident tables: only the per-token metadata moves each step.
        let s = measure(n, || {
            for _ in 0..n {
                k = (k + 1) % seqs.len();
                black_box(bufs.stage_resident(black_box(&seqs[k]))?);
            }
            Ok(())
        })?;
        row(
            &format!("DecodePath::stage_resident, batch {batch}, contexts ≤ {max_ctx}"),
            &s,
            "µs",
            &format!("(~{} staged: tokens only)", fmt_bytes(4 * batch as u64 * 7 + 12)),
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    if !bench_requested() {
        println!("host bench: run with --bench (cargo bench --bench host)");
        return Ok(());
    }
    println!("v4pool host bench — {RUNS} runs per figure, median [min, max]");
    let block_ok = allocators()?;
    boundary()?;
    plans()?;
    staging()?;
    println!("\nTARGETS");
    println!("  block alloc+free pair < {BLOCK_PAIR_TARGET_NS} ns: {}", met(block_ok));
    Ok(())
}
