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

# The mock model's page writes and the connector's copies are tens of KiB each: one thread.
# (With torch's default of one OpenMP thread per core, each such copy took ~20 ms instead
# of ~10 us on a 2-core machine other jobs were loading: the suite ran 4 minutes.)
torch.set_num_threads(1)


def _scheduler(model, tier, extra=None, **kw):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    cfg = L.vllm_config(model, connector_extra={"host_dir": str(tier), "host_bytes": 1 << 34,
                                                      "branch_every": 256, **(extra or {})}, **kw)
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


def _step(s, w, gen, written, after_forward=None):
    """One engine step with a mock model: every scheduled token's pages are written with
    fresh random bytes (what the model would write), then the connector saves/loads;
    ``after_forward()`` runs then, before the scheduler takes the step's output (which may
    free a finished request's blocks)."""
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
    if after_forward is not None:
        after_forward()
    sending, _ = w.get_finished(set())
    s.last_sending = sending
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


def _run_a_then_b(model, tier, *, corrupt=False, extra=None):
    """Request A computed and saved; the prefix cache reset; then, scheduled in one step,
    D = A's first 600 tokens + a suffix (V4.1; two whole blocks, no checkpoint), C = A's first 800
    tokens + another (it hits the checkpoint A's prefill took inside its chunk at its
    prompt's last block boundary, 768: branch_every) and B = A's prompt + an unaligned
    suffix (it hits C's first 768 tokens in vLLM's own prefix cache, C's blocks loaded in
    the same step, and the rest, to 845, from the tier). Returns what the assertions need."""
    cfg, kcfg, s = _scheduler(model, tier, extra)
    w, kv = _worker(cfg, kcfg)
    conn = s.connector
    assert type(conn).__name__ == "V4PoolConnector"
    gen = torch.Generator().manual_seed(1)
    B = conn.layout.block
    prompt_a = torch.randint(1, 100000, (3 * B + 77,), generator=gen).tolist()
    a = _request(s, "A", prompt_a)
    s.add_request(a)
    written = set()
    snaps = {}

    def after_forward():
        # A's pages as its prefill leaves them, at its end and at its branch checkpoint.
        if not snaps and s.requests["A"].num_computed_tokens == len(prompt_a):
            ids = s.kv_cache_manager.get_block_ids("A")
            snaps[len(prompt_a)] = _snapshot(w, ids, conn.layout, len(prompt_a))
            snaps[3 * B] = _snapshot(w, ids, conn.layout, 3 * B)

    for _ in range(20):
        _step(s, w, gen, written, after_forward)
        if not s.requests and not s.has_unfinished_requests():
            break
    assert snaps, "request A never finished its prefill"
    # async_save: A's entries reach the files after its steps (the scheduler finds them there).
    assert w.wait_published(60)
    snap, snap_branch = snaps[len(prompt_a)], snaps[3 * B]
    assert s.reset_prefix_cache()
    # D (V4.1) shares A's first 600 tokens: two whole blocks, no checkpoint at or below 599.
    # (V4 cannot serve it: D would compute those blocks in the step C and B read them.)
    prompt_d = prompt_a[:600] + torch.randint(1, 100000, (20,), generator=gen).tolist()
    d = _request(s, "D", prompt_d)
    if model == "v41-flash":
        s.add_request(d)
    prompt_c = prompt_a[:800] + torch.randint(1, 100000, (30,), generator=gen).tolist()
    c = _request(s, "C", prompt_c)
    s.add_request(c)
    prompt_b = prompt_a + torch.randint(1, 100000, (45,), generator=gen).tolist()
    b = _request(s, "B", prompt_b)
    s.add_request(b)
    if corrupt:
        # Checkpoint entries are the files named c…; a shard folder may be named c… too.
        for f in (f for f in Path(tier).rglob("c*") if f.is_file()):
            raw = bytearray(f.read_bytes())
            raw[-3] ^= 0x40
            f.write_bytes(bytes(raw))
        # A worker that did not write A (another process, or one restarted): its host ring
        # is empty, so B's entries come from the files.
        w, _ = _worker(cfg, kcfg, kv)
    out = s.schedule()
    return dict(s=s, w=w, conn=conn, out=out, a=prompt_a, b=prompt_b, req=b, snap=snap,
                c=prompt_c, req_c=c, snap_branch=snap_branch, d=prompt_d, req_d=d,
                events=list(s.published), cfg=cfg, kcfg=kcfg, kv=kv)


