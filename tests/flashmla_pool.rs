//! A V4-Flash pool in FlashMLA's 584-B paged rows (`KvDtype::FlashMlaV4`), on the host backend:
//! the plan's layout keeps every block, slot and arena in whole 64-row pages; the row writer
//! puts each token's row, as the format's description packs it, at the page place of the row
//! the geometry names (window rows of every class, compressed CSA and HCA rows); a checkpoint
//! of a slot restored into another carries the window rows byte-exact through the paged spans
//! (and nothing outside the image changes); a boundary move keeps every live byte.

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Stream;
use v4pool::format::RowFormatId;
use v4pool::geometry::Class;
use v4pool::model::ModelShape;
use v4pool::pool::{CompressedRow, Pool, PoolSpec, RowSet, RowWriteCapacity, WindowSeq};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

mod common;
use common::{case_seed, Rng};

fn pool() -> Arc<Pool> {
    pool_k(0)
}

/// `k` speculative steps: the ring is 128 + k, so an entry's runs are not whole pages.
fn pool_k(k: i64) -> Arc<Pool> {
    let model = ModelShape::v4_flash(k).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::FlashMlaV4, IndexerDtype::Fp8, 3, 160 << 20)).unwrap();
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
    let p = pool();
    let g = p.geometry().unwrap();
    assert_eq!(p.spec().plane_widths, vec![584]);
    for (what, rows) in [("envelope", g.envelope_rows), ("slot", g.slot_rows), ("arena", g.arena_rows)] {
        assert_eq!(rows % 64, 0, "{what} rows {rows} are not whole pages");
    }
    assert_eq!(g.plane_rows % 64, 0);
}

#[test]
fn rows_land_at_their_page_places() {
    let p = pool();
    let f = RowFormatId::FlashMlaV4.format();
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
                f.place(row, &f.pack(&kv[t * 512..(t + 1) * 512]).unwrap(), &mut [&mut want[..]]).unwrap();
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
    let bad =
        (0..got.len() / 584).filter(|&r| got[r * 584..(r + 1) * 584] != want[r * 584..(r + 1) * 584]).count();
    assert_eq!(bad, 0, "{bad} row-sized byte ranges differ from the description's placement");
}

#[test]
fn a_checkpoint_carries_window_rows_through_the_paged_spans() {
    for k in [0, 2] {
        let p = pool_k(k);
        let runs = p.geometry().unwrap().entry_row_runs();
        println!("spec steps {k}: {} entry runs, first {:?}", runs.len(), runs.first());
        let f = RowFormatId::FlashMlaV4.format();
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
                    "layer {layer} ring position {q}"
                );
            }
        }
        // Nothing outside slot b's pages changed.
        let (s, e) = g.slot_span(pb).unwrap();
        let (s, e) = (s as usize * 584, e as usize * 584);
        assert!(before[..s] == after[..s] && before[e..] == after[e..], "the restore wrote outside its slot");
    }
}
