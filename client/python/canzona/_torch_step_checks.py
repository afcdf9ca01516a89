"""What canzona.torch.Optimizer's step() checks of what the training loop
did since construction and since backward, before anything steps.

The parameters: each must still live in the shared buffer the daemon
updates (``model.to()``, ``.half()`` or ``param.data = ...`` after
construction replaces its storage, where no update would reach it), and
one left out because it did not require grad must not require it now (the
daemon does not hold it); one frozen since construction still steps, on
zero gradients, which is warned once.

The parameters' values, changed in place since the last step (torch's
version counters; ``reload_model_params()`` for writes they miss): in
mixed precision the daemon reads their fp32 masters from the trainer again
(StepRequest.reload_params) instead of writing its older ones over them.

The gradients, changed in place between the end of backward and step(),
seen through torch's version counter of the shared gradient buffer (every
view of it shares one). With ``module=`` the daemon reduces each bucket as
backward reports it, so an edit there, or a second backward outside
``no_sync()``, races with its reads: step() refuses it. Without, the
daemon still reduces inside step(), after the edit: on a job of several
ranks an edit applies to this rank's own gradients before they are
averaged. A factor every rank shares (``GradScaler.unscale_``, 1 /
accumulation steps) commutes with the average, but
``torch.nn.utils.clip_grad_norm_`` clips by this rank's norm, not by the
global one it sees under DDP, and each rank by another factor: warned
once, pointing at ``max_grad_norm=``.

Thread-safety: as the optimizer; the hooks run on the thread that runs
backward.
"""


import torch

from canzona._warn import warn


