//! Reading a `config.json` as the CLI is handed it: bounded in size, regular files only.
//!
//! A FIFO would block the read forever, `/dev/zero` or `/dev/urandom` would grow memory
//! without end, so only a regular file of at most [`MAX_CONFIG_BYTES`] is read. Model
//! configs are a few kilobytes.

use crate::CliError;
use std::io::Read;
use std::path::Path;

/// Largest config file read (1 MiB).
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of the config file at `path`: a regular file of at most [`MAX_CONFIG_BYTES`]
/// holding UTF-8.
pub(crate) fn read_config(path: &Path) -> Result<String, CliError> {
    let io = |reason: String| CliError::Io { path: path.display().to_string(), reason };
    // `metadata` does not open the file, so a FIFO is refused before anything blocks on it.
    let meta = std::fs::metadata(path).map_err(|e| io(e.to_string()))?;
    if !meta.is_file() {
        return Err(io("not a regular file".into()));
    }
    let file = std::fs::File::open(path).map_err(|e| io(e.to_string()))?;
    // The path may have been swapped between the two looks: check what was opened.
    if !file.metadata().map_err(|e| io(e.to_string()))?.is_file() {
        return Err(io("not a regular file".into()));
    }
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text).map_err(|e| io(e.to_string()))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(io(format!("larger than {MAX_CONFIG_BYTES} bytes")));
    }
    Ok(text)
}
