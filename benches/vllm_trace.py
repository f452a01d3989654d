"""The Mooncake conversation trace through vLLM 0.34's real Scheduler on CPU, for
DeepSeek-V4-Flash and V4.1-Flash as vLLM lays them out (tests/vllm/dsv4_layout.py).

A mock model runner stands in for the GPU: the tokens it computes are the tokens the
scheduler schedules, and each request decodes the trace's output length. Requests arrive at
the trace's timestamps (open loop), and every step's time comes from v4pool's calibrated
step-cost model (``v4pool.StepCost``, the coefficients ``v4pool calibrate`` fits and
``v4pool simulate`` uses), charged with the step's prefill, decode and restored bytes, so
TTFT and throughput follow from the schedule. Runs, at one HBM budget per engine and one tier
size (equal tier bytes):

  (a)  vLLM alone (its prefix cache);
  (b)  vLLM + its in-tree OffloadingConnector with a CPU tier (``cpu_bytes_to_use``): its
       scheduler side and vLLM's CPUOffloadingManager (the LRU that decides its hits), and
       its worker side (OffloadingConnectorWorker: register_kv_caches over KV tensors laid
       out by vLLM's allocate_kv_cache, start_load_kv, wait_for_save, get_finished and the
       worker metadata its scheduler side waits for), driven step by step as vLLM's own
       tests/v1/kv_connector/unit/offloading_connector/utils.py drives it. Only the data
       mover under the worker side is this file's: vLLM's CPUOffloadingWorker refuses a
       non-CUDA platform (kv_offload/cpu/spec.py, get_worker);
  (c)  vLLM + v4pool.vllm with a host tier;
  (c') the same without branch_every (checkpoints at chunk and prompt ends only);
  (d)  fleets of N engines with v4pool.vllm: per-engine tiers (TIER/N each) or one shared
       tier (TIER), behind affinity routing (the first block after the shared system
       prompt picks the engine) or least-loaded routing (fewest unfinished requests).

No tier here holds bytes: v4pool.vllm runs its scheduler side in ``bench_index_only`` mode
(the tier keeps the keys and byte sizes of what its worker would store, LRU by the layout's
page bytes) and the OffloadingConnector's data mover completes every transfer as submitted,
counting the device pages' bytes. Both tiers are prompt-only, as vLLM's offload is by
default (``offload_prompt_only``; v4pool.vllm: ``checkpoint_at_finish`` off): the mock
model's output tokens are not the trace's next turn, so no later prompt could hit them.

Reported: prompt tokens served from cache (from HBM and from the tier) and the trace's
ceiling (every earlier block kept), tokens recomputed by replay (V4.1's bounded replay),
the hit-length distribution, tier bytes written per token served from the tier, TTFT
(arrival to first token) and throughput: prompt and output tokens per second the engines
were busy, per GPU (the open loop's rate is the trace's; this is what the step-cost model
says the same work costs).

Run in the vLLM venv:  python benches/vllm_trace.py TRACE.jsonl [--requests 600]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
import dsv4_layout as L  # noqa: E402

import torch  # noqa: E402

import v4pool  # noqa: E402
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

# Steps move tens of KiB per call on CPU: one thread (see tests/vllm/test_connector.py).
torch.set_num_threads(1)

HASH_TOKENS = 512
# Per model, an HBM budget per engine that the trace's reusable prefixes outgrow (vLLM alone
# keeps about a third of the ceiling), and a tier four times that. V4.1's KV takes less than
# half of V4's per token (no compressor-state groups; 460-KB slab blocks against 1 MB).
HBM = {"v4-flash": 8 << 30, "v41-flash": 2 << 30}
TIER = {"v4-flash": 32 << 30, "v41-flash": 8 << 30}
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


# ------------------------------------------- vLLM's OffloadingConnector on a CPU machine


class IndexOnlyMover(OffloadingWorker):
    """The data mover under vLLM's OffloadingConnectorWorker: every transfer completes as
    submitted (reported at the next ``get_finished``), no byte moves; the bytes counted are
    the device pages' (``DevicePointers.sizes``: what vLLM would copy)."""

    def __init__(self):
        self.done: list[TransferResult] = []
        self.stored_bytes = 0
        self.loaded_bytes = 0

    def submit_store(self, job_id, device_ptrs, dst_spec) -> bool:
        self.stored_bytes += int(device_ptrs.sizes.sum())
        self.done.append(TransferResult(job_id=job_id, success=True))
        return True

    def submit_load(self, job_id, src_spec, device_ptrs, expedited=False) -> bool:
        self.loaded_bytes += int(device_ptrs.sizes.sum())
        self.done.append(TransferResult(job_id=job_id, success=True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids) -> None:
        return


class IndexOnlyCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPUOffloadingSpec (its chunk sizing and CPUOffloadingManager unchanged) with
    the data mover above in place of CPUOffloadingWorker, which needs CUDA."""

    def get_worker(self, kv_caches):
        if self._worker is None:
            self._worker = IndexOnlyMover()
        return self._worker


# ------------------------------------------------------------------------ an engine


class Engine:
    """One vLLM scheduler (and, for the OffloadingConnector, its worker-role connector)
    stepped by the mock model runner on the step-cost model's clock."""

    def __init__(self, model: str, kind: str, args, hbm: int, tier: int, shared: str | None = None,
                 branch_every: int | None = None, replay_fallback: bool = True):
        from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                                 get_request_block_hasher, init_none_hash)
        from vllm.utils.hashing import sha256
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        connector, extra = "V4PoolConnector", None
        if kind == "offload":
            connector = "OffloadingConnector"
            extra = {"spec_name": "IndexOnlyCPUOffloadingSpec", "spec_module_path": __name__,
                     "cpu_bytes_to_use": tier}
        elif kind == "v4pool":
            extra = {"bench_index_only": shared or True, "host_bytes": tier,
                     "checkpoint_every": args.checkpoint_every,
                     "checkpoint_every_step": args.checkpoint_every_step,
                     "checkpoint_at_finish": False, "replay_fallback": replay_fallback,
                     "branch_every": args.branch_every if branch_every is None else branch_every}
            if args.evict_first is not None:
                extra["evict_first"] = args.evict_first
        cfg = L.vllm_config(model, max_model_len=MAX_LEN, max_batched=args.chunk,
                            max_num_seqs=args.max_seqs, connector_extra=extra,
                            connector=connector)
        kcfg = L.kv_cache_config(cfg, hbm)
        cfg.cache_config.num_gpu_blocks = kcfg.num_blocks
        if kind == "v4pool":
            # What the workers would write: their per-layer pages (the scheduler's config
            # has one representative page per group).
            from v4pool.vllm import worker_layer_pages

            cfg.kv_transfer_config.kv_connector_extra_config["bench_layer_pages"] = worker_layer_pages(cfg, kcfg)
        block, hash_block = L.scheduler_blocks(cfg, kcfg)
        self.s = Scheduler(vllm_config=cfg, kv_cache_config=generate_scheduler_kv_cache_config([kcfg]),
                           block_size=block, hash_block_size=hash_block, log_stats=True,
                           structured_output_manager=StructuredOutputManager(cfg))
        init_none_hash(sha256)
        # As EngineCore makes it (lookahead hashes for connectors that ask for them).
        self.hasher = get_request_block_hasher(hash_block, sha256, cfg.num_hash_lookahead_tokens)
        self.kind = kind
        self.worker = None
        if kind == "offload":
            from vllm.config import set_current_vllm_config
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
                OffloadingConnector)

            self.worker = OffloadingConnector(cfg, KVConnectorRole.WORKER, kcfg)
            # vLLM's layout over an allocation nothing touches (no byte moves).
            kv = L.allocate(cfg, kcfg, allocate=lambda n: torch.empty(n, dtype=torch.int8))
            with set_current_vllm_config(cfg):
                self.worker.register_kv_caches(kv)
            self.mover = self.worker.connector_worker.worker
        self.clock = 0.0  # ms
        self.empty_steps = 0
        self.arrival: dict[str, float] = {}
        self.seen: set[str] = set()
        self.stats = collections.Counter()
        self.hist = collections.Counter()
        self.ttft: list[float] = []

    def add(self, rid: str, tokens: list[int], max_tokens: int, arrival_ms: float) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, 0)
        self.s.add_request(Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                                   pooling_params=None, block_hasher=self.hasher))
        self.arrival[rid] = arrival_ms
        self.stats["prompt"] += len(tokens)

    def busy(self) -> bool:
        # As EngineCore: requests, finished ones to report, or connector work in flight.
        return self.s.has_requests()

    def load(self) -> int:
        return len(self.s.requests)

    def _restored(self, meta) -> int:
        if self.kind == "offload":
            before, self._mover_loaded = getattr(self, "_mover_loaded", 0), self.mover.loaded_bytes
            return self.mover.loaded_bytes - before
        if self.kind != "v4pool" or meta is None:
            return 0
        lay = self.s.connector.layout
        return sum(lay.bytes_of(tr.blocks, skip_null=True) for tr in meta.loads if tr.kind in ("b", "c"))

    def step(self, cost) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata)
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        s = self.s
        out = s.schedule()
        kvout = None
        if self.worker is not None:
            w, meta = self.worker, out.kv_connector_metadata
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(out.finished_req_ids)
            wmeta = w.build_connector_worker_meta() or OffloadingWorkerMetadata()
            w.clear_connector_metadata()
            kvout = KVConnectorOutput(finished_sending=res.finished_sending,
                                      finished_recving=res.finished_recving,
                                      kv_connector_worker_meta=wmeta,
                                      failed_recving=res.failed_recving or set())
        load = dict(prefill_tokens=0, prefill_ctx_tokens=0.0, decode_seqs=0, decode_ctx_tokens=0,
                    restored_bytes=self._restored(out.kv_connector_metadata))
        firsts = []
        for rid, n in out.num_scheduled_tokens.items():
            r = s.requests[rid]
            start = r.num_computed_tokens - n  # schedule() advanced it past this chunk
            if start < r.num_prompt_tokens:
                load["prefill_tokens"] += n
                load["prefill_ctx_tokens"] += n * (start + n / 2)
            else:
                load["decode_seqs"] += 1
                load["decode_ctx_tokens"] += start
            if rid not in self.seen:
                self.seen.add(rid)
                ps = r.prefill_stats
                local = ps.num_local_cached_tokens if ps else 0
                ext = ps.num_external_cached_tokens if ps else 0
                # Served from cache: what the first chunk starts past; the rest of the hit
                # (V4.1's bounded replay) is recomputed.
                self.stats["cached"] += start
                self.stats["local"] += min(local, start)
                self.stats["external"] += start - min(local, start)
                # Replayed after a hit the tier served part of, or after one in HBM only.
                self.stats["replayed_tier" if ext else "replayed_hbm"] += local + ext - start
                self.hist[(start // 4096) * 4096] += 1
            if r.num_computed_tokens >= r.num_prompt_tokens and start < r.num_prompt_tokens:
                firsts.append(rid)
        self.stats["restored_bytes"] += load["restored_bytes"]
        # A step that computes nothing (connector work only) runs no forward.
        ms = cost.step_ms(**load) if out.total_num_scheduled_tokens else 0.0
        self.empty_steps = 0 if ms else self.empty_steps + 1
        if self.empty_steps > 10_000:
            raise RuntimeError("an engine stepped 10,000 times without scheduling a token")
        self.clock += ms
        self.stats["busy_ms"] += ms
        for rid in firsts:
            self.ttft.append(self.clock - self.arrival[rid])
        ids = list(out.num_scheduled_tokens)
        sampled = [[5] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else []
                   for r in ids]
        self.stats["output"] += sum(len(x) for x in sampled)
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=kvout))

    def tier_written(self) -> int:
        if self.kind == "offload":
            return self.mover.stored_bytes
        if self.kind == "v4pool":
            return self.s.connector.stats.get("saved_bytes", 0)
        return 0


