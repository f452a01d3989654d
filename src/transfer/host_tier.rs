//! The host tier: block units (cached KV blocks, or the PAGE units a checkpoint image was
//! stored in, `pool-runtime.md` §6) evicted from HBM spill to host memory instead of being
//! dropped, and come back byte-exact on a hit.
//!
//! A unit is everything a block id owns: its envelope in every plane and its block in every
//! indexer pool and CSA layer. The tier holds one host buffer of the budget from the pool's
//! backend ([`Backend::alloc_host`]: page-locked on CUDA, so copies run by DMA at link speed;
//! ordinary memory elsewhere) cut into unit-sized cells. Every copy is queued on the pool's
//! stream ([`Backend::upload_host`] / [`Backend::download_host`]), so it is ordered after the
//! pool's earlier work on the units and before its later work, and the tier waits for the
//! stream before a cell is handed out again.
//! An entry occupies one or more **extents** of consecutive cells, laid out part-major (all
//! of the extent's plane-0 envelopes, then plane-1, then each indexer layer), so a restore
//! into consecutive block ids is one copy per part per extent rather than one per block.
//!
//! Recency decides eviction: [`HostTier::spill`] makes room by evicting the least recently
//! spilled or touched entries and returns their keys (the caller unindexes them), refusing
//! before evicting anything when the entry exceeds the whole budget. The tier decides nothing
//! else: which blocks to spill and when is the prefix-reuse manager's call.

use crate::alloc::BlockHandle;
use crate::backend::{Backend, BackendError, HostAllocation, HostMem, Stream};
use crate::checkpoint::LayoutId;
use crate::pool::{Pool, PoolError};
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Arc;
use thiserror::Error;

crate::variant::variant_names! {
/// What the host tier, or the shared tier ([`super::SharedTier`]), refuses or fails with.
#[derive(Debug, Error)]
pub enum HostTierError {
    /// The entry alone needs more than the whole budget; nothing was evicted.
    #[error("{units} units of {unit_bytes} bytes exceed the host budget of {capacity} units")]
    TooLarge {
        /// Units asked for.
        units: usize,
        /// Bytes per unit.
        unit_bytes: u64,
        /// Units the budget holds.
        capacity: u64,
    },
    /// The key is already spilled.
    #[error("the key is already in the host tier")]
    AlreadyHeld,
    /// No entry under the key.
    #[error("the key is not in the host tier")]
    NotHeld,
    /// A restore target of the wrong length.
    #[error("entry holds {held} units, {got} blocks given")]
    UnitCount {
        /// Units the entry holds.
        held: usize,
        /// Blocks given.
        got: usize,
    },
    /// The pool has no room for the restored units; nothing stays allocated.
    #[error("pool has no room for {units} blocks: {source}")]
    NoRoom {
        /// Blocks needed.
        units: usize,
        /// What the pool refused.
        source: PoolError,
    },
    /// The tier serves a pool of another shape.
    #[error("tier built for units of {tier} bytes, pool units are {pool}")]
    PoolMismatch {
        /// The tier's unit bytes.
        tier: u64,
        /// The pool's.
        pool: u64,
    },
    /// A pool call failed (a stale block handle, a backend error).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The entry was spilled from a pool of another layout: its bytes mean something else.
    #[error("entry spilled from layout {entry}, the pool is layout {pool}")]
    ForeignLayout {
        /// The layout id the entry carries.
        entry: String,
        /// The pool's.
        pool: String,
    },
    /// Pinned host memory could not be had.
    #[error("pinned host allocation of {bytes} bytes failed: {source}")]
    Pinned {
        /// Bytes asked for.
        bytes: u64,
        /// What the backend refused.
        source: BackendError,
    },
    /// The backend's pinned allocation is not what was asked for (its trait contract broken).
    #[error("pinned host allocation of {bytes} bytes: {message}")]
    BadPinned {
        /// Bytes asked for.
        bytes: u64,
        /// What the backend returned.
        message: String,
    },
    /// A shared tier's file I/O failed (the directory gone, a full disk): the entry is a
    /// miss, nothing was written or restored.
    #[error("shared tier: {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A shared tier's entry failed its checks (torn, truncated, corrupt, another key's):
    /// a miss, never bytes in the pool; the file is removed.
    #[error("shared tier entry refused: {what}")]
    Corrupt {
        /// Which check failed.
        what: &'static str,
    },
}
}

