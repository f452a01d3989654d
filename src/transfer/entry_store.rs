//! The entry tier ([`super::entry_dir`]) in a key-value store: Mooncake Store
//! (`MooncakeDistributedStore`, through the Python layer: `v4pool.mooncake.MooncakeStore`,
//! `docs/fleet.md` says why there), as vLLM's connector's shared tier (`docs/vllm.md`).
//!
//! * **An entry** is one value under the key `v4pool-entries-1/<layout digest>/<kind><hash>`
//!   (the layout id's checksum as the entry tier's folder, the entry's file name): byte for
//!   byte what [`EntryDir`](super::entry_dir::EntryDir) writes to a file — its header (magic,
//!   kind, hash, the layout id's length, the body's length and checksum, the header's own
//!   checksum), the layout id's text, the body — built and checked by the same code, so a
//!   value one back end wrote is valid in the other. The store's Python adapter only moves
//!   bytes.
//! * **Publish**: the entry is laid out in the tier's staging buffer (registered with the
//!   store once per buffer) — room for the header and the layout text, the body filled by
//!   the caller, the header written last over the body's checksum — and is one `put`.
//! * **Read**: the value's size first (one longer than the tier's capacity, or shorter than a
//!   header, is refused unfetched and removed; one longer than any entry of the caller's
//!   body length could be, whatever its layout, is left unfetched), then one `get` of the whole value into the staging
//!   buffer; the header, the key, the whole layout text, the body's length and checksum are
//!   checked there before the caller sees a byte ([`Lookup::Hit`]). A corrupt or truncated
//!   value is removed; another layout's or another length's is left ([`Lookup::Foreign`]).
//! * **Two-phase calls** ([`EntryStore::put_with`], [`EntryStore::get_with`]): the caller's
//!   memory is read (filled) only inside a closure that runs between the store's calls, never
//!   while one is in flight, so a caller whose memory another thread may change while the
//!   store is asked (Python's tensors, once the adapter's wait releases the GIL) hands it over
//!   only where nothing else runs.
//! * **A store that is down is a miss**: every store error (the master gone, a bounded call
//!   that overran: `v4pool.mooncake`'s `MooncakeDown`) is [`Lookup::Absent`] on a read,
//!   [`EntryDirError::Store`] on a write, counted in [`EntryDirStats::io_errors`]; the
//!   engine carries on.
//! * **Capacity** is the store's own (Mooncake: its high watermark and leases); the tier only
//!   refuses an entry larger than its capacity and never publishes one.

use super::entry_dir::{
    entry_bytes, kind_ok, plausible_len, EntryDirError, EntryDirStats, Header, Lookup, DIGEST_HEX, ENTRY_DIR,
    FIXED, MAX_LAYOUT,
};
use super::shared_tier::checksum;
use super::store_tier::KvStore;
use super::tier_files::entry_name;
use std::io;

/// The tier's staging buffer, registered with its store while it is held.
#[derive(Default)]
struct Staging {
    buf: Option<Box<[u8]>>,
}

impl Staging {
    /// The buffer, at least `bytes` long, registered with `store` (a smaller one is given
    /// back first).
    fn get(&mut self, store: &dyn KvStore, bytes: usize) -> io::Result<&mut [u8]> {
        if self.buf.as_ref().is_none_or(|b| b.len() < bytes) {
            self.give_back(store);
            let b = vec![0u8; bytes].into_boxed_slice();
            store.register_buffer(b.as_ptr() as u64, b.len() as u64)?;
            self.buf = Some(b);
        }
        Ok(self.buf.as_deref_mut().unwrap_or_default())
    }

    /// Unregister the buffer and free it, unless the store may still touch it
    /// ([`io::ErrorKind::ResourceBusy`]: a call it gave up waiting for): then it is never
    /// freed (one buffer per abandoned call, against a late write into freed memory).
    fn give_back(&mut self, store: &dyn KvStore) {
        if let Some(b) = self.buf.take() {
            if let Err(e) = store.unregister_buffer(b.as_ptr() as u64) {
                if e.kind() == io::ErrorKind::ResourceBusy {
                    std::mem::forget(b);
                }
            }
        }
    }
}

/// The entry tier in a key-value store (see the module docs).
pub struct EntryStore {
    store: Box<dyn KvStore>,
    /// `v4pool-entries-1/<layout digest>/`.
    prefix: String,
    layout: String,
    capacity: u64,
    staging: Staging,
    stats: EntryDirStats,
}

