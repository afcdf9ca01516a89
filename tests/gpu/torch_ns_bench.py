#!/usr/bin/env python3
"""PyTorch's Newton-Schulz (NS5) on the shapes `canzonactl bench kernels`
timed, on the same GPU and timed the same way, for the bundle's report
(tests/gpu/bundle): per shape and precision, torch's time in its default
form and in its addmm form, and torch's GEMM rate for the product NS spends
its time in ((s x s) times (s x l), s = min(rows, cols), l = max).

    torch_ns_bench.py --ours bench-kernels-bf16.json --ours bench-kernels-fp32.json \\
        [--min-time 0.5] --out torch-ns5.json
    torch_ns_bench.py --shapes 8192x5120,1024x5120 --precisions bf16 --out x.json
    torch_ns_bench.py --device cpu --shapes 96x160 --out x.json   # self-test

bf16 is torch.optim.Muon's own iteration (torch.optim._muon's
_zeropower_via_newtonschulz: input cast to bf16, 5 quintic steps with
(3.4445, -4.7750, 2.0315)) when torch has it (>= 2.9), else the same
iteration written here. fp32 is that iteration in float32 (torch has no
fp32 NS5) with TF32 off, as our fp32 GEMMs. Inputs are fresh normal
float32 matrices (what the optimizer hands NS). Timing: CUDA events around
each call, 3 warm-up calls, then calls until --min-time seconds have passed
and at least 5 ran; the median.

Writes {status: passed|skipped|failed, reason, torch, device, impl,
shapes: [{precision, rows, cols, ns_ms, ns_addmm_ms, ns_gflops, gemm_ms,
gemm_gflops}]} to --out; exit status 0 unless it failed.
"""

import argparse
import inspect
import json
import os
import sys
import time
import traceback

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7


def ns_flops(rows, cols, steps=STEPS):
    """GEMM-equivalent flops, as kernels/workload.h counts them."""
    s, l = min(rows, cols), max(rows, cols)
    return steps * (4.0 * s * s * l + 2.0 * s * s * s)


def own_ns(torch, grad, dtype, addmm):
    """The standard quintic Newton-Schulz iteration (torch.optim.Muon's)."""
    a, b, c = COEFFICIENTS
    x = grad.to(dtype)
    transposed = grad.size(0) > grad.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(STEPS):
        gram = x @ x.T
        if addmm:
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
        else:
            update = b * gram + c * gram @ gram
            x = a * x + update @ x
    return x.T if transposed else x


def torch_muon_ns():
    """torch.optim.Muon's NS function and whether it takes use_addmm."""
    try:
        from torch.optim import _muon
        fn = _muon._zeropower_via_newtonschulz
    except (ImportError, AttributeError):
        return None, False
    return fn, "use_addmm" in inspect.signature(fn).parameters


