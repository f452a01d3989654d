//! FlashMLA's index convention (index-buffers.md §3f, §5f) as test cases: random decode steps and
//! CSA packs as `Case`s (named buffers, poisoned outputs with slack), the launches that fill them,
//! and the expected FlashMLA buffers written from the convention itself — per token, a row of
//! `width` entries: the valid ones left (`page*64 + offset` = view index + the view's shift),
//! −1 to the row's limit (window and CSA rows: the width; HCA compressed rows: the first
//! multiple of 64 strictly past the length), the poison untouched past it, a length per token;
//! pads a row of −1 and length 0 — never from the code under test. Shared by `flashmla_indices` (host reference against the convention),
//! `index_emulated` (the kernel source against the host reference) and `gpu_flashmla_indices`
//! (CUDA against the host reference).
#![allow(dead_code)]

use crate::common::batches::DecodeBatch;
use crate::common::{Case, Rng, WIN};
use v4pool::geometry::WindowParams;
use v4pool::raw::index::{ClassBuffers, CsaPackArgs, DecodeIndexArgs, FlashMlaOut, Launch, CLASS_HCA};
use v4pool::{UnifiedPoolGeometry, CSA_RATIO, DENSE_RATIO, HCA_RATIO};

pub const POISON: i32 = -7;
/// Poisoned entries past every output: a store there is a store outside the buffer.
pub const SLACK: usize = 29;
const RATIOS: [i32; 3] = [DENSE_RATIO, CSA_RATIO, HCA_RATIO];

/// One class of a decode case: its CSR outputs (on or off) and its FlashMLA outputs.
#[derive(Clone, Debug)]
pub struct FlashClass {
    pub params: WindowParams,
    pub indptr: Vec<i32>,
    /// The CSR index buffer is written too.
    pub csr: bool,
    /// One shift per view (0..64, as `page_view` gives).
    pub shifts: Vec<i32>,
    /// Window row width.
    pub topk: i32,
    /// Compressed row width (HCA; 0 = no compressed part).
    pub extra_topk: i32,
}

/// A random decode step with FlashMLA outputs on every class of the geometry.
#[derive(Clone, Debug)]
pub struct FlashDecode {
    pub batch: DecodeBatch,
    pub envelope: i64,
    pub rpb: i32,
    pub classes: [Option<FlashClass>; 3],
}

/// Buffer indices of one class in the case (`None`: not in this case).
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassBufs {
    pub indptr: usize,
    pub csr: Option<usize>,
    pub dest: usize,
    pub indices: Option<usize>,
    pub topk_length: Option<usize>,
    pub extra: Option<usize>,
    pub extra_length: Option<usize>,
    pub shifts: Option<usize>,
}

/// A width of at least `need` entries: mostly FlashMLA's (a multiple of 64), sometimes exact
/// or ragged (the kernels take any width; only FlashMLA wants 64s).
fn width(rng: &mut Rng, need: i64) -> i32 {
    let need = need.max(1);
    (match rng.below(3) {
        0 => need,
        1 => need + rng.range(1, 70),
        _ => (need + 63) / 64 * 64 + 64 * rng.range(0, 1),
    }) as i32
}

impl FlashDecode {
    /// A step of `bs` sequences on `g` (positions to `max_pos`); the dense class when the
    /// geometry has it; random views (HCA: `hca_views`, as many as the model's HCA layers).
    pub fn random(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize, max_pos: i64, hca_views: usize) -> Self {
        let batch = DecodeBatch::generate(rng, g, bs, 512, max_pos, 0, 1);
        Self::from_batch(rng, g, batch, hca_views)
    }

    /// A step whose sequences straddle an HCA head of a multiple of 64 (the case "strictly
    /// past" exists for): each sequence's tokens at positions 8,192m + 126 + i, so its first
    /// token's head is 64m and the next ones' 64m + 1 (FlashMLA takes the longest as the batch
    /// entry's length); sequences of one token keep a random position.
    pub fn mtp_edge(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize, hca_views: usize) -> Self {
        let mut batch = DecodeBatch::generate(rng, g, bs, 512, 300, 0, 1);
        for b in 0..batch.bs {
            let p0 = 8_192 * rng.range(0, 4) + 126;
            let mut k = 0;
            for t in 0..batch.bid.len() {
                if batch.bid[t] == b as i32 {
                    batch.pos[t] = p0 + k;
                    k += 1;
                }
            }
            batch.ctx[b] = p0 + k;
        }
        let stride = batch.ctx.iter().map(|&c| crate::common::batches::columns(c)).max().unwrap_or(1);
        batch.stride = stride + rng.below(3) as usize;
        batch.tables = crate::common::batches::tables(rng, g, batch.bs, batch.stride);
        Self::from_batch(rng, g, batch, hca_views)
    }

