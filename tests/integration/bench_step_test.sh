#!/usr/bin/env bash
# Smoke test of `canzonactl bench step` against a real canzonad on a private
# unix socket: a tiny model, DP2, every mode (flat/S=1 x plain/overlap) in
# one run, text and JSON; and a daemon-side error (an unknown strategy) must
# exit nonzero with the daemon's message.
#
#   bench_step_test.sh <canzonad> <canzonactl>
set -euo pipefail

CANZONAD=$1
CANZONACTL=$2
DIR=$(mktemp -d "${TMPDIR:-/tmp}/canzona-bench-step.XXXXXX")
DAEMON=
cleanup() {
  if [[ -n "$DAEMON" ]]; then
    kill -TERM "$DAEMON" 2>/dev/null || true
    wait "$DAEMON" 2>/dev/null || true
  fi
  rm -rf "$DIR"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  [[ -f "$DIR/daemon.log" ]] && tail -n 30 "$DIR/daemon.log" >&2
  exit 1
}

OPENBLAS_NUM_THREADS=1 "$CANZONAD" --unix-socket "$DIR/d.sock" \
  --ready-file "$DIR/d.ready" --metrics-address '' --backend cpu \
  --step-timeout 30 --register-timeout 30 >"$DIR/daemon.log" 2>&1 &
DAEMON=$!
for _ in $(seq 100); do
  [[ -s "$DIR/d.ready" ]] && break
  kill -0 "$DAEMON" 2>/dev/null || fail "canzonad exited before ready"
  sleep 0.1
done
[[ -s "$DIR/d.ready" ]] || fail "canzonad not ready after 10 s"

# qwen3-style shapes, small enough for a few seconds on 2 cores.
cat >"$DIR/tiny.json" <<'EOF'
{"name": "tiny", "architecture": "Qwen3ForCausalLM", "num_hidden_layers": 2,
 "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
 "tie_word_embeddings": true}
EOF
ARGS=(bench step --target "unix:$DIR/d.sock" --model "$DIR/tiny.json"
  --layers 1 --vocab 256 --steps 3 --warmup 1 --backward-ms 2
  --forward-ms 1 --overlap --doorbell --shard-group-size 1 --dp 2
  --timeout 30)

"$CANZONACTL" "${ARGS[@]}" >"$DIR/out.txt" 2>&1 ||
  { cat "$DIR/out.txt" >&2; fail "bench step exited $?"; }
cat "$DIR/out.txt"
MODES="flat/plain flat/doorbell flat/overlap flat/overlap_doorbell S=1/plain
  S=1/doorbell S=1/overlap S=1/overlap_doorbell"
for mode in $MODES; do
  grep -q "^$mode " "$DIR/out.txt" || fail "no row for mode $mode"
done

# Host memory on both sides: nothing pageable meets a GPU, so the bundle's
# requirement holds here too.
"$CANZONACTL" "${ARGS[@]}" --json --require-page-locked >"$DIR/out.json" 2>"$DIR/err.txt" ||
  { cat "$DIR/err.txt" >&2; fail "bench step --json failed"; }
for mode in $MODES; do
  grep -q "\"mode\": \"$mode\"" "$DIR/out.json" ||
    fail "no JSON entry for mode $mode"
done
grep -q '"exposed_over_total_comm"' "$DIR/out.json" ||
  fail "JSON lacks exposed_over_total_comm"
# Memory per rank: Register's report by kind, and the local daemon's
# private memory sampled (its pid from the socket's peer credentials).
python3 - "$DIR/out.json" <<'PY' || fail "memory figures missing"
import json, sys
for m in json.load(open(sys.argv[1]))["modes"]:
    assert m["state_bytes"] > 0 and m["buffer_bytes"] > 0, m
    assert m["master_bytes"] == 0, m  # fp32: updated in the trainer's buffers
    assert m["param_bytes_per_rank"] > 0, m
    assert m["daemon_private_bytes_per_rank"] != -1, m
    # The daemon's host round trips per step: at least the sums' wait.
    assert m["median_host_waits"] >= 1, m
    # Host memory on both sides: no copy meets a GPU.
    assert m["pageable_copies"] == 0, m
PY
grep -q "daemon host round trips per step" "$DIR/out.txt" ||
  fail "no host round trips line"

# A daemon-side error: nonzero exit, the daemon's message on stderr.
if "$CANZONACTL" bench step --target "unix:$DIR/d.sock" \
  --model "$DIR/tiny.json" --layers 1 --vocab 256 --steps 1 --warmup 0 \
  --strategy bogus --timeout 30 >/dev/null 2>"$DIR/err.txt"; then
  fail "an unknown strategy exited 0"
fi
grep -q "unknown strategy 'bogus'" "$DIR/err.txt" ||
  { cat "$DIR/err.txt" >&2; fail "no daemon message for a bad strategy"; }
echo "PASS"
