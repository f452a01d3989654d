//! The kernel source itself (kernels/v4pool_kernels.cu, compiled as plain C++ by build.rs into
//! the host-emulation library) against the host reference (`index::host::run_launch`), on
//! random inputs with poisoned outputs. Same launch shapes as the GPU backends
//! (`index::shape::launch_shape`), every thread of every block run in turn.
//!
//! Skipped (with a note on stderr) when build.rs found no clang to build the library.

use crate::common;
use crate::flashmla_common;

use common::Rng;
use std::ffi::{c_char, c_void, CString};
use v4pool::geometry::{GeometrySpec, UnifiedPoolGeometry, WindowParams};
use v4pool::raw::index::host::run_launch;
use v4pool::raw::index::shape::{
    decode_hca_tiles, launch_shape, prefill_short, LaunchShape, DECODE_FLASH_TILE,
};
use v4pool::raw::index::{
    ClassBuffers, CopyRun, CopyRunsArgs, CsaPackArgs, DecodeIndexArgs, FillRun, FillRunsArgs, HcaOffsetsArgs,
    Launch, PlaneWrite, PrefillIndexArgs, RingWriteArgs, RowScatterArgs, StateUpdateArgs, CLASS_HCA,
};

type EmuLaunch = unsafe extern "C" fn(*const c_char, *const c_void, *const u32, u32) -> i32;

struct Emu {
    _lib: libloading::Library,
    launch: EmuLaunch,
}

fn emu() -> Option<Emu> {
    let Some(path) = v4pool::raw::kernels::host_emulation_library() else {
        // CI installs clang-19 and sets V4POOL_REQUIRE_DEVICE_BUILD=1: there a missing library
        // is a failure, never a silent pass.
        assert!(
            !std::env::var("V4POOL_REQUIRE_DEVICE_BUILD").is_ok_and(|v| v == "1"),
            "V4POOL_REQUIRE_DEVICE_BUILD=1 but build.rs built no host-emulation library"
        );
        println!("SKIP: no host-emulation library (build.rs found no clang, or it is not on this machine)");
        return None;
    };
    // SAFETY: the library is ours (build.rs built it from kernels/); loading runs no init code
    // beyond the C++ runtime's.
    let lib = unsafe { libloading::Library::new(path) }.expect("load the emulation library");
    // SAFETY: the symbol has exactly this signature (kernels/v4pool_emulation.cpp).
    let launch = unsafe { *lib.get::<EmuLaunch>(b"v4pool_emu_launch\0").expect("v4pool_emu_launch") };
    Some(Emu { _lib: lib, launch })
}

impl Emu {
    /// # Safety
    /// As `run_launch`: the pointers in the launch cover what the kernel touches.
    unsafe fn run(&self, launch: &Launch) {
        // SAFETY: forwarded.
        unsafe { self.run_as(launch, launch.symbol(), launch_shape(launch)) }
    }

    /// # Safety
    /// As `run`; `symbol` takes `launch`'s argument struct and `shape` covers its work.
    unsafe fn run_as(&self, launch: &Launch, symbol: &str, shape: LaunchShape) {
        let bytes = v4pool::raw::launch::kernel_argument(launch);
        let sym = CString::new(symbol).unwrap();
        // SAFETY: forwarded from the caller; the argument bytes are the struct the kernel takes.
        let rc = unsafe {
            (self.launch)(sym.as_ptr(), bytes.as_ptr().cast(), shape.grid.as_ptr(), shape.block[0])
        };
        assert_eq!(rc, 0, "unknown kernel {symbol}");
    }
}

const POISON: i32 = -7;

/// Run `make`'s launch on the host reference and on the emulated kernel, each with its own
/// copy of the poisoned outputs; both must end equal. Returns whether anything was written.
fn compare<T: Clone + PartialEq + std::fmt::Debug>(
    emu: &Emu,
    what: &str,
    outputs: &[Vec<T>],
    make: impl Fn(&mut [Vec<T>]) -> Launch,
) -> bool {
    compare_as(emu, what, outputs, make, None)
}

/// As [`compare`], the kernel run as `form` (symbol and shape) instead of the launch's own.
fn compare_as<T: Clone + PartialEq + std::fmt::Debug>(
    emu: &Emu,
    what: &str,
    outputs: &[Vec<T>],
    make: impl Fn(&mut [Vec<T>]) -> Launch,
    form: Option<(&str, LaunchShape)>,
) -> bool {
    let mut host = outputs.to_vec();
    let mut dev = outputs.to_vec();
    let l = make(&mut host);
    // SAFETY: `make` points the launch at the test's live buffers, sized for the kernel.
    unsafe { run_launch(&l) }.unwrap_or_else(|e| panic!("{what}: host reference refused: {e}"));
    let l = make(&mut dev);
    // SAFETY: as above; a forced form takes the same arguments and covers the same tokens.
    match form {
        Some((sym, shape)) => unsafe { emu.run_as(&l, sym, shape) },
        None => unsafe { emu.run(&l) },
    }
    assert!(host == dev, "{what}: kernel and host reference differ\nhost {host:?}\nkernel {dev:?}");
    host != outputs
}

fn addr<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}

/// The row writers' two plane writes into `outs` from the rows at `kv` (the second plane only
/// where the layout has one, `widths.1 > 0`).
fn plane_writes(outs: &mut [Vec<u8>], kv: [u64; 2], widths: (i64, i64)) -> [PlaneWrite; 2] {
    let mut planes = [
        PlaneWrite::default().with_kv(kv[0]).with_pool(outs[0].as_mut_ptr() as u64).with_row_bytes(widths.0),
        PlaneWrite::default(),
    ];
    if widths.1 > 0 {
        planes[1] = PlaneWrite::default()
            .with_kv(kv[1])
            .with_pool(outs[1].as_mut_ptr() as u64)
            .with_row_bytes(widths.1);
    }
    planes
}

