//! Decode staging: with resident block tables (`stage_resident` + `write_block_table`) the
//! decode builder produces exactly what a full `stage` does, and bad batches are refused.

use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::index::{CLASS_CSA, CLASS_DENSE, CLASS_HCA};
use v4pool::pool::{DecodeCapacity, DecodeError, DecodeIndexBuffers, DecodeSeq};
use v4pool::GeometrySpec;

fn read_i32(host: &HostBackend, ptr: u64, n: u64) -> Vec<i32> {
    let mut bytes = vec![0u8; 4 * n as usize];
    // SAFETY: the range is one of the decode buffers' own, of `n` i32.
    unsafe { host.download(&mut bytes, ptr, Stream::DEFAULT).unwrap() };
    bytemuck::cast_slice(&bytes).to_vec()
}

#[test]
fn resident_tables_build_the_same_indices_as_full_staging() {
    let mut ratios = vec![0, 0];
    for _ in 0..20 {
        ratios.extend([4, 128]);
    }
    ratios.extend([4, 0]);
    let g = GeometrySpec::new(ratios, 4000, 16, 129, 256).build().unwrap();
    let cap = DecodeCapacity {
        max_seqs: 8,
        max_tokens: 16,
        max_blocks_per_seq: 40,
        win: 128,
        index_topk: 512,
        csa_layers: 1,
    };
    let host = HostBackend::new();
    let mut full = DecodeIndexBuffers::new(&host, &g, cap).unwrap();
    let mut resident = DecodeIndexBuffers::new(&host, &g, cap).unwrap();
    let live: Vec<i64> = g.live_positions().collect();
    let mut x = 12345u64;
    let mut rnd = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let ctx: Vec<i64> = (0..6).map(|_| 1 + rnd(40 * 256 - 2) as i64).collect();
    let tables: Vec<Vec<i32>> =
        ctx.iter().map(|&c| (0..(c + 255) / 256).map(|_| rnd(4000) as i32).collect()).collect();
    let batch: Vec<DecodeSeq<'_>> = (0..6)
        .map(|i| DecodeSeq {
            position: live[i * 2],
            context_len: ctx[i],
            num_tokens: 2,
            block_table: &tables[i],
        })
        .collect();
    full.stage(&host, &batch, Stream::DEFAULT).unwrap();
    for (row, t) in tables.iter().enumerate() {
        // An entering sequence's table in two writes: all but its last block, then the last.
        let (head, tail) = t.split_at(t.len() - 1);
        resident.write_block_table(&host, row, 0, head, Stream::DEFAULT).unwrap();
        resident.write_block_table(&host, row, head.len(), tail, Stream::DEFAULT).unwrap();
    }
    resident.stage_resident(&host, &batch, Stream::DEFAULT).unwrap();
    for bufs in [&full, &resident] {
        for c in [CLASS_DENSE, CLASS_CSA, CLASS_HCA] {
            let (ptr, n) = bufs.indices(c, 0);
            // Poison every output first so unwritten cells would differ from the other run.
            // SAFETY: the buffer is the decode buffers' own, of `n` i32.
            unsafe { host.fill_u32(ptr, n, 0xdead_beef, Stream::DEFAULT).unwrap() };
        }
        // SAFETY: the launch's pointers are the decode buffers' own.
        unsafe { host.launch(&bufs.launch(), Stream::DEFAULT).unwrap() };
    }
    for c in [CLASS_DENSE, CLASS_CSA, CLASS_HCA] {
        let (pa, n) = full.indices(c, 0);
        let (pb, _) = resident.indices(c, 0);
        let a = read_i32(&host, pa, n);
        assert_eq!(a, read_i32(&host, pb, n), "class {c}");
        // The HCA heads were really built from the tables (not left poisoned).
        if c == CLASS_HCA {
            assert!(a.iter().any(|&v| v != 0xdead_beefu32 as i32));
        }
        assert_eq!(read_i32(&host, full.dest_rows(c), 16), read_i32(&host, resident.dest_rows(c), 16));
    }
    // Refusals: a row past the capacity, a table past its columns, a dead position.
    assert!(matches!(
        resident.write_block_table(&host, 8, 0, &[1], Stream::DEFAULT),
        Err(DecodeError::TooManySeqs { .. })
    ));
    assert!(matches!(
        resident.write_block_table(&host, 0, 39, &[1, 2], Stream::DEFAULT),
        Err(DecodeError::BlockTableTooLong { .. })
    ));
    let dead = [DecodeSeq { position: live[0] - 1, context_len: 5, num_tokens: 1, block_table: &tables[0] }];
    assert!(matches!(
        resident.stage_resident(&host, &dead, Stream::DEFAULT),
        Err(DecodeError::BadPosition { .. })
    ));
    // SAFETY: nothing queued uses the buffers (the host backend runs work immediately).
    unsafe {
        full.release(&host);
        resident.release(&host);
    }
}

