//! `v4pool simulate` on the host backend: both policies run the same workload, the elastic
//! one moves the boundary and the fixed one never does, nothing leaks, and the command's
//! JSON carries the numbers.

use std::process::Command;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sim::{
    simulate, Mix, RequestSpec, RunKind, SimConfig, SimConfigError, SimError, Workload, WorkloadConfig,
    MAX_WAITING,
};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

fn pool(budget: u64, seqs: i64) -> Arc<Pool> {
    let model = ModelShape::v4_flash(0).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget)).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    Arc::new(Pool::new(backend, PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap())
}

#[test]
fn both_policies_run_the_same_workload_and_release_everything() {
    let cfg = SimConfig::default()
        .with_mix(Mix::Chat)
        .with_rate(0.6)
        .with_steps(300)
        .with_max_seqs(8)
        .with_elastic_max_seqs(24)
        .with_max_context(1 << 16);
    let requests: Vec<RequestSpec> = cfg.workload().unwrap().collect();
    let mut reports = Vec::new();
    for policy in [RunKind::Elastic, RunKind::Fixed] {
        let pool = pool(1 << 30, cfg.max_seqs as i64);
        let r = simulate(&pool, &cfg, policy, requests.iter().copied()).unwrap();
        let c = pool.counts().unwrap();
        assert_eq!(c.free_blocks, c.num_blocks, "{policy:?} leaked blocks");
        assert_eq!(c.free_slots, c.num_slots, "{policy:?} leaked slots");
        assert_eq!(r.arrived, requests.len() as u64);
        assert!(r.completed > 0 && r.generated_tokens > 0);
        assert!(r.index_build_steps > 0, "no decode index build ran");
        reports.push(r);
    }
    let (elastic, fixed) = (&reports[0], &reports[1]);
    assert!(elastic.boundary_moves > 0, "the elastic run never moved the boundary");
    assert_eq!(fixed.boundary_moves, 0);
    assert!(fixed.max_running <= cfg.max_seqs);
    // A chat load is slot-bound: taking slots from the gap admits more than the fixed split.
    assert!(elastic.max_running > fixed.max_running);
}

#[test]
fn requests_still_queued_count_in_the_per_request_wait() {
    // One fixed slot, held past the run's end by the first request: the rest queue to the end.
    let cfg = SimConfig::default()
        .with_mix(Mix::Chat)
        .with_steps(50)
        .with_max_seqs(1)
        .with_elastic_max_seqs(1)
        .with_max_context(1 << 16);
    let requests: Vec<RequestSpec> = (0..5).map(|i| RequestSpec::new(i, i * 10, 100, 1000)).collect();
    let pool = pool(1 << 30, 1);
    let r = simulate(&pool, &cfg, RunKind::Fixed, requests).unwrap();
    assert_eq!((r.arrived, r.completed, r.preemptions), (5, 0, 0));
    assert_eq!(r.mean_wait_steps, 0.0, "the one admission waited nothing");
    // Queued since steps 10, 20, 30 and 40 at step 50: (40 + 30 + 20 + 10) / 5 requests.
    assert_eq!(r.mean_queue_steps, 20.0);
}

