//! DeepSeek-V4 facts a pool needs (`pool-runtime.md` §1): ratio lists, ring size, widths.
//!
//! The ratio list is data: nothing here assumes a pattern beyond the presets, and a model
//! may have no dense class at all (V4-Pro with DSpark drafts made absent).

use crate::file::read_text_bounded;
// A `config.json` read's refusal (the bounded reader's error, `crate::raw::file`).
pub use crate::file::FileError;
use crate::geometry::{
    resolve_owners, GeometryError, GeometrySpec, ABSENT_RATIO, CSA_RATIO, DENSE_RATIO, HCA_RATIO,
};
use thiserror::Error;

/// Tokens per block, forced for every V4 model: 2·lcm(4, 128).
pub const V4_BLOCK_SIZE: i64 = 256;

/// How DSpark draft layers enter the pool's ratio list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DraftMode {
    /// Drafts keep their window in the planes like any dense layer (ATOM's test shape).
    Dense,
    /// Drafts want bf16 KV where the pool is packed: their windows are a state field and
    /// the layers are `ABSENT_RATIO` here.
    Absent,
}

/// Which DeepSeek generation a model is: it fixes what ratio 1 means and whether layers
/// share compressors (`docs/v41.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// DeepSeek-V4 / V4-Pro: ratios 0 (or 1) window-only, 4, 128; every compressed layer
    /// owns its rows.
    #[default]
    V4,
    /// DeepSeek-V4.1: any positive ratio dividing the block size (1 is a compressed class),
    /// shared compressors (`kv_source_layer_ids`), Engram history in the cursor.
    V41,
}

impl ModelFamily {
    /// The family a config's `model_type` names (`deepseek_v41`, `deepseek_v41_text`, and
    /// their variants are V4.1; everything else is read as V4).
    pub fn from_model_type(model_type: &str) -> ModelFamily {
        if model_type.starts_with("deepseek_v41") {
            ModelFamily::V41
        } else {
            ModelFamily::V4
        }
    }
}

/// Everything the pool reads from a DeepSeek-V4 model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Model name (a preset's, or the config's `model_type`).
    pub name: String,
    /// Trunk depth (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Serial MTP layers appended after the trunk (`num_nextn_predict_layers`).
    pub num_mtp_layers: usize,
    /// The pool's ratio list: trunk, MTP, then draft layers (`-1` when absent).
    pub ratios: Vec<i32>,
    /// Global ids of DSpark draft layers, sorted (empty without DSpark).
    pub draft_layers: Vec<usize>,
    /// The sliding window W.
    pub sliding_window: i64,
    /// Speculative steps k (MTP depth or DSpark tokens; 0 without speculation).
    pub spec_steps: i64,
    /// Attention head dimension (NoPE + RoPE).
    pub head_dim: i64,
    /// RoPE part of the head dimension.
    pub qk_rope_head_dim: i64,
    /// Indexer head dimension.
    pub index_head_dim: i64,
    /// CSA top-k per token.
    pub index_topk: i64,
    /// Tokens per block.
    pub block_size: i64,
    /// The generation (fixes ratio 1's meaning and the state fields).
    pub family: ModelFamily,
    /// KV source layers (`kv_source_layer_ids`): the layers with a compressor, compressed
    /// rows and index keys; every other compressed layer reads the nearest one before it.
    /// Empty: every compressed layer owns its rows (V4).
    pub kv_sources: Vec<usize>,
    /// Index source layers (`index_source_layer_ids`): the layers that run the indexer's
    /// top-k (a superset of `kv_sources`). Empty in V4.
    pub index_sources: Vec<usize>,
    /// Compressed ids of Engram history a request's cursor keeps (`engram_max_ngram_size −
    /// 1`; 0 without Engram).
    pub engram_history: i64,
}

/// The widths the pool's row format stores (`pool-runtime.md` §1, row formats): a KV row of
/// 512 values (448 NoPE + 64 RoPE) and indexer keys of 128; a config with other dims is
/// refused naming the first key that differs.
pub fn check_row_format(head_dim: i64, qk_rope_head_dim: i64, index_head_dim: i64) -> Result<(), ModelError> {
    for (key, got, expected) in [
        ("head_dim", head_dim, 512),
        ("qk_rope_head_dim", qk_rope_head_dim, 64),
        ("index_head_dim", index_head_dim, 128),
    ] {
        if got != expected {
            return Err(ModelError::RowFormat { key, got, expected });
        }
    }
    Ok(())
}

