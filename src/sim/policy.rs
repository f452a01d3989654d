//! The engine's decisions, one small function each, so a request-level manager can replace
//! them one at a time: the start-up split, which requests are refused, admission, taking a
//! slot, growing a request's blocks, choosing a preemption victim, and giving idle slots
//! back to blocks. Every pool operation goes through [`Pool`]'s public methods.

use super::{RequestSpec, SimConfig, SplitPolicy};
use crate::alloc::{BlockHandle, SlotHandle};
use crate::boundary::BoundaryChange;
use crate::pool::{Pool, PoolError, SlotLease};

/// A request holding pool memory.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) spec: RequestSpec,
    pub(crate) slot: SlotHandle,
    pub(crate) position: i64,
    pub(crate) blocks: Vec<BlockHandle>,
    /// Tokens in context (prefilled + generated).
    pub(crate) context: u64,
    pub(crate) generated: u64,
    pub(crate) admitted: u64,
}

impl Running {
    pub(crate) fn new(spec: RequestSpec, lease: SlotLease, step: u64) -> Running {
        Running {
            spec,
            slot: lease.handle,
            position: lease.position,
            blocks: Vec::new(),
            context: 0,
            generated: 0,
            admitted: step,
        }
    }
    pub(crate) fn prefilling(&self) -> bool {
        self.context < self.spec.prompt
    }
}

/// Boundary work done so far.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Moves {
    pub(crate) moves: u64,
    pub(crate) block_relocations: u64,
    pub(crate) slot_relocations: u64,
}

/// What the policy functions act on: the pool, the policy, the running requests (whose
/// handles a boundary move rewrites) and the move counters.
pub(crate) struct Fleet<'p> {
    pub(crate) pool: &'p Pool,
    pub(crate) policy: SplitPolicy,
    pub(crate) running: Vec<Running>,
    pub(crate) moves: Moves,
}

/// Set the start-up split: the fixed policy reserves `max_seqs` slots, the elastic one only
/// its headroom; blocks take the rest. Returns the block count, which bounds what one
/// request can ever hold.
pub(crate) fn initial_split(pool: &Pool, cfg: &SimConfig, policy: SplitPolicy) -> Result<u32, PoolError> {
    let slots = match policy {
        SplitPolicy::Fixed => cfg.max_seqs as u32,
        SplitPolicy::Elastic => cfg.slot_headroom,
    };
    if pool.counts()?.num_slots != slots {
        pool.resize(0, slots)?;
    }
    let c = pool.counts()?;
    if c.num_blocks != c.max_blocks {
        pool.resize(c.max_blocks, slots)?;
    }
    Ok(pool.counts()?.num_blocks)
}

/// Why a request is refused at admission: it could never fit, so admitting it would only
/// stall the run (nothing else to preempt once it holds every block).
pub(crate) fn refusal(req: &RequestSpec, cfg: &SimConfig, capacity_blocks: u32, block_size: u64) -> bool {
    // Decode writes whole steps, so a context can pass prompt + output by a step's tokens.
    let longest = req.prompt + req.output + cfg.tokens_per_decode as u64 - 1;
    req.prompt + req.output > cfg.max_context || longest.div_ceil(block_size) > u64::from(capacity_blocks)
}

/// Admission check: both policies admit only while the blocks running requests' prompts
/// still need stay covered (the engine knows prompt lengths), so admission does not simply
/// trade into preemptions.
pub(crate) fn may_admit(f: &Fleet<'_>, first: u32, block_size: u64) -> Result<bool, PoolError> {
    let owed: u64 = f
        .running
        .iter()
        .map(|r| r.spec.prompt.div_ceil(block_size).saturating_sub(r.blocks.len() as u64))
        .sum();
    let c = f.pool.counts()?;
    let gap = match f.policy {
        SplitPolicy::Elastic => u64::from(c.max_blocks.saturating_sub(c.num_blocks)),
        SplitPolicy::Fixed => 0,
    };
    Ok(u64::from(c.free_blocks) + gap >= owed + u64::from(first))
}

/// Rewrite every holder after a boundary change (the engine's block tables and slots).
fn note_change(f: &mut Fleet<'_>, ch: &BoundaryChange) {
    f.moves.moves += 1;
    f.moves.block_relocations += ch.block_moves.len() as u64;
    f.moves.slot_relocations += ch.slot_moves.len() as u64;
    for m in &ch.block_moves {
        for b in f.running.iter_mut().flat_map(|r| r.blocks.iter_mut()) {
            if *b == m.old {
                *b = m.new;
            }
        }
    }
    for m in &ch.slot_moves {
        for r in f.running.iter_mut().filter(|r| r.slot == m.old) {
            r.slot = m.new;
            r.position = m.to_position;
        }
    }
}

