//! The host reference of FlashMLA's index convention (index-buffers.md §3f, §5f) against the
//! convention written out independently (`flashmla_common::FlashDecode::expected`,
//! `FlashPack::expected`), on random geometries, batches and views with poisoned outputs: the
//! whole of every FlashMLA buffer (every entry to the row's limit as the convention says, the
//! poison past it and in the slack untouched), what FlashMLA reads of the rows with one length
//! per batch entry, and the CSR part of a launch with FlashMLA outputs byte-identical to the
//! same launch without them.

use crate::common;
use crate::flashmla_common;

use common::{geometry_at, Rng};
use flashmla_common::{flashmla_reads, run_in_memory, words, FlashDecode, FlashPack};
use v4pool::raw::index::host::run_launch;
use v4pool::raw::index::Launch;

fn reference(l: &Launch) {
    // SAFETY: the case's buffers are live and sized for the launch (flashmla_common).
    unsafe { run_launch(l) }.unwrap_or_else(|e| panic!("host reference refused: {e}"));
}

fn random_ratios(rng: &mut Rng) -> Vec<i32> {
    let mut r: Vec<i32> = (0..rng.range(2, 9)).map(|_| rng.pick(&[0, 4, 128])).collect();
    r.extend([4, 128]);
    r
}

#[test]
fn decode_builder_writes_flashmla_rows_by_the_convention() {
    let mut rng = Rng::new(0xf1a5_4d1a_0000_0001);
    let mut pads = 0;
    for case_no in 0..40 {
        let ratios = random_ratios(&mut rng);
        let g = geometry_at(&ratios, rng.range(128, 133), rng.range(60_000, 400_000), rng.range(4, 12));
        let views = rng.range(1, 5) as usize;
        let (bs, max_pos) = (rng.range(1, 4) as usize, rng.range(100, 20_000));
        let mut d = FlashDecode::random(&mut rng, &g, bs, max_pos, views);
        // Now and then a negative block id (a raw launch's): its entries are -1 (§3f).
        if case_no % 4 == 1 {
            common::batches::negative_ids(&mut rng, &mut d.batch.tables, 1);
        }
        pads += d.batch.bid.iter().filter(|&&b| b < 0).count();
        let name = format!("flash decode {case_no}");
        let (case, bufs, make) = d.case(&name, 0, true);
        let out = run_in_memory(&case, &make, &reference);
        let (csr_case, csr_bufs, csr_make) = d.case(&name, 0, false);
        let csr_out = run_in_memory(&csr_case, &csr_make, &reference);
        for c in 0..3 {
            let (Some(b), Some(cb)) = (bufs[c], csr_bufs[c]) else { continue };
            let [ix, len, ex, exlen] = d.expected(c);
            assert_eq!(words(&out[b.indices.unwrap()]), ix, "{name}: class {c} indices");
            assert_eq!(words(&out[b.topk_length.unwrap()]), len, "{name}: class {c} topk_length");
            if let Some(e) = b.extra {
                assert_eq!(words(&out[e]), ex, "{name}: class {c} extra_indices");
                assert_eq!(
                    words(&out[b.extra_length.unwrap()]),
                    exlen,
                    "{name}: class {c} extra_topk_length"
                );
            } else {
                assert!(ex.is_empty(), "{name}: class {c} has a compressed part the case lacks");
            }
            // The CSR part and the dest rows: as the same launch in CSR mode writes them.
            assert_eq!(out[b.dest], csr_out[cb.dest], "{name}: class {c} dest rows");
            if let Some(i) = b.csr {
                assert_eq!(out[i], csr_out[cb.csr.unwrap()], "{name}: class {c} CSR indices");
            }
        }
    }
    assert!(pads > 20, "only {pads} pad tokens: the pad rule went untested");
}

