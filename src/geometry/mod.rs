//! The row space: where every DeepSeek-V4 KV row lives, in rows rather than bytes.
//!
//! A port of the seed geometry module (`docs/geometry.md`), name for name, so the two read side by
//! side. Every quantity is an `i64` like the spec's Python ints; every check of the spec is a
//! [`GeometryError`] variant, and so is everything the spec leaves to chance (a zero or
//! indivisible block size, overflow, a plane too tall for an i32 index). No input panics.
//!
//! The row space of one plane:
//!
//! ```text
//! row 0                                                   plane_rows
//! ├─────────────────────────┬ gap ┬────────────────────┤
//! │ num_blocks envelopes    │     │ num_slots slots    │
//! │ (compressed history)    │     │ (state + windows)  │
//! └─────────────────────────┴─────┴────────────────────┘
//! ```
//!
//! Blocks grow up from row 0, slots down from the top; slot `j` sits at `j * slot_rows`
//! whatever the split is, so moving the boundary changes no address. This module knows
//! nothing of devices, bytes of a particular plane, or allocators.

mod class;
mod error;
mod layout;
mod owners;
mod runs;

pub use class::{Class, NUM_SLOTS};
pub use error::GeometryError;
pub use layout::{ClassLayout, PackedRows, WindowParams};
pub use owners::{index_slots, resolve_owners, visible_groups};
pub use runs::merge_abutting;

use crate::checked::{add, gcd, mul, sub};
use std::collections::BTreeMap;

crate::checked::overflow_into!(GeometryError);

/// Compress ratio of a dense (sliding-window-only) layer.
pub const DENSE_RATIO: i32 = 0;
/// Compress ratio of a CSA layer.
pub const CSA_RATIO: i32 = 4;
/// Compress ratio of an HCA layer.
pub const HCA_RATIO: i32 = 128;
/// Not a ratio: a layer whose KV this row space does not hold (a DSpark draft layer, whose
/// window is a state field instead). It never reaches `classes`.
pub const ABSENT_RATIO: i32 = -1;

/// V4's envelope order, what [`envelope_order`] gives for V4's ratios.
pub const ENVELOPE_ORDER: [i32; 2] = [HCA_RATIO, CSA_RATIO];
/// V4's entry order, what [`entry_order`] gives for V4's ratios.
pub const ENTRY_ORDER: [i32; 3] = [DENSE_RATIO, HCA_RATIO, CSA_RATIO];

/// The compressed classes of a ratio list in envelope order: distinct positive ratios,
/// largest first (the class with the fewest rows per block sits lowest). A pure function of
/// the list, so two runs of one model agree; for V4 it is [`ENVELOPE_ORDER`].
pub fn envelope_order(ratios: &[i32]) -> Vec<i32> {
    let mut order: Vec<i32> = ratios.iter().copied().filter(|&r| r > 0).collect();
    order.sort_unstable_by(|a, b| b.cmp(a));
    order.dedup();
    order
}

/// The classes of a ratio list in entry order: dense first (when present), then the
/// compressed classes in envelope order; for V4 it is [`ENTRY_ORDER`].
pub fn entry_order(ratios: &[i32]) -> Vec<i32> {
    let dense = ratios.contains(&DENSE_RATIO).then_some(DENSE_RATIO);
    dense.into_iter().chain(envelope_order(ratios)).collect()
}

/// Which compressed rows an envelope holds and how windows are anchored (`docs/v41.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RowForm {
    /// The seed's layout: every compressed layer's rows in every envelope, windows anchored
    /// at the layer's envelope rows. V4's form; with source layers it is the reference
    /// engine's form (readers' rows reserved, never written).
    #[default]
    Envelope,
    /// Owners only: an envelope holds the source layers' rows alone, every layer's window is
    /// one contiguous ring, and each compressed layer reaches its owner's rows by a bias.
    Compact,
}

/// Largest plane the attention kernels can index: they take int32 row indices.
pub const MAX_PLANE_ROWS: i64 = i32::MAX as i64;

/// A ratio the row space can hold: absent, dense, or any positive ratio (whether it divides
/// the block size is checked with the block size).
fn is_known_ratio(r: i32) -> bool {
    r == ABSENT_RATIO || r >= 0
}

/// Ceiling division of non-negative `a` by positive `b`.
fn ceil_div(a: i64, b: i64) -> i64 {
    a / b + i64::from(a % b != 0)
}

/// Row a class's `index`-th layer's view anchors at before the lead: its ring's start in
/// the dense class and the compact form (one ring of `ring_stride` rows per layer), its
/// compressed rows in the envelope form.
fn layer_anchor(cls: &ClassLayout, form: RowForm, index: usize) -> Result<i64, GeometryError> {
    let i = index as i64;
    Ok(if cls.ratio == DENSE_RATIO || form == RowForm::Compact {
        mul(i, cls.ring_stride, "base row")?
    } else {
        add(cls.envelope_offset, mul(i, cls.block_rows, "base row")?, "base row")?
    })
}

