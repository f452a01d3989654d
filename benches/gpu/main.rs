//! GPU bench (CUDA): the index builders, CSA translate-pack, checkpoint copy and relocation,
//! each against floors measured in the same run (an empty kernel, an empty kernel's graph
//! replay, a device-to-device copy of the bytes the kernel writes).
//!
//! Method. Every figure is the median over many repetitions of the device time between two
//! events around the timed work, after warm-up. Before every repetition (outside the events)
//! the stream writes a 256 MiB scratch buffer (a memset, ~5× the H200's L2), so every
//! repetition starts with a cold L2 and the GPU is still busy when the host queues the timed
//! work (host submission latency is not in the figure). Input sets rotate between
//! repetitions: decode batches are re-staged (upload outside the events), top-k and prefill
//! inputs alternate between separately captured graphs. Each configuration is checked once
//! against the host backend's reference before it is timed.
//!
//! `.gpu/run` and `cargo bench` pass `--bench`; without it (`cargo test --benches`) the
//! binary returns at once. No device: a notice and success, unless V4POOL_REQUIRE_GPU=1.

#[path = "../common/mod.rs"]
mod common;
mod copy;
mod harness;

use copy::copy_group;
use harness::{alloc, compare, download_i32, free, header, print_row, Floors, Gpu, Row, Stat, TRAFFIC_PIECE};

use common::{bench_requested, fmt_bytes, met, random_decode_batch, Rng};
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;
use v4pool::backend::cuda::{self, CudaBackend, CudaGraph};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, DeviceAllocation, Stream};
use v4pool::geometry::{UnifiedPoolGeometry, CSA_RATIO, DENSE_RATIO, HCA_RATIO};
use v4pool::model::ModelShape;
use v4pool::pool::{decode_slice_lens, DecodeBuffer, DecodeCapacity, DecodePath, DecodeSeq, Pool, PoolSpec};
use v4pool::raw::index::shape::prefill_short;
use v4pool::raw::index::{CopyRun, DevicePtr, Launch, PrefillIndexArgs};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, Plan, PlanRequest};
use v4pool::Class;

type Res<T> = Result<T, Box<dyn Error>>;

const S: Stream = Stream::DEFAULT;
const GIB: u64 = 1 << 30;
const FLUSH_BYTES: u64 = 256 << 20;
const WARM: usize = 10;
const REPS: usize = 200;
const WIN: i32 = 128;
/// Decode contexts are drawn up to this; prefill's "1M" is 2^20 so an HCA list reaches 8,192.
const DECODE_MAX_CTX: i64 = 1_000_000;
const PREFILL_1M: i64 = 1 << 20;
const CSA_LAYERS: usize = 21;

// ---- geometry ------------------------------------------------------------------------------

fn flash_plan(seqs: i64, budget: u64) -> Res<Plan> {
    let m = ModelShape::v4_flash(1)?;
    Ok(plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget))?)
}

// ---- decode ----------------------------------------------------------------------------------

/// One decode batch: per sequence its slot position, context and block table; `tps` tokens
/// per sequence (2: an MTP verify step, positions ctx-2 and ctx-1).
struct DecodeSet {
    pos: Vec<i64>,
    ctx: Vec<i64>,
    tables: Vec<Vec<i32>>,
    tps: usize,
}

impl DecodeSet {
    fn random(rng: &mut Rng, g: &UnifiedPoolGeometry, batch: usize, ctx_lo: i64, ctx_hi: i64) -> Self {
        Self::random_tps(rng, g, batch, ctx_lo, ctx_hi, 1)
    }

    fn random_tps(
        rng: &mut Rng,
        g: &UnifiedPoolGeometry,
        batch: usize,
        ctx_lo: i64,
        ctx_hi: i64,
        tps: usize,
    ) -> Self {
        let ctx_lo = ctx_lo.max(tps as i64);
        let (pos, ctx, tables) = random_decode_batch(rng, g, batch, ctx_lo, ctx_hi);
        DecodeSet { pos, ctx, tables, tps }
    }

    /// Positions of every token, with its sequence's context.
    fn tokens(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        self.ctx.iter().flat_map(move |&c| (0..self.tps as i64).map(move |k| (c - self.tps as i64 + k, c)))
    }

    fn seqs(&self) -> Vec<DecodeSeq<'_>> {
        (0..self.pos.len())
            .map(|i| DecodeSeq::new(self.pos[i], self.ctx[i], self.tps, &self.tables[i]))
            .collect()
    }

    /// CSA heads per token, as the pool stages them.
    fn csa_heads(&self, topk: i64) -> Vec<i64> {
        self.tokens().map(|(p, c)| decode_slice_lens(p, c, i64::from(WIN), topk).1).collect()
    }

    /// Bytes the decode builder reads and writes (window tails + dest rows of every class, the
    /// HCA heads; one CSA buffer).
    fn builder_bytes(&self, dense: bool) -> (u64, u64) {
        let (mut r, mut w) = (0u64, 0u64);
        for (p, c) in self.tokens() {
            let (n, _, head) = decode_slice_lens(p, c, i64::from(WIN), 0);
            let (n, head) = (n as u64, head as u64);
            let classes = if dense { 3 } else { 2 };
            w += 4 * (classes * n + head + classes);
            r += 4 + 8 + 4 + classes * 8 + 4 * head.div_ceil(2);
        }
        (r, w)
    }

    /// Bytes CSA translate-pack reads and writes over `layers` layers.
    fn pack_bytes(&self, topk: i64, layers: usize) -> (u64, u64) {
        let (mut r, mut w) = (0u64, 0u64);
        for k in self.csa_heads(topk) {
            let k = k as u64;
            r += layers as u64 * (4 + 8 + 8 + 8 * k);
            w += layers as u64 * 4 * k;
        }
        (r, w)
    }
}

