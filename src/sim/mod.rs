//! The simulator: a pool driven as a serving engine would drive it, through the
//! request-level [`KvManager`](crate::manager::KvManager) and nothing below it (the
//! [`DecodePath`] the pool gives out is staged from the manager's
//! block tables and slots).
//!
//! Requests arrive (Poisson); prompt and output lengths come from a mix (chat, agentic up to
//! 1M tokens, both, or multiturn conversations that re-send their history); every request
//! carries the hashes of its full blocks; the manager admits it with the longest cached
//! prefix that ends at a checkpoint; prefill runs in chunks under a per-step token budget,
//! stopping where the manager says; every decode step stages and launches the decode
//! index build on the pool's backend; a finished request's blocks stay cached. When blocks
//! run out even after eviction a running request is preempted (its committed blocks stay
//! cached, so it resumes with a hit), as engines do.
//!
//! The same workload (same seed) runs as several [`RunKind`] runs: the manager's elastic
//! boundary and a fixed split of the same budget (`max_seqs` slots reserved at start-up,
//! [`sglang_fixed_slots`] sizes it the way SGLang sizes V4), both with v4pool's reuse, two
//! baselines on the elastic split: no reuse, and reuse only at 4,096-token granularity, and
//! the elastic split with a host tier.
//!
//! In time ([`TimeConfig`]) every step costs what the step-cost model ([`cost`]) charges for
//! its work, and the runs report TTFT, TPOT, end-to-end latency, throughput per GPU and
//! goodput ([`TimeReport`]); a Mooncake trace ([`trace`]) replays with its own arrivals;
//! `bench` ([`crate::raw::sim::bench`]) replays a published benchmark cell. `docs/simulate.md` has the model, its
//! validation and the results.
//!
//! * [`workload`] — the PRNG, the mixes, the lazy arrival stream (benches use it too).
//! * `engine` — the step loop ([`simulate`]; its `Engine` is under
//!   [`crate::raw::sim`] for tools that step a run themselves).
//! * `policy` — the engine's own decisions beside the manager's: the manager each run is
//!   built with, refusal, the preemption victim, block hashes (admission back-pressure is the
//!   manager's policy:
//!   [`KvManager::may_admit_request`](crate::manager::KvManager::may_admit_request), which
//!   prices the request's own hit).
//! * `report` — [`SimReport`], every figure a run produces.
//!
//! # Memory bound
//! A run holds the pool (its budget: on the accounting host backend, `raw::sim::sim_pool`, none of
//! it in memory), the decode index buffers (at most
//! 1/[`DECODE_BUDGET_DIVISOR`] of the pool's bytes; a larger configuration is refused by
//! [`SimConfig::check`]), and host bookkeeping bounded by constants: at most
//! [`MAX_WAITING`] queued requests (arrivals finding the queue full are turned away and
//! counted), one record per running request, at most [`MAX_SAMPLES`] samples and a
//! fixed-size latency histogram. One exception, for the hit-rate figure: the set of block
//! hashes ever committed (16 B per distinct block the run computed).

// `bench` (calibration replays) and the step loop's `Engine` with its accounting pool are the
// simulator's internals: public under `crate::raw::sim` only.
pub(crate) mod bench;
pub mod cost;
pub(crate) mod engine;
pub mod fleet;
mod policy;
mod report;
pub mod trace;
pub mod workload;

pub use cost::{StepCost, StepLoad};
pub use engine::simulate;
use engine::{sim_pool, Engine};
pub use policy::{sglang_fixed_slots, SGLANG_SWA_RATIO};
pub use report::{LatencyHistogram, Sample, SimReport, TimeReport};
pub use trace::{Trace, TraceError};
pub use workload::{Mix, RequestSpec, Rng, Workload, WorkloadConfig};

use crate::geometry::UnifiedPoolGeometry;
use crate::pool::{DecodeCapacity, DecodeError, DecodePath, PoolError, PoolSpec};

