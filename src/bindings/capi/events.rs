//! The C ABI's KV events (`crate::events`): v4pool's chained block hashes for an engine's
//! tokens, and a publisher of `BlockStored` / `BlockRemoved` / `AllBlocksCleared` batches in
//! vLLM's ZeroMQ / MessagePack format. An engine adds events, then flushes them as one batch.

use super::{guard, invalid, items, out, rejected, text, V4poolStatus};
use crate::events::{EventEncoding, KvEventPublisher, KvEventsConfig};
use crate::manager::{chain_hashes, BlockHash, KvEvent, Medium, Namespace};
use std::ffi::{c_char, CString};

/// A 128-bit chained block hash (`lo` the low 64 bits: what routers see).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V4poolHash {
    /// Bits 0..64.
    pub lo: u64,
    /// Bits 64..128.
    pub hi: u64,
}

impl V4poolHash {
    fn hash(self) -> BlockHash {
        BlockHash(u128::from(self.hi) << 64 | u128::from(self.lo))
    }
}

/// Where blocks are resident (an event's `medium`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4poolMedium {
    /// The pool (HBM).
    Gpu = 0,
    /// The host tier.
    Cpu = 1,
    /// The shared tier.
    Storage = 2,
}

/// How events are encoded: tagged arrays (llm-d, Dynamo) or tagged maps (vLLM 0.33.0's
/// classes, Dynamo).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4poolEventEncoding {
    /// `[tag, fields…]`.
    Array = 0,
    /// `{"type": tag, …}`.
    Map = 1,
}

/// A KV event publisher with the events added since its last flush (opaque).
pub struct V4poolEvents {
    publisher: KvEventPublisher,
    pending: Vec<KvEvent>,
    endpoint: CString,
    replay: Option<CString>,
}

fn medium(m: u32) -> Result<Medium, super::Fail> {
    match m {
        c if c == V4poolMedium::Gpu as u32 => Ok(Medium::Gpu),
        c if c == V4poolMedium::Cpu as u32 => Ok(Medium::Cpu),
        c if c == V4poolMedium::Storage as u32 => Ok(Medium::Storage),
        _ => Err(invalid(&format!("medium {m}: 0 (GPU), 1 (CPU) or 2 (STORAGE)"))),
    }
}

/// The chained hashes of every full block of `tokens` (`block_size` tokens each) in the
/// namespace of `namespace_label` (as `KvManager`'s), chained from `parent` (null: the first
/// block); writes at most `out_cap` of them and their count to `out_len`.
///
/// # Safety
/// `namespace_label` is NUL-terminated; `tokens` holds `n_tokens`; `parent` is null or
/// readable; `out_hashes` holds `out_cap` writable hashes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_block_hashes(
    namespace_label: *const c_char,
    tokens: *const u32,
    n_tokens: usize,
    block_size: usize,
    parent: *const V4poolHash,
    out_hashes: *mut V4poolHash,
    out_cap: usize,
    out_len: *mut usize,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: forwarded promises.
        let label = unsafe { text(namespace_label, "namespace_label") }?
            .ok_or_else(|| invalid("namespace_label is null"))?;
        // SAFETY: forwarded promise.
        let tokens = unsafe { items(tokens, n_tokens, "tokens") }?;
        if block_size == 0 {
            return Err(invalid("block_size is 0"));
        }
        // SAFETY: null or readable (the caller's promise).
        let parent = unsafe { parent.as_ref() }.map(|p| p.hash());
        let hs = chain_hashes(Namespace::from_label(label), parent, tokens, block_size);
        // SAFETY: `out_len` is writable (this function's `# Safety`).
        let len = unsafe { out(out_len, "out_len") }?;
        *len = hs.len();
        if hs.len() > out_cap {
            return Err((
                V4poolStatus::InvalidArgument,
                "TooSmall".into(),
                format!("{} hashes, room for {out_cap}", hs.len()),
            ));
        }
        if !hs.is_empty() {
            // A raw null check, not `out`: a reference to the first hash would not cover the
            // rest of the slice made from it.
            if out_hashes.is_null() {
                return Err(invalid("out_hashes is null"));
            }
            // SAFETY: non-null, and it holds `out_cap` ≥ `hs.len()` writable hashes (this
            // function's `# Safety`).
            let dst = unsafe { std::slice::from_raw_parts_mut(out_hashes, hs.len()) };
            for (d, h) in dst.iter_mut().zip(hs) {
                *d = V4poolHash { lo: h.0 as u64, hi: (h.0 >> 64) as u64 };
            }
        }
        Ok(())
    })
}

/// A publisher on `endpoint` (bound when it has a wildcard or is `ipc://` / `inproc://`,
/// connected to otherwise), with a replay socket on `replay_endpoint` (null: none), every
/// message's first frame `topic` (null: empty), events encoded as `encoding_code` (a
/// `V4poolEventEncoding`).
///
/// # Safety
/// Strings are null or NUL-terminated; `out_events` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_new(
    endpoint: *const c_char,
    replay_endpoint: *const c_char,
    topic: *const c_char,
    encoding_code: u32,
    dp_rank: u32,
    block_size: u32,
    out_events: *mut *mut V4poolEvents,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: forwarded string promises.
        let (endpoint, replay, topic) = unsafe {
            (text(endpoint, "endpoint")?, text(replay_endpoint, "replay_endpoint")?, text(topic, "topic")?)
        };
        // SAFETY: `out_events` is writable storage for a handle (this function's `# Safety`).
        let slot = unsafe { out(out_events, "out_events") }?;
        let config = KvEventsConfig {
            endpoint: endpoint.ok_or_else(|| invalid("endpoint is null"))?.to_string(),
            replay_endpoint: replay.map(str::to_string),
            topic: topic.unwrap_or("").to_string(),
            encoding: match encoding_code {
                c if c == V4poolEventEncoding::Array as u32 => EventEncoding::TaggedArray,
                c if c == V4poolEventEncoding::Map as u32 => EventEncoding::TaggedMap,
                c => return Err(invalid(&format!("encoding {c}: 0 (array) or 1 (map)"))),
            },
            dp_rank,
            block_size,
            ..KvEventsConfig::default()
        };
        let publisher = KvEventPublisher::new(config).map_err(rejected)?;
        let c = |s: &str| CString::new(s).unwrap_or_default();
        let endpoint = c(publisher.endpoint());
        let replay = publisher.replay_endpoint().map(c);
        *slot = Box::into_raw(Box::new(V4poolEvents { publisher, pending: Vec::new(), endpoint, replay }));
        Ok(())
    })
}

