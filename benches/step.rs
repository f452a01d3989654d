//! The pool's whole share of one DeepSeek-V4 decode step as one CUDA graph (issue 34): per
//! docs/forward.md the decode builder, then per trunk layer in the model's order the token's
//! own rows, the emitted compressed rows, the index keys, the compressor-state updates (main
//! and indexer compressors) and the CSA translate-pack, with random inputs. V4-Flash, V4-Pro
//! (43 / 61 layers) and V4.1-Flash (40; its own rows, the owners' state updates and every
//! compressed layer's pack: the pool's writer has no V4.1 emitted-row or index-key path yet),
//! batch 1 / 16 / 64 / 256 / 1,024, one or two tokens a sequence (MTP), contexts U[tps, 1M]
//! (batch 1: 999,936, where both a CSA and an HCA entry close, the heaviest batch-1 step).
//!
//! Three orders of the same writes (tests/step_common): per-layer (one launch a write, the
//! per-layer API), fused (one `v4pool_write_batch` per layer) and state-at-end (one batch per
//! layer for rows and keys, every state update in one batch after the last layer). Each is
//! first run eagerly on the device over poisoned output rows and compared, every byte the step
//! writes, with the host backend's per-layer run of the same calls; then captured once and
//! replayed. Printed per shape: µs per step of each order (median of graph replays, cold L2:
//! a 256 MiB memset before each), launches per step, µs per launch kind, the launch floor
//! (a graph of as many empty-kernel nodes) and the traffic floor (bytes the step reads and
//! writes at the copy bandwidth measured in this run), and the fused graph against their sum.
//!
//! `cargo bench --bench step` (`--bench` given): the device run; `--formats fp8,bf16` (row
//! formats of the V4 models, by the plan option's names: another format is one more name),
//! `--models`, `--batches`, `--mtp`, `--reps`; `--flashmla-path` (on FlashMLA's V4 rows,
//! `flashmla-v4` and `flashmla-v4-p2`, the decode path in FlashMLA's convention: the builder and
//! the packs write FlashMLA's operands; `--formats fp8,flashmla-v4,flashmla-v4-p2
//! --flashmla-path` times the CSR path beside both page sizes' FlashMLA paths);
//! `--ablate` (after each shape, the fused step's parts alone, with and without programmatic
//! dependent launches, beside the chain floor of as many nodes: which part of a node costs
//! what). Without a CUDA device it prints SKIP, runs the
//! host-backend check at a tiny shape (also `--host-check`) and exits 0 (1 with
//! V4POOL_REQUIRE_GPU=1).

mod common;
#[path = "../tests/step_common/mod.rs"]
mod step_common;

use common::graph::{GraphTimer, S};
use common::{bench_requested, fmt_bytes, median, Rng};
use std::error::Error;
use std::sync::Arc;
use step_common::{count_kinds, step_pool, Holdings, Order, StepData, StepLaunch, StepRig};
use v4pool::backend::cuda::{self, CudaBackend, CudaGraph};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, DeviceAllocation};
use v4pool::model::ModelShape;
use v4pool::plan_report::PlanOptions;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::raw::index::{CopyRun, CopyRunsArgs, FillRun, FillRunsArgs, Launch};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

type Res<T> = Result<T, Box<dyn Error>>;

const GIB: u64 = 1 << 30;
const MAX_CTX: i64 = 1_000_000;
/// Batch 1's context: a multiple of 128 (its last token closes a CSA and an HCA entry).
const BATCH1_CTX: i64 = 999_936;
/// Replays of a graph back to back (no flush between) for the warm figure.
const BACK_TO_BACK: usize = 20;

