"""CUDA IPC export for GPU trainers, without a compiled extension.

The Python twin of client/lib/cuda_export.cc (same checks, codes and
texts): a device range becomes a BufferRef (JSON mapping) holding the IPC
handle of the whole allocation containing it (cudaIpcGetMemHandle on the
base cuMemGetAddressRange finds, as caching allocators hand out pieces of
larger blocks), the range's offset in it, and the GPU's PCI bus id (the
daemon finds the GPU whatever CUDA_VISIBLE_DEVICES either side runs
under). Memory legacy CUDA IPC cannot share (cudaMallocAsync pools,
PyTorch's expandable segments) is refused up front.

The runtime calls go through ctypes into the libcudart this process
already loaded (torch's), else torch's lib folder, the nvidia-* packages,
then the loader's search path; the driver calls into libcuda.so.1. The
interprocess events are torch's: the one the daemon's copies wait on
before reading gradients (torch.cuda.Event(interprocess=True)) and the
daemon's per-bucket "parameters written" ones the trainer's stream waits
on (torch.cuda.Event.from_ipc_handle). Nothing is loaded until a CUDA
buffer or event is made, so CPU trainers never touch CUDA.

Thread-safety: buffer_ref is thread-safe (it restores the calling thread's
current device); a CudaEvent belongs to one trainer thread.
"""

import base64
import ctypes
import glob
import os
import sys
import threading

from canzona._errors import CanzonaError

_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
_MEMORY_TYPE_DEVICE = 2  # cudaMemoryTypeDevice
# CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
_ATTRIBUTE_LEGACY_IPC_CAPABLE = 10


class _PointerAttributes(ctypes.Structure):
    # struct cudaPointerAttributes (the reserved tail of CUDA >= 12 too).
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("device_pointer", ctypes.c_void_p),
                ("host_pointer", ctypes.c_void_p),
                ("reserved", ctypes.c_long * 8)]


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


