//! The decode index path on DeepSeek-V4.1 shapes (compact form: owners-only envelopes,
//! shared compressors, ratios 2 and 1 in the fine and coarse slots, no class-wide head fill;
//! block 256 and 16, ring 128 and 133): the builder and one translate-pack per compressed
//! layer, outputs poisoned first, against an independent reference built from the geometry
//! (every head entry is the owner's row, every window entry the class's ring row, every
//! cell past a slice keeps its poison).
//!
//! `v41_decode_path_matches_the_geometry_on_the_host` and `other_ratios_take_the_same_decode_path`
//! (ratios 8 and 64 with V4's class-wide coarse head) run everywhere;
//! `v41_decode_path_on_the_device` runs the same cases on the GPU and compares every buffer
//! with the host path's (SKIP without a device; `V4POOL_REQUIRE_GPU=1` makes that a failure).
//! The prefill path likewise (`v41_prefill_path_matches_the_geometry_on_the_host`,
//! `v41_prefill_path_on_the_device`): chunks after earlier ones, both slots `[head | window
//! tail]`, every compressed layer packed with its bias.

use crate::common;

use common::{case_seed, device_or_skip, Rng};
use std::sync::Arc;
use v4pool::backend::{Backend, Stream};
use v4pool::geometry::{GeometrySpec, RowForm, UnifiedPoolGeometry};
use v4pool::pool::{
    DecodeBuffer, DecodeCapacity, DecodePath, DecodeSeq, Pool, PrefillBuffer, PrefillCapacity, PrefillPath,
    PrefillSeq,
};
use v4pool::Class;

const POISON: i32 = -0x5a5a5a5b;
const TOPK: usize = 512;
const WIN: i32 = 128;

fn v41_ratios(drafts: usize) -> Vec<i32> {
    let mut r = vec![0, 0];
    r.extend([2; 18]);
    r.extend([1; 20]);
    r.extend(std::iter::repeat_n(0, drafts));
    r
}

/// A V4.1 compact pool with 16-byte rows (the index paths never touch the planes' bytes).
fn pool_on(backend: Arc<dyn Backend>, block: i64, ring: i64, blocks: i64, slots: i64) -> Arc<Pool> {
    let spec = GeometrySpec::new(v41_ratios(if ring > 128 { 3 } else { 0 }), blocks, slots, ring, block)
        .kv_sources(vec![2, 8, 14, 20])
        .form(RowForm::Compact);
    common::index_pool_of(backend, spec)
}

struct Seq {
    position: i64,
    ctx: i64,
    n: usize,
    table: Vec<i32>,
}

fn batch(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize, max_cols: usize) -> Vec<Seq> {
    let live: Vec<i64> = g.live_positions().collect();
    rng.distinct(bs, live.len() as u64)
        .into_iter()
        .map(|i| {
            let max_ctx = (max_cols as i64 * g.block_size).min(6 * g.block_size + 700);
            let ctx = rng.range(6, max_ctx);
            // DSpark verify: up to 6 tokens per step.
            let n = (rng.range(1, 6) as usize).min(ctx as usize);
            let cols = ((ctx + g.block_size - 1) / g.block_size) as usize;
            let table = (0..cols).map(|_| rng.below(g.num_blocks as u64) as i32).collect();
            Seq { position: live[i as usize], ctx, n, table }
        })
        .collect()
}

fn staged(seqs: &[Seq]) -> Vec<DecodeSeq<'_>> {
    seqs.iter().map(|s| DecodeSeq::new(s.position, s.ctx, s.n, &s.table)).collect()
}

/// The indexer's top-k `[max_tokens][TOPK]` for a layer of `ratio`: rows each token sees
/// (`visible_groups`) in the entries the pack reads, anything non-negative past them.
fn topk_rows(rng: &mut Rng, seqs: &[Seq], ratio: i64, max_tokens: usize) -> Vec<i32> {
    let mut rows: Vec<i32> = (0..max_tokens * TOPK).map(|_| rng.below(1 << 30) as i32).collect();
    let mut t = 0;
    for s in seqs {
        for k in 0..s.n {
            let visible = v4pool::geometry::visible_groups(s.ctx - s.n as i64 + k as i64, ratio) as u64;
            for i in 0..(visible as usize).min(TOPK) {
                rows[t * TOPK + i] = rng.below(visible) as i32;
            }
            t += 1;
        }
    }
    rows
}

