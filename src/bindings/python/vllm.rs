//! What `v4pool.vllm` (the vLLM KV connector, `python/v4pool/vllm.py`) needs from the library:
//! v4pool's chained block hashes (`manager::hash`) and an entry tier — files ([`EntryDir`],
//! their bytes through `std::fs` or NIXL POSIX) or a key-value store ([`EntryStore`] over a
//! Python store object, `v4pool.mooncake.MooncakeStore`) — that copies whole entries out of
//! and into CPU `uint8` tensors taken through DLPack (the bytes are read and written only
//! through the slices `tensor.rs` proves from torch's own description, with the GIL held and
//! no Python code running meanwhile). A translation only: the tiers' rules live in
//! `transfer::entry_dir` and `transfer::entry_store`.

use super::tensor::{tensor, Tensor};
use super::{error, lib_err};
use crate::manager::hash::{block_hash, chain_hashes, BlockHash, Namespace};
use crate::transfer::entry_dir::{EntryDir, EntryDirError, EntryDirStats, Lookup};
use crate::transfer::entry_store::EntryStore;
use crate::transfer::{NixlPosix, StdFs, TierIo};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex, MutexGuard};

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

/// The tier behind an `EntryTier`.
enum Entries {
    /// Files.
    Dir(EntryDir),
    /// A key-value store (its calls are Python calls: `PyStore`).
    Store(EntryStore),
}

/// The I/O a file tier's bytes go through, by the name `EntryTier(io=...)` takes.
fn tier_io(name: &str) -> PyResult<Box<dyn TierIo>> {
    match name {
        "std-fs" => Ok(Box::new(StdFs)),
        "nixl-posix" => Ok(Box::new(NixlPosix::from_env().map_err(lib_err)?)),
        other => Err(error("BadIo", format!("io {other:?}: \"std-fs\" or \"nixl-posix\""))),
    }
}

/// One caller at a time in a tier, waited for without the GIL: a store tier's calls run
/// Python code (the adapter waits on its worker thread, releasing the GIL), so a thread
/// that waited for the tier holding the GIL would stop the very call it waits for.
#[derive(Default)]
struct Gate {
    busy: Mutex<bool>,
    free: Condvar,
}

/// A caller's turn in a [`Gate`] (given back on drop).
struct Turn<'a>(&'a Gate);

impl Gate {
    fn enter(&self, py: Python<'_>) -> PyResult<Turn<'_>> {
        let poisoned = || error("Poisoned", "the tier's lock was poisoned".into());
        py.detach(|| {
            let mut busy = self.busy.lock().map_err(|_| ())?;
            while *busy {
                busy = self.free.wait(busy).map_err(|_| ())?;
            }
            *busy = true;
            Ok::<(), ()>(())
        })
        .map_err(|()| poisoned())?;
        Ok(Turn(self))
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Ok(mut b) = self.0.busy.lock() {
            *b = false;
        }
        self.0.free.notify_one();
    }
}

/// `EntryTier(root, layout, budget_bytes, sync=False, evict_first="", io="std-fs")`: whole
/// checksummed entries keyed by a kind letter and a 128-bit hash, in
/// `root/v4pool-entries-1/<layout digest>/`, their bytes moved by `io` (`"std-fs"`, or
/// `"nixl-posix"`: NIXL's POSIX plugin, `$V4POOL_NIXL_LIB`, docs/nixl.md); or
/// `EntryTier.in_store(store, layout, capacity_bytes)`: the same entries in a key-value
/// store. `put` stores the concatenation of CPU `uint8` tensors; `get_into` fills one such
/// tensor only when the entry is whole, of this layout and of exactly the tensor's length
/// (else `False`: a miss). `evict_first`: kind letters whose entries a full tier removes first
/// (`EntryDir::open_ordered`).
#[pyclass(module = "v4pool", name = "EntryTier")]
pub struct PyEntryTier {
    gate: Gate,
    inner: Mutex<Entries>,
    label: String,
}

#[pymethods]
impl PyEntryTier {
    #[new]
    #[pyo3(signature = (root, layout, budget_bytes, sync=false, evict_first="", io="std-fs"))]
    fn new(
        root: PathBuf,
        layout: &str,
        budget_bytes: u64,
        sync: bool,
        evict_first: &str,
        io: &str,
    ) -> PyResult<Self> {
        let inner = EntryDir::open_with_io(&root, layout, budget_bytes, sync, evict_first, tier_io(io)?)
            .map_err(lib_err)?;
        Ok(PyEntryTier::of(Entries::Dir(inner), format!("{root:?}, io={io:?}")))
    }

