//! The prefill index path's buffers (`index-buffers.md` §6): one launch per prefill forward
//! writes the extend rows, the dense window slices, the CSA window tails and the HCA
//! `[window | compressed]` slices; the CSA heads come from the translate-pack in prefill
//! mode (§5, `window_size = 0`, the per-token skip being the token's earlier-chunk window).
//!
//! Where layers share compressors (V4.1, no class-wide coarse head fill) both compressed
//! slots are `[top-k head | window tail]`: the builder writes the window tails only and
//! every compressed layer's translate-pack fills its slot's heads with the slot's ratio and
//! the layer's compress bias ([`crate::pool::PrefillPath::layer_pack`]), as in decode.
//!
//! The host computes per token only the slice lengths and their prefix sums, and per
//! sequence the chunk start, the row of its first token and its committed HCA rows; a
//! forward uploads that and the block tables once. The one public form is
//! [`crate::pool::PrefillPath`]: these buffers (crate-private) with the pool they index.

use super::decode::{
    add_tokens, check_batch_len, check_blocks, check_capacity, check_live, check_seq, class_slice_lens,
    pack_slot, read_columns, slot_ratios, DecodeError, PackTargets, PoolBounds,
};
use super::owned::{Carve, DeviceBuffer, Owned};
use crate::backend::{Backend, Stream};
use crate::geometry::NUM_SLOTS;
use crate::geometry::{Class, UnifiedPoolGeometry, WindowParams, CSA_RATIO, HCA_RATIO};

/// V4's fine and coarse slot ratios (4, 128), for the V4 form of the slice lengths.
const V4_SLOT_RATIOS: [i64; 2] = [CSA_RATIO as i64, HCA_RATIO as i64];
use crate::index::{CsaPackArgs, DevicePtr, Launch, PrefillIndexArgs};
use std::sync::Arc;

/// Capacities the prefill buffers are sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefillCapacity {
    /// Sequences (chunks) in one forward.
    pub max_seqs: usize,
    /// Tokens in one forward.
    pub max_tokens: usize,
    /// Block-table columns per sequence.
    pub max_blocks_per_seq: usize,
    /// Sliding window `win` (1..=ring_slots).
    pub win: i32,
    /// CSA top-k reserved per token (`index_topk`, ≥ 0).
    pub index_topk: i32,
    /// Entries of the HCA prefix buffer; `None` sizes it for the worst case
    /// (`max_tokens × (win − 1 + longest context / 128)`), which at 8K tokens and 1M
    /// context is ~260 MB — engines that bound a forward's context pass their own bound and
    /// `stage` refuses a forward that exceeds it. Packed per layer (V4.1) the worst case is
    /// the CSA buffer's, `max_tokens × (win − 1 + min(index_topk, longest context / ratio))`.
    pub max_hca_entries: Option<u64>,
}

impl PrefillCapacity {
    /// Every required capacity given, the HCA prefix buffer sized for the worst case
    /// ([`PrefillCapacity::for_pool`] takes the window and top-k from the pool's spec).
    pub fn new(
        max_seqs: usize,
        max_tokens: usize,
        max_blocks_per_seq: usize,
        win: i32,
        index_topk: i32,
    ) -> Self {
        PrefillCapacity { max_seqs, max_tokens, max_blocks_per_seq, win, index_topk, max_hca_entries: None }
    }
}

crate::setters::with_setters!(PrefillCapacity {
    with_win(win: i32),
    with_index_topk(index_topk: i32),
    with_max_hca_entries(max_hca_entries: Some(u64)),
});

impl PrefillCapacity {
    /// Buffers for `max_seqs` chunks of `max_tokens` tokens and `max_blocks_per_seq`
    /// block-table columns on `pool`, at the window and index top-k of the pool's spec, with
    /// the HCA prefix buffer sized for the worst case (set `max_hca_entries` to bound it).
    pub fn for_pool(
        pool: &super::Pool,
        max_seqs: usize,
        max_tokens: usize,
        max_blocks_per_seq: usize,
    ) -> Result<Self, super::PoolError> {
        let kv = pool.kv_spec()?;
        Ok(PrefillCapacity {
            max_seqs,
            max_tokens,
            max_blocks_per_seq,
            win: kv.window(),
            index_topk: kv.index_topk(),
            max_hca_entries: None,
        })
    }
}

