"""FlashMLA's sparse decode over a V4-Flash pool at the model's own shapes, through v4pool's
buffers: 64 query heads (V4-Flash's `num_attention_heads`), head dim 512, MTP 2 (two query
tokens a sequence, ring 130), batch 1 / 64 / 256, contexts up to 4K / 128K / 1M tokens, a
dense, two CSA and two HCA layers (their page shifts differ in 64-row pages, not in 2-row pages).

Per shape and row format: one pool in FlashMLA's 584-B rows (`dtype="flashmla-v4"`, pages of
64, or `"flashmla-v4-p2"`, pages of 2) with random valid bytes
in its plane; the decode build and the CSA translate-pack of `v4pool.Forward` make the index
buffers; `v4pool.hf.flashmla_operands` turns them into FlashMLA's operands against the layer's
page view (`Pool.page_view`, the pool's plane itself: no copy between build and attention);
FlashMLA attends; a float32 attention over the rows those operands name, decoded from the same
bytes by the format text, is the reference. Bound: max |err| <= 2e-2 * max |ref| (FlashMLA
rounds P and its output to bf16; seen: docs/flashmla.md). The operands themselves are checked
against the geometry (`Pool.window_index`, `Pool.compress_index`), independently of the builder,
for the first and last token of every shape.

Needs a CUDA device and FlashMLA's library (`V4POOL_FLASHMLA_LIB`); skips visibly otherwise and
fails with V4POOL_REQUIRE_GPU=1. Shapes: `V4POOL_FLASHMLA_SHAPES` ("1x4096,64x131072,..."),
default every batch with every context.
"""

import os
import time

import pytest

torch = pytest.importorskip("torch")
import v4pool  # noqa: E402

hf = pytest.importorskip("v4pool.hf")  # needs transformers (for the module), no model here

LIB = os.environ.get("V4POOL_FLASHMLA_LIB")
HEADS = 64  # DeepSeek-V4-Flash's num_attention_heads
MTP = 2
TOPK = 512
WIN = 128


def _shapes():
    text = os.environ.get("V4POOL_FLASHMLA_SHAPES")
    if text:
        return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    return [(b, c) for b in (1, 64, 256) for c in (4096, 131072, 1 << 20)]


@pytest.fixture(scope="module")
def ops():
    why = None
    if not torch.cuda.is_available():
        why = "no CUDA device"
    elif not LIB or not os.path.isfile(LIB):
        why = "V4POOL_FLASHMLA_LIB is not a FlashMLA library"
    if why:
        if os.environ.get("V4POOL_REQUIRE_GPU") == "1":
            pytest.fail(why)
        print(f"SKIP: {why}")
        pytest.skip(why)
    return hf.load_flashmla(LIB)


def _fill_random_rows(k_cache, gen):
    """Random valid bytes in every page of `k_cache` [pages, P, 1, 584] (P rows a page: P data
    rows, then P scale rows): finite e4m3 NoPE values, bf16 RoPE values, e8m0 scales 2^-5 ..
    2^2 and a zero pad byte."""
    P = k_cache.shape[1]
    flat = k_cache.view(k_cache.shape[0], -1)
    step = 2048 * 64 // P  # pages a chunk: 131,072 rows whatever the page
    for p0 in range(0, flat.shape[0], step):
        pages = flat[p0:p0 + step]
        n = pages.shape[0]
        data = pages[:, : P * 576].view(n, P, 576)
        nope = torch.randn(n, P, 448, device=pages.device, generator=gen).to(torch.float8_e4m3fn)
        data[:, :, :448] = nope.view(torch.uint8)
        rope = (torch.randn(n, P, 64, device=pages.device, generator=gen) * 0.5).to(torch.bfloat16)
        data[:, :, 448:] = rope.view(torch.uint8).view(n, P, 128)
        scale = pages[:, P * 576:].view(n, P, 8)
        scale[:, :, :7] = torch.randint(122, 130, (n, P, 7), device=pages.device, generator=gen, dtype=torch.uint8)
        scale[:, :, 7] = 0


