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
//! Trial forms (issue 15's A/B, `STATE_UPDATE_TRIALS`): `V4POOL_UPDATE_VARIANTS=default,spec,…`
//! (or `all`) times each listed form on the same graph setup and memset floor, one line per
//! form and shape, `state_update[<form>] <shape> v4pool_us=…`, each checked against the host
//! first; the PEER line stays the kept form's (`default`, timed when listed). Unset: the kept
//! form only, as before.
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
use v4pool::index::{ElemType, Launch, STATE_UPDATE_TRIALS};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec, SlotLease};
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
        let (j, &p) = positions.iter().enumerate().last().ok_or("empty sequence")?;
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

/// The forms `V4POOL_UPDATE_VARIANTS` lists (`default` = the kept kernel, `None`; a tag of
/// `STATE_UPDATE_TRIALS`; `all` = every one); unset or empty: the kept form only.
fn forms() -> Res<Vec<Option<u8>>> {
    let list = std::env::var("V4POOL_UPDATE_VARIANTS").unwrap_or_default();
    let mut forms = Vec::new();
    for tag in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        match tag {
            "default" => forms.push(None),
            "all" => {
                forms.extend(std::iter::once(None).chain((0..STATE_UPDATE_TRIALS.len() as u8).map(Some)))
            }
            _ => {
                let i = STATE_UPDATE_TRIALS.iter().position(|t| t.0 == tag).ok_or_else(|| {
                    let known: Vec<&str> = STATE_UPDATE_TRIALS.iter().map(|t| t.0).collect();
                    format!(
                        "V4POOL_UPDATE_VARIANTS: unknown form {tag:?} (default, all, {})",
                        known.join(", ")
                    )
                })?;
                forms.push(Some(i as u8));
            }
        }
    }
    if forms.is_empty() {
        forms.push(None);
    }
    Ok(forms)
}

fn form_tag(form: Option<u8>) -> &'static str {
    form.and_then(|i| STATE_UPDATE_TRIALS.get(usize::from(i))).map_or("default", |t| t.0)
}

/// Fill the state of `c` of every staged sequence's slot (layer 0, its whole ring) with a NaN
/// pattern, so `check` sees only what the next form writes.
///
/// # Safety
/// The pool's planes are live and nothing else writes them meanwhile.
unsafe fn poison_state(pool: &Pool, c: Compressor, seqs: &[(SlotLease, Vec<i64>, i64, usize)]) -> Res<()> {
    let a = &pool.spec().arena;
    let slot_rows = pool.spec().geometry.slot_rows;
    let (kv_name, score_name) = c.fields();
    for (lease, ..) in seqs.iter().take(8) {
        for name in [kv_name, score_name] {
            let f = a.field_index(name)?;
            let shape = &a.fields()[f].shape;
            let bytes = shape.iter().product::<u64>() * 4;
            let (plane, off) = a.byte_offset(lease.position, f, 0, slot_rows)?;
            // SAFETY: layer 0's [ring][dim] f32 of this slot, inside the plane (the caller's
            // promise covers the rest).
            unsafe { pool.backend().fill_u32(pool.plane_ptr(plane)? + off, bytes / 4, 0x7fc0_dead, S)? };
        }
    }
    Ok(())
}

fn bf16s(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n).map(|_| (((rng.next_u64() % 2001) as f32 - 1000.5) / 64.0).to_bits() as u16).collect::<Vec<_>>()
}

