"""v4pool.hf with its KvManager in the loop, as an engine's scheduler drives it: a prefix hit
restored from a checkpoint, a preemption mid-decode and its resumption, a handoff between two
pools. Each must produce exactly what the same request produces without it (bf16 pool:
identical tokens and bit-identical logits), so the test compares against a fresh engine that
runs the request straight through with the same batch composition (one request) and the same
prefill chunk boundaries (chunk 256 divides the block size, so a hit at a block boundary
starts where the uncached run's chunk starts; tokens recomputed after a preemption, decoded
one at a time before, are recomputed one at a time): on CPUs whose matrix kernels round by the
matrix's height, other boundaries round otherwise."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import v4pool.hf as hf  # noqa: E402
from test_hf_pool import BACKEND, prompts_of, tiny  # noqa: E402

KW = dict(dtype="bf16", budget="96MiB", max_seqs=2, max_context=1024, chunk=256, backend=BACKEND)


@pytest.fixture(scope="module")
def model():
    return tiny(index_topk=16)


def straight(model, prompt, steps):
    """The request alone on a fresh engine, no cache hit, no preemption."""
    return hf.attach(model, **KW).generate([prompt], steps)[0]


def same(got, want):
    assert got[0] == want[0], "tokens differ"
    assert torch.equal(got[1], want[1]), f"logits differ by {(got[1] - want[1]).abs().max().item()}"


def test_prefix_hit_is_exact(model):
    base = prompts_of([700], seed=3)[0]
    first, second = base[:600], base[:512] + prompts_of([90], seed=4)[0]
    eng = hf.attach(model, **KW)
    eng.generate([first], 4)
    before = eng.manager.stats()
    got = eng.generate([second], 12)[0]
    after = eng.manager.stats()
    # The first request's checkpoint at its prompt's last block boundary (512) served the hit.
    assert after["hits"] - before["hits"] == 1
    assert after["hit_tokens"] - before["hit_tokens"] == 512
    assert after["restores"] - before["restores"] == 1
    eng.manager.check_invariants()
    same(got, straight(model, second, 12))


def test_preempted_mid_decode_and_resumed_is_exact(model):
    prompt = prompts_of([500], seed=5)[0]
    eng = hf.attach(model, **KW)
    r = eng.add(prompt)
    while r.generated < 18:  # decode crosses the block boundary at 512: a rolling checkpoint
        eng.step([r])
    assert r.computed == 517
    eng.preempt(r)
    # Another request takes the freed slot meanwhile (its ring and state are overwritten).
    other = eng.add(prompts_of([300], seed=6)[0])
    eng.run([other], 3)
    eng.finish(other)
    assert eng.admit(r) == 512  # the rolling checkpoint at the last block boundary
    # The five tokens past the hit are recomputed by the prefill path, then decode goes on.
    # One token a chunk: the straight run decoded them one at a time, and a five-row chunk
    # is the same arithmetic only on CPUs whose kernels round a five-row matrix product as
    # five one-row ones (the H200 host's Xeon does not: 0.037 of a logit apart).
    eng.run([r], 32, chunk=1)
    got = (r.tokens[len(prompt):], torch.stack(r.logits))
    eng.finish(r)
    eng.manager.check_invariants()
    same(got, straight(model, prompt, 32))


def test_handoff_between_two_pools_is_exact(model):
    prompt = prompts_of([300], seed=7)[0]
    sender = hf.attach(model, **KW)
    receiver = hf.attach(model, manager=False, **KW)
    r = sender.add(prompt)
    sender.run([r], 10)
    free = receiver.pool.counts()["free_blocks"]
    moved = sender.handoff(r, receiver)
    assert receiver.pool.counts()["free_blocks"] == free - 2  # 310 tokens: two blocks
    assert r.mid is None  # finished on the sender
    receiver.run([moved], 32)
    got = (moved.tokens[len(prompt):], torch.stack(moved.logits))
    receiver.finish(moved)
    assert receiver.pool.counts()["free_blocks"] == free
    same(got, straight(model, prompt, 32))


def test_handoff_refuses_a_waiting_request(model):
    eng = hf.attach(model, **KW)
    other = hf.attach(model, manager=False, **KW)
    r = eng.add(prompts_of([20], seed=8)[0])
    eng.preempt(r)
    with pytest.raises(hf.v4pool.V4PoolError, match="not running"):
        eng.handoff(r, other)
    eng.finish(r)
