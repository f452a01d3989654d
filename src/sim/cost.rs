//! The step-cost model: what one forward step costs in milliseconds, fitted to published
//! serving measurements (`shared/spec/serving-calibration.md` lists them with their
//! sources; [`CELLS`] carries the figures, each with its source).
//!
//! # The model
//! A step prefills `P` tokens (whose attention sees `Cp` earlier tokens on average) and
//! decodes `B` sequences whose contexts sum to `C` tokens:
//!
//! ```text
//! T = base + per_seq · B + per_kv_token · C + per_prefill_token · P · (1 + prefill_ctx · Cp)
//!       + restored bytes / host bandwidth
//! ```
//!
//! * `base`, `per_seq` and `per_prefill_token` are **fitted** (least squares) to the cells.
//! * `per_kv_token` is **derived from the roofline**, not fitted: every calibration cell
//!   decodes at the same context (8,192 + 512 on average), so the table cannot tell a
//!   per-sequence cost from a per-context-token one. A V4 decode step reads, per context
//!   token, the indexer keys of the CSA layers (a quarter of the tokens) and the HCA rows (a
//!   128th); that is [`Preset::kv_bytes_per_token`] over the deployment's HBM bandwidth. At
//!   these contexts it is under 1 % of a step (V4's compressed attention is why).
//! * `prefill_ctx` is **derived** too: the CSA indexer scores every earlier compressed token
//!   for each prefill token (2 × 64 heads × 128 dims × CSA layers / 4 FLOPs per context token)
//!   against the model's 2 × active parameters FLOPs per token, so a long prompt's tokens
//!   cost more in that proportion. The cells prefill 8,192 tokens from position 0, so they
//!   cannot fix it either.
//! * Speculative decoding (MTP) is folded in: a step is one output token of every decoding
//!   request, so a strategy with MTP has cheaper effective steps. The cells cannot separate
//!   acceptance from step time.
//! * Host-tier restores are charged at [`StepCost::host_gbps`] (PCIe, an assumption the
//!   cells say nothing about).
//!
//! # The fit
//! A cell is a closed-loop benchmark (fixed concurrency, random `isl`/`osl`). Its throughput
//! `X` (requests/s) and TPOT give the mean step of the benchmark: every decoding request gets
//! one token per step, so the mean step time is the TPOT, the mean decode batch is
//! `X · osl · TPOT`, the mean prefill per step `X · isl · TPOT`, and because `T` is linear,
//! the mean step obeys `TPOT = T(mean P, mean B, mean C)` exactly, whatever the steps'
//! distribution. A cell at concurrency 1 also gives `TTFT = T(P = isl, B = 0)`: one
//! prefill step with nothing else running. Those equations, stacked, are solved by least
//! squares ([`fit`]); which cell fixes which coefficient is in each [`Preset`]'s groups.
//! Equations of held-out cells are only evaluated. Every cell's *simulated* figures —
//! the engine replaying the benchmark — are compared by `v4pool calibrate` and by
//! `tests/manager/simulate_time.rs`.

use crate::file::{read_text_bounded, FileError};
use serde_json::Value;

/// Largest coefficient file [`StepCost::from_path`] reads (what `calibrate --json` writes is
/// under 1 KiB).
pub const MAX_COST_BYTES: u64 = 1 << 20;

crate::variant::variant_names! {
/// What the cost model can be refused with.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CostError {
    /// No preset of that name.
    #[error("no cost preset {0:?} (presets: {1})")]
    UnknownPreset(String, String),
    /// A coefficient file is not the JSON object this module writes.
    #[error("cost JSON: {0}")]
    Json(String),
    /// A coefficient that is negative, NaN or infinite.
    #[error("cost coefficient {what} = {value} is not a finite non-negative number")]
    Coefficient {
        /// Its key.
        what: &'static str,
        /// The value given.
        value: f64,
    },
    /// The fitted equations do not determine the coefficients.
    #[error("preset {0}: the fitted cells do not determine every coefficient")]
    Underdetermined(String),
    /// A coefficient file the bounded reader refused (unreadable, not a regular file, over
    /// [`MAX_COST_BYTES`], not UTF-8).
    #[error("cost file: {0}")]
    File(#[from] FileError),
}
}

