//! The engine's own decisions, one small function each; everything about memory (the split,
//! the boundary, the cache, checkpoints, eviction, admission back-pressure) is the
//! [`KvManager`]'s. Here: the manager each run is built with, which requests are refused,
//! which request a stall preempts, and the block hashes a request's tokens have.

use super::{RequestSpec, RunKind, SimConfig};
use crate::manager::{
    block_hash, BlockHash, ElasticPolicy, FixedPolicy, KvManager, ManagerConfig, ManagerError, Namespace,
};
use crate::pool::Pool;
use std::sync::Arc;

/// Blocks between checkpoints for the 4,096-token baseline (16 blocks of 256 tokens).
pub(crate) const LCM_BLOCKS: u32 = 16;

/// Blocks between permanent checkpoints under v4pool's reuse.
pub(crate) const CHECKPOINT_EVERY: u32 = 8;

/// Bounded bypass (the engine's admission, not the split policy's): how far behind a head
/// that waits for blocks the engine looks for a request short enough to prefill in one step.
/// Why: with admission waiting for a whole prompt's blocks, one 128k+ prompt at the head of a
/// FIFO queue held every request behind it for ~1,100 steps on `mixed`, while short requests
/// would have run and finished in the room the long one could not yet use.
pub(crate) const BYPASS_WINDOW: usize = 16;
/// How many requests may pass one head, so a long prompt is delayed by a bounded amount of
/// short work (each passer's blocks come back, cached and evictable, when it finishes).
pub(crate) const BYPASS_PER_HEAD: u32 = 8;

/// The namespace every run hashes content in (the model revision an engine would set).
pub(crate) const NAMESPACE: Namespace = Namespace(0x7634_706f_6f6c_2d73_696d_2d76_3400_0001);

/// The manager a run drives: the run's split policy and reuse configuration.
pub(crate) fn manager(pool: &Arc<Pool>, cfg: &SimConfig, run: RunKind) -> Result<KvManager, ManagerError> {
    let elastic = ElasticPolicy {
        headroom: cfg.slot_headroom,
        max_slots: u32::try_from(cfg.elastic_max_seqs).unwrap_or(u32::MAX),
        ..ElasticPolicy::default()
    };
    // v4pool's reuse: a permanent checkpoint every 8 blocks (2,048 tokens: a shared system
    // prompt of that length ends at one), at prompt ends, and rolling ones at turn ends.
    let reuse =
        ManagerConfig { checkpoint_every: CHECKPOINT_EVERY, rolling: true, ..ManagerConfig::default() };
    let (config, policy): (ManagerConfig, Box<dyn crate::manager::SplitPolicy>) = match run {
        RunKind::Fixed => {
            (reuse, Box::new(FixedPolicy { slots: u32::try_from(cfg.max_seqs).unwrap_or(u32::MAX) }))
        }
        RunKind::Elastic | RunKind::NoReuse => (reuse, Box::new(elastic)),
        RunKind::Reuse4096 => (
            ManagerConfig { checkpoint_every: LCM_BLOCKS, rolling: false, ..ManagerConfig::default() },
            Box::new(elastic),
        ),
    };
    KvManager::new(pool.clone(), config, policy)
}

/// Why a request is refused at admission: it could never fit, so admitting it would only
/// stall the run (nothing else to preempt once it holds every block).
pub(crate) fn refusal(req: &RequestSpec, cfg: &SimConfig, capacity_blocks: u32, block_size: u64) -> bool {
    // Decode writes whole steps, so a context can pass prompt + output by a step's tokens.
    let longest = req.prompt + req.output + cfg.tokens_per_decode as u64 - 1;
    req.prompt + req.output > cfg.max_context || longest.div_ceil(block_size) > u64::from(capacity_blocks)
}

/// Out of blocks even after eviction: the most recently admitted request is preempted (its
/// committed blocks stay cached, so it resumes with a hit). `keys` are the running
/// requests' (admission step, id); `None` when preempting would not help.
pub(crate) fn preemption_victim(keys: impl Iterator<Item = (u64, u64)>, stalled: bool) -> Option<usize> {
    if !stalled {
        return None;
    }
    let keys: Vec<(u64, u64)> = keys.collect();
    if keys.len() < 2 {
        return None;
    }
    (0..keys.len()).max_by_key(|&j| keys[j])
}

/// Append the hashes of blocks `out.len()..blocks` of `req`'s tokens in `ns`. Token `p` is a
/// function of the request's conversation and `p` (of its system prompt for `p < shared`),
/// so one block's content is named by (owner, block index) — far cheaper than hashing
/// 256 synthetic tokens — and the chain makes equal prefixes hash equal.
pub(crate) fn extend_hashes(
    ns: Namespace,
    req: &RequestSpec,
    block_size: u64,
    blocks: u64,
    out: &mut Vec<BlockHash>,
) {
    let mut parent = out.last().copied();
    for i in out.len() as u64..blocks {
        let (tag, owner) = if (i + 1) * block_size <= req.shared { (1, req.system) } else { (2, req.conv) };
        let h =
            block_hash(ns, parent, &[tag, owner as u32, (owner >> 32) as u32, i as u32, (i >> 32) as u32]);
        out.push(h);
        parent = Some(h);
    }
}
