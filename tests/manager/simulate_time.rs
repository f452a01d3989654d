//! `simulate` in time: the step-cost model fitted to the published cells, the calibration
//! benchmark replayed through the engine on the fixed split and compared with the published
//! figures (computed here, never hard-coded), the latency figures' bookkeeping, and the
//! Mooncake trace (a synthetic snippet here; the real trace when `V4POOL_TRACE` names it).

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::raw::sim::bench;
use v4pool::sim::cost::{self, Figure, CELLS, H200X4_FLASH_FP8};
use v4pool::sim::{simulate, RequestSpec, RunKind, SimConfig, TimeConfig, Trace};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

/// The published 4×H200 V4-Flash FP8 cells the validation must meet (±15 %), as
/// (concurrency, TPOT ms, tok/s/GPU). Source: sgl-project/sglang
/// `docs/src/snippets/configs/deepseek-ai/deepseek-v4-benchmarks.jsx` @03f4c00a, via
/// `shared/spec/serving-calibration.md`. Kept apart from `cost::CELLS` on purpose: the
/// test compares the simulator against this table, not against the fit's own input.
const PUBLISHED: [(u32, f64, f64); 3] = [(64, 40.6, 3156.0), (256, 89.8, 3226.0), (1024, 146.95, 3975.0)];

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

#[test]
fn the_fixed_split_reproduces_the_published_h200_cells() {
    let preset = cost::presets().into_iter().find(|p| p.name == H200X4_FLASH_FP8).unwrap();
    let fit = cost::fit(&preset).unwrap();
    println!("cost {:?}", fit.cost);
    println!(
        "{:>6} {:>9} {:>10} {:>10} {:>8} {:>12} {:>12} {:>8}",
        "conc", "role", "TPOT sim", "TPOT pub", "err", "tok/s/GPU", "published", "err"
    );
    for (conc, tpot, thr) in PUBLISHED {
        let (i, cell) = CELLS
            .iter()
            .enumerate()
            .find(|(_, c)| c.preset == H200X4_FLASH_FP8 && c.concurrency == conc)
            .unwrap();
        let role = match preset.uses.iter().find(|u| u.cell == i && u.figure == Figure::Tpot) {
            Some(u) if u.fitted => "fitted",
            _ => "held out",
        };
        let r = bench::replay(host(), cell, fit.cost.clone()).unwrap();
        let t = r.time.as_ref().unwrap();
        assert_eq!(r.completed, cell.prompts, "c={conc}: the replay did not drain");
        let sim_tpot = t.tpot_ms.quantile(0.5);
        let (e_tpot, e_thr) = (sim_tpot / tpot - 1.0, t.tok_s_gpu / thr - 1.0);
        println!(
            "{conc:>6} {role:>9} {sim_tpot:>10.2} {tpot:>10.2} {:>7.1}% {:>12.0} {thr:>12.0} {:>7.1}%  (TTFT p50 {:.0} ms, published {:.0})",
            100.0 * e_tpot,
            t.tok_s_gpu,
            100.0 * e_thr,
            t.ttft_ms.quantile(0.5),
            cell.ttft_ms
        );
        assert!(e_tpot.abs() <= 0.15, "c={conc} ({role}): TPOT {sim_tpot:.2} vs published {tpot}");
        assert!(e_thr.abs() <= 0.15, "c={conc} ({role}): {:.0} tok/s/GPU vs published {thr}", t.tok_s_gpu);
    }
}

fn pool(budget: u64, seqs: i64) -> Arc<Pool> {
    let model = ModelShape::v4_flash(0).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget)).unwrap();
    Arc::new(Pool::new(host(), PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap())
}

/// Round coefficients, so every latency below is known by hand.
fn toy_cost() -> v4pool::sim::StepCost {
    v4pool::sim::StepCost {
        name: "toy".into(),
        gpus: 2,
        base_ms: 10.0,
        per_seq_ms: 1.0,
        per_kv_token_ms: 0.0,
        per_prefill_token_ms: 0.01,
        prefill_ctx: 0.0,
        host_gbps: 50.0,
    }
}