fn random_geometry(rng: &mut Rng, need_compressed: bool) -> UnifiedPoolGeometry {
    random_geometry_ring(rng, need_compressed, 8, 14)
}

/// As [`random_geometry`] with `ring_slots` drawn from `[ring_lo, ring_hi]`: rings longer than
/// a kernel's lanes per token (64 in the prefill builder, 256 in the decode builder) make each
/// lane write several window entries, through the running ring counters and their wrap.
fn random_geometry_ring(
    rng: &mut Rng,
    need_compressed: bool,
    ring_lo: i64,
    ring_hi: i64,
) -> UnifiedPoolGeometry {
    loop {
        let layers = rng.range(2, 7);
        let ratios: Vec<i32> = (0..layers).map(|_| [0, 4, 128][rng.range(0, 2) as usize]).collect();
        if need_compressed && !(ratios.contains(&4) && ratios.contains(&128)) {
            continue;
        }
        let block = if rng.chance(0.5) { 256 } else { 128 };
        let spec =
            GeometrySpec::new(ratios, rng.range(4, 40), rng.range(3, 8), rng.range(ring_lo, ring_hi), block)
                .arena_rows(rng.range(0, 5));
        if let Ok(g) = spec.build() {
            return g;
        }
    }
}

fn physical_slots(rng: &mut Rng, g: &UnifiedPoolGeometry, bs: usize) -> Vec<i32> {
    (0..bs).map(|_| g.physical_slot(rng.range(0, g.num_slots - 1)).unwrap() as i32).collect()
}

fn cumsum(lens: &[i64]) -> Vec<i32> {
    let mut v = vec![0i32];
    for l in lens {
        v.push(v.last().unwrap() + *l as i32);
    }
    v
}

fn extent(indptr: &[i32]) -> usize {
    *indptr.iter().max().unwrap() as usize
}

#[test]
fn decode_builder_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut wrote = 0;
    for case in 0..60 {
        // Every third case with a ring longer than the 256 threads of a block.
        let g = if case % 3 == 2 {
            random_geometry_ring(&mut rng, false, 257, 600)
        } else {
            random_geometry(&mut rng, false)
        };
        let rpb = (g.block_size / 128) as i32;
        let win = rng.range(1, g.ring_slots) as i32;
        let bs = rng.range(1, 5) as usize;
        let slots = physical_slots(&mut rng, &g, bs);
        let t = rng.range(0, 9) as usize;
        let bids: Vec<i32> =
            (0..t).map(|_| if rng.chance(0.2) { -1 } else { rng.range(0, bs as i64 - 1) as i32 }).collect();
        let positions: Vec<i64> = (0..t).map(|_| rng.range(0, 5000)).collect();
        let stride = if rng.chance(0.3) { rng.range(600, 2100) } else { rng.range(1, 6) } as i32;
        let tables: Vec<i32> =
            (0..bs * stride as usize).map(|_| rng.range(0, g.num_blocks - 1) as i32).collect();
        let fused = rng.chance(0.6);
        // Per class: enabled?, head lengths, indptr.
        let mut classes = Vec::new();
        for (c, ratio) in [0, 4, 128].into_iter().enumerate() {
            let Ok(params) = g.window_params(ratio) else {
                classes.push(None);
                continue;
            };
            if c > 0 && rng.chance(0.2) {
                classes.push(None);
                continue;
            }
            let lens: Vec<i64> = (0..t)
                .map(|i| {
                    if bids[i] < 0 {
                        return 0;
                    }
                    let n = (positions[i] + 1).min(win.into());
                    let head = match c {
                        0 => 0,
                        1 => rng.range(0, 6),
                        _ => rng.range(0, i64::from(stride * rpb)),
                    };
                    n + head
                })
                .collect();
            classes.push(Some((params, cumsum(&lens), rng.chance(0.8))));
        }
        if classes.iter().flatten().count() == 0 {
            continue;
        }
        if !classes.iter().flatten().any(|c| c.2) {
            classes.iter_mut().flatten().next().unwrap().2 = true;
        }
        // Outputs: [indices c, dest c] for each class slot (empty when off), plus slack.
        let mut outputs = Vec::new();
        for c in classes.iter() {
            match c {
                Some((_, indptr, _)) => {
                    outputs.push(vec![POISON; extent(indptr) + 3]);
                    outputs.push(vec![POISON; t + 2]);
                }
                None => {
                    outputs.push(vec![]);
                    outputs.push(vec![]);
                }
            }
        }
        let written = compare(&emu, &format!("decode case {case}"), &outputs, |outs| {
            let mut a = DecodeIndexArgs::default()
                .with_state_slot_per_seq(addr(&slots))
                .with_batch_id_per_token(addr(&bids))
                .with_positions(addr(&positions))
                .with_block_tables(if fused { addr(&tables) } else { 0 })
                .with_envelope_rows(g.envelope_rows)
                .with_block_table_stride(stride)
                .with_hca_rows_per_block(rpb)
                .with_num_tokens(t as i32)
                .with_win(win);
            for (c, cls) in classes.iter().enumerate() {
                if let Some((params, indptr, dest)) = cls {
                    a.classes[c] = ClassBuffers::default()
                        .with_params(*params)
                        .with_indptr(addr(indptr))
                        .with_indices(outs[2 * c].as_mut_ptr() as u64)
                        .with_dest_rows(if *dest { outs[2 * c + 1].as_mut_ptr() as u64 } else { 0 });
                }
            }
            Launch::Decode(a)
        });
        wrote += usize::from(written);
    }
    assert!(wrote > 30, "only {wrote} cases wrote anything");
}

