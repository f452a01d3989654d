#!/usr/bin/env python3
"""The crate's public API as a sorted listing, so that a change to it shows as a diff.

Runs `cargo rustdoc --lib` with rustdoc's JSON output (an unstable rustdoc option: enabled on
the stable toolchain with RUSTC_BOOTSTRAP=1, as cargo-public-api does; the JSON's
`format_version` is printed so a format change is visible), walks the crate from its root the
way a user's `use` does — public modules, public items, re-exports under the path they are
re-exported at — and prints:

* every public path with its kind (items: modules, structs, enums, traits, functions,
  constants, statics, type aliases, macros, re-exports of other crates' items; members:
  fields, variants, inherent methods, associated constants and types, trait items);
* counts by kind and by top-level module;
* the public structs whose fields are all public (a caller can build them by literal, so
  adding a field breaks it unless the struct is `#[non_exhaustive]`), each marked.

  scripts/public_api.py                 print the listing
  scripts/public_api.py --write         write it to api/public-api.txt
  scripts/public_api.py --check         exit 1 (with a diff) when it differs from that file
  scripts/public_api.py --json FILE     read an existing rustdoc JSON instead of building one

Only the default features are listed (`--features F` passes features to cargo).
"""

import argparse
import collections
import difflib
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LISTING = ROOT / "api" / "public-api.txt"
# rustdoc JSON formats this script was written against; another one is refused rather than
# misread (the walk depends on the item layout).
FORMATS = range(56, 60)
MEMBER_KINDS = {"field", "variant", "method", "assoc_const", "assoc_type", "trait_method"}


