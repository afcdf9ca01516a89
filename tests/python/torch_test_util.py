"""Shared by the test_torch_*.py suites (canzona.torch against plain
PyTorch): run_ranks, which runs tests/python/torch_worker.py as a job's
ranks against a daemon and collects their results (EXPECTED_TRANSPORT,
the transport every rank must have used); the plain-PyTorch and float64
references the daemon's runs are compared with (newton_schulz, TorchMuon:
torch.optim.Muon's semantics; Float64Rule: canzona_reference's Shampoo /
SOAP; SETTINGS; reference_run and mixed_reference_run, the same training
in one process); and relative / assert_close. Not a test module itself.

A suite by hand, from the source tree (a canzonad starts per file):

  PYTHONPATH=client/python CANZONAD=build/server/canzonad \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_overlap.py
"""

import os
import subprocess
import sys
import uuid

import torch

import torch_worker
from conftest import HERE, transport_unavailable
import train_torch

import canzona.torch as ct

STEPS = 20
# The transport every rank must use: $CANZONA_TRANSPORT, else what "auto"
# picks (grpc where importable).
EXPECTED_TRANSPORT = (
    os.environ.get("CANZONA_TRANSPORT", "auto").replace("auto", "") or
    ("grpc" if transport_unavailable("grpc") is None else "bridge"))