/// What the run covers (command-line options).
struct Options {
    models: Vec<String>,
    formats: Vec<KvDtype>,
    batches: Vec<usize>,
    mtp: Vec<usize>,
    reps: usize,
    /// `--ablate`: after each shape, the fused step's parts alone ([`ablate`]).
    ablate: bool,
    /// `--flashmla-path`: on FlashMLA's V4 rows (either page size), the decode path in
    /// FlashMLA's convention (the builder and the packs write FlashMLA's operands), listed as
    /// `flashmla-v4+path` / `flashmla-v4-p2+path`.
    flashmla_path: bool,
}

fn list<T>(flag: &str, default: &str, parse: impl Fn(&str) -> Res<T>) -> Res<Vec<T>> {
    let args: Vec<String> = std::env::args().collect();
    let v = args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).map_or(default, |s| s.as_str());
    v.split(',').map(|s| parse(s.trim())).collect()
}

impl Options {
    fn parse() -> Res<Options> {
        Ok(Options {
            models: list("--models", "v4-flash,v4-pro,v4.1-flash", |s| Ok(s.to_string()))?,
            formats: list("--formats", "fp8", |s| Ok(PlanOptions::kv_from_name(s)?))?,
            batches: list("--batches", "1,16,64,256,1024", |s| Ok(s.parse()?))?,
            mtp: list("--mtp", "1,2", |s| Ok(s.parse()?))?,
            reps: list("--reps", "100", |s| Ok(s.parse()?))?[0],
            ablate: std::env::args().any(|a| a == "--ablate"),
            flashmla_path: std::env::args().any(|a| a == "--flashmla-path"),
        })
    }
}

/// A row format's name in the tables.
fn format_name(kv: KvDtype) -> String {
    let w: u64 = kv.plane_widths().iter().sum();
    match kv.compressed_format() {
        Some(_) => format!("{} ({} B compressed, {w} B window rows)", kv.name(), kv.compressed_row_bytes()),
        None => format!("{} ({w} B rows)", kv.name()),
    }
}

// ---- device helpers --------------------------------------------------------------------------

fn capture(t: &GraphTimer, rig: &StepRig, launches: &[StepLaunch]) -> Res<CudaGraph> {
    t.capture(|| {
        // SAFETY: the rig's own launches, made for its staged batch.
        unsafe { rig.queue(launches, S) };
        Ok(())
    })
}

fn empty_graph(t: &GraphTimer, nodes: usize) -> Res<CudaGraph> {
    t.capture(|| {
        for _ in 0..nodes {
            // SAFETY: the empty kernel touches nothing.
            unsafe { t.be.launch(&Launch::Empty, S)? };
        }
        Ok(())
    })
}

/// The dependent-node floor: a graph of `nodes` `copy_runs` launches, node i copying the 16
/// bytes node i − 1 wrote (a descriptor load, a load of its predecessor's output, a store: the
/// least a node that reads what the kernel before it wrote can do; the empty-kernel graph reads
/// nothing). Returns the graph and the buffers it names (freed by the caller after the graph).
fn chain_graph(t: &GraphTimer, nodes: usize) -> Res<(CudaGraph, Vec<DeviceAllocation>)> {
    let be = &t.be;
    let data = be.alloc_zeroed(((nodes + 1) * 16).max(256) as u64)?;
    let runs: Vec<CopyRun> = (0..nodes)
        .map(|i| CopyRun { src: data.ptr + 16 * i as u64, dst: data.ptr + 16 * (i + 1) as u64, bytes: 16 })
        .collect();
    let desc = table(be, &runs)?;
    let size = std::mem::size_of::<CopyRun>() as u64;
    let g = t.capture(|| {
        for i in 0..nodes {
            let args = CopyRunsArgs::default().with_runs(desc.ptr + size * i as u64).with_num_runs(1);
            // SAFETY: one 16-byte run inside `data`, described in `desc`; both outlive the graph.
            unsafe { be.launch(&Launch::CopyRuns(args), S)? };
        }
        Ok(())
    })?;
    Ok((g, vec![data, desc]))
}

