"""canzona_reference.py against the daemon's update rules (canzonactl replay).

Run with: /usr/bin/python3 -m pytest tests/python/test_reference.py

Each case writes a random float32 parameter and K = 6 random float32
gradients as .npy, runs

    canzonactl replay --optimizer X --set ... --param P.npy --grads G.npy \
        --out OUT.npy

(binary: $CANZONACTL, default /work/main/build/client/ctl/canzonactl; the
daemon-backed tests are skipped when it does not exist) and compares OUT with
the float64 reference run from the same float32 inputs:

  * rel = max|OUT - REF| / max|REF| below 1e-5 (muon, adamw) or 1e-4
    (shampoo, soap);
  * the same error relative to the displacement, max|OUT - REF| /
    max|REF - P|, below 10x that (so a case whose update is tiny next to the
    parameter cannot pass on the parameter's size alone).

Negative controls check that a reference with one wrong hyperparameter
(momentum, betas, blocking, refresh frequency, ...) fails the comparison.

Cases are chosen so that the float32 daemon computes a well-defined function
of the data (see the comments at SHAMPOO_CASES and SOAP_CASES); the measured
errors are printed in the terminal summary (conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest

import canzona_reference as cr

CANZONACTL = os.environ.get("CANZONACTL", "/work/main/build/client/ctl/canzonactl")
K = 6
TOLERANCE = {"muon": 1e-5, "adamw": 1e-5, "shampoo": 1e-4, "soap": 1e-4}
DISPLACEMENT_FACTOR = 10.0

# Worst errors seen per optimizer, printed by conftest.py's terminal summary.
MEASURED: dict[str, dict[str, float]] = {}


@dataclass
class Case:
    name: str
    optimizer: str
    shape: tuple
    settings: dict = field(default_factory=dict)
    param_scale: float = 0.1
    # The first gradient as U diag(s) V^T with random orthonormal U, V and
    # singular values spread over [1, 2] * sqrt(max dim), instead of plain
    # normal: a square normal gradient's G G^T has condition ~1e4 and more,
    # and Shampoo's root inverse at step 1 / SOAP's first eigenbasis then
    # amplify float32 rounding past the tolerance for some seeds (seen up to
    # 2e-4 for Shampoo 16x16 defaults over 8 seeds; 1e-7 with this).
    conditioned_first: bool = False


MUON_CASES = [
    Case("square_defaults", "muon", (16, 16)),
    Case(
        "tall_quintic_match_rms_weight_decay",
        "muon",
        (24, 10),
        {"ns_coefficients": "quintic", "scale": "match_rms_adamw", "weight_decay": 2.0},
    ),
    Case(
        "wide_polar_express_no_nesterov",
        "muon",
        (10, 27),
        {"ns_coefficients": "polar_express", "nesterov": False, "momentum": 0.9},
    ),
    Case(
        "quintic_cycles_7_steps_eps",
        "muon",
        (13, 21),
        {"ns_coefficients": "quintic", "ns_steps": 7, "eps": 1e-5},
    ),
    Case(
        "polar_express_last_repeated_tall",
        "muon",
        (30, 9),
        {"ns_coefficients": "polar_express", "ns_steps": 7},
    ),
    Case("row_vector", "muon", (1, 37)),
    Case(
        "fp32_lr_3_steps_momentum_0",
        "muon",
        (9, 9),
        {"ns_precision": "fp32", "lr": 0.05, "ns_steps": 3, "momentum": 0.0},
    ),
    Case("tall_64x32_momentum_0.8", "muon", (64, 32), {"momentum": 0.8, "nesterov": "true"}),
    # The Gram iteration computes the standard polynomial: same reference.
    Case("gram_wide_quintic", "muon", (12, 40), {"ns_algorithm": "gram", "ns_coefficients": "quintic"}),
    Case(
        "gram_tall_polar_express",
        "muon",
        (40, 12),
        {"ns_algorithm": "gram", "ns_coefficients": "polar_express"},
    ),
    Case("standard_explicit", "muon", (12, 40), {"ns_algorithm": "standard"}),
    # Convolution filters (out, in, kh, kw): the matrix (out, in * kh * kw).
    Case("conv_filters", "muon", (16, 4, 3, 3)),
    # Stacked experts (E, rows, cols): E matrices.
    Case("stacked_experts", "muon", (3, 8, 12)),
]

ADAMW_CASES = [
    Case("vector_defaults", "adamw", (37,)),
    Case(
        "matrix_all_options",
        "adamw",
        (16, 16),
        {"lr": 0.02, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1},
    ),
    Case("three_d", "adamw", (3, 5, 7), {"lr": 0.02}),
    # beta1 <= 0.5: torch's lerp takes its large-weight branch.
    Case("row_beta1_0.3_no_decay", "adamw", (1, 13), {"beta1": 0.3, "weight_decay": 0}),
    Case("strong_weight_decay", "adamw", (8, 12), {"lr": 0.02, "weight_decay": 5}),
    Case("scalar", "adamw", (), {"lr": 0.01}),
]

# Shampoo's float32 root inverse amplifies the rounding error of a factor's
# smallest eigenvalues by its condition number, and with the default
# epsilon = 1e-12 a rank-deficient factor (one tall/wide gradient, thin
# blocks) has its float32-noise null-space eigenvalue floored to epsilon,
# i.e. a root of 1e3 (measured: 1e-4..4e-4 relative error for defaults on
# 24x10 / 10x24). The cases therefore start preconditioning once each
# factor has seen enough gradients to be full rank and well conditioned, or
# raise epsilon, as tests/unit/optim/update_rule_test.cc does. Square
# defaults (f = 1, start 1) stay in: G G^T of a square gradient is full rank.
SHAMPOO_CASES = [
    Case("square_defaults", "shampoo", (16, 16), conditioned_first=True),
    # Steps 1-3: the grafting-only path.
    Case("square_start_4", "shampoo", (16, 16), {"start_preconditioning_step": 4}),
    Case("square_frequency_3", "shampoo", (12, 12), {"precondition_frequency": 3}),
    Case(
        "tall_start_4_beta2_adagrad_weight_decay",
        "shampoo",
        (24, 10),
        {
            "precondition_frequency": 4,
            "beta2": 0.99,
            "grafting": "adagrad",
            "weight_decay": 0.5,
        },
    ),
    # Blocks 8/8/4 x 8/5, each with its own factors; no grafting.
    Case(
        "blocked_no_grafting",
        "shampoo",
        (20, 13),
        {
            "max_preconditioner_dim": 8,
            "grafting": "none",
            "precondition_frequency": 2,
            "start_preconditioning_step": 4,
        },
    ),
    # Blocks 9 x 16/16/8 with adam grafting (one graft norm per block).
    Case(
        "blocked_adam_grafting_wide",
        "shampoo",
        (9, 40),
        {"max_preconditioner_dim": 16, "precondition_frequency": 2, "start_preconditioning_step": 4},
    ),
    # Blocks 16/16/8 x 16/16/1: the 16x1 blocks have rank-deficient L, made
    # well defined by epsilon = 1e-3.
    Case(
        "blocked_adagrad_epsilon",
        "shampoo",
        (40, 33),
        {
            "max_preconditioner_dim": 16,
            "start_preconditioning_step": 3,
            "grafting": "adagrad",
            "epsilon": 1e-3,
        },
    ),
    Case(
        "wide_grafting_options_weight_decay",
        "shampoo",
        (7, 30),
        {
            "precondition_frequency": 3,
            "start_preconditioning_step": 6,
            "beta2": 0.999,
            "weight_decay": 0.05,
            "grafting_beta2": 0.99,
            "grafting_epsilon": 1e-6,
        },
    ),
    Case(
        "square_beta1_0_no_grafting_beta2",
        "shampoo",
        (16, 16),
        {"beta1": 0, "grafting": "none", "beta2": 0.95, "start_preconditioning_step": 3},
    ),
    Case(
        "strong_weight_decay_frequency_2",
        "shampoo",
        (8, 8),
        {
            "weight_decay": 5,
            "beta2": 0.9,
            "precondition_frequency": 2,
            "start_preconditioning_step": 4,
            "grafting_beta2": 0.9,
            "grafting_epsilon": 1e-4,
            "lr": 0.02,
        },
    ),
    # Gh = G lies in R's range exactly; epsilon 1e-2 keeps R's null space
    # (rank t < 37) out of the float32 noise.
    Case("row_vector_beta1_0_epsilon", "shampoo", (1, 37), {"beta1": 0, "epsilon": 1e-2}),
]

# SOAP's first call builds the bases from G G^T and G^T G of the first
# gradient. For a non-square gradient the longer side's factor is singular
# and the daemon's basis of its null space is float32 noise, on which the
# whole run depends (the float64 reference itself moves by ~30% under a
# 1e-7 perturbation of the data there), so non-square cases keep the longer
# side out of preconditioning with max_precond_dim; square factors are full
# rank and the run is a function of the data.
SOAP_CASES = [
    Case("square_defaults", "soap", (16, 16)),
    Case("square_refresh_every_2", "soap", (16, 16), {"precondition_frequency": 2}),
    Case("conv_filters", "soap", (12, 3, 2, 2), {"precondition_frequency": 2}),
    Case("stacked_experts", "soap", (2, 16, 16)),
    Case(
        "square_frequency_3_normalize_no_bias_correction",
        "soap",
        (12, 12),
        {"precondition_frequency": 3, "normalize_grads": True, "correct_bias": False},
    ),
    Case(
        "square_frequency_1_shampoo_beta",
        "soap",
        (24, 24),
        {"precondition_frequency": 1, "shampoo_beta": 0.5},
        conditioned_first=True,
    ),
    Case(
        "betas_frequency_2",
        "soap",
        (32, 32),
        {"precondition_frequency": 2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-7},
        conditioned_first=True,
    ),
    Case("strong_weight_decay", "soap", (16, 16), {"lr": 0.02, "weight_decay": 5}),
    Case(
        "wide_identity_right_side",
        "soap",
        (12, 40),
        {"max_precond_dim": 20, "precondition_frequency": 3, "weight_decay": 0},
    ),
    Case(
        "tall_identity_left_side",
        "soap",
        (40, 12),
        {"max_precond_dim": 20, "precondition_frequency": 2},
    ),
    Case("both_sides_identity", "soap", (11, 10), {"max_precond_dim": 8}),
    Case("row_vector_identity_right", "soap", (1, 13), {"max_precond_dim": 5}),
]

ALL_CASES = MUON_CASES + ADAMW_CASES + SHAMPOO_CASES + SOAP_CASES


# ---- helpers ----------------------------------------------------------------


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _inputs(case: Case):
    rng = np.random.default_rng(_seed(f"{case.optimizer}/{case.name}"))
    param = (case.param_scale * rng.standard_normal(case.shape)).astype(np.float32)
    grads = rng.standard_normal((K,) + tuple(case.shape))
    # No (near-)zero gradients: sign-like Adam steps would be degenerate.
    grads = np.where(np.abs(grads) < 1e-3, 1e-3, grads)
    if case.conditioned_first:
        rows, cols = case.shape
        k = min(rows, cols)
        u, _ = np.linalg.qr(rng.standard_normal((rows, k)))
        v, _ = np.linalg.qr(rng.standard_normal((cols, k)))
        s = rng.permutation(np.linspace(1.0, 2.0, k)) * np.sqrt(max(rows, cols))
        grads[0] = (u * s) @ v.T
    grads = grads.astype(np.float32)
    return param, grads


def _run_canzonactl(binary, tmp_path, optimizer, settings, param, grads, expect_ok=True):
    p_path, g_path, o_path = tmp_path / "P.npy", tmp_path / "G.npy", tmp_path / "OUT.npy"
    np.save(p_path, param)
    np.save(g_path, grads)
    if o_path.exists():
        o_path.unlink()
    args = [binary, "replay", "--optimizer", optimizer, "--param", str(p_path)]
    args += ["--grads", str(g_path), "--out", str(o_path)]
    if settings:
        args += ["--set", cr.settings_text(settings)]
    # One BLAS thread: the test machines are shared, and it keeps runs
    # reproducible.
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    if not expect_ok:
        return proc
    assert proc.returncode == 0, f"{' '.join(args)}\nrc={proc.returncode}\n{proc.stderr}{proc.stdout}"
    out = np.load(o_path)
    assert out.dtype == np.float32 and out.shape == param.shape
    return out.astype(np.float64)


def _reference(optimizer, shape, settings, param, grads):
    rule = cr.make_rule(optimizer, shape, settings)
    p = np.array(param, dtype=np.float64)
    for g in grads:
        rule.step(p, g.astype(np.float64))
    return p


def _errors(out, ref, param):
    diff = np.abs(out - ref).max()
    rel = diff / np.abs(ref).max()
    disp = diff / np.abs(ref - param.astype(np.float64)).max()
    return float(rel), float(disp)


def _record(case, rel, disp):
    m = MEASURED.setdefault(
        case.optimizer, {"rel": 0.0, "displacement": 0.0, "cases": 0, "worst": ""}
    )
    if rel > m["rel"]:
        m["rel"], m["worst"] = rel, case.name
    m["displacement"] = max(m["displacement"], disp)
    m["cases"] += 1


@pytest.fixture(scope="session")
def canzonactl():
    if not (os.path.isfile(CANZONACTL) and os.access(CANZONACTL, os.X_OK)):
        pytest.skip(
            f"canzonactl not found at {CANZONACTL} (build it, or point $CANZONACTL "
            "at the binary) -- daemon comparisons skipped"
        )
    return CANZONACTL


# ---- the daemon against the reference -------------------------------------


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: f"{c.optimizer}-{c.name}")
def test_matches_daemon(case, canzonactl, tmp_path):
    param, grads = _inputs(case)
    out = _run_canzonactl(canzonactl, tmp_path, case.optimizer, case.settings, param, grads)
    ref = _reference(case.optimizer, case.shape, case.settings, param, grads)
    rel, disp = _errors(out, ref, param)
    _record(case, rel, disp)
    tol = TOLERANCE[case.optimizer]
    assert rel < tol, f"max|out-ref|/max|ref| = {rel:.3e} >= {tol}"
    assert disp < DISPLACEMENT_FACTOR * tol, (
        f"max|out-ref|/max|ref-p| = {disp:.3e} >= {DISPLACEMENT_FACTOR * tol}"
    )


def _case(optimizer, name):
    return next(c for c in ALL_CASES if c.optimizer == optimizer and c.name == name)


# (case, wrong settings for the reference): each must fail the comparison.
NEGATIVE_CONTROLS = [
    (_case("muon", "square_defaults"), {"momentum": 0.9}),
    (_case("muon", "wide_polar_express_no_nesterov"), {"nesterov": True}),
    (_case("muon", "tall_quintic_match_rms_weight_decay"), {"scale": "spectral"}),
    (_case("muon", "quintic_cycles_7_steps_eps"), {"ns_coefficients": "simple"}),
    (_case("adamw", "matrix_all_options"), {"beta1": 0.85}),
    (_case("adamw", "strong_weight_decay"), {"weight_decay": 4.5}),
    (_case("shampoo", "square_start_4"), {"beta1": 0.8}),
    (_case("shampoo", "blocked_no_grafting"), {"max_preconditioner_dim": 1024}),
    (_case("shampoo", "blocked_adam_grafting_wide"), {"grafting": "adagrad"}),
    (_case("shampoo", "square_frequency_3"), {"start_preconditioning_step": 4}),
    (_case("soap", "square_defaults"), {"beta1": 0.9}),
    (_case("soap", "square_refresh_every_2"), {"precondition_frequency": 3}),
    (_case("soap", "wide_identity_right_side"), {"max_precond_dim": 10000}),
    (_case("soap", "square_frequency_3_normalize_no_bias_correction"), {"correct_bias": True}),
]


@pytest.mark.parametrize(
    "case,wrong",
    NEGATIVE_CONTROLS,
    ids=[f"{c.optimizer}-{c.name}-{'-'.join(f'{k}={v}' for k, v in w.items())}" for c, w in NEGATIVE_CONTROLS],
)
def test_negative_control_fails(case, wrong, canzonactl, tmp_path):
    param, grads = _inputs(case)
    out = _run_canzonactl(canzonactl, tmp_path, case.optimizer, case.settings, param, grads)
    settings = {**case.settings, **wrong}
    ref = _reference(case.optimizer, case.shape, settings, param, grads)
    rel, disp = _errors(out, ref, param)
    tol = TOLERANCE[case.optimizer]
    # Well above the tolerance, not merely above it.
    assert rel > 10 * tol, f"a reference with {wrong} still matches: rel = {rel:.3e}"


# ---- settings: the same keys, defaults and validation as the daemon -------


@pytest.mark.parametrize("optimizer", cr.OPTIMIZERS)
def test_known_keys_match_daemon(optimizer, canzonactl, tmp_path):
    proc = _run_canzonactl(
        canzonactl,
        tmp_path,
        optimizer,
        {"no_such_key": 1},
        np.zeros((2, 2), np.float32),
        np.zeros((1, 2, 2), np.float32),
        expect_ok=False,
    )
    assert proc.returncode == 2
    message = proc.stderr + proc.stdout
    assert "(known: " in message, message
    known = message.split("(known: ", 1)[1].split(")", 1)[0].split(", ")
    assert known == list(cr.DEFAULTS[optimizer]), message
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        cr.make_rule(optimizer, (2, 2), {"no_such_key": 1})


BAD_SETTINGS = [
    ("muon", {"momentum": 1}),
    ("muon", {"ns_steps": 0}),
    ("muon", {"nesterov": "yes"}),
    ("muon", {"ns_coefficients": "cubic"}),
    ("muon", {"ns_algorithm": "syrk"}),
    ("muon", {"eps": 0}),
    ("muon", {"lr": -1}),
    ("adamw", {"beta2": 1}),
    ("adamw", {"lr": "nan"}),
    ("shampoo", {"beta2": 0}),
    ("shampoo", {"start_preconditioning_step": 0}),
    ("shampoo", {"grafting": "sgd"}),
    ("shampoo", {"grafting_beta2": 1}),
    ("shampoo", {"max_preconditioner_dim": 1.5}),
    ("soap", {"shampoo_beta": -0.5}),
    ("soap", {"precondition_frequency": 0}),
    ("soap", {"correct_bias": "maybe"}),
]


@pytest.mark.parametrize(
    "optimizer,settings", BAD_SETTINGS, ids=[f"{o}-{cr.settings_text(s)}" for o, s in BAD_SETTINGS]
)
def test_bad_settings_rejected_like_daemon(optimizer, settings, canzonactl, tmp_path):
    key = next(iter(settings))
    proc = _run_canzonactl(
        canzonactl,
        tmp_path,
        optimizer,
        settings,
        np.zeros((2, 2), np.float32),
        np.ones((1, 2, 2), np.float32),
        expect_ok=False,
    )
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert f"setting {key}" in proc.stderr + proc.stdout
    with pytest.raises(ValueError, match=f"setting {key}"):
        cr.make_rule(optimizer, (2, 2), settings)


@pytest.mark.parametrize(
    "optimizer,settings",
    [
        ("muon", {"momentum": 0, "nesterov": "FALSE", "ns_precision": "bf16"}),
        ("shampoo", {"beta2": 1, "start_preconditioning_step": -1}),
        ("soap", {"shampoo_beta": -1, "normalize_grads": 1}),
    ],
)
def test_edge_settings_accepted(optimizer, settings):
    cr.make_rule(optimizer, (3, 4), settings)


def test_settings_text_round_trip():
    text = "lr=0.02, momentum = 0.9,nesterov=false"
    parsed = cr.parse_settings(text)
    assert parsed == {"lr": "0.02", "momentum": "0.9", "nesterov": "false"}
    assert cr.resolve_settings("muon", text) == cr.resolve_settings(
        "muon", {"lr": 0.02, "momentum": 0.9, "nesterov": False}
    )
    assert cr.settings_text({"lr": 1e-3, "nesterov": True, "ns_steps": 3}) == (
        "lr=0.001,nesterov=true,ns_steps=3"
    )
    for bad in ("lr", "=1", "lr=", "lr=1,lr=2"):
        with pytest.raises(ValueError):
            cr.parse_settings(bad)


def test_shapes_validated():
    for shape in ((4,), (4, 3, 2, 2, 2, 2)):
        with pytest.raises(ValueError, match=r"needs a matrix \(2-D, 3-D stacked"):
            cr.make_rule("muon", shape)
    assert [r.shape for r in cr.make_rule("muon", (3, 4, 5)).rules] == [(4, 5)] * 3
    assert cr.make_rule("soap", (8, 4, 3, 3)).shape == (8, 36)
    with pytest.raises(ValueError, match="dimension < 1"):
        cr.make_rule("adamw", (3, 0))
    cr.make_rule("adamw", (2, 3, 4))


# ---- reference-only properties ----------------------------------------------


@pytest.mark.parametrize("optimizer", cr.OPTIMIZERS)
def test_lr_override(optimizer):
    """step(lr=x) is one step with learning rate x (an lr exact in float32
    here: the override is rounded to float32 like the daemon's); the
    configured lr is the default."""
    rng = np.random.default_rng(7)
    shape = (6, 5)
    grads = rng.standard_normal((4,) + shape)
    p0 = rng.standard_normal(shape)
    configured = cr.make_rule(optimizer, shape, {"lr": 0.03125})
    overridden = cr.make_rule(optimizer, shape, {})
    default = cr.make_rule(optimizer, shape, {"lr": 0.03125})
    a, b, c = p0.copy(), p0.copy(), p0.copy()
    for g in grads:
        configured.step(a, g)
        overridden.step(b, g, lr=0.03125)
        default.step(c, g, lr=None)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    zero = cr.make_rule(optimizer, shape, {})
    d = p0.copy()
    for g in grads:
        zero.step(d, g, lr=0.0)
    np.testing.assert_array_equal(d, p0)
    with pytest.raises(ValueError):
        zero.step(d, grads[0], lr=-1.0)


def test_soap_insensitive_to_eigenvector_signs():
    """Flipping the signs of the initial eigenvectors changes nothing: the
    projected moments flip alike and Householder QR's Q does not depend on
    the signs of its input's columns."""
    rng = np.random.default_rng(11)
    shape = (10, 10)
    grads = rng.standard_normal((7,) + shape)
    p0 = rng.standard_normal(shape)
    settings = {"precondition_frequency": 2}
    plain, flipped = cr.make_rule("soap", shape, settings), cr.make_rule("soap", shape, settings)
    a, b = p0.copy(), p0.copy()
    plain.step(a, grads[0])
    flipped.step(b, grads[0])
    flipped.QL = flipped.QL * np.where(rng.random(10) < 0.5, -1.0, 1.0)
    flipped.QR = flipped.QR * np.where(rng.random(10) < 0.5, -1.0, 1.0)
    for g in grads[1:]:
        plain.step(a, g)
        flipped.step(b, g)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-12 * np.abs(a).max())


def test_muon_newton_schulz_orthogonalizes():
    """Quintic Newton-Schulz brings every singular value into its band."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal((12, 20))
    x = cr.newton_schulz(u, cr.ns_coefficients("quintic", 5), 1.0, 1e-7)
    s = np.linalg.svd(x, compute_uv=False)
    assert s.min() > 0.6 and s.max() < 1.25, s
