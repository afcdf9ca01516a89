"""The step doorbell from Python: a local trainer's step calls (Step,
GradReady, WaitParams) through shared memory and futexes instead of gRPC
calls.

The protocol is the C++ one (proto/shared_memory/step_doorbell.{h,cc}); both sides
must agree on it byte for byte:

- the object is a 4096-byte header, a 64 KiB request area and a 64 KiB
  response area, created by the trainer (mode 0600) and named like its
  tensor buffers; the daemon maps it after AttachStepDoorbell;
- header words (native-endian uint32 / int32): magic "CZDB" at 0,
  version 2 at 4, request_seq at 8, response_seq at 12, heartbeat at 16,
  request_bytes at 20, response_bytes at 24, status_code at 28,
  request_method at 32 (STEP 0, GRAD_READY 1, WAIT_PARAMS 2);
- a call writes the serialized request (StepRequest, GradReadyRequest,
  WaitParamsRequest), request_bytes and request_method, bumps request_seq
  and wakes it; the daemon writes the serialized response (or, for a
  status that is not OK, its message), response_bytes and status_code,
  then sets response_seq to the request's seq and wakes it;
- while the daemon serves the doorbell it holds a shared flock(2) on the
  object; a waiting call that can take it exclusively knows nobody serves
  it (the daemon exited or detached it) and fails at once.

Python writes the words with plain 32-bit stores and reads them with plain
loads, which order as release / acquire only on x86-64 (total store
order); elsewhere ``supported()`` is False and steps stay on gRPC. The
futex calls go through ctypes, which releases the GIL while they sleep.

Thread-safety: one thread calls ``call`` at a time (the client holds a
lock per doorbell).
"""

import ctypes
import ctypes.util
import fcntl
import os
import platform
import time

from canzona._errors import CanzonaError
from canzona._shm import SHM_DIR, SharedBuffer, next_shm_seq, shm_name

_MAGIC = 0x42445A43  # "CZDB"
_VERSION = 2  # 2: the serving lock and the request_method word
_HEADER_BYTES = 4096
MAX_PAYLOAD_BYTES = 64 * 1024
OBJECT_BYTES = _HEADER_BYTES + 2 * MAX_PAYLOAD_BYTES
_REQUEST_AREA = _HEADER_BYTES
# The request_method word's values (StepDoorbell::Method).
STEP, GRAD_READY, WAIT_PARAMS = 0, 1, 2
_RESPONSE_AREA = _HEADER_BYTES + MAX_PAYLOAD_BYTES
# Without a heartbeat for this long the daemon is gone (the C++ client's
# StepDoorbell::kDaemonSilence).
DAEMON_SILENCE = 10.0
# How often a waiting call looks at its deadline and the heartbeat.
_TICK = 0.05

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT32_MAX = 2**31 - 1

# absl::StatusCode values, by the names CanzonaError carries.
_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
          "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
          "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
          "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")

# The name's rank field is past any world's ranks and unique per process,
# its seq unique to this process (as the C++ client names them).
_DOORBELL_RANKS = 1 << 40


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                            use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def supported():
    """Whether this process can ring a doorbell: Linux on x86-64 with the
    protobuf messages importable (the payloads are serialized protos)."""
    if not (platform.system() == "Linux" and
            platform.machine() in ("x86_64", "AMD64")):
        return False
    try:
        from canzona._proto import optimizer_service_pb2  # noqa: F401
    except Exception:  # protobuf missing or too old for the stubs
        return False
    return True


