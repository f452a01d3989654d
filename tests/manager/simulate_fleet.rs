//! `simulate` at fleet scale (`sim::fleet`) on a synthetic multi-turn trace: every request is
//! routed and completed; under round-robin (a conversation's turns scattered over the
//! engines) the shared tier serves more of the prompts than per-engine tiers, which serve
//! more than no reuse; the prefix-affinity router, fed only by the engines' KV events, keeps
//! conversations where their prefixes are; and the simulator's shared tier is an LRU within
//! its budget. The whole conversation trace on 16 engines (README's table) runs with
//! `V4POOL_TRACE` set.

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::Backend;
use v4pool::manager::{BlockHash, Tier, TierKey};
use v4pool::pool::PoolSpec;
use v4pool::sim::cost::{self, H200X4_FLASH_FP8};
use v4pool::sim::fleet::{simulate_fleet, FleetConfig, FleetReport, FleetRun, Router, SimSharedTier};
use v4pool::sim::{SimConfig, TimeConfig, Trace};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

/// 25 conversations of 4 turns (25: round-robin over 3 engines moves each conversation's
/// turns between engines), each turn re-sending the history (whole 512-token trace
/// blocks) after one shared system-prompt block, arriving interleaved.
fn synthetic() -> Trace {
    let mut lines = Vec::new();
    for turn in 0..4u64 {
        for c in 0..25u64 {
            let ids: Vec<String> = std::iter::once(0)
                .chain((0..2 + 2 * turn).map(|k| 1 + c * 100 + k))
                .map(|x| x.to_string())
                .collect();
            let ts = turn * 40_000 + c * 900;
            let input = 512 * ids.len() as u64 + 40;
            lines.push((ts, format!(
                r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 24, "hash_ids": [{}]}}"#,
                ids.join(", ")
            )));
        }
    }
    lines.sort();
    Trace::parse(&lines.into_iter().map(|l| l.1).collect::<Vec<_>>().join("\n")).unwrap()
}

fn setup(budget: u64, max_seqs: usize) -> (Arc<dyn Backend>, PoolSpec, SimConfig) {
    let model = v4pool::model::ModelShape::v4_flash(0).unwrap();
    let p =
        plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, max_seqs as i64, budget)).unwrap();
    let spec = PoolSpec::from_plan(&p).unwrap();
    let cfg = SimConfig::default()
        .with_max_seqs(max_seqs)
        .with_elastic_max_seqs((4 * max_seqs).min(p.geometry.slot_positions as usize))
        .with_steps(v4pool::sim::MAX_STEPS)
        .with_build_index(false)
        .with_time(TimeConfig::new(cost::preset(H200X4_FLASH_FP8).unwrap(), 4.0e6));
    (Arc::new(HostBackend::new()), spec, cfg)
}

fn run(
    trace: &Arc<Trace>,
    engines: usize,
    router: Router,
    fleet_run: FleetRun,
    host_tier: u64,
) -> FleetReport {
    let (backend, spec, mut cfg) = setup(384 << 20, 4);
    cfg.host_tier_bytes = host_tier;
    let specs = trace.specs(1.0).unwrap();
    let fleet = FleetConfig::new(engines, router, 4 << 30);
    simulate_fleet(&backend, &spec, &cfg, &fleet, fleet_run, trace, &specs).unwrap()
}

