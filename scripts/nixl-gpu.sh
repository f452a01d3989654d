#!/usr/bin/env bash
# The NIXL tests on a GPU machine without network: gpu_transfer_nixl (twice: UCX's own
# transport choice, then cuda_ipc,cuda_copy,tcp) and transfer_nixl (host pools over TCP
# loopback, as in CI), against the pinned NIXL libraries. Logs go to --out.
#
#   scripts/nixl-gpu.sh --bins DIR [--bundle FILE] [--out DIR]
#   scripts/nixl-gpu.sh --pack DIR          (on the build machine)
#
# --bins DIR    DIR/tests/gpu and DIR/tests/tiers, the suite binaries that hold
#               gpu_transfer_nixl and transfer_nixl (and DIR/nixl-1.5.1.tar.xz, the default
#               --bundle).
# --bundle FILE the NIXL libraries packed by scripts/nixl-bundle.sh.
# --out DIR     where the logs go [nixl-gpu-out].
# --pack DIR    build both suite binaries (scripts/gpu-check.sh --pack) and the bundle
#               (scripts/nixl-bundle.sh) into DIR; copy DIR to the GPU machine and pass it as
#               --bins there.
# Relative paths are the caller's. Exit status 0 when every run passed.
set -u
here=$PWD
root=$(cd "$(dirname "$0")/.." && pwd)
abs() { case $1 in /*) echo "$1";; *) echo "$here/$1";; esac; }
bins="" bundle="" out=$here/nixl-gpu-out pack=""
while [ $# -gt 0 ]; do
  case $1 in
    --bins) bins=$(abs "$2"); shift 2;; --bundle) bundle=$(abs "$2"); shift 2;;
    --out) out=$(abs "$2"); shift 2;; --pack) pack=$(abs "$2"); shift 2;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2;;
  esac
done
tests="gpu:gpu_transfer_nixl:: tiers:transfer_nixl::"
if [ -n "$pack" ]; then
  TESTS=$tests BENCHES=none bash "$root/scripts/gpu-check.sh" --pack "$pack" || exit 1
  bash "$root/scripts/nixl-bundle.sh" "$pack/nixl-1.5.1.tar.xz" || exit 1
  echo "packed into $pack"
  exit 0
fi
[ -n "$bins" ] || { echo "--bins DIR is required (see the header of $0)" >&2; exit 2; }
bundle=${bundle:-$bins/nixl-1.5.1.tar.xz}
for f in "$bundle" "$bins/tests/gpu" "$bins/tests/tiers"; do
  [ -f "$f" ] || { echo "missing $f (see the header of $0)" >&2; exit 2; }
done
mkdir -p "$out"
lib=$(mktemp -d)
tar -xJf "$bundle" -C "$lib" || exit 1
export V4POOL_NIXL_LIB=$lib/.nixl_cu13.mesonpy.libs/libnixl_capi.so V4POOL_REQUIRE_NIXL=1 V4POOL_REQUIRE_GPU=1
export UCX_MODULES='^ib*' RUST_BACKTRACE=1
unset NIXL_ETCD_ENDPOINTS NIXL_TCPSTORE_ENDPOINT
# UCX's CUDA memory hooks (libucm_cuda) want libcudart.so.13; the driver libraries are on the
# system path.
for d in /usr/local/cuda/lib64 /usr/local/cuda-13.0/lib64; do
  [ -d "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} && break
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
rc=0
# One test file's run (its suite binary and filter): its log, then the lines a reader needs.
run() {
  local log=$out/$1.log; shift
  "$@" --nocapture --test-threads 1 > "$log" 2>&1 || rc=1
  grep -E "nixl-[a-z0-9-]+:|SKIP|test result|panicked" "$log" | cut -c1-200
}
echo "== gpu_transfer_nixl (UCX chooses its transports; protocol selection in $out/gpu_transfer_nixl.log)"
UCX_PROTO_INFO=y run gpu_transfer_nixl "$bins/tests/gpu" gpu_transfer_nixl::
grep -oE "(cuda_ipc|cuda_copy|tcp|posix|sysv|cma)/[A-Za-z0-9_:.-]+" "$out/gpu_transfer_nixl.log" | sort | uniq -c | sort -rn | head -8
echo "== gpu_transfer_nixl, UCX_TLS=cuda_ipc,cuda_copy,tcp"
UCX_TLS=cuda_ipc,cuda_copy,tcp run gpu_transfer_nixl-tls "$bins/tests/gpu" gpu_transfer_nixl::
echo "== transfer_nixl (host pools over UCX TCP loopback, as in CI)"
UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_MEM_EVENTS=no run transfer_nixl "$bins/tests/tiers" transfer_nixl::
rm -rf "$lib"
exit $rc
