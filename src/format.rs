//! Row formats: the bytes one token's KV row (512 values: 448 NoPE, then 64 RoPE) takes in the
//! pool, each format **one description** ([`RowFormat`]) that sizing, the host packer and
//! unpacker, and every byte path read through [`PlaneFormat::byte_offset`] /
//! [`PlaneFormat::row_spans`]. Adding a format (NVFP4's 384 B, say) is one more `static` here.
//!
//! A format is a list of **planes** (a row index means the same row in every plane) and a list
//! of **segments** (a run of the 512 values, their element encoding, and where their scales
//! sit). A plane's row is cut into **regions**; a plane is **paged** when `page_rows > 1`: a page
//! holds `page_rows` rows of region 0, then `page_rows` rows of region 1, … (FlashMLA's V4
//! layout: 64 data rows of 576 B, then 64 scale rows of 8 B). Unpaged rows are back to back.
//!
//! | format | planes (bytes/row) | values | scales |
//! |---|---|---|---|
//! | `atom-fp8` | 512 NoPE + 128 RoPE | 448 e4m3, 64 bf16 | e8m0 per 64, stored twice |
//! | `bf16` | 1024 | 512 bf16 | — |
//! | `flashmla-v4` | 584, pages of 64: 576 data + 8 scale | 448 e4m3, 64 bf16 | e8m0 per 64 |
//! | `flashmla-v4-p2` | 584, pages of 2: 576 data + 8 scale | 448 e4m3, 64 bf16 | e8m0 per 64 |
//! | `flashmla-v41` | 528 interleaved | 512 e4m3 | e8m0 per 32 |
//! | `flashmla-v41-fp4` | 288 interleaved | 512 e2m1 (even index low nibble) | e4m3 per 16 |
//!
//! Scale rules (the writer's choice; a reader only multiplies): a power-of-two (e8m0) scale is
//! the least `2^(B-127)` with `max(amax, floor) / scale <= elem_max`. `atom-fp8` has floor 0 (an
//! all-zero tile stores `B = 0` and zero values: v4pool's rule since issue 23); the FlashMLA
//! formats take FlashMLA's own `tests/quant.py` rule, `2^ceil(log2(max(amax / 448, 1e-4)))`,
//! i.e. floor `448e-4` (`B >= 114`). An e4m3 scale (fp4) is `amax / 6` rounded to nearest even
//! e4m3, values `x / scale` rounded to nearest even e2m1 and saturated at 6 (a scale rounded down
//! saturates at most one step). Values divide by the scale in f32 and round to nearest even.

use thiserror::Error;

/// Values of one KV row: 448 NoPE, then 64 RoPE (`crate::index::KV_ROW_VALUES` is this).
pub const KV_ROW_VALUES: usize = 512;

// ---- the scalar codecs every format (and the indexer's key formats) shares ----------------
// The device kernels transcribe these integer for integer (kernels/kv_rows.cuh).

/// The e8m0 byte of a tile whose largest finite magnitude has f32 bits `amax`: 0 for an
/// all-zero tile, else the least `B` with `amax / 2^(B-127) <= 448` (the exponent of amax
/// minus 8, plus one when its mantissa passes 1.75; 448 = 1.75 x 2^8), at least 1.
pub fn e8m0_of_amax(amax: u32) -> u8 {
    e8m0_fitting(amax, E4M3FN_MAX)
}

/// f32 bits of e4m3fn's largest finite value, 448 (1.75 × 2^8).
pub const E4M3FN_MAX: u32 = 0x43e0_0000;
/// f32 bits of e4m3fnuz's largest finite value, 240 (1.875 × 2^7).
pub const E4M3FNUZ_MAX: u32 = 0x4370_0000;

/// The least e8m0 byte `B` with `amax / 2^(B-127) <= max` (both f32 bits, `max` a normal
/// float): the exponent of amax minus max's, plus one when amax's mantissa passes max's; 0 for
/// `amax = 0`, else at least 1 and at most 254. The one power-of-two scale rule every e8m0 and
/// power-of-two f32 scale here takes (kernels/kv_rows.cuh `v4p_e8m0_fitting`).
pub fn e8m0_fitting(amax: u32, max: u32) -> u8 {
    if amax == 0 {
        return 0;
    }
    let b =
        (amax >> 23) as i32 - ((max >> 23) as i32 - 127) + i32::from((amax & 0x7f_ffff) > (max & 0x7f_ffff));
    b.clamp(1, 254) as u8
}

/// The e4m3 magnitude code (no sign) of the positive finite f32 bits `a` under exponent bias
/// `bias` (7: e4m3fn, 8: e4m3fnuz), rounded to nearest even; a result past the format's largest
/// code is the caller's to saturate. f32 subnormals are 0.
fn e4m3_magnitude(a: u32, bias: i32) -> u32 {
    let e = (a >> 23) as i32 - 127;
    let (mut code, rem, half) = if e >= 1 - bias {
        ((((e + bias) as u32) << 3) | ((a & 0x7f_ffff) >> 20), a & 0xf_ffff, 0x8_0000u32)
    } else {
        if a >> 23 == 0 {
            return 0;
        }
        let m = (a & 0x7f_ffff) | 0x80_0000;
        // value / 2^(-2 - bias) (the subnormal step) = m >> sh; sh >= 21
        let sh = (21 - bias - e) as u32;
        if sh > 31 {
            return 0;
        }
        (m >> sh, m & ((1u32 << sh) - 1), 1u32 << (sh - 1))
    };
    if rem > half || (rem == half && code & 1 == 1) {
        code += 1;
    }
    code
}

