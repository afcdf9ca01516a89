"""canzona.torch against plain PyTorch: the example decoder trained through
the daemon (1 and 2 processes) equals reference implementations written
here (Muon as torch.optim.Muon defines it, torch.optim.AdamW, and the
float64 Shampoo / SOAP of canzona_reference); learning-rate schedulers reach
the daemon; state_dict() resumes bitwise in new processes; bad use raises
clear errors.

Run by ctest (label python): from a pip-installed copy (grpc transport)
and from the source tree through canzona-bridge (CANZONA_TRANSPORT=bridge).
By hand: PYTHONPATH=client/python CANZONAD=build/server/canzonad \
  /usr/bin/python3 -m pytest tests/python/test_torch.py
"""

import collections
import contextlib
import copy
import gc
import io
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
import warnings
import weakref

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
sys.path.insert(0, HERE)

import torch_worker  # noqa: E402
from conftest import start_daemon, transport_unavailable  # noqa: E402
import train_torch  # noqa: E402

import canzona  # noqa: E402
import canzona.torch as ct  # noqa: E402

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


# ---------------------------------------------------------------------------
# Tests.

@pytest.mark.parametrize("world", [1, 2])
def test_muon_matches_plain_pytorch(daemon, tmp_path, world):
    results = run_ranks(daemon, world, str(tmp_path), "--optimizer", "muon",
                        "--last", str(STEPS))
    reference = reference_run("muon", world, STEPS)
    worst = assert_close(results[0], reference, 1e-5)
    # Every DP rank ends with the same parameters.
    for other in results[1:]:
        for n, p in results[0]["params"].items():
            assert torch.equal(p, other["params"][n]), n
    print("muon DP%d: worst parameter relative error %.2e" % (world, worst))
    # The negative control: a reference with another momentum is far off.
    losses, params = reference
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("world", [1, 2])
def test_bfloat16_model_matches_a_mixed_precision_reference(daemon, tmp_path,
                                                           world):
    results = run_ranks(daemon, world, str(tmp_path), "--optimizer", "muon",
                        "--dtype", "bfloat16", "--record-grads",
                        "--last", str(STEPS))
    # Nothing in fp32 on the trainer side: parameters, gradients and the
    # shared buffer are bfloat16 (the masters live in the daemon).
    for r in results:
        assert r["dtypes"] == ["torch.bfloat16"], r["dtypes"]
    reference, _ = mixed_reference_run([r["grads"] for r in results])
    # The reference orthogonalizes in float64, the daemon in fp32: their
    # masters differ by float32 rounding, which flips the bfloat16 rounding
    # of a few elements by one ulp; per tensor that stays far below one
    # ulp (2^-8) norm-relative.
    worst = max(relative(results[0]["params"][n], reference[n])
                for n in reference)
    assert worst <= 2.0 ** -8, worst
    for other in results[1:]:
        for n, p in results[0]["params"].items():
            assert torch.equal(p, other["params"][n]), n
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    # Without master weights the small AdamW updates of the norm weights
    # (below a bfloat16 ulp near 1.0) are lost: the same comparison fails.
    rounded, _ = mixed_reference_run([r["grads"] for r in results],
                                     round_each_step=True)
    lost = max(relative(results[0]["params"][n], rounded[n])
               for n in rounded)
    assert lost > 2.0 ** -8, lost
    print("bf16 DP%d: worst parameter relative error %.2e (without masters "
          "%.2e)" % (world, worst, lost))


@pytest.mark.parametrize("world", [1, 2])
def test_a_bfloat16_model_with_fp32_norms_keeps_each_dtype(daemon, tmp_path,
                                                          world):
    """A bfloat16 model whose norm weights stay float32 (Hugging Face's
    _keep_in_fp32_modules, a habit for stable training): one optimizer
    takes both; each parameter and its gradient keep their dtype, and the
    run equals the mixed-precision reference. Before, construction raised
    "one dtype per optimizer"."""
    results = run_ranks(daemon, world, str(tmp_path), "--optimizer", "muon",
                        "--dtype", "bfloat16", "--keep-fp32", "norm",
                        "--record-grads", "--last", "8")
    for r in results:
        for n, dtypes in r["param_dtypes"].items():
            want = "torch.float32" if "norm" in n else "torch.bfloat16"
            assert dtypes == (want, want), (n, dtypes)
    reference, _ = mixed_reference_run([r["grads"] for r in results],
                                       keep_fp32="norm")
    # As in the bfloat16 test: fp32 against float64 orthogonalization
    # flips a few bfloat16 roundings by one ulp; the fp32 norms differ by
    # float32 rounding only.
    for n, want in reference.items():
        got = results[0]["params"][n]
        assert got.dtype == want.dtype, n
        assert relative(got, want) <= (1e-5 if "norm" in n else 2.0 ** -8), n
    for other in results[1:]:
        for n, p in results[0]["params"].items():
            assert torch.equal(p, other["params"][n]), n
    # The norms trained in fp32: updates below a bfloat16 ulp were kept,
    # which a daemon rounding them to bfloat16 would have lost.
    norms = [p for n, p in results[0]["params"].items() if "norm" in n]
    assert any(not torch.equal(p, p.bfloat16().float()) for p in norms)
    if world > 1:
        # Overlapped, over many buckets (some of one dtype, some mixed):
        # bitwise the same.
        small = ("--bucket-size", "3000")
        plain = run_ranks(daemon, world, str(tmp_path), "--optimizer", "muon",
                          "--dtype", "bfloat16", "--keep-fp32", "norm",
                          "--last", "4", *small)
        overlapped = run_ranks(daemon, world, str(tmp_path), "--optimizer",
                               "muon", "--dtype", "bfloat16", "--keep-fp32",
                               "norm", "--last", "4", "--overlap", *small)
        assert plain[0]["buckets"] > 4
        assert overlapped[0]["events"]["grad_ready"] > 0
        for n, p in plain[0]["params"].items():
            assert torch.equal(p, overlapped[0]["params"][n]), n


@pytest.mark.parametrize("world", [1, 2])
def test_clipping_equals_clip_grad_norm_then_the_optimizer(daemon, tmp_path,
                                                         world):
    """max_grad_norm: the daemon's pre-clip norm and factor are
    torch.nn.utils.clip_grad_norm_'s on the same (DP-averaged) gradients,
    and the bf16 run equals clip_grad_norm_ followed by the optimizer."""
    max_norm = 0.05
    results = run_ranks(daemon, world, str(tmp_path), "--optimizer", "muon",
                        "--dtype", "bfloat16", "--record-grads",
                        "--max-grad-norm", str(max_norm), "--last", str(STEPS))
    reference, norms = mixed_reference_run([r["grads"] for r in results],
                                           max_grad_norm=max_norm)
    clipped = 0
    for (got_norm, factor), want in zip(results[0]["clipping"], norms):
        assert abs(got_norm - want) <= 1e-4 * want, (got_norm, want)
        want_factor = min(1.0, max_norm / (want + 1e-6))
        assert abs(factor - want_factor) <= 1e-4 * want_factor
        clipped += factor < 1.0
    assert clipped >= STEPS // 2, results[0]["clipping"]
    worst = max(relative(results[0]["params"][n], reference[n])
                for n in reference)
    assert worst <= 2.0 ** -8, worst
    # The same run without clipping in the reference is far off.
    unclipped, _ = mixed_reference_run([r["grads"] for r in results])
    off = max(relative(results[0]["params"][n], unclipped[n])
              for n in unclipped)
    assert off > 2.0 ** -8, off
    print("clip DP%d: %d of %d steps clipped, worst relative error %.2e "
          "(unclipped reference %.2e)" % (world, clipped, STEPS, worst, off))


@pytest.mark.parametrize("overlap", [False, True])
def test_grad_scaler_unscales_in_the_daemon_and_skips_on_every_rank(
        daemon, tmp_path, overlap):
    """torch.amp.GradScaler through scaler.step(opt): the daemon undoes the
    scale (its gradient norm and the updates are the unscaled run's), and
    when rank 0 alone overflows (step 3) both ranks skip that step, report
    found_inf and back off their scales alike. GradScaler's own path would
    skip step() on rank 0 only and leave rank 1 waiting in the daemon;
    with module= its unscale_ would edit reported gradients."""
    steps, inf_at = 5, 3
    mode = ["--overlap", "--synchronize"] if overlap else []
    plain = run_ranks(daemon, 2, str(tmp_path / "plain"), "--optimizer",
                      "muon", "--last", str(inf_at - 1), *mode)
    scaled = run_ranks(daemon, 2, str(tmp_path / "scaled"), "--optimizer",
                       "muon", "--grad-scaler", "1024", "--inf-at",
                       str(inf_at), "--last", str(steps), *mode)
    for r in scaled:
        assert r["scaling"] == [(1024.0, 0.0), (1024.0, 0.0), (1024.0, 1.0),
                                (512.0, 0.0), (512.0, 0.0)], r["scaling"]
        # Muon and AdamW hardly see a gradient's size; the norm does.
        for (got, _), (want, _) in zip(r["clipping"], plain[0]["clipping"]):
            assert abs(got - want) <= 1e-5 * want, (got, want)
        for got, want in zip(r["deltas"], plain[0]["deltas"]):
            for n in want:
                assert abs(got[n] - want[n]) <= 1e-5 * want[n] + 1e-12, n
        assert all(d == 0.0 for d in r["deltas"][inf_at - 1].values())
        assert all(d > 0.0 for d in r["deltas"][inf_at].values())
    for n, p in scaled[0]["params"].items():
        assert torch.equal(p, scaled[1]["params"][n]), n


def test_a_step_on_non_finite_gradients_is_skipped_and_warned_once(daemon):
    """A loss that turned NaN without a GradScaler (a diverging bf16 run):
    the daemon skips the step on every rank, parameters and state as they
    were; opt.skipped_steps counts it, and the first skip warns, naming the
    loop's line. Through a GradScaler, whose skips are its loss-scale
    search, nothing warns. Before, nothing told the loop."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3, 4):
            before = {n: p.detach().clone()
                      for n, p in model.named_parameters()}
            loss = train_torch.loss_fn(model, step, 0)
            if step in (2, 3):
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            opt.zero_grad()
            moved = [not torch.equal(before[n], p)
                     for n, p in model.named_parameters()]
            assert all(moved) if step in (1, 4) else not any(moved), step
            assert opt.last_step["skipped_nonfinite"] == (step in (2, 3))
    assert opt.skipped_steps == 2 and opt.steps == 4
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "step 2 skipped" in texts[0], texts
    assert caught[0].filename == __file__, caught[0].filename
    opt.close()
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3)
    scaler = torch_worker.make_scaler(1024.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = train_torch.loss_fn(model, 1, 0) * scaler._scale
        (loss * float("inf")).backward()
        scaler.step(opt)
    assert opt.skipped_steps == 1, opt.last_step
    assert not [w for w in caught if "skipped" in str(w.message)], caught
    opt.close()


def test_reference_keywords_reach_the_daemon(daemon):
    """torch.optim.Muon's keywords mean the same in canzona.torch.Muon:
    adjust_lr_fn="match_rms_adamw" scales each matrix's update by
    0.2 sqrt(max(rows, cols)) where "original" scales by
    sqrt(max(1, rows / cols)); from the same model and gradient the first
    updates differ by exactly that ratio (no weight decay). torch's default
    ns_coefficients triple and eps are accepted; other values are a
    ValueError naming the keyword, raised before registering. SOAP's and
    Shampoo's keywords of their reference implementations reach the
    daemon too."""
    os.environ["CANZONA_TARGET"] = daemon
    deltas = {}
    for fn in ("original", "match_rms_adamw"):
        model = train_torch.build_model(0)
        opt = ct.Muon(model.named_parameters(), adjust_lr_fn=fn,
                      ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7,
                      job_id="adjust-" + uuid.uuid4().hex[:8])
        assert opt.param_groups[0]["scale"] == \
            {"original": "spectral"}.get(fn, fn)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_torch.loss_fn(model, 1, 0).backward()
        opt.step()
        deltas[fn] = {n: (p.detach() - before[n]).norm().item()
                      for n, p in model.named_parameters()
                      if ct.default_route(n, p, "muon") == "muon"}
        opt.close()
    shapes = dict((n, p.shape) for n, p in
                  train_torch.build_model(0).named_parameters())
    assert deltas["original"]
    for n, original in deltas["original"].items():
        rows, cols = shapes[n]
        want = 0.2 * max(rows, cols) ** 0.5 / max(1.0, rows / cols) ** 0.5
        got = deltas["match_rms_adamw"][n] / original
        assert abs(got - want) <= 1e-4 * want, (n, got, want)
    # Shampoo's and SOAP's reference keywords reach the daemon: in the
    # param_groups, and through its range checks.
    model = train_torch.build_model(0)
    opt = ct.SOAP(model.named_parameters(), shampoo_beta=0.9,
                  max_precond_dim=32, normalize_grads=True, correct_bias=False,
                  job_id="soap-keywords-" + uuid.uuid4().hex[:8])
    assert {k: opt.param_groups[0][k] for k in (
        "shampoo_beta", "max_precond_dim", "normalize_grads",
        "correct_bias")} == {"shampoo_beta": 0.9, "max_precond_dim": 32,
                             "normalize_grads": True, "correct_bias": False}
    opt.close()
    for make, bad in [(ct.SOAP, {"max_precond_dim": 0}),
                      (ct.Shampoo, {"max_preconditioner_dim": 0}),
                      (ct.Shampoo, {"start_preconditioning_step": -7})]:
        with pytest.raises(canzona.CanzonaError) as error:
            make(train_torch.build_model(0).named_parameters(),
                 job_id="bad-keyword-" + uuid.uuid4().hex[:8], **bad)
        assert error.value.code == "INVALID_ARGUMENT"
        assert next(iter(bad)) in str(error.value)
    named = [("w", torch.nn.Parameter(torch.randn(4, 4)))]
    with pytest.raises(ValueError, match="adjust_lr_fn: 'rms' is not one of"):
        ct.Muon(named, adjust_lr_fn="rms", job_id="bad-adjust")
    with pytest.raises(ValueError, match=r"ns_coefficients: \(3.0, -4.0, 2.0\)"
                                         r": the daemon runs the named sets"):
        ct.Muon(named, ns_coefficients=(3.0, -4.0, 2.0), job_id="bad-ns")


def test_a_closed_optimizer_leaves_the_model_alone(daemon):
    """close() removes every hook the optimizer put on the parameters: an
    optimizer constructed afterwards on the same model (a second training
    phase, a notebook) is the only one its backward feeds. Before, the
    closed one's gradient hooks still copied every gradient into its
    buffer (two extra copies per parameter per backward) and kept that
    buffer, and the optimizer, alive."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    first = ct.Muon(model.named_parameters(), module=model,
                    job_id="first-" + uuid.uuid4().hex[:8])
    train_torch.loss_fn(model, 1, 0).backward()
    first.step()
    first.zero_grad()
    first.close()
    old_views = [view for _, view in first._grads]
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    second = ct.Muon(model.named_parameters(),
                     job_id="second-" + uuid.uuid4().hex[:8])
    train_torch.loss_fn(model, 2, 0).backward()
    assert all(bool((view == 0).all()) for view in old_views)
    assert any(bool((p.grad != 0).any()) for p in model.parameters())
    second.step()
    assert second.steps == 1
    second.close()