def _loaded_libraries(stem):
    """Paths of libraries named stem* that this process has mapped."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # The path is the sixth field and may hold spaces.
                fields = line.rstrip("\n").split(None, 5)
                path = fields[5] if len(fields) == 6 else ""
                if (os.path.basename(path).startswith(stem + ".so")
                        and path not in found):
                    found.append(path)
    except OSError:
        pass
    return found


def _soname_major(path):
    """13 for .../libcudart.so.13 or libcudart.so.13.0.96; None without."""
    tail = os.path.basename(path).partition(".so.")[2]
    major = tail.split(".")[0]
    return int(major) if major.isdigit() else None


def _cudart_candidates():
    """Where libcudart may be, best first: the copy torch loaded, torch's
    lib folder, the nvidia-* pip packages, then the loader's search. Of
    the copies already mapped, torch's CUDA major version first: another
    runtime some extension pulled in (a libcudart.so.12 beside torch's .13)
    would set and read a current device torch does not use."""
    candidates = _loaded_libraries("libcudart")
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    if version:
        want = version.split(".")[0]
        candidates.sort(key=lambda path: str(_soname_major(path)) != want)
    folders = []
    if torch is not None and getattr(torch, "__file__", None):
        folders.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
    for entry in sys.path:
        folders.extend(sorted(glob.glob(os.path.join(entry, "nvidia", "*",
                                                     "lib"))))
    for folder in folders:
        candidates.extend(sorted(glob.glob(os.path.join(folder,
                                                        "libcudart.so*")),
                                 reverse=True))
    candidates.extend(["libcudart.so.13", "libcudart.so.12", "libcudart.so"])
    return candidates


def _load_first(candidates):
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


_INT, _PTR = ctypes.c_int, ctypes.c_void_p
# (attribute, symbol, result type, argument types)
_RUNTIME_FUNCTIONS = [
    ("error_string", "cudaGetErrorString", ctypes.c_char_p, [_INT]),
    ("pointer_attributes", "cudaPointerGetAttributes", _INT,
     [ctypes.POINTER(_PointerAttributes), _PTR]),
    ("get_device", "cudaGetDevice", _INT, [ctypes.POINTER(_INT)]),
    ("set_device", "cudaSetDevice", _INT, [_INT]),
    ("ipc_mem_handle", "cudaIpcGetMemHandle", _INT,
     [ctypes.POINTER(_IpcHandle), _PTR]),
    ("pci_bus_id", "cudaDeviceGetPCIBusId", _INT,
     [ctypes.c_char_p, _INT, _INT]),
]
_DRIVER_FUNCTIONS = [
    ("address_range", "cuMemGetAddressRange_v2", _INT,
     [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
      ctypes.c_uint64]),
    ("pointer_attribute", "cuPointerGetAttribute", _INT,
     [_PTR, _INT, ctypes.c_uint64]),
]


class _Runtime:
    """The few runtime and driver entry points this module calls; ``error``
    says why they are unusable (then not all are set)."""

    def __init__(self):
        self.error = ""
        cudart = _load_first(_cudart_candidates())
        if cudart is None:
            self.error = "the CUDA runtime (libcudart) is not installed"
            return
        driver = _load_first(_loaded_libraries("libcuda") + ["libcuda.so.1"])
        if driver is None:
            self.error = "no usable CUDA driver (libcuda.so.1 not found)"
            return
        for library, functions, what in (
                (cudart, _RUNTIME_FUNCTIONS, "libcudart lacks %s"),
                (driver, _DRIVER_FUNCTIONS,
                 "no usable CUDA driver (libcuda lacks %s)")):
            for attribute, symbol, restype, argtypes in functions:
                try:
                    fn = getattr(library, symbol)
                except AttributeError:
                    self.error = what % symbol
                    return
                fn.restype = restype
                fn.argtypes = argtypes
                setattr(self, attribute, fn)

    def check(self, err, what):
        if err != 0:
            text = self.error_string(err)
            raise CanzonaError("%s: %s" % (
                what, text.decode() if text else "error %d" % err),
                "INTERNAL")


_runtime = None
_runtime_lock = threading.Lock()


def _cudart():
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _Runtime()
        return _runtime


def _unusable(why):
    return CanzonaError("no usable CUDA device: " + why, "FAILED_PRECONDITION")


def buffer_ref(device_ptr, nbytes, event_handle=b""):
    """The BufferRef (protobuf JSON mapping) of ``nbytes`` of device memory
    at ``device_ptr``; ``event_handle`` (gradients only) is a CudaEvent's
    handle. INVALID_ARGUMENT when the pointer is not device memory or the
    range leaves its allocation; FAILED_PRECONDITION, saying what to
    change, when legacy CUDA IPC cannot share the memory."""
    rt = _cudart()
    if rt.error:
        raise _unusable(rt.error)
    if not device_ptr:
        raise CanzonaError("device_ptr is null", "INVALID_ARGUMENT")
    event_handle = bytes(event_handle or b"")
    if event_handle and len(event_handle) != _HANDLE_BYTES:
        raise CanzonaError("event_handle has %d bytes, not 64"
                           % len(event_handle), "INVALID_ARGUMENT")
    attributes = _PointerAttributes()
    if (rt.pointer_attributes(ctypes.byref(attributes), device_ptr) != 0
            or attributes.type != _MEMORY_TYPE_DEVICE):
        raise CanzonaError("device_ptr is not CUDA device memory of this "
                           "process", "INVALID_ARGUMENT")
    previous = ctypes.c_int(-1)
    if rt.get_device(ctypes.byref(previous)) != 0:
        previous.value = -1
    rt.check(rt.set_device(attributes.device), "cudaSetDevice")
    try:
        return _export(rt, device_ptr, nbytes, attributes.device,
                       event_handle)
    finally:
        if previous.value >= 0:
            rt.set_device(previous.value)


def _export(rt, device_ptr, nbytes, device, event_handle):
    # Legacy CUDA IPC shares only cudaMalloc allocations: not memory of a
    # stream-ordered pool (cudaMallocAsync) nor virtual-memory-management
    # mappings (PyTorch's expandable segments), whose export would fail
    # obscurely, or worse, on the daemon's side.
    legacy_ipc = ctypes.c_int(0)
    if (rt.pointer_attribute(ctypes.byref(legacy_ipc),
                             _ATTRIBUTE_LEGACY_IPC_CAPABLE, device_ptr) == 0
            and legacy_ipc.value == 0):
        raise CanzonaError(
            "device_ptr lives in memory CUDA IPC cannot share (a "
            "cudaMallocAsync pool or a virtual-memory mapping): allocate the "
            "trainer's buffers with cudaMalloc; with PyTorch, do not set "
            "expandable_segments:True or backend:cudaMallocAsync in "
            "PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF, its old name)",
            "FAILED_PRECONDITION")
    bus_id = ctypes.create_string_buffer(32)
    rt.check(rt.pci_bus_id(bus_id, 32, device), "cudaDeviceGetPCIBusId")
    base = ctypes.c_uint64(0)
    size = ctypes.c_size_t(0)
    if rt.address_range(ctypes.byref(base), ctypes.byref(size),
                        device_ptr) != 0:
        raise CanzonaError("cuMemGetAddressRange failed: device_ptr is in "
                           "no allocation", "INVALID_ARGUMENT")
    offset = device_ptr - base.value
    if nbytes > size.value - offset:
        raise CanzonaError(
            "[device_ptr, device_ptr + %d) leaves its allocation of %d bytes "
            "at offset %d" % (nbytes, size.value, offset), "INVALID_ARGUMENT")
    handle = _IpcHandle()
    rt.check(rt.ipc_mem_handle(ctypes.byref(handle), base.value),
             "cudaIpcGetMemHandle")
    return {"cuda_ipc": {
        "mem_handle": base64.b64encode(bytes(handle)).decode(),
        "offset": offset,
        "bytes": nbytes,
        "device": device,
        "event_handle": base64.b64encode(event_handle).decode(),
        "pci_bus_id": bus_id.value.decode().lower(),
    }}


def _torch_cuda():
    """torch, when it has a usable CUDA device; FAILED_PRECONDITION else."""
    try:
        import torch
    except ImportError:
        raise _unusable("torch is not installed (CudaEvent is torch's "
                        "interprocess event)") from None
    if not torch.cuda.is_available():
        raise _unusable("torch sees no CUDA device "
                        "(torch.cuda.is_available() is False)")
    return torch


class CudaEvent:
    """An interprocess event (timing disabled) between a GPU trainer and the
    daemon. Made here: the one a trainer records after backward wrote its
    gradients, which the daemon's streams wait for; ``handle`` (64 bytes)
    goes in every gradient's BufferRef. ``opened``: one of the daemon's
    "parameters written" events (register(params_events=True)), which the
    trainer's stream waits for (``wait``)."""

    def __init__(self, device, _event=None):
        torch = _torch_cuda()
        self.device = int(device)
        if _event is not None:
            self._event, self.handle = _event
            return
        try:
            with torch.cuda.device(self.device):
                self._event = torch.cuda.Event(enable_timing=False,
                                               interprocess=True)
                self.handle = bytes(self._event.ipc_handle())
        except RuntimeError as e:
            raise CanzonaError("cudaIpcGetEventHandle: %s" % e,
                               "INTERNAL") from None

    @classmethod
    def opened(cls, device, handle):
        """The event another process exported as ``handle`` (64 bytes),
        opened on ``device`` (cudaIpcOpenEventHandle)."""
        torch = _torch_cuda()
        handle = bytes(handle)
        if len(handle) != _HANDLE_BYTES:
            raise CanzonaError("event handle has %d bytes, not 64"
                               % len(handle), "INVALID_ARGUMENT")
        try:
            event = torch.cuda.Event.from_ipc_handle(
                torch.device("cuda", int(device)), handle)
        except RuntimeError as e:
            raise CanzonaError("cudaIpcOpenEventHandle: %s" % e,
                               "INTERNAL") from None
        return cls(device, _event=(event, handle))

    def record(self, stream=None):
        """Records on ``stream``: a torch.cuda.Stream, a cudaStream_t as an
        int (0: the legacy default stream), or None (the device's current
        stream)."""
        try:
            self._event.record(self._stream(stream))
        except RuntimeError as e:
            raise CanzonaError("cudaEventRecord: %s" % e, "INTERNAL") from None

    def wait(self, stream=None):
        """Work enqueued on ``stream`` (as in ``record``) from now on waits
        on the device for the event's last record, in whichever process
        (cudaStreamWaitEvent; the host does not wait)."""
        try:
            self._event.wait(self._stream(stream))
        except RuntimeError as e:
            raise CanzonaError("cudaStreamWaitEvent: %s" % e,
                               "INTERNAL") from None

    def query(self):
        """Whether the event's last record completed (never blocks)."""
        try:
            return bool(self._event.query())
        except RuntimeError as e:
            raise CanzonaError("cudaEventQuery: %s" % e, "INTERNAL") from None

    def _stream(self, stream):
        import torch
        if stream is None:
            return torch.cuda.current_stream(self.device)
        if isinstance(stream, int):
            return (torch.cuda.default_stream(self.device) if stream == 0
                    else torch.cuda.ExternalStream(stream,
                                                   device=self.device))
        return stream
