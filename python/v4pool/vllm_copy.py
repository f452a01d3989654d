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
import logging
import queue
import threading
from typing import Any, Callable, Iterable

import torch

logger = logging.getLogger("v4pool.vllm")

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
        self._save_stream: Any = None
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

    def to_host_async(self, copies: list) -> Any:
        """Queue ``copies`` pages -> host without waiting for them: an event the copies are done
        after (``query()``, ``synchronize()``), or None where they are done already (the CPU:
        a memcpy, done inline).

        On CUDA they go on a stream of their own, after everything queued on the current stream
        so far (the forward's writes), and the current stream then waits for them on the device:
        blocks vLLM frees while a request runs (a window's blocks behind it, a preempted
        request's) are reused by the next step's zeroing, copy-on-write and forward on that
        stream before any hook of the connector runs, so no later work there may write a page
        before these copies have read it. The host does not wait."""
        if self.device.type != "cuda":
            self.to_host(copies)
            return None
        cur = torch.cuda.current_stream(self.device)
        if self._save_stream is None:
            self._save_stream = torch.cuda.Stream(self.device)
        side = self._save_stream
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            self.to_host(copies)
        done = torch.cuda.Event()
        done.record(side)
        cur.wait_event(done)
        return done

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
    releases them; nor are *publishing* ones (whose bytes a background publish has yet to
    read: :meth:`EntryMover.save_async`), which are not dropped either. Every placement first
    waits for the copies queued from or into the ring (``pending``, an event), so the host
    never writes ring memory a queued copy reads.
    """

    def __init__(self, capacity: int, pin: bool):
        self.capacity = int(capacity)
        self.pin = pin
        self.buf: torch.Tensor | None = None
        self.index: collections.OrderedDict[tuple[str, int], tuple[int, int]] = collections.OrderedDict()
        self.head = 0
        self.protected: set[tuple[str, int]] = set()
        # Removed by the publishing thread (a set's add, discard and membership are atomic
        # under the GIL; nothing iterates it).
        self.publishing: set[tuple[str, int]] = set()
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
        self.publishing.clear()
        self.head = 0

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None

    def lookup(self, kind: str, key: int) -> tuple[int, int] | None:
        """``(offset, bytes)`` of the entry, or None."""
        return self.index.get((kind, key))

    def drop(self, kind: str, key: int) -> None:
        """Forget the entry, unless a publish has yet to read it (its bytes stay placed)."""
        if (kind, key) not in self.publishing:
            self.index.pop((kind, key), None)

    def held(self, k: tuple[str, int]) -> bool:
        """Whether the entry ``k`` may not be overwritten now."""
        return k in self.protected or k in self.publishing

    def reserve(self, kind: str, key: int, n: int) -> int | None:
        """Place an entry of ``n`` bytes (replacing the key's own): its offset, or None when it
        is larger than the ring or would overwrite a protected entry."""
        k = (kind, key)
        if n <= 0 or n > self.capacity or self.held(k):
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
        if any(self.held(d) for d in doomed):
            return None
        self.wait()
        for d in doomed:
            del self.index[d]
        self.index.pop(k, None)
        self.buffer()
        self.index[k] = (start, n)
        self.head = start + n
        return start


class Publisher:
    """One background thread that runs jobs one at a time in the order they were submitted (a
    FIFO: a request's entries are published before the refresh of its path that follows them).
    A job that raises is logged and counted (``errors``), never raised into the submitter. The
    thread is a daemon, started at the first job."""

    def __init__(self, name: str = "v4pool-publish"):
        self.name = name
        self._q: "queue.SimpleQueue[Callable[[], None] | None]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.errors = 0

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; False once closed (the job is not run)."""
        with self._cv:
            if self._closed:
                return False
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._q.put(job)
        return True

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except Exception as e:  # noqa: BLE001 -- a failed publish is a miss, never vLLM's error
                self.errors += 1
                logger.warning("v4pool.vllm: background publish failed: %r", e)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float) -> bool:
        """Run what is queued, then stop the thread, waiting at most ``timeout`` seconds;
        whether it stopped (a job stuck in a write is left to the daemon thread)."""
        with self._cv:
            self._closed = True
            t = self._thread
        if t is None:
            return True
        self._q.put(None)
        t.join(timeout)
        return not t.is_alive()


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

    :meth:`save` returns once the files took the bodies; :meth:`save_async` (with a
    ``publisher``) once the device-to-host copies are queued, the publisher writing the files.
    """

    def __init__(self, copier: SlabCopier, ring: HostRing | None, files: Any,
                 publisher: Publisher | None = None, staged_cap: int = 1 << 30):
        self.copier = copier
        self.ring = ring
        self.files = files
        self.pin = copier.device.type == "cuda"
        # save_async: the thread that publishes, and the bytes of bodies outside the ring that
        # wait for it (at most staged_cap, or one body, before further saves are dropped).
        self.publisher = publisher
        self.staged_cap = max(int(staged_cap), ring.capacity if ring is not None else 0)
        self._staged = 0
        self._lock = threading.Lock()
        # Ring entries whose device-to-host copies failed: dropped by the next save or load
        # (the ring's index is only changed on the caller's thread).
        self._bad: collections.deque[tuple[str, int]] = collections.deque()
        self.stats = {"save_dropped": 0, "publish_failed": 0}

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

    def save_async(self, transfers: list[tuple[str, int, list[tuple[int, list[int]]]]],
                   after: Callable[[list[bool]], None] | None = None) -> Any:
        """Queue each ``(kind, key, plan)``'s pages device-to-host (into the ring, or a buffer
        of their own) and hand their publish to the publisher; return the copies' event
        (:meth:`SlabCopier.to_host_async`; None: done). The publisher then waits for the copies,
        puts the bodies in order and calls ``after(done)`` (whether the files took each), in
        the order of the calls. An entry a publish has yet to read is neither overwritten nor
        dropped; one that is already waiting for its publish is not saved twice; one with no
        room (the ring held by publishes, buffers over ``staged_cap``) is not saved (a miss
        later: ``stats["save_dropped"]``)."""
        assert self.publisher is not None, "save_async needs a publisher"
        ring = self.ring
        self._drop_bad()
        jobs: list[tuple[int, str, int, torch.Tensor, int, int, bool]] = []
        copies: list = []
        for i, (kind, key, plan) in enumerate(transfers):
            if ring is not None and (kind, key) in ring.publishing:
                continue  # its earlier save publishes the same bytes (the key is their hash)
            n = self.copier.body_len(plan)
            off = ring.reserve(kind, key, n) if ring is not None else None
            if off is not None:
                ring.publishing.add((kind, key))
                host, base, staged = ring.buffer(), off, False
            else:
                with self._lock:
                    if self._staged and self._staged + n > self.staged_cap:
                        self.stats["save_dropped"] += 1
                        continue
                    self._staged += n
                host, base, staged = self._staging(n), 0, True
            job = (i, kind, key, host, base, n, staged)
            mark = len(copies)
            try:
                self.copier.copies(plan, host, base, copies, skip_null=False)
            except ValueError as e:  # a block id outside the allocation: this entry is not saved
                logger.warning("v4pool.vllm: save of %s%x not made: %s", kind, key, e)
                del copies[mark:]  # (a merged copy before it writes valid pages into its room)
                self._release(job, bad=True)
                continue
            jobs.append(job)
        event = None
        try:
            if copies:
                event = self.copier.to_host_async(copies)
        except Exception as e:  # noqa: BLE001 -- nothing of the batch is published
            logger.warning("v4pool.vllm: device-to-host copies of %d entries failed: %r", len(jobs), e)
            for job in jobs:
                self._release(job, bad=True)
            jobs = []
        if not self.publisher.submit(lambda: self._publish_async(jobs, event, len(transfers), after)):
            for job in jobs:
                self._release(job, bad=False)
        return event

    def _publish_async(self, jobs: list, event: Any, count: int,
                       after: Callable[[list[bool]], None] | None) -> None:
        """On the publisher's thread: the bodies of ``jobs`` into the files once ``event``'s
        copies are done, then ``after``. Every entry is released, whatever fails."""
        done = [False] * count
        left = collections.deque(jobs)  # the head is popped per entry (4,097 at 1M tokens)
        try:
            if event is not None:
                event.synchronize()
            while left:
                i, kind, key, host, base, n, _ = job = left[0]
                try:
                    done[i] = bool(self.files.put(kind, key, [host.narrow(0, base, n)]))
                except Exception as e:  # noqa: BLE001 -- not published: a miss later
                    logger.warning("v4pool.vllm: publish of %s%x failed: %r", kind, key, e)
                if not done[i]:
                    with self._lock:
                        self.stats["publish_failed"] += 1
                self._release(left.popleft(), bad=False)
        finally:
            # Copies that failed (their bytes are not the pages): dropped from the ring.
            for job in left:
                self._release(job, bad=True)
        if after is not None:
            after(done)

    def _release(self, job: tuple, bad: bool) -> None:
        _, kind, key, _, _, n, staged = job
        if staged:
            with self._lock:
                self._staged -= n
        elif self.ring is not None:
            if bad:  # still held: the caller's thread drops it (_drop_bad)
                self._bad.append((kind, key))
            else:
                self.ring.publishing.discard((kind, key))

    def _drop_bad(self) -> None:
        while self._bad and self.ring is not None:
            k = self._bad.popleft()
            self.ring.publishing.discard(k)
            self.ring.drop(*k)

    def wait_published(self, timeout: float | None = None) -> bool:
        """Wait until every save handed to the publisher so far is published (or failed)."""
        return self.publisher is None or self.publisher.wait_idle(timeout)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the publisher (what is queued is published, within ``timeout`` seconds), then
        free the ring; whether the publisher stopped (if not, the ring is left to it)."""
        stopped = self.publisher is None or self.publisher.close(timeout)
        if stopped and self.ring is not None:
            self.ring.close()
        return stopped

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
        self._drop_bad()

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
