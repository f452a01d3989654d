//! One `Backend` trait; a host backend always present, CUDA and HIP beside it.
//!
//! # The unsafe contract
//!
//! A backend moves bytes and runs the kernels of [`crate::raw::index`] on **raw device
//! addresses** (`u64`; on the host backend, host addresses). It does not know what the
//! bytes mean — nothing here knows DeepSeek — and it cannot check an address: every method
//! that takes one is `unsafe`, and the caller (in this crate, [`crate::pool::Pool`]) promises:
//!
//! * every address and length names memory this backend allocated and has not freed;
//! * a launch's pointers cover what its kernel reads and writes (the sizes are stated on
//!   each `*Args` struct);
//! * work on one stream is ordered; work on different streams is ordered by the caller.
//!
//! Errors are returned for what the caller cannot foresee: a driver failure, an allocation
//! the device refuses, a kernel the module lacks. Work is asynchronous on device backends and
//! immediate on the host backend; [`Backend::synchronize`] and [`Backend::download`] are the
//! points where the host waits.
//!
//! # Layout
//!
//! * `host.rs` — the host backend (the reference; tracks its allocations and refuses any
//!   range outside them).
//! * `cuda/`, `hip/` — the device backends, each split into driver loading, kernel modules,
//!   the [`Backend`] implementation and its extras (graphs, events, profiler ranges).
//! * `staging.rs` — the one pinned staging ring both device backends upload through.
//! * `launch.rs` — the one place a [`Launch`] becomes kernel parameters, a kernel index and
//!   a grid.
//! * `select.rs` — which backend a process gets.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

pub mod cuda;
pub mod external;
pub mod hip;
pub mod host;
pub(crate) mod launch;
mod select;
pub(crate) mod staging;

pub use select::{env_choice, open, open_on, select, select_on, BackendChoice};

// What the trait's methods take: a device address and a kernel launch (its argument
// structs are the kernel contract, `crate::raw::index`).
pub use crate::index::{DevicePtr, Launch};
use std::fmt;
use std::marker::PhantomData;
use thiserror::Error;

/// A raw stream handle (`CUstream` / `hipStream_t`): the caller's stream, so pool work
/// interleaves with the engine's. `Stream::DEFAULT` is the backend's own stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stream(pub u64);

impl Stream {
    /// The backend's own stream (each device backend creates a non-blocking one).
    pub const DEFAULT: Stream = Stream(0);
}

/// Which implementation a backend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Host memory, host reference kernels ([`host::HostBackend`]).
    Host,
    /// The CUDA driver API ([`cuda::CudaBackend`]).
    Cuda,
    /// The HIP runtime ([`hip::HipBackend`]).
    Hip,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
            BackendKind::Hip => "hip",
        })
    }
}

/// One allocation a backend handed out. Freed by [`Backend::free`], never by drop: the owner
/// (the pool) decides when no kernel can still use it.
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceAllocation {
    /// Base address, 256-byte aligned.
    pub ptr: DevicePtr,
    /// Bytes requested (the backend may hold more, e.g. a minimum size for zero bytes).
    pub bytes: u64,
}

/// Host memory a backend handed out for large copies to and from its device
/// ([`Backend::alloc_host`]): page-locked where the device has it, so copies run by DMA at
/// link speed and may be queued; ordinary memory otherwise. Freed by [`Backend::free_host`]
/// of the same backend, never by drop (queued copies may still use it).
#[derive(Debug, PartialEq, Eq)]
pub struct HostAllocation {
    /// First byte (dangling, never read, when `bytes` is 0).
    pub ptr: *mut u8,
    /// Length in bytes.
    pub bytes: usize,
    /// Whether the memory is page-locked.
    pub pinned: bool,
}

// SAFETY: plain host memory; whoever holds the value owns the bytes.
unsafe impl Send for HostAllocation {}
// SAFETY: the value itself gives no access to the bytes.
unsafe impl Sync for HostAllocation {}

