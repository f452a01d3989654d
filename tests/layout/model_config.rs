//! `ModelShape::from_config_json`: V4-Flash/Pro-like configs become the presets' shapes;
//! hostile configs become typed errors, never panics.

use proptest::prelude::*;
use v4pool::model::{DraftMode, Drafts, ModelError, ModelShape, MAX_LAYERS, MAX_SPEC_STEPS};
use v4pool::raw::file::FileError;
use v4pool::VariantName;
use v4pool::{ABSENT_RATIO, DENSE_RATIO};

fn list(v: &[i32]) -> String {
    let items: Vec<String> = v.iter().map(|r| r.to_string()).collect();
    format!("[{}]", items.join(","))
}

fn flash_ratios() -> Vec<i32> {
    let mut r = vec![0, 0];
    for _ in 0..20 {
        r.extend([4, 128]);
    }
    r.push(4);
    r.push(0);
    r
}

fn pro_ratios() -> Vec<i32> {
    let mut r = vec![128, 128];
    for _ in 0..29 {
        r.extend([4, 128]);
    }
    r.push(4);
    r.push(0);
    r
}

/// A V4-like config.json with the keys the pool reads plus some it ignores.
fn config(layers: usize, nextn: usize, ratios: &[i32], topk: i64) -> String {
    format!(
        r#"{{
  "architectures": ["DeepseekV4ForCausalLM"],
  "model_type": "deepseek_v4",
  "hidden_size": 4096,
  "num_hidden_layers": {layers},
  "num_nextn_predict_layers": {nextn},
  "compress_ratios": {ratios},
  "sliding_window": 128,
  "head_dim": 512,
  "qk_rope_head_dim": 64,
  "index_head_dim": 128,
  "index_n_heads": 64,
  "index_topk": {topk},
  "rope_scaling": {{"type": "yarn", "factor": 16.0}},
  "torch_dtype": "bfloat16"
}}"#,
        ratios = list(ratios)
    )
}

fn flash_config() -> String {
    config(43, 1, &flash_ratios(), 512)
}

fn pro_config() -> String {
    config(61, 1, &pro_ratios(), 1024)
}

/// Replace (or with `None` remove) one top-level key of the Flash config.
fn flash_with(key: &str, value: Option<&str>) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&flash_config()).unwrap();
    let obj = v.as_object_mut().unwrap();
    match value {
        Some(text) => {
            obj.insert(key.to_string(), serde_json::from_str(text).unwrap());
        }
        None => {
            obj.remove(key);
        }
    }
    v.to_string()
}

#[test]
fn flash_config_matches_preset() {
    for k in [0, 1, 3] {
        let got = ModelShape::from_config_json(&flash_config(), k).unwrap();
        let preset = ModelShape::v4_flash(k).unwrap();
        assert_eq!(got.ratios, preset.ratios);
        assert_eq!(got.num_hidden_layers, 43);
        assert_eq!(got.num_mtp_layers, 1);
        assert_eq!((got.n_dense(), got.n_csa(), got.n_hca()), (3, 21, 20));
        assert_eq!(got.ring_slots(), 128 + k);
        assert_eq!(
            (got.sliding_window, got.head_dim, got.qk_rope_head_dim, got.index_head_dim, got.index_topk),
            (128, 512, 64, 128, 512)
        );
        assert_eq!(got.block_size, 256);
        assert!(got.draft_layers.is_empty());
    }
}

#[test]
fn pro_config_matches_preset() {
    let got = ModelShape::from_config_json(&pro_config(), 1).unwrap();
    let preset = ModelShape::v4_pro(1).unwrap();
    assert_eq!(got.ratios, preset.ratios);
    assert_eq!(got.ratios.len(), 62);
    assert_eq!((got.n_dense(), got.n_csa(), got.n_hca()), (1, 30, 31));
    assert_eq!(got.index_topk, 1024);
    assert_eq!(got.ring_slots(), 129);
    // The geometry built from it carries the pool-runtime §2.5 numbers.
    let g = got.geometry_spec(0, 0).build().unwrap();
    assert_eq!((g.envelope_rows, g.entry_rows), (1_982, 9_855));
}

