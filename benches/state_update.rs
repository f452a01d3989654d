//! GPU bench (CUDA): the §8 compressor-state update (`v4pool_update_compressor_states`, through
//! the pool's `StateUpdate` handle) at decode and prefill shapes, against floors measured in
//! the same run: an empty kernel's graph replay and a memset of the bytes the update writes.
//!
//! Method (as benches/gpu.rs): median of REPS graph replays after WARM, device events around
//! the replay, a 256 MiB memset before every rep (cold L2, and the GPU busy while the host
//! queues). Every configuration is captured once (one launch, the grid its capacity), staged
//! with a random forward, and checked once (sampled rows against a host computation at the
//! arena's byte offsets) before it is timed. Inputs are bf16 kv / score (what the peer bench
//! feeds ATOM's `update_compressor_states`) and an f32 ape; the state is f32.
//!
//! Shapes (the peer script measures the same names):
//! * `csa_main bs=<B> q=<Q>` / `hca_main bs=<B> q=<Q>`: B sequences with Q new tokens each at
//!   contexts up to 1M; every token is inside its last K positions, so the plan has B·Q rows
//!   (dim 1,024, ring 9, K 8 / dim 512, ring 129, K 128; V4-Flash with one MTP step).
//! * `csa_main prefill T=8192`: a forward of 8,192 tokens, 1,024 sequences × 8, all inside
//!   their last K = 8 positions: the plan has 8,192 rows, the most a forward of 8,192 tokens
//!   can write (a single sequence's 8,192-token chunk writes only its last 8).
//!
//! Output: one grep-able line per shape,
//! `state_update <shape> v4pool_us=… memset_us=… empty_us=… rows=… written_bytes=… vs_memset=…`,
//! and a `PEER` line (benches/gpu.rs's format) for the side-by-side table.
//!
//! `cargo bench --bench state_update` passes `--bench`; without it the binary returns at once.
//! No device: a notice and success, unless V4POOL_REQUIRE_GPU=1.

mod common;

use common::graph::{GraphTimer, GRAPH_REPS as REPS, GRAPH_WARM as WARM, S};
use common::{bench_requested, fmt_bytes, Rng};
use std::error::Error;
use std::sync::Arc;
use v4pool::backend::cuda::{self, CudaBackend, CudaGraph};
use v4pool::backend::{Backend, DeviceAllocation};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec, SlotLease};
use v4pool::raw::index::{ElemType, Launch};
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};
use v4pool::state::update::{Compressor, StateInputs, StateSeq, StateUpdateCapacity};

type Res<T> = Result<T, Box<dyn Error>>;

const MAX_SEQS: usize = 1024;
const MAX_TOKENS: usize = 8192;

/// The shared graph timer plus a scratch buffer for the memset floor.
struct Timer {
    graph: GraphTimer,
    scratch: DeviceAllocation,
}

impl Timer {
    /// Median / p10 / p90 µs of replaying `g`, each rep after an L2-evicting memset.
    fn time(&self, g: &CudaGraph) -> Res<(f64, f64, f64)> {
        self.graph.replay(g, |_| Ok(()))
    }

    fn graph(&self, launch: &Launch) -> Res<CudaGraph> {
        self.graph.capture(|| {
            // SAFETY: every launch names the pool's fields, the handle's plan and the bench's
            // own input allocations, all alive until the graph is dropped.
            unsafe { self.graph.be.launch(launch, S)? };
            Ok(())
        })
    }

    /// A memset of `bytes` (graph replay): the write floor.
    fn memset(&self, bytes: u64) -> Res<f64> {
        let words = bytes.clamp(16, self.scratch.bytes) / 4;
        let g = self.graph.capture(|| {
            // SAFETY: the scratch buffer is live and at least `words` words long.
            unsafe { self.graph.be.fill_u32(self.scratch.ptr, words, 0x5a5a_5a5a, S)? };
            Ok(())
        })?;
        Ok(self.time(&g)?.0)
    }
}

