#!/usr/bin/env python3
"""Asserts what the bundle's runner must report on a machine without a GPU
(check_bundle.sh on this machine, chroot_smoke.sh in a bare Debian):

  - report.md and report.json exist, and no check failed;
  - the CPU job stepped: cpu-step-bench and cpu-tp-mlp-trainer passed (the
    trainer's loss fell);
  - every gpu-labelled test binary ran, nothing failed, and its tests that
    need a GPU reported skipped;
  - the GPU checks (bench kernels, torch NS5, the cuda step benchmarks, the
    PyTorch check and step benchmark) are skipped because there is no GPU;
  - with --no-python: the Python checks are skipped for want of python3.

    check_report.py REPORT_DIR [--gpu-tests N] [--no-python]
"""

import argparse
import json
import os
import sys

GPU_CHECKS = ("bench-kernels-bf16", "bench-kernels-fp32", "torch-ns5",
              "step-cuda-nccl-ws1", "step-cuda-gloo-dp2", "torch-check",
              "torch-step-bench", "torch-step-bench-gloo")
CPU_CHECKS = ("cpu-step-bench", "cpu-tp-mlp-trainer")
PYTHON_CHECKS = ("torch-check", "python-example-trainer")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir")
    parser.add_argument("--gpu-tests", type=int, default=0,
                        help="how many gpu test binaries the bundle holds")
    parser.add_argument("--no-python", action="store_true")
    args = parser.parse_args()

    errors = []
    md_path = os.path.join(args.report_dir, "report.md")
    json_path = os.path.join(args.report_dir, "report.json")
    for path in (md_path, json_path):
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            errors.append("%s missing or empty" % path)
    if errors:
        print("\n".join(errors))
        return 1
    with open(json_path) as f:
        report = json.load(f)
    if "checks" not in report:
        print("report.json has no checks: %s" % report)
        return 1
    checks = {c["name"]: c for c in report["checks"]}

    def expect(name, status, reason_part=None):
        check = checks.get(name)
        if check is None:
            errors.append("%s: not in the report" % name)
            return
        if check["status"] != status:
            errors.append("%s: %s (%s), expected %s" % (
                name, check["status"], check["reason"], status))
        elif reason_part and reason_part not in check["reason"]:
            errors.append("%s: reason %r lacks %r" % (
                name, check["reason"], reason_part))

    if report["summary"]["failed"] != 0:
        failed = [c["name"] + ": " + c["reason"] for c in report["checks"]
                  if c["status"] == "failed"]
        errors.append("failed checks: %s" % "; ".join(failed))
    if report["gpu"]["present"]:
        errors.append("the report says a GPU is present")
    for name in CPU_CHECKS:
        expect(name, "passed")
    gpu_tests = [c for c in report["checks"] if c["kind"] == "gtest"]
    if args.gpu_tests and len(gpu_tests) != args.gpu_tests:
        errors.append("%d gpu test binaries reported, the bundle holds %d" %
                      (len(gpu_tests), args.gpu_tests))
    if not gpu_tests:
        errors.append("no gpu test binary reported")
    # Each binary ran its tests and skipped those that need a GPU (some,
    # such as the IPC test's parsing, need none and pass).
    for check in gpu_tests:
        figures = check["figures"]
        if check["status"] not in ("skipped", "passed"):
            errors.append("%s: %s (%s)" % (check["name"], check["status"],
                                           check["reason"]))
        elif figures.get("skipped", 0) < 1:
            errors.append("%s: no test skipped without a GPU (%s)" %
                          (check["name"], check["reason"]))
    for name in GPU_CHECKS:
        expect(name, "skipped", "no GPU")
    if args.no_python:
        expect("python-example-trainer", "skipped", "no python3")
    if errors:
        print("check_report.py: %s:" % args.report_dir)
        print("\n".join("  " + e for e in errors))
        return 1
    s = report["summary"]
    print("check_report.py: no-GPU report as expected (%d passed, %d skipped)"
          % (s["passed"], s["skipped"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
