//! Rendering `v4pool simulate`'s figures: a table, one JSON object, an SVG picture.

use std::fmt::Write as _;
use v4pool::sim::{LatencyHistogram, Sample, SimConfig, SimReport, TimeReport};

/// `p50 / p90 / p99` of a latency histogram, in ms or s.
fn pcts(h: &LatencyHistogram) -> String {
    let (a, b, c) = TimeReport::percentiles(h);
    if c >= 10_000.0 {
        format!("{:.1}/{:.1}/{:.1} s", a / 1e3, b / 1e3, c / 1e3)
    } else {
        format!("{a:.0}/{b:.0}/{c:.0}")
    }
}

/// Render a report pair as a readable table.
pub(crate) fn render_table(reports: &[SimReport]) -> String {
    let mut s = String::new();
    let row = |s: &mut String, name: &str, f: &dyn Fn(&SimReport) -> String| {
        let _ = write!(s, "  {name:<34}");
        for r in reports {
            let _ = write!(s, "{:>18}", f(r));
        }
        s.push('\n');
    };
    row(&mut s, "policy", &|r| r.policy.clone());
    if reports.iter().any(|r| r.time.is_some()) {
        let t = |r: &SimReport| r.time.clone().unwrap_or_default();
        row(&mut s, "TTFT ms p50/p90/p99", &|r| pcts(&t(r).ttft_ms));
        row(&mut s, "TPOT ms p50/p90/p99", &|r| pcts(&t(r).tpot_ms));
        row(&mut s, "end-to-end ms p50/p90/p99", &|r| pcts(&t(r).e2e_ms));
        row(&mut s, "tok/s/GPU (in+out) / out", &|r| {
            format!("{:.0} / {:.0}", t(r).tok_s_gpu, t(r).out_tok_s_gpu)
        });
        row(&mut s, "goodput req/s (tok/s/GPU)", &|r| {
            format!("{:.3} ({:.0})", t(r).goodput_rps, t(r).goodput_tok_s_gpu)
        });
        row(&mut s, "within target / TTFT censored", &|r| {
            format!("{} / {}", t(r).within_slo, t(r).ttft_censored)
        });
        row(&mut s, "seconds simulated / busy", &|r| format!("{:.0} / {:.2}", t(r).duration_s, t(r).busy));
        row(&mut s, "hit tokens / input tokens", &|r| {
            format!("{:.3}", r.prefix_hit_tokens as f64 / r.input_tokens.max(1) as f64)
        });
        row(&mut s, "host tier GiB restored", &|r| {
            format!("{:.2}", t(r).restored_bytes as f64 / (1u64 << 30) as f64)
        });
    }
    row(&mut s, "requests arrived", &|r| r.arrived.to_string());
    row(&mut s, "requests completed", &|r| r.completed.to_string());
    row(&mut s, "refused (never fit) / turned away", &|r| format!("{} / {}", r.refused, r.turned_away));
    row(&mut s, "tokens generated", &|r| r.generated_tokens.to_string());
    row(&mut s, "tokens prefilled", &|r| r.prefilled_tokens.to_string());
    row(&mut s, "preemptions", &|r| r.preemptions.to_string());
    row(&mut s, "recomputed prefill tokens", &|r| r.recomputed_prefill_tokens.to_string());
    row(&mut s, "prefix hit rate", &|r| format!("{:.3}", r.prefix_hit_rate));
    row(&mut s, "prefill tokens saved", &|r| r.prefill_tokens_saved.to_string());
    row(&mut s, "checkpoints stored / MiB max", &|r| {
        format!("{} / {:.0}", r.checkpoints_stored, r.max_checkpoint_bytes as f64 / (1u64 << 20) as f64)
    });
    row(&mut s, "evictions block / checkpoint", &|r| {
        format!("{} / {}", r.evicted_blocks, r.evicted_checkpoints)
    });
    row(&mut s, "concurrency max / mean", &|r| format!("{} / {:.1}", r.max_running, r.mean_running));
    row(&mut s, "compressed tokens max", &|r| r.max_compressed_tokens.to_string());
    row(&mut s, "compressed tokens mean", &|r| format!("{:.0}", r.mean_compressed_tokens));
    row(&mut s, "mean queue wait per admission", &|r| format!("{:.1}", r.mean_wait_steps));
    row(&mut s, "mean queue wait per request", &|r| format!("{:.1}", r.mean_queue_steps));
    row(&mut s, "boundary moves", &|r| r.boundary_moves.to_string());
    row(&mut s, "relocations block / slot", &|r| format!("{} / {}", r.block_relocations, r.slot_relocations));
    row(&mut s, "index build µs mean / p99", &|r| {
        format!("{:.1} / {:.1}", r.index_build_mean_us, r.index_build_p99_us)
    });
    row(&mut s, "staging µs mean (with tables)", &|r| format!("{:.1}", r.stage_mean_us));
    row(&mut s, "blocks used/num at the end", &|r| format!("{}/{}", r.final_split.1, r.final_split.0));
    row(&mut s, "slots used/num at the end", &|r| format!("{}/{}", r.final_split.3, r.final_split.2));
    s
}

