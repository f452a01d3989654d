//! One `Backend` trait; a host backend always present, CUDA and HIP beside it.
//!
//! # The unsafe contract
//!
//! A backend moves bytes and runs the kernels of [`crate::index`] on **raw device
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

pub mod cuda;
pub mod external;
pub mod hip;
pub mod host;
pub mod select;

pub use select::{open, select, BackendChoice};

use crate::index::{DevicePtr, Launch};
use std::fmt;
use thiserror::Error;

/// A raw stream handle (`CUstream` / `hipStream_t`): the caller's stream, so pool work
/// interleaves with the engine's. `Stream::DEFAULT` is the backend's own stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stream(pub u64);

impl Stream {
    pub const DEFAULT: Stream = Stream(0);
}

/// Which implementation a backend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Host,
    Cuda,
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
    pub bytes: u64,
}

/// What a backend can fail with.
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("{backend} backend unavailable: {reason}")]
    Unavailable { backend: BackendKind, reason: String },
    #[error("{backend} driver call {call} failed: {message}")]
    Driver { backend: BackendKind, call: &'static str, message: String },
    #[error("{backend} could not allocate {bytes} bytes: {message}")]
    OutOfMemory { backend: BackendKind, bytes: u64, message: String },
    #[error("{backend} kernel module has no symbol {symbol}")]
    MissingKernel { backend: BackendKind, symbol: &'static str },
    #[error("{backend} kernel compilation failed: {log}")]
    Compile { backend: BackendKind, log: String },
    #[error("V4POOL_BACKEND={value} is not one of cuda, hip, host")]
    UnknownBackendName { value: String },
    #[error("invalid launch of {kernel}: {reason}")]
    InvalidLaunch { kernel: &'static str, reason: String },
}

/// Allocation, copies and kernel launches on raw addresses. See the module's contract.
pub trait Backend: Send + Sync + fmt::Debug {
    fn kind(&self) -> BackendKind;

    /// Human-readable device name (e.g. "NVIDIA H200", "host").
    fn device_name(&self) -> String;

    /// A zeroed allocation of `bytes`, 256-byte aligned.
    fn alloc_zeroed(&self, bytes: u64) -> Result<DeviceAllocation, BackendError>;

    /// Return an allocation.
    ///
    /// # Safety
    /// No work still queued may use it, and no copy of its address may be used after.
    unsafe fn free(&self, alloc: DeviceAllocation);

    /// Copy host bytes to `dst` in stream order; returns once `src` may be reused.
    ///
    /// # Safety
    /// `dst .. dst + src.len()` lies in one live allocation of this backend.
    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> Result<(), BackendError>;

    /// Copy device bytes to the host; waits for the stream's earlier work.
    ///
    /// # Safety
    /// `src .. src + dst.len()` lies in one live allocation of this backend.
    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> Result<(), BackendError>;

    /// Device-to-device copy of `bytes`, in stream order.
    ///
    /// # Safety
    /// Both ranges lie in live allocations of this backend and do not overlap.
    unsafe fn copy(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: Stream,
    ) -> Result<(), BackendError>;

    /// Fill `count` 32-bit words at `dst` (4-byte aligned) with `value`, in stream order.
    ///
    /// # Safety
    /// `dst .. dst + 4 * count` lies in one live allocation of this backend.
    unsafe fn fill_u32(
        &self,
        dst: DevicePtr,
        count: u64,
        value: u32,
        stream: Stream,
    ) -> Result<(), BackendError>;

    /// Run one kernel of [`crate::index`], in stream order.
    ///
    /// # Safety
    /// Every pointer in the arguments covers what the kernel reads and writes, as stated on
    /// the argument struct.
    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> Result<(), BackendError>;

    /// Wait for all work queued on `stream`.
    fn synchronize(&self, stream: Stream) -> Result<(), BackendError>;

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
}
