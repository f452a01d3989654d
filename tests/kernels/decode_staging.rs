//! The decode path as an engine holds it (`Pool::decode_path`) on the host backend:
//! resident block tables (`stage_resident` + `write_block_table`) build exactly what a full
//! `stage` does; bad batches — dead positions, foreign blocks, contexts the buffers cannot
//! index, token counts that overflow — are refused with a typed error and never panic;
//! capacities whose byte counts overflow are refused.

use crate::common;

use common::Rng;

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Stream;
use v4pool::pool::{DecodeBuffer, DecodeCapacity, DecodeError, DecodePath, DecodeSeq, Pool};
use v4pool::Class;

/// A host pool of `blocks` blocks and 16 slots over V4-like ratios (20 CSA/HCA pairs and
/// dense layers), ring 129, 256-token blocks; 16-byte rows keep it small.
fn pool(blocks: i64) -> Arc<Pool> {
    let mut ratios = vec![0, 0];
    for _ in 0..20 {
        ratios.extend([4, 128]);
    }
    ratios.extend([4, 0]);
    pool_on(Arc::new(HostBackend::new()), ratios, blocks, 16)
}

/// A host pool over `ratios` (see `common::index_pool`).
fn pool_on(backend: Arc<HostBackend>, ratios: Vec<i32>, blocks: i64, slots: i64) -> Arc<Pool> {
    common::index_pool(backend, ratios, blocks, slots)
}

fn cap(max_seqs: usize, max_tokens: usize, max_blocks_per_seq: usize) -> DecodeCapacity {
    DecodeCapacity::new(max_seqs, max_tokens, max_blocks_per_seq, 128, 512)
}

/// Poison every class's index buffer (so cells the build skips would differ), build, read.
fn build_and_read(path: &mut DecodePath) -> Vec<Vec<i32>> {
    let mut out = Vec::new();
    path.build().unwrap();
    for c in Class::ALL {
        out.push(path.read_i32(DecodeBuffer::Indices(c)).unwrap());
        out.push(path.read_i32(DecodeBuffer::Indptr(c)).unwrap());
        out.push(path.read_i32(DecodeBuffer::DestRows(c)).unwrap());
    }
    out
}

#[test]
fn resident_tables_build_the_same_indices_as_full_staging() {
    let pool = pool(400);
    let mut full = pool.decode_path(cap(8, 16, 40)).unwrap();
    let mut resident = pool.decode_path(cap(8, 16, 40)).unwrap();
    let live: Vec<i64> = pool.geometry().unwrap().live_positions().collect();
    let mut rng = Rng::new(12345);
    let ctx: Vec<i64> = (0..6).map(|_| 2 + rng.below(40 * 256 - 2) as i64).collect();
    let tables: Vec<Vec<i32>> =
        ctx.iter().map(|&c| (0..(c + 255) / 256).map(|_| rng.below(400) as i32).collect()).collect();
    let batch: Vec<DecodeSeq<'_>> =
        (0..6).map(|i| DecodeSeq::new(live[i * 2], ctx[i], 2, &tables[i])).collect();
    assert_eq!(full.stage(&batch).unwrap(), 12);
    for (row, t) in tables.iter().enumerate() {
        // An entering sequence's table in two writes: all but its last block, then the last.
        let (head, tail) = t.split_at(t.len() - 1);
        resident.write_block_table(row, 0, head).unwrap();
        resident.write_block_table(row, head.len(), tail).unwrap();
    }
    assert_eq!(resident.stage_resident(&batch).unwrap(), 12);
    let (a, b) = (build_and_read(&mut full), build_and_read(&mut resident));
    assert_eq!(a, b);
    // The HCA heads were really built from the tables: token 0's slice starts with block
    // `tables[0][0]`'s first compressed row whenever its context reaches a compressed row.
    let hca = &a[6];
    let hca_ptr = &a[7];
    if ctx[0] > 128 {
        assert_eq!(hca[hca_ptr[0] as usize], tables[0][0] * pool.geometry().unwrap().envelope_rows as i32);
    }
    // Refusals: a row past the capacity, a table past its columns, a foreign block, a dead position.
    assert!(matches!(resident.write_block_table(8, 0, &[1]), Err(DecodeError::TooManySeqs { .. })));
    assert!(matches!(resident.write_block_table(0, 39, &[1, 2]), Err(DecodeError::BlockTableTooLong { .. })));
    assert!(matches!(
        resident.write_block_table(0, 0, &[400]),
        Err(DecodeError::BadBlock { block: 400, .. })
    ));
    assert!(matches!(resident.write_block_table(0, 0, &[-1]), Err(DecodeError::BadBlock { block: -1, .. })));
    let dead = [DecodeSeq::new(live[0] - 1, 5, 1, &tables[0])];
    assert!(matches!(resident.stage_resident(&dead), Err(DecodeError::BadPosition { .. })));
}

