//! The indexer key writer's host reference (`v4pool_index_keys`): the indexer's bf16 key rows
//! into one CSA layer's indexer K cache, in the pool's row formats. One formula each
//! (docs/forward.md, "Indexer keys"), the kernel's integer steps transcribed:
//!
//! * **bf16**: the 128 values copied (256-B rows).
//! * **FP8** (per block `[rows × 128 e4m3][rows × 4 B f32 scale]`): per row the scale is the
//!   least power of two `s` with `max(amax, 1e-4) / s <= 448` (DeepSeek's `ue8m0` scale of a
//!   128-value block, stored as an f32); each value is `x / s` (exact) rounded to nearest even
//!   e4m3fn, saturating at 448. An all-zero row gets `s = 2^-22` and zero values.
//! * **FP4** (data per block `[4][rows][16]`, scales per block `[4][rows]`): per group of 32
//!   values the least e8m0 byte `B` with `amax / 2^(B-127) <= 6` (0 for an all-zero group);
//!   each value `x / 2^(B-127)` rounded to nearest even e2m1, saturating at 6; value `32g + 2j`
//!   in the low nibble of byte `j` of group `g`, `32g + 2j + 1` in the high one.
//! * **ATOM's FP8** (`atom-fp8`, `atom-fp8-fnuz`; [`crate::format::ATOM_FP8_KEYS`],
//!   [`crate::format::ATOM_FP8_FNUZ_KEYS`]): FP8's block and scale rule at the encoding's max
//!   (448 OCP e4m3, 240 e4m3fnuz), the values in ATOM's preshuffled 16×16 tiles; a NaN or
//!   infinite value is the encoding's NaN and stays out of the amax (docs/amd.md).
//!
//! Otherwise `amax` ignores NaN and counts infinities; NaN encodes as e4m3's NaN (`0x7f` with
//! its sign) in FP8 and as 6 with its sign in FP4 (e2m1 has no NaN).

use super::*;
use crate::format::Fp8KeyFormat;
use crate::index::{
    INDEX_KEYS_ATOM_FP8, INDEX_KEYS_ATOM_FP8_FNUZ, INDEX_KEYS_BF16, INDEX_KEYS_FP4, INDEX_KEYS_FP8,
    INDEX_KEY_VALUES,
};

/// 1e-4 as f32 bits: the floor of an FP8 row's amax (an all-zero row still gets a scale).
pub const FP8_KEY_AMAX_FLOOR: u32 = crate::format::KEY_AMAX_FLOOR;

/// Largest magnitude (f32 bits) of bf16 values `x`, NaN ignored.
fn bf16_amax(x: &[u16]) -> u32 {
    x.iter().map(|&v| (u32::from(v) << 16) & 0x7fff_ffff).filter(|&m| m <= 0x7f80_0000).max().unwrap_or(0)
}

pub use crate::format::{e2m1_rne, e8m0_of_amax_e2m1};

/// One key row (128 bf16 values) in the FP8 format: 128 e4m3 bytes and the row's f32 scale
/// (returned as its bits): [`crate::format::FP8_KEYS`]' rule.
pub fn pack_fp8_key(key: &[u16], data: &mut [u8]) -> Result<u32> {
    crate::format::FP8_KEYS.pack(key, data).map_err(|_| HostKernelError::OutOfBounds {
        buffer: "fp8 key",
        index: 0,
        len: key.len().min(data.len()),
    })
}

/// One key row in the FP4 format: group `g`'s 16 data bytes into `data[g]` and its e8m0 byte
/// into `scales[g]`.
pub fn pack_fp4_key(key: &[u16], data: &mut [[u8; 16]; 4], scales: &mut [u8; 4]) -> Result<()> {
    if key.len() < INDEX_KEY_VALUES {
        return Err(HostKernelError::OutOfBounds { buffer: "fp4 key", index: 0, len: key.len() });
    }
    for g in 0..4 {
        let x = &key[32 * g..32 * g + 32];
        let b = e8m0_of_amax_e2m1(bf16_amax(x));
        // 1 / scale = 2^(127 - b): a normal f32 for every b the formula gives (1..=253).
        let inv = if b == 0 { 0.0 } else { f32::from_bits((254 - u32::from(b)) << 23) };
        let q = |v: u16| crate::format::e2m1_of_scaled_bf16(v, inv);
        for j in 0..16 {
            data[g][j] = q(x[2 * j]) | (q(x[2 * j + 1]) << 4);
        }
        scales[g] = b;
    }
    Ok(())
}

