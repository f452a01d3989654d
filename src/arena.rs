//! The compressor-state arena (`pool-runtime.md` §2): which fields a request's state has,
//! how they lie in one entry, which plane each goes in, and the typed views a kernel binds.
//!
//! The arena has no region of its own: it is the first `arena_rows` rows of every slot, in
//! every plane. A field is one strided tensor, so it lives in exactly one plane; each plane
//! lays its own fields out with the §2.2 cursor walk, and every plane reserves the same
//! number of rows (the largest any plane needs). All byte math is `u64`, checked.

use crate::checked::{add, gcd, mul};
use crate::geometry::UnifiedPoolGeometry;
use crate::model::{ModelFamily, ModelShape};
use thiserror::Error;

crate::checked::overflow_into!(ArenaError);

/// Alignment every field start and every entry end is rounded to (bytes).
pub const FIELD_ALIGN: u64 = 256;
/// Width of one row of a carried window (`[512]` bf16): the unit the DSpark view retypes to.
pub const WINDOW_ROW_BYTES: u64 = 1024;
/// Row multiple a slot is rounded to without a carried window (the geometry's default).
pub const BASE_SLOT_ALIGN_ROWS: i64 = 2;
/// The exhaustive plane plan refuses more candidate codes than this.
pub const MAX_PLAN_CODES: u64 = 65_536;
/// fp32 −inf, the fill of every score field.
pub const F32_NEG_INF: u32 = 0xff80_0000;
/// bf16 −inf twice, as one 32-bit fill word.
pub const BF16_NEG_INF_X2: u32 = 0xff80_ff80;

/// Name of the carried-window field (DSpark draft layers).
pub const STATE_WINDOW: &str = "state_window";

/// Element type of a state field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// 64-bit signed integer (V4.1's cursor).
    I64,
}

impl Dtype {
    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
            Dtype::I64 => 8,
        }
    }
}

/// What a field holds before its first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fill {
    /// Zero bytes.
    Zero,
    /// f32 −inf (`0xff80_0000`): an empty softmax score.
    NegInf,
    /// V4.1's cursor: element 0 (the committed position) zero, every later element −1 (no
    /// Engram history yet). All-ones words after the first element.
    Cursor,
}

impl Fill {
    /// Leading bytes of each layer's tensor that stay zero before [`Fill::pattern`] applies:
    /// one element for [`Fill::Cursor`], none otherwise.
    pub fn lead_zero_bytes(self, dtype: Dtype) -> u64 {
        match self {
            Fill::Cursor => dtype.itemsize(),
            Fill::Zero | Fill::NegInf => 0,
        }
    }

    /// The 32-bit word a memset writes to give this fill in `dtype`.
    pub fn pattern(self, dtype: Dtype) -> u32 {
        match (self, dtype) {
            (Fill::Zero, _) => 0,
            (Fill::NegInf, Dtype::F32) => F32_NEG_INF,
            (Fill::NegInf, Dtype::Bf16) => BF16_NEG_INF_X2,
            // An integer has no −inf; `validate_fields` refuses the pair.
            (Fill::NegInf, Dtype::I64) => 0,
            (Fill::Cursor, _) => u32::MAX,
        }
    }
}

/// One field of a request's compressor state: `layers` tensors of `shape`, layer outermost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateField {
    /// Field name (unique in an arena).
    pub name: String,
    /// Layers the field holds a tensor for.
    pub layers: u64,
    /// Per-layer shape, row-major.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
    /// What a fresh slot's field is initialised to.
    pub fill: Fill,
    /// Whether a checkpoint image carries this field (§2.1).
    pub carried: bool,
    /// Start alignment in bytes; a multiple of 256 (256 itself for most fields).
    pub align: u64,
}

impl StateField {
    /// Elements of one layer's tensor.
    pub fn per_layer_elems(&self) -> Result<u64, ArenaError> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or(ArenaError::Overflow { what: "field elements" })
    }
    /// Bytes of one layer's tensor.
    pub fn per_layer_bytes(&self) -> Result<u64, ArenaError> {
        Ok(mul(self.per_layer_elems()?, self.dtype.itemsize(), "field layer bytes")?)
    }
    /// Bytes of the whole field, all layers.
    pub fn bytes(&self) -> Result<u64, ArenaError> {
        Ok(mul(self.layers, self.per_layer_bytes()?, "field bytes")?)
    }
    /// Alignment the cursor is rounded to before this field: `max(256, align)`.
    fn start_align(&self) -> u64 {
        self.align.max(FIELD_ALIGN)
    }
}

