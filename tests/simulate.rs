//! `v4pool simulate` on the host backend: both policies run the same workload, the elastic
//! one moves the boundary and the fixed one never does, nothing leaks, and the command's
//! JSON carries the numbers.

use std::process::Command;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::cli::simulate::{simulate, workload, Mix, SimConfig, SplitPolicy};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

fn pool(budget: u64, seqs: i64) -> Pool {
    let model = ModelShape::v4_flash(0).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget)).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    Pool::new(backend, PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap()
}

#[test]
fn both_policies_run_the_same_workload_and_release_everything() {
    let cfg = SimConfig {
        mix: Mix::Chat,
        rate: 0.6,
        steps: 300,
        max_seqs: 8,
        elastic_max_seqs: 24,
        max_context: 1 << 16,
        progress: false,
        ..SimConfig::default()
    };
    let requests = workload(&cfg);
    let mut reports = Vec::new();
    for policy in [SplitPolicy::Elastic, SplitPolicy::Fixed] {
        let pool = std::sync::Arc::new(pool(1 << 30, cfg.max_seqs as i64));
        let r = simulate(&pool, &cfg, policy, &requests).unwrap();
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
    assert_eq!(runs.len(), 2);
    for r in runs {
        for key in
            ["completed", "max_running", "boundary_moves", "block_relocations", "index_build", "samples"]
        {
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
