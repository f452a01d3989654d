//! The six formats, each described once (the table in `format`'s own doc says what each holds).

use super::{Elem, Place, PlaneFormat, RowFormat, RowFormatId, ScaleEnc, ScaleSpec, Segment};

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

pub(super) static ATOM_FP8: RowFormat = RowFormat {
    id: RowFormatId::AtomFp8,
    name: "atom-fp8",
    planes: &[PlaneFormat { regions: &[512], page_rows: 1 }, PlaneFormat { regions: &[128], page_rows: 1 }],
    segments: &[
        nope_e4m3(0, at(0, 0, 448), 2),
        Segment { first: 448, count: 64, elem: Elem::Bf16, data: at(1, 0, 0), scale: None },
    ],
    kernel_page_rows: 1,
};

pub(super) static BF16: RowFormat = RowFormat {
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

pub(super) static FLASHMLA_V4: RowFormat = RowFormat {
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
pub(super) static FLASHMLA_V4_P2: RowFormat = RowFormat {
    id: RowFormatId::FlashMlaV4P2,
    name: "flashmla-v4-p2",
    planes: &[PlaneFormat { regions: &[576, 8], page_rows: 2 }],
    segments: FLASHMLA_V4_SEGMENTS,
    kernel_page_rows: 2,
};

pub(super) static FLASHMLA_V41: RowFormat = RowFormat {
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

pub(super) static FLASHMLA_V41_FP4: RowFormat = RowFormat {
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