crate::variant::variant_names! {
/// Everything the arena refuses, with the numbers.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ArenaError {
    #[error("an arena needs at least one state field")]
    /// An arena needs at least one state field.
    NoFields,
    #[error("state field {name:?} is declared twice")]
    /// State field `name` is declared twice.
    DuplicateField {
        /// The name.
        name: String,
    },
    #[error("state field {name:?} has align {align}, not a positive multiple of 256")]
    /// State field `name` has align `align`, not a positive multiple of 256.
    FieldAlign {
        /// The name.
        name: String,
        /// Required alignment in bytes.
        align: u64,
    },
    #[error("arithmetic overflow computing {what}")]
    /// Arithmetic overflow computing `what`.
    Overflow {
        /// What was computed or checked.
        what: &'static str,
    },
    #[error("the plane plan needs at least one plane width")]
    /// The plane plan needs at least one plane width.
    NoPlanes,
    #[error("plane {plane} has width 0")]
    /// Plane `plane` has width 0.
    ZeroWidth {
        /// Plane index.
        plane: usize,
    },
    #[error("{planes} planes ^ {fields} fields is more than {MAX_PLAN_CODES} candidate plans")]
    /// `planes` planes ^ `fields` fields is more than `MAX_PLAN_CODES` candidate plans.
    TooManyPlans {
        /// Planes there are.
        planes: usize,
        /// Fields there are.
        fields: usize,
    },
    #[error(
        "the state window lives in a plane of width {width} B, which does not divide its \
         {WINDOW_ROW_BYTES}-B rows"
    )]
    /// The state window lives in a plane of width `width` B, which does not divide its `WINDOW_ROW_BYTES`-B rows.
    WindowPlaneWidth {
        /// The plane width.
        width: u64,
    },
    #[error("model: {reason}")]
    /// Model: `reason`.
    BadModel {
        /// Why.
        reason: String,
    },
    #[error("plane {plane}: slot stride {stride} B is smaller than its entry of {entry_bytes} B")]
    /// Plane `plane`: slot stride `stride` B is smaller than its entry of `entry_bytes` B.
    SlotStrideTooSmall {
        /// Plane index.
        plane: usize,
        /// The stride.
        stride: u64,
        /// Bytes of the plane's fields.
        entry_bytes: u64,
    },
    #[error("plane {plane}: slot stride {stride} B is not a multiple of {align}")]
    /// Plane `plane`: slot stride `stride` B is not a multiple of `align`.
    SlotStrideMisaligned {
        /// Plane index.
        plane: usize,
        /// The stride.
        stride: u64,
        /// Required alignment in bytes.
        align: u64,
    },
    #[error("live count {live} outside 0..={entries}")]
    /// Live count `live` outside 0..=`entries`.
    LiveOutOfRange {
        /// Live slots given.
        live: i64,
        /// Entries the buffer holds.
        entries: i64,
    },
    #[error("plane {plane}: arena buffer at byte {base} is not on a {align}-B boundary")]
    /// Plane `plane`: arena buffer at byte `base` is not on a `align`-B boundary.
    BufferMisaligned {
        /// Plane index.
        plane: usize,
        /// The buffer's base.
        base: u64,
        /// Required alignment in bytes.
        align: u64,
    },
    #[error("plane {plane}: arena buffer of {len} B is shorter than the {needed} B its entries need")]
    /// Plane `plane`: arena buffer of `len` B is shorter than the `needed` B its entries need.
    BufferTooShort {
        /// Plane index.
        plane: usize,
        /// Length.
        len: u64,
        /// Length needed.
        needed: u64,
    },
    #[error("no entries: an arena view needs at least one position")]
    /// No entries: an arena view needs at least one position.
    NoEntries,
    #[error("field {field} outside 0..{fields}")]
    /// Field `field` outside 0..`fields`.
    FieldOutOfRange {
        /// The field.
        field: usize,
        /// Fields there are.
        fields: usize,
    },
    #[error("no state field named {name:?}")]
    /// No state field named `name`.
    FieldNotFound {
        /// The name.
        name: String,
    },
    #[error("layer {layer} of field {name:?} outside 0..{layers}")]
    /// Layer `layer` of field `name` outside 0..`layers`.
    LayerOutOfRange {
        /// The name.
        name: String,
        /// Layer id.
        layer: u64,
        /// Layers there are.
        layers: u64,
    },
    #[error("plane {plane} outside 0..{planes}")]
    /// Plane `plane` outside 0..`planes`.
    PlaneOutOfRange {
        /// Plane index.
        plane: usize,
        /// Planes there are.
        planes: usize,
    },
    #[error("position {position} outside 0..{positions}")]
    /// Position `position` outside 0..`positions`.
    PositionOutOfRange {
        /// The position given.
        position: i64,
        /// Positions there are.
        positions: i64,
    },
    #[error("slot of {slot_rows} rows cannot hold the {arena_rows}-row arena")]
    /// Slot of `slot_rows` rows cannot hold the `arena_rows`-row arena.
    SlotRowsTooSmall {
        /// Rows of one slot.
        slot_rows: i64,
        /// Arena rows.
        arena_rows: i64,
    },
    #[error("the geometry reserves {geometry} arena rows, this arena needs {layout}")]
    /// The geometry reserves `geometry` arena rows, this arena needs `layout`.
    ArenaRowsMismatch {
        /// Arena rows of the layout.
        layout: i64,
        /// Arena rows of the geometry.
        geometry: i64,
    },
    #[error("field {name:?}: {bytes} B is not a whole number of 32-bit fill words")]
    /// Field `name`: `bytes` B is not a whole number of 32-bit fill words.
    FillNotWordAligned {
        /// The name.
        name: String,
        /// Bytes.
        bytes: u64,
    },
}
}