/// A descriptor table of `items` on `be` (freed by the caller).
fn table<T: bytemuck::Pod>(be: &dyn Backend, items: &[T]) -> Res<DeviceAllocation> {
    let bytes: &[u8] = bytemuck::cast_slice(items);
    let a = be.alloc_zeroed((bytes.len() as u64).max(256))?;
    // SAFETY: the allocation was just made with at least these bytes.
    unsafe { be.upload(a.ptr, bytes, S)? };
    Ok(a)
}

/// The bytes of `runs` (addresses on `be`), gathered by one `copy_runs` launch into one buffer
/// and downloaded.
fn gather(be: &dyn Backend, runs: &[CopyRun]) -> Res<Vec<u8>> {
    let total: u64 = runs.iter().map(|r| r.bytes).sum();
    let out = be.alloc_zeroed(total.max(256))?;
    let mut at = out.ptr;
    let desc: Vec<CopyRun> = runs
        .iter()
        .map(|r| {
            let c = CopyRun { src: r.src, dst: at, bytes: r.bytes };
            at += r.bytes;
            c
        })
        .collect();
    let d = table(be, &desc)?;
    let mut bytes = vec![0u8; total as usize];
    // SAFETY: every source run lies in the pool (the geometry's rows), every destination in
    // `out`, which is `total` bytes; the descriptor holds `desc.len()` runs.
    unsafe {
        be.launch(
            &Launch::CopyRuns(CopyRunsArgs::default().with_runs(d.ptr).with_num_runs(desc.len() as i32)),
            S,
        )?;
        be.download(&mut bytes, out.ptr, S)?;
        be.free(d);
        be.free(out);
    }
    Ok(bytes)
}

/// Fill `runs` (pool rows on `be`) with a poison word.
fn poison(be: &dyn Backend, runs: &[CopyRun]) -> Res<()> {
    let fills: Vec<FillRun> =
        runs.iter().map(|r| FillRun { dst: r.src, bytes: r.bytes, pattern: 0xa5a5_a5a5, _pad: 0 }).collect();
    let d = table(be, &fills)?;
    // SAFETY: every run is 4-byte aligned rows of the pool; the descriptor holds them all.
    unsafe {
        be.launch(
            &Launch::FillRuns(FillRunsArgs::default().with_runs(d.ptr).with_num_runs(fills.len() as i32)),
            S,
        )?;
        be.synchronize(S)?;
        be.free(d);
    }
    Ok(())
}

/// Copy bandwidth (bytes read + written per µs) of a 256 MiB device-to-device copy replayed
/// from a graph with a cold L2.
fn copy_bandwidth(t: &GraphTimer, reps: usize) -> Res<f64> {
    let bytes = 256u64 << 20;
    let (src, dst) = (t.be.alloc_zeroed(bytes)?, t.be.alloc_zeroed(bytes)?);
    let g = t.capture(|| {
        // SAFETY: both buffers are live, disjoint and `bytes` long.
        unsafe { t.be.copy(dst.ptr, src.ptr, bytes, S)? };
        Ok(())
    })?;
    let (us, _, _) = t.replay_reps(&g, reps, |_| Ok(()))?;
    drop(g);
    t.be.synchronize(S)?;
    // SAFETY: the stream is drained and the graph dropped.
    unsafe {
        t.be.free(src);
        t.be.free(dst);
    }
    Ok(2.0 * bytes as f64 / us)
}

/// Median µs of `n` back-to-back replays (no flush between), per replay.
fn back_to_back(t: &GraphTimer, g: &CudaGraph) -> Res<f64> {
    let (e0, e1) = (t.be.event()?, t.be.event()?);
    let mut v = Vec::new();
    for _ in 0..5 {
        e0.record(S)?;
        for _ in 0..BACK_TO_BACK {
            g.replay(S)?;
        }
        e1.record(S)?;
        v.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3 / BACK_TO_BACK as f64);
    }
    Ok(median(&mut v))
}

// ---- one model ---------------------------------------------------------------------------------

