//! The §8 compressor-state update on a DeepSeek-V4.1 pool: the KV owners' rings
//! (`compress_kv` / `compress_score`, `S = max owner ratio + k` rows) written per owner with its
//! own ratio (`StateUpdate::update_owner`), one plan keeping each sequence's last `S`
//! positions. The rings are poisoned with random bytes first; afterwards every kept
//! position's row holds kv and score + ape[pos % ratio] and every other ring byte (other
//! rows, other slots, the cursor) its poison — against an expectation built here from the
//! inputs. `v41_owner_rings_on_the_device` runs the same forward on the GPU and compares
//! the whole plane with the host's (SKIP without a device; `V4POOL_REQUIRE_GPU=1` fails).

use crate::common;
use crate::transfer_common;

use common::{case_seed, Rng};
use std::sync::Arc;
use transfer_common::pool_of;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::model::ModelShape;
use v4pool::pool::Pool;
use v4pool::raw::arena::{V41_COMPRESS_KV, V41_COMPRESS_SCORE};
use v4pool::raw::index::ElemType;
use v4pool::sizing::KvDtype;
use v4pool::state::update::{Compressor, StateInputs, StateSeq, StateUpdateCapacity, StateUpdateError};

const DIM: usize = 512;

fn f32s(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (rng.below(1 << 20) as f32 - 524_288.0) / 4096.0).collect()
}

fn upload(be: &Arc<dyn Backend>, v: &[f32]) -> u64 {
    let a = be.alloc_zeroed(4 * v.len() as u64).unwrap();
    // SAFETY: a fresh allocation of exactly these bytes.
    unsafe { be.upload(a.ptr, bytemuck::cast_slice(v), Stream::DEFAULT).unwrap() };
    a.ptr
}

fn plane(pool: &Pool) -> Vec<u8> {
    let mut buf = vec![0u8; pool.plane_bytes(0).unwrap() as usize];
    // SAFETY: the pool's own plane, exactly its bytes.
    unsafe { pool.backend().download(&mut buf, pool.plane_ptr(0).unwrap(), pool.stream()).unwrap() };
    buf
}

