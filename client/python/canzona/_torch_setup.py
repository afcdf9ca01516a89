"""What canzona.torch.Optimizer's arguments become before it registers:
the groups and their settings, each parameter's group, the (pp, dp, tp)
layout, the one device, each parameter's place in the buffer,
the job id and rank every process agrees on."""

import collections
import numbers
import os
import uuid

import torch


# Hyperparameters each optimizer accepts (the daemon's `--set` keys).
_SETTINGS = {
    "muon": {"lr", "momentum", "nesterov", "ns_steps", "ns_coefficients",
             "scale", "weight_decay", "eps", "ns_precision", "ns_algorithm"},
    "adamw": {"lr", "beta1", "beta2", "eps", "weight_decay"},
    "shampoo": {"lr", "beta1", "beta2", "epsilon", "weight_decay",
                "max_preconditioner_dim", "precondition_frequency",
                "start_preconditioning_step", "grafting", "grafting_beta2",
                "grafting_epsilon"},
    "soap": {"lr", "beta1", "beta2", "eps", "weight_decay",
             "precondition_frequency", "max_precond_dim",
             "shampoo_beta", "normalize_grads", "correct_bias"},
}

# The settings a step may change (StepRequest.settings, the daemon's
# ScheduledSettingNames); every other one is fixed at Register.
_SCHEDULED = {
    "muon": ("momentum", "weight_decay"),
    "adamw": ("beta1", "beta2", "eps", "weight_decay"),
    "shampoo": ("beta1", "beta2", "epsilon", "weight_decay"),
    "soap": ("beta1", "beta2", "eps", "weight_decay"),
}


