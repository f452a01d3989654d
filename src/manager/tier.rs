//! The tiers under the manager: the host tier (issue 14) and the shared tier (issue 35).
//!
//! **The host tier.** Cached blocks and checkpoints that LRU eviction takes out of HBM spill
//! to a [`HostTier`] (page-locked host memory on CUDA) instead of being dropped, stay findable
//! by their hash, and come back into fresh blocks, byte-exact, when a hit needs them.
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
//! **The shared tier** ([`SharedTier`]: files in a directory every engine of a fleet mounts,
//! or any [`Tier`] given to [`KvManager::set_shared_tier`]) is inclusive and not the
//! manager's alone: what this manager commits is *published* there (written through, at
//! [`KvManager::complete_inflight`]: the blocks indexed and the checkpoints that became ready
//! since the last one, each once), and stays in HBM; other engines publish too and the tier
//! evicts on its own, so the manager keeps no index or count of it and asks it on each walk.
//! A restore from it leaves the entry there. Its failures are misses (counted in
//! [`ManagerStats`]), never errors, except a device copy's.
//!
//! Admission first brings back the lower part of the longest hit ([`KvManager::tier_restore_hit`]),
//! looking in HBM, then the host tier, then the shared tier for each block and checkpoint:
//! room for it is made the usual way (the HBM part of the hit held meanwhile), each entry is
//! restored all-or-nothing into fresh blocks on the pool's stream (from the host tier if it
//! holds it, else from the shared tier), and the restored blocks and checkpoint are indexed as
//! ordinary HBM ones, so admission then proceeds as for an HBM hit. When the room cannot be
//! made, the next shorter hit is tried; an entry that is gone (dropped while room was made,
//! refused as corrupt) ends the restore there. Either way the hit is shorter, never wrong,
//! and nothing stays allocated that the tables do not hold.

use super::{
    BlockHash, BlockNode, CkptState, Holder, KvManager, ManagerError, ManagerStats, Medium, Node, NIL,
};
use crate::alloc::BlockHandle;
use crate::pool::Pool;
use crate::transfer::{EntryKind, HostTier, HostTierError, SharedKey, SharedTier, StoreTier};
use std::hash::Hash;

/// A store below HBM that block units go to and come back from, byte-exact, keyed by `K`,
/// with its own recency and budget. As the **host tier** (exclusive) the manager drives it:
/// what spills is what eviction takes, a restore takes the entry out, and the manager forgets
/// what it reports dropped; [`HostTier`] — host memory of the pool's backend, page-locked on
/// CUDA — is the implementation the manager builds (`ManagerConfig::host_tier_bytes`). As
/// the **shared tier** (inclusive, a fleet's; see the module docs) a spill publishes a copy,
/// a restore leaves the entry, and what it holds may change between any two calls;
/// [`SharedTier`] (files) is the implementation the manager builds
/// (`ManagerConfig::shared_tier`), another (a remote store, a simulator's model) is given to
/// [`KvManager::set_shared_tier`].
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
    /// Which of `keys` are held (a remote store answers in one round trip).
    fn contains_many(&self, keys: &[K]) -> Vec<bool> {
        keys.iter().map(|k| self.contains(k)).collect()
    }
    /// Held keys, least recent first.
    fn lru_order(&self) -> Vec<K>;
    /// Mark `key` most recent; whether it is held.
    fn touch(&mut self, key: &K) -> bool;
    /// Drop `key`; whether it was held.
    fn evict(&mut self, key: &K) -> bool;
    /// Copy `blocks` (block units of `pool`) out under `key`, dropping least recent entries for
    /// room; returns the keys dropped.
    fn spill(&mut self, pool: &Pool, key: K, blocks: &[BlockHandle]) -> Result<Vec<K>, HostTierError>;
    /// Copy `key`'s units back into fresh blocks of `pool` (all or nothing) and drop it here
    /// (a shared tier keeps it).
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

/// What `tier_bring_back` did.
enum Brought {
    /// The hit is in HBM now.
    All,
    /// No room could be made; nothing changed but recency.
    NoRoom,
    /// An entry was gone or refused: the first this many hashes' blocks are in HBM (what
    /// came back is indexed), the rest of the hit is not.
    Upto(usize),
}

