#!/usr/bin/python3
"""Checks the Grafana dashboards and Prometheus rules against real tools.

  check_dashboards.py static --repo DIR
      Lints dashboards/*.json: a `datasource` variable of type datasource
      (query prometheus), no `__inputs`, `job` and `rank` variables, every
      panel and target on ${datasource}, unique panel ids, an expr per target.

  check_dashboards.py e2e --repo DIR --canzonad BIN --trainer BIN
                          --canzonactl BIN --prometheus BIN
      Starts two canzonad daemons (A coordinator, B joins it) with metrics on
      free loopback ports, a real Prometheus scraping both every second with
      the repository's recording and alert rules loaded, runs a DP2 x TP2
      training job (300 steps) through the example trainer and one GetPlan
      for a job that does not exist before and after it (non-OK RPCs), then
      evaluates through Prometheus' HTTP API:
        - every target expr of every dashboard panel, with the Grafana
          variables substituted ($job, $rank, $daemon_job, $instance -> .+,
          $__rate_interval -> 30s, $__interval -> 15s);
        - every template variable query (label_values) as a label-values call;
        - every recording rule's expr and the series it records;
        - every alert rule: the whole condition is evaluated and its result
          reported, but a healthy job rightly does not fire, so what must
          return data is each side of the top-level comparison (a numeric
          literal side is skipped). A side with `offset <d>` cannot have data
          in a Prometheus that started seconds ago: it is evaluated with the
          offset removed (which checks its metric, labels and functions) and
          reported as such; the offset itself is covered by the rule unit
          tests (promtool test rules).
      Each must return a non-empty result with at least one finite sample.
      Every process is bounded by a timeout and killed at the end.

Standard library only; loopback only.
"""

import argparse
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

GRAFANA_VARIABLES = {
    "job": ".+",
    "rank": ".+",
    "daemon_job": ".+",
    "instance": ".+",
    "__rate_interval": "30s",
    "__interval": "15s",
}


def fail(message):
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def substitute(expr):
    """Replaces Grafana variables ($name, ${name}, [[name]]) in expr."""

    def one(match):
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in GRAFANA_VARIABLES:
            fail(f"unknown Grafana variable {match.group(0)} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", one, expr)
    if "$" in out:
        fail(f"unsubstituted variable left in {out!r}")
    return out


# --------------------------------------------------------------------------
# Static checks of the dashboard JSON.


def load_dashboards(repo):
    paths = sorted(glob.glob(os.path.join(repo, "dashboards", "*.json")))
    if not paths:
        fail(f"no dashboards in {repo}/dashboards")
    return [(p, json.load(open(p))) for p in paths]


def all_panels(panels):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def lint_dashboard(path, dash):
    name = os.path.basename(path)
    errors = []
    if "__inputs" in dash or "__requires" in dash:
        errors.append("has __inputs/__requires (export for sharing externally is off)")
    if not dash.get("uid") or not dash.get("title"):
        errors.append("needs a uid and a title")
    if not 36 <= dash.get("schemaVersion", 0) <= 41:
        errors.append(f"schemaVersion {dash.get('schemaVersion')} is not 36..41")
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append("needs a `datasource` variable of type datasource, query prometheus")
    for required in ("job", "rank"):
        if required not in variables:
            errors.append(f"needs a `{required}` variable")
    for var in variables.values():
        if var.get("type") == "query":
            if var.get("datasource", {}).get("uid") != "${datasource}":
                errors.append(f"variable {var['name']} is not on ${{datasource}}")
            if not var.get("definition", "").startswith("label_values("):
                errors.append(f"variable {var['name']}: definition is not label_values(...)")
    ids = set()
    exprs = 0
    for panel in all_panels(dash.get("panels", [])):
        title = panel.get("title", "?")
        if panel.get("id") in ids:
            errors.append(f"panel {title}: duplicate id {panel.get('id')}")
        ids.add(panel.get("id"))
        if "gridPos" not in panel:
            errors.append(f"panel {title}: no gridPos")
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            errors.append(f"panel {title}: datasource is not ${{datasource}}")
        if not panel.get("targets"):
            errors.append(f"panel {title}: no targets")
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("uid") != "${datasource}":
                errors.append(f"panel {title} target {target.get('refId')}: "
                              "datasource is not ${datasource}")
            if not target.get("expr", "").strip():
                errors.append(f"panel {title} target {target.get('refId')}: no expr")
            else:
                exprs += 1
                substitute(target["expr"])
    for e in errors:
        print(f"  {name}: {e}")
    print(f"{name}: {len(ids)} panels, {exprs} expressions, "
          f"{len(variables)} variables, {len(errors)} problems")
    return not errors


