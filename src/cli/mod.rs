//! The `v4pool` command line: `layout`, `plan`, `simulate`.

pub mod layout;
pub mod plan;
pub mod simulate;

/// Run the command with `args` (without the program name); returns the exit status.
pub fn run(args: &[String]) -> i32 {
    let _ = args;
    eprintln!("v4pool: no subcommand yet");
    2
}