    /// FlashMLA outputs on every class of `g` for `batch`.
    pub fn from_batch(rng: &mut Rng, g: &UnifiedPoolGeometry, batch: DecodeBatch, hca_views: usize) -> Self {
        let indptrs = [batch.dense_indptr(), batch.csa_indptr(), batch.hca_indptr()];
        let mut classes: [Option<FlashClass>; 3] = [None, None, None];
        for c in 0..3 {
            let Ok(params) = g.window_params(RATIOS[c]) else { continue };
            let views = if c == CLASS_HCA { hca_views } else { rng.range(1, 2) as usize };
            let extra_topk = if c == CLASS_HCA {
                let head = batch
                    .indptr(crate::common::batches::hca_head)
                    .windows(2)
                    .map(|w| i64::from(w[1] - w[0]))
                    .max()
                    .unwrap_or(0);
                width(rng, head)
            } else {
                0
            };
            classes[c] = Some(FlashClass {
                params,
                indptr: indptrs[c].clone(),
                csr: rng.chance(0.5),
                shifts: (0..views).map(|_| rng.range(0, 63) as i32).collect(),
                topk: width(rng, i64::from(WIN)),
                extra_topk,
            });
        }
        FlashDecode { batch, envelope: g.envelope_rows, rpb: (g.block_size / 128) as i32, classes }
    }

    fn t(&self) -> usize {
        self.batch.bid.len()
    }

    /// The case's buffers; `flash`: with the FlashMLA outputs, else the same launch in CSR mode
    /// (every class's CSR buffer on), for comparing the CSR part.
    #[allow(clippy::type_complexity)] // the case, where its class buffers sit, its launches
    pub fn case(
        &self,
        name: &str,
        seed: u64,
        flash: bool,
    ) -> (Case, [Option<ClassBufs>; 3], impl Fn(&[u64]) -> Vec<Launch> + 'static) {
        let b = &self.batch;
        let t = self.t();
        let mut case = Case::new(name, seed);
        let slots = case.i32s("state_slot_per_seq", &b.slots);
        let bid = case.i32s("batch_id_per_token", &b.bid);
        let pos = case.i64s("positions", &b.pos);
        let tables = case.i32s("block_tables", &b.tables);
        let mut bufs: [Option<ClassBufs>; 3] = [None, None, None];
        for (c, cls) in self.classes.iter().enumerate() {
            let Some(cls) = cls else { continue };
            let n = |s: &str| format!("c{c} {s}");
            let total = *cls.indptr.last().unwrap_or(&0) as usize;
            let mut cb = ClassBufs {
                indptr: case.i32s(&n("indptr"), &cls.indptr),
                dest: case.poisoned(&n("dest_rows"), t + SLACK, POISON),
                ..Default::default()
            };
            if cls.csr || !flash {
                cb.csr = Some(case.poisoned(&n("csr indices"), total + SLACK, POISON));
            }
            if flash {
                let views = cls.shifts.len();
                cb.shifts = Some(case.i32s(&n("shifts"), &cls.shifts));
                cb.indices =
                    Some(case.poisoned(&n("indices"), views * t * cls.topk as usize + SLACK, POISON));
                cb.topk_length = Some(case.poisoned(&n("topk_length"), t + SLACK, POISON));
                if cls.extra_topk > 0 {
                    let len = views * t * cls.extra_topk as usize + SLACK;
                    cb.extra = Some(case.poisoned(&n("extra_indices"), len, POISON));
                    cb.extra_length = Some(case.poisoned(&n("extra_topk_length"), t + SLACK, POISON));
                }
            }
            bufs[c] = Some(cb);
        }
        let (classes, envelope, rpb, stride) =
            (self.classes.clone(), self.envelope, self.rpb, b.stride as i32);
        let make = move |p: &[u64]| {
            let mut a = DecodeIndexArgs::default()
                .with_state_slot_per_seq(p[slots])
                .with_batch_id_per_token(p[bid])
                .with_positions(p[pos])
                .with_block_tables(p[tables])
                .with_envelope_rows(envelope)
                .with_block_table_stride(stride)
                .with_hca_rows_per_block(rpb)
                .with_num_tokens(t as i32)
                .with_win(WIN);
            for (c, (cls, cb)) in classes.iter().zip(&bufs).enumerate() {
                let (Some(cls), Some(cb)) = (cls, cb) else { continue };
                a.classes[c] = ClassBuffers::default()
                    .with_params(cls.params)
                    .with_indptr(p[cb.indptr])
                    .with_indices(cb.csr.map_or(0, |i| p[i]))
                    .with_dest_rows(p[cb.dest]);
                let Some(ix) = cb.indices else { continue };
                let at = |i: Option<usize>| i.map_or(0, |i| p[i]);
                a.flashmla[c] = FlashMlaOut::default()
                    .with_indices(p[ix])
                    .with_topk_length(at(cb.topk_length))
                    .with_extra_indices(at(cb.extra))
                    .with_extra_topk_length(at(cb.extra_length))
                    .with_shifts(at(cb.shifts))
                    .with_topk(cls.topk)
                    .with_extra_topk(if cb.extra.is_some() { cls.extra_topk } else { 0 })
                    .with_num_views(cls.shifts.len() as i32);
            }
            vec![Launch::Decode(a)]
        };
        (case, bufs, make)
    }

