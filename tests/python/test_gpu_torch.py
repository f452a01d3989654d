"""The Python module on a CUDA device with PyTorch: views alias device memory, a torch
reference sparse attention over v4pool's decode index buffers equals dense attention over
the same keys, the index build and that attention captured in one CUDA graph and replayed
after boundary moves and new batches, and a pool over a torch-allocated tensor.

Skips (printing a SKIP line) without torch or CUDA; fails instead under
V4POOL_REQUIRE_GPU=1. On the H200: install the wheel with
`python3 -m pip install --no-index --no-deps --target /tmp/site .gpu/*.whl` and run
`PYTHONPATH=/tmp/site V4POOL_REQUIRE_GPU=1 python3 -m pytest -q tests/python/test_gpu_torch.py`.
"""

import os

import pytest

REQUIRE = os.environ.get("V4POOL_REQUIRE_GPU") == "1"


def _gpu_or_skip():
    try:
        import torch
    except ImportError:
        reason = "torch is not installed"
    else:
        if torch.cuda.is_available():
            return torch
        reason = "no CUDA device"
    if REQUIRE:
        pytest.fail(f"V4POOL_REQUIRE_GPU=1 but {reason}")
    print(f"SKIP test_gpu_torch: {reason}")
    pytest.skip(reason, allow_module_level=True)


torch = _gpu_or_skip()
import v4pool  # noqa: E402

WIN = 128
DIM = 512  # bf16 layout: one 1,024-byte plane, 512 bf16 per row


@pytest.fixture(scope="module")
def plan():
    return v4pool.plan(model="v4-flash", budget="2GiB", max_seqs=8, dtype="bf16")


