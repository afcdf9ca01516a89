"""canzona.Client over both transports (grpcio and canzona-bridge) against a
real canzonad, the bridge's line protocol and process lifetime, the shared
memory (proto/shared_memory's rules) and the CUDA IPC export (over a fake libcudart /
libcuda, fake_cuda.c). Needs no torch.

Run by ctest (label python) from the source tree (python_client) and from
the pip-installed package (python_installed_package).
"""

import base64
import ctypes
import json
import os
import random
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid

import pytest

import canzona
from canzona import _cuda
from conftest import require_transport

BRIDGE = os.environ.get("CANZONA_BRIDGE")


def job_name(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:10])


def floats(buffer):
    return memoryview(buffer).cast("f")


# -- a small one-rank job, the same on every transport ----------------------

SHAPES = {"w": (8, 6), "b": (6,)}


def run_job(client, job, steps=3, seed=7, doorbell=False, overlap=False):
    """Registers an 8x6 Muon matrix and a 6-vector (AdamW) in one shared
    buffer, runs `steps` steps on seeded random gradients (through a step
    doorbell with `doorbell`; with `overlap`, one bucket per parameter
    reported with grad_ready, an async step and wait_params), round-trips
    the state through export / import and a checkpoint; returns what it
    saw."""
    rng = random.Random(seed)
    sizes = {n: (s[0] * s[1] if len(s) == 2 else s[0])
             for n, s in SHAPES.items()}
    total = 2 * sum(sizes.values())
    buffer = client.allocate(job, 0, total * 4)
    data = floats(buffer)
    parameters, offset, views = [], 0, {}
    for name, shape in SHAPES.items():
        n = sizes[name]
        for k in range(n):
            data[offset + k] = rng.uniform(-1, 1)
        views[name] = (offset, offset + n, n)
        parameters.append({
            "name": name, "shape": list(shape), "tp_split_dim": -1,
            "group": "muon" if name == "w" else "adamw",
            "param": (buffer.name, offset * 4, n * 4),
            "grad": (buffer.name, (offset + n) * 4, n * 4)})
        offset += 2 * n
    registered = client.register(
        job, (1, 1, 1), (0, 0, 0),
        [("muon", "muon", {"lr": "0.02"}), ("adamw", "adamw", {"lr": "0.01"})],
        parameters, bucket_size=6 if overlap else 0, params_events=True)
    buckets = len(registered["buckets"])
    # Asked for, but shared memory (and the Gloo plane) gets no parameters-
    # written events: the answers wait for the writes.
    assert registered["params_event_handles"] == [b""] * buckets
    if overlap:
        assert buckets == 2
    if doorbell:
        client.attach_step_doorbell(job, (0, 0, 0))
    stats = []
    for step in range(1, steps + 1):
        for p, g, n in views.values():
            for k in range(n):
                data[g + k] = rng.uniform(-1, 1)
        if overlap:
            for b in range(buckets):
                client.grad_ready(job, (0, 0, 0), step, [b])
        stats.append(client.step(job, (0, 0, 0), step, {"muon": 0.02},
                                 async_params=overlap))
        if overlap:
            for b in reversed(range(buckets)):
                assert client.wait_params(job, (0, 0, 0), step, b) >= 0.0
    params = {name: list(data[p:p + n]) for name, (p, g, n) in views.items()}
    exported = client.export_state(job, (0, 0, 0))
    imported = client.import_state(job, (0, 0, 0), exported["state"],
                                   exported["step"],
                                   exported["plan_digest"])
    # In parts of 100 bytes (a rank's state beyond the message size): the
    # same blob, imported alike.
    in_parts = client.export_state(job, (0, 0, 0), part_bytes=100)
    assert in_parts == exported
    assert client.import_state(job, (0, 0, 0), in_parts["state"],
                               in_parts["step"], in_parts["plan_digest"],
                               part_bytes=100) == imported
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="part_bytes"):
            client.export_state(job, (0, 0, 0), part_bytes=bad)
        with pytest.raises(ValueError, match="part_bytes"):
            client.import_state(job, (0, 0, 0), in_parts["state"],
                                in_parts["step"], in_parts["plan_digest"],
                                part_bytes=bad)
    plan, digest = client.plan(job)
    client.deregister(job, (0, 0, 0))
    del data
    buffer.close()
    return {"registered": registered, "stats": stats, "params": params,
            "exported": exported, "imported": imported, "plan": plan,
            "digest": digest}


