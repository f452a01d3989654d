//! The pool's checkpoint images and its checked byte access: every look-up of a held
//! slot's or block's position and the copy or write that uses it happen under the pool's
//! state lock, so a boundary move on another thread cannot come between them.

use super::{checked, Pool, PoolError, PoolSpec, State};
use crate::alloc::{BlockHandle, SlotHandle};
use crate::checkpoint::{CheckpointImage, LayoutId};
use crate::index::{CopyRun, DevicePtr};

impl Pool {
    // ---- checkpoints ----------------------------------------------------------------------

    /// Byte ranges, per plane, that a checkpoint image of one slot carries: the carried
    /// state fields plus the window rows some (layer, ring position) maps to (offsets from
    /// the slot's start in that plane). Fixed for the pool's life: computed once in `new`.
    pub fn checkpoint_ranges(&self) -> Result<Vec<Vec<(u64, u64)>>, PoolError> {
        Ok(self.image_ranges.clone())
    }

    pub(super) fn plan_image_ranges(spec: &PoolSpec) -> Result<Vec<Vec<(u64, u64)>>, PoolError> {
        let g = &spec.geometry;
        let entry_runs = g.entry_row_runs();
        (0..spec.plane_widths.len())
            .map(|p| {
                let state = spec.arena.plane_checkpoint_ranges(p)?;
                let paged = spec
                    .plane_format(p)
                    .ok_or(PoolError::NoSuchPlane { plane: p, planes: spec.plane_widths.len() })?;
                Ok(crate::checkpoint::plane_ranges_in(
                    &state,
                    g.arena_rows,
                    &entry_runs,
                    spec.plane_widths[p],
                    paged,
                )?)
            })
            .collect()
    }

    /// Bytes of one slot's checkpoint image.
    pub fn checkpoint_image_bytes(&self) -> Result<u64, PoolError> {
        Ok(self.image_ranges.iter().flatten().map(|r| r.1).sum())
    }

    /// Copy runs between the image ranges of the slot at `position` and a contiguous image
    /// at `image` (`to_image`: slot → image, a checkpoint; else image → slot, a restore).
    pub fn checkpoint_copy_runs(
        &self,
        position: i64,
        image: DevicePtr,
        to_image: bool,
    ) -> Result<Vec<CopyRun>, PoolError> {
        let g = &self.spec.geometry;
        let (start, _) = g.slot_span(position)?;
        let mut cursor = 0u64;
        let mut runs = Vec::new();
        for (p, ranges) in self.image_ranges.iter().enumerate() {
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

    /// Queue the copies between a held slot's image ranges and an image at `image`, under
    /// the lock that relocates slots, so the slot cannot move between the look-up and the
    /// copy (the copy is queued before any later relocation on the pool's stream).
    ///
    /// # Safety
    /// As [`Pool::checkpoint_to`], for `image`.
    unsafe fn copy_image(&self, slot: SlotHandle, image: DevicePtr, to_image: bool) -> Result<(), PoolError> {
        let st = self.lock()?;
        let pos = st.boundary.position(slot)?;
        let runs = self.checkpoint_copy_runs(pos, image, to_image)?;
        // SAFETY: the slot side lies in the planes (checked by the geometry); the image side
        // is the caller's contract.
        unsafe { self.queue_copies(&runs) }
    }

    /// Copy the checkpoint image of a held slot to device memory at `dst` (one launch). The
    /// image is tagged with nothing: keep [`Pool::layout_id`] with it.
    ///
    /// # Safety
    /// `dst .. dst + checkpoint_image_bytes()` must be live memory of this pool's backend
    /// that does not overlap the planes and stays live until the pool's stream has run the
    /// copy.
    pub unsafe fn checkpoint_to(&self, slot: SlotHandle, dst: DevicePtr) -> Result<(), PoolError> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_image(slot, dst, true) }
    }

    /// Restore a held slot from an image at `src` taken in layout `layout` (refused, before a
    /// byte moves, unless it is [`Pool::layout_id`]); bytes outside the ranges are untouched.
    ///
    /// # Safety
    /// `src .. src + checkpoint_image_bytes()` must be live memory of this pool's backend
    /// that does not overlap the planes and stays unchanged until the pool's stream has run
    /// the copy.
    pub unsafe fn restore_from(
        &self,
        slot: SlotHandle,
        src: DevicePtr,
        layout: &LayoutId,
    ) -> Result<(), PoolError> {
        self.layout_id.check_image(layout)?;
        // SAFETY: the caller's contract.
        unsafe { self.copy_image(slot, src, false) }
    }

