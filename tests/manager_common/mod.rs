//! Shared by the manager tests: a small pool on any backend, and a token engine that writes a
//! request's state the way a forward pass does — window rows through the ring-write kernel
//! (`v4pool_ring_write`), the compressor state through the §8 state-update kernel
//! (`v4pool_update_compressor_states`, the pool's `StateUpdate` handle), both launched on the
//! pool's backend, and each full block's compressed rows through the pool's write path.
//!
//! The pool's arena has the §2.1 fields (small dims, rings of exactly K rows: no spec slack,
//! so a ring's bytes after a forward depend only on the last K positions, never on how the
//! tokens were chunked). Each token's CSA compressor rows are a function of the token and of
//! the state row it replaces (the one K positions back, read from the pool before the
//! forward), so the CSA state chains through the whole history and a wrong restore shows up in
//! every later row; HCA rows depend on the token alone (HCA state is not carried: its ring is
//! rewritten by every resuming forward). Window rows derive from the token's CSA row. An
//! uninterrupted run and a run resumed from a checkpoint must end byte-identical.
#![allow(dead_code)]

use std::sync::Arc;
// The suite declares pool_common beside this module (one copy per binary).
pub(crate) use crate::pool_common;

use v4pool::backend::{Backend, Stream};
use v4pool::manager::{BlockHash, KvManager, Namespace, RequestId};
use v4pool::pool::Pool;
use v4pool::pool::SlotLease;
use v4pool::raw::arena::{Dtype, Fill, StateField};
use v4pool::raw::index::{ElemType, Launch, PlaneWrite, RingWriteArgs};
use v4pool::sizing::IndexerDtype;
use v4pool::state::update::{Compressor, StateInputs, StateSeq, StateUpdateCapacity};
use v4pool::ABSENT_RATIO;

pub use pool_common::WIDTHS;
pub const BLOCK: u64 = 256;

/// Elements per row of every state field of the small pool.
pub const STATE_DIM: u64 = 8;

/// The §2.1 fields at dim [`STATE_DIM`], two layers each, rings of exactly K rows.
fn state_fields() -> Vec<StateField> {
    let f = |name: &str, rows: i64, fill, carried| StateField {
        name: name.into(),
        layers: 2,
        shape: vec![rows as u64, STATE_DIM],
        dtype: Dtype::F32,
        fill,
        carried,
        align: 256,
    };
    let (csa, hca) = (Compressor::CsaMain.window(), Compressor::HcaMain.window());
    vec![
        f("csa_main_kv", csa, Fill::Zero, true),
        f("csa_main_score", csa, Fill::NegInf, true),
        f("csa_idx_kv", csa, Fill::Zero, true),
        f("csa_idx_score", csa, Fill::NegInf, true),
        f("hca_main_kv", hca, Fill::Zero, false),
        f("hca_main_score", hca, Fill::NegInf, false),
    ]
}

/// A small pool: ratios [0,4,128,4,128,0], ring 11, a 3-field arena in two planes, a plane
/// of `positions` slots' rows, carved empty (the manager sets the split). Its state is
/// written by the host (`forward`).
pub fn small_pool(backend: Arc<dyn Backend>, positions: i64) -> Arc<Pool> {
    small_pool_ring(backend, positions, 11)
}

/// As [`small_pool`] with another ring size (another checkpoint layout).
pub fn small_pool_ring(backend: Arc<dyn Backend>, positions: i64, ring: i64) -> Arc<Pool> {
    pool_with(backend, positions, ring, None)
}

/// As [`small_pool`] with the §2.1 arena (small dims): `forward` writes its state through the
/// state-update kernel.
pub fn state_pool(backend: Arc<dyn Backend>, positions: i64) -> Arc<Pool> {
    state_pool_ring(backend, positions, 11)
}

/// As [`state_pool`] with another ring size (another checkpoint layout).
pub fn state_pool_ring(backend: Arc<dyn Backend>, positions: i64, ring: i64) -> Arc<Pool> {
    pool_with(backend, positions, ring, Some(state_fields()))
}

