//! Opening a shared library at run time from a list of candidate names: the one loop behind
//! every library v4pool loads on demand (libzmq, NCCL, NIXL), so a missing library is one
//! error value naming every name tried and why each was refused.

use libloading::Library;

/// The first of `names` the dynamic loader opens, with the name it was opened by; else an
/// error `"{what} not found (name: refusal; …)"`. A library that opens is returned even if
/// it later lacks a symbol: the caller's refusal then names it (no fallback to the next).
///
/// # Safety
/// Opening any of `names` runs its initialisers: each must be sound to run (the vendor's
/// library under its published name, or one the user named explicitly).
pub(crate) unsafe fn open_first(what: &str, names: &[String]) -> Result<(Library, String), String> {
    let mut tried = Vec::new();
    for name in names {
        // SAFETY: the caller's contract.
        match unsafe { Library::new(name) } {
            Ok(lib) => return Ok((lib, name.clone())),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!("{what} not found ({})", tried.join("; ")))
}
