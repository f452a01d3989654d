//! The `v4pool` command line: `layout`, `plan`, `simulate`, `calibrate`. Not part of the library: it
//! parses arguments and renders what the library computes.
//!
//! Every subcommand takes `--key value` options and bare `--flag`s through [`parse_args`];
//! an unknown or malformed argument is a [`CliError`] and exit status 2, with one line on
//! stderr (or one JSON object on stdout with `--json`). Output goes through a fallible
//! writer ([`Streams`]): a closed stdout ends the command quietly (as `head` users expect),
//! any other write error is one line on stderr and exit status 2; nothing panics.

mod calibrate;
mod layout;
mod plan;
mod render;
mod simulate;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use thiserror::Error;
use v4pool::geometry::GeometryError;
use v4pool::model::ModelError;
use v4pool::sizing::KvDtype;
use v4pool::VariantName;

fn main() {
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    let (mut out, mut err) = (stdout.lock(), stderr.lock());
    let mut io = Streams { out: &mut out, err: &mut err };
    let code = match utf8_args(std::env::args_os().skip(1)) {
        Ok(args) => run(&args, &mut io),
        Err((e, json)) => fail("v4pool", &e, json, &mut io),
    };
    std::process::exit(code);
}

/// The arguments as UTF-8, or the error for the first that is not (and whether `--json`
/// was asked for, so the error comes out in that form).
fn utf8_args(args: impl Iterator<Item = std::ffi::OsString>) -> Result<Vec<String>, (CliError, bool)> {
    let args: Vec<std::ffi::OsString> = args.collect();
    let json = args.iter().any(|a| a == "--json");
    args.into_iter()
        .enumerate()
        .map(|(i, a)| {
            a.into_string().map_err(|a| {
                let arg = a.to_string_lossy().into_owned();
                (CliError::NotUtf8 { index: i + 1, arg }, json)
            })
        })
        .collect()
}

/// The two streams a command writes to; every write is fallible.
pub(crate) struct Streams<'a> {
    pub(crate) out: &'a mut dyn Write,
    pub(crate) err: &'a mut dyn Write,
}

impl Streams<'_> {
    /// `text` and a newline on stdout, flushed: a failed write is [`CliError::Output`].
    pub(crate) fn print(&mut self, text: &str) -> Result<(), CliError> {
        writeln!(self.out, "{text}").and_then(|()| self.out.flush()).map_err(CliError::Output)
    }
    /// Best effort on stderr: a closed or full stderr has nowhere to be reported.
    pub(crate) fn note(&mut self, text: std::fmt::Arguments<'_>) {
        let _ = self.err.write_fmt(text).and_then(|()| self.err.flush());
    }
}

/// Exit status of a run that did what it was asked.
pub const EXIT_OK: i32 = 0;
/// Exit status of a run that failed after its input was accepted (the backend or the pool
/// failed mid-run).
pub const EXIT_RUNTIME: i32 = 1;
/// Exit status of invalid input (a usage error, a rejected model or geometry) and of
/// output that could not be written.
pub const EXIT_USAGE: i32 = 2;

const USAGE: &str = "\
usage: v4pool <command> [options]

commands:
  layout     print the row-space geometry of a model or ratio list
  plan       size a pool from a byte budget
  simulate   drive a pool through a request trace, in time
  calibrate  fit simulate's step-cost model to published serving figures
  help       print this message

`v4pool <command> --help` describes a command's options.";

