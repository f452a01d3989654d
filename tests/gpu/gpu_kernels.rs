//! Every kernel on CUDA against the host reference, on fresh random inputs at V4-Flash and
//! V4-Pro shapes. Outputs are poisoned before the launch and every buffer (inputs, outputs,
//! untouched poison) is compared whole. Skips without a device unless
//! `V4POOL_REQUIRE_GPU=1`; a failure prints the seed (`V4POOL_SEED=...` replays it).

use crate::common;

use common::batches::{DecodeBatch, PrefillBatch};
use common::{case_seed, check_case, device_or_skip, geometry_at, models, Case, Rng, WIN};
use v4pool::backend::Backend;
use v4pool::raw::index::shape::prefill_short;
use v4pool::raw::index::{
    ClassBuffers, CopyRun, CopyRunsArgs, CsaPackArgs, DecodeIndexArgs, FillRun, FillRunsArgs, HcaOffsetsArgs,
    Launch, PlaneWrite, PrefillIndexArgs, RingWriteArgs, RowScatterArgs, CLASS_DENSE,
};
use v4pool::{GeometrySpec, UnifiedPoolGeometry, CSA_RATIO, DENSE_RATIO, HCA_RATIO};

const POISON: i32 = -7;
const SLACK: usize = 37;
const HCA_ROWS_PER_BLOCK: i32 = 2;

fn batch_sizes(rng: &mut Rng) -> [usize; 4] {
    [1, rng.range(2, 64) as usize, rng.range(65, 512) as usize, 1024]
}

// ---- decode builder (§3 + §4 fused) ---------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum DecodeVariant {
    /// Every class, every dest buffer, HCA heads from the block tables.
    Full,
    /// HCA heads left to the peer (`block_tables == 0`).
    Peer,
    /// CSA class off (no store at all), HCA without a dest buffer.
    CsaOff,
    /// Only the HCA class.
    HcaOnly,
}

/// Buffers of one decode step on a geometry, in a case; returns the launch builder.
fn decode_case(
    case: &mut Case,
    g: &UnifiedPoolGeometry,
    b: &DecodeBatch,
    variant: DecodeVariant,
) -> impl Fn(&[u64]) -> Vec<Launch> {
    let t_pad = b.t_pad();
    let slots = case.i32s("state_slot_per_seq", &b.slots);
    let bid = case.i32s("batch_id_per_token", &b.bid);
    let pos = case.i64s("positions", &b.pos);
    let tables = case.i32s("block_tables", &b.tables);
    let indptrs = [b.dense_indptr(), b.csa_indptr(), b.hca_indptr()];
    let names = ["dense", "csa", "hca"];
    let ratios = [DENSE_RATIO, CSA_RATIO, HCA_RATIO];
    let enabled = match variant {
        DecodeVariant::Full | DecodeVariant::Peer => [true, true, true],
        DecodeVariant::CsaOff => [true, false, true],
        DecodeVariant::HcaOnly => [false, false, true],
    };
    let with_dest = match variant {
        DecodeVariant::CsaOff => [true, false, false],
        _ => [true, true, true],
    };
    let mut bufs = [(0usize, 0usize, None::<usize>); 3];
    let mut params = [Default::default(); 3];
    for c in 0..3 {
        params[c] = g.window_params(ratios[c]).expect("class present");
        let total = *indptrs[c].last().unwrap_or(&0) as usize;
        let ip = case.i32s(&format!("{}_indptr", names[c]), &indptrs[c]);
        let ix = case.poisoned(&format!("{}_indices", names[c]), total + SLACK, POISON);
        let dr = case.poisoned(&format!("{}_dest_rows", names[c]), t_pad + SLACK, POISON);
        bufs[c] = (ip, ix, with_dest[c].then_some(dr));
    }
    let envelope = g.envelope_rows;
    let stride = b.stride as i32;
    let peer = matches!(variant, DecodeVariant::Peer);
    move |p: &[u64]| {
        let mut a = DecodeIndexArgs::default()
            .with_state_slot_per_seq(p[slots])
            .with_batch_id_per_token(p[bid])
            .with_positions(p[pos])
            .with_block_tables(if peer { 0 } else { p[tables] })
            .with_envelope_rows(envelope)
            .with_block_table_stride(stride)
            .with_hca_rows_per_block(HCA_ROWS_PER_BLOCK)
            .with_num_tokens(t_pad as i32)
            .with_win(WIN);
        for c in 0..3 {
            if enabled[c] {
                let (ip, ix, dr) = bufs[c];
                a.classes[c] = ClassBuffers::default()
                    .with_params(params[c])
                    .with_indptr(p[ip])
                    .with_indices(p[ix])
                    .with_dest_rows(dr.map_or(0, |d| p[d]));
            }
        }
        vec![Launch::Decode(a)]
    }
}