impl HostAllocation {
    /// The `len` bytes at `offset`, for [`Backend::upload_host`] and
    /// [`Backend::download_host`]; refused unless they lie inside this allocation. The range
    /// borrows the allocation, so it cannot be freed while the range is held; that it stays
    /// live until a queued copy has run is still the copy's caller's to ensure.
    pub fn range(&self, offset: usize, len: usize) -> Result<HostMem<'_>, HostMemError> {
        let outside = HostMemError { offset, len, bytes: self.bytes };
        let end = offset.checked_add(len).ok_or(outside)?;
        if end > self.bytes {
            return Err(outside);
        }
        // `wrapping_add`: the offset is in bounds of what the value claims, but the fields are
        // public, so the claim is not trusted until the range is used (an `unsafe` call).
        Ok(HostMem { ptr: self.ptr.wrapping_add(offset), len, _alloc: PhantomData })
    }
}

/// Bytes of one [`HostAllocation`]: the host side of [`Backend::upload_host`] (read) and
/// [`Backend::download_host`] (written). Made by [`HostAllocation::range`], which checks the
/// bounds, or by [`HostMem::from_raw_parts`] where only a pointer is at hand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMem<'a> {
    ptr: *mut u8,
    len: usize,
    _alloc: PhantomData<&'a HostAllocation>,
}

impl<'a> HostMem<'a> {
    /// A range from a raw pointer.
    ///
    /// # Safety
    /// `ptr .. ptr + len` lies inside one [`HostAllocation`] from a backend's
    /// [`Backend::alloc_host`] (the range is given only to that backend), live for `'a`.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize) -> HostMem<'a> {
        HostMem { ptr, len, _alloc: PhantomData }
    }

    /// First byte.
    pub fn as_ptr(self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(self) -> usize {
        self.len
    }

    /// Whether the range has no bytes.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }

    /// The bytes, to read.
    ///
    /// # Safety
    /// The allocation is live and nothing writes the range while the slice is used.
    pub unsafe fn as_slice(self) -> &'a [u8] {
        // SAFETY: in one allocation (the constructors), live and unwritten (the caller).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, to write.
    ///
    /// # Safety
    /// The allocation is live and nothing else reads or writes the range while the slice is
    /// used.
    pub unsafe fn as_mut_slice(self) -> &'a mut [u8] {
        // SAFETY: in one allocation (the constructors), live and unaliased (the caller).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// [`HostAllocation::range`] was asked for bytes beyond the allocation.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
#[error("host range of {len} bytes at offset {offset} is outside an allocation of {bytes} bytes")]
pub struct HostMemError {
    /// Offset asked for.
    pub offset: usize,
    /// Length asked for.
    pub len: usize,
    /// The allocation's length.
    pub bytes: usize,
}

/// Ordinary host memory (the default of [`Backend::alloc_host`]), zeroed, page-aligned.
pub(crate) mod heap {
    use super::{BackendError, BackendKind, BackendResult, HostAllocation};
    use std::alloc::Layout;

    const ALIGN: usize = 4096;

    /// `bytes` of zeroed ordinary memory.
    pub(crate) fn alloc(backend: BackendKind, bytes: u64) -> BackendResult<HostAllocation> {
        let n = super::size::to_usize(backend, "alloc_host", "bytes", bytes)?;
        if n == 0 {
            return Ok(HostAllocation {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                bytes: 0,
                pinned: false,
            });
        }
        let oom = |message: &str| BackendError::OutOfMemory { backend, bytes, message: message.into() };
        let layout = Layout::from_size_align(n, ALIGN).map_err(|_| oom("size overflows a layout"))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom("the allocator refused"));
        }
        Ok(HostAllocation { ptr, bytes: n, pinned: false })
    }

    /// Return memory of [`alloc`].
    ///
    /// # Safety
    /// `a` came from [`alloc`] and nothing uses it any more.
    pub(crate) unsafe fn free(a: HostAllocation) {
        if a.bytes > 0 {
            // SAFETY: the caller's contract: allocated by `alloc` with this layout.
            unsafe { std::alloc::dealloc(a.ptr, Layout::from_size_align_unchecked(a.bytes, ALIGN)) };
        }
    }
}

