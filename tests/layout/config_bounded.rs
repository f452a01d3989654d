//! Every entry point reads a model config through the one bounded reader
//! (`ModelShape::from_config_path`): `PlanOptions::model_shape` (what the Python
//! `v4pool.plan(model=...)` and the C `v4pool_plan` call) refuses a FIFO without blocking,
//! a device without reading it, and a file over `MAX_CONFIG_BYTES` after reading at most one
//! byte past the limit. Before the fix it used `read_to_string`: a FIFO blocked forever (this
//! test timed out) and a 50 MB file was read whole and parsed.

use std::sync::mpsc;
use std::time::Duration;
use v4pool::model::{ModelError, MAX_CONFIG_BYTES};
use v4pool::plan_report::{PlanOptionError, PlanOptions};
use v4pool::raw::file::FileError;

/// `model_shape` for `path` on another thread, failing (not hanging) if it blocks.
fn shape_of(path: &str) -> Result<v4pool::model::ModelShape, PlanOptionError> {
    let o = PlanOptions::new(path, 1 << 30, 4);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(o.model_shape());
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("model_shape blocked")
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("v4pool-config-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = scratch("fifo");
    let fifo = dir.join("config.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        println!("SKIP a_fifo_is_refused_without_blocking: no mkfifo");
        return;
    }
    let r = shape_of(fifo.to_str().unwrap());
    assert!(matches!(r, Err(PlanOptionError::Model(ModelError::File(FileError::NotAFile { .. })))), "{r:?}");
    // The directory form reaches the same file.
    let r = shape_of(dir.to_str().unwrap());
    assert!(matches!(r, Err(PlanOptionError::Model(ModelError::File(FileError::NotAFile { .. })))), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn devices_are_refused_unread() {
    for dev in ["/dev/zero", "/dev/urandom"] {
        if std::path::Path::new(dev).exists() {
            let r = shape_of(dev);
            assert!(
                matches!(r, Err(PlanOptionError::Model(ModelError::File(FileError::NotAFile { .. })))),
                "{dev}: {r:?}"
            );
        }
    }
}

#[test]
fn a_config_past_the_limit_is_refused() {
    let dir = scratch("large");
    let path = dir.join("config.json");
    // Valid JSON of 50 MB: a real config padded with a long string.
    let pad = "x".repeat(50 << 20);
    std::fs::write(&path, format!("{{\"pad\": \"{pad}\"}}")).expect("write");
    assert!(std::fs::metadata(&path).unwrap().len() > MAX_CONFIG_BYTES);
    let r = shape_of(path.to_str().unwrap());
    assert!(matches!(r, Err(PlanOptionError::Model(ModelError::File(FileError::TooLarge { .. })))), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