/// Round `x` up to a multiple of `to` (> 0).
pub(crate) fn round_up(x: u64, to: u64, what: &'static str) -> Result<u64, ArenaError> {
    let r = x % to;
    if r == 0 {
        Ok(x)
    } else {
        Ok(add(x, to - r, what)?)
    }
}
fn to_u64(x: i64, what: &'static str) -> Result<u64, ArenaError> {
    u64::try_from(x).map_err(|_| ArenaError::Overflow { what })
}
fn to_i64(x: u64, what: &'static str) -> Result<i64, ArenaError> {
    i64::try_from(x).map_err(|_| ArenaError::Overflow { what })
}

/// The §2.1 field list of `model`, in declaration (byte and wire) order.
///
/// `state_window` is present only when the model has absent (carried-window) layers; it
/// holds those layers in sorted id order, `(ring_slots, 512)` bf16, aligned to its own row.
pub fn state_fields(model: &ModelShape) -> Result<Vec<StateField>, ArenaError> {
    if model.family == ModelFamily::V41 {
        return v41_state_fields(model);
    }
    let k = u64::try_from(model.spec_steps)
        .map_err(|_| ArenaError::BadModel { reason: format!("spec_steps {} < 0", model.spec_steps) })?;
    let ring = u64::try_from(model.ring_slots())
        .ok()
        .filter(|&r| r > 0)
        .ok_or_else(|| ArenaError::BadModel { reason: format!("ring_slots {} < 1", model.ring_slots()) })?;
    let (n_csa, n_hca) = (model.n_csa() as u64, model.n_hca() as u64);
    let csa_rows = add(8, k, "csa state rows")?;
    let hca_rows = add(128, k, "hca state rows")?;
    let f = |name: &str, layers: u64, shape: Vec<u64>, fill: Fill, carried: bool| StateField {
        name: name.to_string(),
        layers,
        shape,
        dtype: Dtype::F32,
        fill,
        carried,
        align: FIELD_ALIGN,
    };
    let mut fields = vec![
        f("csa_main_kv", n_csa, vec![csa_rows, 1024], Fill::Zero, true),
        f("csa_main_score", n_csa, vec![csa_rows, 1024], Fill::NegInf, true),
        f("csa_idx_kv", n_csa, vec![csa_rows, 256], Fill::Zero, true),
        f("csa_idx_score", n_csa, vec![csa_rows, 256], Fill::NegInf, true),
        f("hca_main_kv", n_hca, vec![hca_rows, 512], Fill::Zero, false),
        f("hca_main_score", n_hca, vec![hca_rows, 512], Fill::NegInf, false),
    ];
    let absent = model.absent_layers().len() as u64;
    if absent > 0 {
        fields.push(StateField {
            name: STATE_WINDOW.to_string(),
            layers: absent,
            shape: vec![ring, 512],
            dtype: Dtype::Bf16,
            fill: Fill::Zero,
            carried: true,
            // Its rows are also reached by index (the DSpark view), so it starts on a row.
            align: WINDOW_ROW_BYTES,
        });
    }
    Ok(fields)
}

/// V4.1's per-request state beside the windows the entry holds (every layer's, drafts
/// included): the KV owners' compressor rings, `owners × (max owner ratio + k) × 512` fp32
/// for the kv and the score (both start at zero: V4.1's gate-free ratio-1 compressor and its
/// ratio-2 compressor sum scores from 0, not −inf), and the cursor, `(history + 1)` int64:
/// the committed position (0), then the Engram history, oldest first, −1 for none. Every
/// field is carried by a checkpoint (`docs/v41.md`).
fn v41_state_fields(model: &ModelShape) -> Result<Vec<StateField>, ArenaError> {
    let bad = |reason: String| ArenaError::BadModel { reason };
    let k =
        u64::try_from(model.spec_steps).map_err(|_| bad(format!("spec_steps {} < 0", model.spec_steps)))?;
    let history = u64::try_from(model.engram_history)
        .map_err(|_| bad(format!("engram history {} < 0", model.engram_history)))?;
    let mut owner_ratios = Vec::with_capacity(model.kv_sources.len());
    for &l in &model.kv_sources {
        match model.ratios.get(l) {
            Some(&r) if r > 0 => owner_ratios.push(r as u64),
            _ => return Err(bad(format!("KV source {l} is not a compressed layer"))),
        }
    }
    let max_ratio = owner_ratios.iter().copied().max().ok_or_else(|| bad("no KV source layers".into()))?;
    let ring = add(max_ratio, k, "compressor ring rows")?;
    let head = u64::try_from(model.head_dim).map_err(|_| bad(format!("head_dim {}", model.head_dim)))?;
    let owners = owner_ratios.len() as u64;
    let f = |name: &str, layers: u64, shape: Vec<u64>, dtype: Dtype, fill: Fill| StateField {
        name: name.to_string(),
        layers,
        shape,
        dtype,
        fill,
        carried: true,
        align: FIELD_ALIGN,
    };
    Ok(vec![
        f(V41_COMPRESS_KV, owners, vec![ring, head], Dtype::F32, Fill::Zero),
        f(V41_COMPRESS_SCORE, owners, vec![ring, head], Dtype::F32, Fill::Zero),
        f(V41_CURSOR, 1, vec![add(history, 1, "cursor elements")?], Dtype::I64, Fill::Cursor),
    ])
}

