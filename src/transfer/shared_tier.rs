//! The shared tier: block units and checkpoints in files of a directory every engine of a
//! fleet mounts (3FS, NFS, Lustre in production; a temporary directory in CI), addressed by
//! the chained block hash and the pool's layout id, so that what one engine computed
//! restores on another byte-exact — compressed blocks, and checkpoints (window rows and
//! compressor state) — with no tail re-prefill. `docs/fleet.md` says why files and how this
//! compares with Mooncake Store.
//!
//! * **An entry** is one file, `<dir>/v4pool-tier-1/<layout>/<shard>/<b|c><hash>` (`b`: a
//!   block's unit, `c`: the units of the checkpoint ending at that block; `<layout>`: a
//!   digest of the layout id, `<shard>`: the hash's top byte, so no directory grows past
//!   1/256 of the entries): a header — magic, kind, hash, units, the layout id's length,
//!   the payload's length and checksum, the header's own checksum — the layout id's text,
//!   then the payload, the units' bytes part-major (as a host-tier extent).
//! * **Publishing** writes a temporary file in the entry's directory (a name no reader
//!   looks up, unique to its writer: pid, a per-process random nonce and a process-wide
//!   counter, created exclusively), syncs it when [`SharedTierConfig::sync`] says so, and
//!   renames it over the entry's name: a reader sees a whole file or none. Two writers of one
//!   key — in two processes, two tiers of one process, or two containers that all see pid 1 —
//!   both finish and the last rename wins; either file is whole (and, content-addressed, the
//!   same bytes). A writer only ever removes a temporary file it created.
//! * **Reading** checks everything before a byte reaches the pool: that the entry's name is
//!   a regular file (a FIFO, device or link there is refused unopened: an open cannot hang),
//!   its length against the budget, the header and its checksum, the layout id (the whole
//!   text, not the directory's digest), the key, the unit count (a block entry holds exactly
//!   one unit, a checkpoint entry exactly the layout's units per checkpoint: anything else
//!   could never be the pool's) and the payload's checksum. A torn, truncated, corrupt or
//!   foreign entry is a miss ([`HostTierError::Corrupt`], [`HostTierError::ForeignLayout`]),
//!   never wrong bytes, and the file is removed so the next publisher writes it anew. An
//!   I/O failure (the mount gone) is a miss too ([`HostTierError::Io`]); the pool and the
//!   engine carry on.
//! * **Its own folders only.** The tier never follows a link: a tier, layout or shard folder
//!   that is a symbolic link is refused (the tier is not built, a publication into it fails)
//!   or, in a scan, skipped; a scan removes only names the tier writes (entries and its own
//!   temporary files), never another file in its folders.
//! * **Capacity** ([`SharedTierConfig::budget_bytes`], for the whole directory, every
//!   layout): least recently used by modification time, across processes. A hit sets the
//!   entry's mtime to now (access times are unreliable: `noatime`, `relatime`); a publisher
//!   keeps an estimate of the directory's bytes (a scan at start, plus what it writes) and
//!   scans when the estimate passes the budget or it has written [`SCAN_EVERY`] of it since
//!   its last scan: the scan sums every entry and removes the oldest until the directory is
//!   at [`LOW_WATER`] of the budget (and the tier's temporary files older than
//!   [`STALE_TEMP`], a writer's that died). Each process writes at most `budget / SCAN_EVERY` plus one entry
//!   between two of its scans, so with `N` writers the directory exceeds the budget by at
//!   most `N × (budget / SCAN_EVERY + largest entry)`.
//!
//! The bytes go through a [`TierIo`]: [`StdFs`] (plain `std::fs`) here; NIXL's POSIX or GDS
//! file plugins implement the same two calls (`docs/fleet.md` says what that needs). Names,
//! renames, removals and scans are POSIX calls on the mount whatever moves the bytes; their
//! rules (no link followed, own names only, exclusive temporary files, the sweep) are
//! `transfer::tier_files`'s, which the entry tier ([`super::entry_dir`]) shares.

