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
//! # Accounting mode: planes without bytes
//!
//! [`HostBackend::accounting`] is the same backend for what a simulation needs of a pool
//! (its allocations, moves, copies, checkpoints and tier traffic, and the index builds on
//! their real shapes) without the planes' bytes. An allocation of at least
//! [`VIRTUAL_MIN_BYTES`] made on a thread inside [`keep_no_bytes`] is *virtual*: an address
//! range far above any host address, tracked like a real allocation and checked the same way,
//! with no memory behind it. Work on a virtual range is counted ([`AccountingStats`]) instead
//! of done: uploads, fills and copies into it, copy and fill runs whose runs lie in it (their
//! descriptors are real and read as the kernel reads them), and copies between it and host
//! memory ([`Backend::download_host`], [`Backend::upload_host`]: the host side is left as it
//! is). What would need its bytes is refused ([`BackendError::Unavailable`]): a
//! [`Backend::download`] of it, a copy from it into real memory, a kernel other than the
//! copy and fill runs that names it. Every other allocation is real and every launch on real
//! memory runs its host reference, so a decode index build runs as on the plain backend.
//! [`Backend::alloc_host`] reserves address space without committing it (`MAP_NORESERVE`),
//! so a host tier costs resident memory only for the bytes written into it — none, when
//! every spill comes from a virtual plane.
//!
//! # Why `Send + Sync`
//! The backend owns no raw pointer: live allocations are a map of integers behind a `Mutex`,
//! so the auto traits hold and sharing it between threads is sound. The memory those integers
//! name is touched only inside the `unsafe` methods, whose callers promise (see
//! [`crate::backend`]) that work touching one range is ordered — the same promise a device
//! backend relies on for its streams. Work is immediate, so nothing is in flight between calls.

use super::size::{range_end, to_usize, word_bytes};
use super::{Backend, BackendError, BackendKind, BackendResult, DeviceAllocation, HostMem, Stream};
use crate::index::bounds::run_launch_within;
use crate::index::host::HostKernelError;
use crate::index::{CopyRun, FillRun};
use crate::index::{DevicePtr, Launch};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Alignment of every allocation, as device allocators give at least this.
pub const HOST_ALLOC_ALIGN: usize = 256;

/// Alignment asked of the system allocator. At most the platform's `malloc` alignment, so
/// `alloc_zeroed` is a `calloc` (lazily committed) rather than an aligned allocation followed
/// by a memset of the whole block (committed at once).
const SYSTEM_ALIGN: usize = 16;

const KIND: BackendKind = BackendKind::Host;

/// Smallest allocation an accounting backend makes virtual inside [`keep_no_bytes`]: a pool's
/// planes and indexer cache are far larger, its copy and fill descriptors (read by the
/// accounting) far smaller.
pub const VIRTUAL_MIN_BYTES: u64 = 1 << 20;

/// First virtual address: above every host address of a 64-bit process (user space ends at
/// 2^47, 2^56 with five-level paging), so a virtual range never meets a real one.
const VIRTUAL_BASE: u64 = 1 << 60;

/// Gap left after each virtual allocation, so a range running past one never lands in the next.
const VIRTUAL_GAP: u64 = 1 << 20;

thread_local! {
    /// Open [`keep_no_bytes`] scopes on this thread.
    static NO_BYTES: Cell<u32> = const { Cell::new(0) };
}

/// Run `f` with large allocations of an accounting-mode [`HostBackend`] made on this thread
/// virtual (see the module docs). Other backends ignore it, so code that builds a pool for a
/// simulation wraps it whatever backend it runs on.
pub fn keep_no_bytes<R>(f: impl FnOnce() -> R) -> R {
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            NO_BYTES.with(|n| n.set(n.get().saturating_sub(1)));
        }
    }
    NO_BYTES.with(|n| n.set(n.get().saturating_add(1)));
    let _close = Close;
    f()
}

/// What an accounting backend did instead of moving bytes (totals since it was made).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccountingStats {
    /// Live virtual allocations and their bytes.
    pub virtual_allocations: usize,
    /// Bytes of the live virtual allocations.
    pub virtual_bytes: u64,
    /// Largest `virtual_bytes` seen.
    pub peak_virtual_bytes: u64,
    /// Bytes uploaded into virtual ranges.
    pub uploaded_bytes: u64,
    /// Bytes copied into virtual ranges (copies and copy runs).
    pub copied_bytes: u64,
    /// Bytes filled in virtual ranges (fills and fill runs).
    pub filled_bytes: u64,
    /// Bytes moved between virtual ranges and host memory (`download_host`).
    pub to_host_bytes: u64,
    /// Bytes moved between host memory and virtual ranges (`upload_host`).
    pub from_host_bytes: u64,
    /// Copy and fill launches counted instead of run, and their runs.
    pub launches: u64,
    /// Runs of those launches.
    pub runs: u64,
    /// Bytes of host memory `alloc_host` reserved (live).
    pub host_reserved_bytes: u64,
}

