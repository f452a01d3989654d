"""Hostile inputs from Python on the host backend: forged array interfaces, lying tensors,
huge sizes, wrong dtypes, several threads. Each case runs in a child interpreter, so a crash
(a segfault, an abort) fails its test instead of killing the run; the child exits 0 only if
every call was refused with a Python exception (or, for valid calls, did the right thing).

Before the fix the forged `__array_interface__` given to `Decode.stage` or as
`Pool(memory=...)`, the lying `data_ptr()` and `read_plane(0, 0, 2**46)` each killed the
interpreter."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import numpy as np, v4pool, threading
plan = v4pool.plan(model="v4-flash", budget="256MiB", max_seqs=4)

def refused(f, *exc):
    try:
        f()
    except (exc or Exception) as e:
        return e
    raise AssertionError("accepted: %r" % (f,))

class Forged:
    # Claims to be an int64 array at address 0x1000.
    def __init__(self, n=4, typestr="<i8"):
        self.__array_interface__ = {"data": (0x1000, False), "shape": (n,), "typestr": typestr,
                                    "strides": None, "version": 3}
        self.nbytes = 8 * n
"""


def run(body, setup="", timeout=300):
    code = PRELUDE + setup + textwrap.dedent(body)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"child still running after {timeout} s (a hang)\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, f"child exited {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_forged_array_interface_to_stage_is_refused():
    run("""
    pool = v4pool.Pool(plan, backend="host")
    dec = pool.decode(2, 8)
    s = pool.alloc_slot()
    ok = np.array([s.position], dtype=np.int64)
    refused(lambda: dec.stage(Forged(1), ok), TypeError)
    refused(lambda: dec.stage(ok, Forged(1)), TypeError)
    refused(lambda: dec.stage(ok, np.array([300]), block_tables=Forged(2, "<i4")), TypeError, ValueError)
    refused(lambda: dec.write_block_table(0, Forged(2, "<i4")), TypeError)
    # The real thing still works.
    assert dec.stage(ok, np.array([300], dtype=np.int64),
                     block_tables=np.array([[0, 1]], dtype=np.int32)) == 1
    dec.build()
    """)


def test_forged_memory_is_refused():
    run("""
    refused(lambda: v4pool.Pool(plan, backend="host", memory=Forged(1 << 28)), TypeError)
    class LyingTensor:
        def data_ptr(self): return 0x1000
        def is_contiguous(self): return True
        is_cuda = False
        def numel(self): return 1 << 40
        def element_size(self): return 1
    refused(lambda: v4pool.Pool(plan, backend="host", memory=LyingTensor()), TypeError)
    class NotACapsule:
        def __dlpack__(self, *a, **k): return 0x1000
        def __dlpack_device__(self): return (1, 0)
    refused(lambda: v4pool.Pool(plan, backend="host", memory=NotACapsule()), TypeError)
    # Read-only and strided numpy memory is refused too.
    need = v4pool.Pool.required_bytes(plan)
    ro = np.zeros(need, dtype=np.uint8); ro.flags.writeable = False
    refused(lambda: v4pool.Pool(plan, backend="host", memory=ro))
    refused(lambda: v4pool.Pool(plan, backend="host", memory=np.zeros(2 * need, np.uint8)[::2]), ValueError)
    # Over_pointer (a raw address from Python) is gone.
    assert not hasattr(v4pool.Pool, "over_pointer")
    """)


def test_huge_sizes_are_refused_before_allocating():
    run("""
    pool = v4pool.Pool(plan, backend="host")
    for n in [2**46, 2**63 - 1]:
        e = refused(lambda: pool.read_plane(0, 0, n), v4pool.V4PoolError, OverflowError)
    e = refused(lambda: pool.read_plane(0, 2**64 - 1, 2), v4pool.V4PoolError, OverflowError)
    refused(lambda: pool.read_plane(7, 0, 1), v4pool.V4PoolError)
    refused(lambda: pool.write_plane(0, 2**64 - 1, b"ab"), v4pool.V4PoolError, OverflowError)
    refused(lambda: pool.decode(2**62, 2**62), v4pool.V4PoolError, OverflowError, ValueError)
    dec = pool.decode(2, 8)
    refused(lambda: dec.stage(np.zeros(10**6, np.int64), np.ones(10**6, np.int64)), v4pool.V4PoolError)
    refused(lambda: dec.write_block_table(2**40, np.zeros(1, np.int32)), v4pool.V4PoolError, OverflowError)
    refused(lambda: dec.write_block_table(0, np.zeros(1, np.int32), start_col=2**62), v4pool.V4PoolError)
    assert len(pool.read_plane(0, 0, 16)) == 16
    """)


# One sequence staged on a fresh pool's decode buffers: its position and context.
STAGE_ONE = """
pool = v4pool.Pool(plan, backend="host")
dec = pool.decode(2, 8)
s = pool.alloc_slot()
pos = np.array([s.position], dtype=np.int64)
ctx = np.array([300], dtype=np.int64)
"""


def test_wrong_dtypes_and_shapes_are_refused():
    run(setup=STAGE_ONE, body="""
    for bad in [pos.astype(np.float64), pos.astype(np.int32), pos.astype(np.uint8),
                np.array([s.position, 0, s.position, 0], dtype=np.int64)[::2]]:
        refused(lambda: dec.stage(bad, ctx), TypeError)
    tables = np.array([[0, 1]], dtype=np.int32)
    refused(lambda: dec.stage(pos, ctx, block_tables=tables.astype(np.int64)), TypeError)
    refused(lambda: dec.stage(pos, ctx, block_tables=np.asfortranarray(np.array([[0, 1], [2, 3]], np.int32))), TypeError, ValueError)
    refused(lambda: dec.stage(pos, ctx, block_tables=np.array([0, 1], np.int32)), ValueError)
    refused(lambda: dec.stage(["a"], ctx), TypeError)
    refused(lambda: dec.stage(pos, ctx, block_tables=np.array([[-1, 2**31 - 1]], np.int32)), v4pool.V4PoolError)
    # Lists still work (copied).
    assert dec.stage([s.position], [300], block_tables=tables) == 1
    """)


def test_arrays_of_the_wrong_rank_are_refused_not_flattened():
    # Seen failing before the fix: a [1, 1] positions array (and 2-D context lengths and
    # token counts, 3-D block tables, 2-D resident-table ids) was flattened and staged.
    run(setup=STAGE_ONE, body="""
    tables = np.array([[0, 1]], dtype=np.int32)
    for e in [refused(lambda: dec.stage(pos.reshape(1, 1), ctx, block_tables=tables), ValueError),
              refused(lambda: dec.stage(pos, ctx.reshape(1, 1), block_tables=tables), ValueError),
              refused(lambda: dec.stage(pos, ctx, np.ones((1, 1), np.int64), block_tables=tables), ValueError),
              refused(lambda: dec.stage(pos.reshape(()), ctx, block_tables=tables), ValueError),
              refused(lambda: dec.stage(pos, ctx, block_tables=tables.reshape(1, 1, 2)), ValueError),
              refused(lambda: dec.write_block_table(0, tables), ValueError)]:
        assert "1-D" in str(e) or "2-D" in str(e), e
    assert dec.stage(pos, ctx, block_tables=tables) == 1
    dec.write_block_table(0, tables[0])
    """)


def test_several_threads_do_not_crash():
    run("""
    pool = v4pool.Pool(plan, backend="host")
    errors = []
    def worker(k):
        try:
            dec = pool.decode(2, 8)
            for i in range(200):
                try:
                    s = pool.alloc_slot()
                except v4pool.V4PoolError:
                    continue
                try:
                    dec.stage(np.array([s.position], np.int64), np.array([300], np.int64),
                              block_tables=np.array([[0, 1]], np.int32))
                    dec.build()
                except v4pool.V4PoolError:
                    pass
                pool.read_plane(k % 2, 0, 64)
                pool.write_plane(k % 2, 4096 * k, bytes(range(32)))
                try:
                    if i % 7 == 0:
                        pool.grow_slots(1)
                    if i % 11 == 0:
                        pool.shrink_slots(1)
                except v4pool.V4PoolError:
                    pass
                pool.free_slot(s)
        except Exception as e:
            errors.append(repr(e))
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert not errors, errors
    """)


@pytest.mark.parametrize("model", ["/dev/zero", "/dev/urandom"])
def test_config_devices_are_refused_unread(model):
    run(f"""
    e = refused(lambda: v4pool.plan(model={model!r}, budget="256MiB", max_seqs=4), v4pool.V4PoolError)
    assert e.variant == "NotAFile", e.variant
    """)


def test_config_fifo_is_refused_without_blocking(tmp_path):
    import os
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    run(f"""
    e = refused(lambda: v4pool.plan(model={str(fifo)!r}, budget="256MiB", max_seqs=4), v4pool.V4PoolError)
    assert e.variant == "NotAFile", e.variant
    """)


# A store (the `KvManager.set_shared_store` protocol) whose `exist` runs `probe()` first:
# `calls` counts its calls, `seen` the variants of the errors `probe` raised.
REENTRANT_STORE = """
class ProbingStore:
    def __init__(self, probe):
        self.probe, self.calls, self.seen = probe, 0, []
    def register_buffer(self, addr, size): pass
    def unregister_buffer(self, addr): pass
    def exist(self, keys):
        self.calls += 1
        try:
            self.probe()
        except v4pool.V4PoolError as e:
            self.seen.append(e.variant)
        return [False] * len(keys)
    def size(self, key): return None
    def put(self, key, addr, size): pass
    def get_into(self, key, addr, size): raise KeyError(key)
    def remove(self, key): return False

pool = v4pool.Pool(plan, backend="host")
m = v4pool.KvManager(pool, policy="fixed", slots=1, checkpoint_every=0, rolling=False)
"""


def test_defect43_row8_a_store_calling_its_manager_is_refused_not_deadlocked():
    """defect43 row 8: a store whose `exist()` calls `m.stats()` or `m.set_shared_store(None)`
    on the manager that is calling it: `admit` never returned (the manager's lock, taken
    again on the same thread). The call is refused with `variant == "Reentrant"` and the
    admission completes as a miss."""
    run("""
    probes = [lambda: m.stats(), lambda: m.set_shared_store(None), lambda: m.match_prefix([1] * 512),
              lambda: m.check_invariants()]
    for k, probe in enumerate(probes):
        store = ProbingStore(probe)
        m.set_shared_store(store)
        rid = m.add_request([k] * 600)
        assert m.admit(rid) == 0
        m.finish(rid)
        assert store.calls > 0, (k, "the store was never asked")
        assert store.seen == ["Reentrant"] * store.calls, (k, store.seen)
    m.set_shared_store(None)
    m.check_invariants()
    assert m.stats()["admissions"] == len(probes)
    """, setup=REENTRANT_STORE, timeout=60)


def test_defect43_row8_another_thread_waits_for_the_manager_without_the_gil():
    """defect43 row 8, across threads: while the manager calls its store (which runs Python,
    so needs the GIL), another thread's `m.stats()` waited for the manager's lock holding the
    GIL: neither could go on. It now waits with the GIL released, and both finish."""
    run("""
    import time
    entered, out = threading.Event(), []
    def slow():
        entered.set()
        time.sleep(0.5)  # the other thread takes the GIL meanwhile and asks for the manager
    store = ProbingStore(slow)
    m.set_shared_store(store)
    rid = m.add_request([7] * 600)
    def other():
        entered.wait()
        out.append(m.stats()["admissions"])
    t = threading.Thread(target=other)
    t.start()
    assert m.admit(rid) == 0
    t.join()
    assert store.calls > 0 and out == [1], (store.calls, out)
    """, setup=REENTRANT_STORE, timeout=60)
