#!/usr/bin/env python3
"""The GPU bundle's step benchmark: canzona.torch's opt.step() against
torch.optim.Muon (2-D hidden matrices) + torch.optim.AdamW (embeddings,
lm_head, norms) on the same device and the same model, at three sizes and
two model dtypes, one side after the other (issue 30).

    torch_step_bench.py --target unix:/run/canzona.sock --device cuda \\
        --out bench.json                        # against a cuda/nccl daemon
    torch_step_bench.py --canzonad build/server/canzonad --backend cpu \\
        --device cpu --sizes 100m --tiny --allow-builtin-muon \\
        --out bench.json                        # CPU smoke (torch < 2.9)

Models: client/examples/train_torch.py's Qwen3-style decoder (RMSNorm, GQA
attention with q/k norms and RoPE, SwiGLU, untied embeddings) at
  100m  8 layers, hidden 1024, ffn 2560, 16 heads / 8 kv heads of 64,
        vocab 8192 (~105 M parameters)
  0.6b  Qwen3-0.6B's shapes, 8b Qwen3-8B's (hidden, ffn, heads, kv heads,
        head dim, vocab, layers from the plan's model configs
        qwen3-0.6b.json / qwen3-8b.json; embeddings untied in both)
--layers overrides every size's layer count, --tiny every size's widths
(the example's own tiny Config) for smoke runs.

Dtypes (fp32 master weights on both sides):
  fp32  the model in float32; both optimizers update it in place.
  bf16  the model in bfloat16. torch: fp32 master copies of every
        parameter that the optimizers update; each step casts the bf16
        gradients into the masters' .grad, steps, and copies the masters
        back rounded (as mixed-precision trainers do; all of it timed as
        the step). canzona: the daemon keeps the fp32 masters itself.
Newton-Schulz in bf16 on both sides (torch.optim.Muon always casts to
bf16; the daemon gets ns_precision=bf16, --ns-precision to change it).
Settings are torch's defaults, passed explicitly to canzona (the same as
torch_check.py's: Muon lr 1e-3, weight decay 0.1, momentum 0.95, nesterov,
5 steps, "simple" coefficients, spectral scale; AdamW lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01).

Timing: per side, --warmup + --steps iterations on one fixed batch
(--batch x --seq tokens); each iteration is forward + loss + backward,
opt.step(), zero_grad, the device synchronized before and after the step;
the medians over the timed iterations of the step alone and of the whole
iteration. Ratios are torch's time over canzona's (> 1: canzona faster).

Memory: the torch side runs first, then everything of it is freed (del,
gc, torch.cuda.empty_cache) before canzona's side; a side that runs out of
memory (torch.cuda.OutOfMemoryError, RESOURCE_EXHAUSTED from the daemon)
marks its row skipped with the reason, as does a row whose canzona side
would not fit by estimate (checked before either side runs). Sizes run
small to large, dtypes in --dtypes order (the bundle: fp32 first, whose
torch side needs the least memory at 8B: no bf16 copies beside its
masters). 8b runs one sequence per batch (BATCH; only its step is judged,
which the batch does not change). Time: the deadline is --budget seconds
from the start, or the runner's limit less a margin
($CANZONA_CHECK_LIMIT_S, which the bundle's runner sets), whichever comes
first; a row that would not end by it is skipped, by an estimate from
the last row of its dtype: its timed iterations scaled by the parameters
times the batch, the rest of it (building, registering, freeing) by the
parameters up to 3x; one cut by
SIGTERM anyway is recorded as failed (so is the check: the runner's timeout
fails it), with the rows before it kept. The JSON is rewritten
after every row, so a run killed by the runner's time limit keeps what it
measured.

Writes {status: passed|failed|skipped, reason, torch, device, reference,
settings, rows: [{size, dtype, params, ..., canzona_step_ms,
torch_step_ms, step_ratio, canzona_iteration_ms, torch_iteration_ms,
iteration_ratio, canzona_peak_gib and torch_peak_gib (this process's
peak), canzona_daemon_gib (the daemon's state, masters and buffers),
shapes_overridden, status: measured|skipped|failed, reason}]} to --out;
exit status 1 if failed. Goals (tests/gpu/bundle/README.md) are judged by
the bundle's report tool, not here.
"""

import argparse
import gc
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback

# The runner's clock starts before torch's import (seconds with CUDA's
# wheels): the time budget counts from here.
T0 = time.monotonic()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_check  # noqa: E402  route, settings, start_daemon, Muon copy

