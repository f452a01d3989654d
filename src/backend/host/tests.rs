//! The host backend's checks and its raw-pointer paths. Small enough to run under Miri
//! (`scripts/miri.sh`), which checks the copies, fills and reference kernels for undefined
//! behaviour; inputs are random (the crate's one generator, `rng::Rng`, seeded per test) and outputs
//! poisoned.

use super::*;
use crate::index::host::{hca_offsets, row_scatter, BlockTables, PlaneRows};
use crate::index::{
    CopyRun, CopyRunsArgs, FillRun, FillRunsArgs, HcaOffsetsArgs, PlaneWrite, RowScatterArgs,
};
use crate::rng::Rng;
use bytemuck::{bytes_of, cast_slice, Pod};

const S: Stream = Stream::DEFAULT;

/// Upload `data` into a fresh allocation of the backend.
fn put<T: Pod>(b: &HostBackend, data: &[T]) -> DeviceAllocation {
    let bytes: &[u8] = cast_slice(data);
    let a = b.alloc_zeroed(bytes.len() as u64).unwrap();
    // SAFETY: `a` holds `bytes.len()` bytes.
    unsafe { b.upload(a.ptr, bytes, S).unwrap() };
    a
}

fn get(b: &HostBackend, a: &DeviceAllocation) -> Vec<u8> {
    let mut out = vec![0u8; a.bytes as usize];
    // SAFETY: the whole of a live allocation.
    unsafe { b.download(&mut out, a.ptr, S).unwrap() };
    out
}

fn free_all(b: &HostBackend, allocs: impl IntoIterator<Item = DeviceAllocation>) {
    for a in allocs {
        // SAFETY: live, and unused after.
        unsafe { b.free(a) };
    }
    assert_eq!(b.live_allocations(), 0);
}

#[test]
fn allocations_are_aligned_zeroed_and_tracked() {
    let b = HostBackend::new();
    let a = b.alloc_zeroed(1000).unwrap();
    let z = b.alloc_zeroed(0).unwrap();
    assert_eq!(a.ptr % HOST_ALLOC_ALIGN as u64, 0);
    assert_eq!(z.ptr % HOST_ALLOC_ALIGN as u64, 0);
    assert_ne!(a.ptr, z.ptr);
    assert_eq!(b.live_allocations(), 2);
    assert_eq!(b.allocated_bytes(), 1000);
    assert!(get(&b, &a).iter().all(|&x| x == 0));
    // Freeing with the wrong size, or an address never handed out, leaves everything live.
    // SAFETY: both are refused without touching memory.
    unsafe {
        b.free(DeviceAllocation { ptr: a.ptr, bytes: 999 });
        b.free(DeviceAllocation { ptr: 0x1000, bytes: 1000 });
    }
    assert_eq!(b.live_allocations(), 2);
    free_all(&b, [a, z]);
}

