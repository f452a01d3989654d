"""The indexer's keys in the pool: v4pool.hf plans a bf16 indexer cache, writes each CSA
entry's key through `Forward.write_index_keys` at the entry's block and row, and its indexer
reads them back through `Pool.indexer_view`. Checked here against the keys the model
computed (recorded at the write), untouched rows poisoned; and the refusals."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import v4pool  # noqa: E402
import v4pool.hf as hf  # noqa: E402
from test_forward_gather import Recorder  # noqa: E402
from test_hf_pool import BACKEND, DEVICE, prompts_of, tiny  # noqa: E402


def test_index_keys_land_at_their_entries_rows():
    model = tiny()
    eng = hf.attach(model, dtype="bf16", budget="96MiB", max_seqs=2, max_context=1024, chunk=256,
                    backend=BACKEND)
    ranks = eng.ratios.count(hf.CSA)
    views = [torch.from_dlpack(eng.pool.indexer_view(k)) for k in range(ranks)]
    assert views[0].dtype == torch.bfloat16 and views[0].shape[1:] == (64, 128)
    for v in views:
        v.fill_(float("nan"))  # poison: every row read back must have been written
    rec = eng.fwd = Recorder(eng.fwd, "write_index_keys")
    r = eng.add(prompts_of([300], seed=11)[0])
    eng.run([r], 6)  # 300 + 5 decoded tokens: entries 0..75 (two blocks)
    ids = [b.id for b in eng._blocks(r)]
    for k in range(ranks):
        want = torch.cat(rec.kv[k])
        assert want.shape == (305 // 4, 128)
        got = torch.cat([views[k][ids[0]], views[k][ids[1], :305 // 4 - 64]])
        assert torch.equal(got, want), f"CSA rank {k}"
        assert torch.isnan(views[k][ids[1], 305 // 4 - 64:]).all()  # rows past the entries
    with pytest.raises(v4pool.V4PoolError):
        eng.pool.indexer_view(ranks)  # no such CSA layer
    eng.finish(r)


def test_index_key_writes_are_checked():
    model = tiny()
    eng = hf.attach(model, dtype="bf16", budget="96MiB", max_seqs=2, chunk=64, backend=BACKEND)
    f = eng.fwd
    keys = torch.zeros((1, 128), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(v4pool.V4PoolError) as e:
        f.write_index_keys(0, keys)  # nothing staged
    assert e.value.variant == "NothingStaged"
    r = eng.add([1, 2, 3, 4])
    eng._grow(r, 4)
    blk = eng._blocks(r)[0]
    f.stage_compressed("csa", [blk], [0])
    with pytest.raises(v4pool.V4PoolError):
        f.write_index_keys(0, torch.zeros((2, 128), dtype=torch.bfloat16, device=DEVICE))  # rows != staged
    with pytest.raises(v4pool.V4PoolError):
        f.write_index_keys(0, torch.zeros((1, 64), dtype=torch.bfloat16, device=DEVICE))  # too narrow
    with pytest.raises(v4pool.V4PoolError):
        f.write_index_keys(0, torch.zeros((1, 128), dtype=torch.float32, device=DEVICE))  # dtype
    f.write_index_keys(0, torch.full((1, 128), 1.5, dtype=torch.bfloat16, device=DEVICE))
    assert (torch.from_dlpack(eng.pool.indexer_view(0))[blk.id, 0] == 1.5).all()
    eng.finish(r)
    # A pool whose indexer cache is fp8 has no key writer (a typed refusal, nothing written).
    plan = v4pool.plan(model="v4-flash", budget="2GiB", max_seqs=2, dtype="bf16", indexer="fp8")
    pool = v4pool.Pool(plan, backend="host")
    fw = v4pool.Forward(pool, 2, 2, 4)
    b = pool.alloc_block()
    fw.stage_compressed("csa", [b], [0])
    with pytest.raises(v4pool.V4PoolError) as e:
        fw.write_index_keys(0, keys.cpu())
    assert e.value.variant == "IndexerFormat"
    pool.free_block(b)
