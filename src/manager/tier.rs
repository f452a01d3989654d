//! The host tier under the manager (issue 14): cached blocks and checkpoints that LRU
//! eviction takes out of HBM spill to a [`HostTier`] (page-locked host memory on CUDA)
//! instead of being dropped, stay findable by their hash, and come back into fresh blocks,
//! byte-exact, when a hit needs them.
//!
//! The manager decides, by recency, and nothing else does: what spills is exactly what the
//! manager's LRU evicts (the tier is not a second policy); the tier keeps its own recency
//! (spill or hit) and drops its least recent entries when the budget is full, and the
//! manager forgets what it drops. A hash is resident in at most one place:
//!
//! * a block is in HBM (the manager's index) **or** in the tier (`TierKey::Block`), never
//!   both — a block recomputed in HBM drops its host copy;
//! * a checkpoint is in HBM (a record on its block's node) or in the tier
//!   (`TierKey::Ckpt`) and is kept only while its block is resident somewhere: the tier
//!   dropping a block drops the checkpoint that ends at it.
//!
//! Admission first brings back the host part of the longest hit ([`KvManager::tier_restore_hit`]):
//! room for it is made the usual way (the HBM part of the hit held meanwhile), each entry is
//! restored all-or-nothing into fresh blocks on the pool's stream, and the restored blocks and
//! checkpoint are indexed as ordinary HBM ones, so admission then proceeds as for an HBM hit.
//! When the room cannot be made, the next shorter hit is tried; an entry the tier dropped
//! while room was made ends the restore there. Either way the hit is shorter, never wrong,
//! and nothing stays allocated that the tables do not hold.

use super::{BlockHash, BlockNode, CkptState, Holder, KvManager, ManagerError, ManagerStats, Node, NIL};
use crate::alloc::BlockHandle;
use crate::pool::Pool;
use crate::transfer::{HostTier, HostTierError};
use std::hash::Hash;

/// A store below HBM that the manager's evicted block units spill to and come back from,
/// byte-exact, keyed by `K`, with its own recency and budget. The manager drives it (what
/// spills is what eviction takes) and forgets what it reports dropped. [`HostTier`] — host
/// memory of the pool's backend, page-locked on CUDA — is the implementation the manager
/// builds (`ManagerConfig::host_tier_bytes`); another tier (disk, a remote store) implements
/// these calls and is constructed in `ManagerTier::new`.
pub trait Tier<K>: Send {
    /// Bytes of one block unit.
    fn unit_bytes(&self) -> u64;
    /// Units the budget holds.
    fn capacity_units(&self) -> u64;
    /// Units held now.
    fn used_units(&self) -> u64;
    /// Whether nothing is held.
    fn is_empty(&self) -> bool;
    /// Whether `key` is held.
    fn contains(&self, key: &K) -> bool;
    /// Held keys, least recent first.
    fn lru_order(&self) -> Vec<K>;
    /// Mark `key` most recent; whether it is held.
    fn touch(&mut self, key: &K) -> bool;
    /// Drop `key`; whether it was held.
    fn evict(&mut self, key: &K) -> bool;
    /// Copy `blocks` (block units of `pool`) out under `key`, dropping least recent entries for
    /// room; returns the keys dropped.
    fn spill(&mut self, pool: &Pool, key: K, blocks: &[BlockHandle]) -> Result<Vec<K>, HostTierError>;
    /// Copy `key`'s units back into fresh blocks of `pool` (all or nothing) and drop it here.
    fn restore(&mut self, pool: &Pool, key: &K) -> Result<Vec<BlockHandle>, HostTierError>;
}

impl<K: Eq + Hash + Clone + Send> Tier<K> for HostTier<K>
where
    HostTier<K>: Send,
{
    fn unit_bytes(&self) -> u64 {
        HostTier::unit_bytes(self)
    }
    fn capacity_units(&self) -> u64 {
        HostTier::capacity_units(self)
    }
    fn used_units(&self) -> u64 {
        HostTier::used_units(self)
    }
    fn is_empty(&self) -> bool {
        HostTier::is_empty(self)
    }
    fn contains(&self, key: &K) -> bool {
        HostTier::contains(self, key)
    }
    fn lru_order(&self) -> Vec<K> {
        HostTier::lru_order(self)
    }
    fn touch(&mut self, key: &K) -> bool {
        HostTier::touch(self, key)
    }
    fn evict(&mut self, key: &K) -> bool {
        HostTier::evict(self, key)
    }
    fn spill(&mut self, pool: &Pool, key: K, blocks: &[BlockHandle]) -> Result<Vec<K>, HostTierError> {
        HostTier::spill(self, pool, key, blocks)
    }
    fn restore(&mut self, pool: &Pool, key: &K) -> Result<Vec<BlockHandle>, HostTierError> {
        HostTier::restore(self, pool, key)
    }
}

