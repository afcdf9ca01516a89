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
# Checks, in order:
#   cpu         canzonactl bench step on a cpu daemon (DP2); tp_mlp_trainer
#               (DP2 x TP2) against two daemons on loopback
#   gpu tests   every gpu-labelled gtest binary in tests/ (JSON in data/)
#   kernels     canzonactl bench kernels on qwen3-32b shapes, bf16 and fp32,
#               then torch's NS5 on the same shapes (checks/torch_ns_bench.py)
#   step        canzonactl bench step against canzonad --backend cuda with
#               --comm nccl (world size 1) and --comm gloo (DP2 on one GPU)
#   torch       checks/torch_check.py: canzona.torch vs torch.optim.Muon +
#               AdamW on the GPU; the Python example trainer on a cpu daemon
# Without a GPU the GPU checks are skipped ("no GPU") and the rest runs;
# without python3 / torch / the canzona package the Python checks are
# skipped with the reason.
#
# Environment: CANZONA_CUDA_LIB_DIRS (colon-separated) is searched first
# for the CUDA libraries; PYTHON picks the interpreter (default python3).
# Exit status: 0 when no check failed, 1 otherwise, 2 on bad usage.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { sed -n '2,31p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

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

log() { printf '[%4ds] %s\n' "$((SECONDS - start))" "$*" | tee -a "$report/runner.log"; }
env_set() { printf '%s=%s\n' "$1" "${2//$'\n'/ }" >>"$report/env.txt"; }

stop_daemons() {
  local pid
  for pid in "${daemon_pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${daemon_pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  daemon_pids=()
}
cleanup() { stop_daemons; rm -rf "$work"; }
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# --- Environment -------------------------------------------------------------

env_set run_started_at "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
env_set run_budget_s "$budget"
env_set run_report_dir "$report"
if [[ -f "$info/info.txt" ]]; then
  while IFS='=' read -r key value; do
    [[ -n "$key" && "$key" != \#* ]] && env_set "bundle_$key" "$value"
  done <"$info/info.txt"
fi
os="unknown"
if [[ -r /etc/os-release ]]; then os="$(. /etc/os-release && echo "${PRETTY_NAME:-$NAME}")"; fi
env_set machine_os "$os"
env_set machine_kernel "$(uname -srm)"
env_set machine_glibc "$(getconf GNU_LIBC_VERSION 2>/dev/null || echo unknown)"
env_set machine_cpu "$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)"
env_set machine_cpus "$(nproc 2>/dev/null || echo unknown)"
# The bundle was linked against a glibc; an older one here cannot load it.
need_glibc="$(sed -n 's/^needs_glibc=GLIBC_//p' "$info/info.txt" 2>/dev/null)"
have_glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
if [[ -n "$need_glibc" && -n "$have_glibc" &&
  "$(printf '%s\n%s\n' "$need_glibc" "$have_glibc" | sort -V | head -n1)" != "$need_glibc" ]]; then
  env_set run_warning "glibc $have_glibc here, the bundle needs $need_glibc: its programs will not load"
fi
env_set machine_memory_gib "$(awk '/^MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo 2>/dev/null)"

python="${PYTHON:-python3}"
have_python=0
if command -v "$python" >/dev/null 2>&1; then
  have_python=1
  python="$(command -v "$python")"
fi

# The Python package (the canzona package and its generated stubs) and the
# bridge program it runs where grpcio is missing.
pypath=""
pkg_init="$(find "$here/python" -maxdepth 3 -path '*/canzona/__init__.py' 2>/dev/null | head -n1)"
if [[ -n "$pkg_init" ]]; then pypath="$(dirname "$(dirname "$pkg_init")")"; fi
if [[ -x "$bin/canzona-bridge" ]]; then export CANZONA_BRIDGE="$bin/canzona-bridge"; fi
export PATH="$bin:$PATH"
export CANZONA_MODELS_DIR="$models"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"

# python3's view: interpreter, torch, its CUDA and NCCL, the GPU it sees,
# and the lib folders of the nvidia-* packages (searched for the libraries).
python_libdirs=()
have_torch=0
torch_cuda=0
if ((have_python)); then
  timeout -k 5 90 "$python" "$here/checks/probe_python.py" $(cat "$info/cuda-libs.txt" 2>/dev/null) \
    >"$work/probe.txt" 2>"$report/logs/probe_python.log"
  while IFS='=' read -r key value; do
    case "$key" in
      libdir) python_libdirs+=("$value") ;;
      machine_* | libversion.*) env_set "$key" "$value" ;;
      have_torch) have_torch="$value" ;;
      torch_cuda_available) torch_cuda="$value" ;;
    esac
  done <"$work/probe.txt"
