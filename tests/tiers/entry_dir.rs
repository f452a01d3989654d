//! The entry tier (`transfer::entry_dir`: whole checksummed entries of an engine that owns its
//! KV layout, vLLM's connector) as a hostile caller sees it, the rows of tests/tiers/shared_tier.rs's
//! issue-43 tests for this tier: a link at an entry name or as one of its folders, a FIFO at an
//! entry name, an entry longer than the budget, truncated and corrupt entries, two writers of
//! one key in one process, and files outside the tier's folders (or of no one's inside them)
//! never touched.

use crate::hostile_fs;

use hostile_fs::{age, mkfifo, outside_file, within_5s, TempDir};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;
use v4pool::sim::Rng;
use v4pool::transfer::entry_dir::{EntryDir, Lookup, ENTRY_DIR};
use v4pool::VariantName;

/// A fresh directory for one test.
fn temp_dir(tag: &str) -> TempDir {
    TempDir::new(&format!("v4pool-entry-{tag}"))
}

const LAYOUT: &str = "vllm-test|deepseek_v4|block256|0:full:p1000";

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    Rng::new(seed).bytes(n)
}

fn mtime(path: &Path) -> SystemTime {
    std::fs::symlink_metadata(path).unwrap().modified().unwrap()
}

/// An entry published for (`kind`, `hash`) and its file's bytes.
fn published(d: &mut EntryDir, kind: char, hash: u128, body: &[u8]) -> Vec<u8> {
    d.put(kind, hash, &[body]).unwrap();
    std::fs::read(d.path_of(kind, hash)).unwrap()
}

