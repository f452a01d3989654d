//! Checkpoint images (`pool-runtime.md` §6, image content and placement only): which bytes of
//! a slot a prefix-cache checkpoint carries, how they land in reserved PAGE units, and the
//! layout id two workers must agree on.
//!
//! An image is, per plane in plane order, the slot's carried state ranges plus every entry
//! row some `(layer, ring position)` maps to, merged. Left out: HCA state, alignment padding,
//! the slot tail and interleave padding. The image is copied into the destination stream of
//! its reserved units (per unit: plane-0 envelope bytes, plane-1 envelope bytes, then each
//! CSA layer's indexer block); a store copies slot → units, a restore the same plan the
//! other way. Both streams are layout constants, so the cut points are computed once
//! ([`CheckpointLayout::template`]) and resolved per op against real ids.
//! The store lifecycle (reservation, LRU, pins) is the lead's, not this module's.

use crate::arena::{ArenaError, ArenaLayout};
use crate::checked::{add, mul};
use crate::geometry::{merge_abutting, GeometryError, UnifiedPoolGeometry};
use crate::sizing::{IndexerDtype, PoolLayout};
use thiserror::Error;

crate::checked::overflow_into!(CheckpointError);

crate::variant::variant_names! {
/// Everything building or resolving a checkpoint plan refuses.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CheckpointError {
    #[error(transparent)]
    /// A failure of the layer below ([`ArenaError`]).
    Arena(#[from] ArenaError),
    #[error(transparent)]
    /// A failure of the layer below ([`GeometryError`]).
    Geometry(#[from] GeometryError),
    #[error("{ranges} planes of state ranges for {widths} plane widths")]
    /// `ranges` planes of state ranges for `widths` plane widths.
    PlaneCount {
        /// Plane widths given.
        widths: usize,
        /// Range lists given.
        ranges: usize,
    },
    #[error("a page of 0 bytes cannot hold an image")]
    /// A page of 0 bytes cannot hold an image.
    EmptyPage,
    #[error("arithmetic overflow computing {what}")]
    /// Arithmetic overflow computing `what`.
    Overflow {
        /// What was computed or checked.
        what: &'static str,
    },
    #[error("a checkpoint takes {expected} units, got {got}")]
    /// A checkpoint takes `expected` units, got `got`.
    UnitCount {
        /// The value given.
        got: usize,
        /// The value expected.
        expected: u64,
    },
    #[error("unit {unit} outside the pool's blocks 0..{num_blocks}")]
    /// Unit `unit` outside the pool's blocks 0..`num_blocks`.
    UnitOutOfRange {
        /// The unit given.
        unit: i64,
        /// Blocks there are.
        num_blocks: i64,
    },
    #[error("unit {unit} outside the indexer's {indexer_blocks} blocks")]
    /// Unit `unit` outside the indexer's `indexer_blocks` blocks.
    IndexerTooSmall {
        /// The unit given.
        unit: i64,
        /// Blocks the indexer is sized for.
        indexer_blocks: i64,
    },
    #[error("unit {unit} is reserved twice in one checkpoint")]
    /// Unit `unit` is reserved twice in one checkpoint.
    DuplicateUnit {
        /// The unit given.
        unit: i64,
    },
    #[error("the carved geometry has {what} {got}, the checkpoint layout was built for {expected}")]
    /// The carved geometry has `what` `got`, the checkpoint layout was built for `expected`.
    LayoutMismatch {
        /// What was computed or checked.
        what: &'static str,
        /// The value expected.
        expected: i64,
        /// The value given.
        got: i64,
    },
    #[error("slot position {position} is not live (live positions {first}..{end})")]
    /// Slot position `position` is not live (live positions `first`..`end`).
    NotLive {
        /// The position given.
        position: i64,
        /// First live position.
        first: i64,
        /// One past the last live position.
        end: i64,
    },
    #[error("the state has no field {name:?}, which the layout id names")]
    /// The state has no field `name`, which the layout id names.
    MissingField {
        /// The name.
        name: &'static str,
    },
    /// An image taken in one layout offered to a pool of another: refused even when the byte
    /// lengths agree, because the same bytes mean different fields there.
    #[error("an image of layout {image:?} cannot be restored into a pool of layout {pool:?}")]
    ForeignLayout {
        /// The pool's layout id.
        pool: String,
        /// The image's layout id.
        image: String,
    },
}
}

fn to_u64(x: i64, what: &'static str) -> Result<u64, CheckpointError> {
    u64::try_from(x).map_err(|_| CheckpointError::Overflow { what })
}
fn to_i64(x: u64, what: &'static str) -> Result<i64, CheckpointError> {
    i64::try_from(x).map_err(|_| CheckpointError::Overflow { what })
}

/// A byte address space a copy reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Region {
    /// Plane `i`; offsets from the plane's first byte.
    Plane(usize),
    /// Indexer pool `i` (FP8: 0 is the only pool; FP4: 0 data, 1 scales); offsets from the
    /// pool's first byte.
    Indexer(usize),
}