/// f32 bits `u` as an e4m3fn byte, rounded to nearest even; magnitudes past 448 (and
/// infinities) saturate to 448, NaN is `0x7f` with the sign, f32 subnormals a signed zero.
pub fn e4m3_rne(u: u32) -> u8 {
    let s = ((u >> 24) & 0x80) as u8;
    let a = u & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return s | 0x7f;
    }
    if a >= E4M3FN_MAX {
        return s | 0x7e;
    }
    s | e4m3_magnitude(a, 7).min(0x7e) as u8
}

/// f32 bits `u` as an e4m3fnuz byte (exponent bias 8, largest 240, one NaN `0x80`, no negative
/// zero), rounded to nearest even, as aiter's conversion on gfx942 writes it
/// (`hip_float8_impl.h`: NaN and infinities become `0x80`, finite magnitudes past 240 clip to
/// 240, and a value that rounds to zero is `0x00` whatever its sign: `0x80` is not −0.0).
pub fn e4m3fnuz_rne(u: u32) -> u8 {
    let a = u & 0x7fff_ffff;
    if a >= 0x7f80_0000 {
        return 0x80;
    }
    let s = ((u >> 24) & 0x80) as u8;
    let code = if a >= E4M3FNUZ_MAX { 0x7f } else { e4m3_magnitude(a, 8).min(0x7f) as u8 };
    if code == 0 {
        0
    } else {
        s | code
    }
}

/// The value an e4m3fnuz byte encodes (NaN for `0x80`, the only NaN; no infinities).
pub fn e4m3fnuz_value(b: u8) -> f32 {
    if b == 0x80 {
        return f32::NAN;
    }
    // Every other byte is half the e4m3fn value of the same byte (bias 8 against 7), and
    // e4m3fn's NaN pattern 0x7f is fnuz's 240.
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    s * if e == 0 { m / 8.0 * 2f32.powi(-7) } else { (1.0 + m / 8.0) * 2f32.powi(e - 8) }
}

/// bf16 bits `v` times `inv` (1 / scale) as an e4m3fn byte: [`e4m3_rne`] of the product, but a
/// NaN value is `0x7f` with its own sign. A product's NaN sign is the platform's (x86 keeps the
/// operand's, NVIDIA GPUs return a canonical NaN), so the rule is on the input, and every
/// backend writes the same byte (kv_rows.cuh `v4p_e4m3_scaled`).
pub fn e4m3_of_scaled_bf16(v: u16, inv: f32) -> u8 {
    if v & 0x7fff > 0x7f80 {
        return ((v >> 8) as u8 & 0x80) | 0x7f;
    }
    e4m3_rne((f32::from_bits(u32::from(v) << 16) * inv).to_bits())
}

/// bf16 bits `v` times `inv` as an e2m1 nibble: [`e2m1_rne`] of the product, a NaN value 6 with
/// its own sign (as [`e4m3_of_scaled_bf16`]; kv_rows.cuh `v4p_e2m1_scaled`).
pub fn e2m1_of_scaled_bf16(v: u16, inv: f32) -> u8 {
    if v & 0x7fff > 0x7f80 {
        return ((v >> 12) as u8 & 0x8) | 0x7;
    }
    e2m1_rne((f32::from_bits(u32::from(v) << 16) * inv).to_bits())
}

/// The e8m0 byte of a group whose largest magnitude has f32 bits `amax`, fitting e2m1's 6: 0
/// for an all-zero group, else the exponent of amax minus 2, plus one when its mantissa passes
/// 1.5 (6 = 1.5 × 2^2), at least 1 (at most 253, for amax = inf).
pub fn e8m0_of_amax_e2m1(amax: u32) -> u8 {
    e8m0_fitting(amax, 0x40c0_0000)
}

/// f32 bits `u` as an e2m1 nibble (sign in bit 3), rounded to the nearest even code: codes
/// 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; 6 and past (infinities, NaN) saturate to 6.
pub fn e2m1_rne(u: u32) -> u8 {
    let s = ((u >> 28) & 0x8) as u8;
    let a = u & 0x7fff_ffff; // positive f32 bits order as their values
                             // Upper midpoint of each code: even codes keep their tie (`<=`), odd ones pass it on.
    const EDGES: [(u32, bool); 7] = [
        (0x3e80_0000, true),  // 0.25
        (0x3f40_0000, false), // 0.75
        (0x3fa0_0000, true),  // 1.25
        (0x3fe0_0000, false), // 1.75
        (0x4020_0000, true),  // 2.5
        (0x4060_0000, false), // 3.5
        (0x40a0_0000, true),  // 5
    ];
    let code = EDGES.iter().position(|&(edge, even)| if even { a <= edge } else { a < edge }).unwrap_or(7);
    s | code as u8
}

/// The formats, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowFormatId {
    /// ROCm/ATOM's (aiter's) fp8 rows: a 512-B NoPE plane and a 128-B RoPE plane (640 B).
    AtomFp8,
    /// One 1,024-B plane of 512 bf16 values.
    Bf16,
    /// FlashMLA's DeepSeek-V4 fp8 layout: 584 B a token in pages of 64 tokens.
    FlashMlaV4,
    /// The same 584-B rows in pages of 2 tokens (one page shift for every HCA layer).
    FlashMlaV4P2,
    /// FlashMLA's DeepSeek-V4.1 fp8 layout: 528 B a token, interleaved.
    FlashMlaV41,
    /// FlashMLA's DeepSeek-V4.1 fp4 extra cache: 288 B a token, interleaved.
    FlashMlaV41Fp4,
}

/// How one value is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// bfloat16, copied.
    Bf16,
    /// float8 e4m3fn (largest finite 448).
    E4m3,
    /// float4 e2m1 (largest 6), two to a byte, the even-indexed value in the low nibble.
    E2m1,
}

impl Elem {
    /// Bits one value takes.
    pub fn bits(self) -> usize {
        match self {
            Elem::Bf16 => 16,
            Elem::E4m3 => 8,
            Elem::E2m1 => 4,
        }
    }
}

