//! What the file-backed tiers' hostile tests (tests/tiers/shared_tier.rs, tests/tiers/entry_dir.rs) plant
//! in and around a tier's folders: old files that are not the tier's, FIFOs, and a bounded
//! wait for a call that may block in `open` on one; the temporary folders they run in.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// A fresh directory `name`-`pid` under the system's temporary one, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Set `path`'s modification time `secs` seconds in the past.
pub fn age(path: &Path, secs: u64) {
    let f = std::fs::File::options().append(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(secs)).unwrap();
}

/// A file outside the tier (or of no one's inside it): `len` bytes, an hour old.
pub fn outside_file(path: &Path, len: usize) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, vec![7u8; len]).unwrap();
    age(path, 3600);
}

/// Make `path` a FIFO.
pub fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let ok = std::process::Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}

/// Run `f` on a thread; its result, or `None` (after freeing the thread by opening the FIFO
/// at `fifo` from the other end) when it does not return within 5 s.
pub fn within_5s<T: Send + 'static>(fifo: &Path, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(v) => Some(v),
        Err(_) => {
            // Both ends, non-blocking for the reader end: whichever the thread waits on opens.
            use std::os::unix::fs::OpenOptionsExt;
            let _r = std::fs::OpenOptions::new().read(true).custom_flags(0o4000).open(fifo);
            let _w = std::fs::OpenOptions::new().write(true).custom_flags(0o4000).open(fifo);
            let _ = rx.recv_timeout(Duration::from_secs(5));
            None
        }
    }
}
