//! `v4pool simulate`: parse the options, check them against the pool they describe (exit
//! status 2 before anything runs or prints), run [`v4pool::sim`] under each policy, render.
//! In time (the default: `--cost` names a step-cost preset or a coefficient file) arrivals
//! are in seconds and the runs report TTFT, TPOT, end-to-end latency, throughput and
//! goodput; `--cost none` counts steps as before.

use crate::render::{render_table, to_json, to_svg};
use crate::{conclude, parse_args, CliError, ParsedArgs, Streams};
use std::io::Write as _;
use v4pool::backend::{BackendChoice, BackendKind};
use v4pool::pool::{Overhead, Pool, PoolSpec};
use v4pool::raw::sim::Engine;
use v4pool::sim::cost::CostError;
use v4pool::sim::fleet::{
    simulate_fleet_with_progress, FleetConfig, FleetProgress, FleetReport, FleetRun, Router,
};
use v4pool::sim::{
    MemoryPlacement, Mix, RequestSpec, RunKind, SimConfig, SimError, SimReport, StepCost, TimeConfig, Trace,
    TraceError, Workload,
};
use v4pool::sizing::{IndexerDtype, KvDtype, Plan, PlanRequest};

const HELP: &str = "\
usage: v4pool simulate [options]

Drives a pool through the request-level KV manager as a serving engine would (Poisson
arrivals or a Mooncake trace, prefix hits, chunked prefill, a decode index build every
step) on one workload: the elastic boundary and a fixed split sized the way SGLang sizes
DeepSeek-V4 (both with v4pool's prefix reuse), beside two baselines on the elastic split: no
reuse, and reuse at 4,096-token granularity; with --host-tier, also elastic with a host
tier. In time (default), a step costs what the step-cost model charges (see `v4pool
calibrate`) and the runs report TTFT, TPOT and end-to-end latency p50/p90/p99,
tok/s/GPU and goodput under a latency target. On the host the pools' planes and host tiers keep
no bytes (their copies are counted, not done): memory is the decode index buffers (at most
a sixteenth of the budget) and the bookkeeping; the estimate is printed first, and a run
that would not fit the machine's available memory is refused.

  --cost PRESET|FILE|none  h200x4-flash-fp8 (default), b200x4-flash-fp4, h200x8-pro-fp4,
                        h200x4-flash-fp8-low-latency, a JSON file of coefficients (the
                        form `v4pool calibrate --json` prints), or none: count steps
  --duration S          seconds of arrivals (time mode)                  [600]
  --horizon S           stop the clock here (time mode) [duration + 600; trace end + 3600]
  --trace FILE          replay a Mooncake JSONL trace with its arrivals (time mode)
  --trace-shard K/N     only conversations routed to shard K of N          [0/1]
  --trace-speed X       arrivals X times faster than recorded              [1]
  --concurrency N       closed loop: N requests in flight (a benchmark client)
  --slo-ttft MS / --slo-tpot MS   goodput's latency target          [2000 / 50]
  --host-tier BYTES     add the elastic run with a host tier of BYTES
                       [none; with --engines 64GiB, or 4/5 of a given --budget]
  --engines N           a fleet of N engines (each its own pool of --budget and host tier
                        of --host-tier) replaying the whole --trace: runs shared tier,
                        per-engine tiers only, no reuse; reports per engine and fleet.
                        Each engine defaults to a real engine's budget: 80GiB of KV in
                        HBM (a 4xH200 V4-Flash deployment keeps more than this after
                        its weights) and a 64GiB host tier; the planes and tiers keep
                        no bytes on the host, so 16 such engines need under a GiB
  --router affinity|round-robin   the fleet's router (affinity: from KV events) [affinity]
  --shared-tier BYTES   the fleet's shared tier                 [engines × budget]
  --fixed-slots sglang|N  the fixed split's slots: SGLang's DeepSeek-V4 default window
                        share (swa_full_tokens_ratio 0.1) of the budget, or N
                                       [sglang in time unless --max-seqs is given]

  --model NAME|PATH     v4-flash (default), v4-pro, v4.1-flash, …, or a config.json
  --spec-steps K        speculative steps (ring = window + K)            [0]
  --budget BYTES        pool budget, e.g. 8GiB         [6GiB; with --engines 80GiB]
  --max-seqs N          running requests under the fixed split (its slots)  [48]
  --elastic-max-seqs N  running requests under the elastic boundary, at least
                        --max-seqs, at most the plane's slot positions
                                       [4 × max-seqs, at most the slot positions]
  --dtype fp8|bf16|flashmla-v4|flashmla-v4-p2|flashmla-v41|flashmla-v41-fp4   KV rows
                        [the family's: fp8 for V4, flashmla-v41 for V4.1]
  --indexer fp8|fp4     indexer cache                                    [fp8]
  --mix chat|agentic|mixed|multiturn                                     [mixed]
  --rate R              mean arrivals per second (time) or per step      [0.5 / 0.4]
  --steps N             forward steps, at most 10,000,000     [2000; time: the cap]
  --seed S                                                               [7]
  --prefill-chunk T     prefill tokens per step                          [8192]
  --max-context T       longest context; agentic and mixed: at least 32769
                        (agentic prompts are 32768 tokens and up)        [1048576]
  --policy all|both|elastic|fixed|no_reuse|reuse_4096
                        all: the four runs; both: elastic and fixed      [all]
  --backend auto|host|cuda|hip   (auto honours V4POOL_BACKEND)           [auto]
  --svg FILE            latency CDFs beside memory by region over time, and the row space
  --json                the numbers as one JSON object
  --no-progress         no progress (it is shown only when stderr is a terminal)";

const OPTIONS: [&str; 32] = [
    "--engines",
    "--router",
    "--shared-tier",
    "--cost",
    "--duration",
    "--horizon",
    "--trace",
    "--trace-shard",
    "--trace-speed",
    "--concurrency",
    "--slo-ttft",
    "--slo-tpot",
    "--host-tier",
    "--fixed-slots",
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
];
const FLAGS: [&str; 3] = ["--json", "--no-progress", "--help"];

/// Everything a run needs, checked: nothing here can be refused once the run starts
/// except by the backend or the pool failing.
struct Setup {
    cfg: SimConfig,
    /// Where the arrivals come from.
    source: Source,
    policies: Vec<RunKind>,
    model: String,
    plan: Plan,
    spec: PoolSpec,
    choice: BackendChoice,
    /// The `--svg` file, already created, so a bad path is refused before the run.
    svg: Option<(String, std::fs::File)>,
    json: bool,
    progress: bool,
    /// `--engines`: a fleet run instead of one engine's.
    fleet: Option<FleetConfig>,
}

/// The arrivals every run replays.
enum Source {
    /// A mix's lazy stream, not yet drawn (each run replays a clone of it).
    Mix(v4pool::sim::Workload),
    /// A trace's requests, with the trace their hash ids come from.
    Trace(std::sync::Arc<Trace>, Vec<RequestSpec>),
}

/// `v4pool simulate` (arguments after the word `simulate`); returns the exit status.
pub(crate) fn run(args: &[String], io: &mut Streams<'_>) -> i32 {
    let json = args.iter().any(|a| a == "--json");
    let result = setup(args).and_then(|s| match s {
        None => io.print(HELP),
        Some(s) => execute(s, io),
    });
    conclude("v4pool simulate", result, json, io)
}

fn bad(flag: &str, value: &str, expected: &'static str) -> CliError {
    CliError::BadValue { flag: flag.to_string(), value: value.to_string(), expected }
}

/// A non-negative integer option (ranges are [`SimConfig::check`]'s).
fn count(p: &ParsedArgs, key: &str, default: u64) -> Result<u64, CliError> {
    match p.get(key) {
        None => Ok(default),
        Some(v) => v.trim().parse::<u64>().map_err(|_| bad(key, v, "a non-negative 64-bit integer")),
    }
}

fn choose<T: Copy>(
    p: &ParsedArgs,
    key: &str,
    default: &str,
    table: &[(&str, T)],
    expected: &'static str,
) -> Result<T, CliError> {
    let v = p.get(key).unwrap_or(default);
    table.iter().find(|(name, _)| *name == v).map(|(_, t)| *t).ok_or_else(|| bad(key, v, expected))
}

fn setup(args: &[String]) -> Result<Option<Setup>, CliError> {
    let p = parse_args(args, &OPTIONS, &FLAGS)?;
    if p.flag("--help") {
        return Ok(None);
    }
    let json = p.flag("--json");
    let model = crate::layout::load_model(p.get("--model").unwrap_or("v4-flash"), &p)?;
    // A fleet is for deployments: its engines default to a real engine's KV budget (the
    // planes keep no bytes on the host, so this costs metadata only). One engine keeps the
    // small default its tables were measured at, where the layouts differ under pressure.
    let in_fleet = p.get("--engines").is_some();
    let budget = v4pool::sizing::parse_bytes(p.get("--budget").unwrap_or(if in_fleet {
        FLEET_BUDGET
    } else {
        "6GiB"
    }))?;
    // A fleet engine's host tier keeps the real engine's proportion to its budget (64 GiB to
    // 80 GiB) when only --budget is given.
    let tier_default = in_fleet.then(|| budget / FLEET_TIER_OF_BUDGET.1 * FLEET_TIER_OF_BUDGET.0);
    // The family's rows, as `plan` takes them (KvDtype::default_for).
    let kv = crate::kv_dtype(&p)?.unwrap_or(KvDtype::default_for(model.family));
    let indexer = choose(
        &p,
        "--indexer",
        "fp8",
        &[("fp8", IndexerDtype::Fp8), ("fp4", IndexerDtype::Fp4)],
        "fp8 or fp4",
    )?;
    let mix = p.get("--mix").unwrap_or("mixed");
    let mix = Mix::parse(mix).ok_or_else(|| bad("--mix", mix, "chat, agentic, mixed or multiturn"))?;
    let cost = match p.get("--cost").unwrap_or(v4pool::sim::cost::H200X4_FLASH_FP8) {
        "none" => None,
        // Anything that exists is a file to read (a FIFO or a device is refused by the reader).
        v if std::path::Path::new(v).exists() => {
            Some(StepCost::from_path(std::path::Path::new(v)).map_err(|e| match e {
                CostError::File(f) => CliError::File(f),
                e => CliError::Io { path: v.into(), reason: e.to_string() },
            })?)
        }
        v => Some(v4pool::sim::cost::preset(v).map_err(|_| bad("--cost", v, COST_EXPECTED))?),
    };
    let in_time = cost.is_some();
    let number = |key: &str, default: f64| -> Result<f64, CliError> {
        match p.get(key) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(bad(key, v, "a finite positive number")),
            },
        }
    };
    let rate = number("--rate", if in_time { 0.5 } else { 0.4 })?;
    if !in_time {
        for key in ["--trace", "--duration", "--horizon", "--concurrency", "--slo-ttft", "--slo-tpot"] {
            if p.get(key).is_some() {
                return Err(CliError::Conflict { a: "--cost none", b: "a time-mode option" });
            }
        }
    }
    let policies = choose(
        &p,
        "--policy",
        "all",
        &[
            ("all", &RunKind::ALL[..]),
            ("both", &[RunKind::Elastic, RunKind::Fixed][..]),
            ("elastic", &[RunKind::Elastic][..]),
            ("fixed", &[RunKind::Fixed][..]),
            ("no_reuse", &[RunKind::NoReuse][..]),
            ("reuse_4096", &[RunKind::Reuse4096][..]),
        ],
        "all, both, elastic, fixed, no_reuse or reuse_4096",
    )?
    .to_vec();
    let choice = match p.get("--backend").unwrap_or("auto") {
        "auto" => BackendChoice::Auto,
        v => BackendChoice::Exactly(
            BackendKind::parse(v).map_err(|_| bad("--backend", v, "auto, host, cuda or hip"))?,
        ),
    };
    let mut max_seqs = count(&p, "--max-seqs", 48)?;
    let plan_seqs =
        i64::try_from(max_seqs).map_err(|_| bad("--max-seqs", &max_seqs.to_string(), "a count"))?;
    let plan = v4pool::sizing::plan(&model, &PlanRequest::new(kv, indexer, plan_seqs, budget))?;
    let spec = PoolSpec::from_plan(&plan)?;
    let positions = spec.geometry.slot_positions.max(0) as u64;
    // The fixed split: in time, SGLang's sizing unless a count is given.
    match p.get("--fixed-slots") {
        Some("sglang") => max_seqs = v4pool::sim::sglang_fixed_slots(&plan, v4pool::sim::SGLANG_SWA_RATIO),
        Some(v) => {
            max_seqs = v.trim().parse::<u64>().map_err(|_| bad("--fixed-slots", v, "sglang or a count"))?
        }
        // An explicit --max-seqs keeps its meaning in time too.
        None if in_time && p.get("--max-seqs").is_none() => {
            max_seqs = v4pool::sim::sglang_fixed_slots(&plan, v4pool::sim::SGLANG_SWA_RATIO)
        }
        None => {}
    }
    if p.get("--fixed-slots").is_some() && p.get("--max-seqs").is_some() {
        return Err(CliError::Conflict { a: "--fixed-slots", b: "--max-seqs" });
    }
    let as_usize = |key: &str, v: u64| usize::try_from(v).map_err(|_| bad(key, &v.to_string(), "a count"));
    let seed = count(&p, "--seed", 7)?;
    let max_context = count(&p, "--max-context", 1 << 20)?;
    let elastic_default = max_seqs.saturating_mul(4).min(positions).max(max_seqs);
    // A host tier holds at least one block and at most 16 budgets (host memory the run
    // allocates: a bound, not a clamp).
    let host_tier_bytes =
        match (p.get("--host-tier"), tier_default) {
            (None, None) => 0,
            (None, Some(b)) if b >= plan.page_bytes => b,
            (None, Some(_)) => return Err(bad(
                "--budget",
                p.get("--budget").unwrap_or(""),
                "bytes whose four fifths (the fleet's default host tier) hold a block; or give --host-tier",
            )),
            (Some(v), _) => match v4pool::sizing::parse_bytes(v) {
                Ok(b) if b >= plan.page_bytes && b <= budget.saturating_mul(16) => b,
                _ => return Err(bad("--host-tier", v, "bytes from one block's page to 16 times --budget")),
            },
        };
    let mut policies = policies;
    if host_tier_bytes > 0 && p.get("--policy").is_none() {
        policies.push(RunKind::ElasticTier);
    }
    let (source, time, steps) = match cost {
        None => {
            let steps = count(&p, "--steps", 2000)?;
            let wc = v4pool::sim::WorkloadConfig::new(mix, rate, steps, seed, max_context);
            (Source::Mix(Workload::new(wc).map_err(SimError::from)?), None, steps)
        }
        Some(cost) => {
            let (source, end_s) = match p.get("--trace") {
                None => {
                    let duration = number("--duration", 600.0)?;
                    // One arrival tick per ms: the rate per tick is the rate per second / 1000.
                    let wc = v4pool::sim::WorkloadConfig::new(
                        mix,
                        rate / 1000.0,
                        (duration * 1000.0) as u64,
                        seed,
                        max_context,
                    );
                    (Source::Mix(Workload::new(wc).map_err(SimError::from)?), duration + 600.0)
                }
                Some(path) => {
                    let trace = Trace::from_path(std::path::Path::new(path)).map_err(|e| match e {
                        TraceError::File(f) => CliError::File(f),
                        e => CliError::Io { path: path.into(), reason: e.to_string() },
                    })?;
                    let v = p.get("--trace-shard").unwrap_or("0/1");
                    let (k, n) = shard(v)?;
                    let trace = trace.shard(k, n).map_err(|_| bad("--trace-shard", v, "K/N with K < N"))?;
                    let trace = std::sync::Arc::new(trace);
                    let speed = number("--trace-speed", 1.0)?;
                    let specs = trace
                        .specs(speed)
                        .map_err(|_| bad("--trace-speed", "", "a finite positive number"))?;
                    let last = specs.last().map_or(0, |r| r.arrival) as f64 / 1000.0;
                    (Source::Trace(trace, specs), last + 3600.0)
                }
            };
            let concurrency = match p.get("--concurrency") {
                None => None,
                Some(v) => Some(as_usize(
                    "--concurrency",
                    v.trim().parse::<u64>().map_err(|_| bad("--concurrency", v, "a count"))?,
                )?),
            };
            let time = TimeConfig::new(cost, number("--horizon", end_s)? * 1000.0)
                .with_concurrency(concurrency)
                .with_slo_ttft_ms(number("--slo-ttft", v4pool::sim::SLO_TTFT_MS)?)
                .with_slo_tpot_ms(number("--slo-tpot", v4pool::sim::SLO_TPOT_MS)?);
            (source, Some(time), count(&p, "--steps", v4pool::sim::MAX_STEPS)?)
        }
    };
    let mut cfg = SimConfig::default()
        .with_mix(mix)
        .with_rate(if in_time { rate / 1000.0 } else { rate })
        .with_steps(steps)
        .with_seed(seed)
        .with_max_seqs(as_usize("--max-seqs", max_seqs)?)
        .with_elastic_max_seqs(as_usize(
            "--elastic-max-seqs",
            count(&p, "--elastic-max-seqs", elastic_default)?,
        )?)
        .with_prefill_chunk(count(&p, "--prefill-chunk", 8192)?)
        .with_max_context(max_context)
        .with_tokens_per_decode(1 + model.spec_steps.max(0) as usize)
        .with_host_tier_bytes(host_tier_bytes);
    cfg.time = time;
    let fleet = match p.get("--engines") {
        None => None,
        Some(v) => {
            let engines = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| (1..=v4pool::sim::fleet::MAX_ENGINES).contains(&n));
            let engines = engines.ok_or_else(|| bad("--engines", v, "a count from 1 to 256"))?;
            if p.get("--trace").is_none() || cfg.time.is_none() {
                return Err(bad("--engines", v, "a fleet replays a --trace in time"));
            }
            let r = p.get("--router").unwrap_or("affinity");
            let router = Router::parse(r).ok_or_else(|| bad("--router", r, "affinity or round-robin"))?;
            let shared_tier_bytes = match p.get("--shared-tier") {
                None => budget.saturating_mul(engines as u64),
                Some(v) => v4pool::sizing::parse_bytes(v)
                    .ok()
                    .filter(|&b| b >= plan.page_bytes)
                    .ok_or_else(|| bad("--shared-tier", v, "bytes, at least one block's page"))?,
            };
            Some(FleetConfig::new(engines, router, shared_tier_bytes))
        }
    };
    if fleet.is_none() {
        for key in ["--router", "--shared-tier"] {
            if p.get(key).is_some() {
                return Err(bad(key, p.get(key).unwrap_or(""), "a fleet option: give --engines"));
            }
        }
    }
    // A fleet charges modeled time only: the decode index build's wall time is what the
    // single-engine runs check, and building for every engine's every step would only slow
    // the replay.
    let cfg = cfg.with_build_index(fleet.is_none());
    let o = Overhead::estimate(&spec, None)?;
    cfg.check(&spec.geometry, o.plane_bytes + o.indexer_bytes).map_err(SimError::from)?;
    let svg = match p.get("--svg") {
        None => None,
        Some(path) => Some((path.to_string(), create_svg(path)?)),
    };
    let progress = !json && !p.flag("--no-progress") && std::io::IsTerminal::is_terminal(&std::io::stderr());
    Ok(Some(Setup {
        cfg,
        source,
        policies,
        model: model.name,
        plan,
        spec,
        choice,
        svg,
        json,
        progress,
        fleet,
    }))
}

