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

/// FP8 indexer: per block per CSA layer, 64 rows × 132 B (`[64×128 fp8][64×4 fp32 scale]`).
pub const INDEXER_FP8_BLOCK_BYTES: u64 = 8_448;
/// FP4 indexer data: per block per CSA layer, packed e2m1 `[1][4][64][16]`.
pub const INDEXER_FP4_DATA_BYTES: u64 = 4_096;
/// FP4 indexer scales: per block per CSA layer, e8m0 `[1][4][64]`.
pub const INDEXER_FP4_SCALE_BYTES: u64 = 256;
/// BF16 indexer: per block per CSA layer, 64 rows × 128 bf16 keys (256 B a row).
pub const INDEXER_BF16_BLOCK_BYTES: u64 = 16_384;

/// How the main KV rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// Two planes: NoPE (512 B/row: fp8 values, e8m0 scales, pad) and RoPE (64 bf16).
    Fp8,
    /// One plane: 512 bf16 per row, RoPE inline.
    Bf16,
    /// One plane of FlashMLA's DeepSeek-V4.1 rows (528 B: 512 e4m3, RoPE quantised too, then 16
    /// e8m0 scales), read in place by FlashMLA's sparse decode (`crate::format`, docs/flashmla.md).
    /// V4.1 models only: V4 keeps its RoPE in bf16.
    FlashMlaV41,
    /// One paged plane of FlashMLA's DeepSeek-V4 rows (584 B a token: pages of 64 rows, 64
    /// data rows of 448 e4m3 + 64 bf16, then 64 scale rows of 7 e8m0 + a pad), read in place by
    /// FlashMLA's sparse decode on SM90. Envelopes, slots and the arena are whole pages
    /// ([`KvDtype::page_rows`]) so a block or slot is one contiguous byte range. V4 only.
    FlashMlaV4,
    /// FlashMLA's DeepSeek-V4.1 packed layout: windows (and the compressor state) in 528-B
    /// [`KvDtype::FlashMlaV41`] rows, compressed rows in its 288-B fp4 rows (256 B e2m1, 32
    /// e4m3 scales: FlashMLA's `extra_k_cache`), packed at their own width in each envelope
    /// (`crate::geometry::PackedRows`, docs/flashmla.md). V4.1 models only.
    FlashMlaV41Fp4,
}

impl KvDtype {
    /// Every dtype, in the order the CLI lists them.
    pub const ALL: [KvDtype; 5] =
        [KvDtype::Fp8, KvDtype::Bf16, KvDtype::FlashMlaV4, KvDtype::FlashMlaV41, KvDtype::FlashMlaV41Fp4];

    /// The dtype a plan of `family` takes when none is named: the family's fp8 form (ATOM's rows
    /// for V4, FlashMLA's 528-B rows for V4.1, whose RoPE is quantised too). The one default
    /// the CLI, the Python module and the C ABI share (`plan_report::PlanOptions`).
    pub fn default_for(family: crate::model::ModelFamily) -> KvDtype {
        match family {
            crate::model::ModelFamily::V4 => KvDtype::Fp8,
            crate::model::ModelFamily::V41 => KvDtype::FlashMlaV41,
        }
    }

