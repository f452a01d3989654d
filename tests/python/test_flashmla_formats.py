"""FlashMLA's sparse decode (the kernel vLLM and SGLang attend DeepSeek-V4 through) reading rows
that v4pool's row-format description packed (`v4pool.pack_rows`): the 584-B V4 layout, the
528-B V4.1 layout and the 288-B V4.1 fp4 extra cache. Needs a CUDA device and FlashMLA's library
(`V4POOL_FLASHMLA_LIB`: `_flashmla_C.abi3.so` from the vllm==0.33.0 wheel, never committed);
skips visibly otherwise, and fails with V4POOL_REQUIRE_GPU=1.

The reference dequantises the same bytes in torch from the format text (not from v4pool) and
attends in float32; the bound is FlashMLA's own error on bf16 output (it rounds P and the
output to bf16): 2e-2 of max |ref| (seen: see BENCHMARKS.md). A second check bounds the
format's quantisation error against the bf16 input rows.
"""

import os

import pytest

torch = pytest.importorskip("torch")
import v4pool  # noqa: E402

LIB = os.environ.get("V4POOL_FLASHMLA_LIB")
REQUIRE = os.environ.get("V4POOL_REQUIRE_GPU") == "1"


def _skip(why):
    if REQUIRE:
        pytest.fail(why)
    print(f"SKIP: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def ops():
    if not torch.cuda.is_available():
        _skip("no CUDA device")
    if not LIB or not os.path.isfile(LIB):
        _skip("V4POOL_FLASHMLA_LIB is not a FlashMLA library")
    torch.ops.load_library(LIB)
    return torch.ops._flashmla_C


def _e4m3(b):
    return b.view(torch.float8_e4m3fn).float()


def _e8m0(b):
    return torch.pow(2.0, b.float() - 127.0)


def _e2m1(nib):
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], device=nib.device)
    return table[nib.long()]


def dequant(fmt, plane, n):
    """The format text, in torch: `plane` uint8 on the device, `n` rows -> [n, 512] float32."""
    if fmt in ("flashmla-v4", "flashmla-v4-p2"):
        P = page_rows(fmt)  # a page: P data rows of 576 B, then P scale rows of 8 B
        pages = plane.view(-1, P * 584)
        data = pages[:, : P * 576].reshape(-1, 576)[:n]
        scale = pages[:, P * 576 :].reshape(-1, 8)[:n, :7]
        nope = _e4m3(data[:, :448].contiguous()) * _e8m0(scale).repeat_interleave(64, 1)
        rope = data[:, 448:576].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], 1)
    if fmt == "flashmla-v41":
        rows = plane.view(-1, 528)[:n]
        return _e4m3(rows[:, :512].contiguous()) * _e8m0(rows[:, 512:]).repeat_interleave(32, 1)
    if fmt == "flashmla-v41-fp4":
        rows = plane.view(-1, 288)[:n]
        lo, hi = rows[:, :256] & 0xF, rows[:, :256] >> 4
        vals = torch.stack([_e2m1(lo), _e2m1(hi)], 2).reshape(n, 512)
        return vals * _e4m3(rows[:, 256:].contiguous()).repeat_interleave(16, 1)
    raise ValueError(fmt)


def page_rows(fmt):
    """Rows of the pages FlashMLA reads `fmt` in (`kernel_page_rows`): 2 for `flashmla-v4-p2`."""
    return 2 if fmt == "flashmla-v4-p2" else 64


def packed(fmt, kv):
    planes = v4pool.pack_rows(fmt, kv.cpu().contiguous().view(torch.uint16).numpy().tobytes())
    assert len(planes) == 1
    return torch.frombuffer(bytearray(planes[0]), dtype=torch.uint8).cuda()


def _indices(b, n, topk, lengths, gen):
    idx = torch.full((b, 1, topk), -1, dtype=torch.int32)
    for i in range(b):
        idx[i, 0, : lengths[i]] = torch.randperm(n, generator=gen)[: lengths[i]].to(torch.int32)
    return idx.cuda(), torch.tensor(lengths, dtype=torch.int32).cuda()


def _attend(q, k, idx, lengths, extra=None):
    """float32 softmax attention of q [b,1,h,512] over k rows idx[b,0,:len] (+ extra part)."""
    b = q.shape[0]
    out = torch.zeros(b, 1, q.shape[2], 512, device=q.device)
    for i in range(b):
        ks = k[idx[i, 0, : lengths[i]].long()]
        if extra is not None:
            ek, eidx, elen = extra
            ks = torch.cat([ks, ek[eidx[i, 0, : elen[i]].long()]], 0)
        s = (q[i, 0].float() @ ks.T) * 512**-0.5
        out[i, 0] = torch.softmax(s, -1) @ ks[:, :512]
    return out


CASES = [
    # (format of k_cache, format of extra_k_cache or None, heads)
    ("flashmla-v4", "flashmla-v4", 64),
    ("flashmla-v4", None, 128),
    # The same rows in pages of 2 (the one-HCA-view layout): FlashMLA's sparse decode takes any
    # page_block_size (csrc/api/sparse_decode.h); benches/peers/flashmla_page_probe.py times it.
    ("flashmla-v4-p2", "flashmla-v4-p2", 64),
    ("flashmla-v4-p2", None, 128),
    ("flashmla-v41", "flashmla-v41", 64),
    ("flashmla-v41", "flashmla-v41-fp4", 64),
]


