"""Float64 numpy references of Canzona's four server-side update rules.

The rules follow the daemon (server/optim/{muon,adamw,shampoo,soap}.cc and
the cpu backend's kernels in kernels/cpu/cpu_backend.cc) step for step, with
the same hyperparameter names, defaults and validation as
``canzonactl replay --set key=value`` (server/optim/optimizer_config.cc).
They were ported from the C++ float64 references in
tests/unit/optim/reference.cc; where the two differ the server code wins.

Example::

    rule = make_rule("muon", (64, 32), {"lr": 0.02, "nesterov": "false"})
    p = p0.astype(np.float64)
    for g in grads:
        rule.step(p, g)            # in place; lr=... overrides for one step

Pure numpy; no torch needed. Everything is computed in float64 (the daemon
works in float32), so a daemon result differs from this one by float32
rounding only -- amplified where the problem is ill-conditioned:

* Shampoo: a factor's smallest eigenvalues carry float32 error ~1e-7 *
  ||factor||; the root inverse amplifies it by the condition number. With
  the default epsilon = 1e-12 a rank-deficient factor (a tall/wide gradient
  before enough steps, thin blocks) has a float32-noise null-space
  eigenvalue that the floor maps to exactly epsilon (root 1e3).
* SOAP: for a non-square parameter with both sides preconditioned, the
  longer side's factor at the first call is singular; the daemon's basis of
  its null space is float32 noise and the rest of the run depends on it.
  Only square shapes, or shapes whose longer side exceeds max_precond_dim
  (identity basis), are a function of the data. Eigenvector signs do not
  matter (the projected moments flip alike, and Householder QR's Q does not
  depend on the signs of its input's columns).
* Muon's ns_precision and ns_algorithm are validated but not emulated
  (Newton-Schulz runs the standard iteration in float64 here; the daemon's
  cpu backend runs fp32, bf16 is cuda-only; gram is the same polynomial).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence, Union

import numpy as np

__all__ = [
    "OPTIMIZERS",
    "DEFAULTS",
    "Rule",
    "make_rule",
    "parse_settings",
    "resolve_settings",
    "settings_text",
    "newton_schulz",
    "ns_coefficients",
]

SettingValue = Union[str, float, int, bool]

OPTIMIZERS = ("muon", "adamw", "shampoo", "soap")

# Defaults and key order of optimizer_config.h / FieldsOf (the order
# ConfigSettings prints them in).
DEFAULTS: dict[str, dict[str, object]] = {
    "muon": {
        "lr": 0.02,
        "momentum": 0.95,
        "nesterov": True,
        "ns_steps": 5,
        "ns_coefficients": "simple",
        "scale": "spectral",
        "weight_decay": 0.0,
        "eps": 1e-7,
        "ns_precision": "auto",
        "ns_algorithm": "auto",
    },
    "adamw": {
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.01,
    },
    "shampoo": {
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 1.0,
        "epsilon": 1e-12,
        "weight_decay": 0.0,
        "max_preconditioner_dim": 1024,
        "precondition_frequency": 1,
        "start_preconditioning_step": -1,
        "grafting": "adam",
        "grafting_beta2": 0.999,
        "grafting_epsilon": 1e-8,
    },
    "soap": {
        "lr": 3e-3,
        "beta1": 0.95,
        "beta2": 0.95,
        "shampoo_beta": -1.0,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "precondition_frequency": 10,
        "max_precond_dim": 10000,
        "normalize_grads": False,
        "correct_bias": True,
    },
}

# ---- settings ---------------------------------------------------------------


def _non_negative(x):
    return x >= 0


def _positive(x):
    return x > 0


def _unit(x):  # [0, 1)
    return 0 <= x < 1


def _open_closed_unit(x):  # (0, 1]
    return 0 < x <= 1


def _at_least_one(x):
    return x >= 1


# key -> (kind, check or enum values, range text), per optimizer; the same
# checks as optimizer_config.cc.
_FIELDS: dict[str, dict[str, tuple]] = {
    "muon": {
        "lr": ("float", _non_negative, ">= 0"),
        "momentum": ("float", _unit, "in [0, 1)"),
        "nesterov": ("bool", None, None),
        "ns_steps": ("int", _at_least_one, ">= 1"),
        "ns_coefficients": ("enum", ("simple", "quintic", "polar_express"), None),
        "scale": ("enum", ("spectral", "match_rms_adamw"), None),
        "weight_decay": ("float", _non_negative, ">= 0"),
        "eps": ("float", _positive, "> 0"),
        "ns_precision": ("enum", ("auto", "fp32", "bf16"), None),
        "ns_algorithm": ("enum", ("standard", "gram", "auto"), None),
    },
    "adamw": {
        "lr": ("float", _non_negative, ">= 0"),
        "beta1": ("float", _unit, "in [0, 1)"),
        "beta2": ("float", _unit, "in [0, 1)"),
        "eps": ("float", _positive, "> 0"),
        "weight_decay": ("float", _non_negative, ">= 0"),
    },
    "shampoo": {
        "lr": ("float", _non_negative, ">= 0"),
        "beta1": ("float", _unit, "in [0, 1)"),
        "beta2": ("float", _open_closed_unit, "in (0, 1]"),
        "epsilon": ("float", _positive, "> 0"),
        "weight_decay": ("float", _non_negative, ">= 0"),
        "max_preconditioner_dim": ("int", _at_least_one, ">= 1"),
        "precondition_frequency": ("int", _at_least_one, ">= 1"),
        "start_preconditioning_step": (
            "int",
            lambda x: x == -1 or x >= 1,
            "-1 or >= 1",
        ),
        "grafting": ("enum", ("adam", "adagrad", "none"), None),
        "grafting_beta2": ("float", _unit, "in [0, 1)"),
        "grafting_epsilon": ("float", _positive, "> 0"),
    },
    "soap": {
        "lr": ("float", _non_negative, ">= 0"),
        "beta1": ("float", _unit, "in [0, 1)"),
        "beta2": ("float", _unit, "in [0, 1)"),
        "shampoo_beta": (
            "float",
            lambda x: x == -1 or 0 <= x < 1,
            "-1 or in [0, 1)",
        ),
        "eps": ("float", _positive, "> 0"),
        "weight_decay": ("float", _non_negative, ">= 0"),
        "precondition_frequency": ("int", _at_least_one, ">= 1"),
        "max_precond_dim": ("int", _at_least_one, ">= 1"),
        "normalize_grads": ("bool", None, None),
        "correct_bias": ("bool", None, None),
    },
}


def _bad(key, value, expected):
    return ValueError(f'setting {key}: bad value "{value}" (expected {expected})')


def _parse_value(key: str, value: SettingValue, field: tuple):
    kind, check, range_text = field
    if kind == "bool":
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        lower = str(value).strip().lower()
        if lower in ("true", "1"):
            return True
        if lower in ("false", "0"):
            return False
        raise _bad(key, value, "true or false")
    if kind == "enum":
        text = str(value).strip()
        if text not in check:
            raise _bad(key, value, " | ".join(check))
        return text
    if kind == "int":
        if isinstance(value, (bool, np.bool_)):
            raise _bad(key, value, "an integer")
        if isinstance(value, (int, np.integer)):
            parsed = int(value)
        else:
            try:
                parsed = int(str(value).strip(), 10)
            except ValueError:
                raise _bad(key, value, "an integer") from None
    else:  # float
        if isinstance(value, (bool, np.bool_)):
            raise _bad(key, value, "a finite number")
        try:
            parsed = float(value if not isinstance(value, str) else value.strip())
        except ValueError:
            raise _bad(key, value, "a finite number") from None
        if not math.isfinite(parsed):
            raise _bad(key, value, "a finite number")
    if not check(parsed):
        raise _bad(key, value, range_text)
    return parsed


def parse_settings(text: str) -> dict[str, str]:
    """``"lr=0.02, momentum=0.9"`` -> ``{"lr": "0.02", "momentum": "0.9"}``.

    Same rules as ParseSettings: whitespace around keys and values is
    dropped, "" is {}, an item without '=', an empty key or value, or a key
    given twice is a ValueError.
    """
    out: dict[str, str] = {}
    if not text.strip():
        return out
    for item in text.split(","):
        item = item.strip()
        if "=" not in item:
            raise ValueError(f'settings: "{item}" is not key=value (in "{text}")')
        key, value = item.split("=", 1)
        key, value = key.strip(), value.strip()
        if not key:
            raise ValueError(f'settings: empty key in "{item}"')
        if not value:
            raise ValueError(f"setting {key}: empty value")
        if key in out:
            raise ValueError(f"setting {key}: given twice")
        out[key] = value
    return out


def resolve_settings(
    optimizer: str, settings: Mapping[str, SettingValue] | str | None = None
) -> dict[str, object]:
    """The defaults of `optimizer` with `settings` applied and validated
    (MakeOptimizerConfig): unknown keys and bad or out-of-range values are a
    ValueError naming the key. `settings` may also be "key=value,..." text.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f'optimizer: unknown value "{optimizer}" '
            "(expected muon, adamw, shampoo or soap)"
        )
    if settings is None:
        settings = {}
    if isinstance(settings, str):
        settings = parse_settings(settings)
    fields = _FIELDS[optimizer]
    config = dict(DEFAULTS[optimizer])
    for key, value in settings.items():
        if key not in fields:
            raise ValueError(
                f"setting {key}: unknown hyperparameter for {optimizer} "
                f"(known: {', '.join(fields)})"
            )
        config[key] = _parse_value(key, value, fields[key])
    return config


