//! Prefill → decode handoff of one request between two pools, through any
//! [`TransferEngine`].
//!
//! The order is what keeps it safe to get wrong on either side:
//!
//! 1. **Layout ids first.** Each side sends its pool's [`Pool::layout_id`]
//!    and wire shape (plane widths, envelope and slot rows, indexer block bytes) through
//!    [`TransferEngine::exchange`]; either side refuses a mismatch with a typed error before
//!    any KV byte moves or anything is allocated.
//! 2. **All-or-nothing reservation.** The receiver takes one slot and as many blocks as the
//!    request holds; if it cannot, everything it took is released and the handoff fails with
//!    [`HandoffError::NoRoom`].
//! 3. **Few, large spans.** Each block's envelope bytes in every plane, its indexer block in
//!    every CSA layer, and the request's **whole slot** in every plane (compressor state and
//!    window ring: the §7 slot unit) become spans, [`coalesce`]d: runs of consecutive block ids
//!    on both sides move as one span per plane and per CSA layer. The whole slot rather than
//!    the §6 checkpoint image: a live request mid-way through an HCA compression window has
//!    HCA state the image leaves out (checkpoints sit on block boundaries, where it is empty).
//! 4. **Rebind.** After completion the receiver owns new block handles (same order as the
//!    sender's block table) and a slot lease; decoding continues there. A failed transfer
//!    releases the reservation.

use super::engine::{coalesce, EngineError, MemRegion, RegionId, Side, Span, TransferEngine};
use crate::alloc::{BlockHandle, SlotHandle};
use crate::checked::gcd;
use crate::pool::{Pool, PoolError, SlotLease};
use thiserror::Error;

crate::variant::variant_names! {
/// What the handoff refuses or fails with.
#[derive(Debug, Error)]
pub enum HandoffError {
    /// The two pools' layout ids differ: their bytes do not mean the same thing.
    #[error("layout ids differ: sender {sender:?}, receiver {receiver:?}")]
    LayoutMismatch {
        /// The sender's layout id.
        sender: String,
        /// The receiver's layout id.
        receiver: String,
    },
    /// Same layout id, different carve (widths, envelope/slot rows, indexer blocks).
    #[error("wire shapes differ: sender {sender:?}, receiver {receiver:?}")]
    ShapeMismatch {
        /// The sender's shape.
        sender: Box<WireShape>,
        /// The receiver's shape.
        receiver: Box<WireShape>,
    },
    /// A handshake message that does not parse.
    #[error("bad handshake message: {0}")]
    BadHandshake(String),
    /// The receiver cannot hold the request; nothing stays allocated.
    #[error("receiver has no room for a slot and {blocks} blocks: {source}")]
    NoRoom {
        /// Blocks the request needed.
        blocks: usize,
        /// What the receiver's pool refused.
        source: PoolError,
    },
    /// The sender's request names a stale block or slot handle.
    #[error("sender request is not held: {0}")]
    Request(PoolError),
    /// The engine failed; the receiver's reservation was released.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A pool call failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
}
}

/// The carve facts a receiver must share with the sender for bytes to land where they mean
/// the same thing (the layout id fixes the model; this fixes the pool's cut of it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireShape {
    /// Row bytes of each plane.
    pub plane_widths: Vec<u64>,
    /// Rows of one block's envelope.
    pub envelope_rows: i64,
    /// Rows of one slot.
    pub slot_rows: i64,
    /// Rows of compressor state at the top of a slot.
    pub arena_rows: i64,
    /// Bytes per block of each indexer pool (empty: no indexer cache).
    pub indexer_block_bytes: Vec<u64>,
    /// Global ids of the CSA layers (the indexer's layer order).
    pub csa_layers: Vec<usize>,
}