/// The fused HCA heads are tiled over grid x (after the window block): heads around and past
/// the tile (4,096 entries) and its multiples
/// at every slice alignment mod 4 of the output (the 16-byte writer's leading and trailing
/// entries, even and odd first groups), table rows at both 8-byte alignments (an odd stride),
/// several rows per block, tiles past a short head, pad tokens between long ones.
#[test]
fn decode_builder_long_hca_heads_every_alignment() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x4ca1_1ed5_0000_0001);
    let g = random_geometry(&mut rng, true);
    let win = rng.range(1, g.ring_slots) as i32;
    let stride = 4201i32;
    let bs = 3usize;
    let slots = physical_slots(&mut rng, &g, bs);
    let tables: Vec<i32> = (0..bs * stride as usize).map(|_| rng.range(0, g.num_blocks - 1) as i32).collect();
    let mut wrote = 0;
    for rpb in 1..=3i32 {
        let longest = i64::from(stride * rpb);
        let heads: Vec<i64> = [
            0, 1, 3, 4, 5, 7, 2047, 2049, 4095, 4096, 4097, 4098, 8191, 8192, 8193, 8195, 8198, 12_287,
            12_289,
        ]
        .into_iter()
        .chain([longest - 1, longest])
        .filter(|&h| h <= longest)
        .collect();
        for lead in 0..4i32 {
            let t = heads.len() + 1;
            let bids: Vec<i32> =
                (0..t).map(|i| if i == 5 { -1 } else { rng.range(0, bs as i64 - 1) as i32 }).collect();
            let positions: Vec<i64> = (0..t).map(|_| rng.range(0, 300)).collect();
            let mut lens = Vec::new();
            for i in 0..t {
                let n = (positions[i] + 1).min(win.into());
                let head = if i < heads.len() { heads[i] } else { rng.range(0, longest) };
                lens.push(if bids[i] < 0 { 0 } else { n + head });
            }
            // `lead` entries before the first slice set the slices' alignment mod 4.
            let indptr: Vec<i32> = cumsum(&lens).iter().map(|&x| x + lead).collect();
            let csa_lens: Vec<i64> =
                (0..t).map(|i| if bids[i] < 0 { 0 } else { (positions[i] + 1).min(win.into()) }).collect();
            let csa_indptr = cumsum(&csa_lens);
            let outputs = vec![
                vec![POISON; extent(&indptr) + 5],
                vec![POISON; t + 1],
                vec![POISON; extent(&csa_indptr) + 1],
            ];
            let written = compare(&emu, &format!("long heads rpb {rpb} lead {lead}"), &outputs, |outs| {
                let mut a = DecodeIndexArgs::default()
                    .with_state_slot_per_seq(addr(&slots))
                    .with_batch_id_per_token(addr(&bids))
                    .with_positions(addr(&positions))
                    .with_block_tables(addr(&tables))
                    .with_envelope_rows(g.envelope_rows)
                    .with_block_table_stride(stride)
                    .with_hca_rows_per_block(rpb)
                    .with_num_tokens(t as i32)
                    .with_win(win);
                a.classes[1] = ClassBuffers::default()
                    .with_params(g.window_params(4).unwrap())
                    .with_indptr(addr(&csa_indptr))
                    .with_indices(outs[2].as_mut_ptr() as u64)
                    .with_dest_rows(0);
                a.classes[2] = ClassBuffers::default()
                    .with_params(g.window_params(128).unwrap())
                    .with_indptr(addr(&indptr))
                    .with_indices(outs[0].as_mut_ptr() as u64)
                    .with_dest_rows(outs[1].as_mut_ptr() as u64);
                let l = Launch::Decode(a);
                assert_eq!(launch_shape(&l).grid, [1 + ((longest + 4095) / 4096) as u32, t as u32, 1]);
                l
            });
            wrote += usize::from(written);
        }
    }
    assert_eq!(wrote, 12);
}

#[test]
fn prefill_builder_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let (shorts, pairs) = prefill_cases(&emu, Rng::new(0x1234_5678_9abc_def1), 60, false);
    // Both forms ran, each on many cases, and the paired form on every one.
    assert!(shorts >= 10, "only {shorts} short-form runs");
    assert!(pairs >= 100, "only {pairs} paired-form runs");
}

/// The prefill builder with the coarse slot packed per layer (V4.1): HCA windows at each
/// slice's tail, the heads left poisoned for the pack, in every form.
#[test]
fn prefill_builder_packed_coarse_matches_reference() {
    let Some(emu) = emu() else { return };
    let (shorts, pairs) = prefill_cases(&emu, Rng::new(0x6b1d_0f41_2c37_9e55), 40, true);
    // No HCA head to write: every launch takes the short form.
    assert_eq!(shorts, 80);
    assert_eq!(pairs, 80);
}

