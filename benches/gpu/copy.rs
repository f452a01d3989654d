//! Checkpoint copy and relocation against the device-to-device copy floor.

use crate::common::{fmt_bytes, Rng};
use crate::harness::{alloc, download_u8, free, header, print_row, Floors, Gpu, Row};
use crate::{flash_plan, Res, GIB, REPS, S};
use std::sync::Arc;
use v4pool::backend::cuda::CudaGraph;
use v4pool::backend::{Backend, DeviceAllocation};
use v4pool::pool::{Pool, PoolSpec};
use v4pool::raw::index::{CopyRun, CopyRunsArgs, DevicePtr, Launch};

pub(crate) fn copy_group(gpu: &Gpu, f: &Floors) -> Res<()> {
    header("checkpoint copy and relocation (V4-Flash fp8 pool, 8 GiB plan; copy_runs kernel)");
    let p = flash_plan(64, 8 * GIB)?;
    let backend: Arc<dyn Backend> = Arc::new(gpu.be.clone());
    let pool = Pool::new(backend, PoolSpec::from_plan(&p)?, S)?;
    let g = pool.spec().geometry.clone();
    let widths = pool.spec().plane_widths.clone();
    let image_bytes = pool.checkpoint_image_bytes()?;
    let mut rng = Rng::new(21);
    // Four held slots with random contents, four image buffers.
    let mut leases = Vec::new();
    for _ in 0..4 {
        let lease = pool.alloc_slot()?;
        for (pl, &w) in widths.iter().enumerate() {
            let (start, _) = g.slot_span(lease.position)?;
            let bytes: Vec<u8> = (0..g.slot_bytes(w)).map(|_| rng.next_u64() as u8).collect();
            pool.write_plane(pl, start as u64 * w, &bytes)?;
        }
        leases.push(lease);
    }
    let images: Vec<DeviceAllocation> = (0..4).map(|_| alloc(&gpu.be, image_bytes)).collect::<Res<_>>()?;
    // The image runs, exactly as Pool::checkpoint_to queues them.
    let image_runs = |position: i64, image: DevicePtr| -> Res<Vec<CopyRun>> {
        Ok(v4pool::pool::split_runs(&pool.checkpoint_copy_runs(position, image, true)?))
    };
    let ck_runs: Vec<Vec<CopyRun>> =
        (0..4).map(|k| image_runs(leases[k].position, images[k].ptr)).collect::<Res<_>>()?;
    // Relocations, as Pool::relocation_runs builds them: one slot move (whole slot, every
    // plane) and one block move (its envelope in every plane plus every indexer layer).
    let live = g.live_positions();
    let free_pos = live.start; // lowest live position: vacant (slots are taken from the top)
    let slot_move = |from: i64, to: i64| -> Res<Vec<CopyRun>> {
        Ok(v4pool::pool::split_runs(&pool.slot_copy_runs(from, to)?))
    };
    let block_move = |from: u64, to: u64| -> Res<Vec<CopyRun>> {
        Ok(v4pool::pool::split_runs(&pool.block_copy_runs(from as u32, to as u32)?))
    };
    let nb = g.num_blocks as u64;
    let slot_runs: Vec<Vec<CopyRun>> =
        (0..4).map(|k| slot_move(leases[k].position, free_pos + k as i64)).collect::<Res<_>>()?;
    let block_runs: Vec<Vec<CopyRun>> = (0..4u64).map(|k| block_move(nb - 1 - k, k)).collect::<Res<_>>()?;

    // One descriptor allocation per run list, uploaded once; graphs replay them.
    let mut descs = Vec::new();
    let mut graphs_of = |lists: &[Vec<CopyRun>]| -> Res<(Vec<CudaGraph>, Vec<Launch>)> {
        let mut graphs = Vec::new();
        let mut launches = Vec::new();
        for runs in lists {
            let d = alloc(&gpu.be, (runs.len() * std::mem::size_of::<CopyRun>()) as u64)?;
            gpu.upload(d.ptr, runs)?;
            let l =
                Launch::CopyRuns(CopyRunsArgs::default().with_runs(d.ptr).with_num_runs(runs.len() as i32));
            graphs.push(gpu.graph_of(&[l])?);
            launches.push(l);
            descs.push(d);
        }
        Ok((graphs, launches))
    };
    let (ck_graphs, ck_launch) = graphs_of(&ck_runs)?;
    let (sl_graphs, sl_launch) = graphs_of(&slot_runs)?;
    let (bl_graphs, bl_launch) = graphs_of(&block_runs)?;

    // Correctness: each kind once, destination poisoned first, compared with its source.
    for (runs, graph) in
        [(&ck_runs[0], &ck_graphs[0]), (&slot_runs[0], &sl_graphs[0]), (&block_runs[0], &bl_graphs[0])]
    {
        for r in runs.iter().filter(|r| r.dst % 4 == 0) {
            // SAFETY: every run's destination lies in the pool's planes, the indexer cache or
            // an image buffer this bench allocated; bytes / 4 words stay inside the run.
            unsafe { gpu.be.fill_u32(r.dst, r.bytes / 4, 0xdead_beef, S)? };
        }
        graph.replay(S)?;
        for r in runs.iter() {
            let a = download_u8(&gpu.be, r.src, r.bytes as usize)?;
            let b = download_u8(&gpu.be, r.dst, r.bytes as usize)?;
            if a != b {
                return Err(format!("copy_runs: run {r:?} differs from its source").into());
            }
        }
    }
    // The pool's own entry point, eager (descriptor upload + launch, in the events).
    let eager_pool = gpu.time(
        REPS,
        |_| Ok(()),
        |i| {
            let k = i % 4;
            // SAFETY: the image buffer is live, image_bytes long, outside the planes.
            unsafe { pool.checkpoint_to(leases[k].handle, images[k].ptr)? };
            Ok(())
        },
    )?;
    let sum = |runs: &[CopyRun]| runs.iter().map(|r| r.bytes).sum::<u64>();
    let kinds: [(String, &[CudaGraph], &[Launch], u64); 3] = [
        (format!("checkpoint image ({} runs)", ck_runs[0].len()), &ck_graphs, &ck_launch, sum(&ck_runs[0])),
        (format!("slot move ({} runs)", slot_runs[0].len()), &sl_graphs, &sl_launch, sum(&slot_runs[0])),
        (format!("block move ({} runs)", block_runs[0].len()), &bl_graphs, &bl_launch, sum(&block_runs[0])),
    ];
    for (name, graphs, launches, bytes) in kinds {
        let eager = gpu.time(REPS, |_| Ok(()), |i| gpu.launch(&launches[i % launches.len()]))?;
        let graph = gpu.time_graphs(graphs, |_| Ok(()))?;
        let (copy, memset) = (gpu.copy_floor(bytes)?, gpu.memset_floor(bytes)?);
        print_row(
            f,
            &Row { name: &name, eager: Some(eager), graph, read: bytes, written: bytes, copy, memset },
        );
    }
    println!(
        "  Pool::checkpoint_to eager (descriptor upload + launch): {:.2} µs median (p90 {:.2}); image {}",
        eager_pool.med,
        eager_pool.p90,
        fmt_bytes(image_bytes)
    );
    drop((ck_graphs, sl_graphs, bl_graphs));
    gpu.be.synchronize(S)?;
    for d in descs {
        free(&gpu.be, d);
    }
    for a in images {
        free(&gpu.be, a);
    }
    Ok(())
}