#[test]
fn a_fleet_routes_and_completes_every_request_and_the_shared_tier_serves_most() {
    let trace = Arc::new(synthetic());
    let n = trace.specs(1.0).unwrap().len() as u64;
    let rr: Vec<FleetReport> =
        FleetRun::ALL.iter().map(|&r| run(&trace, 3, Router::RoundRobin, r, 64 << 20)).collect();
    for r in &rr {
        assert_eq!(r.routed.iter().sum::<u64>(), n, "{:?}", r.run);
        assert!(
            r.routed.iter().all(|&k| k == n / 3 || k == n / 3 + 1),
            "round-robin spreads evenly: {:?}",
            r.routed
        );
        assert_eq!(r.engines.iter().map(|e| e.completed).sum::<u64>(), n, "{:?}", r.run);
        assert_eq!(r.ttft_ms.count(), n);
        println!(
            "round-robin {:>10}: from cache {:.3} ({:.3} of the ceiling {:.3}), TTFT p50 {:.1} ms, restored {} B",
            r.run.name(),
            r.from_cache,
            r.of_ceiling(),
            r.ceiling,
            r.ttft_ms.quantile(0.5),
            r.restored_bytes
        );
    }
    let (shared, per_engine, none) = (&rr[0], &rr[1], &rr[2]);
    assert_eq!(none.from_cache, 0.0);
    assert!(per_engine.from_cache > 0.0, "the shared system prompt block hits on every engine");
    assert!(
        shared.from_cache > per_engine.from_cache + 0.1,
        "scattered turns find their history in the shared tier: {} vs {}",
        shared.from_cache,
        per_engine.from_cache
    );
    assert!(shared.ttft_ms.quantile(0.5) < none.ttft_ms.quantile(0.5));
    assert!(shared.restored_bytes > 0);
    // The affinity router (KV events only) keeps each conversation on one engine: its
    // per-engine tiers serve as much as the shared tier did under round-robin.
    let aff = run(&trace, 3, Router::PrefixAffinity, FleetRun::PerEngine, 64 << 20);
    println!("affinity per_engine: from cache {:.3}, routed {:?}", aff.from_cache, aff.routed);
    assert!(aff.from_cache > per_engine.from_cache + 0.1, "{} vs {}", aff.from_cache, per_engine.from_cache);
    assert!(aff.routed.iter().all(|&k| k > 0), "affinity still spreads new conversations: {:?}", aff.routed);
    assert_eq!(aff.engines.iter().map(|e| e.completed).sum::<u64>(), n);
}

#[test]
fn the_simulator_s_shared_tier_is_an_lru_within_its_budget() {
    let (backend, spec, _) = setup(384 << 20, 4);
    let pool = Arc::new(v4pool::pool::Pool::new(backend, spec, v4pool::backend::Stream::DEFAULT).unwrap());
    let blocks = pool.with_boundary(|b| b.max_blocks_beside(1)).unwrap();
    pool.resize(blocks, 1).unwrap();
    let b: Vec<_> = (0..3).map(|_| pool.alloc_block().unwrap().handle).collect();
    let mut t = SimSharedTier::new(4 * 1000, 1000);
    let mut other = t.clone();
    let key = |i: u128| TierKey::Block(BlockHash(i));
    t.spill(&pool, key(1), &b[..1]).unwrap();
    t.spill(&pool, key(2), &b[..2]).unwrap();
    assert!(other.contains(&key(1)) && other.used_units() == 3, "clones share one index");
    assert!(other.touch(&key(1)));
    // Room for 2 more units: key 2 (least recent) goes, key 1 stays.
    t.spill(&pool, key(3), &b[..2]).unwrap();
    assert!(t.contains(&key(1)) && !t.contains(&key(2)) && t.contains(&key(3)));
    assert_eq!(t.used_units(), 3);
    assert_eq!(t.lru_order(), vec![key(1), key(3)]);
    assert!(t.spill(&pool, key(4), &[b[0]; 5]).is_err(), "larger than the budget");
    let free = pool.counts().unwrap().free_blocks;
    let got = other.restore(&pool, &key(3)).unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(pool.counts().unwrap().free_blocks, free - 2);
    assert!(t.contains(&key(3)), "a restore leaves the entry (inclusive)");
    assert!(other.restore(&pool, &key(2)).is_err());
}

/// The whole conversation trace on 16 engines (`V4POOL_TRACE`): the README's table. Heavy:
/// about 12 GB and 10 CPU-minutes.
#[test]
fn the_conversation_trace_on_sixteen_engines() {
    let Ok(path) = std::env::var("V4POOL_TRACE") else {
        println!("SKIP the_conversation_trace_on_sixteen_engines: set V4POOL_TRACE to the Mooncake conversation trace");
        return;
    };
    let trace = Arc::new(Trace::from_path(std::path::Path::new(&path)).unwrap());
    let specs = trace.specs(1.0).unwrap();
    let (backend, spec, mut cfg) = setup(640 << 20, 4);
    cfg.host_tier_bytes = 128 << 20;
    cfg.time.as_mut().unwrap().horizon_ms = specs.last().unwrap().arrival as f64 + 3.6e6;
    let fleet = FleetConfig::new(16, Router::PrefixAffinity, 16 * (640 << 20));
    let r: Vec<FleetReport> = FleetRun::ALL
        .iter()
        .map(|&run| simulate_fleet(&backend, &spec, &cfg, &fleet, run, &trace, &specs).unwrap())
        .collect();
    for x in &r {
        println!(
            "{}: from cache {:.3}, of ceiling {:.3}, TTFT p50 {:.1}",
            x.run.name(),
            x.from_cache,
            x.of_ceiling(),
            x.ttft_ms.quantile(0.5)
        );
    }
    assert!(r[0].from_cache >= r[1].from_cache && r[1].from_cache > r[2].from_cache);
}

