#!/usr/bin/env python3
"""The module layering ARCHITECTURE.md states, checked over the crate's `crate::` and `super::`
paths (comments stripped). Exit 1, naming each offending file and path, when

* a top-level module of src/ names a module of its own layer or one above it (LAYERS below,
  lowest first), or a module FORBIDDEN lists for it; or
* two sibling files of one folder name each other, directly or round a longer loop
  (`use super::x` between files other than mod.rs).

Usage: scripts/layering.py [SRC_DIR]   (default: src/ beside this script's folder)
"""
import os
import re
import sys

# Lowest first. A module may name only modules of a strictly lower layer.
LAYERS = [
    ["checked", "dylib", "profiling", "rng", "setters", "variant"],
    ["geometry", "file", "format"],
    ["model", "index"],
    ["arena", "alloc", "kernels"],
    ["sizing", "boundary"],
    ["checkpoint"],
    ["plan_report", "backend"],
    ["pool"],
    ["state", "transfer"],
    ["manager"],
    ["events"],
    # What an engine uses, re-exported (src/prelude.rs): above every layer it names, below
    # the simulator and the bindings, which name nothing of it.
    ["prelude"],
    ["sim"],
    # The low-level layers' public home (src/raw.rs): re-exports only, like the prelude, above
    # every layer it names; the bindings name the layers themselves, never it.
    ["raw"],
    ["bindings"],
]
# ARCHITECTURE.md's sentences that the layers alone do not imply.
FORBIDDEN = {
    # allocators know no kernels
    "alloc": {"index", "kernels", "backend"},
    # backends know no DeepSeek (no model, no row space, no allocators)
    "backend": {"model", "geometry", "arena", "sizing", "checkpoint", "alloc", "boundary", "plan_report"},
}

COMMENT = re.compile(r"//[^\n]*")


def strip(text):
    return COMMENT.sub("", text)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "src")
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    errors = []
    siblings = {}  # folder -> {file stem: set of sibling stems it names}
    for folder, _, files in os.walk(src):
        rel_folder = os.path.relpath(folder, src)
        if rel_folder.split(os.sep)[0] == "bin":
            continue  # the CLI is its own crate: it sees only the library's public API
        for f in sorted(files):
            if not f.endswith(".rs"):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, src)
            top = rel.split(os.sep)[0].removesuffix(".rs")
            text = strip(open(path, encoding="utf-8").read())
            if top not in ("lib", "bin"):
                if top not in rank:
                    errors.append(f"{rel}: module `{top}` has no layer in scripts/layering.py")
                    continue
                for m in sorted(set(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", text))):
                    if m == top or m not in rank:
                        continue
                    if rank[m] >= rank[top]:
                        errors.append(f"{rel}: `{top}` names `crate::{m}` (layer {rank[m]} is not below {rank[top]})")
                    elif m in FORBIDDEN.get(top, ()):
                        errors.append(f"{rel}: `{top}` must not name `crate::{m}` (ARCHITECTURE.md)")
            if top == "bindings":
                # The two bindings are rooms side by side: neither names the other.
                parts = rel.split(os.sep)
                if len(parts) > 2:
                    own = parts[1]
                    for other in ("python", "capi"):
                        if other != own and re.search(r"\b(crate::bindings::|super::)" + other + r"\b", text):
                            errors.append(f"{rel}: binding `{own}` names binding `{other}`")
            stem = f.removesuffix(".rs")
            if stem != "mod" and not (rel_folder == "." and stem == "lib"):
                names = set(re.findall(r"\bsuper::([a-z_][a-z0-9_]*)", text))
                siblings.setdefault(folder, {})[stem] = names
    for folder, graph in siblings.items():
        stems = set(graph)
        edges = {s: {n for n in graph[s] if n in stems and n != s} for s in graph}
        # Any loop among siblings: depth-first search with colours.
        colour = {s: 0 for s in edges}

        def visit(s, trail):
            colour[s] = 1
            for n in sorted(edges[s]):
                if colour[n] == 1:
                    loop = trail[trail.index(n):] + [n]
                    errors.append(f"{os.path.relpath(folder, src)}/: files name each other: " + " -> ".join(loop))
                elif colour[n] == 0:
                    visit(n, trail + [n])
            colour[s] = 2

        for s in sorted(edges):
            if colour[s] == 0:
                visit(s, [s])
    for e in errors:
        print("layering:", e)
    if errors:
        print(f"layering: {len(errors)} violation(s); the rules are in scripts/layering.py and ARCHITECTURE.md")
        return 1
    print("layering: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