    /// Class `c`'s FlashMLA buffers from the convention: (indices, topk_length, extra_indices,
    /// extra_topk_length), each with its poisoned slack (the compressed pair empty without it).
    pub fn expected(&self, c: usize) -> [Vec<i32>; 4] {
        let cls = self.classes[c].as_ref().expect("class in the case");
        let b = &self.batch;
        let t = self.t();
        let tail = |mut v: Vec<i32>| {
            v.extend([POISON; SLACK]);
            v
        };
        let (mut ix, mut len, mut ex, mut exlen) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &shift in &cls.shifts {
            for i in 0..t {
                let live = b.bid[i] >= 0;
                let p = b.pos[i];
                let n = if live { (p + 1).min(i64::from(WIN)) } else { 0 };
                let slot = if live { i64::from(b.slots[b.bid[i] as usize]) } else { 0 };
                for k in 0..i64::from(cls.topk) {
                    let row = cls.params.index(slot, p - n + 1 + k);
                    ix.push(if k < n { (row + i64::from(shift)) as i32 } else { -1 });
                }
                if cls.extra_topk == 0 {
                    continue;
                }
                let head = if live { i64::from(cls.indptr[i + 1] - cls.indptr[i]) - n } else { 0 };
                let row0 = if live { b.bid[i] as usize * b.stride } else { 0 };
                let width = i64::from(cls.extra_topk);
                // Written through the first multiple of 64 strictly past the head (a pad: 64),
                // at most the width; past that the poison stays.
                let limit = ((head.max(0) / 64 + 1) * 64).min(width);
                for e in 0..width {
                    let rpb = i64::from(self.rpb);
                    // A negative block id (a raw launch's; `DecodePath` refuses them) names no
                    // row: -1, never a shifted negative that could land on another layer's.
                    let block = if e < head { i64::from(b.tables[row0 + (e / rpb) as usize]) } else { -1 };
                    ex.push(if e < head && block >= 0 {
                        (block * self.envelope + e % rpb + i64::from(shift)) as i32
                    } else if e < limit {
                        -1
                    } else {
                        POISON
                    });
                }
            }
        }
        for i in 0..t {
            let live = b.bid[i] >= 0;
            let n = if live { (b.pos[i] + 1).min(i64::from(WIN)) } else { 0 };
            len.push(n as i32);
            if cls.extra_topk > 0 {
                exlen.push(if live { cls.indptr[i + 1] - cls.indptr[i] - n as i32 } else { 0 });
            }
        }
        let compressed = cls.extra_topk > 0;
        [
            tail(ix),
            tail(len),
            if compressed { tail(ex) } else { Vec::new() },
            if compressed { tail(exlen) } else { Vec::new() },
        ]
    }
}

