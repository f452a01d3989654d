//! A backend over memory the engine owns: allocations are carved from one caller-provided
//! region, so a pool built on it keeps its planes (and whatever else fits) in bytes the
//! engine's own allocator handed out — a torch tensor, a `cudaMalloc` the engine manages.
//!
//! Everything else (copies, fills, launches, synchronisation) goes to the inner backend of
//! the same device. Allocations that do not fit in what is left of the region fall through
//! to the inner backend, so short-lived scratch (a checkpoint's staging buffer) never fails
//! for want of region bytes; `Pool::required_bytes` (in `pool`, the layer above) says how
//! much a pool needs for all of its own allocations to come from the region.
//!
//! The region is a stack: an allocation takes the next 256-byte aligned bytes, and freeing
//! the top allocation (and any freed ones below it) returns their bytes.

use super::{
    Backend, BackendError, BackendKind, BackendResult, DeviceAllocation, HostAllocation, HostMem, Stream,
};
use crate::index::{DevicePtr, Launch};
use std::sync::{Arc, Mutex};

/// The alignment of every allocation carved from the region.
pub const ALIGN: u64 = 256;

/// Allocations of the region, in address order: (offset from the aligned start, bytes, live).
#[derive(Debug, Default)]
struct Carve {
    entries: Vec<(u64, u64, bool)>,
}

impl Carve {
    fn top(&self) -> u64 {
        self.entries.last().map_or(0, |&(o, b, _)| (o + b).div_ceil(ALIGN) * ALIGN)
    }
}

/// A backend whose allocations come from one external region first (see the module docs).
#[derive(Debug)]
pub struct ExternalRegion {
    inner: Arc<dyn Backend>,
    /// First 256-byte aligned address of the region and the bytes from there.
    base: DevicePtr,
    bytes: u64,
    carve: Mutex<Carve>,
}

impl ExternalRegion {
    /// Carve allocations from `ptr .. ptr + bytes` (its first 256-byte aligned address on).
    ///
    /// # Safety
    /// The region must be memory `inner`'s device can read and write with its copies and
    /// kernels (device memory of that device; host memory for the host backend), must stay
    /// allocated for as long as this backend or anything built on it (a pool, index buffers,
    /// views handed out) is in use, and must not be read or written by anyone else while the
    /// pool owns it, except through the views the pool hands out.
    pub unsafe fn new(inner: Arc<dyn Backend>, ptr: DevicePtr, bytes: u64) -> BackendResult<ExternalRegion> {
        let aligned = ptr.checked_add(ALIGN - 1).map(|p| p / ALIGN * ALIGN);
        let skip = aligned.map(|a| a - ptr);
        match (aligned, skip) {
            (Some(base), Some(skip)) if ptr != 0 && skip < bytes => {
                // SAFETY: the caller's promise above, for the aligned part of the region.
                unsafe { inner.adopt_external(base, bytes - skip) };
                Ok(ExternalRegion { inner, base, bytes: bytes - skip, carve: Mutex::new(Carve::default()) })
            }
            _ => Err(BackendError::InvalidLaunch {
                kernel: "external region",
                reason: format!("region {ptr:#x} + {bytes} bytes holds no 256-byte aligned byte"),
            }),
        }
    }

    /// Whether `ptr` lies in the region.
    fn owns(&self, ptr: DevicePtr) -> bool {
        ptr >= self.base && ptr - self.base < self.bytes
    }

    /// Bytes of the region in use (the top of the stack).
    pub fn used_bytes(&self) -> u64 {
        self.carve.lock().map_or(self.bytes, |c| c.top())
    }

    /// The region's aligned start and length.
    pub fn region(&self) -> (DevicePtr, u64) {
        (self.base, self.bytes)
    }
}

// SAFETY: carves allocations inside the engine's region (checked to fit) and forwards
// everything else to the wrapped backend, which keeps its own promises.
unsafe impl Backend for ExternalRegion {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn device_name(&self) -> String {
        self.inner.device_name()
    }

    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation> {
        let mut carve = self.carve.lock().map_err(|_| BackendError::InvalidLaunch {
            kernel: "external region",
            reason: "lock poisoned".into(),
        })?;
        let at = carve.top();
        if bytes == 0 || at.checked_add(bytes).is_none_or(|end| end > self.bytes) {
            drop(carve);
            return self.inner.alloc_zeroed(bytes);
        }
        let ptr = self.base + at;
        // The caller's bytes hold anything: zero them as an allocation promises. The fill is
        // stream-ordered on the backend's own stream; the synchronise makes the zeroes
        // visible to work on any stream, as a fresh allocation's are.
        // SAFETY: `ptr .. ptr + bytes` lies in the region (checked above), which the
        // constructor's caller guarantees is live device memory of `inner`.
        unsafe { self.inner.fill_u32(ptr, bytes.div_ceil(4), 0, Stream::DEFAULT)? };
        self.inner.synchronize(Stream::DEFAULT)?;
        carve.entries.push((at, bytes, true));
        Ok(DeviceAllocation { ptr, bytes })
    }

