//! The Python module `v4pool` (feature `python`; built by maturin, see `pyproject.toml`).
//!
//! A thin translation: arguments become library calls, library errors become
//! `V4PoolError` with the Rust variant's name in `.variant`, and memory leaves as DLPack
//! views (`dlpack.rs`) that keep the pool alive. No pool logic lives here.

mod cost;
mod dlpack;
mod events;
mod forward;
mod manager;
mod pool;
mod store;
mod tensor;
mod vllm;

use crate::model::Drafts;
use crate::plan_report::{PlanOptionError, PlanOptions, PlanReport};
use crate::sizing::parse_bytes;
use crate::VariantName;
use pyo3::prelude::*;
use pyo3::types::PyDict;

pyo3::create_exception!(
    v4pool,
    V4PoolError,
    pyo3::exceptions::PyException,
    "A v4pool error: `.variant` is the Rust error's variant name, `.message` its text."
);

/// `V4PoolError(message)` with `.variant` and `.message` set.
pub(crate) fn error(variant: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let err = V4PoolError::new_err(message.clone());
        let value = err.value(py);
        match value.setattr("variant", variant).and_then(|_| value.setattr("message", message)) {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

/// Any library error, named by its innermost variant ([`VariantName`]).
pub(crate) fn lib_err<E: VariantName + std::fmt::Display>(e: E) -> PyErr {
    error(e.variant_name(), e.to_string())
}

fn plan_err(e: PlanOptionError) -> PyErr {
    error(e.variant_name(), e.to_string())
}

/// Bytes from an int or a text like `8GiB`.
fn bytes_arg(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = v.extract::<u64>() {
        return Ok(n);
    }
    let text: String = v.extract()?;
    parse_bytes(&text).map_err(|e| error(e.variant_name(), e.to_string()))
}

/// A sized pool: the fields of `v4pool plan --json` as attributes (and `to_dict()`).
#[pyclass(module = "v4pool", frozen)]
pub struct Plan {
    pub(crate) report: PlanReport,
    fields: Py<PyDict>,
}

/// A new dict of `key => value` pairs (`?` on each insert): the binding's record-shaped returns
/// (counts, capacities, stats) in one form.
macro_rules! py_dict {
    ($py:expr, { $($key:literal => $value:expr),* $(,)? }) => {{
        let d = pyo3::types::PyDict::new($py);
        $(d.set_item($key, $value)?;)*
        d
    }};
}
pub(crate) use py_dict;

/// A JSON value as Python's `json.loads` makes it (dicts, lists, ints, strings, `None`).
pub(crate) fn py_json<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (value.to_string(),))
}

/// A pool's [`crate::sizing::KvSpec`] as a dict: the `kv_spec` field of `v4pool plan --json`
/// (`plan_report::kv_spec_json`, one field list for the CLI, `Plan`, `Pool` and `KvManager`).
pub(crate) fn kv_spec_dict<'py>(
    py: Python<'py>,
    spec: Result<&crate::sizing::KvSpec, impl VariantName + std::fmt::Display>,
) -> PyResult<Bound<'py, PyAny>> {
    py_json(py, &crate::plan_report::kv_spec_json(spec.map_err(lib_err)?))
}

impl Plan {
    fn new(py: Python<'_>, report: PlanReport) -> PyResult<Plan> {
        let fields = py_json(py, &report.to_json())?.cast_into::<PyDict>()?.unbind();
        Ok(Plan { report, fields })
    }
}

#[pymethods]
impl Plan {
    fn __getattr__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        match self.fields.bind(py).get_item(name)? {
            Some(v) => Ok(v.unbind()),
            None => Err(pyo3::exceptions::PyAttributeError::new_err(format!("plan has no field {name:?}"))),
        }
    }

    /// The fields as a new dict (the `--json` object).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.fields.bind(py).copy()
    }

    /// The `--json` text.
    fn to_json(&self) -> String {
        self.report.to_json().to_string()
    }

    fn __dir__(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let mut names: Vec<String> = self.fields.bind(py).keys().extract()?;
        names.extend(["to_dict", "to_json"].map(String::from));
        Ok(names)
    }

    fn __repr__(&self) -> String {
        let p = &self.report.plan;
        format!(
            "Plan(model={:?}, num_blocks={}, num_slots={}, plane_rows={}, total_bytes={})",
            p.layout.model.name, p.num_blocks, p.num_slots, p.plane_rows, p.total_bytes
        )
    }
}

