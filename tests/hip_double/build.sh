#!/usr/bin/env bash
# Build the HIP runtime double (docs/amd.md, "The HIP runtime double") into the path given
# (default target/hip-double/libv4pool_hip_double.so) with the system C++ compiler ($CXX, else
# clang++-19, clang-19, g++). Prints the library's path.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/hip-double/libv4pool_hip_double.so}
cxx=${CXX:-}
if [ -z "$cxx" ]; then
  for c in clang++-19 clang-19 g++; do
    if command -v "$c" >/dev/null; then cxx=$c; break; fi
  done
fi
[ -n "$cxx" ] || { echo "no C++ compiler (CXX, clang++-19, clang-19, g++)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
# -O1 as the emulation library: the kernels run per thread in loops, and -O0 is slow.
"$cxx" -x c++ -std=c++17 -O1 -g0 -shared -fPIC -pthread -Wall -Wextra -Wno-unused-parameter \
  -o "$out.tmp" tests/hip_double/hip_double.cpp -lstdc++
mv "$out.tmp" "$out"
echo "$PWD/$out"
