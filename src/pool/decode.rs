//! The decode index path: persistent buffers and the host's share of a decode step.
//!
//! The host computes, per token, only slice lengths (`index-buffers.md` §3: window
//! `n = min(pos+1, win)`, CSA head `min((pos+1)/4, ctx/4, topk)`, HCA head
//! `min((pos+1)/128, ctx/128)` — causal per token, §13) and their prefix sums; it never walks
//! a context to build indices. One kernel launch then writes every window tail, every HCA
//! head (from the block tables) and the destination rows. Every buffer lives at a fixed
//! address sized for the largest batch, so the launch can be captured in a graph once and
//! replayed with new contents staged by [`crate::pool::DecodePath::stage`].
//!
//! What a step uploads: `stage` sends the per-token metadata *and* every sequence's block
//! table, O(context) bytes; with the tables kept resident on the device
//! ([`crate::pool::DecodePath::write_block_table`] when a sequence enters or gains a block),
//! `stage_resident` sends only the O(batch) metadata.
//!
//! The one public form is [`crate::pool::DecodePath`]: these buffers (crate-private) with the
//! pool they index, whose live slot positions and block ids it reads from the pool itself.

mod checks;
mod error;
mod flashmla;
mod staging;

pub(crate) use checks::{
    add_tokens, check_batch_len, check_blocks, check_capacity, check_live, check_seq, pack_slot,
    read_columns, slot_ratios, PackTargets, PoolBounds,
};
pub use checks::{class_slice_lens, decode_slice_lens};
pub use error::DecodeError;
use flashmla::FlashPlan;
pub use flashmla::{FlashMlaBuffers, FlashMlaWidths};

use super::owned::{Carve, DeviceBuffer, Owned};
use super::PoolError;
use crate::backend::{Backend, Stream};
use crate::geometry::NUM_SLOTS;
use crate::geometry::{Class, UnifiedPoolGeometry, WindowParams};
use crate::index::shape::MAX_GRID_YZ;
use crate::index::{ClassBuffers, CsaPackArgs, DecodeIndexArgs, DevicePtr, FlashMlaOut, Launch};
use std::sync::Arc;

/// Capacities the persistent buffers are sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DecodeCapacity {
    /// Sequences in one step.
    pub max_seqs: usize,
    /// Tokens in one step (sequences × (1 + speculative steps)); also the captured grid.
    pub max_tokens: usize,
    /// Block-table columns per sequence (longest context / block size, rounded up).
    pub max_blocks_per_seq: usize,
    /// Sliding window `win` (1..=ring_slots).
    pub win: i32,
    /// CSA top-k reserved per token (`index_topk`, ≥ 0).
    pub index_topk: i32,
}

impl DecodeCapacity {
    /// Every capacity given ([`DecodeCapacity::for_pool`] takes the window and top-k from the
    /// pool's spec).
    pub fn new(
        max_seqs: usize,
        max_tokens: usize,
        max_blocks_per_seq: usize,
        win: i32,
        index_topk: i32,
    ) -> Self {
        DecodeCapacity { max_seqs, max_tokens, max_blocks_per_seq, win, index_topk }
    }
}

crate::setters::with_setters!(DecodeCapacity { with_win(win: i32), with_index_topk(index_topk: i32) });

impl DecodeCapacity {
    /// Buffers for `max_seqs` sequences of `max_tokens` tokens and `max_blocks_per_seq`
    /// block-table columns on `pool`, at the window and index top-k of the pool's spec (the
    /// one default every binding and the CLI take).
    pub fn for_pool(
        pool: &super::Pool,
        max_seqs: usize,
        max_tokens: usize,
        max_blocks_per_seq: usize,
    ) -> Result<Self, PoolError> {
        let kv = pool.kv_spec()?;
        Ok(DecodeCapacity {
            max_seqs,
            max_tokens,
            max_blocks_per_seq,
            win: kv.window(),
            index_topk: kv.index_topk(),
        })
    }
}