# Where train_torch.py and the model configs are: the repository's layout
# first, then the bundle's (checks/ beside examples/ and share/).
EXAMPLE_CANDIDATES = (
    os.path.join(HERE, "..", "..", "client", "examples", "train_torch.py"),
    os.path.join(HERE, "..", "examples", "train_torch.py"))
MODELS_CANDIDATES = (
    os.path.join(HERE, "..", "..", "server", "plan", "models"),
    os.path.join(HERE, "..", "share", "canzona", "models"))

# 100m: hand-picked (no plan config); the others name a plan config.
SIZES = {
    "100m": {"layers": 8, "hidden": 1024, "ffn": 2560, "heads": 16,
             "kv_heads": 8, "head_dim": 64, "vocab": 8192},
    "0.6b": "qwen3-0.6b.json",
    "8b": "qwen3-8b.json",
}


# Sequences per batch where --batch is too many: an 8B model's activations
# and fp32 logits (vocabulary 151936) beside its optimizer state.
BATCH = {"8b": 1}


class Terminated(BaseException):
    """SIGTERM (the runner's timeout): stop, but write what was measured."""


# Set by the handler: a cleanup that raises on the way out (closing the
# optimizer mid-step) must not turn the stop into an ordinary row failure.
STOP = {}


def on_sigterm(signum, frame):
    del signum, frame
    STOP["why"] = "terminated by SIGTERM (time limit?)"
    raise Terminated(STOP["why"])


