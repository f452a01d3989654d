#!/usr/bin/env bash
# The shared-tier bench (benches/shared_tier.rs) on a GPU machine without network or Rust.
#
#   scripts/tier-bench-gpu.sh --pack [DIR]    (here: build, strip, bundle NIXL into DIR)
#   bash DIR/tier-bench.sh [bench args]       (there, after copying DIR; e.g. --dir /tmp)
#
# DIR (default .gpu/ of the checkout, which .gitignore leaves out) receives benches/shared_tier
# (the stripped bench, ~3 MB), nixl-1.5.1.tar.xz (scripts/nixl-bundle.sh: libnixl_capi.so,
# the POSIX and UCX plugins and the wheel's libraries they load, ~8 MB; 47 MB unpacked) and
# tier-bench.sh, which writes its log to $V4POOL_BENCH_LOG_DIR (default DIR/out). It builds one
# bench, not every test binary. nvcc must be on PATH for build.rs (the sm_90 cubin); the build
# refuses to pack without it.
set -euo pipefail
[ "${1:-}" = "--pack" ] || { echo "usage: $0 --pack [DIR] (see the header)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
# DIR made absolute before changing directory.
case ${2:-} in
  "") pack=$root/.gpu ;;
  /*) pack=$2 ;;
  *) pack=$PWD/$2 ;;
esac
cd "$root"
command -v nvcc >/dev/null || { echo "nvcc not on PATH: the bench would carry no sm_90 cubin" >&2; exit 1; }
mkdir -p "$pack/benches"
exe=$(cargo bench --bench shared_tier --no-run --message-format=json-render-diagnostics \
  | python3 -c 'import json,sys
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "shared_tier":
        print(m["executable"])')
cp "$exe" "$pack/benches/shared_tier" && strip "$pack/benches/shared_tier"
bash scripts/nixl-bundle.sh "$pack/nixl-1.5.1.tar.xz" >/dev/null
cat > "$pack/tier-bench.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the packed shared-tier bench with the GPU and NIXL required; the log goes to
# $V4POOL_BENCH_LOG_DIR (default: out/ beside this script).
set -u
here=$(cd "$(dirname "$0")" && pwd)
lib=$(mktemp -d)
tar -xJf "$here/nixl-1.5.1.tar.xz" -C "$lib" || exit 1
export V4POOL_NIXL_LIB=$lib/.nixl_cu13.mesonpy.libs/libnixl_capi.so V4POOL_REQUIRE_NIXL=1
export V4POOL_REQUIRE_GPU=1 RUST_BACKTRACE=1
unset NIXL_ETCD_ENDPOINTS NIXL_TCPSTORE_ENDPOINT
out=${V4POOL_BENCH_LOG_DIR:-$here/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
df -h "${TMPDIR:-/tmp}" | tail -1
"$here/benches/shared_tier" --bench "$@" 2>&1 | tee "$out/bench-shared_tier.log"
rc=${PIPESTATUS[0]}
rm -rf "$lib"
exit "$rc"
RUN
chmod +x "$pack/tier-bench.sh"
du -sh "$pack" | sed 's/^/packed size: /'
echo "next: copy $pack to the GPU machine and run \"bash <copy>/tier-bench.sh --dir /tmp\" there"