/// V4.1 field: the KV owners' compressor kv rings.
pub const V41_COMPRESS_KV: &str = "compress_kv";
/// V4.1 field: the KV owners' compressor score rings.
pub const V41_COMPRESS_SCORE: &str = "compress_score";
/// V4.1 field: committed position and Engram history.
pub const V41_CURSOR: &str = "cursor";

/// Reject what §2.4 refuses of a field list: none, duplicates, an align not a multiple of 256.
pub fn validate_fields(fields: &[StateField]) -> Result<(), ArenaError> {
    if fields.is_empty() {
        return Err(ArenaError::NoFields);
    }
    for (i, f) in fields.iter().enumerate() {
        if fields[..i].iter().any(|g| g.name == f.name) {
            return Err(ArenaError::DuplicateField { name: f.name.clone() });
        }
        if f.fill == Fill::NegInf && f.dtype == Dtype::I64 {
            return Err(ArenaError::BadModel {
                reason: format!("field {:?}: an int64 field has no -inf", f.name),
            });
        }
        if f.align == 0 || f.align % FIELD_ALIGN != 0 {
            return Err(ArenaError::FieldAlign { name: f.name.clone(), align: f.align });
        }
        f.bytes()?;
    }
    Ok(())
}

/// Byte offsets of `fields` in one entry, and the entry's size (§2.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryLayout {
    /// Offset of each field, in the order given.
    pub offsets: Vec<u64>,
    /// Final cursor rounded up to 256.
    pub entry_bytes: u64,
}

/// The §2.2 cursor walk over `fields` in the order given. An empty list is an empty entry.
pub fn entry_layout<'a, I>(fields: I) -> Result<EntryLayout, ArenaError>
where
    I: IntoIterator<Item = &'a StateField>,
{
    let mut cursor = 0u64;
    let mut offsets = Vec::new();
    for f in fields {
        cursor = round_up(cursor, f.start_align(), "entry cursor")?;
        offsets.push(cursor);
        cursor = add(cursor, f.bytes()?, "entry cursor")?;
    }
    Ok(EntryLayout { offsets, entry_bytes: round_up(cursor, FIELD_ALIGN, "entry bytes")? })
}

/// `(start, bytes)` ranges of an entry a checkpoint carries (§2.2): each run of consecutive
/// carried fields is one range, padding between carried neighbours included; a non-carried
/// field splits the run; zero-length ranges are dropped.
pub fn checkpoint_ranges(fields: &[StateField]) -> Result<Vec<(u64, u64)>, ArenaError> {
    let layout = entry_layout(fields)?;
    let mut out = Vec::new();
    let mut run: Option<(u64, u64)> = None; // (start, end)
    for (f, &off) in fields.iter().zip(&layout.offsets) {
        if f.carried {
            let end = add(off, f.bytes()?, "checkpoint range")?;
            run = Some(match run {
                Some((start, _)) => (start, end),
                None => (off, end),
            });
        } else if let Some((start, end)) = run.take() {
            out.push((start, end - start));
        }
    }
    if let Some((start, end)) = run {
        out.push((start, end - start));
    }
    out.retain(|&(_, n)| n > 0);
    Ok(out)
}

/// Byte regions placed back to back (§2.2): each start rounded up to 256, the total too.
/// Zero-size regions still get an aligned offset; `[]` gives `([], 0)`.
pub fn plan_regions(sizes: &[u64]) -> Result<(Vec<u64>, u64), ArenaError> {
    let mut cursor = 0u64;
    let mut offsets = Vec::with_capacity(sizes.len());
    for &s in sizes {
        cursor = round_up(cursor, FIELD_ALIGN, "region offset")?;
        offsets.push(cursor);
        cursor = add(cursor, s, "region end")?;
    }
    Ok((offsets, round_up(cursor, FIELD_ALIGN, "regions total")?))
}

