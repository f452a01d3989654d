//! The step loop. Each step: arrivals join the queue, admission (FIFO), chunked prefill,
//! decode, preemption when stalled, the decode index build, completion, and (elastic) idle
//! slots given back. The decisions live in `policy.rs`; this file only sequences
//! them and keeps the figures.

use super::policy::{self, Fleet, Moves, Running};
use super::report::{LatencyHistogram, Sample, SimReport};
use super::{RequestSpec, SimConfig, SimError, SplitPolicy, MAX_SAMPLES, MAX_WAITING};
use crate::backend::Backend;
use crate::pool::{DecodePath, DecodeSeq, Pool};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// One simulated engine on one pool. Drive it with [`Engine::step`] until
/// [`Engine::done`], then take the figures with [`Engine::finish`]; [`simulate`] does all
/// three. Dropping it mid-run frees everything it holds.
pub struct Engine<'p> {
    fleet: Fleet<'p>,
    cfg: SimConfig,
    backend: Arc<dyn Backend>,
    /// The decode path the pool gave out (its buffers are freed when it drops).
    decode: DecodePath,
    block_size: u64,
    /// Blocks at the start-up split: a request needing more is refused.
    capacity_blocks: u32,
    sample_every: u64,
    step: u64,
    /// The next arrival, drawn but not yet due.
    pending: Option<RequestSpec>,
    waiting: VecDeque<RequestSpec>,
    rep: SimReport,
    build: LatencyHistogram,
    stage_us: f64,
    sum_running: f64,
    sum_tokens: f64,
    sum_wait: f64,
    /// Admissions, re-admissions after preemption included: what the wait is averaged over.
    admissions: u64,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("policy", &self.fleet.policy)
            .field("step", &self.step)
            .field("running", &self.fleet.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

/// Run `requests` (in arrival order) on `pool` under `policy` for `cfg.steps` steps.
pub fn simulate(
    pool: &Arc<Pool>,
    cfg: &SimConfig,
    policy: SplitPolicy,
    requests: impl IntoIterator<Item = RequestSpec>,
) -> Result<SimReport, SimError> {
    let mut engine = Engine::new(pool, cfg, policy)?;
    let mut arrivals = requests.into_iter();
    while !engine.done() {
        engine.step(&mut arrivals)?;
    }
    engine.finish()
}

impl<'p> Engine<'p> {
    /// Check `cfg` against `pool` ([`SimConfig::check`]), set the start-up split and
    /// allocate the decode index buffers.
    pub fn new(pool: &'p Arc<Pool>, cfg: &SimConfig, policy: SplitPolicy) -> Result<Engine<'p>, SimError> {
        let geometry = pool.geometry()?;
        let o = pool.overhead(0)?;
        cfg.check(&geometry, o.plane_bytes + o.indexer_bytes)?;
        let backend = pool.backend().clone();
        let capacity_blocks = policy::initial_split(pool, cfg, policy)?;
        let decode = pool.decode_path(cfg.decode_capacity(&geometry, policy))?;
        let rep = SimReport {
            policy: policy.name().into(),
            backend: backend_name(backend.as_ref()),
            steps: cfg.steps,
            plane_rows: geometry.plane_rows,
            envelope_rows: geometry.envelope_rows,
            slot_rows: geometry.slot_rows,
            ..SimReport::default()
        };
        Ok(Engine {
            fleet: Fleet { pool, policy, running: Vec::new(), moves: Moves::default() },
            cfg: cfg.clone(),
            backend,
            decode,
            block_size: geometry.block_size as u64,
            capacity_blocks,
            sample_every: cfg.sample_every.max(cfg.steps.div_ceil(MAX_SAMPLES)),
            step: 0,
            pending: None,
            waiting: VecDeque::new(),
            rep,
            build: LatencyHistogram::default(),
            stage_us: 0.0,
            sum_running: 0.0,
            sum_tokens: 0.0,
            sum_wait: 0.0,
            admissions: 0,
        })
    }

    /// Whether every step has run.
    pub fn done(&self) -> bool {
        self.step >= self.cfg.steps
    }
    /// Steps run so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }
    /// Requests running now.
    pub fn running(&self) -> usize {
        self.fleet.running.len()
    }
    /// Requests waiting for admission now.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Run one step, drawing this step's arrivals from `arrivals` (in arrival order; the
    /// first later one is held for its step).
    pub fn step(&mut self, arrivals: &mut dyn Iterator<Item = RequestSpec>) -> Result<(), SimError> {
        self.arrive(arrivals);
        self.admit()?;
        let mut stalled = self.prefill()?;
        stalled |= self.decode()?;
        if let Some(j) = policy::preemption_victim(&self.fleet, stalled)? {
            let r = self.fleet.running.remove(j);
            self.waiting.push_front(r.spec);
            self.rep.preemptions += 1;
            policy::release(self.fleet.pool, r)?;
        }
        self.build_index()?;
        self.complete()?;
        policy::give_back_idle_slots(&mut self.fleet, self.cfg.slot_headroom, self.step)?;
        self.record()?;
        self.step += 1;
        Ok(())
    }

    fn arrive(&mut self, arrivals: &mut dyn Iterator<Item = RequestSpec>) {
        loop {
            let Some(req) = self.pending.take().or_else(|| arrivals.next()) else { return };
            if req.arrival > self.step {
                self.pending = Some(req);
                return;
            }
            self.rep.arrived += 1;
            if self.waiting.len() >= MAX_WAITING {
                self.rep.turned_away += 1;
            } else {
                self.waiting.push_back(req);
            }
        }
    }

    /// FIFO admission: a slot and the blocks for the first prefill chunk. A request that
    /// can never fit is refused and counted.
    fn admit(&mut self) -> Result<(), SimError> {
        while let Some(req) = self.waiting.front().copied() {
            if policy::refusal(&req, &self.cfg, self.capacity_blocks, self.block_size) {
                self.waiting.pop_front();
                self.rep.refused += 1;
                continue;
            }
            if self.fleet.running.len() >= self.cfg.cap_seqs(self.fleet.policy) {
                break;
            }
            let first = req.prompt.min(self.cfg.prefill_chunk).div_ceil(self.block_size) as u32;
            if !policy::may_admit(&self.fleet, first, self.block_size)?
                || !policy::ensure_free_blocks(&mut self.fleet, first)?
            {
                break;
            }
            let Some(lease) = policy::take_slot(&mut self.fleet, first)? else { break };
            self.waiting.pop_front();
            self.sum_wait += (self.step - req.arrival) as f64;
            self.admissions += 1;
            self.fleet.running.push(Running::new(req, lease, self.step));
        }
        Ok(())
    }

    /// One chunk budget shared in admission order. Returns whether a request stalled.
    fn prefill(&mut self) -> Result<bool, SimError> {
        let mut budget = self.cfg.prefill_chunk;
        let mut i = 0;
        while i < self.fleet.running.len() && budget > 0 {
            let r = &self.fleet.running[i];
            if r.prefilling() {
                let take = (r.spec.prompt - r.context).min(budget);
                let need = (r.context + take).div_ceil(self.block_size) as usize;
                if !policy::grow_blocks_of(&mut self.fleet, i, need)? {
                    return Ok(true);
                }
                self.fleet.running[i].context += take;
                self.rep.prefilled_tokens += take;
                budget -= take;
            }
            i += 1;
        }
        Ok(false)
    }

    /// Every request past its prompt writes `tokens_per_decode` tokens. Returns whether a
    /// request stalled.
    fn decode(&mut self) -> Result<bool, SimError> {
        let t = self.cfg.tokens_per_decode as u64;
        let mut stalled = false;
        for i in 0..self.fleet.running.len() {
            let r = &self.fleet.running[i];
            if r.prefilling() {
                continue;
            }
            let need = (r.context + t).div_ceil(self.block_size) as usize;
            if !policy::grow_blocks_of(&mut self.fleet, i, need)? {
                stalled = true;
                continue;
            }
            let r = &mut self.fleet.running[i];
            r.context += t;
            r.generated += t;
            self.rep.generated_tokens += t;
        }
        Ok(stalled)
    }

    /// The decode step's index build, for requests that decoded this step: stage (timed
    /// apart: it re-sends whole block tables), then launch and wait.
    fn build_index(&mut self) -> Result<(), SimError> {
        let running = &self.fleet.running;
        let decoding: Vec<&Running> = running.iter().filter(|r| !r.prefilling() && r.generated > 0).collect();
        if decoding.is_empty() {
            return Ok(());
        }
        let tables: Vec<Vec<i32>> =
            decoding.iter().map(|r| r.blocks.iter().map(|h| h.id as i32).collect()).collect();
        let batch: Vec<DecodeSeq<'_>> = decoding
            .iter()
            .zip(&tables)
            .map(|(r, t)| DecodeSeq {
                position: r.position,
                context_len: r.context as i64,
                num_tokens: self.cfg.tokens_per_decode,
                block_table: t,
            })
            .collect();
        let (stream, backend) = (self.decode.stream(), self.backend.as_ref());
        let t0 = Instant::now();
        self.decode.stage(&batch)?;
        backend.synchronize(stream)?;
        let t1 = Instant::now();
        self.decode.build()?;
        backend.synchronize(stream)?;
        self.stage_us += (t1 - t0).as_secs_f64() * 1e6;
        self.build.record(t1.elapsed().as_secs_f64() * 1e6);
        Ok(())
    }

    fn complete(&mut self) -> Result<(), SimError> {
        let mut i = 0;
        while i < self.fleet.running.len() {
            let r = &self.fleet.running[i];
            if !r.prefilling() && r.generated >= r.spec.output {
                let r = self.fleet.running.swap_remove(i);
                policy::release(self.fleet.pool, r)?;
                self.rep.completed += 1;
            } else {
                i += 1;
            }
        }
        self.fleet.running.sort_by_key(|r| (r.admitted, r.spec.id));
        Ok(())
    }

    /// Per-step sums and maxima, and a memory sample every `sample_every` steps.
    fn record(&mut self) -> Result<(), SimError> {
        let running = self.fleet.running.len();
        // Compressed history held: every block a running request holds, at block_size tokens.
        let tokens: u64 = self.fleet.running.iter().map(|r| r.blocks.len() as u64 * self.block_size).sum();
        self.sum_running += running as f64;
        self.sum_tokens += tokens as f64;
        self.rep.max_running = self.rep.max_running.max(running);
        self.rep.max_compressed_tokens = self.rep.max_compressed_tokens.max(tokens);
        if self.step % self.sample_every == 0 || self.step + 1 == self.cfg.steps {
            let s = self.sample(tokens)?;
            self.rep.samples.push(s);
        }
        Ok(())
    }

    fn sample(&self, tokens: u64) -> Result<Sample, SimError> {
        let c = self.fleet.pool.counts()?;
        let (e, s) = (self.rep.envelope_rows, self.rep.slot_rows);
        let used_b = i64::from(c.num_blocks - c.free_blocks);
        let used_s = i64::from(c.num_slots - c.free_slots);
        Ok(Sample {
            step: self.step,
            block_rows_used: used_b * e,
            block_rows_free: i64::from(c.free_blocks) * e,
            slot_rows_used: used_s * s,
            slot_rows_free: i64::from(c.free_slots) * s,
            gap_rows: self.rep.plane_rows - i64::from(c.num_blocks) * e - i64::from(c.num_slots) * s,
            running: self.fleet.running.len(),
            waiting: self.waiting.len(),
            compressed_tokens: tokens,
        })
    }

    /// The figures, after freeing every request still running.
    pub fn finish(mut self) -> Result<SimReport, SimError> {
        let c = self.fleet.pool.counts()?;
        let mut rep = std::mem::take(&mut self.rep);
        rep.final_split =
            (c.num_blocks, c.num_blocks - c.free_blocks, c.num_slots, c.num_slots - c.free_slots);
        for r in std::mem::take(&mut self.fleet.running) {
            policy::release(self.fleet.pool, r)?;
        }
        let n = self.cfg.steps.max(1) as f64;
        let m = self.fleet.moves;
        (rep.boundary_moves, rep.block_relocations, rep.slot_relocations) =
            (m.moves, m.block_relocations, m.slot_relocations);
        rep.mean_running = self.sum_running / n;
        rep.mean_compressed_tokens = self.sum_tokens / n;
        rep.mean_wait_steps = self.sum_wait / self.admissions.max(1) as f64;
        rep.index_build_steps = self.build.count();
        rep.stage_mean_us = self.stage_us / self.build.count().max(1) as f64;
        rep.index_build_mean_us = self.build.mean();
        rep.index_build_p99_us = self.build.quantile(0.99);
        rep.index_build_max_us = self.build.max();
        Ok(rep)
    }
}

impl Drop for Engine<'_> {
    fn drop(&mut self) {
        let pool = self.fleet.pool;
        for r in std::mem::take(&mut self.fleet.running) {
            let _ = policy::release(pool, r);
        }
    }
}

/// The backend's kind, with its device name when that says more.
fn backend_name(backend: &dyn Backend) -> String {
    if backend.device_name() == backend.kind().to_string() {
        backend.kind().to_string()
    } else {
        format!("{} ({})", backend.kind(), backend.device_name())
    }
}
