//! CUDA graphs over the decode index path: capture once, replay with new batch contents in
//! the same persistent buffers, and after moving the block/slot boundary (same plane, so the
//! same window params) — never re-capturing. Every replay is compared whole with the host
//! reference. Also times graph replays and eager launches with CUDA events.

use crate::common;

use common::batches::DecodeBatch;
use common::{assert_same, case_seed, cuda_or_skip, geometry_at, run_case, Case, Rng, WIN};
use v4pool::backend::cuda::CudaBackend;
use v4pool::backend::{Backend, DeviceAllocation, Stream};
use v4pool::raw::index::{ClassBuffers, CsaPackArgs, DecodeIndexArgs, Launch};
use v4pool::{UnifiedPoolGeometry, WindowParams, CSA_RATIO, DENSE_RATIO, HCA_RATIO};

/// Fixed sizes of the persistent buffers (the graph's grid is fixed: pads fill the rest).
const BS_CAP: usize = 1024;
const T_CAP: usize = 4200;
const STRIDE_CAP: usize = 3912;
const TOPK: usize = 1024;
const MAX_POS: i64 = 1_000_000;
const MAX_HCA_HEAD: usize = (MAX_POS as usize + 8) / 128;

/// Buffer indices, in the order `buffers()` lays them out.
const SLOTS: usize = 0;
const BID: usize = 1;
const POS: usize = 2;
const TABLES: usize = 3;
const TOPK_ROWS: usize = 4;
const INDPTR: usize = 5; // 5, 6, 7: dense, csa, hca
const INDICES: usize = 8; // 8, 9, 10
const DEST: usize = 11; // 11, 12, 13

/// Capacity (in i32 or i64 elements) and element size of every persistent buffer.
fn layout() -> Vec<(&'static str, usize, usize)> {
    vec![
        ("state_slot_per_seq", BS_CAP, 4),
        ("batch_id_per_token", T_CAP, 4),
        ("positions", T_CAP, 8),
        ("block_tables", BS_CAP * STRIDE_CAP, 4),
        ("topk", T_CAP * TOPK, 4),
        ("dense_indptr", T_CAP + 1, 4),
        ("csa_indptr", T_CAP + 1, 4),
        ("hca_indptr", T_CAP + 1, 4),
        ("dense_indices", T_CAP * WIN as usize, 4),
        ("csa_indices", T_CAP * (TOPK + WIN as usize), 4),
        ("hca_indices", T_CAP * (MAX_HCA_HEAD + WIN as usize), 4),
        ("dense_dest_rows", T_CAP, 4),
        ("csa_dest_rows", T_CAP, 4),
        ("hca_dest_rows", T_CAP, 4),
    ]
}

/// The launches of one decode step, captured once: the fused index build and the CSA pack.
fn step_launches(params: [WindowParams; 3], envelope_rows: i64, p: &[u64]) -> Vec<Launch> {
    let mut d = DecodeIndexArgs::default()
        .with_state_slot_per_seq(p[SLOTS])
        .with_batch_id_per_token(p[BID])
        .with_positions(p[POS])
        .with_block_tables(p[TABLES])
        .with_envelope_rows(envelope_rows)
        .with_block_table_stride(STRIDE_CAP as i32)
        .with_hca_rows_per_block(2)
        .with_num_tokens(T_CAP as i32)
        .with_win(WIN);
    for (c, params) in params.into_iter().enumerate() {
        d.classes[c] = ClassBuffers::default()
            .with_params(params)
            .with_indptr(p[INDPTR + c])
            .with_indices(p[INDICES + c])
            .with_dest_rows(p[DEST + c]);
    }
    let csa = CsaPackArgs::default()
        .with_topk(p[TOPK_ROWS])
        .with_block_tables(p[TABLES])
        .with_positions(p[POS])
        .with_indptr(p[INDPTR + 1])
        .with_batch_id_per_token(p[BID])
        .with_skip_prefix_len_per_token(0)
        .with_out(p[INDICES + 1])
        .with_envelope_rows(envelope_rows)
        .with_topk_row_stride(TOPK as i32)
        .with_block_table_stride(STRIDE_CAP as i32)
        .with_num_tokens(T_CAP as i32)
        .with_block_capacity(64)
        .with_window_size(WIN)
        .with_compress_ratio(4)
        .with_compress_bias(0);
    vec![Launch::Decode(d), Launch::CsaPack(csa)]
}