/// What the tier holds: a block's unit, or the units of the checkpoint ending at a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum TierKey {
    Block(BlockHash),
    Ckpt(BlockHash),
}

/// The host tier with the manager's counts of what it holds.
pub(super) struct ManagerTier {
    host: Box<dyn Tier<TierKey>>,
    blocks: u64,
    ckpts: u64,
}

impl ManagerTier {
    /// A tier of `budget` host bytes for `pool`; `None` for a budget of 0. A budget below one
    /// unit (it could hold nothing) is refused rather than silently ignored.
    pub(super) fn new(pool: &Pool, budget: u64) -> Result<Option<ManagerTier>, ManagerError> {
        if budget == 0 {
            return Ok(None);
        }
        let host: Box<dyn Tier<TierKey>> = Box::new(HostTier::new(pool, budget)?);
        if host.capacity_units() == 0 {
            return Err(ManagerError::Config("host tier budget is below one block unit"));
        }
        Ok(Some(ManagerTier { host, blocks: 0, ckpts: 0 }))
    }

    fn count(&mut self, key: TierKey, up: bool) {
        let c = match key {
            TierKey::Block(_) => &mut self.blocks,
            TierKey::Ckpt(_) => &mut self.ckpts,
        };
        if up {
            *c += 1;
        } else {
            *c -= 1;
        }
    }

    /// Drop `key`; whether it was held.
    fn forget(&mut self, key: TierKey) -> bool {
        let held = self.host.evict(&key);
        if held {
            self.count(key, false);
        }
        held
    }

    /// Drop the host copy of block `h` (HBM holds it again).
    pub(super) fn forget_block(&mut self, h: BlockHash) {
        self.forget(TierKey::Block(h));
    }

    /// Drop the host copy of the checkpoint ending at `h`.
    pub(super) fn forget_ckpt(&mut self, h: BlockHash) {
        self.forget(TierKey::Ckpt(h));
    }

    /// Whether anything is held (an empty tier adds nothing to a match).
    pub(super) fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    fn holds(&self, key: TierKey) -> bool {
        self.host.contains(&key)
    }
}

impl KvManager {
    /// Drop everything the host tier holds (e.g. when the namespace changes); returns the
    /// entries dropped. Nothing happens without a tier.
    pub fn clear_host_tier(&mut self) -> u64 {
        let Some(t) = self.tier.as_mut() else { return 0 };
        let keys = t.host.lru_order();
        for &k in &keys {
            t.forget(k);
        }
        keys.len() as u64
    }

