"""canzona.torch's overlap with backward and forward (``module=``).

As backward finishes a gradient bucket (every parameter's gradient
accumulated), a hook reports it to the daemon (GradReady), whose
communication thread reduces it while backward goes on; step() then waits
only for what is left and returns before the parameter all-gathers end,
and forward pre-hooks wait (WaitParams) for just the buckets each module
reads. The first step learns the loop instead: where it sees what that
would race with (a second backward outside ``no_sync()``, gradients
dropped or edited before the step), every step reports its buckets at
step(), as without ``module=``. ``_Overlap`` holds those hooks for
``canzona.torch.Optimizer``.

Thread-safety: as the optimizer, one per trainer thread; the hooks run on
the thread that runs backward and forward.
"""

import contextlib
import functools
import sys
import weakref

import torch

from canzona._warn import warn


def _holds_view(param, view):
    """Whether ``param.grad`` is ``view``'s memory (the daemon reads it)."""
    return param.grad is not None and param.grad.data_ptr() == view.data_ptr()


def _into_view(param, view, rebind=True):
    """Makes ``view`` (the memory the daemon reads) hold ``param``'s
    gradient where ``param.grad`` is another tensor, zeros where it is None;
    ``rebind``: ``param.grad`` is the view afterwards."""
    if _holds_view(param, view):
        return
    grad = param.grad
    with torch.no_grad():
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
    if rebind:
        param.grad = view


class _OnlyOn:
    """A module hook that calls ``action()`` when it runs on ``module``
    itself: copy.deepcopy(model) (an EMA copy) copies the hooks too, and
    the copy holds parameters of its own, for which nothing waits.
    Pickled (``torch.save(model)``, a model handed to a spawned process)
    or deep-copied, it becomes a hook that does nothing and needs nothing
    of canzona to load: ``sys.audit`` of an event of ours, which only an
    audit hook would see."""

    __slots__ = ("_module", "_action")

    def __init__(self, module, action):
        self._module = weakref.ref(module)
        self._action = action

    def __call__(self, called, *unused):
        del unused
        if called is self._module():
            self._action()

    def __reduce__(self):
        return (functools.partial, (sys.audit, "canzona.copied_hook"))


def _first_forward_pre_hook(module, hook):
    """Registers ``hook`` to run before the forward pre-hooks ``module``
    has already: those may read its parameters too (torch.nn.utils.
    weight_norm and spectral_norm compute the weight from them there), and
    must read the last step's values, not the ones the daemon is still
    writing."""
    try:
        return module.register_forward_pre_hook(hook, prepend=True)
    except TypeError:  # before torch 2.0: no prepend=
        handle = module.register_forward_pre_hook(hook)
        module._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle


class _Overlap:
    """The overlap half of ``canzona.torch.Optimizer`` (a mixin): the
    backward hooks that report buckets, the forward pre-hooks that wait for
    them, ``no_sync()`` and ``synchronize()``. It reads what the optimizer
    set up before ``_hook_module``: ``client``, ``job_id``, ``rank``,
    ``steps``, ``registered``, ``device``, ``_event``, ``_grads``,
    ``_grad_flat``, ``_module``, ``_sync``, ``_hooks``, and calls its
    ``_record_grads``, ``_await_params``, ``_finish_interrupted_step`` and
    (``_StepChecks``) ``_check_reported_grads_unchanged`` and
    ``_edited_since_backward``."""

    def _hook_module(self, module):
        buckets = self.registered["buckets"]
        self._bucket_of = {}
        for b, members in enumerate(buckets):
            for j in members:
                self._bucket_of[j] = b
        # Frozen parameters never get a gradient: their buckets are left to
        # step() (which reports whatever backward did not).
        self._bucket_size = [0] * len(buckets)
        self._left = []
        self._reported = set()
        # The first parameter a backward accumulated into after an earlier
        # backward of the step had reported its bucket.
        self._late_accumulation = None
        # Buckets of the last async step not yet waited for.
        self._unsynced = set()
        # "learning" until the first step shows whether this loop lets
        # backward report buckets (_learn_overlap), then "on" or "off"
        # (every step reports them at step(), as without module=).
        self._overlap = "learning"
        # While learning: each parameter's accumulations outside no_sync()
        # since the last step or zero_grad(), and the first thing seen that
        # reporting would have raced with.
        self._accumulations = [0] * len(self._grads)
        self._overlap_unsafe = None
        self._learned = None
        for j, (param, _) in enumerate(self._grads):
            if param.requires_grad:
                self._bucket_size[self._bucket_of[j]] += 1
        self._left = list(self._bucket_size)
        # GPU: the streams each bucket's gradients accumulated on this
        # backward (AccumulateGrad runs on the stream its parameter's
        # forward used), by handle.
        self._grad_streams = [{} for _ in buckets]
        # A hook that runs once a parameter's gradient is fully accumulated
        # for this backward: torch >= 2.1 has one; before, hooks on the
        # AccumulateGrad nodes (the Megatron DDP technique), which must stay
        # referenced.
        post_accumulate = hasattr(torch.Tensor,
                                  "register_post_accumulate_grad_hook")
        self._accumulators = []
        for j, (param, _) in enumerate(self._grads):
            if not param.requires_grad:
                continue
            if post_accumulate:
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    self._accumulated(j)))
                continue
            acc = param.expand_as(param).grad_fn.next_functions[0][0]
            self._hooks.append(acc.register_hook(self._accumulated(j)))
            self._accumulators.append(acc)
        index = {id(p): j for j, (p, _) in enumerate(self._grads)}
        # A container without a forward of its own (ParameterList,
        # ParameterDict, ModuleList...) is never called: the module above
        # it reads its parameters, so that module's forward waits for them.
        parent = {id(child): sub for sub in module.modules()
                  for child in sub.children()}
        waits = {}  # id(module) -> (module, buckets)
        for sub in module.modules():
            mine = {self._bucket_of[index[id(p)]]
                    for p in sub.parameters(recurse=False) if id(p) in index}
            if not mine:
                continue
            reader = sub
            while (type(reader).forward is torch.nn.Module.forward
                   and id(reader) in parent):
                reader = parent[id(reader)]
            waits.setdefault(id(reader), (reader, set()))[1].update(mine)
        for reader, buckets in waits.values():
            self._hooks.append(_first_forward_pre_hook(
                reader, _OnlyOn(reader, self._before_forward(
                    id(reader), sorted(buckets)))))
        # A forward may read a module's parameters without calling it: a
        # fused linear cross-entropy takes lm_head.weight (Liger's, Cut
        # Cross-Entropy's), so lm_head's pre-hook never waits. The model's
        # own forward learns which readers its last training forward did
        # not call, and its next one waits for their buckets first (only
        # those lose the overlap). Registered last, it runs before the
        # model's other pre-hooks (its own reader's too).
        self._reader_buckets = {key: sorted(buckets)
                                for key, (_, buckets) in waits.items()}
        self._called = set()
        self._uncalled_buckets = []
        self._hooks.append(_first_forward_pre_hook(
            module, _OnlyOn(module, self._model_forward_starts)))
        self._hooks.append(module.register_forward_hook(
            _OnlyOn(module, self._model_forward_ends)))
        # The model's state_dict() (torch.save, save_pretrained, a
        # checkpoint) reads every parameter outside a forward: it waits for
        # the last step's parameters first. Before torch 2.0 only a hook
        # after it exists, which serves as well: the values it returns
        # alias the parameters, and are read after it.
        synchronized = _OnlyOn(module, self.synchronize)
        if hasattr(module, "register_state_dict_pre_hook"):
            self._hooks.append(
                module.register_state_dict_pre_hook(synchronized))
        else:
            self._hooks.append(module._register_state_dict_hook(synchronized))
        # Its load_state_dict() writes every parameter: the last step's
        # writes end first, or they would land on the loaded values.
        if hasattr(module, "register_load_state_dict_pre_hook"):
            self._hooks.append(
                module.register_load_state_dict_pre_hook(synchronized))
        else:
            self._hooks.append(module._register_load_state_dict_pre_hook(
                synchronized, with_module=True))

    def _accumulated(self, j):
        param, view = self._grads[j]

        def hook(*unused):
            del unused
            self._seen_grad = True
            # backward(create_graph=True) accumulates out of place, into a
            # new .grad: its values go to the view before the bucket is
            # reported (.grad stays the caller's, graph and all).
            _into_view(param, view, rebind=False)
            b = self._bucket_of[j]
            if self._overlap != "on":
                self._note_grad_stream(b)
                if self._overlap == "learning" and self._sync:
                    self._accumulations[j] += 1
                    if (self._accumulations[j] == 2
                            and self._overlap_unsafe is None):
                        self._overlap_unsafe = (
                            "two backwards outside opt.no_sync() "
                            "accumulate into %r before one step()"
                            % self._names[j])
                return
            if b in self._reported:
                # A backward after the one that reported this bucket (no
                # no_sync() around it, or no_sync() around a later one
                # only): the daemon is reducing the bucket already (step()
                # refuses).
                if self._late_accumulation is None:
                    self._late_accumulation = self._names[j]
                return
            if not self._sync:
                return
            self._note_grad_stream(b)
            self._left[b] -= 1
            if self._left[b] == 0 and b not in self._reported:
                self._reported.add(b)
                # A parameter used under another stream in forward
                # accumulated there: the event must cover those adds too.
                self._record_grads(self._grad_streams[b].values())
                self._grad_streams[b].clear()
                self.client.grad_ready(self.job_id, self.rank, self.steps + 1,
                                       [b])
        return hook

    def _note_grad_stream(self, b):
        if self._event is not None:
            stream = torch.cuda.current_stream(self.device)
            self._grad_streams[b][stream.cuda_stream] = stream

    def _overlap_zero_grad(self):
        """zero_grad() with ``module=``: while learning, gradients a
        backward outside no_sync() accumulated since the last step are
        dropped, whose buckets backward would have reported (a GAN's
        generator loss backpropagated through the discriminator)."""
        if self._overlap != "learning":
            return
        dropped = next((j for j, n in enumerate(self._accumulations) if n),
                       None)
        if dropped is not None and self._overlap_unsafe is None:
            self._overlap_unsafe = (
                "zero_grad() drops what a backward outside opt.no_sync() "
                "accumulated into %r since the last step"
                % self._names[dropped])
        self._accumulations = [0] * len(self._grads)

    def _learn_overlap(self):
        """At the first step() with ``module=``: whether backward may report
        buckets from the next step on. Not where this step saw a second
        backward outside no_sync(), gradients dropped before it, or edited
        between backward and it (clip_grad_norm_, GradScaler.unscale_, a
        DistributedDataParallel around the model): each would race with the
        daemon's reads of a reported bucket (and raises once overlap is on).
        Returns what ``_overlap_learned`` applies after the step."""
        unsafe = self._overlap_unsafe
        if unsafe is None and self._edited_since_backward():
            unsafe = ("gradients change in place between backward and "
                      "step() (torch.nn.utils.clip_grad_norm_, "
                      "GradScaler.unscale_, or a DistributedDataParallel "
                      "around the model)")
        return unsafe

    def _overlap_learned(self, unsafe):
        """After each step() with ``module=`` that did not overlap: the
        next starts afresh, and after the first, the overlap goes on, or
        off (``unsafe`` says why, warned once)."""
        for streams in self._grad_streams:
            streams.clear()
        self._accumulations = [0] * len(self._grads)
        self._overlap_unsafe = None
        if self._overlap != "learning":
            return
        self._overlap = "on" if unsafe is None else "off"
        if unsafe is not None:
            warn(
                "canzona: module= overlaps backward with the reduction of "
                "each bucket it reports, which needs one backward outside "
                "opt.no_sync() per step and gradients left as backward "
                "wrote them until step(). In this loop %s, so this "
                "optimizer steps without the overlap (the same results, "
                "the forward waits and backward hooks idle). To have it: "
                "every backward but the last inside opt.no_sync() (a GAN's "
                "generator backward inside the discriminator optimizer's "
                "too), clipping with max_grad_norm= (Hugging Face's "
                "Trainer clips unless TrainingArguments(max_grad_norm=0)), "
                "scaler.step(opt) without scaler.unscale_(opt), no DDP "
                "wrapper" % unsafe)

    def _before_forward(self, key, buckets):
        """What the forward of a module (``id()`` ``key``) waits for
        first: the last step's parameters of ``buckets`` (the ones it
        reads)."""
        def wait():
            self._called.add(key)
            self._wait_for(buckets)
        return wait

    def _wait_for(self, buckets):
        self._finish_interrupted_step()
        for b in buckets:
            if b in self._unsynced:
                self.client.wait_params(self.job_id, self.rank, self.steps, b)
                self._await_params(b)
                self._unsynced.discard(b)

    def _model_forward_starts(self):
        self._called = set()
        self._wait_for(self._uncalled_buckets)

    def _model_forward_ends(self):
        # An evaluation forward may take another path (generate() calls
        # lm_head): only training forwards teach.
        if torch.is_grad_enabled():
            self._uncalled_buckets = sorted(
                {b for key, buckets in self._reader_buckets.items()
                 if key not in self._called for b in buckets})

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside does not report buckets (gradient accumulation:
        every micro-batch but the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def synchronize(self):
        """With ``module=``: waits for the last step's parameters, all
        buckets. With the daemon's events (GPU, ``--comm nccl``) the host
        waits only for the answer and the current stream for the writes;
        otherwise the parameters are in place when it returns (after
        close(): nothing to wait for)."""
        if not self._closed:
            self._synchronize()

    def _synchronize(self):
        self._finish_interrupted_step()
        if self._module is not None and self._unsynced:
            self.client.wait_params(self.job_id, self.rank, self.steps, -1)
            self._await_params()
            self._unsynced.clear()

    def _overlap_streams(self):
        """At step() with ``module=``: refuses gradients edited since
        backward, and returns the streams the buckets no hook reported (a
        parameter without a gradient) may have accumulated on too."""
        self._check_reported_grads_unchanged()
        return self._noted_grad_streams()

    def _noted_grad_streams(self):
        """The streams this step's gradients accumulated on, as the
        backward hooks noted them."""
        return [stream for streams in self._grad_streams
                for stream in streams.values()]

    def _overlap_step_done(self):
        """After step() with ``module=``: the next backward reports every
        bucket afresh, and the next forward waits for each."""
        self._left = list(self._bucket_size)
        for streams in self._grad_streams:
            streams.clear()
        self._reported = set()
        self._late_accumulation = None
        self._unsynced = set(range(len(self._bucket_size)))