/// A fleet engine's default KV budget in HBM: issue 45's "real per-engine budget". The cost
/// preset's deployment is 4×H200 (4 × 141 GB of HBM); V4-Flash's 284 B parameters take at most
/// 284 GB at one byte each, so even with a tenth held back for activations and graphs more
/// than 220 GB stay for KV: 80 GiB is a conservative engine, inside the 60–120 GiB range the
/// issue names for the deployments a fleet simulation is for.
const FLEET_BUDGET: &str = "80GiB";
/// A fleet engine's default host tier: 64 GiB of the host's DRAM per engine (an 8-GPU H200
/// node carries 1–2 TiB; two 4-GPU engines per node leave most of it to the system).
/// So its default is 64 GiB beside the default budget, and four fifths of a given `--budget`.
const FLEET_TIER_OF_BUDGET: (u64, u64) = (4, 5);

const COST_EXPECTED: &str = "a preset (h200x4-flash-fp8, h200x4-flash-fp8-low-latency, b200x4-flash-fp4, \
h200x8-pro-fp4), a JSON file of coefficients, or none";

/// `K/N` with K < N (checked by the trace).
fn shard(v: &str) -> Result<(u64, u64), CliError> {
    let e = || bad("--trace-shard", v, "K/N");
    let (k, n) = v.split_once('/').ok_or_else(e)?;
    Ok((k.trim().parse().map_err(|_| e())?, n.trim().parse().map_err(|_| e())?))
}