/// Most requests waiting for admission; arrivals beyond it are turned away (counted in
/// [`SimReport::turned_away`]). 65,536 requests of 32 bytes: 2 MiB.
pub const MAX_WAITING: usize = 1 << 16;
/// Most memory samples one run keeps; a longer run samples more sparsely.
pub const MAX_SAMPLES: u64 = 4096;
/// The decode index buffers may take at most the pool's bytes over this.
pub const DECODE_BUDGET_DIVISOR: u64 = 16;
/// Most steps one run takes.
pub const MAX_STEPS: u64 = 10_000_000;
/// Largest mean arrival rate per step.
pub const MAX_RATE: f64 = 1000.0;
/// Largest prefill chunk (tokens per step).
pub const MAX_PREFILL_CHUNK: u64 = 1 << 24;
/// Longest context a run may allow (tokens).
pub const MAX_CONTEXT: u64 = 1 << 24;
/// Most tokens one decode step writes per request (1 + speculative steps).
pub const MAX_TOKENS_PER_DECODE: usize = 64;
/// Sliding window the decode buffers are built for (capped by the ring).
pub const DECODE_WINDOW: i64 = 128;
/// CSA top-k the decode buffers reserve per token.
pub const DECODE_TOPK: i32 = 512;

const GIB: f64 = (1u64 << 30) as f64;

/// Host bytes the manager keeps per block of the pool at most (its cached-block index, the
/// LRU, the block tables' entries), measured on the conversation trace at 80 GiB (issue 45).
pub const MANAGER_BYTES_PER_BLOCK: u64 = 256;
/// Host bytes a run holds whatever its pool: the binary, the queue (at most [`MAX_WAITING`]
/// requests), histograms and samples.
pub const BASE_BYTES: u64 = 64 << 20;

/// Where a backend keeps what a simulated pool holds, for [`SimConfig::memory_estimate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MemoryPlacement {
    /// The planes and indexer cache are host memory (the plain host backend).
    pub planes_on_host: bool,
    /// The decode index buffers are host memory (any host backend).
    pub index_on_host: bool,
    /// Host tiers are committed host memory (pinned on a device backend, the plain host
    /// backend's heap); the accounting host backend reserves them without committing them.
    pub tiers_committed: bool,
}

crate::setters::with_setters!(MemoryPlacement {
    with_planes_on_host(planes_on_host: bool),
    with_index_on_host(index_on_host: bool),
    with_tiers_committed(tiers_committed: bool),
});

/// What one run of the simulator holds in host memory at its peak, by engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Engines built at once.
    pub engines: usize,
    /// Bytes one engine holds at most.
    pub per_engine: u64,
    /// Bytes the run holds at most (engines × per engine + the run's own).
    pub total: u64,
}