fn pool_with(
    backend: Arc<dyn Backend>,
    positions: i64,
    ring: i64,
    fields: Option<Vec<StateField>>,
) -> Arc<Pool> {
    // Carved empty: the manager sets the split.
    let spec = pool_common::small_spec_with(
        &pool_common::RATIOS,
        &WIDTHS,
        IndexerDtype::Fp8,
        positions,
        ring,
        0,
        Some(0),
        fields,
    );
    Arc::new(Pool::new(backend, spec, Stream::DEFAULT).expect("pool"))
}

/// The SplitMix64 finaliser as a stateless hash of `x` (token ids, the synthetic model's
/// values); random draws come from `v4pool::sim::Rng`, as `tests/README.md` says.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub use pool_common::pattern;

/// Tokens of a conversation `family`, `len` long: families share their first `shared` tokens.
pub fn tokens(family: u64, len: usize, shared: usize) -> Vec<u32> {
    (0..len)
        .map(
            |i| {
                if i < shared {
                    mix(i as u64) as u32
                } else {
                    mix((family << 32) ^ i as u64 ^ 0x5555) as u32
                }
            },
        )
        .collect()
}

pub fn hashes(t: &[u32]) -> Vec<BlockHash> {
    v4pool::manager::chain_hashes(Namespace::from_label("test-model@1"), None, t, BLOCK as usize)
}

/// Byte ranges `(plane, offset in plane, len)` of the carried state of the slot at `position`.
pub fn state_ranges(pool: &Pool, position: i64) -> Vec<(usize, u64, u64)> {
    let g = &pool.spec().geometry;
    let (start, _) = g.slot_span(position).expect("position");
    let mut out = Vec::new();
    for (p, &w) in WIDTHS.iter().enumerate() {
        for (off, len) in pool.spec().arena.plane_checkpoint_ranges(p).expect("ranges") {
            out.push((p, start as u64 * w + off, len));
        }
    }
    out
}

/// The checkpoint image's byte ranges of the slot at `position`.
pub fn image_ranges(pool: &Pool, position: i64) -> Vec<(usize, u64, u64)> {
    let g = &pool.spec().geometry;
    let (start, _) = g.slot_span(position).expect("position");
    let mut out = Vec::new();
    for (p, r) in pool.checkpoint_ranges().expect("ranges").iter().enumerate() {
        for &(off, len) in r {
            out.push((p, start as u64 * WIDTHS[p] + off, len));
        }
    }
    out
}

/// The whole slot at `position`, both planes.
pub fn slot_ranges(pool: &Pool, position: i64) -> Vec<(usize, u64, u64)> {
    let g = &pool.spec().geometry;
    let (start, _) = g.slot_span(position).expect("position");
    pool.spec()
        .plane_widths
        .iter()
        .enumerate()
        .map(|(p, &w)| (p, start as u64 * w, g.slot_bytes(w)))
        .collect()
}

pub fn block_ranges(pool: &Pool, id: u32) -> Vec<(usize, u64, u64)> {
    let g = &pool.spec().geometry;
    let widths = &pool.spec().plane_widths;
    widths.iter().enumerate().map(|(p, &w)| (p, u64::from(id) * g.block_bytes(w), g.block_bytes(w))).collect()
}

pub use pool_common::read;

pub fn write(pool: &Pool, ranges: &[(usize, u64, u64)], bytes: &[u8]) {
    let mut at = 0usize;
    for &(p, off, len) in ranges {
        pool.write_plane(p, off, &bytes[at..at + len as usize]).expect("write");
        at += len as usize;
    }
}

/// A block's compressed rows as the engine writes them: a function of its hash.
pub fn block_content(pool: &Pool, h: &BlockHash) -> Vec<u8> {
    let n: u64 = block_ranges(pool, 0).iter().map(|r| r.2).sum();
    pattern(h.0 as u64 ^ (h.0 >> 64) as u64, n as usize)
}

/// A finite, non-zero value from hash bits (exact in bf16: at most 8 significant bits).
fn value(h: u64) -> f32 {
    let v = ((h % 255) as f32 - 127.0) / 16.0;
    if v == 0.0 {
        0.5
    } else {
        v
    }
}

/// The positional bias of compressor `c` at `layer`: `[ratio][STATE_DIM]` f32.
fn ape(c: Compressor, layer: u64) -> Vec<f32> {
    (0..c.ratio() as u64 * STATE_DIM).map(|i| value(mix(i ^ (layer << 20) ^ ((c as u64) << 24)))).collect()
}