def test_a_new_optimizer_over_the_same_parameters_closes_the_old(daemon):
    """Constructing an optimizer again over the same parameters (re-running
    a notebook cell), as torch.optim allows, closes the open one with a
    RuntimeWarning naming its job, even once its last reference is gone:
    its hooks kept it alive, copied every gradient into its buffer too, and
    kept its job registered. The model trains on as under one optimizer
    (bitwise against a model that only ever had the second)."""
    os.environ["CANZONA_TARGET"] = daemon
    model, alone = train_torch.build_model(0), train_torch.build_model(0)
    first = ct.Muon(model.named_parameters()).job_id  # reference dropped
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ct.Muon(model.named_parameters())
    said = [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "closing the optimizer of job" in said[0], said
    with canzona.Client(daemon) as client:
        jobs = {j["job_id"] for j in client.status()["jobs"]}
    assert first not in jobs and opt.job_id in jobs
    reference = ct.Muon(alone.named_parameters())
    for step in range(1, 3):
        for m, o in ((model, opt), (alone, reference)):
            train_torch.loss_fn(m, step, 0).backward()
            o.step()
            o.zero_grad()
    for (n, p), q in zip(model.named_parameters(), alone.parameters()):
        assert torch.equal(p, q), n
    # An old optimizer whose daemon is gone (a restart) does not stop the
    # new one.

    def gone(*unused):
        raise canzona.CanzonaError("job_id is not registered here",
                                   "NOT_FOUND")
    opt.client.deregister = gone
    with pytest.warns(RuntimeWarning, match="closing the optimizer"):
        replacement = ct.Muon(model.named_parameters())
    assert opt._closed
    train_torch.loss_fn(model, 3, 0).backward()
    replacement.step()
    replacement.close()
    reference.close()


def test_parameters_moved_out_of_the_buffer_are_refused(daemon):
    """model.to() to another dtype or device, .half(), or param.data = ...
    after construction gives a parameter storage of its own, which the
    daemon's updates never reach (torch.optim would follow the Parameter):
    step() raises naming it, before anything steps; a no-op model.to()
    changes nothing, and with the storage back the loop goes on."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(),
                  job_id="moved-" + uuid.uuid4().hex[:8])
    model.to(torch.float32)  # already: a no-op
    train_torch.loss_fn(model, 1, 0).backward()
    opt.step()
    name, param = next(iter(model.named_parameters()))
    shared = param.data
    param.data = param.data.clone()
    before = [p.detach().clone() for p in model.parameters()]
    train_torch.loss_fn(model, 2, 0).backward()
    with pytest.raises(RuntimeError, match="parameter %r no longer lives in "
                       "the optimizer's shared buffer" % name):
        opt.step()
    assert opt.steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    param.data = shared
    opt.step()
    assert opt.steps == 2
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"model\.to\(\)"):
        opt.step()
    opt.close()


def test_an_empty_parameter_is_left_out(daemon):
    """A parameter without elements (a layer configured to width 0) is left
    out of the daemon's buffers, as no step changes it: the rest trains
    bitwise as the same model without it. Before, construction failed:
    "parameters[0] 'extra'.shape: dimension 0 < 1"."""
    os.environ["CANZONA_TARGET"] = daemon
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    results = []
    for empty in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16),
                                    torch.nn.Linear(16, 4))
        if empty:
            model.extra = torch.nn.Parameter(torch.empty(0, 8))
        opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3)
        assert "extra" not in opt._names
        for _ in range(3):
            loss = model(x).square().mean()
            if empty:
                loss = loss + model.extra.sum()  # a gradient of no elements
            loss.backward()
            opt.step()
            opt.zero_grad()
        results.append({n: p.detach().clone()
                        for n, p in model.named_parameters() if n != "extra"})
        opt.close()
    assert results[0].keys() == results[1].keys()
    for n, p in results[0].items():
        assert torch.equal(p, results[1][n]), n


def test_frozen_parameters_stay_as_they_are(daemon):
    """A parameter that does not require grad is skipped by torch.optim
    (no gradient) and left out of Megatron's buffers; canzona leaves it out
    of the daemon's: with weight decay on both groups it stays bitwise as it
    was over three steps (stepping it on zero gradients would shrink it),
    keeps its own storage, and the rest still trains. Unfreezing it later
    is a RuntimeError before anything steps; freezing a registered one
    later warns once."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    frozen = {n for n, _ in model.named_parameters() if "layers.0." in n}
    assert frozen
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ct.Muon(model.named_parameters(), weight_decay=0.1,
                  adamw_weight_decay=0.1,
                  job_id="frozen-" + uuid.uuid4().hex[:8])
    assert set(opt._names).isdisjoint(frozen) and opt._names
    params = dict(model.named_parameters())
    for step in range(1, 4):
        opt.zero_grad()
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), start[n]), n
            assert p.grad is None, n
        else:
            assert not torch.equal(p.detach(), start[n]), n
    name = sorted(frozen)[0]
    params[name].requires_grad_(True)
    opt.zero_grad()
    train_torch.loss_fn(model, 4, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="parameter %r did not require "
                       "grad when the optimizer was constructed" % name):
        opt.step()
    assert opt.steps == 3
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    params[name].requires_grad_(False)
    trained = opt._names[0]
    params[trained].requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (4, 5):
            opt.zero_grad()
            train_torch.loss_fn(model, step, 0).backward()
            opt.step()
    said = [str(w.message) for w in caught if "no longer requires grad"
            in str(w.message)]
    assert len(said) == 1 and repr(trained) in said[0], said
    opt.close()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="named_parameters: none requires "
                                         "grad"):
        ct.Muon(model.named_parameters(), job_id="all-frozen")


def test_unfreezing_carries_the_state_through_a_checkpoint(daemon,
                                                          tmp_path):
    """Progressive unfreezing: three steps with a Muon matrix and a norm
    frozen, save_checkpoint, unfreeze, a new optimizer over every
    parameter, load_checkpoint(strict=False). The checkpoint lacks the
    unfrozen two: strict loading refuses naming one; the lenient one names
    both and starts them fresh, as torch.optim does a parameter added by
    add_param_group. Step 4 then equals, bitwise, a twin whose optimizer
    was never rebuilt (the rest carried its state), and the unfrozen two
    took a first step of their own (the references' first steps)."""
    os.environ["CANZONA_TARGET"] = daemon
    unfrozen = ["layers.0.mlp.down_proj.weight",
                "layers.0.post_attention_layernorm.weight"]
    models = [train_torch.build_model(0), train_torch.build_model(0)]
    for model in models:
        for n, p in model.named_parameters():
            p.requires_grad_(n not in unfrozen)
    settings = dict(lr=0.02, adamw_lr=3e-3, adamw_weight_decay=0.01)
    model, twin = models
    opt = ct.Muon(model.named_parameters(), **settings)
    twin_opt = ct.Muon(twin.named_parameters(), **settings)
    for step in range(1, 4):
        for m, o in ((model, opt), (twin, twin_opt)):
            train_torch.loss_fn(m, step, 0).backward()
            o.step()
            o.zero_grad()
    checkpoint = tmp_path / "frozen-phase"
    opt.save_checkpoint(checkpoint)
    opt.close()
    for n, p in model.named_parameters():
        p.requires_grad_(True)
    opt = ct.Muon(model.named_parameters(), **settings)
    with pytest.raises(canzona.CanzonaError,
                       match="has no state for parameter 'layers.0."):
        opt.load_checkpoint(checkpoint)
    loaded = opt.load_checkpoint(checkpoint, strict=False)
    assert sorted(loaded["missing"]) == sorted(unfrozen), loaded
    assert opt.steps == 3
    params = dict(model.named_parameters())
    start = {n: params[n].detach().clone() for n in unfrozen}
    for m, o in ((model, opt), (twin, twin_opt)):
        train_torch.loss_fn(m, 4, 0).backward()
        if m is model:
            grads = {n: params[n].grad.clone() for n in unfrozen}
        o.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        if n not in unfrozen:
            assert torch.equal(p, q), n
    # The unfrozen ones' first steps: Muon's with an empty momentum, and
    # AdamW's with step 1's bias correction (not the job's step 4).
    matrix, norm = unfrozen
    want = start[matrix].clone()
    TorchMuon(settings["lr"]).step(want, grads[matrix], settings["lr"])
    assert relative(params[matrix].detach(), want) < 1e-5
    want = torch.nn.Parameter(start[norm].clone())
    want.grad = grads[norm]
    torch.optim.AdamW([want], lr=3e-3, weight_decay=0.01).step()
    assert relative(params[norm].detach(), want.detach()) < 1e-6
    assert not torch.equal(params[norm].detach(), start[norm])
    opt.close()
    twin_opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_set_by_hand_step_like_backward(daemon, overlap):
    """A loop that computes its gradients with torch.autograd.grad (or
    torch.func) and sets each .grad, as torch.optim allows, steps exactly
    as one calling backward (bitwise, three steps; with module= too).
    Before, step() raised "before backward produced a gradient"."""
    os.environ["CANZONA_TARGET"] = daemon
    models = [train_torch.build_model(0), train_torch.build_model(0)]
    opts = [ct.Muon(m.named_parameters(), adamw_lr=3e-3,
                    module=m if overlap else None) for m in models]
    by_backward, by_hand = models
    for step in range(1, 4):
        train_torch.loss_fn(by_backward, step, 0).backward()
        params = list(by_hand.parameters())
        grads = torch.autograd.grad(train_torch.loss_fn(by_hand, step, 0),
                                    params)
        for p, g in zip(params, grads):
            p.grad = g
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for opt in opts:
        opt.synchronize()
    for (n, p), q in zip(by_backward.named_parameters(), by_hand.parameters()):
        assert torch.equal(p, q), n
    # Neither backward nor a .grad set: still refused.
    with pytest.raises(RuntimeError, match="before backward produced"):
        opts[1].step()
    for opt in opts:
        opt.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("where", ["unsent", "sent", "answered"])
def test_a_step_interrupted_by_ctrl_c_completes_once(daemon, overlap, where):
    """Ctrl-C in a notebook lands in step(): before its request went out,
    while the daemon runs it, or after its answer came. Whichever, the loop
    goes on (zero_grad, backward, step) as if the step had returned: the
    interrupted step runs exactly once, and the parameters equal an
    uninterrupted run's (bitwise, with module= too).
    Before, every later step() raised "step out of order"."""
    os.environ["CANZONA_TARGET"] = daemon
    models = [train_torch.build_model(0), train_torch.build_model(0)]
    opts = [ct.Muon(m.named_parameters(), adamw_lr=3e-3,
                    module=m if overlap else None) for m in models]
    interrupted = opts[1]
    real_step = interrupted.client.step
    sent = []

    def ctrl_c(*args, **kwargs):
        interrupted.client.step = real_step
        if where == "sent":
            # The caller stops waiting; the call goes on without it.
            sent.append(threading.Thread(target=real_step, args=args,
                                         kwargs=kwargs))
            sent[-1].start()
        elif where == "answered":
            real_step(*args, **kwargs)
        raise KeyboardInterrupt

    for step in range(1, 5):
        for model, opt in zip(models, opts):
            train_torch.loss_fn(model, step, 0).backward()
            if step == 2 and opt is interrupted:
                interrupted.client.step = ctrl_c
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
                assert opt.steps == 1
            else:
                opt.step()
            opt.zero_grad()
        assert interrupted.steps == step
    for thread in sent:
        thread.join()
    for opt in opts:
        opt.synchronize()
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), n
    assert interrupted.last_step["grad_norm"] > 0
    for opt in opts:
        opt.close()


