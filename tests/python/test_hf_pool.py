"""transformers' DeepSeek-V4 on a v4pool pool (`v4pool.hf`) against transformers' own cache.

Tiny random models with the real attention geometry (head_dim 512, RoPE 64, window 128, CSA
ratio 4 with the lightning indexer, HCA ratio 128), built here (no downloads), run in bf16.
The reference is `model.generate` with transformers' own cache, one request at a time; the
pool runs every request of a test in one batch, prompts prefilled in chunks through the
prefill path, then greedy decode steps through the decode path.

Logit bound (bf16 pool): the pool hands attention the same key rows (bit for bit: bf16 KV
copied, compressed entries computed by the same torch operations on the same values), but in
another order ([top-k | window] and [compressed | window] slices instead of [window |
compressed] with -inf masks) and without the masked zeros, so the softmax sums and the
probability-weighted sums accumulate in another order. In bf16 a probability or an attention
output then differs by about one rounding step (2^-8 relative) per layer; through four layers,
the hyper-connections and the lm_head that stays below 2.5 % of the largest logit magnitude.
We assert |delta logit| <= 0.025 * max |logit| + 0.02 at every step (measured here: about 1 %).

Batches. In bf16 activations transformers' own model is not batch-invariant
(test_reference_itself_is_not_batch_invariant_in_bf16), so a batched bf16 run agrees with
one-request references only to rounding, which this random model amplifies from layer to
layer (measured 1.3 % of max |logit| on the host, 3.4 % on the H200): there the test asserts
tokens equal up to a near-tie of the reference (reported) and |delta logit| <= 0.05 * max
|logit| + 0.02, a guard against a wrong row, not a precision claim. The batch proof that admits no near-tie runs the same model in float32
activations over the same bf16 (or fp8) pool: the reference's KV is rounded to the pool's
format where it enters transformers' cache (sliding rows, compressed entries, indexer keys),
so both sides attend the same key values and differ only in float32 accumulation order (the
dense layers see the batch's tokens in one matrix), plus a key element that sits on a bf16
rounding edge and rounds the other way on one side: at most one bf16 step (2^-8) of a logit.
We assert |delta logit| <= 2^-8 * max |logit| and greedy tokens identical at every step
(measured on the host, 2026-12-01: at most 5.1e-4 of max |logit|, a tenth of the bound).
"""

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import v4pool  # noqa: E402
import v4pool.hf as hf  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

BACKEND = os.environ.get("V4POOL_HF_BACKEND", "host")
if BACKEND == "cuda" and not torch.cuda.is_available():
    if os.environ.get("V4POOL_REQUIRE_GPU") == "1":
        raise RuntimeError("V4POOL_REQUIRE_GPU=1 but torch sees no GPU")
    pytest.skip("SKIP: V4POOL_HF_BACKEND=cuda but torch sees no GPU", allow_module_level=True)
DEVICE = "cuda" if BACKEND == "cuda" else "cpu"
if DEVICE == "cpu":
    torch.set_num_threads(1)  # a tiny model: more threads only contend (17x slower on 2 cores)


# Batch composition: transformers' model itself is not row-independent on CPU (a token's
# mHC `comb`, DeepseekV4HyperConnection, differs in its last bits between a batch of one token
# and one of two; torch 2.11), so a batched run (pooled or not) matches one-request runs up to
# rounding only. One request at a time, the pool's run is bit-identical to transformers'
# (test_bf16_one_request_bit_identical); batched, tokens agree except where the reference's
# own top-2 gap is within the rounding bound (a near-tie, reported).
HC_MULT = int(os.environ.get("V4POOL_HF_HC_MULT", "4"))


def tiny(index_topk=16, seed=0, act=torch.bfloat16, window=128):
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=128, index_topk=index_topk, sliding_window=window,
        layer_types=[
            "sliding_attention", "compressed_sparse_attention",
            "heavily_compressed_attention", "compressed_sparse_attention",
        ],
        num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, intermediate_size=64,
        initializer_range=0.2, hc_mult=HC_MULT,
    )
    model = DeepseekV4ForCausalLM(cfg).to(device=DEVICE, dtype=act).eval()
    # The lm_head in float32 (for both runs): bf16 logits of a random model tie exactly at
    # some steps (a 512-way argmax at 2^-8 resolution), which makes the reference's own
    # greedy token arbitrary; the pool is about the KV, not the head's precision.
    model.lm_head.float()
    model.lm_head.register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    return model


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, steps, chunk, quantize=None):
    """transformers' own cache (DynamicCache): the prompt prefilled in chunks of `chunk` (the
    pool's chunk boundaries), then greedy decode steps; tokens and float32 logits per step."""
    from transformers import DynamicCache

    patches = _quantize_reference_kv(_POOL_FORMAT[quantize]) if quantize else []
    toks, logits = [], []
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            ids = torch.tensor([prompt], device=DEVICE)
            for s in range(0, len(prompt), chunk):
                out = model(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True)
            for i in range(steps):
                lg = out.logits[0, -1].float()
                logits.append(lg.cpu())
                toks.append(int(lg.argmax()))
                if i + 1 < steps:
                    out = model(input_ids=torch.tensor([[toks[-1]]], device=DEVICE), past_key_values=cache,
                                use_cache=True)
    finally:
        for undo in patches:
            undo()
    return toks, torch.stack(logits)


