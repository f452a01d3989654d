//! The block pool of §5.1: PAGE units, each one block's envelope in every plane.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use super::idset::IdSet;
use super::{next_pool_id, AllocError, BlockHash, MAX_IDS};

/// Where a block is in its life. The spec's "free set" is `Free`; "marked used" is `Used`;
/// `Popped` is the window between `pop` and `allocate`, in neither.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Popped,
    Used,
}

/// A raw unit's reservation: checkpoint storage, immovable and never freed by `free`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawUnit {
    /// Who reserved the unit (the caller's id, checked on release).
    pub owner: u64,
    /// Position of this unit in the owner's reservation (the order the image is laid in).
    pub piece: u32,
}

/// One block's state, 32 bytes so two share a cache line: the hash is a value plus a flag
/// rather than an `Option`, and a raw unit's (owner, piece) lives in a side map.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Block {
    /// Meaningful only with `has_hash`; zeroed without it so equality sees no stale bits.
    hash_value: BlockHash,
    /// Bumped whenever the id is handed out anew or its holder is relocated away.
    generation: u64,
    ref_count: u32,
    /// Tokens the block's content covers (a count; the engine keeps token ids if it verifies
    /// prefix hits).
    tokens: u32,
    /// Stamp of this block's one valid entry in the cached queue.
    stamp: u32,
    state: State,
    has_hash: bool,
    /// A raw unit: its reservation is in `BlockPool::units`.
    raw: bool,
}

impl Block {
    const FRESH: Block = Block {
        hash_value: 0,
        generation: 0,
        ref_count: 0,
        tokens: 0,
        stamp: 0,
        state: State::Free,
        has_hash: false,
        raw: false,
    };

    #[inline]
    fn hash(&self) -> Option<BlockHash> {
        self.has_hash.then_some(self.hash_value)
    }

    #[inline]
    fn set_hash(&mut self, hash: Option<BlockHash>) {
        self.has_hash = hash.is_some();
        self.hash_value = hash.unwrap_or(0);
    }
}

/// The prefix index's hasher: keys are already content hashes, so one multiply mixes enough,
/// at a fraction of SipHash's cost.
#[derive(Clone, Copy, Debug, Default)]
struct IndexHasher(u64);

impl Hasher for IndexHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        // Hash mixing, not arithmetic on input: wrapping is the point.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type Index = HashMap<BlockHash, u32, BuildHasherDefault<IndexHasher>>;

/// A generation-checked reference to one block of one pool. Everyone sharing a block holds the
/// same handle; a relocation replaces it with the `new` handle of a [`BlockMove`](crate::boundary::BlockMove).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHandle {
    /// Block id: the block's index in the block region.
    pub id: u32,
    /// Generation of the id when handed out; a freed or relocated id's handle goes stale.
    pub generation: u64,
    /// Id of the pool that handed it out (foreign handles are refused).
    pub pool: u32,
}

/// What [`BlockPool::alloc`] hands out: the handle, and the hash whose index entry the block
/// carried (the prefix cache lost that entry; a checkpoint keyed by it must be unindexed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGrant {
    /// The block handed out.
    pub handle: BlockHandle,
    /// The prefix-cache hash whose cached block was evicted to make room, if any.
    pub evicted: Option<BlockHash>,
}

/// Raw units taken by [`BlockPool::reserve_units`], in piece order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Block ids, one per unit.
    pub ids: Vec<u32>,
    /// Index entries dropped because a cached block was handed out as a unit.
    pub evicted: Vec<BlockHash>,
}

/// What [`BlockPool::retire_top`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRetired {
    /// The old top id, now outside the pool.
    pub retired: u32,
    /// Where the top's holders, hash and content went (`None`: the top was free and dropped).
    /// The caller copies the bytes and rewrites every block table.
    pub moved_to: Option<u32>,
    /// The hash that left the index: the free top's own, or the destination's.
    pub evicted: Option<BlockHash>,
}

