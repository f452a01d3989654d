"""Does FlashMLA's V4 sparse decode read a cache of 2-row pages, and at what speed?

docs/flashmla.md ("One HCA view") needs FlashMLA to take `k_cache` / `extra_k_cache` of shape
`[blocks, 2, 1, 584]` (a page of 2 rows: 2 x 576 B data, then 2 x 8 B scales) with a block
stride larger than the page (the pool's envelope). FlashMLA's source checks only stride(1) ==
584; the library as vLLM ships it may check more. A row zero-padded to 640 B (10 whole 64-B
HBM atoms; the experimental `flashmla-v4-p1`, docs/flashmla.md "Partial HBM atoms") needs
`[rows, 1, 1, 584]` with a block stride of 640 B. This probe answers on the device:

1. the same random rows laid out in 64-row pages and in 2-row pages (contiguous, and with a
   block stride of an envelope), the same indices: both outputs against a torch reference that
   dequantises the rows (FlashMLA's own V4 format: 448 e4m3 + 64 bf16, 7 e8m0 scales + a pad);
2. the decode's time over both layouts at serving shapes (batch x s_q queries, 64 heads, a
   128-wide window part and a wide extra part), CUDA events, same call.

usage: python3 flashmla_page_probe.py LIB.so   (LIB: vLLM's _flashmla_C.abi3.so)
Prints one line per check; exits 1 if a layout the library accepts gives wrong output.
"""
import sys

import torch

torch.ops.load_library(sys.argv[1])
ops = torch.ops._flashmla_C
dev = "cuda"
D, H = 512, 64
ROW, DATA, SC = 584, 576, 8


def rows(n, gen):
    """n random V4 rows: (data [n, 576] uint8, scales [n, 8] uint8, dequantised [n, 512] fp32)."""
    nope = torch.randn(n, 448, device=dev, generator=gen) * 0.5
    exps = torch.randint(120, 130, (n, 7), device=dev, dtype=torch.int32, generator=gen)
    scale = torch.pow(2.0, (exps - 127).float()).repeat_interleave(64, -1)
    q8 = (nope / scale).to(torch.float8_e4m3fn)
    rope = torch.randn(n, 64, device=dev, generator=gen).to(torch.bfloat16)
    data = torch.cat([q8.view(torch.uint8), rope.view(torch.uint8)], -1)
    sc = torch.zeros(n, SC, dtype=torch.uint8, device=dev)
    sc[:, :7] = exps.to(torch.uint8)
    ref = torch.cat([q8.float() * scale, rope.float()], -1)
    return data, sc, ref


def paged(data, sc, page, stride_rows=None, stride_bytes=None):
    """The rows in pages of `page` rows ([page x 576][page x 8]); consecutive pages `stride_rows`
    rows (or `stride_bytes` bytes) apart (default: packed). Returns the [pages, page, 1, 584]
    view FlashMLA takes."""
    n = data.shape[0]
    pages = n // page
    stride = stride_bytes or (stride_rows or page) * ROW
    buf = torch.full((pages * stride + page * ROW,), 0xA5, dtype=torch.uint8, device=dev)
    for p in range(0, pages, 4096):  # chunks keep the temporaries small
        q = min(pages, p + 4096)
        blk = buf[p * stride:].as_strided((q - p, page * ROW), (stride, 1))
        blk[:, : page * DATA] = data[p * page:q * page].reshape(q - p, page * DATA)
        blk[:, page * DATA:] = sc[p * page:q * page].reshape(q - p, page * SC)
    return buf.as_strided((pages, page, 1, ROW), (stride, ROW, ROW, 1))


def decode(q, kc, idx, tl, ekc=None, eidx=None, etl=None):
    return ops.sparse_decode_fwd(q, kc, idx, tl, None, None, None, ekc, eidx, etl, 512, D ** -0.5, None, False)[0]


def reference(q, ref, idx, tl, eidx=None, etl=None):
    B, S = q.shape[0], q.shape[1]
    out = torch.zeros(B, S, H, 512, device=dev)
    for b in range(B):
        for s in range(S):
            sel = idx[b, s, : tl[b]].long()
            if eidx is not None:
                sel = torch.cat([sel, eidx[b, s, : etl[b]].long()])
            sel = sel[sel >= 0]
            ks = ref[sel]
            p = torch.softmax((q[b, s].float() @ ks.T) * D ** -0.5, -1)
            out[b, s] = p @ ks[:, :512]
    return out


