//! A byte budget becomes block and slot counts at a fixed plane capacity (`pool-runtime.md` §3).
//!
//! Two entry classes are priced from a geometry built at capacity (0, 0): a **page** (one
//! block: every plane's envelope rows plus one indexer block per CSA layer) and a **slot**
//! (one request: every plane's `slot_rows`, compressor state and windows together).
//!
//! # What this plan does differently from the spec's tight fit
//!
//! The spec's split (`blocks = (B − m·slot_bytes) // page_bytes`, then a tight plane rounded
//! up to whole slots) can overshoot the budget by up to one slot plus alignment (25.1 MB on
//! Pro k=1 fp8). This plan never exceeds the budget, and it carves at an explicit, fixed
//! `plane_rows` so the elastic boundary (§5.4) can move without moving any address:
//!
//! * The plane is `slot_positions × slot_rows` rows: a whole number of slots, since rows above
//!   the last whole slot could hold neither a block nor a slot.
//! * The indexer (its own allocation, addressed by block id) is sized for `max_blocks`, the
//!   most blocks the plane can hold beside `min_slots` slots — by default 0, i.e. every row
//!   of the plane may become block rows. That indexer headroom is paid from the budget.
//! * Every plane and indexer pool is priced rounded up to 256 B (`plan_regions`), and a
//!   caller-supplied `overhead_bytes` (index and metadata buffers the pool keeps) comes off
//!   the budget first.
//! * `slot_positions` is the largest count whose total fits; at the planned split
//!   (`num_slots = max_num_seqs`) the blocks are `floor((positions − m) × S / E)`.
//!
//! Consequence: `num_blocks` never exceeds the spec's tight-fit count. With
//! `min_slots = max_num_seqs` (no elastic block growth) it sits at most `ceil(S / E) + 3`
//! blocks under it — the whole-slot rounding the tight fit overshoots by, taken down instead.
//! With the default `min_slots = 0` it sits further under by the indexer headroom, about
//! `m × S / E × indexer_block_bytes / page_bytes` blocks (≈0.8 % on Flash k=0 fp8, ≈1.4 % on
//! Pro k=1 at 100 GiB, m = 256).
//!
//! Blocks at 100 GiB, m = 256 (fp8 KV and FP8 indexer unless noted):
//!
//! | config            | spec table | `min_slots = 256` | `min_slots = 0` (default) |
//! |-------------------|-----------:|------------------:|--------------------------:|
//! | Flash k=0         |     96,970 |            96,957 |                    96,146 |
//! | Flash k=1         |     96,741 |            96,725 |                    95,888 |
//! | Flash k=1, FP4    |    105,257 |           105,239 |                   104,761 |
//! | Flash k=1 bf16    |     64,184 |            64,172 |                    63,785 |
//! | Pro k=1           |     66,046 |            66,044 |                    65,136 |
//! | Pro k=1, FP4      |     71,847 |            71,829 |                    71,323 |

use crate::arena::{plan_regions, ArenaError, ArenaLayout};
use crate::checked::{add, mul};
use crate::geometry::{GeometryError, UnifiedPoolGeometry, MAX_PLANE_ROWS};
use crate::model::ModelShape;
use thiserror::Error;

crate::checked::overflow_into!(SizingError);

mod dtype;
#[cfg(test)]
mod tests;

pub use dtype::*;

