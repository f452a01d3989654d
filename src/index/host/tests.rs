//! The worked examples of index-buffers.md §1, §3–§7, built from `UnifiedPoolGeometry`.
//! Outputs are poisoned (−7 / −9) first; every cell the contract leaves alone must keep it.

use super::*;
use crate::geometry::{GeometrySpec, UnifiedPoolGeometry};
use crate::index::{CopyRun, CopyRunsArgs, DecodeIndexArgs, FillRun, FillRunsArgs, Launch};

const U: i32 = -7;

/// Geometry A: ratios [0,4,128,4,128,0], 4 blocks, 6 slots, ring 11, block 256.
fn geometry_a() -> UnifiedPoolGeometry {
    GeometrySpec::new(vec![0, 4, 128, 4, 128, 0], 4, 6, 11, 256).build().unwrap()
}

/// Geometry B: ratios [0,4,128,4,128], 40 blocks, 4 slots, ring 11, block 256.
fn geometry_b() -> UnifiedPoolGeometry {
    GeometrySpec::new(vec![0, 4, 128, 4, 128], 40, 4, 11, 256).build().unwrap()
}

fn range(a: i32, b: i32) -> Vec<i32> {
    (a..=b).collect()
}

fn cat(parts: &[&[i32]]) -> Vec<i32> {
    parts.concat()
}

#[test]
fn byte_offsets_are_64_bit() {
    let rows = [0i64, 1, 4194303, 4194304, 4194305, 100000000, 148610071];
    let want = [0u64, 512, 2147483136, 2147483648, 2147484160, 51200000000, 76088356352];
    for (r, w) in rows.iter().zip(want) {
        assert_eq!(row_byte_offset(*r, 512).unwrap(), w);
    }
    assert!(row_byte_offset(-1, 512).is_err());
}

#[test]
fn geometry_a_window_table() {
    let g = geometry_a();
    assert_eq!((g.envelope_rows, g.entry_rows, g.slot_rows, g.plane_rows), (132, 120, 120, 1320));
    let rows = |ratio: i32| -> Vec<i64> {
        let w = g.window_params(ratio).unwrap();
        (0..11).map(|q| window_row(&w, 3, q).unwrap()).collect()
    };
    assert_eq!(rows(0), (360..=370).collect::<Vec<i64>>());
    assert_eq!(rows(4), (401..=411).collect::<Vec<i64>>());
    assert_eq!(rows(128), vec![382, 383, 386, 387, 390, 391, 394, 395, 398, 399, 402]);
    // The device formula agrees with the geometry's own.
    for ratio in [0, 4, 128] {
        let w = g.window_params(ratio).unwrap();
        for pos in [0, 5, 11, 1_000_000] {
            assert_eq!(window_row(&w, 4, pos).unwrap(), w.index(4, pos));
        }
    }
    assert_eq!(g.layer_base_row(3).unwrap() + 401, 469);
}

/// The §3 batch: window 8, slots [3,0,4], positions [5,20,13,7], batch ids [0,1,2,−1].
struct DecodeCase {
    slots: Vec<i32>,
    bids: Vec<i32>,
    positions: Vec<i64>,
    swa_indptr: Vec<i32>,
    csa_indptr: Vec<i32>,
    hca_indptr: Vec<i32>,
}

fn decode_case() -> DecodeCase {
    DecodeCase {
        slots: vec![3, 0, 4],
        bids: vec![0, 1, 2, -1],
        positions: vec![5, 20, 13, 7],
        swa_indptr: vec![0, 6, 14, 22, 22],
        csa_indptr: vec![0, 9, 17, 30, 30],
        hca_indptr: vec![0, 7, 17, 25, 25],
    }
}

struct DecodeOut {
    swa: Vec<i32>,
    csa: Vec<i32>,
    hca: Vec<i32>,
    dest: [Vec<i32>; 3],
}