/// How one scale is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleEnc {
    /// A power of two as an e8m0 byte `B` (scale `2^(B-127)`); the group's amax is raised to at
    /// least the f32 with bits `amax_floor` before the least fitting `B` is taken.
    E8m0 {
        /// f32 bits of the amax floor (0: an all-zero group stores `B = 0`).
        amax_floor: u32,
    },
    /// An e4m3fn byte: `amax / elem_max` rounded to nearest even.
    E4m3,
}

/// Where bytes sit in a row: the plane, the region of the plane's row, the byte in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// Plane index.
    pub plane: usize,
    /// Region of that plane's row.
    pub region: usize,
    /// Byte offset inside the region.
    pub offset: usize,
}

/// The scales of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleSpec {
    /// Values one scale covers.
    pub group: usize,
    /// Its encoding (one byte either way).
    pub enc: ScaleEnc,
    /// Where scale 0 sits; scale `g` is `g × copies` bytes on.
    pub place: Place,
    /// How many times each scale is stored (ATOM stores each twice).
    pub copies: usize,
}

/// A run of the 512 values in one encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First value of the run.
    pub first: usize,
    /// Values in the run.
    pub count: usize,
    /// Their encoding.
    pub elem: Elem,
    /// Where value `first` sits; the rest follow packed.
    pub data: Place,
    /// Their scales, if quantised.
    pub scale: Option<ScaleSpec>,
}

/// One plane's row layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneFormat {
    /// Bytes of each region of a row, in order; their sum is the row's bytes.
    pub regions: &'static [u64],
    /// Rows of a page (1: unpaged, rows back to back).
    pub page_rows: u64,
}

impl PlaneFormat {
    /// Bytes one row takes.
    pub fn row_bytes(&self) -> u64 {
        self.regions.iter().sum()
    }
    /// Byte offset of region `region` of row `row` from the plane's row 0 (`None` past 64 bits
    /// or for a region the row lacks).
    pub fn byte_offset(&self, row: u64, region: usize) -> Option<u64> {
        let before: u64 = self.regions.get(..region)?.iter().sum();
        self.regions.get(region)?;
        let p = self.page_rows;
        let page_bytes = p.checked_mul(self.row_bytes())?;
        (row / p)
            .checked_mul(page_bytes)?
            .checked_add(p.checked_mul(before)?)?
            .checked_add((row % p).checked_mul(self.regions[region])?)
    }
    /// The byte spans `(offset, len)` rows `[first, first + rows)` occupy, in increasing offset,
    /// abutting spans merged: one span when unpaged or when the run is whole pages; for a partial
    /// page, one span per region. The one conversion from rows to bytes a byte path (copy,
    /// checkpoint, transfer) of a paged plane reads.
    pub fn row_spans(&self, first: u64, rows: u64) -> Option<Vec<(u64, u64)>> {
        let end = first.checked_add(rows)?;
        // Rows past the tallest plane a pool has are no plane's: refused before any work.
        if end > MAX_ROWS {
            return None;
        }
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut push = |off: u64, len: u64| {
            if len == 0 {
                return;
            }
            match out.last_mut() {
                Some((o, l)) if *o + *l == off => *l += len,
                _ => out.push((off, len)),
            }
        };
        let p = self.page_rows;
        let mut r = first;
        while r < end {
            if r % p == 0 && end - r >= p {
                // Whole pages are one contiguous byte range: one span, whatever their count
                // (the loop runs at most three times).
                let (whole, page_bytes) = ((end - r) / p * p, p.checked_mul(self.row_bytes())?);
                push((r / p).checked_mul(page_bytes)?, (whole / p).checked_mul(page_bytes)?);
                r += whole;
                continue;
            }
            let page_end = (r / p + 1).checked_mul(p)?.min(end);
            let n = page_end - r;
            for (k, &w) in self.regions.iter().enumerate() {
                push(self.byte_offset(r, k)?, n.checked_mul(w)?);
            }
            r = page_end;
        }
        Some(out)
    }
}

/// One row format: its planes and what its bytes mean.
#[derive(Debug, PartialEq, Eq)]
pub struct RowFormat {
    /// Which one.
    pub id: RowFormatId,
    /// The name the CLI, the bindings and the layout id use.
    pub name: &'static str,
    /// Its planes, in plane order.
    pub planes: &'static [PlaneFormat],
    /// Its value runs, covering the 512 values once.
    pub segments: &'static [Segment],
    /// Rows of the page an attention kernel reads it in (FlashMLA: 64; views are handed over as
    /// `[pages, kernel_page_rows, 1, row_bytes]`); 1 where the kernel takes rows.
    pub kernel_page_rows: u64,
}

/// Rows of the tallest plane a pool may have: plane rows index as `i32` (the geometry refuses
/// a taller plane, `geometry::MAX_PLANE_ROWS`; `tests/row_formats.rs` checks the two agree).
/// [`PlaneFormat::row_spans`] refuses rows past it, so its work stays bounded.
pub const MAX_ROWS: u64 = i32::MAX as u64;

/// FlashMLA's amax floor, `448 × 1e-4` (its `tests/quant.py`: `scale_inv` at least 1e-4).
pub const FLASHMLA_AMAX_FLOOR: u32 = 0x3d37_8034;

const fn at(plane: usize, region: usize, offset: usize) -> Place {
    Place { plane, region, offset }
}

/// V4's NoPE part as ATOM's and FlashMLA's V4 formats store it: 448 e4m3 values from byte 0 of
/// plane 0, one e8m0 scale per 64 at `scale` (`copies` times), the amax raised to `amax_floor`.
const fn nope_e4m3(amax_floor: u32, scale: Place, copies: usize) -> Segment {
    Segment {
        first: 0,
        count: 448,
        elem: Elem::E4m3,
        data: at(0, 0, 0),
        scale: Some(ScaleSpec { group: 64, enc: ScaleEnc::E8m0 { amax_floor }, place: scale, copies }),
    }
}