crate::variant::variant_names! {
/// Everything sizing refuses, with the numbers.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum SizingError {
    #[error(transparent)]
    /// A failure of the layer below ([`ArenaError`]).
    Arena(#[from] ArenaError),
    #[error(transparent)]
    /// A failure of the layer below ([`GeometryError`]).
    Geometry(#[from] GeometryError),
    #[error("max_num_seqs must be at least 1, got {got}")]
    /// `max_num_seqs` must be at least 1, got `got`.
    NoSlots {
        /// The value given.
        got: i64,
    },
    #[error("min_slots {min_slots} outside 0..={max_num_seqs}")]
    /// `min_slots` `min_slots` outside 0..=`max_num_seqs`.
    MinSlots {
        /// The plan's min_slots.
        min_slots: i64,
        /// The plan's max_num_seqs.
        max_num_seqs: i64,
    },
    #[error("the model has no CSA or HCA layer, so a block holds no rows")]
    /// The model has no CSA or HCA layer, so a block holds no rows.
    NoCompressedLayers,
    #[error(
        "budget of {budget} B is too small: {num_slots} slots of {slot_bytes} B and one block of \
         {page_bytes} B need {required} B with the indexer, alignment and {overhead} B of overhead"
    )]
    /// Budget of `budget` B is too small: `num_slots` slots of `slot_bytes` B and one block of `page_bytes` B need `required` B with the indexer, alignment and `overhead` B of overhead.
    BudgetTooSmall {
        /// The budget given.
        budget: u64,
        /// Bytes the minimum needs.
        required: u64,
        /// Slots there are.
        num_slots: i64,
        /// Bytes of one slot.
        slot_bytes: u64,
        /// Bytes of one block.
        page_bytes: u64,
        /// Persistent buffers charged to the budget.
        overhead: u64,
    },
    #[error(
        "{kv} rows do not fit a {family:?} model (V4.1: bf16 or flashmla-v41; V4: fp8, bf16 or flashmla-v4)"
    )]
    /// A KV dtype the model family's rows have no form in (`KvDtype::fits`).
    KvDtypeUnsupported {
        /// The model family.
        family: crate::model::ModelFamily,
        /// The dtype asked for.
        kv: &'static str,
    },
    #[error("{what} {name} is refused on {arch}: {why}")]
    /// A dtype no kernel on the target architecture reads ([`GpuArch::refuses_kv`],
    /// [`GpuArch::refuses_indexer`]).
    UnreadableOnArch {
        /// `KV dtype` or `indexer`.
        what: &'static str,
        /// The dtype's name.
        name: &'static str,
        /// The architecture.
        arch: &'static str,
        /// Why, and what to use instead.
        why: &'static str,
    },
    #[error("indexer {indexer} does not fit a {family:?} model (ATOM's preshuffled caches are V4's)")]
    /// An indexer dtype the model family's index keys have no form in.
    IndexerUnsupported {
        /// The model family.
        family: crate::model::ModelFamily,
        /// The indexer dtype asked for.
        indexer: &'static str,
    },
    #[error("arithmetic overflow computing {what}")]
    /// Arithmetic overflow computing `what`.
    Overflow {
        /// What was computed or checked.
        what: &'static str,
    },
    #[error("the carved pool has {what} {carved}, sizing planned {planned}")]
    /// The carved pool has `what` `carved`, sizing planned `planned`.
    CarveMismatch {
        /// What was computed or checked.
        what: &'static str,
        /// Bytes planned.
        planned: u64,
        /// Bytes carved.
        carved: u64,
    },
    #[error("empty byte count")]
    /// Empty byte count.
    EmptyBytes,
    #[error("{text:?} is not a byte count (digits with an optional unit: 1234, 512MiB, 80GB)")]
    /// `text` is not a byte count (digits with an optional unit: 1234, 512MiB, 80GB).
    BadBytes {
        /// The text given.
        text: String,
    },
    #[error("{text:?}: unknown unit {unit:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")]
    /// `text`: unknown unit `unit` (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
    UnknownUnit {
        /// The text given.
        text: String,
        /// The unit given.
        unit: String,
    },
    #[error("{text:?} does not fit 64 bits of bytes")]
    /// `text` does not fit 64 bits of bytes.
    BytesOverflow {
        /// The text given.
        text: String,
    },
}
}

fn to_u64(x: i64, what: &'static str) -> Result<u64, SizingError> {
    u64::try_from(x).map_err(|_| SizingError::Overflow { what })
}
fn to_i64(x: u64, what: &'static str) -> Result<i64, SizingError> {
    i64::try_from(x).map_err(|_| SizingError::Overflow { what })
}