fn run_decode_case(g: &UnifiedPoolGeometry, tables: Option<&[i32]>) -> DecodeOut {
    let c = decode_case();
    let mut out = DecodeOut {
        swa: vec![U; 22],
        csa: vec![U; 30],
        hca: vec![U; 25],
        dest: [vec![U; 4], vec![U; 4], vec![U; 4]],
    };
    let [d0, d1, d2] = &mut out.dest;
    let dense = g.window_params(0).ok().map(|params| DecodeClass {
        params,
        indptr: &c.swa_indptr,
        indices: Some(&mut out.swa),
        dest_rows: Some(d0.as_mut_slice()),
    });
    let csa = DecodeClass {
        params: g.window_params(4).unwrap(),
        indptr: &c.csa_indptr,
        indices: Some(&mut out.csa),
        dest_rows: Some(d1.as_mut_slice()),
    };
    let hca = DecodeClass {
        params: g.window_params(128).unwrap(),
        indptr: &c.hca_indptr,
        indices: Some(&mut out.hca),
        dest_rows: Some(d2.as_mut_slice()),
    };
    decode_indices(DecodeIndices {
        flashmla: [None, None, None],
        classes: [dense, Some(csa), Some(hca)],
        state_slot_per_seq: &c.slots,
        batch_id_per_token: &c.bids,
        positions: &c.positions,
        block_tables: tables.map(|table| BlockTables { table, stride: 3 }),
        envelope_rows: g.envelope_rows,
        hca_rows_per_block: 2,
        num_tokens: 4,
        win: 8,
    })
    .unwrap();
    out
}

fn decode_csa_expected() -> Vec<i32> {
    cat(&[&[U; 3], &range(401, 406), &range(43, 50), &[U; 5], &range(527, 531), &[521, 522, 523]])
}

#[test]
fn decode_builder_worked_example() {
    let out = run_decode_case(&geometry_a(), None);
    assert_eq!(out.swa, cat(&[&range(360, 365), &range(2, 9), &range(486, 490), &range(480, 482)]));
    assert_eq!(out.csa, decode_csa_expected());
    assert_eq!(
        out.hca,
        vec![
            U, 382, 383, 386, 387, 390, 391, U, U, 26, 27, 30, 31, 34, 35, 38, 39, 514, 515, 518, 519, 522,
            502, 503, 506
        ]
    );
    assert_eq!(out.dest[0], vec![365, 9, 482, U]);
    assert_eq!(out.dest[1], vec![406, 50, 523, U]);
    assert_eq!(out.dest[2], vec![391, 39, 506, U]);
}

#[test]
fn decode_builder_fuses_hca_heads() {
    // §4 in the §3 example: tables [[2,0,3],[1,3,0],[3,1,2]], envelope 132, rpb 2.
    let tables = [2, 0, 3, 1, 3, 0, 3, 1, 2];
    let out = run_decode_case(&geometry_a(), Some(&tables));
    let plain = run_decode_case(&geometry_a(), None);
    assert_eq!(out.hca[0], 264);
    assert_eq!(&out.hca[7..9], &[132, 133]);
    // Everything else as without the fused heads.
    let mut expect = plain.hca.clone();
    expect[0] = 264;
    expect[7] = 132;
    expect[8] = 133;
    assert_eq!(out.hca, expect);
    assert_eq!(out.csa, plain.csa);
}

#[test]
fn decode_builder_without_dense_class() {
    let g = GeometrySpec::new(vec![4, 128, 4, 128], 4, 6, 11, 256).build().unwrap();
    assert!(g.window_params(0).is_err());
    let out = run_decode_case(&g, None);
    assert_eq!(out.swa, vec![U; 22]);
    assert_eq!(out.dest[0], vec![U; 4]);
    assert_eq!(
        out.csa,
        cat(&[&[U; 3], &range(313, 318), &range(21, 28), &[U; 5], &range(417, 421), &[411, 412, 413]])
    );
}

#[test]
fn hca_offsets_worked_example() {
    let entries = [0, 1, 2, 3, 0, 1, 2];
    let bids = [0, 0, 0, 0, 1, 1, 1];
    let tables = BlockTables { table: &[5, 9, 13, 17, 2, 6, 10, 14], stride: 4 };
    let mut out = vec![-9; 8];
    hca_offsets(&entries, &bids, &tables, 10000, 2, &mut out).unwrap();
    assert_eq!(out, vec![50000, 50001, 90000, 90001, 20000, 20001, 60000, -9]);
    let mut out = vec![-9; 8];
    hca_offsets(&entries, &bids, &tables, 10000, 1, &mut out).unwrap();
    assert_eq!(out, vec![50000, 90000, 130000, 170000, 20000, 60000, 100000, -9]);
    // A column past the table is an error on the host (the device would read past the row).
    let err = hca_offsets(&[8], &[0], &tables, 10000, 2, &mut out).unwrap_err();
    assert_eq!(err, HostKernelError::TableColumn { seq: 0, column: 4, stride: 4 });
    assert!(hca_offsets(&[-1], &[0], &tables, 10000, 2, &mut out).is_err());
}

