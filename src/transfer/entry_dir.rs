//! A directory of whole, checksummed byte entries keyed by a kind letter and a 128-bit hash:
//! the tier an engine that owns its own KV layout (vLLM's per-block slab, `docs/vllm.md`)
//! stores block pages and checkpoints in, where [`super::shared_tier`] stores v4pool pool
//! units. The same discipline as the shared tier, without a `Pool`:
//!
//! * **An entry** is one file `<dir>/v4pool-entries-1/<layout digest>/<shard>/<kind><hash>`:
//!   a header (magic, kind, hash, the layout id's length, the body's length and checksum, the
//!   header's own checksum), the layout id's text, then the body. The caller describes the
//!   body (which pages of which tensors, in which order); the directory only keeps it whole.
//! * **Publishing** writes a temporary file beside the entry and renames it over the name: a
//!   reader sees a whole file or none; two publishers of one key both finish, the last wins.
//! * **Reading** checks the file's length, the header checksum, the kind and hash, the whole
//!   layout text, the body's length against what the caller expects and the body's checksum
//!   before it says [`Lookup::Hit`]; anything else is a miss, and a corrupt, truncated or
//!   foreign file is removed. The body is read into the caller's staging buffer, which the
//!   caller copies into engine memory only on a hit.
//! * **Capacity**: least recently used by modification time (a hit sets it), across every
//!   process sharing the directory; a publisher scans after writing 1/[`SCAN_EVERY`] of the
//!   budget and removes the oldest entries down to [`LOW_WATER`] per mille of it.
//!
//! A directory on tmpfs (`/dev/shm`) is a host tier every process of one machine shares (vLLM's
//! scheduler and its workers are separate processes); one on a fleet mount is a shared tier.

use super::shared_tier::{checksum, LOW_WATER, SCAN_EVERY, STALE_TEMP};
use crate::VariantName;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The folder inside the configured directory (the format's version is in its name).
pub const ENTRY_DIR: &str = "v4pool-entries-1";
const MAGIC: &[u8; 8] = b"v4poolE1";
/// Fixed header bytes before the layout text.
const FIXED: usize = 8 + 8 + 16 + 8 + 8 + 16 + 16;
const TEMP: &str = ".tmp-";
/// The longest layout id accepted (a header field of a foreign file is never trusted past it).
pub const MAX_LAYOUT: usize = 64 << 10;

/// Why a directory could not be used or an entry not stored.
#[derive(Debug, thiserror::Error)]
pub enum EntryDirError {
    /// A kind that is not an ASCII lower-case letter.
    #[error("entry kind {0:?} is not a lower-case ASCII letter")]
    BadKind(char),
    /// The layout id is empty or longer than [`MAX_LAYOUT`].
    #[error("layout id of {0} bytes (1..={MAX_LAYOUT})")]
    BadLayout(usize),
    /// The entry alone is larger than the budget.
    #[error("entry of {bytes} bytes exceeds the tier budget of {budget} bytes")]
    TooLarge {
        /// The entry's bytes.
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// The file system refused.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl VariantName for EntryDirError {
    fn variant_name(&self) -> &'static str {
        match self {
            EntryDirError::BadKind(_) => "BadKind",
            EntryDirError::BadLayout(_) => "BadLayout",
            EntryDirError::TooLarge { .. } => "TooLarge",
            EntryDirError::Io { .. } => "Io",
        }
    }
}

/// What a read found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The whole body is in the buffer, checked.
    Hit,
    /// No entry under the key (or the directory is gone).
    Absent,
    /// An entry whose header, length or checksum is wrong (removed).
    Corrupt,
    /// An entry of another layout, or of another body length than asked (removed only if
    /// its own checks fail).
    Foreign,
}

/// Counters since the directory was opened (this process only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryDirStats {
    /// Entries written.
    pub puts: u64,
    /// Bytes written (headers included).
    pub put_bytes: u64,
    /// Reads that hit.
    pub hits: u64,
    /// Reads of an absent key.
    pub absent: u64,
    /// Reads that found a corrupt or truncated entry.
    pub corrupt: u64,
    /// Reads that found an entry of another layout or length.
    pub foreign: u64,
    /// Entries removed by capacity scans.
    pub evicted: u64,
    /// Failed writes (the engine carried on).
    pub put_errors: u64,
}

/// The tier (see the module docs).
#[derive(Debug)]
pub struct EntryDir {
    dir: PathBuf,
    layout: String,
    budget: u64,
    sync: bool,
    /// Estimated bytes of the whole directory (every layout, every process).
    estimate: u64,
    written_since_scan: u64,
    stats: EntryDirStats,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> EntryDirError + 'a {
    move |source| EntryDirError::Io { what, path: path.to_path_buf(), source }
}