/// The coefficients of one (model, hardware, parallelism, quantisation): see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCost {
    /// The preset or file it came from.
    pub name: String,
    /// GPUs of the deployment (throughput is reported per GPU).
    pub gpus: u32,
    /// Fixed cost of a step, ms (fitted).
    pub base_ms: f64,
    /// Per decoding sequence, ms (fitted).
    pub per_seq_ms: f64,
    /// Per context token of a decoding sequence, ms (roofline).
    pub per_kv_token_ms: f64,
    /// Per prefill token at position 0, ms (fitted).
    pub per_prefill_token_ms: f64,
    /// Relative extra cost of a prefill token per earlier token it attends (derived).
    pub prefill_ctx: f64,
    /// Host-to-device bandwidth of host-tier restores, GB/s (assumed).
    pub host_gbps: f64,
}

/// One step's work, the cost model's input.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepLoad {
    /// Tokens prefilled.
    pub prefill_tokens: u64,
    /// Σ over prefilled tokens of the tokens before them (their attention's context).
    pub prefill_ctx_tokens: f64,
    /// Sequences decoded.
    pub decode_seqs: u64,
    /// Σ of the decoded sequences' contexts.
    pub decode_ctx_tokens: u64,
    /// Bytes brought back from the host tier.
    pub restored_bytes: u64,
}

impl StepCost {
    /// Milliseconds one step with `load` takes.
    pub fn step_ms(&self, load: &StepLoad) -> f64 {
        let p = load.prefill_tokens as f64;
        self.base_ms
            + self.per_seq_ms * load.decode_seqs as f64
            + self.per_kv_token_ms * load.decode_ctx_tokens as f64
            + self.per_prefill_token_ms * (p + self.prefill_ctx * load.prefill_ctx_tokens)
            + load.restored_bytes as f64 / (self.host_gbps * 1e6)
    }

    /// The coefficients as one JSON object (what [`StepCost::from_json`] reads).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "name": self.name, "gpus": self.gpus, "base_ms": self.base_ms,
            "per_seq_ms": self.per_seq_ms, "per_kv_token_ms": self.per_kv_token_ms,
            "per_prefill_token_ms": self.per_prefill_token_ms, "prefill_ctx": self.prefill_ctx,
            "host_gbps": self.host_gbps,
        })
    }

    /// Read a coefficient file ([`Self::from_json`]) through the crate's one bounded reader,
    /// at most [`MAX_COST_BYTES`].
    pub fn from_path(path: &std::path::Path) -> Result<StepCost, CostError> {
        Self::from_json(&read_text_bounded(path, MAX_COST_BYTES)?)
    }

    /// Read coefficients from a JSON object with the keys [`StepCost::to_json`] writes
    /// (`name` optional). Every coefficient must be finite and non-negative, `gpus` and
    /// `host_gbps` positive; unknown keys are refused (a typo must not fall back silently).
    pub fn from_json(text: &str) -> Result<StepCost, CostError> {
        let v: Value = serde_json::from_str(text).map_err(|e| CostError::Json(e.to_string()))?;
        let o = v.as_object().ok_or_else(|| CostError::Json("not an object".into()))?;
        const KEYS: [&str; 8] = [
            "name",
            "gpus",
            "base_ms",
            "per_seq_ms",
            "per_kv_token_ms",
            "per_prefill_token_ms",
            "prefill_ctx",
            "host_gbps",
        ];
        if let Some(k) = o.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(CostError::Json(format!("unknown key {k:?}")));
        }
        let num = |what: &'static str| -> Result<f64, CostError> {
            let x = o
                .get(what)
                .ok_or_else(|| CostError::Json(format!("missing {what}")))?
                .as_f64()
                .ok_or_else(|| CostError::Json(format!("{what} is not a number")))?;
            if x.is_finite() && x >= 0.0 {
                Ok(x)
            } else {
                Err(CostError::Coefficient { what, value: x })
            }
        };
        let gpus = num("gpus")?;
        if gpus < 1.0 || gpus.fract() != 0.0 || gpus > 65_536.0 {
            return Err(CostError::Coefficient { what: "gpus", value: gpus });
        }
        let host_gbps = num("host_gbps")?;
        if host_gbps <= 0.0 {
            return Err(CostError::Coefficient { what: "host_gbps", value: host_gbps });
        }
        let name = o.get("name").and_then(Value::as_str).unwrap_or("custom").to_string();
        Ok(StepCost {
            name,
            gpus: gpus as u32,
            base_ms: num("base_ms")?,
            per_seq_ms: num("per_seq_ms")?,
            per_kv_token_ms: num("per_kv_token_ms")?,
            per_prefill_token_ms: num("per_prefill_token_ms")?,
            prefill_ctx: num("prefill_ctx")?,
            host_gbps,
        })
    }
}

