#!/usr/bin/env bash
# canzonactl simulate / calibrate / plan --html on bad input: exit status 2,
# exactly one line on stderr naming the flag or field, and no file written.
#
#   simulate_bad_input_test.sh <canzonactl> <profiles dir>
set -euo pipefail

CTL=$1
PROFILES=$2
DIR=$(mktemp -d "${TMPDIR:-/tmp}/canzona-sim-bad.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
failures=0

# expect_bad NAME EXPECTED_TEXT ARGS...: exit 2, one stderr line containing
# EXPECTED_TEXT, and $DIR/out.html / $DIR/out.json not created.
expect_bad() {
  local name=$1 expected=$2
  shift 2
  rm -f "$DIR/out.html" "$DIR/out.json"
  local rc=0
  "$CTL" "$@" >"$DIR/stdout" 2>"$DIR/stderr" || rc=$?
  local lines
  lines=$(wc -l <"$DIR/stderr")
  if [[ $rc -ne 2 ]]; then
    echo "FAIL $name: exit $rc, expected 2"; cat "$DIR/stderr"; failures=$((failures + 1))
  elif [[ $lines -ne 1 ]]; then
    echo "FAIL $name: $lines stderr lines, expected 1"; cat "$DIR/stderr"; failures=$((failures + 1))
  elif ! grep -qF -- "$expected" "$DIR/stderr"; then
    echo "FAIL $name: stderr lacks '$expected':"; cat "$DIR/stderr"; failures=$((failures + 1))
  elif [[ -e "$DIR/out.html" || -e "$DIR/out.json" ]]; then
    echo "FAIL $name: wrote a file"; failures=$((failures + 1))
  else
    echo "ok   $name: $(cat "$DIR/stderr")"
  fi
}

# A profile with one thing wrong at a time.
profile_with() {  # python expression editing dict `p`, output file
  python3 - "$PROFILES/h100-node.json" "$2" "$1" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
exec(sys.argv[3])
json.dump(p, open(sys.argv[2], "w"))
PY
}
profile_with 'del p["inter_node"]["bandwidth_gbps"]' "$DIR/missing.json"
profile_with 'p["rates"]["ns_gflops"] = 0' "$DIR/zero_rate.json"
profile_with 'p["intra_node"]["latency_us"] = -3' "$DIR/negative.json"
profile_with 'p["comm"] = "mpi"' "$DIR/comm.json"
echo '{"name": "x", ' >"$DIR/broken.json"

SIM=(simulate --model qwen3-8b --dp 8 --tp 8 --html "$DIR/out.html")
expect_bad unknown_profile "unknown profile 'no-such-node'" "${SIM[@]}" --profile no-such-node
expect_bad profile_file_missing "cannot open" "${SIM[@]}" --profile "$DIR/none.json"
expect_bad profile_missing_field "inter_node.bandwidth_gbps is missing" "${SIM[@]}" --profile "$DIR/missing.json"
expect_bad profile_zero_rate "'ns_gflops' must be positive" "${SIM[@]}" --profile "$DIR/zero_rate.json"
expect_bad profile_negative "intra_node.latency_us must be positive" "${SIM[@]}" --profile "$DIR/negative.json"
expect_bad profile_comm "comm must be" "${SIM[@]}" --profile "$DIR/comm.json"
expect_bad profile_not_json "not valid JSON" "${SIM[@]}" --profile "$DIR/broken.json"
expect_bad no_profile "--profile is required" simulate --model qwen3-8b --dp 8 --tp 8 --html "$DIR/out.html"
expect_bad tp_not_dividing "tp 3" simulate --model qwen3-8b --dp 8 --tp 3 --profile h100-node --html "$DIR/out.html"
expect_bad pp_not_dividing "pp" simulate --model qwen3-8b --pp 7 --dp 1 --tp 1 --profile h100-node --html "$DIR/out.html"
expect_bad shard_group "shard_group_size 3" simulate --model qwen3-8b --dp 8 --tp 8 --shard-group-size 3 --profile h100-node --html "$DIR/out.html"
expect_bad negative_forward "--forward-ms" simulate --model qwen3-8b --dp 8 --tp 8 --profile h100-node --forward-ms -1 --html "$DIR/out.html"
expect_bad html_dir_missing "--html" simulate --model qwen3-0.6b --layers 1 --vocab 256 --profile h100-node --html "$DIR/no/such/dir/out.html"
expect_bad plan_html_tp "tp 3" plan --model qwen3-8b --dp 8 --tp 3 --html "$DIR/out.html"
expect_bad plan_html_grid "--html does not apply to --grid" plan --grid --html "$DIR/out.html"
expect_bad calibrate_out_dir "--out: no directory" calibrate --out "$DIR/no/such/dir/out.json"
expect_bad calibrate_no_out "--out is required" calibrate

if ((failures > 0)); then
  echo "$failures case(s) failed"
  exit 1
fi
echo PASS
