//! The simulator under memory pressure (issue 35): admission that counts the hit's own
//! blocks as room to spare livelocked a fleet engine (one request preempted and re-admitted
//! 110,726 times); retention that weighs a checkpoint's bytes against the prefill it saves.

use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, PoolSpec};
use v4pool::sim::{simulate, Mix, RequestSpec, RunKind, SimConfig};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest};

fn pool(budget: u64, seqs: i64) -> Arc<Pool> {
    let model = ModelShape::v4_flash(0).unwrap();
    let p = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, seqs, budget)).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    Arc::new(Pool::new(backend, PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap())
}

const BS: u64 = 256;

/// A turn of conversation `conv`.
fn turn(id: u64, arrival: u64, blocks: u64, output: u64, conv: u64) -> RequestSpec {
    RequestSpec { conv, ..RequestSpec::new(id, arrival, blocks * BS, output) }
}

/// A request decoding past a block boundary while the one waiting at the head of the queue has
/// a hit that is most of the evictable cache: admission counted that hit as room, so the
/// waiting request was admitted with nothing left for its prefill, both stalled, the newest
/// was preempted and re-admitted the next step, forever (the 1 TiB fleet run's engine 10:
/// 110,726 preemptions). Admission now prices the hit it references.
#[test]
fn a_request_whose_hit_is_the_evictable_cache_is_not_readmitted_into_a_stall() {
    let cfg = SimConfig {
        mix: Mix::Chat,
        steps: 3000,
        max_seqs: 4,
        elastic_max_seqs: 4,
        max_context: 1 << 18,
        build_index: false,
        ..SimConfig::default()
    };
    let pool = pool(640 << 20, 4);
    let blocks = u64::from(pool.counts().unwrap().max_blocks);
    // D fills the pool but for the cache of conversation 1's first turn, then decodes 600
    // tokens; the second turn (12 blocks past the first's 96) arrives while D decodes.
    let reqs = vec![turn(0, 0, blocks - 66, 600, 2), turn(1, 30, 96, 2, 1), turn(2, 40, 108, 2, 1)];
    let r = simulate(&pool, &cfg, RunKind::Elastic, reqs).unwrap();
    let c = pool.counts().unwrap();
    assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "leaked");
    // Before the fix: 2,968 preemptions in 3,000 steps and nothing completed.
    assert_eq!(r.completed, 3, "{} preemptions", r.preemptions);
    // A preemption or two where decode growth passes the decode room is ordinary; churn is
    // one every step.
    assert!(r.preemptions <= 2, "{} preemptions: admission churns", r.preemptions);
    // The second turn still hits the first (it waited for room instead).
    assert!(r.prefix_hit_tokens >= 64 * BS, "hit {} tokens", r.prefix_hit_tokens);
}
