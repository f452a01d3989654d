//! The transfer interface: what a byte mover between two pools must offer, shaped so another
//! engine (NIXL, Mooncake Transfer Engine) can implement it. Both of those libraries work the
//! same way: memory is **registered** once (address, length), a transfer is a **list of
//! (src, dst, len) spans** posted in one call, and completion is **polled**. Spans name
//! registered regions plus offsets, so an engine validates every byte it moves against what
//! was registered: posting is safe, registering a raw address is `unsafe`.
//!
//! Spans go from a `Local` region (the initiator's memory) to a `Remote` one (the peer's, as
//! its exported metadata describes it): a one-sided write, which is how a prefill worker
//! pushes KV to a decode worker. [`coalesce`] merges abutting spans so a request moves as a
//! few large copies — per-block descriptors of a few KiB run at a fraction of the link.

use crate::backend::{Backend, BackendError, Stream};
use std::collections::BTreeMap;
use std::sync::Arc;
use thiserror::Error;

/// Which end of a transfer a registered region belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// The initiator's memory: spans read from it.
    Local,
    /// The peer's memory: spans write into it.
    Remote,
}

/// A registered range: `len` bytes from `addr`, cut into items of `item_len` bytes (the unit
/// a peer indexes, e.g. one block's envelope). The same triple a NIXL or Mooncake
/// registration takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemRegion {
    /// First byte (a device address on device backends).
    pub addr: u64,
    /// Bytes registered.
    pub len: u64,
    /// Bytes per item (informational for engines that register by item).
    pub item_len: u64,
}

/// A registered region's id, from [`TransferEngine::register`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

/// One copy: `len` bytes from `src_off` in region `src` (local) to `dst_off` in region `dst`
/// (remote).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Span {
    /// Local region read.
    pub src: RegionId,
    /// Remote region written.
    pub dst: RegionId,
    /// Offset in `src`.
    pub src_off: u64,
    /// Offset in `dst`.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

/// A posted transfer, to poll.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferTicket(pub u64);

