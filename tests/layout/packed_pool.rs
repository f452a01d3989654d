//! A V4.1-Flash pool in FlashMLA's packed V4.1 layout (`KvDtype::FlashMlaV41Fp4`, open point
//! O3), on the host backend: windows and state in 528-B rows, compressed rows in 288-B fp4 rows
//! packed in each envelope (`geometry::PackedRows`).
//!
//! - The geometry, on random packed configurations: every compressed row lies inside its
//!   block's bytes, every window row inside its slot's bytes past the arena, no two rows share
//!   a byte, every index is inside its view, and blocks start on both lattices.
//! - The row writer puts each window row where the 528-B view names it and each compressed row
//!   at `compress_index × 288` of the compressed view, as the formats' descriptions pack them; a
//!   decoder written from the format text (not from `crate::format`) reads the fp4 rows back
//!   within the format's rounding; nothing else in the plane changes.
//! - Boundary moves that relocate blocks and slots, and a checkpoint restored into another slot,
//!   keep every compressed and window row byte-exact where its new block or slot names it.

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Stream;
use v4pool::format::RowFormatId;
use v4pool::geometry::{Class, GeometrySpec, PackedRows};
use v4pool::model::ModelShape;
use v4pool::pool::{BlockHandle, SlotHandle};
use v4pool::pool::{CompressedRow, Pool, PoolSpec, RowSet, RowWriteCapacity, WindowSeq};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

use crate::common;
use common::{case_seed, Rng};

const W: usize = 528;
const C: usize = 288;

fn pool_k(k: i64, budget: u64) -> Arc<Pool> {
    let model = ModelShape::v41_flash(k).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::FlashMlaV41Fp4, IndexerDtype::Fp8, 3, budget)).unwrap();
    let spec = PoolSpec::from_plan(&p).unwrap();
    Arc::new(Pool::new(Arc::new(HostBackend::new()), spec, Stream::DEFAULT).unwrap())
}

fn pool() -> Arc<Pool> {
    pool_k(0, 24 << 20)
}

fn plane(pool: &Pool) -> Vec<u8> {
    let mut out = vec![0u8; pool.plane_bytes(0).unwrap() as usize];
    pool.read_plane(0, 0, &mut out).unwrap();
    out
}

/// Byte offset in the plane of view row `r` of `layer`'s 528-B window view.
fn window_byte(pool: &Pool, layer: usize, r: i64) -> usize {
    let v = pool.layer_view(layer, 0).unwrap();
    (v.ptr - pool.plane_ptr(0).unwrap()) as usize + r as usize * W
}

fn bf16_row(rng: &mut Rng) -> Vec<u16> {
    (0..512)
        .map(|i| {
            let mag = 2f32.powi(i / 16 % 9 - 4);
            let v = (rng.below(2001) as f32 / 1000.0 - 1.0) * mag;
            (v.to_bits() >> 16) as u16
        })
        .collect()
}

