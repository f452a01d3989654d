#!/usr/bin/env bash
# One device call for the index-builder performance work (issue 13), after
# `../shared/gpu/pack --benches` and `../shared/bench/setup-atom-peer <ATOM git dir> .gpu/peer`
# here; run on the GPU machine with carry [".gpu"]. `G=<folder>` runs a packed folder other
# than .gpu, with this script and the peer scripts copied into <folder>/scripts (a helper's
# device call carries the session's checkout, not the helper's worktree). Runs the kernel GPU
# tests with the GPU required, the GPU bench, ROCm/ATOM's peer bench in the same call, the
# side-by-side table, and Nsight Compute on each index kernel; eight files land in $OUT.
set -u
G=${G:-.gpu}
S=${S:-scripts}
out=${OUT:-$G/out}
mkdir -p "$out"
export V4POOL_REQUIRE_GPU=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; } | tee "$out/summary.txt"
for t in ${TESTS:-gpu_kernels gpu_graph}; do
  if timeout 120 "$G/tests/$t" >> "$out/tests.log" 2>&1; then r=ok; else r=FAILED; fi
  echo "$r $t: $(grep -E '^test result' "$out/tests.log" | tail -1)" | tee -a "$out/summary.txt"
done
if [ -n "${MEMCHECK:-}" ]; then
  for m in "gpu_graph" "gpu_kernels csa_translate_pack" "gpu_kernels decode_index_builder" "gpu_kernels prefill_index"; do
    set -- $m
    timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$G/tests/$1" ${2:-} >> "$out/tests.log" 2>&1
    echo "memcheck $m: rc=$? $(grep -E 'ERROR SUMMARY' "$out/tests.log" | tail -1)" | tee -a "$out/summary.txt"
  done
fi
timeout 150 "$G/benches/gpu" --bench > "$out/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$out/summary.txt"
peer=$(mktemp -d)
[ "${PEER:-1}" = 0 ] || OUT=$peer ATOM_PEER_DIR=$PWD/$G/peer timeout 170 python3 "$G/peer/atom_peer_bench.py" > "$out/peer.log" 2>&1
echo "peer rc=$?" | tee -a "$out/summary.txt"
[ "${PEER:-1}" = 0 ] || OUT=$peer ATOM_PEER_DIR=$PWD/$G/peer timeout 45 python3 "$S/atom-peer-extra.py" >> "$out/peer.log" 2>&1
echo "peer extra rc=$?" | tee -a "$out/summary.txt"
cp "$peer"/*.json "$out/" 2>/dev/null
python3 "$S/peer-table.py" "$out/bench.log" "$out/atom_peer_h200.json" "$out/atom_peer_extra.json" > "$out/peer-table.txt" 2>&1
cat "$out/peer-table.txt"
grep -A8 "^TARGETS" "$out/bench.log"
# Nsight Compute: one launch of each index kernel at the shapes that matter (NCU_S=0 skips it,
# PEER=0 skips ATOM's bench: a short confirming call).
[ "${NCU_S:-75}" = 0 ] && exit 0
timeout "${NCU_S:-75}" ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section MemoryWorkloadAnalysis --section WarpStateStats -k regex:'v4pool_(decode|prefill|csa)' \
  "$G/benches/gpu" --profile-shapes > "$out/ncu.txt" 2>&1
echo "ncu rc=$?" | tee -a "$out/summary.txt"
