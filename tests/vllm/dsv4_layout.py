"""DeepSeek-V4 / V4.1 KV layouts as vLLM derives them, on a CPU machine, from a local
``config.json`` (no weights): vLLM's ``ModelConfig`` reads the file, vLLM's own cache layer
modules (``DeepseekV4SWACache``, ``CompressorStateCache``, ``DeepseekV4IndexerCache``) give
their specs (V4.1: the ``deepseek_v41`` ones), the compressed-history spec comes from the
arguments vLLM 0.34's attention layer passes (V4: built with them; V4.1: the layer's own
``get_kv_cache_spec``; the layer builds the model's weights, so it is not constructed
here), and vLLM's planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``) groups the layers and places every page in the
per-block slab; ``allocate_kv_cache`` lays the tensors out. Shared by the tests, the bench
and the GPU fixture generator.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
MODELS = {"v4-flash": FIXTURES / "v4-flash", "v41-flash": FIXTURES / "v41-flash"}


def vllm_config(model: str, *, block_size: int = 256,
                max_batched: int = 2048, max_model_len: int = 2048, max_num_seqs: int = 16,
                connector_extra: dict | None = None, enable_prefix_caching: bool = True,
                connector: str = "V4PoolConnector"):
    """The VllmConfig of ``model`` with ``connector`` (v4pool.vllm's, or an in-tree one by
    name, e.g. "OffloadingConnector") when ``connector_extra`` is given."""
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    model_config = ModelConfig(model=str(MODELS[model]), skip_tokenizer_init=True,
                               dtype="bfloat16", seed=0, max_model_len=max_model_len,
                               trust_remote_code=False,
                               # V4.1's architecture is its vision-language one: served
                               # text-only (--language-model-only), as the prompts are.
                               language_model_only=True)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_batched,
                                       max_model_len=max_model_len, enable_chunked_prefill=True,
                                       is_encoder_decoder=False, watermark=0.0)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                               cache_dtype="fp8_ds_mla",
                               enable_prefix_caching=enable_prefix_caching)
    kv = None
    if connector_extra is not None:
        kv = KVTransferConfig(kv_connector=connector,
                              kv_connector_module_path=("v4pool.vllm"
                                                        if connector == "V4PoolConnector"
                                                        else None),
                              kv_role="kv_both", kv_connector_extra_config=connector_extra)
    cfg = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                     cache_config=cache_config, parallel_config=ParallelConfig(),
                     kv_transfer_config=kv)
    # vLLM's CPU platform turns prefix caching and chunked prefill off for MLA models
    # (platforms/cpu.py: its CPU kernels lack them). The scheduler under test stands in for
    # the GPU engine's, which keeps both: restore what was asked.
    cfg.cache_config.enable_prefix_caching = enable_prefix_caching
    # It also forces block_size=16 on MLA models it has no DeepSeek-V4 kernels for (V4.1:
    # its reference MLA decode kernel's constraint); the GPU engine keeps the block asked.
    cfg.cache_config.block_size = block_size
    cfg.scheduler_config.enable_chunked_prefill = True
    cfg.scheduler_config.max_num_batched_tokens = max_batched
    return cfg


def layer_specs(cfg) -> dict:
    """{layer name: KVCacheSpec} of every attention layer of the model's main layers."""
    if getattr(cfg, "_v4pool_specs", None) is not None:
        return cfg._v4pool_specs
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg):
        if cfg.model_config.hf_config.model_type == "deepseek_v41":
            specs = _v41_specs(cfg)
        else:
            specs = _v4_specs(cfg)
    object.__setattr__(cfg, "_v4pool_specs", specs)
    return specs


def _v4_specs(cfg) -> dict:
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    hf = cfg.model_config.hf_config
    ratios = get_compress_ratios(hf)[: hf.num_hidden_layers]
    cc = cfg.cache_config
    specs = {}
    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.attn"
        swa = DeepseekV4SWACache(head_dim=hf.head_dim, window_size=hf.sliding_window,
                                 dtype=torch.uint8, prefix=f"{p}.swa_cache", cache_config=cc)
        specs[swa.prefix] = swa.get_kv_cache_spec(cfg)
        if r <= 1:
            continue
        specs[p] = MLAAttentionSpec(
            block_size=cc.block_size, num_kv_heads=1, max_tp_shards=1,
            head_size=hf.head_dim, dtype=torch.uint8, tokens_per_state=r,
            cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
            state_content_bytes=584)
        st = CompressorStateCache(state_dim=2 * (1 + (r == 4)) * hf.head_dim,
                                  dtype=torch.float32, compress_ratio=r,
                                  prefix=f"{p}.compressor.state_cache")
        specs[st.prefix] = st.get_kv_cache_spec(cfg)
        if r == 4:
            ix = hf.index_head_dim
            kc = DeepseekV4IndexerCache(head_dim=ix + ix // 128 * 4, dtype=torch.uint8,
                                        prefix=f"{p}.indexer.k_cache", cache_config=cc,
                                        compress_ratio=4)
            specs[kc.prefix] = kc.get_kv_cache_spec(cfg)
            ist = CompressorStateCache(state_dim=2 * 2 * ix, dtype=torch.float32,
                                       compress_ratio=4,
                                       prefix=f"{p}.indexer.compressor.state_cache")
            specs[ist.prefix] = ist.get_kv_cache_spec(cfg)
    return specs


