"""`v4pool.KvManager` on the host backend: a repeated prompt hits its cached prefix (restored
from the checkpoint), finished requests leave their blocks cached, the policies split the
pool, and refusals raise `V4PoolError` with the Rust variant's name."""

import numpy as np
import pytest

import v4pool

BUDGET = "256MiB"
RNG = np.random.default_rng(20261201)


@pytest.fixture(scope="module")
def plan():
    return v4pool.plan(model="v4-flash", budget=BUDGET, max_seqs=4)


@pytest.fixture()
def mgr(plan):
    m = v4pool.KvManager(v4pool.Pool(plan, backend="host"))
    yield m
    m.check_invariants()


def prompt(m, blocks, extra):
    return RNG.integers(0, 120_000, size=blocks * m.block_size + extra).tolist()


def prefill(m, rid):
    """Run a request's prefill the way a scheduler does: chunks up to `prefill_stop`."""
    while (n := m.prefill_stop(rid, 1 << 30)) > 0:
        m.allocate(rid, n)
        m.commit(rid, n)
        m.check_invariants()
    m.complete_inflight()


def raises(variant, call, *args, **kwargs):
    """`call` raises `V4PoolError` named `variant`; returns the error."""
    with pytest.raises(v4pool.V4PoolError) as e:
        call(*args, **kwargs)
    assert e.value.variant == variant, e.value
    return e.value


def test_the_same_prompt_twice_hits_and_finish_keeps_blocks(mgr):
    bs = mgr.block_size
    assert bs > 0 and mgr.policy == "elastic"
    tokens = prompt(mgr, 3, 5)
    a = mgr.add_request(tokens)
    assert mgr.slot_position(a) is None
    assert mgr.match_prefix(tokens) == 0
    assert mgr.admit(a) == 0
    assert isinstance(mgr.slot_position(a), int)
    prefill(mgr, a)
    assert mgr.computed_tokens(a) == len(tokens)
    table_a = mgr.block_table(a)
    assert len(table_a) == 4 and len(set(table_a)) == 4
    mgr.finish(a)
    s = mgr.stats()
    assert s["cached_blocks"] == 3  # the full prompt blocks; the partial one is freed
    assert s["checkpoints_stored"] >= 1 and mgr.checkpoint_bytes_held() > 0
    mgr.check_invariants()

    assert mgr.match_prefix(tokens) == 3 * bs
    b = mgr.add_request(tokens)
    hit = mgr.admit(b)
    assert hit == 3 * bs and hit % bs == 0
    # The hit blocks are the first request's, referenced again.
    assert mgr.block_table(b) == table_a[:3]
    assert mgr.computed_tokens(b) == hit
    prefill(mgr, b)
    assert mgr.computed_tokens(b) == len(tokens)
    s = mgr.stats()
    assert s["admissions"] == 2 and s["hits"] == 1 and s["hit_tokens"] == 3 * bs
    assert s["restores"] == 1
    mgr.finish(b)
    assert mgr.stats()["cached_blocks"] == 3


def test_a_different_prompt_or_namespace_misses(plan, mgr):
    tokens = prompt(mgr, 2, 1)
    a = mgr.add_request(tokens)
    mgr.admit(a)
    prefill(mgr, a)
    mgr.finish(a)
    other = list(tokens)
    other[0] += 1  # the first block differs, so every chained hash does
    assert mgr.match_prefix(other) == 0
    assert mgr.match_prefix(tokens) == 2 * mgr.block_size
    h = mgr.block_hashes(tokens)
    assert len(h) == 2 and h[0] != h[1]
    bs = mgr.block_size
    assert mgr.block_hashes(tokens[bs : 2 * bs], parent=h[0]) == [h[1]]
    m2 = v4pool.KvManager(v4pool.Pool(plan, backend="host"), namespace="adapter-7")
    assert m2.block_hashes(tokens) != h


def test_preempt_keeps_committed_blocks_and_readmits_with_a_hit(mgr):
    bs = mgr.block_size
    tokens = prompt(mgr, 2, 3)
    a = mgr.add_request(tokens)
    mgr.admit(a)
    prefill(mgr, a)
    mgr.preempt(a)
    assert mgr.slot_position(a) is None
    assert mgr.admit(a) == 2 * bs
    mgr.rebalance()
    mgr.finish(a)


