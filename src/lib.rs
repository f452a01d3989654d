//! v4pool — the KV-memory runtime a DeepSeek-V4 serving engine embeds.
//!
//! What an engine uses is at the crate root and in [`prelude`] (`use v4pool::prelude::*;`),
//! the modules below hold the rest of each layer's API, and [`raw`] holds the layers under
//! them. Read `ARCHITECTURE.md` for the layers and their invariants. Bottom up:
//!
//! * [`geometry`] — the row space: every address formula, pure integer code, no devices.
//! * [`format`](mod@format) — every KV row format, described once, with its host packer and unpacker.
//! * [`model`] — DeepSeek-V4 facts: ratio lists, ring sizes, `config.json` parsing.
//! * [`sizing`] — a byte budget becomes block and slot counts at a fixed plane capacity.
//! * [`checkpoint`] — a slot's image and the layout id every image carries.
//! * [`plan_report`] — a plan with its checkpoint facts and its JSON form (CLI and bindings).
//! * [`backend`] — one `Backend` trait; host (always), CUDA and HIP (loaded at run time).
//! * [`pool`] — the planes on a backend, per-layer views, slot state, checkpoints, the
//!   decode and prefill paths.
//! * [`state`] — the compressor-state update and the draft window gather.
//! * [`transfer`] — moving a request's KV between pools and out of HBM (handoff, tiers).
//! * [`manager`] — the request-level KV manager: content-addressed blocks, checkpoint
//!   store, admission with a hit, the elastic split policy.
//! * [`events`] — KV events for routers: the manager's block events published in vLLM's
//!   ZeroMQ / MessagePack format (libzmq loaded at run time).
//! * [`sim`] — the simulator: a pool driven as a serving engine would, and the shared
//!   workload generator. The `v4pool` command (`src/bin/v4pool/`) renders it.
//! * [`raw`] — the low-level layers, for backends, benches, tests and tools: the kernel
//!   contract (`#[repr(C)]` launch arguments) and the host reference of every kernel, launch
//!   plumbing, kernel images, allocators, arena layout, boundary moves, the simulator's
//!   internals. No engine needs it; it may change shape in any 0.x release.
//! * [`VariantName`] — the name of an error's variant, implemented by every error type; the
//!   bindings (`bindings`, features `python` and `capi`) report errors by it.

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod alloc;
mod arena;
pub mod backend;
mod boundary;
mod checked;
pub mod checkpoint;
mod dylib;
pub mod events;
mod file;
pub mod format;
pub mod geometry;
mod index;
mod kernels;
pub mod manager;
pub mod model;
pub mod plan_report;
pub mod pool;
pub mod prelude;
mod profiling;
pub mod raw;
mod rng;
mod setters;
pub mod sim;
pub mod sizing;
pub mod state;
pub mod transfer;
mod variant;

#[cfg(any(feature = "capi", feature = "python"))]
pub mod bindings;

pub use variant::VariantName;

pub use geometry::{
    Class, ClassLayout, GeometryError, GeometrySpec, UnifiedPoolGeometry, WindowParams, ABSENT_RATIO,
    CSA_RATIO, DENSE_RATIO, HCA_RATIO,
};