/// Everything the command line rejects.
#[derive(Debug, Error)]
pub enum CliError {
    #[error("unknown command {name:?} (layout, plan, simulate, calibrate, help)")]
    UnknownCommand { name: String },
    #[error("unknown option {flag:?}")]
    UnknownFlag { flag: String },
    #[error("option {flag} needs a value")]
    MissingValue { flag: String },
    #[error("option {flag} given twice")]
    Duplicate { flag: String },
    #[error("unexpected argument {arg:?}")]
    Unexpected { arg: String },
    #[error("option {flag} takes no value")]
    FlagWithValue { flag: String },
    #[error("option {flag}: {value:?} is not {expected}")]
    BadValue { flag: String, value: String, expected: &'static str },
    #[error("option {flag} is required")]
    MissingOption { flag: &'static str },
    #[error("options {a} and {b} exclude each other")]
    Conflict { a: &'static str, b: &'static str },
    #[error("cannot read {path:?}: {reason}")]
    Io { path: String, reason: String },
    #[error("{what} of {got} exceeds the {max} this command lists")]
    TooLarge { what: &'static str, got: i64, max: i64 },
    #[error("{0}")]
    File(#[from] v4pool::model::FileError),
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    Geometry(#[from] GeometryError),
    #[error("{0}")]
    Sizing(#[from] v4pool::sizing::SizingError),
    #[error("{0}")]
    Checkpoint(#[from] v4pool::checkpoint::CheckpointError),
    #[error("{0}")]
    Backend(#[from] v4pool::backend::BackendError),
    #[error("{0}")]
    Pool(#[from] v4pool::pool::PoolError),
    #[error("{0}")]
    Simulation(#[from] v4pool::sim::SimError),
    #[error("argument {index} is not valid UTF-8: {arg:?}")]
    NotUtf8 { index: usize, arg: String },
    #[error("no command given; usage: v4pool <command> [options] (layout, plan, simulate, calibrate, help)")]
    NoCommand,
    #[error("cannot write output: {0}")]
    Output(std::io::Error),
}

impl CliError {
    /// The variant's name as `--json` reports it; a model or geometry error reports its own.
    pub fn variant_name(&self) -> &'static str {
        use CliError::*;
        match self {
            UnknownCommand { .. } => "UnknownCommand",
            UnknownFlag { .. } => "UnknownFlag",
            MissingValue { .. } => "MissingValue",
            Duplicate { .. } => "Duplicate",
            Unexpected { .. } => "Unexpected",
            FlagWithValue { .. } => "FlagWithValue",
            BadValue { .. } => "BadValue",
            MissingOption { .. } => "MissingOption",
            Conflict { .. } => "Conflict",
            Io { .. } => "Io",
            TooLarge { .. } => "TooLarge",
            File(e) => e.variant_name(),
            Model(e) => e.variant_name(),
            Geometry(e) => e.variant_name(),
            Sizing(e) => e.variant_name(),
            Checkpoint(e) => e.variant_name(),
            Backend(_) => "Backend",
            Pool(_) => "Pool",
            Simulation(v4pool::sim::SimError::Config(_)) => "SimConfig",
            Simulation(_) => "Simulation",
            NotUtf8 { .. } => "NotUtf8",
            NoCommand => "NoCommand",
            Output(_) => "Output",
        }
    }

    /// The exit status this failure ends the command with: input errors (and output that
    /// could not be written) are usage errors; a pool or backend failing mid-run is not.
    pub fn exit_status(&self) -> i32 {
        match self {
            CliError::Simulation(v4pool::sim::SimError::Config(_)) => EXIT_USAGE,
            CliError::Backend(_) | CliError::Pool(_) | CliError::Simulation(_) => EXIT_RUNTIME,
            _ => EXIT_USAGE,
        }
    }

    /// The message on one line: anything an argument or a file smuggled in cannot break it.
    fn one_line(&self) -> String {
        self.to_string().replace('\n', "\\n").replace('\r', "\\r")
    }

    /// `{"error": VARIANT_NAME, "message": TEXT}`, the `--json` form of a failure.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "error": self.variant_name(), "message": self.one_line() })
    }
}

/// Report `err` the way the command was asked to (one line on stderr prefixed with `who`,
/// or a JSON object on stdout with `--json`) and return its exit status. A closed stdout
/// ends the command quietly with status 0 (the reader has all it wanted); other output
/// errors are reported on stderr, never on the stream that failed.
pub(crate) fn fail(who: &str, err: &CliError, json: bool, io: &mut Streams<'_>) -> i32 {
    if let CliError::Output(e) = err {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return EXIT_OK;
        }
        io.note(format_args!("{who}: {}\n", err.one_line()));
        return EXIT_USAGE;
    }
    if !json || io.print(&err.to_json().to_string()).is_err() {
        io.note(format_args!("{who}: {}\n", err.one_line()));
    }
    err.exit_status()
}

/// The exit status of a subcommand's `result`, reporting a failure through [`fail`].
pub(crate) fn conclude(who: &str, result: Result<(), CliError>, json: bool, io: &mut Streams<'_>) -> i32 {
    match result {
        Ok(()) => EXIT_OK,
        Err(e) => fail(who, &e, json, io),
    }
}

/// Parsed `--key value` options and `--flag`s of one subcommand.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ParsedArgs {
    values: BTreeMap<String, String>,
    flags: BTreeSet<String>,
}

/// Parse `args` against the options that take a value and the flags that do not (both
/// spelled with their leading `--`). `--key=value` is accepted too. Unknown options,
/// positional arguments, repeats and missing values are errors.
pub(crate) fn parse_args(args: &[String], options: &[&str], flags: &[&str]) -> Result<ParsedArgs, CliError> {
    let mut parsed = ParsedArgs::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if !arg.starts_with("--") || arg == "--" {
            return Err(CliError::Unexpected { arg: arg.clone() });
        }
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (arg.as_str(), None),
        };
        if flags.contains(&key) {
            if inline.is_some() {
                return Err(CliError::FlagWithValue { flag: key.to_string() });
            }
            if !parsed.flags.insert(key.to_string()) {
                return Err(CliError::Duplicate { flag: key.to_string() });
            }
        } else if options.contains(&key) {
            // A following option is not a value: `--ratios --json` lacks its list.
            let value = match inline {
                Some(v) => v.to_string(),
                None => it
                    .next()
                    .filter(|v| !v.starts_with("--"))
                    .cloned()
                    .ok_or_else(|| CliError::MissingValue { flag: key.to_string() })?,
            };
            if parsed.values.insert(key.to_string(), value).is_some() {
                return Err(CliError::Duplicate { flag: key.to_string() });
            }
        } else {
            return Err(CliError::UnknownFlag { flag: key.to_string() });
        }
    }
    Ok(parsed)
}

impl ParsedArgs {
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    pub(crate) fn flag(&self, name: &str) -> bool {
        self.flags.contains(name)
    }

    /// An optional integer option (any i64; range checks are the caller's).
    pub(crate) fn i64(&self, key: &str) -> Result<Option<i64>, CliError> {
        self.get(key).map(|v| parse_i64(key, v)).transpose()
    }

    pub(crate) fn required_i64(&self, key: &'static str) -> Result<i64, CliError> {
        self.i64(key)?.ok_or(CliError::MissingOption { flag: key })
    }

    /// A comma-separated list of i32 (`--ratios 0,0,4,128`); empty items are errors.
    pub(crate) fn i32_list(&self, key: &str) -> Result<Option<Vec<i32>>, CliError> {
        self.list(key, "a comma-separated list of 32-bit integers")
    }

    /// A comma-separated list of layer ids (`--kv-sources 2,8,14,20`); empty items are errors.
    pub(crate) fn usize_list(&self, key: &str) -> Result<Option<Vec<usize>>, CliError> {
        self.list(key, "a comma-separated list of layer ids")
    }

    fn list<T: std::str::FromStr>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Option<Vec<T>>, CliError> {
        let Some(text) = self.get(key) else { return Ok(None) };
        text.split(',')
            .map(|item| {
                item.trim().parse::<T>().map_err(|_| CliError::BadValue {
                    flag: key.to_string(),
                    value: text.to_string(),
                    expected,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

fn parse_i64(key: &str, value: &str) -> Result<i64, CliError> {
    value.trim().parse::<i64>().map_err(|_| CliError::BadValue {
        flag: key.to_string(),
        value: value.to_string(),
        expected: "a 64-bit integer",
    })
}

/// The `--dtype` values every subcommand's refusal lists: [`KvDtype::ALL`]'s names, as the
/// bindings list them (a unit test holds them equal; each `--help` spells them
/// `fp8|bf16|…` in the same order).
pub(crate) const KV_DTYPES: &str = v4pool::plan_report::KV_DTYPE_NAMES;

/// `--dtype`, if given: any row format, by [`KvDtype::from_name`] (the bindings' parser too),
/// so `plan`, `layout` and `simulate` take the same names and refuse with the same list.
pub(crate) fn kv_dtype(p: &ParsedArgs) -> Result<Option<KvDtype>, CliError> {
    p.get("--dtype")
        .map(|d| {
            KvDtype::from_name(d).ok_or_else(|| CliError::BadValue {
                flag: "--dtype".to_string(),
                value: d.to_string(),
                expected: KV_DTYPES,
            })
        })
        .transpose()
}

/// Run the command with `args` (without the program name); returns the exit status.
pub(crate) fn run(args: &[String], io: &mut Streams<'_>) -> i32 {
    let json = args.iter().any(|a| a == "--json");
    let Some((command, rest)) = args.split_first() else {
        return fail("v4pool", &CliError::NoCommand, json, io);
    };
    match command.as_str() {
        "layout" => layout::run(rest, io),
        "plan" => plan::run(rest, io),
        "simulate" => simulate::run(rest, io),
        "calibrate" => calibrate::run(rest, io),
        "help" | "--help" | "-h" => conclude("v4pool", io.print(USAGE), false, io),
        other => fail("v4pool", &CliError::UnknownCommand { name: other.to_string() }, json, io),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_dtype_list_is_every_format() {
        let names: Vec<&str> = KvDtype::ALL.iter().map(|k| k.name()).collect();
        let (head, last) = names.split_at(names.len() - 1);
        assert_eq!(KV_DTYPES, format!("{} or {}", head.join(", "), last[0]));
    }

    #[test]
    fn parses_options_and_flags() {
        let p = parse_args(
            &strings(&["--blocks", "3", "--json", "--ring=7"]),
            &["--blocks", "--ring"],
            &["--json"],
        )
        .unwrap();
        assert_eq!(p.i64("--blocks").unwrap(), Some(3));
        assert_eq!(p.required_i64("--ring").unwrap(), 7);
        assert!(p.flag("--json"));
        assert_eq!(p.i64("--slots").unwrap(), None);
        assert!(matches!(p.required_i64("--slots"), Err(CliError::MissingOption { flag: "--slots" })));
    }

    #[test]
    fn rejects_malformed_arguments() {
        let opts = ["--blocks", "--ratios"];
        let flags = ["--json"];
        let bad = |v: &[&str]| parse_args(&strings(v), &opts, &flags).unwrap_err().variant_name();
        assert_eq!(bad(&["--nope"]), "UnknownFlag");
        assert_eq!(bad(&["--blocks"]), "MissingValue");
        assert_eq!(bad(&["--ratios", "--json"]), "MissingValue");
        assert_eq!(bad(&["--blocks", "1", "--blocks", "2"]), "Duplicate");
        assert_eq!(bad(&["--json", "--json"]), "Duplicate");
        assert_eq!(bad(&["--json=1"]), "FlagWithValue");
        assert_eq!(bad(&["3"]), "Unexpected");
        assert_eq!(bad(&["--"]), "Unexpected");
        let p = parse_args(&strings(&["--blocks", "x", "--ratios", "0,,4"]), &opts, &flags).unwrap();
        assert_eq!(p.i64("--blocks").unwrap_err().variant_name(), "BadValue");
        assert_eq!(p.i32_list("--ratios").unwrap_err().variant_name(), "BadValue");
        let p =
            parse_args(&strings(&["--blocks", "99999999999999999999", "--ratios", "0,-1, 4"]), &opts, &flags)
                .unwrap();
        assert!(p.i64("--blocks").is_err());
        assert_eq!(p.i32_list("--ratios").unwrap(), Some(vec![0, -1, 4]));
    }

    /// Run in-process with `stdout` as the output stream; returns (status, stderr).
    fn run_into(args: &[&str], stdout: &mut dyn Write) -> (i32, String) {
        let mut err = Vec::new();
        let code = run(&strings(args), &mut Streams { out: stdout, err: &mut err });
        (code, String::from_utf8(err).unwrap())
    }

    #[test]
    fn dispatches() {
        let mut out = Vec::new();
        assert_eq!(run_into(&[], &mut out).0, EXIT_USAGE);
        assert_eq!(run_into(&["help"], &mut out).0, EXIT_OK);
        assert_eq!(run_into(&["--help"], &mut out).0, EXIT_OK);
        assert_eq!(run_into(&["frobnicate"], &mut out).0, EXIT_USAGE);
    }

    /// A writer that fails every write with `kind`.
    struct Failing(std::io::ErrorKind);
    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(self.0.into())
        }
    }

    #[test]
    fn output_errors_are_reported_not_panicked() {
        let (code, err) = run_into(&["help"], &mut Failing(std::io::ErrorKind::BrokenPipe));
        assert_eq!((code, err.as_str()), (EXIT_OK, ""), "a closed pipe ends quietly");
        let (code, err) = run_into(&["help"], &mut Failing(std::io::ErrorKind::StorageFull));
        assert_eq!(code, EXIT_USAGE);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("v4pool: cannot write output"), "{err}");
    }

    #[test]
    fn messages_stay_on_one_line() {
        let mut out = Vec::new();
        let (code, err) = run_into(&["layout", "--x\ny"], &mut out);
        assert_eq!(code, EXIT_USAGE);
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}
