//! The KV row writer (`v4pool_kv_rows`): the kernel source itself (the C++ emulation) against
//! the host reference on fresh random inputs with poisoned outputs, and the pool-level writer
//! (`Pool::kv_row_writer`) on the host backend: rows land where the geometry says, bytes as
//! `pack_fp8_row` makes them, nothing else of the planes changes, stale leases and blocks are
//! refused before any launch.

use crate::common;
use crate::flashmla_common;
use crate::gather_common;

use common::{case_seed, Rng};
use gather_common::{model_pool, model_pool_with};
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::geometry::Class;
use v4pool::model::ModelShape;
use v4pool::pool::{CompressedRow, RowSet, RowWriteCapacity, RowWriteError, WindowSeq};
use v4pool::raw::index::host::{kv_rows, pack_fp8_row, KvPlanes};
use v4pool::raw::index::{
    KvRowsArgs, Launch, KV_ROWS_ATOM_FP8, KV_ROWS_BF16, KV_ROWS_FLASHMLA_V41, KV_ROWS_FLASHMLA_V41_FP4,
};
use v4pool::sizing::IndexerDtype;

/// Random bf16 bits: mostly normal values over a wide range, some zeros, negative zeros,
/// subnormals, infinities and NaNs of either sign now and then, and whole zero tiles.
fn bf16_values(rng: &mut Rng, n: usize) -> Vec<u16> {
    let mut v: Vec<u16> = (0..n)
        .map(|_| match rng.below(100) {
            0..=2 => 0,
            3 => 0x8000,
            4..=5 => (rng.below(0x7f) as u16) | if rng.chance(0.5) { 0x8000 } else { 0 },
            6 => 0x7f80 | if rng.chance(0.5) { 0x8000 } else { 0 },
            // NaN of either sign (its byte keeps the input's sign on every backend)
            7 => (0x7f81 + rng.below(0x7e) as u16) | if rng.chance(0.5) { 0x8000 } else { 0 },
            _ => {
                let e = 100 + rng.below(60) as u16; // 2^-27 .. 2^32
                (e << 7) | (rng.below(128) as u16) | if rng.chance(0.5) { 0x8000 } else { 0 }
            }
        })
        .collect();
    for t in 0..n / 64 {
        if rng.chance(0.05) {
            v[t * 64..t * 64 + 64].fill(0);
        }
    }
    v
}