/// What FlashMLA reads of the HCA compressed rows, each batch entry (a sequence's MTP tokens)
/// given the longest of its tokens' lengths: never an entry the builder left unwritten, and
/// per token exactly what a whole row (−1 to the width) gives — on random steps and on steps
/// whose first token's head is a multiple of 64 and the next one's one longer (the case a
/// row written only to `ceil64(head)` would fail: its sibling's length reaches one past it).
#[test]
fn flashmla_reads_only_written_compressed_entries() {
    let mut rng = Rng::new(0xf1a5_4d1a_0000_0004);
    let mut edges = 0;
    for case_no in 0..40 {
        let ratios = random_ratios(&mut rng);
        let g = geometry_at(&ratios, rng.range(129, 133), rng.range(60_000, 400_000), rng.range(4, 12));
        let bs = rng.range(1, 4) as usize;
        let (views, max_pos) = (rng.range(1, 4) as usize, rng.range(100, 40_000));
        let d = if case_no % 2 == 0 {
            FlashDecode::mtp_edge(&mut rng, &g, bs, views)
        } else {
            FlashDecode::random(&mut rng, &g, bs, max_pos, views)
        };
        let name = format!("flash reads {case_no}");
        let (case, bufs, make) = d.case(&name, 0, true);
        let out = run_in_memory(&case, &make, &reference);
        let b = bufs[2].expect("HCA in every case");
        let cls = d.classes[2].as_ref().unwrap();
        let (w, t) = (cls.extra_topk as usize, d.batch.bid.len());
        let lengths = words(&out[b.extra_length.unwrap()]);
        let rows = words(&out[b.extra.unwrap()]);
        let whole: Vec<i32> =
            d.expected(2)[2].iter().map(|&x| if x == flashmla_common::POISON { -1 } else { x }).collect();
        for v in 0..cls.shifts.len() {
            let view = |r: &[i32]| r[v * t * w..(v + 1) * t * w].to_vec();
            let got = flashmla_reads(&view(&rows), &lengths[..t], &d.batch.bid, w)
                .unwrap_or_else(|e| panic!("{name} view {v}: {e}"));
            let want = flashmla_reads(&view(&whole), &lengths[..t], &d.batch.bid, w).unwrap();
            assert_eq!(got, want, "{name} view {v}: what FlashMLA reads");
        }
        edges += (0..t)
            .filter(|&i| d.batch.bid[i] >= 0 && lengths[i] % 64 == 0)
            .filter(|&i| (0..t).any(|j| d.batch.bid[j] == d.batch.bid[i] && lengths[j] == lengths[i] + 1))
            .count();
    }
    assert!(edges > 10, "only {edges} tokens at a 64-entry edge with a longer sibling");
}

#[test]
fn csa_pack_writes_flashmla_rows_by_the_convention() {
    let mut rng = Rng::new(0xf1a5_4d1a_0000_0002);
    let mut inner_minus_one = 0;
    for case_no in 0..40 {
        let ratios = random_ratios(&mut rng);
        let g = geometry_at(&ratios, rng.range(128, 133), rng.range(60_000, 400_000), rng.range(4, 12));
        let topk = rng.pick(&[8, 64, 512, 700]);
        let (bs, max_pos) = (rng.range(1, 4) as usize, rng.range(100, 20_000));
        let p = FlashPack::random(&mut rng, &g, bs, max_pos, topk);
        let name = format!("flash pack {case_no}");
        let (case, [out, len], make) = p.case(&name, 0);
        let got = run_in_memory(&case, &make, &reference);
        let [rows, lens] = p.expected();
        inner_minus_one += rows.windows(2).filter(|w| w[0] == -1 && w[1] >= 0).count();
        assert_eq!(words(&got[out]), rows, "{name}: extra_indices");
        assert_eq!(words(&got[len]), lens, "{name}: extra_topk_length");
    }
    assert!(inner_minus_one > 0, "no −1 inside a valid part: the in-place rule went untested");
}

/// The typed refusals of the host reference: a head past its row, a pack row past its width.
#[test]
fn host_reference_refuses_entries_past_the_row() {
    let mut rng = Rng::new(0xf1a5_4d1a_0000_0003);
    let g = geometry_at(&[0, 4, 128], 128, 200_000, 4);
    loop {
        let d = FlashDecode::random(&mut rng, &g, 3, 20_000, 2);
        let hca = d.classes[2].as_ref().unwrap();
        let head =
            hca.indptr.windows(2).zip(&d.batch.pos).map(|(w, &p)| i64::from(w[1] - w[0]) - (p + 1).min(128));
        if head.max().unwrap_or(0) < 2 {
            continue;
        }
        let mut narrow = d.clone();
        let h = narrow.classes[2].as_mut().unwrap();
        h.extra_topk = 1;
        let (case, _, make) = narrow.case("narrow", 0, true);
        run_in_memory(&case, &make, &|l| {
            // SAFETY: as `reference`.
            let e = unsafe { run_launch(l) }.expect_err("a head past its row must be refused");
            assert_eq!(v4pool::VariantName::variant_name(&e), "PastRow");
        });
        break;
    }
}