fn poison(path: &DecodePath, be: &dyn Backend) {
    for c in Class::ALL {
        for which in [DecodeBuffer::Indices(c), DecodeBuffer::DestRows(c)] {
            if let Some(buf) = path.buffer(which) {
                let bytes = vec![POISON; buf.len as usize];
                // SAFETY: the path's own buffer, exactly its length in i32.
                unsafe { be.upload(buf.ptr, bytemuck::cast_slice(&bytes), Stream::DEFAULT).unwrap() };
            }
        }
    }
}

/// What a class's buffer must hold after the build and the pack of `layer` (for the
/// compressed slots): per token, its window tail (the class's ring rows, oldest first) after
/// its head of `layer`'s top-k translated to the owner's rows; poison past the slices. The
/// window is the token's last `WIN` positions in decode; in prefill (`prefill`) the part of
/// them before the chunk (the chunk's own rows are the extend buffer's).
fn reference(
    g: &UnifiedPoolGeometry,
    class: Class,
    layer: Option<usize>,
    seqs: &[Seq],
    topk: &[i32],
    prefill: bool,
) -> Vec<i32> {
    let ratio = g.class_ratio(class).unwrap().unwrap();
    let w = g.window_params(ratio).unwrap();
    let mut out = Vec::new();
    let mut t = 0usize;
    for s in seqs {
        for k in 0..s.n {
            let pos = s.ctx - s.n as i64 + k as i64;
            if let Some(l) = layer {
                let visible = v4pool::geometry::visible_groups(pos, i64::from(ratio)).min(TOPK as i64);
                let cap = g.layer_class(l).unwrap().block_rows;
                for i in 0..visible as usize {
                    let v = i64::from(topk[t * TOPK + i]);
                    let col = (v / cap).min(s.table.len() as i64 - 1);
                    let idx = g.compress_index(l, i64::from(s.table[col as usize]), v % cap).unwrap();
                    // The read lands on the owner's row.
                    let owner = g.owner(l).unwrap();
                    assert_eq!(
                        g.absolute_row(l, idx).unwrap(),
                        g.absolute_row(
                            owner,
                            g.compress_index(owner, i64::from(s.table[col as usize]), v % cap).unwrap()
                        )
                        .unwrap()
                    );
                    out.push(idx as i32);
                }
            }
            let n = (pos + 1).min(i64::from(WIN));
            let window = if prefill { pos + 1 - n..s.ctx - s.n as i64 } else { pos + 1 - n..pos + 1 };
            for p in window {
                out.push(w.index(s.position, p) as i32);
            }
            t += 1;
        }
    }
    out
}