/// A model's pool layout at one dtype pair, priced at capacity (0, 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// The model.
    pub model: ModelShape,
    /// KV dtype (fixes the planes).
    pub kv: KvDtype,
    /// Indexer cache dtype.
    pub indexer: IndexerDtype,
    /// The compressor-state arena at these planes.
    pub arena: ArenaLayout,
    /// The layout at capacity (0, 0): what prices pages and slots.
    pub geometry: UnifiedPoolGeometry,
}

impl PoolLayout {
    /// The layout of `model` at `kv` / `indexer`, priced at capacity (0, 0).
    pub fn new(model: &ModelShape, kv: KvDtype, indexer: IndexerDtype) -> Result<Self, SizingError> {
        check_dtypes(model, kv, indexer)?;
        // A paged format's unit of contiguous bytes is a page: the arena, every slot and every
        // envelope are whole pages (the arena's bytes then never share a page with window rows,
        // whose data and scales sit apart inside it).
        let page = kv.page_rows();
        let arena = ArenaLayout::for_model(model, &kv.plane_widths())?.page_aligned(page)?;
        let mut spec = model
            .geometry_spec(0, 0)
            .arena_rows(arena.arena_rows())
            .slot_align_rows(arena.slot_align_rows())
            .envelope_align_rows(page);
        if kv.compressed_format().is_some() {
            let plane: u64 = kv.plane_widths().iter().sum();
            spec = spec
                .packed_rows(to_i64(kv.compressed_row_bytes(), "row bytes")?, to_i64(plane, "row bytes")?);
        }
        let geometry = spec.build()?;
        Ok(PoolLayout { model: model.clone(), kv, indexer, arena, geometry })
    }

    /// The spec of this layout's rows on `arch` ([`KvSpec::new`]).
    pub fn kv_spec(&self, arch: Option<GpuArch>) -> Result<KvSpec, SizingError> {
        KvSpec::new(&self.model, self.kv, self.indexer, arch)
    }
    /// Row bytes of each plane.
    pub fn widths(&self) -> Vec<u64> {
        self.kv.plane_widths()
    }
    /// Number of CSA layers: the indexer's layer count.
    pub fn n_csa(&self) -> u64 {
        self.model.n_csa() as u64
    }
    /// Index-key rows of one block over every layer that owns index keys
    /// ([`ModelShape::indexer_layers`]): `block_size / ratio` each (64 per V4 CSA layer; 640
    /// for V4.1-Flash at block 256).
    pub fn indexer_block_rows(&self) -> Result<u64, SizingError> {
        let g = &self.geometry;
        self.model.indexer_layers().into_iter().try_fold(0u64, |acc, l| {
            let rows = g.layer_class(l)?.block_rows;
            Ok(add(acc, to_u64(rows, "indexer rows")?, "indexer rows")?)
        })
    }
    /// Indexer bytes of one block, every indexer layer, all pools.
    pub fn indexer_block_bytes(&self) -> Result<u64, SizingError> {
        let row: u64 = self.indexer.pool_row_bytes().iter().sum();
        Ok(mul(self.indexer_block_rows()?, row, "indexer block bytes")?)
    }
    /// Bytes of one block: `Σ_planes envelope_rows × width + indexer_block_bytes`.
    pub fn page_bytes(&self) -> Result<u64, SizingError> {
        let e = to_u64(self.geometry.envelope_rows, "envelope rows")?;
        let planes = mul(e, self.widths().iter().sum(), "page bytes")?;
        Ok(add(planes, self.indexer_block_bytes()?, "page bytes")?)
    }
    /// Bytes of one slot: `Σ_planes slot_rows × width`.
    pub fn slot_bytes(&self) -> Result<u64, SizingError> {
        Ok(mul(to_u64(self.geometry.slot_rows, "slot rows")?, self.widths().iter().sum(), "slot bytes")?)
    }
    /// Bytes of each indexer pool sized for `blocks` blocks, in pool order.
    pub fn indexer_pool_bytes(&self, blocks: i64) -> Result<Vec<u64>, SizingError> {
        let rows = mul(self.indexer_block_rows()?, to_u64(blocks, "indexer blocks")?, "indexer pool bytes")?;
        self.indexer.pool_row_bytes().iter().map(|&b| Ok(mul(rows, b, "indexer pool bytes")?)).collect()
    }
    /// Bytes of each plane at `plane_rows` rows, in plane order, its view lead included.
    pub fn plane_bytes(&self, plane_rows: i64) -> Result<Vec<u64>, SizingError> {
        let rows = to_u64(add(plane_rows, self.geometry.view_lead_rows, "plane rows")?, "plane rows")?;
        self.widths().iter().map(|&w| Ok(mul(rows, w, "plane bytes")?)).collect()
    }
    /// The same layout carved at a split and a fixed plane.
    pub fn carve(
        &self,
        num_blocks: i64,
        num_slots: i64,
        plane_rows: i64,
    ) -> Result<UnifiedPoolGeometry, SizingError> {
        Ok(self.geometry.with_capacity(num_blocks, num_slots, Some(plane_rows))?)
    }
}