/// Create the `--svg` file before the run, so a bad path is refused up front. A FIFO is
/// refused too: opening one for writing would wait for a reader.
fn create_svg(path: &str) -> Result<std::fs::File, CliError> {
    use std::os::unix::fs::FileTypeExt as _;
    let io = |reason: String| CliError::Io { path: path.to_string(), reason };
    if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) {
        return Err(io("a FIFO, not a file".into()));
    }
    std::fs::File::create(path).map_err(|e| io(e.to_string()))
}

fn execute(s: Setup, io: &mut Streams<'_>) -> Result<(), CliError> {
    let backend = v4pool::backend::select(s.choice)?;
    // The simulator needs a pool's accounting, not its planes' bytes: on the host, the
    // accounting mode keeps the planes, indexer cache and host tiers as address ranges only.
    let on_host = backend.kind() == BackendKind::Host;
    let backend: std::sync::Arc<dyn v4pool::backend::Backend> =
        if on_host { std::sync::Arc::new(v4pool::backend::host::HostBackend::accounting()) } else { backend };
    // Refuse up front what would not fit this machine's memory (rather than be killed midway).
    let at = MemoryPlacement::default()
        .with_planes_on_host(false)
        .with_index_on_host(on_host)
        .with_tiers_committed(!on_host);
    let engines = s.fleet.as_ref().map_or(1, |f| f.engines);
    let estimate = match v4pool::raw::sim::available_memory() {
        Some(available) => s.cfg.check_memory(&s.spec, engines, at, available)?,
        None => s.cfg.memory_estimate(&s.spec, engines, at)?,
    };
    let workload = match &s.source {
        Source::Trace(t, specs) => {
            let (hit, all) = t.ceiling();
            format!(
                "trace of {} requests, ceiling {hit}/{all} = {:.3} of 512-token blocks",
                specs.len(),
                hit as f64 / all.max(1) as f64
            )
        }
        Source::Mix(w) => match (&s.cfg.time, w.config()) {
            (Some(_), wc) => format!(
                "{} arrivals/s over {:.0} s ({} mix)",
                wc.rate * 1000.0,
                wc.steps as f64 / 1000.0,
                wc.mix.name()
            ),
            (None, wc) => {
                format!("{} arrivals/step over {} steps ({} mix)", wc.rate, wc.steps, wc.mix.name())
            }
        },
    };
    let cost = s.cfg.time.as_ref().map_or("steps".to_string(), |t| format!("in time ({})", t.cost.name));
    if !s.json {
        io.note(format_args!(
            "v4pool simulate: {} on {} ({}), budget {} B, plane {} rows, fixed split {} slots, {workload}, {cost}\n",
            s.model,
            backend.kind(),
            backend.device_name(),
            s.plan.budget_bytes,
            s.plan.plane_rows,
            s.cfg.max_seqs,
        ));
    }
    if !s.json {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        io.note(format_args!(
            "  host memory: about {:.2} GiB at the peak ({engines} engine(s) × {:.2} GiB; {})\n",
            gib(estimate.total),
            gib(estimate.per_engine),
            if on_host {
                "planes, indexer and host tiers kept without bytes"
            } else {
                "planes and indexer on the device, host tiers pinned"
            },
        ));
    }
    if let (Some(fleet), Source::Trace(trace, specs)) = (&s.fleet, &s.source) {
        if !s.json {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            io.note(format_args!(
                "  fleet: {} engines × ({:.1} GiB pool + {:.1} GiB host tier), shared tier {:.1} GiB, {} router\n",
                fleet.engines,
                gib(s.plan.budget_bytes),
                gib(s.cfg.host_tier_bytes),
                gib(fleet.shared_tier_bytes),
                fleet.router.name(),
            ));
        }
        let mut reports = Vec::new();
        for run in FleetRun::ALL {
            let started = std::time::Instant::now();
            let mut shown: Option<std::time::Instant> = None;
            let mut show = |at: &FleetProgress| {
                // At most four lines a second: the callback comes after every engine step.
                if !s.progress || shown.is_some_and(|t| t.elapsed() < std::time::Duration::from_millis(250)) {
                    return;
                }
                shown = Some(std::time::Instant::now());
                io.note(format_args!("\r{}", fleet_progress_line(run, fleet.engines, at, started.elapsed())));
            };
            let report =
                simulate_fleet_with_progress(&backend, &s.spec, &s.cfg, fleet, run, trace, specs, &mut show)?;
            if s.progress {
                io.note(format_args!("\n"));
            }
            reports.push(report);
        }
        return if s.json {
            io.print(&fleet_json(&reports).to_string())
        } else {
            io.print(&format!("{}\n{}", s.model, fleet_table(&reports)))
        };
    }
    let mut reports = Vec::new();
    for &policy in &s.policies {
        let pool = v4pool::raw::sim::sim_pool(&backend, &s.spec)?;
        reports.push(run_policy(&pool, &s, policy, io)?);
    }
    if let Some((path, mut file)) = s.svg {
        file.write_all(to_svg(&reports).as_bytes())
            .and_then(|()| file.flush())
            .map_err(|e| CliError::Io { path, reason: e.to_string() })?;
    }
    let ceiling = match &s.source {
        Source::Trace(t, _) => Some(t.ceiling()),
        Source::Mix(_) => None,
    };
    if s.json {
        io.print(&to_json(&s.cfg, &reports, ceiling).to_string())
    } else {
        io.print(&format!("{}\n{}", s.model, render_table(&reports).trim_end_matches('\n')))
    }
}

