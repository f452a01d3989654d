//! A sized plan with its checkpoint facts, and its JSON form: what `v4pool plan --json`
//! prints and what the Python and C bindings hand out. One field list, here, so the three
//! cannot drift.
//!
//! [`PlanOptions`] is the binding-side request (model by preset name or `config.json` path,
//! budget as bytes or text like `8GiB`): the bindings parse their arguments into it and the
//! library does the rest.

use crate::checkpoint::{layout_id, CheckpointError, CheckpointLayout};
use crate::model::{DraftMode, Drafts, ModelError, ModelShape};
use crate::sizing::{
    default_dtypes, plan, GpuArch, IndexerDtype, KvDtype, KvSpec, Plan, PlanRequest, SizingError,
};
use serde_json::json;
use thiserror::Error;

/// A sized pool and its checkpoint facts.
#[derive(Clone, Debug)]
pub struct PlanReport {
    /// The sized pool.
    pub plan: Plan,
    /// Bytes of one slot's checkpoint image (pool-runtime §6).
    pub image_bytes: u64,
    /// PAGE units one checkpoint image occupies.
    pub units_per_checkpoint: u64,
    /// The §6 layout id images of this plan carry.
    pub layout_id: String,
}

impl PlanReport {
    /// Add the checkpoint facts of `plan`'s layout.
    pub fn new(plan: Plan) -> Result<PlanReport, CheckpointError> {
        let ck = CheckpointLayout::for_pool(&plan.layout)?;
        Ok(PlanReport {
            image_bytes: ck.image_bytes,
            units_per_checkpoint: ck.units_per_checkpoint,
            layout_id: layout_id(&plan.layout)?,
            plan,
        })
    }

    /// The `--json` object (also the Python plan's fields).
    pub fn to_json(&self) -> serde_json::Value {
        let p = &self.plan;
        let m = &p.layout.model;
        let g = &p.geometry;
        json!({
            "model": m.name,
            "kv_dtype": p.layout.kv.name(),
            "indexer_dtype": p.layout.indexer.name(),
            "arch": p.arch.map(|a| a.name()),
            "spec_steps": m.spec_steps,
            "ring_slots": m.ring_slots(),
            "plane_widths": p.layout.widths(),
            "budget_bytes": p.budget_bytes,
            "page_bytes": p.page_bytes,
            "slot_bytes": p.slot_bytes,
            "num_blocks": p.num_blocks,
            "num_slots": p.num_slots,
            "max_blocks": p.max_blocks,
            "min_slots": p.min_slots,
            "tight_fit_blocks": p.tight_fit_blocks,
            "plane_rows": p.plane_rows,
            "slot_positions": p.slot_positions,
            "tokens": p.tokens,
            "envelope_rows": g.envelope_rows,
            "entry_rows": g.entry_rows,
            "arena_rows": g.arena_rows,
            "slot_rows": g.slot_rows,
            "slot_align_rows": g.slot_align_rows,
            "rows_wasted": p.rows_wasted,
            "plane_bytes": p.plane_bytes,
            "plane_offsets": p.plane_offsets,
            "planes_total_bytes": p.planes_total_bytes,
            "indexer_pool_bytes": p.indexer_pool_bytes,
            "indexer_bytes": p.indexer_total_bytes,
            "overhead_bytes": p.overhead_bytes,
            "total_bytes": p.total_bytes,
            "plane_capped": p.plane_capped,
            "image_bytes": self.image_bytes,
            "units_per_checkpoint": self.units_per_checkpoint,
            "layout_id": self.layout_id,
            "kv_bytes_per_token": p.layout.kv.row_format().format().bytes_per_token(),
            "compressed_row_bytes": p.layout.kv.compressed_row_bytes(),
            "capacity_by_format": self.capacity_json(),
            // The spec the pool carries (`Pool::kv_spec`): what every capacity, path and binding
            // default comes from. `null` only if the plan's dtypes cannot be read on its arch
            // (the plan itself would have been refused).
            "kv_spec": p.kv_spec().ok().map(|k| kv_spec_json(&k)),
        })
    }

    /// `capacity_by_format`: every row format the model has a form in, priced by the spec's
    /// tight fit at this plan's budget and slot count ([`Plan::capacity_by_format`]), with the
    /// history tokens each gains over this plan's own format. Empty if it cannot be priced
    /// (a budget below the slot region: the plan itself would have been refused).
    fn capacity_json(&self) -> serde_json::Value {
        let p = &self.plan;
        let bs = p.layout.model.block_size;
        let caps = p.capacity_by_format().unwrap_or_default();
        let here = caps.iter().find(|c| c.format == p.layout.kv.named_format()).map(|c| c.tokens(bs));
        let rows: Vec<serde_json::Value> = caps
            .iter()
            .map(|c| {
                json!({
                    "format": c.format.format().name,
                    "block_row_bytes": c.block_row_bytes,
                    "window_row_bytes": c.window_row_bytes,
                    "tight_fit_blocks": c.tight_fit_blocks,
                    "tokens": c.tokens(bs),
                    "tokens_vs_plan": here.map(|h| c.tokens(bs) - h),
                })
            })
            .collect();
        json!(rows)
    }
}

