//! The indexer's fp8 key formats. A CSA layer's fp8 indexer cache: per block of `rows` key
//! rows, `rows × 128` fp8 bytes, then `rows` f32 scales (`[rows × 128][rows × 4]`, 132 B a
//! row): one scale per row, a power of two.
//! The formats differ in the fp8 encoding, the order of a block's value bytes, and what a
//! non-finite key value becomes; where the scales sit is the same in all three.

use super::codec::{
    e4m3_of_scaled_bf16, e4m3_rne, e4m3_value, e4m3fnuz_rne, e4m3fnuz_value, e8m0_fitting, E4M3FNUZ_MAX,
    E4M3FN_MAX,
};
use super::FormatError;

/// An fp8 encoding of indexer key values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Elem {
    /// OCP e4m3 (`float8_e4m3fn`): bias 7, largest 448, NaN `0x7f`/`0xff`, ±0.
    E4m3fn,
    /// `float8_e4m3fnuz`: bias 8, largest 240, the one NaN `0x80`, no −0 (gfx942's fp8).
    E4m3fnuz,
}

impl Fp8Elem {
    /// f32 bits of the largest finite value.
    pub fn max_bits(self) -> u32 {
        match self {
            Fp8Elem::E4m3fn => E4M3FN_MAX,
            Fp8Elem::E4m3fnuz => E4M3FNUZ_MAX,
        }
    }
    /// The largest finite value (448 or 240: `torch.finfo(dtype).max`, ATOM's `fp8_max`).
    pub fn max(self) -> f32 {
        f32::from_bits(self.max_bits())
    }
    /// torch's (and DLPack's) name of the encoding.
    pub fn torch_name(self) -> &'static str {
        match self {
            Fp8Elem::E4m3fn => "float8_e4m3fn",
            Fp8Elem::E4m3fnuz => "float8_e4m3fnuz",
        }
    }
    /// f32 bits `u` as a byte of this encoding, rounded to nearest even ([`e4m3_rne`],
    /// [`e4m3fnuz_rne`]).
    pub fn encode(self, u: u32) -> u8 {
        match self {
            Fp8Elem::E4m3fn => e4m3_rne(u),
            Fp8Elem::E4m3fnuz => e4m3fnuz_rne(u),
        }
    }
    /// The value a byte of this encoding holds.
    pub fn value(self, b: u8) -> f32 {
        match self {
            Fp8Elem::E4m3fn => e4m3_value(b),
            Fp8Elem::E4m3fnuz => e4m3fnuz_value(b),
        }
    }
}

/// Where value `d` of row `r` sits among a block's `rows × 128` value bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyOrder {
    /// `r × 128 + d`: DeepGEMM's and vLLM's `fp8_paged_mqa_logits` read it.
    RowMajor,
    /// ATOM's `preshuffle=True` (MFMA 16×16 tiles), what aiter's
    /// `deepgemm_fp8_paged_mqa_logits(..., Preshuffle=True)` reads: the block is cut into
    /// groups of 16 rows (2,048 B each), a group into eight 16×16 tiles of 16 columns (256 B
    /// each), a tile row-major: `(r / 16) × 2048 + (d / 16) × 256 + (r % 16) × 16 + d % 16`.
    /// Needs `rows % 16 == 0`.
    Preshuffled16,
}

/// What a NaN or infinite key value becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NonFinite {
    /// v4pool's DeepGEMM-form rule: an infinity counts in the row's amax and saturates; a NaN
    /// is `0x7f` with its sign.
    Saturate,
    /// aiter's conversion: both are the encoding's NaN (`0x80` on e4m3fnuz, `0x7f` with the
    /// sign on e4m3fn) and neither counts in the amax, so the row's finite values keep their
    /// scale. (ATOM's Triton writer has no finite answer: an infinite amax makes its scale
    /// infinite, and the reader's logit for that key is not finite either way.)
    Nan,
}

/// One fp8 indexer key format: the bytes a block of key rows takes and what they mean.
#[derive(Debug, PartialEq, Eq)]
pub struct Fp8KeyFormat {
    /// The indexer dtype's name (`crate::sizing::IndexerDtype::name`).
    pub name: &'static str,
    /// The value encoding.
    pub elem: Fp8Elem,
    /// The order of a block's value bytes.
    pub order: KeyOrder,
    /// What a non-finite value becomes.
    pub non_finite: NonFinite,
    /// Who reads it.
    pub reader: &'static str,
}

/// Values of one indexer key row (V4's `index_head_dim`).
pub const KEY_VALUES: usize = 128;
/// 1e-4 as f32 bits: the floor of a key row's amax, so an all-zero row still has a scale
/// (DeepSeek's `ue8m0` rule and ATOM's `max(amax, 1e-4)`).
pub const KEY_AMAX_FLOOR: u32 = 0x38d1_b717;

