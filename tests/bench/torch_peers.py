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
    sudo tests/bench/torch_peers.py --world 4 --size narrow --nodes \\
        --link-mbit 1000    # one namespace, link and canzonad per rank

--nodes puts every rank (and, for canzona, its own canzonad) in a network
namespace of its own, joined to the others by a veth pair shaped with tc
tbf at --link-mbit both ways: one link per node, as on a cluster with one
GPU per node (DDP's Gloo and the daemons' Gloo both cross it). Size
"narrow" (16 layers of hidden 64, 16 x 4 tokens per rank) moves many bytes
per flop, where the link decides.

A benchmark, not a test: it asserts nothing but that every mode ran.
Standard library + torch + the canzona package (PYTHONPATH=client/python).
"""

import argparse
import json
import os
import resource
import shutil
import signal
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

from canzona.cli import ArgumentParser  # noqa: E402

MODES = ("ddp_replicated", "ddp_roundrobin", "canzona", "canzona_overlap")
SIZES = {
    # hidden, layers, heads, kv heads, head dim, ffn, vocab, seq, batch
    "small": (64, 2, 4, 2, 16, 128, 256, 32, 8),
    "medium": (256, 4, 8, 4, 32, 768, 1024, 64, 8),
    "large": (512, 8, 8, 4, 64, 1536, 2048, 64, 8),
    # Many small matrices and few tokens: little compute per byte moved,
    # where the link decides (Muon's matrices are 98% of the elements).
    "narrow": (64, 16, 4, 2, 16, 256, 256, 16, 4),
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
        common = dict(job_id=args.job_id, target=args.target,
                      bucket_size=args.bucket_size, **extra)
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
        phases = None
        if opt is not None:
            opt.step()
            opt.zero_grad()
            waited = opt.last_step["seconds"]["dp_comm_exposed"]
            phases = opt.last_step["seconds"]
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
                            "gathered": gathered, "waited": waited,
                            "phases": phases})
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
    # The daemon's named phases (canzona modes): per step the slowest
    # rank's, then the median over steps.
    phases = None
    if ranks[0]["samples"][0].get("phases"):
        phases = {
            name: 1e3 * statistics.median(
                max(r["samples"][i]["phases"][name] for r in ranks)
                for i in range(steps))
            for name in ranks[0]["samples"][0]["phases"]}
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
        "daemon_phases_ms": phases,
    }


def start_daemon(canzonad, workdir, device, name="d", node=None,
                 coordinator=None):
    """One canzonad; on `node` (a Nodes index) inside that node's network
    namespace, talking Gloo over its shaped link (node 0 coordinates)."""
    sock = os.path.join(workdir, name + ".sock")
    ready = os.path.join(workdir, name + ".ready")
    log = open(os.path.join(workdir, name + ".log"), "w")
    cmd = [canzonad, "--unix-socket", sock, "--ready-file", ready,
           "--metrics-address", "", "--step-timeout", "600",
           "--register-timeout", "600", "--daemon-id", name,
           "--backend", "cuda" if device == "cuda" else "cpu"]
    if device == "cuda":
        cmd += ["--comm", "nccl"]
    prefix = []
    if node is not None:
        host = Nodes.address(node)
        prefix = ["ip", "netns", "exec", NODES.namespace(node)]
        cmd += ["--comm-host", host]
        cmd += (["--coordinator", coordinator] if coordinator
                else ["--listen", host + ":0"])
    proc = subprocess.Popen(prefix + cmd, stdout=log,
                            stderr=subprocess.STDOUT,
                            env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    for _ in range(300):
        if os.path.exists(ready):  # canzonad renames it into place whole
            with open(ready) as f:
                port = json.load(f).get("tcp_port", 0)
            return proc, "unix:" + sock, port
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit("torch_peers.py: canzonad did not start (see %s)" % log.name)


class Nodes:
    """--nodes: one network namespace per rank ("node"), each joined to a
    bridge by its own veth pair shaped at --link-mbit in both directions
    (tc tbf), so every rank has a link of its own, as on a cluster with one
    GPU per node. Needs root, `ip` and `tc`; removed again by close()."""

    def __init__(self, world, mbit):
        self.tag = "%d" % os.getpid()
        self.world = world
        self.bridge = "czpb" + self.tag
        self.made = []
        burst = max(262144, mbit * 1000000 // 8 // 250)
        shape = ["tbf", "rate", "%dmbit" % mbit, "burst", str(burst),
                 "latency", "100ms"]
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            self._ip("link", "set", self.bridge, "up")
            for i in range(world):
                ns, outer, inner = (self.namespace(i), "czpo%s_%d" % (
                    self.tag, i), self.interface(i))
                self._ip("netns", "add", ns)
                self.made.append(("netns", ns))
                self._ip("link", "add", outer, "type", "veth", "peer",
                         "name", inner)
                self._ip("link", "set", inner, "netns", ns)
                self._ip("-n", ns, "addr", "add", self.address(i) + "/24",
                         "dev", inner)
                self._ip("-n", ns, "link", "set", "lo", "up")
                self._ip("-n", ns, "link", "set", inner, "up")
                self._ip("link", "set", outer, "master", self.bridge)
                self._ip("link", "set", outer, "up")
                # Egress of the node, and of the bridge towards it.
                self._run(["ip", "netns", "exec", ns, "tc", "qdisc", "add",
                           "dev", inner, "root"] + shape)
                self._run(["tc", "qdisc", "add", "dev", outer, "root"] +
                          shape)
        except Exception:
            self.close()
            raise

    def namespace(self, i):
        return "czpn%s_%d" % (self.tag, i)

    def interface(self, i):
        """The node's end of its link (what Gloo must bind to)."""
        return "czpi%s_%d" % (self.tag, i)

    @staticmethod
    def address(i):
        return "10.79.0.%d" % (i + 1)

    def _run(self, cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("%s: %s" % (" ".join(cmd), r.stderr.strip()))

    def _ip(self, *args):
        self._run(["ip"] + list(args))

    def close(self):
        for kind, name in reversed(self.made):
            subprocess.run(["ip", kind, "del", name], capture_output=True)
        self.made = []


NODES = None  # the Nodes of this run, with --nodes


def run_mode(args, mode, workdir):
    daemons = []
    targets = [args.target] * args.world
    if mode.startswith("canzona") and args.target is None:
        if NODES is None:
            proc, target, _ = start_daemon(args.canzonad, workdir,
                                           args.device)
            daemons, targets = [proc], [target] * args.world
        else:
            # One daemon per node, node 0's coordinating.
            coordinator = None
            targets = []
            for i in range(args.world):
                proc, target, port = start_daemon(
                    args.canzonad, workdir, args.device, "%s-d%d" % (mode, i),
                    node=i, coordinator=coordinator)
                if i == 0:
                    coordinator = "%s:%d" % (Nodes.address(0), port)
                daemons.append(proc)
                targets.append(target)
    before = sum(private_bytes(d.pid) for d in daemons) if daemons else None
    port = free_port()
    job = "peers-%s-%d" % (mode.replace("_", "-"), os.getpid())
    procs, outs = [], []
    for rank in range(args.world):
        out = os.path.join(workdir, "%s-%d.json" % (mode, rank))
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world),
                   MASTER_ADDR=("127.0.0.1" if NODES is None
                                else Nodes.address(0)),
                   MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--mode", mode, "--size", args.size, "--optimizer",
               args.optimizer, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--device", args.device, "--job-id", job,
               "--out", out, "--bucket-size", str(args.bucket_size)]
        if targets[rank]:
            cmd += ["--target", targets[rank]]
        if NODES is not None:
            cmd = ["ip", "netns", "exec", NODES.namespace(rank)] + cmd
            env["GLOO_SOCKET_IFNAME"] = NODES.interface(rank)
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append(out)
    # The daemons' peak private memory while the ranks run.
    peak = None
    while daemons and any(p.poll() is None for p in procs):
        peak = max(peak or 0, sum(private_bytes(d.pid) for d in daemons))
        time.sleep(0.05)
    failed = [p.wait() for p in procs]
    for daemon in daemons:
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
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--optimizer", choices=["muon", "shampoo", "soap"],
                   default="muon")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of %s" % ",".join(MODES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--bucket-size", type=int, default=0,
                   help="canzona modes: elements per gradient bucket (0: the "
                        "optimizer's default)")
    p.add_argument("--canzonad", default=os.path.join(ROOT, "build", "server",
                                                      "canzonad"))
    p.add_argument("--target", default=None,
                   help="a running canzonad instead of starting one per mode")
    p.add_argument("--json", default=None)
    p.add_argument("--nodes", action="store_true",
                   help="one network namespace per rank with its own shaped "
                        "link (and one canzonad per rank): needs root")
    p.add_argument("--link-mbit", type=int, default=1000,
                   help="with --nodes: each node's link rate, Mbit/s")
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
    if args.nodes:
        if os.geteuid() != 0 or not shutil.which("ip") or \
                not shutil.which("tc"):
            p.error("--nodes: needs root, ip and tc (iproute2)")
        if args.link_mbit < 1:
            p.error("--link-mbit must be >= 1")
    global NODES
    # A SIGTERM (timeout, Ctrl-C's cousin) still removes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix="canzona-peers.")
    os.chmod(workdir, 0o755)
    try:
        if args.nodes:
            NODES = Nodes(args.world, args.link_mbit)
        rows = [run_mode(args, m, workdir) for m in modes]
    finally:
        if NODES is not None:
            NODES.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print("%s decoder (%s), %d ranks on %s, %s, %d steps after %d warm-up; "
          "medians of the slowest rank" % (args.size, SIZES[args.size],
                                           args.world, args.device,
                                           args.optimizer, args.steps,
                                           args.warmup))
    if args.nodes:
        print("one node per rank: its own %d Mbit/s link (tbf, both ways) "
              "and its own canzonad" % args.link_mbit)
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
    for r in rows:
        if r["daemon_phases_ms"]:
            # Data parallel only: the TP phases are zero.
            from canzona._phases import STEP_PHASES
            named = [p for p in STEP_PHASES if not p.startswith("tp_")]
            named.append("dp_comm_exposed")
            print("%-16s daemon ms: %s" % (r["mode"], ", ".join(
                "%s %.1f" % (n, r["daemon_phases_ms"][n]) for n in named)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "world": args.world,
                       "nodes": args.nodes,
                       "link_mbit": args.link_mbit if args.nodes else None,
                       "optimizer": args.optimizer, "device": args.device,
                       "steps": args.steps, "bucket_size": args.bucket_size,
                       "modes": rows}, f, indent=2)


if __name__ == "__main__":
    main()