def _modded_nanogpt_groups(model):
    """modded-nanogpt's split, as torch.optim param groups of plain
    parameters: Muon's hidden matrices, then Adam groups of their own lr
    for the head, the embeddings and the scalars."""
    hidden = [p for p in model.layers.parameters() if p.dim() == 2]
    scalars = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=hidden, lr=0.03, momentum=0.9),
            dict(params=[model.lm_head.weight], lr=0.02, betas=(0.8, 0.95)),
            dict(params=[model.embed_tokens.weight], lr=0.05,
                 betas=(0.8, 0.95)),
            dict(params=scalars, lr=0.01, weight_decay=0.0)]


def _train_three_steps(pairs):
    for step in range(1, 4):
        for model, opt, sched in pairs:
            train_torch.loss_fn(model, step, 0).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    for _, opt, _ in pairs:
        opt.synchronize()


def test_torch_optim_param_groups_port_as_they_are(daemon):
    """torch.optim's forms of the first argument: param group dicts of
    plain parameters (named after module=) in ct.Muon, each one
    param_group with its own settings in the given order, and param groups
    that say their optimizer (no names: by position) in ct.Optimizer. Each
    trains bitwise as the named form (groups= and route=), with a LambdaLR
    per group. Before, plain parameters failed with "too many values to
    unpack", dicts with an AttributeError."""
    os.environ["CANZONA_TARGET"] = daemon
    models = [train_torch.build_model(0) for _ in range(4)]
    ported = ct.Muon(_modded_nanogpt_groups(models[0]), module=models[0],
                     adamw_eps=1e-10, adamw_weight_decay=0.01)
    assert [(g["name"], g["optimizer"], g["lr"]) for g in
            ported.param_groups] == [
        ("muon", "muon", 0.03), ("adamw", "adamw", 0.02),
        ("adamw_2", "adamw", 0.05), ("adamw_3", "adamw", 0.01)]
    assert ported.param_groups[1]["betas"] == (0.8, 0.95)
    assert ported.param_groups[3]["weight_decay"] == 0.0
    names = {id(p): n for n, p in models[1].named_parameters()}
    route = {}
    for group, spec in zip(("muon", "adamw", "adamw_2", "adamw_3"),
                           _modded_nanogpt_groups(models[1])):
        for p in spec["params"]:
            route[names[id(p)]] = group
    adamw = dict(optimizer="adamw", eps=1e-10, weight_decay=0.01)
    named = ct.Optimizer(models[1].named_parameters(), {
        "muon": dict(optimizer="muon", lr=0.03, momentum=0.9, nesterov=True,
                     ns_steps=5, weight_decay=0.0),
        "adamw": dict(adamw, lr=0.02, betas=(0.8, 0.95)),
        "adamw_2": dict(adamw, lr=0.05, betas=(0.8, 0.95)),
        "adamw_3": dict(adamw, lr=0.01, weight_decay=0.0)}, route)
    positional = ct.Optimizer([
        dict(params=[p for p in models[2].parameters() if p.dim() == 2],
             optimizer="adamw", lr=1e-3, betas=(0.9, 0.95)),
        dict(params=[p for p in models[2].parameters() if p.dim() < 2],
             optimizer="adamw", lr=2e-3, weight_decay=0.0)])
    assert [g["name"] for g in positional.param_groups] == [
        "adamw", "adamw_1"]
    by_name = ct.Optimizer(models[3].named_parameters(), {
        "matrices": dict(optimizer="adamw", lr=1e-3, betas=(0.9, 0.95)),
        "rest": dict(optimizer="adamw", lr=2e-3, weight_decay=0.0)},
        lambda name, p: "matrices" if p.dim() == 2 else "rest")

    def scheduled(opt):
        return torch.optim.lr_scheduler.LambdaLR(
            opt, [lambda s, i=i: 1.0 / (1 + s + i)
                  for i in range(len(opt.param_groups))])

    _train_three_steps([(m, o, scheduled(o)) for m, o in
                        zip(models, (ported, named, positional, by_name))])
    for a, b in ((0, 1), (2, 3)):
        for (n, p), q in zip(models[a].named_parameters(),
                             models[b].parameters()):
            assert torch.equal(p, q), n
    assert not torch.equal(models[0].lm_head.weight,
                           models[2].lm_head.weight)
    for opt in (ported, named, positional, by_name):
        opt.close()


def _conv_net(seed):
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d
    return torch.nn.Sequential(
        conv(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(), conv(8, 16, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10)).to(memory_format=torch.channels_last)


def test_a_channels_last_conv_net_steps_its_filters_as_matrices(daemon):
    """A convolutional net in channels_last (as torchvision's and
    diffusers' recipes train one) registers, and its filters routed to Muon
    step as the matrices (out, in * kh * kw), as Keller Jordan's Muon
    flattens them: losses and parameters follow plain PyTorch with float64
    Newton-Schulz on the flattened filters and torch.optim.AdamW for the
    rest. Before, construction raised "parameter '0.weight' is not
    contiguous", and a contiguous net's filters in Muon "needs a 2-D
    shape"."""
    os.environ["CANZONA_TARGET"] = daemon
    filters = ["0.weight", "3.weight"]
    model, ref = _conv_net(0), _conv_net(0)
    opt = ct.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3,
                  overrides=dict({n: "muon" for n in filters},
                                 **{"8.weight": "adamw"}), module=model)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 6]
    # The filters now view the shared buffer in row-major order.
    assert model[0].weight.is_contiguous()
    named = dict(ref.named_parameters())
    adamw = torch.optim.AdamW(
        [p for n, p in named.items() if n not in filters], lr=3e-3,
        betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    muon = TorchMuon(0.02)
    flat = {n: named[n].detach().reshape(len(named[n]), -1).clone()
            for n in filters}
    torch.manual_seed(1)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (4,))
    for _ in range(3):
        losses = []
        for m in (model, ref):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), losses
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            adamw.step()
            for n in filters:
                p = named[n]
                flat[n].copy_(p.reshape(len(p), -1))
                muon.step(flat[n], p.grad.reshape(len(p), -1), 0.02)
                p.copy_(flat[n].view(p.shape))
        ref.zero_grad()
    opt.synchronize()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert relative(p, q) <= 1e-5, (n, relative(p, q))
    # The negative control: the filters moved, as Muon moves them.
    assert relative(model[0].weight, _conv_net(0)[0].weight) > 1e-2
    opt.close()


class _StackedExperts(torch.nn.Module):
    """A mixture's experts fused into 3-D parameters (E, in, out), as
    recent Hugging Face MoE models hold them; every token visits every
    expert (the routing is beside the point here)."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = torch.nn.Parameter(torch.randn(4, 16, 24, generator=g) / 4)
        self.down = torch.nn.Parameter(torch.randn(4, 24, 16, generator=g) / 5)

    def forward(self, x):
        h = torch.relu(torch.einsum("bi,eio->beo", x, self.up))
        return torch.einsum("beo,eoi->bi", h, self.down)


def test_stacked_experts_step_as_one_matrix_each(daemon):
    """3-D parameters (E, rows, cols) routed to Muon step as E matrices, as
    Keller Jordan's Muon steps a 3-D tensor (batched over its first
    dimension): parameters follow plain PyTorch with float64 Newton-Schulz
    per expert. Before, the daemon refused a 3-D shape in Muon."""
    os.environ["CANZONA_TARGET"] = daemon
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def reference(flattened):
        ref, muon = _StackedExperts(0), TorchMuon(0.02)
        # The matrices Muon steps, kept (its momentum is keyed by them).
        if flattened:  # the negative control: (E, rows * cols)
            parts = {(n, None): p.detach().reshape(4, -1).clone()
                     for n, p in ref.named_parameters()}
        else:
            parts = {(n, e): p.detach()[e].clone()
                     for n, p in ref.named_parameters() for e in range(4)}
        for _ in range(3):
            ref(x).square().mean().backward()
            with torch.no_grad():
                for (n, e), matrix in parts.items():
                    p = getattr(ref, n)
                    view = p.view(4, -1) if e is None else p[e]
                    grad = p.grad.view(4, -1) if e is None else p.grad[e]
                    matrix.copy_(view)
                    muon.step(matrix, grad, 0.02)
                    view.copy_(matrix)
            ref.zero_grad()
        return dict(ref.named_parameters())

    model = _StackedExperts(0)
    opt = ct.Muon(model.named_parameters(), lr=0.02,
                  overrides={"up": "muon", "down": "muon"}, module=model)
    assert [len(g["params"]) for g in opt.param_groups] == [2]
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    per_expert, flattened = reference(False), reference(True)
    for n, p in model.named_parameters():
        assert relative(p, per_expert[n]) <= 1e-5, (n, relative(
            p, per_expert[n]))
        assert relative(p, flattened[n]) > 1e-3, n
    opt.close()


def test_torch_optim_forms_that_cannot_work_say_why(daemon):
    """Unnamed parameters where the optimizer is chosen by name, a group
    mixing matrices with embeddings, and malformed groups raise naming the
    fix, before anything registers."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    with pytest.raises(ValueError, match=r"params: a parameter without a "
                       r"name.*model.named_parameters\(\)"):
        ct.Muon(model.parameters())
    with pytest.raises(ValueError, match=r"params\[0\] holds adamw "
                       r"parameters \(embed_tokens.weight.*and muon "
                       r"parameters .*split it, or give it 'optimizer'"):
        ct.Muon([dict(params=[p for p in model.parameters()
                              if p.dim() == 2])], module=model)
    with pytest.raises(ValueError, match=r"params\[0\]: 'optimizer' is "
                       r"needed"):
        ct.Optimizer([dict(params=list(model.named_parameters()))])
    with pytest.raises(ValueError, match=r"params\[1\]: parameter "
                       r"'norm.weight' is in two groups"):
        ct.Optimizer([dict(params=list(model.named_parameters()),
                           optimizer="adamw"),
                      dict(params=[("norm.weight", model.norm.weight)],
                           optimizer="adamw")])
    with pytest.raises(ValueError, match=r"params\[0\]: no 'params'"):
        ct.Optimizer([dict(lr=0.1, optimizer="adamw")])
    with pytest.raises(TypeError, match="not one tensor"):
        ct.Optimizer(model.norm.weight, {"g": {"optimizer": "adamw"}})
    with pytest.raises(ValueError, match="unknown settings.*amsgrad"):
        ct.Optimizer([dict(params=list(model.named_parameters()),
                           optimizer="adamw", amsgrad=True)])
    assert all(p.grad is None for p in model.parameters())


