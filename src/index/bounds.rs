//! Bounds for the host reference's raw-pointer entry: [`run_launch_within`] runs a launch
//! that may touch only the ranges its caller owns (the host backend's live allocations), so a
//! launch naming any other address is an error instead of a read or write through it.
//!
//! The kernels of [`super::host`] are synchronous, so the bounds of the launch running on a
//! thread live in a thread-local for its duration: every buffer the raw entry turns into a
//! slice (and every run of a copy or fill descriptor) is checked there, with no change to the
//! kernels' signatures. Outside [`run_launch_within`] nothing is checked beyond what
//! [`super::host::run_launch`] always checks (non-null, aligned, no wrap).

use super::host::{run_launch, HostKernelError};
use super::Launch;
use std::cell::RefCell;

type Result<T> = std::result::Result<T, HostKernelError>;

/// What the launch running on this thread may touch, and the slices it has taken so far.
struct Bounds {
    /// Allowed ranges `(base, bytes)`, sorted by base.
    live: Vec<(u64, u64)>,
    /// Slices handed out during this launch: `(start, end, written)`.
    taken: Vec<(u64, u64, bool)>,
}

impl Bounds {
    /// `addr .. addr + bytes` inside one allowed range (checked: no wrap).
    fn contains(&self, addr: u64, bytes: u64) -> bool {
        let i = self.live.partition_point(|&(base, _)| base <= addr);
        i > 0 && {
            let (base, len) = self.live[i - 1];
            addr.checked_add(bytes).is_some_and(|end| base.checked_add(len).is_some_and(|top| end <= top))
        }
    }
}

thread_local! {
    /// Set only while [`run_launch_within`] runs on this thread.
    static BOUNDS: RefCell<Option<Bounds>> = const { RefCell::new(None) };
}

/// `addr .. addr + bytes` (non-empty) inside one allowed range, when bounds are set.
pub(crate) fn check(buffer: &'static str, addr: u64, bytes: u64) -> Result<()> {
    BOUNDS.with_borrow(|b| match b {
        Some(b) if bytes > 0 && !b.contains(addr, bytes) => {
            Err(HostKernelError::OutsideAllocation { buffer, addr, bytes })
        }
        _ => Ok(()),
    })
}

/// Record a slice of `bytes` at `addr` about to be handed out; refuse it if it overlaps a
/// slice already taken by the launch and either is written (the two would alias a `&mut`).
/// A no-op when bounds are not set. `addr + bytes` must not wrap (checked by the caller).
pub(crate) fn claim(buffer: &'static str, addr: u64, bytes: usize, write: bool) -> Result<()> {
    let end = addr + bytes as u64;
    BOUNDS.with_borrow_mut(|b| {
        let Some(b) = b else { return Ok(()) };
        if b.taken.iter().any(|&(s, e, w)| (w || write) && s < end && addr < e) {
            return Err(HostKernelError::Aliased { buffer, addr, bytes: bytes as u64 });
        }
        b.taken.push((addr, end, write));
        Ok(())
    })
}

/// Forget the slices the running launch has taken: the next part of a launch made of parts
/// (a write batch's items, each a launch of its own whose slices are gone when it returns)
/// may take them again. A no-op when bounds are not set.
pub(crate) fn release_claims() {
    BOUNDS.with_borrow_mut(|b| {
        if let Some(b) = b {
            b.taken.clear();
        }
    });
}

/// [`run_launch`] that touches nothing outside `live` (`(base, bytes)` ranges): every buffer a
/// kernel would read or write must lie inside one range ([`HostKernelError::OutsideAllocation`]
/// otherwise), and no written buffer may overlap another buffer of the launch
/// ([`HostKernelError::Aliased`]). The host backend passes its live allocations.
///
/// # Safety
/// Every range in `live` is memory the caller owns for the duration of the call: allocated,
/// not freed, and not accessed by anything else while the launch runs.
pub unsafe fn run_launch_within(launch: &Launch, mut live: Vec<(u64, u64)>) -> Result<()> {
    /// Clears the bounds however the launch ends (an error return or a panic).
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            BOUNDS.set(None);
        }
    }
    live.sort_unstable();
    BOUNDS.set(Some(Bounds { live, taken: Vec::new() }));
    let _reset = Reset;
    // SAFETY: every slice the kernel takes is checked against `live` (owned by the caller, per
    // this function's contract) and against the launch's other slices, which is what
    // `run_launch` asks of its caller.
    unsafe { run_launch(launch) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_inside_one_live_range() {
        let b = Bounds { live: vec![(100, 50), (256, 16)], taken: Vec::new() };
        assert!(b.contains(100, 50) && b.contains(120, 30) && b.contains(256, 16));
        assert!(!b.contains(99, 2) && !b.contains(140, 20) && !b.contains(150, 1));
        assert!(!b.contains(140, 120), "spans two ranges");
        assert!(!b.contains(u64::MAX - 1, 4) && !b.contains(0, 1));
    }

    #[test]
    fn bounds_apply_only_inside_run_launch_within() {
        assert!(check("x", 0x1000, 8).is_ok());
        // SAFETY: the launch touches nothing.
        unsafe { run_launch_within(&Launch::Empty, vec![(64, 64)]).unwrap() };
        assert!(check("x", 0x1000, 8).is_ok(), "bounds leaked past the launch");
    }
}
