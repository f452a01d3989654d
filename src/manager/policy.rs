//! Where the block/slot boundary sits: the policy object the manager consults when a slot or
//! blocks run short and once per scheduler step. The manager carries the decision out
//! (moves the boundary, rewrites its tables, evicts); the policy only says how far.

/// What a policy sees: the split and what could be freed, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolView {
    /// Blocks in the block region now.
    pub num_blocks: u32,
    /// Slots in the slot region now.
    pub num_slots: u32,
    /// Free block ids (not held by a request, the cache or a checkpoint).
    pub free_blocks: u32,
    /// Free slots.
    pub free_slots: u32,
    /// Most blocks the plane holds beside the current slots (the gap is the difference).
    pub max_blocks: u32,
    /// Blocks eviction could free now: unreferenced cached blocks plus the units of ready,
    /// unpinned checkpoints.
    pub evictable_blocks: u32,
    /// Blocks one slot's rows displace (rounded up).
    pub slot_blocks: u32,
    /// Blocks running requests still need to finish their prompts.
    pub owed_blocks: u64,
    /// Requests holding a slot.
    pub running: u32,
    /// Requests known to the manager without a slot (waiting or preempted).
    pub waiting: u32,
    /// Prompt tokens served from the cache so far, per mille of the prompt tokens admitted:
    /// how much the cache is worth keeping. Counted in tokens, not admissions: where every
    /// request shares a short system prompt, nearly every admission hits while the cache
    /// serves far less of the prompt work (multiturn: 0.98 of admissions, 0.70 of tokens).
    pub hit_per_mille: u32,
}

crate::setters::with_setters!(PoolView {
    with_num_blocks(num_blocks: u32),
    with_num_slots(num_slots: u32),
    with_free_blocks(free_blocks: u32),
    with_free_slots(free_slots: u32),
    with_max_blocks(max_blocks: u32),
    with_evictable_blocks(evictable_blocks: u32),
    with_slot_blocks(slot_blocks: u32),
    with_owed_blocks(owed_blocks: u64),
    with_running(running: u32),
    with_waiting(waiting: u32),
    with_hit_per_mille(hit_per_mille: u32),
});

impl PoolView {
    /// Blocks obtainable without touching a slot: free, in the gap, or evictable.
    pub fn spare_blocks(&self) -> u64 {
        u64::from(self.free_blocks)
            + u64::from(self.max_blocks.saturating_sub(self.num_blocks))
            + u64::from(self.evictable_blocks)
    }

    /// Blocks kept for decode growth when one more request runs: `per_seq` for each running
    /// request and the newcomer.
    pub fn decode_room(&self, per_seq: u32) -> u64 {
        u64::from(self.running + 1) * u64::from(per_seq)
    }

    /// Whether a request whose prompt needs `rest` more blocks (past its hit) can run beside
    /// the running ones: the blocks their prompts still owe, its own, and `per_seq` blocks of
    /// decode room per request stay obtainable.
    pub fn admits(&self, rest: u64, per_seq: u32) -> bool {
        // A sum past u64 is more than any pool holds: not admitted (never a wrap-around).
        self.owed_blocks
            .checked_add(rest)
            .and_then(|n| n.checked_add(self.decode_room(per_seq)))
            .is_some_and(|need| self.spare_blocks() >= need)
    }
}

/// How blocks that are short are found, beside evicting cached ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockGrowth {
    /// Blocks to add to the block region (from the gap, then from idle slots when
    /// `shrink_idle_slots`).
    pub grow: u32,
    /// Whether idle slots may be given up to make that room.
    pub shrink_idle_slots: bool,
}

/// The boundary policy the manager consults. Implementations decide; the manager acts.
pub trait SplitPolicy: Send {
    /// The name reports carry (`elastic`, `fixed`).
    fn name(&self) -> &'static str;
    /// Slots to carve at start-up, given a view of the empty pool (blocks take the rest).
    fn initial_slots(&self, view: &PoolView) -> u32;
    /// A request needs a slot and none is free: how many slots to add (0: the request waits).
    fn grow_slots(&mut self, view: &PoolView) -> u32;
    /// `short` blocks are needed beyond the free ones: how many to add to the block region
    /// before the manager evicts cached blocks for the rest.
    fn grow_blocks(&mut self, view: &PoolView, short: u32) -> BlockGrowth;
    /// Once per scheduler step: idle slots to give back to blocks.
    fn rebalance(&mut self, view: &PoolView) -> u32;
    /// Admission back-pressure: may a waiting request whose prompt needs `rest` more blocks
    /// (past its hit) be admitted now? The default keeps [`DECODE_BLOCKS_PER_SEQ`] blocks of
    /// decode room per request ([`PoolView::admits`]).
    ///
    /// Why decode room and not only the owed prompts: a request admitted into a free slot
    /// with exactly its prompt covered is paid for by the running requests' decode growth —
    /// each needs a block every `block_size` tokens, the blocks the admission counted as
    /// spare are gone before the owed prompts finish, and a request is preempted and redoes
    /// its prefill (the mixed mix's 3 preemptions: 17 blocks of slack at admission, 26 taken
    /// by decode growth in the 15 steps before the stall while a long prompt prefilled).
    fn may_admit(&self, view: &PoolView, rest: u64) -> bool {
        view.admits(rest, DECODE_BLOCKS_PER_SEQ)
    }
}