/// The layer-independent part of a window row, `f(q)`: the window is cut into
/// `ring_stride`-sized runs, each given the class's full height, and interleaved across the
/// class's layers. See the spec for why no two (layer, position) pairs collide.
///
/// Arguments must be non-negative with `ring_stride > 0`; overflow is an error.
pub fn ring_offset_for(num_layers: i64, ring_stride: i64, ring_pos: i64) -> Result<i64, GeometryError> {
    if ring_stride < 1 {
        return Err(GeometryError::RingStride { got: ring_stride });
    }
    let (chunk, within) = (ring_pos.div_euclid(ring_stride), ring_pos.rem_euclid(ring_stride));
    let height = mul(num_layers, ring_stride, "class run height")?;
    Ok(add(mul(chunk, height, "ring offset")?, within, "ring offset")?)
}

/// Height the interleaved construction reaches, which is also the least possible (the
/// residue-counting bound). `ring_slots >= 1`, `num_layers >= 1`.
pub fn entry_rows_for(num_layers: i64, ring_stride: i64, ring_slots: i64) -> Result<i64, GeometryError> {
    if ring_slots < 1 {
        return Err(GeometryError::RingSlots { got: ring_slots });
    }
    let last = ring_offset_for(num_layers, ring_stride, ring_slots - 1)?;
    let lead = mul(sub(num_layers, 1, "entry rows")?, ring_stride, "entry rows")?;
    Ok(add(add(lead, last, "entry rows")?, 1, "entry rows")?)
}

/// Every constructor argument of the spec's `UnifiedPoolGeometry`, with its defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GeometrySpec {
    /// Compress ratio of every layer (0, 4, 128, or −1 for absent).
    pub ratios: Vec<i32>,
    /// Blocks at the split.
    pub num_blocks: i64,
    /// Slots at the split.
    pub num_slots: i64,
    /// `win_with_spec`: the sliding window plus the draft lookahead.
    pub ring_slots: i64,
    /// Tokens per block.
    pub block_size: i64,
    /// Fixed plane capacity; `None` is the tight fit around the split (pins the boundary).
    pub plane_rows: Option<i64>,
    /// Rows off the front of each slot held by the compressor state.
    pub arena_rows: i64,
    /// Numbering of slot positions, when taken from a plane with more room.
    pub slot_positions: Option<i64>,
    /// Row multiple a slot is rounded up to.
    pub slot_align_rows: i64,
    /// Source layers (`kv_source_layer_ids`): whose compressed rows the other layers of a
    /// class read. `None` (V4): every compressed layer owns its rows.
    pub kv_sources: Option<Vec<usize>>,
    /// Which rows an envelope holds ([`RowForm::Compact`] needs `kv_sources`).
    pub form: RowForm,
    /// Row multiple an envelope is rounded up to (1: tight). A paged row format (FlashMLA's
    /// 64-row pages) sets its page so every block is whole pages: a block's bytes are then one
    /// contiguous range, the same range a uniform-row plane gives, for every copy that moves it.
    pub envelope_align_rows: i64,
    /// Compressed rows packed at their own width ([`PackedRows`]; `None`: plane rows).
    pub packed_rows: Option<PackedRows>,
}