/// Decode buffers for `batch` sequences of `tps` tokens, top-k `topk`, one CSA buffer (every
/// layer's translate-pack rewrites its heads, as a forward pass runs them).
fn decode_capacity(batch: usize, tps: usize, topk: usize, max_blocks: usize) -> DecodeCapacity {
    DecodeCapacity::new(batch, batch * tps, max_blocks, WIN, topk as i32)
}

/// Random sequence-local top-k, i32 `[layers][T][topk]`, values below each token's
/// compressed CSA rows (`ctx / 4`).
fn random_topk(rng: &mut Rng, set: &DecodeSet, topk: usize, layers: usize) -> Vec<i32> {
    let ctx: Vec<i64> = set.tokens().map(|(_, c)| c).collect();
    let b = ctx.len();
    let mut v = vec![-1i32; layers * b * topk];
    for l in 0..layers {
        for (t, &c) in ctx.iter().enumerate() {
            let rows = (c / i64::from(CSA_RATIO)).max(1);
            for k in 0..topk {
                v[(l * b + t) * topk + k] = rng.range(0, rows) as i32;
            }
        }
    }
    v
}

/// The pools the decode and CSA groups index: one of the bench's plan on the GPU, whose
/// decode paths are timed, and one of the same spec on the host backend, the reference each
/// configuration is checked against. Neither's planes are read or written by the decode
/// index kernels (they write index buffers and destination rows only).
struct Pools {
    gpu: Arc<Pool>,
    host: Arc<Pool>,
}

impl Pools {
    fn of(gpu: &Gpu, p: &Plan) -> Res<Pools> {
        Ok(Pools {
            gpu: Arc::new(Pool::new(Arc::new(gpu.be.clone()), PoolSpec::from_plan(p)?, S)?),
            host: host_pool(p)?,
        })
    }
}

/// A host-backend pool of plan `p` (its memory is committed only where touched).
fn host_pool(p: &Plan) -> Res<Arc<Pool>> {
    Ok(Arc::new(Pool::new(Arc::new(HostBackend::new()), PoolSpec::from_plan(p)?, S)?))
}

/// Everything of one decode configuration on one pool's backend: its decode path (the
/// builder's and packs' buffers) and the top-k input sets.
struct DecodeRig {
    path: DecodePath,
    topk: Vec<DeviceAllocation>,
}

impl DecodeRig {
    fn new(pool: &Arc<Pool>, cap: DecodeCapacity, topk_sets: &[Vec<i32>]) -> Res<Self> {
        let be = pool.backend().clone();
        let path = pool.decode_path(cap)?;
        let mut topk = Vec::new();
        for t in topk_sets {
            let a = alloc(be.as_ref(), 4 * t.len() as u64)?;
            // SAFETY: the allocation was just made with exactly these bytes.
            unsafe { be.upload(a.ptr, bytemuck::cast_slice(t), S)? };
            topk.push(a);
        }
        Ok(DecodeRig { path, topk })
    }

    /// CSA layer `layer`'s translate-pack (its own top-k rows, the one CSA buffer).
    fn pack(&self, set: usize, layer: usize) -> Launch {
        let cap = self.path.capacity();
        let layer_bytes = 4 * (cap.max_tokens * cap.index_topk as usize * layer) as u64;
        let ptr = self.topk[set].ptr + layer_bytes;
        self.path.csa_pack_launch(ptr, cap.index_topk).expect("stride = index_topk")
    }

    /// A forward's packs: one launch per CSA layer.
    fn packs(&self, set: usize, layers: usize) -> Vec<Launch> {
        (0..layers).map(|l| self.pack(set, l)).collect()
    }

    fn release(mut self) {
        let be = self.path.pool().backend().clone();
        for a in self.topk.drain(..) {
            free(be.as_ref(), a);
        }
        // The path's buffers free themselves on drop (after the stream drains).
    }
}

/// Download a class's live slices (`[0, indptr[T])`) and the indptr.
fn class_output(bufs: &DecodePath, class: Class) -> Res<Vec<i32>> {
    let ptr = bufs.read_i32(DecodeBuffer::Indptr(class))?;
    let n = usize::try_from(*ptr.last().unwrap_or(&0)).map_err(|_| "negative indptr")?;
    let mut out = ptr;
    out.extend(&bufs.read_i32(DecodeBuffer::Indices(class))?[..n]);
    out.extend(bufs.read_i32(DecodeBuffer::DestRows(class))?);
    Ok(out)
}

/// Run the builder and layer 0's pack (input set 0) on the GPU and on the host backend (a
/// host pool of the same spec, `pools.host`) and compare every class's slices.
fn check_decode(gpu: &Gpu, rig: &mut DecodeRig, pools: &Pools, set: &DecodeSet, topk0: &[i32]) -> Res<()> {
    let g = &pools.host.spec().geometry;
    let host = pools.host.backend().clone();
    let mut hrig = DecodeRig::new(&pools.host, rig.path.capacity(), std::slice::from_ref(&topk0.to_vec()))?;
    let seqs = set.seqs();
    hrig.path.stage(&seqs)?;
    // SAFETY: the host rig's own buffers, sized by its decode path.
    unsafe {
        host.launch(&hrig.path.build_launch(), S)?;
        host.launch(&hrig.pack(0, 0), S)?;
    }
    rig.path.stage(&seqs)?;
    gpu.launch(&rig.path.build_launch())?;
    gpu.launch(&rig.pack(0, 0))?;
    gpu.be.synchronize(S)?;
    // One CSA buffer: after every layer's pack it holds the last layer's heads.
    let mut checks = vec![(Class::Hca, "hca"), (Class::Csa, "csa")];
    if g.class(DENSE_RATIO).is_some() {
        checks.push((Class::Dense, "dense"));
    }
    for (class, what) in checks {
        let a = class_output(&rig.path, class)?;
        let b = class_output(&hrig.path, class)?;
        compare(what, &a, &b)?;
    }
    hrig.release();
    Ok(())
}