/// The block allocator of §5.1. It knows ids, reference counts and the prefix-cache index,
/// nothing of rows, bytes or kernels.
///
/// Free ids live in two containers: **vacant** (no hash; lowest id first, so the blocks next
/// to the gap stay cold and `retire_top` is cheap) and **cached** (has a hash; FIFO in release
/// order, so the least recently freed content goes first). Vacant is an exact hierarchical
/// bitset whose `min` is the spec's min-heap top (faster than a heap, and no stale entries).
/// Cached is a queue with lazy deletion: an entry is valid only if the block is still free,
/// still has a hash and carries the block's current stamp; anything else is skipped when it
/// surfaces.
///
/// `Clone` keeps the pool id: a clone is a snapshot of the same pool, and handles stay valid
/// against it. Equality compares observable state (stale container entries do not count).
#[derive(Clone, Debug)]
pub struct BlockPool {
    pool: u32,
    num_blocks: u32,
    max_blocks: u32,
    num_free: u32,
    /// Indexed by id; may be longer than `num_blocks` after `retire_top` (kept for reuse).
    blocks: Vec<Block>,
    index: Index,
    /// Reservations of the blocks flagged `raw`.
    units: HashMap<u32, RawUnit>,
    vacant: IdSet,
    cached: VecDeque<(u32, u32)>,
}

impl BlockPool {
    /// A pool of `num_blocks` vacant blocks; `max_blocks = num_blocks`.
    pub fn new(num_blocks: u32) -> Result<Self, AllocError> {
        Self::with_max_blocks(num_blocks, num_blocks)
    }

    /// A pool of `num_blocks` vacant blocks that `extend` may grow to `max_blocks`.
    pub fn with_max_blocks(num_blocks: u32, max_blocks: u32) -> Result<Self, AllocError> {
        check_id_limit("max_blocks", max_blocks)?;
        if max_blocks < num_blocks {
            return Err(AllocError::MaxBelowNum { max_blocks, num_blocks });
        }
        let mut pool = BlockPool {
            pool: next_pool_id(),
            num_blocks: 0,
            max_blocks,
            num_free: 0,
            blocks: Vec::new(),
            index: Index::default(),
            units: HashMap::new(),
            vacant: IdSet::default(),
            cached: VecDeque::new(),
        };
        pool.extend(num_blocks);
        Ok(pool)
    }

    /// This pool's id, carried by its handles.
    pub fn pool_id(&self) -> u32 {
        self.pool
    }
    /// Blocks the allocator manages now.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Most blocks it may grow to.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }
    /// Size of the free set.
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Change the ceiling `extend` grows to; never below the current count.
    pub fn set_max_blocks(&mut self, max_blocks: u32) -> Result<(), AllocError> {
        check_id_limit("max_blocks", max_blocks)?;
        if max_blocks < self.num_blocks {
            return Err(AllocError::MaxBelowNum { max_blocks, num_blocks: self.num_blocks });
        }
        self.max_blocks = max_blocks;
        Ok(())
    }

    // ---- inspection ------------------------------------------------------------------------

    fn block(&self, id: u32) -> Result<&Block, AllocError> {
        if id >= self.num_blocks {
            return Err(AllocError::BlockOutOfRange { id, num_blocks: self.num_blocks });
        }
        Ok(&self.blocks[id as usize])
    }

    /// References held on block `id`.
    pub fn ref_count(&self, id: u32) -> Result<u32, AllocError> {
        Ok(self.block(id)?.ref_count)
    }
    /// The block's hash field (it may no longer be findable: see `publish`).
    pub fn hash(&self, id: u32) -> Result<Option<BlockHash>, AllocError> {
        Ok(self.block(id)?.hash())
    }
    /// Tokens written into block `id`.
    pub fn tokens(&self, id: u32) -> Result<u32, AllocError> {
        Ok(self.block(id)?.tokens)
    }
    /// In the free set.
    pub fn is_free(&self, id: u32) -> Result<bool, AllocError> {
        Ok(self.block(id)?.state == State::Free)
    }
    /// Popped and not yet allocated: neither free nor used.
    pub fn is_popped(&self, id: u32) -> Result<bool, AllocError> {
        Ok(self.block(id)?.state == State::Popped)
    }
    /// The raw-unit reservation holding block `id`, if any.
    pub fn raw_unit(&self, id: u32) -> Result<Option<RawUnit>, AllocError> {
        self.block(id)?;
        Ok(self.unit(id))
    }
    /// The handle a holder of `id` has now (any state; `check` says whether it is live).
    pub fn current_handle(&self, id: u32) -> Result<BlockHandle, AllocError> {
        let generation = self.block(id)?.generation;
        Ok(BlockHandle { id, generation, pool: self.pool })
    }
    #[inline]
    fn unit(&self, id: u32) -> Option<RawUnit> {
        if self.blocks[id as usize].raw {
            self.units.get(&id).copied()
        } else {
            None
        }
    }

