//! Request handoff between two host pools through the local engine: the receiver's blocks
//! (every plane and indexer layer), slot state and window rows byte-identical to the
//! sender's, every other receiver byte untouched; refused cases leave the receiver holding
//! nothing new.

use crate::common;
use crate::transfer_common;

use common::{case_seed, Rng};
use std::sync::Arc;
use transfer_common::*;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::BlockHandle;
use v4pool::pool::Pool;
use v4pool::transfer::engine::{EngineError, MemRegion, RegionId, Side, Span, TransferTicket};
use v4pool::transfer::{handoff, Endpoint, HandoffError, LocalEngine, RequestKv, TransferEngine};

/// A request of `n` blocks on `pool`, ids scattered (every other block of a larger run is
/// freed first), every byte of its blocks and whole slot random.
fn request(pool: &Pool, n: usize, rng: &mut Rng) -> RequestKv {
    let slot = pool.alloc_slot().unwrap();
    let mut taken: Vec<BlockHandle> = Vec::new();
    let mut blocks = Vec::new();
    while blocks.len() < n {
        let b = pool.alloc_block().unwrap().handle;
        let spare = pool.counts().unwrap().free_blocks as usize >= n - blocks.len();
        if spare && rng.chance(0.3) {
            taken.push(b); // a hole, freed below
        } else {
            blocks.push(b);
        }
    }
    for b in taken {
        pool.free_block(b).unwrap();
    }
    for &b in &blocks {
        let r = block_ranges(pool, b.id);
        write(pool, &r, &rng.bytes(total(&r)));
    }
    let r = slot_ranges(pool, slot.position);
    write(pool, &r, &rng.bytes(total(&r)));
    RequestKv { blocks, slot: slot.handle, context_len: (n as u64 * 256).saturating_sub(17) }
}

fn poison(pool: &Pool, rng: &mut Rng) {
    let r = all_ranges(pool);
    write(pool, &r, &rng.bytes(total(&r)));
}

fn handoff_case(name: &str, shared_backend: bool) {
    handoff_case_kv(name, shared_backend, v4pool::sizing::KvDtype::Fp8);
}

fn handoff_case_kv(name: &str, shared_backend: bool, kv: v4pool::sizing::KvDtype) {
    handoff_case_model(name, shared_backend, &ModelShape::v4_flash(1).unwrap(), kv);
}

fn handoff_case_model(name: &str, shared_backend: bool, model: &ModelShape, kv: v4pool::sizing::KvDtype) {
    let model = model.clone();
    for (i, n) in [1usize, 3, 6, 10].into_iter().enumerate() {
        let mut rng = Rng::new(case_seed(name, i as u64));
        let b0: Arc<dyn Backend> = Arc::new(HostBackend::new());
        let b1 = if shared_backend { b0.clone() } else { Arc::new(HostBackend::new()) as Arc<dyn Backend> };
        let (sender, _) = transfer_common::pool_of(b0.clone(), &model, kv, 16, 2);
        let (receiver, _) = transfer_common::pool_of(b1.clone(), &model, kv, 12, 2);
        poison(&receiver, &mut rng);
        // The receiver already holds a request of its own: it must not be disturbed.
        let other = receiver.alloc_slot().unwrap();
        let req = request(&sender, n, &mut rng);
        let before = read(&receiver, &all_ranges(&receiver));
        let counts = receiver.counts().unwrap();
        let mut engine = LocalEngine::new(b0, b1, Stream::DEFAULT);
        let out = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req).unwrap();
        assert_eq!(out.blocks.len(), n);
        assert_eq!(out.context_len, req.context_len);
        assert_ne!(out.slot.handle, other.handle);
        assert_eq!(receiver.slot_position(out.slot.handle).unwrap(), out.slot.position);
        // Blocks in table order, every plane and indexer layer.
        for (a, b) in req.blocks.iter().zip(&out.blocks) {
            receiver.check_block(*b).unwrap();
            assert_eq!(
                read(&receiver, &block_ranges(&receiver, b.id)),
                read(&sender, &block_ranges(&sender, a.id))
            );
        }
        let sp = sender.slot_position(req.slot).unwrap();
        assert_eq!(
            read(&receiver, &slot_ranges(&receiver, out.slot.position)),
            read(&sender, &slot_ranges(&sender, sp))
        );
        assert_eq!(
            read(&receiver, &window_ranges(&receiver, out.slot.position)),
            read(&sender, &window_ranges(&sender, sp))
        );
        // Nothing else on the receiver changed: rebuild the expected image from `before`.
        let all = all_ranges(&receiver);
        let mut want = before.clone();
        let mut written: Vec<(u64, u64)> = slot_ranges(&receiver, out.slot.position);
        for b in &out.blocks {
            written.extend(block_ranges(&receiver, b.id));
        }
        let after = read(&receiver, &all);
        for (addr, len) in written {
            let mut at = 0usize;
            for &(base, n) in &all {
                if (base..base + n).contains(&addr) {
                    let o = at + (addr - base) as usize;
                    want[o..o + len as usize].copy_from_slice(&after[o..o + len as usize]);
                }
                at += n as usize;
            }
        }
        assert!(want == after, "{name}: receiver bytes outside the request changed (n={n})");
        // Coalescing: one span per run of consecutive (sender, receiver) id pairs in every
        // plane and indexer layer, plus the slot in every plane.
        let pairs: Vec<(u32, u32)> = req.blocks.iter().zip(&out.blocks).map(|(a, b)| (a.id, b.id)).collect();
        let runs = paired_runs(&pairs);
        let parts = receiver.num_planes() + receiver.spec().csa_layers.len();
        assert_eq!(out.spans, runs * parts + receiver.num_planes(), "{name}: n={n} pairs {pairs:?}");
        let c = receiver.counts().unwrap();
        assert_eq!((c.free_blocks, c.free_slots), (counts.free_blocks - n as u32, counts.free_slots - 1));
        println!("{name}: {n} blocks in {} spans ({runs} id runs), {} bytes", out.spans, out.bytes);
    }
}

