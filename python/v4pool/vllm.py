"""v4pool inside vLLM: an out-of-tree KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``)
that restores DeepSeek-V4 / V4.1 prefixes exactly -- compressed history, indexer keys,
windows, compressor state and the V4.1 ring -- from v4pool's entry tiers (a host tier on
tmpfs every process of the machine shares, and a shared tier on a fleet mount).

Load it with::

    --kv-transfer-config '{"kv_connector": "V4PoolConnector",
                           "kv_connector_module_path": "v4pool.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"host_dir": "/dev/shm/v4pool",
                               "host_bytes": "64GiB", "shared_dir": "/mnt/kv", "shared_bytes": "2TiB"}}'

What it is, in vLLM's terms (``docs/vllm.md`` has the long form):

* The scheduler side looks prefixes up with v4pool's chained block hashes
  (``v4pool.chain_block_hashes``) in a namespace made of the model and the whole vLLM layout
  (every group's spec and every layer's page), over blocks of the scheduler's block size.
  A hit ends where a stored *checkpoint* ends -- any token, not only block multiples: a
  checkpoint is the request's window rows, compressor state / ring and the partial blocks of
  the compressed groups at one position, saved where a prefill or a request ended.
* ``get_loaded_kv_cache_group_ids`` answers every group, so vLLM takes the hit as it is:
  nothing replayed (V4.1's ``replay_start`` stays 0), no cut to whole blocks. (V4.1's
  ``replay_fallback``: where no checkpoint ends a run of stored blocks, the blocks alone,
  vLLM replaying the window after them as after a hit in its own cache.)
* The worker side places each layer's pages in vLLM's backing allocation (the
  ``KVCacheTensor``'s offset and strides, the page size from the group's spec; torch's own
  storage description) and moves them with ``v4pool.vllm_copy``: saves gather the pages
  named by the scheduler's plan into a page-locked host ring in the worker's process and
  publish them whole and checksummed to the file tiers (``v4pool.EntryTier``), where the
  scheduler finds them; loads copy an entry the ring holds straight into the blocks the
  scheduler allocated for the hit (host-to-device copies of whole slab runs, no file read),
  and read any other from the files into the ring first, only an entry that is whole, of
  this layout and of the planned length.
* Saves are asynchronous (``async_save``, default on): ``wait_for_save`` queues the
  device-to-host copies and hands the publish to one background thread; a finished request
  whose saves were planned is held (``request_finished_all_groups`` answers True) until the
  worker reports its copies done (``get_finished``), so no page is read after vLLM freed it.

The one place that names the vLLM release this is written against: ``VLLM_VERSION``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import TYPE_CHECKING, Any, Iterable

import torch

import v4pool
from v4pool.vllm_copy import (
    NULL_BLOCK,
    EntryMover,
    HostRing,
    Publisher,
    SlabCopier,
    page_view,
    storage_bytes,
)

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: The vLLM release this connector is written and tested against (CI pins it in
#: ci/vllm-requirements.txt; the interface is experimental and moves between releases).
VLLM_VERSION = "0.34.0"

#: How long ``shutdown`` waits for the saves still being published (seconds).
CLOSE_TIMEOUT_S = 30.0

#: Model types the connector understands (hf_config.model_type).
MODEL_TYPES = ("deepseek_v4", "deepseek_v41")

logger = init_logger(__name__)

# Entry kinds in the tiers (BLOCK, CHECKPOINT, INDEX, FAILED), the byte-size parser and the tiers
# themselves live in v4pool.vllm_tiers; re-exported here, where callers and tests name them.
from v4pool.vllm_tiers import (  # noqa: E402
    BLOCK,
    CHECKPOINT,
    FAILED,
    INDEX,
    IndexOnlyTiers,
    Tiers,
    _bytes,
    evict_first_of,
)


class UnsupportedLayout(ValueError):
    """A model or KV layout the connector does not understand (raised at construction)."""


# --------------------------------------------------------------------------- the layout


@dataclasses.dataclass(frozen=True)
class Group:
    """One KV cache group as the connector moves it."""

    idx: int
    # "full" (prefix blocks), "window" (checkpointed window), "state" (a compressor's
    # state rows, checkpointed as far back as its open group reaches), "ring" (one block)
    role: str
    block_size: int  # tokens per block of this group
    window: int  # sliding window in tokens (window groups)
    layers: tuple[str, ...]
    page_bytes: tuple[int, ...]  # per layer
    spec_kind: str
    spec_window: int | None
    # vLLM's prefix cache keeps (and lends) this group's blocks; V4.1's bounded-replay
    # windows and its ring it does not.
    cacheable: bool = True
    ratio: int = 0  # state groups: the compress ratio of their layers
    replay: int = 0  # tokens vLLM replays after a hit that does not restore this group


def _layer_specs(spec) -> list:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec]


def _classify(idx: int, spec) -> tuple[str, int]:
    """The role of a group's spec, or UnsupportedLayout naming the group and the spec."""
    inner = _layer_specs(spec)
    kinds = set()
    window = 0
    for s in inner:
        if isinstance(s, CircularBufferSpec):
            kinds.add("ring")
        elif isinstance(s, SlidingWindowMLASpec):
            kinds.add("window")
            window = max(window, s.sliding_window)
        elif isinstance(s, (MLAAttentionSpec, FullAttentionSpec)) and type(s).__name__ in (
            "MLAAttentionSpec",
            "FullAttentionSpec",
        ):
            kinds.add("full")
        else:
            raise UnsupportedLayout(
                f"v4pool.vllm: KV cache group {idx} has spec {type(s).__name__} ({s!r}), which "
                "the connector does not restore (DeepSeek-V4 groups are MLAAttentionSpec, "
                "SlidingWindowMLASpec and CircularBufferSpec)"
            )
    if len(kinds) != 1:
        raise UnsupportedLayout(
            f"v4pool.vllm: KV cache group {idx} mixes spec kinds {sorted(kinds)} ({spec!r})"
        )
    return kinds.pop(), window


