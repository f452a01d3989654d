"""The Mooncake conversation trace through vLLM 0.34's real Scheduler on CPU, with a mock
model runner (the tokens it computes are the tokens the scheduler schedules), for
DeepSeek-V4-Flash's layout as vLLM derives it (tests/vllm/dsv4_layout.py):

  (a) vLLM alone (its prefix cache, one HBM block budget);
  (c) vLLM + v4pool.vllm with a host tier of TIER bytes;
  (d) a fleet of N schedulers behind prefix affinity (a request goes to the engine that
      served its first block): per-engine host tiers vs one shared tier of the same bytes.

The connector runs scheduler-side in ``bench_index_only`` mode: the tier holds the keys and
byte sizes (from the layout's pages) of what the worker would store, not the bytes. Requests
decode one token (prompt reuse is what the trace measures; the mock model's output tokens are
not the trace's). Reported: prompt tokens served from cache and the trace's ceiling (every
earlier block kept), tokens recomputed by replay, the hit-length distribution, tier bytes per
cached token. (b), vLLM's OffloadingConnector, needs its worker side to report offloads and
is not run here (docs/vllm.md).

Run in the vLLM venv:  python benches/vllm_trace.py TRACE.jsonl [--requests 400]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
import dsv4_layout as L  # noqa: E402

HASH_TOKENS = 512
# vLLM sizes its KV for this length; longer trace requests are left out (counted).
MAX_LEN = 32768


def tokens_of(rec) -> list[int]:
    out = []
    ids = rec["hash_ids"]
    for i, h in enumerate(ids):
        n = HASH_TOKENS if i + 1 < len(ids) else rec["input_length"] - HASH_TOKENS * (len(ids) - 1)
        out += [1 + (h * 1000003 + j * 7919) % 120000 for j in range(max(n, 0))]
    return out[: rec["input_length"]]


def ceiling(recs) -> tuple[int, int]:
    seen, hit, total = set(), 0, 0
    for r in recs:
        prefix_ok = True
        ids = r["hash_ids"]
        for i, h in enumerate(ids):
            n = HASH_TOKENS if i + 1 < len(ids) else r["input_length"] - HASH_TOKENS * (len(ids) - 1)
            key = tuple(ids[: i + 1])
            if prefix_ok and key in seen and i + 1 < len(ids):
                hit += n
            else:
                prefix_ok = False
            seen.add(key)
        total += r["input_length"]
    return hit, total


def make_engine(connector: dict | None, hbm_bytes: int):
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = L.vllm_config("v4-flash", max_model_len=MAX_LEN, max_batched=2048,
                        connector_extra=connector)
    kcfg = L.kv_cache_config(cfg, hbm_bytes)
    cfg.cache_config.num_gpu_blocks = kcfg.num_blocks
    block, hash_block = L.scheduler_blocks(cfg, kcfg)
    s = Scheduler(vllm_config=cfg, kv_cache_config=generate_scheduler_kv_cache_config([kcfg]),
                  block_size=block, hash_block_size=hash_block, log_stats=True,
                  structured_output_manager=StructuredOutputManager(cfg))
    s.hash_block_size = hash_block
    return s, kcfg


def run(engines, recs, route) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    st = collections.Counter()
    hist = collections.Counter()
    for n, rec in enumerate(recs):
        s = engines[route(rec)]
        toks = tokens_of(rec)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        sp.update_from_generation_config({}, 0)
        req = Request(request_id=str(n), prompt_token_ids=toks, sampling_params=sp,
                      pooling_params=None, block_hasher=get_request_block_hasher(s.hash_block_size, sha256))
        s.add_request(req)
        first = True
        while s.has_unfinished_requests():
            out = s.schedule()
            if first and str(n) in out.num_scheduled_tokens:
                cached = req.num_computed_tokens - out.num_scheduled_tokens[str(n)]
                st["cached"] += cached
                st["computed"] += out.num_scheduled_tokens[str(n)]
                st["replayed"] += max(0, getattr(req, "num_replay_tokens", 0) or 0)
                hist[(cached // 4096) * 4096 if cached else 0] += 1
                first = False
            ids = list(out.num_scheduled_tokens)
            s.update_from_output(out, ModelRunnerOutput(
                req_ids=ids,
                sampled_token_ids=[[5] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else [] for r in ids],
                logprobs=None, prompt_logprobs_dict={}, pooler_output=None))
        st["prompt"] += len(toks)
    conn_bytes = 0
    for s in engines:
        c = s.connector
        if c is not None:
            conn_bytes = max(conn_bytes, c.tiers.used[0])
    st["tier_bytes"] = conn_bytes
    return {"stats": dict(st), "hist": dict(sorted(hist.items()))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--hbm", default=str(16 << 30), help="KV bytes per engine (HBM budget)")
    ap.add_argument("--tier", default=str(32 << 30), help="tier bytes (per engine, or shared total)")
    ap.add_argument("--fleet", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="v4pool.vllm checkpoint_every (tokens, a multiple of 256)")
    args = ap.parse_args()
    recs = [json.loads(x) for x in open(args.trace)][: args.requests]
    skipped = sum(r["input_length"] >= MAX_LEN for r in recs)
    recs = [r for r in recs if r["input_length"] < MAX_LEN]
    hbm, tier = int(args.hbm), int(args.tier)
    hit, total = ceiling(recs)
    print(f"# {len(recs)} requests ({skipped} longer than {MAX_LEN} left out), {total} prompt tokens; ceiling (infinite cache): {hit} ({hit / total:.3f})")
    rows = []
    t0 = time.time()
    s, _ = make_engine(None, hbm)
    rows.append(("(a) vLLM alone", run([s], recs, lambda r: 0)))
    s, _ = make_engine({"bench_index_only": True, "host_bytes": tier, "checkpoint_every": args.checkpoint_every, "checkpoint_every_step": True}, hbm)
    rows.append(("(c) vLLM + v4pool.vllm host tier", run([s], recs, lambda r: 0)))
    def affinity(r):
        # Every request shares block 0 (a system prompt): route by the first block after it.
        ids = r["hash_ids"]
        return ids[1] % args.fleet if len(ids) > 1 else 0
    per = [make_engine({"bench_index_only": True, "host_bytes": tier // args.fleet, "checkpoint_every": args.checkpoint_every, "checkpoint_every_step": True}, hbm)[0] for _ in range(args.fleet)]
    rows.append((f"(d) fleet of {args.fleet}, per-engine tiers", run(per, recs, affinity)))
    shared = "fleet-shared-tier"
    fl = [make_engine({"bench_index_only": shared, "host_bytes": tier, "checkpoint_every": args.checkpoint_every, "checkpoint_every_step": True}, hbm)[0] for _ in range(args.fleet)]
    rows.append((f"(d) fleet of {args.fleet}, one shared tier", run(fl, recs, affinity)))
    print(f"# HBM {hbm / 2**30:.0f} GiB per engine, tier {tier / 2**30:.0f} GiB; {time.time() - t0:.0f} s")
    print("| run | prompt tokens from cache | share | of ceiling | replayed | tier bytes / cached token |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        st = r["stats"]
        c = st.get("cached", 0)
        tb = st.get("tier_bytes", 0)
        print(f"| {name} | {c} | {c / total:.3f} | {c / max(hit, 1):.2f} | {st.get('replayed', 0)} | "
              f"{(tb / c) if (c and tb) else 0:.0f} |")
    for name, r in rows:
        print(f"# hit lengths ({name}, bucket of 4096 tokens: requests): {r['hist']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
