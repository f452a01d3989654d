//! The FlashMLA decode path (`Pool::flashmla_decode_path`) on the host backend: a layer's
//! operands are the CSR path's slices of the same batch, reordered into FlashMLA's rows (window
//! tail → `indices`, HCA head → `extra_indices`, the CSA pack's head → the CSA `extra_indices`),
//! each + the layer's `page_view` shift, −1 to the row's limit, pads −1 with length 0; the
//! views follow the shifts (CSA one; HCA one per layer in FlashMLA's 64-row pages, one in all in
//! `flashmla-v4-p2`'s 2-row pages); bad widths are typed errors.

use crate::common;

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Stream;
use v4pool::pool::{
    DecodeBuffer, DecodeCapacity, DecodeError, DecodeSeq, DeviceBuffer, FlashMlaWidths, Pool,
};
use v4pool::{Class, VariantName};

fn pool() -> Arc<Pool> {
    common::index_pool(Arc::new(HostBackend::new()), common::flash_ratios(), 300, 8)
}

fn cap() -> DecodeCapacity {
    DecodeCapacity::new(4, 8, 40, 128, 512)
}

#[test]
fn flashmla_rows_are_the_csr_slices_shifted() {
    // A pool from parts (no row format): FlashMLA's V4 pages of 64, 20 HCA page shifts.
    rows_are_the_csr_slices_shifted(pool(), 20);
}

#[test]
fn flashmla_v4_p2_rows_share_one_hca_view() {
    // V4-Flash in `flashmla-v4-p2` at MTP 1 (ring 129): every HCA layer at one page shift, so
    // one HCA operand serves all 20 layers; its rows are the CSR path's, shifted.
    use v4pool::model::ModelShape;
    use v4pool::pool::PoolSpec;
    use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};
    let model = ModelShape::v4_flash(1).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::FlashMlaV4P2, IndexerDtype::Fp8, 8, 400 << 20)).unwrap();
    let spec = PoolSpec::from_plan(&p).unwrap();
    assert_eq!(spec.kernel_page_rows(), 2);
    rows_are_the_csr_slices_shifted(
        Arc::new(Pool::new(Arc::new(HostBackend::new()), spec, Stream::DEFAULT).unwrap()),
        1,
    );
}

