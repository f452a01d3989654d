//! PD / offload transfer regions (`pool-runtime.md` §7): the byte ranges a KV connector
//! registers, so a peer can address a block or a whole slot by id.
//!
//! Block regions are forward indexed by block id: one per plane, then one per CSA layer of
//! the indexer. Slot regions are one per plane, indexed by **group** in reverse from the top
//! of the slot range, so unit g lands on the slot start of `physical_slot(g)` — the group →
//! position crossing ATOM once got wrong. Every address comes from the carved geometry, so
//! the regions must be rebuilt (re-registered) whenever the block/slot split changes.

use crate::arena::{plan_regions, ArenaError};
use crate::checked::{add, mul};
use crate::geometry::{GeometryError, UnifiedPoolGeometry};
use crate::sizing::{IndexerDtype, IndexerPart, Plan};
use thiserror::Error;

crate::checked::overflow_into!(TransferError);

/// Roles of the plane regions, in plane order (bf16 builds have the first only).
pub const PLANE_ROLES: [&str; 2] = ["dsv4.main_kv.nope", "dsv4.main_kv.rope"];

crate::variant::variant_names! {
/// Everything transfer registration refuses.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TransferError {
    /// The FP4 indexer's scale pool is not described by §7.
    #[error(
        "the FP4 indexer cannot be transferred or offloaded: its scale pool is not described; \
         use the FP8 indexer or disable transfer"
    )]
    Fp4Indexer,
    /// Transfer with pipeline parallelism above 1.
    #[error("pipeline parallel size {size} with transfer is not supported (only 1)")]
    PipelineParallel {
        /// The pipeline-parallel size asked for.
        size: u32,
    },
    /// Neither one nor two planes.
    #[error("{planes} planes: a V4 pool has one (bf16) or two (fp8)")]
    PlaneCount {
        /// Planes given.
        planes: usize,
    },
    /// The indexer holds fewer blocks than the pool.
    #[error("indexer sized for {indexer_blocks} blocks cannot hold the pool's {num_blocks}")]
    IndexerTooSmall {
        /// Blocks the indexer is sized for.
        indexer_blocks: i64,
        /// Blocks the pool has.
        num_blocks: i64,
    },
    /// A unit id outside the region.
    #[error("unit {unit} outside 0..{units}")]
    UnitOutOfRange {
        /// The unit asked for.
        unit: i64,
        /// Units the region holds.
        units: u64,
    },
    /// A byte count overflowed 64 bits.
    #[error("arithmetic overflow computing {what}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// The geometry refused.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// The arena refused.
    #[error(transparent)]
    Arena(#[from] ArenaError),
}
}

fn to_u64(x: i64, what: &'static str) -> Result<u64, TransferError> {
    u64::try_from(x).map_err(|_| TransferError::Overflow { what })
}

/// The allocation a region's base is an offset into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Alloc {
    /// The one allocation holding every plane (planes at `plan_regions` offsets).
    Planes,
    /// The FP8 indexer pool `[n_csa][NB][64][132]`.
    Indexer,
}

/// How a region's units are numbered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnitOrder {
    /// Unit u at `base + u × unit_bytes` (blocks).
    Forward,
    /// Unit g at `base + total − (g + 1) × unit_bytes` (slots, by group).
    Reverse,
}

/// One registered range: `total_bytes` from `base` in `alloc`, cut into `unit_bytes` units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferRegion {
    /// The connector role (`dsv4.main_kv.nope`, `dsv4.csa_indexer.layer_{L}`, …).
    pub role: String,
    /// The allocation `base` is an offset into.
    pub alloc: Alloc,
    /// Offset of the region's first byte in `alloc`.
    pub base: u64,
    /// Bytes of one unit (a block's envelope or indexer block, or a whole slot).
    pub unit_bytes: u64,
    /// Bytes of the region.
    pub total_bytes: u64,
    /// How units are numbered.
    pub order: UnitOrder,
}

