//! Checkpoint copies on the pool: the §6 plan ([`CheckpointLayout::store_plan`]) queued
//! through [`Pool::copy_regions`], which checks every run against the pool's own regions
//! and queues them as one descriptor launch under the lock that moves the boundary.

use super::ManagerError;
use crate::checkpoint::CheckpointLayout;
use crate::pool::Pool;

/// Queue the store (`to_units`) or the restore of the slot at `position` against `units`
/// (block ids in reserved order).
pub(super) fn copy(
    pool: &Pool,
    layout: &CheckpointLayout,
    position: i64,
    units: &[i64],
    to_units: bool,
) -> Result<(), ManagerError> {
    let geometry = pool.geometry()?;
    let nb = i64::try_from(pool.indexer_blocks()).unwrap_or(i64::MAX);
    let plan = if to_units {
        layout.store_plan(&geometry, position, units, nb)?
    } else {
        layout.restore_plan(&geometry, position, units, nb)?
    };
    pool.copy_regions(&plan)?;
    Ok(())
}