/// The time figures of a run as one JSON object.
fn time_json(t: &TimeReport) -> serde_json::Value {
    use serde_json::json;
    let h = |h: &LatencyHistogram| {
        let (p50, p90, p99) = TimeReport::percentiles(h);
        json!({"p50": p50, "p90": p90, "p99": p99, "mean": h.mean(), "max": h.max(), "count": h.count()})
    };
    json!({"cost": t.cost, "gpus": t.gpus, "duration_s": t.duration_s,
           "ttft_ms": h(&t.ttft_ms), "ttft_censored": t.ttft_censored,
           "tpot_ms": h(&t.tpot_ms), "e2e_ms": h(&t.e2e_ms),
           "tok_s_gpu": t.tok_s_gpu, "out_tok_s_gpu": t.out_tok_s_gpu,
           "goodput": {"rps": t.goodput_rps, "tok_s_gpu": t.goodput_tok_s_gpu, "within": t.within_slo,
                       "ttft_ms": t.slo_ttft_ms, "tpot_ms": t.slo_tpot_ms},
           "busy": t.busy, "host_tier_restored_bytes": t.restored_bytes})
}

/// The numbers as one JSON object (`ceiling`: a trace's (hit, all) 512-token blocks).
pub(crate) fn to_json(
    cfg: &SimConfig,
    reports: &[SimReport],
    ceiling: Option<(u64, u64)>,
) -> serde_json::Value {
    use serde_json::json;
    let runs: Vec<serde_json::Value> = reports
        .iter()
        .map(|r| {
            let mut run = json!({
                "policy": r.policy, "backend": r.backend, "steps": r.steps,
                "arrived": r.arrived, "completed": r.completed,
                "refused": r.refused, "turned_away": r.turned_away,
                "generated_tokens": r.generated_tokens, "prefilled_tokens": r.prefilled_tokens,
                "preemptions": r.preemptions, "max_running": r.max_running,
                "mean_running": r.mean_running, "max_compressed_tokens": r.max_compressed_tokens,
                "mean_compressed_tokens": r.mean_compressed_tokens,
                "boundary_moves": r.boundary_moves, "block_relocations": r.block_relocations,
                "slot_relocations": r.slot_relocations, "mean_wait_steps": r.mean_wait_steps,
                "mean_queue_steps": r.mean_queue_steps,
                "index_build": {"steps": r.index_build_steps, "mean_us": r.index_build_mean_us,
                                "p99_us": r.index_build_p99_us, "max_us": r.index_build_max_us,
                                "stage_mean_us": r.stage_mean_us},
                "plane_rows": r.plane_rows, "envelope_rows": r.envelope_rows, "slot_rows": r.slot_rows,
                "final": {"num_blocks": r.final_split.0, "used_blocks": r.final_split.1,
                          "num_slots": r.final_split.2, "used_slots": r.final_split.3},
                "samples": r.samples.iter().map(|s| json!({
                    "step": s.step, "block_rows_used": s.block_rows_used,
                    "block_rows_free": s.block_rows_free, "slot_rows_used": s.slot_rows_used,
                    "slot_rows_free": s.slot_rows_free, "gap_rows": s.gap_rows,
                    "running": s.running, "waiting": s.waiting,
                    "compressed_tokens": s.compressed_tokens})).collect::<Vec<_>>(),
            });
            // Prefix reuse (a second object: one `json!` this long passes the macro's recursion limit).
            let reuse = json!({
                "prefix_hit_rate": r.prefix_hit_rate, "prefix_hit_tokens": r.prefix_hit_tokens,
                "eligible_prefix_tokens": r.eligible_prefix_tokens,
                "prefill_tokens_saved": r.prefill_tokens_saved,
                "recomputed_prefill_tokens": r.recomputed_prefill_tokens, "hits": r.hits,
                "checkpoints_stored": r.checkpoints_stored,
                "checkpoint_bytes_held": r.checkpoint_bytes_held,
                "max_checkpoint_bytes": r.max_checkpoint_bytes,
                "evictions": {"blocks": r.evicted_blocks, "checkpoints": r.evicted_checkpoints},
                "input_tokens": r.input_tokens,
                "time": r.time.as_ref().map(time_json),
            });
            if let (Some(o), serde_json::Value::Object(extra)) = (run.as_object_mut(), reuse) {
                o.extend(extra);
            }
            run
        })
        .collect();
    let trace = ceiling.map(|(hit, all)| {
        json!({"ceiling_blocks": hit, "blocks": all,
        "ceiling": hit as f64 / all.max(1) as f64, "block_tokens": 512})
    });
    json!({"mix": cfg.mix.name(), "rate": cfg.rate, "steps": cfg.steps, "seed": cfg.seed,
           "max_seqs": cfg.max_seqs, "in_time": cfg.time.is_some(), "trace": trace, "runs": runs})
}

