//! `v4pool simulate`: drive a pool as a serving engine would.
//!
//! Requests arrive (Poisson); prompt and output lengths come from a mix (chat, agentic up to
//! 1M tokens, or both); a request is admitted when a slot and the blocks for its prompt are
//! free; prefill runs in chunks under a per-step token budget; every decode step stages and
//! launches the decode index build on the pool's backend; completion frees everything. When
//! blocks run out a running request is preempted (freed and re-queued), as engines do.
//!
//! The same workload (same seed) runs twice: with the elastic boundary (slots taken from
//! the gap on demand, idle slots given back to blocks) and with a fixed split of the same
//! budget (`max_seqs` slots reserved at start-up, as engines that fix the split behave).

use super::CliError;
use crate::backend::Backend;
use crate::pool::{DecodeCapacity, DecodeSeq, Pool, PoolError};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

/// What a simulation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Decode(#[from] crate::pool::DecodeError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
}

/// Length mixes of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// Prompts around 1k tokens, outputs around 300.
    Chat,
    /// Long-context agentic work: prompts 32k..1M tokens (log-uniform), outputs 200..4k.
    Agentic,
    /// 90 % chat, 10 % agentic.
    Mixed,
}

impl Mix {
    pub fn parse(s: &str) -> Option<Mix> {
        match s {
            "chat" => Some(Mix::Chat),
            "agentic" => Some(Mix::Agentic),
            "mixed" => Some(Mix::Mixed),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Mix::Chat => "chat",
            Mix::Agentic => "agentic",
            Mix::Mixed => "mixed",
        }
    }
}

/// How the split between blocks and slots is managed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitPolicy {
    /// Slots grow from the gap on demand and idle ones go back to blocks.
    Elastic,
    /// `max_seqs` slots reserved at start-up; the boundary never moves.
    Fixed,
}

/// Workload and engine parameters (the pool itself comes from the caller).
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub mix: Mix,
    /// Mean arrivals per step.
    pub rate: f64,
    pub steps: u64,
    pub seed: u64,
    /// Most running requests under the fixed split (the engine's `max_num_seqs`, each with
    /// a slot reserved at start-up).
    pub max_seqs: usize,
    /// Most running requests under the elastic boundary: slots are taken from the gap only
    /// while memory allows, so the cap can sit above `max_seqs`.
    pub elastic_max_seqs: usize,
    /// Prefill tokens one step processes, over all prefilling requests.
    pub prefill_chunk: u64,
    /// Tokens one decode step writes per request (1 + speculative steps).
    pub tokens_per_decode: usize,
    /// Longest context a request may reach (block-table width).
    pub max_context: u64,
    /// Slots an elastic pool keeps free beyond the running ones.
    pub slot_headroom: u32,
    /// Sample memory by region every this many steps.
    pub sample_every: u64,
    pub progress: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            mix: Mix::Mixed,
            rate: 0.5,
            steps: 3000,
            seed: 7,
            max_seqs: 64,
            elastic_max_seqs: 256,
            prefill_chunk: 8192,
            tokens_per_decode: 1,
            max_context: 1 << 20,
            slot_headroom: 2,
            sample_every: 10,
            progress: true,
        }
    }
}

/// A deterministic PRNG (SplitMix64): the workload must be identical for both policies. The
/// benches draw their inputs from it too.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = hi.wrapping_sub(lo).max(1) as u64;
        lo.wrapping_add((self.next_u64() % span) as i64)
    }
    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Poisson-distributed count (Knuth; fine for the small means a step sees).
    pub fn poisson(&mut self, mean: f64) -> u64 {
        let l = (-mean).exp();
        let (mut k, mut p) = (0u64, 1.0);
        loop {
            p *= self.f64();
            if p <= l || k > 1000 {
                return k;
            }
            k += 1;
        }
    }
    /// Log-normal with the given median and log-sd, clamped to [lo, hi].
    pub fn lognormal(&mut self, median: f64, sigma: f64, lo: u64, hi: u64) -> u64 {
        let (u1, u2) = (self.f64().max(1e-12), self.f64());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        ((median * (sigma * z).exp()) as u64).clamp(lo, hi)
    }
    /// Log-uniform in [lo, hi].
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + (b - a) * self.f64()).exp() as u64).clamp(lo, hi)
    }
}

/// One request of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub id: u64,
    pub arrival: u64,
    pub prompt: u64,
    pub output: u64,
}

