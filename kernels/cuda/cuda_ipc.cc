#include "kernels/cuda/cuda_ipc.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/base/cuda_host_memory.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/poll.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

// cuMemGetAddressRange through the runtime's driver entry point, so that
// nothing links libcuda (absent on machines without a driver).
using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

absl::StatusOr<GetAddressRange> AddressRangeFn() {
  static std::once_flag once;
  static GetAddressRange fn = nullptr;
  static cudaError_t error = cudaSuccess;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSuccess;
    error = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000,
                                             cudaEnableDefault, &found);
    if (error == cudaSuccess && found == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<GetAddressRange>(p);
    }
  });
  if (fn == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no usable CUDA device: cuMemGetAddressRange unavailable (",
        cudaGetErrorString(error), ")"));
  }
  return fn;
}

absl::StatusOr<CudaIpcOpened> AllocationOf(const void* ptr) {
  CANZONA_ASSIGN_OR_RETURN(GetAddressRange fn, AddressRangeFn());
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r =
      fn(&base, &size, reinterpret_cast<CUdeviceptr>(const_cast<void*>(ptr)));
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuMemGetAddressRange failed (", static_cast<int>(r),
                     "): not device memory of this process"));
  }
  return CudaIpcOpened{reinterpret_cast<void*>(base),
                       static_cast<uint64_t>(size)};
}

// `bytes` as a CUDA IPC handle of type Handle; INVALID_ARGUMENT naming
// `field` when the size is not the handle's.
template <typename Handle>
absl::StatusOr<Handle> HandleFromBytes(const std::string& bytes,
                                       absl::string_view field) {
  if (bytes.size() != sizeof(Handle)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", bytes.size(), " bytes, not ", sizeof(Handle)));
  }
  Handle handle;
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  return handle;
}

class RealOpener final : public CudaIpcOpener {
 public:
  absl::StatusOr<CudaIpcOpened> Open(const std::string& mem_handle,
                                     int device) override {
    CANZONA_ASSIGN_OR_RETURN(
        cudaIpcMemHandle_t handle,
        HandleFromBytes<cudaIpcMemHandle_t>(mem_handle, "mem_handle"));
    CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    void* base = nullptr;
    CANZONA_CUDA_RETURN_IF_ERROR(
        cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess));
    absl::StatusOr<CudaIpcOpened> opened = AllocationOf(base);
    if (!opened.ok()) {
      (void)cudaIpcCloseMemHandle(base);
      return opened.status();
    }
    return CudaIpcOpened{base, opened->size};
  }
  // Failures here are left behind as the thread's last error, which the
  // next kernel launch's check would report as its own: cleared.
  void Close(const CudaIpcOpened& opened, int device) override {
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaIpcCloseMemHandle(opened.base) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  absl::StatusOr<void*> OpenEvent(const std::string& handle,
                                  int device) override {
    CANZONA_ASSIGN_OR_RETURN(
        cudaIpcEventHandle_t h,
        HandleFromBytes<cudaIpcEventHandle_t>(handle, "event_handle"));
    CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaEvent_t event = nullptr;
    CANZONA_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&event, h));
    return static_cast<void*>(event);
  }
  absl::Status WaitEvent(void* event, int device,
                         absl::Time deadline) override {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    // Polled rather than cudaEventSynchronize, which cannot be bounded.
    return PollUntilDone([&]() -> absl::StatusOr<bool> {
      const cudaError_t status =
          cudaEventQuery(static_cast<cudaEvent_t>(event));
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) {
        return CudaStatus(status, "cudaEventQuery (the trainer's event)");
      }
      // NotReady is recorded as the thread's last error: the next launch's
      // check would report it as its own.
      (void)cudaGetLastError();
      if (absl::Now() < deadline) return false;
      return absl::DeadlineExceededError(
          "the trainer's gradients-written event did not complete in "
          "time: is the trainer alive?");
    });
  }
  void CloseEvent(void* event, int device) override {
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  absl::Status CopyToHost(int device, const void* src, size_t bytes,
                          void* dst) override {
    return CudaCopyToHost(device, src, bytes, dst);
  }
  absl::Status CopyFromHost(int device, const void* src, size_t bytes,
                            void* dst) override {
    return CudaCopyFromHost(device, src, bytes, dst);
  }
  bool HostPageable(int device, const void* host, size_t) override {
    if (cudaSetDevice(device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return CudaHostPageable(host);
  }
  absl::StatusOr<int> DeviceOfPciBusId(const std::string& pci_bus_id) override {
    int device = -1;
    const cudaError_t err =
        cudaDeviceGetByPCIBusId(&device, pci_bus_id.c_str());
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::NotFoundError(absl::StrCat(
          "no GPU with PCI bus id '", pci_bus_id,
          "' is visible to this process (", cudaGetErrorString(err), ")"));
    }
    return device;
  }
  absl::StatusOr<std::string> PciBusIdOf(int device) override {
    char id[32] = {};
    CANZONA_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(id, sizeof(id), device));
    return absl::AsciiStrToLower(id);
  }
};

}  // namespace

CudaIpcOpener* RealCudaIpcOpener() {
  static RealOpener* opener = new RealOpener;
  return opener;
}

absl::Status CudaCopyToHost(int device, const void* src, size_t bytes,
                            void* dst) {
  if (bytes == 0) return absl::OkStatus();
  CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status CudaCopyFromHost(int device, const void* src, size_t bytes,
                              void* dst) {
  if (bytes == 0) return absl::OkStatus();
  CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy returns once the bytes are staged for
  // DMA, not once they landed; the reader (the trainer's process, another
  // stream) is not ordered after it, so wait for the copy itself.
  CANZONA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  return absl::OkStatus();
}

}  // namespace canzona