fn preset(name: &str) -> Res<ModelShape> {
    Ok(ModelShape::by_name(name, 1)?)
}

/// The twin pools of one model and format: the device's and the host backend's (the
/// reference), with slots and blocks held for the largest batch.
struct Twins {
    gpu: Arc<Pool>,
    host: Arc<Pool>,
    held_gpu: Holdings,
    held_host: Holdings,
}

fn twins(be: &CudaBackend, model: &ModelShape, kv: KvDtype, seqs: usize) -> Res<Twins> {
    let p = plan(model, &PlanRequest::new(kv, IndexerDtype::Fp8, seqs as i64, 48 * GIB))?;
    let need = 2 * seqs as i64 + MAX_CTX / p.layout.geometry.block_size + 1;
    if p.num_blocks < need {
        return Err(format!(
            "{}: the plan holds {} blocks, the bench needs {need}",
            model.name, p.num_blocks
        )
        .into());
    }
    let gpu = Arc::new(Pool::new(Arc::new(be.clone()), PoolSpec::from_plan(&p)?, S)?);
    let host = Arc::new(Pool::new(Arc::new(HostBackend::new()), PoolSpec::from_plan(&p)?, S)?);
    let held_gpu = Holdings::take(&gpu, seqs);
    let held_host = Holdings::take(&host, seqs);
    Ok(Twins { gpu, host, held_gpu, held_host })
}

/// Contexts of one shape.
fn contexts(batch: usize, tps: usize, seed: u64) -> Vec<i64> {
    if batch == 1 {
        return vec![BATCH1_CTX];
    }
    let mut rng = Rng::new(seed);
    (0..batch).map(|_| rng.range(tps as i64, MAX_CTX + 1)).collect()
}

/// One shape's results.
struct Shape {
    launches: [usize; 3],
    us: [f64; 3],
    p90: [f64; 3],
    floor_launch: [f64; 3],
    /// The fused order's dependent-node floor ([`chain_graph`]).
    floor_chain: f64,
    traffic_us: f64,
    bytes: u64,
    warm_fused: f64,
    kinds: Vec<String>,
    check: String,
}

/// One shape's step: its contexts, inputs and top-k from the shape's seed (so every run of a
/// shape, the timed one and the ablation, stages the same step), the decode path in
/// FlashMLA's convention when `flashmla_path`.
fn step_data(tw: &Twins, model: &ModelShape, (tps, batch): (usize, usize), flashmla_path: bool) -> StepData {
    let seed = 0x5_7e9 + 31 * batch as u64 + tps as u64;
    let ctx = contexts(batch, tps, seed);
    let mut data = StepData::new(&tw.gpu, model.num_hidden_layers, tps, ctx, model.index_topk as usize, seed);
    data.flashmla_path = flashmla_path;
    data
}

/// Median µs of the [`chain_graph`] of `nodes` nodes (its buffers freed after).
fn chain_floor(t: &GraphTimer, nodes: usize, reps: usize) -> Res<f64> {
    let (c, bufs) = chain_graph(t, nodes)?;
    let us = t.replay_reps(&c, reps, |_| Ok(()))?.0;
    t.be.synchronize(S)?;
    drop(c);
    for b in bufs {
        // SAFETY: the chain graph that named them is gone and the stream drained.
        unsafe { t.be.free(b) };
    }
    Ok(us)
}

