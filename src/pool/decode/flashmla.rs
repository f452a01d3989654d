//! The decode path's FlashMLA mode (index-buffers.md §3f, §5f): the row widths FlashMLA's
//! sparse decode takes, one layer's operands, and the plan of views per class and layer.
//!
//! Separate from the CSR buffers in the parent because FlashMLA's row shapes (widths
//! multiples of 64, one view per distinct page shift) are that kernel's contract, not the
//! index path's.

use super::{DecodeCapacity, DecodeError};
use crate::geometry::{Class, UnifiedPoolGeometry, HCA_RATIO, NUM_SLOTS};
use crate::pool::owned::DeviceBuffer;

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

    /// The narrowest widths FlashMLA takes for `cap` on `pool` ([`FlashMlaWidths::for_capacity`]
    /// at the pool's geometry).
    pub fn for_pool(pool: &crate::pool::Pool, cap: DecodeCapacity) -> Result<Self, DecodeError> {
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
    /// The layer's page-view shift (`Pool::page_view(layer, _, page).row_shift`, `page` the
    /// spec's `kernel_page_rows`: 64, or 2 in `flashmla-v4-p2`), already in every
    /// index.
    pub shift: i32,
}

/// The decode path's FlashMLA mode: widths, each class's distinct view shifts (in order of
/// the class's first layer with that shift), and each layer's (class, view).
#[derive(Clone, Debug)]
pub(super) struct FlashPlan {
    pub(super) widths: FlashMlaWidths,
    pub(super) shifts: [Vec<i32>; NUM_SLOTS],
    pub(super) layer_view: Vec<Option<(Class, usize)>>,
}

impl FlashPlan {
    /// Views of the layers' `shifts` (`None`: absent layer), widths checked against `cap`.
    pub(super) fn new(
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

    pub(super) fn views(&self, c: usize) -> u64 {
        self.shifts[c].len() as u64
    }
}
