"""A V4-Flash pool in FlashMLA's 584-B paged rows (pages of 64, `flashmla-v4`, and of 2,
`flashmla-v4-p2`), read in place: the row writer writes window rows and compressed rows;
`Pool.page_view(layer)` hands the layer's rows over as FlashMLA's `k_cache` (`[pages, P, 1,
584]`, no copy) with the shift its view indices take; rows decoded
from those bytes by the format text equal the written KV within e4m3 rounding, on the host
backend (CI) and on CUDA. With a CUDA device and FlashMLA's library (`V4POOL_FLASHMLA_LIB`)
FlashMLA's sparse decode reads the pool's plane through those views — window part and
compressed part in one call, for a dense, a CSA and an HCA layer — and agrees with a float32
attention over the same decoded rows (bound 2e-2 of max |ref|: FlashMLA rounds P and its
output to bf16).
"""

import os

import pytest

torch = pytest.importorskip("torch")
import v4pool  # noqa: E402

from test_flashmla_formats import _e4m3, _e8m0  # noqa: E402  (the format text in torch)


def decode_rows(k_cache, ids):
    """Rows `ids` (kernel indices) of a 584-B paged cache [pages, P, 1, 584], by the format
    text: page `i // P` holds P data rows (448 e4m3 + 64 bf16) then P scale rows (7 e8m0 + pad)."""
    P = k_cache.shape[1]
    flat = k_cache.reshape(-1)
    ids = ids.long().to(flat.device)
    page, off = ids // P, ids % P
    base = page * (P * 584)
    data = flat[(base + off * 576)[:, None] + torch.arange(576, device=flat.device)]
    scale = flat[(base + P * 576 + off * 8)[:, None] + torch.arange(7, device=flat.device)]
    nope = _e4m3(data[:, :448].contiguous()) * _e8m0(scale).repeat_interleave(64, 1)
    rope = data[:, 448:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], 1)


def _attend(q, k_cache, idx, lengths, extra=None):
    """float32 softmax attention of q [b,1,h,512] over the cache rows idx[b,0,:len] (+ extra)."""
    out = torch.zeros(q.shape[0], 1, q.shape[2], 512, device=q.device)
    for i in range(q.shape[0]):
        ks = decode_rows(k_cache, idx[i, 0, : lengths[i]])
        if extra is not None:
            ek, eidx, elen = extra
            ks = torch.cat([ks, decode_rows(ek, eidx[i, 0, : elen[i]])], 0)
        s = (q[i, 0].float() @ ks.T) * 512**-0.5
        out[i, 0] = torch.softmax(s, -1) @ ks[:, :512]
    return out

LIB = os.environ.get("V4POOL_FLASHMLA_LIB")
CUDA = torch.cuda.is_available() and os.environ.get("V4POOL_HF_BACKEND", "cuda") != "host"


DTYPES = {"flashmla-v4": 64, "flashmla-v4-p2": 2}  # row format: its page


def _pool(backend, dtype):
    plan = v4pool.plan(model="v4-flash", budget="96MiB", max_seqs=4, dtype=dtype)
    pool = v4pool.Pool(plan, backend=backend)
    fwd = v4pool.Forward(pool, 4, 512, 8)
    return pool, fwd


def _layers(pool):
    r = list(pool.ratios)
    dense = r.index(0)
    csa = [i for i, x in enumerate(r) if x == 4]
    hca = [i for i, x in enumerate(r) if x == 128]
    return [dense, csa[0], csa[3], hca[0], hca[5]]