/// A byte in a [`Region`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Region the byte is in.
    pub region: Region,
    /// Byte offset in the region.
    pub offset: u64,
}

/// Copy `bytes` bytes from `src` to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionCopy {
    /// Where the bytes come from.
    pub src: Loc,
    /// Where they go.
    pub dst: Loc,
    /// Bytes to copy.
    pub bytes: u64,
}

/// One part of a PAGE unit's destination stream. For block `b` of an indexer sized for
/// `NB` blocks it starts at `base_per_nb × NB + b × block_stride` of `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitPart {
    /// Region of the part.
    pub region: Region,
    /// Multiplies the indexer's block capacity (a CSA layer's start in its pool); 0 for planes.
    pub base_per_nb: u64,
    /// Bytes from one block's part to the next.
    pub block_stride: u64,
    /// Bytes of the part per unit.
    pub bytes: u64,
}

impl UnitPart {
    fn offset(&self, block: u64, indexer_blocks: u64) -> Result<u64, CheckpointError> {
        let base = mul(self.base_per_nb, indexer_blocks, "unit part base")?;
        Ok(add(base, mul(block, self.block_stride, "unit part offset")?, "unit part offset")?)
    }
}

/// One cut of the image against the units, independent of which slot and which ids:
/// `bytes` from `slot_offset` of `plane` (relative to the slot's first byte in that plane)
/// to `part_offset` of part `part` of the `unit`-th reserved unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopySpan {
    /// Plane of the image bytes.
    pub plane: usize,
    /// Offset from the slot's first byte in that plane.
    pub slot_offset: u64,
    /// Which reserved unit (in reservation order).
    pub unit: usize,
    /// Which part of the unit's stream.
    pub part: usize,
    /// Offset inside that part.
    pub part_offset: u64,
    /// Bytes of the cut.
    pub bytes: u64,
}

/// One plane's image ranges (§6): `merge_abutting(state_ranges + window rows × width)`,
/// window rows being `entry_runs` shifted past the arena; a plane known by its width alone
/// (paged as [`crate::format::plane_of_width`] says). [`plane_ranges_in`] takes the plane's
/// layout.
pub fn plane_ranges(
    state_ranges: &[(u64, u64)],
    arena_rows: i64,
    entry_runs: &[(i64, i64)],
    width: u64,
) -> Result<Vec<(u64, u64)>, CheckpointError> {
    plane_ranges_in(state_ranges, arena_rows, entry_runs, width, crate::format::plane_of_width(width))
}

/// [`plane_ranges`] of a plane of `width`-byte rows laid out as `paged` (its row format's
/// plane: `flashmla-v4` and `flashmla-v4-p2` share the width at different pages).
pub fn plane_ranges_in(
    state_ranges: &[(u64, u64)],
    arena_rows: i64,
    entry_runs: &[(i64, i64)],
    width: u64,
    paged: crate::format::PlaneFormat,
) -> Result<Vec<(u64, u64)>, CheckpointError> {
    let w = to_i64(width, "plane width")?;
    let mut all = Vec::with_capacity(state_ranges.len() + entry_runs.len());
    for &(s, n) in state_ranges {
        all.push((to_i64(s, "state range")?, to_i64(n, "state range")?));
    }
    // A paged plane (FlashMLA's V4 rows) keeps a page's data rows apart from its scale rows:
    // a run of window rows is then one span per region and page, from the format's
    // `row_spans` (slots start on a page, so offsets from the slot's start are plane offsets
    // shifted by whole pages).
    for &(start, count) in entry_runs {
        let row = arena_rows.checked_add(start).ok_or(CheckpointError::Overflow { what: "window row" })?;
        if paged.page_rows > 1 {
            let spans = paged
                .row_spans(to_u64(row, "window row")?, to_u64(count, "window rows")?)
                .ok_or(CheckpointError::Overflow { what: "window range" })?;
            for (off, len) in spans {
                all.push((to_i64(off, "window range")?, to_i64(len, "window range")?));
            }
            continue;
        }
        let off = row.checked_mul(w).ok_or(CheckpointError::Overflow { what: "window range" })?;
        let len = count.checked_mul(w).ok_or(CheckpointError::Overflow { what: "window range" })?;
        all.push((off, len));
    }
    // Offset order (a paged plane's scale spans sit after the next run's data spans).
    all.sort_unstable();
    merge_abutting(&all)?.into_iter().map(|(s, n)| Ok((to_u64(s, "range")?, to_u64(n, "range")?))).collect()
}

