"""canzona.torch against plain PyTorch and float64 references: the example
decoder trained through the daemon (1 and 2 processes) equals Muon as
torch.optim.Muon defines it with torch.optim.AdamW, and the float64
Shampoo / SOAP of canzona_reference; a bfloat16 model (with and without
fp32 norms) equals a mixed-precision reference, and max_grad_norm equals
clip_grad_norm_ before the optimizer; a channels_last conv net's filters,
stacked experts and Megatron's fused blocks step as their matrices.

ctest runs it as python_test_torch_bridge_numerics and in
python_installed_package; by hand: see torch_test_util.py.
"""

import os
import uuid

import pytest
import torch

from torch_test_util import (
    STEPS, run_ranks, TorchMuon, reference_run, mixed_reference_run, relative,
    assert_close)

import canzona
import canzona.torch as ct


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