_KILLED_TRAINER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import train_torch, canzona.torch as ct
model = train_torch.build_model(0)
opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3)
print(opt.job_id, flush=True)
for step in range(1, 3):
    train_torch.loss_fn(model, step, 0).backward()
    opt.step()
    opt.zero_grad()
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
opt.close()
"""


@pytest.mark.parametrize("doorbell", [True, False])
def test_a_daemon_that_restarted_is_resumed_from_a_checkpoint(tmp_path,
                                                              doorbell):
    """canzonad exits (systemd restarts it after a crash) under a training
    loop: step() fails, dead or restarted, with its code and a message that
    says how to go on; close() warns instead of raising (nothing is left
    to deregister); a new optimizer loading the last checkpoint trains on
    from there, bitwise as a run never interrupted. Before, step() said only that the daemon no longer served
    the doorbell, and close() raised NOT_FOUND."""
    proc, target = start_daemon(str(tmp_path))
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3, target=target,
                  step_doorbell=doorbell)
    for step in (1, 2):
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        opt.zero_grad()
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    proc.kill()
    proc.wait()
    train_torch.loss_fn(model, 3, 0).backward()
    hint = ("a canzonad that exited or restarted no longer holds job %r and "
            "its state: with the daemon running, construct a new optimizer "
            "and load what save_checkpoint(dir) or state_dict() saved last"
            % opt.job_id)
    with pytest.raises(canzona.CanzonaError) as error:
        opt.step()
    assert error.value.code == "UNAVAILABLE" and hint in str(error.value)
    os.unlink(str(tmp_path / "d.sock"))
    os.unlink(str(tmp_path / "ready.json"))
    proc, target = start_daemon(str(tmp_path))
    try:
        with pytest.raises(canzona.CanzonaError) as error:
            opt.step()
        assert error.value.code in ("UNAVAILABLE", "NOT_FOUND")
        assert hint in str(error.value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.close()
        assert len(caught) == 1 and "was not deregistered" in str(
            caught[0].message), caught
        resumed = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                          target=target, step_doorbell=doorbell)
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        train_torch.loss_fn(model, 3, 0).backward()
        resumed.step()
        assert resumed.steps == 3
        resumed.close()
        plain = train_torch.build_model(0)
        uninterrupted = ct.Muon(plain.named_parameters(), adamw_lr=3e-3,
                                target=target, step_doorbell=doorbell)
        for step in (1, 2, 3):
            train_torch.loss_fn(plain, step, 0).backward()
            uninterrupted.step()
            uninterrupted.zero_grad()
        uninterrupted.close()
        for a, b in zip(model.parameters(), plain.parameters()):
            assert torch.equal(a, b)
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_trainer_restarted_on_its_job_id_trains_again(daemon):
    """torchrun restarts the workers of a job after one died with the same
    run id, hence the same job id and ranks. The killed trainer's
    shared-memory objects (its buffers and doorbell: the model's size)
    leave /dev/shm once the daemon sees it exit, and the restarted one
    registers and trains. Before, the names stayed until a reboot and the
    restart failed at once: "shm_open /canzona.<job>.0.0: File exists"."""
    run_id = "restart-" + uuid.uuid4().hex[:8]
    env = dict(os.environ, CANZONA_TARGET=daemon, TORCHELASTIC_RUN_ID=run_id,
               RANK="0", WORLD_SIZE="1", OPENBLAS_NUM_THREADS="1")
    examples = os.path.join(ROOT, "client", "examples")

    def trainer(how):
        return subprocess.run(
            [sys.executable, "-c", _KILLED_TRAINER, examples, how], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)

    def objects(job):
        return [f for f in os.listdir("/dev/shm")
                if f.startswith("canzona.%s." % job)]

    killed = trainer("kill")
    assert killed.returncode == -9, killed.stdout.decode()
    job = killed.stdout.decode().split()[0]
    assert job == "torch-" + run_id
    for _ in range(100):
        if not objects(job):
            break
        time.sleep(0.05)
    assert objects(job) == []
    restarted = trainer("close")
    assert restarted.returncode == 0, restarted.stdout.decode()
    assert objects(job) == []


@pytest.mark.parametrize("overlap", [False, True])
def test_weights_loaded_between_steps_are_kept_in_mixed_precision(daemon,
                                                                 overlap):
    """model.load_state_dict(...) between steps of a bf16 model (resume,
    best-checkpoint reload, a re-initialized layer): the daemon's fp32
    masters take the loaded values, so an lr-0 step keeps them exactly,
    and a step with no edit since sends no parameter to reload (its
    masters keep their fp32 bits). Before, every such step wrote the older
    masters over the loaded weights: 0 of 25 kept, silently."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0).to(torch.bfloat16)
    loaded = train_torch.build_model(1).to(torch.bfloat16)
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                  module=model if overlap else None)
    sent = []
    real_step = opt.client.step
    waited = []
    real_wait = opt.client.wait_params

    def spy(*args, **kwargs):
        sent.append(list(kwargs.get("reload_params", ())))
        return real_step(*args, **kwargs)

    def wait_spy(*args, **kwargs):
        waited.append(args[-1])
        return real_wait(*args, **kwargs)

    opt.client.step = spy
    opt.client.wait_params = wait_spy
    for step in range(1, 3):
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        opt.zero_grad()
    # With module= the last step's parameter writes may still be under way:
    # load_state_dict waits for them (all buckets) before it writes.
    model.load_state_dict(loaded.state_dict())
    if overlap:
        assert waited[-1] == -1
    with torch.no_grad():
        model.norm.weight.mul_(2.0)  # an in-place edit counts too
        loaded.norm.weight.mul_(2.0)
    for group in opt.param_groups:
        group["lr"] = 0.0
    train_torch.loss_fn(model, 3, 0).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    for (n, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), n
    assert sent[:2] == [[], []]
    assert len(sent[2]) == len(list(model.parameters()))
    train_torch.loss_fn(model, 4, 0).backward()
    opt.step()
    assert sent[3] == []
    # A write torch's version counters miss (through .data; a broadcast
    # into the parameters): lost, unless reload_model_params() says so.
    written = [q * 2 + 1 for q in loaded.parameters()]
    for reload in (False, True):
        opt.zero_grad()
        opt.synchronize()
        for p, q in zip(model.parameters(), written):
            p.data.copy_(q)
        if reload:
            opt.reload_model_params()
        train_torch.loss_fn(model, 5, 0).backward()
        opt.step()
        opt.synchronize()
        kept = [torch.equal(p, q) for p, q in zip(model.parameters(),
                                                   written)]
        assert all(kept) if reload else not any(kept)
    with pytest.raises(ValueError, match="does not hold"):
        opt.reload_model_params([torch.nn.Parameter(torch.zeros(1))])
    # Refused, a call naming one of ours and a stranger marks neither.
    with pytest.raises(ValueError, match="does not hold"):
        opt.reload_model_params([next(model.parameters()),
                                 torch.nn.Parameter(torch.zeros(1))])
    assert opt._changed_params() == []
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("between", ["resume", "ema_swap"])
def test_rewriting_a_bf16_model_s_own_values_keeps_the_masters(daemon,
                                                                between,
                                                                overlap):
    """The loop writes into a bf16 model the values it already holds: a
    resume that loads the optimizer before the model (both from this
    run's checkpoint), or an EMA swap for evaluation undone with copy_().
    Torch's version counters say every parameter changed, so the daemon
    rereads them all; each master that still rounds to its parameter keeps
    its fp32 bits, and the run goes on bitwise as one never touched.
    Before, the masters took the bf16 values: the run drifted."""
    os.environ["CANZONA_TARGET"] = daemon

    def run(touch):
        model = train_torch.build_model(0).to(torch.bfloat16)
        opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                      module=model if overlap else None)
        sent = []
        real_step = opt.client.step

        def spy(*args, **kwargs):
            sent.append(len(kwargs.get("reload_params", ())))
            return real_step(*args, **kwargs)

        opt.client.step = spy
        for step in range(1, 6):
            if step == 3:
                touch(model, opt)
            train_torch.loss_fn(model, step, 0).backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        return [p.detach().clone() for p in model.parameters()], sent

    def resume(model, opt):
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        opt.load_state_dict(opt.state_dict())
        model.load_state_dict(saved_model)

    def ema_swap(model, opt):
        opt.synchronize()  # reads outside a forward (module=)
        backup = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
            for p, b in zip(model.parameters(), backup):
                p.copy_(b)

    untouched, _ = run(lambda model, opt: None)
    touched, sent = run(resume if between == "resume" else ema_swap)
    assert sent[2] == len(untouched) and sent[3] == 0, sent
    for a, b in zip(untouched, touched):
        assert torch.equal(a, b)


def test_a_ddp_wrapped_model_steps_as_one_without(daemon, tmp_path):
    """A model left in DistributedDataParallel (Accelerate wraps it on
    several processes): DDP averages the gradients, the daemons average
    the averages, and the run equals one without DDP bitwise, with no
    warning. Before, DDP's write of the averaged gradients after backward
    looked like a local edit: "gradients were changed in place" warned."""
    plain = run_ranks(daemon, 2, str(tmp_path), "--last", "3")
    wrapped = run_ranks(daemon, 2, str(tmp_path), "--last", "3", "--ddp",
                        str(tmp_path / ("rendezvous-" + uuid.uuid4().hex)))
    for a, b in zip(plain, wrapped):
        assert a["losses"] == b["losses"]
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n
        assert b["warnings"] == []
    # With module= the daemon would read each reported bucket during
    # backward, while DDP writes its average after: the first step sees the
    # write, and the optimizer steps without the overlap, warning once
    # (before: step() refused).
    overlapped = run_ranks(
        daemon, 2, str(tmp_path), "--last", "3", "--overlap", "--ddp",
        str(tmp_path / ("rendezvous-" + uuid.uuid4().hex)))
    for a, b in zip(plain, overlapped):
        assert a["losses"] == b["losses"]
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n
        assert len(b["warnings"]) == 1, b["warnings"]
        assert "a DistributedDataParallel around the model" in \
            b["warnings"][0], b["warnings"]


def test_a_local_clip_on_several_ranks_warns_once(daemon, tmp_path):
    """Without module=, torch.nn.utils.clip_grad_norm_ between backward and
    step() clips each rank's own gradients by its own norm before the
    daemon averages them, where DDP clips the average by its norm: every
    rank of a DP2 job is warned, once, and pointed at max_grad_norm=. One
    rank alone (where the two agree) and the daemon's own clip are not."""
    two = run_ranks(daemon, 2, str(tmp_path / "two"), "--optimizer", "muon",
                    "--last", "3", "--clip-local", "0.5")
    for r in two:
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "RuntimeWarning: canzona: gradients were changed in place" in \
            r["warnings"][0] and "max_grad_norm=" in r["warnings"][0]
    one = run_ranks(daemon, 1, str(tmp_path / "one"), "--optimizer", "muon",
                    "--last", "3", "--clip-local", "0.5")
    assert one[0]["warnings"] == []
    inside = run_ranks(daemon, 2, str(tmp_path / "inside"), "--optimizer",
                       "muon", "--last", "3", "--max-grad-norm", "0.5")
    assert all(r["warnings"] == [] for r in inside)


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_shampoo_and_soap_match_float64_references(daemon, tmp_path, kind):
    """Losses within 1e-5 relative every step; parameters within 1e-4. On
    identical gradients the daemon's Shampoo and SOAP equal the float64
    references within 5e-7 (test_reference.py); over a 20-step training
    loop the float32 trajectory drifts from the float64 one (the
    preconditioned steps amplify it), measured 3.5e-5 (Shampoo) and 2.5e-5
    (SOAP) in parameters, so 1e-5 there would test float32 itself."""
    pytest.importorskip("canzona_reference")
    results = run_ranks(daemon, 2, str(tmp_path), "--optimizer", kind,
                        "--last", str(STEPS))
    worst = assert_close(results[0], reference_run(kind, 2, STEPS), 1e-5,
                         param_tol=1e-4)
    print("%s DP2: worst parameter relative error %.2e" % (kind, worst))


def test_negative_control_detects_a_wrong_update(daemon, tmp_path):
    results = run_ranks(daemon, 1, str(tmp_path), "--optimizer", "muon",
                        "--last", "5")
    losses, params = reference_run("muon", 1, 5, halve_lr=True)
    worst = max(relative(results[0]["params"][n], params[n]) for n in params)
    assert worst > 1e-3


def test_lr_scheduler_reaches_the_daemon(daemon, tmp_path):
    results = run_ranks(daemon, 1, str(tmp_path), "--optimizer", "muon",
                        "--last", "4", "--halve-lr")
    assert_close(results[0], reference_run("muon", 1, 4, halve_lr=True), 1e-5)
    # Muon's update norm is lr * scale * |orthogonal factor|: it halves.
    name = "layers.0.mlp.up_proj.weight"
    d = [delta[name] for delta in results[0]["deltas"]]
    for before, after in zip(d, d[1:]):
        assert 0.4 < after / before < 0.6, d
    assert results[0]["lrs"][0] == pytest.approx(0.02 * 0.5 ** 4)


@pytest.mark.parametrize("kind", ["muon", "shampoo"])
def test_one_cycle_lr_cycles_momentum_through_the_daemon(daemon, kind):
    """torch's OneCycleLR as users construct it (cycle_momentum on, its
    default): it reads optimizer.defaults (the first group's settings) to
    cycle Muon's "momentum", or beta1 in "betas" where the first group has
    betas (Shampoo, SOAP), and writes it into every group; the daemon
    steps with what it wrote, as torch.optim would (an AdamW group ignores
    a written "momentum", as torch.optim.AdamW does). Without defaults the
    scheduler refuses to construct; with betas as beta1 / beta2 (no
    "betas" key) it raises KeyError."""
    if kind == "shampoo":
        pytest.importorskip("canzona_reference")
    os.environ["CANZONA_TARGET"] = daemon
    steps = 4
    model = train_torch.build_model(0)
    opt = torch_worker.make(kind, model, "cycle-" + uuid.uuid4().hex[:8],
                            None)
    assert [g["name"] for g in opt.param_groups] == [kind, "adamw"]
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[0.02 if kind == "muon" else 3e-3, 3e-3],
        total_steps=steps + 1)
    schedule = []
    for step in range(1, steps + 1):
        schedule.append({g["name"]: dict(g, params=None)
                         for g in opt.param_groups})
        opt.zero_grad()
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        sched.step()
    opt.close()
    cycled = "momentum" if kind == "muon" else "betas"
    values = [now[kind][cycled] for now in schedule]
    assert len(set(values)) == steps, values  # it did cycle
    if kind == "shampoo":  # AdamW's beta1 too
        assert len({now["adamw"]["betas"] for now in schedule}) == steps
    want = reference_run(kind, 1, steps, schedule=schedule)[1]
    tol = 1e-5 if kind == "muon" else 1e-4  # as in the tests above
    worst = max(relative(p.detach(), want[n])
                for n, p in model.named_parameters())
    assert worst <= tol, worst
    # The negative control: the registered momentum throughout is far off.
    fixed = [{name: dict(group, **{cycled: opt.defaults[cycled]})
              if name == kind else dict(group, betas=(0.9, 0.999))
              for name, group in now.items()} for now in schedule]
    fixed = reference_run(kind, 1, steps, schedule=fixed)[1]
    assert max(relative(fixed[n], want[n]) for n in want) > 10 * tol


