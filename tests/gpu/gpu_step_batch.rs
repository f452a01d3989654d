//! A whole decode step's pool-side work on the device (docs/forward.md, "Fewer launches"): the
//! per-layer order, each layer's writes in one `v4pool_write_batch`, and every state update in
//! one batch at the end, each on a device pool against the host backend's per-layer order on a
//! twin pool with the same poisoned bytes; every plane, the indexer cache and the decode
//! path's buffers compared byte for byte. The fused order is also captured once as a CUDA
//! graph and replayed over a poisoned pool. V4-Flash (fp8 and bf16 rows), V4-Pro, V4.1-Flash;
//! one and two tokens per sequence. Skips with SKIP without a device (fails with
//! V4POOL_REQUIRE_GPU=1).

use crate::common;
use crate::step_common;

use std::sync::Arc;
use step_common::{path_outputs, poison_pool, pool_bytes, step_pool, Holdings, Order, StepData, StepRig};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::sizing::KvDtype;

const SEQS: usize = 3;

fn contexts(seed: u64) -> Vec<i64> {
    let mut rng = v4pool::sim::Rng::new(seed);
    // 256 and 1,024 close CSA and HCA entries at the step; the third is anywhere the pool's
    // blocks reach.
    vec![256, 1024, rng.range(3, 2_000)]
}

/// Pool bytes and path buffers after one step in `order` on `backend` (a fresh pool poisoned
/// from `seed`), run eagerly or as a graph captured once and replayed twice (CUDA only).
fn step(
    backend: Arc<dyn Backend>,
    cuda: Option<&v4pool::backend::cuda::CudaBackend>,
    model: &ModelShape,
    kv: KvDtype,
    tps: usize,
    order: Order,
    seed: u64,
) -> (Vec<Vec<u8>>, Vec<Vec<i32>>) {
    let pool = step_pool(backend, model, kv, SEQS as i64 + 1, 2 * SEQS as i64 + 2);
    poison_pool(&pool, seed);
    let held = Holdings::take(&pool, SEQS);
    let data =
        StepData::new(&pool, model.num_hidden_layers, tps, contexts(seed), model.index_topk as usize, seed);
    let mut rig = StepRig::new(&pool, &held, &data);
    let launches = rig.launches(order);
    match cuda {
        Some(cuda) => {
            let capture = cuda.begin_capture(Stream::DEFAULT).expect("begin capture");
            // SAFETY: the rig's own launches, made for its staged batch.
            unsafe { rig.queue(&launches, Stream::DEFAULT) };
            let graph = capture.end().expect("end capture");
            // Twice: a replay writes what one step writes (the inputs are the same).
            graph.replay(Stream::DEFAULT).expect("replay");
            graph.replay(Stream::DEFAULT).expect("replay");
            cuda.synchronize(Stream::DEFAULT).expect("sync");
        }
        // SAFETY: as above.
        None => unsafe { rig.queue(&launches, Stream::DEFAULT) },
    }
    (pool_bytes(&pool), path_outputs(&rig.path))
}

#[test]
fn the_step_on_the_device_matches_the_host_in_every_order() {
    let Some(cuda) = common::cuda_or_skip("the_step_on_the_device_matches_the_host_in_every_order") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::new(cuda.clone());
    let cases = [
        (ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, 2usize),
        (ModelShape::v4_flash(1).unwrap(), KvDtype::Bf16, 1),
        (ModelShape::v4_pro(1).unwrap(), KvDtype::Fp8, 2),
        (ModelShape::v41_flash(1).unwrap(), KvDtype::Bf16, 2),
        (ModelShape::v4_flash(1).unwrap(), KvDtype::FlashMlaV4, 2),
        (ModelShape::v4_flash(1).unwrap(), KvDtype::FlashMlaV4P2, 2),
        (ModelShape::v41_flash(1).unwrap(), KvDtype::FlashMlaV41, 1),
    ];
    for (i, (model, kv, tps)) in cases.iter().enumerate() {
        let seed = common::case_seed("gpu-step-batch", i as u64);
        let host: Arc<dyn Backend> = Arc::new(HostBackend::new());
        let (want, want_path) = step(host, None, model, *kv, *tps, Order::PerLayer, seed);
        for order in Order::ALL {
            for graph in [false, true] {
                let (got, got_path) =
                    step(dev.clone(), graph.then_some(&cuda), model, *kv, *tps, order, seed);
                let what = format!("{} {kv:?} tps {tps} {} graph {graph}", model.name, order.name());
                assert!(got_path == want_path, "{what}: decode path buffers differ from the host's");
                assert_eq!(got.len(), want.len());
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    if let Some(at) = g.iter().zip(w).position(|(a, b)| a != b) {
                        panic!("{what}: region {r} differs from the host's at byte {at}");
                    }
                }
            }
        }
    }
}
