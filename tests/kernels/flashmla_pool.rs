//! A V4-Flash pool in FlashMLA's 584-B paged rows, in pages of 64 (`KvDtype::FlashMlaV4`) and
//! of 2 (`KvDtype::FlashMlaV4P2`), on the host backend: the plan's layout keeps every block,
//! slot and arena in whole pages; the row writer puts each token's row, as the format's
//! description packs it, at the page place of the row the geometry names (window rows of every
//! class, compressed CSA and HCA rows); a checkpoint of a slot restored into another carries the
//! window rows byte-exact through the paged spans (and nothing outside the image changes); the
//! FlashMLA decode path's operands, read by FlashMLA's own arithmetic over the layers' page
//! views, name the rows the writer wrote — through one HCA view in pages of 2.

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Stream;
use v4pool::geometry::Class;
use v4pool::model::ModelShape;
use v4pool::pool::{CompressedRow, Pool, PoolSpec, RowSet, RowWriteCapacity, WindowSeq};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

use crate::common;
use crate::flashmla_common;
use common::{case_seed, Rng};

/// FlashMLA's V4 rows in pages of 64 and of 2.
const PAGED: [KvDtype; 2] = [KvDtype::FlashMlaV4, KvDtype::FlashMlaV4P2];

/// `k` speculative steps: the ring is 128 + k, so an entry's runs are not whole pages.
fn pool_k(kv: KvDtype, k: i64) -> Arc<Pool> {
    let model = ModelShape::v4_flash(k).unwrap();
    let p = plan(&model, &PlanRequest::new(kv, IndexerDtype::Fp8, 3, 160 << 20)).unwrap();
    let spec = PoolSpec::from_plan(&p).unwrap();
    Arc::new(Pool::new(Arc::new(HostBackend::new()), spec, Stream::DEFAULT).unwrap())
}

fn plane(pool: &Pool) -> Vec<u8> {
    let mut out = vec![0u8; pool.plane_bytes(0).unwrap() as usize];
    pool.read_plane(0, 0, &mut out).unwrap();
    out
}

/// The plane row view row `r` of `layer` is (the view runs from its base to the plane's end).
fn plane_row(pool: &Pool, layer: usize, r: i64) -> u64 {
    let rows = pool.plane_bytes(0).unwrap() as i64 / 584;
    (rows - pool.layer_view(layer, 0).unwrap().rows + r) as u64
}

fn bf16_row(rng: &mut Rng) -> Vec<u16> {
    (0..512)
        .map(|i| {
            let mag = 2f32.powi(i / 64 % 7 - 3);
            let v = (rng.below(2001) as f32 / 1000.0 - 1.0) * mag;
            (v.to_bits() >> 16) as u16
        })
        .collect()
}

#[test]
fn the_layout_is_whole_pages() {
    for dtype in PAGED {
        let p = pool_k(dtype, 1);
        let g = p.geometry().unwrap();
        let page = dtype.page_rows();
        assert_eq!(p.spec().plane_widths, vec![584]);
        assert_eq!(page, p.spec().kernel_page_rows(), "{}: FlashMLA's page is the plane's", dtype.name());
        for (what, rows) in [("envelope", g.envelope_rows), ("slot", g.slot_rows), ("arena", g.arena_rows)] {
            assert_eq!(rows % page, 0, "{}: {what} rows {rows} are not whole pages", dtype.name());
        }
        assert_eq!(g.plane_rows % page, 0);
        // V4-Flash's envelope: 21 CSA layers × 64 rows + 20 HCA layers × 2 = 1,384 rows, padded
        // to 1,408 in pages of 64, whole in pages of 2.
        assert_eq!(g.envelope_rows, if page == 64 { 1_408 } else { 1_384 }, "{}", dtype.name());
    }
}

