//! What an engine uses, in one import: `use v4pool::prelude::*;`.
//!
//! The path an engine walks, in order (`docs/integration.md` maps each engine call): plan a pool for a byte budget
//! ([`plan`], [`PlanRequest`], [`ModelShape`], [`KvDtype`]), put it on a backend
//! ([`Pool`], [`PoolSpec`], [`HostBackend`] or [`BackendChoice`] with `backend::select`,
//! [`ExternalRegion`] for the engine's own allocation, [`Stream`]), schedule requests over it
//! ([`KvManager`], [`ManagerConfig`], the split policies, the block hashes), and run each
//! step's index work ([`DecodePath`] / [`PrefillPath`] with their capacities and sequences,
//! [`KvRowWriter`], [`StateUpdate`], [`WindowGather`], [`WriteBatch`]), reading the pool
//! through its views. Every error type those calls return is here, with [`VariantName`].
//!
//! Everything else stays in its module (the geometry's formulas, transfer engines, the
//! simulator) or under [`raw`](crate::raw) (the allocators, kernel argument structs and host
//! reference kernels, launch plumbing): reachable, but not what an engine needs to name.

// Planning: model facts, the budget, the row format.
pub use crate::format::RowFormat;
pub use crate::model::{ModelError, ModelShape};
pub use crate::sizing::{plan, IndexerDtype, KvDtype, Plan, PlanRequest, SizingError};

// The pool on a backend.
pub use crate::backend::external::ExternalRegion;
pub use crate::backend::host::HostBackend;
pub use crate::backend::{Backend, BackendChoice, BackendError, BackendKind, DevicePtr, Launch, Stream};
pub use crate::geometry::{Class, GeometryError};
pub use crate::pool::{
    BlockHandle, IndexerView, LayerView, PageView, Pool, PoolCounts, PoolError, PoolSpec, SlotHandle,
    SlotLease,
};

// The scheduler: requests over the pool.
pub use crate::manager::{
    block_hash, chain_hashes, Admission, BlockHash, ElasticPolicy, FixedPolicy, KvEvent, KvManager,
    ManagerConfig, ManagerError, ManagerStats, Namespace, RequestId, SplitPolicy,
};

// A step's index work: decode and prefill paths, row writes, compressor state, draft window.
pub use crate::pool::{
    CompressedRow, CsaTopk, DecodeBuffer, DecodeCapacity, DecodeError, DecodePath, DecodeSeq,
    FlashMlaBuffers, KvRowWriter, PrefillCapacity, PrefillPath, PrefillSeq, RowWriteCapacity, RowWriteError,
    TopkError, WriteBatch, WriteBatchError,
};
pub use crate::state::gather::{GatherCapacity, GatherError, GatherSeq, WindowGather};
pub use crate::state::update::{
    Compressor, ElemType, StateInputs, StateSeq, StateUpdate, StateUpdateCapacity, StateUpdateError,
};

// Moving a request's KV between engines.
// (`handoff` names both a module and its function in `transfer`: the function only.)
pub use crate::transfer::handoff::{handoff, HandoffError, RequestKv};
pub use crate::transfer::{TransferEngine, TransferError};

pub use crate::VariantName;
