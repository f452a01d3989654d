//! The entry tier's back ends beyond `std::fs` files (issue 46: the connector's shared tier in
//! files, NIXL POSIX or Mooncake Store):
//!
//! * `std_fs::*` / `nixl_posix::*`: [`EntryDir`] with its files' bytes through each
//!   [`TierIo`](v4pool::transfer::TierIo) (`tests/tiers/tier_io`): a multi-part round trip whose
//!   parts cross the body checksum's 1 MiB pieces, entries one I/O wrote read by the other, and
//!   the hostile rows of tests/tiers/entry_dir.rs through the I/O's own open (a FIFO, a link at an
//!   entry name, an entry longer than the budget, truncated and corrupt entries). The NIXL
//!   ones need `$V4POOL_NIXL_LIB` (docs/nixl.md; SKIP without, a failure with
//!   `V4POOL_REQUIRE_NIXL=1`: .ci/run's NIXL step) and leave no registration behind.
//! * `store_*`: [`EntryStore`] over an in-memory [`KvStore`] that checks the store contract
//!   (every buffer inside the registered one) and can be taken down: the value is byte for
//!   byte the file [`EntryDir`] writes; refused values are misses; a store that is down is a
//!   miss and a failed put, never a panic. The real Mooncake Store:
//!   tests/python/test_mooncake_entry_tier.py.

use crate::hostile_fs::{mkfifo, within_5s, TempDir};
use crate::tier_io::Io;
use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use v4pool::sim::Rng;
use v4pool::transfer::entry_dir::{EntryDir, Lookup};
use v4pool::transfer::entry_store::EntryStore;
use v4pool::transfer::{KvStore, NixlPosix, TierIo, TierReader};
use v4pool::VariantName;

const LAYOUT: &str = "vllm-test|deepseek_v4|block256|0:full:p1000|1:swa:w128";

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    Rng::new(seed).bytes(n)
}

fn temp_dir(tag: &str, io: Io) -> TempDir {
    TempDir::new(&format!("v4pool-entry-io-{tag}-{}", io.name()))
}

/// A [`TierIo`] that counts its calls, around the one under test: what a tier moved through
/// it (a tier that bypassed its I/O would count nothing).
#[derive(Debug)]
struct Counted(Box<dyn TierIo>, Arc<AtomicU64>, Arc<AtomicU64>);

impl TierIo for Counted {
    fn write_file(&self, path: &Path, head: &[u8], body: &[u8], sync: bool) -> io::Result<()> {
        self.1.fetch_add(1, SeqCst);
        self.0.write_file(path, head, body, sync)
    }
    fn write_pieces(&self, path: &Path, pieces: &[&[u8]], sync: bool) -> io::Result<()> {
        self.1.fetch_add(1, SeqCst);
        self.0.write_pieces(path, pieces, sync)
    }
    fn open(&self, path: &Path) -> io::Result<Box<dyn TierReader>> {
        self.2.fetch_add(1, SeqCst);
        self.0.open(path)
    }
}

/// A tier over `io` and what it did through it.
struct Tier {
    d: EntryDir,
    /// The NIXL agent, to count its registrations.
    nixl: Option<NixlPosix>,
    writes: Arc<AtomicU64>,
    opens: Arc<AtomicU64>,
}

/// A tier in `root` over `io`.
fn open(root: &Path, budget: u64, io: Io) -> Tier {
    let (boxed, nixl): (Box<dyn TierIo>, _) = match io {
        Io::StdFs => (io.boxed(), None),
        Io::NixlPosix => {
            let n = NixlPosix::from_env().expect("a NIXL agent with a POSIX backend");
            (Box::new(n.clone()), Some(n))
        }
    };
    let (writes, opens) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let counted = Box::new(Counted(boxed, writes.clone(), opens.clone()));
    let d = EntryDir::open_with_io(root, LAYOUT, budget, false, "", counted).unwrap();
    Tier { d, nixl, writes, opens }
}