/// `cases` random prefill launches (each at two table strides), the kernel against the host
/// reference in its own form and the paired form; `packed`: the coarse slot packed per layer.
/// Returns (short-form runs, paired-form runs).
fn prefill_cases(emu: &Emu, mut rng: Rng, cases: usize, packed: bool) -> (usize, usize) {
    let (mut shorts, mut pairs) = (0usize, 0usize);
    for case in 0..cases {
        // Every third case with a ring longer than the 64 lanes a token has.
        let g = if case % 3 == 2 {
            random_geometry_ring(&mut rng, true, 65, 300)
        } else {
            random_geometry(&mut rng, true)
        };
        // Every third case with rows per block that do not divide the 64 lanes (the kernel's
        // running (block, row) counter then carries).
        let rpb = if case % 3 == 1 { 3 } else { g.block_size / 128 };
        let win = rng.range(1, g.ring_slots);
        let hca_ratio = [8i64, 16, 128][rng.range(0, 2) as usize];
        let bs = rng.range(1, 4) as usize;
        let slots = physical_slots(&mut rng, &g, bs);
        let (mut positions, mut bids, mut chunk_start, mut cu_q, mut committed) =
            (vec![], vec![], vec![], vec![], vec![]);
        for b in 0..bs {
            // Long contexts give HCA heads of several 2,048-entry rounds.
            let cs = if rng.chance(0.3) {
                0
            } else if rng.chance(0.3) {
                rng.range(20_000, 70_000)
            } else {
                rng.range(0, 1500)
            };
            // Sequences of one token up to many (the paired form shares one table row between
            // consecutive tokens of a sequence; odd counts leave a token on its own).
            let len = if rng.chance(0.25) { rng.range(6, 40) } else { rng.range(1, 6) };
            cu_q.push(positions.len() as i32);
            chunk_start.push(cs as i32);
            committed.push(((cs + len) / hca_ratio) as i32);
            for p in cs..cs + len {
                positions.push(p as i32);
                bids.push(b as i32);
            }
        }
        let t = positions.len();
        let stride =
            committed.iter().map(|&n| (i64::from(n) + rpb - 1) / rpb).max().unwrap().max(1) + rng.range(0, 2);
        // Room for rows of stride + PAD: every case runs at its own stride (the short form
        // where stride * rpb allows) and padded past the short form's bound (the long form).
        const PAD: i64 = 300;
        let tables: Vec<i32> =
            (0..bs * (stride + PAD) as usize).map(|_| rng.range(0, g.num_blocks - 1) as i32).collect();
        let (mut ext_l, mut pre_l, mut csa_l, mut hca_l) = (vec![], vec![], vec![], vec![]);
        for i in 0..t {
            let (b, p) = (bids[i] as usize, i64::from(positions[i]));
            let cs = i64::from(chunk_start[b]);
            let low = (p - win + 1).max(0);
            let pre = (cs - low).max(0);
            ext_l.push((p - cs + 1).min(win));
            pre_l.push(pre);
            csa_l.push(pre + rng.range(0, 4));
            hca_l.push(
                pre + if packed { rng.range(0, 4) } else { ((p + 1) / hca_ratio).min(committed[b].into()) },
            );
        }
        let dense = g.window_params(0).ok();
        let ptrs = [cumsum(&ext_l), cumsum(&pre_l), cumsum(&csa_l), cumsum(&hca_l)];
        let outputs: Vec<Vec<i32>> = ptrs.iter().map(|p| vec![POISON; extent(p) + 2]).collect();
        let mut csa = g.window_params(4).unwrap();
        if case % 3 == 2 {
            // Runs shorter than the ring and not dividing the 64 lanes: the kernel's running
            // (run, offset) counter carries between its wraps.
            csa.ring_stride = 2 * rng.range(1, 20) + 1;
            csa.run_rows = csa.ring_stride + rng.range(0, 4);
        }
        for stride in [stride, stride + PAD] {
            let make = |outs: &mut [Vec<i32>]| {
                Launch::Prefill(
                    PrefillIndexArgs::default()
                        .with_dense(dense.unwrap_or_default())
                        .with_csa(csa)
                        .with_hca(g.window_params(128).unwrap())
                        .with_positions(addr(&positions))
                        .with_bid_per_token(addr(&bids))
                        .with_chunk_start_per_seq(addr(&chunk_start))
                        .with_cu_seqlens_q_per_seq(addr(&cu_q))
                        .with_state_slot_per_seq(addr(&slots))
                        .with_n_committed_hca_per_seq(addr(&committed))
                        .with_block_tables(addr(&tables))
                        .with_extend_indptr(addr(&ptrs[0]))
                        .with_extend_indices(outs[0].as_mut_ptr() as u64)
                        .with_swa_indptr(if dense.is_some() { addr(&ptrs[1]) } else { 0 })
                        .with_swa_indices(if dense.is_some() { outs[1].as_mut_ptr() as u64 } else { 0 })
                        .with_csa_indptr(addr(&ptrs[2]))
                        .with_csa_indices(outs[2].as_mut_ptr() as u64)
                        .with_hca_indptr(addr(&ptrs[3]))
                        .with_hca_indices(outs[3].as_mut_ptr() as u64)
                        .with_envelope_rows(g.envelope_rows)
                        .with_block_table_stride(stride as i32)
                        .with_num_tokens(t as i32)
                        .with_win(win as i32)
                        .with_hca_ratio(hca_ratio as i32)
                        .with_hca_rows_per_block(rpb as i32)
                        .with_coarse_packed(i32::from(packed)),
                )
            };
            let Launch::Prefill(args) = make(&mut outputs.clone()) else { unreachable!() };
            let form = if prefill_short(&args) { "short" } else { "long" };
            shorts += usize::from(prefill_short(&args));
            compare(emu, &format!("prefill case {case} stride {stride} ({form} form)"), &outputs, make);
            // The paired long form (two tokens per 64 lanes, 8 per block) on every case, whatever
            // the shape rule picks (it pairs only forwards of 4,096 tokens or more).
            let pair = LaunchShape { grid: [(t as u32).div_ceil(8).max(1), 1, 1], block: [256, 1, 1] };
            let what = format!("prefill case {case} stride {stride} (paired form)");
            compare_as(emu, &what, &outputs, make, Some(("v4pool_prefill_indices_pair", pair)));
            pairs += 1;
        }
    }
    (shorts, pairs)
}