/// Batch 256, contexts ≤ 1M: the engine's decode step (builder + 21 per-layer packs).
struct StepResult {
    step: Stat,
    builder: Stat,
    memset_step: Stat,
}

struct DecodeResults {
    step_256: Option<StepResult>,
    no_host_sync: Option<(f64, f64)>,
}

fn decode_group(gpu: &Gpu, f: &Floors, pools: &Pools) -> Res<DecodeResults> {
    let g = &pools.gpu.spec().geometry;
    header("decode index build (V4-Flash, window + HCA heads, one CSA buffer; 'step' adds 21 per-layer CSA packs, top-k 512, one graph)");
    let max_blocks = ((DECODE_MAX_CTX + g.block_size - 1) / g.block_size) as usize;
    let mut res = DecodeResults { step_256: None, no_host_sync: None };
    // (batch, tokens per sequence, lowest context, label)
    let configs: [(usize, usize, i64, &str); 7] = [
        (1, 1, 1, "random ≤1M"),
        (8, 1, 1, "random ≤1M"),
        (64, 1, 1, "random ≤1M"),
        (256, 1, 1, "random ≤1M"),
        (1024, 1, 1, "random ≤1M"),
        (1024, 2, 1, "MTP verify ≤1M"),
        (256, 1, DECODE_MAX_CTX, "all 1M"),
    ];
    const NSETS: usize = 4;
    for (batch, tps, ctx_lo, label) in configs {
        let mut rng = Rng::new(100 + batch as u64 + ctx_lo as u64 + 7 * tps as u64);
        let sets: Vec<DecodeSet> = (0..NSETS)
            .map(|_| DecodeSet::random_tps(&mut rng, g, batch, ctx_lo, DECODE_MAX_CTX, tps))
            .collect();
        let topks: Vec<Vec<i32>> = sets.iter().map(|s| random_topk(&mut rng, s, 512, CSA_LAYERS)).collect();
        let cap = decode_capacity(batch, tps, 512, max_blocks);
        let mut rig = DecodeRig::new(&pools.gpu, cap, &topks)?;
        check_decode(gpu, &mut rig, pools, &sets[0], &topks[0])?;
        let seqs: Vec<Vec<DecodeSeq<'_>>> = sets.iter().map(|s| s.seqs()).collect();
        let dec = gpu.graph_of(&[rig.path.build_launch()])?;
        let steps: Vec<CudaGraph> = (0..NSETS)
            .map(|k| gpu.graph_of(&[vec![rig.path.build_launch()], rig.packs(k, CSA_LAYERS)].concat()))
            .collect::<Res<_>>()?;
        let bufs = std::cell::RefCell::new(&mut rig.path);
        let stage = |i: usize| -> Res<()> {
            bufs.borrow_mut().stage(&seqs[i % NSETS])?;
            Ok(())
        };
        let launch = bufs.borrow().build_launch();
        let eager = gpu.time(REPS, stage, |_| gpu.launch(&launch))?;
        let graph = gpu.time_graphs(std::slice::from_ref(&dec), stage)?;
        let step = gpu.time_graphs(&steps, stage)?;
        // Bytes: averaged over the rotating sets.
        let avg = |f: &dyn Fn(&DecodeSet) -> (u64, u64)| {
            let (r, w) = sets.iter().map(f).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            (r / NSETS as u64, w / NSETS as u64)
        };
        let dense = g.class(DENSE_RATIO).is_some();
        let (br, bw) = avg(&|s| s.builder_bytes(dense));
        let (pr, pw) = avg(&|s| s.pack_bytes(512, CSA_LAYERS));
        let (copy_b, memset_b) = (gpu.copy_floor(bw)?, gpu.memset_floor(bw)?);
        let (copy_s, memset_s) = (gpu.copy_floor(bw + pw)?, gpu.memset_floor(bw + pw)?);
        let t = batch * tps;
        let name = format!("builder  T {t:>4} (bs {batch}×{tps}), {label}");
        print_row(
            f,
            &Row {
                name: &name,
                eager: Some(eager),
                graph,
                read: br,
                written: bw,
                copy: copy_b,
                memset: memset_b,
            },
        );
        // What a kernel that must read the block-table rows (`br`) as well as write `bw`
        // could reach with no dependent loads: the builder's bandwidth floor.
        let traffic = gpu.traffic_floor(br, bw)?;
        println!(
            "  {:<34} traffic floor (read {} distinct, write {}): {:.2} µs; builder {:.2}× it, memset {:.2}× it",
            "",
            fmt_bytes(br),
            fmt_bytes(bw),
            traffic.med,
            graph.med / traffic.med,
            memset_b.med / traffic.med
        );
        let name = format!("step     T {t:>4} (bs {batch}×{tps}), {label}");
        print_row(
            f,
            &Row {
                name: &name,
                eager: None,
                graph: step,
                read: br + pr,
                written: bw + pw,
                copy: copy_s,
                memset: memset_s,
            },
        );
        if ctx_lo == 1 {
            peer_line("decode", &format!("T={t}"), graph.med, bw, memset_b.med, Some(traffic.med));
        }
        if batch == 256 && ctx_lo == 1 && tps == 1 {
            peer_line("step", "T=256 topk=512", step.med, bw + pw, memset_s.med, None);
            res.step_256 = Some(StepResult { step, builder: graph, memset_step: memset_s });
            // No host synchronisation on the index path: with ~2.5 ms of work queued ahead,
            // staging + replay must return to the host long before the GPU reaches them.
            let before = gpu.be.event()?;
            before.record(S)?;
            for _ in 0..40 {
                gpu.flush()?;
            }
            let queued = gpu.be.event()?;
            queued.record(S)?;
            let t0 = Instant::now();
            stage(0)?;
            steps[0].replay(S)?;
            let host_us = t0.elapsed().as_secs_f64() * 1e6;
            let done = gpu.be.event()?;
            done.record(S)?;
            let backlog_us = f64::from(before.elapsed_ms(&queued)?) * 1e3;
            done.synchronize()?;
            res.no_host_sync = Some((host_us, backlog_us));
        }
        drop(dec);
        drop(steps);
        gpu.be.synchronize(S)?;
        rig.release();
    }
    Ok(res)
}

