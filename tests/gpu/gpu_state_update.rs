//! The §8 compressor-state update on the device: `v4pool_update_compressor_states` through the
//! pool's `StateUpdate` handle writes, launch for launch, what the host reference writes into
//! the same poisoned planes (whole planes compared, so untouched bytes are verified), at
//! V4-Flash and V4-Pro shapes, fp8 two planes and bf16 one plane, MTP rings 129–133, batches
//! 1–1,024; and the launches captured once in a CUDA graph, replayed over restaged batches with
//! new inputs, across boundary moves (slots shrunk with relocation, grown).
//!
//! Skips (printing SKIP) without a device; `V4POOL_REQUIRE_GPU=1` makes that a failure.

use crate::common;
use crate::state_common;

use state_common::*;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{Pool, SlotLease};
use v4pool::raw::index::ElemType;
use v4pool::sizing::KvDtype;
use v4pool::state::update::{Compressor, StateUpdateCapacity};

/// One forward on a fresh pool of `model` / `kv` with `bs` sequences, on `backend`: returns
/// the planes after every compressor's update (each launch compared with the expectation
/// inside `run_forward`).
fn forward_on(
    backend: Arc<dyn Backend>,
    model: &ModelShape,
    kv: KvDtype,
    bs: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let pool = v4_pool(backend, model, kv, bs as i64);
    let leases: Vec<_> = (0..bs).map(|_| pool.alloc_slot().unwrap()).collect();
    poison(&pool, &mut Rng::new(seed));
    let cap = StateUpdateCapacity::new(bs, bs * 300);
    let decode = forward(&mut Rng::new(seed ^ 1), &leases, model.spec_steps + 1, 1_000_000);
    let what = format!("{} {kv:?} bs={bs} decode on {:?}", model.name, pool.backend().kind());
    run_forward(&pool, &mut Rng::new(seed ^ 2), &decode, cap, &what);
    let prefill = forward(&mut Rng::new(seed ^ 3), &leases, 300, 5000);
    let what = format!("{} {kv:?} bs={bs} prefill on {:?}", model.name, pool.backend().kind());
    run_forward(&pool, &mut Rng::new(seed ^ 4), &prefill, cap, &what);
    planes(&pool)
}

#[test]
fn device_update_equals_the_host_reference() {
    let Some(dev) = common::device_or_skip("device_update_equals_the_host_reference") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    // (model, layout, batch): rings 129..133 over the spec steps.
    let cases = [
        (ModelShape::v4_flash(1).unwrap(), KvDtype::Fp8, 1),
        // Under the HIP runtime double (kernels emulated on the CPU, planes first-touched in
        // host memory) the device-only batch is 6, not 24.
        (ModelShape::v4_flash(2).unwrap(), KvDtype::Fp8, common::sized(24, 6)),
        (ModelShape::v4_flash(5).unwrap(), KvDtype::Bf16, 8),
        (ModelShape::v4_pro(3).unwrap(), KvDtype::Fp8, 8),
        (ModelShape::v4_pro(4).unwrap(), KvDtype::Bf16, 4),
    ];
    for (i, (model, kv, bs)) in cases.into_iter().enumerate() {
        let seed = common::case_seed("gpu-state-update", i as u64);
        // Every launch is compared with the expectation inside; the host backend's own run of
        // the same forward (the reference kernel) is compared too where it is cheap.
        let on_dev = forward_on(dev.clone(), &model, kv, bs, seed);
        if bs <= 8 {
            let on_host = forward_on(Arc::new(HostBackend::new()), &model, kv, bs, seed);
            if let Some(d) = diff(&on_host, &on_dev) {
                panic!("{} {kv:?} bs={bs} (seed {seed:#x}): device and host planes differ:\n{d}", model.name);
            }
            println!("ok {} {kv:?} bs={bs}: device planes equal the host's", model.name);
        }
    }
    // Batches to 1,024 on a small arena with the same field names (both plane layouts); 256
    // under the HIP runtime double.
    let big = common::sized(1024, 256);
    for (i, (widths, k)) in [(&[512u64, 128][..], 1u64), (&[1024][..], 5)].into_iter().enumerate() {
        let seed = common::case_seed("gpu-state-update-bs1024", i as u64);
        let run = |backend: Arc<dyn Backend>| {
            let pool = small_pool(backend, widths, k, None, big as i64);
            let leases: Vec<_> = (0..big).map(|_| pool.alloc_slot().unwrap()).collect();
            poison(&pool, &mut Rng::new(seed));
            let seqs = forward(&mut Rng::new(seed ^ 1), &leases, 2, 1_000_000);
            let cap = StateUpdateCapacity::new(big, 2 * big);
            run_forward(
                &pool,
                &mut Rng::new(seed ^ 2),
                &seqs,
                cap,
                &format!("small arena {widths:?} bs={big}"),
            );
            planes(&pool)
        };
        let (d, h) = (run(dev.clone()), run(Arc::new(HostBackend::new())));
        assert!(diff(&h, &d).is_none(), "small arena {widths:?} bs={big}: device and host differ");
    }
}