/// One part of a unit in a pool: for block `id` at `base + id × stride`, `bytes` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UnitPart {
    base: u64,
    stride: u64,
    bytes: u64,
}

/// The parts of one unit of `pool`, in the tier's order: planes, then indexer pools × layers.
pub(crate) fn unit_parts(pool: &Pool) -> Result<Vec<UnitPart>, PoolError> {
    let g = &pool.spec().geometry;
    let mut parts = Vec::new();
    for (p, &w) in pool.spec().plane_widths.iter().enumerate() {
        let bb = g.block_bytes(w);
        parts.push(UnitPart { base: pool.plane_ptr(p)?, stride: bb, bytes: bb });
    }
    if let Some(base) = pool.indexer_ptr() {
        for (layers, &off) in pool.indexer_parts().iter().zip(pool.indexer_offsets()) {
            for part in layers {
                parts.push(UnitPart {
                    base: base + off + part.prefix * pool.indexer_blocks(),
                    stride: part.block_bytes,
                    bytes: part.block_bytes,
                });
            }
        }
    }
    Ok(parts)
}

/// The bytes of each part of a unit of `pool`.
pub(crate) fn part_bytes(pool: &Pool) -> Result<Vec<u64>, PoolError> {
    Ok(unit_parts(pool)?.iter().map(|p| p.bytes).collect())
}

/// The parts of `pool`'s units, refused unless their sizes are `part_bytes` (a tier built for
/// a pool of another shape).
pub(crate) fn parts_matching(pool: &Pool, part_bytes: &[u64]) -> Result<Vec<UnitPart>, HostTierError> {
    let parts = unit_parts(pool)?;
    if parts.len() != part_bytes.len() || parts.iter().zip(part_bytes).any(|(p, &b)| p.bytes != b) {
        let (tier, pool) = (part_bytes.iter().sum(), parts.iter().map(|p| p.bytes).sum());
        return Err(HostTierError::PoolMismatch { tier, pool });
    }
    Ok(parts)
}

/// `units` fresh blocks of `pool` for a restore, all or none (`NoRoom`: nothing stays
/// allocated). The caller holds the boundary pinned.
pub(crate) fn alloc_units(pool: &Pool, units: usize) -> Result<Vec<BlockHandle>, HostTierError> {
    let mut blocks = Vec::with_capacity(units);
    for _ in 0..units {
        match pool.alloc_block() {
            Ok(g) => blocks.push(g.handle),
            Err(source) => {
                for &b in &blocks {
                    let _ = pool.free_block(b);
                }
                return Err(HostTierError::NoRoom { units, source });
            }
        }
    }
    Ok(blocks)
}

/// Runs of consecutive ids: `(index of first, first id, count)`.
fn id_runs(ids: &[u32]) -> Vec<(usize, u32, usize)> {
    let mut out: Vec<(usize, u32, usize)> = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.1 as u64 + r.2 as u64 == id as u64 => r.2 += 1,
            _ => out.push((i, id, 1)),
        }
    }
    out
}

/// Queue, on `stream`, the copies between the units `ids` of a pool and host memory
/// at `host` laid out part-major (every unit's part 0, then part 1, …; `ids.len()` units): one
/// copy per part per run of consecutive ids. The bytes are in place once the stream has been
/// synchronised.
///
/// # Safety
/// `backend` and `stream` are the pool's; `host .. host + ids.len() × unit bytes` lies in a
/// live allocation of `backend`'s `alloc_host`, neither read nor written by anyone else until
/// the stream has been synchronised; `ids` are live blocks of the pool that no relocation
/// moves meanwhile (the boundary is pinned); `parts` are [`unit_parts`] of the pool.
pub(crate) unsafe fn copy_units(
    backend: &dyn Backend,
    stream: Stream,
    parts: &[UnitPart],
    host: *mut u8,
    ids: &[u32],
    to_host: bool,
) -> Result<(), PoolError> {
    let n = ids.len();
    let mut start = 0usize;
    let runs = id_runs(ids);
    for part in parts {
        for &(i, id, count) in &runs {
            let at = start + i * part.bytes as usize;
            let len = count * part.bytes as usize;
            let dev = part.base + u64::from(id) * part.stride;
            // SAFETY: `id .. id + count` are blocks of this pool, so `dev .. dev + len` lies
            // inside the part's plane or indexer layer; `at .. at + len` lies inside the
            // caller's host range (part-major, `n` units).
            unsafe {
                let cells = HostMem::from_raw_parts(host.add(at), len);
                if to_host {
                    backend.download_host(cells, dev, stream)?
                } else {
                    backend.upload_host(dev, cells, stream)?
                }
            }
        }
        start += n * part.bytes as usize;
    }
    Ok(())
}