def load_example():
    for path in EXAMPLE_CANDIDATES:
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("train_torch", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise RuntimeError("train_torch.py not found (looked in %s)" %
                       ", ".join(EXAMPLE_CANDIDATES))


def shape_of(size, args):
    """The size's shape dict: layers, hidden, ffn, heads, kv_heads,
    head_dim, vocab (overrides applied)."""
    spec = SIZES[size]
    if isinstance(spec, str):
        dirs = [args.models_dir] if args.models_dir else MODELS_CANDIDATES
        path = next((os.path.join(d, spec) for d in dirs
                     if os.path.exists(os.path.join(d, spec))), None)
        if path is None:
            raise RuntimeError("%s not found in %s" % (spec, ", ".join(dirs)))
        with open(path) as f:
            config = json.load(f)
        spec = {"layers": config["num_hidden_layers"],
                "hidden": config["hidden_size"],
                "ffn": config["intermediate_size"],
                "heads": config["num_attention_heads"],
                "kv_heads": config["num_key_value_heads"],
                "head_dim": config["head_dim"],
                "vocab": config["vocab_size"]}
    shape = dict(spec)
    if args.tiny:
        shape.update(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16,
                     vocab=256)
    if args.layers:
        shape["layers"] = args.layers
    return shape


def make_config(example, shape, args, size=None):
    batch = min(args.batch, BATCH.get(size, args.batch))
    attrs = dict(shape, seq=args.seq, batch=batch)
    return type("BenchConfig", (example.Config,), attrs)


def build_model(torch, example, config, device, dtype):
    """The example's decoder, created on the device (torch >= 2.0: no
    host copy of an 8B model) and cast to the dtype."""
    if device.type == "cuda" and hasattr(torch.device, "__enter__"):
        with device:
            model = example.build_model(seed=0, config=config)
    else:
        model = example.build_model(seed=0, config=config).to(device)
    return model.to(dtype)


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_out_of_memory(error):
    if getattr(error, "code", "") == "RESOURCE_EXHAUSTED":
        return True
    text = str(error)
    return "out of memory" in text.lower() or "RESOURCE_EXHAUSTED" in text


class TorchSide:
    """torch.optim.Muon + AdamW; a bf16 model steps through fp32 masters."""

    def __init__(self, torch, model, muon_cls):
        self.torch = torch
        params = [p for _, p in model.named_parameters()]
        groups = [torch_check.route(n, p) for n, p in
                  model.named_parameters()]
        self.params = params
        self.mixed = params[0].dtype != torch.float32
        if self.mixed:
            self.masters = [p.detach().float().requires_grad_()
                            for p in params]
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            targets = self.masters
        else:
            targets = params
        self.muon = muon_cls([t for t, g in zip(targets, groups)
                              if g == "muon"])
        self.adamw = torch.optim.AdamW([t for t, g in zip(targets, groups)
                                        if g == "adamw"])

    def _copy(self, dst, src):
        foreach = getattr(self.torch, "_foreach_copy_", None)
        if foreach is not None:
            foreach(dst, src)
        else:
            for d, s in zip(dst, src):
                d.copy_(s)

    def step(self):
        torch = self.torch
        with torch.no_grad():
            if self.mixed:
                self._copy([m.grad for m in self.masters],
                           [p.grad for p in self.params])
            self.muon.step()
            self.adamw.step()
            if self.mixed:
                self._copy(self.params, self.masters)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def close(self):
        pass


class CanzonaSide:
    def __init__(self, canzona_torch, model, args, label):
        muon = torch_check.MUON
        adamw = torch_check.ADAMW
        self.opt = canzona_torch.Muon(
            model.named_parameters(), lr=muon["lr"],
            momentum=muon["momentum"], nesterov=muon["nesterov"],
            ns_steps=muon["ns_steps"], weight_decay=muon["weight_decay"],
            adamw_lr=adamw["lr"], adamw_betas=adamw["betas"],
            adamw_eps=adamw["eps"], adamw_weight_decay=adamw["weight_decay"],
            route=torch_check.route,
            muon_settings={"ns_coefficients": "simple", "scale": "spectral",
                           "eps": muon["eps"],
                           "ns_precision": args.ns_precision},
            target=args.target,
            job_id="torch-step-bench-%s-%d" % (label, os.getpid()))
        self.error = canzona_torch.CanzonaError
        self.timeout = args.event_timeout
        self.stats = []

    def step(self):
        self.opt.step()
        self.opt.synchronize()
        torch_check.await_params_written(self.opt, self.timeout, self.error)
        # Where the daemon's step went: its phases and host round trips.
        self.stats.append(self.opt.last_step)

    def zero_grad(self):
        self.opt.zero_grad()

    def close(self):
        self.opt.close()

    def breakdown(self, steps):
        """The daemon's view of the last `steps` steps: median ms per phase
        and median host_waits, and the pageable copies of all of them
        (StepResponse: 0 unless the driver refused to page-lock)."""
        stats = [s for s in self.stats[-steps:] if s]
        if not stats:
            return {}
        phases = stats[0].get("seconds", {})
        return {"phases_ms": {p: median([1e3 * s["seconds"][p]
                                         for s in stats]) for p in phases},
                "host_waits": median([s.get("host_waits", 0)
                                      for s in stats]),
                "pageable_copies": sum(s.get("pageable_copies", 0)
                                       for s in stats)}


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def time_side(torch, canzona_torch, example, config, args, side, dtype_name,
              muon_cls, label):
    """One side's medians {step_ms, iteration_ms, peak_gib} and the
    model's parameter count; raises on failure (out of memory included)."""
    device = torch.device(args.device)
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    model = optimizer = None
    try:
        model = build_model(torch, example, config, device, dtype)
        if device.type == "cuda":
            # The fp32 build's storage, dropped by the cast, would stay in
            # this process's cache (the daemon could not use it).
            torch.cuda.empty_cache()
        params = sum(p.numel() for p in model.parameters())
        if side == "torch":
            optimizer = TorchSide(torch, model, muon_cls)
        else:
            optimizer = CanzonaSide(canzona_torch, model, args, label)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(1)
        tokens = torch.randint(0, config.vocab, (config.batch, config.seq + 1),
                               generator=generator).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
        step_ms, iteration_ms = [], []
        for i in range(args.warmup + args.steps):
            sync(torch, device)
            t0 = time.perf_counter()
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, config.vocab), targets)
            loss.backward()
            del logits, loss
            sync(torch, device)
            t1 = time.perf_counter()
            optimizer.step()
            sync(torch, device)
            t2 = time.perf_counter()
            optimizer.zero_grad()
            sync(torch, device)
            t3 = time.perf_counter()
            if i >= args.warmup:
                step_ms.append(1e3 * (t2 - t1))
                iteration_ms.append(1e3 * (t3 - t0))
        peak = (torch.cuda.max_memory_allocated(device) / 2**30
                if device.type == "cuda" else None)
        figures = {"step_ms": median(step_ms),
                   "iteration_ms": median(iteration_ms), "peak_gib": peak,
                   "params": params}
        if side == "canzona":
            figures["daemon"] = optimizer.breakdown(args.steps)
            # This process's peak leaves out the daemon's memory (another
            # process): its state, master weights and buffers.
            reg = optimizer.opt.registered
            figures["daemon_gib"] = sum(
                reg.get(k) or 0 for k in ("state_bytes", "master_bytes",
                                          "buffer_bytes")) / 2**30
        return figures
    finally:
        if optimizer is not None:
            optimizer.close()
        del model, optimizer