impl Tier {
    /// Every put and read so far went through the I/O, and (NIXL) none left a registration.
    fn check(&self, puts: u64, reads: u64) {
        assert_eq!(self.writes.load(SeqCst), puts, "puts not through the tier's I/O");
        assert_eq!(self.opens.load(SeqCst), reads, "reads not through the tier's I/O");
        if let Some(n) = &self.nixl {
            assert_eq!(n.registrations(), 0, "a NIXL call left a registration behind");
        }
    }
}

fn round_trip_of_parts_across_checksum_pieces(io: Io) {
    let root = temp_dir("rt", io);
    let mut t = open(&root.0, 1 << 30, io);
    // Parts of odd lengths, one twice (the same memory at two offsets of the file).
    let (a, b, c) = (bytes((1 << 20) + 4097, 1), bytes(333, 2), bytes((2 << 20) - 5, 3));
    let key = 0xabc << 100 | 5;
    t.d.put('b', key, &[&a, &b, &c, &b]).unwrap();
    let want: Vec<u8> = [&a[..], &b, &c, &b].concat();
    let mut out = vec![0x5au8; want.len()];
    assert_eq!(t.d.get_into('b', key, &mut out), Lookup::Hit);
    assert!(out == want, "the body read back differs");
    assert_eq!(t.d.body_len('b', key), Some(want.len() as u64));
    // Another length than the caller's: foreign, untouched.
    assert_eq!(t.d.get_into('b', key, &mut [0u8; 10]), Lookup::Foreign);
    t.check(1, 3);
    // The file is the format's whatever moved it: read back by the other I/O, and its
    // entry read by this one.
    let other = if io == Io::StdFs { Io::NixlPosix } else { Io::StdFs };
    if other.runs("round_trip_of_parts_across_checksum_pieces, the other I/O") {
        let mut u = open(&root.0, 1 << 30, other);
        let mut out2 = vec![0u8; want.len()];
        assert_eq!(u.d.get_into('b', key, &mut out2), Lookup::Hit);
        assert!(out2 == want, "the other I/O read other bytes");
        u.d.put('c', 77, &[&c]).unwrap();
        u.check(1, 1);
        let mut out3 = vec![0u8; c.len()];
        assert_eq!(t.d.get_into('c', 77, &mut out3), Lookup::Hit);
        assert!(out3 == c, "this I/O read other bytes of the other's entry");
        t.check(1, 4);
    }
}

fn hostile_names_are_refused_through_the_io(io: Io) {
    let root = temp_dir("hostile", io);
    let mut t = open(&root.0, 64 << 20, io);
    let body = bytes(5000, 4);
    // A link at an entry name, to a whole valid entry outside: a miss, the link removed, the
    // target untouched.
    let hash = 0x42 << 120 | 7;
    t.d.put('c', hash, &[&body]).unwrap();
    let path = t.d.path_of('c', hash);
    let good = std::fs::read(&path).unwrap();
    let outside = root.0.join("outside-entry");
    std::fs::write(&outside, &good).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&outside, &path).unwrap();
    let mut out = vec![0xa5u8; body.len()];
    assert_eq!(t.d.get_into('c', hash, &mut out), Lookup::Corrupt, "a link at an entry name was read");
    assert!(std::fs::symlink_metadata(&path).is_err(), "the link stays at the entry's name");
    assert_eq!(std::fs::read(&outside).unwrap(), good, "the link's target changed");
    // A FIFO at an entry name: refused unopened (an open that blocked would hang here).
    let hash = 0x17 << 120 | 9;
    t.d.put('b', hash, &[&body]).unwrap();
    let path = t.d.path_of('b', hash);
    mkfifo(&path);
    let d = Arc::new(Mutex::new(t.d));
    let dd = d.clone();
    let n = body.len();
    let r = within_5s(&path, move || dd.lock().unwrap().get_into('b', hash, &mut vec![0u8; n]));
    assert_eq!(r.expect("get_into blocked in open on a FIFO at the entry's name"), Lookup::Corrupt);
    assert!(std::fs::symlink_metadata(&path).is_err(), "the FIFO stays at the entry's name");
    t.d = Arc::try_unwrap(d).unwrap().into_inner().unwrap();
    // A flipped body byte, a truncation, a header claiming more than the budget: misses,
    // removed, and the forgery refused before a byte of its body is read.
    let hash = 0x5a << 120 | 11;
    for cut in ["flip", "truncate", "claim"] {
        t.d.put('b', hash, &[&body]).unwrap();
        let path = t.d.path_of('b', hash);
        let mut raw = std::fs::read(&path).unwrap();
        let head_len = raw.len() - body.len();
        let claim = 96u64 << 20;
        match cut {
            "flip" => {
                let at = raw.len() - 100;
                raw[at] ^= 0x10;
            }
            "truncate" => raw.truncate(raw.len() - 1),
            _ => {
                // The header's own checksum recomputed: a forgery only the budget refuses,
                // over a sparse file of the length it claims.
                raw[40..48].copy_from_slice(&claim.to_le_bytes());
                let own = v4pool::transfer::shared_tier::checksum(&raw[..64]);
                raw[64..80].copy_from_slice(&own.to_le_bytes());
                raw.truncate(head_len);
            }
        }
        std::fs::write(&path, &raw).unwrap();
        let len = if cut == "claim" {
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(head_len as u64 + claim)
                .unwrap();
            claim as usize
        } else {
            body.len()
        };
        let mut out = vec![0xa5u8; len];
        assert_eq!(t.d.get_into('b', hash, &mut out), Lookup::Corrupt, "{cut}");
        assert!(!path.exists(), "{cut}: the refused entry stays");
        if cut == "claim" {
            assert!(out.iter().all(|&b| b == 0xa5), "the entry past the budget was read");
        }
    }
    assert_eq!(t.d.stats().corrupt, 5);
    t.check(5, 5);
}

