//! `v4pool.KvEventPublisher`: a manager's KV events published for routers in vLLM's
//! ZeroMQ / MessagePack format (`crate::events`); the encoding is a setting (`"array"` for
//! llm-d and Dynamo, `"map"` for vLLM 0.33.0's own classes and Dynamo).

use super::manager::PyKvManager;
use super::{error, lib_err};
use crate::events::{EventEncoding, KvEventPublisher, KvEventsConfig};
use pyo3::prelude::*;
use std::sync::Mutex;

/// A ZeroMQ PUB socket (and optional replay ROUTER socket) sending KV event batches
/// `[topic, seq, msgpack [ts, [events], dp_rank]]` as vLLM's `ZmqEventPublisher` does.
#[pyclass(module = "v4pool", name = "KvEventPublisher", frozen)]
pub struct PyKvEventPublisher {
    inner: Mutex<KvEventPublisher>,
}

#[pymethods]
impl PyKvEventPublisher {
    /// `endpoint`: bound when it has a wildcard (`tcp://*:5557`, `tcp://127.0.0.1:*`) or is
    /// `ipc://` / `inproc://`, connected to otherwise; `replay_endpoint`: a ROUTER socket
    /// answering replay requests; `encoding`: `"array"` or `"map"`.
    #[new]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments, one per option
    #[pyo3(signature = (endpoint, replay_endpoint=None, topic=String::new(), encoding="array", dp_rank=0, block_size=256, buffer_batches=10_000))]
    fn new(
        endpoint: String,
        replay_endpoint: Option<String>,
        topic: String,
        encoding: &str,
        dp_rank: u32,
        block_size: u32,
        buffer_batches: usize,
    ) -> PyResult<PyKvEventPublisher> {
        let encoding = EventEncoding::parse(encoding).ok_or_else(|| {
            error("UnknownEncoding", format!("encoding {encoding:?}: one of \"array\", \"map\""))
        })?;
        let config = KvEventsConfig {
            endpoint,
            replay_endpoint,
            topic,
            encoding,
            dp_rank,
            block_size,
            buffer_batches,
            ..KvEventsConfig::default()
        };
        let p = KvEventPublisher::new(config).map_err(lib_err)?;
        Ok(PyKvEventPublisher { inner: Mutex::new(p) })
    }

    /// The PUB endpoint subscribers connect to (a wildcard port resolved).
    #[getter]
    fn endpoint(&self) -> PyResult<String> {
        Ok(self.lock()?.endpoint().to_string())
    }

    /// The replay endpoint, if any.
    #[getter]
    fn replay_endpoint(&self) -> PyResult<Option<String>> {
        Ok(self.lock()?.replay_endpoint().map(str::to_string))
    }

    /// The next batch's sequence number.
    #[getter]
    fn next_seq(&self) -> PyResult<u64> {
        Ok(self.lock()?.next_seq())
    }

    /// Send the manager's pending events as one batch; its seq, or `None` if there were none.
    fn publish_from(&self, manager: &PyKvManager) -> PyResult<Option<u64>> {
        let mut m = manager.lock()?;
        self.lock()?.publish_from(&mut m).map_err(lib_err)
    }

    /// Send an `AllBlocksCleared` batch (the engine reset its cache); its seq.
    fn publish_cleared(&self) -> PyResult<Option<u64>> {
        self.lock()?.publish(&[crate::manager::KvEvent::AllCleared]).map_err(lib_err)
    }
}

impl PyKvEventPublisher {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, KvEventPublisher>> {
        self.inner.lock().map_err(|_| error("Poisoned", "publisher lock poisoned".into()))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvEventPublisher>()
}