/// Where a checked range lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mem {
    /// In a real allocation (or adopted caller memory), or empty.
    Real,
    /// In a virtual allocation.
    Virtual,
}

#[derive(Debug, Default)]
struct Accounting {
    /// Live virtual allocations: base → bytes.
    ranges: BTreeMap<u64, u64>,
    /// Next virtual address to hand out (never reused).
    next: u64,
    stats: AccountingStats,
}

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
    /// The accounting mode's virtual allocations and counters (`None`: the plain backend).
    accounting: Option<Mutex<Accounting>>,
}

/// Size asked of the system allocator for `bytes` usable bytes aligned to
/// [`HOST_ALLOC_ALIGN`] (zero-byte requests take one byte: a real, unique address that `free`
/// can return).
fn raw_size(bytes: u64) -> BackendResult<usize> {
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

    /// The accounting mode (see the module docs): allocations of at least
    /// [`VIRTUAL_MIN_BYTES`] made inside [`keep_no_bytes`] keep no bytes.
    pub fn accounting() -> Self {
        HostBackend {
            accounting: Some(Mutex::new(Accounting { next: VIRTUAL_BASE, ..Accounting::default() })),
            ..Self::default()
        }
    }

    /// The accounting mode's counters (`None` on the plain backend).
    pub fn accounting_stats(&self) -> Option<AccountingStats> {
        self.acct().map(|a| a.stats)
    }

    fn acct(&self) -> Option<MutexGuard<'_, Accounting>> {
        // As `live`: every update leaves the state consistent through a poison.
        self.accounting.as_ref().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Count `bytes` in the counter `field` picks (accounting mode only).
    fn count(&self, bytes: u64, field: fn(&mut AccountingStats) -> &mut u64) {
        if let Some(mut a) = self.acct() {
            let c = field(&mut a.stats);
            *c = c.saturating_add(bytes);
        }
    }

    /// A virtual allocation of `bytes` (accounting mode).
    fn alloc_virtual(&self, a: &mut Accounting, bytes: u64) -> BackendResult<DeviceAllocation> {
        let too_large =
            BackendError::TooLarge { backend: KIND, call: "alloc_zeroed", what: "bytes", value: bytes };
        let ptr = a.next;
        let span = bytes.div_ceil(VIRTUAL_GAP).checked_add(1).and_then(|n| n.checked_mul(VIRTUAL_GAP));
        a.next = span.and_then(|s| ptr.checked_add(s)).ok_or(too_large)?;
        a.ranges.insert(ptr, bytes);
        a.stats.virtual_allocations += 1;
        a.stats.virtual_bytes += bytes;
        a.stats.peak_virtual_bytes = a.stats.peak_virtual_bytes.max(a.stats.virtual_bytes);
        Ok(DeviceAllocation { ptr, bytes })
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

    /// `addr .. addr + len` inside one live allocation (an empty range anywhere): where it
    /// lies, or the error `call` reports.
    fn locate(&self, call: &'static str, addr: DevicePtr, len: u64) -> BackendResult<Mem> {
        let end = range_end(KIND, call, addr, len)?;
        if len == 0 {
            return Ok(Mem::Real);
        }
        let inside = self.live().range(..=addr).next_back().is_some_and(|(&base, b)| end <= base + b.bytes)
            || self.adopted().range(..=addr).next_back().is_some_and(|(&base, &bytes)| end <= base + bytes);
        if inside {
            return Ok(Mem::Real);
        }
        let in_virtual = self.acct().is_some_and(|a| {
            a.ranges.range(..=addr).next_back().is_some_and(|(&base, &bytes)| end <= base + bytes)
        });
        if in_virtual {
            Ok(Mem::Virtual)
        } else {
            Err(BackendError::OutsideAllocation { backend: KIND, call, addr, bytes: len })
        }
    }

    /// Whether `addr` lies in a live virtual allocation.
    fn is_virtual(&self, addr: u64) -> bool {
        self.acct().is_some_and(|a| {
            a.ranges
                .range(..=addr)
                .next_back()
                .is_some_and(|(&base, &bytes)| addr < base.saturating_add(bytes))
        })
    }

    /// Copy and fill runs with a run in virtual memory, checked as the kernel checks them
    /// before it writes anything, then counted (virtual destinations) or done (real ones,
    /// through this backend's own copy and fill). `None`: every run is real, for the kernel.
    fn account_runs(&self, launch: &Launch, stream: Stream) -> BackendResult<Option<()>> {
        let invalid = |reason: String| BackendError::InvalidLaunch { kernel: launch.symbol(), reason };
        let (desc, n, size) = match launch {
            Launch::CopyRuns(a) => (a.runs, a.num_runs, std::mem::size_of::<CopyRun>()),
            Launch::FillRuns(a) => (a.runs, a.num_runs, std::mem::size_of::<FillRun>()),
            _ => return Ok(None),
        };
        let n = usize::try_from(n).map_err(|_| invalid(format!("num_runs {n} is negative")))?;
        let bytes = (n as u64).checked_mul(size as u64).ok_or(BackendError::TooLarge {
            backend: KIND,
            call: "launch",
            what: "runs",
            value: n as u64,
        })?;
        if self.locate("runs", desc, bytes)? == Mem::Virtual {
            return Err(no_bytes(format!(
                "{}: its run descriptors are in memory kept without bytes",
                launch.symbol()
            )));
        }
        // Copied out as the kernel does: its runs may write over the descriptors.
        fn read<T: bytemuck::Pod + Default>(
            b: &HostBackend,
            desc: u64,
            n: usize,
            stream: Stream,
        ) -> BackendResult<Vec<T>> {
            let mut v = vec![T::default(); n];
            // SAFETY: the descriptors lie in a live real allocation (located by the caller).
            unsafe { b.download(bytemuck::cast_slice_mut(&mut v), desc, stream)? };
            Ok(v)
        }
        // (destination, its place, source and its place, bytes, fill pattern)
        let mut runs = Vec::with_capacity(n);
        match launch {
            Launch::CopyRuns(_) => {
                for (i, r) in read::<CopyRun>(self, desc, n, stream)?.into_iter().enumerate() {
                    let dst = self.locate("copy run dst", r.dst, r.bytes)?;
                    let src = self.locate("copy run src", r.src, r.bytes)?;
                    if r.bytes > 0 && r.src < r.dst + r.bytes && r.dst < r.src + r.bytes {
                        return Err(invalid(format!("copy run {i}: source and destination overlap")));
                    }
                    runs.push((r.dst, dst, Some((r.src, src)), r.bytes, 0));
                }
            }
            _ => {
                for (i, r) in read::<FillRun>(self, desc, n, stream)?.into_iter().enumerate() {
                    if r.dst % 4 != 0 || r.bytes % 4 != 0 {
                        return Err(invalid(format!(
                            "fill run {i}: {} bytes at {:#x} not 4-byte aligned",
                            r.bytes, r.dst
                        )));
                    }
                    runs.push((r.dst, self.locate("fill run", r.dst, r.bytes)?, None, r.bytes, r.pattern));
                }
            }
        }
        if runs.iter().all(|r| r.1 == Mem::Real && r.2.is_none_or(|s| s.1 == Mem::Real)) {
            return Ok(None);
        }
        if runs.iter().any(|r| r.1 == Mem::Real && r.2.is_some_and(|s| s.1 == Mem::Virtual)) {
            return Err(no_bytes(format!(
                "{}: a run copies from memory kept without bytes into real memory",
                launch.symbol()
            )));
        }
        let (mut copied, mut filled) = (0u64, 0u64);
        for &(dst, place, src, bytes, pattern) in &runs {
            match (place, src) {
                (Mem::Virtual, Some(_)) => copied += bytes,
                (Mem::Virtual, None) => filled += bytes,
                // SAFETY: both ranges located in real allocations and disjoint (checked above).
                (Mem::Real, Some((s, _))) => unsafe { self.copy(dst, s, bytes, stream)? },
                // SAFETY: located in a real allocation, 4-byte aligned (checked above).
                (Mem::Real, None) => unsafe { self.fill_u32(dst, bytes / 4, pattern, stream)? },
            }
        }
        if let Some(mut a) = self.acct() {
            a.stats.copied_bytes = a.stats.copied_bytes.saturating_add(copied);
            a.stats.filled_bytes = a.stats.filled_bytes.saturating_add(filled);
            a.stats.launches += 1;
            a.stats.runs += runs.len() as u64;
        }
        Ok(Some(()))
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

/// What an accounting backend refuses: work that needs bytes it does not keep.
fn no_bytes(reason: String) -> BackendError {
    BackendError::Unavailable { backend: KIND, reason: format!("accounting mode keeps no bytes: {reason}") }
}

/// Reserve `bytes` of zeroed host memory committed only where written (`MAP_NORESERVE`: the
/// reservation is not charged against the machine's memory either).
#[cfg(unix)]
fn reserve_host(bytes: u64) -> BackendResult<super::HostAllocation> {
    let n = to_usize(KIND, "alloc_host", "bytes", bytes)?;
    if n == 0 {
        return Ok(super::HostAllocation {
            ptr: std::ptr::NonNull::dangling().as_ptr(),
            bytes: 0,
            pinned: false,
        });
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let noreserve = libc::MAP_NORESERVE;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let noreserve = 0;
    // SAFETY: a fresh private anonymous mapping; no existing memory is named.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | noreserve,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        let message = std::io::Error::last_os_error().to_string();
        return Err(BackendError::OutOfMemory { backend: KIND, bytes, message });
    }
    Ok(super::HostAllocation { ptr: ptr.cast(), bytes: n, pinned: false })
}

#[cfg(not(unix))]
fn reserve_host(bytes: u64) -> BackendResult<super::HostAllocation> {
    super::heap::alloc(KIND, bytes)
}

/// Return memory of [`reserve_host`].
///
/// # Safety
/// `a` came from [`reserve_host`] and nothing uses it any more.
unsafe fn release_host(a: super::HostAllocation) {
    #[cfg(unix)]
    if a.bytes > 0 {
        // SAFETY: the caller's contract: a mapping of exactly `a.bytes` made by `reserve_host`.
        unsafe { libc::munmap(a.ptr.cast(), a.bytes) };
    }
    #[cfg(not(unix))]
    // SAFETY: the caller's contract; `reserve_host` is `heap::alloc` here.
    unsafe {
        super::heap::free(a)
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

    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation> {
        if bytes >= VIRTUAL_MIN_BYTES && NO_BYTES.with(Cell::get) > 0 {
            if let Some(mut a) = self.acct() {
                return self.alloc_virtual(&mut a, bytes);
            }
        }
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
        if let Some(mut a) = self.acct() {
            if a.ranges.get(&alloc.ptr) == Some(&alloc.bytes) {
                a.ranges.remove(&alloc.ptr);
                a.stats.virtual_allocations -= 1;
                a.stats.virtual_bytes -= alloc.bytes;
                return;
            }
        }
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

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], _stream: Stream) -> BackendResult<()> {
        if self.locate("upload", dst, src.len() as u64)? == Mem::Virtual {
            self.count(src.len() as u64, |s| &mut s.uploaded_bytes);
            return Ok(());
        }
        if !src.is_empty() {
            // SAFETY: `dst` range is inside a live allocation (checked) which cannot overlap the
            // borrowed host slice `src`.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host_ptr(dst), src.len()) };
        }
        Ok(())
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, _stream: Stream) -> BackendResult<()> {
        if self.locate("download", src, dst.len() as u64)? == Mem::Virtual {
            return Err(no_bytes(format!("download of {} bytes at {src:#x}", dst.len())));
        }
        if !dst.is_empty() {
            // SAFETY: `src` range is inside a live allocation (checked), disjoint from `dst`.
            unsafe { std::ptr::copy_nonoverlapping(host_ptr(src), dst.as_mut_ptr(), dst.len()) };
        }
        Ok(())
    }

    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64, _stream: Stream) -> BackendResult<()> {
        let to = self.locate("copy", dst, bytes)?;
        let from = self.locate("copy", src, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        // No wrap: both ends were checked by `locate`.
        if src < dst + bytes && dst < src + bytes {
            return Err(BackendError::Overlap { backend: KIND, call: "copy", src, dst, bytes });
        }
        match (to, from) {
            (Mem::Virtual, _) => {
                self.count(bytes, |s| &mut s.copied_bytes);
                return Ok(());
            }
            (Mem::Real, Mem::Virtual) => {
                return Err(no_bytes(format!("copy of {bytes} bytes from {src:#x} into real memory")));
            }
            (Mem::Real, Mem::Real) => {}
        }
        // SAFETY: both ranges are inside live allocations (checked) and disjoint (checked);
        // `bytes` fits usize because an allocation of at least that size exists.
        unsafe { std::ptr::copy_nonoverlapping(host_ptr(src), host_ptr(dst), bytes as usize) };
        Ok(())
    }

    unsafe fn fill_u32(&self, dst: DevicePtr, count: u64, value: u32, _stream: Stream) -> BackendResult<()> {
        let bytes = word_bytes(KIND, "fill_u32", count)?;
        let place = self.locate("fill_u32", dst, bytes)?;
        if count == 0 {
            return Ok(());
        }
        if dst % 4 != 0 {
            return Err(BackendError::Misaligned { backend: KIND, call: "fill_u32", addr: dst, align: 4 });
        }
        if place == Mem::Virtual {
            self.count(bytes, |s| &mut s.filled_bytes);
            return Ok(());
        }
        // SAFETY: aligned, inside a live allocation (checked); the caller orders all use of it.
        let words = unsafe { std::slice::from_raw_parts_mut(host_ptr(dst).cast::<u32>(), count as usize) };
        words.fill(value);
        Ok(())
    }

    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()> {
        if self.accounting.is_some() {
            crate::index::shape::check_launch(launch).map_err(|e| BackendError::InvalidLaunch {
                kernel: launch.symbol(),
                reason: e.to_string(),
            })?;
            if self.account_runs(launch, stream)?.is_some() {
                return Ok(());
            }
        }
        // SAFETY: the kernel may touch only the live allocations (checked buffer by buffer),
        // which this backend made and the caller orders all other use of (the trait contract).
        // Virtual ranges are not among them: a kernel naming one is refused before it runs.
        unsafe { run_launch_within(launch, self.live_ranges()) }.map_err(|e| match e {
            HostKernelError::OutsideAllocation { buffer, addr, bytes } if self.is_virtual(addr) => no_bytes(
                format!("{} reads or writes {bytes} bytes of {buffer} at {addr:#x}", launch.symbol()),
            ),
            HostKernelError::OutsideAllocation { buffer, addr, bytes } => {
                BackendError::OutsideAllocation { backend: KIND, call: buffer, addr, bytes }
            }
            e => BackendError::InvalidLaunch { kernel: launch.symbol(), reason: e.to_string() },
        })
    }

    fn synchronize(&self, _stream: Stream) -> BackendResult<()> {
        Ok(())
    }

    unsafe fn adopt_external(&self, ptr: DevicePtr, bytes: u64) {
        self.adopted().insert(ptr, bytes);
    }

    fn forget_external(&self, ptr: DevicePtr) {
        self.adopted().remove(&ptr);
    }

    fn alloc_host(&self, bytes: u64) -> BackendResult<super::HostAllocation> {
        if self.accounting.is_none() {
            return super::heap::alloc(KIND, bytes);
        }
        let a = reserve_host(bytes)?;
        self.count(a.bytes as u64, |s| &mut s.host_reserved_bytes);
        Ok(a)
    }

    unsafe fn free_host(&self, alloc: super::HostAllocation) {
        match self.acct() {
            None => {
                // SAFETY: the caller's contract; the plain backend's `alloc_host` is `heap::alloc`.
                unsafe { super::heap::free(alloc) }
            }
            Some(mut a) => {
                a.stats.host_reserved_bytes = a.stats.host_reserved_bytes.saturating_sub(alloc.bytes as u64);
                drop(a);
                // SAFETY: the caller's contract; the accounting `alloc_host` is `reserve_host`.
                unsafe { release_host(alloc) }
            }
        }
    }

    unsafe fn upload_host(&self, dst: DevicePtr, src: HostMem, stream: Stream) -> BackendResult<()> {
        if self.locate("upload_host", dst, src.len() as u64)? == Mem::Virtual {
            self.count(src.len() as u64, |s| &mut s.from_host_bytes);
            return Ok(());
        }
        // SAFETY: the caller's contract (`src` is live host memory).
        unsafe { self.upload(dst, src.as_slice(), stream) }
    }

    unsafe fn download_host(&self, dst: HostMem, src: DevicePtr, stream: Stream) -> BackendResult<()> {
        // The host side keeps what it held: a virtual range has no bytes to give it.
        if self.locate("download_host", src, dst.len() as u64)? == Mem::Virtual {
            self.count(dst.len() as u64, |s| &mut s.to_host_bytes);
            return Ok(());
        }
        // SAFETY: the caller's contract (`dst` is live host memory, unaliased).
        unsafe { self.download(dst.as_mut_slice(), src, stream) }
    }
}

#[cfg(test)]
mod tests;
