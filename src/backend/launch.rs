//! The one place a [`Launch`] becomes what a driver's launch call takes: the kernel's single
//! by-value parameter, the kernel's index in [`Launch::SYMBOLS`] (the order both device
//! backends resolve their module's functions in) and the grid.
//!
//! Both device backends call `DeviceLaunch::prepare` and hand `DeviceLaunch::params` to
//! `cuLaunchKernel` / `hipModuleLaunchKernel`; the emulation test takes
//! [`kernel_argument`]'s bytes. Nothing else matches on the launch kind to find its argument.

use super::{BackendError, BackendResult};
use crate::index::shape::{check_launch, launch_shape, LaunchShape};
use crate::index::Launch;
use bytemuck::bytes_of;
use std::ffi::c_void;
use std::marker::PhantomData;

/// The bytes of a launch's single by-value kernel parameter (its `#[repr(C)]` `*Args`
/// struct, exactly as the kernel declares it); empty for `v4pool_empty`, which takes none.
/// The slice borrows the struct inside `launch`, so its address is the argument's address.
pub fn kernel_argument(launch: &Launch) -> &[u8] {
    match launch {
        Launch::Decode(a) => bytes_of(a),
        Launch::Prefill(a) => bytes_of(a),
        Launch::HcaOffsets(a) => bytes_of(a),
        Launch::CsaPack(a) => bytes_of(a),
        Launch::RingWrite(a) => bytes_of(a),
        Launch::RowScatter(a) => bytes_of(a),
        Launch::StateUpdate(a) => bytes_of(a),
        Launch::FillRuns(a) => bytes_of(a),
        Launch::CopyRuns(a) => bytes_of(a),
        Launch::WindowGather(a) | Launch::WindowGatherFp8(a) => bytes_of(a),
        Launch::KvRows(a) => bytes_of(a),
        Launch::IndexKeys(a) => bytes_of(a),
        Launch::WriteBatch(a) => bytes_of(a),
        Launch::Empty => &[],
    }
}

/// Index of `launch`'s kernel in [`Launch::SYMBOLS`].
pub(crate) fn symbol_index(launch: &Launch) -> usize {
    let symbol = launch.symbol();
    // Every symbol `Launch::symbol` returns is listed (a unit test of `crate::index` and the
    // one below check it), so the fallback is never taken.
    Launch::SYMBOLS.iter().position(|s| *s == symbol).unwrap_or(Launch::SYMBOLS.len())
}

/// A checked launch, ready for the driver: kernel index, grid and `kernelParams`.
pub(crate) struct DeviceLaunch<'a> {
    /// Index of the kernel in [`Launch::SYMBOLS`].
    pub index: usize,
    /// Grid and block from [`launch_shape`]: every dimension >= 1, so a launch with no work
    /// is one block that returns at once (and a captured graph keeps its node).
    pub shape: LaunchShape,
    /// Pointer to the argument struct, or null for a kernel without parameters.
    arg: *mut c_void,
    /// The argument lives in the borrowed launch.
    _launch: PhantomData<&'a Launch>,
}

impl<'a> DeviceLaunch<'a> {
    /// Run [`check_launch`] (an [`BackendError::InvalidLaunch`] before anything reaches the
    /// device) and take the kernel index and grid.
    pub fn prepare(launch: &'a Launch) -> BackendResult<Self> {
        check_launch(launch)
            .map_err(|e| BackendError::InvalidLaunch { kernel: launch.symbol(), reason: e.to_string() })?;
        let arg = kernel_argument(launch);
        let arg = if arg.is_empty() { std::ptr::null_mut() } else { arg.as_ptr().cast_mut().cast() };
        Ok(DeviceLaunch {
            index: symbol_index(launch),
            shape: launch_shape(launch),
            arg,
            _launch: PhantomData,
        })
    }

    /// The kernel's symbol, for errors.
    pub fn symbol(&self) -> &'static str {
        Launch::SYMBOLS.get(self.index).copied().unwrap_or("unknown kernel")
    }

    /// `kernelParams` as both drivers take it: a pointer to an array holding one pointer to
    /// the by-value argument struct (the driver copies the struct during the call), or null
    /// when the kernel has no parameters. Valid while `self` is neither moved nor dropped.
    pub fn params(&mut self) -> *mut *mut c_void {
        if self.arg.is_null() {
            std::ptr::null_mut()
        } else {
            &mut self.arg
        }
    }
}

/// `kernelParams` for a kernel without parameters (the probe of `v4pool_empty`).
pub(crate) const NO_PARAMS: *mut *mut c_void = std::ptr::null_mut();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{CopyRunsArgs, RowScatterArgs};

    #[test]
    fn every_launch_has_an_index_and_its_own_argument() {
        let copy = Launch::CopyRuns(CopyRunsArgs { runs: 0x1000, num_runs: 0, _pad: 0 });
        let mut d = DeviceLaunch::prepare(&copy).unwrap();
        assert_eq!(Launch::SYMBOLS[d.index], "v4pool_copy_runs");
        let Launch::CopyRuns(args) = &copy else { unreachable!() };
        // SAFETY: `params` points at one pointer while `d` is alive.
        let arg = unsafe { *d.params() };
        assert_eq!(arg.cast_const(), (args as *const CopyRunsArgs).cast());
        assert_eq!(kernel_argument(&copy).len(), std::mem::size_of::<CopyRunsArgs>());
        let mut empty = DeviceLaunch::prepare(&Launch::Empty).unwrap();
        assert!(empty.params().is_null());
        assert_eq!(Launch::SYMBOLS[empty.index], "v4pool_empty");
        for (i, sym) in Launch::SYMBOLS.iter().enumerate() {
            assert_eq!(Launch::SYMBOLS.iter().position(|s| s == sym), Some(i));
        }
    }

    #[test]
    fn invalid_launches_never_reach_a_driver() {
        let bad = Launch::RowScatter(RowScatterArgs { num_tokens: -1, ..Default::default() });
        assert!(matches!(DeviceLaunch::prepare(&bad), Err(BackendError::InvalidLaunch { .. })));
    }
}