@pytest.mark.parametrize("model,async_save", [("v4-flash", True), ("v41-flash", True),
                                              ("v41-flash", False)])
def test_prefix_restores_exactly(model, async_save, tmp_path):
    r = _run_a_then_b(model, tmp_path / "tier", extra={"async_save": async_save})
    assert (r["w"]._mover.publisher is not None) == async_save
    s, w, conn, out, prompt_a, prompt_b, b, snap = (r[k] for k in ("s", "w", "conn", "out", "a", "b", "req", "snap"))
    # V4.1: vLLM's scheduler would replay the hit's last window (SWA bounded replay) unless
    # the load carries it; V4 has nothing to replay.
    assert s.prefix_replay_tokens == (128 if model == "v41-flash" else 0)
    assert out.num_scheduled_tokens["B"] == len(prompt_b) - len(prompt_a)
    assert b.num_computed_tokens - out.num_scheduled_tokens["B"] == len(prompt_a)
    assert b.replay_start == 0
    st = b.prefill_stats
    assert (st.num_local_cached_tokens, st.num_external_cached_tokens) == (768, 77)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    assert not w.get_block_ids_with_load_errors()
    ids_b = s.kv_cache_manager.get_block_ids("B")
    got = _snapshot(w, ids_b, conn.layout, len(prompt_a))
    # Every group is in the comparison: compressed, indexer, windows, state / ring.
    assert {k[0] for k in snap} == {g.idx for g in conn.layout.groups}
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

    # C: restored at 768, a block multiple inside A's one prefill chunk, exactly. No
    # compressor group is open there: the checkpoint carries neither the V4.1 ring nor the
    # V4 ratio-128 state, and of the ratio-4 state only the 4 rows before it (the group
    # the next compressed entry overlaps).
    c, snap_branch = r["req_c"], r["snap_branch"]
    assert out.num_scheduled_tokens["C"] == len(r["c"]) - 768 and c.replay_start == 0
    assert c.num_computed_tokens - out.num_scheduled_tokens["C"] == 768
    rings = {g.idx for g in conn.layout.groups if g.role == "ring"}
    assert bool(rings) == (model == "v41-flash")
    states = {g.ratio: g for g in conn.layout.groups if g.role == "state"}
    assert sorted(states) == ([] if rings else [4, 128])
    assert {k[0] for k in snap_branch} == ({g.idx for g in conn.layout.groups} - rings
                                           - {g.idx for g in states.values() if g.ratio == 128})
    if states:
        assert {k[1] for k in snap_branch if k[0] == states[4].idx} == {767 // 4}

    # D (V4.1): no checkpoint ends its run of two whole blocks; the connector takes the
    # blocks and vLLM replays the window after them, as after a hit in its own cache
    # (replay_fallback): 512 - 128 tokens served, the blocks restored exactly.
    if model == "v41-flash":
        d = r["req_d"]
        assert out.num_scheduled_tokens["D"] == len(r["d"]) - (512 - 128)
        assert d.replay_start == 512 - 128
        full = [g for g in conn.layout.groups if g.role == "full"]
        assert conn.get_loaded_kv_cache_group_ids(d) == tuple(g.idx for g in full)
        got = _snapshot(w, s.kv_cache_manager.get_block_ids("D"), conn.layout, 512)
        for k, v in snap.items():
            if k[0] in {g.idx for g in full} and k[1] < 2:
                assert torch.equal(got[k], v), k
    got = _snapshot(w, s.kv_cache_manager.get_block_ids("C"), conn.layout, 768)
    assert got.keys() == snap_branch.keys()
    for k in snap_branch:
        assert torch.equal(got[k], snap_branch[k]), k

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


@pytest.mark.parametrize("order", ["c", ""])
def test_index_only_model_evicts_as_the_file_tier_does(order, tmp_path):
    """The bench's index-only tier (IndexOnlyTiers) is the file tier's model: over one random
    sequence of puts, reads and refreshes of blocks ('b') and checkpoints ('c') of two sizes,
    under a random budget, both hold the same keys after every step, checkpoints evicted
    first (``evict_first="c"``, V4.1's order) or one LRU (V4's). The budget is small enough
    that the file tier scans often, each scan over budget evicting down to its low water
    (``EntryTier.sweep_rule``), so several entries go at once."""
    import random
    import time

    import v4pool
    from v4pool.vllm import IndexOnlyTiers

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    layout = "evict-order-test"
    body = {"b": rng.randrange(20_000, 40_000), "c": rng.randrange(60_000, 120_000)}
    entry = {k: 80 + len(layout) + n for k, n in body.items()}  # a file: header, layout, body
    budget = rng.randrange(5, 12) * entry["b"] + rng.randrange(0, 2) * entry["c"]
    tier = v4pool.EntryTier(str(tmp_path), layout, budget, evict_first=order)
    model = IndexOnlyTiers(budget, evict_first=order)
    keys = [(k, h) for k, n in (("b", 10), ("c", 5)) for h in range(n)]
    for step in range(60):
        kind, key = rng.choice(keys)
        r = rng.random()
        if r < 0.55:
            if model.where(kind, key) is None:  # the connector saves only what is absent
                tier.put(kind, key, [torch.randint(0, 256, (body[kind],), dtype=torch.uint8)])
                model.add(kind, key, entry[kind])
        elif r < 0.8:
            if tier.get_into(kind, key, torch.empty(body[kind], dtype=torch.uint8)):
                model.touch(kind, key)
        else:  # a finished request's path, in order (absent keys skipped by both)
            path = rng.sample(keys, rng.randrange(1, 6))
            tier.refresh(path)
            model.refresh(path)
        held = {k for k in keys if tier.contains(*k)}
        assert held == set(model.store), (
            f"seed {seed} step {step}: file tier {sorted(held)}, model {sorted(model.store)}")
        time.sleep(0.02)  # distinct mtimes: the file tier's clock


def test_finished_request_refreshes_its_path_head_last(tmp_path):
    """When a request finishes, the worker refreshes its whole path in the tier after its
    saves: deepest entry first, so its head is the most recently used (evicted last) and its
    tail the first to go, as vLLM's offload LRU ranks a request's blocks. Written in order
    (no refresh), the head block would be the oldest."""
    cfg, kcfg, s = _scheduler("v41-flash", tmp_path)
    w, _ = _worker(cfg, kcfg)
    conn = s.connector
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B = conn.layout.block
    prompt = torch.randint(1, 100000, (3 * B + 77,), generator=gen).tolist()
    s.add_request(_request(s, "A", prompt))
    written = set()
    for _ in range(20):
        _step(s, w, gen, written)
        if not s.requests and not s.has_unfinished_requests():
            break
    _step(s, w, gen, written)  # the step after the finish carries the refresh
    assert w.wait_published(60)
    hashes = conn._hashes(prompt[: 3 * B])
    tier = conn.tiers.tiers[0][1]
    root = Path(tier.layout_dir())
    # Deepest first: the checkpoints at 845 and 768 (branch_every), then blocks 2, 1, 0.
    order = [("c", conn._tail_key(prompt, 3, 77, hashes)), ("c", conn._tail_key(prompt, 3, 0, hashes))]
    order += [("b", h) for h in reversed(hashes)]
    mtimes = [(root / f"{h >> 120:02x}" / f"{k}{h:032x}").stat().st_mtime_ns for k, h in order]
    assert mtimes == sorted(mtimes) and len(set(mtimes)) == len(mtimes), mtimes


@pytest.mark.parametrize("model", ["v4-flash", "v41-flash"])
def test_index_only_tier_charges_what_the_worker_writes(model):
    """The bench's index-only tier charges each entry the body a worker would write: a whole
    block of the compressed groups and a checkpoint at a random position, both equal to the
    worker's body length for the same plan (the scheduler's KVCacheConfig has one
    representative page per group; V4.1's compressed group is 460,224 B a block on the
    worker, 599,040 B at the representative's page)."""
    import random

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from v4pool.vllm import V4PoolConnector, worker_layer_pages

    cfg = L.vllm_config(model, connector_extra={"bench_index_only": True})
    kcfg = L.kv_cache_config(cfg)
    w, _ = _worker(cfg, kcfg)
    cfg.kv_transfer_config.kv_connector_extra_config["bench_layer_pages"] = worker_layer_pages(cfg, kcfg)
    sched = V4PoolConnector(cfg, KVConnectorRole.SCHEDULER, generate_scheduler_kv_cache_config([kcfg]))
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    lay = sched.layout
    pos = rng.randrange(lay.block, 8 * lay.block)
    block = [(g.idx, [rng.randrange(1, kcfg.num_blocks) for _ in lay.block_span(g, 0, lay.block)])
             for g in lay.groups if g.role == "full"]
    ckpt = [(g.idx, [rng.randrange(1, kcfg.num_blocks) for _ in lay.checkpoint_span(g, pos)])
            for g in lay.groups]
    for plan in (block, ckpt):
        assert lay.bytes_of(plan) == w._mover.copier.body_len(plan)


def test_eviction_order_is_per_layout():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from v4pool.vllm import V4PoolConnector, evict_first_of

    got = {}
    for model in ("v4-flash", "v41-flash"):
        cfg = L.vllm_config(model, connector_extra={"bench_index_only": True})
        c = V4PoolConnector(cfg, KVConnectorRole.SCHEDULER, L.kv_cache_config(cfg))
        got[model] = (c.tiers.evict_first, evict_first_of(c.layout, {"replay_fallback": False}))
    # V4 has no replay: its block runs need their checkpoints (one LRU). V4.1 replays after a
    # block run, so its checkpoints go first, unless replay_fallback is off.
    assert got == {"v4-flash": ("", ""), "v41-flash": ("c", "")}


class _Gate:
    """A device-to-host copy still in flight, for the tests: what ``SlabCopier.to_host_async``
    returns on CUDA (an event), done when ``open`` is set."""

    def __init__(self, open_: "threading.Event"):
        self.open = open_

    def query(self):
        return self.open.is_set()

    def synchronize(self):
        assert self.open.wait(60), "copies never done"


def _held(s, rid):
    """Whether the scheduler still holds ``rid``'s blocks (a finished request delay-freed)."""
    return rid in s.requests and any(s.kv_cache_manager.get_block_ids(rid))


def test_async_save_holds_blocks_until_copies_done(tmp_path):
    """async_save: a request whose saves were planned in its last step (max_tokens=1: no save at
    finish) is held by the scheduler until the worker reports its device-to-host copies done,
    never before; the step does not wait for the files (a publish made slow here); the entries
    wait in the ring, held from overwriting, until published; then a new request restores
    A's prefix from the files byte-exact. (On main, the finished request's blocks were freed
    at once: its saves were synchronous.)"""
    import threading
    import time

    cfg, kcfg, s = _scheduler("v4-flash", tmp_path / "tier", {"async_save": True})
    w, _ = _worker(cfg, kcfg)
    conn = s.connector
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B = conn.layout.block
    copied, published = threading.Event(), threading.Event()
    orig_copy = w._mover.copier.to_host_async

    def copy_in_flight(copies):  # v4pool's own copy: done when the test says so
        assert orig_copy(copies) is None  # the CPU: a memcpy, done inline
        return _Gate(copied)

    w._mover.copier.to_host_async = copy_in_flight
    puts = []
    orig_put = w.tiers.put

    def slow_put(kind, key, parts):  # v4pool's own tier write, slow
        assert published.wait(60)
        puts.append((kind, key))
        return orig_put(kind, key, parts)

    w.tiers.put = slow_put
    prompt = torch.randint(1, 100000, (3 * B + 77,), generator=gen).tolist()
    s.add_request(_request(s, "A", prompt, max_tokens=1))
    snap = {}

    def after_forward():
        snap.update(_snapshot(w, s.kv_cache_manager.get_block_ids("A"), conn.layout, len(prompt)))

    t0 = time.monotonic()
    _step(s, w, gen, set(), after_forward)  # A's prefill, its saves, its one token: finished
    assert time.monotonic() - t0 < 30 and not puts  # the step did not wait for the files
    assert _held(s, "A"), "A's blocks freed under its copies"
    assert s.requests["A"].is_finished() and conn.has_pending_block_frees()
    for _ in range(2):  # steps with nothing to schedule: A stays held while its copies run
        _step(s, w, gen, set())
        assert not s.last_sending and _held(s, "A")
    copied.set()
    _step(s, w, gen, set())
    assert s.last_sending == {"A"} and "A" not in s.requests
    assert not conn.has_pending_block_frees()  # vLLM may preempt again when out of blocks
    # Reported, not yet published: the entries wait in the ring, none in the files.
    ring = w._mover.ring
    waiting = set(ring.publishing)
    assert waiting and all(ring.lookup(*k) for k in waiting) and not puts
    assert all(ring.reserve(k, 1, ring.capacity) is None for k in "bc")  # would overwrite them
    published.set()
    assert w.wait_published(60)
    assert not ring.publishing and {k for k in puts if k[0] != "i"} == waiting
    # A new request finds A's prefix in the files and gets its bytes back.
    assert s.reset_prefix_cache()
    s.add_request(_request(s, "B", prompt + [11, 12, 13]))
    out = s.schedule()
    assert out.num_scheduled_tokens["B"] == 3
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    assert not w.get_block_ids_with_load_errors()
    got = _snapshot(w, s.kv_cache_manager.get_block_ids("B"), conn.layout, len(prompt))
    assert got.keys() == snap.keys() and snap
    for k in snap:
        assert torch.equal(got[k], snap[k]), k


def test_async_publish_failure_is_a_miss(tmp_path):
    """A publish that raises in the background (v4pool's tier write failing) costs the entry,
    nothing else: no exception reaches vLLM's step, the request is reported and freed, a later
    request with the same prefix misses and is served by computing it. (On main the exception
    was raised out of wait_for_save, into vLLM's step.)"""
    cfg, kcfg, s = _scheduler("v4-flash", tmp_path / "tier", {"async_save": True})
    w, _ = _worker(cfg, kcfg)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B = s.connector.layout.block

    def failing_put(kind, key, parts):
        raise OSError("disk full (test)")

    w.tiers.put = failing_put
    prompt = torch.randint(1, 100000, (2 * B + 31,), generator=gen).tolist()
    s.add_request(_request(s, "A", prompt, max_tokens=3))
    for _ in range(10):
        _step(s, w, gen, set())
        if not s.requests:
            break
    assert not s.requests  # finished, reported, freed
    assert w.wait_published(60)
    assert w._mover.stats["publish_failed"] > 0 and w._mover.publisher.errors == 0
    assert s.reset_prefix_cache()
    s.add_request(_request(s, "B", prompt + [5, 6]))
    out = _step(s, w, gen, set())
    assert out.num_scheduled_tokens["B"] == len(prompt) + 2  # a miss: all of it computed
    for _ in range(5):
        _step(s, w, gen, set())
        if not s.requests:
            break
    assert not s.requests


def test_shutdown_bounds_a_stuck_publish(tmp_path, monkeypatch):
    """shutdown() waits for a publish stuck in the tier's write at most CLOSE_TIMEOUT_S, and
    the thread is a daemon (it never keeps the process alive)."""
    import threading
    import time

    import v4pool.vllm as V

    cfg, kcfg, _ = _scheduler("v4-flash", tmp_path / "tier", {"async_save": True})
    w, _ = _worker(cfg, kcfg)
    stuck = threading.Event()
    w.tiers.put = lambda kind, key, parts: stuck.wait(60)
    w._mover.save_async([("b", 1, [(0, [1])])])
    monkeypatch.setattr(V, "CLOSE_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 5
    t = w._mover.publisher._thread
    assert t.daemon and t.is_alive()
    stuck.set()
    t.join(10)
    assert not t.is_alive()


def test_ring_keeps_publishing_entries():
    """HostRing.reserve never places an entry over one a publish has yet to read (nor drops
    it), over random sizes and wraps; once published, it may be overwritten."""
    import random

    from v4pool.vllm_copy import HostRing

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    ring = HostRing(rng.randrange(1000, 5000), pin=False)
    for step in range(400):
        n = rng.randrange(1, ring.capacity // 3)
        key = ("b", step)
        off = ring.reserve(*key, n)
        if off is not None and rng.random() < 0.3:
            ring.publishing.add(key)
        for k in list(ring.publishing):
            assert ring.lookup(*k) is not None, f"seed {seed} step {step}: {k} evicted"
            ring.drop(*k)
            assert ring.lookup(*k) is not None, f"seed {seed} step {step}: {k} dropped"
            if off is not None and k != key:
                o, m = ring.lookup(*k)
                assert off + n <= o or o + m <= off, f"seed {seed} step {step}: overlap"
            if rng.random() < 0.2:
                ring.publishing.discard(k)


def test_async_save_of_a_bad_plan_is_not_made(tmp_path):
    """A plan naming a block outside vLLM's allocation is not saved (logged), nothing raised into
    the step; the rest of the batch is published and the ring keeps no entry for it."""
    cfg, kcfg, _ = _scheduler("v4-flash", tmp_path / "tier", {"async_save": True})
    w, _ = _worker(cfg, kcfg)
    nb = w._mover.copier.num_blocks
    done = []
    w._mover.save_async([("b", 1, [(0, [1])]), ("b", 2, [(0, [nb + 5])]), ("b", 3, [(0, [2])])],
                        done.extend)
    assert w.wait_published(60) and done == [True, False, True]
    w._mover.load([])  # the caller's thread forgets the entry that was not made
    ring = w._mover.ring
    assert ring.lookup("b", 2) is None and not ring.publishing
    assert ring.lookup("b", 1) and ring.lookup("b", 3)
