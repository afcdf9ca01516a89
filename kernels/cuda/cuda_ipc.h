// CUDA IPC: a GPU trainer's parameter and gradient buffers shared with the
// daemon (another process on the same node) without copies, and the events
// that order the daemon's reads after the trainer's backward.
//
// Trainer side:
//   CANZONA_ASSIGN_OR_RETURN(CudaIpcExport grad, ExportCudaIpc(ptr, bytes));
//   // grad.mem_handle names the whole allocation holding ptr (a caching
//   // allocator's block); grad.offset is ptr's place in it.
//   CANZONA_ASSIGN_OR_RETURN(CudaIpcEvent done, CreateCudaIpcEvent(device));
//   ... record done.event on the backward stream, then call GradReady/Step.
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

namespace canzona {

// Bytes of cudaIpcMemHandle_t and cudaIpcEventHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

struct CudaIpcExport {
  std::string mem_handle;  // kCudaIpcHandleBytes
  uint64_t offset = 0;     // of the pointer in its allocation
  uint64_t bytes = 0;
  int device = 0;
};

// The IPC handle of the device allocation holding [ptr, ptr + bytes).
// INVALID_ARGUMENT when ptr is not device memory or the range leaves its
// allocation.
absl::StatusOr<CudaIpcExport> ExportCudaIpc(const void* ptr, uint64_t bytes);

// An interprocess event (timing disabled) on `device` and its handle; the
// trainer records it after writing gradients. Destroys the event when the
// object goes.
class CudaIpcEvent {
 public:
  virtual ~CudaIpcEvent() = default;
  virtual void* event() const = 0;  // a cudaEvent_t
  virtual const std::string& handle() const = 0;
};
absl::StatusOr<std::unique_ptr<CudaIpcEvent>> CreateCudaIpcEvent(int device);

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
  // exporting process's last record of it completed.
  virtual absl::StatusOr<void*> OpenEvent(const std::string& handle,
                                          int device) = 0;
  virtual absl::Status WaitEvent(void* event, int device) = 0;
  virtual void CloseEvent(void* event, int device) = 0;
  // Synchronous copies between opened memory and host memory.
  virtual absl::Status CopyToHost(int device, const void* src, size_t bytes,
                                  void* dst) = 0;
  virtual absl::Status CopyFromHost(int device, const void* src, size_t bytes,
                                    void* dst) = 0;
};
CudaIpcOpener* RealCudaIpcOpener();

// Synchronous copies between device memory (of `device`) and host memory.
absl::Status CudaCopyToHost(int device, const void* src, size_t bytes,
                            void* dst);
absl::Status CudaCopyFromHost(int device, const void* src, size_t bytes,
                              void* dst);

}  // namespace canzona

#endif  // CANZONA_KERNELS_CUDA_CUDA_IPC_H_
