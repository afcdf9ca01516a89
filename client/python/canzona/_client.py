"""canzona.Client: one client over two transports.

The client builds every request as a dict in the protobuf JSON mapping
(original field names) and reads responses the same way, so that it needs
no protobuf at all: with grpcio importable the grpc transport turns the
dicts into messages for the generated stubs; otherwise (or with
CANZONA_TRANSPORT=bridge) the bridge transport sends them as JSON lines to
a canzona-bridge child. Responses are read with defaults for absent fields
and int64 fields (strings in the JSON mapping) turned into ints, so both
transports give the same results.

Thread-safety: a Client may be used from several threads.
"""

import base64
import json
import os
import threading

from canzona import _cuda
from canzona import _doorbell
from canzona._errors import CanzonaError
from canzona._phases import DP_COMM, STEP_PHASES
from canzona._shm import SharedBuffer, next_shm_seq, shm_name
from canzona._targets import default_target, is_unix_target

_TRANSPORTS = ("auto", "grpc", "bridge")
# ExportState / ImportState move a rank's state in parts of this many bytes
# (the daemon receives 64 MiB per message by default).
STATE_PART_BYTES = 32 << 20
_PHASES = STEP_PHASES + DP_COMM

# Element types of parameter buffers, by the names torch and numpy use.
_DTYPES = {"float32": "DTYPE_FLOAT32", "bfloat16": "DTYPE_BFLOAT16",
           "float16": "DTYPE_FLOAT16"}


class Options:
    """How to reach the daemon (what both transports are given)."""

    def __init__(self, target, job_token, tls_ca, connect_timeout,
                 register_timeout, step_timeout, checkpoint_timeout):
        self.target = target
        self.job_token = job_token
        self.tls_ca = tls_ca
        self.connect_timeout = float(connect_timeout)
        self.register_timeout = float(register_timeout)
        self.step_timeout = float(step_timeout)
        self.checkpoint_timeout = float(checkpoint_timeout)


def _open_transport(options, transport):
    """The transport `transport` names ("auto": grpc where importable)."""
    transport = transport or os.environ.get("CANZONA_TRANSPORT") or "auto"
    if transport not in _TRANSPORTS:
        raise ValueError("CANZONA_TRANSPORT / transport: %r is not one of %s"
                         % (transport, ", ".join(_TRANSPORTS)))
    grpc_missing = None
    if transport in ("auto", "grpc"):
        try:
            from canzona._grpc_transport import GrpcTransport
        # Not only ImportError: a grpcio / protobuf that imports but cannot
        # load the stubs is as unusable.
        except Exception as e:  # noqa: BLE001
            if transport == "grpc":
                raise CanzonaError(
                    "transport grpc: grpcio / protobuf are not importable "
                    "(%s): pip install grpcio protobuf" % e,
                    "FAILED_PRECONDITION") from None
            grpc_missing = str(e)
        else:
            return GrpcTransport(options)
    from canzona._bridge_transport import BridgeTransport, find_bridge
    executable = find_bridge()
    if executable is None:
        raise CanzonaError(
            "no transport to canzonad: %scanzona-bridge is neither "
            "$CANZONA_BRIDGE, on PATH, nor next to the package (pip install "
            "grpcio protobuf, or put canzona-bridge on PATH)"
            % ("grpcio / protobuf are not importable (%s) and " % grpc_missing
               if grpc_missing else ""), "FAILED_PRECONDITION")
    return BridgeTransport(options, executable)


def _double(value):
    """A double for the JSON mapping, where NaN and the infinities are
    strings (a JSON line cannot hold them as numbers)."""
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _int(value):
    """An int64 field (a string in the JSON mapping) or a default 0."""
    return int(value or 0)


def _check_part_bytes(part_bytes):
    if not isinstance(part_bytes, int) or part_bytes <= 0:
        raise ValueError("part_bytes: %r must be an int > 0" % (part_bytes,))


def _rank(rank):
    pp, dp, tp = rank
    return {"pp_rank": int(pp), "dp_rank": int(dp), "tp_rank": int(tp)}


def _buffer_ref(ref, where):
    """(shm name, offset, nbytes), or ("cuda", device pointer, nbytes[,
    event handle]) for a GPU tensor exported with CUDA IPC."""
    ref = tuple(ref)
    if len(ref) in (3, 4) and isinstance(ref[0], str) and ref[0] == "cuda":
        return _cuda.buffer_ref(int(ref[1]), int(ref[2]),
                                ref[3] if len(ref) == 4 else b"")
    if len(ref) != 3:
        raise ValueError(where + " must be (shm name, offset, nbytes) or "
                         "(\"cuda\", device pointer, nbytes[, event handle])")
    return {"shm": {"name": str(ref[0]), "offset": int(ref[1]),
                    "bytes": int(ref[2])}}


