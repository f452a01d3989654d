//! Block and slot allocators (§5.1, §5.2): ids, reference counts, generation-checked handles.
//!
//! They know nothing of rows, bytes or kernels. Each pool states the spec's semantics in raw
//! ids (`pop`, `allocate`, `claim`, `publish`, `free`, `retire_top`, ...) and offers a handle
//! path for the engine (`alloc`, `free_handle`, `check`): a handle carries the id, a
//! generation and the pool's id, so a double free, a use after free and a handle from another
//! pool are typed errors that change nothing.
//!
//! A generation is bumped whenever an id is handed out anew (ref 0 → 1) or its holder is
//! relocated away by `retire_top`. Blocks shared by several holders share one handle; a
//! double free by one of several sharers cannot be told from a legitimate free.

mod block;
mod idset;
mod slot;

pub use block::{BlockGrant, BlockHandle, BlockPool, BlockRetired, RawUnit, Reservation};
pub use slot::{SlotHandle, SlotPool, SlotRetired};

use std::sync::atomic::{AtomicU32, Ordering};
use thiserror::Error;

/// A prefix-cache content hash (the spec's −1 "no hash" is `Option::None`).
pub type BlockHash = u64;

/// Largest id count a pool holds: block tables and slot mappings are int32 on the device.
pub const MAX_IDS: u32 = i32::MAX as u32;

/// Pool ids start at 1 so a zeroed handle belongs to no pool.
static NEXT_POOL: AtomicU32 = AtomicU32::new(1);

fn next_pool_id() -> u32 {
    NEXT_POOL.fetch_add(1, Ordering::Relaxed)
}

crate::variant::variant_names! {
/// Everything the allocators refuse. No error changes the pool it came from.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum AllocError {
    #[error("No free blocks available")]
    /// No free blocks available.
    NoFreeBlocks,
    #[error("no free slot groups available")]
    /// No free slot groups available.
    NoFreeSlots,
    #[error("block {id} is out of range: the pool has {num_blocks} blocks")]
    /// Block `id` is out of range: the pool has `num_blocks` blocks.
    BlockOutOfRange {
        /// The id.
        id: u32,
        /// Blocks there are.
        num_blocks: u32,
    },
    #[error("group {group} is out of range: the pool has {num_groups} groups")]
    /// Group `group` is out of range: the pool has `num_groups` groups.
    GroupOutOfRange {
        /// The group given.
        group: u32,
        /// Groups there are.
        num_groups: u32,
    },
    #[error("block {id} has ref_count {ref_count}; allocate needs 0")]
    /// Block `id` has ref_count `ref_count`; allocate needs 0.
    BlockReferenced {
        /// The id.
        id: u32,
        /// Its reference count.
        ref_count: u32,
    },
    #[error("block {id} is not held (ref_count 0)")]
    /// Block `id` is not held (ref_count 0).
    BlockNotHeld {
        /// The id.
        id: u32,
    },
    #[error("block {id} is a raw unit of owner {owner}; release it with release_units")]
    /// Block `id` is a raw unit of owner `owner`; release it with release_units.
    RawUnit {
        /// The id.
        id: u32,
        /// The owner given.
        owner: u64,
    },
    #[error("block {id} is not piece {piece} of owner {owner} (it is {found:?}); nothing released")]
    /// Block `id` is not piece `piece` of owner `owner` (it is `found`); nothing released.
    UnitMismatch {
        /// The id.
        id: u32,
        /// The owner given.
        owner: u64,
        /// Piece index.
        piece: u32,
        /// What the unit holds.
        found: Option<RawUnit>,
    },
    #[error("ref_count of block {id} would overflow")]
    /// `ref_count` of block `id` would overflow.
    RefCountOverflow {
        /// The id.
        id: u32,
    },
    #[error("{what} {id} is not held")]
    /// `what` `id` is not held.
    NotHeld {
        /// What was computed or checked.
        what: &'static str,
        /// The id.
        id: u32,
    },
    #[error("group {group} is pinned")]
    /// Group `group` is pinned.
    GroupPinned {
        /// The group given.
        group: u32,
    },
    #[error("group {group} is not pinned")]
    /// Group `group` is not pinned.
    GroupNotPinned {
        /// The group given.
        group: u32,
    },
    #[error("double free of {what} {id} (generation {generation})")]
    /// Double free of `what` `id` (generation `generation`).
    DoubleFree {
        /// What was computed or checked.
        what: &'static str,
        /// The id.
        id: u32,
        /// The handle's generation.
        generation: u64,
    },
    #[error("stale {what} handle: id {id} generation {generation}, current generation {current}")]
    /// Stale `what` handle: id `id` generation `generation`, current generation `current`.
    StaleHandle {
        /// What was computed or checked.
        what: &'static str,
        /// The id.
        id: u32,
        /// The handle's generation.
        generation: u64,
        /// The id's current generation.
        current: u64,
    },
    #[error("{what} handle of pool {handle_pool} used with pool {pool}")]
    /// `what` handle of pool `handle_pool` used with pool `pool`.
    ForeignHandle {
        /// What was computed or checked.
        what: &'static str,
        /// Pool id in the handle.
        handle_pool: u32,
        /// This pool's id.
        pool: u32,
    },
    #[error("max_blocks {max_blocks} is below num_blocks {num_blocks}")]
    /// `max_blocks` `max_blocks` is below num_blocks `num_blocks`.
    MaxBelowNum {
        /// Most blocks the plane holds.
        max_blocks: u32,
        /// Blocks there are.
        num_blocks: u32,
    },
    #[error("{count} {what} exceeds the id limit {limit}")]
    /// `count` `what` exceeds the id limit `limit`.
    TooManyIds {
        /// What was computed or checked.
        what: &'static str,
        /// How many.
        count: u64,
        /// The most allowed.
        limit: u32,
    },
}
}

#[cfg(test)]
mod tests;