/// A [`KvSpec`]'s JSON object: the `kv_spec` field of `v4pool plan --json` and what the Python
/// `Pool.kv_spec` / `KvManager.kv_spec` return, one field list for all three. `window`,
/// `index_topk` and `spec_steps` are the defaults every capacity, path and binding takes.
pub fn kv_spec_json(k: &KvSpec) -> serde_json::Value {
    json!({
        "family": match k.family() {
            crate::model::ModelFamily::V4 => "v4",
            crate::model::ModelFamily::V41 => "v4.1",
        },
        "kv_dtype": k.kv().name(),
        "row_format": k.row_format().name,
        "compressed_format": k.compressed_format().map(|f| f.name),
        "packed": k.packed().map(|p| json!({"compressed": p.compressed, "plane": p.plane})),
        "indexer_dtype": k.indexer().name(),
        "window": k.window(),
        "index_topk": k.index_topk(),
        "spec_steps": k.spec_steps(),
        "arch": k.arch().map(|a| a.name()),
    })
}

/// The `dtype` names every entry point lists when it refuses one ([`KvDtype::ALL`]'s names,
/// in order; the CLI's unit test holds them equal).
pub const KV_DTYPE_NAMES: &str = "fp8, bf16, flashmla-v4, flashmla-v4-p2, flashmla-v41 or flashmla-v41-fp4";