crate::variant::variant_names! {
/// What a backend can fail with.
#[derive(Debug, Error)]
pub enum BackendError {
    /// The backend cannot be used on this machine (no driver, no device, no kernel image).
    #[error("{backend} backend unavailable: {reason}")]
    Unavailable {
        /// Which backend.
        backend: BackendKind,
        /// Why, in words.
        reason: String,
    },
    /// A driver or runtime call returned an error.
    #[error("{backend} driver call {call} failed: {message}")]
    Driver {
        /// Which backend.
        backend: BackendKind,
        /// The driver entry point.
        call: &'static str,
        /// The driver's own error text.
        message: String,
    },
    /// The device (or pinned host memory) refused an allocation.
    #[error("{backend} could not allocate {bytes} bytes: {message}")]
    OutOfMemory {
        /// Which backend.
        backend: BackendKind,
        /// Bytes asked for.
        bytes: u64,
        /// The allocator's reason.
        message: String,
    },
    /// The loaded module lacks a kernel this crate launches.
    #[error("{backend} kernel module has no symbol {symbol}")]
    MissingKernel {
        /// Which backend.
        backend: BackendKind,
        /// The kernel symbol.
        symbol: &'static str,
    },
    /// Run-time compilation (NVRTC / hiprtc) failed.
    #[error("{backend} kernel compilation failed: {log}")]
    Compile {
        /// Which backend.
        backend: BackendKind,
        /// The compiler's log.
        log: String,
    },
    /// `V4POOL_BACKEND` names no backend.
    #[error("V4POOL_BACKEND={value} is not one of cuda, hip, host")]
    UnknownBackendName {
        /// The value found.
        value: String,
    },
    /// A launch's arguments failed the checks every backend runs before the device
    /// ([`crate::index::shape::check_launch`]), or the host reference refused them.
    #[error("invalid launch of {kernel}: {reason}")]
    InvalidLaunch {
        /// The kernel symbol.
        kernel: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A size or address computation overflows, or a size does not fit this host's `usize`.
    #[error("{backend} {call}: {what} = {value} overflows or does not fit this host's address space")]
    TooLarge {
        /// Which backend.
        backend: BackendKind,
        /// The operation.
        call: &'static str,
        /// Which quantity.
        what: &'static str,
        /// Its value (or the operand that overflowed).
        value: u64,
    },
    /// An address range that is not inside one live allocation of this backend (checked by
    /// the host backend, which can; a device would fault or corrupt memory instead).
    #[error("{backend} {call}: {bytes} bytes at {addr:#x} are not inside one live allocation")]
    OutsideAllocation {
        /// Which backend.
        backend: BackendKind,
        /// The operation (or the kernel buffer) that named the range.
        call: &'static str,
        /// Start of the range.
        addr: u64,
        /// Its length in bytes.
        bytes: u64,
    },
    /// A copy whose source and destination overlap.
    #[error("{backend} {call}: source {src:#x} and destination {dst:#x} of {bytes} bytes overlap")]
    Overlap {
        /// Which backend.
        backend: BackendKind,
        /// The operation.
        call: &'static str,
        /// Source address.
        src: u64,
        /// Destination address.
        dst: u64,
        /// Bytes copied.
        bytes: u64,
    },
    /// An address that is not aligned as the operation requires.
    #[error("{backend} {call}: address {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Which backend.
        backend: BackendKind,
        /// The operation.
        call: &'static str,
        /// The address.
        addr: u64,
        /// The alignment required.
        align: u64,
    },
}
// The driver-side variants; the others (a misspelt backend name, a size past `u64`, a range
// outside an allocation) refuse the caller's input.
device = [Unavailable, Driver, OutOfMemory, MissingKernel, Compile, InvalidLaunch];
}

/// What a backend call returns: every [`Backend`] method that can fail fails with a
/// [`BackendError`].
pub type BackendResult<T> = Result<T, BackendError>;

/// Checked sizes: the one place a backend turns a caller's `u64` into a host size or an end
/// address, so overflow is a [`BackendError::TooLarge`] everywhere, never a wrap.
pub(crate) mod size {
    use super::{BackendError, BackendKind, BackendResult};

