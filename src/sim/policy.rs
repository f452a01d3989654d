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
        RunKind::ElasticTier => {
            (ManagerConfig { host_tier_bytes: cfg.host_tier_bytes, ..reuse }, Box::new(elastic))
        }
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
///
/// A trace request (`ids` given: its 512-token prefix ids, see `trace.rs`) names a block by
/// (its trace block's id, the half) when that whole trace block lies inside the prompt, and
/// stops there: the partial last trace block and the output are content the trace does not
/// name (a later turn's id at that position names the block grown by the output), so no
/// request could hit them, and a key of its own would only make the manager keep rolling
/// checkpoints nobody restores.
pub(crate) fn extend_hashes(
    ns: Namespace,
    req: &RequestSpec,
    ids: Option<&[u64]>,
    block_size: u64,
    blocks: u64,
    out: &mut Vec<BlockHash>,
) {
    let mut parent = out.last().copied();
    let tb = super::trace::TRACE_BLOCK_TOKENS;
    for i in out.len() as u64..blocks {
        let (start, end) = (i * block_size, (i + 1) * block_size);
        let traced = ids.map(|ids| {
            let j = start / tb;
            let inside = (j + 1) * tb <= req.prompt && (end - 1) / tb == j;
            inside.then(|| ids.get(j as usize).map(|&h| (h, (start % tb) / block_size.max(1)))).flatten()
        });
        let words = match traced {
            Some(Some((h, half))) => [3, h as u32, (h >> 32) as u32, half as u32, 0],
            Some(None) => return,
            None => {
                let (tag, owner) = if end <= req.shared { (1, req.system) } else { (2, req.conv) };
                [tag, owner as u32, (owner >> 32) as u32, i as u32, (i >> 32) as u32]
            }
        };
        let h = block_hash(ns, parent, &words);
        out.push(h);
        parent = Some(h);
    }
}

/// Slots of the fixed split sized the way SGLang sizes DeepSeek-V4: its memory pool keeps
/// a window (SWA) pool of `swa_ratio` × the full pool's tokens, and SGLang's DeepSeek-V4
/// defaults set that ratio to 0.1 with 256-token pages (sgl-project/sglang PR #37610, which
/// quotes `_compute_dsv4_sizes`: `swa_tokens = int(full_token * swa_ratio) // page_size *
/// page_size` "with the DeepSeek-V4 model overrides (`page_size=256`,
/// `swa_full_tokens_ratio=0.1`)"; the same values appear in the server-args dump of
/// sgl-project/sglang issue 23602). So of a budget of `B` bytes, with `f` bytes of
/// compressed history per token (a block's page over its tokens) and `w` bytes of window
/// per token (a slot's entry rows over the ring), history gets `B · f / (f + 0.1 · w)`; the
/// rest is per-request state, which in v4pool is the slot region, so the split has that
/// share of the budget in slots (each slot holding window and compressor state). At least
/// one slot, at most the plane's slot positions.
pub fn sglang_fixed_slots(plan: &crate::sizing::Plan, swa_ratio: f64) -> u64 {
    let g = &plan.geometry;
    let f = plan.page_bytes as f64 / g.block_size.max(1) as f64;
    let row = plan.slot_bytes as f64 / g.slot_rows.max(1) as f64;
    let w = g.entry_rows as f64 * row / g.ring_slots.max(1) as f64;
    let share = swa_ratio * w / (f + swa_ratio * w);
    let slots = (plan.budget_bytes as f64 * share / plan.slot_bytes.max(1) as f64) as u64;
    slots.clamp(1, g.slot_positions.max(1) as u64)
}

/// SGLang's DeepSeek-V4 default window share (see [`sglang_fixed_slots`]).
pub const SGLANG_SWA_RATIO: f64 = 0.1;
