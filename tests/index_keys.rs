//! The indexer key writer (`v4pool_index_keys`) in every indexer format (bf16, FP8, FP4): the
//! kernel source itself (the C++ emulation) against the host reference on fresh random keys
//! with poisoned caches; the reference against an independent decode of the spec's row
//! formats (FP8 `[64 × 128 e4m3][64 × f32]`, FP4 `[4][64][16]` e2m1 + `[4][64]` e8m0), edge
//! rows included (all zero, huge, tiny, infinities, NaN); and the pool's writer
//! (`KvRowWriter::write_index_keys`) on the host backend: keys land at their entries, every
//! other byte of every indexer pool is unchanged, and stale blocks, rows outside a block,
//! short or narrow key buffers, foreign ranks and pools without an indexer are refused typed,
//! before anything is written.
//!
//! NaN / infinity policy (docs/forward.md, "Indexer keys"): a row's or group's amax ignores
//! NaN and counts infinities; an infinity saturates (448, 6); NaN is e4m3's NaN in FP8 and 6
//! with its sign in FP4.

mod common;
mod gather_common;

use common::{case_seed, Rng};
use gather_common::model_pool_with;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::geometry::Class;
use v4pool::index::host::{index_keys, key_block_bytes, pack_fp4_key, pack_fp8_key, KeyCache};
use v4pool::index::{IndexKeysArgs, Launch, INDEX_KEYS_BF16, INDEX_KEYS_FP4, INDEX_KEYS_FP8};
use v4pool::model::ModelShape;
use v4pool::pool::{CompressedRow, Pool, RowWriteCapacity, RowWriteError};
use v4pool::sizing::IndexerDtype;

/// bf16 bits of `f` (truncated: any bf16 is a valid input).
fn bf16(f: f32) -> u16 {
    (f.to_bits() >> 16) as u16
}

/// Random key rows: values over a wide range of magnitudes (2^-30 .. 2^40) and signs, row by
/// row at random scales, with whole zero rows and zero groups, and the odd zero, subnormal,
/// infinity or NaN — never all zeros.
fn keys(rng: &mut Rng, rows: usize, stride: usize) -> Vec<u16> {
    let mut v = vec![0u16; (rows - 1) * stride + 128];
    for r in 0..rows {
        let base = 100 + rng.below(50) as u16; // the row's magnitude, 2^-27 .. 2^22
        for i in 0..128 {
            v[r * stride + i] = match rng.below(200) {
                0..=2 => 0,
                3 => 0x8000,
                4 => rng.below(0x7f) as u16,
                5 => 0x7f80 | if rng.chance(0.5) { 0x8000 } else { 0 },
                6 => 0x7fc1,
                _ => {
                    let e = base + rng.below(12) as u16;
                    (e << 7) | (rng.below(128) as u16) | if rng.chance(0.5) { 0x8000 } else { 0 }
                }
            };
        }
        if r > 0 && rng.chance(0.08) {
            v[r * stride..r * stride + 128].fill(0);
        }
        if rng.chance(0.1) {
            let g = rng.below(4) as usize;
            v[r * stride + 32 * g..r * stride + 32 * g + 32].fill(0);
        }
    }
    assert!(v.iter().any(|&x| x != 0));
    v
}

const FORMATS: [i32; 3] = [INDEX_KEYS_BF16, INDEX_KEYS_FP8, INDEX_KEYS_FP4];

