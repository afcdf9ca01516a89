"""One trainer rank for tests/python/test_torch_*.py (started by
torch_test_util.run_ranks), run as its own process (RANK / WORLD_SIZE /
CANZONA_TARGET in the environment): trains the example decoder with a
canzona.torch optimizer and saves what the test compares.
"""

import argparse
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "examples"))

import train_torch  # noqa: E402  the example's model and data

import canzona.torch as ct  # noqa: E402


SHAMPOO_EPSILON = float(os.environ.get("TEST_SHAMPOO_EPSILON", "1e-5"))
SOAP_MAX_PRECOND_DIM = int(os.environ.get("TEST_SOAP_MAX_PRECOND_DIM", "32"))


def make(name, model, job_id, lr_settings, **extra):
    named = model.named_parameters()
    common = dict(job_id=job_id, **extra)
    if name == "muon":
        return ct.Muon(named, lr=0.02, adamw_lr=3e-3, adamw_weight_decay=0.01,
                       **common)
    if name == "shampoo":
        # epsilon well above float32 noise in the eigenvalues of a
        # rank-deficient early factor (tests/python/canzona_reference.py).
        return ct.Shampoo(named, lr=3e-3, precondition_frequency=2,
                          epsilon=SHAMPOO_EPSILON, adamw_lr=3e-3, **common)
    if name == "soap":
        # Sides longer than SOAP_MAX_PRECOND_DIM stay unrotated: a factor
        # that is singular at SOAP's first eigenbasis (the longer side of a
        # non-square gradient) makes the basis float32 noise.
        return ct.SOAP(named, lr=3e-3, precondition_frequency=2,
                       weight_decay=0.01, adamw_lr=3e-3,
                       soap_settings={"max_precond_dim": SOAP_MAX_PRECOND_DIM},
                       **common)
    raise ValueError(name)


# torch >= 2.3: torch.amp.GradScaler("cpu") with a CPU update().
CPU_SCALER = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")


# torch >= 2.0: GradScaler.step sets optimizer.grad_scale / found_inf
# (its attribute protocol) for a step() that does not name grad_scaler.
ATTRIBUTE_PROTOCOL_NATIVE = int(torch.__version__.split(".")[0]) >= 2


def make_scaler(init_scale, protocol="keyword"):
    """A GradScaler on the CPU: torch.amp.GradScaler("cpu") where torch has
    one (2.3+); torch 1.13's CUDA scaler otherwise, enabled by hand (its
    step() and per-optimizer state, what canzona.torch meets, do not care
    about the device). protocol "attributes" on torch 1.13, whose
    GradScaler always passes grad_scaler=: one whose step() is torch 2's
    attribute path (AttributeProtocolScaler)."""
    if CPU_SCALER:
        return torch.amp.GradScaler("cpu", init_scale=init_scale)
    import torch.cuda.amp.grad_scaler as cuda_scaler
    kind = cuda_scaler.GradScaler
    if protocol == "attributes" and not ATTRIBUTE_PROTOCOL_NATIVE:
        kind = attribute_protocol_scaler(cuda_scaler)
    cuda_missing = cuda_scaler.amp_definitely_not_available
    cuda_scaler.amp_definitely_not_available = lambda: False
    try:
        scaler = kind(init_scale=init_scale)
    finally:
        cuda_scaler.amp_definitely_not_available = cuda_missing
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    return scaler


def attribute_protocol_scaler(cuda_scaler):
    """torch 1.13's GradScaler with the step() torch >= 2.0 takes for an
    optimizer that supports amp scaling but whose step() does not name
    grad_scaler (behind Accelerate's wrapper, say): check this rank's
    gradients for infs in place (its fused check-and-unscale by 1, which
    torch 1.13 has no CPU kernel for), set optimizer.grad_scale and
    optimizer.found_inf, call step() without the scaler, then delete
    them."""
    OptState = cuda_scaler.OptState

    class AttributeProtocolScaler(cuda_scaler.GradScaler):
        def step(self, optimizer, *args, **kwargs):
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is OptState.READY:
                found = torch.zeros(1)
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            found += (~param.grad.isfinite()).any().float()
                            param.grad.mul_(1.0)
                state["found_inf_per_device"] = {found.device:
                                                 (found > 0).float()}
            optimizer.grad_scale = (None if state["stage"] is
                                    OptState.UNSCALED else self._scale)
            optimizer.found_inf = sum(state["found_inf_per_device"].values())
            retval = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            del optimizer.grad_scale
            del optimizer.found_inf
            return retval

    return AttributeProtocolScaler


