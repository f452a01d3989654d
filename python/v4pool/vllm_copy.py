"""The worker side's byte moves of ``v4pool.vllm``, without vLLM: vLLM's KV pages to and from
entry bodies, through a host tier in this process (page-locked when the KV is on CUDA) in
front of v4pool's file-backed entry tiers. ``v4pool.vllm`` builds it from vLLM's
``KVCacheConfig``; ``benches/vllm_gpu_restore.py`` from a fixture of the same placements (the
GPU machine has torch and v4pool, not vLLM).

Where the bytes are: vLLM 0.34 places every layer's page of block ``b`` at ``offset + layer *
layer_stride + b * block_stride`` of one backing allocation (``KVCacheTensor``); for
DeepSeek-V4 a group's pages of one block lie side by side (one *run* per block per group).

An entry's *body*, for each ``(group, block ids)`` of its plan and each block id in order: the
group's pages of that block in the order they lie in the slab (adjacent pages are one run).
So a load is one host-to-device copy per run and block, and fewer where runs meet: a group
whose run fills its block stride (V4's compressed-history group) is one copy for a range of
consecutive block ids, and bodies that lie back to back in host memory continue each other's
copies. The order depends on the placements, which ``v4pool.vllm.Layout`` puts in the layout
id (an entry is only ever read under the layout it was written for).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

import torch

# vLLM's null block (BlockPool.null_block): a page an entry holds that a load does not write.
NULL_BLOCK = 0

#: A copy that reaches this many bytes takes no more runs: the next starts a new one, so the
#: first copies of a long restore are queued (and running) while the rest is still planned.
MERGE_CAP = 8 << 20


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``t`` as a 1-D uint8 tensor (torch's own description of it)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def page_view(storage_tensor: torch.Tensor, start: int, num_blocks: int, block_stride: int,
              page: int) -> torch.Tensor:
    """``[num_blocks, page]`` uint8 view of the storage behind ``storage_tensor``, the pages at
    ``start + block * block_stride`` (torch's own ``as_strided``: every address one torch
    proves)."""
    raw = storage_bytes(storage_tensor)
    if start < 0 or page <= 0 or (num_blocks > 1 and block_stride < page):
        raise ValueError(f"placement start {start}, page {page}, block stride {block_stride}")
    if start + (num_blocks - 1) * block_stride + page > raw.numel():
        raise ValueError("placement past the allocation")
    return torch.as_strided(raw, (num_blocks, page), (block_stride, 1), start)


def runs_of(pages: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A group's pages ``(start, block_stride, page)`` as runs ``(start, block_stride, bytes)``:
    sorted by where they lie, pages that meet (same stride) merged. Overlapping pages are a
    ``ValueError`` (two layers never share bytes within one group)."""
    out: list[tuple[int, int, int]] = []
    for s, st, n in sorted(pages):
        if out and out[-1][1] == st and out[-1][0] + out[-1][2] == s:
            out[-1] = (out[-1][0], st, out[-1][2] + n)
            continue
        if out and out[-1][1] == st and s < out[-1][0] + out[-1][2]:
            raise ValueError(f"pages at {out[-1][0]}+{out[-1][2]} and {s} overlap")
        out.append((s, st, n))
    return out