    /// The row format's description (`crate::format`): what every byte of a row means.
    pub fn row_format(self) -> crate::format::RowFormatId {
        use crate::format::RowFormatId;
        match self {
            KvDtype::Fp8 => RowFormatId::AtomFp8,
            KvDtype::Bf16 => RowFormatId::Bf16,
            KvDtype::FlashMlaV41 | KvDtype::FlashMlaV41Fp4 => RowFormatId::FlashMlaV41,
            KvDtype::FlashMlaV4 => RowFormatId::FlashMlaV4,
        }
    }
    /// The format of the compressed rows where it is not the planes' own (the packed
    /// [`KvDtype::FlashMlaV41Fp4`]); `None`: compressed rows are plane rows.
    pub fn compressed_format(self) -> Option<crate::format::RowFormatId> {
        match self {
            KvDtype::FlashMlaV41Fp4 => Some(crate::format::RowFormatId::FlashMlaV41Fp4),
            _ => None,
        }
    }
    /// The format the dtype is named for: its compressed rows' where they are packed, else
    /// its planes'.
    pub fn named_format(self) -> crate::format::RowFormatId {
        self.compressed_format().unwrap_or(self.row_format())
    }
    /// Bytes of one compressed row: the packed format's, else the planes' rows together.
    pub fn compressed_row_bytes(self) -> u64 {
        self.named_format().format().bytes_per_token()
    }
    /// Rows of the planes' pages (1: rows back to back): envelopes, slots and the compressor
    /// arena are rounded to it, so every block and slot is whole pages.
    pub fn page_rows(self) -> i64 {
        self.row_format().format().planes.iter().map(|p| p.page_rows as i64).max().unwrap_or(1)
    }
    /// Bytes per row of each plane, in plane order: the row format's.
    pub fn plane_widths(self) -> Vec<u64> {
        self.row_format().format().plane_widths()
    }
    /// The spelling the checkpoint layout id uses.
    pub fn layout_name(self) -> &'static str {
        match self {
            KvDtype::Fp8 => "fp8-2buff",
            KvDtype::Bf16 => "bf16",
            KvDtype::FlashMlaV41 => "flashmla-v41",
            KvDtype::FlashMlaV4 => "flashmla-v4",
            KvDtype::FlashMlaV41Fp4 => "flashmla-v41-fp4",
        }
    }
    /// Lower-case name, as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Fp8 => "fp8",
            KvDtype::Bf16 => "bf16",
            KvDtype::FlashMlaV41 => "flashmla-v41",
            KvDtype::FlashMlaV4 => "flashmla-v4",
            KvDtype::FlashMlaV41Fp4 => "flashmla-v41-fp4",
        }
    }
    /// The dtype a name spells (the CLI's and the bindings' one parser).
    pub fn from_name(name: &str) -> Option<KvDtype> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
    /// Whether a model family can store its rows in this dtype: V4.1's rows have no fp8 form
    /// but FlashMLA's 528-B one (ATOM's 640-B record is V4's), and V4 keeps its RoPE in bf16,
    /// which the 528-B format quantises.
    pub fn fits(self, family: crate::model::ModelFamily) -> bool {
        use crate::model::ModelFamily;
        !matches!(
            (family, self),
            (ModelFamily::V41, KvDtype::Fp8 | KvDtype::FlashMlaV4)
                | (ModelFamily::V4, KvDtype::FlashMlaV41 | KvDtype::FlashMlaV41Fp4)
        )
    }
}

/// How the CSA indexer's K cache is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IndexerDtype {
    /// One pool `[n_csa][NB][64][132]`.
    Fp8,
    /// Two pools: data `[n_csa][NB][4096 B]`, then scales `[n_csa][NB][256 B]`.
    Fp4,
    /// One pool `[n_csa][NB][64][128]` bf16: the keys exactly as a bf16 indexer scores them
    /// (transformers' DeepSeek-V4; a reference run's pool). Twice the fp8 cache; not one of
    /// the layout-id vocabulary's `fp8|fp4` (pool-runtime.md), so its layout id names `bf16`.
    Bf16,
    /// ATOM's fp8 cache off gfx942 (gfx950, gfx1250): the [`IndexerDtype::Fp8`] bytes, but
    /// values in ATOM's preshuffled 16×16 tiles, OCP e4m3 at `fp8_max` 448
    /// ([`crate::format::ATOM_FP8_KEYS`]); what aiter's `deepgemm_fp8_paged_mqa_logits(...,
    /// Preshuffle=True)` reads. V4 only (blocks of 64 rows: the preshuffle tiles 16).
    AtomFp8,
    /// ATOM's fp8 cache on gfx942 (MI300X / MI325X): preshuffled, e4m3fnuz at `fp8_max` 240
    /// ([`crate::format::ATOM_FP8_FNUZ_KEYS`]). V4 only.
    AtomFp8Fnuz,
}