def test_a_schedule_of_momentum_and_decay_reaches_the_daemon(daemon):
    # torch.optim semantics: settings a schedule writes into param_groups
    # between steps (Muon's momentum warm-up, AdamW's betas and decay) hold
    # for that step, as in plain PyTorch, where TorchMuon and AdamW read
    # them afresh each step; back at the constructor's values they are
    # the registered ones again.
    os.environ["CANZONA_TARGET"] = daemon
    schedule = [({"momentum": 0.85}, {"betas": (0.85, 0.999)}),
                ({"momentum": 0.9, "weight_decay": 0.1},
                 {"betas": (0.8, 0.99), "weight_decay": 0.05}),
                ({}, {})]
    muon_base = {"momentum": 0.95, "weight_decay": 0.0}
    adamw_base = {"betas": (0.9, 0.999), "weight_decay": 0.01}
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3,
                  adamw_weight_decay=0.01,
                  job_id="schedule-" + uuid.uuid4().hex[:8])
    groups = {g["name"]: g for g in opt.param_groups}
    reference = train_torch.build_model(0)
    named = list(reference.named_parameters())
    matrix = [(n, p) for n, p in named if ct.default_route(n, p, "muon") == "muon"]
    adamw = torch.optim.AdamW(
        [p for n, p in named if ct.default_route(n, p, "muon") == "adamw"],
        lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    muon = TorchMuon(0.02)
    for step, (m, a) in enumerate(schedule, 1):
        muon_now, adamw_now = dict(muon_base, **m), dict(adamw_base, **a)
        groups["muon"].update(muon_now)
        groups["adamw"].update(adamw_now)
        groups["muon"]["initial_lr"] = 0.02  # a scheduler's key: not sent
        opt.zero_grad()
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        muon.momentum, muon.wd = muon_now["momentum"], muon_now["weight_decay"]
        adamw.param_groups[0]["betas"] = adamw_now["betas"]
        adamw.param_groups[0]["weight_decay"] = adamw_now["weight_decay"]
        reference.zero_grad()
        train_torch.loss_fn(reference, step, 0).backward()
        with torch.no_grad():
            adamw.step()
            for n, p in matrix:
                muon.step(p, p.grad, 0.02)
    want = dict(reference.named_parameters())
    worst = max(relative(p.detach(), want[n])
                for n, p in model.named_parameters())
    assert worst <= 1e-5, worst
    # The negative control: the daemon without the schedule drifts away.
    plain = train_torch.build_model(0)
    unscheduled = ct.Muon(plain.named_parameters(), lr=0.02, adamw_lr=3e-3,
                          adamw_weight_decay=0.01,
                          job_id="unscheduled-" + uuid.uuid4().hex[:8])
    for step in range(1, len(schedule) + 1):
        unscheduled.zero_grad()
        train_torch.loss_fn(plain, step, 0).backward()
        unscheduled.step()
    assert max(relative(p.detach(), want[n])
               for n, p in plain.named_parameters()) > 1e-3
    unscheduled.close()
    # A setting the daemon fixes at registration: a clear error, no step.
    groups["muon"]["ns_steps"] = 3
    opt.zero_grad()
    train_torch.loss_fn(model, 4, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"\['muon'\]\['ns_steps'\].*momentum, "
                                         r"weight_decay"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    groups["muon"]["ns_steps"] = 5
    # torch's spelling and the daemon's side by side, or a betas that is
    # no pair: which would hold is unclear, so neither does.
    for bad, match in [({"beta1": 0.8}, r"\['adamw'\]: both 'betas' and"),
                       ({"betas": 0.8}, r"\['adamw'\]\['betas'\]: 0.8 is "
                                         r"not a pair")]:
        groups["adamw"].update(bad)
        with pytest.raises(ValueError, match=match):
            opt.step()
        groups["adamw"].pop("beta1", None)
        groups["adamw"]["betas"] = (0.9, 0.999)
    assert opt.steps == 3
    opt.step()  # step 4, as the trainer meant it
    assert opt.steps == 4
    # Parameters join at construction only (the daemon planned them).
    with pytest.raises(RuntimeError, match="add_param_group: canzona "
                                           "registers every parameter"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert len(opt.param_groups) == 2
    opt.close()
    # Shampoo registered without momentum has none to schedule.
    model = train_torch.build_model(0)
    opt = ct.Shampoo(model.named_parameters(), betas=(0.0, 1.0),
                     job_id="no-momentum-" + uuid.uuid4().hex[:8])
    train_torch.loss_fn(model, 1, 0).backward()
    opt.param_groups[0]["betas"] = (0.5, 1.0)
    with pytest.raises(ValueError, match=r"\['shampoo'\]\['betas'\]: "
                                         r"beta1 0.5, but shampoo registered "
                                         r"with beta1 0"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.0, 0.9)  # beta2 may change
    opt.step()
    assert opt.steps == 1
    opt.close()


@pytest.mark.parametrize("world", [1, 2])
def test_state_dict_resumes_bitwise_in_new_processes(daemon, tmp_path, world):
    straight = run_ranks(daemon, world, str(tmp_path), "--optimizer", "soap",
                         "--last", "20")
    ckpt = str(tmp_path / "ckpt-{rank}.pt")
    run_ranks(daemon, world, str(tmp_path), "--optimizer", "soap",
              "--last", "10", "--save", ckpt)
    resumed = run_ranks(daemon, world, str(tmp_path), "--optimizer", "soap",
                        "--first", "11", "--last", "20", "--resume", ckpt)
    for a, b in zip(straight, resumed):
        assert a["losses"][10:] == b["losses"]
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n
    if world > 1:
        # Rank 0's file on every rank (Hugging Face's Trainer saves process
        # 0's optimizer only): rank 1 refuses it, saying why.
        outputs = run_ranks(daemon, world, str(tmp_path), "--optimizer",
                            "soap", "--first", "11", "--last", "11",
                            "--resume", str(tmp_path / "ckpt-0.pt"),
                            failing=True)
        code, output = outputs[1]
        assert code != 0
        assert "this state_dict is rank (0, 0, 0)'s, this is rank " \
            "(0, 1, 0)" in output, output


@pytest.mark.parametrize("load_model", ["first", "after-construct", "last"])
def test_a_bf16_run_resumes_bitwise_whenever_the_model_loads(daemon, tmp_path,
                                                             load_model):
    """A bf16 run at DP2 resumed in new processes from torch.save'd model
    and optimizer state, with the model's weights loaded before the
    optimizer is constructed, after it (torch's checkpoint tutorial), or
    after the optimizer's state (then every parameter is listed as changed
    and its master, which rounds to the loaded value, keeps its fp32
    bits): each goes on bitwise as the run never stopped."""
    common = ("--optimizer", "muon", "--dtype", "bfloat16")
    straight = run_ranks(daemon, 2, str(tmp_path), *common, "--last", "8")
    ckpt = str(tmp_path / "ckpt-{rank}.pt")
    run_ranks(daemon, 2, str(tmp_path), *common, "--last", "4",
              "--save", ckpt)
    resumed = run_ranks(daemon, 2, str(tmp_path), *common, "--first", "5",
                        "--last", "8", "--resume", ckpt,
                        "--load-model", load_model)
    for a, b in zip(straight, resumed):
        assert a["losses"][4:] == b["losses"]
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n


def test_accelerate_s_prepare_round_trip_before_the_first_step(daemon):
    """Hugging Face Accelerate prepares an optimizer by loading back its
    own state_dict() with every tensor moved to the device, before any
    step: the run then trains bitwise as one never round-tripped (on a
    GPU the state tensor arrives on it; load_state_dict reads it back)."""
    os.environ["CANZONA_TARGET"] = daemon
    models = [train_torch.build_model(0), train_torch.build_model(0)]
    opts = [ct.SOAP(m.named_parameters(), adamw_lr=3e-3) for m in models]

    def move_to_device(value, device):  # accelerate.utils.move_to_device
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {k: move_to_device(v, device) for k, v in value.items()}
        if isinstance(value, list):
            return [move_to_device(v, device) for v in value]
        return value

    prepared = move_to_device(opts[1].state_dict(), torch.device("cpu"))
    opts[1].load_state_dict(prepared)
    for step in range(1, 4):
        for model, opt in zip(models, opts):
            train_torch.loss_fn(model, step, 0).backward()
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), n
    for opt in opts:
        opt.close()


def test_a_new_optimizer_on_the_same_job_id_continues_bitwise(daemon,
                                                              tmp_path):
    """Two ranks close their optimizer before step 4 and construct another
    on the same job_id= that loads its state_dict (a second phase, a
    rebuilt optimizer): the new one registers as a job of its own, "<id>-2",
    and continues bitwise. Before, the second construction met the first
    job, closed on one rank and not yet on the other (FAILED_PRECONDITION
    "job failed: rank ... deregistered") or not yet counted as left by the
    daemon (ALREADY_EXISTS)."""
    straight = run_ranks(daemon, 2, str(tmp_path), "--optimizer", "soap",
                         "--last", "6")
    rebuilt = run_ranks(daemon, 2, str(tmp_path), "--optimizer", "soap",
                        "--last", "6", "--rebuild-at", "4")
    for a, b in zip(straight, rebuilt):
        first, second = b["job_ids"]
        assert second == first + "-2"
        assert a["losses"] == b["losses"]
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n


def test_two_live_optimizers_and_a_rebuilt_one_share_a_process(daemon):
    """Two models with an optimizer each on the default job id (a GAN's
    generator and discriminator, an actor and a critic), stepping in turn,
    then a third constructed right after the first's close() that loads its
    state_dict: each registers as a job of its own and trains as it would
    alone (bitwise).
    Before, the second construction met the first's job: ALREADY_EXISTS."""
    os.environ["CANZONA_TARGET"] = daemon

    def train(pairs, steps):
        for step in steps:
            for model, opt in pairs:
                train_torch.loss_fn(model, step, 0).backward()
                opt.step()
                opt.zero_grad()

    alone = train_torch.build_model(0)
    opt = ct.Muon(alone.named_parameters(),
                  job_id="alone-" + uuid.uuid4().hex[:8])
    train(((alone, opt),), range(1, 4))
    opt.close()
    a, b = train_torch.build_model(0), train_torch.build_model(0)
    first = ct.Muon(a.named_parameters())
    second = ct.Muon(b.named_parameters())
    assert first.job_id != second.job_id
    train(((a, first), (b, second)), range(1, 4))
    for model in (a, b):
        for (n, p), q in zip(model.named_parameters(), alone.parameters()):
            assert torch.equal(p, q), n
    state = first.state_dict()
    first.close()
    third = ct.Muon(a.named_parameters())
    third.load_state_dict(state)
    assert third.job_id not in (first.job_id, second.job_id)
    train(((a, third), (b, second)), range(4, 6))
    assert third.steps == second.steps == 5
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    second.close()
    third.close()


def test_a_state_dict_beyond_the_message_size_round_trips(daemon):
    """A rank's state larger than the daemon's 64 MiB gRPC message limit
    (AdamW over an 8192 x 1280 embedding: 84 MB) round-trips through
    state_dict() / load_state_dict(): the next step equals the original
    optimizer's bitwise. Before, load_state_dict failed with
    RESOURCE_EXHAUSTED "Received message larger than max"; a 4096 x 4096
    Muon matrix's momentum alone is past the limit."""
    os.environ["CANZONA_TARGET"] = daemon
    models = [torch.nn.Sequential(collections.OrderedDict(
        embed=torch.nn.Embedding(8192, 1280))) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    tokens = torch.arange(0, 8192, 7)

    def step(model, opt):
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()

    first = ct.Muon(models[0].named_parameters(), adamw_lr=1e-3)
    step(models[0], first)
    saved = first.state_dict()
    assert saved["canzona"]["state"].numel() > 64 << 20
    second = ct.Muon(models[1].named_parameters(), adamw_lr=1e-3)
    models[1].load_state_dict(models[0].state_dict())
    second.load_state_dict(saved)
    assert second.steps == 1
    for model, opt in zip(models, (first, second)):
        step(model, opt)
    assert torch.equal(models[0].embed.weight, models[1].embed.weight)
    first.close()
    second.close()


def test_overlap_waits_where_a_container_s_parameters_are_read(daemon):
    """module=: a ParameterList has no forward of its own (the module above
    it reads its weights), so after a step that answered early the parent's
    forward waits for their buckets before it runs, not a child's forward
    that runs after the weights were read."""
    waited = set()

    class ListModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4)
                 for _ in range(3)])
            self.head = torch.nn.Linear(16, 4)
            self.seen = []

        def forward(self, x):
            self.seen.append(set(waited))
            for w in self.weights:
                x = torch.tanh(x @ w)
            return self.head(x)

    model = ListModel()
    opt = ct.Muon(model.named_parameters(), module=model, target=daemon,
                  job_id="list-" + uuid.uuid4().hex[:8])
    real = opt.client.wait_params

    def counted(job_id, rank, step, bucket):
        waited.add(bucket)
        return real(job_id, rank, step, bucket)
    opt.client.wait_params = counted
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        waited.clear()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    weights = {id(w) for w in model.weights}
    buckets = {opt._bucket_of[j] for j, (p, _) in enumerate(opt._grads)
               if id(p) in weights}
    assert buckets
    # The first step learns the loop (its parameters are in place when it
    # returns); the overlap begins with the second.
    for seen in model.seen[2:]:
        assert buckets <= seen, (buckets, seen)