/// With one translate-pack launch for several CSA layers, every layer's copy of the CSA
/// buffer ends up a whole slice: its own top-k head and the shared window tail.
#[test]
fn batched_csa_pack_leaves_every_layer_a_whole_slice() {
    let mut ratios = vec![0, 0];
    for _ in 0..20 {
        ratios.extend([4, 128]);
    }
    ratios.extend([4, 0]);
    let g = GeometrySpec::new(ratios, 4000, 16, 128, 256).build().unwrap();
    let layers = 3usize;
    let cap = DecodeCapacity {
        max_seqs: 4,
        max_tokens: 4,
        max_blocks_per_seq: 40,
        win: 128,
        index_topk: 64,
        csa_layers: layers,
    };
    let host = HostBackend::new();
    let mut bufs = DecodeIndexBuffers::new(&host, &g, cap).unwrap();
    let live: Vec<i64> = g.live_positions().collect();
    let tables: Vec<Vec<i32>> = (0..4).map(|s| (0..40).map(|j| (s * 40 + j) as i32).collect()).collect();
    let ctx = [3000i64, 9000, 200, 10_000];
    let batch: Vec<DecodeSeq<'_>> = (0..4)
        .map(|i| DecodeSeq { position: live[i], context_len: ctx[i], num_tokens: 1, block_table: &tables[i] })
        .collect();
    bufs.stage(&host, &batch, Stream::DEFAULT).unwrap();
    let (csa, per_copy) = bufs.indices(CLASS_CSA, 0);
    let stride = bufs.indices(CLASS_CSA, 1).0 - csa;
    // Poison all copies, then the decode build and one pack over all layers.
    // SAFETY: the copies lie in the decode buffers' CSA region.
    unsafe { host.fill_u32(csa, stride / 4 * layers as u64, 0xdead_beef, Stream::DEFAULT).unwrap() };
    // Top-k per layer: layer l selects compressed rows l, l+1, … (distinct per layer).
    let topk: Vec<i32> = (0..layers * 4 * 64).map(|i| ((i / 256) + (i % 64)) as i32).collect();
    let topk_alloc = host.alloc_zeroed((topk.len() * 4) as u64).unwrap();
    // SAFETY: fresh allocation of exactly this size; launches use the decode buffers' own
    // pointers and the top-k buffer.
    unsafe {
        host.upload(topk_alloc.ptr, bytemuck::cast_slice(&topk), Stream::DEFAULT).unwrap();
        host.launch(&bufs.launch(), Stream::DEFAULT).unwrap();
        host.launch(
            &v4pool::index::Launch::CsaPack(bufs.csa_pack_args(topk_alloc.ptr, 64, layers)),
            Stream::DEFAULT,
        )
        .unwrap();
    }
    let indptr = read_i32(&host, bufs.indptr(CLASS_CSA), 5);
    let copies: Vec<Vec<i32>> =
        (0..layers as u64).map(|l| read_i32(&host, csa + l * stride, per_copy)).collect();
    for (l, copy) in copies.iter().enumerate() {
        let live_end = indptr[4] as usize;
        assert!(
            copy[..live_end].iter().all(|&v| v != 0xdead_beefu32 as i32),
            "layer {l} has unwritten cells"
        );
        for t in 0..4 {
            let (b, e) = (indptr[t] as usize, indptr[t + 1] as usize);
            let n = 128.min(ctx[t] as usize);
            assert_eq!(copy[e - n..e], copies[0][e - n..e], "layer {l} token {t}: window tail");
            if l > 0 && e - n > b {
                assert_ne!(copy[b..e - n], copies[0][b..e - n], "layer {l} token {t}: head is layer 0's");
            }
        }
    }
    // SAFETY: nothing queued uses them (the host backend runs work immediately).
    unsafe {
        host.free(topk_alloc);
        bufs.release(&host);
    }
}
