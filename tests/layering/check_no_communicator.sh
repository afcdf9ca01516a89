#!/usr/bin/env bash
# check_no_communicator.sh BINARY...
# Fails when a binary links a communicator: Gloo (a NEEDED libgloo), or the
# code of Canzona's Gloo or NCCL communicators (their symbols). Run on the
# step simulator's tests (tests/layering): the simulator shares the NCCL
# communicator's pure uneven choice (canzona_nccl_uneven), nothing more.
set -euo pipefail
status=0
for binary in "$@"; do
  [[ -x "$binary" ]] || { echo "no executable $binary" >&2; exit 2; }
  needed=$(readelf -d "$binary" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  bad_libs=$(grep -E '^libgloo' <<<"$needed" || true)
  bad_symbols=$(nm -C "$binary" | grep -E \
    'canzona::(GlooCommunicator|NcclCommunicator|CreateGlooCommunicator|CreateNcclCommunicator)' |
    awk '{$1=$2=""; print}' | sort -u | head -3 || true)
  if [[ -n "$bad_libs" || -n "$bad_symbols" ]]; then
    echo "$(basename "$binary") links a communicator:" $bad_libs $bad_symbols
    status=1
  else
    echo "$(basename "$binary"): no communicator"
  fi
done
exit $status