/// The whole arrival sequence, drawn once so both policies see the same requests.
pub fn workload(cfg: &SimConfig) -> Vec<RequestSpec> {
    let mut rng = Rng::new(cfg.seed);
    let cap = cfg.max_context.max(2);
    let mut out = Vec::new();
    for step in 0..cfg.steps {
        for _ in 0..rng.poisson(cfg.rate) {
            let agentic = match cfg.mix {
                Mix::Chat => false,
                Mix::Agentic => true,
                Mix::Mixed => rng.f64() < 0.1,
            };
            let (prompt, output) = if agentic {
                (rng.log_uniform(32 << 10, cap.min(1 << 20)), rng.log_uniform(200, 4096))
            } else {
                (rng.lognormal(1000.0, 0.8, 16, 16384), rng.lognormal(300.0, 0.7, 16, 4096))
            };
            let prompt = prompt.min(cap - 1);
            let output = output.min(cap - prompt).max(1);
            out.push(RequestSpec { id: out.len() as u64, arrival: step, prompt, output });
        }
    }
    out
}

/// Memory by region at one step, in plane rows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    pub step: u64,
    pub block_rows_used: i64,
    pub block_rows_free: i64,
    pub slot_rows_used: i64,
    pub slot_rows_free: i64,
    pub gap_rows: i64,
    pub running: usize,
    pub waiting: usize,
    pub compressed_tokens: u64,
}

/// What one run reports.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    pub policy: String,
    pub backend: String,
    pub steps: u64,
    pub arrived: u64,
    pub completed: u64,
    pub generated_tokens: u64,
    pub prefilled_tokens: u64,
    pub preemptions: u64,
    pub max_running: usize,
    pub mean_running: f64,
    pub max_compressed_tokens: u64,
    pub mean_compressed_tokens: f64,
    pub boundary_moves: u64,
    pub block_relocations: u64,
    pub slot_relocations: u64,
    pub mean_wait_steps: f64,
    pub index_build_steps: u64,
    pub index_build_mean_us: f64,
    pub index_build_p99_us: f64,
    pub index_build_max_us: f64,
    /// Host staging of the step's metadata (with block tables), mean per step.
    pub stage_mean_us: f64,
    pub plane_rows: i64,
    pub envelope_rows: i64,
    pub slot_rows: i64,
    pub samples: Vec<Sample>,
    /// Final row space: (num_blocks, used blocks, num_slots, used slots).
    pub final_split: (u32, u32, u32, u32),
}

struct Running {
    spec: RequestSpec,
    slot: crate::alloc::SlotHandle,
    position: i64,
    blocks: Vec<crate::alloc::BlockHandle>,
    /// Tokens in context (prefilled + generated).
    context: u64,
    generated: u64,
    admitted: u64,
}

impl Running {
    fn prefilling(&self) -> bool {
        self.context < self.spec.prompt
    }
}

