//! `simulate` at fleet scale (issue 35): `N` engines, each an [`Engine`] on its own pool with
//! its own host tier, behind a router, optionally sharing one shared tier, replaying a whole
//! trace. The engines advance in one clock: before a request is routed at its arrival, every
//! engine with work steps until its clock reaches that arrival (the one furthest behind
//! first), so the router sees what each engine holds then.
//!
//! * **Routers**: [`Router::RoundRobin`], or [`Router::PrefixAffinity`] — the engine with the
//!   least work for the request, as NVIDIA Dynamo's KV router weighs it: the blocks it would
//!   prefill there (its prompt's blocks less the longest prefix that engine's cache — HBM or
//!   host tier — holds, learned only from the KV events its manager publishes, [`KvEvent`])
//!   plus its load — requests in flight and those it was sent among the last `4·N` — each
//!   weighing a quarter of the trace's mean prompt in blocks (so a long cached prefix
//!   outweighs a few requests of load, while a short one, the common system prompt only one
//!   engine holds at first, does not pile every new conversation onto that engine).
//! * **Runs** ([`FleetRun`]): no reuse; per-engine tiers only (pool + host tier); and the
//!   same with the shared tier ([`SimSharedTier`]).
//! * **The shared tier in the simulator** is a model, not files: one LRU index of the
//!   entries every engine published, within a byte budget, shared by the engines; a restore
//!   allocates the blocks and moves no bytes (the whole trace's blocks would be hundreds of
//!   gigabytes of files). Its restores are charged like host-tier ones by the step-cost
//!   model. The real tier's exactness is `tests/shared_tier*.rs`'s.

use super::policy::{self, NAMESPACE};
use super::trace::Trace;
use super::{Engine, LatencyHistogram, RequestSpec, RunKind, SimConfig, SimError, SimReport};
use crate::alloc::BlockHandle;
use crate::backend::Backend;
use crate::manager::{KvEvent, Medium, Tier, TierKey};
use crate::pool::{Pool, PoolSpec};
use crate::transfer::HostTierError;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// How requests are spread over the engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// In turn.
    RoundRobin,
    /// To the engine with the fewest blocks to prefill plus load (prefixes from the KV events).
    PrefixAffinity,
}

impl Router {
    /// `round-robin` or `affinity`.
    pub fn parse(s: &str) -> Option<Router> {
        match s {
            "round-robin" | "rr" => Some(Router::RoundRobin),
            "affinity" | "prefix-affinity" => Some(Router::PrefixAffinity),
            _ => None,
        }
    }
    /// The CLI's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Router::RoundRobin => "round-robin",
            Router::PrefixAffinity => "affinity",
        }
    }
}

/// What the engines of a fleet run reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetRun {
    /// No prefix reuse anywhere.
    NoReuse,
    /// Each engine's pool and host tier (the elastic split with v4pool's reuse).
    PerEngine,
    /// As `PerEngine`, plus one shared tier all engines publish to and restore from.
    Shared,
}

impl FleetRun {
    /// Every run, in report order.
    pub const ALL: [FleetRun; 3] = [FleetRun::Shared, FleetRun::PerEngine, FleetRun::NoReuse];
    /// `shared`, `per_engine`, `no_reuse`.
    pub fn name(self) -> &'static str {
        match self {
            FleetRun::NoReuse => "no_reuse",
            FleetRun::PerEngine => "per_engine",
            FleetRun::Shared => "shared",
        }
    }
}

/// A fleet: how many engines, the router, and the shared tier's budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FleetConfig {
    /// Engines.
    pub engines: usize,
    /// The router.
    pub router: Router,
    /// Bytes the shared tier holds (the `Shared` run).
    pub shared_tier_bytes: u64,
}

impl FleetConfig {
    /// `engines` engines behind `router`, sharing a tier of `shared_tier_bytes`.
    pub fn new(engines: usize, router: Router, shared_tier_bytes: u64) -> Self {
        FleetConfig { engines, router, shared_tier_bytes }
    }
}

/// Most engines a fleet run builds.
pub const MAX_ENGINES: usize = 256;

/// Where a fleet run stands, handed to [`simulate_fleet_with_progress`]'s callback after every
/// engine step (the caller throttles: a fleet steps its engines hundreds of thousands of times).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FleetProgress {
    /// The fleet's clock: the clock of the engine furthest behind that still has work, in ms
    /// of simulated time.
    pub clock_ms: f64,
    /// Where the clock stops.
    pub horizon_ms: f64,
    /// Requests routed so far.
    pub routed: usize,
    /// Requests the run routes: those arriving before the horizon.
    pub requests: usize,
    /// Engine steps taken so far, all engines together.
    pub steps: u64,
}