/// Input element type of each compressor (both kinds exercised).
fn input_type(c: Compressor) -> ElemType {
    if c == Compressor::CsaIdx {
        ElemType::F32
    } else {
        ElemType::Bf16
    }
}

/// One compressor's ring at one layer as the host simulates it: `K` rows of `(kv, score)`.
struct Ring {
    c: Compressor,
    layer: u64,
    kv: Vec<[f32; STATE_DIM as usize]>,
    score: Vec<[f32; STATE_DIM as usize]>,
    /// The forward's input rows, in token order (raw element bytes).
    kv_in: Vec<u8>,
    score_in: Vec<u8>,
}

fn f32s(bytes: &[u8]) -> [f32; STATE_DIM as usize] {
    std::array::from_fn(|e| f32::from_ne_bytes(bytes[4 * e..4 * e + 4].try_into().expect("4 bytes")))
}

/// A row of input values of `c`'s element type from a hash; returns the values as f32 too.
fn input_row(h: u64, ty: ElemType, out: &mut Vec<u8>) -> [f32; STATE_DIM as usize] {
    std::array::from_fn(|e| {
        let v = value(mix(h ^ e as u64));
        match ty {
            ElemType::F32 => out.extend_from_slice(&v.to_ne_bytes()),
            ElemType::Bf16 => out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_ne_bytes()),
        }
        v
    })
}