crate::variant::variant_names! {
/// What a simulation can fail with while it runs.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The pool refused an operation the engine had no reason to expect to fail.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The decode path refused the batch or its buffers.
    #[error(transparent)]
    Decode(#[from] crate::pool::DecodeError),
    /// The backend failed a launch or synchronisation.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    /// The manager refused an operation the engine had no reason to expect to fail.
    #[error(transparent)]
    Manager(#[from] crate::manager::ManagerError),
    /// The configuration does not fit the pool (see [`SimConfig::check`]).
    #[error(transparent)]
    Config(#[from] SimConfigError),
    /// The step-cost model refused its input.
    #[error(transparent)]
    Cost(#[from] cost::CostError),
    /// A trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A calibration replay's model could not be built.
    #[error("calibration replay: {0}")]
    BenchModel(#[source] crate::model::ModelError),
    /// A calibration replay could not size its pool.
    #[error("calibration replay: {0}")]
    Bench(#[source] crate::sizing::SizingError),
}
}

crate::variant::variant_names! {
/// A configuration the simulator refuses before it allocates anything.
#[derive(Debug, thiserror::Error)]
pub enum SimConfigError {
    /// A count outside its range.
    #[error("{what} of {got} is outside {min}..={max}")]
    OutOfRange {
        /// The parameter, as the CLI spells it.
        what: &'static str,
        /// The value given.
        got: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed (for pool-dependent bounds, what this pool allows).
        max: u64,
    },
    /// The arrival rate is not a finite number in (0, [`MAX_RATE`]].
    #[error("rate {0} is not in (0, {MAX_RATE}]")]
    Rate(f64),
    /// The decode index buffers would take more than their share of the pool.
    #[error(
        "decode index buffers for {seqs} sequences of up to {context} tokens take {bytes} B, \
         over the {limit} B (pool bytes / {DECODE_BUDGET_DIVISOR}) they may take"
    )]
    DecodeBuffers {
        /// Sequences the buffers are sized for.
        seqs: usize,
        /// Longest context.
        context: u64,
        /// Bytes they would take.
        bytes: u64,
        /// Bytes they may take.
        limit: u64,
    },
    /// The decode buffers cannot be laid out for this geometry.
    #[error("decode index buffers: {0}")]
    Decode(#[source] DecodeError),
    /// A time-mode figure that is not a finite positive number.
    #[error("{0} {1} is not a finite positive number")]
    Time(&'static str, f64),
    /// A `max_context` shorter than the mix's requests can be ([`Mix::min_context`]).
    #[error("--max-context {got} is below the {min} tokens a request of the {mix} mix may need")]
    ContextBelowMix {
        /// The mix.
        mix: &'static str,
        /// `max_context` given.
        got: u64,
        /// The mix's shortest context.
        min: u64,
    },
    /// The run would hold more host memory than the machine has available
    /// ([`SimConfig::memory_estimate`]): refused before anything is allocated, rather than
    /// killed by the kernel midway.
    #[error(
        "needs about {:.1} GiB of host memory ({engines} engine(s) × {:.2} GiB), {:.1} GiB available",
        *.need as f64 / GIB, *.per_engine as f64 / GIB, *.available as f64 / GIB
    )]
    Memory {
        /// Engines the run builds at once.
        engines: usize,
        /// Bytes one engine holds at most.
        per_engine: u64,
        /// Bytes the run would hold at its peak.
        need: u64,
        /// Bytes the machine has available.
        available: u64,
    },
    /// A fleet (or anything that needs a clock) was asked to run counting steps.
    #[error("this run needs time mode (a step-cost model and a horizon)")]
    NotInTime,
}
}

/// Which run: the manager's split policy and how prefixes are reused (a run of the
/// simulator; the policy itself is a [`crate::manager::SplitPolicy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// [`crate::manager::ElasticPolicy`], with v4pool's reuse (checkpoints every 16 blocks,
    /// at prompt ends and rolling ones at turn ends: hits at any block boundary).
    Elastic,
    /// [`crate::manager::FixedPolicy`] (`max_seqs` slots at start-up), with v4pool's reuse.
    Fixed,
    /// Baseline: the elastic split, no reuse (every request hashes in a namespace of its
    /// own, so nothing it caches is ever hit).
    NoReuse,
    /// Baseline: the elastic split, reuse only at 4,096-token granularity (checkpoints every
    /// 16 blocks of 256, none rolling, and only whole 16-block groups hashed), the way
    /// engines that reuse at the LCM of the groups' block sizes behave.
    Reuse4096,
    /// The elastic split with v4pool's reuse and a host tier of
    /// [`SimConfig::host_tier_bytes`] (`ManagerConfig::host_tier_bytes`): what the LRU
    /// evicts spills to host memory and comes back on a hit (restores charged at the cost
    /// model's host bandwidth).
    ElasticTier,
}

impl RunKind {
    /// Every run, in report order.
    pub const ALL: [RunKind; 4] = [RunKind::Elastic, RunKind::Fixed, RunKind::NoReuse, RunKind::Reuse4096];

    /// `elastic`, `fixed`, `no_reuse` or `reuse_4096`.
    pub fn name(self) -> &'static str {
        match self {
            RunKind::Elastic => "elastic",
            RunKind::Fixed => "fixed",
            RunKind::NoReuse => "no_reuse",
            RunKind::Reuse4096 => "reuse_4096",
            RunKind::ElasticTier => "elastic+host",
        }
    }
}

/// Workload and engine parameters (the pool itself comes from the caller).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SimConfig {
    /// Length mix of the arrivals.
    pub mix: Mix,
    /// Mean arrivals per step.
    pub rate: f64,
    /// Forward steps to run.
    pub steps: u64,
    /// Workload seed.
    pub seed: u64,
    /// Most running requests under the fixed split (the engine's `max_num_seqs`, each with
    /// a slot reserved at start-up).
    pub max_seqs: usize,
    /// Most running requests under the elastic boundary: slots are taken from the gap only
    /// while memory allows, so the cap can sit above `max_seqs` (never below it).
    pub elastic_max_seqs: usize,
    /// Prefill tokens one step processes, over all prefilling requests.
    pub prefill_chunk: u64,
    /// Tokens one decode step writes per request (1 + speculative steps).
    pub tokens_per_decode: usize,
    /// Longest context a request may reach (block-table width).
    pub max_context: u64,
    /// Slots an elastic pool keeps free beyond the running ones.
    pub slot_headroom: u32,
    /// Sample memory by region every this many steps (sparser when `steps` needs it to
    /// stay under [`MAX_SAMPLES`]).
    pub sample_every: u64,
    /// Run in time (a step costs what [`TimeConfig::cost`] says; arrivals in ms); `None`:
    /// count steps, every step the same.
    pub time: Option<TimeConfig>,
    /// Host-tier bytes of the [`RunKind::ElasticTier`] run.
    pub host_tier_bytes: u64,
    /// Whether requests' blocks are hashed (prefix caching). Off for a workload whose prompts
    /// share nothing by construction (the calibration benchmark's random prompts): no
    /// checkpoint is stored that nothing could hit.
    pub hash_blocks: bool,
    /// Whether every decode step stages and builds the decode indices on the backend (the
    /// run's real work; off only where a test needs the timing alone to be fast).
    pub build_index: bool,
}