/// A machine-readable line `scripts/peer-table.py` joins with the peer's JSON; the traffic
/// floor, where measured (decode), as an optional last field.
fn peer_line(kind: &str, shape: &str, us: f64, written: u64, memset_us: f64, traffic_us: Option<f64>) {
    let traffic = traffic_us.map(|t| format!("\t{t:.3}")).unwrap_or_default();
    println!("PEER\t{kind}\t{shape}\t{us:.3}\t{written}\t{memset_us:.3}{traffic}");
}

// ---- CSA translate-pack ---------------------------------------------------------------------

fn csa_group(gpu: &Gpu, f: &Floors, pools: &Pools) -> Res<()> {
    let g = &pools.gpu.spec().geometry;
    header(
        "CSA translate-pack (T = 256, contexts random ≤1M; one launch per layer, each layer its own top-k)",
    );
    let batch = 256usize;
    let max_blocks = ((DECODE_MAX_CTX + g.block_size - 1) / g.block_size) as usize;
    const NSETS: usize = 4;
    for topk in [512usize, 1024, 2048] {
        let mut rng = Rng::new(7 + topk as u64);
        let sets: Vec<DecodeSet> =
            (0..NSETS).map(|_| DecodeSet::random(&mut rng, g, batch, 1, DECODE_MAX_CTX)).collect();
        let topks: Vec<Vec<i32>> = sets.iter().map(|s| random_topk(&mut rng, s, topk, CSA_LAYERS)).collect();
        let cap = decode_capacity(batch, 1, topk, max_blocks);
        let mut rig = DecodeRig::new(&pools.gpu, cap, &topks)?;
        check_decode(gpu, &mut rig, pools, &sets[0], &topks[0])?;
        let seqs: Vec<Vec<DecodeSeq<'_>>> = sets.iter().map(|s| s.seqs()).collect();
        let one: Vec<CudaGraph> = (0..NSETS).map(|k| gpu.graph_of(&[rig.pack(k, 0)])).collect::<Res<_>>()?;
        // The forward's path: 21 launches, one per CSA layer, in one graph.
        let per_layer: Vec<CudaGraph> =
            (0..NSETS).map(|k| gpu.graph_of(&rig.packs(k, CSA_LAYERS))).collect::<Res<_>>()?;
        // The peer's figure: 21 launches of one layer's pack (the same top-k each time, so L2
        // holds it after the first), for a like-for-like comparison.
        let same: Vec<CudaGraph> =
            (0..NSETS).map(|k| gpu.graph_of(&vec![rig.pack(k, 0); CSA_LAYERS])).collect::<Res<_>>()?;
        let serial: Vec<CudaGraph> =
            (0..NSETS).map(|k| gpu.graph_serial(&rig.packs(k, CSA_LAYERS))).collect::<Res<_>>()?;
        let packs1: Vec<Launch> = (0..NSETS).map(|k| rig.pack(k, 0)).collect();
        let bufs = std::cell::RefCell::new(&mut rig.path);
        let stage = |i: usize| -> Res<()> {
            bufs.borrow_mut().stage(&seqs[i % NSETS])?;
            Ok(())
        };
        let e1 = gpu.time(REPS, stage, |i| gpu.launch(&packs1[i % NSETS]))?;
        let g1 = gpu.time_graphs(&one, stage)?;
        let gpl = gpu.time_graphs(&per_layer, stage)?;
        let gsame = gpu.time_graphs(&same, stage)?;
        let gser = gpu.time_graphs(&serial, stage)?;
        let avg = |layers: usize| {
            let (r, w) = sets
                .iter()
                .map(|s| s.pack_bytes(topk as i64, layers))
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            (r / NSETS as u64, w / NSETS as u64)
        };
        let (r1, w1) = avg(1);
        let (r21, w21) = avg(CSA_LAYERS);
        let (c1, m1) = (gpu.copy_floor(w1)?, gpu.memset_floor(w1)?);
        let (c21, m21) = (gpu.copy_floor(w21)?, gpu.memset_floor(w21)?);
        let name = format!("top-k {topk:>4}, 1 layer");
        print_row(
            f,
            &Row { name: &name, eager: Some(e1), graph: g1, read: r1, written: w1, copy: c1, memset: m1 },
        );
        let name = format!("top-k {topk:>4}, 21 launches (1/layer)");
        print_row(
            f,
            &Row { name: &name, eager: None, graph: gpl, read: r21, written: w21, copy: c21, memset: m21 },
        );
        let name = format!("top-k {topk:>4}, 21 launches, serialised");
        print_row(
            f,
            &Row { name: &name, eager: None, graph: gser, read: r21, written: w21, copy: c21, memset: m21 },
        );
        peer_line("csa", &format!("T=256 topk={topk}"), g1.med, w1, m1.med, None);
        let name = format!("top-k {topk:>4}, 21 launches of layer 0");
        print_row(
            f,
            &Row { name: &name, eager: None, graph: gsame, read: r21, written: w21, copy: c21, memset: m21 },
        );
        peer_line("csa_x21", &format!("T=256 topk={topk}"), gpl.med, w21, m21.med, None);
        peer_line("csa_x21_same", &format!("T=256 topk={topk}"), gsame.med, w21, m21.med, None);
        drop((one, per_layer, same, serial));
        gpu.be.synchronize(S)?;
        rig.release();
    }
    Ok(())
}

