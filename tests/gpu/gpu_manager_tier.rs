//! The manager's host tier on the CUDA backend (the H200): cached blocks and checkpoints
//! evicted from HBM spill to page-locked host memory and come back byte-exact on a hit, the
//! window rows written by the ring-write kernel, the state by the state-update kernel, and
//! checkpoints stored and restored by the copy kernel. Skips with a printed notice without a GPU; `V4POOL_REQUIRE_GPU=1` fails
//! instead.

use crate::common;
use crate::tier_common;

use std::sync::Arc;

#[test]
fn gpu_spilled_prefix_restores_byte_exact_from_pinned_memory() {
    let Some(cuda) = common::cuda_or_skip("gpu_spilled_prefix_restores_byte_exact_from_pinned_memory") else {
        return;
    };
    let cuda: Arc<dyn v4pool::backend::Backend> = Arc::new(cuda);
    let pool = tier_common::manager_common::small_pool(cuda.clone(), 24);
    let tier = v4pool::transfer::HostTier::<u64>::new(&pool, 1 << 20).expect("tier");
    assert!(tier.pinned(), "the CUDA backend's host memory is page-locked");
    drop((tier, pool));
    // State written by the state-update kernel and window rows by the ring-write kernel.
    tier_common::spill_hit_restore(tier_common::manager_common::state_pool(cuda.clone(), 24));
    tier_common::spill_hit_restore(tier_common::manager_common::small_pool(cuda, 24));
}
