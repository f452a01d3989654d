"""The indexer's keys in the pool: v4pool.hf plans an indexer cache (bf16, or the spec's FP8 /
FP4 formats), writes each CSA entry's key through `Forward.write_index_keys` at the entry's
block and row, and its indexer reads them back through `Pool.indexer_view`. Checked here
against the keys the model computed (recorded at the write), untouched rows poisoned; the
kernel's FP8 / FP4 bytes against the Python quantise reference (`v4pool.hf.pack_index_*`) byte
for byte; an FP8-indexer pool against transformers with the same quantise-dequantise applied
to its indexer keys; and the refusals.

Logit bound of the FP8-indexer run: the pool's attention KV is bf16 (bit for bit
transformers'), and the indexer scores keys whose values are identical on both sides (the same
formula quantises them, dequantised exactly in bf16), so the scores, the top-k and attention
differ only in accumulation order, as in test_hf_pool's bf16 runs: the same bound,
|delta logit| <= 0.025 * max |logit| + 0.02, and the top-1 token at every step."""

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
    # A pool whose indexer cache is fp8 quantises the keys (no refusal any more: the kernel
    # packs them); a freed block is refused before anything is written.
    plan = v4pool.plan(model="v4-flash", budget="2GiB", max_seqs=2, dtype="bf16", indexer="fp8")
    pool = v4pool.Pool(plan, backend="host")
    fw = v4pool.Forward(pool, 2, 2, 4)
    b = pool.alloc_block()
    fw.stage_compressed("csa", [b], [0])
    fw.write_index_keys(0, keys.cpu())
    pool.free_block(b)
    with pytest.raises(v4pool.V4PoolError) as e:
        fw.write_index_keys(0, keys.cpu())
    assert e.value.variant == "BadEntry"


def _index_keys_poison(eng, indexer):
    ranks = eng.ratios.count(hf.CSA)
    parts = 2 if indexer == "fp4" else 1
    views = [[torch.from_dlpack(eng.pool.indexer_view(k, p)) for p in range(parts)] for k in range(ranks)]
    g = torch.Generator().manual_seed(3)
    for vs in views:
        for v in vs:
            v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8).to(v.device))
    return views


@pytest.mark.parametrize("indexer", ["fp8", "fp4"])
def test_index_key_pack_matches_the_reference_byte_for_byte(indexer):
    # Fresh random keys over a wide range of magnitudes (an all-zero row, an all-zero group,
    # huge and tiny rows among them) through the kernel into poisoned caches: every written
    # byte equals hf.pack_index_*_reference's, every other byte keeps its poison.
    model = tiny()
    eng = hf.attach(model, dtype="bf16", budget="96MiB", max_seqs=2, max_context=1024, chunk=256,
                    backend=BACKEND, indexer=indexer)
    views = _index_keys_poison(eng, indexer)
    before = [[v.clone() for v in vs] for vs in views]
    g = torch.Generator().manual_seed(17)
    n = 100
    keys = torch.randn(n, 128, generator=g) * torch.logspace(-6, 6, n).unsqueeze(1)
    keys[3] = 0  # an all-zero row
    keys[4, 32:64] = 0  # an all-zero FP4 group
    keys[5] *= 1e25
    keys[6] *= 1e-25
    keys = keys.to(torch.bfloat16).to(DEVICE)
    blocks = [eng.pool.alloc_block() for _ in range(2)]
    ids = torch.arange(n) % 2
    rows = (torch.arange(n) * 7) % 64
    seen = set()
    keep = [i for i in range(n) if (int(ids[i]), int(rows[i])) not in seen and not seen.add((int(ids[i]), int(rows[i])))]
    ids, rows, keys = ids[keep], rows[keep], keys[keep]
    eng.fwd.stage_compressed("csa", [blocks[i] for i in ids.tolist()], rows.tolist())
    rank = 1
    eng.fwd.write_index_keys(rank, keys)
    bid = torch.tensor([blocks[i].id for i in ids.tolist()])
    v = [t.cpu() for t in views[rank]]
    nb = v[0].shape[0]
    if indexer == "fp8":
        data, scale = hf.pack_index_fp8_reference(keys.cpu())
        blk = v[0].reshape(nb, -1)
        got_data = blk[:, :64 * 128].reshape(nb, 64, 128)[bid, rows]
        got_scale = blk[:, 64 * 128:].reshape(nb, 64, 4)[bid, rows]
        assert torch.equal(got_data, data)
        assert torch.equal(got_scale, scale.view(torch.uint8).view(-1, 4))
    else:
        data, scales = hf.pack_index_fp4_reference(keys.cpu())
        got_data = v[0].reshape(nb, 4, 64, 16)[bid, :, rows]
        got_scales = v[1].reshape(nb, 4, 64)[bid, :, rows]
        assert torch.equal(got_data, data)
        assert torch.equal(got_scales, scales)
    # The reader dequantises what was written, within the format's rounding of the keys.
    back = hf.read_index_rows(eng.pool, rank, bid.to(DEVICE), rows.to(DEVICE), indexer).cpu().float()
    assert torch.equal(back, hf.quantize_index_reference(keys.cpu(), indexer).float())
    # Untouched: other ranks entirely, and rows of this rank no key targets.
    for k, vs in enumerate(views):
        for p, t in enumerate(vs):
            if k != rank:
                assert torch.equal(t.cpu(), before[k][p].cpu()), f"rank {k} part {p} changed"
    mask = torch.ones(nb, 64, dtype=torch.bool)
    mask[bid, rows] = False
    if indexer == "fp8":
        flat = lambda t: t.reshape(nb, -1)  # noqa: E731
        d_now, d_was = flat(v[0])[:, :8192].reshape(nb, 64, 128), flat(before[rank][0].cpu())[:, :8192].reshape(nb, 64, 128)
        s_now, s_was = flat(v[0])[:, 8192:].reshape(nb, 64, 4), flat(before[rank][0].cpu())[:, 8192:].reshape(nb, 64, 4)
        assert torch.equal(d_now[mask], d_was[mask]) and torch.equal(s_now[mask], s_was[mask])
    else:
        d_now, d_was = v[0].reshape(nb, 4, 64, 16), before[rank][0].cpu().reshape(nb, 4, 64, 16)
        s_now, s_was = v[1].reshape(nb, 4, 64), before[rank][1].cpu().reshape(nb, 4, 64)
        assert torch.equal(d_now.permute(0, 2, 1, 3)[mask], d_was.permute(0, 2, 1, 3)[mask])
        assert torch.equal(s_now.permute(0, 2, 1)[mask], s_was.permute(0, 2, 1)[mask])
    for b in blocks:
        eng.pool.free_block(b)


