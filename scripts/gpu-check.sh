#!/usr/bin/env bash
# GPU check of v4pool on one machine with an NVIDIA GPU (CUDA driver; compute-sanitizer and
# ncu optional): every GPU test with the GPU required, memcheck over the graph and path tests,
# the benches, `v4pool simulate` on CUDA, and optionally the Python module on torch and
# ROCm/ATOM's peer benches beside ours. Summary and logs go to --out.
#
#   scripts/gpu-check.sh [--phase tests|bench|all] [--out DIR] [--bins DIR] [--wheels DIR]
#                        [--peer DIR] [--ncu]
#
# --bins DIR   prebuilt binaries instead of building here: DIR/tests/<suite>, DIR/benches/<bench>,
#              DIR/bin/v4pool, and optionally DIR/bin-path (the path the CLI tests were compiled
#              to find v4pool at; the binary is copied there). Produce one on a build machine
#              with `scripts/gpu-check.sh --pack DIR` and copy DIR over.
#              Without --bins the tests and benches are built here with cargo (release).
# --wheels DIR v4pool and pytest wheels (pip --no-index): runs tests/python/test_gpu_torch.py.
# --peer DIR   an ATOM peer directory (atom_peer_bench.py and ATOM's kernels beside it; see
#              scripts/atom-peer-state.py): ATOM's index and state benches in the same run, and
#              scripts/peer-table.py's side-by-side table.
# --ncu        Nsight Compute over one launch of each index kernel (benches/gpu --profile-shapes).
# Environment: TESTS, MEMCHECK, BENCHES override the lists below (space separated; "none").
# A test entry is "suite:filter": the suite binary (tests/<suite>/main.rs) run for the tests
# whose names contain the filter (a former test file is the filter `<file>::`).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
phase=all out=gpu-check-out bins="" wheels="" peer="" ncu="" pack=""
while [ $# -gt 0 ]; do
  case $1 in
    --phase) phase=$2; shift 2;; --out) out=$2; shift 2;; --bins) bins=$2; shift 2;;
    --wheels) wheels=$2; shift 2;; --peer) peer=$2; shift 2;; --ncu) ncu=1; shift;;
    --pack) pack=$2; shift 2;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2;;
  esac
done
tests=${TESTS:-gpu:gpu_backend:: gpu:gpu_kernels:: gpu:gpu_graph:: gpu:gpu_decode_path:: gpu:gpu_manager:: gpu:gpu_manager_tier:: gpu:gpu_state_update:: gpu:gpu_window_gather:: gpu:gpu_transfer:: gpu:gpu_profiling:: layout:pool_props:: gpu:hip_backend:: manager:manager_exact:: gpu:gpu_v41_index:: gpu:gpu_kv_rows:: gpu:gpu_index_keys:: gpu:gpu_step_batch::}
benches=${BENCHES:-gpu state_update window_gather transfer manager step}
# The same form; the filters keep the sanitizer's slowdown to the graph-replay tests.
memcheck=${MEMCHECK:-gpu:gpu_kernels:: gpu:gpu_graph:: gpu:gpu_decode_path:: gpu:gpu_manager:: gpu:gpu_manager_tier:: gpu:gpu_state_update::captured_update gpu:gpu_window_gather::window_gather_graph layout:pool_props::nothing_lost_on_the_gpu gpu:gpu_v41_index::v41_decode_path_on_the_device gpu:gpu_step_batch::}

# Copy the executable a `cargo --message-format=json` build reports on stdin to $1.
executable_to() {
  python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' |
    tail -1 | xargs -r -I{} cp {} "$1"
}

# Build the tests and benches with cargo and copy them into one folder (tests/, benches/, bin/).
build_into() {
  local dir=$1
  mkdir -p "$dir/tests" "$dir/benches" "$dir/bin"
  cargo build --release --bin v4pool
  cp target/release/v4pool "$dir/bin/v4pool"
  echo "$root/target/release/v4pool" > "$dir/bin-path"
  local t b
  # Each suite once, whichever entries name it.
  for t in $(for e in $tests; do echo "${e%%:*}"; done | sort -u); do
    [ "$t" = none ] && continue
    cargo test --release --no-run --test "$t" --message-format=json 2>/dev/null | executable_to "$dir/tests/$t"
  done
  for b in $benches; do
    [ "$b" = none ] && continue
    cargo build --release --bench "$b" --message-format=json 2>/dev/null | executable_to "$dir/benches/$b"
  done
}
if [ -n "$pack" ]; then build_into "$pack"; echo "packed into $pack"; exit 0; fi
if [ -z "$bins" ]; then bins=$(mktemp -d); build_into "$bins" > "$out.build.log" 2>&1 || { echo "build failed: $out.build.log"; exit 1; }; fi

