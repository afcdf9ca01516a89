// GPU trainers: their parameter and gradient tensors stay in device memory
// and are described to canzonad by CUDA IPC handles (no copies, nothing
// over gRPC).
//
//   CANZONA_ASSIGN_OR_RETURN(auto event, canzona::CudaExportEvent::Create(0));
//   CANZONA_ASSIGN_OR_RETURN(canzona::v1::BufferRef grad,
//       canzona::CudaBufferRef(g_ptr, bytes, event->handle()));
//   *parameter->mutable_grad() = grad;   // in the RegisterRequest
//   ... after backward wrote the gradients: event->Record(stream), then
//   GradReady / Step (the daemon waits on the event before reading them).
//
// The parameters may name a second event (CudaBufferRef(p_ptr, bytes,
// params_event->handle())): the daemon records it after writing them and
// answers Step / WaitParams without waiting for its GPU work; after each
// such answer the trainer calls params_event->Wait(stream), so that its
// stream reads the new parameters.
//
// CudaBufferRef takes the IPC handle of the whole allocation holding the
// pointer (cudaIpcGetMemHandle on its base, found with
// cuMemGetAddressRange) and the pointer's offset in it, as caching
// allocators hand out pieces of larger blocks, and names the GPU by its PCI
// bus id, so that the daemon finds it whatever CUDA_VISIBLE_DEVICES either
// process runs under.
//
// The CUDA runtime is loaded when first needed (dlopen of libcudart), so
// the library links no CUDA library and CPU-only trainers never load it.
// Without a runtime or a device every call returns FAILED_PRECONDITION.
//
// Thread-safety: thread-safe; a CudaExportEvent is used by one thread.
#ifndef CANZONA_CLIENT_LIB_CUDA_EXPORT_H_
#define CANZONA_CLIENT_LIB_CUDA_EXPORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

// A BufferRef for `bytes` of device memory at `device_ptr`;
// `event_handle` is a CudaExportEvent's handle: the gradients' (recorded by
// the trainer) or the parameters' (recorded by the daemon).
// INVALID_ARGUMENT when the pointer is not device memory or the range
// leaves its allocation; FAILED_PRECONDITION, saying what to change, when
// the memory cannot be shared with legacy CUDA IPC (a cudaMallocAsync pool,
// PyTorch's expandable segments).
absl::StatusOr<canzona::v1::BufferRef> CudaBufferRef(
    const void* device_ptr, uint64_t bytes,
    const std::string& event_handle = "");

// An interprocess CUDA event (timing disabled) between the trainer and the
// daemon, which opens it from handle(): the trainer records the gradients'
// after writing them; its stream waits for the parameters' after each
// answer.
class CudaExportEvent {
 public:
  static absl::StatusOr<std::unique_ptr<CudaExportEvent>> Create(int device);
  ~CudaExportEvent();
  CudaExportEvent(const CudaExportEvent&) = delete;
  CudaExportEvent& operator=(const CudaExportEvent&) = delete;

  const std::string& handle() const { return handle_; }
  // cudaEventRecord on `stream` (a cudaStream_t; null: the legacy default
  // stream).
  absl::Status Record(void* stream);
  // cudaStreamWaitEvent: work enqueued on `stream` later waits on the device
  // for the event's last record, in either process.
  absl::Status Wait(void* stream);

 private:
  CudaExportEvent(void* event, int device, std::string handle)
      : event_(event), device_(device), handle_(std::move(handle)) {}
  void* event_;
  int device_;
  std::string handle_;
};

}  // namespace canzona

#endif  // CANZONA_CLIENT_LIB_CUDA_EXPORT_H_