@pytest.mark.parametrize("unused", [False, True])
def test_a_bucket_s_event_covers_every_stream_its_gradients_used(
        daemon, monkeypatch, unused):
    """module= on a GPU: AccumulateGrad runs on the stream each
    parameter's forward used, so a bucket whose parameters were used under
    two streams has its gradients-ready event recorded once the reporting
    stream waited for the other; with a parameter that got no gradient no
    hook reports the bucket, and step() records after that wait instead.
    Streams and the event are stand-ins here (this machine has no GPU);
    the hooks and the order are the real ones."""
    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle
            self.waited = []

        def __eq__(self, other):
            return self.cuda_stream == other.cuda_stream

        def wait_stream(self, other):
            self.waited.append(other.cuda_stream)

    class Event:
        def __init__(self):
            self.records = []

        def record(self, stream):
            self.records.append((stream.cuda_stream, list(stream.waited)))
            stream.waited.clear()

    main, side = Stream(1), Stream(2)
    current = [main]
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: current[0])
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False),
                                torch.nn.Linear(16, 16, bias=False))
    if unused:
        model.unused = torch.nn.Linear(16, 16, bias=False)  # no gradient
    # Backward accumulates the second layer first: its forward ran under
    # the side stream, the first layer's under the main one. (Hooks run in
    # the order they were registered: these before the optimizer's.)
    accumulators = []  # before torch 2.1: hooks on the kept nodes
    for layer, stream in ((model[1], side), (model[0], main)):
        def use(*_, s=stream):
            current[0] = s
        w = layer.weight
        if hasattr(w, "register_post_accumulate_grad_hook"):
            w.register_post_accumulate_grad_hook(use)
        else:
            accumulators.append(w.expand_as(w).grad_fn.next_functions[0][0])
            accumulators[-1].register_hook(use)
    opt = ct.Muon(model.named_parameters(), module=model, target=daemon,
                  job_id="streams-" + uuid.uuid4().hex[:8])
    try:
        assert len(opt.registered["buckets"]) == 1
        opt._event = Event()
        x = torch.randn(4, 16, generator=g)

        def step_records_once(backwards):
            """No hook reports; step() records once, after the main stream
            waited for the side one."""
            for _ in range(backwards):
                model[1](model[0](x)).square().mean().backward()
            assert opt._event.records == []
            opt.step()
            opt.zero_grad()
            assert opt._event.records == [(1, [2])]
            opt._event.records.clear()

        step_records_once(1)  # the first step learns the loop
        model[1](model[0](x)).square().mean().backward()
        # Reported from the main stream after it waited for the side one.
        if unused:
            assert opt._event.records == []
            opt.step()
        else:
            assert opt._event.records == [(1, [2])]
            opt.step()
            opt._event.records.pop()  # step()'s own: nothing to wait for
        assert opt._event.records == [(1, [2])]
        opt.close()
        # Where the first step turned the overlap off (two backwards
        # outside no_sync()), each step records once, after the same wait.
        opt = ct.Muon(model.named_parameters(), module=model, target=daemon,
                      job_id="streams-off-" + uuid.uuid4().hex[:8])
        opt._event = Event()
        with pytest.warns(RuntimeWarning, match="two backwards"):
            step_records_once(2)
            step_records_once(2)
        assert opt._overlap == "off"
    finally:
        opt.close()


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_forward_pre_hooks_already_on_a_module_read_the_last_step(daemon,
                                                                  norm):
    """module=: torch.nn.utils.weight_norm and spectral_norm put a forward
    pre-hook on the layer that computes its weight from the parameters
    (weight_g and weight_v, weight_orig). The optimizer's wait for the
    layer's buckets runs before it, not after: before, that hook read the
    parameters while the last step's all-gathers could still be writing
    them (here: with the layer's bucket not waited for at steps 2 and 3).
    The run equals the one without module= bitwise."""
    os.environ["CANZONA_TARGET"] = daemon

    def run(overlap):
        torch.manual_seed(5)
        wrap = getattr(torch.nn.utils, norm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in torch >= 2.1
            model = torch.nn.Sequential(wrap(torch.nn.Linear(16, 16)),
                                        torch.nn.Tanh(),
                                        torch.nn.Linear(16, 4))
        opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                      module=model if overlap else None, bucket_size=300)
        pending = []
        hooks = model[0]._forward_pre_hooks
        key, norm_hook = next((k, h) for k, h in hooks.items()
                              if type(h).__module__.startswith("torch."))

        def spy(module, inputs):
            if overlap:
                pending.append({opt._bucket_of[j] for j, (p, _) in
                                enumerate(opt._grads)
                                if any(p is q for q in model[0].parameters())}
                               & opt._unsynced)
            return norm_hook(module, inputs)

        hooks[key] = spy
        g = torch.Generator().manual_seed(9)
        for _ in range(3):
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        return [p.detach().clone() for p in model.parameters()], pending

    plain, _ = run(False)
    overlapped, pending = run(True)
    assert pending == [set(), set(), set()]
    for a, b in zip(plain, overlapped):
        assert torch.equal(a, b)


def test_a_forward_that_reads_a_module_s_weight_without_calling_it(daemon):
    """module=: a fused linear cross-entropy (Liger's, Cut Cross-Entropy's)
    reads lm_head.weight without calling lm_head, so lm_head's pre-hook
    never waits for its bucket: before, the loss read it while the last
    step's all-gather could still be writing it (its bucket not waited for
    at steps 2 and 3). The model's forward learns from a training forward
    which readers it did not call and waits for their buckets first; only
    those lose the overlap, and an evaluation forward that calls lm_head
    (generate()) does not unteach it. Bitwise the run without module=."""
    os.environ["CANZONA_TARGET"] = daemon

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(16, 16)
            self.lm_head = torch.nn.Linear(16, 4, bias=False)
            self.read = []

        def forward(self, x, fused=True):
            h = torch.tanh(self.body(x))
            if not fused:
                return self.lm_head(h)
            self.read.append(self.lm_head.weight.detach().clone())
            return torch.nn.functional.linear(h, self.lm_head.weight)

    def run(overlap):
        torch.manual_seed(5)
        model = Model()
        opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                      module=model if overlap else None, bucket_size=60)
        assert len(opt.registered["buckets"]) == 2
        head = {b for b, members in enumerate(opt.registered["buckets"])
                for j in members if opt._grads[j][0] is model.lm_head.weight}
        assert len(head) == 1
        g = torch.Generator().manual_seed(9)
        pending = []
        real = model.forward

        def forward(x, fused=True):
            if overlap:
                pending.append(head & opt._unsynced)
            return real(x, fused)

        model.forward = forward
        for step in range(3):
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if overlap and step == 1:
                assert opt._uncalled_buckets == sorted(head)
                with torch.no_grad():
                    model(torch.randn(8, 16), fused=False)
                assert opt._uncalled_buckets == sorted(head)
        opt.close()
        return [p.detach().clone() for p in model.parameters()], \
            model.read, pending

    plain, plain_read, _ = run(False)
    overlapped, read, pending = run(True)
    # The training forwards (the third forward evaluates, calling lm_head).
    assert len(pending) == 4
    assert [pending[i] for i in (0, 1, 3)] == [set()] * 3, pending
    for a, b in zip(plain + plain_read, overlapped + read):
        assert torch.equal(a, b)


class _Checkpointed(torch.nn.Module):
    """A block whose activations backward recomputes (Hugging Face's
    gradient_checkpointing_enable(), Megatron's recompute)."""

    def __init__(self, block, reentrant):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        import torch.utils.checkpoint
        return torch.utils.checkpoint.checkpoint(
            self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_overlap_with_activation_checkpointing_is_bitwise(daemon, reentrant):
    """Activation checkpointing with module=: backward runs each block's
    forward again, pre-hooks and all, while the buckets of later blocks
    are being reduced. The overlap stays on, and the run is bitwise the
    one without module=."""
    os.environ["CANZONA_TARGET"] = daemon
    runs = []
    for module in (False, True):
        model = train_torch.build_model(0)
        for i, block in enumerate(model.layers):
            model.layers[i] = _Checkpointed(block, reentrant)
        opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                      bucket_size=20000, module=model if module else None)
        losses = []
        for step in range(1, 5):
            loss = train_torch.loss_fn(model, step, 0)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if module:
            assert opt._overlap == "on"
            assert len(opt.registered["buckets"]) > 2
        runs.append((losses, [p.detach().clone()
                              for p in model.parameters()]))
        opt.close()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["muon", "soap"])
def test_overlap_and_hierarchical_sharding_are_bitwise(daemon, tmp_path, kind):
    """module= (GradReady from backward hooks, async step, WaitParams in
    forward pre-hooks) and shard_group_size=1 (every DP rank a group of its
    own: replicated state, all-reduced gradients) give the plain step's
    bits; small buckets so that the model spans several. So does overlap
    when the loop clears gradients with model.zero_grad() (.grad = None,
    as Hugging Face's Trainer does): backward must still accumulate into
    the memory the daemon reduces from the hooks' reports."""
    common = ("--optimizer", kind, "--last", "6", "--bucket-size", "20000")
    plain = run_ranks(daemon, 2, str(tmp_path / "plain"), *common)
    overlap = run_ranks(daemon, 2, str(tmp_path / "overlap"), *common,
                        "--overlap")
    hier = run_ranks(daemon, 2, str(tmp_path / "hier"), *common, "--overlap",
                     "--shard-group-size", "1")
    none = run_ranks(daemon, 2, str(tmp_path / "none"), *common, "--overlap",
                     "--model-zero-grad")
    assert plain[0]["buckets"] > 2, plain[0]["buckets"]
    for other in (overlap, hier, none):
        for a, b in zip(plain, other):
            assert a["losses"] == b["losses"]
            for n, p in a["params"].items():
                assert torch.equal(p, b["params"][n]), n
    for r in overlap:
        total, exposed = r["comm"]
        assert 0 <= exposed and 0 <= total
        # From the second step on (the first learns the loop), every
        # bucket reported from backward hooks and waited for by a forward
        # pre-hook (the last step's by synchronize()).
        assert r["events"]["grad_ready"] == 5 * r["buckets"], r["events"]
        assert r["events"]["wait_params"] >= 4 * r["buckets"], r["events"]
    assert plain[0]["events"] == {"grad_ready": 0, "wait_params": 0}


@pytest.mark.parametrize("edit", ["clip_grad_norm_", "mul_"])
def test_overlap_refuses_gradients_edited_after_backward(daemon, edit):
    """module=: the buckets backward reported are being reduced already, so
    an in-place edit of the gradients before step() (a torch loop's clip or
    GradScaler unscale) would race with the daemon's reads. step() raises
    naming the remedy, before anything steps; the loop without the edit
    steps."""
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), module=model, target=daemon,
                  job_id="edited-" + uuid.uuid4().hex[:8])
    train_torch.loss_fn(model, 1, 0).backward()
    opt.step()
    opt.zero_grad()
    train_torch.loss_fn(model, 1, 1).backward()
    opt.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    if edit == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    else:
        for p in model.parameters():
            p.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="changed in place between "
                       "backward and step.*max_grad_norm="):
        opt.step()
    assert opt.steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    status = canzona.Client(daemon).status()
    assert any(j["job_id"] == opt.job_id for j in status["jobs"])
    opt.close()


def test_overlap_state_dict_waits_for_the_parameters(daemon):
    """With module= step() returns before every bucket's parameters are
    back (opt._unsynced: those not waited for yet); the model's
    state_dict() (what torch.save, save_pretrained and checkpoints read)
    waits for them first, as a forward does, and holds the stepped values,
    equal to a run without module=. (On this one-rank cpu daemon the
    values are in place early anyway: the wait is what is checked.)"""
    os.environ["CANZONA_TARGET"] = daemon
    saved = {}
    for overlap in (False, True):
        model = train_torch.build_model(0)
        opt = ct.Muon(model.named_parameters(),
                      module=model if overlap else None,
                      job_id="state-dict-" + uuid.uuid4().hex[:8])
        for step in range(1, 3):
            train_torch.loss_fn(model, step, 0).backward()
            opt.step()
            opt.zero_grad()
        if overlap:
            assert opt._unsynced  # the last step's buckets, not waited for
        saved[overlap] = {k: v.clone() for k, v in model.state_dict().items()}
        if overlap:
            assert not opt._unsynced
        opt.close()
    for k, v in saved[False].items():
        assert torch.equal(saved[True][k], v), k


def _saved_bytes(obj):
    out = io.BytesIO()
    torch.save(obj, out)
    return len(out.getvalue())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_state_dict_holds_only_its_own_parameters(daemon, dtype):
    """torch.save(model.state_dict()) (nanoGPT's and most loops'
    checkpoint), or one layer's, writes what it did before the optimizer
    took the parameters, and loads back as the trained values. Before,
    each parameter viewed the one shared buffer, so torch.save wrote that
    whole storage with every tensor: every parameter and every gradient,
    2x the model for the model's state_dict, the whole model for one
    layer's."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0).to(dtype)
    layer = model.layers[0]
    before = _saved_bytes(model.state_dict()), _saved_bytes(layer.state_dict())
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3)
    for step in (1, 2):
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        opt.zero_grad()
    after = _saved_bytes(model.state_dict()), _saved_bytes(layer.state_dict())
    assert after == before, (before, after)
    # What was saved is what was trained, and a plain model takes it.
    out = io.BytesIO()
    torch.save(model.state_dict(), out)
    out.seek(0)
    fresh = train_torch.build_model(1).to(dtype)
    fresh.load_state_dict(torch.load(out))
    for (name, a), b in zip(model.state_dict().items(),
                            fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.state_dict()["layers.0.mlp.up_proj.weight"],
                           train_torch.build_model(0).to(dtype)
                           .state_dict()["layers.0.mlp.up_proj.weight"])
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_model_with_its_optimizer_pickles_and_loads_without_canzona(
        daemon, tmp_path, overlap):
    """torch.save(model) of the whole module (a model handed to a spawned
    process is pickled alike) while the optimizer holds it: the file loads
    in a process that cannot import canzona, and the loaded model computes
    what the trained one does. torch >= 2.0 pickles a Parameter's __dict__
    too, where canzona keeps a reference to its optimizer. Before, with
    module= the model's hooks made torch.save raise "Can't pickle local
    object", and a Parameter's __dict__ could not be pickled."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                  module=model if overlap else None)
    for step in (1, 2, 3):
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        opt.zero_grad()
    for param in model.parameters():
        assert pickle.loads(pickle.dumps(dict(param.__dict__))) == {
            k: None for k in param.__dict__}
    path = str(tmp_path / "model.pt")
    torch.save(model, path)
    with torch.no_grad():
        want = train_torch.loss_fn(model, 4, 0).item()
    script = (
        "import sys, torch\n"
        "sys.modules['canzona'] = None  # import canzona fails\n"
        "sys.path.insert(0, %r)\n"
        "import train_torch\n"
        "model = torch.load(%r)\n"
        "with torch.no_grad():\n"
        "    print(repr(train_torch.loss_fn(model, 4, 0).item()))\n"
        % (os.path.join(ROOT, "client", "examples"), path))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", script], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == want, (out.stdout, want)
    opt.close()


