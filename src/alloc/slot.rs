//! The slot pool of §5.2, V4 half: state groups, lowest vacant first.
//!
//! The spec's slot pool also has a checkpointed half (an LRU of groups still backing a hash,
//! with `file_checkpoint`, `claim`, `pin`, `release_pins`) for fork-style GDN state. V4 never
//! uses it: its checkpoints are copies in PAGE units (§6). It is left out; a group here is
//! only ever vacant or held. `pin` here is the V4 need that remains: a held group whose bytes
//! are being read elsewhere (a transfer in flight) must not be relocated or released.

use super::idset::IdSet;
use super::{next_pool_id, AllocError, MAX_IDS};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Group {
    held: bool,
    pinned: bool,
    /// Bumped whenever the group is handed out anew or its holder is relocated away.
    generation: u64,
}

const FRESH: Group = Group { held: false, pinned: false, generation: 0 };

/// A generation-checked reference to one slot group of one pool. Memory takes positions:
/// convert with `position = slot_positions - 1 - group` (the geometry's `physical_slot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotHandle {
    /// The allocator's slot id (a group; `physical_slot` turns it into a position).
    pub group: u32,
    /// Generation of the group when handed out; a freed group's handle goes stale.
    pub generation: u64,
    /// Id of the pool that handed it out (foreign handles are refused).
    pub pool: u32,
}

/// What [`SlotPool::retire_top`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRetired {
    /// The old top group, now outside the pool.
    pub retired: u32,
    /// The group the top's holder moved to (`None`: the top was vacant and dropped). The
    /// caller copies slot(top) to slot(target) before the next forward and re-points the
    /// request.
    pub relocated_to: Option<u32>,
}

/// The V4 slot allocator: groups `0..num_groups`, vacant ones in a hierarchical bitset
/// (lowest first, exact membership).
///
/// `Clone` keeps the pool id (a snapshot of the same pool); equality is of observable state.
#[derive(Clone, Debug)]
pub struct SlotPool {
    pool: u32,
    num_groups: u32,
    num_free: u32,
    /// Indexed by group; may be longer than `num_groups` after `retire_top`.
    groups: Vec<Group>,
    vacant: IdSet,
}

impl SlotPool {
    /// `num_groups` vacant groups.
    pub fn new(num_groups: u32) -> Result<Self, AllocError> {
        let mut pool = SlotPool {
            pool: next_pool_id(),
            num_groups: 0,
            num_free: 0,
            groups: Vec::new(),
            vacant: IdSet::default(),
        };
        pool.extend(num_groups)?;
        Ok(pool)
    }

    /// This pool's id (handles carry it).
    pub fn pool_id(&self) -> u32 {
        self.pool
    }
    /// Groups the allocator manages now.
    pub fn num_groups(&self) -> u32 {
        self.num_groups
    }
    /// Groups not handed out.
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    fn group(&self, group: u32) -> Result<&Group, AllocError> {
        if group >= self.num_groups {
            return Err(AllocError::GroupOutOfRange { group, num_groups: self.num_groups });
        }
        Ok(&self.groups[group as usize])
    }
    /// Whether group `group` is handed out.
    pub fn is_held(&self, group: u32) -> Result<bool, AllocError> {
        Ok(self.group(group)?.held)
    }
    /// Whether group `group` is pinned (cannot be relocated).
    pub fn is_pinned(&self, group: u32) -> Result<bool, AllocError> {
        Ok(self.group(group)?.pinned)
    }
    /// The handle a holder of `group` has now (any state; `check` says whether it is live).
    pub fn current_handle(&self, group: u32) -> Result<SlotHandle, AllocError> {
        let generation = self.group(group)?.generation;
        Ok(SlotHandle { group, generation, pool: self.pool })
    }

    /// Lowest vacant group, now held.
    #[inline]
    pub fn pop(&mut self) -> Result<u32, AllocError> {
        if self.num_free == 0 {
            return Err(AllocError::NoFreeSlots);
        }
        let g = self.vacant.min().ok_or(AllocError::NoFreeSlots)?;
        self.vacant.remove(g);
        let grp = &mut self.groups[g as usize];
        grp.held = true;
        grp.generation += 1;
        self.num_free -= 1;
        Ok(g)
    }

    /// Back to vacant. A pinned group cannot be released.
    #[inline]
    pub fn release(&mut self, group: u32) -> Result<(), AllocError> {
        let g = self.group(group)?;
        if !g.held {
            return Err(AllocError::NotHeld { what: "slot", id: group });
        }
        if g.pinned {
            return Err(AllocError::GroupPinned { group });
        }
        self.groups[group as usize].held = false;
        self.num_free += 1;
        self.vacant.insert(group);
        Ok(())
    }