def median_ms(torch, fn, min_time, device):
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    samples, total = [], 0.0
    while len(samples) < 5 or total < min_time:
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:  # --device cpu (self-tests): the host clock
            t0 = time.perf_counter()
            fn()
            ms = 1e3 * (time.perf_counter() - t0)
        samples.append(ms)
        total += ms / 1e3
    samples.sort()
    return samples[len(samples) // 2]


def shapes_from(paths, explicit, precisions):
    """{precision: [(rows, cols)]} from bench kernels' JSON (its
    ns_precision and shapes) or --shapes for every precision."""
    wanted = {p: [] for p in precisions}
    for path in paths:
        try:
            with open(path) as f:
                ours = json.load(f)
        except (OSError, ValueError):
            continue
        p = ours.get("ns_precision")
        if p in wanted:
            wanted[p] = [(s["rows"], s["cols"]) for s in ours.get("shapes", [])]
    for p in precisions:
        if not wanted[p] and explicit:
            wanted[p] = explicit
    return wanted


def run(args, result):
    try:
        import torch
    except Exception as e:
        result.update(status="skipped", reason="torch is not importable: %s" % e)
        return
    result["torch"] = torch.__version__
    device = torch.device(args.device, 0) if args.device == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        result.update(status="skipped", reason="torch sees no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result["device"] = (torch.cuda.get_device_name(0)
                        if device.type == "cuda" else "cpu")
    muon_ns, has_addmm = torch_muon_ns()
    result["impl"] = {
        "bf16": "torch.optim._muon._zeropower_via_newtonschulz" if muon_ns
                else "the same iteration written here (torch has no Muon)",
        "bf16_addmm": "torch.optim._muon (use_addmm=True)" if has_addmm
                      else "the addmm form written here",
        "fp32": "the iteration in float32, written here (TF32 off)",
    }
    explicit = [tuple(int(x) for x in s.split("x"))
                for s in args.shapes.split(",") if s] if args.shapes else []
    wanted = shapes_from(args.ours, explicit, args.precisions.split(","))
    if not any(wanted.values()):
        result.update(status="skipped",
                      reason="no shapes: bench kernels wrote no JSON and no "
                             "--shapes were given")
        return
    generator = torch.Generator(device=device)
    generator.seed()
    for precision, shapes in wanted.items():
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for rows, cols in shapes:
            grad = torch.randn(rows, cols, device=device, generator=generator)
            if precision == "bf16" and muon_ns is not None:
                # Newer torch takes use_addmm without a default.
                extra = {"use_addmm": False} if has_addmm else {}

                def default():
                    return muon_ns(grad, COEFFICIENTS, STEPS, EPS, **extra)
            else:
                def default():
                    return own_ns(torch, grad, dtype, False)
            if precision == "bf16" and has_addmm:
                def addmm():
                    return muon_ns(grad, COEFFICIENTS, STEPS, EPS, use_addmm=True)
            else:
                def addmm():
                    return own_ns(torch, grad, dtype, True)
            s, l = min(rows, cols), max(rows, cols)
            a = torch.randn(s, s, device=device, dtype=dtype, generator=generator)
            b = torch.randn(s, l, device=device, dtype=dtype, generator=generator)
            ns_ms = median_ms(torch, default, args.min_time, device)
            addmm_ms = median_ms(torch, addmm, args.min_time, device)
            gemm_ms = median_ms(torch, lambda: torch.mm(a, b), args.min_time,
                                device)
            result["shapes"].append({
                "precision": precision, "rows": rows, "cols": cols,
                "ns_ms": ns_ms, "ns_addmm_ms": addmm_ms,
                "ns_gflops": ns_flops(rows, cols) / ns_ms / 1e6,
                "gemm_ms": gemm_ms,
                "gemm_gflops": 2.0 * s * s * l / gemm_ms / 1e6,
            })
            print("%s %dx%d: NS5 %.3f ms (addmm %.3f ms), GEMM %.0f GFLOP/s"
                  % (precision, rows, cols, ns_ms, addmm_ms,
                     result["shapes"][-1]["gemm_gflops"]), flush=True)
            # What is measured so far survives a cut at the runner's limit.
            result["reason"] = "cut after %d shapes" % len(result["shapes"])
            write(args, result)
            del grad, a, b
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result.update(status="passed", reason="")


def write(args, result):
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ours", action="append", default=[],
                        help="canzonactl bench kernels --json output")
    parser.add_argument("--shapes", default="",
                        help="RxC,... when there is no --ours file")
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: self-tests, timed with the host clock")
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-exit-code", type=int, default=0,
                        help="exit status when skipped (ctest: 77)")
    args = parser.parse_args()
    result = {"status": "failed", "reason": "", "timing":
              "CUDA events, 3 warm-up calls, median of >= 5 calls and >= "
              "%g s" % args.min_time, "shapes": []}
    try:
        run(args, result)
    except Exception as e:
        traceback.print_exc()
        result.update(status="failed", reason="%s: %s" % (type(e).__name__, e))
    write(args, result)
    print("torch_ns_bench: %s %s" % (result["status"], result["reason"]))
    if result["status"] == "skipped":
        return args.skip_exit_code
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
