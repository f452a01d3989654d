//! The host's share of a step that decode and prefill staging both use: per-token slice
//! lengths, the pool bounds positions and block ids are checked against, the sequence and
//! capacity checks, and where a translate-pack writes.
//!
//! Separate from the decode buffers because `prefill.rs`, `path.rs` and `rows.rs` call these
//! too: one formula, one place, with no dependency on the decode buffers' layout.

use super::DecodeError;
use crate::geometry::{
    visible_groups, Class, UnifiedPoolGeometry, WindowParams, CSA_RATIO, HCA_RATIO, NUM_SLOTS,
};
use std::ops::Range;

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

/// The batch-size rule decode and prefill staging share: at most `max_seqs` sequences.
pub(crate) fn check_batch_len(seqs: usize, max_seqs: usize) -> Result<(), DecodeError> {
    if seqs > max_seqs {
        return Err(DecodeError::TooManySeqs { got: seqs, cap: max_seqs });
    }
    Ok(())
}

/// The token rule they share: the batch's running token count (saturating) after adding
/// `num_tokens`, refused past `max_tokens`; checked sequence by sequence, so a sequence's
/// own refusals come after the counts of those before it.
pub(crate) fn add_tokens(tokens: usize, num_tokens: usize, max_tokens: usize) -> Result<usize, DecodeError> {
    let tokens = tokens.saturating_add(num_tokens);
    if tokens > max_tokens {
        return Err(DecodeError::TooManyTokens { got: tokens, cap: max_tokens });
    }
    Ok(tokens)
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