#[derive(Debug, Default)]
struct Index {
    entries: HashMap<TierKey, (u64, u64)>,
    order: BTreeMap<u64, TierKey>,
    used: u64,
    capacity: u64,
    clock: u64,
}

impl Index {
    fn touch(&mut self, key: &TierKey) -> bool {
        let Some(e) = self.entries.get_mut(key) else { return false };
        self.clock += 1;
        self.order.remove(&e.1);
        e.1 = self.clock;
        self.order.insert(self.clock, *key);
        true
    }
    fn remove(&mut self, key: &TierKey) -> bool {
        let Some((units, stamp)) = self.entries.remove(key) else { return false };
        self.order.remove(&stamp);
        self.used -= units;
        true
    }
}

/// The simulator's shared tier: an LRU index of entries within a budget of units, shared by
/// every engine of a fleet (clones share it), moving no bytes (see the module docs).
#[derive(Clone, Debug)]
pub struct SimSharedTier {
    index: Arc<Mutex<Index>>,
    unit_bytes: u64,
}

impl SimSharedTier {
    /// A tier of `bytes` for units of `unit_bytes`.
    pub fn new(bytes: u64, unit_bytes: u64) -> SimSharedTier {
        let capacity = bytes.checked_div(unit_bytes).unwrap_or(0);
        SimSharedTier { index: Arc::new(Mutex::new(Index { capacity, ..Index::default() })), unit_bytes }
    }
    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Tier<TierKey> for SimSharedTier {
    fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }
    fn capacity_units(&self) -> u64 {
        self.index().capacity
    }
    fn used_units(&self) -> u64 {
        self.index().used
    }
    fn is_empty(&self) -> bool {
        false
    }
    fn contains(&self, key: &TierKey) -> bool {
        self.index().entries.contains_key(key)
    }
    fn lru_order(&self) -> Vec<TierKey> {
        self.index().order.values().copied().collect()
    }
    fn touch(&mut self, key: &TierKey) -> bool {
        self.index().touch(key)
    }
    fn evict(&mut self, key: &TierKey) -> bool {
        self.index().remove(key)
    }
    fn spill(
        &mut self,
        _pool: &Pool,
        key: TierKey,
        blocks: &[BlockHandle],
    ) -> Result<Vec<TierKey>, HostTierError> {
        let mut ix = self.index();
        let units = blocks.len() as u64;
        if units > ix.capacity {
            return Err(HostTierError::TooLarge {
                units: blocks.len(),
                unit_bytes: self.unit_bytes,
                capacity: ix.capacity,
            });
        }
        if ix.touch(&key) {
            return Ok(Vec::new());
        }
        while ix.used + units > ix.capacity {
            let Some((_, victim)) = ix.order.first_key_value().map(|(s, k)| (*s, *k)) else { break };
            ix.remove(&victim);
        }
        ix.clock += 1;
        let stamp = ix.clock;
        ix.entries.insert(key, (units, stamp));
        ix.order.insert(stamp, key);
        ix.used += units;
        Ok(Vec::new())
    }
    fn restore(&mut self, pool: &Pool, key: &TierKey) -> Result<Vec<BlockHandle>, HostTierError> {
        let units = {
            let mut ix = self.index();
            let Some(&(units, _)) = ix.entries.get(key) else { return Err(HostTierError::NotHeld) };
            ix.touch(key);
            units
        };
        let _pin = pool.pin_boundary()?;
        crate::transfer::host_tier::alloc_units(pool, units as usize)
    }
}

/// One fleet run's figures: each engine's report, and the fleet's.
#[derive(Clone, Debug)]
pub struct FleetReport {
    /// The run.
    pub run: FleetRun,
    /// The router.
    pub router: Router,
    /// Each engine's report, engine 0 first.
    pub engines: Vec<SimReport>,
    /// TTFT over every request of the fleet, ms.
    pub ttft_ms: LatencyHistogram,
    /// TPOT over every request of the fleet, ms.
    pub tpot_ms: LatencyHistogram,
    /// Requests whose TTFT is a lower bound (never given a first token by the horizon).
    pub ttft_censored: u64,
    /// Prompt tokens served from a cache over all prompt tokens (first admissions).
    pub from_cache: f64,
    /// The trace's ceiling (`Trace::ceiling`, a share of blocks an earlier prompt carried).
    pub ceiling: f64,
    /// Requests routed to each engine.
    pub routed: Vec<u64>,
    /// Tokens (input + output) of completed requests per second per GPU of the fleet.
    pub tok_s_gpu: f64,
    /// Bytes restored from the host and shared tiers, over the fleet.
    pub restored_bytes: u64,
}

