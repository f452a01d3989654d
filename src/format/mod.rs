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

mod catalog;
mod codec;
mod keys;
mod layout;
mod pack;
#[cfg(test)]
mod tests;

pub use catalog::*;
pub use codec::*;
pub use keys::*;
pub use layout::*;

use thiserror::Error;

/// Values of one KV row: 448 NoPE, then 64 RoPE (`crate::index::KV_ROW_VALUES` is this).
pub const KV_ROW_VALUES: usize = 512;

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
            RowFormatId::AtomFp8 => &catalog::ATOM_FP8,
            RowFormatId::Bf16 => &catalog::BF16,
            RowFormatId::FlashMlaV4 => &catalog::FLASHMLA_V4,
            RowFormatId::FlashMlaV4P2 => &catalog::FLASHMLA_V4_P2,
            RowFormatId::FlashMlaV41 => &catalog::FLASHMLA_V41,
            RowFormatId::FlashMlaV41Fp4 => &catalog::FLASHMLA_V41_FP4,
        }
    }
    /// The code the kernels' `KvRowsArgs::format` names this format by (`crate::index`'s
    /// `KV_ROWS_*` are these; `kernels/kv_rows.cuh`'s `V4P_KV_ROWS_*` are checked against them
    /// by `tests/kernels/kv_rows.rs`).
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