class _StepChecks:
    """A mixin of ``canzona.torch.Optimizer``. It reads ``_grads``,
    ``_names``, ``_frozen``, ``_grad_flat``, ``layout``, ``_module`` and,
    with ``module=``, ``_reported`` and ``_late_accumulation``, and calls
    its ``_check_open``."""

    def _start_step_checks(self):
        # Where each registered parameter's values live (the shared buffer).
        self._param_addresses = [p.data_ptr() for p, _ in self._grads]
        self._warned_frozen = False
        # The shared gradients' version when the last backward ended, and
        # whether that end is awaited.
        self._backward_version = None
        self._end_queued = False
        self._warned_local_edit = False

    def _check_parameters(self):
        """Before a step: RuntimeError for a parameter moved out of the
        shared buffer or unfrozen since construction; a warning, once, for
        one frozen since."""
        for name, param in self._frozen:
            if param.requires_grad:
                raise RuntimeError(
                    "parameter %r did not require grad when the optimizer "
                    "was constructed, so the daemon does not hold it: "
                    "construct a new optimizer to train it (this one's "
                    "state carries over through save_checkpoint(dir) and "
                    "the new one's load_checkpoint(dir, strict=False))"
                    % name)
        for (param, _), name, address in zip(self._grads, self._names,
                                              self._param_addresses):
            if param.data_ptr() != address:
                raise RuntimeError(
                    "parameter %r no longer lives in the optimizer's shared "
                    "buffer: its storage was replaced after construction "
                    "(model.to(), .half(), .cuda() or param.data = ...), "
                    "where the daemon's updates would not reach it; convert "
                    "and move the model before constructing the optimizer"
                    % name)
            if not param.requires_grad and not self._warned_frozen:
                self._warned_frozen = True
                warn(
                    "canzona: parameter %r no longer requires grad, but the "
                    "daemon registered it and steps it on a zero gradient "
                    "(weight decay and momentum still move it); construct "
                    "a new optimizer to leave it out" % name)

    def _backward_running(self):
        """Called by the gradient hooks: records the version once this
        backward has accumulated every gradient."""
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self._backward_ending)

    def _backward_ending(self):
        # Without module=, backward's end callbacks queued after ours run
        # first (a callback queued now runs after them): DistributedDataParallel
        # writes the averaged gradients into .grad in one, which is part of
        # what backward produced, not an edit, since the daemon reads the
        # gradients in step() only. With module= it has been reading the
        # reported buckets since: a write after this point races with it
        # (and while the first step learns, turns the overlap off).
        if self._module is not None and self._overlap != "off":
            self._backward_ended()
        else:
            torch.autograd.Variable._execution_engine.queue_callback(
                self._backward_ended)

    def _backward_ended(self):
        self._end_queued = False
        self._backward_version = self._grad_flat._version

    def _edited_since_backward(self):
        return (self._backward_version is not None
                and self._grad_flat._version != self._backward_version)

    def _grads_rewritten_unchanged(self):
        """The writes to the gradients since backward changed no value
        (GradScaler's own inf check under torch's attribute protocol
        multiplies them by 1 in place): not an edit of the loop's. An edit
        of the loop's before it goes unseen then; a clip is none (it needs
        ``unscale_`` first, after which GradScaler does not check)."""
        if self._backward_version is not None:
            self._backward_version = self._grad_flat._version

    def _check_reported_grads_unchanged(self):
        """With ``module=``: the buckets backward reported are being reduced
        from the shared gradients already, so an in-place edit after
        backward, or a second backward accumulating into them, would make
        the step use old, new or torn values. Refused, before anything
        steps."""
        if self._late_accumulation is not None:
            raise RuntimeError(
                "a second backward accumulated into %r after an earlier one "
                "had reported its bucket (or an interrupted one: Ctrl-C), "
                "but with module= the daemon reduces each bucket as soon as "
                "backward reports it: this step is not taken. To go on, "
                "carry the state into a new optimizer: state = "
                "opt.state_dict(), the same constructor again, then "
                "load_state_dict(state). For gradient accumulation, run "
                "every backward but the last inside opt.no_sync()"
                % self._late_accumulation)
        if self._reported and self._edited_since_backward():
            raise RuntimeError(
                "gradients were changed in place between backward and "
                "step() (e.g. torch.nn.utils.clip_grad_norm_, "
                "GradScaler.unscale_, or a DistributedDataParallel around "
                "the model: drop it, the daemons average), but with module= "
                "the daemon reduces "
                "each bucket as backward reports it, so it has read them "
                "already: this step is not taken, and the buckets already "
                "reduced hold the unedited gradients (to go on: state = "
                "opt.state_dict() into a new optimizer's load_state_dict). "
                "Clip with max_grad_norm= (in the daemon's "
                "step, after the reduction) and train in bf16 without a "
                "GradScaler, or construct the optimizer without module=")

    def _warn_of_local_grad_edits(self):
        """Without ``module=``, on a job of several ranks: warns once of an
        edit made to this rank's gradients before the reduction."""
        if (self._warned_local_edit or self.layout == (1, 1, 1)
                or not self._edited_since_backward()):
            return
        self._warned_local_edit = True
        warn(
            "canzona: gradients were changed in place between backward and "
            "step() on one rank of a %d-rank job. The daemon averages the "
            "ranks' gradients inside step(), so the edit applied to this "
            "rank's own: a factor every rank shares (GradScaler.unscale_, "
            "1 / accumulation steps) is the same after the average, but "
            "torch.nn.utils.clip_grad_norm_ clipped by this rank's norm, not "
            "by the global norm it clips by under DDP, and each rank by its "
            "own factor. Clip with max_grad_norm= instead (the daemon clips "
            "by the global norm after the reduction). Where a "
            "DistributedDataParallel still wraps the model, it averaged the "
            "gradients before the edit, and the edit is right."
            % (self.layout[0] * self.layout[1] * self.layout[2]))

    def _record_param_versions(self):
        """Each parameter's version counter now (the daemon's writes leave
        it alone): a later one means the loop changed the parameter in
        place since (model.load_state_dict, an init, ``p.mul_``)."""
        self._param_versions = [param._version for param, _ in self._grads]

    def reload_model_params(self, params=None):
        """Megatron's name: the next step takes the current values of
        ``params`` (an iterable of this optimizer's parameters; None: all)
        as the daemon's fp32 masters. For writes torch's version counters
        do not see: through ``.data``, or a torch.distributed collective
        into the parameters (rank 0 loads, then broadcasts). In-place
        writes torch sees need no call. With ``module=``, call
        ``synchronize()`` before writing."""
        self._check_open("reload_model_params()")
        index = {id(param): j for j, (param, _) in enumerate(self._grads)}
        chosen = (range(len(self._grads)) if params is None
                  else [index.get(id(param)) for param in params])
        # Every one checked before any is marked: a refused call changes
        # nothing.
        if None in chosen:
            raise ValueError("reload_model_params: a parameter this "
                             "optimizer does not hold")
        for j in chosen:
            self._param_versions[j] = -1  # never a version counter's value

    def _changed_params(self):
        """The bf16 / fp16 parameters changed in place since the last step
        (by index), whose fp32 masters the daemon must read again: it would
        write its older masters over the new values (fp32 values it reads
        every step). A write through ``.data`` moves no version counter
        (reload_model_params() names those)."""
        return [j for j, ((param, _), version) in
                enumerate(zip(self._grads, self._param_versions))
                if param._version != version and param.dtype != torch.float32]

    def _grad_edits_step_done(self):
        # A backward that raised never ran its end callback.
        self._backward_version = None
        self._end_queued = False
