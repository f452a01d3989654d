//! Boundary moves and the copies they need: growing and shrinking the slot and block regions
//! (relocation planned on a copy, committed once every copy is queued), copy runs between
//! blocks and positions, region copies for checkpoints and transfers, and fills of fresh
//! positions; all under the pool's one state lock.

use super::{checked, BoundaryPin, Pool, PoolError, State, DESCRIPTOR_BYTES};
use crate::alloc::BlockHandle;
use crate::boundary::{Boundary, BoundaryChange, BoundaryError};
use crate::checkpoint::{Loc, Region, RegionCopy};
use crate::index::{CopyRun, CopyRunsArgs, DevicePtr, FillRun, FillRunsArgs, Launch};

impl Pool {
    /// Run a closure on the boundary (read-only), e.g. for reporting.
    pub fn with_boundary<R>(&self, f: impl FnOnce(&Boundary) -> R) -> Result<R, PoolError> {
        Ok(f(&self.lock()?.boundary))
    }

    // ---- the elastic boundary -----------------------------------------------------------

    /// Move the boundary by `op` and carry out what it reports: copy relocated blocks (both
    /// planes and every indexer layer) and slots. The copies are queued on the pool's stream
    /// before anything else the caller queues.
    ///
    /// All or nothing: the move is planned on a copy of the bookkeeping and committed only
    /// once every copy is queued. If one fails, the pool keeps its old split and handles;
    /// the copies that did run wrote only ids and positions that are free in the old split
    /// (block moves go to free ids below the new count, slot moves to vacant groups), and
    /// the pool's allocator indexes no hashes, so nothing live was touched. Newly live
    /// positions are not filled here: [`Pool::alloc_slot`] initialises every position it
    /// hands out, under this lock, before its holder can write it — a fill here would
    /// overwrite the rows of the old split's blocks before the move is known to stand.
    fn apply(
        &self,
        op: impl FnOnce(&mut Boundary) -> Result<BoundaryChange, BoundaryError>,
    ) -> Result<BoundaryChange, PoolError> {
        let _range = crate::profiling::range("v4pool.boundary_move");
        let mut st = self.lock()?;
        if st.pins > 0 {
            return Err(PoolError::BoundaryPinned { pins: st.pins });
        }
        let mut next = st.boundary.clone();
        let change = op(&mut next)?;
        let runs = self.relocation_runs(&change)?;
        // Under the lock that moves the boundary: a slot or block handed out right after
        // the move is written by its holder only after these are queued.
        // SAFETY: the runs were derived from this pool's planes and indexer by the geometry.
        unsafe { self.queue_copies(&runs)? };
        st.boundary = next;
        Ok(change)
    }

