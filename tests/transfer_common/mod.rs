//! Shared by the transfer tests: V4 pools of a chosen size on any backend, and byte access to
//! a block's units (every plane and indexer layer) and a slot through the pool's addresses.
#![allow(dead_code)]

use std::sync::Arc;
use v4pool::backend::{Backend, Stream};
use v4pool::checkpoint::layout_id;
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};

/// A V4 pool of `model` (fp8 KV, fp8 indexer) with `blocks` blocks and `slots` slots (plane
/// sized for exactly that, so the boundary cannot grow past it), and its layout id.
pub fn v4_pool(backend: Arc<dyn Backend>, model: &ModelShape, blocks: i64, slots: i64) -> (Pool, String) {
    let layout = PoolLayout::new(model, KvDtype::Fp8, IndexerDtype::Fp8).expect("layout");
    let g = &layout.geometry;
    // Rows for the blocks, plus a whole slot span per slot and one more for alignment.
    let rows = blocks * g.envelope_rows + (slots + 1) * (g.slot_rows + g.slot_align_rows.max(1));
    let geometry = layout.carve(blocks, slots, rows).expect("carve");
    let spec = PoolSpec::from_layout(&layout, geometry).expect("spec");
    let pool = Pool::new(backend, spec, Stream::DEFAULT).expect("pool");
    (pool, layout_id(&layout).expect("layout id"))
}

/// Device ranges `(address, bytes)` of everything block `id` owns: its envelope in every
/// plane, then its block in every indexer layer.
pub fn block_ranges(pool: &Pool, id: u32) -> Vec<(u64, u64)> {
    let g = &pool.spec().geometry;
    let mut out = Vec::new();
    for (p, &w) in pool.spec().plane_widths.iter().enumerate() {
        let bb = g.block_bytes(w);
        out.push((pool.plane_ptr(p).unwrap() + u64::from(id) * bb, bb));
    }
    if let (Some(base), Some(ix)) = (pool.indexer_ptr(), pool.spec().indexer) {
        for (&pb, &off) in ix.pool_block_bytes().iter().zip(pool.indexer_offsets()) {
            for c in 0..pool.spec().csa_layers.len() as u64 {
                out.push((base + off + (c * pool.indexer_blocks() + u64::from(id)) * pb, pb));
            }
        }
    }
    out
}

/// Device ranges of the whole slot at `position`, one per plane.
pub fn slot_ranges(pool: &Pool, position: i64) -> Vec<(u64, u64)> {
    let g = pool.geometry().unwrap();
    let (row, _) = g.slot_span(position).unwrap();
    pool.spec()
        .plane_widths
        .iter()
        .enumerate()
        .map(|(p, &w)| (pool.plane_ptr(p).unwrap() + row as u64 * w, g.slot_bytes(w)))
        .collect()
}

/// Device ranges of the window rows (the entry rows some (layer, ring position) maps to) of
/// the slot at `position`, every plane.
pub fn window_ranges(pool: &Pool, position: i64) -> Vec<(u64, u64)> {
    let g = pool.geometry().unwrap();
    let (row, _) = g.slot_span(position).unwrap();
    let mut out = Vec::new();
    for (p, &w) in pool.spec().plane_widths.iter().enumerate() {
        for (start, count) in g.entry_row_runs() {
            let r = (row + g.arena_rows + start) as u64;
            out.push((pool.plane_ptr(p).unwrap() + r * w, count as u64 * w));
        }
    }
    out
}

/// Read `ranges` of `pool`'s memory, concatenated.
pub fn read(pool: &Pool, ranges: &[(u64, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(addr, len) in ranges {
        let mut buf = vec![0u8; len as usize];
        // SAFETY: the ranges come from the pool's own planes and indexer (helpers above).
        unsafe { pool.backend().download(&mut buf, addr, pool.stream()).unwrap() };
        out.extend_from_slice(&buf);
    }
    out
}

/// Write `bytes` across `ranges` of `pool`'s memory, in order.
pub fn write(pool: &Pool, ranges: &[(u64, u64)], bytes: &[u8]) {
    let mut at = 0usize;
    for &(addr, len) in ranges {
        // SAFETY: as in `read`.
        unsafe { pool.backend().upload(addr, &bytes[at..at + len as usize], pool.stream()).unwrap() };
        at += len as usize;
    }
    pool.backend().synchronize(pool.stream()).unwrap();
}

/// Total bytes of `ranges`.
pub fn total(ranges: &[(u64, u64)]) -> usize {
    ranges.iter().map(|r| r.1 as usize).sum()
}

/// Every plane and indexer byte of `pool`, as `(address, bytes)` ranges.
pub fn all_ranges(pool: &Pool) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> =
        (0..pool.num_planes()).map(|p| (pool.plane_ptr(p).unwrap(), pool.plane_bytes(p).unwrap())).collect();
    if let (Some(base), Some(ix)) = (pool.indexer_ptr(), pool.spec().indexer) {
        let layers = pool.spec().csa_layers.len() as u64;
        for (&pb, &off) in ix.pool_block_bytes().iter().zip(pool.indexer_offsets()) {
            out.push((base + off, layers * pool.indexer_blocks() * pb));
        }
    }
    out
}

/// Runs of consecutive ids in pairs `(a, b)` where both sides step by one.
pub fn paired_runs(pairs: &[(u32, u32)]) -> usize {
    let mut sorted = pairs.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).filter(|w| !(w[1].0 == w[0].0 + 1 && w[1].1 == w[0].1 + 1)).count()
        + usize::from(!pairs.is_empty())
}
