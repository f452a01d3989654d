//! `v4pool.KvManager`: the request-level manager over a `v4pool.Pool`. Request ids travel
//! as integers ([`RequestId::to_bits`]); prompts as token lists whose chained block hashes
//! are computed here in Rust (the manager's namespace, the pool's block size). Every other
//! argument passes straight through to [`KvManager`].

use super::pool::{Block, Hold, PyPool, Slot};
use super::{error, lib_err};
use crate::checkpoint::{CheckpointImage, LayoutId};
use crate::manager::{
    chain_hashes, BlockHash, ElasticPolicy, FixedPolicy, KvEvent, KvManager, ManagerConfig, ManagerError,
    Namespace, RequestId, SplitPolicy, StoredCheckpoint,
};
use crate::transfer::{handoff, Endpoint, LocalEngine, SharedTierConfig, StoreTier};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

fn poisoned() -> PyErr {
    error("Poisoned", "manager lock poisoned".into())
}

fn reentrant() -> PyErr {
    error(
        "Reentrant",
        "KvManager called from inside one of its own calls (a shared store's callback): \
         refused, the manager is mid-call"
            .into(),
    )
}

thread_local! {
    /// The managers whose lock this thread holds (their addresses). A shared store's Python
    /// callback runs on the thread that holds its manager's lock: a call back into that
    /// manager from there is refused ([`reentrant`]) instead of waiting for itself forever.
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The manager, locked by this thread (and listed in [`HELD`] until dropped).
pub(super) struct Held<'a> {
    guard: MutexGuard<'a, KvManager>,
    key: usize,
}

impl std::ops::Deref for Held<'_> {
    type Target = KvManager;
    fn deref(&self) -> &KvManager {
        &self.guard
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut KvManager {
        &mut self.guard
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|&k| k == self.key) {
                h.swap_remove(i);
            }
        });
    }
}

/// The request-level KV manager (prefix reuse with checkpoints, the elastic boundary) over
/// a pool that holds no blocks or slots yet. Methods mirror the Rust `KvManager`.
#[pyclass(module = "v4pool", name = "KvManager", frozen)]
pub struct PyKvManager {
    // Field order is drop order: the manager (and its pool reference) before the hold that
    // keeps the pool's memory.
    inner: Mutex<KvManager>,
    namespace: Namespace,
    _hold: Arc<Hold>,
}

impl PyKvManager {
    fn key(&self) -> usize {
        std::ptr::from_ref(&self.inner) as usize
    }

    /// Whether this thread is inside a call of this manager.
    fn entered(&self) -> bool {
        HELD.with(|h| h.borrow().contains(&self.key()))
    }

    fn hold<'a>(&self, guard: MutexGuard<'a, KvManager>) -> Held<'a> {
        HELD.with(|h| h.borrow_mut().push(self.key()));
        Held { guard, key: self.key() }
    }

    /// The manager, locked; refused from inside one of its own calls. While another thread
    /// holds it, this one waits with the GIL released: that thread may be in a store's
    /// Python callback, which needs the GIL to finish.
    pub(super) fn lock(&self) -> PyResult<Held<'_>> {
        if self.entered() {
            return Err(reentrant());
        }
        Python::attach(|py| loop {
            match self.inner.try_lock() {
                Ok(guard) => return Ok(self.hold(guard)),
                Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
                // Wait for it to be free, then try again with the GIL.
                Err(TryLockError::WouldBlock) => py.detach(|| drop(self.inner.lock())),
            }
        })
    }

    /// `f` on the manager with the GIL released (a call may launch and wait on copies, or
    /// call a shared store, which takes the GIL itself); refused from inside one of its own
    /// calls.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut KvManager) -> Result<T, ManagerError> + Send,
    ) -> PyResult<T> {
        if self.entered() {
            return Err(reentrant());
        }
        py.detach(|| self.inner.lock().map(|guard| f(&mut self.hold(guard))).map_err(|_| ()))
            .map_err(|()| poisoned())?
            .map_err(lib_err)
    }

    fn hashes(&self, m: &KvManager, tokens: &[u32], parent: Option<u128>) -> Vec<BlockHash> {
        chain_hashes(self.namespace, parent.map(BlockHash), tokens, m.block_size() as usize)
    }
}

