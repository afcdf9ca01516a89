#!/usr/bin/env python3
"""Include and import layering: fails on an arrow that runs the wrong way.

The layers, lowest first: proto/ (the API and the shared-memory protocol),
kernels/, server/, client/. A file includes only its own layer and those
below (tests/ may include anything). Within them:
  - the planner and the step simulator (server/plan/) include no
    communicator: of server/comm/ only the pure nccl_uneven.h;
  - the engine's registration (server/engine/registration.*) reads its
    settings from engine_options.h, not the engine's implementation;
  - the Python package (client/python/canzona) has no import cycle;
  - proto/ keeps hand-written C++ in folders named for what it is
    (proto/shared_memory, proto/names), never beside the .proto files.

    python3 tests/layering/check_includes.py [--root DIR]
"""

import argparse
import os
import re
import sys

LAYERS = ["proto", "kernels", "server", "client"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cc", ".cu", ".cuh")


def files(root, top):
    for folder, _, names in os.walk(os.path.join(root, top)):
        for name in names:
            if name.endswith(SOURCES):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, root)


def includes(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def layer(path):
    top = path.split("/", 1)[0]
    return LAYERS.index(top) if top in LAYERS else None


def rules(path, included):
    """The problems of one include."""
    mine, theirs = layer(path), layer(included)
    if theirs is None and included.startswith("canzona/v1/"):
        theirs = 0  # generated protobuf headers belong to proto/
    if mine is not None and theirs is not None and theirs > mine:
        yield "%s includes %s, a higher layer" % (path, included)
    if (path.startswith("server/plan/") and included.startswith("server/comm/")
            and included != "server/comm/nccl_uneven.h"):
        yield "%s includes %s: the planner links no communicator" % (
            path, included)
    if (re.match(r"server/engine/registration\.(h|cc)$", path)
            and included == "server/engine/engine_impl.h"):
        yield "%s includes engine_impl.h: use engine_options.h" % path


def proto_folders(root):
    """Hand-written C++ at proto/'s top or beside the .proto files."""
    for path in files(root, "proto"):
        folder = os.path.dirname(path)
        if folder == "proto" or folder.startswith("proto/canzona"):
            yield ("%s: hand-written C++ in proto/ belongs in a folder named "
                   "for what it is (proto/shared_memory, proto/names)" % path)


def python_cycles(root):
    package = os.path.join(root, "client", "python", "canzona")
    graph = {}
    pattern = re.compile(
        r"^\s*(?:from canzona\.(\w+) import|from canzona import ([\w, ]+)"
        r"|import canzona\.(\w+))", re.M)
    for name in os.listdir(package):
        if not name.endswith(".py"):
            continue
        module = name[:-3]
        with open(os.path.join(package, name), encoding="utf-8") as f:
            text = f.read()
        edges = set()
        for a, b, c in pattern.findall(text):
            for target in ([a] if a else [c] if c else
                           [t.strip() for t in b.split(",")]):
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    problems = []
    state = {}

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                problems.append("client/python/canzona: import cycle " +
                                " -> ".join(cycle))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    root = parser.parse_args().root
    problems = []
    checked = 0
    for top in LAYERS:
        for path in files(root, top):
            for included in includes(root, path):
                checked += 1
                problems.extend(rules(path, included))
    problems.extend(proto_folders(root))
    problems.extend(python_cycles(root))
    for problem in problems:
        print("check_includes: " + problem)
    if problems:
        return 1
    print("check_includes: %d includes and the Python imports follow the "
          "layers" % checked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