/// The reference engine's translator-takes-the-bias case (`docs/v41.md`): envelope 10,
/// 2 rows per block, tables [[0,1,2],[3,4,5]], top-k [[0,1,2,−1],[3,2,1,−1]], slices of 3 →
/// [0,1,10,41,40,31]; a bias shifts every entry by itself and touches nothing else.
#[test]
fn csa_pack_takes_the_compress_bias() {
    let table = [0, 1, 2, 3, 4, 5];
    for bias in [0i64, 128, 256, 4_864] {
        let mut out = vec![U; 7];
        csa_translate_pack(CsaPack {
            topk: &[0, 1, 2, -1, 3, 2, 1, -1],
            block_tables: BlockTables { table: &table, stride: 3 },
            positions: &[5, 7],
            indptr: &[0, 3, 6],
            batch_id_per_token: &[0, 1],
            skip_prefix_len_per_token: &[0, 0],
            out: &mut out,
            envelope_rows: 10,
            topk_row_stride: 4,
            num_tokens: 2,
            block_capacity: 2,
            window_size: 0,
            compress_bias: bias,
            flashmla: None,
        })
        .unwrap();
        let b = bias as i32;
        assert_eq!(out, vec![b, 1 + b, 10 + b, 41 + b, 40 + b, 31 + b, U], "bias {bias}");
    }
}

#[test]
fn csa_pack_decode_worked_example() {
    let c = decode_case();
    let mut csa = run_decode_case(&geometry_a(), None).csa;
    let topk = cat(&[&[1, 70, 130, -1, -1, -1, -1, -1], &[7; 8], &[0, 64, 65, 127, 200, -1, 5, 9], &[3; 8]]);
    csa_translate_pack(CsaPack {
        topk: &topk,
        block_tables: BlockTables { table: &[2, 0, 3, 1, 3, 0, 3, 1, 2], stride: 3 },
        positions: &c.positions,
        indptr: &c.csa_indptr,
        batch_id_per_token: &c.bids,
        skip_prefix_len_per_token: &[],
        out: &mut csa,
        envelope_rows: 132,
        topk_row_stride: 8,
        num_tokens: 4,
        block_capacity: 64,
        window_size: 8,
        compress_bias: 0,
        flashmla: None,
    })
    .unwrap();
    assert_eq!(
        csa,
        cat(&[
            &[265, 6, 398],
            &range(401, 406),
            &range(43, 50),
            &[396, 132, 133, 195, 272],
            &range(527, 531),
            &[521, 522, 523]
        ])
    );
}

/// The §6 batch on geometry B: two sequences (tokens at positions 0–2 of slot 3, 14–15 of slot
/// 0), block tables [7, 8] and [21, 5].
const BATCH_BIDS: [i32; 5] = [0, 0, 0, 1, 1];
const BATCH_TABLES: [i32; 4] = [7, 8, 21, 5];
/// The batch's CSA prefix rows (each sequence's second token on: 9 and 8 rows).
const BATCH_CSA_PTR: [i32; 6] = [0, 0, 0, 0, 9, 17];

/// The §6 batch through the prefill builder, the HCA prefix rows at `hca_ptr`: the extend,
/// prefix SWA, CSA and HCA indices, each one `U` past its indptr's end.
fn prefill_batch_b(hca_ptr: &[i32; 6], coarse_packed: bool) -> [Vec<i32>; 4] {
    let g = geometry_b();
    let (ext_ptr, swa_ptr) = ([0, 1, 3, 6, 7, 9], [0, 0, 0, 0, 7, 13]);
    let slack = |ptr: &[i32; 6]| vec![U; ptr[5] as usize + 1];
    let [mut ext, mut swa, mut csa, mut hca] =
        [slack(&ext_ptr), slack(&swa_ptr), slack(&BATCH_CSA_PTR), slack(hca_ptr)];
    prefill_indices(PrefillIndices {
        dense: g.window_params(0).unwrap(),
        csa: g.window_params(4).unwrap(),
        hca: g.window_params(128).unwrap(),
        positions: &[0, 1, 2, 14, 15],
        bid_per_token: &BATCH_BIDS,
        chunk_start_per_seq: &[0, 14],
        cu_seqlens_q_per_seq: &[0, 3],
        state_slot_per_seq: &[3, 0],
        // Ignored when packed (a V4 builder writes 2 compressed rows here).
        n_committed_hca_per_seq: &[0, 2],
        block_tables: BlockTables { table: &BATCH_TABLES, stride: 2 },
        extend: Csr { indptr: &ext_ptr, indices: &mut ext },
        prefix_swa: Some(Csr { indptr: &swa_ptr, indices: &mut swa }),
        prefix_csa: Csr { indptr: &BATCH_CSA_PTR, indices: &mut csa },
        prefix_hca: Csr { indptr: hca_ptr, indices: &mut hca },
        envelope_rows: 132,
        num_tokens: 5,
        win: 8,
        hca_ratio: 8,
        hca_rows_per_block: 2,
        coarse_packed,
    })
    .unwrap();
    [ext, swa, csa, hca]
}