/// One sequence of a decode step.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct DecodeSeq<'a> {
    /// Physical slot (a position from `physical_slot`, never a group).
    pub position: i64,
    /// Context length after this step, including its tokens.
    pub context_len: i64,
    /// Tokens this step writes for the sequence (1 + drafts).
    pub num_tokens: usize,
    /// Logical → physical block ids (the engine's host copy). `stage` uploads it;
    /// `stage_resident` only checks its length, the device rows being kept current with
    /// `write_block_table`.
    pub block_table: &'a [i32],
}

impl<'a> DecodeSeq<'a> {
    /// One decode sequence, every field given (the struct is `#[non_exhaustive]`: a field added later
    /// gets a default here and a setter).
    pub fn new(position: i64, context_len: i64, num_tokens: usize, block_table: &'a [i32]) -> Self {
        DecodeSeq { position, context_len, num_tokens, block_table }
    }
}

/// One decode step's batch as flat arrays, one per field (index `b` is sequence `b`): the
/// shape a foreign caller (the Python module, the C ABI) hands over, turned into
/// [`DecodeSeq`]s by [`crate::pool::DecodePath::stage_flat`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct FlatDecodeBatch<'a> {
    /// Slot positions (from `physical_slot`).
    pub positions: &'a [i64],
    /// Context length after the step, its tokens included.
    pub context_lens: &'a [i64],
    /// Tokens the step writes per sequence (1 + drafts).
    pub num_tokens: &'a [i64],
    /// Block tables, row `b` at `b * table_stride`; `None`: the tables are resident on the
    /// device (written with [`crate::pool::DecodePath::write_block_table`]).
    pub block_tables: Option<&'a [i32]>,
    /// Columns from one block-table row to the next.
    pub table_stride: usize,
}

impl<'a> FlatDecodeBatch<'a> {
    /// A decode batch as flat arrays, every field given (the struct is `#[non_exhaustive]`: a field added later
    /// gets a default here and a setter).
    pub fn new(
        positions: &'a [i64],
        context_lens: &'a [i64],
        num_tokens: &'a [i64],
        block_tables: Option<&'a [i32]>,
        table_stride: usize,
    ) -> Self {
        FlatDecodeBatch { positions, context_lens, num_tokens, block_tables, table_stride }
    }
}

impl<'a> FlatDecodeBatch<'a> {
    /// The batch as decode sequences: the arrays one length, every token count a count, and
    /// each sequence's block table the columns its context needs from row `b *
    /// table_stride` (at most `table_stride`: staging refuses a table too short). Resident
    /// tables are only length-checked at staging: `resident` (zeros, the buffers' columns)
    /// stands in for them.
    pub(crate) fn seqs(
        &self,
        block_size: i64,
        resident: &'a [i32],
    ) -> Result<Vec<DecodeSeq<'a>>, DecodeError> {
        let n = self.positions.len();
        if self.context_lens.len() != n || self.num_tokens.len() != n {
            return Err(DecodeError::BatchShape {
                positions: n,
                context_lens: self.context_lens.len(),
                num_tokens: self.num_tokens.len(),
            });
        }
        let mut seqs = Vec::with_capacity(n);
        for b in 0..n {
            let ctx = self.context_lens[b];
            let num_tokens = usize::try_from(self.num_tokens[b])
                .map_err(|_| DecodeError::BadTokenCount { seq: b, num_tokens: self.num_tokens[b] })?;
            let needed = read_columns(ctx, block_size);
            let block_table = match self.block_tables {
                Some(t) => {
                    let start = b.saturating_mul(self.table_stride);
                    let cols = needed.min(self.table_stride);
                    t.get(start..start.saturating_add(cols)).ok_or(DecodeError::BlockTableTooShort {
                        seq: b,
                        context_len: ctx,
                        needed: i64::try_from(needed).unwrap_or(i64::MAX),
                        got: t.len().saturating_sub(start).min(self.table_stride),
                    })?
                }
                None => &resident[..needed.min(resident.len())],
            };
            seqs.push(DecodeSeq { position: self.positions[b], context_len: ctx, num_tokens, block_table });
        }
        Ok(seqs)
    }
}