use super::host_tier::{copy_blocks_synced, part_bytes, parts_matching, restore_blocks, Storage, UnitPart};
use super::tier_files::{self, entry_name, open_regular, parse_entry_name, real_dir};
pub use super::tier_files::{LOW_WATER, SCAN_EVERY, STALE_TEMP};
use super::HostTierError;
use crate::alloc::BlockHandle;
use crate::checkpoint::LayoutId;
use crate::pool::Pool;
use crate::rng::{mum, WY};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The tier's folder inside the configured directory (the format's version is in its name).
pub const TIER_DIR: &str = "v4pool-tier-1";
/// Hex digits of a layout folder's name.
const DIGEST_HEX: usize = 16;

const MAGIC: &[u8; 8] = b"v4poolT1";
/// Fixed header bytes before the layout id's text.
pub(crate) const FIXED: usize = 80;
/// The longest layout id text an entry may carry.
pub(crate) const MAX_LAYOUT_TEXT: u64 = 1 << 16;

/// What an entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntryKind {
    /// One block's unit (every plane and indexer layer).
    Block,
    /// The units of the checkpoint ending at a block (window rows and compressor state).
    Checkpoint,
}

impl EntryKind {
    pub(crate) fn letter(self) -> char {
        match self {
            EntryKind::Block => 'b',
            EntryKind::Checkpoint => 'c',
        }
    }
    fn code(self) -> u8 {
        match self {
            EntryKind::Block => 1,
            EntryKind::Checkpoint => 2,
        }
    }
}

/// An entry's key: what it holds and the block hash it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SharedKey {
    /// Block or checkpoint.
    pub kind: EntryKind,
    /// The chained block hash (`manager::BlockHash`'s value).
    pub hash: u128,
}

impl SharedKey {
    /// The entry's file name (and, in a key-value store, the key's last part).
    pub(crate) fn name(&self) -> String {
        entry_name(self.kind.letter(), self.hash)
    }
    /// The key a file name names, if it is an entry's.
    fn parse(name: &str) -> Option<SharedKey> {
        let (letter, hash) = parse_entry_name(name)?;
        let kind = match letter {
            'b' => EntryKind::Block,
            'c' => EntryKind::Checkpoint,
            _ => return None,
        };
        Some(SharedKey { kind, hash })
    }
}

/// Units an entry of `kind` holds: one block's unit, or the units of one checkpoint.
pub(crate) fn units_of(kind: EntryKind, ckpt_units: u64) -> u64 {
    match kind {
        EntryKind::Block => 1,
        EntryKind::Checkpoint => ckpt_units,
    }
}

/// Units of one checkpoint of `pool` (0 when its spec has no checkpoint layout: then no
/// checkpoint entry is ever the pool's).
pub(crate) fn checkpoint_units(pool: &Pool) -> u64 {
    pool.spec().checkpoint_layout().map_or(0, |c| c.units_per_checkpoint)
}

/// Where the shared tier lives and how much of it a fleet uses.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SharedTierConfig {
    /// A directory every engine mounts; it must exist (the tier creates its folders inside).
    pub dir: PathBuf,
    /// Bytes the whole directory may hold (every layout's entries); see the module docs for
    /// how far over it concurrent writers can take it.
    pub budget_bytes: u64,
    /// Sync each entry to stable storage before it is renamed into place (a crash then
    /// leaves whole entries or none; without it a file system may leave a renamed file
    /// empty after a power loss, which readers refuse as torn).
    pub sync: bool,
}

impl SharedTierConfig {
    /// A tier in `dir` of at most `budget_bytes`, every entry synced before it is renamed
    /// into place (the crash-safe choice; [`SharedTierConfig::with_sync`] turns it off).
    pub fn new(dir: impl Into<PathBuf>, budget_bytes: u64) -> Self {
        SharedTierConfig { dir: dir.into(), budget_bytes, sync: true }
    }
}

crate::setters::with_setters!(SharedTierConfig { with_sync(sync: bool) });

/// An open entry file, as a [`TierIo`] reads it.
pub trait TierReader {
    /// The file's length in bytes.
    fn len(&self) -> u64;
    /// Whether the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fill `dst` from the file's bytes at `offset` (an error if the file ends first).
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> io::Result<()>;
}

