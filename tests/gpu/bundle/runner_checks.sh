# Sourced by the bundle's run.sh: how a check runs. Logging (log, the
# report's env.txt through env_set), one checks/NN-NAME.rec per check
# (record, skip), the shared time budget (may_run), a bounded run of one
# command (run_check), and daemons started for a check and stopped after it
# (start_daemon, with_daemons, stop_daemons).
#
# Uses run.sh's variables: report, work, bin, start, budget, reserve, only,
# check_number, daemon_pids, check_pid (the running check's timeout, whose
# process group a TERM stops); and its write_report.

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

# record NAME key=value...: one checks/NN-NAME.rec
record() {
  local name="$1"; shift
  check_number=$((check_number + 1))
  local file
  file="$report/checks/$(printf '%02d' "$check_number")-${name//[^A-Za-z0-9_.-]/_}.rec"
  { echo "name=$name"; printf '%s\n' "$@"; } >"$file"
  # The report as it stands (run.sh's write_report): a run stopped from
  # outside keeps every finished check's result.
  write_report
}

skip() {  # NAME GROUP KIND REASON
  record "$1" "group=$2" "kind=$3" "state=skipped" "reason=$4"
  log "SKIP $1: $4"
}

# Whether a check may start: --only, and time left (sets $limit). A check
# needs a quarter of its limit (10 s at least): one started with less would
# be killed and counted failed, its partial results unread, where skipped
# it says why.
may_run() {  # NAME GROUP KIND LIMIT
  if [[ -n "$only" ]] && ! [[ "$1" =~ $only ]]; then
    skip "$1" "$2" "$3" "not selected (--only $only)"
    return 1
  fi
  local left=$((budget - (SECONDS - start) - reserve))
  local need=$(($4 / 4 > 10 ? $4 / 4 : 10))
  if ((left < need)); then
    skip "$1" "$2" "$3" "time budget exhausted (${budget} s; ${left} s left, it needs ${need} s)"
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
  # The check may plan its work by the limit (torch_step_bench.py does).
  # In the background, waited for: bash runs a trap (TERM from outside)
  # only once a foreground command returns, and timeout runs in a process
  # group of its own, which the trap then stops (check_pid).
  CANZONA_CHECK_LIMIT_S="$limit" timeout -k 10 "$limit" "$@" >"$report/$logfile" 2>&1 </dev/null &
  check_pid=$!
  wait "$check_pid"
  rc=$?
  check_pid=""
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
  # Again with the daemons' logs complete.
  write_report
}

sock() { echo "unix:$work/$1.sock"; }
