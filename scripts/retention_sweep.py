#!/usr/bin/env python3
"""Elastic reuse against reuse_4096 on many long-prompt traces no one tuned on.

Why: issue 45 asks that v4pool's reuse serve at least the hits, throughput and tail latency of
reuse every 4,096 tokens on *any* trace, and a reviewer runs one we have not seen. A handful
of hand-picked seeds cannot show that; this draws cases at random (shape, sessions, session
rate, shared prefixes, longest prompt, pool budget; each case a pure function of its index),
writes each trace with `gen_long_trace.py`, runs `v4pool simulate --policy elastic` and
`--policy reuse_4096` on it, and reports every case where elastic is behind on tok/s/GPU,
p99 TTFT or prefix hit rate, with the geometric means of the ratios.

Usage: scripts/retention_sweep.py --v4pool target/release/v4pool --cases 0:40 --jobs 2
       [--json out.jsonl]
Exit status: 0 when elastic is behind on no case, 1 otherwise, 2 on bad arguments, 3 when a
run failed.
"""

import argparse
import concurrent.futures as cf
import json
import math
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def case(i: int):
    """Generator arguments and simulate arguments of case `i`."""
    r = random.Random(i)
    shape = r.choice(["agent", "tools", "steps"])
    gen = ["--seed", str(1000 + i), "--shape", shape, "--sessions", str(r.randint(60, 260)),
           "--rate", f"{r.choice([0.1, 0.2, 0.35, 0.5, 0.8, 1.2]):.2f}"]
    if r.random() < 0.5:
        gen += ["--prefixes", str(r.randint(1, 12))]
    if r.random() < 0.3:
        gen += ["--max-prompt", str(r.choice([40_000, 64_000, 128_000]))]
    sim = []
    if r.random() < 0.3:
        sim += ["--budget", r.choice(["3GiB", "4GiB", "8GiB", "12GiB"])]
    return gen, sim


def figures(text: str):
    """tok/s/GPU, p99 TTFT (ms) and prefix hit rate from `simulate --json`'s one run."""
    try:
        run = json.loads(text)["runs"][0]
        return {"tok": float(run["time"]["tok_s_gpu"]), "p99_ms": float(run["time"]["ttft_ms"]["p99"]),
                "hit": float(run["prefix_hit_rate"])}
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"simulate's JSON report lacks a figure: {e!r}") from e


def run_case(i: int, v4pool: str, tmp: str):
    gen, sim = case(i)
    trace = os.path.join(tmp, f"case_{i}.jsonl")
    with open(trace, "w") as f:
        subprocess.run([sys.executable, os.path.join(HERE, "gen_long_trace.py")] + gen,
                       stdout=f, stderr=subprocess.DEVNULL, check=True)
    out = {}
    for policy in ("elastic", "reuse_4096"):
        p = subprocess.run([v4pool, "simulate", "--trace", trace, "--backend", "host",
                            "--policy", policy, "--no-progress", "--json"] + sim,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"case {i} {policy}: {p.stderr.strip()[-300:]}")
        out[policy] = figures(p.stdout)
    os.remove(trace)
    e, c = out["elastic"], out["reuse_4096"]
    behind = [k for k, worse in (("tok", e["tok"] < c["tok"]), ("p99", e["p99_ms"] > c["p99_ms"]),
                                  ("hit", e["hit"] < c["hit"])) if worse]
    return {"case": i, "gen": gen, "sim": sim, "elastic": e, "reuse_4096": c, "behind": behind}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v4pool", default="target/release/v4pool")
    ap.add_argument("--cases", default="0:40", help="START:END, case indices")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write one JSON line a case here")
    a = ap.parse_args()
    try:
        start, end = (int(x) for x in a.cases.split(":"))
    except ValueError:
        print("retention_sweep: --cases is START:END", file=sys.stderr)
        return 2
    if not 0 <= start < end or a.jobs < 1 or not os.access(a.v4pool, os.X_OK):
        print("retention_sweep: bad arguments (cases, jobs or the v4pool binary)", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(lambda i: run_case(i, a.v4pool, tmp), range(start, end)))
    except (RuntimeError, ValueError, OSError, subprocess.CalledProcessError) as e:
        # A run that failed is not a case elastic lost: its own exit status.
        print(f"retention_sweep: {e}", file=sys.stderr)
        return 3
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        if r["behind"]:
            e, c = r["elastic"], r["reuse_4096"]
            print(f"case {r['case']} ({' '.join(r['gen'][2:] + r['sim'])}): behind on {','.join(r['behind'])}:"
                  f" tok/s/GPU {e['tok']:.0f} / {c['tok']:.0f}, p99 TTFT {e['p99_ms'] / 1000:.2f} /"
                  f" {c['p99_ms'] / 1000:.2f} s, hit rate {e['hit']:.3f} / {c['hit']:.3f}")

    def gmean(k):
        # Over the cases where both are positive (a hit rate can be 0 on both).
        q = [r["elastic"][k] / r["reuse_4096"][k] for r in rows if r["elastic"][k] > 0 and r["reuse_4096"][k] > 0]
        return math.exp(sum(map(math.log, q)) / len(q)) if q else float("nan")
    behind = sum(1 for r in rows if r["behind"])
    print(f"{len(rows)} cases, elastic behind reuse_4096 on {behind}; elastic / reuse_4096 geometric means:"
          f" tok/s/GPU {gmean('tok'):.4f}, p99 TTFT {gmean('p99_ms'):.4f}, hit rate {gmean('hit'):.4f}")
    return 1 if behind else 0


if __name__ == "__main__":
    sys.exit(main())