/// How entry bytes move between memory and files: [`StdFs`] here; NIXL's POSIX (or GDS)
/// plugin is the second implementation (`docs/fleet.md`). The memory is the tier's staging
/// buffer, from the pool's backend's `alloc_host` (page-locked on CUDA), which a NIXL
/// implementation registers as DRAM.
pub trait TierIo: Send + std::fmt::Debug {
    /// Create the new file `path` (refused with [`io::ErrorKind::AlreadyExists`] if it
    /// exists: the caller then never removes it) holding `head` then `body`; on stable
    /// storage before returning when `sync`.
    fn write_file(&self, path: &Path, head: &[u8], body: &[u8], sync: bool) -> io::Result<()>;
    /// [`TierIo::write_file`] of `pieces` in order (the entry tier's header, layout text and
    /// its caller's parts: [`super::entry_dir`]), under the same rules. The default joins the
    /// pieces after the first into one body (a copy); an I/O that moves several pieces in one
    /// call overrides it.
    fn write_pieces(&self, path: &Path, pieces: &[&[u8]], sync: bool) -> io::Result<()> {
        let (head, rest) = pieces.split_first().map_or((&[][..], &[][..]), |(h, r)| (*h, r));
        self.write_file(path, head, &rest.concat(), sync)
    }
    /// Open the regular file at `path` for reading, never blocking (a FIFO) nor following a
    /// link (as `StdFs` does: an `lstat` first, a non-blocking open, an `fstat` after).
    fn open(&self, path: &Path) -> io::Result<Box<dyn TierReader>>;
}

/// Plain `std::fs` I/O.
#[derive(Clone, Copy, Debug, Default)]
pub struct StdFs;

struct StdReader {
    file: fs::File,
    len: u64,
}

impl TierReader for StdReader {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        self.file.seek(SeekFrom::Start(offset))?;
        self.file.read_exact(dst)
    }
}

impl TierIo for StdFs {
    fn write_file(&self, path: &Path, head: &[u8], body: &[u8], sync: bool) -> io::Result<()> {
        self.write_pieces(path, &[head, body], sync)
    }
    fn write_pieces(&self, path: &Path, pieces: &[&[u8]], sync: bool) -> io::Result<()> {
        tier_files::write_new(path, pieces, sync)
    }
    fn open(&self, path: &Path) -> io::Result<Box<dyn TierReader>> {
        let file = open_regular(path, false)?;
        let len = file.metadata()?.len();
        Ok(Box::new(StdReader { file, len }))
    }
}

/// What one tier has done since it was built (this process's view).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedTierStats {
    /// Entries written (renamed into place).
    pub published: u64,
    /// Bytes of those files.
    pub published_bytes: u64,
    /// Publications skipped: the entry was there already (another engine wrote it).
    pub already_present: u64,
    /// Entries restored into a pool.
    pub restored: u64,
    /// Payload bytes restored.
    pub restored_bytes: u64,
    /// Entries refused on reading: torn, truncated, a bad header, key or checksum.
    pub corrupt: u64,
    /// Entries refused on reading: another layout's.
    pub foreign: u64,
    /// I/O calls that failed (the directory gone, a full disk, a reader racing a removal).
    pub io_errors: u64,
    /// Capacity scans run.
    pub scans: u64,
    /// Entries removed by this process's scans, and their bytes.
    pub evicted: u64,
    /// See [`SharedTierStats::evicted`].
    pub evicted_bytes: u64,
    /// Dead writers' temporary files removed.
    pub stale_temps: u64,
}

/// The shared tier over one directory, serving pools of one layout (see the module docs).
pub struct SharedTier {
    /// `<dir>/v4pool-tier-1`.
    tier_dir: PathBuf,
    /// The configured directory: never created by the tier (a vanished mount stays absent).
    dir: PathBuf,
    /// `<tier_dir>/<layout digest>`.
    layout_dir: PathBuf,
    layout: LayoutId,
    unit_bytes: u64,
    part_bytes: Vec<u64>,
    /// Units of one checkpoint entry of this layout.
    ckpt_units: u64,
    budget: u64,
    sync: bool,
    io: Box<dyn TierIo>,
    /// Host memory entries pass through (grown to the largest entry; freed on drop).
    staging: Option<Storage>,
    /// The directory's bytes as far as this process knows.
    used: u64,
    written_since_scan: u64,
    stats: SharedTierStats,
}

impl std::fmt::Debug for SharedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTier")
            .field("layout_dir", &self.layout_dir)
            .field("unit_bytes", &self.unit_bytes)
            .field("budget", &self.budget)
            .field("used", &self.used)
            .field("stats", &self.stats)
            .finish()
    }
}