#[test]
fn decode_index_builder_matches_host() {
    let Some(cuda) = device_or_skip("decode_index_builder_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        let seed = case_seed("decode-geometry", model.len() as u64);
        let g = common::big_geometry(&mut Rng::new(seed), &ratios);
        let mut rng = Rng::new(seed);
        let variants =
            [DecodeVariant::Full, DecodeVariant::Peer, DecodeVariant::CsaOff, DecodeVariant::HcaOnly];
        for (i, bs) in batch_sizes(&mut rng).into_iter().enumerate() {
            let variant = variants[i % variants.len()];
            let topk = if i % 2 == 0 { 512 } else { 1024 };
            let seed = case_seed(&format!("decode-{model}"), i as u64);
            let mut rng = Rng::new(seed);
            let b = DecodeBatch::generate(&mut rng, &g, bs, topk, 1_000_000, 0, 1);
            let name = format!("decode {model} bs={bs} T={} ring={} {variant:?}", b.t_pad(), g.ring_slots);
            let mut case = Case::new(name, seed);
            let make = decode_case(&mut case, &g, &b, variant);
            check_case(cuda, &case, &make);
            println!("ok {} ({} MB)", case.name, case.total_bytes() >> 20);
        }
    }
}

#[test]
fn decode_index_builder_with_zero_tokens_stores_nothing() {
    let Some(cuda) = device_or_skip("decode_index_builder_with_zero_tokens_stores_nothing") else {
        return;
    };
    let cuda = &*cuda;
    let seed = case_seed("decode-empty", 0);
    let mut rng = Rng::new(seed);
    let g = common::big_geometry(&mut rng, &common::flash_ratios());
    let mut b = DecodeBatch::generate(&mut rng, &g, 3, 512, 1_000_000, 0, 1);
    // Every token a pad: the builder must leave everything untouched.
    b.bid.iter_mut().for_each(|x| *x = -1);
    let mut case = Case::new("decode all pads", seed);
    let make = decode_case(&mut case, &g, &b, DecodeVariant::Full);
    check_case(cuda, &case, &make);
}

// ---- prefill builder (§6) ---------------------------------------------------------------

fn prefill_args(l: &Launch) -> Option<PrefillIndexArgs> {
    match l {
        Launch::Prefill(a) => Some(*a),
        _ => None,
    }
}

#[test]
fn prefill_index_builder_matches_host() {
    let Some(cuda) = device_or_skip("prefill_index_builder_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        for i in 0..4u64 {
            let seed = case_seed(&format!("prefill-{model}"), i);
            let mut rng = Rng::new(seed);
            let g = common::big_geometry(&mut rng, &ratios);
            let topk = if i % 2 == 0 { 512 } else { 1024 };
            let max_seqs = [1, 16, 64, 16][i as usize];
            let max_pos = if i == 3 { 16_000 } else { 1_000_000 };
            let b = PrefillBatch::generate(&mut rng, &g, max_seqs, 8192, 8_000_000, topk, max_pos);
            let with_dense = i != 1;
            let t = b.num_tokens();
            let mut case = Case::new(
                format!("prefill {model} bs={} T={t} dense={with_dense} ring={}", b.bs, g.ring_slots),
                seed,
            );
            let pos = case.i32s("positions", &b.pos);
            let bid = case.i32s("bid_per_token", &b.bid);
            let cs: Vec<i32> = b.chunk_start.iter().map(|&c| c as i32).collect();
            let cs = case.i32s("chunk_start_per_seq", &cs);
            let cu = case.i32s("cu_seqlens_q_per_seq", &b.cu_q[..b.bs]);
            let slots = case.i32s("state_slot_per_seq", &b.slots);
            let ncommit = case.i32s("n_committed_hca_per_seq", &b.n_committed);
            let tables = case.i32s("block_tables", &b.tables);
            let ptrs = [
                b.indptr(|k| k.ext),
                b.indptr(|k| k.pre),
                b.indptr(|k| k.pre + k.csa_head),
                b.indptr(|k| k.pre + k.n_hca),
            ];
            let names = ["extend", "swa", "csa", "hca"];
            let mut ids = [(0, 0); 4];
            for j in 0..4 {
                let total = *ptrs[j].last().unwrap_or(&0) as usize;
                ids[j] = (
                    case.i32s(&format!("{}_indptr", names[j]), &ptrs[j]),
                    case.poisoned(&format!("{}_indices", names[j]), total + SLACK, POISON),
                );
            }
            let dense = g.window_params(DENSE_RATIO).expect("dense");
            let csa = g.window_params(CSA_RATIO).expect("csa");
            let hca = g.window_params(HCA_RATIO).expect("hca");
            let (envelope, stride) = (g.envelope_rows, b.stride as i32);
            let make = move |p: &[u64]| {
                vec![Launch::Prefill(
                    PrefillIndexArgs::default()
                        .with_dense(dense)
                        .with_csa(csa)
                        .with_hca(hca)
                        .with_positions(p[pos])
                        .with_bid_per_token(p[bid])
                        .with_chunk_start_per_seq(p[cs])
                        .with_cu_seqlens_q_per_seq(p[cu])
                        .with_state_slot_per_seq(p[slots])
                        .with_n_committed_hca_per_seq(p[ncommit])
                        .with_block_tables(p[tables])
                        .with_extend_indptr(p[ids[0].0])
                        .with_extend_indices(p[ids[0].1])
                        .with_swa_indptr(if with_dense { p[ids[1].0] } else { 0 })
                        .with_swa_indices(if with_dense { p[ids[1].1] } else { 0 })
                        .with_csa_indptr(p[ids[2].0])
                        .with_csa_indices(p[ids[2].1])
                        .with_hca_indptr(p[ids[3].0])
                        .with_hca_indices(p[ids[3].1])
                        .with_envelope_rows(envelope)
                        .with_block_table_stride(stride)
                        .with_num_tokens(t as i32)
                        .with_win(WIN)
                        .with_hca_ratio(HCA_RATIO)
                        .with_hca_rows_per_block(HCA_ROWS_PER_BLOCK)
                        .with_coarse_packed(0),
                )]
            };
            let short =
                prefill_short(&make(&[0; 64]).iter().find_map(prefill_args).expect("a prefill launch"));
            // Case 3's contexts (< 25K) are short enough for the short form (the others mostly not).
            assert!(short || i != 3, "case 3 must run the short form");
            check_case(cuda, &case, &make);
            println!(
                "ok {} ({} form, {} MB)",
                case.name,
                if short { "short" } else { "long" },
                case.total_bytes() >> 20
            );
        }
    }
}