fn timed(concurrency: Option<usize>) -> SimConfig {
    SimConfig::default()
        .with_max_seqs(4)
        .with_elastic_max_seqs(8)
        .with_max_context(1 << 16)
        .with_steps(v4pool::sim::MAX_STEPS)
        .with_time(
            TimeConfig::new(toy_cost(), 1e7)
                .with_concurrency(concurrency)
                .with_slo_ttft_ms(25.0)
                .with_slo_tpot_ms(11.0),
        )
}

/// One request alone: its first step prefills 1,000 tokens and samples the first token
/// (10 + 1 + 0.01 × 1,000 = 21 ms), then four decode steps of 11 ms each. It arrives at
/// 1 s: the idle engine jumps there, so the latencies do not include the wait for it.
#[test]
fn one_request_has_the_latencies_the_cost_model_gives() {
    let cfg = timed(None);
    let r =
        simulate(&pool(1 << 30, 4), &cfg, RunKind::Elastic, [RequestSpec::new(0, 1000, 1000, 5)]).unwrap();
    let t = r.time.unwrap();
    assert_eq!(r.completed, 1);
    assert!((t.ttft_ms.quantile(0.5) - 21.0).abs() < 1e-9, "TTFT {}", t.ttft_ms.quantile(0.5));
    assert!((t.tpot_ms.quantile(0.5) - 11.0).abs() < 1e-9, "TPOT {}", t.tpot_ms.quantile(0.5));
    assert!((t.e2e_ms.quantile(0.5) - 65.0).abs() < 1e-9, "E2E {}", t.e2e_ms.quantile(0.5));
    assert!((t.duration_s - 1.065).abs() < 1e-9, "clock {}", t.duration_s);
    // 1,005 tokens over 1.065 s on 2 GPUs; it met the 25 ms / 11 ms target.
    assert!((t.tok_s_gpu - 1005.0 / 1.065 / 2.0).abs() < 1e-6, "{}", t.tok_s_gpu);
    assert_eq!((t.within_slo, t.ttft_censored), (1, 0));
    assert!((t.busy - 0.065 / 1.065).abs() < 1e-9);
}

/// A closed loop keeps exactly its concurrency in flight; a request still queued when the
/// horizon stops the clock counts in TTFT with its wait so far.
#[test]
fn the_closed_loop_and_the_horizon() {
    let reqs: Vec<RequestSpec> = (0..6).map(|i| RequestSpec::new(i, 0, 500, 20)).collect();
    let cfg = timed(Some(2));
    let r = simulate(&pool(1 << 30, 4), &cfg, RunKind::Elastic, reqs.clone()).unwrap();
    assert_eq!((r.completed, r.max_running), (6, 2), "two in flight at a time");
    let t = r.time.unwrap();
    assert_eq!(t.ttft_censored, 0);
    // A horizon inside the first request's decode: nothing completes, all six count censored
    // or with their first token.
    let mut short = timed(Some(6));
    short.time.as_mut().unwrap().horizon_ms = 50.0;
    let r = simulate(&pool(1 << 30, 4), &short, RunKind::Elastic, reqs).unwrap();
    let t = r.time.unwrap();
    assert_eq!(r.completed, 0);
    assert_eq!(t.ttft_ms.count(), 6);
    assert!(t.duration_s >= 0.05);
}

