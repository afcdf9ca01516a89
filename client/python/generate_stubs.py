#!/usr/bin/env python3
"""Generates canzona/_proto/: the protobuf and gRPC Python stubs of
proto/canzona/v1/*.proto, committed to the tree so that installing the
package needs neither protoc nor a compiler.

    client/python/generate_stubs.py            # rewrite canzona/_proto/
    client/python/generate_stubs.py --check    # fail if they are stale

Uses Debian's protoc (3.21) and grpc_python_plugin (protobuf-compiler-grpc,
gRPC 1.51); the stubs run on protobuf >= 4.21 and grpcio >= 1.51. protoc
names modules after the .proto paths ("canzona.v1.x_pb2"), which inside the
package `canzona` would resolve to canzona/v1/: the modules are flattened
into canzona/_proto/ and the gRPC stubs import their messages relatively.
The ctest python_stubs_current runs --check.
"""

import argparse
import difflib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PROTO_ROOT = os.path.join(ROOT, "proto")
PACKAGE_PROTO_DIR = os.path.join(HERE, "canzona", "_proto")
INIT = ('"""Generated protobuf / gRPC stubs of canzona.v1 '
        '(client/python/generate_stubs.py)."""\n')


def generate(protoc, plugin, out_dir):
    """Writes the flattened stubs into out_dir (which must exist)."""
    protos = sorted(glob.glob(os.path.join(PROTO_ROOT, "canzona", "v1",
                                           "*.proto")))
    if not protos:
        sys.exit("generate_stubs: no .proto files under %s" % PROTO_ROOT)
    with tempfile.TemporaryDirectory() as raw:
        subprocess.run(
            [protoc, "--proto_path=" + PROTO_ROOT, "--python_out=" + raw,
             "--grpc_python_out=" + raw,
             "--plugin=protoc-gen-grpc_python=" + plugin] + protos,
            check=True)
        for path in sorted(glob.glob(os.path.join(raw, "canzona", "v1",
                                                  "*.py"))):
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^from canzona\.v1 import ", "from . import ",
                          text, flags=re.M)
            with open(os.path.join(out_dir, os.path.basename(path)),
                      "w") as f:
                f.write(text)
    with open(os.path.join(out_dir, "__init__.py"), "w") as f:
        f.write(INIT)


def tree(directory):
    """{file name: text} of the .py files in directory."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.py"))):
        with open(path) as f:
            out[os.path.basename(path)] = f.read()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protoc", default=shutil.which("protoc") or "protoc")
    parser.add_argument("--plugin", default=shutil.which("grpc_python_plugin")
                        or "/usr/bin/grpc_python_plugin")
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed stubs, write nothing")
    args = parser.parse_args()
    if not args.check:
        os.makedirs(PACKAGE_PROTO_DIR, exist_ok=True)
        for stale in glob.glob(os.path.join(PACKAGE_PROTO_DIR, "*.py")):
            os.remove(stale)
        generate(args.protoc, args.plugin, PACKAGE_PROTO_DIR)
        return 0
    with tempfile.TemporaryDirectory() as fresh:
        generate(args.protoc, args.plugin, fresh)
        want, have = tree(fresh), tree(PACKAGE_PROTO_DIR)
    stale = False
    for name in sorted(set(want) | set(have)):
        if want.get(name) == have.get(name):
            continue
        stale = True
        sys.stdout.writelines(difflib.unified_diff(
            have.get(name, "").splitlines(True),
            want.get(name, "").splitlines(True),
            "committed/" + name, "generated/" + name))
    if stale:
        version = subprocess.run([args.protoc, "--version"], check=True,
                                 capture_output=True, text=True).stdout
        print("canzona/_proto is stale against proto/ (%s): run "
              "client/python/generate_stubs.py and commit the result"
              % version.strip())
        return 1
    print("canzona/_proto matches proto/canzona/v1 (%d files)" % len(want))
    return 0


if __name__ == "__main__":
    sys.exit(main())