/// The cache a key write targets: one CSA layer's blocks, whole.
#[derive(Debug)]
pub enum KeyCache<'a> {
    /// bf16: `[blocks][rows][256 B]`.
    Bf16 {
        /// The layer's blocks.
        data: &'a mut [u8],
    },
    /// FP8: `[blocks][rows × 128 + rows × 4]` bytes.
    Fp8 {
        /// The layer's blocks.
        data: &'a mut [u8],
    },
    /// ATOM's preshuffled FP8 ([`crate::format::ATOM_FP8_KEYS`] or, `fnuz`,
    /// [`crate::format::ATOM_FP8_FNUZ_KEYS`]): `[blocks][rows × 128 + rows × 4]` bytes, the
    /// values in 16×16 tiles.
    AtomFp8 {
        /// The layer's blocks.
        data: &'a mut [u8],
        /// e4m3fnuz (gfx942) rather than OCP e4m3.
        fnuz: bool,
    },
    /// FP4: data `[blocks][4][rows][16]`, scales `[blocks][4][rows]`.
    Fp4 {
        /// The layer's data blocks.
        data: &'a mut [u8],
        /// The layer's scale blocks.
        scales: &'a mut [u8],
    },
}

impl KeyCache<'_> {
    /// The `INDEX_KEYS_*` code of this format.
    pub fn format(&self) -> i32 {
        match self {
            KeyCache::Bf16 { .. } => INDEX_KEYS_BF16,
            KeyCache::Fp8 { .. } => INDEX_KEYS_FP8,
            KeyCache::AtomFp8 { fnuz: false, .. } => INDEX_KEYS_ATOM_FP8,
            KeyCache::AtomFp8 { fnuz: true, .. } => INDEX_KEYS_ATOM_FP8_FNUZ,
            KeyCache::Fp4 { .. } => INDEX_KEYS_FP4,
        }
    }
}

/// The fp8 key format an `INDEX_KEYS_*` code names (`None`: bf16, FP4, unknown).
pub fn fp8_key_format(format: i32) -> Option<&'static Fp8KeyFormat> {
    match format {
        INDEX_KEYS_FP8 => Some(&crate::format::FP8_KEYS),
        INDEX_KEYS_ATOM_FP8 => Some(&crate::format::ATOM_FP8_KEYS),
        INDEX_KEYS_ATOM_FP8_FNUZ => Some(&crate::format::ATOM_FP8_FNUZ_KEYS),
        _ => None,
    }
}

/// Bytes one block of `rows` rows takes in each pool of `format` (FP4: data, scales).
pub fn key_block_bytes(format: i32, rows: usize) -> Option<(usize, usize)> {
    match format {
        INDEX_KEYS_BF16 => Some((rows * 2 * INDEX_KEY_VALUES, 0)),
        INDEX_KEYS_FP8 | INDEX_KEYS_ATOM_FP8 | INDEX_KEYS_ATOM_FP8_FNUZ => {
            Some((fp8_key_format(format)?.block_bytes(rows)?, 0))
        }
        INDEX_KEYS_FP4 => Some((rows * INDEX_KEY_VALUES / 2, rows * 4)),
        _ => None,
    }
}

fn range(at: usize, len: usize, buf: usize, buffer: &'static str) -> Result<std::ops::Range<usize>> {
    match at.checked_add(len) {
        Some(end) if end <= buf => Ok(at..end),
        _ => Err(HostKernelError::OutOfBounds { buffer, index: at as i64, len: buf }),
    }
}

