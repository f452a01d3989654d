//! The pinned staging ring both device backends upload through, written once over the few
//! driver calls it needs ([`StagingDriver`]: pinned alloc/free, events, an async copy).
//!
//! `upload` copies the caller's bytes into pinned host memory, queues the device copy from
//! there and records an event after it, then returns: the caller's slice may be reused at
//! once and the host never waits for the stream. Regions are handed out in ring order,
//! aligned to [`STAGING_ALIGN`]; a region is reused only once the event recorded after its
//! copy has completed. The ring holds at least [`STAGING_DEPTH`] of the largest upload seen
//! (up to [`STAGING_MAX_BYTES`]), so a step's uploads wait only when the device is that many
//! uploads behind (backpressure, not a per-call wait), and once when the ring grows. Uploads
//! larger than [`STAGING_MAX_BYTES`]` / `[`STAGING_DEPTH`] are not staged ([`stages`]); the
//! backend copies them from pageable memory.

use super::{BackendResult, DevicePtr, HostAllocation};
use std::collections::VecDeque;

/// Largest ring.
pub(crate) const STAGING_MAX_BYTES: usize = 256 << 20;
/// The ring holds at least this many of the largest upload seen.
pub(crate) const STAGING_DEPTH: usize = 4;
/// Smallest ring.
pub(crate) const STAGING_MIN_BYTES: usize = 4 << 20;
/// Staged regions start on this boundary (keeps the DMA engine on its fast path).
pub(crate) const STAGING_ALIGN: usize = 256;
/// Retired regions are polled; beyond this many outstanding the oldest is waited for.
pub(crate) const STAGING_MAX_PENDING: usize = 4096;

/// Whether an upload of `len` bytes goes through the ring.
pub(crate) fn stages(len: usize) -> bool {
    len <= STAGING_MAX_BYTES / STAGING_DEPTH
}

/// Zeroed page-locked memory from `driver`, for a device backend's [`Backend::alloc_host`]
/// (`n` > 0; the backend's device current).
///
/// [`Backend::alloc_host`]: super::Backend::alloc_host
pub(crate) fn alloc_host<D: StagingDriver>(driver: &D, n: usize) -> BackendResult<HostAllocation> {
    let ptr = driver.alloc_pinned(n)?;
    // SAFETY: `ptr` is `n` writable bytes just allocated.
    unsafe { std::ptr::write_bytes(ptr, 0, n) };
    Ok(HostAllocation { ptr, bytes: n, pinned: true })
}

/// Return memory of [`alloc_host`] (or of `heap::alloc`, when not pinned). Errors cannot be
/// reported by [`Backend::free_host`]; a failure leaks the buffer.
///
/// # Safety
/// `a` came from one of them with this driver; no queued copy still uses it; the backend's
/// device is current when it is pinned.
///
/// [`Backend::free_host`]: super::Backend::free_host
pub(crate) unsafe fn free_host<D: StagingDriver>(driver: &D, a: HostAllocation) {
    if a.pinned {
        // SAFETY: the caller's contract: pinned memory of this driver, unused.
        let _ = unsafe { driver.free_pinned(a.ptr) };
    } else {
        // SAFETY: the caller's contract: from `heap::alloc`, unused.
        unsafe { super::heap::free(a) };
    }
}

/// The driver calls the ring makes. Every call happens with the backend's device current
/// (the backend binds it before touching the ring).
pub(crate) trait StagingDriver {
    /// `CUevent` / `hipEvent_t`.
    type Event: Copy;
    /// `CUstream` / `hipStream_t`.
    type Stream: Copy;

    /// `bytes` of pinned host memory.
    fn alloc_pinned(&self, bytes: usize) -> BackendResult<*mut u8>;

    /// Return pinned memory.
    ///
    /// # Safety
    /// `ptr` came from [`Self::alloc_pinned`] and no queued copy still reads it.
    unsafe fn free_pinned(&self, ptr: *mut u8) -> BackendResult<()>;

    /// A synchronisation-only event (no timing).
    fn create_event(&self) -> BackendResult<Self::Event>;