crate::variant::variant_names! {
/// What a model description can be rejected for.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("config is not valid JSON: {0}")]
    /// Config is not valid JSON: the value.
    Json(String),
    #[error("config key {key} = {got} does not match the pool's row format ({expected})")]
    /// Config key `key` = `got` differs from the width the pool's row format stores
    /// (`expected`): the rows would be planned at V4 widths the model does not have.
    RowFormat {
        /// The config key.
        key: &'static str,
        /// The value given.
        got: i64,
        /// The width the row format has.
        expected: i64,
    },
    #[error("config key {key} is missing")]
    /// Config key `key` is missing.
    MissingKey {
        /// The config key.
        key: &'static str,
    },
    #[error("config key {key} has an invalid value: {reason}")]
    /// Config key `key` has an invalid value: `reason`.
    BadValue {
        /// The config key.
        key: &'static str,
        /// Why.
        reason: String,
    },
    #[error("compress_ratios has {got} entries, expected {expected} (num_hidden_layers + num_nextn_predict_layers)")]
    /// `compress_ratios` has `got` entries, expected `expected` (num_hidden_layers + num_nextn_predict_layers).
    RatioCount {
        /// The value given.
        got: usize,
        /// The value expected.
        expected: usize,
    },
    #[error("speculative steps must be non-negative, got {got}")]
    /// Speculative steps must be non-negative, got `got`.
    SpecSteps {
        /// The value given.
        got: i64,
    },
    #[error("unknown model preset {name:?} (v4-flash, v4-pro, v4-flash-dspark, v4-pro-dspark, v4.1-flash, v4.1-flash-dspark)")]
    /// Unknown model preset `name` (v4-flash, v4-pro, v4-flash-dspark, v4-pro-dspark, v4.1-flash, v4.1-flash-dspark).
    UnknownPreset {
        /// The name.
        name: String,
    },
    #[error("config must be a JSON object, got {got}")]
    /// Config must be a JSON object, got `got`.
    NotAnObject {
        /// The value given.
        got: &'static str,
    },
    #[error("config key {key} must be {expected}, got {got}")]
    /// Config key `key` must be `expected`, got `got`.
    WrongType {
        /// The config key.
        key: &'static str,
        /// The value expected.
        expected: &'static str,
        /// The value given.
        got: &'static str,
    },
    #[error("config key {key} = {got} outside {min}..={max}")]
    /// Config key `key` = `got` outside `min`..=`max`.
    OutOfRange {
        /// The config key.
        key: &'static str,
        /// The value given.
        got: i64,
        /// The least allowed.
        min: i64,
        /// The most allowed.
        max: i64,
    },
    #[error("compress_ratios[{layer}] = {got} is not a V4 compress ratio (0, 4 or 128)")]
    /// `compress_ratios[`layer`]` = `got` is not a V4 compress ratio (0, 4 or 128).
    UnknownRatio {
        /// Layer id.
        layer: usize,
        /// The value given.
        got: i64,
    },
    #[error("speculative steps {got} exceed the most a ring is sized for ({max})")]
    /// Speculative steps `got` exceed the most a ring is sized for (`max`).
    SpecStepsTooLarge {
        /// The value given.
        got: i64,
        /// The most allowed.
        max: i64,
    },
    #[error("{stages} draft stages outside 1..={max}")]
    /// `stages` draft stages outside 1..=`max`.
    DraftStages {
        /// Stages given.
        stages: usize,
        /// The most allowed.
        max: usize,
    },
    /// `layer_types` names a kind of attention V4 does not have.
    #[error("layer_types[{layer}] = {got:?} is not a V4 attention type (sliding_attention, compressed_sparse_attention, heavily_compressed_attention)")]
    UnknownLayerType {
        /// The layer's index in `layer_types`.
        layer: usize,
        /// The name found there.
        got: String,
    },
    /// The checkpoint's `compress_ratios` and the transformers-native `layer_types` (with
    /// `compress_rates`) both describe the layers, and they differ.
    #[error("compress_ratios[{layer}] gives ratio {compress_ratios}, layer_types[{layer}] gives {layer_types}: the two forms disagree")]
    FormsDisagree {
        /// The first layer where they differ.
        layer: usize,
        /// The pool ratio `compress_ratios` gives there (0 dense, 4 CSA, 128 HCA).
        compress_ratios: i32,
        /// The pool ratio `layer_types` gives there.
        layer_types: i32,
    },
    /// A config file the bounded reader refused (unreadable, not a regular file, over
    /// [`MAX_CONFIG_BYTES`], not UTF-8).
    #[error(transparent)]
    File(#[from] FileError),
    /// A V4.1 draft layer's `compress_ratios` entry is not 0 (drafts are window-only).
    #[error("compress_ratios[{layer}] = {got}: draft layers are window-only (0)")]
    DraftNotWindowOnly {
        /// The draft layer.
        layer: usize,
        /// The ratio given.
        got: i64,
    },
    /// A source layer list that names a draft layer, or KV sources that are not index
    /// sources.
    #[error("{key}: {reason}")]
    Sources {
        /// The config key.
        key: &'static str,
        /// Why.
        reason: String,
    },
    /// A source layer list the geometry refuses (unsorted, not a compressed layer, a layer
    /// with no source before it or with one of another class).
    #[error("{key}: {source}")]
    SourceOwners {
        /// The config key.
        key: &'static str,
        /// What the geometry refused.
        source: GeometryError,
    },
}
}

/// Speculative (MTP) steps a plan takes when none are named: every entry point's one default
/// (the CLI's `--spec-steps`, Python's `plan(spec_steps=)`, `plan_report::PlanOptions`).
pub const DEFAULT_SPEC_STEPS: i64 = 0;