impl std::fmt::Debug for EntryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntryStore")
            .field("store", &self.store)
            .field("prefix", &self.prefix)
            .field("capacity", &self.capacity)
            .field("stats", &self.stats)
            .finish()
    }
}

impl EntryStore {
    /// The tier for `layout` in `store`, whose entries may be at most `capacity_bytes` each
    /// (the store's segment: larger is never written, nor fetched). The layout id's rules are
    /// the file tier's ([`EntryDirError::BadLayout`]).
    pub fn new(
        store: Box<dyn KvStore>,
        layout: &str,
        capacity_bytes: u64,
    ) -> Result<EntryStore, EntryDirError> {
        if layout.is_empty() || layout.len() > MAX_LAYOUT {
            return Err(EntryDirError::BadLayout(layout.len()));
        }
        let digest = checksum(layout.as_bytes());
        Ok(EntryStore {
            store,
            prefix: format!("{ENTRY_DIR}/{digest:0w$x}/", w = DIGEST_HEX),
            layout: layout.to_string(),
            capacity: capacity_bytes,
            staging: Staging::default(),
            stats: EntryDirStats::default(),
        })
    }

    /// The store key of `(kind, hash)`'s entry.
    pub fn key_of(&self, kind: char, hash: u128) -> String {
        format!("{}{}", self.prefix, entry_name(kind, hash))
    }

    /// The counters.
    pub fn stats(&self) -> EntryDirStats {
        self.stats
    }

    /// Whether the store holds a value under the key (not checked: a read may still miss);
    /// `false` when the store does not answer.
    pub fn contains(&mut self, kind: char, hash: u128) -> bool {
        if kind_ok(kind).is_err() {
            return false;
        }
        match self.store.exist(&[self.key_of(kind, hash)]) {
            Ok(v) => v.first().copied().unwrap_or(false),
            Err(_) => {
                self.stats.io_errors += 1;
                false
            }
        }
    }

    /// The body length the value's size implies (its size less this layout's header), `None`
    /// when absent, implausible (shorter than a header, longer than the capacity) or the store
    /// does not answer. Unlike the file tier's, unchecked: only a read fetches the header.
    pub fn body_len(&mut self, kind: char, hash: u128) -> Option<u64> {
        kind_ok(kind).ok()?;
        let len = self.value_len(&self.key_of(kind, hash))?;
        len.checked_sub((FIXED + self.layout.len()) as u64)
    }

    /// The value's size if held and plausible (see [`EntryStore::body_len`]).
    fn value_len(&mut self, key: &str) -> Option<u64> {
        match self.store.size(key) {
            Ok(Some(n)) if plausible_len(n, self.capacity) => Some(n),
            Ok(_) => None,
            Err(_) => {
                self.stats.io_errors += 1;
                None
            }
        }
    }

    /// Publish an entry whose body is `body_len` bytes that `fill` writes (called once, on
    /// the staging buffer, after the store's registration and before its `put`; an error it
    /// returns stores nothing). Replaces any entry under the key.
    pub fn put_with<E: From<EntryDirError>>(
        &mut self,
        kind: char,
        hash: u128,
        body_len: u64,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let k = kind_ok(kind)?;
        let total = entry_bytes(&self.layout, body_len, self.capacity)?;
        let key = self.key_of(kind, hash);
        let fail = |stats: &mut EntryDirStats, what, key, source| {
            stats.put_errors += 1;
            stats.io_errors += 1;
            EntryDirError::Store { what, key, source }
        };
        let total_us = usize::try_from(total)
            .map_err(|_| EntryDirError::TooLarge { bytes: total, budget: self.capacity })?;
        let entry = match self.staging.get(&*self.store, total_us) {
            Ok(b) => &mut b[..total_us],
            Err(e) => return Err(fail(&mut self.stats, "registering the staging buffer for", key, e).into()),
        };
        let (head, rest) = entry.split_at_mut(FIXED);
        let (text, body) = rest.split_at_mut(self.layout.len());
        fill(body)?;
        text.copy_from_slice(self.layout.as_bytes());
        head.copy_from_slice(&Header::of(k, hash, &self.layout, &[body]).bytes());
        if let Err(e) = self.store.put(&key, entry) {
            return Err(fail(&mut self.stats, "putting", key, e).into());
        }
        self.stats.puts += 1;
        self.stats.put_bytes += total;
        Ok(())
    }

