"""torch.optim-compatible optimizers whose state and step live in canzonad.

    import canzona.torch
    model = Model()
    opt = canzona.torch.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for batch in data:
        loss = model(batch).mean()
        loss.backward()            # gradients land in daemon-shared memory
        opt.step()                 # the daemons run the distributed step
        opt.zero_grad()            # zeroes the shared gradients in place
        sched.step()

At construction every parameter's storage moves into a shared-memory buffer
the daemon maps (``param.data`` becomes a view of it), and ``param.grad`` is
set to a view of a shared gradient buffer that backward accumulates into, so
a step copies nothing. Rank coordinates come from torch.distributed (or
RANK / WORLD_SIZE and ``tp_size``), the daemon address from ``target`` or
$CANZONA_TARGET. Gradients are averaged over data-parallel ranks by the
daemons: do not all-reduce them in the trainer (no DDP wrapper).

Overlap (AsyncHZP): pass the model as ``module=`` and the optimizer hooks
it. As backward finishes a gradient bucket (every parameter's gradient
accumulated), a hook tells the daemon (GradReady) and its communication
thread starts that bucket's reduce-scatter while backward goes on; step()
then waits only for what is left, and returns before the parameter
all-gathers end. Forward pre-hooks wait (WaitParams) for just the buckets
each module needs, ahead of its other pre-hooks (weight_norm's); the
model's forward waits first for those of modules its last training
forward did not call (a fused loss reading lm_head.weight). Results are
bitwise those of the plain step. Use ``with opt.no_sync():`` around the
backward of every micro-batch but the last when accumulating gradients,
and ``opt.synchronize()`` before reading parameters outside a forward.

GPU models: parameters on one CUDA device move into one device buffer
instead, exported to the daemon with CUDA IPC (the daemon must run on the
same node with ``--backend cuda``; with ``--comm nccl`` the whole step stays
in GPU memory). Before each GradReady / Step the optimizer records an
interprocess event on the current stream; the daemon's streams wait for it,
so no host synchronization is needed after backward. With ``--comm nccl``
the daemon also answers Step / WaitParams without waiting for its GPU
work: it records one interprocess event per bucket after writing the
bucket's parameters, and the current stream waits for those, so step()
returns while the update still runs, as torch.optim's does.

Mixed precision: a bfloat16 or float16 model (some parameters may stay
float32, as norms kept in fp32 do) keeps each parameter and its gradient
in its dtype; the daemon keeps the fp32 master weights and optimizer state
of what each rank owns, updates them in fp32 and rounds the new parameters
once (round to nearest even). This process keeps no fp32 copy.
state_dict() / checkpoints carry the masters. A non-finite gradient
(float16 overflow) makes every rank skip the step.
Dynamic loss scaling: ``scaler.step(opt)`` with torch.amp.GradScaler hands
the daemon the scale to undo (in fp32, after the reduction) and gives every
rank the daemon's one skip decision, so the ranks' scales stay equal.

Thread-safety: like torch.optim optimizers, one per trainer thread.
"""

import atexit
import inspect
import os
import time
import weakref

import torch

import canzona
from canzona import CanzonaError
from canzona._torch_amp import (
    hide_grad_scaler_future_warning, loss_scale_multiplier, report_found_inf,
    scaler_of_step)
from canzona._torch_state import _State
from canzona._torch_step_checks import _StepChecks
from canzona._torch_overlap import _Overlap, _holds_view, _into_view
from canzona._torch_params import parameters_argument
from canzona._torch_setup import (
    _DTYPE_NAMES, _buffer_entries, _device_of, _given, _job_id, _number,
    _pair, _parse_groups, _resolve_layout, _route_function,
    _scheduled_settings, _setting_value, _torch_muon_settings,
    _torch_spelling, _world, default_route)
from canzona._warn import warn

__all__ = ["Optimizer", "Muon", "Shampoo", "SOAP", "default_route",
           "CanzonaError"]


# The codes of a call to a daemon that exited (UNAVAILABLE) or restarted
# without the job (NOT_FOUND).
_DAEMON_LOST = ("UNAVAILABLE", "NOT_FOUND")


def _join_streams(current, streams):
    """Makes stream ``current`` wait on the device for each other stream
    of ``streams``, so that one event recorded on ``current`` covers the
    work already queued on all of them."""
    for stream in streams:
        if stream != current:
            current.wait_stream(stream)