#[test]
fn the_kernel_source_matches_the_host_reference() {
    let Some((_lib, emu)) = common::emulation_entry("kv_rows") else {
        return;
    };
    for case in 0..48u64 {
        let mut rng = Rng::new(case_seed("kv-rows-emulated", case));
        // Every unpaged format the kernel writes: ATOM's fp8, bf16, FlashMLA's V4.1 528-B rows
        // and its 288-B fp4 rows (a packed pool's compressed rows).
        let format = [KV_ROWS_ATOM_FP8, KV_ROWS_BF16, KV_ROWS_FLASHMLA_V41, KV_ROWS_FLASHMLA_V41_FP4]
            [case as usize % 4];
        let fp8 = format == KV_ROWS_ATOM_FP8;
        let t = 1 + rng.below(40) as usize;
        // Odd strides too: unaligned rows take the kernel's element path, aligned ones its
        // 16-byte path.
        let stride = 512 + rng.below(9) as usize;
        let view_rows = 64i64;
        let kv = bf16_values(&mut rng, (t - 1) * stride + 512);
        let dest: Vec<i32> = (0..t).map(|_| rng.range(-3, view_rows + 3) as i32).collect();
        let bids: Vec<i32> = (0..t).map(|_| if rng.chance(0.2) { -1 } else { rng.below(4) as i32 }).collect();
        let with_bids = rng.chance(0.5);
        let (w0, w1) = match format {
            KV_ROWS_ATOM_FP8 => (512usize, 128usize),
            KV_ROWS_FLASHMLA_V41 => (528, 0),
            KV_ROWS_FLASHMLA_V41_FP4 => (288, 0),
            _ => (1024, 0),
        };
        let poison = |w: usize| vec![0xa5u8; view_rows as usize * w];
        let run = |reference: bool| -> (Vec<u8>, Vec<u8>) {
            let (mut p0, mut p1) = (poison(w0), poison(w1.max(1)));
            let args = KvRowsArgs::default()
                .with_kv(kv.as_ptr() as u64)
                .with_dest_rows(dest.as_ptr() as u64)
                .with_batch_id_per_token(if with_bids { bids.as_ptr() as u64 } else { 0 })
                .with_nope(p0.as_mut_ptr() as u64)
                .with_rope(if fp8 { p1.as_mut_ptr() as u64 } else { 0 })
                .with_kv_row_stride(stride as i64)
                .with_view_rows(view_rows)
                .with_num_tokens(t as i32)
                .with_format(format)
                .with_view_row0(0);
            let launch = Launch::KvRows(args);
            // SAFETY: every pointer is a live buffer of the sizes the arguments name; `emu` is
            // this kernel's entry.
            unsafe { common::run_reference_or_emulated(&launch, emu, reference) };
            (p0, p1)
        };
        let host = common::reference_equals_emulated(run, format_args!("case {case} (format {format})"));
        if format == KV_ROWS_FLASHMLA_V41 || format == KV_ROWS_FLASHMLA_V41_FP4 {
            // The host reference is the format's one description, row for row.
            let f = if format == KV_ROWS_FLASHMLA_V41 {
                v4pool::format::RowFormatId::FlashMlaV41.format()
            } else {
                v4pool::format::RowFormatId::FlashMlaV41Fp4.format()
            };
            for i in 0..t {
                let r = dest[i];
                let last = (0..t).rev().find(|&j| dest[j] == r && (!with_bids || bids[j] >= 0));
                if (0..view_rows as i32).contains(&r) && last == Some(i) {
                    let want = f.pack(&kv[i * stride..i * stride + 512]).unwrap();
                    assert_eq!(
                        &host.0[r as usize * w0..(r as usize + 1) * w0],
                        &want[0][..],
                        "case {case} row {r}"
                    );
                }
            }
        }
        // Untouched: rows no live token targets keep the poison; targeted rows do not.
        let mut hit = vec![false; view_rows as usize];
        for i in 0..t {
            if (!with_bids || bids[i] >= 0) && (0..view_rows).contains(&i64::from(dest[i])) {
                hit[dest[i] as usize] = true;
            }
        }
        for (r, &h) in hit.iter().enumerate() {
            let row = &host.0[r * w0..(r + 1) * w0];
            assert_eq!(row.iter().all(|&b| b == 0xa5), !h, "case {case} row {r}");
        }
    }
}