/// `v4pool_index_keys`: for `t < num_tokens` whose entry `dest[t] = block × block_rows + row`
/// is in `[0, num_blocks × block_rows)`, key row `t` (`key_row_stride` values apart) into that
/// entry of `cache`; other entries are untouched.
pub fn index_keys(
    keys: &[u16],
    key_row_stride: usize,
    dest: &[i32],
    cache: &mut KeyCache<'_>,
    num_blocks: i64,
    block_rows: i32,
    num_tokens: i32,
) -> Result<()> {
    let rows = usize::try_from(block_rows)
        .ok()
        .filter(|&r| r > 0)
        .ok_or(HostKernelError::ZeroDivisor { what: "block_rows", value: block_rows.into() })?;
    let format = cache.format();
    if fp8_key_format(format).is_some_and(|f| !f.fits_rows(rows)) {
        return Err(super::LaunchError::NotMultiple {
            field: "block_rows",
            value: block_rows.into(),
            of: 16,
        }
        .into());
    }
    let (block_bytes, scale_bytes) = key_block_bytes(format, rows).unwrap_or((0, 0));
    let entries = mul(num_blocks, i64::from(block_rows), "indexer entries")?;
    for t in 0..i64::from(num_tokens) {
        let e = i64::from(at(dest, t, "dest")?);
        if !(0..entries).contains(&e) {
            continue; // dropped, not wrapped
        }
        let (block, r) = ((e / i64::from(block_rows)) as usize, (e % i64::from(block_rows)) as usize);
        let start = (t as usize).checked_mul(key_row_stride).ok_or(HostKernelError::OutOfBounds {
            buffer: "keys",
            index: t,
            len: keys.len(),
        })?;
        let key = keys
            .get(start..start.saturating_add(INDEX_KEY_VALUES))
            .ok_or(HostKernelError::OutOfBounds { buffer: "keys", index: t, len: keys.len() })?;
        let base = block * block_bytes;
        match cache {
            KeyCache::Bf16 { data } => {
                let d = range(base + r * 2 * INDEX_KEY_VALUES, 2 * INDEX_KEY_VALUES, data.len(), "cache")?;
                for (out, v) in data[d].chunks_exact_mut(2).zip(key) {
                    out.copy_from_slice(&v.to_ne_bytes());
                }
            }
            KeyCache::Fp8 { data } | KeyCache::AtomFp8 { data, .. } => {
                // The format's own offsets (the preshuffle needs rows % 16 == 0: refused
                // before any byte is written).
                let f = fp8_key_format(format).ok_or(HostKernelError::OutOfBounds {
                    buffer: "cache",
                    index: 0,
                    len: 0,
                })?;
                let len = data.len();
                let oob = || HostKernelError::OutOfBounds { buffer: "cache", index: e, len };
                let mut q = [0u8; INDEX_KEY_VALUES];
                let scale = f.pack(key, &mut q).map_err(|_| oob())?;
                for (d, &b) in q.iter().enumerate() {
                    let at = f.value_offset(rows, r, d).ok_or_else(oob)?;
                    data[range(base + at, 1, len, "cache")?][0] = b;
                }
                let s = range(base + f.scale_offset(rows, r).ok_or_else(oob)?, 4, len, "cache")?;
                data[s].copy_from_slice(&scale.to_ne_bytes());
            }
            KeyCache::Fp4 { data, scales } => {
                let (mut q, mut b) = ([[0u8; 16]; 4], [0u8; 4]);
                pack_fp4_key(key, &mut q, &mut b)?;
                for g in 0..4 {
                    let d = range(base + (g * rows + r) * 16, 16, data.len(), "cache")?;
                    data[d].copy_from_slice(&q[g]);
                    let s = range(block * scale_bytes + g * rows + r, 1, scales.len(), "scales")?;
                    scales[s][0] = b[g];
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod key_tests {
    use super::*;

    /// e2m1 code to its value (sign in bit 3).
    fn e2m1_value(c: u8) -> f32 {
        let v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][usize::from(c & 7)];
        if c & 8 != 0 {
            -v
        } else {
            v
        }
    }

    #[test]
    fn e2m1_rounds_to_the_nearest_code_ties_to_even() {
        // Checked against the decoded values, not the edge table.
        for c in 0u8..8 {
            let v = e2m1_value(c);
            assert_eq!(e2m1_rne(v.to_bits()), c, "{v}");
            assert_eq!(e2m1_rne((-v).to_bits()), c | 8, "-{v}");
            if c < 7 {
                let next = e2m1_value(c + 1);
                let mid = (v + next) / 2.0;
                assert_eq!(e2m1_rne(mid.to_bits()), if c % 2 == 0 { c } else { c + 1 }, "midpoint {mid}");
                assert_eq!(e2m1_rne(f32::from_bits(mid.to_bits() + 1).to_bits()), c + 1, "above {mid}");
                assert_eq!(e2m1_rne(f32::from_bits(mid.to_bits() - 1).to_bits()), c, "below {mid}");
            }
        }
        assert_eq!(e2m1_rne(100.0f32.to_bits()), 7);
        assert_eq!(e2m1_rne(f32::INFINITY.to_bits()), 7);
        assert_eq!(e2m1_rne(f32::NEG_INFINITY.to_bits()), 15);
        assert_eq!(e2m1_rne(f32::NAN.to_bits()) & 7, 7);
    }

    #[test]
    fn the_fp4_scale_is_the_least_power_of_two_that_fits() {
        for amax in [6.0f32, 6.0001, 1.0, 0.75, 3.5, 1e-30, 65504.0, 1e30, 1e-40] {
            let b = e8m0_of_amax_e2m1(amax.to_bits());
            let scale = (f64::from(b) - 127.0).exp2();
            assert!(f64::from(amax) / scale <= 6.0, "{amax}: byte {b}");
            if b > 1 {
                assert!(f64::from(amax) / (scale / 2.0) > 6.0, "{amax}: byte {b} is not the least");
            }
        }
        assert_eq!(e8m0_of_amax_e2m1(6.0f32.to_bits()), 127);
        assert_eq!(e8m0_of_amax_e2m1(f32::INFINITY.to_bits()), 253);
        assert_eq!(e8m0_of_amax_e2m1(0), 0);
    }

    #[test]
    fn an_fp8_key_row_dequantises_within_half_a_code() {
        let mut x = 0x0bad_5eed_1234_5678u64;
        let key: Vec<u16> = (0..128)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let f = ((x % 20001) as f32 / 1000.0 - 10.0) * if x % 5 == 0 { 50.0 } else { 1.0 };
                (f.to_bits() >> 16) as u16
            })
            .collect();
        let mut data = vec![0xaau8; 128];
        let s = f32::from_bits(pack_fp8_key(&key, &mut data).unwrap());
        let amax = key.iter().map(|&v| f32::from_bits(u32::from(v) << 16).abs()).fold(0.0, f32::max);
        assert!(amax / s <= 448.0 && amax / (s / 2.0) > 448.0, "scale {s} for amax {amax}");
        for (i, (&q, &v)) in data.iter().zip(&key).enumerate() {
            let want = f32::from_bits(u32::from(v) << 16);
            let got = f32::from_bits(u32::from(fp8_scaled_bf16(q, s)) << 16);
            // Half an e4m3 step (3 mantissa bits; scale x 2^-10 below the normal range), plus
            // the bf16 rounding of the dequantised product.
            let step = (want.abs() / 16.0).max(s / 1024.0);
            assert!((got - want).abs() <= step + want.abs() / 128.0, "{i}: {want} -> {got}");
        }
        // An all-zero row: zeros at the floor's scale 2^-22.
        let mut data = vec![0xaau8; 128];
        assert_eq!(f32::from_bits(pack_fp8_key(&[0u16; 128], &mut data).unwrap()), (-22f32).exp2());
        assert!(data.iter().all(|&b| b == 0));
    }
}
