//! The `manager` suite: the KV manager and what sits on it. Eviction, exact scenarios,
//! properties, regressions, misuse, the host tier, injected faults, interleaved requests, KV
//! events, and the simulator (`simulate*`; the fleet and timing ones run the `v4pool` binary).
//!
//! One test binary of several files (`mod` each; tests/README.md). Helpers shared with other
//! suites are included from `tests/<helper>/` by path.

#[path = "../common/mod.rs"]
mod common;
mod fault_common;
#[path = "../manager_common/mod.rs"]
mod manager_common;
#[path = "../pool_common/mod.rs"]
mod pool_common;
#[path = "../tier_common/mod.rs"]
mod tier_common;

mod fault_manager;
mod fault_sweep;
mod interleave;
mod kv_events;
mod manager_eviction;
mod manager_exact;
mod manager_hostile;
mod manager_props;
mod manager_regressions;
mod manager_tier;
mod simulate;
mod simulate_fleet;
mod simulate_pressure;
mod simulate_time;
