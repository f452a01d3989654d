//! The elastic block/slot boundary (§5.4), wired: one fixed plane, two counters, and the
//! relocations that move the split.
//!
//! The plane's height never changes, so neither does any address: blocks grow up from row 0,
//! slot position `j` sits at rows `j * slot_rows ..` whatever the split. Moving the boundary
//! only changes which ids are the allocators'. Blocks above a new, lower block count and slot
//! groups above a new, lower slot count are relocated to free ids below; each relocation is a
//! [`BlockMove`] or [`SlotMove`] that the owner (the `Pool`) executes as a copy and a table
//! rewrite before the next forward. This module copies no bytes.
//!
//! Every operation is all-or-nothing: it is planned against the current state (the two pools
//! are independent, so their plans are too) and refused with a [`BoundaryError`] before
//! anything changes.

use std::ops::Range;

use thiserror::Error;

use crate::alloc::{
    AllocError, BlockGrant, BlockHandle, BlockHash, BlockPool, Reservation, SlotHandle, SlotPool, MAX_IDS,
};
use crate::geometry::UnifiedPoolGeometry;

/// A held block moved to a lower id. Copy the envelope rows of `old.id` (both planes, every
/// indexer layer) to `new.id`, and replace `old` by `new` in every block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockMove {
    /// The block's handle before the move (now stale).
    pub old: BlockHandle,
    /// Its handle at the new id.
    pub new: BlockHandle,
}

/// A held slot group moved to a lower group (a higher position). Copy the slot at
/// `from_position` (arena and windows, every plane) to `to_position` and re-point the request
/// from `old` to `new`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMove {
    /// The slot's handle before the move (now stale).
    pub old: SlotHandle,
    /// Its handle at the new group.
    pub new: SlotHandle,
    /// Position the slot's bytes are copied from.
    pub from_position: i64,
    /// Position they are copied to.
    pub to_position: i64,
}

/// What one boundary operation did. Apply in this order before the next forward: the block
/// moves (in order), the slot moves (in order), then initialise `new_live_positions` (§2.4):
/// those rows held block data until now.
///
/// Sources and destinations never overlap: block moves go from ids at or above the new block
/// count to ids below it; slot moves go from retired positions to live ones; both lie on their
/// own side of the old boundary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BoundaryChange {
    /// Blocks relocated below the new boundary (block tables must be rewritten).
    pub block_moves: Vec<BlockMove>,
    /// Slots relocated above the new boundary.
    pub slot_moves: Vec<SlotMove>,
    /// Prefix-cache hashes that left the index (retired free blocks, overwritten destinations).
    pub evicted: Vec<BlockHash>,
    /// Positions that became slots: initialise their compressor state before first use.
    pub new_live_positions: Range<i64>,
    /// Positions that stopped being slots: their rows are block rows now.
    pub retired_positions: Range<i64>,
    /// Blocks after the change.
    pub num_blocks: u32,
    /// Slots after the change.
    pub num_slots: u32,
    /// Most blocks the plane holds beside those slots.
    pub max_blocks: u32,
}

