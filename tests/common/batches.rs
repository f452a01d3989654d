//! Random decode and prefill batches on a geometry, with the host-side sizes of the contract
//! (index-buffers.md §3, §5, §6): indptrs, heads, block tables.

use super::{Rng, BLOCK_SIZE, WIN};
use v4pool::UnifiedPoolGeometry;

/// A sequence's first position: mostly anywhere up to 1,000,000, often small, often right at
/// a block or ring boundary (where the HCA head and the window wrap change).
pub fn start_position(rng: &mut Rng, max_pos: i64) -> i64 {
    match rng.below(4) {
        0 => rng.range(0, 300.min(max_pos)),
        1 => {
            let edge = [128, 256, 4, 64][rng.below(4) as usize];
            let m = rng.range(0, max_pos / edge) * edge;
            (m + rng.range(-2, 2)).clamp(0, max_pos)
        }
        _ => rng.range(0, max_pos),
    }
}

/// `count` distinct physical slots of the geometry's live groups.
pub fn slots(rng: &mut Rng, g: &UnifiedPoolGeometry, count: usize) -> Vec<i32> {
    rng.distinct(count, g.num_slots as u64)
        .into_iter()
        .map(|group| g.physical_slot(group).expect("group in range") as i32)
        .collect()
}

/// Block tables `[bs, stride]` of random blocks of the geometry; every column is a valid block.
pub fn tables(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize, stride: usize) -> Vec<i32> {
    (0..bs * stride).map(|_| rng.below(g.num_blocks.max(1) as u64) as i32).collect()
}

/// Up to `most` (at least one) random entries of `tables` made negative block ids (−1 to −3):
/// what only a raw launch can carry (`DecodePath` refuses them).
pub fn negative_ids(rng: &mut Rng, tables: &mut [i32], most: i64) {
    for _ in 0..rng.range(1, most) {
        let i = rng.below(tables.len() as u64) as usize;
        tables[i] = -(rng.range(1, 3) as i32);
    }
}

/// Columns a context of `ctx` tokens needs.
pub fn columns(ctx: i64) -> usize {
    ((ctx + BLOCK_SIZE - 1) / BLOCK_SIZE).max(1) as usize
}

pub fn window_len(p: i64) -> i64 {
    (p + 1).min(i64::from(WIN))
}

pub fn csa_head(p: i64, ctx: i64, topk: i64) -> i64 {
    ((p + 1) / 4).min(ctx / 4).min(topk)
}

/// v4pool sizes the decode HCA head per token (causal, §13).
pub fn hca_head(p: i64, ctx: i64) -> i64 {
    ((p + 1) / 128).min(ctx / 128)
}

/// Exclusive cumsum of per-token lengths, `len + 1` long.
pub fn cumsum(lens: impl IntoIterator<Item = i64>) -> Vec<i32> {
    let mut v = vec![0i32];
    for l in lens {
        let next = i64::from(*v.last().unwrap_or(&0)) + l;
        v.push(i32::try_from(next).expect("index buffer fits i32"));
    }
    v
}

/// One decode step: `bs` sequences of 1..=1+spec tokens each, then pad tokens (batch id −1)
/// up to `t_pad`.
#[derive(Clone, Debug)]
pub struct DecodeBatch {
    pub bs: usize,
    pub slots: Vec<i32>,
    /// Context length per sequence after this step (including its tokens).
    pub ctx: Vec<i64>,
    pub bid: Vec<i32>,
    pub pos: Vec<i64>,
    /// Live tokens; `bid.len()` is the padded count.
    pub live: usize,
    pub stride: usize,
    pub tables: Vec<i32>,
    pub topk: i64,
}

impl DecodeBatch {
    /// `min_pad`: the padded token count is at least this (graph replays use a fixed grid).
    pub fn generate(
        rng: &mut Rng,
        g: &UnifiedPoolGeometry,
        bs: usize,
        topk: i64,
        max_pos: i64,
        min_pad: usize,
        min_stride: usize,
    ) -> Self {
        let spec = (g.ring_slots - i64::from(WIN)).clamp(0, 3);
        let slots = slots(rng, g, bs);
        let (mut bid, mut pos, mut ctx) = (Vec::new(), Vec::new(), Vec::new());
        for b in 0..bs {
            let k = rng.range(1, 1 + spec);
            let p0 = start_position(rng, max_pos);
            for i in 0..k {
                bid.push(b as i32);
                pos.push(p0 + i);
            }
            ctx.push(p0 + k);
        }
        let live = bid.len();
        let t_pad = (live + rng.below(9) as usize).max(min_pad);
        while bid.len() < t_pad {
            // Pad tokens carry junk positions: the kernels must skip them entirely.
            bid.push(-1);
            pos.push(rng.range(-5, 2_000_000));
        }
        let stride =
            ctx.iter().map(|&c| columns(c)).max().unwrap_or(1).max(min_stride) + rng.below(3) as usize;
        let tables = tables(rng, g, bs, stride);
        DecodeBatch { bs, slots, ctx, bid, pos, live, stride, tables, topk }
    }

    /// Indptr of a class whose live token `t` holds `len(pos, ctx)` entries; pads hold none.
    pub fn indptr(&self, len: impl Fn(i64, i64) -> i64) -> Vec<i32> {
        cumsum(self.bid.iter().zip(&self.pos).map(
            |(&b, &p)| {
                if b < 0 {
                    0
                } else {
                    len(p, self.ctx[b as usize])
                }
            },
        ))
    }

    pub fn dense_indptr(&self) -> Vec<i32> {
        self.indptr(|p, _| window_len(p))
    }