/// FlashMLA's fp4 rows at the values a scale per 16 makes hard: NaN groups (all NaN, and one
/// NaN among finite values), infinities (the e4m3 scale saturates at 448, the values at 6),
/// magnitudes past 6 × 448, groups whose amax / 6 is below e4m3's smallest subnormal (a zero
/// scale: every value 0 with its sign), subnormal bf16, zero and negative zero, ties of e2m1's
/// rounding; the kernel source against the host reference, on the element and 16-byte paths.
#[test]
fn the_kernel_source_packs_fp4_special_groups_as_the_host_reference() {
    let Some((_lib, emu)) = common::emulation_entry("kv_rows") else {
        return;
    };
    let b = |x: f32| (x.to_bits() >> 16) as u16;
    let groups: Vec<[u16; 16]> = vec![
        [0x7fc0; 16],
        {
            let mut g = [b(1.5); 16];
            g[3] = 0xffc1;
            g[9] = b(-2.25);
            g
        },
        {
            let mut g = [b(0.75); 16];
            g[0] = 0x7f80;
            g[5] = 0xff80;
            g
        },
        [
            b(1e30),
            b(-3e4),
            b(2700.0),
            b(-2689.0),
            b(1.0),
            b(6.0),
            b(5.0),
            b(-7.0),
            0,
            0x8000,
            b(3.5),
            b(2.5),
            b(1.25),
            b(0.25),
            b(0.75),
            b(1.75),
        ],
        [b(1e-3); 16],
        {
            let mut g = [b(-1e-38); 16]; // amax / 6 far below e4m3's 2^-9: a zero scale
            g[1] = 0x8001;
            g[2] = 0x0000;
            g
        },
        [0; 16],
        [0x8000; 16],
        {
            let mut g = [0u16; 16];
            for (i, v) in g.iter_mut().enumerate() {
                *v = b((i as f32 - 8.0) * 0.375); // e2m1 ties after scaling
            }
            g
        },
    ];
    let f = v4pool::format::RowFormatId::FlashMlaV41Fp4.format();
    for stride in [512usize, 517] {
        // Two rows: the groups in order, then reversed, padded with the first group.
        let mut kv = vec![0u16; stride + 512];
        for (t, row) in [0usize, 1].into_iter().zip([false, true]) {
            for g in 0..32 {
                let src = if row { &groups[(31 - g) % groups.len()] } else { &groups[g % groups.len()] };
                kv[t * stride + 16 * g..t * stride + 16 * g + 16].copy_from_slice(src);
            }
        }
        let dest = [1i32, 0];
        let run = |reference: bool| -> Vec<u8> {
            let mut p = vec![0xa5u8; 3 * 288];
            let args = KvRowsArgs::default()
                .with_kv(kv.as_ptr() as u64)
                .with_dest_rows(dest.as_ptr() as u64)
                .with_batch_id_per_token(0)
                .with_nope(p.as_mut_ptr() as u64)
                .with_rope(0)
                .with_kv_row_stride(stride as i64)
                .with_view_rows(3)
                .with_num_tokens(2)
                .with_format(KV_ROWS_FLASHMLA_V41_FP4)
                .with_view_row0(0);
            // SAFETY: every pointer is a live buffer of the sizes the arguments name.
            unsafe { common::run_reference_or_emulated(&Launch::KvRows(args), emu, reference) };
            p
        };
        let host = common::reference_equals_emulated(run, format_args!("stride {stride}"));
        for (t, &r) in dest.iter().enumerate() {
            let want = f.pack(&kv[t * stride..t * stride + 512]).unwrap();
            assert_eq!(
                &host[r as usize * 288..(r as usize + 1) * 288],
                &want[0][..],
                "stride {stride} row {r}"
            );
        }
        assert!(host[576..].iter().all(|&x| x == 0xa5), "row 2 was not a destination");
        // The hard groups as the format text reads them: an all-NaN group's scale is 0 (amax
        // ignores NaN) and its nibbles are e2m1's 6 with the input's sign; a zero scale writes
        // every value as a signed zero.
        let row0 = &host[288..576];
        assert_eq!(row0[256], 0, "all-NaN group: zero scale");
        assert!(row0[..8].iter().all(|&x| x == 0x77), "all-NaN group: +6 nibbles");
        assert_eq!(row0[256 + 2], 0x7e, "an infinity saturates the scale at 448");
        assert_eq!(row0[256 + 5], 0, "amax / 6 below 2^-9: zero scale");
        println!("stride {stride}: fp4 scales {:02x?}", &row0[256..256 + groups.len()]);
    }
}

#[test]
fn the_pack_is_the_spec_row_format() {
    let mut rng = Rng::new(case_seed("kv-rows-format", 0));
    let kv = bf16_values(&mut rng, 512);
    let (mut nope, mut rope) = (vec![0xffu8; 512], vec![0xffu8; 128]);
    pack_fp8_row(&kv, &mut nope, &mut rope).unwrap();
    for tile in 0..7 {
        assert_eq!(nope[448 + 2 * tile], nope[449 + 2 * tile], "each scale twice");
    }
    assert!(nope[462..].iter().all(|&b| b == 0), "zero padding");
    for i in 0..64 {
        assert_eq!(u16::from_ne_bytes([rope[2 * i], rope[2 * i + 1]]), kv[448 + i], "RoPE copied");
    }
    // The reference refuses a short source instead of reading past it.
    let mut planes = KvPlanes::Bf16 { pool: &mut [0u8; 1024] };
    assert!(kv_rows(&kv[..511], 512, &[0], None, &mut planes, 1, 1).is_err());
}

fn host_pool(fp8: bool) -> Arc<v4pool::pool::Pool> {
    model_pool(Arc::new(HostBackend::new()), &ModelShape::v4_flash(0).unwrap(), fp8, 6, 3)
}

fn plane(pool: &v4pool::pool::Pool, i: usize) -> Vec<u8> {
    let mut out = vec![0u8; pool.plane_bytes(i).unwrap() as usize];
    pool.read_plane(i, 0, &mut out).unwrap();
    out
}

