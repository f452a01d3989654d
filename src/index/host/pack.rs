//! The KV row writer's host reference (`v4pool_kv_rows`): bf16 KV rows into the pool's row
//! format at given destination rows, packing the fp8 pool's NoPE part into e4m3 values with
//! e8m0 tile scales. One formula: the kernel's integer steps, transcribed.

use super::gather::row_range;
use super::*;
use crate::index::{FP8_NOPE_ROW_BYTES, FP8_NOPE_VALUES, FP8_TILE, KV_ROW_VALUES, ROPE_ROW_BYTES};

pub use crate::format::{e4m3_of_scaled_bf16, e4m3_rne, e8m0_of_amax};

/// One token's 512 bf16 values (`kv`, native-order bits: 448 NoPE, then 64 RoPE) as an fp8
/// NoPE row (512 B: 448 e4m3, seven e8m0 scales each twice, zero padding) and a RoPE row
/// (128 B: the 64 bf16 copied).
pub fn pack_fp8_row(kv: &[u16], nope: &mut [u8], rope: &mut [u8]) -> Result<()> {
    let short = |buffer: &'static str, len: usize| HostKernelError::OutOfBounds { buffer, index: 0, len };
    if kv.len() < KV_ROW_VALUES {
        return Err(short("kv", kv.len()));
    }
    if nope.len() != FP8_NOPE_ROW_BYTES as usize {
        return Err(short("nope", nope.len()));
    }
    if rope.len() != ROPE_ROW_BYTES as usize {
        return Err(short("rope", rope.len()));
    }
    for tile in 0..FP8_NOPE_VALUES / FP8_TILE {
        let x = &kv[tile * FP8_TILE..(tile + 1) * FP8_TILE];
        let amax = x
            .iter()
            .map(|&v| (u32::from(v) << 16) & 0x7fff_ffff)
            .filter(|&m| m <= 0x7f80_0000) // NaN is never the amax
            .max()
            .unwrap_or(0);
        let b = e8m0_of_amax(amax);
        // 1 / scale = 2^(127 - b): a normal f32 for every b the formula gives (1..=248).
        let inv = if b == 0 { 0.0 } else { f32::from_bits((254 - u32::from(b)) << 23) };
        for (i, &v) in x.iter().enumerate() {
            nope[tile * FP8_TILE + i] = e4m3_of_scaled_bf16(v, inv);
        }
        nope[FP8_NOPE_VALUES + 2 * tile] = b;
        nope[FP8_NOPE_VALUES + 2 * tile + 1] = b;
    }
    nope[FP8_NOPE_VALUES + 14..].fill(0);
    for (i, v) in kv[FP8_NOPE_VALUES..KV_ROW_VALUES].iter().enumerate() {
        rope[2 * i..2 * i + 2].copy_from_slice(&v.to_ne_bytes());
    }
    Ok(())
}

/// The planes a KV row write targets (layer views, whole rows).
#[derive(Debug)]
pub enum KvPlanes<'a> {
    /// The bf16 pool's one plane of 1024-B rows.
    Bf16 {
        /// The view's rows.
        pool: &'a mut [u8],
    },
    /// The fp8 pool's NoPE (512-B rows) and RoPE (128-B rows) planes.
    Fp8 {
        /// NoPE rows.
        nope: &'a mut [u8],
        /// RoPE rows.
        rope: &'a mut [u8],
    },
    /// A plane of one unpaged, one-plane format's rows, back to back: FlashMLA's V4.1 528-B
    /// rows (`flashmla-v41`) or its 288-B fp4 rows (`flashmla-v41-fp4`, the packed pool's
    /// compressed view).
    Interleaved {
        /// Which format.
        format: crate::format::RowFormatId,
        /// The view's rows.
        pool: &'a mut [u8],
    },
    /// A one-plane paged format's plane, from its row 0 (FlashMLA's V4 584-B rows in pages of
    /// 64, `flashmla-v4`, or of 2, `flashmla-v4-p2`); view row `r` is plane row `row0 + r`,
    /// placed by the format's page arithmetic.
    Paged {
        /// Which format.
        format: crate::format::RowFormatId,
        /// The plane from its row 0 through the view's last page.
        plane: &'a mut [u8],
        /// The view's first row in the plane.
        row0: i64,
    },
}

