//! The KV row writer on a device (`v4pool_kv_rows` compiled for the GPU) against the host
//! backend: twin pools with the same fresh random plane bytes, the same window and compressed
//! row writes (fp8 pack and bf16 copy), every byte of every plane compared. Skips with SKIP
//! without a device (fails with V4POOL_REQUIRE_GPU=1).

use crate::common;
use crate::gather_common;

use common::{case_seed, device_or_skip, Rng};
use gather_common::model_pool;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Backend;
use v4pool::geometry::Class;
use v4pool::model::ModelShape;
use v4pool::pool::{CompressedRow, KvRowWriter, Pool, RowSet, RowWriteCapacity, WindowSeq};

fn planes(pool: &Pool) -> Vec<Vec<u8>> {
    (0..pool.num_planes())
        .map(|i| {
            let mut out = vec![0u8; pool.plane_bytes(i).unwrap() as usize];
            pool.read_plane(i, 0, &mut out).unwrap();
            out
        })
        .collect()
}

/// The same random plane bytes on the device pool `d` and the host pool `h`, a writer on each
/// with the same three sequences' window rows staged (a ring wrap, one token, a far position),
/// and their KV: bf16 bits of either sign over a wide range, with infinities, NaNs,
/// subnormals, values near e4m3's top, and zero, negative-zero, all-NaN and saturating tiles.
fn staged_windows(d: &Arc<Pool>, h: &Arc<Pool>, rng: &mut Rng) -> (KvRowWriter, KvRowWriter, Vec<u16>) {
    for i in 0..d.num_planes() {
        let bytes = rng.bytes(d.plane_bytes(i).unwrap() as usize);
        d.write_plane(i, 0, &bytes).unwrap();
        h.write_plane(i, 0, &bytes).unwrap();
    }
    let cap = RowWriteCapacity::new(600);
    let (mut wd, mut wh) = (d.kv_row_writer(cap).unwrap(), h.kv_row_writer(cap).unwrap());
    let sd: Vec<_> = (0..3).map(|_| d.alloc_slot().unwrap()).collect();
    let sh: Vec<_> = (0..3).map(|_| h.alloc_slot().unwrap()).collect();
    let starts = [0i64, 7, 1_000_000];
    let tokens = [300usize, 1, 129];
    let seqs = |s: &[v4pool::pool::SlotLease]| -> Vec<WindowSeq> {
        (0..3).map(|i| WindowSeq::new(s[i].handle, starts[i], tokens[i])).collect()
    };
    wd.stage_window(&seqs(&sd)).unwrap();
    wh.stage_window(&seqs(&sh)).unwrap();
    let n: usize = tokens.iter().sum();
    let mut kv: Vec<u16> = (0..n * 512)
        .map(|_| {
            let sign = if rng.chance(0.5) { 0x8000 } else { 0 };
            sign | match rng.below(100) {
                0..=1 => 0,
                2 => 0x7f80,                                                     // infinity
                3 => 0x7f81 + rng.below(0x7e) as u16, // NaN (the byte keeps its sign)
                4..=5 => 1 + rng.below(0x7e) as u16,  // subnormal
                6..=9 => 0x4300 + rng.below(0x80) as u16, // 128..256: near e4m3's top
                _ => ((90 + rng.below(80) as u16) << 7) | rng.below(128) as u16, // 2^-37 .. 2^42
            }
        })
        .collect();
    kv[64..128].fill(0); // an all-zero tile
    kv[512..576].fill(0x8000); // an all-negative-zero tile
    kv[1024..1088].fill(0x7fc0); // an all-NaN tile (amax 0: scale 0)
    for (i, v) in kv[1536..1600].iter_mut().enumerate() {
        *v = 0x43e0 + (i as u16 % 3); // 448, 452, 456: ties and past the top at scale 1
    }
    (wd, wh, kv)
}

#[test]
fn kv_rows_match_the_host() {
    let Some(dev) = device_or_skip("kv_rows_match_the_host") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    for fp8 in [true, false] {
        let model = ModelShape::v4_flash(1).unwrap();
        let d = model_pool(dev.clone(), &model, fp8, 6, 3);
        let h = model_pool(Arc::new(HostBackend::new()), &model, fp8, 6, 3);
        let mut rng = Rng::new(case_seed("gpu-kv-rows", u64::from(fp8)));
        let (mut wd, mut wh, kv) = staged_windows(&d, &h, &mut rng);
        let g = d.geometry().unwrap();
        for ratio in [0, 4, 128] {
            let layer = g.ratios.iter().position(|&r| r == ratio).unwrap();
            wd.write(layer, RowSet::Window, &kv, 512).unwrap();
            wh.write(layer, RowSet::Window, &kv, 512).unwrap();
        }
        let bd: Vec<_> = (0..2).map(|_| d.alloc_block().unwrap().handle).collect();
        let bh: Vec<_> = (0..2).map(|_| h.alloc_block().unwrap().handle).collect();
        let rows = [5i64, 63, 0];
        let blocks = [1usize, 0, 1];
        let ent = |b: &[v4pool::pool::BlockHandle]| -> Vec<CompressedRow> {
            (0..3).map(|i| CompressedRow { block: b[blocks[i]], row: rows[i] }).collect()
        };
        wd.stage_compressed(Class::Csa, &ent(&bd)).unwrap();
        wh.stage_compressed(Class::Csa, &ent(&bh)).unwrap();
        let csa = g.ratios.iter().position(|&r| r == 4).unwrap();
        wd.write(csa, RowSet::Compressed(Class::Csa), &kv[..3 * 512], 512).unwrap();
        wh.write(csa, RowSet::Compressed(Class::Csa), &kv[..3 * 512], 512).unwrap();
        assert!(planes(&d) == planes(&h), "fp8 {fp8}: device planes differ from the host reference's");
    }
}

