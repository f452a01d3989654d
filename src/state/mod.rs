//! The pool's own state kernels (`index-buffers.md` §8 and §9): the writes and reads of a
//! request's compressor state and window ring that only the pool can address, because only it
//! knows where a slot lives, the arena's field offsets and the slot stride.
//!
//! * [`update`]: compressor-state update (§8) — per compressor, per forward, the last K tokens'
//!   kv and score rows into the slot's state ring, score plus the positional bias.
//! * [`gather`]: DSpark window gather (§9) — a dense `[B, Wd, D]` draft window materialised
//!   from a slot's ring (the fp8 variant reads both planes and dequantises NoPE).
//!
//! Both take slot leases, not raw positions, stage their plans in O(tokens) into persistent
//! device buffers (graph-capture safe: no host sync at launch), form every address in 64 bits,
//! and reject bad input with a typed error before any launch.

pub mod gather;
pub mod inputs;
pub mod update;
