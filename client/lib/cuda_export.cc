#include "client/lib/cuda_export.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace canzona {
namespace {

// The few runtime entry points we need, declared here (the C ABI of
// libcudart is stable) so that nothing needs CUDA headers or links it.
constexpr size_t kHandleBytes = 64;  // CUDA_IPC_HANDLE_SIZE
constexpr int kMemoryTypeDevice = 2;
constexpr unsigned kEventDisableTiming = 0x02;
constexpr unsigned kEventInterprocess = 0x04;
constexpr int kAttributeLegacyIpcCapable = 10;  // CU_POINTER_ATTRIBUTE_IS_...
struct PointerAttributes {                      // struct cudaPointerAttributes
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
  long reserved[8];
};
struct IpcHandle {
  char reserved[kHandleBytes];
};

struct Runtime {
  const char* (*error_string)(int) = nullptr;
  int (*pointer_attributes)(PointerAttributes*, const void*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*ipc_mem_handle)(IpcHandle*, void*) = nullptr;
  int (*driver_entry)(const char*, void**, unsigned, unsigned long long,
                      int*) = nullptr;
  int (*event_create)(void**, unsigned) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*event_record)(void*, void*) = nullptr;
  int (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  int (*ipc_open_event)(void**, IpcHandle) = nullptr;
  int (*ipc_event_handle)(IpcHandle*, void*) = nullptr;
  int (*pci_bus_id)(char*, int, int) = nullptr;
  // cuMemGetAddressRange and cuPointerGetAttribute (driver), through the
  // runtime's entry point.
  int (*address_range)(uintptr_t*, size_t*, uintptr_t) = nullptr;
  int (*pointer_attribute)(void*, int, uintptr_t) = nullptr;
  std::string error;  // why the runtime is unusable
};

const Runtime& Cudart() {
  static Runtime* runtime = [] {
    auto* r = new Runtime;
    void* lib = nullptr;
    for (const char* name :
         {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
      lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      r->error = "the CUDA runtime (libcudart) is not installed";
      return r;
    }
    auto sym = [&](const char* name, auto* fn) {
      *reinterpret_cast<void**>(fn) = ::dlsym(lib, name);
      if (*reinterpret_cast<void**>(fn) == nullptr && r->error.empty()) {
        r->error = absl::StrCat("libcudart lacks ", name);
      }
    };
    sym("cudaGetErrorString", &r->error_string);
    sym("cudaPointerGetAttributes", &r->pointer_attributes);
    sym("cudaSetDevice", &r->set_device);
    sym("cudaIpcGetMemHandle", &r->ipc_mem_handle);
    sym("cudaGetDriverEntryPointByVersion", &r->driver_entry);
    sym("cudaEventCreateWithFlags", &r->event_create);
    sym("cudaEventDestroy", &r->event_destroy);
    sym("cudaEventRecord", &r->event_record);
    sym("cudaStreamWaitEvent", &r->stream_wait_event);
    sym("cudaIpcOpenEventHandle", &r->ipc_open_event);
    sym("cudaIpcGetEventHandle", &r->ipc_event_handle);
    sym("cudaDeviceGetPCIBusId", &r->pci_bus_id);
    auto driver = [&](const char* name, auto* fn) {
      if (!r->error.empty()) return;
      void* found_fn = nullptr;
      int found = -1;
      const int err = r->driver_entry(name, &found_fn, 12000,
                                      /*cudaEnableDefault=*/0, &found);
      if (err != 0 || found != 0 || found_fn == nullptr) {
        r->error = absl::StrCat("no usable CUDA driver (", name,
                                " unavailable, error ", err, ")");
      } else {
        *reinterpret_cast<void**>(fn) = found_fn;
      }
    };
    driver("cuMemGetAddressRange", &r->address_range);
    driver("cuPointerGetAttribute", &r->pointer_attribute);
    return r;
  }();
  return *runtime;
}

absl::Status Unusable(const Runtime& r) {
  return absl::FailedPreconditionError(
      absl::StrCat("no usable CUDA device: ", r.error));
}

absl::Status Check(const Runtime& r, int err, const char* what) {
  if (err == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", r.error_string(err)));
}

// Makes `device` current on the calling thread (every event call does).
absl::Status SetDevice(const Runtime& r, int device) {
  return Check(r, r.set_device(device), "cudaSetDevice");
}

// An event of either kind goes with its owner, best effort (a destructor
// cannot report).
void DestroyEvent(void* event, int device) {
  const Runtime& rt = Cudart();
  if (rt.error.empty() && rt.set_device(device) == 0) rt.event_destroy(event);
}

}  // namespace

absl::StatusOr<canzona::v1::BufferRef> CudaBufferRef(
    const void* device_ptr, uint64_t bytes, const std::string& event_handle) {
  const Runtime& rt = Cudart();
  if (!rt.error.empty()) return Unusable(rt);
  if (device_ptr == nullptr) {
    return absl::InvalidArgumentError("device_ptr is null");
  }
  if (!event_handle.empty() && event_handle.size() != kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "event_handle has ", event_handle.size(), " bytes, not 64"));
  }
  PointerAttributes attributes{};
  if (rt.pointer_attributes(&attributes, device_ptr) != 0 ||
      attributes.type != kMemoryTypeDevice) {
    return absl::InvalidArgumentError(
        "device_ptr is not CUDA device memory of this process");
  }
  if (absl::Status s =
          Check(rt, rt.set_device(attributes.device), "cudaSetDevice");
      !s.ok()) {
    return s;
  }
  // Legacy CUDA IPC shares only cudaMalloc allocations: not memory of a
  // stream-ordered pool (cudaMallocAsync) nor virtual-memory-management
  // mappings (PyTorch's expandable segments), whose export would fail
  // obscurely, or worse, on the daemon's side.
  int legacy_ipc = 0;
  if (rt.pointer_attribute(&legacy_ipc, kAttributeLegacyIpcCapable,
                           reinterpret_cast<uintptr_t>(device_ptr)) == 0 &&
      legacy_ipc == 0) {
    return absl::FailedPreconditionError(
        "device_ptr lives in memory CUDA IPC cannot share (a cudaMallocAsync "
        "pool or a virtual-memory mapping): allocate the trainer's buffers "
        "with cudaMalloc; with PyTorch, do not set expandable_segments:True "
        "or backend:cudaMallocAsync in PYTORCH_ALLOC_CONF (or "
        "PYTORCH_CUDA_ALLOC_CONF, its old name)");
  }
  char bus_id[32] = {};
  if (absl::Status s =
          Check(rt, rt.pci_bus_id(bus_id, sizeof(bus_id), attributes.device),
                "cudaDeviceGetPCIBusId");
      !s.ok()) {
    return s;
  }
  uintptr_t base = 0;
  size_t size = 0;
  if (rt.address_range(&base, &size, reinterpret_cast<uintptr_t>(device_ptr)) !=
      0) {
    return absl::InvalidArgumentError(
        "cuMemGetAddressRange failed: device_ptr is in no allocation");
  }
  const uint64_t offset = reinterpret_cast<uintptr_t>(device_ptr) - base;
  if (bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "[device_ptr, device_ptr + ", bytes, ") leaves its allocation of ",
        size, " bytes at offset ", offset));
  }
  IpcHandle handle;
  if (absl::Status s =
          Check(rt, rt.ipc_mem_handle(&handle, reinterpret_cast<void*>(base)),
                "cudaIpcGetMemHandle");
      !s.ok()) {
    return s;
  }
  canzona::v1::BufferRef ref;
  canzona::v1::CudaIpcBufferRef* ipc = ref.mutable_cuda_ipc();
  ipc->set_mem_handle(std::string(handle.reserved, kHandleBytes));
  ipc->set_offset(offset);
  ipc->set_bytes(bytes);
  ipc->set_device(attributes.device);
  ipc->set_event_handle(event_handle);
  ipc->set_pci_bus_id(absl::AsciiStrToLower(bus_id));
  return ref;
}