/// What a checkpoint holds and where it goes, for one carved layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointLayout {
    /// Plane row bytes, in plane order.
    pub widths: Vec<u64>,
    /// Per plane, `(offset in the slot, bytes)` in that plane.
    pub plane_ranges: Vec<Vec<(u64, u64)>>,
    /// Bytes of one slot's image.
    pub image_bytes: u64,
    /// Bytes one unit (a block's page) holds.
    pub page_bytes: u64,
    /// Units one checkpoint takes.
    pub units_per_checkpoint: u64,
    /// One unit's destination stream, in order.
    pub unit_parts: Vec<UnitPart>,
    /// Rows of one block's envelope.
    pub envelope_rows: i64,
    /// Rows of one slot.
    pub slot_rows: i64,
    /// Arena rows at the head of a slot.
    pub arena_rows: i64,
}

impl CheckpointLayout {
    /// The checkpoint layout of a priced pool layout (its planes the row format's).
    pub fn for_pool(layout: &PoolLayout) -> Result<Self, CheckpointError> {
        Self::for_planes(
            &layout.arena,
            &layout.geometry,
            &layout.model.indexer_layers(),
            layout.indexer,
            layout.kv.row_format().format().planes,
        )
    }

    /// From an arena planned at the geometry's plane widths, with the indexer cache's
    /// index-key layers `indexer_layers` (V4: the CSA layers; V4.1: the KV sources; none
    /// without an indexer cache).
    pub fn new(
        arena: &ArenaLayout,
        geom: &UnifiedPoolGeometry,
        indexer_layers: &[usize],
        indexer: IndexerDtype,
    ) -> Result<Self, CheckpointError> {
        let planes: Vec<crate::format::PlaneFormat> =
            arena.widths().iter().map(|&w| crate::format::plane_of_width(w)).collect();
        Self::for_planes(arena, geom, indexer_layers, indexer, &planes)
    }

    /// As [`CheckpointLayout::new`] with each plane's layout given (a pool's row format's
    /// planes, in plane order; their widths must be the arena's).
    pub fn for_planes(
        arena: &ArenaLayout,
        geom: &UnifiedPoolGeometry,
        indexer_layers: &[usize],
        indexer: IndexerDtype,
        planes: &[crate::format::PlaneFormat],
    ) -> Result<Self, CheckpointError> {
        if arena.arena_rows() != geom.arena_rows {
            return Err(CheckpointError::LayoutMismatch {
                what: "arena_rows",
                expected: arena.arena_rows(),
                got: geom.arena_rows,
            });
        }
        let state: Vec<Vec<(u64, u64)>> =
            (0..arena.planes().len()).map(|p| arena.plane_checkpoint_ranges(p)).collect::<Result<_, _>>()?;
        let widths = arena.widths();
        if planes.len() != widths.len() {
            return Err(CheckpointError::PlaneCount { widths: widths.len(), ranges: planes.len() });
        }
        // A paged plane's page arithmetic is its rows' width's; an unpaged one takes any width.
        for (p, &w) in planes.iter().zip(&widths) {
            if p.page_rows > 1 && p.row_bytes() != w {
                return Err(CheckpointError::LayoutMismatch {
                    what: "paged plane row bytes",
                    expected: to_i64(w, "plane width")?,
                    got: to_i64(p.row_bytes(), "plane width")?,
                });
            }
        }
        Self::from_planes(&state, &widths, planes, geom, indexer_layers, indexer)
    }

    /// From explicit per-plane state ranges and plane widths (any widths: the spec's worked
    /// examples use 16-, 8- and 32-B planes).
    pub fn from_parts(
        state_ranges: &[Vec<(u64, u64)>],
        widths: &[u64],
        geom: &UnifiedPoolGeometry,
        indexer_layers: &[usize],
        indexer: IndexerDtype,
    ) -> Result<Self, CheckpointError> {
        let planes: Vec<crate::format::PlaneFormat> =
            widths.iter().map(|&w| crate::format::plane_of_width(w)).collect();
        Self::from_planes(state_ranges, widths, &planes, geom, indexer_layers, indexer)
    }

