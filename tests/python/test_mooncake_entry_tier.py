"""Mooncake Store as the vLLM connector's shared entry tier (`v4pool.EntryTier.in_store`,
`transfer::entry_store`), over TCP loopback against a real `mooncake_master` (started as
tests/python/test_mooncake_tier.py does): entries of several kinds and parts written by this
process read back byte-exact by another process's client; a corrupt, truncated, another
key's or another layout's value under an entry's key, and a read of another length, are
misses (`get_into` False) that leave the caller's tensor untouched, the refused ones removed
from the store; the master killed mid-run leaves the tier answering misses and failed puts
within the adapter's bounded calls, never hanging or raising past `put`.

Needs torch and the `mooncake-transfer-engine-cuda13` wheel importable (.ci/run's Mooncake
step); otherwise SKIP, or a failure with V4POOL_REQUIRE_MOONCAKE=1.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

try:
    import torch
except ImportError as e:
    if os.environ.get("V4POOL_REQUIRE_MOONCAKE") == "1":
        raise
    pytest.skip(f"torch not importable here: {e}", allow_module_level=True)

import v4pool  # noqa: E402
from test_mooncake_tier import Master, _mooncake, kill_master  # noqa: E402

LAYOUT = "vllm-test|deepseek_v4|block256|0:full:p1000|1:swa:w128"
# (kind, hash, part lengths): a block's pages, a checkpoint across the checksum's 1 MiB
# pieces, an index entry of int32s.
ENTRIES = [
    ("b", 0x1234 << 100 | 1, [584 * 256, 132 * 256, 584 * 256]),
    ("c", 0x1234 << 100 | 2, [(1 << 20) + 4097, 333, (2 << 20) - 5]),
    ("i", 0x1234 << 100 | 3, [4 * 17]),
]


@pytest.fixture()
def master():
    m = Master(_mooncake())
    yield m
    m.kill()


def connect(master_args, segment=64 << 20, timeout=None):
    import v4pool.mooncake

    store = v4pool.mooncake.MooncakeStore.connect(*master_args, segment_bytes=segment, timeout=timeout)
    return store, v4pool.EntryTier.in_store(store, LAYOUT, segment)


def parts_of(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in lengths]


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def write_entries(tier, seed):
    """Put every entry of ENTRIES; {hash: sha256 of its body}."""
    want = {}
    for i, (kind, h, lengths) in enumerate(ENTRIES):
        parts = parts_of(seed + i, lengths)
        tier.put(kind, h, parts)
        want[f"{h:x}"] = digest(torch.cat(parts))
    return want


def run_child(*args):
    out = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert out.returncode == 0 and line, out.stdout + out.stderr[-4000:]
    return json.loads(line[-1])


def reader_main(master_args):
    """Another process's client: every entry read into a poisoned tensor; their digests (None
    on a miss), a reader of another layout's answers and the counters, as JSON."""
    store, tier = connect(master_args)
    got = {}
    for kind, h, lengths in ENTRIES:
        assert tier.contains(kind, h)
        assert tier.size(kind, h) == sum(lengths)
        dst = torch.full((sum(lengths),), 0xA5, dtype=torch.uint8)
        got[f"{h:x}"] = digest(dst) if tier.get_into(kind, h, dst) else None
    other = v4pool.EntryTier.in_store(store, "another-layout", 64 << 20)
    other_hits = [other.get_into(k, h, torch.empty(sum(n), dtype=torch.uint8)) for k, h, n in ENTRIES]
    print(json.dumps({"got": got, "other_hits": other_hits, "stats": tier.stats()}), flush=True)
    os._exit(0)  # the client's teardown is not what is tested (test_mooncake_tier.py)


def test_entries_written_here_read_back_byte_exact_in_another_process(master):
    store, tier = connect(master.args)
    want = write_entries(tier, 0x4600)
    assert tier.stats()["puts"] == len(ENTRIES) and tier.stats()["put_errors"] == 0
    # The store's value is the entry file's format: the header's magic, then the layout id.
    key = tier.store_key("b", ENTRIES[0][1])
    assert key.startswith("v4pool-entries-1/") and key in store.put_keys
    raw = store.store.get(key)
    assert raw[:8] == b"v4poolE1" and raw[80:80 + len(LAYOUT)] == LAYOUT.encode()
    r = run_child("reader", *master.args)
    assert r["got"] == want, r
    assert r["other_hits"] == [False] * len(ENTRIES), "another layout's reader hit this layout's entries"
    assert r["stats"]["hits"] == len(ENTRIES) and r["stats"]["io_errors"] == 0, r["stats"]
    store.close()