/// One run, with a progress bar on stderr when asked for.
fn run_policy(
    pool: &std::sync::Arc<Pool>,
    s: &Setup,
    policy: RunKind,
    io: &mut Streams<'_>,
) -> Result<SimReport, CliError> {
    let (cfg, progress) = (&s.cfg, s.progress);
    let mut engine = Engine::new(pool, cfg, policy)?;
    let mut arrivals: Box<dyn Iterator<Item = RequestSpec>> = match &s.source {
        Source::Mix(w) => Box::new(w.clone()),
        Source::Trace(t, specs) => {
            engine = engine.with_trace(t.clone());
            Box::new(specs.clone().into_iter())
        }
    };
    let every = (cfg.steps / 100).max(1);
    let horizon = cfg.time.as_ref().map(|t| t.horizon_ms);
    let mut shown = u64::MAX;
    while !engine.done() {
        let step = engine.steps_done();
        engine.step(&mut arrivals)?;
        let pct = match horizon {
            Some(h) => (engine.clock_ms() * 100.0 / h).min(100.0) as u64,
            None => (step + 1) * 100 / cfg.steps.max(1),
        };
        if progress && (horizon.is_some() && pct != shown || horizon.is_none() && step % every == 0) {
            shown = pct;
            io.note(format_args!(
                "\r  {:<8} [{:<40}] {:>3}%  running {:>4}  waiting {:>5}",
                policy.name(),
                "=".repeat((pct * 40 / 100) as usize),
                pct,
                engine.running(),
                engine.waiting()
            ));
        }
    }
    if progress {
        io.note(format_args!("\n"));
    }
    Ok(engine.finish()?)
}