/// One published benchmark cell (figures only; P50 unless the source says otherwise).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cell {
    /// Which preset's table it belongs to.
    pub preset: &'static str,
    /// The serving strategy the source names (its launch flags differ per strategy).
    pub strategy: &'static str,
    /// Client concurrency.
    pub concurrency: u32,
    /// Input and output tokens of every request.
    pub isl: u64,
    /// Output tokens.
    pub osl: u64,
    /// Prompts sent (the benchmark's `--num-prompts`).
    pub prompts: u64,
    /// The server's running-request cap (`--max-running-requests`).
    pub max_running: u32,
    /// Published TTFT, ms.
    pub ttft_ms: f64,
    /// Published TPOT, ms.
    pub tpot_ms: f64,
    /// Published throughput, input + output tokens per second per GPU.
    pub tok_s_gpu: f64,
}

/// SGLang's published DeepSeek-V4 benchmark table, sgl-project/sglang
/// `docs/src/snippets/configs/deepseek-ai/deepseek-v4-benchmarks.jsx` @03f4c00a (random
/// dataset, `--random-range-ratio 1.0`; prompts per concurrency from the same repository's
/// `deepseek-v4.jsx`, `numPromptsByConc`; running caps from the launch flags there: the
/// H200 FP8 balanced cell `--max-running-requests 128`, high-throughput 256, low-latency
/// none given — its SGLang default is far above 16; B200 inferred, V4-Pro from the source's
/// note). As copied into `shared/spec/serving-calibration.md`.
pub const CELLS: [Cell; 12] = [
    h200("low-latency", 1, 32, 4096, 183.0, 3.26, 632.0),
    h200("low-latency", 16, 32, 4096, 655.0, 10.11, 2752.0),
    h200("balanced", 64, 128, 128, 880.0, 40.6, 3156.0),
    h200("balanced", 256, 512, 128, 46_563.0, 89.8, 3226.0),
    h200("high-throughput", 1024, 2048, 256, 217_694.0, 146.95, 3975.0),
    b200("low-latency", 1, 32, 302.0, 2.91, 677.0),
    b200("balanced", 64, 128, 642.0, 23.2, 5222.0),
    b200("balanced", 256, 512, 3147.0, 64.0, 8399.0),
    b200("high-throughput", 1024, 2048, 104_109.0, 70.25, 8345.0),
    pro("low-latency", 1, 32, 634.0, 5.65, 170.0),
    pro("low-latency", 16, 32, 1727.0, 23.1, 559.0),
    pro("balanced", 64, 128, 41_506.0, 26.1, 589.0),
];