/// What a pool's rows are, carried once: the facts a writer, a path, a gather, a binding or
/// the CLI asks instead of being handed them again (vLLM's `KVCacheSpec`). A plan makes it
/// ([`Plan::kv_spec`], [`PoolLayout::kv_spec`]) and the pool holds it
/// (`crate::pool::PoolSpec::kv_spec`): the row format and the compressed rows' packing, the
/// indexer format, the sliding window, the index top-k, the MTP steps, the architecture.
/// Nothing reads a format back from byte widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpec {
    family: crate::model::ModelFamily,
    kv: KvDtype,
    indexer: IndexerDtype,
    window: i32,
    index_topk: i32,
    spec_steps: i64,
    arch: Option<GpuArch>,
}

impl KvSpec {
    /// The spec of `model`'s rows in `kv` / `indexer` on `arch` (`None`: NVIDIA or the host):
    /// the model's window, index top-k and MTP steps. Refuses what [`PoolLayout::new`] and
    /// [`plan`] refuse (a dtype the family has no form in, one the architecture cannot read)
    /// and a window or top-k past `i32` (the kernels' width).
    pub fn new(
        model: &ModelShape,
        kv: KvDtype,
        indexer: IndexerDtype,
        arch: Option<GpuArch>,
    ) -> Result<KvSpec, SizingError> {
        check_dtypes(model, kv, indexer)?;
        if let Some(arch) = arch {
            check_arch(arch, kv, indexer)?;
        }
        let i32_of = |x: i64, what| i32::try_from(x).map_err(|_| SizingError::Overflow { what });
        Ok(KvSpec {
            family: model.family,
            kv,
            indexer,
            window: i32_of(model.sliding_window, "sliding window")?,
            index_topk: i32_of(model.index_topk, "index top-k")?,
            spec_steps: model.spec_steps,
            arch,
        })
    }
    /// The model family.
    pub fn family(&self) -> crate::model::ModelFamily {
        self.family
    }
    /// The KV dtype (the name the CLI and the bindings take).
    pub fn kv(&self) -> KvDtype {
        self.kv
    }
    /// What every byte of a plane row means.
    pub fn row_format(&self) -> &'static crate::format::RowFormat {
        self.kv.row_format().format()
    }
    /// The compressed rows' format where they are packed at their own width
    /// ([`KvSpec::packed`]); `None`: compressed rows are plane rows.
    pub fn compressed_format(&self) -> Option<&'static crate::format::RowFormat> {
        self.kv.compressed_format().map(crate::format::RowFormatId::format)
    }
    /// The format compressed rows are in: [`KvSpec::compressed_format`], else the planes'.
    pub fn compressed_row_format(&self) -> &'static crate::format::RowFormat {
        self.compressed_format().unwrap_or(self.row_format())
    }
    /// The packing of compressed rows beside plane rows (`None`: unpacked): the geometry a pool
    /// of this spec is carved with.
    pub fn packed(&self) -> Option<crate::geometry::PackedRows> {
        let c = self.compressed_format()?;
        Some(crate::geometry::PackedRows {
            compressed: i64::try_from(c.bytes_per_token()).ok()?,
            plane: i64::try_from(self.row_format().bytes_per_token()).ok()?,
        })
    }
    /// The indexer cache's format.
    pub fn indexer(&self) -> IndexerDtype {
        self.indexer
    }
    /// The sliding window (`win`) every capacity and path defaults to.
    pub fn window(&self) -> i32 {
        self.window
    }
    /// The CSA top-k every capacity and path defaults to.
    pub fn index_topk(&self) -> i32 {
        self.index_topk
    }
    /// MTP (speculative) steps a decode step carries beside its token.
    pub fn spec_steps(&self) -> i64 {
        self.spec_steps
    }
    /// The AMD architecture planned for (`None`: NVIDIA or the host).
    pub fn arch(&self) -> Option<GpuArch> {
        self.arch
    }
}