/// The §2.3 exhaustive plan: `assignment[i]` is field i's plane, and the cost (`arena_rows`).
/// Code c puts field i in plane `(c / P^i) mod P`; the first code with the strictly lowest
/// cost wins. Refuses an empty or zero width and more than 65,536 codes.
pub fn assign_planes(fields: &[StateField], widths: &[u64]) -> Result<(Vec<usize>, u64), ArenaError> {
    validate_fields(fields)?;
    if widths.is_empty() {
        return Err(ArenaError::NoPlanes);
    }
    if let Some(plane) = widths.iter().position(|&w| w == 0) {
        return Err(ArenaError::ZeroWidth { plane });
    }
    let (p, n) = (widths.len() as u64, fields.len());
    let codes = u32::try_from(n)
        .ok()
        .and_then(|n| p.checked_pow(n))
        .filter(|&c| c <= MAX_PLAN_CODES)
        .ok_or(ArenaError::TooManyPlans { planes: widths.len(), fields: n })?;
    let mut best: Option<(u64, Vec<usize>)> = None;
    let mut assignment = vec![0usize; n];
    for code in 0..codes {
        let mut c = code;
        for a in assignment.iter_mut() {
            *a = (c % p) as usize;
            c /= p;
        }
        let mut cost = 0u64;
        for (plane, &w) in widths.iter().enumerate() {
            let bytes =
                entry_layout(fields.iter().zip(&assignment).filter(|(_, &a)| a == plane).map(|(f, _)| f))?
                    .entry_bytes;
            cost = cost.max(bytes.div_ceil(w));
        }
        if best.as_ref().is_none_or(|(b, _)| cost < *b) {
            best = Some((cost, assignment.clone()));
        }
    }
    // codes >= 1 (P >= 1), so the loop ran at least once.
    let (cost, assignment) = best.ok_or(ArenaError::NoPlanes)?;
    Ok((assignment, cost))
}

/// §2.4: 2, or `lcm(2, 1024 / width)` of the plane holding the state window, so that every
/// slot starts on a whole 1024-B window row in that plane.
pub fn slot_align_rows(window_plane_width: Option<u64>) -> Result<i64, ArenaError> {
    let Some(w) = window_plane_width else {
        return Ok(BASE_SLOT_ALIGN_ROWS);
    };
    if w == 0 || WINDOW_ROW_BYTES % w != 0 {
        return Err(ArenaError::WindowPlaneWidth { width: w });
    }
    lcm_rows(BASE_SLOT_ALIGN_ROWS, to_i64(WINDOW_ROW_BYTES / w, "slot align rows")?)
}

/// Rows a slot must be a multiple of for a field's `align`-byte start (counted from the slot's
/// start) to be `align`-byte aligned in memory, in a plane of `width`-byte rows: a slot starts at
/// `slot × slot_rows` rows, so `slot_rows × width` must be a multiple of `align`. 1 for 512- and
/// 1,024-B rows, 2 for 128-B rows, 32 for FlashMLA's 584-B rows, 16 for its 528-B rows. (Without
/// it a 584-B plane's state rows started 16-B aligned only: every state row's first and last
/// 32-B sectors were partial writes, and the compressor-state updates of a decode step took 9 %
/// longer on an H100 at 1,024 tokens, 2026-12-07.)
fn field_start_rows(align: u64, width: u64) -> Result<i64, ArenaError> {
    to_i64(align / gcd(align, width), "field alignment rows")
}

/// lcm of two positive row counts (the slot alignment's terms), checked.
fn lcm_rows(a: i64, b: i64) -> Result<i64, ArenaError> {
    let (x, y) = (to_u64(a, "slot align rows")?, to_u64(b, "slot align rows")?);
    to_i64(mul(x / gcd(x, y), y, "slot align rows")?, "slot align rows")
}

/// A field placed in a plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedField {
    /// Index into [`ArenaLayout::fields`].
    pub field: usize,
    /// Byte offset from the start of the slot in this plane.
    pub offset: u64,
}

/// One plane's share of the arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlaneArena {
    /// Row bytes of the plane.
    pub width: u64,
    /// Fields in declared order.
    pub fields: Vec<PlacedField>,
    /// Bytes the plane's fields take (§2.2 `entry_bytes`), ≤ `arena_rows × width`.
    pub entry_bytes: u64,
}

/// A kernel's typed view of one field across all positions: `[layers][positions][shape…]`
/// in elements of `dtype`, from `offset` bytes into `plane`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldView {
    /// Plane the field lives in.
    pub plane: usize,
    /// Byte offset of position 0, layer 0 from the plane's start.
    pub offset: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions `[layers, positions, shape…]`.
    pub dims: Vec<u64>,
    /// Element strides, one per dim.
    pub strides: Vec<u64>,
}