/// One V4.1 case on `pool`: stage, poison, build, pack every compressed layer; after each
/// pack its slot's buffer equals the reference and the other slot's is unchanged.
fn run_case(pool: &Arc<Pool>, seed: u64, host_twin: Option<&Arc<Pool>>) {
    let g = pool.geometry().unwrap();
    let mut rng = Rng::new(seed);
    let max_cols = 40;
    let cap = DecodeCapacity::new(8, 48, max_cols, WIN, TOPK as i32);
    let mut path = pool.decode_path(cap).unwrap();
    let mut twin = host_twin.map(|h| h.decode_path(cap).unwrap());
    let bs = rng.range(1, 8) as usize;
    let seqs = batch(&mut rng, &g, bs, max_cols);
    let staged = staged(&seqs);
    poison(&path, pool.backend().as_ref());
    path.stage(&staged).unwrap();
    path.build().unwrap();
    if let (Some(t), Some(h)) = (twin.as_mut(), host_twin) {
        poison(t, h.backend().as_ref());
        t.stage(&staged).unwrap();
        t.build().unwrap();
    }
    let tokens: usize = seqs.iter().map(|s| s.n).sum();
    let indptr = |c: Class| path.read_i32(DecodeBuffer::Indptr(c)).unwrap();
    let check = |c: Class, layer: Option<usize>, topk: &[i32], what: &str| {
        let ptr = indptr(c);
        let got = path.read_i32(DecodeBuffer::Indices(c)).unwrap();
        let want = reference(&g, c, layer, &seqs, topk, false);
        let end = ptr[tokens] as usize;
        assert_eq!(&got[..end], &want[..], "{what}: {c} slices");
        assert!(got[end..].iter().all(|&x| x == POISON), "{what}: {c} past the slices");
        if let Some(t) = &twin {
            assert_eq!(got, t.read_i32(DecodeBuffer::Indices(c)).unwrap(), "{what}: {c} device vs host");
        }
    };
    // After the build: windows only (the heads are the packs'; no class-wide head fill).
    for c in [Class::Csa, Class::Hca] {
        let ptr = indptr(c);
        let got = path.read_i32(DecodeBuffer::Indices(c)).unwrap();
        let mut t = 0;
        let mut want_heads = Vec::new();
        for s in &seqs {
            for k in 0..s.n {
                let pos = s.ctx - s.n as i64 + k as i64;
                let r = i64::from(g.class_ratio(c).unwrap().unwrap());
                let head = v4pool::geometry::visible_groups(pos, r).min(TOPK as i64) as usize;
                want_heads.push((ptr[t] as usize, head));
                t += 1;
            }
        }
        for (start, head) in want_heads {
            assert!(got[start..start + head].iter().all(|&x| x == POISON), "{c}: a head the build filled");
        }
    }
    // Under the HIP runtime double every third layer: both classes, the class boundary (20)
    // and every KV source (2, 8, 14, 20) still packed.
    for layer in (2..40).step_by(common::sized(1, 3)) {
        let ratio = i64::from(g.layer_class(layer).unwrap().ratio);
        let rows = topk_rows(&mut rng, &seqs, ratio, cap.max_tokens);
        let be = pool.backend();
        let a = be.alloc_zeroed(4 * rows.len() as u64).unwrap();
        // SAFETY: a fresh allocation of exactly these bytes.
        unsafe { be.upload(a.ptr, bytemuck::cast_slice(&rows), Stream::DEFAULT).unwrap() };
        // SAFETY: [max_tokens][TOPK] non-negative i32 on the path's backend.
        unsafe { path.layer_pack(layer, a.ptr, TOPK as i32).unwrap() };
        if let (Some(t), Some(h)) = (&twin, host_twin) {
            let hb = h.backend();
            let ha = hb.alloc_zeroed(4 * rows.len() as u64).unwrap();
            // SAFETY: as above, on the host twin.
            unsafe {
                hb.upload(ha.ptr, bytemuck::cast_slice(&rows), Stream::DEFAULT).unwrap();
                t.layer_pack(layer, ha.ptr, TOPK as i32).unwrap();
            }
            check(g.layer_slot(layer).unwrap(), Some(layer), &rows, &format!("layer {layer}"));
            // SAFETY: the reads in `check` synchronised the stream.
            unsafe { hb.free(ha) };
        } else {
            check(g.layer_slot(layer).unwrap(), Some(layer), &rows, &format!("layer {layer}"));
        }
        // SAFETY: the reads above synchronised the stream.
        unsafe { be.free(a) };
    }
    // Dense windows and every destination row: equal to the twin's.
    if let Some(t) = &twin {
        for c in Class::ALL {
            for which in [DecodeBuffer::Indptr(c), DecodeBuffer::DestRows(c)] {
                assert_eq!(path.read_i32(which).unwrap(), t.read_i32(which).unwrap(), "{which:?}");
            }
        }
    }
    // Window-only layers are not packed; the single-CSA-buffer pack is refused.
    // SAFETY: refused before any launch (the pointer is never read).
    assert!(unsafe { path.layer_pack(0, 1, TOPK as i32) }.is_err());
    assert!(path.csa_pack_launch(1, TOPK as i32).is_err());
}

