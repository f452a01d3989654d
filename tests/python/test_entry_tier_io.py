"""`v4pool.EntryTier(..., io=...)`: the file tier's bytes through `std::fs` ("std-fs") or NIXL's
POSIX plugin ("nixl-posix", the vLLM connector's `host_io` / `shared_io`): entries of several
parts round-trip byte-exact, a file one I/O wrote reads back through the other, a truncated
entry is a miss, and an unknown I/O is refused by name. The NIXL half needs NIXL's C API
(`$V4POOL_NIXL_LIB`, docs/nixl.md): SKIP without it, a failure with V4POOL_REQUIRE_NIXL=1
(.ci/run's NIXL step runs this file with the pinned library).
"""

import os

import pytest

torch = pytest.importorskip("torch")

import v4pool  # noqa: E402

LAYOUT = "vllm-test|deepseek_v4|block256|0:full:p1000"


def maybe_tier(root, io):
    """A tier over `io`; None when it is NIXL and NIXL is unavailable (not required)."""
    try:
        return v4pool.EntryTier(str(root), LAYOUT, 1 << 30, io=io)
    except v4pool.V4PoolError as e:
        if io == "nixl-posix" and e.variant == "NixlUnavailable" and os.environ.get("V4POOL_REQUIRE_NIXL") != "1":
            print(f"SKIP the NIXL half: NIXL unavailable here: {e}")
            return None
        raise


def tier(root, io):
    t = maybe_tier(root, io)
    if t is None:
        pytest.skip("NIXL unavailable here (V4POOL_NIXL_LIB, docs/nixl.md)")
    return t


@pytest.mark.parametrize("io", ["std-fs", "nixl-posix"])
def test_entries_round_trip_through_the_io(tmp_path, io):
    t = tier(tmp_path, io)
    g = torch.Generator().manual_seed(46)
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in ((1 << 20) + 7, 333, 70_001)]
    body = torch.cat(parts)
    t.put("c", 0xC0FFEE, parts)
    dst = torch.full_like(body, 0xA5)
    assert t.get_into("c", 0xC0FFEE, dst) and torch.equal(dst, body)
    # The other I/O reads the same file (one format, whatever moved the bytes).
    other = maybe_tier(tmp_path, "nixl-posix" if io == "std-fs" else "std-fs")
    if other is not None:
        dst2 = torch.zeros_like(body)
        assert other.get_into("c", 0xC0FFEE, dst2) and torch.equal(dst2, body)
    # A truncated entry: a miss, the tensor untouched, the file removed.
    path = t.layout_dir() / f"{0xC0FFEE >> 120:02x}" / f"c{0xC0FFEE:032x}"
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    dst3 = torch.full_like(body, 0xA5)
    assert not t.get_into("c", 0xC0FFEE, dst3) and bool((dst3 == 0xA5).all()) and not path.exists()
    assert t.stats()["corrupt"] == 1


def test_an_unknown_io_is_refused_by_name(tmp_path):
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.EntryTier(str(tmp_path), LAYOUT, 1 << 30, io="posix")
    assert e.value.variant == "BadIo"
