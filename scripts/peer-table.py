#!/usr/bin/env python3
"""Join the v4pool GPU bench's PEER lines with ROCm/ATOM's peer JSON from the same device call.

    python3 scripts/peer-table.py BENCH_LOG ATOM_JSON [ATOM_EXTRA_JSON] [ATOM_STATE_JSON]

The state kernels' lines (benches/window_gather.rs: `window_gather <variant> B=.. Wd=..
v4pool_us=.. memset_us=..`; the update bench: `... csa_main bs=.. q=.. v4pool_us=..`) are joined
with scripts/atom-peer-state.py's rows in a second table (BENCH_LOG may hold several benches'
output, concatenated).

Prints one side-by-side table (graph-replay medians, µs): shape, v4pool, ATOM, ATOM / v4pool,
and v4pool / a memset of the bytes v4pool writes (decode rows also name v4pool / the traffic
floor: a copy kernel reading the block-table rows the builder reads and writing what it
writes, with no dependent loads). Decode rows compare the same work: ATOM's
kernel writes only the window tails, its HCA heads are built on the host (numpy) and copied
up, so its figure is kernel + host + H2D (the kernel alone is shown beside it).
"""
import json
import sys


def load_rows(paths):
    rows, heads = {}, {}
    for p in paths:
        try:
            d = json.load(open(p))
        except OSError:
            continue
        for r in d.get("rows", []):
            if "graph" in r:
                rows[(r["kernel"], r["shape"].split(" (")[0])] = r
        for h in d.get("decode_hca_head_host", []):
            heads[h["T"]] = h
    return rows, heads


def main():
    ours = []
    for line in open(sys.argv[1], encoding="utf-8"):
        if line.startswith("PEER\t"):
            # An optional last field: the traffic floor (decode: reading the table rows too).
            _, kind, shape, us, written, memset, *traffic = line.rstrip("\n").split("\t")
            ours.append((kind, shape, float(us), int(written), float(memset), float(traffic[0]) if traffic else None))
    rows, heads = load_rows(sys.argv[2:])
    g = lambda kernel, shape, key="graph": rows.get((kernel, shape), {}).get(key, {}).get("median_us")  # noqa: E731

    def host_heads(t):
        h = heads.get(t)
        return None if h is None else h["numpy_median_us"] + h["h2d_median_us"]

    print(f"{'shape':<38} {'v4pool µs':>10} {'ATOM µs':>12} {'ATOM/v4pool':>12} {'≥1.25×':>7} "
          f"{'written':>10} {'v4pool/memset':>14} {'≤1.5×':>6}  note")
    for kind, shape, us, written, memset, traffic in ours:
        if kind == "state_update":
            continue  # the state kernels' table below
        note = ""
        if kind == "decode":
            t = int(shape.split("=")[1])
            k = g("decode_indices", shape)
            hh = host_heads(t)
            atom = None if k is None or hh is None else k + hh
            note = f"ATOM kernel alone {k:.2f} µs (window tails only) + host heads {hh:.0f} µs" if atom else ""
            if traffic:
                note += f"; {us / traffic:.2f}× the traffic floor ({traffic:.2f} µs)"
            label = f"decode {shape}" + (" (bs1024×2 MTP verify)" if t == 2048 else "")
        elif kind == "step":
            d, hh, x21 = g("decode_indices", "T=256"), host_heads(256), g("csa_translate_pack", shape, "graph_x21")
            atom = None if None in (d, hh, x21) else d + hh + x21
            note = f"ATOM: window {d:.2f} + host heads {hh:.0f} + 21 packs {x21:.2f}" if atom else ""
            label = f"decode step bs256 + 21 packs {shape.split()[1]}"
        elif kind == "csa":
            atom, label = g("csa_translate_pack", shape), f"csa pack 1 layer {shape}"
        elif kind == "csa_x21":
            # v4pool: 21 layers, each its own top-k (as a forward); ATOM's figure re-reads one.
            atom, label = g("csa_translate_pack", shape, "graph_x21"), f"csa pack 21 layers {shape}"
            note = "v4pool reads 21 distinct top-k; ATOM one layer's, 21 times"
        elif kind == "csa_x21_same":
            atom, label = g("csa_translate_pack", shape, "graph_x21"), f"csa pack 21x layer 0 {shape}"
        else:
            atom, label = g("prefill_indices", shape), f"prefill {shape}"
        ratio = None if atom is None else atom / us
        big = written >= 4_000_000
        print(f"{label:<38} {us:>10.2f} {('-' if atom is None else f'{atom:.2f}'):>12} "
              f"{('-' if ratio is None else f'{ratio:.2f}×'):>12} "
              f"{('-' if ratio is None else ('MET' if ratio >= 1.25 else 'NOT')):>7} "
              f"{written / 1e6:>8.2f}MB {us / memset:>13.2f}× {(('MET' if us / memset <= 1.5 else 'NOT') if big else '-'):>6}  {note}")


# ---- the state kernels (§8 update, §9 window gather) --------------------------------------

STATE_NAMES = ("csa_main", "hca_main")


def state_line(line):
    """(ATOM kernel, shape, v4pool µs, memset µs) of a state bench line, or None.

    `window_gather fp8 B=64 Wd=128 v4pool_us=..` joins ATOM's `dspark_window_gather` row of shape
    `fp8 B=64 Wd=128`; a line naming `csa_main ...` / `hca_main ...` before `v4pool_us=` joins
    `update_compressor_states` of that shape (whatever words come first)."""
    if " v4pool_us=" not in line:
        return None
    head, _, tail = line.strip().partition(" v4pool_us=")
    fields = dict(kv.split("=", 1) for kv in ("v4pool_us=" + tail).split() if "=" in kv)
    try:
        us, memset = float(fields["v4pool_us"]), float(fields.get("memset_us", "nan"))
    except (KeyError, ValueError):
        return None
    words = head.split()
    if words and words[0] == "window_gather":
        return "dspark_window_gather", " ".join(words[1:]), us, memset
    at = min((head.find(n) for n in STATE_NAMES if n in head), default=-1)
    if at < 0:
        return None
    return "update_compressor_states", head[at:], us, memset


def state_table(log_path, json_paths):
    rows, _ = load_rows(json_paths)
    ours = [r for r in map(state_line, open(log_path, encoding="utf-8")) if r]
    if not ours:
        return
    print(f"\n{'state kernel shape':<38} {'v4pool µs':>10} {'ATOM µs':>10} {'ATOM/v4pool':>12} {'≥1.25×':>7} "
          f"{'memset µs':>10} {'v4pool/memset':>14}")
    for kernel, shape, us, memset in ours:
        atom = rows.get((kernel, shape), {}).get("graph", {}).get("median_us")
        ratio = None if atom is None else atom / us
        label = ("gather " if kernel == "dspark_window_gather" else "update ") + shape
        print(f"{label:<38} {us:>10.2f} {('-' if atom is None else f'{atom:.2f}'):>10} "
              f"{('-' if ratio is None else f'{ratio:.2f}×'):>12} "
              f"{('-' if ratio is None else ('MET' if ratio >= 1.25 else 'NOT')):>7} "
              f"{memset:>10.2f} {us / memset:>13.2f}×")


if __name__ == "__main__":
    main()
    state_table(sys.argv[1], sys.argv[2:])