def run(engines: list[Engine], recs, route, cost) -> dict:
    """Open loop: before a request is routed at its arrival, every engine with work steps
    until its clock reaches that arrival (the one furthest behind first)."""
    for n, rec in enumerate(recs):
        t = float(rec["timestamp"])
        while True:
            behind = [e for e in engines if e.busy() and e.clock < t]
            if not behind:
                break
            min(behind, key=lambda e: e.clock).step(cost)
        for e in engines:
            if not e.busy():
                e.clock = max(e.clock, t)
        e = engines[route(rec, engines)]
        e.add(str(n), tokens_of(rec), max(1, rec["output_length"]), t)
    while any(e.busy() for e in engines):
        min((e for e in engines if e.busy()), key=lambda e: e.clock).step(cost)
    st = collections.Counter()
    hist = collections.Counter()
    ttft: list[float] = []
    for e in engines:
        st.update(e.stats)
        hist.update(e.hist)
        ttft += e.ttft
        st["tier_written"] += e.tier_written()
    st["makespan_ms"] = max(e.clock for e in engines) - float(recs[0]["timestamp"])
    return {"stats": dict(st), "hist": dict(sorted(hist.items())), "ttft": sorted(ttft),
            "engines": len(engines)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--models", default="v4-flash,v41-flash")
    ap.add_argument("--runs", default="a,b,c,cx,c0,d",
                    help="a: vLLM alone, b: OffloadingConnector, c: v4pool.vllm, cx: without "
                         "replay_fallback (V4.1), c0: without branch_every, d: fleets")
    ap.add_argument("--hbm", type=int, help="KV bytes per engine (HBM budget; default per model: HBM)")
    ap.add_argument("--tier", type=int, help="tier bytes, one engine's or a fleet's total (default per model: TIER)")
    ap.add_argument("--fleet", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--branch-every", type=int, default=HASH_TOKENS,
                    help="v4pool.vllm branch_every (the trace's prefixes diverge at its 512-token blocks)")
    ap.add_argument("--checkpoint-every", type=int, default=4096,
                    help="v4pool.vllm checkpoint_every (tokens, a multiple of 256; 4096 is the 16 blocks of v4pool's own manager)")
    ap.add_argument("--checkpoint-every-step", action="store_true",
                    help="v4pool.vllm checkpoint_every_step (a checkpoint at every chunk end)")
    ap.add_argument("--evict-first", help="v4pool.vllm: kinds the tier evicts first (c: checkpoints, "
                    "'': plain LRU; default per layout: c on V4.1, '' on V4)")
    ap.add_argument("--preset", default="h200x4-flash-fp8", help="v4pool.StepCost preset")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    recs = [json.loads(x) for x in open(args.trace)][: args.requests]
    skipped = sum(r["input_length"] >= MAX_LEN for r in recs)
    recs = [r for r in recs if r["input_length"] < MAX_LEN]
    hit, total = ceiling(recs)
    cost = v4pool.StepCost.preset(args.preset)
    runs = args.runs.split(",")
    print(f"# {len(recs)} requests ({skipped} longer than {MAX_LEN} left out), {total:,} prompt tokens, "
          f"{sum(r['output_length'] for r in recs):,} output tokens; ceiling (infinite cache): {hit:,} "
          f"({hit / total:.3f}); step cost {cost.name} ({cost.gpus} GPUs per engine)")

    def single(rec, engines):
        return 0

    def affinity(rec, engines):
        # Every request shares block 0 (a system prompt): route by the first block after it.
        ids = rec["hash_ids"]
        return ids[1] % len(engines) if len(ids) > 1 else 0

    def least_loaded(rec, engines):
        return min(range(len(engines)), key=lambda i: (engines[i].load(), engines[i].clock))

    results = {}
    for model in args.models.split(","):
        hbm = args.hbm or HBM[model]
        tier = args.tier or TIER[model]

        def engine(kind, tier_bytes=tier, **kw):
            return Engine(model, kind, args, hbm, tier_bytes, **kw)

        plan = []
        if "a" in runs:
            plan.append(("(a) vLLM alone", lambda: [engine("none", 0)], single))
        if "b" in runs:
            plan.append(("(b) vLLM + OffloadingConnector (CPU)", lambda: [engine("offload")], single))
        if "c" in runs:
            plan.append(("(c) vLLM + v4pool.vllm host tier", lambda: [engine("v4pool")], single))
        if "cx" in runs and model == "v41-flash":
            plan.append(("(c'') v4pool.vllm, exact hits only (no replay_fallback)",
                         lambda: [engine("v4pool", replay_fallback=False)], single))
        if "c0" in runs:
            plan.append(("(c') v4pool.vllm, no branch_every",
                         lambda: [engine("v4pool", branch_every=0)], single))
        if "d" in runs:
            N = args.fleet
            for rname, route in (("affinity", affinity), ("least-loaded", least_loaded)):
                plan.append((f"(d) fleet of {N}, {rname}, per-engine tiers",
                             lambda: [engine("v4pool", tier // N) for _ in range(N)], route))
                shared = f"shared-{model}-{rname}"
                plan.append((f"(d) fleet of {N}, {rname}, one shared tier",
                             lambda shared=shared: [engine("v4pool", shared=shared) for _ in range(N)],
                             route))
        rows = []
        for name, make, route in plan:
            t0 = time.time()
            r = run(make(), recs, route, cost)
            r["cpu_s"] = round(time.time() - t0, 1)
            rows.append((name, r))
            print(f"# {model} {name}: {r['cpu_s']} s", flush=True)
        results[model] = {"hbm": hbm, "tier": tier, "rows": rows}
        print(f"\n## {model}: HBM {hbm / 2**30:g} GiB per engine, tier {tier / 2**30:g} GiB\n")
        print("| run | prompt tokens from cache | of ceiling | from HBM | from tier | replayed after tier / HBM hits | "
              "tier GiB written | tier B written / tier token | TTFT p50 / p90 (s) | tok/s/GPU busy |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in rows:
            st, tt = r["stats"], r["ttft"]
            c, ext = st.get("cached", 0), st.get("external", 0)
            tw = st.get("tier_written", 0)
            p50 = statistics.median(tt) / 1e3 if tt else 0
            p90 = tt[int(0.9 * (len(tt) - 1))] / 1e3 if tt else 0
            # Tokens (prompt and output) per second the engines were busy, per GPU: what
            # they would serve saturated with this mix (arrivals, not capacity, set the
            # open loop's rate).
            thr = (st.get("prompt", 0) + st.get("output", 0)) / (st["busy_ms"] / 1e3) / cost.gpus
            print(f"| {name} | {c:,} ({c / total:.3f}) | {c / max(hit, 1):.2f} | {st.get('local', 0):,} | "
                  f"{ext:,} | {st.get('replayed_tier', 0):,} / {st.get('replayed_hbm', 0):,} | {tw / 2**30:.1f} | "
                  f"{(tw / ext) if ext else 0:,.0f} | {p50:.2f} / {p90:.2f} | {thr:.0f} |")
        print()
        for name, r in rows:
            print(f"# hit lengths ({name}; 4,096-token buckets: requests): {r['hist']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({m: dict(v, rows=[(n, {k: x for k, x in r.items() if k != "ttft"}) for n, r in v["rows"]])
                       for m, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