const SHAPES: [(i64, i64, i64); 3] = [(256, 128, 60), (16, 133, 960), (256, 133, 60)];

type Case = fn(&Arc<Pool>, u64, Option<&Arc<Pool>>);

/// Three cases of `case` per shape on the host (seeded by `name`).
fn on_the_host(name: &str, case: Case) {
    if common::host_only_under_double(name) {
        return;
    }
    for (i, &(block, ring, blocks)) in SHAPES.iter().enumerate() {
        let pool = pool_on(Arc::new(common::host()), block, ring, blocks, 8);
        for c in 0..3 {
            case(&pool, case_seed(name, (i * 10 + c) as u64), None);
        }
    }
}

/// Four cases of `case` per shape on the device (two under the HIP runtime double), each
/// against a host twin (SKIP without one).
fn on_the_device(test: &str, name: &str, case: Case) {
    let Some(dev) = device_or_skip(test) else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    for (i, &(block, ring, blocks)) in SHAPES.iter().enumerate() {
        let dpool = pool_on(dev.clone(), block, ring, blocks, 8);
        let hpool = pool_on(Arc::new(common::host()), block, ring, blocks, 8);
        for c in 0..common::sized(4, 2) {
            case(&dpool, case_seed(name, (i * 10 + c) as u64), Some(&hpool));
        }
        println!("ok {name}: V4.1 block {block} ring {ring}");
    }
}

#[test]
fn v41_decode_path_matches_the_geometry_on_the_host() {
    on_the_host("v41-host", run_case);
}

#[test]
fn v41_decode_path_on_the_device() {
    on_the_device("v41_decode_path_on_the_device", "v41-device", run_case);
}

/// A class is data: ratios no DeepSeek model uses (8 and 64, the envelope form, V4's
/// class-wide coarse head) go through the same decode path — slice lengths, window tails,
/// the coarse heads from the block tables and the fine pack — as the geometry says.
#[test]
fn other_ratios_take_the_same_decode_path() {
    if common::host_only_under_double("other_ratios_take_the_same_decode_path") {
        return;
    }
    let pool = common::index_pool_of(
        Arc::new(common::host()),
        GeometrySpec::new(vec![0, 8, 64, 8, 64, 0], 50, 8, 131, 256),
    );
    let g = pool.geometry().unwrap();
    assert_eq!((g.class_ratio(Class::Csa).unwrap(), g.class_ratio(Class::Hca).unwrap()), (Some(8), Some(64)));
    let mut rng = Rng::new(case_seed("other-ratios", 0));
    let cap = DecodeCapacity::new(8, 48, 40, WIN, TOPK as i32);
    let mut path = pool.decode_path(cap).unwrap();
    let seqs = batch(&mut rng, &g, 6, 40);
    let staged = staged(&seqs);
    poison(&path, pool.backend().as_ref());
    path.stage(&staged).unwrap();
    path.build().unwrap();
    let rows = topk_rows(&mut rng, &seqs, 8, cap.max_tokens);
    let be = pool.backend();
    let a = be.alloc_zeroed(4 * rows.len() as u64).unwrap();
    // SAFETY: a fresh allocation of exactly these bytes, then [max_tokens][TOPK] non-negative
    // i32 on the path's backend for the pack.
    unsafe {
        be.upload(a.ptr, bytemuck::cast_slice(&rows), Stream::DEFAULT).unwrap();
        path.csa_pack(a.ptr, TOPK as i32).unwrap();
    }
    let tokens: usize = seqs.iter().map(|s| s.n).sum();
    // The fine slot: the pack's heads then the window, as the V4.1 reference builds them.
    let ptr = path.read_i32(DecodeBuffer::Indptr(Class::Csa)).unwrap();
    let got = path.read_i32(DecodeBuffer::Indices(Class::Csa)).unwrap();
    assert_eq!(&got[..ptr[tokens] as usize], &reference(&g, Class::Csa, Some(1), &seqs, &rows, false)[..]);
    // The coarse slot: every committed row of ratio 64 from the block tables, then the window.
    let ptr = path.read_i32(DecodeBuffer::Indptr(Class::Hca)).unwrap();
    let got = path.read_i32(DecodeBuffer::Indices(Class::Hca)).unwrap();
    let w = g.window_params(64).unwrap();
    let mut want = Vec::new();
    for s in &seqs {
        for k in 0..s.n {
            let pos = s.ctx - s.n as i64 + k as i64;
            for e in 0..v4pool::geometry::visible_groups(pos, 64) {
                want.push(g.compress_index(2, i64::from(s.table[(e / 4) as usize]), e % 4).unwrap() as i32);
            }
            let n = (pos + 1).min(i64::from(WIN));
            want.extend((pos + 1 - n..=pos).map(|p| w.index(s.position, p) as i32));
        }
    }
    assert_eq!(&got[..ptr[tokens] as usize], &want[..]);
    assert!(got[ptr[tokens] as usize..].iter().all(|&x| x == POISON));
    // SAFETY: the reads above synchronised the stream.
    unsafe { be.free(a) };
}

