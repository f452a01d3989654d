//! The host backend: "device" memory is host memory and every kernel is its host reference
//! ([`crate::index::host`]), run immediately on the calling thread; the stream is ignored.
//!
//! It is the reference the GPU backends are checked against, and what the CLI and the
//! simulator use without a GPU. Beyond the trait's contract it checks everything it can, so
//! a wrong address is a typed [`BackendError`], never a write through it:
//!
//! * it tracks every allocation it made (and caller memory handed to it with
//!   [`Backend::adopt_external`]); uploads, downloads, copies and fills must lie inside
//!   one live allocation ([`BackendError::OutsideAllocation`]);
//! * launches run through [`run_launch_within`] with the live allocations as the only
//!   memory the kernel may touch: every buffer a kernel reads or writes (the descriptors of
//!   copy and fill runs and every run they name included) must lie inside one allocation,
//!   and a written buffer may not overlap another buffer of the launch;
//! * launches also pass [`crate::index::shape::check_launch`] and the references' own
//!   bounds checks; freeing an address it did not hand out does nothing.
//!
//! # Memory is committed lazily
//!
//! An allocation is `calloc`-style zeroed memory (`std::alloc::alloc_zeroed` at the system
//! allocator's natural alignment, which the system allocator serves from `calloc`; glibc
//! maps large blocks fresh from the kernel and skips the memset), aligned to
//! [`HOST_ALLOC_ALIGN`] inside a slightly larger block. The OS commits a page on first touch,
//! so a pool sized for a large budget costs resident memory only for what a run writes. The
//! contents are zero, as [`Backend::alloc_zeroed`] promises and the pool relies on (fresh
//! rows and a fresh state read as zero until initialised).
//!
//! # Why `Send + Sync`
//! The backend owns no raw pointer: live allocations are a map of integers behind a `Mutex`,
//! so the auto traits hold and sharing it between threads is sound. The memory those integers
//! name is touched only inside the `unsafe` methods, whose callers promise (see
//! [`crate::backend`]) that work touching one range is ordered — the same promise a device
//! backend relies on for its streams. Work is immediate, so nothing is in flight between calls.

use super::size::{range_end, to_usize, word_bytes};
use super::{Backend, BackendError, BackendKind, DeviceAllocation, Stream};
use crate::index::bounds::run_launch_within;
use crate::index::host::HostKernelError;
use crate::index::{DevicePtr, Launch};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Alignment of every allocation, as device allocators give at least this.
pub const HOST_ALLOC_ALIGN: usize = 256;

/// Alignment asked of the system allocator. At most the platform's `malloc` alignment, so
/// `alloc_zeroed` is a `calloc` (lazily committed) rather than an aligned allocation followed
/// by a memset of the whole block (committed at once).
const SYSTEM_ALIGN: usize = 16;

const KIND: BackendKind = BackendKind::Host;

/// One live allocation.
#[derive(Clone, Copy, Debug)]
struct Block {
    /// Bytes the caller asked for (the range that may be touched).
    bytes: u64,
    /// Address the system allocator returned (exposed provenance), and the size asked of it.
    raw: usize,
    raw_size: usize,
}

/// Host memory and host kernels behind the [`Backend`] trait.
#[derive(Debug, Default)]
pub struct HostBackend {
    /// Live allocations: aligned base address → block.
    live: Mutex<BTreeMap<u64, Block>>,
    /// Caller memory accepted by `adopt_external` (base → bytes): checked like `live`, never
    /// freed here.
    adopted: Mutex<BTreeMap<u64, u64>>,
}

/// Size asked of the system allocator for `bytes` usable bytes aligned to
/// [`HOST_ALLOC_ALIGN`] (zero-byte requests take one byte: a real, unique address that `free`
/// can return).
fn raw_size(bytes: u64) -> Result<usize, BackendError> {
    let usable = to_usize(KIND, "alloc_zeroed", "bytes", bytes.max(1))?;
    usable
        .checked_add(HOST_ALLOC_ALIGN - SYSTEM_ALIGN)
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or(BackendError::TooLarge { backend: KIND, call: "alloc_zeroed", what: "bytes", value: bytes })
}