    /// Checkpoint a held slot into a host image tagged with the pool's layout id.
    pub fn checkpoint(&self, slot: SlotHandle) -> Result<CheckpointImage, PoolError> {
        let _range = crate::profiling::range("v4pool.checkpoint");
        let bytes = self.checkpoint_image_bytes()?;
        let len = usize::try_from(bytes).map_err(|_| PoolError::Overflow("image bytes"))?;
        let mut dst = vec![0u8; len];
        let tmp = self.backend.alloc_zeroed(bytes.max(1))?;
        let result = (|| {
            // SAFETY: `tmp` is a fresh allocation of `bytes` bytes, disjoint from the planes;
            // the download waits for the copy queued before it on the same stream.
            unsafe {
                self.copy_image(slot, tmp.ptr, true)?;
                self.backend.download(&mut dst, tmp.ptr, self.stream)?;
            }
            Ok(())
        })();
        // SAFETY: the download above synchronised the stream, so no work uses `tmp`.
        unsafe { self.backend.free(tmp) };
        result.map(|()| CheckpointImage::new(self.layout_id.clone(), dst))
    }

    /// Restore a held slot from a host image: refused unless the image was taken in this
    /// pool's layout ([`Pool::layout_id`]) and has exactly `checkpoint_image_bytes()` bytes.
    pub fn restore(&self, slot: SlotHandle, image: &CheckpointImage) -> Result<(), PoolError> {
        let _range = crate::profiling::range("v4pool.restore");
        self.layout_id.check_image(image.layout_id())?;
        let src = image.bytes();
        let bytes = self.checkpoint_image_bytes()?;
        if src.len() as u64 != bytes {
            return Err(PoolError::BufferSize { got: src.len(), expected: bytes });
        }
        let tmp = self.backend.alloc_zeroed(bytes.max(1))?;
        let result = (|| {
            // SAFETY: `tmp` is a fresh allocation of `bytes` bytes, disjoint from the planes;
            // upload and copy are ordered on the pool's stream, and the synchronize makes the
            // copy finish before `tmp` is freed.
            unsafe {
                self.backend.upload(tmp.ptr, src, self.stream)?;
                self.copy_image(slot, tmp.ptr, false)?;
            }
            self.backend.synchronize(self.stream)?;
            Ok(())
        })();
        // SAFETY: synchronised above (or the work failed to queue).
        unsafe { self.backend.free(tmp) };
        result
    }

    // ---- byte access (tests, tools) --------------------------------------------------------

    pub(super) fn plane_range(&self, plane: usize, offset: u64, len: u64) -> Result<DevicePtr, PoolError> {
        let plane_bytes = self.plane_bytes(plane)?;
        if offset.checked_add(len).is_none_or(|end| end > plane_bytes) {
            return Err(PoolError::PlaneRange { plane, offset, len, plane_bytes });
        }
        Ok(self.plane_ptr(plane)? + offset)
    }

    /// Read bytes of a plane (waits for the pool's stream). Ordered after every boundary
    /// move queued before it.
    pub fn read_plane(&self, plane: usize, offset: u64, dst: &mut [u8]) -> Result<(), PoolError> {
        let ptr = self.plane_range(plane, offset, dst.len() as u64)?;
        let _st = self.lock()?;
        // SAFETY: the range was checked to lie inside the plane.
        unsafe { self.backend.download(dst, ptr, self.stream)? };
        Ok(())
    }

    /// Write bytes into a plane (stream-ordered), under the lock that moves the boundary.
    /// By offset, so it writes whatever holds those rows now: to write a held slot or block
    /// whatever the boundary does, use [`Pool::write_slot`] / [`Pool::write_block`].
    pub fn write_plane(&self, plane: usize, offset: u64, src: &[u8]) -> Result<(), PoolError> {
        let ptr = self.plane_range(plane, offset, src.len() as u64)?;
        let _st = self.lock()?;
        // SAFETY: the range was checked to lie inside the plane.
        unsafe { self.backend.upload(ptr, src, self.stream)? };
        Ok(())
    }