impl TransferRegion {
    /// Units the region holds.
    pub fn units(&self) -> u64 {
        self.total_bytes.checked_div(self.unit_bytes).unwrap_or(0)
    }
    /// Offset in `alloc` of unit `unit` (a block id, or a group for slot regions).
    pub fn unit_offset(&self, unit: i64) -> Result<u64, TransferError> {
        let units = self.units();
        let u = u64::try_from(unit)
            .ok()
            .filter(|&u| u < units)
            .ok_or(TransferError::UnitOutOfRange { unit, units })?;
        Ok(match self.order {
            UnitOrder::Forward => self.base + u * self.unit_bytes,
            UnitOrder::Reverse => self.base + self.total_bytes - (u + 1) * self.unit_bytes,
        })
    }
}

/// Whether transfer is configured, and the pipeline-parallel size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferConfig {
    /// Whether a KV connector is configured (off: nothing is registered).
    pub enabled: bool,
    /// Pipeline-parallel size (transfer supports 1).
    pub pipeline_parallel_size: u32,
}

impl TransferConfig {
    /// Transfer `enabled` or not, at `pipeline_parallel_size`.
    pub fn new(enabled: bool, pipeline_parallel_size: u32) -> Self {
        TransferConfig { enabled, pipeline_parallel_size }
    }
}

/// The regions a connector registers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferRegions {
    /// Planes in plane order, then CSA layers in layer order.
    pub block_regions: Vec<TransferRegion>,
    /// One per plane; a receiver expects exactly [`Self::expected_slot_regions`].
    pub slot_regions: Vec<TransferRegion>,
}

impl TransferRegions {
    /// The plane count: a receiver refuses a slot described by fewer regions.
    pub fn expected_slot_regions(&self) -> usize {
        self.block_regions.iter().filter(|r| r.alloc == Alloc::Planes).count()
    }
}

/// The §7 regions of the carved `geom` with planes of `widths` (in plane order, one
/// allocation), the indexer's index-key layers (id and part of the FP8 pool, in layer order:
/// [`indexer_layers`]), and an indexer allocated for
/// `indexer_blocks` blocks (its layer stride; only the pool's `num_blocks` are registered).
/// Transfer off → nothing registered; FP4 or pipeline parallelism with transfer → refused.
pub fn transfer_regions(
    geom: &UnifiedPoolGeometry,
    widths: &[u64],
    indexer_layers: &[(usize, IndexerPart)],
    indexer: IndexerDtype,
    indexer_blocks: i64,
    config: &TransferConfig,
) -> Result<TransferRegions, TransferError> {
    if !config.enabled {
        return Ok(TransferRegions::default());
    }
    if indexer == IndexerDtype::Fp4 {
        return Err(TransferError::Fp4Indexer);
    }
    if config.pipeline_parallel_size != 1 {
        return Err(TransferError::PipelineParallel { size: config.pipeline_parallel_size });
    }
    if widths.is_empty() || widths.len() > PLANE_ROLES.len() {
        return Err(TransferError::PlaneCount { planes: widths.len() });
    }
    if indexer_blocks < geom.num_blocks {
        return Err(TransferError::IndexerTooSmall { indexer_blocks, num_blocks: geom.num_blocks });
    }
    let plane_rows = to_u64(geom.plane_rows, "plane rows")?;
    let sizes: Vec<u64> =
        widths.iter().map(|&w| mul(plane_rows, w, "plane bytes")).collect::<Result<_, _>>()?;
    let (starts, _) = plan_regions(&sizes)?;
    let nb = to_u64(geom.num_blocks, "num blocks")?;
    let (e, s) = (to_u64(geom.envelope_rows, "envelope rows")?, to_u64(geom.slot_rows, "slot rows")?);
    let slots = to_u64(geom.num_slots, "num slots")?;
    // Row of the lowest live slot: the slot of the highest group.
    let low_row = if slots == 0 {
        0
    } else {
        to_u64(geom.slot_span(geom.physical_slot(geom.num_slots - 1)?)?.0, "slot row")?
    };
    let mut out = TransferRegions::default();
    for (p, (&w, &start)) in widths.iter().zip(&starts).enumerate() {
        let unit = mul(e, w, "envelope bytes")?;
        out.block_regions.push(TransferRegion {
            role: PLANE_ROLES[p].to_string(),
            alloc: Alloc::Planes,
            base: start,
            unit_bytes: unit,
            total_bytes: mul(nb, unit, "block region bytes")?,
            order: UnitOrder::Forward,
        });
        let unit = mul(s, w, "slot bytes")?;
        out.slot_regions.push(TransferRegion {
            role: PLANE_ROLES[p].to_string(),
            alloc: Alloc::Planes,
            base: add(start, mul(low_row, w, "slot base")?, "slot base")?,
            unit_bytes: unit,
            total_bytes: mul(slots, unit, "slot region bytes")?,
            order: UnitOrder::Reverse,
        });
    }
    let cap = to_u64(indexer_blocks, "indexer blocks")?;
    for &(layer, part) in indexer_layers {
        out.block_regions.push(TransferRegion {
            role: format!("dsv4.csa_indexer.layer_{layer}"),
            alloc: Alloc::Indexer,
            base: mul(part.prefix, cap, "indexer base")?,
            unit_bytes: part.block_bytes,
            total_bytes: mul(nb, part.block_bytes, "indexer region bytes")?,
            order: UnitOrder::Forward,
        });
    }
    Ok(out)
}