def _number(value, where):
    """A setting's value as the float the daemon takes: a Python or numpy
    number, or a one-element tensor (torch.optim takes a Tensor lr);
    anything else is a ValueError naming ``where``."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError("%s: %r is not a number" % (where, value))
    return float(value)


def _pair(value, where):
    """``betas`` as (beta1, beta2); anything else is a ValueError naming
    ``where``."""
    try:
        first, second = value
    except (TypeError, ValueError):
        raise ValueError("%s: %r is not a pair (beta1, beta2)"
                         % (where, value)) from None
    return first, second


def _torch_spelling(settings):
    """``settings`` (daemon keys) as torch.optim's param_groups spell them:
    beta1 and beta2 as one ``betas`` pair where both are set, which is what
    schedules that cycle momentum (OneCycleLR, CyclicLR) and user code
    written for torch.optim.AdamW change."""
    spelled = dict(settings)
    if "beta1" in spelled and "beta2" in spelled:
        spelled["betas"] = (spelled.pop("beta1"), spelled.pop("beta2"))
    return spelled


def _daemon_spelling(name, group):
    """A param_group's settings under the daemon's keys: ``betas`` split
    into beta1 and beta2 (ValueError naming the group for a malformed pair,
    or one set beside beta1 / beta2, where which one holds is unclear)."""
    values = dict(group)
    if "betas" in values:
        betas = values.pop("betas")
        if "beta1" in values or "beta2" in values:
            raise ValueError(
                "param_groups[%r]: both 'betas' and 'beta1'/'beta2' are set; "
                "change 'betas' (torch's spelling) alone" % name)
        try:
            values["beta1"], values["beta2"] = betas
        except (TypeError, ValueError):
            raise ValueError("param_groups[%r]['betas']: %r is not a pair "
                             "(beta1, beta2)" % (name, betas)) from None
    return values


# torch.optim.Muon's arguments that name a daemon setting another way:
# adjust_lr_fn's values as the daemon's `scale`, and its default
# ns_coefficients triple (also Keller Jordan's), the daemon's `simple`.
_MUON_SCALES = {"original": "spectral", "match_rms_adamw": "match_rms_adamw"}
_TORCH_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
_NS_COEFFICIENT_NAMES = ("simple", "quintic", "polar_express")


def _given(**settings):
    """The keyword settings a caller gave (None: the daemon's default)."""
    return {k: v for k, v in settings.items() if v is not None}


def _torch_muon_settings(ns_coefficients, eps, adjust_lr_fn):
    """The daemon's settings for torch.optim.Muon's ns_coefficients, eps
    and adjust_lr_fn (None: the daemon's default, which is torch's)."""
    settings = _given(eps=eps)
    if adjust_lr_fn is not None:
        if adjust_lr_fn not in _MUON_SCALES:
            raise ValueError("adjust_lr_fn: %r is not one of %s"
                             % (adjust_lr_fn, sorted(_MUON_SCALES)))
        settings["scale"] = _MUON_SCALES[adjust_lr_fn]
    if ns_coefficients is not None:
        if isinstance(ns_coefficients, str):
            name = ns_coefficients
        elif tuple(ns_coefficients) == _TORCH_NS_COEFFICIENTS:
            name = "simple"
        else:
            name = None
        if name not in _NS_COEFFICIENT_NAMES:
            raise ValueError(
                "ns_coefficients: %r: the daemon runs the named sets %s "
                "(simple is torch.optim.Muon's default %r)"
                % (ns_coefficients, ", ".join(_NS_COEFFICIENT_NAMES),
                   _TORCH_NS_COEFFICIENTS))
        settings["ns_coefficients"] = name
    return settings


def _scheduled_settings(param_groups, groups):
    """{group: {key: value}} of the daemon's settings a schedule changed in
    ``param_groups`` since construction (``groups``: _parse_groups'), for
    StepRequest.settings. A changed setting the daemon fixes at Register is
    a ValueError naming it; keys that are no setting of the daemon's
    (``initial_lr`` and the like, which schedulers add) are left alone."""
    settings = {}
    for group in param_groups:
        name = group["name"]
        kind, registered = groups[name]
        changed = {}
        for key, value in _daemon_spelling(name, group).items():
            if key == "lr" or key not in _SETTINGS[kind]:
                continue
            if key in registered and registered[key] == value:
                continue
            shown = "betas" if key in ("beta1", "beta2") and \
                "betas" in group else key
            if key not in _SCHEDULED[kind]:
                raise ValueError(
                    "param_groups[%r][%r]: changed to %r after construction, "
                    "but %s fixes it at registration (a step may change %s; "
                    "construct a new optimizer for the others)"
                    % (name, shown, group[shown], kind,
                       ", ".join(_SCHEDULED[kind])))
            if kind == "shampoo" and key == "beta1" and value != 0 and \
                    registered.get("beta1") == 0:
                raise ValueError(
                    "param_groups[%r][%r]: beta1 %r, but shampoo registered "
                    "with beta1 0 keeps no momentum to schedule (construct "
                    "with beta1 > 0)" % (name, shown, value))
            changed[key] = _number(value, "param_groups[%r][%r]"
                                   % (name, shown))
        if changed:
            settings[group["name"]] = changed
    return settings


# Names that mark embeddings, output heads and MoE routers: AdamW by
# convention even when 2-D; so is a Mamba layer's state matrix A_log
# (Mamba's and Jamba's are 2-D, (inner, state)).
_ADAMW_NAME_PARTS = ("embed", "wte", "wpe", "lm_head", "output_layer",
                     "router", "a_log")
# Modules that are MoE routers by their own name: Mixtral's, PhiMoE's and
# MiniMax's block_sparse_moe.gate, Qwen-MoE's and DeepSeek's mlp.gate,
# Qwen2-MoE's shared_expert_gate; a router's (experts, hidden) weight is
# wide, where a GLU's gate (gate_proj or w1 mostly; "gate" in some
# models) is (ffn, hidden), tall.
_ROUTER_MODULES = ("gate", "shared_expert_gate")

# Where the gradients' half of the buffer starts: a multiple of this many
# bytes (vector loads and the widest element).
_HALF_ALIGNMENT = 64

# The parameter dtypes the daemon takes, by canzona.Client's names.
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}


