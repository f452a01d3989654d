#!/usr/bin/env bash
# Pack what a machine without network needs to run the NIXL tests: the libraries of the pinned
# nixl-cu13 1.5.1 wheel that libnixl_capi.so, its UCX plugin and UCX's CUDA / CMA transports,
# and its POSIX plugin (the shared tier's files: libaio, liburing) load (about 47 MB, 8 MB
# as .tar.xz), into OUT (a path of the caller's; default
# .gpu/nixl-1.5.1.tar.xz of the checkout). Unpack there and point V4POOL_NIXL_LIB at
# <dir>/.nixl_cu13.mesonpy.libs/libnixl_capi.so (docs/nixl.md; scripts/nixl-gpu.sh does it).
# Reuses the wheel .ci/run downloads (same pin, same sha256).
#
#   scripts/nixl-bundle.sh [OUT]
set -euo pipefail
# OUT made absolute before anything changes directory (the archive is written from a
# staging folder).
case ${1:-} in
  "") out=$(cd "$(dirname "$0")/.." && pwd)/.gpu/nixl-1.5.1.tar.xz ;;
  /*) out=$1 ;;
  *) out=$PWD/$1 ;;
esac
cd "$(dirname "$0")/.."
whl=nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl
sha=6279834382eeabab60bfc2fe62c2363cda3bf520278bbd4a007932cc76073de5
dir=$PWD/target/nixl-1.5.1
mkdir -p "$dir" "$(dirname "$out")"
if ! echo "$sha  $dir/$whl" | sha256sum -c --quiet - >/dev/null 2>&1; then
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$dir" nixl-cu13==1.5.1
  echo "$sha  $dir/$whl" | sha256sum -c --quiet -
fi
stage=$(mktemp -d)
python3 - "$dir/$whl" "$stage" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith((".nixl_cu13.mesonpy.libs/", "nixl_cu13.libs/")):
            z.extract(n, sys.argv[2])
PY
cd "$stage"
m=.nixl_cu13.mesonpy.libs
roots="$m/libnixl_capi.so $m/plugins/libplugin_UCX.so $m/plugins/libplugin_POSIX.so
  nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0
  nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0 nixl_cu13.libs/ucx/libuct_cma.so.0.0.0"
# The roots and every library of the wheel they load (ldd resolves through their RPATHs;
# the CUDA driver and runtime they name come from the target machine).
keep=$( (for r in $roots; do echo "$r"; ldd "$r" | awk -v s="$stage/" '$3 ~ s {print $3}'; done) \
  | while read -r f; do realpath --relative-to="$stage" "$f"; done | sort -u)
tar -cJf "$out" $keep
cd "$OLDPWD"
rm -rf "$stage"
ls -la "$out"
