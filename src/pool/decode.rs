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

use super::owned::{Carve, DeviceBuffer, Owned};
use super::PoolError;
use crate::backend::{Backend, BackendError, Stream};
use crate::geometry::{visible_groups, Class, UnifiedPoolGeometry, WindowParams, CSA_RATIO, HCA_RATIO};
use crate::geometry::{GeometryError, NUM_SLOTS};
use crate::index::shape::MAX_GRID_YZ;
use crate::index::{ClassBuffers, CsaPackArgs, DecodeIndexArgs, DevicePtr, FlashMlaOut, Launch};
use crate::variant::VariantName;
use std::ops::Range;
use std::sync::Arc;
use thiserror::Error;

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

/// Row widths of the decode path's FlashMLA outputs (index-buffers.md §3f, §5f): FlashMLA's
/// sparse decode takes `indices [T, topk]` and `extra_indices_in_kvcache [T, extra_topk]` with
/// both widths multiples of 64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FlashMlaWidths {
    /// Window part of every class (`indices`): at least `win`.
    pub topk: i32,
    /// CSA compressed part (the translate-pack's rows): at least `index_topk`.
    pub csa_extra_topk: i32,
    /// HCA compressed part (the builder's rows): at least the longest HCA head the path takes,
    /// `max_blocks_per_seq × block_size / 128`.
    pub hca_extra_topk: i32,
}

impl FlashMlaWidths {
    /// These widths ([`FlashMlaWidths::for_pool`] gives the narrowest FlashMLA takes).
    pub fn new(topk: i32, csa_extra_topk: i32, hca_extra_topk: i32) -> Self {
        FlashMlaWidths { topk, csa_extra_topk, hca_extra_topk }
    }
}

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

impl FlashMlaWidths {
    /// The narrowest widths FlashMLA takes for `cap` on `pool` ([`FlashMlaWidths::for_capacity`]
    /// at the pool's geometry).
    pub fn for_pool(pool: &super::Pool, cap: DecodeCapacity) -> Result<Self, DecodeError> {
        Self::for_capacity(&pool.spec().geometry, cap)
    }

    /// The narrowest widths FlashMLA takes for `cap` on `geometry` (each rounded up to 64).
    pub fn for_capacity(geometry: &UnifiedPoolGeometry, cap: DecodeCapacity) -> Result<Self, DecodeError> {
        let need = flashmla_needs(geometry, cap)?;
        let up = |n: i64| {
            i32::try_from((n.max(1) + 63) / 64 * 64)
                .map_err(|_| DecodeError::TooLarge { what: "a FlashMLA row" })
        };
        Ok(FlashMlaWidths { topk: up(need[0])?, csa_extra_topk: up(need[1])?, hca_extra_topk: up(need[2])? })
    }
}

/// Entries each FlashMLA row must hold: [window, CSA head, HCA head] at their longest.
fn flashmla_needs(geometry: &UnifiedPoolGeometry, cap: DecodeCapacity) -> Result<[i64; 3], DecodeError> {
    let max_ctx = (cap.max_blocks_per_seq as i64)
        .checked_mul(geometry.block_size)
        .ok_or(DecodeError::TooLarge { what: "longest context" })?;
    Ok([i64::from(cap.win), i64::from(cap.index_topk), max_ctx / i64::from(HCA_RATIO)])
}

/// One layer's FlashMLA operands on a decode path (`DecodePath::flashmla`): int32 buffers, rows
/// of `max_tokens` tokens. The window part is its class's view for the layer's shift; the
/// compressed part the HCA view (builder) or the one CSA buffer (each CSA layer's pack).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashMlaBuffers {
    /// `indices [max_tokens, topk]`.
    pub indices: DeviceBuffer,
    /// `topk_length [max_tokens]`.
    pub topk_length: DeviceBuffer,
    /// `extra_indices_in_kvcache [max_tokens, extra_topk]` (`None`: a dense layer).
    pub extra_indices: Option<DeviceBuffer>,
    /// `extra_topk_length [max_tokens]` (with `extra_indices`).
    pub extra_topk_length: Option<DeviceBuffer>,
    /// FlashMLA's own `topk_length [max_seqs]`: per batch entry (a staged sequence, its tokens
    /// FlashMLA's `s_q` queries), the longest of its tokens' `topk_length`; 0 for a pad.
    /// Exact for every token: a token's row is −1 from its own length on, and FlashMLA skips −1.
    pub seq_topk_length: DeviceBuffer,
    /// FlashMLA's own `extra_topk_length [max_seqs]` (with `extra_indices`), formed as
    /// `seq_topk_length`; the CSA one is what the layer's pack writes (staged with the batch).
    pub seq_extra_topk_length: Option<DeviceBuffer>,
    /// Entries per row of `indices`.
    pub topk: i32,
    /// Entries per row of `extra_indices` (0 for a dense layer).
    pub extra_topk: i32,
    /// The layer's page-view shift (`Pool::page_view(layer, _, 64).row_shift`), already in every
    /// index.
    pub shift: i32,
}

