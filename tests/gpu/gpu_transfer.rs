//! Request handoff on GPUs: a prefill pool on GPU 0 and a decode pool on GPU 1 over NCCL for
//! 8K, 128K and 1M-token requests (V4-Flash), and the same on one GPU through the local
//! engine. The receiver's blocks (every plane and indexer layer), whole slot and window rows
//! are byte-identical to the sender's (random bytes, receiver poisoned first, everything
//! outside the request left poisoned), and a decode index build on the receiving GPU over the
//! rebound request equals the host reference.
//!
//! Skips visibly without a GPU (fails with `V4POOL_REQUIRE_GPU=1`); the two-GPU case skips
//! with fewer than two devices or without libnccl (fails with `V4POOL_REQUIRE_GPUS=2`). Sets
//! `NCCL_NVLS_ENABLE=0` (NVLink multicast stays off on the lent machines).

use crate::common;
use crate::transfer_common;

use common::{case_seed, cuda_or_skip, Rng};
use std::sync::Arc;
use transfer_common::*;
use v4pool::backend::cuda::{self, CudaBackend};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::{DecodeBuffer, DecodeCapacity, DecodeSeq, Pool};
use v4pool::transfer::nccl::{self, NcclEngine};
use v4pool::transfer::{handoff, Endpoint, LocalEngine, Rebound, TransferEngine};
use v4pool::Class;

const TOKENS: [i64; 3] = [8 << 10, 128 << 10, 1 << 20];

fn require_two() -> bool {
    std::env::var("V4POOL_REQUIRE_GPUS").is_ok_and(|v| v == "2")
}

/// Whether this test's NCCL body runs in this process: NCCL reads `NCCL_NVLS_ENABLE` when a
/// communicator starts, and other tests share this process (so no `set_var` here); where the
/// environment lacks it, the test `name` runs again alone in a child process with it `0`, its
/// output printed, and this returns false (the child ran the body).
fn nccl_env(name: &str) -> bool {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_some() {
        return true;
    }
    let mut c = common::child_test(module_path!(), name);
    c.env("NCCL_NVLS_ENABLE", "0");
    common::print_child_output(&common::run_child_test(c, name));
    false
}

/// The decode step's index buffers for the rebound request, built on `backend` (the
/// receiving GPU, or the host reference) by the decode path of a pool of the receiver's spec
/// (the build reads the geometry, live positions and block count, never the planes), read
/// back.
fn decode_build(backend: Arc<dyn Backend>, pool: &Pool, out: &Rebound) -> Vec<Vec<i32>> {
    let pool = Arc::new(Pool::new(backend, pool.spec().clone(), Stream::DEFAULT).unwrap());
    let table = out.block_ids();
    let cap = DecodeCapacity::new(1, 1, table.len(), 128, 2048);
    let mut bufs = pool.decode_path(cap).unwrap();
    let seq = DecodeSeq::new(out.slot.position, out.context_len as i64, 1, &table);
    bufs.stage(&[seq]).unwrap();
    bufs.build().unwrap();
    let mut got = Vec::new();
    for c in Class::ALL.into_iter().filter(|&c| bufs.indices(c).is_some()) {
        for which in [DecodeBuffer::Indices(c), DecodeBuffer::Indptr(c), DecodeBuffer::DestRows(c)] {
            got.push(bufs.read_i32(which).unwrap());
        }
    }
    assert!(!got.is_empty());
    got
}

fn run_sizes(name: &str, sizes: &[i64], make: &dyn Fn(i64) -> (Pool, Pool, String, Box<dyn TransferEngine>)) {
    for (i, &tokens) in sizes.iter().enumerate() {
        let mut rng = Rng::new(case_seed(name, i as u64));
        let (sender, receiver, _, mut engine) = make(tokens);
        poison_pool(&receiver);
        let req = random_request(&sender, tokens, &mut rng);
        let t = std::time::Instant::now();
        let out = handoff(engine.as_mut(), &Endpoint::new(&sender), &Endpoint::new(&receiver), &req)
            .unwrap_or_else(|e| panic!("{name} {tokens}: {e}"));
        let secs = t.elapsed().as_secs_f64();
        let words = check_received(name, tokens, &sender, &receiver, &req, &out);
        // The decode index build on the receiving device equals the host reference.
        let dev = decode_build(receiver.backend().clone(), &receiver, &out);
        let reference = decode_build(Arc::new(HostBackend::new()), &receiver, &out);
        assert!(dev == reference, "{name} {tokens}: decode index build differs from the host reference");
        println!(
            "{name}: {tokens} tokens, {} blocks, {} spans, {:.1} MiB in {:.2} ms ({:.1} GB/s incl. handshake); \
             bytes, window rows, untouched words ({words}) and decode build OK",
            out.blocks.len(),
            out.spans,
            out.bytes as f64 / (1 << 20) as f64,
            secs * 1e3,
            out.bytes as f64 / secs / 1e9
        );
        drop(engine);
    }
}

