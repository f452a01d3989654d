//! The `tiers` suite: a request's KV outside its pool. Handoffs between pools (host, NIXL),
//! the host tier, the shared file tier (one and several processes, std and NIXL-POSIX I/O),
//! the entry directory under hostile files.
//!
//! One test binary of several files (`mod` each; tests/README.md). Helpers shared with other
//! suites are included from `tests/<helper>/` by path.

#[path = "../common/mod.rs"]
mod common;
mod hostile_fs;
#[path = "../manager_common/mod.rs"]
mod manager_common;
#[path = "../nixl_common/mod.rs"]
mod nixl_common;
#[path = "../pool_common/mod.rs"]
mod pool_common;
#[path = "../tier_common/mod.rs"]
mod tier_common;
#[path = "../transfer_common/mod.rs"]
mod transfer_common;
#[macro_use] // per_io!, used by the tier files below
mod tier_io;

mod entry_dir;
mod entry_tier_backends;
mod shared_tier;
mod shared_tier_fleet;
mod transfer_handoff;
mod transfer_host_tier;
mod transfer_nixl;