    /// Free ids in the order `pop` would hand them out (vacant ascending, then cached LRU).
    pub fn free_order(&self) -> Vec<u32> {
        let mut out: Vec<u32> = self.vacant.iter().collect();
        out.extend(self.cached.iter().filter(|&&e| self.cached_valid(e)).map(|&(id, _)| id));
        out
    }

    /// Physical length of the cached queue, stale entries included (tests bound it).
    #[cfg(test)]
    pub(crate) fn cached_queue_len(&self) -> usize {
        self.cached.len()
    }

    // ---- the spec's id-based operations ----------------------------------------------------

    #[inline]
    fn cached_valid(&self, (id, stamp): (u32, u32)) -> bool {
        id < self.num_blocks && {
            let b = &self.blocks[id as usize];
            b.state == State::Free && b.has_hash && b.stamp == stamp
        }
    }

    /// Next free id in pop order below `bound`, taken out of the free set.
    fn take_free_below(&mut self, bound: u32) -> Option<u32> {
        let id = match self.vacant.min() {
            Some(id) if id < bound => id,
            // Cached entries stay where they are; taking the block makes its entry stale.
            _ => self.cached.iter().find(|&&e| e.0 < bound && self.cached_valid(e))?.0,
        };
        self.leave_free_set(id);
        Some(id)
    }

    /// A free block stops being free (it is popped; callers set the final state).
    #[inline]
    fn leave_free_set(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if !b.has_hash {
            self.vacant.remove(id);
        }
        b.state = State::Popped;
        self.num_free -= 1;
    }

    /// Next free id: lowest vacant, else least recently freed cached. Removed from the free set
    /// but not marked used: follow with [`allocate`](Self::allocate).
    #[inline]
    pub fn pop(&mut self) -> Result<u32, AllocError> {
        if self.num_free == 0 {
            return Err(AllocError::NoFreeBlocks);
        }
        let id = match self.vacant.min() {
            Some(id) => id,
            None => loop {
                // num_free > 0 and nothing vacant: a valid cached entry exists.
                let e = self.cached.pop_front().ok_or(AllocError::NoFreeBlocks)?;
                if self.cached_valid(e) {
                    break e.0;
                }
            },
        };
        self.leave_free_set(id);
        Ok(id)
    }

    /// Hand `id` (ref 0) out anew: drop the index entry it owns (returned), clear its content,
    /// ref = 1. Content is lost here, never at `free`.
    #[inline]
    pub fn allocate(&mut self, id: u32) -> Result<Option<BlockHash>, AllocError> {
        let b = self.block(id)?;
        if b.ref_count != 0 {
            return Err(AllocError::BlockReferenced { id, ref_count: b.ref_count });
        }
        let evicted = match b.hash() {
            Some(h) if self.index.get(&h) == Some(&id) => {
                self.index.remove(&h);
                Some(h)
            }
            _ => None,
        };
        if self.blocks[id as usize].state == State::Free {
            self.leave_free_set(id);
        }
        let b = &mut self.blocks[id as usize];
        b.set_hash(None);
        b.tokens = 0;
        b.ref_count = 1;
        b.state = State::Used;
        b.generation += 1;
        Ok(evicted)
    }

