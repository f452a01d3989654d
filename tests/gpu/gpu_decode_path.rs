//! The engine-facing index paths on the device: a `DecodePath` and a `PrefillPath` taken from
//! a pool on the GPU give, call for call, the same buffers as the same paths on a host pool
//! (the reference). Also the decode path captured once in a CUDA graph (its build and one
//! CSA pack per layer) and replayed over restaged batches, compared after every replay.

use crate::common;

use common::{case_seed, cuda_or_skip, device_or_skip, Rng};
use std::sync::Arc;
use v4pool::backend::{Backend, DeviceAllocation, Stream};
use v4pool::pool::{
    DecodeBuffer, DecodeCapacity, DecodePath, DecodeSeq, Pool, PrefillBuffer, PrefillCapacity, PrefillSeq,
};
use v4pool::Class;

const BLOCKS: i64 = 4100;
const SLOTS: i64 = 64;
const TOPK: usize = 512;

/// V4-Flash ratios, ring 129, 256-token blocks, 16-byte rows (the index paths never touch
/// the planes' bytes), on `backend`.
fn pool_on(backend: Arc<dyn Backend>) -> Arc<Pool> {
    common::index_pool(backend, common::flash_ratios(), BLOCKS, SLOTS)
}

/// A random decode batch: `bs` distinct live slots, contexts up to the table's reach, 1–2
/// tokens each (MTP verify), random blocks.
fn batch(rng: &mut Rng, pool: &Pool, bs: usize, max_blocks: usize) -> Vec<(i64, i64, usize, Vec<i32>)> {
    let live: Vec<i64> = pool.geometry().unwrap().live_positions().collect();
    let picks = rng.distinct(bs, live.len() as u64);
    picks
        .into_iter()
        .map(|i| {
            let ctx = common::batches::start_position(rng, (max_blocks * 256) as i64 - 2) + 2;
            let n = rng.range(1, 2) as usize;
            let table = (0..common::batches::columns(ctx)).map(|_| rng.below(BLOCKS as u64) as i32).collect();
            (live[i as usize], ctx, n, table)
        })
        .collect()
}

fn seqs(b: &[(i64, i64, usize, Vec<i32>)]) -> Vec<DecodeSeq<'_>> {
    b.iter().map(|(p, c, n, t)| DecodeSeq::new(*p, *c, *n, t)).collect()
}

/// Top-k rows `[tokens][TOPK]` of small non-negative values, on `be`.
fn topk_on(be: &dyn Backend, rows: &[i32]) -> DeviceAllocation {
    let a = be.alloc_zeroed(4 * rows.len() as u64).unwrap();
    // SAFETY: a fresh allocation of exactly these bytes.
    unsafe { be.upload(a.ptr, bytemuck::cast_slice(rows), Stream::DEFAULT).unwrap() };
    a
}

fn decode_buffers() -> Vec<DecodeBuffer> {
    let mut v = vec![DecodeBuffer::StateSlots, DecodeBuffer::BatchIds, DecodeBuffer::BlockTables];
    for c in Class::ALL {
        v.extend([DecodeBuffer::Indptr(c), DecodeBuffer::Indices(c), DecodeBuffer::DestRows(c)]);
    }
    v
}

fn assert_same_decode(dev: &DecodePath, host: &DecodePath, what: &str) {
    for b in decode_buffers() {
        assert_eq!(dev.read_i32(b).unwrap(), host.read_i32(b).unwrap(), "{what}: {b:?}");
    }
}