crate::setters::with_setters!(SimConfig {
    with_mix(mix: Mix),
    with_rate(rate: f64),
    with_steps(steps: u64),
    with_seed(seed: u64),
    with_max_seqs(max_seqs: usize),
    with_elastic_max_seqs(elastic_max_seqs: usize),
    with_prefill_chunk(prefill_chunk: u64),
    with_tokens_per_decode(tokens_per_decode: usize),
    with_max_context(max_context: u64),
    with_slot_headroom(slot_headroom: u32),
    with_sample_every(sample_every: u64),
    with_time(time: Some(TimeConfig)),
    with_host_tier_bytes(host_tier_bytes: u64),
    with_hash_blocks(hash_blocks: bool),
    with_build_index(build_index: bool),
});

/// Time mode: the step-cost model, the arrival window and the latency target.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TimeConfig {
    /// What a step costs.
    pub cost: StepCost,
    /// The run stops at this clock (ms) with whatever is still queued or running counted
    /// as censored (TTFT so far); a drained run stops earlier.
    pub horizon_ms: f64,
    /// Closed loop (a benchmark client): at most this many requests in flight, the next sent
    /// when one finishes; arrival times are ignored. `None`: open loop, arrivals at their ms.
    pub concurrency: Option<usize>,
    /// Time to first token a request must meet to count toward goodput, ms.
    pub slo_ttft_ms: f64,
    /// Time per output token it must meet, ms.
    pub slo_tpot_ms: f64,
}

