"""torch.amp.GradScaler with canzona.torch: the loss scale is undone in the
daemon, and every rank reports the daemon's one skip decision.

GradScaler's default path unscales each rank's gradients in place and skips
``optimizer.step()`` where *that rank* saw an inf or NaN. Under DDP the
gradients were all-reduced first, so every rank decides alike; here the
daemon reduces them inside step(), so a rank whose local gradients
overflowed would skip step() while the others wait for it in the daemon,
and the ranks' scales would part. So the optimizer declares
``_step_supports_amp_scaling`` and GradScaler hands itself to step()
(``grad_scaler=``): step() passes 1 / scale as StepRequest.grad_scale (the
daemon multiplies the reduced gradients by it in fp32), and afterwards
records the daemon's ``skipped_nonfinite``, the same on every rank, as
this optimizer's found_inf, which ``scaler.update()`` reads.

torch >= 2.0 hands itself that way only to a step() whose signature names
``grad_scaler``. Behind a wrapper of ``*args, **kwargs`` (Hugging Face
Accelerate's AcceleratedOptimizer replaces step() with one under fp16:
``Trainer(fp16=True)``, diffusers' training scripts) it takes its
announced attribute protocol instead: it checks this rank's gradients for
infs itself, sets ``optimizer.grad_scale`` and ``optimizer.found_inf``,
and calls step() without the scaler. Those attributes cannot carry the
daemon's decision back to ``scaler.update()``, so step() finds the scaler
in the frame that set them and goes on as with ``grad_scaler=``.
"""

import sys
import warnings

import torch

# GradScaler's per-optimizer stages (torch.amp.grad_scaler.OptState, by
# value: 0 READY, 1 UNSCALED, 2 STEPPED), compared by value because the
# enum moved between torch versions.
_UNSCALED = 1

# How far up the stack GradScaler.step may be from step(): torch.optim's
# profiling wrapper, no_grad and Accelerate's patched step stand between.
_SCALER_FRAMES = 16


def hide_grad_scaler_future_warning():
    """torch >= 2.0 warns at scaler.step(opt), for an optimizer whose
    step() takes grad_scaler=, that a later torch will use the attribute
    protocol instead. The warning is for the optimizer's authors, and this
    one takes both; shown to users it would only alarm them. Called by
    each optimizer's constructor rather than at import, which a
    ``warnings.catch_warnings()`` around it would undo (the same filter
    added again replaces itself)."""
    warnings.filterwarnings(
        "ignore", message="GradScaler is going to stop passing itself",
        category=FutureWarning)


def _optimizer_state(optimizer, grad_scaler):
    return grad_scaler._per_optimizer_states[id(optimizer)]


def _stage(optimizer, grad_scaler):
    stage = _optimizer_state(optimizer, grad_scaler)["stage"]
    return getattr(stage, "value", stage)


def scaler_of_step(optimizer, grad_scaler):
    """(the GradScaler of this step or None, whether it rewrote this
    rank's gradients in place). The scaler is ``grad_scaler=``, or under
    torch's attribute protocol the GradScaler.step up the stack that set
    ``optimizer.found_inf``. In that protocol GradScaler checked the
    gradients itself first unless ``unscale_`` had: an in-place multiply
    by 1 that moves their version counter and changes no value."""
    if grad_scaler is not None or not torch.is_tensor(
            getattr(optimizer, "found_inf", None)):
        return grad_scaler, False
    frame = sys._getframe(1)
    for _ in range(_SCALER_FRAMES):
        if frame is None:
            break
        caller = frame.f_locals
        states = getattr(caller.get("self"), "_per_optimizer_states", None)
        if (caller.get("optimizer") is optimizer
                and isinstance(states, dict) and id(optimizer) in states):
            scaler = caller["self"]
            return scaler, _stage(optimizer, scaler) != _UNSCALED
        frame = frame.f_back
    raise RuntimeError(
        "optimizer.found_inf is set (torch's GradScaler attribute "
        "protocol) but no GradScaler.step(optimizer) calls this step(): "
        "canzona.torch cannot give every rank the daemon's skip decision "
        "that way. Call scaler.step(opt) on this optimizer, or train in "
        "bfloat16")


def loss_scale_multiplier(optimizer, grad_scaler):
    """StepRequest.grad_scale for this step: 1 / scale, or 0 (none) without
    an enabled scaler or after ``scaler.unscale_(optimizer)`` (the
    gradients were unscaled in place, for clip_grad_norm_ say). Reading the
    scale waits for the current stream, as GradScaler's own skip check
    does."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return 0.0
    if _stage(optimizer, grad_scaler) == _UNSCALED:
        return 0.0
    scale = grad_scaler._scale
    if scale is None:
        raise RuntimeError(
            "grad_scaler: the scaler has no scale yet; call "
            "scaler.scale(loss).backward() before scaler.step(optimizer)")
    # In double, as GradScaler.unscale_ takes its reciprocal.
    return 1.0 / scale.double().item()


def report_found_inf(optimizer, grad_scaler, skipped):
    """Records the daemon's decision as this optimizer's found_inf (one
    entry, on the scale's device), replacing any local check of
    ``unscale_``: ranks that saw different local overflows still back off
    their scales alike."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return
    scale = grad_scaler._scale
    state = _optimizer_state(optimizer, grad_scaler)
    state["found_inf_per_device"] = {
        scale.device: torch.full((1,), 1.0 if skipped else 0.0,
                                 dtype=torch.float32, device=scale.device)}