/// §5 in prefill mode over the §6 batch's CSA prefix rows: `topk` (`topk_row_stride` a row)
/// packed into `out` in blocks of `block_capacity` compressed rows, plus `compress_bias`; the
/// second sequence's tokens skip their 7 and 6 prefix rows (the window).
fn pack_batch_b(
    topk: &[i32],
    topk_row_stride: i32,
    out: &mut [i32],
    block_capacity: i32,
    compress_bias: i64,
) {
    csa_translate_pack(CsaPack {
        topk,
        block_tables: BlockTables { table: &BATCH_TABLES, stride: 2 },
        positions: &[],
        indptr: &BATCH_CSA_PTR,
        batch_id_per_token: &BATCH_BIDS,
        skip_prefix_len_per_token: &[0, 0, 0, 7, 6],
        out,
        envelope_rows: 132,
        topk_row_stride,
        num_tokens: 5,
        block_capacity,
        window_size: 0,
        compress_bias,
        flashmla: None,
    })
    .unwrap();
}

/// The §6 batch on geometry B.
#[test]
fn prefill_builder_worked_example_and_csa_follow_up() {
    let g = geometry_b();
    assert_eq!(g.envelope_rows, 132);
    let (dense, csa, hca) =
        (g.window_params(0).unwrap(), g.window_params(4).unwrap(), g.window_params(128).unwrap());
    let p = |w: &WindowParams| (w.ring_start, w.slot_rows, w.ring_slots, w.ring_stride, w.run_rows);
    assert_eq!(p(&dense), (0, 110, 11, 11, 11));
    assert_eq!(p(&csa), (30, 110, 11, 64, 128));
    assert_eq!(p(&hca), (11, 110, 11, 2, 4));

    let [ext, swa, mut csa_idx, hca_idx] = prefill_batch_b(&[0, 0, 0, 0, 8, 16], false);
    assert_eq!(ext, vec![0, 0, 1, 0, 1, 2, 3, 3, 4, U]);
    assert_eq!(swa, vec![7, 8, 9, 10, 0, 1, 2, 8, 9, 10, 0, 1, 2, U]);
    assert_eq!(csa_idx, vec![U, U, 37, 38, 39, 40, 30, 31, 32, U, U, 38, 39, 40, 30, 31, 32, U]);
    assert_eq!(hca_idx, vec![24, 27, 28, 31, 11, 12, 15, 2772, 27, 28, 31, 11, 12, 15, 2772, 2773, U]);

    // §5 in prefill mode fills the CSA heads.
    let topk = cat(&[&[0, 0, 0, 0], &[0, 0, 0, 0], &[0, 0, 0, 0], &[2, 0, -1, -1], &[3, 65, -1, -1]]);
    pack_batch_b(&topk, 4, &mut csa_idx, 64, 0);
    assert_eq!(csa_idx, vec![2774, 2772, 37, 38, 39, 40, 30, 31, 32, 2775, 661, 38, 39, 40, 30, 31, 32, U]);
}

/// The §6 batch with the coarse slot packed per layer (V4.1): the builder writes the HCA
/// window at the tail of each slice, no compressed head; the pack (prefill mode, the
/// layer's bias) fills the heads.
#[test]
fn prefill_packed_coarse_slot_keeps_its_head_for_the_pack() {
    // The HCA prefix as long as the CSA one: a packed layer's slice holds the compressed head.
    let [_, _, csa_idx, mut hca_idx] = prefill_batch_b(&BATCH_CSA_PTR, true);
    // The windows are V4's (see the worked example), now at each slice's tail.
    assert_eq!(hca_idx, vec![U, U, 24, 27, 28, 31, 11, 12, 15, U, U, 27, 28, 31, 11, 12, 15, U]);
    assert_eq!(csa_idx, vec![U, U, 37, 38, 39, 40, 30, 31, 32, U, U, 38, 39, 40, 30, 31, 32, U]);
    let topk = cat(&[&[0, 0], &[0, 0], &[0, 0], &[1, 2], &[3, 0]]);
    pack_batch_b(&topk, 2, &mut hca_idx, 2, 5);
    // Token 3 (table [21, 5]): rows 1 → 21·132 + 1, 2 → 5·132 + 0; token 4: 3 → 5·132 + 1,
    // 0 → 21·132; each + 5.
    assert_eq!(hca_idx, vec![2778, 665, 24, 27, 28, 31, 11, 12, 15, 666, 2777, 27, 28, 31, 11, 12, 15, U]);
}