/// What [`PoolLayout::new`] refuses of a dtype pair for `model`.
fn check_dtypes(model: &ModelShape, kv: KvDtype, indexer: IndexerDtype) -> Result<(), SizingError> {
    if !kv.fits(model.family) {
        return Err(SizingError::KvDtypeUnsupported { family: model.family, kv: kv.name() });
    }
    if matches!(indexer, IndexerDtype::AtomFp8 | IndexerDtype::AtomFp8Fnuz)
        && model.family != crate::model::ModelFamily::V4
    {
        return Err(SizingError::IndexerUnsupported { family: model.family, indexer: indexer.name() });
    }
    Ok(())
}

/// What [`plan`] refuses of a dtype pair on `arch`.
fn check_arch(arch: GpuArch, kv: KvDtype, indexer: IndexerDtype) -> Result<(), SizingError> {
    let refused = [
        ("KV dtype", kv.name(), arch.refuses_kv(kv)),
        ("indexer", indexer.name(), arch.refuses_indexer(indexer)),
    ];
    match refused.into_iter().find(|r| r.2.is_some()) {
        Some((what, name, Some(why))) => {
            Err(SizingError::UnreadableOnArch { what, name, arch: arch.name(), why })
        }
        _ => Ok(()),
    }
}

/// One row format's capacity at a plan's budget ([`Plan::capacity_by_format`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FormatCapacity {
    /// The row format.
    pub format: crate::format::RowFormatId,
    /// Bytes one compressed (block) row takes in it.
    pub block_row_bytes: u64,
    /// Bytes one window (slot) row takes in it.
    pub window_row_bytes: u64,
    /// The spec's tight fit (`(B − m·slot_bytes) // page_bytes`) at these row bytes.
    pub tight_fit_blocks: i64,
}

impl FormatCapacity {
    /// History tokens the blocks hold.
    pub fn tokens(&self, block_size: i64) -> i64 {
        self.tight_fit_blocks.saturating_mul(block_size)
    }
}

impl Plan {
    /// Every row format the model's rows have a form in, priced by the spec's tight fit at this
    /// plan's budget and slot count: a format a pool carves ([`KvDtype`]) at its own layout
    /// (its envelope, entry and arena rows, page alignment included; V4.1's fp4 format with its
    /// compressed rows packed at 288 B beside 528-B windows). The capacity
    /// one format gains over another, like for like.
    pub fn capacity_by_format(&self) -> Result<Vec<FormatCapacity>, SizingError> {
        use crate::format::ALL;
        let model = &self.layout.model;
        let net = self.budget_bytes - self.overhead_bytes.min(self.budget_bytes);
        let m = to_u64(self.num_slots, "slots")?;
        let tight = |page: u64, slot: u64| -> Result<i64, SizingError> {
            to_i64(net.saturating_sub(mul(m, slot, "slot region")?) / page, "blocks")
        };
        let mut out = Vec::new();
        for f in ALL {
            // The dtype a format names: its planes' format, or its compressed rows' (packed).
            let Some(kv) = KvDtype::ALL.into_iter().find(|k| k.named_format() == f) else {
                continue;
            };
            if !kv.fits(model.family) {
                continue;
            }
            let l = PoolLayout::new(model, kv, self.layout.indexer)?;
            out.push(FormatCapacity {
                format: f,
                block_row_bytes: kv.compressed_row_bytes(),
                window_row_bytes: kv.plane_widths().iter().sum(),
                tight_fit_blocks: tight(l.page_bytes()?, l.slot_bytes()?)?,
            });
        }
        Ok(out)
    }
}