/// Most speculative steps a ring is sized for. Real configs use 0..=7; the bound keeps
/// `ring_slots` and every product with it far from overflow.
pub const MAX_SPEC_STEPS: i64 = 1 << 16;
/// Most layers a config may declare (trunk, MTP or draft stages): V4-Pro has 62.
pub const MAX_LAYERS: i64 = 1 << 12;
/// Largest sliding window, head or indexer width, or top-k a config may declare. Far above
/// any V4 value; it only keeps the products the pool forms from them inside 64 bits.
pub const MAX_DIM: i64 = 1 << 24;

/// Largest config file [`ModelShape::from_config_path`] reads. V4's `config.json` is about
/// 2 KB; the cap keeps a mistaken path (a log, a weights file) from filling memory.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Which of the two ways of naming each layer's compression a config used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RatioForm {
    /// The checkpoint's `compress_ratios` list (0 or 1: sliding only; 4: CSA; 128: HCA).
    CompressRatios,
    /// The transformers-native `layer_types` names with their `compress_rates` map.
    LayerTypes,
    /// Both, checked to agree layer by layer.
    Both,
}

impl RatioForm {
    /// The form's name as reports show it.
    pub fn name(self) -> &'static str {
        match self {
            RatioForm::CompressRatios => "compress_ratios",
            RatioForm::LayerTypes => "layer_types",
            RatioForm::Both => "compress_ratios+layer_types",
        }
    }
}

/// A parsed `config.json`: the model shape and what was read to make it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// The model the config describes.
    pub shape: ModelShape,
    /// The config keys that were present and read, in the order read.
    pub keys_read: Vec<&'static str>,
    /// Where the per-layer ratios came from.
    pub ratio_form: RatioForm,
}

/// The transformers-native names of V4's attention kinds (`layer_types` entries and
/// `compress_rates` keys).
pub const SLIDING_ATTENTION: &str = "sliding_attention";
/// A CSA layer in `layer_types` (compress rate 4).
pub const COMPRESSED_SPARSE_ATTENTION: &str = "compressed_sparse_attention";
/// An HCA layer in `layer_types` (compress rate 128).
pub const HEAVILY_COMPRESSED_ATTENTION: &str = "heavily_compressed_attention";

/// A config's compress ratio as the pool's ratio. V4: 0 and 1 (how some engines write a
/// sliding-only layer) are dense, 4 CSA, 128 HCA, nothing else. V4.1: 0 dense, any positive
/// ratio kept as it is (the geometry checks it divides the block size).
fn pool_ratio(got: i64, family: ModelFamily) -> Option<i32> {
    match (family, got) {
        (ModelFamily::V4, 0 | 1) => Some(DENSE_RATIO),
        (ModelFamily::V4, 4) => Some(CSA_RATIO),
        (ModelFamily::V4, 128) => Some(HCA_RATIO),
        (ModelFamily::V4, _) => None,
        (ModelFamily::V41, r) => i32::try_from(r).ok().filter(|&r| r >= 0),
    }
}

/// DSpark draft stages to append to a config's trunk (stage count comes from the draft
/// checkpoint, not from `config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Drafts {
    /// Draft stages (DSpark).
    pub stages: usize,
    /// How the draft layers keep their KV.
    pub mode: DraftMode,
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    use serde_json::Value::*;
    match v {
        Null => "null",
        Bool(_) => "a boolean",
        Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Number(_) => "a non-integer number",
        String(_) => "a string",
        Array(_) => "a list",
        Object(_) => "an object",
    }
}

/// An integer config value inside `min..=max`; floats, strings and out-of-range numbers
/// are typed errors (a `u64` above `i64::MAX` reads as out of range, not wrapped).
fn int_in(v: &serde_json::Value, key: &'static str, min: i64, max: i64) -> Result<i64, ModelError> {
    let got = match v {
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i
            } else if n.is_u64() {
                i64::MAX
            } else {
                return Err(ModelError::WrongType { key, expected: "an integer", got: json_kind(v) });
            }
        }
        _ => return Err(ModelError::WrongType { key, expected: "an integer", got: json_kind(v) }),
    };
    if !(min..=max).contains(&got) {
        return Err(ModelError::OutOfRange { key, got, min, max });
    }
    Ok(got)
}

fn check_spec_steps(spec_steps: i64) -> Result<(), ModelError> {
    if spec_steps < 0 {
        return Err(ModelError::SpecSteps { got: spec_steps });
    }
    if spec_steps > MAX_SPEC_STEPS {
        return Err(ModelError::SpecStepsTooLarge { got: spec_steps, max: MAX_SPEC_STEPS });
    }
    Ok(())
}

fn v4_trunk_flash() -> Vec<i32> {
    let mut r = vec![DENSE_RATIO, DENSE_RATIO];
    for _ in 0..20 {
        r.extend([CSA_RATIO, HCA_RATIO]);
    }
    r.push(CSA_RATIO);
    r
}

fn v4_trunk_pro() -> Vec<i32> {
    let mut r = vec![HCA_RATIO, HCA_RATIO];
    for _ in 0..29 {
        r.extend([CSA_RATIO, HCA_RATIO]);
    }
    r.push(CSA_RATIO);
    r
}

