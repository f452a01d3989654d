//! One whole decode step's pool-side work (docs/forward.md, "Decode step"), shared by the step
//! tests (`tests/kernels/step_batch.rs`, `tests/gpu/gpu_step_batch.rs`) and the step bench
//! (`benches/step.rs`, which includes this file by path): the decode builder, then per trunk
//! layer in the model's order the token's own rows, the emitted compressed rows, the index keys
//! and the compressor-state updates, and the translate-pack, as launches on one pool, with
//! random inputs in the pool's backend memory. Three orders of the same launches:
//!
//! * [`Order::PerLayer`]: one launch per write, as the per-layer API queues them;
//! * [`Order::Fused`]: one `v4pool_write_batch` per layer for every write of the layer (the
//!   state updates included: the layer's compressors read its ring before this launch);
//! * [`Order::StateAtEnd`]: one batch per layer for its row and key writes, and every layer's
//!   state update in one batch after the last layer.
//!
//! A [`StepData`] (host bytes: the batch, its block tables, every input) is made once and
//! uploaded into a [`StepRig`] per pool, so a device pool and a host-backend pool run the same
//! calls on the same bytes.
#![allow(dead_code)]

use std::sync::Arc;
use v4pool::backend::{Backend, DeviceAllocation, Stream};
use v4pool::geometry::{Class, DENSE_RATIO};
use v4pool::pool::BlockHandle;
use v4pool::pool::{
    decode_slice_lens, CompressedRow, DecodeCapacity, DecodePath, DecodeSeq, FlashMlaWidths, KvRowWriter,
    Pool, RowSet, RowWriteCapacity, SlotLease, WriteBatch,
};
use v4pool::raw::index::shape::flashmla_row_limit;
use v4pool::raw::index::{CopyRun, DevicePtr, ElemType, Launch};
use v4pool::sim::Rng;
use v4pool::state::update::{Compressor, StateInputs, StateSeq, StateUpdate, StateUpdateCapacity};

/// The window every V4 model attends (`sliding_window`).
pub const WIN: i32 = 128;
/// bf16 values of one KV row the model hands over.
const KV: usize = 512;
/// bf16 values of one indexer key.
const KEY: usize = 128;

/// Which grouping of the step's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// One launch per write (the per-layer API).
    PerLayer,
    /// One batch per layer holding all its writes.
    Fused,
    /// One batch per layer for its row and key writes; all state updates in one at the end.
    StateAtEnd,
}

impl Order {
    /// Every order.
    pub const ALL: [Order; 3] = [Order::PerLayer, Order::Fused, Order::StateAtEnd];
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Order::PerLayer => "per-layer",
            Order::Fused => "fused",
            Order::StateAtEnd => "state-at-end",
        }
    }
}

/// The kind of a launch of the per-layer order, for the per-kind table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// The decode builder.
    Build,
    /// A layer's own rows.
    Own,
    /// A layer's emitted compressed rows.
    Emitted,
    /// A CSA layer's index keys.
    Keys,
    /// A compressor-state update.
    State,
    /// A translate-pack.
    Pack,
    /// A write batch (fused orders).
    Batch,
}

impl Kind {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Build => "decode builder",
            Kind::Own => "own rows (kv_rows)",
            Kind::Emitted => "emitted rows (kv_rows)",
            Kind::Keys => "index keys",
            Kind::State => "state update",
            Kind::Pack => "translate-pack",
            Kind::Batch => "write batch",
        }
    }
}

/// One compressor-state launch's engine inputs: which compressor (V4) or owner (V4.1), its
/// layer ordinal and its input offset in [`StepData::f32s`].
#[derive(Clone, Copy, Debug)]
struct StateCall {
    compressor: Option<Compressor>,
    ordinal: u64,
    dim: usize,
    ratio: usize,
}

/// The per-layer writes of one trunk layer.
#[derive(Clone, Debug, Default)]
struct LayerPlan {
    layer: usize,
    /// The layer's compress ratio.
    ratio: i64,
    /// Compressed class whose emitted rows this layer writes (V4 CSA or HCA layers).
    emits: Option<Class>,
    /// CSA rank whose index keys this layer writes.
    keys: Option<usize>,
    states: Vec<StateCall>,
    /// Whether the layer is packed (V4: CSA layers; V4.1: every compressed layer).
    pack: bool,
}

/// Host-side description of one decode step of one model on pools of one spec: the batch,
/// block tables (the last two columns of each are allocated blocks, filled in by the rig),
/// emitted entries, and the engine's inputs (random bytes shared by all rigs).
pub struct StepData {
    pub batch: usize,
    pub tps: usize,
    pub ctx: Vec<i64>,
    /// Block ids of every column but the last two (the rig's own blocks go there).
    pub tables: Vec<Vec<i32>>,
    pub index_topk: usize,
    v41: bool,
    layers: Vec<LayerPlan>,
    /// Random words (bf16 pairs or f32, every one finite) the inputs are windows of.
    words: Vec<u32>,
    /// Per packed layer, i32 `[T][index_topk]` top-k rows.
    topk: Vec<Vec<i32>>,
    /// Build the decode path in FlashMLA's convention (`Pool::flashmla_decode_path`, the
    /// narrowest widths for the step): the builder and the packs write FlashMLA's operands.
    pub flashmla_path: bool,
}