    fn from_planes(
        state_ranges: &[Vec<(u64, u64)>],
        widths: &[u64],
        planes: &[crate::format::PlaneFormat],
        geom: &UnifiedPoolGeometry,
        indexer_layers: &[usize],
        indexer: IndexerDtype,
    ) -> Result<Self, CheckpointError> {
        if state_ranges.len() != widths.len() {
            return Err(CheckpointError::PlaneCount { widths: widths.len(), ranges: state_ranges.len() });
        }
        let runs = geom.entry_row_runs();
        let plane_ranges: Vec<Vec<(u64, u64)>> = state_ranges
            .iter()
            .zip(widths.iter().zip(planes))
            .map(|(s, (&w, &p))| plane_ranges_in(s, geom.arena_rows, &runs, w, p))
            .collect::<Result<_, _>>()?;
        let image_bytes = plane_ranges
            .iter()
            .flatten()
            .try_fold(0u64, |acc, &(_, n)| acc.checked_add(n))
            .ok_or(CheckpointError::Overflow { what: "image bytes" })?;
        let e = to_u64(geom.envelope_rows, "envelope rows")?;
        let mut unit_parts = Vec::new();
        for (p, &w) in widths.iter().enumerate() {
            let bytes = mul(e, w, "envelope bytes")?;
            unit_parts.push(UnitPart {
                region: Region::Plane(p),
                base_per_nb: 0,
                block_stride: bytes,
                bytes,
            });
        }
        // FP8: each layer's block (V4: 8,448 B); FP4: all data blocks, then all scale blocks.
        let layers =
            if indexer_layers.is_empty() { Vec::new() } else { indexer.layer_parts(geom, indexer_layers)? };
        for (pool, parts) in layers.iter().enumerate() {
            for part in parts {
                unit_parts.push(UnitPart {
                    region: Region::Indexer(pool),
                    base_per_nb: part.prefix,
                    block_stride: part.block_bytes,
                    bytes: part.block_bytes,
                });
            }
        }
        let page_bytes = unit_parts.iter().try_fold(0u64, |acc, u| add(acc, u.bytes, "page bytes"))?;
        if page_bytes == 0 {
            return Err(CheckpointError::EmptyPage);
        }
        Ok(CheckpointLayout {
            widths: widths.to_vec(),
            plane_ranges,
            image_bytes,
            page_bytes,
            units_per_checkpoint: image_bytes.div_ceil(page_bytes),
            unit_parts,
            envelope_rows: geom.envelope_rows,
            slot_rows: geom.slot_rows,
            arena_rows: geom.arena_rows,
        })
    }

    /// The image stream: `(plane, offset in the slot, bytes)` in image order.
    pub fn image_segments(&self) -> Vec<(usize, u64, u64)> {
        self.plane_ranges
            .iter()
            .enumerate()
            .flat_map(|(p, r)| r.iter().map(move |&(o, n)| (p, o, n)))
            .collect()
    }

    /// The image against `units_per_checkpoint` units: every overlap of the two streams.
    /// The same for every slot and every set of ids; the image normally ends inside the
    /// last unit, whose remaining bytes are left alone.
    pub fn template(&self) -> Vec<CopySpan> {
        let mut out = Vec::new();
        let parts = &self.unit_parts;
        let (mut unit, mut part, mut part_used) = (0usize, 0usize, 0u64);
        for (plane, mut slot_offset, mut left) in self.image_segments() {
            while left > 0 {
                // The destination stream holds at least image_bytes (units × page ≥ image).
                let room = parts[part].bytes - part_used;
                let n = room.min(left);
                if n > 0 {
                    out.push(CopySpan { plane, slot_offset, unit, part, part_offset: part_used, bytes: n });
                }
                slot_offset += n;
                left -= n;
                part_used += n;
                if part_used == parts[part].bytes {
                    part_used = 0;
                    part += 1;
                    if part == parts.len() {
                        part = 0;
                        unit += 1;
                    }
                }
            }
        }
        out
    }

