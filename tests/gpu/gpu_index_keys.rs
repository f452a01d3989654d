//! The indexer key writer on a device (`v4pool_index_keys` compiled for the GPU) against the
//! host backend, in every indexer format (bf16, FP8, FP4, ATOM's FP8 in OCP e4m3 and e4m3fnuz): twin pools with the same fresh
//! random indexer bytes, the same key writes (wide-range random keys, an all-zero row, huge
//! and tiny rows, infinities and NaN), every byte of every indexer pool compared. Skips with
//! SKIP without a device (fails with V4POOL_REQUIRE_GPU=1).

use crate::common;
use crate::gather_common;

use common::{case_seed, device_or_skip, Rng};
use gather_common::model_pool_with;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Backend;
use v4pool::geometry::Class;
use v4pool::model::ModelShape;
use v4pool::pool::{CompressedRow, Pool, RowWriteCapacity};
use v4pool::sizing::IndexerDtype;

fn parts(ix: IndexerDtype) -> usize {
    if ix == IndexerDtype::Fp4 {
        2
    } else {
        1
    }
}

/// Every indexer pool of `pool`, whole (or, with `fill`, overwritten by it first).
fn pools(pool: &Pool, ix: IndexerDtype, fill: Option<&[Vec<u8>]>) -> Vec<Vec<u8>> {
    (0..parts(ix))
        .map(|p| {
            let v = pool.indexer_view(0, p).unwrap();
            let n = pool.spec().csa_layers.len() as u64 * v.blocks * v.rows_per_block * v.row_bytes;
            if let Some(f) = fill {
                assert_eq!(f[p].len() as u64, n);
                // SAFETY: the pool's indexer pool `p`, `n` bytes from CSA layer 0's base.
                unsafe { pool.backend().upload(v.ptr, &f[p], pool.stream()) }.unwrap();
            }
            let mut out = vec![0u8; n as usize];
            // SAFETY: as above.
            unsafe { pool.backend().download(&mut out, v.ptr, pool.stream()) }.unwrap();
            pool.backend().synchronize(pool.stream()).unwrap();
            out
        })
        .collect()
}

#[test]
fn index_keys_match_the_host() {
    let Some(dev) = device_or_skip("index_keys_match_the_host") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    let model = ModelShape::v4_flash(1).unwrap();
    // Every indexer dtype: ATOM's preshuffled OCP e4m3 and e4m3fnuz caches (formats 3, 4) too.
    for (n, ix) in IndexerDtype::ALL.into_iter().enumerate() {
        let d = model_pool_with(dev.clone(), &model, true, 6, 3, Some(ix));
        let h = model_pool_with(Arc::new(HostBackend::new()), &model, true, 6, 3, Some(ix));
        let mut rng = Rng::new(case_seed("gpu-index-keys", n as u64));
        let fresh: Vec<Vec<u8>> = pools(&h, ix, None).iter().map(|p| rng.bytes(p.len())).collect();
        assert!(pools(&d, ix, Some(&fresh)) == pools(&h, ix, Some(&fresh)));
        let cap = RowWriteCapacity::new(256);
        let (mut wd, mut wh) = (d.kv_row_writer(cap).unwrap(), h.kv_row_writer(cap).unwrap());
        let bd: Vec<_> = (0..3).map(|_| d.alloc_block().unwrap().handle).collect();
        let bh: Vec<_> = (0..3).map(|_| h.alloc_block().unwrap().handle).collect();
        // 150 distinct entries over three blocks, in random order.
        let picks = rng.distinct(150, 3 * 64);
        let ent = |b: &[v4pool::pool::BlockHandle]| -> Vec<CompressedRow> {
            picks.iter().map(|&e| CompressedRow { block: b[(e / 64) as usize], row: e % 64 }).collect()
        };
        let stride = 160;
        let mut keys: Vec<u16> = (0..149 * stride + 128)
            .map(|_| {
                let e = 90 + rng.below(70) as u16; // 2^-37 .. 2^32
                (e << 7) | (rng.below(128) as u16) | if rng.chance(0.5) { 0x8000 } else { 0 }
            })
            .collect();
        keys[..128].fill(0); // an all-zero row
        keys[stride..stride + 128].fill(0x7e00); // huge (~1.7e38)
        keys[2 * stride..2 * stride + 128].fill(0x0080); // tiny (2^-126)
        keys[3 * stride + 7] = 0x7f80; // +inf
        keys[4 * stride + 9] = 0xff80; // -inf
        keys[5 * stride + 33] = 0x7fc1; // NaN
        keys[6 * stride + 40] = 0xffc3; // negative NaN (its byte keeps the sign on every backend)
        keys[7 * stride..7 * stride + 128].fill(0x8001); // negative subnormals
        keys[8 * stride..8 * stride + 128].fill(0x8000); // -0.0 (0x00 in e4m3fnuz)
        keys[9 * stride] = 0x4380; // 256: past e4m3fnuz's 240 beside tiny negatives
        keys[9 * stride + 1..9 * stride + 128].fill(0xb3d6); // -1e-7
        wd.stage_compressed(Class::Csa, &ent(&bd)).unwrap();
        wh.stage_compressed(Class::Csa, &ent(&bh)).unwrap();
        for rank in [0, 2] {
            wd.write_index_keys(rank, &keys, stride).unwrap();
            wh.write_index_keys(rank, &keys, stride).unwrap();
        }
        let (pd, ph) = (pools(&d, ix, None), pools(&h, ix, None));
        assert!(ph != fresh, "{ix:?}: nothing written");
        assert!(pd == ph, "{ix:?}: device indexer cache differs from the host reference's");
        println!("{ix:?}: 2 layers x 150 keys, device == host reference byte for byte");
    }
}
