#!/usr/bin/env bash
# The GPU bundle's no-GPU smoke in a bare Debian: a minbase bookworm chroot
# made with debootstrap, holding none of the project's packages (no
# python3, no gRPC, abseil, OpenBLAS, CUDA). The archive is unpacked into
# it, its runner runs there, and check_report.py asserts the report: the
# daemon started, a CPU job stepped, the gpu tests and GPU checks report
# skipped, the Python checks skipped for want of python3.
#
#   chroot_smoke.sh --archive FILE --work DIR [--fresh]
#
#   --work DIR   where the chroot lives (in the build directory); the
#                debootstrapped tree is kept there as bookworm-minbase.tar
#                and reused, the chroot itself is unpacked fresh each run
#   --fresh      debootstrap again even if the tarball exists
# Needs root (chroot, mount) and, for debootstrap, deb.debian.org
# ($CANZONA_DEBIAN_MIRROR overrides). Exit status 77: not root.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

archive=""
work=""
fresh=0
while (($#)); do
  case "$1" in
    --archive) archive="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --fresh) fresh=1; shift ;;
    *) echo "chroot_smoke.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ -z "$archive" || -z "$work" ]]; then
  echo "usage: chroot_smoke.sh --archive FILE --work DIR [--fresh]" >&2
  exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "chroot_smoke.sh: needs root (chroot, mount)" >&2
  exit 77
fi
command -v debootstrap >/dev/null || { echo "chroot_smoke.sh: debootstrap is not installed" >&2; exit 1; }
mkdir -p "$work"
work="$(cd "$work" && pwd)"
archive="$(cd "$(dirname "$archive")" && pwd)/$(basename "$archive")"
start=$SECONDS

base="$work/bookworm-minbase.tar"
if ((fresh)) || [[ ! -s "$base" ]]; then
  t0=$SECONDS
  rm -rf "$work/debootstrap"
  timeout -k 10 900 debootstrap --variant=minbase bookworm "$work/debootstrap" \
    "${CANZONA_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$work/debootstrap.log" 2>&1 ||
    { tail -n 20 "$work/debootstrap.log" >&2; echo "chroot_smoke.sh: debootstrap failed" >&2; exit 1; }
  tar -C "$work/debootstrap" -cf "$base.tmp" .
  mv "$base.tmp" "$base"
  rm -rf "$work/debootstrap"
  echo "chroot_smoke.sh: debootstrap (minbase bookworm) took $((SECONDS - t0)) s"
fi

root="$work/chroot"
mounts=()
cleanup() {
  local i m
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[i]}" 2>/dev/null || true; done
  # Mounts a killed earlier run left behind, deepest first.
  for m in $(awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
cleanup
mkdir -p "$root"
tar -C "$root" -xf "$base"

# Bare: none of the project's packages (Debian's or CUDA) is installed.
project="$(chroot "$root" dpkg-query -W -f='${Package}\n' |
  grep -E '^(python3|libpython3|libgrpc|libabsl|libopenblas|liblapack|libprotobuf|libgloo|libspdlog|libfmt|libgtest|libbenchmark|libcivetweb|libgfortran|libnvidia|cuda|nvidia)' || true)"
if [[ -n "$project" ]]; then
  echo "chroot_smoke.sh: the chroot is not bare: $project" >&2
  exit 1
fi
[[ ! -e "$root/usr/local/cuda" ]] || { echo "chroot_smoke.sh: CUDA in the chroot" >&2; exit 1; }

# Unpacked from outside: minbase has tar but no xz.
mkdir -p "$root/opt"
tar -C "$root/opt" -xJf "$archive"
mount -t proc proc "$root/proc" && mounts+=("$root/proc")
mount -t tmpfs -o mode=1777 shm "$root/dev/shm" && mounts+=("$root/dev/shm")

t0=$SECONDS
rc=0
timeout -k 10 420 chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root TMPDIR=/tmp /opt/canzona-bundle/run.sh /tmp/report --budget 300 \
  >"$work/chroot-run.log" 2>&1 || rc=$?
echo "chroot_smoke.sh: the runner exited $rc after $((SECONDS - t0)) s in the chroot"
rm -rf "$work/chroot-report"
cp -r "$root/tmp/report" "$work/chroot-report" 2>/dev/null || true
gpu_tests=$(find "$root/opt/canzona-bundle/tests" -maxdepth 1 -type f -perm -u+x | wc -l)
if ! python3 "$here/check_report.py" "$work/chroot-report" --no-python --gpu-tests "$gpu_tests"; then
  cat "$work/chroot-run.log" >&2
  echo "chroot_smoke.sh: FAIL (report: $work/chroot-report)" >&2
  exit 1
fi
echo "chroot_smoke.sh: PASS in $((SECONDS - start)) s (report: $work/chroot-report/report.md)"
