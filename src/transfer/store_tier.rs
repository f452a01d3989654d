//! The shared tier over a key-value store (Mooncake Store: `MooncakeDistributedStore`, through
//! the Python layer; `docs/fleet.md` says why there): the same entries as the file tier —
//! header, layout id text, checksummed payload, byte for byte what
//! [`SharedTier`](super::SharedTier) writes to a file — under the key
//! `v4pool-tier-1/<layout digest>/<b|c><hash>`, so every read is checked by the same code and
//! a value one backend wrote is valid in the other.
//!
//! * **Publish**: the units are copied into the tier's staging buffer after room for the
//!   header, the header is written in front, and the whole entry is one `put` from the
//!   buffer (registered with the store once per buffer: [`KvStore::register_buffer`]).
//! * **Read**: the value's size, then one `get` of the whole value into the staging buffer;
//!   the header and the payload are checked in place before a byte reaches the pool. A
//!   refused entry is removed and is a miss.
//! * **Walk**: [`StoreTier::contains_many`] asks for many keys in one call (`batch_is_exist`:
//!   one round trip instead of one per block).
//! * **Capacity** is the store's: its own eviction (Mooncake: high watermark, leases) replaces
//!   the file tier's mtime LRU; a hit refreshes nothing here.
//! * **Failures are misses**: any error of the store (the master gone, a timeout) is
//!   [`HostTierError::Io`], counted, and the engine carries on.

use super::host_tier::{copy_blocks_synced, part_bytes, Storage, UnitPart};
use super::shared_tier::{
    check_head, checkpoint_units, checksum, head_len_of, header, pool_parts, refusal, removing_refused,
    restore_counted, units_of, Refused, FIXED, MAX_LAYOUT_TEXT, TIER_DIR,
};
use super::{HostTierError, SharedKey, SharedTierStats};
use crate::alloc::BlockHandle;
use crate::checkpoint::LayoutId;
use crate::pool::Pool;
use std::io;

/// A key-value store the shared tier's entries live in. Buffers passed to [`KvStore::put`] and
/// [`KvStore::get_into`] lie inside the one registered with [`KvStore::register_buffer`];
/// an implementation must read or write no byte outside the slice it is given.
pub trait KvStore: Send + std::fmt::Debug {
    /// Make `len` bytes at `addr` usable for puts and gets (the tier's staging buffer; a new
    /// one replaces the old, which is unregistered first).
    fn register_buffer(&self, addr: u64, len: u64) -> io::Result<()>;
    /// Undo [`KvStore::register_buffer`] of the buffer at `addr`. An error of kind
    /// [`io::ErrorKind::ResourceBusy`] says the store may still read or write the buffer (a
    /// call it gave up waiting for, e.g. with its master gone): the tier then never frees it.
    /// Any other error: the store touches it no more, and it is freed.
    fn unregister_buffer(&self, addr: u64) -> io::Result<()>;
    /// Which of `keys` are held.
    fn exist(&self, keys: &[String]) -> io::Result<Vec<bool>>;
    /// The length of `key`'s value, `None` when it is not held.
    fn size(&self, key: &str) -> io::Result<Option<u64>>;
    /// Store `data` as `key`'s value (replacing any).
    fn put(&self, key: &str, data: &[u8]) -> io::Result<()>;
    /// Fill `dst` with `key`'s whole value, which must be exactly `dst.len()` bytes long.
    fn get_into(&self, key: &str, dst: &mut [u8]) -> io::Result<()>;
    /// Remove `key`; whether it was held.
    fn remove(&self, key: &str) -> io::Result<bool>;
}

/// The shared tier in a [`KvStore`] (see the module docs).
pub struct StoreTier {
    store: Box<dyn KvStore>,
    /// `v4pool-tier-1/<layout digest>/`.
    prefix: String,
    layout: LayoutId,
    unit_bytes: u64,
    part_bytes: Vec<u64>,
    /// Units of one checkpoint entry of this layout.
    ckpt_units: u64,
    capacity_bytes: u64,
    staging: Option<Storage>,
    stats: SharedTierStats,
}

impl std::fmt::Debug for StoreTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreTier")
            .field("store", &self.store)
            .field("prefix", &self.prefix)
            .field("stats", &self.stats)
            .finish()
    }
}

