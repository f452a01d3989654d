//! v4pool — the KV-memory runtime a DeepSeek-V4 serving engine embeds.
//!
//! Read `ARCHITECTURE.md` first. The layers, bottom up:
//!
//! * [`geometry`] — the row space: every address formula, pure integer code, no devices.
//! * [`model`] — DeepSeek-V4 facts: ratio lists, ring sizes, `config.json` parsing.
//! * [`arena`] — the compressor-state fields and where they sit in a slot.
//! * [`sizing`] — a byte budget becomes block and slot counts at a fixed plane capacity.
//! * [`alloc`] — block and slot allocators with generation-checked handles; no kernels.
//! * [`boundary`] — the elastic block/slot boundary: grow, shrink, relocate.
//! * [`index`] — the kernel contract: by-value launch arguments shared with `kernels/`,
//!   and the host reference of every kernel.
//! * [`backend`] — one `Backend` trait; host (always), CUDA and HIP (loaded at run time).
//! * [`pool`] — the planes on a backend, per-layer views, slot state, checkpoints, transfers.
//! * [`manager`] — the request-level KV manager: content-addressed blocks, checkpoint
//!   store, admission with a hit, the elastic split policy.
//! * [`events`] — KV events for routers: the manager's block events published in vLLM's
//!   ZeroMQ / MessagePack format (libzmq loaded at run time).
//! * [`sim`] — the simulator: a pool driven as a serving engine would, and the shared
//!   workload generator. The `v4pool` command (`src/bin/v4pool/`) renders it.
//! * [`plan_report`] — a plan with its checkpoint facts and its JSON form (CLI and bindings).
//! * [`VariantName`] ([`variant`]) — the name of an error's variant, implemented by every
//!   error type; the bindings (`bindings`, features `python` and `capi`) report errors by it.

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod alloc;
pub mod arena;
pub mod backend;
pub mod boundary;
mod checked;
pub mod checkpoint;
pub mod events;
pub mod file;
pub mod format;
pub mod geometry;
pub mod index;
pub mod kernels;
pub mod manager;
pub mod model;
pub mod plan_report;
pub mod pool;
pub mod prelude;
pub mod profiling;
mod rng;
mod setters;
pub mod sim;
pub mod sizing;
pub mod state;
pub mod transfer;
pub mod variant;

#[cfg(any(feature = "capi", feature = "python"))]
pub mod bindings;

pub use variant::VariantName;

pub use geometry::{
    Class, ClassLayout, GeometryError, GeometrySpec, UnifiedPoolGeometry, WindowParams, ABSENT_RATIO,
    CSA_RATIO, DENSE_RATIO, HCA_RATIO,
};
