//! A whole decode step as an engine writes it, on the host backend: plan a pool for a
//! budget, carve it, give three sequences a slot and their blocks, take the pool's decode
//! path, stage the batch, build the index buffers, and read a few entries back to check
//! them against the geometry. No `unsafe`, no live-range bookkeeping: the path reads the
//! pool's live slots and blocks itself, owns its buffers and frees them on drop.
//!
//! Run: `cargo run --release --example decode_step`.

use std::error::Error;
use std::sync::Arc;
use v4pool::prelude::*;

fn main() -> Result<(), Box<dyn Error>> {
    // 1. Plan: V4-Flash with one MTP draft (ring 129), fp8 KV, 8 sequences in 2 GiB.
    let model = ModelShape::v4_flash(1)?;
    let plan = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 8, 2 << 30))?;

    // 2. The pool on a backend and the engine's stream (here the host backend).
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let pool = Arc::new(Pool::new(backend, PoolSpec::from_plan(&plan)?, Stream::DEFAULT)?);
    let g = pool.geometry()?;

    // 3. Sequences: a slot each (its compressor state initialised) and the blocks their
    //    contexts need. The block table is the engine's: logical block → physical id.
    let contexts = [37i64, 1000, 5000];
    let mut seqs = Vec::new();
    for &ctx in &contexts {
        let slot = pool.alloc_slot()?;
        let handles: Vec<_> = (0..(ctx + g.block_size - 1) / g.block_size)
            .map(|_| pool.alloc_block().map(|b| b.handle))
            .collect::<Result<_, _>>()?;
        let table: Vec<i32> = handles.iter().map(|h| h.id as i32).collect();
        seqs.push((slot, ctx, table, handles));
    }

    // 4. The decode path: buffers at fixed addresses, sized once for the largest batch
    //    (graph-capturable), on the pool's backend and stream.
    // 8 sequences of 16 tokens (1 token + 1 MTP draft each), 64 block-table columns, window
    // 128, index top-k 512.
    let mut path = pool.decode_path(DecodeCapacity::new(8, 16, 64, 128, 512))?;

    // 5. One step: stage the batch (metadata + block tables), then one build launch.
    let batch: Vec<DecodeSeq<'_>> =
        seqs.iter().map(|(slot, ctx, blocks, _)| DecodeSeq::new(slot.position, *ctx, 1, blocks)).collect();
    let tokens = path.stage(&batch)?;
    path.build()?;
    // Per CSA layer, after its indexer: `unsafe { path.csa_pack(topk_ptr, stride) }` fills
    // the CSA heads from the indexer's top-k (the one call that takes an engine pointer).

    // 6. Attention reads the index buffers at fixed addresses...
    for c in Class::ALL {
        let buf = path.indices(c).expect("V4-Flash has every class");
        println!("{c:>5} indices at {:#x}, {} i32", buf.ptr, buf.len);
    }
    // ...and here we read a few back and check them against the geometry.
    let hca_layer = g.class(Class::Hca.ratio()).expect("hca").layers[0];
    let ptr = path.read_i32(DecodeBuffer::Indptr(Class::Hca))?;
    let hca = path.read_i32(DecodeBuffer::Indices(Class::Hca))?;
    let dest = path.read_i32(DecodeBuffer::DestRows(Class::Hca))?;
    for (t, (slot, ctx, blocks, _)) in seqs.iter().enumerate() {
        let pos = ctx - 1; // the token this step decodes
        let slice = &hca[ptr[t] as usize..ptr[t + 1] as usize];
        let head = (pos + 1) / 128; // HCA compressed rows it attends (causal)
        let window = (pos + 1).min(128);
        assert_eq!(slice.len() as i64, head + window, "token {t}: HCA slice length");
        // Compressed entry e sits in block blocks[e / 2], row e % 2 (two HCA rows a block).
        for e in 0..head {
            let want = g.compress_index(hca_layer, i64::from(blocks[(e / 2) as usize]), e % 2)?;
            assert_eq!(i64::from(slice[e as usize]), want, "token {t}: HCA entry {e}");
        }
        // The window ends with the token's own row, which is also where its KV is written.
        let own = g.window_index(hca_layer, slot.position, pos % g.ring_slots)?;
        assert_eq!(i64::from(*slice.last().expect("window")), own);
        assert_eq!(i64::from(dest[t]), own);
        println!(
            "token {t}: context {ctx}, HCA slice of {} = {head} compressed + {window} window rows: ok",
            slice.len()
        );
    }
    println!("decode step: {tokens} tokens indexed, {} bytes of index buffers", path.device_bytes());

    // 7. Sequences finish: blocks and slots go back; the path frees its buffers on drop.
    drop(path);
    for (slot, _, _, handles) in seqs {
        for h in handles {
            pool.free_block(h)?;
        }
        pool.free_slot(slot.handle)?;
    }
    Ok(())
}