/// One shape: stage `bs` sequences of `q` tokens, capture the update of `c` at layer 0, check,
/// time, print.
fn shape(
    t: &Timer,
    pool: &Arc<Pool>,
    leases: &[SlotLease],
    c: Compressor,
    bs: usize,
    q: usize,
    name: &str,
    empty_us: f64,
    forms: &[Option<u8>],
) -> Res<()> {
    let mut rng = Rng::new(0x5eed ^ (bs * 31 + q) as u64);
    let dim = match c {
        Compressor::CsaMain => 1024,
        Compressor::CsaIdx => 256,
        Compressor::HcaMain => 512,
    };
    let mut upd = pool.state_update(StateUpdateCapacity { max_seqs: bs, max_tokens: bs * q })?;
    let seqs: Vec<(SlotLease, Vec<i64>, i64, usize)> = (0..bs)
        .map(|b| {
            let ctx = q as i64 + (rng.next_u64() % 1_000_000) as i64;
            (leases[b], (ctx - q as i64..ctx).collect(), ctx, b * q)
        })
        .collect();
    let views: Vec<StateSeq<'_>> = seqs
        .iter()
        .map(|(l, p, ctx, first)| StateSeq {
            slot: l.handle,
            first_token: *first,
            positions: p,
            context_len: *ctx,
        })
        .collect();
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
    let inputs = StateInputs {
        kv: allocs[0].ptr,
        score: allocs[1].ptr,
        ape: allocs[2].ptr,
        kv_row_stride: dim as i64,
        score_row_stride: dim as i64,
        rows: tokens as i64,
        dim: dim as i64,
        dtype: ElemType::Bf16,
        ape_dtype: ElemType::F32,
    };
    let written = (rows * dim * 4 * 2) as u64;
    let memset_us = t.memset(written)?;
    let Launch::StateUpdate(args) = upd.launch(c, 0, &inputs)? else {
        return Err("the state update's launch is not a StateUpdate".into());
    };
    for form in forms {
        let launch = match *form {
            None => Launch::StateUpdate(args),
            Some(i) => Launch::StateUpdateTrial(args, i),
        };
        // Fresh poison between forms: a form that writes nothing cannot pass on the last one's.
        // SAFETY: a range inside the pool's plane (every staged slot's state of `c`).
        unsafe { poison_state(pool, c, &seqs)? };
        let graph = t.graph(&launch)?;
        graph.replay(S)?;
        check(pool, c, &seqs, &kv, &score, &ape, dim)?;
        let (us, p10, p90) = t.time(&graph)?;
        let tag = form_tag(*form);
        let label =
            if forms.len() == 1 { "state_update".to_string() } else { format!("state_update[{tag}]") };
        println!(
            "{label} {name} v4pool_us={us:.2} memset_us={memset_us:.2} empty_us={empty_us:.2} rows={rows} \
             written_bytes={written} vs_memset={:.2} p10={p10:.2} p90={p90:.2} ({})",
            us / memset_us,
            fmt_bytes(written)
        );
        if form.is_none() {
            println!("PEER\tstate_update\t{name}\t{us:.3}\t{written}\t{memset_us:.3}");
        }
        drop(graph);
        be.synchronize(S)?;
    }
    for a in allocs {
        // SAFETY: the graph is gone and the stream drained.
        unsafe { be.free(a) };
    }
    Ok(())
}

fn run() -> Res<()> {
    let forms = forms()?;
    let be = CudaBackend::new(0)?;
    println!("device: {}, kernels from {:?}", be.device_name(), be.module_source()?);
    println!(
        "method: median of {REPS} graph replays after {WARM}, a 256 MiB memset before every rep (cold L2)"
    );
    let t = Timer { graph: GraphTimer::new(&be)?, scratch: be.alloc_zeroed(256 << 20)? };
    let empty = t.graph(&Launch::Empty)?;
    let empty_us = t.time(&empty)?.0;
    println!("empty kernel, graph replay: {empty_us:.2} µs");
    println!("forms: {}", forms.iter().map(|f| form_tag(*f)).collect::<Vec<_>>().join(","));
    let pool = flash_pool(Arc::new(be))?;
    let leases: Vec<SlotLease> = (0..MAX_SEQS).map(|_| pool.alloc_slot()).collect::<Result<_, _>>()?;
    for c in [Compressor::CsaMain, Compressor::HcaMain] {
        let tag = if c == Compressor::CsaMain { "csa_main" } else { "hca_main" };
        for bs in [1usize, 64, 256, 1024] {
            for q in [1usize, 2] {
                shape(&t, &pool, &leases, c, bs, q, &format!("{tag} bs={bs} q={q}"), empty_us, &forms)?;
            }
        }
    }
    let prefill = "csa_main prefill T=8192";
    shape(&t, &pool, &leases, Compressor::CsaMain, MAX_TOKENS / 8, 8, prefill, empty_us, &forms)?;
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
