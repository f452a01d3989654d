//! Running the built `v4pool` binary under hostile conditions: a deadline (a hang is a
//! failure, not a stuck test), stdout captured, full (`/dev/full`) or closed (the reader
//! dropped before the command writes), and the checks every failure must pass.
#![allow(dead_code)]

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where the command's stdout goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    Capture,
    /// `/dev/full`: every write fails with ENOSPC.
    Full,
    /// A pipe whose reading end is closed before the command writes.
    Closed,
}

/// What one run did.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub hung: bool,
    pub stdout: String,
    pub stderr: String,
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// Run `v4pool args` with stdout as `out`, killed after `limit`.
pub fn v4pool(args: &[OsString], out: Out, limit: Duration) -> Run {
    let stdout = match out {
        Out::Capture | Out::Closed => Stdio::piped(),
        Out::Full => {
            Stdio::from(std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full"))
        }
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_v4pool"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .expect("the built binary runs");
    let out_reader = match (out, child.stdout.take()) {
        (Out::Capture, Some(s)) => Some(drain(s)),
        // Dropping the reading end closes the pipe: the command's first write gets EPIPE.
        (_, s) => {
            drop(s);
            None
        }
    };
    let err_reader = drain(child.stderr.take().expect("stderr piped"));
    let start = Instant::now();
    let (status, hung) = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break (s, false);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break (child.wait().expect("wait after kill"), true);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let text = |v: Vec<u8>| String::from_utf8_lossy(&v).into_owned();
    Run {
        code: status.code(),
        signal: status.signal(),
        hung,
        stdout: out_reader.map(|h| text(h.join().unwrap_or_default())).unwrap_or_default(),
        stderr: text(err_reader.join().unwrap_or_default()),
    }
}

/// `args` as OS strings.
pub fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// The contract for any run: it ended by itself, by exit (no signal, no panic), with status
/// 0, 1 (only `simulate` failing mid-run) or 2; a failure says so in exactly one line —
/// on stderr, or as one JSON object on stdout when `--json` was asked for and stdout works.
/// With stdout closed, a JSON error may have reached the pipe before the reader went away
/// (unseen), so stderr holds at most that one line.
pub fn check_contract(what: &str, r: &Run, out: Out) {
    assert!(!r.hung, "{what}: hung");
    assert_eq!(r.signal, None, "{what}: killed by signal {:?}; stderr {:?}", r.signal, r.stderr);
    assert!(!r.stderr.contains("panicked"), "{what}: panicked: {}", r.stderr);
    let code = r.code.expect("no signal, so an exit status");
    assert!(code == 0 || code == 1 || code == 2, "{what}: exit status {code}; stderr {:?}", r.stderr);
    if code != 0 {
        // `simulate`'s banner is not a failure line: a failure after it (output that could
        // not be written) adds exactly one.
        let err_lines = r.stderr.lines().filter(|l| !l.contains(" arrivals/step over ")).count();
        let json_error = r.stdout.lines().count() == 1
            && serde_json::from_str::<serde_json::Value>(&r.stdout).is_ok_and(|v| v.get("error").is_some());
        let unseen = out == Out::Closed && err_lines == 0;
        assert!(
            (err_lines == 1 && r.stdout.is_empty()) || (err_lines == 0 && json_error) || unseen,
            "{what}: exit {code} must say why in exactly one line; stdout {:?} stderr {:?}",
            r.stdout,
            r.stderr
        );
    }
}
