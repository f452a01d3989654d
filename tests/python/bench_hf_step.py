"""GPU bench: one decode step of a tiny DeepSeek-V4 (transformers 5.23, bf16) at 4K, 32K and
128K context, transformers' own cache against the v4pool-backed model (`v4pool.hf`), and
v4pool's share of the v4pool-backed step in microseconds by kernel (torch.profiler, CUPTI).

Run on the H200 (not collected by pytest: the file name does not start with test_):

    PYTHONPATH=/tmp/site python3 tests/python/bench_hf_step.py [--contexts 4096,32768,131072]
        [--heads 64 --dtype flashmla-v4]   # with V4POOL_FLASHMLA_LIB: also FlashMLA's decode

What it shows: the wall time of a decode step for both (median of --steps steps, after a
warm-up; the model is tiny, so the step is dominated by launch and host overheads, and the
v4pool-backed attention is the reference Python loop of v4pool.hf, not a fused kernel), and
for the v4pool-backed step the device time of every v4pool_* kernel (decode build, KV row
writes, state updates, CSA packs) against the step's total device time.
"""

import argparse
import statistics
import time

import torch

import v4pool.hf as hf
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def tiny(device, heads=2):
    torch.manual_seed(0)
    cfg = DeepseekV4Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=heads,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=128, index_topk=512, sliding_window=128,
        layer_types=[
            "sliding_attention", "compressed_sparse_attention",
            "heavily_compressed_attention", "compressed_sparse_attention",
        ],
        num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, intermediate_size=64,
        initializer_range=0.2, max_position_embeddings=1 << 20,
    )
    return DeepseekV4ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def sync():
    torch.cuda.synchronize()


def hf_steps(model, prompt, steps, chunk):
    """transformers' own cache: chunked prefill, then timed greedy decode steps."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        for s in range(0, len(prompt), chunk):
            out = model(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True,
                        position_ids=torch.arange(s, min(s + chunk, len(prompt)), device="cuda")[None])
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        pos = len(prompt)
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]], device="cuda"))
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t0)
            pos += 1
    return times


def _timed(engine, r, steps):
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        lg = engine.decode([r])[0]
        r.tokens.append(int(lg.argmax()))
        sync()
        times.append(time.perf_counter() - t0)
    return times


def pool_steps(model, prompt, steps, chunk, dtype="bf16", flashmla=False):
    """The v4pool-backed model: the torch loop's decode steps, then (flashmla) FlashMLA's on the
    same pool and request (the two attentions read the same rows; the timed steps go on from
    where the torch loop's left off)."""
    engine = hf.attach(model, dtype=dtype, budget="8GiB", max_seqs=1, max_context=len(prompt) + 3 * steps + 256,
                       chunk=chunk, backend="cuda", attention="flashmla" if flashmla else "torch")
    ops = engine.flashmla
    engine.flashmla = None  # the torch loop first
    r = engine.add(prompt)
    while r.computed < len(prompt):
        engine.prefill([r], [min(chunk, len(prompt) - r.computed)])
    r.tokens.append(0)
    times = _timed(engine, r, steps)
    ftimes = None
    if ops is not None:
        engine.flashmla = ops
        ftimes = _timed(engine, r, steps)
    # One more step under the profiler: v4pool kernels by name.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lg = engine.decode([r])[0]
        r.tokens.append(int(lg.argmax()))
        sync()
    kernels = {}
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            total += us
            if e.name.startswith("v4pool_"):
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += us
    engine.finish(r)
    return times, ftimes, kernels, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=2, help="query heads (FlashMLA takes 64 or 128)")
    ap.add_argument("--dtype", default="bf16", help="the pool's rows (flashmla-v4 for FlashMLA)")
    a = ap.parse_args()
    import os

    flashmla = a.dtype == "flashmla-v4" and bool(os.environ.get(hf.FLASHMLA_ENV))
    model = tiny("cuda", a.heads)
    print(f"tiny DeepSeek-V4: {a.heads} query heads, pool {a.dtype}, FlashMLA decode {'on' if flashmla else 'off'}")
    g = torch.Generator().manual_seed(1)
    for ctx in [int(c) for c in a.contexts.split(",")]:
        prompt = torch.randint(0, 512, (ctx,), generator=g).tolist()
        ht = hf_steps(model, prompt, a.steps, a.chunk)
        pt, ft, kernels, total = pool_steps(model, prompt, a.steps, a.chunk, a.dtype, flashmla)
        extra = f", v4pool-backed with FlashMLA {statistics.median(ft) * 1e6:.0f} us" if ft else ""
        print(f"context {ctx}: decode step transformers cache {statistics.median(ht) * 1e6:.0f} us, "
              f"v4pool-backed (torch loop) {statistics.median(pt) * 1e6:.0f} us{extra} (median of {a.steps})")
        share = sum(v[1] for v in kernels.values())
        print(f"  v4pool kernels {share:.1f} us of {total:.1f} us device time in the profiled step:")
        for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
            print(f"    {name:40s} {n:3d} launches {us:8.1f} us")


if __name__ == "__main__":
    main()