/// A prefill forward: chunks of up to 300 tokens after 0..6 blocks of earlier context.
fn prefill_batch(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize, max_cols: usize) -> Vec<Seq> {
    let live: Vec<i64> = g.live_positions().collect();
    rng.distinct(bs, live.len() as u64)
        .into_iter()
        .map(|i| {
            let max_ctx = (max_cols as i64 * g.block_size).min(6 * g.block_size + 700);
            let n = rng.range(1, 300.min(max_ctx - 1)) as usize;
            let cs = if rng.below(4) == 0 { 0 } else { rng.range(0, max_ctx - n as i64) };
            let ctx = cs + n as i64;
            let cols = ((ctx + g.block_size - 1) / g.block_size) as usize;
            let table = (0..cols).map(|_| rng.below(g.num_blocks as u64) as i32).collect();
            Seq { position: live[i as usize], ctx, n, table }
        })
        .collect()
}

fn poison_prefill(path: &PrefillPath, be: &dyn Backend) {
    let mut bufs = vec![PrefillBuffer::ExtendIndices];
    bufs.extend(Class::ALL.map(PrefillBuffer::Indices));
    for which in bufs {
        if let Some(buf) = path.buffer(which) {
            let bytes = vec![POISON; buf.len as usize];
            // SAFETY: the path's own buffer, exactly its length in i32.
            unsafe { be.upload(buf.ptr, bytemuck::cast_slice(&bytes), Stream::DEFAULT).unwrap() };
        }
    }
}