#[test]
fn the_kernel_source_matches_the_host_reference() {
    let Some(lib) = common::emulation_library() else {
        return;
    };
    // SAFETY: the symbol has this signature (kernels/v4pool_emulation.cpp).
    let emu = unsafe { *lib.get::<common::EmuLaunch>(b"v4pool_emu_launch_index_keys\0").expect("symbol") };
    for case in 0..30u64 {
        let mut rng = Rng::new(case_seed("index-keys-emulated", case));
        let format = FORMATS[case as usize % 3];
        let t = 1 + rng.below(40) as usize;
        // Odd strides too: unaligned rows take the element amax, aligned ones the vectors.
        let stride = 128 + rng.below(9) as usize;
        let (num_blocks, rows) = (3i64, 64usize);
        let k = keys(&mut rng, t, stride);
        let entries = num_blocks * rows as i64;
        // Distinct entries (two keys to one entry would race on a device), a few outside.
        let mut dest: Vec<i32> = rng.distinct(t, entries as u64).into_iter().map(|e| e as i32).collect();
        for d in dest.iter_mut() {
            if rng.chance(0.1) {
                *d = if rng.chance(0.5) {
                    -1 - rng.below(3) as i32
                } else {
                    entries as i32 + rng.below(3) as i32
                };
            }
        }
        let (block, scale) = key_block_bytes(format, rows).unwrap();
        let run = |reference: bool| -> (Vec<u8>, Vec<u8>) {
            let mut data = vec![0xa5u8; num_blocks as usize * block];
            let mut scales = vec![0x5au8; (num_blocks as usize * scale).max(1)];
            let args = IndexKeysArgs {
                keys: k.as_ptr() as u64,
                dest: dest.as_ptr() as u64,
                data: data.as_mut_ptr() as u64,
                scales: if format == INDEX_KEYS_FP4 { scales.as_mut_ptr() as u64 } else { 0 },
                key_row_stride: stride as i64,
                num_blocks,
                num_tokens: t as i32,
                block_rows: rows as i32,
                format,
                _pad: 0,
            };
            let launch = Launch::IndexKeys(args);
            // SAFETY: every pointer is a live buffer of the sizes the arguments name; `emu` is
            // this kernel's entry.
            unsafe { common::run_reference_or_emulated(&launch, emu, reference) };
            (data, scales)
        };
        let host = run(true);
        let dev = run(false);
        assert!(host == dev, "case {case} (format {format}): kernel and host reference differ");
        // Untouched: entries no key targets keep the poison in every region; targeted ones not.
        let hit: Vec<bool> = (0..entries).map(|e| dest.contains(&(e as i32))).collect();
        for (e, &h) in hit.iter().enumerate() {
            let (b, r) = (e / rows, e % rows);
            let mut spans: Vec<(&[u8], u8)> = Vec::new();
            match format {
                INDEX_KEYS_BF16 => spans.push((&host.0[e * 256..e * 256 + 256], 0xa5)),
                INDEX_KEYS_FP8 => {
                    spans.push((&host.0[b * block + r * 128..b * block + r * 128 + 128], 0xa5));
                    let s = b * block + rows * 128 + r * 4;
                    spans.push((&host.0[s..s + 4], 0xa5));
                }
                _ => {
                    for g in 0..4 {
                        let d = b * block + (g * rows + r) * 16;
                        spans.push((&host.0[d..d + 16], 0xa5));
                        let s = b * scale + g * rows + r;
                        spans.push((&host.1[s..s + 1], 0x5a));
                    }
                }
            }
            if !h {
                assert!(
                    spans.iter().all(|(s, p)| s.iter().all(|b| b == p)),
                    "case {case}: entry {e} changed"
                );
            } else {
                // The scale of a written FP8 row is never the poison (a power of two); a written
                // span as a whole differs from the poison.
                assert!(
                    spans.iter().any(|(s, p)| s.iter().any(|b| b != p)),
                    "case {case}: entry {e} unwritten"
                );
            }
        }
    }
}

/// The value of an e4m3fn byte (finite), decoded by its fields.
fn e4m3_value(b: u8) -> f64 {
    let (e, m) = (i32::from((b >> 3) & 0xf), f64::from(b & 7));
    let v = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The value of an e2m1 nibble.
fn e2m1_value(c: u8) -> f64 {
    let v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][usize::from(c & 7)];
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}

fn finite(v: u16) -> Option<f64> {
    let f = f32::from_bits(u32::from(v) << 16);
    f.is_finite().then_some(f64::from(f))
}