/// Run the workload on `pool` under `policy`.
pub fn simulate(
    pool: &Arc<Pool>,
    cfg: &SimConfig,
    policy: SplitPolicy,
    requests: &[RequestSpec],
) -> Result<SimReport, SimError> {
    let backend: Arc<dyn Backend> = pool.backend().clone();
    let geometry = pool.geometry()?;
    let block_size = geometry.block_size as u64;
    let (e_rows, s_rows) = (geometry.envelope_rows, geometry.slot_rows);
    let max_blocks_per_seq = cfg.max_context.div_ceil(block_size) as usize + 1;
    let cap_seqs = match policy {
        SplitPolicy::Fixed => cfg.max_seqs,
        SplitPolicy::Elastic => cfg.elastic_max_seqs.max(cfg.max_seqs),
    };

    // Start the split: fixed reserves max_seqs slots; elastic starts with the headroom.
    let want_slots = match policy {
        SplitPolicy::Fixed => cfg.max_seqs as u32,
        SplitPolicy::Elastic => cfg.slot_headroom.max(1),
    };
    let c = pool.counts()?;
    let slots_fit = (geometry.slot_positions as u32).min(want_slots);
    let blocks = pool.with_boundary(|b| b.max_blocks_beside(slots_fit))?;
    if c.num_slots != slots_fit || c.num_blocks != blocks {
        pool.resize(0, slots_fit)?;
        pool.resize(blocks, slots_fit)?;
    }

    let mut decode = pool.decode_path(DecodeCapacity {
        max_seqs: cap_seqs,
        max_tokens: cap_seqs * cfg.tokens_per_decode,
        max_blocks_per_seq,
        win: geometry.ring_slots.min(128) as i32,
        index_topk: 512,
    })?;

    let mut rep = SimReport {
        policy: match policy {
            SplitPolicy::Elastic => "elastic".into(),
            SplitPolicy::Fixed => "fixed".into(),
        },
        backend: if backend.device_name() == backend.kind().to_string() {
            backend.kind().to_string()
        } else {
            format!("{} ({})", backend.kind(), backend.device_name())
        },
        steps: cfg.steps,
        plane_rows: geometry.plane_rows,
        envelope_rows: e_rows,
        slot_rows: s_rows,
        ..SimReport::default()
    };
    let mut waiting: VecDeque<RequestSpec> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut next_arrival = 0usize;
    let mut build_us: Vec<f64> = Vec::new();
    let mut stage_us = 0f64;
    let (mut sum_running, mut sum_tokens, mut sum_wait) = (0f64, 0f64, 0f64);
    // Admissions, re-admissions after preemption included: what the wait is averaged over.
    let mut admissions = 0u64;
    let mut table: Vec<i32> = Vec::with_capacity(max_blocks_per_seq);
    let progress_every = (cfg.steps / 100).max(1);

    for step in 0..cfg.steps {
        while next_arrival < requests.len() && requests[next_arrival].arrival <= step {
            waiting.push_back(requests[next_arrival]);
            rep.arrived += 1;
            next_arrival += 1;
        }

        // Admission, FIFO: a slot and the blocks for the first prefill chunk.
        while let Some(req) = waiting.front().copied() {
            if running.len() >= cap_seqs {
                break;
            }
            let first = req.prompt.min(cfg.prefill_chunk).div_ceil(block_size) as u32;
            // Both policies admit only while the blocks that running requests' prompts still
            // need stay covered (the engine knows prompt lengths), so admission does not
            // simply trade into preemptions.
            let owed: u64 = running
                .iter()
                .map(|r| r.spec.prompt.div_ceil(block_size).saturating_sub(r.blocks.len() as u64))
                .sum();
            let c = pool.counts()?;
            let spare = u64::from(c.free_blocks)
                + if policy == SplitPolicy::Elastic {
                    u64::from(c.max_blocks.saturating_sub(c.num_blocks))
                } else {
                    0
                };
            if spare < owed + u64::from(first) {
                break;
            }
            if !ensure_free_blocks(pool, policy, first, &mut rep, &mut running)? {
                break;
            }
            let Some(lease) = take_slot(pool, policy, first, &mut rep, &mut running)? else { break };
            waiting.pop_front();
            sum_wait += (step - req.arrival) as f64;
            admissions += 1;
            running.push(Running {
                spec: req,
                slot: lease.handle,
                position: lease.position,
                blocks: Vec::new(),
                context: 0,
                generated: 0,
                admitted: step,
            });
        }

        // Prefill: one chunk budget shared in admission order.
        let mut stalled = false;
        let mut budget = cfg.prefill_chunk;
        let mut i = 0;
        while i < running.len() && budget > 0 {
            if running[i].prefilling() {
                let take = (running[i].spec.prompt - running[i].context).min(budget);
                let need = (running[i].context + take).div_ceil(block_size) as usize;
                if grow_blocks_of(pool, policy, i, need, &mut rep, &mut running)? {
                    running[i].context += take;
                    rep.prefilled_tokens += take;
                    budget -= take;
                } else {
                    stalled = true;
                    break;
                }
            }
            i += 1;
        }

        // Decode: every request past its prompt writes tokens_per_decode tokens.
        let mut i = 0;
        while i < running.len() {
            if !running[i].prefilling() {
                let t = cfg.tokens_per_decode as u64;
                let need = (running[i].context + t).div_ceil(block_size) as usize;
                if !grow_blocks_of(pool, policy, i, need, &mut rep, &mut running)? {
                    stalled = true;
                    i += 1;
                    continue;
                }
                running[i].context += t;
                running[i].generated += t;
                rep.generated_tokens += t;
            }
            i += 1;
        }

        // Out of blocks: preempt the most recently admitted request (its work restarts),
        // as engines do, so the others can make progress.
        if stalled && pool.counts()?.free_blocks == 0 && running.len() > 1 {
            if let Some(j) = (0..running.len()).max_by_key(|&j| (running[j].admitted, running[j].spec.id)) {
                let r = running.remove(j);
                waiting.push_front(r.spec);
                rep.preemptions += 1;
                release(pool, r)?;
            }
        }

        // The decode step's index build, for requests that decoded this step.
        let decoding: Vec<usize> =
            (0..running.len()).filter(|&i| !running[i].prefilling() && running[i].generated > 0).collect();
        if !decoding.is_empty() {
            let tables: Vec<Vec<i32>> = decoding
                .iter()
                .map(|&i| {
                    table.clear();
                    table.extend(running[i].blocks.iter().map(|h| h.id as i32));
                    table.clone()
                })
                .collect();
            let batch: Vec<DecodeSeq<'_>> = decoding
                .iter()
                .zip(&tables)
                .map(|(&i, t)| DecodeSeq {
                    position: running[i].position,
                    context_len: running[i].context as i64,
                    num_tokens: cfg.tokens_per_decode,
                    block_table: t,
                })
                .collect();
            let t0 = Instant::now();
            decode.stage(&batch)?;
            // Staging here re-sends whole block tables (the simulator re-packs its batch every
            // step); time it apart from the build itself.
            backend.synchronize(pool.stream())?;
            let t1 = Instant::now();
            decode.build()?;
            backend.synchronize(pool.stream())?;
            stage_us += (t1 - t0).as_secs_f64() * 1e6;
            build_us.push(t1.elapsed().as_secs_f64() * 1e6);
        }

        // Completion.
        let mut i = 0;
        while i < running.len() {
            if !running[i].prefilling() && running[i].generated >= running[i].spec.output {
                let r = running.swap_remove(i);
                release(pool, r)?;
                rep.completed += 1;
            } else {
                i += 1;
            }
        }
        running.sort_by_key(|r| (r.admitted, r.spec.id));

        // Elastic: give idle slots beyond the headroom back to blocks.
        if policy == SplitPolicy::Elastic && step % 8 == 0 {
            let c = pool.counts()?;
            let idle = c.free_slots;
            if idle > cfg.slot_headroom {
                let give = idle - cfg.slot_headroom;
                if let Ok(ch) = pool.shrink_slots(give) {
                    note_change(&mut rep, &ch, &mut running, pool)?;
                    let grow = pool.with_boundary(|b| b.max_blocks().saturating_sub(b.num_blocks()))?;
                    if grow > 0 {
                        if let Ok(ch) = pool.grow_blocks(grow) {
                            note_change(&mut rep, &ch, &mut running, pool)?;
                        }
                    }
                }
            }
        }

        // Compressed history held: every block a running request holds, at block_size tokens.
        let tokens: u64 = running.iter().map(|r| r.blocks.len() as u64 * block_size).sum();
        sum_running += running.len() as f64;
        sum_tokens += tokens as f64;
        rep.max_running = rep.max_running.max(running.len());
        rep.max_compressed_tokens = rep.max_compressed_tokens.max(tokens);
        if step % cfg.sample_every.max(1) == 0 || step + 1 == cfg.steps {
            rep.samples.push(sample(pool, step, &running, waiting.len(), tokens)?);
        }
        if cfg.progress && step % progress_every == 0 {
            let done = (step + 1) * 40 / cfg.steps.max(1);
            eprint!(
                "\r  {:<8} [{:<40}] {:>3}%  running {:>4}  waiting {:>5}",
                rep.policy,
                "=".repeat(done as usize),
                (step + 1) * 100 / cfg.steps.max(1),
                running.len(),
                waiting.len()
            );
        }
    }
    if cfg.progress {
        eprintln!();
    }
    let c = pool.counts()?;
    rep.final_split = (c.num_blocks, c.num_blocks - c.free_blocks, c.num_slots, c.num_slots - c.free_slots);
    for r in running.drain(..) {
        release(pool, r)?;
    }
    drop(decode);
    let n = cfg.steps.max(1) as f64;
    rep.mean_running = sum_running / n;
    rep.mean_compressed_tokens = sum_tokens / n;
    rep.mean_wait_steps = sum_wait / admissions.max(1) as f64;
    rep.index_build_steps = build_us.len() as u64;
    rep.stage_mean_us = stage_us / build_us.len().max(1) as f64;
    if !build_us.is_empty() {
        rep.index_build_mean_us = build_us.iter().sum::<f64>() / build_us.len() as f64;
        build_us.sort_by(|a, b| a.total_cmp(b));
        rep.index_build_p99_us = build_us[(build_us.len() * 99 / 100).min(build_us.len() - 1)];
        rep.index_build_max_us = *build_us.last().unwrap_or(&0.0);
    }
    Ok(rep)
}

