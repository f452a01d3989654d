"""v4pool's KV events decoded by a subscriber written from vLLM's own event classes.

`vllm/distributed/kv_events.py` is taken at test time from the vllm 0.33.0 wheel named by
`V4POOL_VLLM_WHEEL` (`.ci/run` downloads it with `pip download --no-deps` and checks its
sha256; nothing of vLLM is committed). Its module-level imports of the rest of vLLM (config,
logger, network helpers, the `ExternalBlockHash` alias) are given stand-ins; the event
classes themselves — `EventBatch`, `KVEventBatch`, `BlockStored`, `BlockRemoved`,
`AllBlocksCleared` — are vLLM's, and the bytes are decoded with msgspec as vLLM's consumers
do. The map encoding is what vLLM 0.33.0's classes read as they are; the array encoding
(what llm-d reads) is decoded with the same classes made `array_like`, as older vLLM
declared them.
"""

import os
import sys
import time
import types
import zipfile

import pytest
import v4pool

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"


def vllm_kv_events(tmp_path_factory):
    wheel = os.environ.get("V4POOL_VLLM_WHEEL")
    if not wheel or not os.path.exists(wheel):
        pytest.skip("V4POOL_VLLM_WHEEL names no vllm 0.33.0 wheel (.ci/run downloads it)")
    import hashlib

    h = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == WHEEL_SHA256, "not the pinned vllm 0.33.0 wheel"
    out = tmp_path_factory.mktemp("vllm")
    with zipfile.ZipFile(wheel) as z:
        src = z.read("vllm/distributed/kv_events.py").decode()
    path = out / "vllm_kv_events.py"
    path.write_text(src)
    # Stand-ins for the rest of vLLM that the module imports at its top.
    stubs = {
        "vllm": {},
        "vllm.config": {},
        "vllm.config.kv_events": {"KVEventsConfig": type("KVEventsConfig", (), {})},
        "vllm.logger": {"init_logger": lambda name: __import__("logging").getLogger(name)},
        "vllm.utils": {},
        "vllm.utils.network_utils": {
            "get_ip": lambda: "127.0.0.1",
            "get_tcp_uri": lambda ip, port: f"tcp://{ip}:{port}",
            "is_valid_ipv6_address": lambda ip: False,
            "split_zmq_path": lambda p: ("tcp", p.rsplit(":", 1)[0], p.rsplit(":", 1)[1]),
        },
        "vllm.v1": {},
        "vllm.v1.core": {},
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    saved = {k: sys.modules.get(k) for k in stubs}
    for name, attrs in stubs.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("vllm_kv_events", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    return vllm_kv_events(tmp_path_factory)


def array_like(kv):
    """vLLM's event classes as `array_like` structs (the tagged-array encoding), same fields."""

    def twin(cls):
        return type(cls.__name__, (cls,), {}, array_like=True, tag=cls.__name__)

    stored, removed, cleared = twin(kv.BlockStored), twin(kv.BlockRemoved), twin(kv.AllBlocksCleared)

    class Batch(kv.EventBatch):
        events: list[stored | removed | cleared]

    return Batch, (stored, removed, cleared)


def subscriber(endpoint, topic=b""):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    return s


def conversation(m, tokens):
    a = m.add_request(tokens)
    m.admit(a)
    m.allocate(a, len(tokens))
    m.commit(a, len(tokens))
    m.complete_inflight()
    m.finish(a)
    return m.block_hashes(tokens)


def joined(pub, sub):
    """Wait until the subscription has reached the publisher (PUB drops what it sends before
    that): probe with AllBlocksCleared batches until one arrives, then drain."""
    deadline = time.time() + 10
    while time.time() < deadline:
        pub.publish_cleared()
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("the subscriber never joined")


def receive(pub, sub, m):
    """Publish the manager's events; the frames of that batch."""
    seq = pub.publish_from(m)
    assert seq is not None
    assert sub.poll(5000), "no batch"
    frames = sub.recv_multipart()
    assert int.from_bytes(frames[1], "big") == seq
    return frames


@pytest.fixture()
def manager():
    plan = v4pool.plan(model="v4-flash", budget="1GiB", max_seqs=4)
    return v4pool.KvManager(v4pool.Pool(plan, backend="host"), events=True)


def wire(h):
    return h & ((1 << 64) - 1)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_vllm_classes_decode_v4pool_events(kv, manager, encoding):
    m = manager
    pub = v4pool.KvEventPublisher(
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@pod-0@deepseek-v4-flash",
        encoding=encoding,
        dp_rank=2,
        block_size=m.block_size,
    )
    sub = subscriber(pub.endpoint, b"kv@")
    joined(pub, sub)
    bs = m.block_size
    tokens = [(i * 2654435761) % 100_003 for i in range(3 * bs + 17)]
    hashes = conversation(m, tokens)
    topic, seq_bytes, payload = receive(pub, sub, m)
    assert topic == b"kv@pod-0@deepseek-v4-flash"
    assert len(seq_bytes) == 8
    if encoding == "map":
        batch = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
        stored_cls = kv.BlockStored
    else:
        Batch, (stored_cls, _, _) = array_like(kv)
        batch = msgspec.msgpack.Decoder(Batch).decode(payload)
        # The map form is refused by the array classes and vice versa: the setting matters.
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 2
    assert abs(batch.ts - time.time()) < 60
    stored = [e for e in batch.events if isinstance(e, stored_cls)]
    assert stored, batch
    got = [h for e in stored for h in e.block_hashes]
    assert got == [wire(h) for h in hashes], "v4pool's chained hashes (low 64 bits), in order"
    first = stored[0]
    assert first.parent_block_hash is None and first.block_size == bs and first.medium == "GPU"
    assert first.lora_id is None and first.lora_name is None
    toks = [t for e in stored for t in e.token_ids]
    assert toks == tokens[: len(hashes) * bs], "each block's tokens"
    # An engine's reset is AllBlocksCleared.
    pub.publish_cleared()
    deadline = time.time() + 10
    while time.time() < deadline and sub.poll(100):
        frames = sub.recv_multipart()
        if encoding == "map":
            b = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(frames[2])
            if any(isinstance(e, kv.AllBlocksCleared) for e in b.events):
                break
        else:
            b = msgspec.msgpack.Decoder(Batch).decode(frames[2])
            if any(type(e).__name__ == "AllBlocksCleared" for e in b.events):
                break
    else:
        raise AssertionError("no AllBlocksCleared batch")
    # Replay as vLLM's clients ask for it: a REQ-style request [start seq], answered with
    # (topic, seq, payload) frames and an end marker of seq -1.
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.connect(pub.replay_endpoint)
    req.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        assert req.poll(5000), "no replay answer"
        frames = req.recv_multipart()
        assert frames[0] == b""
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            assert frames[1] == b"" and frames[3] == b""
            break
        seqs.append(int.from_bytes(frames[2], "big"))
        assert frames[1] == b"kv@pod-0@deepseek-v4-flash"
    assert seqs == list(range(pub.next_seq)), seqs
    req.close(0)
    sub.close(0)


def test_a_bad_encoding_is_refused():
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.KvEventPublisher("tcp://127.0.0.1:*", encoding="json")
    assert e.value.variant == "UnknownEncoding"


def test_drained_events_name_the_tiers(manager):
    m = manager
    bs = m.block_size
    tokens = list(range(2 * bs + 5))
    hashes = conversation(m, tokens)
    ev = m.drain_events()
    assert [e["type"] for e in ev] == ["BlockStored"]
    assert ev[0]["block_hashes"] == hashes and ev[0]["medium"] == "GPU"
    assert ev[0]["token_ids"] == tokens[: 2 * bs]
    assert m.drain_events() == []
