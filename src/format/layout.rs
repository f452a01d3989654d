//! What a row format is made of: value runs ([`Segment`]) and their scales, and each plane's
//! row cut into regions and pages ([`PlaneFormat`]), the one conversion from rows to bytes.

use super::RowFormatId;

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
/// a taller plane, `geometry::MAX_PLANE_ROWS`; `tests/layout/row_formats.rs` checks the two agree).
/// [`PlaneFormat::row_spans`] refuses rows past it, so its work stays bounded.
pub const MAX_ROWS: u64 = i32::MAX as u64;
