#!/usr/bin/env bash
# canzonactl simulate --rates: a `bench kernels --rates-out` file replaces
# the profile's kernel rates. With every rate 10x below h100-node's, the
# updates must take 10x as long: summed over the GPUs (whatever GPU each
# matrix lands on, the sum is the same work).
#
#   simulate_rates_test.sh <canzonactl>
set -euo pipefail
CTL=$1
DIR=$(mktemp -d "${TMPDIR:-/tmp}/canzona-sim-rates.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
cat >"$DIR/slow.json" <<'JSON'
{"backend": "cuda", "gemm_gflops": 69260, "ns_gflops": 54420,
 "eigh_gflops": 200, "adamw_gbps": 268}
JSON
cat >"$DIR/same.json" <<'JSON'
{"backend": "cuda", "gemm_gflops": 692600, "ns_gflops": 544200,
 "eigh_gflops": 2000, "adamw_gbps": 2680}
JSON
ARGS=(simulate --model qwen3-0.6b --layers 2 --vocab 4096 --dp 2 --tp 2
  --profile h100-node --json)
"$CTL" "${ARGS[@]}" --rates "$DIR/same.json" >"$DIR/same.out"
"$CTL" "${ARGS[@]}" --rates "$DIR/slow.json" >"$DIR/slow.out"
python3 - "$DIR/same.out" "$DIR/slow.out" <<'PY'
import json, sys
same, slow = (json.load(open(p)) for p in sys.argv[1:3])
def updates(out):
    cost = [s for s in out["strategies"] if s["strategy"] == "cost"][0]
    return [g["update_s"] for g in cost["per_gpu"]]
a, b = updates(same), updates(slow)
assert len(a) == 4 and all(x > 0 for x in a), a
assert abs(sum(b) / sum(a) - 10) < 1e-6, (sum(a), sum(b))
assert slow["profile"]["rates"]["ns_gflops"] == 54420, slow["profile"]["rates"]
print("PASS: update times x10 with rates / 10")
PY