/// Tokens of a batch: each sequence's `tps` positions `ctx - tps ..`, with its sequence.
pub fn tokens(ctx: &[i64], tps: usize) -> Vec<(usize, i64)> {
    ctx.iter().enumerate().flat_map(|(b, &c)| (0..tps as i64).map(move |k| (b, c - tps as i64 + k))).collect()
}

impl StepData {
    /// A step of `batch` sequences of `tps` tokens at contexts `ctx` on pools of `pool`'s
    /// spec (the pool gives the geometry and the arena's state fields); `seed` draws the
    /// block tables, inputs and top-k.
    pub fn new(
        pool: &Pool,
        trunk: usize,
        tps: usize,
        ctx: Vec<i64>,
        index_topk: usize,
        seed: u64,
    ) -> StepData {
        let g = &pool.spec().geometry;
        let batch = ctx.len();
        let mut rng = Rng::new(seed);
        let tables = ctx
            .iter()
            .map(|&c| {
                let n = ((c + g.block_size - 1) / g.block_size) as usize;
                (0..n).map(|_| rng.below(g.num_blocks as u64) as i32).collect()
            })
            .collect();
        let v41 = g.kv_sources.as_ref().is_some_and(|s| !s.is_empty());
        let layers = layer_plans(pool, trunk, v41);
        let t = batch * tps;
        let need = layers.iter().map(|l| input_words(l, t)).max().unwrap_or(0).max(1 << 16);
        // Twice the largest input, so the windows of different layers differ.
        let words: Vec<u32> = (0..2 * need).map(|_| (rng.next_u64() as u32) & 0xbfff_bfff).collect();
        let toks = tokens(&ctx, tps);
        let topk = layers
            .iter()
            .filter(|l| l.pack)
            .map(|l| {
                let ratio = i64::from(g.ratios[l.layer]);
                let mut v = vec![-1i32; t * index_topk];
                for (i, &(_, p)) in toks.iter().enumerate() {
                    let visible = (p + 1) / ratio;
                    for k in 0..(visible as usize).min(index_topk) {
                        v[i * index_topk + k] = rng.below(visible as u64) as i32;
                    }
                }
                v
            })
            .collect();
        StepData { batch, tps, ctx, tables, index_topk, v41, layers, words, topk, flashmla_path: false }
    }

    /// Tokens of the step.
    pub fn tokens(&self) -> Vec<(usize, i64)> {
        tokens(&self.ctx, self.tps)
    }
    /// Trunk layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Whether the model is V4.1 (owners' state, layer packs, no emitted rows here).
    pub fn is_v41(&self) -> bool {
        self.v41
    }
}

/// Words of the random source a layer's inputs take at most.
fn input_words(l: &LayerPlan, t: usize) -> usize {
    let kv = t * KV / 2;
    let state = l.states.iter().map(|s| t * s.dim).max().unwrap_or(0);
    kv.max(state)
}

/// The trunk layers' writes, in the model's order.
fn layer_plans(pool: &Pool, trunk: usize, v41: bool) -> Vec<LayerPlan> {
    let g = &pool.spec().geometry;
    let mut csa = 0u64;
    let mut hca = 0u64;
    let owners: Vec<usize> = g.kv_sources.clone().unwrap_or_default();
    let dim = |field: &str| pool.state_view(field).map(|(_, v)| v.dims[3] as usize).unwrap_or(0);
    (0..trunk)
        .map(|layer| {
            let ratio = g.ratios[layer];
            let mut l = LayerPlan { layer, ratio: i64::from(ratio), ..Default::default() };
            if v41 {
                l.pack = ratio != DENSE_RATIO;
                if let Some(o) = owners.iter().position(|&s| s == layer) {
                    let d = dim(v4pool::raw::arena::V41_COMPRESS_KV);
                    l.states.push(StateCall {
                        compressor: None,
                        ordinal: o as u64,
                        dim: d,
                        ratio: ratio as usize,
                    });
                }
                return l;
            }
            let call = |c: Compressor, ordinal: u64| StateCall {
                compressor: Some(c),
                ordinal,
                dim: dim(c.fields().0),
                ratio: c.ratio() as usize,
            };
            if ratio == Class::Csa.ratio() {
                l.emits = Some(Class::Csa);
                l.keys = Some(csa as usize);
                l.states = vec![call(Compressor::CsaMain, csa), call(Compressor::CsaIdx, csa)];
                l.pack = true;
                csa += 1;
            } else if ratio == Class::Hca.ratio() {
                l.emits = Some(Class::Hca);
                l.states = vec![call(Compressor::HcaMain, hca)];
                hca += 1;
            }
            l
        })
        .collect()
}

/// One launch of a step, with its kind and (for writes) the layer it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct StepLaunch {
    pub kind: Kind,
    pub launch: Launch,
}