/// Byte offsets of the sub-buffers inside the one allocation. The metadata part comes
/// first and is contiguous, so a step's staging is one host-to-device copy.
#[derive(Clone, Copy, Debug, Default)]
struct Layout {
    slots: u64,
    batch_ids: u64,
    positions: u64,
    indptr: [u64; NUM_SLOTS],
    /// FlashMLA mode: per sequence (FlashMLA's batch entry) its tokens' longest window part
    /// (`topk_length [max_seqs]`, every class alike) and each class's longest compressed part
    /// (`extra_topk_length [max_seqs]`), host-staged with the metadata (0 bytes otherwise).
    fm_seq_length: u64,
    fm_seq_extra_length: [u64; NUM_SLOTS],
    block_tables: u64,
    meta_end: u64,
    indices: [u64; NUM_SLOTS],
    dest_rows: [u64; NUM_SLOTS],
    /// FlashMLA mode (§3f): each class's shifts, window rows and lengths; the compressed rows
    /// and lengths of CSA (the pack's) and HCA (the builder's).
    fm_shifts: [u64; NUM_SLOTS],
    fm_indices: [u64; NUM_SLOTS],
    fm_length: [u64; NUM_SLOTS],
    fm_extra: [u64; NUM_SLOTS],
    fm_extra_length: [u64; NUM_SLOTS],
    total: u64,
}

/// What `plan` decides: the layout, each class's params (`None`: absent), and each
/// class's per-token slice capacity.
struct Planned {
    flash: Option<FlashPlan>,
    layout: Layout,
    params: [Option<WindowParams>; NUM_SLOTS],
    slice_cap: [u64; NUM_SLOTS],
}

/// Persistent decode index buffers on a backend: the advanced, pool-less form of
/// [`crate::pool::DecodePath`]. The buffers are owned (freed on drop, after the stream
/// drains) and every call touches only them; positions and block ids are checked against
/// the [`PoolBounds`] last set (the geometry's at creation).
pub(crate) struct DecodeIndexBuffers {
    cap: DecodeCapacity,
    layout: Layout,
    mem: Owned,
    params: [Option<WindowParams>; NUM_SLOTS],
    envelope_rows: i64,
    hca_rows_per_block: i32,
    block_size: i64,
    /// The fine and coarse slots' compress ratios (V4: 4, 128; V4.1: 1, 2).
    slot_ratios: [i64; 2],
    /// Where the translate-packs write (V4's coarse head fill, per-layer slots and biases).
    targets: PackTargets,
    /// FlashMLA mode (§3f, §5f): the builder and packs write FlashMLA's rows instead of CSR.
    flash: Option<FlashPlan>,
    bounds: PoolBounds,
    staging: Vec<u8>,
    /// CSA head (top-k entries the pack reads) of every staged token, for checking an
    /// engine's top-k rows before a pack.
    csa_heads: Vec<[i32; 2]>,
    /// Per-token slice capacity of each class's index buffer.
    slice_cap: [u64; NUM_SLOTS],
    /// Positions of the batch last staged (a pool-backed path re-checks them at build).
    staged_positions: Vec<i64>,
    /// Block-table columns each staged sequence's build reads (batch row = index).
    staged_columns: Vec<usize>,
    /// Host mirror of the device block tables `[max_seqs][max_blocks_per_seq]` and each
    /// row's running maximum, so a build re-checks the ids it reads in O(batch).
    tables: Vec<i32>,
    table_max: Vec<i32>,
    /// Columns of each row ever written (beyond them the device table holds zeros).
    row_len: Vec<usize>,
    staged_tokens: usize,
}

impl std::fmt::Debug for DecodeIndexBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeIndexBuffers")
            .field("cap", &self.cap)
            .field("bytes", &self.layout.total)
            .field("staged_tokens", &self.staged_tokens)
            .finish()
    }
}

/// One sub-buffer of the decode path, by name (for [`crate::pool::DecodePath::buffer`] and reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeBuffer {
    /// i32 `[max_seqs]`: physical slot per sequence.
    StateSlots,
    /// i32 `[max_tokens]`: sequence of each token, −1 for pads.
    BatchIds,
    /// i64 `[max_tokens]`: position of each token.
    Positions,
    /// i32 `[max_seqs, max_blocks_per_seq]`.
    BlockTables,
    /// i32 `[max_tokens + 1]`: a class's CSR offsets.
    Indptr(Class),
    /// i32: a class's index buffer (`max_tokens` × the class's slice capacity).
    Indices(Class),
    /// i32 `[max_tokens]`: a class's destination rows.
    DestRows(Class),
}