struct Entry {
    /// `(first cell, cells)`, covering the entry's units in order.
    extents: Vec<(u64, u64)>,
    /// The layout id of the pool the units were spilled from (only such a pool restores them).
    layout: LayoutId,
    units: usize,
    stamp: u64,
}

/// Host memory of a tier (its cells, or a staging buffer), from (and returned to) the pool's
/// backend.
pub(crate) struct Storage {
    backend: Arc<dyn Backend>,
    /// `None` only while dropping.
    alloc: Option<HostAllocation>,
}

impl Storage {
    /// `bytes` of host memory from `backend`'s `alloc_host` (page-locked on CUDA), its
    /// contract checked where it is cheap: every copy into the cells trusts it.
    pub(crate) fn new(backend: Arc<dyn Backend>, bytes: u64) -> Result<Storage, HostTierError> {
        let alloc = backend.alloc_host(bytes).map_err(|source| HostTierError::Pinned { bytes, source })?;
        if alloc.bytes as u64 != bytes || (bytes > 0 && alloc.ptr.is_null()) {
            let message = format!("the backend returned {} bytes at {:p}", alloc.bytes, alloc.ptr);
            // SAFETY: handed back to the backend that returned it, unused.
            unsafe { backend.free_host(alloc) };
            return Err(HostTierError::BadPinned { bytes, message });
        }
        Ok(Storage { backend, alloc: Some(alloc) })
    }
    /// The cells' first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.alloc.as_ref().map_or(std::ptr::null_mut(), |a| a.ptr)
    }
    /// Bytes held.
    pub(crate) fn len(&self) -> usize {
        self.alloc.as_ref().map_or(0, |a| a.bytes)
    }
    pub(crate) fn pinned(&self) -> bool {
        self.alloc.as_ref().is_some_and(|a| a.pinned)
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Some(a) = self.alloc.take() {
            // SAFETY: from this backend's `alloc_host`; every copy the tier queues is waited
            // for before the call that queued it returns.
            unsafe { self.backend.free_host(a) };
        }
    }
}

/// Copy the units of `blocks` (live blocks of `pool`) into (`to_host`) or out of the host
/// buffer at `host`, on the pool's stream, waiting for the copies; the boundary pinned from
/// the handle look-up until they finish.
///
/// # Safety
/// `host` holds `blocks.len()` units of `parts` from `pool`'s backend's `alloc_host`, and
/// nothing else reads or writes it until this returns.
pub(crate) unsafe fn copy_blocks_synced(
    pool: &Pool,
    parts: &[UnitPart],
    host: *mut u8,
    blocks: &[BlockHandle],
    to_host: bool,
) -> Result<(), HostTierError> {
    let _pin = pool.pin_boundary()?;
    let ids = pool.block_ids(blocks)?;
    // SAFETY: the caller's promise on `host`; the ids are this pool's live blocks, the
    // boundary pinned.
    let queued = unsafe { copy_units(pool.backend().as_ref(), pool.stream(), parts, host, &ids, to_host) };
    let finished = pool.backend().synchronize(pool.stream()).map_err(PoolError::from);
    Ok(queued.and(finished)?)
}

/// `units` fresh blocks of `pool` holding the units at `host` (all or nothing: on a failure
/// they are freed again).
///
/// # Safety
/// `host` holds `units` units of `parts` from `pool`'s backend's `alloc_host`, untouched
/// until this returns.
pub(crate) unsafe fn restore_blocks(
    pool: &Pool,
    parts: &[UnitPart],
    host: *mut u8,
    units: usize,
) -> Result<Vec<BlockHandle>, HostTierError> {
    // Pinned from before the blocks are handed out until they are written (and, on a
    // failure, freed): the copy's own pin nests inside it.
    let _pin = pool.pin_boundary()?;
    let blocks = alloc_units(pool, units)?;
    // SAFETY: the caller's promise; the blocks were just allocated.
    if let Err(e) = unsafe { copy_blocks_synced(pool, parts, host, &blocks, false) } {
        for &b in &blocks {
            let _ = pool.free_block(b);
        }
        return Err(e);
    }
    Ok(blocks)
}