#[test]
fn a_linked_tier_or_layout_folder_is_refused_and_nothing_outside_is_touched() {
    let root = temp_dir("linked-folder");
    let entry_name = format!("b{:032x}", 0xabcdu128);
    // (a) The tier's folder is a link to a folder outside: refused, and nothing there touched
    // (a publisher's scan over a small budget removed every file it found in it).
    let (v, t) = (root.0.join("V"), root.0.join("T"));
    for name in ["notes.txt", entry_name.as_str(), ".tmp-notes"] {
        outside_file(&v.join("0123456789abcdef0123456789abcdef/ab").join(name), 4096);
    }
    std::fs::create_dir_all(&t).unwrap();
    std::os::unix::fs::symlink(&v, t.join(ENTRY_DIR)).unwrap();
    match EntryDir::open(&t, LAYOUT, 10_000, false) {
        Ok(mut d) => {
            let _ = d.put('b', 1, &[&bytes(6000, 1)]);
            let _ = d.put('b', 2, &[&bytes(6000, 2)]);
        }
        Err(e) => assert_eq!(e.variant_name(), "Io"),
    }
    for name in ["notes.txt", entry_name.as_str(), ".tmp-notes"] {
        let f = v.join("0123456789abcdef0123456789abcdef/ab").join(name);
        assert!(f.exists(), "{} outside the tier was removed (tier folder a link)", f.display());
    }
    assert!(EntryDir::open(&t, LAYOUT, 1 << 30, false).is_err(), "a linked tier folder was used");
    // (b) This layout's folder a link: refused, nothing outside touched.
    let t2 = root.0.join("T2");
    let layout_dir = EntryDir::open(&t2, LAYOUT, 1 << 30, false).unwrap().layout_dir().to_path_buf();
    std::fs::remove_dir_all(&layout_dir).unwrap();
    let v2 = root.0.join("V2");
    outside_file(&v2.join("ab").join(&entry_name), 4096);
    std::os::unix::fs::symlink(&v2, &layout_dir).unwrap();
    match EntryDir::open(&t2, LAYOUT, 10_000, false) {
        Ok(mut d) => {
            let _ = d.put('b', 0xab << 120 | 1, &[&bytes(6000, 1)]);
            let _ = d.put('b', 0xab << 120 | 2, &[&bytes(6000, 2)]);
        }
        Err(e) => assert_eq!(e.variant_name(), "Io"),
    }
    assert!(v2.join("ab").join(&entry_name).exists(), "a file outside was removed (layout folder a link)");
    let written: Vec<_> =
        std::fs::read_dir(v2.join("ab")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(written.len(), 1, "entries were written through a linked layout folder: {written:?}");
    assert!(EntryDir::open(&t2, LAYOUT, 1 << 30, false).is_err(), "a linked layout folder was used");
}

#[test]
fn a_linked_shard_folder_is_neither_written_read_nor_swept() {
    let root = temp_dir("linked-shard");
    let mut d = EntryDir::open(&root.0, LAYOUT, 1 << 30, false).unwrap();
    let hash = 0xcd << 120 | 5;
    let body = bytes(5000, 3);
    // A valid entry of this layout, moved outside, the shard folder a link to where it lies.
    let good = published(&mut d, 'b', hash, &body);
    let shard = d.path_of('b', hash).parent().unwrap().to_path_buf();
    std::fs::remove_dir_all(&shard).unwrap();
    let v = root.0.join("V");
    let outside_entry = v.join(format!("b{hash:032x}"));
    std::fs::create_dir_all(&v).unwrap();
    std::fs::write(&outside_entry, &good).unwrap();
    age(&outside_entry, 3600);
    outside_file(&v.join("notes.txt"), 10);
    std::os::unix::fs::symlink(&v, &shard).unwrap();
    let before = mtime(&outside_entry);
    // Read: a miss, the file outside neither removed nor touched.
    let mut out = vec![0u8; body.len()];
    let r = d.get_into('b', hash, &mut out);
    assert_ne!(r, Lookup::Hit, "an entry was read through a linked shard folder");
    assert!(outside_entry.exists(), "a file outside was removed through a linked shard folder");
    assert_eq!(mtime(&outside_entry), before, "a file outside was touched through a linked shard folder");
    assert!(!d.contains('b', hash), "contains looked through a linked shard folder");
    assert_eq!(d.body_len('b', hash), None, "body_len read through a linked shard folder");
    assert!(!d.remove('b', hash), "remove went through a linked shard folder");
    assert!(outside_entry.exists());
    // Write: refused, nothing written there.
    assert!(d.put('b', hash | 1, &[&body]).is_err(), "a publication went through a linked shard folder");
    let written: Vec<_> = std::fs::read_dir(&v).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(written.len(), 2, "a publication wrote through a linked shard folder: {written:?}");
    // Sweep: a small tier's publications scan past their budget; nothing outside goes.
    let mut small = EntryDir::open(&root.0, LAYOUT, 20_000, false).unwrap();
    for h in 0..8u128 {
        let _ = small.put('b', h, &[&body]);
    }
    assert!(outside_entry.exists() && v.join("notes.txt").exists(), "a scan removed files outside");
}

#[test]
fn a_link_at_an_entry_name_is_a_miss_and_its_target_is_untouched() {
    let root = temp_dir("linked-entry");
    let mut d = EntryDir::open(&root.0, LAYOUT, 1 << 30, false).unwrap();
    let hash = 0x42 << 120 | 7;
    let body = bytes(7000, 4);
    let good = published(&mut d, 'c', hash, &body);
    let path = d.path_of('c', hash);
    // The whole, valid entry now lives outside; a link to it sits at the entry's name.
    let outside = root.0.join("outside-entry");
    std::fs::write(&outside, &good).unwrap();
    age(&outside, 3600);
    let before = mtime(&outside);
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&outside, &path).unwrap();
    assert!(!d.contains('c', hash), "contains followed a link at an entry name");
    let mut out = vec![0xa5u8; body.len()];
    let r = d.get_into('c', hash, &mut out);
    assert_eq!(r, Lookup::Corrupt, "a link at an entry name was read");
    assert!(std::fs::symlink_metadata(&path).is_err(), "the link stays at the entry's name");
    std::os::unix::fs::symlink(&outside, &path).unwrap();
    assert_eq!(d.body_len('c', hash), None, "body_len followed a link at an entry name");
    assert!(std::fs::symlink_metadata(&path).is_err(), "the link stays at the entry's name");
    assert_eq!(std::fs::read(&outside).unwrap(), good, "the link's target changed");
    assert_eq!(mtime(&outside), before, "the link's target was touched (its mtime set)");
}