// ---- HCA compressed offsets (§4) ------------------------------------------------------------

#[test]
fn hca_offsets_match_host() {
    let Some(cuda) = device_or_skip("hca_offsets_match_host") else {
        return;
    };
    let cuda = &*cuda;
    for (i, rpb) in [2, 1, 2].into_iter().enumerate() {
        let seed = case_seed("hca-offsets", i as u64);
        let mut rng = Rng::new(seed);
        let g = common::big_geometry(&mut rng, &common::pro_ratios());
        let bs = rng.range(1, 1024) as usize;
        let ctx: Vec<i64> =
            (0..bs).map(|_| common::batches::start_position(&mut rng, 1_000_000) + 1).collect();
        let stride = ctx.iter().map(|&c| common::batches::columns(c)).max().unwrap_or(1) * (3 - rpb as usize);
        let tables = common::batches::tables(&mut rng, &g, bs, stride);
        let n = if i == 2 { 0 } else { rng.range(1, 300_000) as usize };
        let (mut entry, mut bids) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for _ in 0..n {
            let b = rng.below(bs as u64) as usize;
            bids.push(b as i32);
            entry.push(rng.range(0, (ctx[b] / 128).max(1) - 1) as i32);
        }
        let mut case = Case::new(format!("hca offsets N={n} bs={bs} rpb={rpb}"), seed);
        let e = case.i32s("entry_idx", &entry);
        let b = case.i32s("bid_per_entry", &bids);
        let t = case.i32s("block_tables", &tables);
        let out = case.poisoned("out", n + SLACK, POISON);
        let envelope = g.envelope_rows;
        let make = move |p: &[u64]| {
            vec![Launch::HcaOffsets(
                HcaOffsetsArgs::default()
                    .with_entry_idx(p[e])
                    .with_bid_per_entry(p[b])
                    .with_block_tables(p[t])
                    .with_out(p[out])
                    .with_envelope_rows(envelope)
                    .with_block_table_stride(stride as i32)
                    .with_rows_per_block(rpb)
                    .with_num_entries(n as i32),
            )]
        };
        check_case(cuda, &case, &make);
    }
}

// ---- CSA translate-pack (§5) ----------------------------------------------------------------

#[test]
fn csa_translate_pack_decode_mode_matches_host() {
    let Some(cuda) = device_or_skip("csa_translate_pack_decode_mode_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        let mut rng = Rng::new(case_seed("csa-geometry", model.len() as u64));
        let g = common::big_geometry(&mut rng, &ratios);
        for (i, bs) in batch_sizes(&mut rng).into_iter().enumerate() {
            let seed = case_seed(&format!("csa-decode-{model}"), i as u64);
            let mut rng = Rng::new(seed);
            // V4-Flash's top-k, V4-Pro's, and 2,048 (eight columns per thread).
            let topk: i64 = [512, 1024, 2048][i % 3];
            let b = DecodeBatch::generate(&mut rng, &g, bs, topk, 1_000_000, 0, 1);
            let row_stride = topk as usize + if i == 3 { 16 } else { 0 };
            let t = b.t_pad();
            let topk_rows = b.topk_rows(&mut rng, row_stride);
            let indptr = b.csa_indptr();
            let out_len = *indptr.last().unwrap_or(&0) as usize + SLACK;
            let mut case = Case::new(format!("csa pack decode {model} bs={bs} T={t} k={topk}"), seed);
            let tk = case.i32s("topk", &topk_rows);
            let tb = case.i32s("block_tables", &b.tables);
            let ps = case.i64s("positions", &b.pos);
            let ip = case.i32s("indptr", &indptr);
            let bi = case.i32s("batch_id_per_token", &b.bid);
            // The decode builder's window tails are already in place: random values here,
            // which the pack must leave alone.
            let out: Vec<i32> = (0..out_len).map(|_| rng.next_u64() as i32).collect();
            let out = case.i32s("out", &out);
            let (envelope, stride) = (g.envelope_rows, b.stride as i32);
            let make = move |p: &[u64]| {
                vec![Launch::CsaPack(
                    CsaPackArgs::default()
                        .with_topk(p[tk])
                        .with_block_tables(p[tb])
                        .with_positions(p[ps])
                        .with_indptr(p[ip])
                        .with_batch_id_per_token(p[bi])
                        .with_skip_prefix_len_per_token(0)
                        .with_out(p[out])
                        .with_envelope_rows(envelope)
                        .with_topk_row_stride(row_stride as i32)
                        .with_block_table_stride(stride)
                        .with_num_tokens(t as i32)
                        .with_block_capacity(64)
                        .with_window_size(WIN)
                        .with_compress_ratio(4)
                        .with_compress_bias(0),
                )]
            };
            check_case(cuda, &case, &make);
        }
    }
}