#[test]
fn handoff_is_byte_exact_on_one_backend() {
    handoff_case("handoff_one_backend", true);
}

#[test]
fn handoff_is_byte_exact_in_flashmla_v4_paged_rows() {
    // Blocks and slots are whole 64-row pages in FlashMLA's 584-B format: the same spans move
    // them byte-exact (docs/flashmla.md).
    handoff_case_kv("handoff-flashmla-v4", false, v4pool::sizing::KvDtype::FlashMlaV4);
    // Pages of 2: blocks and slots are whole 2-row pages.
    handoff_case_kv("handoff-flashmla-v4-p2", false, v4pool::sizing::KvDtype::FlashMlaV4P2);
}

#[test]
fn handoff_is_byte_exact_in_the_packed_v41_layout() {
    // V4.1's 288-B compressed rows packed beside 528-B windows: blocks and slots are whole
    // plane rows, so the spans are the same as in any pool.
    let model = ModelShape::v41_flash(0).unwrap();
    handoff_case_model("handoff-v41-packed", false, &model, v4pool::sizing::KvDtype::FlashMlaV41Fp4);
}

#[test]
fn handoff_is_byte_exact_between_two_backends() {
    handoff_case("handoff_two_backends", false);
}

fn assert_nothing_new(pool: &Pool, before: v4pool::pool::PoolCounts) {
    let c = pool.counts().unwrap();
    assert_eq!(
        (c.free_blocks, c.free_slots, c.num_blocks, c.num_slots),
        (before.free_blocks, before.free_slots, before.num_blocks, before.num_slots)
    );
}

#[test]
fn mismatched_layouts_are_refused_before_any_byte_moves() {
    let mut rng = Rng::new(case_seed("mismatch", 0));
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let (flash, flash_id) = v4_pool(b.clone(), &ModelShape::v4_flash(1).unwrap(), 8, 2);
    let (flash0, flash0_id) = v4_pool(b.clone(), &ModelShape::v4_flash(0).unwrap(), 8, 2);
    assert_ne!(flash_id, flash0_id, "MTP changes the ring, so the layout id");
    let req = request(&flash, 2, &mut rng);
    poison(&flash0, &mut rng);
    let snapshot = read(&flash0, &all_ranges(&flash0));
    let counts = flash0.counts().unwrap();
    let mut engine = LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT);
    let err = handoff(&mut engine, &Endpoint::new(&flash), &Endpoint::new(&flash0), &req).unwrap_err();
    match err {
        HandoffError::LayoutMismatch { sender, receiver } => {
            assert_eq!((sender, receiver), (flash_id.clone(), flash0_id.clone()))
        }
        e => panic!("expected LayoutMismatch, got {e}"),
    }
    assert_nothing_new(&flash0, counts);
    assert!(read(&flash0, &all_ranges(&flash0)) == snapshot);
    // An endpoint speaks for its pool's own layout id: no caller string can stand in.
    assert_eq!(Endpoint::new(&flash).layout_id(), flash.layout_id().as_str());
    assert_eq!(Endpoint::new(&flash0).layout_id(), flash0_id);
    // A peer claiming this side's id for a different carve (a forged hello): the shapes are
    // compared too.
    let mut forged: serde_json::Value = serde_json::from_slice(&Endpoint::new(&flash0).hello()).unwrap();
    forged["layout_id"] = serde_json::Value::String(flash_id.clone());
    let forged = serde_json::to_vec(&forged).unwrap();
    let err = Endpoint::new(&flash).check_peer(&forged, true).unwrap_err();
    assert!(matches!(err, HandoffError::ShapeMismatch { .. }), "{err}");
    assert_nothing_new(&flash0, counts);
    assert!(read(&flash0, &all_ranges(&flash0)) == snapshot);
}