#[test]
fn drafts_replace_mtp_or_follow_the_listed_stages() {
    // Flash list with its one MTP entry, three dense draft stages (ATOM's test shape).
    let dense = Drafts { stages: 3, mode: DraftMode::Dense };
    let got = ModelShape::from_config_json_with(&flash_config(), 3, Some(dense)).unwrap();
    assert_eq!(got.ratios, ModelShape::v4_flash_dspark(3, DraftMode::Dense).unwrap().ratios);
    assert_eq!(got.draft_layers, vec![43, 44, 45]);
    assert_eq!(got.num_mtp_layers, 0);
    let g = got.geometry_spec(3, 2).build().unwrap();
    assert_eq!((g.envelope_rows, g.entry_rows, g.slot_rows, g.plane_rows), (1_384, 7_265, 7_266, 21_798));

    // A Pro list that already names its three drafts (the 64-entry report), made absent.
    let mut ratios = pro_ratios();
    ratios.pop();
    ratios.extend([0, 0, 0]);
    let text = config(61, 1, &ratios, 1024);
    let absent = Drafts { stages: 3, mode: DraftMode::Absent };
    let got = ModelShape::from_config_json_with(&text, 7, Some(absent)).unwrap();
    assert_eq!(got.ratios.len(), 64);
    assert_eq!(got.absent_layers(), vec![61, 62, 63]);
    assert_eq!(got.n_dense(), 0);
    assert_eq!(got.ring_slots(), 135);
    assert_eq!(got.ratios, ModelShape::v4_pro_dspark(7, DraftMode::Absent).unwrap().ratios);
    assert!(got.ratios[61..].iter().all(|&r| r == ABSENT_RATIO));
    assert!(got.ratios[..61].iter().all(|&r| r != DENSE_RATIO));

    // Neither length: a count error naming the MTP length.
    let text = config(61, 1, &ratios[..63], 1024);
    assert_eq!(
        ModelShape::from_config_json_with(&text, 0, Some(absent)),
        Err(ModelError::RatioCount { got: 63, expected: 62 })
    );
    assert_eq!(
        ModelShape::from_config_json_with(
            &flash_config(),
            0,
            Some(Drafts { stages: 0, mode: DraftMode::Dense })
        ),
        Err(ModelError::DraftStages { stages: 0, max: MAX_LAYERS as usize })
    );
}

#[test]
fn defaults_and_nulls() {
    // head_dim defaults to 512; num_nextn_predict_layers to 0 (then the list must be trunk only).
    let got = ModelShape::from_config_json(&flash_with("head_dim", None), 0).unwrap();
    assert_eq!(got.head_dim, 512);
    let got = ModelShape::from_config_json(&flash_with("head_dim", Some("null")), 0).unwrap();
    assert_eq!(got.head_dim, 512);
    // Dims other than the pool's row format are refused naming the key (they used to be
    // planned silently at V4 widths).
    for (key, value, expected) in [
        ("head_dim", 576, 512),
        ("head_dim", 256, 512),
        ("qk_rope_head_dim", 32, 64),
        ("index_head_dim", 64, 128),
    ] {
        assert_eq!(
            ModelShape::from_config_json(&flash_with(key, Some(&value.to_string())), 0),
            Err(ModelError::RowFormat { key, got: value, expected })
        );
    }
    assert_eq!(
        ModelShape::from_config_json(&flash_with("num_nextn_predict_layers", None), 0),
        Err(ModelError::RatioCount { got: 44, expected: 43 })
    );
    let trunk_only = config(43, 0, &flash_ratios()[..43], 512);
    let got = ModelShape::from_config_json(&trunk_only, 0).unwrap();
    assert_eq!((got.ratios.len(), got.num_mtp_layers, got.n_dense()), (43, 0, 2));
}