#[test]
fn csa_translate_pack_prefill_mode_matches_host() {
    let Some(cuda) = device_or_skip("csa_translate_pack_prefill_mode_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        for i in 0..2u64 {
            let seed = case_seed(&format!("csa-prefill-{model}"), i);
            let mut rng = Rng::new(seed);
            let g = common::big_geometry(&mut rng, &ratios);
            let topk: i64 = if i == 0 { 512 } else { 1024 };
            let b = PrefillBatch::generate(&mut rng, &g, 32, 6000, 8_000_000, topk, 1_000_000);
            let t = b.num_tokens();
            let indptr = b.indptr(|k| k.pre + k.csa_head);
            let skip: Vec<i32> = (0..t).map(|x| b.token(x).pre as i32).collect();
            let topk_rows = b.topk_rows(&mut rng, topk as usize);
            let out_len = *indptr.last().unwrap_or(&0) as usize + SLACK;
            let mut case = Case::new(format!("csa pack prefill {model} bs={} T={t} k={topk}", b.bs), seed);
            let tk = case.i32s("topk", &topk_rows);
            let tb = case.i32s("block_tables", &b.tables);
            let ip = case.i32s("indptr", &indptr);
            let bi = case.i32s("batch_id_per_token", &b.bid);
            let sk = case.i32s("skip_prefix_len_per_token", &skip);
            let out = case.poisoned("out", out_len, -9);
            let (envelope, stride) = (g.envelope_rows, b.stride as i32);
            let make = move |p: &[u64]| {
                vec![Launch::CsaPack(
                    CsaPackArgs::default()
                        .with_topk(p[tk])
                        .with_block_tables(p[tb])
                        // Prefill mode never reads positions: a null pointer proves it.
                        .with_positions(0)
                        .with_indptr(p[ip])
                        .with_batch_id_per_token(p[bi])
                        .with_skip_prefix_len_per_token(p[sk])
                        .with_out(p[out])
                        .with_envelope_rows(envelope)
                        .with_topk_row_stride(topk as i32)
                        .with_block_table_stride(stride)
                        .with_num_tokens(t as i32)
                        .with_block_capacity(64)
                        .with_window_size(0)
                        .with_compress_ratio(4)
                        .with_compress_bias(0),
                )]
            };
            check_case(cuda, &case, &make);
        }
    }
}

// ---- ring write and row scatter (§7) ------------------------------------------------------

/// Row layouts of the planes: fp8 mode (NoPE 512 B + RoPE 128 B) or bf16 (one 1024 B plane).
fn plane_widths(fp8: bool) -> Vec<i64> {
    if fp8 {
        vec![512, 128]
    } else {
        vec![1024]
    }
}

/// A layer of each class: (ratio, layer id).
fn layers_of(g: &UnifiedPoolGeometry, rng: &mut Rng) -> Vec<(i32, usize)> {
    [DENSE_RATIO, CSA_RATIO, HCA_RATIO]
        .into_iter()
        .filter_map(|r| {
            let c = g.class(r)?;
            Some((r, c.layers[rng.below(c.layers.len() as u64) as usize]))
        })
        .collect()
}

struct RowWriteSetup {
    planes: Vec<(usize, usize, i64)>, // (kv buffer, plane buffer, row bytes)
    base_row: i64,
    view_rows: i64,
}

fn add_planes(
    case: &mut Case,
    rng: &mut Rng,
    g: &UnifiedPoolGeometry,
    layer: usize,
    fp8: bool,
    t: usize,
) -> RowWriteSetup {
    let base_row = g.layer_base_row(layer).expect("layer");
    let view_rows = g.layer_view_rows(layer).expect("layer");
    let planes = plane_widths(fp8)
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            let kv = case.bytes(&format!("kv{i}"), rng.bytes(t * w as usize));
            let plane = case.bytes(&format!("plane{i}"), rng.bytes((g.plane_rows * w) as usize));
            (kv, plane, w)
        })
        .collect();
    RowWriteSetup { planes, base_row, view_rows }
}