/// The whole units of `blocks` (every plane, then every indexer layer, as the tiers store
/// them: part-major), read from `pool` through a staging copy on the pool's stream.
pub fn read_units(pool: &Pool, blocks: &[BlockHandle]) -> Result<Vec<u8>, HostTierError> {
    let mut out = Vec::new();
    units_through_staging(pool, blocks, true, |host| out.extend_from_slice(host))?;
    Ok(out)
}

/// Write `data` (as [`read_units`] returns it, for the same blocks) over the whole units of
/// `blocks`; refused unless `data` is exactly their bytes.
pub fn write_units(pool: &Pool, blocks: &[BlockHandle], data: &[u8]) -> Result<(), HostTierError> {
    let unit: u64 = part_bytes(pool)?.iter().sum();
    if data.len() as u64 != unit * blocks.len() as u64 {
        return Err(HostTierError::PoolMismatch {
            tier: data.len() as u64,
            pool: unit * blocks.len() as u64,
        });
    }
    units_through_staging(pool, blocks, false, |host| host.copy_from_slice(data))
}

/// Copy `blocks`' units to (`to_host`) or from a fresh staging buffer, `with` seeing the buffer
/// after (`to_host`) or before the copies.
fn units_through_staging(
    pool: &Pool,
    blocks: &[BlockHandle],
    to_host: bool,
    mut with: impl FnMut(&mut [u8]),
) -> Result<(), HostTierError> {
    let parts = unit_parts(pool)?;
    let bytes = parts.iter().map(|p| p.bytes).sum::<u64>() * blocks.len() as u64;
    let staging = Storage::new(pool.backend().clone(), bytes)?;
    // SAFETY: `bytes` of the staging buffer, which nothing else uses.
    let host = unsafe { std::slice::from_raw_parts_mut(staging.ptr(), bytes as usize) };
    if !to_host {
        with(host);
    }
    // SAFETY: the staging buffer holds the units of `blocks`, untouched until this returns.
    unsafe { copy_blocks_synced(pool, &parts, staging.ptr(), blocks, to_host)? };
    if to_host {
        with(host);
    }
    Ok(())
}

/// The host tier, keyed by `K` (a block hash, a checkpoint hash). See the module docs.
pub struct HostTier<K> {
    unit_bytes: u64,
    part_bytes: Vec<u64>,
    capacity: u64,
    storage: Storage,
    /// Free cells: first → count, abutting runs merged.
    free: BTreeMap<u64, u64>,
    entries: HashMap<K, Entry>,
    /// Recency order: stamp → key (oldest first).
    order: BTreeMap<u64, K>,
    clock: u64,
}

impl<K> std::fmt::Debug for HostTier<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier")
            .field("unit_bytes", &self.unit_bytes)
            .field("capacity_units", &self.capacity)
            .field("entries", &self.entries.len())
            .field("pinned", &self.storage.pinned())
            .finish()
    }
}

impl<K: Eq + Hash + Clone> HostTier<K> {
    /// A tier for units of `pool`, holding at most `budget_bytes` of host memory (allocated
    /// now by the pool's backend: page-locked on CUDA).
    pub fn new(pool: &Pool, budget_bytes: u64) -> Result<Self, HostTierError> {
        let part_bytes = part_bytes(pool)?;
        let unit_bytes: u64 = part_bytes.iter().sum();
        let capacity = budget_bytes.checked_div(unit_bytes).unwrap_or(0);
        let bytes = capacity * unit_bytes;
        let storage = Storage::new(pool.backend().clone(), bytes)?;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Ok(HostTier {
            unit_bytes,
            part_bytes,
            capacity,
            storage,
            free,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        })
    }