static ATOM_FP8: RowFormat = RowFormat {
    id: RowFormatId::AtomFp8,
    name: "atom-fp8",
    planes: &[PlaneFormat { regions: &[512], page_rows: 1 }, PlaneFormat { regions: &[128], page_rows: 1 }],
    segments: &[
        nope_e4m3(0, at(0, 0, 448), 2),
        Segment { first: 448, count: 64, elem: Elem::Bf16, data: at(1, 0, 0), scale: None },
    ],
    kernel_page_rows: 1,
};

static BF16: RowFormat = RowFormat {
    id: RowFormatId::Bf16,
    name: "bf16",
    planes: &[PlaneFormat { regions: &[1024], page_rows: 1 }],
    segments: &[Segment { first: 0, count: 512, elem: Elem::Bf16, data: at(0, 0, 0), scale: None }],
    kernel_page_rows: 1,
};

// FlashMLA's V4 row: 448 e4m3 and 64 bf16 in a 576-B data region, the 7 e8m0 scales (and a pad
// byte) in an 8-B scale region. Its two formats differ in the page alone.
const FLASHMLA_V4_SEGMENTS: &[Segment] = &[
    nope_e4m3(FLASHMLA_AMAX_FLOOR, at(0, 1, 0), 1),
    Segment { first: 448, count: 64, elem: Elem::Bf16, data: at(0, 0, 448), scale: None },
];

static FLASHMLA_V4: RowFormat = RowFormat {
    id: RowFormatId::FlashMlaV4,
    name: "flashmla-v4",
    planes: &[PlaneFormat { regions: &[576, 8], page_rows: 64 }],
    segments: FLASHMLA_V4_SEGMENTS,
    kernel_page_rows: 64,
};

// The same rows in pages of 2 (1,168 B: 2 data rows, then their 2 scale rows). FlashMLA's sparse
// decode takes any page size (`csrc/api/sparse_decode.h` checks `stride(1) == 584` and the 4-D
// shape; the kernel addresses a row at `block × stride(0) + rel × 576`, its scales at
// `block × stride(0) + page × 576 + rel × 8`); 2 keeps every data row 16-B aligned for its
// 16-B loads (a page of 1 would not). Every layer term of a V4 geometry is then whole pages
// but an odd MTP ring's, so every HCA layer has the same page shift: one HCA view
// (docs/flashmla.md, "One HCA view").
static FLASHMLA_V4_P2: RowFormat = RowFormat {
    id: RowFormatId::FlashMlaV4P2,
    name: "flashmla-v4-p2",
    planes: &[PlaneFormat { regions: &[576, 8], page_rows: 2 }],
    segments: FLASHMLA_V4_SEGMENTS,
    kernel_page_rows: 2,
};

static FLASHMLA_V41: RowFormat = RowFormat {
    id: RowFormatId::FlashMlaV41,
    name: "flashmla-v41",
    planes: &[PlaneFormat { regions: &[528], page_rows: 1 }],
    segments: &[Segment {
        first: 0,
        count: 512,
        elem: Elem::E4m3,
        data: at(0, 0, 0),
        scale: Some(ScaleSpec {
            group: 32,
            enc: ScaleEnc::E8m0 { amax_floor: FLASHMLA_AMAX_FLOOR },
            place: at(0, 0, 512),
            copies: 1,
        }),
    }],
    kernel_page_rows: 64,
};

static FLASHMLA_V41_FP4: RowFormat = RowFormat {
    id: RowFormatId::FlashMlaV41Fp4,
    name: "flashmla-v41-fp4",
    planes: &[PlaneFormat { regions: &[288], page_rows: 1 }],
    segments: &[Segment {
        first: 0,
        count: 512,
        elem: Elem::E2m1,
        data: at(0, 0, 0),
        scale: Some(ScaleSpec { group: 16, enc: ScaleEnc::E4m3, place: at(0, 0, 256), copies: 1 }),
    }],
    kernel_page_rows: 64,
};

/// Every format, in the order the CLI lists them.
pub const ALL: [RowFormatId; 6] = [
    RowFormatId::AtomFp8,
    RowFormatId::Bf16,
    RowFormatId::FlashMlaV4,
    RowFormatId::FlashMlaV4P2,
    RowFormatId::FlashMlaV41,
    RowFormatId::FlashMlaV41Fp4,
];

crate::variant::variant_names! {
/// What the format code refuses.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("unknown row format {name:?} (atom-fp8, bf16, flashmla-v4, flashmla-v4-p2, flashmla-v41, flashmla-v41-fp4)")]
    /// A name no format has.
    Unknown {
        /// The name given.
        name: String,
    },
    #[error("a KV row is {want} values, got {got}")]
    /// The input row is not 512 values.
    RowLength {
        /// Values given.
        got: usize,
        /// Values a row has.
        want: usize,
    },
    #[error("plane {plane} of a {format} row is {want} B, got {got}")]
    /// A plane image of the wrong length.
    PlaneLength {
        /// The format.
        format: &'static str,
        /// Plane index.
        plane: usize,
        /// Bytes given.
        got: usize,
        /// Bytes its row takes.
        want: usize,
    },
}
}