fn plane_writes(s: &RowWriteSetup, p: &[u64]) -> [PlaneWrite; 2] {
    let mut out = [PlaneWrite::default(); 2];
    for (o, &(kv, plane, w)) in out.iter_mut().zip(&s.planes) {
        *o = PlaneWrite::default()
            .with_kv(p[kv])
            .with_pool(p[plane] + (s.base_row * w) as u64)
            .with_row_bytes(w);
    }
    out
}

/// A moderate geometry (whole planes are compared): `slots` slots beside 30 blocks.
fn row_geometry(rng: &mut Rng, ratios: &[i32], slots: i64, arena_rows: i64) -> UnifiedPoolGeometry {
    let ring = rng.range(128, 135);
    let spec = GeometrySpec::new(ratios.to_vec(), 30, slots, ring, common::BLOCK_SIZE).arena_rows(arena_rows);
    spec.build().expect("row geometry")
}

/// Ring write of one layer: `bs` sequences, with `stale` of them on a slot past the plane
/// (rows dropped) and the rest on distinct live slots.
#[allow(clippy::too_many_arguments)]
fn ring_write_case(
    cuda: &dyn Backend,
    name: &str,
    seed: u64,
    g: &UnifiedPoolGeometry,
    layer: usize,
    params: v4pool::WindowParams,
    fp8: bool,
    bs: usize,
) {
    let mut rng = Rng::new(seed);
    let mut slots = common::batches::slots(&mut rng, g, bs);
    if bs > 2 {
        // A stale slot one past the last position, and one far below the plane: dropped.
        slots[0] = g.slot_positions as i32;
        slots[1] = -3;
    }
    let mut cu = vec![0i32];
    let mut pos = Vec::new();
    let mut max_tok = 1;
    for _ in 0..bs {
        let tok = [0, 1, rng.range(2, 200)][rng.below(3) as usize];
        let cs = common::batches::start_position(&mut rng, 1_000_000);
        pos.extend((0..tok).map(|i| (cs + i) as i32));
        cu.push(pos.len() as i32);
        max_tok = max_tok.max(tok);
    }
    let wpb = if rng.chance(0.5) { max_tok.min(params.ring_slots) } else { rng.range(1, params.ring_slots) };
    let t = pos.len();
    let mut case = Case::new(format!("{name} bs={bs} T={t} wpb={wpb} fp8={fp8} layer={layer}"), seed);
    let setup = add_planes(&mut case, &mut rng, g, layer, fp8, t);
    let ps = case.i32s("positions", &pos);
    let cu_b = case.i32s("cu_seqlens_q", &cu);
    let sl = case.i32s("state_slot_per_seq", &slots);
    let view_rows = setup.view_rows;
    let make = move |p: &[u64]| {
        vec![Launch::RingWrite(
            RingWriteArgs::default()
                .with_params(params)
                .with_planes(plane_writes(&setup, p))
                .with_positions(p[ps])
                .with_cu_seqlens_q(p[cu_b])
                .with_state_slot_per_seq(p[sl])
                .with_view_rows(view_rows)
                .with_num_seqs(bs as i32)
                .with_write_per_batch(wpb as i32),
        )]
    };
    check_case(cuda, &case, &make);
}

#[test]
fn ring_write_matches_host() {
    let Some(cuda) = device_or_skip("ring_write_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        for i in 0..3u64 {
            let seed = case_seed(&format!("ring-{model}"), i);
            let mut rng = Rng::new(seed);
            // The slots' windows are most of the planes compared whole: 8 slots, not 24, under
            // the HIP runtime double (a full batch is still every slot; 1,024 rows still fit
            // a layer's view).
            let g = row_geometry(&mut rng, &ratios, common::sized(24, 8), 0);
            for (ratio, layer) in layers_of(&g, &mut rng) {
                let params = g.window_params(ratio).expect("class");
                let bs = [1, rng.range(2, common::sized(16, 7)) as usize, common::sized(24, 8)][i as usize];
                let sub = case_seed(&format!("ring-{model}-{ratio}"), i);
                ring_write_case(
                    cuda,
                    &format!("ring write {model} ratio={ratio}"),
                    sub,
                    &g,
                    layer,
                    params,
                    i != 1,
                    bs,
                );
            }
        }
    }
}

#[test]
fn row_scatter_matches_host() {
    let Some(cuda) = device_or_skip("row_scatter_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        for i in 0..3u64 {
            let seed = case_seed(&format!("scatter-{model}"), i);
            let mut rng = Rng::new(seed);
            // 8 slots under the HIP runtime double, as in ring_write_matches_host.
            let g = row_geometry(&mut rng, &ratios, common::sized(24, 8), 0);
            for (ratio, layer) in layers_of(&g, &mut rng) {
                let fp8 = i != 1;
                let t = [1, rng.range(2, 300) as usize, 1024][i as usize];
                let view_rows = g.layer_view_rows(layer).expect("layer");
                // Distinct in-range rows (two tokens on one row would race), some pads and
                // some rows outside the view (dropped).
                let mut dest: Vec<i32> =
                    rng.distinct(t, view_rows as u64).into_iter().map(|r| r as i32).collect();
                let mut bid: Vec<i32> = (0..t).map(|_| rng.range(0, 23) as i32).collect();
                for k in 0..t {
                    match rng.below(10) {
                        0 => bid[k] = -1,
                        1 => dest[k] = view_rows as i32 + rng.range(0, 5) as i32,
                        2 => dest[k] = -(rng.range(1, 1000) as i32),
                        _ => {}
                    }
                }
                let name = format!("row scatter {model} ratio={ratio} T={t} fp8={fp8}");
                row_scatter_case(cuda, Case::new(name, seed), &mut rng, &g, layer, fp8, &dest, &bid);
            }
        }
    }
}