/// One sequence of a decode step.
#[derive(Clone, Copy, Debug)]
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

/// One decode step's batch as flat arrays, one per field (index `b` is sequence `b`): the
/// shape a foreign caller (the Python module, the C ABI) hands over, turned into
/// [`DecodeSeq`]s by [`crate::pool::DecodePath::stage_flat`].
#[derive(Clone, Copy, Debug)]
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

/// What the decode path refuses.
#[derive(Debug, Error)]
pub enum DecodeError {
    /// More sequences than the buffers hold.
    #[error("batch of {got} sequences exceeds the {cap} the buffers were sized for")]
    TooManySeqs {
        /// Sequences asked for.
        got: usize,
        /// `max_seqs`.
        cap: usize,
    },
    /// More tokens than the buffers hold (or a token count that overflows).
    #[error("batch of {got} tokens exceeds the {cap} the buffers were sized for")]
    TooManyTokens {
        /// Tokens asked for (saturated at `usize::MAX` when the sum overflows).
        got: usize,
        /// `max_tokens`.
        cap: usize,
    },
    /// A block table longer than the buffers' columns.
    #[error("sequence {seq}: block table of {got} columns exceeds {cap}")]
    BlockTableTooLong {
        /// Sequence (batch row).
        seq: usize,
        /// Columns asked for.
        got: usize,
        /// `max_blocks_per_seq`.
        cap: usize,
    },
    /// A block table shorter than the context needs.
    #[error("sequence {seq}: context {context_len} needs {needed} blocks, its table has {got}")]
    BlockTableTooShort {
        /// Sequence (batch row).
        seq: usize,
        /// Its context length.
        context_len: i64,
        /// Blocks the context needs.
        needed: i64,
        /// Columns given.
        got: usize,
    },
    /// A context the buffers or the pool cannot index.
    #[error("sequence {seq}: context {context_len} is more than the {limit} tokens {why}")]
    ContextTooLong {
        /// Sequence (batch row).
        seq: usize,
        /// Its context length.
        context_len: i64,
        /// The most tokens allowed.
        limit: i64,
        /// What sets the limit.
        why: &'static str,
    },
    /// A sequence with no tokens, a negative context, or more tokens than context.
    #[error("sequence {seq}: {num_tokens} tokens with context {context_len}")]
    BadSequence {
        /// Sequence (batch row).
        seq: usize,
        /// Its token count.
        num_tokens: usize,
        /// Its context length.
        context_len: i64,
    },
    /// A position that is not a live slot of the pool.
    #[error("sequence {seq}: position {position} outside the pool's live slot positions {first}..{end}")]
    BadPosition {
        /// Sequence (batch row).
        seq: usize,
        /// The position given.
        position: i64,
        /// First live position.
        first: i64,
        /// One past the last live position.
        end: i64,
    },
    /// A block id outside the pool's block region.
    #[error("sequence {seq}: block id {block} at column {column} outside the pool's blocks 0..{num_blocks}")]
    BadBlock {
        /// Sequence (batch row).
        seq: usize,
        /// Column of the table.
        column: usize,
        /// The id given.
        block: i32,
        /// Blocks the pool has now.
        num_blocks: i64,
    },
    /// A staged block id the build would read is no longer in the pool's block region (the
    /// boundary moved after staging): restage with the moved ids.
    #[error("sequence {seq}: staged block id {block} is outside the pool's blocks 0..{num_blocks} now")]
    StaleBlock {
        /// Sequence (batch row).
        seq: usize,
        /// The highest staged id the build reads for it.
        block: i32,
        /// Blocks the pool has now.
        num_blocks: i64,
    },
    /// A window outside the ring.
    #[error("window {win} must be in 1..={ring_slots} (the ring)")]
    BadWindow {
        /// `win` asked for.
        win: i32,
        /// The geometry's ring.
        ring_slots: i64,
    },
    /// A zero capacity.
    #[error("{what} must be positive")]
    ZeroCapacity {
        /// Which capacity.
        what: &'static str,
    },
    /// A negative top-k.
    #[error("index_topk {0} must not be negative")]
    NegativeTopk(i32),
    /// A class the geometry lacks.
    #[error("the geometry lacks the {0} class this buffer needs")]
    MissingClass(Class),
    /// A path that does not yet build a geometry whose layers share compressors (V4.1).
    #[error("the {path} path does not build layers that share compressors (V4.1) yet")]
    SharedCompressors {
        /// The path.
        path: &'static str,
    },
    /// The one-CSA-buffer pack of a geometry whose layers share compressors: each layer
    /// packs with its own compress bias ([`crate::pool::DecodePath::layer_pack`]).
    #[error("layers share compressors here: pack per layer (layer_pack), each with its bias")]
    PackNeedsLayer,
    /// A layer no translate-pack fills: window-only, absent, or V4's coarse class (its heads
    /// are the builder's).
    #[error("layer {layer} is not filled by a translate-pack")]
    NotPacked {
        /// The layer.
        layer: usize,
    },
    /// Buffers whose sizes overflow (a byte count past `u64`, or an index past `i32`).
    #[error("capacity too large: {what} overflows")]
    TooLarge {
        /// What overflowed.
        what: &'static str,
    },
    /// More tokens per step than one decode-builder launch takes (tokens are its grid y).
    #[error("max_tokens {max_tokens} exceeds the decode builder's {limit} tokens per launch")]
    TokensPastGrid {
        /// `max_tokens` asked for.
        max_tokens: usize,
        /// The limit (`shape::MAX_GRID_YZ`).
        limit: u32,
    },
    /// A forward whose slices overflow one of the buffers.
    #[error("{what}: {got} exceed the buffer's {cap}")]
    BufferFull {
        /// Which buffer.
        what: &'static str,
        /// Entries the forward needs.
        got: u64,
        /// Entries the buffer holds.
        cap: u64,
    },
    /// A top-k row stride shorter than `index_topk`.
    #[error("top-k row stride {stride} is shorter than index_topk {topk}")]
    TopkStride {
        /// Stride given.
        stride: i32,
        /// `index_topk`.
        topk: i32,
    },
    /// A FlashMLA row width that is not a multiple of 64 (FlashMLA's sparse decode needs it).
    #[error("FlashMLA {what} width {width} is not a positive multiple of 64")]
    FlashMlaWidth {
        /// Which row.
        what: &'static str,
        /// Width given.
        width: i32,
    },
    /// A FlashMLA row too narrow for what the path can stage into it.
    #[error("FlashMLA {what} width {width} is narrower than the {need} entries the path can stage")]
    FlashMlaTooNarrow {
        /// Which row.
        what: &'static str,
        /// Width given.
        width: i32,
        /// Entries the row must hold.
        need: i64,
    },
    /// A FlashMLA operand asked of a path built without them, or of a layer without a view.
    #[error("no FlashMLA operands: {why}")]
    NoFlashMla {
        /// Why.
        why: &'static str,
    },
    /// A buffer read back with the wrong element type.
    #[error("{0} is not an i32 buffer")]
    NotI32(&'static str),
    /// A buffer read back that is not inside the path's own memory (an address outside it, or
    /// a length past its end or whose byte count overflows).
    #[error("buffer at {ptr:#x} of {len} elements is not inside the path's {bytes} bytes")]
    OutOfRange {
        /// Address given.
        ptr: DevicePtr,
        /// Elements given.
        len: u64,
        /// Bytes the path holds.
        bytes: u64,
    },
    /// Flat batch arrays (one per field) of different lengths.
    #[error(
        "batch arrays differ in length: {positions} positions, {context_lens} context lengths, {num_tokens} token counts"
    )]
    BatchShape {
        /// Positions given.
        positions: usize,
        /// Context lengths given.
        context_lens: usize,
        /// Token counts given.
        num_tokens: usize,
    },
    /// A token count in flat batch arrays that is negative or past `usize`.
    #[error("sequence {seq}: {num_tokens} tokens is not a count")]
    BadTokenCount {
        /// Sequence (batch row).
        seq: usize,
        /// Its token count.
        num_tokens: i64,
    },
    /// A backend failure.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The geometry cannot say a class's ratio (its index slots are not laid out).
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// A pool failure (its lock, a handle it does not hold); boxed, a pool error can carry a
    /// decode error.
    #[error("pool: {0}")]
    Pool(#[source] Box<PoolError>),
}

