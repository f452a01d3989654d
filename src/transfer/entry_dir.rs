//! A directory of whole, checksummed byte entries keyed by a kind letter and a 128-bit hash:
//! the tier an engine that owns its own KV layout (vLLM's per-block slab, `docs/vllm.md`)
//! stores block pages and checkpoints in, where [`super::shared_tier`] stores v4pool pool
//! units. The same file mechanics as the shared tier (`transfer::tier_files`, one place for
//! both), without a `Pool`:
//!
//! * **An entry** is one file `<dir>/v4pool-entries-1/<layout digest>/<shard>/<kind><hash>`:
//!   a header (magic, kind, hash, the layout id's length, the body's length and checksum, the
//!   header's own checksum), the layout id's text, then the body. The caller describes the
//!   body (which pages of which tensors, in which order); the directory only keeps it whole.
//! * **Its own folders and names only.** The tier, layout and shard folders must be real
//!   directories (a link there is refused: the tier is not opened, a publication or read
//!   through it fails, a scan skips it); an entry name holding anything but a regular file (a
//!   link, a FIFO) is a corrupt entry, never opened or followed; scans list and remove only
//!   names the tier writes.
//! * **Publishing** writes a temporary file of a name unique to its writer, created
//!   exclusively, beside the entry and renames it over the name: a reader sees a whole file
//!   or none; two publishers of one key both finish, the last wins.
//! * **Reading** checks, before the body is read, that the file is no longer than the budget
//!   (no entry larger is ever published: a sparse file claiming gigabytes is refused unread)
//!   and its length, the header checksum, the kind and hash, the whole layout text and the
//!   body's length against what the caller expects; then the body's checksum, before it says
//!   [`Lookup::Hit`]. Anything else is a miss, and a corrupt, truncated or non-regular entry is
//!   removed. The body is read into the caller's staging buffer, which the caller copies into
//!   engine memory only on a hit.
//! * **Capacity**: least recently used by modification time (a hit or a
//!   [`refresh`](EntryDir::refresh) sets it), across every process sharing the directory. A
//!   publisher lists the directory after writing 1/[`SCAN_EVERY`](super::shared_tier::SCAN_EVERY)
//!   of the budget; a scan over budget removes entries in [`evict_order`] down to the budget and
//!   keeps the rest of that order, and a later put over budget removes the next of those (any
//!   used or rewritten since is skipped: its modification time moved) without listing again
//!   ([`EntryDir::sweep_rule`]). The tier is used to its budget, where the shared tier's sweep
//!   leaves 10% of it empty after each scan. A tier opened with kinds to evict first
//!   ([`EntryDir::open_ordered`]) puts its own layout's entries of those kinds, oldest first,
//!   before any other entry in that order: an engine whose block runs stay useful without their
//!   checkpoints (V4.1, which replays the window after a run of blocks) loses its checkpoints
//!   before its blocks.
//!
//! A directory on tmpfs (`/dev/shm`) is a host tier every process of one machine shares (vLLM's
//! scheduler and its workers are separate processes); one on a fleet mount is a shared tier.
//!
//! The entry files' bytes go through a [`TierIo`] ([`EntryDir::open_with_io`]): `std::fs`
//! ([`StdFs`], the default) or NIXL's POSIX plugin ([`NixlPosix`](super::NixlPosix)), whose
//! opens follow the same rules (the trait's contract); folders, names, renames, removals and
//! scans stay POSIX calls here. The same entries in a key-value store (Mooncake Store):
//! [`super::entry_store`].

use super::shared_tier::{checksum, StdFs, TierIo, TierReader};
use super::tier_files::{self, entry_name, parse_entry_name};
use crate::VariantName;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The folder inside the configured directory (the format's version is in its name).
pub const ENTRY_DIR: &str = "v4pool-entries-1";
const MAGIC: &[u8; 8] = b"v4poolE1";
/// Fixed header bytes before the layout text.
pub(crate) const FIXED: usize = 8 + 8 + 16 + 8 + 8 + 16 + 16;
/// Hex digits of a layout folder's name (the layout id's checksum).
pub(crate) const DIGEST_HEX: usize = 32;
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
    /// The file system refused (or a tier folder is not the tier's own: a link).
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The key-value store refused or did not answer (an
    /// [`EntryStore`](super::entry_store::EntryStore): the store down, full).
    #[error("{what} {key}: {source}")]
    Store {
        /// What was being done.
        what: &'static str,
        /// The store key.
        key: String,
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
            EntryDirError::Store { .. } => "Store",
        }
    }
}

