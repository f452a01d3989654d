//! Moving a request's KV between pools, and out of HBM.
//!
//! * [`regions`] — the PD / offload transfer regions of `pool-runtime.md` §7 (what a KV
//!   connector registers), exportable as `(address, length, item length)`.
//! * [`engine`] — the [`TransferEngine`] interface another transfer library (NIXL, Mooncake)
//!   can implement: register regions, post a list of `(src, dst, len)` spans, poll; span
//!   coalescing; the in-process [`LocalEngine`].
//! * [`handoff`](mod@handoff) — prefill → decode handoff of one request between two pools: layout ids
//!   compared first, the receiver's blocks and slot reserved all-or-nothing, the request's
//!   blocks and whole slot sent as a few coalesced spans, the request rebound on the receiver.
//! * [`nccl`] — the two-GPU engine over NCCL, loaded at run time.
//! * [`nixl`] — the engine over NIXL (UCX: RDMA, TCP, shared memory, CUDA copies), its C API
//!   loaded at run time; two agents in one process, or an initiator writing to another
//!   process's agent.
//! * [`nixl_file`] — the shared tier's bytes through NIXL's POSIX plugin ([`NixlPosix`], a
//!   [`TierIo`]).
//! * [`host_tier`] — a host-memory (pinned on CUDA) tier that cached blocks and checkpoint
//!   units spill to instead of being dropped, LRU within a byte budget.
//! * [`shared_tier`] — a tier of files in a directory every engine of a fleet mounts, keyed
//!   by block hash and layout id, checked on every read, LRU by mtime across processes.
//! * [`store_tier`] — the same entries in a key-value store ([`KvStore`]: Mooncake Store
//!   through the Python layer), checked by the same code.
//! * [`entry_dir`] / [`entry_store`] — whole checksummed entries of an engine that owns its
//!   KV layout (vLLM's connector): files (through a [`TierIo`]: `std::fs` or NIXL POSIX) or
//!   a [`KvStore`].

#![warn(missing_docs)]

pub mod engine;
pub mod entry_dir;
pub mod entry_store;
pub mod handoff;
pub mod host_tier;
pub mod nccl;
pub mod nixl;
pub mod nixl_file;
pub mod shared_tier;
pub mod store_tier;
mod tier_files;
/// The regions are pool code (computed from the carved geometry, under the pool); re-exported
/// here, where connectors look for them.
pub use crate::pool::regions;

pub use engine::{coalesce, LocalEngine, MemRegion, RegionId, Span, TransferEngine, TransferTicket};
pub use handoff::{handoff, Endpoint, HandoffError, HandoffPlan, Rebound, RequestKv, WireShape};
pub use host_tier::{HostTier, HostTierError};
pub use nixl_file::NixlPosix;
pub use regions::*;
pub use shared_tier::{
    EntryKind, SharedKey, SharedTier, SharedTierConfig, SharedTierStats, StdFs, TierIo, TierReader,
};
pub use store_tier::{KvStore, StoreTier};

impl TransferRegion {
    /// The region as a transfer library registers it: absolute address, length and item
    /// length, given the base addresses of the plane allocation and of the indexer.
    pub fn export(&self, planes_base: u64, indexer_base: u64) -> MemRegion {
        let base = match self.alloc {
            Alloc::Planes => planes_base,
            Alloc::Indexer => indexer_base,
        };
        MemRegion { addr: base + self.base, len: self.total_bytes, item_len: self.unit_bytes }
    }
}

/// The §7 regions of `pool` at its current split, exported as `(role, (address, length,
/// item length))` for an engine's own registration: block regions, then slot regions.
/// Re-export after every boundary move (the slot base moves with the split).
pub fn exported_regions(
    pool: &crate::pool::Pool,
    config: &TransferConfig,
) -> Result<Vec<(String, MemRegion)>, crate::pool::PoolError> {
    let r = pool.transfer_regions(config)?;
    let (planes, indexer) = (pool.plane_ptr(0)?, pool.indexer_ptr().unwrap_or(0));
    Ok(r.block_regions
        .iter()
        .chain(&r.slot_regions)
        .map(|x| (x.role.clone(), x.export(planes, indexer)))
        .collect())
}
