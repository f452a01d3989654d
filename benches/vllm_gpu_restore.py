"""v4pool.vllm's worker-side copy path on CUDA tensors laid out exactly as vLLM 0.34 lays
DeepSeek-V4-Flash out (tests/fixtures/vllm_v4_flash_layout.json, made on CPU by vLLM's own
functions): a request of N tokens saved (every whole 256-token block and a checkpoint at N:
windows and compressor state) into v4pool's entry tier, then restored into other block ids
of a poisoned cache and compared byte for byte, at 8K / 128K / 1M tokens; the restore's GB/s
beside a pinned host-to-device copy of the same bytes in the same run.

Needs torch with CUDA and the v4pool wheel; not vLLM. Skips, saying so, without CUDA.

    python benches/vllm_gpu_restore.py [--tier-dir /dev/shm/v4pool-bench] [--tokens 8192,131072,1048576]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import v4pool
from v4pool.vllm_copy import SlabCopier, page_view

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_v4_flash_layout.json"


def plan_for(fx, tokens: int, first_block: int):
    """Block plans of a request of ``tokens`` tokens whose blocks start at ``first_block`` in
    every group: the whole hash blocks and the checkpoint at ``tokens`` (the connector's)."""
    B = fx["hash_block"]
    blocks = []
    for i in range(tokens // B):
        plan = []
        for g in fx["groups"]:
            if g["role"] == "full":
                per = B // g["block_size"]
                plan.append((g["idx"], [first_block + i * per + k for k in range(per)]))
        blocks.append(plan)
    ckpt = []
    for g in fx["groups"]:
        bs = g["block_size"]
        if g["role"] == "full":
            lo, hi = (tokens - tokens % B) // bs, -(-tokens // bs)
        elif g["role"] == "window":
            lo, hi = max(0, tokens - g["window"]) // bs, -(-tokens // bs)
        else:
            lo, hi = 0, 1
        ckpt.append((g["idx"], [first_block + b for b in range(lo, hi)]))
    return blocks, ckpt


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier-dir", default="/dev/shm/v4pool-vllm-bench")
    ap.add_argument("--tokens", default="8192,131072,1048576")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the same path on CPU tensors (checks the script, not a GPU figure)")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("SKIP vllm_gpu_restore: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    fx = json.loads(FIXTURE.read_text())
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    pin = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if pin else "CPU (smoke run, not a GPU figure)"
    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} on {name}; "
          f"layout of vLLM {fx['vllm']} ({fx['model']})")
    print("| tokens | bytes moved | save s | restore s | restore GB/s | pinned H2D GB/s | ratio | exact |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    ok_all = True
    for tokens in (int(t) for t in args.tokens.split(",")):
        B = fx["hash_block"]
        probe_blocks, probe_ckpt = plan_for(fx, tokens, 0)
        need = 1 + max(b for plan in probe_blocks + [probe_ckpt] for _, ids in plan for b in ids)
        nblocks = 2 * need + 1  # the saved request's blocks, then the restored one's
        stride = fx["tensors"][0]["block_stride"]
        buf = torch.zeros(nblocks * stride, dtype=torch.uint8, device=dev)
        views = {}
        for t in fx["tensors"]:
            assert t["block_stride"] == stride
            for l, name in enumerate(t["layers"]):
                page = next(g["page_bytes"][g["layers"].index(name)] for g in fx["groups"] if name in g["layers"])
                views[name] = page_view(buf, t["offset"] + l * t["layer_stride"], nblocks, stride, page)
        copier = SlabCopier({g["idx"]: [views[n] for n in g["layers"]] for g in fx["groups"]})
        src_blocks, src_ckpt = plan_for(fx, tokens, 1)
        dst_blocks, dst_ckpt = plan_for(fx, tokens, 1 + need)
        # The "model" writes every page of the saved request with random bytes; the
        # restored request's pages are poisoned.
        gen = torch.Generator(device=dev).manual_seed(tokens)
        buf[stride: (1 + need) * stride].copy_(torch.randint(0, 256, (need * stride,), dtype=torch.uint8, device=dev, generator=gen))
        buf[(1 + need) * stride:].fill_(0xA5)
        shutil.rmtree(args.tier_dir, ignore_errors=True)
        tier = v4pool.EntryTier(args.tier_dir, fx["layout_id"], 1 << 40)
        ns = v4pool.namespace_of(fx["layout_id"])
        keys = [v4pool.tail_hash(ns, [i]) for i in range(len(src_blocks))]
        t0 = time.perf_counter()
        for k, plan in zip(keys, src_blocks):
            tier.put("b", k, [copier.gather(plan).clone()])
        tier.put("c", 1, [copier.gather(src_ckpt).clone()])
        sync(dev)
        t_save = time.perf_counter() - t0
        moved = 0
        t0 = time.perf_counter()
        for k, plan in zip(keys, dst_blocks):
            staging = torch.empty(copier.body_len(plan), dtype=torch.uint8, pin_memory=pin)
            assert tier.get_into("b", k, staging)
            copier.scatter(plan, staging)
            moved += staging.numel()
        staging = torch.empty(copier.body_len(dst_ckpt), dtype=torch.uint8, pin_memory=pin)
        assert tier.get_into("c", 1, staging)
        copier.scatter(dst_ckpt, staging)
        moved += staging.numel()
        sync(dev)
        t_load = time.perf_counter() - t0
        # The same bytes by one pinned host-to-device copy.
        host = torch.empty(moved, dtype=torch.uint8, pin_memory=pin)
        dcopy = torch.empty(moved, dtype=torch.uint8, device=dev)
        sync(dev)
        t0 = time.perf_counter()
        dcopy.copy_(host, non_blocking=True)
        sync(dev)
        t_h2d = time.perf_counter() - t0
        exact = True
        for sp, dp in zip(src_blocks + [src_ckpt], dst_blocks + [dst_ckpt]):
            for (g, sids), (_, dids) in zip(sp, dp):
                if not sids:
                    continue
                for v in copier.layers[g]:
                    s_idx = torch.tensor(sids, dtype=torch.long, device=dev)
                    d_idx = torch.tensor(dids, dtype=torch.long, device=dev)
                    exact &= torch.equal(v.index_select(0, s_idx), v.index_select(0, d_idx))
        ok_all &= exact
        gbs, h2d = moved / t_load / 1e9, moved / t_h2d / 1e9
        print(f"| {tokens} | {moved} | {t_save:.3f} | {t_load:.3f} | {gbs:.2f} | {h2d:.2f} | "
              f"{gbs / h2d:.2f} | {'yes' if exact else 'NO'} |")
        del buf, views, copier, host, dcopy
        if pin:
            torch.cuda.empty_cache()
        shutil.rmtree(args.tier_dir, ignore_errors=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
