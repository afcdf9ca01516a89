#!/usr/bin/env bash
# check_no_gpu_libraries.sh BINARY...
# Fails when a binary depends on a GPU library: a NEEDED entry for the CUDA
# runtime or driver, cuBLAS, cuSOLVER, cuSPARSE or NCCL, or a linked-in
# symbol of theirs (the static CUDA runtime leaves no NEEDED entry). Run on
# the tests of the libraries that must not link CUDA (tests/layering).
set -euo pipefail
gpu_libs='^lib(cudart|cuda|cublas|cublasLt|cusolver|cusparse|nccl)\.so'
gpu_symbols='^(cuda|cublas|cusolver|cusparse|nccl)[A-Z_]'
status=0
for binary in "$@"; do
  [[ -x "$binary" ]] || { echo "no executable $binary" >&2; exit 2; }
  needed=$(readelf -d "$binary" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  bad_libs=$(grep -E "$gpu_libs" <<<"$needed" || true)
  bad_symbols=$(nm "$binary" | awk '{print $NF}' | grep -E "$gpu_symbols" |
    sort -u | head -5 || true)
  if [[ -n "$bad_libs" || -n "$bad_symbols" ]]; then
    echo "$(basename "$binary") links GPU code:" $bad_libs $bad_symbols
    status=1
  else
    echo "$(basename "$binary"): no GPU library (NEEDED:" $needed ")"
  fi
done
exit $status
