//! Rendering `v4pool simulate`'s figures: a table, one JSON object, an SVG picture.

use std::fmt::Write as _;
use v4pool::sim::{Sample, SimConfig, SimReport};

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

/// The numbers as one JSON object.
pub(crate) fn to_json(cfg: &SimConfig, reports: &[SimReport]) -> serde_json::Value {
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
            });
            if let (Some(o), serde_json::Value::Object(extra)) = (run.as_object_mut(), reuse) {
                o.extend(extra);
            }
            run
        })
        .collect();
    json!({"mix": cfg.mix.name(), "rate": cfg.rate, "steps": cfg.steps, "seed": cfg.seed,
           "max_seqs": cfg.max_seqs, "runs": runs})
}

/// Memory by region over time (one panel per run) and the row space at the end.
pub(crate) fn to_svg(reports: &[SimReport]) -> String {
    let (w, ph, gap) = (900.0f64, 220.0f64, 70.0f64);
    let h = 40.0 + reports.len() as f64 * (ph + gap) + 90.0;
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
        r#"<text x="20" y="24" font-size="15">v4pool simulate — plane rows by region over time</text>"#
    );
    for (k, r) in reports.iter().enumerate() {
        let top = 40.0 + k as f64 * (ph + gap);
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
    let ytop = 40.0 + reports.len() as f64 * (ph + gap);
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