def _reference(q, k_cache, idx, tl, eidx, etl, sink, scale, group=8):
    """float32 attention of q [B, s_q, H, 512] over the rows the operands name (the first
    `tl[b]` entries of idx[b, j] and `etl[b]` of eidx[b, j] that are not -1), with the sink."""
    B, s_q = q.shape[:2]
    out = torch.empty(B, s_q, q.shape[2], 512, device=q.device)
    parts = [(idx, tl)] + ([(eidx, etl)] if eidx is not None else [])
    for b0 in range(0, B, group):
        sl = slice(b0, min(B, b0 + group))
        ids, ok = [], []
        for x, n in parts:
            j = torch.arange(x.shape[-1], device=x.device)
            ids.append(x[sl].long())
            ok.append((x[sl] >= 0) & (j.view(1, 1, -1) < n[sl].view(-1, 1, 1)))
        ids, ok = torch.cat(ids, -1), torch.cat(ok, -1)
        g, _, L = ids.shape
        rows = hf.decode_flashmla_v4_rows(k_cache, ids.clamp(min=0).reshape(-1)).view(g, s_q, L, 512)
        logits = torch.einsum("gshd,gsld->gshl", q[sl].float(), rows) * scale
        logits = logits.masked_fill(~ok.unsqueeze(2), float("-inf"))
        sinks = sink.view(1, 1, -1, 1).expand(g, s_q, -1, 1)
        p = torch.softmax(torch.cat([logits, sinks], -1), -1)[..., :-1]
        out[sl] = torch.einsum("gshl,gsld->gshd", p, rows)
    return out