#[test]
fn copies_and_fills_stay_inside_allocations() {
    let b = HostBackend::new();
    let mut rng = Rng::new(0x5eed_0001);
    let data = rng.bytes(64);
    let a = put(&b, &data);
    let poison = vec![0xa5u8; 64];
    let c = put(&b, &poison);
    // SAFETY: every range lies in `a` / `c` unless the call is expected to fail, and failing
    // calls are refused before touching memory.
    unsafe {
        b.copy(c.ptr + 8, a.ptr + 16, 32, S).unwrap();
        b.fill_u32(c.ptr + 48, 4, 0xdead_beef, S).unwrap();
        let mut want = poison.clone();
        want[8..40].copy_from_slice(&data[16..48]);
        for w in want[48..64].chunks_exact_mut(4) {
            w.copy_from_slice(&0xdead_beefu32.to_ne_bytes());
        }
        assert_eq!(get(&b, &c), want);
        let outside = |r: BackendResult<()>| matches!(r, Err(BackendError::OutsideAllocation { .. }));
        // One byte past the end, a bogus address, a range spanning two allocations.
        assert!(outside(b.upload(a.ptr + 1, &data, S)));
        assert!(outside(b.upload(0x1000, &data[..4], S)));
        let mut back = [0u8; 4];
        assert!(outside(b.download(&mut back, 0x1000, S)));
        assert!(outside(b.copy(0x1000, a.ptr, 4, S)));
        assert!(outside(b.copy(c.ptr, 0x1000, 4, S)));
        let (lo, hi) = if a.ptr < c.ptr { (&a, &c) } else { (&c, &a) };
        assert!(outside(b.copy(lo.ptr + 32, hi.ptr, hi.ptr - lo.ptr, S)));
        assert!(outside(b.fill_u32(0x1000, 1, 0, S)));
        assert!(outside(b.fill_u32(c.ptr + 60, 2, 0, S)));
        assert!(matches!(b.copy(a.ptr, a.ptr + 8, 16, S), Err(BackendError::Overlap { .. })));
        assert!(matches!(b.fill_u32(c.ptr + 2, 1, 0, S), Err(BackendError::Misaligned { .. })));
        assert!(matches!(b.fill_u32(c.ptr, u64::MAX / 2, 0, S), Err(BackendError::TooLarge { .. })));
        assert!(matches!(b.copy(u64::MAX - 2, a.ptr, 8, S), Err(BackendError::TooLarge { .. })));
        // Empty ranges touch nothing and are fine anywhere.
        b.copy(0x1000, 0x2000, 0, S).unwrap();
        b.fill_u32(0x1000, 0, 0, S).unwrap();
    }
    // Nothing the refused calls named was written.
    assert_eq!(get(&b, &a), data);
    assert_eq!(get(&b, &c)[..8], poison[..8]);
    free_all(&b, [a, c]);
}

#[test]
fn freed_memory_is_no_longer_addressable() {
    let b = HostBackend::new();
    let a = b.alloc_zeroed(64).unwrap();
    let addr = a.ptr;
    free_all(&b, [a]);
    // SAFETY: refused: the allocation is gone.
    let r = unsafe { b.fill_u32(addr, 4, 1, S) };
    assert!(matches!(r, Err(BackendError::OutsideAllocation { .. })), "{r:?}");
}

#[test]
fn bad_launches_are_errors() {
    let b = HostBackend::new();
    let l = Launch::RingWrite(Default::default());
    // SAFETY: rejected before any memory is touched.
    let err = unsafe { b.launch(&l, S) }.unwrap_err();
    assert!(matches!(err, BackendError::InvalidLaunch { kernel: "v4pool_ring_write", .. }));
    // SAFETY: the empty kernel touches nothing.
    unsafe { b.launch(&Launch::Empty, S).unwrap() };
}

/// Copy and fill runs on random data: the result equals the same moves on host vectors, and
/// bytes no run names keep their poison.
#[test]
fn copy_and_fill_runs_match_a_model() {
    let b = HostBackend::new();
    let mut rng = Rng::new(0x5eed_0002);
    let n = 512usize;
    let src_data = rng.bytes(n);
    let src = put(&b, &src_data);
    let dst = put(&b, &vec![0xa5u8; n]);
    let mut want = vec![0xa5u8; n];
    let mut runs = Vec::new();
    for k in 0..6u64 {
        // Disjoint 64-byte windows of the destination, random lengths and sources.
        let len = 4 * (1 + rng.below(15));
        let s = rng.below(n as u64 - len);
        let d = k * 64 + 4 * rng.below((64 - len) / 4 + 1);
        runs.push(CopyRun { src: src.ptr + s, dst: dst.ptr + d, bytes: len });
        want[d as usize..(d + len) as usize].copy_from_slice(&src_data[s as usize..(s + len) as usize]);
    }
    let desc = put(&b, &runs);
    let launch = Launch::CopyRuns(CopyRunsArgs { runs: desc.ptr, num_runs: runs.len() as i32, _pad: 0 });
    // SAFETY: every run lies in `src` / `dst` and the descriptor in `desc`.
    unsafe { b.launch(&launch, S).unwrap() };
    assert_eq!(get(&b, &dst), want);

    let pattern = rng.next_u64() as u32;
    let fills = [FillRun { dst: dst.ptr + 384, bytes: 64, pattern, _pad: 0 }];
    for w in want[384..448].chunks_exact_mut(4) {
        w.copy_from_slice(&pattern.to_ne_bytes());
    }
    let fdesc = put(&b, &fills);
    let launch = Launch::FillRuns(FillRunsArgs { runs: fdesc.ptr, num_runs: 1, _pad: 0 });
    // SAFETY: the run lies in `dst`.
    unsafe { b.launch(&launch, S).unwrap() };
    assert_eq!(get(&b, &dst), want);
    free_all(&b, [src, dst, desc, fdesc]);
}