#[test]
fn hca_offsets_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0xdead_beef_cafe_f00d);
    for case in 0..30 {
        let n = rng.range(0, 700) as usize;
        let bs = rng.range(1, 5);
        let stride = rng.range(1, 40);
        let rpb = rng.range(1, 3);
        let tables: Vec<i32> = (0..bs * stride).map(|_| rng.range(0, 10_000) as i32).collect();
        let entries: Vec<i32> = (0..n).map(|_| rng.range(0, stride * rpb - 1) as i32).collect();
        let bids: Vec<i32> = (0..n).map(|_| rng.range(0, bs - 1) as i32).collect();
        let outputs = vec![vec![POISON; n + 3]];
        compare(&emu, &format!("hca offsets case {case}"), &outputs, |outs| {
            Launch::HcaOffsets(
                HcaOffsetsArgs::default()
                    .with_entry_idx(addr(&entries))
                    .with_bid_per_entry(addr(&bids))
                    .with_block_tables(addr(&tables))
                    .with_out(outs[0].as_mut_ptr() as u64)
                    .with_envelope_rows(1000 + stride)
                    .with_block_table_stride(stride as i32)
                    .with_rows_per_block(rpb as i32)
                    .with_num_entries(n as i32),
            )
        });
    }
}

#[test]
fn csa_pack_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x0bad_c0de_1234_0001);
    for case in 0..200 {
        let t = rng.range(0, 6) as usize;
        // Rows of every columns-per-thread count (1..8) and of one to two tiles.
        let row_stride =
            [8i64, 64, 300, 512, 513, 1024, 1100, 1800, 2048, 2049, 2600][rng.range(0, 10) as usize];
        let bs = rng.range(1, 4);
        // Now and then a row longer than the decode form stages (4,096 columns).
        let stride = if rng.chance(0.1) { rng.range(4090, 4200) } else { rng.range(1, 12) };
        let tables: Vec<i32> = (0..bs * stride).map(|_| rng.range(0, 500) as i32).collect();
        let window = if rng.chance(0.5) { rng.range(1, 128) } else { 0 };
        let bids: Vec<i32> =
            (0..t).map(|_| if rng.chance(0.2) { -1 } else { rng.range(0, bs - 1) as i32 }).collect();
        // Short contexts too: top-k values past the columns a position reaches (and past
        // the staged columns) come from the table itself.
        let max_pos = [100_000i64, 2_000, 300, 2_000_000][rng.range(0, 3) as usize];
        let positions: Vec<i64> = (0..t).map(|_| rng.range(0, max_pos)).collect();
        let skip: Vec<i32> = (0..t).map(|_| rng.range(0, 20) as i32).collect();
        let lens: Vec<i64> = (0..t)
            .map(|i| {
                let s = if window > 0 { (positions[i] + 1).min(window) } else { skip[i].into() };
                if bids[i] < 0 {
                    0
                } else {
                    s + rng.range(0, row_stride)
                }
            })
            .collect();
        // A few entries before the first slice: slices start at every alignment mod 4.
        let lead = rng.range(0, 3) as i32;
        let indptr: Vec<i32> = cumsum(&lens).iter().map(|&x| x + lead).collect();
        // Rows per block: DeepSeek-V4's 64 (a power of two: shift and mask), others divide;
        // V4.1's 128 and 256 (block 256 at ratios 2 and 1) and 8, 16 (block 16).
        let cap = [64i64, 64, 64, 1, 3, 48, 128, 256, 8, 16][rng.range(0, 9) as usize];
        // The class ratio (V4's 4, V4.1's 1 and 2, and others) and the layer's compress bias
        // (0 for V4 and owners; V4.1 readers up to a few thousand rows).
        let ratio = [4i64, 4, 1, 2, 3, 128][rng.range(0, 5) as usize];
        let bias = if rng.chance(0.5) { 0 } else { rng.range(1, 5000) };
        // Values past the table exercise the clamp; now and then negative ones (C division
        // truncates: column 0, a negative row) and the i32 extremes.
        let topk: Vec<i32> = (0..t as i64 * row_stride)
            .map(|_| match rng.range(0, 99) {
                0 => i32::MIN,
                1 => i32::MAX,
                2..=4 => -(rng.range(1, 300) as i32),
                _ => rng.range(0, stride * cap + 100) as i32,
            })
            .collect();
        let outputs = vec![vec![POISON; extent(&indptr) + 3]];
        // Decode rows run a staged form (two columns per thread up to 512, four past it),
        // prefill rows the gather form (`Launch::symbol`): each against the reference.
        compare(&emu, &format!("csa pack case {case}"), &outputs, |outs| {
            Launch::CsaPack(
                CsaPackArgs::default()
                    .with_topk(addr(&topk))
                    .with_block_tables(addr(&tables))
                    .with_positions(addr(&positions))
                    .with_indptr(addr(&indptr))
                    .with_batch_id_per_token(addr(&bids))
                    .with_skip_prefix_len_per_token(addr(&skip))
                    .with_out(outs[0].as_mut_ptr() as u64)
                    .with_envelope_rows(132)
                    .with_topk_row_stride(row_stride as i32)
                    .with_block_table_stride(stride as i32)
                    .with_num_tokens(t as i32)
                    .with_block_capacity(cap as i32)
                    .with_window_size(window as i32)
                    .with_compress_ratio(ratio as i32)
                    .with_compress_bias(bias),
            )
        });
    }
}

/// Row widths that take the 16-byte, 4-byte and byte paths of the row copy.
const WIDTHS: [(i64, i64); 4] = [(512, 128), (1024, 0), (36, 12), (7, 5)];

