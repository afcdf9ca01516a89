"""Canzona: matrix optimizers (Muon, Shampoo, SOAP) as a per-node service.

The trainer side of Canzona in Python. ``canzona.Client`` talks to the
``canzonad`` on this machine; ``canzona.torch`` has drop-in
``torch.optim.Optimizer`` classes built on it.

    import canzona
    client = canzona.Client()                 # $CANZONA_TARGET or the local socket
    print(client.status())

Errors from the daemon raise ``canzona.CanzonaError`` whose ``code`` is the
gRPC status name ("INVALID_ARGUMENT", "UNAVAILABLE", ...).

Pure Python: with grpcio and protobuf importable the client calls the
daemon through the generated stubs in canzona/_proto; without them (or with
CANZONA_TRANSPORT=bridge) through a ``canzona-bridge`` child process
($CANZONA_BRIDGE, PATH, or next to this package). Shared memory uses the
standard library; CUDA IPC uses torch and the CUDA runtime through ctypes.
"""

from canzona._blocks import (blocks, head_blocks, megatron_fc1_blocks,
                             megatron_qkv_blocks)
from canzona._client import Client, default_target
from canzona._cuda import CudaEvent
from canzona._errors import CanzonaError
from canzona._shm import SharedBuffer

__version__ = "0.1.0"

__all__ = ["Client", "CanzonaError", "CudaEvent", "SharedBuffer",
           "blocks", "default_target", "head_blocks", "megatron_fc1_blocks",
           "megatron_qkv_blocks", "__version__"]