/// What to size: dtypes, the admitted-request count, the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanRequest {
    /// KV dtype.
    pub kv: KvDtype,
    /// Indexer cache dtype.
    pub indexer: IndexerDtype,
    /// `max_num_seqs`: the planned split has exactly one slot per admitted request.
    pub max_num_seqs: i64,
    /// Everything the pool may allocate, in bytes.
    pub budget_bytes: u64,
    /// The fewest slots the elastic boundary may shrink to; the indexer is sized for the
    /// blocks the plane holds beside that many slots. 0 (the default) allows every row.
    pub min_slots: i64,
    /// The pool's own persistent buffers (index buffers, metadata) the caller charges to
    /// the same budget; taken off before anything else.
    pub overhead_bytes: u64,
    /// The AMD architecture the pool's bytes are for (`None`: NVIDIA or the host): a dtype
    /// no kernel there reads is refused ([`GpuArch::refuses_kv`]).
    pub arch: Option<GpuArch>,
}

crate::setters::with_setters!(PlanRequest {
    with_min_slots(min_slots: i64),
    with_overhead_bytes(overhead_bytes: u64),
    with_arch(arch: Some(GpuArch)),
});

impl PlanRequest {
    /// Size `max_num_seqs` slots in `budget_bytes`, no minimum, no overhead.
    pub fn new(kv: KvDtype, indexer: IndexerDtype, max_num_seqs: i64, budget_bytes: u64) -> Self {
        PlanRequest { kv, indexer, max_num_seqs, budget_bytes, min_slots: 0, overhead_bytes: 0, arch: None }
    }
}

/// A sized pool: counts, bytes per part, and the geometry to carve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The layout sized.
    pub layout: PoolLayout,
    /// The AMD architecture it was planned for ([`PlanRequest::arch`]).
    pub arch: Option<GpuArch>,
    /// Bytes of one block (every plane plus its indexer share).
    pub page_bytes: u64,
    /// Bytes of one slot (every plane).
    pub slot_bytes: u64,
    /// Blocks at the planned split (`num_slots` slots).
    pub num_blocks: i64,
    /// Slots at the planned split: `max_num_seqs`.
    pub num_slots: i64,
    /// Blocks the indexer is sized for: what the plane holds beside `min_slots` slots.
    pub max_blocks: i64,
    /// Fewest slots the boundary may shrink to.
    pub min_slots: i64,
    /// Rows of each plane.
    pub plane_rows: i64,
    /// Slot positions the plane is numbered by.
    pub slot_positions: i64,
    /// Compressed-history tokens at the planned split: `num_blocks × block_size`.
    pub tokens: i64,
    /// Bytes of each plane, in plane order, and their offsets in the one plane allocation.
    pub plane_bytes: Vec<u64>,
    /// Offset of each plane in the plane allocation.
    pub plane_offsets: Vec<u64>,
    /// The plane allocation (256-B aligned regions, total rounded to 256).
    pub planes_total_bytes: u64,
    /// Bytes of each indexer pool (sized for `max_blocks`) and their aligned total.
    pub indexer_pool_bytes: Vec<u64>,
    /// The indexer allocation (aligned).
    pub indexer_total_bytes: u64,
    /// Persistent buffers charged to the budget.
    pub overhead_bytes: u64,
    /// `planes_total_bytes + indexer_total_bytes + overhead_bytes` ≤ `budget_bytes`.
    pub total_bytes: u64,
    /// The budget asked for.
    pub budget_bytes: u64,
    /// Plane rows neither a block nor a slot holds at the planned split.
    pub rows_wasted: i64,
    /// The spec's tight-fit count on the same budget net of overhead, for comparison.
    pub tight_fit_blocks: i64,
    /// True when the plane stopped at the i32 row limit, not at the budget.
    pub plane_capped: bool,
    /// The carve: `(num_blocks, num_slots)` at `plane_rows`.
    pub geometry: UnifiedPoolGeometry,
}