impl GeometrySpec {
    /// The spec's defaults: tight plane, no arena, positions from the plane, alignment 2.
    pub fn new(ratios: Vec<i32>, num_blocks: i64, num_slots: i64, ring_slots: i64, block_size: i64) -> Self {
        GeometrySpec {
            ratios,
            num_blocks,
            num_slots,
            ring_slots,
            block_size,
            plane_rows: None,
            arena_rows: 0,
            slot_positions: None,
            slot_align_rows: 2,
            kv_sources: None,
            form: RowForm::Envelope,
            envelope_align_rows: 1,
            packed_rows: None,
        }
    }
    /// Pack compressed rows at `compressed` bytes in a plane of `plane`-byte rows (see
    /// [`PackedRows`]; the compact form only).
    pub fn packed_rows(mut self, compressed: i64, plane: i64) -> Self {
        self.packed_rows = Some(PackedRows { compressed, plane });
        self
    }
    /// Round every envelope up to a multiple of `rows` (see the field).
    pub fn envelope_align_rows(mut self, rows: i64) -> Self {
        self.envelope_align_rows = rows;
        self
    }
    /// Layers read the compressed rows of these source layers (V4.1's shared compressors).
    pub fn kv_sources(mut self, sources: Vec<usize>) -> Self {
        self.kv_sources = Some(sources);
        self
    }
    /// Layers share compressors as V4.1 lays them out: `sources` in the compact form. An
    /// empty list leaves the spec as it is (V4: every compressed layer owns its rows, the
    /// envelope form). What a model's spec and a bare ratio list with sources both use.
    pub fn shared_compressors(self, sources: Vec<usize>) -> Self {
        if sources.is_empty() {
            self
        } else {
            self.kv_sources(sources).form(RowForm::Compact)
        }
    }
    /// Lay the envelope out in `form`.
    pub fn form(mut self, form: RowForm) -> Self {
        self.form = form;
        self
    }
    /// Fix the plane's rows (default: exactly what the counts need).
    pub fn plane_rows(mut self, rows: i64) -> Self {
        self.plane_rows = Some(rows);
        self
    }
    /// Rows of compressor state at the head of each slot.
    pub fn arena_rows(mut self, rows: i64) -> Self {
        self.arena_rows = rows;
        self
    }
    /// Number slots by this many positions (default: what the plane holds).
    pub fn slot_positions(mut self, positions: i64) -> Self {
        self.slot_positions = Some(positions);
        self
    }
    /// Round slot rows up to a multiple of this.
    pub fn slot_align_rows(mut self, rows: i64) -> Self {
        self.slot_align_rows = rows;
        self
    }
    /// Check the spec and lay the row space out.
    pub fn build(self) -> Result<UnifiedPoolGeometry, GeometryError> {
        UnifiedPoolGeometry::new(self)
    }
}

/// The row space, and every address formula that reads from it. Sole owner of the
/// arithmetic: allocation, view binding, the kernels and their references all take their
/// offsets from here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedPoolGeometry {
    /// Compress ratio of every layer (0, 4, 128, or −1 for absent).
    pub ratios: Vec<i32>,
    /// Layers (`ratios.len()`).
    pub num_layers: usize,
    /// Blocks at the split.
    pub num_blocks: i64,
    /// Slots at the split.
    pub num_slots: i64,
    /// Ring positions of the window ring.
    pub ring_slots: i64,
    /// Tokens per block.
    pub block_size: i64,
    /// Rows of compressor state at the head of a slot.
    pub arena_rows: i64,
    /// Slot rows are a multiple of this.
    pub slot_align_rows: i64,
    /// Envelope rows are a multiple of this (1: tight).
    pub envelope_align_rows: i64,
    /// Rows of one block's envelope (every compressed layer), rounded up to
    /// `envelope_align_rows`.
    pub envelope_rows: i64,
    /// Rows of one slot's entry (every layer's window rows).
    pub entry_rows: i64,
    /// Rows of one slot: arena plus entry, aligned.
    pub slot_rows: i64,
    /// Rows of the plane (fixed for the pool's life).
    pub plane_rows: i64,
    /// Slot positions the plane is numbered by (the most slots it holds).
    pub slot_positions: i64,
    /// Position numbering's origin (0 in a pool).
    pub slot_origin: i64,
    /// Present classes keyed by ratio (dense 0, then any positive ratio).
    pub classes: BTreeMap<i32, ClassLayout>,
    /// Compressed classes, envelope order ([`envelope_order`] of the ratios).
    pub envelope_order: Vec<i32>,
    /// Classes, entry order ([`entry_order`] of the ratios).
    pub entry_order: Vec<i32>,
    /// Source layers, when layers share compressors.
    pub kv_sources: Option<Vec<usize>>,
    /// Which rows an envelope holds.
    pub form: RowForm,
    /// Every layer's owner: the layer whose compressed rows it reads (`None` for dense and
    /// absent layers).
    pub owners: Vec<Option<usize>>,
    /// Every layer's compress bias: what a compressed index adds to `block × envelope_rows +
    /// row` to reach the owner's row, relative to the layer's view (0 for V4; never negative,
    /// the view lead absorbing what would be).
    pub compress_bias: Vec<i64>,
    /// Rows below plane row 0 that layer views may start in (0 for V4): views are moved
    /// down by this much so that no compressed index is negative (open point O1, decided in
    /// `docs/v41.md`). Nothing is ever written there; the pool allocates them in front of
    /// the plane.
    pub view_lead_rows: i64,
    /// Compressed rows packed at their own width, if they are ([`PackedRows`]).
    pub packed_rows: Option<PackedRows>,
    /// Compressed rows from one block's to the next: `envelope_rows`, or with packed rows the
    /// compressed rows an envelope's bytes hold (`envelope_rows × plane / compressed`).
    pub compress_stride: i64,
}

