//! `Pool`: the planes on a backend, per-layer views, slot state, checkpoints, transfers,
//! and the persistent index buffers.

pub mod decode;

pub use decode::{decode_slice_lens, DecodeCapacity, DecodeError, DecodeIndexBuffers, DecodeSeq};