/// The FlashMLA path's operands on `pool` against its CSR path's slices of the same batch;
/// `hca_views` distinct HCA operands.
fn rows_are_the_csr_slices_shifted(pool: Arc<Pool>, hca_views_want: usize) {
    let g = pool.geometry().unwrap();
    let widths = FlashMlaWidths::for_capacity(&g, cap()).unwrap();
    assert_eq!((widths.topk, widths.csa_extra_topk, widths.hca_extra_topk), (128, 512, 128));
    let mut csr = pool.decode_path(cap()).unwrap();
    let mut fm = pool.flashmla_decode_path(cap(), widths).unwrap();
    let mut rng = common::Rng::new(0xf1a5_9a70);
    let live: Vec<i64> = g.live_positions().collect();
    let ctx: Vec<i64> = vec![3, 40 * 256, 5_000, 9_999];
    let tables: Vec<Vec<i32>> = ctx
        .iter()
        .map(|&c| (0..(c + 255) / 256).map(|_| rng.below(g.num_blocks as u64) as i32).collect())
        .collect();
    let batch: Vec<DecodeSeq<'_>> =
        (0..4).map(|i| DecodeSeq::new(live[i + 1], ctx[i], 1 + i % 2, &tables[i])).collect();
    let tokens = csr.stage(&batch).unwrap();
    assert_eq!(fm.stage(&batch).unwrap(), tokens);
    csr.build().unwrap();
    fm.build().unwrap();
    // One top-k for the CSA packs, transformers-style: [valid ids | -1].
    let t_max = cap().max_tokens;
    let heads = csr.staged_csa_heads().to_vec();
    let mut topk = vec![-1i32; t_max * 512];
    for (t, &[head, entries]) in heads.iter().enumerate() {
        for k in 0..head as usize {
            topk[t * 512 + k] = rng.below(entries.max(1) as u64) as i32;
        }
    }
    let backend = pool.backend();
    let dev = backend.alloc_zeroed(4 * topk.len() as u64).unwrap();
    // SAFETY: `dev` is a live allocation of the top-k's length on the pool's backend.
    unsafe { backend.upload(dev.ptr, bytemuck::cast_slice(&topk), Stream::DEFAULT).unwrap() };
    // SAFETY: the top-k buffer is live, [max_tokens][512], valid where the pack reads it.
    unsafe {
        csr.csa_pack(dev.ptr, 512).unwrap();
        fm.csa_pack(dev.ptr, 512).unwrap();
    }
    // Each live token's position (sequences in order, their tokens the context's last ones).
    let pos: Vec<i64> = batch
        .iter()
        .flat_map(|s| (0..s.num_tokens as i64).map(move |k| s.context_len - s.num_tokens as i64 + k))
        .collect();
    let read = |c: Class, b: fn(Class) -> DecodeBuffer| csr.read_i32(b(c)).unwrap();
    let (mut hca_views, mut csa_views) =
        (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    for layer in 0..g.num_layers {
        let class = g.layer_slot(layer).unwrap();
        let ops = fm.flashmla(layer).unwrap();
        let shift = pool.page_view(layer, 0, pool.spec().kernel_page_rows()).unwrap().row_shift as i32;
        assert_eq!(ops.shift, shift, "layer {layer}");
        match class {
            Class::Hca => hca_views.insert(ops.indices.ptr),
            Class::Csa => csa_views.insert(ops.indices.ptr),
            Class::Dense => true,
        };
        let (ix, len) = (fm.read_flashmla(ops.indices).unwrap(), fm.read_flashmla(ops.topk_length).unwrap());
        let extra = ops.extra_indices.map(|b| fm.read_flashmla(b).unwrap());
        let extra_len = ops.extra_topk_length.map(|b| fm.read_flashmla(b).unwrap());
        // FlashMLA's per-batch-entry lengths: each sequence's longest token, pads 0.
        let longest = |per_token: &[i32]| -> Vec<i32> {
            let mut out = vec![0i32; cap().max_seqs];
            let mut t = 0;
            for (b, s) in batch.iter().enumerate() {
                out[b] = per_token[t..t + s.num_tokens].iter().copied().max().unwrap();
                t += s.num_tokens;
            }
            out
        };
        assert_eq!(fm.read_flashmla(ops.seq_topk_length).unwrap(), longest(&len), "layer {layer}");
        if let (Some(b), Some(el)) = (ops.seq_extra_topk_length, &extra_len) {
            assert_eq!(fm.read_flashmla(b).unwrap(), longest(el), "layer {layer}: seq_extra_topk_length");
        }
        let (indices, indptr) = (read(class, DecodeBuffer::Indices), read(class, DecodeBuffer::Indptr));
        for t in 0..t_max {
            let slice = &indices[indptr[t] as usize..indptr[t + 1] as usize];
            let n = if t < tokens { (pos[t] + 1).min(128) as usize } else { 0 };
            assert_eq!(len[t] as usize, n, "layer {layer} token {t}: topk_length");
            let want_window: Vec<i32> = slice[slice.len() - n..].iter().map(|r| r + shift).collect();
            let row = &ix[t * 128..(t + 1) * 128];
            assert_eq!(&row[..n], &want_window[..], "layer {layer} token {t}: window");
            assert!(row[n..].iter().all(|&x| x == -1), "layer {layer} token {t}: -1 tail");
            let (Some(extra), Some(extra_len)) = (&extra, &extra_len) else { continue };
            let head: Vec<i32> = slice[..slice.len() - n].iter().map(|r| r + shift).collect();
            let w = ops.extra_topk as usize;
            assert_eq!(extra_len[t] as usize, head.len(), "layer {layer} token {t}: extra_topk_length");
            assert_eq!(&extra[t * w..t * w + head.len()], &head[..], "layer {layer} token {t}: compressed");
            // −1 to the row's limit (HCA: the first multiple of 64 past the head; CSA: the
            // width); past it the row is not written (index-buffers.md §3f).
            let limit = if class == Class::Hca {
                v4pool::raw::index::shape::flashmla_row_limit(head.len() as i64, w as i64) as usize
            } else {
                w
            };
            assert!(
                extra[t * w + head.len()..t * w + limit].iter().all(|&x| x == -1),
                "layer {layer} token {t}"
            );
        }
    }
    // The next build resets the CSA compressed part: no rows until the layer's pack.
    fm.build().unwrap();
    let layer = (0..g.num_layers).find(|&l| g.layer_slot(l).ok() == Some(Class::Csa)).unwrap();
    let ops = fm.flashmla(layer).unwrap();
    assert!(fm.read_flashmla(ops.extra_indices.unwrap()).unwrap().iter().all(|&x| x == -1));
    assert!(fm.read_flashmla(ops.extra_topk_length.unwrap()).unwrap().iter().all(|&x| x == 0));
    assert_eq!(hca_views.len(), hca_views_want, "one HCA view per distinct page shift");
    assert_eq!(csa_views.len(), 1, "the CSA layers share one shift");
    assert!(fm.read_i32(DecodeBuffer::Indices(Class::Csa)).is_err(), "no CSR buffers in FlashMLA mode");
    // SAFETY: no launch uses the top-k any more (the packs ran on the pool's stream; drained).
    unsafe { backend.free(dev) };
}

#[test]
fn bad_widths_are_typed_errors() {
    let pool = pool();
    let g = pool.geometry().unwrap();
    let ok = FlashMlaWidths::for_capacity(&g, cap()).unwrap();
    let cases = [
        (FlashMlaWidths::new(100, ok.csa_extra_topk, ok.hca_extra_topk), "FlashMlaWidth"),
        (FlashMlaWidths::new(64, ok.csa_extra_topk, ok.hca_extra_topk), "FlashMlaTooNarrow"),
        (FlashMlaWidths::new(ok.topk, 448, ok.hca_extra_topk), "FlashMlaTooNarrow"),
        (FlashMlaWidths::new(ok.topk, ok.csa_extra_topk, 0), "FlashMlaWidth"),
        (FlashMlaWidths::new(ok.topk, ok.csa_extra_topk, 64), "FlashMlaTooNarrow"),
    ];
    for (w, want) in cases {
        let e = pool.flashmla_decode_path(cap(), w).unwrap_err();
        assert_eq!(e.variant_name(), want, "{w:?}: {e}");
    }
    let csr = pool.decode_path(cap()).unwrap();
    assert!(matches!(csr.flashmla(2), Err(DecodeError::NoFlashMla { .. })));
}

/// defect43 row 10: `read_flashmla` of a buffer whose length times 4 wraps (`u64::MAX / 4 + 1`
/// elements) read 0 bytes and answered `Ok([])`; any buffer that is not inside the path's own
/// memory (a length past it, an address before or after it) is `OutOfRange`,
/// before anything is allocated for it; 8-byte elements are `NotI32`.
#[test]
fn read_flashmla_refuses_buffers_outside_the_path() {
    let pool = pool();
    let g = pool.geometry().unwrap();
    let fm = pool.flashmla_decode_path(cap(), FlashMlaWidths::for_capacity(&g, cap()).unwrap()).unwrap();
    let ops = fm.flashmla(2).unwrap();
    assert_eq!(fm.read_flashmla(ops.topk_length).unwrap().len(), cap().max_tokens);
    let b = ops.indices;
    let cases = [
        ("a length whose bytes wrap", DeviceBuffer { len: u64::MAX / 4 + 1, ..b }),
        ("the largest length", DeviceBuffer { len: u64::MAX, ..b }),
        ("a length past the path's memory", DeviceBuffer { len: fm.device_bytes() / 4 + 1, ..b }),
        ("an address before it", DeviceBuffer { ptr: b.ptr - (1 << 20), ..b }),
        ("an address after it", DeviceBuffer { ptr: b.ptr + fm.device_bytes(), len: 1, ..b }),
    ];
    for (what, buf) in cases {
        match fm.read_flashmla(buf) {
            Err(e) => assert_eq!(e.variant_name(), "OutOfRange", "{what}: {e}"),
            Ok(v) => panic!("{what}: read {} values", v.len()),
        }
    }
    let e = fm.read_flashmla(DeviceBuffer { elem_bytes: 8, ..b }).unwrap_err();
    assert_eq!(e.variant_name(), "NotI32", "8-byte elements: {e}");
}
