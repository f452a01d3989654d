#!/usr/bin/env bash
# One device call for the index-builder performance work (issue 13), after
# `../shared/gpu/pack --benches` and `../shared/bench/setup-atom-peer <ATOM git dir> .gpu/peer`
# here; run on the GPU machine with carry [".gpu"]. Runs the kernel GPU tests with the GPU
# required, the GPU bench, ROCm/ATOM's peer bench in the same call, the side-by-side table,
# and Nsight Compute on each index kernel. Everything lands in $OUT.
set -u
out=${OUT:-.gpu/out}; mkdir -p "$out"
export V4POOL_REQUIRE_GPU=1
date -u | tee "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$out/summary.txt"
for t in gpu_kernels gpu_graph gpu_backend index_emulated kernel_layout; do
  [ -x ".gpu/tests/$t" ] || continue
  if ".gpu/tests/$t" >"$out/test-$t.log" 2>&1; then r=ok; else r=FAILED; fi
  echo "$r $t: $(grep -E '^test result' "$out/test-$t.log" | tail -1)" | tee -a "$out/summary.txt"
  [ $r = FAILED ] && tail -30 "$out/test-$t.log"
done
timeout 300 .gpu/benches/gpu --bench > "$out/bench.log" 2>&1; echo "bench rc=$?" | tee -a "$out/summary.txt"
if [ -d .gpu/peer ]; then
  ATOM_PEER_DIR=$PWD/.gpu/peer timeout 240 python3 .gpu/peer/atom_peer_bench.py > "$out/peer.log" 2>&1
  echo "peer rc=$?" | tee -a "$out/summary.txt"
  ATOM_PEER_DIR=$PWD/.gpu/peer timeout 60 python3 scripts/atom-peer-extra.py >> "$out/peer.log" 2>&1
  echo "peer extra rc=$?" | tee -a "$out/summary.txt"
fi
python3 scripts/peer-table.py "$out/bench.log" "$out/atom_peer_h200.json" "$out/atom_peer_extra.json" \
  > "$out/peer-table.txt" 2>&1
cat "$out/peer-table.txt"
grep -A12 "^TARGETS" "$out/bench.log"
# Nsight Compute: one launch of each index kernel at the shapes that matter.
if command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis -k regex:'v4pool_(decode|prefill|csa)' \
    .gpu/benches/gpu --profile-shapes > "$out/ncu.txt" 2>&1
  echo "ncu rc=$?" | tee -a "$out/summary.txt"
fi