def test_both_transports_give_the_same_results(daemon):
    """The same job through grpcio and through canzona-bridge: bitwise the
    same parameters, and every result with the same keys and types."""
    for t in ("grpc", "bridge"):
        require_transport(t)
    runs = {}
    for t in ("grpc", "bridge"):
        with canzona.Client(daemon, transport=t) as client:
            assert client.transport == t
            runs[t] = run_job(client, job_name("same-" + t))
    a, b = runs["grpc"], runs["bridge"]
    assert a["params"] == b["params"]
    assert a["params"]["w"] != pytest.approx([0.0] * 48)
    assert a["registered"]["buckets"] == b["registered"]["buckets"]
    assert a["registered"]["state_bytes"] == b["registered"]["state_bytes"] > 0
    assert isinstance(b["registered"]["state_bytes"], int)
    for k, (sa, sb) in enumerate(zip(a["stats"], b["stats"])):
        assert sa.keys() == sb.keys()
        assert sa["seconds"].keys() == sb["seconds"].keys()
        assert sa["grad_norm"] == sb["grad_norm"] > 0
        # Each step reports the previous step's update (none before 1).
        assert sa["update_rms"] == sb["update_rms"]
        assert (sa["update_rms"] > 0) == (k > 0)
    for key in ("state", "step", "records"):
        assert a["exported"][key] == b["exported"][key], key
    assert len(a["exported"]["state"]) > 100 and a["exported"]["step"] == 3
    assert a["imported"] == b["imported"] == {"step": 3, "records": 2}
    assert a["plan"] == b["plan"] and a["plan"]["layout"]["dp"] == 1


def test_status_is_the_json_mapping_on_both_transports(daemon):
    """status(): GetStatusResponse with every field, int64 as strings."""
    seen = {}
    for t in ("grpc", "bridge"):
        require_transport(t)
        with canzona.Client(daemon, transport=t) as client:
            job = job_name("status")
            buffer = client.allocate(job, 0, 8)
            client.register(job, (1, 1, 1), (0, 0, 0),
                            [("a", "adamw", {})],
                            [{"name": "v", "shape": [1], "tp_split_dim": -1,
                              "group": "a", "param": (buffer.name, 0, 4),
                              "grad": (buffer.name, 4, 4)}])
            floats(buffer)[1] = 0.5
            client.step(job, (0, 0, 0), 1)
            status = client.status()
            client.deregister(job, (0, 0, 0))
        [mine] = [j for j in status["jobs"] if j["job_id"] == job]
        assert status["backend"] == "cpu"
        assert mine["state"] == "ready"
        assert mine["local_ranks"][0]["steps_done"] == "1"
        mine = dict(mine, job_id="", plan_digest="")
        mine["local_ranks"] = [dict(r, last_step_seconds=None)
                               for r in mine["local_ranks"]]
        seen[t] = mine
    assert seen["grpc"] == seen["bridge"]


def test_daemon_errors_keep_code_and_message(daemon, transport):
    with canzona.Client(daemon, transport=transport) as client:
        with pytest.raises(canzona.CanzonaError) as error:
            client.plan(job_name("nobody"))
        assert error.value.code == "NOT_FOUND", error.value
        job = job_name("bad-lr")
        buffer = client.allocate(job, 0, 32)
        with pytest.raises(canzona.CanzonaError) as error:
            client.register(job, (1, 1, 1), (0, 0, 0),
                            [("m", "muon", {"lr": "-1"})],
                            [{"name": "w", "shape": [2, 2],
                              "tp_split_dim": -1, "group": "m",
                              "param": (buffer.name, 0, 16),
                              "grad": (buffer.name, 16, 16)}])
        assert error.value.code == "INVALID_ARGUMENT"
        assert "lr" in str(error.value)
        # Client-side checks, before anything is sent.
        with pytest.raises(ValueError, match="groups"):
            client.register(job, (1, 1, 1), (0, 0, 0), [("m", "muon")], [])
        with pytest.raises(ValueError, match="parameter w grad must be"):
            client.register(job, (1, 1, 1), (0, 0, 0),
                            [("m", "muon", {})],
                            [{"name": "w", "shape": [2, 2],
                              "tp_split_dim": -1, "group": "m",
                              "param": (buffer.name, 0, 16),
                              "grad": (buffer.name, 16)}])


def test_unreachable_daemon_and_unreadable_ca(transport):
    with pytest.raises(canzona.CanzonaError) as error:
        canzona.Client("unix:/nonexistent/canzonad.sock", transport=transport,
                       connect_timeout=0.5)
    assert error.value.code == "UNAVAILABLE"
    assert str(error.value).startswith(
        "cannot reach canzonad at unix:/nonexistent/canzonad.sock")
    with pytest.raises(canzona.CanzonaError) as error:
        canzona.Client("127.0.0.1:1", transport=transport,
                       tls_ca="/nonexistent/ca.pem", connect_timeout=0.5)
    assert error.value.code == "INVALID_ARGUMENT"
    assert str(error.value) == ("tls_ca: cannot read a PEM certificate from "
                                "'/nonexistent/ca.pem'")