def test_an_ema_deepcopy_of_an_overlapped_model_is_on_its_own(daemon):
    """copy.deepcopy(model) after constructing with module= (an EMA copy, as
    diffusion and LLM trainers keep one) copies the forward and state_dict
    hooks too: the copy's forward waits for nothing of the optimizer's, its
    state_dict() synchronizes nothing, and both still run after close().
    Before, each forward of the copy waited for the live model's buckets."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3, module=model)
    ema = copy.deepcopy(model)
    waits = []
    real_wait = opt.client.wait_params

    def counted(*args, **kwargs):
        waits.append(args)
        return real_wait(*args, **kwargs)

    opt.client.wait_params = counted
    for step in (1, 2):  # the first learns the loop, the second overlaps
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        train_torch.loss_fn(ema, 2, 0)
        ema.state_dict()
    assert waits == []
    train_torch.loss_fn(model, 3, 0).backward()
    assert len(waits) > 0
    opt.close()
    with torch.no_grad():
        train_torch.loss_fn(ema, 3, 0)


def test_an_interrupted_overlapped_backward_recovers_through_state(daemon):
    """With module=, a backward interrupted after it reported buckets
    (Ctrl-C) leaves them reported for a step that never comes: the next
    step() refuses and says how to go on, and going on so (state_dict(),
    a new optimizer, load_state_dict()) trains bitwise as a run never
    interrupted."""
    os.environ["CANZONA_TARGET"] = daemon
    models = [train_torch.build_model(0), train_torch.build_model(0)]
    opts = [ct.Muon(m.named_parameters(), adamw_lr=3e-3, module=m)
            for m in models]

    def ctrl_c(grad):
        raise KeyboardInterrupt

    def train(model, opt, step):
        train_torch.loss_fn(model, step, 0).backward()
        opt.step()
        opt.zero_grad()

    for model, opt in zip(models, opts):
        train(model, opt, 1)
    model, opt = models[1], opts[1]
    # The embedding's output gradient comes last in backward: most
    # buckets are reported by then.
    handle = model.embed_tokens.register_forward_hook(
        lambda module, args, out: out.register_hook(ctrl_c) and None)
    with pytest.raises(KeyboardInterrupt):
        train_torch.loss_fn(model, 2, 0).backward()
    handle.remove()
    opt.zero_grad()
    train_torch.loss_fn(model, 2, 0).backward()
    with pytest.raises(RuntimeError, match=r"To go on, carry the state "
                       r"into a new optimizer"):
        opt.step()
    state = opt.state_dict()
    opt.close()
    opts[1] = ct.Muon(model.named_parameters(), adamw_lr=3e-3, module=model)
    opts[1].load_state_dict(state)
    opts[1].zero_grad()
    for step in range(2, 4):
        for model, opt in zip(models, opts):
            train(model, opt, step)
    for opt in opts:
        opt.synchronize()
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), n
    for opt in opts:
        opt.close()


def test_overlap_accumulates_inside_no_sync_and_refuses_it_outside(daemon):
    """Gradient accumulation with module=: every backward but the last
    inside opt.no_sync() reports nothing, so the step reduces the sum of
    the micro-batches, bitwise what the same loop gives without module=
    (where backward reports nothing anyway). Without no_sync() in the
    first step, the optimizer learns that the loop accumulates, and steps
    without the overlap (warned once, the same bits). Once the overlap is
    on, the first backward reports its buckets and the daemon starts
    reducing them while a second adds to them: step() refuses, naming a
    parameter, before anything steps."""
    os.environ["CANZONA_TARGET"] = daemon
    runs = {}
    for overlap, micros in ((False, 2), (True, 2), (False, 1)):
        model = train_torch.build_model(0)
        opt = ct.Muon(model.named_parameters(),
                      module=model if overlap else None,
                      job_id="accumulate-" + uuid.uuid4().hex[:8])
        for step in range(1, 4):
            for micro in range(micros):
                sync = opt.no_sync() if overlap and micro == 0 else \
                    contextlib.nullcontext()
                with sync:
                    train_torch.loss_fn(model, step, micro).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        runs[overlap, micros] = {n: p.detach().clone()
                                 for n, p in model.named_parameters()}
        opt.close()
    for n, p in runs[False, 2].items():
        assert torch.equal(runs[True, 2][n], p), n
    # One micro-batch lands elsewhere: the sum of two was stepped.
    assert max(relative(runs[False, 1][n], p)
               for n, p in runs[False, 2].items()) > 1e-3
    # Without no_sync() from the first step on: that step sees the second
    # backward, and the optimizer steps without the overlap, warning once;
    # the same bits. Before, step() refused.
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), module=model,
                  job_id="accumulate-plain-" + uuid.uuid4().hex[:8])
    with pytest.warns(RuntimeWarning) as caught:
        for step in range(1, 4):
            for micro in range(2):
                train_torch.loss_fn(model, step, micro).backward()
            opt.step()
            opt.zero_grad()
    assert [str(w.message) for w in caught if "module=" in str(w.message)
            and "two backwards outside opt.no_sync() accumulate into"
            in str(w.message)] == [str(caught[0].message)], caught
    assert opt._overlap == "off"
    for n, p in model.named_parameters():
        assert torch.equal(p, runs[False, 2][n]), n
    opt.close()
    # Once the overlap is on (a first step of one backward), the second
    # backward plain, or (the wrong way round) inside no_sync() after a
    # first that reported: both add to reported buckets, and step()
    # refuses.
    for second_unsynced in (False, True):
        model = train_torch.build_model(0)
        opt = ct.Muon(model.named_parameters(), module=model,
                      job_id="accumulate-bad-" + uuid.uuid4().hex[:8])
        train_torch.loss_fn(model, 1, 0).backward()
        opt.step()
        opt.zero_grad()
        assert opt._overlap == "on"
        train_torch.loss_fn(model, 2, 0).backward()
        with opt.no_sync() if second_unsynced else contextlib.nullcontext():
            train_torch.loss_fn(model, 2, 1).backward()
        opt.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"a second backward "
                           r"accumulated into '.*'.*opt\.no_sync\(\)"):
            opt.step()
        assert opt.steps == 1
        assert all(torch.equal(a, p)
                   for a, p in zip(before, model.parameters()))
        opt.close()


def _gan_run(overlap, no_sync, edit=False):
    """Three iterations of the DCGAN tutorial's loop with a canzona
    optimizer for each network: the discriminator takes a backward on real
    and one on generated samples per step, and the generator's loss
    backpropagates through it too. ``no_sync``: the discriminator's first
    backward and the generator's (as far as the discriminator goes) inside
    its no_sync(). ``edit``: the generator's gradients clipped by
    clip_grad_norm_ before its step."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 16))
    disc = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 1))
    opt_g = ct.Muon(gen.named_parameters(), adamw_lr=1e-3,
                    module=gen if overlap else None)
    opt_d = ct.Muon(disc.named_parameters(), adamw_lr=1e-3,
                    module=disc if overlap else None)
    bce = torch.nn.BCEWithLogitsLoss()
    quiet = contextlib.nullcontext

    def disc_sync():
        return opt_d.no_sync() if no_sync else quiet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            real, z = torch.randn(8, 16), torch.randn(8, 8)
            opt_d.zero_grad()
            with disc_sync():
                bce(disc(real), torch.ones(8, 1)).backward()
            fake = gen(z)
            bce(disc(fake.detach()), torch.zeros(8, 1)).backward()
            opt_d.step()
            opt_g.zero_grad()
            with disc_sync():
                bce(disc(fake), torch.ones(8, 1)).backward()
            if edit:
                torch.nn.utils.clip_grad_norm_(gen.parameters(), 0.1)
            opt_g.step()
    overlaps = [getattr(o, "_overlap", None) for o in (opt_g, opt_d)]
    for opt in (opt_g, opt_d):
        opt.close()
    ours = [w for w in caught if "canzona" in str(w.message)]
    # Each names the loop's line, not one inside torch (torch.optim wraps
    # step() in frames of its own).
    assert [w.filename for w in ours] == [__file__] * len(ours), [
        (w.filename, w.lineno) for w in ours]
    return ([p.detach().clone() for m in (gen, disc) for p in m.parameters()],
            overlaps, [str(w.message) for w in ours])


@pytest.mark.parametrize("edit", [False, True])
def test_a_gan_loop_with_module_trains_as_without(daemon, edit):
    """The DCGAN tutorial's loop with module= on both networks: its
    discriminator takes two backwards per step (and the generator's loss
    flows through it), which the overlap cannot take: its first step sees
    that, and it steps without the overlap, warning once; the generator
    overlaps, unless its loop clips with clip_grad_norm_ (warned once).
    Bitwise the run without module=. With no_sync() around the
    discriminator's other backwards, both overlap, without a warning.
    Before, the discriminator's first step() raised "a second backward"."""
    os.environ["CANZONA_TARGET"] = daemon
    plain, overlaps, caught = _gan_run(False, False, edit)
    assert overlaps == [None, None] and caught == []
    learned, overlaps, caught = _gan_run(True, False, edit)
    assert overlaps == ["off" if edit else "on", "off"], overlaps
    assert len(caught) == (2 if edit else 1), caught
    assert any("two backwards outside opt.no_sync() accumulate into "
               "'2.bias'" in w for w in caught), caught
    assert not edit or any("gradients change in place between backward "
                           "and step()" in w for w in caught), caught
    synced, overlaps, caught = _gan_run(True, True, edit)
    assert overlaps == ["off" if edit else "on", "on"], overlaps
    assert len(caught) == (1 if edit else 0), caught
    for a, b, c in zip(plain, learned, synced):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_settings_that_are_no_numbers_are_refused_naming_them(daemon):
    """lr and the settings schedules write must be numbers, as in
    torch.optim: a str is a ValueError naming the group and key, at
    construction and at step() (nothing steps, and the next step does); a
    one-element tensor (torch.optim takes a Tensor lr) is its value;
    betas that are no pair are named. Before, lr="0.02" registered and
    stayed a str in param_groups, a Tensor lr was refused by the daemon
    as "tensor(0.0200)", and the others raised IndexError or a ValueError
    without a name."""
    os.environ["CANZONA_TARGET"] = daemon
    for kwargs, text in (
            ({"lr": "0.02"}, "groups['muon']['lr']: '0.02' is not a number"),
            ({"weight_decay": None},
             "groups['muon']['weight_decay']: None is not a number"),
            ({"adamw_betas": (0.9,)},
             "adamw_betas: (0.9,) is not a pair (beta1, beta2)")):
        with pytest.raises(ValueError) as error:
            ct.Muon(train_torch.build_model(0).named_parameters(), **kwargs)
        assert str(error.value) == text
    with pytest.raises(ValueError, match=r"^betas: 0\.9 is not a pair"):
        ct.SOAP(train_torch.build_model(0).named_parameters(), betas=0.9)
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), lr=torch.tensor(0.02))
    assert opt.param_groups[0]["lr"] == float(torch.tensor(0.02))
    train_torch.loss_fn(model, 1, 0).backward()
    opt.step()
    train_torch.loss_fn(model, 2, 0).backward()
    for key, value in (("lr", "x"), ("momentum", "0.9")):
        before = [p.detach().clone() for p in model.parameters()]
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError) as error:
            opt.step()
        assert str(error.value) == ("param_groups['muon'][%r]: %r is not a "
                                    "number" % (key, value))
        assert opt.steps == 1
        assert all(torch.equal(a, p) for a, p in zip(before,
                                                     model.parameters()))
        opt.param_groups[0][key] = good
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    opt.step()
    assert opt.steps == 2
    opt.close()


def _route(name, group, shape=(8, 16), tp_split=False):
    return name, group, shape, tp_split


