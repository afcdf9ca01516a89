"""An optimizer's life around the model: the README's example under
torchrun, close() and a new optimizer over
the same parameters, parameters moved out of the shared buffer, empty
and frozen parameters, a step interrupted by Ctrl-C, and constructions
that fail (refused settings, a failure after Register, host memory the
daemon could not lock) leaving the model and the daemon as they were.

ctest runs it as python_test_torch_bridge_lifecycle and in
python_installed_package; by hand: see torch_test_util.py.
"""

import gc
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
import weakref

import pytest
import torch

import train_torch
from conftest import ROOT

import canzona
import canzona.torch as ct


def test_the_readme_s_example_trains_under_torchrun(daemon):
    """README's quick start, as written: torchrun --redirects 2 --tee 1
    --nproc_per_node 2 client/examples/train_torch.py --optimizer muon
    --steps N. Both ranks
    train one job and the loss falls. A bad flag is one line on stderr
    naming it, exit 2 (before, argparse's usage came first, and an unknown
    --optimizer was a ValueError traceback from each rank)."""
    example = os.path.join(ROOT, "client", "examples", "train_torch.py")
    with socket.socket() as s:  # torchrun's port, free for this run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, CANZONA_TARGET=daemon, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--redirects", "2",
         "--tee", "1", "--nproc_per_node", "2", "--master_port", str(port),
         example, "--optimizer", "muon",
         "--steps", "20"], env=env, capture_output=True, text=True,
        timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"canzona: job \S+, 2 ranks", run.stdout), run.stdout
    losses = [float(x) for x in re.findall(r"loss (\S+)", run.stdout)]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], run.stdout
    for flag, named in [(["--steps", "x"], "--steps"),
                        (["--optimizer", "adam"], "--optimizer"),
                        (["--bogus"], "--bogus")]:
        bad = subprocess.run([sys.executable, example] + flag, env=env,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.count("\n") == 1 and named in bad.stderr, \
            bad.stderr


_EXIT_WITHOUT_CLOSE = """
import os, sys
import canzona.torch as ct
import train_torch
model = train_torch.build_model(0)
opt = ct.Muon(model.named_parameters(), job_id=sys.argv[1])
for step in (1, 2):
    train_torch.loss_fn(model, step, 0).backward()
    opt.step()
    opt.zero_grad()
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a forked child's normal exit runs the atexit handlers
    os.waitpid(child, 0)
print("stepped", opt.steps)
"""


def test_a_script_that_ends_without_close_deregisters(daemon):
    """torch.optim has no close(), so most training scripts end without
    one: at the normal exit the rank deregisters as close() would. Before,
    the daemon found the trainer gone, failed the job ("exited without
    deregistering") and cut the rank's connections at once, where a slower
    peer may still be reading its last all-gather. A child forked after
    construction that exits normally (its atexit handlers run) leaves the
    parent's rank registered: the parent's second step runs."""
    job = "no-close-" + uuid.uuid4().hex[:8]
    env = dict(os.environ, CANZONA_TARGET=daemon,
               PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, job],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "stepped 2" in run.stdout, \
        run.stdout + run.stderr
    client = canzona.Client(daemon)
    # The daemon's watcher looks for exited trainers every 200 ms.
    for _ in range(10):
        jobs = {j["job_id"]: j for j in client.status()["jobs"]}
        assert job not in jobs, jobs.get(job)
        time.sleep(0.2)
    client.close()


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