/// The row-major e4m3fn cache DeepGEMM and vLLM read on NVIDIA (indexer dtype `fp8`).
pub static FP8_KEYS: Fp8KeyFormat = Fp8KeyFormat {
    name: "fp8",
    elem: Fp8Elem::E4m3fn,
    order: KeyOrder::RowMajor,
    non_finite: NonFinite::Saturate,
    reader: "DeepGEMM / vLLM fp8_paged_mqa_logits",
};
/// ATOM's cache off gfx942 (gfx950, gfx1250): preshuffled OCP e4m3, `fp8_max` 448.
pub static ATOM_FP8_KEYS: Fp8KeyFormat = Fp8KeyFormat {
    name: "atom-fp8",
    elem: Fp8Elem::E4m3fn,
    order: KeyOrder::Preshuffled16,
    non_finite: NonFinite::Nan,
    reader: "aiter deepgemm_fp8_paged_mqa_logits(Preshuffle=True)",
};
/// ATOM's cache on gfx942 (MI300X / MI325X): preshuffled e4m3fnuz, `fp8_max` 240.
pub static ATOM_FP8_FNUZ_KEYS: Fp8KeyFormat = Fp8KeyFormat {
    name: "atom-fp8-fnuz",
    elem: Fp8Elem::E4m3fnuz,
    order: KeyOrder::Preshuffled16,
    non_finite: NonFinite::Nan,
    reader: "aiter deepgemm_fp8_paged_mqa_logits(Preshuffle=True) on gfx942",
};

impl Fp8KeyFormat {
    /// Bytes one block of `rows` key rows takes.
    pub fn block_bytes(&self, rows: usize) -> Option<usize> {
        rows.checked_mul(KEY_VALUES + 4)
    }
    /// Whether a block of `rows` rows can hold this format (the preshuffle's 16-row groups).
    pub fn fits_rows(&self, rows: usize) -> bool {
        rows > 0 && (self.order == KeyOrder::RowMajor || rows % 16 == 0)
    }
    /// Byte of value `d` of row `r` in a block of `rows` rows (`None` out of range).
    pub fn value_offset(&self, rows: usize, r: usize, d: usize) -> Option<usize> {
        if r >= rows || d >= KEY_VALUES || !self.fits_rows(rows) {
            return None;
        }
        Some(match self.order {
            KeyOrder::RowMajor => r * KEY_VALUES + d,
            KeyOrder::Preshuffled16 => (r / 16) * 16 * KEY_VALUES + (d / 16) * 256 + (r % 16) * 16 + d % 16,
        })
    }
    /// Byte of row `r`'s f32 scale in a block of `rows` rows.
    pub fn scale_offset(&self, rows: usize, r: usize) -> Option<usize> {
        if r >= rows || !self.fits_rows(rows) {
            return None;
        }
        Some(rows * KEY_VALUES + 4 * r)
    }
    /// One key row (128 bf16 values, native bits) quantised: its 128 value bytes in value
    /// order into `out`, and its scale's f32 bits. The scale is the least power of two `s` with
    /// `max(amax, 1e-4) / s <= max` (ATOM's `2^ceil(log2(max(amax, 1e-4) / fp8_max))`, exactly);
    /// each value is `x / s` (exact: a power of two) rounded to nearest even.
    pub fn pack(&self, key: &[u16], out: &mut [u8]) -> Result<u32, FormatError> {
        if key.len() < KEY_VALUES || out.len() != KEY_VALUES {
            return Err(FormatError::RowLength { got: key.len().min(out.len()), want: KEY_VALUES });
        }
        let key = &key[..KEY_VALUES];
        let finite_only = self.non_finite == NonFinite::Nan;
        let amax = key
            .iter()
            .map(|&v| (u32::from(v) << 16) & 0x7fff_ffff)
            .filter(|&m| if finite_only { m < 0x7f80_0000 } else { m <= 0x7f80_0000 })
            .max()
            .unwrap_or(0);
        let b = u32::from(e8m0_fitting(amax.max(KEY_AMAX_FLOOR), self.elem.max_bits()));
        // b is 105..=248 here, so 2^(b-127) and its inverse are normal f32s.
        let inv = f32::from_bits((254 - b) << 23);
        for (o, &v) in out.iter_mut().zip(key) {
            *o = match (self.elem, self.non_finite) {
                (Fp8Elem::E4m3fn, NonFinite::Saturate) => e4m3_of_scaled_bf16(v, inv),
                (_, _) if v & 0x7f80 == 0x7f80 => match self.elem {
                    Fp8Elem::E4m3fn => ((v >> 8) as u8 & 0x80) | 0x7f,
                    Fp8Elem::E4m3fnuz => 0x80,
                },
                (elem, _) => elem.encode((f32::from_bits(u32::from(v) << 16) * inv).to_bits()),
            };
        }
        Ok(b << 23)
    }
}