    /// # Safety
    /// `event` came from [`Self::create_event`] and is not used after.
    unsafe fn destroy_event(&self, event: Self::Event);

    /// Whether the work before `event`'s last record has completed (no wait). An error
    /// counts as "not yet": a later [`Self::wait_event`] reports it.
    ///
    /// # Safety
    /// `event` is live.
    unsafe fn event_done(&self, event: Self::Event) -> bool;

    /// Wait for the work before `event`'s last record.
    ///
    /// # Safety
    /// `event` is live.
    unsafe fn wait_event(&self, event: Self::Event) -> BackendResult<()>;

    /// Record `event` at the end of `stream`'s queue.
    ///
    /// # Safety
    /// `event` and `stream` are live.
    unsafe fn record(&self, event: Self::Event, stream: Self::Stream) -> BackendResult<()>;

    /// Queue a host-to-device copy of `len` bytes from pinned `src`.
    ///
    /// # Safety
    /// `src .. src + len` is pinned memory of this driver that stays untouched until the copy
    /// ran; `dst .. dst + len` lies in a live device allocation; `stream` is live.
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Self::Stream,
    ) -> BackendResult<()>;

    /// Wait for everything queued on `stream`.
    ///
    /// # Safety
    /// `stream` is live.
    unsafe fn sync_stream(&self, stream: Self::Stream) -> BackendResult<()>;
}

/// A region still being copied: `[start, end)` of the ring and the event recorded after it.
struct Pending<E> {
    start: usize,
    end: usize,
    event: E,
}

/// Pinned host memory uploads are staged through, reused as a ring. Owned by a backend
/// behind its mutex; released with [`StagingRing::release`] (the backend's `Drop`).
pub(crate) struct StagingRing<D: StagingDriver> {
    base: *mut u8,
    capacity: usize,
    head: usize,
    pending: VecDeque<Pending<D::Event>>,
    /// Retired events, reused.
    spare_events: Vec<D::Event>,
}

// SAFETY: the pinned buffer and the events are process-wide driver objects usable from any
// thread (with the device current, which every backend entry point ensures); the ring is
// only touched through `&mut`, i.e. under its owner's mutex.
unsafe impl<D: StagingDriver> Send for StagingRing<D> {}

impl<D: StagingDriver> Default for StagingRing<D> {
    fn default() -> Self {
        StagingRing {
            base: std::ptr::null_mut(),
            capacity: 0,
            head: 0,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        }
    }
}

impl<D: StagingDriver> StagingRing<D> {
    /// Stage `src` and queue its copy to `dst` on `stream`; returns without waiting for the
    /// stream (unless the device is a whole ring behind). `src.len()` must pass [`stages`].
    ///
    /// # Safety
    /// `dst .. dst + src.len()` lies in a live device allocation of `driver`'s backend and
    /// `stream` is live.
    pub(crate) unsafe fn upload(
        &mut self,
        driver: &D,
        dst: DevicePtr,
        src: &[u8],
        stream: D::Stream,
    ) -> BackendResult<()> {
        debug_assert!(stages(src.len()));
        // Cannot overflow: `src.len() <= STAGING_MAX_BYTES / STAGING_DEPTH`.
        if src.len() * STAGING_DEPTH > self.capacity {
            self.grow(driver, src.len())?;
        }
        let len = src.len().div_ceil(STAGING_ALIGN) * STAGING_ALIGN;
        let mut start = self.head;
        if start + len > self.capacity {
            start = 0;
        }
        self.reclaim(driver, start, len)?;
        // SAFETY: `[start, start+len)` lies in the pinned buffer (len <= capacity/DEPTH
        // rounded up to the alignment, which divides the capacity) and no pending copy reads it.
        let staged = unsafe { self.base.add(start) };
        // SAFETY: as above; `src` is a live host slice, disjoint from pinned memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), staged, src.len()) };
        let event = self.event(driver)?;
        // SAFETY: the staged bytes stay untouched until `event` completes (reclaim checks
        // it); `dst` and `stream` are the caller's contract.
        if let Err(e) = unsafe { driver.copy_to_device(dst, staged, src.len(), stream) } {
            self.spare_events.push(event);
            return Err(e);
        }
        // SAFETY: a live event and stream.
        if let Err(e) = unsafe { driver.record(event, stream) } {
            // The copy is queued but nothing marks its end: wait for it, so the region may
            // be reused, then report the failure.
            // SAFETY: the caller's live stream.
            let _ = unsafe { driver.sync_stream(stream) };
            self.spare_events.push(event);
            return Err(e);
        }
        self.pending.push_back(Pending { start, end: start + len, event });
        self.head = start + len;
        Ok(())
    }

