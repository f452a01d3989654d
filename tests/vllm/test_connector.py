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
    # What the scheduler publishes (vLLM's KVEventBatch of its own and the connector's
    # events), kept instead of sent: the publisher is vLLM's null one here.
    s.published = []
    s.kv_event_publisher.publish = s.published.append
    return cfg, kcfg, s


def _worker(cfg, kcfg, kv=None):
    """A worker-role connector over ``kv`` (default: newly allocated KV tensors)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from v4pool.vllm import V4PoolConnector

    kv = L.allocate(cfg, kcfg) if kv is None else kv
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


def _run_a_then_b(model, tier, *, corrupt=False):
    """Request A computed and saved; the prefix cache reset; B = A's prompt + an unaligned
    suffix scheduled. Returns what the assertions need."""
    cfg, kcfg, s = _scheduler(model, tier)
    w, kv = _worker(cfg, kcfg)
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
    assert s.reset_prefix_cache()
    # B: A's prompt + an unaligned suffix.
    prompt_b = prompt_a + torch.randint(1, 100000, (45,), generator=gen).tolist()
    b = _request(s, "B", prompt_b)
    s.add_request(b)
    if corrupt:
        for f in Path(tier).rglob("c*"):
            raw = bytearray(f.read_bytes())
            raw[-3] ^= 0x40
            f.write_bytes(bytes(raw))
        # A worker that did not write A (another process, or one restarted): its host ring
        # is empty, so B's entries come from the files.
        w, _ = _worker(cfg, kcfg, kv)
    out = s.schedule()
    return dict(s=s, w=w, conn=conn, out=out, a=prompt_a, b=prompt_b, req=b, snap=snap,
                events=list(s.published), cfg=cfg, kcfg=kcfg, kv=kv)


@pytest.mark.parametrize("model", ["v4-flash"])
def test_prefix_restores_exactly(model, tmp_path):
    r = _run_a_then_b(model, tmp_path / "tier")
    s, w, conn, out, prompt_a, prompt_b, b, snap = (r[k] for k in ("s", "w", "conn", "out", "a", "b", "req", "snap"))
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
    # Again from the files alone, into B's pages poisoned: a worker that did not write A
    # (its host ring is empty) reads every entry from the tier directory.
    for g_idx, b_idx, name in snap:
        w._pages[name][ids_b[g_idx][b_idx]].fill_(0xA5)
    w2, _ = _worker(r["cfg"], r["kcfg"], r["kv"])
    w2.bind_connector_metadata(out.kv_connector_metadata)
    w2.start_load_kv(None)
    assert not w2.get_block_ids_with_load_errors()
    got = _snapshot(w2, ids_b, conn.layout, len(prompt_a))
    for k in snap:
        assert torch.equal(got[k], snap[k]), k

    # The events, through vLLM's own wire format and classes.
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    stored = []
    for batch in r["events"]:
        wire = msgspec.msgpack.Encoder().encode(batch)
        back = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire)
        stored += [e for e in back.events if isinstance(e, BlockStored) and e.medium == "cpu"]
    full_groups = [g.idx for g in conn.layout.groups if g.role == "full"]
    assert stored and {e.group_idx for e in stored} == set(full_groups)
    assert all(e.kv_cache_spec_kind for e in stored)
    assert len(stored) == len(full_groups) * (len(prompt_a) // conn.layout.block)


def test_corrupt_entry_is_a_miss(tmp_path):
    r = _run_a_then_b("v4-flash", tmp_path / "tier", corrupt=True)
    out, w = r["out"], r["w"]
    # The scheduler saw a file and counted the hit; the worker's read fails its checksum:
    # nothing is written, the blocks are reported for recomputation.
    w.bind_connector_metadata(out.kv_connector_metadata)
    before = {k: v.clone() for k, v in _snapshot(w, r["s"].kv_cache_manager.get_block_ids("B"), r["conn"].layout, len(r["a"])).items()}
    w.start_load_kv(None)
    errs = w.get_block_ids_with_load_errors()
    assert errs
    after = _snapshot(w, r["s"].kv_cache_manager.get_block_ids("B"), r["conn"].layout, len(r["a"]))
    ckpt_blocks = set()
    for tr in out.kv_connector_metadata.loads:
        if tr.kind == "c":
            ckpt_blocks |= {(gi, b) for gi, ids in tr.blocks for b in ids}
    for k, v in before.items():
        gi = k[0]
        bid = r["s"].kv_cache_manager.get_block_ids("B")[gi][k[1]]
        if (gi, bid) in ckpt_blocks:
            assert torch.equal(after[k], v), "a corrupt entry wrote into vLLM's cache"


def test_unknown_layout_is_refused(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from v4pool.vllm import UnsupportedLayout, V4PoolConnector

    cfg = L.vllm_config("v4-flash", connector_extra={"host_dir": str(tmp_path)})
    kcfg = L.kv_cache_config(cfg)
    bad = KVCacheConfig(num_blocks=kcfg.num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=list(kcfg.kv_cache_groups) + [
                            KVCacheGroupSpec(["mamba"], MambaSpec(block_size=256, shapes=((4,),),
                                                                  dtypes=(torch.float32,)))])
    with pytest.raises(UnsupportedLayout, match=r"group 5 has spec MambaSpec"):
        V4PoolConnector(cfg, KVConnectorRole.SCHEDULER, bad)


SECOND = r"""
import sys, json
sys.path.insert(0, sys.argv[1])
import dsv4_layout as L
from test_connector import _scheduler, _request
cfg, kcfg, s = _scheduler("v4-flash", sys.argv[2])
prompt = json.loads(sys.argv[3])
req = _request(s, "B2", prompt)
s.add_request(req)
out = s.schedule()
print(json.dumps({"scheduled": out.num_scheduled_tokens["B2"], "computed": req.num_computed_tokens}))
"""


def test_second_scheduler_process_hits_the_shared_directory(tmp_path):
    import json

    tier = tmp_path / "tier"
    r = _run_a_then_b("v4-flash", tier)
    prompt = r["a"] + [5, 6, 7]
    p = subprocess.run([sys.executable, "-c", SECOND, str(Path(__file__).parent), str(tier),
                        json.dumps(prompt)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["scheduled"] == 3 and got["computed"] == len(prompt)
