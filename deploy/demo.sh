#!/usr/bin/env bash
# The main job on the embedded CPU default: two canzonad daemons on loopback
# ("two nodes"), and a 4-rank trainer (DP2 x TP2) training a tensor-parallel
# MLP with Muon (matrices) and AdamW (biases) on synthetic data. Prints the
# loss falling and the optimizer step latency p50/p99 per phase; stops
# everything cleanly; exits 0.
#   deploy/demo.sh [--steps N] [--strategy cost|alpha|start_anchored|layerwise|sc]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/deploy/lib/deps.sh"
canzona_install_deps
canzona_cuda_path

steps=300
strategy=cost
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --strategy) strategy="$2"; shift 2 ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

build="${BUILD_DIR:-$root/build}"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target canzonad canzonactl tp_mlp_trainer

run="$(mktemp -d /tmp/canzona-demo.XXXXXX)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$run"
}
trap cleanup EXIT

wait_ready() {  # file
  for _ in $(seq 1 100); do [[ -s "$1" ]] && return 0; sleep 0.1; done
  echo "demo.sh: a daemon did not come up; its log:" >&2
  cat "$run"/*.log >&2
  exit 1
}

# Daemon A: coordinator, TCP on a free loopback port. Daemon B joins it.
export OPENBLAS_NUM_THREADS=1
"$build/server/canzonad" --unix-socket "$run/a.sock" --listen 127.0.0.1:0 \
  --metrics-address 127.0.0.1:0 \
  --daemon-id node-a --ready-file "$run/a.ready" >"$run/a.log" 2>&1 &
pids+=($!)
wait_ready "$run/a.ready"
port=$(sed -E 's/.*"tcp_port": ([0-9]+).*/\1/' "$run/a.ready")
"$build/server/canzonad" --unix-socket "$run/b.sock" --coordinator "127.0.0.1:$port" \
  --metrics-address 127.0.0.1:0 \
  --daemon-id node-b --ready-file "$run/b.ready" >"$run/b.log" 2>&1 &
pids+=($!)
wait_ready "$run/b.ready"
metrics_port() { sed -E 's/.*"metrics_port": ([0-9]+).*/\1/' "$1"; }
echo "daemons: node-a (coordinator, 127.0.0.1:$port), node-b;" \
  "metrics at http://127.0.0.1:$(metrics_port "$run/a.ready")/metrics and" \
  "http://127.0.0.1:$(metrics_port "$run/b.ready")/metrics"

"$build/client/examples/tp_mlp_trainer" \
  --targets "unix:$run/a.sock,unix:$run/b.sock" --dp 2 --tp 2 \
  --steps "$steps" --strategy "$strategy" --job demo

echo
echo "node-a's exported step metrics:"
fetch_metrics() {  # port: plain HTTP/1.0 over bash's /dev/tcp (no curl needed)
  exec 3<>"/dev/tcp/127.0.0.1/$1"
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  cat <&3
  exec 3<&-
}
fetch_metrics "$(metrics_port "$run/a.ready")" | grep -E '^canzona_steps_total|^canzona_step_phase_seconds_count\{.*phase="total"' || true
echo "demo: done"