impl IndexerDtype {
    /// Bytes one block of one CSA layer takes in each indexer pool, in pool order.
    pub fn pool_block_bytes(self) -> &'static [u64] {
        match self {
            IndexerDtype::Fp8 | IndexerDtype::AtomFp8 | IndexerDtype::AtomFp8Fnuz => {
                &[INDEXER_FP8_BLOCK_BYTES]
            }
            IndexerDtype::Fp4 => &[INDEXER_FP4_DATA_BYTES, INDEXER_FP4_SCALE_BYTES],
            IndexerDtype::Bf16 => &[INDEXER_BF16_BLOCK_BYTES],
        }
    }
    /// Bytes one index-key row takes in each pool, in pool order (FP8: 128 fp8 + an fp32
    /// scale; FP4: 64 B of e2m1 data, then a 4-B e8m0 scale row): a V4 CSA block is 64 rows.
    pub fn pool_row_bytes(self) -> &'static [u64] {
        match self {
            IndexerDtype::Fp8 | IndexerDtype::AtomFp8 | IndexerDtype::AtomFp8Fnuz => {
                &[INDEXER_FP8_BLOCK_BYTES / 64]
            }
            IndexerDtype::Fp4 => &[INDEXER_FP4_DATA_BYTES / 64, INDEXER_FP4_SCALE_BYTES / 64],
            IndexerDtype::Bf16 => &[INDEXER_BF16_BLOCK_BYTES / 64],
        }
    }
    /// Bytes one block of one CSA layer takes across the pools (8,448 or 4,352).
    pub fn layer_block_bytes(self) -> u64 {
        self.pool_block_bytes().iter().sum()
    }
    /// The indexer cache's layers in each of its pools, `[pool][i]` for the `i`-th of
    /// `layers` (the layers owning index keys, [`ModelShape::indexer_layers`]): the layer's
    /// array `[indexer_blocks][block_bytes]` starts `prefix × indexer_blocks` bytes into its
    /// pool. Every V4 layer takes V4's CSA block ([`Self::pool_block_bytes`]); where the
    /// geometry has KV sources (V4.1) an owner takes its `block_size / ratio` rows at
    /// [`Self::pool_row_bytes`] (O8: one plane per KV owner). The one formula every user of
    /// the indexer cache reads (pool carve, copies, host tier, handoff, regions, checkpoints).
    pub fn layer_parts(
        self,
        geometry: &UnifiedPoolGeometry,
        layers: &[usize],
    ) -> Result<Vec<Vec<IndexerPart>>, GeometryError> {
        let owners = geometry.kv_sources.is_some();
        let mut out = Vec::with_capacity(self.pool_block_bytes().len());
        for (&block, &row) in self.pool_block_bytes().iter().zip(self.pool_row_bytes()) {
            let mut prefix = 0u64;
            let mut parts = Vec::with_capacity(layers.len());
            for &l in layers {
                let block_bytes = if owners {
                    let rows = u64::try_from(geometry.layer_class(l)?.block_rows)
                        .map_err(|_| GeometryError::Overflow { what: "indexer rows" })?;
                    mul(rows, row, "indexer block bytes")?
                } else {
                    block
                };
                parts.push(IndexerPart { prefix, block_bytes });
                prefix = add(prefix, block_bytes, "indexer layer prefix")?;
            }
            out.push(parts);
        }
        Ok(out)
    }
    /// Lower-case name, as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            IndexerDtype::Fp8 => "fp8",
            IndexerDtype::Fp4 => "fp4",
            IndexerDtype::Bf16 => "bf16",
            IndexerDtype::AtomFp8 => "atom-fp8",
            IndexerDtype::AtomFp8Fnuz => "atom-fp8-fnuz",
        }
    }
    /// Every indexer dtype, in the order the CLI lists them.
    pub const ALL: [IndexerDtype; 5] = [
        IndexerDtype::Fp8,
        IndexerDtype::Fp4,
        IndexerDtype::Bf16,
        IndexerDtype::AtomFp8,
        IndexerDtype::AtomFp8Fnuz,
    ];
    /// The dtype a name spells (the CLI's and the bindings' one parser).
    pub fn from_name(name: &str) -> Option<IndexerDtype> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
    /// The fp8 key format's description (`crate::format`), for the fp8 caches.
    pub fn fp8_keys(self) -> Option<&'static crate::format::Fp8KeyFormat> {
        match self {
            IndexerDtype::Fp8 => Some(&crate::format::FP8_KEYS),
            IndexerDtype::AtomFp8 => Some(&crate::format::ATOM_FP8_KEYS),
            IndexerDtype::AtomFp8Fnuz => Some(&crate::format::ATOM_FP8_FNUZ_KEYS),
            IndexerDtype::Fp4 | IndexerDtype::Bf16 => None,
        }
    }
    /// The `IndexKeysArgs::format` code its key writer takes (`crate::index::INDEX_KEYS_*`).
    pub fn key_format_code(self) -> i32 {
        use crate::index::*;
        match self {
            IndexerDtype::Fp8 => INDEX_KEYS_FP8,
            IndexerDtype::Fp4 => INDEX_KEYS_FP4,
            IndexerDtype::Bf16 => INDEX_KEYS_BF16,
            IndexerDtype::AtomFp8 => INDEX_KEYS_ATOM_FP8,
            IndexerDtype::AtomFp8Fnuz => INDEX_KEYS_ATOM_FP8_FNUZ,
        }
    }
}