/// One pool's buffers, handles and inputs for a [`StepData`]: the decode path, three row
/// writers (own rows; CSA entries; HCA entries), the state update, and the write batches of
/// the fused orders.
pub struct StepRig {
    pub pool: Arc<Pool>,
    pub path: DecodePath,
    own: KvRowWriter,
    csa_w: KvRowWriter,
    hca_w: KvRowWriter,
    pub state: StateUpdate,
    inputs: Vec<DeviceAllocation>,
    fused: Vec<WriteBatch>,
    at_end: Vec<WriteBatch>,
    /// The block tables staged (the data's, with the rig's blocks in the last two columns).
    pub tables: Vec<Vec<i32>>,
    /// Each sequence's slot position.
    pub positions: Vec<i64>,
    /// Emitted entries per class (CSA, HCA): (block id, row in block).
    pub entries: [Vec<(u32, i64)>; 2],
    per_layer: Vec<Vec<StepLaunch>>,
    build: Launch,
}

/// What a rig takes from its pool: slots and blocks for the largest batch, held for its life.
pub struct Holdings {
    pub slots: Vec<SlotLease>,
    pub blocks: Vec<BlockHandle>,
}

impl Holdings {
    /// `seqs` slots and two blocks per sequence.
    pub fn take(pool: &Pool, seqs: usize) -> Holdings {
        let slots = (0..seqs).map(|_| pool.alloc_slot().expect("slot")).collect();
        let blocks = (0..2 * seqs).map(|_| pool.alloc_block().expect("block").handle).collect();
        Holdings { slots, blocks }
    }
}

/// The engine's inputs of one rig: allocations on its backend holding windows of the data's
/// random words.
struct Inputs<'a> {
    be: Arc<dyn Backend>,
    words: &'a [u32],
    made: Vec<DeviceAllocation>,
}

impl Inputs<'_> {
    /// A new allocation holding `bytes`.
    fn bytes(&mut self, bytes: &[u8]) -> DevicePtr {
        let a = self.be.alloc_zeroed((bytes.len() as u64).max(256)).expect("input allocation");
        // SAFETY: the allocation was just made with at least these bytes.
        unsafe { self.be.upload(a.ptr, bytes, Stream::DEFAULT).expect("upload") };
        let ptr = a.ptr;
        self.made.push(a);
        ptr
    }

    /// A new allocation holding `n` random words, from a window that moves with every input
    /// (so no two inputs hold the same bytes).
    fn window(&mut self, n: usize) -> DevicePtr {
        let words = self.words;
        let start = (self.made.len() * 7_919) % (words.len() - n.min(words.len()) + 1);
        self.bytes(bytemuck::cast_slice(&words[start..start + n]))
    }
}

