//! Shared by the transfer tests: V4 pools of a chosen size on any backend, and byte access to
//! a block's units (every plane and indexer layer) and a slot through the pool's addresses.
#![allow(dead_code)]

use std::sync::Arc;
use v4pool::backend::{Backend, Stream};
use v4pool::checkpoint::layout_id;
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};
use v4pool::transfer::{Rebound, RequestKv};

/// A V4 pool of `model` (fp8 KV, fp8 indexer) with `blocks` blocks and `slots` slots (plane
/// sized for exactly that, so the boundary cannot grow past it), and its layout id.
pub fn v4_pool(backend: Arc<dyn Backend>, model: &ModelShape, blocks: i64, slots: i64) -> (Pool, String) {
    pool_of(backend, model, KvDtype::Fp8, blocks, slots)
}

/// [`v4_pool`] for `model` with `kv` rows (V4.1: bf16 only).
pub fn pool_of(
    backend: Arc<dyn Backend>,
    model: &ModelShape,
    kv: KvDtype,
    blocks: i64,
    slots: i64,
) -> (Pool, String) {
    let layout = PoolLayout::new(model, kv, IndexerDtype::Fp8).expect("layout");
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
    if let Some(base) = pool.indexer_ptr() {
        for (parts, &off) in pool.indexer_parts().iter().zip(pool.indexer_offsets()) {
            for part in parts {
                let at = part.offset(u64::from(id), pool.indexer_blocks()).unwrap();
                out.push((base + off + at, part.block_bytes));
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
    if let Some(base) = pool.indexer_ptr() {
        for (parts, &off) in pool.indexer_parts().iter().zip(pool.indexer_offsets()) {
            let per_block: u64 = parts.iter().map(|p| p.block_bytes).sum();
            out.push((base + off, per_block * pool.indexer_blocks()));
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

/// The word [`poison_pool`] fills a pool with (never zero: a zeroed pool would pass).
pub const POISON: u32 = 0xa5c3_5a3c;

/// Fill every byte of `pool` with `POISON` (device fill).
pub fn poison_pool(pool: &Pool) {
    assert_ne!(POISON, 0);
    for (addr, len) in all_ranges(pool) {
        // SAFETY: the pool's own planes and indexer; lengths are multiples of 4 (row widths
        // and indexer blocks are).
        unsafe { pool.backend().fill_u32(addr, len / 4, POISON, pool.stream()).unwrap() };
    }
    pool.backend().synchronize(pool.stream()).unwrap();
}

/// A prefill's request of `tokens` on `pool` (blocks of 256 tokens): fresh blocks, random bytes in them and in
/// its whole slot.
pub fn random_request(pool: &Pool, tokens: i64, rng: &mut crate::common::Rng) -> RequestKv {
    let slot = pool.alloc_slot().unwrap();
    let n = (tokens + 255) / 256;
    let blocks: Vec<_> = (0..n).map(|_| pool.alloc_block().unwrap().handle).collect();
    // Random bytes across the planes and indexer in large uploads (every block gets some).
    for (addr, len) in all_ranges(pool) {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(256 << 20);
            let mut buf = vec![0u8; n as usize];
            rng.fill(&mut buf);
            // SAFETY: inside the pool's own allocation.
            unsafe { pool.backend().upload(addr + at, &buf, pool.stream()).unwrap() };
            at += n;
        }
    }
    pool.backend().synchronize(pool.stream()).unwrap();
    RequestKv { blocks, slot: slot.handle, context_len: tokens as u64 }
}

/// Everything the request owns on `pool`, per block and slot, as one byte vector.
pub fn request_bytes(pool: &Pool, blocks: &[u32], position: i64) -> Vec<u8> {
    let mut ranges = Vec::new();
    for &b in blocks {
        ranges.extend(block_ranges(pool, b));
    }
    ranges.extend(slot_ranges(pool, position));
    read(pool, &ranges)
}

/// Receiver words outside the request that still hold the poison, and all such words.
pub fn untouched_outside(pool: &Pool, out: &Rebound) -> (u64, u64) {
    let mut inside: Vec<(u64, u64)> = slot_ranges(pool, out.slot.position);
    for b in &out.blocks {
        inside.extend(block_ranges(pool, b.id));
    }
    inside.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (a, n) in inside {
        match merged.last_mut() {
            Some(m) if m.0 + m.1 == a => m.1 += n,
            _ => merged.push((a, n)),
        }
    }
    let (mut poisoned, mut words) = (0u64, 0u64);
    for (base, len) in all_ranges(pool) {
        let mut at = base;
        let ends = merged.iter().filter(|m| m.0 >= base && m.0 < base + len).copied();
        for (gap_start, gap_end) in ends.map(|m| (m.0, m.0 + m.1)).chain([(base + len, base + len)]) {
            if gap_start > at {
                let bytes = read(pool, &[(at, gap_start - at)]);
                words += bytes.len() as u64 / 4;
                poisoned += bytes
                    .chunks_exact(4)
                    .filter(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == POISON)
                    .count() as u64;
            }
            at = at.max(gap_end);
        }
    }
    (poisoned, words)
}

/// The receiver holds exactly the sender's request: every block (in table order) and the
/// whole slot byte-identical, the window rows too, and every receiver word outside the
/// request still `POISON` (see [`poison_pool`]). Returns the words checked outside.
pub fn check_received(
    name: &str,
    tokens: i64,
    sender: &Pool,
    receiver: &Pool,
    req: &RequestKv,
    out: &Rebound,
) -> u64 {
    let sp = sender.slot_position(req.slot).unwrap();
    assert_eq!(req.blocks.len(), out.blocks.len());
    // Unit by unit (a 1M-token request is gigabytes: no copy of it all at once).
    for (i, (a, b)) in req.blocks.iter().zip(&out.blocks).enumerate() {
        assert!(
            same_bytes(sender, &block_ranges(sender, a.id), receiver, &block_ranges(receiver, b.id)),
            "{name} {tokens}: block {i} of the table (ids {} -> {}) differs",
            a.id,
            b.id
        );
    }
    assert!(
        same_bytes(sender, &slot_ranges(sender, sp), receiver, &slot_ranges(receiver, out.slot.position)),
        "{name} {tokens}: slot differs"
    );
    assert_eq!(
        read(receiver, &window_ranges(receiver, out.slot.position)),
        read(sender, &window_ranges(sender, sp)),
        "{name} {tokens}: window rows differ"
    );
    let (poisoned, words) = untouched_outside(receiver, out);
    assert_eq!(poisoned, words, "{name} {tokens}: receiver bytes outside the request changed");
    words
}

/// Whether `a`'s ranges of pool `pa` hold the same bytes as `b`'s of pool `pb` (pairwise, equal
/// lengths), read range by range.
pub fn same_bytes(pa: &Pool, a: &[(u64, u64)], pb: &Pool, b: &[(u64, u64)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&ra, &rb)| ra.1 == rb.1 && read(pa, &[ra]) == read(pb, &[rb]))
}

/// Whether the test `test` of `module` (the caller's `module_path!()`) runs its NIXL body in
/// this process: false with SKIP printed when the library does not load (a panic with
/// `V4POOL_REQUIRE_NIXL=1`). UCX reads its settings from the environment when an agent's
/// backend starts, and other tests share this process, so a variable of `ucx_defaults` the
/// environment lacks is never `set_var` here: the test runs again alone in a child process
/// with them set, its output printed, and this returns false (the child ran the body).
pub fn nixl_or_skip(module: &str, test: &str, ucx_defaults: &[(&str, &str)]) -> bool {
    if let Some(why) = v4pool::transfer::nixl::unavailable_reason() {
        if std::env::var("V4POOL_REQUIRE_NIXL").is_ok_and(|v| v == "1") {
            panic!("{test}: V4POOL_REQUIRE_NIXL=1 but NIXL is unavailable: {why}");
        }
        println!("SKIP: {test}: NIXL unavailable ({why})");
        return false;
    }
    let missing: Vec<_> = ucx_defaults.iter().filter(|(k, _)| std::env::var_os(k).is_none()).collect();
    if missing.is_empty() {
        return true;
    }
    let mut c = crate::common::child_test(module, test);
    for (k, v) in missing {
        c.env(k, v);
    }
    crate::common::print_child_output(&crate::common::run_child_test(c, test));
    false
}
