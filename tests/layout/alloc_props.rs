//! Property tests of the allocators and the elastic boundary.
//!
//! * `block_pool_matches_the_spec_model`: random op sequences on a `BlockPool` and on a naive,
//!   obviously-§5.1 model (sorted sets and vectors, O(n) everything) agree on every result
//!   and on the whole observable state; a refused op leaves the pool equal to its snapshot.
//! * `slot_pool_matches_the_spec_model`: the same for the V4 `SlotPool`.
//! * `boundary_keeps_every_holder`: random traffic and boundary moves on a `Boundary`, with
//!   every holder's handle and a content tag tracked in a model that applies the reported
//!   moves as copies: handles keep resolving to the same content, nothing live lies past the
//!   counts, blocks never overlap live slot rows, invalid ops are refused without change.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;
use v4pool::geometry::GeometrySpec;
use v4pool::pool::{Boundary, BoundaryChange, BoundaryError};
use v4pool::raw::alloc::{AllocError, BlockHandle, BlockPool, RawUnit, SlotHandle, SlotPool};

// =============================================================================================
// BlockPool against a naive model of §5.1
// =============================================================================================

#[derive(Clone, Debug, Default)]
struct NaiveBlocks {
    num: u32,
    max: u32,
    ref_count: Vec<u32>,
    hash: Vec<Option<u64>>,
    tokens: Vec<u32>,
    used: Vec<bool>,
    free: BTreeSet<u32>,
    /// Free ids with a hash, in release order.
    cached: Vec<u32>,
    index: HashMap<u64, u32>,
    raw: Vec<Option<RawUnit>>,
}

