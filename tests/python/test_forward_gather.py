"""`Forward.gather_stage` / `Forward.gather`: the §9 window gather (`Pool::window_gather`)
from Python, against the geometry: after prefills through v4pool.hf (the ring written by
`write_window`, wrapping past 128 positions), every layer's gathered window holds, for each
sequence, the KV rows the model wrote at positions `anchor - Wd + 1 ..= anchor` (bf16: the
same bits; fp8: the row format's quantise-dequantise of them), zeros below position 0."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import v4pool  # noqa: E402
import v4pool.hf as hf  # noqa: E402
from test_hf_pool import BACKEND, DEVICE, prompts_of, tiny  # noqa: E402


class Recorder:
    """The engine's `Forward`, recording the tensor of every call of `method` per its first
    argument (a layer, or a CSA rank) in `.kv`."""

    def __init__(self, f, method="write_window"):
        self.f, self.kv, self.method = f, {}, method

    def __getattr__(self, name):
        call = getattr(self.f, name)
        if name != self.method:
            return call

        def record(key, t):
            self.kv.setdefault(key, []).append(t.clone())
            return call(key, t)

        return record


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gather_is_the_window_of_the_ring(dtype):
    model = tiny()
    eng = hf.attach(model, dtype=dtype, budget="96MiB", max_seqs=2, max_context=512, chunk=256,
                    backend=BACKEND)
    rec = eng.fwd = Recorder(eng.fwd)
    long_, short = prompts_of([300, 40], seed=9)
    r1 = eng.add(long_)
    eng.run([r1], 1)  # two prefill forwards: 256 + 44 rows
    r2 = eng.add(short)
    eng.run([r2], 1)  # one: 40 rows
    f = eng.fwd.f
    wd = 64
    assert f.gather_stage([eng._slot(r1), eng._slot(r2)], [299, 39], [300, 40]) == 2
    for layer in range(len(eng.ratios)):
        calls = rec.kv[layer]
        kv1, kv2 = torch.cat(calls[:2]), calls[2]
        if dtype == "fp8":
            kv1, kv2 = hf.quantize_fp8_reference(kv1), hf.quantize_fp8_reference(kv2)
        out = torch.from_dlpack(f.gather(layer, wd)).clone()
        assert out.shape == (2, wd, 512)
        assert torch.equal(out[0], kv1[300 - wd:300]), f"layer {layer}: long sequence"
        assert torch.equal(out[1, :wd - 40], torch.zeros_like(out[1, :wd - 40])), f"layer {layer}: below 0"
        assert torch.equal(out[1, wd - 40:], kv2), f"layer {layer}: short sequence"
    # Refusals, before any launch.
    with pytest.raises(v4pool.V4PoolError):
        f.gather(0, 129)  # wider than the ring
    with pytest.raises(v4pool.V4PoolError):
        f.gather_stage([eng._slot(r1)], [300], [300])  # the anchor at the context length
    slot = eng._slot(r2)
    eng.finish(r2)
    with pytest.raises(v4pool.V4PoolError):
        f.gather_stage([slot], [39])  # a slot no longer held
    eng.finish(r1)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gather_into_an_engine_tensor_equals_the_gather(dtype):
    # `gather_into` writes the same rows as `gather` into a poisoned torch tensor of the
    # engine's, `[max_seqs, Wd, 512]`; rows of pad sequences (past the staged batch) keep their
    # poison; every hostile tensor is refused with V4PoolError before anything is written.
    model = tiny()
    eng = hf.attach(model, dtype=dtype, budget="96MiB", max_seqs=3, max_context=512, chunk=256,
                    backend=BACKEND)
    long_, short = prompts_of([300, 40], seed=9)
    r1, r2 = eng.add(long_), eng.add(short)
    eng.run([r1, r2], 1)
    f = eng.fwd
    wd = 64
    assert f.gather_stage([eng._slot(r1), eng._slot(r2)], [299, 39], [300, 40]) == 2
    poison = torch.full((3, wd, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    for layer in range(len(eng.ratios)):
        out = poison.clone()
        f.gather_into(layer, wd, out)
        want = torch.from_dlpack(f.gather(layer, wd)).clone()
        assert torch.equal(out[:2].view(torch.int16), want.view(torch.int16)), f"layer {layer}"
        assert torch.isnan(out[2]).all(), f"layer {layer}: a pad sequence's rows were written"
    before = poison.clone()
    hostile = [
        (torch.zeros((3, wd, 512), dtype=torch.float32, device=DEVICE), "dtype"),
        (torch.zeros((2, wd, 512), dtype=torch.bfloat16, device=DEVICE), "fewer sequences than max_seqs"),
        (torch.zeros((3, wd + 1, 512), dtype=torch.bfloat16, device=DEVICE), "another window"),
        (torch.zeros((3, wd, 1024), dtype=torch.bfloat16, device=DEVICE)[:, :, :512], "strided rows"),
        (torch.zeros((3, 512, wd), dtype=torch.bfloat16, device=DEVICE).transpose(1, 2), "transposed"),
        (torch.zeros((3 * wd * 512 + 1,), dtype=torch.bfloat16, device=DEVICE)[1:].view(3, wd, 512),
         "misaligned"),
        (torch.from_dlpack(eng.pool.layer_view(0, 0)).view(torch.bfloat16).reshape(-1)[: 3 * wd * 512]
         .view(3, wd, 512), "the pool's own plane"),
        ([[0] * 512] * wd, "not a tensor"),
    ]
    if DEVICE == "cuda" or torch.cuda.is_available():
        other = "cpu" if DEVICE == "cuda" else "cuda"
        hostile.append((torch.zeros((3, wd, 512), dtype=torch.bfloat16, device=other), "another device"))
    for t, why in hostile:
        with pytest.raises(v4pool.V4PoolError) as e:
            f.gather_into(0, wd, t)
        want = "BadOutput" if why in ("misaligned", "the pool's own plane") else "BadTensor"
        assert e.value.variant == want, (why, e.value.variant, str(e.value))
        if isinstance(t, torch.Tensor) and why != "the pool's own plane":
            assert not t.any(), f"{why}: refused, yet written"
    out = poison.clone()
    with pytest.raises(v4pool.V4PoolError):
        f.gather_into(0, 129, torch.zeros((3, 129, 512), dtype=torch.bfloat16, device=DEVICE))  # > ring
    with pytest.raises(v4pool.V4PoolError):
        f.gather_into(len(eng.ratios), wd, out)  # no such layer
    assert torch.equal(out.view(torch.int16), before.view(torch.int16)), "a refused gather wrote"
    eng.finish(r1)
    with pytest.raises(v4pool.V4PoolError):
        f.gather_into(0, wd, out)  # a staged slot no longer held
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))
    eng.finish(r2)
