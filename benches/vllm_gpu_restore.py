"""v4pool.vllm's worker-side restore on CUDA tensors laid out exactly as vLLM 0.34 lays
DeepSeek-V4-Flash out (tests/fixtures/vllm_v4_flash_layout.json, made on CPU by vLLM's own
functions), through the connector's own copy path (``v4pool.vllm_copy.EntryMover``: the
page-locked host ring in front of v4pool's entry-tier files).

For each prefix of N tokens (8K / 128K / 1M): one backing allocation of just the blocks the
run needs (vLLM's null block, the saved request's, the restored one's: every group's block
ids distinct, as vLLM's one block pool hands them out), the saved request's pages filled
with random bytes, the rest poisoned. The request is saved as the connector saves it (every
whole 256-token block, and a checkpoint at N: windows and compressor state) -- into the ring
and the files -- then restored into the other request's blocks:

* ``ring``: the hot path, from the ring (host-to-device copies of whole slab runs), the
  block ids vLLM would hand a fresh pool (consecutive) and shuffled;
* ``files``: a worker that did not save them (its ring empty): every entry read from its file,
  checked, into the ring, then copied.

The save is also made as ``async_save`` makes it (``EntryMover.save_async``, into a ring of its
own): ``save queued`` is what the step waits for (the device-to-host copies queued), ``save
published`` until the publisher thread has written every file; its ring must equal the
synchronous save's byte for byte.

Each restore is compared byte for byte over the whole allocation with a reference that
copies page by page (so nothing outside the planned pages may change either), and timed
beside one pinned host-to-device copy of the same number of bytes in the same run (median
of ``--reps``). Sizes run one after the other; each frees its memory before the next.

Needs torch and the v4pool wheel; not vLLM. Without CUDA it prints SKIP; ``--cpu-smoke``
runs the same path on CPU tensors (it checks the script and the bytes, not a GPU figure).

    python benches/vllm_gpu_restore.py [--tokens 8192,131072,1048576] [--tier-dir DIR] [--reps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import v4pool
from v4pool.vllm_copy import NULL_BLOCK, EntryMover, HostRing, Publisher, SlabCopier, page_view, storage_bytes

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_v4_flash_layout.json"
POISON = 0xA5


class Files:
    """One EntryTier as the mover's file tiers (a failed put is False, as v4pool.vllm.Tiers)."""

    def __init__(self, root: str, layout: str):
        self.t = v4pool.EntryTier(root, layout, 1 << 42)

    def put(self, kind, key, parts):
        try:
            self.t.put(kind, key, parts)
            return True
        except Exception as e:  # noqa: BLE001 - reported by the row
            print(f"# put failed: {e}")
            return False

    def get_into(self, kind, key, dst):
        return self.t.get_into(kind, key, dst)