/// The compressor state of the forward `t[from..to]` of the slot `lease`: every CSA token's
/// rows from the token and the ring row it replaces (simulated on the host from the pool's
/// rings), HCA rows from the token; then one `StateUpdate` launch per compressor and layer
/// (the kernel keeps the last K). Returns each token's digest (of its CSA main row).
fn update_state(pool: &Arc<Pool>, lease: SlotLease, t: &[u32], from: usize, to: usize) -> Vec<u64> {
    let mut rings = Vec::new();
    for c in Compressor::ALL {
        for layer in 0..2 {
            let (kv, score) = rings_of(pool, lease.position, c, layer);
            rings.push(Ring { c, layer, kv, score, kv_in: Vec::new(), score_in: Vec::new() });
        }
    }
    let mut digests = Vec::with_capacity(to - from);
    for (p, &token) in t.iter().enumerate().take(to).skip(from) {
        let tok = u64::from(token) ^ ((p as u64) << 32);
        for r in rings.iter_mut() {
            let k = r.c.window() as usize;
            let mut h = mix(tok ^ (r.layer << 56) ^ ((r.c as u64) << 60));
            if r.c != Compressor::HcaMain {
                for v in r.kv[p % k].iter().chain(&r.score[p % k]) {
                    h = mix(h ^ u64::from(v.to_bits()));
                }
            }
            let ty = input_type(r.c);
            let kv = input_row(h, ty, &mut r.kv_in);
            let score = input_row(mix(h ^ 0x5c0e), ty, &mut r.score_in);
            let ape = ape(r.c, r.layer);
            let a = (p as u64 % r.c.ratio() as u64 * STATE_DIM) as usize;
            r.kv[p % k] = kv;
            r.score[p % k] = std::array::from_fn(|e| score[e] + ape[a + e]);
        }
        let main = &rings[0].kv[p % Compressor::CsaMain.window() as usize];
        digests.push(main.iter().fold(tok, |d, v| mix(d ^ u64::from(v.to_bits()))));
    }
    // The kernel: one launch per compressor and layer over the forward's rows.
    let n = to - from;
    let mut upd = pool.state_update(StateUpdateCapacity::new(1, n)).expect("state update");
    let positions: Vec<i64> = (from as i64..to as i64).collect();
    let seq = StateSeq::new(lease.handle, 0, &positions, to as i64);
    upd.stage(&[seq]).expect("stage");
    let backend = pool.backend().clone();
    let stream = pool.stream();
    let mut allocs = Vec::new();
    for r in &rings {
        let ape_bytes: Vec<u8> = ape(r.c, r.layer).iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut ptrs = [0u64; 3];
        for (ptr, bytes) in ptrs.iter_mut().zip([&r.kv_in, &r.score_in, &ape_bytes]) {
            let a = backend.alloc_zeroed(bytes.len() as u64).expect("alloc");
            // SAFETY: a fresh allocation of exactly these bytes.
            unsafe { backend.upload(a.ptr, bytes, stream).expect("upload") };
            *ptr = a.ptr;
            allocs.push(a);
        }
        let inputs = StateInputs::default()
            .with_kv(ptrs[0])
            .with_score(ptrs[1])
            .with_ape(ptrs[2])
            .with_kv_row_stride(STATE_DIM as i64)
            .with_score_row_stride(STATE_DIM as i64)
            .with_rows(n as i64)
            .with_dim(STATE_DIM as i64)
            .with_dtype(input_type(r.c))
            .with_ape_dtype(ElemType::F32);
        // SAFETY: the inputs were just uploaded to the pool's backend with these shapes.
        unsafe { upd.update(r.c, r.layer, &inputs).expect("state update") };
    }
    backend.synchronize(stream).expect("sync");
    for a in allocs {
        // SAFETY: synchronised above; nothing uses the buffer.
        unsafe { backend.free(a) };
    }
    // The kernel left every ring as the host simulated it (the last K positions written).
    for r in &rings {
        let (kv, score) = rings_of(pool, lease.position, r.c, r.layer);
        let bits = |rows: &[[f32; STATE_DIM as usize]]| {
            rows.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert!(
            bits(&kv) == bits(&r.kv) && bits(&score) == bits(&r.score),
            "{:?} layer {}: state after the kernel",
            r.c,
            r.layer
        );
    }
    digests
}

/// The `(kv, score)` rings of compressor `c` at `layer` of the slot at `position`.
fn rings_of(
    pool: &Pool,
    position: i64,
    c: Compressor,
    layer: u64,
) -> (Vec<[f32; STATE_DIM as usize]>, Vec<[f32; STATE_DIM as usize]>) {
    let arena = &pool.spec().arena;
    let slot_rows = pool.spec().geometry.slot_rows;
    let row_bytes = (STATE_DIM * 4) as usize;
    let k = c.window() as usize;
    let read_ring = |name: &str| {
        let (plane, off) = arena
            .byte_offset(position, arena.field_index(name).expect("field"), layer, slot_rows)
            .expect("offset");
        let mut b = vec![0u8; k * row_bytes];
        pool.read_plane(plane, off, &mut b).expect("read state");
        b.chunks(row_bytes).map(f32s).collect::<Vec<_>>()
    };
    (read_ring(c.fields().0), read_ring(c.fields().1))
}

/// The carried state of the 3-field arena, written by the host: per token a digest of the
/// state before it, then the state absorbs the token. Returns the digests.
fn host_state(pool: &Pool, position: i64, t: &[u32], from: usize, to: usize) -> Vec<u64> {
    let sr = state_ranges(pool, position);
    let mut state = read(pool, &sr);
    let mut digests = Vec::with_capacity(to - from);
    for (k, &tok) in t[from..to].iter().enumerate() {
        let pos = (from + k) as u64;
        let mut d = mix(u64::from(tok) ^ (pos << 32));
        for chunk in state.chunks(64) {
            d = mix(d ^ u64::from(chunk[0]) ^ (u64::from(chunk[chunk.len() - 1]) << 8));
        }
        digests.push(d);
        let m = mix(d ^ 0x1234);
        for (j, b) in state.iter_mut().enumerate() {
            *b = b.wrapping_mul(31).wrapping_add((m >> ((j % 8) * 8)) as u8) ^ (j as u8);
        }
    }
    write(pool, &sr, &state);
    digests
}

/// The forward pass of tokens `t[from..to]` for a request holding `lease`: its compressor
/// state through the state-update kernel, its window rows (every layer, both planes, derived
/// from each token's state digest) through the ring-write kernel; full blocks get their
/// compressed rows.
pub fn forward(pool: &Arc<Pool>, lease: SlotLease, table: &[i32], t: &[u32], from: usize, to: usize) {
    if to <= from {
        return;
    }
    let g = pool.spec().geometry.clone();
    let position = lease.position;
    let n = to - from;
    // The §2.1 arena's state goes through the kernel; the 3-field arena's through the host.
    let kernel = pool.spec().arena.field_index(Compressor::CsaMain.fields().0).is_ok();
    let digests =
        if kernel { update_state(pool, lease, t, from, to) } else { host_state(pool, position, t, from, to) };
    // Window rows through the ring-write kernel, one launch per layer.
    let backend = pool.backend().clone();
    let stream = pool.stream();
    let ring = g.ring_slots as usize;
    let w = n.min(ring);
    let positions: Vec<i32> = (from..to).map(|p| p as i32).collect();
    let cu: Vec<i32> = vec![0, n as i32];
    let slot: Vec<i32> = vec![position as i32];
    let alloc = |bytes: &[u8]| {
        let a = backend.alloc_zeroed(bytes.len().max(4) as u64).expect("alloc");
        // SAFETY: a fresh allocation of at least `bytes.len()` bytes.
        unsafe { backend.upload(a.ptr, bytes, stream).expect("upload") };
        a
    };
    let pos_buf = alloc(bytemuck::cast_slice(&positions));
    let cu_buf = alloc(bytemuck::cast_slice(&cu));
    let slot_buf = alloc(bytemuck::cast_slice(&slot));
    let mut kv_bufs = Vec::new();
    for layer in 0..g.num_layers {
        let ratio = g.ratios[layer];
        if ratio == ABSENT_RATIO {
            continue;
        }
        let params = g.window_params(ratio).expect("params");
        let mut planes = [PlaneWrite::default(); 2];
        for (p, &width) in WIDTHS.iter().enumerate() {
            let mut kv = Vec::with_capacity(n * width as usize);
            for d in &digests {
                kv.extend(pattern(mix(*d ^ ((layer as u64) << 40) ^ ((p as u64) << 48)), width as usize));
            }
            let buf = alloc(&kv);
            let view = pool.layer_view(layer, p).expect("view");
            planes[p] =
                PlaneWrite::default().with_kv(buf.ptr).with_pool(view.ptr).with_row_bytes(width as i64);
            kv_bufs.push(buf);
        }
        let view_rows = pool.layer_view(layer, 0).expect("view").rows;
        let args = RingWriteArgs::default()
            .with_params(params)
            .with_planes(planes)
            .with_positions(pos_buf.ptr)
            .with_cu_seqlens_q(cu_buf.ptr)
            .with_state_slot_per_seq(slot_buf.ptr)
            .with_view_rows(view_rows)
            .with_num_seqs(1)
            .with_write_per_batch(w as i32);
        // SAFETY: every pointer is a live buffer of this backend sized for `n` tokens, or a
        // layer view of the pool; rows outside the view are dropped by the kernel.
        unsafe { backend.launch(&Launch::RingWrite(args), stream).expect("ring write") };
    }
    backend.synchronize(stream).expect("sync");
    for a in [pos_buf, cu_buf, slot_buf].into_iter().chain(kv_bufs) {
        // SAFETY: synchronised above; nothing uses the buffer.
        unsafe { backend.free(a) };
    }
    // Compressed rows of blocks that became full.
    let hs = hashes(&t[..to]);
    for b in from / BLOCK as usize..to / BLOCK as usize {
        let id = table[b] as u32;
        write(pool, &block_ranges(pool, id), &block_content(pool, &hs[b]));
    }
}

/// Run request `id` (tokens `t`) from its computed tokens to `to` through the manager:
/// chunks cut at `prefill_stop`, allocate, forward, commit, complete.
pub fn run_to(m: &mut KvManager, id: RequestId, t: &[u32], to: u64, chunk: u64) {
    loop {
        let done = m.computed_tokens(id).expect("request");
        if done >= to {
            break;
        }
        let mut n = m.prefill_stop(id, chunk).expect("stop");
        if n == 0 {
            n = 1; // past the prompt: decode one token at a time
        }
        let n = n.min(to - done);
        m.allocate(id, n).expect("allocate");
        let slot = m.slot(id).expect("slot").expect("running");
        let table = m.block_table(id).expect("table");
        forward(m.pool(), slot, &table, t, done as usize, (done + n) as usize);
        m.commit(id, n).expect("commit");
        m.complete_inflight().expect("complete");
    }
}

/// Assert two byte strings are equal, naming the first differing byte (not printing both).
pub fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let first = got.iter().zip(want).position(|(x, y)| x != y);
    assert!(first.is_none(), "{what}: first differing byte at {first:?}");
}