    /// Spill `units` under `key` (a stale copy under the same key is replaced: the content
    /// is a function of the hash). `Ok(false)`: the entry exceeds the whole budget and is
    /// dropped instead. The tier's own evictions are forgotten here, each block's checkpoint
    /// with it.
    fn tier_put(&mut self, key: TierKey, units: &[BlockHandle]) -> Result<bool, ManagerError> {
        let KvManager { tier, pool, stats, .. } = self;
        let Some(t) = tier.as_mut() else { return Ok(false) };
        t.forget(key);
        let evicted = match t.host.spill(pool, key, units) {
            Ok(evicted) => evicted,
            Err(HostTierError::TooLarge { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        t.count(key, true);
        for k in evicted {
            t.count(k, false);
            stats.tier_host_evictions += 1;
            if let TierKey::Block(h) = k {
                // Its block is in neither place now (a tier block is never in HBM).
                if t.forget(TierKey::Ckpt(h)) {
                    stats.tier_host_evictions += 1;
                }
            }
        }
        stats.tier_spilled_bytes += units.len() as u64 * t.host.unit_bytes();
        Ok(true)
    }

    /// Before checkpoint node `i` leaves HBM: a ready one on an indexed block spills.
    pub(super) fn tier_spill_ckpt(&mut self, i: u32) -> Result<(), ManagerError> {
        if self.tier.is_none() {
            return Ok(());
        }
        let c = self.nodes.ckpt(i);
        // A copying record has no complete image yet; an unindexed one is being dropped.
        if c.state != CkptState::Ready || c.block == NIL {
            return Ok(());
        }
        let (h, units) = (c.hash, c.units.clone());
        if self.tier_put(TierKey::Ckpt(h), &units)? {
            self.stats.tier_spilled_checkpoints += 1;
        }
        Ok(())
    }

    /// Before cached block `b` leaves HBM: its checkpoint (if any, first: spilling the block
    /// may then drop it, never the reverse) and the block spill. A block that does not
    /// spill takes its host checkpoint with it.
    pub(super) fn tier_spill_block(&mut self, b: &BlockNode) -> Result<(), ManagerError> {
        let (Some(_), Some(h)) = (&self.tier, b.hash) else { return Ok(()) };
        let ckpt = if b.ckpt != NIL { self.tier_spill_ckpt(b.ckpt) } else { Ok(()) };
        let block = self.tier_put(TierKey::Block(h), &[b.handle]);
        if let Ok(true) = block {
            self.stats.tier_spilled_blocks += 1;
        } else if let Some(t) = self.tier.as_mut() {
            t.forget(TierKey::Ckpt(h));
        }
        ckpt.and(block.map(drop))
    }

    /// The longest prefix of `hashes` resident anywhere: per block its HBM node (NIL: in
    /// the tier), and the hit ends in it, shortest first: (blocks, whether the checkpoint
    /// ending there is in the tier).
    pub(super) fn tier_walk(&self, hashes: &[BlockHash]) -> (Vec<u32>, Vec<(usize, bool)>) {
        let (mut nodes, mut ends) = (Vec::new(), Vec::new());
        let Some(t) = self.tier.as_ref().filter(|t| !t.is_empty()) else { return (nodes, ends) };
        for (i, h) in hashes.iter().enumerate() {
            let node = match self.index.get(h) {
                Some(&b) => b,
                None if t.holds(TierKey::Block(*h)) => NIL,
                None => break,
            };
            nodes.push(node);
            let ck = if node == NIL { NIL } else { self.nodes.block(node).ckpt };
            if ck != NIL {
                if self.nodes.ckpt(ck).state == CkptState::Ready {
                    ends.push((i + 1, false));
                }
            } else if t.holds(TierKey::Ckpt(*h)) {
                ends.push((i + 1, true));
            }
        }
        (nodes, ends)
    }

    /// Bring the host part of the longest hit among `hashes` back into HBM (see the module
    /// docs). Refusals for room shorten the hit; only copy failures are errors.
    pub(super) fn tier_restore_hit(&mut self, hashes: &[BlockHash]) -> Result<(), ManagerError> {
        // An empty tier walks nothing: the HBM match that follows is the whole answer.
        let (nodes, ends) = self.tier_walk(hashes);
        for (k, &(n, host_ck)) in ends.iter().enumerate().rev() {
            let host_blocks = nodes[..n].iter().filter(|&&b| b == NIL).count() as u64;
            let need = host_blocks + if host_ck { u64::from(self.units_per_ckpt) } else { 0 };
            if need == 0 {
                return Ok(()); // an HBM hit
            }
            if self.tier_bring_back(&hashes[..n], &nodes[..n], host_ck, need)? {
                return Ok(());
            }
            if k + 1 == ends.len() {
                self.stats.tier_shortened_hits += 1;
            }
        }
        Ok(())
    }

    /// Make room for `need` blocks with the HBM part of the hit held, then restore the hit's
    /// host blocks in order and its host checkpoint. `Ok(false)`: no room, nothing changed
    /// but the hit's recency.
    fn tier_bring_back(
        &mut self,
        hashes: &[BlockHash],
        nodes: &[u32],
        host_ck: bool,
        need: u64,
    ) -> Result<bool, ManagerError> {
        let n = nodes.len();
        // The hit is used: its host entries become the tier's most recent (evicted last while
        // room is made), its HBM blocks the LRU's when released below.
        if let Some(t) = self.tier.as_mut() {
            for (h, _) in hashes.iter().zip(nodes).filter(|(_, &b)| b == NIL) {
                t.host.touch(&TierKey::Block(*h));
            }
            if host_ck {
                t.host.touch(&TierKey::Ckpt(hashes[n - 1]));
            }
        }
        let held: Vec<u32> = nodes.iter().copied().filter(|&b| b != NIL).collect();
        for &b in &held {
            self.nodes.unlink(b);
            self.nodes.block_mut(b).refs += 1;
        }
        let ck = if host_ck { NIL } else { self.nodes.block(nodes[n - 1]).ckpt };
        if ck != NIL {
            self.nodes.unlink(ck);
            self.nodes.ckpt_mut(ck).pins += 1;
        }
        let room = u32::try_from(need)
            .map_err(|_| ManagerError::Config("too many blocks"))
            .and_then(|r| self.make_room(r));
        if ck != NIL {
            self.nodes.ckpt_mut(ck).pins -= 1;
        }
        // Back to the LRU (with the checkpoint), unless a request holds them.
        self.unref(&held)?;
        match room {
            Ok(()) => {}
            Err(ManagerError::OutOfBlocks { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        let mut restored = Vec::new();
        // A copy failure stops the restore like a missing entry, and is returned once what
        // came back is in the tables.
        let mut failed = None;
        for (&h, _) in hashes.iter().zip(nodes).filter(|(_, &b)| b == NIL) {
            match self.tier_take(TierKey::Block(h)) {
                Ok(Some(units)) => {
                    let node = self.nodes.insert(Node::Block(BlockNode {
                        handle: units[0],
                        hash: Some(h),
                        refs: 0,
                        ckpt: NIL,
                    }));
                    self.set_holder(units[0].id, Holder::Block(node));
                    self.index.insert(h, node);
                    restored.push(node);
                    self.stats.tier_restored_blocks += 1;
                }
                Ok(None) => break,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let mut complete = restored.len() == nodes.iter().filter(|&&b| b == NIL).count();
        if complete && host_ck {
            let h = hashes[n - 1];
            // Complete: every block of the hit is in HBM now.
            let end = self.index[&h];
            // The walk saw no record on the block; should one be there now, it serves the hit.
            if self.nodes.block(end).ckpt == NIL {
                match self.tier_take(TierKey::Ckpt(h)) {
                    Ok(Some(units)) => {
                        let c = self.attach_ckpt(end, h, units, CkptState::Ready, false);
                        self.stats.checkpoints_held += 1;
                        self.stats.tier_restored_checkpoints += 1;
                        self.nodes.touch(c);
                    }
                    Ok(None) => complete = false,
                    Err(e) => {
                        complete = false;
                        failed = Some(e);
                    }
                }
            }
        }
        // Deepest first, as `unref` lists them.
        for &b in restored.iter().rev() {
            self.nodes.touch(b);
        }
        if !complete {
            self.stats.tier_shortened_hits += 1;
        }
        failed.map_or(Ok(true), Err)
    }

    /// Restore `key` into fresh blocks (all or nothing; the entry leaves the tier). `None`
    /// when the tier no longer holds it or the pool has no room.
    fn tier_take(&mut self, key: TierKey) -> Result<Option<Vec<BlockHandle>>, ManagerError> {
        let KvManager { tier, pool, stats, .. } = self;
        let Some(t) = tier.as_mut() else { return Ok(None) };
        match t.host.restore(pool, &key) {
            Ok(units) => {
                t.count(key, false);
                stats.tier_restored_bytes += units.len() as u64 * t.host.unit_bytes();
                Ok(Some(units))
            }
            Err(HostTierError::NotHeld | HostTierError::NoRoom { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The tier's figures in `s`.
    pub(super) fn tier_stats(&self, s: &mut ManagerStats) {
        if let Some(t) = &self.tier {
            s.tier_resident_blocks = t.blocks;
            s.tier_resident_checkpoints = t.ckpts;
            s.tier_resident_bytes = t.host.used_units() * t.host.unit_bytes();
        }
    }

    /// The tier's invariants: no block in both places, no checkpoint without its block, the
    /// counts right.
    pub(super) fn check_tier(&self) -> Result<(), String> {
        let Some(t) = &self.tier else { return Ok(()) };
        let (mut blocks, mut ckpts) = (0u64, 0u64);
        for key in t.host.lru_order() {
            match key {
                TierKey::Block(h) => {
                    blocks += 1;
                    if self.index.contains_key(&h) {
                        return Err(format!("block {:032x} both in HBM and in the host tier", h.0));
                    }
                }
                TierKey::Ckpt(h) => {
                    ckpts += 1;
                    if !self.index.contains_key(&h) && !t.holds(TierKey::Block(h)) {
                        return Err(format!("host checkpoint {:032x} without its block", h.0));
                    }
                }
            }
        }
        if (blocks, ckpts) != (t.blocks, t.ckpts) {
            return Err(format!(
                "host tier holds {blocks} blocks and {ckpts} checkpoints, counted {} and {}",
                t.blocks, t.ckpts
            ));
        }
        Ok(())
    }
}
