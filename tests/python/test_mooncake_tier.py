"""Mooncake Store as the shared tier (`v4pool.mooncake`, `KvManager.set_shared_store`), over
TCP loopback against a real `mooncake_master` (its HTTP metadata server on): a V4-Flash
prefix of 8K or 128K tokens one process committed restores in another byte-exact (every
block's whole unit and the slot's checkpoint image: window rows and compressor state) onto
a poisoned pool; a corrupt entry, an entry of another layout under this layout's key and a
reader of another layout are misses that never reach the pool; the master killed mid-run
leaves both engines serving (misses, failed publications counted) with nothing held, each
store call bounded by the adapter (`v4pool.mooncake`; its logic alone:
tests/python/test_mooncake_adapter.py).

1M tokens runs with V4POOL_MOONCAKE_1M=1, not in CI: the store keeps values in the writer's
mounted segment, so a 1M prefix needs a 4.4 GB segment beside two 4.3 GB pools (13 GB, beside
the rest of CI on a shared 23 GB machine).

Needs the `mooncake-transfer-engine-cuda13` wheel importable (libibverbs1, libcudart 13 and
a libcuda.so.1 on the loader path: .ci/run's Mooncake step); otherwise SKIP, or a failure
with V4POOL_REQUIRE_MOONCAKE=1.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import v4pool

BLOCK = 256


def _mooncake():
    try:
        import mooncake.store  # noqa: F401
        import mooncake

        return os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    except Exception as e:  # ImportError, or a missing system library (OSError)
        if os.environ.get("V4POOL_REQUIRE_MOONCAKE") == "1":
            raise
        pytest.skip(f"mooncake store not importable here: {e}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A `mooncake_master` on loopback with its HTTP metadata server."""

    def __init__(self, binary):
        self.port, self.http = _free_port(), _free_port()
        self.proc = subprocess.Popen(
            [binary, f"--port={self.port}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}",
             f"--metrics_port={_free_port()}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.http), timeout=1).close()
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("mooncake_master did not start")
                time.sleep(0.2)

    @property
    def args(self):
        return f"127.0.0.1:{self.port}", f"http://127.0.0.1:{self.http}/metadata"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture()
def master():
    m = Master(_mooncake())
    yield m
    m.kill()


def engine(tokens, master_args, mtp=1, segment=0, timeout=None):
    """A manager over a fresh V4-Flash host pool with room for `tokens` and one slot, a
    checkpoint at prompt ends only, Mooncake as its shared tier (mounting `segment` bytes;
    each store call bounded by `timeout` s, the adapter's default when None):
    (manager, pool, store)."""
    import v4pool.mooncake

    blocks = tokens // BLOCK + 8
    plan = v4pool.plan(model="v4-flash", budget=f"{blocks * 11 // 10 + 80}MiB", max_seqs=1, spec_steps=mtp)
    pool = v4pool.Pool(plan, backend="host")
    m = v4pool.KvManager(pool, policy="fixed", slots=1, checkpoint_every=0, rolling=False)
    segment = segment or (64 << 20)
    store = v4pool.mooncake.MooncakeStore.connect(*master_args, segment_bytes=segment, timeout=timeout)
    m.set_shared_store(store, capacity_bytes=segment)
    return m, pool, store


def tokens_of(seed, n):
    return np.random.default_rng(seed).integers(0, 1 << 31, size=n + BLOCK).tolist()


def digest(m, pool, rid):
    """Every block's whole unit and the slot's checkpoint image, hashed in order."""
    h = hashlib.sha256(pool.read_units(m.blocks(rid)))
    h.update(pool.checkpoint(m.slot(rid))[1])
    return h.hexdigest()


def assert_drained(m, pool):
    """Everything back in the pool once the cache is emptied."""
    m.complete_inflight()
    m.check_invariants()
    m.evict_all()
    c = pool.counts()
    assert (c["free_blocks"], c["free_slots"]) == (c["num_blocks"], c["num_slots"]), c


def commit_prefix(n, seed, master_args, timeout=None):
    """The writer (this process): commit a prefix of `n` tokens with random bytes in every
    block unit and the whole slot image, publish it; (manager, pool, store, digest)."""
    m, pool, store = engine(n, master_args, segment=(n // BLOCK + 16) * (3 << 20) // 2, timeout=timeout)
    t = tokens_of(seed, n)
    rid = m.add_request(t[:n])
    assert m.admit(rid) == 0
    m.allocate(rid, n)
    rng = np.random.default_rng(seed ^ 0xFEED)
    blocks = m.blocks(rid)
    pool.write_units(blocks, rng.bytes(len(pool.read_units(blocks)) ))
    layout, img = pool.checkpoint(m.slot(rid))
    pool.restore(m.slot(rid), layout, rng.bytes(len(img)))
    m.commit(rid, n)
    t0 = time.time()
    m.complete_inflight()
    secs = time.time() - t0
    s = m.stats()
    assert (s["shared_published_blocks"], s["shared_published_checkpoints"]) == (n // BLOCK, 1), s
    assert s["shared_write_failures"] == 0
    want = digest(m, pool, rid)
    m.finish(rid)
    print(f"writer: {n} tokens, {s['shared_published_bytes'] / 1e9:.2f} GB published in {secs:.2f} s "
          f"({s['shared_published_bytes'] / secs / 1e9:.2f} GB/s)")
    return m, pool, store, want


def run_reader(n, seed, master_args, mtp=1):
    """The reader, in another process: its report."""
    out = subprocess.run([sys.executable, __file__, "reader", str(n), str(seed), str(mtp), *master_args],
                         capture_output=True, text=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert out.returncode == 0 and line, out.stdout + out.stderr[-4000:]
    return json.loads(line[-1])


def reader_main(n, seed, mtp, master_args):
    """A fresh poisoned pool admits the prefix and one more block; prints the hit, the digest
    of what came back and the counters as JSON; then gives everything back."""
    m, pool, store = engine(n, master_args, mtp=mtp)
    rng = np.random.default_rng(0xBAD)
    for p, w in enumerate(pool.plane_widths):
        pool.write_plane(p, 0, rng.bytes(pool.plane_rows * w))
    t = tokens_of(seed, n)
    rid = m.add_request(t)
    t0 = time.time()
    hit = m.admit(rid)
    secs = time.time() - t0
    m.complete_inflight()
    m.check_invariants()
    d = digest(m, pool, rid) if hit else ""
    s = m.stats()
    m.finish(rid)
    assert_drained(m, pool)
    print(json.dumps({"hit": hit, "digest": d, "admit_s": secs, **s}))


@pytest.mark.parametrize("n", [8 << 10, 128 << 10] + ([1 << 20] if os.environ.get("V4POOL_MOONCAKE_1M") == "1" else []))
def test_a_prefix_committed_in_one_process_restores_in_another(master, n):
    seed = 0x3500 + n
    m, pool, store, want = commit_prefix(n, seed, master.args)
    r = run_reader(n, seed, master.args)
    print(f"reader: hit={r['hit']} admit {r['admit_s']:.3f} s "
          f"({r['shared_restored_bytes'] / max(r['admit_s'], 1e-9) / 1e9:.2f} GB/s)")
    assert r["hit"] == n and r["digest"] == want, r
    assert (r["shared_restored_blocks"], r["shared_restored_checkpoints"], r["shared_refused"]) == (n // BLOCK, 1, 0)
    assert_drained(m, pool)
    store.close()


def test_two_writers_of_one_prefix_a_reader_restores_one_of_them_whole(master):
    # Two engines compute the same prefix (the same keys) with different bytes, both before
    # either publishes, then publish one after the other; whatever the store keeps of the
    # second's puts (an overwrite or a refusal, counted, never an error), a reader restores one
    # writer's prefix whole, never a mixture, and nothing is held afterwards.
    n, seed = 8 << 10, 0x35AA
    seg = (n // BLOCK + 16) * (3 << 20) // 2
    writers = []
    for byte_seed in (1, 2):
        m, pool, store = engine(n, master.args, segment=seg)
        rid = m.add_request(tokens_of(seed, n)[:n])
        assert m.admit(rid) == 0  # nothing published yet: both compute the prefix
        m.allocate(rid, n)
        rng = np.random.default_rng(byte_seed)
        blocks = m.blocks(rid)
        pool.write_units(blocks, rng.bytes(len(pool.read_units(blocks))))
        layout, img = pool.checkpoint(m.slot(rid))
        pool.restore(m.slot(rid), layout, rng.bytes(len(img)))
        m.commit(rid, n)
        writers.append((m, pool, store, rid))
    wants = []
    for m, pool, store, rid in writers:
        m.complete_inflight()
        wants.append(digest(m, pool, rid))
        m.finish(rid)
    assert wants[0] != wants[1]
    r = run_reader(n, seed, master.args)
    assert r["hit"] == n and r["digest"] in wants, r
    print(f"two writers: the reader restored writer {wants.index(r['digest'])}'s prefix; the second's "
          f"write failures {writers[1][0].stats()['shared_write_failures']}")
    for m, pool, store, _ in writers:
        assert_drained(m, pool)
        store.close()


def test_refused_entries_and_another_layout_are_misses(master):
    n, seed = 8 << 10, 0x35FF
    m, pool, store, want = commit_prefix(n, seed, master.args)
    # A reader of another layout (no MTP layer) finds nothing of this one's.
    assert run_reader(n, seed, master.args, mtp=0)["hit"] == 0
    hashes = m.block_hashes(tokens_of(seed, n)[:n])
    key = lambda kind, h: next(k for k in store.put_keys if k.endswith(f"{kind}{h:032x}"))  # noqa: E731
    # A corrupt block in the middle: refused (a miss, the entry removed), the chain stops.
    mid = key("b", hashes[len(hashes) // 2])
    good = store.store.get(mid)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 4
    assert store.store.remove(mid, force=True) == 0 and store.store.put(mid, bytes(bad)) == 0
    r = run_reader(n, seed, master.args)
    assert (r["hit"], r["shared_refused"]) == (0, 1), r
    assert store.store.is_exist(mid) == 0, "the corrupt entry stays"
    # The same entry truncated (a torn value): refused the same way.
    assert store.store.put(mid, bytes(good[: len(good) // 3])) == 0
    r = run_reader(n, seed, master.args)
    assert (r["hit"], r["shared_refused"]) == (0, 1), r
    assert store.store.is_exist(mid) == 0, "the truncated entry stays"
    assert store.store.put(mid, good) == 0
    # Another layout's whole entry under this layout's checkpoint key: refused, a miss.
    other, other_pool, other_store, _ = commit_prefix_of_layout(n, seed, master.args, mtp=0)
    ck = key("c", hashes[-1])
    foreign = other_store.store.get(next(k for k in other_store.put_keys if k.endswith(ck[-33:])))
    assert store.store.remove(ck, force=True) == 0 and store.store.put(ck, foreign) == 0
    r = run_reader(n, seed, master.args)
    assert (r["hit"], r["shared_refused"]) == (0, 1), r
    assert_drained(other, other_pool)
    assert_drained(m, pool)


def commit_prefix_of_layout(n, seed, master_args, mtp):
    """The prompt of `commit_prefix` published by a pool of another layout."""
    m, pool, store = engine(n, master_args, mtp=mtp, segment=(n // BLOCK + 16) * (3 << 20) // 2)
    rid = m.add_request(tokens_of(seed, n)[:n])
    m.admit(rid)
    m.allocate(rid, n)
    m.commit(rid, n)
    m.complete_inflight()
    m.finish(rid)
    return m, pool, store, None


def test_the_master_killed_mid_run_leaves_the_engines_serving(master):
    """With the master gone the client's next call blocks for good (0.3.14); the adapter's
    bounded wait turns it into a miss and the store down: both engines admit (misses),
    commit and publish (failures counted) within a few timeouts, and give every block, slot
    and staging buffer back. In a child process (`killed_main`), which ends with `os._exit`:
    the abandoned call wakes while CPython 3.11 finalizes, and a thread woken then is ended
    by `pthread_exit`, which cannot unwind pybind11's frames (`std::terminate`, an abort
    after the test passed; docs/fleet.md)."""
    out = subprocess.run([sys.executable, __file__, "killed", str(master.proc.pid), *master.args],
                         capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert out.returncode == 0 and line, out.stdout + out.stderr[-4000:]
    r = json.loads(line[-1])
    print(f"two engines served a prompt each with the master gone in {r['secs']:.1f} s; store counters "
          f"{r['counters']}")
    master.kill()


def kill_master(master_pid, master_args):
    """Kill the master (from a child: the parent reaps it) and wait until its port is closed."""
    os.kill(master_pid, 9)
    while True:
        try:
            socket.create_connection(tuple(master_args[0].rsplit(":", 1)), timeout=0.2).close()
            time.sleep(0.05)
        except OSError:
            break


def killed_main(master_pid, master_args):
    """The body of the test above: prints a JSON report, then ends the process at once."""
    n, seed, timeout = 8 << 10, 0x3600, 2.0
    m, pool, store, _ = commit_prefix(n, seed, master_args, timeout=timeout)
    m2, pool2, store2 = engine(n, master_args, timeout=timeout)
    kill_master(master_pid, master_args)
    t0 = time.time()
    for mgr, p, s, st in ((m2, pool2, seed, store2), (m, pool, seed + 1, store)):
        mgr.evict_all()
        t = tokens_of(s, n)
        rid = mgr.add_request(t[:n])
        assert mgr.admit(rid) == 0  # the store is gone: a miss, not an error
        mgr.allocate(rid, n)
        mgr.commit(rid, n)
        mgr.complete_inflight()
        mgr.finish(rid)
        stats = mgr.stats()
        assert stats["shared_write_failures"] > 0, stats
        assert_drained(mgr, p)
        # One call overran and marked the store down; every later one was refused at once.
        assert st.down and st.counters["timeouts"] == 1 and st.counters["refused_down"] > 0, st.counters
        # Nothing leaked: the tier, dropped, gave its staging buffer back; a buffer still
        # registered is one whose unregistration waits for the store (none is touched by an
        # abandoned call here: the overrun was a lookup).
        mgr.set_shared_store(None, 0)
        assert set(st.registrations()) == set(st.pending_unregistrations()), st.registrations()
        assert all(c in ("batch_is_exist", "get_size", "is_exist", "remove") for c in st.stuck_calls())
    secs = time.time() - t0
    assert secs < 4 * timeout + 10, f"the store's calls were not bounded: {secs:.1f} s"
    t1 = time.time()
    for st in (store, store2):
        st.close()  # not asked of the vanished master
    assert time.time() - t1 < 1, "close of a down store waited on the client"
    print(json.dumps({"secs": secs, "counters": store.counters}), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "killed":
        killed_main(int(sys.argv[2]), tuple(sys.argv[3:5]))
    assert sys.argv[1] == "reader"
    reader_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), tuple(sys.argv[5:7]))
