//! The one bounded file reader: every file the crate reads on a caller's word (a model's
//! `config.json`, a Mooncake trace, a step-cost coefficient file) comes through
//! [`read_bounded`], so a path that names a FIFO cannot hang the open, a device
//! (`/dev/zero`) is not read at all, and a file over its reader's cap is refused unread (its
//! length) or after at most one byte past the cap (a file that grows) — never read whole,
//! never silently cut at the cap. Each reader names its
//! own cap ([`crate::model::MAX_CONFIG_BYTES`], [`crate::sim::trace::MAX_TRACE_BYTES`],
//! [`crate::sim::cost::MAX_COST_BYTES`]).

use std::io::Read as _;
use std::path::Path;
use thiserror::Error;

crate::variant::variant_names! {
/// What the bounded reader refuses.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum FileError {
    /// The file could not be read.
    #[error("cannot read {path}: {reason}")]
    Io {
        /// The path as given.
        path: String,
        /// The operating system's reason.
        reason: String,
    },
    /// The path names something other than a regular file (a FIFO, a device such as
    /// `/dev/zero`, a socket, a directory): refused before it is read, so reading cannot hang.
    #[error("{path} is {kind}, not a regular file")]
    NotAFile {
        /// The path as given.
        path: String,
        /// What it is instead.
        kind: &'static str,
    },
    /// A file larger than its reader's cap.
    #[error("{path} is larger than the {limit} bytes its reader takes")]
    TooLarge {
        /// The path as given.
        path: String,
        /// The cap it exceeds.
        limit: u64,
    },
    /// A text file that is not UTF-8.
    #[error("{path} is not UTF-8 text: {reason}")]
    NotUtf8 {
        /// The path as given.
        path: String,
        /// Where it stops being UTF-8.
        reason: String,
    },
}
}

/// The bytes of the regular file at `path`, at most `limit` of them (see the module doc).
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    let shown = || path.display().to_string();
    let io = |e: std::io::Error| FileError::Io { path: shown(), reason: e.to_string() };
    let not_a_file = |meta: &std::fs::Metadata| FileError::NotAFile { path: shown(), kind: file_kind(meta) };
    // Checked before the open: opening a FIFO for reading waits for a writer.
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(not_a_file(&meta));
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // Non-blocking, so a regular file swapped for a FIFO after the check above cannot hang
    // the open; it is refused by the second check, on the open handle.
    #[cfg(target_os = "linux")]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, 0o4000); // O_NONBLOCK
    let file = options.open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(not_a_file(&meta));
    }
    let too_large = || FileError::TooLarge { path: shown(), limit };
    // A regular file's length refuses it unread; the read's own cap covers one that grows.
    if meta.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read_bounded`], as UTF-8 text.
pub fn read_text_bounded(path: &Path, limit: u64) -> Result<String, FileError> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|e| FileError::NotUtf8 { path: path.display().to_string(), reason: e.to_string() })
}

/// What a non-regular file is, in words.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_exact_and_named() {
        let dir = std::env::temp_dir().join(format!("v4pool-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_bounded(&p, 10).unwrap(), b"0123456789");
        let r = read_bounded(&p, 9);
        assert!(matches!(&r, Err(FileError::TooLarge { limit: 9, .. })), "{r:?}");
        assert!(r.unwrap_err().to_string().contains("9 bytes"));
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(matches!(read_text_bounded(&p, 10), Err(FileError::NotUtf8 { .. })));
        assert!(matches!(read_bounded(&dir, 10), Err(FileError::NotAFile { kind: "a directory", .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
