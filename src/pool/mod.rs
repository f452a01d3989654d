//! `Pool`: the planes on a backend, per-layer views, slot state, checkpoints, relocations,
//! transfer regions, and the persistent index buffers.
//!
//! The pool is the one place that combines the geometry, the allocators and a backend. It
//! owns one allocation carved into 256-byte aligned planes (NoPE then RoPE, or the single
//! bf16 plane) and, when the model has CSA layers, a second one for the indexer cache sized
//! for the most blocks the plane can ever hold, so neither moves when the boundary does.
//!
//! Threads: `Pool` is `Send + Sync`. Allocation, release and boundary moves take one
//! internal mutex (they are host bookkeeping plus, for moves, copies queued on the pool's
//! stream); views and index-buffer addresses are plain values that never change.

pub mod decode;

pub use decode::{decode_slice_lens, DecodeCapacity, DecodeError, DecodeIndexBuffers, DecodeSeq};

use crate::alloc::{AllocError, BlockGrant, BlockHandle, SlotHandle};
use crate::arena::{ArenaError, ArenaLayout, FieldView};
use crate::backend::{Backend, BackendError, DeviceAllocation, Stream};
use crate::boundary::{Boundary, BoundaryChange, BoundaryError};
use crate::geometry::{GeometryError, UnifiedPoolGeometry, DENSE_RATIO};
use crate::index::{CopyRun, CopyRunsArgs, DevicePtr, FillRun, FillRunsArgs, Launch};
use std::sync::{Arc, Mutex, MutexGuard};
use thiserror::Error;

/// Runs one descriptor launch carries; longer lists take several launches.
const DESCRIPTOR_RUNS: usize = 4096;
const PLANE_ALIGN: u64 = 256;

/// What the pool is built from: a geometry at a fixed plane capacity (its split is the
/// initial one), the plane widths, the arena, and the indexer cache's shape.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub geometry: UnifiedPoolGeometry,
    /// Row bytes of each plane: `[512, 128]` (fp8) or `[1024]` (bf16).
    pub plane_widths: Vec<u64>,
    pub arena: ArenaLayout,
    /// Indexer bytes per block per CSA layer (8,448 FP8; 4,352 FP4); 0 = no indexer cache.
    pub indexer_block_bytes: u64,
    /// Global ids of the CSA layers (the indexer cache's layer order).
    pub csa_layers: Vec<usize>,
}

impl PoolSpec {
    /// The spec of a sized plan: its carve, its arena, its indexer shape.
    pub fn from_plan(plan: &crate::sizing::Plan) -> Result<PoolSpec, PoolError> {
        Ok(PoolSpec {
            geometry: plan.geometry.clone(),
            plane_widths: plan.layout.widths().to_vec(),
            arena: plan.layout.arena.clone(),
            indexer_block_bytes: plan.layout.indexer.layer_block_bytes(),
            csa_layers: plan.layout.model.csa_layers(),
        })
    }
}

#[derive(Debug, Error)]
pub enum PoolError {
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error(transparent)]
    Arena(#[from] ArenaError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error(transparent)]
    Boundary(#[from] BoundaryError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("plane {plane} outside 0..{planes}")]
    NoSuchPlane { plane: usize, planes: usize },
    #[error("arena rows {arena} differ from the geometry's {geometry}")]
    ArenaMismatch { arena: i64, geometry: i64 },
    #[error("the geometry's slot_origin is {0}; a pool numbers its own positions (origin 0)")]
    SlotOrigin(i64),
    #[error("bytes {offset}..{offset}+{len} outside plane {plane} of {plane_bytes} bytes")]
    PlaneRange { plane: usize, offset: u64, len: u64, plane_bytes: u64 },
    #[error("buffer of {got} bytes, expected {expected}")]
    BufferSize { got: usize, expected: u64 },
    #[error("arithmetic overflow computing {0}")]
    Overflow(&'static str),
    #[error("the pool's lock was poisoned by a panic in another thread")]
    Poisoned,
}

/// One layer's view of one plane: from the layer's base row to the plane's end. Index
/// buffer entries are rows of this view; row `x` is at `ptr + x * row_bytes` (64-bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerView {
    pub layer: usize,
    pub plane: usize,
    pub ptr: DevicePtr,
    pub rows: i64,
    pub row_bytes: u64,
}

/// A slot handed out: the allocator's handle and where it sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLease {
    pub handle: SlotHandle,
    pub position: i64,
}

