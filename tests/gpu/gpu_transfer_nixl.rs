//! NIXL on one GPU: VRAM registration, then handoffs of 8K, 128K and 1M-token V4-Flash
//! requests between two pools on GPU 0 through two NIXL agents (UCX's CUDA transports), the
//! receiver's blocks, whole slot and window rows byte-identical, every receiver byte outside
//! the request still poisoned. Prints the NIXL transfer's GB/s beside the in-process engine's
//! device copies of the same spans (a third pool, same run) and the spans per request.
//!
//! The same sizes with the receiver in a second process on the same GPU (this binary re-run
//! as the child; UCX's cuda_ipc between processes), checked by the receiver.
//!
//! Skips visibly without a GPU (fails with `V4POOL_REQUIRE_GPU=1`) or without the NIXL
//! library (`$V4POOL_NIXL_LIB`; fails with `V4POOL_REQUIRE_NIXL=1`). UCX picks its transports
//! unless `UCX_TLS` says otherwise; InfiniBand modules are kept off (`UCX_MODULES=^ib*`)
//! unless the environment sets `UCX_MODULES`. docs/nixl.md has the command.

use crate::common;
use crate::nixl_common;
use crate::transfer_common;

use common::{case_seed, cuda_or_skip, Rng};
use nixl_common::*;
use std::sync::Arc;
use transfer_common::*;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::transfer::nixl::{NixlAgent, NixlEngine, NixlMem, NixlOptions};
use v4pool::transfer::{handoff, Endpoint, LocalEngine};

const TOKENS: [i64; 3] = [8 << 10, 128 << 10, 1 << 20];

fn nixl_or_skip(test: &str) -> bool {
    transfer_common::nixl_or_skip(module_path!(), test, &[("UCX_MODULES", "^ib*")])
}

#[test]
fn nixl_vram_handoffs_on_one_gpu() {
    // `V4POOL_TEST_DEVICE=host`: a dry run of this test's harness on the host backend (DRAM,
    // 8K tokens), on a machine without a GPU.
    let dry = std::env::var("V4POOL_TEST_DEVICE").is_ok_and(|v| v == "host");
    let (b, dev): (Arc<dyn Backend>, u32) = if dry {
        println!("DRY RUN: nixl_vram_handoffs_on_one_gpu on the host backend, 8K tokens only");
        (Arc::new(v4pool::backend::host::HostBackend::new()), 0)
    } else {
        let Some(gpu) = cuda_or_skip("nixl_vram_handoffs_on_one_gpu") else { return };
        let dev = gpu.ordinal() as u32;
        (Arc::new(gpu), dev)
    };
    if !nixl_or_skip("nixl_vram_handoffs_on_one_gpu") {
        return;
    }
    println!("UCX_TLS={:?}", std::env::var("UCX_TLS").ok());
    let mem = NixlMem::for_backend(b.as_ref(), dev).unwrap();
    assert_eq!(mem, if dry { NixlMem::Dram } else { NixlMem::Vram(dev) });
    // VRAM registration on its own: register, metadata grows with it, deregister.
    {
        let a = b.alloc_zeroed(64 << 20).unwrap();
        let mut agent = NixlAgent::new(None, &NixlOptions::default()).unwrap();
        let bare = agent.metadata().unwrap().len();
        // SAFETY: a live device allocation of that size, freed after the agent is dropped.
        unsafe { agent.register(mem, a.ptr, 64 << 20).unwrap() };
        let with = agent.metadata().unwrap().len();
        assert!(with > bare, "registration adds to the metadata ({bare} -> {with} bytes)");
        agent.deregister(mem, a.ptr, 64 << 20).unwrap();
        drop(agent);
        // SAFETY: nothing uses the allocation any more.
        unsafe { b.free(a) };
        println!("nixl-vram: registered 64 MiB as {mem:?} ({bare} -> {with} metadata bytes)");
    }
    let model = ModelShape::v4_flash(1).unwrap();
    let sizes: &[i64] = if dry { &TOKENS[..1] } else { &TOKENS };
    for (i, &tokens) in sizes.iter().enumerate() {
        let blocks = (tokens + 255) / 256 + 4;
        let mut rng = Rng::new(case_seed("nixl_vram", i as u64));
        let (s, _) = v4_pool(b.clone(), &model, blocks, 2);
        let (r, _) = v4_pool(b.clone(), &model, blocks, 2);
        let (r2, _) = v4_pool(b.clone(), &model, blocks, 2);
        poison_pool(&r);
        poison_pool(&r2);
        let req = random_request(&s, tokens, &mut rng);
        let mut engine = NixlEngine::pair(mem, mem, &NixlOptions::default()).unwrap();
        let out = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r), &req)
            .unwrap_or_else(|e| panic!("{tokens}: {e}"));
        let words = check_received("nixl-vram", tokens, &s, &r, &req, &out);
        // The same request by device copies (one cuMemcpy per span), same spans.
        let mut local = LocalEngine::new(b.clone(), b.clone(), Stream::DEFAULT);
        let out2 = handoff(&mut local, &Endpoint::new(&s), &Endpoint::new(&r2), &req).unwrap();
        check_received("local-vram", tokens, &s, &r2, &req, &out2);
        assert_eq!(out.spans, out2.spans);
        // A second NIXL handoff on the warm engine (the first pays connection setup).
        for b2 in out.blocks.iter() {
            r.free_block(*b2).unwrap();
        }
        r.free_slot(out.slot.handle).unwrap();
        poison_pool(&r);
        let warm = handoff(&mut engine, &Endpoint::new(&s), &Endpoint::new(&r), &req).unwrap();
        check_received("nixl-vram-warm", tokens, &s, &r, &req, &warm);
        let gb = |o: &v4pool::transfer::Rebound| o.bytes as f64 / o.transfer_time.as_secs_f64() / 1e9;
        println!(
            "nixl-vram: {tokens} tokens, {} blocks, {} spans per request, {:.1} MiB: NIXL {:.3} ms ({:.1} GB/s), \
             warm {:.3} ms ({:.1} GB/s); device copies {:.3} ms ({:.1} GB/s); bytes, window rows, untouched \
             words ({words}) OK",
            out.blocks.len(),
            out.spans,
            out.bytes as f64 / (1 << 20) as f64,
            out.transfer_time.as_secs_f64() * 1e3,
            gb(&out),
            warm.transfer_time.as_secs_f64() * 1e3,
            gb(&warm),
            out2.transfer_time.as_secs_f64() * 1e3,
            gb(&out2),
        );
    }
}

