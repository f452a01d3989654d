//! The request-level calls: add, admit (with a hit), allocate, commit (with checkpoints),
//! preempt, finish; checkpoint export and import; tables and invariant checks.

use super::{store, BlockHash, BlockNode, CkptState, Holder, KvManager, ManagerError, Node, NIL};
use crate::alloc::BlockHandle;
use crate::checkpoint::CheckpointImage;
use crate::pool::SlotLease;

/// A request of one manager (index and generation: a finished request's id is refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestId {
    index: u32,
    generation: u32,
}

impl RequestId {
    /// The id as one integer (generation in the high half), for bindings that hand ids to
    /// other languages.
    pub fn to_bits(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }
    /// The id [`RequestId::to_bits`] gave. Any integer is accepted: one that names no
    /// request of the manager is refused there as `UnknownRequest`.
    pub fn from_bits(bits: u64) -> RequestId {
        RequestId { index: bits as u32, generation: (bits >> 32) as u32 }
    }
}

/// What [`KvManager::admit`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Tokens served from the cache (a multiple of the block size); prefill resumes here.
    pub hit_tokens: u64,
    /// The request's slot (restored from the hit's checkpoint when `hit_tokens > 0`).
    pub slot: SlotLease,
}

/// Counters since the manager was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagerStats {
    /// Admissions (re-admissions after preemption included).
    pub admissions: u64,
    /// Admissions that hit.
    pub hits: u64,
    /// Tokens served from the cache over all admissions.
    pub hit_tokens: u64,
    /// Checkpoint stores queued.
    pub checkpoints_stored: u64,
    /// Stores refused because even full eviction could not free the units.
    pub refused_stores: u64,
    /// Restores queued.
    pub restores: u64,
    /// Image bytes copied by stores.
    pub checkpoint_bytes_copied: u64,
    /// Checkpoint records holding units now.
    pub checkpoints_held: u64,
    /// Cached blocks evicted.
    pub evicted_blocks: u64,
    /// Checkpoints evicted (from the LRU; unindexed ones are not counted here).
    pub evicted_checkpoints: u64,
    /// Checkpoints superseded while their request ran (a deeper one stored on the chain, no
    /// restore read them, no other request held their block): moved to the evicted-first end.
    pub superseded_checkpoints: u64,
    /// Blocks in the index now.
    pub cached_blocks: u64,
    /// Boundary moves carried out.
    pub boundary_moves: u64,
    /// Blocks relocated by boundary moves.
    pub block_relocations: u64,
    /// Slots relocated by boundary moves.
    pub slot_relocations: u64,
    /// Cached blocks evicted from HBM that spilled to the host tier (not dropped).
    pub tier_spilled_blocks: u64,
    /// Checkpoints evicted from HBM that spilled to the host tier.
    pub tier_spilled_checkpoints: u64,
    /// Bytes copied to the host tier by those spills.
    pub tier_spilled_bytes: u64,
    /// Blocks brought back from the host tier for a hit.
    pub tier_restored_blocks: u64,
    /// Checkpoints brought back from the host tier for a hit.
    pub tier_restored_checkpoints: u64,
    /// Bytes copied back from the host tier.
    pub tier_restored_bytes: u64,
    /// Entries (blocks or checkpoints) the host tier dropped for room: gone for good.
    pub tier_host_evictions: u64,
    /// Hits cut short because the host part of the longest one could not come back (no
    /// room in HBM, or the tier dropped an entry while room was made).
    pub tier_shortened_hits: u64,
    /// Blocks held in the host tier now.
    pub tier_resident_blocks: u64,
    /// Checkpoints held in the host tier now.
    pub tier_resident_checkpoints: u64,
    /// Host bytes those entries occupy now.
    pub tier_resident_bytes: u64,
    /// Blocks this manager published to the shared tier (entries already there not counted).
    pub shared_published_blocks: u64,
    /// Checkpoints it published there.
    pub shared_published_checkpoints: u64,
    /// Payload bytes of those publications.
    pub shared_published_bytes: u64,
    /// Publications that failed (I/O: the directory gone, a full disk); the engine carried on.
    pub shared_write_failures: u64,
    /// Blocks brought back from the shared tier for a hit.
    pub shared_restored_blocks: u64,
    /// Checkpoints brought back from the shared tier for a hit.
    pub shared_restored_checkpoints: u64,
    /// Bytes copied back from the shared tier.
    pub shared_restored_bytes: u64,
    /// Shared entries refused on reading (torn, truncated, corrupt, another layout's, I/O):
    /// misses that shortened a hit, never bytes in the pool.
    pub shared_refused: u64,
}

/// A checkpoint read to host memory for a transfer between workers (prefill → decode,
/// offload): the hash of the block it ends at and the slot image, tagged with the layout id
/// it was taken in ([`crate::pool::Pool::restore`] refuses another layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredCheckpoint {
    /// The hash of the block it ends at.
    pub hash: BlockHash,
    /// The slot image (§6 ranges) and its layout id.
    pub image: CheckpointImage,
}

