//! The `v4pool` command line: `layout`, `plan`, `simulate`.
//!
//! Every subcommand takes `--key value` options and bare `--flag`s through [`parse_args`];
//! an unknown or malformed argument is a [`CliError`] and exit status 2.

pub mod layout;
pub mod plan;
pub mod simulate;

use crate::geometry::GeometryError;
use crate::model::ModelError;
use std::collections::{BTreeMap, BTreeSet};
use thiserror::Error;

/// Exit status of a run that did what it was asked.
pub const EXIT_OK: i32 = 0;
/// Exit status of invalid input: a usage error, a rejected model or geometry.
pub const EXIT_USAGE: i32 = 2;

const USAGE: &str = "\
usage: v4pool <command> [options]

commands:
  layout     print the row-space geometry of a model or ratio list
  plan       size a pool from a byte budget
  simulate   drive a pool through a request trace
  help       print this message

`v4pool <command> --help` describes a command's options.";

/// Everything the command line rejects.
#[derive(Debug, Error)]
pub enum CliError {
    #[error("unknown command {name:?} (layout, plan, simulate, help)")]
    UnknownCommand { name: String },
    #[error("unknown option {flag}")]
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
    #[error("cannot read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{what} of {got} exceeds the {max} this command lists")]
    TooLarge { what: &'static str, got: i64, max: i64 },
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    Geometry(#[from] GeometryError),
    #[error("{0}")]
    Sizing(#[from] crate::sizing::SizingError),
    #[error("{0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error("{0}")]
    Backend(#[from] crate::backend::BackendError),
    #[error("{0}")]
    Pool(#[from] crate::pool::PoolError),
    #[error("{0}")]
    Simulation(#[from] simulate::SimError),
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
            Model(e) => e.variant_name(),
            Geometry(e) => e.variant_name(),
            Sizing(e) => e.variant_name(),
            Checkpoint(e) => e.variant_name(),
            Backend(_) => "Backend",
            Pool(_) => "Pool",
            Simulation(_) => "Simulation",
        }
    }

    /// `{"error": VARIANT_NAME, "message": TEXT}`, the `--json` form of a failure.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "error": self.variant_name(), "message": self.to_string() })
    }
}

/// Report `err` the way the command was asked to (one line on stderr prefixed with `who`,
/// or a JSON object on stdout with `--json`) and return the exit status.
pub(crate) fn fail(who: &str, err: &CliError, json: bool) -> i32 {
    if json {
        println!("{}", err.to_json());
    } else {
        eprintln!("{who}: {err}");
    }
    EXIT_USAGE
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
        let Some(text) = self.get(key) else { return Ok(None) };
        text.split(',')
            .map(|item| {
                item.trim().parse::<i32>().map_err(|_| CliError::BadValue {
                    flag: key.to_string(),
                    value: text.to_string(),
                    expected: "a comma-separated list of 32-bit integers",
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

/// Run the command with `args` (without the program name); returns the exit status.
pub fn run(args: &[String]) -> i32 {
    let Some((command, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return EXIT_USAGE;
    };
    match command.as_str() {
        "layout" => layout::run(rest),
        "plan" => plan::run(rest),
        "simulate" => simulate::run(rest),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            EXIT_OK
        }
        other => {
            let err = CliError::UnknownCommand { name: other.to_string() };
            let json = rest.iter().any(|a| a == "--json");
            fail("v4pool", &err, json)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
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

    #[test]
    fn dispatches() {
        assert_eq!(run(&[]), EXIT_USAGE);
        assert_eq!(run(&strings(&["help"])), EXIT_OK);
        assert_eq!(run(&strings(&["--help"])), EXIT_OK);
        assert_eq!(run(&strings(&["frobnicate"])), EXIT_USAGE);
    }
}
