#!/usr/bin/python3
"""Canzona against what users run instead, side by side in one run.

The same Qwen3-style decoder (client/examples/train_torch.py, a size flag),
the same seeded data and the same number of data-parallel ranks (processes
on Gloo here; NCCL on GPUs with --device cuda) under:

  ddp_replicated   DDP (gradient all-reduce overlapped with backward) and
                   every rank runs Muon on every matrix (AdamW for the rest)
  ddp_roundrobin   DDP and Keller Jordan's distributed Muon: matrices sorted
                   by size and dealt round-robin, each rank orthogonalizes
                   its share, the updates are all-gathered
  canzona          canzona.torch (strategy cost): the daemon reduce-scatters,
                   updates what each rank owns, all-gathers
  canzona_overlap  the same with the overlap hooks (module=model)

With --optimizer shampoo or soap: ddp_replicated (the float64 references of
tests/python/canzona_reference.py on every rank; slow, a small model) against
canzona. Per mode: the median over steps of the slowest rank's iteration,
optimizer step (its collectives included) and exposed communication
(DDP: backward minus the same backward without the all-reduce; round-robin:
plus its all-gathers; canzona: what the trainer waited for in Step and
WaitParams), peak memory per rank (trainer RSS, and for canzona the daemon's
private memory per rank), and the final loss (the same optimizer: equal
within float tolerance).

    tests/bench/torch_peers.py --canzonad build/server/canzonad \\
        --world 2 --size medium --steps 20 [--json out.json]

A benchmark, not a test: it asserts nothing but that every mode ran.
Standard library + torch + the canzona package (PYTHONPATH=client/python).
"""

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

MODES = ("ddp_replicated", "ddp_roundrobin", "canzona", "canzona_overlap")
SIZES = {
    # hidden, layers, heads, kv heads, head dim, ffn, vocab, seq, batch
    "small": (64, 2, 4, 2, 16, 128, 256, 32, 8),
    "medium": (256, 4, 8, 4, 32, 768, 1024, 64, 8),
    "large": (512, 8, 8, 4, 64, 1536, 2048, 64, 8),
}
LR, ADAMW_LR, ADAMW_WD, MOMENTUM = 0.02, 3e-3, 0.01, 0.95


def model_config(size):
    import train_torch

    hidden, layers, heads, kv, hd, ffn, vocab, seq, batch = SIZES[size]

    class C(train_torch.Config):
        pass

    C.hidden, C.layers, C.heads, C.kv_heads, C.head_dim = (hidden, layers,
                                                          heads, kv, hd)
    C.ffn, C.vocab, C.seq, C.batch = ffn, vocab, seq, batch
    return C


# ---------------------------------------------------------------------------
# The peers' optimizers (torch.optim.Muon where torch has it, >= 2.9).

def newton_schulz(g, steps=5, eps=1e-7):
    """Muon's quintic Newton-Schulz (torch.optim.Muon / Keller Jordan)."""
    import torch
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / (x.norm() + eps)
    for _ in range(steps):
        m = x @ x.t()
        x = a * x + (b * m + c * m @ m) @ x
    x = x.t() if transposed else x
    return x.contiguous().to(g.dtype) if x.dtype != g.dtype else x.contiguous()


class Muon:
    """torch.optim.Muon semantics: lerp momentum, Nesterov, 5 Newton-Schulz
    steps, lr * sqrt(max(1, rows / cols)), no weight decay. update() gives a
    parameter's update direction; apply() moves it."""

    def __init__(self, params):
        import torch
        self.params = list(params)
        self.buf = {id(p): torch.zeros_like(p) for p in self.params}

    def update(self, p):
        buf = self.buf[id(p)]
        buf.lerp_(p.grad, 1 - MOMENTUM)
        return newton_schulz(p.grad.lerp(buf, MOMENTUM))

    @staticmethod
    def apply(p, update):
        scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        p.data.add_(update.view_as(p), alpha=-LR * scale)