    /// Prefix hit: share a used block, or take a free one back keeping its hash and content.
    pub fn claim(&mut self, id: u32) -> Result<(), AllocError> {
        let b = self.block(id)?;
        if let Some(unit) = self.unit(id) {
            return Err(AllocError::RawUnit { id, owner: unit.owner });
        }
        if b.state == State::Used {
            let r = b.ref_count.checked_add(1).ok_or(AllocError::RefCountOverflow { id })?;
            self.blocks[id as usize].ref_count = r;
            return Ok(());
        }
        if b.state == State::Free {
            self.leave_free_set(id);
        }
        let b = &mut self.blocks[id as usize];
        b.ref_count = 1;
        b.state = State::Used;
        b.generation += 1;
        Ok(())
    }

    /// Record a held block's content and index `hash → id`. A hash indexed to another block is
    /// re-pointed (that block keeps its hash field but is no longer findable). If `id` owned
    /// the index entry of a different hash, that entry is dropped and returned: the block's
    /// content is no longer what the old hash names.
    pub fn publish(
        &mut self,
        id: u32,
        hash: BlockHash,
        tokens: u32,
    ) -> Result<Option<BlockHash>, AllocError> {
        let b = self.block(id)?;
        if let Some(unit) = self.unit(id) {
            return Err(AllocError::RawUnit { id, owner: unit.owner });
        }
        if b.state != State::Used {
            return Err(AllocError::BlockNotHeld { id });
        }
        let dropped = match b.hash() {
            Some(old) if old != hash && self.index.get(&old) == Some(&id) => {
                self.index.remove(&old);
                Some(old)
            }
            _ => None,
        };
        self.index.insert(hash, id);
        let b = &mut self.blocks[id as usize];
        b.set_hash(Some(hash));
        b.tokens = tokens;
        Ok(dropped)
    }

    /// Drop one reference; at 0 the block joins the free set, cached if it has a hash, else
    /// vacant. Its content stays until it is handed out again.
    #[inline]
    pub fn free(&mut self, id: u32) -> Result<(), AllocError> {
        let b = self.block(id)?;
        if let Some(unit) = self.unit(id) {
            return Err(AllocError::RawUnit { id, owner: unit.owner });
        }
        if b.state != State::Used {
            return Err(AllocError::BlockNotHeld { id });
        }
        self.release(id);
        Ok(())
    }

    /// `free` without the checks (the caller made them).
    #[inline]
    fn release(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.ref_count -= 1;
        if b.ref_count > 0 {
            return;
        }
        b.state = State::Free;
        self.num_free += 1;
        if b.has_hash {
            b.stamp = b.stamp.wrapping_add(1);
            self.cached.push_back((id, b.stamp));
            // Stale entries of blocks re-freed behind a long-lived head would pile up; one
            // in-place sweep per `len` pushes keeps the queue within twice the pool.
            if self.cached.len() > 2 * self.blocks.len() + 16 {
                let (blocks, n) = (&self.blocks, self.num_blocks);
                self.cached.retain(|&(id, stamp)| {
                    id < n && {
                        let b = &blocks[id as usize];
                        b.state == State::Free && b.has_hash && b.stamp == stamp
                    }
                });
            }
        } else {
            self.vacant.insert(id);
        }
    }