@pytest.fixture(autouse=True)
def on_a_stream():
    """Every test runs on its own torch stream, which the pools also use."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        yield s
    torch.cuda.synchronize()


def make_pool(plan, **kw):
    return v4pool.Pool(plan, backend="cuda", device=0, stream=torch.cuda.current_stream(), **kw)


def layer_of(pool, ratio):
    return pool.ratios.index(ratio)


def test_views_alias_device_memory(plan):
    pool = make_pool(plan)
    slot = pool.alloc_slot()
    layer = layer_of(pool, 128)
    view = torch.from_dlpack(pool.layer_view(layer, 0, dtype="uint8"))
    assert view.is_cuda and view.data_ptr() == pool.layer_view(layer, 0).ptr
    assert view.shape[1] == 1024
    for ring_pos in (0, 5, WIN - 1):
        row = pool.window_index(layer, slot.position, ring_pos)
        data = torch.randint(0, 256, (1024,), dtype=torch.uint8, device="cuda")
        view[row] = data
        torch.cuda.synchronize()
        offset = pool.absolute_row(layer, row) * 1024
        assert pool.read_plane(0, offset, 1024) == bytes(data.cpu().numpy())
        back = torch.randint(0, 256, (1024,), dtype=torch.uint8).numpy().tobytes()
        pool.write_plane(0, offset, back)
        pool.synchronize()
        assert bytes(view[row].cpu().numpy()) == back
    bf = torch.from_dlpack(pool.layer_view(layer, 0))
    assert bf.dtype == torch.bfloat16 and bf.shape[1] == DIM
    idx = torch.from_dlpack(pool.decode(max_seqs=2, max_blocks_per_seq=2).indices("hca"))
    assert idx.dtype == torch.int32 and idx.is_cuda


# ---- attention ---------------------------------------------------------------------------


def sparse_attention(q, keys, indptr, indices, cap):
    """Attention of q[t] over rows indices[indptr[t]:indptr[t+1]] of `keys` (values = keys,
    MLA-style). Fixed shapes and no host sync, so it can be captured in a graph."""
    t = q.shape[0]
    start = indptr[:t].long()
    length = (indptr[1:t + 1] - indptr[:t]).long()
    ar = torch.arange(cap, device=q.device)
    pos = (start[:, None] + ar[None, :]).clamp(max=indices.numel() - 1)
    mask = ar[None, :] < length[:, None]
    rows = torch.where(mask, indices[pos].long(), torch.zeros_like(pos))
    k = keys[rows].float()  # [T, cap, D]
    scores = torch.einsum("td,tcd->tc", q.float(), k) / DIM**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return torch.einsum("tc,tcd->td", w, k)


def dense_rows(pool, layer, ratio, position, ctx, table):
    """The rows a decode token at position ctx-1 attends, from the geometry alone: the HCA
    head (compressed entries of the context) then the window, oldest first."""
    p = ctx - 1
    n = min(p + 1, WIN)
    ring = pool.plan.ring_slots
    head = []
    if ratio == 128:
        rpb = 256 // 128
        head = [pool.compress_index(layer, int(table[e // rpb]), e % rpb) for e in range(min((p + 1) // 128, ctx // 128))]
    tail = [pool.window_index(layer, position, (p - n + 1 + i) % ring) for i in range(n)]
    return head + tail


def dense_attention(q, keys, pool, layer, ratio, positions, ctxs, tables):
    out = []
    for t, (pos, ctx) in enumerate(zip(positions, ctxs)):
        rows = torch.tensor(dense_rows(pool, layer, ratio, pos, ctx, tables[t]), device="cuda")
        k = keys[rows].float().contiguous()  # the sequence's keys laid out densely
        w = torch.softmax(k @ q[t].float() / DIM**0.5, dim=0)
        out.append(w @ k)
    return torch.stack(out)


class Batch:
    """Held slots and blocks of a few sequences; follows boundary moves."""

    def __init__(self, pool, seqs, blocks_per_seq, gen):
        self.pool = pool
        self.slots = [pool.alloc_slot() for _ in range(seqs)]
        self.blocks = [[pool.alloc_block() for _ in range(blocks_per_seq)] for _ in range(seqs)]
        self.gen = gen
        self.new_contexts()

    def new_contexts(self):
        cap = 256 * len(self.blocks[0])
        self.ctx = [int(c) for c in torch.randint(1, cap + 1, (len(self.slots),), generator=self.gen)]

    def apply(self, change):
        moved = {(o.id, o.generation): n for o, n in change["block_moves"]}
        self.blocks = [[moved.get((b.id, b.generation), b) for b in row] for row in self.blocks]
        smoved = {(o.group, o.generation): n for o, n in change["slot_moves"]}
        self.slots = [smoved.get((s.group, s.generation), s) for s in self.slots]

    def arrays(self):
        import numpy as np

        positions = np.array([self.pool.slot_position(s) for s in self.slots], dtype=np.int64)
        tables = np.array([[b.id for b in row] for row in self.blocks], dtype=np.int32)
        return positions, np.array(self.ctx, dtype=np.int64), tables


def run_attention_check(pool, ratio, rounds=1, graph=False):
    gen = torch.Generator().manual_seed(20261130 + ratio)
    layer = layer_of(pool, ratio)
    cls = {0: "dense", 128: "hca"}[ratio]
    seqs, bps = 6, 3
    dec = pool.decode(max_seqs=8, max_blocks_per_seq=bps)
    batch = Batch(pool, seqs, bps, gen)
    keys = torch.from_dlpack(pool.layer_view(layer, 0))  # [view_rows, 512] bf16
    stream = torch.cuda.current_stream()
    cap_tokens = dec.capacity()["max_tokens"]
    slice_cap = dec.indices(cls).shape[0] // cap_tokens
    indptr = torch.from_dlpack(dec.indptr(cls))
    indices = torch.from_dlpack(dec.indices(cls))
    q = torch.zeros(seqs, DIM, dtype=torch.bfloat16, device="cuda")

    def stage_round():
        positions, ctx, tables = batch.arrays()
        dec.stage(positions, ctx, block_tables=tables)  # on the pool's stream (= `stream`)
        keys.copy_(torch.randn(keys.shape, dtype=torch.bfloat16, device="cuda"))
        q.copy_(torch.randn(q.shape, dtype=torch.bfloat16, device="cuda"))
        return positions, ctx, tables

    g = None
    for r in range(rounds):
        positions, ctx, tables = stage_round()
        if graph and g is None:
            g = torch.cuda.CUDAGraph()
            # Warm up on a side stream as torch requires, then capture build + attention.
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                dec.build(stream=side)
                sparse_attention(q, keys, indptr, indices, slice_cap)
            stream.wait_stream(side)
            with torch.cuda.graph(g):
                dec.build(stream=torch.cuda.current_stream())
                static_out = sparse_attention(q, keys, indptr, indices, slice_cap)
        if graph:
            g.replay()
            out = static_out
        else:
            dec.build(stream=stream)
            out = sparse_attention(q, keys, indptr, indices, slice_cap)
        ref = dense_attention(q, keys, pool, layer, ratio, positions, ctx, tables)
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        # Next round: move the boundary (relocating what sits at the edge) and take a
        # new batch of contexts; captured addresses stay valid.
        change = pool.grow_slots(1) if r % 2 == 0 else pool.shrink_slots(1)
        batch.apply(change)
        batch.new_contexts()
    torch.cuda.synchronize()
    return dec


@pytest.mark.parametrize("ratio", [0, 128])
def test_sparse_attention_matches_dense(plan, ratio):
    pool = make_pool(plan)
    run_attention_check(pool, ratio, rounds=2)


@pytest.mark.parametrize("ratio", [0, 128])
def test_graph_captured_build_and_attention_replays(plan, ratio):
    pool = make_pool(plan)
    run_attention_check(pool, ratio, rounds=5, graph=True)


def test_pool_over_a_torch_tensor(plan):
    need = v4pool.Pool.required_bytes(plan)
    mem = torch.full((need + 4096,), 0xAB, dtype=torch.uint8, device="cuda")
    pool = make_pool(plan, memory=mem)
    start, length = pool.region
    base = mem.data_ptr()
    assert base <= start < base + 256 and start + length <= base + mem.numel()
    p0 = pool.plane(0).ptr
    assert base <= p0 < base + mem.numel()
    torch.cuda.synchronize()
    # The planes come zeroed even though the tensor held 0xAB.
    assert int(mem[p0 - base:p0 - base + 4096].max()) == 0
    # Writes through the pool land in the tensor's bytes.
    pool.write_plane(0, 2048, bytes(range(32)))
    pool.synchronize()
    assert mem[p0 - base + 2048:p0 - base + 2080].cpu().tolist() == list(range(32))
    run_attention_check(pool, 128, rounds=3, graph=True)
    with pytest.raises(ValueError):
        v4pool.Pool(plan, backend="cuda", memory=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.Pool(plan, backend="cuda", memory=torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
    assert e.value.variant == "RegionTooSmall"
