#!/usr/bin/env python3
"""Is Cargo.toml's `rust-version` the real minimum? No older toolchain is installed where CI
runs, so this checks the two things that set it, from `cargo metadata` (offline, the lock file):

* every package a build of the library pulls in (normal and build dependencies, every feature,
  as locked) declares a `rust-version` no newer than ours — otherwise ours is a promise the
  locked tree breaks;
* ours is no older than the newest of them, so it states the real floor rather than a guess.

The crate's own code is held to it by clippy's `incompatible_msrv` lint (std items stable
after `rust-version`), which `.ci/run` runs with `-D warnings`. Usage: scripts/msrv.py
"""
import json
import subprocess
import sys


def ver(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


host = next(l.split()[1] for l in subprocess.check_output(["rustc", "-vV"], text=True).splitlines()
            if l.startswith("host:"))
meta = json.loads(subprocess.check_output(
    ["cargo", "metadata", "--format-version", "1", "--all-features", "--locked",
     "--filter-platform", host]))
pkgs = {p["id"]: p for p in meta["packages"]}
root = meta["resolve"]["root"]
ours = pkgs[root]["rust_version"]
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
seen, todo = set(), [root]
while todo:
    n = todo.pop()
    for d in nodes[n]["deps"]:
        kinds = {k["kind"] for k in d["dep_kinds"]}
        # Dev-dependencies of the root only build its tests; below the root cargo drops them.
        if kinds <= {"dev"}:
            continue
        if d["pkg"] not in seen:
            seen.add(d["pkg"])
            todo.append(d["pkg"])
need = max(((ver(pkgs[p]["rust_version"]), pkgs[p]["name"] + " " + pkgs[p]["version"])
            for p in seen if pkgs[p].get("rust_version")), default=((0,), "none"))
print(f"msrv: Cargo.toml rust-version {ours}; newest locked dependency floor {'.'.join(map(str, need[0]))} ({need[1]})")
if ver(ours) < need[0]:
    print(f"msrv: rust-version {ours} is below what {need[1]} requires")
    sys.exit(1)
if ver(ours) > need[0]:
    print("msrv: rust-version is above every dependency's floor: keep it only if the crate's own "
          "code needs it (clippy's incompatible_msrv says which items)")