def build_json(features):
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )
    # A target directory of its own: RUSTC_BOOTSTRAP is part of cargo's fingerprints, so
    # sharing the build's would rebuild every dependency on each switch between the two.
    target = pathlib.Path(json.loads(meta.stdout)["target_directory"]) / "public-api"
    env["CARGO_TARGET_DIR"] = str(target)
    cmd = ["cargo", "rustdoc", "--lib", "--quiet"]
    if features:
        cmd += ["--features", features]
    cmd += ["--", "-Z", "unstable-options", "--output-format", "json"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return target / "doc" / "v4pool.json"


def kind_of(item):
    return next(iter(item["inner"]))


def is_non_exhaustive(item):
    # Attributes are plain strings, {"non_exhaustive": ...} or {"other": "#[...]"} depending
    # on the format version: any mention counts.
    return any("non_exhaustive" in json.dumps(a) for a in item.get("attrs", []))


class Walk:
    def __init__(self, doc):
        self.index = doc["index"]
        self.paths = doc["paths"]
        self.lines = set()  # (path, kind)
        self.structs = {}  # definition id -> (shortest path, item)
        self.defined = set()  # ids of the items listed (one item re-exported at two paths: one)

    def item(self, iid):
        return None if iid is None else self.index.get(str(iid))

    def emit(self, path, item, stack):
        kind = kind_of(item)
        self.lines.add((path, kind))
        self.defined.add(item["id"])
        inner = item["inner"][kind]
        if kind == "module":
            if item["id"] in stack:
                return
            self.module(inner["items"], path, stack | {item["id"]})
        elif kind == "struct":
            # Named by where it is defined (rustdoc's `paths`), not by a re-export such as
            # the prelude's.
            where = self.paths.get(str(item["id"]))
            self.structs[item["id"]] = ("::".join(where["path"]) if where else path, item)
            k = inner["kind"]
            fields = []
            if isinstance(k, dict) and "plain" in k:
                fields = k["plain"]["fields"]
            elif isinstance(k, dict) and "tuple" in k:
                fields = [f for f in k["tuple"] if f is not None]
            for f in fields:
                field = self.item(f)
                if field is not None:
                    self.lines.add((f"{path}::{field['name']}", "field"))
            self.inherent(inner["impls"], path)
        elif kind == "enum":
            for v in inner["variants"]:
                var = self.item(v)
                if var is not None:
                    self.lines.add((f"{path}::{var['name']}", "variant"))
            self.inherent(inner["impls"], path)
        elif kind == "union":
            self.inherent(inner["impls"], path)
        elif kind == "trait":
            for t in inner["items"]:
                ti = self.item(t)
                if ti is not None:
                    self.lines.add((f"{path}::{ti['name']}", "trait_" + member(kind_of(ti))))

    def inherent(self, impls, path):
        for i in impls:
            imp = self.item(i)
            if imp is None or imp["inner"]["impl"]["trait"] is not None:
                continue  # trait impls are the trait's surface, not the type's
            for m in imp["inner"]["impl"]["items"]:
                mi = self.item(m)
                if mi is not None and mi["visibility"] == "public":
                    self.lines.add((f"{path}::{mi['name']}", member(kind_of(mi))))

    def module(self, ids, prefix, stack):
        for iid in ids:
            it = self.item(iid)
            if it is None or it["visibility"] != "public":
                continue
            if kind_of(it) != "use":
                self.emit(f"{prefix}::{it['name']}", it, stack)
                continue
            u = it["inner"]["use"]
            target = self.item(u["id"])
            if u["is_glob"]:
                if target is not None and kind_of(target) == "module":
                    self.module(target["inner"]["module"]["items"], prefix, stack)
                elif target is not None and kind_of(target) == "enum":
                    for v in target["inner"]["enum"]["variants"]:
                        var = self.item(v)
                        if var is not None:
                            self.lines.add((f"{prefix}::{var['name']}", "variant"))
                else:
                    self.lines.add((f"{prefix}::* (from {u['source']})", "use_external"))
            elif target is not None:
                self.emit(f"{prefix}::{u['name']}", target, stack)
            else:
                self.lines.add((f"{prefix}::{u['name']} (from {u['source']})", "use_external"))


def member(kind):
    return {"function": "method"}.get(kind, kind)


def listing(doc):
    if doc["format_version"] not in FORMATS:
        sys.exit(f"public_api.py: rustdoc JSON format {doc['format_version']} is not one of "
                 f"{FORMATS.start}..{FORMATS.stop - 1}; check the walk against it")
    w = Walk(doc)
    root = w.index[str(doc["root"])]
    crate = root["name"]
    w.module(root["inner"]["module"]["items"], crate, {root["id"]})
    items = sorted(w.lines)
    by_kind = collections.Counter(k for _, k in items)
    top = collections.Counter()
    for path, kind in items:
        if kind in MEMBER_KINDS or kind.startswith("trait_"):
            continue
        parts = path.split("::")
        top[parts[1] if len(parts) > 2 else "(root)"] += 1
    n_items = sum(c for k, c in by_kind.items() if k not in MEMBER_KINDS and not k.startswith("trait_"))
    n_members = len(items) - n_items
    open_structs = []
    for path, item in w.structs.values():
        k = item["inner"]["struct"]["kind"]
        if isinstance(k, dict) and "plain" in k:
            ok = bool(k["plain"]["fields"]) and not k["plain"]["has_stripped_fields"]
            n = len(k["plain"]["fields"])
        elif isinstance(k, dict) and "tuple" in k:
            ok = bool(k["tuple"]) and all(f is not None for f in k["tuple"])
            n = len(k["tuple"])
        else:
            ok, n = False, 0  # unit structs have no fields to add to
        if ok:
            open_structs.append((path, n, is_non_exhaustive(item)))
    open_structs.sort()
    out = [
        f"# {crate} public API (default features), from rustdoc JSON format {doc['format_version']}",
        "# generated by scripts/public_api.py; regenerate with --write, compare with --check",
        "",
        f"items at {n_items} paths ({len(w.defined)} distinct; public modules "
        f"{by_kind['module']}, top-level {sum(1 for m in top if m != '(root)')}), members {n_members}, "
        f"structs with all fields public {len(open_structs)} "
        f"(#[non_exhaustive] {sum(1 for s in open_structs if s[2])})",
        "",
        "## by kind",
    ]
    out += [f"{k:<14} {c}" for k, c in sorted(by_kind.items())]
    out += ["", "## items by top-level module"]
    out += [f"{m:<14} {c}" for m, c in sorted(top.items())]
    out += ["", "## structs with all fields public (path, fields, #[non_exhaustive])"]
    out += [f"{p}  {n}  {'non_exhaustive' if ne else 'exhaustive'}" for p, n, ne in open_structs]
    out += ["", "## every public path (path  kind)"]
    out += [f"{p}  {k}" for p, k in items]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="an existing rustdoc JSON file of the crate")
    ap.add_argument("--features", help="cargo features to list with (default: the default ones)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {LISTING.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help=f"fail when it differs from {LISTING.relative_to(ROOT)}")
    a = ap.parse_args()
    path = pathlib.Path(a.json) if a.json else build_json(a.features)
    with open(path) as f:
        text = listing(json.load(f))
    if a.write:
        LISTING.parent.mkdir(exist_ok=True)
        LISTING.write_text(text)
        print(text.split("\n\n")[1])
    elif a.check:
        old = LISTING.read_text() if LISTING.exists() else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), text.splitlines(True), str(LISTING.relative_to(ROOT)), "now"))
            print(f"public_api.py: the public API differs from {LISTING.relative_to(ROOT)} "
                  "(if intended: scripts/public_api.py --write and commit it)", file=sys.stderr)
            return 1
        print(f"public_api.py: the public API matches {LISTING.relative_to(ROOT)}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