impl UnifiedPoolGeometry {
    /// Build and check a geometry; see [`GeometrySpec`] for the arguments.
    pub fn new(spec: GeometrySpec) -> Result<Self, GeometryError> {
        let GeometrySpec {
            ratios,
            num_blocks,
            num_slots,
            ring_slots,
            block_size,
            plane_rows,
            arena_rows,
            slot_positions,
            slot_align_rows,
            kv_sources,
            form,
            envelope_align_rows,
            packed_rows,
        } = spec;
        if ratios.is_empty() {
            return Err(GeometryError::NoLayers);
        }
        let mut unknown: Vec<i32> = ratios.iter().copied().filter(|&r| !is_known_ratio(r)).collect();
        if !unknown.is_empty() {
            unknown.sort_unstable();
            unknown.dedup();
            return Err(GeometryError::UnknownRatios { ratios: unknown });
        }
        if slot_align_rows < 1 {
            return Err(GeometryError::SlotAlignRows { got: slot_align_rows });
        }
        if envelope_align_rows < 1 {
            return Err(GeometryError::EnvelopeAlignRows { got: envelope_align_rows });
        }
        if ring_slots < 1 {
            return Err(GeometryError::RingSlots { got: ring_slots });
        }
        if arena_rows < 0 {
            return Err(GeometryError::ArenaRows { got: arena_rows });
        }
        for (what, got) in [("num_blocks", num_blocks), ("num_slots", num_slots)] {
            if got < 0 {
                return Err(GeometryError::NegativeCount { what, got });
            }
        }
        if let Some(p) = plane_rows {
            if p < 0 {
                return Err(GeometryError::NegativeCount { what: "plane_rows", got: p });
            }
        }
        if block_size < 1 {
            return Err(GeometryError::BlockSize { block_size });
        }
        let layers_of = |ratio: i32| -> Vec<usize> {
            ratios.iter().enumerate().filter(|&(_, &r)| r == ratio).map(|(i, _)| i).collect()
        };
        let envelope_order = envelope_order(&ratios);
        let entry_order = entry_order(&ratios);
        for &ratio in &envelope_order {
            if block_size % i64::from(ratio) != 0 {
                return Err(GeometryError::BlockSizeNotDivisible { block_size, ratio });
            }
        }
        let owners = match &kv_sources {
            Some(sources) => resolve_owners(&ratios, sources)?,
            None => ratios.iter().enumerate().map(|(l, &r)| (r > 0).then_some(l)).collect(),
        };
        if form == RowForm::Compact && kv_sources.is_none() {
            return Err(GeometryError::CompactWithoutSources);
        }
        if let Some(p) = packed_rows {
            if p.compressed < 1 || p.plane < 1 {
                return Err(GeometryError::PackedRowBytes { compressed: p.compressed, plane: p.plane });
            }
            // The envelope form interleaves a class's windows at its block-row stride, so its
            // compressed rows and window rows share rows: one width.
            if form != RowForm::Compact {
                return Err(GeometryError::PackedNeedsCompact);
            }
        }
        let block_rows_of = |ratio: i32| if ratio == DENSE_RATIO { 0 } else { block_size / i64::from(ratio) };
        // The envelope form interleaves a compressed class's windows at its block-row
        // stride (the seed's construction); the compact form and the dense class keep each
        // layer's ring contiguous.
        let stride_of = |ratio: i32| {
            if ratio == DENSE_RATIO || form == RowForm::Compact {
                ring_slots
            } else {
                block_size / i64::from(ratio)
            }
        };
        // The layers whose rows an envelope holds.
        let owners_of = |ratio: i32| -> Vec<usize> {
            match form {
                _ if ratio <= 0 => Vec::new(),
                RowForm::Envelope => layers_of(ratio),
                RowForm::Compact => layers_of(ratio).into_iter().filter(|&l| owners[l] == Some(l)).collect(),
            }
        };

        // Both orders are walked before any layout is built, so each class learns its
        // offset in the envelope and in the entry at once.
        let mut envelope_offsets = BTreeMap::new();
        let mut cursor = 0i64;
        for &ratio in &envelope_order {
            envelope_offsets.insert(ratio, cursor);
            let n = owners_of(ratio).len() as i64;
            cursor = add(cursor, mul(n, block_rows_of(ratio), "envelope rows")?, "envelope rows")?;
        }
        // Rows past the last class are padding no index reaches (a paged format's page tail).
        // Packed, the envelope is the plane rows its compressed rows' bytes need, rounded to
        // where the two lattices meet, so every block starts on a compressed row too.
        let (envelope_rows, compress_stride) = match packed_rows {
            None => {
                let e = mul(ceil_div(cursor, envelope_align_rows), envelope_align_rows, "envelope rows")?;
                (e, e)
            }
            Some(p) => {
                let bytes = mul(cursor, p.compressed, "envelope bytes")?;
                let period = p.plane_period();
                let align =
                    mul(period / gcd(period, envelope_align_rows), envelope_align_rows, "envelope rows")?;
                let e = mul(ceil_div(ceil_div(bytes, p.plane), align), align, "envelope rows")?;
                (e, mul(e, p.plane, "compress stride")? / p.compressed)
            }
        };
        let mut classes = BTreeMap::new();
        cursor = 0;
        for &ratio in &entry_order {
            let class = ClassLayout::build(
                ratio,
                layers_of(ratio),
                owners_of(ratio),
                block_rows_of(ratio),
                stride_of(ratio),
                ring_slots,
                envelope_offsets.get(&ratio).copied().unwrap_or(0),
                cursor,
            )?;
            cursor = add(cursor, class.entry_rows(), "entry rows")?;
            classes.insert(ratio, class);
        }
        let entry_rows = cursor;

        // Where each layer's view would anchor with no lead (the spec's base row), and the
        // bias from there to the owner's rows; the most negative bias becomes the lead.
        let mut anchors = vec![0i64; ratios.len()];
        let mut spec_bias = vec![0i64; ratios.len()];
        for cls in classes.values() {
            for (i, &l) in cls.layers.iter().enumerate() {
                anchors[l] = layer_anchor(cls, form, i)?;
                if let Some(owner) = owners[l] {
                    spec_bias[l] = sub(cls.envelope_position(owner)?, anchors[l], "compress bias")?;
                }
            }
        }
        let view_lead_rows = match packed_rows {
            // Packed compressed indices are absolute in the compressed view: never negative.
            Some(_) => 0,
            None => spec_bias
                .iter()
                .copied()
                .min()
                .unwrap_or(0)
                .min(0)
                .checked_neg()
                .ok_or(GeometryError::Overflow { what: "view lead rows" })?,
        };
        let compress_bias: Vec<i64> = match packed_rows {
            // The owner's envelope position, in compressed rows.
            Some(_) => ratios
                .iter()
                .zip(spec_bias.iter().zip(&anchors))
                .map(|(&r, (&b, &a))| if r > 0 { b + a } else { 0 })
                .collect(),
            None => ratios
                .iter()
                .zip(&spec_bias)
                .map(|(&r, &b)| if r > 0 { b + view_lead_rows } else { 0 })
                .collect(),
        };

        // A slot's start is the one address the compressor state's alignment rests on, so
        // the slot (not the window) is rounded up.
        let rows = add(arena_rows, entry_rows, "slot rows")?;
        let slot_rows = mul(ceil_div(rows, slot_align_rows), slot_align_rows, "slot rows")?;
        if slot_rows == 0 {
            return Err(GeometryError::EmptySlot);
        }
        let block_region = mul(num_blocks, envelope_rows, "block region rows")?;
        let plane_rows = match plane_rows {
            Some(p) => p,
            None => {
                let whole = add(num_slots, ceil_div(block_region, slot_rows), "plane rows")?;
                mul(whole, slot_rows, "plane rows")?
            }
        };
        // Whole slots the plane holds; the remainder under one slot at the top is the only
        // waste the layout carries.
        let held = plane_rows / slot_rows;
        let too_small = num_slots > held || mul(held - num_slots, slot_rows, "plane rows")? < block_region;
        if too_small {
            return Err(GeometryError::PlaneTooSmall {
                plane_rows,
                num_blocks,
                envelope_rows,
                num_slots,
                slot_rows,
            });
        }
        // A view reaches from its base (possibly in the lead) to the plane's end.
        if add(plane_rows, view_lead_rows, "plane rows")? > MAX_PLANE_ROWS {
            return Err(GeometryError::PlaneExceedsI32 { plane_rows: plane_rows + view_lead_rows });
        }
        // The compressed view's indices are i32 too.
        if let Some(rows) = packed_rows.map(|p| p.compressed_rows_in(plane_rows)).transpose()? {
            if rows > MAX_PLANE_ROWS {
                return Err(GeometryError::CompressedViewExceedsI32 { compressed_rows: rows, plane_rows });
            }
        }
        let slot_positions_v = slot_positions.unwrap_or(held);
        // Positions this plane does not reach, because it took its numbering from one with
        // more room; subtracted back out of every row it computes.
        let slot_origin = sub(slot_positions_v, held, "slot origin")?;
        if slot_origin < 0 {
            return Err(GeometryError::SlotPositionsTooFew {
                plane_rows,
                held,
                slot_positions: slot_positions_v,
            });
        }
        // The origin shift enters every window row; make sure it is representable.
        mul(slot_origin, slot_rows, "slot origin rows")?;

        Ok(UnifiedPoolGeometry {
            num_layers: ratios.len(),
            ratios,
            num_blocks,
            num_slots,
            ring_slots,
            block_size,
            arena_rows,
            slot_align_rows,
            envelope_align_rows,
            envelope_rows,
            entry_rows,
            slot_rows,
            plane_rows,
            slot_positions: slot_positions_v,
            slot_origin,
            classes,
            envelope_order,
            entry_order,
            kv_sources,
            form,
            owners,
            compress_bias,
            view_lead_rows,
            packed_rows,
            compress_stride,
        })
    }