    /// The tier in a key-value store: `store` implements the protocol of
    /// `KvManager.set_shared_store` (`v4pool.mooncake.MooncakeStore`); an entry (header,
    /// layout text, body) is at most `capacity_bytes`. A store error is a miss (`get_into`
    /// `False`, `contains` `False`) or a failed `put`, never a partial read.
    #[staticmethod]
    fn in_store(store: Py<PyAny>, layout: &str, capacity_bytes: u64) -> PyResult<Self> {
        let s = Box::new(super::store::PyStore::new(store));
        let inner = EntryStore::new(s, layout, capacity_bytes).map_err(lib_err)?;
        Ok(PyEntryTier::of(Entries::Store(inner), "store".into()))
    }

    /// Whether an entry exists (a read may still miss).
    fn contains(&self, py: Python<'_>, kind: &str, hash: u128) -> PyResult<bool> {
        let k = kind_of(kind)?;
        self.with(py, |e| match e {
            Entries::Dir(d) => d.contains(k, hash),
            Entries::Store(s) => s.contains(k, hash),
        })
    }

    /// The body length the entry's checked header claims (never more than the budget), or
    /// None (a refused entry is removed). A store tier's is its value's size less the header
    /// (checked when read).
    fn size(&self, py: Python<'_>, kind: &str, hash: u128) -> PyResult<Option<u64>> {
        let k = kind_of(kind)?;
        self.with(py, |e| match e {
            Entries::Dir(d) => d.body_len(k, hash),
            Entries::Store(s) => s.body_len(k, hash),
        })
    }

    /// Publish the concatenation of `parts` (C-contiguous CPU uint8 tensors) under the key.
    fn put(&self, py: Python<'_>, kind: &str, hash: u128, parts: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let k = kind_of(kind)?;
        let mut descs = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let name = format!("parts[{i}]");
            let (t, len) = cpu_u8(p, &name)?;
            descs.push((t, len, name));
        }
        self.with(py, |e| match e {
            // No Python code runs in a file tier's put: the GIL is kept throughout.
            // SAFETY: as `part_slices` asks.
            Entries::Dir(d) => d.put(k, hash, &unsafe { part_slices(&descs) }?).map_err(lib_err),
            // The store is called before and after `fill`, never during it.
            Entries::Store(s) => {
                let body_len = descs.iter().map(|d| d.1 as u64).sum();
                s.put_with(k, hash, body_len, |body| {
                    let mut at = 0;
                    // SAFETY: as `part_slices` asks: no Python code runs inside `fill`.
                    for p in unsafe { part_slices(&descs) }? {
                        body[at..at + p.len()].copy_from_slice(p);
                        at += p.len();
                    }
                    Ok::<(), StoreErr>(())
                })
                .map_err(|e| e.0)
            }
        })?
    }

    /// Fill `dst` (a C-contiguous CPU uint8 tensor) with the entry's whole body; `False` on a
    /// miss (absent, corrupt, truncated, foreign, another length, a store that does not
    /// answer), when `dst` must be ignored.
    fn get_into(&self, py: Python<'_>, kind: &str, hash: u128, dst: Bound<'_, PyAny>) -> PyResult<bool> {
        let k = kind_of(kind)?;
        let (t, len) = cpu_u8(&dst, "dst")?;
        // SAFETY (both arms): u8 elements of a contiguous tensor of `len` bytes (checked by
        // `cpu_u8`); the slice lives only inside this call while `t` keeps torch's export
        // alive, nothing else in this call reads or writes them, the GIL is held and no Python
        // code runs while it lives, so no other Python thread can resize, free or touch the
        // tensor under the write.
        let out = || unsafe { t.host_slice_mut::<u8>("dst", 1, len, len) };
        self.with(py, |e| match e {
            Entries::Dir(d) => Ok(d.get_into(k, hash, out()?) == Lookup::Hit),
            // The body is copied once the store's calls are over.
            Entries::Store(s) => {
                s.get_with(k, hash, len, |b| out().map(|o| o.copy_from_slice(b))).map(|r| r == Lookup::Hit)
            }
        })?
    }