const RATIOS: &str = "compress_ratios";
const LAYER_TYPES: &str = "layer_types";
const COMPRESS_RATES: &str = "compress_rates";

/// The `compress_ratios` list as pool ratios.
fn ratio_list(v: &serde_json::Value, family: ModelFamily) -> Result<Vec<i32>, ModelError> {
    let serde_json::Value::Array(list) = v else {
        return Err(ModelError::WrongType { key: RATIOS, expected: "a list", got: json_kind(v) });
    };
    list.iter()
        .enumerate()
        .map(|(layer, v)| {
            let got = match v {
                serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => n.as_i64().unwrap_or(i64::MAX),
                other => {
                    return Err(ModelError::WrongType {
                        key: RATIOS,
                        expected: "a list of integers",
                        got: json_kind(other),
                    })
                }
            };
            // -1 is the pool's own rewrite (DraftMode::Absent), never a config value.
            pool_ratio(got, family).ok_or(ModelError::UnknownRatio { layer, got })
        })
        .collect()
}

/// The `layer_types` names as pool ratios, through `compress_rates` (the trunk alone gets
/// its `with_mtp - trunk` MTP layers appended, sliding as V4's are).
fn layer_type_ratios(
    types: &serde_json::Value,
    rates: Option<&serde_json::Value>,
    trunk: usize,
    with_mtp: usize,
) -> Result<Vec<i32>, ModelError> {
    let serde_json::Value::Array(list) = types else {
        return Err(ModelError::WrongType { key: LAYER_TYPES, expected: "a list", got: json_kind(types) });
    };
    let rates = match rates {
        None => None,
        Some(serde_json::Value::Object(m)) => Some(m),
        Some(other) => {
            return Err(ModelError::WrongType {
                key: COMPRESS_RATES,
                expected: "an object",
                got: json_kind(other),
            })
        }
    };
    // Each kind's ratio: the map's rate (when given) must be the one V4 defines for it.
    let kind_ratio = |kind: &str, default: i64, ratio: i32| -> Result<i32, ModelError> {
        let Some(v) = rates.and_then(|m| m.get(kind)).filter(|v| !v.is_null()) else { return Ok(ratio) };
        let got = int_in(v, COMPRESS_RATES, 0, i64::MAX)?;
        if pool_ratio(got, ModelFamily::V4) != Some(ratio) {
            return Err(ModelError::BadValue {
                key: COMPRESS_RATES,
                reason: format!("{kind} has rate {got}; V4 defines {default}"),
            });
        }
        Ok(ratio)
    };
    let sliding = kind_ratio(SLIDING_ATTENTION, 1, DENSE_RATIO)?;
    let csa = kind_ratio(COMPRESSED_SPARSE_ATTENTION, 4, CSA_RATIO)?;
    let hca = kind_ratio(HEAVILY_COMPRESSED_ATTENTION, 128, HCA_RATIO)?;
    let mut out = list
        .iter()
        .enumerate()
        .map(|(layer, v)| match v.as_str() {
            Some(SLIDING_ATTENTION) => Ok(sliding),
            Some(COMPRESSED_SPARSE_ATTENTION) => Ok(csa),
            Some(HEAVILY_COMPRESSED_ATTENTION) => Ok(hca),
            Some(other) => Err(ModelError::UnknownLayerType { layer, got: other.to_string() }),
            None => Err(ModelError::WrongType {
                key: LAYER_TYPES,
                expected: "a list of strings",
                got: json_kind(v),
            }),
        })
        .collect::<Result<Vec<i32>, _>>()?;
    if out.len() == trunk {
        out.resize(with_mtp, sliding);
    }
    Ok(out)
}

/// A config path's file and text: a directory means its `config.json`; the file is read by
/// the crate's one bounded reader ([`crate::file::read_text_bounded`]) at [`MAX_CONFIG_BYTES`].
fn read_bounded(path: &std::path::Path) -> Result<(std::path::PathBuf, String), ModelError> {
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    let text = read_text_bounded(&file, MAX_CONFIG_BYTES)?;
    Ok((file, text))
}

const TEXT_CONFIG: &str = "text_config";
const MODEL_TYPE: &str = "model_type";
const KV_SOURCES: &str = "kv_source_layer_ids";
const INDEX_SOURCES: &str = "index_source_layer_ids";
const ENGRAM: &str = "engram_max_ngram_size";

type Obj = serde_json::Map<String, serde_json::Value>;