    /// Make `[start, start+len)` free: retire finished copies, wait for overlapping ones.
    fn reclaim(&mut self, driver: &D, start: usize, len: usize) -> BackendResult<()> {
        let end = start.saturating_add(len);
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let (s, e, ev) = (p.start, p.end, p.event);
            let overlaps = s < end && start < e;
            // SAFETY: `ev` is a live event this ring created and recorded.
            let done = unsafe { driver.event_done(ev) };
            let too_many = i == 0 && self.pending.len() > STAGING_MAX_PENDING;
            if done || overlaps || too_many {
                if !done {
                    // SAFETY: as above. Only reached when the ring has wrapped onto a region
                    // still being copied, i.e. the device is a whole ring behind.
                    unsafe { driver.wait_event(ev) }?;
                }
                self.pending.remove(i);
                self.spare_events.push(ev);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Grow to hold `STAGING_DEPTH` uploads of `len` bytes, after every outstanding copy from
    /// the old buffer finished.
    fn grow(&mut self, driver: &D, len: usize) -> BackendResult<()> {
        let capacity = (STAGING_DEPTH * len).next_power_of_two().clamp(STAGING_MIN_BYTES, STAGING_MAX_BYTES);
        self.reclaim(driver, 0, usize::MAX / 2)?;
        if !self.base.is_null() {
            // SAFETY: every copy that read the old buffer has completed (reclaim waited).
            unsafe { driver.free_pinned(self.base) }?;
            self.base = std::ptr::null_mut();
            self.capacity = 0;
        }
        self.base = driver.alloc_pinned(capacity)?;
        self.capacity = capacity;
        self.head = 0;
        Ok(())
    }

    fn event(&mut self, driver: &D) -> BackendResult<D::Event> {
        match self.spare_events.pop() {
            Some(ev) => Ok(ev),
            None => driver.create_event(),
        }
    }

    /// Wait for every staged copy, then free the events and the pinned buffer. Errors are
    /// ignored: this runs in the owner's `Drop`, where the worst case is a leak.
    pub(crate) fn release(&mut self, driver: &D) {
        for p in self.pending.drain(..) {
            // SAFETY: live events of this ring, destroyed once, after their copy finished.
            unsafe {
                let _ = driver.wait_event(p.event);
                driver.destroy_event(p.event);
            }
        }
        for ev in self.spare_events.drain(..) {
            // SAFETY: a retired event of this ring; nothing waits on it.
            unsafe { driver.destroy_event(ev) };
        }
        if !self.base.is_null() {
            // SAFETY: every copy reading the buffer completed above.
            let _ = unsafe { driver.free_pinned(self.base) };
            self.base = std::ptr::null_mut();
            self.capacity = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    //! The ring's bookkeeping against a fake driver whose "device" is a byte vector and whose
    //! copies complete only when the test says so.
    use super::*;
    use std::cell::RefCell;

    #[derive(Default)]
    struct Fake {
        /// Copies queued and not yet run: (dst, bytes read at queue time are NOT taken; the
        /// source pointer is read when the copy runs, as a DMA engine would).
        queued: RefCell<Vec<(u64, *const u8, usize, usize)>>,
        /// Events: recorded after copy number `n`; complete when `ran >= n`.
        events: RefCell<Vec<Option<usize>>>,
        ran: RefCell<usize>,
        device: RefCell<Vec<u8>>,
        buffers: RefCell<Vec<Vec<u64>>>,
        waits: RefCell<usize>,
    }

    impl Fake {
        fn run_all(&self) {
            let q: Vec<_> = self.queued.borrow_mut().drain(..).collect();
            for (dst, src, len, n) in q {
                // SAFETY: the ring promises the pinned source is untouched until the copy ran.
                let bytes = unsafe { std::slice::from_raw_parts(src, len) };
                self.device.borrow_mut()[dst as usize..dst as usize + len].copy_from_slice(bytes);
                *self.ran.borrow_mut() = n;
            }
        }
    }

    impl StagingDriver for Fake {
        type Event = usize;
        type Stream = ();
        fn alloc_pinned(&self, bytes: usize) -> BackendResult<*mut u8> {
            let mut v = vec![0u64; bytes / 8];
            let p = v.as_mut_ptr().cast();
            self.buffers.borrow_mut().push(v);
            Ok(p)
        }
        unsafe fn free_pinned(&self, ptr: *mut u8) -> BackendResult<()> {
            assert!(self.queued.borrow().iter().all(|q| {
                let b = self.buffers.borrow();
                let owner = b.iter().find(|v| v.as_ptr().cast::<u8>() == ptr.cast_const()).unwrap();
                let range = owner.as_ptr_range();
                !(range.start.cast::<u8>() <= q.1 && q.1 < range.end.cast::<u8>())
            }));
            self.buffers.borrow_mut().retain(|v| v.as_ptr().cast::<u8>() != ptr.cast_const());
            Ok(())
        }
        fn create_event(&self) -> BackendResult<usize> {
            self.events.borrow_mut().push(None);
            Ok(self.events.borrow().len() - 1)
        }
        unsafe fn destroy_event(&self, _: usize) {}
        unsafe fn event_done(&self, e: usize) -> bool {
            self.events.borrow()[e].is_none_or(|n| *self.ran.borrow() >= n)
        }
        unsafe fn wait_event(&self, _: usize) -> BackendResult<()> {
            *self.waits.borrow_mut() += 1;
            self.run_all();
            Ok(())
        }
        unsafe fn record(&self, e: usize, _: ()) -> BackendResult<()> {
            let n = self.queued.borrow().last().map_or(*self.ran.borrow(), |q| q.3);
            self.events.borrow_mut()[e] = Some(n);
            Ok(())
        }
        unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize, _: ()) -> BackendResult<()> {
            let n = self.queued.borrow().last().map_or(*self.ran.borrow(), |q| q.3) + 1;
            self.queued.borrow_mut().push((dst, src, len, n));
            Ok(())
        }
        unsafe fn sync_stream(&self, _: ()) -> BackendResult<()> {
            self.run_all();
            Ok(())
        }
    }

    #[test]
    // 40 MiB of random bytes: minutes under Miri, and the ring is device code, not a host path.
    #[cfg_attr(miri, ignore)]
    fn staged_bytes_survive_until_their_copy_runs() {
        let fake = Fake::default();
        let upload = 1 << 20;
        fake.device.borrow_mut().resize(64 * upload, 0);
        let mut ring = StagingRing::<Fake>::default();
        let mut want = vec![0u8; 64 * upload];
        let mut rng = crate::rng::Rng::new(0x9e37_79b9);
        // 40 uploads of 1 MiB into a 4 MiB ring with nothing run: the ring must wrap onto
        // regions still queued and wait for them instead of overwriting their bytes.
        for i in 0..40usize {
            let data = rng.bytes(upload - 3 * i);
            let dst = (i % 64) * upload;
            want[dst..dst + data.len()].copy_from_slice(&data);
            // SAFETY: the fake device holds every destination range.
            unsafe { ring.upload(&fake, dst as u64, &data, ()).unwrap() };
        }
        assert!(*fake.waits.borrow() > 0, "a 4-deep ring of 40 uploads never waited");
        fake.run_all();
        assert_eq!(*fake.device.borrow(), want);
        ring.release(&fake);
        assert!(fake.buffers.borrow().is_empty());
    }
}