#[test]
fn the_writer_puts_rows_where_the_geometry_says() {
    for fp8 in [true, false] {
        let pool = host_pool(fp8);
        let g = pool.geometry().unwrap();
        let mut rng = Rng::new(case_seed("kv-rows-writer", u64::from(fp8)));
        let mut w = pool.kv_row_writer(RowWriteCapacity::new(300)).unwrap();
        // Fresh random plane contents: an untouched byte is one that keeps its value.
        for i in 0..pool.num_planes() {
            let bytes = rng.bytes(pool.plane_bytes(i).unwrap() as usize);
            pool.write_plane(i, 0, &bytes).unwrap();
        }
        let a = pool.alloc_slot().unwrap();
        let b = pool.alloc_slot().unwrap();
        // Sequence a: 140 tokens from position 5 (more than the ring: the first 12 dropped);
        // sequence b: 3 tokens from position 1,000.
        let seqs = [WindowSeq::new(a.handle, 5, 140), WindowSeq::new(b.handle, 1000, 3)];
        assert_eq!(w.stage_window(&seqs).unwrap(), 143);
        let csa = g.ratios.iter().position(|&r| r == 4).unwrap();
        let kv = bf16_values(&mut rng, 143 * 520);
        let before: Vec<Vec<u8>> = (0..pool.num_planes()).map(|i| plane(&pool, i)).collect();
        w.write(csa, RowSet::Window, &kv, 520).unwrap();
        let after: Vec<Vec<u8>> = (0..pool.num_planes()).map(|i| plane(&pool, i)).collect();
        let base = g.layer_base_row(csa).unwrap();
        let mut expect = before.clone();
        let mut put = |t: usize, slot: i64, p: i64| {
            let row = (base + g.window_index(csa, slot, p % g.ring_slots).unwrap()) as usize;
            let src = &kv[t * 520..t * 520 + 512];
            if fp8 {
                let (mut n, mut r) = (vec![0u8; 512], vec![0u8; 128]);
                pack_fp8_row(src, &mut n, &mut r).unwrap();
                expect[0][row * 512..row * 512 + 512].copy_from_slice(&n);
                expect[1][row * 128..row * 128 + 128].copy_from_slice(&r);
            } else {
                let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_ne_bytes()).collect();
                expect[0][row * 1024..row * 1024 + 1024].copy_from_slice(&bytes);
            }
        };
        for t in 12..140 {
            put(t, a.position, 5 + t as i64);
        }
        for t in 0..3 {
            put(140 + t, b.position, 1000 + t as i64);
        }
        assert!(after == expect, "fp8 {fp8}: window rows differ from the geometry's, or other bytes changed");

        // Compressed rows: entries at rows of two blocks, HCA class.
        let b0 = pool.alloc_block().unwrap().handle;
        let b1 = pool.alloc_block().unwrap().handle;
        let hca = g.ratios.iter().position(|&r| r == 128).unwrap();
        let entries = [CompressedRow { block: b1, row: 1 }, CompressedRow { block: b0, row: 0 }];
        w.stage_compressed(Class::Hca, &entries).unwrap();
        let kv2 = bf16_values(&mut rng, 2 * 512);
        w.write(hca, RowSet::Compressed(Class::Hca), &kv2, 512).unwrap();
        let hbase = g.layer_base_row(hca).unwrap();
        for (i, e) in entries.iter().enumerate() {
            let row = (hbase + g.compress_index(hca, i64::from(e.block.id), e.row).unwrap()) as usize;
            let got = &plane(&pool, 0)[row * w0(fp8)..(row + 1) * w0(fp8)];
            if fp8 {
                let (mut n, mut r) = (vec![0u8; 512], vec![0u8; 128]);
                pack_fp8_row(&kv2[i * 512..i * 512 + 512], &mut n, &mut r).unwrap();
                assert_eq!(got, &n[..]);
            } else {
                let bytes: Vec<u8> =
                    kv2[i * 512..i * 512 + 512].iter().flat_map(|v| v.to_ne_bytes()).collect();
                assert_eq!(got, &bytes[..]);
            }
        }
        // Staged for HCA, written to a CSA layer: refused.
        assert!(matches!(
            w.write(csa, RowSet::Compressed(Class::Hca), &kv2, 512),
            Err(RowWriteError::NothingStaged { .. })
        ));
        // A short KV buffer: refused before any launch.
        assert!(matches!(
            w.write(hca, RowSet::Compressed(Class::Hca), &kv2[..1000], 512),
            Err(RowWriteError::KvShape { .. })
        ));
        // A freed block, a freed slot: refused at write time (staged while live).
        pool.free_block(b0).unwrap();
        let snapshot = plane(&pool, 0);
        assert!(matches!(
            w.write(hca, RowSet::Compressed(Class::Hca), &kv2, 512),
            Err(RowWriteError::BadEntry { .. })
        ));
        pool.free_slot(b.handle).unwrap();
        assert!(matches!(
            w.write(csa, RowSet::Window, &kv, 520),
            Err(RowWriteError::StaleLease { seq: 1, .. })
        ));
        assert!(plane(&pool, 0) == snapshot, "a refused write changed the plane");
        assert!(matches!(w.stage_window(&seqs), Err(RowWriteError::StaleLease { seq: 1, .. })));
        let twice = WindowSeq::new(a.handle, 0, 1);
        assert!(matches!(
            w.stage_window(&[twice, twice]),
            Err(RowWriteError::SharedSlot { first: 0, second: 1, .. })
        ));
        assert!(matches!(
            w.stage_window(&[WindowSeq::new(a.handle, 0, 301)]),
            Err(RowWriteError::TooManyTokens { .. })
        ));
    }
}

