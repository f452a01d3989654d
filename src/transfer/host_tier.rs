//! The host tier: block units (cached KV blocks, or the PAGE units a checkpoint image was
//! stored in, `pool-runtime.md` §6) evicted from HBM spill to host memory instead of being
//! dropped, and come back byte-exact on a hit.
//!
//! A unit is everything a block id owns: its envelope in every plane and its block in every
//! indexer pool and CSA layer. The tier holds one host buffer of the budget (page-locked on
//! CUDA, so restores run at DMA speed; ordinary memory elsewhere) cut into unit-sized cells.
//! An entry occupies one or more **extents** of consecutive cells, laid out part-major (all
//! of the extent's plane-0 envelopes, then plane-1, then each indexer layer), so a restore
//! into consecutive block ids is one copy per part per extent rather than one per block.
//!
//! Recency decides eviction: [`HostTier::spill`] makes room by evicting the least recently
//! spilled or touched entries and returns their keys (the caller unindexes them), refusing
//! before evicting anything when the entry exceeds the whole budget. The tier decides nothing
//! else: which blocks to spill and when is the prefix-reuse manager's call.

use crate::alloc::BlockHandle;
use crate::backend::{BackendKind, Stream};
use crate::pool::{Pool, PoolError};
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use thiserror::Error;

/// What the host tier refuses or fails with.
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
    /// Pinned host memory could not be had.
    #[error("pinned host allocation of {bytes} bytes failed: {message}")]
    Pinned {
        /// Bytes asked for.
        bytes: u64,
        /// Driver message.
        message: String,
    },
}

/// One part of a unit in a pool: for block `id` at `base + id × stride`, `bytes` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UnitPart {
    base: u64,
    stride: u64,
    bytes: u64,
}

/// The parts of one unit of `pool`, in the tier's order: planes, then indexer pools × layers.
fn unit_parts(pool: &Pool) -> Result<Vec<UnitPart>, PoolError> {
    let g = &pool.spec().geometry;
    let mut parts = Vec::new();
    for (p, &w) in pool.spec().plane_widths.iter().enumerate() {
        let bb = g.block_bytes(w);
        parts.push(UnitPart { base: pool.plane_ptr(p)?, stride: bb, bytes: bb });
    }
    if let (Some(base), Some(ix)) = (pool.indexer_ptr(), pool.spec().indexer) {
        for (&pb, &off) in ix.pool_block_bytes().iter().zip(pool.indexer_offsets()) {
            for c in 0..pool.spec().csa_layers.len() as u64 {
                parts.push(UnitPart {
                    base: base + off + c * pool.indexer_blocks() * pb,
                    stride: pb,
                    bytes: pb,
                });
            }
        }
    }
    Ok(parts)
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

struct Entry {
    /// `(first cell, cells)`, covering the entry's units in order.
    extents: Vec<(u64, u64)>,
    units: usize,
    stamp: u64,
}

/// Host memory of the tier: page-locked on CUDA (copied by DMA on the tier's own stream),
/// ordinary elsewhere (copied through the backend).
enum Storage {
    Heap(Vec<u8>),
    Pinned(pinned::PinnedBuf, pinned::DmaStream),
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
            .field("pinned", &matches!(self.storage, Storage::Pinned(..)))
            .finish()
    }
}