/// An AMD GPU architecture a pool is planned for: on AMD the bytes an engine's kernels read
/// depend on it (aiter's `fp8` is e4m3fnuz on gfx942 and OCP e4m3 on gfx950; ATOM's fp8 main KV
/// exists only on gfx950 / gfx1250). docs/amd.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuArch {
    /// MI200 (CDNA2): no fp8 in aiter.
    Gfx90a,
    /// MI300X / MI325X (CDNA3): fp8 is e4m3fnuz.
    Gfx942,
    /// MI350X / MI355X (CDNA4): fp8 is OCP e4m3.
    Gfx950,
    /// gfx1250: fp8 is OCP e4m3.
    Gfx1250,
}

impl GpuArch {
    /// Every architecture, in the order the CLI lists them.
    pub const ALL: [GpuArch; 4] = [GpuArch::Gfx90a, GpuArch::Gfx942, GpuArch::Gfx950, GpuArch::Gfx1250];
    /// The name (`gfx942`, …), as ROCm spells it.
    pub fn name(self) -> &'static str {
        match self {
            GpuArch::Gfx90a => "gfx90a",
            GpuArch::Gfx942 => "gfx942",
            GpuArch::Gfx950 => "gfx950",
            GpuArch::Gfx1250 => "gfx1250",
        }
    }
    /// The architecture a name spells.
    pub fn from_name(name: &str) -> Option<GpuArch> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }
    /// aiter's `dtypes.fp8` here (`aiter/utility/dtypes.py`); `None`: aiter has none.
    pub fn fp8(self) -> Option<crate::format::Fp8Elem> {
        use crate::format::Fp8Elem;
        match self {
            GpuArch::Gfx90a => None,
            GpuArch::Gfx942 => Some(Fp8Elem::E4m3fnuz),
            GpuArch::Gfx950 | GpuArch::Gfx1250 => Some(Fp8Elem::E4m3fn),
        }
    }
    /// Whether ATOM's 640-B fp8 main KV is read here: aiter's sparse prefill and V4 decode
    /// kernels exist for gfx950 / gfx1250 only, and ATOM turns fp8 off elsewhere
    /// (`deepseek_v4_attn.py`).
    pub fn reads_atom_fp8_kv(self) -> bool {
        matches!(self, GpuArch::Gfx950 | GpuArch::Gfx1250)
    }
    /// Why `kv` is refused here, if it is: a format no kernel on this architecture reads.
    pub fn refuses_kv(self, kv: KvDtype) -> Option<&'static str> {
        match kv {
            KvDtype::Fp8 if !self.reads_atom_fp8_kv() => Some(
                "ATOM and aiter read the 640-B fp8 KV only on gfx950/gfx1250 (ATOM falls back to a bf16 KV \
                 cache elsewhere); use --dtype bf16",
            ),
            KvDtype::FlashMlaV4 | KvDtype::FlashMlaV41 | KvDtype::FlashMlaV41Fp4 => {
                Some("FlashMLA's formats are read by FlashMLA on NVIDIA only; use --dtype bf16")
            }
            _ => None,
        }
    }
    /// Why `indexer` is refused here, if it is: its fp8 bytes are not this architecture's fp8,
    /// or ATOM has no such cache here.
    pub fn refuses_indexer(self, indexer: IndexerDtype) -> Option<&'static str> {
        use crate::format::Fp8Elem;
        let ours = self.fp8();
        match indexer {
            IndexerDtype::Bf16 => None,
            IndexerDtype::Fp4 if self == GpuArch::Gfx942 || ours.is_none() => {
                Some("ATOM's fp4 indexer is unsupported on gfx942 and gfx90a; use atom-fp8-fnuz (gfx942) or bf16")
            }
            IndexerDtype::Fp4 => None,
            _ if ours.is_none() => Some("aiter has no fp8 type on gfx90a; use --indexer bf16"),
            IndexerDtype::AtomFp8Fnuz if ours != Some(Fp8Elem::E4m3fnuz) => {
                Some("e4m3fnuz is gfx942's fp8 only; use --indexer atom-fp8 here")
            }
            IndexerDtype::Fp8 | IndexerDtype::AtomFp8 if ours != Some(Fp8Elem::E4m3fn) => Some(
                "gfx942's fp8 is e4m3fnuz: its readers would see OCP e4m3 bytes at half value and 0x80 as NaN; \
                 use --indexer atom-fp8-fnuz",
            ),
            _ => None,
        }
    }
}