/// Rows past 2^31 bytes: a plane of > 4,194,304 rows at 512 B, written near its top.
#[test]
fn row_writes_address_past_2_gib() {
    let Some(cuda) = device_or_skip("row_writes_address_past_2_gib") else {
        return;
    };
    let cuda = &*cuda;
    let seed = case_seed("big-rows", 0);
    let mut rng = Rng::new(seed);
    let ratios = common::flash_ratios();
    // 5 M rows with 64 slots: the slots (all window rows) sit at the top, past row 4,194,304.
    let g = geometry_at(&ratios, 133, 5_000_000, 64);
    let layer = g.class(CSA_RATIO).expect("csa").layers[3];
    let first_slot_row =
        (g.slot_positions - g.num_slots) * g.slot_rows - g.layer_base_row(layer).expect("layer");
    assert!(first_slot_row * 512 > 1 << 31, "{first_slot_row}");
    let params = g.window_params(CSA_RATIO).expect("csa");
    ring_write_case(cuda, "ring write past 2 GiB", seed, &g, layer, params, true, 24);
    // Row scatter onto the top rows of the view.
    let view_rows = g.layer_view_rows(layer).expect("layer");
    let t = 512;
    let dest: Vec<i32> = rng.distinct(t, 200_000).into_iter().map(|r| (view_rows - 1 - r) as i32).collect();
    let bid = vec![0i32; t];
    row_scatter_case(cuda, Case::new("row scatter past 2 GiB", seed), &mut rng, &g, layer, true, &dest, &bid);
}

/// Row scatter of `dest.len()` tokens onto `layer`'s view (both planes): `case` gains the
/// planes, the batch ids and the destination rows, then runs against the host reference.
#[allow(clippy::too_many_arguments)] // the case, its rows and the view they land in
fn row_scatter_case(
    cuda: &dyn Backend,
    mut case: Case,
    rng: &mut Rng,
    g: &UnifiedPoolGeometry,
    layer: usize,
    fp8: bool,
    dest: &[i32],
    bid: &[i32],
) {
    let (t, view_rows) = (dest.len(), g.layer_view_rows(layer).expect("layer"));
    let setup = add_planes(&mut case, rng, g, layer, fp8, t);
    let bi = case.i32s("batch_id_per_token", bid);
    let dr = case.i32s("dest_rows", dest);
    let make = move |p: &[u64]| {
        vec![Launch::RowScatter(
            RowScatterArgs::default()
                .with_planes(plane_writes(&setup, p))
                .with_batch_id_per_token(p[bi])
                .with_dest_rows(p[dr])
                .with_view_rows(view_rows)
                .with_num_tokens(t as i32),
        )]
    };
    check_case(cuda, &case, &make);
}

// ---- DSpark field windows -------------------------------------------------------------------