/// `v4pool_kv_rows`: for `t < num_tokens` whose batch id (if given) is not negative and whose
/// `dest_rows[t]` is in `[0, view_rows)`, row `t` of `kv` (`kv_row_stride` values apart) into
/// that row of the planes; other tokens are untouched.
pub fn kv_rows(
    kv: &[u16],
    kv_row_stride: usize,
    dest_rows: &[i32],
    batch_id_per_token: Option<&[i32]>,
    planes: &mut KvPlanes<'_>,
    view_rows: i64,
    num_tokens: i32,
) -> Result<()> {
    for t in 0..i64::from(num_tokens) {
        if let Some(bids) = batch_id_per_token {
            if at(bids, t, "batch_id_per_token")? < 0 {
                continue;
            }
        }
        let row = i64::from(at(dest_rows, t, "dest_rows")?);
        if !(0..view_rows).contains(&row) {
            continue; // dropped, not wrapped
        }
        let start = (t as usize).checked_mul(kv_row_stride).ok_or(HostKernelError::OutOfBounds {
            buffer: "kv",
            index: t,
            len: kv.len(),
        })?;
        let src = kv.get(start..start.saturating_add(KV_ROW_VALUES)).ok_or(HostKernelError::OutOfBounds {
            buffer: "kv",
            index: t,
            len: kv.len(),
        })?;
        match planes {
            KvPlanes::Bf16 { pool } => {
                let r = row_range(row, 2 * KV_ROW_VALUES as u64, pool.len(), "pool")?;
                for (d, v) in pool[r].chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&v.to_ne_bytes());
                }
            }
            KvPlanes::Fp8 { nope, rope } => {
                let n = row_range(row, FP8_NOPE_ROW_BYTES, nope.len(), "nope")?;
                let r = row_range(row, ROPE_ROW_BYTES, rope.len(), "rope")?;
                pack_fp8_row(src, &mut nope[n], &mut rope[r])?;
            }
            KvPlanes::Interleaved { format, pool } => {
                // The format's one description packs (no second transcription of the formula).
                let f = format.format();
                let r = row_range(row, f.bytes_per_token(), pool.len(), "pool")?;
                let packed = f.pack(src).map_err(|_| HostKernelError::OutOfBounds {
                    buffer: "kv",
                    index: t,
                    len: kv.len(),
                })?;
                pool[r].copy_from_slice(&packed[0]);
            }
            KvPlanes::Paged { format, plane, row0 } => {
                let f = format.format();
                let oob = HostKernelError::OutOfBounds { buffer: "plane", index: row, len: plane.len() };
                let packed = f.pack(src).map_err(|_| oob.clone())?;
                let r = u64::try_from(*row0 + row).map_err(|_| oob.clone())?;
                f.place(r, &packed, &mut [&mut plane[..]]).ok_or(oob)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod pack_tests {
    use super::*;

    /// Decode an e4m3fn byte (finite) to f32.
    fn e4m3_value(b: u8) -> f32 {
        let mag = u32::from(b & 0x7f);
        let v = if mag >= 8 { f32::from_bits((mag << 20) + (120 << 23)) } else { mag as f32 / 512.0 };
        if b & 0x80 != 0 {
            -v
        } else {
            v
        }
    }

    #[test]
    fn e4m3_rounds_to_the_nearest_code_ties_to_even() {
        // Every finite code round-trips, and every midpoint between neighbours goes to the
        // even code: checked against the decoded values, not against the formula.
        for b in 0u8..0x7f {
            let v = e4m3_value(b);
            assert_eq!(e4m3_rne(v.to_bits()), b, "code {b:#x} ({v})");
            assert_eq!(e4m3_rne((-v).to_bits()), b | 0x80);
            if b < 0x7e {
                let next = e4m3_value(b + 1);
                let mid = (v + next) / 2.0;
                let want = if b % 2 == 0 { b } else { b + 1 };
                assert_eq!(e4m3_rne(mid.to_bits()), want, "midpoint {mid} of {b:#x}");
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(e4m3_rne(above.to_bits()), b + 1, "just above {mid}");
            }
        }
        assert_eq!(e4m3_rne(500.0f32.to_bits()), 0x7e);
        assert_eq!(e4m3_rne(f32::INFINITY.to_bits()), 0x7e);
        assert_eq!(e4m3_rne(f32::NAN.to_bits()) & 0x7f, 0x7f);
        assert_eq!(e4m3_rne(1e-40f32.to_bits()), 0);
    }

    #[test]
    fn the_scale_is_the_least_power_of_two_that_fits() {
        for amax in [448.0f32, 449.0, 1.0, 0.75, 3.5, 1e-30, 65504.0, 1e30] {
            let b = e8m0_of_amax(amax.to_bits());
            let scale = (f64::from(b) - 127.0).exp2();
            assert!(f64::from(amax) / scale <= 448.0, "{amax}: byte {b}");
            assert!(f64::from(amax) / (scale / 2.0) > 448.0, "{amax}: byte {b} is not the least");
        }
        assert_eq!(e8m0_of_amax(448.0f32.to_bits()), 127);
        assert_eq!(e8m0_of_amax(0), 0);
    }

    #[test]
    fn a_packed_row_dequantises_within_half_a_code() {
        let mut rng = crate::rng::Rng::new(0x1234_5678_9abc_def0);
        let mut kv = vec![0u16; 512];
        for v in kv.iter_mut() {
            let x = rng.next_u64();
            let f = ((x % 20001) as f32 / 1000.0 - 10.0) * if x % 7 == 0 { 30.0 } else { 1.0 };
            *v = (f.to_bits() >> 16) as u16;
        }
        kv[64..128].fill(0); // an all-zero tile: scale byte 0
        let (mut nope, mut rope) = (vec![0xaau8; 512], vec![0xaau8; 128]);
        pack_fp8_row(&kv, &mut nope, &mut rope).unwrap();
        assert_eq!(nope[448 + 2], 0);
        assert!(nope[462..].iter().all(|&b| b == 0));
        let mut out = vec![0u8; 1024];
        dequant_fp8_row(&nope, &rope, &mut out);
        for i in 0..512 {
            let want = f32::from_bits(u32::from(kv[i]) << 16);
            let got = f32::from_bits(u32::from(u16::from_ne_bytes([out[2 * i], out[2 * i + 1]])) << 16);
            if i >= 448 {
                assert_eq!(got.to_bits(), want.to_bits());
            } else {
                let scale = e8m0_scale(nope[448 + 2 * (i / 64)]);
                // Half an e4m3 step: 1/16 of a normal value (3 mantissa bits), scale x 2^-10
                // below the normal range; plus the bf16 rounding of the dequantised product.
                let step = if want == 0.0 { 0.0 } else { (want.abs() / 16.0).max(scale / 1024.0) };
                assert!((got - want).abs() <= step + want.abs() / 128.0, "{i}: {want} -> {got}");
            }
        }
    }
}
