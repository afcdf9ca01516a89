#!/usr/bin/env bash
# Hierarchical vs flat sharding (and plain vs overlapped steps) over a shaped
# inter-node link, in one run.
#
# Two network namespaces joined by a veth pair stand for two nodes: daemon A
# (coordinator, 10.77.0.1) in one, daemon B (10.77.0.2) in the other, each
# veth end shaped by `tc ... netem delay D rate R`. canzonactl bench step runs
# outside both and reaches the daemons through their unix sockets (files,
# visible from every namespace): DP ranks 0,1 on A (shard group 0), 2,3 on B
# (shard group 1). Flat sharding sends every reduce-scatter / all-gather
# slice across the shaped link; with --shard-group-size 2 only the
# cross-group all-reduce of each rank's half crosses it. The planner's bytes
# per link tier for the same model are printed next to the measurement.
#
#   sudo tests/bench/shaped_link.sh [--build-dir build] [--delay-ms 2]
#       [--rate-mbit 1000] [--shaper netem|tbf] [--model qwen3-0.6b]
#       [--layers 2] [--vocab 4096] [--steps 5] [--warmup 1]
#       [--backward-ms 20] [--forward-ms 10] [--optimizer muon]
#       [--strategy cost] [--timeout 300] [-- <more bench step flags>]
#
# Needs root, `ip` and `tc` with sch_netem; exits 77 (skipped) naming what
# is missing. --shaper tbf shapes the rate only (token bucket, no delay) for
# kernels without netem. Daemons and namespaces are removed on exit.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=$REPO/build
CANZONAD=
CANZONACTL=
DELAY_MS=2
RATE_MBIT=1000
SHAPER=netem
MODEL=qwen3-0.6b
MODELS_DIR=${CANZONA_MODELS_DIR:-}
LAYERS=2
VOCAB=4096
STEPS=5
WARMUP=1
BACKWARD_MS=20
FORWARD_MS=10
OPTIMIZER=muon
STRATEGY=cost
TIMEOUT_S=300
EXTRA=()

usage() { sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --canzonad) CANZONAD=$2; shift 2 ;;
    --canzonactl) CANZONACTL=$2; shift 2 ;;
    --delay-ms) DELAY_MS=$2; shift 2 ;;
    --rate-mbit) RATE_MBIT=$2; shift 2 ;;
    --shaper) SHAPER=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --models-dir) MODELS_DIR=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --backward-ms) BACKWARD_MS=$2; shift 2 ;;
    --forward-ms) FORWARD_MS=$2; shift 2 ;;
    --optimizer) OPTIMIZER=$2; shift 2 ;;
    --strategy) STRATEGY=$2; shift 2 ;;
    --timeout) TIMEOUT_S=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "shaped_link.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
CANZONAD=${CANZONAD:-$BUILD_DIR/server/canzonad}
CANZONACTL=${CANZONACTL:-$BUILD_DIR/client/ctl/canzonactl}
[[ "$SHAPER" == netem || "$SHAPER" == tbf ]] ||
  { echo "shaped_link.sh: --shaper must be netem or tbf" >&2; exit 2; }

skip() { echo "shaped_link.sh: SKIP: $*" >&2; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, tc)"
command -v ip >/dev/null || skip "no 'ip' (iproute2)"
command -v tc >/dev/null || skip "no 'tc' (iproute2)"
[[ -x "$CANZONAD" ]] || { echo "no canzonad at $CANZONAD" >&2; exit 2; }
[[ -x "$CANZONACTL" ]] || { echo "no canzonactl at $CANZONACTL" >&2; exit 2; }