    /// `value` as a `usize` (`what`: which quantity, for the error).
    pub(crate) fn to_usize(
        backend: BackendKind,
        call: &'static str,
        what: &'static str,
        value: u64,
    ) -> BackendResult<usize> {
        usize::try_from(value).map_err(|_| BackendError::TooLarge { backend, call, what, value })
    }

    /// Bytes of `count` 32-bit words.
    pub(crate) fn word_bytes(backend: BackendKind, call: &'static str, count: u64) -> BackendResult<u64> {
        count.checked_mul(4).ok_or(BackendError::TooLarge { backend, call, what: "word count", value: count })
    }

    /// `addr + bytes`, the end of a range.
    pub(crate) fn range_end(
        backend: BackendKind,
        call: &'static str,
        addr: u64,
        bytes: u64,
    ) -> BackendResult<u64> {
        addr.checked_add(bytes).ok_or(BackendError::TooLarge {
            backend,
            call,
            what: "range end",
            value: addr,
        })
    }
}

/// Allocation, copies and kernel launches on raw addresses. See the module's contract.
///
/// # Safety
/// Safe code in this crate builds slices and queues device work from what an
/// implementation's safe methods return, so an implementation promises:
///
/// * [`Backend::alloc_zeroed`] returns, on `Ok`, an allocation of at least `bytes` bytes at
///   `ptr`, 256-byte aligned, owned by the caller until [`Backend::free`];
/// * [`Backend::alloc_host`] returns, on `Ok`, host memory of exactly `bytes` bytes at
///   `ptr` (valid for reads and writes; dangling only when `bytes` is 0), owned by the
///   caller until [`Backend::free_host`]: the default [`Backend::download_host`] and
///   [`Backend::upload_host`] build slices over it;
/// * the `unsafe` methods touch no memory beyond what their contracts name, and
///   [`Backend::synchronize`] returns only once the stream's earlier work is complete.
///
/// An implementation without `unsafe impl` does not compile, so a backend outside the crate
/// cannot make these promises by accident:
///
/// ```compile_fail,E0200
/// # use v4pool::backend::*;
/// #[derive(Debug)]
/// struct Lying;
/// impl Backend for Lying {
///     fn kind(&self) -> BackendKind { BackendKind::Host }
///     fn device_name(&self) -> String { "lying".into() }
///     fn alloc_zeroed(&self, _: u64) -> BackendResult<DeviceAllocation> { todo!() }
///     unsafe fn free(&self, _: DeviceAllocation) {}
///     unsafe fn upload(&self, _: DevicePtr, _: &[u8], _: Stream) -> BackendResult<()> { Ok(()) }
///     unsafe fn download(&self, _: &mut [u8], _: DevicePtr, _: Stream) -> BackendResult<()> { Ok(()) }
///     unsafe fn copy(&self, _: DevicePtr, _: DevicePtr, _: u64, _: Stream) -> BackendResult<()> { Ok(()) }
///     unsafe fn fill_u32(&self, _: DevicePtr, _: u64, _: u32, _: Stream) -> BackendResult<()> { Ok(()) }
///     unsafe fn launch(&self, _: &Launch, _: Stream) -> BackendResult<()> { Ok(()) }
///     fn synchronize(&self, _: Stream) -> BackendResult<()> { Ok(()) }
///     // A lie safe code would build a slice from.
///     fn alloc_host(&self, bytes: u64) -> BackendResult<HostAllocation> {
///         Ok(HostAllocation { ptr: 0x1000 as *mut u8, bytes: bytes as usize, pinned: false })
///     }
/// }
/// ```
pub unsafe trait Backend: Send + Sync + fmt::Debug {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;

    /// Human-readable device name (e.g. "NVIDIA H200", "host").
    fn device_name(&self) -> String;

    /// A zeroed allocation of `bytes`, 256-byte aligned.
    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation>;

    /// Return an allocation.
    ///
    /// # Safety
    /// No work still queued may use it, and no copy of its address may be used after.
    unsafe fn free(&self, alloc: DeviceAllocation);

    /// Copy host bytes to `dst` in stream order; returns once `src` may be reused.
    ///
    /// # Safety
    /// `dst .. dst + src.len()` lies in one live allocation of this backend.
    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> BackendResult<()>;

