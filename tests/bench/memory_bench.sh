#!/usr/bin/env bash
# The daemon's memory per rank (ZeRO-1): for DP 1/2/4, fp32 and bf16
# trainers, Muon and AdamW, one fresh canzonad on a private unix socket per
# configuration runs `canzonactl bench step` (qwen3-0.6b shapes, 2 layers,
# vocab 4096 by default) and reports, per rank: the rank's parameter bytes,
# what Register reported (master, state, buffers) and the daemon's private
# memory growth (smaps_rollup), as ratios to the parameter bytes. A
# benchmark, not a test: nothing is asserted.
#
#   tests/bench/memory_bench.sh [--canzonad build/server/canzonad]
#       [--canzonactl build/client/ctl/canzonactl] [--layers 2]
#       [--vocab 4096] [--dps "1 2 4"] [--dtypes "fp32 bf16"]
#       [--optimizers "muon adamw"] [--json out.json]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
CANZONAD="$root/build/server/canzonad"
CANZONACTL="$root/build/client/ctl/canzonactl"
LAYERS=2
VOCAB=4096
DPS="1 2 4"
DTYPES="fp32 bf16"
OPTIMIZERS="muon adamw"
JSON=
while (($#)); do
  case "$1" in
    --canzonad) CANZONAD=$2; shift 2 ;;
    --canzonactl) CANZONACTL=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --dps) DPS=$2; shift 2 ;;
    --dtypes) DTYPES=$2; shift 2 ;;
    --optimizers) OPTIMIZERS=$2; shift 2 ;;
    --json) JSON=$2; shift 2 ;;
    *) echo "memory_bench.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
DIR=$(mktemp -d "${TMPDIR:-/tmp}/canzona-memory.XXXXXX")
DAEMON=
stop_daemon() {
  if [[ -n "$DAEMON" ]]; then
    kill -TERM "$DAEMON" 2>/dev/null || true
    wait "$DAEMON" 2>/dev/null || true
    DAEMON=
  fi
}
trap 'stop_daemon; rm -rf "$DIR"' EXIT

results=()
for dtype in $DTYPES; do
  for optimizer in $OPTIMIZERS; do
    for dp in $DPS; do
      rm -f "$DIR/d.sock" "$DIR/d.ready"
      OPENBLAS_NUM_THREADS=1 "$CANZONAD" --unix-socket "$DIR/d.sock" \
        --ready-file "$DIR/d.ready" --metrics-address '' --backend cpu \
        --step-timeout 120 --register-timeout 120 >"$DIR/daemon.log" 2>&1 &
      DAEMON=$!
      for _ in $(seq 200); do
        [[ -s "$DIR/d.ready" ]] && break
        sleep 0.05
      done
      out="$DIR/$dtype-$optimizer-$dp.json"
      "$CANZONACTL" bench step --target "unix:$DIR/d.sock" --model qwen3-0.6b \
        --layers "$LAYERS" --vocab "$VOCAB" --dp "$dp" --dtype "$dtype" \
        --optimizer "$optimizer" --steps 2 --warmup 1 --backward-ms 0 \
        --forward-ms 0 --timeout 120 --json >"$out"
      stop_daemon
      results+=("$out")
    done
  done
done

python3 - "$JSON" "${results[@]}" <<'PY'
import json
import sys

out_json, files = sys.argv[1], sys.argv[2:]
rows = []
for f in files:
    run = json.load(open(f))
    mode = run["modes"][0]
    params = mode["param_bytes_per_rank"]
    rows.append({
        "dtype": run["dtype"], "optimizer": run["optimizer"], "dp": run["dp"],
        "param_mib": params / 2**20,
        "master_mib": mode["master_bytes"] / 2**20,
        "state_mib": mode["state_bytes"] / 2**20,
        "buffer_mib": mode["buffer_bytes"] / 2**20,
        "daemon_mib": mode["daemon_private_bytes_per_rank"] / 2**20,
        "daemon_over_params": mode["daemon_over_param_bytes"],
        "owned_over_params":
            (mode["master_bytes"] + mode["state_bytes"]) / params,
        "reported_over_params":
            (mode["master_bytes"] + mode["state_bytes"] +
             mode["buffer_bytes"]) / params,
    })
print("%-5s %-6s %3s %10s %10s %10s %11s %11s %9s %9s %9s" % (
    "dtype", "opt", "dp", "params MiB", "master MiB", "state MiB",
    "buffers MiB", "daemon MiB", "daemon/p", "owned/p", "report/p"))
for r in rows:
    print("%-5s %-6s %3d %10.2f %10.2f %10.2f %11.2f %11.2f %8.3fx %8.3fx "
          "%8.3fx" % (r["dtype"], r["optimizer"], r["dp"], r["param_mib"],
                      r["master_mib"], r["state_mib"], r["buffer_mib"],
                      r["daemon_mib"], r["daemon_over_params"],
                      r["owned_over_params"], r["reported_over_params"]))
print("per rank, the largest: params = the rank's parameter bytes in its "
      "dtype; master/state/buffers = Register's report; daemon = the "
      "daemon's private memory growth per rank; owned = master + state")
if out_json:
    json.dump(rows, open(out_json, "w"), indent=2)
PY
