//! The `cli` suite: the `v4pool` binary run as a process, given good and hostile input.
//!
//! One test binary of several files (`mod` each; tests/README.md). Helpers shared with other
//! suites are included from `tests/<helper>/` by path.

mod cli_support;

mod cli_fuzz;
mod cli_hostile;
mod cli_layout;