absl::StatusOr<std::unique_ptr<CudaExportEvent>> CudaExportEvent::Create(
    int device) {
  const Runtime& rt = Cudart();
  if (!rt.error.empty()) return Unusable(rt);
  if (absl::Status s = SetDevice(rt, device); !s.ok()) return s;
  void* event = nullptr;
  if (absl::Status s = Check(
          rt, rt.event_create(&event, kEventDisableTiming | kEventInterprocess),
          "cudaEventCreateWithFlags");
      !s.ok()) {
    return s;
  }
  IpcHandle handle;
  if (absl::Status s = Check(rt, rt.ipc_event_handle(&handle, event),
                             "cudaIpcGetEventHandle");
      !s.ok()) {
    rt.event_destroy(event);
    return s;
  }
  return std::unique_ptr<CudaExportEvent>(new CudaExportEvent(
      event, device, std::string(handle.reserved, kHandleBytes)));
}

CudaExportEvent::~CudaExportEvent() { DestroyEvent(event_, device_); }

absl::Status CudaExportEvent::Record(void* stream) {
  const Runtime& rt = Cudart();
  if (absl::Status s = SetDevice(rt, device_); !s.ok()) return s;
  return Check(rt, rt.event_record(event_, stream), "cudaEventRecord");
}

absl::StatusOr<std::unique_ptr<CudaOpenedEvent>> CudaOpenedEvent::Open(
    const std::string& handle, int device) {
  if (handle.size() != kHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("event handle has ", handle.size(), " bytes, not 64"));
  }
  const Runtime& rt = Cudart();
  if (!rt.error.empty()) return Unusable(rt);
  if (absl::Status s = SetDevice(rt, device); !s.ok()) return s;
  IpcHandle h;
  std::memcpy(h.reserved, handle.data(), kHandleBytes);
  void* event = nullptr;
  if (absl::Status s =
          Check(rt, rt.ipc_open_event(&event, h), "cudaIpcOpenEventHandle");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<CudaOpenedEvent>(new CudaOpenedEvent(event, device));
}

CudaOpenedEvent::~CudaOpenedEvent() { DestroyEvent(event_, device_); }

absl::Status CudaOpenedEvent::Wait(void* stream) {
  const Runtime& rt = Cudart();
  if (absl::Status s = SetDevice(rt, device_); !s.ok()) return s;
  return Check(rt, rt.stream_wait_event(stream, event_, 0),
               "cudaStreamWaitEvent");
}

}  // namespace canzona