impl RowFormatId {
    /// The description.
    pub fn format(self) -> &'static RowFormat {
        match self {
            RowFormatId::AtomFp8 => &ATOM_FP8,
            RowFormatId::Bf16 => &BF16,
            RowFormatId::FlashMlaV4 => &FLASHMLA_V4,
            RowFormatId::FlashMlaV4P2 => &FLASHMLA_V4_P2,
            RowFormatId::FlashMlaV41 => &FLASHMLA_V41,
            RowFormatId::FlashMlaV41Fp4 => &FLASHMLA_V41_FP4,
        }
    }
    /// The code the kernels' `KvRowsArgs::format` names this format by (`crate::index`'s
    /// `KV_ROWS_*` are these; `kernels/kv_rows.cuh`'s `V4P_KV_ROWS_*` are checked against them
    /// by `tests/kv_rows.rs`).
    pub const fn kernel_code(self) -> i32 {
        match self {
            RowFormatId::Bf16 => 0,
            RowFormatId::AtomFp8 => 1,
            RowFormatId::FlashMlaV41 => 2,
            RowFormatId::FlashMlaV4 => 3,
            RowFormatId::FlashMlaV41Fp4 => 4,
            RowFormatId::FlashMlaV4P2 => 5,
        }
    }
    /// The format a kernel code names ([`RowFormatId::kernel_code`]'s inverse).
    pub fn from_kernel_code(code: i32) -> Option<Self> {
        ALL.into_iter().find(|f| f.kernel_code() == code)
    }
    /// The format a name spells.
    pub fn from_name(name: &str) -> Result<Self, FormatError> {
        ALL.into_iter()
            .find(|f| f.format().name == name)
            .ok_or_else(|| FormatError::Unknown { name: name.into() })
    }
}

/// The plane layout of a `width`-byte row for a plane known by its width alone (a pool spec
/// from parts without a row format): the first format's plane of that width in [`ALL`]'s order
/// (584: `flashmla-v4`'s pages of 64, not `flashmla-v4-p2`'s pages of 2, which share the width);
/// a width no format has is an unpaged plane (the geometry's own worked examples use any
/// width). A pool with a row format reads its planes from the format
/// (`crate::pool::PoolSpec::plane_format`).
pub fn plane_of_width(width: u64) -> PlaneFormat {
    ALL.iter()
        .flat_map(|f| f.format().planes.iter())
        .find(|p| p.row_bytes() == width)
        .copied()
        .unwrap_or(PlaneFormat { regions: &[], page_rows: 1 })
}

fn amax_of(x: &[u16]) -> u32 {
    // bf16 bits widened to f32 bits; NaN is never the amax, infinities count.
    x.iter().map(|&v| (u32::from(v) << 16) & 0x7fff_ffff).filter(|&m| m <= 0x7f80_0000).max().unwrap_or(0)
}