def default_route(name, param, matrix_group):
    """2-D hidden weights and 3-D stacked experts (a name with "expert":
    (E, rows, cols), as recent Hugging Face MoE models fuse them, stepped
    as E matrices) -> ``matrix_group``; embeddings, lm_head, routers,
    biases (2-D ones too: one per expert) and every other tensor that is
    not 2-D -> "adamw". Convolution filters too (a patch embedding or a
    depthwise kernel is no hidden matrix): route the ones that are (a
    ResNet's) to the matrix optimizer by name, which steps Conv2d / Conv3d
    filters as the matrices (out, in * kernel). Experts split over tensor
    parallelism stay in AdamW (the daemon steps a stack whole)."""
    lowered = name.lower()
    if lowered.endswith("bias"):  # GPT-OSS's experts.gate_up_proj_bias
        return "adamw"            # is 2-D: a bias per expert
    if (param.dim() == 3 and "expert" in lowered
            and not getattr(param, "tensor_model_parallel", False)):
        return matrix_group
    if param.dim() != 2:
        return "adamw"
    if any(part in lowered for part in _ADAMW_NAME_PARTS):
        return "adamw"
    module = lowered.split(".")[-2] if "." in lowered else ""
    if module in _ROUTER_MODULES and param.shape[0] < param.shape[1]:
        return "adamw"
    return matrix_group


def _setting_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _world():
    """(global rank, world size) from torch.distributed or the environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


# The optimizers this process constructed on each job id.
_CONSTRUCTED = collections.Counter()


def _job_id(job_id):
    """The job id of the optimizer under construction, which every rank
    agrees on: job_id=, $CANZONA_JOB_ID, torchrun's run id, or one rank 0
    broadcasts; the n-th optimizer this process constructs on that id (n >
    1) registers as "<id>-<n>", a job of its own. Every rank constructs its
    optimizers in the same order, so they agree on n without a word. The
    same id again would meet the earlier job: still open (two models, two
    optimizers), or closed here but not yet on every rank (close() does not
    wait for the others), which the daemons refuse."""
    base = _base_job_id(job_id)
    _CONSTRUCTED[base] += 1
    n = _CONSTRUCTED[base]
    if n == 1:
        return base
    suffix = "-%d" % n
    return base[:64 - len(suffix)] + suffix


def _base_job_id(job_id):
    if job_id:
        return job_id
    if os.environ.get("CANZONA_JOB_ID"):
        return os.environ["CANZONA_JOB_ID"]
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return "torch-" + "".join(c if c.isalnum() or c in "_-" else "-"
                                  for c in run)[:58]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = ["torch-" + uuid.uuid4().hex[:16]]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("job_id: pass one (or set CANZONA_JOB_ID) when "
                         "torch.distributed is not initialized")
    return "torch-%d" % os.getpid()


def _parse_groups(groups):
    """{group name: (optimizer kind, settings)} from Optimizer's ``groups``,
    ``betas`` split into the daemon's beta1 and beta2."""
    if not groups:
        raise ValueError("groups: at least one group is needed")
    parsed = {}
    for gname, spec in groups.items():
        spec = dict(spec)
        kind = spec.pop("optimizer", None)
        if kind not in _SETTINGS:
            raise ValueError("groups[%r].optimizer: %r is not one of %s"
                             % (gname, kind, sorted(_SETTINGS)))
        if "betas" in spec:
            spec["beta1"], spec["beta2"] = _pair(
                spec.pop("betas"), "groups[%r]['betas']" % gname)
        unknown = set(spec) - _SETTINGS[kind]
        if unknown:
            raise ValueError("groups[%r]: unknown settings %s for %s"
                             % (gname, sorted(unknown), kind))
        # What schedules read and write: numbers, as in torch.optim.
        for key in ("lr",) + _SCHEDULED[kind]:
            if key in spec:
                spec[key] = _number(spec[key],
                                    "groups[%r][%r]" % (gname, key))
        parsed[gname] = (kind, spec)
    return parsed