#[pymethods]
impl PyKvManager {
    /// `policy`: `"elastic"` (the boundary follows demand; `slots` caps the slot count) or
    /// `"fixed"` (`slots` slots carved once; default the plan's `num_slots`). `namespace`
    /// keeps blocks of different models or adapters from matching. `host_tier_bytes`: host
    /// memory (page-locked on CUDA) evicted blocks and checkpoints spill to; 0: none.
    /// `shared_tier_dir`: a directory every engine mounts, the fleet's shared tier (committed
    /// blocks and checkpoints published there, hits restored from it), holding at most
    /// `shared_tier_bytes`; `events`: record KV events (`drain_events`, `KvEventPublisher`).
    #[new]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments, one per option
    #[pyo3(signature = (
        pool, policy="elastic", checkpoint_every=16, rolling=true, slots=None, namespace="", host_tier_bytes=0,
        shared_tier_dir=None, shared_tier_bytes=1 << 40, events=false
    ))]
    fn new(
        py: Python<'_>,
        pool: &Bound<'_, PyPool>,
        policy: &str,
        checkpoint_every: u32,
        rolling: bool,
        slots: Option<u32>,
        namespace: &str,
        host_tier_bytes: u64,
        shared_tier_dir: Option<std::path::PathBuf>,
        shared_tier_bytes: u64,
        events: bool,
    ) -> PyResult<PyKvManager> {
        let (pool, hold) = pool.get().shared();
        let policy: Box<dyn SplitPolicy> = match policy {
            "elastic" => {
                let d = ElasticPolicy::default();
                Box::new(ElasticPolicy { max_slots: slots.unwrap_or(d.max_slots), ..d })
            }
            // A fresh pool still has the plan's split.
            "fixed" => Box::new(FixedPolicy {
                slots: match slots {
                    Some(n) => n,
                    None => pool.counts().map_err(lib_err)?.num_slots,
                },
            }),
            other => {
                return Err(error(
                    "UnknownPolicy",
                    format!("policy {other:?}: one of \"elastic\", \"fixed\""),
                ))
            }
        };
        let shared_tier =
            shared_tier_dir.map(|dir| SharedTierConfig { dir, budget_bytes: shared_tier_bytes, sync: true });
        let config = ManagerConfig { checkpoint_every, rolling, host_tier_bytes, shared_tier };
        let mut m = py.detach(|| KvManager::new(pool, config, policy)).map_err(lib_err)?;
        m.enable_events(events);
        Ok(PyKvManager { inner: Mutex::new(m), namespace: Namespace::from_label(namespace), _hold: hold })
    }

    /// Tokens per block: hits are multiples of it.
    #[getter]
    fn block_size(&self) -> PyResult<u64> {
        Ok(self.lock()?.block_size())
    }

    /// What the pool's rows are (`KvManager::kv_spec`), the dict `Pool.kv_spec` gives.
    #[getter]
    fn kv_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        super::kv_spec_dict(py, self.lock()?.kv_spec())
    }

    /// `"elastic"` or `"fixed"`.
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.policy_name())
    }

    /// The chained hashes (128-bit ints) of every full block of `tokens`, in this manager's
    /// namespace, chained from `parent` (the hash of the block before them).
    #[pyo3(signature = (tokens, parent=None))]
    fn block_hashes(&self, tokens: Vec<u32>, parent: Option<u128>) -> PyResult<Vec<u128>> {
        let m = self.lock()?;
        Ok(self.hashes(&m, &tokens, parent).into_iter().map(|h| h.0).collect())
    }

    /// A new waiting request with prompt `tokens`; returns its id. With events on, the
    /// tokens go into the `BlockStored` events of its blocks.
    fn add_request(&self, tokens: Vec<u32>) -> PyResult<u64> {
        let mut m = self.lock()?;
        let hashes = self.hashes(&m, &tokens, None);
        let id = m.add_request(tokens.len() as u64, hashes);
        m.record_tokens(id, &tokens).map_err(lib_err)?;
        Ok(id.to_bits())
    }

    /// More tokens of a request (what it generated) for its blocks' events.
    fn record_tokens(&self, id: u64, tokens: Vec<u32>) -> PyResult<()> {
        self.lock()?.record_tokens(RequestId::from_bits(id), &tokens).map_err(lib_err)
    }

    /// Turn KV events on or off (off drops what is pending).
    fn enable_events(&self, on: bool) -> PyResult<()> {
        self.lock()?.enable_events(on);
        Ok(())
    }

    /// The KV events recorded since the last call: dicts with `type` (`BlockStored`,
    /// `BlockRemoved`, `AllBlocksCleared`), `block_hashes` (128-bit ints), `parent_block_hash`,
    /// `token_ids`, `medium` (`GPU`, `CPU`, `STORAGE`).
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let events = self.lock()?.drain_events();
        events
            .into_iter()
            .map(|e| {
                let d = PyDict::new(py);
                let hashes = |hs: Vec<BlockHash>| hs.into_iter().map(|h| h.0).collect::<Vec<u128>>();
                match e {
                    KvEvent::Stored { hashes: hs, parent, tokens, medium } => {
                        d.set_item("type", "BlockStored")?;
                        d.set_item("block_hashes", hashes(hs))?;
                        d.set_item("parent_block_hash", parent.map(|p| p.0))?;
                        d.set_item("token_ids", tokens)?;
                        d.set_item("medium", medium.name())?;
                    }
                    KvEvent::Removed { hashes: hs, medium } => {
                        d.set_item("type", "BlockRemoved")?;
                        d.set_item("block_hashes", hashes(hs))?;
                        d.set_item("medium", medium.name())?;
                    }
                    KvEvent::AllCleared => d.set_item("type", "AllBlocksCleared")?,
                }
                Ok(d)
            })
            .collect()
    }

    /// More full-block hashes of a request (from `block_hashes`, chained from its last).
    fn extend_hashes(&self, id: u64, hashes: Vec<u128>) -> PyResult<()> {
        let hashes: Vec<BlockHash> = hashes.into_iter().map(BlockHash).collect();
        self.lock()?.extend_hashes(RequestId::from_bits(id), &hashes).map_err(lib_err)
    }

    /// Tokens of `tokens` the cache would serve now (no side effects).
    fn match_prefix(&self, tokens: Vec<u32>) -> PyResult<u64> {
        let m = self.lock()?;
        Ok(m.match_prefix(&self.hashes(&m, &tokens, None)))
    }

    /// Admit a waiting request (take a slot, restore the hit); returns the hit tokens.
    fn admit(&self, py: Python<'_>, id: u64) -> PyResult<u64> {
        Ok(self.run(py, |m| m.admit(RequestId::from_bits(id)))?.hit_tokens)
    }

    /// How many of `budget` prefill tokens the request's next chunk takes (0: it decodes).
    fn prefill_stop(&self, id: u64, budget: u64) -> PyResult<u64> {
        self.lock()?.prefill_stop(RequestId::from_bits(id), budget).map_err(lib_err)
    }

    /// Blocks for `tokens` more tokens of a running request.
    fn allocate(&self, py: Python<'_>, id: u64, tokens: u64) -> PyResult<()> {
        self.run(py, |m| m.allocate(RequestId::from_bits(id), tokens))
    }

    /// `tokens` more tokens of a running request are in the pool.
    fn commit(&self, py: Python<'_>, id: u64, tokens: u64) -> PyResult<()> {
        self.run(py, |m| m.commit(RequestId::from_bits(id), tokens))
    }

    /// Free a running request's slot; its committed blocks stay cached.
    fn preempt(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        self.run(py, |m| m.preempt(RequestId::from_bits(id)))
    }

    /// The request is done: slot freed, blocks stay cached, the id is retired.
    fn finish(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        self.run(py, |m| m.finish(RequestId::from_bits(id)))
    }

    /// After the batch that carried this step's copies completed: stored checkpoints
    /// become ready (and hit), restores drop their pins.
    fn complete_inflight(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |m| m.complete_inflight())
    }

    /// Once per scheduler step: idle slots go back to blocks as the policy says.
    fn rebalance(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |m| m.rebalance())
    }

    /// A request's block table (pool block ids, current after every boundary move).
    fn block_table(&self, id: u64) -> PyResult<Vec<i32>> {
        self.lock()?.block_table(RequestId::from_bits(id)).map_err(lib_err)
    }

    /// A running request's slot position (None while it waits).
    fn slot_position(&self, id: u64) -> PyResult<Option<i64>> {
        Ok(self.lock()?.slot(RequestId::from_bits(id)).map_err(lib_err)?.map(|s| s.position))
    }

    /// A running request's slot as the pool's writers take it (None while it waits). Lent:
    /// the manager frees it; ask again after every step (a boundary move relocates it).
    fn slot(&self, id: u64) -> PyResult<Option<Slot>> {
        let s = self.lock()?.slot(RequestId::from_bits(id)).map_err(lib_err)?;
        Ok(s.map(|s| Slot::from_handle(s.handle, s.position)))
    }

    /// A request's blocks (handles, table order) as the pool's writers take them. Lent like
    /// `slot`: never free them through the pool.
    fn blocks(&self, id: u64) -> PyResult<Vec<Block>> {
        let b = self.lock()?.block_handles(RequestId::from_bits(id)).map_err(lib_err)?;
        Ok(b.into_iter().map(Block::from_handle).collect())
    }

    /// Hand a running request to `receiver` (a pool of the same layout) through the
    /// in-process engine (`transfer::handoff` with `LocalEngine`): returns the receiver's
    /// `(slot, blocks, context_len)`, which the caller then owns on `receiver` (free them
    /// there). The request stays here; finish it when done. The manager's lock is held
    /// throughout, so no step of this manager moves the request meanwhile.
    fn handoff(
        &self,
        py: Python<'_>,
        id: u64,
        receiver: &Bound<'_, PyPool>,
    ) -> PyResult<(Slot, Vec<Block>, u64)> {
        let (rpool, _hold) = receiver.get().shared();
        if self.entered() {
            return Err(reentrant());
        }
        let rebound = py
            .detach(|| {
                let m = self.hold(self.inner.lock().map_err(|_| None)?);
                let kv = m.request_kv(RequestId::from_bits(id)).map_err(|e| Some(lib_err(e)))?;
                let sp = m.pool();
                let mut engine =
                    LocalEngine::new(sp.backend().clone(), rpool.backend().clone(), rpool.stream());
                handoff(&mut engine, &Endpoint::new(sp), &Endpoint::new(&rpool), &kv)
                    .map_err(|e| Some(lib_err(e)))
            })
            .map_err(|e| e.unwrap_or_else(poisoned))?;
        let slot = Slot::from_handle(rebound.slot.handle, rebound.slot.position);
        Ok((slot, rebound.blocks.into_iter().map(Block::from_handle).collect(), rebound.context_len))
    }

    /// Tokens of a request whose KV and state are in the pool.
    fn computed_tokens(&self, id: u64) -> PyResult<u64> {
        self.lock()?.computed_tokens(RequestId::from_bits(id)).map_err(lib_err)
    }

    /// Bytes of checkpoints held (stored or being stored).
    fn checkpoint_bytes_held(&self) -> PyResult<u64> {
        Ok(self.lock()?.checkpoint_bytes_held())
    }

    /// The ready checkpoint ending at block `hash`, read to host memory as
    /// `(layout_id, data)` (the format of `Pool.checkpoint`), for another worker's
    /// `import_checkpoint`.
    fn export_checkpoint<'py>(&self, py: Python<'py>, hash: u128) -> PyResult<(String, Bound<'py, PyBytes>)> {
        let stored = self.run(py, |m| m.export_checkpoint(&BlockHash(hash)))?;
        Ok((stored.image.layout_id().to_string(), PyBytes::new(py, stored.image.bytes())))
    }

    /// Store an exported image under its block's hash (the block must be cached here);
    /// `False` when one is already there. Visible after `complete_inflight`.
    fn import_checkpoint(&self, py: Python<'_>, hash: u128, layout_id: &str, data: &[u8]) -> PyResult<bool> {
        let stored = StoredCheckpoint {
            hash: BlockHash(hash),
            image: CheckpointImage::new(LayoutId::new(layout_id), data.to_vec()),
        };
        self.run(py, |m| m.import_checkpoint(&stored))
    }

    /// The manager's counters since construction.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.lock()?.stats();
        Ok(super::py_dict!(py, {
            "admissions" => s.admissions,
            "hits" => s.hits,
            "hit_tokens" => s.hit_tokens,
            "checkpoints_stored" => s.checkpoints_stored,
            "refused_stores" => s.refused_stores,
            "restores" => s.restores,
            "checkpoint_bytes_copied" => s.checkpoint_bytes_copied,
            "checkpoints_held" => s.checkpoints_held,
            "evicted_blocks" => s.evicted_blocks,
            "evicted_checkpoints" => s.evicted_checkpoints,
            "superseded_checkpoints" => s.superseded_checkpoints,
            "cached_blocks" => s.cached_blocks,
            "boundary_moves" => s.boundary_moves,
            "block_relocations" => s.block_relocations,
            "slot_relocations" => s.slot_relocations,
            "tier_spilled_blocks" => s.tier_spilled_blocks,
            "tier_spilled_checkpoints" => s.tier_spilled_checkpoints,
            "tier_spilled_bytes" => s.tier_spilled_bytes,
            "tier_restored_blocks" => s.tier_restored_blocks,
            "tier_restored_checkpoints" => s.tier_restored_checkpoints,
            "tier_restored_bytes" => s.tier_restored_bytes,
            "tier_host_evictions" => s.tier_host_evictions,
            "tier_shortened_hits" => s.tier_shortened_hits,
            "tier_resident_blocks" => s.tier_resident_blocks,
            "tier_resident_checkpoints" => s.tier_resident_checkpoints,
            "tier_resident_bytes" => s.tier_resident_bytes,
            "shared_published_blocks" => s.shared_published_blocks,
            "shared_published_checkpoints" => s.shared_published_checkpoints,
            "shared_published_bytes" => s.shared_published_bytes,
            "shared_write_failures" => s.shared_write_failures,
            "shared_restored_blocks" => s.shared_restored_blocks,
            "shared_restored_checkpoints" => s.shared_restored_checkpoints,
            "shared_restored_bytes" => s.shared_restored_bytes,
            "shared_refused" => s.shared_refused,
        }))
    }

    /// Evict every cached block and checkpoint from HBM (spilling to the host tier when
    /// there is one); the number of blocks evicted.
    fn evict_all(&self, py: Python<'_>) -> PyResult<u64> {
        self.run(py, |m| m.evict_all())
    }

    /// Install a key-value store as the fleet's shared tier in place of any other (`None`:
    /// remove it): `store` implements the protocol of `v4pool.mooncake.MooncakeStore` (the
    /// Mooncake Store adapter), `capacity_bytes` is what the store holds for the fleet (an
    /// entry larger is refused). Entries are the file tier's bytes, checked the same way.
    #[pyo3(signature = (store, capacity_bytes=1 << 40))]
    fn set_shared_store(
        &self,
        py: Python<'_>,
        store: Option<Py<PyAny>>,
        capacity_bytes: u64,
    ) -> PyResult<()> {
        // Without the GIL (`run`): the tier it replaces may call its store as it drops.
        self.run(py, |m| {
            let tier = match store {
                Some(obj) => {
                    let s = Box::new(super::store::PyStore::new(obj));
                    let t = StoreTier::new(m.pool(), s, capacity_bytes)?;
                    Some(Box::new(t) as Box<dyn crate::manager::Tier<crate::manager::TierKey>>)
                }
                None => None,
            };
            m.set_shared_tier(tier)
        })
    }

    /// Check the manager's invariants (reference counts, index, pool agreement); raises
    /// `V4PoolError` with variant `Invariant` on a violation.
    fn check_invariants(&self) -> PyResult<()> {
        self.lock()?.check_invariants().map_err(|e| error("Invariant", e))
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!("{:?}", *self.lock()?))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvManager>()
}
