#!/usr/bin/env bash
# On the GPU machine (no network): the NIXL tests, with the libraries packed here by
# `bash scripts/nixl-bundle.sh` (.gpu/nixl-1.5.1.tar.xz) and the test binaries packed by
# `../shared/gpu/pack` (.gpu/tests/). Run with carry [".gpu"]:  bash scripts/nixl-gpu.sh
# Logs go to $OUT (default .gpu/out).
set -u
out=${OUT:-.gpu/out}; mkdir -p "$out"
lib=$(mktemp -d)
tar -xJf .gpu/nixl-1.5.1.tar.xz -C "$lib" || exit 1
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
echo "== gpu_transfer_nixl (UCX chooses its transports; protocol selection in $out/gpu_transfer_nixl.log)"
UCX_PROTO_INFO=y .gpu/tests/gpu_transfer_nixl --nocapture --test-threads 1 > "$out/gpu_transfer_nixl.log" 2>&1 || rc=1
grep -E "nixl-[a-z0-9-]+:|SKIP|test result|panicked" "$out/gpu_transfer_nixl.log"
grep -oE "(cuda_ipc|cuda_copy|tcp|posix|sysv|cma)/[A-Za-z0-9_:.-]+" "$out/gpu_transfer_nixl.log" | sort | uniq -c | sort -rn | head -8
echo "== gpu_transfer_nixl, UCX_TLS=cuda_ipc,cuda_copy,tcp"
UCX_TLS=cuda_ipc,cuda_copy,tcp .gpu/tests/gpu_transfer_nixl --nocapture --test-threads 1 > "$out/gpu_transfer_nixl-tls.log" 2>&1 || rc=1
grep -E "nixl-[a-z0-9-]+:|SKIP|test result|panicked" "$out/gpu_transfer_nixl-tls.log"
echo "== transfer_nixl (host pools over UCX TCP loopback, as in CI)"
UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_MEM_EVENTS=no .gpu/tests/transfer_nixl --nocapture --test-threads 1 \
  > "$out/transfer_nixl.log" 2>&1 || rc=1
grep -E "nixl-[a-z0-9-]+:|SKIP|test result|panicked" "$out/transfer_nixl.log" | cut -c1-200
rm -rf "$lib"
exit $rc