/// What a read found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The whole body is in the buffer, checked.
    Hit,
    /// No entry under the key (or the directory is gone, or a folder on its way is a link).
    Absent,
    /// An entry whose header, length or checksum is wrong, longer than the budget, or not a
    /// regular file (removed).
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
    /// Key-value store calls that failed (an [`EntryStore`](super::entry_store::EntryStore):
    /// the store down or refusing; a read so failed is counted absent too). 0 for files.
    pub io_errors: u64,
}

/// The tier (see the module docs).
#[derive(Debug)]
pub struct EntryDir {
    /// `<root>/v4pool-entries-1`.
    tier_dir: PathBuf,
    /// `<tier_dir>/<layout digest>`.
    dir: PathBuf,
    layout: String,
    budget: u64,
    sync: bool,
    /// Kind letters whose entries (of this layout) a full tier removes first.
    evict_first: Vec<u8>,
    /// Estimated bytes of the whole directory (every layout, every process).
    estimate: u64,
    written_since_scan: u64,
    /// The entries the last scan left, in eviction order, each with the modification time it
    /// had then: a put that takes the directory over budget evicts from here, down to the
    /// budget, without listing the directory again. Those of the kinds evicted first (with
    /// this process's puts of them since, oldest first), then the others (reversed: the next
    /// to go last).
    queue_first: std::collections::VecDeque<Queued>,
    queue: Vec<Queued>,
    stats: EntryDirStats,
    /// What moves the entry files' bytes.
    io: Box<dyn TierIo>,
}

/// An entry a scan found and left, as the scan saw it.
#[derive(Debug)]
struct Queued {
    path: PathBuf,
    mtime: std::time::SystemTime,
    bytes: u64,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> EntryDirError + 'a {
    move |source| EntryDirError::Io { what, path: path.to_path_buf(), source }
}

pub(crate) fn kind_ok(kind: char) -> Result<u8, EntryDirError> {
    if kind.is_ascii_lowercase() {
        Ok(kind as u8)
    } else {
        Err(EntryDirError::BadKind(kind))
    }
}

/// An entry file opened and its header checked (before its layout text and body are read).
struct Opened {
    file: Box<dyn TierReader>,
    head: Header,
}

impl EntryDir {
    /// Open (creating) the tier for `layout` under `root`, bounded by `budget_bytes` for the
    /// whole `root/v4pool-entries-1`; `sync` makes every publish fsync before its rename. The
    /// tier and layout folders must be real directories (a link there is an `Io` error).
    pub fn open(root: &Path, layout: &str, budget_bytes: u64, sync: bool) -> Result<EntryDir, EntryDirError> {
        EntryDir::open_ordered(root, layout, budget_bytes, sync, "")
    }

    /// [`EntryDir::open`], with the kind letters (`evict_first`, each a lower-case ASCII
    /// letter) whose entries of this layout a scan over budget removes before any other entry
    /// ([`evict_order`]); `""` is plain LRU.
    pub fn open_ordered(
        root: &Path,
        layout: &str,
        budget_bytes: u64,
        sync: bool,
        evict_first: &str,
    ) -> Result<EntryDir, EntryDirError> {
        EntryDir::open_with_io(root, layout, budget_bytes, sync, evict_first, Box::new(StdFs))
    }