    /// The same layout at a different split (the spec's `with_capacity`: positions are
    /// re-derived from the new plane, as the spec does).
    pub fn with_capacity(
        &self,
        num_blocks: i64,
        num_slots: i64,
        plane_rows: Option<i64>,
    ) -> Result<UnifiedPoolGeometry, GeometryError> {
        UnifiedPoolGeometry::new(GeometrySpec {
            ratios: self.ratios.clone(),
            num_blocks,
            num_slots,
            ring_slots: self.ring_slots,
            block_size: self.block_size,
            plane_rows,
            arena_rows: self.arena_rows,
            slot_positions: None,
            slot_align_rows: self.slot_align_rows,
            kv_sources: self.kv_sources.clone(),
            form: self.form,
            envelope_align_rows: self.envelope_align_rows,
            packed_rows: self.packed_rows,
        })
    }

    /// The spec's constructor arguments that reproduce this geometry.
    pub fn spec(&self) -> GeometrySpec {
        GeometrySpec {
            ratios: self.ratios.clone(),
            num_blocks: self.num_blocks,
            num_slots: self.num_slots,
            ring_slots: self.ring_slots,
            block_size: self.block_size,
            plane_rows: Some(self.plane_rows),
            arena_rows: self.arena_rows,
            slot_positions: Some(self.slot_positions),
            slot_align_rows: self.slot_align_rows,
            kv_sources: self.kv_sources.clone(),
            form: self.form,
            envelope_align_rows: self.envelope_align_rows,
            packed_rows: self.packed_rows,
        }
    }

