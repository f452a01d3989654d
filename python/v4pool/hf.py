"""v4pool.hf: a transformers ``DeepseekV4ForCausalLM`` whose attention reads its KV from a
v4pool pool.

``engine = attach(model, dtype="bf16")`` builds a pool sized from the model's config and
swaps every layer's attention for one that keeps its state in the pool; ``engine.generate``
then runs several requests of different lengths in one batch: prompts prefilled in chunks
through the pool's prefill path, then greedy decode steps through its decode path. Every
pool-side step is a v4pool call (``v4pool.Forward``): the index builds, the CSA translate-pack
from the indexer's top-k, the token's own rows (decode row scatter, prefill ring write), the
compressors' emitted rows at the request's compressed rows and the indexer's keys in the
pool's indexer cache, and the compressor-state update
(section 8). The model-side math (projections, the compressors' softmax pooling over the
state the pool holds, the indexer's scores, attention over the rows the index buffers name)
is transformers' own code or the same torch operations on the same values, in the same
order. docs/forward.md gives the per-forward order.

The scheduler is a ``v4pool.KvManager`` over the pool (``add`` admits with the longest
prefix hit restored from a checkpoint; per forward ``prefill_stop`` / ``allocate`` /
``commit``, then ``complete_inflight``; ``preempt``, ``admit`` again, ``finish``); the
writers take the slot and block handles the manager lends for each request, asked afresh
every forward. ``handoff`` moves a running request to an engine attached with
``manager=False`` on another pool (v4pool's in-process transfer engine).

The indexer's compressed keys live in the pool too: the pool is planned with a bf16 indexer
cache by default (``indexer="bf16"``: transformers' indexer scores bf16 keys), or with the
spec's FP8 / FP4 indexer cache (``indexer="fp8"`` / ``"fp4"``: the keys quantised by the
kernel, and dequantised here with the same formula, ``read_index_rows``), written through
``Forward.write_index_keys`` at the CSA entries' rows and read back through
``Pool.indexer_view``, so a prefix hit, a relocation and a handoff carry them with the blocks.

Attention. By default the attention is a torch loop over the rows the index buffers name
(transformers' eager attention, its sinks included): the reference. With
``attention="flashmla"`` (a pool in FlashMLA's V4 rows, ``dtype="flashmla-v4"`` or its 2-row
pages ``"flashmla-v4-p2"``, on CUDA, a
model with 64 or 128 query heads) every decode step attends through FlashMLA's sparse decode,
the kernel vLLM and SGLang attend DeepSeek-V4 through, reading the pool's plane in place
(``Pool.page_view``: the layer's pages as its ``k_cache`` and ``extra_k_cache``, no copy):
the window part from the class's window rows, the compressed part from the CSA top-k head or
the HCA compressed head, both from the decode build's buffers plus the view's shift, and the
model's sinks as ``attn_sink``. The library is given by path (``flashmla_lib=`` or the
``V4POOL_FLASHMLA_LIB`` environment variable: ``_flashmla_C.abi3.so`` of the ``vllm==0.33.0``
wheel); absent or unusable, the engine refuses with ``FlashMlaUnavailable``. Prefill keeps the
torch loop: FlashMLA's sparse prefill reads bf16 rows an engine gathers itself
(docs/flashmla.md).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import v4pool

try:  # transformers is an optional dependency of the wheel
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as _mv4
except ImportError as e:  # pragma: no cover
    raise ImportError("v4pool.hf needs transformers with DeepSeek-V4 (5.17 or later)") from e

FLASHMLA_ENV = "V4POOL_FLASHMLA_LIB"
# FlashMLA's sparse decode: index widths in multiples of 64 (the pool's default page too), these
# head counts. The V4 row formats it reads: 584-B rows in pages of 64, or of 2.
FLASHMLA_PAGE = 64
FLASHMLA_V4_DTYPES = ("flashmla-v4", "flashmla-v4-p2")
FLASHMLA_HEADS = (64, 128)


class FlashMlaUnavailable(RuntimeError):
    """``attention="flashmla"`` asked for where FlashMLA cannot run: no library given, a library
    that does not load, or a pool / model its sparse decode does not take (the message says
    which)."""


def load_flashmla(path=None):
    """FlashMLA's ops (``torch.ops._flashmla_C``) from the library at `path` (default: the
    ``V4POOL_FLASHMLA_LIB`` environment variable)."""
    path = path or os.environ.get(FLASHMLA_ENV)
    if not path:
        raise FlashMlaUnavailable(f"attention='flashmla' needs FlashMLA's library: set {FLASHMLA_ENV} "
                                  "(or flashmla_lib=) to _flashmla_C.abi3.so from the vllm==0.33.0 wheel")
    if not os.path.isfile(path):
        raise FlashMlaUnavailable(f"FlashMLA library {path!r} is not a file")
    try:
        torch.ops.load_library(path)
        return torch.ops._flashmla_C
    except (OSError, RuntimeError) as e:
        raise FlashMlaUnavailable(f"FlashMLA library {path!r} does not load: {e}") from e


def decode_flashmla_v4_rows(k_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (kernel indices: page * P + offset) of a 584-B paged cache `[pages, P, 1,
    584]` (P = 64: `flashmla-v4`; 2: `flashmla-v4-p2`) as float32 `[n, 512]`: a page holds P
    data rows (448 e4m3 NoPE, 64 bf16 RoPE), then P scale rows (7 e8m0, one per 64 NoPE values,
    and a pad byte)."""
    flat = k_cache.reshape(-1)
    ids = ids.long().to(flat.device)
    p = k_cache.shape[1]
    page, off = ids // p, ids % p
    base = page * (p * 584)
    data = flat[(base + off * 576).unsqueeze(1) + torch.arange(576, device=flat.device)]
    sc = flat[(base + p * 576 + off * 8).unsqueeze(1) + torch.arange(7, device=flat.device)]
    scale = torch.pow(2.0, sc.float() - 127.0).repeat_interleave(64, 1)
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).float() * scale
    rope = data[:, 448:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], 1)