// ---- prefill ------------------------------------------------------------------------------------

/// Host image of one prefill forward's inputs, and its output sizes.
struct PrefillSet {
    t: usize,
    stride: i32,
    /// positions, bid, chunk_start, cu_q, slots, n_committed, tables, 4 indptrs (ext, swa, csa, hca).
    arrays: Vec<Vec<i32>>,
    /// Output entries per buffer (ext, swa, csa, hca).
    outputs: [u64; 4],
    /// Entries the builder writes (CSA heads excluded).
    written: u64,
    read: u64,
}

const P_POS: usize = 0;
const P_BID: usize = 1;
const P_CS: usize = 2;
const P_CUQ: usize = 3;
const P_SLOT: usize = 4;
const P_NCOMM: usize = 5;
const P_TABLES: usize = 6;
const P_PTR: usize = 7;

impl PrefillSet {
    /// Sequences `(chunk_len, ctx_end)`: each writes positions `ctx_end - chunk_len .. ctx_end`.
    fn new(rng: &mut Rng, g: &UnifiedPoolGeometry, seqs: &[(i64, i64)], topk: i64) -> Self {
        let stride = seqs.iter().map(|&(_, c)| (c + g.block_size - 1) / g.block_size).max().unwrap_or(1);
        let mut live: Vec<i64> = g.live_positions().collect();
        rng.shuffle(&mut live);
        let mut a: Vec<Vec<i32>> = vec![Vec::new(); P_PTR + 4];
        for p in 0..4 {
            a[P_PTR + p].push(0);
        }
        let (mut written, mut read) = (0u64, 0u64);
        let win = i64::from(WIN);
        let mut cu = 0i64;
        for (b, &(len, ctx)) in seqs.iter().enumerate() {
            let cs = ctx - len;
            let ncomm = ctx / i64::from(HCA_RATIO);
            a[P_CS].push(cs as i32);
            a[P_CUQ].push(cu as i32);
            a[P_SLOT].push(live[b] as i32);
            a[P_NCOMM].push(ncomm as i32);
            let mut row: Vec<i32> = (0..stride).map(|_| rng.range(0, g.num_blocks) as i32).collect();
            a[P_TABLES].append(&mut row);
            for p in cs..ctx {
                a[P_POS].push(p as i32);
                a[P_BID].push(b as i32);
                let in_chunk = p - cs;
                let low = (p - win + 1).max(0);
                let ext = (in_chunk + 1).min(win);
                let pre = (cs - low).max(0);
                let n_hca = ((p + 1) / i64::from(HCA_RATIO)).min(ncomm);
                let csa_head = ((p + 1) / 4).min(ctx / 4).min(topk);
                for (k, len) in [ext, pre, pre + csa_head, pre + n_hca].into_iter().enumerate() {
                    let last = i64::from(*a[P_PTR + k].last().unwrap_or(&0));
                    a[P_PTR + k].push((last + len) as i32);
                }
                written += (ext + 3 * pre + n_hca) as u64;
                read += 4 * 2 + 4 * 8 + 4 * 5 + 4 * (n_hca as u64).div_ceil(2);
            }
            cu += len;
        }
        let t = a[P_POS].len();
        let outputs = [0, 1, 2, 3].map(|k| a[P_PTR + k].last().copied().unwrap_or(0) as u64);
        PrefillSet { t, stride: stride as i32, arrays: a, outputs, written, read }
    }
}

/// A prefill set laid out in one input and one output allocation on a backend.
struct PrefillRig {
    inputs: DeviceAllocation,
    outputs: DeviceAllocation,
    args: PrefillIndexArgs,
    out_ptrs: [DevicePtr; 4],
}

fn offsets(sizes: impl Iterator<Item = u64>) -> (Vec<u64>, u64) {
    let mut off = Vec::new();
    let mut cur = 0u64;
    for s in sizes {
        off.push(cur);
        cur += s.div_ceil(256) * 256;
    }
    (off, cur)
}