    // ---- byte helpers (64-bit: a plane's bytes pass 2^32) ----------------------------

    /// Bytes of the plane at `row_bytes` per row.
    pub fn plane_bytes(&self, row_bytes: u64) -> u64 {
        self.plane_rows as u64 * row_bytes
    }
    /// Bytes one block costs in a plane of this row width.
    pub fn block_bytes(&self, row_bytes: u64) -> u64 {
        self.envelope_rows as u64 * row_bytes
    }
    /// Bytes one request costs in a plane of this row width: state and windows.
    pub fn slot_bytes(&self, row_bytes: u64) -> u64 {
        self.slot_rows as u64 * row_bytes
    }

    // ---- addressing -------------------------------------------------------------------

    /// Present class by ratio, or `None`.
    pub fn class(&self, ratio: i32) -> Option<&ClassLayout> {
        self.classes.get(&ratio)
    }

    /// The class layer `layer_id` belongs to.
    pub fn layer_class(&self, layer_id: usize) -> Result<&ClassLayout, GeometryError> {
        let ratio = *self
            .ratios
            .get(layer_id)
            .ok_or(GeometryError::LayerOutOfRange { layer: layer_id, num_layers: self.num_layers })?;
        if ratio == ABSENT_RATIO {
            return Err(GeometryError::AbsentLayer { layer: layer_id });
        }
        self.classes.get(&ratio).ok_or(GeometryError::NoSuchClass { ratio })
    }

    /// Row a layer's view anchors at; the view runs from there to the plane's end. Below 0
    /// (down to `-view_lead_rows`) when the geometry has a view lead.
    pub fn layer_base_row(&self, layer_id: usize) -> Result<i64, GeometryError> {
        let cls = self.layer_class(layer_id)?;
        let index = cls.layer_index(layer_id)?;
        Ok(layer_anchor(cls, self.form, index)? - self.view_lead_rows)
    }

    /// Where a layer's view starts in pages of `page_rows` rows (an attention kernel reading
    /// pages: FlashMLA's `[pages, page_rows, 1, row_bytes]`): the first row of the page holding
    /// the view's base row, and the base's place in that page, the **page shift** every index
    /// of the view takes there. `None` for a view starting in the lead (below row 0, no page
    /// holds it) or a page of no rows. Layers whose bases differ by whole pages share a shift,
    /// so one index buffer serves them (V4's HCA layers, 2 rows apart: one shift in pages of
    /// 2, twenty in pages of 64).
    pub fn layer_page(&self, layer_id: usize, page_rows: i64) -> Result<Option<(i64, i64)>, GeometryError> {
        let base = self.layer_base_row(layer_id)?;
        if base < 0 || page_rows < 1 {
            return Ok(None);
        }
        let first = base / page_rows * page_rows;
        Ok(Some((first, base - first)))
    }

