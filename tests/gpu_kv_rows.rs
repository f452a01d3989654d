//! The KV row writer on a device (`v4pool_kv_rows` compiled for the GPU) against the host
//! backend: twin pools with the same fresh random plane bytes, the same window and compressed
//! row writes (fp8 pack and bf16 copy), every byte of every plane compared. Skips with SKIP
//! without a device (fails with V4POOL_REQUIRE_GPU=1).

mod common;
mod gather_common;

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
/// and their KV: bf16 bits over a wide range with a zero tile.
fn staged_windows(d: &Arc<Pool>, h: &Arc<Pool>, rng: &mut Rng) -> (KvRowWriter, KvRowWriter, Vec<u16>) {
    for i in 0..d.num_planes() {
        let bytes = rng.bytes(d.plane_bytes(i).unwrap() as usize);
        d.write_plane(i, 0, &bytes).unwrap();
        h.write_plane(i, 0, &bytes).unwrap();
    }
    let cap = RowWriteCapacity { max_tokens: 600 };
    let (mut wd, mut wh) = (d.kv_row_writer(cap).unwrap(), h.kv_row_writer(cap).unwrap());
    let sd: Vec<_> = (0..3).map(|_| d.alloc_slot().unwrap()).collect();
    let sh: Vec<_> = (0..3).map(|_| h.alloc_slot().unwrap()).collect();
    let starts = [0i64, 7, 1_000_000];
    let tokens = [300usize, 1, 129];
    let seqs = |s: &[v4pool::pool::SlotLease]| -> Vec<WindowSeq> {
        (0..3)
            .map(|i| WindowSeq { slot: s[i].handle, first_position: starts[i], tokens: tokens[i] })
            .collect()
    };
    wd.stage_window(&seqs(&sd)).unwrap();
    wh.stage_window(&seqs(&sh)).unwrap();
    let n: usize = tokens.iter().sum();
    let mut kv: Vec<u16> = (0..n * 512).map(|_| (rng.next_u64() as u16) & 0x7f7f).collect();
    kv[64..128].fill(0);
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
        let ent = |b: &[v4pool::alloc::BlockHandle]| -> Vec<CompressedRow> {
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

#[test]
fn flashmla_v41_rows_match_the_host() {
    // V4.1-Flash in FlashMLA's 528-B rows: the device kernel's packs equal the host reference's
    // (the format's description) over every byte of the plane, window and compressed rows.
    let Some(dev) = device_or_skip("flashmla_v41_rows_match_the_host") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    let model = ModelShape::v41_flash(0).unwrap();
    let w = v4pool::sizing::KvDtype::FlashMlaV41.plane_widths().to_vec();
    let d = gather_common::model_pool_at(dev.clone(), &model, w.clone(), 6, 3, None);
    let h = gather_common::model_pool_at(Arc::new(HostBackend::new()), &model, w, 6, 3, None);
    let mut rng = Rng::new(case_seed("gpu-kv-rows-v41", 0));
    let (wd, wh, kv) = staged_windows(&d, &h, &mut rng);
    let g = d.geometry().unwrap();
    for class in g.classes.values() {
        let layer = class.layers[0];
        wd.write(layer, RowSet::Window, &kv, 512).unwrap();
        wh.write(layer, RowSet::Window, &kv, 512).unwrap();
    }
    assert!(planes(&d) == planes(&h), "flashmla-v41: device plane differs from the host reference's");
}