/// The main KV and indexer dtypes a pool of `family` takes when none is named: with no
/// architecture (NVIDIA, the host) ATOM's fp8 rows for V4 and FlashMLA's 528-B rows for V4.1,
/// with the row-major fp8 indexer; on an AMD architecture what its engine reads there: the fp8
/// main KV where ATOM reads it (V4 on gfx950 / gfx1250), bf16 elsewhere, and ATOM's preshuffled
/// fp8 indexer in the architecture's fp8 (bf16 on gfx90a, which has none).
pub fn default_dtypes(family: crate::model::ModelFamily, arch: Option<GpuArch>) -> (KvDtype, IndexerDtype) {
    use crate::model::ModelFamily;
    let Some(arch) = arch else {
        return (KvDtype::default_for(family), IndexerDtype::Fp8);
    };
    let kv = if family == ModelFamily::V4 && arch.reads_atom_fp8_kv() { KvDtype::Fp8 } else { KvDtype::Bf16 };
    let indexer = match arch.fp8() {
        Some(crate::format::Fp8Elem::E4m3fnuz) => IndexerDtype::AtomFp8Fnuz,
        Some(crate::format::Fp8Elem::E4m3fn) => IndexerDtype::AtomFp8,
        None => IndexerDtype::Bf16,
    };
    (kv, indexer)
}

