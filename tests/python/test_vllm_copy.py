"""v4pool.vllm_copy on CPU tensors (no vLLM): the worker side's saves and loads through the
host ring and v4pool.EntryTier files, against a reference that copies page by page.

A backing allocation laid out the way vLLM 0.34 lays a per-block slab out (every layer's page
at offset + layer * layer_stride + block * block_stride), with three groups: one whose pages
fill their block (one run), one whose two tensors leave a gap (two runs a block), one whose
pages are narrower than their layer stride (a run per page). Random bytes, a poisoned
destination, the whole allocation compared after each load (so nothing outside the planned
pages may change either)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import v4pool  # noqa: E402
from v4pool.vllm_copy import NULL_BLOCK, EntryMover, HostRing, SlabCopier, page_view, storage_bytes  # noqa: E402

BLOCKS = 160
# The saved request's blocks are 1..DST - 1, the loads' from DST on.
DST = 81
STRIDE = 4096
# KVCacheTensor-like placements: (group, offset, layer_stride, layers, page).
TENSORS = [
    (0, 0, 700, 3, 700),       # group 0: 2100 B ...
    (0, 2100, 500, 2, 500),    # ... + 1000 B right after: one run of 3100 B
    (1, 0, 1000, 2, 1000),     # group 1: 2000 B, a gap, then ...
    (1, 2500, 300, 3, 300),    # ... 900 B: two runs a block
    (2, 0, 1200, 3, 1000),     # group 2: pages of 1000 B every 1200 B: three runs
]
LAYOUT = "test-layout|slab-order"
POISON_BYTE = 0xA5


class Files:
    """One EntryTier as the mover's file tiers (every failure a miss, as v4pool.vllm.Tiers)."""

    def __init__(self, root):
        self.t = v4pool.EntryTier(str(root), LAYOUT, 1 << 30)

    def put(self, kind, key, parts):
        self.t.put(kind, key, parts)
        return True

    def get_into(self, kind, key, dst):
        return self.t.get_into(kind, key, dst)


def slab(seed: int):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (BLOCKS * STRIDE,), dtype=torch.uint8, generator=g)
    groups: dict[int, list] = {0: [], 1: [], 2: []}
    views: dict[int, list] = {0: [], 1: [], 2: []}
    for grp, off, lstride, layers, page in TENSORS:
        for l in range(layers):
            groups[grp].append((off + l * lstride, STRIDE, page))
            views[grp].append(page_view(buf, off + l * lstride, BLOCKS, STRIDE, page))
    return buf, SlabCopier(storage_bytes(buf), groups, BLOCKS), views


def reference(buf, views, src_plans, dst_plans):
    """The expected allocation: each destination page set from its source page, page by
    page (NULL_BLOCK destinations skipped)."""
    want = buf.clone()
    wv = {g: [page_view(want, v.storage_offset(), BLOCKS, STRIDE, v.shape[1]) for v in vs]
          for g, vs in views.items()}
    for sp, dp in zip(src_plans, dst_plans):
        for (g, sids), (_, dids) in zip(sp, dp):
            for s, d in zip(sids, dids):
                if d != NULL_BLOCK:
                    for v, w in zip(views[g], wv[g]):
                        w[d].copy_(v[s])
    return want


def plans(rng: random.Random, n: int, ids: list[int]):
    """``n`` entries' plans over the block ids ``ids`` (taken in order): a few blocks of
    each group, as the connector's block and checkpoint entries are."""
    it = iter(ids)
    out = []
    for _ in range(n):
        out.append([(g, [next(it) for _ in range(rng.randint(1, 3))]) for g in rng.sample([0, 1, 2], rng.randint(1, 3))])
    return out


def with_ids(ps, ids):
    it = iter(ids)
    return [[(g, [next(it) for _ in bs]) for g, bs in p] for p in ps]