impl Plan {
    /// The spec of the planned pool's rows: what [`crate::pool::PoolSpec::from_plan`] hands
    /// the pool.
    pub fn kv_spec(&self) -> Result<KvSpec, SizingError> {
        self.layout.kv_spec(self.arch)
    }
    /// The §4 start-up cross-check: page and slot bytes recomputed from the geometry the
    /// pool actually carved (and its plane and row counts) must equal what sizing used.
    /// Checkpoint image bytes and the layout id are compared by the caller through
    /// [`crate::checkpoint`], which prices them from the same carved geometry.
    pub fn verify_carve(&self, carved: &UnifiedPoolGeometry) -> Result<(), SizingError> {
        let row_bytes: u64 = self.layout.widths().iter().sum();
        let e = to_u64(carved.envelope_rows, "envelope rows")?;
        let page = add(mul(e, row_bytes, "page bytes")?, self.layout.indexer_block_bytes()?, "page bytes")?;
        let slot = mul(to_u64(carved.slot_rows, "slot rows")?, row_bytes, "slot bytes")?;
        let checks = [
            ("page_bytes", self.page_bytes, page),
            ("slot_bytes", self.slot_bytes, slot),
            ("plane_rows", to_u64(self.plane_rows, "plane rows")?, to_u64(carved.plane_rows, "plane rows")?),
            (
                "slot_positions",
                to_u64(self.slot_positions, "positions")?,
                to_u64(carved.slot_positions, "positions")?,
            ),
            ("arena_rows", to_u64(self.geometry.arena_rows, "arena")?, to_u64(carved.arena_rows, "arena")?),
        ];
        for (what, planned, got) in checks {
            if planned != got {
                return Err(SizingError::CarveMismatch { what, planned, carved: got });
            }
        }
        Ok(())
    }
}

/// Bytes the allocations take for a plane of `positions` slots: `(planes, indexer, max_blocks)`.
fn cost(layout: &PoolLayout, positions: i64, min_slots: i64) -> Result<(u64, u64, i64), SizingError> {
    let s = layout.geometry.slot_rows;
    let e = layout.geometry.envelope_rows;
    let rows = positions.checked_mul(s).ok_or(SizingError::Overflow { what: "plane rows" })?;
    let planes = plan_regions(&layout.plane_bytes(rows)?)?.1;
    let max_blocks = (positions - min_slots).max(0) * s / e;
    let indexer = plan_regions(&layout.indexer_pool_bytes(max_blocks)?)?.1;
    Ok((planes, indexer, max_blocks))
}