per_io!(round_trip_of_parts_across_checksum_pieces, hostile_names_are_refused_through_the_io);

// ---- the entry tier in a key-value store ---------------------------------------------------

/// An in-memory store that checks the [`KvStore`] contract (every put and get inside the
/// registered buffer, no unregistration of an unknown buffer) and can be taken down (every
/// call an error, as `v4pool.mooncake.MooncakeStore` raises `MooncakeDown`).
#[derive(Debug, Default)]
struct CheckedStore {
    values: Mutex<HashMap<String, Vec<u8>>>,
    registered: Mutex<Vec<(u64, u64)>>,
    down: std::sync::atomic::AtomicBool,
    gets: AtomicU64,
}

impl CheckedStore {
    fn up(&self) -> io::Result<()> {
        if self.down.load(SeqCst) {
            return Err(io::Error::other("the store is down"));
        }
        Ok(())
    }
    fn inside(&self, addr: u64, len: usize) {
        let r = self.registered.lock().unwrap();
        assert!(
            r.iter().any(|&(a, n)| addr >= a && addr + len as u64 <= a + n),
            "a buffer outside the registered ones: {addr:#x}+{len} (registered {r:x?})"
        );
    }
}

/// The store behind a tier, shared with the test.
#[derive(Debug, Clone, Default)]
struct Shared(Arc<CheckedStore>);

impl KvStore for Shared {
    fn register_buffer(&self, addr: u64, len: u64) -> io::Result<()> {
        self.0.up()?;
        self.0.registered.lock().unwrap().push((addr, len));
        Ok(())
    }
    fn unregister_buffer(&self, addr: u64) -> io::Result<()> {
        let mut r = self.0.registered.lock().unwrap();
        let i = r.iter().position(|&(a, _)| a == addr).expect("unregistering a buffer never registered");
        r.remove(i);
        Ok(())
    }
    fn exist(&self, keys: &[String]) -> io::Result<Vec<bool>> {
        self.0.up()?;
        let m = self.0.values.lock().unwrap();
        Ok(keys.iter().map(|k| m.contains_key(k)).collect())
    }
    fn size(&self, key: &str) -> io::Result<Option<u64>> {
        self.0.up()?;
        Ok(self.0.values.lock().unwrap().get(key).map(|v| v.len() as u64))
    }
    fn put(&self, key: &str, data: &[u8]) -> io::Result<()> {
        self.0.up()?;
        self.0.inside(data.as_ptr() as u64, data.len());
        self.0.values.lock().unwrap().insert(key.to_string(), data.to_vec());
        Ok(())
    }
    fn get_into(&self, key: &str, dst: &mut [u8]) -> io::Result<()> {
        self.0.up()?;
        self.0.inside(dst.as_ptr() as u64, dst.len());
        self.0.gets.fetch_add(1, SeqCst);
        let m = self.0.values.lock().unwrap();
        let v = m.get(key).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        if v.len() != dst.len() {
            return Err(io::Error::other("another size"));
        }
        dst.copy_from_slice(v);
        Ok(())
    }
    fn remove(&self, key: &str) -> io::Result<bool> {
        self.0.up()?;
        Ok(self.0.values.lock().unwrap().remove(key).is_some())
    }
}