/// Memory by region over time (one panel per run) and the row space at the end.
pub(crate) fn to_svg(reports: &[SimReport]) -> String {
    let (w, ph, gap) = (900.0f64, 220.0f64, 70.0f64);
    let cdf_h = if reports.iter().any(|r| r.time.is_some()) { 260.0 } else { 0.0 };
    let h = 40.0 + cdf_h + reports.len() as f64 * (ph + gap) + 90.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let colors = [
        ("blocks used", "#1f77b4"),
        ("blocks free", "#aec7e8"),
        ("gap", "#eeeeee"),
        ("slots free", "#ffbb78"),
        ("slots used", "#ff7f0e"),
    ];
    let _ = writeln!(
        s,
        r#"<text x="20" y="24" font-size="15">v4pool simulate — latency CDFs, and plane rows by region over time</text>"#
    );
    if cdf_h > 0.0 {
        latency_cdfs(&mut s, reports, w);
    }
    for (k, r) in reports.iter().enumerate() {
        let top = 40.0 + cdf_h + k as f64 * (ph + gap);
        let (x0, pw) = (60.0, w - 80.0);
        let _ = writeln!(s, r#"<text x="{x0}" y="{}">{} ({})</text>"#, top + 12.0, r.policy, r.backend);
        let n = r.samples.len().max(2) as f64 - 1.0;
        let total = r.plane_rows.max(1) as f64;
        // Stack bottom-up in row-space order: blocks from row 0, the gap, slots at the top.
        let layers: [fn(&Sample) -> i64; 5] = [
            |x| x.block_rows_used,
            |x| x.block_rows_free,
            |x| x.gap_rows,
            |x| x.slot_rows_free,
            |x| x.slot_rows_used,
        ];
        let mut base = vec![0f64; r.samples.len()];
        for (li, f) in layers.iter().enumerate() {
            let mut pts = String::new();
            let upper: Vec<f64> = r.samples.iter().zip(&base).map(|(x, b)| b + f(x) as f64).collect();
            for (i, u) in upper.iter().enumerate() {
                let _ =
                    write!(pts, "{:.1},{:.1} ", x0 + pw * i as f64 / n, top + 20.0 + ph * (1.0 - u / total));
            }
            for (i, b) in base.iter().enumerate().rev() {
                let _ =
                    write!(pts, "{:.1},{:.1} ", x0 + pw * i as f64 / n, top + 20.0 + ph * (1.0 - b / total));
            }
            let _ = writeln!(s, r#"<polygon points="{pts}" fill="{}" stroke="none"/>"#, colors[li].1);
            base = upper;
        }
        let _ = writeln!(
            s,
            r#"<rect x="{x0}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#,
            top + 20.0
        );
        let _ = writeln!(s, r#"<text x="10" y="{}">row 0</text>"#, top + 20.0 + ph);
        let _ = writeln!(s, r#"<text x="10" y="{}">top</text>"#, top + 30.0);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">step {}</text>"#,
            x0 + pw,
            top + ph + 36.0,
            r.steps
        );
    }
    // The row space at the end of each run, as a strip.
    let ytop = 40.0 + cdf_h + reports.len() as f64 * (ph + gap);
    for (k, r) in reports.iter().enumerate() {
        let y = ytop + k as f64 * 22.0;
        let (x0, pw) = (140.0, w - 160.0);
        let total = r.plane_rows.max(1) as f64;
        let (nb, ub, ns, us) = r.final_split;
        let seg = [
            (i64::from(ub) * r.envelope_rows, colors[0].1),
            (i64::from(nb - ub) * r.envelope_rows, colors[1].1),
            (r.plane_rows - i64::from(nb) * r.envelope_rows - i64::from(ns) * r.slot_rows, colors[2].1),
            (i64::from(ns - us) * r.slot_rows, colors[3].1),
            (i64::from(us) * r.slot_rows, colors[4].1),
        ];
        let _ = writeln!(s, r#"<text x="10" y="{}">row space, {}</text>"#, y + 13.0, r.policy);
        let mut x = x0;
        for (rows, color) in seg {
            let wd = pw * rows.max(0) as f64 / total;
            let _ = writeln!(s, r#"<rect x="{x:.1}" y="{y}" width="{wd:.1}" height="16" fill="{color}"/>"#);
            x += wd;
        }
    }
    let ly = ytop + reports.len() as f64 * 22.0 + 14.0;
    for (i, (name, color)) in colors.iter().enumerate() {
        let x = 20.0 + i as f64 * 150.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{ly}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
            x + 16.0,
            ly + 11.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Run colours of the CDF panels.
const RUN_COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

/// Two panels side by side: the TTFT and TPOT CDFs of every run, on a log time axis.
fn latency_cdfs(s: &mut String, reports: &[SimReport], w: f64) {
    let (top, ph) = (50.0, 190.0);
    let pw = (w - 120.0) / 2.0;
    type Pick = fn(&TimeReport) -> &LatencyHistogram;
    let panels: [(&str, Pick); 2] = [("TTFT (ms, log)", |t| &t.ttft_ms), ("TPOT (ms, log)", |t| &t.tpot_ms)];
    for (k, (title, pick)) in panels.iter().enumerate() {
        let x0 = 50.0 + k as f64 * (pw + 40.0);
        let all: Vec<(f64, f64)> =
            reports.iter().filter_map(|r| r.time.as_ref()).flat_map(|t| pick(t).cdf()).collect();
        let lo = all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min).max(1e-3);
        let hi = all.iter().map(|p| p.0).fold(0.0f64, f64::max).max(lo * 10.0);
        let (la, lb) = (lo.log10().floor(), hi.log10().ceil());
        let x = |v: f64| x0 + pw * (v.max(lo).log10() - la) / (lb - la).max(1e-9);
        let _ = writeln!(
            s,
            r#"<text x="{x0}" y="{}">{title} — fraction of requests at or below</text>"#,
            top - 6.0
        );
        let _ = writeln!(
            s,
            r#"<rect x="{x0}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let mut d = la as i32;
        while d <= lb as i32 {
            let xv = x(10f64.powi(d));
            let _ = writeln!(
                s,
                r##"<line x1="{xv:.1}" y1="{top}" x2="{xv:.1}" y2="{}" stroke="#dddddd"/>"##,
                top + ph
            );
            let _ =
                writeln!(s, r#"<text x="{xv:.1}" y="{}" text-anchor="middle">1e{d}</text>"#, top + ph + 14.0);
            d += 1;
        }
        for (i, r) in reports.iter().enumerate() {
            let Some(t) = &r.time else { continue };
            let mut pts = format!("{:.1},{:.1} ", x0, top + ph);
            for (v, f) in pick(t).cdf() {
                let _ = write!(pts, "{:.1},{:.1} ", x(v), top + ph * (1.0 - f));
            }
            let c = RUN_COLORS[i % RUN_COLORS.len()];
            let _ = writeln!(s, r#"<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5"/>"#);
            if k == 0 {
                let ly = top + 14.0 + i as f64 * 14.0;
                let _ = writeln!(s, r#"<text x="{}" y="{ly}" fill="{c}">{}</text>"#, x0 + 8.0, r.policy);
            }
        }
    }
}
