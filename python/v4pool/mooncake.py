"""Mooncake Store as the fleet's shared tier: `MooncakeStore` adapts Mooncake's
`MooncakeDistributedStore` (the `mooncake-transfer-engine` wheels' only store binding: they
ship no C ABI) to the protocol `KvManager.set_shared_store` calls. The entries are the file
tier's bytes (header, layout id, checksummed payload), checked in Rust before a byte reaches
the pool; this module only moves them. docs/fleet.md says why here and not in Rust.

    store = MooncakeStore.connect("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    manager.set_shared_store(store, capacity_bytes=store.segment_bytes)

**Bounded calls.** With the master gone, a client call can block for good (seen with
0.3.14: `batch_is_exist` waits on its RPC pool's semaphore whatever `MC_RPC_TIMEOUT_MS`
says). So every store call runs on a worker thread and is waited for at most `timeout`
seconds; one that overruns is abandoned and marks the store **down**: every later call is a
miss (`MooncakeDown`) that touches no client, until `backoff` seconds have passed; then one
call goes through as a probe (an answer, even an error code, brings the store back; another
overrun doubles the back-off, up to `max_backoff`). The binding releases the GIL inside its
calls, so a stuck worker holds nothing the engine needs.

**Buffers.** An abandoned `put_from` / `get_into` may still read or write the tier's staging
buffer whenever the client wakes up. While one is outstanding the store stays down (a late
write can then never land between a later read's check and its copy into the pool), and
`unregister_buffer` of that buffer raises `MooncakeBufferBusy` (errno EBUSY), which the Rust
tier answers by never freeing it; the worker unregisters it when the call returns. An
unregistration asked for while the store is down is done when it is back up (or by
`close`); a registration that completes after its caller gave up is undone at once. So no
registration outlives its buffer, and no freed buffer is one a call may touch.
"""

import errno
import os
import queue
import threading
import time