    /// [`EntryDir::open_ordered`] with the entry files' bytes moved by `io` (a
    /// [`NixlPosix`](super::NixlPosix) for NIXL's POSIX plugin; [`StdFs`] is the default).
    pub fn open_with_io(
        root: &Path,
        layout: &str,
        budget_bytes: u64,
        sync: bool,
        evict_first: &str,
        io: Box<dyn TierIo>,
    ) -> Result<EntryDir, EntryDirError> {
        let evict_first = evict_first.chars().map(kind_ok).collect::<Result<Vec<u8>, _>>()?;
        if layout.is_empty() || layout.len() > MAX_LAYOUT {
            return Err(EntryDirError::BadLayout(layout.len()));
        }
        // The configured directory itself is the caller's (its path may hold links it chose).
        fs::create_dir_all(root).map_err(io_err("creating", root))?;
        let tier_dir = root.join(ENTRY_DIR);
        let dir = tier_dir.join(format!("{:0w$x}", checksum(layout.as_bytes()), w = DIGEST_HEX));
        tier_files::make_own_folders(&[&tier_dir, &dir])
            .map_err(io_err("opening the tier's folders", &dir))?;
        let mut d = EntryDir {
            tier_dir,
            dir,
            layout: layout.to_string(),
            budget: budget_bytes,
            sync,
            evict_first,
            estimate: 0,
            written_since_scan: 0,
            queue_first: std::collections::VecDeque::new(),
            queue: Vec::new(),
            stats: EntryDirStats::default(),
            io,
        };
        d.scan();
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

    fn shard_dir(&self, hash: u128) -> PathBuf {
        self.dir.join(format!("{:02x}", (hash >> 120) as u8))
    }

    /// The file an entry lives in.
    pub fn path_of(&self, kind: char, hash: u128) -> PathBuf {
        self.shard_dir(hash).join(entry_name(kind, hash))
    }

    /// The entry's path, its folders checked to be the tier's own (not links).
    fn own_path(&self, kind: char, hash: u128) -> io::Result<PathBuf> {
        let shard = self.shard_dir(hash);
        tier_files::own_folders(&[&self.tier_dir, &self.dir, &shard])?;
        Ok(shard.join(entry_name(kind, hash)))
    }

    /// Whether a regular file of a plausible length (a header, at most the budget) is there
    /// under the key (not checked: a read may still miss).
    pub fn contains(&self, kind: char, hash: u128) -> bool {
        let min = (FIXED + self.layout.len()) as u64;
        self.own_path(kind, hash).is_ok_and(|p| {
            fs::symlink_metadata(p)
                .is_ok_and(|m| m.file_type().is_file() && m.len() >= min && m.len() <= self.budget)
        })
    }

    /// The body length an entry's checked header claims (never more than the budget), `None`
    /// when absent, unreadable or refused (a refused entry is removed, as by
    /// [`EntryDir::get_into`]).
    pub fn body_len(&mut self, kind: char, hash: u128) -> Option<u64> {
        match self.open_checked(kind, hash) {
            Ok((_, o)) => Some(o.head.body_len),
            Err((path, r)) => {
                self.count(r, path.as_deref());
                None
            }
        }
    }

    /// Open `(kind, hash)`'s entry and check what can be checked before its layout text and
    /// body are read; on a refusal, the answer and (for a corrupt entry) the path to remove.
    #[allow(clippy::type_complexity)]
    fn open_checked(&self, kind: char, hash: u128) -> Result<(PathBuf, Opened), (Option<PathBuf>, Lookup)> {
        let Ok(k) = kind_ok(kind) else { return Err((None, Lookup::Absent)) };
        // A folder on the way that is absent or a link: nothing of the tier's is there.
        let Ok(path) = self.own_path(kind, hash) else { return Err((None, Lookup::Absent)) };
        let corrupt = |p: &Path| Err((Some(p.to_path_buf()), Lookup::Corrupt));
        // The I/O's open refuses a non-regular file (`InvalidData`) unopened, never blocking
        // nor following a link (`TierIo::open`'s contract).
        let mut file = match self.io.open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => return corrupt(&path),
            Err(_) => return Err((None, Lookup::Absent)),
        };
        let len = file.len();
        // Never a read past the header of a file the tier could not have written.
        if !plausible_len(len, self.budget) {
            return corrupt(&path);
        }
        let mut head = [0u8; FIXED];
        if file.read_exact_at(0, &mut head).is_err() {
            return corrupt(&path);
        }
        match Header::check(&head, k, hash, len) {
            Some(h) => Ok((path, Opened { file, head: h })),
            None => corrupt(&path),
        }
    }