impl WireShape {
    /// The shape of `pool`.
    pub fn of(pool: &Pool) -> WireShape {
        let s = pool.spec();
        let g = &s.geometry;
        WireShape {
            plane_widths: s.plane_widths.clone(),
            envelope_rows: g.envelope_rows,
            slot_rows: g.slot_rows,
            arena_rows: g.arena_rows,
            indexer_block_bytes: match (pool.indexer_ptr(), s.indexer) {
                (Some(_), Some(ix)) => ix.pool_block_bytes().to_vec(),
                _ => Vec::new(),
            },
            csa_layers: s.csa_layers.clone(),
        }
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "plane_widths": self.plane_widths,
            "envelope_rows": self.envelope_rows,
            "slot_rows": self.slot_rows,
            "arena_rows": self.arena_rows,
            "indexer_block_bytes": self.indexer_block_bytes,
            "csa_layers": self.csa_layers,
        })
    }

    fn from_json(v: &serde_json::Value) -> Option<WireShape> {
        let list =
            |k: &str| -> Option<Vec<u64>> { v.get(k)?.as_array()?.iter().map(|x| x.as_u64()).collect() };
        Some(WireShape {
            plane_widths: list("plane_widths")?,
            envelope_rows: v.get("envelope_rows")?.as_i64()?,
            slot_rows: v.get("slot_rows")?.as_i64()?,
            arena_rows: v.get("arena_rows")?.as_i64()?,
            indexer_block_bytes: list("indexer_block_bytes")?,
            csa_layers: list("csa_layers")?.into_iter().map(|x| x as usize).collect(),
        })
    }
}

/// One side of a handoff: a pool, speaking for its own layout id ([`Pool::layout_id`]):
/// the id comes from the pool, never from the caller, so a peer of another layout cannot be
/// passed off as this one.
#[derive(Debug)]
pub struct Endpoint<'a> {
    pool: &'a Pool,
}

/// The pool's registrable memory: every plane, then every indexer pool.
struct PoolRegions {
    planes: Vec<RegionId>,
    indexer: Vec<RegionId>,
}

impl<'a> Endpoint<'a> {
    /// An endpoint for `pool`, carrying the pool's own layout id.
    pub fn new(pool: &'a Pool) -> Endpoint<'a> {
        Endpoint { pool }
    }

    /// The pool this side moves bytes of.
    pub fn pool(&self) -> &'a Pool {
        self.pool
    }

    /// The layout id this side sends: its pool's.
    pub fn layout_id(&self) -> &str {
        self.pool.layout_id().as_str()
    }

    /// The handshake message this side sends: its layout id and wire shape.
    pub fn hello(&self) -> Vec<u8> {
        serde_json::json!({ "layout_id": self.layout_id(), "shape": WireShape::of(self.pool).to_json() })
            .to_string()
            .into_bytes()
    }

    /// Check a peer's handshake message against this side; `self_is_sender` orders the
    /// error's fields.
    pub fn check_peer(&self, msg: &[u8], self_is_sender: bool) -> Result<(), HandoffError> {
        let bad = |m: &str| HandoffError::BadHandshake(m.to_string());
        let v: serde_json::Value = serde_json::from_slice(msg).map_err(|e| bad(&e.to_string()))?;
        let id = v.get("layout_id").and_then(|x| x.as_str()).ok_or_else(|| bad("no layout_id"))?;
        let shape = v.get("shape").and_then(WireShape::from_json).ok_or_else(|| bad("no shape"))?;
        let (mine, theirs) = (self.layout_id().to_string(), id.to_string());
        if mine != theirs {
            let (sender, receiver) = if self_is_sender { (mine, theirs) } else { (theirs, mine) };
            return Err(HandoffError::LayoutMismatch { sender, receiver });
        }
        let my_shape = WireShape::of(self.pool);
        if my_shape != shape {
            let (a, b) = (Box::new(my_shape), Box::new(shape));
            let (sender, receiver) = if self_is_sender { (a, b) } else { (b, a) };
            return Err(HandoffError::ShapeMismatch { sender, receiver });
        }
        Ok(())
    }

    /// Register the pool's planes and indexer pools on `side`.
    fn register(&self, engine: &mut dyn TransferEngine, side: Side) -> Result<PoolRegions, HandoffError> {
        let p = self.pool;
        let g = &p.spec().geometry;
        let mut out = PoolRegions { planes: Vec::new(), indexer: Vec::new() };
        for (i, &w) in p.spec().plane_widths.iter().enumerate() {
            let r = MemRegion { addr: p.plane_ptr(i)?, len: p.plane_bytes(i)?, item_len: g.block_bytes(w) };
            // SAFETY: the plane is the pool's own allocation, live while `self.pool` is borrowed;
            // `handoff` deregisters before returning.
            out.planes.push(unsafe { engine.register(side, r)? });
        }
        for (base, bytes, pb) in indexer_pools(p) {
            let r = MemRegion { addr: base, len: bytes, item_len: pb };
            // SAFETY: as above, inside the pool's indexer allocation.
            out.indexer.push(unsafe { engine.register(side, r)? });
        }
        Ok(out)
    }
}