impl VariantName for DecodeError {
    fn variant_name(&self) -> &'static str {
        use DecodeError::*;
        match self {
            TooManySeqs { .. } => "TooManySeqs",
            TooManyTokens { .. } => "TooManyTokens",
            BlockTableTooLong { .. } => "BlockTableTooLong",
            BlockTableTooShort { .. } => "BlockTableTooShort",
            ContextTooLong { .. } => "ContextTooLong",
            BadSequence { .. } => "BadSequence",
            BadPosition { .. } => "BadPosition",
            BadBlock { .. } => "BadBlock",
            StaleBlock { .. } => "StaleBlock",
            BadWindow { .. } => "BadWindow",
            ZeroCapacity { .. } => "ZeroCapacity",
            NegativeTopk(_) => "NegativeTopk",
            MissingClass(_) => "MissingClass",
            SharedCompressors { .. } => "SharedCompressors",
            PackNeedsLayer => "PackNeedsLayer",
            NotPacked { .. } => "NotPacked",
            TooLarge { .. } => "TooLarge",
            TokensPastGrid { .. } => "TokensPastGrid",
            BufferFull { .. } => "BufferFull",
            TopkStride { .. } => "TopkStride",
            FlashMlaWidth { .. } => "FlashMlaWidth",
            FlashMlaTooNarrow { .. } => "FlashMlaTooNarrow",
            NoFlashMla { .. } => "NoFlashMla",
            NotI32(_) => "NotI32",
            OutOfRange { .. } => "OutOfRange",
            BatchShape { .. } => "BatchShape",
            BadTokenCount { .. } => "BadTokenCount",
            Backend(e) => e.variant_name(),
            Geometry(e) => e.variant_name(),
            Pool(e) => e.variant_name(),
        }
    }

    fn is_device_failure(&self) -> bool {
        match self {
            DecodeError::Backend(e) => e.is_device_failure(),
            DecodeError::Geometry(e) => e.is_device_failure(),
            DecodeError::Pool(e) => e.is_device_failure(),
            _ => false,
        }
    }
}