#[test]
fn a_fifo_at_an_entry_name_is_refused_unopened() {
    let root = temp_dir("fifo");
    let mut d = EntryDir::open(&root.0, LAYOUT, 64 << 20, false).unwrap();
    let hash = 0x17 << 120 | 9;
    published(&mut d, 'b', hash, &bytes(100, 5));
    let path = d.path_of('b', hash);
    mkfifo(&path);
    let d = Arc::new(std::sync::Mutex::new(d));
    let dd = d.clone();
    let r = within_5s(&path, move || {
        let mut out = vec![0u8; 100];
        dd.lock().unwrap().get_into('b', hash, &mut out)
    });
    assert_eq!(r.expect("get_into blocked in open on a FIFO at the entry's name"), Lookup::Corrupt);
    assert!(std::fs::symlink_metadata(&path).is_err(), "the FIFO stays at the entry's name");
    mkfifo(&path);
    let dd = d.clone();
    let n = within_5s(&path, move || dd.lock().unwrap_or_else(|e| e.into_inner()).body_len('b', hash));
    assert_eq!(n.expect("body_len blocked in open on a FIFO at the entry's name"), None);
    assert!(!d.lock().unwrap_or_else(|e| e.into_inner()).contains('b', hash));
}

#[test]
fn an_entry_longer_than_the_budget_is_refused_unread() {
    let root = temp_dir("oversized");
    let budget = 32u64 << 20;
    let mut d = EntryDir::open(&root.0, LAYOUT, budget, false).unwrap();
    let hash = 0x99 << 120 | 3;
    let body = bytes(4096, 6);
    let good = published(&mut d, 'b', hash, &body);
    let head_len = good.len() - body.len();
    // The header rewritten to claim a body of 96 MiB (its own checksum recomputed: a forgery
    // only a length rule can refuse), over a sparse file of exactly that length.
    let claim = 96u64 << 20;
    let mut h = good[..head_len].to_vec();
    h[40..48].copy_from_slice(&claim.to_le_bytes());
    let own = v4pool::transfer::shared_tier::checksum(&h[..64]);
    h[64..80].copy_from_slice(&own.to_le_bytes());
    let path = d.path_of('b', hash);
    let sparse = || {
        std::fs::write(&path, &h).unwrap();
        std::fs::File::options().write(true).open(&path).unwrap().set_len(head_len as u64 + claim).unwrap();
    };
    // Its size is not believed (a caller would allocate it) ...
    sparse();
    assert_eq!(d.body_len('b', hash), None, "the size of an entry past the budget was believed");
    assert!(!path.exists(), "the refused entry stays");
    // ... and a read of exactly the claimed length reads none of it.
    sparse();
    let mut out = vec![0xa5u8; claim as usize];
    let r = d.get_into('b', hash, &mut out);
    assert_eq!(r, Lookup::Corrupt);
    assert!(out.iter().all(|&b| b == 0xa5), "the entry past the budget was read into the buffer");
    assert!(!path.exists(), "the refused entry stays");
}

#[test]
fn truncated_and_corrupt_entries_are_misses_and_removed() {
    let root = temp_dir("corrupt");
    let mut d = EntryDir::open(&root.0, LAYOUT, 1 << 30, false).unwrap();
    let body = bytes(3 << 20, 7);
    for (what, cut) in [("a body byte flipped", None), ("truncated", Some(1usize)), ("header only", Some(0))]
    {
        let hash = 0x5a << 120 | 11;
        let good = published(&mut d, 'b', hash, &body);
        let path = d.path_of('b', hash);
        let mut raw = good.clone();
        match cut {
            None => {
                let n = raw.len();
                raw[n - 1000] ^= 0x10;
            }
            Some(0) => raw.truncate(good.len() - body.len()),
            Some(k) => raw.truncate(raw.len() - k),
        }
        std::fs::write(&path, &raw).unwrap();
        let mut out = vec![0u8; body.len()];
        assert_eq!(d.get_into('b', hash, &mut out), Lookup::Corrupt, "{what}");
        assert!(!path.exists(), "{what}: the entry stays");
    }
    assert_eq!(d.stats().corrupt, 3);
}

#[test]
fn scans_remove_only_the_tiers_own_names() {
    let root = temp_dir("own-names");
    let mut d = EntryDir::open(&root.0, LAYOUT, 1 << 30, false).unwrap();
    let hash = 0x33 << 120 | 1;
    published(&mut d, 'b', hash, &bytes(100, 8));
    let shard = d.path_of('b', hash).parent().unwrap().to_path_buf();
    // Files of no one's in the tier's own folders, an hour old (older than any entry).
    let strays = [
        shard.join("notes.txt"),
        shard.join(".tmp-notes"),
        d.layout_dir().join("notes.txt"),
        root.0.join(ENTRY_DIR).join("notes.txt"),
        d.layout_dir().join("zz/notes.txt"),
    ];
    for s in &strays {
        outside_file(s, 4096);
    }
    // A dead writer's temporary file, of the tier's own naming, older than the stale age.
    let mut small = EntryDir::open(&root.0, LAYOUT, 30_000, false).unwrap();
    for h in 0..20u128 {
        let _ = small.put('b', h, &[&bytes(5000, h as u64)]);
    }
    assert!(small.stats().evicted > 0, "{:?}", small.stats());
    for s in &strays {
        assert!(s.exists(), "{} (not the tier's) was removed by a scan", s.display());
    }
}