/// What a tier holds: a block's unit, or the units of the checkpoint ending at a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TierKey {
    /// The unit of the block of this hash.
    Block(BlockHash),
    /// The units of the checkpoint ending at the block of this hash.
    Ckpt(BlockHash),
}

impl TierKey {
    /// The shared tier's key (its file name) for this key.
    pub fn shared(self) -> SharedKey {
        match self {
            TierKey::Block(h) => SharedKey { kind: EntryKind::Block, hash: h.0 },
            TierKey::Ckpt(h) => SharedKey { kind: EntryKind::Checkpoint, hash: h.0 },
        }
    }
}

/// The shared tiers' (file, store) `evict`, `spill` and `restore` under the manager's key: the
/// tier's own call on the key's [`SharedKey`]; a spill publishes and evicts nothing else.
macro_rules! shared_key_spill_restore {
    ($tier:ident) => {
        fn evict(&mut self, key: &TierKey) -> bool {
            $tier::evict(self, &key.shared())
        }
        fn spill(
            &mut self,
            pool: &Pool,
            key: TierKey,
            blocks: &[BlockHandle],
        ) -> Result<Vec<TierKey>, HostTierError> {
            self.publish(pool, key.shared(), blocks).map(|_| Vec::new())
        }
        fn restore(&mut self, pool: &Pool, key: &TierKey) -> Result<Vec<BlockHandle>, HostTierError> {
            $tier::restore(self, pool, &key.shared())
        }
    };
}

/// The file tier as the manager's shared tier: a spill publishes (an entry already there is
/// kept), a restore leaves the entry, the tier's own evictions are no one's to forget.
impl Tier<TierKey> for SharedTier {
    fn unit_bytes(&self) -> u64 {
        SharedTier::unit_bytes(self)
    }
    fn capacity_units(&self) -> u64 {
        SharedTier::capacity_units(self)
    }
    fn used_units(&self) -> u64 {
        SharedTier::used_units(self)
    }
    fn is_empty(&self) -> bool {
        // Other engines may have published since anything was asked: never known empty.
        false
    }
    fn contains(&self, key: &TierKey) -> bool {
        SharedTier::contains(self, &key.shared())
    }
    fn lru_order(&self) -> Vec<TierKey> {
        let key = |k: SharedKey| match k.kind {
            EntryKind::Block => TierKey::Block(BlockHash(k.hash)),
            EntryKind::Checkpoint => TierKey::Ckpt(BlockHash(k.hash)),
        };
        SharedTier::lru_order(self).into_iter().map(key).collect()
    }
    fn touch(&mut self, key: &TierKey) -> bool {
        SharedTier::touch(self, &key.shared())
    }
    shared_key_spill_restore!(SharedTier);
}

/// A key-value store's tier (Mooncake Store) as the manager's shared tier: as the file
/// tier, with the walk's look-ups batched and the store's own eviction (no LRU order here).
impl Tier<TierKey> for StoreTier {
    fn unit_bytes(&self) -> u64 {
        StoreTier::unit_bytes(self)
    }
    fn capacity_units(&self) -> u64 {
        StoreTier::capacity_units(self)
    }
    fn used_units(&self) -> u64 {
        // The store's, not known here.
        0
    }
    fn is_empty(&self) -> bool {
        false
    }
    fn contains(&self, key: &TierKey) -> bool {
        StoreTier::contains(self, &key.shared())
    }
    fn contains_many(&self, keys: &[TierKey]) -> Vec<bool> {
        let keys: Vec<SharedKey> = keys.iter().map(|k| k.shared()).collect();
        StoreTier::contains_many(self, &keys)
    }
    fn lru_order(&self) -> Vec<TierKey> {
        Vec::new()
    }
    fn touch(&mut self, key: &TierKey) -> bool {
        StoreTier::contains(self, &key.shared())
    }
    shared_key_spill_restore!(StoreTier);
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

    /// Drop the host copy of block `h` (HBM holds it again); whether there was one.
    pub(super) fn forget_block(&mut self, h: BlockHash) -> bool {
        self.forget(TierKey::Block(h))
    }

    /// Drop the host copy of the checkpoint ending at `h`.
    pub(super) fn forget_ckpt(&mut self, h: BlockHash) {
        self.forget(TierKey::Ckpt(h));
    }

