//! The manager's host tier on the host backend.

mod tier_common;

use std::sync::Arc;
use tier_common::*;
use v4pool::backend::host::HostBackend;

fn host() -> Arc<HostBackend> {
    Arc::new(HostBackend::new())
}

#[test]
fn spill_then_hit_restores_byte_exact() {
    let m = tiered(host(), 24, 64);
    println!("blocks {:?} upc {}", m.pool().counts().unwrap(), m.units_per_checkpoint());
    spill_hit_restore(host());
}