/// Slice lengths of one V4 decode token: window rows, CSA head, HCA head.
#[inline]
pub fn decode_slice_lens(pos: i64, ctx: i64, win: i64, topk: i64) -> (i64, i64, i64) {
    class_slice_lens(pos, ctx, win, topk, [i64::from(CSA_RATIO), i64::from(HCA_RATIO)], true)
}

/// Slice lengths of one decode token for the fine and coarse slots' `ratios`: window rows,
/// then each slot's head, `visible_groups(pos, ratio)` compressed rows (the per-sequence
/// `ctx / ratio` bound is redundant where `pos < ctx`, kept as V4 had it), capped by the
/// top-k — except the coarse slot under `coarse_head_fill` (V4), which takes them all.
#[inline]
pub fn class_slice_lens(
    pos: i64,
    ctx: i64,
    win: i64,
    topk: i64,
    ratios: [i64; 2],
    coarse_head_fill: bool,
) -> (i64, i64, i64) {
    let n = (pos + 1).min(win);
    let head = |r: i64| visible_groups(pos, r).min(ctx / r);
    let fine = head(ratios[0]).min(topk);
    let coarse = if coarse_head_fill { head(ratios[1]) } else { head(ratios[1]).min(topk) };
    (n, fine, coarse)
}

/// The bounds staging checks positions and block ids against: the pool's live slot
/// positions and its block count (a [`crate::pool::DecodePath`] reads both from the pool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PoolBounds {
    /// Live slot positions.
    pub live: Range<i64>,
    /// Blocks in the block region (ids `0..num_blocks`).
    pub num_blocks: i64,
}

impl PoolBounds {
    /// The bounds of `geometry` at its split.
    pub fn of(geometry: &UnifiedPoolGeometry) -> PoolBounds {
        PoolBounds { live: geometry.live_positions(), num_blocks: geometry.num_blocks }
    }
}

/// Checks one sequence shared by decode and prefill staging: position live, context
/// within what the tables and the pool can index, table length, and (when `ids`) every id
/// a block of the pool. Returns the blocks the context needs.
#[allow(clippy::too_many_arguments)] // one input per rule checked; a struct would only rename them
pub(crate) fn check_seq(
    seq: usize,
    position: i64,
    context_len: i64,
    table: &[i32],
    ids: bool,
    bounds: &PoolBounds,
    max_blocks_per_seq: usize,
    block_size: i64,
) -> Result<(), DecodeError> {
    if !bounds.live.contains(&position) {
        return Err(DecodeError::BadPosition {
            seq,
            position,
            first: bounds.live.start,
            end: bounds.live.end,
        });
    }
    let too_long = |limit: i64, why| DecodeError::ContextTooLong { seq, context_len, limit, why };
    let table_limit = (max_blocks_per_seq as i64).saturating_mul(block_size);
    if context_len > table_limit {
        return Err(too_long(table_limit, "the buffers' block-table columns cover"));
    }
    let pool_limit = bounds.num_blocks.saturating_mul(block_size);
    if context_len > pool_limit {
        return Err(too_long(pool_limit, "the pool's blocks hold"));
    }
    if table.len() > max_blocks_per_seq {
        return Err(DecodeError::BlockTableTooLong { seq, got: table.len(), cap: max_blocks_per_seq });
    }
    // 0 ≤ context_len ≤ table_limit here, so this cannot overflow.
    let needed = (context_len + block_size - 1) / block_size;
    if (table.len() as i64) < needed {
        return Err(DecodeError::BlockTableTooShort { seq, context_len, needed, got: table.len() });
    }
    if ids {
        if let Some((column, &block)) =
            table.iter().enumerate().find(|(_, &b)| !(0..bounds.num_blocks).contains(&i64::from(b)))
        {
            return Err(DecodeError::BadBlock { seq, column, block, num_blocks: bounds.num_blocks });
        }
    }
    Ok(())
}