def run_static(args):
    ok = all([lint_dashboard(p, d) for p, d in load_dashboards(args.repo)])
    if not ok:
        fail("dashboard lint")
    print("PASS")


# --------------------------------------------------------------------------
# End to end: daemons, trainer, Prometheus.


class Processes:
    """Children started in their own process group; all killed at the end."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.children = []  # (name, Popen, log path)

    def start(self, name, argv):
        log = os.path.join(self.workdir, f"{name}.log")
        proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.children.append((name, proc, log))
        return proc

    def dump_logs(self):
        for name, _, log in self.children:
            print(f"----- {name} log (last 4000 bytes) -----")
            with open(log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4000))
                print(f.read().decode(errors="replace"))

    def stop_all(self):
        for _, proc, _ in self.children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc, _ in self.children:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, predicate, timeout, procs, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc, _ in procs.children:
            if proc.poll() is not None and name.startswith(("daemon", "prometheus")):
                procs.dump_logs()
                fail(f"{name} exited with {proc.returncode} while waiting for {what}")
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    procs.dump_logs()
    fail(f"timed out after {timeout}s waiting for {what}")


def read_ready(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def start_daemon(procs, args, workdir, name, coordinator_port=None):
    ready_path = os.path.join(workdir, f"{name}.ready")
    argv = [args.canzonad, "--unix-socket", os.path.join(workdir, f"{name}.sock"),
            "--listen", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
            "--daemon-id", name, "--ready-file", ready_path]
    if coordinator_port is not None:
        argv += ["--coordinator", f"127.0.0.1:{coordinator_port}"]
    procs.start(f"daemon-{name}", argv)
    ready = wait_for(f"{name}'s ready file", lambda: read_ready(ready_path), 60, procs)
    if not ready.get("metrics_port"):
        procs.dump_logs()
        fail(f"{name}'s ready file has no metrics_port: {ready}")
    return ready


class Prometheus:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path, params=None, timeout=10):
        url = self.base + path
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)

    def ready(self):
        try:
            with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr):
        """Returns (result list, error string or None)."""
        try:
            body = self.get("/api/v1/query", {"query": expr})
        except urllib.error.HTTPError as e:
            return [], f"HTTP {e.code}: {e.read().decode(errors='replace')}"
        if body.get("status") != "success":
            return [], body.get("error", "query failed")
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}], None
        return data["result"], None


def split_comparison(expr):
    """Splits expr at its top-level comparison operator, if any.

    Returns (left, op, right) or None. Top level: outside (), {}, [] and
    string literals; `=~`, `!~` and `=` inside {} are label matchers.
    """
    depth = 0
    quote = None
    i = 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for op in (">=", "<=", "==", "!=", ">", "<"):
                if expr.startswith(op, i):
                    right = expr[i + len(op):].strip()
                    right = re.sub(r"^bool\b", "", right).strip()
                    return expr[:i].strip(), op, right
        i += 1
    return None


NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
OFFSET = re.compile(r"\s+offset\s+-?\d+[smhdwy]\w*")


class Checker:
    def __init__(self, prom):
        self.prom = prom
        self.failures = []
        self.count = 0

    def check(self, what, expr, note=""):
        self.count += 1
        result, error = self.prom.query(expr)
        values = []
        for sample in result:
            try:
                values.append(float(sample["value"][1]))
            except (KeyError, ValueError, TypeError):
                pass
        finite = [v for v in values if math.isfinite(v)]
        status = "ok"
        if error:
            status = f"ERROR {error}"
        elif not result:
            status = "EMPTY"
        elif not finite:
            status = "NO FINITE SAMPLE"
        shown = ", ".join(f"{v:.4g}" for v in finite[:4]) + (" ..." if len(finite) > 4 else "")
        print(f"  [{status}] {what}{note}: {len(result)} series "
              f"({len(finite)} finite{': ' + shown if finite else ''})\n      {expr}")
        if status != "ok":
            self.failures.append(f"{what}: {status}: {expr}")


def run_e2e(args):
    workdir = tempfile.mkdtemp(prefix="canzona-dash.")
    procs = Processes(workdir)
    ok = False
    try:
        ok = e2e(args, workdir, procs)
    finally:
        procs.stop_all()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"(files kept in {workdir})")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


def e2e(args, workdir, procs):
    dashboards = load_dashboards(args.repo)
    for path, dash in dashboards:
        if not lint_dashboard(path, dash):
            fail("dashboard lint")

    a = start_daemon(procs, args, workdir, "a")
    b = start_daemon(procs, args, workdir, "b", coordinator_port=a["tcp_port"])
    print(f"daemons up: a tcp {a['tcp_port']} metrics {a['metrics_port']}, "
          f"b metrics {b['metrics_port']}", flush=True)

    rules = sorted(glob.glob(os.path.join(args.repo, "deploy", "prometheus", "rules", "*.yml")))
    if not rules:
        fail("no rule files in deploy/prometheus/rules")
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                "  evaluation_interval: 1s\n")
        f.write("rule_files:\n" + "".join(f"  - {json.dumps(r)}\n" for r in rules))
        f.write("scrape_configs:\n  - job_name: canzonad\n    honor_labels: true\n"
                "    static_configs:\n      - targets:\n"
                f"          - 127.0.0.1:{a['metrics_port']}\n"
                f"          - 127.0.0.1:{b['metrics_port']}\n")
    port = free_port()
    procs.start("prometheus", [
        args.prometheus, f"--config.file={config}",
        f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h", "--log.level=warn"])
    prom = Prometheus(port)
    wait_for("prometheus ready", prom.ready, 60, procs)

    def both_up():
        result, _ = prom.query('up{job="canzonad"} == 1')
        return len(result) == 2

    wait_for("both daemons scraped (up == 1)", both_up, 60, procs)
    print("prometheus scrapes both daemons", flush=True)

    # Non-OK RPCs for the RPC errors panel: GetPlan of a job that does not
    # exist (canzonactl must fail), once before the job and once after it.
    # The daemon creates a (method, code) series at its first request, so a
    # single error would only ever be scraped at 1 and rate() would be 0.
    def failing_rpc():
        bad = subprocess.run([args.canzonactl, "plan", "--target",
                              f"unix:{a['unix_socket']}", "--job", "no-such-job"],
                             capture_output=True, timeout=30)
        if bad.returncode == 0:
            fail("canzonactl plan for a job that does not exist succeeded")

    failing_rpc()

    # The job, scraped while it runs.
    started = time.monotonic()
    trainer = procs.start("trainer", [
        args.trainer, "--targets",
        f"unix:{a['unix_socket']},unix:{b['unix_socket']}",
        "--dp", "2", "--tp", "2", "--steps", str(args.steps), "--job", "dash-e2e"])
    try:
        trainer.wait(timeout=args.trainer_timeout)
    except subprocess.TimeoutExpired:
        procs.dump_logs()
        fail(f"trainer did not finish in {args.trainer_timeout}s")
    if trainer.returncode != 0:
        procs.dump_logs()
        fail(f"trainer exited with {trainer.returncode}")
    print(f"trainer: {args.steps} steps in {time.monotonic() - started:.1f}s", flush=True)

    # The second non-OK RPC (see failing_rpc), seconds after the first.
    failing_rpc()

    # Wait until Prometheus holds every rank's final step count and the
    # recording rules have evaluated on it.
    def settled():
        steps, _ = prom.query(f'canzona_steps_total{{job="dash-e2e"}} == {args.steps}')
        errors, _ = prom.query('canzona_rpc_requests_total{code!="OK"} == 2')
        recorded, _ = prom.query('canzona:step_phase_seconds:p99{job="dash-e2e"}')
        return len(steps) == 4 and errors and recorded

    wait_for("the final counts in prometheus", settled, 60, procs)
    time.sleep(3)  # a few more scrapes and rule evaluations

    checker = Checker(prom)
    print("\n== dashboard panel expressions ($job/$rank/$daemon_job/$instance -> .+, "
          "$__rate_interval -> 30s, $__interval -> 15s)")
    for path, dash in dashboards:
        name = os.path.basename(path)
        for panel in all_panels(dash.get("panels", [])):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    checker.check(f"{name} / {panel['title']} / {target['refId']}",
                                  substitute(target["expr"]))

    print("\n== dashboard variable queries (label_values via /api/v1/label/.../values)")
    for path, dash in dashboards:
        name = os.path.basename(path)
        for var in dash.get("templating", {}).get("list", []):
            if var.get("type") != "query":
                continue
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"].strip())
            if not m:
                checker.failures.append(f"{name} variable {var['name']}: not label_values(m, l)")
                continue
            selector, label = substitute(m.group(1)), m.group(2)
            body = prom.get(f"/api/v1/label/{label}/values", {"match[]": selector})
            checker.count += 1
            values = body.get("data") or []
            print(f"  [{'ok' if values else 'EMPTY'}] {name} variable {var['name']}: "
                  f"{values}\n      label_values({selector}, {label})")
            if not values:
                checker.failures.append(f"{name} variable {var['name']}: no values")

    print("\n== recording and alert rules (as loaded by this Prometheus: /api/v1/rules)")
    groups = prom.get("/api/v1/rules")["data"]["groups"]
    loaded_files = {g["file"] for g in groups}
    for r in rules:
        if r not in loaded_files:
            checker.failures.append(f"rule file {r} not loaded (loaded: {loaded_files})")
    rule_count = 0
    for group in groups:
        for rule in group["rules"]:
            rule_count += 1
            if rule.get("health") != "ok":
                checker.failures.append(f"rule {rule['name']}: health {rule.get('health')} "
                                        f"{rule.get('lastError', '')}")
            expr = rule["query"]
            if rule["type"] == "recording":
                checker.check(f"recording {rule['name']} (expr)", expr)
                checker.check(f"recording {rule['name']} (recorded series)", rule["name"])
                continue
            # Alert: the condition itself, reported only (false when healthy).
            result, error = prom.query(expr)
            print(f"  [info] alert {rule['name']}: condition now returns {len(result)} series"
                  f"{' (error ' + error + ')' if error else ''}, state {rule.get('state')}"
                  f"\n      {expr}")
            if error:
                checker.failures.append(f"alert {rule['name']}: {error}")
            parts = split_comparison(expr)
            sides = [("expression", expr)] if parts is None else [
                (f"left of {parts[1]}", parts[0]), (f"right of {parts[1]}", parts[2])]
            for side, sub in sides:
                if NUMBER.match(sub):
                    print(f"  [skip] alert {rule['name']} {side}: the literal {sub}")
                    continue
                note = ""
                if OFFSET.search(sub):
                    sub = OFFSET.sub("", sub)
                    note = " (offset removed: no history yet; offset covered by promtool test rules)"
                checker.check(f"alert {rule['name']} {side}", sub, note)
    if rule_count == 0:
        checker.failures.append("no rules loaded")

    print(f"\n{checker.count} queries, {len(checker.failures)} failures")
    for f in checker.failures:
        print(f"  FAILED {f}")
    if checker.failures:
        procs.dump_logs()
    return not checker.failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["static", "e2e"])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--canzonad")
    parser.add_argument("--trainer")
    parser.add_argument("--canzonactl")
    parser.add_argument("--prometheus", default="/usr/bin/prometheus")
    # 300 steps take a few seconds on a CPU, so the 1 s scrapes see the
    # counters move (60 steps can finish between two scrapes: every rate 0,
    # every quantile NaN).
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trainer-timeout", type=float, default=240)
    args = parser.parse_args()
    args.repo = os.path.abspath(args.repo)
    if args.mode == "static":
        run_static(args)
        return
    for flag in ("canzonad", "trainer", "canzonactl", "prometheus"):
        path = getattr(args, flag)
        if not path or not os.access(path, os.X_OK):
            fail(f"--{flag} {path!r} is not an executable")
    run_e2e(args)


if __name__ == "__main__":
    main()
