//! `v4pool calibrate`: fit the step-cost model of every preset (or one) to the published
//! cells and print the coefficients, each equation's residual (fitted or held out), and —
//! unless `--no-replay` — every cell's benchmark replayed through the engine on the fixed
//! split beside the published TTFT, TPOT and tok/s/GPU. `--json` gives all of it, with the
//! coefficients in the form `simulate --cost FILE` reads.

use crate::{conclude, parse_args, CliError, Streams};
use std::fmt::Write as _;
use v4pool::backend::BackendChoice;
use v4pool::raw::sim::bench;
use v4pool::sim::cost::{self, Figure, Fit, StepCost, CELLS};
use v4pool::sim::{SimError, TimeReport};

const HELP: &str = "\
usage: v4pool calibrate [--preset NAME] [--no-replay] [--json]

Fits T(P, B, C) = base + per_seq·B + per_kv_token·C + per_prefill_token·P·(1 + prefill_ctx·Cp)
to published serving cells (SGLang's DeepSeek-V4 benchmark table) by least squares, prints
the coefficients (fitted, or derived from the roofline), every cell's equation with its
residual, which cells were fitted and which held out, and each cell's benchmark replayed
through the engine (fixed split, closed-loop client, the host backend).

  --preset NAME   h200x4-flash-fp8, b200x4-flash-fp4 or h200x8-pro-fp4 [all]
  --no-replay     skip the replays (the fit alone)
  --json          one JSON object";

/// `v4pool calibrate` (arguments after the word); returns the exit status.
pub(crate) fn run(args: &[String], io: &mut Streams<'_>) -> i32 {
    let json = args.iter().any(|a| a == "--json");
    conclude("v4pool calibrate", execute(args, io), json, io)
}

fn execute(args: &[String], io: &mut Streams<'_>) -> Result<(), CliError> {
    let p = parse_args(args, &["--preset"], &["--json", "--no-replay", "--help"])?;
    if p.flag("--help") {
        return io.print(HELP);
    }
    let mut presets = cost::presets();
    if let Some(name) = p.get("--preset") {
        presets.retain(|q| q.name == name);
        if presets.is_empty() {
            return Err(CliError::BadValue {
                flag: "--preset".into(),
                value: name.into(),
                expected: "h200x4-flash-fp8, b200x4-flash-fp4 or h200x8-pro-fp4",
            });
        }
    }
    let backend = if p.flag("--no-replay") {
        None
    } else {
        Some(v4pool::backend::select(BackendChoice::Exactly(v4pool::backend::BackendKind::Host))?)
    };
    let mut out = Vec::new();
    for preset in &presets {
        let fit = cost::fit(preset).map_err(SimError::from)?;
        let mut replays = Vec::new();
        if let Some(b) = &backend {
            for u in preset.uses.iter().filter(|u| u.figure == Figure::Tpot) {
                let c = if u.group == 0 { &fit.cost } else { fit.second.as_ref().unwrap_or(&fit.cost) };
                let r = bench::replay(b.clone(), &CELLS[u.cell], c.clone())?;
                replays.push((u.cell, r.time.unwrap_or_default()));
            }
        }
        out.push((fit, replays));
    }
    if p.flag("--json") {
        io.print(&to_json(&out).to_string())
    } else {
        io.print(render(&out).trim_end())
    }
}

type Replay = (usize, TimeReport);

fn role(fitted: bool) -> &'static str {
    if fitted {
        "fitted"
    } else {
        "held out"
    }
}

fn coefficients(s: &mut String, c: &StepCost) {
    let _ = writeln!(
        s,
        "  {}: base {:.3} ms + {:.4} ms/seq (fitted) + {:.3e} ms/context token (roofline) + {:.5} ms/prefill token (fitted) × (1 + {:.3e}·context) (derived); host {:.0} GB/s (assumed); {} GPUs",
        c.name, c.base_ms, c.per_seq_ms, c.per_kv_token_ms, c.per_prefill_token_ms, c.prefill_ctx, c.host_gbps, c.gpus
    );
}