/// Each indexer pool of `pool` as (address, bytes, registered item bytes): its index-key
/// layers' `[indexer_blocks][layer block bytes]` in layer order ([`Pool::indexer_parts`]; V4:
/// `[n_csa][indexer_blocks][pb]`, items of `pb`).
fn indexer_pools(pool: &Pool) -> Vec<(u64, u64, u64)> {
    let Some(base) = pool.indexer_ptr() else {
        return Vec::new();
    };
    pool.indexer_parts()
        .iter()
        .zip(pool.indexer_offsets())
        .map(|(layers, &off)| {
            let per_block: u64 = layers.iter().map(|p| p.block_bytes).sum();
            // Items every layer's blocks are whole multiples of (V4: the one block size).
            let item = layers.iter().map(|p| p.block_bytes).fold(0, gcd);
            (base + off, per_block * pool.indexer_blocks(), item)
        })
        .collect()
}

/// A request's KV on the sender: its block table (in order) and its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestKv {
    /// Block table, in logical order.
    pub blocks: Vec<BlockHandle>,
    /// The request's slot.
    pub slot: SlotHandle,
    /// Tokens the request holds (carried through so decoding continues at the same step).
    pub context_len: u64,
}

/// The request as the receiver now holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rebound {
    /// The new block table, in the sender's logical order.
    pub blocks: Vec<BlockHandle>,
    /// The new slot (handle and position).
    pub slot: SlotLease,
    /// Tokens the request holds.
    pub context_len: u64,
    /// Spans the transfer took after coalescing.
    pub spans: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time from posting the spans to their completion (the byte movement alone,
    /// without the handshake and the reservation).
    pub transfer_time: std::time::Duration,
}

impl Rebound {
    /// The block table as ids (what the decode staging takes).
    pub fn block_ids(&self) -> Vec<i32> {
        self.blocks.iter().map(|b| b.id as i32).collect()
    }
}

/// The spans of one handoff, coalesced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoffPlan {
    /// Coalesced spans.
    pub spans: Vec<Span>,
    /// Total bytes.
    pub bytes: u64,
}

/// Spans moving `src_blocks` (paired in order with `dst_blocks`) and the slot at `src_pos` to
/// the slot at `dst_pos`, between registered pools of the same wire shape.
fn plan(
    sender: &Pool,
    s: &PoolRegions,
    receiver: &Pool,
    r: &PoolRegions,
    pairs: &[(u32, u32)],
    positions: (i64, i64),
) -> Result<HandoffPlan, HandoffError> {
    let g = &sender.spec().geometry;
    let mut spans = Vec::new();
    for (p, &w) in sender.spec().plane_widths.iter().enumerate() {
        let bb = g.block_bytes(w);
        for &(a, b) in pairs {
            spans.push(Span {
                src: s.planes[p],
                dst: r.planes[p],
                src_off: u64::from(a) * bb,
                dst_off: u64::from(b) * bb,
                len: bb,
            });
        }
        let (sa, _) = sender.geometry()?.slot_span(positions.0).map_err(PoolError::from)?;
        let (sb, _) = receiver.geometry()?.slot_span(positions.1).map_err(PoolError::from)?;
        spans.push(Span {
            src: s.planes[p],
            dst: r.planes[p],
            src_off: sa as u64 * w,
            dst_off: sb as u64 * w,
            len: g.slot_bytes(w),
        });
    }
    let (nb_s, nb_r) = (sender.indexer_blocks(), receiver.indexer_blocks());
    // The shapes matched, so both pools have these layers (only their block counts differ).
    for (i, layers) in sender.indexer_parts().iter().enumerate() {
        for part in layers {
            for &(a, b) in pairs {
                spans.push(Span {
                    src: s.indexer[i],
                    dst: r.indexer[i],
                    src_off: part.prefix * nb_s + u64::from(a) * part.block_bytes,
                    dst_off: part.prefix * nb_r + u64::from(b) * part.block_bytes,
                    len: part.block_bytes,
                });
            }
        }
    }
    let spans = coalesce(&spans);
    let bytes = spans.iter().map(|s| s.len).sum();
    Ok(HandoffPlan { spans, bytes })
}

