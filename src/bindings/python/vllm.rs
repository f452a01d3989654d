//! What `v4pool.vllm` (the vLLM KV connector, `python/v4pool/vllm.py`) needs from the library:
//! v4pool's chained block hashes (`manager::hash`) and an [`EntryDir`] tier that copies
//! whole entries out of and into CPU `uint8` tensors taken through DLPack (the bytes are read
//! and written only through the slices `tensor.rs` proves from torch's own description, with
//! the GIL held). A translation only: the tier's rules live in `transfer::entry_dir`.

use super::tensor::{tensor, Tensor};
use super::{error, lib_err};
use crate::manager::hash::{block_hash, chain_hashes, BlockHash, Namespace};
use crate::transfer::entry_dir::{EntryDir, Lookup};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::Mutex;

/// DLPack's unsigned-integer type code.
const DL_UINT: u8 = 1;

/// The namespace of a label (`Namespace::from_label`): the model, the layout, an adapter.
#[pyfunction]
fn namespace_of(label: &str) -> u128 {
    Namespace::from_label(label).0
}

/// The chained hashes of every full `block`-token block of `tokens` in namespace `ns`
/// (from `namespace_of`), after `parent`.
#[pyfunction]
#[pyo3(signature = (ns, tokens, block, parent=None))]
fn chain_block_hashes(
    py: Python<'_>,
    ns: u128,
    tokens: Vec<u32>,
    block: usize,
    parent: Option<u128>,
) -> PyResult<Vec<u128>> {
    if block == 0 {
        return Err(error("BadBlock", "block of 0 tokens".into()));
    }
    Ok(py.detach(|| {
        chain_hashes(Namespace(ns), parent.map(BlockHash), &tokens, block).into_iter().map(|h| h.0).collect()
    }))
}

/// The hash of `tokens` (any count, a partial tail included) after `parent` in `ns`.
#[pyfunction]
#[pyo3(signature = (ns, tokens, parent=None))]
fn tail_hash(ns: u128, tokens: Vec<u32>, parent: Option<u128>) -> u128 {
    block_hash(Namespace(ns), parent.map(BlockHash), &tokens).0
}

fn kind_of(kind: &str) -> PyResult<char> {
    let mut c = kind.chars();
    match (c.next(), c.next()) {
        (Some(k), None) => Ok(k),
        _ => Err(error("BadKind", format!("entry kind {kind:?} is not one letter"))),
    }
}

/// A C-contiguous CPU `uint8` tensor of any shape, through torch's DLPack export, and its
/// length in bytes (its device is checked when its bytes are taken: `host_slice`).
fn cpu_u8<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(Tensor<'py>, usize)> {
    let t = tensor(obj, name)?;
    let len = t.contiguous(name, DL_UINT, 8, &t.shape.clone())?;
    let len = usize::try_from(len).map_err(|_| error("BadTensor", format!("{name}: too large")))?;
    Ok((t, len))
}

/// `EntryTier(root, layout, budget_bytes, sync=False, evict_first="")`: whole checksummed entries keyed by a
/// kind letter and a 128-bit hash, in `root/v4pool-entries-1/<layout digest>/`. `put` stores
/// the concatenation of CPU `uint8` tensors; `get_into` fills one such tensor only when the
/// entry is whole, of this layout and of exactly the tensor's length (else `False`: a miss).
/// `evict_first`: kind letters whose entries a full tier removes first (`EntryDir::open_ordered`).
#[pyclass(module = "v4pool", name = "EntryTier")]
pub struct PyEntryTier {
    inner: Mutex<EntryDir>,
    root: PathBuf,
}

#[pymethods]
impl PyEntryTier {
    #[new]
    #[pyo3(signature = (root, layout, budget_bytes, sync=false, evict_first=""))]
    fn new(root: PathBuf, layout: &str, budget_bytes: u64, sync: bool, evict_first: &str) -> PyResult<Self> {
        let inner =
            EntryDir::open_ordered(&root, layout, budget_bytes, sync, evict_first).map_err(lib_err)?;
        Ok(PyEntryTier { inner: Mutex::new(inner), root })
    }

    /// Whether an entry file exists (a read may still miss).
    fn contains(&self, kind: &str, hash: u128) -> PyResult<bool> {
        let k = kind_of(kind)?;
        Ok(self.lock()?.contains(k, hash))
    }