const fn h200(s: &'static str, c: u32, n: u64, cap: u32, ttft: f64, tpot: f64, thr: f64) -> Cell {
    cell(H200X4_FLASH_FP8, s, c, n, cap, ttft, tpot, thr)
}
const fn b200(s: &'static str, c: u32, n: u64, ttft: f64, tpot: f64, thr: f64) -> Cell {
    // Inferred, not published: the cells' mean decode batch X·osl·TPOT is 239 at c=256 and
    // 261 at c=1,024, as a cap of 256 would give.
    cell(B200X4_FLASH_FP4, s, c, n, 256, ttft, tpot, thr)
}
const fn pro(s: &'static str, c: u32, n: u64, ttft: f64, tpot: f64, thr: f64) -> Cell {
    // "KV fits about 15 requests" (the source's note on this deployment): the cap.
    cell(H200X8_PRO_FP4, s, c, n, 15, ttft, tpot, thr)
}
#[allow(clippy::too_many_arguments)]
const fn cell(
    preset: &'static str,
    strategy: &'static str,
    concurrency: u32,
    prompts: u64,
    max_running: u32,
    ttft_ms: f64,
    tpot_ms: f64,
    tok_s_gpu: f64,
) -> Cell {
    Cell {
        preset,
        strategy,
        concurrency,
        isl: 8192,
        osl: 1024,
        prompts,
        max_running,
        ttft_ms,
        tpot_ms,
        tok_s_gpu,
    }
}

/// The 4×H200 V4-Flash FP8 preset (DP-attention 4 + DeepEP, the balanced and
/// high-throughput strategies).
pub const H200X4_FLASH_FP8: &str = "h200x4-flash-fp8";
/// The 4×B200 V4-Flash FP4 preset.
pub const B200X4_FLASH_FP4: &str = "b200x4-flash-fp4";
/// The 8×H200 V4-Pro FP4 preset.
pub const H200X8_PRO_FP4: &str = "h200x8-pro-fp4";

/// Which equation a cell gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Figure {
    /// The benchmark's mean step equals its TPOT.
    Tpot,
    /// At concurrency 1, TTFT is one prefill step.
    Ttft,
}

/// One equation of a preset: a cell's figure, in a coefficient group, fitted or held out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Use {
    /// Index into [`CELLS`].
    pub cell: usize,
    /// Which figure.
    pub figure: Figure,
    /// The group whose `base`/`per_seq` it constrains (0: the preset's own; 1: a second
    /// strategy sharing only `per_prefill_token`).
    pub group: usize,
    /// Fitted (true) or held out (false).
    pub fitted: bool,
}

/// A preset: the cells it is fitted to and the facts its derived coefficients come from.
#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    /// Its name.
    pub name: &'static str,
    /// GPUs.
    pub gpus: u32,
    /// Bytes a decode step reads per context token (indexer keys of the CSA layers over
    /// their ratio 4, plus HCA rows over 128; V4's own sizes).
    pub kv_bytes_per_token: f64,
    /// Aggregate HBM bandwidth, TB/s.
    pub hbm_tbps: f64,
    /// Indexer FLOPs per context token of one prefill token over the model's FLOPs per token.
    pub prefill_ctx: f64,
    /// The equations, in the order they are printed.
    pub uses: Vec<Use>,
}

const fn fitted(cell: usize, figure: Figure, group: usize) -> Use {
    Use { cell, figure, group, fitted: true }
}
const fn held(cell: usize, figure: Figure, group: usize) -> Use {
    Use { cell, figure, group, fitted: false }
}

/// V4-Flash: 21 CSA layers with 132 B indexer keys over ratio 4, 20 HCA layers with 584 B
/// rows over ratio 128 (per context token of a decode step).
const FLASH_KV_BYTES: f64 = 21.0 * 132.0 / 4.0 + 20.0 * 584.0 / 128.0;
/// V4-Pro: 31 CSA and 30 HCA layers, same row sizes.
const PRO_KV_BYTES: f64 = 31.0 * 132.0 / 4.0 + 30.0 * 584.0 / 128.0;
/// Indexer FLOPs per context token (2 × 64 heads × 128 dims per CSA layer, over ratio 4)
/// over 2 × active parameters: V4-Flash 21 CSA layers, 13B active.
const FLASH_PREFILL_CTX: f64 = 2.0 * 64.0 * 128.0 * 21.0 / 4.0 / 26e9;
/// V4-Pro: 31 CSA layers, 49B active.
const PRO_PREFILL_CTX: f64 = 2.0 * 64.0 * 128.0 * 31.0 / 4.0 / 98e9;