/// The elastic boundary: slots come from blocks only while blocks keep a reserve for what
/// running requests still owe, and idle slots go back to blocks beyond a small headroom.
///
/// Why these rules: a slot taken while running requests still owe blocks for their prompts
/// is paid for by preempting one of them later (the old simulator's elastic run preempted
/// 98 times against the fixed split's 9 on the mixed mix because it only kept a fixed
/// twentieth in reserve). Counting the owed blocks and the cache that eviction can free makes
/// a new slot cost only memory nobody will need before it is given back.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ElasticPolicy {
    /// Free slots kept beyond the running requests.
    pub headroom: u32,
    /// Most slots the policy will grow to.
    pub max_slots: u32,
    /// Blocks kept in reserve beyond what running requests owe, as a fraction of the plane's
    /// block capacity (per mille).
    pub reserve_per_mille: u32,
    /// Cached blocks a new slot may not evict, as a fraction of the plane's block capacity
    /// (per mille) scaled by the share of prompt tokens the cache served
    /// ([`PoolView::hit_per_mille`]): the prefix cache is what the
    /// next turn hits, so where requests hit, slots come out of the cache only beyond this
    /// share; where nothing hits, the cache is no reason to hold a request back.
    pub cache_per_mille: u32,
    /// Blocks kept per running request for its decode growth, against new slots and new
    /// admissions alike (owed blocks count prompts only; a request that cannot grow its
    /// output is preempted and redoes work).
    pub decode_blocks_per_seq: u32,
}

crate::setters::with_setters!(ElasticPolicy {
    with_headroom(headroom: u32),
    with_max_slots(max_slots: u32),
    with_reserve_per_mille(reserve_per_mille: u32),
    with_cache_per_mille(cache_per_mille: u32),
    with_decode_blocks_per_seq(decode_blocks_per_seq: u32),
});

impl Default for ElasticPolicy {
    fn default() -> Self {
        ElasticPolicy {
            headroom: 2,
            max_slots: 256,
            reserve_per_mille: 20,
            cache_per_mille: CACHE_PER_MILLE,
            decode_blocks_per_seq: DECODE_BLOCKS_PER_SEQ,
        }
    }
}

/// [`ElasticPolicy::cache_per_mille`]'s default.
pub const CACHE_PER_MILLE: u32 = 700;
/// [`ElasticPolicy::decode_blocks_per_seq`]'s default.
pub const DECODE_BLOCKS_PER_SEQ: u32 = 2;

impl SplitPolicy for ElasticPolicy {
    fn name(&self) -> &'static str {
        "elastic"
    }
    fn initial_slots(&self, _view: &PoolView) -> u32 {
        self.headroom.clamp(1, self.max_slots.max(1))
    }
    fn grow_slots(&mut self, v: &PoolView) -> u32 {
        if v.num_slots >= self.max_slots {
            return 0;
        }
        let capacity = u64::from(v.max_blocks.max(v.num_blocks));
        let reserve = capacity * u64::from(self.reserve_per_mille) / 1000
            + v.owed_blocks
            + u64::from(v.slot_blocks)
            + v.decode_room(self.decode_blocks_per_seq);
        // The cache counts as spare only beyond the share kept for hits.
        let keep =
            capacity * u64::from(self.cache_per_mille) / 1000 * u64::from(v.hit_per_mille.min(1000)) / 1000;
        let spare = v.spare_blocks() - u64::from(v.evictable_blocks)
            + u64::from(v.evictable_blocks).saturating_sub(keep);
        u32::from(spare >= reserve)
    }
    fn grow_blocks(&mut self, v: &PoolView, short: u32) -> BlockGrowth {
        // The gap costs nothing; idle slots beyond the headroom are the next cheapest (the
        // cache is what a later request would hit).
        BlockGrowth { grow: short, shrink_idle_slots: v.free_slots > 0 }
    }
    fn rebalance(&mut self, v: &PoolView) -> u32 {
        // Keep the headroom, and keep slots a waiting request could use right away.
        let keep = self.headroom.max(v.waiting.min(v.free_slots));
        v.free_slots.saturating_sub(keep)
    }
    fn may_admit(&self, v: &PoolView, rest: u64) -> bool {
        v.admits(rest, self.decode_blocks_per_seq)
    }
}

