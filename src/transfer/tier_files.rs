//! The file mechanics of v4pool's file-backed tiers, in one place so one rule holds for both:
//! the shared tier ([`super::shared_tier`]: pool units a fleet shares) and the entry tier
//! ([`super::entry_dir`]: the pages of an engine that owns its KV layout, vLLM's connector).
//!
//! * **Names.** An entry is `<kind letter><32 hex digits of its hash>` in a shard folder
//!   (two hex digits), in a layout folder (a hex digest), in the tier's folder; a temporary
//!   file is `.tmp-<entry name>-<pid>-<nonce>-<n>` ([`temp_name`]): the process id, a random
//!   per-process nonce (two containers that both see pid 1 differ) and a process-wide counter
//!   (two tiers of one process differ).
//! * **Never follow a link.** The tier, layout and shard folders must be directories, not
//!   links ([`own_folders`]); an entry is opened only when `lstat` says a regular file, opened
//!   non-blocking (a FIFO swapped in meanwhile cannot hang the open) and re-checked with
//!   `fstat` to be that same file ([`open_regular`]).
//! * **Publishing** creates a temporary file exclusively (`O_EXCL`: never an existing file,
//!   never through a link), writes it whole, and renames it over the entry's name
//!   ([`publish`]); a reader sees a whole file or none, and a writer only ever removes a
//!   temporary file it created.
//! * **Scans** list only names a tier writes (entries and its temporary files) in its real
//!   folders ([`scan_tier`]); the capacity sweep ([`sweep`]) removes only those: dead
//!   writers' temporary files older than [`STALE_TEMP`], and when the tier is over its budget
//!   the least recently modified entries down to [`LOW_WATER`] of it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

/// A publisher scans after writing this fraction (1/N) of the budget since its last scan.
pub const SCAN_EVERY: u64 = 8;
/// A scan that finds the directory over budget removes entries until it is at this share of
/// the budget (per mille), so the next scans are not all evictions.
pub const LOW_WATER: u64 = 900;

/// The bytes an over-budget [`sweep`] brings a tier down to: [`LOW_WATER`] per mille of
/// `budget` (the shared tier's rule; the entry tier keeps its scan's order instead and evicts
/// down to the budget itself, `EntryDir::sweep_rule`).
pub(crate) fn low_water(budget: u64) -> u64 {
    budget / 1000 * LOW_WATER
}
/// A temporary file this old is a dead writer's: a scan removes it.
pub const STALE_TEMP: Duration = Duration::from_secs(600);

/// The prefix of temporary files (never an entry's name: entries start with a letter).
const TEMP: &str = ".tmp-";
/// An entry name's length: its kind letter and 32 hex digits.
const ENTRY_NAME: usize = 33;

/// Whether a publisher that has `written` bytes since its last scan, in a directory it
/// believes holds `used` bytes, scans now.
pub(crate) fn scan_due(used: u64, written: u64, budget: u64) -> bool {
    used > budget || written >= budget / SCAN_EVERY
}

/// An entry's file name.
pub(crate) fn entry_name(kind: char, hash: u128) -> String {
    format!("{kind}{hash:032x}")
}

/// The kind letter and hash an entry's file name names, if it is one (a lower-case ASCII
/// letter, then exactly 32 lower-case hex digits, as [`entry_name`] writes them).
pub(crate) fn parse_entry_name(name: &str) -> Option<(char, u128)> {
    let b = name.as_bytes();
    if b.len() != ENTRY_NAME || !b[0].is_ascii_lowercase() || !b[1..].iter().all(|&c| is_hex(c)) {
        return None;
    }
    Some((b[0] as char, u128::from_str_radix(&name[1..], 16).ok()?))
}

fn is_hex(c: u8) -> bool {
    c.is_ascii_digit() || (b'a'..=b'f').contains(&c)
}

/// Temporary names made by this process so far (shared by every tier in it).
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// This process's nonce in temporary names: random per process (the standard library's
/// hash keys come from the OS's random source), so two processes with one pid (containers
/// that all see pid 1, on hosts sharing a mount) differ too.
fn process_nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.finish()
    })
}

/// A fresh temporary name for the entry named `entry`: `.tmp-<entry>-<pid>-<nonce>-<n>`.
pub(crate) fn temp_name(entry: &str) -> String {
    let n = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
    format!("{TEMP}{entry}-{}-{:016x}-{n}", std::process::id(), process_nonce())
}