impl StepRig {
    /// Stage `data` on `pool` with the slots and blocks of `held`, upload its inputs, and make
    /// every launch of the three orders (the fused orders' tables uploaded too).
    pub fn new(pool: &Arc<Pool>, held: &Holdings, data: &StepData) -> StepRig {
        let be = pool.backend().clone();
        let g = pool.spec().geometry.clone();
        let (batch, tps) = (data.batch, data.tps);
        let t = batch * tps;
        let positions: Vec<i64> = held.slots[..batch].iter().map(|s| s.position).collect();
        let mut tables = data.tables.clone();
        for (b, table) in tables.iter_mut().enumerate() {
            let n = table.len();
            for (k, col) in (n.saturating_sub(2)..n).enumerate() {
                table[col] = held.blocks[2 * b + k].id as i32;
            }
        }
        let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(1);
        let cap = DecodeCapacity::new(batch, t, max_blocks, WIN, data.index_topk as i32);
        let mut path = if data.flashmla_path {
            let widths = FlashMlaWidths::for_capacity(&g, cap).expect("FlashMLA widths");
            pool.flashmla_decode_path(cap, widths).expect("FlashMLA decode path")
        } else {
            pool.decode_path(cap).expect("decode path")
        };
        // Every FlashMLA operand starts poisoned, the same on every pool: what the builder
        // and the packs leave unwritten (past an HCA row's limit) stays the poison, which
        // `path_outputs` checks and compares like any byte.
        poison_flashmla_operands(&path);
        let seqs: Vec<DecodeSeq<'_>> =
            (0..batch).map(|b| DecodeSeq::new(positions[b], data.ctx[b], tps, &tables[b])).collect();
        path.stage(&seqs).expect("stage the decode batch");
        let wcap = RowWriteCapacity::new(t);
        let own = pool.kv_row_writer(wcap).expect("writer");
        let mut csa_w = pool.kv_row_writer(wcap).expect("writer");
        let mut hca_w = pool.kv_row_writer(wcap).expect("writer");
        // Entries closing at each token: CSA (p + 1) % 4 == 0, HCA (p + 1) % 128 == 0.
        let toks = data.tokens();
        let mut entries: [Vec<(u32, i64)>; 2] = [Vec::new(), Vec::new()];
        if !data.v41 {
            for (i, class) in [Class::Csa, Class::Hca].into_iter().enumerate() {
                let ratio = i64::from(class.ratio());
                let per_block = g.block_size / ratio;
                let mut rows = Vec::new();
                for &(b, p) in &toks {
                    if (p + 1) % ratio != 0 {
                        continue;
                    }
                    let e = (p + 1) / ratio - 1;
                    let col = (e / per_block) as usize;
                    let id = tables[b][col];
                    let handle = held.blocks[2 * b..2 * b + 2]
                        .iter()
                        .find(|h| h.id as i32 == id)
                        .copied()
                        .expect("an emitted entry lies in one of the sequence's own blocks");
                    rows.push(CompressedRow { block: handle, row: e % per_block });
                    entries[i].push((handle.id, e % per_block));
                }
                let w = if class == Class::Csa { &mut csa_w } else { &mut hca_w };
                w.stage_compressed(class, &rows).expect("stage entries");
            }
        }
        let scap = StateUpdateCapacity::new(batch, t);
        let mut state = pool.state_update(scap).expect("state update");
        let pos_lists: Vec<Vec<i64>> = data.ctx.iter().map(|&c| (c - tps as i64..c).collect()).collect();
        let sseqs: Vec<StateSeq<'_>> = (0..batch)
            .map(|b| StateSeq::new(held.slots[b].handle, b * tps, &pos_lists[b], data.ctx[b]))
            .collect();
        state.stage(&sseqs).expect("stage the state plan");

        // Inputs: windows of the random words, a different one per input.
        let mut inputs = Inputs { be: be.clone(), words: &data.words, made: Vec::new() };
        let mut per_layer = Vec::new();
        let mut packs = data.topk.iter();
        for l in &data.layers {
            let mut out = Vec::new();
            let kv = inputs.window(t * KV / 2);
            let own_l = own.write_decode_launch(&path, l.layer, kv, KV).expect("own rows launch");
            out.push(StepLaunch { kind: Kind::Own, launch: own_l });
            if let Some(class) = l.emits {
                let w = if class == Class::Csa { &csa_w } else { &hca_w };
                let n = entries[usize::from(class == Class::Hca)].len().max(1);
                let src = inputs.window(n * KV / 2);
                let launch = w.write_launch(l.layer, RowSet::Compressed(class), src, KV).expect("emitted");
                out.push(StepLaunch { kind: Kind::Emitted, launch });
            }
            if let Some(rank) = l.keys {
                let n = entries[0].len().max(1);
                let keys = inputs.window(n * KEY / 2);
                let launch = csa_w.index_keys_launch(rank, keys, KEY).expect("index keys");
                out.push(StepLaunch { kind: Kind::Keys, launch });
            }
            for s in &l.states {
                let kv = inputs.window(t * s.dim);
                let score = inputs.window(t * s.dim);
                let ape = inputs.window(s.ratio * s.dim);
                let si = StateInputs::default()
                    .with_kv(kv)
                    .with_score(score)
                    .with_ape(ape)
                    .with_kv_row_stride(s.dim as i64)
                    .with_score_row_stride(s.dim as i64)
                    .with_rows(t as i64)
                    .with_dim(s.dim as i64)
                    .with_dtype(ElemType::F32)
                    .with_ape_dtype(ElemType::F32);
                let launch = match s.compressor {
                    Some(c) => state.launch(c, s.ordinal, &si),
                    None => state.owner_launch(s.ordinal, &si),
                }
                .expect("state launch");
                out.push(StepLaunch { kind: Kind::State, launch });
            }
            if l.pack {
                let topk = packs.next().expect("a top-k per packed layer");
                let a = inputs.bytes(bytemuck::cast_slice(topk));
                let k = data.index_topk as i32;
                let launch =
                    if data.v41 { path.layer_pack_launch(l.layer, a, k) } else { path.csa_pack_launch(a, k) }
                        .expect("pack launch");
                out.push(StepLaunch { kind: Kind::Pack, launch });
            }
            per_layer.push(out);
        }
        let build = path.build_launch();
        let mut rig = StepRig {
            pool: Arc::clone(pool),
            path,
            own,
            csa_w,
            hca_w,
            state,
            inputs: inputs.made,
            fused: Vec::new(),
            at_end: Vec::new(),
            tables,
            positions,
            entries,
            per_layer,
            build,
        };
        rig.make_batches();
        rig
    }

    /// The write batches of the two fused orders: one table per layer for each, and the
    /// state-at-end order's table of every state update (the tables are set by `launches`).
    fn make_batches(&mut self) {
        for l in &self.per_layer {
            let writes = l.iter().filter(|s| s.kind != Kind::Pack).count();
            let rows = l.iter().filter(|s| s.kind != Kind::Pack && s.kind != Kind::State).count();
            self.fused.push(self.pool.write_batch(writes.max(1)).expect("write batch"));
            self.at_end.push(self.pool.write_batch(rows.max(1)).expect("write batch"));
        }
        let states = self.per_layer.iter().flatten().filter(|s| s.kind == Kind::State).count();
        if states > 0 {
            self.at_end.push(self.pool.write_batch(states).expect("state batch"));
        }
    }

    /// The step's launches in `order` (the builder first).
    pub fn launches(&mut self, order: Order) -> Vec<StepLaunch> {
        self.launches_of(order, |_| true)
    }