/// The backend both processes use: CUDA device 0, or the host for the dry run.
fn two_process_backend(test: &str) -> Option<(&'static str, Arc<dyn Backend>)> {
    if std::env::var("V4POOL_TEST_DEVICE").is_ok_and(|v| v == "host") {
        println!("DRY RUN: {test} on the host backend, 8K tokens only");
        return Some(("host", Arc::new(v4pool::backend::host::HostBackend::new())));
    }
    let gpu = cuda_or_skip(test)?;
    Some(("cuda", Arc::new(gpu)))
}

#[test]
fn nixl_vram_handoffs_between_two_processes_on_one_gpu() {
    let test = "nixl_vram_handoffs_between_two_processes_on_one_gpu";
    let Some((kind, b)) = two_process_backend(test) else { return };
    if !nixl_or_skip(test) {
        return;
    }
    let model = ModelShape::v4_flash(1).unwrap();
    let sizes: &[i64] = if kind == "host" { &TOKENS[..1] } else { &TOKENS };
    for (i, &tokens) in sizes.iter().enumerate() {
        let blocks = (tokens + 255) / 256 + 4;
        let mut rng = Rng::new(case_seed("nixl_vram_2proc", i as u64));
        let (s, _) = v4_pool(b.clone(), &model, blocks, 2);
        let req = random_request(&s, tokens, &mut rng);
        let mut peer =
            spawn_receiver(module_path!(), &format!("vram{i}"), tokens, blocks, 1, Mode::Receive, kind);
        let verdict =
            send_to_child(&s, &req, &mut peer, Mode::Receive).unwrap_or_else(|e| panic!("{tokens}: {e}"));
        let text = peer.finish("two-process VRAM handoff", false);
        assert!(verdict.starts_with("OK"), "{tokens}: receiver says {verdict}\n{text}");
        println!("nixl-vram-2proc: {tokens} tokens ({kind}): receiver: {verdict}");
    }
}

/// The receiver half of the test above, run in a child process.
#[test]
#[ignore = "run as a child process by nixl_vram_handoffs_between_two_processes_on_one_gpu"]
fn child_nixl_receiver() {
    as_child_receiver(module_path!(), &[("UCX_MODULES", "^ib*")]);
}