@pytest.mark.parametrize("name, group, shape, tp_split", [
    # MoE routers, as Hugging Face's models name them: AdamW, whichever
    # family (before, Mixtral's, PhiMoE's and MiniMax's went to Muon
    # while Qwen's and DeepSeek's went to AdamW).
    # Mixtral; Qwen-MoE and DeepSeek; Qwen2-MoE; GPT-OSS; Llama 4; DBRX.
    _route("model.layers.0.block_sparse_moe.gate.weight", "adamw"),
    _route("model.layers.0.mlp.gate.weight", "adamw"),
    _route("model.layers.0.mlp.shared_expert_gate.weight", "adamw"),
    _route("model.layers.0.mlp.router.weight", "adamw"),
    _route("model.layers.0.feed_forward.router.weight", "adamw"),
    _route("transformer.blocks.0.ffn.router.layer.weight", "adamw"),
    _route("model.embed_tokens.weight", "adamw"),
    _route("lm_head.weight", "adamw"),
    # Hidden matrices, gates of a GLU among them.
    _route("model.layers.0.mlp.gate_proj.weight", "muon"),
    _route("model.layers.0.block_sparse_moe.experts.0.w1.weight", "muon"),
    _route("model.layers.0.mlp.experts.3.gate_proj.weight", "muon"),
    _route("model.layers.0.mlp.shared_expert.gate_proj.weight", "muon"),
    _route("model.layers.0.self_attn.q_proj.weight", "muon"),
    _route("transformer.h.0.attn.c_attn.weight", "muon"),
    _route("gate_up_proj.weight", "muon"),
    # Experts fused into one 3-D stack (E, rows, cols) step as E matrices
    # (GPT-OSS's, and Hugging Face's fused MoE layers); before, AdamW
    # took them, the bulk of an MoE model. A 3-D tensor of another kind
    # (a Conv1d's filters), convolution filters and experts split over
    # tensor parallelism (which the daemon does not step) stay in AdamW.
    _route("model.layers.0.mlp.experts.gate_up_proj", "muon", (4, 8, 16)),
    _route("model.layers.0.mlp.experts.down_proj", "muon", (4, 16, 8)),
    # Mamba's (and Jamba's) state matrix is 2-D (before: Muon).
    _route("model.layers.0.mamba.A_log", "adamw"),
    # GPT-OSS's biases per expert are 2-D (before: Muon).
    _route("model.layers.0.mlp.experts.gate_up_proj_bias", "adamw"),
    _route("model.layers.0.conv1d.weight", "adamw", (4, 8, 16)),
    _route("encoder.conv1.weight", "adamw", (4, 8, 3, 3)),
    _route("model.layers.0.mlp.experts.gate_up_proj", "adamw", (4, 8, 16),
           True),
])
def test_default_route_by_name_and_shape(name, group, shape, tp_split):
    param = torch.nn.Parameter(torch.empty(*shape))
    if tp_split:  # Megatron's attributes of a tensor-parallel weight
        param.tensor_model_parallel, param.partition_dim = True, 1
    assert ct.default_route(name, param, "muon") == group


def test_bad_use_raises_clear_errors(daemon):
    os.environ["CANZONA_TARGET"] = daemon
    # Not running: a clear "cannot reach canzonad at ..." error.
    with pytest.raises(canzona.CanzonaError, match="cannot reach canzonad at"):
        ct.Muon([("w", torch.nn.Parameter(torch.randn(4, 4)))],
                target="unix:/nonexistent/canzonad.sock", connect_timeout=1)
    # A device the daemon cannot map.
    meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="is on meta"):
        ct.Muon([("w", meta)], job_id="bad-device")
    # A GPU trainer's export without a usable CUDA runtime or device.
    if not torch.cuda.is_available():
        with pytest.raises(canzona.CanzonaError) as error:
            canzona.CudaEvent(0)
        assert error.value.code == "FAILED_PRECONDITION"
    # A dtype the daemon does not take, named with its parameter.
    wide = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="parameter 'w' is torch.float64"):
        ct.Muon([("v", torch.nn.Parameter(torch.randn(4, 4))), ("w", wide)],
                job_id="bad-dtype")
    # Not contiguous (a transposed view): it moves into the buffer
    # row-major, its values unchanged.
    strided = torch.nn.Parameter(torch.randn(4, 6).t())
    values = strided.detach().clone()
    opt = ct.Muon([("w", strided)], job_id="strided-" + uuid.uuid4().hex[:8])
    assert strided.is_contiguous() and torch.equal(strided, values)
    opt.close()
    # The daemon's own validation, with its message and code.
    with pytest.raises(canzona.CanzonaError) as error:
        ct.Optimizer([("w", torch.nn.Parameter(torch.randn(4, 4)))],
                     {"m": {"optimizer": "muon", "lr": -1.0}},
                     job_id="bad-lr-" + uuid.uuid4().hex[:8])
    assert error.value.code == "INVALID_ARGUMENT"
    assert "lr" in str(error.value)
    # step() before backward.
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(),
                  job_id="no-backward-" + uuid.uuid4().hex[:8])
    with pytest.raises(RuntimeError, match="before backward"):
        opt.step()
    train_torch.loss_fn(model, 1, 0).backward()
    # GradScaler's announced attribute protocol (a scale set on the
    # optimizer, no grad_scaler=): refused before anything steps.
    opt.grad_scale = torch.full((1,), 1024.0)
    with pytest.raises(RuntimeError, match="grad_scaler="):
        opt.step()
    del opt.grad_scale
    assert opt.steps == 0
    assert opt.steps == 0
    plan, digest = opt.plan()
    assert plan["layout"]["dp"] == 1 and digest
    status = canzona.Client(daemon).status()
    assert any(j["job_id"] == opt.job_id for j in status["jobs"])
    path = "/dev/shm" + opt._buffer.name
    assert os.path.exists(path)
    before = [p.detach().clone() for p in model.parameters()]
    opt.close()
    # close() removes the buffer's name; the parameters still read it.
    assert not os.path.exists(path)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.close()  # idempotent
    # A closed optimizer says so (before: "before backward", or a failed
    # RPC "on closed channel"); synchronize() has nothing left to wait for.
    for call in (opt.step, opt.state_dict, opt.plan):
        with pytest.raises(RuntimeError, match=r"this optimizer is closed "
                           r"\(close\(\) ended its job"):
            call()
    opt.synchronize()
    # A torch.optim optimizer's state_dict: what carries over, and what not
    # (before: KeyError 'canzona').
    plain = torch.optim.AdamW(train_torch.build_model(0).parameters())
    fresh = ct.Muon(train_torch.build_model(0).named_parameters(),
                    job_id="torch-state-" + uuid.uuid4().hex[:8])
    with pytest.raises(ValueError, match="not a canzona.torch state_dict"):
        fresh.load_state_dict(plain.state_dict())
    fresh.close()


def test_a_refused_construction_leaves_the_model_as_it_was(daemon,
                                                           monkeypatch):
    """A setting the daemon refuses (a notebook cell with a typo'd lr)
    leaves no hook on the parameters, no gradient view and no name in
    /dev/shm: the next backward runs, and the next optimizer trains the
    model bitwise as it trains one never touched.
    Before, that backward raised AttributeError from the refused
    optimizer's hook, for good."""
    os.environ["CANZONA_TARGET"] = daemon
    touched, untouched = train_torch.build_model(0), train_torch.build_model(0)
    # The refused optimizer's own buffer (a listing of /dev/shm would race
    # the names other test processes create and remove meanwhile).
    allocated = []
    real_allocate = canzona.Client.allocate

    def allocate(*args, **kwargs):
        allocated.append(real_allocate(*args, **kwargs))
        return allocated[-1]

    monkeypatch.setattr(canzona.Client, "allocate", allocate)
    with pytest.raises(canzona.CanzonaError, match="setting lr: bad value"):
        ct.Muon(touched.named_parameters(), lr=-1.0)
    [buffer] = allocated
    assert not os.path.exists("/dev/shm" + buffer.name)
    monkeypatch.undo()
    assert all(p.grad is None for p in touched.parameters())
    train_torch.loss_fn(touched, 1, 0).backward()
    for model in (touched, untouched):
        model.zero_grad(set_to_none=True)
    opts = [ct.Muon(m.named_parameters(), adamw_lr=3e-3)
            for m in (touched, untouched)]
    for step in range(1, 3):
        for model, opt in zip((touched, untouched), opts):
            train_torch.loss_fn(model, step, 0).backward()
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(touched.named_parameters(), untouched.parameters()):
        assert torch.equal(p, q), n
    for opt in opts:
        opt.close()


def test_a_failure_after_register_deregisters(daemon, monkeypatch):
    # Anything failing after Register (here the doorbell's attach) must not
    # leave the rank registered: it would keep its state and its mapping of
    # the buffer, and hold the job id.
    os.environ["CANZONA_TARGET"] = daemon

    def refuse(*args, **kwargs):
        raise canzona.CanzonaError("attach refused", "UNAVAILABLE")

    monkeypatch.setattr(canzona.Client, "attach_step_doorbell", refuse)
    monkeypatch.setattr(canzona.Client, "step_doorbell_supported",
                        lambda self: True)
    job = "after-register-" + uuid.uuid4().hex[:8]
    model = train_torch.build_model(0)
    with pytest.raises(canzona.CanzonaError, match="attach refused"):
        ct.Muon(model.named_parameters(), job_id=job)
    status = canzona.Client(daemon).status()
    assert not any(j["job_id"] == job for j in status["jobs"])


def test_host_memory_the_daemon_could_not_lock_warns(daemon, monkeypatch):
    # A daemon whose memlock limit refused cudaHostRegister reports the
    # bytes at registration; the trainer hears of it, not only the daemon's
    # log. (This cpu daemon locks nothing: its answer is 0, and no warning.)
    os.environ["CANZONA_TARGET"] = daemon
    register = canzona.Client.register
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt = ct.Muon(train_torch.build_model(0).named_parameters(),
                      job_id="locked-" + uuid.uuid4().hex[:8])
    assert opt.registered["pageable_host_bytes"] == 0
    opt.close()

    def refused(self, *args, **kwargs):
        r = register(self, *args, **kwargs)
        r["pageable_host_bytes"] = 1 << 20
        return r

    monkeypatch.setattr(canzona.Client, "register", refused)
    with pytest.warns(RuntimeWarning,
                      match="could not page-lock 1048576 bytes.*memlock"):
        opt = ct.Muon(train_torch.build_model(0).named_parameters(),
                      job_id="unlocked-" + uuid.uuid4().hex[:8])
    opt.close()


def _fused_and_separate(seed):
    """One attention + MLP's weights (8 heads in 4 query groups of 8 over
    hidden 64; ffn 48) as separate q, k, v, gate, up and as Megatron's fused
    linear_qkv (per group: q heads, k, v) and linear_fc1 ([gate; up])."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, 64, generator=g) * 0.1
               for rows in (64, 32, 32))
    gate, up = (torch.randn(48, 64, generator=g) * 0.1 for _ in range(2))

    def fuse_qkv(q, k, v):
        parts = []
        for group in range(4):
            parts += [q[16 * group:16 * group + 16], k[8 * group:8 * group + 8],
                      v[8 * group:8 * group + 8]]
        return torch.cat(parts)

    separate = {"q_proj": q, "k_proj": k, "v_proj": v, "gate_proj": gate,
                "up_proj": up}
    fused = {"linear_qkv": fuse_qkv(q, k, v),
             "linear_fc1": torch.cat([gate, up])}
    return separate, fused, fuse_qkv


def test_megatron_blocks_train_like_separate_matrices(daemon):
    """canzona.torch with blocks: Megatron's fused qkv / fc1 train bitwise
    like separate q, k, v, gate, up under Muon; without blocks they do
    not."""
    os.environ["CANZONA_TARGET"] = daemon
    separate, fused, fuse_qkv = _fused_and_separate(0)
    grads = [_fused_and_separate(s + 1) for s in range(3)]
    blocks = {"linear_qkv": canzona.megatron_qkv_blocks(8, 4, 8),
              "linear_fc1": canzona.megatron_fc1_blocks(48)}
    assert blocks["linear_qkv"]["sizes"] == [16, 8, 8]

    def train(values, grad_of, with_blocks):
        params = {n: torch.nn.Parameter(t.clone()) for n, t in values.items()}
        opt = ct.Muon(list(params.items()), lr=0.02,
                      job_id="blocks-" + uuid.uuid4().hex[:8],
                      blocks=blocks if with_blocks else None)
        try:
            for step in range(3):
                opt.zero_grad()
                # d/dp sum(p * G) = G: backward delivers exactly G.
                loss = sum((p * grad_of(step)[n]).sum()
                           for n, p in params.items())
                loss.backward()
                opt.step()
            return {n: p.detach().clone() for n, p in params.items()}
        finally:
            opt.close()

    want = train(separate, lambda s: grads[s][0], False)
    want_fused = {"linear_qkv": fuse_qkv(want["q_proj"], want["k_proj"],
                                         want["v_proj"]),
                  "linear_fc1": torch.cat([want["gate_proj"],
                                           want["up_proj"]])}
    got = train(fused, lambda s: grads[s][1], True)
    for name in fused:
        assert torch.equal(got[name], want_fused[name]), name
    control = train(fused, lambda s: grads[s][1], False)
    assert not torch.equal(control["linear_qkv"], want_fused["linear_qkv"])
    # Blocks for a parameter that does not exist, and blocks the daemon
    # refuses (a size that does not tile the rows), name the problem.
    with pytest.raises(ValueError, match="no parameter named"):
        ct.Muon([("w", torch.nn.Parameter(torch.randn(4, 4)))],
                blocks={"x": canzona.megatron_fc1_blocks(2)})
    with pytest.raises(canzona.CanzonaError) as error:
        ct.Muon([("w", torch.nn.Parameter(torch.randn(6, 4)))],
                job_id="bad-blocks-" + uuid.uuid4().hex[:8],
                blocks={"w": canzona.blocks([2, 2])})
    assert error.value.code == "INVALID_ARGUMENT"
    assert "'w'.blocks.sizes" in str(error.value)
