"""v4pool.vllm against vLLM's real classes on CPU: the real Scheduler loads the connector
by module path; a worker-role connector in the same process moves bytes between CPU KV
tensors laid out by vLLM's own allocate_kv_cache and v4pool's entry tiers.

Run in the vLLM venv (ci/vllm-requirements.txt), not in tests/python's venv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dsv4_layout as L  # noqa: E402

import torch  # noqa: E402



def _scheduler(model, tier, **kw):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    cfg = L.vllm_config(model, connector_extra={"host_dir": str(tier), "host_bytes": 1 << 34}, **kw)
    kcfg = L.kv_cache_config(cfg)
    cfg.cache_config.num_gpu_blocks = kcfg.num_blocks
    block, hash_block = L.scheduler_blocks(cfg, kcfg)
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    s = Scheduler(vllm_config=cfg, kv_cache_config=generate_scheduler_kv_cache_config([kcfg]),
                  block_size=block, hash_block_size=hash_block,
                  log_stats=True, structured_output_manager=StructuredOutputManager(cfg))
    s.hash_block_size = hash_block
    return cfg, kcfg, s


def _worker(cfg, kcfg):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from v4pool.vllm import V4PoolConnector

    kv = L.allocate(cfg, kcfg)
    w = V4PoolConnector(cfg, KVConnectorRole.WORKER, kcfg)
    w.register_kv_caches(kv)
    return w, kv


def _request(s, rid, tokens, max_tokens=1):
    """A request as vLLM's own tests make one (its block hasher at the hash block)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 1)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None,
                   block_hasher=get_request_block_hasher(s.hash_block_size, sha256))


def _step(s, w, gen, written):
    """One engine step with a mock model: every scheduled token's pages are written with
    fresh random bytes (what the model would write), then the connector saves/loads."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = s.schedule()
    meta = out.kv_connector_metadata
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for rid, n in out.num_scheduled_tokens.items():
        req = s.requests[rid]
        ids = s.kv_cache_manager.get_block_ids(rid)
        for g in w.layout.groups:
            end = req.num_computed_tokens
            start = end - n
            span = range(start // g.block_size, -(-end // g.block_size)) if g.role != "ring" else range(1)
            for b in span:
                if b >= len(ids[g.idx]) or ids[g.idx][b] == 0:
                    continue
                bid = ids[g.idx][b]
                for name in g.layers:
                    page = w._pages[name][bid]
                    page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen))
                written.add((g.idx, bid))
    w.wait_for_save()
    sending, _ = w.get_finished(set())
    w.clear_connector_metadata()
    reqs = [r for r in out.num_scheduled_tokens]
    mro = ModelRunnerOutput(
        req_ids=reqs,
        sampled_token_ids=[[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else [] for r in reqs],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_sending=sending or set(), finished_recving=set()),
    )
    s.update_from_output(out, mro)
    return out


def _snapshot(w, ids, layout, pos):
    snap = {}
    for g in layout.groups:
        for b in layout.checkpoint_span(g, pos) if g.role != "full" else range(-(-pos // g.block_size)):
            if b < len(ids[g.idx]) and ids[g.idx][b] != 0:
                for name in g.layers:
                    snap[(g.idx, b, name)] = w._pages[name][ids[g.idx][b]].clone()
    return snap


@pytest.mark.parametrize("model", ["v4-flash"])
def test_prefix_restores_exactly(model, tmp_path):
    cfg, kcfg, s = _scheduler(model, tmp_path / "tier")
    w, _ = _worker(cfg, kcfg)
    conn = s.connector
    assert type(conn).__name__ == "V4PoolConnector"
    gen = torch.Generator().manual_seed(1)
    B = conn.layout.block
    prompt_a = torch.randint(1, 100000, (3 * B + 77,), generator=gen).tolist()
    a = _request(s, "A", prompt_a)
    s.add_request(a)
    written = set()
    snap = None
    for _ in range(20):
        out = _step(s, w, gen, written)
        if "A" in s.requests and s.requests["A"].num_computed_tokens == len(prompt_a) and snap is None:
            snap = _snapshot(w, s.kv_cache_manager.get_block_ids("A"), conn.layout, len(prompt_a))
        if not s.requests and not s.has_unfinished_requests():
            break
    assert snap, "request A never finished its prefill"
    print("DEBUG", conn.layout.layout_id == w.layout.layout_id, conn.layout.layout_id[:300], w.layout.layout_id[:300], conn.stats, [t.stats() for _, t in conn.tiers.tiers], [t.stats() for _, t in w.tiers.tiers], flush=True)
    assert s.reset_prefix_cache()
    # B: A's prompt + an unaligned suffix.
    prompt_b = prompt_a + torch.randint(1, 100000, (45,), generator=gen).tolist()
    b = _request(s, "B", prompt_b)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens["B"] == len(prompt_b) - len(prompt_a)
    assert b.num_computed_tokens - out.num_scheduled_tokens["B"] == len(prompt_a)
    assert getattr(b, "replay_start", 0) in (0, None)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    assert not w.get_block_ids_with_load_errors()
    ids_b = s.kv_cache_manager.get_block_ids("B")
    got = _snapshot(w, ids_b, conn.layout, len(prompt_a))
    assert got.keys() == snap.keys()
    for k in snap:
        assert torch.equal(got[k], snap[k]), k
