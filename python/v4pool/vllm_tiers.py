"""The connector's tiers (``v4pool.vllm``): ``Tiers``, the host and shared entry tiers a worker
moves bytes through (``v4pool.EntryTier``: files through std::fs or NIXL POSIX, or a key-value
store such as Mooncake Store), and ``IndexOnlyTiers``, the bytes-free model of them that
benches/vllm_trace.py runs the scheduler side over. Split from ``v4pool.vllm`` (which re-exports
every name here) so each file stays under a thousand lines; nothing here reads vLLM's classes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

import v4pool
from vllm.logger import init_logger

if TYPE_CHECKING:
    from v4pool.vllm import Layout

logger = init_logger("v4pool.vllm")

# Entry kinds in the tiers: a full block's pages, a checkpoint, a checkpoint index; and a
# load the scheduler side already knows cannot be served (never in a tier).
BLOCK, CHECKPOINT, INDEX, FAILED = "b", "c", "i", "x"


def _bytes(v: Any) -> int:
    if isinstance(v, int):
        return v
    s = str(v).strip()
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "B": 1}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


class Tiers:
    """The host tier and the shared tier, each optional; any failure is a miss."""

    def __init__(self, layout: Layout, extra: dict):
        self.tiers: list[tuple[str, Any]] = []
        for medium, dkey, bkey, iokey, default_bytes in (
            ("cpu", "host_dir", "host_bytes", "host_io", 8 << 30),
            ("shared", "shared_dir", "shared_bytes", "shared_io", 64 << 30),
        ):
            root = extra.get(dkey)
            # The shared tier in Mooncake Store instead of a directory (docs/vllm.md).
            store = extra.get("shared_store") if medium == "shared" else None
            if not root and not store:
                continue
            try:
                if store:
                    if root:
                        logger.warning("v4pool.vllm: shared_store set: shared_dir %s unused", root)
                    from v4pool.mooncake import MooncakeStore

                    root = f"mooncake {store.get('master')}"
                    tier = v4pool.EntryTier.in_store(
                        MooncakeStore.from_config(store, to_bytes=_bytes), layout.layout_id,
                        _bytes(extra.get(bkey, store.get("segment_bytes", 1 << 30))),
                    )
                else:
                    tier = v4pool.EntryTier(
                        str(root), layout.layout_id, _bytes(extra.get(bkey, default_bytes)),
                        sync=bool(extra.get("sync", False)), evict_first=evict_first_of(layout, extra),
                        io=str(extra.get(iokey, "std-fs")),
                    )
            except Exception as e:  # a tier that cannot open: vLLM serves on misses
                logger.warning("v4pool.vllm: %s tier %s unusable: %s", medium, root, e)
                continue
            self.tiers.append((medium, tier))
        self.lock = threading.Lock()

    def where(self, kind: str, key: int) -> str | None:
        for medium, t in self.tiers:
            try:
                if t.contains(kind, key):
                    return medium
            except Exception:
                continue
        return None

    def put(self, kind: str, key: int, parts: list[torch.Tensor]) -> bool:
        ok = False
        for medium, t in self.tiers:
            try:
                t.put(kind, key, parts)
                ok = True
            except Exception as e:
                logger.warning("v4pool.vllm: %s tier put failed: %s", medium, e)
        return ok

    def refresh(self, keys: list[tuple[str, int]]) -> None:
        for medium, t in self.tiers:
            try:
                t.refresh(keys)
            except Exception as e:
                logger.warning("v4pool.vllm: %s tier refresh failed: %s", medium, e)

    def get_into(self, kind: str, key: int, dst: torch.Tensor) -> bool:
        for _, t in self.tiers:
            try:
                if t.get_into(kind, key, dst):
                    return True
            except Exception:
                continue
        return False

    def read_index(self, key: int) -> list[int]:
        for _, t in self.tiers:
            try:
                n = t.size(INDEX, key)
                if not n or n % 4:
                    continue
                buf = torch.empty(n, dtype=torch.uint8)
                if t.get_into(INDEX, key, buf):
                    return buf.view(torch.int32).tolist()
            except Exception:
                continue
        return []

    def add_index(self, key: int, tail: int) -> None:
        # Read-modify-write: a racing writer may drop one tail, which only costs a hit.
        tails = sorted(set(self.read_index(key)) | {tail})
        self.put(INDEX, key, [torch.tensor(tails, dtype=torch.int32).view(torch.uint8)])


def evict_first_of(layout: "Layout", extra: dict) -> str:
    """The entry kinds a full tier evicts before any other (oldest first among them), for
    ``layout``; ``evict_first`` in the extra config overrides it ("" for plain LRU).

    V4.1 with ``replay_fallback`` (the default): checkpoints. A V4.1 run of stored blocks
    stays a hit without its checkpoint (vLLM replays the window after it), and a checkpoint carries 128 tokens of
    window for every SWA layer (3 to 4.4 MB, the bytes of about 1,700 tokens of blocks), so
    dropping checkpoints first keeps the most hit tokens per byte. V4: plain LRU. A V4 block
    run without the checkpoint at its end is no hit at all (no replay), so evicting
    checkpoints first would keep blocks nothing can use; so is V4.1 without
    ``replay_fallback`` (measured on the trace at 8 GiB: 0.63 of the ceiling with checkpoints
    first against 0.81 with plain LRU, docs/vllm.md)."""
    first = extra.get("evict_first")
    if first is None:
        return CHECKPOINT if layout.replay and bool(extra.get("replay_fallback", True)) else ""
    return str(first)


class IndexOnlyTiers:
    """For benches/vllm_trace.py only (``bench_index_only``): the tier's keys and byte sizes
    without bytes, in one LRU of ``host_bytes``, shareable between scheduler objects of one
    process (a fleet's shared tier: pass the same dict). Saves are accounted when planned.
    Its clock is the file tier's (``transfer::entry_dir``: an entry's mtime is set when it is
    written, read or refreshed, not when it is looked up), and so are its eviction order (the
    kinds of ``evict_first`` oldest first, then every entry oldest first:
    ``EntryDir::open_ordered``) and its capacity rule (``EntryDir::sweep_rule``: a scan
    after every 1/8 of the budget written evicts down to the budget and keeps the rest of its
    order, from which a put over budget evicts until the next scan); tests/vllm pins both to
    one outcome."""

    def __init__(self, capacity: int, shared: "dict | None" = None, evict_first: str = ""):
        import collections

        st = shared if shared is not None else {}
        st.setdefault("lru", collections.OrderedDict())
        # The entries of the kinds evicted first, in the same LRU order as ``lru``.
        st.setdefault("first", collections.OrderedDict())
        st.setdefault("index", {})
        # Bytes held, bytes written since the last scan, the clock (each entry's last use),
        # and what the last scan left in eviction order, with each entry's use then.
        st.setdefault("n", {"used": 0, "written": 0, "clock": 0})
        st.setdefault("stamp", {})
        st.setdefault("queue_first", collections.deque())
        st.setdefault("queue", collections.deque())
        self.store, self.first, self.index = st["lru"], st["first"], st["index"]
        self.n, self.stamp = st["n"], st["stamp"]
        self.queue_first, self.queue = st["queue_first"], st["queue"]
        self.capacity = capacity
        # The file tier's rule, from the library (one formula: EntryDir::sweep_rule).
        self.scan_after, self.target = v4pool.EntryTier.sweep_rule(capacity)
        self.evict_first = evict_first
        self.tiers = [("cpu", None)]

    @property
    def used(self) -> int:
        return self.n["used"]

    def where(self, kind, key):
        return "cpu" if (kind, key) in self.store else None

    def _use(self, k) -> None:
        self.n["clock"] += 1
        self.stamp[k] = self.n["clock"]

    def touch(self, kind, key):
        k = (kind, key)
        if k in self.store:
            self.store.move_to_end(k)
            if k in self.first:
                self.first.move_to_end(k)
            self._use(k)

    def _evict(self, k) -> None:
        self.n["used"] -= self.store.pop(k)
        self.first.pop(k, None)
        self.stamp.pop(k, None)

    def add(self, kind, key, nbytes):
        k = (kind, key)
        if k in self.store:
            return
        self.store[k] = nbytes
        self._use(k)
        if kind in self.evict_first:
            self.first[k] = nbytes
            self.queue_first.append((k, self.stamp[k]))
        self.n["used"] += nbytes
        self.n["written"] += nbytes
        if self.n["written"] >= self.scan_after:
            self._scan()
        elif self.n["used"] > self.capacity:
            # What the last scan left, skipping entries used since (EntryDir::evict_queued).
            while self.n["used"] > self.capacity and (self.queue_first or self.queue):
                q, stamp = (self.queue_first or self.queue).popleft()
                if self.stamp.get(q) == stamp:
                    self._evict(q)
            if self.n["used"] > self.capacity:
                self._scan()

    def _scan(self) -> None:
        # EntryDir::scan: the kinds of evict_first oldest first, then the rest oldest first,
        # evicted down to the target; the rest of that order kept for later puts.
        self.n["written"] = 0
        order = list(self.first) + [k for k in self.store if k not in self.first]
        self.queue_first.clear()
        self.queue.clear()
        for k in order:
            if self.n["used"] > self.target:
                self._evict(k)
            else:
                (self.queue_first if k in self.first else self.queue).append((k, self.stamp[k]))

    def refresh(self, keys):
        for kind, key in keys:
            self.touch(kind, key)

    def read_index(self, key):
        return list(self.index.get(key, ()))

    def add_index(self, key, tail):
        self.index[key] = tuple(sorted(set(self.index.get(key, ())) | {tail}))