    /// The body length the entry's checked header claims (never more than the budget), or
    /// None (a refused entry is removed).
    fn size(&self, kind: &str, hash: u128) -> PyResult<Option<u64>> {
        let k = kind_of(kind)?;
        Ok(self.lock()?.body_len(k, hash))
    }

    /// Publish the concatenation of `parts` (C-contiguous CPU uint8 tensors) under the key.
    fn put(&self, kind: &str, hash: u128, parts: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let k = kind_of(kind)?;
        let mut descs = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let name = format!("parts[{i}]");
            let (t, len) = cpu_u8(p, &name)?;
            descs.push((t, len, name));
        }
        let mut slices: Vec<&[u8]> = Vec::with_capacity(descs.len());
        for (t, len, name) in &descs {
            // SAFETY: u8 elements of a contiguous tensor of `len` bytes (checked by `cpu_u8`);
            // the slices live only inside this call, while `descs` keeps torch's exports alive,
            // and the GIL stays held, so no other Python thread can resize or free them.
            slices.push(unsafe { t.host_slice::<u8>(name, 1, *len, *len)? });
        }
        // The GIL is kept: released, another thread could free or resize a part under the read.
        self.lock().and_then(|mut d| d.put(k, hash, &slices).map_err(lib_err))
    }

    /// Fill `dst` (a C-contiguous CPU uint8 tensor) with the entry's whole body; `False` on a
    /// miss (absent, corrupt, truncated, foreign, another length), when `dst` must be ignored.
    fn get_into(&self, kind: &str, hash: u128, dst: Bound<'_, PyAny>) -> PyResult<bool> {
        let k = kind_of(kind)?;
        let (t, len) = cpu_u8(&dst, "dst")?;
        // SAFETY: u8 elements of a contiguous tensor of `len` bytes (checked by `cpu_u8`); the
        // slice lives only inside this call while `t` keeps torch's export alive, nothing else
        // in this call reads or writes them, and the GIL stays held, so no other Python thread
        // can resize, free or touch the tensor under the write.
        let out = unsafe { t.host_slice_mut::<u8>("dst", 1, len, len)? };
        // The GIL is kept, as in `put`.
        self.lock().map(|mut d| d.get_into(k, hash, out) == Lookup::Hit)
    }

    /// Mark the entries of `keys` (`(kind, hash)` pairs) used now, in that order (the last the
    /// most recently used); how many were there (`EntryDir::refresh`).
    fn refresh(&self, keys: Vec<(String, u128)>) -> PyResult<usize> {
        let keys = keys.iter().map(|(k, h)| Ok((kind_of(k)?, *h))).collect::<PyResult<Vec<_>>>()?;
        Ok(self.lock()?.refresh(&keys))
    }

    /// `(scan_after, low)` of a tier of `budget_bytes` (`EntryDir::sweep_rule`): a writer scans
    /// after `scan_after` bytes or when over budget; an over-budget scan evicts down to `low`.
    #[staticmethod]
    fn sweep_rule(budget_bytes: u64) -> (u64, u64) {
        EntryDir::sweep_rule(budget_bytes)
    }

    /// Remove an entry; whether one was there.
    fn remove(&self, kind: &str, hash: u128) -> PyResult<bool> {
        let k = kind_of(kind)?;
        Ok(self.lock()?.remove(k, hash))
    }

    /// The counters (this process) and the directory's estimated bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.lock()?;
        let s = inner.stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("puts", s.puts),
            ("put_bytes", s.put_bytes),
            ("hits", s.hits),
            ("absent", s.absent),
            ("corrupt", s.corrupt),
            ("foreign", s.foreign),
            ("evicted", s.evicted),
            ("put_errors", s.put_errors),
            ("used_bytes", inner.used_bytes()),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The folder this layout's entries live in.
    fn layout_dir(&self) -> PyResult<PathBuf> {
        Ok(self.lock()?.layout_dir().to_path_buf())
    }

    fn __repr__(&self) -> String {
        format!("EntryTier({:?})", self.root)
    }
}

impl PyEntryTier {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, EntryDir>> {
        self.inner.lock().map_err(|_| error("Poisoned", "the tier's lock was poisoned".into()))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(namespace_of, m)?)?;
    m.add_function(wrap_pyfunction!(chain_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(tail_hash, m)?)?;
    m.add_class::<PyEntryTier>()?;
    Ok(())
}