fn kind_ok(kind: char) -> Result<u8, EntryDirError> {
    if kind.is_ascii_lowercase() {
        Ok(kind as u8)
    } else {
        Err(EntryDirError::BadKind(kind))
    }
}

impl EntryDir {
    /// Open (creating) the tier for `layout` under `root`, bounded by `budget_bytes` for the
    /// whole `root/v4pool-entries-1`; `sync` makes every publish fsync before its rename.
    pub fn open(root: &Path, layout: &str, budget_bytes: u64, sync: bool) -> Result<EntryDir, EntryDirError> {
        if layout.is_empty() || layout.len() > MAX_LAYOUT {
            return Err(EntryDirError::BadLayout(layout.len()));
        }
        let digest = checksum(layout.as_bytes());
        let dir = root.join(ENTRY_DIR).join(format!("{digest:032x}"));
        fs::create_dir_all(&dir).map_err(io_err("creating", &dir))?;
        let mut d = EntryDir {
            dir,
            layout: layout.to_string(),
            budget: budget_bytes,
            sync,
            estimate: 0,
            written_since_scan: 0,
            stats: EntryDirStats::default(),
        };
        d.estimate = d.scan(false);
        Ok(d)
    }

    /// The folder of this layout's entries.
    pub fn layout_dir(&self) -> &Path {
        &self.dir
    }

    /// The counters.
    pub fn stats(&self) -> EntryDirStats {
        self.stats
    }

    /// The directory's estimated bytes (all layouts).
    pub fn used_bytes(&self) -> u64 {
        self.estimate
    }

    /// The file an entry lives in.
    pub fn path_of(&self, kind: char, hash: u128) -> PathBuf {
        self.dir.join(format!("{:02x}", (hash >> 120) as u8)).join(format!("{kind}{hash:032x}"))
    }

    /// Whether a file exists under the key (not checked: a read may still miss).
    pub fn contains(&self, kind: char, hash: u128) -> bool {
        self.path_of(kind, hash).is_file()
    }

    /// The body length an entry's header claims, `None` when absent or unreadable.
    pub fn body_len(&self, kind: char, hash: u128) -> Option<u64> {
        let mut f = fs::File::open(self.path_of(kind, hash)).ok()?;
        let mut head = [0u8; FIXED];
        f.read_exact(&mut head).ok()?;
        let h = Header::parse(&head)?;
        Some(h.body_len)
    }

    /// Publish `body` (the concatenation of `parts`) under the key, replacing any entry.
    pub fn put(&mut self, kind: char, hash: u128, parts: &[&[u8]]) -> Result<(), EntryDirError> {
        let k = kind_ok(kind)?;
        let body_len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let total = FIXED as u64 + self.layout.len() as u64 + body_len;
        if total > self.budget {
            return Err(EntryDirError::TooLarge { bytes: total, budget: self.budget });
        }
        let r = self.write(k, hash, parts, body_len);
        match &r {
            Ok(()) => {
                self.stats.puts += 1;
                self.stats.put_bytes += total;
                self.estimate += total;
                self.written_since_scan += total;
                if self.estimate > self.budget || self.written_since_scan > self.budget / SCAN_EVERY {
                    self.estimate = self.scan(true);
                    self.written_since_scan = 0;
                }
            }
            Err(_) => self.stats.put_errors += 1,
        }
        r
    }