/// The value an e4m3fn byte encodes (NaN for `0x7f` / `0xff`).
pub fn e4m3_value(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    s * if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// The value an e2m1 nibble encodes.
pub fn e2m1_value(n: u8) -> f32 {
    const V: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = V[usize::from(n & 7)];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// The scale an e8m0 byte encodes, `2^(B-127)` (0 for `B = 0`, which v4pool's own rule writes for
/// an all-zero tile; NaN for 255).
pub fn e8m0_value(b: u8) -> f32 {
    match b {
        0 => 0.0,
        255 => f32::NAN,
        _ => 2f32.powi(i32::from(b) - 127),
    }
}

impl RowFormat {
    /// Bytes one token's row takes over every plane.
    pub fn bytes_per_token(&self) -> u64 {
        self.planes.iter().map(PlaneFormat::row_bytes).sum()
    }
    /// Row bytes of each plane, in plane order.
    pub fn plane_widths(&self) -> Vec<u64> {
        self.planes.iter().map(PlaneFormat::row_bytes).collect()
    }
    /// Whether any plane is paged (its rows' bytes are not contiguous).
    pub fn is_paged(&self) -> bool {
        self.planes.iter().any(|p| p.page_rows > 1)
    }

    fn byte_in_row(&self, p: Place) -> usize {
        let plane = &self.planes[p.plane];
        plane.regions[..p.region].iter().sum::<u64>() as usize + p.offset
    }

    /// One token's 512 bf16 values (native-order bits) as its row in each plane, regions in
    /// order (de-paged: [`PlaneFormat::byte_offset`] places each region). Bytes no segment
    /// names (padding) are zero.
    pub fn pack(&self, kv: &[u16]) -> Result<Vec<Vec<u8>>, FormatError> {
        if kv.len() != KV_ROW_VALUES {
            return Err(FormatError::RowLength { got: kv.len(), want: KV_ROW_VALUES });
        }
        let mut out: Vec<Vec<u8>> = self.planes.iter().map(|p| vec![0u8; p.row_bytes() as usize]).collect();
        for seg in self.segments {
            let vals = &kv[seg.first..seg.first + seg.count];
            let data = self.byte_in_row(seg.data);
            let group = seg.scale.map_or(seg.count, |s| s.group);
            for (g, x) in vals.chunks(group).enumerate() {
                // inv: 1 / scale, the factor a value is multiplied by before rounding.
                let inv = match seg.scale {
                    None => 1.0,
                    Some(s) => {
                        let (byte, inv) = match s.enc {
                            ScaleEnc::E8m0 { amax_floor } => {
                                let a = amax_of(x).max(amax_floor);
                                let b = match seg.elem {
                                    Elem::E2m1 => e8m0_of_amax_e2m1(a),
                                    _ => e8m0_of_amax(a),
                                };
                                // 1 / scale as the kernels form it, 2^(127 - B) from its bits
                                // (0 for B = 0, and for B = 254, an infinite amax's).
                                let inv =
                                    if b == 0 { 0.0 } else { f32::from_bits((254 - u32::from(b)) << 23) };
                                (b, inv)
                            }
                            ScaleEnc::E4m3 => {
                                let max = if seg.elem == Elem::E2m1 { 6.0 } else { 448.0 };
                                let b = e4m3_rne((f32::from_bits(amax_of(x)) / max).to_bits());
                                let scale = e4m3_value(b);
                                (b, if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 })
                            }
                        };
                        let at = self.byte_in_row(s.place) + g * s.copies;
                        out[s.place.plane][at..at + s.copies].fill(byte);
                        inv
                    }
                };
                for (i, &v) in x.iter().enumerate() {
                    let k = g * group + i; // value index inside the segment
                    let row = &mut out[seg.data.plane];
                    match seg.elem {
                        Elem::Bf16 => row[data + 2 * k..data + 2 * k + 2].copy_from_slice(&v.to_ne_bytes()),
                        // A power-of-two inverse is exact; an e4m3 scale's is rounded once.
                        Elem::E4m3 => row[data + k] = e4m3_of_scaled_bf16(v, inv),
                        Elem::E2m1 => {
                            let n = e2m1_of_scaled_bf16(v, inv);
                            row[data + k / 2] |= if k % 2 == 0 { n } else { n << 4 };
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// The 512 values a row holds (f32; what an attention kernel dequantises to), from each
    /// plane's row as [`RowFormat::pack`] returns it.
    pub fn unpack(&self, rows: &[&[u8]]) -> Result<Vec<f32>, FormatError> {
        for (plane, p) in self.planes.iter().enumerate() {
            let got = rows.get(plane).map_or(0, |r| r.len());
            if got != p.row_bytes() as usize {
                return Err(FormatError::PlaneLength {
                    format: self.name,
                    plane,
                    got,
                    want: p.row_bytes() as usize,
                });
            }
        }
        let mut out = vec![0f32; KV_ROW_VALUES];
        for seg in self.segments {
            let data = self.byte_in_row(seg.data);
            let row = rows[seg.data.plane];
            for k in 0..seg.count {
                let scale = seg.scale.map_or(1.0, |s| {
                    let b = rows[s.place.plane][self.byte_in_row(s.place) + (k / s.group) * s.copies];
                    match s.enc {
                        ScaleEnc::E8m0 { .. } => e8m0_value(b),
                        ScaleEnc::E4m3 => e4m3_value(b),
                    }
                });
                let v = match seg.elem {
                    Elem::Bf16 => f32::from_bits(
                        u32::from(u16::from_ne_bytes([row[data + 2 * k], row[data + 2 * k + 1]])) << 16,
                    ),
                    Elem::E4m3 => e4m3_value(row[data + k]),
                    Elem::E2m1 => e2m1_value(row[data + k / 2] >> (4 * (k % 2))),
                };
                out[seg.first + k] = v * scale;
            }
        }
        Ok(out)
    }

    /// Writes the packed row (`pack`'s output) as row `row` of the planes (`planes[i]` is plane
    /// i from its row 0), through [`PlaneFormat::byte_offset`].
    /// `None` (nothing written) for a row outside the planes and for images that are not
    /// one row of each of the format's planes.
    pub fn place(&self, row: u64, packed: &[Vec<u8>], planes: &mut [&mut [u8]]) -> Option<()> {
        let n = self.planes.len();
        if packed.len() != n
            || planes.len() != n
            || self.planes.iter().zip(packed).any(|(p, img)| img.len() as u64 != p.row_bytes())
        {
            return None;
        }
        // Every destination checked before the first byte moves: a refused place writes nothing.
        let mut spans = Vec::new();
        for (i, p) in self.planes.iter().enumerate() {
            for (k, &w) in p.regions.iter().enumerate() {
                let off = usize::try_from(p.byte_offset(row, k)?).ok()?;
                let end = off.checked_add(usize::try_from(w).ok()?)?;
                planes[i].get(off..end)?;
                spans.push((i, off, end));
            }
        }
        let mut at = vec![0usize; n];
        for (i, off, end) in spans {
            planes[i][off..end].copy_from_slice(&packed[i][at[i]..at[i] + (end - off)]);
            at[i] += end - off;
        }
        Some(())
    }

    /// Tokens `kv` (`n × 512` bf16 bits, token after token) as rows `0..n` of fresh planes of
    /// `n` rows rounded up to whole kernel pages (zero elsewhere): what an attention kernel
    /// reads, built by the description alone (tests, and engines checking a format).
    pub fn pack_planes(&self, kv: &[u16]) -> Result<Vec<Vec<u8>>, FormatError> {
        if kv.len() % KV_ROW_VALUES != 0 {
            return Err(FormatError::RowLength { got: kv.len() % KV_ROW_VALUES, want: KV_ROW_VALUES });
        }
        let n = (kv.len() / KV_ROW_VALUES) as u64;
        let rows = n.div_ceil(self.kernel_page_rows) * self.kernel_page_rows;
        let mut planes: Vec<Vec<u8>> =
            self.planes.iter().map(|p| vec![0u8; (rows * p.row_bytes()) as usize]).collect();
        for (t, x) in kv.chunks_exact(KV_ROW_VALUES).enumerate() {
            let packed = self.pack(x)?;
            let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
            // In range by construction: the planes hold `rows >= n` rows.
            self.place(t as u64, &packed, &mut views).expect("rows inside the planes");
        }
        Ok(planes)
    }

    /// Reads row `row` of the planes back as `pack`'s per-plane images.
    pub fn fetch(&self, row: u64, planes: &[&[u8]]) -> Option<Vec<Vec<u8>>> {
        self.planes
            .iter()
            .zip(planes)
            .map(|(p, src)| {
                let mut img = Vec::with_capacity(p.row_bytes() as usize);
                for (k, &w) in p.regions.iter().enumerate() {
                    let off = usize::try_from(p.byte_offset(row, k)?).ok()?;
                    img.extend_from_slice(src.get(off..off + w as usize)?);
                }
                Some(img)
            })
            .collect()
    }
}

// ---- the indexer's fp8 key formats --------------------------------------------------------
// A CSA layer's fp8 indexer cache: per block of `rows` key rows, `rows × 128` fp8 bytes, then
// `rows` f32 scales (`[rows × 128][rows × 4]`, 132 B a row): one scale per row, a power of two.
// The formats differ in the fp8 encoding, the order of a block's value bytes, and what a
// non-finite key value becomes; where the scales sit is the same in all three.

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn random_row(rng: &mut Rng) -> Vec<u16> {
        // Varied magnitudes per tile so scales differ; never all zero.
        (0..KV_ROW_VALUES)
            .map(|i| {
                let mag = 2f32.powi((i / 32) as i32 % 9 - 4);
                let v = (rng.below(2001) as f32 / 1000.0 - 1.0) * mag;
                (v.to_bits() >> 16) as u16
            })
            .collect()
    }

    #[test]
    fn a_scaled_nan_keeps_the_input_sign_and_the_rest_is_the_product_rounded() {
        // The rule is on the input, whatever sign the platform gives a product's NaN.
        for (v, e4m3, e2m1) in
            [(0x7fc1u16, 0x7fu8, 0x7u8), (0xffc1, 0xff, 0xf), (0x7f81, 0x7f, 0x7), (0xff80, 0xfe, 0xf)]
        {
            assert_eq!(e4m3_of_scaled_bf16(v, 0.5), e4m3, "{v:#x}");
            assert_eq!(e2m1_of_scaled_bf16(v, 0.5), e2m1, "{v:#x}");
        }
        let mut rng = Rng::new(9);
        for _ in 0..10_000 {
            let v = rng.next_u64() as u16;
            if v & 0x7fff > 0x7f80 {
                continue;
            }
            let inv = f32::from_bits(((100 + rng.below(60)) as u32) << 23);
            let f = f32::from_bits(u32::from(v) << 16) * inv;
            assert_eq!(e4m3_of_scaled_bf16(v, inv), e4m3_rne(f.to_bits()));
            assert_eq!(e2m1_of_scaled_bf16(v, inv), e2m1_rne(f.to_bits()));
        }
    }

    #[test]
    fn bytes_per_token_are_the_published_ones() {
        let b: Vec<u64> = ALL.iter().map(|f| f.format().bytes_per_token()).collect();
        assert_eq!(b, [640, 1024, 584, 584, 528, 288]);
        for f in ALL {
            assert_eq!(RowFormatId::from_name(f.format().name), Ok(f));
        }
        assert!(matches!(RowFormatId::from_name("fp9"), Err(FormatError::Unknown { .. })));
    }

    #[test]
    fn paged_offsets_follow_flashmla_v4() {
        let p = &RowFormatId::FlashMlaV4.format().planes[0];
        // Page 1 starts at 64 × 584; its row 3's data at +3 × 576, its scales after 64 × 576.
        assert_eq!(p.byte_offset(67, 0), Some(37_376 + 3 * 576));
        assert_eq!(p.byte_offset(67, 1), Some(37_376 + 36_864 + 3 * 8));
        // Whole pages are one span; a partial page two.
        assert_eq!(p.row_spans(64, 128), Some(vec![(37_376, 2 * 37_376)]));
        assert_eq!(p.row_spans(2, 3), Some(vec![(2 * 576, 3 * 576), (36_864 + 16, 24)]));
        let u = &RowFormatId::FlashMlaV41.format().planes[0];
        assert_eq!(u.row_spans(5, 70), Some(vec![(5 * 528, 70 * 528)]));
        // Pages of 2 (1,168 B): row 67 is page 33's second row, its scales after 2 × 576.
        let p2 = &RowFormatId::FlashMlaV4P2.format().planes[0];
        assert_eq!(p2.byte_offset(67, 0), Some(33 * 1_168 + 576));
        assert_eq!(p2.byte_offset(67, 1), Some(33 * 1_168 + 1_152 + 8));
        assert_eq!(p2.row_spans(4, 6), Some(vec![(4 * 584, 6 * 584)]));
        // Rows 3 and 4: row 3's data, its scales abutting row 4's data (page 2), row 4's scales.
        assert_eq!(
            p2.row_spans(3, 2),
            Some(vec![(1_168 + 576, 576), (1_168 + 1_160, 8 + 576), (2 * 1_168 + 1_152, 8)])
        );
    }

    #[test]
    fn pack_place_fetch_unpack_round_trip_within_the_format_error() {
        let mut rng = Rng::new(11);
        for f in ALL {
            let fmt = f.format();
            let mut planes: Vec<Vec<u8>> =
                fmt.planes.iter().map(|p| vec![0xeeu8; (130 * p.row_bytes()) as usize]).collect();
            let kv = random_row(&mut rng);
            let packed = fmt.pack(&kv).unwrap();
            let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
            fmt.place(69, &packed, &mut views).unwrap();
            let views: Vec<&[u8]> = planes.iter().map(|v| v.as_slice()).collect();
            let back = fmt.fetch(69, &views).unwrap();
            assert_eq!(back, packed, "{}", fmt.name);
            let refs: Vec<&[u8]> = back.iter().map(|v| v.as_slice()).collect();
            let vals = fmt.unpack(&refs).unwrap();
            for (i, (&v, &x)) in vals.iter().zip(&kv).enumerate() {
                let x = f32::from_bits(u32::from(x) << 16);
                // Relative to the value's group amax: e4m3 has 3 mantissa bits, e2m1 1.
                let rel = match fmt.name {
                    "bf16" => 0.0,
                    "flashmla-v41-fp4" => 0.26,
                    _ => 0.0625,
                };
                let group_amax = 2f32.powi((i / 32) as i32 % 9 - 4);
                assert!((v - x).abs() <= rel * group_amax + 1e-30, "{} value {i}: {v} vs {x}", fmt.name);
            }
            // Only the row's own bytes changed.
            let touched: usize = planes.iter().map(|p| p.iter().filter(|&&b| b != 0xee).count()).sum();
            assert!(touched as u64 <= fmt.bytes_per_token());
        }
    }

    #[test]
    fn flashmla_scale_floor_is_quant_py_rule() {
        // 2^ceil(log2(max(amax / 448, 1e-4))): tiny or zero rows get 2^-13 (byte 114).
        let kv = vec![0u16; KV_ROW_VALUES];
        let v4 = RowFormatId::FlashMlaV4.format().pack(&kv).unwrap();
        assert_eq!(&v4[0][576..583], &[114u8; 7]);
        let atom = RowFormatId::AtomFp8.format().pack(&kv).unwrap();
        assert_eq!(&atom[0][448..462], &[0u8; 14]);
        // amax exactly 448 × 2^k takes scale 2^k; one bf16 step above takes 2^(k+1).
        let mut kv = vec![0u16; KV_ROW_VALUES];
        kv[0] = (448f32.to_bits() >> 16) as u16;
        assert_eq!(RowFormatId::FlashMlaV4.format().pack(&kv).unwrap()[0][576], 127);
        kv[0] += 1;
        assert_eq!(RowFormatId::FlashMlaV4.format().pack(&kv).unwrap()[0][576], 128);
    }

    #[test]
    fn e4m3fnuz_follows_aiters_rules() {
        // Every finite code round-trips; its value is half the e4m3fn value of the same byte.
        for b in 0..=255u8 {
            let v = e4m3fnuz_value(b);
            if b == 0x80 {
                assert!(v.is_nan());
                continue;
            }
            assert_eq!(e4m3fnuz_rne(v.to_bits()), b, "{b:#04x} = {v}");
            if b & 0x7f != 0x7f {
                assert_eq!(v, e4m3_value(b) / 2.0, "{b:#04x}");
            }
        }
        assert_eq!(e4m3fnuz_value(0x7f), 240.0);
        // Midpoints go to the even code, one ulp either side to the nearer.
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3fnuz_value(b), e4m3fnuz_value(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(e4m3fnuz_rne(mid.to_bits()), even, "midpoint {mid}");
            assert_eq!(e4m3fnuz_rne(mid.to_bits() + 1), b + 1, "above {mid}");
            assert_eq!(e4m3fnuz_rne(mid.to_bits() - 1), b, "below {mid}");
            assert_eq!(e4m3fnuz_rne((-mid).to_bits()), if even == 0 { 0 } else { 0x80 | even }, "-{mid}");
        }
        // No negative zero: -0.0 and negatives rounding to zero are 0x00; NaN and infinities
        // are the one NaN; past 240 clips.
        assert_eq!(e4m3fnuz_rne((-0.0f32).to_bits()), 0);
        assert_eq!(e4m3fnuz_rne((-1e-9f32).to_bits()), 0);
        assert_eq!(e4m3fnuz_rne((-2f32.powi(-12)).to_bits()), 0);
        assert_eq!(e4m3fnuz_rne((-2f32.powi(-10)).to_bits()), 0x81);
        for x in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(e4m3fnuz_rne(x.to_bits()), 0x80, "{x}");
        }
        for (x, b) in [(240.0f32, 0x7f), (247.9, 0x7f), (1e30, 0x7f), (-300.0, 0xff), (232.0, 0x7e)] {
            assert_eq!(e4m3fnuz_rne(x.to_bits()), b, "{x}");
        }
    }

    #[test]
    fn the_power_of_two_scale_is_the_least_that_fits_each_max() {
        for max in [E4M3FN_MAX, E4M3FNUZ_MAX, 0x40c0_0000] {
            let m = f64::from(f32::from_bits(max));
            for amax in [1e-4f32, 1.0, 239.9, 240.0, 240.1, 448.0, 449.0, 6.0, 7.0, 3e38, 1e-30] {
                let b = e8m0_fitting(amax.to_bits(), max);
                let scale = (f64::from(b) - 127.0).exp2();
                assert!(f64::from(amax) / scale <= m, "{amax} / 2^{} > {m}", i32::from(b) - 127);
                assert!(b == 1 || f64::from(amax) / (scale / 2.0) > m, "{amax}: {b} not the least");
            }
        }
        assert_eq!(e8m0_fitting(0, E4M3FNUZ_MAX), 0);
    }

    #[test]
    fn the_key_formats_place_values_as_their_readers_read_them() {
        // Row-major: r × 128 + d; preshuffled: 16×16 tiles, 16 rows a group.
        assert_eq!(FP8_KEYS.value_offset(64, 5, 17), Some(5 * 128 + 17));
        assert_eq!(ATOM_FP8_FNUZ_KEYS.value_offset(64, 17, 35), Some(2048 + 2 * 256 + 16 + 3));
        assert_eq!(ATOM_FP8_KEYS.scale_offset(64, 3), Some(64 * 128 + 12));
        assert_eq!(ATOM_FP8_KEYS.value_offset(40, 0, 0), None); // not whole 16-row groups
        assert_eq!(ATOM_FP8_KEYS.value_offset(64, 64, 0), None);
        // An all-zero row takes the 1e-4 floor: 2^-21 at 240, 2^-22 at 448.
        let mut q = [0xaau8; 128];
        assert_eq!(f32::from_bits(ATOM_FP8_FNUZ_KEYS.pack(&[0x8000; 128], &mut q).unwrap()), 2f32.powi(-21));
        assert!(q.iter().all(|&b| b == 0), "-0.0 is 0x00 in e4m3fnuz");
        assert_eq!(f32::from_bits(ATOM_FP8_KEYS.pack(&[0; 128], &mut q).unwrap()), 2f32.powi(-22));
    }
}