/// Size a pool for `model` (§3) within `req.budget_bytes`; see the module docs for how this
/// differs from the spec's tight fit.
pub fn plan(model: &ModelShape, req: &PlanRequest) -> Result<Plan, SizingError> {
    let m = req.max_num_seqs;
    if m < 1 {
        return Err(SizingError::NoSlots { got: m });
    }
    if !(0..=m).contains(&req.min_slots) {
        return Err(SizingError::MinSlots { min_slots: req.min_slots, max_num_seqs: m });
    }
    if let Some(arch) = req.arch {
        check_arch(arch, req.kv, req.indexer)?;
    }
    let layout = PoolLayout::new(model, req.kv, req.indexer)?;
    let (s, e) = (layout.geometry.slot_rows, layout.geometry.envelope_rows);
    if e == 0 {
        return Err(SizingError::NoCompressedLayers);
    }
    let page_bytes = layout.page_bytes()?;
    let slot_bytes = layout.slot_bytes()?;
    let fits = |positions: i64| -> Result<bool, SizingError> {
        let (planes, indexer, _) = cost(&layout, positions, req.min_slots)?;
        Ok(add(add(planes, indexer, "total bytes")?, req.overhead_bytes, "total bytes")? <= req.budget_bytes)
    };

    // Fewest positions that hold m slots and one block.
    let lo = m.checked_add((e + s - 1) / s).ok_or(SizingError::Overflow { what: "slot positions" })?;
    let cap = MAX_PLANE_ROWS / s;
    if lo > cap {
        return Err(GeometryError::PlaneExceedsI32 { plane_rows: lo.saturating_mul(s) }.into());
    }
    if !fits(lo)? {
        let (planes, indexer, _) = cost(&layout, lo, req.min_slots)?;
        return Err(SizingError::BudgetTooSmall {
            budget: req.budget_bytes,
            required: planes.saturating_add(indexer).saturating_add(req.overhead_bytes),
            num_slots: m,
            slot_bytes,
            page_bytes,
            overhead: req.overhead_bytes,
        });
    }
    // The planes alone outgrow the budget past this many positions.
    let row_bytes: u64 = layout.widths().iter().sum();
    let by_budget = req.budget_bytes / mul(to_u64(s, "slot rows")?, row_bytes, "slot bytes")?;
    let hi = cap.min(to_i64(by_budget, "slot positions")?.saturating_add(1));
    // Largest feasible positions in [lo, hi]: cost grows with positions.
    let (mut good, mut bad) = (lo, hi.saturating_add(1));
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    let positions = good;
    let plane_capped = positions == cap && fits(cap)?;
    let plane_rows = positions * s;
    let (planes_total, indexer_total, max_blocks) = cost(&layout, positions, req.min_slots)?;
    let num_blocks = (positions - m) * s / e;
    let geometry = layout.carve(num_blocks, m, plane_rows)?;
    let plane_bytes = layout.plane_bytes(plane_rows)?;
    let plane_offsets = plan_regions(&plane_bytes)?.0;
    let indexer_pool_bytes = layout.indexer_pool_bytes(max_blocks)?;
    let total_bytes = planes_total + indexer_total + req.overhead_bytes;
    let net = req.budget_bytes - req.overhead_bytes.min(req.budget_bytes);
    let tight_fit_blocks = to_i64(
        net.saturating_sub(mul(to_u64(m, "slots")?, slot_bytes, "slot region")?) / page_bytes,
        "blocks",
    )?;
    Ok(Plan {
        arch: req.arch,
        page_bytes,
        slot_bytes,
        num_blocks,
        num_slots: m,
        max_blocks,
        min_slots: req.min_slots,
        plane_rows,
        slot_positions: geometry.slot_positions,
        tokens: num_blocks.checked_mul(model.block_size).ok_or(SizingError::Overflow { what: "tokens" })?,
        plane_bytes,
        plane_offsets,
        planes_total_bytes: planes_total,
        indexer_pool_bytes,
        indexer_total_bytes: indexer_total,
        overhead_bytes: req.overhead_bytes,
        total_bytes,
        budget_bytes: req.budget_bytes,
        rows_wasted: plane_rows - num_blocks * e - m * s,
        tight_fit_blocks,
        plane_capped,
        geometry,
        layout,
    })
}

/// Parse a byte count: digits with an optional fractional part and unit. Decimal units
/// (`KB`, `MB`, `GB`, `TB`) are powers of 1000, binary ones (`KiB` … `TiB`) powers of 1024,
/// `B` or none is bytes; units are case-insensitive. Fractions round down to whole bytes.
pub fn parse_bytes(text: &str) -> Result<u64, SizingError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(SizingError::EmptyBytes);
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let scale: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(SizingError::UnknownUnit { text: text.to_string(), unit: unit.to_string() }),
    };
    let bad = || SizingError::BadBytes { text: text.to_string() };
    let (whole, frac) = match num.split_once('.') {
        Some((w, f)) => (w, f),
        None => (num, ""),
    };
    if whole.is_empty() && frac.is_empty() {
        return Err(bad());
    }
    if frac.contains('.') || frac.len() > 18 {
        return Err(bad());
    }
    let overflow = || SizingError::BytesOverflow { text: text.to_string() };
    let digits = format!("{whole}{frac}");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let mantissa: u128 = digits.parse().map_err(|_| overflow())?;
    let value = mantissa.checked_mul(scale).ok_or_else(overflow)? / 10u128.pow(frac.len() as u32);
    u64::try_from(value).map_err(|_| overflow())
}