/// The family `model_type` names: the text config's, else the top level's; absent is V4.
fn model_family(
    obj: &Obj,
    top: &Obj,
    read: &std::cell::RefCell<Vec<&'static str>>,
) -> Result<ModelFamily, ModelError> {
    let mut family = ModelFamily::V4;
    for o in [top, obj] {
        match o.get(MODEL_TYPE).filter(|v| !v.is_null()) {
            None => {}
            Some(serde_json::Value::String(t)) => {
                if !read.borrow().contains(&MODEL_TYPE) {
                    read.borrow_mut().push(MODEL_TYPE);
                }
                // Either level naming V4.1 makes it V4.1 (the top says `deepseek_v41`, the
                // text config `deepseek_v41_text`).
                if ModelFamily::from_model_type(t) == ModelFamily::V41 {
                    family = ModelFamily::V41;
                }
            }
            Some(other) => {
                return Err(ModelError::WrongType {
                    key: MODEL_TYPE,
                    expected: "a string",
                    got: json_kind(other),
                })
            }
        }
    }
    Ok(family)
}

/// What a V4.1 config adds.
#[derive(Default)]
struct V41Keys {
    kv_sources: Vec<usize>,
    index_sources: Vec<usize>,
    engram_history: i64,
}

/// A list of layer ids (non-negative integers; the geometry checks order and range).
fn layer_list(v: &serde_json::Value, key: &'static str) -> Result<Vec<usize>, ModelError> {
    let serde_json::Value::Array(list) = v else {
        return Err(ModelError::WrongType { key, expected: "a list", got: json_kind(v) });
    };
    list.iter().map(|x| int_in(x, key, 0, MAX_LAYERS).map(|i| i as usize)).collect()
}

/// V4.1's own keys, checked against the ratio list: draft entries window-only; both source
/// lists sorted, unique, compressed backbone layers, KV sources given (at least one) and among
/// the index sources, and
/// every compressed layer with a source of its class before it; the Engram history.
fn read_v41_keys<'a>(
    ratios: &[i32],
    backbone: usize,
    get: &dyn Fn(&'static str) -> Option<&'a serde_json::Value>,
) -> Result<V41Keys, ModelError> {
    if let Some((layer, &r)) = ratios.iter().enumerate().skip(backbone).find(|(_, &r)| r != DENSE_RATIO) {
        return Err(ModelError::DraftNotWindowOnly { layer, got: i64::from(r) });
    }
    let sources = |key: &'static str| -> Result<Vec<usize>, ModelError> {
        let list = get(key).map(|v| layer_list(v, key)).transpose()?.unwrap_or_default();
        if let Some(&l) = list.iter().find(|&&l| l >= backbone) {
            return Err(ModelError::Sources {
                key,
                reason: format!("layer {l} is not a backbone layer (< {backbone})"),
            });
        }
        resolve_owners(ratios, &list).map_err(|source| ModelError::SourceOwners { key, source })?;
        Ok(list)
    };
    let kv_sources = sources(KV_SOURCES)?;
    // V4.1 shares compressors: its compressor state is held per KV source, so a config that
    // names none describes no V4.1 pool (the geometry alone would lay it out in V4's form).
    // Refused here, where every reader (layout, plan, the bindings) meets it.
    if kv_sources.is_empty() {
        return Err(ModelError::Sources {
            key: KV_SOURCES,
            reason: "a V4.1 config names its KV source layers (those with a compressor): none given".into(),
        });
    }
    let index_sources = sources(INDEX_SOURCES)?;
    if !index_sources.is_empty() {
        if let Some(&l) = kv_sources.iter().find(|l| !index_sources.contains(l)) {
            return Err(ModelError::Sources {
                key: KV_SOURCES,
                reason: format!("layer {l} is not an index source"),
            });
        }
    }
    let engram_history = get(ENGRAM).map_or(Ok(1), |v| int_in(v, ENGRAM, 1, MAX_DIM))? - 1;
    Ok(V41Keys { kv_sources, index_sources, engram_history })
}

impl ModelShape {
    /// A published shape: window 128, head 512 (RoPE 64), indexer 128, block 256.
    fn published(
        name: &str,
        ratios: Vec<i32>,
        trunk: usize,
        spec_steps: i64,
        topk: i64,
    ) -> Result<Self, ModelError> {
        check_spec_steps(spec_steps)?;
        Ok(ModelShape {
            name: name.to_string(),
            num_hidden_layers: trunk,
            num_mtp_layers: ratios.len() - trunk,
            ratios,
            draft_layers: Vec::new(),
            sliding_window: 128,
            spec_steps,
            head_dim: 512,
            qk_rope_head_dim: 64,
            index_head_dim: 128,
            index_topk: topk,
            block_size: V4_BLOCK_SIZE,
            family: ModelFamily::V4,
            kv_sources: Vec::new(),
            index_sources: Vec::new(),
            engram_history: 0,
        })
    }

    fn preset(name: &str, trunk: Vec<i32>, spec_steps: i64, topk: i64) -> Result<Self, ModelError> {
        let num_hidden_layers = trunk.len();
        let mut ratios = trunk;
        ratios.push(DENSE_RATIO); // the MTP layer, sized whether or not speculation is on
        Self::published(name, ratios, num_hidden_layers, spec_steps, topk)
    }

