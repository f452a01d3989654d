#!/usr/bin/env python3
"""Render BENCHMARKS.md from the machine-readable results in bench-results/.

Each bench-results/*.json file is one device run at one commit: `commit`, `device`, `date`
(UTC, "YYYY-MM-DD HH:MM"), `source` (its log section in docs/archive/BENCHMARKS-history.md),
`peer_source`, and `rows`, each with `bench`, `figure`, `value` (a number or a list of them;
`decimals` or `value_text` say how it reads), `unit`, `peer`, `ratio` and `paths` (the code the row
measures). bench-results/page.md is the page around the table ({at}, {headline}).

Every row is stamped with its commit and with whether its paths changed between that commit
and the render commit (`git diff --quiet <commit> <at> -- <paths>`). The render commit is
written into the page, so the page is a pure function of the results, the template and the git
history, and a check can re-render it exactly: why not stamp against HEAD at check time? Then
every commit that touches a kernel would make the page differ from its rendering, and the page
would have to be re-rendered in the same commit it cannot name.

Usage:
  scripts/render_benchmarks.py            write BENCHMARKS.md, stamped against HEAD
  scripts/render_benchmarks.py --check    exit 1 unless BENCHMARKS.md equals its rendering
                                          (against the commit it names); list the rows whose
                                          code changed since that commit up to HEAD
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RESULTS = os.path.join(ROOT, "bench-results")
PAGE = os.path.join(RESULTS, "page.md")
OUT = os.path.join(ROOT, "BENCHMARKS.md")
REQUIRED = ("commit", "device", "date", "source", "rows")
ROW_REQUIRED = ("bench", "figure", "value", "unit", "peer", "ratio", "paths")
# The page names its render commit in this form (a full hash: short ones can grow ambiguous).
AT = re.compile(r"`([0-9a-f]{40})`, the commit this page was rendered at")


class RenderError(Exception):
    pass


def git(*args):
    r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def resolve(rev):
    rc, out = git("rev-parse", "--verify", "--quiet", rev + "^{commit}")
    if rc != 0:
        raise RenderError(f"commit {rev} is not in this checkout's history")
    return out


def load():
    runs = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        name = os.path.relpath(path, ROOT)
        missing = [k for k in REQUIRED if k not in run]
        if missing:
            raise RenderError(f"{name}: missing {', '.join(missing)}")
        if not re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", run["date"]):
            raise RenderError(f"{name}: date {run['date']!r} is not 'YYYY-MM-DD HH:MM' (UTC)")
        for i, row in enumerate(run["rows"]):
            missing = [k for k in ROW_REQUIRED if k not in row]
            if missing:
                raise RenderError(f"{name}: row {i}: missing {', '.join(missing)}")
            if not row["paths"]:
                raise RenderError(f"{name}: row {i}: no paths: nothing to stamp it against")
        run["file"] = name
        runs.append(run)
    if not runs:
        raise RenderError("bench-results/ holds no results")
    # Newest run first; the file name breaks ties, so the order never depends on the file system.
    runs.sort(key=lambda r: (r["date"], r["file"]), reverse=True)
    return runs


def number(v, decimals=None):
    if decimals is not None:
        return f"{v:,.{decimals}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,}" if abs(v) >= 1e-2 else f"{v:.1e}"


def value_text(row):
    if "value_text" in row:
        text = row["value_text"]
    else:
        values = row["value"] if isinstance(row["value"], list) else [row["value"]]
        text = " / ".join(number(v, row.get("decimals")) for v in values)
    unit = row["unit"]
    return f"{text} {unit}" if unit and unit != "µs" else text


def stamp(commit, at, paths):
    full = resolve(commit)
    rc, out = git("diff", "--name-only", full, at, "--", *paths)
    if rc != 0:
        raise RenderError(f"git diff {commit} {at[:12]} failed")
    files = [f for f in out.splitlines() if f]
    return "unchanged" if not files else f"changed ({len(files)} file{'s' if len(files) > 1 else ''})"


def cell(text):
    return str(text).replace("|", "\\|")


def render(at):
    at = resolve(at)
    lines = [
        "| work | v4pool | peer | ratio | device | measured (UTC) | commit | code since |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in load():
        for row in run["rows"]:
            lines.append("| " + " | ".join(cell(c) for c in (
                f"{row['bench']}, {row['figure']}",
                value_text(row),
                row["peer"],
                row["ratio"],
                run["device"],
                run["date"],
                f"`{run['commit']}`",
                stamp(run["commit"], at, row["paths"]),
            )) + " |")
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    if "{headline}" not in page or "{at}" not in page:
        raise RenderError("bench-results/page.md lacks {headline} or {at}")
    page = page.replace("{at}", f"`{at}`").replace("{headline}", "\n".join(lines))
    if not AT.search(page):
        raise RenderError("bench-results/page.md must name the render commit as "
                          "'{at}, the commit this page was rendered at'")
    return page


def check():
    """0 when BENCHMARKS.md is its own rendering; prints what differs otherwise."""
    with open(OUT, encoding="utf-8") as f:
        have = f.read()
    m = AT.search(have)
    if not m:
        print("BENCHMARKS.md names no render commit: run scripts/render_benchmarks.py", file=sys.stderr)
        return 1
    want = render(m.group(1))
    if have != want:
        import difflib
        sys.stderr.writelines(difflib.unified_diff(
            want.splitlines(True), have.splitlines(True), "rendered", "BENCHMARKS.md", n=1))
        print("BENCHMARKS.md differs from its rendering: run scripts/render_benchmarks.py",
              file=sys.stderr)
        return 1
    # Information only: rows whose code changed after the page was rendered.
    head = resolve("HEAD")
    if head != m.group(1):
        for run in load():
            for row in run["rows"]:
                if stamp(m.group(1), head, row["paths"]) != "unchanged":
                    print(f"note: code of '{row['bench']}, {row['figure']}' changed since the render")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    ap.add_argument("--at", default="HEAD", help="the commit to stamp against (default HEAD)")
    a = ap.parse_args()
    try:
        if a.check:
            return check()
        page = render(a.at)
    except RenderError as e:
        print(f"render_benchmarks: {e}", file=sys.stderr)
        return 2
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