fn w0(fp8: bool) -> usize {
    if fp8 {
        512
    } else {
        1024
    }
}

/// The whole indexer cache of a host pool.
fn indexer_bytes(pool: &v4pool::pool::Pool) -> Vec<u8> {
    let v = pool.indexer_view(0, 0).unwrap();
    let n = pool.spec().csa_layers.len() as u64 * v.blocks * v.rows_per_block * v.row_bytes;
    let mut out = vec![0u8; n as usize];
    // SAFETY: the pool's indexer allocation, `n` bytes from CSA layer 0's base (host backend).
    unsafe { pool.backend().download(&mut out, v.ptr, pool.stream()) }.unwrap();
    out
}

#[test]
fn index_keys_land_at_their_entries_rows_and_nothing_else_changes() {
    let model = ModelShape::v4_flash(0).unwrap();
    let pool = model_pool_with(Arc::new(HostBackend::new()), &model, false, 6, 3, Some(IndexerDtype::Bf16));
    let mut rng = Rng::new(case_seed("index-keys-writer", 0));
    let v = pool.indexer_view(0, 0).unwrap();
    assert_eq!((v.rows_per_block, v.row_bytes), (64, 256));
    let fresh = rng.bytes(indexer_bytes(&pool).len());
    // SAFETY: as in `indexer_bytes`.
    unsafe { pool.backend().upload(v.ptr, &fresh, pool.stream()) }.unwrap();
    // Two consecutive rows (one copy run), then a row of another block.
    let (mut w, [b0, b1], entries) = crate::index_keys::staged_entries(&pool, 3);
    let stride = 136;
    let keys = bf16_values(&mut rng, 2 * stride + 128);
    let rank = 2;
    w.write_index_keys(rank, &keys, stride).unwrap();
    let mut expect = fresh.clone();
    let layer_bytes = (v.blocks * 64 * 256) as usize;
    for (i, e) in entries.iter().enumerate() {
        let at = rank * layer_bytes + (e.block.id as usize * 64 + e.row as usize) * 256;
        let bytes: Vec<u8> =
            keys[i * stride..i * stride + 128].iter().flat_map(|k| k.to_ne_bytes()).collect();
        expect[at..at + 256].copy_from_slice(&bytes);
    }
    assert!(indexer_bytes(&pool) == expect, "index keys off their rows, or other bytes changed");
    // Refusals, nothing written: a short buffer, a CSA rank past the layers, HCA entries
    // staged, a freed block (every format: tests/kernels/index_keys.rs).
    assert!(matches!(w.write_index_keys(rank, &keys[..300], stride), Err(RowWriteError::KvShape { .. })));
    let ranks = pool.spec().csa_layers.len();
    assert!(matches!(w.write_index_keys(ranks, &keys, stride), Err(RowWriteError::Pool(_))));
    pool.free_block(b0).unwrap();
    assert!(matches!(w.write_index_keys(rank, &keys, stride), Err(RowWriteError::BadEntry { entry: 2, .. })));
    w.stage_compressed(Class::Hca, &[CompressedRow { block: b1, row: 0 }]).unwrap();
    assert!(matches!(w.write_index_keys(rank, &keys, stride), Err(RowWriteError::NothingStaged { .. })));
    assert!(indexer_bytes(&pool) == expect, "a refused write changed the indexer cache");
}

