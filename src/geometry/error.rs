use thiserror::Error;

crate::variant::variant_names! {
/// Everything the geometry rejects: every check of the spec, with the numbers its message
/// carries, plus what the spec leaves to chance (zero or indivisible block size, overflow,
/// planes too tall for an i32 index).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GeometryError {
    #[error("a V4 pool needs at least one layer")]
    /// A V4 pool needs at least one layer.
    NoLayers,
    #[error("unknown compress ratios {ratios:?} (0, a positive ratio, or -1 for absent)")]
    /// Unknown compress ratios `ratios` (a negative value other than −1).
    UnknownRatios {
        /// The ratios given.
        ratios: Vec<i32>,
    },
    #[error("slot_align_rows must be positive, got {got}")]
    /// `slot_align_rows` must be positive, got `got`.
    SlotAlignRows {
        /// The value given.
        got: i64,
    },
    #[error("envelope_align_rows must be positive, got {got}")]
    /// `envelope_align_rows` must be positive, got `got`.
    EnvelopeAlignRows {
        /// The value given.
        got: i64,
    },
    #[error("ring_slots must be positive, got {got}")]
    /// `ring_slots` must be positive, got `got`.
    RingSlots {
        /// The value given.
        got: i64,
    },
    #[error("ring_stride must be positive, got {got}")]
    /// `ring_stride` must be positive, got `got`.
    RingStride {
        /// The value given.
        got: i64,
    },
    #[error("arena_rows must not be negative, got {got}")]
    /// `arena_rows` must not be negative, got `got`.
    ArenaRows {
        /// The value given.
        got: i64,
    },
    #[error("{what} must not be negative, got {got}")]
    /// `what` must not be negative, got `got`.
    NegativeCount {
        /// What was computed or checked.
        what: &'static str,
        /// The value given.
        got: i64,
    },
    #[error("block_size must be positive, got {block_size}")]
    /// `block_size` must be positive, got `block_size`.
    BlockSize {
        /// Tokens per block.
        block_size: i64,
    },
    #[error("block_size {block_size} is not a multiple of compress ratio {ratio}")]
    /// `block_size` `block_size` is not a multiple of compress ratio `ratio`.
    BlockSizeNotDivisible {
        /// Tokens per block.
        block_size: i64,
        /// Compress ratio.
        ratio: i32,
    },
    #[error("arithmetic overflow computing {what}")]
    /// Arithmetic overflow computing `what`.
    Overflow {
        /// What was computed or checked.
        what: &'static str,
    },
    #[error("a slot of zero rows: no layer keeps KV here and arena_rows is 0")]
    /// A slot of zero rows: no layer keeps KV here and arena_rows is 0.
    EmptySlot,
    #[error(
        "plane of {plane_rows} rows cannot hold {num_blocks} blocks ({envelope_rows} rows each) \
         plus {num_slots} slots ({slot_rows} rows each)"
    )]
    /// Plane of `plane_rows` rows cannot hold `num_blocks` blocks (`envelope_rows` rows each) plus `num_slots` slots (`slot_rows` rows each).
    PlaneTooSmall {
        /// Rows of the plane.
        plane_rows: i64,
        /// Blocks there are.
        num_blocks: i64,
        /// Rows of one envelope.
        envelope_rows: i64,
        /// Slots there are.
        num_slots: i64,
        /// Rows of one slot.
        slot_rows: i64,
    },
    #[error("plane of {plane_rows} rows does not fit an i32 index (at most 2147483647 rows)")]
    /// Plane of `plane_rows` rows does not fit an i32 index (at most 2147483647 rows).
    PlaneExceedsI32 {
        /// Rows of the plane.
        plane_rows: i64,
    },
    #[error(
        "the compressed view of a plane of {plane_rows} rows has {compressed_rows} rows: more \
         than an i32 index reaches (2147483647)"
    )]
    /// A packed plane's compressed view (its rows at their own width) has more rows than an
    /// i32 index reaches, though the plane's own rows fit.
    CompressedViewExceedsI32 {
        /// Rows of the compressed view.
        compressed_rows: i64,
        /// Rows of the plane.
        plane_rows: i64,
    },
    #[error(
        "plane of {plane_rows} rows holds {held} slots, more than the {slot_positions} positions \
         it was told to number by"
    )]
    /// Plane of `plane_rows` rows holds `held` slots, more than the `slot_positions` positions it was told to number by.
    SlotPositionsTooFew {
        /// Rows of the plane.
        plane_rows: i64,
        /// Held ids above the bound.
        held: i64,
        /// Slot positions of the plane.
        slot_positions: i64,
    },
    #[error("layer {layer} outside 0..{num_layers}")]
    /// Layer `layer` outside 0..`num_layers`.
    LayerOutOfRange {
        /// Layer id.
        layer: usize,
        /// Layers there are.
        num_layers: usize,
    },
    #[error(
        "layer {layer} keeps no KV in this row space; its window is a state field, so it has no \
         class, no base row and no view"
    )]
    /// Layer `layer` keeps no KV in this row space; its window is a state field, so it has no class, no base row and no view.
    AbsentLayer {
        /// Layer id.
        layer: usize,
    },
    #[error("layer {layer} is not in the class of ratio {ratio}")]
    /// Layer `layer` is not in the class of ratio `ratio`.
    LayerNotInClass {
        /// Layer id.
        layer: usize,
        /// Compress ratio.
        ratio: i32,
    },
    #[error("this geometry has no class of ratio {ratio}")]
    /// This geometry has no class of ratio `ratio`.
    NoSuchClass {
        /// Compress ratio.
        ratio: i32,
    },
    #[error("layer {layer} is dense and keeps no compressed KV")]
    /// Layer `layer` is dense and keeps no compressed KV.
    DenseHasNoCompressed {
        /// Layer id.
        layer: usize,
    },
    #[error("row {row} outside 0..{block_rows} for ratio {ratio}")]
    /// Row `row` outside 0..`block_rows` for ratio `ratio`.
    CompressRowOutOfRange {
        /// The row given.
        row: i64,
        /// Rows one block compresses to in the class.
        block_rows: i64,
        /// Compress ratio.
        ratio: i32,
    },
    #[error("block {block} outside 0..{num_blocks}")]
    /// Block `block` outside 0..`num_blocks`.
    BlockOutOfRange {
        /// The block given.
        block: i64,
        /// Blocks there are.
        num_blocks: i64,
    },
    #[error("ring position {ring_pos} outside 0..{ring_slots}")]
    /// Ring position `ring_pos` outside 0..`ring_slots`.
    RingPosOutOfRange {
        /// The ring position given.
        ring_pos: i64,
        /// Ring positions.
        ring_slots: i64,
    },
    #[error("slot position {slot} outside {first}..{end}")]
    /// Slot position `slot` outside `first`..`end`.
    SlotOutOfRange {
        /// The slot position given.
        slot: i64,
        /// First live position.
        first: i64,
        /// One past the last live position.
        end: i64,
    },
    #[error("rows per window row must be positive, got {got}")]
    /// Rows per window row must be positive, got `got`.
    RowsPerWindowRow {
        /// The value given.
        got: i64,
    },
    #[error(
        "{name} of {rows} rows does not divide by the {rows_per_window_row} plane rows one window row takes"
    )]
    /// `name` of `rows` rows does not divide by the `rows_per_window_row` plane rows one window row takes.
    FieldNotDivisible {
        /// The name.
        name: &'static str,
        /// The field's rows.
        rows: i64,
        /// Rows one window row takes.
        rows_per_window_row: i64,
    },
    #[error("group {group} outside 0..{num_slots}")]
    /// Group `group` outside 0..`num_slots`.
    GroupOutOfRange {
        /// The group given.
        group: i64,
        /// Slots there are.
        num_slots: i64,
    },
    #[error("runs must be non-negative, got ({start}, {count})")]
    /// Runs must be non-negative, got (`start`, `count`).
    RunNegative {
        /// Start of the run.
        start: i64,
        /// How many.
        count: i64,
    },
    #[error("runs must ascend and not overlap: ({start}, {count}) starts before {prev_end}")]
    /// Runs must ascend and not overlap: (`start`, `count`) starts before `prev_end`.
    RunOverlap {
        /// Start of the run.
        start: i64,
        /// How many.
        count: i64,
        /// End of the run before it.
        prev_end: i64,
    },
    #[error("source layer lists must ascend without repeats: {sources:?}")]
    /// Source layer lists must ascend without repeats.
    SourcesNotSorted {
        /// The list given.
        sources: Vec<usize>,
    },
    #[error("source layer {layer} is not a compressed layer of the {num_layers} given")]
    /// A source layer is out of range, or a window-only or absent layer.
    BadSource {
        /// The source layer.
        layer: usize,
        /// Layers there are.
        num_layers: usize,
    },
    #[error("compressed layer {layer} has no source layer at or before it")]
    /// A compressed layer has no source layer at or before it.
    NoSourceBefore {
        /// The layer.
        layer: usize,
    },
    #[error("layer {layer} (ratio {ratio}) would read source {owner} of ratio {owner_ratio}: a layer and its owner share one class")]
    /// A layer's owner is in another class.
    OwnerClassDiffers {
        /// The reading layer.
        layer: usize,
        /// Its ratio.
        ratio: i32,
        /// The source it would read.
        owner: usize,
        /// The source's ratio.
        owner_ratio: i32,
    },
    #[error("the compact row form needs source layers (a config without them keeps the envelope form)")]
    /// The compact form was asked for without source layers.
    CompactWithoutSources,
    #[error("packed compressed rows need the compact form (shared compressors): the envelope form interleaves windows with compressed rows")]
    /// Packed compressed rows without the compact form.
    PackedNeedsCompact,
    #[error("packed rows of {compressed} B in a plane of {plane}-B rows: both must be positive")]
    /// A packed-rows width that is not positive.
    PackedRowBytes {
        /// Bytes of a compressed row.
        compressed: i64,
        /// Bytes of a plane row.
        plane: i64,
    },
    #[error("{count} compressed classes {ratios:?}: the index buffers hold at most two")]
    /// More than two compressed classes where index buffers are built.
    TooManyIndexClasses {
        /// Distinct positive ratios.
        count: usize,
        /// The ratios, envelope order.
        ratios: Vec<i32>,
    },
}
}