/// One sequence's chunk of a prefill forward.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct PrefillSeq<'a> {
    /// Physical slot (a position from `physical_slot`).
    pub position: i64,
    /// Absolute position of the chunk's first token (tokens before it are in the pool).
    pub chunk_start: i64,
    /// Tokens of the chunk (≥ 1); its context afterwards is `chunk_start + num_tokens`.
    pub num_tokens: usize,
    /// Logical → physical block ids covering the context after the chunk.
    pub block_table: &'a [i32],
}

impl<'a> PrefillSeq<'a> {
    /// One prefill sequence, every field given (the struct is `#[non_exhaustive]`: a field added later
    /// gets a default here and a setter).
    pub fn new(position: i64, chunk_start: i64, num_tokens: usize, block_table: &'a [i32]) -> Self {
        PrefillSeq { position, chunk_start, num_tokens, block_table }
    }
}

/// One sub-buffer of the prefill path, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillBuffer {
    /// i32 `[max_tokens]`: position of each token.
    Positions,
    /// i32 `[max_tokens]`: sequence of each token.
    BatchIds,
    /// i32 `[max_tokens]`: each token's earlier-chunk window rows (the CSA pack's skip).
    SkipPrefix,
    /// i32 `[max_seqs]`.
    ChunkStarts,
    /// i32 `[max_seqs]`: row of each sequence's first token in the forward's K.
    CuSeqlensQ,
    /// i32 `[max_seqs]`.
    StateSlots,
    /// i32 `[max_seqs]`: `ctx / 128` per sequence.
    CommittedHca,
    /// i32 `[max_seqs, max_blocks_per_seq]`.
    BlockTables,
    /// i32 `[max_tokens + 1]`: the extend indptr.
    ExtendIndptr,
    /// i32: extend rows (rows of the forward's own K).
    ExtendIndices,
    /// i32 `[max_tokens + 1]`: a class's prefix indptr (dense = `prefix_swa`).
    Indptr(Class),
    /// i32: a class's prefix index buffer.
    Indices(Class),
}

/// Per-token slice lengths of a prefill token at `p` in a chunk starting at `cs` of a
/// sequence whose context after the chunk is `ctx`: (extend rows, earlier-chunk window rows,
/// CSA head, HCA compressed entries). The heads are decode's formulas (§13: causal).
pub fn prefill_slice_lens(p: i64, cs: i64, ctx: i64, win: i64, topk: i64) -> (i64, i64, i64, i64) {
    slot_slice_lens(p, cs, ctx, win, topk, V4_SLOT_RATIOS, true)
}

/// [`prefill_slice_lens`] for the fine and coarse slots' `ratios`; under `head_fill` (V4)
/// the coarse class takes every committed row (the builder's class-wide rule), else its head
/// is capped by the top-k as the fine one's ([`class_slice_lens`]).
fn slot_slice_lens(
    p: i64,
    cs: i64,
    ctx: i64,
    win: i64,
    topk: i64,
    ratios: [i64; 2],
    head_fill: bool,
) -> (i64, i64, i64, i64) {
    let low = (p - win + 1).max(0);
    let ext = (p - cs + 1).min(win);
    let pre = (cs - low).max(0);
    let (_, csa, hca) = class_slice_lens(p, ctx, win, topk, ratios, head_fill);
    (ext, pre, csa, hca)
}

/// The entries each token of a prefill chunk takes: the one rule the size check and the
/// staging both walk.
#[derive(Clone, Copy)]
struct ChunkEntries {
    win: i64,
    topk: i64,
    ratios: [i64; 2],
    head_fill: bool,
    dense: bool,
}

