#!/usr/bin/env bash
# The Canzona GPU bundle's runner: finds the CUDA 13 runtime, cuBLAS,
# cuSOLVER and NCCL on this machine, prints them and the GPU, then runs
# every check in order, each bounded in time, going on past failures, and
# writes report.md + report.json into the report directory.
#
#   ./run.sh REPORT_DIR [--budget SECONDS] [--archive FILE] [--only REGEX]
#
#   --budget S     wall-clock budget for everything (default 480): a check
#                  gets min(its own limit, what is left); one that cannot
#                  start in time is reported skipped
#   --archive F    also pack the whole report directory (logs, JSON) into F
#                  (.tar.gz), e.g. for a tool that returns few files
#   --only REGEX   run only the checks whose name matches (others skipped)
#
# Checks, in order (the goals' figures first: a short GPU visit may be cut):
#   cpu         canzonactl bench step on a cpu daemon (DP2); tp_mlp_trainer
#               (DP2 x TP2) against two daemons on loopback
#   torch       checks/torch_step_bench.py: canzona.torch's step and
#               iteration times against torch.optim.Muon + AdamW at 100M /
#               Qwen3-0.6B / Qwen3-8B shapes (NCCL plane); checks/
#               torch_check.py: their updates compared on the GPU; the step
#               bench at 100M on the Gloo plane
#   step        canzonactl bench step against canzonad --backend cuda with
#               --comm nccl (world size 1) and --comm gloo (DP2 on one GPU)
#   gpu tests   every gpu-labelled gtest binary in tests/ (JSON in data/)
#   kernels     canzonactl bench kernels on qwen3-32b shapes, bf16 and fp32,
#               then torch's NS5 on the same shapes (checks/torch_ns_bench.py)
#   example     the Python example trainer on a cpu daemon
# report.md, report.json (and --archive) are rewritten after every check,
# so a run stopped from outside leaves what it measured.
# Without a GPU the GPU checks are skipped ("no GPU") and the rest runs;
# without python3 / torch / the canzona package the Python checks are
# skipped with the reason.
#
# Environment: CANZONA_CUDA_LIB_DIRS (colon-separated) is searched first
# for the CUDA libraries; PYTHON picks the interpreter (default python3).
# Exit status: 0 when no check failed, 1 otherwise, 2 on bad usage.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { sed -n '2,38p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

report=""
budget=480
archive=""
only=""
while (($#)); do
  case "$1" in
    --budget) budget="$2"; shift 2 ;;
    --archive) archive="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *)
      if [[ -n "$report" ]]; then echo "run.sh: one report directory" >&2; exit 2; fi
      report="$1"; shift ;;
  esac
done
if [[ -z "$report" ]]; then usage >&2; exit 2; fi
if ! [[ "$budget" =~ ^[0-9]+$ ]]; then echo "run.sh: --budget: not a number of seconds: $budget" >&2; exit 2; fi
mkdir -p "$report" || exit 2
report="$(cd "$report" && pwd)"
# A report directory used before: only this run's results in it.
rm -rf "$report"/{checks,logs,data} "$report"/report.md "$report"/report.json \
  "$report"/env.txt "$report"/runner.log
mkdir -p "$report"/{checks,logs,data} || exit 2

bin="$here/bin"
models="$here/share/canzona/models"
info="$here/share/canzona/bundle"
work="$(mktemp -d "${TMPDIR:-/tmp}/canzona-bundle.XXXXXX")"
start=$SECONDS
# Reserved at the end of the budget for the report.
reserve=15
check_number=0
daemon_pids=()

