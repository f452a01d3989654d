#!/usr/bin/env python3
"""ATOM's two state kernels (atom/model_ops/v4_kernels/state_writes.py) at the shapes of v4pool's
state benches, with the peer bench's own checks, timer and row format:

  * update_compressor_states (index-buffers.md §8), bf16 kv / score, fp32 ape, fp32 state
    tensors strided by a whole slot of the pool (views into one big buffer, slot stride
    `slot_rows x plane width` of ATOM's V4-Flash fp8 geometry):
      csa_main bs=<B> q=<q>   B 1, 64, 256, 1024; q 1, 2; dim 1024, ratio 4, overlap, S = 8 + spec
      hca_main bs=<B> q=<q>   dim 512, ratio 128, no overlap, S = 128 + spec
      csa_main prefill T=8192 a forward of 8,192 tokens: 1,024 sequences x 8, all inside their
                              last K = 8 positions, so the plan has 8,192 rows (the most a
                              forward of 8,192 tokens can write; benches/state_update.rs's shape)
    Contexts up to 1M. The write plan keeps, per sequence, the tokens at positions >= context - K
    (K = 8 CSA, 128 HCA), as ATOM's make_compress_plans does; the grid is the plan's length.
  * dspark_paged_window_gather (bf16 pool, one plane) and dspark_paged_window_gather_2buff
    (fp8 NoPE + bf16 RoPE planes, dequantised) at B 1, 64, 256, 1024 with Wd 128, and Wd 133
    at B 256, from the ring of a V4-Flash-DSpark draft layer (drafts dense, ring 133 = 128 + 5):
      bf16 B=<B> Wd=<Wd>, fp8 B=<B> Wd=<Wd>      (kernel "dspark_window_gather")
    anchors int32 (so ATOM's `.to(torch.int32)` is free), slots distinct random physical slots
    of a 1,024-slot pool, pool contents random (fp8 rows valid: no NaN, scales 100..149).

Every configuration is checked against ATOM's own *_reference first (outputs poisoned), and a
graph replay must reproduce the eager output; then eager and graph-replay medians (triton's
do_bench, cold L2), as `atom_peer_bench.measure_case` does for the index builders.

ATOM's state_writes.py and v4_quant.py are not among the files the peer directory holds. Copy
them beside the others first (same pinned commit), then run with the peer dir:

    ATOM=<a clone of ROCm/ATOM>; PEER=<the peer directory>
    C=ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21; K=$PEER/atom/model_ops/v4_kernels
    git -C $ATOM show $C:atom/model_ops/v4_kernels/state_writes.py > $K/state_writes.py
    git -C $ATOM show $C:atom/model_ops/v4_kernels/v4_quant.py > $K/v4_quant.py
    ATOM_PEER_DIR=$PEER OUT=$OUT python3 scripts/atom-peer-state.py [--quick] [--only update|gather]

(`$ATOM_PEER_DIR/state_writes.py` and `$ATOM_PEER_DIR/v4_quant.py`, flat, are found too.)
v4_quant imports `aiter.dtypes` for its fp8 dtype: a stand-in module maps it to torch's
float8_e4m3fn (the H200's fp8, what ATOM's aiter gives on NVIDIA). Writes
$OUT/atom_peer_state.json ({"rows": [...]}, the peer JSON's row format).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import types
from pathlib import Path

SPEC = 1  # MTP1: update rings S = K + 1, as v4pool's update bench
CSA = dict(name="csa_main", dim=1024, ratio=4, overlap=True)
HCA = dict(name="hca_main", dim=512, ratio=128, overlap=False)
BATCHES = (1, 64, 256, 1024)
GATHER_SHAPES = [(b, 128) for b in BATCHES] + [(256, 133)]
DSPARK_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0]  # V4-Flash + 3 dense DSpark drafts
DSPARK_SPEC = 5  # ring 133
MAX_POS = 1_000_000
GATHER_SLOTS = 1024
SENTINEL = 12345.0


# ------------------------------------------------------- torch-free helpers ----
def pool_window(ratio: int, overlap: bool) -> int:
    """K: the positions a compressor's state must keep (§8)."""
    return (2 if overlap else 1) * ratio