#[test]
fn a_v41_pool_in_flashmla_rows_gets_the_format_pack_at_its_window_rows() {
    // V4.1-Flash in FlashMLA's 528-B rows on the host backend: each class's first layer gets the
    // staged tokens' rows exactly as the format's description packs them, at the rows the
    // geometry's window_index names; every other byte keeps its random value.
    let model = ModelShape::v41_flash(0).unwrap();
    let kv = v4pool::sizing::KvDtype::FlashMlaV41;
    let pool = gather_common::model_pool_at(Arc::new(HostBackend::new()), &model, kv, 6, 3, None);
    let mut rng = Rng::new(case_seed("kv-rows-v41", 0));
    pool.write_plane(0, 0, &rng.bytes(pool.plane_bytes(0).unwrap() as usize)).unwrap();
    let mut w = pool.kv_row_writer(RowWriteCapacity::new(64)).unwrap();
    let slots: Vec<_> = (0..2).map(|_| pool.alloc_slot().unwrap()).collect();
    let before = plane(&pool, 0); // after alloc_slot initialised the slots' state
    let seqs = [WindowSeq::new(slots[0].handle, 5, 3), WindowSeq::new(slots[1].handle, 1_000, 2)];
    assert_eq!(w.stage_window(&seqs).unwrap(), 5);
    let kv = bf16_values(&mut rng, 5 * 512);
    let g = pool.geometry().unwrap();
    let f = v4pool::format::RowFormatId::FlashMlaV41.format();
    let mut want = before.clone();
    let mut written = 0;
    for class in g.classes.values() {
        let layer = class.layers[0];
        w.write(layer, RowSet::Window, &kv, 512).unwrap();
        // The view runs from its base row to the plane's end (lead rows included).
        let base = pool.plane_bytes(0).unwrap() as i64 / 528 - pool.layer_view(layer, 0).unwrap().rows;
        let mut t = 0;
        for (s, lease) in seqs.iter().zip(&slots) {
            let pos = pool.with_boundary(|b| b.position(lease.handle)).unwrap().unwrap();
            for i in 0..s.tokens as i64 {
                let q = (s.first_position + i) % g.ring_slots;
                let row = (base + g.window_index(layer, pos, q).unwrap()) as usize;
                want[row * 528..(row + 1) * 528]
                    .copy_from_slice(&f.pack(&kv[t * 512..(t + 1) * 512]).unwrap()[0]);
                t += 1;
                written += 1;
            }
        }
    }
    assert!(written >= 10, "V4.1-Flash has at least two classes");
    let got = plane(&pool, 0);
    let bad: Vec<usize> = (0..got.len() / 528)
        .filter(|&r| got[r * 528..(r + 1) * 528] != want[r * 528..(r + 1) * 528])
        .collect();
    assert!(
        bad.is_empty(),
        "rows as the description packs them, nothing else changed; rows differing: {bad:?}"
    );
}

