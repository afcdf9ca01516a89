#include "client/lib/cuda_export.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <utility>

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
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*ipc_mem_handle)(IpcHandle*, void*) = nullptr;
  int (*event_create)(void**, unsigned) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*event_record)(void*, void*) = nullptr;
  int (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  int (*ipc_open_event)(void**, IpcHandle) = nullptr;
  int (*ipc_event_handle)(IpcHandle*, void*) = nullptr;
  int (*pci_bus_id)(char*, int, int) = nullptr;
  // The driver's (libcuda.so.1): every CUDA 12 and 13 driver has them.
  int (*address_range)(uintptr_t*, size_t*, uintptr_t) = nullptr;
  int (*pointer_attribute)(void*, int, uintptr_t) = nullptr;
  std::string error;  // why the runtime is unusable
};

constexpr const char* kRuntimeNames[] = {"libcudart.so.13", "libcudart.so.12",
                                         "libcudart.so"};

// The runtime the process has loaded already: another one would keep a
// current device and contexts of its own that the trainer's CUDA calls
// never see. Else the newest the loader finds.
void* OpenRuntime() {
  for (const char* name : kRuntimeNames) {
    if (void* lib = ::dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return lib;
  }
  for (const char* name : kRuntimeNames) {
    if (void* lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL)) return lib;
  }
  return nullptr;
}

const Runtime& Cudart() {
  static Runtime* runtime = [] {
    auto* r = new Runtime;
    void* lib = OpenRuntime();
    if (lib == nullptr) {
      r->error = "the CUDA runtime (libcudart) is not installed";
      return r;
    }
    auto sym = [&](void* from, const char* library, const char* name,
                   auto* fn) {
      *reinterpret_cast<void**>(fn) = ::dlsym(from, name);
      if (*reinterpret_cast<void**>(fn) == nullptr && r->error.empty()) {
        r->error = absl::StrCat(library, " lacks ", name);
      }
    };
    auto runtime_sym = [&](const char* name, auto* fn) {
      sym(lib, "libcudart", name, fn);
    };
    runtime_sym("cudaGetErrorString", &r->error_string);
    runtime_sym("cudaPointerGetAttributes", &r->pointer_attributes);
    runtime_sym("cudaGetDevice", &r->get_device);
    runtime_sym("cudaSetDevice", &r->set_device);
    runtime_sym("cudaIpcGetMemHandle", &r->ipc_mem_handle);
    runtime_sym("cudaEventCreateWithFlags", &r->event_create);
    runtime_sym("cudaEventDestroy", &r->event_destroy);
    runtime_sym("cudaEventRecord", &r->event_record);
    runtime_sym("cudaStreamWaitEvent", &r->stream_wait_event);
    runtime_sym("cudaIpcOpenEventHandle", &r->ipc_open_event);
    runtime_sym("cudaIpcGetEventHandle", &r->ipc_event_handle);
    runtime_sym("cudaDeviceGetPCIBusId", &r->pci_bus_id);
    if (!r->error.empty()) return r;
    void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver == nullptr) {
      r->error = "no CUDA driver (libcuda.so.1) is installed";
      return r;
    }
    sym(driver, "libcuda.so.1", "cuMemGetAddressRange_v2", &r->address_range);
    sym(driver, "libcuda.so.1", "cuPointerGetAttribute", &r->pointer_attribute);
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

// Makes a device current on the calling thread for as long as it lives,
// then the one that was current before: a trainer thread that drives
// several GPUs keeps allocating and launching where it did.
class DeviceScope {
 public:
  static absl::StatusOr<DeviceScope> Enter(const Runtime& r, int device) {
    int previous = 0;
    if (absl::Status s = Check(r, r.get_device(&previous), "cudaGetDevice");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(r, r.set_device(device), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    return DeviceScope(r, previous, previous != device);
  }
  DeviceScope(DeviceScope&& other) noexcept
      : runtime_(other.runtime_),
        previous_(other.previous_),
        restore_(std::exchange(other.restore_, false)) {}
  DeviceScope& operator=(DeviceScope&&) = delete;
  ~DeviceScope() {
    if (restore_) runtime_->set_device(previous_);
  }

 private:
  DeviceScope(const Runtime& r, int previous, bool restore)
      : runtime_(&r), previous_(previous), restore_(restore) {}
  const Runtime* runtime_;
  int previous_;
  bool restore_;
};

// An event of either kind goes with its owner, best effort (a destructor
// cannot report).
void DestroyEvent(void* event, int device) {
  const Runtime& rt = Cudart();
  if (!rt.error.empty()) return;
  if (absl::StatusOr<DeviceScope> scope = DeviceScope::Enter(rt, device);
      scope.ok()) {
    rt.event_destroy(event);
  }
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
  absl::StatusOr<DeviceScope> scope = DeviceScope::Enter(rt, attributes.device);
  if (!scope.ok()) return scope.status();
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
  absl::StatusOr<DeviceScope> scope = DeviceScope::Enter(rt, device);
  if (!scope.ok()) return scope.status();
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
  absl::StatusOr<DeviceScope> scope = DeviceScope::Enter(rt, device_);
  if (!scope.ok()) return scope.status();
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
  absl::StatusOr<DeviceScope> scope = DeviceScope::Enter(rt, device);
  if (!scope.ok()) return scope.status();
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
  absl::StatusOr<DeviceScope> scope = DeviceScope::Enter(rt, device_);
  if (!scope.ok()) return scope.status();
  return Check(rt, rt.stream_wait_event(stream, event_, 0),
               "cudaStreamWaitEvent");
}

}  // namespace canzona
