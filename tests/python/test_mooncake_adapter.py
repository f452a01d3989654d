"""`v4pool.mooncake.MooncakeStore`'s bounded calls against a fake client whose calls can be
made to hang (no Mooncake needed: runs wherever v4pool imports): a call that overruns marks
the store down, later calls are misses that never reach the client, one probe goes through
after the back-off, and a buffer an abandoned call may still touch is never given back
(`MooncakeBufferBusy`) until that call returns, when its registration is undone. The real
client, master killed mid-run, is tests/python/test_mooncake_tier.py.
"""

import errno
import threading
import time

import pytest

from v4pool.mooncake import MooncakeBufferBusy, MooncakeDown, MooncakeError, MooncakeStore

T = 0.3  # the adapter's timeout in these tests (seconds)


class FakeClient:
    """The `MooncakeDistributedStore` calls the adapter makes; `hang` blocks every call
    until released; `calls` lists what reached the client."""

    def __init__(self):
        self.calls = []
        self.registered = {}
        self.values = {}
        self.hang = threading.Event()
        self.hang.set()  # set: calls answer

    def _enter(self, what):
        self.calls.append(what)
        self.hang.wait()

    def register_buffer(self, addr, size):
        self._enter("register_buffer")
        assert addr not in self.registered
        self.registered[addr] = size
        return 0

    def unregister_buffer(self, addr):
        self._enter("unregister_buffer")
        return 0 if self.registered.pop(addr, None) is not None else -600

    def batch_is_exist(self, keys):
        self._enter("batch_is_exist")
        return [1 if k in self.values else 0 for k in keys]

    def get_size(self, key):
        self._enter("get_size")
        return len(self.values[key]) if key in self.values else -704

    def is_exist(self, key):
        self._enter("is_exist")
        return 1 if key in self.values else 0

    def put_from(self, key, addr, size):
        self._enter("put_from")
        self.values[key] = size
        return 0

    def get_into(self, key, addr, size):
        self._enter("get_into")
        return size

    def remove(self, key, force):
        self._enter("remove")
        return 0 if self.values.pop(key, None) is not None else -704

    def close(self):
        self.calls.append("close")


def downed(backoff, buffer=None, overrun=lambda s: s.exist(["a"])):
    """A store over a fake client (with `buffer` registered first, `(addr, size)`), down
    after `overrun(store)` overran: (client, store); the client's calls hang."""
    c = FakeClient()
    s = MooncakeStore(c, timeout=T, backoff=backoff)
    if buffer:
        s.register_buffer(*buffer)
    c.hang.clear()
    with pytest.raises(MooncakeDown):
        overrun(s)
    return c, s


def wait_for(cond, secs=5):
    end = time.monotonic() + secs
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_call_that_overruns_marks_the_store_down_and_later_calls_never_reach_the_client():
    c = FakeClient()
    s = MooncakeStore(c, timeout=T, backoff=60)
    assert s.exist(["a"]) == [False]
    c.hang.clear()
    t0 = time.monotonic()
    with pytest.raises(MooncakeDown):
        s.exist(["a"])
    assert T <= time.monotonic() - t0 < T + 1
    assert s.down and s.stuck_calls() == ["batch_is_exist"]
    n = len(c.calls)
    t0 = time.monotonic()
    for call in (lambda: s.exist(["a"]), lambda: s.size("a"), lambda: s.remove("a")):
        with pytest.raises(MooncakeDown):
            call()
    assert time.monotonic() - t0 < 0.1, "a down store answers at once"
    assert len(c.calls) == n, "a down store's calls reached the client"
    assert s.counters["refused_down"] == 3 and s.counters["timeouts"] == 1
    c.hang.set()
    wait_for(lambda: not s.stuck_calls())
    assert s.down, "the store comes back only through a probe after the back-off"


def test_after_the_backoff_one_probe_goes_through_and_an_answer_brings_the_store_back():
    c, s = downed(0.5)
    # The probe overruns too: down again, for twice as long.
    time.sleep(0.6)
    with pytest.raises(MooncakeDown, match="down for 1 s"):
        s.exist(["a"])
    assert s.counters["probes"] == 1
    c.hang.set()
    wait_for(lambda: not s.stuck_calls())
    with pytest.raises(MooncakeDown):
        s.exist(["a"])  # still inside the doubled back-off
    time.sleep(1.1)
    assert s.exist(["a"]) == [False]
    assert not s.down and s.counters["recovered"] == 1


def test_a_buffer_an_abandoned_call_may_touch_is_never_given_back_until_it_returns():
    # The overrun is a read into the registered buffer.
    c, s = downed(0.2, (0x1000, 4096), lambda s: s.get_into("k", 0x1000 + 64, 128))
    with pytest.raises(MooncakeBufferBusy) as e:
        s.unregister_buffer(0x1000)
    assert e.value.errno == errno.EBUSY
    # No probe while that call may still write: past the back-off, still down.
    time.sleep(0.3)
    with pytest.raises(MooncakeDown):
        s.exist(["a"])
    assert s.pending_unregistrations() == [0x1000]
    c.hang.set()
    # The stuck call returned: its buffer's registration is undone by the worker.
    wait_for(lambda: 0x1000 not in c.registered)
    assert s.registrations() == {} and s.pending_unregistrations() == []
    assert s.exist(["a"]) == [False]  # the probe
    assert not s.down


def test_a_buffer_given_back_while_down_is_unregistered_once_the_store_answers():
    c, s = downed(0.3, (0x2000, 4096))  # the overrun is a lookup: no buffer involved
    n = len(c.calls)
    s.unregister_buffer(0x2000)  # the tier may free it: no call of the client touches it
    assert len(c.calls) == n and s.pending_unregistrations() == [0x2000]
    c.hang.set()
    wait_for(lambda: not s.stuck_calls())
    time.sleep(0.35)
    assert s.exist(["a"]) == [False]
    assert 0x2000 not in c.registered and s.registrations() == {}
    # A new buffer at an address whose old registration is still pending: undone first.
    s.register_buffer(0x3000, 64)
    c.hang.clear()
    with pytest.raises(MooncakeDown):
        s.exist(["a"])
    s.unregister_buffer(0x3000)
    c.hang.set()
    wait_for(lambda: not s.stuck_calls())
    time.sleep(0.7)
    s.register_buffer(0x3000, 128)
    assert c.registered == {0x3000: 128} and s.registrations() == {0x3000: 128}


def test_a_registration_its_caller_gave_up_on_is_undone_when_it_completes():
    c = FakeClient()
    s = MooncakeStore(c, timeout=T, backoff=60)
    c.hang.clear()
    with pytest.raises(MooncakeDown):
        s.register_buffer(0x4000, 4096)
    c.hang.set()
    wait_for(lambda: not s.stuck_calls() and "unregister_buffer" in c.calls)
    assert c.registered == {} and s.registrations() == {}


def test_errors_the_store_answers_are_misses_but_leave_it_up():
    c = FakeClient()
    s = MooncakeStore(c, timeout=T, backoff=60)
    assert s.size("nope") is None
    c.get_into = lambda key, addr, size: c.calls.append("get_into") or size - 1  # a short read
    with pytest.raises(MooncakeError, match="of 8 bytes"):
        s.get_into("k", 0, 8)
    assert s.remove("nope") is False
    assert not s.down and s.counters["timeouts"] == 0


def test_close_of_a_down_store_does_not_touch_the_client():
    c, s = downed(60)
    s.close()
    assert "close" not in c.calls and s.closed
    with pytest.raises(MooncakeError, match="closed"):
        s.exist(["a"])
    c.hang.set()
