// CudaIpcRegistry: the daemon's opened CUDA IPC allocations. A trainer
// exports many tensors that live in a few allocations (a caching
// allocator's blocks), so each (device, allocation handle) is opened once
// and shared; every Map() returns a Mapping that holds a reference, and
// the allocation is closed when the last Mapping goes (Deregister, a dead
// trainer, a refused registration).
//
//   CudaIpcRegistry registry(RealCudaIpcOpener());
//   CANZONA_ASSIGN_OR_RETURN(CudaIpcRegistry::Mapping grad,
//       registry.Map("parameters[3] 'w'.grad", ref.cuda_ipc(), bytes,
//                    DTypeBytes(dtype), device, CudaDeviceCount()));
//   float* device_grad = grad.data();
//
// Validation (INVALID_ARGUMENT naming `field`): the handle's size, the
// device (0 <= device < devices), offset alignment (the element's size: a
// bf16 tensor packed after an odd-sized one starts 2 bytes past a 4-byte
// boundary, and every kernel, copy and collective reading it takes 2-byte
// elements), the byte count
// against the parameter's, and [offset, offset + bytes) inside the opened
// allocation. Which device: TrainerBuffers resolves the trainer's PCI bus id
// to this process's index first.
//
// Thread-safety: thread-safe; Mappings may be destroyed on any thread.
#ifndef CANZONA_SERVER_ENGINE_CUDA_IPC_REGISTRY_H_
#define CANZONA_SERVER_ENGINE_CUDA_IPC_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "kernels/cuda/cuda_ipc.h"

namespace canzona {

class CudaIpcRegistry {
 public:
  // `opener` must outlive the registry.
  explicit CudaIpcRegistry(CudaIpcOpener* opener) : opener_(opener) {}
  ~CudaIpcRegistry();
  CudaIpcRegistry(const CudaIpcRegistry&) = delete;
  CudaIpcRegistry& operator=(const CudaIpcRegistry&) = delete;

  // One referenced range of an opened allocation.
  class Mapping {
   public:
    Mapping() = default;
    Mapping(Mapping&& other) noexcept { *this = std::move(other); }
    Mapping& operator=(Mapping&& other) noexcept;
    ~Mapping() { Reset(); }
    float* data() const { return data_; }
    int device() const { return device_; }
    void Reset();
    // Lets go of the range without releasing it: the allocation stays
    // open until the registry goes (device work that never finished may
    // still read it).
    void Abandon() {
      registry_ = nullptr;
      data_ = nullptr;
    }

   private:
    friend class CudaIpcRegistry;
    CudaIpcRegistry* registry_ = nullptr;
    std::pair<int, std::string> key_;
    float* data_ = nullptr;
    int device_ = 0;
  };

  // Opens `ref` on `device` (this process's index of the GPU the trainer
  // named); `devices`: how many CUDA devices this process sees;
  // `element_bytes`: the size of the buffer's elements (its alignment).
  absl::StatusOr<Mapping> Map(const std::string& field,
                              const canzona::v1::CudaIpcBufferRef& ref,
                              uint64_t expected_bytes, int element_bytes,
                              int device, int devices);

  // Allocations open now (tests).
  int open_allocations() const;

 private:
  struct Entry {
    CudaIpcOpened opened;
    int refs = 0;
  };
  void Release(const std::pair<int, std::string>& key);

  CudaIpcOpener* const opener_;
  mutable absl::Mutex mu_;
  std::map<std::pair<int, std::string>, Entry> open_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_CUDA_IPC_REGISTRY_H_
