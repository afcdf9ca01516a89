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
// With RegisterRequest.params_events the daemon answers Step / WaitParams
// before its GPU writes of the parameters end, and exports one event per
// bucket (Bucket.params_event_handle); the trainer opens each once and
// makes its stream wait for a bucket's after each answer that hands it
// over:
//   CANZONA_ASSIGN_OR_RETURN(auto written, canzona::CudaOpenedEvent::Open(
//       response.buckets(b).params_event_handle(), 0));
//   ... after Step (every bucket) or WaitParams(b): written->Wait(stream).
//
// CudaBufferRef takes the IPC handle of the whole allocation holding the
// pointer (cudaIpcGetMemHandle on its base, found with
// cuMemGetAddressRange) and the pointer's offset in it, as caching
// allocators hand out pieces of larger blocks, and names the GPU by its PCI
// bus id, so that the daemon finds it whatever CUDA_VISIBLE_DEVICES either
// process runs under.
//
// The CUDA runtime is loaded when first needed, so the library links no
// CUDA library and CPU-only trainers never load it: the libcudart the
// process already has (a trainer built against CUDA 12 keeps its own),
// else the newest found; the two driver calls (cuMemGetAddressRange,
// cuPointerGetAttribute) come from libcuda.so.1 directly. Without a runtime
// or a device every call returns FAILED_PRECONDITION. Every call leaves the
// calling thread's current device as it found it.
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
// `event_handle` (gradients only) is a CudaExportEvent's handle.
// INVALID_ARGUMENT when the pointer is not device memory or the range
// leaves its allocation; FAILED_PRECONDITION, saying what to change, when
// the memory cannot be shared with legacy CUDA IPC (a cudaMallocAsync pool,
// PyTorch's expandable segments).
absl::StatusOr<canzona::v1::BufferRef> CudaBufferRef(
    const void* device_ptr, uint64_t bytes,
    const std::string& event_handle = "");

// An interprocess event another process (the daemon) exported, opened here
// (cudaIpcOpenEventHandle) on `device`; closed with it.
class CudaOpenedEvent {
 public:
  // INVALID_ARGUMENT unless `handle` has 64 bytes; FAILED_PRECONDITION
  // without a CUDA runtime or device.
  static absl::StatusOr<std::unique_ptr<CudaOpenedEvent>> Open(
      const std::string& handle, int device);
  ~CudaOpenedEvent();
  CudaOpenedEvent(const CudaOpenedEvent&) = delete;
  CudaOpenedEvent& operator=(const CudaOpenedEvent&) = delete;

  // cudaStreamWaitEvent: work enqueued on `stream` (a cudaStream_t; null:
  // the legacy default stream) later waits on the device for the
  // exporter's last record.
  absl::Status Wait(void* stream);

 private:
  CudaOpenedEvent(void* event, int device) : event_(event), device_(device) {}
  void* event_;
  int device_;
};

// An interprocess CUDA event (timing disabled) the trainer records after
// writing gradients; the daemon opens it from handle().
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

 private:
  CudaExportEvent(void* event, int device, std::string handle)
      : event_(event), device_(device), handle_(std::move(handle)) {}
  void* event_;
  int device_;
  std::string handle_;
};

}  // namespace canzona

#endif  // CANZONA_CLIENT_LIB_CUDA_EXPORT_H_
