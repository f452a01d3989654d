//! `simulate` in time: the step-cost model fitted to the published cells, the calibration
//! benchmark replayed through the engine on the fixed split and compared with the published
//! figures (computed here, never hard-coded), the latency figures' bookkeeping, and the
//! Mooncake trace (a synthetic snippet here; the real trace when `V4POOL_TRACE` names it).

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sim::cost::{self, Figure, CELLS, H200X4_FLASH_FP8};
use v4pool::sim::{bench, simulate, RequestSpec, SimConfig, SplitPolicy, TimeConfig, Trace};
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
