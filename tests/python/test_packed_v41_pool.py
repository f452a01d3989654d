"""A V4.1-Flash pool in FlashMLA's packed V4.1 layout (`dtype="flashmla-v41-fp4"`): windows in
528-B rows (FlashMLA's `k_cache` through `Pool.page_view`), compressed rows in 288-B fp4 rows
packed in each block (its `extra_k_cache` through `Pool.compressed_view`, shift 0).

Rows written by the pool's row writer read back through those views, decoded by the format
text in torch (`test_flashmla_formats.dequant`, not v4pool), within each format's rounding; on
CUDA the bytes equal what the host backend writes for the same rows. FlashMLA itself cannot read
V4.1 rows on SM90 (its SM90 kernels refuse the V4.1 formats: docs/flashmla.md), so no attention
runs here.
"""

import os

import pytest

torch = pytest.importorskip("torch")
import v4pool  # noqa: E402

from test_flashmla_formats import dequant  # noqa: E402  (the format text in torch)

CUDA = torch.cuda.is_available()


def _run(backend, device):
    gen = torch.Generator().manual_seed(43)
    plan = v4pool.plan(model="v4.1-flash", budget="48MiB", max_seqs=3, dtype="flashmla-v41-fp4")
    pool = v4pool.Pool(plan, backend=backend)
    fwd = v4pool.Forward(pool, 3, 512, 8)
    slots = [pool.alloc_slot() for _ in range(2)]
    blocks = [pool.alloc_block() for _ in range(3)]
    starts, tokens = [0, 700], [150, 128]  # the ring keeps each sequence's last 128
    fwd.stage_window(slots, starts, tokens)
    kv = (torch.randn(sum(tokens), 512, generator=gen) * torch.linspace(0.05, 2, 512)).to(torch.bfloat16)
    kv = kv.to(device)
    entries = [(b, r) for b in range(3) for r in (0, 1, 127)]  # rows every V4.1 class has
    ckv = (torch.randn(len(entries), 512, generator=gen) * torch.linspace(0.1, 3, 512)).to(torch.bfloat16)
    ckv = ckv.to(device)
    r = list(pool.ratios)
    # One dense layer, a ratio-2 owner and reader, a ratio-1 owner and reader.
    layers = [0, 2, 3, 20, 39]
    # V4.1's index slots: ratio 1 the fine ("csa") class, ratio 2 the coarse ("hca") one.
    cls_of = {1: "csa", 2: "hca"}
    for layer in layers:
        fwd.write_window(layer, kv)
        if r[layer] > 0:
            fwd.stage_compressed(cls_of[r[layer]], [blocks[b] for b, _ in entries], [x for _, x in entries])
            fwd.write_compressed(layer, cls_of[r[layer]], ckv)
    pool.synchronize()
    positions = [pool.slot_position(s) for s in slots]
    got = {}
    for layer in layers:
        view, shift = pool.page_view(layer)
        k_cache = torch.from_dlpack(view)
        assert k_cache.shape[1:] == (64, 1, 528) and k_cache.dtype == torch.uint8
        flat = k_cache.view(-1, 528)
        t0 = 0
        for s in range(2):
            for j in (0, 77, 127):
                p = starts[s] + tokens[s] - 128 + j
                row = flat[pool.window_index(layer, positions[s], p % 128) + shift]
                want = kv[t0 + tokens[s] - 128 + j].float()
                dec = dequant("flashmla-v41", row.contiguous(), 1)[0]
                assert (dec - want).abs().max().item() <= want.abs().max().item() / 16, (layer, s, j)
                got[("w", layer, s, j)] = row.cpu().clone()
            t0 += tokens[s]
        if r[layer] == 0:
            with pytest.raises(v4pool.V4PoolError):
                pool.compressed_view(layer)
            continue
        extra = torch.from_dlpack(pool.compressed_view(layer))
        assert extra.shape[1] == 288 and extra.dtype == torch.uint8
        pages = extra[: extra.shape[0] // 64 * 64].view(-1, 64, 1, 288)  # FlashMLA's extra_k_cache
        assert pages.shape[0] > 0
        for j, (b, x) in enumerate(entries):
            i = pool.compress_index(layer, blocks[b].id, x)
            dec = dequant("flashmla-v41-fp4", extra[i].contiguous(), 1)[0]
            want = ckv[j].float()
            # fp4: half the widest e2m1 step of each 16-value group's scale (amax / 6), plus a
            # rounded-down scale's saturation.
            amax = want.view(32, 16).abs().amax(1).repeat_interleave(16)
            assert ((dec - want).abs() <= amax / 6 * 1.07 + amax / 16 + 1e-30).all(), (layer, b, x)
            got[("c", layer, b, x)] = extra[i].cpu().clone()
    return got


def test_packed_rows_decode_on_the_host():
    got = _run("host", "cpu")
    assert len(got) > 0


def test_packed_rows_on_cuda_equal_the_host():
    if not CUDA:
        if os.environ.get("V4POOL_REQUIRE_GPU") == "1":
            pytest.fail("no CUDA device")
        print("SKIP: no CUDA device")
        pytest.skip("no CUDA device")
    host, cuda = _run("host", "cpu"), _run("cuda", "cuda")
    assert host.keys() == cuda.keys()
    bad = [k for k in host if not torch.equal(host[k], cuda[k])]
    assert not bad, f"{len(bad)} rows differ between CUDA and the host: {bad[:4]}"
    print(f"{len(host)} rows byte-equal on CUDA and the host")
