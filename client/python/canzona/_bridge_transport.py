"""The canzona-bridge transport, for interpreters without grpcio/protobuf.

canzona-bridge (client/bridge, a C++ program linking the C++ client) runs
as a child process and speaks newline-delimited JSON on its stdin/stdout:

    -> {"id": 7, "method": "Step", "request": {...JSON mapping...}}
    <- {"id": 7, "response": {...}}   or
    <- {"id": 7, "error": {"code": "INVALID_ARGUMENT", "message": "..."}}

Its first line (id 0) says whether it reached the daemon. Requests run
concurrently in the bridge and answers come back tagged by id: callers
write their line under a lock and wait; one reader thread hands each answer
to its caller. The target, timeouts, job token and TLS CA go to the bridge
on its command line and environment, and the bridge applies them exactly
as the C++ client does. Closing the transport (or the bridge dying) fails
calls still waiting with UNAVAILABLE; the bridge exits when its stdin
closes, so it never outlives this process.

Thread-safety: thread-safe.
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import weakref

from canzona._errors import CanzonaError

_EXECUTABLE = "canzona-bridge"


def find_bridge():
    """canzona-bridge: $CANZONA_BRIDGE, else on PATH, else next to the
    package (beside or inside its folder); None when there is none."""
    explicit = os.environ.get("CANZONA_BRIDGE")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise CanzonaError("CANZONA_BRIDGE=%s is not an executable file"
                               % explicit, "FAILED_PRECONDITION")
        return explicit
    on_path = shutil.which(_EXECUTABLE)
    if on_path:
        return on_path
    package = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.dirname(package), package):
        candidate = os.path.join(folder, _EXECUTABLE)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


class _Waiter:
    __slots__ = ("done", "answer")

    def __init__(self):
        self.done = threading.Event()
        self.answer = None


class _Channel:
    """What the reader threads share with callers (not the transport
    itself, so that dropping the transport finalizes it)."""

    def __init__(self, proc):
        self.proc = proc
        self.lock = threading.Lock()
        self.waiters = {}  # id -> _Waiter, guarded by lock
        self.next_id = 1  # guarded by lock
        self.failure = None  # CanzonaError once the bridge is gone
        self.write_lock = threading.Lock()
        self.stderr_tail = collections.deque(maxlen=20)

    def fail_all(self, error):
        """Fails every waiting call (and later ones); returns how many
        were waiting."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            waiters, self.waiters = self.waiters, {}
        for waiter in waiters.values():
            waiter.answer = {"error": {"code": error.code,
                                       "message": str(error)}}
            waiter.done.set()
        return len(waiters)

    def gone(self):
        """The error for calls after the bridge's end."""
        status = self.proc.poll()
        tail = "".join(self.stderr_tail).strip()
        return CanzonaError(
            "canzona-bridge exited%s%s" % (
                "" if status is None else " with status %d" % status,
                ": " + tail if tail else ""), "UNAVAILABLE")


def _read_answers(channel):
    for raw in channel.proc.stdout:
        try:
            answer = json.loads(raw)
            waiter_id = answer["id"]
        except (ValueError, KeyError, TypeError):
            channel.stderr_tail.append("unreadable line from canzona-bridge: "
                                       "%r\n" % raw[:200])
            continue
        with channel.lock:
            waiter = channel.waiters.pop(waiter_id, None)
        if waiter is None:
            # An answer nobody waits for: the bridge could not read one of
            # our lines (id null), a protocol bug worth seeing.
            sys.stderr.write("canzona-bridge: %s"
                             % raw.decode(errors="replace"))
            continue
        waiter.answer = answer
        waiter.done.set()
    channel.proc.wait()
    channel.fail_all(channel.gone())


def _read_stderr(channel):
    """Keeps the bridge's last stderr lines for error messages and passes
    them on to this process's stderr."""
    for raw in channel.proc.stderr:
        line = raw.decode(errors="replace")
        channel.stderr_tail.append(line)
        sys.stderr.write(line)


def _shutdown(channel):
    """Ends the bridge: end of input, and SIGTERM when calls were still
    waiting (the bridge would finish them first, for nobody); SIGKILL
    after 10 s."""
    waiting = channel.fail_all(CanzonaError("the client is closed",
                                            "UNAVAILABLE"))
    try:
        channel.proc.stdin.close()
    except OSError:
        pass
    if waiting and channel.proc.poll() is None:
        channel.proc.terminate()
    try:
        channel.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        channel.proc.kill()
        channel.proc.wait()


def _answer(answer):
    if "error" in answer:
        error = answer["error"]
        raise CanzonaError(error.get("message", ""),
                           error.get("code", "UNKNOWN"))
    return answer.get("response", {})


class BridgeTransport:
    """One canzona-bridge child connected to one canzonad."""

    name = "bridge"

    def __init__(self, options, executable):
        argv = [executable, "--target", options.target]
        for flag in ("connect_timeout", "register_timeout", "step_timeout",
                     "checkpoint_timeout"):
            argv += ["--" + flag.replace("_", "-"),
                     repr(float(getattr(options, flag)))]
        # The token and CA travel in the environment (not visible in ps);
        # the bridge exits when this process does.
        env = dict(os.environ, CANZONA_JOB_TOKEN=options.job_token,
                   CANZONA_TLS_CA=options.tls_ca,
                   CANZONA_BRIDGE_PARENT_PID=str(os.getpid()))
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env)
        except OSError as e:
            raise CanzonaError("cannot start canzona-bridge %s: %s"
                               % (executable, e.strerror or e),
                               "FAILED_PRECONDITION") from None
        self._channel = channel = _Channel(proc)
        # The bridge's hello (id 0): connected, or why not.
        hello = _Waiter()
        channel.waiters[0] = hello
        for target in (_read_answers, _read_stderr):
            threading.Thread(target=target, args=(channel,), daemon=True,
                             name="canzona-bridge-" + target.__name__).start()
        self._closer = weakref.finalize(self, _shutdown, channel)
        hello.done.wait()
        try:
            _answer(hello.answer)
        except CanzonaError:
            self.close()
            raise

    def call(self, method, request):
        """Runs ``method`` on ``request`` (a dict) in the bridge; returns
        the response dict. CanzonaError with the call's status otherwise."""
        channel = self._channel
        waiter = _Waiter()
        with channel.lock:
            if channel.failure is not None:
                raise channel.failure
            waiter_id = channel.next_id
            channel.next_id += 1
            channel.waiters[waiter_id] = waiter
        line = json.dumps({"id": waiter_id, "method": method,
                           "request": request}, separators=(",", ":"))
        try:
            with channel.write_lock:
                channel.proc.stdin.write(line.encode() + b"\n")
                channel.proc.stdin.flush()
        except (OSError, ValueError):
            # The bridge is gone (or closing); the reader fails the waiters.
            with channel.lock:
                channel.waiters.pop(waiter_id, None)
                failure = channel.failure
            raise failure or channel.gone() from None
        waiter.done.wait()
        return _answer(waiter.answer)

    def close(self):
        self._closer()