fn sample(
    pool: &Pool,
    step: u64,
    running: &[Running],
    waiting: usize,
    tokens: u64,
) -> Result<Sample, PoolError> {
    let c = pool.counts()?;
    let g = &pool.spec().geometry;
    let (e, s) = (g.envelope_rows, g.slot_rows);
    let used_b = i64::from(c.num_blocks - c.free_blocks);
    let used_s = i64::from(c.num_slots - c.free_slots);
    Ok(Sample {
        step,
        block_rows_used: used_b * e,
        block_rows_free: i64::from(c.free_blocks) * e,
        slot_rows_used: used_s * s,
        slot_rows_free: i64::from(c.free_slots) * s,
        gap_rows: g.plane_rows - i64::from(c.num_blocks) * e - i64::from(c.num_slots) * s,
        running: running.len(),
        waiting,
        compressed_tokens: tokens,
    })
}

fn release(pool: &Pool, r: Running) -> Result<(), PoolError> {
    for b in r.blocks {
        pool.free_block(b)?;
    }
    pool.free_slot(r.slot)
}

/// Rewrite every holder after a boundary change (the engine's block tables and slots).
fn note_change(
    rep: &mut SimReport,
    ch: &crate::boundary::BoundaryChange,
    running: &mut [Running],
    _pool: &Pool,
) -> Result<(), PoolError> {
    rep.boundary_moves += 1;
    rep.block_relocations += ch.block_moves.len() as u64;
    rep.slot_relocations += ch.slot_moves.len() as u64;
    for m in &ch.block_moves {
        for r in running.iter_mut() {
            for b in r.blocks.iter_mut() {
                if *b == m.old {
                    *b = m.new;
                }
            }
        }
    }
    for m in &ch.slot_moves {
        for r in running.iter_mut() {
            if r.slot == m.old {
                r.slot = m.new;
                r.position = m.to_position;
            }
        }
    }
    Ok(())
}

