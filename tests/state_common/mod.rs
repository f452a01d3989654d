//! Shared by the compressor-state update tests (host and GPU): pools with the real §2.1
//! fields (V4-Flash / V4-Pro, fp8 two planes or bf16 one plane) or a small arena with the
//! same field names, random forwards and inputs (finite, never zero), and the expected planes:
//! the whole planes before the update with the §8 rows written in, addressed through the
//! arena's own `byte_offset` (the formula the pool's field views come from).
#![allow(dead_code)]

use std::sync::Arc;
use v4pool::backend::{Backend, DeviceAllocation, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec, SlotLease};
use v4pool::raw::arena::{ArenaLayout, Dtype, Fill, StateField};
use v4pool::raw::index::ElemType;
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};
use v4pool::state::update::{Compressor, StateInputs, StateSeq, StateUpdateCapacity};
use v4pool::GeometrySpec;

/// The tests' generator (`tests/common`).
pub use crate::common::Rng;

/// A V4 pool of `model` in `kv` layout: `slots` slots and 4 blocks.
pub fn v4_pool(backend: Arc<dyn Backend>, model: &ModelShape, kv: KvDtype, slots: i64) -> Arc<Pool> {
    let layout = PoolLayout::new(model, kv, IndexerDtype::Fp8).expect("layout");
    let g = &layout.geometry;
    let blocks = 4;
    let rows = blocks * g.envelope_rows + (slots + 1) * (g.slot_rows + g.slot_align_rows.max(1));
    let geometry = layout.carve(blocks, slots, rows).expect("carve");
    let spec = PoolSpec::from_layout(&layout, geometry).expect("spec");
    Arc::new(Pool::new(backend, spec, Stream::DEFAULT).expect("pool"))
}

/// A pool whose arena has the six §2.1 field names at small dims (`csa_main` 16, `csa_idx`
/// 8, `hca` 24; rings 8 + k and 128 + k, or `csa_ring` for the CSA fields when given), two
/// layers each, in planes of `widths`: for large batches on the host.
pub fn small_pool(
    backend: Arc<dyn Backend>,
    widths: &[u64],
    k: u64,
    csa_ring: Option<u64>,
    slots: i64,
) -> Arc<Pool> {
    let csa = csa_ring.unwrap_or(8 + k);
    let f = |name: &str, rows: u64, dim: u64, fill: Fill| StateField {
        name: name.into(),
        layers: 2,
        shape: vec![rows, dim],
        dtype: Dtype::F32,
        fill,
        carried: true,
        align: 256,
    };
    let arena = ArenaLayout::new(
        vec![
            f("csa_main_kv", csa, 16, Fill::Zero),
            f("csa_main_score", csa, 16, Fill::NegInf),
            f("csa_idx_kv", csa, 8, Fill::Zero),
            f("csa_idx_score", csa, 8, Fill::NegInf),
            f("hca_main_kv", 128 + k, 24, Fill::Zero),
            f("hca_main_score", 128 + k, 24, Fill::NegInf),
        ],
        widths,
    )
    .expect("arena");
    let ratios = vec![0, 4, 128, 4, 128, 0];
    let probe = GeometrySpec::new(ratios.clone(), 0, 0, 128 + k as i64, 256)
        .arena_rows(arena.arena_rows())
        .slot_align_rows(arena.slot_align_rows())
        .build()
        .expect("geometry");
    let blocks = 2;
    let plane = blocks * probe.envelope_rows + (slots + 1) * probe.slot_rows;
    let geometry = probe.with_capacity(blocks, slots, Some(plane)).expect("carve");
    let spec = PoolSpec::new(geometry, widths.to_vec(), arena, None, vec![1, 3]).expect("spec");
    Arc::new(Pool::new(backend, spec, Stream::DEFAULT).expect("pool"))
}

/// Fill every plane with random bytes (the state fields poisoned, every other byte too).
pub fn poison(pool: &Pool, rng: &mut Rng) {
    for p in 0..pool.num_planes() {
        let bytes = rng.bytes(pool.plane_bytes(p).unwrap() as usize);
        // SAFETY: the plane's own range.
        unsafe { pool.backend().upload(pool.plane_ptr(p).unwrap(), &bytes, pool.stream()).unwrap() };
    }
}

/// Every plane's bytes (waits for the stream).
pub fn planes(pool: &Pool) -> Vec<Vec<u8>> {
    (0..pool.num_planes())
        .map(|p| {
            let mut v = vec![0u8; pool.plane_bytes(p).unwrap() as usize];
            // SAFETY: the plane's own range.
            unsafe { pool.backend().download(&mut v, pool.plane_ptr(p).unwrap(), pool.stream()).unwrap() };
            v
        })
        .collect()
}

/// One sequence of a forward, owned.
#[derive(Clone, Debug)]
pub struct Seq {
    pub lease: SlotLease,
    pub first_token: usize,
    pub positions: Vec<i64>,
    pub context_len: i64,
}