    /// Copy device bytes to the host; waits for the stream's earlier work.
    ///
    /// # Safety
    /// `src .. src + dst.len()` lies in one live allocation of this backend.
    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> BackendResult<()>;

    /// Device-to-device copy of `bytes`, in stream order.
    ///
    /// # Safety
    /// Both ranges lie in live allocations of this backend and do not overlap.
    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: Stream) -> BackendResult<()>;

    /// Fill `count` 32-bit words at `dst` (4-byte aligned) with `value`, in stream order.
    ///
    /// # Safety
    /// `dst .. dst + 4 * count` lies in one live allocation of this backend.
    unsafe fn fill_u32(&self, dst: DevicePtr, count: u64, value: u32, stream: Stream) -> BackendResult<()>;

    /// Run one kernel of [`crate::raw::index`], in stream order.
    ///
    /// # Safety
    /// Every pointer in the arguments covers what the kernel reads and writes, as stated on
    /// the argument struct.
    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()>;

    /// Wait for all work queued on `stream`.
    fn synchronize(&self, stream: Stream) -> BackendResult<()>;

    /// Accept caller memory `ptr .. ptr + bytes` in copies, fills and launches as if this
    /// backend had allocated it (for [`external::ExternalRegion`]); the backend never frees
    /// it. Device backends keep no record, so the default does nothing; the host backend adds
    /// the range to the checks it makes.
    ///
    /// # Safety
    /// The range is memory this backend's device can use, live and used by no one else until
    /// [`Backend::forget_external`] is called for `ptr`.
    unsafe fn adopt_external(&self, _ptr: DevicePtr, _bytes: u64) {}

    /// Stop accepting a range given to [`Backend::adopt_external`].
    fn forget_external(&self, _ptr: DevicePtr) {}

    /// Zeroed host memory for large copies to and from the device (a host tier, offload):
    /// page-locked on device backends that provide it; the default is ordinary memory.
    fn alloc_host(&self, bytes: u64) -> BackendResult<HostAllocation> {
        heap::alloc(self.kind(), bytes)
    }

    /// Return memory of [`Backend::alloc_host`].
    ///
    /// # Safety
    /// `alloc` came from this backend's `alloc_host`; no queued copy still uses it.
    unsafe fn free_host(&self, alloc: HostAllocation) {
        // SAFETY: the caller's contract; the default `alloc_host` is `heap::alloc`.
        unsafe { heap::free(alloc) }
    }

    /// Queue a copy of the bytes of `src`, host memory of [`Backend::alloc_host`], to `dst` in
    /// stream order. Unlike [`Backend::upload`] it may return before `src` is read (a DMA from
    /// page-locked memory): `src` stays untouched until the stream's work has completed. The
    /// default uploads through [`Backend::upload`].
    ///
    /// # Safety
    /// `dst .. dst + src.len()` lies in one live allocation of this backend; `src` lies in an
    /// allocation of this backend's `alloc_host` ([`HostAllocation::range`] checks the bounds,
    /// not where the allocation came from), which stays live and is not written until the
    /// stream has been synchronised.
    unsafe fn upload_host(&self, dst: DevicePtr, src: HostMem, stream: Stream) -> BackendResult<()> {
        // SAFETY: the caller's contract.
        unsafe { self.upload(dst, src.as_slice(), stream) }
    }

    /// Queue a copy of `dst.len()` bytes from `src` to `dst`, host memory of
    /// [`Backend::alloc_host`], in stream order; the bytes are there once the stream has
    /// been synchronised (the default downloads through [`Backend::download`], which waits).
    ///
    /// # Safety
    /// `src .. src + dst.len()` lies in one live allocation of this backend; `dst` lies in an
    /// allocation of this backend's `alloc_host` (bounds as for [`Backend::upload_host`]),
    /// which stays live and is neither read nor written by anyone else until the stream has
    /// been synchronised.
    unsafe fn download_host(&self, dst: HostMem, src: DevicePtr, stream: Stream) -> BackendResult<()> {
        // SAFETY: the caller's contract.
        unsafe { self.download(dst.as_mut_slice(), src, stream) }
    }
}
