"""BENCHMARKS.md is the rendering of bench-results/ (scripts/render_benchmarks.py), stamped
against the commit it names, and the stamps follow git. Pure Python and git: no wheel needed."""

import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "render_benchmarks.py")


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def rb():
    r = git("rev-parse", "--is-shallow-repository")
    if r.returncode != 0:
        pytest.skip("not a git checkout: the stamps need the history")
    if r.stdout.strip() == "true":
        pytest.skip("a shallow clone: the measured commits are not in it")
    spec = importlib.util.spec_from_file_location("render_benchmarks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_md_is_its_rendering(rb):
    with open(rb.OUT, encoding="utf-8") as f:
        have = f.read()
    m = rb.AT.search(have)
    assert m, "BENCHMARKS.md names no render commit: run scripts/render_benchmarks.py"
    assert have == rb.render(m.group(1)), "BENCHMARKS.md is stale: run scripts/render_benchmarks.py"


def test_every_row_names_a_commit_of_the_history_and_its_code(rb):
    for run in rb.load():
        rb.resolve(run["commit"])
        for row in run["rows"]:
            for p in row["paths"]:
                assert os.path.exists(os.path.join(ROOT, p)), f"{run['file']}: no path {p}"


def test_stamps_follow_git(rb):
    # The kernels changed between the decode-builder run and the step run; nothing changes
    # between a commit and itself.
    a, b = rb.resolve("50a6eac"), rb.resolve("c6dc7e5")
    assert rb.stamp("50a6eac", b, ["kernels/"]).startswith("changed (")
    assert rb.stamp("50a6eac", a, ["kernels/"]) == "unchanged"
