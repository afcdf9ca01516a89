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
"""

import torch

# GradScaler's per-optimizer stages (torch.amp.grad_scaler.OptState, by
# value: 0 READY, 1 UNSCALED, 2 STEPPED), compared by value because the
# enum moved between torch versions.
_UNSCALED = 1


def _optimizer_state(optimizer, grad_scaler):
    return grad_scaler._per_optimizer_states[id(optimizer)]


def loss_scale_multiplier(optimizer, grad_scaler):
    """StepRequest.grad_scale for this step: 1 / scale, or 0 (none) without
    an enabled scaler or after ``scaler.unscale_(optimizer)`` (the
    gradients were unscaled in place, for clip_grad_norm_ say). Reading the
    scale waits for the current stream, as GradScaler's own skip check
    does."""
    if grad_scaler is None and torch.is_tensor(
            getattr(optimizer, "grad_scale", None)):
        # The protocol torch announces to replace grad_scaler=: a scale
        # and each rank's own found_inf as attributes, with no way to
        # hand the daemon's decision back to scaler.update().
        raise RuntimeError(
            "this torch's GradScaler set optimizer.grad_scale instead of "
            "passing grad_scaler= to step(); canzona.torch cannot give "
            "every rank the daemon's skip decision that way: use a torch "
            "whose GradScaler passes grad_scaler= to step(), or train in "
            "bfloat16")
    if grad_scaler is None or not grad_scaler.is_enabled():
        return 0.0
    state = _optimizer_state(optimizer, grad_scaler)
    if getattr(state["stage"], "value", state["stage"]) == _UNSCALED:
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