fn window_params(g: &UnifiedPoolGeometry) -> [WindowParams; 3] {
    [DENSE_RATIO, CSA_RATIO, HCA_RATIO].map(|r| g.window_params(r).expect("class present"))
}

/// Host mirrors of the persistent buffers; a step overwrites the prefix its batch uses and
/// leaves stale contents behind it, as a serving engine does.
struct Mirrors(Vec<Vec<u8>>);

impl Mirrors {
    fn new(rng: &mut Rng) -> Self {
        // Start from random bytes: nothing may depend on buffers being clean.
        Mirrors(layout().into_iter().map(|(_, n, size)| rng.bytes(n * size)).collect())
    }
    fn put_i32(&mut self, buf: usize, v: &[i32]) {
        self.0[buf][..4 * v.len()].copy_from_slice(bytemuck::cast_slice(v));
    }
    fn put_i64(&mut self, buf: usize, v: &[i64]) {
        self.0[buf][..8 * v.len()].copy_from_slice(bytemuck::cast_slice(v));
    }
    fn poison(&mut self, buf: usize, value: i32) {
        for c in self.0[buf].chunks_exact_mut(4) {
            c.copy_from_slice(&value.to_le_bytes());
        }
    }

    /// Lay a batch into the buffers; outputs poisoned with `poison`.
    fn load(&mut self, rng: &mut Rng, b: &DecodeBatch, poison: i32) {
        assert_eq!(b.t_pad(), T_CAP);
        assert_eq!(b.stride, STRIDE_CAP);
        self.put_i32(SLOTS, &b.slots);
        self.put_i32(BID, &b.bid);
        self.put_i64(POS, &b.pos);
        self.put_i32(TABLES, &b.tables);
        self.put_i32(TOPK_ROWS, &b.topk_rows(rng, TOPK));
        self.put_i32(INDPTR, &b.dense_indptr());
        self.put_i32(INDPTR + 1, &b.csa_indptr());
        self.put_i32(INDPTR + 2, &b.hca_indptr());
        for buf in (INDICES..INDICES + 3).chain(DEST..DEST + 3) {
            self.poison(buf, poison);
        }
    }
}

fn batch(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize) -> DecodeBatch {
    let mut b = DecodeBatch::generate(rng, g, bs, TOPK as i64, MAX_POS, T_CAP, 1);
    assert!(b.stride <= STRIDE_CAP, "{} columns", b.stride);
    b.stride = STRIDE_CAP;
    b.tables = common::batches::tables(rng, g, bs, STRIDE_CAP);
    b
}

struct DeviceBuffers<'a> {
    cuda: &'a CudaBackend,
    allocs: Vec<DeviceAllocation>,
}

impl DeviceBuffers<'_> {
    fn ptrs(&self) -> Vec<u64> {
        self.allocs.iter().map(|a| a.ptr).collect()
    }

    /// Upload every input, poison the outputs in stream order (no host wait), as a step does.
    fn load(&self, m: &Mirrors, poison: i32) {
        let s = Stream::DEFAULT;
        for (i, (a, bytes)) in self.allocs.iter().zip(&m.0).enumerate() {
            // SAFETY: each mirror has exactly its allocation's length.
            unsafe {
                if i >= INDICES {
                    self.cuda.fill_u32(a.ptr, a.bytes / 4, poison as u32, s).expect("poison");
                } else {
                    self.cuda.upload(a.ptr, bytes, s).expect("upload");
                }
            }
        }
    }

    fn download(&self) -> Vec<Vec<u8>> {
        self.allocs
            .iter()
            .map(|a| {
                let mut v = vec![0u8; a.bytes as usize];
                // SAFETY: a live allocation of this length.
                unsafe { self.cuda.download(&mut v, a.ptr, Stream::DEFAULT).expect("download") };
                v
            })
            .collect()
    }
}

impl Drop for DeviceBuffers<'_> {
    fn drop(&mut self) {
        let _ = self.cuda.synchronize(Stream::DEFAULT);
        for a in self.allocs.drain(..) {
            // SAFETY: the stream is idle and nothing uses the buffers after the test.
            unsafe { self.cuda.free(a) };
        }
    }
}

