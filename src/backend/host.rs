//! The host backend: "device" memory is host memory and every kernel is its host reference
//! ([`crate::index::host`]), run immediately on the calling thread; the stream is ignored.
//!
//! It is the reference the GPU backends are checked against, and what the CLI and the
//! simulator use without a GPU. Beyond the trait's contract it checks what it cheaply can:
//! copies and fills must lie inside one live allocation, launches go through
//! [`crate::index::shape::check_launch`] and the references' bounds checks, and freeing an
//! address it did not hand out does nothing. Those are errors here where a GPU would fault or
//! corrupt memory.
//!
//! # Why `Send + Sync`
//! The backend owns no raw pointer: live allocations are a map of integers (base → bytes)
//! behind a `Mutex`, so the auto traits hold and sharing it between threads is sound. The
//! memory those integers name is touched only inside the `unsafe` methods, whose callers
//! promise (see [`crate::backend`]) that the ranges are live and that work touching one range
//! is ordered — the same promise a device backend relies on for its streams. Work is
//! immediate, so nothing is in flight between calls.

use super::{Backend, BackendError, BackendKind, DeviceAllocation, Stream};
use crate::index::host::run_launch;
use crate::index::{DevicePtr, Launch};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Alignment of every allocation, as device allocators give at least this.
pub const HOST_ALLOC_ALIGN: usize = 256;

/// Host memory and host kernels behind the [`Backend`] trait.
#[derive(Debug, Default)]
pub struct HostBackend {
    /// Live allocations: base address → requested bytes.
    live: Mutex<BTreeMap<u64, u64>>,
    /// Caller memory accepted by `adopt_external` (base → bytes): checked like `live`, never
    /// freed here.
    adopted: Mutex<BTreeMap<u64, u64>>,
}

/// Layout of an allocation of `bytes` (zero-byte requests take one byte: a real, unique
/// address that `free` can return).
fn layout(bytes: u64) -> Option<Layout> {
    let size = usize::try_from(bytes.max(1)).ok()?;
    Layout::from_size_align(size, HOST_ALLOC_ALIGN).ok()
}