    /// Whether anything is held (an empty tier adds nothing to a match).
    pub(super) fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    pub(super) fn holds(&self, key: TierKey) -> bool {
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
        for &k in &keys {
            if let TierKey::Block(h) = k {
                // A host block is never in HBM too: it is gone from every local tier.
                self.event_removed(h, Medium::Cpu, true);
            }
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
        let mut dropped = Vec::new();
        for k in evicted {
            t.count(k, false);
            stats.tier_host_evictions += 1;
            if let TierKey::Block(h) = k {
                // Its block is in neither place now (a tier block is never in HBM).
                if t.forget(TierKey::Ckpt(h)) {
                    stats.tier_host_evictions += 1;
                }
                dropped.push(h);
            }
        }
        stats.tier_spilled_bytes += units.len() as u64 * t.host.unit_bytes();
        for h in dropped {
            self.event_removed(h, Medium::Cpu, true);
        }
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
        // A superseded one saves fewer prefill tokens per byte than anything it would push out
        // of the tier (physical.rs, `CkptNode::superseded`): it takes free room only.
        let free =
            self.tier.as_ref().map_or(0, |t| t.host.capacity_units().saturating_sub(t.host.used_units()));
        if c.superseded && free < units.len() as u64 {
            return Ok(());
        }
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
        if !self.has_lower() {
            return (nodes, ends);
        }
        let mut known = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let node = match self.index.get(h) {
                Some(&b) => b,
                None if self.lower_holds(TierKey::Block(*h), hashes, i, &mut known) => NIL,
                None => break,
            };
            nodes.push(node);
            let ck = if node == NIL { NIL } else { self.nodes.block(node).ckpt };
            if ck != NIL {
                if self.nodes.ckpt(ck).state == CkptState::Ready {
                    ends.push((i + 1, false));
                }
            } else if self.lower_holds(TierKey::Ckpt(*h), hashes, i, &mut known) {
                ends.push((i + 1, true));
            }
        }
        (nodes, ends)
    }

    /// Whether a tier below HBM may hold part of a hit: a host tier holding anything, or a
    /// shared tier (never known empty).
    pub(super) fn has_lower(&self) -> bool {
        self.tier.as_ref().is_some_and(|t| !t.is_empty()) || self.shared.is_some()
    }

    /// Whether the host tier, else the shared tier, holds `key`, the block and checkpoint
    /// entry of `hashes[i]`; the shared tier's answers are asked in growing batches
    /// (`known`, both keys per hash) so that a store answers a long prefix in a few round
    /// trips and a chain that breaks early asks little past the break.
    fn lower_holds(&self, key: TierKey, hashes: &[BlockHash], i: usize, known: &mut Vec<bool>) -> bool {
        if self.tier.as_ref().is_some_and(|t| t.holds(key)) {
            return true;
        }
        let Some(s) = self.shared.as_ref() else { return false };
        if 2 * i >= known.len() {
            let from = known.len() / 2;
            let upto = hashes.len().min(i + (from + 1).clamp(8, 1024));
            let keys: Vec<TierKey> =
                hashes[from..upto].iter().flat_map(|&h| [TierKey::Block(h), TierKey::Ckpt(h)]).collect();
            known.extend(s.contains_many(&keys));
            // A tier that answered for fewer (or more) keys than asked: the rest are misses.
            known.resize(2 * upto, false);
        }
        known[2 * i + usize::from(matches!(key, TierKey::Ckpt(_)))]
    }

