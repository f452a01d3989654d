//! The `v4pool` command: a thin shell over [`v4pool::cli`].
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(v4pool::cli::run(&args));
}