fn blocks_for(tokens: i64) -> i64 {
    (tokens + 255) / 256 + 4
}

#[test]
fn nccl_handoff_gpu0_to_gpu1() {
    if !nccl_env("nccl_handoff_gpu0_to_gpu1") {
        return;
    }
    let Some(gpu0) = cuda_or_skip("nccl_handoff_gpu0_to_gpu1") else { return };
    let count = cuda::device_count().unwrap_or(0);
    if count < 2 || !nccl::is_available() {
        let why = if count < 2 {
            format!("{count} CUDA device(s)")
        } else {
            format!("{:?}", nccl::version().err())
        };
        if require_two() {
            panic!("V4POOL_REQUIRE_GPUS=2 but {why}");
        }
        println!("SKIP: nccl_handoff_gpu0_to_gpu1 needs two GPUs and libnccl ({why})");
        return;
    }
    println!("NCCL version {:?}", nccl::version());
    let gpu1 = CudaBackend::new(1).unwrap();
    let model = ModelShape::v4_flash(1).unwrap();
    run_sizes("nccl", &TOKENS, &|tokens| {
        let (s, id) = v4_pool(Arc::new(gpu0.clone()), &model, blocks_for(tokens), 2);
        let (r, _) = v4_pool(Arc::new(gpu1.clone()), &model, blocks_for(tokens), 2);
        let e = NcclEngine::new(&gpu0, &gpu1).unwrap();
        (s, r, id, Box::new(e) as Box<dyn TransferEngine>)
    });
    // Refusals over NCCL: mismatched layouts (no receiver allocation), no room.
    let (s, _) = v4_pool(Arc::new(gpu0.clone()), &model, 40, 2);
    let (r, _) = v4_pool(Arc::new(gpu1.clone()), &ModelShape::v4_flash(0).unwrap(), 40, 2);
    let mut e = NcclEngine::new(&gpu0, &gpu1).unwrap();
    let req = random_request(&s, 8 << 10, &mut Rng::new(1));
    let before = r.counts().unwrap();
    let err = handoff(&mut e, &Endpoint::new(&s), &Endpoint::new(&r), &req).unwrap_err();
    assert!(matches!(err, v4pool::transfer::HandoffError::LayoutMismatch { .. }), "{err}");
    assert_eq!(r.counts().unwrap(), before);
    let (small, _) = v4_pool(Arc::new(gpu1.clone()), &model, 8, 2);
    let before = small.counts().unwrap();
    let err = handoff(&mut e, &Endpoint::new(&s), &Endpoint::new(&small), &req).unwrap_err();
    assert!(matches!(err, v4pool::transfer::HandoffError::NoRoom { .. }), "{err}");
    assert_eq!(small.counts().unwrap(), before);
    println!("nccl: refusals OK (layout mismatch, no room)");
}

#[test]
fn local_handoff_on_one_gpu() {
    // `V4POOL_TEST_DEVICE=host`: a dry run of this test's checks on the host backend at the
    // smallest size (the harness itself, on a machine without a GPU).
    let dry = std::env::var("V4POOL_TEST_DEVICE").is_ok_and(|v| v == "host");
    let b: Arc<dyn Backend> = if dry {
        println!("DRY RUN: local_handoff_on_one_gpu on the host backend, 8K tokens only");
        Arc::new(HostBackend::new())
    } else {
        let Some(gpu0) = cuda_or_skip("local_handoff_on_one_gpu") else { return };
        Arc::new(gpu0)
    };
    let model = ModelShape::v4_flash(1).unwrap();
    let sizes: &[i64] = if dry { &TOKENS[..1] } else { &TOKENS };
    run_sizes("local-1gpu", sizes, &|tokens| {
        let (s, id) = v4_pool(b.clone(), &model, blocks_for(tokens), 2);
        let (r, _) = v4_pool(b.clone(), &model, blocks_for(tokens), 2);
        let e = LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT);
        (s, r, id, Box::new(e) as Box<dyn TransferEngine>)
    });
}
