#!/usr/bin/env python3
"""The PyTorch check of the GPU bundle: a real torch model (a small
decoder: embeddings, attention and MLP matrices, LayerNorms, biases, an
output head) trained through canzona.torch against a canzonad, step by step
beside torch.optim.Muon (2-D hidden matrices) + torch.optim.AdamW (the
rest) on the same device, with the same settings.

    torch_check.py --target unix:/run/canzona.sock --device cuda --out check.json
    torch_check.py --canzonad build/server/canzonad --device cpu \\
        --variants fp32 --allow-builtin-muon --out check.json   # no GPU, torch < 2.9

Lockstep: each step, the torch model takes canzona's parameters and the
gradients canzona's backward produced, so both optimizers see exactly the
same inputs, and each step's update (new - old parameters) is compared per
parameter by ||ours - torch|| / ||torch||. The canzona model trains on its
own, on one fixed batch of random tokens (its loss must fall). Variants:

  fp32  model in float32; Newton-Schulz in float32 on both sides: the
        daemon with ns_precision=fp32, torch.optim.Muon with its NS
        function run in float32 (torch's Muon always casts to bf16; the
        module function is replaced by the same iteration without the
        cast). Matrix tolerance 1e-3: cuBLAS float32 (no TF32) against
        torch's float32 matmuls; the Backend conformance suite holds fp32
        NS to 2e-4 across BLAS libraries, and NS5 amplifies differences in
        the small singular directions by up to a^5 ~ 480 there.
  bf16  model under bf16 autocast; Newton-Schulz in bf16 on both sides:
        ns_precision=bf16 and torch.optim.Muon unchanged. Matrix tolerance
        6e-2: each side is 1-2.5% (relative Frobenius) from the exact
        result (tests/gpu/cuda_backend_test.cc measured ours; torch stores
        the same bf16 intermediates), so they can differ by ~5%; order-1
        faults (a wrong scale, a missing normalization) stay far above.
  bf16params  the model's parameters in bfloat16 (mixed precision: the
        daemon keeps fp32 master weights and state, the trainer bf16
        parameters and gradients); Newton-Schulz in float32 on both sides,
        so that what is checked is the mixed-precision path (bf16
        gradients widened, fp32 masters updated, rounded back into the
        trainer's memory; on a GPU over CUDA IPC). The torch side keeps
        fp32 masters of its own, stepped with the same bf16 gradients
        (widened) and never synced: after each step canzona's parameters
        must equal the masters rounded to bf16 within 2e-3 (relative
        Frobenius, both groups): only elements whose masters straddle a
        rounding boundary may differ, each by one ulp (2^-8 relative).
        Measured on the cpu backend over 10 steps: 3.8e-5; with the torch
        side re-reading its masters from the rounded parameters every step
        (what a daemon that lost its masters would do: sub-ulp updates
        vanish) 2.8e-3 (matrices) and 5.4e-3 (vectors), about the same at
        20 steps. On a GPU the two sides' fp32 updates differ more (cuBLAS
        against torch's matmuls, ~1e-3 of an update), so more masters
        straddle a boundary: ~5e-4 by that estimate, within the bound. The
        update's own accuracy is the fp32 variant's to check: a parameter
        comparison barely sees a 10% learning-rate error.
  fp16params  bf16params with float16 parameters and dynamic loss scaling:
        torch.amp.GradScaler's scaler.step(opt) / scaler.update() on the
        canzona side (the daemon undoes the scale and reports the skip,
        canzona/_torch_amp.py); the torch side's masters step with the
        same gradients times 1 / scale. At step 3 the canzona side's loss
        is multiplied by inf: that step must be skipped (no update, the
        torch side skips it too) and the scale halved; the daemon's
        gradient norm is the unscaled gradients' (1e-4). Odd steps go
        through a wrapper of *args, **kwargs, as Accelerate's fp16 puts
        step(): torch >= 2.0's attribute protocol (found_inf set, no
        grad_scaler=), even steps get grad_scaler=. Tolerance 2e-3 as
        for bf16params: a float16 ulp is 8x smaller, so ~8x more elements
        straddle a rounding boundary, each off by an 8x smaller ulp.
        Needs a GPU (torch on the CPU has no float16 matmuls before 2.x).
  fp32overlap  fp32 with module=model: backward reports each bucket as
        its gradients are complete (on torch >= 2.1 through
        register_post_accumulate_grad_hook, before through hooks on the
        AccumulateGrad nodes), step() returns before the parameters are
        written and forward waits per bucket. The results are bitwise the
        plain step's, so fp32's tolerances hold; the overlap must have
        started (the first step learns the loop, then GradReady calls).
  Vector parameters (AdamW) on identical inputs: tolerance 1e-3. Float32
  in another order, and elements with tiny gradients amplify rounding in
  m / sqrt(v) (3e-5 measured over 20 steps on the cpu backend); a missing
  weight decay (1e-2 of the update here) or bias correction (>= 1e-1) is
  still caught.

Settings: torch's defaults on the torch side, passed explicitly to
canzona: Muon lr 1e-3, weight_decay 0.1, momentum 0.95, nesterov, ns_steps
5, coefficients "simple" (3.4445, -4.7750, 2.0315), eps 1e-7, scale
"spectral" (= torch's adjust_lr_fn None/"original": sqrt(max(1, A/B)));
AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.

Reports both optimizers' step time (median over steps 2..N, device
synchronized). Writes {status: passed|failed|skipped, reason, torch, device,
settings, tolerances, variants: [...]} to --out; exit status 1 if failed.
"""

