//! The §9 DSpark window gather on the device: the same pool (V4-Flash / V4-Pro, fp8 two planes
//! and bf16 one plane, class rings and carried windows, MTP rings 129..133) built on the GPU
//! and on the host backend with the same random contents gives, gather for gather, the same
//! bytes — staged rows, zero rows and untouched pad rows of a poisoned output alike — at
//! batches 1..1024. Also one gather captured in a CUDA graph and replayed over restaged
//! batches and after boundary moves (new slots, new leases), compared after every replay.

use crate::common;
use crate::gather_common;

use common::{case_seed, cuda_or_skip, device_or_skip, Rng};
use gather_common::{batch, expected, fill, model_pool, models, source_layers};
use std::sync::Arc;
use v4pool::backend::{Backend, Stream};
use v4pool::pool::{Pool, SlotLease};
use v4pool::state::gather::{GatherCapacity, WindowGather};

/// Device and host pools of `model` with the same leases and the same random window bytes.
fn twin_pools(
    dev: &Arc<dyn Backend>,
    model: &v4pool::model::ModelShape,
    fp8: bool,
    rng: &mut Rng,
) -> (Arc<Pool>, Arc<Pool>, Vec<SlotLease>, Vec<SlotLease>) {
    let d = model_pool(dev.clone(), model, fp8, 6, 3);
    let h = model_pool(Arc::new(common::host()), model, fp8, 6, 3);
    let (dl, hl): (Vec<_>, Vec<_>) =
        (0..3).map(|_| (d.alloc_slot().unwrap(), h.alloc_slot().unwrap())).unzip();
    assert_eq!(
        dl.iter().map(|l| l.position).collect::<Vec<_>>(),
        hl.iter().map(|l| l.position).collect::<Vec<_>>()
    );
    let mut r2 = rng.clone();
    fill(&d, &dl, rng);
    fill(&h, &hl, &mut r2);
    (d, h, dl, hl)
}

/// The same batch on the other pool's leases (same positions, same anchors).
fn mirror(
    b: &[v4pool::state::gather::GatherSeq],
    from: &[SlotLease],
    to: &[SlotLease],
) -> Vec<v4pool::state::gather::GatherSeq> {
    b.iter()
        .map(|s| {
            let i = from.iter().position(|l| l.handle == s.slot).unwrap();
            v4pool::state::gather::GatherSeq::new(to[i].handle, s.anchor, s.context_len)
        })
        .collect()
}

/// Gather into a poisoned allocation of `max_seqs × wd` rows on `g`'s backend; every byte.
fn gather_poisoned(g: &WindowGather, layer: usize, wd: usize) -> Vec<u8> {
    let be = g.pool().backend().clone();
    let n = g.capacity().max_seqs * wd * 1024;
    let out = be.alloc_zeroed(n as u64).unwrap();
    let mut bytes = vec![0xa5u8; n];
    // SAFETY: `out` is a live allocation of `n` bytes of this backend, apart from the pool;
    // it is freed only after the stream drained.
    unsafe {
        be.upload(out.ptr, &bytes, Stream::DEFAULT).unwrap();
        g.gather_into(layer, wd, out.ptr).unwrap();
        be.download(&mut bytes, out.ptr, Stream::DEFAULT).unwrap();
        be.synchronize(Stream::DEFAULT).unwrap();
        be.free(out);
    }
    bytes
}