impl ChunkEntries {
    /// Each token `p` of `s`'s chunk, in order, as `(p, prefix, csa_head, adds)`: its prefix
    /// and CSA head lengths ([`slot_slice_lens`]) and the entries it adds to each index buffer
    /// (prefix_swa, prefix_csa, prefix_hca by [`Class::index`], then [`EXTEND`]).
    fn of(self, s: &PrefillSeq<'_>) -> impl Iterator<Item = (i64, i64, i64, [i64; 4])> {
        let (cs, ctx) = (s.chunk_start, s.chunk_start + s.num_tokens as i64);
        (cs..ctx).map(move |p| {
            let (ext, pre, csa, hca) =
                slot_slice_lens(p, cs, ctx, self.win, self.topk, self.ratios, self.head_fill);
            let mut adds = [0i64; 4];
            adds[Class::Dense.index()] = if self.dense { pre } else { 0 };
            adds[Class::Csa.index()] = pre + csa;
            adds[Class::Hca.index()] = pre + hca;
            adds[EXTEND] = ext;
            (p, pre, csa, adds)
        })
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Layout {
    positions: u64,
    batch_ids: u64,
    skip: u64,
    chunk_start: u64,
    cu_q: u64,
    slots: u64,
    committed: u64,
    block_tables: u64,
    /// extend, dense, csa, hca
    indptr: [u64; 4],
    meta_end: u64,
    indices: [u64; 4],
    total: u64,
}

/// Buffer slot of the extend buffers next to the three classes.
const EXTEND: usize = 3;

/// Prefill index buffers on a backend: the advanced, pool-less form of
/// [`crate::pool::PrefillPath`] (owned; freed on drop; checks against [`PoolBounds`]).
pub(crate) struct PrefillIndexBuffers {
    cap: PrefillCapacity,
    layout: Layout,
    mem: Owned,
    params: [Option<WindowParams>; NUM_SLOTS],
    /// Entries each index buffer holds: [dense, csa, hca, extend].
    entries: [u64; 4],
    envelope_rows: i64,
    block_size: i64,
    /// The fine and coarse slots' compress ratios (V4: 4, 128).
    slot_ratios: [i64; 2],
    /// Where the translate-packs write (V4's coarse head fill, per-layer slots and biases).
    targets: PackTargets,
    bounds: PoolBounds,
    staging: Vec<u8>,
    /// CSA head of every staged token (what the translate-pack reads of its top-k row).
    csa_heads: Vec<[i32; 2]>,
    staged_positions: Vec<i64>,
    /// Highest block id each staged sequence's build reads (re-checked at build).
    staged_max_ids: Vec<Option<i32>>,
    staged_tokens: usize,
}

impl std::fmt::Debug for PrefillIndexBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillIndexBuffers")
            .field("cap", &self.cap)
            .field("bytes", &self.layout.total)
            .field("staged_tokens", &self.staged_tokens)
            .finish()
    }
}

struct Planned {
    layout: Layout,
    params: [Option<WindowParams>; NUM_SLOTS],
    entries: [u64; 4],
}