import argparse
import copy
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON = {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
        "ns_steps": 5, "eps": 1e-7}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
TOLERANCES = {"fp32": {"matrix": 1e-3, "vector": 1e-3},
              "bf16": {"matrix": 6e-2, "vector": 1e-3},
              "bf16params": {"matrix": 2e-3, "vector": 2e-3},
              "fp16params": {"matrix": 2e-3, "vector": 2e-3},
              "fp32overlap": {"matrix": 1e-3, "vector": 1e-3}}
# The daemon's Newton-Schulz precision per variant.
NS_PRECISION = {"fp32": "fp32", "bf16": "bf16", "bf16params": "fp32",
                "fp16params": "fp32", "fp32overlap": "fp32"}
# The variant whose optimizer hooks the model (module=).
OVERLAP = "fp32overlap"
# The trainer's parameter dtype of the mixed-precision variants.
HALF_PARAMS = {"bf16params": "bfloat16", "fp16params": "float16"}
# fp16params: the step whose loss overflows on the canzona side.
OVERFLOW_STEP = 3
HEAD_NAMES = ("embed", "lm_head")


def route(name, param):
    """2-D hidden matrices -> Muon; embeddings, the head, 1-D -> AdamW."""
    if param.dim() == 2 and not any(h in name for h in HEAD_NAMES):
        return "muon"
    return "adamw"


def newton_schulz(torch, grad, ns_coefficients, ns_steps, eps, dtype):
    """torch.optim.Muon's iteration (torch/optim/_muon.py) in `dtype`."""
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def builtin_muon(torch):
    """torch.optim.Muon's algorithm for torch < 2.9 (self-tests only)."""

    class Muon(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95,
                     nesterov=True, eps=1e-7, ns_steps=5):
            super().__init__(params, dict(lr=lr, weight_decay=weight_decay,
                                          momentum=momentum, nesterov=nesterov,
                                          eps=eps, ns_steps=ns_steps))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                mu = group["momentum"]
                for p in group["params"]:
                    buf = self.state[p].setdefault(
                        "momentum_buffer", torch.zeros_like(p.grad))
                    buf.lerp_(p.grad, 1 - mu)
                    update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                    update = newton_schulz(torch, update, COEFFICIENTS,
                                           group["ns_steps"], group["eps"],
                                           torch.float32)
                    rows, cols = p.shape
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-group["lr"] *
                           math.sqrt(max(1.0, rows / cols)))

    return Muon