/// A synthetic Mooncake snippet: the second request re-sends the first one's two 512-token
/// ids (four pool blocks, wholly inside both prompts) and hits all 1,024 tokens; the third
/// carries id 8 at another position and hits nothing in the pool (block keys are chained,
/// as prefixes are), while the trace's ceiling, which only asks whether an id was seen,
/// counts it (real Mooncake ids are prefix hashes, so an id never recurs at another
/// position there and the two agree).
#[test]
fn a_trace_snippet_maps_512_token_ids_onto_pool_blocks() {
    let text = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [7, 8]}\n\
                {\"timestamp\": 5000, \"input_length\": 2048, \"output_length\": 4, \"hash_ids\": [7, 8, 9, 10]}\n\
                {\"timestamp\": 9000, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [8, 11]}\n";
    let trace = Arc::new(Trace::parse(text).unwrap());
    assert_eq!(trace.ceiling(), (3, 8));
    let cfg = timed(None);
    for policy in [RunKind::Elastic, RunKind::NoReuse] {
        let pool = pool(1 << 30, 4);
        let mut engine =
            v4pool::raw::sim::Engine::new(&pool, &cfg, policy).unwrap().with_trace(trace.clone());
        let mut arrivals = trace.specs(1.0).unwrap().into_iter();
        while !engine.done() {
            engine.step(&mut arrivals).unwrap();
        }
        let r = engine.finish().unwrap();
        assert_eq!((r.completed, r.input_tokens), (3, 4096));
        let want = if policy == RunKind::Elastic { 1024 } else { 0 };
        assert_eq!(r.prefix_hit_tokens, want, "{policy:?}");
        // What an infinite cache could have served: the same 1,024 tokens.
        assert_eq!(r.eligible_prefix_tokens, 1024, "{policy:?}");
        let t = r.time.unwrap();
        // The hit skips 1,024 of 2,048 prefill tokens: 10.24 ms less for that first step.
        assert!(t.ttft_ms.max() < 10.0 + 1.0 + 0.01 * 2048.0 + 1e-9);
    }
}

/// The conversation trace (`V4POOL_TRACE=/path/to/mooncake_conversation_trace.jsonl`),
/// one shard of sixteen at the trace's arrivals, 8 GiB (docs/simulate.md says why): elastic
/// with v4pool's reuse against the layouts engines ship. Skips visibly without the trace
/// (the project does not commit it). Heavy: about 12 GB of memory and 5 CPU-minutes.
#[test]
fn the_conversation_trace_against_the_baselines() {
    let Ok(path) = std::env::var("V4POOL_TRACE") else {
        println!("SKIP the_conversation_trace_against_the_baselines: set V4POOL_TRACE to the Mooncake conversation trace");
        return;
    };
    let trace = Arc::new(Trace::from_path(std::path::Path::new(&path)).unwrap().shard(0, 16).unwrap());
    let (hit, all) = trace.ceiling();
    let specs = trace.specs(1.0).unwrap();
    let budget = 8u64 << 30;
    let model = ModelShape::v4_flash(0).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 48, budget)).unwrap();
    let fixed = v4pool::sim::sglang_fixed_slots(&p, v4pool::sim::SGLANG_SWA_RATIO) as usize;
    // elastic_max_seqs as `v4pool simulate` sets it: four times the fixed split's slots, at
    // most the plane's.
    let cfg = SimConfig::default()
        .with_max_seqs(fixed)
        .with_elastic_max_seqs((4 * fixed).min(p.geometry.slot_positions as usize).max(fixed))
        .with_steps(v4pool::sim::MAX_STEPS)
        .with_time(TimeConfig::new(
            cost::preset(H200X4_FLASH_FP8).unwrap(),
            (specs.last().unwrap().arrival as f64) + 3.6e6,
        ))
        .with_host_tier_bytes(4 << 30);
    let mut runs = Vec::new();
    for policy in
        [RunKind::Elastic, RunKind::Fixed, RunKind::NoReuse, RunKind::Reuse4096, RunKind::ElasticTier]
    {
        let pool = Arc::new(Pool::new(host(), PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap());
        let mut engine =
            v4pool::raw::sim::Engine::new(&pool, &cfg, policy).unwrap().with_trace(trace.clone());
        let mut arrivals = specs.clone().into_iter();
        while !engine.done() {
            engine.step(&mut arrivals).unwrap();
        }
        let r = engine.finish().unwrap();
        let t = r.time.clone().unwrap();
        println!(
            "{:<13} completed {:>5} tok/s/GPU {:>7.1} TTFT p50 {:>8.1} p99 {:>9.1} ms TPOT p50 {:>6.1} hit/input {:.3} of-ceiling {:.3} restored {:.2} GiB",
            r.policy,
            r.completed,
            t.tok_s_gpu,
            t.ttft_ms.quantile(0.5),
            t.ttft_ms.quantile(0.99),
            t.tpot_ms.quantile(0.5),
            r.prefix_hit_tokens as f64 / r.input_tokens.max(1) as f64,
            r.prefix_hit_rate,
            t.restored_bytes as f64 / (1u64 << 30) as f64
        );
        runs.push(r);
    }
    println!("trace ceiling {hit}/{all} = {:.3} of 512-token blocks", hit as f64 / all as f64);
    let elastic = &runs[0];
    let te = elastic.time.as_ref().unwrap();
    assert!(elastic.prefix_hit_rate >= 0.9, "elastic served {:.3} of the ceiling", elastic.prefix_hit_rate);
    for b in &runs[1..4] {
        let tb = b.time.as_ref().unwrap();
        assert!(te.tok_s_gpu >= tb.tok_s_gpu * 0.999, "{}: throughput", b.policy);
        assert!(te.ttft_ms.quantile(0.5) <= tb.ttft_ms.quantile(0.5) * 1.001, "{}: TTFT p50", b.policy);
        assert!(te.ttft_ms.quantile(0.99) <= tb.ttft_ms.quantile(0.99) * 1.001, "{}: TTFT p99", b.policy);
    }
}