class SlabCopier:
    """Copies between entry bodies in host memory and the pages of vLLM's backing allocation
    ``raw`` (a 1-D uint8 tensor over all of it, on its device).

    ``groups``: group index -> its layers' pages ``(start, block_stride, page_bytes)``.
    ``num_blocks``: the block ids a plan may name.
    A copy list holds ``[source or destination host tensor, host offset, raw offset, bytes]``.
    ``stats``: copies queued each way.
    """

    def __init__(self, raw: torch.Tensor, groups: dict[int, list[tuple[int, int, int]]],
                 num_blocks: int):
        self.raw = raw
        self.device = raw.device
        self.num_blocks = num_blocks
        self.runs = {g: runs_of(p) for g, p in groups.items()}
        self.block_bytes = {g: sum(n for _, _, n in r) for g, r in self.runs.items()}
        self.stats = {"to_device": 0, "to_host": 0}
        for g, runs in self.runs.items():
            for s, st, n in runs:
                if s < 0 or n <= 0 or s + max(num_blocks - 1, 0) * st + n > raw.numel():
                    raise ValueError(f"group {g}: run at {s} of {n} B (block stride {st}) past "
                                     f"the allocation of {raw.numel()} B")

    def body_len(self, plan: list[tuple[int, list[int]]]) -> int:
        return sum(len(ids) * self.block_bytes[g] for g, ids in plan)

    def copies(self, plan: list[tuple[int, list[int]]], host: torch.Tensor, base: int,
               out: list, skip_null: bool) -> None:
        """Append to ``out`` the copies between the body of ``plan`` at ``host[base:]`` and the
        plan's pages, continuing the last copy of ``out`` where both sides meet (up to
        :data:`MERGE_CAP` bytes).
        ``skip_null``: NULL_BLOCK's pages are left out (a load writes no page of vLLM's null
        block); a save reads them (the body is whole)."""
        o = base
        nb = self.num_blocks
        for g, ids in plan:
            runs = self.runs[g]
            for b in ids:
                if not 0 <= b < nb:
                    raise ValueError(f"group {g}: block id {b} outside 0..{nb}")
                if skip_null and b == NULL_BLOCK:
                    o += self.block_bytes[g]
                    continue
                for s, st, n in runs:
                    d = s + b * st
                    if out:
                        last = out[-1]
                        if (last[0] is host and last[1] + last[3] == o and last[2] + last[3] == d
                                and last[3] < MERGE_CAP):
                            last[3] += n
                            o += n
                            continue
                    out.append([host, o, d, n])
                    o += n

    def to_device(self, copies: list) -> None:
        """Queue ``copies`` host -> pages (non-blocking from page-locked memory: the caller
        orders readers after them, :meth:`sync` or a recorded event)."""
        raw = self.raw
        nb = self.device.type == "cuda"
        self.stats["to_device"] += len(copies)
        for host, h, d, n in copies:
            raw.narrow(0, d, n).copy_(host.narrow(0, h, n), non_blocking=nb)

    def to_host(self, copies: list) -> None:
        """Queue ``copies`` pages -> host (see :meth:`to_device`)."""
        raw = self.raw
        nb = self.device.type == "cuda"
        self.stats["to_host"] += len(copies)
        for host, h, d, n in copies:
            host.narrow(0, h, n).copy_(raw.narrow(0, d, n), non_blocking=nb)

    def sync(self) -> None:
        """Wait for every copy queued on the device's current stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def record(self) -> "torch.cuda.Event | None":
        """An event after the copies queued so far (None on the CPU, where copies are done)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev


def _host_buffer(n: int, pin: bool) -> torch.Tensor:
    """``n`` bytes of host memory, page-locked when ``pin``: registered with CUDA as they are
    (``cudaHostRegister``: exactly ``n`` bytes, where torch's pinned allocator rounds a size up
    to a power of two), else from torch's pinned allocator."""
    t = torch.empty(n, dtype=torch.uint8)
    if not pin:
        return t
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(t.data_ptr(), n, 0)
        if getattr(rc, "value", rc) == 0:
            return t
    except (AttributeError, RuntimeError):
        pass
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class HostRing:
    """The first-level entry tier of one worker: whole entry bodies in one host buffer of
    ``capacity`` bytes (allocated at first use; page-locked when ``pin``), written as a ring.

    An entry is placed at the ring's head, or at its start when it does not fit before the
    end (the entries past the head are dropped then); the entries the new one overlaps are
    the oldest written, and are dropped. Memory is the capacity, whatever is stored: nothing
    grows with what a peer's files hold. *Protected* entries (whose bytes a batch has yet to
    copy) are never overwritten: a placement that would is refused (None) until the batch
    releases them. Every placement first waits for the copies queued from or into the ring
    (``pending``, an event), so the host never writes ring memory a queued copy reads.
    """

    def __init__(self, capacity: int, pin: bool):
        self.capacity = int(capacity)
        self.pin = pin
        self.buf: torch.Tensor | None = None
        self.index: collections.OrderedDict[tuple[str, int], tuple[int, int]] = collections.OrderedDict()
        self.head = 0
        self.protected: set[tuple[str, int]] = set()
        self.pending: Any = None

    def buffer(self) -> torch.Tensor:
        if self.buf is None:
            self.buf = _host_buffer(self.capacity, self.pin)
        return self.buf

    def close(self) -> None:
        """Unregister and free the buffer (the ring is empty afterwards)."""
        self.wait()
        if self.buf is not None and self.pin:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            except (AttributeError, RuntimeError):
                pass
        self.buf = None
        self.index.clear()
        self.protected.clear()
        self.head = 0

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None

    def lookup(self, kind: str, key: int) -> tuple[int, int] | None:
        """``(offset, bytes)`` of the entry, or None."""
        return self.index.get((kind, key))

    def drop(self, kind: str, key: int) -> None:
        self.index.pop((kind, key), None)

    def reserve(self, kind: str, key: int, n: int) -> int | None:
        """Place an entry of ``n`` bytes (replacing the key's own): its offset, or None when it
        is larger than the ring or would overwrite a protected entry."""
        k = (kind, key)
        if n <= 0 or n > self.capacity or k in self.protected:
            return None
        head = self.head
        wrap = head + n > self.capacity
        start = 0 if wrap else head
        # In write order the index holds the last lap's entries (at or past the head, in
        # offset order), then this lap's (before it). The new entry overlaps the last lap's
        # up to its end; on a wrap, all of the last lap's and this lap's up to its end.
        doomed = []
        for key_, (o, _) in self.index.items():
            if o >= head:
                if wrap or o < head + n:
                    doomed.append(key_)
                    continue
                break
            if wrap and o < n:
                doomed.append(key_)
                continue
            break
        if any(d in self.protected for d in doomed):
            return None
        self.wait()
        for d in doomed:
            del self.index[d]
        self.index.pop(k, None)
        self.buffer()
        self.index[k] = (start, n)
        self.head = start + n
        return start