/// Every preset, in the order `v4pool calibrate` prints them.
pub fn presets() -> Vec<Preset> {
    use Figure::{Tpot, Ttft};
    let (f, h) = (fitted, held);
    vec![
        // Group 0: DP-attention 4 (balanced, high-throughput): base and per_seq fixed by
        // c=64 and c=1,024; c=256 (balanced's second cell) held out. Group 1: the
        // low-latency strategy (TP4, MTP 3), whose c=1 TTFT fixes the prefill cost both
        // share (prefill is compute; the cells at c ≥ 64 all prefill 8 tokens per output
        // token, so they cannot separate it from per_seq). TTFTs past concurrency 1 are
        // queueing, no equation: the replays compare them.
        entry(H200X4_FLASH_FP8, false, 4.0 * 4.8, &[f(0, Ttft, 1), f(0, Tpot, 1), f(1, Tpot, 1)]).and(&[
            f(2, Tpot, 0),
            h(3, Tpot, 0),
            f(4, Tpot, 0),
        ]),
        // One group: c=1's TTFT, c=64 and c=1,024 fitted; c=256 and c=1's TPOT held out
        // (one linear model for all four cells put a negative per_seq on B200: the
        // low-latency strategy's MTP-3 steps are not the DP-attention ones).
        entry(B200X4_FLASH_FP4, false, 4.0 * 8.0, &[f(5, Ttft, 0), h(5, Tpot, 0), f(6, Tpot, 0)])
            .and(&[h(7, Tpot, 0), f(8, Tpot, 0)]),
        // One group: c=1 (TTFT, TPOT) and c=16 fitted; c=64 held out.
        entry(H200X8_PRO_FP4, true, 8.0 * 4.8, &[f(9, Ttft, 0), f(9, Tpot, 0), f(10, Tpot, 0)])
            .and(&[h(11, Tpot, 0)]),
    ]
}

impl Preset {
    /// More equations, in print order.
    fn and(mut self, uses: &[Use]) -> Preset {
        self.uses.extend_from_slice(uses);
        self
    }
}

/// A preset of V4-Pro (`pro`) or V4-Flash on GPUs of `hbm_tbps` aggregate bandwidth; the
/// GPU count is the cells' (every cell of a preset ran on the same deployment).
fn entry(name: &'static str, pro: bool, hbm_tbps: f64, uses: &[Use]) -> Preset {
    let gpus = if pro { 8 } else { 4 };
    let (kv_bytes_per_token, prefill_ctx) =
        if pro { (PRO_KV_BYTES, PRO_PREFILL_CTX) } else { (FLASH_KV_BYTES, FLASH_PREFILL_CTX) };
    Preset { name, gpus, kv_bytes_per_token, hbm_tbps, prefill_ctx, uses: uses.to_vec() }
}

/// PCIe Gen5 ×16 in practice (an assumption; no cell measures a host tier).
pub const HOST_GBPS: f64 = 50.0;

/// The mean step of a cell's benchmark (see the module docs): (mean prefill tokens, mean
/// decode batch, mean Σ decode context) per step.
pub fn mean_step(c: &Cell, gpus: u32) -> (f64, f64, f64) {
    let x = c.tok_s_gpu * f64::from(gpus) / (c.isl + c.osl) as f64;
    let tau = c.tpot_ms / 1000.0;
    let b = x * c.osl as f64 * tau;
    (x * c.isl as f64 * tau, b, b * (c.isl as f64 + c.osl as f64 / 2.0))
}

/// One equation's row: coefficients of (per_prefill_token, base₀, per_seq₀, base₁, per_seq₁)
/// and the right-hand side with the derived terms moved over.
fn row(p: &Preset, u: &Use, kv_ms: f64) -> ([f64; 5], f64, f64) {
    let c = &CELLS[u.cell];
    let mut a = [0.0; 5];
    let (base, seq) = (1 + 2 * u.group, 2 + 2 * u.group);
    match u.figure {
        Figure::Ttft => {
            a[0] = c.isl as f64 * (1.0 + p.prefill_ctx * c.isl as f64 / 2.0);
            a[base] = 1.0;
            (a, c.ttft_ms, c.ttft_ms)
        }
        Figure::Tpot => {
            let (pf, b, ctx) = mean_step(c, p.gpus);
            a[0] = pf * (1.0 + p.prefill_ctx * c.isl as f64 / 2.0);
            a[base] = 1.0;
            a[seq] = b;
            (a, c.tpot_ms - kv_ms * ctx, c.tpot_ms)
        }
    }
}