/// The command in time: every run's JSON carries the latency figures, `--host-tier` adds the
/// host-tier run, and coefficients printed by `calibrate --json` are read back by `--cost`.
#[test]
fn the_commands_carry_the_time_figures_and_read_their_own_coefficients() {
    let bin = env!("CARGO_BIN_EXE_v4pool");
    let cal = std::process::Command::new(bin).args(["calibrate", "--no-replay", "--json"]).output().unwrap();
    assert!(cal.status.success(), "{}", String::from_utf8_lossy(&cal.stderr));
    let v: serde_json::Value = serde_json::from_slice(&cal.stdout).unwrap();
    let presets = v["presets"].as_array().unwrap();
    assert_eq!(presets.len(), 3);
    for p in presets {
        let eq = p["equations"].as_array().unwrap();
        assert!(eq.iter().any(|e| e["fitted"] == true) && eq.iter().any(|e| e["fitted"] == false), "{p}");
    }
    let file = std::env::temp_dir().join(format!("v4pool-cost-{}.json", std::process::id()));
    std::fs::write(&file, presets[0]["cost"].to_string()).unwrap();
    let out = std::process::Command::new(bin)
        .args(["simulate", "--budget", "1GiB", "--max-seqs", "4", "--duration", "30", "--rate", "1"])
        .args(["--mix", "multiturn", "--host-tier", "1GiB", "--backend", "host", "--json", "--cost"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["elastic", "fixed", "no_reuse", "reuse_4096", "elastic+host"]);
    for r in runs {
        let t = &r["time"];
        assert_eq!(t["cost"], H200X4_FLASH_FP8);
        for key in ["ttft_ms", "tpot_ms", "e2e_ms"] {
            for q in ["p50", "p90", "p99"] {
                assert!(t[key][q].as_f64().is_some(), "{key}.{q} missing in {t}");
            }
        }
        assert!(t["tok_s_gpu"].as_f64().unwrap() > 0.0 && t["goodput"]["rps"].as_f64().is_some());
    }
    let bad =
        std::process::Command::new(bin).args(["simulate", "--cost", "nope", "--json"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    // `--cost none` counts steps as before: no time figures, and time options are refused.
    let steps = ["simulate", "--cost", "none", "--steps", "30", "--budget", "1GiB", "--max-seqs", "4"];
    let out =
        std::process::Command::new(bin).args(steps).args(["--backend", "host", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["runs"].as_array().unwrap().iter().all(|r| r["time"].is_null()) && v["in_time"] == false);
    let out =
        std::process::Command::new(bin).args(steps).args(["--duration", "5", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