const S0: u64 = WY[0];
const S1: u64 = WY[1];
const S2: u64 = WY[2];
const S3: u64 = WY[3];

/// A 128-bit checksum of `bytes` (two multiply-fold lanes over 32-byte words, then the
/// length): every bit of the input reaches both halves, so a flipped, torn or shifted byte
/// goes undetected with probability about 2^-64 or less. Not a cryptographic hash: it guards
/// against accidents (torn writes, bit rot, a truncation), not against an adversary with
/// write access to the directory, who could write any entry anyway.
pub fn checksum(bytes: &[u8]) -> u128 {
    let (mut a, mut b) = (S0, S1);
    let mut round = |c: &[u8]| {
        let w = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        // The previous state is folded back in whatever the product: a zero product (a word
        // equal to a constant) loses no earlier input.
        a = mum(w(0) ^ S2 ^ a, w(1) ^ S3) ^ a.rotate_left(29);
        b = mum(w(2) ^ S1 ^ b, w(3) ^ S0) ^ b.rotate_left(37);
    };
    let mut chunks = bytes.chunks_exact(32);
    for c in &mut chunks {
        round(c);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 32];
        last[..rest.len()].copy_from_slice(rest);
        round(&last);
    }
    let len = bytes.len() as u64;
    let x = mum(a ^ len ^ S1, b ^ S2);
    let y = mum(b ^ len.rotate_left(32) ^ S3, a ^ S0 ^ x);
    (u128::from(y) << 64) | u128::from(x ^ mum(x, S3))
}

