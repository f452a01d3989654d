"""examples/quickstart.py runs as written against the installed wheel (from outside the
checkout, so `import v4pool` is the wheel) and serves the second turn from the cache."""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def test_quickstart_runs_and_hits():
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            [sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
            cwd=cwd, capture_output=True, text=True, timeout=120,
        )
    assert r.returncode == 0, r.stdout + r.stderr
    # The second turn's hit is the first turn's full blocks (the script exits 1 otherwise).
    assert "admitted with 768 from the cache" in r.stdout, r.stdout
    assert "error as expected: NoSuchPlane" in r.stdout, r.stdout