/// Size a pool from a byte budget: `v4pool plan` as a function. `dtype=None` takes the model
/// family's rows (fp8 for V4, `flashmla-v41` for V4.1) and `spec_steps=None` the library's
/// default (0), both as `v4pool plan` does.
#[pyfunction]
#[pyo3(signature = (
    model="v4-flash", budget=None, max_seqs=16, *, dtype=None, indexer=None, spec_steps=None,
    min_slots=0, overhead=None, draft_stages=None, draft_mode="absent", arch=None
))]
#[allow(clippy::too_many_arguments)]
fn plan(
    py: Python<'_>,
    model: &str,
    budget: Option<Bound<'_, PyAny>>,
    max_seqs: i64,
    dtype: Option<&str>,
    indexer: Option<&str>,
    spec_steps: Option<i64>,
    min_slots: i64,
    overhead: Option<Bound<'_, PyAny>>,
    draft_stages: Option<usize>,
    draft_mode: &str,
    arch: Option<&str>,
) -> PyResult<Plan> {
    let budget_bytes = match budget {
        Some(b) => bytes_arg(&b)?,
        None => 8 << 30,
    };
    let mut o = PlanOptions::new(model, budget_bytes, max_seqs);
    // Unnamed dtypes and steps: the library's defaults (`PlanOptions::new`,
    // `sizing::default_dtypes` for the family and `arch`), the CLI's too.
    o.kv = dtype.map(PlanOptions::kv_from_name).transpose().map_err(plan_err)?;
    o.indexer = indexer.map(PlanOptions::indexer_from_name).transpose().map_err(plan_err)?;
    o.arch = arch.map(PlanOptions::arch_from_name).transpose().map_err(plan_err)?;
    if let Some(k) = spec_steps {
        o.spec_steps = k;
    }
    o.min_slots = min_slots;
    o.overhead_bytes = overhead.map(|v| bytes_arg(&v)).transpose()?.unwrap_or(0);
    if let Some(stages) = draft_stages {
        o.drafts =
            Some(Drafts { stages, mode: PlanOptions::draft_mode_from_name(draft_mode).map_err(plan_err)? });
    }
    let report = py.detach(|| o.report()).map_err(plan_err)?;
    Plan::new(py, report)
}

/// Tokens' bf16 KV (`kv`: bytes of `n × 512` native-order bf16 values) packed by the row format
/// `format` (`atom-fp8`, `bf16`, `flashmla-v4`, `flashmla-v4-p2`, `flashmla-v41`, `flashmla-v41-fp4`) into
/// fresh planes of `n` rows rounded up to the kernel's pages: one `bytes` per plane. What the
/// pool's writers write, from the format's one description (`v4pool::format`).
#[pyfunction]
fn pack_rows(py: Python<'_>, format: &str, kv: &[u8]) -> PyResult<Vec<Py<pyo3::types::PyBytes>>> {
    let f = crate::format::RowFormatId::from_name(format).map_err(lib_err)?.format();
    if kv.len() % 2 != 0 {
        return Err(lib_err(crate::format::FormatError::RowLength {
            got: kv.len(),
            want: 2 * crate::index::KV_ROW_VALUES,
        }));
    }
    let values: Vec<u16> = kv.chunks_exact(2).map(|b| u16::from_ne_bytes([b[0], b[1]])).collect();
    let planes = py.detach(|| f.pack_planes(&values)).map_err(lib_err)?;
    Ok(planes.iter().map(|p| pyo3::types::PyBytes::new(py, p).unbind()).collect())
}

#[pymodule]
fn v4pool(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("V4PoolError", m.py().get_type::<V4PoolError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(pack_rows, m)?)?;
    m.add_class::<Plan>()?;
    m.add_class::<dlpack::DeviceView>()?;
    pool::register(m)?;
    manager::register(m)?;
    events::register(m)?;
    forward::register(m)?;
    vllm::register(m)?;
    cost::register(m)?;
    Ok(())
}
