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
