#!/usr/bin/env bash
# Two canzonad builds side by side under the same `canzonactl bench step`
# (DP1, cpu backend): the daemons alternate, A B A B, each on a fresh unix
# socket, and the script prints each run's median step, local_compute,
# buffers per rank and host round trips. For before/after figures of a
# change to the daemon (tests/bench/RESULTS.md).
#   tests/bench/daemon_ab.sh OLD/canzonad NEW/canzonad [bench step flags...]
#   e.g. ... --optimizer adamw --model qwen3-0.6b --layers 2 --vocab 32768
set -euo pipefail
if (($# < 2)); then
  echo "usage: $0 CANZONAD_A CANZONAD_B [canzonactl bench step flags]" >&2
  exit 2
fi
a=$1 b=$2
shift 2
root="$(cd "$(dirname "$0")/../.." && pwd)"
ctl="${CANZONACTL:-$root/build/client/ctl/canzonactl}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
run() {  # label daemon [bench step flags]
  local label=$1 daemon=$2 pid
  shift 2
  local sock="$out/$label.sock"
  OPENBLAS_NUM_THREADS=1 "$daemon" --unix-socket "$sock" \
    --ready-file "$out/$label.ready" --metrics-address '' --backend cpu \
    --step-timeout 600 --register-timeout 60 >"$out/$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do [[ -s "$out/$label.ready" ]] && break; sleep 0.1; done
  OPENBLAS_NUM_THREADS=1 "$ctl" bench step --target "unix:$sock" --dp 1 \
    --backward-ms 0 --forward-ms 0 --json "$@" >"$out/$label.json" ||
    { tail -n 20 "$out/$label.log" >&2; kill "$pid"; exit 1; }
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  python3 - "$label" "$out/$label.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[2]))["modes"][0]
print("%-4s step %9.1f ms  local_compute %9.1f ms  buffers %8.1f MiB  "
      "host round trips %s" % (
          sys.argv[1], m["median_step_ms"],
          m["median_phase_ms"]["local_compute"], m["buffer_bytes"] / 2**20,
          m.get("median_host_waits", "-")))
PY
}
for round in 1 2; do
  run "A$round" "$a" "${@}"
  run "B$round" "$b" "${@}"
done
