"""State and checkpoints: state_dict() and save_checkpoint() resumed bitwise
(in new processes, on the same job_id, after unfreezing, after the daemon
restarted, past the gRPC message size, after Accelerate's round trip),
torch.distributed.checkpoint refused, weights loaded into a bf16 model between steps, and torch.save of the
model's state_dict or of the whole model while the optimizer holds it.

ctest runs it as python_test_torch_bridge_state and in
python_installed_package; by hand: see torch_test_util.py.
"""

import collections
import io
import os
import pickle
import subprocess
import sys
import uuid
import warnings

import pytest
import torch

from conftest import ROOT, start_daemon
import train_torch
from torch_test_util import run_ranks, TorchMuon, relative

import canzona
import canzona.torch as ct


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


def test_torch_distributed_checkpoint_is_refused_naming_save_checkpoint(
        daemon):
    """torch.distributed.checkpoint (get_optimizer_state_dict, torchtitan's
    checkpointer) keeps a state_dict's "state" and "param_groups" only, so
    it would save none of the daemon's state, found out at the load. Its
    state_dict() and load_state_dict() calls raise, naming the way that
    works. torch 1.13 has no torch.distributed.checkpoint.state_dict: a
    function of that module's name stands in for it (the real one runs
    too where torch has it)."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters())
    train_torch.loss_fn(model, 1, 0).backward()
    opt.step()
    saved = opt.state_dict()  # from the loop: as before
    namespace = {"__name__": "torch.distributed.checkpoint.state_dict"}
    exec("def get_optimizer_state_dict(model, optim):\n"
         "    osd = optim.state_dict()\n"
         "    return {'state': osd['state'], 'param_groups': "
         "osd['param_groups']}\n"
         "def set_optimizer_state_dict(model, optim, osd):\n"
         "    optim.load_state_dict(osd)\n", namespace)
    calls = [lambda: namespace["get_optimizer_state_dict"](model, opt),
             lambda: namespace["set_optimizer_state_dict"](model, opt, saved)]
    try:
        from torch.distributed.checkpoint import state_dict as dcp
        calls.append(lambda: dcp.get_optimizer_state_dict(model, opt))
    except ImportError:
        pass
    for call in calls:
        with pytest.raises(RuntimeError, match="save_checkpoint"):
            call()
    opt.load_state_dict(saved)
    train_torch.loss_fn(model, 2, 0).backward()
    opt.step()
    assert opt.steps == 2
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