    /// The plane address of `offset .. offset + len` inside a held slot's bytes in `plane`
    /// (state and windows, `slot_bytes(width)`), with the lock held.
    fn slot_range(
        &self,
        st: &State,
        slot: SlotHandle,
        plane: usize,
        offset: u64,
        len: u64,
    ) -> Result<DevicePtr, PoolError> {
        let g = &self.spec.geometry;
        let w = self.plane_width(plane)?;
        let (start, _) = g.slot_span(st.boundary.position(slot)?)?;
        let limit = g.slot_bytes(w);
        if offset.checked_add(len).is_none_or(|end| end > limit) {
            return Err(PoolError::OutOfRange { what: "the slot", offset, len, limit });
        }
        self.plane_range(plane, start as u64 * w + offset, len)
    }

    /// The plane address of `offset .. offset + len` inside a held block's envelope in
    /// `plane`, with the lock held.
    fn block_range(
        &self,
        st: &State,
        block: BlockHandle,
        plane: usize,
        offset: u64,
        len: u64,
    ) -> Result<DevicePtr, PoolError> {
        st.boundary.check_block(block)?;
        let w = self.plane_width(plane)?;
        let limit = self.spec.geometry.block_bytes(w);
        if offset.checked_add(len).is_none_or(|end| end > limit) {
            return Err(PoolError::OutOfRange { what: "the block", offset, len, limit });
        }
        let base = checked(u64::from(block.id).checked_mul(limit), "block offset")?;
        self.plane_range(plane, base + offset, len)
    }

    fn plane_width(&self, plane: usize) -> Result<u64, PoolError> {
        self.spec
            .plane_widths
            .get(plane)
            .copied()
            .ok_or(PoolError::NoSuchPlane { plane, planes: self.spec.plane_widths.len() })
    }

    /// Write `src` at `offset` of a held slot's bytes in `plane`: the position is looked up
    /// and written under the lock that relocates slots, so the bytes land in the slot even
    /// while another thread moves the boundary.
    pub fn write_slot(
        &self,
        slot: SlotHandle,
        plane: usize,
        offset: u64,
        src: &[u8],
    ) -> Result<(), PoolError> {
        let st = self.lock()?;
        let ptr = self.slot_range(&st, slot, plane, offset, src.len() as u64)?;
        // SAFETY: the range was checked to lie inside the slot, inside the plane.
        unsafe { self.backend.upload(ptr, src, self.stream)? };
        Ok(())
    }

    /// Read `dst.len()` bytes at `offset` of a held slot's bytes in `plane` (waits for the
    /// pool's stream).
    pub fn read_slot(
        &self,
        slot: SlotHandle,
        plane: usize,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), PoolError> {
        let st = self.lock()?;
        let ptr = self.slot_range(&st, slot, plane, offset, dst.len() as u64)?;
        // SAFETY: the range was checked to lie inside the slot, inside the plane.
        unsafe { self.backend.download(dst, ptr, self.stream)? };
        Ok(())
    }

    /// Write `src` at `offset` of a held block's envelope in `plane` (a current handle:
    /// not freed, not relocated away), under the lock that relocates blocks.
    pub fn write_block(
        &self,
        block: BlockHandle,
        plane: usize,
        offset: u64,
        src: &[u8],
    ) -> Result<(), PoolError> {
        let st = self.lock()?;
        let ptr = self.block_range(&st, block, plane, offset, src.len() as u64)?;
        // SAFETY: the range was checked to lie inside the block, inside the plane.
        unsafe { self.backend.upload(ptr, src, self.stream)? };
        Ok(())
    }

    /// Read `dst.len()` bytes at `offset` of a held block's envelope in `plane` (waits for
    /// the pool's stream).
    pub fn read_block(
        &self,
        block: BlockHandle,
        plane: usize,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), PoolError> {
        let st = self.lock()?;
        let ptr = self.block_range(&st, block, plane, offset, dst.len() as u64)?;
        // SAFETY: the range was checked to lie inside the block, inside the plane.
        unsafe { self.backend.download(dst, ptr, self.stream)? };
        Ok(())
    }
}