fn run_shape(
    t: &GraphTimer,
    tw: &Twins,
    model: &ModelShape,
    (tps, batch): (usize, usize),
    bw: f64,
    reps: usize,
    flashmla_path: bool,
) -> Res<Shape> {
    let data = step_data(tw, model, (tps, batch), flashmla_path);
    let mut hrig = StepRig::new(&tw.host, &tw.held_host, &data);
    let mut grig = StepRig::new(&tw.gpu, &tw.held_gpu, &data);
    if hrig.tables != grig.tables || hrig.positions != grig.positions {
        return Err("the twin pools handed out different slots or blocks".into());
    }
    // The reference: the host backend's per-layer order.
    let host_launches = hrig.launches(Order::PerLayer);
    // SAFETY: the host rig's own launches.
    unsafe { hrig.queue(&host_launches, S) };
    let want = gather(tw.host.backend().as_ref(), &hrig.written_runs(&data))?;
    let want_path = step_common::path_outputs(&hrig.path);
    let runs = grig.written_runs(&data);
    let gbe = tw.gpu.backend().clone();
    let mut orders = Vec::new();
    for order in Order::ALL {
        let launches = grig.launches(order);
        poison(gbe.as_ref(), &runs)?;
        // SAFETY: the device rig's own launches.
        unsafe { grig.queue(&launches, S) };
        let got = gather(gbe.as_ref(), &runs)?;
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "{} {}: written byte {at} differs from the host's",
                model.name,
                order.name()
            )
            .into());
        }
        if step_common::path_outputs(&grig.path) != want_path {
            return Err(format!(
                "{} {}: decode path buffers differ from the host's",
                model.name,
                order.name()
            )
            .into());
        }
        orders.push(launches);
    }
    let mut check = format!(
        "{} bytes in {} runs equal to the host's in all three orders",
        fmt_bytes(want.len() as u64),
        runs.len()
    );
    if flashmla_path {
        // Every FlashMLA operand equal to the host's, the poison included; the rule (whole
        // rows, HCA rows to their limits and untouched past them) was checked by path_outputs.
        let untouched = step_common::check_flashmla_rule(&grig.path, &want_path)?;
        check += &format!(
            "; FlashMLA operands equal to the host's, {} HCA entries past the rows' limits untouched",
            untouched
        );
    }
    drop(hrig);

    let mut res = Shape {
        launches: [0; 3],
        us: [0.0; 3],
        p90: [0.0; 3],
        floor_launch: [0.0; 3],
        floor_chain: 0.0,
        traffic_us: 0.0,
        bytes: 0,
        warm_fused: 0.0,
        kinds: Vec::new(),
        check,
    };
    let (r, w) = grig.traffic(&data);
    res.bytes = r + w;
    res.traffic_us = (r + w) as f64 / bw;
    for (i, launches) in orders.iter().enumerate() {
        let g = capture(t, &grig, launches)?;
        let (med, _, p90) = t.replay_reps(&g, reps, |_| Ok(()))?;
        res.us[i] = med;
        res.p90[i] = p90;
        res.launches[i] = launches.len();
        if i == 1 {
            res.warm_fused = back_to_back(t, &g)?;
            res.floor_chain = chain_floor(t, launches.len(), reps)?;
        }
        let e = empty_graph(t, launches.len())?;
        res.floor_launch[i] = t.replay_reps(&e, reps, |_| Ok(()))?.0;
        // Per launch kind: a graph of that kind's launches alone, in step order.
        if i < 2 {
            for (kind, n) in count_kinds(launches) {
                let only: Vec<StepLaunch> = launches.iter().filter(|l| l.kind == kind).copied().collect();
                let gk = capture(t, &grig, &only)?;
                let (us, _, _) = t.replay_reps(&gk, reps / 2, |_| Ok(()))?;
                res.kinds.push(format!(
                    "{:<12} {:<24} {n:>4} launches {us:>9.2} µs = {:>6.2} µs each",
                    Order::ALL[i].name(),
                    kind.name(),
                    us / n as f64
                ));
            }
        }
    }
    t.be.synchronize(S)?;
    Ok(res)
}