impl NaiveBlocks {
    fn new(num: u32, max: u32) -> Self {
        let mut m = NaiveBlocks { max, ..Default::default() };
        m.extend(num);
        m
    }
    fn take(&mut self, id: u32) {
        self.free.remove(&id);
        self.cached.retain(|&c| c != id);
    }
    fn next_free(&self, below: u32) -> Option<u32> {
        let vacant = self.free.iter().copied().find(|&id| self.hash[id as usize].is_none() && id < below);
        vacant.or_else(|| self.cached.iter().copied().find(|&id| id < below))
    }
    fn pop(&mut self) -> Option<u32> {
        let id = self.next_free(u32::MAX)?;
        self.take(id);
        Some(id)
    }
    fn owns(&self, id: u32) -> Option<u64> {
        self.hash[id as usize].filter(|h| self.index.get(h) == Some(&id))
    }
    fn allocate(&mut self, id: u32) -> Option<Option<u64>> {
        if id >= self.num || self.ref_count[id as usize] != 0 {
            return None;
        }
        let ev = self.owns(id);
        if let Some(h) = ev {
            self.index.remove(&h);
        }
        let i = id as usize;
        (self.hash[i], self.tokens[i], self.ref_count[i], self.used[i]) = (None, 0, 1, true);
        self.take(id);
        Some(ev)
    }
    fn claim(&mut self, id: u32) -> bool {
        if id >= self.num || self.raw[id as usize].is_some() {
            return false;
        }
        let i = id as usize;
        if self.used[i] {
            self.ref_count[i] += 1;
        } else {
            (self.ref_count[i], self.used[i]) = (1, true);
            self.take(id);
        }
        true
    }
    fn publish(&mut self, id: u32, h: u64, t: u32) -> Option<Option<u64>> {
        if id >= self.num || self.raw[id as usize].is_some() || !self.used[id as usize] {
            return None;
        }
        let dropped = self.owns(id).filter(|&old| old != h);
        if let Some(old) = dropped {
            self.index.remove(&old);
        }
        self.index.insert(h, id);
        (self.hash[id as usize], self.tokens[id as usize]) = (Some(h), t);
        Some(dropped)
    }
    fn free_id(&mut self, id: u32) -> bool {
        if id >= self.num || self.raw[id as usize].is_some() || !self.used[id as usize] {
            return false;
        }
        self.release(id);
        true
    }
    fn release(&mut self, id: u32) {
        let i = id as usize;
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            self.used[i] = false;
            self.free.insert(id);
            if self.hash[i].is_some() {
                self.cached.push(id);
            }
        }
    }
    fn clear_index(&mut self) {
        self.index.clear();
        for i in 0..self.num as usize {
            if self.ref_count[i] == 0 {
                (self.hash[i], self.tokens[i]) = (None, 0);
            }
        }
        self.cached.clear();
    }
    fn reserve(&mut self, count: u32, owner: u64) -> Option<(Vec<u32>, Vec<u64>)> {
        if count as usize > self.free.len() {
            return None;
        }
        let (mut ids, mut ev) = (vec![], vec![]);
        for piece in 0..count {
            let id = self.pop()?;
            ev.extend(self.allocate(id)?);
            self.raw[id as usize] = Some(RawUnit { owner, piece });
            ids.push(id);
        }
        Some((ids, ev))
    }
    fn release_units(&mut self, ids: &[u32], owner: u64) -> bool {
        let ok = ids.iter().enumerate().all(|(p, &id)| {
            id < self.num && self.raw[id as usize] == Some(RawUnit { owner, piece: p as u32 })
        });
        if ok {
            for &id in ids {
                self.raw[id as usize] = None;
                self.release(id);
            }
        }
        ok
    }
    fn extend(&mut self, count: u32) -> u32 {
        let taken = count.min(self.max - self.num);
        for id in self.num..self.num + taken {
            let i = id as usize;
            if self.ref_count.len() <= i {
                self.ref_count.push(0);
                self.hash.push(None);
                self.tokens.push(0);
                self.used.push(false);
                self.raw.push(None);
            }
            (self.ref_count[i], self.hash[i], self.tokens[i], self.used[i], self.raw[i]) =
                (0, None, 0, false, None);
            self.free.insert(id);
        }
        self.num += taken;
        taken
    }
    fn retire_top(&mut self) -> Option<(u32, Option<u32>, Option<u64>)> {
        let top = self.num.checked_sub(1)?;
        let t = top as usize;
        let popped = !self.used[t] && !self.free.contains(&top);
        if self.raw[t].is_some() || popped {
            return None;
        }
        let (moved_to, evicted);
        if self.free.contains(&top) {
            evicted = self.owns(top);
            if let Some(h) = evicted {
                self.index.remove(&h);
            }
            self.take(top);
            moved_to = None;
        } else {
            let d = self.next_free(top)?;
            self.take(d);
            evicted = self.owns(d);
            if let Some(h) = evicted {
                self.index.remove(&h);
            }
            if let Some(h) = self.owns(top) {
                self.index.insert(h, d);
            }
            let di = d as usize;
            (self.ref_count[di], self.hash[di], self.tokens[di], self.used[di]) =
                (self.ref_count[t], self.hash[t], self.tokens[t], true);
            moved_to = Some(d);
        }
        (self.ref_count[t], self.hash[t], self.tokens[t], self.used[t]) = (0, None, 0, false);
        self.num = top;
        Some((top, moved_to, evicted))
    }
    fn free_order(&self) -> Vec<u32> {
        let mut v: Vec<u32> =
            self.free.iter().copied().filter(|&id| self.hash[id as usize].is_none()).collect();
        v.extend(&self.cached);
        v
    }
}

#[derive(Clone, Debug)]
enum BlockOp {
    Pop,
    Allocate(u32),
    Alloc,
    Claim(u32),
    Publish(u32, u64, u32),
    Free(u32),
    ClearIndex,
    Reserve(u32, u64),
    Release { owner: u64, corrupt: bool },
    Extend(u32),
    RetireTop,
    SetMax(u32),
}