#[test]
fn ring_write_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x5555_aaaa_1111_2222);
    for case in 0..40 {
        let g = random_geometry(&mut rng, false);
        let ratio = *g.classes.keys().next().unwrap();
        let params: WindowParams = g.window_params(ratio).unwrap();
        let view_rows = g.plane_rows - rng.range(0, 20);
        let (w0, w1) = WIDTHS[rng.range(0, 3) as usize];
        // Distinct slots: two sequences of one batch never share a slot (their writes to one
        // ring row would race; the kernel and the reference order them differently).
        let bs = rng.range(1, 4.min(g.num_slots)) as usize;
        let mut slots: Vec<i32> = rng
            .distinct(bs, g.num_slots as u64)
            .into_iter()
            .map(|s| g.physical_slot(s).unwrap() as i32)
            .collect();
        if rng.chance(0.3) {
            slots[0] = g.slot_positions as i32; // stale: its rows fall past the view
        }
        let mut cu = vec![0i32];
        let mut positions = vec![];
        for _ in 0..bs {
            let n = rng.range(0, 20);
            let start = rng.range(0, 3000);
            positions.extend((start..start + n).map(|p| p as i32));
            cu.push(positions.len() as i32);
        }
        let t = positions.len();
        let wpb = rng.range(1, params.ring_slots) as i32;
        let kv0 = rng.bytes(t * w0 as usize + 1);
        let kv1 = rng.bytes(t * w1 as usize + 1);
        // Misalign the second plane's kv by one byte half the time (byte path).
        let off = usize::from(rng.chance(0.5) && w1 % 16 != 0);
        let outputs = vec![rng.bytes((view_rows * w0) as usize), rng.bytes((view_rows * w1) as usize)];
        compare(&emu, &format!("ring write case {case}"), &outputs, |outs| {
            let planes = plane_writes(outs, [addr(&kv0), addr(&kv1) + off as u64], (w0, w1));
            Launch::RingWrite(
                RingWriteArgs::default()
                    .with_params(params)
                    .with_planes(planes)
                    .with_positions(addr(&positions))
                    .with_cu_seqlens_q(addr(&cu))
                    .with_state_slot_per_seq(addr(&slots))
                    .with_view_rows(view_rows)
                    .with_num_seqs(bs as i32)
                    .with_write_per_batch(wpb),
            )
        });
    }
}

#[test]
fn row_scatter_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x7777_3333_9999_0000);
    for case in 0..40 {
        let view_rows = rng.range(1, 300);
        let (w0, w1) = WIDTHS[rng.range(0, 3) as usize];
        let t = rng.range(0, 20) as usize;
        let bids: Vec<i32> = (0..t).map(|_| if rng.chance(0.2) { -1 } else { 0 }).collect();
        // Distinct rows, some out of the view (negative or past it).
        let mut rows: Vec<i64> = (0..view_rows).collect();
        for i in (1..rows.len()).rev() {
            rows.swap(i, rng.range(0, i as i64) as usize);
        }
        let dest: Vec<i32> = (0..t)
            .map(|i| {
                if rng.chance(0.15) {
                    [-1, view_rows as i32, 1 << 30][rng.range(0, 2) as usize]
                } else {
                    rows[i % rows.len()] as i32
                }
            })
            .collect();
        let dest: Vec<i32> =
            dest.iter().enumerate().map(|(i, &d)| if i >= rows.len() { -1 } else { d }).collect();
        let kv0 = rng.bytes(t * w0 as usize);
        let kv1 = rng.bytes(t * w1 as usize);
        let outputs = vec![rng.bytes((view_rows * w0) as usize), rng.bytes((view_rows * w1) as usize)];
        compare(&emu, &format!("row scatter case {case}"), &outputs, |outs| {
            let planes = plane_writes(outs, [addr(&kv0), addr(&kv1)], (w0, w1));
            Launch::RowScatter(
                RowScatterArgs::default()
                    .with_planes(planes)
                    .with_batch_id_per_token(addr(&bids))
                    .with_dest_rows(addr(&dest))
                    .with_view_rows(view_rows)
                    .with_num_tokens(t as i32),
            )
        });
    }
}

/// Disjoint random ranges `(offset, len)` inside `total` bytes, offsets and lengths multiples
/// of `unit`.
fn disjoint_ranges(rng: &mut Rng, total: i64, count: usize, unit: i64, max_len: i64) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut cursor = 0;
    for _ in 0..count {
        let start = cursor + rng.range(0, 40) * unit;
        let len = rng.range(0, max_len / unit) * unit;
        if start + len > total {
            break;
        }
        out.push((start, len));
        cursor = start + len;
    }
    out
}

#[test]
fn fill_and_copy_runs_kernels_match_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x0123_4567_89ab_cdef);
    for case in 0..20 {
        let total = 200_000i64;
        let n = rng.range(0, 6) as usize;
        let fills = disjoint_ranges(&mut rng, total, n, 4, 40_000);
        let outputs = vec![rng.bytes(total as usize)];
        let patterns: Vec<u32> = fills.iter().map(|_| rng.next_u64() as u32).collect();
        compare(&emu, &format!("fill case {case}"), &outputs, |outs| {
            let base = outs[0].as_mut_ptr() as u64;
            let runs: Vec<FillRun> = fills
                .iter()
                .zip(&patterns)
                .map(|(&(o, l), &p)| FillRun { dst: base + o as u64, bytes: l as u64, pattern: p, _pad: 0 })
                .collect();
            // The descriptor must outlive the launch: leak it into the test (small).
            let runs: &'static [FillRun] = Box::leak(runs.into_boxed_slice());
            Launch::FillRuns(FillRunsArgs::default().with_runs(addr(runs)).with_num_runs(runs.len() as i32))
        });

        let src = rng.bytes(total as usize);
        let n = rng.range(0, 6) as usize;
        let copies = disjoint_ranges(&mut rng, total - 64, n, 1, 30_000);
        let shifts: Vec<i64> =
            copies.iter().map(|_| if rng.chance(0.5) { 0 } else { rng.range(0, 31) }).collect();
        let outputs = vec![rng.bytes(total as usize)];
        compare(&emu, &format!("copy case {case}"), &outputs, |outs| {
            let base = outs[0].as_mut_ptr() as u64;
            let runs: Vec<CopyRun> = copies
                .iter()
                .zip(&shifts)
                .map(|(&(o, l), &s)| CopyRun {
                    src: addr(&src) + (o + s) as u64,
                    dst: base + o as u64,
                    bytes: l as u64,
                })
                .collect();
            let runs: &'static [CopyRun] = Box::leak(runs.into_boxed_slice());
            Launch::CopyRuns(CopyRunsArgs::default().with_runs(addr(runs)).with_num_runs(runs.len() as i32))
        });
    }
}

/// Random finite, non-zero values as `ty` bytes (bf16: the upper half of an f32).
fn random_values(rng: &mut Rng, n: usize, bf16: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        let mut v = rng.range(-1 << 20, 1 << 20) as f32 / 4096.0;
        if v == 0.0 {
            v = 0.5;
        }
        if bf16 {
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_ne_bytes());
        } else {
            out.extend_from_slice(&v.to_ne_bytes());
        }
    }
    out
}

#[test]
fn state_update_kernel_matches_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0x3c3c_5a5a_0f0f_9696);
    for case in 0..60 {
        // The V4 dims (16-byte path), a small multiple of 8, and odd dims (element path).
        let dim = [256, 512, 1024, 8, 24, 13, 3][rng.range(0, 6) as usize] as i64;
        let (ratio, window) = if rng.chance(0.5) { (4, 8) } else { (128, 128) };
        let ring = window + rng.range(0, 5);
        let (in_bf16, ape_bf16) = (rng.chance(0.5), rng.chance(0.5));
        // Row strides: tight, padded, or (odd dims only) anything.
        let kv_stride = dim + [0, 8, 24][rng.range(0, 2) as usize];
        let score_stride = dim + [0, 8, 1][rng.range(0, 2) as usize];
        let positions = rng.range(1, 12);
        let state_row = dim * 4;
        // One plane holds both tensors: [kv ring x dim | score ring x dim | pad] per slot.
        let slot_bytes = 2 * ring * state_row + rng.range(0, 4) * 16;
        let bs = rng.range(1, positions.min(6)) as usize;
        let slots: Vec<i32> = {
            let mut all: Vec<i32> = (0..positions as i32).collect();
            for i in (1..all.len()).rev() {
                all.swap(i, rng.range(0, i as i64) as usize);
            }
            all[..bs].to_vec()
        };
        // Per sequence: up to K positions ending at its context, each ring row once.
        let mut plan: Vec<i32> = Vec::new();
        let mut tokens = 0i32;
        for (b, &slot) in slots.iter().enumerate() {
            let ctx = rng.range(1, 3000);
            let q = rng.range(1, window.min(ctx).min(12));
            for p in ctx - q..ctx {
                plan.extend([tokens, b as i32, p as i32, slot]);
                tokens += 1;
            }
        }
        let pads = rng.range(0, 5);
        for _ in 0..pads {
            plan.extend([rng.range(0, 9) as i32, rng.range(0, 9) as i32, -1, rng.range(0, 9) as i32]);
        }
        // Shuffled plan rows (any order is a valid plan): pads among live rows, ragged ids
        // that are not their plan row.
        if rng.chance(0.5) {
            let n = plan.len() / 4;
            for i in (1..n).rev() {
                let j = rng.range(0, i as i64) as usize;
                for c in 0..4 {
                    plan.swap(4 * i + c, 4 * j + c);
                }
            }
        }
        let num_rows = (plan.len() / 4) as i32;
        let rows = tokens.max(1) as usize;
        let kv = random_values(&mut rng, rows * kv_stride as usize, in_bf16);
        let score = random_values(&mut rng, rows * score_stride as usize, in_bf16);
        let ape = random_values(&mut rng, (ratio * dim) as usize, ape_bf16);
        let use_map = rng.chance(0.5);
        let plan: Vec<i32> = plan
            .chunks(4)
            .flat_map(|r| if use_map { [r[0], r[1], r[2], -5] } else { *<&[i32; 4]>::try_from(r).unwrap() })
            .collect();
        // 16-byte aligned copies (the kernel reads plan rows as vectors).
        let plan16: Vec<u128> = vec![0; plan.len() / 4 + 1];
        let plan_addr = plan16.as_ptr() as u64;
        // SAFETY: plan16 holds plan.len() / 4 + 1 16-byte rows.
        unsafe { std::ptr::copy_nonoverlapping(plan.as_ptr(), plan_addr as *mut i32, plan.len()) };
        let outputs = vec![rng.bytes((positions * slot_bytes) as usize + 64)];
        let kv_off = rng.range(0, 3) * 16; // where position 0 starts in the buffer
        let wrote = compare(&emu, &format!("state update case {case} dim {dim}"), &outputs, |outs| {
            let base = outs[0].as_mut_ptr() as u64 + kv_off as u64;
            Launch::StateUpdate(
                StateUpdateArgs::default()
                    .with_kv(addr(&kv))
                    .with_score(addr(&score))
                    .with_ape(addr(&ape))
                    .with_write_plan(plan_addr)
                    .with_slot_map(if use_map { addr(&slots) } else { 0 })
                    .with_kv_state(base)
                    .with_score_state(base + (ring * state_row) as u64)
                    .with_kv_slot_bytes(slot_bytes)
                    .with_score_slot_bytes(slot_bytes)
                    .with_kv_row_stride(kv_stride)
                    .with_score_row_stride(score_stride)
                    .with_num_rows(num_rows)
                    .with_dim(dim as i32)
                    .with_ring(ring as i32)
                    .with_window(window as i32)
                    .with_ratio(ratio as i32)
                    .with_in_dtype(i32::from(in_bf16))
                    .with_ape_dtype(i32::from(ape_bf16)),
            )
        });
        assert!(wrote || tokens == 0, "case {case}: nothing written");
    }
}

// ---- FlashMLA's convention (§3f, §5f) -------------------------------------------------------

/// A flashmla_common case on the host reference and on the emulated kernel: every buffer equal.
fn compare_case(emu: &Emu, case: &common::Case, make: &dyn Fn(&[u64]) -> Vec<Launch>) {
    // SAFETY (both): the case's buffers are live and sized for its launches (flashmla_common).
    let host = flashmla_common::run_in_memory(case, make, &|l| unsafe { run_launch(l) }.expect("reference"));
    let dev = flashmla_common::run_in_memory(case, make, &|l| unsafe { emu.run(l) });
    for ((h, d), b) in host.iter().zip(&dev).zip(&case.bufs) {
        assert!(h == d, "{}: buffer {}: kernel and host reference differ", case.name, b.name);
    }
}

#[test]
fn decode_builder_flashmla_rows_match_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0xf1a5_e111_0000_0001);
    for case_no in 0..36 {
        let ratios = [0, 4, 128, 4, 128, 128][..rng.range(3, 6) as usize].to_vec();
        let g = common::geometry_at(&ratios, rng.range(128, 133), rng.range(60_000, 300_000), 6);
        // Heads past one tile (4,096 entries) now and then: positions to 1.2M.
        let max_pos = if case_no % 6 == 5 { 1_200_000 } else { rng.range(100, 30_000) };
        let (bs, views) = (rng.range(1, 4) as usize, rng.range(1, 4) as usize);
        // Every fourth: MTP tokens whose heads straddle a multiple of 64 (the row limit's edge).
        let mut d = if case_no % 4 == 3 {
            flashmla_common::FlashDecode::mtp_edge(&mut rng, &g, bs, views)
        } else {
            flashmla_common::FlashDecode::random(&mut rng, &g, bs, max_pos, views)
        };
        // From case 24: rows per block 3 or 4 (a coarse ratio other than 128, which a config may
        // give), the head writer's forms other than its rows-per-block-2 groups; every head still
        // fits the table rows (head / rpb < head / 2).
        if case_no >= 24 {
            d.rpb = [3, 4][case_no % 2];
        }
        // Every third case: negative block ids in the tables, -1 in every form of the head
        // writer (§3f); every fifth of those with an envelope below the rows per block, where
        // a negative block's row is not negative (the rule is the block id's sign).
        if case_no % 3 == 1 {
            common::batches::negative_ids(&mut rng, &mut d.batch.tables, 9);
            if case_no % 5 == 1 {
                d.envelope = rng.range(0, 1);
            }
        }
        let (case, _, make) = d.case(&format!("flash decode {case_no}"), 0, true);
        compare_case(&emu, &case, &make);
    }
}

/// Batches of over 2,048 tokens with long heads: the grid then holds fewer FlashMLA tiles a
/// token than its row has (`DECODE_FLASH_BLOCKS`: 2 tiles of 4,096 entries a token, where rows
/// of up to 12,500 entries have 3 or 4), and each tile strides over the row.
#[test]
fn decode_builder_flashmla_rows_match_reference_in_large_batches() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0xf1a5_e111_0000_0003);
    for case_no in 0..3 {
        let bs = rng.range(2_100, 2_400) as usize;
        let g = common::geometry_at(&[0, 4, 128, 4, 128], rng.range(128, 133), 3_000_000, bs as i64);
        let d = flashmla_common::FlashDecode::random(&mut rng, &g, bs, 1_600_000, 1);
        let (case, _, make) = d.case(&format!("large flash decode {case_no}"), 0, true);
        // The case must take the striding form: fewer tiles than the row's width needs.
        let addrs: Vec<u64> = (1..=case.bufs.len() as u64).map(|i| i << 20).collect();
        let strided = make(&addrs).iter().any(|l| match l {
            Launch::Decode(a) => {
                let row =
                    u64::from(a.flashmla[CLASS_HCA].extra_topk as u32).div_ceil(u64::from(DECODE_FLASH_TILE));
                decode_hca_tiles(a) < row
            }
            _ => false,
        });
        assert!(strided, "{}: the grid covers every tile; the case tests nothing new", case.name);
        compare_case(&emu, &case, &make);
    }
}

#[test]
fn csa_pack_flashmla_rows_match_reference() {
    let Some(emu) = emu() else { return };
    let mut rng = Rng::new(0xf1a5_e111_0000_0002);
    for case_no in 0..24 {
        let g = common::geometry_at(&[0, 4, 128, 4], rng.range(128, 133), rng.range(60_000, 300_000), 6);
        // Top-k rows of the staged form (<= 512) and its wide form (> 512), an empty one (gather).
        let topk = rng.pick(&[1, 64, 512, 513, 1024, 2048]);
        let (bs, max_pos) = (rng.range(1, 4) as usize, rng.range(100, 40_000));
        let mut p = flashmla_common::FlashPack::random(&mut rng, &g, bs, max_pos, topk);
        if case_no % 3 == 1 {
            common::batches::negative_ids(&mut rng, &mut p.batch.tables, 9);
        }
        let (case, _, make) = p.case(&format!("flash pack {case_no}"), 0);
        compare_case(&emu, &case, &make);
    }
}
