//! The row and indexer formats a plan is made for: `KvDtype` (the main KV rows),
//! `IndexerDtype` (the CSA indexer cache, with `layer_parts`, the one placement formula),
//! `GpuArch` and the defaults per model family and architecture.

use crate::checked::{add, mul};
use crate::geometry::{GeometryError, UnifiedPoolGeometry};

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
    /// [`KvDtype::FlashMlaV4`]'s rows in pages of 2 (`[2 × 576 B data][2 × 8 B scales]`):
    /// every HCA layer then sits at one page shift, so the FlashMLA decode path writes one HCA
    /// index operand where 64-row pages need one per layer, and envelopes pad to 2 rows, not
    /// 64 (docs/flashmla.md, "One HCA view"). V4 only.
    FlashMlaV4P2,
    /// FlashMLA's DeepSeek-V4.1 packed layout: windows (and the compressor state) in 528-B
    /// [`KvDtype::FlashMlaV41`] rows, compressed rows in its 288-B fp4 rows (256 B e2m1, 32
    /// e4m3 scales: FlashMLA's `extra_k_cache`), packed at their own width in each envelope
    /// (`crate::geometry::PackedRows`, docs/flashmla.md). V4.1 models only.
    FlashMlaV41Fp4,
}

impl KvDtype {
    /// Every dtype, in the order the CLI lists them.
    pub const ALL: [KvDtype; 6] = [
        KvDtype::Fp8,
        KvDtype::Bf16,
        KvDtype::FlashMlaV4,
        KvDtype::FlashMlaV4P2,
        KvDtype::FlashMlaV41,
        KvDtype::FlashMlaV41Fp4,
    ];

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
            KvDtype::FlashMlaV4P2 => RowFormatId::FlashMlaV4P2,
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
            KvDtype::FlashMlaV4P2 => "flashmla-v4-p2",
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
            KvDtype::FlashMlaV4P2 => "flashmla-v4-p2",
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
            (ModelFamily::V41, KvDtype::Fp8 | KvDtype::FlashMlaV4 | KvDtype::FlashMlaV4P2)
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
    /// `layers` (the layers owning index keys,
    /// [`ModelShape::indexer_layers`](crate::model::ModelShape::indexer_layers)): the layer's
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
            KvDtype::FlashMlaV4 | KvDtype::FlashMlaV4P2 | KvDtype::FlashMlaV41 | KvDtype::FlashMlaV41Fp4 => {
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