def make_model(torch, vocab=512, dim=256, heads=4, ffn=1024, layers=2,
               seq=64):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, ffn)
            self.fc2 = nn.Linear(ffn, dim)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
            q, k, v = (z.view(b, t, heads, dim // heads).transpose(1, 2)
                       for z in (q, k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(dim // heads)
            mask = torch.ones(t, t, dtype=torch.bool,
                              device=x.device).triu(1)
            attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
            y = (attn @ v).transpose(1, 2).reshape(b, t, dim)
            x = x + self.proj(y)
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(
                self.norm2(x))))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.pos_embed = nn.Parameter(0.02 * torch.randn(seq, dim))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)
            # One element: in bf16 every tensor packed after it starts 2
            # bytes past a 4-byte boundary (CUDA IPC offsets the daemon
            # must take), as a scalar gain or an odd-sized bias does.
            self.logit_scale = nn.Parameter(torch.ones(1))

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos_embed[:tokens.size(1)]
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.norm(x)) * self.logit_scale

    return Decoder(), vocab, seq


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def await_params_written(opt, timeout_s, error):
    """Waits on the host, at most ``timeout_s``, for the daemon's
    parameters-written events of the last step (``--comm nccl``): a daemon
    that died after answering leaves them pending, and the caller's
    ``torch.cuda.synchronize()`` would wait for good (past SIGTERM).
    Raises ``error`` (canzona.CanzonaError) with code UNAVAILABLE."""
    deadline = time.monotonic() + timeout_s
    for event in getattr(opt, "_params_written", []):
        while not event.query():
            if time.monotonic() > deadline:
                raise error(
                    "the daemon's parameters-written event did not "
                    "complete in %g s (daemon lost?)" % timeout_s,
                    "UNAVAILABLE")
            time.sleep(0)


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def run_variant(torch, canzona_torch, args, variant, muon_cls):
    device = torch.device(args.device)
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    model, vocab, seq = make_model(torch)
    model = model.to(device)
    # bf16params / fp16params: canzona trains half-precision parameters;
    # the torch side steps fp32 masters of them (exactly the half values at
    # the start).
    half_params = variant in HALF_PARAMS
    if half_params:
        model = model.to(getattr(torch, HALF_PARAMS[variant]))
    scaler = make_scaler(torch, device) if variant == "fp16params" else None
    # Steps the daemon skipped, and those whose unscaled gradients were
    # not finite (the made overflow, and any at GradScaler's 2**16 start).
    skipped, nonfinite_steps, scales, norm_errs = [], [], [], []
    mirror = copy.deepcopy(model)
    if half_params:
        mirror = mirror.float()
    names = [n for n, _ in model.named_parameters()]
    groups = {n: route(n, p) for n, p in model.named_parameters()}

    opt = canzona_torch.Muon(
        model.named_parameters(), lr=MUON["lr"], momentum=MUON["momentum"],
        nesterov=MUON["nesterov"], ns_steps=MUON["ns_steps"],
        weight_decay=MUON["weight_decay"], adamw_lr=ADAMW["lr"],
        adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
        adamw_weight_decay=ADAMW["weight_decay"], route=route,
        muon_settings={"ns_coefficients": "simple", "scale": "spectral",
                       "eps": MUON["eps"],
                       "ns_precision": NS_PRECISION[variant]},
        target=args.target, module=model if variant == OVERLAP else None,
        job_id="torch-check-%s-%d-%d" % (variant, os.getpid(), seed % 10000))
    # Registered from here on: whatever fails below, close() deregisters.
    try:
        # The buckets backward reported (fp32overlap: the overlap ran).
        reported = [0]
        grad_ready = opt.client.grad_ready

        def counted_grad_ready(*a, **k):
            reported[0] += 1
            return grad_ready(*a, **k)
        opt.client.grad_ready = counted_grad_ready
        mirror_params = dict(mirror.named_parameters())
        params = dict(model.named_parameters())
        torch_muon = muon_cls(
            [mirror_params[n] for n in names if groups[n] == "muon"])
        torch_adamw = torch.optim.AdamW(
            [mirror_params[n] for n in names if groups[n] == "adamw"])
        tol = TOLERANCES[variant]
        worst = {"muon": (0.0, ""), "adamw": (0.0, "")}
        losses, ours_ms, torch_ms = [], [], []
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        # One batch, every step: the loss must visibly fall in a few steps.
        tokens = torch.randint(0, vocab, (8, seq + 1),
                               generator=generator).to(device)
        for step in range(1, args.steps + 1):
            with torch.no_grad():
                for n in names:
                    if not half_params:  # lockstep
                        mirror_params[n].copy_(params[n])
            before = {n: params[n].detach().clone() for n in names}
            with torch.autocast(device_type=device.type,
                                dtype=torch.bfloat16,
                                enabled=variant == "bf16"):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            overflow = False
            if scaler is None:
                loss.backward()
            else:
                scale = scaler.get_scale()
                scales.append(scale)
                scaled = scaler.scale(loss)
                if step == OVERFLOW_STEP:
                    scaled = scaled * float("inf")
                scaled.backward()
            losses.append(loss.item())
            for n in names:
                mirror_params[n].grad = params[n].grad.detach().to(
                    mirror_params[n].dtype, copy=True)
                if scaler is not None:
                    mirror_params[n].grad.mul_(1.0 / scale)
            if scaler is not None:
                # The reference skips by its own check, as GradScaler does.
                overflow = not all(
                    bool(torch.isfinite(mirror_params[n].grad).all())
                    for n in names)
                if overflow:
                    nonfinite_steps.append(step)

            sync(torch, device)
            t0 = time.perf_counter()
            if scaler is None:
                opt.step()
            else:
                if step % 2:
                    # Hugging Face Accelerate's fp16 wrapper (*args,
                    # **kwargs): torch >= 2.0's GradScaler then sets
                    # opt.found_inf instead of passing grad_scaler=.
                    original = opt.step
                    opt.step = lambda *a, **k: original(*a, **k)
                    try:
                        scaler.step(opt)
                    finally:
                        opt.step = original
                else:
                    scaler.step(opt)
                scaler.update()
                if opt.last_step["skipped_nonfinite"]:
                    skipped.append(step)
                else:
                    # Muon and AdamW hardly see a gradient's size (an
                    # unscaled step looks alike); the daemon's norm does.
                    want = math.sqrt(sum(
                        float(mirror_params[n].grad.double().norm()) ** 2
                        for n in names))
                    norm_errs.append(
                        abs(opt.last_step["grad_norm"] - want) / want)
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            await_params_written(opt, args.event_timeout,
                                 canzona_torch.CanzonaError)
            sync(torch, device)
            ours_ms.append(1e3 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            if not overflow:
                torch_muon.step()
                torch_adamw.step()
            sync(torch, device)
            torch_ms.append(1e3 * (time.perf_counter() - t0))
            opt.zero_grad()
            torch_muon.zero_grad()
            torch_adamw.zero_grad()

            with torch.no_grad():
                for n in names:
                    if half_params:
                        # The parameters against the masters, rounded.
                        ours = params[n].double()
                        ref = mirror_params[n].to(params[n].dtype).double()
                    else:
                        ours = (params[n] - before[n]).double()
                        ref = (mirror_params[n] - before[n]).double()
                    if not bool(torch.isfinite(ours).all()):
                        raise RuntimeError("step %d: %s: non-finite update"
                                           % (step, n))
                    err = float((ours - ref).norm() / ref.norm().clamp(
                        min=1e-30))
                    if err > worst[groups[n]][0]:
                        worst[groups[n]] = (err, "%s at step %d" % (n, step))
        # The parameters pickle while the optimizer holds them (torch >=
        # 2.0 pickles a Parameter's __dict__, where canzona.torch keeps a
        # reference to its optimizer): torch.save(model), or a model
        # handed to a spawned process.
        saved = io.BytesIO()
        torch.save([params[n] for n in names], saved)
        saved.seek(0)
        loaded = torch.load(saved, map_location=device, weights_only=False)
        if not all(torch.equal(a, params[n]) for a, n in zip(loaded, names)):
            raise RuntimeError("the parameters torch.save wrote load as "
                               "other values")
    finally:
        opt.close()
    # bf16params compares the parameters with the rounded masters.
    compared = "parameters" if half_params else "update"
    matrix_err, matrix_where = worst["muon"]
    vector_err, vector_where = worst["adamw"]
    problems = []
    if matrix_err > tol["matrix"]:
        problems.append("matrix %s off by %.3g (%s) > %g" %
                        (compared, matrix_err, matrix_where, tol["matrix"]))
    if vector_err > tol["vector"]:
        problems.append("vector %s off by %.3g (%s) > %g" %
                        (compared, vector_err, vector_where, tol["vector"]))
    if not losses[-1] < losses[0]:
        problems.append("loss did not fall: %.4f -> %.4f" %
                        (losses[0], losses[-1]))
    if variant == OVERLAP and not reported[0]:
        problems.append("module=: backward reported no bucket (the overlap "
                        "never started)")
    if scaler is not None:
        if skipped != nonfinite_steps:
            problems.append("skipped steps %s, not %s (those with non-finite "
                            "gradients)" % (skipped, nonfinite_steps))
        if args.steps >= OVERFLOW_STEP and OVERFLOW_STEP not in skipped:
            problems.append("the overflow made at step %d was not skipped"
                            % OVERFLOW_STEP)
        if (len(scales) > OVERFLOW_STEP and
                scales[OVERFLOW_STEP] != scales[OVERFLOW_STEP - 1] / 2):
            problems.append("the scale went %g -> %g at the overflow, not "
                            "halved" % (scales[OVERFLOW_STEP - 1],
                                        scales[OVERFLOW_STEP]))
        # The norm of fp32 sums in two orders.
        if norm_errs and max(norm_errs) > 1e-4:
            problems.append("the daemon's gradient norm is off the "
                            "unscaled one by %.3g" % max(norm_errs))
    return {
        "name": variant, "steps": args.steps, "seed": seed,
        "status": "failed" if problems else "passed",
        "reason": "; ".join(problems),
        "matrix_params": sum(1 for n in names if groups[n] == "muon"),
        "vector_params": sum(1 for n in names if groups[n] == "adamw"),
        "matrix_max_rel_err": matrix_err, "matrix_worst": matrix_where,
        "matrix_tolerance": tol["matrix"],
        "vector_max_rel_err": vector_err, "vector_worst": vector_where,
        "vector_tolerance": tol["vector"],
        "loss_first": losses[0], "loss_last": losses[-1],
        "canzona_step_ms": median(ours_ms[1:]),
        "torch_step_ms": median(torch_ms[1:]),
        "skipped_steps": skipped, "loss_scales": scales,
        "grad_norm_max_rel_err": max(norm_errs) if norm_errs else None,
        "buckets_reported": reported[0],
    }


def make_scaler(torch, device):
    """torch.amp.GradScaler on `device` (torch >= 2.3), else torch 1.x's
    CUDA scaler."""
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, init_scale=2.0 ** 16)
    return torch.cuda.amp.GradScaler(init_scale=2.0 ** 16)


