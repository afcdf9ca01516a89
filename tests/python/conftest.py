"""Shared by the suites: the canzonad fixture, the transport parameter, the
installed-package check, and the terminal summary of test_reference.py's
measured errors.

Environment (tests/python/CMakeLists.txt sets it):
  CANZONAD, CANZONACTL      the binaries under test
  CANZONA_BRIDGE            canzona-bridge (the bridge transport)
  CANZONA_TEST_STRICT=1     a transport that is unavailable fails the test
                            instead of skipping it
  CANZONA_TEST_INSTALLED    the venv the package must be imported from
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
# The example trainer (train_torch) the suites train; pytest puts this
# folder on sys.path itself (its rootdir-relative "prepend" imports).
sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
CANZONAD = os.environ.get("CANZONAD",
                          os.path.join(ROOT, "build", "server", "canzonad"))
TRANSPORTS = ("grpc", "bridge")


def pytest_sessionstart(session):
    venv = os.environ.get("CANZONA_TEST_INSTALLED")
    if not venv:
        return
    import canzona
    where = os.path.realpath(canzona.__file__)
    if not where.startswith(os.path.realpath(venv) + os.sep):
        raise pytest.UsageError("canzona imported from %s, not from the "
                                "installed copy in %s" % (where, venv))


def transport_unavailable(transport):
    """Why `transport` cannot run here, or None."""
    if transport == "grpc":
        try:
            import canzona._grpc_transport  # noqa: F401
        except ImportError as e:
            return "grpcio / protobuf not importable: %s" % e
        return None
    from canzona._bridge_transport import find_bridge
    if find_bridge() is None:
        return "no canzona-bridge (set CANZONA_BRIDGE)"
    return None


def require_transport(transport):
    why = transport_unavailable(transport)
    if why is None:
        return
    if os.environ.get("CANZONA_TEST_STRICT") == "1":
        pytest.fail("transport %s: %s" % (transport, why))
    pytest.skip("transport %s: %s" % (transport, why))


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    """Each transport in turn ("grpc", "bridge")."""
    require_transport(request.param)
    return request.param


def start_daemon(tmp, *extra):
    """A canzonad on a private unix socket in tmp: (process, target)."""
    sock = os.path.join(tmp, "d.sock")
    ready = os.path.join(tmp, "ready.json")
    log = open(os.path.join(tmp, "d.log"), "w")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    # Test-only libraries (fake CUDA) must not reach the daemon.
    env.pop("LD_LIBRARY_PATH", None)
    proc = subprocess.Popen(
        [CANZONAD, "--unix-socket", sock, "--ready-file", ready,
         "--metrics-address", "127.0.0.1:0", "--backend", "cpu",
         "--step-timeout", "60"] + list(extra),
        stdout=log, stderr=log, env=env)
    log.close()
    for _ in range(400):
        if os.path.exists(ready) and os.path.getsize(ready) > 0:
            return proc, "unix:" + sock
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    pytest.fail("canzonad did not start: " +
                open(os.path.join(tmp, "d.log")).read())


@pytest.fixture(scope="module")
def daemon():
    """One canzonad on a private unix socket; yields its target."""
    if not os.path.exists(CANZONAD):
        pytest.skip("canzonad not built at %s" % CANZONAD)
    tmp = tempfile.mkdtemp(prefix="canzona-py-")
    proc, target = start_daemon(tmp)
    yield target
    proc.terminate()
    code = proc.wait(timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0


def pytest_terminal_summary(terminalreporter):
    """Prints the worst reference-vs-daemon errors test_reference.py
    measured."""
    module = sys.modules.get("test_reference")
    measured = getattr(module, "MEASURED", None)
    if not measured:
        return
    terminalreporter.section("canzona reference vs daemon: worst relative errors")
    for optimizer in sorted(measured):
        m = measured[optimizer]
        terminalreporter.write_line(
            f"{optimizer:8s} {m['cases']:2d} cases  max|out-ref|/max|ref| = {m['rel']:.2e}"
            f" ({m['worst']})  max|out-ref|/max|ref-p| = {m['displacement']:.2e}"
        )