impl PrefillRig {
    fn new(be: &dyn Backend, g: &UnifiedPoolGeometry, set: &PrefillSet) -> Res<Self> {
        let (ioff, itotal) = offsets(set.arrays.iter().map(|v| 4 * v.len() as u64));
        let (ooff, ototal) = offsets(set.outputs.iter().map(|&n| 4 * n));
        let inputs = alloc(be, itotal)?;
        let outputs = alloc(be, ototal)?;
        let mut image = vec![0u8; itotal as usize];
        for (v, &o) in set.arrays.iter().zip(&ioff) {
            let bytes: &[u8] = bytemuck::cast_slice(v);
            image[o as usize..o as usize + bytes.len()].copy_from_slice(bytes);
        }
        // SAFETY: the image is exactly the input allocation's size.
        unsafe { be.upload(inputs.ptr, &image, S)? };
        let (ib, ob) = (inputs.ptr, outputs.ptr);
        let i = |k: usize| ib + ioff[k];
        let o = |k: usize| ob + ooff[k];
        let dense = g.class(DENSE_RATIO).is_some();
        let args = PrefillIndexArgs::default()
            .with_dense(if dense { g.window_params(DENSE_RATIO)? } else { Default::default() })
            .with_csa(g.window_params(CSA_RATIO)?)
            .with_hca(g.window_params(HCA_RATIO)?)
            .with_positions(i(P_POS))
            .with_bid_per_token(i(P_BID))
            .with_chunk_start_per_seq(i(P_CS))
            .with_cu_seqlens_q_per_seq(i(P_CUQ))
            .with_state_slot_per_seq(i(P_SLOT))
            .with_n_committed_hca_per_seq(i(P_NCOMM))
            .with_block_tables(i(P_TABLES))
            .with_extend_indptr(i(P_PTR))
            .with_extend_indices(o(0))
            .with_swa_indptr(if dense { i(P_PTR + 1) } else { 0 })
            .with_swa_indices(if dense { o(1) } else { 0 })
            .with_csa_indptr(i(P_PTR + 2))
            .with_csa_indices(o(2))
            .with_hca_indptr(i(P_PTR + 3))
            .with_hca_indices(o(3))
            .with_envelope_rows(g.envelope_rows)
            .with_block_table_stride(set.stride)
            .with_num_tokens(set.t as i32)
            .with_win(WIN)
            .with_hca_ratio(HCA_RATIO)
            .with_hca_rows_per_block((g.block_size / i64::from(HCA_RATIO)) as i32)
            .with_coarse_packed(0);
        Ok(PrefillRig { inputs, outputs, args, out_ptrs: [o(0), o(1), o(2), o(3)] })
    }

    fn release(self, be: &dyn Backend) {
        free(be, self.inputs);
        free(be, self.outputs);
    }
}