#[test]
fn fp8_rows_are_the_spec_format_and_dequantise_within_half_a_step() {
    let mut rng = Rng::new(case_seed("index-keys-fp8-format", 0));
    let mut rows: Vec<Vec<u16>> = (0..40).map(|_| keys(&mut rng, 1, 128)).collect();
    rows.push(vec![0; 128]); // all zero: scale 2^-22, values 0
    rows.push((0..128).map(|i| bf16(1e30 * (i as f32 - 64.0))).collect()); // huge
    rows.push((0..128).map(|i| bf16(1e-30 * (i as f32 + 1.0))).collect()); // tiny
    rows.push((0..128).map(|i| bf16(if i == 3 { f32::INFINITY } else { 1.0 })).collect());
    rows.push((0..128).map(|i| bf16(if i == 5 { f32::NAN } else { -2.5 })).collect());
    for (n, key) in rows.iter().enumerate() {
        let mut data = vec![0u8; 128];
        let scale = f64::from(f32::from_bits(pack_fp8_key(key, &mut data).unwrap()));
        let amax = key.iter().filter_map(|&v| finite(v)).map(f64::abs).fold(0.0, f64::max);
        let has_inf = key.iter().any(|&v| f32::from_bits(u32::from(v) << 16).is_infinite());
        // The scale: the least power of two with max(amax, 1e-4) / scale <= 448.
        assert_eq!(scale.log2().fract(), 0.0, "row {n}: scale {scale} is a power of two");
        if !has_inf {
            let m = amax.max(f64::from(1e-4f32));
            assert!(
                m / scale <= 448.0 && m / (scale / 2.0) > 448.0,
                "row {n}: scale {scale} for amax {amax}"
            );
        }
        for (i, (&q, &v)) in data.iter().zip(key).enumerate() {
            let x = f32::from_bits(u32::from(v) << 16);
            if x.is_nan() {
                assert_eq!(q & 0x7f, 0x7f, "row {n} value {i}: NaN is e4m3's NaN");
                continue;
            }
            if x.is_infinite() {
                assert_eq!(q & 0x7f, 0x7e, "row {n} value {i}: an infinity saturates to 448");
                continue;
            }
            let got = e4m3_value(q) * scale;
            // Half an e4m3 step: 2^-4 of the value when normal, 2^-10 x scale below.
            let step = (f64::from(x).abs() / 16.0).max(scale / 1024.0);
            assert!((got - f64::from(x)).abs() <= step, "row {n} value {i}: {x} -> {got}");
        }
    }
    assert_eq!(pack_fp8_key(&[0; 128], &mut [0u8; 128]).unwrap(), (-22f32).exp2().to_bits());
}