def test_blocking_calls_run_concurrently(daemon, transport):
    """Rank 0's Register blocks until rank 1 registers; the same client
    answers other calls meanwhile (the bridge runs requests concurrently
    and hands answers to their callers by id)."""
    job = job_name("concurrent")
    with canzona.Client(daemon, transport=transport) as c0, \
            canzona.Client(daemon, transport=transport) as c1:
        buffers = [c.allocate(job, r, 16) for r, c in enumerate((c0, c1))]

        def register(client, dp_rank):
            b = buffers[dp_rank]
            return client.register(
                job, (1, 2, 1), (0, dp_rank, 0), [("a", "adamw", {})],
                [{"name": "v", "shape": [2], "tp_split_dim": -1,
                  "group": "a", "param": (b.name, 0, 8),
                  "grad": (b.name, 8, 8)}])

        results = {}
        first = threading.Thread(
            target=lambda: results.setdefault(0, register(c0, 0)))
        first.start()
        time.sleep(0.3)
        assert first.is_alive()  # waiting for rank 1
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(
            c0.status())) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(answers) == 16 and first.is_alive()
        assert any(j["job_id"] == job for j in answers[0]["jobs"])
        results[1] = register(c1, 1)
        first.join(30)
        assert results[0]["plan_digest"] == results[1]["plan_digest"] != ""
        for r, c in enumerate((c0, c1)):
            c.deregister(job, (0, r, 0))


def test_transport_selection():
    with pytest.raises(ValueError, match="CANZONA_TRANSPORT"):
        canzona.Client("unix:/x", transport="carrier-pigeon")
    saved = os.environ.get("CANZONA_BRIDGE")
    os.environ["CANZONA_BRIDGE"] = "/nonexistent/canzona-bridge"
    try:
        with pytest.raises(canzona.CanzonaError) as error:
            canzona.Client("unix:/x", transport="bridge")
        assert error.value.code == "FAILED_PRECONDITION"
        assert "CANZONA_BRIDGE=/nonexistent/canzona-bridge" in str(error.value)
    finally:
        if saved is None:
            del os.environ["CANZONA_BRIDGE"]
        else:
            os.environ["CANZONA_BRIDGE"] = saved


# -- the bridge process -------------------------------------------------------