/// A fixed split: `slots` slots carved at start-up, the boundary never moves (the way
/// engines with a fixed `max_num_seqs` behave). The comparison baseline.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct FixedPolicy {
    /// Slots carved at start-up.
    pub slots: u32,
}

impl FixedPolicy {
    /// A fixed split of `slots` slots.
    pub fn new(slots: u32) -> Self {
        FixedPolicy { slots }
    }
}

impl SplitPolicy for FixedPolicy {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn initial_slots(&self, _view: &PoolView) -> u32 {
        self.slots
    }
    fn grow_slots(&mut self, _view: &PoolView) -> u32 {
        0
    }
    fn grow_blocks(&mut self, _view: &PoolView, _short: u32) -> BlockGrowth {
        BlockGrowth::default()
    }
    fn rebalance(&mut self, _view: &PoolView) -> u32 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> PoolView {
        PoolView {
            num_blocks: 900,
            num_slots: 4,
            free_blocks: 100,
            free_slots: 0,
            max_blocks: 900,
            evictable_blocks: 50,
            slot_blocks: 20,
            owed_blocks: 0,
            running: 4,
            waiting: 3,
            hit_per_mille: 1000,
        }
    }

    #[test]
    fn elastic_takes_a_slot_only_with_the_owed_blocks_covered() {
        let mut p = ElasticPolicy::default();
        assert_eq!(p.grow_slots(&view()), 1);
        // 150 spare, 18 reserve + 20 slot rows + 120 owed > 150.
        assert_eq!(p.grow_slots(&PoolView { owed_blocks: 120, ..view() }), 0);
        assert_eq!(p.grow_slots(&PoolView { num_slots: 256, ..view() }), 0);
    }

    #[test]
    fn elastic_keeps_its_cache_share_and_decode_room_against_new_slots() {
        let mut p = ElasticPolicy::default();
        // 10 free + 890 evictable: 630 of the cache are kept for hits, so 270 count.
        let cached = PoolView { free_blocks: 10, evictable_blocks: 890, ..view() };
        assert_eq!(p.grow_slots(&cached), 1);
        // 10 free + 600 evictable: the whole cache is within the kept share.
        let kept = PoolView { free_blocks: 10, evictable_blocks: 600, ..view() };
        assert_eq!(p.grow_slots(&kept), 0);
        // Where nothing hits, the cache holds nothing back.
        assert_eq!(p.grow_slots(&PoolView { hit_per_mille: 0, ..kept }), 1);
        // 100 free, no cache: 18 reserve + 20 slot rows + (40 + 1) × 2 decode blocks > 100.
        assert_eq!(p.grow_slots(&PoolView { evictable_blocks: 0, running: 40, ..view() }), 0);
        assert_eq!(p.grow_slots(&PoolView { evictable_blocks: 0, running: 20, ..view() }), 1);
    }

    #[test]
    fn admission_keeps_decode_room_for_every_running_request_and_the_newcomer() {
        // 150 spare; 100 owed; 4 running + the newcomer at 2 decode blocks each.
        let v = PoolView { owed_blocks: 100, ..view() };
        let (e, f) = (ElasticPolicy::default(), FixedPolicy { slots: 8 });
        for p in [&e as &dyn SplitPolicy, &f] {
            assert!(p.may_admit(&v, 40), "{}: 100 + 40 + 10 = 150 fits", p.name());
            assert!(!p.may_admit(&v, 41), "{}: the decode room is not spent on a prompt", p.name());
        }
        // Without decode room only the prompts count.
        let bare = ElasticPolicy { decode_blocks_per_seq: 0, ..ElasticPolicy::default() };
        assert!(bare.may_admit(&v, 50) && !bare.may_admit(&v, 51));
    }

    #[test]
    fn elastic_gives_back_idle_slots_beyond_headroom_and_waiters() {
        let mut p = ElasticPolicy::default();
        assert_eq!(p.rebalance(&PoolView { free_slots: 10, waiting: 0, ..view() }), 8);
        assert_eq!(p.rebalance(&PoolView { free_slots: 10, waiting: 5, ..view() }), 5);
        assert_eq!(p.rebalance(&PoolView { free_slots: 1, ..view() }), 0);
        let mut f = FixedPolicy { slots: 8 };
        assert_eq!(f.rebalance(&PoolView { free_slots: 10, ..view() }), 0);
        assert_eq!(f.grow_slots(&view()), 0);
    }
}