class Optimizer(_Overlap, _StepChecks, _State, torch.optim.Optimizer):
    """A torch.optim.Optimizer whose state lives in canzonad.

    Args:
      named_parameters: iterable of (name, parameter); names must be the
        same on every rank of a pipeline stage. Those that do not require
        grad are left out (torch.optim would skip them for want of a
        gradient); step() refuses to run once one of them requires it.
        Also torch.optim's forms: parameters (named after ``module=``), or
        param group dicts, each one group with its own settings (torch's
        spelling), its "optimizer" and optional "name"; ``groups`` and
        ``route`` are then not given (canzona/_torch_params.py).
      groups: {group name: {"optimizer": "muon"|"adamw"|"shampoo"|"soap",
        "lr": ..., other daemon settings}}. Each becomes one param_group;
        a schedule may change its "lr" and, like torch.optim's, other
        settings between steps (Muon's momentum warm-up): muon momentum and
        weight_decay; adamw, soap and shampoo "betas" (param_groups spell
        beta1 and beta2 as torch.optim.AdamW does; shampoo's beta1 only
        where constructed > 0) and weight_decay; adamw and soap eps,
        shampoo epsilon. step() raises ValueError for a change to any other
        setting, which the daemon fixes at registration. ``defaults`` is
        the first group's settings (what OneCycleLR and CyclicLR read to
        cycle "momentum" or "betas").
      route: group of each parameter: a callable (name, param) -> group, a
        dict {name: group}, or None (the only group).
      layout: (pp, dp, tp) or {"pp":, "dp":, "tp":}; default: pp 1, tp
        ``tp_size``, dp = world size / tp.
      tp_split: {name: dim} of tensor-parallel parameters (the local shard
        is split along dim); default: Megatron's ``partition_dim`` attribute
        where ``tensor_model_parallel`` is set, else replicated.
      target: the daemon address (default $CANZONA_TARGET or the local
        socket). job_id: shared by all ranks (default $CANZONA_JOB_ID, the
        torchrun run id, or one broadcast from rank 0); the n-th optimizer
        a process constructs on one id registers as "<id>-<n>", a job of
        its own (a second model's optimizer, or one constructed after
        close(), which the other ranks may not have called yet).
      strategy, alpha, bucket_size: the planner's (see canzonactl plan).
      shard_group_size: hierarchical sharding: optimizer state sharded over
        groups of this many DP ranks and replicated across groups (0: flat).
      module: the model (an nn.Module holding the parameters) to overlap
        communication with its backward and forward (see above).
      max_grad_norm: clip the gradients at this global L2 norm inside every
        step, as ``torch.nn.utils.clip_grad_norm_`` before the optimizer
        would (the norm over every rank's shards, each element once); 0
        turns clipping off. ``step(max_grad_norm=...)`` overrides it for one
        step; ``last_step`` holds the pre-clip "grad_norm" and the
        "clip_factor".
      step_doorbell: step (and report buckets / wait for parameters, with
        module=) through a shared-memory doorbell instead of gRPC calls
        where that works (the local daemon's unix socket, the
        grpc transport, Linux on x86-64); False: always gRPC.
      grad_reduce_dtype: None (data-parallel gradient sums in the
        parameters' dtype) or torch.float32 (Megatron's
        grad_reduce_in_fp32).
      blocks: {name: spec} of fused matrices whose blocks the matrix rules
        update one by one (``canzona.megatron_qkv_blocks``,
        ``canzona.megatron_fc1_blocks``, ``canzona.head_blocks``): Muon,
        Shampoo and SOAP then treat Megatron's linear_qkv and linear_fc1
        as a Hugging Face layout's q, k, v, gate and up.
      params_events: GPU models with ``--comm nccl``: the daemon answers
        before its GPU writes of the parameters end and the current stream
        (at ``step()``, or at each module's forward with ``module=``)
        waits for its per-bucket events instead. Work on other streams
        must wait for that one (or call ``torch.cuda.synchronize()``). If
        the daemon dies while a stream waits, the wait may never end
        (``step()`` would have failed instead): False answers after the
        writes, as on the Gloo plane.
    """

    # GradScaler.step(opt) calls step(grad_scaler=scaler) instead of
    # unscaling and skipping on this rank's own gradients.
    _step_supports_amp_scaling = True

    def __init__(self, named_parameters, groups=None, route=None, *,
                 layout=None, tp_size=1, tp_split=None, target=None,
                 job_id=None, job_token=None, tls_ca=None, strategy="cost",
                 alpha=0.0, bucket_size=0, connect_timeout=10.0,
                 step_timeout=600.0, shard_group_size=0, module=None,
                 max_grad_norm=0.0, grad_reduce_dtype=None, blocks=None,
                 step_doorbell=True, params_events=True, foreach=None,
                 fused=None, maximize=False, capturable=False,
                 differentiable=False):
        # torch.optim's choice of its own kernels (foreach=, fused=, as
        # nanoGPT passes AdamW) means nothing here: the daemon runs its
        # own. What would change the update is refused by name.
        del foreach, fused
        for flag, value, why in (
                ("maximize", maximize, "negate the loss instead"),
                ("capturable", capturable,
                 "it runs outside any CUDA graph of yours"),
                ("differentiable", differentiable,
                 "no autograd through the update")):
            if value:
                raise ValueError(
                    "%s=True: torch.optim's %s mode has no counterpart in "
                    "the daemon's step (%s)" % (flag, flag, why))
        named, groups, route = parameters_argument(named_parameters, groups,
                                                   route, module)
        blocks = dict(blocks or {})
        unknown_blocks = set(blocks) - {name for name, _ in named}
        if unknown_blocks:
            raise ValueError("blocks: no parameter named %s"
                             % sorted(unknown_blocks))
        if not named:
            raise ValueError("named_parameters: empty")
        # A parameter that does not require grad is left out, as Megatron
        # leaves it out of its buffers and torch.optim skips it for want of
        # a gradient: the daemon would step it on zeros, and weight decay
        # would shrink a frozen layer.
        self._frozen = [(n, p) for n, p in named if not p.requires_grad]
        named = [(n, p) for n, p in named if p.requires_grad]
        if not named:
            raise ValueError("named_parameters: none requires grad")
        # So is one without elements (a layer configured to width 0), which
        # no step changes: the daemon takes no empty shape.
        named = [(n, p) for n, p in named if p.numel() > 0]
        if not named:
            raise ValueError("named_parameters: every one is empty")
        self._groups = _parse_groups(groups)
        route_fn = _route_function(route, self._groups)
        rank, world = _world()
        layout = _resolve_layout(layout, tp_size, world)
        pp, dp, tp = layout
        max_grad_norm = float(max_grad_norm)
        if not max_grad_norm >= 0 or max_grad_norm == float("inf"):
            raise ValueError("max_grad_norm: %r must be finite and >= 0"
                             % max_grad_norm)
        if grad_reduce_dtype not in (None, torch.float32):
            raise ValueError("grad_reduce_dtype: %r is not None or "
                             "torch.float32" % (grad_reduce_dtype,))
        self.layout = layout
        self.rank = (rank // (dp * tp), (rank // tp) % dp, rank % tp)
        self.global_rank = rank
        self.job_id = _job_id(job_id)
        self.device = _device_of(named)
        dtypes = {p.dtype for _, p in named}
        # The parameters' dtype where they share one (None: several).
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None
        entries, half = _buffer_entries(named, route_fn, self._groups,
                                        dict(tp_split or {}), tp)
        _close_previous_owners(named)
        self.client = canzona.Client(target, job_token=job_token,
                                     connect_timeout=connect_timeout,
                                     step_timeout=step_timeout, tls_ca=tls_ca)
        self._params_written = []
        # Every hook this optimizer puts on the parameters and the module:
        # close() removes them, so that an optimizer constructed later on
        # the same model is the only one that sees its gradients, and this
        # one's buffer is not kept alive by them.
        self._hooks = []
        registered = False
        try:
            flat = self._allocate_buffer(2 * half, rank)
            self._seen_grad = False
            # (step, request) of a step() an exception left (see
            # _finish_interrupted_step), else None.
            self._interrupted_step = None
            parameters, by_group = self._move_into_buffer(entries, flat, half,
                                                          blocks)
            if self._event is not None:
                # The moved-from parameters' storage would stay reserved in
                # this process's caching allocator, where the daemon on the
                # same GPU (another process, allocating its master weights
                # and state at Register) cannot use it.
                torch.cuda.empty_cache()
                # The copies into the buffer are queued on the current
                # stream; whatever the daemon reads of it from Register on
                # (another process, its own streams) is written by then.
                torch.cuda.current_stream(self._event.device).synchronize()
            param_groups = []
            for gname, (kind, spec) in self._groups.items():
                if by_group[gname]:
                    param_groups.append(dict(
                        _torch_spelling(spec), params=by_group[gname],
                        name=gname, optimizer=kind))
            super().__init__(param_groups, {})
            # What schedules that cycle momentum read to choose between a
            # group's "momentum" and its "betas" (OneCycleLR, CyclicLR):
            # the first group's settings, the same on every rank. Set after
            # the groups went in, so that no group takes another's keys.
            self.defaults = _torch_spelling(next(iter(
                self._groups.values()))[1])
            self._groups_fixed = True
            # Groups without parameters are still registered (every rank of a
            # stage registers the same groups).
            self.registered = self.client.register(
                self.job_id, layout, self.rank,
                [(g, kind, {k: _setting_value(v) for k, v in spec.items()})
                 for g, (kind, spec) in self._groups.items()],
                parameters, strategy=strategy, alpha=alpha,
                bucket_size=bucket_size, shard_group_size=shard_group_size,
                max_grad_norm=max_grad_norm,
                grad_reduce_dtype=("float32" if grad_reduce_dtype is not None
                                   else None),
                params_events=params_events and self._event is not None)
            registered = True
            pageable = self.registered.get("pageable_host_bytes", 0)
            if pageable > 0:
                warn(
                    "canzona: the daemon could not page-lock %d bytes of "
                    "host memory its GPU copies to and from (its memlock "
                    "limit; systemd LimitMEMLOCK=infinity): steps run, "
                    "slower, through the driver's bounce buffers" % pageable)
            self._open_params_events()
            if step_doorbell and self.client.step_doorbell_supported():
                self.client.attach_step_doorbell(self.job_id, self.rank)
            self.steps = 0
            self.last_step = None
            # Steps the daemon skipped for non-finite gradients.
            self.skipped_steps = 0
            self._last_skipped = None
            self._warned_skipped = False
            self._closed = False
            self._module = module
            self._sync = True
            self._start_step_checks()
            if module is not None:
                self._hook_module(module)
            for param, _ in self._grads:
                param._canzona_owner = _OwnerRef(self)
            self._record_param_versions()
            hide_grad_scaler_future_warning()
            _close_at_exit(self)
        except BaseException:
            # The model stays as it was (a bad setting must not break the
            # next optimizer, nor the next backward): no hook of this one
            # stays, and each parameter gets memory of its own back and no
            # gradient view of this buffer, whose name goes.
            for handle in self._hooks:
                handle.remove()
            for param, view in getattr(self, "_grads", []):
                param.data = param.data.clone()
                if _holds_view(param, view):
                    param.grad = None
            # A registered rank would keep its state, its mapping of our
            # buffer and, with the events, answer before its writes end.
            if registered:
                try:
                    self.client.deregister(self.job_id, self.rank)
                except Exception:  # noqa: BLE001  the first error matters
                    pass
            self.client.close()  # ends a canzona-bridge child now
            if isinstance(getattr(self, "_buffer", None), canzona.SharedBuffer):
                self._buffer.unlink()
            raise

    def _allocate_buffer(self, nbytes, rank):
        """The one buffer of every parameter and gradient, as flat bytes
        (each parameter views its part in its own dtype): device memory
        exported with CUDA IPC (with the event the daemon's streams wait
        for) for a model on a GPU, else host shared memory."""
        self._event = None
        if self.device.type == "cuda":
            index = self.device.index
            if index is None:
                index = torch.cuda.current_device()
            self._event = canzona.CudaEvent(index)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8,
                                       device=torch.device("cuda", index))
            return self._buffer
        self._buffer = self.client.allocate(self.job_id, rank, nbytes)
        return torch.frombuffer(self._buffer, dtype=torch.uint8)

    def _own_memory(self, flat, offset, nbytes):
        """Bytes [offset, offset + nbytes) of the buffer. In host memory as
        a storage of its own over the same mapping: torch.save (and
        pickling, and safetensors' shared-tensor check) takes a tensor's
        whole storage, so with views of the one buffer each saved
        ``state_dict()``, even one layer's, held every parameter and every
        gradient. Device memory stays views: torch makes no storage over
        part of a CUDA allocation it did not make."""
        if self._event is None and nbytes > 0:
            return torch.frombuffer(self._buffer, dtype=torch.uint8,
                                    count=nbytes, offset=offset)
        return flat[offset:offset + nbytes]

    def _move_into_buffer(self, entries, flat, half, blocks):
        """Moves each parameter's values into its place in ``flat`` (its
        ``.data`` becomes that memory, its ``.grad`` a view of the
        gradients' half) and returns Register's
        parameter descriptions and the parameters of each group."""
        self._grads = []
        self._names = []
        # The gradients are views of one tensor (one fill zeroes them) and
        # share its version counter, which the step checks read.
        self._grad_flat = self._own_memory(flat, half, flat.numel() - half)
        parameters = []
        by_group = {g: [] for g in self._groups}
        for e in entries:
            nbytes = e.param.numel() * e.param.element_size()
            goffset = half + e.offset
            pview = self._own_memory(flat, e.offset, nbytes).view(
                e.param.dtype).view(e.param.shape)
            gview = self._grad_flat[e.offset:e.offset + nbytes].view(
                e.param.dtype).view(e.param.shape)
            with torch.no_grad():
                pview.copy_(e.param.data)
                gview.zero_()
            e.param.data = pview
            e.param.grad = gview
            self._hooks.append(
                e.param.register_hook(self._grad_arrives(e.param, gview)))
            self._grads.append((e.param, gview))
            self._names.append(e.name)
            by_group[e.group].append(e.param)
            if self._event is not None:
                base = flat.data_ptr()
                param_ref = ("cuda", base + e.offset, nbytes)
                grad_ref = ("cuda", base + goffset, nbytes,
                            self._event.handle)
            else:
                ref = self._buffer.name
                param_ref = (ref, e.offset, nbytes)
                grad_ref = (ref, goffset, nbytes)
            parameters.append({
                "name": e.name, "shape": e.shape, "tp_split_dim": e.split,
                "group": e.group, "param": param_ref, "grad": grad_ref,
                "dtype": _DTYPE_NAMES[e.param.dtype],
                "blocks": blocks.get(e.name)})
        return parameters, by_group

    def _open_params_events(self):
        """Opens the daemon's "parameters written" events, per bucket
        (granted with --comm nccl, for every bucket or none): its answers
        then come before its GPU writes end, and the current stream waits
        for these instead."""
        handles = self.registered.get("params_event_handles", [])
        if any(handles) and not all(handles):
            raise CanzonaError(
                "register: the daemon granted parameters-written events "
                "for %d of %d buckets (all or none)"
                % (sum(1 for h in handles if h), len(handles)),
                "INTERNAL")
        if self._event is not None and handles and all(handles):
            self._params_written = [
                canzona.CudaEvent.opened(self._event.device, h)
                for h in handles]

    def _record_grads(self, streams=()):
        """GPU: marks on the current stream, after what ``streams`` hold,
        where the gradients are final; the daemon's copies wait for this
        event on the device."""
        if self._event is not None:
            current = torch.cuda.current_stream(self.device)
            _join_streams(current, streams)
            self._event.record(current)

    def _await_params(self, bucket=-1):
        """GPU, --comm nccl: the current stream waits on the device for the
        daemon's writes of bucket ``bucket``'s parameters (-1: all)."""
        stream = None
        for b, event in enumerate(self._params_written):
            if bucket < 0 or b == bucket:
                if stream is None:
                    stream = torch.cuda.current_stream(self.device)
                event.wait(stream)

    def _grad_arrives(self, param, view):
        """A hook that runs before ``param``'s gradient accumulates (a
        leaf's tensor hooks run before AccumulateGrad, on its stream): puts
        the shared view back where the caller replaced ``.grad`` —
        ``model.zero_grad()`` sets it to None, as Hugging Face's Trainer
        does every step — so that backward accumulates into the memory the
        daemon reads. Otherwise AccumulateGrad would keep the gradient in a
        tensor of its own, and with ``module=`` the buckets its hooks report
        would be reduced from the stale view."""
        def hook(grad):
            self._finish_interrupted_step()
            self._seen_grad = True
            self._backward_running()
            _into_view(param, view)
            return grad
        return hook

    def _grads_assigned(self):
        """Whether the loop set a .grad to a tensor of its own (what
        torch.autograd.grad or torch.func returned), as torch.optim
        allows: no backward hook saw it, and step() copies it into the
        view the daemon reads."""
        return any(param.grad is not None and not _holds_view(param, view)
                   for param, view in self._grads)

    def _restore_grads(self):
        """Puts the shared views back where a caller replaced .grad; a
        parameter left without one (no gradient since ``.grad = None``)
        steps on zeros, not on an old gradient."""
        for param, view in self._grads:
            _into_view(param, view)

    @torch.no_grad()
    def step(self, closure=None, max_grad_norm=0.0, grad_scaler=None):
        """One optimizer step on every rank. Without ``module=`` this rank's
        parameters hold the update when it returns; with the daemon's
        events (GPU, ``--comm nccl``), for the current stream's later work:
        the host does not wait for the GPU. max_grad_norm > 0 clips this
        step at that norm instead of the constructor's (every rank passes
        the same). grad_scaler: passed by ``scaler.step(opt)``
        (torch.amp.GradScaler): the daemon undoes its scale and every rank
        skips alike (canzona/_torch_amp.py)."""
        self._check_open("step()")
        self._finish_interrupted_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_parameters()
        if not self._seen_grad and not self._grads_assigned():
            raise RuntimeError(
                "step() before backward produced a gradient: call "
                "loss.backward() first (or set .grad, as to what "
                "torch.autograd.grad returns)")
        # What a schedule or the loop wrote, checked before anything of
        # this step happens.
        lr = {g["name"]: _number(g["lr"], "param_groups[%r]['lr']"
                                 % g["name"]) for g in self.param_groups}
        settings = _scheduled_settings(self.param_groups, self._groups)
        grad_scaler, rewritten = scaler_of_step(self, grad_scaler)
        if rewritten:
            self._grads_rewritten_unchanged()
        grad_scale = loss_scale_multiplier(self, grad_scaler)
        overlap = self._module is not None and self._overlap == "on"
        if overlap:
            streams = self._overlap_streams()
        else:
            streams = ()
            if self._module is not None:
                streams = self._noted_grad_streams()
            if self._module is not None and self._overlap == "learning":
                # An edit turns the overlap off, and warns of itself.
                self._learned = self._learn_overlap()
            else:
                self._warn_of_local_grad_edits()
        self._restore_grads()
        request = {
            "lr": lr, "grad_scale": grad_scale, "async_params": overlap,
            "max_grad_norm": max_grad_norm, "settings": settings,
            "reload_params": self._changed_params()}
        # The previous step's parameters must be in place before this
        # step reads them (a step without a forward in between).
        self.synchronize()
        self._record_grads(streams)
        self._call_step(self.steps + 1, request, grad_scaler)
        return loss

    def _call_step(self, step, request, grad_scaler=None):
        """Step ``step`` on the daemon, and what this process does after
        its answer. Until the answer comes the step is in flight: an
        exception that leaves the wait (Ctrl-C in a notebook, a client
        deadline) does not stop it on the daemon."""
        self._interrupted_step = (step, request)
        try:
            self.last_step = self.client.step(self.job_id, self.rank, step,
                                              **request)
        except CanzonaError as error:
            # The daemon's answer: the step was refused or failed. Past a
            # deadline of this client's it may still run.
            if error.code not in ("DEADLINE_EXCEEDED", "CANCELLED"):
                self._interrupted_step = None
            if error.code in _DAEMON_LOST:
                raise CanzonaError(
                    "%s; a canzonad that exited or restarted no longer holds "
                    "job %r and its state: with the daemon running, "
                    "construct a new optimizer and load what "
                    "save_checkpoint(dir) or state_dict() saved last"
                    % (error, self.job_id), error.code) from None
            raise
        # Each line below may run twice (an interrupt among them, then the
        # catch-up): the step counts as done only after the last.
        report_found_inf(self, grad_scaler,
                         self.last_step["skipped_nonfinite"])
        self._count_skipped(step, grad_scaler)
        if not request["async_params"]:
            self._await_params()
        self.steps = step
        self._seen_grad = False
        self._grad_edits_step_done()
        if request["async_params"]:
            self._overlap_step_done()
        elif self._module is not None:
            self._overlap_learned(self._learned)
        self._record_param_versions()
        self._interrupted_step = None

    def _count_skipped(self, step, grad_scaler):
        """Counts a step the daemon skipped for non-finite gradients (on
        any rank), and warns at the first one taken without a GradScaler,
        whose skips are its loss-scale search: torch.optim would have
        written the NaN into the parameters, and a run that diverged must
        not look as if it trained on."""
        if (not self.last_step["skipped_nonfinite"]
                or step == self._last_skipped):
            return
        self._last_skipped = step
        self.skipped_steps += 1
        if grad_scaler is None and not self._warned_skipped:
            self._warned_skipped = True
            warn(
                "canzona: step %d skipped: gradients hold inf or NaN on a "
                "rank (grad_norm %s), so every rank left its parameters "
                "and optimizer state as they were (torch.optim would have "
                "written the NaN into them). opt.skipped_steps counts such "
                "steps (and canzona_steps_skipped_total); this warning is "
                "not repeated" % (step, self.last_step["grad_norm"]))

    def _check_open(self, call):
        """RuntimeError for ``call`` on a closed optimizer, whose job the
        daemon no longer has (rather than a failed RPC, or a misleading
        "before backward")."""
        if self._closed:
            raise RuntimeError(
                "%s: this optimizer is closed (close() ended its job %r); "
                "construct a new one over the parameters" % (call, self.job_id))

    def _finish_interrupted_step(self):
        """Catches up with a step() that an exception left while the
        daemon ran it (Ctrl-C in a notebook): before anything here reads or
        writes the buffers that step uses (backward, zero_grad, a forward
        with ``module=``, the next step, state and checkpoints), it asks
        for that step again, which the daemon answers with the step's own
        result once it completes, without running it twice. Before, the
        next step() failed with "step out of order" for good."""
        if self._interrupted_step is not None:
            self._call_step(*self._interrupted_step)

    def add_param_group(self, param_group):
        """torch.optim's, while constructing; afterwards a RuntimeError: the
        daemon placed every parameter in a bucket and on an owner at
        registration (construct a new optimizer with all of them)."""
        if getattr(self, "_groups_fixed", False):
            raise RuntimeError(
                "add_param_group: canzona registers every parameter with the "
                "daemon at construction; construct a new optimizer with the "
                "added parameters")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=False):
        """Zeroes the shared gradient buffers in place (``set_to_none`` is
        accepted for compatibility and ignored: the buffers must stay).
        Safe right after a step that answered before its GPU writes: the
        daemon has read every gradient by then (its one wait, for the
        sums, comes after the reductions); only parameters are written
        after the answer."""
        del set_to_none
        self._finish_interrupted_step()
        if self._module is not None:
            self._overlap_zero_grad()
        for param, view in self._grads:
            if not _holds_view(param, view):
                param.grad = view
        # The gradients are one contiguous half of the buffer: one fill.
        self._grad_flat.zero_()

    def plan(self):
        """The job's plan (planner JSON, parsed) and its digest."""
        self._check_open("plan()")
        return self.client.plan(self.job_id)

    def close(self):
        """Deregisters this rank (the job ends when its last rank leaves),
        removes every hook on the parameters and the module, closes the
        client and removes the shared buffer's name (the parameters stay
        usable: the mapping lives as long as they do)."""
        if not self._closed:
            self._closed = True
            _OPEN.pop(self, None)
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            for param, _ in self._grads:
                param._canzona_owner = None
            try:
                try:
                    # A step an exception left ends, and the last step's
                    # parameters arrive (module=), before the rank leaves:
                    # the model holds the final values.
                    self._synchronize()
                except Exception:  # noqa: BLE001  the rank leaves anyway
                    pass
                # The daemon's events go with the rank: their last records
                # complete, and our opened copies close, first (bounded: a
                # daemon that died leaves them pending).
                if self._params_written:
                    try:
                        deadline = time.monotonic() + 10.0
                        for event in self._params_written:
                            while (not event.query()
                                   and time.monotonic() < deadline):
                                time.sleep(0.001)
                    except Exception:  # noqa: BLE001  a CUDA or daemon
                        pass           # error must not keep the rank
                    finally:
                        self._params_written = []
                try:
                    self.client.deregister(self.job_id, self.rank)
                except CanzonaError as error:
                    # Nothing is left to deregister: the daemon exited or
                    # restarted, which the loop has heard of already.
                    if error.code not in _DAEMON_LOST:
                        raise
                    warn("canzona: close(): job %r was not deregistered: %s"
                         % (self.job_id, error))
            finally:
                self.client.close()
                # Otherwise only garbage collection or a normal interpreter
                # exit unlinks it, and a trainer that leaves with os._exit
                # (or is killed) would leave the whole buffer in /dev/shm.
                if isinstance(self._buffer, canzona.SharedBuffer):
                    self._buffer.unlink()