def _never_free(client):
    """Keep a client whose master vanished alive until the process ends, and never run its
    destructor: it holds the GIL for 10-20 s (its teardown RPCs time out one by one) and, at
    interpreter exit, wakes the calls we abandoned, whose threads then die re-taking the GIL
    inside C++ frames that may not unwind (`std::terminate`: the process aborts). One
    reference nobody owns does it; the memory goes with the process."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


class MooncakeError(OSError):
    """A Mooncake call returned an error code (the manager counts it as a miss)."""


class MooncakeDown(MooncakeError):
    """The store is down (a call overran its timeout): a miss, no client call made."""


class MooncakeBufferBusy(MooncakeError):
    """An abandoned call may still touch this buffer: it must not be freed."""

    def __init__(self, msg):
        super().__init__(errno.EBUSY, msg)


def _ok(what, code):
    if code != 0:
        raise MooncakeError(f"mooncake {what}: error {code}")


def _env_seconds(name, default):
    v = os.environ.get(name)
    return float(v) if v else default


# The calls that read or write a buffer's bytes (registrations only record ranges).
_TOUCHES_BUFFER = ("put_from", "get_into")


class _Job:
    __slots__ = ("fn", "args", "what", "addr", "done", "result", "error", "abandoned")

    def __init__(self, what, fn, args, addr):
        self.what, self.fn, self.args, self.addr = what, fn, args, addr
        self.done = threading.Event()
        self.result = self.error = None
        self.abandoned = False


class MooncakeStore:
    """The shared-tier store protocol over a `MooncakeDistributedStore` already set up, each
    call bounded (see the module docs). `timeout` / `backoff` default to
    `$V4POOL_MOONCAKE_TIMEOUT_S` (5) and `$V4POOL_MOONCAKE_BACKOFF_S` (30)."""

    def __init__(self, store, segment_bytes=0, timeout=None, backoff=None, max_backoff=None):
        self.store = store
        self.segment_bytes = segment_bytes
        self.timeout = timeout if timeout is not None else _env_seconds("V4POOL_MOONCAKE_TIMEOUT_S", 5.0)
        self.backoff = backoff if backoff is not None else _env_seconds("V4POOL_MOONCAKE_BACKOFF_S", 30.0)
        self.max_backoff = max_backoff if max_backoff is not None else max(self.backoff, 300.0)
        # Every key this process put, in order (what a test or an operator can look up:
        # Mooncake lists no keys).
        self.put_keys = []
        self.closed = False
        self._lock = threading.Lock()
        self._queue = None
        self._down_until = None  # monotonic time of the next probe; None: up
        self._next_backoff = self.backoff
        self._stuck = set()  # abandoned jobs still running
        self._registered = {}  # addr -> size, as the client has them
        self._unregister_later = set()  # addrs to unregister once up (or when their call ends)
        self.counters = {"timeouts": 0, "down": 0, "refused_down": 0, "probes": 0, "recovered": 0}

    @classmethod
    def connect(cls, master, metadata_server, local_hostname="127.0.0.1", segment_bytes=1 << 30,
                buffer_bytes=64 << 20, protocol="tcp", device="", timeout=None, backoff=None):
        """A client of the master at `master` (`host:port`) with its metadata server
        (`http://host:port/metadata`, or `P2PHANDSHAKE`), mounting a segment of
        `segment_bytes` of this process's memory into the store."""
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        _ok("setup", s.setup(local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol, device,
                             master))
        return cls(s, segment_bytes, timeout=timeout, backoff=backoff)

    @classmethod
    def from_config(cls, cfg, to_bytes=int):
        """`connect` from a dict (the vLLM connector's `shared_store`): `master` and
        `metadata` as `connect` takes them, and optionally `local_hostname`, `segment_bytes`,
        `buffer_bytes` (sizes through `to_bytes`), `protocol`, `device`, `timeout`, `backoff`.
        An unknown key is refused (a typo would otherwise pass silently)."""
        known = {"master", "metadata", "local_hostname", "segment_bytes", "buffer_bytes", "protocol", "device",
                 "timeout", "backoff"}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"shared_store: unknown keys {unknown} (known: {sorted(known)})")
        args = {k: v for k, v in cfg.items() if k not in ("master", "metadata")}
        for k in ("segment_bytes", "buffer_bytes"):
            if k in args:
                args[k] = to_bytes(args[k])
        return cls.connect(cfg["master"], cfg["metadata"], **args)

    # ---- the bounded call ----------------------------------------------------------------

    def _worker(self, q):
        while True:
            job = q.get()
            if job is None:
                return
            try:
                job.result = job.fn(*job.args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                job.error = e
            with self._lock:
                job.done.set()
                if not job.abandoned:
                    continue
                self._stuck.discard(job)
                late = self._finish_late(job)
            for fn, args in late:
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 - best effort, on a client that was stuck
                    pass
            # This worker was replaced when its job was abandoned: it ends here.
            return

    def _finish_late(self, job):
        """What to run after an abandoned `job` returned (under the lock): undo a registration
        its caller gave up on, or an unregistration deferred because of it."""
        addr = job.addr
        if addr is None:
            return []
        busy = any(j.addr == addr and j.what in _TOUCHES_BUFFER for j in self._stuck)
        if job.what == "register_buffer" and job.error is None and job.result == 0:
            # The tier saw a failure and freed (or will free) this buffer: undo it now.
            return [(self.store.unregister_buffer, (addr,))]
        if addr in self._unregister_later and not busy:
            self._unregister_later.discard(addr)
            self._registered.pop(addr, None)
            return [(self.store.unregister_buffer, (addr,))]
        return []

    def _call(self, what, fn, *args, addr=None):
        if self.closed:
            raise MooncakeError("the store is closed")
        with self._lock:
            probe = False
            if self._down_until is not None:
                now = time.monotonic()
                buffer_stuck = any(j.what in _TOUCHES_BUFFER for j in self._stuck)
                if now < self._down_until or buffer_stuck:
                    self.counters["refused_down"] += 1
                    raise MooncakeDown(f"mooncake {what}: the store is down (a call overran "
                                       f"{self.timeout:g} s; next probe in "
                                       f"{max(self._down_until - now, 0):.0f} s)")
                probe = True
                self.counters["probes"] += 1
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._worker, args=(self._queue,), daemon=True,
                                 name="v4pool-mooncake").start()
            job = _Job(what, fn, args, addr)
            self._queue.put(job)
        if not job.done.wait(self.timeout):
            with self._lock:
                if not job.done.is_set():
                    job.abandoned = True
                    self._stuck.add(job)
                    # The worker is stuck in this job: the next call gets a new one.
                    self._queue = None
                    self.counters["timeouts"] += 1
                    if self._down_until is None:
                        self.counters["down"] += 1
                    else:
                        self._next_backoff = min(self._next_backoff * 2, self.max_backoff)
                    self._down_until = time.monotonic() + self._next_backoff
                    raise MooncakeDown(f"mooncake {what}: no answer in {self.timeout:g} s; the store "
                                       f"is down for {self._next_backoff:g} s")
        if probe:
            self._up()
        if job.error is not None:
            raise job.error
        return job.result

    def _up(self):
        """A probe answered: the store is back; finish the unregistrations it missed."""
        with self._lock:
            if self._down_until is None:
                return
            self._down_until = None
            self._next_backoff = self.backoff
            self.counters["recovered"] += 1
            todo = [a for a in self._unregister_later
                    if not any(j.addr == a and j.what in _TOUCHES_BUFFER for j in self._stuck)]
        for addr in todo:
            try:
                self._call("unregister_buffer", self.store.unregister_buffer, addr, addr=addr)
            except MooncakeError:
                return
            with self._lock:
                self._unregister_later.discard(addr)
                self._registered.pop(addr, None)

    # ---- state, for tests and operators --------------------------------------------------

    @property
    def down(self):
        """Whether calls are refused now (a call overran; no probe has answered since)."""
        return self._down_until is not None

    def stuck_calls(self):
        """Names of abandoned calls still running in the client."""
        with self._lock:
            return sorted(j.what for j in self._stuck)

    def registrations(self):
        """Buffers the client has registered as far as this adapter knows, `{addr: size}`
        (those whose unregistration waits for the store to answer included)."""
        with self._lock:
            return dict(self._registered)

    def pending_unregistrations(self):
        """Buffers the tier gave back while the store could not be asked."""
        with self._lock:
            return sorted(self._unregister_later)

    # ---- the protocol --------------------------------------------------------------------

    def register_buffer(self, addr, size):
        with self._lock:
            again = addr in self._unregister_later
        if again:
            # A new buffer where an old one was registered: the old registration goes first
            # (an error code means the client holds it no more: gone either way).
            self._call("unregister_buffer", self.store.unregister_buffer, addr, addr=addr)
            with self._lock:
                self._unregister_later.discard(addr)
                self._registered.pop(addr, None)
        _ok("register_buffer", self._call("register_buffer", self.store.register_buffer, addr, size, addr=addr))
        with self._lock:
            self._registered[addr] = size

    def unregister_buffer(self, addr):
        # A tier dropped after close() gives its buffer back to nothing: close() released it.
        if self.closed:
            return
        with self._lock:
            if addr not in self._registered:
                return
            if any(j.addr == addr and j.what in _TOUCHES_BUFFER for j in self._stuck):
                self._unregister_later.add(addr)
                raise MooncakeBufferBusy(f"mooncake unregister_buffer {addr:#x}: an abandoned call may "
                                         "still touch it")
            if self._down_until is not None:
                # Nothing of the client touches it (no call on it is outstanding): the tier
                # may free it; the registration goes when the store answers again.
                self._unregister_later.add(addr)
                return
        _ok("unregister_buffer", self._call("unregister_buffer", self.store.unregister_buffer, addr, addr=addr))
        with self._lock:
            self._registered.pop(addr, None)

    def exist(self, keys):
        codes = self._call("batch_is_exist", self.store.batch_is_exist, keys)
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            raise MooncakeError(f"mooncake batch_is_exist: {codes[:8]}")
        return [c == 1 for c in codes]

    def size(self, key):
        n = self._call("get_size", self.store.get_size, key)
        if n >= 0:
            return n
        # A negative size is "no such key" or a failure: which one, the existence check says.
        e = self._call("is_exist", self.store.is_exist, key)
        if e == 0:
            return None
        raise MooncakeError(f"mooncake get_size {key}: error {n} (is_exist {e})")

    def _buffer_of(self, addr):
        with self._lock:
            for a, n in self._registered.items():
                if a <= addr < a + n:
                    return a
        return addr

    def put(self, key, addr, size):
        _ok("put_from", self._call("put_from", self.store.put_from, key, addr, size, addr=self._buffer_of(addr)))
        self.put_keys.append(key)

    def get_into(self, key, addr, size):
        n = self._call("get_into", self.store.get_into, key, addr, size, addr=self._buffer_of(addr))
        if n != size:
            raise MooncakeError(f"mooncake get_into {key}: {n} of {size} bytes")

    def remove(self, key):
        # Forced: a refused entry goes even while a reader holds its lease.
        return self._call("remove", self.store.remove, key, True) == 0

    def close(self):
        """Release the client. A store that is down is not asked (its teardown would block
        on the vanished master): the client is kept, unreleased, until the process exits."""
        if self.closed:
            return
        if self._down_until is not None or self._stuck:
            self.closed = True
            _never_free(self.store)
            return
        with self._lock:
            todo = sorted(self._unregister_later)
        for addr in todo:
            try:
                self._call("unregister_buffer", self.store.unregister_buffer, addr, addr=addr)
            except MooncakeError:
                break
        self.closed = True
        if self._queue is not None:
            self._queue.put(None)
        self.store.close()