/// Captured once (every compressor at one layer each), replayed over restaged batches with
/// new inputs written into the captured input buffers; a shrink that relocates held slots and
/// a grow in between (the engine rebinds its leases and restages). Every replay leaves the
/// planes as the expectation says.
#[test]
fn captured_update_replays_new_batches_across_boundary_moves() {
    let Some(cuda) = common::cuda_or_skip("captured_update_replays_new_batches_across_boundary_moves") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::new(cuda.clone());
    let model = ModelShape::v4_flash(2).unwrap();
    let pool: Arc<Pool> = v4_pool(dev.clone(), &model, KvDtype::Fp8, 12);
    let mut rng = Rng::new(common::case_seed("gpu-state-update-graph", 0));
    let mut leases: Vec<SlotLease> = (0..10).map(|_| pool.alloc_slot().unwrap()).collect();
    let cap = StateUpdateCapacity::new(8, 24);
    let mut upd = pool.state_update(cap).unwrap();
    // Fixed input buffers per compressor, sized for the capacity's tokens.
    let mut sets = Vec::new();
    for (n, c) in Compressor::ALL.into_iter().enumerate() {
        let (_, dim) = field_shape(&pool, c);
        let dtype = if n == 1 { ElemType::F32 } else { ElemType::Bf16 };
        let i = inputs(&mut rng, c, dim, cap.max_tokens, dtype, ElemType::F32);
        let (allocs, view) = upload(dev.as_ref(), &i);
        let layer = layers(&pool, c) - 1 - n as u64 % 2;
        sets.push((c, layer, i, allocs, view));
    }
    let graph = {
        let capture = cuda.begin_capture(Stream::DEFAULT).unwrap();
        for (c, layer, _, _, view) in &sets {
            let launch = upd.launch(*c, *layer, view).unwrap();
            // SAFETY: the launch names the handle's plan, the pool's fields and the input
            // allocations above, all of which outlive the graph (dropped first, below).
            unsafe { cuda.launch(&launch, Stream::DEFAULT).unwrap() };
        }
        capture.end().unwrap()
    };
    for step in 0..7 {
        match step {
            2 => {
                // Free three slots, then shrink by two: held slots in the retired groups move.
                for l in leases.drain(..3) {
                    pool.free_slot(l.handle).unwrap();
                }
                let change = pool.shrink_slots(2).unwrap();
                for m in &change.slot_moves {
                    let l = leases.iter_mut().find(|l| l.handle == m.old).expect("a moved slot is held");
                    *l = SlotLease { handle: m.new, position: m.to_position };
                }
                println!("step {step}: shrink moved {} slot(s)", change.slot_moves.len());
            }
            4 => {
                pool.grow_slots(3).unwrap();
                leases.extend((0..2).map(|_| pool.alloc_slot().unwrap()));
                println!("step {step}: grew by 3 slots");
            }
            _ => {}
        }
        let bs = rng.range(1, leases.len().min(cap.max_seqs) as i64) as usize;
        let seqs = forward(&mut rng, &leases[leases.len() - bs..], 3, 1_000_000);
        upd.stage(&views(&seqs)).unwrap();
        for (_, _, i, allocs, _) in sets.iter_mut() {
            refill(&mut rng, i);
            for (a, bytes) in allocs.iter().zip([&i.kv, &i.score, &i.ape]) {
                // SAFETY: the allocation holds exactly these bytes (same shapes as captured).
                unsafe { dev.upload(a.ptr, bytes, Stream::DEFAULT).unwrap() };
            }
        }
        let mut want = planes(&pool);
        graph.replay(Stream::DEFAULT).unwrap();
        for (c, layer, i, _, _) in &sets {
            expect(&pool, &mut want, *c, *layer, i, &seqs);
        }
        if let Some(d) = diff(&want, &planes(&pool)) {
            panic!("graph replay {step} ({bs} sequences):\n{d}");
        }
        println!(
            "ok graph replay {step}: {bs} sequences, plan rows {:?}",
            [upd.staged_rows(v4pool::Class::Csa), upd.staged_rows(v4pool::Class::Hca)]
        );
    }
    drop(graph);
    for (_, _, _, allocs, _) in sets {
        free(dev.as_ref(), allocs);
    }
}