/// A config text and what its error must look like.
type HostileCase = (String, fn(&ModelError) -> bool);

#[test]
fn hostile_configs_are_typed_errors() {
    use ModelError::*;
    let cases: Vec<HostileCase> = vec![
        ("".into(), |e| matches!(e, Json(_))),
        ("{".into(), |e| matches!(e, Json(_))),
        ("{\"sliding_window\": NaN}".into(), |e| matches!(e, Json(_))),
        ("[1,2,3]".into(), |e| matches!(e, NotAnObject { got: "a list" })),
        ("42".into(), |e| matches!(e, NotAnObject { got: "an integer" })),
        ("null".into(), |e| matches!(e, NotAnObject { got: "null" })),
        ("\"config\"".into(), |e| matches!(e, NotAnObject { got: "a string" })),
        ("[".repeat(100_000), |e| matches!(e, Json(_))),
        (format!("{{\"a\":{}1{}}}", "[".repeat(5_000), "]".repeat(5_000)), |e| matches!(e, Json(_))),
        ("{}".into(), |e| matches!(e, MissingKey { key: "num_hidden_layers" })),
        (flash_with("compress_ratios", None), |e| {
            matches!(e, MissingKey { key: "compress_ratios (or layer_types)" })
        }),
        (flash_with("sliding_window", None), |e| matches!(e, MissingKey { key: "sliding_window" })),
        (flash_with("sliding_window", Some("null")), |e| matches!(e, MissingKey { key: "sliding_window" })),
        (flash_with("index_topk", None), |e| matches!(e, MissingKey { key: "index_topk" })),
        (flash_with("num_hidden_layers", Some("\"43\"")), |e| {
            matches!(e, WrongType { key: "num_hidden_layers", got: "a string", .. })
        }),
        (flash_with("num_hidden_layers", Some("43.0")), |e| {
            matches!(e, WrongType { key: "num_hidden_layers", got: "a non-integer number", .. })
        }),
        (flash_with("num_hidden_layers", Some("-43")), |e| {
            matches!(e, OutOfRange { key: "num_hidden_layers", got: -43, .. })
        }),
        (flash_with("num_hidden_layers", Some("0")), |e| {
            matches!(e, OutOfRange { key: "num_hidden_layers", got: 0, min: 1, .. })
        }),
        (flash_with("num_hidden_layers", Some("18446744073709551615")), |e| {
            matches!(e, OutOfRange { key: "num_hidden_layers", got: i64::MAX, .. })
        }),
        // serde_json refuses a number no f64 holds.
        (flash_config().replace("\"num_hidden_layers\": 43", "\"num_hidden_layers\": 1e400"), |e| {
            matches!(e, Json(_))
        }),
        (flash_with("sliding_window", Some("-128")), |e| {
            matches!(e, OutOfRange { key: "sliding_window", .. })
        }),
        (flash_with("sliding_window", Some("9223372036854775807")), |e| {
            matches!(e, OutOfRange { key: "sliding_window", got: i64::MAX, .. })
        }),
        (flash_with("sliding_window", Some("[128]")), |e| {
            matches!(e, WrongType { key: "sliding_window", got: "a list", .. })
        }),
        (flash_with("sliding_window", Some("true")), |e| {
            matches!(e, WrongType { key: "sliding_window", got: "a boolean", .. })
        }),
        (flash_with("head_dim", Some("0")), |e| matches!(e, OutOfRange { key: "head_dim", .. })),
        (flash_with("qk_rope_head_dim", Some("1024")), |e| {
            matches!(e, OutOfRange { key: "qk_rope_head_dim", got: 1024, max: 512, .. })
        }),
        (flash_with("index_head_dim", Some("{}")), |e| {
            matches!(e, WrongType { key: "index_head_dim", got: "an object", .. })
        }),
        (flash_with("num_nextn_predict_layers", Some("-1")), |e| {
            matches!(e, OutOfRange { key: "num_nextn_predict_layers", .. })
        }),
        (flash_with("num_nextn_predict_layers", Some("4611686018427387904")), |e| {
            matches!(e, OutOfRange { key: "num_nextn_predict_layers", .. })
        }),
        (flash_with("compress_ratios", Some("\"0,0,4\"")), |e| {
            matches!(e, WrongType { key: "compress_ratios", got: "a string", .. })
        }),
        (flash_with("compress_ratios", Some("{\"0\": 0}")), |e| {
            matches!(e, WrongType { key: "compress_ratios", got: "an object", .. })
        }),
        (flash_with("compress_ratios", Some("[]")), |e| matches!(e, RatioCount { got: 0, expected: 44 })),
        (flash_with("compress_ratios", Some(&list(&flash_ratios()[..43]))), |e| {
            matches!(e, RatioCount { got: 43, expected: 44 })
        }),
        (flash_with("compress_ratios", Some(&list(&[4; 45]))), |e| matches!(e, RatioCount { got: 45, .. })),
    ];
    for (text, check) in cases {
        let got = ModelShape::from_config_json(&text, 1);
        let shown = text.chars().take(80).collect::<String>();
        match got {
            Err(e) => {
                assert!(check(&e), "{shown}: unexpected error {e:?}");
                assert!(!e.variant_name().is_empty());
                assert!(!e.to_string().is_empty());
            }
            Ok(m) => panic!("{shown}: accepted as {m:?}"),
        }
    }
}