#[test]
fn a_full_stage_refuses_foreign_block_ids() {
    let pool = pool(64);
    let mut path = pool.decode_path(cap(2, 2, 8)).unwrap();
    let live = pool.geometry().unwrap().live_positions();
    for bad in [64, -1, i32::MAX] {
        let table = [3, bad];
        let batch = [DecodeSeq::new(live.start, 300, 1, &table)];
        assert!(
            matches!(path.stage(&batch), Err(DecodeError::BadBlock { column: 1, .. })),
            "block {bad} accepted"
        );
    }
}

/// Issue 10 (3): contexts the buffers cannot index are refused — an `i64::MAX` context used
/// to pass (its block count wrapped negative) and stage a wrong indptr.
#[test]
fn stage_refuses_contexts_it_cannot_index() {
    let pool = pool(64);
    let mut path = pool.decode_path(cap(2, 4, 8)).unwrap();
    let live = pool.geometry().unwrap().live_positions();
    let table: Vec<i32> = (0..8).collect();
    for (ctx, tokens) in [(i64::MAX, 1), (i64::MAX - 1, 2), (8 * 256 + 1, 1), (-5, 1), (0, 1), (3, 4)] {
        let batch = [DecodeSeq::new(live.start, ctx, tokens, &table)];
        let r = path.stage(&batch);
        assert!(
            matches!(r, Err(DecodeError::ContextTooLong { .. } | DecodeError::BadSequence { .. })),
            "context {ctx} with {tokens} tokens: {r:?}"
        );
        assert!(
            matches!(
                path.stage_resident(&batch),
                Err(DecodeError::ContextTooLong { .. } | DecodeError::BadSequence { .. })
            ),
            "resident: context {ctx}"
        );
    }
    // Beyond the pool's blocks while the table's columns would allow it.
    let small = self::pool(4);
    let mut path = small.decode_path(cap(1, 1, 8)).unwrap();
    let small_live = small.geometry().unwrap().live_positions();
    let table = [0, 1, 2, 3, 0];
    let batch = [DecodeSeq::new(small_live.start, 4 * 256 + 1, 1, &table)];
    assert!(matches!(path.stage_resident(&batch), Err(DecodeError::ContextTooLong { limit: 1024, .. })));
    // The largest context the table covers is accepted, and its indptr is exact.
    let mut path = pool.decode_path(cap(1, 1, 8)).unwrap();
    let batch = [DecodeSeq::new(live.start, 8 * 256, 1, &table[..4])];
    assert!(path.stage(&batch).is_err(), "a table short of the context is refused");
    let full: Vec<i32> = (0..8).collect();
    let batch = [DecodeSeq::new(live.start, 8 * 256, 1, &full)];
    path.stage(&batch).unwrap();
    assert_eq!(path.read_i32(DecodeBuffer::Indptr(Class::Hca)).unwrap(), vec![0, 128 + 16]);
}