pub fn views(seqs: &[Seq]) -> Vec<StateSeq<'_>> {
    seqs.iter().map(|s| StateSeq::new(s.lease.handle, s.first_token, &s.positions, s.context_len)).collect()
}

/// A forward over `leases`: each sequence `q` new tokens (1..=`max_q`) ending at a random
/// context, tokens laid out in order; sometimes a sequence's tokens come in random order.
pub fn forward(rng: &mut Rng, leases: &[SlotLease], max_q: i64, max_ctx: i64) -> Vec<Seq> {
    let mut first = 0usize;
    leases
        .iter()
        .map(|&lease| {
            let q = rng.range(1, max_q);
            let ctx = rng.range(q, max_ctx.max(q));
            let mut positions: Vec<i64> = (ctx - q..ctx).collect();
            if rng.chance(0.2) {
                for i in (1..positions.len()).rev() {
                    positions.swap(i, rng.range(0, i as i64) as usize);
                }
            }
            let s = Seq { lease, first_token: first, positions, context_len: ctx };
            first += q as usize;
            s
        })
        .collect()
}

/// Tokens of a forward (rows of its inputs).
pub fn tokens(seqs: &[Seq]) -> usize {
    seqs.iter().map(|s| s.first_token + s.positions.len()).max().unwrap_or(0)
}

/// Host copies of one launch's inputs.
#[derive(Clone, Debug)]
pub struct Inputs {
    pub kv: Vec<u8>,
    pub score: Vec<u8>,
    pub ape: Vec<u8>,
    /// The launch's strides, rows, dim and element types; its pointers are null until
    /// [`upload`] sets them.
    pub shape: StateInputs,
}

/// Random finite non-zero values as `ty` bytes.
pub fn values(rng: &mut Rng, n: usize, ty: ElemType) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        let mut v = rng.range(-(1 << 20), 1 << 20) as f32 / 4096.0;
        if v == 0.0 {
            v = 0.25;
        }
        match ty {
            ElemType::F32 => out.extend_from_slice(&v.to_ne_bytes()),
            ElemType::Bf16 => out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_ne_bytes()),
        }
    }
    out
}

/// Inputs of `rows` tokens at `dim`, strides padded half the time.
pub fn inputs(
    rng: &mut Rng,
    c: Compressor,
    dim: i64,
    rows: usize,
    dtype: ElemType,
    ape_dtype: ElemType,
) -> Inputs {
    let kv_row_stride = dim + if rng.chance(0.5) { 8 * rng.range(1, 4) } else { 0 };
    let score_row_stride = dim + if rng.chance(0.5) { 8 * rng.range(1, 4) } else { 0 };
    Inputs {
        kv: values(rng, rows.max(1) * kv_row_stride as usize, dtype),
        score: values(rng, rows.max(1) * score_row_stride as usize, dtype),
        ape: values(rng, (c.ratio() * dim) as usize, ape_dtype),
        shape: StateInputs::default()
            .with_kv_row_stride(kv_row_stride)
            .with_score_row_stride(score_row_stride)
            .with_rows(rows as i64)
            .with_dim(dim)
            .with_dtype(dtype)
            .with_ape_dtype(ape_dtype),
    }
}

/// The inputs uploaded to `backend`: the allocations (free them after the stream drains) and
/// the launch's view of them.
pub fn upload(backend: &dyn Backend, i: &Inputs) -> (Vec<DeviceAllocation>, StateInputs) {
    let mut allocs = Vec::new();
    for bytes in [&i.kv, &i.score, &i.ape] {
        let a = backend.alloc_zeroed(bytes.len() as u64).unwrap();
        // SAFETY: a fresh allocation of exactly these bytes.
        unsafe { backend.upload(a.ptr, bytes, Stream::DEFAULT).unwrap() };
        allocs.push(a);
    }
    let view = i.shape.with_kv(allocs[0].ptr).with_score(allocs[1].ptr).with_ape(allocs[2].ptr);
    (allocs, view)
}

/// Free input allocations after draining the stream.
pub fn free(backend: &dyn Backend, allocs: Vec<DeviceAllocation>) {
    backend.synchronize(Stream::DEFAULT).unwrap();
    for a in allocs {
        // SAFETY: the stream is drained; nothing uses them any more.
        unsafe { backend.free(a) };
    }
}

fn elem(buf: &[u8], ty: ElemType, i: usize) -> f32 {
    match ty {
        ElemType::F32 => f32::from_ne_bytes(buf[4 * i..4 * i + 4].try_into().unwrap()),
        ElemType::Bf16 => f32::from_bits(u32::from(u16::from_ne_bytes([buf[2 * i], buf[2 * i + 1]])) << 16),
    }
}

/// The fields' `(ring S, dim)` of a compressor in `pool`.
pub fn field_shape(pool: &Pool, c: Compressor) -> (i64, i64) {
    let (kv, _) = c.fields();
    let a = &pool.spec().arena;
    let f = &a.fields()[a.field_index(kv).unwrap()];
    (f.shape[0] as i64, f.shape[1] as i64)
}