/// One index-key layer in one indexer pool ([`IndexerDtype::layer_parts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerPart {
    /// Block bytes of the layers before this one in the pool: the layer starts
    /// `prefix × indexer_blocks` bytes into the pool.
    pub prefix: u64,
    /// Bytes of one block of this layer.
    pub block_bytes: u64,
}

impl IndexerPart {
    /// Byte offset of `block` of this layer in its pool of `indexer_blocks` blocks.
    pub fn offset(&self, block: u64, indexer_blocks: u64) -> Option<u64> {
        self.prefix.checked_mul(indexer_blocks)?.checked_add(block.checked_mul(self.block_bytes)?)
    }
}

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

#[cfg(test)]
mod tests {
    #[test]
    fn kv_dtype_names_round_trip() {
        for k in KvDtype::ALL {
            assert_eq!(KvDtype::from_name(k.name()), Some(k));
        }
    }

    use super::*;
    use crate::model::ModelShape;

    const GIB100: u64 = 100 << 30;

    struct Row {
        model: ModelShape,
        kv: KvDtype,
        indexer: IndexerDtype,
        page: u64,
        slot: u64,
        blocks: i64,
        plane_rows: i64,
        positions: i64,
    }

    fn table() -> Vec<Row> {
        let (k8, kb) = (KvDtype::Fp8, KvDtype::Bf16);
        let (i8, i4) = (IndexerDtype::Fp8, IndexerDtype::Fp4);
        let f = |k| ModelShape::v4_flash(k).unwrap();
        let p = |k| ModelShape::v4_pro(k).unwrap();
        let r = |model, kv, indexer, page, slot, blocks, plane_rows, positions| Row {
            model,
            kv,
            indexer,
            page,
            slot,
            blocks,
            plane_rows,
            positions,
        };
        vec![
            r(f(0), k8, i8, 1_063_168, 16_711_680, 96_970, 140_900_352, 5_396),
            r(f(1), k8, i8, 1_063_168, 17_661_440, 96_741, 140_960_368, 5_108),
            r(f(1), k8, i4, 977_152, 17_661_440, 105_257, 152_743_860, 5_535),
            r(f(1), kb, i8, 1_594_624, 19_625_984, 64_184, 93_740_906, 4_891),
            r(p(1), k8, i8, 1_521_920, 26_782_720, 66_046, 141_655_480, 3_385),
            r(p(1), k8, i4, 1_399_040, 26_782_720, 71_847, 153_121_832, 3_659),
        ]
    }

    #[test]
    fn section_3_table_page_and_slot_bytes_exact() {
        for row in table() {
            let plan = plan(&row.model, &PlanRequest::new(row.kv, row.indexer, 256, GIB100)).unwrap();
            assert_eq!(plan.page_bytes, row.page, "{} {:?} {:?}", row.model.name, row.kv, row.indexer);
            assert_eq!(plan.slot_bytes, row.slot);
            // The spec's own split reproduces its table exactly...
            assert_eq!(plan.tight_fit_blocks, row.blocks);
            // ...and its tight plane is what the table lists.
            let tight = plan.layout.geometry.with_capacity(row.blocks, 256, None).unwrap();
            assert_eq!((tight.plane_rows, tight.slot_positions), (row.plane_rows, row.positions));
        }
    }

