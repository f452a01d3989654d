//! vLLM's KV-event payload in MessagePack (`vllm/distributed/kv_events.py`): a batch is
//! `EventBatch` (msgspec `array_like`), `[ts, [events…], data_parallel_rank]`; an event is a
//! tagged `KVCacheEvent`, encoded as [`EventEncoding::TaggedArray`] `["BlockStored",
//! block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]` or
//! [`EventEncoding::TaggedMap`] `{"type": "BlockStored", "block_hashes": …, …}` — see
//! [`EventEncoding`] for which consumer reads which. Fields past `lora_name` (extra keys,
//! group index, cache-spec kind, locality) are left out: msgspec's `omit_defaults` leaves
//! them out too when they are unset, and a v4pool block unit holds every group at once.

use crate::manager::{BlockHash, KvEvent};
use rmp::encode;

/// How each event of a batch is encoded (the batch itself is always an array).
///
/// Checked against the consumers' sources (docs/fleet.md §2): llm-d's `kv-cache` router
/// (`pkg/kvevents/engineadapter/vllm_adapter.go`) unmarshals every event into a list and
/// reads the tag at index 0 — arrays only; NVIDIA Dynamo's `zmq_listener.rs` accepts a
/// tagged map (`"type"`) or a tagged sequence; vLLM 0.33.0's own `KVCacheEvent` is
/// `tag=True` without `array_like`, so its classes encode — and decode — maps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventEncoding {
    /// `[tag, fields…]`: what llm-d and Dynamo read (and vLLM before `array_like` left
    /// `KVCacheEvent`). The default: every router reads it.
    #[default]
    TaggedArray,
    /// `{"type": tag, field: value…}`: what vLLM 0.33.0's classes and Dynamo read.
    TaggedMap,
}

impl EventEncoding {
    /// `"array"` or `"map"` (the bindings' spelling).
    pub fn parse(s: &str) -> Option<EventEncoding> {
        match s {
            "array" | "tagged_array" => Some(EventEncoding::TaggedArray),
            "map" | "tagged_map" => Some(EventEncoding::TaggedMap),
            _ => None,
        }
    }
    /// The bindings' spelling.
    pub fn name(self) -> &'static str {
        match self {
            EventEncoding::TaggedArray => "array",
            EventEncoding::TaggedMap => "map",
        }
    }
}

/// A block hash as routers take it: the low 64 bits of v4pool's 128-bit chained hash, an
/// unsigned integer (Dynamo decodes signed or unsigned integers only, never bytes; llm-d
/// takes either). Routing keys only: a collision can misroute a request, never restore
/// wrong bytes — the manager and the tiers match on all 128 bits.
pub fn wire_hash(h: BlockHash) -> u64 {
    h.0 as u64
}

/// Writes into a `Vec<u8>` cannot fail; `rmp`'s error type is generic over the writer.
fn ok<E: std::fmt::Debug>(r: Result<impl Sized, E>) {
    r.map(drop).expect("writing MessagePack into a Vec cannot fail")
}

fn hashes(out: &mut Vec<u8>, hs: &[BlockHash]) {
    ok(encode::write_array_len(out, hs.len() as u32));
    for &h in hs {
        ok(encode::write_uint(out, wire_hash(h)));
    }
}

fn opt_hash(out: &mut Vec<u8>, h: Option<BlockHash>) {
    match h {
        Some(h) => ok(encode::write_uint(out, wire_hash(h))),
        None => ok(encode::write_nil(out)),
    }
}

fn tokens(out: &mut Vec<u8>, ts: &[u32]) {
    ok(encode::write_array_len(out, ts.len() as u32));
    for &t in ts {
        ok(encode::write_uint(out, u64::from(t)));
    }
}

fn key(out: &mut Vec<u8>, enc: EventEncoding, name: &str) {
    if enc == EventEncoding::TaggedMap {
        ok(encode::write_str(out, name));
    }
}

/// One event in `enc`, blocks of `block_size` tokens.
fn event(out: &mut Vec<u8>, e: &KvEvent, enc: EventEncoding, block_size: u32) {
    let (tag, fields) = match e {
        KvEvent::Stored { .. } => ("BlockStored", 7),
        KvEvent::Removed { .. } => ("BlockRemoved", 2),
        KvEvent::AllCleared => ("AllBlocksCleared", 0),
    };
    match enc {
        EventEncoding::TaggedArray => {
            ok(encode::write_array_len(out, 1 + fields));
            ok(encode::write_str(out, tag));
        }
        EventEncoding::TaggedMap => {
            ok(encode::write_map_len(out, 1 + fields));
            ok(encode::write_str(out, "type"));
            ok(encode::write_str(out, tag));
        }
    }
    match e {
        KvEvent::Stored { hashes: hs, parent, tokens: ts, medium } => {
            key(out, enc, "block_hashes");
            hashes(out, hs);
            key(out, enc, "parent_block_hash");
            opt_hash(out, *parent);
            key(out, enc, "token_ids");
            tokens(out, ts);
            key(out, enc, "block_size");
            ok(encode::write_uint(out, u64::from(block_size)));
            key(out, enc, "lora_id");
            ok(encode::write_nil(out));
            key(out, enc, "medium");
            ok(encode::write_str(out, medium.name()));
            key(out, enc, "lora_name");
            ok(encode::write_nil(out));
        }
        KvEvent::Removed { hashes: hs, medium } => {
            key(out, enc, "block_hashes");
            hashes(out, hs);
            key(out, enc, "medium");
            ok(encode::write_str(out, medium.name()));
        }
        KvEvent::AllCleared => {}
    }
}

/// The MessagePack of one batch: `[ts, [events…], dp_rank]`.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: u32,
    enc: EventEncoding,
    block_size: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 32);
    ok(encode::write_array_len(&mut out, 3));
    ok(encode::write_f64(&mut out, ts));
    ok(encode::write_array_len(&mut out, events.len() as u32));
    for e in events {
        event(&mut out, e, enc, block_size);
    }
    ok(encode::write_uint(&mut out, u64::from(dp_rank)));
    out
}
