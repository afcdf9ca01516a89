"""Canzona: matrix optimizers (Muon, Shampoo, SOAP) as a per-node service.

The trainer side of Canzona in Python. ``canzona.Client`` talks to the
``canzonad`` on this machine; ``canzona.torch`` has drop-in
``torch.optim.Optimizer`` classes built on it.

    import canzona
    client = canzona.Client()                 # $CANZONA_TARGET or the local socket
    print(client.status())

Errors from the daemon raise ``canzona.CanzonaError`` whose ``code`` is the
gRPC status name ("INVALID_ARGUMENT", "UNAVAILABLE", ...).
"""

import json
import os

from canzona._canzona import CanzonaError, CudaEvent, SharedBuffer
from canzona import _canzona

__all__ = ["Client", "CanzonaError", "CudaEvent", "SharedBuffer",
           "default_target"]


def default_target():
    """The daemon address: $CANZONA_TARGET, else the local daemon's socket."""
    target = os.environ.get("CANZONA_TARGET")
    if target:
        return target
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return "unix:%s/canzona/canzonad.sock" % runtime
    return "unix:/tmp/canzona-%d/canzonad.sock" % os.getuid()


class Client:
    """A connection to one canzonad (thread-safe).

    Raises CanzonaError with code UNAVAILABLE and "cannot reach canzonad at
    <target>" when no daemon answers within ``connect_timeout`` seconds.
    """

    def __init__(self, target=None, job_token=None, connect_timeout=10.0,
                 register_timeout=600.0, step_timeout=600.0,
                 checkpoint_timeout=1800.0, tls_ca=None):
        self.target = target or default_target()
        # TCP daemons want the job token (a bearer token) and, with TLS,
        # the CA: $CANZONA_JOB_TOKEN / $CANZONA_TLS_CA by default.
        if job_token is None:
            job_token = os.environ.get("CANZONA_JOB_TOKEN", "")
        if tls_ca is None:
            tls_ca = os.environ.get("CANZONA_TLS_CA", "")
        self._client = _canzona.Client(
            self.target, job_token, connect_timeout, register_timeout,
            step_timeout, checkpoint_timeout, tls_ca)

    def allocate(self, job_id, global_rank, nbytes):
        """A new shared-memory buffer the daemon may map (buffer protocol)."""
        return self._client.allocate(job_id, global_rank, nbytes)

    def register(self, job_id, layout, rank, groups, parameters,
                 strategy="cost", alpha=0.0, bucket_size=0,
                 shard_group_size=0):
        """Registers one rank; returns when every rank of the job has.

        layout and rank are (pp, dp, tp); groups are (name, optimizer,
        settings dict); parameters are dicts with name, shape (global),
        tp_split_dim, group, param and grad ((shm name, offset, nbytes)).
        shard_group_size: hierarchical sharding (0: flat). The result's
        "buckets" lists each gradient bucket's parameter indices, in the
        order backward fills them.
        """
        return self._client.register(job_id, tuple(layout), tuple(rank),
                                     [tuple(g) for g in groups], parameters,
                                     strategy, alpha, bucket_size,
                                     shard_group_size)

    def step(self, job_id, rank, step, lr=None, grad_scale=0.0,
             async_params=False):
        """Runs optimizer step ``step``; returns its statistics. With
        async_params it returns after the update and the parameters arrive
        per bucket (wait_params)."""
        return self._client.step(job_id, tuple(rank), step, lr or {},
                                 grad_scale, async_params)

    def grad_ready(self, job_id, rank, step, buckets):
        """Backward finished these buckets of ``step``: the daemon starts
        their reduction now (before step())."""
        self._client.grad_ready(job_id, tuple(rank), step, list(buckets))

    def wait_params(self, job_id, rank, step, bucket=-1):
        """Blocks until ``bucket`` (-1: all) holds step ``step``'s update;
        returns the seconds it waited."""
        return self._client.wait_params(job_id, tuple(rank), step, bucket)

    def plan(self, job_id):
        """The job's plan (the planner's JSON, parsed) and its digest."""
        text, digest = self._client.get_plan(job_id)
        return json.loads(text), digest

    def deregister(self, job_id, rank):
        self._client.deregister(job_id, tuple(rank))

    def status(self):
        """The daemon's jobs, ranks and last step times."""
        return json.loads(self._client.status_json())

    def save_checkpoint(self, job_id, rank, directory, at_step=0):
        """Collective: every rank of the job calls it between the same steps."""
        return self._client.save_checkpoint(job_id, tuple(rank), directory,
                                            at_step)

    def load_checkpoint(self, job_id, rank, directory):
        """Collective: loads the state this rank owns (any saving layout)."""
        return self._client.load_checkpoint(job_id, tuple(rank), directory)

    def export_state(self, job_id, rank):
        """This rank's state as bytes, with its step and plan digest."""
        return self._client.export_state(job_id, tuple(rank))

    def import_state(self, job_id, rank, state, step, plan_digest):
        return self._client.import_state(job_id, tuple(rank), bytes(state),
                                         step, plan_digest)