#[test]
fn the_command_prints_json_with_both_runs() {
    let out = Command::new(env!("CARGO_BIN_EXE_v4pool"))
        .args([
            "simulate",
            "--steps",
            "60",
            "--budget",
            "1GiB",
            "--max-seqs",
            "4",
            "--backend",
            "host",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["elastic", "fixed", "no_reuse", "reuse_4096"]);
    for r in runs {
        for key in [
            "completed",
            "max_running",
            "boundary_moves",
            "block_relocations",
            "index_build",
            "samples",
            "prefix_hit_rate",
            "prefill_tokens_saved",
            "recomputed_prefill_tokens",
            "checkpoint_bytes_held",
            "evictions",
        ] {
            assert!(!r[key].is_null(), "missing {key}");
        }
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_v4pool"))
        .args(["simulate", "--mix", "nope", "--json"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let e: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(e["error"], "BadValue");
}

/// The arrival stream is drawn lazily: a trace of 10^15 requests costs nothing until it is
/// iterated (the old simulator built the whole list first and ran out of memory).
#[test]
fn the_workload_is_lazy() {
    let cfg = WorkloadConfig::new(Mix::Mixed, 1000.0, 1 << 40, 3, 1 << 20);
    let first: Vec<RequestSpec> = Workload::new(cfg).unwrap().take(5000).collect();
    assert_eq!(first.len(), 5000);
    assert!(first.last().unwrap().arrival < 10, "a rate of 1000 fills 5000 within a few steps");
}

fn small(steps: u64, rate: f64) -> SimConfig {
    SimConfig::default()
        .with_mix(Mix::Chat)
        .with_rate(rate)
        .with_steps(steps)
        .with_max_seqs(4)
        .with_elastic_max_seqs(8)
        .with_max_context(1 << 16)
}

/// Arrivals beyond the queue's cap are turned away and counted; the queue never holds more
/// than `MAX_WAITING` requests however long the run or high the rate.
#[test]
fn the_waiting_queue_is_bounded() {
    let cfg = small(120, 1000.0).with_sample_every(1);
    let pool = pool(1 << 30, cfg.max_seqs as i64);
    let r = simulate(&pool, &cfg, RunKind::Fixed, cfg.workload().unwrap()).unwrap();
    assert!(r.turned_away > 0, "{} arrivals, none turned away", r.arrived);
    assert!(r.samples.iter().all(|s| s.waiting <= MAX_WAITING + cfg.max_seqs));
    assert!(r.samples.iter().any(|s| s.waiting >= MAX_WAITING - 1000), "the queue never filled");
}

/// A request that can never fit the pool is refused at admission and counted; the run goes
/// on (the old simulator admitted it, and it stalled every request behind it for good).
#[test]
fn a_prompt_larger_than_the_pool_is_refused() {
    let cfg = small(400, 0.0001);
    let block_tokens = 256u64;
    let mut requests = vec![RequestSpec::new(0, 0, 60_000, 100)];
    requests.extend((1..6).map(|id| RequestSpec::new(id, id, 500, 20)));
    for policy in [RunKind::Elastic, RunKind::Fixed] {
        // The big one needs one block more than the whole plane holds.
        let pool = pool(1 << 30, cfg.max_seqs as i64);
        let blocks = pool.geometry().unwrap().max_blocks_beside(0) as u64;
        let mut reqs = requests.clone();
        reqs[0].prompt = (blocks + 1) * block_tokens;
        let cfg = cfg.clone().with_max_context(reqs[0].prompt + 200);
        let r = simulate(&pool, &cfg, policy, reqs).unwrap();
        assert_eq!(r.refused, 1, "{policy:?}");
        assert_eq!(r.completed, 5, "{policy:?}: the requests behind the refused one finish");
        let c = pool.counts().unwrap();
        assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "{policy:?} leaked");
    }
}

/// Configurations the run could not hold within its bound are typed errors, never clamped.
#[test]
fn the_config_is_checked_against_the_pool() {
    let pool = pool(1 << 30, 4);
    let g = pool.geometry().unwrap();
    let positions = g.slot_positions as u64;
    let ok = small(10, 0.5);
    ok.check(&g, 1 << 30).unwrap();
    let too_many = ok.clone().with_elastic_max_seqs(positions as usize + 1);
    assert!(matches!(
        too_many.check(&g, 1 << 30),
        Err(SimConfigError::OutOfRange { what: "--elastic-max-seqs", max, .. }) if max == positions
    ));
    let below = ok.clone().with_elastic_max_seqs(2);
    assert!(matches!(below.check(&g, 1 << 30), Err(SimConfigError::OutOfRange { .. })));
    for rate in [f64::NAN, f64::INFINITY, 0.0, -1.0, 1e6] {
        assert!(matches!(ok.clone().with_rate(rate).check(&g, 1 << 30), Err(SimConfigError::Rate(_))));
    }
    // The decode buffers may take a sixteenth of the pool's bytes.
    assert!(matches!(ok.check(&g, 1 << 16), Err(SimConfigError::DecodeBuffers { .. })));
    // The engine refuses the same before it touches the pool.
    let err = simulate(&pool, &too_many, RunKind::Elastic, std::iter::empty()).unwrap_err();
    assert!(matches!(err, SimError::Config(_)), "{err}");
}

/// Multiturn conversations re-send their history: v4pool's reuse serves most of what earlier
/// turns prefilled from the cache, the no-reuse baseline none of it, and the 4,096-token
/// baseline only whole 16-block groups; every run leaves the pool empty.
#[test]
fn the_multiturn_mix_hits() {
    let cfg = SimConfig::default()
        .with_mix(Mix::Multiturn)
        .with_rate(0.4)
        .with_steps(400)
        .with_max_seqs(8)
        .with_elastic_max_seqs(24)
        .with_max_context(1 << 16);
    let mut reports = Vec::new();
    for policy in RunKind::ALL {
        let pool = pool(1 << 30, cfg.max_seqs as i64);
        let r = simulate(&pool, &cfg, policy, cfg.workload().unwrap()).unwrap();
        let c = pool.counts().unwrap();
        assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "{policy:?} leaked");
        assert!(r.completed > 0, "{policy:?} completed nothing");
        assert!(r.eligible_prefix_tokens > 0, "{policy:?}: no turn re-sent a prefilled prefix");
        assert!(r.prefix_hit_tokens <= r.eligible_prefix_tokens, "{policy:?}");
        reports.push(r);
    }
    let (elastic, no_reuse, lcm) = (&reports[0], &reports[2], &reports[3]);
    assert!(elastic.prefix_hit_rate >= 0.8, "elastic hit rate {}", elastic.prefix_hit_rate);
    assert!(elastic.hits > 0 && elastic.prefill_tokens_saved > 0 && elastic.checkpoints_stored > 0);
    // A namespace per request: nothing hits across requests (a preempted request still
    // resumes from what it committed itself).
    assert_eq!(no_reuse.prefix_hit_tokens, 0);
    assert_eq!(no_reuse.prefix_hit_rate, 0.0);
    assert_eq!(lcm.prefix_hit_tokens % 4096, 0, "the 4,096 baseline hit off its grid");
    assert!(lcm.prefix_hit_rate < elastic.prefix_hit_rate);
    assert!(elastic.prefilled_tokens < no_reuse.prefilled_tokens);
}

/// A v4-flash fp8 pool spec of `budget` bytes for `seqs` sequences.
fn spec(budget: u64, seqs: i64) -> PoolSpec {
    let model = ModelShape::v4_flash(0).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget)).unwrap();
    PoolSpec::from_plan(&p).unwrap()
}