    unsafe fn free(&self, alloc: DeviceAllocation) {
        if !self.owns(alloc.ptr) {
            // SAFETY: not from the region, so from `inner`; forwarded from the caller.
            return unsafe { self.inner.free(alloc) };
        }
        let Ok(mut carve) = self.carve.lock() else { return };
        let off = alloc.ptr - self.base;
        if let Some(e) = carve.entries.iter_mut().find(|e| e.0 == off && e.2) {
            e.2 = false;
        }
        while carve.entries.last().is_some_and(|e| !e.2) {
            carve.entries.pop();
        }
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> BackendResult<()> {
        // SAFETY: forwarded; region addresses are the inner device's memory.
        unsafe { self.inner.upload(dst, src, stream) }
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> BackendResult<()> {
        // SAFETY: as `upload`.
        unsafe { self.inner.download(dst, src, stream) }
    }

    fn alloc_host(&self, bytes: u64) -> BackendResult<HostAllocation> {
        self.inner.alloc_host(bytes)
    }

    unsafe fn free_host(&self, alloc: HostAllocation) {
        // SAFETY: forwarded; `alloc_host` is the inner backend's.
        unsafe { self.inner.free_host(alloc) }
    }

    unsafe fn upload_host(&self, dst: DevicePtr, src: HostMem, stream: Stream) -> BackendResult<()> {
        // SAFETY: as `upload`.
        unsafe { self.inner.upload_host(dst, src, stream) }
    }

    unsafe fn download_host(&self, dst: HostMem, src: DevicePtr, stream: Stream) -> BackendResult<()> {
        // SAFETY: as `upload`.
        unsafe { self.inner.download_host(dst, src, stream) }
    }

    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: Stream) -> BackendResult<()> {
        // SAFETY: as `upload`.
        unsafe { self.inner.copy(dst, src, bytes, stream) }
    }

    unsafe fn fill_u32(&self, dst: DevicePtr, count: u64, value: u32, stream: Stream) -> BackendResult<()> {
        // SAFETY: as `upload`.
        unsafe { self.inner.fill_u32(dst, count, value, stream) }
    }

    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()> {
        // SAFETY: as `upload`.
        unsafe { self.inner.launch(launch, stream) }
    }

    fn synchronize(&self, stream: Stream) -> BackendResult<()> {
        self.inner.synchronize(stream)
    }

    unsafe fn adopt_external(&self, ptr: DevicePtr, bytes: u64) {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.adopt_external(ptr, bytes) }
    }

    fn forget_external(&self, ptr: DevicePtr) {
        self.inner.forget_external(ptr)
    }
}

impl Drop for ExternalRegion {
    fn drop(&mut self) {
        self.inner.forget_external(self.base);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;

    #[test]
    fn region_is_a_stack_with_fallthrough() {
        let mut mem = vec![0xA5u8; 4096 + 256];
        let inner: Arc<dyn Backend> = Arc::new(HostBackend::new());
        // SAFETY: `mem` outlives `ext` and nothing else touches it meanwhile.
        let ext = unsafe { ExternalRegion::new(inner, mem.as_mut_ptr() as u64 + 3, 4096).unwrap() };
        let (base, bytes) = ext.region();
        assert_eq!(base % 256, 0);
        assert!(bytes <= 4096 && bytes > 4096 - 256);
        let a = ext.alloc_zeroed(1000).unwrap();
        assert_eq!(a.ptr, base);
        let b = ext.alloc_zeroed(1000).unwrap();
        assert_eq!(b.ptr, base + 1024);
        // Zeroed although the region held 0xA5.
        let off = (b.ptr - mem.as_ptr() as u64) as usize;
        assert!(mem[off..off + 1000].iter().all(|&x| x == 0));
        // Too big for what is left: from the inner backend, outside the region.
        let c = ext.alloc_zeroed(4096).unwrap();
        assert!(!ext.owns(c.ptr));
        // SAFETY: no work uses these allocations.
        unsafe {
            ext.free(c);
            ext.free(a); // not the top: held until b goes
            assert_eq!(ext.used_bytes(), 2048);
            ext.free(b);
        }
        assert_eq!(ext.used_bytes(), 0);
        // A region with no aligned byte is refused.
        // SAFETY: never dereferenced (the constructor refuses it).
        assert!(unsafe { ExternalRegion::new(Arc::new(HostBackend::new()), 1, 10) }.is_err());
    }
}