/// A memset: `bytes` bytes from `offset` in `plane`, filled with the 32-bit word `pattern`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneFill {
    /// Plane to fill.
    pub plane: usize,
    /// Byte offset from the plane's start.
    pub offset: u64,
    /// Bytes to fill (a multiple of 4).
    pub bytes: u64,
    /// The 32-bit word repeated over the range.
    pub pattern: u32,
}

/// How one plane's arena buffer is bound (§2.4 preconditions): `entries` slots of
/// `stride` bytes from byte `base` (an address or an offset; only its alignment matters),
/// `live` of them the pool's, in a buffer of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaBinding {
    /// Plane the buffer holds.
    pub plane: usize,
    /// Byte address (or offset) of entry 0; only its alignment is checked.
    pub base: u64,
    /// Buffer length in bytes.
    pub len: u64,
    /// Bytes from one slot's arena to the next.
    pub stride: u64,
    /// Slots the buffer has room for.
    pub entries: i64,
    /// Slots of those the pool holds.
    pub live: i64,
}

/// The arena of a model at a set of plane widths: per plane the fields placed there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaLayout {
    fields: Vec<StateField>,
    /// Plane of each field.
    assignment: Vec<usize>,
    planes: Vec<PlaneArena>,
    arena_rows: i64,
    slot_align_rows: i64,
}

impl ArenaLayout {
    /// The §2.1 fields of `model` planned into planes of `widths` (§2.3, §2.4).
    pub fn for_model(model: &ModelShape, widths: &[u64]) -> Result<Self, ArenaError> {
        Self::new(state_fields(model)?, widths)
    }

    /// Plan arbitrary `fields` into planes of `widths`.
    pub fn new(fields: Vec<StateField>, widths: &[u64]) -> Result<Self, ArenaError> {
        let (assignment, arena_rows) = assign_planes(&fields, widths)?;
        let mut planes = Vec::with_capacity(widths.len());
        for (p, &width) in widths.iter().enumerate() {
            let idx: Vec<usize> = (0..fields.len()).filter(|&i| assignment[i] == p).collect();
            let layout = entry_layout(idx.iter().map(|&i| &fields[i]))?;
            let placed = idx
                .iter()
                .zip(&layout.offsets)
                .map(|(&field, &offset)| PlacedField { field, offset })
                .collect();
            planes.push(PlaneArena { width, fields: placed, entry_bytes: layout.entry_bytes });
        }
        let window_width = fields.iter().position(|f| f.name == STATE_WINDOW).map(|i| widths[assignment[i]]);
        // The window's term and its width check; the planes' terms include it again (the
        // window field's own 1,024-B alignment) and add every other field's.
        let mut align = slot_align_rows(window_width)?;
        for p in &planes {
            let field_align = p.fields.iter().map(|pf| fields[pf.field].start_align()).max().unwrap_or(1);
            align = lcm_rows(align, field_start_rows(field_align, p.width)?)?;
        }
        Ok(ArenaLayout {
            slot_align_rows: align,
            arena_rows: to_i64(arena_rows, "arena rows")?,
            fields,
            assignment,
            planes,
        })
    }