/// A free slot: take one, or under the elastic policy grow the slot region into the gap
/// (relocating top blocks when they are held and free ids exist below).
fn take_slot(
    pool: &Pool,
    policy: SplitPolicy,
    need: u32,
    rep: &mut SimReport,
    running: &mut [Running],
) -> Result<Option<crate::pool::SlotLease>, PoolError> {
    let c = pool.counts()?;
    if c.free_slots == 0 {
        if policy == SplitPolicy::Fixed {
            return Ok(None);
        }
        // Take a slot from the gap only while blocks keep a reserve (a twentieth of what
        // the plane holds, plus the rows the slot itself takes): admitting past that would
        // only preempt running requests for lack of blocks.
        let g = &pool.spec().geometry;
        let slot_blocks = (g.slot_rows + g.envelope_rows - 1) / g.envelope_rows;
        let reserve = i64::from(c.max_blocks.max(c.num_blocks)) / 20 + slot_blocks + i64::from(need);
        let spare = i64::from(c.free_blocks) + i64::from(c.max_blocks.saturating_sub(c.num_blocks));
        if spare < reserve {
            return Ok(None);
        }
        match pool.grow_slots(1) {
            Ok(ch) => note_change(rep, &ch, running, pool)?,
            Err(_) => return Ok(None),
        }
    }
    match pool.alloc_slot() {
        Ok(l) => Ok(Some(l)),
        Err(PoolError::Alloc(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Make `n` blocks free: under the elastic policy, turn idle slots (and the gap) into
/// blocks first. Returns whether they are free now.
fn ensure_free_blocks(
    pool: &Pool,
    policy: SplitPolicy,
    n: u32,
    rep: &mut SimReport,
    running: &mut [Running],
) -> Result<bool, PoolError> {
    let c = pool.counts()?;
    if c.free_blocks >= n {
        return Ok(true);
    }
    if policy == SplitPolicy::Elastic {
        let short = n - c.free_blocks;
        let room = c.max_blocks.saturating_sub(c.num_blocks);
        let r = if room >= short { pool.grow_blocks(short) } else { pool.grow_blocks_shrinking_slots(short) };
        if let Ok(ch) = r {
            note_change(rep, &ch, running, pool)?;
        }
    }
    Ok(pool.counts()?.free_blocks >= n)
}

/// Give request `i` blocks up to `need`. Returns whether it has them (false: out of
/// blocks, the request stalls this step).
fn grow_blocks_of(
    pool: &Pool,
    policy: SplitPolicy,
    i: usize,
    need: usize,
    rep: &mut SimReport,
    running: &mut [Running],
) -> Result<bool, PoolError> {
    let have = running[i].blocks.len();
    if have >= need {
        return Ok(true);
    }
    if !ensure_free_blocks(pool, policy, (need - have) as u32, rep, running)? {
        return Ok(false);
    }
    for _ in have..need {
        let grant = pool.alloc_block()?;
        running[i].blocks.push(grant.handle);
    }
    Ok(true)
}

/// Render a report pair as a readable table.
pub fn render_table(reports: &[SimReport]) -> String {
    let mut s = String::new();
    let row = |s: &mut String, name: &str, f: &dyn Fn(&SimReport) -> String| {
        let _ = write!(s, "  {name:<34}");
        for r in reports {
            let _ = write!(s, "{:>18}", f(r));
        }
        s.push('\n');
    };
    row(&mut s, "policy", &|r| r.policy.clone());
    row(&mut s, "requests arrived", &|r| r.arrived.to_string());
    row(&mut s, "requests completed", &|r| r.completed.to_string());
    row(&mut s, "tokens generated", &|r| r.generated_tokens.to_string());
    row(&mut s, "tokens prefilled", &|r| r.prefilled_tokens.to_string());
    row(&mut s, "preemptions", &|r| r.preemptions.to_string());
    row(&mut s, "concurrency max / mean", &|r| format!("{} / {:.1}", r.max_running, r.mean_running));
    row(&mut s, "compressed tokens max", &|r| r.max_compressed_tokens.to_string());
    row(&mut s, "compressed tokens mean", &|r| format!("{:.0}", r.mean_compressed_tokens));
    row(&mut s, "mean queue wait per admission", &|r| format!("{:.1}", r.mean_wait_steps));
    row(&mut s, "boundary moves", &|r| r.boundary_moves.to_string());
    row(&mut s, "relocations block / slot", &|r| format!("{} / {}", r.block_relocations, r.slot_relocations));
    row(&mut s, "index build µs mean / p99", &|r| {
        format!("{:.1} / {:.1}", r.index_build_mean_us, r.index_build_p99_us)
    });
    row(&mut s, "staging µs mean (with tables)", &|r| format!("{:.1}", r.stage_mean_us));
    row(&mut s, "blocks used/num at the end", &|r| format!("{}/{}", r.final_split.1, r.final_split.0));
    row(&mut s, "slots used/num at the end", &|r| format!("{}/{}", r.final_split.3, r.final_split.2));
    s
}

/// The numbers as one JSON object.
pub fn to_json(cfg: &SimConfig, reports: &[SimReport]) -> serde_json::Value {
    use serde_json::json;
    let runs: Vec<serde_json::Value> = reports
        .iter()
        .map(|r| {
            json!({
                "policy": r.policy, "backend": r.backend, "steps": r.steps,
                "arrived": r.arrived, "completed": r.completed,
                "generated_tokens": r.generated_tokens, "prefilled_tokens": r.prefilled_tokens,
                "preemptions": r.preemptions, "max_running": r.max_running,
                "mean_running": r.mean_running, "max_compressed_tokens": r.max_compressed_tokens,
                "mean_compressed_tokens": r.mean_compressed_tokens,
                "boundary_moves": r.boundary_moves, "block_relocations": r.block_relocations,
                "slot_relocations": r.slot_relocations, "mean_wait_steps": r.mean_wait_steps,
                "index_build": {"steps": r.index_build_steps, "mean_us": r.index_build_mean_us,
                                "p99_us": r.index_build_p99_us, "max_us": r.index_build_max_us,
                                "stage_mean_us": r.stage_mean_us},
                "plane_rows": r.plane_rows, "envelope_rows": r.envelope_rows, "slot_rows": r.slot_rows,
                "final": {"num_blocks": r.final_split.0, "used_blocks": r.final_split.1,
                          "num_slots": r.final_split.2, "used_slots": r.final_split.3},
                "samples": r.samples.iter().map(|s| json!({
                    "step": s.step, "block_rows_used": s.block_rows_used,
                    "block_rows_free": s.block_rows_free, "slot_rows_used": s.slot_rows_used,
                    "slot_rows_free": s.slot_rows_free, "gap_rows": s.gap_rows,
                    "running": s.running, "waiting": s.waiting,
                    "compressed_tokens": s.compressed_tokens})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"mix": cfg.mix.name(), "rate": cfg.rate, "steps": cfg.steps, "seed": cfg.seed,
           "max_seqs": cfg.max_seqs, "runs": runs})
}

/// Memory by region over time (one panel per run) and the row space at the end.
pub fn to_svg(reports: &[SimReport]) -> String {
    let (w, ph, gap) = (900.0f64, 220.0f64, 70.0f64);
    let h = 40.0 + reports.len() as f64 * (ph + gap) + 90.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let colors = [
        ("blocks used", "#1f77b4"),
        ("blocks free", "#aec7e8"),
        ("gap", "#eeeeee"),
        ("slots free", "#ffbb78"),
        ("slots used", "#ff7f0e"),
    ];
    let _ = writeln!(
        s,
        r#"<text x="20" y="24" font-size="15">v4pool simulate — plane rows by region over time</text>"#
    );
    for (k, r) in reports.iter().enumerate() {
        let top = 40.0 + k as f64 * (ph + gap);
        let (x0, pw) = (60.0, w - 80.0);
        let _ = writeln!(s, r#"<text x="{x0}" y="{}">{} ({})</text>"#, top + 12.0, r.policy, r.backend);
        let n = r.samples.len().max(2) as f64 - 1.0;
        let total = r.plane_rows.max(1) as f64;
        // Stack bottom-up in row-space order: blocks from row 0, the gap, slots at the top.
        let layers: [fn(&Sample) -> i64; 5] = [
            |x| x.block_rows_used,
            |x| x.block_rows_free,
            |x| x.gap_rows,
            |x| x.slot_rows_free,
            |x| x.slot_rows_used,
        ];
        let mut base = vec![0f64; r.samples.len()];
        for (li, f) in layers.iter().enumerate() {
            let mut pts = String::new();
            let upper: Vec<f64> = r.samples.iter().zip(&base).map(|(x, b)| b + f(x) as f64).collect();
            for (i, u) in upper.iter().enumerate() {
                let _ =
                    write!(pts, "{:.1},{:.1} ", x0 + pw * i as f64 / n, top + 20.0 + ph * (1.0 - u / total));
            }
            for (i, b) in base.iter().enumerate().rev() {
                let _ =
                    write!(pts, "{:.1},{:.1} ", x0 + pw * i as f64 / n, top + 20.0 + ph * (1.0 - b / total));
            }
            let _ = writeln!(s, r#"<polygon points="{pts}" fill="{}" stroke="none"/>"#, colors[li].1);
            base = upper;
        }
        let _ = writeln!(
            s,
            r#"<rect x="{x0}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#,
            top + 20.0
        );
        let _ = writeln!(s, r#"<text x="10" y="{}">row 0</text>"#, top + 20.0 + ph);
        let _ = writeln!(s, r#"<text x="10" y="{}">top</text>"#, top + 30.0);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">step {}</text>"#,
            x0 + pw,
            top + ph + 36.0,
            r.steps
        );
    }
    // The row space at the end of each run, as a strip.
    let ytop = 40.0 + reports.len() as f64 * (ph + gap);
    for (k, r) in reports.iter().enumerate() {
        let y = ytop + k as f64 * 22.0;
        let (x0, pw) = (140.0, w - 160.0);
        let total = r.plane_rows.max(1) as f64;
        let (nb, ub, ns, us) = r.final_split;
        let seg = [
            (i64::from(ub) * r.envelope_rows, colors[0].1),
            (i64::from(nb - ub) * r.envelope_rows, colors[1].1),
            (r.plane_rows - i64::from(nb) * r.envelope_rows - i64::from(ns) * r.slot_rows, colors[2].1),
            (i64::from(ns - us) * r.slot_rows, colors[3].1),
            (i64::from(us) * r.slot_rows, colors[4].1),
        ];
        let _ = writeln!(s, r#"<text x="10" y="{}">row space, {}</text>"#, y + 13.0, r.policy);
        let mut x = x0;
        for (rows, color) in seg {
            let wd = pw * rows.max(0) as f64 / total;
            let _ = writeln!(s, r#"<rect x="{x:.1}" y="{y}" width="{wd:.1}" height="16" fill="{color}"/>"#);
            x += wd;
        }
    }
    let ly = ytop + reports.len() as f64 * 22.0 + 14.0;
    for (i, (name, color)) in colors.iter().enumerate() {
        let x = 20.0 + i as f64 * 150.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{ly}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
            x + 16.0,
            ly + 11.0
        );
    }
    s.push_str("</svg>\n");
    s
}

const HELP: &str = "\
usage: v4pool simulate [options]

Drives a pool as a serving engine would (Poisson arrivals, chunked prefill, a decode index
build every step) twice on the same workload: elastic boundary vs a fixed split.

  --model NAME|PATH     v4-flash (default), v4-pro, …, or a config.json
  --spec-steps K        speculative steps (ring = window + K)            [0]
  --budget BYTES        pool budget, e.g. 8GiB                           [6GiB]
  --max-seqs N          running requests; the fixed split reserves N slots [48]
  --elastic-max-seqs N  running requests under the elastic boundary      [4 × max-seqs]
  --dtype fp8|bf16      KV planes                                        [fp8]
  --indexer fp8|fp4     indexer cache                                    [fp8]
  --mix chat|agentic|mixed                                               [mixed]
  --rate R              mean arrivals per step                           [0.4]
  --steps N             forward steps                                    [2000]
  --seed S                                                               [7]
  --prefill-chunk T     prefill tokens per step                          [8192]
  --max-context T       longest context                                  [1048576]
  --policy both|elastic|fixed                                            [both]
  --backend auto|host|cuda|hip   (auto honours V4POOL_BACKEND)           [auto]
  --svg FILE            memory by region over time, and the row space
  --json                the numbers as one JSON object
  --no-progress         no progress bar";

fn sim_args(args: &[String]) -> Result<Option<String>, CliError> {
    use super::{parse_args, CliError as E};
    let p = parse_args(
        args,
        &[
            "--model",
            "--spec-steps",
            "--draft-stages",
            "--draft-mode",
            "--budget",
            "--max-seqs",
            "--dtype",
            "--indexer",
            "--mix",
            "--rate",
            "--steps",
            "--seed",
            "--prefill-chunk",
            "--max-context",
            "--elastic-max-seqs",
            "--policy",
            "--backend",
            "--svg",
        ],
        &["--json", "--no-progress", "--help"],
    )?;
    if p.flag("--help") {
        return Ok(Some(HELP.to_string()));
    }
    let json = p.flag("--json");
    let model = super::layout::load_model(p.get("--model").unwrap_or("v4-flash"), &p)?;
    let bad = |flag: &str, value: &str, expected: &'static str| E::BadValue {
        flag: flag.to_string(),
        value: value.to_string(),
        expected,
    };
    let budget = crate::sizing::parse_bytes(p.get("--budget").unwrap_or("6GiB"))?;
    let kv = match p.get("--dtype").unwrap_or("fp8") {
        "fp8" => crate::sizing::KvDtype::Fp8,
        "bf16" => crate::sizing::KvDtype::Bf16,
        v => return Err(bad("--dtype", v, "fp8 or bf16")),
    };
    let indexer = match p.get("--indexer").unwrap_or("fp8") {
        "fp8" => crate::sizing::IndexerDtype::Fp8,
        "fp4" => crate::sizing::IndexerDtype::Fp4,
        v => return Err(bad("--indexer", v, "fp8 or fp4")),
    };
    let positive = |key: &'static str, default: i64, max: i64| -> Result<i64, CliError> {
        let v = p.i64(key)?.unwrap_or(default);
        if v < 1 || v > max {
            return Err(E::BadValue {
                flag: key.to_string(),
                value: v.to_string(),
                expected: "a positive count in range",
            });
        }
        Ok(v)
    };
    let mut cfg = SimConfig {
        steps: positive("--steps", 2000, 10_000_000)? as u64,
        seed: p.i64("--seed")?.unwrap_or(7) as u64,
        max_seqs: positive("--max-seqs", 48, 65_536)? as usize,
        elastic_max_seqs: p.i64("--elastic-max-seqs")?.map(|v| v.clamp(1, 65_536) as usize).unwrap_or(0),
        prefill_chunk: positive("--prefill-chunk", 8192, 1 << 24)? as u64,
        max_context: positive("--max-context", 1 << 20, 1 << 24)? as u64,
        tokens_per_decode: 1 + model.spec_steps as usize,
        progress: !json && !p.flag("--no-progress") && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ..SimConfig::default()
    };
    if cfg.elastic_max_seqs == 0 {
        cfg.elastic_max_seqs = 4 * cfg.max_seqs;
    }
    if let Some(m) = p.get("--mix") {
        cfg.mix = Mix::parse(m).ok_or_else(|| bad("--mix", m, "chat, agentic or mixed"))?;
    }
    cfg.rate = match p.get("--rate") {
        None => 0.4,
        Some(v) => match v.trim().parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 && r <= 1000.0 => r,
            _ => return Err(bad("--rate", v, "a rate in (0, 1000]")),
        },
    };
    let policies: Vec<SplitPolicy> = match p.get("--policy").unwrap_or("both") {
        "both" => vec![SplitPolicy::Elastic, SplitPolicy::Fixed],
        "elastic" => vec![SplitPolicy::Elastic],
        "fixed" => vec![SplitPolicy::Fixed],
        v => return Err(bad("--policy", v, "both, elastic or fixed")),
    };
    let choice = match p.get("--backend").unwrap_or("auto") {
        "auto" => crate::backend::BackendChoice::Auto,
        v => crate::backend::BackendChoice::Exactly(crate::backend::BackendKind::parse(v)?),
    };
    let plan = crate::sizing::plan(
        &model,
        &crate::sizing::PlanRequest::new(kv, indexer, cfg.max_seqs as i64, budget),
    )?;
    let backend = crate::backend::select(choice)?;
    let requests = workload(&cfg);
    if !json {
        eprintln!(
            "v4pool simulate: {} on {} ({}), budget {} B, plane {} rows, {} requests ({} mix)",
            model.name,
            backend.kind(),
            backend.device_name(),
            budget,
            plan.plane_rows,
            requests.len(),
            cfg.mix.name()
        );
    }
    let mut reports = Vec::new();
    for policy in policies {
        let pool = Arc::new(Pool::new(
            backend.clone(),
            crate::pool::PoolSpec::from_plan(&plan)?,
            crate::backend::Stream::DEFAULT,
        )?);
        reports.push(simulate(&pool, &cfg, policy, &requests)?);
    }
    if let Some(path) = p.get("--svg") {
        std::fs::write(path, to_svg(&reports))
            .map_err(|e| E::Io { path: path.to_string(), reason: e.to_string() })?;
    }
    Ok(Some(if json {
        to_json(&cfg, &reports).to_string()
    } else {
        format!("{}\n{}", model.name, render_table(&reports))
    }))
}

/// `v4pool simulate` (arguments after the word `simulate`); returns the exit status.
pub fn run(args: &[String]) -> i32 {
    let json = args.iter().any(|a| a == "--json");
    match sim_args(args) {
        Ok(Some(out)) => {
            println!("{out}");
            super::EXIT_OK
        }
        Ok(None) => super::EXIT_OK,
        Err(
            e @ (super::CliError::Backend(_) | super::CliError::Pool(_) | super::CliError::Simulation(_)),
        ) => {
            super::fail("v4pool simulate", &e, json);
            1
        }
        Err(e) => super::fail("v4pool simulate", &e, json),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_is_deterministic_and_bounded() {
        let cfg = SimConfig { steps: 500, ..SimConfig::default() };
        let a = workload(&cfg);
        let b = workload(&cfg);
        assert_eq!(a, b);
        assert!(!a.is_empty());
        for r in &a {
            assert!(r.prompt >= 1 && r.output >= 1 && r.prompt + r.output <= cfg.max_context);
        }
        let mean = a.len() as f64 / cfg.steps as f64;
        assert!((mean - cfg.rate).abs() < 0.15, "arrival rate {mean} far from {}", cfg.rate);
    }
}
