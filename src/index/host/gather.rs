//! The §9 DSpark window gather (index-buffers.md §9): a dense `[B, Wd, 512]` bf16 window from a
//! ring, copied (bf16 rows) or dequantised (fp8 NoPE + bf16 RoPE planes).

use super::*;
use crate::checked::sub;
use crate::index::{FP8_NOPE_ROW_BYTES, FP8_NOPE_VALUES, FP8_TILE, GATHER_ROW_BYTES, ROPE_ROW_BYTES};

/// Where a gather reads its rows: the same row index in every plane of the source.
#[derive(Clone, Copy, Debug)]
pub enum GatherPlanes<'a> {
    /// 1024-B bf16 rows (a bf16 plane's layer view, or a carried window's retyped plane).
    Bf16 {
        /// The view's rows.
        pool: &'a [u8],
    },
    /// The fp8 pool's two planes.
    Fp8 {
        /// NoPE rows of 512 B: 448 e4m3 values, 7 e8m0 scales each stored twice, padding.
        nope: &'a [u8],
        /// RoPE rows of 128 B: 64 bf16.
        rope: &'a [u8],
    },
}

/// bf16 bits of `f`, rounded to nearest even; NaN is `0x7fc0` (the kernel's `v4p_bf16_rne`).
fn bf16_rne(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return 0x7fc0;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// The e8m0 scale byte `e` as a float: `2^(e-127)`, 0 for `e = 0` (an all-zero tile).
pub fn e8m0_scale(e: u8) -> f32 {
    if e == 0 {
        0.0
    } else {
        f32::from_bits(u32::from(e) << 23)
    }
}

/// One e4m3fn byte times `scale` as bf16 bits (the kernel's `v4p_fp8_scaled_bf16`): the
/// byte's value is exact in f32, so the product's rounding and the bf16 rounding are the only
/// ones, as `float(x) * scale` then a cast to bf16. `0x7f` / `0xff` are NaN.
pub fn fp8_scaled_bf16(byte: u8, scale: f32) -> u16 {
    let mag = u32::from(byte & 0x7f);
    if mag == 0x7f {
        return 0x7fc0;
    }
    let v = if mag >= 8 {
        f32::from_bits((mag << 20) + (120 << 23))
    } else {
        mag as f32 * f32::from_bits(118 << 23)
    };
    bf16_rne(if byte & 0x80 != 0 { -v } else { v } * scale)
}

/// One fp8 row pair as 512 bf16 into `out` (1024 B, native order): NoPE tile `i` scaled by its
/// even scale byte `448 + 2i`, the RoPE part copied.
pub fn dequant_fp8_row(nope: &[u8], rope: &[u8], out: &mut [u8]) {
    for (i, v) in nope[..FP8_NOPE_VALUES].iter().enumerate() {
        let scale = e8m0_scale(nope[FP8_NOPE_VALUES + 2 * (i / FP8_TILE)]);
        out[2 * i..2 * i + 2].copy_from_slice(&fp8_scaled_bf16(*v, scale).to_ne_bytes());
    }
    out[2 * FP8_NOPE_VALUES..].copy_from_slice(rope);
}

/// Byte range of row `row` in a buffer of `width`-byte rows, checked against its length.
pub(super) fn row_range(
    row: i64,
    width: u64,
    len: usize,
    buffer: &'static str,
) -> Result<std::ops::Range<usize>> {
    let oob = || HostKernelError::OutOfBounds { buffer, index: row, len };
    let start = usize::try_from(row_byte_offset(row, width as i64)?).map_err(|_| oob())?;
    match start.checked_add(width as usize) {
        Some(end) if end <= len => Ok(start..end),
        _ => Err(oob()),
    }
}

/// §9 window gather: for `b < num_seqs` with a non-negative slot and `s < draft_window`,
/// `p = anchor_pos[b] - (draft_window - 1) + s`; row `b * draft_window + s` of `out` (1024 B)
/// is zeros when `p < 0`, else the source row `window_row(params, slot, p)` as 512 bf16.
/// Sequences with a negative slot (pads) are not written. A row outside `[0, view_rows)` is an
/// error here (the device skips it; a staged lease never reaches one).
#[allow(clippy::too_many_arguments)] // the kernel's argument list, one for one
pub fn window_gather(
    params: &WindowParams,
    planes: GatherPlanes<'_>,
    state_slot_per_seq: &[i32],
    anchor_pos: &[i64],
    out: &mut [u8],
    view_rows: i64,
    num_seqs: i32,
    draft_window: i32,
) -> Result<()> {
    let wd = i64::from(draft_window);
    for b in 0..i64::from(num_seqs) {
        let slot = i64::from(at(state_slot_per_seq, b, "state_slot_per_seq")?);
        let anchor = at(anchor_pos, b, "anchor_pos")?;
        if slot < 0 {
            continue; // a pad: no store
        }
        for s in 0..wd {
            let p = add(sub(anchor, wd - 1, "window position")?, s, "window position")?;
            let dst =
                row_range(add(mul(b, wd, "out row")?, s, "out row")?, GATHER_ROW_BYTES, out.len(), "out")?;
            if p < 0 {
                out[dst].fill(0);
                continue;
            }
            let row = window_row(params, slot, p)?;
            if !(0..view_rows).contains(&row) {
                return Err(HostKernelError::OutOfBounds {
                    buffer: "pool view",
                    index: row,
                    len: usize::try_from(view_rows).unwrap_or(0),
                });
            }
            match planes {
                GatherPlanes::Bf16 { pool } => {
                    let src = row_range(row, GATHER_ROW_BYTES, pool.len(), "pool")?;
                    out[dst].copy_from_slice(&pool[src]);
                }
                GatherPlanes::Fp8 { nope, rope } => {
                    let n = row_range(row, FP8_NOPE_ROW_BYTES, nope.len(), "nope")?;
                    let r = row_range(row, ROPE_ROW_BYTES, rope.len(), "rope")?;
                    dequant_fp8_row(&nope[n], &rope[r], &mut out[dst]);
                }
            }
        }
    }
    Ok(())
}