# How checks run (runner_checks.sh), then what this machine has
# (runner_environment.sh: env.txt, LD_LIBRARY_PATH, gpu, python, ...).
source "$info/runner_checks.sh" || { echo "run.sh: $info/runner_checks.sh missing" >&2; exit 2; }
# report.md and report.json from the records so far (and the archive):
# after every check (record calls it) and at the end.
write_report() {
  if ! "$bin/canzona-bundle-report" "$report" >"$work/summary.txt" 2>"$report/logs/report.log"; then
    # The report tool failed: a plain report from the records alone.
    {
      echo "# Canzona GPU bundle report (plain: the report tool failed)"
      echo
      echo '```'
      cat "$report/env.txt"
      echo '```'
      for rec in "$report"/checks/*.rec; do
        [[ -f "$rec" ]] || continue
        echo
        echo '```'
        cat "$rec"
        echo '```'
      done
    } >"$report/report.md"
    echo '{"schema": 1, "error": "canzona-bundle-report failed; see report.md"}' >"$report/report.json"
    echo "canzona bundle: report tool failed ($(tail -n1 "$report/logs/report.log"))" >"$work/summary.txt"
  fi
  if [[ -n "$archive" ]]; then
    # Exit status 1: a log grew while read (a daemon still writing); the
    # archive is still whole.
    tar -C "$(dirname "$report")" --warning=no-file-changed -czf "$archive.tmp" \
      "$(basename "$report")" 2>>"$report/logs/report.log"
    if (($? <= 1)); then
      mv -f "$archive.tmp" "$archive"
    else
      log "report archive not updated (tar failed; see logs/report.log)"
    fi
  fi
}
cleanup() { stop_daemons; rm -rf "$work"; }
# Stopped from outside: the running check (its timeout's process group)
# and the daemons stop, and the report holds every check finished so far.
interrupted() {
  log "interrupted"
  if [[ -n "$check_pid" ]]; then kill -TERM -- "-$check_pid" 2>/dev/null; fi
  stop_daemons
  write_report
  exit 143
}
check_pid=""
trap cleanup EXIT
trap interrupted INT TERM
source "$info/runner_environment.sh" || { echo "run.sh: $info/runner_environment.sh missing" >&2; exit 2; }

# --- cpu: the daemon starts and a CPU job steps (no GPU needed) ----------------

with_daemons cpu-step-bench cpu step 60 data/cpu-step-bench.json \
  "--backend cpu --comm gloo --step-timeout 60 --register-timeout 60" -- \
  bash -c "'$bin/canzonactl' bench step --target '$(sock d0)' --model '$info/tiny-model.json' \
    --layers 1 --vocab 256 --dp 2 --steps 5 --warmup 1 --backward-ms 2 --forward-ms 1 \
    --overlap --timeout 60 --json >'$report/data/cpu-step-bench.json'"

with_daemons cpu-tp-mlp-trainer cpu trainer 90 "" \
  "--backend cpu --comm gloo --step-timeout 60 --register-timeout 60" \
  "--backend cpu --comm gloo --step-timeout 60 --register-timeout 60" -- \
  "$bin/tp_mlp_trainer" --targets "$(sock d0),$(sock d1)" --dp 2 --tp 2 --steps 60 \
  --print-every 10 --job bundle-trainer

# --- torch: canzona.torch on the GPU vs torch.optim.Muon + AdamW ------------------
# First: the goals' figures (the step benchmarks) and the PyTorch check are
# what a short GPU visit is for; the rest repeats or extends them.

no_gpu="no GPU ($gpu_reason)"
torch_reason=""
if ((!have_python)); then
  torch_reason="no python3"
elif ((!have_torch)); then
  torch_reason="torch is not importable by $python"
elif ((!torch_cuda)); then
  torch_reason="torch sees no CUDA device"
fi

# The PyTorch check needs torch with CUDA; the example trainer (on a cpu
# daemon) torch alone; both the canzona package.
canzona_reason=""
if ((!have_python)); then
  canzona_reason="no python3"
elif ((!have_torch)); then
  canzona_reason="torch is not importable by $python"
fi
if [[ -z "$canzona_reason" ]]; then
  if [[ -z "$pypath" ]]; then
    canzona_reason="the bundle carries no canzona Python package"
  elif ! PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" timeout -k 5 60 "$python" -c 'import canzona, canzona.torch' \
    >"$report/logs/import_canzona.log" 2>&1; then
    canzona_reason="import canzona failed: $(tail -n1 "$report/logs/import_canzona.log")"
  fi
fi
# canzona.torch's opt.step() and whole iteration against torch.optim.Muon +
# AdamW at 100M / Qwen3-0.6B / Qwen3-8B shapes, fp32 and bf16 models (the
# goals are judged in the report); sizes that do not fit are skipped rows.
if ((!gpu)); then
  skip torch-step-bench torch torch_step_bench "$no_gpu"
elif [[ -n "$canzona_reason$torch_reason" ]]; then
  skip torch-step-bench torch torch_step_bench "${canzona_reason:-$torch_reason}"
else
  with_daemons torch-step-bench torch torch_step_bench 210 data/torch-step-bench.json \
    "--backend cuda --comm nccl --step-timeout 30 --register-timeout 120" -- \
    env PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    "$python" "$here/checks/torch_step_bench.py" --target "$(sock d0)" --device cuda \
    --sizes 100m,0.6b,8b --dtypes fp32,bf16 --warmup 3 --steps 5 --budget 180 \
    --models-dir "$models" --out "$report/data/torch-step-bench.json"
fi
if ((!gpu)); then
  skip torch-check torch torch_check "$no_gpu"
elif [[ -n "$canzona_reason$torch_reason" ]]; then
  skip torch-check torch torch_check "${canzona_reason:-$torch_reason}"
else
  with_daemons torch-check torch torch_check 120 data/torch-check.json \
    "--backend cuda --comm nccl --step-timeout 30 --register-timeout 60" -- \
    env PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    "$python" "$here/checks/torch_check.py" --target "$(sock d0)" --device cuda --steps 20 \
    --out "$report/data/torch-check.json"
fi
# The same at ~100 M parameters on the Gloo plane with CUDA tensors (host
# staging, how ranks share a GPU): goal within 3x of torch's step.
if ((!gpu)); then
  skip torch-step-bench-gloo torch torch_step_bench "$no_gpu"
elif [[ -n "$canzona_reason$torch_reason" ]]; then
  skip torch-step-bench-gloo torch torch_step_bench "${canzona_reason:-$torch_reason}"
else
  with_daemons torch-step-bench-gloo torch torch_step_bench 120 data/torch-step-bench-gloo.json \
    "--backend cuda --comm gloo --step-timeout 30 --register-timeout 60" -- \
    env PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    "$python" "$here/checks/torch_step_bench.py" --target "$(sock d0)" --device cuda \
    --comm gloo --sizes 100m --dtypes bf16,fp32 --warmup 3 --steps 5 --budget 90 \
    --models-dir "$models" --out "$report/data/torch-step-bench-gloo.json"
fi

# --- step: the distributed step with cuda compute --------------------------------

# Steps take milliseconds: a hang ends at 30 s, not after the budget.
step_args=(--model qwen3-0.6b --models-dir "$models" --layers 2 --vocab 4096 --steps 10
  --warmup 2 --backward-ms 20 --forward-ms 10 --overlap --timeout 30 --json
  --require-page-locked)
if ((gpu)); then
  with_daemons step-cuda-nccl-ws1 step step 90 data/step-cuda-nccl-ws1.json \
    "--backend cuda --comm nccl --step-timeout 30 --register-timeout 60" -- \
    bash -c "'$bin/canzonactl' bench step --target '$(sock d0)' --dp 1 --tp 1 $(printf '%q ' "${step_args[@]}") \
      >'$report/data/step-cuda-nccl-ws1.json'"
  with_daemons step-cuda-gloo-dp2 step step 90 data/step-cuda-gloo-dp2.json \
    "--backend cuda --comm gloo --step-timeout 30 --register-timeout 60" -- \
    bash -c "'$bin/canzonactl' bench step --target '$(sock d0)' --dp 2 --tp 1 $(printf '%q ' "${step_args[@]}") \
      >'$report/data/step-cuda-gloo-dp2.json'"
else
  skip step-cuda-nccl-ws1 step step "$no_gpu"
  skip step-cuda-gloo-dp2 step step "$no_gpu"
fi

# --- gpu tests: every gpu-labelled binary; they skip themselves without one ----
# (at most 8.3 s each on the 2026-11-27 H200: 90 s bounds a hang's cost)

for test_bin in "$here"/tests/*; do
  [[ -x "$test_bin" ]] || continue
  t="$(basename "$test_bin")"
  run_check "gpu-test-$t" "gpu tests" gtest 90 "data/gpu-test-$t.json" -- \
    "$test_bin" "--gtest_output=json:$report/data/gpu-test-$t.json"
done

# --- kernels: our Newton-Schulz vs GEMM, then torch's NS5 on the same shapes ---

for precision in bf16 fp32; do
  if ((gpu)); then
    run_check "bench-kernels-$precision" kernels kernels 150 "data/bench-kernels-$precision.json" -- \
      bash -c "'$bin/canzonactl' bench kernels --backend cuda --model qwen3-32b --models-dir '$models' \
        --precision $precision --min-time 0.5 --json >'$report/data/bench-kernels-$precision.json'"
  else
    skip "bench-kernels-$precision" kernels kernels "$no_gpu"
  fi
done

if ((!gpu)); then
  skip torch-ns5 kernels torch_ns "$no_gpu"
elif [[ -n "$torch_reason" ]]; then
  skip torch-ns5 kernels torch_ns "$torch_reason"
else
  run_check torch-ns5 kernels torch_ns 180 data/torch-ns5.json -- \
    "$python" "$here/checks/torch_ns_bench.py" --ours "$report/data/bench-kernels-bf16.json" \
    --ours "$report/data/bench-kernels-fp32.json" --min-time 0.5 --out "$report/data/torch-ns5.json"
fi

# --- the Python example trainer on a cpu daemon --------------------------------

if [[ -n "$canzona_reason" ]]; then
  skip python-example-trainer torch generic "$canzona_reason"
elif ! [[ -f "$here/examples/train_torch.py" ]]; then
  skip python-example-trainer torch generic "the bundle carries no train_torch.py"
else
  with_daemons python-example-trainer torch generic 120 "" \
    "--backend cpu --comm gloo --step-timeout 60 --register-timeout 60" -- \
    env PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CANZONA_TARGET="$(sock d0)" \
    "$python" "$here/examples/train_torch.py" --steps 10
fi

# --- report --------------------------------------------------------------------------

env_set run_finished_at "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
env_set run_elapsed_s "$((SECONDS - start))"
write_report
if [[ -n "$archive" ]]; then log "report archive: $archive"; fi
echo
cat "$report/report.md"
echo
log "$(cat "$work/summary.txt")"
grep -q ' 0 failed,' "$work/summary.txt"