#[test]
fn rows_land_at_their_page_places() {
    for dtype in PAGED {
        let p = pool_k(dtype, 0);
        let f = dtype.row_format().format();
        let mut rng = Rng::new(case_seed("flashmla-pool", 0));
        p.write_plane(0, 0, &rng.bytes(p.plane_bytes(0).unwrap() as usize)).unwrap();
        let slots: Vec<_> = (0..2).map(|_| p.alloc_slot().unwrap()).collect();
        let blocks: Vec<_> = (0..2).map(|_| p.alloc_block().unwrap().handle).collect();
        let mut want = plane(&p); // after the slots' state was initialised
        let mut w = p.kv_row_writer(RowWriteCapacity::new(64)).unwrap();
        let seqs = [
            WindowSeq::new(slots[0].handle, 61, 5), // crosses a page
            WindowSeq::new(slots[1].handle, 4_000, 3),
        ];
        w.stage_window(&seqs).unwrap();
        let kv: Vec<u16> = (0..8).flat_map(|_| bf16_row(&mut rng)).collect();
        let g = p.geometry().unwrap();
        for ratio in [0, 4, 128] {
            let layer = g.ratios.iter().position(|&r| r == ratio).unwrap();
            w.write(layer, RowSet::Window, &kv, 512).unwrap();
            let mut t = 0;
            for (s, lease) in seqs.iter().zip(&slots) {
                let pos = p.with_boundary(|b| b.position(lease.handle)).unwrap().unwrap();
                for i in 0..s.tokens as i64 {
                    let q = (s.first_position + i) % g.ring_slots;
                    let row = plane_row(&p, layer, g.window_index(layer, pos, q).unwrap());
                    f.place(row, &f.pack(&kv[t * 512..(t + 1) * 512]).unwrap(), &mut [&mut want[..]])
                        .unwrap();
                    t += 1;
                }
            }
        }
        for (class, ratio, entries) in
            [(Class::Csa, 4, [(1usize, 5i64), (0, 63), (1, 0)]), (Class::Hca, 128, [(0, 1), (1, 0), (1, 1)])]
        {
            let rows: Vec<CompressedRow> =
                entries.iter().map(|&(b, r)| CompressedRow { block: blocks[b], row: r }).collect();
            w.stage_compressed(class, &rows).unwrap();
            let layer = g.ratios.iter().position(|&r| r == ratio).unwrap();
            w.write(layer, RowSet::Compressed(class), &kv[..3 * 512], 512).unwrap();
            for (i, &(b, r)) in entries.iter().enumerate() {
                let row = plane_row(&p, layer, g.compress_index(layer, i64::from(blocks[b].id), r).unwrap());
                f.place(row, &f.pack(&kv[i * 512..(i + 1) * 512]).unwrap(), &mut [&mut want[..]]).unwrap();
            }
        }
        let got = plane(&p);
        let bad = (0..got.len() / 584)
            .filter(|&r| got[r * 584..(r + 1) * 584] != want[r * 584..(r + 1) * 584])
            .count();
        assert_eq!(
            bad,
            0,
            "{}: {bad} row-sized byte ranges differ from the description's placement",
            dtype.name()
        );
    }
}