/// Issue 10 (3): two sequences of huge token counts used to wrap the token sum and panic on
/// a slice bound; now the sum is checked.
#[test]
fn huge_token_counts_are_refused_not_a_panic() {
    let pool = pool(64);
    let mut path = pool.decode_path(cap(4, 8, 8)).unwrap();
    let live = pool.geometry().unwrap().live_positions();
    let table = [0i32];
    let half = usize::MAX / 2 + 1;
    let batch = [
        DecodeSeq::new(live.start, i64::MAX, half, &table),
        DecodeSeq::new(live.start + 1, i64::MAX, half, &table),
    ];
    assert!(matches!(path.stage(&batch), Err(DecodeError::TooManyTokens { .. })));
    assert!(matches!(path.stage_resident(&batch), Err(DecodeError::TooManyTokens { .. })));
}

/// Issue 10 (3): `required_bytes` used to wrap for huge capacities and report a tiny size.
#[test]
fn required_bytes_overflow_is_an_error() {
    let pool = pool(64);
    let g = pool.geometry().unwrap();
    for c in [
        cap(usize::MAX, 1, 1),
        cap(1, 1, usize::MAX),
        cap(usize::MAX / 4, 1, usize::MAX / 4),
        cap(1 << 40, 1, 1 << 30),
    ] {
        let r = DecodePath::required_bytes(&g, c);
        assert!(matches!(r, Err(DecodeError::TooLarge { .. })), "{c:?}: {r:?}");
        assert!(matches!(
            DecodePath::required_bytes(&pool.spec().geometry, c),
            Err(DecodeError::TooLarge { .. })
        ));
        assert!(matches!(pool.decode_path(c), Err(DecodeError::TooLarge { .. })));
    }
    assert!(matches!(pool.decode_path(cap(1, 1, 1).with_index_topk(-1)), Err(DecodeError::NegativeTopk(-1))));
    let ok = DecodePath::required_bytes(&pool.spec().geometry, cap(8, 16, 40)).unwrap();
    assert_eq!(pool.decode_path(cap(8, 16, 40)).unwrap().device_bytes(), ok);
}

/// Tokens are the decode builder's grid y: a capacity past 65,535 tokens is refused when the
/// buffers are sized, not at the first launch.
#[test]
fn tokens_past_the_builder_grid_are_an_error() {
    let pool = pool(64);
    let g = pool.geometry().unwrap();
    assert!(DecodePath::required_bytes(&g, cap(1, 65_535, 1)).is_ok());
    for t in [65_536, usize::MAX] {
        let r = DecodePath::required_bytes(&g, cap(1, t, 1));
        assert!(
            matches!(r, Err(DecodeError::TokensPastGrid { max_tokens, limit: 65_535 }) if max_tokens == t),
            "{t}: {r:?}"
        );
        assert!(matches!(pool.decode_path(cap(1, t, 1)), Err(DecodeError::TokensPastGrid { .. })));
    }
}

/// A position freed by a boundary move between staging and the build is caught at build.
#[test]
fn build_rechecks_positions_after_the_boundary_moves() {
    let pool = pool(64);
    let mut path = pool.decode_path(cap(1, 1, 8)).unwrap();
    let lowest = pool.geometry().unwrap().live_positions().start;
    let table = [1i32];
    path.stage(&[DecodeSeq::new(lowest, 10, 1, &table)]).unwrap();
    path.build().unwrap();
    pool.shrink_slots(1).unwrap();
    assert!(matches!(path.build(), Err(DecodeError::BadPosition { position, .. }) if position == lowest));
}

/// The handle owns its memory: dropping it (and the pool) returns every byte.
#[test]
fn dropping_the_handles_frees_their_buffers() {
    let backend = Arc::new(HostBackend::new());
    let pool = pool_on(backend.clone(), vec![0, 4, 128], 8, 4);
    let before = backend.live_allocations();
    let path = pool.decode_path(cap(2, 2, 2)).unwrap();
    assert_eq!(backend.live_allocations(), before + 1);
    drop(path);
    assert_eq!(backend.live_allocations(), before);
    drop(pool);
    assert_eq!(backend.live_allocations(), 0);
}