def update_scale(scaler, found_inf):
    """scaler.update(); torch 1.13 has no CPU kernel for it, so there the
    backoff (the growth interval, 2000 steps, is never reached here) is
    passed as new_scale."""
    if CPU_SCALER:
        scaler.update()
    else:
        scale = scaler._scale.item()
        scaler.update(new_scale=scale * scaler.get_backoff_factor()
                      if found_inf else scale)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="muon")
    p.add_argument("--job-id", required=True)
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--last", type=int, default=20)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default=None,
                   help="torch.save file with model and optimizer state")
    p.add_argument("--load-model", default="first",
                   choices=["first", "after-construct", "last"],
                   help="--resume: when the model's weights load: before "
                        "constructing the optimizer, after it, or after "
                        "the optimizer's state")
    p.add_argument("--save", default=None,
                   help="after --last, torch.save model and optimizer here")
    p.add_argument("--halve-lr", action="store_true",
                   help="StepLR(step_size=1, gamma=0.5)")
    p.add_argument("--overlap", action="store_true",
                   help="module=model: GradReady hooks, async step, "
                        "WaitParams pre-hooks")
    p.add_argument("--bucket-size", type=int, default=0)
    p.add_argument("--shard-group-size", type=int, default=0)
    p.add_argument("--dtype", default="float32",
                   help="the model's dtype (bfloat16: mixed precision)")
    p.add_argument("--keep-fp32", default="",
                   help="parameters whose name contains this stay float32 "
                        "in a --dtype bfloat16 model")
    p.add_argument("--record-grads", action="store_true",
                   help="save each step's gradients (what the daemon got)")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip in the daemon (canzona.torch max_grad_norm)")
    p.add_argument("--model-zero-grad", action="store_true",
                   help="model.zero_grad() (.grad = None, as Hugging Face's "
                        "Trainer does) instead of opt.zero_grad()")
    p.add_argument("--grad-scaler", type=float, default=0.0,
                   help="> 0: loss scaling with torch.amp.GradScaler at this "
                        "initial scale (scaler.step(opt), scaler.update())")
    p.add_argument("--scaler-protocol", default="keyword",
                   choices=["keyword", "attributes"],
                   help="attributes: opt.step behind a wrapper of *args, "
                        "**kwargs, as Accelerate's fp16 puts it, so torch "
                        ">= 2.0's GradScaler sets found_inf instead of "
                        "passing grad_scaler=")
    p.add_argument("--inf-at", type=int, default=0,
                   help="rank 0's loss is multiplied by inf at this step "
                        "(its gradients alone are not finite)")
    p.add_argument("--clip-local", type=float, default=0.0,
                   help="> 0: torch.nn.utils.clip_grad_norm_ at this norm "
                        "between backward and step()")
    p.add_argument("--rebuild-at", type=int, default=0,
                   help="before this step: state_dict(), close(), and a new "
                        "optimizer on the same job_id= that loads it")
    p.add_argument("--ddp", default="",
                   help="wrap the model in DistributedDataParallel (gloo, "
                        "this rendezvous file), as Accelerate does on "
                        "several processes")
    p.add_argument("--synchronize", action="store_true",
                   help="opt.synchronize() after each step: with --overlap "
                        "the deltas then hold every bucket's update")
    args = p.parse_args()
    torch.set_num_threads(1)
    caught = []  # canzona's warnings, as shown; the others are printed
    print_warning = warnings.showwarning

    def show(message, category, *rest, **kwrest):
        if str(message).startswith("canzona"):
            caught.append("%s: %s" % (category.__name__, message))
        else:
            print_warning(message, category, *rest, **kwrest)
    warnings.showwarning = show
    rank = int(os.environ.get("RANK", "0"))

    model = train_torch.build_model(seed=0).to(getattr(torch, args.dtype))
    for name, q in model.named_parameters():
        if args.keep_fp32 and args.keep_fp32 in name:
            q.data = q.data.float()
    if args.resume:
        saved = torch.load(args.resume)
        if args.load_model == "first":
            model.load_state_dict(saved["model"])
    net = model
    if args.ddp:
        torch.distributed.init_process_group(
            "gloo", init_method="file://" + args.ddp, rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]))
        net = torch.nn.parallel.DistributedDataParallel(model)
    extra = dict(bucket_size=args.bucket_size,
                 shard_group_size=args.shard_group_size,
                 max_grad_norm=args.max_grad_norm)
    if args.overlap:
        extra["module"] = model
    opt = make(args.optimizer, model, args.job_id, None, **extra)
    # Counts the bucket events the hooks send (the test asserts overlap
    # really happened).
    events = {"grad_ready": 0, "wait_params": 0}
    for name in events:
        real = getattr(opt.client, name)

        def counted(*a, _real=real, _name=name, **k):
            events[_name] += 1
            return _real(*a, **k)
        setattr(opt.client, name, counted)
    if args.resume:
        if args.load_model == "after-construct":
            model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if args.load_model == "last":
            model.load_state_dict(saved["model"])
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
             if args.halve_lr else None)
    scaler = (make_scaler(args.grad_scaler, args.scaler_protocol)
              if args.grad_scaler > 0 else None)
    scaling = []  # (the scale the step used, found_inf) per step
    losses = []
    deltas = []
    grads = []
    clipping = []  # (pre-clip norm, factor) per step
    job_ids = [opt.job_id]
    for step in range(args.first, args.last + 1):
        if step == args.rebuild_at:
            state = opt.state_dict()
            opt.close()
            opt = make(args.optimizer, model, args.job_id, None, **extra)
            opt.load_state_dict(state)
            job_ids.append(opt.job_id)
        loss = train_torch.loss_fn(net, step, rank)
        scaled = loss
        if scaler is not None:
            # scaler.scale(loss) as on a GPU (torch 1.13's asserts CUDA).
            scaled = loss * scaler._scale
        if step == args.inf_at and rank == 0:
            # The backward itself overflows (not an edit after it, which
            # module= refuses).
            scaled = scaled * float("inf")
        scaled.backward()
        if args.clip_local > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_local)
        if args.record_grads:
            grads.append({n: q.grad.detach().clone()
                          for n, q in model.named_parameters()})
        before = {n: q.detach().clone() for n, q in model.named_parameters()}
        if scaler is None:
            opt.step()
        else:
            used = scaler._scale.item()
            if args.scaler_protocol == "attributes":
                # Accelerate's AcceleratedOptimizer.step under fp16.
                original = opt.step
                opt.step = lambda *a, **k: original(*a, **k)
                try:
                    scaler.step(opt)
                finally:
                    opt.step = original
            else:
                scaler.step(opt)
            found_inf = sum(t.item() for t in scaler._per_optimizer_states[
                id(opt)]["found_inf_per_device"].values())
            scaling.append((used, found_inf))
            update_scale(scaler, found_inf)
        if args.synchronize:
            opt.synchronize()
        clipping.append((opt.last_step["grad_norm"],
                         opt.last_step["clip_factor"]))
        deltas.append({n: (q.detach() - before[n]).norm().item()
                       for n, q in model.named_parameters()})
        if args.model_zero_grad:
            model.zero_grad(set_to_none=True)
        else:
            opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    opt.synchronize()
    if args.save:
        torch.save({"model": model.state_dict(),
                    "optimizer": opt.state_dict()}, args.save)
    torch.save({"losses": losses, "deltas": deltas, "grads": grads,
                "clipping": clipping, "scaling": scaling,
                "params": {n: q.detach().clone()
                           for n, q in model.named_parameters()},
                "lrs": [g["lr"] for g in opt.param_groups],
                "buckets": len(opt.registered["buckets"]),
                "events": events,
                "warnings": caught,
                "job_ids": job_ids,
                "transport": opt.client.transport,
                # Every tensor the optimizer hands torch: the model's dtype.
                "dtypes": sorted({str(q.dtype) for q in model.parameters()} |
                                 {str(q.grad.dtype) for q in model.parameters()
                                  if q.grad is not None} |
                                 {str(opt.dtype or "mixed")}),
                # Each parameter's and its gradient's dtype, by name.
                "param_dtypes": {n: (str(q.dtype),
                                     str(getattr(q.grad, "dtype", None)))
                                 for n, q in model.named_parameters()},
                "comm": [opt.last_step["seconds"]["dp_comm"],
                         opt.last_step["seconds"]["dp_comm_exposed"]]},
               args.out)
    opt.close()


if __name__ == "__main__":
    main()