/// Checks shared by the decode and prefill capacities: `[max_seqs, max_tokens,
/// max_blocks_per_seq]` positive, the window inside the ring, top-k not negative, CSA and
/// HCA classes present. Returns each class's window params (`None`: absent).
pub(crate) fn check_capacity(
    geometry: &UnifiedPoolGeometry,
    counts: [usize; 3],
    win: i32,
    index_topk: i32,
) -> Result<[Option<WindowParams>; NUM_SLOTS], DecodeError> {
    for (what, v) in ["max_seqs", "max_tokens", "max_blocks_per_seq"].into_iter().zip(counts) {
        if v == 0 {
            return Err(DecodeError::ZeroCapacity { what });
        }
    }
    if win < 1 || i64::from(win) > geometry.ring_slots {
        return Err(DecodeError::BadWindow { win, ring_slots: geometry.ring_slots });
    }
    if index_topk < 0 {
        return Err(DecodeError::NegativeTopk(index_topk));
    }
    for c in [Class::Csa, Class::Hca] {
        // More than two compressed classes have no slots: no buffers can be built.
        if geometry.class_ratio(c)?.is_none() {
            return Err(DecodeError::MissingClass(c));
        }
    }
    Ok(Class::ALL.map(|c| geometry.class_window_params(c).ok()))
}

/// Block-table columns a sequence of `context_len` tokens reads: its blocks, `ceil(context /
/// block_size)` (`context_len` was checked non-negative and within the table).
pub(crate) fn read_columns(context_len: i64, block_size: i64) -> usize {
    (context_len.max(0) as u64).div_ceil(block_size.max(1) as u64) as usize
}

/// The first sequence whose highest read block id (`max_ids[seq]`, `None`: reads none) is no
/// longer below `num_blocks` (the boundary moved after staging).
pub(crate) fn check_blocks(max_ids: &[Option<i32>], num_blocks: i64) -> Result<(), DecodeError> {
    match max_ids
        .iter()
        .enumerate()
        .find_map(|(seq, m)| m.filter(|&b| i64::from(b) >= num_blocks).map(|b| (seq, b)))
    {
        Some((seq, block)) => Err(DecodeError::StaleBlock { seq, block, num_blocks }),
        None => Ok(()),
    }
}

/// Where a translate-pack writes, derived once from the geometry for both index paths
/// (decode and prefill): V4's class-wide coarse head fill, and every layer's slot (`None`:
/// absent) and compress bias.
#[derive(Clone, Debug)]
pub(crate) struct PackTargets {
    /// V4's class-wide coarse head fill ([`UnifiedPoolGeometry::coarse_head_fill`]); without
    /// it both compressed slots are packed per layer.
    pub(crate) head_fill: bool,
    layer_slots: Vec<Option<Class>>,
    compress_bias: Vec<i64>,
}

impl PackTargets {
    pub(crate) fn of(geometry: &UnifiedPoolGeometry) -> PackTargets {
        PackTargets {
            head_fill: geometry.coarse_head_fill(),
            layer_slots: (0..geometry.num_layers).map(|l| geometry.layer_slot(l).ok()).collect(),
            compress_bias: geometry.compress_bias.clone(),
        }
    }

    /// The slot and compress bias of a translate-pack of one layer's top-k: `None`, V4's
    /// one-CSA-buffer pack of any CSA layer (every CSA layer owns its rows; bias 0; refused
    /// where layers share compressors, [`DecodeError::PackNeedsLayer`]); `Some(layer)`,
    /// compressed layer `layer` into the heads of its slot's buffer with its compress bias
    /// (V4.1: both slots, every compressed layer, after its indexer; V4's coarse heads are
    /// the builder's, so its coarse layers are refused, [`DecodeError::NotPacked`]).
    pub(crate) fn target(&self, layer: Option<usize>) -> Result<(Class, i64), DecodeError> {
        let Some(layer) = layer else {
            return if self.head_fill { Ok((Class::Csa, 0)) } else { Err(DecodeError::PackNeedsLayer) };
        };
        match self.layer_slots.get(layer).copied().flatten() {
            // Both tables hold one entry per layer.
            Some(c @ (Class::Csa | Class::Hca)) if !(c == Class::Hca && self.head_fill) => {
                self.compress_bias.get(layer).map(|&bias| (c, bias)).ok_or(DecodeError::NotPacked { layer })
            }
            _ => Err(DecodeError::NotPacked { layer }),
        }
    }
}