    /// Count a refusal, removing a corrupt entry at `path`.
    fn count(&mut self, r: Lookup, path: Option<&Path>) {
        match r {
            Lookup::Hit => self.stats.hits += 1,
            Lookup::Absent => self.stats.absent += 1,
            Lookup::Corrupt => {
                self.stats.corrupt += 1;
                // Refused for good (a link or FIFO there is removed, never followed): the next
                // publisher writes it anew.
                if let Some(p) = path {
                    let _ = fs::remove_file(p);
                }
            }
            Lookup::Foreign => self.stats.foreign += 1,
        }
    }

    /// Publish `body` (the concatenation of `parts`) under the key, replacing any entry.
    pub fn put(&mut self, kind: char, hash: u128, parts: &[&[u8]]) -> Result<(), EntryDirError> {
        let k = kind_ok(kind)?;
        let total = entry_bytes(&self.layout, parts.iter().map(|p| p.len() as u64).sum(), self.budget)?;
        let r = self.write(k, hash, parts);
        match &r {
            Ok(()) => {
                self.stats.puts += 1;
                self.stats.put_bytes += total;
                self.estimate += total;
                self.written_since_scan += total;
                if self.evict_first.contains(&k) {
                    // Evicted before the others the last scan left (after the older ones).
                    let path = self.path_of(kind, hash);
                    if let Ok(mtime) = fs::symlink_metadata(&path).and_then(|m| m.modified()) {
                        self.queue_first.push_back(Queued { path, mtime, bytes: total });
                    }
                }
                let (scan_after, _) = EntryDir::sweep_rule(self.budget);
                if self.written_since_scan >= scan_after {
                    self.scan();
                } else if self.estimate > self.budget {
                    self.evict_queued();
                    if self.estimate > self.budget {
                        self.scan();
                    }
                }
            }
            Err(_) => self.stats.put_errors += 1,
        }
        r
    }

    fn write(&self, kind: u8, hash: u128, parts: &[&[u8]]) -> Result<(), EntryDirError> {
        let shard = self.shard_dir(hash);
        // Never the configured directory itself: a directory that vanished stays absent.
        tier_files::make_own_folders(&[&self.tier_dir, &self.dir, &shard])
            .map_err(io_err("creating", &shard))?;
        let head = Header::of(kind, hash, &self.layout, parts).bytes();
        let mut pieces: Vec<&[u8]> = vec![&head, self.layout.as_bytes()];
        pieces.extend_from_slice(parts);
        let name = entry_name(kind as char, hash);
        tier_files::publish(&shard, &name, |tmp| self.io.write_pieces(tmp, &pieces, self.sync))
            .map_err(io_err("publishing", &shard.join(&name)))
    }

    /// Read the entry's body into `dst`, which must be exactly its length: [`Lookup::Hit`]
    /// only when every check passed (see the module docs). `dst` may hold partial bytes after
    /// any other answer and must then not be used; an entry refused before its body is read
    /// (longer than the budget, a bad header, another length) leaves `dst` untouched.
    pub fn get_into(&mut self, kind: char, hash: u128, dst: &mut [u8]) -> Lookup {
        let (path, r) = match self.open_checked(kind, hash) {
            Ok((path, o)) => {
                let r = self.read(o, dst);
                (Some(path), r)
            }
            Err((path, r)) => (path, r),
        };
        if r == Lookup::Hit {
            // The LRU clock: a hit is a use. A failure to set it only ages the entry.
            if let Some(p) = &path {
                tier_files::touch(p);
            }
        }
        self.count(r, path.as_deref());
        r
    }

    fn read(&self, mut o: Opened, dst: &mut [u8]) -> Lookup {
        let mut layout = vec![0u8; o.head.layout_len as usize];
        if o.file.read_exact_at(FIXED as u64, &mut layout).is_err() {
            return Lookup::Corrupt;
        }
        if let Err(r) = o.head.check_ours(&layout, &self.layout, dst.len()) {
            return r;
        }
        if o.file.read_exact_at((FIXED + layout.len()) as u64, dst).is_err() {
            return Lookup::Corrupt;
        }
        o.head.check_body(dst)
    }