// ---- the handles' outputs against the geometry ------------------------------------------

/// The first layer of `class` (window and compressed indices are relative to a layer's own
/// base, the same for every layer of a class).
fn layer_of(g: &v4pool::UnifiedPoolGeometry, class: Class) -> usize {
    g.class(class.ratio()).expect("class").layers[0]
}

fn window(
    g: &v4pool::UnifiedPoolGeometry,
    class: Class,
    slot: i64,
    positions: std::ops::Range<i64>,
) -> Vec<i32> {
    positions.map(|p| g.window_index(layer_of(g, class), slot, p % g.ring_slots).unwrap() as i32).collect()
}

/// Compressed row `e` of a class through a block table: block `table[e / rows]`, row `e % rows`.
fn compressed(g: &v4pool::UnifiedPoolGeometry, class: Class, table: &[i32], e: i64, rows: i64) -> i32 {
    let block = i64::from(table[(e / rows) as usize]);
    g.compress_index(layer_of(g, class), block, e % rows).unwrap() as i32
}

/// Top-k rows on the pool's backend: `[tokens][stride]`, row `t` selecting compressed CSA
/// rows `t, t+3, t+6, …` (each below its sequence's `ctx / 4`).
fn upload_topk(pool: &Pool, rows: &[Vec<i32>], stride: usize) -> v4pool::backend::DeviceAllocation {
    let mut flat = vec![-1i32; rows.len() * stride];
    for (t, r) in rows.iter().enumerate() {
        flat[t * stride..t * stride + r.len()].copy_from_slice(r);
    }
    let be = pool.backend();
    let a = be.alloc_zeroed(4 * flat.len() as u64).unwrap();
    // SAFETY: a fresh allocation of exactly these bytes.
    unsafe { be.upload(a.ptr, bytemuck::cast_slice(&flat), Stream::DEFAULT).unwrap() };
    a
}