class StepDoorbell:
    """Owns the shared-memory object (unlinked at close), the ctypes
    views of its header words and a descriptor that probes the serving
    lock."""

    def __init__(self, job_id):
        self._shm = SharedBuffer.create(
            shm_name(job_id, _DOORBELL_RANKS + os.getpid(), next_shm_seq()),
            OBJECT_BYTES)
        words = [ctypes.c_uint32.from_buffer(self._shm, 4 * i)
                 for i in range(7)]
        (magic, version, self._request_seq, self._response_seq,
         self._heartbeat, self._request_bytes, self._response_bytes) = words
        self._status_code = ctypes.c_int32.from_buffer(self._shm, 28)
        self._request_method = ctypes.c_uint32.from_buffer(self._shm, 32)
        magic.value = _MAGIC
        version.value = _VERSION
        del magic, version, words
        try:
            self._lock_fd = os.open(SHM_DIR + self._shm.name,
                                    os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            name, self._lock_fd = self._shm.name, None
            self.close()
            raise CanzonaError("shm_open (serving lock) %s: %s"
                               % (name, e.strerror), "INTERNAL") from None
        self._futex = _syscall()
        self._timespec = _Timespec()

    @property
    def name(self):
        return self._shm.name

    def _daemon_holds_lock(self):
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            # Held (EWOULDBLOCK), or an error that says nothing about the
            # daemon: the heartbeat decides.
            return True
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def _wake(self, word):
        self._futex(ctypes.c_long(_SYS_FUTEX_X86_64),
                    ctypes.c_void_p(ctypes.addressof(word)),
                    ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(_INT32_MAX),
                    None, None, ctypes.c_int(0))

    def _wait(self, word, expected, seconds):
        ts = self._timespec
        seconds = max(seconds, 0.0)
        ts.tv_sec = int(seconds)
        ts.tv_nsec = int((seconds - int(seconds)) * 1e9)
        self._futex(ctypes.c_long(_SYS_FUTEX_X86_64),
                    ctypes.c_void_p(ctypes.addressof(word)),
                    ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint32(expected),
                    ctypes.byref(ts), None, ctypes.c_int(0))

    def call(self, request, timeout, daemon_silence=DAEMON_SILENCE,
             method=STEP):
        """Sends ``request`` (the serialized request of ``method``) and
        returns the daemon's response bytes;
        CanzonaError with the daemon's status, DEADLINE_EXCEEDED past
        ``timeout`` seconds, UNAVAILABLE as soon as no daemon holds the
        serving lock (it exited or detached the doorbell) or after
        ``daemon_silence`` seconds without a heartbeat (it hangs)."""
        if len(request) > MAX_PAYLOAD_BYTES:
            raise CanzonaError(
                "doorbell request of %d bytes exceeds the doorbell's %d"
                % (len(request), MAX_PAYLOAD_BYTES), "INVALID_ARGUMENT")
        if self._shm is None:
            raise CanzonaError("step doorbell is closed", "FAILED_PRECONDITION")
        self._shm[_REQUEST_AREA:_REQUEST_AREA + len(request)] = request
        self._request_bytes.value = len(request)
        self._request_method.value = method
        seq = (self._request_seq.value + 1) & 0xFFFFFFFF
        self._request_seq.value = seq
        self._wake(self._request_seq)
        now = time.monotonic()
        deadline = now + timeout
        beat, beat_seen = self._heartbeat.value, now
        # The lock is probed only once a wait did not bring the answer.
        waited = False
        while True:
            answered = self._response_seq.value
            if answered == seq:
                break
            now = time.monotonic()
            if now >= deadline:
                raise CanzonaError("the daemon did not answer the step "
                                   "doorbell before the deadline",
                                   "DEADLINE_EXCEEDED")
            if waited and not self._daemon_holds_lock():
                raise CanzonaError(
                    "canzonad no longer serves the step doorbell '%s' (it "
                    "exited or detached the doorbell)" % self.name,
                    "UNAVAILABLE")
            b = self._heartbeat.value
            if b != beat:
                beat, beat_seen = b, now
            elif now - beat_seen > daemon_silence:
                raise CanzonaError(
                    "canzonad stopped serving the step doorbell '%s' (no "
                    "heartbeat for %gs)" % (self.name, daemon_silence),
                    "UNAVAILABLE")
            self._wait(self._response_seq, answered,
                       min(_TICK, deadline - now))
            waited = True
        n = min(self._response_bytes.value, MAX_PAYLOAD_BYTES)
        payload = self._shm[_RESPONSE_AREA:_RESPONSE_AREA + n]
        code = self._status_code.value
        if code == 0:
            return payload
        message = payload.decode("utf-8", "replace")
        if not 0 < code < len(_CODES):
            raise CanzonaError("doorbell status %d: %s" % (code, message),
                               "UNKNOWN")
        raise CanzonaError(message, _CODES[code])

    def close(self):
        """Unlinks and unmaps the object (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._shm is None:
            return
        # The ctypes views export the mapping: drop them first.
        del (self._request_seq, self._response_seq, self._heartbeat,
             self._request_bytes, self._response_bytes, self._status_code,
             self._request_method)
        self._shm.close()
        self._shm = None


def _set_rank(request, rank):
    pp, dp, tp = rank
    request.rank.pp_rank, request.rank.dp_rank, request.rank.tp_rank = (
        int(pp), int(dp), int(tp))


def encode_step(job_id, rank, step, lr, grad_scale, async_params,
                max_grad_norm, settings=None, reload_params=()):
    """A serialized StepRequest (the fields Client.step sends)."""
    from canzona._proto import optimizer_service_pb2 as pb
    request = pb.StepRequest(job_id=job_id, step=int(step),
                             grad_scale=float(grad_scale),
                             async_params=bool(async_params),
                             max_grad_norm=float(max_grad_norm))
    _set_rank(request, rank)
    for group, value in (lr or {}).items():
        request.lr[str(group)] = float(value)
    for group, values in (settings or {}).items():
        for key, value in values.items():
            request.settings[str(group)].values[str(key)] = float(value)
    request.reload_params.extend(int(j) for j in reload_params)
    return request.SerializeToString()


def encode_grad_ready(job_id, rank, step, buckets):
    """A serialized GradReadyRequest."""
    from canzona._proto import optimizer_service_pb2 as pb
    request = pb.GradReadyRequest(job_id=job_id, step=int(step),
                                  buckets=[int(b) for b in buckets])
    _set_rank(request, rank)
    return request.SerializeToString()


def encode_wait_params(job_id, rank, step, bucket):
    """A serialized WaitParamsRequest."""
    from canzona._proto import optimizer_service_pb2 as pb
    request = pb.WaitParamsRequest(job_id=job_id, step=int(step),
                                   bucket=int(bucket))
    _set_rank(request, rank)
    return request.SerializeToString()


def _parse(message_class, payload):
    try:
        return message_class.FromString(payload)
    except Exception as e:  # DecodeError; the daemon wrote garbage
        raise CanzonaError("step doorbell: unreadable %s (%s)"
                           % (message_class.__name__, e), "INTERNAL") from None


def decode_wait_params(payload):
    """The seconds a serialized WaitParamsResponse says the rank waited."""
    from canzona._proto import optimizer_service_pb2 as pb
    return _parse(pb.WaitParamsResponse, payload).waited_seconds


def decode_step(payload, phases):
    """A serialized StepResponse as the JSON-mapping dict Client.step reads
    (the phases it reports, the statistics)."""
    from canzona._proto import optimizer_service_pb2 as pb
    r = _parse(pb.StepResponse, payload)
    return {"seconds": {p: getattr(r.seconds, p) for p in phases},
            "grad_norm": r.grad_norm, "update_rms": r.update_rms,
            "skipped_nonfinite": r.skipped_nonfinite,
            "clip_factor": r.clip_factor, "host_waits": r.host_waits,
            "pageable_copies": r.pageable_copies}