impl HostBackend {
    /// An empty host backend (no live allocations).
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.live().len()
    }

    /// Bytes held by live allocations.
    pub fn allocated_bytes(&self) -> u64 {
        self.live().values().map(|b| b.bytes).sum()
    }

    fn live(&self) -> MutexGuard<'_, BTreeMap<u64, Block>> {
        // A poisoned lock only means another thread panicked while holding it; the map itself
        // is always consistent (single insert/remove calls).
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `addr .. addr + len` inside one live allocation (an empty range anywhere), or the
    /// error `call` reports.
    fn check_range(&self, call: &'static str, addr: DevicePtr, len: u64) -> Result<(), BackendError> {
        let end = range_end(KIND, call, addr, len)?;
        if len == 0 {
            return Ok(());
        }
        let inside = self.live().range(..=addr).next_back().is_some_and(|(&base, b)| end <= base + b.bytes)
            || self.adopted().range(..=addr).next_back().is_some_and(|(&base, &bytes)| end <= base + bytes);
        if inside {
            Ok(())
        } else {
            Err(BackendError::OutsideAllocation { backend: KIND, call, addr, bytes: len })
        }
    }

    /// The live allocations (and adopted caller memory) as `(base, bytes)`, for
    /// [`run_launch_within`].
    fn live_ranges(&self) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = self.live().iter().map(|(&base, b)| (base, b.bytes)).collect();
        ranges.extend(self.adopted().iter().map(|(&base, &bytes)| (base, bytes)));
        ranges
    }

    fn adopted(&self) -> MutexGuard<'_, BTreeMap<u64, u64>> {
        // As `live`: single insert/remove calls keep the map consistent through a poison.
        self.adopted.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The host address `addr` names (an allocation of this backend, whose provenance was exposed
/// when it was made).
fn host_ptr(addr: DevicePtr) -> *mut u8 {
    std::ptr::with_exposed_provenance_mut(addr as usize)
}

// SAFETY: allocations are tracked and sized as asked (`alloc_zeroed`), host memory comes
// from the default `alloc_host` (exactly `bytes`), and every copy, fill and launch is
// checked against the live allocations before it touches memory.
unsafe impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        KIND
    }

    fn device_name(&self) -> String {
        "host".to_string()
    }

    fn alloc_zeroed(&self, bytes: u64) -> Result<DeviceAllocation, BackendError> {
        let size = raw_size(bytes)?;
        let oom =
            |message: &str| BackendError::OutOfMemory { backend: KIND, bytes, message: message.to_string() };
        let layout = Layout::from_size_align(size, SYSTEM_ALIGN).map_err(|e| oom(&e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        if raw.is_null() {
            return Err(oom("the host allocator refused"));
        }
        let offset = raw.align_offset(HOST_ALLOC_ALIGN);
        // `raw_size` left `HOST_ALLOC_ALIGN - SYSTEM_ALIGN` spare bytes and the system
        // allocator aligns to SYSTEM_ALIGN, so the aligned base and `bytes` fit the block.
        debug_assert!(offset <= HOST_ALLOC_ALIGN - SYSTEM_ALIGN);
        // SAFETY: `offset` stays inside the block (above).
        let base = unsafe { raw.add(offset) };
        // Exposed: every later access rebuilds the pointer from the integer address.
        let addr = base.expose_provenance() as u64;
        let block = Block { bytes, raw: raw.expose_provenance(), raw_size: size };
        self.live().insert(addr, block);
        Ok(DeviceAllocation { ptr: addr, bytes })
    }

    unsafe fn free(&self, alloc: DeviceAllocation) {
        let mut live = self.live();
        // An address this backend did not hand out (or already freed), or one with another
        // size, is left alone rather than freed with a layout it was not made with.
        let Some(block) = live.get(&alloc.ptr).copied().filter(|b| b.bytes == alloc.bytes) else {
            return;
        };
        live.remove(&alloc.ptr);
        drop(live);
        // SAFETY: `raw` came from `alloc_zeroed` with this size and alignment (the layout was
        // valid then) and was live until the removal above; the caller promises no further use.
        unsafe {
            let layout = Layout::from_size_align_unchecked(block.raw_size, SYSTEM_ALIGN);
            dealloc(std::ptr::with_exposed_provenance_mut(block.raw), layout);
        }
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], _stream: Stream) -> Result<(), BackendError> {
        self.check_range("upload", dst, src.len() as u64)?;
        if !src.is_empty() {
            // SAFETY: `dst` range is inside a live allocation (checked) which cannot overlap the
            // borrowed host slice `src`.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host_ptr(dst), src.len()) };
        }
        Ok(())
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, _stream: Stream) -> Result<(), BackendError> {
        self.check_range("download", src, dst.len() as u64)?;
        if !dst.is_empty() {
            // SAFETY: `src` range is inside a live allocation (checked), disjoint from `dst`.
            unsafe { std::ptr::copy_nonoverlapping(host_ptr(src), dst.as_mut_ptr(), dst.len()) };
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
        // No wrap: both ends were checked by `check_range`.
        if src < dst + bytes && dst < src + bytes {
            return Err(BackendError::Overlap { backend: KIND, call: "copy", src, dst, bytes });
        }
        // SAFETY: both ranges are inside live allocations (checked) and disjoint (checked);
        // `bytes` fits usize because an allocation of at least that size exists.
        unsafe { std::ptr::copy_nonoverlapping(host_ptr(src), host_ptr(dst), bytes as usize) };
        Ok(())
    }

    unsafe fn fill_u32(
        &self,
        dst: DevicePtr,
        count: u64,
        value: u32,
        _stream: Stream,
    ) -> Result<(), BackendError> {
        let bytes = word_bytes(KIND, "fill_u32", count)?;
        self.check_range("fill_u32", dst, bytes)?;
        if count == 0 {
            return Ok(());
        }
        if dst % 4 != 0 {
            return Err(BackendError::Misaligned { backend: KIND, call: "fill_u32", addr: dst, align: 4 });
        }
        // SAFETY: aligned, inside a live allocation (checked); the caller orders all use of it.
        let words = unsafe { std::slice::from_raw_parts_mut(host_ptr(dst).cast::<u32>(), count as usize) };
        words.fill(value);
        Ok(())
    }

    unsafe fn launch(&self, launch: &Launch, _stream: Stream) -> Result<(), BackendError> {
        // SAFETY: the kernel may touch only the live allocations (checked buffer by buffer),
        // which this backend made and the caller orders all other use of (the trait contract).
        unsafe { run_launch_within(launch, self.live_ranges()) }.map_err(|e| match e {
            HostKernelError::OutsideAllocation { buffer, addr, bytes } => {
                BackendError::OutsideAllocation { backend: KIND, call: buffer, addr, bytes }
            }
            e => BackendError::InvalidLaunch { kernel: launch.symbol(), reason: e.to_string() },
        })
    }

    fn synchronize(&self, _stream: Stream) -> Result<(), BackendError> {
        Ok(())
    }

    unsafe fn adopt_external(&self, ptr: DevicePtr, bytes: u64) {
        self.adopted().insert(ptr, bytes);
    }

    fn forget_external(&self, ptr: DevicePtr) {
        self.adopted().remove(&ptr);
    }
}

#[cfg(test)]
mod tests;