/// A fitted preset: its coefficients and every equation's published and modelled value.
#[derive(Clone, Debug)]
pub struct Fit {
    /// The preset.
    pub preset: Preset,
    /// The coefficients of group 0 (the preset's own strategy).
    pub cost: StepCost,
    /// Group 1's coefficients, when the preset has a second strategy.
    pub second: Option<StepCost>,
    /// (use, published ms, the fitted model's ms).
    pub equations: Vec<(Use, f64, f64)>,
}

/// Fit `preset` by least squares (normal equations over the fitted uses; unknowns a
/// group does not use are left out).
pub fn fit(preset: &Preset) -> Result<Fit, CostError> {
    let kv_ms = preset.kv_bytes_per_token / (preset.hbm_tbps * 1e12) * 1e3;
    let groups = preset.uses.iter().map(|u| u.group).max().unwrap_or(0) + 1;
    let n = 1 + 2 * groups;
    let rows: Vec<([f64; 5], f64)> = preset
        .uses
        .iter()
        .filter(|u| u.fitted)
        .map(|u| {
            let (a, b, _) = row(preset, u, kv_ms);
            (a, b)
        })
        .collect();
    // Non-negative least squares by elimination: a coefficient the unconstrained solution
    // makes negative (no step gets cheaper with more work) is pinned at 0 and the rest
    // refitted; at most one pass per coefficient.
    let mut free: Vec<usize> = (0..n).collect();
    let x = loop {
        let m = free.len();
        let mut ata = vec![vec![0.0; m]; m];
        let mut atb = vec![0.0; m];
        for (a, b) in &rows {
            for (i, &fi) in free.iter().enumerate() {
                atb[i] += a[fi] * b;
                for (j, &fj) in free.iter().enumerate() {
                    ata[i][j] += a[fi] * a[fj];
                }
            }
        }
        let sol = solve(ata, atb).ok_or_else(|| CostError::Underdetermined(preset.name.into()))?;
        let mut x = vec![0.0; n];
        for (i, &fi) in free.iter().enumerate() {
            x[fi] = sol[i];
        }
        match (0..free.len()).filter(|&i| sol[i] < 0.0).min_by(|&i, &j| sol[i].total_cmp(&sol[j])) {
            Some(i) if free.len() > 1 => {
                free.remove(i);
            }
            _ => break x,
        }
    };
    let cost = |g: usize, name: String| StepCost {
        name,
        gpus: preset.gpus,
        base_ms: x[1 + 2 * g],
        per_seq_ms: x[2 + 2 * g],
        per_kv_token_ms: kv_ms,
        per_prefill_token_ms: x[0],
        prefill_ctx: preset.prefill_ctx,
        host_gbps: HOST_GBPS,
    };
    let equations = preset
        .uses
        .iter()
        .map(|u| {
            let (a, rhs, published) = row(preset, u, kv_ms);
            let model: f64 = (0..n).map(|i| a[i] * x[i]).sum::<f64>() + (published - rhs);
            (*u, published, model)
        })
        .collect();
    Ok(Fit {
        cost: cost(0, preset.name.to_string()),
        second: (groups > 1).then(|| cost(1, format!("{}-low-latency", preset.name))),
        preset: preset.clone(),
        equations,
    })
}