#[test]
fn window_gather_matches_the_host() {
    let Some(dev) = device_or_skip("window_gather_matches_the_host") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    let mut rng = Rng::new(case_seed("gpu-window-gather", 0));
    for (i, model) in models().into_iter().enumerate() {
        for fp8 in [true, false] {
            let (dpool, hpool, dl, hl) = twin_pools(&dev, &model, fp8, &mut rng);
            let ring = dpool.spec().geometry.ring_slots as usize;
            // Under the HIP runtime double (kernels emulated on the CPU) a 64-sequence grid:
            // the same five shapes — one sequence at the ring's width, a few, a part of the
            // grid with pads, the whole grid, all but a few — at a sixteenth of the rows.
            let max_seqs = common::sized(1024, 64);
            let cap = GatherCapacity::new(max_seqs, 128);
            let (mut d, mut h) = (dpool.window_gather(cap).unwrap(), hpool.window_gather(cap).unwrap());
            let shapes = common::sized(
                [(1, ring), (7, 128), (256, 128), (1024, 16), (1000, 3)],
                [(1, ring), (7, 128), (16, 128), (64, 16), (60, 3)],
            );
            for layer in source_layers(&model) {
                for (n, wd) in shapes {
                    let b = batch(&mut rng, &dl, n, wd);
                    d.stage(&b).unwrap();
                    h.stage(&mirror(&b, &dl, &hl)).unwrap();
                    let what = format!("{} fp8={fp8} layer {layer} n={n} wd={wd}", model.name);
                    if wd <= 128 {
                        d.gather(layer, wd).unwrap();
                        h.gather(layer, wd).unwrap();
                        let got = d.read_output().unwrap();
                        assert!(got == h.read_output().unwrap(), "{what}: device and host differ");
                        if n <= 7 {
                            assert!(got == expected(&dpool, layer, &b, wd), "{what}: differs from the spec");
                        }
                    }
                    // The whole grid, pads included, into a poisoned output.
                    if n <= max_seqs / 4 {
                        assert!(
                            gather_poisoned(&d, layer, wd) == gather_poisoned(&h, layer, wd),
                            "{what}: gather_into"
                        );
                    }
                }
            }
            println!("ok case {i}: {} fp8={fp8} ring {ring}", model.name);
        }
    }
}

#[test]
fn window_gather_graph_replays_new_batches_and_boundary_moves() {
    let Some(cuda) = cuda_or_skip("window_gather_graph_replays_new_batches_and_boundary_moves") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::new(cuda.clone());
    let mut rng = Rng::new(case_seed("gpu-window-gather-graph", 0));
    for (model, fp8) in [
        (v4pool::model::ModelShape::v4_flash(1).unwrap(), true),
        (v4pool::model::ModelShape::v4_pro_dspark(3, v4pool::model::DraftMode::Absent).unwrap(), false),
    ] {
        let (dpool, hpool, mut dl, mut hl) = twin_pools(&dev, &model, fp8, &mut rng);
        let cap = GatherCapacity::new(64, 128);
        let (mut d, mut h) = (dpool.window_gather(cap).unwrap(), hpool.window_gather(cap).unwrap());
        let layers = source_layers(&model);
        let wd = 128;
        let out = d.output().unwrap();
        let graph = {
            let capture = cuda.begin_capture(Stream::DEFAULT).unwrap();
            // SAFETY: the launches name the pool's planes, the handle's buffers and its own
            // output, all of which outlive the graph (dropped below first).
            unsafe {
                for &l in &layers {
                    let at = out.ptr; // every layer into the same output: the last one wins
                    cuda.launch(&d.gather_launch(l, wd, at).unwrap(), Stream::DEFAULT).unwrap();
                }
            }
            capture.end().unwrap()
        };
        let last = *layers.last().unwrap();
        for step in 0..6 {
            if step == 3 {
                // Move the boundary: two more slots, leased and filled on both pools.
                dpool.grow_slots(2).unwrap();
                hpool.grow_slots(2).unwrap();
                let (nd, nh): (Vec<_>, Vec<_>) =
                    (0..2).map(|_| (dpool.alloc_slot().unwrap(), hpool.alloc_slot().unwrap())).unzip();
                let mut r2 = rng.clone();
                fill(&dpool, &nd, &mut rng);
                fill(&hpool, &nh, &mut r2);
                dl.extend(nd);
                hl.extend(nh);
            }
            let n = rng.range(1, 64) as usize;
            let b = batch(&mut rng, &dl, n, wd);
            d.stage(&b).unwrap();
            graph.replay(Stream::DEFAULT).unwrap();
            h.stage(&mirror(&b, &dl, &hl)).unwrap();
            h.gather(last, wd).unwrap();
            // The graph wrote the device output; read it through the handle's last gather
            // shape by running the same gather eagerly on the host only.
            let mut got = vec![0u8; n * wd * 1024];
            // SAFETY: the handle's output, `max_seqs × out_window` rows ≥ n × wd.
            unsafe { dev.download(&mut got, out.ptr, Stream::DEFAULT).unwrap() };
            let want: Vec<u8> = h.read_output().unwrap().iter().flat_map(|v| v.to_ne_bytes()).collect();
            assert!(got == want, "{} step {step}: graph replay differs from the host", model.name);
            println!("ok {} graph replay {step}: {n} sequences", model.name);
        }
        drop(graph);
        dev.synchronize(Stream::DEFAULT).unwrap();
    }
}