def test_extend_hashes_after_decode(mgr):
    bs = mgr.block_size
    tokens = prompt(mgr, 1, 0)
    a = mgr.add_request(tokens)
    mgr.admit(a)
    prefill(mgr, a)
    # Decode one more block's worth of tokens, then hand its hash over.
    gen = prompt(mgr, 1, 0)
    mgr.allocate(a, bs)
    mgr.commit(a, bs)
    parent = mgr.block_hashes(tokens)[-1]
    mgr.extend_hashes(a, mgr.block_hashes(gen, parent=parent))
    mgr.complete_inflight()
    mgr.finish(a)
    assert mgr.stats()["cached_blocks"] == 2


def test_fixed_policy_runs_out_of_slots(plan):
    m = v4pool.KvManager(v4pool.Pool(plan, backend="host"), policy="fixed", slots=2)
    assert m.policy == "fixed"
    ids = [m.add_request(prompt(m, 1, 1)) for _ in range(3)]
    m.admit(ids[0])
    m.admit(ids[1])
    raises("NoSlot", m.admit, ids[2])
    m.finish(ids[0])
    assert m.admit(ids[2]) == 0
    m.check_invariants()


def test_errors_carry_the_variant(plan, mgr):
    assert "no request" in raises("UnknownRequest", mgr.admit, 123456789).message
    for call in (mgr.block_table, mgr.finish, mgr.slot_position, mgr.computed_tokens):
        raises("UnknownRequest", call, 987654321)
    a = mgr.add_request(prompt(mgr, 1, 1))
    raises("NotRunning", mgr.allocate, a, 4)
    raises("NotRunning", mgr.preempt, a)
    mgr.admit(a)
    raises("AlreadyRunning", mgr.admit, a)
    raises("CommitPastAllocation", mgr.commit, a, 1)
    mgr.finish(a)
    # A finished id is retired: it names nothing any more.
    raises("UnknownRequest", mgr.finish, a)
    raises("UnknownRequest", mgr.extend_hashes, a, [1, 2])

    raises("UnknownPolicy", v4pool.KvManager, v4pool.Pool(plan, backend="host"), policy="greedy")
    busy = v4pool.Pool(plan, backend="host")
    busy.alloc_slot()
    raises("Config", v4pool.KvManager, busy)


def test_checkpoints_travel_between_managers(plan):
    """A checkpoint exported by one worker is imported by another that caches the block
    without one; afterwards the prefix up to that block hits there too."""
    m1 = v4pool.KvManager(v4pool.Pool(plan, backend="host"), checkpoint_every=1)
    m2 = v4pool.KvManager(v4pool.Pool(plan, backend="host"))
    bs = m1.block_size
    tokens = prompt(m1, 3, 5)
    for m in (m1, m2):
        rid = m.add_request(tokens)
        m.admit(rid)
        prefill(m, rid)
        m.finish(rid)
    h = m1.block_hashes(tokens)
    assert m1.match_prefix(tokens[:bs]) == bs
    assert m2.match_prefix(tokens[:bs]) == 0  # cached, but no checkpoint ends there
    layout, data = m1.export_checkpoint(h[0])
    assert len(data) > 0
    assert m2.import_checkpoint(h[0], layout, data) is True
    m2.complete_inflight()
    assert m2.match_prefix(tokens[:bs]) == bs
    assert m2.import_checkpoint(h[0], layout, data) is False
    m2.check_invariants()
    raises("NotCached", m1.export_checkpoint, 12345)
    raises("NotCached", m2.import_checkpoint, 12345, layout, data)
    raises("ForeignLayout", m2.import_checkpoint, h[1], layout + "x", data)


def test_defect43_row20_stats_has_every_field_of_the_rust_stats(mgr):
    """defect43 row 20: one stats schema across bindings. `KvManager.stats()` has exactly the
    fields of the Rust `ManagerStats` (read from its source in this checkout); it lacked
    `superseded_checkpoints`. (The C ABI has no manager, so no stats struct to compare.)"""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "manager" / "request.rs"
    body = re.search(r"pub struct ManagerStats \{(.*?)\n\}", src.read_text(), re.S).group(1)
    fields = re.findall(r"^\s*pub (\w+): u64,", body, re.M)
    assert len(fields) > 20, fields
    stats = mgr.stats()
    assert list(stats) == fields, (set(fields) - set(stats), set(stats) - set(fields))
    assert all(isinstance(v, int) for v in stats.values())
