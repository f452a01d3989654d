#!/usr/bin/env python3
"""ATOM's prefill builder at the shapes its peer bench leaves out: chunks starting at position 0
(2,048 and 8,192 tokens, no context before them). Uses the peer bench's own cases, checks and
timer; writes $OUT/atom_peer_extra.json (rows in the peer JSON's format).

    ATOM_PEER_DIR=<peer directory> python3 scripts/atom-peer-extra.py
"""
import json
import os
import sys
from pathlib import Path

peer = Path(os.environ["ATOM_PEER_DIR"]).resolve()
sys.path.insert(0, str(peer))
import atom_peer_bench as apb  # noqa: E402

timer = apb.Timer(False)
geo = apb.flash_geometry()
copy_cache = apb.make_copy_bench(timer, "cuda")
rows = []
for T in (2048, 8192):
    cases = [apb.PrefillCase(geo, T, T, "cuda", seed=31 * T + i) for i in range(apb.ROTATE)]
    rows.append(apb.measure_case("prefill_indices", f"T={T} ctx={T // 1024}K", cases, timer, copy_cache))
    print(rows[-1]["shape"], rows[-1].get("graph"), flush=True)
out = Path(os.environ.get("OUT", "atom_peer_out"))
out.mkdir(parents=True, exist_ok=True)
(out / "atom_peer_extra.json").write_text(json.dumps(dict(rows=rows), indent=1))