    /// DeepSeek-V4.1-Flash without its draft layers: `[0,0] + [2]*18 + [1]*20`, KV sources
    /// 2, 8, 14, 20, index sources those and 24, 28, 32, 36, Engram history 3.
    pub fn v41_flash(spec_steps: i64) -> Result<Self, ModelError> {
        let mut ratios = vec![DENSE_RATIO; 2];
        ratios.extend([2; 18]);
        ratios.extend([1; 20]);
        Ok(ModelShape {
            family: ModelFamily::V41,
            kv_sources: vec![2, 8, 14, 20],
            index_sources: vec![2, 8, 14, 20, 24, 28, 32, 36],
            engram_history: 3,
            ..Self::published("v4.1-flash", ratios, 40, spec_steps, 512)?
        })
    }

    /// V4.1-Flash with its three DSpark draft layers (40–42), window-only, each with its
    /// own window ring in the entry.
    pub fn v41_flash_dspark(spec_steps: i64) -> Result<Self, ModelError> {
        let mut m = Self::v41_flash(spec_steps)?;
        m.ratios.extend([DENSE_RATIO; 3]);
        m.draft_layers = vec![40, 41, 42];
        m.name.push_str("-dspark");
        Ok(m)
    }

    /// V4-Flash: `[0,0] + [4,128]*20 + [4] + [0]` (43 trunk layers + 1 MTP).
    pub fn v4_flash(spec_steps: i64) -> Result<Self, ModelError> {
        Self::preset("v4-flash", v4_trunk_flash(), spec_steps, 512)
    }

    /// V4-Pro: `[128,128] + [4,128]*29 + [4] + [0]` (61 trunk layers + 1 MTP).
    pub fn v4_pro(spec_steps: i64) -> Result<Self, ModelError> {
        Self::preset("v4-pro", v4_trunk_pro(), spec_steps, 1024)
    }

    /// A trunk followed by `stages` DSpark draft layers instead of the MTP layer
    /// (ATOM's Flash test shape: `[0,0] + [4,128]*20 + [4] + [0,0,0]`).
    fn with_drafts(mut self, stages: usize, mode: DraftMode) -> Self {
        self.ratios.truncate(self.num_hidden_layers);
        self.num_mtp_layers = 0;
        let first = self.ratios.len();
        let ratio = if mode == DraftMode::Absent { ABSENT_RATIO } else { DENSE_RATIO };
        self.ratios.extend(std::iter::repeat_n(ratio, stages));
        self.draft_layers = (first..first + stages).collect();
        self.name.push_str(if mode == DraftMode::Absent { "-dspark" } else { "-dspark-dense" });
        self
    }

    /// V4-Flash with three DSpark draft stages.
    pub fn v4_flash_dspark(spec_steps: i64, mode: DraftMode) -> Result<Self, ModelError> {
        Ok(Self::v4_flash(spec_steps)?.with_drafts(3, mode))
    }

    /// V4-Pro with three DSpark draft stages (no dense class at all when absent).
    pub fn v4_pro_dspark(spec_steps: i64, mode: DraftMode) -> Result<Self, ModelError> {
        Ok(Self::v4_pro(spec_steps)?.with_drafts(3, mode))
    }

    /// A preset by name: `v4-flash`, `v4-pro`, `v4-flash-dspark`, `v4-pro-dspark`
    /// (drafts absent; append `-dense` for dense drafts).
    pub fn by_name(name: &str, spec_steps: i64) -> Result<Self, ModelError> {
        match name {
            "v4-flash" => Self::v4_flash(spec_steps),
            "v4-pro" => Self::v4_pro(spec_steps),
            "v4-flash-dspark" => Self::v4_flash_dspark(spec_steps, DraftMode::Absent),
            "v4-pro-dspark" => Self::v4_pro_dspark(spec_steps, DraftMode::Absent),
            "v4-flash-dspark-dense" => Self::v4_flash_dspark(spec_steps, DraftMode::Dense),
            "v4-pro-dspark-dense" => Self::v4_pro_dspark(spec_steps, DraftMode::Dense),
            "v4.1-flash" => Self::v41_flash(spec_steps),
            "v4.1-flash-dspark" => Self::v41_flash_dspark(spec_steps),
            _ => Err(ModelError::UnknownPreset { name: name.to_string() }),
        }
    }

    /// Read a HuggingFace `config.json` (no DSpark drafts; see [`Self::from_config_json_with`]).
    pub fn from_config_json(text: &str, spec_steps: i64) -> Result<Self, ModelError> {
        Self::from_config_json_with(text, spec_steps, None)
    }

    /// [`Self::read_config`]'s shape alone.
    pub fn from_config_json_with(
        text: &str,
        spec_steps: i64,
        drafts: Option<Drafts>,
    ) -> Result<Self, ModelError> {
        Ok(Self::read_config(text, spec_steps, drafts)?.shape)
    }

    /// Read a `config.json` file, bounded: a directory means its `config.json`; anything but
    /// a regular file (a FIFO, `/dev/zero`, `/dev/urandom`) is refused without being read,
    /// and a file over [`MAX_CONFIG_BYTES`] is refused after reading at most one byte more.
    /// The shape's name is the file's path.
    pub fn from_config_path(
        path: &std::path::Path,
        spec_steps: i64,
        drafts: Option<Drafts>,
    ) -> Result<ModelConfig, ModelError> {
        let (file, text) = read_bounded(path)?;
        let mut config = Self::read_config(&text, spec_steps, drafts)?;
        config.shape.name = file.display().to_string();
        Ok(config)
    }