    /// Copies that store the slot at `position` into the reserved `units` (block ids, in
    /// reserved order); `geom` is the carved geometry, `indexer_blocks` the block capacity
    /// the indexer pools were allocated for. Adjacent copies are merged.
    pub fn store_plan(
        &self,
        geom: &UnifiedPoolGeometry,
        position: i64,
        units: &[i64],
        indexer_blocks: i64,
    ) -> Result<Vec<RegionCopy>, CheckpointError> {
        for (what, expected, got) in [
            ("envelope_rows", self.envelope_rows, geom.envelope_rows),
            ("slot_rows", self.slot_rows, geom.slot_rows),
            ("arena_rows", self.arena_rows, geom.arena_rows),
        ] {
            if expected != got {
                return Err(CheckpointError::LayoutMismatch { what, expected, got });
            }
        }
        if units.len() as u64 != self.units_per_checkpoint {
            return Err(CheckpointError::UnitCount { got: units.len(), expected: self.units_per_checkpoint });
        }
        for (i, &u) in units.iter().enumerate() {
            if !(0..geom.num_blocks).contains(&u) {
                return Err(CheckpointError::UnitOutOfRange { unit: u, num_blocks: geom.num_blocks });
            }
            if u >= indexer_blocks {
                return Err(CheckpointError::IndexerTooSmall { unit: u, indexer_blocks });
            }
            if units[..i].contains(&u) {
                return Err(CheckpointError::DuplicateUnit { unit: u });
            }
        }
        let live = geom.live_positions();
        if !live.contains(&position) {
            return Err(CheckpointError::NotLive { position, first: live.start, end: live.end });
        }
        let slot_row = to_u64(geom.slot_span(position)?.0, "slot row")?;
        let nb = to_u64(indexer_blocks, "indexer blocks")?;
        let mut out: Vec<RegionCopy> = Vec::new();
        for span in self.template() {
            let slot_base = mul(slot_row, self.widths[span.plane], "slot base")?;
            let src =
                Loc { region: Region::Plane(span.plane), offset: add(slot_base, span.slot_offset, "src")? };
            let part = &self.unit_parts[span.part];
            let block = to_u64(units[span.unit], "unit")?;
            let dst =
                Loc { region: part.region, offset: add(part.offset(block, nb)?, span.part_offset, "dst")? };
            if let Some(last) = out.last_mut() {
                if last.src.region == src.region
                    && last.dst.region == dst.region
                    && last.src.offset + last.bytes == src.offset
                    && last.dst.offset + last.bytes == dst.offset
                {
                    last.bytes += span.bytes;
                    continue;
                }
            }
            out.push(RegionCopy { src, dst, bytes: span.bytes });
        }
        Ok(out)
    }

    /// Copies that restore an image from `units` into the slot at `position`: the store
    /// plan read the other way. Bytes outside the ranges are left alone.
    pub fn restore_plan(
        &self,
        geom: &UnifiedPoolGeometry,
        position: i64,
        units: &[i64],
        indexer_blocks: i64,
    ) -> Result<Vec<RegionCopy>, CheckpointError> {
        Ok(self
            .store_plan(geom, position, units, indexer_blocks)?
            .into_iter()
            .map(|r| RegionCopy { src: r.dst, dst: r.src, bytes: r.bytes })
            .collect())
    }
}

/// A checkpoint layout id (§6): the one line two workers, or a pool and an image, must agree
/// on byte for byte before an image's bytes mean the same fields. Cheap to clone, so a store
/// (the prefix-reuse manager's) can keep one with every checkpoint it holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayoutId(std::sync::Arc<str>);

impl LayoutId {
    /// A layout id from its text (as [`layout_id`] writes it, or as read back from storage).
    pub fn new(id: impl Into<String>) -> LayoutId {
        LayoutId(id.into().into())
    }

    /// The layout id of a priced pool layout ([`layout_id`]).
    pub fn for_layout(layout: &PoolLayout) -> Result<LayoutId, CheckpointError> {
        Ok(LayoutId::new(layout_id(layout)?))
    }

    /// The id's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Refuse an image of layout `image` for a pool of this layout.
    pub fn check_image(&self, image: &LayoutId) -> Result<(), CheckpointError> {
        if self != image {
            return Err(CheckpointError::ForeignLayout { pool: self.to_string(), image: image.to_string() });
        }
        Ok(())
    }
}

impl std::fmt::Display for LayoutId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One slot's checkpoint image on the host, tagged with the layout it was taken in. Built by
/// [`crate::pool::Pool::checkpoint`], or by [`CheckpointImage::new`] when importing bytes
/// stored elsewhere; [`crate::pool::Pool::restore`] refuses an image of another layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointImage {
    layout: LayoutId,
    bytes: Vec<u8>,
}