    fn write(&self, kind: u8, hash: u128, parts: &[&[u8]], body_len: u64) -> Result<(), EntryDirError> {
        let path = self.path_of(kind as char, hash);
        let shard = path.parent().expect("an entry has a shard folder");
        fs::create_dir_all(shard).map_err(io_err("creating", shard))?;
        let mut sum = BodySum::default();
        for p in parts {
            sum.push(p);
        }
        let head =
            Header { kind, hash, layout_len: self.layout.len() as u64, body_len, body_sum: sum.finish() }
                .bytes();
        let tmp = shard.join(format!(
            "{TEMP}{}-{:x}-{:032x}",
            std::process::id(),
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
            hash
        ));
        let written = (|| -> io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&head)?;
            f.write_all(self.layout.as_bytes())?;
            for p in parts {
                f.write_all(p)?;
            }
            if self.sync {
                f.sync_all()?;
            }
            drop(f);
            fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(EntryDirError::Io { what: "publishing", path, source: e });
        }
        Ok(())
    }

    /// Read the entry's body into `dst`, which must be exactly its length: [`Lookup::Hit`]
    /// only when every check passed (see the module docs). `dst` may hold partial bytes after
    /// any other answer and must then not be used.
    pub fn get_into(&mut self, kind: char, hash: u128, dst: &mut [u8]) -> Lookup {
        let Ok(k) = kind_ok(kind) else { return Lookup::Absent };
        let path = self.path_of(kind, hash);
        let r = self.read(&path, k, hash, dst);
        match r {
            Lookup::Hit => {
                self.stats.hits += 1;
                // The LRU clock: a hit is a use. A failure to set it only ages the entry.
                if let Ok(f) = fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
            }
            Lookup::Absent => self.stats.absent += 1,
            Lookup::Corrupt => {
                self.stats.corrupt += 1;
                let _ = fs::remove_file(&path);
            }
            Lookup::Foreign => self.stats.foreign += 1,
        }
        r
    }

    fn read(&self, path: &Path, kind: u8, hash: u128, dst: &mut [u8]) -> Lookup {
        let Ok(mut f) = fs::File::open(path) else { return Lookup::Absent };
        let Ok(meta) = f.metadata() else { return Lookup::Absent };
        let mut head = [0u8; FIXED];
        if f.read_exact(&mut head).is_err() {
            return Lookup::Corrupt;
        }
        let Some(h) = Header::parse(&head) else { return Lookup::Corrupt };
        if h.kind != kind || h.hash != hash || h.layout_len > MAX_LAYOUT as u64 {
            return Lookup::Corrupt;
        }
        let want_len = FIXED as u64 + h.layout_len + h.body_len;
        if meta.len() != want_len {
            return Lookup::Corrupt;
        }
        let mut layout = vec![0u8; h.layout_len as usize];
        if f.read_exact(&mut layout).is_err() {
            return Lookup::Corrupt;
        }
        if layout != self.layout.as_bytes() || h.body_len != dst.len() as u64 {
            return Lookup::Foreign;
        }
        if f.read_exact(dst).is_err() {
            return Lookup::Corrupt;
        }
        let mut sum = BodySum::default();
        sum.push(dst);
        if sum.finish() != h.body_sum {
            return Lookup::Corrupt;
        }
        Lookup::Hit
    }

    /// Remove an entry; whether one was there.
    pub fn remove(&mut self, kind: char, hash: u128) -> bool {
        fs::remove_file(self.path_of(kind, hash)).is_ok()
    }

    /// Sum the whole tree's entry bytes; with `evict`, remove the oldest entries (every
    /// layout) until it is at [`LOW_WATER`] of the budget when it is over, and stale
    /// temporary files. Returns the bytes left.
    fn scan(&mut self, evict: bool) -> u64 {
        let Some(top) = self.dir.parent() else { return 0 };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
        let now = SystemTime::now();
        let Ok(layouts) = fs::read_dir(top) else { return 0 };
        for l in layouts.flatten() {
            let Ok(shards) = fs::read_dir(l.path()) else { continue };
            for s in shards.flatten() {
                let Ok(entries) = fs::read_dir(s.path()) else { continue };
                for e in entries.flatten() {
                    let Ok(m) = e.metadata() else { continue };
                    let mtime = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                    if e.file_name().to_string_lossy().starts_with(TEMP) {
                        if evict && now.duration_since(mtime).is_ok_and(|age| age > STALE_TEMP) {
                            let _ = fs::remove_file(e.path());
                        }
                        continue;
                    }
                    files.push((mtime, m.len(), e.path()));
                }
            }
        }
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        if evict && total > self.budget {
            let low = self.budget / 1000 * LOW_WATER;
            files.sort();
            for (_, len, path) in files {
                if total <= low {
                    break;
                }
                if fs::remove_file(&path).is_ok() {
                    total -= len;
                    self.stats.evicted += 1;
                }
            }
        }
        total
    }
}

struct Header {
    kind: u8,
    hash: u128,
    layout_len: u64,
    body_len: u64,
    body_sum: u128,
}

impl Header {
    fn bytes(&self) -> [u8; FIXED] {
        let mut h = [0u8; FIXED];
        h[..8].copy_from_slice(MAGIC);
        h[8] = self.kind;
        h[16..32].copy_from_slice(&self.hash.to_le_bytes());
        h[32..40].copy_from_slice(&self.layout_len.to_le_bytes());
        h[40..48].copy_from_slice(&self.body_len.to_le_bytes());
        h[48..64].copy_from_slice(&self.body_sum.to_le_bytes());
        let own = checksum(&h[..64]);
        h[64..80].copy_from_slice(&own.to_le_bytes());
        h
    }