@pytest.mark.parametrize("ring_bytes", [0, 9000, 30000, 1 << 20])
@pytest.mark.parametrize("order", ["consecutive", "shuffled"])
def test_saved_pages_restore_exactly_through_the_ring_and_the_files(tmp_path, ring_bytes, order):
    rng = random.Random(ring_bytes * 7 + len(order))
    buf, copier, views = slab(ring_bytes + 1)
    src = plans(rng, 8, list(range(1, DST)))
    n_ids = sum(len(b) for p in src for _, b in p)
    free = list(range(DST, DST + n_ids))
    if order == "shuffled":
        rng.shuffle(free)
    dst = with_ids(src, free)
    # A few pages the loads must not write (vLLM's prefix cache lent them: NULL_BLOCK).
    dst[1][0][1][0] = NULL_BLOCK
    dst[5][-1][1][-1] = NULL_BLOCK
    files = Files(tmp_path / "tier")
    ring = HostRing(ring_bytes, pin=False) if ring_bytes else None
    saver = EntryMover(copier, ring, files)
    keys = [("b" if i % 2 else "c", 1000 + i) for i in range(len(src))]
    assert saver.save([(k, h, p) for (k, h), p in zip(keys, src)]) == [True] * len(src)
    buf[DST * STRIDE:].fill_(0xA5)
    want = reference(buf, views, src, dst)
    # The same worker (its ring, where it holds them), then a fresh one (files only).
    for mover in (saver, EntryMover(copier, HostRing(ring_bytes, pin=False) if ring_bytes else None, files)):
        buf[DST * STRIDE:].fill_(0xA5)
        assert mover.load([(k, h, p) for (k, h), p in zip(keys, dst)]) == [True] * len(dst)
        assert torch.equal(buf, want)
    if ring is not None and ring_bytes >= (1 << 20):
        # A ring that holds everything served every load: no file was read.
        assert files.t.stats()["hits"] == len(src)


def test_an_entry_of_another_length_or_corrupt_file_writes_nothing(tmp_path):
    rng = random.Random(5)
    buf, copier, views = slab(3)
    src = plans(rng, 4, list(range(1, DST)))
    files = Files(tmp_path / "tier")
    EntryMover(copier, HostRing(1 << 20, pin=False), files).save(
        [("c", 7 + i, p) for i, p in enumerate(src)])
    buf[DST * STRIDE:].fill_(0xA5)
    before = buf.clone()
    ids = iter(range(DST, BLOCKS))
    dst = with_ids(src, ids)
    # Entry 0 loaded under a plan one block longer; entry 1's file corrupted (a fresh worker
    # reads the file); entry 2 absent.
    longer = [(g, b + [next(ids)]) if i == 0 else (g, b) for i, (g, b) in enumerate(dst[0])]
    path = Path(str(files.t.layout_dir()))
    for f in path.rglob(f"c{8:032x}"):
        raw = bytearray(f.read_bytes())
        raw[-9] ^= 0x20
        f.write_bytes(bytes(raw))
    fresh = EntryMover(copier, HostRing(1 << 20, pin=False), files)
    got = fresh.load([("c", 7, longer), ("c", 8, dst[1]), ("c", 99, dst[2])])
    assert got == [False, False, False]
    assert torch.equal(buf, before), "a refused entry wrote into the pages"


def test_the_ring_keeps_every_entry_it_holds_whole():
    """Random placements into a small ring: live entries never overlap, stay inside it and
    keep their bytes; protected entries are never overwritten."""
    rng = random.Random(11)
    ring = HostRing(10_000, pin=False)
    pattern = {}
    for step in range(3000):
        key = ("b", rng.randint(0, 60))
        n = rng.choice([1, 7, 100, 999, 2500, 4000, 10_000, 10_001])
        if rng.random() < 0.1 and ring.index:
            ring.protected.add(rng.choice(list(ring.index)))
        if rng.random() < 0.2:
            ring.protected.clear()
        before = dict(ring.index)
        off = ring.reserve(*key, n)
        if off is None:
            assert n > ring.capacity or key in ring.protected or any(
                k in ring.protected for k in before), (step, n)
            assert ring.index == before
        else:
            assert 0 <= off and off + n <= ring.capacity
            v = step % 251 + 1
            ring.buffer()[off:off + n].fill_(v)
            pattern[key] = v
        for p in ring.protected:
            if p in before:
                assert ring.index.get(p) == before[p], "a protected entry moved or went"
        live = sorted(ring.index.values())
        for (o1, n1), (o2, _) in zip(live, live[1:]):
            assert o1 + n1 <= o2, "two live entries overlap"
        for k, (o, n_) in ring.index.items():
            assert bool((ring.buffer()[o:o + n_] == pattern[k]).all()), f"entry {k} lost its bytes"


def test_the_entry_tier_takes_only_contiguous_host_bytes(tmp_path):
    t = v4pool.EntryTier(str(tmp_path), LAYOUT, 1 << 20)
    body = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    t.put("b", 5, [body[:1000], body[1000:]])
    out = torch.full((4096,), POISON_BYTE, dtype=torch.uint8)
    assert t.get_into("b", 5, out) and torch.equal(out, body)
    for what, bad in [("strided", torch.zeros(8192, dtype=torch.uint8)[::2]),
                      ("not uint8", torch.zeros(1024, dtype=torch.int32)),
                      ("not a tensor", bytearray(4096))]:
        with pytest.raises(Exception) as e:
            t.get_into("b", 5, bad)
        assert getattr(e.value, "variant", "BadTensor") == "BadTensor", what
        with pytest.raises(Exception):
            t.put("b", 6, [bad])
    assert not t.contains("b", 6)