    /// The block a hash is indexed to.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.index.get(&hash).copied()
    }

    /// Empty the index: unreferenced blocks forget their content, referenced ones keep it but
    /// can no longer be found, every free block becomes vacant.
    pub fn clear_index(&mut self) {
        self.index.clear();
        for b in &mut self.blocks[..self.num_blocks as usize] {
            if b.ref_count == 0 {
                b.set_hash(None);
                b.tokens = 0;
            }
        }
        self.cached.clear();
        for id in 0..self.num_blocks {
            if self.blocks[id as usize].state == State::Free {
                self.vacant.insert(id);
            }
        }
    }

    /// Take `count` free ids (pop order) as raw units of `owner`, pieces `0..count`; `None` if
    /// fewer are free (nothing taken).
    pub fn reserve_units(&mut self, count: u32, owner: u64) -> Option<Reservation> {
        if count > self.num_free {
            return None;
        }
        let mut out = Reservation { ids: Vec::with_capacity(count as usize), evicted: Vec::new() };
        for piece in 0..count {
            // Cannot fail: count <= num_free, and a popped id has ref 0.
            let id = self.pop().ok()?;
            if let Ok(Some(h)) = self.allocate(id) {
                out.evicted.push(h);
            }
            self.blocks[id as usize].raw = true;
            self.units.insert(id, RawUnit { owner, piece });
            out.ids.push(id);
        }
        Some(out)
    }

    /// Free raw units: `ids[i]` must be `owner`'s piece `i`. Everything is validated first; on
    /// any mismatch nothing is released.
    pub fn release_units(&mut self, ids: &[u32], owner: u64) -> Result<(), AllocError> {
        for (piece, &id) in ids.iter().enumerate() {
            self.block(id)?;
            let found = self.unit(id);
            let piece = u32::try_from(piece).map_err(|_| AllocError::UnitMismatch {
                id,
                owner,
                piece: u32::MAX,
                found,
            })?;
            if found != Some(RawUnit { owner, piece }) {
                return Err(AllocError::UnitMismatch { id, owner, piece, found });
            }
        }
        for &id in ids {
            self.blocks[id as usize].raw = false;
            self.units.remove(&id);
            self.release(id);
        }
        Ok(())
    }

    /// Add up to `count` vacant ids at the top, never past `max_blocks`; returns how many.
    pub fn extend(&mut self, count: u32) -> u32 {
        let taken = count.min(self.max_blocks - self.num_blocks);
        let end = self.num_blocks + taken;
        if self.blocks.len() < end as usize {
            self.blocks.resize(end as usize, Block::FRESH);
            self.vacant.grow_to(end as usize);
            self.cached.reserve((2 * end as usize + 16).saturating_sub(self.cached.len()));
        }
        for id in self.num_blocks..end {
            let b = &mut self.blocks[id as usize];
            // A retired id comes back blank; its generation carries on so old handles stay dead.
            *b = Block { generation: b.generation, stamp: b.stamp, ..Block::FRESH };
            self.vacant.insert(id);
        }
        self.num_blocks = end;
        self.num_free += taken;
        taken
    }

    /// Remove the top id (§5.1). `None`, changing nothing, if the pool is empty, the top is a
    /// raw unit or popped, or the top is held and no free id is below it.
    pub fn retire_top(&mut self) -> Option<BlockRetired> {
        self.retire_top_into(self.num_blocks.saturating_sub(1))
    }

    /// `retire_top` taking the destination (in pop order) only among ids below `bound`, so a
    /// boundary move never lands on an id it is about to retire too.
    pub(crate) fn retire_top_into(&mut self, bound: u32) -> Option<BlockRetired> {
        let top = self.num_blocks.checked_sub(1)?;
        let t = self.blocks[top as usize].clone();
        if t.raw || t.state == State::Popped {
            return None;
        }
        let owns = |index: &Index, h: Option<BlockHash>, id: u32| match h {
            Some(h) if index.get(&h) == Some(&id) => Some(h),
            _ => None,
        };
        let mut out = BlockRetired { retired: top, moved_to: None, evicted: None };
        if t.state == State::Free {
            out.evicted = owns(&self.index, t.hash(), top);
            if let Some(h) = out.evicted {
                self.index.remove(&h);
            }
            self.leave_free_set(top);
        } else {
            let dest = self.take_free_below(bound.min(top))?;
            out.moved_to = Some(dest);
            out.evicted = owns(&self.index, self.blocks[dest as usize].hash(), dest);
            if let Some(h) = out.evicted {
                self.index.remove(&h);
            }
            if let Some(h) = owns(&self.index, t.hash(), top) {
                self.index.insert(h, dest);
            }
            let d = &mut self.blocks[dest as usize];
            *d = Block { generation: d.generation + 1, stamp: d.stamp, ..t.clone() };
        }
        let b = &mut self.blocks[top as usize];
        *b = Block { generation: t.generation + 1, stamp: t.stamp, ..Block::FRESH };
        self.num_blocks = top;
        Some(out)
    }

    // ---- the engine-facing handle path -----------------------------------------------------

    /// `pop` + `allocate`: a fresh block with ref 1.
    #[inline]
    pub fn alloc(&mut self) -> Result<BlockGrant, AllocError> {
        let id = self.pop()?;
        let evicted = self.allocate(id)?;
        let generation = self.blocks[id as usize].generation;
        Ok(BlockGrant { handle: BlockHandle { id, generation, pool: self.pool }, evicted })
    }

    /// The handle is this pool's, current, and its block held.
    #[inline]
    pub fn check(&self, handle: BlockHandle) -> Result<(), AllocError> {
        let b = self.resolve(handle)?;
        if b.state != State::Used {
            return Err(AllocError::NotHeld { what: "block", id: handle.id });
        }
        Ok(())
    }

    #[inline]
    fn resolve(&self, handle: BlockHandle) -> Result<&Block, AllocError> {
        if handle.pool != self.pool {
            return Err(AllocError::ForeignHandle {
                what: "block",
                handle_pool: handle.pool,
                pool: self.pool,
            });
        }
        let current = match self.blocks.get(handle.id as usize) {
            Some(b) if handle.id < self.num_blocks && b.generation == handle.generation => return Ok(b),
            Some(b) => b.generation,
            None => 0,
        };
        Err(AllocError::StaleHandle { what: "block", id: handle.id, generation: handle.generation, current })
    }

    /// Drop the reference `handle` stands for. A handle whose block is free is a double free;
    /// one whose id was handed out anew or relocated is stale; neither changes anything.
    #[inline]
    pub fn free_handle(&mut self, handle: BlockHandle) -> Result<(), AllocError> {
        let b = self.resolve(handle)?;
        if b.state != State::Used {
            return Err(AllocError::DoubleFree {
                what: "block",
                id: handle.id,
                generation: handle.generation,
            });
        }
        if let Some(unit) = self.unit(handle.id) {
            return Err(AllocError::RawUnit { id: handle.id, owner: unit.owner });
        }
        self.release(handle.id);
        Ok(())
    }

    /// Prefix hit by id (from `lookup`): `claim`, then the handle to hold.
    pub fn claim_handle(&mut self, id: u32) -> Result<BlockHandle, AllocError> {
        self.claim(id)?;
        self.current_handle(id)
    }

    /// `publish` through a handle.
    pub fn publish_handle(
        &mut self,
        handle: BlockHandle,
        hash: BlockHash,
        tokens: u32,
    ) -> Result<Option<BlockHash>, AllocError> {
        self.check(handle)?;
        self.publish(handle.id, hash, tokens)
    }
}