/// Receiver side: a slot and `n` blocks, or nothing.
fn reserve(pool: &Pool, n: usize) -> Result<(SlotLease, Vec<BlockHandle>), HandoffError> {
    let slot = pool.alloc_slot().map_err(|source| HandoffError::NoRoom { blocks: n, source })?;
    let mut blocks = Vec::with_capacity(n);
    for _ in 0..n {
        match pool.alloc_block() {
            Ok(g) => blocks.push(g.handle),
            Err(source) => {
                release(pool, slot.handle, &blocks);
                return Err(HandoffError::NoRoom { blocks: n, source });
            }
        }
    }
    Ok((slot, blocks))
}

/// Give back a reservation (errors ignored: the handles were just handed out by this pool).
fn release(pool: &Pool, slot: SlotHandle, blocks: &[BlockHandle]) {
    for &b in blocks {
        let _ = pool.free_block(b);
    }
    let _ = pool.free_slot(slot);
}

/// Hand `request` from `sender` to `receiver` through `engine` (sender memory registered as
/// local, receiver memory as remote). See the module docs for the order of steps. On
/// success the sender still holds its request (free it when done); on any error the
/// receiver holds nothing new.
pub fn handoff(
    engine: &mut dyn TransferEngine,
    sender: &Endpoint<'_>,
    receiver: &Endpoint<'_>,
    request: &RequestKv,
) -> Result<Rebound, HandoffError> {
    // 1. Layout ids (and shapes), both ways, before anything else.
    let (at_receiver, at_sender) = engine.exchange(&sender.hello(), &receiver.hello())?;
    receiver.check_peer(&at_receiver, false)?;
    sender.check_peer(&at_sender, true)?;
    // Pin both boundaries before looking anything up: the engine copies outside the pools'
    // locks and streams, so no relocation may move a block or slot it reads or writes until
    // the copy has ended (a move meanwhile is refused with `PoolError::BoundaryPinned`).
    let (sp, rp) = (sender.pool, receiver.pool);
    let _pins = (sp.pin_boundary()?, rp.pin_boundary()?);
    // The sender's request must be held now.
    let src_pos = sp.slot_position(request.slot).map_err(HandoffError::Request)?;
    sp.block_ids(&request.blocks).map_err(HandoffError::Request)?;
    // 2. All-or-nothing reservation.
    let (slot, blocks) = reserve(rp, request.blocks.len())?;
    let result = (|| {
        let s = sender.register(engine, Side::Local)?;
        let r = receiver.register(engine, Side::Remote);
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                deregister(engine, &s);
                return Err(e);
            }
        };
        let moved = (|| {
            let pairs: Vec<(u32, u32)> =
                request.blocks.iter().zip(&blocks).map(|(a, b)| (a.id, b.id)).collect();
            let plan = plan(sp, &s, rp, &r, &pairs, (src_pos, slot.position))?;
            // The sender's bytes and the receiver's slot initialisation are queued on the
            // pools' streams: both must be done before the engine reads or overwrites.
            sp.backend().synchronize(sp.stream()).map_err(PoolError::from)?;
            rp.backend().synchronize(rp.stream()).map_err(PoolError::from)?;
            let started = std::time::Instant::now();
            let ticket = engine.post(&plan.spans)?;
            engine.wait(ticket)?;
            Ok((plan, started.elapsed()))
        })();
        deregister(engine, &s);
        deregister(engine, &r);
        moved
    })();
    match result {
        Ok((plan, transfer_time)) => Ok(Rebound {
            blocks,
            slot,
            context_len: request.context_len,
            spans: plan.spans.len(),
            bytes: plan.bytes,
            transfer_time,
        }),
        Err(e) => {
            release(rp, slot.handle, &blocks);
            Err(e)
        }
    }
}

fn deregister(engine: &mut dyn TransferEngine, r: &PoolRegions) {
    for &id in r.planes.iter().chain(&r.indexer) {
        let _ = engine.deregister(id);
    }
}