/// A draft layer's window kept in a state field: the ring write and the decode builder take
/// `field_window_params` on the plane retyped to `k` plane rows per window row.
#[test]
fn dspark_field_window_matches_host() {
    let Some(cuda) = device_or_skip("dspark_field_window_matches_host") else {
        return;
    };
    let cuda = &*cuda;
    for (model, ratios) in models() {
        for k in [1i64, 2] {
            let seed = case_seed(&format!("dspark-{model}"), k as u64);
            let mut rng = Rng::new(seed);
            let ring = rng.range(128, 135);
            let arena = (ring * k + 65) / 2 * 2 + 2 * rng.range(0, 100);
            let g = GeometrySpec::new(ratios.clone(), 60, 40, ring, common::BLOCK_SIZE)
                .arena_rows(arena)
                .slot_align_rows(2 * k)
                .build()
                .expect("geometry with an arena");
            let offset = k * rng.range(0, (arena - ring * k) / k);
            let params = g.field_window_params(offset, k).expect("field window");
            // Ring write through the retyped plane: view = whole plane, rows of k*512 B.
            let bs = rng.range(3, 20) as usize;
            let mut slots = common::batches::slots(&mut rng, &g, bs);
            slots[0] = g.slot_positions as i32; // stale: dropped
            let mut cu = vec![0i32];
            let mut pos = Vec::new();
            for _ in 0..bs {
                let tok = rng.range(0, 150);
                let cs = common::batches::start_position(&mut rng, 1_000_000);
                pos.extend((0..tok).map(|i| (cs + i) as i32));
                cu.push(pos.len() as i32);
            }
            let t = pos.len();
            let w = 512 * k;
            let view_rows = g.plane_rows / k;
            let mut case = Case::new(format!("dspark ring write {model} k={k} bs={bs} T={t}"), seed);
            let kv = case.bytes("kv", rng.bytes(t * w as usize));
            let plane = case.bytes("plane", rng.bytes((g.plane_rows * 512) as usize));
            let ps = case.i32s("positions", &pos);
            let cu_b = case.i32s("cu_seqlens_q", &cu);
            let sl = case.i32s("state_slot_per_seq", &slots);
            let wpb = params.ring_slots.min(150) as i32;
            let make = move |p: &[u64]| {
                vec![Launch::RingWrite(
                    RingWriteArgs::default()
                        .with_params(params)
                        .with_planes([
                            PlaneWrite::default().with_kv(p[kv]).with_pool(p[plane]).with_row_bytes(w),
                            PlaneWrite::default(),
                        ])
                        .with_positions(p[ps])
                        .with_cu_seqlens_q(p[cu_b])
                        .with_state_slot_per_seq(p[sl])
                        .with_view_rows(view_rows)
                        .with_num_seqs(bs as i32)
                        .with_write_per_batch(wpb),
                )]
            };
            check_case(cuda, &case, &make);

            // The draft layer's decode indices: its field window as the dense class.
            let bs = rng.range(1, 40) as usize;
            let b = DecodeBatch::generate(&mut rng, &g, bs, 512, 1_000_000, 0, 1);
            let indptr = b.dense_indptr();
            let mut case = Case::new(format!("dspark decode {model} k={k} T={}", b.t_pad()), seed);
            let slots = case.i32s("state_slot_per_seq", &b.slots);
            let bid = case.i32s("batch_id_per_token", &b.bid);
            let pos = case.i64s("positions", &b.pos);
            let ip = case.i32s("indptr", &indptr);
            let ix = case.poisoned("indices", *indptr.last().unwrap_or(&0) as usize + SLACK, POISON);
            let dr = case.poisoned("dest_rows", b.t_pad() + SLACK, POISON);
            let t_pad = b.t_pad() as i32;
            let make = move |p: &[u64]| {
                let mut a = DecodeIndexArgs::default()
                    .with_state_slot_per_seq(p[slots])
                    .with_batch_id_per_token(p[bid])
                    .with_positions(p[pos])
                    .with_num_tokens(t_pad)
                    .with_win(WIN);
                a.classes[CLASS_DENSE] = ClassBuffers::default()
                    .with_params(params)
                    .with_indptr(p[ip])
                    .with_indices(p[ix])
                    .with_dest_rows(p[dr]);
                vec![Launch::Decode(a)]
            };
            check_case(cuda, &case, &make);
        }
    }
}

// ---- fill runs / copy runs ------------------------------------------------------------------

/// Disjoint runs `(offset, bytes)` inside `[0, len)`, each a multiple of `align` at an
/// offset multiple of `align`.
fn disjoint_runs(rng: &mut Rng, len: u64, count: usize, align: u64) -> Vec<(u64, u64)> {
    let mut cuts: Vec<u64> = (0..2 * count).map(|_| rng.below(len / align) * align).collect();
    cuts.sort_unstable();
    cuts.chunks(2).map(|c| (c[0], c[1] - c[0])).collect()
}

#[test]
fn fill_runs_and_copy_runs_match_host() {
    let Some(cuda) = device_or_skip("fill_runs_and_copy_runs_match_host") else {
        return;
    };
    let cuda = &*cuda;
    for i in 0..4u64 {
        let seed = case_seed("runs", i);
        let mut rng = Rng::new(seed);
        let len = [4096, 1 << 20, 64 << 20, 3 << 20][i as usize];
        let count = [1, 7, 40, 0][i as usize];
        let patterns = [0xff80_0000u32, 0, rng.next_u64() as u32];
        // Fill: runs over a random region.
        let fills: Vec<(u64, u64, u32)> = disjoint_runs(&mut rng, len, count, 4)
            .into_iter()
            .map(|(o, b)| (o, b, patterns[rng.below(3) as usize]))
            .collect();
        let mut case = Case::new(format!("fill runs len={len} runs={count}"), seed);
        let region = case.bytes("region", rng.bytes(len as usize));
        let n = fills.len();
        let desc = case.with_ptrs("runs", (n.max(1) * std::mem::size_of::<FillRun>()) as u64, move |p| {
            let mut runs: Vec<FillRun> = fills
                .iter()
                .map(|&(o, b, pattern)| FillRun { dst: p[region] + o, bytes: b, pattern, _pad: 0 })
                .collect();
            runs.resize(n.max(1), FillRun::default());
            bytemuck::cast_slice(&runs).to_vec()
        });
        let make = move |p: &[u64]| {
            vec![Launch::FillRuns(FillRunsArgs::default().with_runs(p[desc]).with_num_runs(n as i32))]
        };
        check_case(cuda, &case, &make);

        // Copy: sources in one region, destinations disjoint in another, at any byte offset.
        let srcs = disjoint_runs(&mut rng, len, count, 1);
        let dsts = disjoint_runs(&mut rng, len, count, 1);
        let copies: Vec<(u64, u64, u64)> =
            srcs.iter().zip(&dsts).map(|(&(so, sb), &(d, db))| (so, d, sb.min(db))).collect();
        let mut case = Case::new(format!("copy runs len={len} runs={count}"), seed);
        let src = case.bytes("src", rng.bytes(len as usize));
        let dst = case.bytes("dst", rng.bytes(len as usize));
        let n = copies.len();
        let desc = case.with_ptrs("runs", (n.max(1) * std::mem::size_of::<CopyRun>()) as u64, move |p| {
            let mut runs: Vec<CopyRun> = copies
                .iter()
                .map(|&(s, d, b)| CopyRun { src: p[src] + s, dst: p[dst] + d, bytes: b })
                .collect();
            runs.resize(n.max(1), CopyRun::default());
            bytemuck::cast_slice(&runs).to_vec()
        });
        let make = move |p: &[u64]| {
            vec![Launch::CopyRuns(CopyRunsArgs::default().with_runs(p[desc]).with_num_runs(n as i32))]
        };
        check_case(cuda, &case, &make);
    }
}