# The model, trimmed to --layers and --vocab, as a config file both
# canzonactl bench step and canzonactl plan read.
if [[ "$MODEL" == *.json || "$MODEL" == */* ]]; then
  MODEL_JSON=$MODEL
else
  [[ -n "$MODELS_DIR" ]] || MODELS_DIR=$REPO/server/plan/models
  MODEL_JSON=$MODELS_DIR/$MODEL.json
fi
[[ -f "$MODEL_JSON" ]] || { echo "no model config $MODEL_JSON" >&2; exit 2; }

ID=$$
NSA=czlink-a-$ID
NSB=czlink-b-$ID
VA=cza$ID
VB=czb$ID
DIR=$(mktemp -d "${TMPDIR:-/tmp}/canzona-shaped-link.XXXXXX")
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  ip netns del "$NSA" 2>/dev/null || true
  ip netns del "$NSB" 2>/dev/null || true
  ip link del "$VA" 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

sed -E "s/\"num_hidden_layers\": *[0-9]+/\"num_hidden_layers\": $LAYERS/; \
s/\"vocab_size\": *[0-9]+/\"vocab_size\": $VOCAB/" "$MODEL_JSON" \
  >"$DIR/model.json"

# Two namespaces, one veth pair, both ends shaped.
ip netns add "$NSA" 2>"$DIR/err" || skip "ip netns add failed: $(cat "$DIR/err")"
ip netns add "$NSB" 2>"$DIR/err" || skip "ip netns add failed: $(cat "$DIR/err")"
ip link add "$VA" type veth peer name "$VB" 2>"$DIR/err" ||
  skip "veth pair: $(cat "$DIR/err")"
ip link set "$VA" netns "$NSA"
ip link set "$VB" netns "$NSB"
ip -n "$NSA" addr add 10.77.0.1/24 dev "$VA"
ip -n "$NSB" addr add 10.77.0.2/24 dev "$VB"
for ns_dev in "$NSA:$VA" "$NSB:$VB"; do
  ns=${ns_dev%%:*}
  dev=${ns_dev#*:}
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$dev" up
  if [[ "$SHAPER" == netem ]]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root netem \
      delay "${DELAY_MS}ms" rate "${RATE_MBIT}mbit" 2>"$DIR/err" ||
      skip "tc netem on $dev: $(cat "$DIR/err") (the kernel lacks sch_netem?" \
        "--shaper tbf shapes the rate only)"
  else
    # Token bucket: rate only; the burst must hold a GSO super-packet.
    burst=$((RATE_MBIT * 1000000 / 8 / 250))
    ((burst < 262144)) && burst=262144
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf \
      rate "${RATE_MBIT}mbit" burst "$burst" latency 100ms 2>"$DIR/err" ||
      skip "tc tbf on $dev: $(cat "$DIR/err")"
  fi
done
if [[ "$SHAPER" == netem ]]; then
  LINK="netem delay ${DELAY_MS} ms + rate ${RATE_MBIT} Mbit/s on each veth end"
else
  LINK="tbf rate ${RATE_MBIT} Mbit/s on each veth end, no added delay"
fi
echo "link: veth $NSA 10.77.0.1 <-> $NSB 10.77.0.2, $LINK"
if command -v ping >/dev/null; then
  ip netns exec "$NSA" ping -c 3 -i 0.2 -q 10.77.0.2 2>&1 | grep -E "rtt|loss" || true
fi

start_daemon() {  # <netns> <name> <comm host> <extra flags...>
  local ns=$1 name=$2 host=$3
  shift 3
  ip netns exec "$ns" env OPENBLAS_NUM_THREADS=1 "$CANZONAD" \
    --unix-socket "$DIR/$name.sock" --comm-host "$host" \
    --metrics-address '' --ready-file "$DIR/$name.ready" --daemon-id "$name" \
    --backend cpu --step-timeout 600 --register-timeout 300 "$@" \
    >"$DIR/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 200); do
    [[ -s "$DIR/$name.ready" ]] && return 0
    if ! kill -0 "${PIDS[-1]}" 2>/dev/null; then
      cat "$DIR/$name.log" >&2
      echo "daemon $name exited before it was ready" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "daemon $name not ready after 20 s" >&2
  exit 1
}
start_daemon "$NSA" a 10.77.0.1 --listen 10.77.0.1:0
PORT=$(sed -E 's/.*"tcp_port": *([0-9]+).*/\1/' "$DIR/a.ready")
start_daemon "$NSB" b 10.77.0.2 --coordinator "10.77.0.1:$PORT"

set +e
"$CANZONACTL" bench step --target "unix:$DIR/a.sock" \
  --target "unix:$DIR/b.sock" --dp 4 --tp 1 --shard-group-size 2 --overlap \
  --model "$DIR/model.json" --layers "$LAYERS" --vocab "$VOCAB" --optimizer "$OPTIMIZER" --strategy "$STRATEGY" \
  --steps "$STEPS" --warmup "$WARMUP" --backward-ms "$BACKWARD_MS" \
  --forward-ms "$FORWARD_MS" --timeout "$TIMEOUT_S" "${EXTRA[@]}" 2>&1 |
  tee "$DIR/bench.txt"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 ]]; then
  echo "--- daemon a ---" >&2
  tail -n 20 "$DIR/a.log" >&2
  echo "--- daemon b ---" >&2
  tail -n 20 "$DIR/b.log" >&2
  exit "$rc"
fi

# The planned DP bytes per link tier for the same model and buckets.
BUCKET=$(sed -nE 's/.*bucket size ([0-9]+).*/\1/p' "$DIR/bench.txt" | head -n 1)
echo
echo "planned (canzonactl plan --model <same> --dp 4 --shard-group-size 2" \
  "--dtype fp32 --bucket-size ${BUCKET:-default}):"
"$CANZONACTL" plan --model "$DIR/model.json" --dp 4 --tp 1 \
  --shard-group-size 2 --dtype fp32 --optimizer "$OPTIMIZER" \
  --strategy "$STRATEGY" ${BUCKET:+--bucket-size "$BUCKET"} |
  sed -n '/^flat vs hierarchical/,$p'