def decode_plan(ctxs: list[int], q: int, k: int) -> list[tuple[int, int, int, int]]:
    """Write-plan rows (ragged_id, batch_id, position, 0) of a decode step: sequence b's q
    tokens are ragged rows b*q .. b*q+q-1 at positions ctx-q .. ctx-1 (ctx = context after the
    step); a token is kept when its position is >= ctx - K."""
    rows = []
    for b, ctx in enumerate(ctxs):
        for j in range(q):
            pos = ctx - q + j
            if pos >= max(0, ctx - k):
                rows.append((b * q + j, b, pos, 0))
    return rows


def update_shapes() -> list[tuple[dict, str, int, int]]:
    """(class, shape label, batch, new tokens per sequence) for every update row."""
    out = []
    for cls in (CSA, HCA):
        for b in BATCHES:
            for q in (1, 2):
                out.append((cls, f"{cls['name']} bs={b} q={q}", b, q))
    out.append((CSA, "csa_main prefill T=8192", 1024, 8))
    return out


def gather_label(fp8: bool, b: int, wd: int) -> str:
    return f"{'fp8' if fp8 else 'bf16'} B={b} Wd={wd}"


# ------------------------------------------------------------ ATOM loading ----
def load_atom(peer: Path):
    """ATOM's state_writes (and v4_quant) as the package modules they import each other by."""
    sys.path.insert(0, str(peer))
    if "aiter" not in sys.modules:  # v4_quant's only non-torch import: its fp8 dtype
        import torch

        aiter = types.ModuleType("aiter")
        aiter.dtypes = types.SimpleNamespace(fp8=torch.float8_e4m3fn, fp32=torch.float32, bf16=torch.bfloat16)
        sys.modules["aiter"] = aiter
    pkg = "atom.model_ops.v4_kernels"
    mods = {}
    for name in ("v4_quant", "state_writes"):
        cands = [peer / "atom/model_ops/v4_kernels" / f"{name}.py", peer / f"{name}.py"]
        path = next((p for p in cands if p.is_file()), None)
        if path is None:
            raise SystemExit(f"{name}.py not found in {cands}: copy it from ATOM first (see the docstring)")
        spec = importlib.util.spec_from_file_location(f"{pkg}.{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"{pkg}.{name}"] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["state_writes"]


# -------------------------------------------------------------- the cases ----
def make_cases(sw, torch):
    """Case classes with the interface atom_peer_bench.measure_case drives: kind, T,
    bytes_written(), check(windows), run(), snapshot(), reset()."""

    class UpdateCase:
        kind = "update_compressor_states"

        def __init__(self, state, cls, b, q, seed, slot_range):
            self.cls, self.state = cls, state
            k = pool_window(cls["ratio"], cls["overlap"])
            rnd = random.Random(seed)
            ctxs = [rnd.randrange(q, MAX_POS) for _ in range(b)]
            n_tok, plan = b * q, decode_plan(ctxs, q, k)
            dev, dim = "cuda", cls["dim"]
            g = torch.Generator(device=dev).manual_seed(seed)
            self.kv = torch.randn(n_tok, dim, generator=g, device=dev).to(torch.bfloat16)
            self.score = torch.randn(n_tok, dim, generator=g, device=dev).to(torch.bfloat16)
            self.ape = torch.randn(cls["ratio"], dim, generator=g, device=dev)
            slots = rnd.sample(slot_range, b)
            self.slots = torch.tensor(slots, dtype=torch.int32, device=dev)
            self.plan = torch.tensor(plan, dtype=torch.int32, device=dev).reshape(-1, 4)
            self.T = self.plan.shape[0]
            self.reset()

        def bytes_written(self):
            return 2 * self.T * self.cls["dim"] * 4

        def _call(self, fn):
            fn(self.kv, self.score, self.ape, self.state["kv"], self.state["score"],
               write_plan=self.plan, state_slot_mapping=self.slots,
               ratio=self.cls["ratio"], overlap=self.cls["overlap"])

        def run(self):
            self._call(sw.update_compressor_states)

        def reset(self):
            idx = self.slots.long()
            self.state["kv"][idx] = SENTINEL
            self.state["score"][idx] = SENTINEL

        def _slot_rows(self):
            idx = self.slots.long()
            return [self.state["kv"][idx].clone(), self.state["score"][idx].clone()]

        def snapshot(self):
            # Only the rows this plan writes: rotated cases may share slots (the pool has
            # 1,024), so a slot's other rows are another case's.
            p = self.plan.long()
            s, d = self.slots.long()[p[:, 1]], p[:, 2] % self.state["S"]
            return [self.state["kv"][s, d].clone(), self.state["score"][s, d].clone()]

        def check(self, windows):
            # The whole plan (the reference walks it on the host): from poisoned slots, the
            # kernel against ATOM's reference over every row of the sequences' slots (so no
            # stray store goes unseen), then that exactly the planned rows were written.
            self.reset()
            self.run()
            torch.cuda.synchronize()
            got = self._slot_rows()
            self.reset()
            self._call(sw.update_compressor_states_reference)
            torch.cuda.synchronize()
            want = self._slot_rows()
            written = int((got[0] != SENTINEL).any(-1).sum())
            slots = self.slots.tolist()
            targets = len({(slots[bi], pos % self.state["S"]) for _, bi, pos, _ in self.plan.tolist() if pos >= 0})
            ok = all(torch.equal(a, b) for a, b in zip(got, want)) and written == targets
            return dict(ok=bool(ok), rows=self.T, rows_written=written, targets=targets)

    class GatherCase:
        def __init__(self, pool, fp8, b, wd, seed):
            self.pool, self.fp8, self.wd = pool, fp8, wd
            self.kind = "dspark_window_gather_2buff" if fp8 else "dspark_window_gather"
            rnd = random.Random(seed)
            self.slots = torch.tensor([pool["geo"].physical_slot(gr) for gr in rnd.sample(range(GATHER_SLOTS), b)],
                                      dtype=torch.int32, device="cuda")
            anchors = [rnd.randrange(0, wd) if rnd.random() < 0.2 else rnd.randrange(0, MAX_POS) for _ in range(b)]
            self.anchors = torch.tensor(anchors, dtype=torch.int32, device="cuda")
            self.T = b
            self.out = None

        def bytes_written(self):
            return self.T * self.wd * 1024

        def _args(self, lo=0, hi=None):
            p = self.pool
            planes = (p["nope"], p["rope"]) if self.fp8 else (p["bf16"],)
            return (*planes, self.slots[lo:hi], self.anchors[lo:hi], self.wd, p["window"])

        def run(self):
            fn = sw.dspark_paged_window_gather_2buff if self.fp8 else sw.dspark_paged_window_gather
            self.out = fn(*self._args())

        def reset(self):
            if self.out is not None:
                self.out.fill_(-7.0)

        def snapshot(self):
            return [self.out.clone()]

        def check(self, windows):
            # Windows of sequences at both ends against ATOM's reference (a Python loop per
            # row). Exact for the copy; the fp8 variant's scale comes from tl.exp2 in the
            # kernel and torch.pow in the reference, so it is held to bf16 rounding.
            ref = (sw.dspark_paged_window_gather_2buff_reference if self.fp8
                   else sw.dspark_paged_window_gather_reference)
            self.run()
            torch.cuda.synchronize()
            ok, exact = True, True
            for lo, hi in windows:
                want = ref(*self._args(lo, hi))
                got = self.out[lo:hi]
                exact &= torch.equal(got, want)
                ok &= torch.equal(got, want) or (
                    self.fp8 and torch.allclose(got.float(), want.float(), rtol=2.0**-7, atol=0.0))
            return dict(ok=bool(ok), exact=bool(exact), windows=windows, seqs=self.T)

    return UpdateCase, GatherCase


def update_state(apb, torch, cls, positions):
    """kv / score state views of one CSA or HCA layer, strided by a whole slot of ATOM's V4-Flash
    fp8 pool: CSA fields live in its 128-B plane, HCA fields in its 512-B plane (pool-runtime.md
    §2.3), score after kv, each field 256-B aligned."""
    geo = apb.flash_geometry()
    width = 128 if cls["ratio"] == 4 else 512
    k = pool_window(cls["ratio"], cls["overlap"])
    s = k + SPEC
    stride_elems = geo.slot_rows * width // 4
    field_elems = s * cls["dim"]
    n_layers = apb.FLASH_RATIOS.count(cls["ratio"])
    score_off = -(-(n_layers * field_elems * 4) // 256) * 256 // 4
    assert score_off + field_elems <= stride_elems, "state fields do not fit a slot"
    buf = torch.empty(positions * stride_elems, dtype=torch.float32, device="cuda")
    view = lambda off: buf.as_strided((positions, s, cls["dim"]), (stride_elems, cls["dim"], 1), off)  # noqa: E731
    return dict(kv=view(0), score=view(score_off), S=s, positions=positions, buf=buf)


def gather_pool(torch, geo_cls):
    """The planes of a V4-Flash-DSpark (dense drafts) pool of GATHER_SLOTS slots, window rows
    only (arena 0), random contents; the view and window of the first draft layer."""
    geo = geo_cls(DSPARK_RATIOS, 0, GATHER_SLOTS, ring_slots=128 + DSPARK_SPEC, block_size=256)
    layer = len(DSPARK_RATIOS) - 3
    base, rows = geo.layer_base_row(layer), geo.plane_rows
    g = torch.Generator(device="cuda").manual_seed(7)
    nope = torch.randint(0, 256, (rows, 512), dtype=torch.uint8, device="cuda", generator=g)
    vals = nope[:, :448]
    vals[(vals & 0x7F) == 0x7F] ^= 1  # no NaN e4m3 values
    nope[:, 448:462:2] = torch.randint(100, 150, (rows, 7), dtype=torch.uint8, device="cuda", generator=g)
    rope = torch.empty(rows, 64, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
    bf16 = torch.empty(rows, 512, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
    return dict(
        geo=geo,
        window=geo.window_params(0),
        nope=nope[base:].view(torch.float8_e4m3fn),
        rope=rope[base:],
        bf16=bf16[base:],
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("update", "gather"))
    args = ap.parse_args()
    peer = Path(os.environ["ATOM_PEER_DIR"]).resolve()
    sys.path.insert(0, str(peer))
    import torch

    import atom_peer_bench as apb
    from atom.model_ops.attentions.v4_pool_geometry import UnifiedPoolGeometry

    sw = load_atom(peer)
    apb.KERNEL_NAMES.update(
        update_compressor_states="_update_compressor_states_kernel",
        dspark_window_gather="_dspark_paged_window_gather_kernel",
        dspark_window_gather_2buff="_dspark_paged_window_gather_2buff_kernel",
    )
    UpdateCase, GatherCase = make_cases(sw, torch)
    timer = apb.Timer(args.quick)
    copy_cache = apb.make_copy_bench(timer, "cuda")
    rows = []

    def record(kernel, shape, cases):
        rows.append(apb.measure_case(kernel, shape, cases, timer, copy_cache))
        r = rows[-1]
        print(kernel, shape, "graph", r.get("graph", {}).get("median_us"), "check", r["check"].get("ok"), flush=True)

    if args.only in (None, "update"):
        states = {}
        for cls, shape, b, q in update_shapes():
            if cls["name"] not in states:
                states[cls["name"]] = update_state(apb, torch, cls, apb.NUM_SLOTS)
            # Rotated sets on disjoint slots (the graph check compares each set's rows after the
            # others ran): as many as the pool's slots allow, at least one.
            n = max(1, min(apb.ROTATE, apb.NUM_SLOTS // b))
            part = apb.NUM_SLOTS // n
            cases = [UpdateCase(states[cls["name"]], cls, b, q, 1000 * b + 10 * q + i, range(i * part, (i + 1) * part))
                     for i in range(n)]
            record("update_compressor_states", shape, cases)
        states.clear()
        torch.cuda.empty_cache()
    if args.only in (None, "gather"):
        pool = gather_pool(torch, UnifiedPoolGeometry)
        for fp8 in (True, False):
            for b, wd in GATHER_SHAPES:
                cases = [GatherCase(pool, fp8, b, wd, seed=97 * b + wd + i) for i in range(apb.ROTATE)]
                record("dspark_window_gather", gather_label(fp8, b, wd), cases)
    out = Path(os.environ.get("OUT", "atom_peer_out"))
    out.mkdir(parents=True, exist_ok=True)
    env = apb.env_info()
    env.update(spec_steps_update=SPEC, dspark_ring=128 + DSPARK_SPEC, ape_dtype="float32", kv_dtype="bfloat16")
    (out / "atom_peer_state.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))


if __name__ == "__main__":
    main()