def bridge_process(target, *flags):
    require_transport("bridge")
    from canzona._bridge_transport import find_bridge
    return subprocess.Popen([find_bridge(), "--target", target] + list(flags),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def send(proc, line):
    proc.stdin.write((line if isinstance(line, str)
                      else json.dumps(line)).encode() + b"\n")
    proc.stdin.flush()


def receive(proc):
    return json.loads(proc.stdout.readline())


def test_bridge_protocol(daemon):
    proc = bridge_process(daemon)
    try:
        assert receive(proc) == {"id": 0, "response": {"target": daemon}}
        send(proc, "this is not json")
        line = receive(proc)
        assert line["id"] is None
        assert line["error"] == {"code": "INVALID_ARGUMENT",
                                 "message": "line: not a JSON object"}
        send(proc, {"id": 5, "method": "Fly"})
        line = receive(proc)
        assert line["id"] == 5 and line["error"]["code"] == "INVALID_ARGUMENT"
        assert 'unknown method "Fly"' in line["error"]["message"]
        send(proc, {"id": 6, "method": "GetPlan",
                    "request": {"job_idd": "x"}})
        line = receive(proc)
        assert line["id"] == 6 and "job_idd" in line["error"]["message"]
        # Still serving, with the daemon's own errors and answers.
        send(proc, {"id": 7, "method": "GetPlan", "request": {"job_id": "x"}})
        line = receive(proc)
        assert line["id"] == 7 and line["error"]["code"] == "NOT_FOUND"
        send(proc, {"id": 8, "method": "GetStatus", "request": {}})
        line = receive(proc)
        assert line["id"] == 8 and line["response"]["backend"] == "cpu"
        # End of input: what is in flight is answered, then exit 0.
        send(proc, {"id": 9, "method": "GetStatus"})
        proc.stdin.close()
        assert receive(proc)["id"] == 9
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_bridge_says_when_it_cannot_connect():
    proc = bridge_process("unix:/nonexistent/canzonad.sock",
                          "--connect-timeout", "0.3")
    line = receive(proc)
    assert line["id"] == 0 and line["error"]["code"] == "UNAVAILABLE"
    assert line["error"]["message"].startswith(
        "cannot reach canzonad at unix:/nonexistent")
    assert proc.wait(timeout=10) == 1
    proc.stdin.close()


def test_bridge_rejects_bad_flags():
    proc = bridge_process("unix:/x", "--step-timeout", "-3")
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "--step-timeout" in lines[0], lines


def process_gone(pid):
    """True once pid has exited (a zombie nobody reaps counts as gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True


def test_bridge_exits_with_its_parent(daemon):
    """A trainer killed mid-step must not leave its bridge holding the rank
    (the daemon watches the bridge's pid): the bridge exits when its parent
    dies, even while a forked child of the trainer (a data loader worker)
    still holds the bridge's stdin, so that no end of input comes."""
    require_transport("bridge")
    trainer = subprocess.run(
        [sys.executable, "-c",
         "import os, sys, time, canzona\n"
         "c = canzona.Client(sys.argv[1], transport='bridge')\n"
         "pid = os.fork()\n"
         "if pid == 0:\n"
         "    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n"
         "    time.sleep(60)\n"
         "    os._exit(0)\n"
         "print(c._transport._channel.proc.pid, pid, flush=True)\n"
         "os._exit(0)\n",
         daemon], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, timeout=60)
    assert trainer.returncode == 0
    bridge, worker = (int(x) for x in trainer.stdout.split())
    try:
        deadline = time.time() + 10
        while not process_gone(bridge) and time.time() < deadline:
            time.sleep(0.05)
        assert process_gone(bridge)
        assert not process_gone(worker)  # so the pipe was still open
    finally:
        os.kill(worker, 9)


def test_close_ends_the_bridge_and_fails_waiting_calls(daemon):
    require_transport("bridge")
    client = canzona.Client(daemon, transport="bridge")
    proc = client._transport._channel.proc
    job = job_name("closing")
    buffer = client.allocate(job, 0, 16)
    errors = []

    def blocked():
        try:
            client.register(job, (1, 2, 1), (0, 0, 0), [("a", "adamw", {})],
                            [{"name": "v", "shape": [2], "tp_split_dim": -1,
                              "group": "a", "param": (buffer.name, 0, 8),
                              "grad": (buffer.name, 8, 8)}])
        except canzona.CanzonaError as e:
            errors.append(e)

    waiting = threading.Thread(target=blocked)
    waiting.start()
    time.sleep(0.3)
    start = time.time()
    client.close()
    waiting.join(15)
    assert not waiting.is_alive()
    assert errors and errors[0].code == "UNAVAILABLE"
    assert "closed" in str(errors[0])
    assert proc.wait(timeout=15) is not None
    assert time.time() - start < 5  # not the 600 s Register deadline
    with pytest.raises(canzona.CanzonaError) as error:
        client.status()
    assert error.value.code == "UNAVAILABLE"


def test_a_dead_bridge_fails_calls_with_its_status(daemon):
    require_transport("bridge")
    client = canzona.Client(daemon, transport="bridge")
    proc = client._transport._channel.proc
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            client.status()
        except canzona.CanzonaError as e:
            assert e.code == "UNAVAILABLE"
            assert "canzona-bridge exited with status -9" in str(e)
            break
        time.sleep(0.05)
    else:
        pytest.fail("calls still succeed after the bridge died")
    client.close()


# -- the step doorbell --------------------------------------------------------

def doorbell_path(client, job):
    [(bell, _)] = [v for k, v in client._doorbells.items() if k[0] == job]
    return "/dev/shm" + bell.name


@pytest.mark.parametrize("overlap", [False, True])
def test_doorbell_steps_equal_grpc_steps(daemon, overlap):
    """The same seeded job stepped over gRPC and through the doorbell (with
    overlap: grad_ready and wait_params too): bitwise the same parameters
    and statistics."""
    require_transport("grpc")
    runs = {}
    for doorbell in (False, True):
        with canzona.Client(daemon, transport="grpc") as client:
            assert client.step_doorbell_supported()
            methods = []
            call = client._transport.call

            def counting(method, request, call=call, methods=methods):
                methods.append(method)
                return call(method, request)

            client._transport.call = counting
            runs[doorbell] = run_job(client, job_name("bell"),
                                     doorbell=doorbell, overlap=overlap)
            # Step calls through the doorbell never reach gRPC.
            per_step = {"Step": 1, "GradReady": 2 if overlap else 0,
                        "WaitParams": 2 if overlap else 0}
            for method, count in per_step.items():
                assert methods.count(method) == (0 if doorbell else
                                                 3 * count), method
    a, b = runs[False], runs[True]
    assert a["params"] == b["params"]
    assert a["params"]["w"] != pytest.approx([0.0] * 48)
    if overlap:  # overlap changes when, not what
        with canzona.Client(daemon, transport="grpc") as client:
            plain = run_job(client, job_name("bell-plain"))
        assert plain["params"] == a["params"]
    for sa, sb in zip(a["stats"], b["stats"]):
        assert sa.keys() == sb.keys()
        assert sa["seconds"].keys() == sb["seconds"].keys()
        assert sb["seconds"]["total"] > 0
        for key in ("grad_norm", "update_rms", "skipped_nonfinite",
                    "clip_factor", "host_waits", "pageable_copies"):
            assert sa[key] == sb[key], key
    assert a["exported"]["state"] == b["exported"]["state"]


def test_doorbell_errors_change_nothing_then_deregister_detaches(daemon):
    require_transport("grpc")
    with canzona.Client(daemon, transport="grpc") as client:
        job = job_name("bell-bad")
        buffer = client.allocate(job, 0, 32)
        data = floats(buffer)
        data[0:4] = memoryview(struct.pack("4f", 0.5, -0.25, 1.5, 2.0)).cast(
            "f")
        client.register(job, (1, 1, 1), (0, 0, 0), [("a", "adamw", {})],
                        [{"name": "v", "shape": [4], "tp_split_dim": -1,
                          "group": "a", "param": (buffer.name, 0, 16),
                          "grad": (buffer.name, 16, 16)}])
        # Not attached: an unknown job or rank is refused by name, and no
        # object is left behind.
        before = set(os.listdir("/dev/shm"))
        with pytest.raises(canzona.CanzonaError) as error:
            client.attach_step_doorbell(job_name("nobody"), (0, 0, 0))
        assert error.value.code == "NOT_FOUND" and "job_id" in str(error.value)
        with pytest.raises(canzona.CanzonaError) as error:
            client.attach_step_doorbell(job, (0, 1, 0))
        assert error.value.code in ("NOT_FOUND", "INVALID_ARGUMENT")
        assert "rank" in str(error.value)
        assert set(os.listdir("/dev/shm")) == before
        client.attach_step_doorbell(job, (0, 0, 0))
        path = doorbell_path(client, job)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        data[4:8] = memoryview(struct.pack("4f", 0.3, -0.7, 0.1, 0.9)).cast(
            "f")
        start = list(data[0:4])
        # The daemon's own errors come back through shared memory.
        with pytest.raises(canzona.CanzonaError) as error:
            client.step(job, (0, 0, 0), 2)
        assert error.value.code == "FAILED_PRECONDITION"
        assert "step out of order" in str(error.value)
        with pytest.raises(canzona.CanzonaError) as error:
            client.step(job, (0, 0, 0), 1, grad_scale=-1.0)
        assert error.value.code == "INVALID_ARGUMENT"
        assert "grad_scale" in str(error.value)
        with pytest.raises(canzona.CanzonaError) as error:
            client.step(job, (0, 0, 0), 1, {"nope": 0.1})
        assert error.value.code == "INVALID_ARGUMENT" and "nope" in str(
            error.value)
        assert list(data[0:4]) == start
        first = client.step(job, (0, 0, 0), 1)
        assert first["grad_norm"] == pytest.approx(
            (0.3**2 + 0.7**2 + 0.1**2 + 0.9**2) ** 0.5, rel=1e-6)
        assert list(data[0:4]) != start
        client.deregister(job, (0, 0, 0))
        # Deregister detached it on both sides: the object is gone and the
        # next step is gRPC's answer.
        assert not os.path.exists(path)
        with pytest.raises(canzona.CanzonaError) as error:
            client.step(job, (0, 0, 0), 2)
        assert error.value.code == "NOT_FOUND"
        del data
        buffer.close()


def test_doorbell_needs_grpc_and_a_unix_socket(daemon):
    require_transport("bridge")
    with canzona.Client(daemon, transport="bridge") as client:
        assert not client.step_doorbell_supported()
        with pytest.raises(canzona.CanzonaError) as error:
            client.attach_step_doorbell("j", (0, 0, 0))
        assert error.value.code == "FAILED_PRECONDITION"
        assert "grpc transport" in str(error.value)


def test_doorbell_protocol_against_a_scripted_daemon():
    """The client side of the protocol with this test as the daemon: the
    header words, the payload areas, status codes, the deadline, the
    heartbeat and the serving lock."""
    from canzona import _doorbell
    if not _doorbell.supported():
        pytest.skip("no doorbell on this platform")
    bell = _doorbell.StepDoorbell(job_name("proto"))
    path = "/dev/shm" + bell.name
    try:
        import fcntl
        import mmap
        # The daemon's descriptor: it maps the object and holds the
        # serving lock while it serves.
        served = open(path, "r+b")
        m = mmap.mmap(served.fileno(), 0)
        fcntl.flock(served, fcntl.LOCK_SH)
        assert len(m) == 4096 + 2 * 65536
        assert struct.unpack_from("<II", m, 0) == (0x42445A43, 2)

        def words():
            return struct.unpack_from("<IIIIIi", m, 8)

        def serve(status, payload, seq_offset=0):
            while True:
                request_seq = words()[0]
                if request_seq != words()[1]:
                    break
                time.sleep(0.001)
            n = words()[3]
            got.append(bytes(m[4096:4096 + n]))
            methods.append(struct.unpack_from("<I", m, 32)[0])
            m[4096 + 65536:4096 + 65536 + len(payload)] = payload
            struct.pack_into("<Ii", m, 24, len(payload), status)
            struct.pack_into("<I", m, 12, request_seq + seq_offset)

        got, methods = [], []
        for status, payload, expect in [
                (0, b"\x01\x02answer", b"\x01\x02answer"),
                (9, b"step out of order", ("FAILED_PRECONDITION",
                                           "step out of order")),
                (77, b"odd", ("UNKNOWN", "doorbell status 77: odd"))]:
            t = threading.Thread(target=serve, args=(status, payload))
            t.start()
            try:
                result = bell.call(b"req-%d" % status, 5.0,
                                   method=status % 3)
                assert result == expect
            except canzona.CanzonaError as e:
                assert (e.code, str(e)) == expect
            t.join()
        assert got == [b"req-0", b"req-9", b"req-77"]
        assert methods == [_doorbell.STEP, _doorbell.STEP,
                           _doorbell.WAIT_PARAMS]
        with pytest.raises(canzona.CanzonaError) as error:
            bell.call(b"x" * (65536 + 1), 1.0)
        assert error.value.code == "INVALID_ARGUMENT"
        # Nobody answers: the deadline, or the silent heartbeat first.
        with pytest.raises(canzona.CanzonaError) as error:
            bell.call(b"late", 0.2)
        assert error.value.code == "DEADLINE_EXCEEDED"
        with pytest.raises(canzona.CanzonaError) as error:
            bell.call(b"silent", 30.0, daemon_silence=0.2)
        assert error.value.code == "UNAVAILABLE"
        # A beating heartbeat keeps the call waiting past the silence.
        stop = threading.Event()

        def beat():
            while not stop.is_set():
                struct.pack_into("<I", m, 16, words()[2] + 1)
                time.sleep(0.02)

        beater = threading.Thread(target=beat)
        beater.start()
        started = time.monotonic()
        with pytest.raises(canzona.CanzonaError) as error:
            bell.call(b"slow", 0.6, daemon_silence=0.2)
        stop.set()
        beater.join()
        assert error.value.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - started >= 0.55
        # The daemon lets go of the lock (it exited or detached; Python's
        # mmap holds a dup of the descriptor, so that goes too): the call
        # fails then, not after the heartbeat's silence nor at the deadline.
        m.close()
        served.close()
        with pytest.raises(canzona.CanzonaError) as error:
            bell.call(b"gone", 20.0, daemon_silence=3600.0)
        assert error.value.code == "UNAVAILABLE"
        assert "no longer serves" in str(error.value)
    finally:
        bell.close()
    assert not os.path.exists(path)


# -- shared memory ------------------------------------------------------------

def test_shared_memory_follows_the_shm_protocol(daemon):
    with canzona.Client(daemon) as client:
        job = job_name("shm")
        first = client.allocate(job, 3, 64)
        second = client.allocate(job, 3, 8)
        # /canzona.<job>.<rank>.<seq>, the seqs unique to this process: a
        # process started later (a trainer restarted after a kill) draws
        # its own and never meets a name this one left.
        prefix = "/canzona.%s.3." % job
        assert first.name.startswith(prefix)
        assert second.name.startswith(prefix)
        seq = int(first.name[len(prefix):])
        assert int(second.name[len(prefix):]) == seq + 1
        other = subprocess.run(
            [sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:]; "
             "from canzona._shm import next_shm_seq; print(next_shm_seq())"]
            + sys.path, stdout=subprocess.PIPE, check=True)
        assert abs(int(other.stdout) - seq) >= 10**6
        path = "/dev/shm" + first.name
        info = os.stat(path)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.geteuid() and info.st_size == 64
        assert first.nbytes == 64 and bytes(first) == bytes(64)  # zeroed
        floats(first)[3] = 2.5
        with open(path, "rb") as f:  # what the daemon maps
            assert struct.unpack_from("f", f.read(), 12)[0] == 2.5
        # O_EXCL: an existing name is never reused.
        with pytest.raises(canzona.CanzonaError) as error:
            canzona.SharedBuffer.create(first.name, 8)
        assert error.value.code == "ALREADY_EXISTS"
        assert str(error.value) == "shm_open %s: File exists" % first.name
        # The name goes with the buffer: close() or garbage collection.
        first.close()
        assert not os.path.exists(path)
        second_path = "/dev/shm" + second.name
        del second
        assert not os.path.exists(second_path)
        with pytest.raises(canzona.CanzonaError) as error:
            client.allocate("bad.job", 0, 8)
        assert error.value.code == "INVALID_ARGUMENT"
        assert "job id" in str(error.value) or "fields" in str(error.value)
        with pytest.raises(canzona.CanzonaError, match="64 characters"):
            client.allocate("j" * 65, 0, 8)
        with pytest.raises(ValueError, match="nbytes must be > 0"):
            client.allocate(job, 0, 0)


def test_shared_memory_is_backed_when_created():
    """Every page of a new buffer is backed (posix_fallocate), so a full
    /dev/shm cannot kill the trainer or the daemon at a later write."""
    name = "/canzona.%s.0.0" % job_name("backed")
    buffer = canzona.SharedBuffer.create(name, 4 << 20)
    assert os.stat("/dev/shm" + name).st_blocks * 512 >= 4 << 20
    buffer.close()


def test_a_full_dev_shm_is_resource_exhausted_not_a_bus_error(daemon):
    """A /dev/shm too small for the buffer (a container's: 64 MiB under
    Docker by default) makes SharedBuffer.create and canzona.torch's
    construction raise RESOURCE_EXHAUSTED naming /dev/shm and the remedy.
    Before, creation succeeded and the first write past the limit (the
    parameters' copy into the buffer) killed the trainer with SIGBUS.
    Runs under a private 1 MiB /dev/shm (unshare -m: skipped where this
    process may not mount)."""
    pytest.importorskip("torch")
    if subprocess.run(["unshare", "-m", "true"],
                      capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace (needs CAP_SYS_ADMIN)")
    code = (
        "import sys, torch, canzona, canzona.torch as ct\n"
        "try:\n"
        "    canzona.SharedBuffer.create('/canzona.full-shm.0.0', 8 << 20)\n"
        "except canzona.CanzonaError as e:\n"
        "    print('create:', e.code, e)\n"
        "model = torch.nn.Linear(1024, 1024)  # 8 MiB with its gradients\n"
        "try:\n"
        "    ct.Muon(model.named_parameters(), target=sys.argv[1],\n"
        "            job_id='full-shm')\n"
        "except canzona.CanzonaError as e:\n"
        "    print('torch:', e.code, e)\n")
    shell = ("mount --make-rprivate / && "
             "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
             'exec "$0" -c "$1" "$2"')
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell, sys.executable, code, daemon],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2, run.stdout + run.stderr
    for line in lines:
        assert " RESOURCE_EXHAUSTED posix_fallocate " in line, line
        assert "/dev/shm cannot hold these" in line and "--shm-size" in line


def test_shared_memory_is_unlinked_at_exit(tmp_path):
    name = "/canzona.%s.0.0" % job_name("exit")
    code = ("import canzona, sys\n"
            "b = canzona.SharedBuffer.create(sys.argv[1], 16)\n"
            "b.__class__.leak = b\n")  # a reference that outlives main
    subprocess.run([sys.executable, "-c", code, name], check=True,
                   timeout=60)
    assert not os.path.exists("/dev/shm" + name)


# -- CUDA IPC export (fake runtime and driver) --------------------------------

FAKE_IPC_BASE = 0x7F0000000000
FAKE_VMM_BASE = 0x7F0000200000


@pytest.fixture
def fake_cuda():
    """canzona._cuda on fake_cuda.c's libcudart / libcuda, loaded into this
    process so that the module finds them as already loaded."""
    folder = os.environ.get("CANZONA_TEST_FAKE_CUDA_DIR")
    if not folder:
        if os.environ.get("CANZONA_TEST_STRICT") == "1":
            pytest.fail("CANZONA_TEST_FAKE_CUDA_DIR is not set")
        pytest.skip("no fake CUDA libraries (CANZONA_TEST_FAKE_CUDA_DIR)")
    cudart = ctypes.CDLL(os.path.join(folder, "libcudart.so.13"))
    ctypes.CDLL(os.path.join(folder, "libcuda.so.1"))
    saved = _cuda._runtime
    _cuda._runtime = None
    try:
        assert _cuda._cudart().error == ""
        yield cudart
    finally:
        _cuda._runtime = saved


def current_device(cudart):
    device = ctypes.c_int(-1)
    assert cudart.cudaGetDevice(ctypes.byref(device)) == 0
    return device.value


def test_cuda_buffer_ref_exports_the_allocation(fake_cuda):
    event = bytes(range(64))
    ref = _cuda.buffer_ref(FAKE_IPC_BASE + 4096, 1024, event)["cuda_ipc"]
    handle = base64.b64decode(ref["mem_handle"])
    assert len(handle) == 64
    assert handle.rstrip(b"\0") == b"fake-ipc:%x" % FAKE_IPC_BASE  # the base
    assert ref["offset"] == 4096 and ref["bytes"] == 1024
    assert ref["device"] == 1 and ref["pci_bus_id"] == "0000:3c:00.0"
    assert base64.b64decode(ref["event_handle"]) == event
    # The caller's current device is left as it was.
    assert current_device(fake_cuda) == 0
    # The whole allocation, to its last byte, is fine; one more is not.
    _cuda.buffer_ref(FAKE_IPC_BASE, 1 << 20)
    with pytest.raises(canzona.CanzonaError) as error:
        _cuda.buffer_ref(FAKE_IPC_BASE + 8, (1 << 20) - 4)
    assert error.value.code == "INVALID_ARGUMENT"
    assert str(error.value) == ("[device_ptr, device_ptr + 1048572) leaves "
                                "its allocation of 1048576 bytes at offset 8")


@pytest.mark.parametrize("ptr, nbytes, event, code, text", [
    (0, 4, b"", "INVALID_ARGUMENT", "device_ptr is null"),
    (FAKE_IPC_BASE, 4, b"short", "INVALID_ARGUMENT",
     "event_handle has 5 bytes, not 64"),
    (0x1000, 4, b"", "INVALID_ARGUMENT",
     "device_ptr is not CUDA device memory of this process"),
    (FAKE_VMM_BASE + 16, 4, b"", "FAILED_PRECONDITION",
     "device_ptr lives in memory CUDA IPC cannot share"),
])
def test_cuda_buffer_ref_refuses_what_ipc_cannot_share(fake_cuda, ptr, nbytes,
                                                       event, code, text):
    with pytest.raises(canzona.CanzonaError) as error:
        _cuda.buffer_ref(ptr, nbytes, event)
    assert error.value.code == code
    assert str(error.value).startswith(text), str(error.value)
    assert current_device(fake_cuda) == 0


def test_cuda_refs_reach_the_daemon(daemon, transport, fake_cuda):
    """A ("cuda", ptr, nbytes, event) parameter becomes a cuda_ipc
    BufferRef on both transports; this daemon (cpu) names the field and
    refuses it."""
    with canzona.Client(daemon, transport=transport) as client:
        with pytest.raises(canzona.CanzonaError) as error:
            client.register(
                job_name("cuda"), (1, 1, 1), (0, 0, 0), [("a", "adamw", {})],
                [{"name": "v", "shape": [4], "tp_split_dim": -1,
                  "group": "a", "param": ("cuda", FAKE_IPC_BASE, 16),
                  "grad": ("cuda", FAKE_IPC_BASE + 16, 16, bytes(64))}])
    assert error.value.code == "FAILED_PRECONDITION"
    assert str(error.value) == ("parameters[0] 'v'.param.cuda_ipc: this "
                                "daemon has no usable CUDA device")


def test_torch_s_cuda_runtime_comes_first_among_mapped_copies(monkeypatch):
    """Two runtimes mapped (an extension's libcudart.so.12 at the lower
    address, torch's .13 above it): the device calls go to torch's."""
    mapped = ["/ext/libcudart.so.12", "/torch/lib/libcudart.so.13.0.96"]
    monkeypatch.setattr(_cuda, "_loaded_libraries", lambda stem: list(mapped))
    fake_torch = type(sys)("torch")
    fake_torch.version = type(sys)("torch.version")
    fake_torch.version.cuda = "13.0"
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert _cuda._cudart_candidates()[:2] == mapped[::-1]
    fake_torch.version.cuda = None  # a cpu build: the maps' order
    assert _cuda._cudart_candidates()[:2] == mapped


def test_cuda_event_needs_a_device():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(canzona.CanzonaError) as error:
        canzona.CudaEvent(0)
    assert error.value.code == "FAILED_PRECONDITION"
    assert str(error.value).startswith("no usable CUDA device: ")
