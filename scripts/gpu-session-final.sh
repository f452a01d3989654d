#!/usr/bin/env bash
# The session's closing device call (nvidia-h200-x2 where lent), after `../shared/gpu/pack --benches`,
# `scripts/gpu-session.sh --prepare`, a maturin wheel in .gpu/wheels (+ pytest wheels in .gpu/pywheels),
# `../shared/bench/setup-atom-peer <ATOM git dir> .gpu/peer`, ATOM's state_writes.py copied into
# .gpu/peer and scripts/ copied to .gpu/scripts. Carry [".gpu"].
# Runs: every GPU test (GPU required; two GPUs for the transfer), memcheck over the GPU tests,
# Python on torch, the state-kernel benches with ATOM's state kernels in the same call, the
# transfer and manager benches; with BENCHES including gpu and PEER_INDEX=1, the index-builder
# bench with ATOM's peer bench too. Six files come back.
# PHASE=tests (tests, memcheck, pytest) or PHASE=bench (benches and peers); both when unset, which
# can outrun one 10-minute command: split it in two calls of one lease.
set -u
phase=${PHASE:-all}
out=${OUT:-.gpu/out}; mkdir -p "$out"
export V4POOL_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && export V4POOL_REQUIRE_GPUS=2
if p=$(cat .gpu/bin-path 2>/dev/null); then mkdir -p "$(dirname "$p")" && cp .gpu/bin/v4pool "$p"; fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; } | tee "$out/summary.txt"
[ "$phase" = bench ] && TESTS=none MEMCHECK=none
[ "$phase" = tests ] && BENCHES=none
for t in ${TESTS:-gpu_backend gpu_kernels gpu_graph gpu_decode_path gpu_manager gpu_manager_tier gpu_state_update gpu_window_gather gpu_transfer gpu_profiling pool_props decode_step hip_backend manager_exact gpu_v41_index}; do
  [ "$t" = none ] && continue
  [ -x .gpu/tests/$t ] || { echo "missing $t" | tee -a "$out/summary.txt"; continue; }
  s=$(date +%s)
  if timeout 150 .gpu/tests/$t --include-ignored > "$out/t-$t.log" 2>&1; then r=ok; else r="FAILED rc=$?"; fi
  echo "$r $t ($(( $(date +%s)-s ))s): $(grep -E '^test result|SKIP' "$out/t-$t.log" | tail -1)" | tee -a "$out/summary.txt"
done
cat "$out"/t-*.log > "$out/tests.log" 2>/dev/null; rm -f "$out"/t-*.log
if [ "$phase" != bench ]; then
echo "== python (torch)" | tee -a "$out/summary.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/pywheels/*.whl > "$out/py.log" 2>&1
PYTHONPATH=/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu_torch.py >> "$out/py.log" 2>&1
echo "pytest gpu rc=$? $(tail -1 "$out/py.log")" | tee -a "$out/summary.txt"
fi
echo "== memcheck" | tee -a "$out/summary.txt"
# "binary[:test-name filter]" (the filters keep the sanitizer's slowdown to the graph-replay tests).
for m in ${MEMCHECK:-gpu_decode_path gpu_manager gpu_manager_tier gpu_state_update:captured_update gpu_window_gather:window_gather_graph gpu_v41_index:v41_decode_path_on_the_device}; do
  b=${m%%:*}; f=""; [ "$b" != "$m" ] && f=${m#*:}
  [ -x .gpu/tests/$b ] || continue
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 .gpu/tests/$b $f > "$out/mc-$b.log" 2>&1
  echo "memcheck $m: rc=$? $(grep -E 'ERROR SUMMARY' "$out/mc-$b.log" | tail -1)" | tee -a "$out/summary.txt"
done
cat "$out"/mc-*.log 2>/dev/null | tail -300 >> "$out/tests.log"; rm -f "$out"/mc-*.log
echo "== benches" | tee -a "$out/summary.txt"
: > "$out/bench.log"
for b in ${BENCHES:-state_update window_gather transfer manager}; do
  [ "$b" = none ] && continue
  [ -x .gpu/benches/$b ] || { echo "missing bench $b" | tee -a "$out/summary.txt"; continue; }
  timeout 150 .gpu/benches/$b --bench >> "$out/bench.log" 2>&1; echo "bench $b rc=$?" | tee -a "$out/summary.txt"
done
echo "== peer (ROCm/ATOM, same call)" | tee -a "$out/summary.txt"
peer=$(mktemp -d)
if [ -d .gpu/peer ] && [ "$phase" != tests ]; then
  if [ -n "${PEER_INDEX:-}" ]; then  # the index builders' peer, beside BENCHES containing gpu
    OUT=$peer ATOM_PEER_DIR=$PWD/.gpu/peer timeout 170 python3 .gpu/peer/atom_peer_bench.py > "$out/peer.log" 2>&1
    echo "peer rc=$?" | tee -a "$out/summary.txt"
    OUT=$peer ATOM_PEER_DIR=$PWD/.gpu/peer timeout 45 python3 .gpu/scripts/atom-peer-extra.py >> "$out/peer.log" 2>&1
    echo "peer extra rc=$?" | tee -a "$out/summary.txt"
  fi
  OUT=$peer ATOM_PEER_DIR=$PWD/.gpu/peer timeout 120 python3 .gpu/scripts/atom-peer-state.py >> "$out/peer.log" 2>&1
  echo "peer state rc=$?" | tee -a "$out/summary.txt"
  python3 .gpu/scripts/peer-table.py "$out/bench.log" "$peer/atom_peer_h200.json" "$peer/atom_peer_extra.json" \
    "$peer/atom_peer_state.json" > "$out/peer-table.txt" 2>&1
  cat "$out/peer-table.txt"
fi
cat "$out/summary.txt"