def quantize_flashmla_v4_reference(kv: torch.Tensor) -> torch.Tensor:
    """`kv` [..., 512] rounded to the pool's 584-B rows, as float32: packed from bf16 by the row
    format's one description (``v4pool.pack_rows``, what the pool's writers write) and decoded
    again."""
    rows = kv.reshape(-1, kv.shape[-1])
    n = rows.shape[0]
    if n == 0:
        return kv.float()
    raw = rows.to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy().tobytes()
    plane = torch.frombuffer(bytearray(v4pool.pack_rows("flashmla-v4", raw)[0]), dtype=torch.uint8)
    out = decode_flashmla_v4_rows(plane.view(-1, FLASHMLA_PAGE, 1, 584), torch.arange(n))
    return out.reshape(kv.shape).to(kv.device)


BLOCK = 256  # tokens per block (the pool's block size for every V4 model)
# V4's two compress ratios, the pool's classes (the window is the model's: PoolEngine.win).
CSA, HCA = 4, 128
CLASS = {0: "dense", CSA: "csa", HCA: "hca"}


def _pool_config(config) -> dict:
    """The keys v4pool's config loader reads, from a transformers DeepseekV4Config."""
    d = config.to_dict()
    keep = {
        "num_hidden_layers", "sliding_window", "head_dim", "qk_rope_head_dim", "index_head_dim",
        "index_topk", "layer_types", "compress_rates",
    }
    out = {k: d[k] for k in keep if k in d}
    out["num_nextn_predict_layers"] = 0  # transformers' model runs no MTP layer
    return out


def _dequant_fp8(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rows of the fp8 pool as bf16 `[n, 512]`: e4m3 values times their tile's e8m0 scale
    (the even byte 448 + 2i), the RoPE part as stored."""
    vals = nope[:, :448].view(torch.float8_e4m3fn).float().view(-1, 7, 64)
    e = nope[:, 448:462:2].to(torch.int32)
    scale = torch.where(e == 0, torch.zeros_like(e, dtype=torch.float32), torch.exp2((e - 127).float()))
    out = (vals * scale.unsqueeze(-1)).view(-1, 448).to(torch.bfloat16)
    return torch.cat([out, rope.view(torch.bfloat16)], dim=-1)


def quantize_fp8_reference(kv: torch.Tensor) -> torch.Tensor:
    """The fp8 row format's quantise-dequantise in torch (the reference the fp8 tests apply to
    transformers' own KV): per 64-value NoPE tile the least power-of-two scale with
    amax / scale <= 448, values rounded to e4m3, RoPE kept in bf16."""
    shape = kv.shape
    x = kv.reshape(-1, 512)
    nope = x[:, :448].float().view(-1, 7, 64)
    amax = nope.abs().amax(dim=-1, keepdim=True)
    exp = torch.ceil(torch.log2(amax / 448.0))
    # log2 of a float is not exact at powers of two: step to the least exponent that fits.
    exp = torch.where(amax / torch.exp2(exp - 1) <= 448.0, exp - 1, exp)
    exp = torch.where(amax / torch.exp2(exp) > 448.0, exp + 1, exp)
    scale = torch.where(amax == 0, torch.ones_like(amax), torch.exp2(exp.clamp(-126, 127)))
    q = (nope / scale).to(torch.float8_e4m3fn).float() * torch.where(amax == 0, torch.zeros_like(scale), scale)
    out = torch.cat([q.view(-1, 448).to(torch.bfloat16), x[:, 448:]], dim=-1)
    return out.view(shape)


# ---- the indexer K cache's row formats (docs/forward.md, "Indexer keys") -------------------
# The same formulas as the kernel `v4pool_index_keys` (src/index/host/keys.rs), for finite keys.


def _least_pow2_exponent(amax: torch.Tensor, vmax_mant: float, vmax_exp: int) -> torch.Tensor:
    """The least integer k with amax <= vmax * 2^k, vmax = vmax_mant * 2^vmax_exp (vmax_mant in
    [1, 2)), exactly (frexp, no log2 rounding); amax > 0."""
    mant, e = torch.frexp(amax)  # amax = mant * 2^e, mant in [0.5, 1)
    return torch.where(mant * 2 <= vmax_mant, e - 1 - vmax_exp, e - vmax_exp)


def pack_index_fp8_reference(keys: torch.Tensor):
    """bf16 keys `[n, 128]` in the FP8 indexer format: `(data [n, 128] uint8 e4m3, scale [n]
    float32)`, per row the least power of two with max(amax, 1e-4) / scale <= 448, values
    x / scale rounded to nearest even e4m3."""
    x = keys.reshape(-1, 128).float()
    amax = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).amax(dim=-1)
    amax = torch.clamp(amax, min=torch.tensor(1e-4, dtype=torch.float32).item())
    k = _least_pow2_exponent(amax, 1.75, 8)
    scale = torch.ldexp(torch.ones_like(amax), k)
    data = (x * torch.ldexp(torch.ones_like(amax), -k).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return data.view(torch.uint8), scale


def dequant_index_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 indexer rows (`[n, 128]` uint8, `[n]` float32) as bf16 keys `[n, 128]` (exact: an
    e4m3 value times a power of two)."""
    return (data.view(torch.float8_e4m3fn).float() * scale.reshape(-1, 1)).to(torch.bfloat16)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles (sign in bit 3) of float32 `v`, nearest even code, saturating at 6."""
    a = v.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (code | (torch.signbit(v).int() << 3)).to(torch.uint8)


def pack_index_fp4_reference(keys: torch.Tensor):
    """bf16 keys `[n, 128]` in the FP4 indexer format: `(data [n, 4, 16] uint8, scales [n, 4]
    uint8)`: per group of 32 values the least e8m0 byte B with amax / 2^(B-127) <= 6 (0 for an
    all-zero group), values rounded to nearest even e2m1, value 2j in the low nibble of byte j."""
    x = keys.reshape(-1, 4, 32).float()
    amax = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).amax(dim=-1)
    zero = amax == 0
    k = _least_pow2_exponent(torch.where(zero, torch.ones_like(amax), amax), 1.5, 2)
    b = torch.where(zero, torch.zeros_like(k), torch.clamp(k + 127, min=1))
    inv = torch.where(zero, torch.zeros_like(amax), torch.ldexp(torch.ones_like(amax), 127 - b))
    codes = _e2m1_codes(x * inv.unsqueeze(-1)).view(-1, 4, 16, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data, b.to(torch.uint8)


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dequant_index_fp4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP4 indexer rows (`[n, 4, 16]`, `[n, 4]` uint8) as bf16 keys `[n, 128]` (exact)."""
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float32, device=data.device)
    nib = torch.stack([data & 0xF, data >> 4], dim=-1).long().view(-1, 4, 32)
    b = scales.to(torch.int32)
    scale = torch.where(b == 0, torch.zeros_like(b, dtype=torch.float32), torch.exp2((b - 127).float()))
    return (table[nib] * scale.unsqueeze(-1)).view(-1, 128).to(torch.bfloat16)