class Float32MuonNs:
    """Runs torch.optim.Muon's Newton-Schulz in float32 while active."""

    def __init__(self, torch):
        self.torch = torch
        from torch.optim import _muon
        self.module = _muon
        self.original = _muon._zeropower_via_newtonschulz

    def __enter__(self):
        torch = self.torch

        def fp32(grad, ns_coefficients, ns_steps, eps, *unused, **unused_kw):
            return newton_schulz(torch, grad, ns_coefficients, ns_steps, eps,
                                 torch.float32)
        self.module._zeropower_via_newtonschulz = fp32
        return self

    def __exit__(self, *exc):
        self.module._zeropower_via_newtonschulz = self.original


def start_daemon(args, workdir, extra_args=()):
    """args.canzonad --backend args.backend [extra_args] on a private
    socket in workdir; (process, target) once it is ready."""
    socket = os.path.join(workdir, "canzonad.sock")
    ready = os.path.join(workdir, "ready")
    log = open(os.path.join(workdir, "canzonad.log"), "w")
    proc = subprocess.Popen(
        [args.canzonad, "--unix-socket", socket, "--ready-file", ready,
         "--metrics-address", "", "--backend", args.backend] +
        list(extra_args),
        stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(ready) and os.path.getsize(ready) > 0:
            return proc, "unix:" + socket
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("canzonad did not start; see %s" % log.name)


def fmt(value, pattern="%.2f"):
    return "-" if value is None else pattern % value


def failed_variant(variant, args, reason):
    """The row of a variant that raised (every key the report reads)."""
    tolerances = TOLERANCES.get(variant, {})
    return {"name": variant, "steps": args.steps, "status": "failed",
            "reason": reason, "matrix_max_rel_err": None,
            "matrix_tolerance": tolerances.get("matrix"),
            "vector_max_rel_err": None,
            "vector_tolerance": tolerances.get("vector"),
            "loss_first": None, "loss_last": None,
            "canzona_step_ms": None, "torch_step_ms": None}


def write(args, result):
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)


