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

/// Retention under pressure, as a property: random conversations (turns that re-send their
/// history, branches off a shared opening, long prompts) on a pool far smaller than their
/// working set, with and without a host tier. At every step the manager's invariants hold
/// (every held block is a live request's, a cached block or a checkpoint unit; the LRU holds
/// exactly what may be evicted); checkpoints never hold more bytes than the pool; a hit never
/// passes what an earlier request committed; at the end the pool is empty. Whether a restored
/// image is exact is `manager_props`'s (the same supersession paths, byte-checked).
mod retention {
    use super::*;
    use proptest::prelude::*;
    use v4pool::sim::Engine;

    fn spec() -> impl Strategy<Value = Vec<(u64, u64, u64, u64)>> {
        // (conversation, prompt blocks, output tokens, arrival gap in steps)
        proptest::collection::vec((0u64..6, 1u64..220, 1u64..300, 0u64..12), 4..28)
    }

    fn run(reqs: &[(u64, u64, u64, u64)], tier: bool) {
        let pool = pool(512 << 20, 4);
        let cfg = SimConfig {
            mix: Mix::Chat,
            steps: 1500,
            max_seqs: 4,
            elastic_max_seqs: 8,
            max_context: 1 << 17,
            build_index: false,
            prefill_chunk: 4096,
            host_tier_bytes: if tier { 96 << 20 } else { 0 },
            ..SimConfig::default()
        };
        let (mut at, mut len) = (0, std::collections::HashMap::new());
        let specs: Vec<RequestSpec> = reqs
            .iter()
            .enumerate()
            .map(|(i, &(conv, blocks, out, gap))| {
                at += gap;
                // A conversation's next turn re-sends what it had (a branch when shorter).
                let b = len.get(&conv).map_or(blocks, |&l: &u64| (l * 3 / 4 + blocks / 4).max(1));
                len.insert(conv, b + out.div_ceil(BS));
                turn(i as u64, at, b, out, conv)
            })
            .collect();
        let run = if tier { RunKind::ElasticTier } else { RunKind::Elastic };
        let mut e = Engine::new(&pool, &cfg, run).unwrap();
        let budget = pool.overhead(0).unwrap().plane_bytes;
        let mut arrivals = specs.into_iter();
        while !e.done() {
            e.step(&mut arrivals).unwrap();
            let m = e.manager();
            m.check_invariants().unwrap_or_else(|x| panic!("invariant: {x}"));
            assert!(m.checkpoint_bytes_held() <= budget, "checkpoints over the pool");
            let s = m.stats();
            assert!(s.tier_resident_bytes <= cfg.host_tier_bytes, "host tier over budget: {s:?}");
        }
        let r = e.finish().unwrap();
        assert!(r.prefix_hit_tokens <= r.eligible_prefix_tokens);
        assert!(r.max_checkpoint_bytes <= budget);
        let c = pool.counts().unwrap();
        assert_eq!((c.free_blocks, c.free_slots), (c.num_blocks, c.num_slots), "leaked");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
        #[test]
        fn pressure_loses_nothing_and_keeps_budgets(reqs in spec(), tier in any::<bool>()) {
            run(&reqs, tier);
        }
    }
}