/// A pool of `model` in format `kv` as the sizing layout carves it (FlashMLA's V4 rows need its
/// page alignment), with four slots and four blocks.
fn layout_pool(backend: Arc<dyn Backend>, model: &ModelShape, kv: v4pool::sizing::KvDtype) -> Arc<Pool> {
    let layout = v4pool::sizing::PoolLayout::new(model, kv, v4pool::sizing::IndexerDtype::Fp8).unwrap();
    let g = &layout.geometry;
    let (slots, blocks) = (4, 4);
    let rows = blocks * g.envelope_rows + (slots + 1) * (g.slot_rows + g.slot_align_rows.max(1));
    let geometry = layout.carve(blocks, slots, rows).unwrap();
    let spec = v4pool::pool::PoolSpec::from_layout(&layout, geometry).unwrap();
    Arc::new(Pool::new(backend, spec, v4pool::backend::Stream::DEFAULT).unwrap())
}

#[test]
fn flashmla_rows_match_the_host() {
    // FlashMLA's formats (V4-Flash in 584-B paged rows, pages of 64 and of 2; V4.1-Flash in
    // 528-B rows): the device
    // kernel's packs equal the host reference's (the format's description) over every byte of
    // the plane, window rows of every class.
    let Some(dev) = device_or_skip("flashmla_rows_match_the_host") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    for (model, kv) in [
        (ModelShape::v4_flash(1).unwrap(), v4pool::sizing::KvDtype::FlashMlaV4),
        (ModelShape::v4_flash(1).unwrap(), v4pool::sizing::KvDtype::FlashMlaV4P2),
        (ModelShape::v41_flash(0).unwrap(), v4pool::sizing::KvDtype::FlashMlaV41),
        // The packed layout: 528-B windows, 288-B fp4 compressed rows in the compressed view.
        (ModelShape::v41_flash(0).unwrap(), v4pool::sizing::KvDtype::FlashMlaV41Fp4),
    ] {
        let d = layout_pool(dev.clone(), &model, kv);
        let h = layout_pool(Arc::new(HostBackend::new()), &model, kv);
        let mut rng = Rng::new(case_seed("gpu-kv-rows-flashmla", kv.compressed_row_bytes()));
        let (mut wd, mut wh, kv_in) = staged_windows(&d, &h, &mut rng);
        let g = d.geometry().unwrap();
        for class in g.classes.values() {
            let layer = class.layers[0];
            wd.write(layer, RowSet::Window, &kv_in, 512).unwrap();
            wh.write(layer, RowSet::Window, &kv_in, 512).unwrap();
        }
        if g.packed_rows.is_some() {
            // Compressed rows of both V4.1 classes (ratio 1: the fine slot, ratio 2: the coarse
            // one), rows spread over two blocks, the same special values.
            let (bd, bh) = (
                [d.alloc_block().unwrap(), d.alloc_block().unwrap()],
                [h.alloc_block().unwrap(), h.alloc_block().unwrap()],
            );
            for (class, ratio) in [(Class::Csa, 1), (Class::Hca, 2)] {
                let rows = 256 / ratio;
                let ent = |b: &[v4pool::pool::BlockGrant; 2]| -> Vec<CompressedRow> {
                    (0..8)
                        .map(|i| CompressedRow { block: b[i % 2].handle, row: (i as i64 * 37) % rows })
                        .collect()
                };
                wd.stage_compressed(class, &ent(&bd)).unwrap();
                wh.stage_compressed(class, &ent(&bh)).unwrap();
                let layer = g.ratios.iter().position(|&r| r == ratio as i32).unwrap();
                wd.write(layer, RowSet::Compressed(class), &kv_in[..8 * 512], 512).unwrap();
                wh.write(layer, RowSet::Compressed(class), &kv_in[..8 * 512], 512).unwrap();
            }
            assert_eq!(wd.compressed_format_code(), v4pool::raw::index::KV_ROWS_FLASHMLA_V41_FP4);
        }
        assert!(planes(&d) == planes(&h), "{}: device plane differs from the host reference's", kv.name());
    }
}