# The optimizers open in this process, by the pid that constructed them.
# torch.optim has no close(), so most scripts end without calling one; at a
# normal interpreter exit (the end of the script, sys.exit, an uncaught
# exception) each is closed as close() would, instead of the daemon finding
# its trainer gone: that fails the job ("exited without deregistering") and
# cuts the rank's connections at once, where a slower peer may still be
# reading its last all-gather.
_OPEN = weakref.WeakKeyDictionary()
_EXIT_HANDLER = False  # registered (at the first construction)


def _close_at_exit(opt):
    """Adds ``opt`` to those closed at exit. The handler is registered at
    the first construction, not at import: atexit runs the last registered
    first, and it must run before weakref.finalize's (registered with the
    first finalizer, the client's or the buffer's), which would close the
    client and unlink the buffer under it."""
    global _EXIT_HANDLER
    if not _EXIT_HANDLER:
        _EXIT_HANDLER = True
        atexit.register(_close_open_optimizers)
    _OPEN[opt] = os.getpid()


def _close_open_optimizers():
    for opt, pid in list(_OPEN.items()):
        # A child forked after construction (os.fork; DataLoader workers
        # leave through os._exit, which runs no atexit) inherits this
        # handler: it must not deregister its parent's ranks.
        if pid != os.getpid():
            continue
        try:
            opt.close()
        except Exception as error:  # noqa: BLE001  the others still close
            warn("canzona: at exit, job %r: close(): %s" % (opt.job_id, error))