    /// Pin the boundary: until the returned guard drops, every boundary move is refused
    /// with [`PoolError::BoundaryPinned`], so the ids and positions of held handles stay
    /// where they are. For copies that run outside the pool's stream and lock (a transfer
    /// engine's, a host tier's): pin first, then look handles up, copy, and drop the pin.
    /// Allocation and release go on meanwhile.
    pub fn pin_boundary(&self) -> Result<BoundaryPin<'_>, PoolError> {
        let mut st = self.lock()?;
        st.pins = st.pins.checked_add(1).ok_or(PoolError::Overflow("boundary pins"))?;
        Ok(BoundaryPin { pool: self })
    }

    /// Block ids of held handles, looked up together under the state lock.
    pub fn block_ids(&self, blocks: &[BlockHandle]) -> Result<Vec<u32>, PoolError> {
        let st = self.lock()?;
        blocks
            .iter()
            .map(|&b| {
                st.boundary.check_block(b)?;
                Ok(b.id)
            })
            .collect()
    }

    /// Add `n` slots, moving the boundary down (relocating blocks as needed).
    pub fn grow_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_slots(n))
    }
    /// Remove `n` slots, moving the boundary up (relocating slots as needed).
    pub fn shrink_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.shrink_slots(n))
    }
    /// Add `n` blocks in the gap.
    pub fn grow_blocks(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_blocks(n))
    }
    /// Add `n` blocks, giving up slots when the gap is too small.
    pub fn grow_blocks_shrinking_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_blocks_shrinking_slots(n))
    }
    /// Remove `n` blocks (relocating blocks as needed).
    pub fn shrink_blocks(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.shrink_blocks(n))
    }
    /// Move the split to exactly `num_blocks` blocks and `num_slots` slots.
    pub fn resize(&self, num_blocks: u32, num_slots: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.resize(num_blocks, num_slots))
    }

    /// The copies a boundary change needs, as device byte ranges.
    fn relocation_runs(&self, change: &BoundaryChange) -> Result<Vec<CopyRun>, PoolError> {
        let mut runs = Vec::new();
        for m in &change.block_moves {
            runs.extend(self.block_copy_runs(m.old.id, m.new.id)?);
        }
        for m in &change.slot_moves {
            runs.extend(self.slot_copy_runs(m.from_position, m.to_position)?);
        }
        Ok(runs)
    }

    /// Copies that move block `from`'s bytes to block `to`: its envelope rows in every plane
    /// and its block in every indexer pool and CSA layer.
    pub fn block_copy_runs(&self, from: u32, to: u32) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        for id in [from, to] {
            if u64::from(id) >= self.indexer_blocks {
                return Err(PoolError::NoSuchBlock { id, max: self.indexer_blocks });
            }
        }
        let (from, to) = (u64::from(from), u64::from(to));
        let mut runs = Vec::new();
        for (p, &w) in self.spec.plane_widths.iter().enumerate() {
            let base = self.plane_ptr(p)?;
            let bytes = g.block_bytes(w);
            runs.push(CopyRun { src: base + from * bytes, dst: base + to * bytes, bytes });
        }
        if let Some(base) = self.indexer_ptr() {
            for (parts, &off) in self.indexer_parts().iter().zip(&self.indexer_offsets) {
                for part in parts {
                    let (pb, layer) = (part.block_bytes, base + off + part.prefix * self.indexer_blocks);
                    runs.push(CopyRun { src: layer + from * pb, dst: layer + to * pb, bytes: pb });
                }
            }
        }
        Ok(runs)
    }

    /// Copies that move the slot at position `from` to position `to` (state and windows,
    /// every plane).
    pub fn slot_copy_runs(&self, from: i64, to: i64) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        let (from, _) = g.slot_span(from)?;
        let (to, _) = g.slot_span(to)?;
        let mut runs = Vec::new();
        for (p, &w) in self.spec.plane_widths.iter().enumerate() {
            let base = self.plane_ptr(p)?;
            runs.push(CopyRun {
                src: base + from as u64 * w,
                dst: base + to as u64 * w,
                bytes: g.slot_bytes(w),
            });
        }
        Ok(runs)
    }

    /// Queue `runs` (non-overlapping byte copies) as descriptor launches on the pool stream,
    /// ordered after every relocation queued before it.
    ///
    /// # Safety
    /// Every run's source and destination must be live memory of this pool's backend that
    /// stays live until the pool's stream has run the copy, and no destination may overlap
    /// another run's bytes. Prefer [`Pool::copy_regions`], which checks runs against the
    /// pool's own memory.
    pub unsafe fn copy_runs(&self, runs: &[CopyRun]) -> Result<(), PoolError> {
        let _st = self.lock()?;
        // SAFETY: the caller's contract.
        unsafe { self.queue_copies(runs) }
    }

    /// Queue copies between the pool's own regions (planes and indexer pools, offsets from
    /// each region's first byte; [`crate::checkpoint::RegionCopy`], as a store or restore plan
    /// writes them), under the lock that moves the boundary. Every run is checked to lie in
    /// its regions and not to overlap itself; nothing is queued if one fails.
    pub fn copy_regions(&self, runs: &[RegionCopy]) -> Result<(), PoolError> {
        let mut raw = Vec::with_capacity(runs.len());
        for (index, r) in runs.iter().enumerate() {
            let src = self.region_range(r.src, r.bytes)?;
            let dst = self.region_range(r.dst, r.bytes)?;
            if r.src.region == r.dst.region
                && r.src.offset < r.dst.offset + r.bytes
                && r.dst.offset < r.src.offset + r.bytes
            {
                return Err(PoolError::SelfOverlap { index });
            }
            raw.push(CopyRun { src, dst, bytes: r.bytes });
        }
        let _st = self.lock()?;
        // SAFETY: every run was checked to lie inside this pool's planes or indexer.
        unsafe { self.queue_copies(&raw) }
    }

    /// Bytes of a region: a plane, or one indexer pool (`[n_csa][indexer_blocks][block]`).
    fn region_bytes(&self, region: Region) -> Result<u64, PoolError> {
        match region {
            Region::Plane(p) => self.plane_bytes(p),
            Region::Indexer(i) => {
                let parts = self.indexer_parts().get(i).ok_or(PoolError::NoSuchRegion { region })?;
                let per_block = parts.iter().try_fold(0u64, |acc, p| acc.checked_add(p.block_bytes));
                checked(per_block.and_then(|b| b.checked_mul(self.indexer_blocks)), "indexer pool bytes")
            }
        }
    }

    /// The device address of `loc .. loc + bytes`, checked to lie in its region.
    fn region_range(&self, loc: Loc, bytes: u64) -> Result<DevicePtr, PoolError> {
        let limit = self.region_bytes(loc.region)?;
        if loc.offset.checked_add(bytes).is_none_or(|end| end > limit) {
            return Err(PoolError::OutOfRange { what: "the region", offset: loc.offset, len: bytes, limit });
        }
        Ok(match loc.region {
            Region::Plane(p) => self.plane_ptr(p)?,
            Region::Indexer(i) => self.indexer_ptr().unwrap_or(0) + self.indexer_offsets[i],
        } + loc.offset)
    }

    /// Queue copies with the caller holding the state lock (or owning the pool outright).
    ///
    /// # Safety
    /// As [`Pool::copy_runs`].
    pub(super) unsafe fn queue_copies(&self, runs: &[CopyRun]) -> Result<(), PoolError> {
        let _range = crate::profiling::range("v4pool.copy_runs");
        self.run_descriptors(&split_runs(runs), |runs, num_runs| {
            Launch::CopyRuns(CopyRunsArgs { runs, num_runs, _pad: 0 })
        })
    }

    /// Initialise the compressor state of `positions` (zero kv, −inf scores, zero padding),
    /// under the lock that hands positions out. Every position must be a live slot position
    /// (one the slot region holds now); anything else is refused before a byte is written.
    pub fn init_positions(&self, positions: std::ops::Range<i64>) -> Result<(), PoolError> {
        let st = self.lock()?;
        self.init_positions_locked(&st, positions)
    }

    /// [`Pool::init_positions`] with the lock held by the caller (`st` proves it).
    pub(super) fn init_positions_locked(
        &self,
        st: &State,
        positions: std::ops::Range<i64>,
    ) -> Result<(), PoolError> {
        let _range = crate::profiling::range("v4pool.init_state");
        let live = st.boundary.live_positions();
        if !positions.is_empty() && (positions.start < live.start || positions.end > live.end) {
            return Err(PoolError::NotLive {
                start: positions.start,
                end: positions.end,
                live_start: live.start,
                live_end: live.end,
            });
        }
        let g = &self.spec.geometry;
        let mut runs = Vec::new();
        for pos in positions {
            for r in self.spec.arena.fill_runs(pos, g.slot_rows)? {
                runs.push(FillRun {
                    dst: self.plane_range(r.plane, r.offset, r.bytes)?,
                    bytes: r.bytes,
                    pattern: r.pattern,
                    _pad: 0,
                });
            }
        }
        self.run_descriptors(&runs, |runs, num_runs| {
            Launch::FillRuns(FillRunsArgs { runs, num_runs, _pad: 0 })
        })
    }

    /// Upload `items` into the descriptor buffer a chunk at a time and queue `launch` for each
    /// chunk. The descriptor lock is held across each upload and its launch: both are queued
    /// on the pool's one stream, so another thread's next upload is ordered after this launch
    /// and cannot overwrite descriptors it has yet to read.
    fn run_descriptors<T: bytemuck::Pod>(
        &self,
        items: &[T],
        launch: impl Fn(DevicePtr, i32) -> Launch,
    ) -> Result<(), PoolError> {
        let desc = self.descriptors.as_ref().map_or(0, |a| a.ptr);
        let per = (DESCRIPTOR_BYTES as usize / std::mem::size_of::<T>()).max(1);
        let _guard = self.descriptor_lock.lock().map_err(|_| PoolError::Poisoned)?;
        for chunk in items.chunks(per) {
            // SAFETY: the descriptor buffer holds DESCRIPTOR_BYTES and is live while the pool
            // is; every run was derived from this pool's own allocations (checked by the
            // geometry and the arena); upload and launch are ordered on the same stream.
            unsafe {
                self.backend.upload(desc, bytemuck::cast_slice(chunk), self.stream)?;
                self.backend.launch(&launch(desc, chunk.len() as i32), self.stream)?;
            }
        }
        Ok(())
    }
}

/// Bytes one copy run carries at most once split: the copy kernel gives every run the same
/// number of blocks, so a few large runs (a 17 MB slot move is two) would leave most of the
/// device idle. Pieces this size keep every run's blocks busy and the grid wide.
pub const COPY_PIECE_BYTES: u64 = 256 << 10;

/// `runs` with every run longer than [`COPY_PIECE_BYTES`] cut into pieces (same bytes).
pub fn split_runs(runs: &[CopyRun]) -> Vec<CopyRun> {
    let mut out = Vec::with_capacity(runs.len());
    for r in runs {
        let mut done = 0;
        while done < r.bytes {
            let n = (r.bytes - done).min(COPY_PIECE_BYTES);
            out.push(CopyRun { src: r.src + done, dst: r.dst + done, bytes: n });
            done += n;
        }
    }
    out
}