/// The pool's own memory besides the planes, reported so it can be held under 1 %.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overhead {
    pub plane_bytes: u64,
    pub indexer_bytes: u64,
    /// Device descriptor buffers (copy and fill runs).
    pub descriptor_bytes: u64,
    /// Host bookkeeping: allocator state.
    pub host_bytes: u64,
}

impl Overhead {
    /// Overhead (descriptors + host bookkeeping + `extra`, e.g. index buffers) over planes.
    pub fn fraction(&self, extra: u64) -> f64 {
        (self.descriptor_bytes + self.host_bytes + extra) as f64 / self.plane_bytes.max(1) as f64
    }
}

struct State {
    boundary: Boundary,
}

/// The KV pool on one backend. See the module docs.
pub struct Pool {
    backend: Arc<dyn Backend>,
    stream: Stream,
    spec: PoolSpec,
    planes: Option<DeviceAllocation>,
    plane_offsets: Vec<u64>,
    indexer: Option<DeviceAllocation>,
    /// Blocks the indexer cache is sized for (the most the plane can hold).
    indexer_blocks: u64,
    descriptors: Option<DeviceAllocation>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("backend", &self.backend.kind())
            .field("plane_rows", &self.spec.geometry.plane_rows)
            .field("plane_widths", &self.spec.plane_widths)
            .finish()
    }
}

fn checked(v: Option<u64>, what: &'static str) -> Result<u64, PoolError> {
    v.ok_or(PoolError::Overflow(what))
}