/// A free slot: take one, or under the elastic policy grow the slot region into the gap
/// (relocating top blocks when they are held and free ids exist below).
pub(crate) fn take_slot(f: &mut Fleet<'_>, need: u32) -> Result<Option<SlotLease>, PoolError> {
    let c = f.pool.counts()?;
    if c.free_slots == 0 {
        if f.policy == SplitPolicy::Fixed {
            return Ok(None);
        }
        // Take a slot from the gap only while blocks keep a reserve (a twentieth of what
        // the plane holds, plus the rows the slot itself takes): admitting past that would
        // only preempt running requests for lack of blocks.
        let g = f.pool.geometry()?;
        let slot_blocks = (g.slot_rows + g.envelope_rows - 1) / g.envelope_rows;
        let reserve = i64::from(c.max_blocks.max(c.num_blocks)) / 20 + slot_blocks + i64::from(need);
        let spare = i64::from(c.free_blocks) + i64::from(c.max_blocks.saturating_sub(c.num_blocks));
        if spare < reserve {
            return Ok(None);
        }
        match f.pool.grow_slots(1) {
            Ok(ch) => note_change(f, &ch),
            Err(_) => return Ok(None),
        }
    }
    match f.pool.alloc_slot() {
        Ok(l) => Ok(Some(l)),
        Err(PoolError::Alloc(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Make `n` blocks free: under the elastic policy, turn idle slots (and the gap) into
/// blocks first. Returns whether they are free now.
pub(crate) fn ensure_free_blocks(f: &mut Fleet<'_>, n: u32) -> Result<bool, PoolError> {
    let c = f.pool.counts()?;
    if c.free_blocks >= n {
        return Ok(true);
    }
    if f.policy == SplitPolicy::Elastic {
        let short = n - c.free_blocks;
        let room = c.max_blocks.saturating_sub(c.num_blocks);
        let r =
            if room >= short { f.pool.grow_blocks(short) } else { f.pool.grow_blocks_shrinking_slots(short) };
        if let Ok(ch) = r {
            note_change(f, &ch);
        }
    }
    Ok(f.pool.counts()?.free_blocks >= n)
}

/// Give request `i` blocks up to `need`. Returns whether it has them (false: out of
/// blocks, the request stalls this step).
pub(crate) fn grow_blocks_of(f: &mut Fleet<'_>, i: usize, need: usize) -> Result<bool, PoolError> {
    let have = f.running[i].blocks.len();
    if have >= need {
        return Ok(true);
    }
    let short = u32::try_from(need - have).unwrap_or(u32::MAX);
    if !ensure_free_blocks(f, short)? {
        return Ok(false);
    }
    for _ in have..need {
        let grant = f.pool.alloc_block()?;
        f.running[i].blocks.push(grant.handle);
    }
    Ok(true)
}

/// Out of blocks: the most recently admitted request is preempted (its work restarts), as
/// engines do, so the others can make progress. `None` when preempting would not help.
pub(crate) fn preemption_victim(f: &Fleet<'_>, stalled: bool) -> Result<Option<usize>, PoolError> {
    if !stalled || f.running.len() < 2 || f.pool.counts()?.free_blocks != 0 {
        return Ok(None);
    }
    Ok((0..f.running.len()).max_by_key(|&j| (f.running[j].admitted, f.running[j].spec.id)))
}

/// Elastic only, every eighth step: give idle slots beyond the headroom back to blocks,
/// then grow blocks into the gap.
pub(crate) fn give_back_idle_slots(f: &mut Fleet<'_>, headroom: u32, step: u64) -> Result<(), PoolError> {
    if f.policy != SplitPolicy::Elastic || step % 8 != 0 {
        return Ok(());
    }
    let idle = f.pool.counts()?.free_slots;
    if idle <= headroom {
        return Ok(());
    }
    if let Ok(ch) = f.pool.shrink_slots(idle - headroom) {
        note_change(f, &ch);
        let c = f.pool.counts()?;
        let grow = c.max_blocks.saturating_sub(c.num_blocks);
        if grow > 0 {
            if let Ok(ch) = f.pool.grow_blocks(grow) {
                note_change(f, &ch);
            }
        }
    }
    Ok(())
}

/// Free everything `r` holds.
pub(crate) fn release(pool: &Pool, r: Running) -> Result<(), PoolError> {
    for b in r.blocks {
        pool.free_block(b)?;
    }
    pool.free_slot(r.slot)
}