fn bf16_value(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

/// FlashMLA's V4.1 fp4 row from the format text: 512 e2m1 values, two a byte with the even
/// index in the low nibble (codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), then 32
/// e4m3fn scales, one per 16 values.
fn decode_fp4(row: &[u8]) -> Vec<f32> {
    assert_eq!(row.len(), C);
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let e4m3 = |b: u8| {
        let (e, m) = (i32::from((b >> 3) & 15), f32::from(b & 7));
        let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
        if b & 0x80 != 0 {
            -mag
        } else {
            mag
        }
    };
    (0..512)
        .map(|i| {
            let byte = row[i / 2];
            let nib = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
            let v = E2M1[usize::from(nib & 7)] * if nib & 8 != 0 { -1.0 } else { 1.0 };
            v * e4m3(row[256 + i / 16])
        })
        .collect()
}

/// The V4.1 worked numbers at block 256: 640 compressed rows (owners 2, 8, 14, 20 at 0, 128,
/// 256, 384) in 354 plane rows (184,320 B rounded up to where the lattices meet: 6 plane rows),
/// so 649 compressed rows from one block to the next, and no view lead.
#[test]
fn the_packed_layout_meets_both_lattices() {
    let p = pool();
    let g = p.geometry().unwrap();
    assert_eq!(p.spec().plane_widths, vec![528]);
    assert_eq!(g.packed_rows, Some(PackedRows { compressed: 288, plane: 528 }));
    assert_eq!((g.envelope_rows, g.compress_stride, g.view_lead_rows), (354, 649, 0));
    assert_eq!(g.envelope_rows * 528 % 288, 0);
    for (owner, at) in [(2usize, 0i64), (8, 128), (14, 256), (20, 384)] {
        assert_eq!(g.compress_bias[owner], at, "owner {owner}");
    }
    // Readers reach their owner's rows: layer 3 (ratio 2) reads owner 2's, layer 39 owner 20's.
    assert_eq!(g.compress_index(3, 1, 5).unwrap(), 649 + 5);
    assert_eq!(g.compress_index(39, 2, 7).unwrap(), 2 * 649 + 384 + 7);
    // Every layer's window view starts on a page of the plane (no lead), and the compressed
    // view spans the plane.
    for l in 0..g.num_layers {
        let v = p.page_view(l, 0, 64).unwrap();
        assert!(v.row_shift < 64);
        if g.ratios[l] > 0 {
            let c = p.compressed_view(l).unwrap();
            assert_eq!((c.ptr, c.row_bytes), (p.plane_ptr(0).unwrap(), 288));
            assert_eq!(c.rows, p.plane_bytes(0).unwrap() as i64 / 288);
        } else {
            assert!(p.compressed_view(l).is_err(), "a dense layer has no compressed view");
        }
    }
    let unpacked = PoolSpec::from_plan(
        &plan(
            &ModelShape::v41_flash(0).unwrap(),
            &PlanRequest::new(KvDtype::FlashMlaV41, IndexerDtype::Fp8, 3, 24 << 20),
        )
        .unwrap(),
    )
    .unwrap();
    let (e, s) = (unpacked.geometry.envelope_rows, unpacked.geometry.slot_rows);
    println!(
        "packed: block {} B, slot {} B; 528-B rows throughout: block {} B, slot {} B",
        g.envelope_rows * 528,
        g.slot_rows * 528,
        e * 528,
        s * 528
    );
    assert!(g.envelope_rows * 528 < e * 528 * 6 / 10, "packing saves over 40 % of a block");
    assert_eq!(g.slot_rows, s, "slots do not change");
}

/// Random packed geometries: the byte ranges every row of every live block and slot occupies.
#[test]
fn random_packed_geometries_keep_every_row_apart() {
    let mut rng = Rng::new(case_seed("packed-geometry", 0));
    for case in 0..60 {
        // Ratios [0, 0 | r_a × n_a | r_b × n_b] with the first layer of each class a source.
        let (ra, rb) = (rng.pick(&[2, 4, 8]), rng.pick(&[1, 2]));
        let (ra, rb) = if ra == rb { (4, 1) } else { (ra, rb) };
        let (na, nb) = (rng.range(1, 5) as usize, rng.range(1, 5) as usize);
        let mut ratios = vec![0, 0];
        ratios.extend(std::iter::repeat_n(ra, na));
        ratios.extend(std::iter::repeat_n(rb, nb));
        let mut sources = vec![2, 2 + na];
        if na > 2 && rng.chance(0.5) {
            sources.insert(1, 3);
        }
        let block = 8 * rng.range(1, 5);
        let ring = rng.range(2, 12);
        let (c, w) = (rng.range(8, 80) * 4, rng.range(8, 80) * 4);
        let (blocks, slots) = (rng.range(1, 5), rng.range(1, 4));
        let g = GeometrySpec::new(ratios.clone(), blocks, slots, ring, block)
            .shared_compressors(sources.clone())
            .arena_rows(rng.range(0, 4))
            .slot_align_rows(rng.pick(&[1, 2, 64]))
            .envelope_align_rows(rng.pick(&[1, 64]))
            .packed_rows(c, w)
            .build()
            .unwrap_or_else(|e| panic!("case {case}: {e}"));
        let (c, w) = (c as u64, w as u64);
        assert_eq!(
            g.envelope_rows as u64 * w % c,
            0,
            "case {case}: a block does not start on the compressed lattice"
        );
        assert_eq!(g.compress_stride as u64 * c, g.envelope_rows as u64 * w);
        let plane = g.plane_rows as u64 * w;
        let mut spans: Vec<(u64, u64, String)> = Vec::new();
        for l in 0..g.num_layers {
            let base = g.layer_base_row(l).unwrap();
            assert!(base >= 0, "case {case}: layer {l} view starts below the plane");
            if g.ratios[l] > 0 && g.owner(l).unwrap() == l {
                let rows = g.layer_class(l).unwrap().block_rows;
                for b in 0..blocks {
                    let (lo, hi) =
                        (b as u64 * g.envelope_rows as u64 * w, (b + 1) as u64 * g.envelope_rows as u64 * w);
                    for r in 0..rows {
                        let i = g.compress_index(l, b, r).unwrap();
                        assert!((0..g.compressed_view_rows(l).unwrap()).contains(&i));
                        let at = i as u64 * c;
                        assert!(
                            lo <= at && at + c <= hi,
                            "case {case}: layer {l} block {b} row {r} outside its block"
                        );
                        spans.push((at, c, format!("compressed l{l} b{b} r{r}")));
                    }
                }
            }
            if g.ratios[l] > 0 {
                // A reader's index is its owner's row.
                let o = g.owner(l).unwrap();
                assert_eq!(g.compress_index(l, 0, 0).unwrap(), g.compress_index(o, 0, 0).unwrap());
            }
            for pos in g.live_positions() {
                let (s, e) = g.slot_span(pos).unwrap();
                let (lo, hi) = ((s + g.arena_rows) as u64 * w, e as u64 * w);
                for q in 0..ring {
                    let i = g.window_index(l, pos, q).unwrap();
                    assert!((0..g.layer_view_rows(l).unwrap()).contains(&i));
                    let at = (base + i) as u64 * w;
                    assert!(lo <= at && at + w <= hi, "case {case}: layer {l} window outside its slot");
                    spans.push((at, w, format!("window l{l} p{pos} q{q}")));
                }
            }
        }
        spans.sort();
        for pair in spans.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 <= pair[1].0,
                "case {case}: {} and {} share bytes",
                pair[0].2,
                pair[1].2
            );
        }
        assert!(spans.last().is_none_or(|s| s.0 + s.1 <= plane));
    }
    // What the packing refuses: the envelope form (V4's interleaved windows), widths below 1.
    let v4 = GeometrySpec::new(vec![0, 4, 128], 1, 1, 8, 128).packed_rows(288, 528).build();
    assert!(v4.unwrap_err().to_string().contains("compact form"));
    let zero = GeometrySpec::new(vec![0, 2, 1], 1, 1, 8, 16)
        .shared_compressors(vec![1, 2])
        .packed_rows(0, 528)
        .build();
    assert!(zero.is_err());
}