/// The endpoint subscribers connect to (a bound wildcard port resolved); owned by `events`.
///
/// # Safety
/// `events` is live.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_endpoint(events: *const V4poolEvents) -> *const c_char {
    // SAFETY: the caller's promise.
    unsafe { events.as_ref() }.map_or(std::ptr::null(), |e| e.endpoint.as_ptr())
}

/// The replay endpoint, or null; owned by `events`.
///
/// # Safety
/// `events` is live.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_replay_endpoint(events: *const V4poolEvents) -> *const c_char {
    // SAFETY: the caller's promise.
    unsafe { events.as_ref() }.and_then(|e| e.replay.as_ref()).map_or(std::ptr::null(), |c| c.as_ptr())
}

/// Add a `BlockStored` event: `n` blocks (a chain, in order) after `parent` (null: none),
/// with their tokens (`n_tokens` = `n` × block size, or 0 for none), in `medium_code` (a
/// `V4poolMedium`).
///
/// # Safety
/// `events` is live and no other call uses it meanwhile; `hashes` holds `n`; `parent` is null
/// or readable; `tokens` holds `n_tokens`.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_stored(
    events: *mut V4poolEvents,
    hashes: *const V4poolHash,
    n: usize,
    parent: *const V4poolHash,
    tokens: *const u32,
    n_tokens: usize,
    medium_code: u32,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `events` is live and this call's alone (this function's `# Safety`).
        let e = unsafe { out(events, "events") }?;
        // SAFETY: forwarded promises.
        let (hs, ts) = unsafe { (items(hashes, n, "hashes")?, items(tokens, n_tokens, "tokens")?) };
        let bs = e.publisher.config().block_size as usize;
        if !ts.is_empty() && ts.len() != n * bs {
            return Err(invalid(&format!("{} tokens for {n} blocks of {bs}", ts.len())));
        }
        // SAFETY: null or readable.
        let parent = unsafe { parent.as_ref() }.map(|p| p.hash());
        let medium = medium(medium_code)?;
        e.pending.push(KvEvent::Stored {
            hashes: hs.iter().map(|h| h.hash()).collect(),
            parent,
            tokens: ts.to_vec(),
            medium,
        });
        Ok(())
    })
}

/// Add a `BlockRemoved` event: `n` blocks left `medium`.
///
/// # Safety
/// `events` is live and no other call uses it meanwhile; `hashes` holds `n`.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_removed(
    events: *mut V4poolEvents,
    hashes: *const V4poolHash,
    n: usize,
    medium_code: u32,
) -> V4poolStatus {
    guard(|| {
        // SAFETY: `events` is live and this call's alone (this function's `# Safety`).
        let e = unsafe { out(events, "events") }?;
        // SAFETY: forwarded promise.
        let hs = unsafe { items(hashes, n, "hashes") }?;
        let medium = medium(medium_code)?;
        e.pending.push(KvEvent::Removed { hashes: hs.iter().map(|h| h.hash()).collect(), medium });
        Ok(())
    })
}

/// Add an `AllBlocksCleared` event.
///
/// # Safety
/// `events` is live and no other call uses it meanwhile.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_cleared(events: *mut V4poolEvents) -> V4poolStatus {
    guard(|| {
        // SAFETY: `events` is live and this call's alone (this function's `# Safety`).
        unsafe { out(events, "events") }?.pending.push(KvEvent::AllCleared);
        Ok(())
    })
}

/// Send the events added since the last flush as one batch; its sequence number to
/// `out_seq` (-1: there was nothing to send).
///
/// # Safety
/// `events` is live and no other call uses it meanwhile; `out_seq` writable.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_flush(events: *mut V4poolEvents, out_seq: *mut i64) -> V4poolStatus {
    guard(|| {
        // SAFETY: `events` is live and this call's alone (this function's `# Safety`).
        let e = unsafe { out(events, "events") }?;
        // SAFETY: `out_seq` is writable (this function's `# Safety`).
        let seq = unsafe { out(out_seq, "out_seq") }?;
        let pending = std::mem::take(&mut e.pending);
        *seq = match e.publisher.publish(&pending).map_err(rejected)? {
            Some(s) => i64::try_from(s).unwrap_or(i64::MAX),
            None => -1,
        };
        Ok(())
    })
}

/// Close the publisher's sockets (unsent events are dropped).
///
/// # Safety
/// `events` is null or a live handle, not used after.
#[no_mangle]
pub unsafe extern "C" fn v4pool_events_free(events: *mut V4poolEvents) {
    if !events.is_null() {
        // SAFETY: from `Box::into_raw` in `v4pool_events_new`, freed once.
        drop(unsafe { Box::from_raw(events) });
    }
}