#[test]
fn the_kernel_source_packs_flashmla_v4_pages_as_the_host_reference() {
    // FlashMLA's 584-B paged rows, in pages of 64 (`flashmla-v4`) and of 2 (`flashmla-v4-p2`):
    // the kernel (as C++) equals the host reference on random tokens with pads, dropped rows and
    // a view starting mid-page; each written row is the format description's pack at its page
    // place; every other byte of the plane stays poison; and FlashMLA's own read of the plane as
    // `[pages, P, 1, 584]` from the view's page (index = view row + the view's shift) gives each
    // written row back (flashmla_common::flashmla_v4_read: FlashMLA's arithmetic, not ours).
    let Some((_lib, emu)) = common::emulation_entry("kv_rows") else {
        return;
    };
    use v4pool::format::RowFormatId;
    for id in [RowFormatId::FlashMlaV4, RowFormatId::FlashMlaV4P2] {
        let f = id.format();
        let page = f.kernel_page_rows as i64;
        assert_eq!(page, f.planes[0].page_rows as i64, "{}: FlashMLA's page is the plane's", f.name);
        for case in 0..12u64 {
            let mut rng = Rng::new(case_seed(&format!("kv-rows-{}", f.name), case));
            let t = 1 + rng.below(40) as usize;
            let stride = 512 + 8 * rng.below(3) as usize;
            let view_rows = 150i64;
            let row0 = rng.below(100) as i64; // the view's first plane row: mid-page in general
            let pages = (row0 + view_rows + page - 1) / page;
            let kv = bf16_values(&mut rng, (t - 1) * stride + 512);
            let dest: Vec<i32> = (0..t).map(|_| rng.range(-3, view_rows + 3) as i32).collect();
            let bids: Vec<i32> =
                (0..t).map(|_| if rng.chance(0.2) { -1 } else { rng.below(4) as i32 }).collect();
            let run = |reference: bool| -> Vec<u8> {
                let mut plane = vec![0xa5u8; (pages * page * 584) as usize];
                let args = KvRowsArgs::default()
                    .with_kv(kv.as_ptr() as u64)
                    .with_dest_rows(dest.as_ptr() as u64)
                    .with_batch_id_per_token(bids.as_ptr() as u64)
                    .with_nope(plane.as_mut_ptr() as u64)
                    .with_rope(0)
                    .with_kv_row_stride(stride as i64)
                    .with_view_rows(view_rows)
                    .with_num_tokens(t as i32)
                    .with_format(id.kernel_code())
                    .with_view_row0(row0);
                // SAFETY: every pointer is a live buffer of the sizes the arguments name.
                unsafe { common::run_reference_or_emulated(&Launch::KvRows(args), emu, reference) };
                plane
            };
            let host = run(true);
            let dev = run(false);
            assert!(host == dev, "{} case {case}: kernel and host reference differ", f.name);
            let mut want = vec![0xa5u8; host.len()];
            let mut rows = std::collections::BTreeMap::new(); // view row -> its last packed row
            for i in 0..t {
                if bids[i] >= 0 && (0..view_rows as i32).contains(&dest[i]) {
                    let packed = f.pack(&kv[i * stride..i * stride + 512]).unwrap();
                    f.place((row0 + i64::from(dest[i])) as u64, &packed, &mut [&mut want[..]]).unwrap();
                    rows.insert(i64::from(dest[i]), packed.concat());
                }
            }
            assert!(host == want, "{} case {case}: rows at their page places, nothing else written", f.name);
            // FlashMLA's view: from the page holding the view's first row, shifted.
            let (first_page, shift) = (row0 / page, row0 % page);
            let view = &dev[(first_page * page * 584) as usize..];
            for (&r, packed) in &rows {
                let got =
                    flashmla_common::flashmla_v4_read(view, page as usize, (page * 584) as usize, r + shift);
                assert_eq!(
                    got.as_ref(),
                    Some(packed),
                    "{} case {case}: FlashMLA's read of view row {r}",
                    f.name
                );
            }
        }
    }
}

#[test]
fn v41_layers_take_their_window_rows() {
    // Regression: the writer named a layer's class by V4's ratios (0, 4, 128), so every
    // compressed layer of DeepSeek-V4.1 (ratios 1 and 2, the fine and coarse slots) was
    // refused, by the decode write and the window write alike.
    use v4pool::pool::{DecodeCapacity, DecodeSeq, PoolSpec};
    use v4pool::sizing::{KvDtype, PoolLayout};
    let model = ModelShape::v41_flash(0).unwrap();
    let layout = PoolLayout::new(&model, KvDtype::Bf16, IndexerDtype::Fp8).unwrap();
    let lg = &layout.geometry;
    let geometry =
        layout.carve(4, 2, 4 * lg.envelope_rows + 3 * (lg.slot_rows + lg.slot_align_rows.max(1))).unwrap();
    let spec = PoolSpec::from_layout(&layout, geometry).unwrap();
    let pool =
        Arc::new(v4pool::pool::Pool::new(Arc::new(HostBackend::new()), spec, Default::default()).unwrap());
    let g = pool.geometry().unwrap();
    let mut rng = Rng::new(case_seed("kv-rows-v41", 0));
    let a = pool.alloc_slot().unwrap();
    let mut w = pool.kv_row_writer(RowWriteCapacity::new(3)).unwrap();
    w.stage_window(&[WindowSeq::new(a.handle, 1000, 3)]).unwrap();
    let mut path = pool.decode_path(DecodeCapacity::new(1, 1, 4, 128, 512)).unwrap();
    let table = [0, 1, 2, 3];
    path.stage(&[DecodeSeq::new(a.position, 1004, 1, &table)]).unwrap();
    path.build().unwrap();
    // Dense, coarse (ratio 2) and fine (ratio 1) layers.
    for layer in [0usize, 2, 25] {
        let base = g.layer_base_row(layer).unwrap();
        let row_bytes = |p: i64| -> Vec<u8> {
            let row = (base + g.window_index(layer, a.position, p % g.ring_slots).unwrap()) as usize;
            plane(&pool, 0)[row * 1024..(row + 1) * 1024].to_vec()
        };
        let as_bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
        let kv = bf16_values(&mut rng, 3 * 512);
        w.write(layer, RowSet::Window, &kv, 512).unwrap();
        for t in 0..3 {
            assert_eq!(
                row_bytes(1000 + t as i64),
                as_bytes(&kv[t * 512..(t + 1) * 512]),
                "layer {layer} window row {t}"
            );
        }
        let kv = bf16_values(&mut rng, 512);
        w.write_decode(&path, layer, &kv, 512).unwrap();
        assert_eq!(row_bytes(1003), as_bytes(&kv), "layer {layer}: the decode token's own row");
    }
}

