#!/usr/bin/python3
"""canzonad speaks sd_notify(3) the way canzonad.service (Type=notify,
WatchdogSec=) needs: this test plays systemd's part with a unix datagram
socket in NOTIFY_SOCKET and checks

  1. with WATCHDOG_USEC: READY=1 after the ready file exists, WATCHDOG=1
     repeatedly (every interval/2), SIGTERM -> STOPPING=1 and exit 0;
  2. without WATCHDOG_USEC: READY=1 and no WATCHDOG=1;
  3. with WATCHDOG_PID of another process: no WATCHDOG=1 (sd_watchdog_enabled).

Usage: sd_notify_test.py /path/to/canzonad
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def start(canzonad, tmp, name, env_extra):
    notify_path = os.path.join(tmp, name + ".notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    env = dict(os.environ)
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    env["NOTIFY_SOCKET"] = notify_path
    env.update(env_extra)
    args = [canzonad, "--unix-socket", os.path.join(tmp, name + ".sock"),
            "--listen", "127.0.0.1:0",
            "--ready-file", os.path.join(tmp, name + ".ready")]
    help_text = subprocess.run([canzonad, "--help"], capture_output=True,
                               text=True).stdout
    if "--metrics-address" in help_text:  # parallel tests: no fixed port
        args += ["--metrics-address", "127.0.0.1:0"]
    log = open(os.path.join(tmp, name + ".log"), "w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, sock


def receive(sock, deadline):
    """The next notification as a dict of its KEY=VALUE lines, or None."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    sock.settimeout(remaining)
    try:
        data = sock.recv(4096)
    except socket.timeout:
        return None
    return dict(line.split("=", 1) for line in data.decode().splitlines()
                if "=" in line)


def fail(message, tmp, name):
    log_path = os.path.join(tmp, name + ".log")
    if os.path.exists(log_path):
        sys.stderr.write(open(log_path).read())
    sys.exit("FAIL: " + message)


def expect_ready(proc, sock, tmp, name):
    deadline = time.monotonic() + 60
    while True:
        msg = receive(sock, deadline)
        if msg is None:
            fail(f"{name}: no READY=1 within 60 s (rc={proc.poll()})", tmp, name)
        if msg.get("READY") == "1":
            break
    if not os.path.exists(os.path.join(tmp, name + ".ready")):
        fail(f"{name}: READY=1 before the ready file was written", tmp, name)
    print(f"{name}: READY=1 STATUS={msg.get('STATUS')!r}")


def stop(proc, sock, tmp, name):
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    stopping = False
    while not stopping:
        msg = receive(sock, deadline)
        if msg is None:
            fail(f"{name}: no STOPPING=1 after SIGTERM", tmp, name)
        stopping = msg.get("STOPPING") == "1"
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        fail(f"{name}: did not exit within 30 s of SIGTERM", tmp, name)
    if rc != 0:
        fail(f"{name}: exit status {rc} after SIGTERM, expected 0", tmp, name)
    print(f"{name}: STOPPING=1, exit 0")


def count_watchdogs(sock, seconds):
    deadline = time.monotonic() + seconds
    count = 0
    while (msg := receive(sock, deadline)) is not None:
        count += msg.get("WATCHDOG") == "1"
    return count


def main():
    canzonad = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="canzona-notify-") as tmp:
        # 1. Watchdog of 1 s: pings every 0.5 s; expect >= 3 in 2.5 s.
        proc, sock = start(canzonad, tmp, "watched", {"WATCHDOG_USEC": "1000000"})
        try:
            expect_ready(proc, sock, tmp, "watched")
            pings = count_watchdogs(sock, 2.5)
            if pings < 3:
                fail(f"watched: {pings} WATCHDOG=1 in 2.5 s, expected >= 3",
                     tmp, "watched")
            print(f"watched: {pings} WATCHDOG=1 in 2.5 s")
            stop(proc, sock, tmp, "watched")
        finally:
            if proc.poll() is None:
                proc.kill()

        # 2. No watchdog configured, 3. the watchdog is another process's.
        for name, env in (("unwatched", {}),
                          ("other_pid", {"WATCHDOG_USEC": "1000000",
                                         "WATCHDOG_PID": "1"})):
            proc, sock = start(canzonad, tmp, name, env)
            try:
                expect_ready(proc, sock, tmp, name)
                pings = count_watchdogs(sock, 1.5)
                if pings:
                    fail(f"{name}: {pings} WATCHDOG=1 without a watchdog",
                         tmp, name)
                print(f"{name}: no WATCHDOG=1 in 1.5 s")
                stop(proc, sock, tmp, name)
            finally:
                if proc.poll() is None:
                    proc.kill()
    print("PASS")


if __name__ == "__main__":
    main()