def _quantize_reference_index_keys(indexer):
    """transformers' indexer keys through the indexer format's quantise-dequantise when they
    enter its cache (DeepseekV4HCACache.update_compressor_states, name "indexer")."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mv4

    hca = mv4.DeepseekV4HCACache
    orig = hca.update_compressor_states

    def comp(self, name, compressed):
        if name == "indexer":
            compressed = hf.quantize_index_reference(compressed, indexer)
        return orig(self, name, compressed)

    hca.update_compressor_states = comp

    def undo():
        hca.update_compressor_states = orig

    return undo


@pytest.mark.parametrize("indexer", ["fp8", "fp4"])
def test_quantised_indexer_against_quantised_reference(indexer):
    # An FP8- (FP4-) indexer pool (bf16 KV) against transformers with the same e4m3 + f32
    # scale (e2m1 + e8m0) quantise-dequantise applied to its indexer keys; top-k 16 below the
    # CSA entries, so the indexer's selection matters. One request at a time, prefilled in
    # chunks of 128 (measured on the host backend: identical logits, delta 0).
    from test_hf_pool import bound, reference

    model = tiny(index_topk=16, seed=5)
    worst = 0.0
    for n in [6, 140, 301]:
        eng = hf.attach(model, dtype="bf16", budget="96MiB", max_seqs=1, max_context=1024, chunk=128,
                        backend=BACKEND, indexer=indexer)
        prompt = prompts_of([n], seed=n)[0]
        (toks, logits), = eng.generate([prompt], 24)
        undo = _quantize_reference_index_keys(indexer)
        try:
            ref_toks, ref_logits = reference(model, prompt, 24, 128)
        finally:
            undo()
        diff = (ref_logits - logits.cpu()).abs().amax(dim=-1)
        assert toks == ref_toks, (n, toks, ref_toks)
        assert float(diff.max()) <= bound(ref_logits), (n, diff.tolist())
        worst = max(worst, float(diff.max()) / float(ref_logits.abs().max()))
    print(f"{indexer} indexer: worst |delta logit| / max |logit| = {worst:.4f}")


def test_the_quantised_indexer_changes_what_the_reference_selects():
    # The FP8 test is not vacuous: the quantised keys differ from transformers' bf16 keys, so
    # the pool's logits differ from the unquantised reference's somewhere (while they match the
    # quantised one, above).
    from test_hf_pool import reference

    model = tiny(index_topk=16, seed=5)
    eng = hf.attach(model, dtype="bf16", budget="96MiB", max_seqs=1, max_context=1024, chunk=128,
                    backend=BACKEND, indexer="fp8")
    prompt = prompts_of([301], seed=301)[0]
    (_, logits), = eng.generate([prompt], 8)
    _, plain = reference(model, prompt, 8, 128)
    assert float((plain - logits.cpu()).abs().max()) > 0