class Float64Rule:
    """canzona_reference's float64 Shampoo / SOAP for one parameter."""

    def __init__(self, kind, p):
        import canzona_reference
        settings = ({"lr": 3e-3, "precondition_frequency": 2}
                    if kind == "shampoo" else
                    {"lr": 3e-3, "precondition_frequency": 2,
                     "max_precond_dim": 10000})
        self.rule = canzona_reference.make_rule(kind, tuple(p.shape), settings)

    def step(self, p):
        import torch
        value = p.detach().double().numpy().copy()
        self.rule.step(value, p.grad.double().numpy(), lr=3e-3)
        p.data.copy_(torch.from_numpy(value).to(p.dtype))


def split_params(model, matrix_kind):
    import canzona.torch as ct
    matrix, rest = [], []
    for name, p in model.named_parameters():
        route = ct.default_route(name, p, matrix_kind)
        (matrix if route == matrix_kind else rest).append(p)
    return matrix, rest


# ---------------------------------------------------------------------------
# One rank of one mode.

def rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def private_bytes(pid):
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            kib = sum(int(line.split()[1]) for line in f
                      if line.startswith("Private_Dirty:"))
        return kib * 1024
    except OSError:
        return -1


def run_rank(args):
    import torch
    import torch.distributed as dist
    import train_torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = model_config(args.size)
    device = torch.device(args.device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    model = train_torch.build_model(seed=0, config=config).to(device)
    mode = args.mode
    kind = args.optimizer
    sync = (torch.cuda.synchronize if args.device == "cuda"
            else (lambda: None))

    def loss_of(step):
        inputs, targets = train_torch.batch(step, rank, config)
        logits = forward(inputs.to(device))
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab), targets.to(device).reshape(-1))

    opt = None
    if mode.startswith("canzona"):
        import canzona.torch as ct
        extra = {"module": model} if mode == "canzona_overlap" else {}
        named = model.named_parameters()
        common = dict(job_id=args.job_id, target=args.target, **extra)
        if kind == "muon":
            opt = ct.Muon(named, lr=LR, adamw_lr=ADAMW_LR,
                          adamw_weight_decay=ADAMW_WD, **common)
        elif kind == "shampoo":
            opt = ct.Shampoo(named, lr=3e-3, precondition_frequency=2,
                             adamw_lr=ADAMW_LR,
                             adamw_weight_decay=ADAMW_WD, **common)
        else:
            opt = ct.SOAP(named, lr=3e-3, precondition_frequency=2,
                          soap_settings={"max_precond_dim": 10000},
                          adamw_lr=ADAMW_LR, adamw_weight_decay=ADAMW_WD,
                          **common)
        forward = model
        local = None
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        forward = ddp
        local = ddp  # no_sync() for the communication-free backward
        matrix, rest = split_params(model, kind)
        adamw = torch.optim.AdamW(rest, lr=ADAMW_LR, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=ADAMW_WD)
        if kind == "muon":
            if hasattr(torch.optim, "Muon") and mode == "ddp_replicated":
                muon = torch.optim.Muon(matrix, lr=LR, momentum=MOMENTUM,
                                        weight_decay=0.0)
                rules = None
            else:
                muon = Muon(matrix)
                rules = None
        else:
            rules = {id(p): Float64Rule(kind, p) for p in matrix}
        # Round-robin: same-shape matrices dealt in order of size.
        by_shape = {}
        for p in sorted(matrix, key=lambda q: -q.numel()):
            by_shape.setdefault(tuple(p.shape), []).append(p)

        def matrix_step():
            gathered = 0.0
            if kind != "muon":
                for p in matrix:
                    rules[id(p)].step(p)
                return gathered
            if mode == "ddp_replicated":
                if isinstance(muon, Muon):
                    for p in matrix:
                        Muon.apply(p, muon.update(p))
                else:
                    muon.step()
                return gathered
            for shape, group in by_shape.items():
                for base in range(0, len(group), world):
                    chunk = group[base:base + world]
                    mine = (muon.update(chunk[rank]) if rank < len(chunk)
                            else torch.zeros(shape, device=device))
                    outs = [torch.empty(shape, device=device)
                            for _ in range(world)]
                    sync()
                    t0 = time.perf_counter()
                    dist.all_gather(outs, mine.contiguous())
                    sync()
                    gathered += time.perf_counter() - t0
                    for j, p in enumerate(chunk):
                        Muon.apply(p, outs[j])
            return gathered

    samples = []
    losses = []
    # Backward without communication (DDP no_sync), for the exposed time.
    local_backward = []
    for step in range(1, args.warmup + args.steps + 1):
        sync()
        t_start = time.perf_counter()
        loss = loss_of(step)
        sync()
        t_fwd = time.perf_counter()
        loss.backward()
        sync()
        t_bwd = time.perf_counter()
        gathered = 0.0
        waited = 0.0
        if opt is not None:
            opt.step()
            opt.zero_grad()
            waited = opt.last_step["seconds"]["dp_comm_exposed"]
        else:
            with torch.no_grad():
                adamw.step()
                gathered = matrix_step()
            model.zero_grad(set_to_none=True)
        sync()
        t_end = time.perf_counter()
        losses.append(loss.item())
        if step > args.warmup:
            samples.append({"iteration": t_end - t_start,
                            "backward": t_bwd - t_fwd,
                            "optimizer": t_end - t_bwd,
                            "gathered": gathered, "waited": waited})
    if local is not None:
        # The same backward with DDP's all-reduce off (no_sync), on fresh
        # batches; the optimizer does not run.
        for step in range(1, 4):
            with local.no_sync():
                loss = loss_of(10000 + step)
                sync()
                t0 = time.perf_counter()
                loss.backward()
                sync()
                local_backward.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    if opt is not None:
        opt.synchronize()
        opt.close()
    final = torch.tensor([losses[-1]], device=device)
    dist.all_reduce(final)
    result = {"rank": rank, "samples": samples,
              "final_loss": final.item() / world,
              "local_backward": (statistics.median(local_backward)
                                 if local_backward else None),
              "rss_bytes": rss_bytes(),
              "cuda_peak_bytes": (torch.cuda.max_memory_allocated()
                                  if args.device == "cuda" else None)}
    with open(args.out, "w") as f:
        json.dump(result, f)
    # Gloo's destroy_process_group can spin forever on rank 0 once the other
    # ranks are gone (torch 2.x); the result is written, so leave at once.
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------
# The driver.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(mode, ranks, daemon_bytes_per_rank):
    steps = len(ranks[0]["samples"])
    iteration, optimizer, exposed = [], [], []
    for i in range(steps):
        slow_iter = slow_opt = slow_exposed = 0.0
        for r in ranks:
            s = r["samples"][i]
            slow_iter = max(slow_iter, s["iteration"])
            slow_opt = max(slow_opt, s["optimizer"])
            if r["local_backward"] is not None:  # DDP
                e = max(0.0, s["backward"] - r["local_backward"]) + s["gathered"]
            else:
                e = s["waited"]
            slow_exposed = max(slow_exposed, e)
        iteration.append(slow_iter)
        optimizer.append(slow_opt)
        exposed.append(slow_exposed)
    return {
        "mode": mode,
        "median_iteration_ms": 1e3 * statistics.median(iteration),
        "median_optimizer_ms": 1e3 * statistics.median(optimizer),
        "median_exposed_comm_ms": 1e3 * statistics.median(exposed),
        "trainer_peak_rss_mib": max(r["rss_bytes"] for r in ranks) / 2**20,
        "daemon_private_mib_per_rank": (daemon_bytes_per_rank / 2**20
                                        if daemon_bytes_per_rank is not None
                                        else None),
        "final_loss": ranks[0]["final_loss"],
    }