/// Gaussian elimination with partial pivoting; `None` when the system is singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    let scale = a.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs())).max(f64::MIN_POSITIVE);
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() <= scale * 1e-13 {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        let (upper, lower) = a.split_at_mut(col + 1);
        let pivot = &upper[col];
        for (i, row) in lower.iter_mut().enumerate() {
            let f = row[col] / pivot[col];
            for (v, p) in row[col..].iter_mut().zip(&pivot[col..]) {
                *v -= f * p;
            }
            b[col + 1 + i] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| a[i][k] * x[k]).sum();
        x[i] = (b[i] - s) / a[i][i];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// The cost of a preset by name (`h200x4-flash-fp8`, …, or `NAME-low-latency` for a
/// preset's second strategy), fitted on the spot.
pub fn preset(name: &str) -> Result<StepCost, CostError> {
    let all = presets();
    let names = || {
        let mut v: Vec<String> = all.iter().map(|p| p.name.to_string()).collect();
        v.push(format!("{H200X4_FLASH_FP8}-low-latency"));
        v.join(", ")
    };
    let (base, second) = match name.strip_suffix("-low-latency") {
        Some(b) => (b, true),
        None => (name, false),
    };
    let p =
        all.iter().find(|p| p.name == base).ok_or_else(|| CostError::UnknownPreset(name.into(), names()))?;
    let f = fit(p)?;
    if second {
        f.second.ok_or_else(|| CostError::UnknownPreset(name.into(), names()))
    } else {
        Ok(f.cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_solver_recovers_a_known_system() {
        // 3x + y = 9, x + 2y = 8: x = 2, y = 3.
        let x = solve(vec![vec![3.0, 1.0], vec![1.0, 2.0]], vec![9.0, 8.0]).unwrap();
        assert!((x[0] - 2.0).abs() < 1e-12 && (x[1] - 3.0).abs() < 1e-12, "{x:?}");
        assert!(solve(vec![vec![1.0, 2.0], vec![2.0, 4.0]], vec![1.0, 2.0]).is_none());
    }

    /// Equal up to the last bit serde_json's float parsing may round (it is not exact).
    fn same(a: &StepCost, b: &StepCost) {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * x.abs().max(y.abs());
        assert_eq!((&a.name, a.gpus), (&b.name, b.gpus));
        for (x, y) in [
            (a.base_ms, b.base_ms),
            (a.per_seq_ms, b.per_seq_ms),
            (a.per_kv_token_ms, b.per_kv_token_ms),
            (a.per_prefill_token_ms, b.per_prefill_token_ms),
            (a.prefill_ctx, b.prefill_ctx),
            (a.host_gbps, b.host_gbps),
        ] {
            assert!(close(x, y), "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn every_preset_fits_with_positive_coefficients_and_exact_fitted_rows_when_square() {
        for p in presets() {
            let f = fit(&p).unwrap();
            for c in std::iter::once(&f.cost).chain(f.second.as_ref()) {
                assert!(c.per_prefill_token_ms > 0.0 && c.per_kv_token_ms > 0.0, "{c:?}");
                assert!(c.base_ms >= 0.0 && c.per_seq_ms >= 0.0, "{c:?}");
                // Every preset's coefficients are ones `--cost FILE` accepts.
                same(&StepCost::from_json(&c.to_json().to_string()).unwrap(), c);
            }
            let fitted = p.uses.iter().filter(|u| u.fitted).count();
            let unknowns = 1 + 2 * (p.uses.iter().map(|u| u.group).max().unwrap() + 1);
            let pinned = std::iter::once(&f.cost)
                .chain(f.second.as_ref())
                .any(|c| c.per_seq_ms == 0.0 || c.base_ms == 0.0);
            if fitted == unknowns && !pinned {
                for (u, published, model) in &f.equations {
                    if u.fitted {
                        assert!((published - model).abs() < 1e-6 * published, "{u:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn coefficients_round_trip_through_json_and_bad_ones_are_refused() {
        let c = preset(H200X4_FLASH_FP8).unwrap();
        let back = StepCost::from_json(&c.to_json().to_string()).unwrap();
        same(&back, &c);
        let mut v = c.to_json();
        v["base_ms"] = serde_json::json!(-1.0);
        assert!(matches!(
            StepCost::from_json(&v.to_string()),
            Err(CostError::Coefficient { what: "base_ms", .. })
        ));
        v["base_ms"] = serde_json::json!(1.0);
        v["typo"] = serde_json::json!(1.0);
        assert!(matches!(StepCost::from_json(&v.to_string()), Err(CostError::Json(_))));
        assert!(matches!(preset("nope"), Err(CostError::UnknownPreset(..))));
    }
}
