//! The `gpu` suite: every case that runs on a device (CUDA, or HIP with `V4POOL_BACKEND=hip`)
//! against the host reference. Without a device each prints `SKIP …` and passes; with
//! `V4POOL_REQUIRE_GPU=1` it fails instead (`V4POOL_REQUIRE_GPUS=2` for two-GPU cases).
//! `hip_backend` also checks the embedded HIP code objects without a GPU.
//!
//! One test binary of several files (`mod` each; tests/README.md). Helpers shared with other
//! suites are included from `tests/<helper>/` by path.

#[path = "../common/mod.rs"]
mod common;
#[path = "../flashmla_common/mod.rs"]
mod flashmla_common;
#[path = "../gather_common/mod.rs"]
mod gather_common;
#[path = "../manager_common/mod.rs"]
mod manager_common;
#[path = "../nixl_common/mod.rs"]
mod nixl_common;
#[path = "../pool_common/mod.rs"]
mod pool_common;
#[path = "../state_common/mod.rs"]
mod state_common;
#[path = "../step_common/mod.rs"]
mod step_common;
#[path = "../tier_common/mod.rs"]
mod tier_common;
#[path = "../transfer_common/mod.rs"]
mod transfer_common;

mod gpu_backend;
mod gpu_decode_path;
mod gpu_flashmla_indices;
mod gpu_graph;
mod gpu_index_keys;
mod gpu_kernels;
mod gpu_kv_rows;
mod gpu_manager;
mod gpu_manager_tier;
mod gpu_profiling;
mod gpu_state_update;
mod gpu_step_batch;
mod gpu_transfer;
mod gpu_transfer_nixl;
mod gpu_v41_index;
mod gpu_window_gather;
mod hip_backend;