    /// The fields, in declared order.
    pub fn fields(&self) -> &[StateField] {
        &self.fields
    }
    /// Each plane's share of the arena.
    pub fn planes(&self) -> &[PlaneArena] {
        &self.planes
    }
    /// Row bytes of each plane.
    pub fn widths(&self) -> Vec<u64> {
        self.planes.iter().map(|p| p.width).collect()
    }
    /// Rows every slot reserves for state at its front, in every plane.
    pub fn arena_rows(&self) -> i64 {
        self.arena_rows
    }
    /// Row multiple the geometry rounds a slot up to.
    pub fn slot_align_rows(&self) -> i64 {
        self.slot_align_rows
    }
    /// The same fields with the arena and the slot alignment rounded to whole pages of
    /// `page_rows` rows (a paged row format: the arena's bytes then fill whole pages and never
    /// share one with window rows). The fields keep their offsets; the added rows are padding.
    pub fn page_aligned(mut self, page_rows: i64) -> Result<Self, ArenaError> {
        if page_rows < 1 {
            return Err(ArenaError::Overflow { what: "page rows" });
        }
        let pages = add(self.arena_rows, page_rows - 1, "arena rows")? / page_rows;
        self.arena_rows = mul(pages, page_rows, "arena rows")?;
        self.slot_align_rows = lcm_rows(self.slot_align_rows, page_rows)?;
        Ok(self)
    }
    /// Sum of the fields' bytes (no padding): the "state bytes" of §2.5.
    pub fn state_bytes(&self) -> Result<u64, ArenaError> {
        self.fields.iter().try_fold(0u64, |acc, f| Ok::<_, ArenaError>(add(acc, f.bytes()?, "state bytes")?))
    }
    /// Index of the field called `name`.
    pub fn field_index(&self, name: &str) -> Result<usize, ArenaError> {
        self.fields
            .iter()
            .position(|f| f.name == name)
            .ok_or_else(|| ArenaError::FieldNotFound { name: name.to_string() })
    }
    /// `(plane, byte offset in that plane's arena)` of field `field`.
    pub fn field_place(&self, field: usize) -> Result<(usize, u64), ArenaError> {
        let plane = *self
            .assignment
            .get(field)
            .ok_or(ArenaError::FieldOutOfRange { field, fields: self.fields.len() })?;
        let offset = self.planes[plane]
            .fields
            .iter()
            .find(|pf| pf.field == field)
            .map(|pf| pf.offset)
            .ok_or(ArenaError::FieldOutOfRange { field, fields: self.fields.len() })?;
        Ok((plane, offset))
    }
    /// Largest `max(256, align)` over the fields placed in `plane`: what that plane's slot
    /// stride and arena buffer base must be multiples of. Per plane, because a plane's
    /// view holds only its own fields (a 1024-B-aligned state window in the 512-B plane
    /// asks nothing of the 128-B plane's stride).
    pub fn max_align(&self, plane: usize) -> Result<u64, ArenaError> {
        Ok(self
            .plane(plane)?
            .fields
            .iter()
            .map(|pf| self.fields[pf.field].start_align())
            .max()
            .unwrap_or(FIELD_ALIGN))
    }
    /// Checkpoint ranges of the fields placed in `plane`, in that plane's slot bytes.
    pub fn plane_checkpoint_ranges(&self, plane: usize) -> Result<Vec<(u64, u64)>, ArenaError> {
        let p = self.plane(plane)?;
        let fields: Vec<StateField> = p.fields.iter().map(|pf| self.fields[pf.field].clone()).collect();
        checkpoint_ranges(&fields)
    }

    fn plane(&self, plane: usize) -> Result<&PlaneArena, ArenaError> {
        self.planes.get(plane).ok_or(ArenaError::PlaneOutOfRange { plane, planes: self.planes.len() })
    }

    fn slot_stride(&self, plane: usize, slot_rows: i64) -> Result<u64, ArenaError> {
        if slot_rows < self.arena_rows {
            return Err(ArenaError::SlotRowsTooSmall { slot_rows, arena_rows: self.arena_rows });
        }
        Ok(mul(to_u64(slot_rows, "slot rows")?, self.plane(plane)?.width, "slot stride")?)
    }

    /// Byte offset, from the start of `plane`, of the slot at `position` of the carved
    /// `geom` (its arena comes first). Validates the position against the geometry and
    /// honours its `slot_origin`; state code should write only `geom.live_positions()`.
    pub fn slot_base(
        &self,
        geom: &UnifiedPoolGeometry,
        plane: usize,
        position: i64,
    ) -> Result<u64, ArenaError> {
        if geom.arena_rows != self.arena_rows {
            return Err(ArenaError::ArenaRowsMismatch { layout: self.arena_rows, geometry: geom.arena_rows });
        }
        let width = self.plane(plane)?.width;
        let (start, _) = geom
            .slot_span(position)
            .map_err(|_| ArenaError::PositionOutOfRange { position, positions: geom.slot_positions })?;
        Ok(mul(to_u64(start, "slot row")?, width, "slot base")?)
    }

    /// Byte offset, from the start of its plane, of `layer` of `field` at slot `position`
    /// (§2.4): `position × slot_rows × width + field offset + layer × per-layer bytes`.
    /// Returns `(plane, offset)`. Positions count from the plane's row 0 (a carve whose
    /// `slot_origin` is 0, as every plan of [`crate::sizing`] is).
    pub fn byte_offset(
        &self,
        position: i64,
        field: usize,
        layer: u64,
        slot_rows: i64,
    ) -> Result<(usize, u64), ArenaError> {
        let (plane, field_offset) = self.field_place(field)?;
        let f = &self.fields[field];
        if layer >= f.layers {
            return Err(ArenaError::LayerOutOfRange { name: f.name.clone(), layer, layers: f.layers });
        }
        let pos = u64::try_from(position)
            .map_err(|_| ArenaError::PositionOutOfRange { position, positions: i64::MAX })?;
        let slot = mul(pos, self.slot_stride(plane, slot_rows)?, "slot byte offset")?;
        let in_field = mul(layer, f.per_layer_bytes()?, "layer byte offset")?;
        Ok((plane, add(add(slot, field_offset, "field byte offset")?, in_field, "field byte offset")?))
    }