impl TimeConfig {
    /// Open loop at `cost` until `horizon_ms`, against the default latency targets
    /// ([`SLO_TTFT_MS`], [`SLO_TPOT_MS`]).
    pub fn new(cost: StepCost, horizon_ms: f64) -> Self {
        TimeConfig { cost, horizon_ms, concurrency: None, slo_ttft_ms: SLO_TTFT_MS, slo_tpot_ms: SLO_TPOT_MS }
    }
}

crate::setters::with_setters!(TimeConfig {
    with_concurrency(concurrency: Option<usize>),
    with_slo_ttft_ms(slo_ttft_ms: f64),
    with_slo_tpot_ms(slo_tpot_ms: f64),
});

/// The latency target goodput is reported against by default: a first token within 2 s and
/// 50 ms per output token (20 tokens/s, faster than reading), for a chat service.
pub const SLO_TTFT_MS: f64 = 2000.0;
/// See [`SLO_TTFT_MS`].
pub const SLO_TPOT_MS: f64 = 50.0;

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
            time: None,
            host_tier_bytes: 0,
            hash_blocks: true,
            build_index: true,
        }
    }
}

impl SimConfig {
    /// The arrival stream's parameters.
    pub fn workload_config(&self) -> WorkloadConfig {
        WorkloadConfig {
            mix: self.mix,
            rate: self.rate,
            steps: self.steps,
            seed: self.seed,
            max_context: self.max_context,
        }
    }

    /// A fresh arrival stream (the same one every call); refused as [`Workload::new`] refuses.
    pub fn workload(&self) -> Result<Workload, SimConfigError> {
        Workload::new(self.workload_config())
    }

    /// Running requests the decode buffers must hold under `policy`.
    pub fn cap_seqs(&self, policy: RunKind) -> usize {
        match policy {
            RunKind::Fixed => self.max_seqs,
            RunKind::Elastic | RunKind::NoReuse | RunKind::Reuse4096 | RunKind::ElasticTier => {
                self.elastic_max_seqs
            }
        }
    }

    /// The decode buffers' capacity for `policy` on `geometry`.
    pub fn decode_capacity(&self, geometry: &UnifiedPoolGeometry, policy: RunKind) -> DecodeCapacity {
        let seqs = self.cap_seqs(policy);
        DecodeCapacity {
            max_seqs: seqs,
            max_tokens: seqs * self.tokens_per_decode,
            max_blocks_per_seq: self.max_context.div_ceil(geometry.block_size.max(1) as u64) as usize + 1,
            win: geometry.ring_slots.min(DECODE_WINDOW) as i32,
            index_topk: DECODE_TOPK,
        }
    }