def _format_value(value: SettingValue) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (float, np.floating)):
        return repr(float(value))  # shortest round-tripping spelling
    return str(value)


def settings_text(settings: Mapping[str, SettingValue]) -> str:
    """The ``--set`` argument for `settings` ("key=value,..."; floats in
    their shortest round-tripping form, bools as true/false)."""
    return ",".join(f"{k}={_format_value(v)}" for k, v in settings.items())


# ---- Newton-Schulz ----------------------------------------------------------

_SIMPLE = (3.4445, -4.7750, 2.0315)
_QUINTIC = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
_POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def _f32(x: float) -> float:
    return float(np.float32(x))


def ns_coefficients(name: str, steps: int, as_float32: bool = True):
    """The (a, b, c) triples Muon runs for `steps` steps (NewtonSchulzSpecFor):
    simple repeats one triple, quintic cycles its five, polar_express repeats
    its last. The daemon stores them as float32; `as_float32` rounds them so.
    """
    if name == "simple":
        triples = [_SIMPLE] * steps
    elif name == "quintic":
        triples = [_QUINTIC[i % len(_QUINTIC)] for i in range(steps)]
    elif name == "polar_express":
        triples = [_POLAR_EXPRESS[min(i, len(_POLAR_EXPRESS) - 1)] for i in range(steps)]
    else:
        raise ValueError(f"unknown ns_coefficients {name!r}")
    if as_float32:
        triples = [tuple(_f32(c) for c in t) for t in triples]
    return [tuple(float(c) for c in t) for t in triples]