impl FleetReport {
    /// `from_cache` over the ceiling: the share of the trace's reuse ceiling served.
    pub fn of_ceiling(&self) -> f64 {
        if self.ceiling > 0.0 {
            self.from_cache / self.ceiling
        } else {
            0.0
        }
    }
}

/// Which blocks each engine's cache holds, as the router learns it from events.
struct Affinity {
    /// Per engine: wire hash → media bits (GPU 1, CPU 2).
    held: Vec<HashMap<u64, u8>>,
}

impl Affinity {
    fn learn(&mut self, e: usize, events: &[KvEvent]) {
        let bit = |m: Medium| match m {
            Medium::Gpu => 1u8,
            Medium::Cpu => 2,
            Medium::Storage => 0,
        };
        let held = &mut self.held[e];
        for ev in events {
            match ev {
                KvEvent::Stored { hashes, medium, .. } if bit(*medium) != 0 => {
                    for h in hashes {
                        *held.entry(crate::events::wire_hash(*h)).or_insert(0) |= bit(*medium);
                    }
                }
                KvEvent::Removed { hashes, medium } if bit(*medium) != 0 => {
                    for h in hashes {
                        let w = crate::events::wire_hash(*h);
                        if let Some(b) = held.get_mut(&w) {
                            *b &= !bit(*medium);
                            if *b == 0 {
                                held.remove(&w);
                            }
                        }
                    }
                }
                KvEvent::AllCleared => held.clear(),
                _ => {}
            }
        }
    }
    /// Leading blocks of `hashes` engine `e` holds.
    fn score(&self, e: usize, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.held[e].contains_key(h)).count()
    }
}