crate::variant::variant_names! {
/// What an engine refuses or fails with.
#[derive(Debug, Error)]
pub enum EngineError {
    /// A span names a region that is not registered.
    #[error("region {0:?} is not registered")]
    UnknownRegion(RegionId),
    /// A span reads a remote region or writes a local one.
    #[error("span reads {src:?} memory and writes {dst:?} memory; spans go local → remote")]
    WrongSide {
        /// Side of the span's source region.
        src: Side,
        /// Side of the span's destination region.
        dst: Side,
    },
    /// A span leaves its region.
    #[error("bytes {off}..{off}+{len} outside region {region:?} of {region_len} bytes")]
    OutOfRegion {
        /// The region.
        region: RegionId,
        /// Span offset.
        off: u64,
        /// Span length.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// Two destination ranges of one post overlap (the result would depend on order).
    #[error("destination bytes of two spans overlap at {addr:#x}")]
    Overlap {
        /// First overlapping address.
        addr: u64,
    },
    /// A ticket this engine never handed out (or already completed and forgotten).
    #[error("unknown ticket {0:?}")]
    UnknownTicket(TransferTicket),
    /// A handshake message longer than the engine carries.
    #[error("handshake message of {len} bytes exceeds {max}")]
    MessageTooLong {
        /// Message bytes.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A device backend call failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The NCCL library is not present (or lacks a symbol); nothing was attempted.
    #[error("NCCL unavailable: {0}")]
    NcclUnavailable(String),
    /// An NCCL or driver call failed.
    #[error("{call} failed: {message}")]
    Nccl {
        /// The failing call.
        call: &'static str,
        /// Its error text.
        message: String,
    },
    /// The NIXL C API library is not present (or lacks a symbol, or is the stub build);
    /// nothing was attempted.
    #[error("NIXL unavailable: {0}")]
    NixlUnavailable(String),
    /// A NIXL call failed (or a transfer did not complete in time).
    #[error("{call} failed: {message}")]
    Nixl {
        /// The failing call.
        call: &'static str,
        /// Its status and what it means.
        message: String,
    },
    /// A peer's NIXL metadata that is not a whole blob of the pinned format (cut short,
    /// padded, a length that runs past its end): refused before NIXL reads any of it.
    #[error("peer metadata refused: {reason} (at byte {at} of {len})")]
    NixlMetadata {
        /// What is wrong.
        reason: &'static str,
        /// Where in the blob.
        at: usize,
        /// The blob's length.
        len: usize,
    },
}
}

/// A byte mover between two pools' memories. See the module docs.
pub trait TransferEngine {
    /// A short name for reports ("local", "nccl").
    fn name(&self) -> &'static str;

    /// Register `region` on `side`.
    ///
    /// # Safety
    /// `region.addr .. region.addr + region.len` must be live memory of that side's device,
    /// and stay live and not be freed until [`TransferEngine::deregister`] (or the engine is
    /// dropped); no other code may write it while a posted transfer touching it is pending.
    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError>;

    /// Forget a registration.
    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError>;

    /// Deliver each side's handshake bytes to the other side before any KV byte moves.
    /// Returns `(what the remote side received, what the local side received)`.
    fn exchange(&mut self, local_msg: &[u8], remote_msg: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError>;

    /// Queue every span (validated against the registrations first: nothing is queued when
    /// one is bad).
    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError>;

    /// Whether the transfer has completed (its bytes are in place on the remote side).
    fn poll(&mut self, ticket: TransferTicket) -> Result<bool, EngineError>;

    /// Poll until complete.
    fn wait(&mut self, ticket: TransferTicket) -> Result<(), EngineError> {
        while !self.poll(ticket)? {
            std::thread::yield_now();
        }
        Ok(())
    }
}

/// Sort spans and merge each into the previous when both its source and destination start
/// where the previous ended in the same regions. Returns the merged list (same bytes).
pub fn coalesce(spans: &[Span]) -> Vec<Span> {
    let mut sorted = spans.to_vec();
    sorted.retain(|s| s.len > 0);
    sorted.sort_unstable();
    let mut out: Vec<Span> = Vec::with_capacity(sorted.len());
    for s in sorted {
        if let Some(last) = out.last_mut() {
            if last.src == s.src
                && last.dst == s.dst
                && last.src_off + last.len == s.src_off
                && last.dst_off + last.len == s.dst_off
            {
                last.len += s.len;
                continue;
            }
        }
        out.push(s);
    }
    out
}

/// Registered regions, by id, with their sides; the checks every engine runs on a post.
#[derive(Debug, Default)]
pub struct Registry {
    next: u32,
    regions: BTreeMap<RegionId, (Side, MemRegion)>,
}

impl Registry {
    /// Record a region; returns its id.
    pub fn insert(&mut self, side: Side, region: MemRegion) -> RegionId {
        let id = RegionId(self.next);
        self.next += 1;
        self.regions.insert(id, (side, region));
        id
    }

    /// Forget a region.
    pub fn remove(&mut self, id: RegionId) -> Result<(), EngineError> {
        self.regions.remove(&id).map(|_| ()).ok_or(EngineError::UnknownRegion(id))
    }

    /// The side and region of `id`.
    pub fn get(&self, id: RegionId) -> Result<(Side, MemRegion), EngineError> {
        self.regions.get(&id).copied().ok_or(EngineError::UnknownRegion(id))
    }

    /// Absolute `(src, dst, len)` of every span, after checking sides, bounds, and that no
    /// two destination ranges overlap.
    pub fn resolve(&self, spans: &[Span]) -> Result<Vec<(u64, u64, u64)>, EngineError> {
        let mut out = Vec::with_capacity(spans.len());
        for s in spans {
            let (ss, sr) = self.get(s.src)?;
            let (ds, dr) = self.get(s.dst)?;
            if (ss, ds) != (Side::Local, Side::Remote) {
                return Err(EngineError::WrongSide { src: ss, dst: ds });
            }
            for (id, r, off) in [(s.src, sr, s.src_off), (s.dst, dr, s.dst_off)] {
                if off.checked_add(s.len).is_none_or(|end| end > r.len) {
                    return Err(EngineError::OutOfRegion { region: id, off, len: s.len, region_len: r.len });
                }
            }
            out.push((sr.addr + s.src_off, dr.addr + s.dst_off, s.len));
        }
        let mut dsts: Vec<(u64, u64)> = out.iter().filter(|r| r.2 > 0).map(|r| (r.1, r.2)).collect();
        dsts.sort_unstable();
        for w in dsts.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(EngineError::Overlap { addr: w[1].0 });
            }
        }
        // No span may read bytes another span writes (local and remote regions registered
        // over the same memory): the result would depend on the order of the copies.
        for &(src, _, len) in out.iter().filter(|r| r.2 > 0) {
            let i = dsts.partition_point(|d| d.0 + d.1 <= src);
            if dsts.get(i).is_some_and(|d| d.0 < src + len) {
                return Err(EngineError::Overlap { addr: dsts[i].0.max(src) });
            }
        }
        Ok(out)
    }
}

/// Bytes staged through host memory at a time between two different backends.
const STAGING_PIECE: u64 = 64 << 20;

/// Two pools in one process: spans become the backend's own copies. With one backend on
/// both sides (the host backend, or two pools on one GPU) each span is one
/// [`Backend::copy`] on the remote side's stream; with two different backends each span is
/// staged through host memory (download, upload). `poll` waits for the remote stream.
#[derive(Debug)]
pub struct LocalEngine {
    local: Arc<dyn Backend>,
    remote: Arc<dyn Backend>,
    stream: Stream,
    registry: Registry,
    next_ticket: u64,
    pending: Option<TransferTicket>,
}

impl LocalEngine {
    /// An engine reading memory of `local` and writing memory of `remote`, queueing copies on
    /// the remote backend's `stream`. The caller orders the local side's earlier writes
    /// before a post (the handoff synchronises the sender's stream first).
    pub fn new(local: Arc<dyn Backend>, remote: Arc<dyn Backend>, stream: Stream) -> LocalEngine {
        LocalEngine { local, remote, stream, registry: Registry::default(), next_ticket: 0, pending: None }
    }
}

impl TransferEngine for LocalEngine {
    fn name(&self) -> &'static str {
        "local"
    }

    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError> {
        Ok(self.registry.insert(side, region))
    }

    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError> {
        self.registry.remove(id)
    }

    fn exchange(&mut self, local_msg: &[u8], remote_msg: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        Ok((local_msg.to_vec(), remote_msg.to_vec()))
    }

    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError> {
        let resolved = self.registry.resolve(spans)?;
        let same = Arc::ptr_eq(&self.local, &self.remote);
        let mut staging = Vec::new();
        for (src, dst, len) in resolved {
            if same {
                // SAFETY: both ranges lie in registered regions (checked by `resolve`), which the
                // registrant promised are live memory of this backend; destinations do not
                // overlap each other, and local and remote regions are different memory.
                unsafe { self.remote.copy(dst, src, len, self.stream)? };
            } else {
                // Staged in pieces so a large span needs no buffer of its size.
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(STAGING_PIECE);
                    staging.resize(n as usize, 0);
                    // SAFETY: as above; the download waits for the local stream's earlier work
                    // and the upload returns once `staging` may be reused.
                    unsafe {
                        self.local.download(&mut staging, src + done, Stream::DEFAULT)?;
                        self.remote.upload(dst + done, &staging, self.stream)?;
                    }
                    done += n;
                }
            }
        }
        let t = TransferTicket(self.next_ticket);
        self.next_ticket += 1;
        self.pending = Some(t);
        Ok(t)
    }

    fn poll(&mut self, ticket: TransferTicket) -> Result<bool, EngineError> {
        if ticket.0 >= self.next_ticket {
            return Err(EngineError::UnknownTicket(ticket));
        }
        if self.pending.is_some_and(|p| p.0 >= ticket.0) {
            self.remote.synchronize(self.stream)?;
            self.pending = None;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(src: u32, dst: u32, so: u64, d: u64, len: u64) -> Span {
        Span { src: RegionId(src), dst: RegionId(dst), src_off: so, dst_off: d, len }
    }

    #[test]
    fn coalesce_merges_only_when_both_sides_abut() {
        let spans = [
            span(0, 1, 200, 100, 100),
            span(0, 1, 0, 0, 100),
            span(0, 1, 100, 50, 50),
            span(0, 2, 100, 100, 0),
        ];
        // (0→0,100) and (100→50,50) abut on both sides? src 0+100=100 ✓, dst 0+100≠50 ✗.
        assert_eq!(
            coalesce(&spans),
            vec![span(0, 1, 0, 0, 100), span(0, 1, 100, 50, 50), span(0, 1, 200, 100, 100)]
        );
        let spans = [span(0, 1, 64, 64, 64), span(0, 1, 0, 0, 64), span(0, 1, 128, 128, 1)];
        assert_eq!(coalesce(&spans), vec![span(0, 1, 0, 0, 129)]);
        assert_eq!(coalesce(&[]), vec![]);
    }

    #[test]
    fn registry_checks_sides_bounds_and_overlap() {
        let mut r = Registry::default();
        let a = r.insert(Side::Local, MemRegion { addr: 1000, len: 100, item_len: 10 });
        let b = r.insert(Side::Remote, MemRegion { addr: 5000, len: 100, item_len: 10 });
        let ok = Span { src: a, dst: b, src_off: 10, dst_off: 20, len: 80 };
        assert_eq!(r.resolve(&[ok]).unwrap(), vec![(1010, 5020, 80)]);
        assert!(matches!(r.resolve(&[Span { len: 81, ..ok }]), Err(EngineError::OutOfRegion { .. })));
        assert!(matches!(
            r.resolve(&[Span { src_off: u64::MAX, ..ok }]),
            Err(EngineError::OutOfRegion { .. })
        ));
        assert!(matches!(r.resolve(&[Span { src: b, dst: a, ..ok }]), Err(EngineError::WrongSide { .. })));
        let twice = [Span { len: 10, ..ok }, Span { src_off: 50, dst_off: 25, len: 10, ..ok }];
        assert!(matches!(r.resolve(&twice), Err(EngineError::Overlap { addr: 5025 })));
        // A remote region over the local one's memory: a span reading what another writes.
        let alias = r.insert(Side::Remote, MemRegion { addr: 1000, len: 100, item_len: 10 });
        let a_to_alias = Span { src: a, dst: alias, src_off: 0, dst_off: 50, len: 10 };
        let reads_written = Span { src: a, dst: b, src_off: 45, dst_off: 0, len: 10 };
        assert!(matches!(r.resolve(&[a_to_alias, reads_written]), Err(EngineError::Overlap { addr: 1050 })));
        assert!(r.resolve(&[a_to_alias, Span { src_off: 60, ..reads_written }]).is_ok());
        r.remove(a).unwrap();
        assert!(matches!(r.resolve(&[ok]), Err(EngineError::UnknownRegion(RegionId(0)))));
        assert!(r.remove(a).is_err());
    }
}
