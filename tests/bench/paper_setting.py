#!/usr/bin/env python3
"""The paper's 256-GPU setting on paper (Canzona, arXiv 2602.06079:
Qwen3 8B-32B on 256 GPUs; 5.8x lower optimizer-step latency and 1.57x
end-to-end over Megatron's layerwise optimizer).

  tests/bench/paper_setting.py --build-dir build [--profile h100-node]
      [--tokens 2097152] [--mfu 0.4]

For Qwen3-8B/14B/32B at DP32 x TP8 and DP64 x TP4 (PP 1, megatron layout,
bf16 parameters and DP traffic, Muon + AdamW, buckets of 4e8 elements,
every other planner default) it runs `canzonactl simulate --overlap` on
the profile and prints two markdown tables:

1. the predicted optimizer step of sc, layerwise, alpha and cost with
   everything exposed, and the ratios layerwise / cost, layerwise / alpha,
   sc / cost (the paper: 5.8x);
2. the part of the step that overlap cannot hide (from the last gradient
   reduction to the first parameter gather: norms, updates, TP pipeline),
   its ratio, and the iteration layerwise / cost (the paper: 1.57x) for a
   stated forward + backward: 6 x parameters x tokens per iteration over
   256 GPUs x MFU x 989.4 TFLOP/s (H100 SXM dense bf16 peak), backward
   2/3 of it, without overlap and with GradReady / WaitParams overlap.

Every figure is a prediction of the model from the profile's stated
assumptions; nothing here was measured on a GPU.
"""

import argparse
import json
import os
import subprocess

MODELS = ["qwen3-8b", "qwen3-14b", "qwen3-32b"]
LAYOUTS = [(32, 8), (64, 4)]
PEAK_BF16 = 989.4e12  # H100 SXM dense bf16, NVIDIA datasheet


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--profile", default="h100-node")
    ap.add_argument("--tokens", type=float, default=2 ** 21)
    ap.add_argument("--mfu", type=float, default=0.4)
    args = ap.parse_args()
    ctl = os.path.join(os.path.abspath(args.build_dir), "client", "ctl",
                       "canzonactl")
    rows = []
    for model in MODELS:
        for dp, tp in LAYOUTS:
            # The trainer's compute needs the model size: ask once.
            size = json.loads(subprocess.run(
                [ctl, "simulate", "--model", model, "--dp", str(dp), "--tp",
                 str(tp), "--profile", args.profile, "--json"], check=True,
                capture_output=True, text=True).stdout)["elements"]
            fwd_bwd = 6 * size * args.tokens / (256 * args.mfu * PEAK_BF16)
            out = json.loads(subprocess.run(
                [ctl, "simulate", "--model", model, "--dp", str(dp), "--tp",
                 str(tp), "--profile", args.profile, "--dtype", "bf16",
                 "--overlap", "--backward-ms", str(1e3 * fwd_bwd * 2 / 3),
                 "--forward-ms", str(1e3 * fwd_bwd / 3), "--json"],
                check=True, capture_output=True, text=True).stdout)
            by = {s["strategy"]: s for s in out["strategies"]}
            rows.append((model, dp, tp, size, fwd_bwd, by))

    print("Optimizer step, everything exposed (predicted):\n")
    print("| model | DP x TP | sc | layerwise | alpha | cost | "
          "layerwise / cost | layerwise / alpha | sc / cost |")
    print("|" + " --- |" * 9)
    for model, dp, tp, _, _, by in rows:
        step = {k: v["step_s"] for k, v in by.items()}
        print(f"| {model} | {dp} x {tp} | {step['sc']:.3f} s | "
              f"{step['layerwise']:.3f} s | {step['alpha']:.3f} s | "
              f"{step['cost']:.3f} s | "
              f"{step['layerwise'] / step['cost']:.2f}x | "
              f"{step['layerwise'] / step['alpha']:.2f}x | "
              f"{step['sc'] / step['cost']:.2f}x |")

    print("\nWhat overlap cannot hide, and the iteration (predicted):\n")
    print("| model | DP x TP | fwd+bwd (stated) | update span layerwise | "
          "update span cost | ratio | iteration layerwise / cost, no "
          "overlap | with overlap |")
    print("|" + " --- |" * 8)
    for model, dp, tp, _, fwd_bwd, by in rows:
        lw, cost = by["layerwise"]["overlap"], by["cost"]["overlap"]
        print(f"| {model} | {dp} x {tp} | {fwd_bwd:.2f} s | "
              f"{lw['update_span_s']:.3f} s | {cost['update_span_s']:.3f} s "
              f"| {lw['update_span_s'] / cost['update_span_s']:.2f}x | "
              f"{lw['plain_iteration_s'] / cost['plain_iteration_s']:.3f}x | "
              f"{lw['overlap_iteration_s'] / cost['overlap_iteration_s']:.3f}x"
              " |")
    print(f"\nprofile {args.profile}; fwd+bwd = 6 x parameters x "
          f"{args.tokens:.0f} tokens / (256 x {args.mfu} x "
          f"{PEAK_BF16 / 1e12:.1f} TFLOP/s), backward 2/3 of it.")


if __name__ == "__main__":
    main()