@pytest.mark.parametrize("fmt,extra_fmt,heads", CASES)
def test_flashmla_reads_v4pool_rows(ops, fmt, extra_fmt, heads):
    gen = torch.Generator().manual_seed(33)
    n, b = 1000, 4  # 1000 rows: 15 whole pages and a partial one
    kv = (torch.randn(n, 512, generator=gen) * torch.linspace(0.05, 3, 512)).to(torch.bfloat16)
    kplane = packed(fmt, kv)
    page = page_rows(fmt)
    rows = (n + page - 1) // page * page  # pack_rows rounds to whole kernel pages
    width = kplane.numel() // rows
    kref = dequant(fmt, kplane, n)
    # The format's own error against the input: e4m3 and bf16 parts within a value's group.
    err = (kref - kv.float().cuda()).abs().max().item()
    assert err <= 0.07 * kv.float().abs().max().item(), f"{fmt} quantisation error {err}"
    k_cache = kplane.view(-1, page, 1, width)
    assert k_cache.shape[0] == rows // page and width == {"flashmla-v4": 584, "flashmla-v4-p2": 584, "flashmla-v41": 528}[fmt]
    q = (torch.randn(b, 1, heads, 512, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    lengths = [128, 100, 77, 1]
    idx, tl = _indices(b, n, 128, lengths, gen)
    extra = (None, None, None)
    extra_ref = None
    if extra_fmt is not None:
        ekv = (torch.randn(n, 512, generator=gen) * 0.7).to(torch.bfloat16)
        eplane = packed(extra_fmt, ekv)
        ewidth = eplane.numel() // rows
        elens = [256, 190, 64, 3]
        eidx, etl = _indices(b, n, 256, elens, gen)
        extra = (eplane.view(-1, page, 1, ewidth), eidx, etl)
        extra_ref = (dequant(extra_fmt, eplane, n), eidx, elens)
    call = lambda: ops.sparse_decode_fwd(  # noqa: E731
        q, k_cache, idx, tl, None, None, None, extra[0], extra[1], extra[2], 512, 512**-0.5, None, False
    )[0]
    if fmt == "flashmla-v41" and torch.cuda.get_device_capability() < (10, 0):
        # Seen on the H200 (2026-12-01, vllm 0.33.0's library): the SM90 sparse decode lists
        # V32/V4 cache formats only; V41_KVCACHE_FORMAT is required but not supported.
        with pytest.raises(RuntimeError, match="does not support all required features"):
            call()
        print(f"flashmla {fmt} + {extra_fmt}: refused on SM{''.join(map(str, torch.cuda.get_device_capability()))}, as FlashMLA's SM90 kernels are")
        return
    out = call()
    ref = _attend(q, kref, idx, lengths, extra_ref)
    e = (out.float() - ref).abs().max().item()
    m = ref.abs().max().item()
    print(f"flashmla {fmt} + {extra_fmt}, heads {heads}: max|err| {e:.3e} of max|ref| {m:.3e}")
    assert e <= 2e-2 * m, f"{fmt}+{extra_fmt}: FlashMLA disagrees with the format text ({e} of {m})"


@pytest.mark.parametrize("fmt", ["flashmla-v4", "flashmla-v4-p2", "flashmla-v41", "flashmla-v41-fp4"])
def test_the_text_decoder_reads_pack_rows_on_cpu(fmt):
    """The reference's own decoder (above) against the input rows, on the host: the GPU test's
    reference is only as good as this."""
    gen = torch.Generator().manual_seed(7)
    n = 130
    kv = (torch.randn(n, 512, generator=gen) * torch.linspace(0.05, 3, 512)).to(torch.bfloat16)
    raw = v4pool.pack_rows(fmt, kv.contiguous().view(torch.uint16).numpy().tobytes())[0]
    plane = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = (n + page_rows(fmt) - 1) // page_rows(fmt) * page_rows(fmt)  # 192, or 130 in pages of 2
    assert plane.numel() == rows * {"flashmla-v4": 584, "flashmla-v4-p2": 584, "flashmla-v41": 528, "flashmla-v41-fp4": 288}[fmt]
    got = dequant(fmt, plane, n)
    group = {"flashmla-v4": 64, "flashmla-v4-p2": 64, "flashmla-v41": 32, "flashmla-v41-fp4": 16}[fmt]
    amax = kv.float().abs().view(n, -1, group).amax(-1).repeat_interleave(group, 1)
    rel = 0.26 if fmt.endswith("fp4") else 1 / 16
    assert ((got - kv.float()).abs() <= rel * amax + 1e-30).all()
    # A broken decoder (pages ignored) is caught: V4's scales sit after the page's data rows.
    if fmt in ("flashmla-v4", "flashmla-v4-p2"):
        wrong = _e4m3(plane.view(-1, 584)[:n, :448].contiguous())
        assert not torch.allclose(wrong, got[:, :448])