    #[test]
    fn section_3_blocks_under_the_table_within_the_stated_margin() {
        for row in table() {
            let s = plan(&row.model, &PlanRequest::new(row.kv, row.indexer, 256, GIB100)).unwrap();
            let (sr, e) = (s.geometry.slot_rows, s.geometry.envelope_rows);
            assert!(s.total_bytes <= GIB100);
            // min_slots = m: only the whole-slot rounding separates this plan from the table.
            let tight = plan(
                &row.model,
                &PlanRequest { min_slots: 256, ..PlanRequest::new(row.kv, row.indexer, 256, GIB100) },
            )
            .unwrap();
            assert!(tight.total_bytes <= GIB100);
            assert_eq!(tight.max_blocks, tight.num_blocks);
            let margin = (sr + e - 1) / e + 3;
            assert!(
                tight.num_blocks <= row.blocks && row.blocks - tight.num_blocks <= margin,
                "{}: {} vs {}",
                row.model.name,
                tight.num_blocks,
                row.blocks
            );
            // min_slots = 0: the indexer headroom for the slots' rows comes off too (and the two
            // plans round to whole slots independently).
            let idx = s.layout.indexer_block_bytes().unwrap() as i64;
            let headroom = (256 * sr / e + 1) * idx / s.page_bytes as i64 + 1;
            assert!(s.num_blocks <= tight.num_blocks && tight.num_blocks - s.num_blocks <= headroom + margin);
            assert_eq!(s.max_blocks, s.slot_positions * sr / e);
            assert!(s.max_blocks > s.num_blocks);
            // Within 1.5 % of the table either way.
            assert!((row.blocks - s.num_blocks) * 1000 <= 15 * row.blocks, "{} {}", s.num_blocks, row.blocks);
        }
    }