/// The fused step taken apart (`--ablate`): graphs of some of its launches only, and the same
/// with programmatic dependent launches off, each beside the chain floor of as many nodes, so
/// the table says which part of a node costs what. Timing only: the whole step's bytes were
/// checked by [`run_shape`] before.
fn ablate(
    t: &GraphTimer,
    tw: &Twins,
    model: &ModelShape,
    (tps, batch): (usize, usize),
    reps: usize,
    flashmla_path: bool,
) -> Res<Vec<String>> {
    use step_common::Kind;
    let data = step_data(tw, model, (tps, batch), flashmla_path);
    let mut rig = StepRig::new(&tw.gpu, &tw.held_gpu, &data);
    // Run the whole step once so the builder's outputs (the writes' rows) are in place.
    let all = rig.launches(Order::Fused);
    // SAFETY: the rig's own launches.
    unsafe { rig.queue(&all, S) };
    t.be.synchronize(S)?;
    type Keep = fn(Kind) -> bool;
    let parts: [(&str, Order, Keep); 9] = [
        ("fused step", Order::Fused, |_| true),
        ("per-layer step", Order::PerLayer, |_| true),
        ("writes only (no builder, no packs)", Order::Fused, |k| k != Kind::Build && k != Kind::Pack),
        ("builder + packs", Order::Fused, |k| k == Kind::Build || k == Kind::Pack),
        ("own rows only", Order::Fused, |k| k == Kind::Own),
        ("emitted rows only", Order::Fused, |k| k == Kind::Emitted),
        ("index keys only", Order::Fused, |k| k == Kind::Keys),
        ("state updates only", Order::Fused, |k| k == Kind::State),
        ("own rows + state updates", Order::Fused, |k| k == Kind::Own || k == Kind::State),
    ];
    let mut out = Vec::new();
    for overlap in [true, false] {
        t.be.set_overlapped_launches(overlap)?;
        for (name, order, keep) in parts {
            let launches = rig.launches_of(order, keep);
            if launches.is_empty() {
                continue;
            }
            let g = capture(t, &rig, &launches)?;
            let us = t.replay_reps(&g, reps, |_| Ok(()))?.0;
            let warm = back_to_back(t, &g)?;
            drop(g);
            let chain = chain_floor(t, launches.len(), reps)?;
            let n = launches.len();
            out.push(format!(
                "ABLATE\t{}\t{batch}\t{tps}\t{}\t{name}\t{n}\t{us:.2}\t{:.2}\t{warm:.2}\t{chain:.2}\t{:.2}",
                model.name,
                if overlap { "pdl" } else { "plain" },
                us / n as f64,
                us / chain
            ));
        }
    }
    t.be.set_overlapped_launches(true)?;
    t.be.synchronize(S)?;
    Ok(out)
}