#[test]
fn a_receiver_without_room_holds_nothing_afterwards() {
    let mut rng = Rng::new(case_seed("no_room", 0));
    let model = ModelShape::v4_flash(1).unwrap();
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let (sender, _) = v4_pool(b.clone(), &model, 12, 2);
    let (receiver, _) = v4_pool(b.clone(), &model, 4, 2);
    let req = request(&sender, 6, &mut rng);
    let counts = receiver.counts().unwrap();
    let mut engine = LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT);
    let err = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req).unwrap_err();
    assert!(matches!(err, HandoffError::NoRoom { blocks: 6, .. }), "{err}");
    assert_nothing_new(&receiver, counts);
    // No free slot: refused the same way.
    let small = request(&sender, 1, &mut rng);
    let s1 = receiver.alloc_slot().unwrap();
    let s2 = receiver.alloc_slot().unwrap();
    let counts = receiver.counts().unwrap();
    let err = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &small).unwrap_err();
    assert!(matches!(err, HandoffError::NoRoom { .. }), "{err}");
    assert_nothing_new(&receiver, counts);
    receiver.free_slot(s1.handle).unwrap();
    receiver.free_slot(s2.handle).unwrap();
    // A stale sender handle is the sender's error, checked before the receiver allocates.
    let mut stale = small.clone();
    sender.free_block(stale.blocks[0]).unwrap();
    stale.blocks[0] = BlockHandle { generation: stale.blocks[0].generation, ..stale.blocks[0] };
    let counts = receiver.counts().unwrap();
    let err = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &stale).unwrap_err();
    assert!(matches!(err, HandoffError::Request(_)), "{err}");
    assert_nothing_new(&receiver, counts);
}

/// An engine whose transfer fails after writing part of it: the receiver must release what
/// it reserved. Also shows the trait is implementable outside the crate.
struct FailingEngine(LocalEngine);

impl TransferEngine for FailingEngine {
    fn name(&self) -> &'static str {
        "failing"
    }
    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError> {
        // SAFETY: forwarded with the caller's promise.
        unsafe { self.0.register(side, region) }
    }
    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError> {
        self.0.deregister(id)
    }
    fn exchange(&mut self, a: &[u8], b: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        self.0.exchange(a, b)
    }
    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError> {
        self.0.post(&spans[..spans.len() / 2])?;
        Err(EngineError::Nccl { call: "post", message: "link down".into() })
    }
    fn poll(&mut self, t: TransferTicket) -> Result<bool, EngineError> {
        self.0.poll(t)
    }
}

#[test]
fn a_failed_transfer_releases_the_reservation() {
    let mut rng = Rng::new(case_seed("failed_transfer", 0));
    let model = ModelShape::v4_flash(1).unwrap();
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let (sender, _) = v4_pool(b.clone(), &model, 8, 2);
    let (receiver, _) = v4_pool(b.clone(), &model, 8, 2);
    let req = request(&sender, 4, &mut rng);
    let counts = receiver.counts().unwrap();
    let mut engine = FailingEngine(LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT));
    let err = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req).unwrap_err();
    assert!(matches!(err, HandoffError::Engine(EngineError::Nccl { .. })), "{err}");
    assert_nothing_new(&receiver, counts);
    // The sender still holds its request, untouched: a retry succeeds.
    let mut engine = LocalEngine::new(b.clone(), b, Stream::DEFAULT);
    let out = handoff(&mut engine, &Endpoint::new(&sender), &Endpoint::new(&receiver), &req).unwrap();
    assert_eq!(out.blocks.len(), 4);
}