fn prefill_group(gpu: &Gpu, f: &Floors, g: &UnifiedPoolGeometry) -> Res<Option<(Stat, Stat)>> {
    header("prefill index build (V4-Flash; written = extend + dense + CSA window + HCA lists, CSA heads excluded; 'short': the 16-lane form)");
    let mut target = None;
    let mut rng = Rng::new(11);
    let four: Vec<(i64, i64)> = (0..4).map(|_| (2048, rng.range(2048, PREFILL_1M + 1))).collect();
    // (label, sequences as (chunk_len, ctx_end), is the target row)
    // (label, sequences as (chunk_len, ctx_end), is the target row, peer key)
    type Config = (String, Vec<(i64, i64)>, bool, &'static str);
    let configs: Vec<Config> = vec![
        ("2,048 tok, fresh".into(), vec![(2048, 2048)], false, "T=2048 ctx=2K"),
        ("2,048 tok at 128K".into(), vec![(2048, 131_072)], false, "T=2048 ctx=128K"),
        ("2,048 tok at 1M".into(), vec![(2048, PREFILL_1M)], false, "T=2048 ctx=1024K"),
        ("8,192 tok, fresh".into(), vec![(8192, 8192)], false, "T=8192 ctx=8K"),
        ("8,192 tok at 128K".into(), vec![(8192, 131_072)], false, "T=8192 ctx=128K"),
        ("8,192 tok at 1M".into(), vec![(8192, PREFILL_1M)], true, "T=8192 ctx=1024K"),
        ("8,192 tok = 4×2,048, ctx ≤1M".into(), four, false, ""),
    ];
    for (name, seqs, is_target, key) in configs {
        // Two input sets (different slots and block tables), one graph each.
        let sets: Vec<PrefillSet> = (0..2).map(|_| PrefillSet::new(&mut rng, g, &seqs, 512)).collect();
        let rigs: Vec<PrefillRig> =
            sets.iter().map(|s| PrefillRig::new(&gpu.be, g, s)).collect::<Res<_>>()?;
        // Check set 0 against the host reference (every output buffer, whole).
        {
            let host = HostBackend::new();
            let hrig = PrefillRig::new(&host, g, &sets[0])?;
            // SAFETY: the host rig's buffers, laid out for these arguments.
            unsafe { host.launch(&Launch::Prefill(hrig.args), S)? };
            gpu.launch(&Launch::Prefill(rigs[0].args))?;
            for (k, what) in ["extend", "dense", "csa", "hca"].iter().enumerate() {
                let n = sets[0].outputs[k] as usize;
                let a = download_i32(&gpu.be, rigs[0].out_ptrs[k], n)?;
                let b = download_i32(&host, hrig.out_ptrs[k], n)?;
                compare(what, &a, &b)?;
            }
            hrig.release(&host);
        }
        let graphs: Vec<CudaGraph> =
            rigs.iter().map(|r| gpu.graph_of(&[Launch::Prefill(r.args)])).collect::<Res<_>>()?;
        let eager = gpu.time(REPS, |_| Ok(()), |i| gpu.launch(&Launch::Prefill(rigs[i % 2].args)))?;
        let graph = gpu.time_graphs(&graphs, |_| Ok(()))?;
        let written = 4 * sets[0].written;
        let (copy, memset) = (gpu.copy_floor(written)?, gpu.memset_floor(written)?);
        print_row(
            f,
            &Row {
                name: &format!(
                    "{name} (T {}{})",
                    sets[0].t,
                    if prefill_short(&rigs[0].args) { ", short" } else { "" }
                ),
                eager: Some(eager),
                graph,
                read: sets[0].read,
                written,
                copy,
                memset,
            },
        );
        if !key.is_empty() {
            peer_line("prefill", key, graph.med, written, memset.med, None);
        }
        if is_target {
            target = Some((graph, copy));
        }
        drop(graphs);
        gpu.be.synchronize(S)?;
        for r in rigs {
            r.release(&gpu.be);
        }
    }
    Ok(target)
}

// ---- main -------------------------------------------------------------------------------------

fn run() -> Res<()> {
    let be = CudaBackend::new(0)?;
    let module = match be.module_source() {
        Ok(m) => format!("{m:?}"),
        Err(e) => return Err(format!("no kernel module: {e}").into()),
    };
    let (free_b, total_b) = be.memory_info()?;
    println!(
        "device: {} (sm_{}{}), kernels from {module}, memory {} free of {}",
        be.device_name(),
        be.compute_capability().0,
        be.compute_capability().1,
        fmt_bytes(free_b),
        fmt_bytes(total_b)
    );
    let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    println!("run at unix time {unix}");
    println!(
        "method: median of {REPS} reps after {WARM} warm-up, device events around the work; \
         a 256 MiB memset before every rep (cold L2); inputs rotated; \
         copy floors: the faster of memcpy and copy_runs over 1 MiB pieces"
    );
    let copy_cap = 384u64 << 20;
    let gpu = Gpu {
        flush: alloc(&be, FLUSH_BYTES)?,
        flush_value: std::cell::Cell::new(0),
        ev0: be.event()?,
        ev1: be.event()?,
        copy_src: alloc(&be, copy_cap)?,
        copy_dst: alloc(&be, copy_cap)?,
        copy_desc: alloc(&be, copy_cap.div_ceil(TRAFFIC_PIECE) * std::mem::size_of::<CopyRun>() as u64)?,
        be,
    };
    let empty_graph_g = gpu.graph_of(&[Launch::Empty])?;
    let floors = Floors {
        empty_launch: gpu.time(REPS, |_| Ok(()), |_| gpu.launch(&Launch::Empty))?,
        empty_graph: gpu.time_graphs(std::slice::from_ref(&empty_graph_g), |_| Ok(()))?,
    };
    // 21 empty nodes: the launch floor of a forward's 21 per-layer packs.
    let empty21 = gpu.time_graphs(&[gpu.graph_of(&[Launch::Empty; CSA_LAYERS])?], |_| Ok(()))?;
    let p = flash_plan(1024, 100 * GIB)?;
    let g = p.geometry.clone();
    println!(
        "geometry: V4-Flash fp8, 100 GiB plan: plane_rows {}, {} blocks, {} slots, envelope {} rows, slot {} rows",
        g.plane_rows, g.num_blocks, g.num_slots, g.envelope_rows, g.slot_rows
    );
    println!("\n== floors (same run)");
    println!(
        "  empty kernel, eager launch:   {:.2} µs (p10 {:.2}, p90 {:.2})",
        floors.empty_launch.med, floors.empty_launch.p10, floors.empty_launch.p90
    );
    println!(
        "  empty kernel, graph replay:   {:.2} µs (p10 {:.2}, p90 {:.2})",
        floors.empty_graph.med, floors.empty_graph.p10, floors.empty_graph.p90
    );
    println!(
        "  21 empty kernels, one graph:  {:.2} µs (p10 {:.2}, p90 {:.2})",
        empty21.med, empty21.p10, empty21.p90
    );
    for mb in [1u64, 16, 256] {
        let bytes = mb << 20;
        let (_, m, k) = gpu.copy_floors(bytes)?;
        let tbs = |s: &Stat| 2.0 * bytes as f64 / (s.med * 1e6);
        println!(
            "  D2D copy {mb:>4} MiB (graph):   memcpy {:.2} µs = {:.2} TB/s; copy_runs {:.2} µs = {:.2} TB/s (read + write)",
            m.med,
            tbs(&m),
            k.med,
            tbs(&k)
        );
    }
    // `--prefill-only` / `--decode-only`: the floors and that group alone.
    let prefill_only = std::env::args().any(|a| a == "--prefill-only");
    let decode_only = std::env::args().any(|a| a == "--decode-only");
    let mut dec = DecodeResults { step_256: None, no_host_sync: None };
    if !prefill_only {
        // The decode paths index pools of the plan (dropped before the groups after).
        let pools = Pools::of(&gpu, &p)?;
        dec = decode_group(&gpu, &floors, &pools)?;
        if decode_only {
            return Ok(());
        }
        csa_group(&gpu, &floors, &pools)?;
    }
    let pre = prefill_group(&gpu, &floors, &g)?;
    if !prefill_only {
        copy_group(&gpu, &floors)?;
    }

    println!(
        "\nTARGETS (ratios to floors measured in this run; the peer table comes from scripts/peer-table.py)"
    );
    if let Some(s) = dec.step_256 {
        println!(
            "  decode step as an engine runs it (builder + 21 per-layer CSA packs, top-k 512), batch 256, ctx ≤1M, \
             one graph: {:.2} µs (builder alone {:.2} µs); a memset of its written bytes {:.2} µs = {:.2}×",
            s.step.med,
            s.builder.med,
            s.memset_step.med,
            s.step.med / s.memset_step.med
        );
    }
    if let Some((graph, copy)) = pre {
        let r = graph.med / copy.med;
        println!(
            "  prefill 8,192 tokens at 1M: {:.2} µs = {r:.2}× a D2D copy of its written bytes ({:.2} µs) (≤ 0.75×): {}",
            graph.med,
            copy.med,
            met(r <= 0.75)
        );
    }
    if let Some((host_us, backlog_us)) = dec.no_host_sync {
        println!(
            "  no host synchronisation on the index path (stage + replay returned in {host_us:.0} µs \
             with {backlog_us:.0} µs of GPU work queued ahead): {}",
            met(host_us < backlog_us)
        );
    }
    drop(empty_graph_g);
    gpu.be.synchronize(S)?;
    free(&gpu.be, gpu.flush);
    free(&gpu.be, gpu.copy_src);
    free(&gpu.be, gpu.copy_dst);
    free(&gpu.be, gpu.copy_desc);
    Ok(())
}

/// `--host-check`: build every decode and prefill input of the bench and run it on the host
/// backend (no GPU needed), so a broken input fails here rather than on scarce device time.
fn host_check() -> Res<()> {
    let p = flash_plan(1024, 100 * GIB)?;
    let g = &p.geometry;
    let host = HostBackend::new();
    let pool = host_pool(&p)?;
    let max_blocks = ((DECODE_MAX_CTX + g.block_size - 1) / g.block_size) as usize;
    let mut rng = Rng::new(5);
    for (batch, tps, topk) in [(1usize, 1usize, 512usize), (256, 1, 2048), (1024, 2, 512)] {
        let set = DecodeSet::random_tps(&mut rng, g, batch, 1, DECODE_MAX_CTX, tps);
        let tk = random_topk(&mut rng, &set, topk, CSA_LAYERS);
        let cap = decode_capacity(batch, tps, topk, max_blocks);
        let mut rig = DecodeRig::new(&pool, cap, std::slice::from_ref(&tk))?;
        rig.path.stage(&set.seqs())?;
        rig.path.build()?;
        // SAFETY: the rig's own buffers, sized by its decode path.
        unsafe {
            for l in rig.packs(0, CSA_LAYERS) {
                pool.backend().launch(&l, S)?;
            }
        }
        let hca = class_output(&rig.path, Class::Hca)?;
        let (r, w) = set.builder_bytes(true);
        println!(
            "  decode batch {batch}×{tps}, top-k {topk}: ok ({} HCA entries; builder R {r} W {w})",
            hca[batch * tps]
        );
        rig.release();
    }
    for seqs in [vec![(2048i64, 2048i64)], vec![(8192, PREFILL_1M)], vec![(2048, 5000), (2048, PREFILL_1M)]] {
        let set = PrefillSet::new(&mut rng, g, &seqs, 512);
        let rig = PrefillRig::new(&host, g, &set)?;
        // SAFETY: the rig's buffers, laid out for these arguments.
        unsafe { host.launch(&Launch::Prefill(rig.args), S)? };
        let hca = download_i32(&host, rig.out_ptrs[3], set.outputs[3] as usize)?;
        if let Some(i) = hca.iter().position(|&x| x < 0 || i64::from(x) >= g.plane_rows) {
            return Err(format!("prefill hca entry {i} = {} outside the plane", hca[i]).into());
        }
        println!("  prefill {seqs:?}: ok (T {}, written {} B)", set.t, 4 * set.written);
        rig.release(&host);
    }
    Ok(())
}

/// `--profile-shapes`: one eager launch of each index kernel at the shapes that matter, for
/// Nsight Compute (`scripts/gpu-check.sh --ncu`): decode builder at batch 256, translate-pack at
/// top-k 512 and 2,048, prefill of 8,192 tokens at 128K and at 1M.
fn profile_shapes() -> Res<()> {
    let be = CudaBackend::new(0)?;
    let p = flash_plan(1024, 100 * GIB)?;
    let g = &p.geometry;
    let pool = Arc::new(Pool::new(Arc::new(be.clone()), PoolSpec::from_plan(&p)?, S)?);
    let max_blocks = ((DECODE_MAX_CTX + g.block_size - 1) / g.block_size) as usize;
    let mut rng = Rng::new(5);
    for topk in [512usize, 2048] {
        let set = DecodeSet::random(&mut rng, g, 256, 1, DECODE_MAX_CTX);
        let tk = random_topk(&mut rng, &set, topk, 1);
        let mut rig =
            DecodeRig::new(&pool, decode_capacity(256, 1, topk, max_blocks), std::slice::from_ref(&tk))?;
        rig.path.stage(&set.seqs())?;
        // SAFETY: the rig's own buffers, sized by its decode path.
        unsafe {
            be.launch(&rig.path.build_launch(), S)?;
            be.launch(&rig.pack(0, 0), S)?;
        }
        be.synchronize(S)?;
        rig.release();
    }
    for seqs in [vec![(8192i64, 131_072i64)], vec![(8192, PREFILL_1M)]] {
        let set = PrefillSet::new(&mut rng, g, &seqs, 512);
        let rig = PrefillRig::new(&be, g, &set)?;
        // SAFETY: the rig's buffers, laid out for these arguments.
        unsafe { be.launch(&Launch::Prefill(rig.args), S)? };
        be.synchronize(S)?;
        rig.release(&be);
    }
    Ok(())
}

fn main() {
    if std::env::args().any(|a| a == "--profile-shapes") {
        if let Err(e) = profile_shapes() {
            eprintln!("profile shapes failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    if std::env::args().any(|a| a == "--host-check") {
        if let Err(e) = host_check() {
            eprintln!("host check failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    if !bench_requested() {
        println!("gpu bench: run with --bench (cargo bench --bench gpu, or .gpu/run)");
        return;
    }
    let require = std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if !cuda::is_available() {
        let why = cuda::device_count().err().map_or("no device".to_string(), |e| e.to_string());
        if require {
            eprintln!("gpu bench: V4POOL_REQUIRE_GPU=1 but no CUDA device: {why}");
            std::process::exit(1);
        }
        println!("gpu bench: SKIPPED — no CUDA device ({why})");
        return;
    }
    if let Err(e) = run() {
        eprintln!("gpu bench failed: {e}");
        std::process::exit(1);
    }
}