    /// The tensor a kernel binds for `field`: `[layers][slot_positions][shape…]`, element
    /// strides `(prod(shape), slot_rows × width / itemsize, …contiguous)`.
    pub fn field_view(
        &self,
        field: usize,
        slot_rows: i64,
        slot_positions: i64,
    ) -> Result<FieldView, ArenaError> {
        let (plane, offset) = self.field_place(field)?;
        let f = &self.fields[field];
        let stride_bytes = self.slot_stride(plane, slot_rows)?;
        let positions = to_u64(slot_positions, "slot positions")?;
        let item = f.dtype.itemsize();
        let mut dims = vec![f.layers, positions];
        dims.extend(&f.shape);
        let mut strides = vec![f.per_layer_elems()?, stride_bytes / item];
        let mut inner = Vec::with_capacity(f.shape.len());
        let mut acc = 1u64;
        for &d in f.shape.iter().rev() {
            inner.push(acc);
            acc = mul(acc, d, "field strides")?;
        }
        strides.extend(inner.into_iter().rev());
        Ok(FieldView { plane, offset, dtype: f.dtype, dims, strides })
    }

    /// Memsets that initialise the arena of slot `position` (§2.4): in every plane the whole
    /// `arena_rows × width` bytes, zero except score fields (−inf). Covering the padding too
    /// matters because a position that becomes live held block data before.
    pub fn fill_runs(&self, position: i64, slot_rows: i64) -> Result<Vec<PlaneFill>, ArenaError> {
        let pos = u64::try_from(position)
            .map_err(|_| ArenaError::PositionOutOfRange { position, positions: i64::MAX })?;
        let arena_rows = to_u64(self.arena_rows, "arena rows")?;
        let mut out: Vec<PlaneFill> = Vec::new();
        let mut push = |run: PlaneFill| {
            if run.bytes == 0 {
                return;
            }
            if let Some(last) = out.last_mut() {
                if last.plane == run.plane
                    && last.pattern == run.pattern
                    && last.offset + last.bytes == run.offset
                {
                    last.bytes += run.bytes;
                    return;
                }
            }
            out.push(run);
        };
        for (p, plane) in self.planes.iter().enumerate() {
            let base = mul(pos, self.slot_stride(p, slot_rows)?, "slot byte offset")?;
            let end = add(base, mul(arena_rows, plane.width, "arena bytes")?, "arena end")?;
            let mut cursor = base;
            for pf in &plane.fields {
                let f = &self.fields[pf.field];
                let bytes = f.bytes()?;
                let pattern = f.fill.pattern(f.dtype);
                if pattern != 0 && bytes % 4 != 0 {
                    return Err(ArenaError::FillNotWordAligned { name: f.name.clone(), bytes });
                }
                let start = add(base, pf.offset, "field start")?;
                push(PlaneFill { plane: p, offset: cursor, bytes: start - cursor, pattern: 0 });
                let (layer_bytes, lead) = (f.per_layer_bytes()?, f.fill.lead_zero_bytes(f.dtype));
                if lead == 0 {
                    push(PlaneFill { plane: p, offset: start, bytes, pattern });
                } else {
                    // Each layer's tensor: its leading element zero, the rest the pattern.
                    for layer in 0..f.layers {
                        let at = add(start, mul(layer, layer_bytes, "field layer offset")?, "field layer")?;
                        let lead = lead.min(layer_bytes);
                        push(PlaneFill { plane: p, offset: at, bytes: lead, pattern: 0 });
                        push(PlaneFill { plane: p, offset: at + lead, bytes: layer_bytes - lead, pattern });
                    }
                }
                cursor = start + bytes;
            }
            push(PlaneFill { plane: p, offset: cursor, bytes: end - cursor, pattern: 0 });
        }
        Ok(out)
    }

    /// Check a plane's arena binding against the §2.4 preconditions.
    pub fn check_binding(&self, b: &ArenaBinding) -> Result<(), ArenaError> {
        let plane = self.plane(b.plane)?;
        let align = self.max_align(b.plane)?;
        if b.stride < plane.entry_bytes {
            return Err(ArenaError::SlotStrideTooSmall {
                plane: b.plane,
                stride: b.stride,
                entry_bytes: plane.entry_bytes,
            });
        }
        if b.stride % align != 0 {
            return Err(ArenaError::SlotStrideMisaligned { plane: b.plane, stride: b.stride, align });
        }
        if b.entries < 1 {
            return Err(ArenaError::NoEntries);
        }
        if !(0..=b.entries).contains(&b.live) {
            return Err(ArenaError::LiveOutOfRange { live: b.live, entries: b.entries });
        }
        if b.base % align != 0 {
            return Err(ArenaError::BufferMisaligned { plane: b.plane, base: b.base, align });
        }
        let before_last = mul(to_u64(b.entries - 1, "entries")?, b.stride, "arena buffer bytes")?;
        let needed = add(before_last, plane.entry_bytes, "arena buffer bytes")?;
        if b.len < needed {
            return Err(ArenaError::BufferTooShort { plane: b.plane, len: b.len, needed });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