/// One forward on a fresh V4.1 pool (`spec_steps` drafts) on `backend`; returns the plane.
fn forward_on(backend: Arc<dyn Backend>, spec_steps: i64, seed: u64) -> Vec<u8> {
    let model = ModelShape::v41_flash(spec_steps).unwrap();
    let pool = Arc::new(pool_of(backend, &model, KvDtype::Bf16, 4, 4).0);
    let be = pool.backend().clone();
    let mut rng = Rng::new(seed);
    let leases: Vec<_> = (0..3).map(|_| pool.alloc_slot().unwrap()).collect();
    // Poison the whole plane (rings, cursor, windows) with random bytes.
    let mut before = vec![0u8; pool.plane_bytes(0).unwrap() as usize];
    rng.fill(&mut before);
    // SAFETY: the pool's own plane, exactly its bytes.
    unsafe { be.upload(pool.plane_ptr(0).unwrap(), &before, Stream::DEFAULT).unwrap() };
    // Sequences: a decode step of 1 + k tokens, a prefill chunk, a short start.
    let (kv_ptr, kv_view) = pool.state_view(V41_COMPRESS_KV).unwrap();
    let ring = kv_view.dims[2] as i64;
    assert_eq!(ring, 2 + spec_steps, "S = max owner ratio + k");
    let shapes = [(1 + spec_steps as usize, 900_i64), (40, 300), (2, 2)];
    let mut positions: Vec<Vec<i64>> = Vec::new();
    let mut first = 0;
    let mut seqs_meta = Vec::new();
    for &(n, ctx) in &shapes {
        positions.push((ctx - n as i64..ctx).collect());
        seqs_meta.push((first, ctx));
        first += n;
    }
    let rows = first;
    let seqs: Vec<StateSeq<'_>> = leases
        .iter()
        .zip(&positions)
        .zip(&seqs_meta)
        .map(|((l, p), &(first_token, context_len))| StateSeq::new(l.handle, first_token, p, context_len))
        .collect();
    let cap = StateUpdateCapacity::new(4, 64);
    let mut upd = pool.state_update(cap).unwrap();
    upd.stage(&seqs).unwrap();
    let g = &pool.spec().geometry;
    let sources = g.kv_sources.clone().unwrap();
    let (score_ptr, score_view) = pool.state_view(V41_COMPRESS_SCORE).unwrap();
    let mut want = before.clone();
    let base = pool.plane_ptr(0).unwrap();
    for (o, &layer) in sources.iter().enumerate() {
        let ratio = g.ratios[layer] as usize;
        let (kv, score, ape) =
            (f32s(&mut rng, rows * DIM), f32s(&mut rng, rows * DIM), f32s(&mut rng, ratio * DIM));
        let inputs = StateInputs::default()
            .with_kv(upload(&be, &kv))
            .with_score(upload(&be, &score))
            .with_ape(upload(&be, &ape))
            .with_kv_row_stride(DIM as i64)
            .with_score_row_stride(DIM as i64)
            .with_rows(rows as i64)
            .with_dim(DIM as i64)
            .with_dtype(ElemType::F32)
            .with_ape_dtype(ElemType::F32);
        // SAFETY: the three inputs are fresh allocations of the pool's backend of the sizes
        // the launch reads, uploaded on its stream.
        unsafe { upd.update_owner(o as u64, &inputs).unwrap() };
        // Expectation: each kept position's row of owner o.
        for ((lease, p), &(first_token, ctx)) in leases.iter().zip(&positions).zip(&seqs_meta) {
            for (j, &pos) in p.iter().enumerate() {
                if pos < ctx - ring {
                    continue;
                }
                let r = first_token + j;
                let row = |ptr: u64, v: &v4pool::pool::FieldView| {
                    let elems = o as u64 * v.strides[0]
                        + lease.position as u64 * v.strides[1]
                        + (pos % ring) as u64 * v.strides[2];
                    (ptr + 4 * elems - base) as usize
                };
                let (k_at, s_at) = (row(kv_ptr, &kv_view), row(score_ptr, &score_view));
                for e in 0..DIM {
                    let sum = score[r * DIM + e] + ape[(pos as usize % ratio) * DIM + e];
                    want[k_at + 4 * e..k_at + 4 * e + 4].copy_from_slice(&kv[r * DIM + e].to_ne_bytes());
                    want[s_at + 4 * e..s_at + 4 * e + 4].copy_from_slice(&sum.to_ne_bytes());
                }
            }
        }
    }
    let got = plane(&pool);
    assert!(got == want, "V4.1 k={spec_steps} on {:?}: the plane differs from the expectation", be.kind());
    // Past the owners, and V4's compressors, are refused.
    let none = StateInputs::default()
        .with_kv(0)
        .with_score(0)
        .with_ape(0)
        .with_kv_row_stride(512)
        .with_score_row_stride(512)
        .with_rows(64)
        .with_dim(512)
        .with_dtype(ElemType::F32)
        .with_ape_dtype(ElemType::F32);
    assert!(matches!(upd.owner_launch(4, &none), Err(StateUpdateError::NoSuchOwner { owner: 4, owners: 4 })));
    assert!(upd.launch(Compressor::CsaMain, 0, &none).is_err());
    got
}

#[test]
fn v41_owner_rings_on_the_host() {
    for (i, k) in [0i64, 5].into_iter().enumerate() {
        forward_on(Arc::new(HostBackend::new()), k, case_seed("v41-state-host", i as u64));
    }
}

#[test]
fn v41_owner_rings_on_the_device() {
    let Some(dev) = common::device_or_skip("v41_owner_rings_on_the_device") else {
        return;
    };
    let dev: Arc<dyn Backend> = Arc::from(dev);
    for (i, k) in [0i64, 5].into_iter().enumerate() {
        let seed = case_seed("v41-state-device", i as u64);
        let d = forward_on(dev.clone(), k, seed);
        let h = forward_on(Arc::new(HostBackend::new()), k, seed);
        assert!(d == h, "V4.1 k={k}: device plane differs from the host's");
        println!("ok V4.1 owner rings k={k}");
    }
}