impl PrefillIndexBuffers {
    fn plan(geometry: &UnifiedPoolGeometry, cap: PrefillCapacity) -> Result<Planned, DecodeError> {
        let params = check_capacity(
            geometry,
            [cap.max_seqs, cap.max_tokens, cap.max_blocks_per_seq],
            cap.win,
            cap.index_topk,
        )?;
        let too_large = |what| DecodeError::TooLarge { what };
        let (t, s, win) = (cap.max_tokens as u64, cap.max_seqs as u64, cap.win as u64);
        let max_ctx = (cap.max_blocks_per_seq as u64)
            .checked_mul(geometry.block_size as u64)
            .ok_or(too_large("longest context"))?;
        let coarse_rows = max_ctx / slot_ratios(geometry)?[1] as u64;
        // Packed per layer the coarse head is capped by the top-k, as the fine one.
        let coarse_head =
            if geometry.coarse_head_fill() { coarse_rows } else { coarse_rows.min(cap.index_topk as u64) };
        let worst_hca = (win - 1 + coarse_head).checked_mul(t);
        let hca = match cap.max_hca_entries {
            Some(n) => Some(n),
            None => worst_hca,
        };
        let dense = if params[Class::Dense.index()].is_some() { t.checked_mul(win - 1) } else { Some(0) };
        let entries = [dense, t.checked_mul(win - 1 + cap.index_topk as u64), hca, t.checked_mul(win)];
        let mut e = [0u64; 4];
        for (i, n) in entries.into_iter().enumerate() {
            e[i] = n.filter(|&n| n <= i32::MAX as u64).ok_or(too_large("an i32 index buffer"))?;
        }
        let mut carve = Carve::default();
        let mut take = |n: Option<u64>| carve.take(n.ok_or(too_large("bytes"))?, 4).ok_or(too_large("bytes"));
        let mut l = Layout {
            positions: take(Some(t))?,
            batch_ids: take(Some(t))?,
            skip: take(Some(t))?,
            chunk_start: take(Some(s))?,
            cu_q: take(Some(s))?,
            slots: take(Some(s))?,
            committed: take(Some(s))?,
            block_tables: take(s.checked_mul(cap.max_blocks_per_seq as u64))?,
            ..Layout::default()
        };
        for i in 0..4 {
            l.indptr[i] = take(t.checked_add(1))?;
        }
        l.meta_end = take(Some(0))?;
        for (at, n) in l.indices.iter_mut().zip(e) {
            *at = take(Some(n))?;
        }
        l.total = carve.end();
        if usize::try_from(l.meta_end).is_err() {
            return Err(too_large("host staging"));
        }
        Ok(Planned { layout: l, params, entries: e })
    }

    /// Device bytes the buffers for `cap` take, without allocating them.
    pub(crate) fn required_bytes(
        geometry: &UnifiedPoolGeometry,
        cap: PrefillCapacity,
    ) -> Result<u64, DecodeError> {
        Ok(Self::plan(geometry, cap)?.layout.total)
    }