pub fn config(every: u32, rolling: bool) -> v4pool::manager::ManagerConfig {
    v4pool::manager::ManagerConfig::default().with_checkpoint_every(every).with_rolling(rolling)
}

fn table_contents(m: &KvManager, id: RequestId, blocks: usize) -> Vec<u8> {
    let table = m.block_table(id).expect("table");
    table[..blocks].iter().flat_map(|&b| read(m.pool(), &block_ranges(m.pool(), b as u32))).collect()
}

/// The exactness scenario on `backend`: turn 1 (prompt 1,000, decoded to 1,500) finishes;
/// turn 2 re-sends the history plus a new message (prompt 2,300), hits turn 1's last
/// checkpoint (1,280 = 5 blocks), is preempted while decoding at 2,450, resumes from its
/// rolling checkpoint at 2,304 and decodes to 2,600. Its slot (state and window rows, every
/// byte) and its blocks must equal an uninterrupted run of the same 2,600 tokens on a fresh
/// pool; each restored slot image must equal the storing request's image at that token.
pub fn exactness(backend: Arc<dyn Backend>) {
    use v4pool::manager::{ElasticPolicy, FixedPolicy};
    let t = tokens(1, 2600, 0);
    // The uninterrupted reference.
    let ref_pool = state_pool(backend.clone(), 40);
    let mut rm = KvManager::new(ref_pool, config(0, false), Box::new(FixedPolicy::new(2))).expect("manager");
    let r = rm.add_request(2300, hashes(&t));
    assert_eq!(rm.admit(r).expect("admit").hit_tokens, 0);
    run_to(&mut rm, r, &t, 2600, 512);
    let rpos = rm.slot(r).unwrap().unwrap().position;
    let want_slot = read(rm.pool(), &slot_ranges(rm.pool(), rpos));
    let want_blocks = table_contents(&rm, r, 10);

    let pool = state_pool(backend, 40);
    let mut m =
        KvManager::new(pool.clone(), config(2, true), Box::new(ElasticPolicy::default())).expect("manager");
    // Turn 1.
    let a = m.add_request(1000, hashes(&t[..1500]));
    assert_eq!(m.admit(a).expect("admit").hit_tokens, 0);
    run_to(&mut m, a, &t, 1280, 700);
    let pos = m.slot(a).unwrap().unwrap().position;
    let image_1280 = read(&pool, &image_ranges(&pool, pos));
    run_to(&mut m, a, &t, 1500, 700);
    m.finish(a).expect("finish");
    m.check_invariants().expect("invariants");
    // Turn 2: hits at 1,280 (turn 1's rolling checkpoint, its turn end).
    let b = m.add_request(2300, hashes(&t));
    let adm = m.admit(b).expect("admit");
    assert_eq!(adm.hit_tokens, 1280, "the hit ends at turn 1's last checkpoint");
    m.complete_inflight().expect("complete");
    same(&read(&pool, &image_ranges(&pool, adm.slot.position)), &image_1280, "restored image at 1,280");
    run_to(&mut m, b, &t, 2304, 700);
    let pos = m.slot(b).unwrap().unwrap().position;
    let image_2304 = read(&pool, &image_ranges(&pool, pos));
    run_to(&mut m, b, &t, 2450, 700);
    m.preempt(b).expect("preempt");
    m.check_invariants().expect("invariants");
    let adm = m.admit(b).expect("re-admit");
    assert_eq!(adm.hit_tokens, 2304, "resumption hits the rolling checkpoint");
    m.complete_inflight().expect("complete");
    same(&read(&pool, &image_ranges(&pool, adm.slot.position)), &image_2304, "restored image at 2,304");
    run_to(&mut m, b, &t, 2600, 700);
    let pos = m.slot(b).unwrap().unwrap().position;
    let got_slot = read(&pool, &slot_ranges(&pool, pos));
    same(&got_slot, &want_slot, "resumed slot against the uninterrupted run");
    same(&table_contents(&m, b, 10), &want_blocks, "blocks against the uninterrupted run");
    // Not all zeros or all one value: the test compares real content.
    assert!(want_slot.iter().filter(|&&x| x != want_slot[0]).count() > want_slot.len() / 4);
    m.finish(b).expect("finish");
    m.check_invariants().expect("invariants");
}