/// Every file (not folder) under `dir`.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(files_under(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

#[test]
fn two_tiers_in_one_process_publish_the_same_keys() {
    const WRITERS: usize = 4;
    let dir = temp_dir("two-writers");
    let key = |i: u128| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) << 8 | i;
    for round in 0..5 {
        let barrier = Arc::new(std::sync::Barrier::new(WRITERS));
        let writers: Vec<_> = (0..WRITERS)
            .map(|_| {
                let (barrier, dir) = (barrier.clone(), dir.0.clone());
                std::thread::spawn(move || {
                    let mut t = EntryDir::open(&dir, LAYOUT, 1 << 30, false).unwrap();
                    barrier.wait();
                    // Every writer's body for a key is the same bytes (content-addressed).
                    (0..100u128)
                        .filter(|&i| t.put('b', key(i), &[&bytes(2000, i as u64)]).is_err())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let failed: Vec<Vec<u128>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
        let mut t = EntryDir::open(&dir.0, LAYOUT, 1 << 30, false).unwrap();
        let mut out = vec![0u8; 2000];
        let bad: Vec<u128> =
            (0..100u128).filter(|&i| t.get_into('b', key(i), &mut out) != Lookup::Hit).collect();
        assert!(bad.is_empty(), "round {round}: keys with no whole entry: {bad:?}");
        assert!(failed.iter().all(|f| f.is_empty()), "round {round}: publications failed: {failed:?}");
        for i in 0..100u128 {
            assert!(t.remove('b', key(i)));
        }
        let left = files_under(t.layout_dir());
        assert!(left.is_empty(), "round {round}: files left behind: {left:?}");
    }
}

/// A tier opened with checkpoints ('c') to evict first removes its layout's checkpoints,
/// oldest first, before an older block; then blocks by LRU. Plain `open` is one LRU. The
/// budget holds three entries under the low-water mark and not four, so each overflowing put
/// removes exactly one entry (the index-only model in tests/vllm uses the same sizes).
#[test]
fn a_tier_ordered_to_evict_checkpoints_first_keeps_older_blocks() {
    let root = temp_dir("evict-first");
    let body = bytes(4000, 11);
    let entry = (80 + LAYOUT.len() + body.len()) as u64;
    let budget = entry * 34 / 10;
    let run = |order: &str| {
        let dir = root.0.join(if order.is_empty() { "lru" } else { "ordered" });
        let mut d = EntryDir::open_ordered(&dir, LAYOUT, budget, false, order).unwrap();
        // An old block, a newer checkpoint, a newer block: then a fourth entry overflows.
        for (kind, hash, secs) in [('b', 1u128, 300), ('c', 2, 200), ('b', 3, 100)] {
            d.put(kind, hash, &[&body]).unwrap();
            age(&d.path_of(kind, hash), secs);
        }
        d.put('b', 4, &[&body]).unwrap();
        let held: Vec<(char, u128)> =
            [('b', 1), ('c', 2), ('b', 3), ('b', 4)].into_iter().filter(|&(k, h)| d.contains(k, h)).collect();
        (d, held)
    };
    let (_, lru) = run("");
    assert_eq!(lru, vec![('c', 2), ('b', 3), ('b', 4)], "plain LRU: the oldest entry goes");
    let (mut d, ordered) = run("c");
    assert_eq!(ordered, vec![('b', 1), ('b', 3), ('b', 4)], "the checkpoint went before the older block");
    // No checkpoint left: blocks by LRU.
    d.put('b', 5, &[&body]).unwrap();
    assert!(!d.contains('b', 1) && d.contains('b', 3) && d.contains('b', 5));
    assert_eq!(d.stats().evicted, 2);
    assert!(d.used_bytes() <= budget);
    let e = EntryDir::open_ordered(&root.0, LAYOUT, budget, false, "C").unwrap_err();
    assert_eq!(e.variant_name(), "BadKind");
}