def _route_function(route, groups):
    """Optimizer's ``route`` as a callable (name, param) -> group."""
    if route is None:
        if len(groups) != 1:
            raise ValueError("route: needed with several groups")
        only = next(iter(groups))
        return lambda name, param: only
    if callable(route):
        return route
    return lambda name, param: route[name]


def _resolve_layout(layout, tp_size, world):
    """(pp, dp, tp) from Optimizer's ``layout`` and ``tp_size``, checked
    against the world size."""
    if layout is None:
        if world % tp_size:
            raise ValueError("tp_size %d does not divide the world size %d"
                             % (tp_size, world))
        layout = (1, world // tp_size, tp_size)
    elif isinstance(layout, dict):
        layout = (layout.get("pp", 1), layout["dp"], layout.get("tp", 1))
    layout = tuple(int(x) for x in layout)
    pp, dp, tp = layout
    if pp * dp * tp != world:
        raise ValueError("layout %s has %d ranks, the world has %d"
                         % (layout, pp * dp * tp, world))
    return layout


def _device_of(named):
    """The one device of every parameter, each in a dtype the daemon takes:
    float32, or bfloat16 / float16 (mixed precision: the daemon keeps the
    fp32 master weights and state; this process keeps no fp32 copy). The
    dtypes may differ per parameter (a bf16 model keeping its norms in
    fp32, as Hugging Face's _keep_in_fp32_modules does)."""
    for name, param in named:
        if param.device.type not in ("cpu", "cuda"):
            raise ValueError(
                "parameter %r is on %s: the daemon maps host shared "
                "memory or CUDA IPC device memory" % (name, param.device))
        if param.dtype not in _DTYPE_NAMES:
            raise ValueError("parameter %r is %s: the daemon takes float32, "
                             "bfloat16 or float16" % (name, param.dtype))
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise ValueError("parameters are on %s: one device per optimizer"
                         % sorted(str(d) for d in devices))
    return devices.pop()


class _Entry:
    """One parameter's place in the buffer (``offset``: bytes into either
    half) and what Register says of it."""

    __slots__ = ("name", "param", "group", "split", "shape", "offset")

    def __init__(self, name, param, group, split, shape):
        self.name, self.param, self.group = name, param, group
        self.split, self.shape, self.offset = split, shape, 0


def _buffer_entries(named, route_fn, groups, tp_split, tp):
    """Each parameter's entry, and the bytes of the parameters' half of
    the buffer. Every parameter and gradient lives in one buffer: the
    parameters, then the gradients, each in reverse order: the order
    backward fills the daemon's buckets in (as Megatron's grad buffer), so
    its collectives work on this buffer in place. Each starts aligned to
    its own element size, which leaves no gap between parameters of one
    dtype (the daemon's runs are unbroken); the gradients' half starts at
    a multiple of _HALF_ALIGNMENT. Each takes its values in row-major
    order, as the daemon reads them: a channels_last convolution's filters
    become contiguous (its convolutions still run channels_last where their
    input is), and a matrix optimizer steps them as (out, in * kernel)
    whatever their memory format was."""
    entries = []
    for name, param in named:
        group = route_fn(name, param)
        if group not in groups:
            raise ValueError("route: parameter %r -> unknown group %r"
                             % (name, group))
        split = tp_split.get(name)
        if split is None:
            split = (getattr(param, "partition_dim", -1)
                     if getattr(param, "tensor_model_parallel", False)
                     else -1)
        shape = list(param.shape)
        if split >= 0:
            shape[split] *= tp
        entries.append(_Entry(name, param, group, split, shape))
    at = 0
    for entry in reversed(entries):
        unit = entry.param.element_size()
        at += -at % unit
        entry.offset = at
        at += entry.param.numel() * unit
    return entries, at + -at % _HALF_ALIGNMENT