#[test]
fn a_checkpoint_carries_window_rows_through_the_paged_spans() {
    for (dtype, k) in PAGED.into_iter().flat_map(|d| [(d, 0), (d, 1), (d, 2)]) {
        let p = pool_k(dtype, k);
        let runs = p.geometry().unwrap().entry_row_runs();
        println!("{} spec steps {k}: {} entry runs, first {:?}", dtype.name(), runs.len(), runs.first());
        let f = dtype.row_format().format();
        let mut rng = Rng::new(case_seed("flashmla-pool", 1));
        p.write_plane(0, 0, &rng.bytes(p.plane_bytes(0).unwrap() as usize)).unwrap();
        let a = p.alloc_slot().unwrap();
        let b = p.alloc_slot().unwrap();
        let mut w = p.kv_row_writer(RowWriteCapacity::new(200)).unwrap();
        w.stage_window(&[WindowSeq::new(a.handle, 0, 130)]).unwrap();
        let kv: Vec<u16> = (0..130).flat_map(|_| bf16_row(&mut rng)).collect();
        let g = p.geometry().unwrap();
        let layers: Vec<usize> =
            [0, 4, 128].iter().map(|&r| g.ratios.iter().position(|&x| x == r).unwrap()).collect();
        for &layer in &layers {
            w.write(layer, RowSet::Window, &kv, 512).unwrap();
        }
        // The manager's checkpoint layout (the units a checkpoint fills) cuts the image where
        // the pool's own copy runs do: the same paged spans.
        let ck = p.spec().checkpoint_layout().unwrap();
        assert_eq!(ck.plane_ranges, p.checkpoint_ranges().unwrap(), "{} k {k}", dtype.name());
        assert_eq!(ck.image_bytes, p.checkpoint_image_bytes().unwrap());
        let image = p.checkpoint(a.handle).unwrap();
        let before = plane(&p);
        p.restore(b.handle, &image).unwrap();
        let after = plane(&p);
        let pos = |h| p.with_boundary(|bd| bd.position(h)).unwrap().unwrap();
        let (pa, pb) = (pos(a.handle), pos(b.handle));
        // Every window row of every layer the writer wrote reads back the same in slot b.
        for &layer in &layers {
            for q in 0..g.ring_slots {
                let ra = plane_row(&p, layer, g.window_index(layer, pa, q).unwrap());
                let rb = plane_row(&p, layer, g.window_index(layer, pb, q).unwrap());
                assert_eq!(
                    f.fetch(ra, &[&after[..]]).unwrap(),
                    f.fetch(rb, &[&after[..]]).unwrap(),
                    "{} k {k}: layer {layer} ring position {q}",
                    dtype.name()
                );
            }
        }
        // Nothing outside slot b's pages changed.
        let (s, e) = g.slot_span(pb).unwrap();
        let (s, e) = (s as usize * 584, e as usize * 584);
        assert!(before[..s] == after[..s] && before[e..] == after[e..], "the restore wrote outside its slot");
    }
}

