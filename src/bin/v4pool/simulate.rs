//! `v4pool simulate`: parse the options, check them against the pool they describe (exit
//! status 2 before anything runs or prints), run [`v4pool::sim`] under each policy, render.

use crate::render::{render_table, to_json, to_svg};
use crate::{conclude, parse_args, CliError, ParsedArgs, Streams};
use std::io::Write as _;
use v4pool::backend::{BackendChoice, BackendKind, Stream};
use v4pool::pool::{Overhead, Pool, PoolSpec};
use v4pool::sim::{Engine, Mix, RunKind, SimConfig, SimReport};
use v4pool::sizing::{IndexerDtype, KvDtype, Plan, PlanRequest};

const HELP: &str = "\
usage: v4pool simulate [options]

Drives a pool through the request-level KV manager as a serving engine would (Poisson
arrivals, prefix hits, chunked prefill, a decode index build every step) on one workload:
the elastic boundary and a fixed split (both with v4pool's prefix reuse), beside two
baselines on the elastic split: no reuse, and reuse at 4,096-token granularity. Memory is
the budget plus at most a sixteenth of it for decode index buffers and a few MiB of host
bookkeeping; options that would need more are refused.

  --model NAME|PATH     v4-flash (default), v4-pro, v4.1-flash, …, or a config.json
  --spec-steps K        speculative steps (ring = window + K)            [0]
  --budget BYTES        pool budget, e.g. 8GiB                           [6GiB]
  --max-seqs N          running requests; the fixed split reserves N slots [48]
  --elastic-max-seqs N  running requests under the elastic boundary, at least
                        --max-seqs, at most the plane's slot positions
                                       [4 × max-seqs, at most the slot positions]
  --dtype fp8|bf16      KV planes                                        [fp8]
  --indexer fp8|fp4     indexer cache                                    [fp8]
  --mix chat|agentic|mixed|multiturn                                     [mixed]
  --rate R              mean arrivals per step, in (0, 1000]             [0.4]
  --steps N             forward steps, at most 10,000,000                [2000]
  --seed S                                                               [7]
  --prefill-chunk T     prefill tokens per step                          [8192]
  --max-context T       longest context                                  [1048576]
  --policy all|both|elastic|fixed|no_reuse|reuse_4096
                        all: the four runs; both: elastic and fixed      [all]
  --backend auto|host|cuda|hip   (auto honours V4POOL_BACKEND)           [auto]
  --svg FILE            memory by region over time, and the row space
  --json                the numbers as one JSON object
  --no-progress         no progress bar";

const OPTIONS: [&str; 18] = [
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
    policies: Vec<RunKind>,
    model: String,
    plan: Plan,
    spec: PoolSpec,
    choice: BackendChoice,
    /// The `--svg` file, already created, so a bad path is refused before the run.
    svg: Option<(String, std::fs::File)>,
    json: bool,
    progress: bool,
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
    let budget = v4pool::sizing::parse_bytes(p.get("--budget").unwrap_or("6GiB"))?;
    let kv = choose(&p, "--dtype", "fp8", &[("fp8", KvDtype::Fp8), ("bf16", KvDtype::Bf16)], "fp8 or bf16")?;
    let indexer = choose(
        &p,
        "--indexer",
        "fp8",
        &[("fp8", IndexerDtype::Fp8), ("fp4", IndexerDtype::Fp4)],
        "fp8 or fp4",
    )?;
    let mix = p.get("--mix").unwrap_or("mixed");
    let mix = Mix::parse(mix).ok_or_else(|| bad("--mix", mix, "chat, agentic, mixed or multiturn"))?;
    let rate = match p.get("--rate") {
        None => 0.4,
        Some(v) => v.trim().parse::<f64>().map_err(|_| bad("--rate", v, "a number"))?,
    };
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
    let max_seqs = count(&p, "--max-seqs", 48)?;
    let plan_seqs =
        i64::try_from(max_seqs).map_err(|_| bad("--max-seqs", &max_seqs.to_string(), "a count"))?;
    let plan = v4pool::sizing::plan(&model, &PlanRequest::new(kv, indexer, plan_seqs, budget))?;
    let spec = PoolSpec::from_plan(&plan)?;
    let positions = spec.geometry.slot_positions.max(0) as u64;
    let as_usize = |key: &str, v: u64| usize::try_from(v).map_err(|_| bad(key, &v.to_string(), "a count"));
    let cfg = SimConfig {
        mix,
        rate,
        steps: count(&p, "--steps", 2000)?,
        seed: count(&p, "--seed", 7)?,
        max_seqs: as_usize("--max-seqs", max_seqs)?,
        elastic_max_seqs: as_usize(
            "--elastic-max-seqs",
            count(&p, "--elastic-max-seqs", max_seqs.saturating_mul(4).min(positions).max(max_seqs))?,
        )?,
        prefill_chunk: count(&p, "--prefill-chunk", 8192)?,
        max_context: count(&p, "--max-context", 1 << 20)?,
        tokens_per_decode: 1 + model.spec_steps.max(0) as usize,
        ..SimConfig::default()
    };
    let o = Overhead::estimate(&spec, None)?;
    cfg.check(&spec.geometry, o.plane_bytes + o.indexer_bytes).map_err(v4pool::sim::SimError::from)?;
    let svg = match p.get("--svg") {
        None => None,
        Some(path) => Some((path.to_string(), create_svg(path)?)),
    };
    let progress = !json && !p.flag("--no-progress") && std::io::IsTerminal::is_terminal(&std::io::stderr());
    Ok(Some(Setup { cfg, policies, model: model.name, plan, spec, choice, svg, json, progress }))
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
    if !s.json {
        io.note(format_args!(
            "v4pool simulate: {} on {} ({}), budget {} B, plane {} rows, {} arrivals/step over {} steps ({} mix)\n",
            s.model,
            backend.kind(),
            backend.device_name(),
            s.plan.budget_bytes,
            s.plan.plane_rows,
            s.cfg.rate,
            s.cfg.steps,
            s.cfg.mix.name()
        ));
    }
    let mut reports = Vec::new();
    for &policy in &s.policies {
        let pool = std::sync::Arc::new(Pool::new(backend.clone(), s.spec.clone(), Stream::DEFAULT)?);
        reports.push(run_policy(&pool, &s.cfg, policy, s.progress, io)?);
    }
    if let Some((path, mut file)) = s.svg {
        file.write_all(to_svg(&reports).as_bytes())
            .and_then(|()| file.flush())
            .map_err(|e| CliError::Io { path, reason: e.to_string() })?;
    }
    if s.json {
        io.print(&to_json(&s.cfg, &reports).to_string())
    } else {
        io.print(&format!("{}\n{}", s.model, render_table(&reports).trim_end_matches('\n')))
    }
}

/// One run, with a progress bar on stderr when asked for.
fn run_policy(
    pool: &std::sync::Arc<Pool>,
    cfg: &SimConfig,
    policy: RunKind,
    progress: bool,
    io: &mut Streams<'_>,
) -> Result<SimReport, CliError> {
    let mut engine = Engine::new(pool, cfg, policy)?;
    let mut arrivals = cfg.workload();
    let every = (cfg.steps / 100).max(1);
    while !engine.done() {
        let step = engine.steps_done();
        engine.step(&mut arrivals)?;
        if progress && step % every == 0 {
            let pct = (step + 1) * 100 / cfg.steps.max(1);
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