/// A report with the wall-clock figures (the index build's and staging's µs) cleared: what
/// must not depend on where the pool's bytes are.
fn modelled(mut r: v4pool::sim::SimReport) -> String {
    r.index_build_mean_us = 0.0;
    r.index_build_p99_us = 0.0;
    r.index_build_max_us = 0.0;
    r.stage_mean_us = 0.0;
    r.backend.clear();
    format!("{r:?}")
}

/// Issue 45: the accounting host backend (planes, indexer cache and host tier without
/// bytes) runs the pool's and manager's own code, so every run reports the same figures as on
/// the plain host backend, host tier spills and restores included.
#[test]
fn the_accounting_backend_gives_the_plain_backends_results() {
    let cfg = SimConfig::default()
        .with_mix(Mix::Multiturn)
        .with_rate(0.8)
        .with_steps(400)
        .with_max_seqs(8)
        .with_elastic_max_seqs(24)
        .with_max_context(1 << 16)
        .with_host_tier_bytes(64 << 20);
    let requests: Vec<RequestSpec> = cfg.workload().unwrap().collect();
    let s = spec(1 << 30, cfg.max_seqs as i64);
    let accounting = Arc::new(HostBackend::accounting());
    for policy in [RunKind::Elastic, RunKind::Fixed, RunKind::Reuse4096, RunKind::ElasticTier] {
        let plain: Arc<dyn Backend> = Arc::new(HostBackend::new());
        let p = Arc::new(Pool::new(plain, s.clone(), Stream::DEFAULT).unwrap());
        let expected = simulate(&p, &cfg, policy, requests.iter().copied()).unwrap();
        let backend: Arc<dyn Backend> = accounting.clone();
        let p = v4pool::raw::sim::sim_pool(&backend, &s).unwrap();
        let got = simulate(&p, &cfg, policy, requests.iter().copied()).unwrap();
        assert!(got.index_build_steps > 0, "{policy:?}: no decode index build ran");
        assert!(expected.boundary_moves + expected.checkpoints_stored > 0, "{policy:?} moved nothing");
        assert_eq!(modelled(got), modelled(expected), "{policy:?} differs on the accounting backend");
    }
    let st = accounting.accounting_stats().unwrap();
    assert!(st.copied_bytes > 0 && st.filled_bytes > 0 && st.launches > 0, "nothing was counted: {st:?}");
    assert!(st.to_host_bytes > 0, "the host tier took nothing: {st:?}");
    assert_eq!((st.virtual_allocations, st.virtual_bytes), (0, 0), "virtual allocations leaked");
}