/// One V4.1 prefill forward on `pool`: stage, poison, build (both compressed slots' heads
/// stay poisoned: no class-wide coarse fill), then pack every compressed layer; after each
/// pack its slot's buffer equals the reference (heads on the owner's rows, the earlier
/// chunks' window rows at the tail), and on a device every buffer equals the host twin's.
fn run_prefill_case(pool: &Arc<Pool>, seed: u64, host_twin: Option<&Arc<Pool>>) {
    let g = pool.geometry().unwrap();
    let mut rng = Rng::new(seed);
    let max_cols = 40;
    let cap = PrefillCapacity::new(4, 1200, max_cols, WIN, TOPK as i32);
    let mut path = pool.prefill_path(cap).unwrap();
    let mut twin = host_twin.map(|h| h.prefill_path(cap).unwrap());
    let bs = rng.range(1, 4) as usize;
    let seqs = prefill_batch(&mut rng, &g, bs, max_cols);
    let staged: Vec<PrefillSeq<'_>> =
        seqs.iter().map(|s| PrefillSeq::new(s.position, s.ctx - s.n as i64, s.n, &s.table)).collect();
    let tokens = path.stage(&staged).unwrap();
    poison_prefill(&path, pool.backend().as_ref());
    path.build().unwrap();
    if let (Some(t), Some(h)) = (twin.as_mut(), host_twin) {
        t.stage(&staged).unwrap();
        poison_prefill(t, h.backend().as_ref());
        t.build().unwrap();
    }
    let same_as_twin = |which: PrefillBuffer, what: &str| {
        if let Some(t) = &twin {
            assert_eq!(
                path.read_i32(which).unwrap(),
                t.read_i32(which).unwrap(),
                "{what}: {which:?} device vs host"
            );
        }
    };
    // After the build: each compressed slot holds the windows only, at the slices' tails.
    for c in [Class::Csa, Class::Hca] {
        let ptr = path.read_i32(PrefillBuffer::Indptr(c)).unwrap();
        let got = path.read_i32(PrefillBuffer::Indices(c)).unwrap();
        let ratio = i64::from(g.class_ratio(c).unwrap().unwrap());
        let (mut t, mut want) = (0, Vec::new());
        let w = g.window_params(ratio as i32).unwrap();
        for s in &seqs {
            let cs = s.ctx - s.n as i64;
            for p in cs..s.ctx {
                let head = v4pool::geometry::visible_groups(p, ratio).min(TOPK as i64) as usize;
                assert_eq!(
                    (ptr[t + 1] - ptr[t]) as usize,
                    head + (cs - (p - i64::from(WIN) + 1).max(0)).max(0) as usize
                );
                want.extend(std::iter::repeat_n(POISON, head));
                want.extend(((p - i64::from(WIN) + 1).max(0)..cs).map(|q| w.index(s.position, q) as i32));
                t += 1;
            }
        }
        assert_eq!(&got[..ptr[tokens] as usize], &want[..], "{c}: the build's windows");
        assert!(got[ptr[tokens] as usize..].iter().all(|&x| x == POISON), "{c}: past the slices");
        same_as_twin(PrefillBuffer::Indices(c), "build");
    }
    for which in [PrefillBuffer::ExtendIndices, PrefillBuffer::Indices(Class::Dense)] {
        same_as_twin(which, "build");
    }
    // Under the HIP runtime double every third layer: both classes, the class boundary (20)
    // and every KV source (2, 8, 14, 20) still packed.
    for layer in (2..40).step_by(common::sized(1, 3)) {
        let ratio = i64::from(g.layer_class(layer).unwrap().ratio);
        let rows = topk_rows(&mut rng, &seqs, ratio, cap.max_tokens);
        let slot = g.layer_slot(layer).unwrap();
        let pack = |p: &PrefillPath, be: &Arc<dyn Backend>| {
            let a = be.alloc_zeroed(4 * rows.len() as u64).unwrap();
            // SAFETY: a fresh allocation of exactly these bytes, then [max_tokens][TOPK]
            // non-negative i32 on the path's backend for the pack.
            unsafe {
                be.upload(a.ptr, bytemuck::cast_slice(&rows), Stream::DEFAULT).unwrap();
                p.layer_pack(layer, a.ptr, TOPK as i32).unwrap();
            }
            let got = p.read_i32(PrefillBuffer::Indices(slot)).unwrap();
            // SAFETY: the read synchronised the stream.
            unsafe { be.free(a) };
            got
        };
        let got = pack(&path, pool.backend());
        if let (Some(t), Some(h)) = (&twin, host_twin) {
            assert_eq!(got, pack(t, h.backend()), "layer {layer}: device vs host");
        }
        let end = path.read_i32(PrefillBuffer::Indptr(slot)).unwrap()[tokens] as usize;
        let want = reference(&g, slot, Some(layer), &seqs, &rows, true);
        assert_eq!(&got[..end], &want[..], "layer {layer}: {slot} slices");
        assert!(got[end..].iter().all(|&x| x == POISON), "layer {layer}: {slot} past the slices");
    }
    // Window-only layers are not packed; the single-CSA-buffer pack is refused.
    // SAFETY (both): refused before any launch (the pointer is never read).
    assert!(unsafe { path.layer_pack(0, 1, TOPK as i32) }.is_err());
    assert!(unsafe { path.csa_pack(1, TOPK as i32) }.is_err());
}

#[test]
fn v41_prefill_path_matches_the_geometry_on_the_host() {
    on_the_host("v41-prefill-host", run_prefill_case);
}

#[test]
fn v41_prefill_path_on_the_device() {
    on_the_device("v41_prefill_path_on_the_device", "v41-prefill-device", run_prefill_case);
}