    /// Add `count` vacant groups at the top.
    pub fn extend(&mut self, count: u32) -> Result<(), AllocError> {
        let end =
            self.num_groups.checked_add(count).filter(|&e| e <= MAX_IDS).ok_or(AllocError::TooManyIds {
                what: "slot groups",
                count: u64::from(self.num_groups) + u64::from(count),
                limit: MAX_IDS,
            })?;
        if self.groups.len() < end as usize {
            self.groups.resize(end as usize, FRESH);
            self.vacant.grow_to(end as usize);
        }
        for g in self.num_groups..end {
            let grp = &mut self.groups[g as usize];
            *grp = Group { generation: grp.generation, ..FRESH };
            self.vacant.insert(g);
        }
        self.num_groups = end;
        self.num_free += count;
        Ok(())
    }

    /// Remove the top group (§5.2, V4 half). `None`, changing nothing, if the pool is empty,
    /// the top is pinned, or the top is held and no other group is vacant.
    pub fn retire_top(&mut self) -> Option<SlotRetired> {
        let top = self.num_groups.checked_sub(1)?;
        let t = self.groups[top as usize];
        if t.pinned {
            return None;
        }
        let mut out = SlotRetired { retired: top, relocated_to: None };
        if t.held {
            // The top is held, so it is not vacant: the lowest vacant is another group.
            let target = self.vacant.min()?;
            self.vacant.remove(target);
            let tg = &mut self.groups[target as usize];
            tg.held = true;
            tg.generation += 1;
            out.relocated_to = Some(target);
        }
        // Either the vacant top leaves the free set, or the target joins the held ones.
        self.vacant.remove(top);
        self.num_free -= 1;
        self.groups[top as usize] = Group { generation: t.generation + 1, ..FRESH };
        self.num_groups = top;
        Some(out)
    }

    /// Keep a held group in place: no relocation, no release, until `unpin`.
    pub fn pin(&mut self, group: u32) -> Result<(), AllocError> {
        if !self.group(group)?.held {
            return Err(AllocError::NotHeld { what: "slot", id: group });
        }
        self.groups[group as usize].pinned = true;
        Ok(())
    }

    /// Unpin a pinned group.
    pub fn unpin(&mut self, group: u32) -> Result<(), AllocError> {
        if !self.group(group)?.pinned {
            return Err(AllocError::GroupNotPinned { group });
        }
        self.groups[group as usize].pinned = false;
        Ok(())
    }

    // ---- the engine-facing handle path -----------------------------------------------------

    /// `pop`, as a handle.
    #[inline]
    pub fn alloc(&mut self) -> Result<SlotHandle, AllocError> {
        let group = self.pop()?;
        Ok(SlotHandle { group, generation: self.groups[group as usize].generation, pool: self.pool })
    }

    #[inline]
    fn resolve(&self, handle: SlotHandle) -> Result<&Group, AllocError> {
        if handle.pool != self.pool {
            return Err(AllocError::ForeignHandle {
                what: "slot",
                handle_pool: handle.pool,
                pool: self.pool,
            });
        }
        let current = match self.groups.get(handle.group as usize) {
            Some(g) if handle.group < self.num_groups && g.generation == handle.generation => return Ok(g),
            Some(g) => g.generation,
            None => 0,
        };
        Err(AllocError::StaleHandle {
            what: "slot",
            id: handle.group,
            generation: handle.generation,
            current,
        })
    }

    /// The handle is this pool's, current, and its group held.
    #[inline]
    pub fn check(&self, handle: SlotHandle) -> Result<(), AllocError> {
        if !self.resolve(handle)?.held {
            return Err(AllocError::NotHeld { what: "slot", id: handle.group });
        }
        Ok(())
    }

    /// `release` through a handle; double free and stale handles are errors that change
    /// nothing.
    #[inline]
    pub fn free_handle(&mut self, handle: SlotHandle) -> Result<(), AllocError> {
        if !self.resolve(handle)?.held {
            return Err(AllocError::DoubleFree {
                what: "slot",
                id: handle.group,
                generation: handle.generation,
            });
        }
        self.release(handle.group)
    }

    /// Vacant groups in the order `pop` hands them out.
    pub fn free_order(&self) -> Vec<u32> {
        (0..self.num_groups).filter(|&g| !self.groups[g as usize].held).collect()
    }
}

impl PartialEq for SlotPool {
    fn eq(&self, other: &Self) -> bool {
        let gens = |p: &SlotPool| p.groups.iter().map(|g| g.generation).collect::<Vec<_>>();
        self.pool == other.pool
            && self.num_groups == other.num_groups
            && self.num_free == other.num_free
            && self.groups[..self.num_groups as usize] == other.groups[..other.num_groups as usize]
            && gens(self) == gens(other)
    }
}
impl Eq for SlotPool {}