#[test]
fn bad_ratio_entries_name_the_layer() {
    let mut r = flash_ratios();
    for (bad, expect) in [(8, 8i64), (-1, -1), (2, 2), (256, 256), (i32::MAX, i32::MAX as i64)] {
        r[7] = bad;
        let text = flash_with("compress_ratios", Some(&list(&r)));
        assert_eq!(
            ModelShape::from_config_json(&text, 0),
            Err(ModelError::UnknownRatio { layer: 7, got: expect })
        );
    }
    let mut entries: Vec<String> = flash_ratios().iter().map(|x| x.to_string()).collect();
    for bad in ["4.0", "\"4\"", "null", "[4]", "1e3", "99999999999999999999"] {
        entries[5] = bad.to_string();
        let text = flash_with("compress_ratios", Some(&format!("[{}]", entries.join(","))));
        let got = ModelShape::from_config_json(&text, 0);
        assert!(
            matches!(
                got,
                Err(ModelError::WrongType { key: "compress_ratios", .. })
                    | Err(ModelError::UnknownRatio { layer: 5, .. })
            ),
            "{bad}: {got:?}"
        );
    }
}

#[test]
fn spec_steps_are_bounded() {
    assert_eq!(ModelShape::from_config_json(&flash_config(), -1), Err(ModelError::SpecSteps { got: -1 }));
    assert_eq!(
        ModelShape::from_config_json(&flash_config(), i64::MAX),
        Err(ModelError::SpecStepsTooLarge { got: i64::MAX, max: MAX_SPEC_STEPS })
    );
    assert_eq!(
        ModelShape::v4_pro(MAX_SPEC_STEPS + 1),
        Err(ModelError::SpecStepsTooLarge { got: MAX_SPEC_STEPS + 1, max: MAX_SPEC_STEPS })
    );
    let m = ModelShape::from_config_json(&flash_config(), MAX_SPEC_STEPS).unwrap();
    assert_eq!(m.ring_slots(), 128 + MAX_SPEC_STEPS);
}

/// Fragments a hostile config is made of: valid JSON pieces, broken ones, numbers at the
/// edges, and the real keys, so random strings reach every branch of the reader.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("null".to_string()),
        Just("true".to_string()),
        Just("NaN".to_string()),
        Just("-Infinity".to_string()),
        Just("1e999".to_string()),
        Just("-0".to_string()),
        Just("18446744073709551616".to_string()),
        Just("\"\\ud800\"".to_string()),
        prop_oneof![
            Just("compress_ratios"),
            Just("num_hidden_layers"),
            Just("num_nextn_predict_layers"),
            Just("sliding_window"),
            Just("head_dim"),
            Just("qk_rope_head_dim"),
            Just("index_head_dim"),
            Just("index_topk"),
        ]
        .prop_map(|k| format!("\"{k}\"")),
        any::<i64>().prop_map(|n| n.to_string()),
        prop_oneof![Just(0i64), Just(4), Just(128), Just(-1), Just(1), Just(43), Just(44)]
            .prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        "[ -~]{0,6}",
    ]
}