/// Step the engine furthest behind, among those with work whose clock is below `until`, until
/// none is left; the router learns each step's events.
fn advance(
    engines: &mut [Engine<'_>],
    queues: &mut [VecDeque<RequestSpec>],
    affinity: &mut Affinity,
    until: f64,
    at: &mut FleetProgress,
    progress: &mut dyn FnMut(&FleetProgress),
) -> Result<(), SimError> {
    loop {
        let next = (0..engines.len())
            .filter(|&e| (engines[e].has_work() || !queues[e].is_empty()) && engines[e].clock_ms() < until)
            .min_by(|&a, &b| engines[a].clock_ms().total_cmp(&engines[b].clock_ms()));
        let Some(e) = next else { return Ok(()) };
        // The engine about to step is the one furthest behind: its clock is the fleet's.
        at.clock_ms = at.clock_ms.max(engines[e].clock_ms());
        let q = &mut queues[e];
        let mut arrivals = std::iter::from_fn(|| q.pop_front());
        engines[e].step(&mut arrivals)?;
        let events = engines[e].manager_mut().drain_events();
        affinity.learn(e, &events);
        at.steps += 1;
        progress(at);
    }
}

/// Replay `specs` (a trace's, in arrival order) on a fleet: `fleet.engines` pools of `spec`
/// on `backend`, each driven by an [`Engine`] of `cfg` (time mode) for `run`.
pub fn simulate_fleet(
    backend: &Arc<dyn Backend>,
    spec: &PoolSpec,
    cfg: &SimConfig,
    fleet: &FleetConfig,
    run: FleetRun,
    trace: &Arc<Trace>,
    specs: &[RequestSpec],
) -> Result<FleetReport, SimError> {
    simulate_fleet_with_progress(backend, spec, cfg, fleet, run, trace, specs, &mut |_| {})
}

/// [`simulate_fleet`], calling `progress` after every engine step with where the run stands
/// (a fleet of real budgets runs for minutes; the caller decides how often to show it).
#[allow(clippy::too_many_arguments)] // simulate_fleet's inputs plus the callback
pub fn simulate_fleet_with_progress(
    backend: &Arc<dyn Backend>,
    spec: &PoolSpec,
    cfg: &SimConfig,
    fleet: &FleetConfig,
    run: FleetRun,
    trace: &Arc<Trace>,
    specs: &[RequestSpec],
    progress: &mut dyn FnMut(&FleetProgress),
) -> Result<FleetReport, SimError> {
    let n = fleet.engines;
    if n == 0 || n > MAX_ENGINES {
        return Err(super::SimConfigError::OutOfRange {
            what: "--engines",
            got: n as u64,
            min: 1,
            max: MAX_ENGINES as u64,
        }
        .into());
    }
    let Some(time) = cfg.time.clone() else {
        return Err(super::SimConfigError::NotInTime.into());
    };
    let kind = match run {
        FleetRun::NoReuse => RunKind::NoReuse,
        FleetRun::PerEngine | FleetRun::Shared => RunKind::ElasticTier,
    };
    let pools: Vec<Arc<Pool>> = (0..n).map(|_| super::sim_pool(backend, spec)).collect::<Result<_, _>>()?;
    let mut engines = Vec::with_capacity(n);
    let unit = crate::transfer::host_tier::part_bytes(&pools[0])?.iter().sum();
    let shared = (run == FleetRun::Shared).then(|| SimSharedTier::new(fleet.shared_tier_bytes, unit));
    for p in &pools {
        let mut e = Engine::new(p, cfg, kind)?.with_trace(trace.clone());
        let m = e.manager_mut();
        if let Some(s) = &shared {
            m.set_shared_tier(Some(Box::new(s.clone())))?;
        }
        m.enable_events(fleet.router == Router::PrefixAffinity);
        engines.push(e);
    }
    let mut queues: Vec<VecDeque<RequestSpec>> = vec![VecDeque::new(); n];
    let mut routed = vec![0u64; n];
    let mut affinity = Affinity { held: vec![HashMap::new(); n] };
    let bs = spec.geometry.block_size.max(1) as u64;
    let mut turn = 0usize;
    let prompt_blocks: u64 = specs.iter().map(|r| r.prompt / bs).sum();
    let load_weight = (prompt_blocks / specs.len().max(1) as u64 / 4).max(1);
    let (mut recent, mut recent_count) = (VecDeque::new(), vec![0usize; n]);
    let requests = specs.iter().take_while(|r| (r.arrival as f64) < time.horizon_ms).count();
    let mut at = FleetProgress { clock_ms: 0.0, horizon_ms: time.horizon_ms, routed: 0, requests, steps: 0 };
    for r in specs {
        let t = r.arrival as f64;
        if t >= time.horizon_ms {
            break;
        }
        advance(&mut engines, &mut queues, &mut affinity, t, &mut at, progress)?;
        let target = match fleet.router {
            Router::RoundRobin => {
                turn += 1;
                (turn - 1) % n
            }
            Router::PrefixAffinity => {
                let mut hs = Vec::new();
                policy::extend_hashes(NAMESPACE, r, trace.ids_of(r), bs, r.prompt / bs, &mut hs);
                let wire: Vec<u64> = hs.into_iter().map(crate::events::wire_hash).collect();
                // Dynamo's trade: blocks to prefill on the engine plus its load — requests in
                // flight and those routed to it among the last 4·N — each weighing a quarter
                // of the trace's mean prompt in blocks.
                let cost = |e: usize| {
                    let inflight = engines[e].running() + engines[e].waiting() + queues[e].len();
                    let load = (inflight + recent_count[e]) as u64;
                    (wire.len() - affinity.score(e, &wire)) as u64 + load_weight * load
                };
                (0..n).min_by_key(|&e| (cost(e), e)).unwrap_or(0)
            }
        };
        recent.push_back(target);
        recent_count[target] += 1;
        if recent.len() > 4 * n {
            let old = recent.pop_front().unwrap_or(target);
            recent_count[old] -= 1;
        }
        routed[target] += 1;
        queues[target].push_back(*r);
        at.routed += 1;
    }
    advance(&mut engines, &mut queues, &mut affinity, time.horizon_ms, &mut at, progress)?;
    let mut reports = Vec::with_capacity(n);
    for e in engines {
        reports.push(e.finish()?);
    }
    let (mut ttft, mut tpot) = (LatencyHistogram::default(), LatencyHistogram::default());
    let (mut censored, mut hit, mut input, mut shared_bytes) = (0, 0u64, 0u64, 0u64);
    let (mut tokens, mut duration) = (0.0, 0.0f64);
    for r in &reports {
        hit += r.prefix_hit_tokens;
        input += r.input_tokens;
        if let Some(t) = &r.time {
            ttft.merge(&t.ttft_ms);
            tpot.merge(&t.tpot_ms);
            censored += t.ttft_censored;
            tokens += t.tok_s_gpu * t.duration_s * f64::from(t.gpus.max(1));
            duration = duration.max(t.duration_s);
            shared_bytes += t.restored_bytes;
        }
    }
    let (c_hit, c_all) = trace.ceiling();
    let gpus = f64::from(time.cost.gpus.max(1)) * n as f64;
    Ok(FleetReport {
        run,
        router: fleet.router,
        engines: reports,
        ttft_ms: ttft,
        tpot_ms: tpot,
        ttft_censored: censored,
        from_cache: hit as f64 / input.max(1) as f64,
        ceiling: c_hit as f64 / c_all.max(1) as f64,
        routed,
        tok_s_gpu: tokens / duration.max(1e-9) / gpus,
        restored_bytes: shared_bytes,
    })
}
