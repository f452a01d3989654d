//! The step loop. Each step: arrivals join the queue, admission (FIFO, with prefix hits),
//! chunked prefill, decode, preemption when stalled, the decode index build, completion,
//! then the manager's `complete_inflight` and `rebalance`. Memory decisions are the
//! [`KvManager`]'s; the engine's own are in `policy.rs`; this file sequences them and keeps
//! the figures.
//!
//! In time ([`super::TimeConfig`]) the clock advances by what the step-cost model charges
//! for the step's work (prefill tokens and their context, decoded sequences and their
//! contexts, host-tier bytes restored); tokens a step produces exist at its end. An idle
//! engine jumps to the next arrival. A closed loop sends the next request when one finishes.

use super::cost::StepLoad;
use super::policy::{self, NAMESPACE};
use super::report::{LatencyHistogram, Sample, SimReport, TimeReport};
use super::trace::Trace;
use super::{RequestSpec, RunKind, SimConfig, SimError, MAX_SAMPLES, MAX_STEPS, MAX_WAITING};
use crate::backend::Backend;
use crate::manager::{BlockHash, KvManager, ManagerError, Namespace, RequestId};
use crate::pool::{DecodePath, DecodeSeq, Pool, PoolError, PoolSpec};
use std::collections::{HashSet, VecDeque};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