crate::variant::variant_names! {
/// What a binding's `plan(...)` call rejects.
#[derive(Debug, Error)]
pub enum PlanOptionError {
    /// An option's value is not of the expected form.
    #[error("option {option}: {value:?} is not {expected}")]
    BadValue {
        /// The option's name.
        option: &'static str,
        /// The value given.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The model's config could not be read.
    #[error("cannot read {path}: {reason}")]
    Io {
        /// The path given.
        path: String,
        /// Why it could not be read.
        reason: String,
    },
    /// The model is refused.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The budget cannot be sized.
    #[error(transparent)]
    Sizing(#[from] SizingError),
    /// The checkpoint layout is refused.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}
}

/// A plan request as the bindings take it: the same options as `v4pool plan`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanOptions {
    /// A preset (`v4-flash`, `v4-pro`, …) or a path to a `config.json` (or its directory).
    pub model: String,
    /// Bytes the pool may use.
    pub budget_bytes: u64,
    /// Concurrent requests (slots) the plan must hold.
    pub max_seqs: i64,
    /// KV dtype (fp8 planes or one bf16 plane); `None`: the model family's and architecture's
    /// default ([`crate::sizing::default_dtypes`]).
    pub kv: Option<KvDtype>,
    /// Indexer cache dtype; `None`: the architecture's default.
    pub indexer: Option<IndexerDtype>,
    /// The AMD architecture the pool is for (`None`: NVIDIA or the host).
    pub arch: Option<GpuArch>,
    /// Speculative (MTP) steps of a preset.
    pub spec_steps: i64,
    /// Slots the plan reserves at least.
    pub min_slots: i64,
    /// Bytes set aside from the budget for other uses.
    pub overhead_bytes: u64,
    /// Draft stages and mode of a `config.json` model (presets name their drafts).
    pub drafts: Option<Drafts>,
}

crate::setters::with_setters!(PlanOptions {
    with_kv(kv: Some(KvDtype)),
    with_indexer(indexer: Some(IndexerDtype)),
    with_arch(arch: Some(GpuArch)),
    with_spec_steps(spec_steps: i64),
    with_min_slots(min_slots: i64),
    with_overhead_bytes(overhead_bytes: u64),
    with_drafts(drafts: Some(Drafts)),
});

impl PlanOptions {
    /// Defaults of `v4pool plan` for everything but the three required values.
    pub fn new(model: &str, budget_bytes: u64, max_seqs: i64) -> PlanOptions {
        PlanOptions {
            model: model.to_string(),
            budget_bytes,
            max_seqs,
            kv: None,
            indexer: None,
            arch: None,
            spec_steps: crate::model::DEFAULT_SPEC_STEPS,
            min_slots: 0,
            overhead_bytes: 0,
            drafts: None,
        }
    }

    /// Parse a `dtype` option value (one of [`KV_DTYPE_NAMES`]).
    pub fn kv_from_name(name: &str) -> Result<KvDtype, PlanOptionError> {
        KvDtype::from_name(name).ok_or_else(|| PlanOptionError::BadValue {
            option: "dtype",
            value: name.into(),
            expected: KV_DTYPE_NAMES,
        })
    }

    /// Parse an `indexer` option value (`fp8`, `fp4`, `bf16`, `atom-fp8` or `atom-fp8-fnuz`).
    pub fn indexer_from_name(name: &str) -> Result<IndexerDtype, PlanOptionError> {
        IndexerDtype::from_name(name).ok_or_else(|| PlanOptionError::BadValue {
            option: "indexer",
            value: name.into(),
            expected: "fp8, fp4, bf16, atom-fp8 or atom-fp8-fnuz",
        })
    }

    /// Parse an `arch` option value (`gfx90a`, `gfx942`, `gfx950` or `gfx1250`).
    pub fn arch_from_name(name: &str) -> Result<GpuArch, PlanOptionError> {
        GpuArch::from_name(name).ok_or_else(|| PlanOptionError::BadValue {
            option: "arch",
            value: name.into(),
            expected: "gfx90a, gfx942, gfx950 or gfx1250",
        })
    }

    /// Parse a `draft_mode` option value (`absent` or `dense`).
    pub fn draft_mode_from_name(name: &str) -> Result<DraftMode, PlanOptionError> {
        match name {
            "absent" => Ok(DraftMode::Absent),
            "dense" => Ok(DraftMode::Dense),
            other => Err(PlanOptionError::BadValue {
                option: "draft_mode",
                value: other.into(),
                expected: "absent or dense",
            }),
        }
    }

    /// The model: a preset by name, else a `config.json` at the path (a directory means its
    /// `config.json`), read through [`ModelShape::from_config_path`]: a FIFO or device is
    /// refused unread, a file past [`crate::model::MAX_CONFIG_BYTES`] refused.
    pub fn model_shape(&self) -> Result<ModelShape, PlanOptionError> {
        match ModelShape::by_name(&self.model, self.spec_steps) {
            Err(ModelError::UnknownPreset { .. }) if std::path::Path::new(&self.model).exists() => {}
            Ok(_) if self.drafts.is_some() => {
                return Err(PlanOptionError::BadValue {
                    option: "draft_stages",
                    value: self.model.clone(),
                    expected: "given with a config.json model (a preset names its drafts)",
                })
            }
            other => return Ok(other?),
        }
        // The one bounded reader every entry point uses (CLI, Python, C): regular files only,
        // opened without blocking, at most `MAX_CONFIG_BYTES`.
        let path = std::path::Path::new(&self.model);
        Ok(ModelShape::from_config_path(path, self.spec_steps, self.drafts)?.shape)
    }

    /// Size the pool and add its checkpoint facts.
    pub fn report(&self) -> Result<PlanReport, PlanOptionError> {
        let model = self.model_shape()?;
        let (kv, indexer) = default_dtypes(model.family, self.arch);
        let req = PlanRequest {
            min_slots: self.min_slots,
            overhead_bytes: self.overhead_bytes,
            arch: self.arch,
            ..PlanRequest::new(
                self.kv.unwrap_or(kv),
                self.indexer.unwrap_or(indexer),
                self.max_seqs,
                self.budget_bytes,
            )
        };
        Ok(PlanReport::new(plan(&model, &req)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::variant::VariantName;

    #[test]
    fn options_size_the_same_plan_as_the_library() {
        let r = PlanOptions::new("v4-flash", 8 << 30, 16).report().unwrap();
        let model = ModelShape::v4_flash(0).unwrap();
        let direct = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 16, 8 << 30)).unwrap();
        assert_eq!(r.plan, direct);
        let j = r.to_json();
        assert_eq!(j["num_slots"], 16);
        assert_eq!(j["plane_rows"], direct.plane_rows);
        assert_eq!(j["layout_id"], layout_id(&direct.layout).unwrap());
    }

    #[test]
    fn bad_options_are_typed() {
        let e = |o: PlanOptions| o.report().unwrap_err().variant_name();
        assert_eq!(e(PlanOptions::new("v4-nope", 8 << 30, 16)), "UnknownPreset");
        assert_eq!(e(PlanOptions::new("v4-flash", 1 << 20, 16)), "BudgetTooSmall");
        assert_eq!(PlanOptions::kv_from_name("fp16").unwrap_err().variant_name(), "BadValue");
        let mut o = PlanOptions::new("v4-flash", 8 << 30, 16);
        o.drafts = Some(Drafts { stages: 1, mode: DraftMode::Dense });
        assert_eq!(e(o), "BadValue");
    }
}
