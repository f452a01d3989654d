#!/usr/bin/env python3
"""vLLM 0.33's own kernels for the pool-side writes of one DeepSeek-V4 decode step, timed as one
CUDA graph beside v4pool's (benches/step.rs, issue 34). Holds no vLLM code: `extract` lays the
few vLLM files it imports (each checked against its git blob id at v0.33.0, the wheel against
its sha256) and stand-ins of our own for the rest of the package into a folder git ignores;
`run` imports them from there.

  python3 benches/peers/vllm_step.py extract WHEEL DEST     # here; DEST must be git-ignored
  python3 DEST/vllm_step.py run [--v4pool STEP_LOG] [--models v4-flash,v4-pro]
        [--batches 1,16,64,256,1024] [--mtp 1,2] [--reps 100] [--check-only]

What one vLLM decode step issues for the same writes (vllm/models/deepseek_v4/compressor.py,
attention.py, the FLASHMLA_SPARSE_DSV4 metadata builders), all Triton from the wheel:

  builders   once a step: compute_token_to_req_indices, is_valid, the SWA window indices
             (_COMPUTE_SWA_INDICES_AND_LENS_KERNEL), the C4 and C128 compressed slot mappings
             (block_table.clamp_, get_compressed_slot_mapping), build_c128a_topk_metadata;
  own rows   every layer: quantize_and_insert_k_cache (bf16 K -> the fp8_ds_mla 584 B row).
             On CUDA vLLM writes this row inside torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_
             rope_quant_insert (C++, fused with the query's norm and RoPE), which a wheel's
             compiled extension alone cannot be timed without; the Triton kernel makes the same
             write;
  state      per compressor and layer: SavePartialStatesKernel (kv, score + ape into the paged
             state cache);
  compress   per compressor and layer: _fused_kv_compress_norm_rope_insert_sparse_attn (main,
             head 512) and _fused_kv_compress_norm_rope_insert_indexer_attn (indexer, head
             128): softmax-pool the state, RMSNorm, RoPE, quantise, write the compressed row or
             index key. MODEL ARITHMETIC IS FUSED into these writes (v4pool takes the entries the
             model computed); they are timed as they are. On CUDA vLLM runs a CuTeDSL kernel for
             the head-512 path (nvidia/ops/sparse_attn_compress_cutedsl.py, needs
             cutlass-dsl); the Triton one is the path vLLM takes elsewhere;
  translate  per CSA layer: compute_global_topk_indices_and_lens.

Checked before timing (torch references written here): the state rows (exact), the own rows
(RoPE bits exact, NoPE within e4m3's rounding of the input at the row's scale), the translate
(exact); the compress kernels' rows are checked written and finite only (their arithmetic is the
model's). Timing: graph replays, a 256 MiB memset before each (cold L2), median of --reps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
# git blob id at v0.33.0 -> path in the package tree
FILES = {
    "823c4856659dd6ce2f640ec8152ee813bee58088": "vllm/model_executor/warmup/jit_warmup.py",
    "1fdaa20e870600fe3a4fdd0a605985e022f1bd56": "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    "1852e77ee28fc8521a18375bcc77f61bb1c56727": "vllm/v1/attention/ops/metadata.py",
    "31cfaab5dc26a5203d3e1d98c8cd47a0d3366886": "vllm/v1/attention/backends/mla/compressor_utils.py",
    "b6c090aa3fabe975fca70d7ae4410c4f693f88f6": "vllm/v1/attention/backends/mla/sparse_swa.py",
    "cdab7d23ae071bf87fd085c55ade9ead2c7855b0": "vllm/models/deepseek_v4/sparse_mla.py",
    "e190d95437b57ebd37857a57bc26b2c4077495c3": "vllm/models/deepseek_v4/common/ops/cache_utils.py",
    "d9e30b08d78b322d8a331d729b12f9c42af0a095": "vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py",
    "6a554b9b4e02321e91954d7e04ee66d12c6b6345": "vllm/models/deepseek_v4/common/ops/save_partial_states.py",
    "54b1b9be7e899bdadb8ecf2b27132f3fbbbb3ff3": "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py",
    "6936be9fa1690afff4d2593f6fbefcb844f9ad5c": "vllm/v1/attention/ops/common.py",
    "d07fe7cf7485c1a67ea5763f5e4e18767985f934": "vllm/utils/math_utils.py",
    "f65f1bb52626f10ce8b79f1c738614f45840234f": "vllm/transformers_utils/deepseek_v4_utils.py",
}

# ---- extract ------------------------------------------------------------------------------------

# Our stand-ins for the parts of the vllm package the files import but the bench never runs.
STUB = '''"""Stand-in names (ours) for vLLM imports the bench never calls."""


class _Any(type):
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Any(name, (Any,), {})

    def __getitem__(cls, item):
        return cls


class Any(metaclass=_Any):
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Any(name, (Any,), {})
'''
SHIMS = {
    "vllm/__init__.py": '''try:  # sparse_swa.py names transformers.DeepseekV4Config in a type check only
    from transformers import DeepseekV4Config  # noqa: F401
except Exception:
    import sys
    import types
    m = sys.modules.get("transformers") or types.ModuleType("transformers")
    m.DeepseekV4Config = type("DeepseekV4Config", (), {})
    sys.modules["transformers"] = m
''',
    "vllm/envs.py": "VLLM_TRITON_JIT_WARMUP_NUM_THREADS = 1\n",
    "vllm/triton_utils/__init__.py": "import triton  # noqa: F401\nimport triton.language as tl  # noqa: F401\n\nHAS_TRITON = True\n",
    "vllm/utils/import_utils.py": "def has_cutedsl():\n    return False\n\n\ndef has_deep_gemm():\n    return False\n",
    # The H200 (sm_90) value: MX scales are an SM100 format.
    "vllm/utils/deep_gemm.py": "def mqa_logits_use_mx_scales():\n    return False\n",
    "vllm/model_executor/layers/quantization/utils/quant_utils.py": '''import torch


def get_fp8_min_max():
    f = torch.finfo(torch.float8_e4m3fn)
    return f.min, f.max
''',
    "vllm/platforms/__init__.py": '''import types

import torch


class _Cuda:
    device_type = "cuda"

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def is_fp8_fnuz(self):
        return False

    def is_device_capability_family(self, family):
        return False

    def get_device_capability(self):
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return types.SimpleNamespace(major=major, minor=minor)


current_platform = _Cuda()
''',
}
STUB_MODULES = ["config/__init__", "config/cache", "model_executor/layers/attention_layer_base",
                "platforms/interface", "v1/attention/backend", "v1/attention/backends/utils",
                "v1/attention/ops/flashmla", "v1/kv_cache_interface"]


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def extract(wheel: Path, dest: Path) -> None:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=dest.parent if dest.parent.exists() else ".",
                         capture_output=True, text=True)
    if top.returncode == 0 and str(dest.resolve()).startswith(top.stdout.strip() + "/"):
        ignored = subprocess.run(["git", "check-ignore", "-q", str(dest)], cwd=top.stdout.strip())
        if ignored.returncode != 0:
            sys.exit(f"refusing: {dest} is not ignored by git (vLLM code must not be committed)")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        sys.exit(f"{wheel}: sha256 {digest}, pinned {WHEEL_SHA256}")
    shutil.rmtree(dest / "vllm", ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for blob, path in FILES.items():
            data = z.read(path)
            if git_blob(data) != blob:
                sys.exit(f"{path}: blob {git_blob(data)}, pinned {blob}")
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            (dest / path).write_bytes(data)
    # Every package folder on the way: an empty __init__ (the ops package's own imports
    # kernels the bench does not run).
    for path in list(FILES.values()) + list(SHIMS) + [f"vllm/{m}.py" for m in STUB_MODULES]:
        d = (dest / path).parent
        while d != dest:
            init = d / "__init__.py"
            if not init.exists():
                d.mkdir(parents=True, exist_ok=True)
                init.write_text("")
            d = d.parent
    for path, text in SHIMS.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)
    for m in STUB_MODULES:
        (dest / f"vllm/{m}.py").write_text("from _step_stub import __getattr__  # noqa: F401\n")
    (dest / "_step_stub.py").write_text(STUB)
    (dest / "VLLM_SOURCE").write_text(f"vllm 0.33.0 wheel {wheel} sha256 {digest}\n" +
                                      "".join(f"{b} {p}\n" for b, p in FILES.items()))
    shutil.copy2(__file__, dest / "vllm_step.py")
    print(f"vLLM step peer laid out in {dest} ({len(FILES)} files, blob ids checked)")


# ---- the step ---------------------------------------------------------------------------------

# vLLM's DeepSeek-V4 layout on an H100/H200 (fp8_ds_mla): 256-token KV blocks (C4: 64 rows a
# block, C128: 2), SWA blocks of 64 tokens, window 128, state blocks of 4 (C4) and 8 (C128)
# positions, rows of 448 fp8 + 64 bf16 + 8 scale bytes, blocks padded to 576 B.
WINDOW, KV_BLOCK, SWA_BLOCK, MAX_CTX, MAX_MODEL_LEN = 128, 256, 64, 1_000_000, 1 << 20
BATCH1_CTX = 999_936  # as benches/step.rs: batch 1's last token closes a C4 and a C128 entry
MODELS = {
    "v4-flash": ([0, 0] + [4, 128] * 20 + [4], 512),
    "v4-pro": ([128, 128] + [4, 128] * 29 + [4], 1024),
}


def cdiv(a, b):
    return -(-a // b)


def round_up(a, b):
    return cdiv(a, b) * b


class Step:
    """Buffers and calls of one decode step (one model, batch, tokens per sequence)."""

    def __init__(self, ops, ratios, topk, batch, tps, dev, seed):
        import torch
        self.torch, self.ops = torch, ops
        g = torch.Generator(device=dev).manual_seed(seed)
        self.ratios, self.topk, self.batch, self.tps = ratios, topk, batch, tps
        T = self.T = batch * tps
        if batch == 1:
            ctx = torch.full((1,), BATCH1_CTX, dtype=torch.int64, device=dev)
        else:
            ctx = torch.randint(tps, MAX_CTX + 1, (batch,), generator=g, device=dev)
        self.seq_lens = ctx.to(torch.int32)
        self.qsl = torch.arange(0, T + 1, tps, dtype=torch.int32, device=dev)
        self.req = torch.arange(batch, device=dev).repeat_interleave(tps)
        self.pos = (ctx[self.req] - tps + torch.arange(T, device=dev) % tps).to(torch.int64)
        self.replay_start = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        # Block tables: each request's blocks its own (no two requests write one row).
        nb = self.nb = 3 * batch + 8
        def table(cols, per_req):
            j = torch.arange(cols, dtype=torch.int32, device=dev)
            return (torch.arange(batch, dtype=torch.int32, device=dev)[:, None] * per_req + j % per_req).contiguous()
        self.swa_bt = table(cdiv(MAX_MODEL_LEN, SWA_BLOCK), 3)
        self.c4_bt = table(cdiv(MAX_MODEL_LEN, KV_BLOCK), 3)
        self.c128_bt = table(cdiv(MAX_MODEL_LEN, KV_BLOCK), 3)
        self.st4_bt = table(cdiv(MAX_MODEL_LEN, 4), 3)
        self.st128_bt = table(cdiv(MAX_MODEL_LEN, 8), 17)
        look = lambda bt, bs: (bt[self.req, self.pos // bs].long() * bs + self.pos % bs)  # noqa: E731
        self.swa_slots = look(self.swa_bt, SWA_BLOCK)
        self.st4_slots, self.st128_slots = look(self.st4_bt, 4), look(self.st128_bt, 8)
        # The builders' outputs (sized as vLLM sizes them: max_num_batched_tokens 8192).
        mt = max(8192, T)
        self.t2r = torch.zeros(mt, **i32)
        self.valid = torch.zeros(mt, dtype=torch.bool, device=dev)
        self.swa_idx = torch.zeros(mt, 1, WINDOW, **i32)
        self.swa_lens = torch.zeros(mt, **i32)
        self.c4_sm = torch.empty(mt, dtype=torch.int64, device=dev)
        self.c128_sm = torch.empty(mt, dtype=torch.int64, device=dev)
        self.c128_width = min(max(1 << max(int(ctx.max()) // 128, 1).bit_length(), 128),
                              cdiv(cdiv(MAX_MODEL_LEN, 128), 128) * 128)
        self.g_dec = torch.empty(T, cdiv(cdiv(MAX_MODEL_LEN, 128), 128) * 128, **i32)
        self.d_lens = torch.empty(T, **i32)
        self.pre_buf = torch.empty(1, self.g_dec.shape[1], **i32)
        # Shared model tensors: RoPE cos/sin per position, RMSNorm weights.
        self.cos_sin = torch.rand(MAX_CTX + 1, 64, generator=g, device=dev)
        self.rms512 = torch.rand(512, generator=g, device=dev).to(torch.bfloat16)
        self.rms128 = torch.rand(128, generator=g, device=dev).to(torch.bfloat16)
        # Per layer: inputs and caches.
        row = 448 + 128 + 8
        self.layers = []
        ci = 0
        for r in ratios:
            L = dict(ratio=r)
            L["k"] = torch.randn(T, 512, generator=g, device=dev).to(torch.bfloat16)
            L["swa"] = torch.zeros(nb, round_up(SWA_BLOCK * row, 576), dtype=torch.uint8, device=dev)
            if r:
                coff = 2 if r == 4 else 1
                rows = KV_BLOCK // r
                L["kvc"] = torch.zeros(nb, rows, round_up(rows * row, 576) // rows, dtype=torch.uint8, device=dev)
                L["main"] = self._compressor(g, dev, T, 512, coff, r, batch)
            if r == 4:
                L["idx"] = self._compressor(g, dev, T, 128, 2, 4, batch)
                L["ixc"] = torch.zeros(nb, 64, round_up(64 * 132, 576) // 64, dtype=torch.uint8, device=dev)
                vis = ((self.pos + 1) // 4).clamp(min=1)
                kk = torch.arange(topk, device=dev)
                vals = (torch.rand(T, topk, generator=g, device=dev) * vis[:, None]).long()
                L["topk"] = torch.where(kk < ((self.pos + 1) // 4).clamp(max=topk)[:, None], vals, -1).to(torch.int32)
                ci += 1
            self.layers.append(L)

    def _compressor(self, g, dev, T, head, coff, ratio, batch):
        torch = self.torch
        w = coff * head
        bs = 4 if ratio == 4 else 8
        per_req = 3 if ratio == 4 else 17
        return dict(
            kv_score=torch.randn(T, 2 * w, generator=g, device=dev),  # fp32, as the GEMM emits it
            ape=torch.randn(ratio, w, generator=g, device=dev),
            state=torch.zeros(batch * per_req + 8, bs, 2 * w, device=dev),
            head=head, coff=coff, ratio=ratio, bs=bs)

    # -- the calls -----------------------------------------------------------------------------

    def builders(self):
        o, T = self.ops, self.T
        tok = o.compute_token_to_req_indices(self.qsl, self.t2r, T, T)
        self.torch.ge(self.swa_slots, 0, out=self.valid[:T])
        self.swa_lens[T:] = 0
        o.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL(
            self.swa_idx[:T], self.swa_lens[:T], WINDOW, WINDOW, self.swa_lens, self.swa_lens, self.qsl,
            self.seq_lens, tok, self.valid[:T], self.swa_bt, SWA_BLOCK, self.replay_start,
            num_tokens=T, token_offset=0)
        for bt, rows, ratio, out in ((self.c4_bt, 64, 4, self.c4_sm), (self.c128_bt, 2, 128, self.c128_sm)):
            o.get_compressed_slot_mapping(T, self.swa_slots, self.qsl, self.seq_lens, bt.clamp_(min=0), rows,
                                          ratio, out=out)
        o.build_c128a_topk_metadata(self.pos, 128, T, tok, self.c128_bt, 2, self.swa_slots, self.g_dec,
                                    self.d_lens, self.pre_buf, max_compressed_tokens=self.c128_width)

    def own(self, L):
        self.ops.quantize_and_insert_k_cache(L["k"], L["swa"], self.swa_slots, block_size=SWA_BLOCK)

    def state(self, c):
        w = c["coff"] * c["head"]
        kv, score = c["kv_score"][:, :w], c["kv_score"][:, w:]
        slots = self.st4_slots if c["ratio"] == 4 else self.st128_slots
        st = c["state"]
        self.ops.SavePartialStatesKernel.kernel[(self.T,)](
            kv, kv.stride(0), score, score.stride(0), c["ape"], c["ape"].stride(0), self.pos, st, st.stride(0),
            st.stride(1), slots, c["bs"], HEAD_SIZE=w, TRITON_BLOCK_SIZE=1 << (w - 1).bit_length(),
            STATE_WIDTH=w, COMPRESS_RATIO=c["ratio"])

    def compress(self, c, cache, slot_map, indexer):
        r, st = c["ratio"], c["state"]
        slots = self.st4_slots if r == 4 else self.st128_slots
        bt = self.st4_bt if r == 4 else self.st128_bt
        common = (st, st.stride(0), st.stride(1), self.t2r, self.pos, slots, bt, bt.stride(0), c["bs"],
                  self.rms128 if indexer else self.rms512, 1e-6, self.cos_sin, self.cos_sin.stride(0), cache,
                  slot_map, cache.shape[1])
        if indexer:
            self.ops.fcq._fused_kv_compress_norm_rope_insert_indexer_attn[(self.T,)](
                *common, HEAD_SIZE=128, TRITON_BLOCK_SIZE=128, STATE_WIDTH=256, COMPRESS_RATIO=4, OVERLAP=True,
                ROPE_HEAD_DIM=64, FP8_MAX=448.0, QUANT_BLOCK=128, TOKEN_STRIDE=128, SCALE_DIM=4,
                KV_BLOCK_STRIDE=cache.stride(0), MX_SCALE=False, num_warps=1)
        else:
            self.ops.fcq._fused_kv_compress_norm_rope_insert_sparse_attn[(self.T,)](
                *common, HEAD_SIZE=512, TRITON_BLOCK_SIZE=512, STATE_WIDTH=c["coff"] * 512, COMPRESS_RATIO=r,
                OVERLAP=r == 4, ROPE_HEAD_DIM=64, FP8_MAX=448.0, QUANT_BLOCK=64, TOKEN_STRIDE=576, SCALE_DIM=8,
                KV_BLOCK_STRIDE=cache.stride(0), SANITIZE_CACHE_NANS=False, num_warps=4)

    def translate(self, L):
        T = self.T
        return self.ops.compute_global_topk_indices_and_lens(L["topk"], self.t2r[:T], self.c4_bt, 64,
                                                             self.valid[:T])

    def calls(self, kinds=None):
        """(kind, thunk) for every call of the step, in the model's order."""
        out = [("builders", self.builders)]
        for L in self.layers:
            r = L["ratio"]
            out.append(("own rows", lambda L=L: self.own(L)))
            if r:
                sm = self.c4_sm if r == 4 else self.c128_sm
                out.append(("state", lambda L=L: self.state(L["main"])))
                out.append(("compress (main)", lambda L=L, sm=sm: self.compress(L["main"], L["kvc"], sm, False)))
            if r == 4:
                out.append(("state", lambda L=L: self.state(L["idx"])))
                out.append(("compress (indexer)", lambda L=L: self.compress(L["idx"], L["ixc"], self.c4_sm, True)))
                out.append(("translate", lambda L=L: self.translate(L)))
        return [c for c in out if kinds is None or c[0] in kinds]

    # -- checks (torch references, ours) --------------------------------------------------------

    def check(self):
        torch, T = self.torch, self.T
        for L in self.layers:
            L["swa"].fill_(0xA5)
            if "kvc" in L:
                L["kvc"].fill_(0xFF)  # bf16 NaN: a row the compressor did not write is not finite
        for _, f in self.calls():
            f()
        if self.pos.is_cuda:
            torch.cuda.synchronize()
        bad = []
        # State rows: [kv | score + ape[p % ratio]] at each token's state slot.
        for L in self.layers:
            for name in ("main", "idx"):
                c = L.get(name)
                if c is None:
                    continue
                w = c["coff"] * c["head"]
                slots = self.st4_slots if c["ratio"] == 4 else self.st128_slots
                st = c["state"].view(-1, 2 * w)[slots]
                want = torch.cat([c["kv_score"][:, :w], c["kv_score"][:, w:] + c["ape"][self.pos % c["ratio"]]], 1)
                if not torch.equal(st, want):
                    bad.append(f"state {name} ratio {c['ratio']}")
                    break
        # Own rows: RoPE bf16 exact, NoPE e4m3 x 2^(scale - 127) within e4m3 rounding.
        L = self.layers[0]
        blk, off = self.swa_slots // SWA_BLOCK, self.swa_slots % SWA_BLOCK
        cache = L["swa"]
        data = cache[blk][:, :SWA_BLOCK * 576].reshape(T, SWA_BLOCK, 576)[torch.arange(T), off]
        scales = cache[blk][:, SWA_BLOCK * 576:SWA_BLOCK * 584].reshape(T, SWA_BLOCK, 8)[torch.arange(T), off]
        rope = data[:, 448:].contiguous().view(torch.bfloat16)
        if not torch.equal(rope, L["k"][:, 448:]):
            bad.append("own rows RoPE")
        nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).float().view(T, 7, 64)
        nope = nope * torch.exp2(scales[:, :7].float() - 127)[:, :, None]
        ref = L["k"][:, :448].float().view(T, 7, 64)
        # (On the CPU, Triton 3.6's interpreter rounds e4m3 wrongly where the rounding carries
        # into the next binade, e.g. 125.5 -> 64: the NoPE check is the device's.)
        # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value (normal range), and below
        # 2^-6 x scale the subnormal step 2^-9 x scale (scale <= 2 amax / 448).
        tol = 2.0 ** -4 * ref.abs() + ref.abs().amax(2, keepdim=True) / 448 * 2.0 ** -8
        if self.pos.is_cuda and not torch.all((nope - ref).abs() <= tol):
            bad.append("own rows NoPE")
        # Translate: the block-table lookup of every valid top-k entry.
        for L in self.layers:
            if L["ratio"] != 4:
                continue
            got, lens = self.translate(L)
            t = L["topk"].long()
            want = torch.where(t >= 0, self.c4_bt[self.req[:, None], (t.clamp(min=0) // 64)].long() * 64 + t % 64, -1)
            if not torch.equal(got.long(), want) or not torch.equal(lens, (t >= 0).sum(1).int()):
                bad.append("translate")
            break
        # Compressed rows and keys of the first CSA layer: written where a token closes an entry,
        # and finite.
        L = next(L for L in self.layers if L["ratio"] == 4)
        ok_rows = (self.c4_sm[:T] >= 0)
        if bool(ok_rows.any()):
            s = self.c4_sm[:T][ok_rows]
            kvc = L["kvc"].view(L["kvc"].shape[0], -1)
            rows = kvc[s // 64][:, :64 * 576].reshape(-1, 64, 576)[torch.arange(len(s)), s % 64]
            if not torch.isfinite(rows[:, 448:].contiguous().view(torch.bfloat16).float()).all():
                bad.append("compressed rows")
        return bad


class Ops:
    """The vLLM functions the step calls, imported from the extracted folder."""

    def __init__(self):
        from vllm.models.deepseek_v4.common.ops import cache_utils
        from vllm.models.deepseek_v4.common.ops import fused_compress_quant_cache as fcq
        from vllm.models.deepseek_v4.common.ops.save_partial_states import SavePartialStatesKernel
        from vllm.models.deepseek_v4.sparse_mla import build_c128a_topk_metadata
        from vllm.v1.attention.backends.mla import sparse_swa
        from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping
        from vllm.v1.attention.ops.metadata import compute_token_to_req_indices
        self.quantize_and_insert_k_cache = cache_utils.quantize_and_insert_k_cache
        self.compute_global_topk_indices_and_lens = cache_utils.compute_global_topk_indices_and_lens
        self.fcq, self.SavePartialStatesKernel = fcq, SavePartialStatesKernel
        self.build_c128a_topk_metadata, self.sparse_swa = build_c128a_topk_metadata, sparse_swa
        self.get_compressed_slot_mapping = get_compressed_slot_mapping
        self.compute_token_to_req_indices = compute_token_to_req_indices


# ---- timing ---------------------------------------------------------------------------------------

class Timer:
    def __init__(self, reps):
        import torch
        self.torch, self.reps = torch, reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def graph(self, thunks):
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in thunks:  # warm-up outside the capture (Triton compiles here)
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in thunks:
                f()
        return g

    def replay(self, g, reps=None):
        torch = self.torch
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        v = []
        for i in range(10 + (reps or self.reps)):
            self.flush.fill_(i & 0xFF)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            if i >= 10:
                v.append(e0.elapsed_time(e1) * 1e3)
        v.sort()
        return statistics.median(v), v[int(0.9 * (len(v) - 1))]


def v4pool_rows(path):
    """benches/step.rs's STEP lines: (model, batch, tps) -> (per-layer, fused) µs."""
    rows = {}
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            f = line.split("\t")
            if f[0] == "STEP" and f[2] == "fp8":
                rows[(f[1], int(f[3]), int(f[4]))] = (float(f[5]), float(f[6]))
    return rows


def run(args):
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ops = Ops()
    dev = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    if args.check_only or dev == "cpu":
        for name in args.models.split(","):
            ratios, topk = MODELS[name]
            st = Step(ops, ratios[:4], 64, 3, 2, dev, 1)
            bad = st.check()
            print(f"check {name} (4 layers, batch 3 x 2, {dev}): {'ok' if not bad else 'FAILED ' + ', '.join(bad)}")
            if bad:
                sys.exit(1)
        return
    timer = Timer(args.reps)
    ours = v4pool_rows(args.v4pool)
    out = Path(os.environ.get("OUT", "."))
    results = []
    print(f"vLLM 0.33.0 step peer on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"graph replay medians of {args.reps} reps, cold L2")
    for name in args.models.split(","):
        ratios, topk = MODELS[name]
        print(f"\n== {name} ({len(ratios)} layers, top-k {topk}), vLLM fp8_ds_mla rows (584 B)")
        print(f"  {'batch':>5} {'tps':>3} | {'launches':>8} | {'vLLM µs':>10} {'p90':>9} | {'v4pool µs':>10} {'vLLM/v4pool':>11} |"
              f" {'w/o builders':>12} | {'w/o compress':>12} {'ratio':>7} | check")
        for tps in [int(x) for x in args.mtp.split(",")]:
            for batch in [int(x) for x in args.batches.split(",")]:
                st = Step(ops, ratios, topk, batch, tps, "cuda", 100 + batch + tps)
                bad = st.check()
                calls = st.calls()
                g = timer.graph([f for _, f in calls])
                us, p90 = timer.replay(g)
                del g
                g2 = timer.graph([f for k, f in calls if k != "builders"])
                us_nb, _ = timer.replay(g2)
                del g2
                # The writes alone: without the compressors' fused model arithmetic (their
                # rows are v4pool's emitted rows and index keys, which take the entries as input).
                g3 = timer.graph([f for k, f in calls if not k.startswith("compress")])
                us_writes, _ = timer.replay(g3)
                del g3
                kinds = {}
                for k in dict.fromkeys(k for k, _ in calls):
                    fs = [f for kk, f in calls if kk == k]
                    gk = timer.graph(fs)
                    kinds[k] = (len(fs), timer.replay(gk, max(10, args.reps // 2))[0])
                    del gk
                mine = ours.get((name, batch, tps))
                ratio = f"{us / mine[1]:>10.2f}×" if mine else f"{'-':>11}"
                mine_s = f"{mine[1]:>10.2f}" if mine else f"{'-':>10}"
                ratio_w = f"{us_writes / mine[1]:>6.2f}×" if mine else f"{'-':>7}"
                print(f"  {batch:>5} {tps:>3} | {len(calls):>8} | {us:>10.2f} {p90:>9.2f} | {mine_s} {ratio} | {us_nb:>12.2f} |"
                      f" {us_writes:>12.2f} {ratio_w} | {'ok' if not bad else 'FAILED ' + ', '.join(bad)}")
                for k, (n, t) in kinds.items():
                    print(f"        {k:<20} {n:>4} launches {t:>9.2f} µs = {t / n:>6.2f} µs each")
                print(f"PEERSTEP\t{name}\t{batch}\t{tps}\t{us:.3f}\t{us_nb:.3f}\t{us_writes:.3f}\t{len(calls)}")
                results.append(dict(model=name, batch=batch, tps=tps, us=us, p90=p90, us_no_builders=us_nb,
                                    us_no_compress=us_writes,
                                    launches=len(calls), kinds=kinds, check=bad or "ok",
                                    v4pool_fused=mine[1] if mine else None))
                del st
                torch.cuda.empty_cache()
    (out / "vllm_step_h200.json").write_text(json.dumps(results, indent=1))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("wheel", type=Path)
    e.add_argument("dest", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--v4pool", default=None)
    r.add_argument("--models", default="v4-flash,v4-pro")
    r.add_argument("--batches", default="1,16,64,256,1024")
    r.add_argument("--mtp", default="1,2")
    r.add_argument("--reps", type=int, default=100)
    r.add_argument("--check-only", action="store_true")
    a = p.parse_args()
    if a.cmd == "extract":
        a.dest.mkdir(parents=True, exist_ok=True)
        extract(a.wheel, a.dest)
    else:
        run(a)


if __name__ == "__main__":
    main()
