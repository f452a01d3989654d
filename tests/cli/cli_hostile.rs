//! The CLI under the misuse issue 10 lists (points 4, 5, 7, 8), each case run as a binary
//! with a deadline: non-UTF-8 arguments, closed and full stdout, config paths that are not
//! regular bounded files, and `simulate`'s bad input refused (exit 2, one line, no banner)
//! before anything runs.

use crate::cli_support;

use cli_support::{check_contract, os, v4pool, Out, Run};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

fn refused(what: &str, r: &Run) {
    check_contract(what, r, Out::Capture);
    assert_eq!(r.code, Some(2), "{what}: {r:?}");
}

#[test]
fn a_non_utf8_argument_exits_2_with_one_line() {
    for at in 0..3 {
        let mut args = os(&["layout", "--ratios", "4,128"]);
        args[at] = OsString::from_vec(vec![b'-', b'-', 0xff, 0xfe]);
        let r = v4pool(&args, Out::Capture, LIMIT);
        refused("non-UTF-8", &r);
        assert!(r.stderr.contains("not valid UTF-8"), "{r:?}");
    }
    let mut args = os(&["plan", "--json"]);
    args.push(OsString::from_vec(vec![0x80]));
    let r = v4pool(&args, Out::Capture, LIMIT);
    refused("non-UTF-8 with --json", &r);
    assert!(r.stdout.contains("\"NotUtf8\""), "{r:?}");
}

#[test]
fn a_closed_stdout_ends_quietly() {
    // Far more than a pipe buffers, so the command is still writing when it learns the
    // reader is gone (as under `| head -c 10`).
    let big = os(&[
        "layout",
        "--ratios",
        "4,128,4,0",
        "--blocks",
        "3",
        "--slots",
        "200000",
        "--ring",
        "7",
        "--json",
    ]);
    for args in
        [big, os(&["help"]), os(&["plan", "--model", "v4-flash", "--budget", "8GiB", "--max-seqs", "8"])]
    {
        let r = v4pool(&args, Out::Closed, LIMIT);
        check_contract("closed stdout", &r, Out::Closed);
        assert_eq!(r.code, Some(0), "{args:?}: {r:?}");
        assert_eq!(r.stderr, "", "{args:?}: a closed pipe is not an error to report");
    }
}

#[test]
fn a_full_stdout_is_one_line_on_stderr() {
    for args in
        [os(&["help"]), os(&["layout", "--ratios", "4,128", "--blocks", "1", "--slots", "1", "--ring", "7"])]
    {
        let r = v4pool(&args, Out::Full, LIMIT);
        check_contract("/dev/full", &r, Out::Full);
        assert_eq!(r.code, Some(2));
        assert!(r.stderr.contains("cannot write output"), "{r:?}");
    }
    // A failure that would go to stdout as JSON comes out on stderr instead.
    let r = v4pool(&os(&["layout", "--nope", "--json"]), Out::Full, LIMIT);
    check_contract("/dev/full with --json", &r, Out::Full);
    assert_eq!(r.code, Some(2));
}

