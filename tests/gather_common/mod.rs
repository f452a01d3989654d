//! Shared by the window-gather tests (host and GPU): real V4 pools (fp8 two planes or bf16
//! one plane, DSpark drafts absent or not) with few slots, fresh random window contents,
//! random batches, and the expected window computed independently of the kernel's host
//! reference: rows located with the geometry's `WindowParams::index` and the arena's field
//! view, fp8 decoded in f64.
#![allow(dead_code)]

use crate::common::Rng;
use std::sync::Arc;
use v4pool::backend::{Backend, Stream};
use v4pool::model::{DraftMode, ModelShape};
use v4pool::pool::{Pool, PoolSpec, SlotLease};
use v4pool::raw::arena::{ArenaLayout, STATE_WINDOW};
use v4pool::sizing::{IndexerDtype, KvDtype, KvSpec};
use v4pool::state::gather::GatherSeq;
use v4pool::ABSENT_RATIO;

/// The models the tests run: V4-Flash and V4-Pro, MTP rings 129..133, drafts absent or not.
pub fn models() -> Vec<ModelShape> {
    vec![
        ModelShape::v4_flash(1).unwrap(),
        ModelShape::v4_pro(3).unwrap(),
        ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(),
        ModelShape::v4_pro_dspark(2, DraftMode::Absent).unwrap(),
        ModelShape::v4_flash_dspark(4, DraftMode::Dense).unwrap(),
    ]
}

/// The dtype of the tests' pools: ATOM's fp8 rows (two planes) or bf16 rows (one plane).
pub fn kv_dtype(fp8: bool) -> KvDtype {
    if fp8 {
        KvDtype::Fp8
    } else {
        KvDtype::Bf16
    }
}

/// A pool of `model` at `widths` with `positions` slot positions, `slots` of them slots and a
/// few blocks beside them, on `backend`.
pub fn model_pool(
    backend: Arc<dyn Backend>,
    model: &ModelShape,
    fp8: bool,
    positions: i64,
    slots: i64,
) -> Arc<Pool> {
    model_pool_with(backend, model, fp8, positions, slots, None)
}

/// [`model_pool`] with an indexer cache of `indexer`'s format.
#[allow(dead_code)] // not every test binary that includes this module uses it
pub fn model_pool_with(
    backend: Arc<dyn Backend>,
    model: &ModelShape,
    fp8: bool,
    positions: i64,
    slots: i64,
    indexer: Option<v4pool::sizing::IndexerDtype>,
) -> Arc<Pool> {
    model_pool_at(backend, model, kv_dtype(fp8), positions, slots, indexer)
}

/// [`model_pool_with`] in any row format (its planes, described by the pool's `KvSpec`).
#[allow(dead_code)] // not every test binary that includes this module uses it
pub fn model_pool_at(
    backend: Arc<dyn Backend>,
    model: &ModelShape,
    kv: KvDtype,
    positions: i64,
    slots: i64,
    indexer: Option<v4pool::sizing::IndexerDtype>,
) -> Arc<Pool> {
    let w = kv.plane_widths();
    let arena = ArenaLayout::for_model(model, &w).expect("arena");
    let probe = model
        .geometry_spec(0, 0)
        .arena_rows(arena.arena_rows())
        .slot_align_rows(arena.slot_align_rows())
        .build()
        .expect("geometry");
    let plane_rows = positions * probe.slot_rows;
    let blocks = (positions - slots) * probe.slot_rows / probe.envelope_rows;
    let geometry = probe.with_capacity(blocks.min(8), slots, Some(plane_rows)).expect("carve");
    let kv_spec = KvSpec::new(model, kv, indexer.unwrap_or(IndexerDtype::Fp8), None).expect("kv spec");
    let spec = PoolSpec::new(geometry, w, arena, indexer, model.indexer_layers())
        .and_then(|s| s.with_kv_spec(kv_spec))
        .expect("spec");
    Arc::new(Pool::new(backend, spec, Stream::DEFAULT).expect("pool"))
}

/// The layers the tests gather: the first of each class the model has, and every draft layer
/// whose window is carried.
pub fn source_layers(model: &ModelShape) -> Vec<usize> {
    let mut out = Vec::new();
    for ratio in [0, 4, 128] {
        if let Some(l) = model.ratios.iter().position(|&r| r == ratio) {
            out.push(l);
        }
    }
    out.extend(model.absent_layers());
    out
}

/// One fp8 NoPE row made valid: no NaN values, each tile's scale a plausible e8m0 byte (or 0,
/// an all-zero tile) at its even byte and a different byte beside it (readers use the even).
fn fix_nope_row(rng: &mut Rng, row: &mut [u8]) {
    for b in &mut row[..448] {
        if *b & 0x7f == 0x7f {
            *b ^= 0x01;
        }
    }
    for t in 0..7 {
        let e = if rng.chance(0.05) { 0 } else { rng.range(100, 150) as u8 };
        row[448 + 2 * t] = e;
        row[449 + 2 * t] = e.wrapping_add(1 + rng.below(200) as u8);
    }
}

