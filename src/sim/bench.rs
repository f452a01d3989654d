//! A calibration cell replayed through the engine: the benchmark the cell was measured with
//! (a closed-loop client at the cell's concurrency sending `prompts` random requests of
//! `isl` / `osl` tokens) on a fixed split with the cell's running-request cap, timed by a
//! step-cost model. What `v4pool calibrate` and `tests/manager/simulate_time.rs` compare with the
//! published figures.
//!
//! Random prompts share nothing, so blocks are not hashed (no checkpoint is stored that
//! nothing could hit, as SGLang's benchmark flushes its cache); the decode index build is
//! skipped because it does not change the timing (the cost model charges the step).

use super::cost::{Cell, StepCost};
use super::{RequestSpec, RunKind, SimConfig, SimError, SimReport, TimeConfig, SLO_TPOT_MS, SLO_TTFT_MS};
use crate::backend::{Backend, Stream};
use crate::model::ModelShape;
use crate::pool::{Pool, PoolSpec};
use crate::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};
use std::sync::Arc;

/// Prefill tokens one step takes in the replay: SGLang's chunked-prefill size, 8,192 per
/// attention-DP rank, over the cell's ranks (4). An assumption: TTFT depends on it, TPOT and
/// throughput hardly (the cost is linear in prefill tokens, however they are chunked).
pub const BENCH_PREFILL_CHUNK: u64 = 4 * 8192;

/// The engine's configuration for replaying `cell` with `cost`.
pub fn bench_config(cell: &Cell, cost: StepCost) -> SimConfig {
    let cap = cell.max_running.min(cell.concurrency).max(1) as usize;
    SimConfig {
        steps: super::MAX_STEPS,
        max_seqs: cap,
        elastic_max_seqs: cap,
        prefill_chunk: BENCH_PREFILL_CHUNK,
        max_context: cell.isl + cell.osl + 256,
        hash_blocks: false,
        build_index: false,
        time: Some(TimeConfig {
            cost,
            // Far beyond any cell's makespan: the replay ends by draining.
            horizon_ms: 1e9,
            concurrency: Some(cell.concurrency as usize),
            slo_ttft_ms: SLO_TTFT_MS,
            slo_tpot_ms: SLO_TPOT_MS,
        }),
        ..SimConfig::default()
    }
}

/// The benchmark's requests (all sent by the closed-loop client; arrival times unused).
pub fn bench_requests(cell: &Cell) -> Vec<RequestSpec> {
    (0..cell.prompts).map(|i| RequestSpec::new(i, 0, cell.isl, cell.osl)).collect()
}

/// The model a preset's cells ran (V4-Pro for the `-pro-` presets, else V4-Flash).
pub fn cell_model(cell: &Cell) -> Result<ModelShape, SimError> {
    let m = if cell.preset.contains("-pro-") { ModelShape::v4_pro(0) } else { ModelShape::v4_flash(0) };
    m.map_err(SimError::BenchModel)
}

/// Replay `cell` on `backend` with the cell's model in an FP8 pool sized to hold the cell's
/// running cap (memory never binds in these cells: the cap does), under the fixed split.
pub fn replay(backend: Arc<dyn Backend>, cell: &Cell, cost: StepCost) -> Result<SimReport, SimError> {
    let model = cell_model(cell)?;
    let cfg = bench_config(cell, cost);
    let probe = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 1, 1 << 30))
        .map_err(SimError::Bench)?;
    // Each running request: its slot and its context's blocks, plus two of decode room.
    let per_req = probe.slot_bytes + (cfg.max_context.div_ceil(256) + 2) * probe.page_bytes;
    let budget = cfg.max_seqs as u64 * per_req + (256 << 20);
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, cfg.max_seqs as i64, budget))
        .map_err(SimError::Bench)?;
    let spec = PoolSpec::from_plan(&p)?;
    let pool = Arc::new(Pool::new(backend, spec, Stream::DEFAULT)?);
    super::simulate(&pool, &cfg, RunKind::Fixed, bench_requests(cell))
}