fn block_op() -> impl Strategy<Value = BlockOp> {
    prop_oneof![
        3 => Just(BlockOp::Pop),
        3 => (0u32..14).prop_map(BlockOp::Allocate),
        6 => Just(BlockOp::Alloc),
        4 => (0u32..14).prop_map(BlockOp::Claim),
        5 => (0u32..14, 0u64..6, 1u32..300).prop_map(|(i, h, t)| BlockOp::Publish(i, h, t)),
        8 => (0u32..14).prop_map(BlockOp::Free),
        1 => Just(BlockOp::ClearIndex),
        2 => (0u32..4, 0u64..3).prop_map(|(c, o)| BlockOp::Reserve(c, o)),
        2 => (0u64..3, any::<bool>()).prop_map(|(owner, corrupt)| BlockOp::Release { owner, corrupt }),
        2 => (0u32..4).prop_map(BlockOp::Extend),
        3 => Just(BlockOp::RetireTop),
        1 => (0u32..16).prop_map(BlockOp::SetMax),
    ]
}

fn assert_same_blocks(p: &BlockPool, m: &NaiveBlocks) {
    assert_eq!((p.num_blocks(), p.max_blocks(), p.num_free() as usize), (m.num, m.max, m.free.len()));
    for id in 0..m.num {
        let i = id as usize;
        assert_eq!(p.ref_count(id).unwrap(), m.ref_count[i], "ref_count of {id}");
        assert_eq!(p.hash(id).unwrap(), m.hash[i], "hash of {id}");
        assert_eq!(p.tokens(id).unwrap(), m.tokens[i], "tokens of {id}");
        assert_eq!(p.is_free(id).unwrap(), m.free.contains(&id), "free set membership of {id}");
        assert_eq!(p.raw_unit(id).unwrap(), m.raw[i], "raw unit of {id}");
    }
    assert_eq!(p.free_order(), m.free_order(), "pop order");
    for h in 0..6 {
        assert_eq!(p.lookup(h), m.index.get(&h).copied(), "lookup({h})");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn block_pool_matches_the_spec_model(
        num in 0u32..10,
        extra in 0u32..4,
        ops in prop::collection::vec(block_op(), 1..80),
    ) {
        let mut p = BlockPool::with_max_blocks(num, num + extra).unwrap();
        let mut m = NaiveBlocks::new(num, num + extra);
        let mut units: Vec<(u64, Vec<u32>)> = vec![];
        for op in ops {
            let before = p.clone();
            let ok = match op.clone() {
                BlockOp::Pop => {
                    let (got, want) = (p.pop().ok(), m.pop());
                    prop_assert_eq!(got, want);
                    got.is_some()
                }
                BlockOp::Allocate(id) => {
                    let (got, want) = (p.allocate(id).ok(), m.allocate(id));
                    prop_assert_eq!(got, want);
                    got.is_some()
                }
                BlockOp::Alloc => {
                    let got = p.alloc().ok();
                    let want = m.pop().map(|id| (id, m.allocate(id).flatten()));
                    prop_assert_eq!(got.map(|g| (g.handle.id, g.evicted)), want);
                    got.is_some()
                }
                BlockOp::Claim(id) => {
                    let (got, want) = (p.claim(id).is_ok(), m.claim(id));
                    prop_assert_eq!(got, want);
                    got
                }
                BlockOp::Publish(id, h, t) => {
                    let (got, want) = (p.publish(id, h, t).ok(), m.publish(id, h, t));
                    prop_assert_eq!(got, want);
                    got.is_some()
                }
                BlockOp::Free(id) => {
                    let (got, want) = (p.free(id).is_ok(), m.free_id(id));
                    prop_assert_eq!(got, want);
                    got
                }
                BlockOp::ClearIndex => {
                    p.clear_index();
                    m.clear_index();
                    true
                }
                BlockOp::Reserve(count, owner) => {
                    let got = p.reserve_units(count, owner).map(|r| (r.ids, r.evicted));
                    let want = m.reserve(count, owner);
                    prop_assert_eq!(&got, &want);
                    if let Some((ids, _)) = got {
                        units.push((owner, ids));
                    }
                    want.is_some()
                }
                BlockOp::Release { owner, corrupt } => {
                    let pos = units.iter().position(|u| u.0 == owner);
                    let (o, mut ids) = pos.map(|i| units[i].clone()).unwrap_or((owner, vec![owner as u32]));
                    if corrupt && ids.len() > 1 {
                        ids.swap(0, 1);
                    }
                    let o = if corrupt && ids.len() == 1 { o + 1 } else { o };
                    let (got, want) = (p.release_units(&ids, o).is_ok(), m.release_units(&ids, o));
                    prop_assert_eq!(got, want);
                    if got {
                        if let Some(i) = pos {
                            units.remove(i);
                        }
                    }
                    got
                }
                BlockOp::Extend(n) => {
                    prop_assert_eq!(p.extend(n), m.extend(n));
                    true
                }
                BlockOp::RetireTop => {
                    let got = p.retire_top().map(|r| (r.retired, r.moved_to, r.evicted));
                    let want = m.retire_top();
                    prop_assert_eq!(got, want);
                    got.is_some()
                }
                BlockOp::SetMax(max) => {
                    let ok = p.set_max_blocks(max).is_ok();
                    prop_assert_eq!(ok, max >= m.num);
                    if ok {
                        m.max = max;
                    }
                    ok
                }
            };
            if !ok {
                prop_assert_eq!(&p, &before, "refused {:?} changed the pool", op);
            }
            assert_same_blocks(&p, &m);
        }
    }
}

// =============================================================================================
// SlotPool against a naive model of §5.2 (V4 half)
// =============================================================================================

#[derive(Clone, Debug)]
enum SlotOp {
    Pop,
    Release(u32),
    Extend(u32),
    RetireTop,
    Pin(u32),
    Unpin(u32),
}

fn slot_op() -> impl Strategy<Value = SlotOp> {
    prop_oneof![
        5 => Just(SlotOp::Pop),
        5 => (0u32..12).prop_map(SlotOp::Release),
        2 => (0u32..3).prop_map(SlotOp::Extend),
        3 => Just(SlotOp::RetireTop),
        1 => (0u32..12).prop_map(SlotOp::Pin),
        1 => (0u32..12).prop_map(SlotOp::Unpin),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn slot_pool_matches_the_spec_model(num in 0u32..8, ops in prop::collection::vec(slot_op(), 1..60)) {
        let mut s = SlotPool::new(num).unwrap();
        // Model: held and pinned flags per group; vacant = the rest.
        let (mut n, mut held, mut pinned) = (num, vec![false; num as usize], vec![false; num as usize]);
        for op in ops {
            let before = s.clone();
            let ok = match op.clone() {
                SlotOp::Pop => {
                    let want = (0..n).find(|&g| !held[g as usize]);
                    if let Some(g) = want {
                        held[g as usize] = true;
                    }
                    prop_assert_eq!(s.pop().ok(), want);
                    want.is_some()
                }
                SlotOp::Release(g) => {
                    let want = g < n && held[g as usize] && !pinned[g as usize];
                    if want {
                        held[g as usize] = false;
                    }
                    prop_assert_eq!(s.release(g).is_ok(), want);
                    want
                }
                SlotOp::Extend(c) => {
                    s.extend(c).unwrap();
                    n += c;
                    held.resize(n as usize, false);
                    pinned.resize(n as usize, false);
                    true
                }
                SlotOp::RetireTop => {
                    let want = match n.checked_sub(1) {
                        None => None,
                        Some(top) if pinned[top as usize] => None,
                        Some(top) if !held[top as usize] => Some((top, None)),
                        Some(top) => (0..top).find(|&g| !held[g as usize]).map(|t| (top, Some(t))),
                    };
                    if let Some((top, to)) = want {
                        if let Some(t) = to {
                            held[t as usize] = true;
                        }
                        n = top;
                        held.truncate(n as usize);
                        pinned.truncate(n as usize);
                    }
                    prop_assert_eq!(s.retire_top().map(|r| (r.retired, r.relocated_to)), want);
                    want.is_some()
                }
                SlotOp::Pin(g) => {
                    let want = g < n && held[g as usize];
                    if want {
                        pinned[g as usize] = true;
                    }
                    prop_assert_eq!(s.pin(g).is_ok(), want);
                    want
                }
                SlotOp::Unpin(g) => {
                    let want = g < n && pinned[g as usize];
                    if want {
                        pinned[g as usize] = false;
                    }
                    prop_assert_eq!(s.unpin(g).is_ok(), want);
                    want
                }
            };
            if !ok {
                prop_assert_eq!(&s, &before, "refused {:?} changed the pool", op);
            }
            prop_assert_eq!(s.num_groups(), n);
            prop_assert_eq!(s.num_free() as usize, held.iter().filter(|&&h| !h).count());
            for g in 0..n {
                prop_assert_eq!(s.is_held(g).unwrap(), held[g as usize]);
                prop_assert_eq!(s.is_pinned(g).unwrap(), pinned[g as usize]);
            }
        }
    }
}

// =============================================================================================
// Boundary: holders survive every move
// =============================================================================================

#[derive(Clone, Debug)]
enum BOp {
    AllocBlock,
    FreeBlock(usize),
    ShareBlock(usize),
    Publish(usize, u64),
    PrefixHit(u64),
    AllocSlot,
    FreeSlot(usize),
    Pin(usize),
    Unpin(usize),
    Reserve(u32),
    Release(usize, bool),
    GrowSlots(u32),
    ShrinkSlots(u32),
    GrowBlocks(u32),
    GrowBlocksShrinking(u32),
    ShrinkBlocks(u32),
    Resize(u32, u32),
    FreeDeadBlock(usize),
    FreeDeadSlot(usize),
    ForeignFree,
}

fn b_op() -> impl Strategy<Value = BOp> {
    let i = 0usize..64;
    prop_oneof![
        12 => Just(BOp::AllocBlock),
        6 => i.clone().prop_map(BOp::FreeBlock),
        2 => i.clone().prop_map(BOp::ShareBlock),
        2 => (i.clone(), 0u64..5).prop_map(|(i, h)| BOp::Publish(i, h)),
        2 => (0u64..5).prop_map(BOp::PrefixHit),
        5 => Just(BOp::AllocSlot),
        4 => i.clone().prop_map(BOp::FreeSlot),
        1 => i.clone().prop_map(BOp::Pin),
        1 => i.clone().prop_map(BOp::Unpin),
        1 => (0u32..3).prop_map(BOp::Reserve),
        1 => (i.clone(), any::<bool>()).prop_map(|(i, c)| BOp::Release(i, c)),
        3 => (0u32..4).prop_map(BOp::GrowSlots),
        3 => (0u32..4).prop_map(BOp::ShrinkSlots),
        3 => (0u32..6).prop_map(BOp::GrowBlocks),
        2 => (0u32..6).prop_map(BOp::GrowBlocksShrinking),
        3 => (0u32..6).prop_map(BOp::ShrinkBlocks),
        2 => (0u32..30, 0u32..12).prop_map(|(b, s)| BOp::Resize(b, s)),
        2 => i.clone().prop_map(BOp::FreeDeadBlock),
        2 => i.prop_map(BOp::FreeDeadSlot),
        1 => Just(BOp::ForeignFree),
    ]
}

/// Everything the owner of a boundary knows: who holds what, and what the "bytes" say.
#[derive(Default)]
struct Holders {
    /// (handle, content tag) per logical holder; sharers hold the same handle and tag.
    blocks: Vec<(BlockHandle, u64)>,
    slots: Vec<(SlotHandle, u64, bool)>,
    /// Content tag at each block id / slot position, moved by the reported copies.
    block_mem: HashMap<u32, u64>,
    slot_mem: HashMap<i64, u64>,
    /// Raw-unit reservations (owner, ids).
    units: Vec<(u64, Vec<u32>)>,
    dead_blocks: Vec<BlockHandle>,
    dead_slots: Vec<SlotHandle>,
    live: BTreeSet<i64>,
    next_tag: u64,
}

impl Holders {
    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    /// Execute a change as the Pool would: copies, then table rewrites.
    fn apply(&mut self, c: &BoundaryChange) {
        for mv in &c.block_moves {
            let content = self.block_mem.get(&mv.old.id).copied();
            if let Some(t) = content {
                self.block_mem.insert(mv.new.id, t);
            }
            for h in &mut self.blocks {
                if h.0 == mv.old {
                    h.0 = mv.new;
                }
            }
            self.dead_blocks.push(mv.old);
        }
        for mv in &c.slot_moves {
            let content = self.slot_mem.get(&mv.from_position).copied();
            if let Some(t) = content {
                self.slot_mem.insert(mv.to_position, t);
            }
            for h in &mut self.slots {
                if h.0 == mv.old {
                    h.0 = mv.new;
                }
            }
            self.dead_slots.push(mv.old);
        }
        for p in c.retired_positions.clone() {
            assert!(self.live.remove(&p), "retired position {p} was not live");
        }
        for p in c.new_live_positions.clone() {
            assert!(self.live.insert(p), "new live position {p} was already live");
            // Initialised (§2.4): block data there is gone.
            self.slot_mem.remove(&p);
        }
    }
}

fn check_invariants(b: &Boundary, h: &Holders) {
    let (nb, ns) = (b.num_blocks(), b.num_slots());
    let g = b.geometry();
    assert!(i64::from(ns) <= b.held_positions(), "slots past capacity");
    assert!(nb <= b.max_blocks() && b.max_blocks() == b.max_blocks_beside(ns));
    assert_eq!((g.num_blocks, g.num_slots), (i64::from(nb), i64::from(ns)));
    // The lowest live slot starts above every block's rows.
    let block_top = i64::from(nb) * g.envelope_rows;
    let live = b.live_positions();
    if let Some(lowest) = live.clone().next() {
        assert!(block_top <= g.slot_span(lowest).unwrap().0, "blocks overlap slot position {lowest}");
    }
    assert!(block_top <= g.plane_rows);
    assert_eq!(h.live, live.clone().collect::<BTreeSet<_>>(), "reported live positions drifted");
    for &(bh, tag) in &h.blocks {
        b.check_block(bh).unwrap();
        assert!(bh.id < nb, "live block {} at or past num_blocks {nb}", bh.id);
        assert_eq!(h.block_mem.get(&bh.id), Some(&tag), "block holder lost its content");
        assert!(bh.id as i64 * g.envelope_rows + g.envelope_rows <= block_top);
    }
    for &(sh, tag, _) in &h.slots {
        b.check_slot(sh).unwrap();
        assert!(sh.group < ns, "live slot group {} at or past num_slots {ns}", sh.group);
        let pos = b.position(sh).unwrap();
        assert_eq!(pos, g.physical_slot(i64::from(sh.group)).unwrap());
        assert!(live.contains(&pos));
        assert_eq!(h.slot_mem.get(&pos), Some(&tag), "slot holder lost its content");
    }
    for (_, ids) in &h.units {
        assert!(ids.iter().all(|&id| id < nb), "a raw unit was retired");
    }
    assert!(b.blocks().num_free() <= nb && b.slots().num_free() <= ns);
}

fn pick<T>(v: &[T], i: usize) -> Option<usize> {
    (!v.is_empty()).then(|| i % v.len())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn boundary_keeps_every_holder(
        ring in prop::sample::select(vec![7i64, 64]),
        positions in 4i64..14,
        start_slots in 0i64..4,
        fill_blocks in any::<bool>(),
        ops in prop::collection::vec(b_op(), 1..120),
    ) {
        let probe = GeometrySpec::new(vec![4, 128, 4, 0], 0, 0, ring, 256).arena_rows(10).build().unwrap();
        let plane = positions * probe.slot_rows + probe.slot_rows / 2;
        let geometry = GeometrySpec::new(vec![4, 128, 4, 0], 0, start_slots, ring, 256)
            .arena_rows(10)
            .plane_rows(plane)
            .build()
            .unwrap();
        let mut b = Boundary::new(&geometry).unwrap();
        if fill_blocks {
            b.grow_blocks(b.max_blocks()).unwrap();
        }
        let mut other = Boundary::new(&geometry).unwrap();
        let foreign_block = other.grow_blocks(1).and_then(|_| Ok(other.alloc_block()?.handle)).ok();
        let mut h = Holders { live: b.live_positions().collect(), ..Default::default() };
        for op in ops {
            let before = b.clone();
            let result: Result<Option<BoundaryChange>, String> = match op.clone() {
                BOp::AllocBlock => match b.alloc_block() {
                    Ok(g) => {
                        let tag = h.tag();
                        h.block_mem.insert(g.handle.id, tag);
                        h.blocks.push((g.handle, tag));
                        Ok(None)
                    }
                    Err(e) => Err(e.to_string()),
                },
                BOp::FreeBlock(i) => match pick(&h.blocks, i) {
                    Some(i) => {
                        let (bh, _) = h.blocks.swap_remove(i);
                        b.free_block(bh).unwrap();
                        if !h.blocks.iter().any(|x| x.0 == bh) {
                            h.dead_blocks.push(bh);
                        }
                        Ok(None)
                    }
                    None => Ok(None),
                },
                BOp::ShareBlock(i) => match pick(&h.blocks, i) {
                    Some(i) => {
                        let (bh, tag) = h.blocks[i];
                        let shared = b.claim_block(bh.id).unwrap();
                        prop_assert_eq!(shared, bh);
                        h.blocks.push((bh, tag));
                        Ok(None)
                    }
                    None => Ok(None),
                },
                BOp::Publish(i, hash) => match pick(&h.blocks, i) {
                    Some(i) => {
                        b.publish_block(h.blocks[i].0, hash, 256).unwrap();
                        Ok(None)
                    }
                    None => Ok(None),
                },
                BOp::PrefixHit(hash) => match b.lookup(hash) {
                    Some(id) => {
                        let bh = b.claim_block(id).unwrap();
                        // A hit keeps the content, whoever held it before.
                        let tag = h.block_mem[&id];
                        h.blocks.push((bh, tag));
                        Ok(None)
                    }
                    None => Ok(None),
                },
                BOp::AllocSlot => match b.alloc_slot() {
                    Ok(sh) => {
                        let tag = h.tag();
                        h.slot_mem.insert(b.position(sh).unwrap(), tag);
                        h.slots.push((sh, tag, false));
                        Ok(None)
                    }
                    Err(e) => Err(e.to_string()),
                },
                BOp::FreeSlot(i) => match pick(&h.slots, i) {
                    Some(i) => {
                        let (sh, _, pinned) = h.slots[i];
                        if pinned {
                            b.free_slot(sh).map(|_| None).map_err(|e| e.to_string())
                        } else {
                            h.slots.swap_remove(i);
                            b.free_slot(sh).unwrap();
                            h.dead_slots.push(sh);
                            Ok(None)
                        }
                    }
                    None => Ok(None),
                },
                BOp::Pin(i) | BOp::Unpin(i) => match pick(&h.slots, i) {
                    Some(i) => {
                        let pin = matches!(op, BOp::Pin(_));
                        let r = if pin { b.pin_slot(h.slots[i].0) } else { b.unpin_slot(h.slots[i].0) };
                        prop_assert_eq!(r.is_ok(), pin || h.slots[i].2, "{:?}", r);
                        if r.is_ok() {
                            h.slots[i].2 = pin;
                        }
                        r.map(|_| None).map_err(|e| e.to_string())
                    }
                    None => Ok(None),
                },
                BOp::Reserve(count) => {
                    let owner = h.next_tag + 1000;
                    h.next_tag += 1;
                    match b.reserve_units(count, owner) {
                        Some(r) => {
                            h.units.push((owner, r.ids));
                            Ok(None)
                        }
                        None => Err("no units".into()),
                    }
                }
                BOp::Release(i, corrupt) => match pick(&h.units, i) {
                    Some(i) => {
                        let (owner, ids) = h.units[i].clone();
                        if corrupt {
                            b.release_units(&ids, owner + 1).map(|_| None).map_err(|e| e.to_string())
                        } else {
                            b.release_units(&ids, owner).unwrap();
                            h.units.swap_remove(i);
                            Ok(None)
                        }
                    }
                    None => Ok(None),
                },
                BOp::GrowSlots(n) => b.grow_slots(n).map(Some).map_err(|e| e.to_string()),
                BOp::ShrinkSlots(n) => b.shrink_slots(n).map(Some).map_err(|e| e.to_string()),
                BOp::GrowBlocks(n) => b.grow_blocks(n).map(Some).map_err(|e| e.to_string()),
                BOp::GrowBlocksShrinking(n) => {
                    b.grow_blocks_shrinking_slots(n).map(Some).map_err(|e| e.to_string())
                }
                BOp::ShrinkBlocks(n) => b.shrink_blocks(n).map(Some).map_err(|e| e.to_string()),
                BOp::Resize(nb, ns) => b.resize(nb, ns).map(Some).map_err(|e| e.to_string()),
                BOp::FreeDeadBlock(i) => match pick(&h.dead_blocks, i) {
                    Some(i) => {
                        let d = h.dead_blocks[i];
                        if h.blocks.iter().any(|x| x.0 == d) {
                            Ok(None)
                        } else {
                            let e = b.free_block(d).expect_err("a dead handle was accepted");
                            prop_assert!(matches!(e, AllocError::DoubleFree { .. } | AllocError::StaleHandle { .. }), "{:?}", e);
                            Err(e.to_string())
                        }
                    }
                    None => Ok(None),
                },
                BOp::FreeDeadSlot(i) => match pick(&h.dead_slots, i) {
                    Some(i) => {
                        let d = h.dead_slots[i];
                        let e = b.free_slot(d).expect_err("a dead slot handle was accepted");
                        prop_assert!(matches!(e, AllocError::DoubleFree { .. } | AllocError::StaleHandle { .. }), "{:?}", e);
                        Err(e.to_string())
                    }
                    None => Ok(None),
                },
                BOp::ForeignFree => match foreign_block {
                    Some(fb) => {
                        let e = b.free_block(fb).expect_err("a foreign handle was accepted");
                        prop_assert!(matches!(e, AllocError::ForeignHandle { .. }), "{:?}", e);
                        Err(e.to_string())
                    }
                    None => Ok(None),
                },
            };
            match result {
                Ok(Some(change)) => {
                    prop_assert_eq!((change.num_blocks, change.num_slots), (b.num_blocks(), b.num_slots()));
                    h.apply(&change);
                }
                Ok(None) => {}
                Err(_) => prop_assert_eq!(&b, &before, "refused {:?} changed the boundary", op),
            }
            check_invariants(&b, &h);
        }
    }

    /// A boundary error names a real obstacle: when `resize` refuses a valid split, some held
    /// id above the cut has no free id below, or something immovable is in the way.
    #[test]
    fn resize_refuses_only_for_a_reason(
        start_blocks in 0u32..6,
        hold in prop::collection::vec(any::<bool>(), 6),
        ns in 0u32..8,
        nb in 0u32..8,
    ) {
        let geometry = GeometrySpec::new(vec![4, 128, 4, 0], i64::from(start_blocks), 0, 7, 256)
            .arena_rows(10)
            .plane_rows(960)
            .build()
            .unwrap();
        let mut b = Boundary::new(&geometry).unwrap();
        let handles: Vec<BlockHandle> = (0..start_blocks).map(|_| b.alloc_block().unwrap().handle).collect();
        for (hd, keep) in handles.iter().zip(&hold) {
            if !keep {
                b.free_block(*hd).unwrap();
            }
        }
        let held = handles.len() as u32 - b.blocks().num_free();
        match b.resize(nb, ns) {
            Ok(c) => prop_assert!(held <= nb && c.num_blocks == nb),
            Err(BoundaryError::NoRoom { .. } | BoundaryError::TooManySlots { .. }) => {
                prop_assert!(i64::from(ns) > b.held_positions() || nb > b.max_blocks_beside(ns))
            }
            Err(BoundaryError::NoBlockTarget { .. }) => prop_assert!(held > nb),
            Err(e) => prop_assert!(false, "unexpected refusal {e}"),
        }
    }
}
