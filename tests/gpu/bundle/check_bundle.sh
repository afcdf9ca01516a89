#!/usr/bin/env bash
# Checks the GPU bundle's archive: its size (< 60 MiB), its layout, its
# library closure (every library an ELF in it needs is inside it, or is
# glibc's or CUDA's), that every program loads with the archive's libraries
# and the CUDA stand-ins alone, and the runner's no-GPU smoke on this
# machine (check_report.py).
#
#   check_bundle.sh --build-dir DIR [--pack] [--archive FILE] [--no-smoke]
#
#   --pack      first pack DIR's binaries (make_bundle.sh --no-build)
#   --archive   the archive (default DIR/bundle/canzona-bundle.tar.xz)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/elf_closure.sh"

build=""
archive=""
pack=0
smoke=1
while (($#)); do
  case "$1" in
    --build-dir) build="$2"; shift 2 ;;
    --archive) archive="$2"; shift 2 ;;
    --pack) pack=1; shift ;;
    --no-smoke) smoke=0; shift ;;
    *) echo "check_bundle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ -z "$build" && -z "$archive" ]]; then
  echo "check_bundle.sh: --build-dir or --archive" >&2
  exit 2
fi
archive="${archive:-$build/bundle/canzona-bundle.tar.xz}"
if ((pack)); then
  # Two xz threads: ctest runs other tests beside this one.
  "$here/make_bundle.sh" --build-dir "$build" --out "$archive" --no-build --jobs 2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/canzona-bundle-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
errors=0
fail() { echo "FAIL: $*" >&2; errors=$((errors + 1)); }

bytes=$(stat -c %s "$archive")
limit=$((60 * 1024 * 1024))
((bytes < limit)) || fail "archive is $bytes bytes, not under 60 MiB ($limit)"
tar -C "$work" -xJf "$archive"
top="$work/canzona-bundle"

# Layout.
for f in run.sh bin/canzonad bin/canzonactl bin/tp_mlp_trainer bin/canzona-bundle-report \
  checks/torch_check.py checks/torch_ns_bench.py checks/torch_step_bench.py checks/probe_python.py \
  share/canzona/models/qwen3-32b.json share/canzona/models/qwen3-0.6b.json \
  share/canzona/models/qwen3-8b.json examples/train_torch.py python/canzona/torch.py \
  share/canzona/bundle/cuda-libs.txt share/canzona/bundle/info.txt \
  share/canzona/bundle/runner_checks.sh share/canzona/bundle/runner_environment.sh; do
  [[ -e "$top/$f" ]] || fail "$f missing"
done
[[ -x "$top/run.sh" ]] || fail "run.sh is not executable"
gpu_tests=$(find "$top/tests" -maxdepth 1 -type f -perm -u+x | wc -l)
if [[ -n "$build" && -f "$build/bundle/manifest.txt" ]]; then
  want=$(grep -c '^test ' "$build/bundle/manifest.txt")
  ((gpu_tests == want)) || fail "$gpu_tests gpu test binaries packed, the build's manifest lists $want"
fi
((gpu_tests > 0)) || fail "no gpu test binary"

