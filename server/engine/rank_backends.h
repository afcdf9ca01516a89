// RankBackends: the backends one local rank works with, and the trainer
// memory pinned or registered with them: the compute backend (where the
// updates run), a cpu backend for host memory (the compute backend itself
// when it is a cpu one), and the staging backend, where the communicators
// read and write: the host (Gloo) or the compute backend (NCCL,
// `resident()`). Also the rank's GPU and its PCI bus id.
//
// SetupRank builds it first, and RankRuntime declares it first, so that it
// is destroyed last: after every buffer allocated from the backends and
// everything that copies from the pinned trainer memory.
//
//   Backend& staging = backends.staging();
//   if (&staging == &backends.compute()) ...  // updates in place
//
// Thread-safety: the rank's worker; the backends as Backend describes.
#ifndef CANZONA_SERVER_ENGINE_RANK_BACKENDS_H_
#define CANZONA_SERVER_ENGINE_RANK_BACKENDS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "server/comm/nccl_api.h"
#include "server/engine/pinned_host_memory.h"

namespace canzona {

class RankBackends {
 public:
  RankBackends() = default;
  RankBackends(const RankBackends&) = delete;
  RankBackends& operator=(const RankBackends&) = delete;

  Backend& compute() { return *backend_; }
  Backend& host() { return *host_; }
  Backend& staging() { return *staging_; }
  // Staging is the compute backend's memory (cpu, or the NCCL data plane):
  // updates run in place there.
  bool updates_in_place() const { return staging_ == backend_.get(); }
  // Staging in the rank's GPU memory (the NCCL data plane).
  bool resident() const { return nccl_api_ != nullptr; }
  NcclApi* nccl_api() const { return nccl_api_; }  // null: Gloo
  // The rank's GPU: where its updates run (cuda) or its trainer's buffers
  // live (CUDA IPC), and its PCI bus id (empty: no GPU involved).
  int device() const { return device_; }
  const std::string& pci_bus_id() const { return pci_bus_id_; }
  // Bytes of the trainer's shared memory the driver refused to page-lock.
  int64_t pageable_trainer_bytes() const {
    return pinned_trainer_memory_ != nullptr
               ? pinned_trainer_memory_->refused_bytes()
               : 0;
  }

 private:
  friend class RankBuilder;  // SetupRank

  std::unique_ptr<Backend> backend_;       // compute
  std::unique_ptr<Backend> host_backend_;  // cpu, when `backend_` is not
  Backend* host_ = nullptr;                // a cpu backend
  Backend* staging_ = nullptr;             // host, or backend when resident
  // The trainer's buffers, registered with `staging_` where its
  // collectives and kernels address them in place (range checks).
  std::vector<RegisteredMemory> trainer_memory_;
  NcclApi* nccl_api_ = nullptr;  // set exactly on the NCCL plane
  // The NCCL plane's trainer shared memory, page-locked while the rank
  // lives (destroyed after everything that copies from it).
  std::unique_ptr<PinnedHostMemory> pinned_trainer_memory_;
  int device_ = 0;
  std::string pci_bus_id_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_BACKENDS_H_
