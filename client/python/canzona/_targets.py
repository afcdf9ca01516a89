"""Daemon addresses: the default target and what kind a target is.

A module of its own so that the transports (_grpc_transport) and the client
(_client) both use it without importing each other.
"""

import os


def is_unix_target(target):
    return target.startswith("unix:") or target.startswith("unix-abstract:")


def default_target():
    """The daemon address: $CANZONA_TARGET, else the local daemon's socket."""
    target = os.environ.get("CANZONA_TARGET")
    if target:
        return target
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return "unix:%s/canzona/canzonad.sock" % runtime
    return "unix:/tmp/canzona-%d/canzonad.sock" % os.getuid()
