//! `v4pool.StepCost`: the calibrated step-cost model (`sim::cost`) for benches that drive an
//! engine's own scheduler from Python (`benches/vllm_trace.py`), so their TTFT and throughput
//! come from the same fitted coefficients `v4pool simulate` and `v4pool calibrate` use. A
//! translation only: the formula is `StepCost::step_ms`'s.

use super::lib_err;
use crate::sim::cost::{preset, StepCost, StepLoad};
use pyo3::prelude::*;

/// One deployment's step-cost coefficients (see `v4pool calibrate`).
#[pyclass(module = "v4pool", name = "StepCost", frozen)]
pub struct PyStepCost {
    inner: StepCost,
}

#[pymethods]
impl PyStepCost {
    /// The preset `name` (`h200x4-flash-fp8`, `b200x4-flash-fp4`, `h200x8-pro-fp4`, or
    /// `h200x4-flash-fp8-low-latency`), fitted on the spot as `v4pool calibrate` fits it.
    #[staticmethod]
    fn preset(name: &str) -> PyResult<PyStepCost> {
        Ok(PyStepCost { inner: preset(name).map_err(lib_err)? })
    }

    /// Coefficients from the JSON object `v4pool calibrate --json` writes (or `to_json`).
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<PyStepCost> {
        Ok(PyStepCost { inner: StepCost::from_json(text).map_err(lib_err)? })
    }

    /// Milliseconds of one step that prefills `prefill_tokens` tokens (whose attention sees
    /// `prefill_ctx_tokens` earlier tokens in all), decodes `decode_seqs` sequences of
    /// `decode_ctx_tokens` context tokens in all, and brings `restored_bytes` back from a
    /// host or shared tier.
    #[pyo3(signature = (prefill_tokens=0, prefill_ctx_tokens=0.0, decode_seqs=0, decode_ctx_tokens=0, restored_bytes=0))]
    fn step_ms(
        &self,
        prefill_tokens: u64,
        prefill_ctx_tokens: f64,
        decode_seqs: u64,
        decode_ctx_tokens: u64,
        restored_bytes: u64,
    ) -> f64 {
        self.inner.step_ms(&StepLoad {
            prefill_tokens,
            prefill_ctx_tokens,
            decode_seqs,
            decode_ctx_tokens,
            restored_bytes,
        })
    }

    /// The preset or file name.
    #[getter]
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    /// GPUs of the deployment (throughput per GPU divides by it).
    #[getter]
    fn gpus(&self) -> u32 {
        self.inner.gpus
    }

    /// The coefficients as the JSON text `from_json` reads.
    fn to_json(&self) -> String {
        self.inner.to_json().to_string()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStepCost>()
}