#[test]
fn prefill_without_dense_leaves_swa_alone() {
    let g = GeometrySpec::new(vec![4, 128, 4, 128], 40, 4, 11, 256).build().unwrap();
    let (csa, hca) = (g.window_params(4).unwrap(), g.window_params(128).unwrap());
    let (mut ext, mut csa_idx, mut hca_idx) = (vec![U; 2], vec![U; 9], vec![U; 8]);
    prefill_indices(PrefillIndices {
        dense: WindowParams::default(),
        csa,
        hca,
        positions: &[14],
        bid_per_token: &[0],
        chunk_start_per_seq: &[14],
        cu_seqlens_q_per_seq: &[0],
        state_slot_per_seq: &[0],
        n_committed_hca_per_seq: &[2],
        block_tables: BlockTables { table: &[21, 5], stride: 2 },
        extend: Csr { indptr: &[0, 1], indices: &mut ext },
        prefix_swa: None,
        prefix_csa: Csr { indptr: &[0, 9], indices: &mut csa_idx },
        prefix_hca: Csr { indptr: &[0, 8], indices: &mut hca_idx },
        envelope_rows: g.envelope_rows,
        num_tokens: 1,
        win: 8,
        hca_ratio: 8,
        hca_rows_per_block: 2,
        coarse_packed: false,
    })
    .unwrap();
    assert_eq!(ext, vec![0, U]);
    assert_eq!(&csa_idx[..2], &[U, U]);
    assert_eq!(hca_idx[7], 21 * g.envelope_rows as i32);
}