crate::variant::variant_names! {
/// Everything the boundary refuses; none of it changes any state.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum BoundaryError {
    #[error(transparent)]
    /// A failure of the layer below ([`AllocError`]).
    Alloc(#[from] AllocError),
    #[error("the geometry has no envelope rows: blocks take no room, so there is no boundary to move")]
    /// The geometry has no envelope rows: blocks take no room, so there is no boundary to move.
    NoEnvelope,
    #[error("{what} would be {requested}, beyond the id limit {limit}")]
    /// `what` would be `requested`, beyond the id limit `limit`.
    TooManyIds {
        /// What was computed or checked.
        what: &'static str,
        /// How many were asked for.
        requested: u64,
        /// The most allowed.
        limit: u32,
    },
    #[error("{num_slots} slots exceed the {slot_positions} positions the plane holds")]
    /// `num_slots` slots exceed the `slot_positions` positions the plane holds.
    TooManySlots {
        /// Slots there are.
        num_slots: u64,
        /// Slot positions of the plane.
        slot_positions: i64,
    },
    #[error(
        "{num_blocks} blocks do not fit beside {num_slots} slots: the plane holds at most {max_blocks} there"
    )]
    /// `num_blocks` blocks do not fit beside `num_slots` slots: the plane holds at most `max_blocks` there.
    NoRoom {
        /// Blocks there are.
        num_blocks: u64,
        /// Slots there are.
        num_slots: u32,
        /// Most blocks the plane holds.
        max_blocks: u32,
    },
    #[error("cannot remove {count} {what}: there are only {have}")]
    /// Cannot remove `count` `what`: there are only `have`.
    Underflow {
        /// What was computed or checked.
        what: &'static str,
        /// How many.
        count: u32,
        /// How many there are.
        have: u32,
    },
    #[error("block {id} at or above the new block count {bound} cannot move: it is {why}")]
    /// Block `id` at or above the new block count `bound` cannot move: it is `why`.
    BlockImmovable {
        /// The id.
        id: u32,
        /// The boundary the move is to.
        bound: u32,
        /// Why it cannot move.
        why: &'static str,
    },
    #[error("{held} held blocks at or above {bound} but only {free_below} free ids below it")]
    /// `held` held blocks at or above `bound` but only `free_below` free ids below it.
    NoBlockTarget {
        /// The boundary the move is to.
        bound: u32,
        /// Held ids above the bound.
        held: u32,
        /// Free ids below the bound.
        free_below: u32,
    },
    #[error("slot group {group} at or above the new slot count {bound} is pinned")]
    /// Slot group `group` at or above the new slot count `bound` is pinned.
    SlotPinned {
        /// The group given.
        group: u32,
        /// The boundary the move is to.
        bound: u32,
    },
    #[error("{held} held slot groups at or above {bound} but only {vacant_below} vacant groups below it")]
    /// `held` held slot groups at or above `bound` but only `vacant_below` vacant groups below it.
    NoSlotTarget {
        /// The boundary the move is to.
        bound: u32,
        /// Held ids above the bound.
        held: u32,
        /// Vacant groups below the bound.
        vacant_below: u32,
    },
    #[error("boundary invariant broken ({what}); this is a bug")]
    /// Boundary invariant broken (`what`); this is a bug.
    Invariant {
        /// What was computed or checked.
        what: &'static str,
    },
}
}

/// A fixed-capacity plane split between a [`BlockPool`] and a [`SlotPool`].
///
/// Valid iff `num_slots <= held` and `(held - num_slots) * slot_rows >= num_blocks *
/// envelope_rows`, where `held = plane_rows / slot_rows` is the positions the plane holds
/// (`slot_positions` when the geometry numbers its own positions). The block pool's
/// `max_blocks` is always the most blocks that fit beside the current slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Boundary {
    /// The layout at the current split: `num_blocks`/`num_slots` follow the pools.
    geometry: UnifiedPoolGeometry,
    held: i64,
    blocks: BlockPool,
    slots: SlotPool,
}