def _state_ratio(idx: int, role: str, window: int, layers, hf) -> int:
    """The compress ratio of a group of DeepSeek-V4 compressor states (vLLM's
    ``CompressorStateCache``: layers ``model.layers.<i>....compressor.state_cache``, a
    sliding window of ``(2 if ratio 4 else 1) * ratio`` fp32 rows), from the model's
    ``compress_ratios``; 0 for any other group."""
    if role != "window" or not all(n.endswith("compressor.state_cache") for n in layers):
        return 0
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios

    table = get_compress_ratios(hf)
    ratios = set()
    for n in layers:
        m = re.search(r"\.layers\.(\d+)\.", n)
        if m is None or int(m.group(1)) >= len(table):
            raise UnsupportedLayout(f"v4pool.vllm: group {idx}: no compress ratio for layer {n}")
        ratios.add(int(table[int(m.group(1))]))
    r = ratios.pop() if len(ratios) == 1 else 0
    if r <= 1 or window % r or window // r not in (1, 2):
        raise UnsupportedLayout(
            f"v4pool.vllm: group {idx} holds compressor states of ratios "
            f"{sorted(ratios | {r})} with a window of {window} tokens")
    return r


def _slab_of(kv_cache_config: "KVCacheConfig") -> str:
    """Where every layer's page lies in vLLM's per-block slab (each KVCacheTensor's offset,
    layer stride, block stride and layers), digested: an entry's body holds a block's pages in
    slab order (``v4pool.vllm_copy``), so entries of two placements must never mix."""
    text = ";".join(f"{t.offset}+{t.layer_stride}/{t.block_stride}:" + ",".join(t.layers)
                    for t in kv_cache_config.kv_cache_tensors)
    return "slab:" + hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class Layout:
    model: str
    groups: tuple[Group, ...]
    block: int  # the hash block: the scheduler's block (LCM of the groups' block sizes)
    layout_id: str
    replay: int = 0  # V4.1: the window vLLM's bounded replay recomputes after a hit

    @staticmethod
    def of(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> "Layout":
        hf = vllm_config.model_config.hf_config
        model_type = getattr(hf, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise UnsupportedLayout(
                f"v4pool.vllm: model type {model_type!r} is not one the connector restores "
                f"({', '.join(MODEL_TYPES)})"
            )
        groups = []
        for idx, g in enumerate(kv_cache_config.kv_cache_groups):
            role, window = _classify(idx, g.kv_cache_spec)
            ratio = _state_ratio(idx, role, window, g.layer_names, hf)
            role = "state" if ratio else role
            spec = g.kv_cache_spec
            per_layer = (
                spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else None
            )
            pages = tuple(
                (per_layer[n] if per_layer else spec).page_size_bytes for n in g.layer_names
            )
            kind = get_kv_cache_spec_kind(spec).value
            groups.append(
                Group(
                    idx=idx,
                    role=role,
                    block_size=spec.block_size,
                    window=window,
                    layers=tuple(g.layer_names),
                    page_bytes=pages,
                    spec_kind=kind,
                    spec_window=window or None,
                    cacheable=spec.prefix_cacheable,
                    ratio=ratio,
                    replay=spec.prefix_replay_tokens,
                )
            )
        block = 1
        for g in groups:
            if g.role != "ring":
                block = math.lcm(block, g.block_size)
        for g in groups:
            if g.role != "ring" and block % g.block_size:
                raise UnsupportedLayout(f"v4pool.vllm: group {g.idx} block {g.block_size}")
        name = getattr(vllm_config.model_config, "served_model_name", None) or getattr(
            vllm_config.model_config, "model", "?"
        )
        # The scheduler's KVCacheConfig holds one representative spec per group
        # (generate_scheduler_kv_cache_config), the workers' the per-layer specs: the id is
        # made of what both see. Per-layer pages differing under one id still cannot mix:
        # an entry of another length is a miss.
        desc = ";".join(
            f"{g.idx}:{g.role}:{g.spec_kind}:bs{g.block_size}:w{g.window}:"
            f"p{_layer_specs(kv_cache_config.kv_cache_groups[g.idx].kv_cache_spec)[0].page_size_bytes}:"
            + ",".join(g.layers)
            for g in groups
        )
        layout_id = f"vllm-{VLLM_VERSION}|{model_type}|block{block}|{desc}|{_slab_of(kv_cache_config)}"
        return Layout(model=f"{model_type}:{name}", groups=tuple(groups), block=block,
                      layout_id=layout_id, replay=max(g.replay for g in groups))

    def bytes_of(self, blocks: "list[tuple[int, list[int]]]", skip_null: bool = False) -> int:
        """The body bytes of an entry that holds ``blocks`` (per group, the block ids in body
        order; ``skip_null``: only the pages a load writes, NULL_BLOCK left out)."""
        return sum(sum(1 for b in ids if b != NULL_BLOCK or not skip_null) * sum(self.groups[g].page_bytes)
                   for g, ids in blocks)

    def block_span(self, g: Group, start: int, end: int) -> range:
        """Group-block indices holding tokens [start, end)."""
        return range(start // g.block_size, -(-end // g.block_size))

    def checkpoint_span(self, g: Group, pos: int) -> range:
        """Group-block indices a checkpoint at ``pos`` holds for group ``g``.

        The V4.1 ring (``CircularBufferSpec``: the compressor's open group, ratio 1 or 2) is
        held only where ``pos`` is not a multiple of the block: at a multiple (even) no
        group is open, so no later token reads the ring's rows (vLLM's
        ``CompressorMetadataBuilder``: "ordinary decode only needs the latest open row to
        complete the next ratio-2 pair"), and a checkpoint there may be taken inside a
        prefill chunk, where the ring holds the chunk's end instead."""
        if g.role == "full":
            return self.block_span(g, pos - pos % self.block, pos)
        if g.role == "window":
            return self.block_span(g, max(0, pos - g.window), pos)
        if g.role == "state":
            # The rows later tokens read: the open group's and, for the overlapping ratio-4
            # compressor (window 2 x ratio), the group before it. A closed group's rows
            # are in the compressed entry already (v4pool's own checkpoints leave the HCA
            # state out for this reason: pool-runtime.md section 6).
            reach = pos - pos % g.ratio - (g.window // g.ratio - 1) * g.ratio
            return self.block_span(g, max(0, reach), pos)
        return range(0, 1) if pos % self.block else range(0)


# ------------------------------------------------------------------------ the tiers (v4pool.vllm_tiers)

_BENCH_SHARED: dict[str, dict] = {}


def worker_layer_pages(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> dict[str, int]:
    """Every layer's page bytes as a worker sees them (its KVCacheConfig holds per-layer
    specs; the scheduler's only one representative per group): the ``bench_layer_pages`` an
    index-only tier needs to charge entries what a worker writes."""
    return {n: p for g in Layout.of(vllm_config, kv_cache_config).groups
            for n, p in zip(g.layers, g.page_bytes)}


# ------------------------------------------------------------------- the metadata


@dataclasses.dataclass
class Transfer:
    """One entry moved between the tiers and vLLM's blocks: for each group, the block ids
    in body order (NULL_BLOCK: a page the body holds that this load does not write)."""

    kind: str
    key: int
    blocks: list[tuple[int, list[int]]]
    req_id: str
    pos: int = 0  # checkpoint position / block end (for events)
    block_index: int = -1  # full blocks: the block's index in the request
    index_key: int = 0  # checkpoints: the index entry listing the tails after its block


@dataclasses.dataclass
class V4PoolMetadata(KVConnectorMetadata):
    loads: list[Transfer] = dataclasses.field(default_factory=list)
    saves: list[Transfer] = dataclasses.field(default_factory=list)
    # Finished requests whose blocks vLLM holds for the connector (request_finished_all_groups
    # answered True): reported by get_finished once their saves have left the blocks.
    finishing: list[str] = dataclasses.field(default_factory=list)
    # Entries whose last use is set after the saves, in this order (the last the newest).
    refresh: list[tuple[str, int]] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------- the connector


@dataclasses.dataclass
class _Hit:
    length: int
    full_blocks: int  # whole hash blocks loaded from 'b' entries
    ckpt_key: int
    local: int  # tokens vLLM's own prefix cache already holds
    exact: bool = True  # a checkpoint ends it (False: whole blocks, vLLM replays the window)


class V4PoolConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docs."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise UnsupportedLayout("v4pool.vllm needs the KVCacheConfig (vLLM >= 0.34)")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.layout = Layout.of(vllm_config, kv_cache_config)
        self.ns = v4pool.namespace_of(self.layout.model + "|" + self.layout.layout_id)
        self.index_only = extra.get("bench_index_only")
        if self.index_only is not None:
            # The scheduler's KVCacheConfig holds one representative spec per group
            # (generate_scheduler_kv_cache_config): its page for every layer. An index-only
            # tier charges entries what the worker would write, so the bench passes the
            # workers' per-layer pages (V4.1's compressed group: 460,224 B a block, not the
            # representative's 599,040).
            pages = extra.get("bench_layer_pages")
            if pages:
                self.layout = dataclasses.replace(self.layout, groups=tuple(
                    dataclasses.replace(g, page_bytes=tuple(int(pages[n]) for n in g.layers))
                    for g in self.layout.groups))
            # A name shares one index-only tier between the schedulers of one process.
            shared = (_BENCH_SHARED.setdefault(self.index_only, {})
                      if isinstance(self.index_only, str) else None)
            self.tiers = IndexOnlyTiers(_bytes(extra.get("host_bytes", 8 << 30)), shared,
                                        evict_first_of(self.layout, extra))
        else:
            self.tiers = Tiers(self.layout, extra)
        self.checkpoint_every_step = bool(extra.get("checkpoint_every_step", False))
        # Saves published by a background thread, wait_for_save only queuing the copies
        # (default on); off: wait_for_save returns once the files took every save.
        self.async_save = bool(extra.get("async_save", True))
        # A checkpoint where the request ends (prompt and output), for a next turn that
        # carries the output (default on).
        self.checkpoint_at_finish = bool(extra.get("checkpoint_at_finish", True))
        # V4.1: where no checkpoint ends a run of stored whole blocks, offer the blocks and
        # let vLLM replay the window after them, if that serves more tokens (default on).
        self.replay_fallback = bool(extra.get("replay_fallback", True))
        # Checkpoints inside a prefill chunk (multiples of the hash block): every
        # checkpoint_every tokens, and the prompt's last multiple of branch_every tokens,
        # where a later prompt that shares this one's whole blocks of branch_every tokens
        # diverges (v4pool's own manager checkpoints the prompt's last block boundary for
        # the same reason; 0: none). The window and state rows of every position of a
        # chunk are in vLLM's blocks until the next step frees those out of the window, and
        # V4.1's ring needs none there (Layout.checkpoint_span).
        for opt in ("checkpoint_every", "branch_every"):
            every = int(extra.get(opt, 0))
            if every < 0 or every % self.layout.block:
                raise UnsupportedLayout(
                    f"v4pool.vllm: {opt} {every} is not a multiple of the block {self.layout.block}")
            setattr(self, opt, every)
        # Scheduler state.
        self._requests: dict[str, "Request"] = {}
        self._hits: dict[str, _Hit] = {}
        self._block_hits: set[str] = set()  # requests whose hit ends without a checkpoint
        self._pending_loads: list[Transfer] = []
        self._pending_saves: list[Transfer] = []
        self._finishing: list[str] = []
        self._saved_pos: dict[str, int] = {}
        # async_save: requests with saves planned before they finished (held when they do);
        # finished requests whose blocks vLLM holds for us until a worker reports them.
        self._saving: set[str] = set()
        self._held: set[str] = set()
        # The checkpoints each request saved or hit (position, key), for _path_of.
        self._req_ckpts: dict[str, list[tuple[int, int]]] = {}
        self._pending_refresh: list[tuple[str, int]] = []
        self._events: list[BlockStored] = []
        self.stats = {"lookups": 0, "hit_tokens": 0, "hits": 0, "saved_entries": 0}
        # Worker state.
        self._pages: dict[str, torch.Tensor] = {}
        self._mover: "EntryMover | None" = None
        self._load_event = None  # after this step's loads (CUDA), for wait_for_layer_load
        self._load_errors: set[int] = set()
        # Finished requests vLLM holds for us, not yet reported; and each step's copies still
        # in flight (their event, the requests they read).
        self._finished_saving: set[str] = set()
        self._inflight: list[tuple[Any, set[str]]] = []

    # ---------------------------------------------------------------- scheduler side

    def _hashes(self, tokens: list[int]) -> list[int]:
        return v4pool.chain_block_hashes(self.ns, list(tokens), self.layout.block)

    def _tail_key(self, tokens: list[int], j: int, t: int, hashes: list[int]) -> int:
        B = self.layout.block
        parent = hashes[j - 1] if j > 0 else None
        return v4pool.tail_hash(self.ns, list(tokens[j * B : j * B + t]), parent)

    def _index_key(self, j: int, hashes: list[int]) -> int:
        return v4pool.tail_hash(self.ns, [], hashes[j - 1] if j > 0 else None)

    def lookup(self, tokens: list[int], limit: int, held: int = 0) -> tuple[int, int, int, int]:
        """The longest stored hit of ``tokens`` no longer than ``limit``, the first
        ``held`` whole blocks being in vLLM's own prefix cache: (length, whole blocks,
        checkpoint key, the run of whole blocks held or stored); length 0 when none."""
        B = self.layout.block
        hashes = self._hashes(tokens[: limit - limit % B] if limit >= B else [])
        k = min(held, len(hashes))
        while k < len(hashes) and self.tiers.where(BLOCK, hashes[k]):
            k += 1
        for j in range(k, -1, -1):
            tails = [t for t in self.tiers.read_index(self._index_key(j, hashes))
                     if 0 <= t < B and j * B + t <= limit and j * B + t > 0]
            for t in sorted(tails, reverse=True):
                key = self._tail_key(tokens, j, t, hashes)
                if self.tiers.where(CHECKPOINT, key):
                    return j * B + t, j, key, k
        return 0, 0, 0, k

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        self._requests[request.request_id] = request
        self.stats["lookups"] += 1
        tokens = list(request.prompt_token_ids or [])
        # vLLM computes at least the last prompt token itself.
        limit = len(tokens) - 1
        B = self.layout.block
        length, full, key, run = self.lookup(tokens, limit, num_computed_tokens // B)
        exact = True
        if self.replay_fallback and self.layout.replay and run * B - self.layout.replay > length:
            # No checkpoint near the end of the run of whole blocks: take the blocks and let
            # vLLM replay the window after them (V4.1's bounded replay), as it would after
            # a hit in its own prefix cache, when that serves more tokens.
            length, full, key, exact = run * B, run, 0, False
        self._block_hits.discard(request.request_id)
        if length <= num_computed_tokens:
            return 0, False
        self._hits[request.request_id] = _Hit(length, full, key, num_computed_tokens, exact)
        if not exact:
            self._block_hits.add(request.request_id)
        return length - num_computed_tokens, False

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        if request.request_id in self._block_hits:
            # Whole blocks only: vLLM replays the window and rebuilds the ring.
            return tuple(g.idx for g in self.layout.groups if g.role == "full")
        # Every group is restored: compressed, indexer, windows, state, ring.
        return tuple(g.idx for g in self.layout.groups)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        ids = blocks.get_block_ids()
        if hit.length != hit.local + num_external_tokens:
            # The scheduler took fewer tokens than offered (a cap of its own): no checkpoint
            # ends there, so nothing is loaded and the blocks it allocated for them are
            # reported as load errors, which vLLM recomputes.
            end = hit.local + num_external_tokens
            self._pending_loads.append(Transfer(FAILED, 0, [
                (g.idx, [ids[g.idx][b] for b in (range(1) if g.role == "ring" else
                                                 self.layout.block_span(g, hit.local, end))
                         if b < len(ids[g.idx]) and ids[g.idx][b] != NULL_BLOCK])
                for g in self.layout.groups], request.request_id))
            return
        B = self.layout.block
        tokens = list(request.prompt_token_ids or [])
        hashes = self._hashes(tokens[: hit.full_blocks * B])
        rid = request.request_id
        first = hit.local // B  # whole blocks vLLM's own cache already holds
        loads = []
        for i in range(first, hit.full_blocks):
            plan = []
            for g in self.layout.groups:
                if g.role == "full":
                    plan.append((g.idx, [ids[g.idx][b] for b in self.layout.block_span(g, i * B, (i + 1) * B)]))
            loads.append(Transfer(BLOCK, hashes[i], plan, rid, (i + 1) * B, i))
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += num_external_tokens
        if not hit.exact:
            self.stats["replayed_hits"] = self.stats.get("replayed_hits", 0) + 1
            self._add_loads(loads)
            return
        plan = []
        for g in self.layout.groups:
            span = self.layout.checkpoint_span(g, hit.length)
            own = ids[g.idx]
            out = []
            for b in span:
                bid = own[b] if b < len(own) else NULL_BLOCK
                # Never write a block vLLM's prefix cache lent this request (a group it
                # does not cache has blocks of the request's own there: those are written).
                if g.cacheable and b * g.block_size < hit.local:
                    bid = NULL_BLOCK
                out.append(bid)
            plan.append((g.idx, out))
        self._req_ckpts.setdefault(rid, []).append((hit.length, hit.ckpt_key))
        self._add_loads(loads + [Transfer(CHECKPOINT, hit.ckpt_key, plan, rid, hit.length)])

    def _add_loads(self, loads: list[Transfer]) -> None:
        self._pending_loads.extend(loads)
        if self.index_only is not None:
            for tr in loads:  # what the worker's reads would do to the tier's clock
                self.tiers.touch(tr.kind, tr.key)

    def _plan_saves(self, request: "Request", pos: int, block_ids,
                    ckpts: "list[int] | None" = None) -> list[Transfer]:
        """Saves of the request's state at ``pos`` computed tokens: the whole blocks not yet
        stored and checkpoints (with their index entries) at ``ckpts`` (default ``[pos]``);
        each checkpoint position must be one whose window and state rows are still in the
        blocks: within the step that computed it."""
        B = self.layout.block
        rid = request.request_id
        tokens = list(request.all_token_ids[:pos])
        hashes = self._hashes(tokens)
        out = []
        for i, h in enumerate(hashes):
            if self.tiers.where(BLOCK, h):
                continue
            plan = []
            for g in self.layout.groups:
                if g.role == "full":
                    plan.append((g.idx, [block_ids[g.idx][b] for b in self.layout.block_span(g, i * B, (i + 1) * B)]))
            if any(b == NULL_BLOCK for _, bs in plan for b in bs):
                break
            out.append(Transfer(BLOCK, h, plan, rid, (i + 1) * B, i))
        for q in (ckpts if ckpts is not None else [pos]):
            j, t = divmod(q, B)
            key = self._tail_key(tokens, j, t, hashes)
            self._req_ckpts.setdefault(rid, []).append((q, key))
            if self.tiers.where(CHECKPOINT, key):
                continue
            plan = []
            for g in self.layout.groups:
                own = block_ids[g.idx]
                bs = [own[b] if b < len(own) else NULL_BLOCK for b in self.layout.checkpoint_span(g, q)]
                plan.append((g.idx, bs))
            # A checkpoint lacking a page (freed, never allocated) is not saved.
            if not any(b == NULL_BLOCK for _, bs in plan for b in bs):
                out.append(Transfer(CHECKPOINT, key, plan, rid, q, index_key=self._index_key(j, hashes)))
        return out

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = V4PoolMetadata(loads=self._pending_loads, saves=self._pending_saves,
                              finishing=self._finishing)
        self._pending_loads, self._pending_saves, self._finishing = [], [], []
        n_finish = len(meta.saves)  # noted when request_finished_all_groups planned them
        mgr = self._kv_cache_manager
        # Where each request's chunk of this step starts, as the scheduler sent it to the
        # workers (vLLM 0.34 builds this metadata before it advances num_computed_tokens).
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(rid)
            if req is None or mgr is None or rid not in starts:
                continue
            start = starts[rid]
            pos = start + n  # the state the workers' forward leaves in the blocks
            if pos > req.num_prompt_tokens or pos <= self._saved_pos.get(rid, 0):
                continue
            # Checkpoints where this step's rows still hold the state: every
            # checkpoint_every tokens inside the chunk, the chunk's end on request, the
            # prompt's end always.
            ck = []
            if self.checkpoint_every:
                e = self.checkpoint_every
                ck = list(range((start // e + 1) * e, pos + 1, e))
            if self.branch_every:
                q = req.num_prompt_tokens - req.num_prompt_tokens % self.branch_every
                if start < q <= pos and q not in ck:
                    ck.append(q)
            if (pos == req.num_prompt_tokens or self.checkpoint_every_step) and pos not in ck:
                ck.append(pos)
            if not ck:
                continue
            self._saved_pos[rid] = pos
            meta.saves.extend(self._plan_saves(req, pos, mgr.get_block_ids(rid), ck))
        self._note_saves(meta.saves[n_finish:])
        if self.async_save and self.index_only is None:
            self._saving.update(tr.req_id for tr in meta.saves[n_finish:])
        meta.refresh, self._pending_refresh = self._pending_refresh, []
        return meta

    def _path_of(self, req: "Request") -> list[tuple[str, int]]:
        """The entries of ``req``'s path (the whole blocks of what it computed and the
        checkpoints it saved or hit; the tier skips those it does not hold), deepest first, a
        checkpoint before the block it ends. Refreshed in this order when the request
        finishes, a request's head becomes its most recent entry and its tail the first to
        go: vLLM's offload LRU ranks a request's blocks the same way (its ``LRUCachePolicy``:
        every block the request touched, held in HBM or not, tails before heads, at
        ``on_request_finished``)."""
        B = self.layout.block
        n = req.num_computed_tokens
        hashes = self._hashes(list(req.all_token_ids[: n - n % B]))
        ents = [((i + 1) * B, 0, BLOCK, h) for i, h in enumerate(hashes)]
        ents += [(q, 1, CHECKPOINT, k) for q, k in self._req_ckpts.pop(req.request_id, ())]
        ents.sort(reverse=True)
        return [(kind, key) for _, _, kind, key in ents]

    def _note_saves(self, saves: list[Transfer]) -> None:
        B = self.layout.block
        if self.index_only is not None:
            for s in saves:
                n = self.layout.bytes_of(s.blocks)
                self.tiers.add(s.kind, s.key, n)
                if s.kind == CHECKPOINT:
                    self.tiers.add_index(s.index_key, s.pos % B)
            self.stats["saved_entries"] += len(saves)
            self.stats["saved_bytes"] = self.stats.get("saved_bytes", 0) + sum(
                self.layout.bytes_of(s.blocks) for s in saves)
            return
        for s in saves:
            self.stats["saved_entries"] += 1
            if s.kind != BLOCK:
                continue
            req = self._requests.get(s.req_id)
            toks = list(req.all_token_ids[s.block_index * B:(s.block_index + 1) * B]) if req else []
            for g in self.layout.groups:
                if g.role != "full":
                    continue
                self._events.append(BlockStored(
                    # 16 bytes: a 128-bit int does not fit the events' msgpack wire.
                    block_hashes=[s.key.to_bytes(16, "little")], parent_block_hash=None, token_ids=toks,
                    block_size=B, lora_id=None, medium=self.tiers.tiers[0][0] if self.tiers.tiers else None,
                    lora_name=None, group_idx=g.idx, kv_cache_spec_kind=g.spec_kind,
                    kv_cache_spec_sliding_window=g.spec_window,
                ))

    def request_finished(self, request: "Request", block_ids: list[int]):
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        rid = request.request_id
        self._requests.pop(rid, None)
        pos = request.num_computed_tokens
        saved = self._saved_pos.pop(rid, 0)
        if self.tiers.tiers:
            path = self._path_of(request)
            if self.index_only is not None:
                self.tiers.refresh(path)
            else:  # after this request's last saves, on the worker (wait_for_save)
                self._pending_refresh.extend(path)
        self._req_ckpts.pop(rid, None)
        self._hits.pop(rid, None)
        self._block_hits.discard(rid)
        # Saves planned in earlier steps may still be reading the blocks (async_save).
        held = rid in self._saving
        self._saving.discard(rid)
        saves = []
        if pos > 0 and pos > saved and self.tiers.tiers and self.checkpoint_at_finish:
            saves = self._plan_saves(request, pos, block_ids)
            self._note_saves(saves)
        if self.index_only is not None or not (saves or held):
            return False, None
        self._pending_saves.extend(saves)
        self._finishing.append(rid)
        self._held.add(rid)
        # The blocks stay until the worker reports the saves done (get_finished).
        return True, None

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_sending or ():
            self._held.discard(rid)

    def has_pending_block_frees(self) -> bool:
        """Whether finished requests' blocks are held for their saves: freed within a step or
        two (their copies are short), so vLLM waits for them rather than preempt a request
        (and recompute it) when it runs out of blocks."""
        return bool(self._held)

    def take_events(self) -> Iterable[BlockStored]:
        ev, self._events = self._events, []
        return ev

    # ------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Place every layer's pages in vLLM's backing allocation: the placement (offset,
        layer stride, block stride) from the KVCacheConfig's KVCacheTensor, the page from the
        group's spec; the layer's own tensor must start exactly there, and every layer must
        lie in one allocation (a layout that disagrees is refused, nothing is guessed). Then
        the copy path: the slab's runs, the host ring (``pinned_bytes`` of the extra config,
        default 4 GiB, page-locked on CUDA, allocated at the first save or load; 0: none) in
        front of the file tiers."""
        cfg = self._kv_cache_config
        page_of = {n: p for g in self.layout.groups for n, p in zip(g.layers, g.page_bytes)}
        group_of = {n: g.idx for g in self.layout.groups for n in g.layers}
        placed: dict[int, list[tuple[int, int, int]]] = {g.idx: [] for g in self.layout.groups}
        raw = None
        num_blocks = None
        for kt in cfg.kv_cache_tensors:
            nblocks = cfg.num_blocks_of(kt) if hasattr(cfg, "num_blocks_of") else cfg.num_blocks
            for l, name in enumerate(kt.layers):
                if name not in page_of:
                    continue
                t = kv_caches.get(name)
                if t is None:
                    raise UnsupportedLayout(f"v4pool.vllm: no KV tensor for layer {name}")
                page = page_of[name]
                start = kt.offset + l * kt.layer_stride
                storage = t.untyped_storage()
                if t.data_ptr() != storage.data_ptr() + start:
                    raise UnsupportedLayout(
                        f"v4pool.vllm: layer {name} (group {group_of[name]}): tensor at +"
                        f"{t.data_ptr() - storage.data_ptr()} B, the KVCacheTensor places it at "
                        f"+{start} B (block stride {kt.block_stride}, page {page})")
                whole = storage_bytes(t)
                if raw is None:
                    raw = whole
                elif (whole.data_ptr(), whole.numel(), whole.device) != (raw.data_ptr(), raw.numel(), raw.device):
                    raise UnsupportedLayout(
                        f"v4pool.vllm: layer {name} is not in the backing allocation of the others")
                self._pages[name] = page_view(t, start, nblocks, kt.block_stride, page)
                placed[group_of[name]].append((start, kt.block_stride, page))
                num_blocks = nblocks if num_blocks is None else min(num_blocks, nblocks)
        missing = [n for n in page_of if n not in self._pages]
        if missing:
            raise UnsupportedLayout(f"v4pool.vllm: layers without a KVCacheTensor: {missing[:4]}")
        try:
            copier = SlabCopier(raw, placed, num_blocks)
        except ValueError as e:
            raise UnsupportedLayout(f"v4pool.vllm: {e}") from e
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        ring_bytes = _bytes(extra.get("pinned_bytes", 4 << 30))
        ring = HostRing(ring_bytes, pin=raw.device.type == "cuda") if ring_bytes > 0 else None
        self._mover = EntryMover(copier, ring, self.tiers,
                                 Publisher() if self.async_save else None)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Queue every planned load on the current stream (the forward that reads the pages
        runs after them on it); a load that finds no whole entry of the planned length is
        reported for recomputation, and nothing of it reaches vLLM's blocks."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, V4PoolMetadata)
        self._load_event = None
        if not meta.loads:
            return
        # A load the scheduler already marked failed (FAILED) names no entry: reported, not read.
        live = [tr for tr in meta.loads if tr.kind != FAILED]
        moved = iter(self._mover.load([(tr.kind, tr.key, tr.blocks) for tr in live]))
        done = [tr.kind != FAILED and next(moved) for tr in meta.loads]
        self._load_event = self._mover.copier.record()
        for tr, ok in zip(meta.loads, done):
            if not ok:
                # The scheduler counted these tokens; vLLM recomputes them.
                for _, ids in tr.blocks:
                    self._load_errors.update(b for b in ids if b != NULL_BLOCK)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # The loads were queued on the stream start_load_kv ran on; a layer on another stream
        # waits for them there (on the device, not the host).
        if self._load_event is not None:
            torch.cuda.current_stream().wait_event(self._load_event)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        """Store every planned save (pages into the host ring, then published to the file
        tiers), note the checkpoints in their index entries, then refresh finished requests'
        paths. ``async_save``: only the copies are queued here, the rest is the publisher's
        (one thread, in the order of the steps); else all of it is done on return."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, V4PoolMetadata)
        self._finished_saving.update(meta.finishing)
        saves, refresh = meta.saves, meta.refresh
        if not (saves or refresh):
            return
        moves = [(tr.kind, tr.key, tr.blocks) for tr in saves]
        if self._mover.publisher is None:
            self._published(saves, refresh, self._mover.save(moves) if saves else [])
            return
        event = self._mover.save_async(moves, lambda done: self._published(saves, refresh, done))
        if event is not None:
            self._inflight.append((event, {tr.req_id for tr in saves}))

    def _published(self, saves: list[Transfer], refresh: list[tuple[str, int]], done: list[bool]) -> None:
        for tr, ok in zip(saves, done):
            if ok and tr.kind == CHECKPOINT:
                self.tiers.add_index(tr.index_key, tr.pos % self.layout.block)
        if refresh:  # after the saves: a finished request's path, head last
            self.tiers.refresh(refresh)

    def get_finished(self, finished_req_ids: set[str]):
        """The finished requests held for us whose saves have all left vLLM's blocks (their
        device-to-host copies are done; publishing them may go on)."""
        self._inflight = [(ev, rids) for ev, rids in self._inflight if not ev.query()]
        busy = set().union(*(rids for _, rids in self._inflight))
        done = {r for r in self._finished_saving if r not in busy}
        self._finished_saving -= done
        return (done or None), None

    def wait_published(self, timeout: float | None = None) -> bool:
        """Wait until every save so far is published (or failed); False if ``timeout`` passed.
        Nothing in vLLM's step calls it: for tests, benches and shutdown."""
        return self._mover is None or self._mover.wait_published(timeout)

    def shutdown(self):
        """Publish what is queued (waiting at most ``CLOSE_TIMEOUT_S``) and free the ring."""
        if self._mover is not None and not self._mover.close(CLOSE_TIMEOUT_S):
            logger.warning("v4pool.vllm: saves still publishing after %.0f s at shutdown", CLOSE_TIMEOUT_S)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs
