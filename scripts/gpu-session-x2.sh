#!/usr/bin/env bash
# Run after `../shared/gpu/pack --benches`, `scripts/gpu-session.sh --prepare` and a maturin wheel in .gpu/wheels
# (plus pytest wheels in .gpu/pywheels); on nvidia-h200-x2, carry [".gpu"].
# Device call A: GPU tests (GPU required, two GPUs for the transfer), memcheck, Python on torch, transfer + manager benches.
set -u
out=${OUT:-.gpu/out}; mkdir -p "$out"
export V4POOL_REQUIRE_GPU=1 V4POOL_REQUIRE_GPUS=2 NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
if p=$(cat .gpu/bin-path 2>/dev/null); then mkdir -p "$(dirname "$p")" && cp .gpu/bin/v4pool "$p"; fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; } | tee "$out/summary.txt"
for t in gpu_backend gpu_kernels gpu_graph gpu_decode_path gpu_manager gpu_transfer gpu_profiling pool_props decode_step hip_backend manager_exact; do
  [ -x .gpu/tests/$t ] || { echo "missing $t" | tee -a "$out/summary.txt"; continue; }
  s=$(date +%s)
  if timeout 150 .gpu/tests/$t --include-ignored > "$out/t-$t.log" 2>&1; then r=ok; else r="FAILED rc=$?"; fi
  echo "$r $t ($(( $(date +%s)-s ))s): $(grep -E '^test result|SKIP' "$out/t-$t.log" | tail -1)" | tee -a "$out/summary.txt"
done
cat "$out"/t-*.log > "$out/tests.log"; rm -f "$out"/t-*.log
echo "== python (torch)" | tee -a "$out/summary.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/pywheels/*.whl > "$out/py.log" 2>&1
PYTHONPATH=/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu_torch.py >> "$out/py.log" 2>&1
echo "pytest gpu rc=$? $(tail -1 "$out/py.log")" | tee -a "$out/summary.txt"
PYTHONPATH=/tmp/site timeout 60 python3 tests/python/bench_decode_stage.py >> "$out/py.log" 2>&1
echo "py bench rc=$?" | tee -a "$out/summary.txt"; tail -12 "$out/py.log"
echo "== memcheck" | tee -a "$out/summary.txt"
for m in gpu_decode_path gpu_graph gpu_manager; do
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 1 .gpu/tests/$m > "$out/mc-$m.log" 2>&1
  echo "memcheck $m: rc=$? $(grep -E 'ERROR SUMMARY' "$out/mc-$m.log" | tail -1)" | tee -a "$out/summary.txt"
done
cat "$out"/mc-*.log | tail -200 > "$out/memcheck.log"; rm -f "$out"/mc-*.log
echo "== benches" | tee -a "$out/summary.txt"
timeout 120 .gpu/benches/transfer --bench > "$out/bench-transfer.log" 2>&1; echo "transfer bench rc=$?" | tee -a "$out/summary.txt"
tail -30 "$out/bench-transfer.log"
timeout 40 .gpu/benches/manager --bench > "$out/bench-manager.log" 2>&1; echo "manager bench rc=$?" | tee -a "$out/summary.txt"
tail -8 "$out/bench-manager.log"
cat "$out/summary.txt"