/// Whether `name` is a temporary name a tier writes for an entry `parse` accepts: `.tmp-`, an
/// entry's name, then `-` and digits, hex and dashes.
fn is_temp_name<K>(name: &str, parse: &dyn Fn(&str) -> Option<K>) -> bool {
    let Some(rest) = name.strip_prefix(TEMP) else { return false };
    let (Some(entry), Some(tail)) = (rest.get(..ENTRY_NAME), rest.get(ENTRY_NAME..)) else { return false };
    parse(entry).is_some()
        && tail.len() > 1
        && tail.starts_with('-')
        && tail.bytes().all(|c| c == b'-' || is_hex(c))
}

/// Whether `path` is a directory itself, not a link to one (nor anything else).
pub(crate) fn real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_dir())
}

/// The error for a tier folder that is not a real directory (a link, a file).
pub(crate) fn not_own_folder(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is not a directory of the tier's own (a link?): not followed", path.display()),
    )
}

/// Every folder of `chain` is a real directory (not a link, which would take a write,
/// read or removal outside the tier); the first that is not, as an error (`NotFound` when
/// absent).
pub(crate) fn own_folders(chain: &[&Path]) -> io::Result<()> {
    for d in chain {
        if !fs::symlink_metadata(d)?.file_type().is_dir() {
            return Err(not_own_folder(d));
        }
    }
    Ok(())
}

/// Create each folder of `chain` that is absent (in order: each one's parent must exist),
/// then check them all with [`own_folders`].
pub(crate) fn make_own_folders(chain: &[&Path]) -> io::Result<()> {
    for d in chain {
        match fs::create_dir(d) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            other => other?,
        }
    }
    own_folders(chain)
}

/// The real sub-directories of `dir` (links skipped, never followed) whose names are
/// `name_len` lowercase hex digits (the names the tiers give their layout and shard folders).
pub(crate) fn own_subdirs(dir: &Path, name_len: usize) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(dir) else { return Vec::new() };
    rd.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.len() == name_len && n.bytes().all(is_hex)))
        .map(|e| e.path())
        .collect()
}

/// Open the regular file at `path` (appending when `append`, else reading) without ever
/// blocking or following a link: refused unopened unless `lstat` says a regular file,
/// opened non-blocking (a FIFO swapped in meanwhile cannot hang the open), and refused
/// again (`InvalidData`) unless the open file is that same regular file.
pub(crate) fn open_regular(path: &Path, append: bool) -> io::Result<fs::File> {
    use std::os::unix::fs::MetadataExt;
    let not_regular = || io::Error::new(io::ErrorKind::InvalidData, "not a regular file");
    let before = fs::symlink_metadata(path)?;
    if !before.file_type().is_file() {
        return Err(not_regular());
    }
    let mut options = fs::OpenOptions::new();
    if append {
        options.append(true);
    } else {
        options.read(true);
    }
    #[cfg(target_os = "linux")]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, 0o4000); // O_NONBLOCK
    let file = options.open(path)?;
    let after = file.metadata()?;
    if !after.is_file() || (after.dev(), after.ino()) != (before.dev(), before.ino()) {
        return Err(not_regular());
    }
    Ok(file)
}

/// Set the regular file at `path`'s modification time to now (the tiers' LRU clock: access
/// times are unreliable, `noatime`, `relatime`); whether it was set. Never through a link.
pub(crate) fn touch(path: &Path) -> bool {
    open_regular(path, true).and_then(|f| f.set_modified(SystemTime::now())).is_ok()
}

/// Create the new file `path` (refused with [`io::ErrorKind::AlreadyExists`] if anything is
/// there, a link included) holding `pieces` in order; on stable storage before returning when
/// `sync`.
pub(crate) fn write_new(path: &Path, pieces: &[&[u8]], sync: bool) -> io::Result<()> {
    use std::io::Write;
    let mut f = fs::OpenOptions::new().write(true).create_new(true).open(path)?;
    for p in pieces {
        f.write_all(p)?;
    }
    if sync {
        f.sync_data()?;
    }
    Ok(())
}

