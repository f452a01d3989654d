//! Checkpoint copies on the pool: the §6 plan ([`CheckpointLayout::store_plan`]) resolved
//! against the pool's planes and indexer cache, queued as one descriptor launch.

use super::ManagerError;
use crate::checkpoint::{CheckpointLayout, CopyRun as PlanRun, Loc, Region};
use crate::index::{CopyRun, DevicePtr};
use crate::pool::Pool;

/// The pool's address of a plan location (the plan was validated against the carved
/// geometry and the indexer's block capacity, so the offset lies inside its region).
fn address(pool: &Pool, loc: Loc) -> Result<DevicePtr, ManagerError> {
    let base = match loc.region {
        Region::Plane(p) => pool.plane_ptr(p)?,
        Region::Indexer(i) => {
            let off = pool.indexer_offsets().get(i).copied().ok_or(ManagerError::NoIndexer)?;
            pool.indexer_ptr().ok_or(ManagerError::NoIndexer)? + off
        }
    };
    Ok(base + loc.offset)
}

/// The device copies of a store (`to_units`) or a restore of the slot at `position` against
/// `units` (block ids in reserved order).
pub(super) fn copy_runs(
    pool: &Pool,
    layout: &CheckpointLayout,
    position: i64,
    units: &[i64],
    to_units: bool,
) -> Result<Vec<CopyRun>, ManagerError> {
    let geometry = pool.geometry()?;
    let nb = i64::try_from(pool.indexer_blocks()).unwrap_or(i64::MAX);
    let plan: Vec<PlanRun> = if to_units {
        layout.store_plan(&geometry, position, units, nb)?
    } else {
        layout.restore_plan(&geometry, position, units, nb)?
    };
    plan.iter()
        .map(|r| Ok(CopyRun { src: address(pool, r.src)?, dst: address(pool, r.dst)?, bytes: r.bytes }))
        .collect()
}

/// The copies between `units` and a contiguous image at `image` (`to_image`: units → image),
/// in image order: the store plan's destinations are the image stream cut at unit parts.
pub(super) fn image_runs(
    pool: &Pool,
    layout: &CheckpointLayout,
    position: i64,
    units: &[i64],
    image: DevicePtr,
    to_image: bool,
) -> Result<Vec<CopyRun>, ManagerError> {
    let store = copy_runs(pool, layout, position, units, true)?;
    let mut cursor = 0u64;
    Ok(store
        .into_iter()
        .map(|r| {
            let at = image + cursor;
            cursor += r.bytes;
            if to_image {
                CopyRun { src: r.dst, dst: at, bytes: r.bytes }
            } else {
                CopyRun { src: at, dst: r.dst, bytes: r.bytes }
            }
        })
        .collect())
}