#[test]
fn a_stride_whose_span_wraps_is_a_shape_error() {
    // Seen failing before the fix: `(tokens − 1) × stride + row` wrapped for stride
    // usize::MAX and the copy panicked slicing the KV (window, compressed and index-key
    // writes alike).
    let pool = model_pool_with(
        Arc::new(HostBackend::new()),
        &ModelShape::v4_flash(0).unwrap(),
        true,
        6,
        3,
        Some(IndexerDtype::Fp8),
    );
    let g = pool.geometry().unwrap();
    let csa = g.ratios.iter().position(|&r| r == 4).unwrap();
    let mut w = pool.kv_row_writer(RowWriteCapacity::new(8)).unwrap();
    let slot = pool.alloc_slot().unwrap().handle;
    w.stage_window(&[WindowSeq::new(slot, 0, 4)]).unwrap();
    let kv = vec![0x3f80u16; 4 * 512];
    let before = plane(&pool, 0);
    for stride in [usize::MAX, usize::MAX / 2, usize::MAX / 3 + 1] {
        let r = w.write(csa, RowSet::Window, &kv, stride);
        assert!(matches!(r, Err(RowWriteError::KvShape { tokens: 4, .. })), "window, stride {stride}: {r:?}");
    }
    let block = pool.alloc_block().unwrap().handle;
    let entries: Vec<CompressedRow> = (0..4).map(|row| CompressedRow { block, row }).collect();
    w.stage_compressed(Class::Csa, &entries).unwrap();
    for stride in [usize::MAX, usize::MAX / 2] {
        let r = w.write(csa, RowSet::Compressed(Class::Csa), &kv, stride);
        assert!(
            matches!(r, Err(RowWriteError::KvShape { tokens: 4, .. })),
            "compressed, stride {stride}: {r:?}"
        );
        let r = w.write_index_keys(0, &kv, stride);
        assert!(
            matches!(r, Err(RowWriteError::KvShape { tokens: 4, .. })),
            "index keys, stride {stride}: {r:?}"
        );
    }
    assert!(plane(&pool, 0) == before, "a refused write changed the plane");
    // The same writes at a stride that fits go through.
    w.write(csa, RowSet::Compressed(Class::Csa), &kv, 512).expect("a fitting stride");
    w.write_index_keys(0, &kv, 512).expect("a fitting stride");
}

#[test]
fn window_positions_past_i64_are_refused() {
    // Seen failing before the fix: staging 2 tokens from position i64::MAX returned Ok (the
    // second position wrapped negative) and the write went through.
    let pool = host_pool(true);
    let mut w = pool.kv_row_writer(RowWriteCapacity::new(8)).unwrap();
    let slot = pool.alloc_slot().unwrap().handle;
    for (first, tokens) in [(i64::MAX, 2), (i64::MAX - 2, 4)] {
        let r = w.stage_window(&[WindowSeq::new(slot, first, tokens)]);
        assert!(
            matches!(r, Err(RowWriteError::PositionPastI64 { seq: 0, first_position, tokens: t })
                if first_position == first && t == tokens),
            "{first} + {tokens}: {r:?}"
        );
    }
    let r = w.write(0, RowSet::Window, &vec![0u16; 2 * 512], 512);
    assert!(matches!(r, Err(RowWriteError::NothingStaged { .. })), "{r:?}");
    // The last position that is one.
    assert_eq!(w.stage_window(&[WindowSeq::new(slot, i64::MAX - 1, 2)]).unwrap(), 2);
}