/// The FlashMLA decode path's operands as FlashMLA reads them: every layer's window rows and
/// every HCA layer's compressed rows, written by the row writer over a plane of random bytes,
/// are what FlashMLA's own arithmetic (`flashmla_common::flashmla_v4_read`) fetches for each
/// index of `indices` / `extra_indices` from the layer's page view (`[pages, P, 1, 584]`, P the
/// format's kernel page, block stride P × 584). MTP 1 (ring 129) puts dense layer 1 at an odd
/// row: shift 1 in pages of 2. The HCA operands: one per layer in pages of 64 (20 page shifts),
/// one for all 20 HCA layers in pages of 2.
#[test]
fn flashmla_reads_the_decode_paths_rows_through_the_page_views() {
    use v4pool::pool::{DecodeCapacity, DecodeSeq, FlashMlaWidths};
    for dtype in PAGED {
        let p = pool_k(dtype, 1);
        let g = p.geometry().unwrap();
        let f = dtype.row_format().format();
        let page = p.spec().kernel_page_rows();
        let mut rng = Rng::new(case_seed("flashmla-pool-read", page as u64));
        // Random bytes everywhere: an index naming any other row reads other bytes.
        p.write_plane(0, 0, &rng.bytes(p.plane_bytes(0).unwrap() as usize)).unwrap();
        let slot = p.alloc_slot().unwrap();
        let blocks: Vec<_> = (0..3).map(|_| p.alloc_block().unwrap().handle).collect();
        let table: Vec<i32> = blocks.iter().map(|b| b.id as i32).collect();
        let ctx = 3 * 256i64;
        let first = ctx - 128; // the window of the token at ctx - 1
        let mut w = p.kv_row_writer(RowWriteCapacity::new(128)).unwrap();
        let win: Vec<u16> = (0..128).flat_map(|_| bf16_row(&mut rng)).collect();
        w.stage_window(&[WindowSeq::new(slot.handle, first, 128)]).unwrap();
        for layer in 0..g.num_layers {
            w.write(layer, RowSet::Window, &win, 512).unwrap();
        }
        // Each HCA layer's own rows (2 a block): entry e of a head is block e / 2, row e % 2.
        let rows: Vec<CompressedRow> =
            (0..6).map(|e| CompressedRow { block: blocks[e / 2], row: (e % 2) as i64 }).collect();
        w.stage_compressed(Class::Hca, &rows).unwrap();
        let hca_layers: Vec<usize> =
            (0..g.num_layers).filter(|&l| g.layer_slot(l).ok() == Some(Class::Hca)).collect();
        let mut hca_kv = Vec::new();
        for &layer in &hca_layers {
            let x: Vec<u16> = (0..6).flat_map(|_| bf16_row(&mut rng)).collect();
            w.write(layer, RowSet::Compressed(Class::Hca), &x, 512).unwrap();
            hca_kv.push(x);
        }
        let cap = DecodeCapacity::new(1, 1, 3, 128, 512);
        let mut fm = p.flashmla_decode_path(cap, FlashMlaWidths::for_pool(&p, cap).unwrap()).unwrap();
        fm.stage(&[DecodeSeq::new(slot.position, ctx, 1, &table)]).unwrap();
        fm.build().unwrap();
        let bytes = plane(&p);
        let base = p.plane_ptr(0).unwrap();
        let packed = |x: &[u16]| f.pack(x).unwrap().concat();
        let (mut hca_views, mut dense_shifts) =
            (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
        for layer in 0..g.num_layers {
            let class = g.layer_slot(layer).unwrap();
            let ops = fm.flashmla(layer).unwrap();
            let pv = p.page_view(layer, 0, page).unwrap();
            assert_eq!(
                (pv.page_rows, ops.shift),
                (page, pv.row_shift as i32),
                "{} layer {layer}",
                dtype.name()
            );
            if class == Class::Dense {
                dense_shifts.insert(ops.shift);
            }
            let view = &bytes[(pv.ptr - base) as usize..];
            let read = |i: i32| {
                flashmla_common::flashmla_v4_read(view, page as usize, page as usize * 584, i.into())
            };
            let ix = fm.read_flashmla(ops.indices).unwrap();
            assert_eq!(fm.read_flashmla(ops.topk_length).unwrap()[0], 128, "{} layer {layer}", dtype.name());
            for e in 0..128 {
                // Oldest first: entry e is position first + e.
                let want = packed(&win[e * 512..(e + 1) * 512]);
                assert_eq!(read(ix[e]), Some(want), "{} layer {layer} window entry {e}", dtype.name());
            }
            if class != Class::Hca {
                continue;
            }
            let extra = ops.extra_indices.unwrap();
            hca_views.insert(extra.ptr);
            let ex = fm.read_flashmla(extra).unwrap();
            assert_eq!(fm.read_flashmla(ops.extra_topk_length.unwrap()).unwrap()[0], 6);
            let x = &hca_kv[hca_layers.iter().position(|&l| l == layer).unwrap()];
            for e in 0..6 {
                let want = packed(&x[e * 512..(e + 1) * 512]);
                assert_eq!(read(ex[e]), Some(want), "{} layer {layer} HCA entry {e}", dtype.name());
            }
        }
        let want_views = if page == 2 { 1 } else { hca_layers.len() };
        println!("{}: {} HCA views, dense shifts {dense_shifts:?}", dtype.name(), hca_views.len());
        assert_eq!(hca_views.len(), want_views, "{}: HCA index operands", dtype.name());
        assert_eq!(hca_layers.len(), 20);
        if page == 2 {
            assert_eq!(
                dense_shifts.into_iter().collect::<Vec<_>>(),
                [0, 1],
                "ring 129: dense layer 1 at an odd row"
            );
        }
    }
}