/// One progress line of a fleet run (no newline: it is redrawn in place).
fn fleet_progress_line(
    run: FleetRun,
    engines: usize,
    at: &FleetProgress,
    wall: std::time::Duration,
) -> String {
    // Routed requests, not the clock, measure the way: after the last arrival the engines
    // drain their queues and stop well before the horizon (the trace's end plus an hour).
    let pct = at.routed * 100 / at.requests.max(1);
    format!(
        "  {:<10} {engines} engines  routed {:>6}/{} ({pct:>3}%)  clock {:>6.0} s  {:>9} steps  {:>4.0} s wall",
        run.name(),
        at.routed,
        at.requests,
        at.clock_ms / 1000.0,
        at.steps,
        wall.as_secs_f64(),
    )
}

/// The fleet runs as a table (the fleet's figures), then each run's engines.
fn fleet_table(reports: &[FleetReport]) -> String {
    let mut out = String::from(
        "| run | router | TTFT p50 / p90 / p99 ms | TPOT p50 ms | tok/s/GPU | prompt tokens from cache | of the ceiling | restored GiB |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        out += &format!(
            "| {} | {} | {:.1} / {:.1} / {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.2} |\n",
            r.run.name(),
            r.router.name(),
            r.ttft_ms.quantile(0.5),
            r.ttft_ms.quantile(0.9),
            r.ttft_ms.quantile(0.99),
            r.tpot_ms.quantile(0.5),
            r.tok_s_gpu,
            r.from_cache,
            r.of_ceiling(),
            r.restored_bytes as f64 / (1u64 << 30) as f64,
        );
    }
    for r in reports {
        out += &format!("\n{} (ceiling {:.3}): per engine\n", r.run.name(), r.ceiling);
        out += "| engine | requests | TTFT p50 / p99 ms | prompt tokens from cache | of the ceiling |\n|---:|---:|---:|---:|---:|\n";
        for (k, e) in r.engines.iter().enumerate() {
            let (p50, p99) =
                e.time.as_ref().map_or((0.0, 0.0), |t| (t.ttft_ms.quantile(0.5), t.ttft_ms.quantile(0.99)));
            let cache = e.prefix_hit_tokens as f64 / e.input_tokens.max(1) as f64;
            let of = if r.ceiling > 0.0 { cache / r.ceiling } else { 0.0 };
            out += &format!("| {k} | {} | {p50:.1} / {p99:.1} | {cache:.3} | {of:.3} |\n", r.routed[k]);
        }
    }
    out
}