/// Publish the entry `entry` in the (checked, real) folder `dir`: `write` creates a
/// temporary file exclusively (as [`write_new`] does, `AlreadyExists` if the name is taken)
/// and writes it whole; it is then renamed over the entry's name. A name that exists all the
/// same (a leftover) is retried with another; on any failure the temporary file this call
/// created is removed, and a file it did not create never is.
pub(crate) fn publish(
    dir: &Path,
    entry: &str,
    mut write: impl FnMut(&Path) -> io::Result<()>,
) -> io::Result<()> {
    let mut tries = 0;
    let tmp = loop {
        let tmp = dir.join(temp_name(entry));
        match write(&tmp) {
            Ok(()) => break tmp,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 3 => tries += 1,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(e),
            Err(e) => {
                // Created by this call (the name was free), so this call removes it.
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        }
    };
    if let Err(e) = fs::rename(&tmp, dir.join(entry)) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}

/// One file a scan found: an entry (`key` is what its name parses to) or a tier's temporary
/// file (`key` is `None`).
pub(crate) struct Found<K> {
    pub path: PathBuf,
    pub bytes: u64,
    pub mtime: SystemTime,
    pub key: Option<K>,
}

/// The files a tier writes (entries `parse` accepts and their temporary files) under one
/// layout's real folder (checked by the caller), in its real shard folders: links are never
/// followed (`DirEntry::file_type` and `metadata` do not), other names never listed.
pub(crate) fn scan_layout<K>(layout_dir: &Path, parse: &dyn Fn(&str) -> Option<K>, out: &mut Vec<Found<K>>) {
    for shard in own_subdirs(layout_dir, 2) {
        let Ok(files) = fs::read_dir(&shard) else { continue };
        for f in files.flatten() {
            if !f.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let Some(name) = f.file_name().to_str().map(str::to_owned) else { continue };
            let key = parse(&name);
            if key.is_none() && !is_temp_name(&name, parse) {
                continue;
            }
            let Ok(m) = f.metadata() else { continue };
            let mtime = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            out.push(Found { path: f.path(), bytes: m.len(), mtime, key });
        }
    }
}

/// [`scan_layout`] over every layout folder (`digest_len` hex digits) of the tier folder
/// `tier_dir`; nothing when `tier_dir` is not a real directory.
pub(crate) fn scan_tier<K>(
    tier_dir: &Path,
    digest_len: usize,
    parse: &dyn Fn(&str) -> Option<K>,
) -> Vec<Found<K>> {
    let mut found = Vec::new();
    if real_dir(tier_dir) {
        for l in own_subdirs(tier_dir, digest_len) {
            scan_layout(&l, parse, &mut found);
        }
    }
    found
}

/// What a [`sweep`] did.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Swept {
    /// Bytes left in the files found.
    pub used: u64,
    /// Entries removed, and their bytes.
    pub evicted: u64,
    pub evicted_bytes: u64,
    /// Dead writers' temporary files removed.
    pub stale_temps: u64,
}

/// The capacity sweep over the files a scan `found`: temporary files older than
/// [`STALE_TEMP`] removed, the others counted; when the total is over `budget`, the least
/// recently modified entries removed until it is at [`LOW_WATER`] of it.
pub(crate) fn sweep<K>(found: Vec<Found<K>>, budget: u64) -> Swept {
    let now = SystemTime::now();
    let mut s = Swept::default();
    let mut entries = Vec::new();
    for f in found {
        let temp = f.key.is_none();
        if temp && now.duration_since(f.mtime).is_ok_and(|age| age > STALE_TEMP) {
            if fs::remove_file(&f.path).is_ok() {
                s.stale_temps += 1;
            }
            continue;
        }
        s.used += f.bytes;
        if !temp {
            entries.push(f);
        }
    }
    if s.used > budget {
        let low = low_water(budget);
        entries.sort_by_key(|f| f.mtime);
        for f in entries {
            if s.used <= low {
                break;
            }
            if fs::remove_file(&f.path).is_ok() {
                s.used = s.used.saturating_sub(f.bytes);
                s.evicted += 1;
                s.evicted_bytes += f.bytes;
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_only_the_tiers_own_parse() {
        let n = entry_name('b', 0xabc);
        assert_eq!(parse_entry_name(&n), Some(('b', 0xabc)));
        for bad in ["B0000", "notes.txt", &n.to_uppercase(), &format!("b+{}", &n[2..]), &format!("{n}0")] {
            assert_eq!(parse_entry_name(bad), None, "{bad}");
        }
        let t = temp_name(&n);
        assert!(is_temp_name(&t, &parse_entry_name));
        assert_ne!(t, temp_name(&n), "two temporary names of one process are equal");
        for bad in [".tmp-notes", ".tmp-", &format!(".tmp-{n}"), &format!(".tmp-{n}-x"), &format!("{t}.bak")]
        {
            assert!(!is_temp_name(bad, &parse_entry_name), "{bad}");
        }
    }
}