    pub fn csa_indptr(&self) -> Vec<i32> {
        let k = self.topk;
        self.indptr(|p, c| csa_head(p, c, k) + window_len(p))
    }

    pub fn hca_indptr(&self) -> Vec<i32> {
        self.indptr(|p, c| hca_head(p, c) + window_len(p))
    }

    pub fn t_pad(&self) -> usize {
        self.bid.len()
    }

    /// Top-k rows `[T, row_stride]`: the first `valid_k` of each live row are compressed CSA
    /// rows of the sequence (a few past its table, which the kernel clamps); the rest junk.
    pub fn topk_rows(&self, rng: &mut Rng, row_stride: usize) -> Vec<i32> {
        let mut out = Vec::with_capacity(self.t_pad() * row_stride);
        for (&b, &p) in self.bid.iter().zip(&self.pos) {
            let valid = if b < 0 { 0 } else { csa_head(p, self.ctx[b as usize], self.topk) as usize };
            let rows = if b < 0 { 1 } else { (self.ctx[b as usize] / 4).max(1) };
            for k in 0..row_stride {
                out.push(if k < valid {
                    if rng.chance(0.02) {
                        (self.stride as i64 * 64 + rng.range(0, 500)) as i32
                    } else {
                        rng.range(0, rows - 1) as i32
                    }
                } else if rng.chance(0.5) {
                    -1
                } else {
                    rng.next_u64() as i32
                });
            }
        }
        out
    }
}

/// One prefill forward: `bs` sequences, each a chunk of consecutive positions; no pads.
#[derive(Clone, Debug)]
pub struct PrefillBatch {
    pub bs: usize,
    pub slots: Vec<i32>,
    pub chunk_start: Vec<i64>,
    pub cu_q: Vec<i32>,
    pub n_committed: Vec<i32>,
    pub ctx: Vec<i64>,
    pub pos: Vec<i32>,
    pub bid: Vec<i32>,
    pub stride: usize,
    pub tables: Vec<i32>,
    pub topk: i64,
}

pub struct PrefillToken {
    pub ext: i64,
    pub pre: i64,
    pub n_hca: i64,
    pub csa_head: i64,
}

impl PrefillBatch {
    /// Sequences until `max_tokens` tokens or `max_entries` HCA index entries.
    pub fn generate(
        rng: &mut Rng,
        g: &UnifiedPoolGeometry,
        max_seqs: usize,
        max_tokens: usize,
        max_entries: i64,
        topk: i64,
        max_pos: i64,
    ) -> Self {
        let mut b = PrefillBatch {
            bs: 0,
            slots: Vec::new(),
            chunk_start: Vec::new(),
            cu_q: vec![0],
            n_committed: Vec::new(),
            ctx: Vec::new(),
            pos: Vec::new(),
            bid: Vec::new(),
            stride: 1,
            tables: Vec::new(),
            topk,
        };
        let mut entries = 0i64;
        while b.bs < max_seqs {
            let cs = if rng.chance(0.3) { 0 } else { start_position(rng, max_pos) };
            let len = match rng.below(3) {
                0 => rng.range(1, 8),
                1 => rng.range(100, 300),
                _ => rng.range(1, 2000),
            };
            // HCA entries per token are at most ctx/128 + win.
            let cost = len * ((cs + len) / 128 + i64::from(WIN));
            if b.pos.len() + len as usize > max_tokens || entries + cost > max_entries {
                if b.bs == 0 {
                    continue;
                }
                break;
            }
            entries += cost;
            let seq = b.bs as i32;
            for i in 0..len {
                b.pos.push((cs + i) as i32);
                b.bid.push(seq);
            }
            b.chunk_start.push(cs);
            b.ctx.push(cs + len);
            b.n_committed.push(((cs + len) / 128) as i32);
            b.cu_q.push(b.pos.len() as i32);
            b.bs += 1;
        }
        b.slots = slots(rng, g, b.bs);
        b.stride = b.ctx.iter().map(|&c| columns(c)).max().unwrap_or(1) + rng.below(3) as usize;
        b.tables = tables(rng, g, b.bs, b.stride);
        b
    }

    pub fn token(&self, t: usize) -> PrefillToken {
        let b = self.bid[t] as usize;
        let p = i64::from(self.pos[t]);
        let cs = self.chunk_start[b];
        let w = i64::from(WIN);
        let low = (p - w + 1).max(0);
        PrefillToken {
            ext: (p - cs + 1).min(w),
            pre: (cs - low).max(0),
            n_hca: ((p + 1) / 128).min(i64::from(self.n_committed[b])),
            csa_head: csa_head(p, self.ctx[b], self.topk),
        }
    }

    pub fn indptr(&self, f: impl Fn(&PrefillToken) -> i64) -> Vec<i32> {
        cumsum((0..self.pos.len()).map(|t| f(&self.token(t))))
    }

    pub fn num_tokens(&self) -> usize {
        self.pos.len()
    }

    /// Top-k rows `[T, row_stride]` for the prefill CSA pack.
    pub fn topk_rows(&self, rng: &mut Rng, row_stride: usize) -> Vec<i32> {
        let mut out = Vec::with_capacity(self.num_tokens() * row_stride);
        for t in 0..self.num_tokens() {
            let tok = self.token(t);
            let rows = (self.ctx[self.bid[t] as usize] / 4).max(1);
            for k in 0..row_stride as i64 {
                out.push(if k < tok.csa_head { rng.range(0, rows - 1) as i32 } else { -1 });
            }
        }
        out
    }
}
