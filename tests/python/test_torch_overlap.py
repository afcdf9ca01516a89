"""module= (the overlap of the step with backward and forward): the waits
in forward pre-hooks and state_dict(), CUDA stream events (stand-ins),
weight_norm / spectral_norm, weights read without calling their module,
activation checkpointing, hierarchical sharding, gradients edited after
backward, an EMA deepcopy, an interrupted backward, gradient accumulation
with no_sync(), and a GAN's loop: bitwise the run without module=.

ctest runs it as python_test_torch_bridge_overlap and in
python_installed_package; by hand: see torch_test_util.py.
"""

import contextlib
import copy
import os
import uuid
import warnings

import pytest
import torch

import train_torch
from torch_test_util import run_ranks, relative

import canzona
import canzona.torch as ct


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
    # Each says how to have the overlap, Hugging Face's Trainer included.
    assert all("TrainingArguments(max_grad_norm=0)" in w and
               "scaler.step(opt) without scaler.unscale_(opt)" in w
               for w in caught), caught
    synced, overlaps, caught = _gan_run(True, True, edit)
    assert overlaps == ["off" if edit else "on", "on"], overlaps
    assert len(caught) == (1 if edit else 0), caught
    for a, b, c in zip(plain, learned, synced):
        assert torch.equal(a, b) and torch.equal(a, c)