impl DecodeBuffer {
    fn name(self) -> &'static str {
        match self {
            DecodeBuffer::StateSlots => "state_slots",
            DecodeBuffer::BatchIds => "batch_ids",
            DecodeBuffer::Positions => "positions",
            DecodeBuffer::BlockTables => "block_tables",
            DecodeBuffer::Indptr(_) => "indptr",
            DecodeBuffer::Indices(_) => "indices",
            DecodeBuffer::DestRows(_) => "dest_rows",
        }
    }
}

impl DecodeIndexBuffers {
    /// Check `cap` against `geometry` and lay the buffers out (no allocation).
    fn plan(
        geometry: &UnifiedPoolGeometry,
        cap: DecodeCapacity,
        flash: Option<(FlashMlaWidths, &[Option<i32>])>,
    ) -> Result<Planned, DecodeError> {
        let params = check_capacity(
            geometry,
            [cap.max_seqs, cap.max_tokens, cap.max_blocks_per_seq],
            cap.win,
            cap.index_topk,
        )?;
        if cap.max_tokens > MAX_GRID_YZ as usize {
            return Err(DecodeError::TokensPastGrid { max_tokens: cap.max_tokens, limit: MAX_GRID_YZ });
        }
        let too_large = |what| DecodeError::TooLarge { what };
        let win = cap.win as u64;
        let max_ctx = (cap.max_blocks_per_seq as u64)
            .checked_mul(geometry.block_size as u64)
            .ok_or(too_large("longest context"))?;
        let coarse = slot_ratios(geometry)?[1] as u64;
        // The coarse head: every committed row (V4's head fill), else the top-k.
        let hca_head_cap =
            if geometry.coarse_head_fill() { max_ctx / coarse } else { (cap.index_topk as u64).min(max_ctx) };
        let slice_cap = [win, win + cap.index_topk as u64, win + hca_head_cap];
        let (t, s) = (cap.max_tokens as u64, cap.max_seqs as u64);
        // Every indptr entry is an i32: a full step's slices must fit one.
        for c in slice_cap {
            if t.checked_mul(c).is_none_or(|n| n > i32::MAX as u64) {
                return Err(too_large("an i32 index buffer"));
            }
        }
        let mut l = Layout::default();
        let mut carve = Carve::default();
        let mut take = |n: Option<u64>, elem: u64| {
            carve.take(n.ok_or(too_large("bytes"))?, elem).ok_or(too_large("bytes"))
        };
        l.slots = take(Some(s), 4)?;
        l.batch_ids = take(Some(t), 4)?;
        l.positions = take(Some(t), 8)?;
        for c in 0..NUM_SLOTS {
            l.indptr[c] = take(t.checked_add(1), 4)?;
        }
        let flash = flash.map(|(w, shifts)| FlashPlan::new(geometry, cap, w, shifts)).transpose()?;
        // Before the block tables: a resident-table stage uploads the metadata up to them.
        let per_seq = if flash.is_some() { s } else { 0 };
        l.fm_seq_length = take(Some(per_seq), 4)?;
        for c in 0..NUM_SLOTS {
            l.fm_seq_extra_length[c] = take(Some(per_seq), 4)?;
        }
        l.block_tables = take(s.checked_mul(cap.max_blocks_per_seq as u64), 4)?;
        l.meta_end = take(Some(0), 1)?;
        // FlashMLA mode writes no CSR indices: their buffers take no bytes (the indptrs stay:
        // they carry each token's slice lengths).
        for (at, c) in l.indices.iter_mut().zip(slice_cap) {
            *at = take(t.checked_mul(if flash.is_some() { 0 } else { c }), 4)?;
        }
        for c in 0..NUM_SLOTS {
            l.dest_rows[c] = take(Some(t), 4)?;
        }
        if let Some(f) = &flash {
            let w = f.widths;
            let extra = [0, i64::from(w.csa_extra_topk), i64::from(w.hca_extra_topk)];
            for (c, &extra) in extra.iter().enumerate() {
                // The CSA compressed rows are one buffer (every CSA layer's pack in turn).
                let extra_views = if c == Class::Csa.index() { 1 } else { f.views(c) };
                let rows = |width: i64, views: u64| t.checked_mul(views)?.checked_mul(width as u64);
                l.fm_shifts[c] = take(Some(f.views(c)), 4)?;
                l.fm_indices[c] = take(rows(i64::from(w.topk), f.views(c)), 4)?;
                l.fm_length[c] = take(Some(t), 4)?;
                l.fm_extra[c] = take(rows(extra, extra_views), 4)?;
                l.fm_extra_length[c] = take(Some(t), 4)?;
            }
        }
        l.total = carve.end();
        if usize::try_from(l.meta_end).is_err() {
            return Err(too_large("host staging"));
        }
        Ok(Planned { flash, layout: l, params, slice_cap })
    }

