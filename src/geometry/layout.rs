//! The per-class pieces of the row space: the window-row formula a kernel carries
//! ([`WindowParams`]), one compress class's rows in an envelope and an entry ([`ClassLayout`]),
//! and the packed compressed-row widths ([`PackedRows`]).
//!
//! Separate from [`super::UnifiedPoolGeometry`] in the parent: these describe one class or one
//! row width; the parent composes them into a pool's planes, blocks and slots.

use super::{entry_rows_for, mul, ring_offset_for, GeometryError};
use crate::checked::gcd;
use bytemuck::{Pod, Zeroable};

/// A class's window-row formula as five scalars a kernel carries by value.
///
/// `#[repr(C)]`, five signed 64-bit fields in the spec's order; `kernels/v4pool_common.h`
/// declares the same struct and a test checks the two layouts agree.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct WindowParams {
    /// Row of position 0's ring run, relative to the layer view (slot 0).
    pub ring_start: i64,
    /// Rows from one slot to the next.
    pub slot_rows: i64,
    /// Ring positions (the window ring's length).
    pub ring_slots: i64,
    /// Ring positions per contiguous run.
    pub ring_stride: i64,
    /// Rows from one run of a layer to its next (the class's run height).
    pub run_rows: i64,
}

impl WindowParams {
    /// Row of absolute token position `pos` of physical slot `slot`, relative to the layer
    /// view's base; the wrap (`pos % ring_slots`) happens here. `pos >= 0`. Params come from
    /// a valid geometry, whose rows fit an i32, so the arithmetic cannot overflow for slots
    /// the geometry holds.
    #[inline]
    pub fn index(&self, slot: i64, pos: i64) -> i64 {
        let q = pos.rem_euclid(self.ring_slots);
        let (chunk, within) = (q / self.ring_stride, q % self.ring_stride);
        slot * self.slot_rows + self.ring_start + chunk * self.run_rows + within
    }
}

/// One compress class's rows, inside an envelope and inside an entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassLayout {
    /// The class's compress ratio.
    pub ratio: i32,
    /// Global layer ids in class order (ascending); a layer's position here is its
    /// `layer_index`.
    pub layers: Vec<usize>,
    /// The layers whose compressed rows an envelope holds, ascending: every layer of the
    /// class in the envelope form, the class's source layers in the compact form, none for
    /// the dense class.
    pub owners: Vec<usize>,
    /// Rows one block compresses to in one layer (`block_size / ratio`); also the class's
    /// layer stride in an envelope. 0 for the dense class.
    pub block_rows: i64,
    /// Ring positions per contiguous run.
    pub ring_stride: i64,
    /// Ring positions.
    pub ring_slots: i64,
    /// Row of the class's part in an envelope.
    pub envelope_offset: i64,
    /// Row of the class's window rows in an entry.
    pub entry_offset: i64,
    envelope_rows: i64,
    entry_rows: i64,
}

impl ClassLayout {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build(
        ratio: i32,
        layers: Vec<usize>,
        owners: Vec<usize>,
        block_rows: i64,
        ring_stride: i64,
        ring_slots: i64,
        envelope_offset: i64,
        entry_offset: i64,
    ) -> Result<Self, GeometryError> {
        let n = layers.len() as i64;
        Ok(ClassLayout {
            ratio,
            block_rows,
            ring_stride,
            ring_slots,
            envelope_offset,
            entry_offset,
            envelope_rows: mul(owners.len() as i64, block_rows, "class envelope rows")?,
            entry_rows: entry_rows_for(n, ring_stride, ring_slots)?,
            layers,
            owners,
        })
    }

    /// Row of `owner`'s compressed rows in an envelope.
    pub fn envelope_position(&self, owner: usize) -> Result<i64, GeometryError> {
        // `owners` ascends (a filter of the ascending `layers`): a search, not a scan, so the
        // per-layer loops over a geometry stay O(layers · log layers).
        let i = self
            .owners
            .binary_search(&owner)
            .map_err(|_| GeometryError::LayerNotInClass { layer: owner, ratio: self.ratio })?;
        Ok(self.envelope_offset + i as i64 * self.block_rows)
    }

    /// Layers of the class.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Rows this class takes in one envelope, across all its layers.
    pub fn envelope_rows(&self) -> i64 {
        self.envelope_rows
    }

    /// Rows this class's sliding windows take in one entry.
    pub fn entry_rows(&self) -> i64 {
        self.entry_rows
    }

    /// Position of `layer_id` in this class.
    pub fn layer_index(&self, layer_id: usize) -> Result<usize, GeometryError> {
        // `layers` ascends (layer ids in order): see `envelope_position`.
        self.layers
            .binary_search(&layer_id)
            .map_err(|_| GeometryError::LayerNotInClass { layer: layer_id, ratio: self.ratio })
    }

    /// The class's ring offset of ring position `ring_pos` (see [`ring_offset_for`]).
    pub fn ring_offset(&self, ring_pos: i64) -> i64 {
        // Cannot overflow: the class was built with its entry rows checked.
        ring_offset_for(self.layers.len() as i64, self.ring_stride, ring_pos).unwrap_or(i64::MAX)
    }

    /// Row of a window position, relative to the class's part of an entry.
    pub fn ring_row(&self, layer_index: usize, ring_pos: i64) -> i64 {
        layer_index as i64 * self.ring_stride + self.ring_offset(ring_pos)
    }

    /// Runs `(start, count)` of entry rows, relative to this class's part of the entry, that
    /// some (layer, ring position) maps to: the rows a checkpoint carries.
    pub fn entry_row_runs(&self) -> Vec<(i64, i64)> {
        let l = self.layers.len() as i64;
        let s = self.ring_stride;
        let (whole, partial) = (self.ring_slots / s, self.ring_slots % s);
        let height = l * s;
        let mut runs = Vec::with_capacity(1 + self.layers.len());
        if whole > 0 {
            runs.push((0, whole * height));
        }
        if partial > 0 {
            for i in 0..l {
                runs.push((whole * height + i * s, partial));
            }
        }
        runs
    }
}

/// Compressed rows narrower than the plane's rows (FlashMLA V4.1's 288-B fp4 rows beside its
/// 528-B window rows, open point O3): an envelope holds its compressed rows packed at their own
/// width, so a block costs `E′ × compressed` bytes, not `E′ × plane`, while every slot, the
/// boundary, and every unit a copy moves stay in plane rows. Compressed rows then form a second
/// lattice over the same plane bytes, the **compressed view**: compressed row `c` sits at byte
/// `c × compressed` from plane row 0, and a compressed index is absolute in it
/// (`block × compress_stride + envelope position of the owner + row`), not relative to a layer's
/// window view. Only widths matter here, not what the bytes mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackedRows {
    /// Bytes of one compressed row.
    pub compressed: i64,
    /// Bytes of one plane row (window, state).
    pub plane: i64,
}

impl PackedRows {
    /// Plane rows that hold a whole number of compressed rows: the lattices meet every
    /// `compressed / gcd` plane rows.
    pub(super) fn plane_period(self) -> i64 {
        self.compressed / gcd(self.compressed, self.plane)
    }
    /// Compressed rows in `plane_rows` plane rows, rounded down.
    pub(super) fn compressed_rows_in(self, plane_rows: i64) -> Result<i64, GeometryError> {
        Ok(mul(plane_rows, self.plane, "compressed rows")? / self.compressed)
    }
}
