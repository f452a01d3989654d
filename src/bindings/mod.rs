//! The bindings: the room over the library where Python (`python`, feature `python`, built by
//! maturin) and C (`capi`, feature `capi`, header `include/v4pool.h`) callers come in.
//!
//! They only translate: a foreign argument is checked (device, dtype, shape, strides, bounds,
//! handle liveness) and turned into a library call; a library error becomes a `V4PoolError`
//! (Python) or a status plus its variant name (C). Logic they would otherwise repeat lives in
//! the library below them; neither names the other.

#[cfg(feature = "capi")]
pub mod capi;
#[cfg(feature = "python")]
pub mod python;