fn run(opts: &Options) -> Res<()> {
    let be = CudaBackend::new(0)?;
    let module = be.module_source().map(|m| format!("{m:?}")).unwrap_or_else(|e| format!("none ({e})"));
    let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    println!(
        "device: {} (sm_{}{}), kernels from {module}; run at unix time {unix}",
        be.device_name(),
        be.compute_capability().0,
        be.compute_capability().1
    );
    let t = GraphTimer::new(&be)?;
    let bw = copy_bandwidth(&t, opts.reps)?;
    let empty1 = t.replay_reps(&empty_graph(&t, 1)?, opts.reps, |_| Ok(()))?.0;
    println!(
        "method: graph replay medians of {} reps (cold L2: a 256 MiB memset before each); 'warm' = {BACK_TO_BACK} replays back to back; \
         copy bandwidth {:.2} TB/s (256 MiB D2D, read + write, this run); empty-kernel graph {empty1:.2} µs",
        opts.reps,
        bw / 1e6
    );
    let max_batch = opts.batches.iter().copied().max().unwrap_or(1);
    for name in &opts.models {
        let model = preset(name)?;
        // The formats asked for that the model has a form in (V4: fp8, bf16, flashmla-v4[-p2]; V4.1:
        // bf16, flashmla-v41, flashmla-v41-fp4); none of them: the family's own fp8 form.
        let mut formats: Vec<KvDtype> =
            opts.formats.iter().copied().filter(|k| k.fits(model.family)).collect();
        if formats.is_empty() {
            formats.push(match model.family {
                v4pool::model::ModelFamily::V41 => KvDtype::FlashMlaV41,
                v4pool::model::ModelFamily::V4 => KvDtype::Fp8,
            });
        }
        for kv in formats {
            let fm_path = opts.flashmla_path && matches!(kv, KvDtype::FlashMlaV4 | KvDtype::FlashMlaV4P2);
            let fname = if fm_path { format!("{}+path", kv.name()) } else { kv.name().to_string() };
            let started = std::time::Instant::now();
            let tw = twins(&be, &model, kv, max_batch)?;
            let setup_s = started.elapsed().as_secs_f64();
            println!(
                "\n== {} ({} trunk layers), {} rows, FP8 indexer cache",
                model.name,
                model.num_hidden_layers,
                format_name(kv)
            );
            println!(
                "  {:>5} {:>3} | {:>15} | {:>10} {:>10} {:>10} | {:>8} {:>9} | {:>8} {:>8} {:>8} {:>8} | {:>9} {:>9}",
                "batch",
                "tps",
                "launches b/a/e",
                "per-layer",
                "fused",
                "at-end",
                "launch fl",
                "traffic fl",
                "fused/fl",
                "chain fl",
                "fused/cfl",
                "gain",
                "warm fused",
                "moved"
            );
            for &tps in &opts.mtp {
                for &batch in &opts.batches {
                    let s = run_shape(&t, &tw, &model, (tps, batch), bw, opts.reps, fm_path)?;
                    let floor = s.floor_launch[1] + s.traffic_us;
                    let chain = s.floor_chain + s.traffic_us;
                    println!(
                        "  {batch:>5} {tps:>3} | {:>4}/{:>4}/{:>5} | {:>10.2} {:>10.2} {:>10.2} | {:>8.2} {:>9.2} | {:>8.2} {:>8.2} {:>8.2} {:>7.2}× | {:>9.2} {:>9}",
                        s.launches[0],
                        s.launches[1],
                        s.launches[2],
                        s.us[0],
                        s.us[1],
                        s.us[2],
                        s.floor_launch[1],
                        s.traffic_us,
                        s.us[1] / floor,
                        s.floor_chain,
                        s.us[1] / chain,
                        s.us[0] / s.us[1],
                        s.warm_fused,
                        fmt_bytes(s.bytes)
                    );
                    println!(
                        "STEP\t{}\t{fname}\t{batch}\t{tps}\t{:.3}\t{:.3}\t{:.3}\t{}\t{}\t{}\t{:.3}\t{:.3}\t{:.3}\t{:.3}\t{}\t{:.3}",
                        model.name,
                        s.us[0],
                        s.us[1],
                        s.us[2],
                        s.launches[0],
                        s.launches[1],
                        s.launches[2],
                        s.floor_launch[0],
                        s.floor_launch[1],
                        s.traffic_us,
                        s.warm_fused,
                        s.bytes,
                        s.floor_chain
                    );
                    println!(
                        "        check: {}; p90 {:.2} / {:.2} / {:.2} µs",
                        s.check, s.p90[0], s.p90[1], s.p90[2]
                    );
                    for k in &s.kinds {
                        println!("        {k}");
                    }
                    if opts.ablate {
                        println!("        ablation: model batch tps launches part nodes µs µs/node warm chain-floor ÷chain");
                        for line in ablate(&t, &tw, &model, (tps, batch), opts.reps, fm_path)? {
                            println!("{line}");
                        }
                    }
                }
            }
            drop(tw);
            println!("  ({:.1} s: pools and held slots {setup_s:.1} s)", started.elapsed().as_secs_f64());
        }
    }
    be.synchronize(S)?;
    // SAFETY: the stream is drained; no graph names the flush buffer any more.
    unsafe { t.release() };
    Ok(())
}