fn put_u32(h: &mut [u8], at: usize, v: u32) {
    h[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(h: &mut [u8], at: usize, v: u64) {
    h[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn put_u128(h: &mut [u8], at: usize, v: u128) {
    h[at..at + 16].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(h: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(h: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"))
}
fn get_u128(h: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(h[at..at + 16].try_into().expect("16 bytes"))
}

/// The header of an entry of `units` units of `key` with `payload_len` bytes summing to
/// `sum`, in `layout`.
pub(crate) fn header(key: SharedKey, units: u32, layout: &[u8], payload_len: u64, sum: u128) -> Vec<u8> {
    let mut h = vec![0u8; FIXED + layout.len()];
    h[..8].copy_from_slice(MAGIC);
    h[8] = key.kind.code();
    put_u32(&mut h, 12, units);
    put_u128(&mut h, 16, key.hash);
    put_u32(&mut h, 32, layout.len() as u32);
    put_u64(&mut h, 40, payload_len);
    put_u128(&mut h, 48, sum);
    h[FIXED..].copy_from_slice(layout);
    let own = header_sum(&h);
    put_u128(&mut h, 64, own);
    h
}

/// The header's own checksum: its fixed fields before the checksum, and the layout text.
fn header_sum(h: &[u8]) -> u128 {
    let mut covered = h[..64].to_vec();
    covered.extend_from_slice(&h[FIXED..]);
    checksum(&covered)
}

/// Why an entry's bytes are refused (a miss either way; the entry is removed).
pub(crate) enum Refused {
    /// Torn, truncated, corrupt, or another key's.
    Corrupt(&'static str),
    /// A whole entry of another layout (its layout id's text).
    Foreign(String),
}

/// The unit parts of `pool` for a shared tier of `layout` whose units are `part_bytes`: refused
/// unless the pool is of that layout (an entry of one layout restored into a pool of another
/// would be bytes of the wrong meaning).
pub(crate) fn pool_parts(
    pool: &Pool,
    layout: &LayoutId,
    part_bytes: &[u64],
) -> Result<Vec<UnitPart>, HostTierError> {
    if pool.layout_id() != layout {
        return Err(HostTierError::ForeignLayout {
            entry: layout.to_string(),
            pool: pool.layout_id().to_string(),
        });
    }
    parts_matching(pool, part_bytes)
}

/// `read` (a shared tier's read of an entry) as it was, after calling `remove` when it refused
/// the entry's bytes (corrupt, another layout's): refused for good, the entry goes so that the
/// next publisher writes it anew. An I/O error leaves it.
pub(crate) fn removing_refused<T>(
    read: Result<T, HostTierError>,
    remove: impl FnOnce(),
) -> Result<T, HostTierError> {
    if let Err(HostTierError::Corrupt { .. } | HostTierError::ForeignLayout { .. }) = read {
        remove();
    }
    read
}

/// The last step of a shared tier's restore: the checked payload of `units` units at `host`
/// into fresh blocks of `pool` (all or nothing), counted in `stats`.
///
/// # Safety
/// `host` is this pool's backend's `alloc_host` memory holding the entry's checked payload,
/// untouched meanwhile.
pub(crate) unsafe fn restore_counted(
    stats: &mut SharedTierStats,
    unit_bytes: u64,
    pool: &Pool,
    parts: &[UnitPart],
    host: *mut u8,
    units: usize,
) -> Result<Vec<BlockHandle>, HostTierError> {
    // SAFETY: the caller's contract.
    let blocks = unsafe { restore_blocks(pool, parts, host, units)? };
    stats.restored += 1;
    stats.restored_bytes += units as u64 * unit_bytes;
    Ok(blocks)
}

/// `r` as the error a reader returns, counted in `stats`; `pool` is the reader's layout.
pub(crate) fn refusal(stats: &mut SharedTierStats, r: Refused, pool: &LayoutId) -> HostTierError {
    match r {
        Refused::Corrupt(what) => {
            stats.corrupt += 1;
            HostTierError::Corrupt { what }
        }
        Refused::Foreign(entry) => {
            stats.foreign += 1;
            HostTierError::ForeignLayout { entry, pool: pool.to_string() }
        }
    }
}

/// The header's length (fixed part and layout text) from an entry's first [`FIXED`] bytes,
/// the entry being `len` bytes long (at least [`FIXED`], checked by the caller).
pub(crate) fn head_len_of(fixed: &[u8], len: u64) -> Result<u64, Refused> {
    if &fixed[..8] != MAGIC {
        return Err(Refused::Corrupt("not an entry (magic)"));
    }
    let layout_len = get_u32(fixed, 32) as u64;
    let head_len = FIXED as u64 + layout_len;
    if layout_len > MAX_LAYOUT_TEXT || head_len > len {
        return Err(Refused::Corrupt("layout id past the file's end"));
    }
    Ok(head_len)
}

/// Check a whole header (`head`: the fixed part and the layout text) as `key`'s entry in
/// `layout` with units of `unit_bytes` and `ckpt_units` units a checkpoint, the entry being
/// `len` bytes long: its unit count and
/// the payload's checksum, which the caller checks once the payload is read.
pub(crate) fn check_head(
    head: &[u8],
    key: &SharedKey,
    layout: &LayoutId,
    unit_bytes: u64,
    ckpt_units: u64,
    len: u64,
) -> Result<(usize, u128), Refused> {
    if header_sum(head) != get_u128(head, 64) {
        return Err(Refused::Corrupt("header checksum"));
    }
    // A whole header: what it says can be believed as written.
    if &head[FIXED..] != layout.as_str().as_bytes() {
        return Err(Refused::Foreign(String::from_utf8_lossy(&head[FIXED..]).into_owned()));
    }
    let units = get_u32(head, 12) as u64;
    let payload_len = get_u64(head, 40);
    if head[8] != key.kind.code() || get_u128(head, 16) != key.hash {
        return Err(Refused::Corrupt("another key's entry"));
    }
    // A count the key's kind never has (a forgery with a valid header) would poison every
    // later admission of the prefix or leak the extra blocks: refused before the payload.
    if units != units_of(key.kind, ckpt_units) {
        return Err(Refused::Corrupt("unit count does not fit the key's kind"));
    }
    if units == 0 || units.checked_mul(unit_bytes) != Some(payload_len) {
        return Err(Refused::Corrupt("unit count and payload length disagree"));
    }
    if (head.len() as u64).checked_add(payload_len) != Some(len) {
        return Err(Refused::Corrupt("torn or truncated (length)"));
    }
    Ok((units as usize, get_u128(head, 48)))
}

impl SharedTier {
    /// A tier for units of `pool` in `config.dir` (which must exist), moving bytes with
    /// [`StdFs`].
    pub fn new(pool: &Pool, config: &SharedTierConfig) -> Result<SharedTier, HostTierError> {
        SharedTier::with_io(pool, config, Box::new(StdFs))
    }

    /// As [`SharedTier::new`] with another [`TierIo`].
    pub fn with_io(
        pool: &Pool,
        config: &SharedTierConfig,
        io: Box<dyn TierIo>,
    ) -> Result<SharedTier, HostTierError> {
        let part_bytes = part_bytes(pool)?;
        let unit_bytes = part_bytes.iter().sum();
        let layout = pool.layout_id().clone();
        let tier_dir = config.dir.join(TIER_DIR);
        let digest = checksum(layout.as_str().as_bytes());
        let layout_dir = tier_dir.join(format!("{:0w$x}", digest as u64, w = DIGEST_HEX));
        let meta = fs::metadata(&config.dir)
            .map_err(|source| HostTierError::Io { op: "stat the tier directory", source })?;
        if !meta.is_dir() {
            let source = io::Error::new(io::ErrorKind::NotADirectory, config.dir.display().to_string());
            return Err(HostTierError::Io { op: "stat the tier directory", source });
        }
        // A link here would take the scans' removals outside the tier.
        tier_files::make_own_folders(&[&tier_dir, &layout_dir])
            .map_err(|source| HostTierError::Io { op: "open the tier's folders", source })?;
        let mut tier = SharedTier {
            tier_dir,
            dir: config.dir.clone(),
            layout_dir,
            layout,
            unit_bytes,
            part_bytes,
            ckpt_units: checkpoint_units(pool),
            budget: config.budget_bytes,
            sync: config.sync,
            io,
            staging: None,
            used: 0,
            written_since_scan: 0,
            stats: SharedTierStats::default(),
        };
        tier.scan();
        Ok(tier)
    }

    /// Bytes of one unit.
    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }
    /// Units the budget holds.
    pub fn capacity_units(&self) -> u64 {
        self.budget.checked_div(self.unit_bytes).unwrap_or(0)
    }
    /// Units the directory holds as far as this process knows (headers count as payload).
    pub fn used_units(&self) -> u64 {
        self.used.checked_div(self.unit_bytes).unwrap_or(0)
    }
    /// The directory's bytes as far as this process knows (exact after a scan).
    pub fn used_bytes(&self) -> u64 {
        self.used
    }
    /// What this tier has done.
    pub fn stats(&self) -> SharedTierStats {
        self.stats
    }
    /// The folder this layout's entries live in.
    pub fn layout_dir(&self) -> &Path {
        &self.layout_dir
    }
    /// The file `key`'s entry lives in.
    pub fn path_of(&self, key: &SharedKey) -> PathBuf {
        self.shard_dir(key).join(key.name())
    }
    fn shard_dir(&self, key: &SharedKey) -> PathBuf {
        self.layout_dir.join(format!("{:02x}", (key.hash >> 120) as u8))
    }
    /// Bytes of an entry's header for this layout (an entry is this plus its units).
    pub fn head_bytes(&self) -> u64 {
        (FIXED + self.layout.as_str().len()) as u64
    }

    /// Whether an entry for `key` is there with a plausible length (whole units after the
    /// header; the contents are checked when it is read).
    pub fn contains(&self, key: &SharedKey) -> bool {
        let head = self.head_bytes();
        fs::symlink_metadata(self.path_of(key)).is_ok_and(|m| {
            m.file_type().is_file() && m.len() > head && (m.len() - head) % self.unit_bytes.max(1) == 0
        })
    }

    /// Mark `key` as just used (its mtime set to now: the fleet's LRU); whether it is there.
    pub fn touch(&mut self, key: &SharedKey) -> bool {
        self.own_folder(key).is_ok_and(|d| tier_files::touch(&d.join(key.name())))
    }

    /// `key`'s shard folder, checked to be the tier's own: it, the layout folder and the
    /// tier folder are directories, not links (which would take a write or removal outside
    /// the tier).
    fn own_folder(&self, key: &SharedKey) -> io::Result<PathBuf> {
        let shard = self.shard_dir(key);
        tier_files::own_folders(&[&self.tier_dir, &self.layout_dir, &shard])?;
        Ok(shard)
    }

    /// Remove `key`'s entry; whether it was there.
    pub fn evict(&mut self, key: &SharedKey) -> bool {
        let Ok(dir) = self.own_folder(key) else { return false };
        let path = dir.join(key.name());
        let bytes = fs::symlink_metadata(&path).map(|m| m.len()).unwrap_or(0);
        let removed = fs::remove_file(path).is_ok();
        if removed {
            self.used = self.used.saturating_sub(bytes);
        }
        removed
    }

    /// This layout's entries, least recently used (oldest mtime) first.
    pub fn lru_order(&self) -> Vec<SharedKey> {
        let mut found = Vec::new();
        if real_dir(&self.tier_dir) && real_dir(&self.layout_dir) {
            tier_files::scan_layout(&self.layout_dir, &SharedKey::parse, &mut found);
        }
        found.sort_by_key(|f| f.mtime);
        found.into_iter().filter_map(|f| f.key).collect()
    }

    fn check_pool(&self, pool: &Pool) -> Result<Vec<UnitPart>, HostTierError> {
        pool_parts(pool, &self.layout, &self.part_bytes)
    }

    /// The staging buffer, at least `bytes` long (grown from the pool's backend).
    fn staging(&mut self, pool: &Pool, bytes: u64) -> Result<&Storage, HostTierError> {
        if self.staging.as_ref().is_none_or(|s| (s.len() as u64) < bytes) {
            // The old buffer has no copy queued (every copy is waited for), so it may go.
            self.staging = None;
            self.staging = Some(Storage::new(pool.backend().clone(), bytes)?);
        }
        Ok(self.staging.as_ref().expect("just made"))
    }

    fn io_error(&mut self, op: &'static str, source: io::Error) -> HostTierError {
        self.stats.io_errors += 1;
        HostTierError::Io { op, source }
    }

    /// Write the units `blocks` of `pool` as `key`'s entry (see the module docs): `Ok(false)`
    /// when an entry is there already (it is touched instead). The blocks stay allocated in
    /// the pool; their bytes must be complete (the manager publishes after the batch that
    /// wrote them has completed). A failure writes nothing (a temporary file is removed) and
    /// leaves the pool as it was.
    pub fn publish(
        &mut self,
        pool: &Pool,
        key: SharedKey,
        blocks: &[BlockHandle],
    ) -> Result<bool, HostTierError> {
        let parts = self.check_pool(pool)?;
        if self.contains(&key) {
            self.touch(&key);
            self.stats.already_present += 1;
            return Ok(false);
        }
        let units = u32::try_from(blocks.len()).map_err(|_| HostTierError::TooLarge {
            units: blocks.len(),
            unit_bytes: self.unit_bytes,
            capacity: self.capacity_units(),
        })?;
        let bytes = u64::from(units) * self.unit_bytes;
        if bytes + self.head_bytes() > self.budget {
            let capacity = self.capacity_units();
            return Err(HostTierError::TooLarge {
                units: blocks.len(),
                unit_bytes: self.unit_bytes,
                capacity,
            });
        }
        let host = self.staging(pool, bytes)?.ptr();
        // SAFETY: the staging buffer holds `bytes` (grown above) from this pool's backend's
        // `alloc_host`, and nothing else uses it meanwhile.
        unsafe { copy_blocks_synced(pool, &parts, host, blocks, true)? };
        // SAFETY: `bytes` of the staging buffer, written by the copies just waited for.
        let body = unsafe { std::slice::from_raw_parts(host, bytes as usize) };
        let head = header(key, units, self.layout.as_str().as_bytes(), bytes, checksum(body));
        // Never the configured directory itself: a mount that vanished stays absent.
        let shard = self.shard_dir(&key);
        if let Err(e) = tier_files::make_own_folders(&[&self.tier_dir, &self.layout_dir, &shard]) {
            return Err(self.io_error("create the entry's folder", e));
        }
        // A temporary name unique to this writer, created exclusively, renamed into place.
        let (io, sync) = (&self.io, self.sync);
        let written = tier_files::publish(&shard, &key.name(), |tmp| io.write_file(tmp, &head, body, sync));
        if let Err(e) = written {
            return Err(self.io_error("write the entry", e));
        }
        let len = head.len() as u64 + bytes;
        self.stats.published += 1;
        self.stats.published_bytes += len;
        self.used += len;
        self.written_since_scan += len;
        if tier_files::scan_due(self.used, self.written_since_scan, self.budget) {
            self.scan();
        }
        Ok(true)
    }

    /// Read `key`'s entry into freshly allocated blocks of `pool` (all or nothing: on any
    /// refusal nothing stays allocated); the entry stays (other engines may want it) and is
    /// touched. Blocks come back in the order they were published.
    pub fn restore(&mut self, pool: &Pool, key: &SharedKey) -> Result<Vec<BlockHandle>, HostTierError> {
        let parts = self.check_pool(pool)?;
        let path = match self.own_folder(key) {
            Ok(dir) => dir.join(key.name()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(HostTierError::NotHeld),
            Err(e) => return Err(self.io_error("find the entry's folder", e)),
        };
        // Refused unopened unless a regular file: opening a FIFO waits for a writer forever.
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_file() => {}
            Ok(_) => {
                // Not an entry the tier wrote, under an entry's name: removed like a corrupt one.
                let _ = fs::remove_file(&path);
                let r = Refused::Corrupt("not a regular file");
                return Err(refusal(&mut self.stats, r, &self.layout));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(HostTierError::NotHeld),
            Err(e) => return Err(self.io_error("stat the entry", e)),
        }
        let mut file = match self.io.open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(HostTierError::NotHeld),
            Err(e) => return Err(self.io_error("open the entry", e)),
        };
        let units = removing_refused(self.read_entry(pool, key, file.as_mut()), || {
            let _ = fs::remove_file(&path);
        })?;
        drop(file);
        let host = self.staging.as_ref().expect("read_entry filled it").ptr();
        // SAFETY: the staging buffer holds the entry's checked payload (`units` units) from
        // this pool's backend's `alloc_host`, untouched meanwhile.
        let blocks = unsafe { restore_counted(&mut self.stats, self.unit_bytes, pool, &parts, host, units)? };
        self.touch(key);
        Ok(blocks)
    }

    /// Read and check `key`'s entry from `file` into the staging buffer; its unit count.
    fn read_entry(
        &mut self,
        pool: &Pool,
        key: &SharedKey,
        file: &mut dyn TierReader,
    ) -> Result<usize, HostTierError> {
        let len = file.len();
        if len < FIXED as u64 {
            return Err(refusal(&mut self.stats, Refused::Corrupt("shorter than a header"), &self.layout));
        }
        // Never a buffer or a read for more than the tier holds: a sparse file whose header
        // claims gigabytes is refused unread (no entry larger than the budget is published).
        if len > self.budget {
            return Err(refusal(
                &mut self.stats,
                Refused::Corrupt("longer than the tier holds"),
                &self.layout,
            ));
        }
        let mut head = vec![0u8; FIXED];
        if let Err(e) = file.read_exact_at(0, &mut head) {
            return Err(self.io_error("read the entry's header", e));
        }
        let head_len = head_len_of(&head, len).map_err(|r| refusal(&mut self.stats, r, &self.layout))?;
        head.resize(head_len as usize, 0);
        if let Err(e) = file.read_exact_at(FIXED as u64, &mut head[FIXED..]) {
            return Err(self.io_error("read the entry's header", e));
        }
        let (units, sum) = check_head(&head, key, &self.layout, self.unit_bytes, self.ckpt_units, len)
            .map_err(|r| refusal(&mut self.stats, r, &self.layout))?;
        let payload_len = len - head_len;
        let host = self.staging(pool, payload_len)?.ptr();
        // SAFETY: the staging buffer holds at least `payload_len` bytes, and no copy is
        // queued on it (every copy is waited for before the call that queued it returns).
        let body = unsafe { std::slice::from_raw_parts_mut(host, payload_len as usize) };
        if let Err(e) = file.read_exact_at(head_len, body) {
            return Err(self.io_error("read the entry's payload", e));
        }
        if checksum(body) != sum {
            return Err(refusal(&mut self.stats, Refused::Corrupt("payload checksum"), &self.layout));
        }
        Ok(units)
    }

    /// The capacity scan (module docs): sum the directory, remove dead writers' temporary
    /// files, and when over budget the least recently used entries down to [`LOW_WATER`]
    /// (`tier_files::sweep`, the rule the entry tier shares).
    fn scan(&mut self) {
        self.stats.scans += 1;
        self.written_since_scan = 0;
        if !real_dir(&self.tier_dir) && !self.dir.exists() {
            self.stats.io_errors += 1;
        }
        let found = tier_files::scan_tier(&self.tier_dir, DIGEST_HEX, &SharedKey::parse);
        let swept = tier_files::sweep(found, self.budget);
        self.stats.stale_temps += swept.stale_temps;
        self.stats.evicted += swept.evicted;
        self.stats.evicted_bytes += swept.evicted_bytes;
        self.used = swept.used;
    }
}