    /// Bytes of one unit (all parts of one block id).
    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }
    /// Whether the host memory is page-locked (copies by DMA): on CUDA.
    pub fn pinned(&self) -> bool {
        self.storage.pinned()
    }
    /// Units the budget holds.
    pub fn capacity_units(&self) -> u64 {
        self.capacity
    }
    /// Units held now.
    pub fn used_units(&self) -> u64 {
        self.capacity - self.free.values().sum::<u64>()
    }
    /// Entries held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether the tier holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Whether `key` is held.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }
    /// Units held under `key`.
    pub fn units_of(&self, key: &K) -> Option<usize> {
        self.entries.get(key).map(|e| e.units)
    }
    /// Keys from least to most recently used (the eviction order).
    pub fn lru_order(&self) -> Vec<K> {
        self.order.values().cloned().collect()
    }
    /// Extents (host runs) the entry under `key` occupies: each restores as one copy per part.
    pub fn extents_of(&self, key: &K) -> Option<usize> {
        self.entries.get(key).map(|e| e.extents.len())
    }

    /// Mark `key` as just used (a lookup hit that is not restored yet). False if not held.
    pub fn touch(&mut self, key: &K) -> bool {
        let Some(e) = self.entries.get_mut(key) else {
            return false;
        };
        self.clock += 1;
        let old = std::mem::replace(&mut e.stamp, self.clock);
        if let Some(k) = self.order.remove(&old) {
            self.order.insert(self.clock, k);
        }
        true
    }

    /// Drop the entry under `key` (its host bytes are forgotten). False if not held.
    pub fn evict(&mut self, key: &K) -> bool {
        let Some(e) = self.entries.remove(key) else {
            return false;
        };
        self.order.remove(&e.stamp);
        for (first, n) in e.extents {
            self.release_cells(first, n);
        }
        true
    }

    /// The entry under `key`, if it was spilled from a pool of `pool`'s layout.
    fn entry_for(&self, pool: &Pool, key: &K) -> Result<&Entry, HostTierError> {
        let e = self.entries.get(key).ok_or(HostTierError::NotHeld)?;
        if e.layout != *pool.layout_id() {
            return Err(HostTierError::ForeignLayout {
                entry: e.layout.to_string(),
                pool: pool.layout_id().to_string(),
            });
        }
        Ok(e)
    }

    fn check_pool(&self, pool: &Pool) -> Result<Vec<UnitPart>, HostTierError> {
        parts_matching(pool, &self.part_bytes)
    }

    /// Copy the units `blocks` of `pool` (all parts) to host memory under `key`, evicting
    /// least-recently-used entries for the shortfall; returns the evicted keys. The blocks
    /// stay allocated in the pool: free them once this returns. Refused without evicting
    /// anything if the entry exceeds the budget, the key is held, or a handle is stale.
    ///
    /// The pool's boundary is pinned from the handle look-up until the copies have finished,
    /// so no relocation can move a block between the look-up and the copy.
    pub fn spill(&mut self, pool: &Pool, key: K, blocks: &[BlockHandle]) -> Result<Vec<K>, HostTierError> {
        let parts = self.check_pool(pool)?;
        let _pin = pool.pin_boundary()?;
        if self.entries.contains_key(&key) {
            return Err(HostTierError::AlreadyHeld);
        }
        let n = blocks.len() as u64;
        if n > self.capacity {
            return Err(HostTierError::TooLarge {
                units: blocks.len(),
                unit_bytes: self.unit_bytes,
                capacity: self.capacity,
            });
        }
        let ids = pool.block_ids(blocks)?;
        let mut evicted = Vec::new();
        while self.free.values().sum::<u64>() < n {
            // n ≤ capacity: once every entry is gone the whole budget is free.
            let Some(victim) = self.order.first_key_value().map(|(_, k)| k.clone()) else {
                break;
            };
            self.evict(&victim);
            evicted.push(victim);
        }
        let extents = self.take_cells(n);
        // The pool's stream may still be writing these blocks; downloads wait for it.
        let mut done = 0usize;
        let result = (|| {
            for &(first, cells) in &extents {
                let chunk = &ids[done..done + cells as usize];
                self.copy_extent(pool, &parts, first, chunk, true)?;
                done += cells as usize;
            }
            self.finish(pool)
        })();
        if let Err(e) = result {
            // Copies already queued must finish before the cells can be handed out again.
            let _ = self.finish(pool);
            for (first, cells) in extents {
                self.release_cells(first, cells);
            }
            return Err(e);
        }
        self.clock += 1;
        self.order.insert(self.clock, key.clone());
        let layout = pool.layout_id().clone();
        self.entries.insert(key, Entry { extents, layout, units: blocks.len(), stamp: self.clock });
        Ok(evicted)
    }

    /// Bring the entry under `key` back into freshly allocated blocks of `pool` (all or
    /// none: without room nothing stays allocated and the entry stays held). Returns the
    /// blocks in the order they were spilled; the entry leaves the tier.
    pub fn restore(&mut self, pool: &Pool, key: &K) -> Result<Vec<BlockHandle>, HostTierError> {
        let units = self.entry_for(pool, key)?.units;
        // Pinned from before the blocks are handed out until they are written (and, on a
        // failure, freed): a relocation meanwhile would leave these handles stale.
        let _pin = pool.pin_boundary()?;
        let blocks = alloc_units(pool, units)?;
        match self.restore_into(pool, key, &blocks) {
            Ok(()) => Ok(blocks),
            Err(e) => {
                for &b in &blocks {
                    let _ = pool.free_block(b);
                }
                Err(e)
            }
        }
    }

    /// Bring the entry under `key` back into `blocks` (held by the caller, as many as the
    /// entry's units); the entry leaves the tier. Waits for the copies to finish.
    pub fn restore_into(
        &mut self,
        pool: &Pool,
        key: &K,
        blocks: &[BlockHandle],
    ) -> Result<(), HostTierError> {
        let parts = self.check_pool(pool)?;
        let e = self.entry_for(pool, key)?;
        if e.units != blocks.len() {
            return Err(HostTierError::UnitCount { held: e.units, got: blocks.len() });
        }
        let extents = e.extents.clone();
        // Pinned from the look-up until the uploads have finished (see `spill`).
        let _pin = pool.pin_boundary()?;
        let ids = pool.block_ids(blocks)?;
        let mut done = 0usize;
        let queued = (|| {
            for (first, cells) in extents {
                self.copy_extent(pool, &parts, first, &ids[done..done + cells as usize], false)?;
                done += cells as usize;
            }
            Ok(())
        })();
        // Uploads from page-locked memory are asynchronous: the cells may be reused as soon
        // as the entry is gone, so wait for them here (also after a failed enqueue).
        let finished = self.finish(pool);
        queued.and(finished)?;
        self.evict(key);
        Ok(())
    }

    /// After copies: wait for them (queued on the pool's stream, after the pool's earlier
    /// work on the units).
    fn finish(&self, pool: &Pool) -> Result<(), HostTierError> {
        Ok(pool.backend().synchronize(pool.stream()).map_err(PoolError::from)?)
    }

    /// Queue the copies of one extent (cells from `first`, one per id in `ids`) between host
    /// and pool on the pool's stream: one copy per part per run of consecutive ids (large
    /// copies; from page-locked memory a DMA at link speed, not through the staging ring).
    fn copy_extent(
        &mut self,
        pool: &Pool,
        parts: &[UnitPart],
        first: u64,
        ids: &[u32],
        to_host: bool,
    ) -> Result<(), HostTierError> {
        let at = (first * self.unit_bytes) as usize;
        // SAFETY: the cells `first .. first + ids.len()` lie within the capacity of the tier's
        // buffer (from the backend's `alloc_host`), held by this entry alone and not touched
        // again until `finish` has waited for the stream; the ids are blocks of this pool
        // (handles checked by the caller under the pinned boundary).
        unsafe {
            let host = self.storage.ptr().add(at);
            Ok(copy_units(self.storage.backend.as_ref(), pool.stream(), parts, host, ids, to_host)?)
        }
    }

    /// Take `n` cells: one extent if a free run is long enough, else the longest runs first.
    fn take_cells(&mut self, n: u64) -> Vec<(u64, u64)> {
        if n == 0 {
            return Vec::new();
        }
        if let Some((&first, &len)) = self.free.iter().find(|(_, &len)| len >= n) {
            self.free.remove(&first);
            if len > n {
                self.free.insert(first + n, len - n);
            }
            return vec![(first, n)];
        }
        let mut runs: Vec<(u64, u64)> = self.free.iter().map(|(&f, &l)| (f, l)).collect();
        runs.sort_by_key(|&(f, l)| (std::cmp::Reverse(l), f));
        let mut out = Vec::new();
        let mut left = n;
        for (first, len) in runs {
            if left == 0 {
                break;
            }
            let take = len.min(left);
            self.free.remove(&first);
            if len > take {
                self.free.insert(first + take, len - take);
            }
            out.push((first, take));
            left -= take;
        }
        out
    }

    /// Return cells, merging with abutting free runs.
    fn release_cells(&mut self, mut first: u64, mut n: u64) {
        if n == 0 {
            return;
        }
        if let Some((&pf, &pl)) = self.free.range(..first).next_back() {
            if pf + pl == first {
                self.free.remove(&pf);
                first = pf;
                n += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(first + n)) {
            self.free.remove(&(first + n));
            n += nl;
        }
        self.free.insert(first, n);
    }
}
