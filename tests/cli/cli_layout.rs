//! `v4pool layout` run as a binary: the table, the JSON keys and values, and the error paths
//! (exit status 2, one line or a JSON error object).

use serde_json::Value;
use std::process::{Command, Output};

fn v4pool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_v4pool")).args(args).output().expect("the built binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json_of(args: &[&str]) -> Value {
    let o = v4pool(args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(&stdout(&o)).expect("one JSON object")
}

fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().expect("an object").keys().cloned().collect();
    k.sort();
    k
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut k: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    k.sort();
    k
}

/// pool-runtime §7: ratios [4,128,4,0], NB 3, slots 2, ring 7, arena 10.
#[test]
fn json_carries_the_spec_names_and_numbers() {
    let v = json_of(&[
        "layout",
        "--ratios",
        "4,128,4,0",
        "--blocks",
        "3",
        "--slots",
        "2",
        "--ring",
        "7",
        "--arena-rows",
        "10",
        "--json",
    ]);
    assert_eq!(
        keys(&v),
        sorted(&[
            "ratios",
            "num_blocks",
            "num_slots",
            "ring_slots",
            "block_size",
            "arena_rows",
            "slot_align_rows",
            "envelope_rows",
            "entry_rows",
            "slot_rows",
            "plane_rows",
            "slot_positions",
            "slot_origin",
            "classes",
            "layers",
            "physical_slots",
        ])
    );
    assert_eq!(v["ratios"], serde_json::json!([4, 128, 4, 0]));
    assert_eq!((v["num_blocks"].as_i64(), v["num_slots"].as_i64()), (Some(3), Some(2)));
    assert_eq!((v["ring_slots"].as_i64(), v["block_size"].as_i64()), (Some(7), Some(256)));
    assert_eq!((v["arena_rows"].as_i64(), v["slot_align_rows"].as_i64()), (Some(10), Some(2)));
    assert_eq!(v["envelope_rows"].as_i64(), Some(130));
    assert_eq!(v["entry_rows"].as_i64(), Some(85));
    assert_eq!(v["slot_rows"].as_i64(), Some(96));
    assert_eq!(v["plane_rows"].as_i64(), Some(672));
    assert_eq!((v["slot_positions"].as_i64(), v["slot_origin"].as_i64()), (Some(7), Some(0)));
    assert_eq!(v["physical_slots"], serde_json::json!([6, 5]));

    let classes = v["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 3);
    let class_keys = sorted(&[
        "ratio",
        "layers",
        "block_rows",
        "ring_stride",
        "ring_slots",
        "envelope_offset",
        "entry_offset",
        "envelope_rows",
        "entry_rows",
        "window_params",
    ]);
    let wp_keys = sorted(&["ring_start", "slot_rows", "ring_slots", "ring_stride", "run_rows"]);
    for c in classes {
        assert_eq!(keys(c), class_keys);
        assert_eq!(keys(&c["window_params"]), wp_keys);
    }
    // Entry order: dense, HCA, CSA; CSA two layers at stride 64 behind HCA's 2 envelope rows.
    let ratios: Vec<i64> = classes.iter().map(|c| c["ratio"].as_i64().unwrap()).collect();
    assert_eq!(ratios, vec![0, 128, 4]);
    let csa = &classes[2];
    assert_eq!(csa["layers"], serde_json::json!([0, 2]));
    assert_eq!((csa["envelope_offset"].as_i64(), csa["entry_offset"].as_i64()), (Some(2), Some(14)));
    assert_eq!((csa["envelope_rows"].as_i64(), csa["entry_rows"].as_i64()), (Some(128), Some(71)));
    assert_eq!(
        csa["window_params"],
        serde_json::json!({"ring_start": 22, "slot_rows": 96, "ring_slots": 7, "ring_stride": 64, "run_rows": 128})
    );

    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    for (i, l) in layers.iter().enumerate() {
        assert_eq!(keys(l), sorted(&["layer", "ratio", "base_row", "view_rows"]));
        assert_eq!(l["layer"].as_u64(), Some(i as u64));
    }
    let bases: Vec<i64> = layers.iter().map(|l| l["base_row"].as_i64().unwrap()).collect();
    assert_eq!(bases, vec![2, 0, 66, 0]);
    let views: Vec<i64> = layers.iter().map(|l| l["view_rows"].as_i64().unwrap()).collect();
    assert_eq!(views, vec![670, 672, 606, 672]);
}

#[test]
fn absent_layers_are_null_and_presets_default_the_ring() {
    let v = json_of(&[
        "layout",
        "--model",
        "v4-pro-dspark",
        "--spec-steps",
        "7",
        "--blocks",
        "1",
        "--slots",
        "1",
        "--json",
    ]);
    assert_eq!(v["ring_slots"].as_i64(), Some(135));
    assert_eq!(v["block_size"].as_i64(), Some(256));
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 64);
    for l in &layers[61..] {
        assert_eq!(l["ratio"].as_i64(), Some(-1));
        assert!(l["base_row"].is_null() && l["view_rows"].is_null());
    }
    assert!(layers[..61].iter().all(|l| l["base_row"].is_i64()));
    // No dense class at all.
    let ratios: Vec<i64> =
        v["classes"].as_array().unwrap().iter().map(|c| c["ratio"].as_i64().unwrap()).collect();
    assert_eq!(ratios, vec![128, 4]);
    assert_eq!(v["envelope_rows"].as_i64(), Some(1_982));

    // --ring overrides the model's ring.
    let v = json_of(&[
        "layout", "--model", "v4-flash", "--ring", "131", "--blocks", "0", "--slots", "0", "--json",
    ]);
    assert_eq!((v["ring_slots"].as_i64(), v["entry_rows"].as_i64()), (Some(131), Some(7_003)));
    assert_eq!(v["physical_slots"], serde_json::json!([]));
}