#[test]
fn decode_path_writes_what_the_geometry_says() {
    let pool = pool(200);
    let g = pool.geometry().unwrap();
    let mut path = pool.decode_path(cap(4, 8, 24).with_index_topk(16)).unwrap();
    let live: Vec<i64> = g.live_positions().collect();
    let mut rng = Rng::new(99);
    // Contexts from 1 to the table's reach; one sequence with two tokens (an MTP verify).
    let ctx = [1i64, 300, 129 + rng.below(5000) as i64, 24 * 256];
    let ntok = [1usize, 2, 1, 3];
    let tables: Vec<Vec<i32>> =
        ctx.iter().map(|&c| (0..(c + 255) / 256).map(|_| rng.below(200) as i32).collect()).collect();
    let slots = [live[3], live[0], live[7], live[15]];
    let batch: Vec<DecodeSeq<'_>> =
        (0..4).map(|i| DecodeSeq::new(slots[i], ctx[i], ntok[i], &tables[i])).collect();
    assert_eq!(path.stage(&batch).unwrap(), 7);
    path.build().unwrap();
    // One row per token of the capacity (8): the pad's row is never read.
    let topk_rows: Vec<Vec<i32>> = (0..8).map(|t| (0..16).map(|k| t + 3 * k).collect()).collect();
    let topk = upload_topk(&pool, &topk_rows, 16);
    // SAFETY: `topk` is live memory of the pool's backend holding [max_tokens = 8][16]
    // non-negative i32.
    unsafe { path.csa_pack(topk.ptr, 16).unwrap() };
    let read = |b| path.read_i32(b).unwrap();
    let (rpb_hca, rpb_csa) = (g.block_size / 128, g.block_size / 4);
    let mut t = 0usize;
    for b in 0..4 {
        for k in 0..ntok[b] {
            let p = ctx[b] - ntok[b] as i64 + k as i64;
            let n = (p + 1).min(128);
            for c in Class::ALL {
                let (ptr, idx, dest) = (
                    read(DecodeBuffer::Indptr(c)),
                    read(DecodeBuffer::Indices(c)),
                    read(DecodeBuffer::DestRows(c)),
                );
                let slice = &idx[ptr[t] as usize..ptr[t + 1] as usize];
                let tail = window(&g, c, slots[b], p - n + 1..p + 1);
                assert_eq!(&slice[slice.len() - n as usize..], &tail[..], "class {c} token {t}: window tail");
                assert_eq!(dest[t], *tail.last().unwrap(), "class {c} token {t}: dest row");
                let head = &slice[..slice.len() - n as usize];
                match c {
                    Class::Dense => assert!(head.is_empty()),
                    Class::Hca => {
                        assert_eq!(
                            head.len() as i64,
                            ((p + 1) / 128).min(ctx[b] / 128),
                            "token {t}: HCA head"
                        );
                        for (e, &v) in head.iter().enumerate() {
                            assert_eq!(
                                v,
                                compressed(&g, c, &tables[b], e as i64, rpb_hca),
                                "token {t} HCA entry {e}"
                            );
                        }
                    }
                    Class::Csa => {
                        assert_eq!(
                            head.len() as i64,
                            ((p + 1) / 4).min(ctx[b] / 4).min(16),
                            "token {t}: CSA head"
                        );
                        for (e, &v) in head.iter().enumerate() {
                            let want = compressed(&g, c, &tables[b], i64::from(topk_rows[t][e]), rpb_csa);
                            assert_eq!(v, want, "token {t} CSA head {e}");
                        }
                    }
                }
            }
            t += 1;
        }
    }
    // Pads: batch id −1 and empty slices.
    assert_eq!(read(DecodeBuffer::BatchIds)[7], -1);
    let hp = read(DecodeBuffer::Indptr(Class::Hca));
    assert_eq!(hp[8], hp[7]);
    // SAFETY: the host backend ran the pack already; nothing uses the allocation.
    unsafe { pool.backend().free(topk) };
}

