//! The host backend commits memory lazily: a large allocation costs resident memory only for
//! the pages a run touches, and reads as zero everywhere (issue 10: `simulate` with a large
//! budget must not commit the whole budget up front). The test runs alone in a child process
//! of the suite binary, so no other test's allocations move the resident-set numbers it reads.

use crate::common;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};

/// Resident set size of this process in bytes (`VmRSS` of /proc/self/status), or `None`
/// where there is no procfs.
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[test]
fn large_allocations_commit_only_touched_pages() {
    let mut c = common::child_test(module_path!(), "child_large_allocations");
    c.env("V4POOL_RSS_CHILD", "1");
    common::print_child_output(&common::run_child_test(c, "large_allocations_commit_only_touched_pages"));
}

#[test]
#[ignore = "run as a child process by large_allocations_commit_only_touched_pages"]
fn child_large_allocations() {
    if std::env::var_os("V4POOL_RSS_CHILD").is_none() {
        println!("SKIP: child_large_allocations runs only as a child (alone in its process)");
        return;
    }
    let Some(before) = rss_bytes() else {
        println!("SKIP: no /proc/self/status on this system");
        return;
    };
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    let b = HostBackend::new();
    let a = b.alloc_zeroed(4 * GIB).expect("4 GiB of address space");
    let after_alloc = rss_bytes().unwrap();
    // Touch 16 pages spread over the allocation: one write each, read back with zeros around.
    let stride = a.bytes / 16;
    for k in 0..16u64 {
        let word = 0x0123_4567u32.wrapping_mul(k as u32 + 1);
        // SAFETY: inside `a`, 4-byte aligned (stride and base are multiples of 256).
        unsafe { b.fill_u32(a.ptr + k * stride, 1, word, Stream::DEFAULT).unwrap() };
        let mut back = [0xffu8; 12];
        // SAFETY: inside `a` (stride >= 256 MiB, so the 4 bytes before lie in the allocation
        // for k > 0; k = 0 reads from the start).
        let at = if k == 0 { a.ptr } else { a.ptr + k * stride - 4 };
        unsafe { b.download(&mut back, at, Stream::DEFAULT).unwrap() };
        let (lead, rest) = if k == 0 { (&back[..0], &back[..]) } else { back.split_at(4) };
        assert!(lead.iter().all(|&x| x == 0), "page before write {k} is not zero");
        assert_eq!(rest[..4], word.to_ne_bytes(), "write {k} did not land");
        assert!(rest[4..].iter().all(|&x| x == 0), "bytes after write {k} are not zero");
    }
    let after_touch = rss_bytes().unwrap();
    // SAFETY: live, unused after.
    unsafe { b.free(a) };
    println!(
        "RSS: before {} MiB, after a 4 GiB allocation {} MiB, after touching 16 pages {} MiB",
        before / MIB,
        after_alloc / MIB,
        after_touch / MIB
    );
    // Eager commitment would add 4096 MiB; lazy adds a few pages (and the test harness's noise).
    assert!(after_alloc.saturating_sub(before) < 64 * MIB, "the allocation was committed up front");
    assert!(after_touch.saturating_sub(before) < 64 * MIB, "touching 16 pages committed more");
}
