// CUDA IPC: a GPU trainer's parameter and gradient buffers shared with the
// daemon (another process on the same node) without copies, and the events
// that order the daemon's reads after the trainer's backward.
//
// The trainer side (export a device pointer, create the event) is in the
// client library, client/lib/cuda_export.h.
//
// Daemon side: CudaIpcOpener opens an allocation once (cudaIpcOpenMemHandle
// on the exporting device) and reports its size for the bounds check; the
// refcounting lives in server/engine/cuda_ipc_registry.h. Copies between
// the opened memory and host staging go through CudaCopy*.
//
// Without CUDA (or without a device) every call returns
// FAILED_PRECONDITION ("no usable CUDA device").
//
// Thread-safety: the functions are thread-safe (they set the device on the
// calling thread); an opener is used under its registry's lock.
#ifndef CANZONA_KERNELS_CUDA_CUDA_IPC_H_
#define CANZONA_KERNELS_CUDA_CUDA_IPC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace canzona {

// Bytes of cudaIpcMemHandle_t and cudaIpcEventHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

// An allocation another process exported, opened in this one.
struct CudaIpcOpened {
  void* base = nullptr;
  uint64_t size = 0;  // bytes of the whole allocation
};

// Opens and closes exported allocations and events; real CUDA by default,
// a fake in tests.
class CudaIpcOpener {
 public:
  virtual ~CudaIpcOpener() = default;
  virtual absl::StatusOr<CudaIpcOpened> Open(const std::string& mem_handle,
                                             int device) = 0;
  virtual void Close(const CudaIpcOpened& opened, int device) = 0;
  // An event handle opened for waiting; Wait blocks the host until the
  // exporting process's last record of it completed, or DEADLINE_EXCEEDED
  // at `deadline`: a trainer that died before its GPU reached the record
  // may leave it pending for good, and the waiting thread (a rank's DP
  // lane, per bucket) must still end for the rank to be removed.
  virtual absl::StatusOr<void*> OpenEvent(const std::string& handle,
                                          int device) = 0;
  virtual absl::Status WaitEvent(void* event, int device,
                                 absl::Time deadline) = 0;
  virtual void CloseEvent(void* event, int device) = 0;
  // Synchronous copies between opened memory and host memory.
  virtual absl::Status CopyToHost(int device, const void* src, size_t bytes,
                                  void* dst) = 0;
  virtual absl::Status CopyFromHost(int device, const void* src, size_t bytes,
                                    void* dst) = 0;
  // Whether the host side of such a copy, [host, host + bytes), is
  // pageable to the driver (kernels/base/cuda_host_memory.h): the copy then
  // goes through a bounce buffer, and the daemon counts it
  // (StepResponse.pageable_copies). Asked on `device`, as the copy runs:
  // the first CUDA call of a thread would otherwise make device 0 current
  // (and create its context there).
  virtual bool HostPageable(int device, const void* host, size_t bytes) = 0;
  // The GPU's identity across processes: the device index this process
  // sees for the GPU at `pci_bus_id` (cudaDeviceGetByPCIBusId; NOT_FOUND
  // when it cannot see that GPU), and the PCI bus id of `device`
  // (cudaDeviceGetPCIBusId, lower case, e.g. "0000:3b:00.0").
  virtual absl::StatusOr<int> DeviceOfPciBusId(
      const std::string& pci_bus_id) = 0;
  virtual absl::StatusOr<std::string> PciBusIdOf(int device) = 0;
};
CudaIpcOpener* RealCudaIpcOpener();

// Synchronous copies between device memory (of `device`) and host memory.
absl::Status CudaCopyToHost(int device, const void* src, size_t bytes,
                            void* dst);
absl::Status CudaCopyFromHost(int device, const void* src, size_t bytes,
                              void* dst);

}  // namespace canzona

#endif  // CANZONA_KERNELS_CUDA_CUDA_IPC_H_