def start_daemon(canzonad, workdir, device):
    sock = os.path.join(workdir, "d.sock")
    ready = os.path.join(workdir, "d.ready")
    log = open(os.path.join(workdir, "daemon.log"), "w")
    proc = subprocess.Popen(
        [canzonad, "--unix-socket", sock, "--ready-file", ready,
         "--metrics-address", "", "--step-timeout", "600",
         "--register-timeout", "600",
         "--backend", "cuda" if device == "cuda" else "cpu"] +
        (["--comm", "nccl"] if device == "cuda" else []),
        stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    for _ in range(300):
        if os.path.exists(ready) and os.path.getsize(ready) > 0:
            return proc, "unix:" + sock
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit("torch_peers.py: canzonad did not start (see %s)" % log.name)


def run_mode(args, mode, workdir):
    daemon = None
    target = args.target
    if mode.startswith("canzona") and target is None:
        daemon, target = start_daemon(args.canzonad, workdir, args.device)
    before = private_bytes(daemon.pid) if daemon else None
    port = free_port()
    job = "peers-%s-%d" % (mode.replace("_", "-"), os.getpid())
    procs, outs = [], []
    for rank in range(args.world):
        out = os.path.join(workdir, "%s-%d.json" % (mode, rank))
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--mode", mode, "--size", args.size, "--optimizer",
               args.optimizer, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--device", args.device, "--job-id", job,
               "--out", out]
        if target:
            cmd += ["--target", target]
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append(out)
    # The daemon's peak private memory while the ranks run.
    peak = None
    while daemon is not None and any(p.poll() is None for p in procs):
        peak = max(peak or 0, private_bytes(daemon.pid))
        time.sleep(0.05)
    failed = [p.wait() for p in procs]
    if daemon is not None:
        daemon.terminate()
        daemon.wait()
    if any(failed):
        sys.exit("torch_peers.py: mode %s failed (exit codes %s)"
                 % (mode, failed))
    ranks = [json.load(open(o)) for o in outs]
    daemon_bytes = ((peak - before) / args.world
                    if before is not None and peak is not None and peak >= 0
                    else None)
    return summarize(mode, ranks, daemon_bytes)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--optimizer", choices=["muon", "shampoo", "soap"],
                   default="muon")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of %s" % ",".join(MODES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--canzonad", default=os.path.join(ROOT, "build", "server",
                                                      "canzonad"))
    p.add_argument("--target", default=None,
                   help="a running canzonad instead of starting one per mode")
    p.add_argument("--json", default=None)
    # Worker side.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--job-id", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_rank(args)
        return
    if args.world < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--world and --steps must be >= 1, --warmup >= 0")
    modes = args.modes.split(",") if args.modes else (
        list(MODES) if args.optimizer == "muon"
        else ["ddp_replicated", "canzona", "canzona_overlap"])
    for m in modes:
        if m not in MODES:
            p.error("--modes: unknown mode %r" % m)
        if args.optimizer != "muon" and m == "ddp_roundrobin":
            p.error("--modes: ddp_roundrobin is Muon's (Keller Jordan's)")
    if args.target is None and any(m.startswith("canzona") for m in modes) \
            and not os.access(args.canzonad, os.X_OK):
        p.error("--canzonad: %s is not executable" % args.canzonad)
    workdir = tempfile.mkdtemp(prefix="canzona-peers.")
    try:
        rows = [run_mode(args, m, workdir) for m in modes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("%s decoder (%s), %d ranks on %s, %s, %d steps after %d warm-up; "
          "medians of the slowest rank" % (args.size, SIZES[args.size],
                                           args.world, args.device,
                                           args.optimizer, args.steps,
                                           args.warmup))
    base = {r["mode"]: r for r in rows}
    print("%-16s %10s %10s %10s %10s %10s %12s %10s %10s" % (
        "mode", "iter ms", "optim ms", "exposed ms", "vs repl", "vs rr",
        "trainer MiB", "daemon MiB", "loss"))
    for r in rows:
        def ratio(peer):
            ref = base.get(peer)
            return ("%9.2fx" % (ref["median_iteration_ms"] /
                                r["median_iteration_ms"]) if ref else "-")
        daemon = r["daemon_private_mib_per_rank"]
        print("%-16s %10.1f %10.1f %10.1f %10s %10s %12.1f %10s %10.4f" % (
            r["mode"], r["median_iteration_ms"], r["median_optimizer_ms"],
            r["median_exposed_comm_ms"], ratio("ddp_replicated"),
            ratio("ddp_roundrobin"), r["trainer_peak_rss_mib"],
            "%.1f" % daemon if daemon is not None else "-", r["final_loss"]))
    print("vs repl / vs rr: the peer's iteration time over this mode's "
          "(> 1: faster than the peer)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "world": args.world,
                       "optimizer": args.optimizer, "device": args.device,
                       "steps": args.steps, "modes": rows}, f, indent=2)


if __name__ == "__main__":
    main()