def quantize_index_reference(keys: torch.Tensor, indexer: str) -> torch.Tensor:
    """The indexer format's quantise-dequantise of bf16 keys `[..., 128]` (bf16: unchanged)."""
    if indexer == "bf16":
        return keys
    shape = keys.shape
    if indexer == "fp8":
        out = dequant_index_fp8(*pack_index_fp8_reference(keys))
    elif indexer == "fp4":
        out = dequant_index_fp4(*pack_index_fp4_reference(keys))
    else:
        raise ValueError(f"indexer {indexer!r}: bf16, fp8 or fp4")
    return out.to(keys.dtype).view(shape)


def read_index_rows(pool, rank: int, ids: torch.Tensor, rows: torch.Tensor, indexer: str) -> torch.Tensor:
    """Rows `(ids[i], rows[i])` (block id, row in block) of CSA layer `rank`'s indexer K cache,
    read through `Pool.indexer_view` and dequantised: bf16 `[n, 128]`."""
    v = torch.from_dlpack(pool.indexer_view(rank))
    if indexer == "bf16":
        return v[ids, rows]
    nb, per = v.shape[0], v.shape[1]
    if indexer == "fp8":  # per block [per x 128 e4m3][per x f32 scale]
        blk = v.reshape(nb, -1)
        data = blk[:, : per * 128].reshape(nb, per, 128)
        scale = blk[:, per * 128:].reshape(nb, per, 4).view(torch.float32)
        return dequant_index_fp8(data[ids, rows], scale[ids, rows])
    data = v.reshape(nb, 4, per, 16)  # per block [4][per][16] e2m1
    scales = torch.from_dlpack(pool.indexer_view(rank, 1)).reshape(nb, 4, per)  # [4][per] e8m0
    return dequant_index_fp4(data[ids, :, rows], scales[ids, :, rows])


@dataclass
class Request:
    """One request as the engine's scheduler holds it. Driven by the engine's `KvManager`
    (`mid` its manager id: slot and blocks are the manager's, asked afresh every step), or,
    on a pool without a manager (a handoff's receiver), holding its slot and blocks itself."""

    rid: int
    prompt: list
    mid: int = None  # the manager's request id
    slot: object = None  # held directly (no manager)
    blocks: list = field(default_factory=list)  # held directly (no manager)
    tokens: list = field(default_factory=list)  # prompt + generated (the last one pending)
    computed: int = 0  # tokens whose KV is in the pool
    hashes: list = field(default_factory=list)  # chained hashes of its full blocks so far
    logits: list = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