    /// The step's launches in `order` made of the launches of the kinds `keep` takes only (the
    /// step bench's ablation: which part of a node costs what). The written bytes are the
    /// whole step's only when `keep` takes every kind.
    pub fn launches_of(&mut self, order: Order, keep: impl Fn(Kind) -> bool) -> Vec<StepLaunch> {
        let mut out = Vec::new();
        if keep(Kind::Build) {
            out.push(StepLaunch { kind: Kind::Build, launch: self.build });
        }
        let pack = |l: &[StepLaunch]| l.iter().find(|s| s.kind == Kind::Pack && keep(Kind::Pack)).copied();
        for (i, l) in self.per_layer.iter().enumerate() {
            match order {
                Order::PerLayer => out.extend(l.iter().filter(|s| keep(s.kind)).copied()),
                Order::Fused | Order::StateAtEnd => {
                    let state = order == Order::Fused;
                    let writes: Vec<StepLaunch> = l
                        .iter()
                        .filter(|s| s.kind != Kind::Pack && (state || s.kind != Kind::State) && keep(s.kind))
                        .copied()
                        .collect();
                    if writes.is_empty() {
                        // nothing of this layer's writes kept
                    } else if writes.len() == 1 {
                        out.push(writes[0]); // one write alone: its own kernel, no table
                    } else {
                        let list = if state { &mut self.fused } else { &mut self.at_end };
                        let launches: Vec<Launch> = writes.iter().map(|s| s.launch).collect();
                        let launch = list[i].set(&launches).expect("batch");
                        out.push(StepLaunch { kind: Kind::Batch, launch });
                    }
                    out.extend(pack(l));
                }
            }
        }
        if order == Order::StateAtEnd && self.at_end.len() > self.per_layer.len() && keep(Kind::State) {
            let states: Vec<Launch> =
                self.per_layer.iter().flatten().filter(|s| s.kind == Kind::State).map(|s| s.launch).collect();
            let last = self.at_end.last_mut().expect("state batch");
            out.push(StepLaunch { kind: Kind::Batch, launch: last.set(&states).expect("state batch") });
        }
        out
    }

    /// Queue `launches` on the pool's backend, stream `stream`.
    ///
    /// # Safety
    /// The launches are this rig's own (its buffers, its pool's views), made for its staged
    /// batch.
    pub unsafe fn queue(&self, launches: &[StepLaunch], stream: Stream) {
        for l in launches {
            // SAFETY: the caller's promise: every pointer is one of the rig's buffers or its
            // pool's views, sized by the handles that made the launch.
            unsafe { self.pool.backend().launch(&l.launch, stream).expect("launch") };
        }
    }

    /// The byte runs (absolute addresses in the pool) the step writes into the pool: every
    /// token's own row per layer and plane, every emitted entry per layer and plane, every
    /// CSA entry's index key (FP8 data and scale), every state row of the plans. From the
    /// geometry and the arena, not from any kernel's output.
    pub fn written_runs(&self, data: &StepData) -> Vec<CopyRun> {
        let pool = &self.pool;
        let spec = pool.spec();
        let g = &spec.geometry;
        let mut runs = Vec::new();
        // A row's bytes: one span of a uniform plane; of a paged plane (FlashMLA's 584-B rows)
        // its data and scale spans inside the page, through the layer's page view.
        let row_runs = |layer: usize, row: i64, runs: &mut Vec<CopyRun>| {
            for plane in 0..pool.num_planes() {
                let v = pool.layer_view(layer, plane).expect("view");
                let fmt = spec.plane_format(plane).expect("the pool's plane");
                if fmt.page_rows <= 1 {
                    runs.push(CopyRun { src: v.ptr + row as u64 * v.row_bytes, dst: 0, bytes: v.row_bytes });
                    continue;
                }
                let pv = pool.page_view(layer, plane, fmt.page_rows as i64).expect("page view");
                for (off, len) in fmt.row_spans((row + pv.row_shift) as u64, 1).expect("row spans") {
                    runs.push(CopyRun { src: pv.ptr + off, dst: 0, bytes: len });
                }
            }
        };
        let toks = data.tokens();
        for l in &data.layers {
            for &(b, p) in &toks {
                let row = g.window_index(l.layer, self.positions[b], p % g.ring_slots).expect("window row");
                row_runs(l.layer, row, &mut runs);
            }
            if let Some(class) = l.emits {
                for &(block, r) in &self.entries[usize::from(class == Class::Hca)] {
                    let row = g.compress_index(l.layer, i64::from(block), r).expect("compressed row");
                    if g.packed_rows.is_some() {
                        // Packed: a row of the compressed view, at its own width.
                        let v = pool.compressed_view(l.layer).expect("compressed view");
                        runs.push(CopyRun {
                            src: v.ptr + row as u64 * v.row_bytes,
                            dst: 0,
                            bytes: v.row_bytes,
                        });
                    } else {
                        row_runs(l.layer, row, &mut runs);
                    }
                }
            }
            if let Some(rank) = l.keys {
                let v = pool.indexer_view(rank, 0).expect("indexer view");
                let rows = v.rows_per_block;
                for &(block, r) in &self.entries[0] {
                    let blk = v.ptr + u64::from(block) * rows * v.row_bytes;
                    match v.row_bytes {
                        132 => {
                            runs.push(CopyRun { src: blk + r as u64 * 128, dst: 0, bytes: 128 });
                            runs.push(CopyRun { src: blk + rows * 128 + r as u64 * 4, dst: 0, bytes: 4 });
                        }
                        w => runs.push(CopyRun { src: blk + r as u64 * w, dst: 0, bytes: w }),
                    }
                }
            }
            for s in &l.states {
                let (kv, score) = match s.compressor {
                    Some(c) => c.fields(),
                    None => (v4pool::raw::arena::V41_COMPRESS_KV, v4pool::raw::arena::V41_COMPRESS_SCORE),
                };
                let plan = self.state.read_plan(plan_class(s)).expect("plan");
                for field in [kv, score] {
                    let (ptr, v) = pool.state_view(field).expect("field");
                    let ring = v.dims[2] as i64;
                    for row in plan.chunks_exact(4).filter(|r| r[2] >= 0) {
                        let at = ptr
                            + 4 * (s.ordinal * v.strides[0]
                                + row[3] as u64 * v.strides[1]
                                + (i64::from(row[2]) % ring) as u64 * v.strides[2]);
                        runs.push(CopyRun { src: at, dst: 0, bytes: 4 * s.dim as u64 });
                    }
                }
            }
        }
        runs
    }