def test_values_that_are_not_this_entrys_are_misses(master):
    store, tier = connect(master.args)
    write_entries(tier, 0x4700)
    kind, h, lengths = ENTRIES[1]
    n = sum(lengths)
    key = tier.store_key(kind, h)
    good = store.store.get(key)
    assert len(good) == 80 + len(LAYOUT) + n

    def replace(value):
        # (A refused value is gone already: the tier removed it.)
        assert store.store.is_exist(key) == 0 or store.store.remove(key, True) == 0
        assert store.store.put(key, bytes(value)) == 0

    def miss(length=n):
        dst = torch.full((length,), 0xA5, dtype=torch.uint8)
        hit = tier.get_into(kind, h, dst)
        assert bool((dst == 0xA5).all()), "a refused value reached the caller's tensor"
        return hit

    flipped = bytearray(good)
    flipped[len(good) - 1000] ^= 0x10
    other_key_value = store.store.get(tier.store_key(*ENTRIES[0][:2]))
    for what, value in [("a body byte flipped", flipped), ("truncated", good[:-1]),
                        ("header only", good[:80 + len(LAYOUT)]), ("another key's entry", other_key_value)]:
        replace(value)
        assert not miss(), what
        assert store.store.is_exist(key) == 0, f"{what}: the refused value stays in the store"
    # Another layout's whole entry under this key: a miss, left (it may be the other's).
    # (Over the same adapter: one closed with the client, so a tier dropped after it gives
    # its buffer back to nothing; a second adapter would call the closed client.)
    other = v4pool.EntryTier.in_store(store, "another-layout", 64 << 20)
    other.put(kind, h, parts_of(1, lengths))
    foreign = store.store.get(other.store_key(kind, h))
    assert store.store.put(key, foreign) == 0
    assert not miss() and store.store.is_exist(key) == 1
    # The right entry back: a read of another length is a miss, of the right one a hit.
    replace(good)
    assert not miss(n - 1)
    dst = torch.empty(n, dtype=torch.uint8)
    assert tier.get_into(kind, h, dst) and bytes(dst.numpy()) == good[80 + len(LAYOUT):]
    s = tier.stats()
    assert (s["corrupt"], s["foreign"], s["hits"]) == (4, 2, 1), s
    store.close()


def killed_main(master_pid, master_args):
    """The master killed after a put: every later call a miss or a failed put, each store
    call bounded; a JSON report, then the process ends at once (test_mooncake_tier.py says
    why a clean exit is not attempted)."""
    timeout = 2.0
    store, tier = connect(master_args, timeout=timeout)
    kind, h, lengths = ENTRIES[0]
    parts = parts_of(5, lengths)
    tier.put(kind, h, parts)
    n = sum(lengths)
    assert tier.get_into(kind, h, torch.empty(n, dtype=torch.uint8))
    kill_master(master_pid, master_args)
    t0 = time.time()
    answers = {}
    dst = torch.full((n,), 0xA5, dtype=torch.uint8)
    answers["get_into"] = [tier.get_into(kind, h, dst) for _ in range(3)]
    answers["untouched"] = bool((dst == 0xA5).all())
    answers["contains"] = tier.contains(kind, h)
    answers["size"] = tier.size(kind, h)
    try:
        tier.put(kind, h + 1, parts)
        answers["put"] = "stored"
    except v4pool.V4PoolError as e:
        answers["put"] = e.variant
    answers["secs"] = time.time() - t0
    answers["stats"] = tier.stats()
    answers["counters"] = store.counters
    print(json.dumps(answers), flush=True)
    os._exit(0)


def test_the_master_killed_mid_run_is_misses(master):
    r = run_child("killed", master.proc.pid, *master.args)
    master.kill()
    print(f"the master gone: {r['secs']:.1f} s for 6 calls; tier {r['stats']}; store {r['counters']}")
    assert r["get_into"] == [False] * 3 and r["untouched"], r
    assert (r["contains"], r["size"], r["put"]) == (False, None, "Store"), r
    # Every one of the six tier calls failed in the store; one store call overran its 2 s and
    # marked the store down, the later ones were refused at once (an early one may fail with
    # the client's own error code first).
    assert r["stats"]["io_errors"] >= 6 and r["stats"]["put_errors"] == 1, json.dumps(r)
    assert r["counters"]["timeouts"] == 1 and r["counters"]["refused_down"] >= 4, json.dumps(r)
    assert r["secs"] < 2 * 2.0 + 5, "the store's calls were not bounded"



if __name__ == "__main__":
    if sys.argv[1] == "reader":
        reader_main(tuple(sys.argv[2:4]))
    assert sys.argv[1] == "killed"
    killed_main(int(sys.argv[2]), tuple(sys.argv[3:5]))
