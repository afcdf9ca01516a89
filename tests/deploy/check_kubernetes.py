#!/usr/bin/python3
"""Renders deploy/kubernetes with `kubectl kustomize` (base and every overlay)
and checks what the deployment depends on; runs yamllint on the tree; checks
the ConfigMap's config file against the flags of the built canzonad.

Usage: check_kubernetes.py <source root> [canzonad]   (exit 77: skipped)
"""
import os
import shutil
import subprocess
import sys

import yaml  # python3-yaml (deploy/lib/deps.sh)

errors = []


def check(cond, message):
    if not cond:
        errors.append(message)


def render(path):
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"FAIL: kubectl kustomize {path}:\n{out.stderr}")
    return list(yaml.safe_load_all(out.stdout))


def check_rendered(name, docs, gpu):
    kinds = {d["kind"]: d for d in docs}
    for kind in ("DaemonSet", "ConfigMap", "Service", "ServiceMonitor",
                 "ServiceAccount", "Namespace"):
        check(kind in kinds, f"{name}: no {kind}")
    ds = kinds["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    check(pod.get("hostPID") is True, f"{name}: hostPID is not true")
    check("nvidia.com/gpu" not in yaml.safe_dump(ds) or gpu,
          f"{name}: nvidia.com/gpu appears in the DaemonSet")
    containers = pod["containers"] + pod.get("initContainers", [])
    for c in containers:
        res = c.get("resources", {})
        for section in ("requests", "limits"):
            check("nvidia.com/gpu" not in res.get(section, {}),
                  f"{name}: {c['name']} {section} nvidia.com/gpu")
    (daemon,) = [c for c in pod["containers"] if c["name"] == "canzonad"]
    for section in ("requests", "limits"):
        check({"cpu", "memory"} <= set(daemon.get("resources", {})
                                       .get(section, {})),
              f"{name}: resources.{section} lacks cpu/memory")
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    check(ports.get("metrics") == 9464, f"{name}: metrics port is not 9464")
    check(isinstance(ports.get("grpc"), int), f"{name}: no numeric grpc port")
    for probe in ("readinessProbe", "livenessProbe"):
        grpc = daemon.get(probe, {}).get("grpc", {})
        check(isinstance(grpc.get("port"), int),
              f"{name}: {probe} is not a gRPC probe on a numeric port")
        check(grpc.get("port") == ports.get("grpc"),
              f"{name}: {probe} port is not the grpc containerPort")
    args = daemon.get("args", [])
    check(any(a.startswith("--config=") or a == "--config" for a in args),
          f"{name}: --config not passed")
    check("--unix-socket=/run/canzona/canzonad.sock" in args,
          f"{name}: socket not in /run/canzona")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    host = {path: volumes[mounts[path]].get("hostPath", {}).get("path")
            for path in mounts}
    check(host.get("/run/canzona") == "/run/canzona",
          f"{name}: /run/canzona is not the host's runtime dir")
    check(host.get("/dev/shm") == "/dev/shm", f"{name}: /dev/shm not shared")
    cm_name = volumes[mounts["/etc/canzona"]]["configMap"]["name"]
    check(cm_name == kinds["ConfigMap"]["metadata"]["name"],
          f"{name}: the config volume names no rendered ConfigMap")
    sc = {**pod.get("securityContext", {}), **daemon.get("securityContext", {})}
    check(sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0,
          f"{name}: the daemon may run as root")
    check(sc.get("allowPrivilegeEscalation") is False,
          f"{name}: privilege escalation allowed")
    svc = kinds["Service"]
    check(svc["spec"].get("clusterIP") == "None", f"{name}: Service not headless")
    check(any(p["name"] == "metrics" and p["port"] == 9464
              for p in svc["spec"]["ports"]), f"{name}: no metrics Service port")
    sel = svc["spec"].get("selector", {})
    tmpl_labels = ds["spec"]["template"]["metadata"]["labels"]
    check(sel and all(tmpl_labels.get(k) == v for k, v in sel.items()),
          f"{name}: the Service selects no daemon pods")
    sm = kinds["ServiceMonitor"]
    check(sm["apiVersion"] == "monitoring.coreos.com/v1",
          f"{name}: ServiceMonitor apiVersion")
    svc_labels = svc["metadata"].get("labels", {})
    check(all(svc_labels.get(k) == v
              for k, v in sm["spec"]["selector"]["matchLabels"].items()),
          f"{name}: the ServiceMonitor does not select the Service")
    check(any(e.get("port") == "metrics" for e in sm["spec"]["endpoints"]),
          f"{name}: ServiceMonitor endpoint is not the metrics port")
    # Our series carry job = the Canzona job id; without honorLabels the
    # operator renames it exported_job and every per-job panel breaks.
    check(all(e.get("honorLabels") is True for e in sm["spec"]["endpoints"]),
          f"{name}: ServiceMonitor endpoints must set honorLabels: true")
    config = kinds["ConfigMap"]["data"]["canzonad.toml"]
    if gpu:
        check('backend = "cuda"' in config, f"{name}: backend is not cuda")
        check(pod.get("nodeSelector"), f"{name}: no nodeSelector")
        check(any(t.get("key") == "nvidia.com/gpu"
                  for t in pod.get("tolerations", [])),
              f"{name}: no nvidia.com/gpu toleration")
        check(host.get("/tmp/nvidia-mps") is not None,
              f"{name}: no MPS pipe directory mount")
        check(not daemon["image"].endswith(":latest"),
              f"{name}: image tag not pinned")
    print(f"{name}: {len(docs)} objects rendered and checked")
    return config


def check_config(config, canzonad):
    """Every key of the config file is a flag of the built canzonad (CLI11
    silently ignores unknown keys, so a typo would go unnoticed)."""
    help_text = subprocess.run([canzonad, "--help"], capture_output=True,
                               text=True).stdout
    pending = {"metrics-address"}  # the metrics exporter adds this flag
    for line in config.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key = line.split("=", 1)[0].strip()
        if f"--{key}" in help_text:
            continue
        if key in pending:
            print(f"NOTE: --{key} is not in this canzonad yet")
            continue
        errors.append(f"config key {key!r} is not a canzonad flag")


def main():
    root = sys.argv[1]
    canzonad = sys.argv[2] if len(sys.argv) > 2 else None
    if shutil.which("kubectl") is None:
        print("SKIP: kubectl not installed (it is not a Debian package)")
        sys.exit(77)
    kdir = os.path.join(root, "deploy", "kubernetes")
    configs = [check_rendered("base", render(os.path.join(kdir, "base")),
                              gpu=False)]
    overlays = os.path.join(kdir, "overlays")
    for overlay in sorted(os.listdir(overlays)):
        configs.append(check_rendered(
            overlay, render(os.path.join(overlays, overlay)),
            gpu=overlay.startswith("gpu")))
    if canzonad:
        for config in configs:
            check_config(config, canzonad)
    lint = subprocess.run(["yamllint", "-s", "-c",
                           os.path.join(kdir, ".yamllint"), kdir],
                          capture_output=True, text=True)
    check(lint.returncode == 0, f"yamllint:\n{lint.stdout}{lint.stderr}")
    if errors:
        print("FAIL:\n  " + "\n  ".join(errors))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