class _OwnerRef(weakref.ref):
    """A parameter's ``_canzona_owner``: the optimizer holding it, weakly.
    It pickles as None: torch >= 2.0 pickles a Parameter's ``__dict__``
    (``torch.save(model)``), and the copy belongs to no optimizer."""

    __slots__ = ()

    def __reduce__(self):
        return (type(None), ())


def _close_previous_owners(named):
    """Closes, with a RuntimeWarning, every open canzona optimizer holding
    one of these parameters, as torch.optim lets a new optimizer replace
    an old one over the same parameters (re-running a notebook cell). Left
    open, its gradient hooks would copy every gradient into its buffer
    too, and they would keep it (and its job at the daemon) alive even
    after its last reference went."""
    for name, param in named:
        ref = getattr(param, "_canzona_owner", None)
        owner = ref() if ref is not None else None
        if owner is not None and not owner._closed:
            warn(
                "canzona: closing the optimizer of job %r, which held "
                "parameter %r: a new optimizer takes its parameters"
                % (owner.job_id, name))
            try:
                owner.close()
            except Exception:  # noqa: BLE001  its daemon may be gone (a
                pass           # restart); its hooks went first regardless


# The keywords Optimizer takes besides its positional arguments.
_OPTIMIZER_KEYWORDS = frozenset(
    inspect.signature(Optimizer.__init__).parameters) - {
        "self", "named_parameters", "groups", "route"}