/// Issue 45: the progress callback sees the run advance (routed requests and the fleet's
/// clock never go back, every request before the horizon is routed) and changes nothing
/// the run reports.
#[test]
fn the_progress_callback_follows_the_run_and_changes_nothing() {
    use v4pool::sim::fleet::{simulate_fleet_with_progress, FleetProgress};
    let trace = Arc::new(synthetic());
    let (backend, spec, mut cfg) = setup(384 << 20, 4);
    cfg.host_tier_bytes = 64 << 20;
    let specs = trace.specs(1.0).unwrap();
    // A horizon inside the trace: the requests after it are neither routed nor counted.
    let horizon = specs[60].arrival as f64;
    cfg.time.as_mut().unwrap().horizon_ms = horizon;
    let before = specs.iter().filter(|r| (r.arrival as f64) < horizon).count();
    assert!(before < specs.len());
    let fleet = FleetConfig::new(3, Router::PrefixAffinity, 4 << 30);
    let plain = simulate_fleet(&backend, &spec, &cfg, &fleet, FleetRun::Shared, &trace, &specs).unwrap();
    let mut seen: Vec<FleetProgress> = Vec::new();
    let watched = simulate_fleet_with_progress(
        &backend,
        &spec,
        &cfg,
        &fleet,
        FleetRun::Shared,
        &trace,
        &specs,
        &mut |at: &FleetProgress| seen.push(*at),
    )
    .unwrap();
    assert!(seen.len() > 10, "{} calls", seen.len());
    for w in seen.windows(2) {
        assert!(w[1].routed >= w[0].routed && w[1].clock_ms >= w[0].clock_ms, "{w:?}");
        assert_eq!(w[1].steps, w[0].steps + 1, "one call per engine step");
    }
    let last = seen.last().unwrap();
    assert_eq!((last.routed, last.requests), (before, before));
    assert!(last.clock_ms <= horizon && last.horizon_ms == horizon);
    assert_eq!(watched.routed, plain.routed);
    assert_eq!(watched.routed.iter().sum::<u64>(), before as u64);
    assert_eq!(
        (watched.from_cache, watched.restored_bytes, watched.ttft_ms.quantile(0.99)),
        (plain.from_cache, plain.restored_bytes, plain.ttft_ms.quantile(0.99))
    );
}

/// Issue 45: `simulate --engines N` defaults each engine to a real engine's budget (80 GiB of
/// HBM, a 64 GiB host tier) and a given `--budget` brings a host tier of four fifths of it;
/// progress stays off stderr when it is not a terminal.
#[test]
fn a_fleet_defaults_to_real_engine_budgets() {
    let dir = std::env::temp_dir().join(format!("v4pool-fleet-defaults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 500, \"input_length\": 1500, \"output_length\": 10, \"hash_ids\": [1, 2, 3]}\n",
    )
    .unwrap();
    let fleet = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_v4pool"))
            .args(["simulate", "--trace", trace.to_str().unwrap(), "--engines", "2", "--backend", "host"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("| shared | affinity |"));
        err
    };
    let err = fleet(&[]);
    assert!(err.contains("budget 85899345920 B"), "{err}");
    assert!(err.contains("2 engines × (80.0 GiB pool + 64.0 GiB host tier), shared tier 160.0 GiB"), "{err}");
    assert!(!err.contains("routed"), "no progress where stderr is not a terminal: {err}");
    let err = fleet(&["--budget", "10GiB"]);
    assert!(err.contains("2 engines × (10.0 GiB pool + 8.0 GiB host tier)"), "{err}");
    let err = fleet(&["--budget", "10GiB", "--host-tier", "1GiB"]);
    assert!(err.contains("2 engines × (10.0 GiB pool + 1.0 GiB host tier)"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
