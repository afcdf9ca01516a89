"""What the bundle's runner learns from python3: the interpreter, torch and
the CUDA / NCCL / GPU it sees, the lib folders of the nvidia-* packages
(searched for the CUDA libraries), and which package version holds each
library named on the command line. Prints key=value lines; never fails
(what it cannot learn it leaves out).

    python3 probe_python.py libcublas.so.13 libnccl.so.2 ...
"""

import glob
import os
import platform
import sys


def emit(key, value):
    print("%s=%s" % (key, str(value).replace("\n", " ")))


def nvidia_lib_dirs():
    """site-packages/nvidia/*/lib* of every path entry (the CUDA 13 wheels
    use nvidia/cu13/lib, NCCL nvidia/nccl/lib), then torch/lib."""
    dirs = []
    try:
        import nvidia  # a namespace package: every site-packages' nvidia/
        roots = list(nvidia.__path__)
    except Exception:
        roots = [os.path.join(p, "nvidia") for p in sys.path if p]
    for root in roots:
        for d in sorted(glob.glob(os.path.join(root, "*", "lib*"))):
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


def library_versions(sonames):
    """soname -> "distribution version" from the installed nvidia-*
    distributions' file lists."""
    found = {}
    try:
        from importlib import metadata
    except ImportError:
        return found
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if not name.startswith("nvidia-"):
            continue
        for f in dist.files or []:
            base = os.path.basename(str(f))
            if base in sonames and base not in found:
                found[base] = "%s %s" % (name, dist.version)
    return found


def main():
    sonames = set(sys.argv[1:])
    emit("machine_python", "%s (%s)" % (platform.python_version(),
                                        sys.executable))
    for d in nvidia_lib_dirs():
        emit("libdir", d)
    for soname, version in sorted(library_versions(sonames).items()):
        emit("libversion." + soname, version)
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        emit("have_torch", 0)
        emit("machine_torch", "not importable: %s" % e)
        return
    emit("have_torch", 1)
    emit("machine_torch", torch.__version__)
    emit("machine_torch_cuda", torch.version.cuda)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if os.path.isdir(lib):
        emit("libdir", lib)
    available = torch.cuda.is_available()
    emit("torch_cuda_available", int(available))
    if not available:
        return
    try:
        emit("machine_torch_nccl", ".".join(map(str, torch.cuda.nccl.version())))
    except Exception:
        pass
    props = torch.cuda.get_device_properties(0)
    emit("machine_torch_gpu", "%s, %d MiB, %d SMs" % (
        props.name, props.total_memory // (1 << 20), props.multi_processor_count))


if __name__ == "__main__":
    main()