# The pool's row formats as torch functions of the model's KV (any activation dtype): bf16
# rows, and fp8 rows packed from bf16 input (the writers take the model's KV as bf16).
_POOL_FORMAT = {
    "bf16": lambda x: x.to(torch.bfloat16).to(x.dtype),
    "fp8": lambda x: hf.quantize_fp8_reference(x.to(torch.bfloat16)).to(x.dtype),
}


def _quantize_reference_kv(fmt):
    """The pool's row format `fmt` applied to transformers' KV: every sliding-window row when
    it enters the cache, every compressed entry when it is emitted; the indexer's compressed
    keys rounded to bf16 (the pool's bf16 indexer cache)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mv4

    hca = mv4.DeepseekV4HCACache
    orig_update, orig_comp = hca.update, hca.update_compressor_states
    orig_sliding = DynamicSlidingWindowLayer.update

    def update(self, key_states, value_states, *a, **k):
        q = fmt(key_states)
        return orig_update(self, q, q, *a, **k)

    def sliding(self, key_states, value_states, *a, **k):  # the dense (sliding-only) layers
        q = fmt(key_states)
        return orig_sliding(self, q, q, *a, **k)

    def comp(self, name, compressed):
        if name == "compressor":
            compressed = fmt(compressed)
        else:  # the indexer's keys
            compressed = _POOL_FORMAT["bf16"](compressed)
        return orig_comp(self, name, compressed)

    hca.update, hca.update_compressor_states = update, comp
    DynamicSlidingWindowLayer.update = sliding

    def undo():
        hca.update, hca.update_compressor_states = orig_update, orig_comp
        DynamicSlidingWindowLayer.update = orig_sliding

    return [undo]


def bound(ref_logits):
    return 0.025 * float(ref_logits.abs().max()) + 0.02


def bound_bf16_batch(ref_logits):
    return 0.05 * float(ref_logits.abs().max()) + 0.02


def bound_f32(ref_logits):
    return 2.0 ** -8 * float(ref_logits.abs().max())


def run_and_compare(model, lengths, steps, chunk, dtype="bf16", max_context=2048, exact=False, ties=None,
                    bound=bound, strict_tokens=False):
    ties = [] if ties is None else ties
    engine = hf.attach(model, dtype=dtype, budget="96MiB", max_seqs=len(lengths),
                       max_context=max_context, chunk=chunk, backend=BACKEND)
    prompts = prompts_of(lengths)
    outs = engine.generate(prompts, steps)
    worst = 0.0
    for p, (toks, logits) in zip(prompts, outs):
        f32 = next(model.parameters()).dtype == torch.float32
        fmt = dtype if (dtype == "fp8" or f32) else None  # a bf16 model's KV is bf16 already
        ref_toks, ref_logits = reference(model, p, steps, chunk, quantize=fmt)
        diff = (ref_logits - logits.cpu()).abs().amax(dim=-1)
        k = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
        if k < len(toks):
            top2 = ref_logits[k].topk(2).values
            gap = float(top2[0] - top2[1])
            msg = (f"prompt {len(p)}: step {k}: pool {toks[k]}, transformers {ref_toks[k]}; "
                   f"reference top-2 gap {gap:.4f}, |delta logit| {float(diff[k]):.4f}")
            if exact or strict_tokens or gap > 2 * float(diff[k]):
                pytest.fail(msg)  # not a near-tie of the reference: a real difference
            print("near-tie, comparison of this request stops:", msg)
            ties.append(msg)
        worst = max(worst, float(diff[: k + 1].max()) / float(ref_logits.abs().max()))
        # Logits within the bound up to (and at) the first divergence; fp8: the same check is
        # the top-1 agreement at every step compared.
        assert float(diff[: k + 1].max()) <= bound(ref_logits), (len(p), diff.tolist())
        if exact:
            assert float(diff.max()) == 0.0, (len(p), diff.tolist())
    return worst


def test_bf16_one_request_bit_identical():
    # Each prompt alone (a batch of one): every logit of 32 decode steps equals transformers'
    # own cache bit for bit, at top-k 16 below the CSA entries. Lengths: below 4, one past 4,
    # below the window, a multiple of 4 and of 128, one past it, >= 8 HCA entries.
    model = tiny(index_topk=16)
    for n in [3, 5, 100, 128, 129, 1030]:
        run_and_compare(model, [n], steps=32, chunk=256, exact=True)


@pytest.mark.parametrize("window", [64, 32, 96])
def test_bf16_other_windows_bit_identical(window):
    # Every window the pool plans, not only V4's 128: one request at a time, every logit of
    # 24 decode steps equals transformers' own cache bit for bit. Prompt lengths around the
    # window (one below, at, one past) and past two HCA entries; chunks of 40 so a chunk's
    # early tokens reach back into the previous chunk's window rows (40 < window) or not
    # (the 32-token window).
    model = tiny(index_topk=16, window=window)
    for n in [3, window - 1, window, window + 1, 300]:
        run_and_compare(model, [n], steps=24, chunk=40, exact=True)


# Prompt lengths of the batch tests (see test_bf16_batch_of_lengths_token_identical).
LENGTHS = [3, 5, 100, 128, 129, 1030]


def test_bf16_batch_of_lengths_token_identical():
    # Prompt lengths: below 4, one past 4, below the window, a multiple of 4 and of 128, one
    # past it, and >= 8 HCA entries (1,030 // 128 = 8); top-k 16 below the CSA entries.
    # One batch of six requests, prefilled in chunks of 256 (the long prompt in five
    # chunks), then 32 decode steps with all six in every step.
    # float32 activations over the bf16 pool: tokens identical at every step, no near-tie
    # allowed, logits within 2^-8 of max |logit| (module doc).
    model = tiny(index_topk=16, act=torch.float32)
    worst = run_and_compare(model, LENGTHS, steps=32, chunk=256, bound=bound_f32, strict_tokens=True)
    print(f"f32 activations, bf16 pool, top-k 16: worst |delta logit| / max |logit| = {worst:.2e}")


def test_bf16_activations_batch_of_lengths():
    # The same batch with bf16 activations, an engine's usual case: transformers' own model is
    # not batch-invariant there (module doc), so tokens agree up to a near-tie of the
    # reference (reported) and logits within the guard of the module doc.
    model = tiny(index_topk=16)
    ties = []
    worst = run_and_compare(model, LENGTHS, steps=32, chunk=256, ties=ties, bound=bound_bf16_batch)
    print(f"bf16, top-k 16: worst |delta logit| / max |logit| = {worst:.4f}; near-ties {len(ties)}")


def test_reference_itself_is_not_batch_invariant_in_bf16():
    # The premise of the bf16 batch bound: transformers with its own cache, six different
    # prompts of 1,030 tokens in one batch (equal lengths: no padding), moves the first
    # prompt's logits against the same prompt alone. Fails if transformers becomes
    # batch-invariant (then the bf16 batch test should be made exact).
    from transformers import DynamicCache

    model = tiny(index_topk=16)
    prompts = prompts_of([1030] * 6, seed=7)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids = torch.tensor(prompts, device=DEVICE)
        for s in range(0, ids.shape[1], 256):
            out = model(input_ids=ids[:, s:s + 256], past_key_values=cache, use_cache=True)
        batched = [out.logits[0, -1].float().cpu()]
        for _ in range(31):
            out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
            batched.append(out.logits[0, -1].float().cpu())
    toks, alone = reference(model, prompts[0], 32, 256)
    diff = float((torch.stack(batched) - alone).abs().max())
    print(f"transformers' own bf16 batch variance: {diff:.2e} = {diff / float(alone.abs().max()):.2e} of max |logit|")
    assert diff > 0


def test_bf16_topk_at_least_the_entries():
    # index_topk 512 >= every request's CSA entries (at most 76 + 32 / 4 here), four requests
    # in one batch, float32 activations over the bf16 pool: tokens identical at every step.
    model = tiny(index_topk=512, seed=3, act=torch.float32)
    worst = run_and_compare(model, [4, 77, 300, 520], steps=32, chunk=128, bound=bound_f32, strict_tokens=True)
    print(f"f32 activations, top-k 512: worst |delta logit| / max |logit| = {worst:.2e}")


def test_fp8_pool_against_quantised_reference():
    # The fp8 pool (e4m3 values, e8m0 tile scales; RoPE bf16) against transformers with the
    # same quantise-dequantise applied to its KV; the bound is the bf16 one (the quantised
    # values are the same on both sides, only the order of accumulation differs).
    model = tiny(index_topk=16, seed=5)
    worst = run_and_compare(model, [6, 140, 260], steps=32, chunk=128, dtype="fp8")
    print(f"fp8: worst |delta logit| / max |logit| = {worst:.4f}")


def test_fp8_pool_float32_activations_top1_every_step():
    # The fp8 pool under float32 activations against transformers with the same bf16 + e4m3 +
    # e8m0 quantise-dequantise on its KV: top-1 agreement at every step (no near-tie allowed)
    # and logits within 2^-8 of max |logit| (module doc; a value on an e4m3 rounding edge is
    # one e4m3 step of one element, which the attention averages over the row).
    model = tiny(index_topk=16, seed=5, act=torch.float32)
    worst = run_and_compare(model, [6, 140, 260, 1030], steps=32, chunk=128, dtype="fp8", bound=bound_f32,
                            strict_tokens=True)
    print(f"fp8, f32 activations: worst |delta logit| / max |logit| = {worst:.2e}")


def test_pack_matches_the_reference_quantisation_byte_for_byte():
    # The kernel's fp8 rows against hf.quantize_fp8_reference's torch formula: the pool's
    # dequantised row equals the reference's quantise-dequantise value for value.
    model = tiny()
    engine = hf.attach(model, dtype="fp8", budget="96MiB", max_seqs=2, chunk=128, backend=BACKEND)
    g = torch.Generator().manual_seed(7)
    kv = (torch.randn(130, 512, generator=g) * torch.logspace(-3, 3, 512)).to(torch.bfloat16)
    kv[5, 64:128] = 0  # an all-zero tile
    kv = kv.to(DEVICE)
    slot = engine.pool.alloc_slot()
    engine.fwd.stage_window([slot], [0], [130])
    layer = engine.ratios.index(4)
    engine.fwd.write_window(layer, kv)
    rows = torch.tensor([engine.pool.window_index(layer, engine.pool.slot_position(slot), p % 128)
                         for p in range(2, 130)])
    got = engine.rows(layer, rows)
    want = hf.quantize_fp8_reference(kv[2:130])
    assert torch.equal(got.cpu().view(torch.int16), want.cpu().view(torch.int16))


def test_forward_arguments_are_checked():
    model = tiny()
    engine = hf.attach(model, dtype="bf16", budget="96MiB", max_seqs=2, chunk=64, backend=BACKEND)
    f = engine.fwd
    slot = engine.pool.alloc_slot()
    f.stage_window([slot], [0], [3])
    layer = engine.ratios.index(4)
    with pytest.raises(v4pool.V4PoolError) as e:
        f.write_window(layer, torch.zeros(3, 512, device=DEVICE))  # float32, not bfloat16
    assert e.value.variant == "BadTensor"
    with pytest.raises(v4pool.V4PoolError):
        f.write_window(layer, torch.zeros(4, 512, dtype=torch.bfloat16, device=DEVICE))  # 4 rows, 3 staged
    with pytest.raises(v4pool.V4PoolError):
        f.write_window(layer, torch.zeros(3, 1024, dtype=torch.bfloat16, device=DEVICE)[:, ::2])  # strided
    with pytest.raises(v4pool.V4PoolError):
        f.write_window(layer, [[0] * 512] * 3)  # not a tensor
    # A top-k row with -1 where the pack reads an id: refused before the launch.
    blk = engine.pool.alloc_block()
    f.decode_stage([engine.pool.slot_position(slot)], [9], [[blk.id]])
    f.decode_build()
    with pytest.raises(v4pool.V4PoolError) as e:
        f.decode_csa_pack(torch.tensor([[1, -1]]))  # position 8 reads 2 ids
    assert e.value.variant == "BadId"
    with pytest.raises(v4pool.V4PoolError) as e:
        f.decode_csa_pack(torch.tensor([[0]]))  # one id, the pack reads two
    assert e.value.variant == "TooNarrow"
    f.decode_csa_pack(torch.tensor([[1, 0]], dtype=torch.int32))
    # A freed slot: the staged window write is refused.
    engine.pool.free_slot(slot)
    with pytest.raises(v4pool.V4PoolError):
        f.write_window(layer, torch.zeros(3, 512, dtype=torch.bfloat16, device=DEVICE))
