//! `v4pool layout`: the row-space geometry of a model or ratio list, as a table or JSON.
//!
//! The JSON keys are the spec's names, so a layout printed here can be compared field for
//! field with `v4_pool_geometry.py`.

use crate::{conclude, parse_args, CliError, ParsedArgs, Streams};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::Path;
use v4pool::geometry::{GeometrySpec, UnifiedPoolGeometry, ABSENT_RATIO};
use v4pool::model::{DraftMode, Drafts, ModelError, ModelShape};
use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};

/// The dtype whose planes a ratio list without `--dtype` is priced at: ATOM's fp8 rows, NoPE
/// and RoPE planes (`pool-runtime.md` §1).
const PRICED_DTYPE: KvDtype = KvDtype::Fp8;
/// Most groups `--json` lists in `physical_slots`; real pools hold a few thousand slots, and
/// the bound keeps a hostile `--slots` from building a list the size of the plane.
pub(crate) const MAX_LISTED_SLOTS: i64 = 1 << 20;
const DEFAULT_BLOCK_SIZE: i64 = v4pool::model::V4_BLOCK_SIZE;

const OPTIONS: [&str; 15] = [
    "--model",
    "--dtype",
    "--ratios",
    "--kv-sources",
    "--blocks",
    "--slots",
    "--ring",
    "--block-size",
    "--plane-rows",
    "--arena-rows",
    "--slot-positions",
    "--slot-align-rows",
    "--spec-steps",
    "--draft-stages",
    "--draft-mode",
];
const FLAGS: [&str; 2] = ["--json", "--help"];