fn kv_rows(n: usize, w: usize) -> Vec<u8> {
    (0..n * w).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn ring_write_worked_example() {
    let g = geometry_a();
    let params = g.window_params(4).unwrap();
    let view_rows = g.layer_view_rows(3).unwrap();
    assert_eq!(view_rows, 1252);
    let (w0, w1) = (16usize, 4usize);
    let (kv0, kv1) = (kv_rows(6, w0), kv_rows(6, w1));
    let positions = [0, 1, 2, 3, 20, 21];
    let cu = [0, 4, 6];
    for (slots, written) in [
        ([3, 0], vec![(402, 1), (403, 2), (404, 3), (50, 4), (51, 5)]),
        ([3, 11], vec![(402, 1), (403, 2), (404, 3)]),
    ] {
        let mut pool0 = vec![0xa5u8; view_rows as usize * w0];
        let mut pool1 = vec![0x5au8; view_rows as usize * w1];
        let mut planes = [
            PlaneRows { kv: &kv0, pool: &mut pool0, row_bytes: w0 },
            PlaneRows { kv: &kv1, pool: &mut pool1, row_bytes: w1 },
        ];
        ring_write(&params, &mut planes, &positions, &cu, &slots, view_rows, 2, 3).unwrap();
        let mut expect0 = vec![0xa5u8; pool0.len()];
        let mut expect1 = vec![0x5au8; pool1.len()];
        for (row, src) in written {
            expect0[row * w0..(row + 1) * w0].copy_from_slice(&kv0[src * w0..(src + 1) * w0]);
            expect1[row * w1..(row + 1) * w1].copy_from_slice(&kv1[src * w1..(src + 1) * w1]);
        }
        assert!(pool0 == expect0 && pool1 == expect1, "slots {slots:?}");
    }
    // The stale slot's rows really are past the view.
    assert_eq!(window_row(&params, 11, 20).unwrap(), 1370);
    assert_eq!(window_row(&params, 11, 21).unwrap(), 1371);
}

#[test]
fn row_scatter_skips_pads_and_out_of_view_rows() {
    let w = 8usize;
    let kv = kv_rows(5, w);
    let view_rows = 600i64;
    let mut pool = vec![0xeeu8; view_rows as usize * w];
    // dest rows of the §3 CSA class plus one past the view and one negative.
    let dest = [406, 50, 523, 7, 600];
    let bids = [0, 1, 2, -1, 0];
    let mut planes = [PlaneRows { kv: &kv, pool: &mut pool, row_bytes: w }];
    row_scatter(&mut planes, &bids, &dest, view_rows, 5).unwrap();
    let mut expect = vec![0xeeu8; view_rows as usize * w];
    for (t, row) in [(0usize, 406usize), (1, 50), (2, 523)] {
        expect[row * w..(row + 1) * w].copy_from_slice(&kv[t * w..(t + 1) * w]);
    }
    assert!(pool == expect);
}

#[test]
fn raw_entry_matches_the_safe_reference() {
    // The §3 example through run_launch on host addresses.
    let g = geometry_a();
    let c = decode_case();
    let tables = [2, 0, 3, 1, 3, 0, 3, 1, 2];
    let (mut swa, mut csa, mut hca) = (vec![U; 22], vec![U; 30], vec![U; 25]);
    let mut dest = [vec![U; 4], vec![U; 4], vec![U; 4]];
    let addr = |s: &[i32]| s.as_ptr() as u64;
    let mut a = DecodeIndexArgs {
        state_slot_per_seq: addr(&c.slots),
        batch_id_per_token: addr(&c.bids),
        positions: c.positions.as_ptr() as u64,
        block_tables: addr(&tables),
        envelope_rows: 132,
        block_table_stride: 3,
        hca_rows_per_block: 2,
        num_tokens: 4,
        win: 8,
        ..Default::default()
    };
    let bufs = [(&c.swa_indptr, &mut swa), (&c.csa_indptr, &mut csa), (&c.hca_indptr, &mut hca)];
    for (i, ((indptr, indices), d)) in bufs.into_iter().zip(dest.iter_mut()).enumerate() {
        a.classes[i] = crate::index::ClassBuffers {
            params: g.window_params([0, 4, 128][i]).unwrap(),
            indptr: addr(indptr),
            indices: indices.as_mut_ptr() as u64,
            dest_rows: d.as_mut_ptr() as u64,
        };
    }
    // SAFETY: every address is a live Vec of the length the arguments imply.
    unsafe { run_launch(&Launch::Decode(a)).unwrap() };
    let want = run_decode_case(&g, Some(&tables));
    assert_eq!((swa, csa, hca), (want.swa, want.csa, want.hca));
    assert_eq!(dest, want.dest);
}

#[test]
fn raw_fill_and_copy_runs() {
    let mut buf = vec![0u32; 64];
    let base = buf.as_mut_ptr() as u64;
    let runs = [
        FillRun { dst: base + 4, bytes: 40, pattern: 0xff80_0000, _pad: 0 },
        FillRun { dst: base + 100, bytes: 8, pattern: 7, _pad: 0 },
    ];
    let a = FillRunsArgs { runs: runs.as_ptr() as u64, num_runs: 2, _pad: 0 };
    // SAFETY: the runs lie inside `buf`.
    unsafe { run_launch(&Launch::FillRuns(a)).unwrap() };
    let mut want = vec![0u32; 64];
    want[1..11].fill(0xff80_0000);
    want[25..27].fill(7);
    assert_eq!(buf, want);

    let src: Vec<u8> = (0..200u32).map(|i| (i * 13 + 1) as u8).collect();
    let mut dst = vec![0x11u8; 200];
    let runs = [
        CopyRun { src: src.as_ptr() as u64 + 3, dst: dst.as_mut_ptr() as u64 + 5, bytes: 50 },
        CopyRun { src: src.as_ptr() as u64 + 100, dst: dst.as_mut_ptr() as u64 + 100, bytes: 64 },
    ];
    let a = CopyRunsArgs { runs: runs.as_ptr() as u64, num_runs: 2, _pad: 0 };
    // SAFETY: the runs lie inside `src` and `dst`.
    unsafe { run_launch(&Launch::CopyRuns(a)).unwrap() };
    let mut want = vec![0x11u8; 200];
    want[5..55].copy_from_slice(&src[3..53]);
    want[100..164].copy_from_slice(&src[100..164]);
    assert_eq!(dst, want);

    let bad = [FillRun { dst: base + 2, bytes: 8, pattern: 1, _pad: 0 }];
    let a = FillRunsArgs { runs: bad.as_ptr() as u64, num_runs: 1, _pad: 0 };
    // SAFETY: rejected before any write.
    let err = unsafe { run_launch(&Launch::FillRuns(a)) }.unwrap_err();
    assert!(matches!(err, HostKernelError::FillRunUnaligned { run: 0, .. }));
}
