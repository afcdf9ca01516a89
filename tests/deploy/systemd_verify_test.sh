#!/usr/bin/env bash
# deploy/systemd/canzonad.service passes `systemd-analyze verify` with
# ExecStart pointing at the built canzonad, and the sysusers.d file creates
# the canzona user and group.
#   systemd_verify_test.sh <source root> <path to built canzonad>
#
# What verify does and does not check (systemd 252, honestly):
#  - it parses every line and prints a warning for an unknown key or a value
#    it cannot parse, but still exits 0: so we fail on ANY output;
#  - it checks that the ExecStart= binary exists and is executable (hence the
#    built path substituted into a temp copy);
#  - it does not resolve User=/Group=, so a missing canzona user passes. The
#    sysusers.d file is checked separately with systemd-sysusers --root on an
#    empty tree.
set -euo pipefail
root="$1"
canzonad="$2"
command -v systemd-analyze >/dev/null || { echo "SKIP: no systemd-analyze"; exit 77; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
unit="$root/deploy/systemd/canzonad.service"

verify() {  # unit file -> output of systemd-analyze verify, status in $rc
  set +e
  out="$(SYSTEMD_LOG_COLOR=0 systemd-analyze verify "$1" 2>&1)"
  rc=$?
  set -e
}

# 1. The unit, with the built binary.
mkdir "$tmp/ok"
sed "s#^ExecStart=/usr/local/bin/canzonad #ExecStart=$canzonad #" "$unit" \
  >"$tmp/ok/canzonad.service"
grep -q "^ExecStart=$canzonad " "$tmp/ok/canzonad.service" \
  || { echo "FAIL: ExecStart not rewritten"; exit 1; }
verify "$tmp/ok/canzonad.service"
if [[ $rc -ne 0 || -n "$out" ]]; then
  echo "FAIL: systemd-analyze verify (rc=$rc):"; echo "$out"; exit 1
fi
echo "verify: clean"

# 2. The check can fail: a typo'd key and a bad value must produce output.
mkdir "$tmp/bad"
sed -e 's/^WatchdogSec=/WatchdogSecs=/' -e 's/^DevicePolicy=closed/DevicePolicy=shut/' \
  "$tmp/ok/canzonad.service" >"$tmp/bad/canzonad.service"
verify "$tmp/bad/canzonad.service"
[[ "$out" == *WatchdogSecs* && "$out" == *"device policy"* ]] \
  || { echo "FAIL: verify did not flag a broken unit: $out"; exit 1; }
echo "verify: flags a broken copy"

# 3. The settings the deployment depends on are there.
for line in Type=notify NotifyAccess=main WatchdogSec=30 Restart=on-failure \
    EnvironmentFile=-/etc/default/canzonad RuntimeDirectory=canzona \
    RuntimeDirectoryMode=0750 User=canzona Group=canzona DevicePolicy=closed \
    "DeviceAllow=char-nvidia\* rw" LimitMEMLOCK=infinity NoNewPrivileges=yes \
    ProtectSystem=strict PrivateTmp=no; do
  grep -qx "$line" "$unit" || { echo "FAIL: $unit lacks $line"; exit 1; }
done
grep -qx 'ExecStart=/usr/local/bin/canzonad --unix-socket /run/canzona/canzonad.sock $CANZONAD_ARGS' "$unit" \
  || { echo "FAIL: ExecStart"; exit 1; }
for key in PrivateDevices PrivateIPC=yes ProtectProc=invisible MemoryDenyWriteExecute=yes; do
  if grep -q "^$key" "$unit"; then echo "FAIL: $key would hide GPUs/shm/IPC"; exit 1; fi
done
echo "unit: required settings present, GPU-hiding ones absent"

# 4. sysusers.d: creates canzona (user and group) in an empty root.
if command -v systemd-sysusers >/dev/null; then
  mkdir -p "$tmp/root/etc"
  : >"$tmp/root/etc/passwd"; : >"$tmp/root/etc/group"
  systemd-sysusers --root="$tmp/root" "$root/deploy/systemd/canzonad.sysusers.conf" 2>&1
  grep -q '^canzona:' "$tmp/root/etc/passwd" || { echo "FAIL: no canzona user"; exit 1; }
  grep -q '^canzona:' "$tmp/root/etc/group" || { echo "FAIL: no canzona group"; exit 1; }
  grep -q '^video:.*canzona' "$tmp/root/etc/group" || { echo "FAIL: canzona not in video"; exit 1; }
  echo "sysusers: $(grep '^canzona:' "$tmp/root/etc/passwd")"
fi

# 5. The example environment file is valid shell assignments (the subset
#    EnvironmentFile= reads) and sets CANZONAD_ARGS.
( set -u; source "$root/deploy/systemd/canzonad.env.example"; [[ -n "$CANZONAD_ARGS" ]] ) \
  || { echo "FAIL: canzonad.env.example"; exit 1; }
echo PASS
