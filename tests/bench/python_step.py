#!/usr/bin/python3
"""canzona.torch's optimizer step: over gRPC and through the step doorbell,
side by side in one run.

One canzonad on a private unix socket, one rank (DP1) of a small model
(two Linear layers: a Muon matrix pair and AdamW biases), and two
canzona.torch.Muon optimizers on identical copies of it: one with
step_doorbell=False (every step a gRPC call), one with the doorbell. They
step in alternation on the same batches, so the machine's noise hits both.
Reports per mode the median and p90 of opt.step() as the trainer sees it and
of the daemon's own step ("total"), the ratio, and checks that both copies
end bitwise equal (the same optimizer either way).

    /usr/bin/python3 tests/bench/python_step.py [--steps N] [--json FILE]
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# The daemon the way the peers benchmark starts it (this folder is on
# sys.path as the script's own); it also puts client/python on sys.path.
from torch_peers import ROOT, start_daemon

from canzona.cli import ArgumentParser  # noqa: E402


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main():
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--canzonad", default=os.path.join(ROOT, "build", "server",
                                                      "canzonad"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for flag, value in (("--steps", args.steps), ("--hidden", args.hidden)):
        if value < 1:
            print("python_step.py: %s must be >= 1" % flag, file=sys.stderr)
            sys.exit(2)
    if args.warmup < 0:
        print("python_step.py: --warmup must be >= 0", file=sys.stderr)
        sys.exit(2)

    import torch
    import canzona.torch as ct

    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1")
    workdir = tempfile.mkdtemp(prefix="canzona-pystep-")
    daemon, target, _ = start_daemon(args.canzonad, workdir, "cpu")
    try:
        models, opts = {}, {}
        for mode, doorbell in (("grpc", False), ("doorbell", True)):
            torch.manual_seed(0)
            models[mode] = torch.nn.Sequential(
                torch.nn.Linear(args.hidden, args.hidden),
                torch.nn.Linear(args.hidden, args.hidden))
            opts[mode] = ct.Muon(models[mode].named_parameters(), lr=0.02,
                                 target=target, job_id="pystep-" + mode,
                                 step_doorbell=doorbell)
        if not opts["doorbell"].client._doorbells:
            sys.exit("python_step.py: no step doorbell here (needs the grpc "
                     "transport, Linux on x86-64 and protobuf)")
        seen = {m: {"step": [], "daemon": []} for m in models}
        for i in range(args.warmup + args.steps):
            x = torch.randn(8, args.hidden)
            for mode in models:
                models[mode](x).square().sum().backward()
                t0 = time.perf_counter()
                opts[mode].step()
                took = time.perf_counter() - t0
                opts[mode].zero_grad()
                if i >= args.warmup:
                    seen[mode]["step"].append(took)
                    seen[mode]["daemon"].append(
                        opts[mode].last_step["seconds"]["total"])
        equal = all(torch.equal(a, b) for a, b in zip(
            models["grpc"].parameters(), models["doorbell"].parameters()))
        for opt in opts.values():
            opt.close()
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    for mode, s in seen.items():
        rows.append({"mode": mode,
                     "step_p50_ms": 1e3 * statistics.median(s["step"]),
                     "step_p90_ms": 1e3 * percentile(s["step"], 0.9),
                     "daemon_p50_ms": 1e3 * statistics.median(s["daemon"])})
    ratio = rows[0]["step_p50_ms"] / rows[1]["step_p50_ms"]
    print("canzona.torch step, DP1, %d steps after %d warm-up (hidden %d)"
          % (args.steps, args.warmup, args.hidden))
    print("%-10s %12s %12s %14s" % ("mode", "step p50 ms", "step p90 ms",
                                    "daemon p50 ms"))
    for r in rows:
        print("%-10s %12.3f %12.3f %14.3f" % (r["mode"], r["step_p50_ms"],
                                              r["step_p90_ms"],
                                              r["daemon_p50_ms"]))
    print("doorbell: %.2fx faster than gRPC at p50; parameters %s" %
          (ratio, "bitwise equal" if equal else "DIFFER"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "hidden": args.hidden,
                       "modes": rows, "grpc_over_doorbell": ratio,
                       "bitwise_equal": equal}, f, indent=2)
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