def await_free_memory(torch, device, want, timeout_s=20.0):
    """The device's (free, total) bytes once `want` are free, or after
    `timeout_s`: the last row's daemon rank stays after its deregistration
    (until the daemon's watcher round, 200 ms, for these single-daemon
    jobs; a daemon before 2026-12-07 kept it 5 s) with its mapping of the
    trainer's buffer and its memory pool, which a large row needs back
    before it builds its model."""
    give_up = time.monotonic() + timeout_s
    free, total = torch.cuda.mem_get_info(device)
    while free < want and time.monotonic() < give_up:
        time.sleep(0.2)
        free, total = torch.cuda.mem_get_info(device)
    return free, total


def free_memory(torch, device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def ratio(a, b):
    return a / b if a and b else None


def deadline(args):
    """When the last row must end: --budget from the start, or the
    runner's limit less a margin for writing and cleaning up."""
    limit = float(os.environ.get("CANZONA_CHECK_LIMIT_S", "inf")) - 20
    return T0 + min(float(args.budget), limit)


def canzona_side_bytes(row, dtype_name):
    """A lower estimate of the canzona side's device memory: the
    trainer's buffer (parameters and gradients) and the daemon's fp32
    owned gradients, masters (bf16), Muon momentum and AdamW moments."""
    params, matrices = row["params"], row["matrix_params"]
    unit = 4 if dtype_name == "fp32" else 2
    daemon = 4 * params + 4 * matrices + 8 * (params - matrices)
    if dtype_name != "fp32":
        daemon += 4 * params
    return 2 * unit * params + daemon


def run_row(torch, canzona_torch, example, args, size, dtype_name, muon_cls,
            started, state):
    device = torch.device(args.device)
    row = {"size": size, "dtype": dtype_name, "status": "skipped",
           "reason": "", "params": None, "matrix_params": None,
           "canzona_step_ms": None, "torch_step_ms": None,
           "step_ratio": None, "canzona_iteration_ms": None,
           "torch_iteration_ms": None, "iteration_ratio": None,
           "canzona_peak_gib": None, "torch_peak_gib": None,
           "canzona_daemon_gib": None}
    shape = shape_of(size, args)
    config = make_config(example, shape, args, size)
    row["shape"] = shape
    row["batch"] = config.batch
    # A smoke run's shapes are not the size's: no goal is judged on them.
    row["shapes_overridden"] = bool(args.tiny or args.layers)
    # The parameter count without building the model (the example's
    # Decoder: embeddings, lm_head, final norm, per layer 4 attention and
    # 3 MLP matrices and 4 norms).
    h, f, d = shape["hidden"], shape["ffn"], shape["head_dim"]
    attention = h * d * (2 * shape["heads"] + 2 * shape["kv_heads"])
    matrices = shape["layers"] * (attention + 3 * h * f)
    row["matrix_params"] = matrices
    row["params"] = (matrices + 2 * shape["vocab"] * h + h +
                     shape["layers"] * (2 * h + 2 * d))
    now = time.monotonic()
    if state.get("daemon_lost"):
        row.update(status="failed", reason="not run: the daemon was lost "
                   "earlier (%s)" % state["daemon_lost"])
        return row
    # From the last row of this dtype, else the last row (the first row:
    # free): its timed iterations grow with the parameters times the batch,
    # its building and registering less than the parameters.
    last = state.get("last_" + dtype_name) or state.get("last")
    estimate = 0.0
    if last:
        params, batch, total_s, iterations_s = last
        scale = row["params"] / params
        estimate = (iterations_s * scale * config.batch / batch +
                    (total_s - iterations_s) * min(scale, 3.0))
    if now + estimate >= deadline(args):
        row["reason"] = ("time: %.0f s left, the row needs ~%.0f s" % (
            max(0.0, deadline(args) - now), estimate))
        return row
    if device.type == "cuda":
        need = canzona_side_bytes(row, dtype_name)
        free, total = torch.cuda.mem_get_info(device)
        if need <= 0.97 * total:
            free, total = await_free_memory(torch, device, need / 0.97)
        if need > 0.97 * free:
            row["reason"] = ("out of memory by estimate: the canzona side "
                             "needs >= %.1f GiB of the device's %.1f GiB "
                             "(%.1f GiB free)" % (need / 2**30, total / 2**30,
                                                  free / 2**30))
            return row
    problems, skips = [], []
    for side in ("torch", "canzona"):
        failure = None
        try:
            figures = time_side(torch, canzona_torch, example, config, args,
                                side, dtype_name, muon_cls,
                                # Job ids take no dots (shm names).
                                "%s-%s" % (size.replace(".", "p"),
                                           dtype_name))
        except Exception as e:  # noqa: BLE001  recorded per row
            failure = (is_out_of_memory(e), "%s side: %s: %s" % (
                side, type(e).__name__, str(e).strip().split("\n")[0][:300]))
            if getattr(e, "code", "") == "UNAVAILABLE":
                state["daemon_lost"] = failure[1]
            if not failure[0]:
                traceback.print_exc()
        if STOP:
            raise Terminated(STOP["why"])
        # The exception and its frames (and their tensors) are gone here.
        free_memory(torch, device)
        if failure is not None:
            (skips if failure[0] else problems).append(failure[1])
            continue
        row["%s_step_ms" % side] = figures["step_ms"]
        row["%s_iteration_ms" % side] = figures["iteration_ms"]
        row["%s_peak_gib" % side] = figures["peak_gib"]
        row["params"] = figures["params"]
        if "daemon" in figures:
            row["canzona_daemon"] = figures["daemon"]
            row["canzona_daemon_gib"] = figures["daemon_gib"]
    iterations_s = (args.warmup + args.steps) * sum(
        row["%s_iteration_ms" % side] or 0.0
        for side in ("torch", "canzona")) / 1e3
    total_s = time.monotonic() - now
    state["last"] = state["last_" + dtype_name] = (
        row["params"], config.batch, total_s, min(iterations_s, total_s))
    row["step_ratio"] = ratio(row["torch_step_ms"], row["canzona_step_ms"])
    row["iteration_ratio"] = ratio(row["torch_iteration_ms"],
                                   row["canzona_iteration_ms"])
    if problems:
        row.update(status="failed", reason="; ".join(problems + skips))
    elif skips:
        row.update(status="skipped",
                   reason="out of memory: " + "; ".join(skips))
    else:
        row["status"] = "measured"
    return row


def fmt(value, pattern="%.2f"):
    return "-" if value is None else pattern % value


def write(args, result):
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)