    /// Bytes the step reads from the engine and writes into the pool and the path's buffers,
    /// in `(read, written)`: what a kernel doing this work must move at least.
    pub fn traffic(&self, data: &StepData) -> (u64, u64) {
        let t = (data.batch * data.tps) as u64;
        let row = spec_row_bytes(&self.pool);
        // A packed pool's compressed rows are narrower than its plane rows.
        let crow = self.pool.spec().geometry.packed_rows.map_or(row, |p| p.compressed as u64);
        let (mut r, mut w) = (0u64, 0u64);
        for l in &data.layers {
            r += t * 2 * KV as u64;
            w += t * row;
            if let Some(class) = l.emits {
                let n = self.entries[usize::from(class == Class::Hca)].len() as u64;
                r += n * 2 * KV as u64;
                w += n * crow;
            }
            if l.keys.is_some() {
                let n = self.entries[0].len() as u64;
                r += n * 2 * KEY as u64;
                w += n * 132;
            }
            for s in &l.states {
                let rows = self.state.staged_rows(plan_class(s)) as u64;
                r += rows * 8 * s.dim as u64 + (s.ratio * s.dim * 4) as u64;
                w += rows * 8 * s.dim as u64;
            }
        }
        if data.flashmla_path {
            // FlashMLA's window rows, the CSA extra rows and every length buffer are written
            // whole (fixed widths, -1 tails): every view's by the builder, the one CSA extra
            // buffer (rows and lengths) by every pack, so it counts once per pack. The HCA
            // compressed rows only to each row's limit (index-buffers.md §3f): per view, per
            // token, `flashmla_row_limit(head, width)` entries (a pad's: 64). The reads as on
            // the CSR path (block-table entries, top-k rows), counted below.
            let csa_extra = flashmla_buffers_of(&self.path, Class::Csa, true);
            let hca_extra = flashmla_buffers_of(&self.path, Class::Hca, false);
            let packs = data.layers.iter().filter(|l| l.pack).count() as u64;
            let topk = data.index_topk as i64;
            let heads: Vec<i64> = data
                .tokens()
                .iter()
                .map(|&(b, p)| decode_slice_lens(p, data.ctx[b], i64::from(WIN), topk).2)
                .collect();
            for b in flashmla_operands(&self.path) {
                if let Some(f) = hca_extra.iter().find(|f| f.extra_indices.is_some_and(|x| x.ptr == b.ptr)) {
                    let width = i64::from(f.extra_topk);
                    let rows = (b.len / width as u64) as usize;
                    let limits: i64 = (0..rows)
                        .map(|t| flashmla_row_limit(heads.get(t).copied().unwrap_or(0), width))
                        .sum();
                    w += limits as u64 * b.elem_bytes;
                    continue;
                }
                let times = if csa_extra.iter().any(|f| {
                    f.extra_indices.is_some_and(|x| x.ptr == b.ptr)
                        || f.extra_topk_length.is_some_and(|x| x.ptr == b.ptr)
                }) {
                    packs
                } else {
                    1
                };
                w += times * b.len * b.elem_bytes;
            }
        }
        // The builder (window tails of every class, V4's HCA heads from the tables, the
        // destination rows) and the packs (each packed layer's head: top-k read, table
        // entries read, rows written).
        let topk = data.index_topk as i64;
        for &(b, p) in &data.tokens() {
            let (n, _, hca_head) = decode_slice_lens(p, data.ctx[b], i64::from(WIN), topk);
            let hca_head = if data.v41 { 0 } else { hca_head as u64 };
            if !data.flashmla_path {
                w += 4 * (3 * n as u64 + hca_head + 3);
            }
            r += 4 * hca_head.div_ceil(2);
            for l in data.layers.iter().filter(|l| l.pack) {
                let head = ((p + 1) / l.ratio).min(topk) as u64;
                r += 8 * head;
                if !data.flashmla_path {
                    w += 4 * head;
                }
            }
        }
        (r, w)
    }
}