    /// Mark the entries of `keys` (`(kind, hash)` pairs) used now, in that order (the last the
    /// most recently used); how many were there (`EntryDir::refresh`). A store tier marks
    /// nothing and answers 0: the store (Mooncake's) keeps its own eviction order.
    fn refresh(&self, py: Python<'_>, keys: Vec<(String, u128)>) -> PyResult<usize> {
        let keys = keys.iter().map(|(k, h)| Ok((kind_of(k)?, *h))).collect::<PyResult<Vec<_>>>()?;
        self.with(py, |e| match e {
            Entries::Dir(d) => d.refresh(&keys),
            Entries::Store(_) => 0,
        })
    }

    /// `(scan_after, low)` of a tier of `budget_bytes` (`EntryDir::sweep_rule`): a writer scans
    /// after `scan_after` bytes or when over budget; an over-budget scan evicts down to `low`.
    #[staticmethod]
    fn sweep_rule(budget_bytes: u64) -> (u64, u64) {
        EntryDir::sweep_rule(budget_bytes)
    }

    /// Remove an entry; whether one was there.
    fn remove(&self, py: Python<'_>, kind: &str, hash: u128) -> PyResult<bool> {
        let k = kind_of(kind)?;
        self.with(py, |e| match e {
            Entries::Dir(d) => d.remove(k, hash),
            Entries::Store(s) => s.remove(k, hash),
        })
    }

    /// The counters (this process) and the directory's estimated bytes (0 for a store tier:
    /// the store keeps its own account). `io_errors`: store calls that failed.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, used): (EntryDirStats, u64) = self.with(py, |e| match e {
            Entries::Dir(d) => (d.stats(), d.used_bytes()),
            Entries::Store(s) => (s.stats(), 0),
        })?;
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
            ("io_errors", s.io_errors),
            ("used_bytes", used),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The folder this layout's entries live in (None for a store tier).
    fn layout_dir(&self, py: Python<'_>) -> PyResult<Option<PathBuf>> {
        self.with(py, |e| match e {
            Entries::Dir(d) => Some(d.layout_dir().to_path_buf()),
            Entries::Store(_) => None,
        })
    }

    /// The store key of an entry (None for a file tier: `layout_dir`).
    fn store_key(&self, py: Python<'_>, kind: &str, hash: u128) -> PyResult<Option<String>> {
        let k = kind_of(kind)?;
        self.with(py, |e| match e {
            Entries::Dir(_) => None,
            Entries::Store(s) => Some(s.key_of(k, hash)),
        })
    }

    fn __repr__(&self) -> String {
        format!("EntryTier({})", self.label)
    }
}

/// The bytes of `put`'s parts (checked by `cpu_u8`).
///
/// # Safety
/// The slices must be dropped before any Python code runs (and the GIL held meanwhile):
/// `descs` keeps torch's exports alive, and with the GIL held and no Python code running no
/// other Python thread can resize or free the tensors under the read.
unsafe fn part_slices<'a>(descs: &'a [(Tensor<'_>, usize, String)]) -> PyResult<Vec<&'a [u8]>> {
    let mut slices: Vec<&[u8]> = Vec::with_capacity(descs.len());
    for (t, len, name) in descs {
        // SAFETY: u8 elements of a contiguous tensor of `len` bytes (`cpu_u8`); the caller's
        // promise for the rest.
        slices.push(unsafe { t.host_slice::<u8>(name, 1, *len, *len)? });
    }
    Ok(slices)
}

/// A Python error out of a store tier's `fill`, or the tier's own.
struct StoreErr(PyErr);

impl From<PyErr> for StoreErr {
    fn from(e: PyErr) -> StoreErr {
        StoreErr(e)
    }
}

impl From<EntryDirError> for StoreErr {
    fn from(e: EntryDirError) -> StoreErr {
        StoreErr(lib_err(e))
    }
}

impl PyEntryTier {
    fn of(inner: Entries, label: String) -> PyEntryTier {
        PyEntryTier { gate: Gate::default(), inner: Mutex::new(inner), label }
    }

    /// `f` on the tier, in this caller's turn (waited for without the GIL: [`Gate`]).
    fn with<T>(&self, py: Python<'_>, f: impl FnOnce(&mut Entries) -> T) -> PyResult<T> {
        let _turn = self.gate.enter(py)?;
        // Uncontended: the turn is this caller's.
        let mut g: MutexGuard<'_, Entries> =
            self.inner.lock().map_err(|_| error("Poisoned", "the tier's lock was poisoned".into()))?;
        Ok(f(&mut g))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(namespace_of, m)?)?;
    m.add_function(wrap_pyfunction!(chain_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(tail_hash, m)?)?;
    m.add_class::<PyEntryTier>()?;
    Ok(())
}