fn render(out: &[(Fit, Vec<Replay>)]) -> String {
    let mut s = String::new();
    for (fit, replays) in out {
        let _ = writeln!(s, "{}", fit.preset.name);
        coefficients(&mut s, &fit.cost);
        if let Some(c) = &fit.second {
            coefficients(&mut s, c);
        }
        let _ = writeln!(
            s,
            "  {:<16} {:>5} {:>5} {:>9} {:>12} {:>12} {:>9}",
            "strategy", "conc", "fig", "role", "published ms", "model ms", "residual"
        );
        for (u, published, model) in &fit.equations {
            let c = &CELLS[u.cell];
            let fig = if u.figure == Figure::Tpot { "TPOT" } else { "TTFT" };
            let _ = writeln!(
                s,
                "  {:<16} {:>5} {:>5} {:>9} {:>12.2} {:>12.2} {:>8.1}%",
                c.strategy,
                c.concurrency,
                fig,
                role(u.fitted),
                published,
                model,
                100.0 * (model / published - 1.0)
            );
        }
        if !replays.is_empty() {
            let _ =
                writeln!(s, "  replayed (fixed split, closed loop; TTFT at high concurrency is queueing):");
            let _ = writeln!(
                s,
                "  {:<16} {:>5} {:>9} {:>22} {:>22} {:>22}",
                "strategy", "conc", "TPOT", "TPOT ms sim / pub", "tok/s/GPU sim / pub", "TTFT ms sim / pub"
            );
            for (i, t) in replays {
                let c = &CELLS[*i];
                let fitted =
                    fit.preset.uses.iter().any(|u| u.cell == *i && u.figure == Figure::Tpot && u.fitted);
                let _ = writeln!(
                    s,
                    "  {:<16} {:>5} {:>9} {:>22} {:>22} {:>22}",
                    c.strategy,
                    c.concurrency,
                    role(fitted),
                    format!(
                        "{:.2} / {:.2} ({:+.1}%)",
                        t.tpot_ms.quantile(0.5),
                        c.tpot_ms,
                        100.0 * (t.tpot_ms.quantile(0.5) / c.tpot_ms - 1.0)
                    ),
                    format!(
                        "{:.0} / {:.0} ({:+.1}%)",
                        t.tok_s_gpu,
                        c.tok_s_gpu,
                        100.0 * (t.tok_s_gpu / c.tok_s_gpu - 1.0)
                    ),
                    format!("{:.0} / {:.0}", t.ttft_ms.quantile(0.5), c.ttft_ms),
                );
            }
        }
    }
    s
}

fn to_json(out: &[(Fit, Vec<Replay>)]) -> serde_json::Value {
    use serde_json::json;
    let presets: Vec<serde_json::Value> = out
        .iter()
        .map(|(fit, replays)| {
            let eq: Vec<serde_json::Value> = fit
                .equations
                .iter()
                .map(|(u, published, model)| {
                    let c = &CELLS[u.cell];
                    json!({"strategy": c.strategy, "concurrency": c.concurrency,
                           "figure": if u.figure == Figure::Tpot { "tpot" } else { "ttft" },
                           "fitted": u.fitted, "published_ms": published, "model_ms": model,
                           "residual": model / published - 1.0})
                })
                .collect();
            let rep: Vec<serde_json::Value> = replays
                .iter()
                .map(|(i, t)| {
                    let c = &CELLS[*i];
                    let (p50, p90, p99) = TimeReport::percentiles(&t.ttft_ms);
                    json!({"strategy": c.strategy, "concurrency": c.concurrency,
                           "tpot_ms": t.tpot_ms.quantile(0.5), "published_tpot_ms": c.tpot_ms,
                           "tok_s_gpu": t.tok_s_gpu, "published_tok_s_gpu": c.tok_s_gpu,
                           "ttft_ms": {"p50": p50, "p90": p90, "p99": p99}, "published_ttft_ms": c.ttft_ms})
                })
                .collect();
            json!({"preset": fit.preset.name, "cost": fit.cost.to_json(),
                   "second": fit.second.as_ref().map(StepCost::to_json),
                   "equations": eq, "replays": rep})
        })
        .collect();
    json!({"source": "sgl-project/sglang docs/src/snippets/configs/deepseek-ai/deepseek-v4-benchmarks.jsx @03f4c00a",
           "presets": presets})
}