fn fleet_json(reports: &[FleetReport]) -> serde_json::Value {
    let runs: Vec<serde_json::Value> = reports
        .iter()
        .map(|r| {
            let engines: Vec<serde_json::Value> = r
                .engines
                .iter()
                .enumerate()
                .map(|(k, e)| {
                    let t = e.time.as_ref();
                    serde_json::json!({
                        "engine": k,
                        "routed": r.routed[k],
                        "completed": e.completed,
                        "input_tokens": e.input_tokens,
                        "prefix_hit_tokens": e.prefix_hit_tokens,
                        "ttft_ms_p50": t.map_or(0.0, |t| t.ttft_ms.quantile(0.5)),
                        "ttft_ms_p99": t.map_or(0.0, |t| t.ttft_ms.quantile(0.99)),
                        "tpot_ms_p50": t.map_or(0.0, |t| t.tpot_ms.quantile(0.5)),
                        "restored_bytes": t.map_or(0, |t| t.restored_bytes),
                    })
                })
                .collect();
            serde_json::json!({
                "run": r.run.name(),
                "router": r.router.name(),
                "ttft_ms": [r.ttft_ms.quantile(0.5), r.ttft_ms.quantile(0.9), r.ttft_ms.quantile(0.99)],
                "ttft_censored": r.ttft_censored,
                "tpot_ms_p50": r.tpot_ms.quantile(0.5),
                "tok_s_gpu": r.tok_s_gpu,
                "from_cache": r.from_cache,
                "ceiling": r.ceiling,
                "of_ceiling": r.of_ceiling(),
                "restored_bytes": r.restored_bytes,
                "engines": engines,
            })
        })
        .collect();
    serde_json::json!({ "fleet": runs })
}