# Closure: every NEEDED soname of every ELF is in lib/ or is glibc's / CUDA's;
# the programs' RPATH is $ORIGIN/../lib, the libraries' $ORIGIN; no real
# CUDA library is packed (only the stand-ins in lib/cuda-stubs). Prints
# each problem; sets $elves and $needed_total.
check_closure() {  # TOP -> number of problems as the exit status (capped)
  local top="$1" problems=0 f rel want_rpath soname
  elves=0
  needed_total=0
  while IFS= read -r -d '' f; do
    canzona_is_elf "$f" || continue
    elves=$((elves + 1))
    rel="${f#"$top"/}"
    case "$rel" in
      lib/cuda-stubs/*) want_rpath="" ;;
      lib/*) want_rpath='$ORIGIN' ;;
      *) want_rpath='$ORIGIN/../lib' ;;
    esac
    if [[ "$(canzona_rpath "$f")" != "$want_rpath" ]]; then
      echo "$rel: RPATH '$(canzona_rpath "$f")', expected '$want_rpath'"
      problems=$((problems + 1))
    fi
    if [[ "$rel" == lib/* && "$rel" != lib/cuda-stubs/* &&
      "$(canzona_lib_class "$(basename "$f")")" != bundled ]]; then
      echo "$rel: a $(canzona_lib_class "$(basename "$f")") library is packed"
      problems=$((problems + 1))
    fi
    while read -r soname; do
      needed_total=$((needed_total + 1))
      case "$(canzona_lib_class "$soname")" in
        glibc) ;;
        cuda)
          if [[ "$rel" != lib/* && ! -e "$top/lib/cuda-stubs/$soname" ]]; then
            echo "$rel needs $soname, which has no stand-in in lib/cuda-stubs"
            problems=$((problems + 1))
          fi
          ;;
        bundled)
          if [[ ! -e "$top/lib/$soname" ]]; then
            echo "$rel needs $soname, not in lib/"
            problems=$((problems + 1))
          fi
          ;;
      esac
    done < <(canzona_needed "$f")
  done < <(find "$top" -type f -print0)
  return $((problems > 100 ? 100 : problems))
}

closure_rc=0
check_closure "$top" >"$work/closure.txt" || closure_rc=$?
((closure_rc == 0)) || fail "library closure: $(cat "$work/closure.txt")"
elves_checked=$elves
needed_checked=$needed_total
# Negative control: the same check must notice a library taken out.
victim="$(find "$top/lib" -maxdepth 1 -name 'libprotobuf.so*' | head -n1)"
if [[ -n "$victim" ]]; then
  mv "$victim" "$work/victim.so"
  if check_closure "$top" >"$work/closure-negative.txt"; then
    fail "the closure check did not notice $(basename "$victim") missing"
  fi
  mv "$work/victim.so" "$victim"
fi

# Loading: with the archive's libraries and the stand-ins only (no CUDA
# here on the path, no project library from this machine), every program
# resolves every symbol, and every non-glibc library comes from the archive.
loaded=0
for f in "$top"/bin/* "$top"/tests/* "$top"/bench/*; do
  canzona_is_elf "$f" || continue
  out="$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$top/lib/cuda-stubs" ldd -r "$f" 2>&1)" ||
    fail "${f#"$top"/}: ldd failed: $out"
  if grep -E 'not found|undefined symbol' <<<"$out" >&2; then
    fail "${f#"$top"/}: does not load from the archive alone"
  fi
  while read -r soname path; do
    [[ "$(canzona_lib_class "$soname")" == glibc ]] && continue
    [[ "$path" == "$top"/* ]] || fail "${f#"$top"/}: $soname loads from $path, outside the archive"
  done < <(sed -n 's/^[[:space:]]*\([^ ]*\) => \(\/[^ ]*\) .*/\1 \2/p' <<<"$out")
  loaded=$((loaded + 1))
done

echo "check_bundle.sh: $archive: $((bytes / 1024)) KiB; $elves_checked ELF files, $needed_checked NEEDED" \
  "entries checked (a library taken out is noticed); $loaded programs load from the archive alone;" \
  "$(ls "$top"/lib/*.so* | wc -l) libraries, $(ls "$top"/lib/cuda-stubs/*.so* | wc -l) CUDA stand-ins," \
  "$gpu_tests gpu test binaries; needs CUDA: $(cat "$top/share/canzona/bundle/cuda-libs.txt")"

if ((smoke)) && ((errors == 0)); then
  start=$SECONDS
  "$top/run.sh" "$work/report" --budget 300 >"$work/run.log" 2>&1 || true
  if python3 "$here/check_report.py" "$work/report" --gpu-tests "$gpu_tests"; then
    echo "check_bundle.sh: runner smoke passed on this machine in $((SECONDS - start)) s"
  else
    cat "$work/run.log" >&2
    fail "runner smoke"
  fi
fi
if ((errors)); then
  echo "check_bundle.sh: $errors failure(s)" >&2
  exit 1
fi
echo "PASS"