def _run(backend, device, dtype, ops=None):
    gen = torch.Generator().manual_seed(41)
    pool, fwd = _pool(backend, dtype)
    slots = [pool.alloc_slot() for _ in range(2)]
    blocks = [pool.alloc_block() for _ in range(3)]
    starts, tokens = [0, 1000], [200, 128]  # the ring keeps each sequence's last 128
    fwd.stage_window(slots, starts, tokens)
    kv = (torch.randn(sum(tokens), 512, generator=gen) * torch.linspace(0.05, 2, 512)).to(torch.bfloat16).to(device)
    entries = [(b, r) for b in range(3) for r in (0, 1)]  # rows 0..1 exist in every class
    ckv = (torch.randn(len(entries), 512, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    layers = _layers(pool)
    for layer in layers:
        fwd.write_window(layer, kv)
        cls = {4: "csa", 128: "hca"}.get(pool.ratios[layer])
        if cls:
            fwd.stage_compressed(cls, [blocks[b] for b, _ in entries], [r for _, r in entries])
            fwd.write_compressed(layer, cls, ckv)
    pool.synchronize()
    positions = [pool.slot_position(s) for s in slots]
    results = []
    for layer in layers:
        view, shift = pool.page_view(layer)
        k_cache = torch.from_dlpack(view)
        assert k_cache.shape[1:] == (DTYPES[dtype], 1, 584) and k_cache.dtype == torch.uint8
        # Window part: each sequence's last 128 positions, newest last.
        idx = torch.full((2, 1, 128), -1, dtype=torch.int32)
        t0 = 0
        for s in range(2):
            first = starts[s] + tokens[s] - 128
            for j in range(128):
                p = first + j
                idx[s, 0, j] = pool.window_index(layer, positions[s], p % 128) + shift
                token = t0 + tokens[s] - 128 + j
                got, want = decode_rows(k_cache, idx[s, 0, j : j + 1])[0], kv[token].float()
                err = (got - want).abs().max().item()
                assert err <= want.abs().max().item() / 16, f"layer {layer} seq {s} pos {p}: {err}"
            t0 += tokens[s]
        extra = None
        if pool.ratios[layer] in (4, 128):
            eidx = torch.full((2, 1, 64), -1, dtype=torch.int32)
            for s in range(2):
                for j, (b, r) in enumerate(entries):
                    eidx[s, 0, j] = pool.compress_index(layer, blocks[b].id, r) + shift
                    got, want = decode_rows(k_cache, eidx[s, 0, j : j + 1])[0], ckv[j].float()
                    assert (got - want).abs().max().item() <= want.abs().max().item() / 16
            extra = (k_cache, eidx.to(device), torch.tensor([len(entries)] * 2, dtype=torch.int32, device=device))
        results.append((layer, pool.ratios[layer], k_cache, idx.to(device), extra))
    if ops is None:
        return
    for layer, ratio, k_cache, idx, extra in results:
        q = (torch.randn(2, 1, 64, 512, generator=gen) * 0.3).to(torch.bfloat16).to(device)
        tl = torch.tensor([128, 128], dtype=torch.int32, device=device)
        e = extra or (None, None, None)
        out = ops.sparse_decode_fwd(q, k_cache, idx, tl, None, None, None, e[0], e[1], e[2], 512, 512**-0.5, None, False)[0]
        ref = _attend(q, k_cache, idx, [128, 128], None if extra is None else (k_cache, extra[1], [len(entries)] * 2))
        err, m = (out.float() - ref).abs().max().item(), ref.abs().max().item()
        print(f"flashmla over the pool ({dtype}), layer {layer} (ratio {ratio}): max|err| {err:.3e} of {m:.3e}")
        assert err <= 2e-2 * m


@pytest.mark.parametrize("dtype", DTYPES)
def test_page_views_decode_to_the_written_rows_on_the_host(dtype):
    _run("host", "cpu", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flashmla_reads_the_pool_in_place(dtype):
    if not CUDA or not LIB:
        msg = "no CUDA device" if not CUDA else "V4POOL_FLASHMLA_LIB not set"
        if os.environ.get("V4POOL_REQUIRE_GPU") == "1":
            pytest.fail(msg)
        print(f"SKIP: {msg}")
        pytest.skip(msg)
    torch.ops.load_library(LIB)
    _run("cuda", "cuda", dtype, torch.ops._flashmla_C)