def spans(fx, tokens: int):
    """What the connector saves for a prefix of ``tokens``: per whole hash block, the full
    groups' block indices; and the checkpoint's block indices per group (request-relative)."""
    B = fx["hash_block"]
    blocks = []
    for i in range(tokens // B):
        blocks.append([(g["idx"], list(range(i * B // g["block_size"], (i + 1) * B // g["block_size"])))
                       for g in fx["groups"] if g["role"] == "full"])
    ckpt = []
    for g in fx["groups"]:
        bs = g["block_size"]
        if g["role"] == "full":
            lo, hi = (tokens - tokens % B) // bs, -(-tokens // bs)
        elif g["role"] == "window":
            lo, hi = max(0, tokens - g["window"]) // bs, -(-tokens // bs)
        else:
            lo, hi = 0, 1
        ckpt.append((g["idx"], list(range(lo, hi))))
    return blocks + [ckpt]


def assign(entries, next_id: int):
    """Block ids for a request's ``entries`` (request-relative indices), each group's taken
    in order from ``next_id`` on, as vLLM's block pool hands a fresh pool's out. Returns the
    plans and the next free id."""
    ids: dict[tuple[int, int], int] = {}
    for g in sorted({g for e in entries for g, _ in e}):
        for b in sorted({b for e in entries for gg, bs in e if gg == g for b in bs}):
            ids[(g, b)] = next_id
            next_id += 1
    return [[(g, [ids[(g, b)] for b in bs]) for g, bs in e] for e in entries], next_id


def shuffled(plans, rng: random.Random):
    """``plans`` with their block ids permuted among themselves (a fragmented pool)."""
    flat = sorted({b for p in plans for _, bs in p for b in bs})
    perm = dict(zip(flat, rng.sample(flat, len(flat))))
    return [[(g, [perm[b] for b in bs]) for g, bs in p] for p in plans]


def layer_pages(fx):
    """group -> [(start, block_stride, page)] of its layers, from the KVCacheTensors."""
    page = {n: p for g in fx["groups"] for n, p in zip(g["layers"], g["page_bytes"])}
    group = {n: g["idx"] for g in fx["groups"] for n in g["layers"]}
    out: dict[int, list] = {g["idx"]: [] for g in fx["groups"]}
    for t in fx["tensors"]:
        for l, name in enumerate(t["layers"]):
            out[group[name]].append((t["offset"] + l * t["layer_stride"], t["block_stride"], page[name]))
    return out


def expected(buf, pages, nblocks, src, dst):
    """``buf`` after a correct restore: each destination page set from its source page, page
    by page with torch's indexing (another route than the copy path's slab runs)."""
    want = buf.clone()
    dev = buf.device
    for g, layers in pages.items():
        s_ids = [b for sp, dp in zip(src, dst) for (gs, sb), (_, db) in zip(sp, dp) if gs == g
                 for b, d in zip(sb, db) if d != NULL_BLOCK]
        d_ids = [d for sp, dp in zip(src, dst) for (gs, _), (_, db) in zip(sp, dp) if gs == g
                 for d in db if d != NULL_BLOCK]
        if not s_ids:
            continue
        si = torch.tensor(s_ids, dtype=torch.long, device=dev)
        di = torch.tensor(d_ids, dtype=torch.long, device=dev)
        for start, stride, page in layers:
            v = page_view(buf, start, nblocks, stride, page)
            w = page_view(want, start, nblocks, stride, page)
            w.index_copy_(0, di, v.index_select(0, si))
    return want


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def run_size(fx, tokens: int, dev, tier_root: Path, reps: int, rows: list, notes: list) -> bool:
    pin = dev.type == "cuda"
    entries = spans(fx, tokens)
    src, next_id = assign(entries, 1)  # block 0 is vLLM's null block
    dst, nblocks = assign(entries, next_id)
    stride = fx["tensors"][0]["block_stride"]
    if any(t["block_stride"] != stride for t in fx["tensors"]):
        raise SystemExit("the fixture's tensors differ in block stride")
    pages = layer_pages(fx)
    buf = torch.empty(nblocks * stride, dtype=torch.uint8, device=dev)
    copier = SlabCopier(storage_bytes(buf), pages, nblocks)
    bodies = [copier.body_len(p) for p in src]
    moved = sum(bodies)
    # Room for the files: the bodies and their headers.
    need = moved + len(bodies) * (80 + len(fx["layout_id"]))
    free = shutil.disk_usage(tier_root).free
    if free < need + (1 << 30):
        print(f"SKIP {tokens} tokens: {tier_root} has {free / 1e9:.1f} GB free, the files need "
              f"{need / 1e9:.1f} GB (pass --tier-dir)")
        return True
    gen = torch.Generator(device=dev).manual_seed(tokens)
    buf.fill_(POISON)
    buf[stride:next_id * stride].copy_(torch.randint(0, 256, ((next_id - 1) * stride,), dtype=torch.uint8,
                                                     device=dev, generator=gen))
    tier_dir = tempfile.mkdtemp(prefix=f"v4pool-vllm-bench-{tokens}-", dir=tier_root)
    files = Files(tier_dir, fx["layout_id"])
    ring = HostRing(moved, pin=pin)
    ring.buffer()  # allocated (and registered) before the clock starts, as a serving worker's is
    saver = EntryMover(copier, ring, files)
    notes.append(f"# {tokens} tokens: {nblocks} blocks of {stride} B allocated on {dev}, {len(src)} entries, "
                 f"ring of {moved} B" + (f", page-locked: {ring.buffer().is_pinned()}" if pin else ""))
    kinds = ["b"] * (len(src) - 1) + ["c"]
    keys = [v4pool.tail_hash(v4pool.namespace_of(fx["layout_id"]), [tokens, i]) for i in range(len(src))]
    saves: list = []
    t_save = timed(lambda: saves.extend(saver.save(list(zip(kinds, keys, src)))), dev)
    ok = all(saves)
    # The reference: one pinned host-to-device copy of as many bytes.
    host = torch.empty(moved, dtype=torch.uint8, pin_memory=pin)
    host.copy_(ring.buffer()[:moved])
    dcopy = torch.empty(moved, dtype=torch.uint8, device=dev)
    t_h2d = statistics.median(timed(lambda: dcopy.copy_(host, non_blocking=pin), dev) for _ in range(reps))
    del host, dcopy
    h2d = moved / t_h2d / 1e9
    print(f"| {tokens} | save (ring + files) | consecutive | {moved} | {copier.stats['to_host']} | "
          f"{t_save:.4f} | {moved / t_save / 1e9:.2f} | | | {'yes' if ok else 'NO: a file put failed'} |")
    rows.append(dict(tokens=tokens, path="save", ids="consecutive", bytes=moved, seconds=t_save, ok=ok))
    # async_save's way: the step's share (copies queued) and the publish behind it.
    aring = HostRing(moved, pin=pin)
    aring.buffer()
    asaver = EntryMover(copier, aring, files, Publisher())
    published: list = []
    sync(dev)
    t0 = time.perf_counter()
    asaver.save_async(list(zip(kinds, keys, src)), published.extend)
    t_queued = time.perf_counter() - t0
    asaver.wait_published()
    t_pub = time.perf_counter() - t0
    same = all(published) and torch.equal(aring.buffer()[:moved], ring.buffer()[:moved])
    ok &= same
    for path, t in (("save queued (async)", t_queued), ("save published (async)", t_pub)):
        print(f"| {tokens} | {path} | consecutive | {moved} | | {t:.4f} | {moved / t / 1e9:.2f} | | | "
              f"{'yes' if same else 'NO'} |")
        rows.append(dict(tokens=tokens, path=path, ids="consecutive", bytes=moved, seconds=t, ok=same))
    asaver.close()
    del aring, asaver
    rng = random.Random(tokens)
    cases = [("ring", "consecutive", dst, saver), ("ring", "shuffled", shuffled(dst, rng), saver),
             ("files", "consecutive", dst, None)]
    for path, order, plans, mover in cases:
        times, exact, copies = [], True, 0
        for _ in range(reps if path == "ring" else 1):
            # Poison the restored request's blocks, then the expected allocation.
            buf[next_id * stride:].fill_(POISON)
            want = expected(buf, pages, nblocks, src, plans)
            m = mover
            if m is None:
                # A worker that did not save them: its ring is empty (allocated and registered
                # before the clock starts, as a serving worker's is); every entry from its file.
                m = EntryMover(copier, HostRing(moved, pin=pin), files)
                m.ring.buffer()
            before = copier.stats["to_device"]
            got: list = []
            times.append(timed(lambda: got.extend(m.load(list(zip(kinds, keys, plans)))), dev))
            copies = copier.stats["to_device"] - before
            exact &= all(got) and torch.equal(buf, want)
            del want
            if mover is None:
                m.ring.close()
        t = statistics.median(times)
        gbs = moved / t / 1e9
        ok &= exact
        print(f"| {tokens} | {path} | {order} | {moved} | {copies} | {t:.4f} | {gbs:.2f} | {h2d:.2f} | "
              f"{gbs / h2d:.2f} | {'yes' if exact else 'NO'} |")
        rows.append(dict(tokens=tokens, path=path, ids=order, bytes=moved, copies=copies, seconds=t,
                         gbs=gbs, h2d_gbs=h2d, ratio=gbs / h2d, exact=exact))
    ring.close()
    del buf, copier, saver, ring
    shutil.rmtree(tier_dir, ignore_errors=True)
    if pin:
        torch.cuda.empty_cache()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=None,
                    help="prefix lengths (default 8192,131072,1048576; 8192,20480 with --cpu-smoke)")
    ap.add_argument("--tier-dir", default=tempfile.gettempdir(),
                    help="where each size's entry files go (a fresh folder inside, removed after)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (the median is shown)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the same path on CPU tensors (checks the script, not a GPU figure)")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("SKIP vllm_gpu_restore: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    fx = json.loads(FIXTURE.read_text())
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    tokens = args.tokens or ("8192,20480" if args.cpu_smoke else "8192,131072,1048576")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke run, not a GPU figure)"
    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} on {name}; torch {torch.__version__}; "
          f"layout of vLLM {fx['vllm']} ({fx['model']}); files in {args.tier_dir}")
    print("| tokens | path | block ids | bytes | copies | s | GB/s | pinned H2D GB/s | ratio | exact |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
    rows: list = []
    notes: list = []
    ok = True
    for n in (int(t) for t in tokens.split(",")):
        ok &= run_size(fx, n, dev, Path(args.tier_dir), max(1, args.reps), rows, notes)
    print("\n".join(notes))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, torch=torch.__version__, rows=rows), indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
