//! Several independent writes of a forward in one launch (docs/forward.md, "Fewer launches"):
//! a [`WriteBatch`] turns the launches of KV row writes, index-key writes and compressor-state
//! updates that the model's order lets run together (one layer's writes; or every layer's
//! state update) into one `v4pool_write_batch` launch that runs each of them block for block
//! as its own kernel would, so the bytes are the per-launch path's.
//!
//! ```text
//! let mut batch = pool.write_batch(5)?;                 // once: a table of at most 5 items
//! let layer = batch.set(&[own_rows, emitted, keys, main_state, index_state])?;   // upload
//! unsafe { backend.launch(&layer, stream)? };           // or capture it in a graph
//! ```
//!
//! The launches come from the writers' launch calls (`KvRowWriter::write_decode_launch`,
//! `write_launch`, `index_keys_launch`, `StateUpdate::launch`), each checked there; the batch
//! adds only its table. Which writes may share a launch is the caller's to know: none may read
//! what another writes and no two may write one byte (docs/forward.md says which sets of a
//! forward are such sets, and why).

use super::owned::{Carve, Owned};
use super::Pool;
use crate::backend::BackendError;
use crate::index::shape::{check_launch, write_item_blocks, LaunchError};
use crate::index::{Launch, WriteBatchArgs, WriteItem, WRITE_BATCH_MAX_ITEMS};
use std::sync::Arc;
use thiserror::Error;

crate::variant::variant_names! {
/// What building a write batch refuses, before anything is uploaded.
#[derive(Debug, Error)]
pub enum WriteBatchError {
    /// A batch sized for more items than the kernel takes.
    #[error("a batch of {got} items exceeds the kernel's {max}")]
    Capacity {
        /// Items asked for.
        got: usize,
        /// `WRITE_BATCH_MAX_ITEMS`.
        max: usize,
    },
    /// More launches than the batch was sized for, or none.
    #[error("{got} launches for a batch of 1 ..= {cap}")]
    Count {
        /// Launches given.
        got: usize,
        /// The batch's capacity.
        cap: usize,
    },
    /// A launch that is no write the batch kernel carries.
    #[error("launch {index} ({symbol}) is not a KV row, index-key or state-update write")]
    NotAWrite {
        /// Its place in the list.
        index: usize,
        /// Its kernel.
        symbol: &'static str,
    },
    /// A launch its own kernel would refuse.
    #[error("launch {index}: {source}")]
    Invalid {
        /// Its place in the list.
        index: usize,
        /// The refusal.
        #[source]
        source: LaunchError,
    },
    /// Items whose grids together pass the kernel's i32 block count.
    #[error("the items' grids add up to {blocks} blocks, past i32")]
    TooManyBlocks {
        /// Blocks of the items together.
        blocks: u64,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
via_source = [Invalid];
}

impl Pool {
    /// A write batch of at most `max_items` writes on this pool's backend and stream (see
    /// [`WriteBatch`]).
    pub fn write_batch(self: &Arc<Self>, max_items: usize) -> Result<WriteBatch, WriteBatchError> {
        WriteBatch::new(Arc::clone(self), max_items)
    }
}

/// The item table of one `v4pool_write_batch` launch, at a fixed device address: an owned
/// handle (see the module doc).
#[derive(Debug)]
pub struct WriteBatch {
    pool: Arc<Pool>,
    owned: Owned,
    cap: usize,
    items_at: u64,
    first_at: u64,
}

impl WriteBatch {
    /// A table of `max_items` (1 ..= `WRITE_BATCH_MAX_ITEMS`) items on `pool`'s backend.
    pub fn new(pool: Arc<Pool>, max_items: usize) -> Result<WriteBatch, WriteBatchError> {
        if max_items == 0 || max_items > WRITE_BATCH_MAX_ITEMS {
            return Err(WriteBatchError::Capacity { got: max_items, max: WRITE_BATCH_MAX_ITEMS });
        }
        let mut c = Carve::default();
        let n = max_items as u64;
        // Small, fixed sizes: no overflow.
        let items_at = c.take(n, std::mem::size_of::<WriteItem>() as u64).unwrap_or(0);
        let first_at = c.take(n, 4).unwrap_or(0);
        let owned = Owned::new(Arc::clone(pool.backend()), pool.stream(), c.end())?;
        Ok(WriteBatch { pool, owned, cap: max_items, items_at, first_at })
    }

    /// Items the table holds at most.
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// The pool whose backend holds the table.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Upload `launches` (1 ..= capacity KV row, index-key or state-update writes, each
    /// checked as its own launch would be) as the table and return the one launch that runs
    /// them all: the same grid as theirs together, so a graph captured over it replays after a
    /// later `set` of launches with the same grids. The upload is on the pool's stream: a
    /// launch of the table queued before it still reads the old one; a launch on another
    /// stream is the caller's to order after it.
    ///
    /// Launching the result (`Backend::launch`, a graph) is `unsafe` as every item's own
    /// launch is, and more: no item may read what another writes, and no two may write one
    /// byte, since the items run in any order and at once; and the items' staged metadata must
    /// be complete before the kernel preceding the batch starts (`WriteBatchArgs`' input
    /// readiness: the writers' launch calls stage it by host upload, so it is).
    pub fn set(&mut self, launches: &[Launch]) -> Result<Launch, WriteBatchError> {
        if launches.is_empty() || launches.len() > self.cap {
            return Err(WriteBatchError::Count { got: launches.len(), cap: self.cap });
        }
        let mut items = Vec::with_capacity(launches.len());
        let mut first = Vec::with_capacity(launches.len());
        let mut blocks = 0u64;
        for (index, launch) in launches.iter().enumerate() {
            let (Some(item), Some(own)) = (WriteItem::of(launch), write_item_blocks(launch)) else {
                return Err(WriteBatchError::NotAWrite { index, symbol: launch.symbol() });
            };
            check_launch(launch).map_err(|source| WriteBatchError::Invalid { index, source })?;
            let at = i32::try_from(blocks).map_err(|_| WriteBatchError::TooManyBlocks { blocks })?;
            first.push(at);
            items.push(item);
            blocks += own;
        }
        let num_blocks = i32::try_from(blocks).map_err(|_| WriteBatchError::TooManyBlocks { blocks })?;
        self.owned.upload(self.items_at, bytemuck::cast_slice(&items))?;
        self.owned.upload(self.first_at, bytemuck::cast_slice(&first))?;
        Ok(Launch::WriteBatch(WriteBatchArgs {
            items: self.owned.base() + self.items_at,
            first_block: self.owned.base() + self.first_at,
            num_items: launches.len() as i32, // at most WRITE_BATCH_MAX_ITEMS
            num_blocks,
        }))
    }
}
