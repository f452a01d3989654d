//! The request-level KV manager: what a scheduler calls (vLLM's `get_computed_blocks` /
//! `allocate_slots` / `free`, SGLang's `match_prefix` / `insert` / `evict` with lock refs),
//! for a stateful model.
//!
//! * **Content-addressed blocks.** A full block is keyed by its [`BlockHash`] (128-bit,
//!   chained, namespaced; see [`hash`]). Requests reference blocks; a block no request
//!   references stays cached and sits in one LRU list with the ready checkpoints, and is
//!   evicted only when an allocation or a store needs the room. A referenced block is never
//!   evicted.
//! * **State checkpoints** (`pool-runtime.md` §6): the slot image copied into block units of
//!   the same row space, keyed by the hash of the block it ends at. Lifecycle:
//!   `begin_store` (COPYING, refused before anything is evicted when even full eviction
//!   cannot make room) → [`KvManager::complete_inflight`] (READY, visible); restores pin a
//!   record until the batch that carried them completes; a record whose block left the
//!   cache is unindexed (EVICTING) and its units go back once no writer or pin needs them.
//!   Every record carries the layout id; an image from another layout is a typed error.
//! * **Checkpoint points**: every `checkpoint_every` blocks, the prompt's last block boundary,
//!   and a rolling one at each other block boundary a request's computed tokens land on
//!   (the previous rolling one of that request is dropped) — so a finished turn leaves its
//!   last full block checkpointed and the next turn's prompt hits there.
//! * **Admission with a hit**: the longest cached prefix that ends at a ready checkpoint;
//!   a fresh slot restored from it in one copy launch; the hit's blocks referenced; prefill
//!   resumes at the hit.
//! * **The boundary** moves only here, as a [`SplitPolicy`] decides; the manager rewrites
//!   its own tables for every relocation, so callers ask [`KvManager::block_table`] and
//!   [`KvManager::slot`] afresh each step.
//!
//! The engine calls, per request: [`KvManager::add_request`] (prompt length and the hashes of
//! its full blocks) → [`KvManager::admit`] → per step [`KvManager::prefill_stop`],
//! [`KvManager::allocate`], the forward pass, [`KvManager::commit`] → [`KvManager::preempt`]
//! or [`KvManager::finish`]; per batch [`KvManager::complete_inflight`] after the batch's
//! work has completed, and [`KvManager::rebalance`] once per step.

mod events;
pub mod hash;
mod physical;
pub mod policy;
mod store;
mod tier;

pub use events::{KvEvent, Medium};
pub use hash::{block_hash, chain_hashes, BlockHash, Namespace};
pub use policy::{BlockGrowth, ElasticPolicy, FixedPolicy, PoolView, SplitPolicy};

use crate::alloc::{AllocError, BlockHandle};
use crate::boundary::BoundaryChange;
use crate::checkpoint::{CheckpointError, CheckpointLayout, LayoutId};
use crate::pool::{Pool, PoolError, SlotLease};
use hash::BuildPassThrough;
use physical::{BlockNode, CkptNode, Holder, Node, Nodes, NIL};
pub use physical::{Candidate, CandidateKind, CkptState, EvictionPolicy, Lru, NodeId};
use std::collections::HashMap;
use std::sync::Arc;
use thiserror::Error;
pub use tier::{Tier, TierKey};

mod request;
pub use request::{Admission, ManagerStats, RequestId, StoredCheckpoint};

crate::variant::variant_names! {
/// Everything the manager refuses. A refused call changes nothing unless it says so.
#[derive(Debug, Error)]
pub enum ManagerError {
    /// The pool refused (allocator, boundary, backend).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A checkpoint plan was refused.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The id names no request of this manager (finished, or never added).
    #[error("no request {0:?}")]
    UnknownRequest(RequestId),
    /// The call needs a request that holds a slot.
    #[error("request {0:?} is not running")]
    NotRunning(RequestId),
    /// `admit` on a request that already holds a slot.
    #[error("request {0:?} is already running")]
    AlreadyRunning(RequestId),
    /// No slot is free and the policy gave none.
    #[error("no slot is free and the policy grew none")]
    NoSlot,
    /// Not even evicting every unreferenced block and checkpoint would free `need` blocks.
    #[error("{need} blocks needed, at most {available} obtainable; nothing was evicted")]
    OutOfBlocks {
        /// Blocks the call needed.
        need: u64,
        /// Blocks free, in the gap or evictable.
        available: u64,
    },
    /// `commit` of more tokens than the allocated blocks hold.
    #[error("commit to {tokens} tokens, but the request's blocks hold {capacity}")]
    CommitPastAllocation {
        /// Tokens after the commit.
        tokens: u64,
        /// Tokens the request's blocks hold.
        capacity: u64,
    },
    /// No ready checkpoint, or no cached block, under that hash.
    #[error("no {what} for hash {hash:032x}")]
    NotCached {
        /// `"checkpoint"` or `"block"`.
        what: &'static str,
        /// The hash asked for.
        hash: u128,
    },
    /// The backend refused a transfer.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    /// The configuration is unusable.
    #[error("bad manager config: {0}")]
    Config(&'static str),
    /// A count the caller passed overflows what it adds to (nothing changed).
    #[error("arithmetic overflow computing {0}")]
    Overflow(&'static str),
    /// A request's block hashes repeat a value: hash `again` equals hash `first` (chained
    /// hashes never repeat within one request; nothing changed).
    #[error("block hash {again} repeats hash {first} of the same request")]
    RepeatedHash {
        /// Index of the first occurrence.
        first: usize,
        /// Index of the repeat.
        again: usize,
    },
    /// The host tier failed to copy (a backend or driver error; refusals for room are not
    /// errors: a spill that does not fit drops the entry, a restore without room shortens
    /// the hit).
    #[error(transparent)]
    HostTier(#[from] crate::transfer::HostTierError),
}
}

/// How the manager checkpoints and which layout its checkpoints belong to.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ManagerConfig {
    /// A permanent checkpoint every this many blocks (0: none besides prompt end and rolling).
    pub checkpoint_every: u32,
    /// Rolling checkpoints at the other block boundaries a request's computed tokens land on
    /// (turn ends; resumption after preemption).
    pub rolling: bool,
    /// Host memory (page-locked on CUDA) that cached blocks and checkpoints evicted from HBM
    /// spill to instead of being dropped, allocated at construction; 0: no host tier. A
    /// budget below one block unit is refused.
    pub host_tier_bytes: u64,
    /// A shared tier of files (a directory every engine of a fleet mounts): committed blocks
    /// and ready checkpoints are published there at [`KvManager::complete_inflight`] and
    /// admission restores from it what neither HBM nor the host tier holds (`tier.rs`,
    /// `docs/fleet.md`). `None`: no shared tier (or one given to
    /// [`KvManager::set_shared_tier`]).
    pub shared_tier: Option<crate::transfer::SharedTierConfig>,
}

crate::setters::with_setters!(ManagerConfig {
    with_checkpoint_every(checkpoint_every: u32),
    with_rolling(rolling: bool),
    with_host_tier_bytes(host_tier_bytes: u64),
    with_shared_tier(shared_tier: Some(crate::transfer::SharedTierConfig)),
});

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig { checkpoint_every: 16, rolling: true, host_tier_bytes: 0, shared_tier: None }
    }
}

/// The request-level KV manager over one [`Pool`]. See the module docs.
pub struct KvManager {
    pool: Arc<Pool>,
    config: ManagerConfig,
    layout_id: LayoutId,
    ck: CheckpointLayout,
    units_per_ckpt: u32,
    block_size: u64,
    policy: Box<dyn SplitPolicy>,
    /// Which evictable node goes first ([`Lru`] unless [`KvManager::set_eviction_policy`]).
    eviction: Box<dyn EvictionPolicy>,
    nodes: Nodes,
    index: HashMap<BlockHash, u32, BuildPassThrough>,
    by_id: Vec<Holder>,
    requests: Vec<request::Slot>,
    free_requests: Vec<u32>,
    /// Checkpoints whose store copy is queued.
    copying: Vec<u32>,
    /// Checkpoints pinned by restores queued in the current batch.
    pinned: Vec<u32>,
    /// Reused by `allocate` (no heap allocation per call).
    scratch: Vec<BlockHandle>,
    /// A slot position followed through boundary moves (a store's source while its room
    /// is made: giving idle slots back relocates held slots above the new top).
    tracked: Option<i64>,
    /// Where evicted blocks and checkpoints spill (`None`: they are dropped).
    tier: Option<tier::ManagerTier>,
    /// The fleet's shared tier (inclusive; `tier.rs`), if any.
    shared: Option<Box<dyn Tier<TierKey>>>,
    /// Blocks indexed since the last `complete_inflight`, published to the shared tier there
    /// (empty without one).
    publish: Vec<BlockHash>,
    /// KV events recorded for a router (`None`: off, the default).
    events: Option<events::EventLog>,
    stats: ManagerStats,
    /// Prompt tokens of every admission (resumptions included): what the cache could have
    /// served; `stats.hit_tokens` over this is the share of prompt work it did serve.
    admitted_tokens: u64,
}