#[test]
fn table_shows_the_worked_numbers() {
    let o = v4pool(&[
        "layout",
        "--model",
        "v4-flash-dspark-dense",
        "--spec-steps",
        "3",
        "--blocks",
        "3",
        "--slots",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    for needle in [
        "envelope_rows 1384",
        "entry_rows 7265",
        "slot_rows 7266",
        "plane_rows 21798",
        "ring_slots 131",
        // 21,798 rows × 512 B and × 128 B.
        "11160576 B",
        "2790144 B",
        "dense(0)",
        "HCA(128)",
        "CSA(4)",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(o.stderr.is_empty());
}

#[test]
fn config_json_path_is_read() {
    let dir = std::env::temp_dir().join(format!("v4pool-cli-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        r#"{"num_hidden_layers": 3, "num_nextn_predict_layers": 1, "compress_ratios": [0, 4, 128, 0],
            "sliding_window": 8, "qk_rope_head_dim": 64, "index_head_dim": 128, "index_topk": 512}"#,
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let v =
        json_of(&["layout", "--model", p, "--spec-steps", "2", "--blocks", "2", "--slots", "1", "--json"]);
    assert_eq!(v["ratios"], serde_json::json!([0, 4, 128, 0]));
    assert_eq!(v["ring_slots"].as_i64(), Some(10));
    // The folder holding config.json works too, with drafts made absent.
    let d = dir.to_str().unwrap();
    let v =
        json_of(&["layout", "--model", d, "--draft-stages", "2", "--blocks", "2", "--slots", "1", "--json"]);
    assert_eq!(v["ratios"], serde_json::json!([0, 4, 128, -1, -1]));
    // A hostile config is a typed JSON error.
    std::fs::write(&path, r#"{"num_hidden_layers": "three"}"#).unwrap();
    let o = v4pool(&["layout", "--model", p, "--blocks", "2", "--slots", "1", "--json"]);
    assert_eq!(o.status.code(), Some(2));
    let e: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(e["error"], "WrongType");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each failing invocation exits 2 with one stderr line, and with `--json` prints exactly
/// `{"error": VARIANT, "message": TEXT}` on stdout.
#[test]
fn errors_exit_2_with_variant_names() {
    let base = ["layout", "--blocks", "3", "--slots", "2", "--ring", "7"];
    // `layout --ratios R --blocks 1 --slots 1 --ring 7` and the flags after it.
    let one_block = |ratios: &'static str, more: &[&'static str]| {
        [&["layout", "--ratios", ratios, "--blocks", "1", "--slots", "1", "--ring", "7"][..], more].concat()
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (one_block("4,-2", &[]), "UnknownRatios"),
        (one_block("4,7", &[]), "BlockSizeNotDivisible"),
        (one_block("", &[]), "BadValue"),
        (one_block("4,x", &[]), "BadValue"),
        (vec!["layout", "--ratios", "4", "--blocks", "1", "--slots", "1", "--ring", "0"], "RingSlots"),
        (vec!["layout", "--ratios", "4", "--blocks", "-1", "--slots", "1", "--ring", "7"], "NegativeCount"),
        (one_block("4", &["--block-size", "0"]), "BlockSize"),
        (one_block("128", &["--block-size", "64"]), "BlockSizeNotDivisible"),
        (one_block("4", &["--plane-rows", "10"]), "PlaneTooSmall"),
        (
            vec!["layout", "--ratios", "4", "--blocks", "9223372036854775807", "--slots", "1", "--ring", "7"],
            "Overflow",
        ),
        (
            vec!["layout", "--ratios", "4", "--blocks", "40000000", "--slots", "1", "--ring", "7"],
            "PlaneExceedsI32",
        ),
        (one_block("-1", &[]), "EmptySlot"),
        (vec!["layout", "--ratios", "4", "--blocks", "1", "--slots", "1"], "MissingOption"),
        (vec!["layout", "--ratios", "4", "--slots", "1", "--ring", "7"], "MissingOption"),
        (vec!["layout", "--blocks", "1", "--slots", "1", "--ring", "7"], "MissingOption"),
        (vec!["layout", "--model", "v4-flash", "--ratios", "4", "--blocks", "1", "--slots", "1"], "Conflict"),
        (vec!["layout", "--model", "v4-flashy", "--blocks", "1", "--slots", "1"], "UnknownPreset"),
        (
            vec!["layout", "--model", "v4-flash", "--dtype", "fp16", "--blocks", "1", "--slots", "1"],
            "BadValue",
        ),
        (
            vec!["layout", "--model", "v4-flash", "--dtype", "flashmla-v41", "--blocks", "1", "--slots", "1"],
            "KvDtypeUnsupported",
        ),
        (
            vec![
                "layout", "--ratios", "4", "--dtype", "bf16", "--blocks", "1", "--slots", "1", "--ring", "7",
            ],
            "Conflict",
        ),
        (vec!["layout", "--model", "/nonexistent/config.json", "--blocks", "1", "--slots", "1"], "Io"),
        (
            vec!["layout", "--model", "v4-flash", "--spec-steps", "-2", "--blocks", "1", "--slots", "1"],
            "SpecSteps",
        ),
        (
            vec!["layout", "--model", "v4-flash", "--draft-stages", "3", "--blocks", "1", "--slots", "1"],
            "Conflict",
        ),
        (one_block("4", &["--slot-positions", "1"]), "SlotPositionsTooFew"),
        (one_block("4", &["--slot-align-rows", "0"]), "SlotAlignRows"),
        (one_block("4", &["--arena-rows", "-3"]), "ArenaRows"),
        ([&base[..], &["--ratios", "4", "--frobnicate"]].concat(), "UnknownFlag"),
        ([&base[..], &["--ratios", "4", "--ring", "8"]].concat(), "Duplicate"),
        ([&base[..], &["--ratios"]].concat(), "MissingValue"),
        ([&base[..], &["--ratios", "4", "stray"]].concat(), "Unexpected"),
        (vec!["frobnicate"], "UnknownCommand"),
    ];
    for (args, variant) in cases {
        let o = v4pool(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line, got {err:?}");
        assert!(o.stdout.is_empty(), "{args:?}: nothing on stdout without --json");

        let mut with_json = args.clone();
        with_json.push("--json");
        let o = v4pool(&with_json);
        assert_eq!(o.status.code(), Some(2), "{with_json:?}");
        let e: Value =
            serde_json::from_str(&stdout(&o)).unwrap_or_else(|_| panic!("{with_json:?}: {}", stdout(&o)));
        assert_eq!(keys(&e), sorted(&["error", "message"]), "{with_json:?}");
        assert_eq!(e["error"], variant, "{with_json:?}: {e}");
        assert!(!e["message"].as_str().unwrap().is_empty());
    }
}

#[test]
fn json_refuses_to_list_a_huge_slot_count() {
    let args = ["layout", "--ratios", "4", "--blocks", "1", "--slots", "9999999", "--ring", "7"];
    // The table does not list groups, so it prints.
    assert_eq!(v4pool(&args).status.code(), Some(0));
    let o = v4pool(&[&args[..], &["--json"]].concat());
    assert_eq!(o.status.code(), Some(2));
    let e: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(e["error"], "TooLarge");
}

#[test]
fn help_and_dispatch() {
    for args in [vec!["help"], vec!["--help"], vec!["layout", "--help"]] {
        let o = v4pool(&args);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        assert!(stdout(&o).contains("usage: v4pool"), "{args:?}");
    }
    let o = v4pool(&[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage: v4pool"));
}

/// `--ratios` with `--kv-sources` lays V4.1's shared compressors out as its preset does (the
/// compact form, the view lead, every compress bias). Seen failing before the fix: the option
/// did not exist (UnknownFlag, exit 2), so a ratio list could not express V4.1.
#[test]
fn ratios_take_kv_sources() {
    let mut ratios = vec!["0"; 2];
    ratios.extend(["2"; 18]);
    ratios.extend(["1"; 20]);
    let ratios = ratios.join(",");
    let common = ["--blocks", "3", "--slots", "2", "--json"];
    let mut by_ratios = vec!["layout", "--ratios", &ratios, "--kv-sources", "2,8,14,20", "--ring", "128"];
    by_ratios.extend(common);
    let mut by_model = vec!["layout", "--model", "v4.1-flash"];
    by_model.extend(common);
    let (a, b) = (json_of(&by_ratios), json_of(&by_model));
    assert_eq!(a["kv_sources"], serde_json::json!([2, 8, 14, 20]), "{a}");
    assert!(a["view_lead_rows"].as_i64().unwrap() > 0, "{a}");
    assert_eq!(a, b, "the ratio list with its sources lays out as the preset");
    // The geometry's refusals of a source list, and the option beside --model.
    for (sources, variant) in [("8,14,20", "NoSourceBefore"), ("8,2", "SourcesNotSorted"), ("0", "BadSource")]
    {
        let o = v4pool(&[
            "layout",
            "--ratios",
            &ratios,
            "--kv-sources",
            sources,
            "--ring",
            "128",
            "--blocks",
            "1",
            "--slots",
            "1",
            "--json",
        ]);
        assert_eq!(o.status.code(), Some(2));
        let e: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(e["error"], variant, "{sources}: {e}");
    }
    let o =
        v4pool(&["layout", "--model", "v4.1-flash", "--kv-sources", "2", "--blocks", "1", "--slots", "1"]);
    assert_eq!(o.status.code(), Some(2));
}

/// `--dtype` lays the geometry out as a pool of that format carves it: the rows `v4pool plan`
/// sizes a pool with (envelope, arena, slot, alignment) are the layout's, and a paged format's
/// envelopes, slots, arena and every slot group start in whole pages.
#[test]
fn dtype_lays_out_the_pools_geometry() {
    for (model, dtype, widths, page) in [
        ("v4-flash", "fp8", vec![512, 128], 1),
        ("v4-flash", "flashmla-v4", vec![584], 64),
        ("v4-flash", "flashmla-v4-p2", vec![584], 2),
        ("v4-pro", "flashmla-v4", vec![584], 64),
        ("v4.1-flash", "flashmla-v41", vec![528], 1),
    ] {
        let plan = json_of(&[
            "plan",
            "--model",
            model,
            "--budget",
            "4GiB",
            "--max-seqs",
            "3",
            "--dtype",
            dtype,
            "--json",
        ]);
        let v = json_of(&[
            "layout", "--model", model, "--dtype", dtype, "--blocks", "5", "--slots", "3", "--json",
        ]);
        for key in ["envelope_rows", "entry_rows", "arena_rows", "slot_rows", "slot_align_rows"] {
            assert_eq!(v[key], plan[key], "{model} {dtype}: {key}");
        }
        assert_eq!(v["kv_dtype"], dtype);
        assert_eq!(v["plane_widths"], serde_json::json!(widths), "{model} {dtype}");
        assert_eq!(v["page_rows"], page, "{model} {dtype}");
        for key in ["envelope_rows", "arena_rows", "slot_rows"] {
            assert_eq!(v[key].as_i64().unwrap() % page, 0, "{model} {dtype}: {key} in whole pages");
        }
        for group in v["physical_slots"].as_array().unwrap() {
            let start = v["slot_origin"].as_i64().unwrap()
                - (group.as_i64().unwrap() + 1) * v["slot_rows"].as_i64().unwrap();
            assert_eq!(start % page, 0, "{model} {dtype}: slot group {group} starts a page");
        }
    }
    // Without --dtype the layout is the spec's (no arena): unchanged by the option's existence.
    let bare = json_of(&["layout", "--model", "v4-flash", "--blocks", "5", "--slots", "3", "--json"]);
    assert_eq!((bare["envelope_rows"].as_i64(), bare["arena_rows"].as_i64()), (Some(1384), Some(0)));
    assert!(bare.get("kv_dtype").is_none());
    let table = stdout(&v4pool(&[
        "layout",
        "--model",
        "v4-flash",
        "--dtype",
        "flashmla-v4",
        "--blocks",
        "5",
        "--slots",
        "3",
    ]));
    assert!(table.contains("row format flashmla-v4 (584 B a token, pages of 64 rows)"), "{table}");
    assert!(table.contains(" 584-B plane: "), "{table}");
}

/// FlashMLA's V4 rows in pages of 2 (`flashmla-v4-p2`) against pages of 64, V4-Flash at MTP 1
/// (ring 129): the envelope is the 1,384 rows its layers take (not padded to 1,408), every HCA
/// layer's view at one page shift (1 index operand, not 20), the dense layers at two (ring 129
/// is odd), and at 100 GiB / 256 sequences the plan carves more blocks, each format's tight fit
/// the other's capacity row.
#[test]
fn two_row_pages_give_one_hca_view_and_a_tight_envelope() {
    let args = |dtype: &'static str| {
        [
            "layout",
            "--model",
            "v4-flash",
            "--spec-steps",
            "1",
            "--dtype",
            dtype,
            "--blocks",
            "5",
            "--slots",
            "3",
        ]
    };
    let layout = |dtype| json_of(&[&args(dtype)[..], &["--json"]].concat());
    let (p64, p2) = (layout("flashmla-v4"), layout("flashmla-v4-p2"));
    assert_eq!((p64["envelope_rows"].as_i64(), p2["envelope_rows"].as_i64()), (Some(1408), Some(1384)));
    let views = |v: &serde_json::Value| {
        ["dense", "HCA", "CSA"]
            .map(|c| v["kernel_page_views"][c].as_u64().unwrap_or_else(|| panic!("{c}: {v}")))
    };
    assert_eq!(views(&p64), [3, 20, 1], "pages of 64: dense 0/129/258, HCA 2 rows apart, CSA 64 apart");
    assert_eq!(views(&p2), [2, 1, 1], "pages of 2");
    let table = stdout(&v4pool(&args("flashmla-v4-p2")));
    assert!(
        table.contains("kernel page views (pages of 2 rows; one index operand each): dense 2, HCA 1, CSA 1"),
        "{table}"
    );
    let plan = |dtype: &str| {
        json_of(&[
            "plan",
            "--model",
            "v4-flash",
            "--budget",
            "100GiB",
            "--max-seqs",
            "256",
            "--dtype",
            dtype,
            "--json",
        ])
    };
    let (a, b) = (plan("flashmla-v4"), plan("flashmla-v4-p2"));
    let blocks = |v: &serde_json::Value| v["num_blocks"].as_i64().unwrap();
    println!("blocks at 100 GiB: flashmla-v4 {} flashmla-v4-p2 {}", blocks(&a), blocks(&b));
    assert!(blocks(&b) > blocks(&a), "the tighter envelope holds more blocks");
    let fit = |v: &serde_json::Value, name: &str| {
        v["capacity_by_format"].as_array().unwrap().iter().find(|c| c["format"] == name).unwrap()
            ["tight_fit_blocks"]
            .clone()
    };
    assert_eq!(fit(&a, "flashmla-v4-p2"), b["tight_fit_blocks"]);
    assert_eq!(fit(&b, "flashmla-v4"), a["tight_fit_blocks"]);
}

/// `plan --json` prices every row format the model has a form in at the plan's budget: V4-Flash
/// at 100 GiB and 256 sequences holds 584 B a token in FlashMLA's format against ATOM's 640, and
/// the tokens it gains are the difference of the two tight fits.
#[test]
fn plan_json_reports_capacity_by_format() {
    let v = json_of(&["plan", "--model", "v4-flash", "--budget", "100GiB", "--max-seqs", "256", "--json"]);
    assert_eq!(v["kv_bytes_per_token"], 640);
    let caps = v["capacity_by_format"].as_array().unwrap();
    let of = |name: &str| {
        caps.iter().find(|c| c["format"] == name).unwrap_or_else(|| panic!("{name} in {caps:?}"))
    };
    let (atom, fm) = (of("atom-fp8"), of("flashmla-v4"));
    assert_eq!((atom["block_row_bytes"].as_u64(), fm["block_row_bytes"].as_u64()), (Some(640), Some(584)));
    assert_eq!(atom["tight_fit_blocks"], v["tight_fit_blocks"], "this plan's own format is its tight fit");
    assert_eq!(atom["tokens_vs_plan"], 0);
    let gain = (fm["tight_fit_blocks"].as_i64().unwrap() - atom["tight_fit_blocks"].as_i64().unwrap()) * 256;
    assert!(gain > 0);
    assert_eq!(fm["tokens_vs_plan"].as_i64(), Some(gain));
    assert!(caps.iter().all(|c| c["format"] != "flashmla-v41"), "V4 has no 528-B form");
    let v41 =
        json_of(&["plan", "--model", "v4.1-flash", "--budget", "100GiB", "--max-seqs", "256", "--json"]);
    assert_eq!(v41["kv_bytes_per_token"], 528);
    let fp4 = v41["capacity_by_format"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["format"] == "flashmla-v41-fp4")
        .cloned();
    let fp4 = fp4.expect("V4.1 prices its fp4 compressed rows");
    assert_eq!((fp4["block_row_bytes"].as_u64(), fp4["window_row_bytes"].as_u64()), (Some(288), Some(528)));
    // The packed plan itself: its tight fit is its own row, and it holds more than the 528-B one.
    let packed = json_of(&[
        "plan",
        "--model",
        "v4.1-flash",
        "--budget",
        "100GiB",
        "--max-seqs",
        "256",
        "--dtype",
        "flashmla-v41-fp4",
        "--json",
    ]);
    assert_eq!(
        (packed["kv_bytes_per_token"].as_u64(), packed["compressed_row_bytes"].as_u64()),
        (Some(528), Some(288))
    );
    let row = packed["capacity_by_format"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["format"] == "flashmla-v41-fp4")
        .cloned();
    let row = row.expect("the packed row");
    assert_eq!(row["tight_fit_blocks"], packed["tight_fit_blocks"]);
    assert_eq!(row["tokens_vs_plan"], 0);
    assert!(packed["num_blocks"].as_i64() > v41["num_blocks"].as_i64(), "{packed} vs {v41}");
}

/// A pool planned for an AMD architecture takes the formats its engine's kernels read there
/// (docs/amd.md): gfx942 defaults to a bf16 main KV and ATOM's preshuffled e4m3fnuz indexer;
/// ATOM's 640-B fp8 main KV, which aiter reads only on gfx950 / gfx1250, is refused on gfx942
/// with one line saying why.
#[test]
fn plan_for_an_amd_architecture_picks_what_its_kernels_read() {
    let plan = |extra: &[&str]| {
        let mut a = vec!["plan", "--budget", "4GiB", "--max-seqs", "3", "--json"];
        if !extra.contains(&"--model") {
            a.extend_from_slice(&["--model", "v4-flash"]);
        }
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |extra: &[&str]| {
        let a = plan(extra);
        json_of(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    for (extra, kv, indexer) in [
        (&["--backend", "hip", "--arch", "gfx942"][..], "bf16", "atom-fp8-fnuz"),
        (&["--arch", "gfx950"][..], "fp8", "atom-fp8"),
        (&["--backend", "hip", "--arch", "gfx1250"][..], "fp8", "atom-fp8"),
        (&["--arch", "gfx90a"][..], "bf16", "bf16"),
        (&[][..], "fp8", "fp8"),
        (&["--backend", "cuda"][..], "fp8", "fp8"),
    ] {
        let v = run(extra);
        assert_eq!(
            (v["kv_dtype"].as_str(), v["indexer_dtype"].as_str()),
            (Some(kv), Some(indexer)),
            "{extra:?}"
        );
        let id = v["layout_id"].as_str().unwrap();
        assert!(id.contains(&format!(":index={indexer}:")), "{extra:?}: {id}");
    }
    // The indexer layout is in the layout id: a pool of another indexer layout is another id.
    let ids: Vec<String> = ["fp8", "atom-fp8"]
        .iter()
        .map(|i| run(&["--indexer", i])["layout_id"].as_str().unwrap().to_string())
        .collect();
    assert_ne!(ids[0], ids[1]);
    // Refused, exit 2, one line saying why.
    for (extra, variant, why) in [
        (
            &["--backend", "hip", "--arch", "gfx942", "--dtype", "fp8"][..],
            "UnreadableOnArch",
            "gfx950/gfx1250",
        ),
        (&["--arch", "gfx942", "--indexer", "fp8"][..], "UnreadableOnArch", "e4m3fnuz"),
        (&["--arch", "gfx950", "--indexer", "atom-fp8-fnuz"][..], "UnreadableOnArch", "gfx942"),
        (&["--arch", "gfx942", "--dtype", "flashmla-v4"][..], "UnreadableOnArch", "NVIDIA"),
        (&["--backend", "hip"][..], "MissingOption", "--arch"),
        (&["--arch", "gfx1100"][..], "BadValue", "gfx942"),
        (&["--backend", "cuda", "--arch", "gfx942"][..], "Conflict", "--arch"),
        (&["--model", "v4.1-flash", "--indexer", "atom-fp8"][..], "IndexerUnsupported", "V4"),
    ] {
        let mut a = plan(extra);
        a.retain(|x| x != "--json");
        let o = v4pool(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(why), "{extra:?}: {err}");
        let o = v4pool(&plan(extra).iter().map(String::as_str).collect::<Vec<_>>());
        let v: Value = serde_json::from_str(&stdout(&o)).expect("one JSON error object");
        assert_eq!(v["error"], variant, "{extra:?}");
    }
}
