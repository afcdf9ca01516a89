#!/usr/bin/env python3
"""Newton-Schulz in bf16: does folding "a X" into the polynomial change the
error?

The cuda backend's standard iteration used to compute X <- a X + B X with
B = b A + c A A, which needs a copy of X per step (cuBLAS's C may not alias
an input). It now computes X <- B' X with B' = a I + b A + c A A (one pass
over the n x n A instead of a read and a write of X). In float32 the two are
the same to rounding; in bf16 the diagonal's a is rounded with B'. This
script emulates the cuda backend's bf16 GEMMs (bf16 operands, float32
accumulation, alpha A B + beta C in float32, one rounding to bf16) for both
and compares each with a float64 iteration on gaussian, 4-decade and low-rank
inputs over several seeds. Needs torch (CPU).

    python3 tests/bench/ns_fold_rounding.py [--seeds 6]
"""
import argparse
import statistics

import torch

COEFFICIENTS = [(3.4445, -4.7750, 2.0315)] * 5


def bf16(t):
    return t.to(torch.bfloat16).to(torch.float32)


def gemm(alpha, a, b, beta=0.0, c=None):
    """cuBLAS bf16 GEMM: bf16 operands, float32 accumulate and epilogue."""
    acc = (alpha * (bf16(a).double() @ bf16(b).double())).float()
    if c is not None and beta != 0.0:
        acc = acc + beta * bf16(c)
    return bf16(acc)


def reference(x):
    x = x.double()
    x = x / (x.norm() + 1e-7)
    for a, b, c in COEFFICIENTS:
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x


def with_copy(x):
    x = bf16(x / (x.norm() + 1e-7))
    for a, b, c in COEFFICIENTS:
        g = gemm(1.0, x, x.T)
        poly = gemm(c, g, g, b, g)        # C: a copy of A
        x = gemm(1.0, poly, x, a, x)      # C: a copy of X
    return x


def folded(x):
    x = bf16(x / (x.norm() + 1e-7))
    for a, b, c in COEFFICIENTS:
        g = gemm(1.0, x, x.T)
        start = bf16(b * g + a * torch.eye(g.shape[0]))  # NsScaleAddIdentity
        poly = gemm(c, g, g, 1.0, start)
        x = gemm(1.0, poly, x)            # beta 0: no copy
    return x


def inputs(s, l):
    yield "gaussian", torch.randn(s, l)
    u, _, v = torch.linalg.svd(torch.randn(s, l), full_matrices=False)
    yield "4 decades", (u * torch.logspace(0, -4, s)) @ v
    yield "rank 8 + noise", (torch.randn(s, 8) @ torch.randn(8, l) +
                             1e-3 * torch.randn(s, l))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args()
    shapes = [(128, 384), (256, 256), (192, 768)]
    errors = {}
    for seed in range(args.seeds):
        torch.manual_seed(100 + seed)
        for s, l in shapes:
            for name, x in inputs(s, l):
                ref = reference(x)
                for label, f in (("copy", with_copy), ("folded", folded)):
                    err = ((f(x).double() - ref).norm() / ref.norm()).item()
                    errors.setdefault(name, {}).setdefault(label, []).append(
                        err)
    print("| input | relative error, copy of X (median) | folded (median) "
          "| folded / copy: median, min, max |")
    print("| --- | --- | --- | --- |")
    for name, by in errors.items():
        ratios = [f / c for f, c in zip(by["folded"], by["copy"])]
        print("| %s | %.3e | %.3e | %.3f, %.3f, %.3f |" % (
            name, statistics.median(by["copy"]),
            statistics.median(by["folded"]), statistics.median(ratios),
            min(ratios), max(ratios)))
    print("(%d seeds x shapes %s)" % (args.seeds, ", ".join(
        "%dx%d" % s for s in shapes)))


if __name__ == "__main__":
    main()