impl Shared {
    fn value(&self, key: &str) -> Vec<u8> {
        self.0.values.lock().unwrap()[key].clone()
    }
    fn set(&self, key: &str, v: Vec<u8>) {
        self.0.values.lock().unwrap().insert(key.to_string(), v);
    }
    fn held(&self, key: &str) -> bool {
        self.0.values.lock().unwrap().contains_key(key)
    }
    fn set_down(&self, down: bool) {
        self.0.down.store(down, SeqCst);
    }
}

#[test]
fn store_entries_are_the_files_bytes_and_round_trip() {
    let s = Shared::default();
    let mut t = EntryStore::new(Box::new(s.clone()), LAYOUT, 1 << 30).unwrap();
    let root = temp_dir("store-vs-file", Io::StdFs);
    let mut d = EntryDir::open(&root.0, LAYOUT, 1 << 30, false).unwrap();
    let (a, b) = (bytes((1 << 20) + 77, 11), bytes(4099, 12));
    let hash = 0x3c << 120 | 0xfeed;
    for kind in ['b', 'c'] {
        t.put(kind, hash, &[&a, &b]).unwrap();
        d.put(kind, hash, &[&a, &b]).unwrap();
        // One format: the store's value is the file's bytes.
        let key = t.key_of(kind, hash);
        assert!(
            key.starts_with("v4pool-entries-1/") && key.ends_with(&format!("{kind}{hash:032x}")),
            "{key}"
        );
        assert!(
            s.value(&key) == std::fs::read(d.path_of(kind, hash)).unwrap(),
            "the value is not the file's bytes"
        );
        assert!(t.contains(kind, hash));
        assert_eq!(t.body_len(kind, hash), Some((a.len() + b.len()) as u64));
        let mut out = vec![0u8; a.len() + b.len()];
        assert_eq!(t.get_into(kind, hash, &mut out), Lookup::Hit);
        assert!(out[..a.len()] == a[..] && out[a.len()..] == b[..]);
    }
    // A smaller entry after a larger one reuses the buffer; a larger one registers a new one,
    // the old unregistered first (the store checks both).
    t.put('b', 1, &[&b]).unwrap();
    let big = bytes(3 << 20, 13);
    t.put('b', 2, &[&big]).unwrap();
    let mut out = vec![0u8; big.len()];
    assert_eq!(t.get_into('b', 2, &mut out), Lookup::Hit);
    assert!(out == big);
    assert_eq!(s.0.registered.lock().unwrap().len(), 1);
    assert!(t.remove('b', 2) && !t.contains('b', 2));
    assert_eq!(t.get_into('b', 2, &mut out), Lookup::Absent);
    let st = t.stats();
    assert_eq!((st.puts, st.hits, st.absent, st.io_errors), (4, 3, 1, 0), "{st:?}");
    drop(t);
    assert!(s.0.registered.lock().unwrap().is_empty(), "the dropped tier kept its buffer registered");
}