def _retire(attached):
    """Closes a (doorbell, lock) pair once its caller, if any, is done."""
    bell, lock = attached
    with lock:
        bell.close()


def _ring(attached, method, request, timeout):
    """One call through an attached (doorbell, lock) pair: its response
    bytes."""
    bell, lock = attached
    with lock:
        return bell.call(request, timeout, method=method)


class Client:
    """A connection to one canzonad (thread-safe).

    Raises CanzonaError with code UNAVAILABLE and "cannot reach canzonad at
    <target>" when no daemon answers within ``connect_timeout`` seconds.
    ``transport``: "grpc", "bridge" or "auto" (default $CANZONA_TRANSPORT,
    else auto: grpc where grpcio and protobuf import, else canzona-bridge).
    """

    def __init__(self, target=None, job_token=None, connect_timeout=10.0,
                 register_timeout=600.0, step_timeout=600.0,
                 checkpoint_timeout=1800.0, tls_ca=None, transport=None):
        self.target = target or default_target()
        # TCP daemons want the job token (a bearer token) and, with TLS,
        # the CA: $CANZONA_JOB_TOKEN / $CANZONA_TLS_CA by default.
        if job_token is None:
            job_token = os.environ.get("CANZONA_JOB_TOKEN", "")
        if tls_ca is None:
            tls_ca = os.environ.get("CANZONA_TLS_CA", "")
        self._job_token = job_token
        self._transport = _open_transport(
            Options(self.target, job_token, tls_ca, connect_timeout,
                    register_timeout, step_timeout, checkpoint_timeout),
            transport)
        self._step_timeout = step_timeout
        # (job_id, rank) -> (StepDoorbell, the lock one caller holds).
        self._doorbells = {}
        self._doorbells_lock = threading.Lock()

    @property
    def transport(self):
        """"grpc" or "bridge"."""
        return self._transport.name

    def close(self):
        """Ends the connection (and a bridge child); idempotent."""
        with self._doorbells_lock:
            doorbells, self._doorbells = self._doorbells, {}
        for attached in doorbells.values():
            _retire(attached)
        self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        return self._transport.call(method, request)

    def allocate(self, job_id, global_rank, nbytes):
        """A new shared-memory buffer the daemon may map (buffer protocol),
        named /canzona.<job>.<rank>.<seq> (seq unique to this process)."""
        if nbytes <= 0:
            raise ValueError("nbytes must be > 0")
        return SharedBuffer.create(
            shm_name(job_id, int(global_rank), next_shm_seq()), int(nbytes))

    def register(self, job_id, layout, rank, groups, parameters,
                 strategy="cost", alpha=0.0, bucket_size=0,
                 shard_group_size=0, max_grad_norm=0.0,
                 grad_reduce_dtype=None, params_events=False):
        """Registers one rank; returns when every rank of the job has.

        layout and rank are (pp, dp, tp); groups are (name, optimizer,
        settings dict); parameters are dicts with name, shape (global),
        tp_split_dim, group, param and grad ((shm name, offset, nbytes) or
        ("cuda", device pointer, nbytes[, event handle])), and optionally
        dtype ("float32", the default, "bfloat16" or "float16": the
        buffers' element type; the daemon keeps fp32 master weights of
        bf16 / fp16 parameters) and blocks (a fused matrix's blocks, from
        canzona.blocks / megatron_qkv_blocks / megatron_fc1_blocks).
        shard_group_size: hierarchical sharding (0: flat). max_grad_norm:
        clip the gradients at this global L2 norm in every step (0: no
        clipping). grad_reduce_dtype: None (DP sums in the parameters'
        dtype) or "float32" (Megatron's grad_reduce_in_fp32). The result's
        "buckets" lists each gradient bucket's parameter indices, in the
        order backward fills them; "master_bytes", "state_bytes" and
        "buffer_bytes" the daemon's memory for this rank;
        "pageable_host_bytes" the host memory meeting the GPU the driver
        refused to page-lock (the daemon's memlock limit; 0 normally).
        params_events
        (CUDA buffers): the daemon answers step / wait_params without
        waiting for its GPU writes and records, per bucket, an
        interprocess event after them instead; "params_event_handles"
        gives each bucket's handle (CudaEvent.opened), empty where not
        granted (the Gloo plane: the answers wait). The stream that touches
        the buffers must wait for a bucket's event after each answer that
        hands over that bucket (step: all; wait_params: that bucket, -1:
        all).
        """
        if grad_reduce_dtype not in (None, "float32"):
            raise ValueError("grad_reduce_dtype: %r is not None or 'float32'"
                             % (grad_reduce_dtype,))
        pp, dp, tp = layout
        request_groups = []
        for group in groups:
            group = tuple(group)
            if len(group) != 3:
                raise ValueError(
                    "groups: (name, optimizer, settings) expected")
            name, optimizer, settings = group
            request_groups.append({
                "name": str(name), "optimizer": str(optimizer),
                "settings": [{"key": str(k), "value": str(v)}
                             for k, v in dict(settings).items()]})
        request_parameters = []
        for p in parameters:
            name = str(p["name"])
            dtype = str(p.get("dtype", "float32"))
            if dtype not in _DTYPES:
                raise ValueError("parameter %s dtype: %r is not one of %s"
                                 % (name, dtype, sorted(_DTYPES)))
            entry = {
                "name": name,
                "shape": [int(d) for d in p["shape"]],
                "dtype": _DTYPES[dtype],
                "tp_split_dim": int(p["tp_split_dim"]),
                "group": str(p["group"]),
                "param": _buffer_ref(p["param"], "parameter %s param" % name),
                "grad": _buffer_ref(p["grad"], "parameter %s grad" % name),
            }
            if p.get("blocks"):
                spec = dict(p["blocks"])
                entry["blocks"] = {
                    "dim": int(spec.get("dim", 0)),
                    "sizes": [str(int(s)) for s in spec["sizes"]],
                    "repeat": str(int(spec.get("repeat", 1))),
                    "merge_repeats": bool(spec.get("merge_repeats", False)),
                    "names": [str(n) for n in spec.get("names", [])]}
            request_parameters.append(entry)
        r = self._call("Register", {
            "job_id": job_id, "job_token": self._job_token,
            "layout": {"pp": int(pp), "dp": int(dp), "tp": int(tp)},
            "rank": _rank(rank), "groups": request_groups,
            "parameters": request_parameters, "strategy": strategy,
            "alpha": _double(alpha), "bucket_size": int(bucket_size),
            "shard_group_size": int(shard_group_size),
            "max_grad_norm": _double(max_grad_norm),
            "grad_reduce_dtype": ("DTYPE_FLOAT32" if grad_reduce_dtype
                                  else "DTYPE_UNSPECIFIED"),
            "params_events": bool(params_events)})
        return {
            "plan_digest": r.get("plan_digest", ""),
            "owned_parameters": int(r.get("owned_parameters", 0)),
            "state_bytes": _int(r.get("state_bytes")),
            "master_bytes": _int(r.get("master_bytes")),
            "buffer_bytes": _int(r.get("buffer_bytes")),
            "pageable_host_bytes": _int(r.get("pageable_host_bytes")),
            # Per bucket, the indices of its parameters (in `parameters`).
            "buckets": [[int(j) for j in b.get("parameters", [])]
                        for b in r.get("buckets", [])],
            "params_event_handles": [
                base64.b64decode(b.get("params_event_handle", ""))
                for b in r.get("buckets", [])],
        }

    def step(self, job_id, rank, step, lr=None, grad_scale=0.0,
             async_params=False, max_grad_norm=0.0, settings=None,
             reload_params=()):
        """Runs optimizer step ``step``; returns its statistics (grad_norm
        before clipping, clip_factor, update_rms of the previous step's
        update, host_waits: the daemon's host round trips in it, and
        pageable_copies: its copies between the GPU and host memory that
        was not page-locked, 0 unless the memlock limit refused it). With
        async_params it returns after the update and the parameters arrive
        per bucket (wait_params). max_grad_norm > 0 clips this step at that
        norm instead of the job's. settings: {group: {key: value}} for this
        step only, like lr (StepRequest.settings: muon momentum and
        weight_decay; adamw and soap beta1, beta2, eps and weight_decay;
        shampoo beta1 where registered > 0, beta2, epsilon and
        weight_decay). reload_params: indices of the registered parameters
        whose values this trainer changed since its last step (their
        masters are read from it again: StepRequest.reload_params)."""
        attached = self._doorbell_of(job_id, rank)
        if attached is not None:
            r = _doorbell.decode_step(_ring(
                attached, _doorbell.STEP,
                _doorbell.encode_step(job_id, rank, step, lr, grad_scale,
                                      async_params, max_grad_norm, settings,
                                      reload_params),
                self._step_timeout), _PHASES)
        else:
            r = self._call("Step", {
                "job_id": job_id, "rank": _rank(rank), "step": int(step),
                "lr": {str(g): _double(v) for g, v in (lr or {}).items()},
                "grad_scale": _double(grad_scale),
                "async_params": bool(async_params),
                "max_grad_norm": _double(max_grad_norm),
                "settings": {
                    str(g): {"values": {str(k): _double(v)
                                        for k, v in values.items()}}
                    for g, values in (settings or {}).items()},
                "reload_params": [int(j) for j in reload_params]})
        seconds = r.get("seconds", {})
        return {
            "seconds": {p: float(seconds.get(p, 0.0)) for p in _PHASES},
            "grad_norm": float(r.get("grad_norm", 0.0)),
            "update_rms": float(r.get("update_rms", 0.0)),
            "skipped_nonfinite": bool(r.get("skipped_nonfinite", False)),
            "clip_factor": float(r.get("clip_factor", 1.0)),
            # int64 is a string in the JSON mapping.
            "host_waits": int(r.get("host_waits", 0)),
            "pageable_copies": int(r.get("pageable_copies", 0)),
        }

    def attach_step_doorbell(self, job_id, rank):
        """From now on this rank's step calls (step, grad_ready,
        wait_params) ring a doorbell in shared memory
        instead of making a gRPC call (a local daemon, after register).
        FAILED_PRECONDITION where that cannot work: a TCP target, or a
        platform without the doorbell (see ``step_doorbell_supported``)."""
        if not is_unix_target(self.target):
            raise CanzonaError(
                "attach_step_doorbell: a step doorbell is shared memory on "
                "the daemon's node; %s is not its unix socket" % self.target,
                "FAILED_PRECONDITION")
        if not self.step_doorbell_supported():
            raise CanzonaError(
                "attach_step_doorbell: needs the grpc transport (the daemon "
                "watches the attaching process), Linux on x86-64 and "
                "protobuf", "FAILED_PRECONDITION")
        bell = _doorbell.StepDoorbell(job_id)
        try:
            self._call("AttachStepDoorbell", {
                "job_id": job_id, "rank": _rank(rank), "shm_name": bell.name})
        except BaseException:
            bell.close()
            raise
        with self._doorbells_lock:
            previous = self._doorbells.get((job_id, tuple(rank)))
            self._doorbells[(job_id, tuple(rank))] = (bell, threading.Lock())
        if previous is not None:
            _retire(previous)

    def step_doorbell_supported(self):
        """Whether attach_step_doorbell can work from here: the daemon's
        unix socket as the target, the grpc transport (the daemon watches
        the attaching process), Linux on x86-64 and protobuf."""
        return (is_unix_target(self.target) and self.transport == "grpc" and
                _doorbell.supported())

    def _doorbell_of(self, job_id, rank):
        """The rank's attached (doorbell, lock), or None."""
        with self._doorbells_lock:
            return self._doorbells.get((job_id, tuple(rank)))

    def _drop_doorbell(self, job_id, rank):
        with self._doorbells_lock:
            attached = self._doorbells.pop((job_id, tuple(rank)), None)
        if attached is not None:
            _retire(attached)

    def grad_ready(self, job_id, rank, step, buckets):
        """Backward finished these buckets of ``step``: the daemon starts
        their reduction now (before step()). Through the rank's doorbell
        when one is attached, like step()."""
        attached = self._doorbell_of(job_id, rank)
        if attached is not None:
            _ring(attached, _doorbell.GRAD_READY,
                  _doorbell.encode_grad_ready(job_id, rank, step, buckets),
                  self._step_timeout)
            return
        self._call("GradReady", {
            "job_id": job_id, "rank": _rank(rank), "step": int(step),
            "buckets": [int(b) for b in buckets]})

    def wait_params(self, job_id, rank, step, bucket=-1):
        """Blocks until ``bucket`` (-1: all) holds step ``step``'s update;
        returns the seconds it waited. Through the rank's doorbell when one
        is attached."""
        attached = self._doorbell_of(job_id, rank)
        if attached is not None:
            return float(_doorbell.decode_wait_params(_ring(
                attached, _doorbell.WAIT_PARAMS,
                _doorbell.encode_wait_params(job_id, rank, step, bucket),
                self._step_timeout)))
        r = self._call("WaitParams", {
            "job_id": job_id, "rank": _rank(rank), "step": int(step),
            "bucket": int(bucket)})
        return float(r.get("waited_seconds", 0.0))

    def plan(self, job_id):
        """The job's plan (the planner's JSON, parsed) and its digest."""
        r = self._call("GetPlan", {"job_id": job_id})
        return json.loads(r.get("plan_json", "")), r.get("digest", "")

    def deregister(self, job_id, rank):
        self._call("Deregister", {"job_id": job_id,
                                  "job_token": self._job_token,
                                  "rank": _rank(rank)})
        # The daemon detached the rank's doorbell: steps of a later job go
        # over gRPC until it attaches a new one.
        self._drop_doorbell(job_id, rank)

    def status(self):
        """The daemon's jobs, ranks and last step times (GetStatusResponse
        in the JSON mapping: int64 fields are strings)."""
        return self._call("GetStatus", {})

    def save_checkpoint(self, job_id, rank, directory, at_step=0):
        """Collective: every rank of the job calls it between the same steps."""
        r = self._call("SaveCheckpoint", {
            "job_id": job_id, "rank": _rank(rank), "dir": str(directory),
            "at_step": int(at_step)})
        return {"step": _int(r.get("step")),
                "records": int(r.get("records", 0)),
                "bytes": _int(r.get("bytes")),
                "seconds": float(r.get("seconds", 0.0))}

    def load_checkpoint(self, job_id, rank, directory, allow_missing=False):
        """Collective: loads the state this rank owns (any saving layout).
        allow_missing: parameters the checkpoint has no record of keep
        their state and values ("missing" names them) instead of
        NOT_FOUND."""
        r = self._call("LoadCheckpoint", {
            "job_id": job_id, "rank": _rank(rank), "dir": str(directory),
            "allow_missing": bool(allow_missing)})
        return {"step": _int(r.get("step")),
                "records": int(r.get("records", 0)),
                "seconds": float(r.get("seconds", 0.0)),
                "missing": list(r.get("missing", []))}

    def _state_call(self, method, request):
        """One ExportState / ImportState call: ``request`` and the answer
        as the JSON mapping, but with ``state`` as bytes. Over grpc the
        bytes travel as protobuf bytes (call_message); the bridge's JSON
        lines take the mapping's base64."""
        raw = getattr(self._transport, "call_message", None)
        if raw is None:
            if "state" in request:
                request = dict(request, state=base64.b64encode(
                    request["state"]).decode())
            r = self._call(method, request)
            return dict(r, state=base64.b64decode(r.get("state", "")))
        from canzona._proto import optimizer_service_pb2 as pb
        if "state" in request:
            request = dict(request, state=bytes(request["state"]))
        r = raw(method, getattr(pb, method + "Request")(**request))
        return {name: getattr(r, name) for name in
                ("state", "total_bytes", "step", "plan_digest", "records")
                if hasattr(r, name)}

    def export_state(self, job_id, rank, part_bytes=STATE_PART_BYTES):
        """This rank's state (a bytearray), with its step and plan digest,
        read in parts of ``part_bytes``."""
        _check_part_bytes(part_bytes)
        request = {"job_id": job_id, "rank": _rank(rank),
                   "max_bytes": int(part_bytes)}
        state = bytearray()
        while True:
            r = self._state_call("ExportState",
                                 dict(request, offset=len(state)))
            total = _int(r.get("total_bytes"))
            if not r["state"] and len(state) < total:
                raise CanzonaError("ExportState: an empty part at offset %d "
                                   "of %d" % (len(state), total), "DATA_LOSS")
            state += r["state"]
            if len(state) >= total:
                break
        return {"state": state, "step": _int(r.get("step")),
                "plan_digest": r.get("plan_digest", ""),
                "records": int(r.get("records", 0))}

    def import_state(self, job_id, rank, state, step, plan_digest,
                     part_bytes=STATE_PART_BYTES):
        """Puts this rank's state back (``state``: what export_state
        returned), sent in parts of ``part_bytes``."""
        _check_part_bytes(part_bytes)
        view = memoryview(state).cast("B")
        total = len(view)
        request = {"job_id": job_id, "rank": _rank(rank), "step": int(step),
                   "plan_digest": plan_digest}
        if total > part_bytes:
            request["total_bytes"] = total
        for at in range(0, max(total, 1), part_bytes):
            r = self._state_call("ImportState", dict(
                request, offset=at, state=view[at:at + part_bytes]))
        return {"step": _int(r.get("step")),
                "records": int(r.get("records", 0))}