impl PartialEq for BlockPool {
    fn eq(&self, other: &Self) -> bool {
        let n = self.num_blocks as usize;
        self.pool == other.pool
            && self.num_blocks == other.num_blocks
            && self.max_blocks == other.max_blocks
            && self.num_free == other.num_free
            && self.index == other.index
            && self.units == other.units
            && self.blocks.len() >= n
            && other.blocks.len() >= n
            // Stamps are bookkeeping of the lazy queue; the free order below covers them.
            && self.blocks[..n].iter().zip(&other.blocks[..n]).all(|(a, b)| Block { stamp: 0, ..a.clone() } == Block { stamp: 0, ..b.clone() })
            // Generations of retired ids keep their handles dead, so they are state too.
            && self.blocks[n..].iter().map(|b| b.generation).eq(other.blocks[n..].iter().map(|b| b.generation))
            && self.free_order() == other.free_order()
    }
}
impl Eq for BlockPool {}

fn check_id_limit(what: &'static str, count: u32) -> Result<(), AllocError> {
    if count > MAX_IDS {
        return Err(AllocError::TooManyIds { what, count: u64::from(count), limit: MAX_IDS });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_block_is_half_a_cache_line() {
        assert_eq!(std::mem::size_of::<super::Block>(), 32);
    }
}