    /// Size and allocate the buffers for `cap` on `backend` (work on `stream`).
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        stream: Stream,
        geometry: &UnifiedPoolGeometry,
        cap: PrefillCapacity,
    ) -> Result<Self, DecodeError> {
        let Planned { layout, params, entries } = Self::plan(geometry, cap)?;
        let mem = Owned::new(backend, stream, layout.total)?;
        Ok(PrefillIndexBuffers {
            cap,
            layout,
            mem,
            params,
            entries,
            envelope_rows: geometry.compress_stride,
            block_size: geometry.block_size,
            slot_ratios: slot_ratios(geometry)?,
            targets: PackTargets::of(geometry),
            bounds: PoolBounds::of(geometry),
            staging: vec![0u8; layout.meta_end as usize],
            csa_heads: Vec::new(),
            staged_positions: Vec::with_capacity(cap.max_seqs),
            staged_max_ids: Vec::with_capacity(cap.max_seqs),
            staged_tokens: 0,
        })
    }

    /// Bytes these buffers hold on the device.
    pub(crate) fn device_bytes(&self) -> u64 {
        self.layout.total
    }
    /// The capacity the buffers were sized for.
    pub(crate) fn capacity(&self) -> PrefillCapacity {
        self.cap
    }
    /// The stream every upload and launch goes on.
    pub(crate) fn stream(&self) -> Stream {
        self.mem.stream()
    }
    /// Tokens of the forward last staged.
    pub(crate) fn staged_tokens(&self) -> usize {
        self.staged_tokens
    }
    /// Set the bounds staging checks against.
    pub(crate) fn set_bounds(&mut self, bounds: PoolBounds) {
        self.bounds = bounds;
    }

    fn has_class(&self, class: Class) -> bool {
        self.params[class.index()].is_some()
    }

    /// A sub-buffer's address and length (`None`: dense buffers without dense layers).
    pub(crate) fn buffer(&self, which: PrefillBuffer) -> Option<DeviceBuffer> {
        let (t, s) = (self.cap.max_tokens as u64, self.cap.max_seqs as u64);
        let l = &self.layout;
        let (off, len) = match which {
            PrefillBuffer::Positions => (l.positions, t),
            PrefillBuffer::BatchIds => (l.batch_ids, t),
            PrefillBuffer::SkipPrefix => (l.skip, t),
            PrefillBuffer::ChunkStarts => (l.chunk_start, s),
            PrefillBuffer::CuSeqlensQ => (l.cu_q, s),
            PrefillBuffer::StateSlots => (l.slots, s),
            PrefillBuffer::CommittedHca => (l.committed, s),
            PrefillBuffer::BlockTables => (l.block_tables, s * self.cap.max_blocks_per_seq as u64),
            PrefillBuffer::ExtendIndptr => (l.indptr[EXTEND], t + 1),
            PrefillBuffer::ExtendIndices => (l.indices[EXTEND], self.entries[EXTEND]),
            PrefillBuffer::Indptr(c) | PrefillBuffer::Indices(c) if !self.has_class(c) => return None,
            PrefillBuffer::Indptr(c) => (l.indptr[c.index()], t + 1),
            PrefillBuffer::Indices(c) => (l.indices[c.index()], self.entries[c.index()]),
        };
        Some(DeviceBuffer { ptr: self.mem.base() + off, len, elem_bytes: 4 })
    }

    /// Read an i32 sub-buffer back (waits for the stream).
    pub(crate) fn read_i32(&self, which: PrefillBuffer) -> Result<Vec<i32>, DecodeError> {
        let buf = self.buffer(which).ok_or(DecodeError::MissingClass(Class::Dense))?;
        Ok(self.mem.read_i32(buf)?)
    }

    /// Stage one forward (metadata and block tables, one upload); returns its tokens.
    pub(crate) fn stage(&mut self, batch: &[PrefillSeq<'_>]) -> Result<usize, DecodeError> {
        let _range = crate::profiling::range("v4pool.prefill_stage");
        let tokens = self.build_metadata(batch)?;
        self.mem.upload(0, &self.staging)?;
        self.staged_positions.clear();
        self.staged_positions.extend(batch.iter().map(|s| s.position));
        self.staged_max_ids.clear();
        self.staged_max_ids.extend(batch.iter().map(|s| {
            let cols = read_columns(s.chunk_start + s.num_tokens as i64, self.block_size);
            s.block_table[..cols].iter().copied().max()
        }));
        self.staged_tokens = tokens;
        Ok(tokens)
    }

    fn build_metadata(&mut self, batch: &[PrefillSeq<'_>]) -> Result<usize, DecodeError> {
        let cap = self.cap;
        check_batch_len(batch.len(), cap.max_seqs)?;
        let mut tokens = 0usize;
        for (i, s) in batch.iter().enumerate() {
            tokens = add_tokens(tokens, s.num_tokens, cap.max_tokens)?;
            // num_tokens ≤ max_tokens, so `ctx` cannot overflow for chunk_start ≤ i32::MAX.
            if s.num_tokens == 0 || !(0..=i64::from(i32::MAX)).contains(&s.chunk_start) {
                return Err(DecodeError::BadSequence {
                    seq: i,
                    num_tokens: s.num_tokens,
                    context_len: s.chunk_start,
                });
            }
            let ctx = s.chunk_start + s.num_tokens as i64;
            if ctx > i64::from(i32::MAX) {
                let (limit, why) = (i64::from(i32::MAX), "an i32 prefill position holds");
                return Err(DecodeError::ContextTooLong { seq: i, context_len: ctx, limit, why });
            }
            check_seq(
                i,
                s.position,
                ctx,
                s.block_table,
                true,
                &self.bounds,
                cap.max_blocks_per_seq,
                self.block_size,
            )?;
        }
        // Slice totals, checked against each buffer before anything is written.
        let entries = ChunkEntries {
            win: i64::from(cap.win),
            topk: i64::from(cap.index_topk),
            ratios: self.slot_ratios,
            head_fill: self.targets.head_fill,
            dense: self.has_class(Class::Dense),
        };
        let mut total = [0i64; 4];
        for (_, _, _, adds) in batch.iter().flat_map(|s| entries.of(s)) {
            for (t, a) in total.iter_mut().zip(adds) {
                *t += a;
            }
        }
        const NAMES: [&str; 4] =
            ["prefix_swa entries", "prefix_csa entries", "prefix_hca entries", "extend entries"];
        for i in 0..4 {
            if total[i] as u64 > self.entries[i] {
                return Err(DecodeError::BufferFull {
                    what: NAMES[i],
                    got: total[i] as u64,
                    cap: self.entries[i],
                });
            }
        }
        let l = self.layout;
        let st = &mut self.staging;
        // Every value fits an i32: positions and contexts were checked, totals fit the
        // buffers, whose entries fit an i32.
        let put = |st: &mut Vec<u8>, off: u64, i: usize, v: i64| {
            let o = off as usize + 4 * i;
            st[o..o + 4].copy_from_slice(&(v as i32).to_ne_bytes());
        };
        let mut ptr = [0i64; 4];
        for i in 0..4 {
            put(st, l.indptr[i], 0, 0);
        }
        let mut t = 0usize;
        self.csa_heads.clear();
        for (b, s) in batch.iter().enumerate() {
            let ctx = s.chunk_start + s.num_tokens as i64;
            put(st, l.chunk_start, b, s.chunk_start);
            put(st, l.cu_q, b, t as i64);
            put(st, l.slots, b, s.position);
            put(st, l.committed, b, ctx / self.slot_ratios[1]);
            let row = l.block_tables as usize + 4 * b * cap.max_blocks_per_seq;
            st[row..row + 4 * s.block_table.len()].copy_from_slice(bytemuck::cast_slice(s.block_table));
            for (p, pre, csa, adds) in entries.of(s) {
                put(st, l.positions, t, p);
                put(st, l.batch_ids, t, b as i64);
                put(st, l.skip, t, pre);
                // At most index_topk and a position / 4: both i32.
                self.csa_heads.push([csa as i32, ((p + 1) / i64::from(crate::geometry::CSA_RATIO)) as i32]);
                for (q, a) in ptr.iter_mut().zip(adds) {
                    *q += a;
                }
                for (&at, &p) in l.indptr.iter().zip(&ptr) {
                    put(st, at, t + 1, p);
                }
                t += 1;
            }
        }
        Ok(t)
    }

    fn prefill_args(&self) -> PrefillIndexArgs {
        let b = self.mem.base();
        let l = &self.layout;
        let (d, c, h) = (Class::Dense.index(), Class::Csa.index(), Class::Hca.index());
        let dense = self.params[d];
        PrefillIndexArgs {
            dense: dense.unwrap_or_default(),
            csa: self.params[c].unwrap_or_default(),
            hca: self.params[h].unwrap_or_default(),
            positions: b + l.positions,
            bid_per_token: b + l.batch_ids,
            chunk_start_per_seq: b + l.chunk_start,
            cu_seqlens_q_per_seq: b + l.cu_q,
            state_slot_per_seq: b + l.slots,
            n_committed_hca_per_seq: b + l.committed,
            block_tables: b + l.block_tables,
            extend_indptr: b + l.indptr[EXTEND],
            extend_indices: b + l.indices[EXTEND],
            swa_indptr: if dense.is_some() { b + l.indptr[d] } else { 0 },
            swa_indices: if dense.is_some() { b + l.indices[d] } else { 0 },
            csa_indptr: b + l.indptr[c],
            csa_indices: b + l.indices[c],
            hca_indptr: b + l.indptr[h],
            hca_indices: b + l.indices[h],
            envelope_rows: self.envelope_rows,
            block_table_stride: self.cap.max_blocks_per_seq as i32,
            num_tokens: self.staged_tokens as i32,
            win: self.cap.win,
            hca_ratio: self.slot_ratios[1] as i32,
            hca_rows_per_block: (self.block_size / self.slot_ratios[1]) as i32,
            coarse_packed: i32::from(!self.targets.head_fill),
        }
    }

    /// The prefill builder's launch for the staged forward (advanced: see
    /// [`Self::build`] for the safe way to run it).
    pub(crate) fn launch(&self) -> Launch {
        Launch::Prefill(self.prefill_args())
    }

    /// Check the staged forward against `bounds` (the pool's now): its positions still live
    /// slots and the block ids its build and translate-packs read still blocks of the region.
    pub(crate) fn check_staged(&self, bounds: &PoolBounds) -> Result<(), DecodeError> {
        check_live(&self.staged_positions, &bounds.live)?;
        check_blocks(&self.staged_max_ids, bounds.num_blocks)
    }

    /// Run the prefill builder over the staged forward, after checking it against the bounds
    /// last set ([`Self::check_staged`]).
    pub(crate) fn build(&self) -> Result<(), DecodeError> {
        let _range = crate::profiling::range("v4pool.prefill_build");
        self.check_staged(&self.bounds)?;
        if self.staged_tokens == 0 {
            return Ok(());
        }
        // SAFETY: every pointer is this handle's own; the staged indptrs were computed here
        // and their totals checked against each buffer's entries, and `num_tokens` is the
        // staged count, so the kernel reads staged metadata and writes inside the buffers.
        unsafe { self.mem.launch(&self.launch())? };
        Ok(())
    }

    /// The CSA head of every token of the forward staged last: `[head, entries]`: how many top-k
    /// entries of its row the translate-pack reads, and the compressed CSA entries its
    /// position may select (`(pos + 1) / 4`).
    pub(crate) fn staged_csa_heads(&self) -> &[[i32; 2]] {
        &self.csa_heads
    }

    /// The translate-pack arguments of one layer's top-k `topk` (i32
    /// `[rows][topk_row_stride]`) at the slot and bias [`PackTargets::target`] gives; refuses a
    /// stride shorter than `index_topk` (the kernel reads that much of a row).
    pub(crate) fn pack_args(
        &self,
        layer: Option<usize>,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<CsaPackArgs, DecodeError> {
        let (slot, bias) = self.targets.target(layer)?;
        self.slot_pack_args(slot, bias, topk, topk_row_stride)
    }

    fn slot_pack_args(
        &self,
        slot: Class,
        compress_bias: i64,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<CsaPackArgs, DecodeError> {
        let (ratio, block_capacity) =
            pack_slot(self.cap.index_topk, topk_row_stride, self.slot_ratios, slot, self.block_size)?;
        let b = self.mem.base();
        let l = &self.layout;
        let c = slot.index();
        Ok(CsaPackArgs {
            topk,
            block_tables: b + l.block_tables,
            positions: 0,
            indptr: b + l.indptr[c],
            batch_id_per_token: b + l.batch_ids,
            skip_prefix_len_per_token: b + l.skip,
            out: b + l.indices[c],
            envelope_rows: self.envelope_rows,
            topk_row_stride,
            block_table_stride: self.cap.max_blocks_per_seq as i32,
            num_tokens: self.staged_tokens as i32,
            block_capacity,
            window_size: 0,
            compress_ratio: ratio as i32,
            compress_bias,
            extra_topk_length: 0,
            extra_topk: 0,
            shift: 0,
        })
    }

    /// Run the translate-pack of [`Self::pack_args`] on the buffers' stream.
    ///
    /// # Safety
    /// `topk` must address live memory of this backend holding i32
    /// `[staged tokens][topk_row_stride]`, ordered before this call on the stream, non-negative where the
    /// contract reads it (`index-buffers.md` §5): the first `min((pos+1)/4, ctx/4,
    /// index_topk)` entries of each real token's row for the CSA pack, the first
    /// `min(visible_groups(pos, ratio), index_topk)` for a layer's.
    pub(crate) unsafe fn pack(
        &self,
        layer: Option<usize>,
        topk: DevicePtr,
        topk_row_stride: i32,
    ) -> Result<(), DecodeError> {
        let args = self.pack_args(layer, topk, topk_row_stride)?;
        if self.staged_tokens == 0 {
            return Ok(());
        }
        // SAFETY: the caller vouches for `topk`; every other pointer is this handle's own.
        unsafe { self.mem.launch(&Launch::CsaPack(args))? };
        Ok(())
    }
}