/// A well-formed object over the real keys with random values, so the typed paths (not
/// just the parser) see garbage.
fn keyed_object() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        (0i64..70).prop_map(|n| n.to_string()),
        proptest::collection::vec(prop_oneof![Just(0i64), Just(4), Just(128), any::<i64>()], 0..70)
            .prop_map(|v| format!("[{}]", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","))),
        Just("null".to_string()),
        Just("\"x\"".to_string()),
        Just("2.5".to_string()),
        Just("{}".to_string()),
    ];
    let keys = [
        "compress_ratios",
        "num_hidden_layers",
        "num_nextn_predict_layers",
        "sliding_window",
        "head_dim",
        "qk_rope_head_dim",
        "index_head_dim",
        "index_topk",
    ];
    proptest::collection::vec((0usize..keys.len(), value), 0..10).prop_map(move |kv| {
        let body: Vec<String> = kv.iter().map(|(k, v)| format!("\"{}\": {}", keys[*k], v)).collect();
        format!("{{{}}}", body.join(","))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn random_text_never_panics(parts in proptest::collection::vec(fragment(), 0..40), k in any::<i64>()) {
        let text = parts.concat();
        let _ = ModelShape::from_config_json(&text, k);
        let _ = ModelShape::from_config_json_with(&text, k.rem_euclid(8), Some(Drafts { stages: 3, mode: DraftMode::Absent }));
    }

    #[test]
    fn random_objects_are_shapes_or_typed_errors(text in keyed_object(), k in -2i64..10, stages in 0usize..5) {
        let drafts = (stages > 0).then_some(Drafts { stages, mode: DraftMode::Dense });
        match ModelShape::from_config_json_with(&text, k, drafts) {
            Ok(m) => {
                // Whatever is accepted is a shape the geometry can take.
                prop_assert!(k >= 0);
                prop_assert_eq!(m.ring_slots(), m.sliding_window + k);
                let expected = m.num_hidden_layers + m.num_mtp_layers + m.draft_layers.len();
                prop_assert_eq!(m.ratios.len(), expected);
                prop_assert!(m.qk_rope_head_dim <= m.head_dim);
                let _ = m.geometry_spec(1, 1).build();
            }
            Err(e) => prop_assert!(!e.variant_name().is_empty()),
        }
    }
}

// ---- config forms (issue 9) and bounded reads (issue 10 point 7) -------------------------

/// The Flash config with its ratios written as transformers does: `layer_types` names (the
/// trunk's 43, or all 44 with the MTP layer) and, optionally, the `compress_rates` map.
fn flash_native(with_mtp: bool, rates: bool, keep_list: Option<&str>) -> String {
    let names: Vec<serde_json::Value> = flash_ratios()[..if with_mtp { 44 } else { 43 }]
        .iter()
        .map(|r| match r {
            0 => "sliding_attention",
            4 => "compressed_sparse_attention",
            _ => "heavily_compressed_attention",
        })
        .map(serde_json::Value::from)
        .collect();
    let mut v: serde_json::Value = serde_json::from_str(&flash_config()).unwrap();
    let obj = v.as_object_mut().unwrap();
    obj.remove("compress_ratios");
    if let Some(list) = keep_list {
        obj.insert("compress_ratios".into(), serde_json::from_str(list).unwrap());
    }
    obj.insert("layer_types".into(), names.into());
    if rates {
        obj.insert(
            "compress_rates".into(),
            serde_json::json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}),
        );
    }
    v.to_string()
}

