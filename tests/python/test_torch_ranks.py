"""Several trainer processes and what runs beside the optimizer: a
torch.amp.GradScaler at DP2 (and non-finite gradients skipped without
one), a DistributedDataParallel-wrapped model, a local clip on several
ranks, and a killed trainer restarted on its job id.

ctest runs it as python_test_torch_bridge_ranks and in
python_installed_package; by hand: see torch_test_util.py.
"""

import os
import subprocess
import sys
import time
import uuid
import warnings

import pytest
import torch

from conftest import ROOT
import torch_worker
import train_torch
from torch_test_util import run_ranks

import canzona.torch as ct


@pytest.mark.parametrize("overlap,protocol", [
    (False, "keyword"), (True, "keyword"),
    (False, "attributes"), (True, "attributes")])
def test_grad_scaler_unscales_in_the_daemon_and_skips_on_every_rank(
        daemon, tmp_path, overlap, protocol):
    """torch.amp.GradScaler through scaler.step(opt): the daemon undoes the
    scale (its gradient norm and the updates are the unscaled run's), and
    when rank 0 alone overflows (step 3) both ranks skip that step, report
    found_inf and back off their scales alike. GradScaler's own path would
    skip step() on rank 0 only and leave rank 1 waiting in the daemon;
    with module= its unscale_ would edit reported gradients.

    protocol "attributes": step() behind a wrapper of *args, **kwargs, as
    Hugging Face Accelerate's fp16 puts it, where torch >= 2.0's
    GradScaler checks this rank's gradients in place and sets found_inf
    instead of passing grad_scaler=. The same run, with no warning of an
    edited gradient (without module=) and no refused step (with it)."""
    steps, inf_at = 5, 3
    mode = ["--overlap", "--synchronize"] if overlap else []
    plain = run_ranks(daemon, 2, str(tmp_path / "plain"), "--optimizer",
                      "muon", "--last", str(inf_at - 1), *mode)
    scaled = run_ranks(daemon, 2, str(tmp_path / "scaled"), "--optimizer",
                       "muon", "--grad-scaler", "1024", "--inf-at",
                       str(inf_at), "--last", str(steps),
                       "--scaler-protocol", protocol, *mode)
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
        assert r["warnings"] == [], r["warnings"]
        if overlap:
            assert r["events"]["grad_ready"] > 0, r["events"]
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
