//! A seeded, bounded fuzz of the `v4pool` command: random argument lists built from every
//! subcommand's options with hostile values (negative, huge, `1e309`, NaN, hex, empty,
//! non-UTF-8), unknown flags, missing values, hostile config files (a directory, a FIFO,
//! `/dev/zero`, a 64 MiB file, invalid JSON, deep nesting, non-UTF-8 bytes), and stdout
//! captured, full (`/dev/full`) or closed. Every run must end by itself, by exit, never a
//! panic or a signal; every failure exits 2 with exactly one line.
//!
//! `V4POOL_FUZZ_CASES` sets the case count (default 200) and `V4POOL_FUZZ_SEED` the seed
//! (default 1); a failure names the case's arguments so it can be replayed.

use crate::cli_support;

use cli_support::{check_contract, v4pool, Out};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use v4pool::sim::Rng;

const NUMBERS: [&str; 24] = [
    "-1",
    "0",
    "1",
    "2",
    "7",
    "256",
    "-9223372036854775808",
    "9223372036854775807",
    "18446744073709551616",
    "99999999999999999999999",
    "1e309",
    "-1e309",
    "NaN",
    "inf",
    "0x10",
    "",
    " ",
    "1.5",
    "٣",
    "4,128,4,0",
    "0,,4",
    "4,128,-1,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0",
    "--json",
    "=",
];
const BUDGETS: [&str; 8] = ["1GiB", "512MiB", "0", "-1", "12XB", "1e309", "", "99999999999999999999999"];
const WORDS: [&str; 12] = [
    "v4-flash",
    "v4-pro",
    "v4-flash-dspark",
    "chat",
    "agentic",
    "mixed",
    "fp8",
    "bf16",
    "fp4",
    "both",
    "host",
    "nope",
];

/// The options a subcommand's `--help` names: the fuzz follows the CLI as it changes.
fn options_of(command: &str) -> Vec<&'static str> {
    let r = v4pool(&[command.into(), "--help".into()], Out::Capture, Duration::from_secs(30));
    assert_eq!(r.code, Some(0), "{command} --help: {r:?}");
    let mut found: Vec<&'static str> = r
        .stdout
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| &*Box::leak(w.to_string().into_boxed_str()))
        .collect();
    found.sort_unstable();
    found.dedup();
    assert!(found.len() > 3, "{command} --help names too few options: {found:?}");
    found
}

/// Hostile files, made once per run of the test.
struct Files {
    dir: PathBuf,
    paths: Vec<String>,
}

impl Files {
    fn new() -> Files {
        let dir = std::env::temp_dir().join(format!("v4pool-cli-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("folder")).unwrap();
        let write = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            p.display().to_string()
        };
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let mut paths = vec![
            "/dev/zero".to_string(),
            "/dev/urandom".to_string(),
            "/dev/null".to_string(),
            "/nonexistent/config.json".to_string(),
            dir.join("folder").display().to_string(),
            write("invalid.json", b"{\"num_hidden_layers\": 4,"),
            write("deep.json", deep.as_bytes()),
            write("binary.json", &[0xff, 0xfe, 0x00, 0x7b]),
            write("empty.json", b""),
            write("wrong.json", b"{\"compress_ratios\": \"no\"}"),
        ];
        let huge = dir.join("huge.json");
        std::fs::File::create(&huge).unwrap().set_len(64 << 20).unwrap();
        paths.push(huge.display().to_string());
        let fifo = dir.join("fifo.json");
        if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
            paths.push(fifo.display().to_string());
        } else {
            println!("SKIP FIFO cases: mkfifo is not available");
        }
        Files { dir, paths }
    }
    fn svg(&self, rng: &mut Rng) -> String {
        match rng.range(0, 4) {
            0 => self.dir.join("out.svg").display().to_string(),
            1 => "/nonexistent/dir/out.svg".to_string(),
            2 => self.dir.join("fifo.json").display().to_string(),
            _ => self.dir.join("folder").display().to_string(),
        }
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn pick<'a>(rng: &mut Rng, from: &[&'a str]) -> &'a str {
    from[rng.range(0, from.len() as i64) as usize]
}

/// A value for `key`: usually hostile, sometimes sensible.
fn value(rng: &mut Rng, key: &str, files: &Files) -> OsString {
    let v = match (key, rng.range(0, 10)) {
        (_, 0) => return OsString::from_vec(vec![b'4', 0xff, b'8']),
        ("--model", 1..=5) => files.paths[rng.range(0, files.paths.len() as i64) as usize].clone(),
        ("--svg", _) => files.svg(rng),
        ("--budget" | "--overhead", _) => pick(rng, &BUDGETS).to_string(),
        (_, 1..=2) => pick(rng, &WORDS).to_string(),
        _ => pick(rng, &NUMBERS).to_string(),
    };
    OsString::from(v)
}

/// One random argument list.
fn case(rng: &mut Rng, files: &Files, options: &[Vec<&'static str>; 3]) -> Vec<OsString> {
    let command = pick(rng, &["layout", "layout", "plan", "plan", "simulate", "simulate", "help", "bogus"]);
    let mut args = vec![OsString::from(command)];
    let options: &[&str] = match command {
        "layout" => &options[0],
        "plan" => &options[1],
        _ => &options[2],
    };
    if command == "simulate" {
        // Small, host-only runs: the fuzz is after the parser and the refusals, not the
        // simulator's throughput (and a huge budget would only measure the machine).
        for a in
            ["--steps", "12", "--budget", "512MiB", "--max-seqs", "2", "--backend", "host", "--no-progress"]
        {
            args.push(a.into());
        }
    } else if command == "layout" && rng.range(0, 2) == 0 {
        for a in ["--ratios", "4,128,4,0", "--blocks", "3", "--slots", "2", "--ring", "7"] {
            args.push(a.into());
        }
    }
    for _ in 0..rng.range(0, 5) {
        match rng.range(0, 12) {
            0 => args.push(pick(rng, &["--nope", "-x", "--", "--json=1", "stray", "--help=no"]).into()),
            1 => args.push(pick(rng, options).into()), // possibly missing its value
            2 => args.push("--json".into()),
            _ => {
                let key = pick(rng, options);
                args.push(key.into());
                args.push(value(rng, key, files));
            }
        }
    }
    args
}

#[test]
fn hostile_command_lines_never_panic_and_fail_in_one_line() {
    let cases: u64 = std::env::var("V4POOL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let seed: u64 = std::env::var("V4POOL_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let files = Files::new();
    let options = ["layout", "plan", "simulate"].map(options_of);
    let mut rng = Rng::new(seed);
    let mut by_status = [0u32; 3];
    for i in 0..cases {
        let args = case(&mut rng, &files, &options);
        let out = match rng.range(0, 6) {
            0 => Out::Full,
            1 => Out::Closed,
            _ => Out::Capture,
        };
        let r = v4pool(&args, out, Duration::from_secs(60));
        let what = format!("case {i} (seed {seed}) {args:?} stdout {out:?}");
        check_contract(&what, &r, out);
        assert_ne!(r.code, Some(1), "{what}: only a run failing mid-way exits 1: {r:?}");
        by_status[r.code.unwrap_or(0) as usize] += 1;
    }
    println!("{cases} cases: {} exit 0, {} exit 2", by_status[0], by_status[2]);
    assert!(by_status[0] > 0 && by_status[2] > 0, "the fuzz should reach both successes and refusals");
    let _ = Path::new(&files.dir);
}
