#!/usr/bin/env python3
"""Predicted vs measured: the step simulator against real steps on this
machine (a benchmark, not a test: it reports, it asserts nothing).

  tests/bench/sim_validation.py --build-dir build [--out DIR]
      [--profile FILE] [--steps 5] [--warmup 1] [--only REGEX] [--markdown]

1. `canzonactl calibrate` writes this machine's profile (unless --profile).
2. A canzonad (cpu backend, one BLAS thread per rank, as canzonad runs by
   default) on a private unix socket; for every configuration,
   `canzonactl bench step --json` measures the daemon's phase times (per
   step the slowest rank, median over steps) and `canzonactl simulate
   --json` predicts them with the same model cut, bucket size, layout,
   optimizer, strategy and shard groups.
3. `canzona_step_bench` (the in-process step benchmark: two engines, all
   five strategies at DP2 x TP2) against `simulate` per strategy.
Prints one table: per configuration and phase, predicted, measured and
predicted / measured, and whether each is within 25%. The machine may be
shared: the CPU time other processes and this benchmark used during each
run are measured (/proc/stat) and turned into the other work's busy
threads (background_threads), which the prediction shares the cores with
(hardware_profile.h); the prediction for an idle machine is shown beside
it.
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PHASES = ["reduce_scatter", "local_compute", "tp_gather", "tp_compute",
          "tp_scatter", "all_gather", "total"]

# name, bench step flags. qwen3-0.6b shapes, 2 layers, vocabulary 4096
# (megatron layout, fp32, Muon + AdamW unless adamw).
CONFIGS = [
    ("dp1 tp1 muon", ["--dp", "1", "--tp", "1"]),
    ("dp2 tp1 muon", ["--dp", "2", "--tp", "1"]),
    ("dp4 tp1 muon", ["--dp", "4", "--tp", "1"]),
    ("dp2 tp2 muon", ["--dp", "2", "--tp", "2"]),
    ("dp1 tp2 muon", ["--dp", "1", "--tp", "2"]),
    ("dp2 tp1 adamw", ["--dp", "2", "--tp", "1", "--optimizer", "adamw"]),
    ("dp4 tp1 adamw", ["--dp", "4", "--tp", "1", "--optimizer", "adamw"]),
    ("dp4 tp1 adamw S=2",
     ["--dp", "4", "--tp", "1", "--optimizer", "adamw",
      "--shard-group-size", "2"]),
    ("dp4 tp1 muon S=2",
     ["--dp", "4", "--tp", "1", "--shard-group-size", "2"]),
]
MODEL = ["--model", "qwen3-0.6b", "--layers", "2", "--vocab", "4096"]


def run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if result.returncode != 0:
        sys.stderr.write(" ".join(cmd) + "\n" + result.stdout + result.stderr)
        raise SystemExit(f"command failed ({result.returncode})")
    return result.stdout


def flag(flags, name, default):
    return flags[flags.index(name) + 1] if name in flags else default


def loaded_profile(profile, background, out_dir, name):
    """The profile with the other processes' work during a run as
    background threads (hardware_profile.h): the machine as it was while
    measured."""
    p = json.load(open(profile))
    p["background_threads"] = round(background, 3)
    path = os.path.join(out_dir, "profile-" + re.sub(r"\W+", "_", name) +
                        ".json")
    with open(path, "w") as f:
        json.dump(p, f, indent=1)
    return path


def simulate(ctl, profile, flags, bucket, strategy, shard_group):
    cmd = [ctl, "simulate", "--profile", profile, "--json", "--dtype", "fp32",
           "--strategy", strategy, "--bucket-size", str(bucket),
           "--dp", flag(flags, "--dp", "1"), "--tp", flag(flags, "--tp", "1"),
           "--optimizer", flag(flags, "--optimizer", "muon")] + MODEL
    if shard_group:
        cmd += ["--shard-group-size", str(shard_group)]
    out = json.loads(run(cmd))
    for s in out["strategies"]:
        if s["strategy"] == strategy:
            return s["slowest_per_phase"]
    raise SystemExit(f"simulate: no strategy {strategy}")


def start_daemon(canzonad, workdir):
    sock = os.path.join(workdir, "d.sock")
    ready = os.path.join(workdir, "d.ready")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    log = open(os.path.join(workdir, "daemon.log"), "w")
    proc = subprocess.Popen(
        [canzonad, "--unix-socket", sock, "--ready-file", ready,
         "--metrics-address", "", "--backend", "cpu", "--step-timeout", "600",
         "--register-timeout", "600"], stdout=log, stderr=log, env=env)
    for _ in range(200):
        if os.path.exists(ready) and os.path.getsize(ready) > 0:
            return proc, sock
        if proc.poll() is not None:
            raise SystemExit("canzonad exited before ready")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("canzonad not ready after 20 s")


class OtherLoad:
    """CPU time used by processes other than this benchmark's (the daemon,
    canzonactl and the step bench are this script's children) and by ours,
    in cores averaged over a run: the machine is shared, and what others run
    slows the measured steps down."""

    def __init__(self, daemon_pid):
        self.daemon_pid = daemon_pid
        self.start = self._sample()

    def _sample(self):
        fields = open("/proc/stat").readline().split()[1:]
        busy = sum(int(x) for i, x in enumerate(fields) if i not in (3, 4))
        ours = 0
        if self.daemon_pid:
            stat = open(f"/proc/{self.daemon_pid}/stat").read()
            parts = stat[stat.rindex(")") + 2:].split()
            ours += int(parts[11]) + int(parts[12])
        t = os.times()
        ticks = os.sysconf("SC_CLK_TCK")
        ours += (t.children_user + t.children_system + t.user + t.system) * \
            ticks
        return time.time(), busy, ours, ticks

    def cores(self):
        """(other processes' cores, this benchmark's cores)."""
        wall0, busy0, ours0, ticks = self.start
        wall1, busy1, ours1, _ = self._sample()
        span = max(wall1 - wall0, 1e-9) * ticks
        ours = (ours1 - ours0) / span
        return max(0.0, (busy1 - busy0) / span - ours), ours


def background_threads(other, ours, ranks):
    """The other work as busy threads on the cores (hardware_profile.h).
    On saturated cores the scheduler shares them per runnable thread, so
    the other work's share over ours is its threads over our ranks:
    b = ranks x other / ours. With cores to spare, what it used is what it
    wanted: b = other."""
    cores = os.cpu_count()
    if other + ours >= 0.9 * cores and ours > 0:
        return ranks * other / ours
    return other


def rows_for(name, idle, loaded, measured, other):
    """Per phase: (name, phase, predicted with the run's other load,
    measured, other load, predicted on an idle machine), in ms."""
    rows = []
    for phase in PHASES:
        p = 1e3 * loaded.get(phase, 0.0)
        m = measured.get(phase, 0.0)
        if p < 0.05 and m < 0.05:
            continue  # a phase this configuration does not have
        rows.append((name, phase, p, m, other, 1e3 * idle.get(phase, 0.0)))
    return rows


def step_bench_rows(build, ctl, profile, steps, out_dir):
    """canzona_step_bench: every strategy at DP2 x TP2 (its defaults)."""
    binary = os.path.join(build, "tests", "bench", "canzona_step_bench")
    load = OtherLoad(None)
    out = run([binary, "--model=qwen3-0.6b", "--layers=2", "--vocab=4096",
               "--dp=2", "--tp=2", f"--steps={steps + 1}"])
    other, ours = load.cores()
    background = background_threads(other, ours, 4)
    names = None
    rows = []
    for line in out.splitlines():
        cols = line.split()
        if cols and cols[0] == "strategy":
            names = cols[1:-2]  # ... wait total, vs sc
            continue
        if names and cols and cols[0] in ("sc", "layerwise", "start_anchored",
                                          "alpha", "cost"):
            values = [float(v[:-2]) for v in cols[1:1 + len(names)]]
            measured = dict(zip(names, values))
            flags = ["--dp", "2", "--tp", "2"]
            idle = simulate(ctl, profile, flags, 4000000, cols[0], 0)
            loaded = simulate(ctl, loaded_profile(profile, background,
                                                  out_dir, "step_bench"),
                              flags, 4000000, cols[0], 0)
            rows += rows_for(f"step_bench dp2 tp2 {cols[0]}", idle, loaded,
                             measured, background)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default=None, help="regex on config names")
    ap.add_argument("--no-step-bench", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    ctl = os.path.join(build, "client", "ctl", "canzonactl")
    canzonad = os.path.join(build, "server", "canzonad")
    out_dir = args.out or tempfile.mkdtemp(prefix="canzona-sim-validation.")
    os.makedirs(out_dir, exist_ok=True)

    cpu = "unknown"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    print(f"machine: {cpu}, {os.cpu_count()} cores, {platform.machine()}, "
          f"{platform.platform()}; load average at start "
          f"{os.getloadavg()[0]:.2f}")

    profile = args.profile
    if not profile:
        profile = os.path.join(out_dir, "this-machine.json")
        run([ctl, "calibrate", "--out", profile, "--min-time", "0.5"])
    print(f"profile: {profile}")

    rows = []
    workdir = tempfile.mkdtemp(prefix="canzona-sim-daemon.")
    daemon, sock = start_daemon(canzonad, workdir)
    try:
        for name, flags in CONFIGS:
            if args.only and not re.search(args.only, name):
                continue
            cmd = [ctl, "bench", "step", "--target", f"unix:{sock}", "--json",
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--timeout", "600"] + MODEL + flags
            load = OtherLoad(daemon.pid)
            bench = json.loads(run(cmd))
            other, ours = load.cores()
            ranks = int(flag(flags, "--dp", "1")) * int(flag(flags, "--tp", "1"))
            background = background_threads(other, ours, ranks)
            with open(os.path.join(out_dir, name.replace(" ", "_") + ".json"),
                      "w") as f:
                json.dump(bench, f, indent=1)
            shard = int(flag(flags, "--shard-group-size", "0"))
            for mode in bench["modes"]:
                if mode["overlap"]:
                    continue
                s = mode["shard_group_size"]
                label = name if (s == 0) == (shard == 0) else \
                    name.replace(f" S={shard}", " flat")
                idle = simulate(ctl, profile, flags, bench["bucket_size"],
                                bench["strategy"], s)
                loaded = simulate(ctl, loaded_profile(profile, background,
                                                      out_dir, name),
                                  flags, bench["bucket_size"],
                                  bench["strategy"], s)
                rows += rows_for(label, idle, loaded, mode["median_phase_ms"],
                                 background)
            print(f"done: {name} (other processes {other:.2f} cores, ours "
                  f"{ours:.2f}: {background:.2f} background threads)",
                  file=sys.stderr)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.no_step_bench and (not args.only or
                                   re.search(args.only, "step_bench")):
        rows += step_bench_rows(build, ctl, profile, args.steps, out_dir)

    within = sum(1 for r in rows if r[3] > 0 and abs(r[2] / r[3] - 1) <= 0.25)
    totals = [r for r in rows if r[1] == "total"]
    within_totals = sum(1 for r in totals if abs(r[2] / r[3] - 1) <= 0.25)
    if args.markdown:
        print("| configuration | phase | predicted | measured | pred / meas "
              "| background threads | predicted, idle machine |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    else:
        print(f"{'configuration':32} {'phase':15} {'predicted':>11} "
              f"{'measured':>11} {'pred/meas':>10} {'background':>10} "
              f"{'pred idle':>11}")
    for name, phase, p, m, other, idle in rows:
        ratio = p / m if m > 0 else float("inf")
        mark = "" if abs(ratio - 1) <= 0.25 else " *"
        if args.markdown:
            print(f"| {name} | {phase} | {p:.1f} ms | {m:.1f} ms | "
                  f"{ratio:.2f}{mark} | {other:.2f} | {idle:.1f} ms |")
        else:
            print(f"{name:32} {phase:15} {p:9.1f}ms {m:9.1f}ms "
                  f"{ratio:9.2f}{mark} {other:10.2f} {idle:9.1f}ms")
    print(f"{within} of {len(rows)} phases and {within_totals} of "
          f"{len(totals)} step totals within 25% (* outside); load average "
          f"at end {os.getloadavg()[0]:.2f}")
    print(f"raw results: {out_dir}")


if __name__ == "__main__":
    main()