    /// Plane rows a pool allocates per plane: the lead below row 0, then the plane.
    pub fn allocation_rows(&self) -> i64 {
        self.plane_rows + self.view_lead_rows
    }

    /// The layer whose compressed rows `layer_id` reads (itself in V4).
    pub fn owner(&self, layer_id: usize) -> Result<usize, GeometryError> {
        let cls = self.layer_class(layer_id)?;
        if cls.ratio == DENSE_RATIO {
            return Err(GeometryError::DenseHasNoCompressed { layer: layer_id });
        }
        self.owners[layer_id].ok_or(GeometryError::DenseHasNoCompressed { layer: layer_id })
    }

    /// The layer's compress bias (see [`UnifiedPoolGeometry::compress_bias`]); refused for
    /// dense and absent layers.
    pub fn layer_compress_bias(&self, layer_id: usize) -> Result<i64, GeometryError> {
        self.owner(layer_id)?;
        Ok(self.compress_bias[layer_id])
    }

    /// The layers owning index keys, in order (the indexer cache's layers): with KV sources
    /// (V4.1) the sources, whose compressed latent the index keys derive from (O8: one plane
    /// per KV owner; re-index layers read their owner's); else V4's ratio-4 (CSA) layers.
    pub fn index_key_layers(&self) -> Vec<usize> {
        match &self.kv_sources {
            Some(sources) => sources.clone(),
            None => (0..self.num_layers).filter(|&l| self.ratios[l] == CSA_RATIO).collect(),
        }
    }

    /// Rows a layer's view spans: its base to the end of the plane.
    pub fn layer_view_rows(&self, layer_id: usize) -> Result<i64, GeometryError> {
        Ok(self.plane_rows - self.layer_base_row(layer_id)?)
    }

    /// Index of a compressed row of block `block` as layer `layer_id` reads it: its owner's
    /// row, relative to the layer's own view (`block × envelope_rows + row + bias`; the bias
    /// is 0 in V4, so no layer term).
    pub fn compress_index(&self, layer_id: usize, block: i64, row: i64) -> Result<i64, GeometryError> {
        let cls = self.layer_class(layer_id)?;
        if cls.ratio == DENSE_RATIO {
            return Err(GeometryError::DenseHasNoCompressed { layer: layer_id });
        }
        if !(0..cls.block_rows).contains(&row) {
            return Err(GeometryError::CompressRowOutOfRange {
                row,
                block_rows: cls.block_rows,
                ratio: cls.ratio,
            });
        }
        if !(0..self.num_blocks).contains(&block) {
            return Err(GeometryError::BlockOutOfRange { block, num_blocks: self.num_blocks });
        }
        Ok(block * self.compress_stride + row + self.compress_bias[layer_id])
    }

    /// Rows of the view compressed indices are rows of, for `layer_id`: its layer view
    /// ([`Self::layer_view_rows`]), or with packed rows the compressed view over the whole
    /// plane (plane row 0 on, at the compressed width).
    pub fn compressed_view_rows(&self, layer_id: usize) -> Result<i64, GeometryError> {
        match self.compressed_plane_rows()? {
            None => self.layer_view_rows(layer_id),
            Some(rows) => {
                self.layer_class(layer_id)?;
                Ok(rows)
            }
        }
    }

    /// With packed rows, the compressed rows the plane holds (the compressed view's rows, the
    /// same for every layer); `None` without.
    pub fn compressed_plane_rows(&self) -> Result<Option<i64>, GeometryError> {
        self.packed_rows.map(|p| p.compressed_rows_in(self.plane_rows)).transpose()
    }

    /// Index of a sliding-window row, relative to the layer's own base.
    pub fn window_index(&self, layer_id: usize, slot: i64, ring_pos: i64) -> Result<i64, GeometryError> {
        if !(0..self.ring_slots).contains(&ring_pos) {
            return Err(GeometryError::RingPosOutOfRange { ring_pos, ring_slots: self.ring_slots });
        }
        self.check_position(slot)?;
        let ratio = self.layer_class(layer_id)?.ratio;
        Ok(self.window_params(ratio)?.index(slot, ring_pos))
    }

    /// A class's window formula as five by-value scalars. Moving the boundary changes
    /// nothing here; only `plane_rows` (through `slot_positions`) must stay fixed.
    pub fn window_params(&self, ratio: i32) -> Result<WindowParams, GeometryError> {
        let cls = self.classes.get(&ratio).ok_or(GeometryError::NoSuchClass { ratio })?;
        // Layer i's view sits `anchor(i) - anchor(0)` rows above the class's first layer's,
        // which is its ring's layer term; the lead moves every view down, so rows move up.
        let anchor = layer_anchor(cls, self.form, 0)?;
        Ok(WindowParams {
            ring_start: self.arena_rows + cls.entry_offset - anchor + self.view_lead_rows
                - self.slot_origin * self.slot_rows,
            slot_rows: self.slot_rows,
            ring_slots: self.ring_slots,
            ring_stride: cls.ring_stride,
            run_rows: cls.num_layers() as i64 * cls.ring_stride,
        })
    }