_FACTORY_NAMES = {"muon": "Muon", "shampoo": "Shampoo", "soap": "SOAP"}


def _matrix_optimizer(kind, named_parameters, matrix_settings, adamw_settings,
                      route, overrides, kwargs):
    """The matrix rule ``kind`` for 2-D hidden weights, AdamW for the rest.
    torch.optim param group dicts: each is a group of the optimizer its
    parameters route to (unless it names one), with that optimizer's
    keyword settings updated by its own."""
    unknown = sorted(set(kwargs) - _OPTIMIZER_KEYWORDS)
    if unknown:
        # Named for the function the loop called, not Optimizer.__init__;
        # an AdamW keyword is the likeliest (torch.optim.AdamW's habit).
        raise TypeError(
            "%s() got an unexpected keyword argument %r (the AdamW "
            "group's settings are adamw_lr, adamw_betas, adamw_eps and "
            "adamw_weight_decay)" % (_FACTORY_NAMES[kind], unknown[0]))
    defaults = {kind: matrix_settings, "adamw": adamw_settings}
    overrides = dict(overrides or {})

    def routed(name, param):
        if name in overrides:
            return overrides[name]
        if route is not None:
            return route(name, param) if callable(route) else route[name]
        return default_route(name, param, kind)

    named, groups, by_group = parameters_argument(
        named_parameters, None, None, kwargs.get("module"), kind_of=routed,
        defaults=defaults)
    if groups is None:
        groups = {k: dict(settings, optimizer=k)
                  for k, settings in defaults.items()}
        by_group = routed
    return Optimizer(named, groups, by_group, **kwargs)


