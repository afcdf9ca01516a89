#!/usr/bin/env bash
# Builds and packs the Canzona GPU bundle: one archive (tar.xz, < 60 MiB)
# that runs every GPU check on a machine where nothing can be built
# (tests/gpu/bundle/README.md).
#
#   tests/gpu/bundle/make_bundle.sh [--build-dir DIR] [--out FILE] [--no-build] [--jobs N]
#
#   --build-dir DIR   CMake build directory (default: <repo>/build); configured
#                     here if needed, reused if it exists
#   --out FILE        the archive (default: DIR/bundle/canzona-bundle.tar.xz)
#   --no-build        pack what DIR holds (fails if a file is missing)
#
# Inside canzona-bundle/: run.sh (the runner); bin/ canzonad, canzonactl,
# tp_mlp_trainer, canzona-bundle-report, canzona-bridge (the Python
# package's transport where grpcio is missing); tests/ every gpu-labelled
# gtest binary; bench/ the GPU benchmarks; lib/ the shared libraries they
# load except glibc's and CUDA's (elf_closure.sh), and lib/cuda-stubs/
# stand-ins for the CUDA ones (make_cuda_stubs.sh); share/canzona/models/
# the model configs; python/ the canzona package; examples/ the Python
# example trainer; checks/ the torch scripts. Binaries are stripped and
# find lib/ through their RPATH ($ORIGIN/../lib).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
source "$root/deploy/lib/deps.sh"
source "$here/elf_closure.sh"

build="$root/build"
out=""
do_build=1
jobs="${CANZONA_JOBS:-$(nproc)}"
max_bytes=$((60 * 1024 * 1024))
while (($#)); do
  case "$1" in
    --build-dir) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --jobs) jobs="$2"; shift 2 ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "make_bundle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$build"
build="$(cd "$build" && pwd)"
out="${out:-$build/bundle/canzona-bundle.tar.xz}"
start=$SECONDS

if ((do_build)); then
  canzona_install_deps
  canzona_cuda_path
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; exit 1; }
fi
manifest="$build/bundle/manifest.txt"
if [[ ! -f "$manifest" ]]; then
  echo "make_bundle.sh: $manifest missing: configure $build first (or drop --no-build)" >&2
  exit 1
fi
if ! grep -qx 'config cuda ON' "$manifest"; then
  echo "make_bundle.sh: $build is configured without CUDA (CANZONA_ENABLE_CUDA=OFF); the bundle needs the cuda backend" >&2
  exit 1
fi
# manifest.txt (tests/gpu/bundle/CMakeLists.txt): "<kind> <target> <file>".
mapfile -t targets < <(awk '$1 == "bin" || $1 == "test" || $1 == "bench" {print $2}' "$manifest")
if ((do_build)); then
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
fi

stage="$build/bundle/stage"
top="$stage/canzona-bundle"
rm -rf "$stage"
mkdir -p "$top"/{bin,tests,bench,lib/cuda-stubs,share/canzona/bundle,share/canzona/models,checks,python,examples}

# Our executables: copied, stripped of their debug info, RPATH to lib/.
ours=()
built=()
while read -r kind target file; do
  case "$kind" in
    bin) dest="$top/bin" ;;
    test) dest="$top/tests" ;;
    bench) dest="$top/bench" ;;
    *) continue ;;
  esac
  if [[ ! -x "$file" ]]; then
    echo "make_bundle.sh: $target is not built ($file)" >&2
    exit 1
  fi
  name="$(basename "$file")"
  cp "$file" "$dest/$name"
  strip --strip-debug "$dest/$name"
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$dest/$name"
  ours+=("$dest/$name")
  built+=("$file")
done <"$manifest"

# Their closure (resolved on the build's files, with the build's RPATHs): every
# library but glibc's and CUDA's, by soname, RPATH to its own folder.
canzona_resolve bundled "${built[@]}" >"$stage/closure.txt" ||
  { echo "make_bundle.sh: a library the binaries need is not found here" >&2; exit 1; }
