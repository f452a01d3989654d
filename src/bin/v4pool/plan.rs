//! `v4pool plan`: size a pool from a byte budget (`pool-runtime.md` §3) and print the split.
//!
//! ```text
//! v4pool plan --model v4-flash|v4-pro|v4-flash-dspark|v4-pro-dspark|v4.1-flash|…|PATH/config.json
//!             --budget 100GiB --max-seqs 256
//!             [--dtype fp8|bf16|flashmla-v4|flashmla-v4-p2|flashmla-v41|flashmla-v41-fp4] [--indexer fp8|fp4|bf16|atom-fp8|atom-fp8-fnuz]
//!             [--backend cuda|hip] [--arch gfx90a|gfx942|gfx950|gfx1250] [--spec-steps K]
//!             [--min-slots N] [--overhead BYTES] [--json]
//! ```
//!
//! Invalid input exits with status 2 and one line on stderr, or with `--json` one object
//! `{"error": VARIANT, "message": TEXT}` on stdout.

use crate::layout::load_model;
use crate::{conclude, parse_args, CliError, Streams};
use v4pool::plan_report::PlanReport;
use v4pool::sizing::{default_dtypes, parse_bytes, plan, GpuArch, IndexerDtype, PlanRequest};

const USAGE: &str = "\
usage: v4pool plan --model NAME|PATH/config.json --budget BYTES --max-seqs N
                   [--dtype fp8|bf16|flashmla-v4|flashmla-v4-p2|flashmla-v41|flashmla-v41-fp4] [--indexer fp8|fp4|bf16|atom-fp8|atom-fp8-fnuz]
                   [--backend cuda|hip] [--arch gfx90a|gfx942|gfx950|gfx1250] [--spec-steps K]
                   [--min-slots N] [--overhead BYTES] [--json]

  --model       preset (v4-flash, v4-pro, v4-flash-dspark, v4-pro-dspark, and -dense
                variants with dense drafts; v4.1-flash, v4.1-flash-dspark: bf16 or
                flashmla-v41)
                or a HuggingFace config.json (V4.1's nested text_config too)
  --budget      bytes the pool may take: 1234, 512MiB, 80GB, 100GiB
  --max-seqs    admitted requests: one slot each
  --dtype       main KV: fp8 (ATOM's 640-B rows in two planes, default for V4), bf16 (one
                plane), flashmla-v4 (FlashMLA's 584-B V4 rows, pages of 64; what its SM90
                sparse decode reads), flashmla-v4-p2 (the same rows in pages of 2: one HCA
                index operand for every HCA layer), flashmla-v41 (FlashMLA's 528-B V4.1 rows, default for V4.1),
                flashmla-v41-fp4 (V4.1's packed layout: 528-B window rows, FlashMLA's
                288-B fp4 rows for the compressed KV)
  --indexer     CSA indexer cache: fp8 (row-major e4m3fn, DeepGEMM/vLLM's; default), fp4, bf16
                (exact bf16 keys), atom-fp8 (ATOM's preshuffled OCP e4m3; default on gfx950,
                gfx1250) or atom-fp8-fnuz (ATOM's preshuffled e4m3fnuz; default on gfx942)
  --backend     cuda (default) or hip; hip needs --arch
  --arch        the AMD architecture (gfx90a, gfx942, gfx950, gfx1250): the defaults become
                what ATOM/aiter read there (gfx942: bf16 KV, atom-fp8-fnuz indexer) and a dtype
                no kernel there reads is refused
  --spec-steps  speculative steps k; ring = window + k (default 0)
  --min-slots   fewest slots the elastic boundary may shrink to; the indexer is sized
                for the blocks the plane holds beside them (default 0)
  --overhead    bytes of the pool's own buffers charged to the budget (default 0)
  --json        one JSON object instead of the report";

const OPTIONS: [&str; 12] = [
    "--model",
    "--backend",
    "--arch",
    "--budget",
    "--max-seqs",
    "--dtype",
    "--indexer",
    "--spec-steps",
    "--min-slots",
    "--overhead",
    "--draft-stages",
    "--draft-mode",
];
const FLAGS: [&str; 2] = ["--json", "--help"];

/// Parse `args` (without the word `plan`) and size the pool. `Ok(None)` is `--help`.
pub(crate) fn execute(args: &[String]) -> Result<Option<PlanReport>, CliError> {
    let p = parse_args(args, &OPTIONS, &FLAGS)?;
    if p.flag("--help") {
        return Ok(None);
    }
    let model_spec = p.get("--model").ok_or(CliError::MissingOption { flag: "--model" })?;
    let budget_text = p.get("--budget").ok_or(CliError::MissingOption { flag: "--budget" })?;
    let m = p.required_i64("--max-seqs")?;
    let bad = |flag: &str, value: &str, expected: &'static str| CliError::BadValue {
        flag: flag.to_string(),
        value: value.to_string(),
        expected,
    };
    let kv = crate::kv_dtype(&p)?;
    let indexer = match p.get("--indexer") {
        Some(i) => Some(
            IndexerDtype::from_name(i)
                .ok_or_else(|| bad("--indexer", i, "fp8, fp4, bf16, atom-fp8 or atom-fp8-fnuz"))?,
        ),
        None => None,
    };
    let arch = match p.get("--arch") {
        Some(a) => {
            Some(GpuArch::from_name(a).ok_or_else(|| bad("--arch", a, "gfx90a, gfx942, gfx950 or gfx1250"))?)
        }
        None => None,
    };
    // The architecture is what decides the formats; a HIP pool without one cannot pick them.
    match (p.get("--backend"), arch) {
        (None | Some("cuda"), None) | (None | Some("hip"), Some(_)) => {}
        (Some("hip"), None) => return Err(CliError::MissingOption { flag: "--arch" }),
        (Some("cuda"), Some(_)) => return Err(CliError::Conflict { a: "--backend cuda", b: "--arch" }),
        (Some(other), _) => return Err(bad("--backend", other, "cuda or hip")),
    }
    let min_slots = p.i64("--min-slots")?.unwrap_or(0);
    let overhead_bytes = p.get("--overhead").map(parse_bytes).transpose()?.unwrap_or(0);
    let budget_bytes = parse_bytes(budget_text)?;
    let model = load_model(model_spec, &p)?;
    // Without an architecture the default is the family's fp8 form (ATOM's rows for V4,
    // FlashMLA's 528-B rows for V4.1); with one, what ATOM and aiter read there.
    let (default_kv, default_indexer) = default_dtypes(model.family, arch);
    let (kv, indexer) = (kv.unwrap_or(default_kv), indexer.unwrap_or(default_indexer));
    let mut req = PlanRequest::new(kv, indexer, m, budget_bytes)
        .with_min_slots(min_slots)
        .with_overhead_bytes(overhead_bytes);
    req.arch = arch;
    Ok(Some(PlanReport::new(plan(&model, &req)?)?))
}

/// The readable report.
fn to_text(report: &PlanReport) -> String {
    let p = &report.plan;
    let m = &p.layout.model;
    let g = &p.geometry;
    let row_bytes: u64 = p.layout.widths().iter().sum();
    let raw: u64 = p.plane_bytes.iter().sum::<u64>() + p.indexer_pool_bytes.iter().sum::<u64>();
    let mut s = String::new();
    let mut line = |t: String| {
        s.push_str(&t);
        s.push('\n');
    };
    line(format!(
        "v4pool plan: {} k={} (ring {}), {} KV, {} indexer, budget {} ({} B), max_num_seqs {}",
        m.name,
        m.spec_steps,
        m.ring_slots(),
        p.layout.kv.name(),
        p.layout.indexer.name(),
        human(p.budget_bytes),
        grouped(p.budget_bytes),
        p.num_slots
    ));
    line(format!(
        "  page (one block)   {:>18} B   {} envelope rows × {} B + indexer {} B",
        grouped(p.page_bytes),
        grouped(g.envelope_rows as u64),
        row_bytes,
        grouped(p.page_bytes - g.envelope_rows as u64 * row_bytes)
    ));
    line(format!(
        "  slot (one request) {:>18} B   {} rows: arena {} + entry {} (+ pad)",
        grouped(p.slot_bytes),
        grouped(g.slot_rows as u64),
        grouped(g.arena_rows as u64),
        grouped(g.entry_rows as u64)
    ));
    line(format!(
        "  blocks             {:>18}     at {} slots; up to {} beside {} slots (spec tight fit: {})",
        grouped(p.num_blocks as u64),
        p.num_slots,
        grouped(p.max_blocks as u64),
        p.min_slots,
        grouped(p.tight_fit_blocks.max(0) as u64)
    ));
    line(format!(
        "  slots              {:>18}     of {} positions",
        grouped(p.num_slots as u64),
        grouped(p.slot_positions as u64)
    ));
    line(format!("  history tokens     {:>18}     (blocks × {})", grouped(p.tokens as u64), m.block_size));
    line(format!(
        "  plane rows         {:>18}     {} rows wasted at this split{}",
        grouped(p.plane_rows as u64),
        grouped(p.rows_wasted as u64),
        if p.plane_capped { " (plane at the i32 row limit)" } else { "" }
    ));
    line("  bytes:".to_string());
    let names = ["nope", "rope"];
    for (i, (&b, w)) in p.plane_bytes.iter().zip(p.layout.widths()).enumerate() {
        let label = format!("plane {i} ({}, {w} B/row)", names.get(i).copied().unwrap_or("plane"));
        line(format!("    {label:<30} {:>18}  {}", grouped(b), human(b)));
    }
    let idx: u64 = p.indexer_pool_bytes.iter().sum();
    let label = format!("indexer ({}, {} blocks)", p.layout.indexer.name(), grouped(p.max_blocks as u64));
    line(format!("    {label:<30} {:>18}  {}", grouped(idx), human(idx)));
    line(format!("    {:<30} {:>18}", "overhead", grouped(p.overhead_bytes)));
    line(format!("    {:<30} {:>18}", "alignment padding", grouped(p.total_bytes - p.overhead_bytes - raw)));
    line(format!(
        "    {:<30} {:>18}  {} ({} B of the budget unused)",
        "total",
        grouped(p.total_bytes),
        human(p.total_bytes),
        grouped(p.budget_bytes - p.total_bytes)
    ));
    line(format!(
        "  checkpoint image   {:>18} B   {} units",
        grouped(report.image_bytes),
        report.units_per_checkpoint
    ));
    line(format!("  layout id: {}", report.layout_id));
    // What each row format holds at this budget and slot count (one formula, the spec's tight
    // fit, for every format, so the gain between two is like for like).
    if let Ok(caps) = p.capacity_by_format() {
        let here = caps.iter().find(|c| c.format == p.layout.kv.named_format()).copied();
        line(
            "  KV bytes per token by row format (spec tight fit at this budget and slot count):".to_string(),
        );
        for c in &caps {
            let gain = here.map_or(String::new(), |h| {
                let d = c.tokens(m.block_size) - h.tokens(m.block_size);
                let pct = 100.0 * d as f64 / h.tokens(m.block_size).max(1) as f64;
                if c.format == h.format {
                    "(this plan)".to_string()
                } else {
                    format!("{d:+} tokens ({pct:+.1} %)")
                }
            });
            let bytes = if c.block_row_bytes == c.window_row_bytes {
                format!("{} B", c.block_row_bytes)
            } else {
                format!("{} B compressed, {} B window", c.block_row_bytes, c.window_row_bytes)
            };
            line(format!(
                "    {:<17} {:<32} {:>9} blocks {:>14} tokens  {}",
                c.format.format().name,
                bytes,
                grouped(c.tight_fit_blocks as u64),
                grouped(c.tokens(m.block_size) as u64),
                gain,
            ));
        }
    }
    s
}

/// `1234567` → `1,234,567`.
fn grouped(n: u64) -> String {
    let d = n.to_string();
    let mut out = String::with_capacity(d.len() + d.len() / 3);
    for (i, c) in d.chars().enumerate() {
        if i > 0 && (d.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes in the largest binary unit that keeps a value ≥ 1, two decimals.
fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut i = 0;
    while i + 1 < units.len() && n >= 1u64 << (10 * (i + 1)) {
        i += 1;
    }
    format!("{:.2} {}", n as f64 / (1u64 << (10 * i)) as f64, units[i])
}

/// Run `v4pool plan` with `args` (without the word `plan`); returns the exit status.
pub(crate) fn run(args: &[String], io: &mut Streams<'_>) -> i32 {
    let json = args.iter().any(|a| a == "--json");
    let result = execute(args).and_then(|report| match report {
        Some(r) if json => io.print(&r.to_json().to_string()),
        Some(r) => io.print(to_text(&r).trim_end_matches('\n')),
        None => io.print(USAGE),
    });
    conclude("v4pool plan", result, json, io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flash_k1_report_matches_the_plan() {
        let r = execute(&args("--model v4-flash --budget 100GiB --max-seqs 256 --spec-steps 1 --json"))
            .unwrap()
            .unwrap();
        let j = r.to_json();
        assert_eq!(j["page_bytes"], 1_063_168);
        assert_eq!(j["slot_bytes"], 17_661_440);
        assert_eq!(j["num_slots"], 256);
        assert_eq!(j["tight_fit_blocks"], 96_741);
        assert_eq!(j["image_bytes"], 5_568_000);
        assert_eq!(j["units_per_checkpoint"], 6);
        let blocks = j["num_blocks"].as_i64().unwrap();
        assert!(blocks <= 96_741 && blocks > 95_000);
        assert_eq!(j["tokens"].as_i64().unwrap(), blocks * 256);
        assert!(j["total_bytes"].as_u64().unwrap() <= 100 << 30);
        let planes: Vec<u64> =
            j["plane_bytes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let rows = j["plane_rows"].as_u64().unwrap();
        assert_eq!(planes, vec![rows * 512, rows * 128]);
        // The spec the pool carries: the defaults every capacity and binding takes.
        let k = &j["kv_spec"];
        assert_eq!((&k["window"], &k["index_topk"], &k["spec_steps"]), (&json!(128), &json!(512), &json!(1)));
        assert_eq!(
            (&k["kv_dtype"], &k["row_format"], &k["packed"]),
            (&json!("fp8"), &json!("atom-fp8"), &json!(null))
        );
        let text = to_text(&r);
        assert!(text.contains("1,063,168"));
        assert!(text.contains("layout id: dsv4-paged-state-v3:block=256:ring=129:"));
    }

    #[test]
    fn options_and_defaults() {
        let r = execute(&args(
            "--model=v4-pro --budget 80GB --max-seqs=64 --dtype bf16 --indexer fp4 --min-slots 64",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(r.plan.layout.kv, v4pool::sizing::KvDtype::Bf16);
        assert_eq!(r.plan.layout.indexer, IndexerDtype::Fp4);
        assert_eq!(r.plan.max_blocks, r.plan.num_blocks);
        assert_eq!(r.plan.budget_bytes, 80_000_000_000);
        assert!(execute(&args("--help")).unwrap().is_none());
        let o =
            execute(&args("--model v4-flash --budget 10GiB --max-seqs 8 --overhead 1GiB")).unwrap().unwrap();
        assert_eq!(o.plan.overhead_bytes, 1 << 30);
    }

    #[test]
    fn invalid_input_is_typed() {
        let e = |s: &str| execute(&args(s)).unwrap_err().variant_name();
        assert_eq!(e("--budget 1GiB --max-seqs 1"), "MissingOption");
        assert_eq!(e("--model v4-flash --max-seqs 1"), "MissingOption");
        assert_eq!(e("--model v4-flash --budget 1GiB"), "MissingOption");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs x"), "BadValue");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 1 --dtype fp16"), "BadValue");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 1 --indexer int8"), "BadValue");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 1 --bogus 3"), "UnknownFlag");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 1 extra"), "Unexpected");
        assert_eq!(e("--model v4-flash --model v4-pro --budget 1GiB --max-seqs 1"), "Duplicate");
        assert_eq!(e("--model v4-flash --budget --max-seqs 1"), "MissingValue");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 1 --json=yes"), "FlagWithValue");
        assert_eq!(e("--json --json"), "Duplicate");
        assert_eq!(e("--model v4-flash --budget 12XB --max-seqs 1"), "UnknownUnit");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 256"), "BudgetTooSmall");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 0"), "NoSlots");
        assert_eq!(e("--model v4-mini --budget 1GiB --max-seqs 1"), "UnknownPreset");
        assert_eq!(e("--model v4-flash --budget 1GiB --max-seqs 1 --spec-steps -1"), "SpecSteps");
        assert_eq!(e("--model /nonexistent/config.json --budget 1GiB --max-seqs 1"), "Io");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut io = Streams { out: &mut out, err: &mut err };
        assert_eq!(run(&args("--model v4-flash --budget 1GiB --max-seqs 256 --json"), &mut io), 2);
        assert_eq!(run(&args("--model v4-flash --budget 1GiB --max-seqs 256"), &mut io), 2);
    }

    #[test]
    fn number_formatting() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1_000), "1,000");
        assert_eq!(grouped(107_374_182_400), "107,374,182,400");
        assert_eq!(human(100 << 30), "100.00 GiB");
        assert_eq!(human(512), "512.00 B");
    }
}
