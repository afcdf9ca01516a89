"""Porting a torch.optim loop to canzona.torch: torch.optim.Muon's, SOAP's
and Shampoo's keywords, step(closure) as Lightning calls it, gradients set
by hand, param group dicts and plain parameters, learning-rate and
momentum schedulers (LambdaLR, StepLR, OneCycleLR, settings written into
param_groups), the default route by name and shape, and the forms,
settings and uses that cannot work raising clear errors.

ctest runs it as python_test_torch_bridge_porting and in
python_installed_package; by hand: see torch_test_util.py.
"""

import os
import uuid
import warnings

import pytest
import torch

import torch_worker
import train_torch
from torch_test_util import (
    run_ranks, TorchMuon, reference_run, relative, assert_close)

import canzona
import canzona.torch as ct


def test_torch_optim_kernel_flags_are_accepted_and_modes_refused(daemon):
    """torch.optim's flags: foreach= and fused= (nanoGPT passes AdamW
    fused=True) choose torch's own kernels and are accepted, meaning
    nothing here; maximize=, capturable= and differentiable= would change
    what a step is, and True is a ValueError naming the flag, before
    anything registers. Before, each was a TypeError naming
    Optimizer.__init__."""
    os.environ["CANZONA_TARGET"] = daemon
    model = train_torch.build_model(0)
    opt = ct.Muon(model.named_parameters(), fused=True, foreach=False)
    train_torch.loss_fn(model, 1, 0).backward()
    opt.step()
    opt.close()
    for flag in ("maximize", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=r"^%s=True: torch.optim's %s "
                           r"mode has no counterpart" % (flag, flag)):
            ct.SOAP(train_torch.build_model(0).named_parameters(),
                    **{flag: True})
        ct.Muon(train_torch.build_model(0).named_parameters(),
                **{flag: False}).close()


def test_torch_s_warning_that_grad_scaler_will_stop_is_not_shown(daemon):
    """torch >= 2.0 warns at scaler.step(opt), for an optimizer whose
    step() takes grad_scaler=, that a later torch will set found_inf
    instead. canzona.torch takes both (test_torch_ranks.py runs each), so
    once an optimizer is constructed that warning, addressed to it, is not
    shown to its users; other FutureWarnings are."""
    with warnings.catch_warnings(record=True) as caught:
        opt = ct.Muon(train_torch.build_model(0).named_parameters(),
                      job_id="future-" + uuid.uuid4().hex[:8], target=daemon)
        opt.close()
        warnings.filterwarnings("always", message="another")
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword "
            "argument to the passed optimizer. In the near future "
            "GradScaler registers `grad_scale: Tensor` and `found_inf: "
            "Tensor` to the passed optimizer and let the optimizer use "
            "them directly.", FutureWarning)
        warnings.warn("another FutureWarning", FutureWarning)
    assert [str(w.message) for w in caught] == ["another FutureWarning"]


def test_an_unknown_keyword_names_the_function_and_adamw_s(daemon):
    """Muon(..., betas=...) (torch.optim.AdamW's habit) is a TypeError
    naming Muon and the AdamW group's keywords, before anything registers;
    before, it named Optimizer.__init__."""
    os.environ["CANZONA_TARGET"] = daemon
    with pytest.raises(TypeError) as error:
        ct.Muon(train_torch.build_model(0).named_parameters(),
                betas=(0.9, 0.95))
    assert str(error.value) == (
        "Muon() got an unexpected keyword argument 'betas' (the AdamW "
        "group's settings are adamw_lr, adamw_betas, adamw_eps and "
        "adamw_weight_decay)")


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


@pytest.mark.parametrize("module", [False, True])
def test_a_closure_steps_as_lightning_calls_it(daemon, module):
    """opt.step(closure) as PyTorch Lightning's automatic optimization
    calls it: the closure zeroes the gradients, runs forward and backward
    and returns the loss, which step() returns. Bitwise the plain loop's
    run; with module= the overlap starts all the same."""
    os.environ["CANZONA_TARGET"] = daemon
    runs = []
    for use_closure in (False, True):
        model = train_torch.build_model(0)
        opt = ct.Muon(model.named_parameters(), adamw_lr=3e-3,
                      module=model if module else None)
        for step in range(1, 5):
            def closure():
                opt.zero_grad()
                loss = train_torch.loss_fn(model, step, 0)
                loss.backward()
                return loss
            if use_closure:
                loss = opt.step(closure)
                assert torch.is_tensor(loss) and loss.requires_grad
            else:
                closure()
                assert opt.step() is None
        opt.synchronize()
        if module:
            assert opt._overlap == "on"
        runs.append({n: p.detach().clone()
                     for n, p in model.named_parameters()})
        opt.close()
    for n, p in runs[0].items():
        assert torch.equal(p, runs[1][n]), n


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


def test_torch_optim_forms_that_cannot_work_say_why(daemon):
    """Unnamed parameters where the optimizer is chosen by name, a group
    mixing matrices with embeddings, malformed groups, the module itself
    and its state_dict() raise naming the fix, before anything registers;
    a {name: parameter} dict is taken as its pairs."""
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
    # The module itself, and a state_dict() (tensors detached from the
    # model); before: "'Decoder' object is not iterable" and "str is not a
    # parameter".
    with pytest.raises(TypeError, match=r"^params: the module Decoder "
                       r"itself; pass its named_parameters\(\)"):
        ct.Muon(model)
    with pytest.raises(TypeError, match=r"^params: a mapping, but not of "
                       r"names to parameters \(a state_dict\(\) holds"):
        ct.Muon(model.state_dict())
    assert all(p.grad is None for p in model.parameters())
    # dict(model.named_parameters()) is its pairs.
    opt = ct.Muon(dict(model.named_parameters()))
    assert opt._names == [n for n, _ in model.named_parameters()]
    opt.close()


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
    # A GLU's gate projection named "gate": (ffn, hidden), tall, where a
    # router's (experts, hidden) is wide.
    _route("model.layers.0.mlp.gate.weight", "muon", (32, 16)),
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
    # GradScaler's attribute protocol (a scale and found_inf set on the
    # optimizer, no grad_scaler=) with no GradScaler.step calling: no
    # scaler to give the daemon's decision to, refused before anything
    # steps.
    opt.grad_scale = torch.full((1,), 1024.0)
    opt.found_inf = torch.zeros(1)
    with pytest.raises(RuntimeError, match="no GradScaler.step"):
        opt.step()
    del opt.grad_scale, opt.found_inf
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
