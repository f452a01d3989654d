//! Exactness on the host backend: a request resumed from checkpoints (a multi-turn hit and a
//! preemption) ends with slot state and window rows byte-identical to an uninterrupted run;
//! checkpoint images carry the layout id.

mod manager_common;

use manager_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::manager::{ElasticPolicy, KvManager, ManagerError};

#[test]
fn resumed_request_is_byte_identical_to_an_uninterrupted_run() {
    exactness(Arc::new(HostBackend::new()));
}

#[test]
fn checkpoint_images_carry_the_layout_id() {
    let t = tokens(3, 1400, 0);
    let pool = small_pool(Arc::new(HostBackend::new()), 40);
    let mut m = KvManager::new(pool.clone(), config(2, true), Box::new(ElasticPolicy::default())).unwrap();
    let a = m.add_request(1400, hashes(&t));
    m.admit(a).unwrap();
    run_to(&mut m, a, &t, 1024, 512);
    let h = hashes(&t)[3];
    let pos = m.slot(a).unwrap().unwrap().position;
    let at_1024 = read(&pool, &image_ranges(&pool, pos));
    let image = m.export_checkpoint(&h).expect("export");
    assert_eq!(image.layout_id, "test-layout");
    assert_eq!(image.bytes.len() as u64, pool.checkpoint_image_bytes().unwrap());
    m.finish(a).unwrap();
    // Another layout: a typed error, nothing changes.
    let other = small_pool(Arc::new(HostBackend::new()), 40);
    let mut cfg = config(2, true);
    cfg.layout_id = "other-layout".into();
    let mut o = KvManager::new(other, cfg, Box::new(ElasticPolicy::default())).unwrap();
    assert!(matches!(o.import_checkpoint(&image), Err(ManagerError::LayoutMismatch { .. })));
    let mut bad = image.clone();
    bad.bytes.pop();
    assert!(matches!(m.import_checkpoint(&bad), Err(ManagerError::ImageSize { .. })));
    // Drop the record, import it back, and a new request restores the same bytes from it.
    m.unindex(h).unwrap();
    assert_eq!(m.checkpoint_state(&h), None);
    assert!(m.import_checkpoint(&image).expect("import"));
    m.check_invariants().unwrap();
    let b = m.add_request(1100, hashes(&t[..1100]));
    let adm = m.admit(b).unwrap();
    assert_eq!(adm.hit_tokens, 1024);
    m.complete_inflight().unwrap();
    same(&read(&pool, &image_ranges(&pool, adm.slot.position)), &at_1024, "imported image restored");
    m.finish(b).unwrap();
    m.check_invariants().unwrap();
}
