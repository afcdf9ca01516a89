#!/usr/bin/env bash
# Installs what is missing, configures, builds and runs every test; then the
# GPU bundle's runner runs in a bare Debian chroot (the bundle stage); then a
# last stage runs the unit tests, the request fuzzer and a short soak
# under AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer.
#   tests/run.sh                 # everything (gpu tests skip without a GPU)
#   BUILD_DIR=out tests/run.sh   # another build directory (and out-asan)
#   tests/run.sh -L gpu          # extra arguments go to ctest in the normal
#                                # tree; the sanitizer stage is then skipped
#   CANZONA_SKIP_SANITIZERS=1 tests/run.sh   # no sanitizer stage
#   CANZONA_SANITIZERS_ONLY=1 tests/run.sh   # only the sanitizer stage
#   CANZONA_SKIP_BUNDLE=1 tests/run.sh       # no bundle stage (bare-chroot
#                                            # smoke of the GPU bundle)
#
# The sanitizer stage (only when no ctest arguments are given) configures
# "$BUILD_DIR-asan" with clang, CANZONA_ENABLE_CUDA=OFF,
# CANZONA_SANITIZE=address,undefined and CANZONA_FUZZ=ON, builds only the
# target canzona_sanitized (the daemon's unit tests, the request fuzzer and
# the soak bench: tests/CMakeLists.txt says which) and runs
# ctest -L sanitized there. Any ASan, LSan or UBSan report fails its test. Suppressions
# (tests/sanitizers/) cover Debian's uninstrumented system libraries only.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/deploy/lib/deps.sh"
canzona_install_deps
canzona_cuda_path

build="${BUILD_DIR:-$root/build}"
jobs="${CANZONA_JOBS:-$(nproc)}"

# Stage times, printed at the end (and on failure): where CI's minutes go.
stage_times=()
stage_start=0
stage_done() {
  stage_times+=("$(printf '%-26s %5d s' "$1" $((SECONDS - stage_start)))")
  stage_start=$SECONDS
}
print_stage_times() {
  ((${#stage_times[@]} > 0)) || return 0
  echo "canzona: stage times"
  printf '  %s\n' "${stage_times[@]}"
  printf '  %-26s %5d s\n' "total" "$SECONDS"
}
trap print_stage_times EXIT
stage_done "install dependencies"
# OpenBLAS threads compete with ctest's parallel jobs on small machines.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"

if [[ "${CANZONA_SANITIZERS_ONLY:-0}" != 1 ]]; then
  mkdir -p "$build"
  # -g1 (line tables, function names): symbolized backtraces, also in the
  # GPU bundle, at 20-40 % less compile time than -g. Unity builds (8 files
  # a translation unit) parse and instantiate the shared headers once per
  # batch instead of once per file: CI's builds take about half the time.
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_UNITY_BUILD=ON \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" >"$build/configure.log" 2>&1 \
    || { cat "$build/configure.log"; exit 1; }
  cmake --build "$build" -j "$jobs"
  stage_done "normal: configure + build"
  (cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900 "$@")
  stage_done "normal: ctest"
fi

# --- Bundle stage ------------------------------------------------------------
# The GPU bundle's runner in a bare Debian (tests/gpu/bundle/chroot_smoke.sh):
# a minbase bookworm chroot (debootstrap; the tree is kept in the build
# directory and reused), the archive the normal stage's canzona_bundle test
# packed, its no-GPU smoke. Needs root and deb.debian.org.
if [[ "${CANZONA_SKIP_BUNDLE:-0}" != 1 && "${CANZONA_SANITIZERS_ONLY:-0}" != 1 ]] && (($# == 0)); then
  bundle_start=$SECONDS
  archive="$build/bundle/canzona-bundle.tar.xz"
  if [[ ! -f "$archive" ]]; then
    "$root/tests/gpu/bundle/make_bundle.sh" --build-dir "$build" --no-build --jobs "$jobs"
  fi
  bundle_rc=0
  "$root/tests/gpu/bundle/chroot_smoke.sh" --archive "$archive" --work "$build/bundle/chroot-smoke" ||
    bundle_rc=$?
  if ((bundle_rc == 77)); then
    echo "canzona: bundle stage skipped (not root)" >&2
  elif ((bundle_rc != 0)); then
    exit "$bundle_rc"
  else
    echo "canzona: bundle stage passed in $((SECONDS - bundle_start)) s"
  fi
  stage_done "bundle: chroot smoke"
fi

if [[ "${CANZONA_SKIP_SANITIZERS:-0}" == 1 ]]; then
  exit 0
fi
if (($# > 0)) && [[ "${CANZONA_SANITIZERS_ONLY:-0}" != 1 ]]; then
  echo "canzona: ctest arguments given; sanitizer stage skipped" >&2
  exit 0
fi

# --- Sanitizer stage -------------------------------------------------------
san_start=$SECONDS
asan="${build%/}-asan"
mkdir -p "$asan"
# -O1 with line tables: symbolized reports at a fraction of -g's build time.
cmake -S "$root" -B "$asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_UNITY_BUILD=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
  -DCANZONA_ENABLE_CUDA=OFF -DCANZONA_SANITIZE=address,undefined -DCANZONA_FUZZ=ON \
  >"$asan/configure.log" 2>&1 || { cat "$asan/configure.log"; exit 1; }
# The sanitized tests (tests/CMakeLists.txt, CANZONA_SANITIZED_FOLDERS): the
# daemon's unit tests, the request fuzzer and the soak bench.
cmake --build "$asan" -j "$jobs" --target canzona_sanitized
stage_done "sanitizers: configure + build"

san_dir="$root/tests/sanitizers"
# The same flags as tests/sanitizers/sanitizer_options.cc compiles in, made
# visible here; a caller's own *SAN_OPTIONS win.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1:check_initialization_order=1:suppressions=$san_dir/asan.supp}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$san_dir/lsan.supp}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Exclusions: tests/sanitizers/known_failures.txt (reported bugs, one
# comment each).
exclude='^$'
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] || exclude+="|$line"
done <"$san_dir/known_failures.txt"
(cd "$asan" && ctest --output-on-failure -j "$jobs" --timeout 900 \
  -L sanitized -E "$exclude")
stage_done "sanitizers: ctest"
echo "canzona: sanitizer stage passed in $((SECONDS - san_start)) s"