    /// Refuse what the run could not do within its memory bound (see the module docs):
    /// counts out of range, more running requests than the plane has slot positions, and
    /// decode buffers over their share of `pool_bytes`. Nothing is clamped.
    pub fn check(&self, geometry: &UnifiedPoolGeometry, pool_bytes: u64) -> Result<(), SimConfigError> {
        let positions = geometry.slot_positions.max(0) as u64;
        let range = |what, got: u64, min: u64, max: u64| {
            if got < min || got > max {
                Err(SimConfigError::OutOfRange { what, got, min, max })
            } else {
                Ok(())
            }
        };
        range("--steps", self.steps, 1, MAX_STEPS)?;
        if !(self.rate.is_finite() && self.rate > 0.0 && self.rate <= MAX_RATE) {
            return Err(SimConfigError::Rate(self.rate));
        }
        range("--max-seqs", self.max_seqs as u64, 1, positions)?;
        range("--elastic-max-seqs", self.elastic_max_seqs as u64, self.max_seqs as u64, positions)?;
        range("--prefill-chunk", self.prefill_chunk, 1, MAX_PREFILL_CHUNK)?;
        range("--max-context", self.max_context, 2, MAX_CONTEXT)?;
        range("tokens per decode", self.tokens_per_decode as u64, 1, MAX_TOKENS_PER_DECODE as u64)?;
        range("--slot-headroom", u64::from(self.slot_headroom), 1, positions)?;
        range("sample interval", self.sample_every, 1, u64::MAX)?;
        if let Some(t) = &self.time {
            if !(t.horizon_ms.is_finite() && t.horizon_ms > 0.0) {
                return Err(SimConfigError::Time("horizon", t.horizon_ms));
            }
            if !(t.slo_ttft_ms.is_finite() && t.slo_ttft_ms > 0.0) {
                return Err(SimConfigError::Time("TTFT target", t.slo_ttft_ms));
            }
            if !(t.slo_tpot_ms.is_finite() && t.slo_tpot_ms > 0.0) {
                return Err(SimConfigError::Time("TPOT target", t.slo_tpot_ms));
            }
            if let Some(c) = t.concurrency {
                range("--concurrency", c as u64, 1, MAX_WAITING as u64)?;
            }
        }
        let limit = pool_bytes / DECODE_BUDGET_DIVISOR;
        // (the memory bound is `memory_estimate`'s)
        for policy in [RunKind::Elastic, RunKind::Fixed] {
            let cap = self.decode_capacity(geometry, policy);
            let bytes = DecodePath::required_bytes(geometry, cap).map_err(SimConfigError::Decode)?;
            if bytes > limit {
                let (seqs, context) = (cap.max_seqs, self.max_context);
                return Err(SimConfigError::DecodeBuffers { seqs, context, bytes, limit });
            }
        }
        Ok(())
    }

    /// Host memory a run of `engines` engines on pools of `spec` holds at its peak, with
    /// the pools' parts placed as `at` says: per engine the pool's host bookkeeping, the
    /// manager's per-block records ([`MANAGER_BYTES_PER_BLOCK`]), the decode index buffers
    /// and their host staging when the run builds them, the planes and host tier where they
    /// are host memory; plus [`BASE_BYTES`].
    pub fn memory_estimate(
        &self,
        spec: &PoolSpec,
        engines: usize,
        at: MemoryPlacement,
    ) -> Result<MemoryEstimate, SimError> {
        let g = &spec.geometry;
        let o = crate::pool::Overhead::estimate(spec, None)?;
        let blocks = g.max_blocks_beside(0).max(0) as u64;
        let mut per = o.host_bytes.saturating_add(blocks.saturating_mul(MANAGER_BYTES_PER_BLOCK));
        if self.build_index {
            // The elastic runs' capacity: at least the fixed split's.
            let cap = self.decode_capacity(g, RunKind::Elastic);
            let device = DecodePath::required_bytes(g, cap).map_err(SimConfigError::Decode)?;
            // Host staging (at most the buffers' size) and the engine's block-table copies.
            let tables =
                (cap.max_seqs as u64).saturating_mul(cap.max_blocks_per_seq as u64).saturating_mul(8);
            per = per.saturating_add(device).saturating_add(tables);
            if at.index_on_host {
                per = per.saturating_add(device);
            }
        }
        if at.planes_on_host {
            per = per.saturating_add(o.plane_bytes).saturating_add(o.indexer_bytes);
        }
        if at.tiers_committed {
            per = per.saturating_add(self.host_tier_bytes);
        }
        let total = per.saturating_mul(engines as u64).saturating_add(BASE_BYTES);
        Ok(MemoryEstimate { engines, per_engine: per, total })
    }

    /// [`Self::memory_estimate`] refused when it exceeds `available` bytes
    /// ([`SimConfigError::Memory`]).
    pub fn check_memory(
        &self,
        spec: &PoolSpec,
        engines: usize,
        at: MemoryPlacement,
        available: u64,
    ) -> Result<MemoryEstimate, SimError> {
        let e = self.memory_estimate(spec, engines, at)?;
        if e.total > available {
            let (per_engine, need) = (e.per_engine, e.total);
            return Err(SimConfigError::Memory { engines, per_engine, need, available }.into());
        }
        Ok(e)
    }
}