    fn parse(h: &[u8; FIXED]) -> Option<Header> {
        if &h[..8] != MAGIC || checksum(&h[..64]).to_le_bytes() != h[64..80] {
            return None;
        }
        let u64_at = |a: usize| u64::from_le_bytes(h[a..a + 8].try_into().expect("8 bytes"));
        let u128_at = |a: usize| u128::from_le_bytes(h[a..a + 16].try_into().expect("16 bytes"));
        Some(Header {
            kind: h[8],
            hash: u128_at(16),
            layout_len: u64_at(32),
            body_len: u64_at(40),
            body_sum: u128_at(48),
        })
    }
}

/// The body's checksum: [`checksum`] of each [`PIECE`]-byte piece of the body, chained. The
/// writer's parts and the reader's one buffer are cut at the same body offsets, so both get
/// the same sum without the writer concatenating its parts.
#[derive(Default)]
struct BodySum {
    acc: u128,
    pending: Vec<u8>,
}

/// The body checksum's piece.
const PIECE: usize = 1 << 20;

impl BodySum {
    fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.pending.is_empty() && bytes.len() >= PIECE {
                self.fold(&bytes[..PIECE]);
                bytes = &bytes[PIECE..];
                continue;
            }
            let take = (PIECE - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() == PIECE {
                let p = std::mem::take(&mut self.pending);
                self.fold(&p);
            }
        }
    }
    fn fold(&mut self, piece: &[u8]) {
        self.acc = checksum(piece) ^ self.acc.rotate_left(13).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn finish(mut self) -> u128 {
        if !self.pending.is_empty() {
            let p = std::mem::take(&mut self.pending);
            self.fold(&p);
        }
        self.acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("v4pool-entry-dir-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        crate::rng::Rng::new(seed).bytes(n)
    }

    #[test]
    fn entries_round_trip_and_reject_what_is_not_theirs() {
        let root = tmp("rt");
        let mut d = EntryDir::open(&root, "layout-a", 1 << 30, false).unwrap();
        let (a, b) = (bytes(3 << 20, 1), bytes(12345, 2));
        d.put('b', 7, &[&a[..1000], &a[1000..], &b]).unwrap();
        let mut out = vec![0u8; a.len() + b.len()];
        assert_eq!(d.get_into('b', 7, &mut out), Lookup::Hit);
        assert_eq!(&out[..a.len()], &a[..]);
        assert_eq!(&out[a.len()..], &b[..]);
        assert_eq!(d.get_into('c', 7, &mut out), Lookup::Absent);
        // Another length than the caller's description: foreign, left in place.
        let mut short = vec![0u8; 10];
        assert_eq!(d.get_into('b', 7, &mut short), Lookup::Foreign);
        // Another layout reading the same directory sees nothing of ours.
        let mut other = EntryDir::open(&root, "layout-b", 1 << 30, false).unwrap();
        assert_eq!(other.get_into('b', 7, &mut out), Lookup::Absent);
        // A flipped body byte, then a truncation: misses, and the file is gone.
        let path = d.path_of('b', 7);
        let mut raw = fs::read(&path).unwrap();
        let n = raw.len();
        raw[n - 5] ^= 1;
        fs::write(&path, &raw).unwrap();
        assert_eq!(d.get_into('b', 7, &mut out), Lookup::Corrupt);
        assert!(!path.exists());
        d.put('b', 7, &[&a, &b]).unwrap();
        let raw = fs::read(&path).unwrap();
        fs::write(&path, &raw[..raw.len() - 1]).unwrap();
        assert_eq!(d.get_into('b', 7, &mut out), Lookup::Corrupt);
        // A foreign layout's file moved under our name: its header is whole, its layout not ours.
        other.put('b', 7, &[&a, &b]).unwrap();
        fs::copy(other.path_of('b', 7), &path).unwrap();
        assert_eq!(d.get_into('b', 7, &mut out), Lookup::Foreign);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used() {
        let root = tmp("lru");
        let entry = 64 << 10;
        let budget = 10 * (entry as u64 + 200);
        let mut d = EntryDir::open(&root, "l", budget, false).unwrap();
        let body = bytes(entry, 3);
        for h in 0..30u128 {
            d.put('b', h, &[&body]).unwrap();
        }
        assert!(d.used_bytes() <= budget);
        assert!(d.stats().evicted >= 20);
        let mut out = vec![0u8; entry];
        assert_eq!(d.get_into('b', 29, &mut out), Lookup::Hit);
        assert_eq!(d.get_into('b', 0, &mut out), Lookup::Absent);
        assert!(matches!(
            d.put('b', 99, &[&vec![0u8; budget as usize]]),
            Err(EntryDirError::TooLarge { .. })
        ));
        let _ = fs::remove_dir_all(&root);
    }
}
