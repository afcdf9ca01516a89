# Sourced by the bundle's run.sh: what this machine has. Writes env.txt
# (machine_*, bundle_*, cudalib.*, gpu_*, run_* keys) and sets for run.sh:
#   python, have_python, have_torch, torch_cuda   the interpreter and torch
#   pypath                                        the canzona package's root
#   needed, missing                               CUDA sonames needed / not found
#   gpu (0/1), gpu_reason                         whether GPU checks can run
# and exports PATH, LD_LIBRARY_PATH (the CUDA libraries found, the stand-ins
# for the missing ones), CANZONA_BRIDGE, CANZONA_MODELS_DIR.
#
# Uses run.sh's variables: here, bin, models, info, report, work.

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
# PyTorch's allocator settings (expandable segments make its memory
# unshareable over legacy CUDA IPC: canzona.torch refuses it).
env_set torch_alloc_conf "${PYTORCH_ALLOC_CONF-unset} / ${PYTORCH_CUDA_ALLOC_CONF-unset}"
# Recorded, then cleared: both sides of every comparison run on torch's
# default allocator, and a machine's expandable segments fail no check.
unset PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF

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