/// A fresh scratch folder for test `name`, and a FIFO `fifo` in it (`None`: no mkfifo here).
fn scratch_with_fifo(name: &str, fifo: &str) -> (std::path::PathBuf, Option<std::path::PathBuf>) {
    let dir = std::env::temp_dir().join(format!("v4pool-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(fifo);
    let _ = std::fs::remove_file(&path);
    let made = std::process::Command::new("mkfifo").arg(&path).status().is_ok_and(|s| s.success());
    (dir, made.then_some(path))
}

/// A config path that is not a small regular file is refused at once (no hang on a FIFO,
/// no unbounded read of a device).
#[test]
fn config_paths_are_read_bounded() {
    let (dir, fifo) = scratch_with_fifo("hostile", "fifo.json");
    let made = fifo.is_some();
    let fifo = fifo.unwrap_or_default();
    let huge = dir.join("huge.json");
    std::fs::File::create(&huge).unwrap().set_len(64 << 20).unwrap();
    let mut paths = vec!["/dev/zero".to_string(), "/dev/urandom".to_string(), huge.display().to_string()];
    if made {
        // An --svg FIFO would block the open for writing until a reader came.
        let r = simulate(&["--svg", &fifo.display().to_string()]);
        refused("simulate --svg FIFO", &r);
        paths.push(fifo.display().to_string());
    } else {
        println!("SKIP the FIFO case: mkfifo is not available");
    }
    for path in &paths {
        for cmd in ["layout", "plan", "simulate"] {
            let r = v4pool(
                &os(&[
                    cmd,
                    "--model",
                    path,
                    "--blocks",
                    "1",
                    "--slots",
                    "1",
                    "--budget",
                    "1GiB",
                    "--max-seqs",
                    "1",
                ]),
                Out::Capture,
                Duration::from_secs(20),
            );
            refused(&format!("{cmd} --model {path}"), &r);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn simulate(extra: &[&str]) -> Run {
    let mut args =
        os(&["simulate", "--budget", "1GiB", "--max-seqs", "4", "--steps", "20", "--backend", "host"]);
    args.extend(os(extra));
    v4pool(&args, Out::Capture, LIMIT)
}

/// Bad input to `simulate` is exit 2 with one line, before its banner and before any run.
#[test]
fn simulate_refuses_bad_input_before_its_banner() {
    let cases: [&[&str]; 10] = [
        &["--svg", "/dev/stdin/x"],
        &["--backend", "nope"],
        &["--rate", "1e309"],
        &["--rate", "NaN"],
        &["--steps", "-5"],
        &["--seed", "-1"],
        &["--elastic-max-seqs", "100000000"],
        &["--elastic-max-seqs", "2"],
        &["--max-context", "99999999999"],
        &["--svg", "/nonexistent-dir/sim.svg"],
    ];
    for extra in cases {
        let r = simulate(extra);
        refused(&format!("simulate {extra:?}"), &r);
        assert!(!r.stderr.contains("budget"), "{extra:?}: the banner was printed: {:?}", r.stderr);
    }
}

/// The decode buffers are bounded by the budget: more running requests than the plane has
/// slot positions is refused (it was clamped to 65,536 and, with a 16M-token context, sized
/// 17 GB of block tables), not clamped and not allocated.
#[test]
fn simulate_bounds_the_decode_buffers_by_the_budget() {
    let r = simulate(&["--elastic-max-seqs", "65536", "--max-context", "16777216"]);
    refused("elastic-max-seqs beyond the plane", &r);
    assert!(r.stderr.contains("--elastic-max-seqs of 65536 is outside 4..="), "{r:?}");
    let ok = simulate(&["--json", "--max-context", "16777216"]);
    check_contract("a small run", &ok, Out::Capture);
    assert_eq!(ok.code, Some(0), "{ok:?}");
}

/// A `--max-context` shorter than the mix's requests can be is refused (exit 2, one line):
/// agentic prompts are 32K tokens and up, so the mixed and agentic mixes need 32,769.
#[test]
fn simulate_refuses_a_max_context_its_mix_cannot_draw() {
    // Seen failing before the fix: exit 101, a panic in the generator's clamp (min > max).
    for mix in ["mixed", "agentic"] {
        for context in ["2", "32768"] {
            let r = simulate(&["--no-progress", "--mix", mix, "--max-context", context]);
            refused(&format!("--mix {mix} --max-context {context}"), &r);
            assert!(r.stderr.contains("32769") && r.stderr.contains(mix), "{r:?}");
        }
    }
    for (mix, context) in [("chat", "2"), ("multiturn", "2"), ("mixed", "32769")] {
        let r = simulate(&["--no-progress", "--json", "--mix", mix, "--max-context", context]);
        check_contract(&format!("--mix {mix} --max-context {context}"), &r, Out::Capture);
        assert_eq!(r.code, Some(0), "--mix {mix} --max-context {context}: {r:?}");
    }
}

/// The trace and the cost file are read as a config is (one bounded reader): a FIFO or a
/// device refused unopened or unread, a file over the cap refused with the cap named, and
/// nothing past the cap silently dropped.
#[test]
fn trace_and_cost_files_are_read_bounded() {
    // Seen failing before the fix: a --trace FIFO blocked in open (past the deadline),
    // /dev/zero was read for 1 GiB and refused as JSON, not as a device.
    let (dir, fifo) = scratch_with_fifo("files", "trace.fifo");
    let mut unread = vec![("/dev/zero".to_string(), "a character device")];
    match fifo {
        Some(f) => unread.push((f.display().to_string(), "a FIFO")),
        None => println!("SKIP the FIFO case: mkfifo is not available"),
    }
    for (path, kind) in &unread {
        for key in ["--trace", "--cost"] {
            let r = v4pool(
                &os(&["simulate", key, path, "--budget", "1GiB"]),
                Out::Capture,
                Duration::from_secs(20),
            );
            refused(&format!("{key} {path}"), &r);
            assert!(r.stderr.contains(kind), "{key} {path}: {r:?}");
        }
    }
    let huge = dir.join("huge.jsonl");
    std::fs::File::create(&huge).unwrap().set_len(v4pool::sim::trace::MAX_TRACE_BYTES + 1).unwrap();
    let r = v4pool(&os(&["simulate", "--trace", &huge.display().to_string()]), Out::Capture, LIMIT);
    refused("--trace past the cap", &r);
    assert!(r.stderr.contains(&v4pool::sim::trace::MAX_TRACE_BYTES.to_string()), "{r:?}");
    // Seen failing before the fix: exit 0, the file read to 1 MiB and the rest dropped.
    let cost = v4pool::sim::cost::preset("h200x4-flash-fp8").unwrap().to_json().to_string();
    let padded = dir.join("cost.json");
    std::fs::write(&padded, format!("{cost}{}garbage", " ".repeat(1 << 20))).unwrap();
    let r = simulate(&["--no-progress", "--cost", &padded.display().to_string()]);
    refused("--cost past the cap", &r);
    assert!(r.stderr.contains(&v4pool::sim::cost::MAX_COST_BYTES.to_string()), "{r:?}");
    // The same coefficients unpadded are read.
    std::fs::write(&padded, &cost).unwrap();
    let r =
        simulate(&["--no-progress", "--json", "--policy", "fixed", "--cost", &padded.display().to_string()]);
    check_contract("--cost FILE", &r, Out::Capture);
    assert_eq!(r.code, Some(0), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// defect43 row 14: every subcommand with `--dtype` takes every row format (one parser), and
/// its `--help` and its refusal list the same formats. `simulate --dtype flashmla-v4` was
/// refused with "is not fp8, bf16, flashmla-v4 or flashmla-v41" while its help said
/// `fp8|bf16`.
#[test]
fn defect43_row14_every_dtype_flag_takes_every_format_and_says_so() {
    const FORMATS: [&str; 6] =
        ["fp8", "bf16", "flashmla-v4", "flashmla-v4-p2", "flashmla-v41", "flashmla-v41-fp4"];
    let rest: [&[&str]; 3] = [
        &["--model", "v4-flash", "--budget", "1GiB", "--max-seqs", "1"],
        &["--model", "v4-flash", "--blocks", "1", "--slots", "1"],
        &[],
    ];
    for (cmd, rest) in ["plan", "layout", "simulate"].into_iter().zip(rest) {
        let help = v4pool(&os(&[cmd, "--help"]), Out::Capture, LIMIT);
        assert_eq!(help.code, Some(0), "{help:?}");
        let line = help.stdout.lines().find(|l| l.contains("--dtype")).expect("--dtype in the help");
        let listed = line.split_whitespace().find(|w| w.starts_with("fp8")).unwrap_or("");
        let listed = listed.trim_end_matches([']', ',']);
        assert_eq!(listed.split('|').collect::<Vec<_>>(), FORMATS, "{cmd} --help: {line}");
        let r = v4pool(&os(&[&[cmd, "--dtype", "fp16"], rest].concat()), Out::Capture, LIMIT);
        refused(&format!("{cmd} --dtype fp16"), &r);
        let want = "fp8, bf16, flashmla-v4, flashmla-v4-p2, flashmla-v41 or flashmla-v41-fp4";
        assert!(r.stderr.contains(want), "{cmd}: {:?}", r.stderr);
    }
    // Each format sizes the plane its own way: the blocks a run ends with tell them apart.
    let mut blocks = Vec::new();
    for (model, dtype) in [
        ("v4-flash", "fp8"),
        ("v4-flash", "bf16"),
        ("v4-flash", "flashmla-v4"),
        ("v4-flash", "flashmla-v4-p2"),
        ("v4.1-flash", "flashmla-v41"),
        ("v4.1-flash", "flashmla-v41-fp4"),
    ] {
        let r = simulate(&["--no-progress", "--json", "--mix", "chat", "--model", model, "--dtype", dtype]);
        check_contract(&format!("simulate --model {model} --dtype {dtype}"), &r, Out::Capture);
        assert_eq!(r.code, Some(0), "simulate --model {model} --dtype {dtype}: {r:?}");
        let report: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        blocks.push(report["runs"][0]["final"]["num_blocks"].as_u64().expect("final.num_blocks"));
    }
    let mut distinct = blocks.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), blocks.len(), "a --dtype was not used: blocks {blocks:?}");
}

/// defect43 row 20: every name `include/v4pool.h` gives C is v4pool's own — types `V4pool…`,
/// enumerators and macros `V4POOL_…`, functions `v4pool_…` — so an application that has
/// its own `Class` or `Compressor` links. The header exported `typedef struct Class Class`
/// and `typedef struct Compressor Compressor`.
#[test]
fn defect43_row20_the_c_header_names_only_prefixed_things() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/v4pool.h")).unwrap();
    let mut code = String::new();
    let mut rest = header.as_str();
    // Comments out (they name Rust items).
    while let Some(at) = rest.find("/*") {
        code.push_str(&rest[..at]);
        rest = rest[at..].find("*/").map_or("", |end| &rest[at + end + 2..]);
    }
    code.push_str(rest);
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut bad = Vec::new();
    let mut names = 0;
    for line in code.lines() {
        let t = line.trim();
        let mut check = |name: String, prefix: &str| {
            names += 1;
            if !name.starts_with(prefix) {
                bad.push(format!("{name} (want {prefix}…): {t}"));
            }
        };
        for kw in ["typedef struct ", "typedef enum ", "struct ", "enum "] {
            if let Some(r) = t.strip_prefix(kw) {
                check(ident(r), "V4pool");
            }
        }
        if let Some(name) = t.strip_prefix("} ").map(ident).filter(|n| !n.is_empty()) {
            check(name, "V4pool");
        }
        if let Some(r) = t.strip_prefix("#define ") {
            check(ident(r), "V4POOL_");
        }
        // Enumerators: `  NAME = 1,` (struct fields have a type before the name).
        let first = ident(t);
        if line.starts_with("  ")
            && !first.is_empty()
            && (t[first.len()..].starts_with(" =") || &t[first.len()..] == ",")
        {
            check(first, "V4POOL_");
        }
        if !line.starts_with(' ') && t.contains('(') && !t.starts_with('#') {
            let before = &t[..t.find('(').unwrap()];
            check(before.rsplit([' ', '*']).next().unwrap().to_string(), "v4pool_");
        }
    }
    assert!(names > 100, "the header was not read: {names} names");
    assert!(bad.is_empty(), "unprefixed C names in include/v4pool.h:\n{}", bad.join("\n"));
}

/// defect43 row 20: the scripts stand on their own — no path into a folder outside the
/// repository (`scripts/tier-bench-gpu.sh` named this team's `../shared/gpu/pack`).
#[test]
fn defect43_row20_scripts_name_no_folder_outside_the_repository() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts");
    let mut bad = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for (i, line) in text.lines().enumerate() {
            if ["../shared", "/work/", "shared/gpu"].iter().any(|p| line.contains(p)) {
                bad.push(format!("{}:{}: {line}", path.display(), i + 1));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// defect43 row 20: a build where no device compiler is installed is quiet — no
/// `cargo:warning` (every downstream build printed "nvcc not found … no sm_90 cubin") — but
/// says what it skipped when device code was required (`V4POOL_REQUIRE_DEVICE_BUILD=1`) or
/// a compiler was named and is not there. build.rs itself, compiled here and run as cargo
/// runs it, with an empty PATH.
#[test]
fn defect43_row20_a_build_without_device_compilers_is_quiet() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = std::env::temp_dir().join(format!("v4pool-build-rs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("out")).unwrap();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    let exe = dir.join("build-script");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let built = std::process::Command::new(rustc)
        .args(["--edition", "2021", "--crate-name", "build_script", "-o"])
        .arg(&exe)
        .arg(format!("{root}/build.rs"))
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let run = |env: &[(&str, &str)]| {
        let mut c = std::process::Command::new(&exe);
        c.current_dir(root).env_clear().env("OUT_DIR", dir.join("out")).env("PATH", dir.join("bin"));
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text.lines().filter(|l| l.starts_with("cargo:warning=")).map(str::to_string).collect::<Vec<_>>()
    };
    let quiet = run(&[]);
    assert!(quiet.is_empty(), "nothing is wrong, yet:\n{}", quiet.join("\n"));
    let log = std::fs::read_to_string(dir.join("out/v4pool_kernel_build.txt")).unwrap();
    assert!(log.contains("nvcc not found"), "the build log still says what was skipped: {log:?}");
    let required = run(&[("V4POOL_REQUIRE_DEVICE_BUILD", "1")]);
    assert!(required.iter().any(|l| l.contains("nvcc not found")), "{required:?}");
    let named = run(&[("NVCC", "/nonexistent/nvcc"), ("V4POOL_CLANG", "/nonexistent/clang")]);
    assert!(named.iter().any(|l| l.contains("/nonexistent/nvcc")), "{named:?}");
    assert!(named.iter().any(|l| l.contains("/nonexistent/clang") || l.contains("clang")), "{named:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// defect43 row 20: a packed plan whose compressed view outgrows an i32 index says so — it
/// reported the compressed view's rows as the plane's ("plane of 2629338624 rows does not
/// fit an i32 index").
#[test]
fn defect43_row20_a_plan_too_large_names_the_compressed_view() {
    let r = v4pool(
        &os(&[
            "plan",
            "--model",
            "v4.1-flash",
            "--dtype",
            "flashmla-v41-fp4",
            "--budget",
            "1TiB",
            "--max-seqs",
            "16",
        ]),
        Out::Capture,
        LIMIT,
    );
    refused("plan flashmla-v41-fp4 1TiB", &r);
    assert!(r.stderr.contains("the compressed view of a plane of "), "{:?}", r.stderr);
}

/// defect43 row 18 (issue 44 item 2's "one default per family"): `simulate` without `--dtype`
/// takes the model family's rows, as `plan` does: V4.1 runs on `flashmla-v41` instead of being
/// refused because fp8 rows do not fit it. It defaulted to fp8 ("fp8 rows do not fit a V41
/// model").
#[test]
fn defect43_row18_simulate_takes_the_family_default_dtype() {
    let plain = simulate(&["--no-progress", "--json", "--mix", "chat", "--model", "v4.1-flash"]);
    check_contract("simulate --model v4.1-flash", &plain, Out::Capture);
    assert_eq!(plain.code, Some(0), "simulate --model v4.1-flash: {plain:?}");
    let named = simulate(&[
        "--no-progress",
        "--json",
        "--mix",
        "chat",
        "--model",
        "v4.1-flash",
        "--dtype",
        "flashmla-v41",
    ]);
    assert_eq!(named.code, Some(0), "{named:?}");
    let blocks = |r: &Run| {
        let report: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        report["runs"][0]["final"]["num_blocks"].as_u64().expect("final.num_blocks")
    };
    assert_eq!(blocks(&plain), blocks(&named), "the default is not flashmla-v41");
    let help = v4pool(&os(&["simulate", "--help"]), Out::Capture, LIMIT);
    let line = help.stdout.lines().find(|l| l.contains("--dtype")).expect("--dtype in the help");
    assert!(!line.ends_with("[fp8]"), "help still names fp8 as the default: {line}");
}