const USAGE: &str = "\
usage: v4pool layout (--model NAME|PATH | --ratios R,R,... [--kv-sources L,L,...])
                     --blocks N --slots S
                     [--ring R] [--block-size B] [--plane-rows P] [--arena-rows A]
                     [--slot-positions Q] [--slot-align-rows K] [--spec-steps K]
                     [--draft-stages N [--draft-mode absent|dense]]
                     [--dtype fp8|bf16|flashmla-v4|flashmla-v4-p2|flashmla-v41|flashmla-v41-fp4] [--json]

  --model    a preset (v4-flash, v4-pro, v4-flash-dspark, v4-pro-dspark, ...-dspark-dense,
             v4.1-flash, v4.1-flash-dspark)
             or a config.json (or the folder holding one)
  --ratios   a ratio list (0 dense, any positive ratio dividing the block, -1 absent); needs --ring
  --kv-sources  with --ratios: the source layers of shared compressors (V4.1's
             kv_source_layer_ids), laid out in the compact form as a V4.1 model is
  --ring     ring slots (default: the model's window + --spec-steps)
  --block-size  tokens per block (default 256)
  --draft-stages, --draft-mode  DSpark drafts appended to a config.json's trunk
  --dtype    with --model: the pool's row format lays the geometry out as a pool carves it
             (the model's compressor arena and slot alignment at the format's planes; a
             paged format's envelopes, slots and arena in whole pages) and prices its planes
  --json     one JSON object with the spec's names; errors as {\"error\", \"message\"}";

/// Run `v4pool layout`; returns the exit status.
pub(crate) fn run(args: &[String], io: &mut Streams<'_>) -> i32 {
    // Known before parsing, so even a parse error comes out in the form asked for.
    let json = args.iter().any(|a| a == "--json");
    let result = layout(args).and_then(|text| io.print(text.as_deref().unwrap_or(USAGE)));
    conclude("v4pool layout", result, json, io)
}

/// The text `run` prints on success, or `None` for `--help`.
fn layout(args: &[String]) -> Result<Option<String>, CliError> {
    let parsed = parse_args(args, &OPTIONS, &FLAGS)?;
    if parsed.flag("--help") {
        return Ok(None);
    }
    let (name, spec, kv) = geometry_spec(&parsed)?;
    let json = parsed.flag("--json");
    if json && spec.num_slots > MAX_LISTED_SLOTS {
        return Err(CliError::TooLarge { what: "--slots", got: spec.num_slots, max: MAX_LISTED_SLOTS });
    }
    let geometry = spec.build()?;
    Ok(Some(if json {
        let mut v = layout_json(&geometry)?;
        if let (Some(kv), Some(obj)) = (kv, v.as_object_mut()) {
            obj.insert("kv_dtype".into(), json!(kv.name()));
            obj.insert("row_format".into(), json!(kv.row_format().format().name));
            obj.insert("compressed_row_format".into(), json!(kv.named_format().format().name));
            obj.insert("compressed_row_bytes".into(), json!(kv.compressed_row_bytes()));
            obj.insert("plane_widths".into(), json!(kv.plane_widths()));
            obj.insert("page_rows".into(), json!(kv.page_rows()));
            let views: serde_json::Map<String, Value> = page_views(&geometry, kv)?
                .into_iter()
                .map(|(ratio, n)| (class_name(ratio).to_string(), json!(n)))
                .collect();
            obj.insert("kernel_page_views".into(), Value::Object(views));
        }
        v.to_string()
    } else {
        layout_table(&name, &geometry, kv)?
    }))
}

/// The model (or ratio list) and the options, as geometry arguments, a display name and the
/// row format asked for.
fn geometry_spec(p: &ParsedArgs) -> Result<(String, GeometrySpec, Option<KvDtype>), CliError> {
    let model = match (p.get("--model"), p.get("--ratios")) {
        (Some(_), Some(_)) => return Err(CliError::Conflict { a: "--model", b: "--ratios" }),
        (None, None) => return Err(CliError::MissingOption { flag: "--model" }),
        // A model brings its own sources (a config's kv_source_layer_ids).
        (Some(_), None) if p.get("--kv-sources").is_some() => {
            return Err(CliError::Conflict { a: "--kv-sources", b: "--model" })
        }
        (Some(m), None) => Some(load_model(m, p)?),
        (None, Some(_)) => {
            // The arena and slot alignment a format needs come from a model's compressors.
            for flag in ["--spec-steps", "--draft-stages", "--draft-mode", "--dtype"] {
                if p.get(flag).is_some() {
                    return Err(CliError::Conflict { a: flag, b: "--ratios" });
                }
            }
            None
        }
    };
    let kv = crate::kv_dtype(p)?;
    let num_blocks = p.required_i64("--blocks")?;
    let num_slots = p.required_i64("--slots")?;
    // A model brings its source layers and row form (V4.1) with its ratios.
    let (name, base, ring_default) = match model {
        Some(m) => {
            let ring = m.ring_slots();
            let mut spec = m.geometry_spec(num_blocks, num_slots);
            if let Some(kv) = kv {
                // The pool's own layout rules (one place: sizing::PoolLayout), at this split.
                let l = PoolLayout::new(&m, kv, IndexerDtype::Fp8)?;
                spec = spec
                    .arena_rows(l.geometry.arena_rows)
                    .slot_align_rows(l.geometry.slot_align_rows)
                    .envelope_align_rows(kv.page_rows());
                spec.packed_rows = l.geometry.packed_rows;
            }
            (m.name.clone(), spec, Some(ring))
        }
        None => {
            let ratios = p.i32_list("--ratios")?.unwrap_or_default();
            let sources = p.usize_list("--kv-sources")?.unwrap_or_default();
            let spec = GeometrySpec::new(ratios, num_blocks, num_slots, 0, DEFAULT_BLOCK_SIZE)
                .shared_compressors(sources);
            ("ratios".to_string(), spec, None)
        }
    };
    let ring = match (p.i64("--ring")?, ring_default) {
        (Some(r), _) | (None, Some(r)) => r,
        (None, None) => return Err(CliError::MissingOption { flag: "--ring" }),
    };
    let block_size = p.i64("--block-size")?.unwrap_or(base.block_size);
    let mut spec = base;
    spec.ring_slots = ring;
    spec.block_size = block_size;
    if let Some(v) = p.i64("--plane-rows")? {
        spec = spec.plane_rows(v);
    }
    if let Some(v) = p.i64("--arena-rows")? {
        spec = spec.arena_rows(v);
    }
    if let Some(v) = p.i64("--slot-positions")? {
        spec = spec.slot_positions(v);
    }
    if let Some(v) = p.i64("--slot-align-rows")? {
        spec = spec.slot_align_rows(v);
    }
    Ok((name, spec, kv))
}

/// A preset by name, else a config.json path (or a folder holding one).
pub(crate) fn load_model(arg: &str, p: &ParsedArgs) -> Result<ModelShape, CliError> {
    let spec_steps = p.i64("--spec-steps")?.unwrap_or(v4pool::model::DEFAULT_SPEC_STEPS);
    let drafts = match (p.i64("--draft-stages")?, p.get("--draft-mode")) {
        (None, None) => None,
        (None, Some(_)) => return Err(CliError::MissingOption { flag: "--draft-stages" }),
        (Some(stages), mode) => {
            let mode = match mode.unwrap_or("absent") {
                "absent" => DraftMode::Absent,
                "dense" => DraftMode::Dense,
                other => {
                    return Err(CliError::BadValue {
                        flag: "--draft-mode".to_string(),
                        value: other.to_string(),
                        expected: "absent or dense",
                    })
                }
            };
            let stages = usize::try_from(stages).map_err(|_| CliError::BadValue {
                flag: "--draft-stages".to_string(),
                value: stages.to_string(),
                expected: "a non-negative count",
            })?;
            Some(Drafts { stages, mode })
        }
    };
    match ModelShape::by_name(arg, spec_steps) {
        Err(ModelError::UnknownPreset { .. }) if looks_like_path(arg) => {}
        Ok(_) if drafts.is_some() => return Err(CliError::Conflict { a: "--draft-stages", b: "a preset" }),
        other => return Ok(other?),
    }
    // Bounded: regular files only, at most MAX_CONFIG_BYTES (a FIFO or a device is refused).
    Ok(ModelShape::from_config_path(Path::new(arg), spec_steps, drafts)?.shape)
}

fn looks_like_path(arg: &str) -> bool {
    arg.contains('/') || arg.contains('\\') || arg.ends_with(".json") || Path::new(arg).exists()
}

/// The layout under the spec's names (see the module docs).
pub(crate) fn layout_json(g: &UnifiedPoolGeometry) -> Result<Value, CliError> {
    let mut classes = Vec::new();
    for &ratio in &g.entry_order {
        let Some(c) = g.class(ratio) else { continue };
        let w = g.window_params(ratio)?;
        classes.push(json!({
            "ratio": c.ratio,
            "layers": c.layers,
            "block_rows": c.block_rows,
            "ring_stride": c.ring_stride,
            "ring_slots": c.ring_slots,
            "envelope_offset": c.envelope_offset,
            "entry_offset": c.entry_offset,
            "envelope_rows": c.envelope_rows(),
            "entry_rows": c.entry_rows(),
            "window_params": {
                "ring_start": w.ring_start,
                "slot_rows": w.slot_rows,
                "ring_slots": w.ring_slots,
                "ring_stride": w.ring_stride,
                "run_rows": w.run_rows,
            },
        }));
    }
    let mut layers = Vec::with_capacity(g.num_layers);
    for (layer, &ratio) in g.ratios.iter().enumerate() {
        let (base, view) = if ratio == ABSENT_RATIO {
            (Value::Null, Value::Null)
        } else {
            (json!(g.layer_base_row(layer)?), json!(g.layer_view_rows(layer)?))
        };
        layers.push(json!({ "layer": layer, "ratio": ratio, "base_row": base, "view_rows": view }));
    }
    let physical_slots =
        (0..g.num_slots).map(|group| g.physical_slot(group)).collect::<Result<Vec<_>, _>>()?;
    let mut out = json!({
        "ratios": g.ratios,
        "num_blocks": g.num_blocks,
        "num_slots": g.num_slots,
        "ring_slots": g.ring_slots,
        "block_size": g.block_size,
        "arena_rows": g.arena_rows,
        "slot_align_rows": g.slot_align_rows,
        "envelope_rows": g.envelope_rows,
        "entry_rows": g.entry_rows,
        "slot_rows": g.slot_rows,
        "plane_rows": g.plane_rows,
        "slot_positions": g.slot_positions,
        "slot_origin": g.slot_origin,
        "classes": classes,
        "layers": layers,
        "physical_slots": physical_slots,
    });
    // Shared compressors (V4.1) only: V4's JSON stays as it was.
    if let (Some(src), Some(obj)) = (&g.kv_sources, out.as_object_mut()) {
        obj.insert("kv_sources".into(), json!(src));
        obj.insert("form".into(), json!(format!("{:?}", g.form).to_lowercase()));
        obj.insert("owners".into(), json!(g.owners));
        obj.insert("compress_bias".into(), json!(g.compress_bias));
        obj.insert("view_lead_rows".into(), json!(g.view_lead_rows));
    }
    Ok(out)
}

/// Per class (entry order), the distinct page shifts of its layers' views in the pages an
/// attention kernel reads the row format in (`kernel_page_rows`, `UnifiedPoolGeometry::layer_page`):
/// the index operands a FlashMLA decode path writes for the class (V4-Flash's HCA: 20 in pages of
/// 64, 1 in pages of 2). A view starting in the lead has no page and counts as none.
fn page_views(g: &UnifiedPoolGeometry, kv: KvDtype) -> Result<Vec<(i32, usize)>, CliError> {
    let page = kv.row_format().format().kernel_page_rows as i64;
    let mut out = Vec::new();
    for &ratio in &g.entry_order {
        let Some(c) = g.class(ratio) else { continue };
        let mut shifts = std::collections::BTreeSet::new();
        for &l in &c.layers {
            if let Some((_, shift)) = g.layer_page(l, page)? {
                shifts.insert(shift);
            }
        }
        out.push((ratio, shifts.len()));
    }
    Ok(out)
}

fn class_name(ratio: i32) -> &'static str {
    match ratio {
        0 => "dense",
        4 => "CSA",
        128 => "HCA",
        _ => "class",
    }
}

/// The readable form: totals, one line per class, per-layer base rows, plane bytes.
pub(crate) fn layout_table(
    name: &str,
    g: &UnifiedPoolGeometry,
    kv: Option<KvDtype>,
) -> Result<String, CliError> {
    let mut out = String::new();
    // Writing to a String cannot fail; the results are dropped deliberately.
    let ratios: Vec<String> = g.ratios.iter().map(|r| r.to_string()).collect();
    let _ = writeln!(out, "model {name}: {} layers, ratios [{}]", g.num_layers, ratios.join(","));
    if let Some(src) = &g.kv_sources {
        let _ = writeln!(out, "kv sources {src:?}, {:?} form, view lead {} rows", g.form, g.view_lead_rows);
    }
    let _ = writeln!(
        out,
        "blocks {}  slots {}  ring_slots {}  block_size {}  arena_rows {}  slot_align_rows {}",
        g.num_blocks, g.num_slots, g.ring_slots, g.block_size, g.arena_rows, g.slot_align_rows
    );
    let _ = writeln!(
        out,
        "envelope_rows {}  entry_rows {}  slot_rows {}  plane_rows {}  slot_positions {}  slot_origin {}",
        g.envelope_rows, g.entry_rows, g.slot_rows, g.plane_rows, g.slot_positions, g.slot_origin
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<8} {:>6} {:>10} {:>11} {:>8} {:>8} {:>9} {:>10} | {:>10} {:>9} {:>10} {:>11} {:>8}",
        "class",
        "layers",
        "block_rows",
        "ring_stride",
        "env_off",
        "env_rows",
        "entry_off",
        "entry_rows",
        "ring_start",
        "slot_rows",
        "ring_slots",
        "ring_stride",
        "run_rows"
    );
    for &ratio in &g.entry_order {
        let Some(c) = g.class(ratio) else { continue };
        let w = g.window_params(ratio)?;
        let _ = writeln!(
            out,
            "{:<8} {:>6} {:>10} {:>11} {:>8} {:>8} {:>9} {:>10} | {:>10} {:>9} {:>10} {:>11} {:>8}",
            format!("{}({})", class_name(ratio), ratio),
            c.num_layers(),
            c.block_rows,
            c.ring_stride,
            c.envelope_offset,
            c.envelope_rows(),
            c.entry_offset,
            c.entry_rows(),
            w.ring_start,
            w.slot_rows,
            w.ring_slots,
            w.ring_stride,
            w.run_rows
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{:>5} {:>5} {:>10} {:>10}", "layer", "ratio", "base_row", "view_rows");
    for (layer, &ratio) in g.ratios.iter().enumerate() {
        if ratio == ABSENT_RATIO {
            let _ = writeln!(out, "{layer:>5} {ratio:>5} {:>10} {:>10}", "absent", "-");
        } else {
            let (base, view) = (g.layer_base_row(layer)?, g.layer_view_rows(layer)?);
            let _ = writeln!(out, "{layer:>5} {ratio:>5} {base:>10} {view:>10}");
        }
    }
    let _ = writeln!(out);
    if let Some(kv) = kv {
        let f = kv.row_format().format();
        let _ = writeln!(
            out,
            "row format {} ({} B a token, pages of {} rows)",
            f.name,
            f.bytes_per_token(),
            kv.page_rows()
        );
        let views: Vec<String> =
            page_views(g, kv)?.into_iter().map(|(r, n)| format!("{} {n}", class_name(r))).collect();
        let _ = writeln!(
            out,
            "kernel page views (pages of {} rows; one index operand each): {}",
            f.kernel_page_rows,
            views.join(", ")
        );
        if let (Some(c), Some(p)) = (kv.compressed_format(), g.packed_rows) {
            let _ = writeln!(
                out,
                "compressed rows {} ({} B, packed: {} compressed rows a block in {} plane rows; compressed view {} rows)",
                c.format().name,
                p.compressed,
                g.compress_stride,
                g.envelope_rows,
                g.compressed_plane_rows()?.unwrap_or(0)
            );
        }
    }
    for width in kv.unwrap_or(PRICED_DTYPE).plane_widths() {
        let _ = writeln!(
            out,
            "{width:>4}-B plane: {} B  (block {} B, slot {} B)",
            g.plane_bytes(width),
            g.block_bytes(width),
            g.slot_bytes(width)
        );
    }
    let live = g.live_positions();
    if g.num_slots == 0 {
        let _ = write!(out, "groups: none");
    } else {
        let _ = write!(
            out,
            "groups 0..{} -> positions {}..={} (group 0 at {}, rows [{}, {}))",
            g.num_slots,
            live.end - 1,
            live.start,
            live.end - 1,
            g.slot_span(live.start)?.0,
            g.slot_span(live.end - 1)?.1
        );
    }
    Ok(out)
}