else
  env_set machine_python "absent (no $python)"
fi

# --- CUDA libraries ------------------------------------------------------------

# Where each needed CUDA library is: $CANZONA_CUDA_LIB_DIRS, the nvidia-*
# Python packages' lib folders (and torch/lib), the CUDA toolkits under
# /usr/local, the driver's folder, then ldconfig's cache.
search_dirs=()
IFS=':' read -r -a user_dirs <<<"${CANZONA_CUDA_LIB_DIRS:-}"
search_dirs+=("${user_dirs[@]}" "${python_libdirs[@]}")
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
  /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
  [[ -d "$d" ]] && search_dirs+=("$d")
done
ldconfig_cache="$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) | sed -n 's/^[[:space:]]*\([^ ]*\) (.*) => \(.*\)$/\1 \2/p')"

find_library() {  # soname -> "path source" or nothing
  local soname="$1" d path
  for d in "${search_dirs[@]}"; do
    [[ -n "$d" && -e "$d/$soname" ]] && { echo "$d/$soname search-path"; return; }
  done
  path="$(awk -v s="$soname" '$1 == s {print $2; exit}' <<<"$ldconfig_cache")"
  [[ -n "$path" && -e "$path" ]] && echo "$path ldconfig"
}

# The version of a found library: its nvidia-* package's (probe_python.py),
# NCCL's own banner, the version in its resolved file name, or the CUDA
# toolkit's version.json beside it.
library_version() {  # soname path
  local v json
  v="$(grep -m1 "^libversion\.$1=" "$report/env.txt" 2>/dev/null | cut -d= -f2-)"
  if [[ -z "$v" && "$1" == libnccl.so* ]]; then
    v="$(grep -a -o -m1 'NCCL version [0-9][0-9.+a-z]*' "$2" 2>/dev/null | head -n1)"
  fi
  if [[ -z "$v" ]]; then
    v="$(basename "$(readlink -f "$2")")"
    v="${v#"$1"}"; v="${v#.}"
  fi
  json="$(dirname "$(readlink -f "$2")")/../version.json"
  if [[ -z "$v" && -f "$json" ]]; then
    v="$(sed -n '/"cuda"/,/}/s/.*"version" *: *"\([^"]*\)".*/CUDA toolkit \1/p' "$json" | head -n1)"
  fi
  echo "${v:-unknown}"
}

lib_dirs=()
missing=()
needed=()
[[ -f "$info/cuda-libs.txt" ]] && read -r -a needed <"$info/cuda-libs.txt"
for soname in "${needed[@]}" libcuda.so.1; do
  found="$(find_library "$soname")"
  if [[ -z "$found" ]]; then
    [[ "$soname" == libcuda.so.1 ]] || missing+=("$soname")
    env_set "cudalib.$soname.path" "not found"
    continue
  fi
  path="${found% *}"
  env_set "cudalib.$soname.path" "$path"
  env_set "cudalib.$soname.source" "${found##* }"
  env_set "cudalib.$soname.version" "$(library_version "$soname" "$path")"
  lib_dirs+=("$(dirname "$path")")
done
# Stand-ins for the missing ones (every call returns an error), so that the
# binaries load and run on the cpu backend.
if ((${#missing[@]})); then
  mkdir -p "$work/cuda-stubs"
  for soname in "${missing[@]}"; do
    ln -sf "$here/lib/cuda-stubs/$soname" "$work/cuda-stubs/$soname"
    env_set "cudalib.$soname.source" "bundle stub (not found on this machine)"
  done
  lib_dirs+=("$work/cuda-stubs")
  env_set run_cuda_missing "${missing[*]}"
fi
ld_path="$(printf '%s\n' "${lib_dirs[@]}" | awk '!seen[$0]++' | paste -sd:)"
export LD_LIBRARY_PATH="${ld_path}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
env_set run_ld_library_path "$LD_LIBRARY_PATH"

# --- GPU -------------------------------------------------------------------------

gpu=0
gpu_reason=""
if command -v nvidia-smi >/dev/null 2>&1; then
  smi="$(timeout -k 5 30 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,pci.bus_id \
    --format=csv,noheader,nounits 2>&1)"
  if [[ $? -eq 0 && -n "$smi" ]]; then
    IFS=',' read -r name memory driver cc bus <<<"$(head -n1 <<<"$smi")"
    gpu=1
    env_set gpu_source nvidia-smi
    env_set gpu_name "$(echo $name)"
    env_set gpu_memory_mib "$(echo $memory)"
    env_set gpu_driver "$(echo $driver)"
    env_set gpu_compute_cap "$(echo $cc)"
    env_set gpu_pci_bus_id "$(echo $bus)"
    env_set gpu_count "$(grep -c . <<<"$smi")"
  else
    gpu_reason="nvidia-smi found no GPU: $(head -n1 <<<"$smi")"
  fi
elif [[ -e /dev/nvidiactl || -e /dev/nvidia0 ]]; then
  # No nvidia-smi: ask our own cuda backend.
  probe="$(timeout -k 5 60 "$bin/canzonactl" bench kernels --backend cuda --model "$info/tiny-model.json" \
    --max-shapes 1 --min-time 0.01 2>&1)"
  if [[ $? -eq 0 ]]; then
    gpu=1
    env_set gpu_source "canzonactl bench kernels --backend cuda"
    env_set gpu_name "$(sed -n 's/^backend: \(.*\)   model:.*/\1/p' <<<"$probe")"
  else
    gpu_reason="/dev/nvidia* present but the cuda backend failed: $(tail -n1 <<<"$probe")"
  fi
else
  gpu_reason="no nvidia-smi and no /dev/nvidia* device"
fi
if ((gpu)) && ((${#missing[@]})); then
  gpu=0
  gpu_reason="a GPU is present but CUDA libraries are missing: ${missing[*]}"
fi
[[ -r /proc/driver/nvidia/version ]] &&
  env_set gpu_driver_version_file "$(head -n1 /proc/driver/nvidia/version)"
env_set gpu_present "$gpu"
((gpu)) || env_set gpu_reason "$gpu_reason"

log "bundle: $here"
log "report: $report (budget ${budget} s)"
log "machine: $os, $(uname -r), $(getconf GNU_LIBC_VERSION 2>/dev/null), $(nproc) CPUs"
grep -q '^run_warning=' "$report/env.txt" && log "WARNING: $(grep -m1 '^run_warning=' "$report/env.txt" | cut -d= -f2-)"
if ((have_python)); then
  log "python: $(grep -m1 '^machine_python=' "$report/env.txt" | cut -d= -f2-); torch: $(grep -m1 '^machine_torch=' "$report/env.txt" | cut -d= -f2-)"
else
  log "python: none"
fi
for soname in "${needed[@]}" libcuda.so.1; do
  log "  $soname: $(grep -m1 "^cudalib\.$soname\.path=" "$report/env.txt" | cut -d= -f2-) ($(grep -m1 "^cudalib\.$soname\.version=" "$report/env.txt" | cut -d= -f2-))"
done
if ((gpu)); then
  log "GPU: $(grep -m1 '^gpu_name=' "$report/env.txt" | cut -d= -f2-), $(grep -m1 '^gpu_memory_mib=' "$report/env.txt" | cut -d= -f2-) MiB, driver $(grep -m1 '^gpu_driver=' "$report/env.txt" | cut -d= -f2-)"
else
  log "GPU: none ($gpu_reason)"
fi

# --- Running checks ------------------------------------------------------------

# record NAME key=value...: one checks/NN-NAME.rec
record() {
  local name="$1"; shift
  check_number=$((check_number + 1))
  local file
  file="$report/checks/$(printf '%02d' "$check_number")-${name//[^A-Za-z0-9_.-]/_}.rec"
  { echo "name=$name"; printf '%s\n' "$@"; } >"$file"
}

skip() {  # NAME GROUP KIND REASON
  record "$1" "group=$2" "kind=$3" "state=skipped" "reason=$4"
  log "SKIP $1: $4"
}

# Whether a check may start: --only, and time left (sets $limit).
may_run() {  # NAME GROUP KIND LIMIT
  if [[ -n "$only" ]] && ! [[ "$1" =~ $only ]]; then
    skip "$1" "$2" "$3" "not selected (--only $only)"
    return 1
  fi
  local left=$((budget - (SECONDS - start) - reserve))
  if ((left < 10)); then
    skip "$1" "$2" "$3" "time budget exhausted (${budget} s)"
    return 1
  fi
  limit=$(($4 < left ? $4 : left))
}

# run_check NAME GROUP KIND LIMIT DATA -- COMMAND...: runs COMMAND bounded by
# LIMIT seconds (less if the budget is short), output to logs/NAME.log.
run_check() {
  local name="$1" group="$2" kind="$3" max="$4" data="$5"
  shift 6
  may_run "$name" "$group" "$kind" "$max" || return 0
  local logfile="logs/${name//[^A-Za-z0-9_.-]/_}.log"
  log "RUN  $name (limit ${limit} s)"
  local t0=$SECONDS t0ns rc
  t0ns=$(date +%s%N)
  timeout -k 10 "$limit" "$@" >"$report/$logfile" 2>&1
  rc=$?
  local ms=$((($(date +%s%N) - t0ns) / 1000000))
  local timed_out=0
  if ((rc == 124 || rc == 137)) && ((SECONDS - t0 >= limit)); then timed_out=1; fi
  record "$name" "group=$group" "kind=$kind" "state=ran" "exit_code=$rc" \
    "timed_out=$timed_out" "duration_s=$((ms / 1000)).$(printf '%03d' $((ms % 1000)))" \
    "limit_s=$limit" "command=${*//$'\n'/ }" "log=$logfile" "data=$data"
  log "     $name: exit $rc after $((SECONDS - t0)) s"
}

# start_daemon NAME LOG ARGS...: canzonad on $work/NAME.sock, ready file
# $work/NAME.ready, output to LOG (relative to the report); 0 once ready.
start_daemon() {
  local name="$1" logfile="$2"
  shift 2
  rm -f "$work/$name.ready" "$work/$name.sock"
  "$bin/canzonad" --unix-socket "$work/$name.sock" --ready-file "$work/$name.ready" \
    --metrics-address '' --daemon-id "$name" "$@" >"$report/$logfile" 2>&1 &
  local pid=$!
  daemon_pids+=("$pid")
  for _ in $(seq 600); do
    [[ -s "$work/$name.ready" ]] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  return 1
}

# with_daemons NAME GROUP KIND LIMIT DATA 'DAEMON ARGS' [...] -- COMMAND...:
# starts one daemon per quoted argument list (d0 first; later ones join d0
# as coordinator), runs the check, stops them. A daemon that does not start
# fails the check with its log's last line.
with_daemons() {
  local name="$1" group="$2" kind="$3" max="$4" data="$5"
  shift 5
  local specs=()
  while (($#)) && [[ "$1" != -- ]]; do specs+=("$1"); shift; done
  shift
  may_run "$name" "$group" "$kind" "$max" || return 0
  local i=0 spec port="" daemon_log base="logs/${name//[^A-Za-z0-9_.-]/_}"
  for spec in "${specs[@]}"; do
    local extra=()
    if ((i == 0 && ${#specs[@]} > 1)); then extra=(--listen 127.0.0.1:0); fi
    if ((i > 0)); then extra=(--coordinator "127.0.0.1:$port"); fi
    daemon_log="$base-daemon-d$i.log"
    # shellcheck disable=SC2086
    if ! start_daemon "d$i" "$daemon_log" $spec "${extra[@]}"; then
      # canzonad's fatal error is its "canzonad: ..." line.
      local why
      why="$(grep -m1 '^canzonad: ' "$report/$daemon_log" || tail -n1 "$report/$daemon_log")"
      log "     daemon d$i did not start: $why"
      printf 'canzonad %s did not start (%s):\n%s\n' "$spec" "$daemon_log" "$why" >"$report/$base.log"
      record "$name" "group=$group" "kind=generic" "state=ran" "exit_code=1" "timed_out=0" \
        "duration_s=0" "limit_s=$limit" "command=canzonad $spec" "log=$base.log"
      stop_daemons
      return 0
    fi
    if ((i == 0)); then port="$(sed -E 's/.*"tcp_port": ([0-9]+).*/\1/' "$work/d0.ready")"; fi
    i=$((i + 1))
  done
  run_check "$name" "$group" "$kind" "$limit" "$data" -- "$@"
  stop_daemons
}

sock() { echo "unix:$work/$1.sock"; }

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

# --- gpu tests: every gpu-labelled binary; they skip themselves without one ----

for test_bin in "$here"/tests/*; do
  [[ -x "$test_bin" ]] || continue
  t="$(basename "$test_bin")"
  run_check "gpu-test-$t" "gpu tests" gtest 150 "data/gpu-test-$t.json" -- \
    "$test_bin" "--gtest_output=json:$report/data/gpu-test-$t.json"
done

# --- kernels: our Newton-Schulz vs GEMM, then torch's NS5 on the same shapes ---

no_gpu="no GPU ($gpu_reason)"
for precision in bf16 fp32; do
  if ((gpu)); then
    run_check "bench-kernels-$precision" kernels kernels 150 "data/bench-kernels-$precision.json" -- \
      bash -c "'$bin/canzonactl' bench kernels --backend cuda --model qwen3-32b --models-dir '$models' \
        --precision $precision --min-time 0.5 --json >'$report/data/bench-kernels-$precision.json'"
  else
    skip "bench-kernels-$precision" kernels kernels "$no_gpu"
  fi
done

torch_reason=""
if ((!have_python)); then
  torch_reason="no python3"
elif ((!have_torch)); then
  torch_reason="torch is not importable by $python"
elif ((!torch_cuda)); then
  torch_reason="torch sees no CUDA device"
fi
if ((!gpu)); then
  skip torch-ns5 kernels torch_ns "$no_gpu"
elif [[ -n "$torch_reason" ]]; then
  skip torch-ns5 kernels torch_ns "$torch_reason"
else
  run_check torch-ns5 kernels torch_ns 180 data/torch-ns5.json -- \
    "$python" "$here/checks/torch_ns_bench.py" --ours "$report/data/bench-kernels-bf16.json" \
    --ours "$report/data/bench-kernels-fp32.json" --min-time 0.5 --out "$report/data/torch-ns5.json"
fi

# --- step: the distributed step with cuda compute --------------------------------

step_args=(--model qwen3-0.6b --models-dir "$models" --layers 2 --vocab 4096 --steps 10
  --warmup 2 --backward-ms 20 --forward-ms 10 --overlap --timeout 120 --json)
if ((gpu)); then
  with_daemons step-cuda-nccl-ws1 step step 120 data/step-cuda-nccl-ws1.json \
    "--backend cuda --comm nccl --step-timeout 120 --register-timeout 120" -- \
    bash -c "'$bin/canzonactl' bench step --target '$(sock d0)' --dp 1 --tp 1 $(printf '%q ' "${step_args[@]}") \
      >'$report/data/step-cuda-nccl-ws1.json'"
  with_daemons step-cuda-gloo-dp2 step step 120 data/step-cuda-gloo-dp2.json \
    "--backend cuda --comm gloo --step-timeout 120 --register-timeout 120" -- \
    bash -c "'$bin/canzonactl' bench step --target '$(sock d0)' --dp 2 --tp 1 $(printf '%q ' "${step_args[@]}") \
      >'$report/data/step-cuda-gloo-dp2.json'"
else
  skip step-cuda-nccl-ws1 step step "$no_gpu"
  skip step-cuda-gloo-dp2 step step "$no_gpu"
fi

# --- torch: canzona.torch on the GPU vs torch.optim.Muon + AdamW ------------------

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
if ((!gpu)); then
  skip torch-check torch torch_check "$no_gpu"
elif [[ -n "$canzona_reason$torch_reason" ]]; then
  skip torch-check torch torch_check "${canzona_reason:-$torch_reason}"
else
  with_daemons torch-check torch torch_check 240 data/torch-check.json \
    "--backend cuda --comm nccl --step-timeout 120 --register-timeout 120" -- \
    env PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    "$python" "$here/checks/torch_check.py" --target "$(sock d0)" --device cuda --steps 20 \
    --out "$report/data/torch-check.json"
fi
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
if ! "$bin/canzona-bundle-report" "$report" >"$work/summary.txt" 2>"$report/logs/report.log"; then
  # The report tool failed: a plain report from the records alone.
  log "canzona-bundle-report failed: $(tail -n1 "$report/logs/report.log")"
  {
    echo "# Canzona GPU bundle report (plain: the report tool failed)"
    echo
    echo '```'
    cat "$report/env.txt"
    echo '```'
    for rec in "$report"/checks/*.rec; do
      echo
      echo '```'
      cat "$rec"
      echo '```'
    done
  } >"$report/report.md"
  echo '{"schema": 1, "error": "canzona-bundle-report failed; see report.md"}' >"$report/report.json"
  echo "canzona bundle: report tool failed" >"$work/summary.txt"
fi
if [[ -n "$archive" ]]; then
  tar -C "$(dirname "$report")" -czf "$archive" "$(basename "$report")" &&
    log "report archive: $archive"
fi
echo
cat "$report/report.md"
echo
log "$(cat "$work/summary.txt")"
grep -q ' 0 failed,' "$work/summary.txt"