#[test]
fn store_values_that_are_not_ours_are_misses() {
    let s = Shared::default();
    let cap = 8u64 << 20;
    let mut t = EntryStore::new(Box::new(s.clone()), LAYOUT, cap).unwrap();
    let body = bytes(200_000, 21);
    let hash = 0x77 << 120 | 1;
    let key = t.key_of('b', hash);
    t.put('b', hash, &[&body]).unwrap();
    let good = s.value(&key);
    let mut out = vec![0xa5u8; body.len()];
    let untouched = |o: &[u8]| o.iter().all(|&x| x == 0xa5);
    // Corrupt and truncated values: misses, removed, the caller's buffer untouched.
    let mut flipped = good.clone();
    flipped[good.len() - 3] ^= 1;
    for (what, v) in [
        ("flipped", flipped),
        ("truncated", good[..good.len() - 1].to_vec()),
        ("header only", good[..100].to_vec()),
    ] {
        s.set(&key, v);
        assert_eq!(t.get_into('b', hash, &mut out), Lookup::Corrupt, "{what}");
        assert!(untouched(&out) && !s.held(&key), "{what}: read, or left in the store");
    }
    // Another key's whole entry under this key: its header names another hash.
    t.put('b', hash + 1, &[&body]).unwrap();
    s.set(&key, s.value(&t.key_of('b', hash + 1)));
    assert_eq!(t.get_into('b', hash, &mut out), Lookup::Corrupt, "another key's entry");
    // Another layout's whole entry under this key: foreign, left; so is another length.
    let other = Shared::default();
    let mut o = EntryStore::new(Box::new(other.clone()), "another-layout", cap).unwrap();
    o.put('b', hash, &[&body]).unwrap();
    s.set(&key, other.value(&o.key_of('b', hash)));
    assert_eq!(t.get_into('b', hash, &mut out), Lookup::Foreign);
    assert!(untouched(&out) && s.held(&key));
    s.set(&key, good.clone());
    assert_eq!(t.get_into('b', hash, &mut vec![0u8; body.len() - 1]), Lookup::Foreign);
    // A value longer than the capacity is refused unfetched (a hostile size asks for nothing),
    // and so is one within it but longer than any entry of the caller's length (left).
    let gets = s.0.gets.load(SeqCst);
    s.set(&key, vec![0u8; cap as usize / 2]);
    assert_eq!(t.get_into('b', hash, &mut out), Lookup::Foreign);
    assert!(s.held(&key));
    s.set(&key, vec![0u8; cap as usize + 1]);
    assert_eq!(t.get_into('b', hash, &mut out), Lookup::Corrupt);
    assert_eq!(s.0.gets.load(SeqCst), gets, "a value past the capacity was fetched");
    assert_eq!(t.body_len('b', hash), None);
    // An entry larger than the capacity is never put.
    let e = t.put('b', 9, &[&vec![0u8; cap as usize]]).unwrap_err();
    assert_eq!(e.variant_name(), "TooLarge");
    let st = t.stats();
    assert_eq!((st.corrupt, st.foreign, st.hits), (5, 3, 0), "{st:?}");
}

#[test]
fn a_store_that_is_down_is_a_miss_and_a_failed_put() {
    let s = Shared::default();
    let mut t = EntryStore::new(Box::new(s.clone()), LAYOUT, 1 << 30).unwrap();
    let body = bytes(70_000, 31);
    t.put('b', 5, &[&body]).unwrap();
    s.set_down(true);
    let mut out = vec![0u8; body.len()];
    assert_eq!(t.get_into('b', 5, &mut out), Lookup::Absent);
    assert!(!t.contains('b', 5));
    assert_eq!(t.body_len('b', 5), None);
    assert!(!t.remove('b', 5));
    let e = t.put('b', 6, &[&body]).unwrap_err();
    assert_eq!(e.variant_name(), "Store");
    // A put that needs a larger buffer fails registering it: the same answer.
    let e = t.put('b', 7, &[&bytes(200_000, 32)]).unwrap_err();
    assert_eq!(e.variant_name(), "Store");
    let st = t.stats();
    assert_eq!((st.absent, st.put_errors, st.io_errors), (1, 2, 6), "{st:?}");
    // Back up: the entry written before is there, whole.
    s.set_down(false);
    assert_eq!(t.get_into('b', 5, &mut out), Lookup::Hit);
    assert!(out == body);
    t.put('b', 7, &[&bytes(200_000, 32)]).unwrap();
}
