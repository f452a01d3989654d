//! The `kernels` suite: what the kernels compute, on the host reference and through the kernel
//! source compiled as C++ (`index_emulated`, built by build.rs when a clang is present): index
//! buffers, FlashMLA indices and pools, KV rows and indexer keys, decode staging, the state
//! update, the window gather, the step batch, V4.1's indexer and state; and `device_build`,
//! what build.rs embedded.
//!
//! One test binary of several files (`mod` each; tests/README.md). Helpers shared with other
//! suites are included from `tests/<helper>/` by path.

#[path = "../common/mod.rs"]
mod common;
#[path = "../flashmla_common/mod.rs"]
mod flashmla_common;
#[path = "../gather_common/mod.rs"]
mod gather_common;
#[path = "../state_common/mod.rs"]
mod state_common;
#[path = "../step_common/mod.rs"]
mod step_common;
#[path = "../transfer_common/mod.rs"]
mod transfer_common;

mod decode_staging;
mod device_build;
mod flashmla_indices;
mod flashmla_path;
mod flashmla_pool;
mod index_emulated;
mod index_keys;
mod index_properties;
mod kv_rows;
mod state_update;
mod step_batch;
mod v41_indexer;
mod v41_state_update;
mod window_gather;