    /// A window that lives in a state field (a DSpark draft layer), counted in rows of the
    /// plane retyped to `rows_per_window_row` plane rows per window row.
    pub fn field_window_params(
        &self,
        field_offset_rows: i64,
        rows_per_window_row: i64,
    ) -> Result<WindowParams, GeometryError> {
        if rows_per_window_row < 1 {
            return Err(GeometryError::RowsPerWindowRow { got: rows_per_window_row });
        }
        if field_offset_rows < 0 {
            return Err(GeometryError::NegativeCount { what: "field_offset_rows", got: field_offset_rows });
        }
        for (name, rows) in [("slot", self.slot_rows), ("field offset", field_offset_rows)] {
            if rows % rows_per_window_row != 0 {
                return Err(GeometryError::FieldNotDivisible { name, rows, rows_per_window_row });
            }
        }
        let slot_rows = self.slot_rows / rows_per_window_row;
        Ok(WindowParams {
            ring_start: field_offset_rows / rows_per_window_row - self.slot_origin * slot_rows,
            slot_rows,
            ring_slots: self.ring_slots,
            // One run: a field's ring is contiguous.
            ring_stride: self.ring_slots,
            run_rows: self.ring_slots,
        })
    }

    /// Where pool group `group` sits in the plane: the only place groups and positions meet.
    pub fn physical_slot(&self, group: i64) -> Result<i64, GeometryError> {
        if !(0..self.num_slots).contains(&group) {
            return Err(GeometryError::GroupOutOfRange { group, num_slots: self.num_slots });
        }
        Ok(self.slot_positions - 1 - group)
    }

    /// `[start, stop)` plane rows a slot position occupies, state and windows.
    pub fn slot_span(&self, slot: i64) -> Result<(i64, i64), GeometryError> {
        self.check_position(slot)?;
        let start = (slot - self.slot_origin) * self.slot_rows;
        Ok((start, start + self.slot_rows))
    }

    /// `[start, stop)` plane rows holding a slot position's compressor state.
    pub fn arena_span(&self, slot: i64) -> Result<(i64, i64), GeometryError> {
        let (start, _) = self.slot_span(slot)?;
        Ok((start, start + self.arena_rows))
    }

    /// Plane row an index reaches: what the two address spaces share.
    pub fn absolute_row(&self, layer_id: usize, index: i64) -> Result<i64, GeometryError> {
        Ok(add(self.layer_base_row(layer_id)?, index, "absolute row")?)
    }

    /// Entry rows some (layer, ring position) maps to, as merged `(start, count)` runs in
    /// entry coordinates: classes in entry order, each shifted by its entry offset.
    pub fn entry_row_runs(&self) -> Vec<(i64, i64)> {
        let mut all = Vec::new();
        for &ratio in &self.entry_order {
            if let Some(cls) = self.classes.get(&ratio) {
                all.extend(cls.entry_row_runs().into_iter().map(|(s, c)| (s + cls.entry_offset, c)));
            }
        }
        // Class parts are disjoint and in entry order, so the runs ascend without overlap.
        merge_abutting(&all).unwrap_or(all)
    }

    /// The positions a plane this size holds that the pool does not use for slots: those
    /// below `slot_positions - num_slots`. Position `j` is a valid argument iff
    /// `slot_origin <= j < slot_positions`.
    fn check_position(&self, slot: i64) -> Result<(), GeometryError> {
        if !(self.slot_origin..self.slot_positions).contains(&slot) {
            return Err(GeometryError::SlotOutOfRange {
                slot,
                first: self.slot_origin,
                end: self.slot_positions,
            });
        }
        Ok(())
    }

    /// Positions that are the pool's slots now: `slot_positions - num_slots .. slot_positions`.
    pub fn live_positions(&self) -> std::ops::Range<i64> {
        self.slot_positions - self.num_slots..self.slot_positions
    }

    /// Largest block count the plane holds beside `num_slots` slots (0 when the slots alone
    /// do not fit; `i64::MAX` when blocks take no rows). Unsigned, so no count is negative.
    pub fn max_blocks_beside(&self, num_slots: u32) -> i64 {
        let num_slots = i64::from(num_slots);
        let held = self.plane_rows / self.slot_rows;
        if num_slots > held || self.envelope_rows == 0 {
            return if num_slots > held { 0 } else { i64::MAX };
        }
        (held - num_slots) * self.slot_rows / self.envelope_rows
    }
}