/// A V4-Flash fp8 pool (one MTP step: rings 9 and 129) with MAX_SEQS slots and 16 blocks.
fn flash_pool(be: Arc<dyn Backend>) -> Res<Arc<Pool>> {
    let layout = PoolLayout::new(&ModelShape::v4_flash(1)?, KvDtype::Fp8, IndexerDtype::Fp8)?;
    let g = &layout.geometry;
    let (blocks, slots) = (16, MAX_SEQS as i64);
    let rows = blocks * g.envelope_rows + (slots + 1) * (g.slot_rows + g.slot_align_rows.max(1));
    let spec = PoolSpec::from_layout(&layout, layout.carve(blocks, slots, rows)?)?;
    Ok(Arc::new(Pool::new(be, spec, S)?))
}

fn f32_of_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Check `samples` staged tokens of the last update of `c` at layer 0: kv and score + ape at
/// the arena's byte offset of the slot's position.
fn check(
    pool: &Pool,
    c: Compressor,
    seqs: &[(SlotLease, Vec<i64>, i64, usize)],
    kv: &[u16],
    score: &[u16],
    ape: &[f32],
    dim: usize,
) -> Res<()> {
    let a = &pool.spec().arena;
    let slot_rows = pool.spec().geometry.slot_rows;
    let (kv_name, score_name) = c.fields();
    let ring = a.fields()[a.field_index(kv_name)?].shape[0] as i64;
    for (lease, positions, _ctx, first) in seqs.iter().take(8) {
        let (j, &p) = positions.iter().enumerate().next_back().ok_or("empty sequence")?;
        let t = first + j;
        for (name, want) in [
            (kv_name, (0..dim).map(|e| f32_of_bf16(kv[t * dim + e])).collect::<Vec<f32>>()),
            (
                score_name,
                (0..dim)
                    .map(|e| f32_of_bf16(score[t * dim + e]) + ape[(p % c.ratio()) as usize * dim + e])
                    .collect(),
            ),
        ] {
            let (plane, off) = a.byte_offset(lease.position, a.field_index(name)?, 0, slot_rows)?;
            let addr = pool.plane_ptr(plane)? + off + ((p % ring) as u64) * dim as u64 * 4;
            let mut got = vec![0u8; dim * 4];
            // SAFETY: a state row inside the pool's plane.
            unsafe { pool.backend().download(&mut got, addr, S)? };
            let got: Vec<f32> =
                got.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect();
            if got.iter().map(|x| x.to_bits()).ne(want.iter().map(|x| x.to_bits())) {
                return Err(format!("{c:?}: {name} of token {t} (position {p}) differs from the host").into());
            }
        }
    }
    Ok(())
}

fn bf16s(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n).map(|_| (((rng.next_u64() % 2001) as f32 - 1000.5) / 64.0).to_bits() as u16).collect::<Vec<_>>()
}