impl HostBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.live().len()
    }

    /// Bytes held by live allocations.
    pub fn allocated_bytes(&self) -> u64 {
        self.live().values().sum()
    }

    fn live(&self) -> MutexGuard<'_, BTreeMap<u64, u64>> {
        // A poisoned lock only means another thread panicked while holding it; the map itself
        // is always consistent (single insert/remove calls).
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `addr .. addr + len` inside one live allocation, or the error the call reports.
    fn check_range(&self, call: &'static str, addr: DevicePtr, len: u64) -> Result<(), BackendError> {
        let within = |map: &BTreeMap<u64, u64>| {
            map.range(..=addr)
                .next_back()
                .is_some_and(|(&base, &bytes)| addr.checked_add(len).is_some_and(|end| end <= base + bytes))
        };
        let adopted = self.adopted.lock().unwrap_or_else(|e| e.into_inner());
        let inside = within(&self.live()) || within(&adopted);
        if inside || len == 0 {
            return Ok(());
        }
        Err(BackendError::Driver {
            backend: BackendKind::Host,
            call,
            message: format!("range {addr:#x}+{len} is not inside one live allocation"),
        })
    }
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn device_name(&self) -> String {
        "host".to_string()
    }

    fn alloc_zeroed(&self, bytes: u64) -> Result<DeviceAllocation, BackendError> {
        let oom = |message: &str| BackendError::OutOfMemory {
            backend: BackendKind::Host,
            bytes,
            message: message.to_string(),
        };
        let layout = layout(bytes).ok_or_else(|| oom("size does not fit this host's address space"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom("the host allocator refused"));
        }
        let addr = ptr as usize as u64;
        self.live().insert(addr, bytes);
        Ok(DeviceAllocation { ptr: addr, bytes })
    }

    unsafe fn free(&self, alloc: DeviceAllocation) {
        let known = self.live().remove(&alloc.ptr);
        // An address this backend did not hand out (or already freed) is left alone.
        if let (Some(bytes), Some(layout)) = (known, layout(alloc.bytes)) {
            if bytes == alloc.bytes {
                // SAFETY: `ptr` came from `alloc_zeroed` with this layout (same byte count) and
                // was live until the removal above; the caller promises no further use.
                unsafe { dealloc(alloc.ptr as usize as *mut u8, layout) };
            } else {
                // Wrong size: put it back rather than free with a layout it was not made with.
                self.live().insert(alloc.ptr, bytes);
            }
        }
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], _stream: Stream) -> Result<(), BackendError> {
        self.check_range("upload", dst, src.len() as u64)?;
        if !src.is_empty() {
            // SAFETY: `dst` range is inside a live allocation (checked) which cannot overlap the
            // borrowed host slice `src`.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as usize as *mut u8, src.len()) };
        }
        Ok(())
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, _stream: Stream) -> Result<(), BackendError> {
        self.check_range("download", src, dst.len() as u64)?;
        if !dst.is_empty() {
            // SAFETY: `src` range is inside a live allocation (checked), disjoint from `dst`.
            unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len()) };
        }
        Ok(())
    }

    unsafe fn copy(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        _stream: Stream,
    ) -> Result<(), BackendError> {
        self.check_range("copy", dst, bytes)?;
        self.check_range("copy", src, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        if src < dst + bytes && dst < src + bytes {
            return Err(BackendError::Driver {
                backend: BackendKind::Host,
                call: "copy",
                message: format!("ranges {src:#x} and {dst:#x} of {bytes} bytes overlap"),
            });
        }
        // SAFETY: both ranges are inside live allocations (checked) and disjoint (checked);
        // `bytes` fits usize because an allocation of at least that size exists.
        unsafe {
            std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, bytes as usize)
        };
        Ok(())
    }

    unsafe fn fill_u32(
        &self,
        dst: DevicePtr,
        count: u64,
        value: u32,
        _stream: Stream,
    ) -> Result<(), BackendError> {
        let bytes = count.checked_mul(4).ok_or_else(|| BackendError::Driver {
            backend: BackendKind::Host,
            call: "fill_u32",
            message: format!("{count} words overflow a byte count"),
        })?;
        self.check_range("fill_u32", dst, bytes)?;
        if count == 0 {
            return Ok(());
        }
        if dst % 4 != 0 {
            return Err(BackendError::Driver {
                backend: BackendKind::Host,
                call: "fill_u32",
                message: format!("address {dst:#x} is not 4-byte aligned"),
            });
        }
        // SAFETY: aligned, inside a live allocation (checked); the caller orders all use of it.
        let words = unsafe { std::slice::from_raw_parts_mut(dst as usize as *mut u32, count as usize) };
        words.fill(value);
        Ok(())
    }

    unsafe fn launch(&self, launch: &Launch, _stream: Stream) -> Result<(), BackendError> {
        // SAFETY: the caller's promise (every pointer covers what the kernel touches) is the
        // one `run_launch` needs.
        unsafe { run_launch(launch) }
            .map_err(|e| BackendError::InvalidLaunch { kernel: launch.symbol(), reason: e.to_string() })
    }

    fn synchronize(&self, _stream: Stream) -> Result<(), BackendError> {
        Ok(())
    }

    unsafe fn adopt_external(&self, ptr: DevicePtr, bytes: u64) {
        self.adopted.lock().unwrap_or_else(|e| e.into_inner()).insert(ptr, bytes);
    }

    fn forget_external(&self, ptr: DevicePtr) {
        self.adopted.lock().unwrap_or_else(|e| e.into_inner()).remove(&ptr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_zeroed_and_tracked() {
        let b = HostBackend::new();
        let a = b.alloc_zeroed(1000).unwrap();
        let z = b.alloc_zeroed(0).unwrap();
        assert_eq!(a.ptr % 256, 0);
        assert_eq!(b.live_allocations(), 2);
        let mut back = vec![0xffu8; 1000];
        // SAFETY: inside `a`.
        unsafe { b.download(&mut back, a.ptr, Stream::DEFAULT).unwrap() };
        assert!(back.iter().all(|&x| x == 0));
        // SAFETY: both are live and unused after.
        unsafe {
            b.free(a);
            b.free(z);
        }
        assert_eq!(b.live_allocations(), 0);
    }

    #[test]
    fn copies_stay_inside_allocations() {
        let b = HostBackend::new();
        let a = b.alloc_zeroed(64).unwrap();
        let c = b.alloc_zeroed(64).unwrap();
        let data: Vec<u8> = (1..=64).collect();
        // SAFETY: all ranges lie in `a` / `c` unless the call is expected to fail.
        unsafe {
            b.upload(a.ptr, &data, Stream::DEFAULT).unwrap();
            b.copy(c.ptr + 8, a.ptr + 16, 32, Stream::DEFAULT).unwrap();
            b.fill_u32(c.ptr + 48, 4, 0xdead_beef, Stream::DEFAULT).unwrap();
            let mut out = vec![0u8; 64];
            b.download(&mut out, c.ptr, Stream::DEFAULT).unwrap();
            let mut want = vec![0u8; 64];
            want[8..40].copy_from_slice(&data[16..48]);
            for w in want[48..64].chunks_exact_mut(4) {
                w.copy_from_slice(&0xdead_beefu32.to_ne_bytes());
            }
            assert_eq!(out, want);
            assert!(b.upload(a.ptr + 1, &data, Stream::DEFAULT).is_err());
            assert!(b.copy(a.ptr, a.ptr + 8, 16, Stream::DEFAULT).is_err());
            assert!(b.fill_u32(c.ptr + 2, 1, 0, Stream::DEFAULT).is_err());
            b.free(a);
            b.free(c);
        }
    }

    #[test]
    fn bad_launches_are_errors() {
        let b = HostBackend::new();
        let l = Launch::RingWrite(Default::default());
        // SAFETY: rejected before any memory is touched.
        let err = unsafe { b.launch(&l, Stream::DEFAULT) }.unwrap_err();
        assert!(matches!(err, BackendError::InvalidLaunch { kernel: "v4pool_ring_write", .. }));
        // SAFETY: the empty kernel touches nothing.
        unsafe { b.launch(&Launch::Empty, Stream::DEFAULT).unwrap() };
    }
}
