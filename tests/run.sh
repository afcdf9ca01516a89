#!/usr/bin/env bash
# Installs what is missing, configures, builds and runs every test.
#   tests/run.sh                 # everything (gpu tests skip without a GPU)
#   BUILD_DIR=out tests/run.sh   # another build directory
#   tests/run.sh -L gpu          # extra arguments go to ctest
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/deploy/lib/deps.sh"
canzona_install_deps
canzona_cuda_path

build="${BUILD_DIR:-$root/build}"
jobs="${CANZONA_JOBS:-$(nproc)}"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "$jobs"
cd "$build"
# OpenBLAS threads compete with ctest's parallel jobs on small machines.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
ctest --output-on-failure -j "$jobs" --timeout 900 "$@"