/// Write into `planes` what the §8 update of `c` at `layer` leaves: every token of every
/// sequence with `position >= context − K`, kv to `kv[slot][pos % S]`, score + ape to
/// `score[slot][pos % S]`, at the arena's byte offsets of the slot's position.
pub fn expect(pool: &Pool, planes: &mut [Vec<u8>], c: Compressor, layer: u64, i: &Inputs, seqs: &[Seq]) {
    let a = &pool.spec().arena;
    let slot_rows = pool.spec().geometry.slot_rows;
    let (ring, dim) = field_shape(pool, c);
    let (kv_name, score_name) = c.fields();
    let (kv_f, score_f) = (a.field_index(kv_name).unwrap(), a.field_index(score_name).unwrap());
    let ape_row = |pos: i64| (pos % c.ratio()) as usize * dim as usize;
    for s in seqs {
        for (j, &p) in s.positions.iter().enumerate() {
            if p < s.context_len - c.window() {
                continue;
            }
            let t = s.first_token + j;
            let in_row = ((p % ring) * dim * 4) as usize;
            let (plane, off) = a.byte_offset(s.lease.position, kv_f, layer, slot_rows).unwrap();
            let dst = &mut planes[plane][off as usize + in_row..][..dim as usize * 4];
            for e in 0..dim as usize {
                let v = elem(&i.kv, i.shape.dtype, t * i.shape.kv_row_stride as usize + e);
                dst[4 * e..4 * e + 4].copy_from_slice(&v.to_ne_bytes());
            }
            let (plane, off) = a.byte_offset(s.lease.position, score_f, layer, slot_rows).unwrap();
            let dst = &mut planes[plane][off as usize + in_row..][..dim as usize * 4];
            for e in 0..dim as usize {
                let v = elem(&i.score, i.shape.dtype, t * i.shape.score_row_stride as usize + e)
                    + elem(&i.ape, i.shape.ape_dtype, ape_row(p) + e);
                dst[4 * e..4 * e + 4].copy_from_slice(&v.to_ne_bytes());
            }
        }
    }
}

/// Number of differing bytes and the first few offsets, per plane.
pub fn diff(want: &[Vec<u8>], got: &[Vec<u8>]) -> Option<String> {
    let mut out = String::new();
    for (p, (w, g)) in want.iter().zip(got).enumerate() {
        if w == g {
            continue;
        }
        let bad: Vec<usize> =
            w.iter().zip(g).enumerate().filter(|(_, (a, b))| a != b).map(|(i, _)| i).collect();
        out += &format!("plane {p}: {} bytes differ, first at {:?}\n", bad.len(), &bad[..bad.len().min(8)]);
    }
    (!out.is_empty()).then_some(out)
}

/// The layers of `c` in `pool` (the fields' layer count).
pub fn layers(pool: &Pool, c: Compressor) -> u64 {
    let a = &pool.spec().arena;
    a.fields()[a.field_index(c.fields().0).unwrap()].layers
}

/// Stage `seqs`, run every compressor at a few layers with fresh inputs, and compare the
/// whole planes with the expectation after each launch.
pub fn run_forward(pool: &Arc<Pool>, rng: &mut Rng, seqs: &[Seq], cap: StateUpdateCapacity, what: &str) {
    let mut upd = pool.state_update(cap).unwrap();
    let rows = upd.stage(&views(seqs)).unwrap();
    let mut want = planes(pool);
    for c in Compressor::ALL {
        let n = layers(pool, c);
        for layer in [0, n - 1] {
            let (_, dim) = field_shape(pool, c);
            let dtype = if rng.chance(0.6) { ElemType::Bf16 } else { ElemType::F32 };
            let ape = if rng.chance(0.5) { ElemType::Bf16 } else { ElemType::F32 };
            let i = inputs(rng, c, dim, tokens(seqs), dtype, ape);
            let (allocs, view) = upload(pool.backend().as_ref(), &i);
            // SAFETY: the inputs were uploaded to the pool's backend with these shapes.
            unsafe { upd.update(c, layer, &view).unwrap() };
            expect(pool, &mut want, c, layer, &i, seqs);
            let got = planes(pool);
            if let Some(d) = diff(&want, &got) {
                panic!("{what}: {c:?} layer {layer} ({dtype:?} inputs, {ape:?} ape, rows {rows:?}):\n{d}");
            }
            free(pool.backend().as_ref(), allocs);
        }
    }
    println!("ok {what}: {} sequences, plan rows {rows:?}", seqs.len());
}

/// New random values in `i`'s buffers, same shapes (a captured graph's inputs, refilled).
pub fn refill(rng: &mut Rng, i: &mut Inputs) {
    i.kv = values(rng, i.kv.len() / i.shape.dtype.size() as usize, i.shape.dtype);
    i.score = values(rng, i.score.len() / i.shape.dtype.size() as usize, i.shape.dtype);
    i.ape = values(rng, i.ape.len() / i.shape.ape_dtype.size() as usize, i.shape.ape_dtype);
}