/// Without a GPU, `V4POOL_TEST_DEVICE=host` still runs the batches of the graph test through
/// the host reference (generators, capacities and bounds), comparing nothing.
#[test]
fn decode_graph_batches_fit_the_persistent_buffers() {
    if !std::env::var("V4POOL_TEST_DEVICE").is_ok_and(|v| v == "host") {
        return;
    }
    let mut rng = Rng::new(case_seed("graph-dry", 0));
    let g = geometry_at(&common::flash_ratios(), 135, 149_000_000, 2048);
    for slots in [3000, 1100] {
        let moved =
            g.with_capacity(g.max_blocks_beside(slots), i64::from(slots), Some(g.plane_rows)).expect("split");
        assert_eq!(window_params(&moved), window_params(&g));
    }
    let mut mirrors = Mirrors::new(&mut rng);
    let b = batch(&mut rng, &g, BS_CAP);
    mirrors.load(&mut rng, &b, -7);
    let mut case = Case::new("graph dry run", 0);
    for ((name, _, _), bytes) in layout().into_iter().zip(&mirrors.0) {
        case.bytes(name, bytes.clone());
    }
    let (params, envelope) = (window_params(&g), g.envelope_rows);
    run_case(&common::host(), &case, &|p| step_launches(params, envelope, p)).expect("host reference");
}

/// Alone in a process of its own (`common::alone`): it times graph replays on the legacy
/// default stream, which other tests' work in this process would join (17,241 us a step
/// beside the suite's other tests on an H100, 2026-12-07; 36.5 as its own binary on an H200,
/// 2026-11-29).
#[test]
fn decode_graph_replays_new_batches_and_moved_boundaries() {
    if !common::alone(module_path!(), "decode_graph_replays_new_batches_and_moved_boundaries") {
        return;
    }
    let Some(cuda) = cuda_or_skip("decode_graph_replays_new_batches_and_moved_boundaries") else {
        return;
    };
    let seed = case_seed("graph", 0);
    let mut rng = Rng::new(seed);
    let ratios = common::flash_ratios();
    let ring = rng.range(128, 135);
    let plane = 150_000_000 - rng.range(0, 1_000_000);
    let g0 = geometry_at(&ratios, ring, plane, 2048);
    let params = window_params(&g0);
    let envelope = g0.envelope_rows;

    let dev = DeviceBuffers {
        cuda: &cuda,
        allocs: layout()
            .into_iter()
            .map(|(_, n, size)| cuda.alloc_zeroed((n * size) as u64).expect("alloc"))
            .collect(),
    };
    let ptrs = dev.ptrs();
    let mut mirrors = Mirrors::new(&mut rng);

    // Capture once, on the first batch's buffers (capture runs nothing).
    let graph = {
        let capture = cuda.begin_capture(Stream::DEFAULT).expect("begin capture");
        for l in step_launches(params, envelope, &ptrs) {
            // SAFETY: the persistent buffers cover every launch (capacities above).
            unsafe { cuda.launch(&l, Stream::DEFAULT).expect("captured launch") };
        }
        capture.end().expect("end capture")
    };

    // Splits of the same plane: more slots, then fewer (more blocks) than the capture's.
    let g_more = g0.with_capacity(g0.max_blocks_beside(3000), 3000, Some(plane)).expect("more slots");
    let g_fewer = g0.with_capacity(g0.max_blocks_beside(1100), 1100, Some(plane)).expect("fewer slots");
    let steps: Vec<(&str, &UnifiedPoolGeometry, usize)> = vec![
        ("capture split", &g0, rng.range(1, 64) as usize),
        ("capture split", &g0, rng.range(65, 1023) as usize),
        ("capture split", &g0, BS_CAP),
        ("more slots", &g_more, BS_CAP),
        ("fewer slots", &g_fewer, BS_CAP),
    ];
    for (i, (split, g, bs)) in steps.into_iter().enumerate() {
        // The boundary moved, the window formula did not: the captured scalars stay right.
        assert_eq!(window_params(g), params, "{split}: window params moved with the boundary");
        assert_eq!(g.envelope_rows, envelope);
        let step_seed = case_seed("graph-step", i as u64);
        let mut rng = Rng::new(step_seed);
        let b = batch(&mut rng, g, bs);
        let poison = -7 - i as i32;
        mirrors.load(&mut rng, &b, poison);
        dev.load(&mirrors, poison);
        graph.replay(Stream::DEFAULT).expect("replay");
        let got = dev.download();

        let mut case = Case::new(
            format!(
                "graph step {i} ({split}: {} slots, {} blocks) bs={bs} live={}",
                g.num_slots, g.num_blocks, b.live
            ),
            step_seed,
        );
        for ((name, _, _), bytes) in layout().into_iter().zip(&mirrors.0) {
            case.bytes(name, bytes.clone());
        }
        let want = run_case(&common::host(), &case, &|p| step_launches(params, envelope, p))
            .unwrap_or_else(|e| panic!("{}: host reference failed: {e}", case.name));
        assert_same(&case, &want, &got);
        println!("ok {}", case.name);
    }

    // Timing at the last batch (bs = BS_CAP, so runs compare): graph replays and the same
    // launches queued eagerly.
    let (start, end) = (cuda.event().expect("event"), cuda.event().expect("event"));
    let reps = 200;
    start.record(Stream::DEFAULT).expect("record");
    for _ in 0..reps {
        graph.replay(Stream::DEFAULT).expect("replay");
    }
    end.record(Stream::DEFAULT).expect("record");
    let graph_ms = start.elapsed_ms(&end).expect("elapsed");
    start.record(Stream::DEFAULT).expect("record");
    for _ in 0..reps {
        for l in step_launches(params, envelope, &ptrs) {
            // SAFETY: as for the capture.
            unsafe { cuda.launch(&l, Stream::DEFAULT).expect("launch") };
        }
    }
    end.record(Stream::DEFAULT).expect("record");
    let eager_ms = start.elapsed_ms(&end).expect("elapsed");
    println!(
        "TIMING decode index build + CSA pack, T={T_CAP} (bs<={BS_CAP}, positions<=1e6, top-k {TOPK}) on {}: graph replay {:.1} us/step, eager {:.1} us/step",
        cuda.device_name(),
        1000.0 * graph_ms / reps as f32,
        1000.0 * eager_ms / reps as f32
    );
}