struct Written {
    /// (layer, block, row, packed bytes) of each compressed row written.
    compressed: Vec<(usize, BlockHandle, i64, Vec<u8>)>,
    /// (layer, slot handle, ring position, packed bytes) of each window row written.
    window: Vec<(usize, SlotHandle, i64, Vec<u8>)>,
}

/// Write window rows of a dense, a ratio-2 and a ratio-1 layer for both slots, and compressed
/// rows of both classes into `blocks`; returns what went where and the plane expected.
fn write_rows(
    p: &Arc<Pool>,
    slots: &[v4pool::pool::SlotLease],
    blocks: &[BlockHandle],
    rng: &mut Rng,
) -> (Written, Vec<u8>) {
    let g = p.geometry().unwrap();
    let (fw, fc) = (RowFormatId::FlashMlaV41.format(), RowFormatId::FlashMlaV41Fp4.format());
    let mut want = plane(p);
    let mut out = Written { compressed: Vec::new(), window: Vec::new() };
    let mut w = p.kv_row_writer(RowWriteCapacity::new(64)).unwrap();
    assert_eq!(w.compressed_format_code(), v4pool::raw::index::KV_ROWS_FLASHMLA_V41_FP4);
    let seqs = [
        WindowSeq::new(slots[0].handle, 125, 6), // wraps the ring
        WindowSeq::new(slots[1].handle, 9_000, 3),
    ];
    w.stage_window(&seqs).unwrap();
    let kv: Vec<u16> = (0..9).flat_map(|_| bf16_row(rng)).collect();
    for layer in [0usize, 5, 33] {
        w.write(layer, RowSet::Window, &kv, 512).unwrap();
        let mut t = 0;
        for (s, lease) in seqs.iter().zip(slots) {
            let pos = p.slot_position(lease.handle).unwrap();
            for i in 0..s.tokens as i64 {
                let q = (s.first_position + i) % g.ring_slots;
                let at = window_byte(p, layer, g.window_index(layer, pos, q).unwrap());
                let bytes = fw.pack(&kv[t * 512..(t + 1) * 512]).unwrap().remove(0);
                want[at..at + W].copy_from_slice(&bytes);
                out.window.push((layer, lease.handle, q, bytes));
                t += 1;
            }
        }
    }
    // V4.1's index slots: ratio 1 is the fine ("CSA") class, ratio 2 the coarse ("HCA") one.
    for (class, layer, entries) in [
        (Class::Hca, 2usize, vec![(0usize, 0i64), (1, 127), (2, 64), (0, 1)]),
        (Class::Csa, 20, vec![(2, 255), (1, 0), (0, 128)]),
    ] {
        let rows: Vec<CompressedRow> =
            entries.iter().map(|&(b, r)| CompressedRow { block: blocks[b], row: r }).collect();
        w.stage_compressed(class, &rows).unwrap();
        let kv: Vec<u16> = (0..entries.len()).flat_map(|_| bf16_row(rng)).collect();
        w.write(layer, RowSet::Compressed(class), &kv, 512).unwrap();
        for (i, &(b, r)) in entries.iter().enumerate() {
            let src = &kv[i * 512..(i + 1) * 512];
            let at = g.compress_index(layer, i64::from(blocks[b].id), r).unwrap() as usize * C;
            let bytes = fc.pack(src).unwrap().remove(0);
            want[at..at + C].copy_from_slice(&bytes);
            // The format text's decoder reads it back within fp4's rounding: half the widest
            // e2m1 step (1 × scale), plus what a scale rounded down saturates (amax / 16).
            let dec = decode_fp4(&bytes);
            for (gi, grp) in src.chunks(16).enumerate() {
                let amax = grp.iter().map(|&v| bf16_value(v).abs()).fold(0f32, f32::max);
                let scale = amax / 6.0;
                for (j, &v) in grp.iter().enumerate() {
                    let err = (bf16_value(v) - dec[gi * 16 + j]).abs();
                    assert!(
                        err <= scale * 1.07 + amax / 16.0 + 1e-30,
                        "value {} of a row: {err} > bound (amax {amax})",
                        gi * 16 + j
                    );
                }
            }
            out.compressed.push((layer, blocks[b], r, bytes));
        }
    }
    (out, want)
}

