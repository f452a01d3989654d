//! FlashMLA's index convention (index-buffers.md §3f, §5f) on CUDA against the host reference:
//! the decode builder's FlashMLA rows (every class; 20 HCA views as V4-Flash has in 64-row pages,
//! and the one view of `flashmla-v4-p2`'s 2-row pages) and the CSA
//! translate-pack's FlashMLA rows, at V4-Flash / V4-Pro shapes, every buffer compared whole with
//! its poisoned slack (an HCA row's entries past its limit stay the poison on both). Skips without a device unless `V4POOL_REQUIRE_GPU=1`.

use crate::common;
use crate::flashmla_common;

use common::{case_seed, check_case, device_or_skip, models, Rng};
use flashmla_common::{FlashDecode, FlashPack};

#[test]
fn decode_builder_flashmla_rows_match_host() {
    let Some(cuda) = device_or_skip("decode_builder_flashmla_rows_match_host") else {
        return;
    };
    for (model, ratios) in models() {
        let seed = case_seed("flashmla-decode-geometry", model.len() as u64);
        let g = common::big_geometry(&mut Rng::new(seed), &ratios);
        let hca_layers = ratios.iter().filter(|&&r| r == 128).count();
        // One HCA view per layer (64-row pages) and one in all (2-row pages, flashmla-v4-p2).
        let shapes = [1usize, 64, 256].into_iter().flat_map(|bs| [(bs, hca_layers), (bs, 1)]);
        for (i, (bs, views)) in shapes.enumerate() {
            let seed = case_seed(&format!("flashmla-decode-{model}"), i as u64);
            let mut rng = Rng::new(seed);
            let d = FlashDecode::random(&mut rng, &g, bs, 1_000_000, views);
            let name = format!("flashmla decode {model} bs={bs} HCA views {views} T={}", d.batch.bid.len());
            let (case, _, make) = d.case(&name, seed, true);
            check_case(&*cuda, &case, &make);
            println!("ok {name} ({} MB)", case.total_bytes() >> 20);
        }
        // MTP tokens whose HCA heads straddle a multiple of 64: the row limit's edge.
        let seed = case_seed(&format!("flashmla-decode-edge-{model}"), 0);
        let d = FlashDecode::mtp_edge(&mut Rng::new(seed), &g, 64, hca_layers);
        let name = format!("flashmla decode {model} MTP edge T={}", d.batch.bid.len());
        let (case, _, make) = d.case(&name, seed, true);
        check_case(&*cuda, &case, &make);
        println!("ok {name}");
    }
}

#[test]
fn csa_pack_flashmla_rows_match_host() {
    let Some(cuda) = device_or_skip("csa_pack_flashmla_rows_match_host") else {
        return;
    };
    for (model, ratios) in models() {
        let seed = case_seed("flashmla-pack-geometry", model.len() as u64);
        let g = common::big_geometry(&mut Rng::new(seed), &ratios);
        for (i, (bs, topk)) in [(1usize, 512i64), (64, 512), (256, 1024), (32, 2048)].into_iter().enumerate()
        {
            let seed = case_seed(&format!("flashmla-pack-{model}"), i as u64);
            let mut rng = Rng::new(seed);
            let p = FlashPack::random(&mut rng, &g, bs, 1_000_000, topk);
            let name = format!("flashmla pack {model} bs={bs} topk={topk}");
            let (case, _, make) = p.case(&name, seed);
            check_case(&*cuda, &case, &make);
            println!("ok {name}");
        }
    }
}