    /// Mark the entries of `keys` used now, in that order (the last the most recently used),
    /// as a read does; how many were there. An engine refreshes a request's whole path this
    /// way when it finishes (`v4pool.vllm`: deepest first, so a prefix's head is evicted last
    /// and its tail first, as vLLM's offload LRU ranks a request's blocks). Absent keys and
    /// non-regular files are skipped (never followed).
    pub fn refresh(&mut self, keys: &[(char, u128)]) -> usize {
        let mut n = 0;
        for &(kind, hash) in keys {
            if kind_ok(kind).is_err() {
                continue;
            }
            if self.own_path(kind, hash).is_ok_and(|p| tier_files::touch(&p)) {
                n += 1;
            }
        }
        n
    }

    /// The capacity rule of a tier of `budget` bytes, for a model of it (the bench's index-only
    /// tier): `(scan_after, target)`. A publisher lists the directory once it has written
    /// `scan_after` bytes since its last scan; a scan over budget removes entries in
    /// [`evict_order`] until the directory holds `target` bytes (the budget: every byte of it
    /// used) and keeps the rest of that order, so that a later put over budget removes the next
    /// ones without listing again (skipping any used or rewritten since, whose modification
    /// time moved); it lists again when they run out.
    pub fn sweep_rule(budget: u64) -> (u64, u64) {
        (budget / tier_files::SCAN_EVERY, budget)
    }

    /// Evict what the last scan left, in its order, until the directory is within budget.
    fn evict_queued(&mut self) {
        while self.estimate > self.budget {
            let Some(q) = self.queue_first.pop_front().or_else(|| self.queue.pop()) else { return };
            match fs::symlink_metadata(&q.path) {
                // Unchanged since the scan: still the oldest it knew of.
                Ok(m) if m.file_type().is_file() && m.modified().is_ok_and(|t| t == q.mtime) => {
                    if fs::remove_file(&q.path).is_ok() {
                        self.estimate = self.estimate.saturating_sub(q.bytes);
                        self.stats.evicted += 1;
                    }
                }
                // Used or rewritten since (newer now): left for the next scan.
                Ok(_) => {}
                // Removed by another process: its bytes are gone from the directory.
                Err(_) => self.estimate = self.estimate.saturating_sub(q.bytes),
            }
        }
    }

    /// Remove an entry; whether one was there (never through a link).
    pub fn remove(&mut self, kind: char, hash: u128) -> bool {
        self.own_path(kind, hash).is_ok_and(|p| fs::remove_file(p).is_ok())
    }

    /// Sum the tier's entries (every layout) and sweep it (`tier_files::sweep`: dead
    /// writers' temporary files, and the oldest entries when it is over budget), this
    /// layout's entries of the `evict_first` kinds removed first when it is over budget.
    fn scan(&mut self) {
        let parse = |n: &str| parse_entry_name(n);
        let found = tier_files::scan_tier(&self.tier_dir, DIGEST_HEX, &parse);
        // Temporary files go to the sweep (it removes dead writers' and counts live ones);
        // entries are evicted here, in evict_order, down to the rule's target.
        let (temps, entries): (Vec<_>, Vec<_>) = found.into_iter().partition(|f| f.key.is_none());
        let swept = tier_files::sweep(temps, u64::MAX);
        let mut used = swept.used + entries.iter().map(|f| f.bytes).sum::<u64>();
        let first = |f: &tier_files::Found<(char, u128)>| {
            f.path.starts_with(&self.dir) && f.key.is_some_and(|(k, _)| self.evict_first.contains(&(k as u8)))
        };
        let ages: Vec<(bool, std::time::SystemTime)> = entries.iter().map(|f| (first(f), f.mtime)).collect();
        let (_, target) = EntryDir::sweep_rule(self.budget);
        let mut queue = Vec::new();
        self.queue_first.clear();
        for i in evict_order(&ages) {
            let f = &entries[i];
            if used <= target {
                let q = Queued { path: f.path.clone(), mtime: f.mtime, bytes: f.bytes };
                if ages[i].0 {
                    self.queue_first.push_back(q);
                } else {
                    queue.push(q);
                }
            } else if fs::remove_file(&f.path).is_ok() {
                used -= f.bytes;
                self.stats.evicted += 1;
            }
        }
        queue.reverse();
        self.queue = queue;
        self.estimate = used;
        self.written_since_scan = 0;
    }
}