/// What both translate-packs (decode and prefill) check and derive for `slot`: a top-k row
/// stride of at least `index_topk` (the kernel reads that much of a row), the slot's compress
/// ratio, and the compressed rows a block holds for it (`block_size / ratio`).
pub(crate) fn pack_slot(
    index_topk: i32,
    topk_row_stride: i32,
    slot_ratios: [i64; 2],
    slot: Class,
    block_size: i64,
) -> Result<(i64, i32), DecodeError> {
    if topk_row_stride < index_topk.max(1) {
        return Err(DecodeError::TopkStride { stride: topk_row_stride, topk: index_topk });
    }
    let ratio = slot_ratios[slot.index() - 1];
    Ok((ratio, (block_size / ratio) as i32))
}

/// The fine and coarse slots' compress ratios of `geometry` (V4: 4, 128).
pub(crate) fn slot_ratios(geometry: &UnifiedPoolGeometry) -> Result<[i64; 2], DecodeError> {
    let r = |c| geometry.class_ratio(c)?.map(i64::from).ok_or(DecodeError::MissingClass(c));
    Ok([r(Class::Csa)?, r(Class::Hca)?])
}

/// The first staged position no longer in `live` (the boundary moved after staging).
pub(crate) fn check_live(positions: &[i64], live: &Range<i64>) -> Result<(), DecodeError> {
    match positions.iter().enumerate().find(|(_, p)| !live.contains(p)) {
        Some((seq, &position)) => {
            Err(DecodeError::BadPosition { seq, position, first: live.start, end: live.end })
        }
        None => Ok(()),
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

/// The decode path's FlashMLA mode: widths, each class's distinct view shifts (in order of
/// the class's first layer with that shift), and each layer's (class, view).
#[derive(Clone, Debug)]
struct FlashPlan {
    widths: FlashMlaWidths,
    shifts: [Vec<i32>; NUM_SLOTS],
    layer_view: Vec<Option<(Class, usize)>>,
}

impl FlashPlan {
    /// Views of the layers' `shifts` (`None`: absent layer), widths checked against `cap`.
    fn new(
        geometry: &UnifiedPoolGeometry,
        cap: DecodeCapacity,
        widths: FlashMlaWidths,
        layer_shifts: &[Option<i32>],
    ) -> Result<FlashPlan, DecodeError> {
        if !geometry.coarse_head_fill() {
            return Err(DecodeError::SharedCompressors { path: "FlashMLA decode" });
        }
        let need = flashmla_needs(geometry, cap)?;
        let rows = [
            ("indices", widths.topk),
            ("CSA extra", widths.csa_extra_topk),
            ("HCA extra", widths.hca_extra_topk),
        ];
        for ((what, width), need) in rows.into_iter().zip(need) {
            if width < 1 || width % 64 != 0 {
                return Err(DecodeError::FlashMlaWidth { what, width });
            }
            if i64::from(width) < need {
                return Err(DecodeError::FlashMlaTooNarrow { what, width, need });
            }
        }
        let mut shifts: [Vec<i32>; NUM_SLOTS] = Default::default();
        let mut layer_view = Vec::with_capacity(layer_shifts.len());
        for (l, shift) in layer_shifts.iter().enumerate() {
            let (Some(shift), Ok(class)) = (shift, geometry.layer_slot(l)) else {
                layer_view.push(None);
                continue;
            };
            let views = &mut shifts[class.index()];
            let v = views.iter().position(|s| s == shift).unwrap_or_else(|| {
                views.push(*shift);
                views.len() - 1
            });
            layer_view.push(Some((class, v)));
        }
        Ok(FlashPlan { widths, shifts, layer_view })
    }

    fn views(&self, c: usize) -> u64 {
        self.shifts[c].len() as u64
    }
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

    /// Stage a batch: metadata and the sequences' block tables, one upload of O(context)
    /// bytes (every table is sent). Returns the batch's real token count.
    pub(crate) fn stage(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.upload_metadata(batch, true)
    }

    /// Stage a batch whose block tables are already resident on the device (batch row `b`
    /// holds sequence `b`'s table, kept current with [`Self::write_block_table`]): one
    /// upload of the O(batch) metadata only. Each `block_table` is checked for length but not
    /// sent.
    pub(crate) fn stage_resident(&mut self, batch: &[DecodeSeq<'_>]) -> Result<usize, DecodeError> {
        self.upload_metadata(batch, false)
    }

    fn upload_metadata(&mut self, batch: &[DecodeSeq<'_>], tables: bool) -> Result<usize, DecodeError> {
        let _range = crate::profiling::range("v4pool.decode_stage");
        let (bytes, tokens) = self.build_metadata(batch, tables)?;
        self.mem.upload(0, &self.staging[..bytes])?;
        if tables {
            for (b, s) in batch.iter().enumerate() {
                self.mirror_write(b, 0, s.block_table);
            }
        }
        self.staged_positions.clear();
        self.staged_positions.extend(batch.iter().map(|s| s.position));
        self.staged_columns.clear();
        self.staged_columns.extend(batch.iter().map(|s| read_columns(s.context_len, self.block_size)));
        self.staged_tokens = tokens;
        Ok(tokens)
    }

    /// Record `ids` written at `row`, `start ..` of the device tables (both checked in range).
    fn mirror_write(&mut self, row: usize, start: usize, ids: &[i32]) {
        let w = self.cap.max_blocks_per_seq;
        let r = row * w;
        let end = start + ids.len();
        self.tables[r + start..r + end].copy_from_slice(ids);
        self.row_len[row] = self.row_len[row].max(end);
        let mut m = if start == 0 { i32::MIN } else { self.table_max[r + start - 1] };
        for c in start..self.row_len[row] {
            m = m.max(self.tables[r + c]);
            self.table_max[r + c] = m;
        }
    }

    /// The highest block id the build reads from each staged row, from the mirror (columns
    /// never written hold id 0 on the device).
    fn staged_max_ids(&self) -> Vec<Option<i32>> {
        let w = self.cap.max_blocks_per_seq;
        self.staged_columns
            .iter()
            .enumerate()
            .map(|(row, &cols)| {
                if cols == 0 {
                    return None;
                }
                let len = self.row_len[row];
                let written = (len > 0).then(|| self.table_max[row * w + cols.min(len) - 1]);
                let unwritten = (cols > len).then_some(0);
                written.max(unwritten)
            })
            .collect()
    }

    /// Check the staged batch against `bounds` (the pool's now; the boundary may have moved
    /// since staging): its positions still live slots, and the block ids a build or a
    /// translate-pack reads (from the tables staged or written since) still below the block
    /// count. Both kernels turn those ids into pool rows, so both run only after this.
    pub(crate) fn check_staged(&self, bounds: &PoolBounds) -> Result<(), DecodeError> {
        check_live(&self.staged_positions, &bounds.live)?;
        check_blocks(&self.staged_max_ids(), bounds.num_blocks)
    }

    /// Write `ids` into the device block table of batch row `row` from column `start_col`
    /// (an entering sequence's whole table, or the blocks a sequence just gained). Every id
    /// must be a block of the pool (see [`PoolBounds`]).
    pub(crate) fn write_block_table(
        &mut self,
        row: usize,
        start_col: usize,
        ids: &[i32],
    ) -> Result<(), DecodeError> {
        let cap = self.cap;
        if row >= cap.max_seqs {
            return Err(DecodeError::TooManySeqs { got: row.saturating_add(1), cap: cap.max_seqs });
        }
        let end = start_col.saturating_add(ids.len());
        if end > cap.max_blocks_per_seq {
            return Err(DecodeError::BlockTableTooLong { seq: row, got: end, cap: cap.max_blocks_per_seq });
        }
        let n = self.bounds.num_blocks;
        if let Some((i, &block)) = ids.iter().enumerate().find(|(_, &b)| !(0..n).contains(&i64::from(b))) {
            return Err(DecodeError::BadBlock { seq: row, column: start_col + i, block, num_blocks: n });
        }
        let off = self.layout.block_tables + 4 * (row * cap.max_blocks_per_seq + start_col) as u64;
        self.mem.upload(off, bytemuck::cast_slice(ids))?;
        self.mirror_write(row, start_col, ids);
        Ok(())
    }

    /// Run the decode builder over the staged batch on the buffers' stream.
    pub(crate) fn build(&self) -> Result<(), DecodeError> {
        let _range = crate::profiling::range("v4pool.decode_build");
        // SAFETY: every pointer is this handle's own, sized for `max_tokens`; the staged
        // indptrs were computed here and fit each class's slice capacity (checked when the
        // batch was staged), so the kernel writes inside the index buffers.
        unsafe { self.mem.launch(&self.launch())? };
        Ok(())
    }

    /// Run the translate-pack of [`Self::pack_args`] on the buffers' stream.
    ///
    /// # Safety
    /// `topk` must address live memory of this backend holding i32
    /// `[max_tokens][topk_row_stride]`, ordered before this call on the stream, non-negative where the
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
        // SAFETY: the caller vouches for `topk`; every other pointer is this handle's own.
        unsafe { self.mem.launch(&Launch::CsaPack(args))? };
        Ok(())
    }

    /// Fill the host staging image (with the block tables when `tables`); returns (bytes to
    /// upload, real tokens). Nothing is written unless the whole batch is valid.
    fn build_metadata(
        &mut self,
        batch: &[DecodeSeq<'_>],
        tables: bool,
    ) -> Result<(usize, usize), DecodeError> {
        let cap = self.cap;
        if batch.len() > cap.max_seqs {
            return Err(DecodeError::TooManySeqs { got: batch.len(), cap: cap.max_seqs });
        }
        let mut tokens = 0usize;
        for (i, s) in batch.iter().enumerate() {
            tokens = tokens.saturating_add(s.num_tokens);
            if tokens > cap.max_tokens {
                return Err(DecodeError::TooManyTokens { got: tokens, cap: cap.max_tokens });
            }
            // num_tokens ≤ max_tokens here, so the cast is exact.
            if s.num_tokens == 0 || s.context_len < s.num_tokens as i64 {
                return Err(DecodeError::BadSequence {
                    seq: i,
                    num_tokens: s.num_tokens,
                    context_len: s.context_len,
                });
            }
            check_seq(
                i,
                s.position,
                s.context_len,
                s.block_table,
                tables,
                &self.bounds,
                cap.max_blocks_per_seq,
                self.block_size,
            )?;
        }
        let l = self.layout;
        let dense = self.has_class(Class::Dense);
        let st = &mut self.staging;
        let put_i32 = |st: &mut Vec<u8>, off: u64, i: usize, v: i32| {
            let o = off as usize + 4 * i;
            st[o..o + 4].copy_from_slice(&v.to_ne_bytes());
        };
        let (win, topk) = (i64::from(cap.win), i64::from(cap.index_topk));
        let mut ptr = [0i64; NUM_SLOTS];
        for c in 0..NUM_SLOTS {
            put_i32(st, l.indptr[c], 0, 0);
        }
        self.csa_heads.clear();
        let flash = self.flash.is_some();
        if flash {
            // Pads (and the rest of a longer earlier batch) get length 0.
            for b in 0..cap.max_seqs {
                put_i32(st, l.fm_seq_length, b, 0);
                for &at in &l.fm_seq_extra_length {
                    put_i32(st, at, b, 0);
                }
            }
        }
        let mut t = 0usize;
        for (b, s) in batch.iter().enumerate() {
            // Live positions lie in the plane, whose rows fit an i32.
            put_i32(st, l.slots, b, s.position as i32);
            if tables {
                let row = l.block_tables as usize + 4 * b * cap.max_blocks_per_seq;
                st[row..row + 4 * s.block_table.len()].copy_from_slice(bytemuck::cast_slice(s.block_table));
            }
            for k in 0..s.num_tokens {
                let pos = s.context_len - s.num_tokens as i64 + k as i64;
                let (n, csa, hca) =
                    class_slice_lens(pos, s.context_len, win, topk, self.slot_ratios, self.targets.head_fill);
                // At most index_topk and a position / the fine ratio: both i32.
                self.csa_heads.push([csa as i32, ((pos + 1) / self.slot_ratios[0]) as i32]);
                if flash {
                    // FlashMLA's per-batch-entry lengths (its `s_q` tokens share one): the
                    // longest of the sequence's tokens, the same slice lengths the builder and
                    // the pack write per token (each within an i32, as the indptrs are).
                    let get = |st: &Vec<u8>, off: u64| {
                        let o = off as usize + 4 * b;
                        i32::from_ne_bytes([st[o], st[o + 1], st[o + 2], st[o + 3]])
                    };
                    let longest = get(st, l.fm_seq_length).max(n as i32);
                    put_i32(st, l.fm_seq_length, b, longest);
                    for (c, part) in [(Class::Csa, csa), (Class::Hca, hca)] {
                        let at = l.fm_seq_extra_length[c.index()];
                        let longest = get(st, at).max(part as i32);
                        put_i32(st, at, b, longest);
                    }
                }
                put_i32(st, l.batch_ids, t, b as i32);
                let o = l.positions as usize + 8 * t;
                st[o..o + 8].copy_from_slice(&pos.to_ne_bytes());
                ptr[Class::Dense.index()] += if dense { n } else { 0 };
                ptr[Class::Csa.index()] += csa + n;
                ptr[Class::Hca.index()] += hca + n;
                // Each slice is within its class's capacity (the context checks bound the
                // HCA head), and `plan` checked max_tokens × capacity fits an i32.
                for (&at, &p) in l.indptr.iter().zip(&ptr) {
                    put_i32(st, at, t + 1, p as i32);
                }
                t += 1;
            }
        }
        // Pad tokens: batch id −1, empty slices (the indptr tail repeats its last value).
        for p in t..cap.max_tokens {
            put_i32(st, l.batch_ids, p, -1);
            for (&at, &end) in l.indptr.iter().zip(&ptr) {
                put_i32(st, at, p + 1, end as i32);
            }
        }
        Ok((if tables { l.meta_end } else { l.block_tables } as usize, t))
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