#[test]
fn prefill_path_writes_what_the_geometry_says() {
    use v4pool::pool::{PrefillBuffer, PrefillCapacity, PrefillSeq};
    let pool = pool(200);
    let g = pool.geometry().unwrap();
    let cap = PrefillCapacity::new(3, 700, 24, 128, 16);
    let mut path = pool.prefill_path(cap).unwrap();
    let live: Vec<i64> = g.live_positions().collect();
    // A fresh prompt, a chunk resumed mid-window, a chunk resumed deep in its context.
    let chunks = [(0i64, 200usize), (90, 60), (5000, 300)];
    let slots = [live[5], live[1], live[9]];
    let mut rng = Rng::new(7);
    let tables: Vec<Vec<i32>> = chunks
        .iter()
        .map(|&(cs, n)| (0..(cs + n as i64 + 255) / 256).map(|_| rng.below(200) as i32).collect())
        .collect();
    let batch: Vec<PrefillSeq<'_>> =
        (0..3).map(|i| PrefillSeq::new(slots[i], chunks[i].0, chunks[i].1, &tables[i])).collect();
    assert_eq!(path.stage(&batch).unwrap(), 560);
    path.build().unwrap();
    let topk_rows: Vec<Vec<i32>> = (0..560).map(|t| (0..16).map(|k| (t % 7) + k).collect()).collect();
    let topk = upload_topk(&pool, &topk_rows, 16);
    // SAFETY: `topk` holds [560 staged tokens][16] non-negative i32 on the pool's backend.
    unsafe { path.csa_pack(topk.ptr, 16).unwrap() };
    let read = |b| path.read_i32(b).unwrap();
    let (ext_ptr, ext) = (read(PrefillBuffer::ExtendIndptr), read(PrefillBuffer::ExtendIndices));
    let bufs: Vec<(Vec<i32>, Vec<i32>)> = Class::ALL
        .iter()
        .map(|&c| (read(PrefillBuffer::Indptr(c)), read(PrefillBuffer::Indices(c))))
        .collect();
    let (mut t, mut cu) = (0usize, 0i64);
    for b in 0..3 {
        let (cs, n) = chunks[b];
        let ctx = cs + n as i64;
        for p in cs..ctx {
            let low = (p - 127).max(0);
            let e = (p - cs + 1).min(128);
            let pre = (cs - low).max(0);
            let want_ext: Vec<i32> = (0..e).map(|k| (cu + (p - cs) - e + 1 + k) as i32).collect();
            assert_eq!(
                &ext[ext_ptr[t] as usize..ext_ptr[t + 1] as usize],
                &want_ext[..],
                "token {t}: extend"
            );
            for c in Class::ALL {
                let (ptr, idx) = &bufs[c.index()];
                let slice = &idx[ptr[t] as usize..ptr[t + 1] as usize];
                let win = window(&g, c, slots[b], low..low + pre);
                match c {
                    Class::Dense => assert_eq!(slice, &win[..], "token {t}: prefix_swa"),
                    Class::Csa => {
                        let head = ((p + 1) / 4).min(ctx / 4).min(16) as usize;
                        assert_eq!(slice.len(), head + pre as usize);
                        assert_eq!(&slice[head..], &win[..], "token {t}: CSA window tail");
                        for (k, &v) in slice[..head].iter().enumerate() {
                            let want =
                                compressed(&g, c, &tables[b], i64::from(topk_rows[t][k]), g.block_size / 4);
                            assert_eq!(v, want, "token {t}: CSA head {k}");
                        }
                    }
                    Class::Hca => {
                        let n_hca = ((p + 1) / 128).min(ctx / 128);
                        assert_eq!(slice.len() as i64, pre + n_hca);
                        assert_eq!(&slice[..pre as usize], &win[..], "token {t}: HCA window head");
                        for j in 0..n_hca {
                            let want = compressed(&g, c, &tables[b], j, g.block_size / 128);
                            assert_eq!(slice[(pre + j) as usize], want, "token {t}: HCA entry {j}");
                        }
                    }
                }
            }
            t += 1;
        }
        cu += n as i64;
    }
    // Refusals: over the tokens, a foreign block, a dead slot, a chunk past i32 positions.
    let over = [PrefillSeq::new(slots[0], 0, 701, &tables[2])];
    assert!(matches!(path.stage(&over), Err(DecodeError::TooManyTokens { .. })));
    let bad = [99999i32];
    let foreign = [PrefillSeq::new(slots[0], 0, 4, &bad)];
    assert!(matches!(path.stage(&foreign), Err(DecodeError::BadBlock { .. })));
    let dead = [PrefillSeq::new(live[0] - 1, 0, 4, &tables[0])];
    assert!(matches!(path.stage(&dead), Err(DecodeError::BadPosition { .. })));
    let huge = [PrefillSeq::new(slots[0], i64::MAX, 4, &tables[0])];
    assert!(matches!(path.stage(&huge), Err(DecodeError::BadSequence { .. })));
    // A bounded HCA buffer refuses a forward that needs more.
    let mut small = pool.prefill_path(cap.with_max_hca_entries(1000)).unwrap();
    assert!(matches!(small.stage(&batch), Err(DecodeError::BufferFull { .. })));
    // SAFETY: the host backend ran the pack already; nothing uses the allocation.
    unsafe { pool.backend().free(topk) };
}

/// Bindings hold the handles as `'static` objects and may move them across threads.
#[test]
fn handles_are_static_send_and_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<DecodePath>();
    check::<v4pool::pool::PrefillPath>();
    check::<Arc<Pool>>();
}
