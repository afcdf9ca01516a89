#!/usr/bin/env bash
# expect_usage_error.sh FLAG COMMAND [ARG...]
# Passes when COMMAND exits with status 2 and writes exactly one line to
# stderr, and that line names FLAG: how Canzona's command-line tools report
# bad input.
set -uo pipefail
flag=$1
shift
err=$("$@" 2>&1 >/dev/null)
rc=$?
printf '%s\n' "$err"
if [[ $rc -ne 2 ]]; then
  echo "expected exit status 2, got $rc" >&2
  exit 1
fi
if [[ $(printf '%s\n' "$err" | wc -l) -ne 1 ]]; then
  echo "expected one line on stderr" >&2
  exit 1
fi
if [[ "$err" != *"$flag"* ]]; then
  echo "the message does not name $flag" >&2
  exit 1
fi