fn plan_class(s: &StateCall) -> Class {
    s.compressor.map_or(Class::Csa, Compressor::class)
}

fn spec_row_bytes(pool: &Pool) -> u64 {
    pool.spec().plane_widths.iter().sum()
}

impl Drop for StepRig {
    fn drop(&mut self) {
        let be = self.pool.backend().clone();
        let _ = be.synchronize(Stream::DEFAULT);
        for a in self.inputs.drain(..) {
            // SAFETY: the stream is drained and nothing else holds the inputs (graphs over
            // them are dropped before the rig).
            unsafe { be.free(a) };
        }
    }
}

/// Launches of `launches` per kind, in first-seen order.
pub fn count_kinds(launches: &[StepLaunch]) -> Vec<(Kind, usize)> {
    let mut out: Vec<(Kind, usize)> = Vec::new();
    for l in launches {
        match out.iter_mut().find(|(k, _)| *k == l.kind) {
            Some((_, n)) => *n += 1,
            None => out.push((l.kind, 1)),
        }
    }
    out
}

/// A pool of `model` in `kv` rows (FP8 indexer cache) with `slots` slots and `blocks` blocks
/// on `backend`: the step tests' pools.
pub fn step_pool(
    backend: Arc<dyn Backend>,
    model: &v4pool::model::ModelShape,
    kv: v4pool::sizing::KvDtype,
    slots: i64,
    blocks: i64,
) -> Arc<Pool> {
    let layout =
        v4pool::sizing::PoolLayout::new(model, kv, v4pool::sizing::IndexerDtype::Fp8).expect("layout");
    let g = &layout.geometry;
    let rows = blocks * g.envelope_rows + (slots + 1) * (g.slot_rows + g.slot_align_rows.max(1));
    let geometry = layout.carve(blocks, slots, rows).expect("carve");
    let spec = v4pool::pool::PoolSpec::from_layout(&layout, geometry).expect("spec");
    Arc::new(Pool::new(backend, spec, Stream::DEFAULT).expect("pool"))
}

/// Every byte of `pool`'s planes and indexer cache (waits for its stream).
pub fn pool_bytes(pool: &Pool) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = (0..pool.num_planes())
        .map(|i| {
            let mut v = vec![0u8; pool.plane_bytes(i).expect("plane") as usize];
            pool.read_plane(i, 0, &mut v).expect("read plane");
            v
        })
        .collect();
    if let Some(ptr) = pool.indexer_ptr() {
        let n = pool.overhead(0).expect("overhead").indexer_bytes as usize;
        let mut v = vec![0u8; n];
        // SAFETY: the pool's own indexer allocation, `n` bytes long.
        unsafe { pool.backend().download(&mut v, ptr, Stream::DEFAULT).expect("read the indexer cache") };
        out.push(v);
    }
    out
}

/// Fill every plane and the indexer cache of `pool` with bytes from `seed` (the same bytes
/// for every pool of one spec): outputs poisoned, untouched bytes comparable.
pub fn poison_pool(pool: &Pool, seed: u64) {
    let mut rng = Rng::new(seed);
    for i in 0..pool.num_planes() {
        let bytes = rng.bytes(pool.plane_bytes(i).expect("plane") as usize);
        pool.write_plane(i, 0, &bytes).expect("write plane");
    }
    if let Some(ptr) = pool.indexer_ptr() {
        let n = pool.overhead(0).expect("overhead").indexer_bytes as usize;
        let bytes = rng.bytes(n);
        // SAFETY: the pool's own indexer allocation, `n` bytes long.
        unsafe { pool.backend().upload(ptr, &bytes, Stream::DEFAULT).expect("write the indexer cache") };
    }
}

/// What the FlashMLA operands start as in a rig (`StepRig::new`): an i32 no row or length is.
pub const FLASHMLA_POISON: i32 = -0x2f5a_3c1d;

/// Poison every FlashMLA operand buffer of `path` (none on a CSR path), waiting for the upload.
pub fn poison_flashmla_operands(path: &DecodePath) {
    let be = path.pool().backend().clone();
    for b in flashmla_operands(path) {
        let words = vec![FLASHMLA_POISON; b.len as usize];
        // SAFETY: the path's own buffer, `len` i32 elements long; nothing runs on it yet.
        unsafe {
            be.upload(b.ptr, bytemuck::cast_slice(&words), Stream::DEFAULT).expect("poison an operand")
        };
    }
    be.synchronize(Stream::DEFAULT).expect("poisoned operands");
}