/// Fresh random contents for every window row and the carried windows of each lease's slot.
pub fn fill(pool: &Pool, leases: &[SlotLease], rng: &mut Rng) {
    let spec = pool.spec();
    let g = &spec.geometry;
    let fp8 = spec.plane_widths.len() == 2;
    for lease in leases {
        for (p, &w) in spec.plane_widths.iter().enumerate() {
            let start = g.arena_rows as u64 * w;
            let mut bytes = rng.bytes(((g.slot_rows - g.arena_rows) as u64 * w) as usize);
            if fp8 && p == 0 {
                for row in bytes.chunks_exact_mut(512) {
                    fix_nope_row(rng, row);
                }
            }
            pool.write_slot(lease.handle, p, start, &bytes).unwrap();
        }
        if let Ok(f) = spec.arena.field_index(STATE_WINDOW) {
            let (plane, off) = spec.arena.field_place(f).unwrap();
            let len = spec.arena.fields()[f].bytes().unwrap() as usize;
            pool.write_slot(lease.handle, plane, off, &rng.bytes(len)).unwrap();
        }
    }
}

/// A random batch of `n` sequences over `leases` (repeats allowed: a gather only reads):
/// anchors near 0 (zero rows) or large, contexts known or not.
pub fn batch(rng: &mut Rng, leases: &[SlotLease], n: usize, wd: usize) -> Vec<GatherSeq> {
    (0..n)
        .map(|_| {
            let anchor = if rng.chance(0.3) { rng.range(0, 2 * wd as i64) } else { rng.range(0, 1_000_000) };
            let context_len = rng.chance(0.5).then(|| anchor + 1 + rng.range(0, 5));
            GatherSeq::new(leases[rng.below(leases.len() as u64) as usize].handle, anchor, context_len)
        })
        .collect()
}

fn e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 15), f64::from(b & 7));
    if e == 0 {
        sign * m / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

/// Bytes of `len` at plane byte `offset` of `pool`.
fn read(pool: &Pool, plane: usize, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pool.read_plane(plane, offset, &mut v).unwrap();
    v
}

/// The window `layer` should give for `batch` (`[n, wd, 512]` bf16 bits), from the spec's
/// formulas: a class layer's row is `layer_base_row + window_params(ratio).index(slot, p)`;
/// a carried window's is element `[rank][position][p mod ring]` of the `state_window` view.
pub fn expected(pool: &Pool, layer: usize, batch: &[GatherSeq], wd: usize) -> Vec<u16> {
    let spec = pool.spec();
    let g = &spec.geometry;
    let ratio = g.ratios[layer];
    let mut out = Vec::with_capacity(batch.len() * wd * 512);
    for s in batch {
        let pos = pool.slot_position(s.slot).unwrap();
        for i in 0..wd as i64 {
            let p = s.anchor - (wd as i64 - 1) + i;
            if p < 0 {
                out.extend(std::iter::repeat_n(0u16, 512));
                continue;
            }
            let row: Vec<u8> = if ratio == ABSENT_RATIO {
                let (_, view) = pool.state_view(STATE_WINDOW).unwrap();
                let rank = g.ratios[..layer].iter().filter(|&&r| r == ABSENT_RATIO).count() as u64;
                let q = p.rem_euclid(g.ring_slots) as u64;
                let elem = rank * view.strides[0] + pos as u64 * view.strides[1] + q * view.strides[2];
                read(pool, view.plane, view.offset + 2 * elem, 1024)
            } else {
                let r =
                    (g.layer_base_row(layer).unwrap() + g.window_params(ratio).unwrap().index(pos, p)) as u64;
                if spec.plane_widths.len() == 1 {
                    read(pool, 0, r * 1024, 1024)
                } else {
                    let nope = read(pool, 0, r * 512, 512);
                    let mut v = Vec::with_capacity(1024);
                    for (k, &b) in nope[..448].iter().enumerate() {
                        let e = nope[448 + 2 * (k / 64)];
                        let scale = if e == 0 { 0.0 } else { 2f64.powi(i32::from(e) - 127) };
                        v.extend(half::bf16::from_f64(e4m3(b) * scale).to_bits().to_ne_bytes());
                    }
                    v.extend(read(pool, 1, r * 128, 128));
                    v
                }
            };
            out.extend(row.chunks_exact(2).map(|c| u16::from_ne_bytes([c[0], c[1]])));
        }
    }
    out
}