impl<K: Eq + Hash + Clone> HostTier<K> {
    /// A tier for units of `pool`, holding at most `budget_bytes` of host memory (allocated
    /// now; page-locked when the pool is on CUDA).
    pub fn new(pool: &Pool, budget_bytes: u64) -> Result<Self, HostTierError> {
        let part_bytes: Vec<u64> = unit_parts(pool)?.iter().map(|p| p.bytes).collect();
        let unit_bytes: u64 = part_bytes.iter().sum();
        let capacity = budget_bytes.checked_div(unit_bytes).unwrap_or(0);
        let bytes = capacity * unit_bytes;
        let storage = if pool.backend().kind() == BackendKind::Cuda {
            let dma = pinned::DmaStream::for_pointer(pool.plane_ptr(0)?)?;
            Storage::Pinned(pinned::PinnedBuf::new(bytes)?, dma)
        } else {
            let n = usize::try_from(bytes)
                .map_err(|_| HostTierError::Pinned { bytes, message: "exceeds the address space".into() })?;
            Storage::Heap(vec![0; n])
        };
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

    fn check_pool(&self, pool: &Pool) -> Result<Vec<UnitPart>, HostTierError> {
        let parts = unit_parts(pool)?;
        let bytes: Vec<u64> = parts.iter().map(|p| p.bytes).collect();
        if bytes != self.part_bytes {
            return Err(HostTierError::PoolMismatch { tier: self.unit_bytes, pool: bytes.iter().sum() });
        }
        Ok(parts)
    }

    /// Copy the units `blocks` of `pool` (all parts) to host memory under `key`, evicting
    /// least-recently-used entries for the shortfall; returns the evicted keys. The blocks
    /// stay allocated in the pool: free them once this returns. Refused without evicting
    /// anything if the entry exceeds the budget, the key is held, or a handle is stale.
    pub fn spill(&mut self, pool: &Pool, key: K, blocks: &[BlockHandle]) -> Result<Vec<K>, HostTierError> {
        let parts = self.check_pool(pool)?;
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
        for &b in blocks {
            pool.check_block(b)?;
        }
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
        let ids: Vec<u32> = blocks.iter().map(|b| b.id).collect();
        // The pool's stream may still be writing these blocks; downloads wait for it.
        let mut done = 0usize;
        let result = (|| {
            self.begin(pool)?;
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
        self.entries.insert(key, Entry { extents, units: blocks.len(), stamp: self.clock });
        Ok(evicted)
    }

    /// Bring the entry under `key` back into freshly allocated blocks of `pool` (all or
    /// none: without room nothing stays allocated and the entry stays held). Returns the
    /// blocks in the order they were spilled; the entry leaves the tier.
    pub fn restore(&mut self, pool: &Pool, key: &K) -> Result<Vec<BlockHandle>, HostTierError> {
        let units = self.entries.get(key).ok_or(HostTierError::NotHeld)?.units;
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
        let e = self.entries.get(key).ok_or(HostTierError::NotHeld)?;
        if e.units != blocks.len() {
            return Err(HostTierError::UnitCount { held: e.units, got: blocks.len() });
        }
        for &b in blocks {
            pool.check_block(b)?;
        }
        let extents = e.extents.clone();
        let ids: Vec<u32> = blocks.iter().map(|b| b.id).collect();
        let mut done = 0usize;
        let queued = self.begin(pool).and_then(|()| {
            for (first, cells) in extents {
                self.copy_extent(pool, &parts, first, &ids[done..done + cells as usize], false)?;
                done += cells as usize;
            }
            Ok(())
        });
        // Uploads from page-locked memory are asynchronous: the cells may be reused as soon
        // as the entry is gone, so wait for them here (also after a failed enqueue).
        let finished = self.finish(pool);
        queued.and(finished)?;
        self.evict(key);
        Ok(())
    }

    /// Before copies: the pool's queued work on the units (writes, relocations, slot
    /// initialisation) must be done before the tier's own stream reads or overwrites them.
    fn begin(&self, pool: &Pool) -> Result<(), HostTierError> {
        if let Storage::Pinned(..) = self.storage {
            pool.backend().synchronize(pool.stream()).map_err(PoolError::from)?;
        }
        Ok(())
    }

    /// After copies: wait for them (DMA on the tier's stream, or the pool's stream).
    fn finish(&self, pool: &Pool) -> Result<(), HostTierError> {
        match &self.storage {
            Storage::Pinned(_, dma) => dma.synchronize(),
            Storage::Heap(_) => Ok(pool.backend().synchronize(pool.stream()).map_err(PoolError::from)?),
        }
    }

    /// Queue the copies of one extent (cells from `first`, one per id in `ids`) between host
    /// and pool: one copy per part per run of consecutive ids. Page-locked storage copies by
    /// DMA on the tier's stream (large asynchronous copies at link speed, not through the
    /// backend's staging ring); ordinary storage through the backend.
    fn copy_extent(
        &mut self,
        pool: &Pool,
        parts: &[UnitPart],
        first: u64,
        ids: &[u32],
        to_host: bool,
    ) -> Result<(), HostTierError> {
        let n = ids.len() as u64;
        let mut host = (first * self.unit_bytes) as usize;
        let backend = pool.backend().clone();
        let stream: Stream = pool.stream();
        let runs = id_runs(ids);
        let (buf, dma) = match &mut self.storage {
            Storage::Heap(v) => (v.as_mut_slice(), None),
            Storage::Pinned(p, d) => (p.as_mut_slice(), Some(&*d)),
        };
        for part in parts {
            for &(i, id, count) in &runs {
                let at = host + i * part.bytes as usize;
                let slice = &mut buf[at..at + count * part.bytes as usize];
                let dev = part.base + u64::from(id) * part.stride;
                // SAFETY: `id .. id + count` are blocks of this pool (handles checked), so
                // `dev .. dev + count × bytes` lies inside the part's plane or indexer layer;
                // `slice` is a disjoint host buffer owned by the tier, not touched again until
                // `finish` has waited for the copy.
                unsafe {
                    match (dma, to_host) {
                        (Some(d), true) => d.download(slice, dev)?,
                        (Some(d), false) => d.upload(dev, slice)?,
                        (None, true) => backend.download(slice, dev, stream).map_err(PoolError::from)?,
                        (None, false) => backend.upload(dev, slice, stream).map_err(PoolError::from)?,
                    }
                }
            }
            host += (n * part.bytes) as usize;
        }
        Ok(())
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

mod pinned {
    //! Page-locked host memory from the CUDA driver (portable: usable from every context).

    use super::HostTierError;
    use cudarc::driver::sys;

    /// A page-locked buffer, freed on drop.
    pub struct PinnedBuf {
        ptr: *mut u8,
        len: usize,
    }

    // SAFETY: the buffer is plain host memory owned by this value alone; access goes through
    // `&mut self`.
    unsafe impl Send for PinnedBuf {}
    // SAFETY: no interior mutability: shared references give no access to the bytes.
    unsafe impl Sync for PinnedBuf {}

    fn err(bytes: u64, message: impl Into<String>) -> HostTierError {
        HostTierError::Pinned { bytes, message: message.into() }
    }

    /// Make device 0's primary context current on this thread (pinned memory is portable,
    /// so which context does not matter, only that one is current).
    fn bind(bytes: u64) -> Result<(), HostTierError> {
        if !crate::backend::cuda::is_available() {
            return Err(err(bytes, "no CUDA driver or device"));
        }
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the driver is initialised (probed above); plain out-pointers. The primary
        // context stays retained for the process, as the CUDA backend's does.
        unsafe {
            if sys::cuDeviceGet(&mut dev, 0) != sys::CUresult::CUDA_SUCCESS
                || sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) != sys::CUresult::CUDA_SUCCESS
                || sys::cuCtxSetCurrent(ctx) != sys::CUresult::CUDA_SUCCESS
            {
                return Err(err(bytes, "could not make a CUDA context current"));
            }
        }
        Ok(())
    }

    /// A stream of its own on the device that owns the pool's memory, for the tier's copies.
    pub struct DmaStream {
        ctx: sys::CUcontext,
        stream: sys::CUstream,
    }

    // SAFETY: driver handles usable from any thread; the tier uses them through `&self` /
    // `&mut self` of its owner, one call at a time.
    unsafe impl Send for DmaStream {}
    // SAFETY: as above; the driver's stream calls are thread-safe.
    unsafe impl Sync for DmaStream {}

    fn cu(call: &str, r: sys::CUresult) -> Result<(), HostTierError> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(err(0, format!("{call}: {r:?}")))
        }
    }

    impl DmaStream {
        /// A stream on the device holding device address `ptr`.
        pub fn for_pointer(ptr: u64) -> Result<DmaStream, HostTierError> {
            bind(0)?;
            let mut ordinal: std::ffi::c_int = 0;
            let (mut dev, mut ctx, mut stream) = (0, std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: a context is current; plain out-pointers; `ptr` is only queried.
            unsafe {
                cu(
                    "cuPointerGetAttribute",
                    sys::cuPointerGetAttribute(
                        (&mut ordinal as *mut std::ffi::c_int).cast(),
                        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                        ptr,
                    ),
                )?;
                cu("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal))?;
                cu("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
                cu(
                    "cuStreamCreate",
                    sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                )?;
            }
            Ok(DmaStream { ctx, stream })
        }

        /// Queue a host-to-device copy.
        ///
        /// # Safety
        /// `dst .. dst + src.len()` is live device memory; `src` is page-locked and stays
        /// untouched until [`DmaStream::synchronize`].
        pub unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<(), HostTierError> {
            // SAFETY: the caller's promise; our own context and stream.
            unsafe {
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx))?;
                cu(
                    "cuMemcpyHtoDAsync",
                    sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.stream),
                )
            }
        }

        /// Queue a device-to-host copy.
        ///
        /// # Safety
        /// `src .. src + dst.len()` is live device memory; `dst` is page-locked and not read
        /// until [`DmaStream::synchronize`].
        pub unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<(), HostTierError> {
            // SAFETY: the caller's promise; our own context and stream.
            unsafe {
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx))?;
                cu(
                    "cuMemcpyDtoHAsync",
                    sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), self.stream),
                )
            }
        }

        /// Wait for every queued copy.
        pub fn synchronize(&self) -> Result<(), HostTierError> {
            // SAFETY: our own context and stream.
            unsafe {
                cu("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx))?;
                cu("cuStreamSynchronize", sys::cuStreamSynchronize(self.stream))
            }
        }
    }

    impl Drop for DmaStream {
        fn drop(&mut self) {
            let _ = self.synchronize();
            // SAFETY: idle after the synchronize; destroyed once.
            unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }

    impl PinnedBuf {
        /// `bytes` of page-locked, zeroed host memory.
        pub fn new(bytes: u64) -> Result<PinnedBuf, HostTierError> {
            let len = usize::try_from(bytes).map_err(|_| err(bytes, "exceeds the address space"))?;
            if len == 0 {
                return Ok(PinnedBuf { ptr: std::ptr::NonNull::dangling().as_ptr(), len: 0 });
            }
            bind(bytes)?;
            let mut p = std::ptr::null_mut();
            // SAFETY: a context is current; `p` is an out-pointer.
            let r = unsafe { sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE) };
            if r != sys::CUresult::CUDA_SUCCESS || p.is_null() {
                return Err(err(bytes, format!("cuMemHostAlloc: {r:?}")));
            }
            // SAFETY: `p` is `len` writable bytes just allocated.
            unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
            Ok(PinnedBuf { ptr: p.cast(), len })
        }

        /// The bytes.
        pub fn as_mut_slice(&mut self) -> &mut [u8] {
            // SAFETY: `ptr` is `len` bytes owned by `self` (dangling only when len is 0).
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
    }

    impl Drop for PinnedBuf {
        fn drop(&mut self) {
            if self.len > 0 && bind(self.len as u64).is_ok() {
                // SAFETY: allocated by cuMemHostAlloc; the tier waits for every copy that uses it.
                unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
            }
        }
    }
}