#[test]
fn decode_and_prefill_paths_match_the_host() {
    let Some(dev) = device_or_skip("decode_and_prefill_paths_match_the_host") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    let (dpool, hpool) = (pool_on(dev.clone()), pool_on(Arc::new(common::host())));
    let cap = DecodeCapacity::new(32, 64, 4000, 128, TOPK as i32);
    let (mut d, mut h) = (dpool.decode_path(cap).unwrap(), hpool.decode_path(cap).unwrap());
    for i in 0..4 {
        let mut rng = Rng::new(case_seed("decode-path", i));
        let bs = rng.range(1, 32) as usize;
        let b = batch(&mut rng, &dpool, bs, 4000);
        let s = seqs(&b);
        let resident = i % 2 == 1;
        if resident {
            for (row, (_, _, _, t)) in b.iter().enumerate() {
                d.write_block_table(row, 0, t).unwrap();
                h.write_block_table(row, 0, t).unwrap();
            }
            assert_eq!(d.stage_resident(&s).unwrap(), h.stage_resident(&s).unwrap());
        } else {
            assert_eq!(d.stage(&s).unwrap(), h.stage(&s).unwrap());
        }
        d.build().unwrap();
        h.build().unwrap();
        let rows: Vec<i32> = (0..64 * TOPK).map(|_| rng.below(64) as i32).collect();
        let (dt, ht) = (topk_on(dev.as_ref(), &rows), topk_on(hpool.backend().as_ref(), &rows));
        // SAFETY: both hold [max_tokens][TOPK] non-negative i32 on their path's backend.
        unsafe {
            d.csa_pack(dt.ptr, TOPK as i32).unwrap();
            h.csa_pack(ht.ptr, TOPK as i32).unwrap();
        }
        assert_same_decode(&d, &h, &format!("decode step {i} (resident tables: {resident})"));
        // SAFETY: the reads above synchronised both streams.
        unsafe {
            dev.free(dt);
            hpool.backend().free(ht);
        }
        println!("ok decode step {i}: {} tokens", d.staged_tokens());
    }

    let pcap = PrefillCapacity::new(8, 4096, 4000, 128, TOPK as i32).with_max_hca_entries(4096 * 4200);
    let (mut dp, mut hp) = (dpool.prefill_path(pcap).unwrap(), hpool.prefill_path(pcap).unwrap());
    let live: Vec<i64> = dpool.geometry().unwrap().live_positions().collect();
    for i in 0..3 {
        let mut rng = Rng::new(case_seed("prefill-path", i));
        let mut chunks = Vec::new();
        let mut tokens = 0;
        for s in 0..rng.range(1, 8) as usize {
            let n = rng.range(1, 1000) as usize;
            if tokens + n > 4096 {
                break;
            }
            tokens += n;
            let cs = if rng.chance(0.3) { 0 } else { common::batches::start_position(&mut rng, 900_000) };
            let table: Vec<i32> = (0..common::batches::columns(cs + n as i64))
                .map(|_| rng.below(BLOCKS as u64) as i32)
                .collect();
            chunks.push((live[s * 3], cs, n, table));
        }
        let batch: Vec<PrefillSeq<'_>> =
            chunks.iter().map(|(p, cs, n, t)| PrefillSeq::new(*p, *cs, *n, t)).collect();
        assert_eq!(dp.stage(&batch).unwrap(), hp.stage(&batch).unwrap());
        dp.build().unwrap();
        hp.build().unwrap();
        let rows: Vec<i32> = (0..tokens * TOPK).map(|_| rng.below(64) as i32).collect();
        let (dt, ht) = (topk_on(dev.as_ref(), &rows), topk_on(hpool.backend().as_ref(), &rows));
        // SAFETY: both hold [staged tokens][TOPK] non-negative i32 on their path's backend.
        unsafe {
            dp.csa_pack(dt.ptr, TOPK as i32).unwrap();
            hp.csa_pack(ht.ptr, TOPK as i32).unwrap();
        }
        let mut names =
            vec![PrefillBuffer::ExtendIndptr, PrefillBuffer::ExtendIndices, PrefillBuffer::SkipPrefix];
        for c in Class::ALL {
            names.extend([PrefillBuffer::Indptr(c), PrefillBuffer::Indices(c)]);
        }
        for b in names {
            assert_eq!(dp.read_i32(b).unwrap(), hp.read_i32(b).unwrap(), "prefill forward {i}: {b:?}");
        }
        // SAFETY: the reads above synchronised both streams.
        unsafe {
            dev.free(dt);
            hpool.backend().free(ht);
        }
        println!("ok prefill forward {i}: {tokens} tokens");
    }
}

/// Capture the decode step once (build + 21 per-layer packs over the one CSA buffer), then
/// restage new batches and replay: every replay equals the host path run eagerly.
#[test]
fn decode_path_graph_replays_restaged_batches() {
    let Some(cuda) = cuda_or_skip("decode_path_graph_replays_restaged_batches") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::new(cuda.clone());
    let (dpool, hpool) = (pool_on(dev.clone()), pool_on(Arc::new(common::host())));
    let cap = DecodeCapacity::new(64, 128, 4000, 128, TOPK as i32);
    let (mut d, mut h) = (dpool.decode_path(cap).unwrap(), hpool.decode_path(cap).unwrap());
    const LAYERS: usize = 21;
    let mut rng = Rng::new(case_seed("decode-path-graph", 0));
    let rows: Vec<i32> = (0..LAYERS * 128 * TOPK).map(|_| rng.below(64) as i32).collect();
    let (dt, ht) = (topk_on(dev.as_ref(), &rows), topk_on(hpool.backend().as_ref(), &rows));
    let layer_bytes = 4 * (128 * TOPK) as u64;
    let graph = {
        let capture = cuda.begin_capture(Stream::DEFAULT).unwrap();
        // SAFETY: the launches name the path's own buffers and the top-k allocation, which
        // outlive the graph (dropped below before either).
        unsafe {
            cuda.launch(&d.build_launch(), Stream::DEFAULT).unwrap();
            for l in 0..LAYERS as u64 {
                cuda.launch(
                    &d.csa_pack_launch(dt.ptr + l * layer_bytes, TOPK as i32).unwrap(),
                    Stream::DEFAULT,
                )
                .unwrap();
            }
        }
        capture.end().unwrap()
    };
    for step in 0..4 {
        let bs = rng.range(1, 64) as usize;
        let b = batch(&mut rng, &dpool, bs, 4000);
        let s = seqs(&b);
        d.stage(&s).unwrap();
        graph.replay(Stream::DEFAULT).unwrap();
        h.stage(&s).unwrap();
        h.build().unwrap();
        for l in 0..LAYERS as u64 {
            // SAFETY: the host copy of the same top-k, [LAYERS][max_tokens][TOPK].
            unsafe { h.csa_pack(ht.ptr + l * layer_bytes, TOPK as i32).unwrap() };
        }
        assert_same_decode(&d, &h, &format!("graph replay {step}"));
        println!("ok graph replay {step}: {} tokens", d.staged_tokens());
    }
    drop(graph);
    dev.synchronize(Stream::DEFAULT).unwrap();
    // SAFETY: the graph is gone and the stream drained.
    unsafe {
        dev.free(dt);
        hpool.backend().free(ht);
    }
}
