"""What canzona.torch.Optimizer saves and restores: ``state_dict()`` /
``load_state_dict()`` (this rank's param_groups and the daemon's state for
it, as bytes, for ``torch.save`` per rank and Hugging Face Accelerate's
round trip) and ``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` (the
daemons' collective checkpoint, loadable in any layout).
torch.distributed.checkpoint, which keeps only a state_dict's "state" and
"param_groups", is refused rather than left to save nothing of the
daemon's.

Thread-safety: as the optimizer.
"""

import os
import sys

import torch

from canzona import CanzonaError
from canzona._torch_setup import _torch_spelling


class _State:
    """A mixin of ``canzona.torch.Optimizer``. It reads ``client``,
    ``job_id``, ``rank``, ``layout``, ``param_groups`` and ``_names``,
    sets ``steps``, and calls its ``_check_open``, ``synchronize``,
    ``_finish_interrupted_step`` and ``_record_param_versions``."""

    def state_dict(self):
        """This rank's view: param_groups as torch has them plus the state
        the daemon holds for this rank (as bytes)."""
        self._check_open("state_dict()")
        _refuse_distributed_checkpoint("state_dict()")
        self.synchronize()
        exported = self.client.export_state(self.job_id, self.rank)
        groups = []
        index = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        blob = exported["state"]
        return {
            "state": {},
            "param_groups": groups,
            "canzona": {
                "state": torch.frombuffer(blob, dtype=torch.uint8)
                if blob else torch.empty(0, dtype=torch.uint8),
                "step": exported["step"],
                "plan_digest": exported["plan_digest"],
                "layout": self.layout,
                "rank": self.rank,
                "names": list(self._names),
            },
        }

    def load_state_dict(self, state_dict):
        """Restores group hyperparameters and this rank's daemon state (the
        same plan: change layouts through checkpoints instead)."""
        self._check_open("load_state_dict()")
        _refuse_distributed_checkpoint("load_state_dict()")
        if "canzona" not in state_dict:
            raise ValueError(
                "state_dict: not a canzona.torch state_dict (no 'canzona' "
                "entry; a torch.optim optimizer's?): its per-parameter state "
                "does not carry over into the daemon's. Construct without "
                "loading (the first step starts the state, as a new "
                "torch.optim optimizer's does), or load what this "
                "optimizer's state_dict() or save_checkpoint() wrote")
        self._finish_interrupted_step()
        saved = state_dict["canzona"]
        if list(saved["names"]) != self._names:
            raise ValueError("state_dict: parameter names differ from this "
                             "optimizer's")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("state_dict: %d param_groups, this optimizer "
                             "has %d" % (len(groups), len(self.param_groups)))
        # Hugging Face Accelerate moves every tensor of a state_dict to the
        # GPU when it prepares the optimizer (its device_placement).
        blob = saved["state"].detach().cpu().contiguous().numpy()
        try:
            self.client.import_state(self.job_id, self.rank, blob,
                                     int(saved["step"]), saved["plan_digest"])
        except CanzonaError as error:
            if tuple(saved.get("rank", self.rank)) == tuple(self.rank):
                raise
            # The usual cause: one rank's file loaded on every rank (Hugging
            # Face's Trainer saves the optimizer of process 0 only).
            raise CanzonaError(
                "%s (this state_dict is rank %s's, this is rank %s: each "
                "rank loads the state_dict it saved, or every rank calls "
                "save_checkpoint(dir) and load_checkpoint(dir))"
                % (error, tuple(saved["rank"]), tuple(self.rank)),
                error.code) from None
        for group, packed in zip(self.param_groups, groups):
            # State dicts saved before param_groups spelled betas as torch
            # does hold beta1 and beta2.
            for key, value in _torch_spelling(packed).items():
                if key != "params":
                    group[key] = value
        self.steps = int(saved["step"])
        # The masters are the loaded ones now, whatever the loop wrote into
        # the parameters before.
        self._record_param_versions()

    def save_checkpoint(self, directory):
        """Collective over the job: the state of every rank into directory
        (relative to this process's working directory)."""
        self._check_open("save_checkpoint()")
        self._finish_interrupted_step()
        return self.client.save_checkpoint(self.job_id, self.rank,
                                           os.path.abspath(directory))

    def load_checkpoint(self, directory, strict=True):
        """Collective: loads a checkpoint saved in any layout. strict=False
        (torch's load_state_dict(strict=False)): a parameter the checkpoint
        has no record of (a layer unfrozen or added since it was saved)
        keeps its value and starts with fresh state, as a parameter added
        to torch.optim does, instead of raising; the result's "missing"
        names them. The checkpoint's records of parameters this optimizer
        lacks (frozen since) are ignored either way."""
        self._check_open("load_checkpoint()")
        self._finish_interrupted_step()
        result = self.client.load_checkpoint(
            self.job_id, self.rank, os.path.abspath(directory),
            allow_missing=not strict)
        self.steps = result["step"]
        self._record_param_versions()
        return result


def _refuse_distributed_checkpoint(call):
    """RuntimeError where torch.distributed.checkpoint calls ``call``
    (``get_state_dict``, ``get_optimizer_state_dict`` and their setters,
    torchtitan's checkpointer): it keeps an optimizer state_dict's "state"
    and "param_groups" only, so a checkpoint it saved would restore no
    optimizer state, found out only when loading it."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(
                "torch.distributed.checkpoint"):
            raise RuntimeError(
                "%s called by torch.distributed.checkpoint, which keeps an "
                "optimizer state_dict's 'state' and 'param_groups' only; "
                "canzona.torch's state lives in the daemon (the state_dict's "
                "'canzona' entry), so that checkpoint would restore none of "
                "it. Checkpoint the model with get_model_state_dict() and the "
                "optimizer with opt.save_checkpoint(dir) on every rank "
                "(opt.load_checkpoint(dir) restores it in any layout)" % call)
        frame = frame.f_back