/// The order a full tier removes entries in, given each entry's `(evicted first, last use)`:
/// the indices of the entries evicted first, oldest first, then every other, oldest first.
/// `v4pool.vllm`'s index-only tier (`IndexOnlyTiers`) mirrors it; tests/vllm pins both to one
/// outcome.
pub fn evict_order<T: Ord + Copy>(entries: &[(bool, T)]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..entries.len()).collect();
    idx.sort_by_key(|&i| (!entries[i].0, entries[i].1));
    idx
}

/// The bytes of an entry of `layout` with a body of `body_len` bytes ([`EntryDirError::TooLarge`]
/// past `budget`: no entry larger is ever published).
pub(crate) fn entry_bytes(layout: &str, body_len: u64, budget: u64) -> Result<u64, EntryDirError> {
    let total = (FIXED as u64 + layout.len() as u64).saturating_add(body_len);
    if total > budget {
        return Err(EntryDirError::TooLarge { bytes: total, budget });
    }
    Ok(total)
}

/// Whether an entry of `len` bytes could be one a tier of `budget` bytes wrote (checked before
/// a byte past its header is read or fetched).
pub(crate) fn plausible_len(len: u64, budget: u64) -> bool {
    len >= FIXED as u64 && len <= budget
}

/// The header of an entry (the layout text and body follow it).
pub(crate) struct Header {
    pub(crate) kind: u8,
    pub(crate) hash: u128,
    pub(crate) layout_len: u64,
    pub(crate) body_len: u64,
    pub(crate) body_sum: u128,
}

impl Header {
    /// The header of an entry of `(kind, hash)` for `layout` whose body is `parts` in order.
    pub(crate) fn of(kind: u8, hash: u128, layout: &str, parts: &[&[u8]]) -> Header {
        let mut sum = BodySum::default();
        for p in parts {
            sum.push(p);
        }
        let body_len = parts.iter().map(|p| p.len() as u64).sum();
        Header { kind, hash, layout_len: layout.len() as u64, body_len, body_sum: sum.finish() }
    }

    /// The header in `fixed`, if it is whole (magic, own checksum), `(kind, hash)`'s, and
    /// says the entry is `len` bytes long; `None`: a corrupt entry.
    pub(crate) fn check(fixed: &[u8; FIXED], kind: u8, hash: u128, len: u64) -> Option<Header> {
        let h = Header::parse(fixed)?;
        if h.kind != kind || h.hash != hash || h.layout_len > MAX_LAYOUT as u64 {
            return None;
        }
        let want = (FIXED as u64).checked_add(h.layout_len).and_then(|n| n.checked_add(h.body_len));
        (want == Some(len)).then_some(h)
    }

    /// Whether the entry's layout text is `layout` and its body `body_len` bytes long, as
    /// the reader expects ([`Lookup::Foreign`] if not).
    pub(crate) fn check_ours(&self, text: &[u8], layout: &str, body_len: usize) -> Result<(), Lookup> {
        if text != layout.as_bytes() || self.body_len != body_len as u64 {
            return Err(Lookup::Foreign);
        }
        Ok(())
    }

    /// [`Lookup::Hit`] when `body`'s checksum is the header's, else [`Lookup::Corrupt`].
    pub(crate) fn check_body(&self, body: &[u8]) -> Lookup {
        let mut sum = BodySum::default();
        sum.push(body);
        if sum.finish() == self.body_sum {
            Lookup::Hit
        } else {
            Lookup::Corrupt
        }
    }

    pub(crate) fn bytes(&self) -> [u8; FIXED] {
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
