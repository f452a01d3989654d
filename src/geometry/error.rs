use thiserror::Error;

/// Everything the geometry rejects: every check of the spec, with the numbers its message
/// carries, plus what the spec leaves to chance (zero or indivisible block size, overflow,
/// planes too tall for an i32 index).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GeometryError {
    #[error("a V4 pool needs at least one layer")]
    NoLayers,
    #[error("unknown V4 compress ratios {ratios:?}")]
    UnknownRatios { ratios: Vec<i32> },
    #[error("slot_align_rows must be positive, got {got}")]
    SlotAlignRows { got: i64 },
    #[error("ring_slots must be positive, got {got}")]
    RingSlots { got: i64 },
    #[error("ring_stride must be positive, got {got}")]
    RingStride { got: i64 },
    #[error("arena_rows must not be negative, got {got}")]
    ArenaRows { got: i64 },
    #[error("{what} must not be negative, got {got}")]
    NegativeCount { what: &'static str, got: i64 },
    #[error("block_size must be positive, got {block_size}")]
    BlockSize { block_size: i64 },
    #[error("block_size {block_size} is not a multiple of compress ratio {ratio}")]
    BlockSizeNotDivisible { block_size: i64, ratio: i32 },
    #[error("arithmetic overflow computing {what}")]
    Overflow { what: &'static str },
    #[error("a slot of zero rows: no layer keeps KV here and arena_rows is 0")]
    EmptySlot,
    #[error(
        "plane of {plane_rows} rows cannot hold {num_blocks} blocks ({envelope_rows} rows each) \
         plus {num_slots} slots ({slot_rows} rows each)"
    )]
    PlaneTooSmall { plane_rows: i64, num_blocks: i64, envelope_rows: i64, num_slots: i64, slot_rows: i64 },
    #[error("plane of {plane_rows} rows does not fit an i32 index (at most 2147483647 rows)")]
    PlaneExceedsI32 { plane_rows: i64 },
    #[error(
        "plane of {plane_rows} rows holds {held} slots, more than the {slot_positions} positions \
         it was told to number by"
    )]
    SlotPositionsTooFew { plane_rows: i64, held: i64, slot_positions: i64 },
    #[error("layer {layer} outside 0..{num_layers}")]
    LayerOutOfRange { layer: usize, num_layers: usize },
    #[error(
        "layer {layer} keeps no KV in this row space; its window is a state field, so it has no \
         class, no base row and no view"
    )]
    AbsentLayer { layer: usize },
    #[error("layer {layer} is not in the class of ratio {ratio}")]
    LayerNotInClass { layer: usize, ratio: i32 },
    #[error("this geometry has no class of ratio {ratio}")]
    NoSuchClass { ratio: i32 },
    #[error("layer {layer} is dense and keeps no compressed KV")]
    DenseHasNoCompressed { layer: usize },
    #[error("row {row} outside 0..{block_rows} for ratio {ratio}")]
    CompressRowOutOfRange { row: i64, block_rows: i64, ratio: i32 },
    #[error("block {block} outside 0..{num_blocks}")]
    BlockOutOfRange { block: i64, num_blocks: i64 },
    #[error("ring position {ring_pos} outside 0..{ring_slots}")]
    RingPosOutOfRange { ring_pos: i64, ring_slots: i64 },
    #[error("slot position {slot} outside {first}..{end}")]
    SlotOutOfRange { slot: i64, first: i64, end: i64 },
    #[error("rows per window row must be positive, got {got}")]
    RowsPerWindowRow { got: i64 },
    #[error(
        "{name} of {rows} rows does not divide by the {rows_per_window_row} plane rows one window row takes"
    )]
    FieldNotDivisible { name: &'static str, rows: i64, rows_per_window_row: i64 },
    #[error("group {group} outside 0..{num_slots}")]
    GroupOutOfRange { group: i64, num_slots: i64 },
    #[error("runs must be non-negative, got ({start}, {count})")]
    RunNegative { start: i64, count: i64 },
    #[error("runs must ascend and not overlap: ({start}, {count}) starts before {prev_end}")]
    RunOverlap { start: i64, count: i64, prev_end: i64 },
}

impl GeometryError {
    /// The variant's name, as `v4pool layout --json` reports it.
    pub fn variant_name(&self) -> &'static str {
        use GeometryError::*;
        match self {
            NoLayers => "NoLayers",
            UnknownRatios { .. } => "UnknownRatios",
            SlotAlignRows { .. } => "SlotAlignRows",
            RingSlots { .. } => "RingSlots",
            RingStride { .. } => "RingStride",
            ArenaRows { .. } => "ArenaRows",
            NegativeCount { .. } => "NegativeCount",
            BlockSize { .. } => "BlockSize",
            BlockSizeNotDivisible { .. } => "BlockSizeNotDivisible",
            Overflow { .. } => "Overflow",
            EmptySlot => "EmptySlot",
            PlaneTooSmall { .. } => "PlaneTooSmall",
            PlaneExceedsI32 { .. } => "PlaneExceedsI32",
            SlotPositionsTooFew { .. } => "SlotPositionsTooFew",
            LayerOutOfRange { .. } => "LayerOutOfRange",
            AbsentLayer { .. } => "AbsentLayer",
            LayerNotInClass { .. } => "LayerNotInClass",
            NoSuchClass { .. } => "NoSuchClass",
            DenseHasNoCompressed { .. } => "DenseHasNoCompressed",
            CompressRowOutOfRange { .. } => "CompressRowOutOfRange",
            BlockOutOfRange { .. } => "BlockOutOfRange",
            RingPosOutOfRange { .. } => "RingPosOutOfRange",
            SlotOutOfRange { .. } => "SlotOutOfRange",
            RowsPerWindowRow { .. } => "RowsPerWindowRow",
            FieldNotDivisible { .. } => "FieldNotDivisible",
            GroupOutOfRange { .. } => "GroupOutOfRange",
            RunNegative { .. } => "RunNegative",
            RunOverlap { .. } => "RunOverlap",
        }
    }
}