#[derive(Clone, Debug)]
pub(super) struct Req {
    pub(super) hashes: Vec<BlockHash>,
    pub(super) prompt: u64,
    /// Tokens the request has had in the pool at most (a preempted request re-prefills them).
    pub(super) known: u64,
    /// Block nodes in table order.
    pub(super) blocks: Vec<u32>,
    /// `blocks[..indexed]` are committed (in the index, or private duplicates).
    pub(super) indexed: usize,
    /// Tokens whose KV and state are in the pool.
    pub(super) computed: u64,
    pub(super) slot: Option<SlotLease>,
    /// The hash of this request's latest rolling checkpoint.
    pub(super) rolling: Option<BlockHash>,
    /// The hash of the latest permanent checkpoint this request stored itself (not one it
    /// found there): superseded when it stores a deeper one.
    pub(super) stored: Option<BlockHash>,
    /// The hash of the checkpoint its admission restored, until it stores deeper on the
    /// chain (then that one is superseded for it: see [`super::physical::CkptNode::restores`]).
    pub(super) from: Option<BlockHash>,
    /// Its tokens as the engine recorded them (`record_tokens`; only while events are on).
    pub(super) tokens: Vec<u32>,
}

/// What a hit occupies ([`KvManager::hit_footprint`]).
#[derive(Clone, Copy, Debug, Default)]
struct HitFootprint {
    /// Blocks of the hit.
    blocks: usize,
    /// Units of it on the LRU now (its unreferenced blocks, its checkpoint if listed).
    held_units: u64,
    /// Units a tier below HBM must bring back (blocks, and the checkpoint if there).
    lower_units: u64,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Slot {
    pub(super) generation: u32,
    pub(super) req: Option<Req>,
}

/// Every this many permanent checkpoint points one is coarse (`CkptNode::coarse`): with
/// `simulate`'s reuse (every 8 blocks of 256 tokens) every 8,192 tokens. Why 4 and not 2:
/// on the long-prompt sweep (`scripts/retention_sweep.py`, 80 cases) both levels beat no
/// levels (13 and 12 cases behind `reuse_4096` against 16), but with 2 the coarse points
/// sit on `reuse_4096`'s own grid and the rules lift it more than v4pool's reuse on
/// overloaded agent loops (`steps` seed 6: 32,803 against 37,812 tok/s/GPU; with 4, 39,575
/// against 38,741).
const COARSE_EVERY: usize = 4;

impl KvManager {
    fn req(&self, id: RequestId) -> Result<&Req, ManagerError> {
        self.requests
            .get(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.req.as_ref())
            .ok_or(ManagerError::UnknownRequest(id))
    }
    pub(super) fn req_mut(&mut self, id: RequestId) -> Result<&mut Req, ManagerError> {
        self.requests
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.req.as_mut())
            .ok_or(ManagerError::UnknownRequest(id))
    }

    /// A new waiting request: its prompt length and the hashes of its full blocks (prompt
    /// blocks; more may follow with [`KvManager::extend_hashes`]).
    pub fn add_request(&mut self, prompt_tokens: u64, hashes: Vec<BlockHash>) -> RequestId {
        let req = Req {
            hashes,
            prompt: prompt_tokens,
            known: prompt_tokens,
            blocks: Vec::new(),
            indexed: 0,
            computed: 0,
            slot: None,
            rolling: None,
            stored: None,
            from: None,
            tokens: Vec::new(),
        };
        let index = match self.free_requests.pop() {
            Some(i) => i,
            None => {
                self.requests.push(Slot::default());
                (self.requests.len() - 1) as u32
            }
        };
        let s = &mut self.requests[index as usize];
        s.req = Some(req);
        RequestId { index, generation: s.generation }
    }

    /// More full-block hashes of a request (generated tokens completed blocks); blocks already
    /// computed are committed to the index now.
    pub fn extend_hashes(&mut self, id: RequestId, hashes: &[BlockHash]) -> Result<(), ManagerError> {
        let r = self.req_mut(id)?;
        if let Some((first, again)) = first_repeat(r.hashes.iter().chain(hashes)) {
            return Err(ManagerError::RepeatedHash { first, again });
        }
        r.hashes.extend_from_slice(hashes);
        self.index_blocks(id)
    }

