"""The worker side's copy path of ``v4pool.vllm``, without vLLM: byte views of a KV slab and
the moves between them and v4pool's entry tiers. ``v4pool.vllm`` builds it from vLLM's
``KVCacheConfig``; ``benches/vllm_gpu_restore.py`` from a fixture of the same placements
(the GPU machine has torch and v4pool, not vLLM).

A *page view* is a ``[num_blocks, page_bytes]`` uint8 view of the backing allocation at
``offset + layer * layer_stride + block * block_stride`` (vLLM's ``KVCacheTensor``): torch's
own ``as_strided`` over the tensor's storage, so every address is one torch proves.
"""

from __future__ import annotations

import torch

# vLLM's null block (BlockPool.null_block): a page an entry holds that a load does not write.
NULL_BLOCK = 0


def page_view(storage_tensor: torch.Tensor, start: int, num_blocks: int, block_stride: int,
              page: int) -> torch.Tensor:
    """``[num_blocks, page]`` uint8 view of the storage behind ``storage_tensor``."""
    storage = storage_tensor.untyped_storage()
    if start < 0 or page <= 0 or (num_blocks > 1 and block_stride < page):
        raise ValueError(f"placement start {start}, page {page}, block stride {block_stride}")
    if start + (num_blocks - 1) * block_stride + page > storage.nbytes():
        raise ValueError("placement past the allocation")
    raw = torch.empty(0, dtype=torch.uint8, device=storage_tensor.device).set_(storage)
    return torch.as_strided(raw, (num_blocks, page), (block_stride, 1), start)


class SlabCopier:
    """Gathers pages into host staging and scatters them back.

    ``layers``: group index -> the page views of its layers, in body order. An entry's body
    is, for each ``(group, block ids)`` of the plan, each layer's pages of those blocks.
    Device pages go through a pinned host buffer (one gather, one device-to-host copy);
    host pages are gathered directly.
    """

    def __init__(self, layers: dict[int, list[torch.Tensor]]):
        self.layers = layers
        self._pinned: torch.Tensor | None = None

    def body_len(self, plan: list[tuple[int, list[int]]]) -> int:
        return sum(len(ids) * sum(v.shape[1] for v in self.layers[g]) for g, ids in plan)

    def _staging(self, n: int, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.empty(n, dtype=torch.uint8)
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return self._pinned[:n]

    def _device(self, plan) -> torch.device:
        for g, _ in plan:
            for v in self.layers[g]:
                return v.device
        return torch.device("cpu")

    def gather(self, plan: list[tuple[int, list[int]]]) -> torch.Tensor:
        """The body of ``plan``'s pages (a host tensor, valid until the next call)."""
        dev = self._device(plan)
        out = self._staging(self.body_len(plan), dev)
        if dev.type == "cuda":
            parts = []
            for g, ids in plan:
                if not ids:
                    continue
                idx = torch.tensor(ids, dtype=torch.long, device=dev)
                parts += [v.index_select(0, idx).reshape(-1) for v in self.layers[g]]
            if parts:
                out.copy_(torch.cat(parts), non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()
            return out
        off = 0
        for g, ids in plan:
            if not ids:
                continue
            idx = torch.tensor(ids, dtype=torch.long)
            for v in self.layers[g]:
                n = len(ids) * v.shape[1]
                torch.index_select(v, 0, idx, out=out[off:off + n].view(len(ids), v.shape[1]))
                off += n
        return out

    def scatter(self, plan: list[tuple[int, list[int]]], body: torch.Tensor) -> None:
        """Write ``body`` (a host tensor of ``body_len(plan)`` bytes) into the plan's blocks,
        skipping NULL_BLOCK entries."""
        dev = self._device(plan)
        src = body.to(dev, non_blocking=True) if dev.type == "cuda" else body
        off = 0
        for g, ids in plan:
            keep = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
            sel = torch.tensor(keep, dtype=torch.long, device=dev)
            dst = torch.tensor([ids[i] for i in keep], dtype=torch.long, device=dev)
            for v in self.layers[g]:
                n = len(ids) * v.shape[1]
                if keep:
                    chunk = src[off:off + n].view(len(ids), v.shape[1])
                    v.index_copy_(0, dst, chunk.index_select(0, sel))
                off += n
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