impl StoreTier {
    /// A tier for units of `pool` in `store`, whose entries may total `capacity_bytes` (the
    /// store's segment: an entry larger is refused before it is written, a value larger is
    /// refused before it is read).
    pub fn new(
        pool: &Pool,
        store: Box<dyn KvStore>,
        capacity_bytes: u64,
    ) -> Result<StoreTier, HostTierError> {
        let part_bytes = part_bytes(pool)?;
        let layout = pool.layout_id().clone();
        let digest = checksum(layout.as_str().as_bytes()) as u64;
        Ok(StoreTier {
            store,
            prefix: format!("{TIER_DIR}/{digest:016x}/"),
            unit_bytes: part_bytes.iter().sum(),
            part_bytes,
            ckpt_units: checkpoint_units(pool),
            layout,
            capacity_bytes,
            staging: None,
            stats: SharedTierStats::default(),
        })
    }

    /// Bytes of one unit.
    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }
    /// Units the store's capacity holds.
    pub fn capacity_units(&self) -> u64 {
        self.capacity_bytes.checked_div(self.unit_bytes).unwrap_or(0)
    }
    /// What this tier has done (`scans`, `evicted`: always 0, the store evicts).
    pub fn stats(&self) -> SharedTierStats {
        self.stats
    }
    /// Bytes of an entry's header for this layout.
    pub fn head_bytes(&self) -> u64 {
        (FIXED + self.layout.as_str().len()) as u64
    }
    /// The store key of `key`'s entry.
    pub fn key_of(&self, key: &SharedKey) -> String {
        format!("{}{}", self.prefix, key.name())
    }

    fn io_error(&mut self, op: &'static str, source: io::Error) -> HostTierError {
        self.stats.io_errors += 1;
        HostTierError::Io { op, source }
    }

    /// Which of `keys` the store holds, in one call; a failure answers "none".
    pub fn contains_many(&self, keys: &[SharedKey]) -> Vec<bool> {
        let names: Vec<String> = keys.iter().map(|k| self.key_of(k)).collect();
        match self.store.exist(&names) {
            Ok(v) if v.len() == keys.len() => v,
            _ => vec![false; keys.len()],
        }
    }

    /// Whether the store holds `key`.
    pub fn contains(&self, key: &SharedKey) -> bool {
        self.contains_many(std::slice::from_ref(key))[0]
    }

    /// Remove `key`'s entry; whether it was there.
    pub fn evict(&mut self, key: &SharedKey) -> bool {
        self.store.remove(&self.key_of(key)).unwrap_or(false)
    }

    /// The staging buffer, at least `bytes` long, registered with the store.
    fn staging(&mut self, pool: &Pool, bytes: u64) -> Result<*mut u8, HostTierError> {
        if let Some(s) = self.staging.as_ref().filter(|s| s.len() as u64 >= bytes) {
            return Ok(s.ptr());
        }
        // The old buffer has no copy queued and no store call in flight (each is waited
        // for): it is unregistered and freed before the new one is made.
        if let Some(old) = self.staging.take() {
            self.give_back(old);
        }
        let s = Storage::new(pool.backend().clone(), bytes)?;
        if let Err(e) = self.store.register_buffer(s.ptr() as u64, s.len() as u64) {
            return Err(self.io_error("register the staging buffer with the store", e));
        }
        let ptr = s.ptr();
        self.staging = Some(s);
        Ok(ptr)
    }

    /// Unregister `buf` and free it, unless the store may still touch it: then it is kept,
    /// never freed (a bounded leak, one buffer per call the store gave up on, against a late
    /// write into freed memory or into a buffer reused for a later entry).
    fn give_back(&mut self, buf: Storage) {
        if let Err(e) = self.store.unregister_buffer(buf.ptr() as u64) {
            if e.kind() == io::ErrorKind::ResourceBusy {
                self.stats.io_errors += 1;
                std::mem::forget(buf);
            }
        }
    }

    fn check_pool(&self, pool: &Pool) -> Result<Vec<UnitPart>, HostTierError> {
        pool_parts(pool, &self.layout, &self.part_bytes)
    }

    /// Write the units `blocks` of `pool` as `key`'s entry: `Ok(false)` when the store holds
    /// it already. The blocks stay allocated; a failure stores nothing new and leaves the
    /// pool as it was.
    pub fn publish(
        &mut self,
        pool: &Pool,
        key: SharedKey,
        blocks: &[BlockHandle],
    ) -> Result<bool, HostTierError> {
        let parts = self.check_pool(pool)?;
        if self.contains(&key) {
            self.stats.already_present += 1;
            return Ok(false);
        }
        let too_large = |s: &StoreTier| HostTierError::TooLarge {
            units: blocks.len(),
            unit_bytes: s.unit_bytes,
            capacity: s.capacity_units(),
        };
        let units = u32::try_from(blocks.len()).map_err(|_| too_large(self))?;
        let bytes = u64::from(units) * self.unit_bytes;
        let head_len = self.head_bytes();
        if bytes.checked_add(head_len).is_none_or(|n| n > self.capacity_bytes) {
            return Err(too_large(self));
        }
        let host = self.staging(pool, head_len + bytes)?;
        // SAFETY: the staging buffer holds `head_len + bytes` (grown above) from this pool's
        // backend's `alloc_host`; the units go after the header's room, and nothing else uses
        // the buffer meanwhile.
        unsafe { copy_blocks_synced(pool, &parts, host.add(head_len as usize), blocks, true)? };
        // SAFETY: `head_len + bytes` bytes of the staging buffer, the units written by the
        // copies just waited for; the header's room is written below before the put.
        let entry = unsafe { std::slice::from_raw_parts_mut(host, (head_len + bytes) as usize) };
        let (head, body) = entry.split_at_mut(head_len as usize);
        head.copy_from_slice(&header(key, units, self.layout.as_str().as_bytes(), bytes, checksum(body)));
        let name = self.key_of(&key);
        if let Err(e) = self.store.put(&name, entry) {
            return Err(self.io_error("put the entry", e));
        }
        self.stats.published += 1;
        self.stats.published_bytes += head_len + bytes;
        Ok(true)
    }

    /// Read `key`'s entry into freshly allocated blocks of `pool` (all or nothing); the entry
    /// stays. A refused entry is removed.
    pub fn restore(&mut self, pool: &Pool, key: &SharedKey) -> Result<Vec<BlockHandle>, HostTierError> {
        let parts = self.check_pool(pool)?;
        let name = self.key_of(key);
        let len = match self.store.size(&name) {
            Ok(Some(n)) => n,
            Ok(None) => return Err(HostTierError::NotHeld),
            Err(e) => return Err(self.io_error("ask the entry's size", e)),
        };
        let (units, head_len) = removing_refused(self.read_entry(pool, key, &name, len), || {
            let _ = self.store.remove(&name);
        })?;
        let host = self.staging.as_ref().expect("read_entry filled it").ptr();
        // SAFETY: the staging buffer holds the checked entry (`units` units after `head_len`
        // header bytes) from this pool's backend's `alloc_host`, untouched meanwhile.
        unsafe {
            restore_counted(
                &mut self.stats,
                self.unit_bytes,
                pool,
                &parts,
                host.add(head_len as usize),
                units,
            )
        }
    }

    /// Get the `len`-byte value `name` of `key` into the staging buffer and check it whole:
    /// its unit count and header length.
    fn read_entry(
        &mut self,
        pool: &Pool,
        key: &SharedKey,
        name: &str,
        len: u64,
    ) -> Result<(usize, u64), HostTierError> {
        if len < FIXED as u64 {
            return Err(refusal(&mut self.stats, Refused::Corrupt("shorter than a header"), &self.layout));
        }
        // Never a buffer for more than the tier can hold (a hostile size asks for nothing);
        // a capacity near `u64::MAX` (unbounded) must not wrap into refusing everything.
        // Nor for more than any entry of this key could be (its units are the kind's; a
        // layout text at its longest): a value of gigabytes under a block's key asks for
        // nothing whatever the capacity.
        let most = (FIXED as u64 + MAX_LAYOUT_TEXT)
            .saturating_add(units_of(key.kind, self.ckpt_units).saturating_mul(self.unit_bytes));
        if len > self.capacity_bytes.saturating_add(self.head_bytes()).min(most) {
            return Err(refusal(
                &mut self.stats,
                Refused::Corrupt("longer than the tier holds"),
                &self.layout,
            ));
        }
        let host = self.staging(pool, len)?;
        // SAFETY: the staging buffer holds at least `len` bytes, no copy is queued on it.
        let entry = unsafe { std::slice::from_raw_parts_mut(host, len as usize) };
        if let Err(e) = self.store.get_into(name, entry) {
            return Err(self.io_error("get the entry", e));
        }
        let checked = head_len_of(&entry[..FIXED], len).and_then(|head_len| {
            let (head, body) = entry.split_at(head_len as usize);
            let (units, sum) = check_head(head, key, &self.layout, self.unit_bytes, self.ckpt_units, len)?;
            if checksum(body) != sum {
                return Err(Refused::Corrupt("payload checksum"));
            }
            Ok((units, head_len))
        });
        checked.map_err(|r| refusal(&mut self.stats, r, &self.layout))
    }
}

impl Drop for StoreTier {
    fn drop(&mut self) {
        if let Some(s) = self.staging.take() {
            self.give_back(s);
        }
    }
}