/// The host-backend part at a tiny shape (no device needed): V4-Flash fp8, flashmla-v4 and
/// flashmla-v4-p2 (CSR and FlashMLA paths),
/// V4-Pro fp8, V4.1-Flash bf16, flashmla-v41 and the packed flashmla-v41-fp4,
/// three sequences of one and two tokens on small pools; the fused orders' written bytes
/// equal to the per-layer order's.
fn host_check() -> Res<()> {
    for (name, kv, fm_path) in [
        ("v4-flash", KvDtype::Fp8, false),
        ("v4-flash", KvDtype::FlashMlaV4, false),
        ("v4-flash", KvDtype::FlashMlaV4, true),
        ("v4-flash", KvDtype::FlashMlaV4P2, false),
        ("v4-flash", KvDtype::FlashMlaV4P2, true),
        ("v4-pro", KvDtype::Fp8, false),
        ("v4.1-flash", KvDtype::Bf16, false),
        ("v4.1-flash", KvDtype::FlashMlaV41, false),
        ("v4.1-flash", KvDtype::FlashMlaV41Fp4, false),
    ] {
        let model = preset(name)?;
        for tps in [1usize, 2] {
            let mut written = Vec::new();
            let mut counts = Vec::new();
            let mut paths = Vec::new();
            for order in Order::ALL {
                let pool = step_pool(Arc::new(HostBackend::new()), &model, kv, 4, 8);
                let held = Holdings::take(&pool, 3);
                let mut data = StepData::new(
                    &pool,
                    model.num_hidden_layers,
                    tps,
                    vec![256, 1024, 77],
                    model.index_topk as usize,
                    3,
                );
                data.flashmla_path = fm_path;
                let mut rig = StepRig::new(&pool, &held, &data);
                let launches = rig.launches(order);
                // SAFETY: the rig's own launches.
                unsafe { rig.queue(&launches, S) };
                written.push(gather(pool.backend().as_ref(), &rig.written_runs(&data))?);
                counts.push(launches.len());
                // The decode path's buffers (FlashMLA's operands checked against their rule).
                paths.push(step_common::path_outputs(&rig.path));
            }
            if paths.iter().any(|p| *p != paths[0]) {
                return Err(format!("{name} tps {tps}: the orders left different decode path buffers").into());
            }
            if written.iter().any(|w| *w != written[0]) {
                return Err(format!("{name} tps {tps}: the orders wrote different bytes").into());
            }
            println!(
                "  host check {name} {}{} tps {tps}: {} written bytes equal in every order; launches per step {} / {} / {} (per-layer / fused / state-at-end)",
                kv.name(),
                if fm_path { " (FlashMLA decode path)" } else { "" },
                written[0].len(),
                counts[0],
                counts[1],
                counts[2]
            );
        }
    }
    Ok(())
}

fn main() {
    let host_only = std::env::args().any(|a| a == "--host-check");
    if !bench_requested() && !host_only {
        println!("step bench: run with --bench (cargo bench --bench step), or --host-check");
        return;
    }
    let fail = |what: &str, e: Box<dyn Error>| -> ! {
        eprintln!("step bench {what} failed: {e}");
        std::process::exit(1)
    };
    if !host_only && !cuda::is_available() {
        let why = cuda::device_count().err().map_or("no device".to_string(), |e| e.to_string());
        if std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("step bench: V4POOL_REQUIRE_GPU=1 but no CUDA device: {why}");
            std::process::exit(1);
        }
        println!(
            "step bench: SKIP — no CUDA device ({why}); the host-backend check at a tiny shape instead:"
        );
    }
    if host_only || !cuda::is_available() {
        if let Err(e) = host_check() {
            fail("host check", e);
        }
        return;
    }
    let opts = Options::parse().unwrap_or_else(|e| fail("options", e));
    if let Err(e) = run(&opts) {
        fail("run", e);
    }
}