def _v41_specs(cfg) -> dict:
    """DeepSeek-V4.1 as vLLM 0.34's ``models/deepseek_v41/attention.py`` lays it out: every
    main layer's SWA cache (block 32, bounded replay as ``CacheConfig`` says); on the KV
    source layers the compressed history (the attention layer's own ``get_kv_cache_spec``,
    called on the attributes its ``__init__`` derives), the compressor ring
    (``CompressorStateCache``, a ``CircularBufferSpec``, ratio 2 only) and, where the layer
    is an index source too, the indexer keys; the other compressed layers read their
    source's caches and own none. The record widths are the ones vLLM picks on this
    platform (``_use_v41_mxfp8_kv_record``: the 584-B V4 record off SM100)."""
    from types import SimpleNamespace

    from vllm.models.deepseek_v41.attention import (DeepseekV4Attention,
                                                    DeepseekV4IndexerCache,
                                                    _indexer_k_cache_head_dim,
                                                    _resolve_dsv4_kv_cache_dtype,
                                                    _use_v41_mxfp8_kv_record)
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    hf = cfg.model_config.hf_config
    ratios = get_compress_ratios(hf)[: hf.num_hidden_layers]
    kv_sources = set(hf.kv_source_layer_ids)
    index_sources = set(hf.index_source_layer_ids)
    cc = cfg.cache_config
    kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(True, cc.cache_dtype, cc)
    mxfp8 = _use_v41_mxfp8_kv_record()
    swa_bytes = 528 if mxfp8 else 584
    compressed_bytes = 288 if kv_dtype == "nvfp4_ds_mla" else swa_bytes
    alignment = 512 if mxfp8 else 576
    specs = {}
    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.attn"
        swa = DeepseekV4SWACache(
            head_dim=hf.head_dim, window_size=hf.sliding_window, dtype=kv_torch_dtype,
            prefix=f"{p}.swa_cache", cache_config=cc, block_size=32,
            packed_bytes_per_token=swa_bytes, packed_page_alignment=alignment,
            packed_block_stride_alignment=(math.lcm(swa_bytes, compressed_bytes)
                                           if mxfp8 else None),
            bounded_replay=cc.swa_bounded_replay)
        specs[swa.prefix] = swa.get_kv_cache_spec(cfg)
        if r == 0 or i not in kv_sources:
            continue
        attn = SimpleNamespace(is_kv_source=True, kv_cache_dtype=kv_dtype,
                               kv_cache_torch_dtype=kv_torch_dtype, head_dim=hf.head_dim,
                               compress_ratio=r, kv_page_alignment=alignment,
                               compressed_bytes_per_token=compressed_bytes)
        specs[p] = DeepseekV4Attention.get_kv_cache_spec(attn, cfg)
        if r > 1:
            st = CompressorStateCache(state_dim=2 * hf.head_dim, dtype=torch.float32,
                                      prefix=f"{p}.compressor.state_cache")
            specs[st.prefix] = st.get_kv_cache_spec(cfg)
        if i in index_sources:
            kc = DeepseekV4IndexerCache(
                head_dim=_indexer_k_cache_head_dim(hf.index_head_dim, dsa_indexer_uses_fp4(cfg)),
                dtype=torch.uint8, prefix=f"{p}.indexer.k_cache", cache_config=cc,
                compress_ratio=r)
            specs[kc.prefix] = kc.get_kv_cache_spec(cfg)
    return specs


def kv_cache_config(cfg, memory_bytes: int = 1 << 30):
    """The KVCacheConfig as vLLM's engine core makes it (``EngineCore._initialize_kv_caches``):
    the layout resolved from the layers' backends, the global groups, then the per-worker
    config for ``memory_bytes`` of KV memory."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  record_kv_cache_layout,
                                                  resolve_kv_cache_layout)
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(cfg)
    specs = layer_specs(cfg)
    if cfg.cache_config.kv_cache_layout is None:
        backends = get_current_attn_backends(cfg)
        supported = [x.name for x in get_supported_kv_cache_layouts(backends)]
        layout = resolve_kv_cache_layout(cfg, [supported], list(specs.values()))
        record_kv_cache_layout(cfg.cache_config, layout.name)
    groups = get_global_kv_cache_groups(cfg, [specs])
    return get_kv_cache_configs(cfg, [specs], [memory_bytes], groups)[0]


def allocate(cfg, kcfg, allocate=None):
    """Per-layer CPU tensors over one backing allocation, by vLLM's ``allocate_kv_cache``
    (``allocate``: its hook for the backing allocation, default zeroed)."""
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(kcfg, torch.device("cpu"), layout, allocate=allocate)


def scheduler_blocks(cfg, kcfg) -> tuple[int, int]:
    """(scheduler block, hash block) as EngineCore resolves them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kcfg, cfg)