    /// Tokens of `hashes` a request would be served from the cache now: the longest cached
    /// prefix that ends at a ready checkpoint (no side effects). With a host tier, blocks and
    /// checkpoints held there count: admission brings them back.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> u64 {
        let blocks = if self.has_lower() {
            self.tier_walk(hashes).1.last().map_or(0, |e| e.0)
        } else {
            self.match_blocks(hashes, hashes.len()).0
        };
        blocks as u64 * self.block_size
    }

    /// Admission back-pressure for a waiting request, as the policy says
    /// ([`super::SplitPolicy::may_admit`]), with the request's own hit priced in: the blocks
    /// past the hit, plus what the hit must bring back from a tier below HBM, against the room
    /// obtainable *without* the hit's own blocks and checkpoint — admitting the request
    /// references them, so they are not room it can be given.
    ///
    /// Why not [`KvManager::may_admit`] with the blocks past the hit: that counts the hit's
    /// unreferenced cached blocks as evictable room. A request whose hit was most of the
    /// evictable cache was admitted with nothing left for its prefill; it stalled, and so did
    /// a running request that needed one decode block, the newest admission was preempted,
    /// its hit went back to the LRU and passed the same check the next step: a fleet engine
    /// preempted and re-admitted one request 110,726 times (issue 35), neither making
    /// progress.
    pub fn may_admit_request(&self, id: RequestId) -> Result<bool, ManagerError> {
        let r = self.req(id)?;
        if r.slot.is_some() {
            return Err(ManagerError::AlreadyRunning(id));
        }
        let bs = self.block_size;
        let limit = ((r.known.saturating_sub(1) / bs) as usize).min(r.hashes.len());
        let f = self.hit_footprint(&r.hashes[..limit]);
        let rest = (r.known.div_ceil(bs)).saturating_sub(f.blocks as u64).saturating_add(f.lower_units);
        let mut v = self.view()?;
        v.evictable_blocks =
            v.evictable_blocks.saturating_sub(u32::try_from(f.held_units).unwrap_or(u32::MAX));
        Ok(self.policy.may_admit(&v, rest))
    }

    /// What the longest hit among `hashes` occupies, as `admit` would take it: its length in
    /// blocks, the units of it now on the LRU (evictable until admission references them),
    /// and the units a tier below HBM must bring back.
    fn hit_footprint(&self, hashes: &[BlockHash]) -> HitFootprint {
        let listed = |i: u32| if self.nodes.in_lru[i as usize] { self.nodes.weight(i) } else { 0 };
        let mut f = HitFootprint::default();
        let (nodes, ck_lower) = if self.has_lower() {
            let (nodes, ends) = self.tier_walk(hashes);
            let Some(&(n, lower)) = ends.last() else { return f };
            (nodes[..n].to_vec(), lower)
        } else {
            let (n, _) = self.match_blocks(hashes, hashes.len());
            (hashes[..n].iter().map(|h| self.index[h]).collect(), false)
        };
        f.blocks = nodes.len();
        for &b in &nodes {
            if b == NIL {
                f.lower_units += 1;
            } else {
                f.held_units += listed(b);
            }
        }
        if ck_lower {
            f.lower_units += u64::from(self.units_per_ckpt);
        } else if let Some(&end) = nodes.last() {
            let c = self.nodes.block(end).ckpt;
            if c != NIL {
                f.held_units += listed(c);
            }
        }
        f
    }

    /// (blocks, checkpoint node) of the longest hit in HBM among the first `limit` hashes.
    fn match_blocks(&self, hashes: &[BlockHash], limit: usize) -> (usize, u32) {
        let mut best = (0, NIL);
        for (i, h) in hashes.iter().take(limit).enumerate() {
            let Some(&b) = self.index.get(h) else { break };
            let c = self.nodes.block(b).ckpt;
            if c != NIL && self.nodes.ckpt(c).state == CkptState::Ready {
                best = (i + 1, c);
            }
        }
        best
    }

    /// Admit a waiting request: match its prefix, take a slot (the policy may grow the slot
    /// region), reference the hit's blocks and restore the slot from the hit's checkpoint in
    /// one copy launch. On `NoSlot` or any error nothing is held.
    pub fn admit(&mut self, id: RequestId) -> Result<Admission, ManagerError> {
        let r = self.req(id)?;
        if r.slot.is_some() {
            return Err(ManagerError::AlreadyRunning(id));
        }
        // A repeated hash would match one cached block at several table positions.
        if let Some((first, again)) = first_repeat(r.hashes.iter()) {
            return Err(ManagerError::RepeatedHash { first, again });
        }
        // At least one token is computed (its logits are needed).
        let limit = (r.known.saturating_sub(1) / self.block_size) as usize;
        if self.has_lower() {
            // The part of the longest hit in the host or shared tier comes back first; the HBM hit below
            // then covers it (shorter when it could not come back).
            let hashes: Vec<BlockHash> = r.hashes.iter().take(limit).copied().collect();
            self.tier_restore_hit(&hashes)?;
        }
        let r = self.req(id)?;
        let (hit, ck) = self.match_blocks(&r.hashes, limit);
        let hit_nodes: Vec<u32> = r.hashes[..hit].iter().map(|h| self.index[h]).collect();
        // Hold the hit before taking a slot: a slot may need room, and room is found by eviction.
        for &b in &hit_nodes {
            self.nodes.unlink(b);
            self.nodes.block_mut(b).refs += 1;
        }
        if ck != NIL {
            self.nodes.unlink(ck);
            self.nodes.ckpt_mut(ck).pins += 1;
        }
        let slot = self.take_slot();
        if ck != NIL {
            self.nodes.ckpt_mut(ck).pins -= 1;
        }
        let slot = match slot {
            Ok(s) => s,
            Err(e) => {
                self.unref(&hit_nodes)?;
                if ck != NIL {
                    self.touch_ckpt(ck);
                }
                return Err(e);
            }
        };
        if ck != NIL {
            if let Err(e) = self.begin_restore(ck, slot.position) {
                self.unref(&hit_nodes)?;
                self.touch_ckpt(ck);
                self.pool.free_slot(slot.handle)?;
                return Err(e);
            }
        }
        if ck != NIL && !self.nodes.ckpt(ck).coarse {
            self.credit_coarse(&hit_nodes[..hit - 1]);
        }
        let bs = self.block_size;
        let from = (ck != NIL).then(|| self.nodes.ckpt(ck).hash);
        let r = self.req_mut(id)?;
        let known = r.known;
        r.from = from;
        r.blocks = hit_nodes;
        r.indexed = hit;
        r.computed = hit as u64 * bs;
        r.slot = Some(slot);
        self.stats.admissions += 1;
        self.admitted_tokens += known;
        if hit > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += hit as u64 * bs;
        }
        Ok(Admission { hit_tokens: hit as u64 * bs, slot })
    }

    pub(super) fn touch_ckpt(&mut self, c: u32) {
        let n = self.nodes.ckpt(c);
        if n.state == CkptState::Ready && n.pins == 0 {
            self.nodes.touch(c);
        }
    }

    /// Drop one reference from each of `nodes`, deepest first: blocks nobody references go
    /// to the LRU (deeper ones, and each block's checkpoint before its block, evicted first);
    /// private ones go back to the pool.
    pub(super) fn unref(&mut self, nodes: &[u32]) -> Result<(), ManagerError> {
        // A released chain's checkpoints below its deepest ready one are superseded: a
        // request continuing the chain restores from the deepest, so they only serve one
        // that diverges inside it. Unless proven (`CkptNode::proven`), they go to the
        // evicted-first end (their units are a whole slot image each, more than the blocks
        // between two of them).
        let (mut deeper, mut deeper_coarse) = (false, false);
        for &b in nodes.iter().rev() {
            let n = self.nodes.block_mut(b);
            n.refs -= 1;
            if n.refs > 0 {
                continue;
            }
            if n.hash.is_some() {
                let c = n.ckpt;
                if c != NIL {
                    let n = self.nodes.ckpt(c);
                    let ready = n.state == CkptState::Ready && n.pins == 0;
                    let coarse = n.coarse;
                    let demote = ready && !n.proven && if coarse { deeper_coarse } else { deeper };
                    // The chain's deepest ready checkpoint is what its next request restores:
                    // never superseded, whatever its request did below it.
                    if ready {
                        let n = self.nodes.ckpt_mut(c);
                        n.superseded = demote;
                        n.interior |= deeper;
                    }
                    if demote {
                        self.nodes.touch_front(c);
                    } else {
                        self.touch_ckpt(c);
                    }
                    deeper |= ready;
                    deeper_coarse |= ready && coarse;
                }
                self.nodes.touch(b);
            } else {
                let h = n.handle;
                self.nodes.remove(b);
                self.release_block_id(h)?;
            }
        }
        Ok(())
    }

    /// How many of `budget` prefill tokens the next chunk of a running request takes: it
    /// stops at the prompt's end (for a resumed request, at the last token it had computed)
    /// and at the next checkpoint point, so a checkpoint can be taken there. 0: the request
    /// decodes.
    pub fn prefill_stop(&self, id: RequestId, budget: u64) -> Result<u64, ManagerError> {
        let r = self.req(id)?;
        let mut end = r.known;
        let bs = self.block_size;
        let prompt_end = r.prompt / bs * bs;
        if prompt_end > r.computed {
            end = end.min(prompt_end);
        }
        let every = u64::from(self.config.checkpoint_every) * bs;
        if let Some(q) = r.computed.checked_div(every) {
            end = end.min((q + 1) * every);
        }
        Ok(end.saturating_sub(r.computed).min(budget))
    }

    /// Blocks for `tokens` more tokens of a running request (allocated, not yet committed),
    /// evicting LRU cached blocks and checkpoints when the free ones fall short. On
    /// `OutOfBlocks` nothing was evicted or allocated.
    pub fn allocate(&mut self, id: RequestId, tokens: u64) -> Result<(), ManagerError> {
        let bs = self.block_size;
        let r = self.req(id)?;
        if r.slot.is_none() {
            return Err(ManagerError::NotRunning(id));
        }
        let end = r.computed.checked_add(tokens).ok_or(ManagerError::Overflow("allocated tokens"))?;
        let want =
            usize::try_from(end.div_ceil(bs)).map_err(|_| ManagerError::Overflow("allocated blocks"))?;
        let have = r.blocks.len();
        if want <= have {
            return Ok(());
        }
        let need = u32::try_from(want - have).map_err(|_| ManagerError::Config("too many blocks"))?;
        // Fast path: the free blocks suffice (no count taken first). A shortfall returns
        // what was taken and makes room for the whole request, so the call stays
        // all-or-nothing.
        let mut got = std::mem::take(&mut self.scratch);
        got.clear();
        for _ in 0..need {
            match self.pool.alloc_block() {
                Ok(g) => got.push(g.handle),
                Err(crate::pool::PoolError::Alloc(crate::alloc::AllocError::NoFreeBlocks)) => break,
                Err(e) => {
                    self.return_blocks(&got)?;
                    return Err(e.into());
                }
            }
        }
        if got.len() < need as usize {
            self.return_blocks(&got)?;
            got.clear();
            self.make_room(need)?;
            for _ in 0..need {
                got.push(self.pool.alloc_block()?.handle);
            }
        }
        let KvManager { requests, nodes, by_id, .. } = self;
        let r = requests
            .get_mut(id.index as usize)
            .and_then(|s| s.req.as_mut())
            .ok_or(ManagerError::UnknownRequest(id))?;
        for &h in &got {
            let node = nodes.insert(Node::Block(BlockNode { handle: h, hash: None, refs: 1, ckpt: NIL }));
            let i = h.id as usize;
            if i >= by_id.len() {
                by_id.resize(i + 1, Holder::None);
            }
            by_id[i] = Holder::Block(node);
            r.blocks.push(node);
        }
        self.scratch = got;
        Ok(())
    }

    fn return_blocks(&self, blocks: &[BlockHandle]) -> Result<(), ManagerError> {
        for &b in blocks {
            self.pool.free_block(b)?;
        }
        Ok(())
    }

    /// `tokens` more tokens of a running request are in the pool (the forward that wrote
    /// them is queued): full blocks with known hashes enter the index, and a checkpoint is
    /// stored when the computed tokens land on a checkpoint point.
    pub fn commit(&mut self, id: RequestId, tokens: u64) -> Result<(), ManagerError> {
        let bs = self.block_size;
        let r = self.req_mut(id)?;
        if r.slot.is_none() {
            return Err(ManagerError::NotRunning(id));
        }
        let after = r.computed.checked_add(tokens).ok_or(ManagerError::Overflow("committed tokens"))?;
        let capacity = r.blocks.len() as u64 * bs;
        if after > capacity {
            return Err(ManagerError::CommitPastAllocation { tokens: after, capacity });
        }
        r.computed = after;
        r.known = r.known.max(after);
        self.index_blocks(id)?;
        self.maybe_checkpoint(id)
    }

    /// Put the request's full, hashed, not yet indexed blocks into the index (a block whose
    /// hash another request indexed first stays private).
    fn index_blocks(&mut self, id: RequestId) -> Result<(), ManagerError> {
        let bs = self.block_size;
        // Field borrows, not `req_mut`: this runs once per committed block.
        let KvManager { requests, index, nodes, tier, shared, publish, events, .. } = self;
        let r = requests
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.req.as_mut())
            .ok_or(ManagerError::UnknownRequest(id))?;
        let full = ((r.computed / bs) as usize).min(r.hashes.len()).min(r.blocks.len());
        for i in r.indexed..full {
            let (h, b) = (r.hashes[i], r.blocks[i]);
            if let std::collections::hash_map::Entry::Vacant(e) = index.entry(h) {
                e.insert(b);
                nodes.block_mut(b).hash = Some(h);
                // Recomputed while a copy sat in the host tier: HBM's is the one kept.
                let was_host = tier.as_mut().is_some_and(|t| t.forget_block(h));
                if shared.is_some() {
                    publish.push(h);
                }
                if let Some(l) = events.as_mut() {
                    if was_host {
                        l.removed(h, super::Medium::Cpu);
                    }
                    let bs = bs as usize;
                    let tokens = r.tokens.get(i * bs..(i + 1) * bs).unwrap_or(&[]);
                    l.learn(h, i.checked_sub(1).map(|p| r.hashes[p]), tokens);
                    l.stored(h, super::Medium::Gpu);
                }
            }
        }
        r.indexed = r.indexed.max(full);
        Ok(())
    }

    fn maybe_checkpoint(&mut self, id: RequestId) -> Result<(), ManagerError> {
        let bs = self.block_size;
        let r = self.req(id)?;
        if r.computed == 0 || r.computed % bs != 0 {
            return Ok(());
        }
        let k = (r.computed / bs) as usize;
        if k > r.indexed || k > r.hashes.len() {
            return Ok(()); // its hash is not known yet
        }
        let every = self.config.checkpoint_every as usize;
        let prompt_end = k as u64 == r.prompt / bs;
        let permanent = (every > 0 && k % every == 0) || prompt_end;
        if !permanent && !self.config.rolling {
            return Ok(());
        }
        // Two levels (`CkptNode::coarse`): prompt ends and every `COARSE_EVERY`-th permanent point.
        let coarse = prompt_end || (every > 0 && k % (COARSE_EVERY * every) == 0);
        let h = r.hashes[k - 1];
        let (prev, stored, from) = (r.rolling, r.stored, r.from);
        let Some(position) = r.slot.map(|s| s.position) else { return Err(ManagerError::NotRunning(id)) };
        let existed = self.checkpoint_state(&h).is_some();
        if !self.begin_store(h, position, !permanent, coarse)? {
            return Ok(());
        }
        // The chain has a deeper checkpoint now: the permanent one this request stored before
        // serves only a request that diverges between the two. (While it runs, whatever its
        // level: its request's next store is never far; at release the chain's deepest coarse
        // one is kept, `unref`.)
        if let Some(p) = stored.filter(|&p| p != h) {
            self.supersede(p, false);
        }
        // So has the checkpoint this request was admitted from: restored once, by the
        // request now continuing past it, it was a continuation, not a branch.
        if let Some(p) = from.filter(|&p| p != h) {
            self.supersede(p, true);
        }
        if let Some(p) = prev.filter(|&p| p != h) {
            if let Some(&b) = self.index.get(&p) {
                let c = self.nodes.block(b).ckpt;
                if c != NIL && self.nodes.ckpt(c).rolling {
                    self.unindex_node(c)?;
                }
            }
        }
        let r = self.req_mut(id)?;
        r.from = None;
        r.rolling = if permanent { None } else { Some(h) };
        if permanent && !existed {
            r.stored = Some(h);
        }
        Ok(())
    }

    /// Retention under pressure: the checkpoint ending at `hash` has a deeper one on its chain.
    /// Unless it is proven (`CkptNode::proven`), or another running request holds its block
    /// (the chain branches there, or will be continued from there), it moves to the evicted-first end of
    /// the LRU and spills to a tier only into free room. Without pressure nothing is evicted and it
    /// stays, so hits keep the finest cadence; under pressure the chain keeps its deepest
    /// checkpoint and its proven ones, and what a coarser cadence would have held in
    /// checkpoints is cache instead. Exactness is untouched: only which checkpoints are kept.
    fn supersede(&mut self, hash: BlockHash, restored_from: bool) {
        let Some(&b) = self.index.get(&hash) else { return };
        let n = self.nodes.block(b);
        let (c, shared) = (n.ckpt, n.refs > 1);
        if c == NIL {
            return;
        }
        let ck = self.nodes.ckpt_mut(c);
        if ck.state == CkptState::Evicting {
            return;
        }
        // Its chain went past it, whoever holds the block: a later restore proves a branch.
        ck.interior = true;
        // A rolling checkpoint is its own request's to drop, unless it is the one this
        // request restored (its request has left, or holds the block: `shared`).
        if shared || ck.proven || (ck.rolling && !restored_from) {
            return;
        }
        ck.superseded = true;
        if self.nodes.in_lru[c as usize] {
            self.nodes.touch_front(c);
        }
        self.stats.superseded_checkpoints += 1;
    }

    /// A restore from a fine checkpoint counts for the deepest coarse one below it on the
    /// chain, if that one is ready (`hits`: the hit's blocks below the restored one): a coarse cadence alone
    /// would have restored that one, and its restore count is what proves it a reuse point
    /// kept under pressure. Without this, the finer cadence spreads a chain's restores over
    /// points restored once each, none proven, and a request that later diverges at the
    /// coarse point finds it evicted where the coarse cadence kept it.
    fn credit_coarse(&mut self, hits: &[u32]) {
        for &b in hits.iter().rev() {
            let c = self.nodes.block(b).ckpt;
            if c == NIL || !self.nodes.ckpt(c).coarse {
                continue;
            }
            let n = self.nodes.ckpt_mut(c);
            if n.state != CkptState::Ready {
                return;
            }
            n.count_restore();
            self.touch_ckpt(c);
            return;
        }
    }

    fn release(&mut self, id: RequestId) -> Result<(), ManagerError> {
        let r = self.req_mut(id)?;
        let blocks = std::mem::take(&mut r.blocks);
        let slot = r.slot.take();
        r.indexed = 0;
        r.computed = 0;
        r.rolling = None;
        r.stored = None;
        r.from = None;
        self.unref(&blocks)?;
        if let Some(s) = slot {
            self.pool.free_slot(s.handle)?;
        }
        Ok(())
    }

    /// Preempt a running request: its slot is freed, its committed blocks stay cached (with
    /// their checkpoints), uncommitted ones are freed; it waits to be admitted again, when it
    /// hits what it committed.
    pub fn preempt(&mut self, id: RequestId) -> Result<(), ManagerError> {
        if self.req(id)?.slot.is_none() {
            return Err(ManagerError::NotRunning(id));
        }
        self.release(id)
    }

    /// A request is done: its slot is freed, its blocks stay cached; the id is retired.
    pub fn finish(&mut self, id: RequestId) -> Result<(), ManagerError> {
        self.release(id)?;
        let s = &mut self.requests[id.index as usize];
        s.req = None;
        s.generation = s.generation.wrapping_add(1);
        self.free_requests.push(id.index);
        Ok(())
    }

    /// A request's block table (pool block ids, current after every boundary move).
    pub fn block_table(&self, id: RequestId) -> Result<Vec<i32>, ManagerError> {
        Ok(self.req(id)?.blocks.iter().map(|&b| self.nodes.block(b).handle.id as i32).collect())
    }
    /// A request's block handles in table order (current after every boundary move): what
    /// the pool's writers take for its rows. Lent, not given: the manager still owns them.
    pub fn block_handles(&self, id: RequestId) -> Result<Vec<BlockHandle>, ManagerError> {
        Ok(self.req(id)?.blocks.iter().map(|&b| self.nodes.block(b).handle).collect())
    }
    /// A running request as a handoff sends it: its block handles, its slot and its computed
    /// tokens (`NotRunning` while it waits).
    pub fn request_kv(&self, id: RequestId) -> Result<crate::transfer::RequestKv, ManagerError> {
        let r = self.req(id)?;
        let slot = r.slot.ok_or(ManagerError::NotRunning(id))?;
        Ok(crate::transfer::RequestKv {
            blocks: self.block_handles(id)?,
            slot: slot.handle,
            context_len: r.computed,
        })
    }
    /// A running request's slot (current after every boundary move).
    pub fn slot(&self, id: RequestId) -> Result<Option<SlotLease>, ManagerError> {
        Ok(self.req(id)?.slot)
    }
    /// Tokens of a request whose KV and state are in the pool.
    pub fn computed_tokens(&self, id: RequestId) -> Result<u64, ManagerError> {
        Ok(self.req(id)?.computed)
    }
    /// References held on the cached block `hash` (`None`: not cached).
    pub fn block_refs(&self, hash: &BlockHash) -> Option<u32> {
        self.index.get(hash).map(|&b| self.nodes.block(b).refs)
    }
    /// The state of the checkpoint ending at `hash` (`None`: none).
    pub fn checkpoint_state(&self, hash: &BlockHash) -> Option<CkptState> {
        let &b = self.index.get(hash)?;
        let c = self.nodes.block(b).ckpt;
        (c != NIL).then(|| self.nodes.ckpt(c).state)
    }
    /// Block ids holding the checkpoint ending at `hash` (empty: none).
    pub fn checkpoint_units(&self, hash: &BlockHash) -> Vec<u32> {
        let Some(&b) = self.index.get(hash) else { return Vec::new() };
        let c = self.nodes.block(b).ckpt;
        if c == NIL {
            return Vec::new();
        }
        self.nodes.ckpt(c).units.iter().map(|u| u.id).collect()
    }
    /// Bytes of block units the checkpoints hold now.
    pub fn checkpoint_bytes_held(&self) -> u64 {
        self.stats.checkpoints_held * u64::from(self.units_per_ckpt) * self.ck.page_bytes
    }

    /// Evict every unreferenced cached block and ready unpinned checkpoint (e.g. when the
    /// namespace changes); returns the block ids freed. With a host tier they spill to it
    /// like any eviction ([`KvManager::clear_host_tier`] drops what it holds).
    pub fn evict_all(&mut self) -> Result<u64, ManagerError> {
        let mut freed = 0;
        while self.nodes.head != NIL {
            freed += self.evict(self.nodes.head)?;
        }
        Ok(freed)
    }

    // ---- transfer -------------------------------------------------------------------------

    /// The ready checkpoint ending at `hash`, read to host memory: restored into a slot taken
    /// for the purpose (the policy may grow one), read with [`crate::pool::Pool::checkpoint`]
    /// (tagged with the pool's layout id), and the slot given back.
    pub fn export_checkpoint(&mut self, hash: &BlockHash) -> Result<StoredCheckpoint, ManagerError> {
        let c = self.ready_ckpt(hash).ok_or(ManagerError::NotCached { what: "checkpoint", hash: hash.0 })?;
        // Pinned while a slot is found: finding one may evict.
        self.nodes.unlink(c);
        self.nodes.ckpt_mut(c).pins += 1;
        let slot = self.take_slot();
        self.nodes.ckpt_mut(c).pins -= 1;
        self.touch_ckpt(c);
        let slot = slot?;
        let ids: Vec<i64> = self.nodes.ckpt(c).units.iter().map(|u| i64::from(u.id)).collect();
        let image = store::copy(&self.pool, &self.ck, slot.position, &ids, false)
            .and_then(|()| Ok(self.pool.checkpoint(slot.handle)?));
        self.pool.free_slot(slot.handle)?;
        Ok(StoredCheckpoint { hash: *hash, image: image? })
    }

    /// Store an image exported by another worker under its block's hash (the block must be
    /// cached here): an image of another layout is refused before anything changes; one
    /// already present is kept (`Ok(false)`). The image goes through a slot taken for the
    /// purpose ([`crate::pool::Pool::restore`] checks its layout and size) into units like
    /// any store, visible after [`KvManager::complete_inflight`].
    pub fn import_checkpoint(&mut self, stored: &StoredCheckpoint) -> Result<bool, ManagerError> {
        self.layout_id.check_image(stored.image.layout_id())?;
        let hash = stored.hash;
        let &b = self.index.get(&hash).ok_or(ManagerError::NotCached { what: "block", hash: hash.0 })?;
        if self.nodes.block(b).ckpt != NIL {
            return Ok(false);
        }
        // Referenced while a slot and units are found, so eviction cannot take it.
        self.nodes.unlink(b);
        self.nodes.block_mut(b).refs += 1;
        let result = self.take_slot().and_then(|slot| {
            let stored_ok = self
                .pool
                .restore(slot.handle, &stored.image)
                .map_err(ManagerError::from)
                .and_then(|()| self.begin_store(hash, slot.position, false, true));
            self.pool.free_slot(slot.handle)?;
            stored_ok
        });
        self.unref(&[b])?;
        result
    }

    // ---- invariants (tests) -----------------------------------------------------------------

    /// Check every internal invariant: references equal the requests holding each block; the
    /// LRU holds exactly the unreferenced cached blocks and the ready unpinned checkpoints;
    /// every held pool block id is a block or a unit of this manager and vice versa. A
    /// description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.nodes.nodes.len()];
        for r in self.requests.iter().filter_map(|s| s.req.as_ref()) {
            for &b in &r.blocks {
                refs[b as usize] += 1;
            }
            if r.slot.is_none() && !r.blocks.is_empty() {
                return Err("a waiting request holds blocks".into());
            }
        }
        let mut held = 0u64;
        let mut lru_weight = 0u64;
        for (i, n) in self.nodes.nodes.iter().enumerate() {
            let listed = self.nodes.in_lru[i];
            match n {
                Node::Free => {
                    if listed {
                        return Err(format!("free node {i} listed"));
                    }
                }
                Node::Block(b) => {
                    held += 1;
                    if b.refs != refs[i] {
                        return Err(format!("block node {i}: refs {} but {} holders", b.refs, refs[i]));
                    }
                    if listed != (b.refs == 0 && b.hash.is_some()) {
                        return Err(format!("block node {i}: listed {listed}, refs {}", b.refs));
                    }
                    if b.refs == 0 && b.hash.is_none() {
                        return Err(format!("private block node {i} with no holder"));
                    }
                    if let Some(h) = b.hash {
                        if self.index.get(&h) != Some(&(i as u32)) {
                            return Err(format!("block node {i} hashed but not indexed"));
                        }
                    }
                    if self.by_id.get(b.handle.id as usize) != Some(&Holder::Block(i as u32)) {
                        return Err(format!("block node {i} id {} not mapped", b.handle.id));
                    }
                    self.pool.check_block(b.handle).map_err(|e| format!("block node {i}: {e}"))?;
                    if b.ckpt != NIL && self.nodes.ckpt(b.ckpt).block != i as u32 {
                        return Err(format!("block node {i}: checkpoint link broken"));
                    }
                    if listed {
                        lru_weight += 1;
                    }
                }
                Node::Ckpt(c) => {
                    held += c.units.len() as u64;
                    if listed != (c.state == CkptState::Ready && c.pins == 0) {
                        return Err(format!("checkpoint {i}: listed {listed} in state {:?}", c.state));
                    }
                    if c.block != NIL && self.nodes.block(c.block).hash != Some(c.hash) {
                        return Err(format!("checkpoint {i} sits on a block of another hash"));
                    }
                    if (c.state == CkptState::Evicting) != (c.block == NIL) {
                        return Err(format!("checkpoint {i}: state {:?} with block {}", c.state, c.block));
                    }
                    for (k, u) in c.units.iter().enumerate() {
                        if self.by_id.get(u.id as usize) != Some(&Holder::Unit(i as u32, k as u32)) {
                            return Err(format!("checkpoint {i} unit {} not mapped", u.id));
                        }
                        self.pool.check_block(*u).map_err(|e| format!("checkpoint {i} unit: {e}"))?;
                    }
                    if listed {
                        lru_weight += c.units.len() as u64;
                    }
                }
            }
        }
        if lru_weight != self.nodes.lru_blocks {
            return Err(format!("LRU weight {} but {} listed", self.nodes.lru_blocks, lru_weight));
        }
        let c = self.pool.counts().map_err(|e| e.to_string())?;
        if u64::from(c.num_blocks - c.free_blocks) != held {
            return Err(format!("pool holds {} blocks, manager {held}", c.num_blocks - c.free_blocks));
        }
        self.check_tier()
    }
}

/// The first repeated value among `hashes`: (index of its first occurrence, of the repeat).
fn first_repeat<'a>(hashes: impl Iterator<Item = &'a BlockHash>) -> Option<(usize, usize)> {
    let mut seen = std::collections::HashMap::new();
    for (i, h) in hashes.enumerate() {
        if let Some(&first) = seen.get(h) {
            return Some((first, i));
        }
        seen.insert(*h, i);
    }
    None
}
