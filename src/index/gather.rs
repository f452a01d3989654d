//! The §9 DSpark window gather's launch argument (`index-buffers.md` §9), mirrored field for
//! field by `WindowGatherArgs` in `kernels/v4pool_common.h` (tests/layout/kernel_layout.rs compares
//! the two). Its own module so the contract's newer kernels do not crowd `index/mod.rs`.

use super::DevicePtr;
use crate::geometry::WindowParams;
use bytemuck::{Pod, Zeroable};

/// Bytes of one gathered window row: 512 bf16 (448 NoPE + 64 RoPE), in every variant.
pub const GATHER_ROW_BYTES: u64 = 1024;
/// Bytes of an fp8 NoPE row: 448 e4m3 values, 7 e8m0 scales each stored twice, padding.
pub const FP8_NOPE_ROW_BYTES: u64 = 512;
/// Bytes of a RoPE row: 64 bf16.
pub const ROPE_ROW_BYTES: u64 = 128;
/// fp8 NoPE values per row.
pub const FP8_NOPE_VALUES: usize = 448;
/// fp8 NoPE values one e8m0 scale covers.
pub const FP8_TILE: usize = 64;

/// DSpark window gather (§9): for `b < num_seqs`, `s < draft_window`, with
/// `p = anchor_pos[b] - (draft_window - 1) + s`: `out[b][s]` = zeros when `p < 0`, else row
/// `window_row(params, state_slot_per_seq[b], p)` of the source as 512 bf16. A sequence whose
/// slot is negative is a pad of a fixed graph grid: nothing of it is written.
///
/// Two kernels take it: `v4pool_window_gather` copies 1024-B bf16 rows from `pool` (`rope`
/// must be 0); `v4pool_window_gather_fp8` reads the NoPE plane at `pool` (512-B rows) and the
/// RoPE plane at `rope` (128-B rows) and dequantises NoPE tile by tile (`2^(e-127)`, e the
/// even scale byte `448 + 2i`, e = 0 → 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[non_exhaustive]
pub struct WindowGatherArgs {
    /// The source ring's window parameters (a class's, or a carried window's field params).
    pub params: WindowParams,
    /// Row 0 of the source view (1024-B bf16 rows, or the fp8 NoPE plane's 512-B rows).
    pub pool: DevicePtr,
    /// fp8 variant: row 0 of the RoPE plane's view (128-B rows); 0 in the copy variant.
    pub rope: DevicePtr,
    /// i32 `[num_seqs]`: physical slot per sequence, negative for a pad.
    pub state_slot_per_seq: DevicePtr,
    /// i64 `[num_seqs]`: the newest position of each sequence's window.
    pub anchor_pos: DevicePtr,
    /// bf16 out `[num_seqs, draft_window, 512]`.
    pub out: DevicePtr,
    /// Rows of the source view (a row outside it is never read).
    pub view_rows: i64,
    /// Sequences in the grid, pads included.
    pub num_seqs: i32,
    /// Window length Wd (1..=ring_slots).
    pub draft_window: i32,
}

crate::setters::with_setters!(WindowGatherArgs {
    with_params(params: WindowParams),
    with_pool(pool: DevicePtr),
    with_rope(rope: DevicePtr),
    with_state_slot_per_seq(state_slot_per_seq: DevicePtr),
    with_anchor_pos(anchor_pos: DevicePtr),
    with_out(out: DevicePtr),
    with_view_rows(view_rows: i64),
    with_num_seqs(num_seqs: i32),
    with_draft_window(draft_window: i32),
});