def _check_operands(pool, ring, layer, ratio, shift, tables, slot_pos, positions, idx, tl, eidx, etl, topk, tokens):
    """The operands of token `t` (batch entry t // MTP) name exactly the rows the geometry
    gives: its window's last positions, and its CSA top-k's / HCA entries' compressed rows."""
    for t in tokens:
        b, j = divmod(t, MTP)
        p = positions[t]
        want = {pool.window_index(layer, slot_pos[b], q % ring) + shift for q in range(max(0, p - WIN + 1), p + 1)}
        got = set(x for x in idx[b, j, : int(tl[b])].tolist() if x >= 0)
        assert got == want, f"layer {layer} token {t}: window rows"
        if ratio == 0:
            assert eidx is None
            continue
        per = 256 // ratio
        if ratio == 4:
            ent = [e for e in topk[t].tolist() if e >= 0]
        else:
            ent = range((p + 1) // ratio)
        want = {pool.compress_index(layer, tables[b][e // per], e % per) + shift for e in ent}
        got = set(x for x in eidx[b, j, : int(etl[b])].tolist() if x >= 0) if eidx is not None else set()
        assert got == want, f"layer {layer} token {t}: compressed rows"


def _builder_operands(fwdf, layer, T, shift, idx, tl, eidx, etl, hca):
    """The FlashMLA-mode builder's (and pack's) operands of `layer` for the T staged tokens,
    checked equal to the ones formed from the CSR buffers (`idx`… at s_q = MTP): the same
    rows in the same order, per token, −1 after each token's length to the row's limit (an HCA
    layer's compressed rows: the first multiple of 64 strictly past the length; the rest: the
    width; past the limit the builder writes nothing, index-buffers.md §3f). Returned as
    FlashMLA takes them with one query a batch entry (FlashMLA then loads no entry past the
    limit): ([T, 1, W], [T], [T, 1, We] or None, [T] or None)."""
    ops = fwdf.flashmla(layer)
    assert ops["shift"] == shift

    def one(name, lname, want, want_len, limited=False):
        rows = torch.from_dlpack(ops[name])[:T]
        lengths = torch.from_dlpack(ops[lname])[:T]
        per_token = want.reshape(T, -1).to(rows.device)
        w = rows.shape[1]
        if per_token.shape[1] < w:
            per_token = torch.nn.functional.pad(per_token, (0, w - per_token.shape[1]), value=-1)
        assert bool((per_token[:, w:] == -1).all()), name  # nothing the builder's width cuts off
        per_token = per_token[:, :w]
        inside = torch.arange(w, device=rows.device).unsqueeze(0) < lengths.unsqueeze(1).long()
        assert bool((lengths.long().view(-1, MTP).amax(1) <= want_len.to(rows.device).long()).all()), name
        col = torch.arange(w, device=rows.device).unsqueeze(0)
        limit = torch.clamp((lengths.long() // 64 + 1) * 64, max=w) if limited else torch.full_like(lengths.long(), w)
        written = col < limit.unsqueeze(1)
        want_rows = torch.where(inside, per_token, torch.full_like(per_token, -1))
        assert torch.equal(rows[written], want_rows[written]), name
        assert bool((per_token[~inside] == -1).all()), (name, "a row past the builder's length")
        return rows.unsqueeze(1).contiguous(), lengths.contiguous()

    bi, bl = one("indices", "topk_length", idx, tl)
    if eidx is None:
        assert "extra_indices" not in ops or int(torch.from_dlpack(ops["extra_topk_length"])[:T].max()) == 0
        return bi, bl, None, None
    bei, bel = one("extra_indices", "extra_topk_length", eidx, etl, limited=hca)
    return bi, bl, bei, bel


DTYPES = ["flashmla-v4", "flashmla-v4-p2"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,context", _shapes())
def test_flashmla_reads_the_pool_through_v4pools_buffers(ops, batch, context, dtype):
    _run(batch, context, "cuda", ops, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_operands_name_the_geometrys_rows_on_the_host(dtype):
    # The same path on the host backend (CI): the build, the pack, the operands checked against
    # the geometry and the reference run over them; no FlashMLA.
    _run(3, 4096, "host", None, dtype)


def _run(batch, context, backend, ops, dtype):
    dev = "cuda" if backend == "cuda" else "cpu"
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + context)
    cpu = torch.Generator().manual_seed(batch + context)
    blocks_per_seq = -(-(context + MTP) // 256)
    plan = v4pool.plan(model="v4-flash", budget="12GiB" if backend == "cuda" else "1GiB", max_seqs=batch, dtype=dtype, spec_steps=MTP)
    pool = v4pool.Pool(plan, backend=backend)
    nblocks = min(plan.num_blocks, max(blocks_per_seq, 64))
    blocks = [pool.alloc_block() for _ in range(nblocks)]
    slots = [pool.alloc_slot() for _ in range(batch)]
    fwd = v4pool.Forward(pool, batch, batch * MTP, blocks_per_seq, win=WIN, index_topk=TOPK)
    # The same step's FlashMLA buffers from the builder and the pack themselves (flashmla=True:
    # FlashMLA's convention, the narrowest widths for these capacities).
    fwdf = v4pool.Forward(pool, batch, batch * MTP, blocks_per_seq, win=WIN, index_topk=TOPK, flashmla=True)
    # Contexts a little apart (up to 300 tokens short of `context`), block tables over the
    # pool's blocks in a different rotation per sequence (sequences share blocks: the rows are
    # random anyway, and 256 sequences of 1M tokens would not fit one pool otherwise).
    ctx = [context - int(x) for x in torch.randint(0, 300, (batch,), generator=cpu)]
    ids = [b.id for b in blocks]
    tables = [[ids[(s * 31 + k) % nblocks] for k in range(blocks_per_seq)] for s in range(batch)]
    slot_pos = [pool.slot_position(s) for s in slots]
    for f in (fwd, fwdf):
        f.decode_stage(slot_pos, ctx, tables, [MTP] * batch)
        f.decode_build()
    positions = [c - MTP + j for c in ctx for j in range(MTP)]
    k0, _ = pool.page_view(0)
    _fill_random_rows(torch.from_dlpack(k0), gen)
    r = list(pool.ratios)
    csa = [i for i, x in enumerate(r) if x == 4]
    hca = [i for i, x in enumerate(r) if x == 128]
    layers = [r.index(0), csa[0], csa[10], hca[0], hca[9]]
    T = batch * MTP
    nwin = torch.clamp(torch.tensor(positions, device=dev) + 1, max=WIN)
    sink = torch.randn(HEADS, device=dev, generator=gen)
    scale = 512 ** -0.5
    report = []
    for layer in layers:
        ratio = r[layer]
        cls = hf.CLASS[ratio]
        topk = None
        if ratio == 4:  # the indexer's top-k: 512 distinct entries a token, of those it may see
            seen = torch.tensor([(p + 1) // 4 for p in positions], device=dev)
            score = torch.rand(T, int(seen.max()), device=dev, generator=gen)
            score = score.masked_fill(torch.arange(score.shape[1], device=dev) >= seen.unsqueeze(1), -1.0)
            topk = score.topk(min(TOPK, score.shape[1]), dim=1).indices.to(torch.int32)
            topk = torch.where(torch.gather(score, 1, topk.long()) < 0, torch.full_like(topk, -1), topk)
            fwd.decode_csa_pack(topk.contiguous())
            fwdf.decode_csa_pack(topk.contiguous())
        ind = torch.from_dlpack(fwd.decode_indices(cls))
        ptr = torch.from_dlpack(fwd.decode_indptr(cls))
        view, shift = pool.page_view(layer)
        k_cache = torch.from_dlpack(view)
        pool.synchronize()
        idx, tl, eidx, etl = hf.flashmla_operands(ind, ptr[: T + 1], nwin, shift, s_q=MTP)
        _check_operands(pool, plan.ring_slots, layer, ratio, shift, tables, slot_pos, positions, idx.cpu(), tl.cpu(),
                        None if eidx is None else eidx.cpu(), None if etl is None else etl.cpu(),
                        None if topk is None else topk.cpu(), [0, T - 1])
        built = _builder_operands(fwdf, layer, T, shift, idx, tl, eidx, etl, ratio == 128)
        q = (torch.randn(batch, MTP, HEADS, 512, device=dev, generator=gen) * 0.3).to(torch.bfloat16)
        ref = _reference(q, k_cache, idx, tl, eidx, etl, sink, scale)
        assert torch.isfinite(ref).all()
        if ops is None:
            continue
        extra = k_cache if eidx is not None else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ops.sparse_decode_fwd(q, k_cache, idx, tl, sink, None, None, extra, eidx, etl, 512, scale, None,
                                    False)[0]
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) * 1e6
        err, m = (out.float() - ref).abs().max().item(), ref.abs().max().item()
        # The builder's own buffers, each MTP token a batch entry of one query (FlashMLA's
        # lengths are per batch entry; the builder's are per token).
        bi, bl, bei, bel = built
        q1 = q.reshape(T, 1, HEADS, 512)
        out1 = ops.sparse_decode_fwd(q1, k_cache, bi, bl, sink, None, None, k_cache if bei is not None else None,
                                     bei, bel, 512, scale, None, False)[0]
        err1 = (out1.float().view_as(ref) - ref).abs().max().item()
        width = idx.shape[-1] + (0 if eidx is None else eidx.shape[-1])
        bwidth = bi.shape[-1] + (0 if bei is None else bei.shape[-1])
        report.append(f"layer {layer} (ratio {ratio}, shift {shift}, {width} indices): "
                      f"max|err| {err:.2e} of {m:.2e}, first call {us:.0f} us; "
                      f"builder's buffers ({bwidth} wide) max|err| {err1:.2e}")
        assert err <= 2e-2 * m and err1 <= 2e-2 * m, report[-1]
    print(f"\nV4-Flash {dtype}, batch {batch}, context {context}, MTP {MTP}, {HEADS} heads:")
    for line in report:
        print("  " + line)