#[test]
fn every_config_form_gives_one_layout() {
    use v4pool::checkpoint::layout_id;
    use v4pool::model::RatioForm;
    use v4pool::sizing::{IndexerDtype, KvDtype, PoolLayout};
    let zeros = list(&flash_ratios());
    let ones = list(&flash_ratios().iter().map(|&r| if r == 0 { 1 } else { r }).collect::<Vec<_>>());
    let forms = [
        (flash_config(), RatioForm::CompressRatios),
        (flash_with("compress_ratios", Some(&ones)), RatioForm::CompressRatios),
        (flash_native(false, true, None), RatioForm::LayerTypes),
        (flash_native(true, false, None), RatioForm::LayerTypes),
        (flash_native(false, true, Some(&ones)), RatioForm::Both),
        (flash_native(true, true, Some(&zeros)), RatioForm::Both),
    ];
    let want = ModelShape::from_config_json(&flash_config(), 1).unwrap();
    assert_eq!(want.ratios, ModelShape::v4_flash(1).unwrap().ratios);
    for (text, form) in forms {
        let got = ModelShape::read_config(&text, 1, None).unwrap_or_else(|e| panic!("{form:?}: {e}"));
        assert_eq!(got.ratio_form, form);
        assert_eq!(got.shape, want, "{form:?}: another model");
        for kv in [KvDtype::Fp8, KvDtype::Bf16] {
            let (a, b) = (
                PoolLayout::new(&got.shape, kv, IndexerDtype::Fp4).unwrap(),
                PoolLayout::new(&want, kv, IndexerDtype::Fp4).unwrap(),
            );
            assert_eq!(a, b);
            assert_eq!(layout_id(&a).unwrap(), layout_id(&b).unwrap());
        }
        // The report names exactly the ratio keys the form used, and what else was read.
        let ratio_keys: Vec<&str> = got
            .keys_read
            .iter()
            .copied()
            .filter(|k| ["compress_ratios", "layer_types", "compress_rates"].contains(k))
            .collect();
        let expect: &[&str] = match form {
            RatioForm::CompressRatios => &["compress_ratios"],
            RatioForm::LayerTypes if text.contains("compress_rates") => &["layer_types", "compress_rates"],
            RatioForm::LayerTypes => &["layer_types"],
            RatioForm::Both => &["compress_ratios", "layer_types", "compress_rates"],
        };
        assert_eq!(ratio_keys, expect, "{form:?}");
        for key in ["num_hidden_layers", "num_nextn_predict_layers", "sliding_window", "index_topk"] {
            assert!(got.keys_read.contains(&key), "{form:?}: {key} not reported");
        }
        assert!(!got.keys_read.contains(&"hidden_size"), "hidden_size is not read");
    }
}