    /// Read a HuggingFace `config.json` text, reporting the keys read.
    ///
    /// Keys (`pool-runtime.md` §1): `num_hidden_layers`, `sliding_window`,
    /// `qk_rope_head_dim`, `index_head_dim`, `index_topk` are required;
    /// `num_nextn_predict_layers` defaults to 0 and `head_dim` to 512 (ATOM's `kv_head_dim`
    /// default). A JSON `null` counts as absent. Every malformed value is a typed error.
    ///
    /// The per-layer ratios come from either form, or both (then they must agree layer by
    /// layer: [`ModelError::FormsDisagree`]):
    /// * the checkpoint's `compress_ratios` list: 0 or 1 (sliding only), 4 (CSA), 128 (HCA);
    /// * transformers' `layer_types` (`sliding_attention`, `compressed_sparse_attention`,
    ///   `heavily_compressed_attention`) with the optional `compress_rates` map from those
    ///   names to rates (default 4 and 128; V4 has no others). `layer_types` may list the
    ///   trunk alone, the MTP layers (sliding) then being appended.
    ///
    /// With DSpark drafts, the list may either name the drafts (`num_hidden_layers + stages`
    /// entries, the last `stages` being the drafts) or carry the MTP layers
    /// (`num_hidden_layers + num_nextn_predict_layers`), which the drafts then replace, as the
    /// presets do. Either way a draft's ratio is dense or absent by `mode`, whatever the
    /// config wrote there.
    pub fn read_config(
        text: &str,
        spec_steps: i64,
        drafts: Option<Drafts>,
    ) -> Result<ModelConfig, ModelError> {
        check_spec_steps(spec_steps)?;
        if let Some(d) = drafts {
            if d.stages < 1 || d.stages as i64 > MAX_LAYERS {
                return Err(ModelError::DraftStages { stages: d.stages, max: MAX_LAYERS as usize });
            }
        }
        // serde_json refuses nesting past 128 levels and NaN/Infinity, so hostile text ends
        // here as an error rather than a stack overflow.
        let root: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ModelError::Json(e.to_string()))?;
        let top = match &root {
            serde_json::Value::Object(o) => o,
            other => return Err(ModelError::NotAnObject { got: json_kind(other) }),
        };
        let read = std::cell::RefCell::new(Vec::new());
        // V4.1 keeps every text key under `text_config`; read from there when present.
        let obj = match top.get(TEXT_CONFIG).filter(|v| !v.is_null()) {
            Some(serde_json::Value::Object(t)) => {
                read.borrow_mut().push(TEXT_CONFIG);
                t
            }
            Some(other) => {
                return Err(ModelError::WrongType {
                    key: TEXT_CONFIG,
                    expected: "an object",
                    got: json_kind(other),
                })
            }
            None => top,
        };
        let family = model_family(obj, top, &read)?;
        let get = |key: &'static str| {
            let v = obj.get(key).filter(|v| !v.is_null());
            if v.is_some() {
                read.borrow_mut().push(key);
            }
            v
        };
        let required = |key: &'static str, min: i64, max: i64| -> Result<i64, ModelError> {
            int_in(get(key).ok_or(ModelError::MissingKey { key })?, key, min, max)
        };
        let optional = |key: &'static str, default: i64, min: i64, max: i64| -> Result<i64, ModelError> {
            get(key).map_or(Ok(default), |v| int_in(v, key, min, max))
        };

        let num_hidden_layers = required("num_hidden_layers", 1, MAX_LAYERS)? as usize;
        let nextn = optional("num_nextn_predict_layers", 0, 0, MAX_LAYERS)? as usize;
        let sliding_window = required("sliding_window", 1, MAX_DIM)?;
        let head_dim = optional("head_dim", 512, 1, MAX_DIM)?;
        let qk_rope_head_dim = required("qk_rope_head_dim", 1, head_dim)?;
        let index_head_dim = required("index_head_dim", 1, MAX_DIM)?;
        let index_topk = required("index_topk", 1, MAX_DIM)?;
        check_row_format(head_dim, qk_rope_head_dim, index_head_dim)?;

        let with_mtp = num_hidden_layers + nextn;
        let with_drafts = drafts.map(|d| num_hidden_layers + d.stages);
        let listed = get(RATIOS).map(|v| ratio_list(v, family)).transpose()?;
        let typed = get(LAYER_TYPES)
            .filter(|_| family == ModelFamily::V4)
            .map(|types| layer_type_ratios(types, get(COMPRESS_RATES), num_hidden_layers, with_mtp))
            .transpose()?;
        let (ratios, ratio_form) = match (listed, typed) {
            (Some(l), None) => (l, RatioForm::CompressRatios),
            (None, Some(t)) => (t, RatioForm::LayerTypes),
            (Some(l), Some(t)) => {
                if let Some(layer) = (0..l.len().max(t.len())).find(|&i| l.get(i) != t.get(i)) {
                    return Err(ModelError::FormsDisagree {
                        layer,
                        compress_ratios: l.get(layer).copied().unwrap_or(ABSENT_RATIO),
                        layer_types: t.get(layer).copied().unwrap_or(ABSENT_RATIO),
                    });
                }
                (l, RatioForm::Both)
            }
            (None, None) => return Err(ModelError::MissingKey { key: "compress_ratios (or layer_types)" }),
        };
        if ratios.len() != with_mtp && Some(ratios.len()) != with_drafts {
            return Err(ModelError::RatioCount { got: ratios.len(), expected: with_mtp });
        }
        let v41 = match family {
            ModelFamily::V4 => V41Keys::default(),
            ModelFamily::V41 => read_v41_keys(&ratios, num_hidden_layers, &get)?,
        };

        let mut shape = ModelShape {
            name: "config".to_string(),
            num_hidden_layers,
            num_mtp_layers: nextn,
            ratios,
            draft_layers: Vec::new(),
            sliding_window,
            spec_steps,
            head_dim,
            qk_rope_head_dim,
            index_head_dim,
            index_topk,
            block_size: V4_BLOCK_SIZE,
            family,
            kv_sources: v41.kv_sources,
            index_sources: v41.index_sources,
            engram_history: v41.engram_history,
        };
        if family == ModelFamily::V41 {
            // The layers past the backbone are V4.1's DSpark drafts, windowed in the entry.
            shape.draft_layers = (num_hidden_layers..shape.ratios.len()).collect();
        }
        if let Some(d) = drafts {
            shape = shape.with_drafts(d.stages, d.mode);
        }
        Ok(ModelConfig { shape, keys_read: read.into_inner(), ratio_form })
    }

    /// The geometry arguments the model fixes (ratio list, ring, block size, and for shared
    /// compressors the source layers in the compact form) at a split; the caller adds plane
    /// capacity, arena rows and alignment.
    pub fn geometry_spec(&self, num_blocks: i64, num_slots: i64) -> GeometrySpec {
        GeometrySpec::new(self.ratios.clone(), num_blocks, num_slots, self.ring_slots(), self.block_size)
            .shared_compressors(self.kv_sources.clone())
    }

    /// The layers that own index keys, in order (the indexer cache's layer order): the CSA
    /// layers in V4, the KV sources in V4.1 (its index keys derive from the owner's
    /// compressed latent, so only owners have them).
    pub fn indexer_layers(&self) -> Vec<usize> {
        match self.family {
            ModelFamily::V4 => self.csa_layers(),
            ModelFamily::V41 => self.kv_sources.clone(),
        }
    }

    /// `ring_slots = W + k`: the window plus the draft lookahead.
    pub fn ring_slots(&self) -> i64 {
        self.sliding_window + self.spec_steps
    }

    fn count(&self, ratio: i32) -> usize {
        self.ratios.iter().filter(|&&r| r == ratio).count()
    }
    /// CSA layers.
    pub fn n_csa(&self) -> usize {
        self.count(CSA_RATIO)
    }
    /// HCA layers.
    pub fn n_hca(&self) -> usize {
        self.count(HCA_RATIO)
    }
    /// Dense layers.
    pub fn n_dense(&self) -> usize {
        self.count(DENSE_RATIO)
    }
    /// Draft layers whose window is a state field (`ABSENT_RATIO`), sorted.
    pub fn absent_layers(&self) -> Vec<usize> {
        self.ratios.iter().enumerate().filter(|(_, &r)| r == ABSENT_RATIO).map(|(i, _)| i).collect()
    }
    /// Global ids of the CSA layers, in order (the indexer cache's layer order).
    pub fn csa_layers(&self) -> Vec<usize> {
        self.ratios.iter().enumerate().filter(|(_, &r)| r == CSA_RATIO).map(|(i, _)| i).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_pool_runtime_section_1() {
        let f = ModelShape::v4_flash(0).unwrap();
        assert_eq!(f.ratios.len(), 44);
        assert_eq!((f.n_dense(), f.n_csa(), f.n_hca()), (3, 21, 20));
        assert_eq!(f.ratios[43], DENSE_RATIO);
        let p = ModelShape::v4_pro(1).unwrap();
        assert_eq!(p.ratios.len(), 62);
        assert_eq!((p.n_dense(), p.n_csa(), p.n_hca()), (1, 30, 31));
        assert_eq!(p.ring_slots(), 129);
        let d = ModelShape::v4_flash_dspark(3, DraftMode::Dense).unwrap();
        assert_eq!(d.ratios.len(), 46);
        assert_eq!(d.n_dense(), 5);
        assert_eq!(d.draft_layers, vec![43, 44, 45]);
        let pa = ModelShape::v4_pro_dspark(7, DraftMode::Absent).unwrap();
        assert_eq!(pa.n_dense(), 0);
        assert_eq!(pa.absent_layers(), vec![61, 62, 63]);
        assert_eq!(pa.ring_slots(), 135);
        assert!(matches!(ModelShape::v4_flash(-1), Err(ModelError::SpecSteps { got: -1 })));
    }
}