// ---- backend byte operations ----------------------------------------------------------------

/// upload / fill_u32 / copy / download at random offsets on real allocations, against the
/// host backend doing the same.
#[test]
fn byte_operations_match_host() {
    let Some(cuda) = device_or_skip("byte_operations_match_host") else {
        return;
    };
    let cuda = &*cuda;
    let host = common::host();
    let s = v4pool::backend::Stream::DEFAULT;
    for i in 0..4u64 {
        let seed = case_seed("bytes", i);
        let mut rng = Rng::new(seed);
        let len = [256u64, 4096, 3 << 20, 300 << 20][i as usize];
        let init = rng.bytes(len as usize);
        // (kind, offset, bytes, extra): 0 upload, 1 fill, 2 copy.
        let mut ops = Vec::new();
        for _ in 0..20 {
            let kind = rng.below(3);
            let a = rng.below(len / 4) * 4;
            let b = rng.below(len / 4) * 4;
            let n = rng.below((len - a.max(b)) / 4 + 1) * 4;
            ops.push((kind, a, b, n, rng.next_u64()));
        }
        let run = |be: &dyn Backend| -> Vec<u8> {
            let x = be.alloc_zeroed(len).expect("alloc");
            let y = be.alloc_zeroed(len).expect("alloc");
            let mut op_rng = Rng::new(seed ^ 0x5555);
            // SAFETY: every range below lies inside `x` or `y` (offsets + n <= len), and
            // copies go from `y` to `x` (distinct allocations).
            unsafe {
                be.upload(x.ptr, &init, s).expect("upload");
                be.upload(y.ptr, &init, s).expect("upload");
                for &(kind, a, b, n, v) in &ops {
                    match kind {
                        0 => be.upload(x.ptr + a, &op_rng.bytes(n as usize), s).expect("upload"),
                        1 => be.fill_u32(x.ptr + a, n / 4, v as u32, s).expect("fill"),
                        _ => be.copy(x.ptr + a, y.ptr + b, n, s).expect("copy"),
                    }
                }
                let mut out = vec![0u8; len as usize];
                be.download(&mut out, x.ptr, s).expect("download");
                be.free(x);
                be.free(y);
                out
            }
        };
        let want = run(&host);
        let got = run(cuda);
        assert!(want == got, "byte operations differ (seed {seed:#x}, V4POOL_SEED={})", common::base_seed());
        assert!(want != init, "the operations changed something");
    }
}

#[test]
fn alloc_zeroed_is_zero_and_aligned() {
    let Some(cuda) = device_or_skip("alloc_zeroed_is_zero_and_aligned") else {
        return;
    };
    let cuda = &*cuda;
    let s = v4pool::backend::Stream::DEFAULT;
    for bytes in [0u64, 1, 4096, 5 << 20] {
        let a = cuda.alloc_zeroed(bytes).expect("alloc");
        assert_eq!(a.ptr % 256, 0);
        // Dirty it, free, and allocate again: a reused allocation must still come back zeroed.
        let mut back = vec![0xAAu8; bytes as usize];
        // SAFETY: within the allocation.
        unsafe {
            cuda.download(&mut back, a.ptr, s).expect("download");
            assert!(back.iter().all(|&b| b == 0));
            cuda.fill_u32(a.ptr, bytes / 4, 0xdead_beef, s).expect("fill");
            cuda.synchronize(s).expect("sync");
            cuda.free(a);
        }
        let b = cuda.alloc_zeroed(bytes).expect("alloc");
        let mut back = vec![0xAAu8; bytes as usize];
        // SAFETY: within the allocation.
        unsafe {
            cuda.download(&mut back, b.ptr, s).expect("download");
            cuda.free(b);
        }
        assert!(back.iter().all(|&b| b == 0));
    }
}