#[test]
fn contradictory_or_unknown_forms_are_typed_errors() {
    use ModelError::*;
    // Layer 3 is HCA in the list, CSA in layer_types.
    let mut r = flash_ratios();
    r[3] = 4;
    let text = flash_native(false, true, Some(&list(&r)));
    assert_eq!(
        ModelShape::from_config_json(&text, 0),
        Err(FormsDisagree { layer: 3, compress_ratios: 4, layer_types: 128 })
    );
    // Ratios in another order are another model, not a match.
    let mut swapped = flash_ratios();
    swapped.swap(2, 3);
    assert!(matches!(
        ModelShape::from_config_json(&flash_native(true, true, Some(&list(&swapped))), 0),
        Err(FormsDisagree { layer: 2, .. })
    ));
    let cases: Vec<HostileCase> = vec![
        (
            flash_native(true, true, None).replace("\"sliding_attention\"", "\"full_attention\""),
            |e| matches!(e, UnknownLayerType { layer: 0, got } if got == "full_attention"),
        ),
        (
            flash_native(true, true, None)
                .replace("\"compressed_sparse_attention\":4", "\"compressed_sparse_attention\":8"),
            |e| matches!(e, BadValue { key: "compress_rates", .. }),
        ),
        (
            flash_native(true, true, None)
                .replace("\"heavily_compressed_attention\":128", "\"heavily_compressed_attention\":4"),
            |e| matches!(e, BadValue { key: "compress_rates", .. }),
        ),
        (
            flash_native(true, false, None)
                .replace("\"layer_types\":[", "\"compress_rates\":[4],\"layer_types\":["),
            |e| matches!(e, WrongType { key: "compress_rates", .. }),
        ),
        (flash_native(true, false, None).replacen("\"sliding_attention\"", "7", 1), |e| {
            matches!(e, WrongType { key: "layer_types", .. })
        }),
        (flash_with("layer_types", Some("\"sliding_attention\"")), |e| {
            matches!(e, WrongType { key: "layer_types", got: "a string", .. })
        }),
        // 43 names are the trunk (the MTP layer follows); 42 are neither.
        (flash_native(false, false, None).replacen("\"sliding_attention\",", "", 1), |e| {
            matches!(e, RatioCount { got: 42, .. })
        }),
    ];
    for (text, check) in cases {
        match ModelShape::from_config_json(&text, 0) {
            Err(e) => assert!(check(&e), "unexpected {e:?}"),
            Ok(m) => panic!("accepted {:?}", m.ratios),
        }
    }
}

/// A fresh directory under the system temp dir.
fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("v4pool-model-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `from_config_path` on `path` in a thread, failing the test if it does not answer in 10 s.
#[allow(clippy::result_large_err)] // the library's error type, as the library returns it
fn read_path(path: &std::path::Path) -> Result<v4pool::model::ModelConfig, ModelError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || tx.send(ModelShape::from_config_path(&p, 0, None)));
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("reading {} hung", path.display()))
}

#[test]
fn config_paths_are_read_bounded() {
    use v4pool::model::MAX_CONFIG_BYTES;
    let dir = temp_dir("paths");
    let file = dir.join("config.json");
    std::fs::write(&file, flash_config()).unwrap();
    let got = read_path(&file).unwrap();
    assert_eq!(got.shape.ratios, ModelShape::v4_flash(0).unwrap().ratios);
    assert_eq!(got.shape.name, file.display().to_string());
    // A directory means its config.json.
    assert_eq!(read_path(&dir).unwrap().shape.name, file.display().to_string());
    // Whitespace past the cap: refused, though it is valid JSON.
    let big = dir.join("big.json");
    let mut text = flash_config().into_bytes();
    text.resize(MAX_CONFIG_BYTES as usize + 1, b' ');
    std::fs::write(&big, &text).unwrap();
    assert!(
        matches!(read_path(&big), Err(ModelError::File(FileError::TooLarge { limit, .. })) if limit == MAX_CONFIG_BYTES)
    );
    text.truncate(MAX_CONFIG_BYTES as usize);
    std::fs::write(&big, &text).unwrap();
    assert!(read_path(&big).is_ok(), "exactly the cap is fine");
    std::fs::write(&big, [0xff, 0xfe, b'{']).unwrap();
    assert!(matches!(read_path(&big), Err(ModelError::File(FileError::NotUtf8 { .. }))));
    assert!(matches!(read_path(&dir.join("missing.json")), Err(ModelError::File(FileError::Io { .. }))));
    // Devices and FIFOs: refused before they are read, without hanging.
    for dev in ["/dev/zero", "/dev/urandom", "/dev/null"] {
        if std::path::Path::new(dev).exists() {
            let got = read_path(std::path::Path::new(dev));
            assert!(
                matches!(got, Err(ModelError::File(FileError::NotAFile { kind: "a character device", .. }))),
                "{dev}: {got:?}"
            );
        }
    }
    let fifo = dir.join("fifo.json");
    if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        assert!(matches!(
            read_path(&fifo),
            Err(ModelError::File(FileError::NotAFile { kind: "a FIFO", .. }))
        ));
    } else {
        println!("SKIP: mkfifo unavailable; FIFO case not run");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