def newton_schulz(
    u: np.ndarray, coefficients: Sequence[Sequence[float]], norm_scale: float, norm_eps: float
) -> np.ndarray:
    """X = U / (norm_scale ||U||_F + norm_eps) on the wide orientation, then
    X <- a X + (b A + c A A) X with A = X X^T per triple."""
    u = np.asarray(u, dtype=np.float64)
    transpose = u.shape[0] > u.shape[1]
    x = u.T.copy() if transpose else u.copy()
    x = x / (norm_scale * np.linalg.norm(x) + norm_eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T.copy() if transpose else x


def _lerp(a: np.ndarray, b: np.ndarray, weight: float) -> np.ndarray:
    return a + weight * (b - a)


# ---- the rules --------------------------------------------------------------


class Rule:
    """One parameter's optimizer state; the reference of UpdateRule.

    optimizer: "muon" | "adamw" | "shampoo" | "soap".
    shape: the parameter's shape (2-D for all but adamw; dims >= 1).
    settings: hyperparameters as for canzonactl --set (values may be strings
      or Python numbers/bools; or one "key=value,..." string); unknown keys
      and bad values raise ValueError naming the key.

    step(param, grad, lr=None) updates the float64 array `param` in place;
    `lr` overrides the configured learning rate for that step (rounded to
    float32 as the daemon's StepOptions::lr is; finite and >= 0).

    State after steps: .t (the step count; SOAP's first call only builds the
    bases and does not count), and per optimizer .momentum (muon),
    .exp_avg/.exp_avg_sq (adamw; soap: exp_avg in the projected space),
    .blocks (shampoo: dicts with L, R, L_inv, R_inv, momentum, graft),
    .GL/.GR/.QL/.QR (soap; None for an identity side).
    """

    def __init__(
        self,
        optimizer: str,
        shape: Sequence[int],
        settings: Mapping[str, SettingValue] | str | None = None,
    ):
        self.optimizer = optimizer
        self.config = resolve_settings(optimizer, settings)
        # The parameter's shape; self.shape is what the rule steps: a matrix
        # rule steps (shape[0], product of the rest), as the daemon does.
        self.param_shape = tuple(int(d) for d in shape)
        self.shape = self.param_shape
        if any(d < 1 for d in self.shape):
            raise ValueError(f"{optimizer}: shape {list(self.shape)} has a dimension < 1")
        if optimizer != "adamw":
            # 2-D, or convolution filters (out, in, *kernel) as (out, in *
            # kernel); make_rule steps a 3-D shape as stacked matrices.
            if len(self.shape) not in (2, 4, 5):
                raise ValueError(
                    f"{optimizer} needs a matrix (2-D, 3-D stacked matrices, or "
                    f"4-D / 5-D convolution filters), got shape {list(self.shape)}"
                )
            self.shape = (self.shape[0], math.prod(self.shape[1:]))
        # The daemon's step counter (SOAP's first call does not count).
        self.t = 0
        getattr(self, f"_init_{optimizer}")()

    @property
    def lr(self) -> float:
        return float(self.config["lr"])

    def step(self, param: np.ndarray, grad: np.ndarray, lr: float | None = None) -> None:
        if not isinstance(param, np.ndarray) or param.dtype != np.float64:
            raise TypeError("param must be a float64 numpy array (updated in place)")
        if tuple(param.shape) != self.param_shape:
            raise ValueError(f"param shape {param.shape} != rule shape {self.param_shape}")
        if not param.flags.c_contiguous:
            raise TypeError("param must be C-contiguous (updated in place)")
        g = np.asarray(grad, dtype=np.float64)
        if tuple(g.shape) != self.param_shape:
            raise ValueError(f"grad shape {g.shape} != rule shape {self.param_shape}")
        param, g = param.reshape(self.shape), g.reshape(self.shape)
        if lr is None:
            lr = self.lr
        else:
            lr = float(np.float32(lr))
            if not (lr >= 0 and math.isfinite(lr)):
                raise ValueError(f"step: lr override must be finite and >= 0, got {lr}")
        getattr(self, f"_step_{self.optimizer}")(param, g, lr)

    # -- Muon (muon.cc) --------------------------------------------------------

    def _init_muon(self):
        c = self.config
        rows, cols = self.shape
        self.momentum = np.zeros(self.shape)
        if c["ns_coefficients"] == "polar_express":
            # Polar Express ignores eps: its own margin 1.02 and 1e-6.
            self.norm_scale, self.norm_eps = _f32(1.02), _f32(1e-6)
        else:
            self.norm_scale, self.norm_eps = 1.0, _f32(c["eps"])
        self.coefficients = ns_coefficients(c["ns_coefficients"], c["ns_steps"])
        # Rows and cols of the whole matrix.
        if c["scale"] == "spectral":
            self.scale = math.sqrt(max(1.0, rows / cols))
        else:  # match_rms_adamw
            self.scale = 0.2 * math.sqrt(max(rows, cols))

    def _step_muon(self, p, g, lr):
        c = self.config
        mu = c["momentum"]
        self.momentum = _lerp(self.momentum, g, 1.0 - mu)
        u = _lerp(g, self.momentum, mu) if c["nesterov"] else self.momentum
        self.t += 1
        x = newton_schulz(u, self.coefficients, self.norm_scale, self.norm_eps)
        p *= 1.0 - lr * c["weight_decay"]
        p -= lr * self.scale * x

    # -- AdamW (adamw.cc, CpuBackend::AdamWStep) ------------------------------

    def _init_adamw(self):
        self.exp_avg = np.zeros(self.shape)
        self.exp_avg_sq = np.zeros(self.shape)

    def _step_adamw(self, p, g, lr):
        c = self.config
        b1, b2 = c["beta1"], c["beta2"]
        self.t += 1
        t = self.t
        bc1 = 1.0 - b1**t
        bc2 = 1.0 - b2**t
        p *= 1.0 - lr * c["weight_decay"]
        self.exp_avg = _lerp(self.exp_avg, g, 1.0 - b1)
        self.exp_avg_sq = b2 * self.exp_avg_sq + (1.0 - b2) * g * g
        denom = np.sqrt(self.exp_avg_sq) / math.sqrt(bc2) + c["eps"]
        p -= (lr / bc1) * self.exp_avg / denom

    # -- Shampoo (shampoo.cc) ---------------------------------------------------

    def _init_shampoo(self):
        c = self.config
        rows, cols = self.shape
        dim = c["max_preconditioner_dim"]
        self.start = (
            c["precondition_frequency"]
            if c["start_preconditioning_step"] == -1
            else c["start_preconditioning_step"]
        )
        self.blocks = []
        # torch.split: full blocks, then the remainder; blocks row-major.
        for r0 in range(0, rows, dim):
            br = min(dim, rows - r0)
            for c0 in range(0, cols, dim):
                bc = min(dim, cols - c0)
                self.blocks.append(
                    {
                        "r0": r0,
                        "rows": br,
                        "c0": c0,
                        "cols": bc,
                        "L": np.zeros((br, br)),
                        "R": np.zeros((bc, bc)),
                        # Identities before the first root inverse.
                        "L_inv": np.eye(br),
                        "R_inv": np.eye(bc),
                        "momentum": np.zeros((br, bc)) if c["beta1"] != 0 else None,
                        "graft": np.zeros((br, bc)) if c["grafting"] != "none" else None,
                    }
                )

    def _root_inverse(self, factor, bc2):
        """Q diag(lam^(-1/4)) Q^T for (lam, Q) = eigh(factor / bc2 + eps I),
        all eigenvalues shifted so the smallest is eps when it is below."""
        eps = self.config["epsilon"]
        a = factor / bc2 + eps * np.eye(factor.shape[0])
        lam, q = np.linalg.eigh(a)
        mn = lam.min()
        if not math.isfinite(mn):
            raise FloatingPointError("shampoo: non-finite eigenvalue in a preconditioner factor")
        if mn < eps:
            lam = lam - mn + eps
        return (q * lam**-0.25) @ q.T

    def _step_shampoo(self, p, g_full, lr):
        c = self.config
        self.t += 1
        t = self.t
        beta1, beta2 = c["beta1"], c["beta2"]
        weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
        decay = 1.0 if beta2 == 1.0 else beta2
        bc2 = 1.0 - beta2**t if beta2 < 1.0 else 1.0
        start, freq = self.start, c["precondition_frequency"]
        precondition = (t % freq == 0 and t > start) or t == start
        bc1 = 1.0 - beta1**t if beta1 != 0 else 1.0
        grafting = c["grafting"]
        gb2 = c["grafting_beta2"]
        bcg = 1.0 - gb2**t if grafting == "adam" else 1.0
        direction = np.zeros(self.shape)
        for b in self.blocks:
            rs = slice(b["r0"], b["r0"] + b["rows"])
            cs = slice(b["c0"], b["c0"] + b["cols"])
            g = g_full[rs, cs]
            b["L"] = decay * b["L"] + weight * (g @ g.T)
            b["R"] = decay * b["R"] + weight * (g.T @ g)
            if grafting == "adam":
                b["graft"] = gb2 * b["graft"] + (1.0 - gb2) * g * g
            elif grafting == "adagrad":
                b["graft"] = b["graft"] + g * g
            if precondition:
                b["L_inv"] = self._root_inverse(b["L"], bc2)
                b["R_inv"] = self._root_inverse(b["R"], bc2)
            if b["momentum"] is not None:
                b["momentum"] = _lerp(b["momentum"], g, 1.0 - beta1)
                gh = b["momentum"] / bc1
            else:
                gh = g
            if grafting != "none":
                graft_dir = gh / (np.sqrt(b["graft"] / bcg) + c["grafting_epsilon"])
            if t < start:
                d = graft_dir if grafting != "none" else gh
            else:
                d = b["L_inv"] @ gh @ b["R_inv"]
                if grafting != "none":
                    d = d * (np.linalg.norm(graft_dir) / (np.linalg.norm(d) + 1e-16))
            direction[rs, cs] = d
        p *= 1.0 - lr * c["weight_decay"]
        p -= lr * direction

    # -- SOAP (soap.cc) -----------------------------------------------------------

    def _init_soap(self):
        c = self.config
        rows, cols = self.shape
        # A side longer than max_precond_dim keeps the identity basis.
        self.left = rows <= c["max_precond_dim"]
        self.right = cols <= c["max_precond_dim"]
        self.initialized = False
        self.exp_avg = np.zeros(self.shape)  # in the projected space
        self.exp_avg_sq = np.zeros(self.shape)
        self.GL = np.zeros((rows, rows)) if self.left else None
        self.GR = np.zeros((cols, cols)) if self.right else None
        self.QL = None
        self.QR = None

    def _soap_project(self, x):
        if self.left:
            x = self.QL.T @ x
        if self.right:
            x = x @ self.QR
        return x

    def _soap_project_back(self, x):
        if self.left:
            x = self.QL @ x
        if self.right:
            x = x @ self.QR.T
        return x

    def _soap_update_factors(self, g):
        c = self.config
        beta = c["beta2"] if c["shampoo_beta"] < 0 else c["shampoo_beta"]
        if self.left:
            self.GL = _lerp(self.GL, g @ g.T, 1.0 - beta)
        if self.right:
            self.GR = _lerp(self.GR, g.T @ g, 1.0 - beta)

    @staticmethod
    def _descending_eigenbasis(factor):
        # eigh(factor + 1e-30 I), columns reversed to descending eigenvalues.
        _, q = np.linalg.eigh(factor + 1e-30 * np.eye(factor.shape[0]))
        return q[:, ::-1].copy()

    def _soap_refresh(self, left):
        factor = self.GL if left else self.GR
        q = self.QL if left else self.QR
        gq = factor @ q
        est = np.einsum("ij,ij->j", q, gq)  # diag(Q^T GX Q)
        order = np.argsort(-est, kind="stable")
        if left:
            self.exp_avg_sq = self.exp_avg_sq[order, :]
        else:
            self.exp_avg_sq = self.exp_avg_sq[:, order]
        # Householder QR (LAPACK geqrf + orgqr, as the daemon). The result does
        # not depend on the signs of q's columns.
        q_new, _ = np.linalg.qr(gq[:, order])
        if left:
            self.QL = q_new
        else:
            self.QR = q_new

    def _step_soap(self, p, g, lr):
        c = self.config
        if not self.initialized:
            # First call: factors and bases from this gradient, no update.
            self._soap_update_factors(g)
            if self.left:
                self.QL = self._descending_eigenbasis(self.GL)
            if self.right:
                self.QR = self._descending_eigenbasis(self.GR)
            self.initialized = True
            return
        gp = self._soap_project(g)
        self.t += 1
        t = self.t
        b1, b2 = c["beta1"], c["beta2"]
        self.exp_avg = (1.0 - b1) * gp + b1 * self.exp_avg
        self.exp_avg_sq = b2 * self.exp_avg_sq + (1.0 - b2) * gp * gp
        alpha = lr
        if c["correct_bias"]:
            alpha = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        direction = self._soap_project_back(
            self.exp_avg / (np.sqrt(self.exp_avg_sq) + c["eps"])
        )
        if c["normalize_grads"]:
            alpha /= 1e-30 + math.sqrt(float(np.mean(direction * direction)))
        p -= alpha * direction
        if c["weight_decay"] > 0:
            p *= 1.0 - lr * c["weight_decay"]
        # Preconditioner update after the step; exp_avg is carried over to
        # the (possibly) new basis.
        self.exp_avg = self._soap_project_back(self.exp_avg)
        self._soap_update_factors(g)
        if t % c["precondition_frequency"] == 0:
            if self.left:
                self._soap_refresh(True)
            if self.right:
                self._soap_refresh(False)
        self.exp_avg = self._soap_project(self.exp_avg)


class StackedRule:
    """A matrix optimizer on a 3-D parameter (E, rows, cols), stacked
    experts: a Rule of its own for each matrix, as Keller Jordan's Muon
    steps a 3-D tensor batched over its first dimension."""

    def __init__(self, optimizer, shape, settings=None):
        self.shape = tuple(int(d) for d in shape)
        self.rules = [Rule(optimizer, self.shape[1:], settings) for _ in range(self.shape[0])]

    def step(self, param: np.ndarray, grad: np.ndarray, lr: float | None = None) -> None:
        if tuple(param.shape) != self.shape or tuple(np.shape(grad)) != self.shape:
            raise ValueError(f"param / grad shape != rule shape {self.shape}")
        for e, rule in enumerate(self.rules):
            rule.step(param[e], np.asarray(grad)[e], lr)


def make_rule(
    optimizer: str,
    shape: Sequence[int],
    settings: Mapping[str, SettingValue] | str | None = None,
) -> Rule | StackedRule:
    """Rule(optimizer, shape, settings); StackedRule for a matrix optimizer
    on a 3-D shape."""
    if optimizer != "adamw" and len(shape) == 3:
        return StackedRule(optimizer, shape, settings)
    return Rule(optimizer, shape, settings)