def run(args, result):
    try:
        import torch
        import canzona.torch as canzona_torch
    except Exception as e:
        result.update(status="skipped", reason="import failed: %s" % e)
        return
    result["torch"] = torch.__version__
    if args.device == "cuda" and not torch.cuda.is_available():
        result.update(status="skipped", reason="torch sees no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result["device"] = (torch.cuda.get_device_name(0)
                        if args.device == "cuda" else "cpu")
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        if not args.allow_builtin_muon:
            result.update(status="skipped", reason=(
                "torch %s has no torch.optim.Muon (>= 2.9)" % torch.__version__))
            return
        muon_cls = builtin_muon(torch)
        result["reference"] = "built-in copy of torch.optim.Muon's algorithm"
    else:
        result["reference"] = "torch.optim.Muon + torch.optim.AdamW"
    for variant in args.variants.split(","):
        # A variant that raises is one failed row: the others still run,
        # and the JSON is rewritten after each (a run the runner's limit
        # cuts keeps the variants before it).
        try:
            if (NS_PRECISION[variant] == "fp32" and
                    getattr(torch.optim, "Muon", None)):
                with Float32MuonNs(torch):
                    outcome = run_variant(torch, canzona_torch, args, variant,
                                          muon_cls)
            else:
                outcome = run_variant(torch, canzona_torch, args, variant,
                                      muon_cls)
        except Exception as e:  # noqa: BLE001  recorded per variant
            traceback.print_exc()
            outcome = failed_variant(variant, args, "%s: %s" % (
                type(e).__name__, str(e).strip().split("\n")[0][:300]))
        result["variants"].append(outcome)
        write(args, result)
        print("%s: %s; matrices %s (tol %s), vectors %s (tol %s); loss "
              "%s -> %s; step ms canzona %s, torch %s %s" % (
                  variant, outcome["status"],
                  fmt(outcome["matrix_max_rel_err"], "%.3g"),
                  fmt(outcome["matrix_tolerance"], "%g"),
                  fmt(outcome["vector_max_rel_err"], "%.3g"),
                  fmt(outcome["vector_tolerance"], "%g"),
                  fmt(outcome["loss_first"], "%.4f"),
                  fmt(outcome["loss_last"], "%.4f"),
                  fmt(outcome["canzona_step_ms"]),
                  fmt(outcome["torch_step_ms"]), outcome["reason"]),
              flush=True)
    failed = [v for v in result["variants"] if v["status"] != "passed"]
    result.update(status="failed" if failed else "passed",
                  reason="; ".join("%s: %s" % (v["name"], v["reason"])
                                   for v in failed))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="the daemon (default: start "
                        "--canzonad on a private socket)")
    parser.add_argument("--canzonad", help="canzonad to start")
    parser.add_argument("--backend", default="cpu",
                        help="backend of the started canzonad")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--variants",
                        default="fp32,bf16,bf16params,fp16params,"
                        "fp32overlap")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--event-timeout", type=float, default=30,
                        help="seconds a step's parameters-written events "
                        "may take (then the daemon counts as lost)")
    parser.add_argument("--allow-builtin-muon", action="store_true",
                        help="without torch.optim.Muon, compare with a copy "
                        "of its algorithm (self-tests on old torch)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-exit-code", type=int, default=0,
                        help="exit status when skipped (ctest: 77)")
    args = parser.parse_args()
    if not args.target and not args.canzonad:
        parser.error("--target or --canzonad")
    result = {"status": "failed", "reason": "", "variants": [],
              "settings": {"muon": MUON, "muon_daemon_extra": {
                  "ns_coefficients": "simple", "scale": "spectral",
                  "ns_precision": NS_PRECISION}, "adamw": ADAMW,
                  "lockstep": "torch takes canzona's parameters and "
                              "gradients before every step (bf16params: "
                              "the gradients only; its fp32 masters are "
                              "its own)"},
              "tolerances": TOLERANCES}
    daemon = None
    with tempfile.TemporaryDirectory(prefix="canzona-torch-check.") as tmp:
        try:
            if not args.target:
                daemon, args.target = start_daemon(args, tmp)
            run(args, result)
        except Exception as e:
            traceback.print_exc()
            result.update(status="failed",
                          reason="%s: %s" % (type(e).__name__, e))
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(timeout=30)
    write(args, result)
    print("torch_check: %s %s" % (result["status"], result["reason"]))
    if result["status"] == "skipped":
        return args.skip_exit_code
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