#[test]
fn fp4_rows_are_the_spec_format_and_dequantise_within_half_a_step() {
    let mut rng = Rng::new(case_seed("index-keys-fp4-format", 0));
    let mut rows: Vec<Vec<u16>> = (0..40).map(|_| keys(&mut rng, 1, 128)).collect();
    rows.push(vec![0; 128]);
    rows.push((0..128).map(|i| bf16(1e30 * (i as f32 - 64.0))).collect());
    rows.push((0..128).map(|i| bf16(1e-30 * (i as f32 + 1.0))).collect());
    rows.push((0..128).map(|i| bf16(if i == 40 { f32::NEG_INFINITY } else { 1.0 })).collect());
    rows.push((0..128).map(|i| bf16(if i == 70 { f32::NAN } else { 0.3 })).collect());
    for (n, key) in rows.iter().enumerate() {
        let (mut data, mut scales) = ([[0u8; 16]; 4], [0u8; 4]);
        pack_fp4_key(key, &mut data, &mut scales).unwrap();
        for g in 0..4 {
            let x = &key[32 * g..32 * g + 32];
            let amax = x.iter().filter_map(|&v| finite(v)).map(f64::abs).fold(0.0, f64::max);
            let inf = x.iter().any(|&v| f32::from_bits(u32::from(v) << 16).is_infinite());
            let b = scales[g];
            if amax == 0.0 && !inf {
                assert_eq!(b, 0, "row {n} group {g}: an all-zero group has scale byte 0");
            }
            let scale = 2f64.powi(i32::from(b) - 127);
            if !inf && amax > 0.0 {
                assert!(amax / scale <= 6.0, "row {n} group {g}: byte {b} for amax {amax}");
                assert!(b == 1 || amax / (scale / 2.0) > 6.0, "row {n} group {g}: byte {b} not the least");
            }
            for j in 0..32 {
                // Value 2k in the low nibble of byte k, 2k + 1 in the high nibble.
                let code = (data[g][j / 2] >> (4 * (j % 2))) & 0xf;
                let v = f32::from_bits(u32::from(x[j]) << 16);
                if !v.is_finite() {
                    assert_eq!(code & 7, 7, "row {n} group {g} value {j}: {v} saturates to 6");
                    continue;
                }
                if b == 0 {
                    assert_eq!(code & 7, 0);
                    continue;
                }
                let got = e2m1_value(code) * scale;
                // Half an e2m1 step: at most 1 (between 4 and 6) x scale, 0.25 x scale below 2.
                let half = if (f64::from(v) / scale).abs() < 2.0 { 0.25 } else { 1.0 };
                assert!(
                    (got - f64::from(v)).abs() <= half * scale,
                    "row {n} group {g} value {j}: {v} -> {got}"
                );
            }
        }
    }
}

/// Every indexer pool of a host pool, whole: `[part][bytes]`.
fn indexer_pools(pool: &Pool) -> Vec<Vec<u8>> {
    let parts = match pool.spec().indexer {
        Some(IndexerDtype::Fp4) => 2,
        _ => 1,
    };
    (0..parts)
        .map(|p| {
            let v = pool.indexer_view(0, p).unwrap();
            let n = pool.spec().csa_layers.len() as u64 * v.blocks * v.rows_per_block * v.row_bytes;
            let mut out = vec![0u8; n as usize];
            // SAFETY: the pool's indexer pool `p`, `n` bytes from CSA layer 0's base (host backend).
            unsafe { pool.backend().download(&mut out, v.ptr, pool.stream()) }.unwrap();
            out
        })
        .collect()
}