    /// Device bytes the buffers for `cap` take, without allocating them (for sizing and
    /// overhead reports). Sizes that overflow are [`DecodeError::TooLarge`].
    pub(crate) fn required_bytes(
        geometry: &UnifiedPoolGeometry,
        cap: DecodeCapacity,
    ) -> Result<u64, DecodeError> {
        Ok(Self::plan(geometry, cap, None)?.layout.total)
    }

    /// Size and allocate the buffers for `cap` on `backend` (work goes on `stream`), for
    /// `geometry`'s classes; positions and block ids are checked against `geometry`'s split
    /// until [`Self::set_bounds`]. The buffers start staged with an empty batch (all pads),
    /// so a build before any `stage` writes nothing.
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        stream: Stream,
        geometry: &UnifiedPoolGeometry,
        cap: DecodeCapacity,
        flash: Option<(FlashMlaWidths, &[Option<i32>])>,
    ) -> Result<Self, DecodeError> {
        let Planned { flash, layout, params, slice_cap } = Self::plan(geometry, cap, flash)?;
        let mem = Owned::new(backend, stream, layout.total)?;
        if let Some(f) = &flash {
            // The views' shifts are fixed for the pool's life: uploaded once, outside the
            // metadata every stage rewrites.
            for c in 0..NUM_SLOTS {
                mem.upload(layout.fm_shifts[c], bytemuck::cast_slice(&f.shifts[c]))?;
            }
        }
        let mut bufs = DecodeIndexBuffers {
            cap,
            layout,
            mem,
            params,
            envelope_rows: geometry.compress_stride,
            hca_rows_per_block: (geometry.block_size / slot_ratios(geometry)?[1]) as i32,
            block_size: geometry.block_size,
            slot_ratios: slot_ratios(geometry)?,
            targets: PackTargets::of(geometry),
            flash,
            bounds: PoolBounds::of(geometry),
            staging: vec![0u8; layout.meta_end as usize],
            csa_heads: Vec::with_capacity(cap.max_tokens),
            slice_cap,
            staged_positions: Vec::with_capacity(cap.max_seqs),
            staged_columns: Vec::with_capacity(cap.max_seqs),
            tables: vec![0; cap.max_seqs.saturating_mul(cap.max_blocks_per_seq)],
            table_max: vec![0; cap.max_seqs.saturating_mul(cap.max_blocks_per_seq)],
            row_len: vec![0; cap.max_seqs],
            staged_tokens: 0,
        };
        bufs.upload_metadata(&[], true)?;
        Ok(bufs)
    }

    /// Bytes these buffers hold on the device (the pool reports it as overhead).
    pub(crate) fn device_bytes(&self) -> u64 {
        self.layout.total
    }

    /// The capacity the buffers were sized for.
    pub(crate) fn capacity(&self) -> DecodeCapacity {
        self.cap
    }

    /// The stream every upload and launch goes on.
    pub(crate) fn stream(&self) -> Stream {
        self.mem.stream()
    }

    /// Tokens of the batch last staged (pads excluded).
    pub(crate) fn staged_tokens(&self) -> usize {
        self.staged_tokens
    }

    /// Positions of the batch last staged, one per sequence.
    pub(crate) fn staged_positions(&self) -> &[i64] {
        &self.staged_positions
    }

    /// The CSA head of every token of the batch staged last: `[head, entries]`: how many top-k
    /// entries of its row the translate-pack reads, and the compressed CSA entries its
    /// position may select (`(pos + 1) / 4`).
    pub(crate) fn staged_csa_heads(&self) -> &[[i32; 2]] {
        &self.csa_heads
    }

    /// The bounds staging checks against.
    pub(crate) fn bounds(&self) -> &PoolBounds {
        &self.bounds
    }

    /// Set the bounds staging checks against, after the boundary moved (the buffers and
    /// every address stay).
    pub(crate) fn set_bounds(&mut self, bounds: PoolBounds) {
        self.bounds = bounds;
    }

    fn base(&self) -> DevicePtr {
        self.mem.base()
    }

    /// Whether the geometry has `class` (dense may be absent; CSA and HCA never are).
    pub(crate) fn has_class(&self, class: Class) -> bool {
        self.params[class.index()].is_some()
    }

    /// The decode builder's arguments: fixed pointers, `num_tokens = max_tokens` (pad tokens
    /// carry batch id −1), so it can be captured once and replayed. One CSA buffer: every
    /// CSA layer's translate-pack overwrites its heads in turn.
    pub(crate) fn decode_args(&self) -> DecodeIndexArgs {
        let b = self.base();
        let l = &self.layout;
        let mut classes = [ClassBuffers::default(); NUM_SLOTS];
        for c in Class::ALL {
            if let Some(params) = self.params[c.index()] {
                let i = c.index();
                classes[i] = ClassBuffers {
                    params,
                    indptr: b + l.indptr[i],
                    indices: if self.flash.is_some() { 0 } else { b + l.indices[i] },
                    dest_rows: b + l.dest_rows[i],
                };
            }
        }
        let mut flashmla = [FlashMlaOut::default(); NUM_SLOTS];
        if let Some(f) = &self.flash {
            for c in Class::ALL {
                let i = c.index();
                if self.params[i].is_none() || f.shifts[i].is_empty() {
                    continue;
                }
                let hca = c == Class::Hca;
                flashmla[i] = FlashMlaOut {
                    indices: b + l.fm_indices[i],
                    topk_length: b + l.fm_length[i],
                    extra_indices: if hca { b + l.fm_extra[i] } else { 0 },
                    extra_topk_length: if hca { b + l.fm_extra_length[i] } else { 0 },
                    shifts: b + l.fm_shifts[i],
                    topk: f.widths.topk,
                    extra_topk: if hca { f.widths.hca_extra_topk } else { 0 },
                    num_views: f.shifts[i].len() as i32,
                    _pad: 0,
                };
            }
        }
        DecodeIndexArgs {
            classes,
            state_slot_per_seq: b + l.slots,
            batch_id_per_token: b + l.batch_ids,
            positions: b + l.positions,
            // Without V4's head fill the builder leaves the coarse heads to the packs.
            block_tables: if self.targets.head_fill { b + l.block_tables } else { 0 },
            envelope_rows: self.envelope_rows,
            block_table_stride: self.cap.max_blocks_per_seq as i32,
            hca_rows_per_block: self.hca_rows_per_block,
            num_tokens: self.cap.max_tokens as i32,
            win: self.cap.win,
            flashmla,
        }
    }

    /// The decode launch, ready for graph capture ([`Backend::launch`] is the caller's
    /// `unsafe`; [`Self::build`] is the safe way to run it).
    pub(crate) fn launch(&self) -> Launch {
        Launch::Decode(self.decode_args())
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
        let mut a = self.slot_pack_args(slot, bias, topk, topk_row_stride)?;
        if let Some(f) = &self.flash {
            // FlashMLA mode (§5f): the one CSA row buffer, shifted by the layer's view; the
            // class-wide pack (`None`) needs the CSA layers to share one shift (V4's do).
            let shift = match layer {
                Some(l) => f.shifts[slot.index()][self.flashmla_view(l)?.1],
                None => match f.shifts[Class::Csa.index()].as_slice() {
                    [one] => *one,
                    _ => return Err(DecodeError::PackNeedsLayer),
                },
            };
            let (b, l) = (self.base(), &self.layout);
            a.out = b + l.fm_extra[Class::Csa.index()];
            a.extra_topk_length = b + l.fm_extra_length[Class::Csa.index()];
            a.extra_topk = f.widths.csa_extra_topk;
            a.shift = shift;
        }
        Ok(a)
    }

    /// Layer `layer`'s (class, view) in FlashMLA mode.
    fn flashmla_view(&self, layer: usize) -> Result<(Class, usize), DecodeError> {
        let f = self.flash.as_ref().ok_or(DecodeError::NoFlashMla { why: "the path writes CSR buffers" })?;
        f.layer_view
            .get(layer)
            .copied()
            .flatten()
            .ok_or(DecodeError::NoFlashMla { why: "the layer has no view" })
    }

    /// Layer `layer`'s FlashMLA operands (FlashMLA mode only).
    pub(crate) fn flashmla(&self, layer: usize) -> Result<FlashMlaBuffers, DecodeError> {
        let (class, v) = self.flashmla_view(layer)?;
        let f = self.flash.as_ref().ok_or(DecodeError::NoFlashMla { why: "the path writes CSR buffers" })?;
        let (b, l, t) = (self.base(), &self.layout, self.cap.max_tokens as u64);
        let i = class.index();
        let buf = |off: u64, len: u64| DeviceBuffer { ptr: b + off, len, elem_bytes: 4 };
        let topk = f.widths.topk;
        let row = t * topk as u64;
        let (extra_topk, extra_at) = match class {
            Class::Dense => (0, None),
            Class::Csa => (f.widths.csa_extra_topk, Some(l.fm_extra[i])),
            Class::Hca => {
                let w = f.widths.hca_extra_topk;
                (w, Some(l.fm_extra[i] + 4 * v as u64 * t * w as u64))
            }
        };
        let seqs = self.cap.max_seqs as u64;
        Ok(FlashMlaBuffers {
            indices: buf(l.fm_indices[i] + 4 * v as u64 * row, row),
            topk_length: buf(l.fm_length[i], t),
            extra_indices: extra_at.map(|at| buf(at, t * extra_topk as u64)),
            extra_topk_length: extra_at.map(|_| buf(l.fm_extra_length[i], t)),
            seq_topk_length: buf(l.fm_seq_length, seqs),
            seq_extra_topk_length: extra_at.map(|_| buf(l.fm_seq_extra_length[i], seqs)),
            topk,
            extra_topk,
            shift: f.shifts[i][v],
        })
    }

    /// Read any i32 buffer of these buffers back (waits for the stream). A caller's
    /// `DeviceBuffer` is a plain value: its bytes are checked inside the path's memory in
    /// checked arithmetic before anything is allocated for them (`4 × len` must not wrap).
    pub(crate) fn read_buffer(&self, buf: DeviceBuffer) -> Result<Vec<i32>, DecodeError> {
        if buf.elem_bytes != 4 {
            return Err(DecodeError::NotI32("the buffer"));
        }
        let bytes = self.device_bytes();
        let inside = buf
            .ptr
            .checked_sub(self.base())
            .zip(buf.len.checked_mul(4))
            .and_then(|(off, n)| off.checked_add(n))
            .is_some_and(|end| end <= bytes);
        if !inside {
            return Err(DecodeError::OutOfRange { ptr: buf.ptr, len: buf.len, bytes });
        }
        Ok(self.mem.read_i32(buf)?)
    }

    /// FlashMLA mode: the fills that reset the one CSA compressed buffer before a build —
    /// `(address, u32 count, value)`: every row −1 and every length 0, so a CSA layer read
    /// before its pack shows no rows (never row 0, never the last step's pack).
    pub(crate) fn csa_flash_reset(&self) -> Option<[(DevicePtr, u64, u32); 2]> {
        let f = self.flash.as_ref()?;
        self.has_class(Class::Csa).then_some(())?;
        let (b, l, t) = (self.base(), &self.layout, self.cap.max_tokens as u64);
        let i = Class::Csa.index();
        Some([
            (b + l.fm_extra[i], t * f.widths.csa_extra_topk as u64, u32::MAX),
            (b + l.fm_extra_length[i], t, 0),
        ])
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
        let b = self.base();
        let l = &self.layout;
        let i = slot.index();
        Ok(CsaPackArgs {
            topk,
            block_tables: b + l.block_tables,
            positions: b + l.positions,
            indptr: b + l.indptr[i],
            batch_id_per_token: b + l.batch_ids,
            skip_prefix_len_per_token: 0,
            out: b + l.indices[i],
            envelope_rows: self.envelope_rows,
            topk_row_stride,
            block_table_stride: self.cap.max_blocks_per_seq as i32,
            num_tokens: self.cap.max_tokens as i32,
            block_capacity,
            window_size: self.cap.win,
            compress_ratio: ratio as i32,
            compress_bias,
            extra_topk_length: 0,
            extra_topk: 0,
            shift: 0,
        })
    }

    /// A sub-buffer's address and length (`None`: a dense buffer of a geometry without
    /// dense layers).
    pub(crate) fn buffer(&self, which: DecodeBuffer) -> Option<DeviceBuffer> {
        let (t, s) = (self.cap.max_tokens as u64, self.cap.max_seqs as u64);
        let l = &self.layout;
        let (off, len, elem) = match which {
            DecodeBuffer::StateSlots => (l.slots, s, 4),
            DecodeBuffer::BatchIds => (l.batch_ids, t, 4),
            DecodeBuffer::Positions => (l.positions, t, 8),
            DecodeBuffer::BlockTables => (l.block_tables, s * self.cap.max_blocks_per_seq as u64, 4),
            DecodeBuffer::Indptr(c) | DecodeBuffer::Indices(c) | DecodeBuffer::DestRows(c)
                if !self.has_class(c) =>
            {
                return None
            }
            // FlashMLA mode has no CSR index buffers (`flashmla(layer)` gives its rows).
            DecodeBuffer::Indices(_) if self.flash.is_some() => return None,
            DecodeBuffer::Indptr(c) => (l.indptr[c.index()], t + 1, 4),
            DecodeBuffer::Indices(c) => (l.indices[c.index()], t * self.slice_cap[c.index()], 4),
            DecodeBuffer::DestRows(c) => (l.dest_rows[c.index()], t, 4),
        };
        Some(DeviceBuffer { ptr: self.base() + off, len, elem_bytes: elem })
    }

    /// A class's index buffer (`max_tokens` slices of the class's capacity; token `t`'s
    /// slice is `[indptr[t], indptr[t+1])`).
    pub(crate) fn indices(&self, class: Class) -> Option<DeviceBuffer> {
        self.buffer(DecodeBuffer::Indices(class))
    }

    /// A class's indptr (`max_tokens + 1` i32).
    pub(crate) fn indptr(&self, class: Class) -> Option<DeviceBuffer> {
        self.buffer(DecodeBuffer::Indptr(class))
    }

    /// A class's destination rows (`max_tokens` i32).
    pub(crate) fn dest_rows(&self, class: Class) -> Option<DeviceBuffer> {
        self.buffer(DecodeBuffer::DestRows(class))
    }

    /// Read an i32 sub-buffer back (waits for the stream). A buffer the geometry lacks is
    /// [`DecodeError::MissingClass`]; positions (i64) are [`DecodeError::NotI32`].
    pub(crate) fn read_i32(&self, which: DecodeBuffer) -> Result<Vec<i32>, DecodeError> {
        let buf = self.buffer(which).ok_or(DecodeError::MissingClass(Class::Dense))?;
        if buf.elem_bytes != 4 {
            return Err(DecodeError::NotI32(which.name()));
        }
        Ok(self.mem.read_i32(buf)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_lengths_follow_the_contract() {
        // Position 0: one window row, no heads.
        assert_eq!(decode_slice_lens(0, 1, 128, 512), (1, 0, 0));
        // Deep context: full window, top-k bound, HCA causal per token.
        assert_eq!(decode_slice_lens(999_999, 1_000_000, 128, 512), (128, 512, 7812));
        // An earlier spec token sees only groups that end at or before it (§13).
        assert_eq!(decode_slice_lens(254, 256, 128, 512).2, 1);
        assert_eq!(decode_slice_lens(255, 256, 128, 512).2, 2);
    }
}