mkdir -p "$out"
export V4POOL_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && export V4POOL_REQUIRE_GPUS=2
if p=$(cat "$bins/bin-path" 2>/dev/null); then mkdir -p "$(dirname "$p")" && cp "$bins/bin/v4pool" "$p"; fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; } | tee "$out/summary.txt"
rc=0
if [ "$phase" != bench ]; then
  for e in $tests; do
    [ "$e" = none ] && continue
    t=${e%%:*}; f=""; [ "$t" != "$e" ] && f=${e#*:}
    n=${f%::}; n=${n//::/.}; n=${n:-$t}
    [ -x "$bins/tests/$t" ] || { echo "missing $t" | tee -a "$out/summary.txt"; rc=1; continue; }
    s=$(date +%s)
    if timeout 150 "$bins/tests/$t" --include-ignored $f > "$out/t-$n.log" 2>&1; then r=ok; else r="FAILED rc=$?"; rc=1; fi
    echo "$r $e ($(( $(date +%s)-s ))s): $(grep -E '^test result|SKIP' "$out/t-$n.log" | tail -1)" | tee -a "$out/summary.txt"
  done
  if [ -n "$wheels" ]; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl > "$out/py.log" 2>&1
    PYTHONPATH=$site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu_torch.py >> "$out/py.log" 2>&1 || rc=1
    echo "pytest gpu: $(tail -1 "$out/py.log")" | tee -a "$out/summary.txt"
  fi
  if command -v compute-sanitizer >/dev/null; then
    for m in $memcheck; do
      [ "$m" = none ] && continue
      b=${m%%:*}; f=""; [ "$b" != "$m" ] && f=${m#*:}
      n=${f%::}; n=${n//::/.}; n=${n:-$b}
      [ -x "$bins/tests/$b" ] || continue
      timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 "$bins/tests/$b" $f > "$out/mc-$n.log" 2>&1 || rc=1
      echo "memcheck $m: $(grep -E 'ERROR SUMMARY' "$out/mc-$n.log" | tail -1)" | tee -a "$out/summary.txt"
    done
  else
    echo "SKIP memcheck: compute-sanitizer not on PATH" | tee -a "$out/summary.txt"
  fi
fi
if [ "$phase" != tests ]; then
  : > "$out/bench.log"
  for b in $benches; do
    [ "$b" = none ] && continue
    [ -x "$bins/benches/$b" ] || { echo "missing bench $b" | tee -a "$out/summary.txt"; continue; }
    timeout 150 "$bins/benches/$b" --bench >> "$out/bench.log" 2>&1; echo "bench $b rc=$?" | tee -a "$out/summary.txt"
  done
  "$bins/bin/v4pool" simulate --backend cuda --no-progress --svg "$out/simulate.svg" > "$out/simulate.txt" 2>&1
  echo "simulate rc=$?" | tee -a "$out/summary.txt"
  if [ -n "$peer" ]; then
    p=$(cd "$peer" && pwd); pj=$(mktemp -d)
    OUT=$pj ATOM_PEER_DIR=$p timeout 170 python3 "$p/atom_peer_bench.py" > "$out/peer.log" 2>&1
    OUT=$pj ATOM_PEER_DIR=$p timeout 45 python3 scripts/atom-peer-extra.py >> "$out/peer.log" 2>&1
    OUT=$pj ATOM_PEER_DIR=$p timeout 120 python3 scripts/atom-peer-state.py >> "$out/peer.log" 2>&1
    cp "$pj"/*.json "$out/" 2>/dev/null
    python3 scripts/peer-table.py "$out/bench.log" "$pj/atom_peer_h200.json" "$pj/atom_peer_extra.json" \
      "$pj/atom_peer_state.json" > "$out/peer-table.txt" 2>&1
    cat "$out/peer-table.txt"
  fi
  if [ -n "$ncu" ] && command -v ncu >/dev/null; then
    timeout 120 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section MemoryWorkloadAnalysis --section WarpStateStats -k regex:'v4pool_(decode|prefill|csa)' \
      "$bins/benches/gpu" --profile-shapes > "$out/ncu.txt" 2>&1
    echo "ncu rc=$?" | tee -a "$out/summary.txt"
  fi
fi
echo "gpu-check rc=$rc" | tee -a "$out/summary.txt"
exit $rc