def _adamw_settings(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay):
    beta1, beta2 = _pair(adamw_betas, "adamw_betas")
    return {"lr": adamw_lr, "beta1": beta1, "beta2": beta2,
            "eps": adamw_eps, "weight_decay": adamw_weight_decay}


def Muon(named_parameters, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
         weight_decay=0.0, ns_coefficients=None, eps=None, adjust_lr_fn=None,
         adamw_lr=3e-4, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
         adamw_weight_decay=0.0, route=None, overrides=None,
         muon_settings=None, **kwargs):
    """Muon for 2-D hidden weights, AdamW for the rest (torch.optim.Muon
    update semantics; ``overrides`` {name: group} moves single parameters).
    torch.optim.Muon's keywords mean what they mean there: ns_coefficients
    its default triple or a daemon set's name ("simple", "quintic",
    "polar_express"), adjust_lr_fn "original" or "match_rms_adamw"; None
    keeps the daemon's default, which is torch's. The defaults of lr (0.02)
    and weight_decay (0) are Keller Jordan's, not torch's (1e-3, 0.1)."""
    settings = {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                "ns_steps": ns_steps, "weight_decay": weight_decay}
    settings.update(_torch_muon_settings(ns_coefficients, eps, adjust_lr_fn))
    settings.update(muon_settings or {})
    return _matrix_optimizer(
        "muon", named_parameters, settings,
        _adamw_settings(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay),
        route, overrides, kwargs)