def run(args, result):
    try:
        import torch
        import canzona.torch as canzona_torch
        example = load_example()
    except Exception as e:  # noqa: BLE001
        result.update(status="skipped", reason="import failed: %s" % e)
        return
    result["torch"] = torch.__version__
    if args.device == "cuda" and not torch.cuda.is_available():
        result.update(status="skipped", reason="torch sees no CUDA device")
        return
    result["device"] = (torch.cuda.get_device_name(0)
                        if args.device == "cuda" else "cpu")
    # torch's defaults, left as they are (both sides' forward and backward).
    result["settings"]["tf32_matmul"] = bool(
        torch.backends.cuda.matmul.allow_tf32)
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        if not args.allow_builtin_muon:
            result.update(status="skipped", reason=(
                "torch %s has no torch.optim.Muon (>= 2.9)" %
                torch.__version__))
            return
        muon_cls = torch_check.builtin_muon(torch)
        result["reference"] = ("built-in copy of torch.optim.Muon's "
                               "algorithm + torch.optim.AdamW")
    else:
        result["reference"] = "torch.optim.Muon + torch.optim.AdamW"
    started = T0
    # daemon_lost: why, once a call found no daemon; last: (parameters,
    # seconds) of the last row run.
    state = {}
    sizes = [s for s in args.sizes.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    total = len(sizes) * len(dtypes)
    for size in sizes:
        for dtype_name in dtypes:
            try:
                row = run_row(torch, canzona_torch, example, args, size,
                              dtype_name, muon_cls, started, state)
            except Terminated as e:
                # The runner's limit cut this row (the check fails: the
                # runner's timeout says so too); the rows before it stand.
                result["rows"].append({
                    "size": size, "dtype": dtype_name, "status": "failed",
                    "reason": "cut by the check's time limit (%s)" % e})
                write(args, result)
                raise
            result["rows"].append(row)
            result["reason"] = "stopped after %d of %d rows" % (
                len(result["rows"]), total)
            write(args, result)
            print("%s %s: %s, %s params; step ms canzona %s, torch %s "
                  "(x%s); iteration ms canzona %s, torch %s (x%s) %s" % (
                      size, dtype_name, row["status"],
                      fmt(row["params"], "%d"),
                      fmt(row["canzona_step_ms"]), fmt(row["torch_step_ms"]),
                      fmt(row["step_ratio"]),
                      fmt(row["canzona_iteration_ms"]),
                      fmt(row["torch_iteration_ms"]),
                      fmt(row["iteration_ratio"]), row["reason"]),
                  flush=True)
    conclude(result)


def conclude(result):
    """The run's status from its rows: failed if one failed, skipped if
    none was measured, else passed; the reason lists what was not."""
    rows = result["rows"]
    failed = [r for r in rows if r["status"] == "failed"]
    skipped = [r for r in rows if r["status"] == "skipped"]
    notes = ["%s %s: %s" % (r["size"], r["dtype"], r["reason"])
             for r in failed + skipped]
    if failed:
        status = "failed"
    elif len(skipped) == len(rows):
        status = "skipped"
    else:
        status = "passed"
    result.update(status=status, reason="; ".join(notes))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="the daemon (default: start "
                        "--canzonad on a private socket)")
    parser.add_argument("--canzonad", help="canzonad to start")
    parser.add_argument("--backend", default="cuda",
                        help="backend of the started canzonad")
    parser.add_argument("--comm", default="nccl",
                        help="data plane of the started canzonad (with "
                        "--target: the one the daemon was started with, "
                        "recorded in the settings)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", default="100m,0.6b,8b",
                        help="comma-separated, of %s" % ", ".join(SIZES))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed iterations per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=0,
                        help="override every size's layer count")
    parser.add_argument("--tiny", action="store_true",
                        help="every size with the example's tiny widths "
                        "(smoke runs)")
    parser.add_argument("--ns-precision", default="bf16",
                        choices=("bf16", "fp32"),
                        help="the daemon's Newton-Schulz precision")
    parser.add_argument("--models-dir", help="where qwen3-*.json are")
    parser.add_argument("--event-timeout", type=float, default=30,
                        help="seconds to wait for the daemon's "
                        "parameters-written events after a step")
    parser.add_argument("--budget", type=int, default=150,
                        help="seconds from the start by which every row "
                        "must end (by estimate)")
    parser.add_argument("--allow-builtin-muon", action="store_true",
                        help="without torch.optim.Muon, time a copy of its "
                        "algorithm (self-tests on old torch)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-exit-code", type=int, default=0,
                        help="exit status when skipped (ctest: 77)")
    args = parser.parse_args()
    if not args.target and not args.canzonad:
        parser.error("--target or --canzonad")
    unknown = [s for s in args.sizes.split(",") if s and s not in SIZES]
    if unknown:
        parser.error("--sizes: unknown %s" % ", ".join(unknown))
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps >= 1, --warmup >= 0")
    signal.signal(signal.SIGTERM, on_sigterm)
    result = {"status": "failed", "reason": "", "rows": [],
              "settings": {"muon": torch_check.MUON, "muon_daemon_extra": {
                  "ns_coefficients": "simple", "scale": "spectral",
                  "ns_precision": args.ns_precision}, "adamw":
                  torch_check.ADAMW, "batch": args.batch, "seq": args.seq,
                  "warmup": args.warmup, "steps": args.steps,
                  "comm": args.comm,
                  "bf16_torch": "fp32 master copies, grads cast in and "
                                "parameters copied back inside the step",
                  "order": "torch side, then canzona side, memory freed "
                           "between"}}
    daemon = None
    with tempfile.TemporaryDirectory(prefix="canzona-step-bench.") as tmp:
        try:
            if not args.target:
                daemon, args.target = torch_check.start_daemon(
                    args, tmp, ["--comm", args.comm])
            run(args, result)
        except Terminated:
            # The cut row is recorded as failed; the measured rows stand.
            conclude(result)
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            reason = "%s: %s" % (type(e).__name__, e)
            if result["reason"]:  # "stopped after N of M rows"
                reason += " (%s)" % result["reason"]
            result.update(status="failed", reason=reason)
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(timeout=30)
    write(args, result)
    print("torch_step_bench: %s %s" % (result["status"], result["reason"]))
    if result["status"] == "skipped":
        return args.skip_exit_code
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