#[test]
fn the_writer_puts_keys_at_their_entries_in_every_format_and_nothing_else_changes() {
    let model = ModelShape::v4_flash(0).unwrap();
    for (n, ix) in [IndexerDtype::Bf16, IndexerDtype::Fp8, IndexerDtype::Fp4].into_iter().enumerate() {
        let pool = model_pool_with(Arc::new(HostBackend::new()), &model, n % 2 == 0, 6, 3, Some(ix));
        let mut rng = Rng::new(case_seed("index-keys-writer-formats", n as u64));
        // Poison every indexer pool with fresh random bytes.
        for (p, bytes) in indexer_pools(&pool).iter().enumerate() {
            let fresh = rng.bytes(bytes.len());
            let v = pool.indexer_view(0, p).unwrap();
            // SAFETY: as in `indexer_pools`.
            unsafe { pool.backend().upload(v.ptr, &fresh, pool.stream()) }.unwrap();
        }
        let before = indexer_pools(&pool);
        let mut w = pool.kv_row_writer(RowWriteCapacity { max_tokens: 16 }).unwrap();
        let b0 = pool.alloc_block().unwrap().handle;
        let b1 = pool.alloc_block().unwrap().handle;
        let entries = [
            CompressedRow { block: b1, row: 5 },
            CompressedRow { block: b1, row: 6 },
            CompressedRow { block: b0, row: 63 },
            CompressedRow { block: b0, row: 0 },
        ];
        w.stage_compressed(Class::Csa, &entries).unwrap();
        let stride = 136;
        let mut k = keys(&mut rng, entries.len(), stride);
        k[3 * stride..3 * stride + 128].fill(0); // an all-zero key row
        let rank = 1;
        w.write_index_keys(rank, &k, stride).unwrap();
        // Expected: the poisoned pools with the reference's encoding of the keys in layer `rank`.
        let mut expect = before.clone();
        let v = pool.indexer_view(rank, 0).unwrap();
        let dest: Vec<i32> =
            entries.iter().map(|e| (e.block.id as u64 * v.rows_per_block) as i32 + e.row as i32).collect();
        let layer = |p: usize| {
            let base = pool.indexer_view(0, p).unwrap().ptr;
            let at = (pool.indexer_view(rank, p).unwrap().ptr - base) as usize;
            let len = key_block_bytes(fmt(ix), 64).map(|(d, s)| if p == 0 { d } else { s }).unwrap();
            at..at + len * v.blocks as usize
        };
        let (r0, r1) = (layer(0), if ix == IndexerDtype::Fp4 { layer(1) } else { 0..0 });
        {
            let (d, rest) = expect.split_at_mut(1);
            let data = &mut d[0][r0];
            let mut cache = match ix {
                IndexerDtype::Bf16 => KeyCache::Bf16 { data },
                IndexerDtype::Fp8 => KeyCache::Fp8 { data },
                IndexerDtype::Fp4 => KeyCache::Fp4 { data, scales: &mut rest[0][r1] },
            };
            index_keys(&k, stride, &dest, &mut cache, v.blocks as i64, 64, dest.len() as i32).unwrap();
        }
        let after = indexer_pools(&pool);
        assert!(after == expect, "{ix:?}: keys off their entries, or other bytes changed");
        assert!(after != before, "{ix:?}: nothing written");
        // Refusals, nothing written: a short buffer, a narrow stride, a rank past the CSA
        // layers, a row outside a block (refused when staged), HCA entries staged, a freed block.
        assert!(matches!(w.write_index_keys(rank, &k[..300], stride), Err(RowWriteError::KvShape { .. })));
        assert!(matches!(w.write_index_keys(rank, &k, 64), Err(RowWriteError::KvShape { .. })));
        let ranks = pool.spec().csa_layers.len();
        assert!(matches!(w.write_index_keys(ranks, &k, stride), Err(RowWriteError::Pool(_))));
        pool.free_block(b0).unwrap();
        assert!(matches!(
            w.write_index_keys(rank, &k, stride),
            Err(RowWriteError::BadEntry { entry: 2, .. })
        ));
        assert!(matches!(
            w.stage_compressed(Class::Csa, &[CompressedRow { block: b1, row: 64 }]),
            Err(RowWriteError::BadEntry { entry: 0, .. })
        ));
        w.stage_compressed(Class::Hca, &[CompressedRow { block: b1, row: 0 }]).unwrap();
        assert!(matches!(w.write_index_keys(rank, &k, stride), Err(RowWriteError::NothingStaged { .. })));
        assert!(indexer_pools(&pool) == expect, "{ix:?}: a refused write changed the indexer cache");
    }
    // A pool without an indexer cache.
    let none = model_pool_with(Arc::new(HostBackend::new()), &model, true, 6, 3, None);
    let w = none.kv_row_writer(RowWriteCapacity { max_tokens: 4 }).unwrap();
    let mut w = w;
    let b = none.alloc_block().unwrap().handle;
    w.stage_compressed(Class::Csa, &[CompressedRow { block: b, row: 0 }]).unwrap();
    assert!(matches!(
        w.write_index_keys(0, &[0x3f80; 128], 128),
        Err(RowWriteError::IndexerFormat { format: "none" })
    ));
}

fn fmt(ix: IndexerDtype) -> i32 {
    match ix {
        IndexerDtype::Bf16 => INDEX_KEYS_BF16,
        IndexerDtype::Fp8 => INDEX_KEYS_FP8,
        IndexerDtype::Fp4 => INDEX_KEYS_FP4,
    }
}