#[test]
fn rows_land_at_their_packed_places() {
    let p = pool();
    let mut rng = Rng::new(case_seed("packed-pool", 0));
    p.write_plane(0, 0, &rng.bytes(p.plane_bytes(0).unwrap() as usize)).unwrap();
    let slots: Vec<_> = (0..2).map(|_| p.alloc_slot().unwrap()).collect();
    let blocks: Vec<_> = (0..3).map(|_| p.alloc_block().unwrap().handle).collect();
    let (written, want) = write_rows(&p, &slots, &blocks, &mut rng);
    let got = plane(&p);
    let bad = (0..got.len()).filter(|&i| got[i] != want[i]).count();
    assert_eq!(bad, 0, "{bad} plane bytes differ from the descriptions' placement");
    println!("{} window rows, {} compressed rows in place", written.window.len(), written.compressed.len());
}

#[test]
fn boundary_moves_and_checkpoints_keep_packed_rows() {
    let p = pool();
    let g = p.geometry().unwrap();
    let mut rng = Rng::new(case_seed("packed-pool", 1));
    p.write_plane(0, 0, &rng.bytes(p.plane_bytes(0).unwrap() as usize)).unwrap();
    // Hold every block, keep three spread out, free the rest: shrinking the blocks then
    // relocates the high ones down.
    let mut all = Vec::new();
    while let Ok(b) = p.alloc_block() {
        all.push(b.handle);
    }
    let n = all.len();
    assert!(n >= 8, "the test pool holds {n} blocks");
    let keep = vec![all[n - 1], all[n / 2], all[1]];
    for b in &all {
        if !keep.contains(b) {
            p.free_block(*b).unwrap();
        }
    }
    let slots: Vec<_> = (0..2).map(|_| p.alloc_slot().unwrap()).collect();
    let (mut written, _) = write_rows(&p, &slots, &keep, &mut rng);
    let read_at = |at: usize, len: usize| {
        let mut b = vec![0u8; len];
        p.read_plane(0, at as u64, &mut b).unwrap();
        b
    };
    let check = |written: &Written, what: &str| {
        for (layer, b, r, bytes) in &written.compressed {
            let at = g.compress_index(*layer, i64::from(b.id), *r).unwrap() as usize * C;
            assert_eq!(&read_at(at, C), bytes, "{what}: layer {layer} block {} row {r}", b.id);
        }
        for (layer, h, q, bytes) in &written.window {
            let pos = p.slot_position(*h).unwrap();
            let at = window_byte(&p, *layer, g.window_index(*layer, pos, *q).unwrap());
            assert_eq!(&read_at(at, W), bytes, "{what}: layer {layer} slot at {pos} ring {q}");
        }
    };
    check(&written, "written");
    let follow = |written: &mut Written, ch: &v4pool::pool::BoundaryChange| {
        for m in &ch.block_moves {
            for e in written.compressed.iter_mut().filter(|e| e.1 == m.old) {
                e.1 = m.new;
            }
        }
        for m in &ch.slot_moves {
            for e in written.window.iter_mut().filter(|e| e.1 == m.old) {
                e.1 = m.new;
            }
        }
        (ch.block_moves.len(), ch.slot_moves.len())
    };
    // Blocks down to a few: the kept ones above move (their compressed rows with them).
    let before = p.counts().unwrap().num_blocks;
    let ch = p.shrink_blocks(before - 4).unwrap();
    let moved = follow(&mut written, &ch);
    assert!(moved.0 >= 1, "no block moved: the test shows nothing");
    check(&written, "after shrink_blocks");
    // Slots into the room, then blocks back over the slots' old rows.
    let c = p.counts().unwrap();
    let room =
        (g.slot_positions - i64::from(c.num_slots)) * g.slot_rows - i64::from(c.num_blocks) * g.envelope_rows;
    let more = (room / g.slot_rows) as u32;
    assert!(more >= 1, "no room for a slot: {c:?}");
    let ch = p.grow_slots(more).unwrap();
    follow(&mut written, &ch);
    check(&written, "after grow_slots");
    let ch = p.shrink_slots(more).unwrap();
    follow(&mut written, &ch);
    check(&written, "after shrink_slots");
    let ch = p.grow_blocks(3).unwrap();
    follow(&mut written, &ch);
    check(&written, "after grow_blocks");
    println!("moves: blocks {}, counts {:?}", moved.0, p.counts().unwrap());
    // A checkpoint of slot 0 restored into a fresh slot carries its 528-B window rows.
    let fresh = p.alloc_slot().unwrap();
    let image = p.checkpoint(slots[0].handle).unwrap();
    p.restore(fresh.handle, &image).unwrap();
    let mut copy = Written { compressed: Vec::new(), window: Vec::new() };
    for (layer, h, q, bytes) in &written.window {
        if *h == slots[0].handle {
            copy.window.push((*layer, fresh.handle, *q, bytes.clone()));
        }
    }
    assert!(!copy.window.is_empty());
    check(&copy, "restored");
    check(&written, "after the restore");
}