    #[test]
    fn plan_accounting_adds_up() {
        let m = ModelShape::v4_pro(1).unwrap();
        let p = plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp4, 256, GIB100)).unwrap();
        assert_eq!(p.plane_rows, p.slot_positions * p.geometry.slot_rows);
        assert_eq!(p.plane_bytes, vec![p.plane_rows as u64 * 512, p.plane_rows as u64 * 128]);
        assert_eq!(p.plane_offsets, vec![0, p.plane_bytes[0]]);
        assert_eq!(
            p.indexer_pool_bytes,
            vec![30 * p.max_blocks as u64 * 4096, 30 * p.max_blocks as u64 * 256]
        );
        assert_eq!(p.total_bytes, p.planes_total_bytes + p.indexer_total_bytes);
        assert_eq!(p.tokens, p.num_blocks * 256);
        assert_eq!(p.geometry.num_blocks, p.num_blocks);
        assert_eq!(p.geometry.num_slots, 256);
        assert_eq!(p.geometry.slot_origin, 0);
        assert!(p.rows_wasted >= 0 && p.rows_wasted < p.geometry.envelope_rows);
        // One more position would not fit.
        let (planes, idx, _) = cost(&p.layout, p.slot_positions + 1, 0).unwrap();
        assert!(planes + idx > GIB100);
        // The plane's blocks are exactly what max_blocks_beside gives.
        assert_eq!(p.geometry.max_blocks_beside(256), p.num_blocks);
        assert_eq!(p.geometry.max_blocks_beside(0), p.max_blocks);
    }

    #[test]
    fn verify_carve_catches_a_different_layout() {
        let m = ModelShape::v4_flash(1).unwrap();
        let p = plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 16, 8 << 30)).unwrap();
        assert_eq!(p.verify_carve(&p.geometry), Ok(()));
        // The elastic boundary moving changes nothing sizing priced.
        let moved = p.geometry.with_capacity(p.num_blocks / 2, 20, Some(p.plane_rows)).unwrap();
        assert_eq!(p.verify_carve(&moved), Ok(()));
        let k0 = PoolLayout::new(&ModelShape::v4_flash(0).unwrap(), KvDtype::Fp8, IndexerDtype::Fp8).unwrap();
        let other = k0.carve(10, 16, p.plane_rows).unwrap();
        assert!(matches!(p.verify_carve(&other), Err(SizingError::CarveMismatch { what: "slot_bytes", .. })));
        let tight = p.geometry.with_capacity(p.num_blocks - 100, 16, None).unwrap();
        assert!(matches!(p.verify_carve(&tight), Err(SizingError::CarveMismatch { what: "plane_rows", .. })));
    }

    #[test]
    fn overhead_comes_off_the_budget() {
        let m = ModelShape::v4_flash(1).unwrap();
        let base = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, GIB100);
        let a = plan(&m, &base).unwrap();
        let b = plan(&m, &PlanRequest { overhead_bytes: 2 << 30, ..base }).unwrap();
        assert!(b.num_blocks < a.num_blocks);
        assert!(b.total_bytes <= GIB100 && b.overhead_bytes == 2 << 30);
        assert_eq!(b.total_bytes, b.planes_total_bytes + b.indexer_total_bytes + (2 << 30));
    }

    #[test]
    fn too_small_budgets_carry_the_numbers() {
        let m = ModelShape::v4_flash(1).unwrap();
        let req = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, 4 << 30);
        match plan(&m, &req) {
            Err(SizingError::BudgetTooSmall {
                budget, required, num_slots, slot_bytes, page_bytes, ..
            }) => {
                assert_eq!(
                    (budget, num_slots, slot_bytes, page_bytes),
                    (4 << 30, 256, 17_661_440, 1_063_168)
                );
                assert!(required > budget && required >= 256 * slot_bytes + page_bytes);
            }
            other => panic!("{other:?}"),
        }
        // Exactly the smallest feasible budget works, one byte less does not.
        let lo_req = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 1, 1);
        let need = match plan(&m, &lo_req) {
            Err(SizingError::BudgetTooSmall { required, .. }) => required,
            other => panic!("{other:?}"),
        };
        let p = plan(&m, &PlanRequest { budget_bytes: need, ..lo_req }).unwrap();
        assert!(p.num_blocks >= 1 && p.total_bytes == need);
        assert!(plan(&m, &PlanRequest { budget_bytes: need - 1, ..lo_req }).is_err());
        assert_eq!(
            plan(&m, &PlanRequest { max_num_seqs: 0, ..lo_req }),
            Err(SizingError::NoSlots { got: 0 })
        );
        assert!(matches!(
            plan(&m, &PlanRequest { min_slots: 2, ..lo_req }),
            Err(SizingError::MinSlots { min_slots: 2, max_num_seqs: 1 })
        ));
    }

    #[test]
    fn huge_budgets_stop_at_the_i32_plane() {
        let m = ModelShape::v4_flash(0).unwrap();
        let p = plan(&m, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 256, 4 << 40)).unwrap();
        assert!(p.plane_capped);
        assert!(p.plane_rows <= MAX_PLANE_ROWS && p.plane_rows + p.geometry.slot_rows > MAX_PLANE_ROWS);
        assert!(p.total_bytes <= 4 << 40);
    }

    #[test]
    fn parse_bytes_units_and_errors() {
        assert_eq!(parse_bytes("100GiB"), Ok(107_374_182_400));
        assert_eq!(parse_bytes("512MiB"), Ok(536_870_912));
        assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("1234"), Ok(1234));
        assert_eq!(parse_bytes(" 7 kib "), Ok(7168));
        assert_eq!(parse_bytes("1.5GiB"), Ok(1_610_612_736));
        assert_eq!(parse_bytes("3B"), Ok(3));
        assert_eq!(parse_bytes(""), Err(SizingError::EmptyBytes));
        assert!(matches!(parse_bytes("12XB"), Err(SizingError::UnknownUnit { .. })));
        assert!(matches!(parse_bytes("GiB"), Err(SizingError::BadBytes { .. })));
        assert!(matches!(parse_bytes("-5"), Err(SizingError::UnknownUnit { .. })));
        assert!(matches!(parse_bytes("1.2.3"), Err(SizingError::BadBytes { .. })));
        assert!(matches!(parse_bytes("."), Err(SizingError::BadBytes { .. })));
        assert!(matches!(parse_bytes("20000000TiB"), Err(SizingError::BytesOverflow { .. })));
        assert!(matches!(
            parse_bytes("99999999999999999999999999999999999999999"),
            Err(SizingError::BytesOverflow { .. })
        ));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
    }
}
