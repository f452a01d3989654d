#!/usr/bin/env bash
# One device session on the GPU machine, after `../shared/gpu/pack --benches` and
# `scripts/gpu-session.sh --prepare` here. Runs every packed test with the GPU required, every
# bench, compute-sanitizer memcheck over the GPU tests, and `v4pool simulate` on CUDA.
# Logs and the simulate SVG/JSON go to $OUT (the device tool brings them back).
set -u
if [ "${1:-}" = "--prepare" ]; then
  # Here (build machine): ship the release CLI too, and remember the path the cli tests
  # were compiled to look for it at (cargo bakes CARGO_BIN_EXE_v4pool in).
  root=$(git rev-parse --show-toplevel)
  mkdir -p "$root/.gpu/bin"
  cp "$root/target/release/v4pool" "$root/.gpu/bin/v4pool"
  echo "$root/target/release/v4pool" > "$root/.gpu/bin-path"
  exit 0
fi
out=${OUT:-.gpu/out}; mkdir -p "$out"
export V4POOL_REQUIRE_GPU=1
if p=$(cat .gpu/bin-path 2>/dev/null); then mkdir -p "$(dirname "$p")" && cp .gpu/bin/v4pool "$p"; fi
date -u
# .gpu/run writes a log per binary; keep them aside and bring back a few concatenations
# (the device tool returns at most 8 files).
logs=$(mktemp -d)
OUT=$logs bash .gpu/run > "$out/run.log" 2>&1; rc=$?
cat "$logs"/bench-*.log > "$out/bench.log" 2>/dev/null
for f in "$logs"/*.log; do case $f in */bench-*) ;; *) echo "##### $f"; cat "$f";; esac; done > "$out/tests.log"
grep -E "^(ok|FAILED) |passed, .* failed|MET|SKIP" "$out/run.log" | head -60
echo "== memcheck"
for t in gpu_kernels:240 gpu_graph:120 gpu_backend:90 pool_props:90; do
  name=${t%%:*}; limit=${t##*:}
  filter=""; [ "$name" = pool_props ] && filter=nothing_lost_on_the_gpu
  timeout "$limit" compute-sanitizer --tool memcheck --error-exitcode 1 ".gpu/tests/$name" $filter \
    > "$logs/memcheck-$name.log" 2>&1
  echo "memcheck $name: rc=$? $(grep -E 'ERROR SUMMARY' "$logs/memcheck-$name.log" | tail -1)"
  { echo "##### $name"; tail -60 "$logs/memcheck-$name.log"; } >> "$out/memcheck.log"
done
echo "== simulate on CUDA"
.gpu/bin/v4pool simulate --backend cuda --no-progress --svg "$out/simulate.svg" > "$out/simulate.txt" 2>&1
tail -22 "$out/simulate.txt"
.gpu/bin/v4pool simulate --backend cuda --mix chat --no-progress --json > "$out/simulate-chat.json" 2>/dev/null
echo "run.log rc=$rc"
exit $rc