/// Bytes of memory the machine has available now (`MemAvailable`), where it says.
pub fn available_memory() -> Option<u64> {
    use std::io::Read as _;
    let mut text = String::new();
    // /proc/meminfo is a few KiB: read no more than 64 KiB of it.
    std::fs::File::open("/proc/meminfo").ok()?.take(64 << 10).read_to_string(&mut text).ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A pool for a simulation: its planes and indexer cache keep no bytes on an accounting
/// host backend ([`crate::backend::host::keep_no_bytes`]; the pool's own code runs
/// unchanged, its copies and fills counted instead of done), real memory on any other.
pub fn sim_pool(backend: &Arc<dyn Backend>, spec: &PoolSpec) -> Result<Arc<Pool>, PoolError> {
    crate::backend::host::keep_no_bytes(|| {
        Pool::new(backend.clone(), spec.clone(), crate::backend::Stream::DEFAULT)
    })
    .map(Arc::new)
}

/// A request the engine knows: waiting (no manager id until it first reaches the head of
/// the queue, so a long queue holds no hashes) or running.
#[derive(Debug)]
struct Req {
    spec: RequestSpec,
    id: Option<RequestId>,
    /// Hashes of its full blocks known so far, in the shared namespace (what the hit-rate
    /// figures are measured in).
    hashes: Vec<BlockHash>,
    /// The `no_reuse` run's hashes: the same blocks in a namespace of its own.
    private: Vec<BlockHash>,
    /// Hashes handed to the manager.
    given: usize,
    /// `hashes[..marked]` are in the ever-committed set.
    marked: usize,
    /// Tokens computed (the manager's count).
    context: u64,
    generated: u64,
    /// Most tokens it had computed before its latest preemption (prefill below is redone work).
    high_water: u64,
    admitted: u64,
    /// The step it (re-)joined the queue: its arrival, or its latest preemption.
    queued: u64,
    /// Whether it was admitted before (a re-admission is not counted in the hit rate).
    seen: bool,
    /// Requests admitted past it while it waited at the head of the queue (bounded bypass).
    passed: u32,
    /// When it was sent (its arrival, or in a closed loop the moment a client sent it), ms.
    sent_ms: f64,
    /// The step it arrived at.
    arrived_step: u64,
    /// When its first token existed, ms.
    first_ms: Option<f64>,
}

impl Req {
    fn new(spec: RequestSpec) -> Req {
        Req {
            spec,
            id: None,
            hashes: Vec::new(),
            private: Vec::new(),
            given: 0,
            marked: 0,
            context: 0,
            generated: 0,
            high_water: 0,
            admitted: 0,
            queued: spec.arrival,
            seen: false,
            passed: 0,
            sent_ms: spec.arrival as f64,
            arrived_step: spec.arrival,
            first_ms: None,
        }
    }
    fn prefilling(&self) -> bool {
        self.context < self.spec.prompt.max(self.high_water)
    }
    fn id(&self) -> RequestId {
        self.id.expect("a running request is registered")
    }
}

/// One simulated engine on one pool, driving one [`KvManager`]. Drive it with
/// [`Engine::step`] until [`Engine::done`], then take the figures with [`Engine::finish`];
/// [`simulate`] does all three. Dropping it mid-run frees everything it holds.
pub struct Engine<'p> {
    m: KvManager,
    run: RunKind,
    cfg: SimConfig,
    backend: Arc<dyn Backend>,
    /// The decode path the pool gave out (its buffers are freed when it drops); none when
    /// the run builds no index ([`SimConfig::build_index`] off: a fleet), which then holds
    /// no decode buffers either.
    decode: Option<DecodePath>,
    block_size: u64,
    /// Blocks at the start-up split: a request needing more is refused.
    capacity_blocks: u32,
    sample_every: u64,
    step: u64,
    /// The next arrival, drawn but not yet due.
    pending: Option<RequestSpec>,
    waiting: VecDeque<Req>,
    running: Vec<Req>,
    /// Every block hash (shared namespace) any request has committed: what "an earlier
    /// request had already prefilled" means for the hit rate, cached now or not.
    ever: HashSet<BlockHash>,
    /// First admissions: tokens an earlier request had prefilled, and tokens served.
    eligible_tokens: u64,
    first_hit_tokens: u64,
    rep: SimReport,
    build: LatencyHistogram,
    stage_us: f64,
    sum_running: f64,
    sum_tokens: f64,
    sum_wait: f64,
    /// Admissions, re-admissions after preemption included: what the wait is averaged over.
    admissions: u64,
    /// Steps requests spent in the queue, summed over every stay (arrival or preemption to
    /// admission).
    queue_steps: u64,
    /// The trace whose hash ids trace requests carry.
    trace: Option<Arc<Trace>>,
    /// The clock, ms (time mode), and when the next memory sample is due.
    clock_ms: f64,
    next_sample_ms: f64,
    /// The arrival stream has ended.
    exhausted: bool,
    /// This step's work, for the cost model.
    load: StepLoad,
    /// Host-tier bytes restored before this step.
    restored: u64,
    busy_ms: f64,
    time: TimeReport,
    /// Input + output tokens of completed requests, and of those within the target.
    done_tokens: u64,
    done_out_tokens: u64,
    slo_tokens: u64,
    _pool: PhantomData<&'p Pool>,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("run", &self.run)
            .field("step", &self.step)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

/// Run `requests` (in arrival order) on `pool` as run `policy` for `cfg.steps` steps.
pub fn simulate(
    pool: &Arc<Pool>,
    cfg: &SimConfig,
    policy: RunKind,
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
    /// Check `cfg` against `pool` ([`SimConfig::check`]), build the run's manager (which
    /// sets the start-up split) and allocate the decode index buffers.
    pub fn new(pool: &'p Arc<Pool>, cfg: &SimConfig, policy: RunKind) -> Result<Engine<'p>, SimError> {
        let geometry = pool.geometry()?;
        let o = pool.overhead(0)?;
        cfg.check(&geometry, o.plane_bytes + o.indexer_bytes)?;
        let backend = pool.backend().clone();
        let m = policy::manager(pool, cfg, policy)?;
        let capacity_blocks = m.view()?.num_blocks;
        let decode = if cfg.build_index {
            Some(pool.decode_path(cfg.decode_capacity(&geometry, policy))?)
        } else {
            None
        };
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
            m,
            run: policy,
            cfg: cfg.clone(),
            backend,
            decode,
            block_size: geometry.block_size as u64,
            capacity_blocks,
            sample_every: cfg.sample_every.max(cfg.steps.div_ceil(MAX_SAMPLES)),
            step: 0,
            pending: None,
            waiting: VecDeque::new(),
            running: Vec::new(),
            ever: HashSet::new(),
            eligible_tokens: 0,
            first_hit_tokens: 0,
            rep,
            build: LatencyHistogram::default(),
            stage_us: 0.0,
            sum_running: 0.0,
            sum_tokens: 0.0,
            sum_wait: 0.0,
            admissions: 0,
            queue_steps: 0,
            trace: None,
            clock_ms: 0.0,
            next_sample_ms: 0.0,
            exhausted: false,
            load: StepLoad::default(),
            restored: 0,
            busy_ms: 0.0,
            time: TimeReport::default(),
            done_tokens: 0,
            done_out_tokens: 0,
            slo_tokens: 0,
            _pool: PhantomData,
        })
    }

    /// Take trace requests' hash ids from `trace` (the requests come from
    /// [`Trace::specs`]).
    pub fn with_trace(mut self, trace: Arc<Trace>) -> Self {
        self.trace = Some(trace);
        self
    }

    /// Whether the run is over: every step has run, or in time, the arrivals ended and
    /// every request finished, or the clock passed the horizon (or [`MAX_STEPS`] ran).
    pub fn done(&self) -> bool {
        match &self.cfg.time {
            None => self.step >= self.cfg.steps,
            Some(t) => {
                let drained = self.exhausted
                    && self.pending.is_none()
                    && self.waiting.is_empty()
                    && self.running.is_empty();
                drained || self.clock_ms >= t.horizon_ms || self.step >= self.cfg.steps.min(MAX_STEPS)
            }
        }
    }
    /// The clock, ms (0 when the run counts steps).
    pub fn clock_ms(&self) -> f64 {
        self.clock_ms
    }
    /// Steps run so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }
    /// Requests running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }
    /// Requests waiting for admission now.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    /// The manager this run drives.
    pub fn manager(&self) -> &KvManager {
        &self.m
    }
    /// The manager, to install a shared tier or take its events (`sim::fleet`).
    pub fn manager_mut(&mut self) -> &mut KvManager {
        &mut self.m
    }
    /// Whether anything is left to do: a request drawn and not yet due, waiting or running.
    pub fn has_work(&self) -> bool {
        self.pending.is_some() || !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// One forward step; `arrivals` yields the requests in arrival order.
    pub fn step(&mut self, arrivals: &mut dyn Iterator<Item = RequestSpec>) -> Result<(), SimError> {
        self.arrive(arrivals);
        if self.cfg.time.is_some() && self.waiting.is_empty() && self.running.is_empty() {
            // Idle: jump to the next arrival (an open loop's; a closed loop sends at once).
            if let Some(next) = self.pending.or_else(|| self.pull(arrivals)) {
                self.pending = Some(next);
                self.clock_ms = self.clock_ms.max(next.arrival as f64);
                self.arrive(arrivals);
            }
        }
        self.load = StepLoad::default();
        self.admit()?;
        let mut stalled = self.prefill()?;
        stalled |= self.decode()?;
        let keys = self.running.iter().map(|r| (r.admitted, r.spec.id));
        if let Some(j) = policy::preemption_victim(keys, stalled) {
            let mut r = self.running.remove(j);
            self.m.preempt(r.id())?;
            r.high_water = r.high_water.max(r.context);
            r.context = 0;
            r.queued = self.step;
            self.waiting.push_front(r);
            self.rep.preemptions += 1;
        }
        if self.cfg.build_index {
            self.build_index()?;
        }
        self.advance()?;
        self.complete()?;
        self.m.complete_inflight()?;
        self.m.rebalance()?;
        self.record()?;
        self.step += 1;
        Ok(())
    }

    fn pull(&mut self, arrivals: &mut dyn Iterator<Item = RequestSpec>) -> Option<RequestSpec> {
        let next = arrivals.next();
        self.exhausted |= next.is_none();
        next
    }

    /// Arrivals due join the queue: by step, by ms (open loop), or while fewer than the
    /// concurrency are in flight (closed loop, sent now).
    fn arrive(&mut self, arrivals: &mut dyn Iterator<Item = RequestSpec>) {
        let closed = self.cfg.time.as_ref().and_then(|t| t.concurrency);
        loop {
            if closed.is_some_and(|c| self.waiting.len() + self.running.len() >= c) {
                return;
            }
            let Some(req) = self.pending.take().or_else(|| self.pull(arrivals)) else { return };
            let due = match (&self.cfg.time, closed) {
                (None, _) => req.arrival <= self.step,
                (Some(_), Some(_)) => true,
                (Some(_), None) => req.arrival as f64 <= self.clock_ms,
            };
            if !due {
                self.pending = Some(req);
                return;
            }
            self.rep.arrived += 1;
            if self.waiting.len() >= MAX_WAITING {
                self.rep.turned_away += 1;
            } else {
                let mut r = Req::new(req);
                if self.cfg.time.is_some() {
                    // Queue figures count steps; the arrival is in ms.
                    (r.queued, r.arrived_step) = (self.step, self.step);
                }
                if closed.is_some() {
                    r.sent_ms = self.clock_ms;
                }
                self.waiting.push_back(r);
            }
        }
    }

    /// Time mode: charge the step's work, advance the clock, and stamp first tokens.
    fn advance(&mut self) -> Result<(), SimError> {
        let Some(t) = &self.cfg.time else { return Ok(()) };
        // Shared-tier bytes are charged as host-tier ones: both come over the GPU's host link
        // (a 3FS-class store reads at about that rate per node; docs/simulate.md).
        let st = self.m.stats();
        let restored = st.tier_restored_bytes + st.shared_restored_bytes;
        self.load.restored_bytes = restored.saturating_sub(self.restored);
        self.restored = restored;
        let ms = t.cost.step_ms(&self.load);
        self.clock_ms += ms;
        self.busy_ms += ms;
        for r in self.running.iter_mut().filter(|r| r.generated > 0 && r.first_ms.is_none()) {
            r.first_ms = Some(self.clock_ms);
            self.time.ttft_ms.record(self.clock_ms - r.sent_ms);
        }
        Ok(())
    }

    /// Hash `r`'s blocks up to `tokens` and hand the manager what this run gives it: every
    /// hash, or (`reuse_4096`) only whole groups of [`policy::LCM_BLOCKS`].
    fn learn(&mut self, r: &mut Req, tokens: u64) -> Result<(), ManagerError> {
        let blocks = if self.cfg.hash_blocks { tokens / self.block_size } else { 0 };
        let ids = self.trace.as_deref().and_then(|t| t.ids_of(&r.spec));
        policy::extend_hashes(NAMESPACE, &r.spec, ids, self.block_size, blocks, &mut r.hashes);
        let mine = self.run == RunKind::NoReuse;
        if mine {
            let ns = Namespace(NAMESPACE.0 ^ (u128::from(r.spec.id) << 64 | 0x006e_6f72_6575_7365));
            policy::extend_hashes(ns, &r.spec, ids, self.block_size, blocks, &mut r.private);
        }
        let target = match self.run {
            RunKind::Reuse4096 => r.hashes.len() / policy::LCM_BLOCKS as usize * policy::LCM_BLOCKS as usize,
            _ => r.hashes.len(),
        };
        let src = if mine { &r.private } else { &r.hashes };
        match r.id {
            None => r.id = Some(self.m.add_request(r.spec.prompt, src[..target].to_vec())),
            Some(id) if target > r.given => self.m.extend_hashes(id, &src[r.given..target])?,
            Some(_) => {}
        }
        r.given = r.given.max(target);
        Ok(())
    }

    /// `r` computed `take` more tokens: commit them, note redone work and committed blocks.
    fn committed(&mut self, r: &mut Req, take: u64) -> Result<(), ManagerError> {
        self.m.commit(r.id(), take)?;
        let c0 = r.context;
        r.context += take;
        self.rep.recomputed_prefill_tokens += r.high_water.min(r.context).saturating_sub(c0);
        let full = ((r.context / self.block_size) as usize).min(r.hashes.len());
        for &h in &r.hashes[r.marked.min(full)..full] {
            self.ever.insert(h);
        }
        r.marked = r.marked.max(full);
        Ok(())
    }

    /// FIFO admission with a bounded bypass: the manager matches the prefix, takes a slot and
    /// restores it from the hit's checkpoint. A request that can never fit is refused and
    /// counted; a head waiting for blocks may be passed by short requests ([`Self::bypass`]).
    fn admit(&mut self) -> Result<(), SimError> {
        while let Some(front) = self.waiting.front() {
            if policy::refusal(&front.spec, &self.cfg, self.capacity_blocks, self.block_size) {
                self.waiting.pop_front();
                self.rep.refused += 1;
                continue;
            }
            if self.running.len() >= self.cfg.cap_seqs(self.run) {
                break;
            }
            let r = self.waiting.pop_front().expect("the front exists");
            if let Some(r) = self.try_admit(r)? {
                self.waiting.push_front(r);
                if !self.bypass()? {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Bounded bypass: while the head waits for blocks, one of the next
    /// [`policy::BYPASS_WINDOW`] requests whose prompt fits one prefill chunk may be admitted
    /// past it, at most [`policy::BYPASS_PER_HEAD`] times per head. Returns whether one was.
    fn bypass(&mut self) -> Result<bool, SimError> {
        if self.running.len() >= self.cfg.cap_seqs(self.run)
            || self.waiting.front().is_none_or(|h| h.passed >= policy::BYPASS_PER_HEAD)
        {
            return Ok(false);
        }
        let end = self.waiting.len().min(1 + policy::BYPASS_WINDOW);
        let Some(i) = (1..end).find(|&i| {
            let spec = &self.waiting[i].spec;
            spec.prompt.max(self.waiting[i].high_water) <= self.cfg.prefill_chunk
                && !policy::refusal(spec, &self.cfg, self.capacity_blocks, self.block_size)
        }) else {
            return Ok(false);
        };
        let r = self.waiting.remove(i).expect("in the window");
        match self.try_admit(r)? {
            Some(r) => {
                self.waiting.insert(i, r);
                Ok(false)
            }
            None => {
                if let Some(h) = self.waiting.front_mut() {
                    h.passed += 1;
                }
                Ok(true)
            }
        }
    }

    /// Match `r`'s prefix, and admit it if the policy lets it run now (the manager restores
    /// its slot from the hit's checkpoint); `Some(r)` gives it back when it must wait.
    fn try_admit(&mut self, mut r: Req) -> Result<Option<Req>, SimError> {
        if r.id.is_none() {
            let prompt = r.spec.prompt;
            self.learn(&mut r, prompt)?;
        }
        // Admission back-pressure is the manager's policy: the whole remaining prompt
        // and decode room must stay obtainable beside the hit it references, or admission
        // only trades into preemptions (or, counting the hit as room, a livelock).
        if !self.m.may_admit_request(r.id())? {
            return Ok(Some(r));
        }
        let a = match self.m.admit(r.id()) {
            Ok(a) => a,
            Err(ManagerError::NoSlot | ManagerError::OutOfBlocks { .. }) => return Ok(Some(r)),
            Err(e) => return Err(e.into()),
        };
        if !r.seen {
            // Tokens an earlier request had prefilled: the longest prefix of committed
            // blocks, at most what the manager may serve (one token is always computed).
            let limit = ((r.spec.prompt.saturating_sub(1) / self.block_size) as usize).min(r.hashes.len());
            let known = r.hashes[..limit].iter().take_while(|h| self.ever.contains(h)).count() as u64;
            self.eligible_tokens += known * self.block_size;
            self.first_hit_tokens += a.hit_tokens;
            self.rep.input_tokens += r.spec.prompt;
        }
        self.rep.prefill_tokens_saved += a.hit_tokens;
        r.seen = true;
        r.context = a.hit_tokens;
        r.admitted = self.step;
        self.sum_wait += self.step.saturating_sub(r.arrived_step) as f64;
        self.admissions += 1;
        self.queue_steps += self.step - r.queued;
        self.running.push(r);
        Ok(None)
    }

    /// One chunk budget shared in admission order; each request's chunk stops where the
    /// manager says (prompt end, checkpoint points). Returns whether a request stalled.
    fn prefill(&mut self) -> Result<bool, SimError> {
        let mut budget = self.cfg.prefill_chunk;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let mut r = self.take(i);
            let out = self.prefill_one(&mut r, &mut budget);
            self.running[i] = r;
            if out? {
                return Ok(true);
            }
            i += 1;
        }
        Ok(false)
    }

    /// Take running request `i` out (a placeholder holds its place) to work on it beside
    /// `self`; put it back with `self.running[i] = r`.
    fn take(&mut self, i: usize) -> Req {
        let spec = self.running[i].spec;
        std::mem::replace(&mut self.running[i], Req::new(spec))
    }

    /// Prefill `r` within `budget`; returns whether it stalled for lack of blocks.
    fn prefill_one(&mut self, r: &mut Req, budget: &mut u64) -> Result<bool, SimError> {
        while r.prefilling() && *budget > 0 {
            let mut take = self.m.prefill_stop(r.id(), *budget)?;
            if take == 0 {
                break;
            }
            // A prompt whose known content ends before its end (a trace request's partial
            // last block): stop the chunk where the hashes end, so the manager's rolling
            // checkpoint lands where a later turn's match ends.
            let hashed = r.given as u64 * self.block_size;
            let rolling = self.run != RunKind::Reuse4096;
            if rolling && hashed > r.context && hashed < r.spec.prompt && r.context + take > hashed {
                take = hashed - r.context;
            }
            match self.m.allocate(r.id(), take) {
                Ok(()) => {}
                Err(ManagerError::OutOfBlocks { .. }) => return Ok(true),
                Err(e) => return Err(e.into()),
            }
            self.load.prefill_tokens += take;
            self.load.prefill_ctx_tokens += take as f64 * (r.context as f64 + take as f64 / 2.0);
            self.committed(r, take)?;
            self.rep.prefilled_tokens += take;
            *budget -= take;
        }
        Ok(false)
    }

    /// Every request past its prompt writes `tokens_per_decode` tokens; blocks they complete
    /// get their hashes. Returns whether a request stalled.
    fn decode(&mut self) -> Result<bool, SimError> {
        let t = self.cfg.tokens_per_decode as u64;
        let mut stalled = false;
        for i in 0..self.running.len() {
            if self.running[i].prefilling() {
                continue;
            }
            let mut r = self.take(i);
            let out = self.decode_one(&mut r, t);
            self.running[i] = r;
            stalled |= out?;
        }
        Ok(stalled)
    }

    fn decode_one(&mut self, r: &mut Req, t: u64) -> Result<bool, SimError> {
        match self.m.allocate(r.id(), t) {
            Ok(()) => {}
            Err(ManagerError::OutOfBlocks { .. }) => return Ok(true),
            Err(e) => return Err(e.into()),
        }
        self.load.decode_seqs += 1;
        self.load.decode_ctx_tokens += r.context;
        self.learn(r, r.context + t)?;
        self.committed(r, t)?;
        r.generated += t;
        self.rep.generated_tokens += t;
        Ok(false)
    }

    /// The decode step's index build, for requests that decoded this step: stage (timed
    /// apart: it re-sends whole block tables), then launch and wait.
    fn build_index(&mut self) -> Result<(), SimError> {
        let Some(decode) = self.decode.as_mut() else { return Ok(()) };
        let mut tables = Vec::new();
        let mut meta = Vec::new();
        for r in self.running.iter().filter(|r| !r.prefilling() && r.generated > 0) {
            let id = r.id();
            let slot = self.m.slot(id)?.ok_or(ManagerError::NotRunning(id))?;
            tables.push(self.m.block_table(id)?);
            meta.push((slot.position, r.context as i64));
        }
        if tables.is_empty() {
            return Ok(());
        }
        let batch: Vec<DecodeSeq<'_>> = meta
            .iter()
            .zip(&tables)
            .map(|(&(position, context_len), t)| DecodeSeq {
                position,
                context_len,
                num_tokens: self.cfg.tokens_per_decode,
                block_table: t,
            })
            .collect();
        let (stream, backend) = (decode.stream(), self.backend.as_ref());
        let t0 = Instant::now();
        decode.stage(&batch)?;
        backend.synchronize(stream)?;
        let t1 = Instant::now();
        decode.build()?;
        backend.synchronize(stream)?;
        self.stage_us += (t1 - t0).as_secs_f64() * 1e6;
        self.build.record(t1.elapsed().as_secs_f64() * 1e6);
        Ok(())
    }

    /// Finished requests leave (their blocks stay cached); admission order is kept.
    fn complete(&mut self) -> Result<(), SimError> {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if !r.prefilling() && r.generated >= r.spec.output {
                let r = self.running.remove(i);
                self.m.finish(r.id())?;
                self.rep.completed += 1;
                self.finished_in_time(&r);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// A completed request's latencies and whether it met the target.
    fn finished_in_time(&mut self, r: &Req) {
        let Some(t) = &self.cfg.time else { return };
        let first = r.first_ms.unwrap_or(self.clock_ms);
        let ttft = first - r.sent_ms;
        let tpot = if r.spec.output > 1 { (self.clock_ms - first) / (r.spec.output - 1) as f64 } else { 0.0 };
        self.time.e2e_ms.record(self.clock_ms - r.sent_ms);
        if r.spec.output > 1 {
            self.time.tpot_ms.record(tpot);
        }
        let tokens = r.spec.prompt + r.spec.output;
        self.done_tokens += tokens;
        self.done_out_tokens += r.spec.output;
        if ttft <= t.slo_ttft_ms && tpot <= t.slo_tpot_ms {
            self.time.within_slo += 1;
            self.slo_tokens += tokens;
        }
    }

    /// Per-step sums and maxima, and a memory sample every `sample_every` steps.
    fn record(&mut self) -> Result<(), SimError> {
        let running = self.running.len();
        // Compressed history held: the blocks running requests hold, at block_size tokens.
        let bs = self.block_size;
        let tokens: u64 = self.running.iter().map(|r| r.context.div_ceil(bs) * bs).sum();
        self.sum_running += running as f64;
        self.sum_tokens += tokens as f64;
        self.rep.max_running = self.rep.max_running.max(running);
        self.rep.max_compressed_tokens = self.rep.max_compressed_tokens.max(tokens);
        let held = self.m.checkpoint_bytes_held();
        self.rep.max_checkpoint_bytes = self.rep.max_checkpoint_bytes.max(held);
        let due = match &self.cfg.time {
            None => self.step % self.sample_every == 0 || self.step + 1 == self.cfg.steps,
            Some(_) => self.clock_ms >= self.next_sample_ms,
        };
        if due && self.rep.samples.len() < MAX_SAMPLES as usize + 1 {
            if let Some(t) = &self.cfg.time {
                self.next_sample_ms = self.clock_ms + t.horizon_ms / MAX_SAMPLES as f64;
            }
            let s = self.sample(tokens)?;
            self.rep.samples.push(s);
        }
        Ok(())
    }

    fn sample(&self, tokens: u64) -> Result<Sample, SimError> {
        let v = self.m.view()?;
        let (e, s) = (self.rep.envelope_rows, self.rep.slot_rows);
        let used_b = i64::from(v.num_blocks - v.free_blocks);
        let used_s = i64::from(v.num_slots - v.free_slots);
        Ok(Sample {
            step: self.step,
            time_ms: self.clock_ms,
            block_rows_used: used_b * e,
            block_rows_free: i64::from(v.free_blocks) * e,
            slot_rows_used: used_s * s,
            slot_rows_free: i64::from(v.free_slots) * s,
            gap_rows: self.rep.plane_rows - i64::from(v.num_blocks) * e - i64::from(v.num_slots) * s,
            running: self.running.len(),
            waiting: self.waiting.len(),
            compressed_tokens: tokens,
        })
    }

    /// Finish every registered request and empty the cache, so the pool holds nothing.
    fn release_all(&mut self) -> Result<(), ManagerError> {
        for r in self.running.drain(..).chain(self.waiting.drain(..)) {
            if let Some(id) = r.id {
                self.m.finish(id)?;
            }
        }
        self.m.complete_inflight()?;
        self.m.evict_all()?;
        Ok(())
    }

    /// The figures, after freeing every request still running and emptying the cache.
    pub fn finish(mut self) -> Result<SimReport, SimError> {
        let v = self.m.view()?;
        let mut rep = std::mem::take(&mut self.rep);
        rep.final_split =
            (v.num_blocks, v.num_blocks - v.free_blocks, v.num_slots, v.num_slots - v.free_slots);
        let st = self.m.stats();
        rep.time = self.time_report(st.tier_restored_bytes + st.shared_restored_bytes);
        rep.checkpoint_bytes_held = self.m.checkpoint_bytes_held();
        rep.checkpoints_stored = st.checkpoints_stored;
        rep.evicted_blocks = st.evicted_blocks;
        rep.evicted_checkpoints = st.evicted_checkpoints;
        rep.hits = st.hits;
        (rep.boundary_moves, rep.block_relocations, rep.slot_relocations) =
            (st.boundary_moves, st.block_relocations, st.slot_relocations);
        rep.eligible_prefix_tokens = self.eligible_tokens;
        rep.prefix_hit_tokens = self.first_hit_tokens;
        rep.prefix_hit_rate = if self.eligible_tokens == 0 {
            0.0
        } else {
            self.first_hit_tokens as f64 / self.eligible_tokens as f64
        };
        // Requests still queued count with their wait so far: a run that serves fewer of an
        // overloaded queue does not look faster for it.
        let still: u64 = self.waiting.iter().map(|r| self.step - r.queued).sum();
        let queued = rep.arrived - rep.refused - rep.turned_away;
        self.release_all()?;
        let n = self.step.max(1) as f64;
        rep.mean_running = self.sum_running / n;
        rep.mean_compressed_tokens = self.sum_tokens / n;
        rep.mean_wait_steps = self.sum_wait / self.admissions.max(1) as f64;
        rep.mean_queue_steps = (self.queue_steps + still) as f64 / queued.max(1) as f64;
        rep.index_build_steps = self.build.count();
        rep.stage_mean_us = self.stage_us / self.build.count().max(1) as f64;
        rep.index_build_mean_us = self.build.mean();
        rep.index_build_p99_us = self.build.quantile(0.99);
        rep.index_build_max_us = self.build.max();
        rep.steps = self.step;
        Ok(rep)
    }

    /// The time figures at the end (requests never given a first token count with their
    /// wait so far; `release_all` has not run yet).
    fn time_report(&mut self, restored: u64) -> Option<TimeReport> {
        let t = self.cfg.time.as_ref()?;
        let mut out = std::mem::take(&mut self.time);
        for r in self.running.iter().chain(&self.waiting).filter(|r| r.first_ms.is_none()) {
            out.ttft_ms.record(self.clock_ms - r.sent_ms);
            out.ttft_censored += 1;
        }
        let secs = (self.clock_ms / 1000.0).max(1e-9);
        let gpus = f64::from(t.cost.gpus.max(1));
        out.cost = t.cost.name.clone();
        out.gpus = t.cost.gpus;
        out.duration_s = self.clock_ms / 1000.0;
        out.tok_s_gpu = self.done_tokens as f64 / secs / gpus;
        out.out_tok_s_gpu = self.done_out_tokens as f64 / secs / gpus;
        out.goodput_rps = out.within_slo as f64 / secs;
        out.goodput_tok_s_gpu = self.slo_tokens as f64 / secs / gpus;
        out.slo_ttft_ms = t.slo_ttft_ms;
        out.slo_tpot_ms = t.slo_tpot_ms;
        out.busy = self.busy_ms / self.clock_ms.max(1e-9);
        out.restored_bytes = restored;
        Some(out)
    }
}

impl Drop for Engine<'_> {
    fn drop(&mut self) {
        let _ = self.release_all();
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