impl Boundary {
    /// The split `geometry` was built with, in the plane it was built with (give it a fixed
    /// `plane_rows`; a tight-fit plane leaves the boundary nowhere to go).
    pub fn new(geometry: &UnifiedPoolGeometry) -> Result<Self, BoundaryError> {
        if geometry.envelope_rows <= 0 {
            return Err(BoundaryError::NoEnvelope);
        }
        let held = geometry.plane_rows / geometry.slot_rows;
        let count = |what: &'static str, n: i64| {
            u32::try_from(n).ok().filter(|&n| n <= MAX_IDS).ok_or(BoundaryError::TooManyIds {
                what,
                requested: n.max(0) as u64,
                limit: MAX_IDS,
            })
        };
        let (nb, ns) = (count("num_blocks", geometry.num_blocks)?, count("num_slots", geometry.num_slots)?);
        if i64::from(ns) > held {
            return Err(BoundaryError::TooManySlots { num_slots: u64::from(ns), slot_positions: held });
        }
        let mut b = Boundary {
            geometry: geometry.clone(),
            held,
            blocks: BlockPool::new(0)?,
            slots: SlotPool::new(ns)?,
        };
        let max_blocks = b.max_blocks_beside(ns);
        if nb > max_blocks {
            return Err(BoundaryError::NoRoom { num_blocks: u64::from(nb), num_slots: ns, max_blocks });
        }
        b.blocks = BlockPool::with_max_blocks(nb, max_blocks)?;
        Ok(b)
    }

    // ---- the split -------------------------------------------------------------------------

    /// Blocks at the current split.
    pub fn num_blocks(&self) -> u32 {
        self.blocks.num_blocks()
    }
    /// Slots at the current split.
    pub fn num_slots(&self) -> u32 {
        self.slots.num_groups()
    }
    /// Most blocks that fit beside the current slots.
    pub fn max_blocks(&self) -> u32 {
        self.blocks.max_blocks()
    }
    /// Positions the plane holds (the most slots it can take).
    pub fn held_positions(&self) -> i64 {
        self.held
    }
    /// Positions that are slots now: `slot_positions - num_slots .. slot_positions`.
    pub fn live_positions(&self) -> Range<i64> {
        self.geometry.live_positions()
    }
    /// The layout at the current split (its `num_blocks`/`num_slots` are the pools').
    pub fn geometry(&self) -> &UnifiedPoolGeometry {
        &self.geometry
    }
    /// The block allocator (read-only).
    pub fn blocks(&self) -> &BlockPool {
        &self.blocks
    }
    /// The slot allocator (read-only).
    pub fn slots(&self) -> &SlotPool {
        &self.slots
    }

    /// Most blocks that fit beside `num_slots` slots (`num_slots <= held`), capped at the id
    /// limit. `(held - num_slots) * slot_rows <= plane_rows`, so nothing here overflows.
    pub fn max_blocks_beside(&self, num_slots: u32) -> u32 {
        let rows = (self.held - i64::from(num_slots)).max(0) * self.geometry.slot_rows;
        let blocks = rows / self.geometry.envelope_rows;
        u32::try_from(blocks).map_or(MAX_IDS, |b| b.min(MAX_IDS))
    }

    fn position_of(&self, group: u32) -> i64 {
        self.geometry.slot_positions - 1 - i64::from(group)
    }

    /// Where a held slot sits in the plane.
    pub fn position(&self, slot: SlotHandle) -> Result<i64, AllocError> {
        self.slots.check(slot)?;
        Ok(self.position_of(slot.group))
    }

    // ---- moving the boundary ---------------------------------------------------------------

    /// Add `n` slots, retiring the top blocks that stand where they go (held ones move to free
    /// ids below). Refused if the plane has no room or the blocks cannot move.
    pub fn grow_slots(&mut self, n: u32) -> Result<BoundaryChange, BoundaryError> {
        let ns = self.num_slots().checked_add(n).ok_or(BoundaryError::TooManyIds {
            what: "num_slots",
            requested: u64::from(self.num_slots()) + u64::from(n),
            limit: MAX_IDS,
        })?;
        if i64::from(ns) > self.held {
            return Err(BoundaryError::TooManySlots { num_slots: u64::from(ns), slot_positions: self.held });
        }
        let nb = self.num_blocks().min(self.max_blocks_beside(ns));
        self.resize(nb, ns)
    }

    /// Remove the top `n` slot groups, moving held ones to vacant groups below. Blocks do not
    /// grow by themselves; `max_blocks` rises.
    pub fn shrink_slots(&mut self, n: u32) -> Result<BoundaryChange, BoundaryError> {
        let have = self.num_slots();
        let ns = have.checked_sub(n).ok_or(BoundaryError::Underflow { what: "slots", count: n, have })?;
        self.resize(self.num_blocks(), ns)
    }

    /// Add `n` vacant blocks beside the current slots; refused if they do not fit.
    pub fn grow_blocks(&mut self, n: u32) -> Result<BoundaryChange, BoundaryError> {
        let nb = self.blocks_after_growth(n)?;
        self.resize(nb, self.num_slots())
    }

    /// Add `n` vacant blocks, retiring as few top slot groups as that needs.
    pub fn grow_blocks_shrinking_slots(&mut self, n: u32) -> Result<BoundaryChange, BoundaryError> {
        let nb = self.blocks_after_growth(n)?;
        let rows = i64::from(nb) * self.geometry.envelope_rows;
        let s = self.geometry.slot_rows;
        // Most slots that leave `rows` below them: held - ceil(rows / S).
        let room = self.held - (rows / s + i64::from(rows % s != 0));
        let ns = i64::from(self.num_slots()).min(room);
        let ns = u32::try_from(ns).map_err(|_| BoundaryError::NoRoom {
            num_blocks: u64::from(nb),
            num_slots: 0,
            max_blocks: self.max_blocks_beside(0),
        })?;
        self.resize(nb, ns)
    }

    /// Remove the top `n` blocks, moving held ones to free ids below.
    pub fn shrink_blocks(&mut self, n: u32) -> Result<BoundaryChange, BoundaryError> {
        let have = self.num_blocks();
        let nb = have.checked_sub(n).ok_or(BoundaryError::Underflow { what: "blocks", count: n, have })?;
        self.resize(nb, self.num_slots())
    }

    fn blocks_after_growth(&self, n: u32) -> Result<u32, BoundaryError> {
        self.num_blocks().checked_add(n).filter(|&nb| nb <= MAX_IDS).ok_or(BoundaryError::TooManyIds {
            what: "num_blocks",
            requested: u64::from(self.num_blocks()) + u64::from(n),
            limit: MAX_IDS,
        })
    }

    /// Move to the split `(num_blocks, num_slots)`: shrink slots, shrink blocks, then grow
    /// either. Refused, changing nothing, if the split is invalid or a relocation has no
    /// target (a held id above the new count and too few free ids below, a raw unit or pinned
    /// slot in the way).
    pub fn resize(&mut self, num_blocks: u32, num_slots: u32) -> Result<BoundaryChange, BoundaryError> {
        if i64::from(num_slots) > self.held {
            return Err(BoundaryError::TooManySlots {
                num_slots: u64::from(num_slots),
                slot_positions: self.held,
            });
        }
        let max_blocks = self.max_blocks_beside(num_slots);
        if num_blocks > max_blocks {
            return Err(BoundaryError::NoRoom { num_blocks: u64::from(num_blocks), num_slots, max_blocks });
        }
        let (nb0, ns0) = (self.num_blocks(), self.num_slots());
        if num_slots < ns0 {
            self.plan_slot_retire(num_slots)?;
        }
        if num_blocks < nb0 {
            self.plan_block_retire(num_blocks)?;
        }

        // Nothing below can fail: the plans above are exact (see `plan_block_retire`).
        let top = self.geometry.slot_positions;
        let mut change = BoundaryChange {
            new_live_positions: top - i64::from(num_slots.max(ns0))..top - i64::from(ns0),
            retired_positions: top - i64::from(ns0)..top - i64::from(num_slots.min(ns0)),
            ..BoundaryChange::default()
        };
        while self.num_slots() > num_slots {
            let g = self.num_slots() - 1;
            let old = self.slots.current_handle(g)?;
            let r = self.slots.retire_top().ok_or(BoundaryError::Invariant { what: "slot retire" })?;
            if let Some(t) = r.relocated_to {
                if t >= num_slots {
                    return Err(BoundaryError::Invariant { what: "slot target above the new count" });
                }
                change.slot_moves.push(SlotMove {
                    old,
                    new: self.slots.current_handle(t)?,
                    from_position: self.position_of(g),
                    to_position: self.position_of(t),
                });
            }
        }
        while self.num_blocks() > num_blocks {
            let old = self.blocks.current_handle(self.num_blocks() - 1)?;
            let r = self
                .blocks
                .retire_top_into(num_blocks)
                .ok_or(BoundaryError::Invariant { what: "block retire" })?;
            if let Some(to) = r.moved_to {
                change.block_moves.push(BlockMove { old, new: self.blocks.current_handle(to)? });
            }
            change.evicted.extend(r.evicted);
        }
        self.blocks.set_max_blocks(max_blocks)?;
        let grow = num_blocks - self.num_blocks();
        if self.blocks.extend(grow) != grow {
            return Err(BoundaryError::Invariant { what: "block extend" });
        }
        self.slots.extend(num_slots - self.num_slots())?;
        self.geometry.num_blocks = i64::from(num_blocks);
        self.geometry.num_slots = i64::from(num_slots);
        change.num_blocks = num_blocks;
        change.num_slots = num_slots;
        change.max_blocks = max_blocks;
        Ok(change)
    }

    /// Can every block at or above `bound` leave? Raw units and popped ids cannot move; each
    /// held one needs its own free id below `bound`.
    ///
    /// Exact: retiring a held top takes one free id below `bound` and removes one held id
    /// above it; retiring a free top changes neither count. So `held <= free_below` at the
    /// start holds at every step, and a destination always exists.
    fn plan_block_retire(&self, bound: u32) -> Result<(), BoundaryError> {
        let (mut held, mut free_above) = (0u32, 0u32);
        for id in bound..self.num_blocks() {
            if self.blocks.raw_unit(id)?.is_some() {
                return Err(BoundaryError::BlockImmovable {
                    id,
                    bound,
                    why: "a raw unit (checkpoint storage)",
                });
            }
            if self.blocks.is_popped(id)? {
                return Err(BoundaryError::BlockImmovable { id, bound, why: "popped but not allocated" });
            }
            if self.blocks.is_free(id)? {
                free_above += 1;
            } else {
                held += 1;
            }
        }
        let free_below = self.blocks.num_free() - free_above;
        if held > free_below {
            return Err(BoundaryError::NoBlockTarget { bound, held, free_below });
        }
        Ok(())
    }

    /// The same for slot groups; a pinned held group cannot move. The slot pool takes the
    /// lowest vacant group, which lies below `bound` while any does (same counting argument).
    fn plan_slot_retire(&self, bound: u32) -> Result<(), BoundaryError> {
        let (mut held, mut vacant_above) = (0u32, 0u32);
        for g in bound..self.num_slots() {
            if self.slots.is_pinned(g)? {
                return Err(BoundaryError::SlotPinned { group: g, bound });
            }
            if self.slots.is_held(g)? {
                held += 1;
            } else {
                vacant_above += 1;
            }
        }
        let vacant_below = self.slots.num_free() - vacant_above;
        if held > vacant_below {
            return Err(BoundaryError::NoSlotTarget { bound, held, vacant_below });
        }
        Ok(())
    }

    // ---- the allocators, through the boundary -----------------------------------------------

    /// Hand out a block below the boundary.
    pub fn alloc_block(&mut self) -> Result<BlockGrant, AllocError> {
        self.blocks.alloc()
    }
    /// Return a block.
    pub fn free_block(&mut self, block: BlockHandle) -> Result<(), AllocError> {
        self.blocks.free_handle(block)
    }
    /// Check a block handle is current.
    pub fn check_block(&self, block: BlockHandle) -> Result<(), AllocError> {
        self.blocks.check(block)
    }
    /// Prefix hit on `id` (from `lookup`).
    pub fn claim_block(&mut self, id: u32) -> Result<BlockHandle, AllocError> {
        self.blocks.claim_handle(id)
    }
    /// Returns the hash `block` stopped owning, if it owned another.
    pub fn publish_block(
        &mut self,
        block: BlockHandle,
        hash: BlockHash,
        tokens: u32,
    ) -> Result<Option<BlockHash>, AllocError> {
        self.blocks.publish_handle(block, hash, tokens)
    }
    /// The block holding prefix-cache hash `hash`, if cached.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.blocks.lookup(hash)
    }
    /// Forget every prefix-cache hash.
    pub fn clear_index(&mut self) {
        self.blocks.clear_index()
    }
    /// Raw units for checkpoint storage; they never move, so they can hold a boundary back.
    pub fn reserve_units(&mut self, count: u32, owner: u64) -> Option<Reservation> {
        self.blocks.reserve_units(count, owner)
    }
    /// Release raw units `ids` reserved by `owner`.
    pub fn release_units(&mut self, ids: &[u32], owner: u64) -> Result<(), AllocError> {
        self.blocks.release_units(ids, owner)
    }

    /// Hand out a slot above the boundary.
    pub fn alloc_slot(&mut self) -> Result<SlotHandle, AllocError> {
        self.slots.alloc()
    }
    /// Return a slot.
    pub fn free_slot(&mut self, slot: SlotHandle) -> Result<(), AllocError> {
        self.slots.free_handle(slot)
    }
    /// Check a slot handle is current.
    pub fn check_slot(&self, slot: SlotHandle) -> Result<(), AllocError> {
        self.slots.check(slot)
    }
    /// Keep a slot in place (a transfer reads it): shrinking past it is refused until unpinned.
    pub fn pin_slot(&mut self, slot: SlotHandle) -> Result<(), AllocError> {
        self.slots.check(slot)?;
        self.slots.pin(slot.group)
    }
    /// Unpin a slot so the boundary may relocate it again.
    pub fn unpin_slot(&mut self, slot: SlotHandle) -> Result<(), AllocError> {
        self.slots.check(slot)?;
        self.slots.unpin(slot.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::GeometrySpec;

    /// Ratios `[4,128,4,0]`, ring 7, block 256, arena 10: envelope 130 rows, entry 85, slot 96.
    fn geometry(num_blocks: i64, num_slots: i64, plane_rows: i64) -> UnifiedPoolGeometry {
        GeometrySpec::new(vec![4, 128, 4, 0], num_blocks, num_slots, 7, 256)
            .arena_rows(10)
            .plane_rows(plane_rows)
            .build()
            .unwrap()
    }

    /// Ten positions (960 rows): blocks beside 0..=10 slots are 7,6,5,5,4,3,2,2,1,0,0.
    fn small(num_blocks: i64, num_slots: i64) -> Boundary {
        Boundary::new(&geometry(num_blocks, num_slots, 960)).unwrap()
    }

    fn refused(
        b: &mut Boundary,
        op: impl FnOnce(&mut Boundary) -> Result<BoundaryChange, BoundaryError>,
    ) -> BoundaryError {
        let before = b.clone();
        let e = op(b).expect_err("should be refused");
        assert_eq!(*b, before, "a refused boundary operation changed state ({e:?})");
        e
    }

    #[test]
    fn worked_numbers_at_plane_60000() {
        let b = Boundary::new(&geometry(3, 2, 60_000)).unwrap();
        let g = b.geometry();
        assert_eq!((g.envelope_rows, g.slot_rows, b.held_positions()), (130, 96, 625));
        assert_eq!((b.num_blocks(), b.num_slots(), b.max_blocks()), (3, 2, 460));
        assert_eq!(b.live_positions(), 623..625);
        assert_eq!(b.max_blocks_beside(0), 461);
        assert_eq!(b.max_blocks_beside(625), 0);
    }

    #[test]
    fn splits_move_no_address() {
        let mut b = Boundary::new(&geometry(3, 2, 60_000)).unwrap();
        let params = |b: &Boundary| {
            let g = b.geometry();
            (g.window_params(0).unwrap(), g.window_params(4).unwrap(), g.window_params(128).unwrap())
        };
        let first = params(&b);
        let span = b.geometry().slot_span(624).unwrap();
        for (nb, ns) in [(2, 5), (7, 1), (1, 1), (3, 2)] {
            let c = b.resize(nb, ns).unwrap();
            assert_eq!((b.num_blocks(), b.num_slots(), c.num_blocks, c.num_slots), (nb, ns, nb, ns));
            assert_eq!(params(&b), first);
            assert_eq!(b.geometry().slot_span(624).unwrap(), span);
            assert_eq!(b.geometry().physical_slot(0).unwrap(), 624);
            assert_eq!(b.geometry().num_slots, i64::from(ns));
        }
    }

    #[test]
    fn max_blocks_follow_the_slots() {
        let b = small(0, 0);
        let beside: Vec<u32> = (0..=10).map(|n| b.max_blocks_beside(n)).collect();
        assert_eq!(beside, vec![7, 6, 5, 5, 4, 3, 2, 2, 1, 0, 0]);
    }

    #[test]
    fn new_refuses_what_the_plane_cannot_hold() {
        let mut g = geometry(2, 2, 960);
        g.num_blocks = 6;
        assert_eq!(
            Boundary::new(&g),
            Err(BoundaryError::NoRoom { num_blocks: 6, num_slots: 2, max_blocks: 5 })
        );
        g.num_blocks = 0;
        g.num_slots = 11;
        assert_eq!(Boundary::new(&g), Err(BoundaryError::TooManySlots { num_slots: 11, slot_positions: 10 }));
        let dense = GeometrySpec::new(vec![0, 0], 0, 1, 7, 256).plane_rows(100).build().unwrap();
        assert_eq!(Boundary::new(&dense), Err(BoundaryError::NoEnvelope));
    }

    #[test]
    fn grow_slots_retires_top_blocks_and_moves_held_ones_down() {
        // 7 blocks beside 0 slots; hold 1, 4, 6 with hashes on 6 and on (freed) 5.
        let mut b = small(7, 0);
        let h: Vec<BlockHandle> = (0..7).map(|_| b.alloc_block().unwrap().handle).collect();
        b.publish_block(h[6], 66, 256).unwrap();
        b.publish_block(h[5], 55, 256).unwrap();
        for i in [0, 2, 3, 5] {
            b.free_block(h[i]).unwrap();
        }
        // Three slots leave room for 5 blocks: 6 moves to 0 (lowest vacant), 5 (free) is dropped.
        let c = b.grow_slots(3).unwrap();
        assert_eq!(c.block_moves, vec![BlockMove { old: h[6], new: b.blocks().current_handle(0).unwrap() }]);
        assert_eq!(c.evicted, vec![55]);
        assert_eq!(c.new_live_positions, 7..10);
        assert_eq!(c.retired_positions, 10..10);
        assert!(c.slot_moves.is_empty());
        assert_eq!((b.num_blocks(), b.num_slots(), b.max_blocks()), (5, 3, 5));
        assert_eq!(b.lookup(66), Some(0));
        assert!(b.check_block(h[6]).is_err());
        for i in [1, 4] {
            b.check_block(h[i]).unwrap();
        }
        // The new slots are the pool's, lowest group at the highest position.
        let s = b.alloc_slot().unwrap();
        assert_eq!(b.position(s).unwrap(), 9);
    }

    #[test]
    fn grow_slots_refusals_change_nothing() {
        let mut b = small(5, 2);
        let h: Vec<BlockHandle> = (0..5).map(|_| b.alloc_block().unwrap().handle).collect();
        assert_eq!(
            refused(&mut b, |b| b.grow_slots(9)),
            BoundaryError::TooManySlots { num_slots: 11, slot_positions: 10 }
        );
        // 4 slots leave room for 4 blocks: block 4 is held and nothing is free below.
        assert_eq!(
            refused(&mut b, |b| b.grow_slots(2)),
            BoundaryError::NoBlockTarget { bound: 4, held: 1, free_below: 0 }
        );
        b.free_block(h[0]).unwrap();
        b.free_block(h[4]).unwrap();
        let r = b.reserve_units(1, 8).unwrap();
        assert_eq!(r.ids, vec![0]);
        b.release_units(&r.ids, 8).unwrap();
        // A raw unit at the top cannot move.
        b.free_block(h[3]).unwrap();
        b.free_block(h[2]).unwrap();
        let r = b.reserve_units(4, 8).unwrap();
        assert_eq!(r.ids, vec![0, 2, 3, 4]);
        assert_eq!(
            refused(&mut b, |b| b.grow_slots(2)),
            BoundaryError::BlockImmovable { id: 4, bound: 4, why: "a raw unit (checkpoint storage)" }
        );
    }

    #[test]
    fn shrink_slots_moves_held_top_groups_to_vacant_ones_below() {
        let mut b = small(2, 6);
        let s: Vec<SlotHandle> = (0..6).map(|_| b.alloc_slot().unwrap()).collect();
        for g in [1, 2, 4] {
            b.free_slot(s[g]).unwrap();
        }
        // Keep 3 groups: 5 → 1 (position 4 → 8), 4 vacant, 3 → 2 (position 6 → 7).
        let c = b.shrink_slots(3).unwrap();
        let new = |g| b.slots().current_handle(g).unwrap();
        assert_eq!(
            c.slot_moves,
            vec![
                SlotMove { old: s[5], new: new(1), from_position: 4, to_position: 8 },
                SlotMove { old: s[3], new: new(2), from_position: 6, to_position: 7 },
            ]
        );
        assert_eq!(c.retired_positions, 4..7);
        assert!(c.new_live_positions.is_empty());
        assert_eq!((b.num_blocks(), b.num_slots(), b.max_blocks()), (2, 3, 5));
        assert_eq!(b.position(c.slot_moves[0].new).unwrap(), 8);
        assert!(b.position(s[5]).is_err());
        b.check_slot(s[0]).unwrap();
    }

    #[test]
    fn shrink_slots_refusals_change_nothing() {
        let mut b = small(0, 3);
        let s: Vec<SlotHandle> = (0..3).map(|_| b.alloc_slot().unwrap()).collect();
        assert_eq!(
            refused(&mut b, |b| b.shrink_slots(4)),
            BoundaryError::Underflow { what: "slots", count: 4, have: 3 }
        );
        assert_eq!(
            refused(&mut b, |b| b.shrink_slots(1)),
            BoundaryError::NoSlotTarget { bound: 2, held: 1, vacant_below: 0 }
        );
        b.free_slot(s[0]).unwrap();
        b.pin_slot(s[2]).unwrap();
        assert_eq!(refused(&mut b, |b| b.shrink_slots(1)), BoundaryError::SlotPinned { group: 2, bound: 2 });
        b.unpin_slot(s[2]).unwrap();
        b.shrink_slots(1).unwrap();
    }

    #[test]
    fn grow_blocks_fits_beside_the_slots_or_is_refused() {
        let mut b = small(1, 4);
        let c = b.grow_blocks(3).unwrap();
        assert_eq!((c.num_blocks, b.blocks().num_free()), (4, 4));
        assert!(c.block_moves.is_empty() && c.slot_moves.is_empty() && c.new_live_positions.is_empty());
        assert_eq!(
            refused(&mut b, |b| b.grow_blocks(1)),
            BoundaryError::NoRoom { num_blocks: 5, num_slots: 4, max_blocks: 4 }
        );
    }

    #[test]
    fn grow_blocks_shrinking_slots_retires_as_few_slots_as_needed() {
        let mut b = small(4, 4);
        let s: Vec<SlotHandle> = (0..4).map(|_| b.alloc_slot().unwrap()).collect();
        for &sh in &s[..3] {
            b.free_slot(sh).unwrap();
        }
        // 6 blocks need slots <= 1 (5 blocks fit beside 2 or 3): three groups go, 3 → 0.
        let c = b.grow_blocks_shrinking_slots(2).unwrap();
        assert_eq!((b.num_blocks(), b.num_slots(), b.max_blocks()), (6, 1, 6));
        assert_eq!(c.retired_positions, 6..9);
        assert_eq!(
            refused(&mut b, |b| b.grow_blocks_shrinking_slots(1)),
            BoundaryError::NoSlotTarget { bound: 0, held: 1, vacant_below: 0 }
        );
        assert_eq!(
            refused(&mut b, |b| b.grow_blocks_shrinking_slots(2)),
            BoundaryError::NoRoom { num_blocks: 8, num_slots: 0, max_blocks: 7 }
        );
        assert_eq!(
            refused(&mut b, |b| b.grow_blocks(u32::MAX)),
            BoundaryError::TooManyIds {
                what: "num_blocks",
                requested: 6 + u64::from(u32::MAX),
                limit: MAX_IDS
            }
        );
    }

    #[test]
    fn shrink_blocks_moves_held_tops_below_the_new_count() {
        // Blocks 0..5: hold 3 and 4, free 0..3, with 1 cached (hash 11) and 0, 2 vacant.
        let mut b = small(5, 2);
        let h: Vec<BlockHandle> = (0..5).map(|_| b.alloc_block().unwrap().handle).collect();
        b.publish_block(h[1], 11, 256).unwrap();
        for i in [1, 0, 2] {
            b.free_block(h[i]).unwrap();
        }
        let c = b.shrink_blocks(2).unwrap();
        let new = |i| b.blocks().current_handle(i).unwrap();
        assert_eq!(
            c.block_moves,
            vec![BlockMove { old: h[4], new: new(0) }, BlockMove { old: h[3], new: new(2) }]
        );
        assert!(c.evicted.is_empty());
        assert_eq!((b.num_blocks(), b.max_blocks()), (3, 5));
        assert_eq!(b.lookup(11), Some(1), "the cached block below the cut stays findable");
        assert_eq!(
            refused(&mut b, |b| b.shrink_blocks(4)),
            BoundaryError::Underflow { what: "blocks", count: 4, have: 3 }
        );
    }

    #[test]
    fn a_move_prefers_a_cached_id_below_the_cut_over_one_above_it() {
        // 0..4 held except 1 (cached, freed first) and 3 (cached): moving 4 below 3 must take 1.
        let mut b = small(5, 0);
        let h: Vec<BlockHandle> = (0..5).map(|_| b.alloc_block().unwrap().handle).collect();
        b.publish_block(h[3], 33, 1).unwrap();
        b.publish_block(h[1], 11, 1).unwrap();
        b.free_block(h[3]).unwrap();
        b.free_block(h[1]).unwrap();
        let c = b.shrink_blocks(2).unwrap();
        assert_eq!(c.block_moves, vec![BlockMove { old: h[4], new: b.blocks().current_handle(1).unwrap() }]);
        assert_eq!(c.evicted, vec![11, 33], "1's hash as the destination, then 3's as a free top");
    }
}