mapfile -t closure <"$stage/closure.txt"
for line in "${closure[@]}"; do
  soname="${line%% *}"
  cp -L "${line#* }" "$top/lib/$soname"
  chmod u+w "$top/lib/$soname"
  strip --strip-unneeded "$top/lib/$soname"
  patchelf --force-rpath --set-rpath '$ORIGIN' "$top/lib/$soname"
done

# The CUDA libraries the runner must find on the target: what our binaries
# need, and what those need in turn (libcusolver needs libcusparse and
# libnvJitLink), by soname; and stand-ins for the direct ones.
canzona_resolve cuda "${built[@]}" | awk '{print $1}' | sort -u | paste -sd' ' \
  >"$top/share/canzona/bundle/cuda-libs.txt"
"$here/make_cuda_stubs.sh" "$top/lib/cuda-stubs" "${built[@]}"

cp "$root"/server/plan/models/*.json "$top/share/canzona/models/"
cp "$here/tiny_model.json" "$top/share/canzona/bundle/tiny-model.json"
cp "$here/run.sh" "$top/run.sh"
cp "$here/runner_checks.sh" "$here/runner_environment.sh" "$top/share/canzona/bundle/"
cp "$here/probe_python.py" "$root/tests/gpu/torch_ns_bench.py" "$root/tests/gpu/torch_check.py" \
  "$root/tests/gpu/torch_step_bench.py" "$top/checks/"

# The Python package (pure Python, its gRPC stubs committed) and its
# pyproject, without caches or build leftovers; its one compiled helper is
# bin/canzona-bridge.
tar -C "$root/client/python" --exclude='__pycache__' --exclude='*.pyc' \
  --exclude='build' --exclude='*.egg-info' -cf - . | tar -C "$top/python" -xf -
for example in "$root"/client/examples/*.py; do
  [[ -f "$example" ]] && cp "$example" "$top/examples/"
done

commit="$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then commit="$commit+modified"; fi
{
  echo "version=$(awk '$1 == "version" {print $2}' "$manifest")"
  echo "commit=$commit"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(getconf GNU_LIBC_VERSION)"
  echo "compiler=$(awk '$1 == "compiler" {$1 = ""; print substr($0, 2)}' "$manifest")"
  echo "cuda_toolkit=$(awk '$1 == "cuda" {$1 = ""; print substr($0, 2)}' "$manifest")"
  # The newest glibc symbol version any file needs: the target's glibc
  # must be at least this.
  echo "needs_glibc=$(for f in "${ours[@]}" "$top"/lib/*.so*; do objdump -T "$f" 2>/dev/null; done |
    grep -o 'GLIBC_[0-9.]*' | sort -u -V | tail -n1)"
} >"$top/share/canzona/bundle/info.txt"
(cd "$top" && find . -type f | sort) >"$top/share/canzona/bundle/files.txt"

mkdir -p "$(dirname "$out")"
tar -C "$stage" --owner=0 --group=0 --sort=name -cf - canzona-bundle | xz -T "$jobs" -3 >"$out.tmp"
mv "$out.tmp" "$out"
bytes=$(stat -c %s "$out")
echo "make_bundle.sh: $out: $((bytes / 1024)) KiB ($(du -sk "$top" | cut -f1) KiB unpacked):" \
  "$(ls "$top/bin" | wc -l) programs, $(ls "$top/tests" | wc -l) gpu test binaries," \
  "$(ls "$top/bench" | wc -l) benchmarks, $(ls "$top"/lib/*.so* | wc -l) libraries," \
  "$(ls "$top"/lib/cuda-stubs/*.so* | wc -l) CUDA stubs, in $((SECONDS - start)) s"
if ((bytes > max_bytes)); then
  echo "make_bundle.sh: the archive is $bytes bytes, over the 60 MiB limit ($max_bytes)" >&2
  exit 1
fi