/// What FlashMLA's sparse decode reads of a `[T][width]` operand (`rows`, one view) when each
/// batch entry (a sequence: its tokens, `bid`) is given one length, the longest of its tokens'
/// (`lengths`): per token, entries `0..ceil64(L)` loaded, those at or past `L` made −1
/// (FlashMLA 9241ae3, csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh: get_cur_req_info and the
/// MODEL1 check before the K loads). A pad is a batch entry of its own. Returns, per token, the
/// entries as FlashMLA uses them, or the first loaded entry that is the poison (a row entry
/// the builder never wrote).
pub fn flashmla_reads(
    rows: &[i32],
    lengths: &[i32],
    bid: &[i32],
    width: usize,
) -> Result<Vec<Vec<i32>>, String> {
    let t = bid.len();
    let mut out = Vec::with_capacity(t);
    for i in 0..t {
        let l = if bid[i] < 0 {
            lengths[i]
        } else {
            (0..t).filter(|&j| bid[j] == bid[i]).map(|j| lengths[j]).max().unwrap_or(0)
        } as usize;
        let loaded = l.div_ceil(64) * 64;
        let mut used = Vec::with_capacity(l);
        for e in 0..loaded.min(width) {
            let v = rows[i * width + e];
            if e < l && v == POISON {
                return Err(format!("token {i} entry {e}: unwritten, under the batch entry's length {l}"));
            }
            used.push(if e < l { v } else { -1 });
        }
        out.push(used);
    }
    Ok(out)
}

/// A random CSA translate-pack in FlashMLA mode on a decode batch: transformers-style top-k rows
/// (`[valid ids | −1 tail]`, an occasional −1 inside the valid part), the layer's shift and bias.
#[derive(Clone, Debug)]
pub struct FlashPack {
    pub batch: DecodeBatch,
    pub indptr: Vec<i32>,
    pub topk: Vec<i32>,
    pub row_stride: i32,
    pub extra_topk: i32,
    pub shift: i32,
    pub bias: i64,
    pub envelope: i64,
    pub cap: i32,
}

impl FlashPack {
    pub fn random(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize, max_pos: i64, index_topk: i64) -> Self {
        let batch = DecodeBatch::generate(rng, g, bs, index_topk, max_pos, 0, 1);
        let indptr = batch.csa_indptr();
        let cap = (g.block_size / 4) as i32;
        let row_stride = index_topk as i32 + rng.range(0, 3) as i32;
        let t = batch.bid.len();
        let mut topk = vec![0i32; t * row_stride as usize];
        for i in 0..t {
            let b = batch.bid[i];
            let rows = if b < 0 { 0 } else { (batch.ctx[b as usize] / 4).min((batch.pos[i] + 1) / 4) };
            let valid =
                if b < 0 { 0 } else { i64::from(indptr[i + 1] - indptr[i]) - (batch.pos[i] + 1).min(128) };
            for k in 0..row_stride as usize {
                topk[i * row_stride as usize + k] = if (k as i64) < valid && !rng.chance(0.05) {
                    rng.range(0, (rows - 1).max(0)) as i32
                } else {
                    -1
                };
            }
        }
        FlashPack {
            batch,
            indptr,
            topk,
            row_stride,
            extra_topk: width(rng, index_topk),
            shift: rng.range(0, 63) as i32,
            bias: if rng.chance(0.3) { rng.range(1, 50) } else { 0 },
            envelope: g.envelope_rows,
            cap,
        }
    }

    /// The case (outputs: `out` rows, `extra_topk_length`) and its launch.
    pub fn case(
        &self,
        name: &str,
        seed: u64,
    ) -> (Case, [usize; 2], impl Fn(&[u64]) -> Vec<Launch> + 'static) {
        let b = &self.batch;
        let t = b.bid.len();
        let mut case = Case::new(name, seed);
        let topk = case.i32s("topk", &self.topk);
        let tables = case.i32s("block_tables", &b.tables);
        let pos = case.i64s("positions", &b.pos);
        let indptr = case.i32s("indptr", &self.indptr);
        let bid = case.i32s("batch_id_per_token", &b.bid);
        let out = case.poisoned("extra_indices", t * self.extra_topk as usize + SLACK, POISON);
        let len = case.poisoned("extra_topk_length", t + SLACK, POISON);
        let a = CsaPackArgs::default()
            .with_envelope_rows(self.envelope)
            .with_topk_row_stride(self.row_stride)
            .with_block_table_stride(b.stride as i32)
            .with_num_tokens(t as i32)
            .with_block_capacity(self.cap)
            .with_window_size(WIN)
            .with_compress_ratio(CSA_RATIO)
            .with_compress_bias(self.bias)
            .with_extra_topk(self.extra_topk)
            .with_shift(self.shift);
        let make = move |p: &[u64]| {
            vec![Launch::CsaPack(
                a.with_topk(p[topk])
                    .with_block_tables(p[tables])
                    .with_positions(p[pos])
                    .with_indptr(p[indptr])
                    .with_batch_id_per_token(p[bid])
                    .with_out(p[out])
                    .with_extra_topk_length(p[len]),
            )]
        };
        (case, [out, len], make)
    }