/// Graph plumbing on its own: an empty-kernel graph replays; uploads and downloads are refused
/// on a capturing stream (they would bake stale bytes into the graph or wait inside it); a
/// capture dropped without `end` leaves the stream usable.
#[test]
fn capture_refuses_host_transfers_and_aborts_cleanly() {
    let Some(cuda) = cuda_or_skip("capture_refuses_host_transfers_and_aborts_cleanly") else {
        return;
    };
    let s = Stream::DEFAULT;
    let buf = cuda.alloc_zeroed(256).expect("alloc");
    {
        let _capture = cuda.begin_capture(s).expect("begin");
        // SAFETY: inside the allocation.
        let up = unsafe { cuda.upload(buf.ptr, &[1, 2, 3, 4], s) };
        assert!(up.is_err(), "upload during capture must be refused");
        let mut back = [0u8; 4];
        // SAFETY: inside the allocation.
        let down = unsafe { cuda.download(&mut back, buf.ptr, s) };
        assert!(down.is_err(), "download during capture must be refused");
        // Dropped without end: the capture is discarded.
    }
    let capture = cuda.begin_capture(s).expect("begin again");
    // SAFETY: the empty kernel touches nothing; the fill stays in the allocation.
    unsafe {
        cuda.launch(&Launch::Empty, s).expect("empty");
        cuda.fill_u32(buf.ptr, 64, 0x0102_0304, s).expect("fill node");
    }
    let graph = capture.end().expect("end");
    for _ in 0..3 {
        graph.replay(s).expect("replay");
    }
    let mut back = [0u8; 256];
    // SAFETY: inside the allocation.
    unsafe { cuda.download(&mut back, buf.ptr, s).expect("download") };
    assert!(back.chunks(4).all(|c| c == 0x0102_0304u32.to_le_bytes()));
    drop(graph);
    // SAFETY: idle (download waited) and not used again.
    unsafe { cuda.free(buf) };
    println!(
        "module source: {:?}, device {} sm_{:?}",
        cuda.module_source(),
        cuda.device_name(),
        cuda.compute_capability()
    );
}

/// Launch overhead floor: one empty-kernel replay, timed with events.
#[test]
fn empty_kernel_graph_floor() {
    let Some(cuda) = cuda_or_skip("empty_kernel_graph_floor") else {
        return;
    };
    let s = Stream::DEFAULT;
    let capture = cuda.begin_capture(s).expect("begin");
    // SAFETY: the empty kernel touches nothing.
    unsafe { cuda.launch(&Launch::Empty, s).expect("empty") };
    let graph = capture.end().expect("end");
    let (a, b) = (cuda.event().expect("event"), cuda.event().expect("event"));
    let reps = 1000;
    graph.replay(s).expect("warm-up");
    a.record(s).expect("record");
    for _ in 0..reps {
        graph.replay(s).expect("replay");
    }
    b.record(s).expect("record");
    let ms = a.elapsed_ms(&b).expect("elapsed");
    println!("TIMING empty-kernel graph replay: {:.2} us", 1000.0 * ms / reps as f32);
}