/// The regions of a sized [`Plan`] at its planned split.
pub fn plan_transfer_regions(plan: &Plan, config: &TransferConfig) -> Result<TransferRegions, TransferError> {
    let layers = indexer_layers(&plan.geometry, &plan.layout.model.indexer_layers(), plan.layout.indexer)?;
    transfer_regions(
        &plan.geometry,
        &plan.layout.widths(),
        &layers,
        plan.layout.indexer,
        plan.max_blocks,
        config,
    )
}

/// Each index-key layer of `layers` with its part of `indexer`'s first pool (FP8: the only
/// one), as [`transfer_regions`] takes them.
pub fn indexer_layers(
    geom: &UnifiedPoolGeometry,
    layers: &[usize],
    indexer: IndexerDtype,
) -> Result<Vec<(usize, IndexerPart)>, GeometryError> {
    let parts = indexer.layer_parts(geom, layers)?;
    Ok(layers.iter().copied().zip(parts.into_iter().next().unwrap_or_default()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::GeometrySpec;

    const ON: TransferConfig = TransferConfig { enabled: true, pipeline_parallel_size: 1 };

    fn example() -> UnifiedPoolGeometry {
        GeometrySpec::new(vec![4, 128, 4, 0], 3, 2, 7, 256).arena_rows(10).build().unwrap()
    }

    /// The example's CSA layers 0 and 2 with their FP8 parts.
    fn csa(g: &UnifiedPoolGeometry) -> Vec<(usize, IndexerPart)> {
        indexer_layers(g, &[0, 2], IndexerDtype::Fp8).unwrap()
    }

    fn region(
        role: &str,
        alloc: Alloc,
        base: u64,
        unit: u64,
        total: u64,
        order: UnitOrder,
    ) -> TransferRegion {
        TransferRegion { role: role.into(), alloc, base, unit_bytes: unit, total_bytes: total, order }
    }

    #[test]
    fn section_7_worked_example_fp8() {
        let g = example();
        assert_eq!((g.envelope_rows, g.entry_rows, g.slot_rows), (130, 85, 96));
        assert_eq!((g.plane_rows, g.slot_positions), (672, 7));
        assert_eq!((g.physical_slot(0).unwrap(), g.physical_slot(1).unwrap()), (6, 5));
        let r = transfer_regions(&g, &[16, 8], &csa(&g), IndexerDtype::Fp8, 3, &ON).unwrap();
        use UnitOrder::*;
        assert_eq!(
            r.block_regions,
            vec![
                region("dsv4.main_kv.nope", Alloc::Planes, 0, 2_080, 6_240, Forward),
                region("dsv4.main_kv.rope", Alloc::Planes, 10_752, 1_040, 3_120, Forward),
                region("dsv4.csa_indexer.layer_0", Alloc::Indexer, 0, 8_448, 25_344, Forward),
                region("dsv4.csa_indexer.layer_2", Alloc::Indexer, 25_344, 8_448, 25_344, Forward),
            ]
        );
        assert_eq!(
            r.slot_regions,
            vec![
                region("dsv4.main_kv.nope", Alloc::Planes, 7_680, 1_536, 3_072, Reverse),
                region("dsv4.main_kv.rope", Alloc::Planes, 14_592, 768, 1_536, Reverse),
            ]
        );
        assert_eq!(r.slot_regions[0].base, 480 * 16);
        assert_eq!(r.slot_regions[0].unit_offset(0), Ok(9_216));
        assert_eq!(r.slot_regions[0].unit_offset(1), Ok(7_680));
        assert_eq!(r.slot_regions[1].unit_offset(0), Ok(15_360));
        assert_eq!(r.expected_slot_regions(), 2);
        // Reverse indexing lands on the slot start of physical_slot(g) in every plane.
        for (p, (w, start)) in [(16u64, 0u64), (8, 10_752)].into_iter().enumerate() {
            for grp in 0..2 {
                let row = g.slot_span(g.physical_slot(grp).unwrap()).unwrap().0 as u64;
                assert_eq!(r.slot_regions[p].unit_offset(grp).unwrap(), start + row * w);
            }
        }
        assert!(matches!(r.slot_regions[0].unit_offset(2), Err(TransferError::UnitOutOfRange { .. })));
        assert_eq!(r.block_regions[0].unit_offset(2), Ok(4_160));
    }

    #[test]
    fn section_7_worked_example_bf16() {
        let g = example();
        let r = transfer_regions(&g, &[32], &csa(&g), IndexerDtype::Fp8, 3, &ON).unwrap();
        assert_eq!(r.block_regions.len(), 3);
        assert_eq!(
            r.block_regions[0],
            region("dsv4.main_kv.nope", Alloc::Planes, 0, 4_160, 12_480, UnitOrder::Forward)
        );
        assert_eq!(r.slot_regions.len(), 1);
        assert_eq!(
            r.slot_regions[0],
            region("dsv4.main_kv.nope", Alloc::Planes, 15_360, 3_072, 6_144, UnitOrder::Reverse)
        );
        assert_eq!(r.expected_slot_regions(), 1);
    }

    #[test]
    fn empty_slots_and_refusals() {
        let g = GeometrySpec::new(vec![4, 128, 4, 0], 3, 0, 7, 256)
            .arena_rows(10)
            .plane_rows(672)
            .build()
            .unwrap();
        let r = transfer_regions(&g, &[16, 8], &csa(&g), IndexerDtype::Fp8, 5, &ON).unwrap();
        assert_eq!((r.slot_regions[0].base, r.slot_regions[0].total_bytes), (0, 0));
        assert_eq!((r.slot_regions[1].base, r.slot_regions[1].total_bytes), (10_752, 0));
        // Indexer layers are strided by the allocated capacity, not the live count.
        assert_eq!(r.block_regions[3].base, 5 * 8_448);
        assert_eq!(r.block_regions[3].total_bytes, 3 * 8_448);
        let g = example();
        let off = TransferConfig { enabled: false, pipeline_parallel_size: 4 };
        assert_eq!(
            transfer_regions(&g, &[16, 8], &csa(&g), IndexerDtype::Fp4, 3, &off),
            Ok(TransferRegions::default())
        );
        assert_eq!(
            transfer_regions(&g, &[16, 8], &csa(&g), IndexerDtype::Fp4, 3, &ON),
            Err(TransferError::Fp4Indexer)
        );
        let pp = TransferConfig { enabled: true, pipeline_parallel_size: 2 };
        assert_eq!(
            transfer_regions(&g, &[16, 8], &csa(&g), IndexerDtype::Fp8, 3, &pp),
            Err(TransferError::PipelineParallel { size: 2 })
        );
        assert_eq!(
            transfer_regions(&g, &[16, 8], &csa(&g), IndexerDtype::Fp8, 2, &ON),
            Err(TransferError::IndexerTooSmall { indexer_blocks: 2, num_blocks: 3 })
        );
        assert_eq!(
            transfer_regions(&g, &[], &csa(&g), IndexerDtype::Fp8, 3, &ON),
            Err(TransferError::PlaneCount { planes: 0 })
        );
    }
}
