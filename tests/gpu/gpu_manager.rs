//! The manager's exactness scenario on the CUDA backend (the H200): window rows written by
//! the ring-write kernel, compressor state by the §8 state-update kernel, checkpoint stores
//! and restores by the copy kernel. Skips with a
//! printed notice without a GPU; `V4POOL_REQUIRE_GPU=1` fails instead.

use crate::common;
use crate::manager_common;

use std::sync::Arc;

#[test]
fn gpu_resumed_request_is_byte_identical_to_an_uninterrupted_run() {
    let Some(cuda) = common::cuda_or_skip("gpu_resumed_request_is_byte_identical_to_an_uninterrupted_run")
    else {
        return;
    };
    manager_common::exactness(Arc::new(cuda));
}