class PoolEngine:
    """A DeepseekV4ForCausalLM on a v4pool pool (see the module doc)."""

    def __init__(self, model, *, dtype="bf16", budget="256MiB", max_seqs=8, max_context=4096,
                 chunk=256, backend="host", device=0, manager=True, policy="elastic", indexer="bf16",
                 attention="torch", flashmla_lib=None):
        cfg = model.config
        if attention not in ("torch", "flashmla"):
            raise ValueError(f"attention {attention!r} is not 'torch' or 'flashmla'")
        self.flashmla = None
        if attention == "flashmla":
            # Everything FlashMLA's SM90 sparse decode takes, refused before a pool is carved.
            why = None
            if backend != "cuda":
                why = f"backend {backend!r}: FlashMLA runs on CUDA"
            elif dtype not in FLASHMLA_V4_DTYPES:
                why = (f"dtype {dtype!r}: FlashMLA's SM90 decode reads the 584-B V4 rows "
                       "(dtype='flashmla-v4' or 'flashmla-v4-p2'); its V4.1 formats need SM100 "
                       "(docs/flashmla.md)")
            elif cfg.num_attention_heads not in FLASHMLA_HEADS:
                why = f"{cfg.num_attention_heads} query heads: FlashMLA's sparse decode takes {FLASHMLA_HEADS}"
            elif cfg.head_dim != 512:
                why = f"head_dim {cfg.head_dim}: FlashMLA's V4 decode takes 512"
            if why:
                raise FlashMlaUnavailable(why)
            self.flashmla = load_flashmla(flashmla_lib)
        self.model = model
        self.cfg = cfg
        self.chunk = chunk
        self.layer_types = list(cfg.layer_types)
        self.topk = cfg.index_topk
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(_pool_config(cfg), f)
            # The indexer's keys in a bf16 indexer cache by default: transformers' indexer scores
            # bf16 keys, which the fp8 / fp4 formats hold only quantised.
            self.plan = v4pool.plan(model=d, budget=budget, max_seqs=max_seqs, dtype=dtype, indexer=indexer)
        self.indexer = indexer
        # The window and the layers' compress ratios as the plan laid the pool out (its ring is
        # the window plus the draft lookahead), checked against the config they came from.
        self.win = self.plan.ring_slots - self.plan.spec_steps
        if self.win != cfg.sliding_window:
            raise ValueError(f"the plan's window {self.win} is not the config's sliding_window {cfg.sliding_window}")
        # On a GPU the pool's work goes on torch's current stream, so every v4pool launch and
        # upload is ordered with the model's own kernels (no cross-stream races).
        stream = torch.cuda.current_stream() if backend == "cuda" else None
        self.pool = v4pool.Pool(self.plan, backend=backend, device=device, stream=stream)
        self.ratios = list(self.pool.ratios)
        want = [cfg.compress_rates.get(t, 0) for t in self.layer_types]  # sliding: no rate
        if self.ratios != want or not set(self.ratios) <= set(CLASS):
            raise ValueError(f"the pool's layer ratios {self.ratios} are not the config's {want}")
        self.device = next(model.parameters()).device
        # The model's activation dtype. The pool holds its rows in its own format (bf16, or
        # fp8 + bf16 RoPE) whatever the model computes in: a float32 model writes its KV
        # rounded to bf16 and reads the rows back widened, as an engine with a narrower KV
        # cache than its activations does.
        self.act = next(model.parameters()).dtype
        self.max_blocks = -(-max_context // BLOCK)
        self.fwd = v4pool.Forward(
            self.pool, max_seqs, max_seqs, self.max_blocks,
            prefill_tokens=max_seqs * chunk, win=self.win, index_topk=self.topk,
        )
        self.fp8 = self.fwd.fp8
        # FlashMLA's 584-B rows sit in pages (data rows, then scale rows): rows are read through
        # the layer's page view and its shift, not a row view.
        self.paged = dtype in FLASHMLA_V4_DTYPES
        self._pages = {}
        self.ordinal = []  # a layer's index among the layers of its class
        seen = {}
        for r in self.ratios:
            self.ordinal.append(seen.get(r, 0))
            seen[r] = seen.get(r, 0) + 1
        self._views = {}
        self._state = {}
        self._ctx = None
        self._next_id = 0
        self._orig = {}
        # The scheduler's side: a KvManager over the pool (prefix reuse with checkpoints,
        # preemption), or none (the pool's slots and blocks taken directly, e.g. a handoff's
        # receiver, which only continues requests handed to it).
        self.manager = v4pool.KvManager(self.pool, policy=policy) if manager else None
        self._ikeys = {}

    # ---- pool views (zero-copy torch tensors over the pool's memory) -------------------

    def view(self, layer):
        if layer not in self._views:
            planes = [torch.from_dlpack(self.pool.layer_view(layer, p)) for p in range(self.pool.num_planes)]
            self._views[layer] = planes
        return self._views[layer]

    def page(self, layer):
        """`layer`'s rows as FlashMLA's `k_cache` (`[pages, P, 1, 584]` uint8 over the pool's
        plane, P the format's page) and the shift its view indices take."""
        if layer not in self._pages:
            v, shift = self.pool.page_view(layer)
            self._pages[layer] = (torch.from_dlpack(v), shift)
        return self._pages[layer]

    def rows(self, layer, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` of `layer`'s view as bf16 `[n, 512]` (fp8 rows dequantised)."""
        idx = idx.long()
        if self.paged:
            k_cache, shift = self.page(layer)
            return decode_flashmla_v4_rows(k_cache, idx + shift).to(self.act)
        planes = self.view(layer)
        if self.fp8:
            return _dequant_fp8(planes[0][idx], planes[1][idx]).to(self.act)
        return planes[0][idx].to(self.act)

    def index_keys(self, layer, blocks, entries: int) -> torch.Tensor:
        """CSA layer `layer`'s first `entries` index keys of a request with block handles
        `blocks`, read from the pool's indexer cache `[entries, index_head_dim]` bf16 (fp8 / fp4
        caches dequantised with their formats' formula)."""
        rank = self.ordinal[layer]
        per = BLOCK // CSA
        w = torch.arange(entries, device=self.device)
        ids = torch.tensor([b.id for b in blocks], dtype=torch.long, device=self.device)
        if self.indexer != "bf16":  # fp8 / fp4: dequantised (exact in bf16)
            return read_index_rows(self.pool, rank, ids[w // per] if entries else w, w % per,
                                   self.indexer).to(self.act)
        if rank not in self._ikeys:
            self._ikeys[rank] = torch.from_dlpack(self.pool.indexer_view(rank))
        return self._ikeys[rank][ids[w // per] if entries else w, w % per].to(self.act)

    def state(self, name):
        if name not in self._state:
            self._state[name] = torch.from_dlpack(self.pool.state_view(name))
        return self._state[name]

    # ---- requests ----------------------------------------------------------------------

    def add(self, prompt) -> Request:
        """A new request, admitted (with the manager: its prefix hit restored)."""
        r = Request(self._next_id, list(prompt))
        self._next_id += 1
        r.tokens = list(prompt)
        if self.manager is None:
            r.slot = self.pool.alloc_slot()
            return r
        r.mid = self.manager.add_request(r.tokens)
        r.hashes = self.manager.block_hashes(r.tokens)
        self.admit(r)
        return r

    def admit(self, r: Request) -> int:
        """Admit `r` (waiting: new or preempted); returns the hit tokens. The slot comes back
        restored from the hit's checkpoint, prefill resumes at the hit."""
        hit = self.manager.admit(r.mid)
        r.computed = hit
        return hit

    def preempt(self, r: Request):
        """Preempt a running request: its slot goes, its committed blocks stay cached (a
        rolling checkpoint at its last block boundary), it waits for `admit`."""
        self.manager.preempt(r.mid)
        r.computed = 0

    def _slot(self, r):
        return r.slot if self.manager is None else self.manager.slot(r.mid)

    def _blocks(self, r):
        return r.blocks if self.manager is None else self.manager.blocks(r.mid)

    def _table(self, r):
        return [b.id for b in r.blocks] if self.manager is None else self.manager.block_table(r.mid)

    def _grow(self, r: Request, n: int):
        """Blocks for `n` more tokens of `r`."""
        if self.manager is not None:
            self.manager.allocate(r.mid, n)
            return
        while len(r.blocks) * BLOCK < r.computed + n:
            r.blocks.append(self.pool.alloc_block())

    def _commit(self, reqs, counts):
        """After a forward: its tokens are in the pool. New full blocks get their hashes
        (generated tokens too, so a resumed request hits them); the manager commits (storing checkpoints at block boundaries), and
        once the forward's work is complete (a GPU: torch's stream, which the pool shares)
        its stored checkpoints become ready."""
        for r, n in zip(reqs, counts):
            r.computed += n
            if self.manager is None:
                continue
            known = len(r.tokens) // BLOCK
            if known > len(r.hashes):
                new = self.manager.block_hashes(r.tokens[: known * BLOCK])[len(r.hashes):]
                self.manager.extend_hashes(r.mid, new)
                r.hashes += new
            self.manager.commit(r.mid, n)
        if self.manager is not None:
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.manager.complete_inflight()
            self.manager.rebalance()

    def finish(self, r: Request):
        if self.manager is not None:
            if r.mid is not None:
                self.manager.finish(r.mid)
                r.mid = None
            return
        for b in r.blocks:
            self.pool.free_block(b)
        if r.slot is not None:
            self.pool.free_slot(r.slot)
        r.blocks, r.slot = [], None

    def handoff(self, r: Request, receiver: "PoolEngine") -> Request:
        """Hand running `r` to `receiver` (an engine without a manager on a pool of the same
        layout) through v4pool's in-process transfer engine: its blocks and whole slot are
        copied; `r` is finished here; the returned request continues on `receiver`."""
        if receiver.manager is not None:
            raise ValueError("the receiver holds handed-off requests itself: attach it with manager=False")
        slot, blocks, n = self.manager.handoff(r.mid, receiver.pool)
        if n != r.computed:
            raise RuntimeError(f"handoff carried {n} tokens, the request computed {r.computed}")
        moved = Request(receiver._next_id, r.prompt, slot=slot, blocks=blocks, tokens=list(r.tokens),
                        computed=r.computed, logits=list(r.logits))
        receiver._next_id += 1
        self.finish(r)
        return moved

    # ---- the attention the model runs --------------------------------------------------

    def __enter__(self):
        for layer in self.model.model.layers:
            attn = layer.self_attn
            self._orig[attn] = attn.forward
            attn.forward = _bind(self, attn)
        return self

    def __exit__(self, *exc):
        for attn, f in self._orig.items():
            attn.forward = f
        self._orig.clear()

    # ---- forwards ------------------------------------------------------------------------

    def _run(self, ctx, input_ids, position_ids):
        self._ctx = ctx
        try:
            with torch.no_grad(), self:
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        finally:
            self._ctx = None
        return out.logits[0].float()

    def prefill(self, reqs, chunks):
        """One prefill forward: `chunks[i]` new tokens of `reqs[i]` (contiguous, in batch order)."""
        starts, ids, pos = [], [], []
        for r, n in zip(reqs, chunks):
            cs = r.computed
            self._grow(r, n)
            starts.append(cs)
            ids += r.tokens[cs:cs + n]
            pos += list(range(cs, cs + n))
        slots = [self._slot(r) for r in reqs]
        f = self.fwd
        f.prefill_stage([s.position for s in slots], starts, chunks, [self._table(r) for r in reqs])
        f.prefill_build()
        f.stage_window(slots, starts, chunks)
        firsts = [sum(chunks[:i]) for i in range(len(reqs))]
        f.state_stage(slots, firsts,
                      [list(range(s, s + n)) for s, n in zip(starts, chunks)],
                      [s + n for s, n in zip(starts, chunks)])
        ctx = _Fwd("prefill", reqs, starts, chunks, [self._blocks(r) for r in reqs], [s.position for s in slots])
        logits = self._run(ctx, torch.tensor([ids], device=self.device), torch.tensor([pos], device=self.device))
        self._commit(reqs, chunks)
        return [logits[firsts[i] + chunks[i] - 1] for i in range(len(reqs))]

    def decode(self, reqs):
        """One decode step: each request's last token (its KV not yet in the pool)."""
        ids, pos = [], []
        for r in reqs:
            self._grow(r, 1)
            ids.append(r.tokens[r.computed])
            pos.append(r.computed)
        f = self.fwd
        slots = [self._slot(r) for r in reqs]
        f.decode_stage([s.position for s in slots], [p + 1 for p in pos], [self._table(r) for r in reqs])
        f.decode_build()
        f.state_stage(slots, list(range(len(reqs))), [[p] for p in pos], [p + 1 for p in pos])
        ctx = _Fwd("decode", reqs, pos, [1] * len(reqs), [self._blocks(r) for r in reqs], [s.position for s in slots])
        logits = self._run(ctx, torch.tensor([ids], device=self.device), torch.tensor([pos], device=self.device))
        self._commit(reqs, [1] * len(reqs))
        return [logits[i] for i in range(len(reqs))]

    def _stop(self, r: Request, chunk: int) -> int:
        """Tokens of `r`'s next prefill chunk (0: it decodes): up to its last known token but
        the pending one (with the manager: also at checkpoint points, see `prefill_stop`)."""
        if self.manager is not None:
            return self.manager.prefill_stop(r.mid, chunk)
        end = len(r.tokens) - (1 if r.generated else 0)
        return max(0, min(chunk, end - r.computed))

    def step(self, reqs, *, chunk=None):
        """One scheduler step over running `reqs`: a prefill forward for those with prompt (or,
        resumed, recomputation) left, else one decode step for all. A request whose prefill
        reached its last token picks its first generated token. Returns whether it decoded."""
        chunk = chunk or self.chunk
        live = [(r, n) for r in reqs for n in [self._stop(r, chunk)] if n > 0]
        if live:
            rs, ns = [r for r, _ in live], [n for _, n in live]
            for r, lg in zip(rs, self.prefill(rs, ns)):
                if r.computed == len(r.tokens):  # the prompt's last token: its logits choose
                    r.logits.append(lg)
                    r.tokens.append(int(lg.argmax()))
            return False
        for r, lg in zip(reqs, self.decode(reqs)):
            r.logits.append(lg)
            r.tokens.append(int(lg.argmax()))
        return True

    def run(self, reqs, max_new_tokens, *, chunk=None):
        """Steps until every request of `reqs` has `max_new_tokens` generated tokens (those
        done drop out of the batch)."""
        while True:
            live = [r for r in reqs if r.generated < max_new_tokens]
            if not live:
                return
            self.step(live, chunk=chunk)

    def generate(self, prompts, max_new_tokens, *, chunk=None):
        """Greedy generation for `prompts` (token lists) in one batch: chunked prefill, then
        decode steps. Returns `(tokens, logits)` per request (generated tokens; the logits
        that chose them, float32)."""
        reqs = []
        try:
            for p in prompts:
                reqs.append(self.add(p))
            self.run(reqs, max_new_tokens, chunk=chunk)
            return [(r.tokens[len(r.prompt):], torch.stack(r.logits)) for r in reqs]
        finally:
            for r in reqs:
                self.finish(r)


@dataclass
class _Fwd:
    """The forward the attention layers are in: its requests and their new tokens."""

    mode: str
    reqs: list
    starts: list  # first new position per request
    counts: list  # new tokens per request
    blocks: list  # per request its block handles (the manager's, current this forward)
    positions: list  # per request its slot position this forward

    def spans(self):
        t = 0
        for r, s, n in zip(self.reqs, self.starts, self.counts):
            yield r, s, n, t
            t += n

    def of(self, r):
        """(slot position, block handles) of `r` this forward."""
        i = next(i for i, x in enumerate(self.reqs) if x is r)
        return self.positions[i], self.blocks[i]


def attach(model, **kw) -> PoolEngine:
    """A PoolEngine over `model` (a DeepseekV4ForCausalLM): see the module doc."""
    return PoolEngine(model, **kw)


def _bind(engine, attn):
    def forward(hidden_states, position_embeddings, position_ids, attention_mask=None, past_key_values=None, **kw):
        return _attention(engine, attn, hidden_states, position_embeddings, position_ids)

    return forward


# ---- compressors over the pool's state ------------------------------------------------------


def _entries(engine, ctx, comp, layer, kv, gate, state_kv, state_score, ratio, overlap, head_dim):
    """Compressed entries that close in this forward, per request: the softmax-gated pool of
    each window, from this forward's rows (tokens at or after the request's start) and the
    pool's state ring (earlier tokens: read before this forward's state update). Returns a
    list per request of (first entry index, entries [n, head_dim] before norm/rope inputs)."""
    out = []
    S = state_kv.shape[2]
    for r, s, n, t0 in ctx.spans():
        # Window w closes at token w * ratio + ratio - 1: those closing in [s, s + n).
        w0 = max(0, -(-(s - ratio + 1) // ratio))
        w1 = (s + n) // ratio  # exclusive
        if w1 <= w0:
            out.append((w0, None, None))
            continue
        pos = ctx.of(r)[0]
        width = 2 * ratio if overlap else ratio
        nw = w1 - w0
        new_kv = kv.new_zeros((1, nw, width, head_dim))
        new_gate = gate.new_full((1, nw, width, head_dim), float("-inf"))

        def tok(p, half):
            """(kv, gate) of token p's half (0: Ca / the only series, 1: Cb)."""
            lo, hi = (0, head_dim) if half == 0 else (head_dim, 2 * head_dim)
            if p >= s:
                return kv[t0 + p - s, lo:hi], gate[t0 + p - s, lo:hi]
            row = p % S
            return (state_kv[comp, pos, row, lo:hi].to(kv.dtype), state_score[comp, pos, row, lo:hi].to(gate.dtype))

        for i, w in enumerate(range(w0, w1)):
            for j in range(ratio):
                p = w * ratio + j
                half = 1 if overlap else 0
                new_kv[0, i, (ratio if overlap else 0) + j], new_gate[0, i, (ratio if overlap else 0) + j] = tok(p, half)
                if overlap and w > 0:
                    q = (w - 1) * ratio + j
                    new_kv[0, i, j], new_gate[0, i, j] = tok(q, 0)
        out.append((w0, new_kv, new_gate))
    return out


def _compress(engine, ctx, module, layer, hidden, kind, ape_name):
    """One compressor (`module`: transformers' compressor or indexer) over this forward:
    its state update in the pool, and the entries that close here (normed and rotated as
    transformers does). Returns per request `(first entry, entries)` or `(w, None)`."""
    ratio = module.compress_rate
    overlap = kind != "hca_main"
    head_dim = module.head_dim
    kv = module.kv_proj(hidden)[0]
    gate = module.gate_proj(hidden)[0]
    # The score the state holds: gate + bias in the model's dtype (transformers adds them so).
    pos = torch.cat([torch.arange(s, s + n, device=kv.device) for _, s, n, _ in ctx.spans()])
    score = gate + module.position_bias[pos % ratio]
    kv_name, score_name = {"csa_main": ("csa_main_kv", "csa_main_score"),
                           "csa_idx": ("csa_idx_kv", "csa_idx_score"),
                           "hca_main": ("hca_main_kv", "hca_main_score")}[kind]
    ordinal = engine.ordinal[layer]
    skv = engine.state(kv_name)
    ssc = engine.state(score_name)
    # Entries first: they read the state ring as the previous forward left it.
    raw = _entries(engine, ctx, ordinal, layer, kv, score, skv, ssc, ratio, overlap, head_dim)
    res = []
    for (w0, nkv, ngate), (r, s, n, t0) in zip(raw, ctx.spans()):
        if nkv is None:
            res.append((w0, None))
            continue
        comp = module.kv_norm((nkv * ngate.softmax(dim=2, dtype=torch.float32).to(nkv.dtype)).sum(dim=2))
        positions = (torch.arange(w0, w0 + nkv.shape[1], device=nkv.device) * ratio).unsqueeze(0)
        cos, sin = module.rotary_emb(comp, position_ids=positions, layer_type=module.rope_layer_type)
        comp = _mv4.apply_rotary_pos_emb(comp.unsqueeze(1), cos, sin).squeeze(1)
        res.append((w0, comp[0]))
    # Then the state update (section 8): this forward's rows into the ring.
    ape = torch.zeros((ratio, kv.shape[1]), dtype=score.dtype, device=score.device)
    engine.fwd.state_update(kind, ordinal, kv.contiguous(), score.contiguous(), ape)
    return res


def _write_entries(engine, layer, cls, ctx, entries, ratio, index_entries=None):
    """The compressor's emitted rows at the requests' compressed rows (before attention); for
    a CSA layer also the indexer's keys of the same entries, in the pool's indexer cache
    (before the indexer scores them)."""
    per_block = BLOCK // ratio
    blocks, rows, kvs = [], [], []
    for (w0, e), (r, *_rest) in zip(entries, ctx.spans()):
        if e is None:
            continue
        for i in range(e.shape[0]):
            w = w0 + i
            blocks.append(ctx.of(r)[1][w // per_block])
            rows.append(w % per_block)
        kvs.append(e)
    if not kvs:
        return
    engine.fwd.stage_compressed(cls, blocks, rows)
    engine.fwd.write_compressed(layer, cls, torch.cat(kvs).to(torch.bfloat16).contiguous())
    if index_entries is not None:
        keys = [e for _, e in index_entries if e is not None]
        engine.fwd.write_index_keys(engine.ordinal[layer], torch.cat(keys).to(torch.bfloat16).contiguous())


def _indexer_topk(engine, ctx, indexer, layer, hidden, q_residual, position_ids, entries):
    """transformers' indexer scoring over each request's compressed keys (read from the
    pool's indexer cache, where this forward's entries were just written): int64 rows
    `[valid ids | -1 tail]`, `min(index_topk, entries)` wide, padded with -1 to one width."""
    rows = []
    for r, s, n, t0 in ctx.spans():
        keys = engine.index_keys(layer, ctx.of(r)[1], (s + n) // indexer.compress_rate)
        hs = hidden[:, t0:t0 + n]
        pid = position_ids[:, t0:t0 + n]
        if keys.shape[0] == 0:
            rows.append(torch.full((n, 1), -1, dtype=torch.long, device=hidden.device))
            continue
        cos_q, sin_q = indexer.rotary_emb(hs, position_ids=pid, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual[:, t0:t0 + n]).view(1, n, -1, indexer.head_dim).transpose(1, 2)
        q = _mv4.apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)
        scores = indexer.scorer(q, keys.unsqueeze(0), hs)
        k = min(indexer.index_topk, keys.shape[0])
        thr = (pid + 1) // indexer.compress_rate
        fut = torch.arange(keys.shape[0], device=keys.device).view(1, 1, -1) >= thr.unsqueeze(-1)
        scores = scores.masked_fill(fut, float("-inf"))
        top = scores.topk(k, dim=-1).indices
        top = torch.where(top >= thr.unsqueeze(-1), torch.full_like(top, -1), top)
        rows.append(top[0])
    width = max(x.shape[1] for x in rows)
    return torch.cat([F.pad(x, (0, width - x.shape[1]), value=-1) for x in rows])


# ---- attention over the rows the index buffers name ----------------------------------------


def _keys_of(engine, layer, ratio, mode, ind, ptr, own, topk, s0, n, t0, dtype):
    """One request's keys and mask for transformers' eager attention, laid out as its own
    cache hands them over: `[window: the last W - 1 positions before the chunk, then the chunk
    (decode: the last W positions, the token's own row last) | every compressed entry in
    ascending order]` (W the model's `sliding_window`, the window the engine's `Forward`
    builds), each row fetched from the pool through the class's index buffer (the
    chunk's own rows in prefill from this forward's KV), masked as transformers masks them:
    the sliding window causally, HCA entries that close after a query, CSA entries its
    top-k did not select. Returns keys `[1, 1, L, 512]` and an additive mask `[1, 1, n, L]`."""
    dev = ind.device
    neg = float("-inf")
    win = engine.win
    p_last = s0 + n - 1
    if mode == "decode":
        a, b = int(ptr[t0]), int(ptr[t0 + 1])
        nw = min(p_last + 1, win)
        sl = ind[a:b]
        window = engine.rows(layer, sl[b - a - nw:])
        head = sl[: b - a - nw]
        wpos = torch.arange(p_last - nw + 1, p_last + 1, device=dev)
        heads = [head]
    else:
        pre0 = min(s0, win - 1)
        a, b = int(ptr[t0]), int(ptr[t0 + 1])
        sl = ind[a:b]
        prev = sl[:pre0] if ratio == HCA else sl[b - a - pre0:]
        window = torch.cat([engine.rows(layer, prev), own[t0:t0 + n]])
        wpos = torch.arange(s0 - pre0, s0 + n, device=dev)
        heads = []
        for t in range(t0, t0 + n):
            a, b = int(ptr[t]), int(ptr[t + 1])
            p = s0 + t - t0
            pre = min(p + 1, win) - min(p - s0 + 1, win)  # window rows of earlier chunks
            heads.append(ind[a + pre:b] if ratio == HCA else ind[a:b - pre])
    qpos = torch.arange(s0, s0 + n, device=dev)
    vis = (wpos.unsqueeze(0) <= qpos.unsqueeze(1)) & (wpos.unsqueeze(0) > qpos.unsqueeze(1) - win)
    wmask = torch.zeros(vis.shape, dtype=dtype, device=dev).masked_fill(~vis, neg)
    if ratio == 0:
        return window.view(1, 1, -1, window.shape[-1]), wmask.view(1, 1, n, -1)
    if ratio == HCA:
        entries = engine.rows(layer, heads[-1])  # the last query's head: every entry so far
        e = torch.arange(entries.shape[0], device=dev)
        ok = e.unsqueeze(0) < ((qpos + 1) // HCA).unsqueeze(1)
        if mode == "decode":
            ok = torch.ones_like(ok)
    else:
        num = (p_last + 1) // CSA  # entries of the context after this forward
        entries = window.new_zeros((num, window.shape[-1]))
        ok = torch.zeros((n, num), dtype=torch.bool, device=dev)
        for i, head in enumerate(heads):
            ids = topk[t0 + i, : head.shape[0]].to(dev)
            if head.shape[0]:
                entries[ids] = engine.rows(layer, head)
                ok[i, ids] = True
    cmask = torch.zeros(ok.shape, dtype=dtype, device=dev).masked_fill(~ok, neg)
    keys = torch.cat([window, entries])
    mask = torch.cat([wmask, cmask], dim=-1)
    return keys.view(1, 1, -1, keys.shape[-1]), mask.view(1, 1, n, -1)


def flashmla_operands(ind, ptr, nwin, shift, s_q=1):
    """FlashMLA's window and compressed index operands of one class from the decode build's
    CSR buffers (`ind`, `ptr`, on the device): token t's slice `ind[ptr[t]:ptr[t+1]]` is
    `[compressed head | window tail]` (docs/index-buffers.md), the tail `nwin[t]` rows long.
    Each part is left-packed into rows a multiple of 64 wide, shifted to the layer's page view
    (`Pool.page_view`), -1 after; a batch's `s_q` consecutive tokens (MTP) form one query
    row group, whose length is the longest of its tokens' (FlashMLA's lengths are per batch
    entry; the shorter tokens' tails are -1, which it skips). Returns (indices [B, s_q, W],
    lengths [B], extra indices [B, s_q, We] or None when no token has a compressed head,
    extra lengths or None)."""
    device = ind.device
    ptr = ptr.to(device).long()
    nwin = nwin.to(device).long()
    start, end = ptr[:-1], ptr[1:]
    head = end - start - nwin

    def part(first, length):
        width = max(FLASHMLA_PAGE, -(-int(length.max()) // FLASHMLA_PAGE) * FLASHMLA_PAGE)
        j = torch.arange(width, device=device)
        ok = j.unsqueeze(0) < length.unsqueeze(1)
        src = torch.where(ok, first.unsqueeze(1) + j, torch.zeros_like(j))
        rows = torch.where(ok, ind[src].long() + shift, torch.full_like(src, -1))
        lengths = length.view(-1, s_q).amax(1)
        return rows.to(torch.int32).view(-1, s_q, width).contiguous(), lengths.to(torch.int32).contiguous()

    idx, tl = part(start + head, nwin)
    if int(head.max()) == 0:
        return idx, tl, None, None
    eidx, etl = part(start, head)
    return idx, tl, eidx, etl


def _flashmla_decode(engine, attn, layer, q, ind, ptr, ctx):
    """One decode step's attention of `layer` for every token through FlashMLA's sparse decode
    over the pool's pages (module doc). Returns `[1, T, H, 512]` in the model's dtype."""
    k_cache, shift = engine.page(layer)
    dev = q.device
    pos = torch.tensor(ctx.starts, device=dev)
    nwin = torch.clamp(pos + 1, max=engine.win)
    idx, tl, eidx, etl = flashmla_operands(ind, ptr, nwin, shift)
    qf = q[0].transpose(0, 1).unsqueeze(1).to(torch.bfloat16).contiguous()  # [T, 1, H, 512]
    sink = attn.sinks.float().contiguous()
    extra = k_cache if eidx is not None else None
    out = engine.flashmla.sparse_decode_fwd(qf, k_cache, idx, tl, sink, None, None, extra, eidx, etl,
                                            512, attn.scaling, None, False)[0]
    return out[:, 0].unsqueeze(0).to(q.dtype)  # [1, T, H, 512]


def _attention(engine, attn, hidden_states, position_embeddings, position_ids):
    ctx = engine._ctx
    layer = attn.layer_idx
    ratio = engine.ratios[layer]
    cls = CLASS[ratio]
    f = engine.fwd
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    cos, sin = position_embeddings[attn.rope_layer_type]
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden_states))
    q = attn.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2)
    q = attn.q_b_norm(q)
    q = _mv4.apply_rotary_pos_emb(q, cos, sin)
    kv = attn.kv_norm(attn.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = _mv4.apply_rotary_pos_emb(kv, cos, sin)
    kv_rows = kv[0, 0].to(torch.bfloat16).contiguous()  # [T, 512], the pool's bf16 input
    T = kv_rows.shape[0]

    if ctx.mode == "decode":
        f.write_decode(layer, kv_rows)  # the token attends to itself: before attention

    topk = None
    if ratio:
        comp = attn.compressor
        kind = "csa_main" if ratio == CSA else "hca_main"
        entries = _compress(engine, ctx, comp, layer, hidden_states, kind, None)
        idx_entries = None
        if ratio == CSA:  # the indexer's entries close at the same windows as the main ones
            idx_entries = _compress(engine, ctx, comp.indexer, layer, hidden_states, "csa_idx", None)
        # Emitted rows and index keys before the indexer and attention read them.
        _write_entries(engine, layer, cls, ctx, entries, ratio, idx_entries)
        if ratio == CSA:
            topk = _indexer_topk(engine, ctx, comp.indexer, layer, hidden_states, q_residual, position_ids, idx_entries)
            if ctx.mode == "decode":
                f.decode_csa_pack(topk)
            else:
                f.prefill_csa_pack(topk)

    if ctx.mode == "decode":
        ind = torch.from_dlpack(f.decode_indices(cls)).long()
        ptr = torch.from_dlpack(f.decode_indptr(cls)).long()
        own = None
    else:
        ind = torch.from_dlpack(f.prefill_buffer("indices", cls)).long()
        ptr = torch.from_dlpack(f.prefill_buffer("indptr", cls)).long()
        if engine.paged:
            own = quantize_flashmla_v4_reference(kv_rows)
        else:
            own = quantize_fp8_reference(kv_rows) if engine.fp8 else kv_rows
        own = own.to(q.dtype)  # in-chunk rows at the pool's precision
    if ctx.mode == "decode" and engine.flashmla is not None:
        outs = [_flashmla_decode(engine, attn, layer, q, ind, ptr, ctx)]
    else:
        outs = []
        for r, s0, n, t0 in ctx.spans():
            keys, mask = _keys_of(engine, layer, ratio, ctx.mode, ind, ptr, own, topk if ratio == CSA else None,
                                  s0, n, t0, q.dtype)
            o, _ = _mv4.eager_attention_forward(attn, q[:, :, t0:t0 + n], keys, keys, mask, scaling=attn.scaling)
            outs.append(o)  # [1, n, H, D]
    if ctx.mode == "prefill":
        f.write_window(layer, kv_rows)  # the ring write: after attention

    attn_output = torch.cat(outs, dim=1)  # [1, T, H, D], as transformers' attention returns it
    attn_output = _mv4.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn_output.reshape(*input_shape, attn.config.o_groups, -1)
    grouped = attn.o_a_proj(grouped).flatten(2)
    return attn.o_b_proj(grouped), None
