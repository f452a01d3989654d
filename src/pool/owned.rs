//! One device allocation owned by an index-path handle, with the backend and stream it
//! was made on: every byte a handle's safe calls write goes through the bounds checks here,
//! and the memory goes back to the backend on drop.

use crate::backend::{Backend, BackendError, BackendResult, DeviceAllocation, Stream};
use crate::index::{DevicePtr, Launch};
use std::sync::Arc;

/// A buffer an index-path handle owns on its device: address and length in elements.
///
/// A plain value for attention kernels and graph capture; the handle that gave it out
/// keeps the memory alive, and reading it back goes through the handle (by name), never
/// through this address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// Device address of element 0 (a host address on the host backend).
    pub ptr: DevicePtr,
    /// Length in elements.
    pub len: u64,
    /// Bytes per element (4: i32, 8: i64).
    pub elem_bytes: u64,
}

/// Byte layout of sub-buffers inside one allocation, with checked arithmetic: a capacity
/// too large for a `u64` byte count is an error, never a wrapped size.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Carve {
    cur: u64,
}

/// Sub-buffers start on 256-byte boundaries (coalesced access, and what backends align to).
const ALIGN: u64 = 256;

impl Carve {
    /// Take `count * elem` bytes; returns the offset of the first.
    pub(crate) fn take(&mut self, count: u64, elem: u64) -> Option<u64> {
        let at = self.cur;
        let end = at.checked_add(count.checked_mul(elem)?)?;
        self.cur = end.checked_next_multiple_of(ALIGN)?;
        Some(at)
    }
    /// Bytes taken so far (aligned).
    pub(crate) fn end(&self) -> u64 {
        self.cur
    }
}

/// The allocation, its backend and stream; freed on drop after the stream drains.
pub(crate) struct Owned {
    backend: Arc<dyn Backend>,
    stream: Stream,
    alloc: Option<DeviceAllocation>,
    bytes: u64,
}

impl Owned {
    pub(crate) fn new(backend: Arc<dyn Backend>, stream: Stream, bytes: u64) -> BackendResult<Owned> {
        let alloc = backend.alloc_zeroed(bytes.max(ALIGN))?;
        Ok(Owned { backend, stream, alloc: Some(alloc), bytes })
    }

    pub(crate) fn stream(&self) -> Stream {
        self.stream
    }
    pub(crate) fn base(&self) -> DevicePtr {
        self.alloc.as_ref().map_or(0, |a| a.ptr)
    }

    fn check(&self, call: &'static str, offset: u64, len: usize) -> BackendResult<DevicePtr> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.bytes => Ok(self.base() + offset),
            _ => Err(BackendError::InvalidLaunch {
                kernel: call,
                reason: format!("bytes {offset}+{len} outside the handle's {} bytes", self.bytes),
            }),
        }
    }

    /// Copy `src` to byte `offset` of the allocation (stream-ordered).
    pub(crate) fn upload(&self, offset: u64, src: &[u8]) -> BackendResult<()> {
        let dst = self.check("upload", offset, src.len())?;
        // SAFETY: `check` kept the range inside the allocation, which lives while `self` does.
        unsafe { self.backend.upload(dst, src, self.stream) }
    }

    /// Copy bytes from byte `offset` of the allocation (waits for the stream).
    pub(crate) fn download(&self, offset: u64, dst: &mut [u8]) -> BackendResult<()> {
        let src = self.check("download", offset, dst.len())?;
        // SAFETY: as in `upload`.
        unsafe { self.backend.download(dst, src, self.stream) }
    }

    /// Read `buf` (one of this allocation's i32 sub-buffers) back to the host.
    pub(crate) fn read_i32(&self, buf: DeviceBuffer) -> BackendResult<Vec<i32>> {
        let mut bytes = vec![0u8; 4 * buf.len as usize];
        self.download(buf.ptr.wrapping_sub(self.base()), &mut bytes)?;
        Ok(bytes.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Queue `launch` on the stream.
    ///
    /// # Safety
    /// Every pointer of `launch` covers what its kernel reads and writes.
    pub(crate) unsafe fn launch(&self, launch: &Launch) -> BackendResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.launch(launch, self.stream) }
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        // Nothing queued may still use the memory: drain the stream first. A graph captured
        // over the handle's buffers must be dropped before the handle (its replay is the
        // caller's `unsafe`).
        let _ = self.backend.synchronize(self.stream);
        if let Some(a) = self.alloc.take() {
            // SAFETY: the stream is drained and the allocation is this handle's alone.
            unsafe { self.backend.free(a) };
        }
    }
}

impl std::fmt::Debug for Owned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owned").field("backend", &self.backend.kind()).field("bytes", &self.bytes).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carve_refuses_overflow_and_aligns() {
        let mut c = Carve::default();
        assert_eq!(c.take(3, 4), Some(0));
        assert_eq!(c.take(1, 8), Some(256));
        assert_eq!(c.end(), 512);
        assert_eq!(c.take(u64::MAX / 2, 4), None);
        let mut c = Carve::default();
        assert_eq!(c.take(u64::MAX - 10, 1), None, "the alignment round-up overflows");
    }
}