/// The issue-10 cases: a run naming memory the backend never allocated (a bogus address, a
/// caller's own `Vec`, a range straddling an allocation's end) is an error and writes nothing,
/// whichever run of the descriptor it is.
#[test]
fn runs_outside_live_allocations_are_refused() {
    let b = HostBackend::new();
    let mut rng = Rng::new(0x5eed_0003);
    let data = rng.bytes(256);
    let a = put(&b, &data);
    // Words, so the address is 4-byte aligned for the fill runs (a byte vector need not be,
    // and then the run is refused for alignment before its range is checked).
    // u64 elements: the victim is 8-byte aligned everywhere (Miri included), so every refusal
    // below is for lying outside the allocations, not for alignment.
    let victim = vec![0x0000_0007_0000_0007u64; 8];
    let victim_addr = victim.as_ptr() as u64;
    let good = CopyRun { src: a.ptr, dst: a.ptr + 128, bytes: 64 };
    for bad in [
        CopyRun { src: a.ptr, dst: 0x1000, bytes: 16 },
        CopyRun { src: a.ptr, dst: victim_addr, bytes: 16 },
        CopyRun { src: 0x1000, dst: a.ptr, bytes: 16 },
        CopyRun { src: a.ptr, dst: a.ptr + 224, bytes: 64 },
    ] {
        let desc = put(&b, &[good, bad]);
        let l = Launch::CopyRuns(CopyRunsArgs { runs: desc.ptr, num_runs: 2, _pad: 0 });
        // SAFETY: refused before any run is copied.
        let r = unsafe { b.launch(&l, S) };
        assert!(matches!(r, Err(BackendError::OutsideAllocation { .. })), "{bad:?}: {r:?}");
        free_all_but(&b, desc);
    }
    for bad in [0x1000, victim_addr, a.ptr + 252] {
        let runs = [
            FillRun { dst: a.ptr, bytes: 16, pattern: 0, _pad: 0 },
            FillRun { dst: bad, bytes: 8, pattern: 0, _pad: 0 },
        ];
        let desc = put(&b, &runs);
        let l = Launch::FillRuns(FillRunsArgs { runs: desc.ptr, num_runs: 2, _pad: 0 });
        // SAFETY: refused before any run is written.
        let r = unsafe { b.launch(&l, S) };
        assert!(matches!(r, Err(BackendError::OutsideAllocation { .. })), "{bad:#x}: {r:?}");
        free_all_but(&b, desc);
    }
    // A descriptor that is itself outside, or longer than its allocation.
    let desc = put(&b, &[good]);
    for (runs, num_runs) in [(0x1000, 1), (victim_addr, 1), (desc.ptr, 2)] {
        let l = Launch::CopyRuns(CopyRunsArgs { runs, num_runs, _pad: 0 });
        // SAFETY: refused before the descriptor is read.
        let r = unsafe { b.launch(&l, S) };
        assert!(matches!(r, Err(BackendError::OutsideAllocation { .. })), "{runs:#x}: {r:?}");
    }
    assert_eq!(get(&b, &a), data, "a refused launch wrote");
    assert_eq!(victim, vec![0x0000_0007_0000_0007u64; 8]);
    free_all(&b, [a, desc]);
}

fn free_all_but(b: &HostBackend, a: DeviceAllocation) {
    // SAFETY: live and unused after.
    unsafe { b.free(a) };
}