    /// (rows, lengths) from the convention, with their poisoned slack.
    pub fn expected(&self) -> [Vec<i32>; 2] {
        let b = &self.batch;
        let t = b.bid.len();
        let (mut rows, mut lens) = (Vec::new(), Vec::new());
        for i in 0..t {
            let live = b.bid[i] >= 0;
            let valid = if live {
                i64::from(self.indptr[i + 1] - self.indptr[i]) - (b.pos[i] + 1).min(128)
            } else {
                0
            };
            for k in 0..i64::from(self.extra_topk) {
                let v = if k < valid { self.topk[i * self.row_stride as usize + k as usize] } else { -1 };
                rows.push(if v < 0 {
                    -1
                } else {
                    let block = b.tables[b.bid[i] as usize * b.stride + (v / self.cap) as usize];
                    (i64::from(block) * self.envelope
                        + i64::from(v % self.cap)
                        + self.bias
                        + i64::from(self.shift)) as i32
                });
            }
            lens.push(valid.max(0) as i32);
        }
        rows.extend([POISON; SLACK]);
        lens.extend([POISON; SLACK]);
        [rows, lens]
    }
}

/// Run a case's launches on host memory through `run` (the host reference or the emulated
/// kernel), returning every buffer's final bytes. Buffers are 8-byte aligned.
pub fn run_in_memory(
    case: &Case,
    make: &dyn Fn(&[u64]) -> Vec<Launch>,
    run: &dyn Fn(&Launch),
) -> Vec<Vec<u8>> {
    let mut mem: Vec<Vec<u64>> = Vec::new();
    let mut lens = Vec::new();
    for b in &case.bufs {
        let crate::common::Content::Bytes(bytes) = &b.content else { panic!("{}: plain bytes only", b.name) };
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        mem.push(words);
        lens.push(bytes.len());
    }
    let ptrs: Vec<u64> = mem.iter().map(|m| m.as_ptr() as u64).collect();
    for l in make(&ptrs) {
        run(&l);
    }
    mem.iter().zip(lens).map(|(m, n)| bytemuck::cast_slice::<u64, u8>(m)[..n].to_vec()).collect()
}

/// A buffer's bytes as i32.
pub fn words(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The 584 bytes FlashMLA's V4 sparse decode reads for KV index `index` of a cache `[num_blocks,
/// page_block_size, 1, 584]` that starts at `view[0]` with a block stride of `stride0` bytes
/// (`kv.stride(0)`): its data (448 e4m3 NoPE, 64 bf16 RoPE) then its 7 e8m0 scales and the pad,
/// the order `v4pool::format` packs a row in. FlashMLA's own arithmetic (deepseek-ai/FlashMLA at
/// 9241ae3, `csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`): `block = index / page_block_size`,
/// `rel = index mod page_block_size`, the data at `block × stride0 + rel × 576`, the scales at
/// `block × stride0 + page_block_size × 576 + rel × 8`; its API (`csrc/api/sparse_decode.h`)
/// takes any page size with `stride(1) == 584`. Written from that text, not from
/// `v4pool::format`. `None` for a negative index (FlashMLA skips −1) or bytes past the view.
pub fn flashmla_v4_read(view: &[u8], page_block_size: usize, stride0: usize, index: i64) -> Option<Vec<u8>> {
    let index = usize::try_from(index).ok()?;
    let (block, rel) = (index / page_block_size, index % page_block_size);
    let data = block * stride0 + rel * 576;
    let scales = block * stride0 + page_block_size * 576 + rel * 8;
    let mut row = view.get(data..data + 576)?.to_vec();
    row.extend_from_slice(view.get(scales..scales + 8)?);
    Some(row)
}