    /// Bring the host part of the longest hit among `hashes` back into HBM (see the module
    /// docs). Refusals for room shorten the hit; only copy failures are errors.
    pub(super) fn tier_restore_hit(&mut self, hashes: &[BlockHash]) -> Result<(), ManagerError> {
        // An empty tier walks nothing: the HBM match that follows is the whole answer.
        let mut limit = hashes.len();
        let mut shortened = false;
        'walk: loop {
            let (nodes, ends) = self.tier_walk(&hashes[..limit]);
            for &(n, lower_ck) in ends.iter().rev() {
                let lower_blocks = nodes[..n].iter().filter(|&&b| b == NIL).count() as u64;
                let need = lower_blocks + if lower_ck { u64::from(self.units_per_ckpt) } else { 0 };
                if need == 0 {
                    break 'walk; // an HBM hit
                }
                match self.tier_bring_back(&hashes[..n], &nodes[..n], lower_ck, need)? {
                    Brought::All => break 'walk,
                    Brought::NoRoom => shortened = true,
                    // Entries gone or refused: what came back is in HBM, and the hit is looked
                    // for again before the first one missing (a strictly shorter walk).
                    Brought::Upto(m) => {
                        shortened = true;
                        limit = m;
                        continue 'walk;
                    }
                }
            }
            break;
        }
        if shortened {
            self.stats.tier_shortened_hits += 1;
        }
        Ok(())
    }

    /// Make room for `need` blocks with the HBM part of the hit held, then restore the hit's
    /// lower blocks in order and its lower checkpoint.
    fn tier_bring_back(
        &mut self,
        hashes: &[BlockHash],
        nodes: &[u32],
        lower_ck: bool,
        need: u64,
    ) -> Result<Brought, ManagerError> {
        let n = nodes.len();
        // The hit is used: its host entries become the tier's most recent (evicted last while
        // room is made), its HBM blocks the LRU's when released below.
        if let Some(t) = self.tier.as_mut() {
            for (h, _) in hashes.iter().zip(nodes).filter(|(_, &b)| b == NIL) {
                t.host.touch(&TierKey::Block(*h));
            }
            if lower_ck {
                t.host.touch(&TierKey::Ckpt(hashes[n - 1]));
            }
        }
        let held: Vec<u32> = nodes.iter().copied().filter(|&b| b != NIL).collect();
        for &b in &held {
            self.nodes.unlink(b);
            self.nodes.block_mut(b).refs += 1;
        }
        let ck = if lower_ck { NIL } else { self.nodes.block(nodes[n - 1]).ckpt };
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
            Err(ManagerError::OutOfBlocks { .. }) => return Ok(Brought::NoRoom),
            Err(e) => return Err(e),
        }
        let mut restored = Vec::new();
        // A copy failure stops the restore like a missing entry, and is returned once what
        // came back is in the tables.
        let mut failed = None;
        // The first hash whose block did not come back.
        let mut missing = None;
        // For the events: (index in the hit, whether it came from the host tier).
        let mut came = Vec::new();
        for (i, (&h, _)) in hashes.iter().zip(nodes).enumerate().filter(|(_, (_, &b))| b == NIL) {
            let from_host = self.tier.as_ref().is_some_and(|t| t.holds(TierKey::Block(h)));
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
                    came.push((i, from_host));
                }
                Ok(None) => {
                    missing = Some(i);
                    break;
                }
                Err(e) => {
                    missing = Some(i);
                    failed = Some(e);
                    break;
                }
            }
        }
        if missing.is_none() && lower_ck {
            let h = hashes[n - 1];
            // Complete: every block of the hit is in HBM now.
            let end = self.index[&h];
            // The walk saw no record on the block; should one be there now, it serves the hit.
            if self.nodes.block(end).ckpt == NIL {
                match self.tier_take(TierKey::Ckpt(h)) {
                    Ok(Some(units)) => {
                        let c = self.attach_ckpt(end, h, units, CkptState::Ready, false, true);
                        self.stats.checkpoints_held += 1;
                        self.nodes.touch(c);
                    }
                    Ok(None) => missing = Some(n - 1),
                    Err(e) => {
                        missing = Some(n - 1);
                        failed = Some(e);
                    }
                }
            }
        }
        // Deepest first, as `unref` lists them.
        for &b in restored.iter().rev() {
            self.nodes.touch(b);
        }
        if let Some(l) = self.events.as_mut() {
            // What left the host tier, then everything now in HBM (one event each, in chain order).
            for &(i, _) in came.iter().filter(|c| c.1) {
                l.removed(hashes[i], Medium::Cpu);
            }
            for &(i, _) in &came {
                let h = hashes[i];
                // A block from the shared tier is another engine's: its parent is the chain's,
                // its tokens unknown here.
                if !l.knows(h) {
                    l.learn(h, i.checked_sub(1).map(|p| hashes[p]), &[]);
                }
                l.stored(h, Medium::Gpu);
            }
        }
        match (failed, missing) {
            (Some(e), _) => Err(e),
            (None, Some(m)) => Ok(Brought::Upto(m)),
            (None, None) => Ok(Brought::All),
        }
    }

    /// Restore `key` into fresh blocks (all or nothing): from the host tier (the entry leaves
    /// it) if it holds it, else from the shared tier (the entry stays). `None` when neither
    /// holds it any more, the pool has no room, or the shared tier's entry was refused.
    fn tier_take(&mut self, key: TierKey) -> Result<Option<Vec<BlockHandle>>, ManagerError> {
        match self.host_take(key)? {
            Some(units) => Ok(Some(units)),
            None => self.shared_take(key),
        }
    }

    fn host_take(&mut self, key: TierKey) -> Result<Option<Vec<BlockHandle>>, ManagerError> {
        let KvManager { tier, pool, stats, .. } = self;
        let Some(t) = tier.as_mut().filter(|t| t.holds(key)) else { return Ok(None) };
        match t.host.restore(pool, &key) {
            Ok(units) => {
                t.count(key, false);
                stats.tier_restored_bytes += units.len() as u64 * t.host.unit_bytes();
                match key {
                    TierKey::Block(_) => stats.tier_restored_blocks += 1,
                    TierKey::Ckpt(_) => stats.tier_restored_checkpoints += 1,
                }
                Ok(Some(units))
            }
            Err(HostTierError::NotHeld | HostTierError::NoRoom { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Restore `key` from the shared tier. Only a device copy's failure is an error: an
    /// entry refused on reading (torn, corrupt, foreign, the directory gone) is a miss.
    fn shared_take(&mut self, key: TierKey) -> Result<Option<Vec<BlockHandle>>, ManagerError> {
        let KvManager { shared, pool, stats, .. } = self;
        let Some(s) = shared.as_mut() else { return Ok(None) };
        match s.restore(pool, &key) {
            Ok(units) => {
                stats.shared_restored_bytes += units.len() as u64 * s.unit_bytes();
                match key {
                    TierKey::Block(_) => stats.shared_restored_blocks += 1,
                    TierKey::Ckpt(_) => stats.shared_restored_checkpoints += 1,
                }
                Ok(Some(units))
            }
            Err(HostTierError::NotHeld | HostTierError::NoRoom { .. }) => Ok(None),
            Err(HostTierError::Pool(e)) => Err(e.into()),
            Err(_) => {
                stats.shared_refused += 1;
                Ok(None)
            }
        }
    }

    /// Publish to the shared tier what became complete since the last call: the blocks
    /// indexed (those still in HBM) and the checkpoint records `ready` (called by
    /// `complete_inflight`, once the batch that wrote them has completed). An entry already
    /// there is kept; a write that fails is counted and skipped; only a device copy's failure
    /// is an error.
    pub(super) fn shared_publish(&mut self, ready: &[u32]) -> Result<(), ManagerError> {
        let blocks = std::mem::take(&mut self.publish);
        if self.shared.is_none() {
            return Ok(());
        }
        for h in blocks {
            let Some(&b) = self.index.get(&h) else { continue }; // evicted meanwhile
            let handle = self.nodes.block(b).handle;
            self.shared_put(TierKey::Block(h), &[handle])?;
        }
        for &i in ready {
            let (hash, units) = match &self.nodes.nodes[i as usize] {
                Node::Ckpt(c) if c.state == CkptState::Ready && c.block != NIL => (c.hash, c.units.clone()),
                _ => continue,
            };
            self.shared_put(TierKey::Ckpt(hash), &units)?;
        }
        Ok(())
    }

    fn shared_put(&mut self, key: TierKey, units: &[BlockHandle]) -> Result<(), ManagerError> {
        let KvManager { shared, pool, stats, .. } = self;
        let Some(s) = shared.as_mut() else { return Ok(()) };
        if s.contains(&key) {
            return Ok(());
        }
        match s.spill(pool, key, units) {
            Ok(_) => {
                stats.shared_published_bytes += units.len() as u64 * s.unit_bytes();
                match key {
                    TierKey::Block(h) => {
                        stats.shared_published_blocks += 1;
                        self.event_stored(h, Medium::Storage);
                    }
                    TierKey::Ckpt(_) => stats.shared_published_checkpoints += 1,
                }
                Ok(())
            }
            Err(HostTierError::Pool(e)) => Err(e.into()),
            Err(_) => {
                stats.shared_write_failures += 1;
                Ok(())
            }
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