#[test]
fn exported_regions_name_the_pools_own_memory() {
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let (pool, _) = v4_pool(b, &ModelShape::v4_flash(1).unwrap(), 6, 2);
    let on = v4pool::transfer::TransferConfig::new(true, 1);
    let regions = v4pool::transfer::exported_regions(&pool, &on).unwrap();
    let g = pool.geometry().unwrap();
    let n_csa = pool.spec().csa_layers.len();
    assert_eq!(regions.len(), 2 + n_csa + 2);
    for p in 0..2 {
        let (role, r) = &regions[p];
        assert_eq!(role, v4pool::transfer::PLANE_ROLES[p]);
        assert_eq!(r.addr, pool.plane_ptr(p).unwrap());
        assert_eq!((r.len, r.item_len), (6 * r.item_len, g.block_bytes(pool.spec().plane_widths[p])));
        // Slot region: the lowest live slot's start, whole slots as items.
        let (_, s) = &regions[2 + n_csa + p];
        let low = g.slot_span(g.physical_slot(1).unwrap()).unwrap().0 as u64;
        assert_eq!(s.addr, pool.plane_ptr(p).unwrap() + low * pool.spec().plane_widths[p]);
        assert_eq!((s.len, s.item_len), (2 * s.item_len, g.slot_bytes(pool.spec().plane_widths[p])));
    }
    let (_, ix) = &regions[2 + n_csa - 1];
    let pb = ix.item_len;
    assert_eq!(ix.addr, pool.indexer_ptr().unwrap() + (n_csa as u64 - 1) * pool.indexer_blocks() * pb);
}

/// A live request in the model: where it is and what its blocks and slot must hold.
struct Held {
    req: RequestKv,
    bytes: Vec<u8>,
}

fn held_bytes(pool: &Pool, req: &RequestKv) -> Vec<u8> {
    let mut r = Vec::new();
    for b in &req.blocks {
        r.extend(block_ranges(pool, b.id));
    }
    r.extend(slot_ranges(pool, pool.slot_position(req.slot).unwrap()));
    read(pool, &r)
}

/// Random sequences of new requests and handoffs back and forth between two pools (the
/// sender frees what it handed off): after every step every live request on either pool
/// holds exactly its bytes, and refused handoffs change no count.
fn ping_pong(steps: Vec<(usize, bool, u64)>) {
    let model = ModelShape::v4_flash(1).unwrap();
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let (p0, _) = v4_pool(b.clone(), &model, 8, 2);
    let (p1, _) = v4_pool(b.clone(), &model, 6, 2);
    let pools = [&p0, &p1];
    let mut live: [Vec<Held>; 2] = [Vec::new(), Vec::new()];
    let mut engine = LocalEngine::new(b.clone(), b, Stream::DEFAULT);
    for (n, from_one, seed) in steps {
        let from = usize::from(from_one);
        let (s, r) = (pools[from], pools[1 - from]);
        let mut rng = Rng::new(seed);
        if live[from].is_empty() || seed % 3 == 0 {
            // A new request on the sender, if it has room.
            let c = s.counts().unwrap();
            if c.free_slots > 0 && c.free_blocks as usize >= n {
                let req = request(s, n, &mut rng);
                let bytes = held_bytes(s, &req);
                live[from].push(Held { req, bytes });
            }
            continue;
        }
        let i = (seed as usize / 3) % live[from].len();
        let before = r.counts().unwrap();
        match handoff(&mut engine, &Endpoint::new(s), &Endpoint::new(r), &live[from][i].req) {
            Ok(out) => {
                let h = live[from].swap_remove(i);
                for blk in &h.req.blocks {
                    s.free_block(*blk).unwrap();
                }
                s.free_slot(h.req.slot).unwrap();
                let req =
                    RequestKv { blocks: out.blocks, slot: out.slot.handle, context_len: out.context_len };
                live[1 - from].push(Held { req, bytes: h.bytes });
            }
            Err(HandoffError::NoRoom { .. }) => assert_nothing_new(r, before),
            Err(e) => panic!("{e}"),
        }
        for (p, held) in pools.iter().zip(&live) {
            for h in held {
                assert!(held_bytes(p, &h.req) == h.bytes, "a live request's bytes changed");
            }
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]
    #[test]
    fn handoffs_back_and_forth_lose_nothing(
        steps in proptest::collection::vec((0usize..5, proptest::bool::ANY, proptest::prelude::any::<u64>()), 1..14)
    ) {
        ping_pong(steps);
    }
}
