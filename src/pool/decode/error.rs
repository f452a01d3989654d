//! What the decode (and prefill) index path refuses: [`DecodeError`] and its variant names.
//!
//! Separate because the error is shared by every staging and build check of both paths and
//! is long (one variant per rule), which buried the buffers' code in the parent.

use crate::backend::BackendError;
use crate::geometry::{Class, GeometryError};
use crate::index::DevicePtr;
use crate::pool::PoolError;
use thiserror::Error;

crate::variant::variant_names! {
/// What the decode path refuses.
#[derive(Debug, Error)]
pub enum DecodeError {
    /// More sequences than the buffers hold.
    #[error("batch of {got} sequences exceeds the {cap} the buffers were sized for")]
    TooManySeqs {
        /// Sequences asked for.
        got: usize,
        /// `max_seqs`.
        cap: usize,
    },
    /// More tokens than the buffers hold (or a token count that overflows).
    #[error("batch of {got} tokens exceeds the {cap} the buffers were sized for")]
    TooManyTokens {
        /// Tokens asked for (saturated at `usize::MAX` when the sum overflows).
        got: usize,
        /// `max_tokens`.
        cap: usize,
    },
    /// A block table longer than the buffers' columns.
    #[error("sequence {seq}: block table of {got} columns exceeds {cap}")]
    BlockTableTooLong {
        /// Sequence (batch row).
        seq: usize,
        /// Columns asked for.
        got: usize,
        /// `max_blocks_per_seq`.
        cap: usize,
    },
    /// A block table shorter than the context needs.
    #[error("sequence {seq}: context {context_len} needs {needed} blocks, its table has {got}")]
    BlockTableTooShort {
        /// Sequence (batch row).
        seq: usize,
        /// Its context length.
        context_len: i64,
        /// Blocks the context needs.
        needed: i64,
        /// Columns given.
        got: usize,
    },
    /// A context the buffers or the pool cannot index.
    #[error("sequence {seq}: context {context_len} is more than the {limit} tokens {why}")]
    ContextTooLong {
        /// Sequence (batch row).
        seq: usize,
        /// Its context length.
        context_len: i64,
        /// The most tokens allowed.
        limit: i64,
        /// What sets the limit.
        why: &'static str,
    },
    /// A sequence with no tokens, a negative context, or more tokens than context.
    #[error("sequence {seq}: {num_tokens} tokens with context {context_len}")]
    BadSequence {
        /// Sequence (batch row).
        seq: usize,
        /// Its token count.
        num_tokens: usize,
        /// Its context length.
        context_len: i64,
    },
    /// A position that is not a live slot of the pool.
    #[error("sequence {seq}: position {position} outside the pool's live slot positions {first}..{end}")]
    BadPosition {
        /// Sequence (batch row).
        seq: usize,
        /// The position given.
        position: i64,
        /// First live position.
        first: i64,
        /// One past the last live position.
        end: i64,
    },
    /// A block id outside the pool's block region.
    #[error("sequence {seq}: block id {block} at column {column} outside the pool's blocks 0..{num_blocks}")]
    BadBlock {
        /// Sequence (batch row).
        seq: usize,
        /// Column of the table.
        column: usize,
        /// The id given.
        block: i32,
        /// Blocks the pool has now.
        num_blocks: i64,
    },
    /// A staged block id the build would read is no longer in the pool's block region (the
    /// boundary moved after staging): restage with the moved ids.
    #[error("sequence {seq}: staged block id {block} is outside the pool's blocks 0..{num_blocks} now")]
    StaleBlock {
        /// Sequence (batch row).
        seq: usize,
        /// The highest staged id the build reads for it.
        block: i32,
        /// Blocks the pool has now.
        num_blocks: i64,
    },
    /// A window outside the ring.
    #[error("window {win} must be in 1..={ring_slots} (the ring)")]
    BadWindow {
        /// `win` asked for.
        win: i32,
        /// The geometry's ring.
        ring_slots: i64,
    },
    /// A zero capacity.
    #[error("{what} must be positive")]
    ZeroCapacity {
        /// Which capacity.
        what: &'static str,
    },
    /// A negative top-k.
    #[error("index_topk {0} must not be negative")]
    NegativeTopk(i32),
    /// A class the geometry lacks.
    #[error("the geometry lacks the {0} class this buffer needs")]
    MissingClass(Class),
    /// A path that does not yet build a geometry whose layers share compressors (V4.1).
    #[error("the {path} path does not build layers that share compressors (V4.1) yet")]
    SharedCompressors {
        /// The path.
        path: &'static str,
    },
    /// The one-CSA-buffer pack of a geometry whose layers share compressors: each layer
    /// packs with its own compress bias ([`crate::pool::DecodePath::layer_pack`]).
    #[error("layers share compressors here: pack per layer (layer_pack), each with its bias")]
    PackNeedsLayer,
    /// A layer no translate-pack fills: window-only, absent, or V4's coarse class (its heads
    /// are the builder's).
    #[error("layer {layer} is not filled by a translate-pack")]
    NotPacked {
        /// The layer.
        layer: usize,
    },
    /// Buffers whose sizes overflow (a byte count past `u64`, or an index past `i32`).
    #[error("capacity too large: {what} overflows")]
    TooLarge {
        /// What overflowed.
        what: &'static str,
    },
    /// More tokens per step than one decode-builder launch takes (tokens are its grid y).
    #[error("max_tokens {max_tokens} exceeds the decode builder's {limit} tokens per launch")]
    TokensPastGrid {
        /// `max_tokens` asked for.
        max_tokens: usize,
        /// The limit (`shape::MAX_GRID_YZ`).
        limit: u32,
    },
    /// A forward whose slices overflow one of the buffers.
    #[error("{what}: {got} exceed the buffer's {cap}")]
    BufferFull {
        /// Which buffer.
        what: &'static str,
        /// Entries the forward needs.
        got: u64,
        /// Entries the buffer holds.
        cap: u64,
    },
    /// A top-k row stride shorter than `index_topk`.
    #[error("top-k row stride {stride} is shorter than index_topk {topk}")]
    TopkStride {
        /// Stride given.
        stride: i32,
        /// `index_topk`.
        topk: i32,
    },
    /// A FlashMLA row width that is not a multiple of 64 (FlashMLA's sparse decode needs it).
    #[error("FlashMLA {what} width {width} is not a positive multiple of 64")]
    FlashMlaWidth {
        /// Which row.
        what: &'static str,
        /// Width given.
        width: i32,
    },
    /// A FlashMLA row too narrow for what the path can stage into it.
    #[error("FlashMLA {what} width {width} is narrower than the {need} entries the path can stage")]
    FlashMlaTooNarrow {
        /// Which row.
        what: &'static str,
        /// Width given.
        width: i32,
        /// Entries the row must hold.
        need: i64,
    },
    /// A FlashMLA operand asked of a path built without them, or of a layer without a view.
    #[error("no FlashMLA operands: {why}")]
    NoFlashMla {
        /// Why.
        why: &'static str,
    },
    /// A buffer read back with the wrong element type.
    #[error("{0} is not an i32 buffer")]
    NotI32(&'static str),
    /// A buffer read back that is not inside the path's own memory (an address outside it, or
    /// a length past its end or whose byte count overflows).
    #[error("buffer at {ptr:#x} of {len} elements is not inside the path's {bytes} bytes")]
    OutOfRange {
        /// Address given.
        ptr: DevicePtr,
        /// Elements given.
        len: u64,
        /// Bytes the path holds.
        bytes: u64,
    },
    /// Flat batch arrays (one per field) of different lengths.
    #[error(
        "batch arrays differ in length: {positions} positions, {context_lens} context lengths, {num_tokens} token counts"
    )]
    BatchShape {
        /// Positions given.
        positions: usize,
        /// Context lengths given.
        context_lens: usize,
        /// Token counts given.
        num_tokens: usize,
    },
    /// A token count in flat batch arrays that is negative or past `usize`.
    #[error("sequence {seq}: {num_tokens} tokens is not a count")]
    BadTokenCount {
        /// Sequence (batch row).
        seq: usize,
        /// Its token count.
        num_tokens: i64,
    },
    /// A backend failure.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The geometry cannot say a class's ratio (its index slots are not laid out).
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// A pool failure (its lock, a handle it does not hold); boxed, a pool error can carry a
    /// decode error.
    #[error("pool: {0}")]
    Pool(#[source] Box<PoolError>),
}
}