/// Issue 45: a simulated engine at a real budget (80 GiB of HBM, a 64 GiB host tier) holds
/// only metadata: on the plain host backend the pool alone asks for 80 GiB (refused on a
/// machine of less memory, or committed page by page as moves touch it).
#[test]
fn a_simulated_pool_at_80_gib_holds_only_metadata() {
    const GIB: u64 = 1 << 30;
    let cfg = SimConfig::default()
        .with_mix(Mix::Multiturn)
        .with_rate(0.8)
        .with_steps(300)
        .with_max_seqs(8)
        .with_elastic_max_seqs(24)
        .with_max_context(1 << 16)
        .with_host_tier_bytes(64 * GIB);
    let s = spec(80 * GIB, cfg.max_seqs as i64);
    let accounting = Arc::new(HostBackend::accounting());
    let backend: Arc<dyn Backend> = accounting.clone();
    let p = v4pool::raw::sim::sim_pool(&backend, &s).unwrap();
    let mut engine = v4pool::raw::sim::Engine::new(&p, &cfg, RunKind::ElasticTier).unwrap();
    let mut arrivals = cfg.workload().unwrap();
    while !engine.done() {
        engine.step(&mut arrivals).unwrap();
    }
    let st = accounting.accounting_stats().unwrap();
    let real = accounting.allocated_bytes();
    let r = engine.finish().unwrap();
    assert!(r.completed > 0 && r.index_build_steps > 0);
    assert!(st.virtual_bytes >= 79 * GIB, "the planes were not kept without bytes: {st:?}");
    // The tier holds whole units of its budget.
    assert!(st.host_reserved_bytes > 63 * GIB, "the host tier was not reserved: {st:?}");
    // Real memory: the decode index buffers and descriptors, a few MiB.
    assert!(real < 256 << 20, "{real} bytes of real allocations beside an 80 GiB pool");
}

/// Issue 43 row 15: a run whose pools and tiers would not fit the machine's memory is
/// refused up front; kept without bytes, the same run fits.
#[test]
fn a_run_that_would_not_fit_memory_is_refused_up_front() {
    use v4pool::sim::MemoryPlacement;
    const GIB: u64 = 1 << 30;
    let cfg = SimConfig::default()
        .with_host_tier_bytes(64 * GIB)
        .with_max_seqs(8)
        .with_elastic_max_seqs(24)
        .with_max_context(1 << 16);
    let s = spec(80 * GIB, 8);
    let plain = MemoryPlacement::default()
        .with_planes_on_host(true)
        .with_index_on_host(true)
        .with_tiers_committed(true);
    let accounting = MemoryPlacement::default()
        .with_planes_on_host(false)
        .with_index_on_host(true)
        .with_tiers_committed(false);
    let e = cfg.check_memory(&s, 4, plain, 24 * GIB).unwrap_err();
    assert!(matches!(e, SimError::Config(SimConfigError::Memory { engines: 4, .. })), "{e}");
    assert!(e.to_string().contains("GiB available"), "{e}");
    let fit = cfg.check_memory(&s, 16, accounting, 24 * GIB).unwrap();
    assert!(fit.total < 8 * GIB, "16 engines kept without bytes estimated at {} B", fit.total);
    // The command refuses with one line and exit status 2 where the machine is smaller than
    // 256 engines of 4 TiB kept without bytes (every CI machine).
    let need = cfg.memory_estimate(&spec(4 << 40, 16), 256, accounting).unwrap().total;
    if v4pool::raw::sim::available_memory().is_some_and(|a| a < need) {
        let dir = std::env::temp_dir().join(format!("v4pool-sim-mem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("t.jsonl");
        std::fs::write(
            &trace,
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [1, 2]}\n",
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_v4pool"))
            .args(["simulate", "--trace", trace.to_str().unwrap(), "--engines", "256", "--budget", "4TiB"])
            .args(["--max-seqs", "16", "--backend", "host", "--no-progress"])
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("GiB of host memory"), "{err}");
    }
}
