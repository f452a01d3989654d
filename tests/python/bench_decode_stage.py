"""One decode step's stage + build at batch 256, called from Python, against the same calls
made from Rust in the same process on the same arrays (`Decode.time_stage_build`). The
difference is what the binding costs per step; the issue's bound is 20 us of host time.

    python tests/python/bench_decode_stage.py            # auto backend (CUDA if present)
    V4POOL_BENCH_BACKEND=host V4POOL_BENCH_BUDGET=6GiB python tests/python/bench_decode_stage.py

On a GPU the build is one launch, so stage + build is compared whole. On the host backend
the build runs the index kernel's CPU reference (milliseconds, whose noise hides
microseconds), so the verdict there is on staging alone. Prints one line per mode and
`bench: PASS` / `bench: FAIL`.
"""

import os
import sys
import time

import numpy as np

import v4pool

BATCH = 256
BLOCKS_PER_SEQ = 32  # contexts up to 8,192 tokens
ITERS = int(os.environ.get("V4POOL_BENCH_ITERS", "2000"))
REPEATS = 5
BOUND_US = 20.0


def best_mean(fn, iters):
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def main():
    backend = os.environ.get("V4POOL_BENCH_BACKEND", "auto")
    budget = os.environ.get("V4POOL_BENCH_BUDGET", "8GiB")
    plan = v4pool.plan(model="v4-flash", budget=budget, max_seqs=BATCH)
    pool = v4pool.Pool(plan, backend=backend)
    slots = [pool.alloc_slot() for _ in range(BATCH)]
    rng = np.random.default_rng(1)
    positions = np.array([s.position for s in slots], dtype=np.int64)
    ctx = rng.integers(1, BLOCKS_PER_SEQ * 256 + 1, size=BATCH).astype(np.int64)
    ntok = np.ones(BATCH, dtype=np.int64)
    tables = rng.integers(0, plan.num_blocks, size=(BATCH, BLOCKS_PER_SEQ)).astype(np.int32)
    dec = pool.decode(max_seqs=BATCH, max_blocks_per_seq=BLOCKS_PER_SEQ)
    for r in range(BATCH):
        dec.write_block_table(r, tables[r])
    on_host = pool.backend == "host"
    iters = max(ITERS // (10 if on_host else 1), 50)
    print(f"backend {pool.backend} ({pool.device_name}), batch {BATCH}, {iters} iterations x {REPEATS}")

    worst = 0.0
    for name, tbl in (("tables", tables), ("resident", None)):
        for build in (False, True):
            def step():
                dec.stage(positions, ctx, ntok, tbl)
                if build:
                    dec.build()

            step()
            dec.synchronize()
            py = best_mean(step, iters)
            dec.synchronize()
            rust = min(dec.time_stage_build(positions, ctx, ntok, tbl, iters, build) for _ in range(REPEATS))
            dec.synchronize()
            over = (py - rust) * 1e6
            what = "stage+build" if build else "stage"
            counts = build != on_host
            if counts:
                worst = max(worst, over)
            print(
                f"  {name:8s} {what:11s}: python {py * 1e6:9.2f} us, rust {rust * 1e6:9.2f} us, "
                f"binding {over:7.2f} us{'' if counts else '  (not judged on this backend)'}"
            )
    verdict = "PASS" if worst <= BOUND_US else "FAIL"
    print(f"bench: {verdict} (binding overhead {worst:.2f} us, bound {BOUND_US} us)")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