def main():
    gen = torch.Generator(device=dev)
    gen.manual_seed(45)
    n = 64 * 64  # rows
    data, sc, ref = rows(n, gen)
    B, S = 4, 2
    q = (torch.randn(B, S, H, D, device=dev, generator=gen) * 0.3).to(torch.bfloat16)
    idx = torch.randint(0, n, (B, S, 128), device=dev, dtype=torch.int32, generator=gen)
    tl = torch.tensor([128, 100, 77, 1], dtype=torch.int32, device=dev)
    eidx = torch.randint(0, n, (B, S, 256), device=dev, dtype=torch.int32, generator=gen)
    etl = torch.tensor([256, 3, 200, 64], dtype=torch.int32, device=dev)
    for b in range(B):
        idx[b, :, tl[b]:] = -1
        eidx[b, :, etl[b]:] = -1
    want = reference(q, ref, idx, tl, eidx, etl)
    bad = False
    layouts = {
        "64-row pages": paged(data, sc, 64),
        "2-row pages, packed": paged(data, sc, 2),
        "2-row pages, block stride 1,408 rows": paged(data, sc, 2, 1408),
        "1-row pages, block stride 640 B": paged(data, sc, 1, stride_bytes=640),
    }
    for name, kc in layouts.items():
        for role, args in (
            ("as k_cache and extra_k_cache", (kc, idx, tl, kc, eidx, etl)),
            ("as extra_k_cache beside a 64-row k_cache", (layouts["64-row pages"], idx, tl, kc, eidx, etl)),
        ):
            try:
                out = decode(q, *args)
            except Exception as e:  # the library's own check refusing the layout
                print(f"{name} {role}: REFUSED: {str(e).splitlines()[0][:240]}")
                continue
            err = (out.float() - want).abs().max().item()
            ok = err < 2e-2 * want.abs().max().item()
            bad |= not ok
            print(f"{name} {role}: {'OK' if ok else 'WRONG'} max|err| {err:.3e} of max|ref| {want.abs().max().item():.3e}")

    # Timing at serving shapes: the same rows and indices over both page sizes: 2-row pages
    # packed (the whole plane in 2-row pages: v4pool's `flashmla-v4-p2`) and 2-row pages 64 rows
    # apart (one page of a block's envelope per block). 256K rows: 150 MB packed, 4.9 GB 64 rows
    # apart; both past the L2.
    n = 1 << 18
    data, sc, _ = rows(n, gen)
    big = {
        "64-row pages": paged(data, sc, 64),
        "2-row pages, packed": paged(data, sc, 2),
        "2-row pages, stride 64 rows": paged(data, sc, 2, 64),
        "1-row pages, stride 640 B": paged(data, sc, 1, stride_bytes=640),
    }
    del data, sc
    for B, S, extra in ((64, 1, 2048), (256, 2, 2048), (1024, 1, 1024)):
        q = (torch.randn(B, S, H, D, device=dev, generator=gen) * 0.3).to(torch.bfloat16)
        idx = torch.randint(0, n, (B, S, 128), device=dev, dtype=torch.int32, generator=gen)
        tl = torch.full((B,), 128, dtype=torch.int32, device=dev)
        eidx = torch.randint(0, n, (B, S, extra), device=dev, dtype=torch.int32, generator=gen)
        etl = torch.full((B,), extra, dtype=torch.int32, device=dev)
        times = {}
        for name, kc in big.items():
            try:
                decode(q, kc, idx, tl, kc, eidx, etl)
            except Exception as e:
                print(f"timing {name}: REFUSED: {str(e).splitlines()[0][:160]}")
                continue
            torch.cuda.synchronize()
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(30):
                decode(q, kc, idx, tl, kc, eidx, etl)
            z.record()
            torch.cuda.synchronize()
            times[name] = a.elapsed_time(z) / 30 * 1e3
        line = ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
        base = times.get("64-row pages")
        if base:
            line += "".join(f"; {k} / 64-row = {v / base:.3f}" for k, v in times.items() if k != "64-row pages")
        print(f"timing batch {B} x s_q {S}, window 128 + extra {extra}: {line}")
    sys.exit(1 if bad else 0)


main()