def run_ranks(daemon, world, out_dir, *args, failing=False):
    """Runs torch_worker.py as `world` ranks; returns each rank's results
    (failing: each rank's exit code and output instead)."""
    job = "py-" + uuid.uuid4().hex[:12]
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    outs = []
    for rank in range(world):
        out = os.path.join(out_dir, "%s-%d.pt" % (job, rank))
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                   CANZONA_TARGET=daemon, OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "torch_worker.py"),
             "--job-id", job, "--out", out] +
            [a.replace("{rank}", str(rank)) for a in args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs.append(out)
    outputs = []
    for p in procs:
        output, _ = p.communicate(timeout=300)
        outputs.append((p.returncode, output.decode()))
        assert failing or p.returncode == 0, output.decode()
    if failing:
        return outputs
    results = [torch.load(o) for o in outs]
    for r in results:
        assert r["transport"] == EXPECTED_TRANSPORT, r["transport"]
    return results


# ---------------------------------------------------------------------------
# References.

def newton_schulz(g, steps=5, eps=1e-7):
    """torch.optim.Muon's orthogonalization, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / (x.norm() + eps)
    for _ in range(steps):
        m = x @ x.t()
        x = a * x + (b * m + c * m @ m) @ x
    return x.t() if transposed else x


class TorchMuon:
    """torch.optim.Muon semantics: momentum by lerp, Nesterov, 5 quintic
    Newton-Schulz steps, lr * sqrt(max(1, rows / cols)), decoupled decay."""

    def __init__(self, lr, momentum=0.95, weight_decay=0.0):
        self.lr, self.momentum, self.wd = lr, momentum, weight_decay
        self.buf = {}

    def step(self, p, g, lr):
        buf = self.buf.setdefault(id(p), torch.zeros_like(p))
        buf.lerp_(g, 1 - self.momentum)
        update = g.lerp(buf, self.momentum)
        o = newton_schulz(update)
        scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        p.mul_(1 - lr * self.wd)
        p.add_(o.float(), alpha=-lr * scale)


class Float64Rule:
    """canzona_reference's float64 Shampoo / SOAP on a float32 parameter."""

    def __init__(self, kind, shape, settings):
        import canzona_reference
        self.rule = canzona_reference.make_rule(kind, tuple(shape), settings)

    def step(self, p, g, lr):
        value = p.double().numpy().copy()
        self.rule.step(value, g.double().numpy(), lr=lr)
        p.copy_(torch.from_numpy(value).float())


SETTINGS = {
    "muon": ({"lr": 0.02}, {"lr": 3e-3, "weight_decay": 0.01}),
    "shampoo": ({"lr": 3e-3, "beta1": 0.9, "beta2": 1.0,
                 "epsilon": torch_worker.SHAMPOO_EPSILON,
                 "weight_decay": 0.0, "precondition_frequency": 2},
                {"lr": 3e-3, "weight_decay": 0.0}),
    "soap": ({"lr": 3e-3, "beta1": 0.95, "beta2": 0.95, "eps": 1e-8,
              "weight_decay": 0.01, "precondition_frequency": 2,
              "max_precond_dim": torch_worker.SOAP_MAX_PRECOND_DIM},
             {"lr": 3e-3, "weight_decay": 0.0}),
}


def reference_run(kind, world, steps, halve_lr=False, schedule=None):
    """The same training in one process with plain-PyTorch optimizers and
    the DP-averaged gradient. schedule: per step, {group: param_group}
    as a scheduler left canzona's param_groups before that step (lr,
    and Muon's momentum or the betas), applied to the references."""
    model = train_torch.build_model(seed=0)
    matrix_settings, adamw_settings = SETTINGS[kind]
    named = list(model.named_parameters())
    matrix = [(n, p) for n, p in named if ct.default_route(n, p, kind) == kind]
    adamw_params = [p for n, p in named if ct.default_route(n, p, kind) == "adamw"]
    adamw = torch.optim.AdamW(adamw_params, lr=adamw_settings["lr"],
                              betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=adamw_settings["weight_decay"])
    if kind == "muon":
        rule = TorchMuon(matrix_settings["lr"])
        rules = {n: rule for n, _ in matrix}
    else:
        rules = {n: Float64Rule(kind, p.shape, matrix_settings)
                 for n, p in matrix}
    losses = []
    for step in range(1, steps + 1):
        grads = {n: torch.zeros_like(p) for n, p in named}
        for rank in range(world):
            model.zero_grad()
            loss = train_torch.loss_fn(model, step, rank)
            loss.backward()
            if rank == 0:
                losses.append(loss.item())
            for n, p in named:
                grads[n] += p.grad
        factor = 1.0 / world
        scale = 0.5 ** (step - 1) if halve_lr else 1.0
        with torch.no_grad():
            for n, p in named:
                p.grad = grads[n] * factor
            matrix_lr = matrix_settings["lr"] * scale
            for group in adamw.param_groups:
                group["lr"] = adamw_settings["lr"] * scale
            if schedule:
                now = schedule[step - 1]
                adamw.param_groups[0]["lr"] = now["adamw"]["lr"]
                adamw.param_groups[0]["betas"] = now["adamw"]["betas"]
                matrix_lr = now[kind]["lr"]
                for rule in rules.values():
                    if kind == "muon":
                        rule.momentum = now[kind]["momentum"]
                    else:
                        (rule.rule.config["beta1"],
                         rule.rule.config["beta2"]) = now[kind]["betas"]
            adamw.step()
            for n, p in matrix:
                rules[n].step(p, p.grad, matrix_lr)
    return losses, {n: p.detach().clone() for n, p in named}


def mixed_reference_run(rank_grads, round_each_step=False, max_grad_norm=0.0,
                        keep_fp32=""):
    """Plain-PyTorch mixed precision, as Megatron users write it: a
    bfloat16 model; fp32 master weights and optimizer state
    (torch.optim.AdamW, and Muon as above, on the masters); the ranks'
    bfloat16 gradients summed in bfloat16 (Megatron's default: a sum
    accumulated in fp32 and rounded once) and DP-averaged in fp32;
    torch.nn.utils.clip_grad_norm_ on the masters' gradients when
    max_grad_norm is set; the new parameters rounded once per step into
    the model. Returns the parameters and each step's pre-clip norm. It is fed the gradients the
    trainers computed (rank_grads[rank][step - 1]): bfloat16 forward and
    backward amplify any one-ulp difference chaotically (Adam normalizes
    away the size of tiny gradients), so a closed-loop comparison would
    measure that chaos, not the optimizer. round_each_step: no master
    weights (the masters are rounded after every step), the negative
    control. keep_fp32: the parameters whose name contains it are float32
    (their own masters), and the ranks' gradients are summed in fp32, as
    the daemon sums a bucket whose parameters mix dtypes (the test model
    fits one bucket)."""
    model = train_torch.build_model(seed=0).to(torch.bfloat16)
    for n, p in model.named_parameters():
        if keep_fp32 and keep_fp32 in n:
            p.data = p.data.float()
    matrix_settings, adamw_settings = SETTINGS["muon"]
    named = list(model.named_parameters())
    master = {n: torch.nn.Parameter(p.detach().float().clone())
              for n, p in named}
    matrix = [n for n, p in named if ct.default_route(n, p, "muon") == "muon"]
    adamw = torch.optim.AdamW(
        [master[n] for n, p in named if n not in matrix],
        lr=adamw_settings["lr"], betas=(0.9, 0.999), eps=1e-8,
        weight_decay=adamw_settings["weight_decay"])
    muon = TorchMuon(matrix_settings["lr"])
    world = len(rank_grads)
    norms = []
    with torch.no_grad():
        for step_grads in zip(*rank_grads):
            for n, _ in named:
                total = torch.zeros_like(master[n])
                for g in step_grads:
                    total += g[n].float()
                if world > 1 and not keep_fp32:
                    total = total.to(torch.bfloat16).float()
                master[n].grad = total * (1.0 / world)
            if max_grad_norm > 0:
                norms.append(torch.nn.utils.clip_grad_norm_(
                    list(master.values()), max_grad_norm).item())
            adamw.step()
            for n in matrix:
                muon.step(master[n], master[n].grad, matrix_settings["lr"])
            for n, p in named:
                p.copy_(master[n])  # round to nearest even, once
                if round_each_step:
                    master[n].copy_(p)
    return {n: p.detach().clone() for n, p in named}, norms


def relative(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def assert_close(result, reference, tol, param_tol=None):
    """Losses within `tol` relative; parameters (norm-relative, per tensor)
    within `param_tol` (default `tol`)."""
    ref_losses, ref_params = reference
    for got, want in zip(result["losses"], ref_losses):
        assert abs(got - want) <= tol * abs(want), (got, want)
    worst = max(relative(result["params"][n], ref_params[n])
                for n in ref_params)
    assert worst <= (param_tol or tol), worst
    return worst