def Shampoo(named_parameters, lr=1e-2, betas=(0.9, 1.0), epsilon=1e-12,
            weight_decay=0.0, precondition_frequency=1,
            max_preconditioner_dim=None, start_preconditioning_step=None,
            adamw_lr=3e-4, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
            adamw_weight_decay=0.0, route=None, overrides=None,
            shampoo_settings=None, **kwargs):
    """Shampoo (Adam grafting by default) for 2-D hidden weights, AdamW for
    the rest; the keywords are Distributed Shampoo's (None: the daemon's
    default, which is its)."""
    beta1, beta2 = _pair(betas, "betas")
    settings = {"lr": lr, "beta1": beta1, "beta2": beta2,
                "epsilon": epsilon, "weight_decay": weight_decay,
                "precondition_frequency": precondition_frequency}
    settings.update(_given(
        max_preconditioner_dim=max_preconditioner_dim,
        start_preconditioning_step=start_preconditioning_step))
    settings.update(shampoo_settings or {})
    return _matrix_optimizer(
        "shampoo", named_parameters, settings,
        _adamw_settings(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay),
        route, overrides, kwargs)


def SOAP(named_parameters, lr=3e-3, betas=(0.95, 0.95), eps=1e-8,
         weight_decay=0.0, precondition_frequency=10, shampoo_beta=None,
         max_precond_dim=None, normalize_grads=None, correct_bias=None,
         adamw_lr=3e-4, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
         adamw_weight_decay=0.0, route=None, overrides=None,
         soap_settings=None, **kwargs):
    """SOAP (Adam in Shampoo's eigenbasis) for 2-D hidden weights, AdamW for
    the rest; the keywords are nikhilvyas/SOAP's (None: the daemon's
    default, which is its; weight_decay defaults to 0 here, 0.01 there)."""
    beta1, beta2 = _pair(betas, "betas")
    settings = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                "weight_decay": weight_decay,
                "precondition_frequency": precondition_frequency}
    settings.update(_given(
        shampoo_beta=shampoo_beta, max_precond_dim=max_precond_dim,
        normalize_grads=normalize_grads, correct_bias=correct_bias))
    settings.update(soap_settings or {})
    return _matrix_optimizer(
        "soap", named_parameters, settings,
        _adamw_settings(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay),
        route, overrides, kwargs)