/// One shape: stage `bs` sequences of `q` tokens, capture the update of `c` at layer 0, check,
/// time, print.
#[allow(clippy::too_many_arguments)] // one bench shape's parameters
fn shape(
    t: &Timer,
    pool: &Arc<Pool>,
    leases: &[SlotLease],
    c: Compressor,
    bs: usize,
    q: usize,
    name: &str,
    empty_us: f64,
) -> Res<()> {
    let mut rng = Rng::new(0x5eed ^ (bs * 31 + q) as u64);
    let dim = match c {
        Compressor::CsaMain => 1024,
        Compressor::CsaIdx => 256,
        Compressor::HcaMain => 512,
    };
    let mut upd = pool.state_update(StateUpdateCapacity::new(bs, bs * q))?;
    let seqs: Vec<(SlotLease, Vec<i64>, i64, usize)> = (0..bs)
        .map(|b| {
            let ctx = q as i64 + (rng.next_u64() % 1_000_000) as i64;
            (leases[b], (ctx - q as i64..ctx).collect(), ctx, b * q)
        })
        .collect();
    let views: Vec<StateSeq<'_>> =
        seqs.iter().map(|(l, p, ctx, first)| StateSeq::new(l.handle, *first, p, *ctx)).collect();
    let [csa_rows, hca_rows] = upd.stage(&views)?;
    let rows = if c == Compressor::HcaMain { hca_rows } else { csa_rows };
    let tokens = bs * q;
    let (kv, score) = (bf16s(&mut rng, tokens * dim), bf16s(&mut rng, tokens * dim));
    let ape: Vec<f32> = (0..c.ratio() as usize * dim).map(|i| (i % 97) as f32 / 8.0 - 6.0).collect();
    let be = pool.backend();
    let mut allocs = Vec::new();
    for bytes in
        [bytemuck::cast_slice::<u16, u8>(&kv), bytemuck::cast_slice(&score), bytemuck::cast_slice(&ape)]
    {
        let a = be.alloc_zeroed(bytes.len() as u64)?;
        // SAFETY: a fresh allocation of exactly these bytes.
        unsafe { be.upload(a.ptr, bytes, S)? };
        allocs.push(a);
    }
    let inputs = StateInputs::default()
        .with_kv(allocs[0].ptr)
        .with_score(allocs[1].ptr)
        .with_ape(allocs[2].ptr)
        .with_kv_row_stride(dim as i64)
        .with_score_row_stride(dim as i64)
        .with_rows(tokens as i64)
        .with_dim(dim as i64)
        .with_dtype(ElemType::Bf16)
        .with_ape_dtype(ElemType::F32);
    let graph = t.graph(&upd.launch(c, 0, &inputs)?)?;
    graph.replay(S)?;
    check(pool, c, &seqs, &kv, &score, &ape, dim)?;
    let (us, p10, p90) = t.time(&graph)?;
    let written = (rows * dim * 4 * 2) as u64;
    let memset_us = t.memset(written)?;
    println!(
        "state_update {name} v4pool_us={us:.2} memset_us={memset_us:.2} empty_us={empty_us:.2} rows={rows} \
         written_bytes={written} vs_memset={:.2} p10={p10:.2} p90={p90:.2} ({})",
        us / memset_us,
        fmt_bytes(written)
    );
    println!("PEER\tstate_update\t{name}\t{us:.3}\t{written}\t{memset_us:.3}");
    drop(graph);
    be.synchronize(S)?;
    for a in allocs {
        // SAFETY: the graph is gone and the stream drained.
        unsafe { be.free(a) };
    }
    Ok(())
}

fn run() -> Res<()> {
    let be = CudaBackend::new(0)?;
    println!("device: {}, kernels from {:?}", be.device_name(), be.module_source()?);
    println!(
        "method: median of {REPS} graph replays after {WARM}, a 256 MiB memset before every rep (cold L2)"
    );
    let t = Timer { graph: GraphTimer::new(&be)?, scratch: be.alloc_zeroed(256 << 20)? };
    let empty = t.graph(&Launch::Empty)?;
    let empty_us = t.time(&empty)?.0;
    println!("empty kernel, graph replay: {empty_us:.2} µs");
    let pool = flash_pool(Arc::new(be))?;
    let leases: Vec<SlotLease> = (0..MAX_SEQS).map(|_| pool.alloc_slot()).collect::<Result<_, _>>()?;
    for c in [Compressor::CsaMain, Compressor::HcaMain] {
        let tag = if c == Compressor::CsaMain { "csa_main" } else { "hca_main" };
        for bs in [1usize, 64, 256, 1024] {
            for q in [1usize, 2] {
                shape(&t, &pool, &leases, c, bs, q, &format!("{tag} bs={bs} q={q}"), empty_us)?;
            }
        }
    }
    shape(&t, &pool, &leases, Compressor::CsaMain, MAX_TOKENS / 8, 8, "csa_main prefill T=8192", empty_us)?;
    Ok(())
}

fn main() {
    if !bench_requested() {
        println!("state_update bench: run with --bench (cargo bench --bench state_update)");
        return;
    }
    let require = std::env::var("V4POOL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if !cuda::is_available() {
        let why = cuda::device_count().err().map_or("no device".to_string(), |e| e.to_string());
        if require {
            eprintln!("state_update bench: V4POOL_REQUIRE_GPU=1 but no CUDA device: {why}");
            std::process::exit(1);
        }
        println!("state_update bench: SKIPPED — no CUDA device ({why})");
        return;
    }
    if let Err(e) = run() {
        eprintln!("state_update bench failed: {e}");
        std::process::exit(1);
    }
}