class EntryMover:
    """The worker side's saves and loads of entry bodies: ``ring`` first (None: none), the
    file-backed tiers ``files`` behind it (``put(kind, key, parts) -> bool`` and
    ``get_into(kind, key, dst) -> bool``, every failure a miss: ``v4pool.vllm.Tiers``).

    A save gathers the plan's pages into the ring (device-to-host copies), then publishes
    the body to the files, checksummed there (the scheduler finds entries in the files; other
    processes read them). A load copies an entry the ring holds straight from it into the
    plan's pages: no file read, no checksum. An entry the ring lacks is read from the files
    (whole, checked) into the ring first. Copies go on the device's current stream, which
    the forward that reads the pages runs on; :meth:`load` returns once they are queued.
    """

    def __init__(self, copier: SlabCopier, ring: HostRing | None, files: Any):
        self.copier = copier
        self.ring = ring
        self.files = files
        self.pin = copier.device.type == "cuda"

    def _staging(self, n: int) -> torch.Tensor:
        # Outside the ring (it is off, or the entry is larger): the body's own buffer, sized
        # by this worker's own plan.
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)

    def save(self, transfers: list[tuple[str, int, list[tuple[int, list[int]]]]]) -> list[bool]:
        """Store each ``(kind, key, plan)``'s pages; whether the files took each."""
        done = [False] * len(transfers)
        pending: list[tuple[int, str, int, torch.Tensor, int, int]] = []
        for i, (kind, key, plan) in enumerate(transfers):
            n = self.copier.body_len(plan)
            host, base = self._place(kind, key, n, lambda: self._publish(pending, done))
            copies: list = []
            self.copier.copies(plan, host, base, copies, skip_null=False)
            self.copier.to_host(copies)
            pending.append((i, kind, key, host, base, n))
        self._publish(pending, done)
        return done

    def _place(self, kind: str, key: int, n: int, flush: Callable[[], None]) -> tuple[torch.Tensor, int]:
        """Room for ``n`` bytes of ``(kind, key)``: in the ring (after ``flush`` when only the
        batch's own protected entries are in the way), else a buffer of its own."""
        ring = self.ring
        if ring is not None:
            off = ring.reserve(kind, key, n)
            if off is None and ring.protected and n <= ring.capacity:
                flush()
                off = ring.reserve(kind, key, n)
            if off is not None:
                ring.protected.add((kind, key))
                return ring.buffer(), off
        return self._staging(n), 0

    def _publish(self, pending: list, done: list[bool]) -> None:
        self.copier.sync()
        for i, kind, key, host, base, n in pending:
            done[i] = bool(self.files.put(kind, key, [host.narrow(0, base, n)]))
            if self.ring is not None:
                self.ring.protected.discard((kind, key))
        pending.clear()

    def load(self, transfers: list[tuple[str, int, list[tuple[int, list[int]]]]]) -> list[bool]:
        """Copy each ``(kind, key, plan)``'s entry into the plan's pages, if an entry of
        exactly the plan's length is held (the ring's, else a file's, whole and checked);
        whether each was. Nothing reaches the pages from an entry that is not."""
        done = [False] * len(transfers)
        copies: list = []
        ring = self.ring

        def flush() -> None:
            self.copier.to_device(copies)
            copies.clear()
            if ring is not None:
                ring.pending = self.copier.record()
                ring.protected.clear()

        for i, (kind, key, plan) in enumerate(transfers):
            n = self.copier.body_len(plan)
            held = ring.lookup(kind, key) if ring is not None else None
            if held is not None and held[1] == n:
                ring.protected.add((kind, key))
                self.copier.copies(plan, ring.buffer(), held[0], copies, skip_null=True)
                done[i] = True
                self._queue_settled(copies)
                continue
            if held is not None and ring is not None:
                ring.drop(kind, key)
            host, base = self._place(kind, key, n, flush)
            if not self.files.get_into(kind, key, host.narrow(0, base, n)):
                if ring is not None and host is ring.buf:
                    ring.drop(kind, key)
                    ring.protected.discard((kind, key))
                continue
            self.copier.copies(plan, host, base, copies, skip_null=True)
            done[i] = True
            self._queue_settled(copies)
        flush()
        return done

    def _queue_settled(self, copies: list) -> None:
        """Queue every copy but the last (which the next entry may still continue), so the
        device copies while the rest is planned; their entries stay protected until the
        batch's end."""
        if len(copies) > 1:
            self.copier.to_device(copies[:-1])
            del copies[:-1]