/// The FlashMLA operands of `path`'s layers of `class`, each buffer once (`first`: the first
/// such layer's only, as the CSA layers share one extra buffer).
fn flashmla_buffers_of(path: &DecodePath, class: Class, first: bool) -> Vec<v4pool::pool::FlashMlaBuffers> {
    let g = &path.pool().spec().geometry;
    let mut out: Vec<v4pool::pool::FlashMlaBuffers> = Vec::new();
    for layer in 0..g.ratios.len() {
        if g.ratios[layer] != class.ratio() {
            continue;
        }
        let Ok(f) = path.flashmla(layer) else { continue };
        if !out.iter().any(|o| o.extra_indices.map(|x| x.ptr) == f.extra_indices.map(|x| x.ptr)) {
            out.push(f);
        }
        if first {
            break;
        }
    }
    out
}

/// The rule a FlashMLA-mode path's operands follow after a step (index-buffers.md §3f): window
/// rows, CSA extra rows and lengths written whole; an HCA compressed row written through
/// `flashmla_row_limit(length, width)` and the poison untouched past it. Checked on the
/// buffers `path_outputs` reads (`bufs`, in `flashmla_operands` order). Returns the entries
/// left untouched past the HCA rows' limits (what the rule saves).
pub fn check_flashmla_rule(path: &DecodePath, bufs: &[Vec<i32>]) -> Result<u64, String> {
    let mut untouched = 0u64;
    let ops = flashmla_operands(path);
    let at = |ptr: DevicePtr| ops.iter().position(|b| b.ptr == ptr).map(|i| &bufs[i]);
    let hca = flashmla_buffers_of(path, Class::Hca, false);
    for (b, words) in ops.iter().zip(bufs) {
        let Some(f) = hca.iter().find(|f| f.extra_indices.is_some_and(|x| x.ptr == b.ptr)) else {
            if let Some(i) = words.iter().position(|&x| x == FLASHMLA_POISON) {
                return Err(format!("operand at {:#x}: entry {i} unwritten (a whole-row buffer)", b.ptr));
            }
            continue;
        };
        let lengths =
            f.extra_topk_length.and_then(|l| at(l.ptr)).ok_or("HCA lengths not among the operands")?;
        let width = f.extra_topk as usize;
        for (t, row) in words.chunks(width).enumerate() {
            let limit = flashmla_row_limit(i64::from(lengths[t]), width as i64) as usize;
            if let Some(i) = row[..limit].iter().position(|&x| x == FLASHMLA_POISON) {
                return Err(format!(
                    "HCA operand at {:#x} token {t}: entry {i} under the limit {limit} unwritten",
                    b.ptr
                ));
            }
            if let Some(i) = row[limit..].iter().position(|&x| x != FLASHMLA_POISON) {
                return Err(format!(
                    "HCA operand at {:#x} token {t}: entry {} past the limit {limit} written ({})",
                    b.ptr,
                    limit + i,
                    row[limit + i]
                ));
            }
            untouched += (row.len() - limit) as u64;
        }
    }
    Ok(untouched)
}

/// A FlashMLA-mode path's operand buffers, each once (layers of one class and page shift share
/// theirs; the CSA layers share one extra buffer), in layer order; none on a CSR path.
pub fn flashmla_operands(path: &DecodePath) -> Vec<v4pool::pool::DeviceBuffer> {
    let mut out: Vec<v4pool::pool::DeviceBuffer> = Vec::new();
    for layer in 0..path.pool().spec().geometry.ratios.len() {
        let Ok(f) = path.flashmla(layer) else { continue };
        for b in
            [Some(f.indices), Some(f.topk_length), f.extra_indices, f.extra_topk_length].into_iter().flatten()
        {
            if !out.iter().any(|o| o.ptr == b.ptr) {
                out.push(b);
            }
        }
    }
    out
}

/// The decode path's outputs a step leaves: every class's indptr, live indices and
/// destination rows (FlashMLA mode: its operands whole, poison included, checked against
/// [`check_flashmla_rule`] first, and the destination rows).
pub fn path_outputs(path: &DecodePath) -> Vec<Vec<i32>> {
    use v4pool::pool::DecodeBuffer;
    let mut out = Vec::new();
    if path.flashmla(0).is_ok() {
        // FlashMLA mode: every distinct operand buffer, and the destination rows.
        for b in flashmla_operands(path) {
            out.push(path.read_flashmla(b).expect("FlashMLA operand"));
        }
        check_flashmla_rule(path, &out).unwrap_or_else(|e| panic!("the FlashMLA operands' rule: {e}"));
        for class in [Class::Dense, Class::Csa, Class::Hca] {
            if let Ok(rows) = path.read_i32(DecodeBuffer::DestRows(class)) {
                out.push(rows);
            }
        }
        return out;
    }
    for class in [Class::Dense, Class::Csa, Class::Hca] {
        let Ok(indptr) = path.read_i32(DecodeBuffer::Indptr(class)) else { continue };
        let n = (*indptr.last().unwrap_or(&0)).max(0) as usize;
        out.push(path.read_i32(DecodeBuffer::Indices(class)).expect("indices")[..n].to_vec());
        out.push(path.read_i32(DecodeBuffer::DestRows(class)).expect("dest rows"));
        out.push(indptr);
    }
    out
}
