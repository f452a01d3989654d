"""DeepSeek-V4 / V4.1 KV layouts as vLLM derives them, on a CPU machine, from a local
``config.json`` (no weights): vLLM's ``ModelConfig`` reads the file, vLLM's own cache layer
modules (``DeepseekV4SWACache``, ``CompressorStateCache``, ``DeepseekV4IndexerCache``) give
their specs, the compressed-history spec is built with the arguments vLLM 0.34's
``DeepseekV4MLAAttention.get_kv_cache_spec`` uses (that module builds the model's weights, so
it is not constructed here), and vLLM's planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``) groups the layers and places every page in the
per-block slab; ``allocate_kv_cache`` lays the tensors out. Shared by the tests, the bench
and the GPU fixture generator.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
MODELS = {"v4-flash": FIXTURES / "v4-flash", "v41-flash": FIXTURES / "v41-flash"}


def vllm_config(model: str, *, block_size: int = 256,
                max_batched: int = 2048, max_model_len: int = 2048,
                connector_extra: dict | None = None, enable_prefix_caching: bool = True):
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    model_config = ModelConfig(model=str(MODELS[model]), skip_tokenizer_init=True,
                               dtype="bfloat16", seed=0, max_model_len=max_model_len,
                               trust_remote_code=False)
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                                       max_model_len=max_model_len, enable_chunked_prefill=True,
                                       is_encoder_decoder=False, watermark=0.0)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                               cache_dtype="fp8_ds_mla" if model == "v4-flash" else "fp8_ds_mla",
                               enable_prefix_caching=enable_prefix_caching)
    kv = None
    if connector_extra is not None:
        kv = KVTransferConfig(kv_connector="V4PoolConnector",
                              kv_connector_module_path="v4pool.vllm", kv_role="kv_both",
                              kv_connector_extra_config=connector_extra)
    cfg = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                     cache_config=cache_config, parallel_config=ParallelConfig(),
                     kv_transfer_config=kv)
    # vLLM's CPU platform turns prefix caching and chunked prefill off for MLA models
    # (platforms/cpu.py: its CPU kernels lack them). The scheduler under test stands in for
    # the GPU engine's, which keeps both: restore what was asked.
    cfg.cache_config.enable_prefix_caching = enable_prefix_caching
    cfg.scheduler_config.enable_chunked_prefill = True
    cfg.scheduler_config.max_num_batched_tokens = max_batched
    return cfg


def layer_specs(cfg) -> dict:
    """{layer name: KVCacheSpec} of every attention layer of the model's main layers."""
    from vllm.config import set_current_vllm_config
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if getattr(cfg, "_v4pool_specs", None) is not None:
        return cfg._v4pool_specs
    hf = cfg.model_config.hf_config
    ratios = get_compress_ratios(hf)[: hf.num_hidden_layers]
    cc = cfg.cache_config
    v41 = hf.model_type == "deepseek_v41"
    specs = {}
    with set_current_vllm_config(cfg):
        if v41:
            from vllm.models.deepseek_v41 import attention as a41  # noqa: F401
        from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
        from vllm.models.deepseek_v4.compressor import CompressorStateCache
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

        for i, r in enumerate(ratios):
            p = f"model.layers.{i}.attn"
            swa = DeepseekV4SWACache(head_dim=hf.head_dim, window_size=hf.sliding_window,
                                     dtype=torch.uint8, prefix=f"{p}.swa_cache", cache_config=cc,
                                     bounded_replay=v41)
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
    object.__setattr__(cfg, "_v4pool_specs", specs)
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


def allocate(cfg, kcfg):
    """Per-layer CPU tensors over one backing allocation, by vLLM's ``allocate_kv_cache``."""
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(kcfg, torch.device("cpu"), layout)


def scheduler_blocks(cfg, kcfg) -> tuple[int, int]:
    """(scheduler block, hash block) as EngineCore resolves them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kcfg, cfg)