/// Row scatter (two planes) and HCA offsets through raw pointers equal the safe references
/// on the same random inputs; a written buffer overlapping an input is refused.
#[test]
fn reference_kernels_through_raw_pointers() {
    let b = HostBackend::new();
    let mut rng = Rng::new(0x5eed_0004);
    let (t, rows, w0, w1) = (6usize, 9usize, 16usize, 4usize);
    let kv0 = rng.bytes(t * w0);
    let kv1 = rng.bytes(t * w1);
    let bids: Vec<i32> = (0..t).map(|i| if i == 2 { -1 } else { rng.below(3) as i32 }).collect();
    let dest: Vec<i32> = (0..t).map(|_| rng.below(rows as u64 + 2) as i32).collect();
    let (kv0_d, kv1_d, bids_d, dest_d) = (put(&b, &kv0), put(&b, &kv1), put(&b, &bids), put(&b, &dest));
    let pool0 = put(&b, &vec![0xa5u8; rows * w0]);
    let pool1 = put(&b, &vec![0x5au8; rows * w1]);
    let args = RowScatterArgs {
        planes: [
            PlaneWrite { kv: kv0_d.ptr, pool: pool0.ptr, row_bytes: w0 as i64 },
            PlaneWrite { kv: kv1_d.ptr, pool: pool1.ptr, row_bytes: w1 as i64 },
        ],
        batch_id_per_token: bids_d.ptr,
        dest_rows: dest_d.ptr,
        view_rows: rows as i64,
        num_tokens: t as i32,
        _pad: 0,
    };
    // SAFETY: every buffer is a live allocation of the sizes the kernel reads and writes.
    unsafe { b.launch(&Launch::RowScatter(args), S).unwrap() };
    let (mut want0, mut want1) = (vec![0xa5u8; rows * w0], vec![0x5au8; rows * w1]);
    let mut planes = [
        PlaneRows { kv: &kv0, pool: &mut want0, row_bytes: w0 },
        PlaneRows { kv: &kv1, pool: &mut want1, row_bytes: w1 },
    ];
    row_scatter(&mut planes, &bids, &dest, rows as i64, t as i32).unwrap();
    assert_eq!(get(&b, &pool0), want0);
    assert_eq!(get(&b, &pool1), want1);
    assert_ne!(want0, vec![0xa5u8; rows * w0], "nothing was scattered: the test proves nothing");

    // The pool view overlapping the kv rows it reads: refused, nothing written.
    let mut aliased = args;
    aliased.planes[0].pool = kv0_d.ptr;
    aliased.view_rows = (t * w0 / w0) as i64;
    // SAFETY: refused before anything is written.
    let r = unsafe { b.launch(&Launch::RowScatter(aliased), S) };
    assert!(matches!(r, Err(BackendError::InvalidLaunch { .. })), "{r:?}");
    assert_eq!(get(&b, &kv0_d), kv0);

    let n = 7usize;
    let (stride, rpb, envelope) = (3i32, 2i32, 40i64);
    let entries: Vec<i32> = (0..n).map(|_| rng.below((stride * rpb) as u64) as i32).collect();
    let ebids: Vec<i32> = (0..n).map(|_| rng.below(2) as i32).collect();
    let table: Vec<i32> = (0..2 * stride).map(|_| rng.below(50) as i32).collect();
    let (e_d, eb_d, tab_d) = (put(&b, &entries), put(&b, &ebids), put(&b, &table));
    let out = put(&b, &vec![-7i32; n]);
    let h = HcaOffsetsArgs {
        entry_idx: e_d.ptr,
        bid_per_entry: eb_d.ptr,
        block_tables: tab_d.ptr,
        out: out.ptr,
        envelope_rows: envelope,
        block_table_stride: stride,
        rows_per_block: rpb,
        num_entries: n as i32,
        _pad: 0,
    };
    // SAFETY: as above.
    unsafe { b.launch(&Launch::HcaOffsets(h), S).unwrap() };
    let mut want = vec![-7i32; n];
    hca_offsets(&entries, &ebids, &BlockTables { table: &table, stride }, envelope, rpb, &mut want).unwrap();
    assert_eq!(get(&b, &out), bytes_of_slice(&want));
    // `out` over `entry_idx`: refused.
    let aliased = HcaOffsetsArgs { out: e_d.ptr, ..h };
    // SAFETY: refused before anything is written.
    let r = unsafe { b.launch(&Launch::HcaOffsets(aliased), S) };
    assert!(matches!(r, Err(BackendError::InvalidLaunch { .. })), "{r:?}");
    assert_eq!(get(&b, &e_d), bytes_of_slice(&entries));
    free_all(&b, [kv0_d, kv1_d, bids_d, dest_d, pool0, pool1, e_d, eb_d, tab_d, out]);
}

fn bytes_of_slice(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| bytes_of(x).to_vec()).collect()
}