impl CheckpointImage {
    /// An image of `bytes` taken in layout `layout` (the restore checks both the id and the
    /// length against the pool).
    pub fn new(layout: LayoutId, bytes: Vec<u8>) -> CheckpointImage {
        CheckpointImage { layout, bytes }
    }

    /// The layout the image was taken in.
    pub fn layout_id(&self) -> &LayoutId {
        &self.layout
    }

    /// The image's bytes (per plane, the §6 ranges in order).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The layout id and the bytes, for storing elsewhere.
    pub fn into_parts(self) -> (LayoutId, Vec<u8>) {
        (self.layout, self.bytes)
    }
}

/// Python's spelling of a tuple of ints: `(9, 1024)`, `(5,)`.
fn py_tuple(v: &[u64]) -> String {
    match v {
        [one] => format!("({one},)"),
        _ => format!("({})", v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// The checkpoint layout id (§6), one line; two workers must agree byte for byte.
pub fn layout_id(layout: &PoolLayout) -> Result<String, CheckpointError> {
    let m = &layout.model;
    if m.family == crate::model::ModelFamily::V41 {
        return Ok(v41_layout_id(layout));
    }
    let fields = layout.arena.fields();
    let shape = |name: &'static str| -> Result<String, CheckpointError> {
        fields
            .iter()
            .find(|f| f.name == name)
            .map(|f| py_tuple(&f.shape))
            .ok_or(CheckpointError::MissingField { name })
    };
    let ratios: Vec<String> = m.ratios.iter().map(i32::to_string).collect();
    let nocopy: Vec<&str> = fields.iter().filter(|f| !f.carried).map(|f| f.name.as_str()).collect();
    Ok(format!(
        "dsv4-paged-state-v3:block={}:ring={}:dims={},{},{}:state={},{},{}:main={}:index={}:ratios={}\
         :nocopy={}:entry=packed",
        m.block_size,
        m.ring_slots(),
        m.head_dim,
        m.qk_rope_head_dim,
        m.index_head_dim,
        shape("csa_main_kv")?,
        shape("csa_idx_kv")?,
        shape("hca_main_kv")?,
        layout.kv.layout_name(),
        layout.indexer.name(),
        ratios.join(","),
        nocopy.join(","),
    ))
}

/// V4.1's layout id: v4pool's own image (arena, then class-grouped windows, owners-only
/// envelopes), so it names neither the reference engine's image nor V4's; every input that
/// gives the image bytes their meaning is in it (`docs/v41.md`).
fn v41_layout_id(layout: &PoolLayout) -> String {
    let m = &layout.model;
    let join = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let ratios: Vec<String> = m.ratios.iter().map(i32::to_string).collect();
    let state: Vec<String> = layout
        .arena
        .fields()
        .iter()
        .map(|f| format!("{}{}x{}", f.name, f.layers, py_tuple(&f.shape)))
        .collect();
    format!(
        "dsv41-v4pool-compact-v1:block={}:ring={}:dims={},{},{}:state={}:main={}:index={}:ratios={}\
         :kv_sources={}:index_sources={}:history={}:form={:?}",
        m.block_size,
        m.ring_slots(),
        m.head_dim,
        m.qk_rope_head_dim,
        m.index_head_dim,
        state.join(";"),
        layout.kv.layout_name(),
        layout.indexer.name(),
        ratios.join(","),
        join(&m.kv_sources),
        join(&m.index_sources),
        m.engram_history,
        layout.geometry.form,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::GeometrySpec;
    use crate::model::{DraftMode, ModelShape};
    use crate::sizing::KvDtype;
    use crate::variant::VariantName;

    #[test]
    fn worked_example_ratios_4_128_4_0() {
        let g = GeometrySpec::new(vec![4, 128, 4, 0], 0, 0, 7, 256).arena_rows(10).build().unwrap();
        assert_eq!(g.entry_row_runs(), vec![(0, 21), (78, 7)]);
        assert_eq!(g.entry_rows, 85);
        let r = plane_ranges(&[], 10, &g.entry_row_runs(), 32).unwrap();
        assert_eq!(r, vec![(320, 672), (2816, 224)]);
        // A state range that ends exactly where the entry begins merges into it.
        let r = plane_ranges(&[(0, 64), (128, 192)], 10, &g.entry_row_runs(), 32).unwrap();
        assert_eq!(r, vec![(0, 64), (128, 864), (2816, 224)]);
        assert!(matches!(
            plane_ranges(&[(0, 400)], 10, &g.entry_row_runs(), 32),
            Err(CheckpointError::Geometry(GeometryError::RunOverlap { .. }))
        ));
    }

    #[test]
    fn dspark_dense_draft_runs() {
        let m = ModelShape::v4_flash_dspark(3, DraftMode::Dense).unwrap();
        assert_eq!(m.ring_slots(), 131);
        let g = GeometrySpec::new(m.ratios.clone(), 0, 0, 131, 256).build().unwrap();
        let runs = g.entry_row_runs();
        assert_eq!(&runs[..3], &[(0, 3256), (3257, 1), (3259, 1)]);
        assert!(runs.contains(&(3293, 2692)));
        let tail: Vec<(i64, i64)> = (0..20).map(|i| (6046 + 64 * i, 3)).collect();
        assert_eq!(&runs[runs.len() - 20..], &tail[..]);
        assert_eq!(runs.iter().map(|r| r.1).sum::<i64>(), 6026);
        assert_eq!(g.entry_rows, 7265);
    }

    fn pool(model: ModelShape, kv: KvDtype, idx: IndexerDtype) -> (PoolLayout, CheckpointLayout) {
        let l = PoolLayout::new(&model, kv, idx).unwrap();
        let c = CheckpointLayout::for_pool(&l).unwrap();
        (l, c)
    }

    #[test]
    fn section_6_image_sizes() {
        let (_, c) = pool(ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8);
        assert_eq!((c.image_bytes, c.units_per_checkpoint), (5_568_000, 6));
        assert_eq!(c.page_bytes, 1_063_168);
        // Plane 1 carries the four CSA fields as one range, then the windows.
        assert_eq!(c.plane_ranges[1][0], (0, 1_935_360));
        let (l, c) = pool(
            ModelShape::v4_flash_dspark(5, DraftMode::Absent).unwrap(),
            KvDtype::Bf16,
            IndexerDtype::Fp8,
        );
        assert_eq!(c.image_bytes, 9_060_352);
        assert_eq!(l.slot_bytes().unwrap(), 21_184_512);
        assert_eq!(c.units_per_checkpoint, 6);
        // CSA state, then the state window merged with the entry's first run.
        assert_eq!(c.plane_ranges[0][0], (0, 2_795_520));
        assert_eq!(c.plane_ranges[0][1].0, 13_690_880);
        // Dense drafts give the same image size: 3 × 133 window rows either way.
        let (_, d) =
            pool(ModelShape::v4_flash_dspark(5, DraftMode::Dense).unwrap(), KvDtype::Bf16, IndexerDtype::Fp8);
        assert_eq!(d.image_bytes, 9_060_352);
    }

    #[test]
    fn unit_parts_follow_section_6_order() {
        let (_, c) = pool(ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, IndexerDtype::Fp4);
        assert_eq!(c.unit_parts.len(), 2 + 2 * 21);
        assert_eq!(
            c.unit_parts[0],
            UnitPart { region: Region::Plane(0), base_per_nb: 0, block_stride: 708_608, bytes: 708_608 }
        );
        assert_eq!(c.unit_parts[1].bytes, 1384 * 128);
        assert_eq!(
            c.unit_parts[2],
            UnitPart { region: Region::Indexer(0), base_per_nb: 0, block_stride: 4096, bytes: 4096 }
        );
        assert_eq!(c.unit_parts[3].base_per_nb, 4096);
        assert_eq!(
            c.unit_parts[23],
            UnitPart { region: Region::Indexer(1), base_per_nb: 0, block_stride: 256, bytes: 256 }
        );
        assert_eq!(c.unit_parts[43].base_per_nb, 20 * 256);
        assert_eq!(c.page_bytes, 977_152);
    }

    #[test]
    fn store_plan_tiles_the_image_and_restore_reverses_it() {
        let (l, c) = pool(ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8);
        let g = l.carve(40, 4, (4 + 3) * l.geometry.slot_rows).unwrap();
        let units = [7, 3, 39, 0, 12, 25];
        let position = g.physical_slot(2).unwrap();
        let plan = c.store_plan(&g, position, &units, 50).unwrap();
        assert_eq!(plan.iter().map(|r| r.bytes).sum::<u64>(), c.image_bytes);
        // Sources: exactly the image ranges of the slot, in order.
        let slot_row = g.slot_span(position).unwrap().0 as u64;
        let mut srcs: Vec<(usize, u64, u64)> = Vec::new();
        for r in &plan {
            let Region::Plane(p) = r.src.region else { panic!("source outside the planes") };
            let off = r.src.offset - slot_row * c.widths[p];
            match srcs.last_mut() {
                Some(last) if last.0 == p && last.1 + last.2 == off => last.2 += r.bytes,
                _ => srcs.push((p, off, r.bytes)),
            }
        }
        let want: Vec<(usize, u64, u64)> = {
            let mut v: Vec<(usize, u64, u64)> = Vec::new();
            for (p, o, n) in c.image_segments() {
                match v.last_mut() {
                    Some(last) if last.0 == p && last.1 + last.2 == o => last.2 += n,
                    _ => v.push((p, o, n)),
                }
            }
            v
        };
        assert_eq!(srcs, want);
        // First destination: unit 7's plane-0 envelope; plane-0 envelope bytes are 708,608.
        assert_eq!(plan[0].dst, Loc { region: Region::Plane(0), offset: 7 * 708_608 });
        // Indexer destinations sit at (c × NB + block) × 8,448 with NB = 50.
        let idx: Vec<&RegionCopy> = plan.iter().filter(|r| r.dst.region == Region::Indexer(0)).collect();
        assert!(!idx.is_empty());
        for r in &idx {
            let block = (r.dst.offset / 8_448) % 50;
            assert!(units.contains(&(block as i64)));
        }
        // Destinations never overlap.
        let mut d: Vec<(Region, u64, u64)> =
            plan.iter().map(|r| (r.dst.region, r.dst.offset, r.bytes)).collect();
        d.sort_by_key(|&(reg, o, _)| (format!("{reg:?}"), o));
        assert!(d.windows(2).all(|w| w[0].0 != w[1].0 || w[0].1 + w[0].2 <= w[1].1));
        let back = c.restore_plan(&g, position, &units, 50).unwrap();
        assert_eq!(back.len(), plan.len());
        assert!(back.iter().zip(&plan).all(|(b, s)| b.src == s.dst && b.dst == s.src && b.bytes == s.bytes));
    }

    #[test]
    fn store_plan_refusals() {
        let (l, c) = pool(ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8);
        let g = l.carve(40, 4, 7 * l.geometry.slot_rows).unwrap();
        let p = g.physical_slot(0).unwrap();
        let e =
            |pos: i64, units: &[i64], nb: i64| c.store_plan(&g, pos, units, nb).unwrap_err().variant_name();
        assert_eq!(e(p, &[1, 2, 3], 40), "UnitCount");
        assert_eq!(e(p, &[1, 2, 3, 4, 5, 40], 40), "UnitOutOfRange");
        assert_eq!(e(p, &[1, 2, 3, 4, 5, -1], 40), "UnitOutOfRange");
        assert_eq!(e(p, &[1, 2, 3, 4, 5, 30], 30), "IndexerTooSmall");
        assert_eq!(e(p, &[1, 2, 3, 4, 5, 1], 40), "DuplicateUnit");
        assert_eq!(e(g.slot_positions - 5, &[1, 2, 3, 4, 5, 6], 40), "NotLive");
        let other =
            PoolLayout::new(&ModelShape::v4_flash(0).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8).unwrap();
        let g0 = other.carve(40, 4, 7 * other.geometry.slot_rows).unwrap();
        assert_eq!(
            c.store_plan(&g0, p, &[1, 2, 3, 4, 5, 6], 40).unwrap_err().variant_name(),
            "LayoutMismatch"
        );
    }

    #[test]
    fn layout_id_is_exact() {
        let l = PoolLayout::new(&ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8).unwrap();
        let flash_ratios = format!("0,0,{}4,0", "4,128,".repeat(20));
        assert_eq!(
            layout_id(&l).unwrap(),
            format!(
                "dsv4-paged-state-v3:block=256:ring=129:dims=512,64,128:state=(9, 1024),(9, 256),(129, 512)\
                 :main=fp8-2buff:index=fp8:ratios={flash_ratios}:nocopy=hca_main_kv,hca_main_score:entry=packed"
            )
        );
        let d = PoolLayout::new(
            &ModelShape::v4_pro_dspark(7, DraftMode::Absent).unwrap(),
            KvDtype::Bf16,
            IndexerDtype::Fp4,
        )
        .unwrap();
        let id = layout_id(&d).unwrap();
        assert!(id.contains(":ring=135:"));
        assert!(id.contains(":state=(15, 1024),(15, 256),(135, 512):main=bf16:index=fp4:"));
        assert!(id.contains(",4,-1,-1,-1:nocopy=hca_main_kv,hca_main_score:entry=packed"));
        assert!(!id.contains('\n'));
        assert_eq!(py_tuple(&[5]), "(5,)");
    }
}