impl std::fmt::Debug for KvManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvManager")
            .field("policy", &self.policy.name())
            .field("cached", &self.index.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl KvManager {
    /// A manager over `pool`: carves the split `policy` asks for at start-up (the pool must
    /// hold no blocks or slots yet).
    pub fn new(
        pool: Arc<Pool>,
        config: ManagerConfig,
        policy: Box<dyn SplitPolicy>,
    ) -> Result<Self, ManagerError> {
        let spec = pool.spec();
        let ck = spec.checkpoint_layout()?;
        let units_per_ckpt = u32::try_from(ck.units_per_checkpoint)
            .map_err(|_| ManagerError::Config("checkpoint too large"))?;
        let block_size =
            u64::try_from(spec.geometry.block_size).map_err(|_| ManagerError::Config("block size"))?;
        if block_size == 0 {
            return Err(ManagerError::Config("block size 0"));
        }
        let capacity = pool.indexer_blocks().max(1) as usize;
        let layout_id = pool.layout_id().clone();
        let tier = tier::ManagerTier::new(&pool, config.host_tier_bytes)?;
        let shared = match &config.shared_tier {
            Some(c) => Some(Box::new(crate::transfer::SharedTier::new(&pool, c)?) as Box<dyn Tier<TierKey>>),
            None => None,
        };
        let m = KvManager {
            pool,
            config,
            layout_id,
            ck,
            units_per_ckpt,
            block_size,
            policy,
            eviction: Box::new(Lru),
            nodes: Nodes::new(),
            index: HashMap::default(),
            by_id: vec![Holder::None; capacity],
            requests: Vec::new(),
            free_requests: Vec::new(),
            copying: Vec::new(),
            pinned: Vec::new(),
            scratch: Vec::new(),
            tracked: None,
            tier,
            shared,
            publish: Vec::new(),
            events: None,
            stats: ManagerStats::default(),
            admitted_tokens: 0,
        };
        let c = m.pool.counts()?;
        if c.num_blocks != c.free_blocks || c.num_slots != c.free_slots {
            return Err(ManagerError::Config("the pool already has blocks or slots in use"));
        }
        let slots =
            m.policy.initial_slots(&m.view()?).min(u32::try_from(c.slot_positions).unwrap_or(u32::MAX));
        let blocks = m.pool.with_boundary(|b| b.max_blocks_beside(slots))?;
        m.pool.resize(0, slots)?;
        m.pool.resize(blocks, slots)?;
        Ok(m)
    }

    /// Install (or, with `None`, remove) the shared tier: any [`Tier`] over the same units,
    /// with the shared semantics of `tier.rs` (a restore leaves the entry; its contents change
    /// under the manager). Replaces the one `ManagerConfig::shared_tier` built.
    pub fn set_shared_tier(&mut self, tier: Option<Box<dyn Tier<TierKey>>>) -> Result<(), ManagerError> {
        if let Some(t) = &tier {
            if t.unit_bytes() != self.units_bytes() {
                return Err(ManagerError::Config("the shared tier's units are not this pool's"));
            }
        }
        self.shared = tier;
        self.publish.clear();
        Ok(())
    }

    /// Bytes of one block unit of the pool (every plane and indexer layer).
    fn units_bytes(&self) -> u64 {
        crate::transfer::host_tier::part_bytes(&self.pool).map_or(0, |p| p.iter().sum())
    }

    /// Whether a shared tier is installed.
    pub fn has_shared_tier(&self) -> bool {
        self.shared.is_some()
    }

    /// Replace the eviction policy (default [`Lru`]); takes effect at the next eviction.
    pub fn set_eviction_policy(&mut self, policy: Box<dyn EvictionPolicy>) {
        self.eviction = policy;
    }

    /// The eviction policy's name.
    pub fn eviction_policy_name(&self) -> &'static str {
        self.eviction.name()
    }

    /// The pool underneath.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    /// What the pool's rows are ([`Pool::kv_spec`]): row format, packing, indexer, window,
    /// index top-k, MTP steps, arch — what an engine sizes its decode and prefill buffers and
    /// reads its attention operands by, asked here rather than passed again. Refused
    /// (`ManagerError::Pool(PoolError::NoKvSpec)`) only for a pool built from parts given none.
    pub fn kv_spec(&self) -> Result<&crate::sizing::KvSpec, ManagerError> {
        Ok(self.pool.kv_spec()?)
    }
    /// Tokens per block.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }
    /// Block units one checkpoint takes.
    pub fn units_per_checkpoint(&self) -> u32 {
        self.units_per_ckpt
    }
    /// The policy's name (`elastic`, `fixed`).
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }
    /// The layout id every checkpoint of this manager carries (the pool's).
    pub fn layout_id(&self) -> &LayoutId {
        &self.layout_id
    }
    /// Counters since construction.
    pub fn stats(&self) -> ManagerStats {
        let mut s = self.stats;
        s.cached_blocks = self.index.len() as u64;
        self.tier_stats(&mut s);
        s
    }

    /// What the policy sees now.
    pub fn view(&self) -> Result<PoolView, ManagerError> {
        let c = self.pool.counts()?;
        let g = &self.pool.spec().geometry;
        let slot_blocks = (g.slot_rows + g.envelope_rows - 1) / g.envelope_rows.max(1);
        let (mut running, mut waiting, mut owed) = (0u32, 0u32, 0u64);
        for r in self.requests.iter().filter_map(|s| s.req.as_ref()) {
            if r.slot.is_some() {
                running += 1;
                owed += r.known.div_ceil(self.block_size).saturating_sub(r.blocks.len() as u64);
            } else {
                waiting += 1;
            }
        }
        Ok(PoolView {
            num_blocks: c.num_blocks,
            num_slots: c.num_slots,
            free_blocks: c.free_blocks,
            free_slots: c.free_slots,
            max_blocks: c.max_blocks,
            evictable_blocks: u32::try_from(self.nodes.lru_blocks).unwrap_or(u32::MAX),
            slot_blocks: u32::try_from(slot_blocks).unwrap_or(u32::MAX),
            owed_blocks: owed,
            running,
            waiting,
            hit_per_mille: u32::try_from(self.stats.hit_tokens * 1000 / self.admitted_tokens.max(1))
                .unwrap_or(1000),
        })
    }

    // ---- boundary ------------------------------------------------------------------------

    /// Rewrite every table after a boundary move: block ids of cached blocks and checkpoint
    /// units, and request slots.
    fn note_change(&mut self, ch: &BoundaryChange) {
        self.stats.boundary_moves += 1;
        self.stats.block_relocations += ch.block_moves.len() as u64;
        self.stats.slot_relocations += ch.slot_moves.len() as u64;
        for m in &ch.block_moves {
            let holder = self.by_id.get(m.old.id as usize).copied().unwrap_or(Holder::None);
            self.set_holder(m.old.id, Holder::None);
            self.set_holder(m.new.id, holder);
            match holder {
                Holder::Block(n) => self.nodes.block_mut(n).handle = m.new,
                Holder::Unit(n, k) => self.nodes.ckpt_mut(n).units[k as usize] = m.new,
                Holder::None => {}
            }
        }
        for m in &ch.slot_moves {
            if self.tracked == Some(m.from_position) {
                self.tracked = Some(m.to_position);
            }
            for r in self.requests.iter_mut().filter_map(|s| s.req.as_mut()) {
                if r.slot.is_some_and(|l| l.handle == m.old) {
                    r.slot = Some(SlotLease { handle: m.new, position: m.to_position });
                }
            }
        }
    }

    fn set_holder(&mut self, id: u32, h: Holder) {
        let i = id as usize;
        if i >= self.by_id.len() {
            self.by_id.resize(i + 1, Holder::None);
        }
        self.by_id[i] = h;
    }

    fn apply(&mut self, r: Result<BoundaryChange, PoolError>) -> bool {
        match r {
            Ok(ch) => {
                self.note_change(&ch);
                true
            }
            Err(_) => false,
        }
    }

    /// Admission back-pressure, as the policy says ([`SplitPolicy::may_admit`]): whether a
    /// waiting request whose prompt needs `rest_blocks` more blocks past its hit should be
    /// admitted now (`admit` itself only needs a slot; a request admitted beyond this is
    /// likely to stall and be preempted).
    pub fn may_admit(&self, rest_blocks: u64) -> Result<bool, ManagerError> {
        Ok(self.policy.may_admit(&self.view()?, rest_blocks))
    }

    /// Once per scheduler step: give idle slots back to blocks as the policy says.
    pub fn rebalance(&mut self) -> Result<(), ManagerError> {
        let give = self.policy.rebalance(&self.view()?);
        if give > 0 {
            let r = self.pool.shrink_slots(give);
            if self.apply(r) {
                let grow = self.pool.with_boundary(|b| b.max_blocks().saturating_sub(b.num_blocks()))?;
                if grow > 0 {
                    let r = self.pool.grow_blocks(grow);
                    self.apply(r);
                }
            }
        }
        Ok(())
    }

    /// Move the boundary to exactly `slots` slots, outside the policy (operator tooling,
    /// tests): held slots above the new top and held blocks in the way are relocated, cached
    /// blocks evicted when relocation needs free ids; blocks take every row the slots leave.
    /// `Ok(false)` when the move is impossible (too many held slots or blocks); nothing changed.
    pub fn set_slots(&mut self, slots: u32) -> Result<bool, ManagerError> {
        let c = self.pool.counts()?;
        if slots > c.num_slots {
            let n = slots - c.num_slots;
            let r = self.pool.grow_slots(n);
            if !self.apply(r) {
                let per = self.view()?.slot_blocks;
                if self.make_room(n.saturating_mul(per)).is_err() {
                    return Ok(false);
                }
                let r = self.pool.grow_slots(n);
                if !self.apply(r) {
                    return Ok(false);
                }
            }
        } else if slots < c.num_slots {
            let r = self.pool.shrink_slots(c.num_slots - slots);
            if !self.apply(r) {
                return Ok(false);
            }
            let grow = self.pool.with_boundary(|b| b.max_blocks().saturating_sub(b.num_blocks()))?;
            if grow > 0 {
                let r = self.pool.grow_blocks(grow);
                self.apply(r);
            }
        }
        Ok(true)
    }

    /// Make `need` block ids free: the policy's growth first, then LRU eviction. Refuses
    /// (evicting nothing) when even full eviction cannot reach the count.
    fn make_room(&mut self, need: u32) -> Result<(), ManagerError> {
        let c = self.pool.counts()?;
        if c.free_blocks >= need {
            return Ok(());
        }
        let v = self.view()?;
        let short = need - c.free_blocks;
        let growth = self.policy.grow_blocks(&v, short);
        if growth.grow > 0 {
            let gap = c.max_blocks.saturating_sub(c.num_blocks);
            let n = growth.grow.min(gap);
            if n > 0 {
                let r = self.pool.grow_blocks(n);
                self.apply(r);
            }
            let mut rest = growth.grow.saturating_sub(n);
            if rest > 0 && growth.shrink_idle_slots {
                // Superseded checkpoints before idle slots: they save prefill only for a
                // request diverging inside their span (physical.rs), an idle slot is the room
                // the next admission runs in. Only when eviction can cover the rest, so a
                // refusal still evicts nothing.
                let free = u64::from(self.pool.counts()?.free_blocks);
                if free + self.nodes.lru_blocks >= u64::from(need) {
                    let freed = self.evict_superseded(u64::from(need).saturating_sub(free))?;
                    rest = rest.saturating_sub(u32::try_from(freed).unwrap_or(u32::MAX));
                }
            }
            if rest > 0 && growth.shrink_idle_slots {
                // As many as the idle slots allow, all or nothing per try.
                let mut k = rest;
                while k > 0 {
                    let r = self.pool.grow_blocks_shrinking_slots(k);
                    if self.apply(r) {
                        break;
                    }
                    k /= 2;
                }
            }
        }
        let free = self.pool.counts()?.free_blocks;
        if free >= need {
            return Ok(());
        }
        let available = u64::from(free) + self.nodes.lru_blocks;
        if available < u64::from(need) {
            return Err(ManagerError::OutOfBlocks { need: u64::from(need), available });
        }
        let mut free = u64::from(free);
        while free < u64::from(need) {
            if self.nodes.head == NIL {
                break;
            }
            let victim = self.eviction.victim(&mut self.nodes.candidates());
            let Some(victim) = victim.filter(|&v| self.nodes.is_candidate(v)) else {
                return Err(ManagerError::Config("the eviction policy chose no evictable node"));
            };
            free += self.evict(victim.0)?;
        }
        if free < u64::from(need) {
            return Err(ManagerError::OutOfBlocks { need: u64::from(need), available: free });
        }
        Ok(())
    }

    /// Evict superseded checkpoints from the evicted-first end of the LRU until `want` block
    /// ids are freed or the head is something else; returns the ids freed.
    fn evict_superseded(&mut self, want: u64) -> Result<u64, ManagerError> {
        let mut freed = 0;
        while freed < want {
            let h = self.nodes.head;
            if h == NIL || !matches!(&self.nodes.nodes[h as usize], Node::Ckpt(c) if c.superseded) {
                break;
            }
            freed += self.evict(h)?;
        }
        Ok(freed)
    }

    /// Evict an LRU node; returns the block ids that became free.
    fn evict(&mut self, i: u32) -> Result<u64, ManagerError> {
        match &self.nodes.nodes[i as usize] {
            Node::Block(_) => {
                let b = self.nodes.block(i).clone();
                debug_assert_eq!(b.refs, 0, "a referenced block is never in the LRU");
                // With a host tier the block (and its checkpoint) is copied out before its
                // ids are freed; the tables below change as without one.
                let spilled = self.tier_spill_block(&b);
                if let Some(h) = b.hash {
                    let in_host = self.tier.as_ref().is_some_and(|t| t.holds(TierKey::Block(h)));
                    self.event_removed(h, Medium::Gpu, !in_host);
                    if in_host {
                        self.event_stored(h, Medium::Cpu);
                    }
                }
                // The checkpoint ending at this block is useless without it: unindex first,
                // while the block node still links it.
                let mut freed = 1;
                if b.ckpt != NIL {
                    freed += self.unindex_node(b.ckpt)?;
                }
                if let Some(h) = b.hash {
                    self.index.remove(&h);
                }
                self.nodes.remove(i);
                self.release_block_id(b.handle)?;
                self.stats.evicted_blocks += 1;
                spilled?;
                Ok(freed)
            }
            Node::Ckpt(_) => {
                self.stats.evicted_checkpoints += 1;
                let spilled = self.tier_spill_ckpt(i);
                let freed = self.release_ckpt(i)?;
                spilled?;
                Ok(freed)
            }
            Node::Free => Ok(0),
        }
    }

    fn release_block_id(&mut self, h: BlockHandle) -> Result<(), ManagerError> {
        self.set_holder(h.id, Holder::None);
        self.pool.free_block(h)?;
        Ok(())
    }

    /// Free a checkpoint's units and its node now (no writer or pin may need them).
    fn release_ckpt(&mut self, i: u32) -> Result<u64, ManagerError> {
        let c = self.nodes.ckpt(i).clone();
        if c.block != NIL {
            self.nodes.block_mut(c.block).ckpt = NIL;
        }
        self.nodes.remove(i);
        for u in &c.units {
            self.release_block_id(*u)?;
        }
        self.stats.checkpoints_held -= 1;
        Ok(c.units.len() as u64)
    }

    /// §6 `unindex`: the record's block left the index; release its units now unless a queued
    /// writer or a pin still needs them. Returns the block ids freed now.
    fn unindex_node(&mut self, i: u32) -> Result<u64, ManagerError> {
        let c = self.nodes.ckpt(i);
        if c.block != NIL {
            let b = c.block;
            self.nodes.block_mut(b).ckpt = NIL;
        }
        let c = self.nodes.ckpt_mut(i);
        c.block = NIL;
        let busy = c.state == CkptState::Copying || c.pins > 0;
        c.state = CkptState::Evicting;
        if busy {
            self.nodes.unlink(i);
            Ok(0)
        } else {
            self.release_ckpt(i)
        }
    }

    /// §6 `unindex(hash)`: the checkpoint ending at `hash` is dropped (once no writer or pin
    /// needs it), and its copy in the host tier. Nothing happens when there is none.
    pub fn unindex(&mut self, hash: BlockHash) -> Result<(), ManagerError> {
        if let Some(t) = self.tier.as_mut() {
            t.forget_ckpt(hash);
        }
        if let Some(&b) = self.index.get(&hash) {
            let ck = self.nodes.block(b).ckpt;
            if ck != NIL {
                self.unindex_node(ck)?;
            }
        }
        Ok(())
    }

    /// §6 `begin_store(hash, slot)`: reserve units for the block `hash` ends at and queue the
    /// copy from the slot at `position`. Nothing if a record for `hash` is ready or pending;
    /// `Ok(false)` (nothing evicted) when even full eviction cannot free the units.
    fn begin_store(
        &mut self,
        hash: BlockHash,
        position: i64,
        rolling: bool,
        coarse: bool,
    ) -> Result<bool, ManagerError> {
        let Some(&b) = self.index.get(&hash) else { return Ok(false) };
        if self.nodes.block(b).ckpt != NIL {
            return Ok(true);
        }
        // The indexed block need not be the storing request's own: when another request
        // indexed the hash first, the storer holds a private duplicate and the indexed block
        // may sit unreferenced in the LRU, so the room is made first and the block looked
        // up again (eviction may have taken it, and its node been reused).
        // Making room may move the boundary, and with it the source slot.
        self.tracked = Some(position);
        let room = self.make_room(self.units_per_ckpt);
        let position = self.tracked.take().unwrap_or(position);
        match room {
            Ok(()) => {}
            Err(ManagerError::OutOfBlocks { .. }) => {
                self.stats.refused_stores += 1;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        let Some(&b) = self.index.get(&hash) else { return Ok(false) };
        let mut units = Vec::with_capacity(self.units_per_ckpt as usize);
        for _ in 0..self.units_per_ckpt {
            match self.pool.alloc_block() {
                Ok(g) => units.push(g.handle),
                Err(e) => {
                    for u in units {
                        self.pool.free_block(u)?;
                    }
                    return Err(e.into());
                }
            }
        }
        let ids: Vec<i64> = units.iter().map(|u| i64::from(u.id)).collect();
        if let Err(e) = store::copy(&self.pool, &self.ck, position, &ids, true) {
            for u in units {
                self.pool.free_block(u)?;
            }
            return Err(e);
        }
        let node = self.attach_ckpt(b, hash, units, CkptState::Copying, rolling, coarse);
        self.copying.push(node);
        self.stats.checkpoints_stored += 1;
        self.stats.checkpoints_held += 1;
        self.stats.checkpoint_bytes_copied += self.ck.image_bytes;
        Ok(true)
    }

    /// Record a checkpoint on block node `b` held in `units`.
    fn attach_ckpt(
        &mut self,
        b: u32,
        hash: BlockHash,
        units: Vec<BlockHandle>,
        state: CkptState,
        rolling: bool,
        coarse: bool,
    ) -> u32 {
        let ids: Vec<u32> = units.iter().map(|u| u.id).collect();
        let node = self.nodes.insert(Node::Ckpt(CkptNode {
            hash,
            block: b,
            units,
            state,
            pins: 0,
            rolling,
            restores: 0,
            interior: false,
            proven: false,
            superseded: false,
            coarse,
            layout: self.layout_id.clone(),
        }));
        for (k, id) in ids.into_iter().enumerate() {
            self.set_holder(id, Holder::Unit(node, k as u32));
        }
        self.nodes.block_mut(b).ckpt = node;
        node
    }

    /// §6 `complete_inflight`: call after the batch that carried this step's copies has
    /// completed. Stores become READY and visible (or are released if their block left the
    /// index meanwhile); restores drop their pins.
    pub fn complete_inflight(&mut self) -> Result<(), ManagerError> {
        let mut ready = Vec::new();
        for i in std::mem::take(&mut self.copying) {
            let c = self.nodes.ckpt_mut(i);
            if c.state == CkptState::Evicting {
                if c.pins == 0 {
                    self.release_ckpt(i)?;
                }
            } else {
                c.state = CkptState::Ready;
                if c.pins == 0 {
                    // Superseded while its copy ran (a chunk crossed two checkpoint points).
                    if c.superseded {
                        self.nodes.touch_front(i);
                    } else {
                        self.nodes.touch(i);
                    }
                }
                ready.push(i);
            }
        }
        for i in std::mem::take(&mut self.pinned) {
            let c = self.nodes.ckpt_mut(i);
            c.pins -= 1;
            if c.pins == 0 {
                match c.state {
                    CkptState::Evicting => {
                        self.release_ckpt(i)?;
                    }
                    CkptState::Ready => self.nodes.touch(i),
                    CkptState::Copying => {}
                }
            }
        }
        // Everything stored or committed before this call is complete now: publish it.
        self.shared_publish(&ready)
    }

    /// A ready checkpoint ending at `hash`, if any.
    fn ready_ckpt(&self, hash: &BlockHash) -> Option<u32> {
        let &b = self.index.get(hash)?;
        let c = self.nodes.block(b).ckpt;
        (c != NIL && self.nodes.ckpt(c).state == CkptState::Ready).then_some(c)
    }

    /// §6 `begin_restore`: pin the record (until `complete_inflight`), refresh its LRU place,
    /// and queue the copy into the slot at `position` (one descriptor launch).
    fn begin_restore(&mut self, ck: u32, position: i64) -> Result<(), ManagerError> {
        let c = self.nodes.ckpt(ck);
        self.layout_id.check_image(&c.layout)?;
        let ids: Vec<i64> = c.units.iter().map(|u| i64::from(u.id)).collect();
        store::copy(&self.pool, &self.ck, position, &ids, false)?;
        let c = self.nodes.ckpt_mut(ck);
        c.pins += 1;
        c.count_restore();
        self.nodes.unlink(ck);
        self.pinned.push(ck);
        self.stats.restores += 1;
        Ok(())
    }

    /// Free slot for an admission: take one, or grow the slot region as the policy allows
    /// (evicting cached blocks when relocation needs free ids).
    fn take_slot(&mut self) -> Result<SlotLease, ManagerError> {
        if self.pool.counts()?.free_slots == 0 {
            let v = self.view()?;
            let n = self.policy.grow_slots(&v);
            if n == 0 {
                return Err(ManagerError::NoSlot);
            }
            let r = self.pool.grow_slots(n);
            if !self.apply(r) {
                // Relocating the top blocks needs free ids below: make them, then retry.
                let need = n.saturating_mul(v.slot_blocks);
                if self.make_room(need).is_err() {
                    return Err(ManagerError::NoSlot);
                }
                let r = self.pool.grow_slots(n);
                if !self.apply(r) {
                    return Err(ManagerError::NoSlot);
                }
            }
        }
        match self.pool.alloc_slot() {
            Ok(l) => Ok(l),
            Err(PoolError::Alloc(AllocError::NoFreeSlots)) => Err(ManagerError::NoSlot),
            Err(e) => Err(e.into()),
        }
    }
}