    /// Publish the concatenation of `parts` under the key ([`EntryStore::put_with`]).
    pub fn put(&mut self, kind: char, hash: u128, parts: &[&[u8]]) -> Result<(), EntryDirError> {
        let body_len = parts.iter().map(|p| p.len() as u64).sum();
        self.put_with(kind, hash, body_len, |body| {
            let mut at = 0;
            for p in parts {
                body[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
            Ok::<(), EntryDirError>(())
        })
    }

    /// Read the entry under the key, checked whole (see the module docs); on
    /// [`Lookup::Hit`] only, `take` is given its body (exactly `body_len` bytes, the length
    /// the caller expects: another is [`Lookup::Foreign`]) and its error is returned.
    pub fn get_with<E>(
        &mut self,
        kind: char,
        hash: u128,
        body_len: usize,
        take: impl FnOnce(&[u8]) -> Result<(), E>,
    ) -> Result<Lookup, E> {
        let key = self.key_of(kind, hash);
        let r = match kind_ok(kind) {
            Ok(k) => self.fetch(k, hash, &key, body_len),
            Err(_) => Err(Lookup::Absent),
        };
        let r = match r {
            Ok(body) => {
                // The staging buffer holds the checked body at `body`.
                let b = self.staging.buf.as_deref().unwrap_or_default();
                take(&b[body.0..body.1])?;
                Lookup::Hit
            }
            Err(r) => r,
        };
        match r {
            Lookup::Hit => self.stats.hits += 1,
            Lookup::Absent => self.stats.absent += 1,
            Lookup::Corrupt => {
                self.stats.corrupt += 1;
                // Refused for good: the next publisher writes it anew.
                if self.store.remove(&key).is_err() {
                    self.stats.io_errors += 1;
                }
            }
            Lookup::Foreign => self.stats.foreign += 1,
        }
        Ok(r)
    }

    /// Fetch and check `key`'s value into the staging buffer: the body's range there, or
    /// the answer.
    fn fetch(&mut self, kind: u8, hash: u128, key: &str, body_len: usize) -> Result<(usize, usize), Lookup> {
        let len = match self.store.size(key) {
            Ok(Some(n)) => n,
            Ok(None) => return Err(Lookup::Absent),
            Err(_) => {
                self.stats.io_errors += 1;
                return Err(Lookup::Absent);
            }
        };
        // Never a buffer for a value the tier could not have written ...
        if !plausible_len(len, self.capacity) {
            return Err(Lookup::Corrupt);
        }
        // ... nor for one longer than any entry of the caller's length, whatever its layout:
        // a hostile size under a small entry's key asks for nothing (left, as another
        // length's entry is).
        if len > (FIXED + MAX_LAYOUT) as u64 + body_len as u64 {
            return Err(Lookup::Foreign);
        }
        let len = usize::try_from(len).map_err(|_| Lookup::Corrupt)?;
        let entry = match self.staging.get(&*self.store, len) {
            Ok(b) => &mut b[..len],
            Err(_) => {
                self.stats.io_errors += 1;
                return Err(Lookup::Absent);
            }
        };
        // A value replaced by one of another size since its size was asked is an error
        // here (the whole value or nothing): a miss.
        if self.store.get_into(key, entry).is_err() {
            self.stats.io_errors += 1;
            return Err(Lookup::Absent);
        }
        let fixed: &[u8; FIXED] = entry[..FIXED].try_into().map_err(|_| Lookup::Corrupt)?;
        let head = Header::check(fixed, kind, hash, len as u64).ok_or(Lookup::Corrupt)?;
        let text_end = FIXED + head.layout_len as usize;
        head.check_ours(&entry[FIXED..text_end], &self.layout, body_len)?;
        match head.check_body(&entry[text_end..]) {
            Lookup::Hit => Ok((text_end, len)),
            r => Err(r),
        }
    }

    /// Fill `dst` with the entry's body ([`EntryStore::get_with`]); `dst` is untouched unless
    /// the answer is [`Lookup::Hit`].
    pub fn get_into(&mut self, kind: char, hash: u128, dst: &mut [u8]) -> Lookup {
        let r = self.get_with(kind, hash, dst.len(), |b| {
            dst.copy_from_slice(b);
            Ok::<(), std::convert::Infallible>(())
        });
        match r {
            Ok(l) => l,
            Err(never) => match never {},
        }
    }

    /// Remove an entry; whether one was there (`false` when the store does not answer).
    pub fn remove(&mut self, kind: char, hash: u128) -> bool {
        if kind_ok(kind).is_err() {
            return false;
        }
        match self.store.remove(&self.key_of(kind, hash)) {
            Ok(held) => held,
            Err(_) => {
                self.stats.io_errors += 1;
                false
            }
        }
    }
}

impl Drop for EntryStore {
    fn drop(&mut self) {
        self.staging.give_back(&*self.store);
    }
}