impl Pool {
    /// Carve the planes for `spec` on `backend`; all pool work goes on `stream`.
    pub fn new(backend: Arc<dyn Backend>, spec: PoolSpec, stream: Stream) -> Result<Pool, PoolError> {
        let g = &spec.geometry;
        if spec.arena.arena_rows() != g.arena_rows {
            return Err(PoolError::ArenaMismatch { arena: spec.arena.arena_rows(), geometry: g.arena_rows });
        }
        if g.slot_origin != 0 {
            return Err(PoolError::SlotOrigin(g.slot_origin));
        }
        let boundary = Boundary::new(g)?;
        // Planes back to back, each start on a 256-byte boundary.
        let mut plane_offsets = Vec::with_capacity(spec.plane_widths.len());
        let mut cursor = 0u64;
        for &w in &spec.plane_widths {
            plane_offsets.push(cursor);
            let bytes = checked((g.plane_rows as u64).checked_mul(w), "plane bytes")?;
            cursor = checked(cursor.checked_add(bytes), "planes")?.div_ceil(PLANE_ALIGN) * PLANE_ALIGN;
        }
        let indexer_blocks = boundary.max_blocks_beside(0) as u64;
        let indexer_bytes = checked(
            (spec.csa_layers.len() as u64)
                .checked_mul(indexer_blocks)
                .and_then(|x| x.checked_mul(spec.indexer_block_bytes)),
            "indexer bytes",
        )?;
        let planes = backend.alloc_zeroed(cursor.max(PLANE_ALIGN))?;
        let indexer = if indexer_bytes > 0 { Some(backend.alloc_zeroed(indexer_bytes)?) } else { None };
        let desc_bytes = (DESCRIPTOR_RUNS * std::mem::size_of::<CopyRun>()) as u64;
        let descriptors = Some(backend.alloc_zeroed(desc_bytes)?);
        let pool = Pool {
            backend,
            stream,
            spec,
            planes: Some(planes),
            plane_offsets,
            indexer,
            indexer_blocks,
            descriptors,
            state: Mutex::new(State { boundary }),
        };
        // Initialise every live position's state (the allocation is already zero).
        let live = pool.lock()?.boundary.live_positions();
        pool.init_positions(live)?;
        Ok(pool)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, PoolError> {
        self.state.lock().map_err(|_| PoolError::Poisoned)
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    pub fn stream(&self) -> Stream {
        self.stream
    }
    pub fn spec(&self) -> &PoolSpec {
        &self.spec
    }
    /// The layout at the current split (plane capacity and every address are fixed).
    pub fn geometry(&self) -> Result<UnifiedPoolGeometry, PoolError> {
        Ok(self.lock()?.boundary.geometry().clone())
    }
    pub fn num_planes(&self) -> usize {
        self.spec.plane_widths.len()
    }

    /// Base address of plane `plane`.
    pub fn plane_ptr(&self, plane: usize) -> Result<DevicePtr, PoolError> {
        let off = self
            .plane_offsets
            .get(plane)
            .ok_or(PoolError::NoSuchPlane { plane, planes: self.plane_offsets.len() })?;
        Ok(self.planes.as_ref().map_or(0, |a| a.ptr) + off)
    }

    /// Bytes of plane `plane`.
    pub fn plane_bytes(&self, plane: usize) -> Result<u64, PoolError> {
        let w = self
            .spec
            .plane_widths
            .get(plane)
            .ok_or(PoolError::NoSuchPlane { plane, planes: self.spec.plane_widths.len() })?;
        Ok(self.spec.geometry.plane_bytes(*w))
    }

    /// Base address of the indexer cache (`[n_csa][indexer_blocks][block bytes]`), if any.
    pub fn indexer_ptr(&self) -> Option<DevicePtr> {
        self.indexer.as_ref().map(|a| a.ptr)
    }
    pub fn indexer_blocks(&self) -> u64 {
        self.indexer_blocks
    }

    /// The per-layer view of `layer` in `plane`. Absent layers have none (an error).
    pub fn layer_view(&self, layer: usize, plane: usize) -> Result<LayerView, PoolError> {
        let g = &self.spec.geometry;
        let base = g.layer_base_row(layer)?;
        let w = self.spec.plane_widths[plane.min(self.spec.plane_widths.len().saturating_sub(1))];
        let ptr = self.plane_ptr(plane)? + base as u64 * w;
        Ok(LayerView { layer, plane, ptr, rows: g.layer_view_rows(layer)?, row_bytes: w })
    }

    /// Every non-absent layer's view in every plane, in layer order.
    pub fn layer_views(&self) -> Result<Vec<Vec<LayerView>>, PoolError> {
        let g = &self.spec.geometry;
        (0..g.num_layers)
            .filter(|&l| g.ratios[l] != crate::geometry::ABSENT_RATIO)
            .map(|l| (0..self.num_planes()).map(|p| self.layer_view(l, p)).collect())
            .collect()
    }

    /// A typed view of one arena field across all positions, with its device address.
    pub fn state_view(&self, field: &str) -> Result<(DevicePtr, FieldView), PoolError> {
        let g = &self.spec.geometry;
        let idx = self.spec.arena.field_index(field)?;
        let view = self.spec.arena.field_view(idx, g.slot_rows, g.slot_positions)?;
        Ok((self.plane_ptr(view.plane)? + view.offset, view))
    }

    // ---- allocation ---------------------------------------------------------------------

    /// Hand out a slot and initialise its compressor state (queued on the pool's stream).
    pub fn alloc_slot(&self) -> Result<SlotLease, PoolError> {
        let mut st = self.lock()?;
        let handle = st.boundary.alloc_slot()?;
        let position = st.boundary.position(handle)?;
        drop(st);
        self.init_positions(position..position + 1)?;
        Ok(SlotLease { handle, position })
    }

    pub fn free_slot(&self, handle: SlotHandle) -> Result<(), PoolError> {
        Ok(self.lock()?.boundary.free_slot(handle)?)
    }

    /// Position of a held slot (the only group → position crossing is in the geometry).
    pub fn slot_position(&self, handle: SlotHandle) -> Result<i64, PoolError> {
        Ok(self.lock()?.boundary.position(handle)?)
    }

    pub fn alloc_block(&self) -> Result<BlockGrant, PoolError> {
        Ok(self.lock()?.boundary.alloc_block()?)
    }

    pub fn free_block(&self, handle: BlockHandle) -> Result<(), PoolError> {
        Ok(self.lock()?.boundary.free_block(handle)?)
    }

    /// Check a block handle is current (not freed, not relocated away, from this pool).
    pub fn check_block(&self, handle: BlockHandle) -> Result<(), PoolError> {
        Ok(self.lock()?.boundary.check_block(handle)?)
    }

    /// (num_blocks, num_slots, free blocks, free slots, max blocks beside the slots).
    pub fn counts(&self) -> Result<PoolCounts, PoolError> {
        let st = self.lock()?;
        let b = &st.boundary;
        Ok(PoolCounts {
            num_blocks: b.num_blocks(),
            num_slots: b.num_slots(),
            free_blocks: b.blocks().num_free(),
            free_slots: b.slots().num_free(),
            max_blocks: b.max_blocks(),
            slot_positions: self.spec.geometry.slot_positions,
        })
    }

    /// Run a closure on the boundary (read-only), e.g. for reporting.
    pub fn with_boundary<R>(&self, f: impl FnOnce(&Boundary) -> R) -> Result<R, PoolError> {
        Ok(f(&self.lock()?.boundary))
    }

    // ---- the elastic boundary -----------------------------------------------------------

    /// Move the boundary by `op` and carry out what it reports: copy relocated blocks (both
    /// planes and every indexer layer) and slots, then initialise newly live positions. The
    /// copies are queued on the pool's stream before anything else the caller queues.
    fn apply(
        &self,
        op: impl FnOnce(&mut Boundary) -> Result<BoundaryChange, BoundaryError>,
    ) -> Result<BoundaryChange, PoolError> {
        let mut st = self.lock()?;
        let change = op(&mut st.boundary)?;
        let runs = self.relocation_runs(&change)?;
        self.copy_runs(&runs)?;
        drop(st);
        self.init_positions(change.new_live_positions.clone())?;
        Ok(change)
    }

    pub fn grow_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_slots(n))
    }
    pub fn shrink_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.shrink_slots(n))
    }
    pub fn grow_blocks(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_blocks(n))
    }
    pub fn grow_blocks_shrinking_slots(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.grow_blocks_shrinking_slots(n))
    }
    pub fn shrink_blocks(&self, n: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.shrink_blocks(n))
    }
    pub fn resize(&self, num_blocks: u32, num_slots: u32) -> Result<BoundaryChange, PoolError> {
        self.apply(|b| b.resize(num_blocks, num_slots))
    }

    /// The copies a boundary change needs, as device byte ranges.
    fn relocation_runs(&self, change: &BoundaryChange) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        let mut runs = Vec::new();
        for m in &change.block_moves {
            let (from, to) = (u64::from(m.old.id), u64::from(m.new.id));
            for (p, &w) in self.spec.plane_widths.iter().enumerate() {
                let base = self.plane_ptr(p)?;
                let bytes = g.block_bytes(w);
                runs.push(CopyRun { src: base + from * bytes, dst: base + to * bytes, bytes });
            }
            if let Some(ix) = self.indexer_ptr() {
                let bb = self.spec.indexer_block_bytes;
                for c in 0..self.spec.csa_layers.len() as u64 {
                    let layer = ix + c * self.indexer_blocks * bb;
                    runs.push(CopyRun { src: layer + from * bb, dst: layer + to * bb, bytes: bb });
                }
            }
        }
        for m in &change.slot_moves {
            let (from, _) = g.slot_span(m.from_position)?;
            let (to, _) = g.slot_span(m.to_position)?;
            for (p, &w) in self.spec.plane_widths.iter().enumerate() {
                let base = self.plane_ptr(p)?;
                let bytes = g.slot_bytes(w);
                runs.push(CopyRun { src: base + from as u64 * w, dst: base + to as u64 * w, bytes });
            }
        }
        Ok(runs)
    }

    /// Queue `runs` (non-overlapping byte copies) as descriptor launches on the pool stream.
    pub fn copy_runs(&self, runs: &[CopyRun]) -> Result<(), PoolError> {
        let desc = self.descriptors.as_ref().map_or(0, |a| a.ptr);
        for chunk in runs.chunks(DESCRIPTOR_RUNS) {
            // SAFETY: the descriptor buffer holds DESCRIPTOR_RUNS runs and is live while the
            // pool is; every run was derived from this pool's own allocations, and the upload
            // is ordered before the launch on the same stream.
            unsafe {
                self.backend.upload(desc, bytemuck::cast_slice(chunk), self.stream)?;
                self.backend.launch(
                    &Launch::CopyRuns(CopyRunsArgs { runs: desc, num_runs: chunk.len() as i32, _pad: 0 }),
                    self.stream,
                )?;
            }
        }
        Ok(())
    }

    /// Initialise the compressor state of `positions` (zero kv, −inf scores, zero padding).
    pub fn init_positions(&self, positions: std::ops::Range<i64>) -> Result<(), PoolError> {
        let g = &self.spec.geometry;
        let mut runs = Vec::new();
        for pos in positions {
            for r in self.spec.arena.fill_runs(pos, g.slot_rows)? {
                runs.push(FillRun {
                    dst: self.plane_ptr(r.plane)? + r.offset,
                    bytes: r.bytes,
                    pattern: r.pattern,
                    _pad: 0,
                });
            }
        }
        let desc = self.descriptors.as_ref().map_or(0, |a| a.ptr);
        let per = DESCRIPTOR_RUNS * std::mem::size_of::<CopyRun>() / std::mem::size_of::<FillRun>();
        for chunk in runs.chunks(per) {
            // SAFETY: as in `copy_runs`; fill runs lie in the planes (checked by the arena
            // against the slot stride, positions come from the geometry).
            unsafe {
                self.backend.upload(desc, bytemuck::cast_slice(chunk), self.stream)?;
                self.backend.launch(
                    &Launch::FillRuns(FillRunsArgs { runs: desc, num_runs: chunk.len() as i32, _pad: 0 }),
                    self.stream,
                )?;
            }
        }
        Ok(())
    }

    // ---- checkpoints ----------------------------------------------------------------------

    /// Byte ranges, per plane, that a checkpoint image of one slot carries: the carried
    /// state fields plus the window rows some (layer, ring position) maps to (offsets from
    /// the slot's start in that plane).
    pub fn checkpoint_ranges(&self) -> Result<Vec<Vec<(u64, u64)>>, PoolError> {
        let g = &self.spec.geometry;
        let entry_runs = g.entry_row_runs();
        let mut out = Vec::new();
        for (p, &w) in self.spec.plane_widths.iter().enumerate() {
            let mut ranges: Vec<(i64, i64)> = self
                .spec
                .arena
                .plane_checkpoint_ranges(p)?
                .into_iter()
                .map(|(s, c)| (s as i64, c as i64))
                .collect();
            let w = w as i64;
            ranges.extend(entry_runs.iter().map(|&(s, c)| ((g.arena_rows + s) * w, c * w)));
            let merged = crate::geometry::merge_abutting(&ranges)?;
            out.push(merged.into_iter().map(|(s, c)| (s as u64, c as u64)).collect());
        }
        Ok(out)
    }

    /// Bytes of one slot's checkpoint image.
    pub fn checkpoint_image_bytes(&self) -> Result<u64, PoolError> {
        Ok(self.checkpoint_ranges()?.iter().flatten().map(|r| r.1).sum())
    }

    /// Copy runs between a slot's image ranges and a contiguous image at `image`.
    fn image_runs(&self, position: i64, image: DevicePtr, to_image: bool) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        let (start, _) = g.slot_span(position)?;
        let mut cursor = 0u64;
        let mut runs = Vec::new();
        for (p, ranges) in self.checkpoint_ranges()?.iter().enumerate() {
            let slot_base = self.plane_ptr(p)? + start as u64 * self.spec.plane_widths[p];
            for &(off, len) in ranges {
                let (a, b) = (slot_base + off, image + cursor);
                runs.push(if to_image {
                    CopyRun { src: a, dst: b, bytes: len }
                } else {
                    CopyRun { src: b, dst: a, bytes: len }
                });
                cursor += len;
            }
        }
        Ok(runs)
    }

    /// Copy the checkpoint image of a held slot to device memory at `dst` (one launch).
    ///
    /// # Safety
    /// `dst .. dst + checkpoint_image_bytes()` must be live memory of this pool's backend
    /// that does not overlap the planes.
    pub unsafe fn checkpoint_to(&self, slot: SlotHandle, dst: DevicePtr) -> Result<(), PoolError> {
        let pos = self.slot_position(slot)?;
        self.copy_runs(&self.image_runs(pos, dst, true)?)
    }

    /// Restore a held slot from an image at `src`; bytes outside the ranges are untouched.
    ///
    /// # Safety
    /// As [`Pool::checkpoint_to`], for `src`.
    pub unsafe fn restore_from(&self, slot: SlotHandle, src: DevicePtr) -> Result<(), PoolError> {
        let pos = self.slot_position(slot)?;
        self.copy_runs(&self.image_runs(pos, src, false)?)
    }

    /// Checkpoint into a host buffer of exactly `checkpoint_image_bytes()` bytes.
    pub fn checkpoint(&self, slot: SlotHandle, dst: &mut [u8]) -> Result<(), PoolError> {
        let bytes = self.checkpoint_image_bytes()?;
        if dst.len() as u64 != bytes {
            return Err(PoolError::BufferSize { got: dst.len(), expected: bytes });
        }
        let tmp = self.backend.alloc_zeroed(bytes.max(1))?;
        let result = (|| {
            // SAFETY: `tmp` is a fresh allocation of `bytes` bytes, disjoint from the planes;
            // the download waits for the copy queued before it on the same stream.
            unsafe {
                self.checkpoint_to(slot, tmp.ptr)?;
                self.backend.download(dst, tmp.ptr, self.stream)?;
            }
            Ok(())
        })();
        // SAFETY: the download above synchronised the stream, so no work uses `tmp`.
        unsafe { self.backend.free(tmp) };
        result
    }

    /// Restore a held slot from a host image of exactly `checkpoint_image_bytes()` bytes.
    pub fn restore(&self, slot: SlotHandle, src: &[u8]) -> Result<(), PoolError> {
        let bytes = self.checkpoint_image_bytes()?;
        if src.len() as u64 != bytes {
            return Err(PoolError::BufferSize { got: src.len(), expected: bytes });
        }
        let tmp = self.backend.alloc_zeroed(bytes.max(1))?;
        let result = (|| {
            // SAFETY: as in `checkpoint`; the synchronize makes the copy finish before free.
            unsafe {
                self.backend.upload(tmp.ptr, src, self.stream)?;
                self.restore_from(slot, tmp.ptr)?;
            }
            self.backend.synchronize(self.stream)?;
            Ok(())
        })();
        // SAFETY: synchronised above (or the work failed to queue).
        unsafe { self.backend.free(tmp) };
        result
    }

    // ---- raw byte access (tests, tools) ----------------------------------------------------

    fn plane_range(&self, plane: usize, offset: u64, len: u64) -> Result<DevicePtr, PoolError> {
        let plane_bytes = self.plane_bytes(plane)?;
        if offset.checked_add(len).is_none_or(|end| end > plane_bytes) {
            return Err(PoolError::PlaneRange { plane, offset, len, plane_bytes });
        }
        Ok(self.plane_ptr(plane)? + offset)
    }

    /// Read bytes of a plane (waits for the pool's stream).
    pub fn read_plane(&self, plane: usize, offset: u64, dst: &mut [u8]) -> Result<(), PoolError> {
        let ptr = self.plane_range(plane, offset, dst.len() as u64)?;
        // SAFETY: the range was checked to lie inside the plane.
        unsafe { self.backend.download(dst, ptr, self.stream)? };
        Ok(())
    }

    /// Write bytes into a plane (stream-ordered).
    pub fn write_plane(&self, plane: usize, offset: u64, src: &[u8]) -> Result<(), PoolError> {
        let ptr = self.plane_range(plane, offset, src.len() as u64)?;
        // SAFETY: the range was checked to lie inside the plane.
        unsafe { self.backend.upload(ptr, src, self.stream)? };
        Ok(())
    }

    /// The pool's own memory next to its planes.
    pub fn overhead(&self) -> Result<Overhead, PoolError> {
        let st = self.lock()?;
        let plane_bytes: u64 = (0..self.num_planes()).map(|p| self.plane_bytes(p).unwrap_or(0)).sum();
        let host = std::mem::size_of::<Boundary>() as u64
            + 32 * (u64::from(st.boundary.max_blocks_beside(0)) + self.spec.geometry.slot_positions as u64);
        Ok(Overhead {
            plane_bytes,
            indexer_bytes: self.indexer.as_ref().map_or(0, |a| a.bytes),
            descriptor_bytes: self.descriptors.as_ref().map_or(0, |a| a.bytes),
            host_bytes: host,
        })
    }

    /// Whether the geometry has a dense class (its decode buffer is always passed).
    pub fn has_dense(&self) -> bool {
        self.spec.geometry.class(DENSE_RATIO).is_some()
    }
}

/// Allocator counts at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolCounts {
    pub num_blocks: u32,
    pub num_slots: u32,
    pub free_blocks: u32,
    pub free_slots: u32,
    pub max_blocks: u32,
    pub slot_positions: i64,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Nothing may still use the memory: wait for the pool's stream first.
        let _ = self.backend.synchronize(self.stream);
        for a in [self.planes.take(), self.indexer.take(), self.descriptors.take()].into_iter().flatten() {
            // SAFETY: the stream is drained and the pool hands out no owning references;
            // views held past the pool's life are the caller's documented misuse.
            unsafe { self.backend.free(a) };
        }
    }
}
