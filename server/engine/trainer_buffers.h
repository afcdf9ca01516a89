// TrainerBuffers: one trainer rank's parameter and gradient buffers as the
// daemon sees them, and the copies between them and the rank's staging.
//
// CPU trainers share POSIX shared memory objects (mapped once per object,
// the names and owners checked); GPU trainers export CUDA IPC handles
// (opened through the daemon's CudaIpcRegistry) and the interprocess event
// they record once backward has written the gradients. Either way no tensor
// byte crosses gRPC. Each parameter's buffers hold its dtype (fp32, bf16 or
// fp16); Read widens into fp32 staging (or copies in the trainer's dtype),
// Write rounds to nearest even.
//
// Device memory under host staging (a GPU trainer on the Gloo plane) is
// the expensive case: every copy is a synchronous cudaMemcpy through the
// IPC layer. A plain copy goes straight between the trainer's memory and
// staging; a conversion goes through the caller's scratch (one host
// buffer reused by every copy, never an allocation per copy). Callers
// copy a whole run (Run: a bucket the trainer laid out in bucket order) in
// one call where they can, so a step costs a few large copies rather than
// several small ones per parameter.
//
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<TrainerBuffers> buffers,
//                            TrainerBuffers::Map(request, spec.fragment_numel,
//                                                options));
//   // On the rank's DP lane thread:
//   CANZONA_RETURN_IF_ERROR(buffers->WaitGradients(copier, on_device));
//   CANZONA_RETURN_IF_ERROR(buffers->Read(buffers->grad(j), j, n,
//       DType::kFloat32, staged, copier, device_staging, scratch));
//
// Errors of Map name the field ("parameters[3] 'w'.grad.shm.name: ...").
//
// Thread-safety: Map runs on the registering gRPC thread; afterwards the
// mapping is immutable and the copies run on the rank's DP lane thread
// (and checkpoints never touch trainer memory).
#ifndef CANZONA_SERVER_ENGINE_TRAINER_BUFFERS_H_
#define CANZONA_SERVER_ENGINE_TRAINER_BUFFERS_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "kernels/base/dtype.h"
#include "kernels/cuda/cuda_ipc.h"
#include "proto/shared_memory/shared_memory.h"
#include "server/engine/cuda_ipc_registry.h"
#include "server/engine/staging_copier.h"

namespace canzona {

class TrainerBuffers {
 public:
  struct Options {
    // The trainer's uid (SO_PEERCRED): shm objects must belong to it.
    std::optional<uid_t> owner_uid;
    // CUDA IPC (null only when no trainer exports device memory).
    CudaIpcRegistry* registry = nullptr;
    CudaIpcOpener* opener = nullptr;
    // The node's CUDA devices, asked only when a buffer is device memory
    // (a cpu daemon without GPU trainers never starts CUDA).
    std::function<int()> cuda_devices;
    // RESOURCE_EXHAUSTED beyond this many mapped bytes.
    int64_t max_bytes = int64_t{1} << 40;
    // How long a host wait for the trainer's gradients event may take (the
    // step timeout) before it is DEADLINE_EXCEEDED.
    absl::Duration event_timeout = absl::InfiniteDuration();
  };

  // Maps every parameter's param and grad buffer of `request` (validated:
  // `fragment_numel[j]` elements of the parameter's dtype each).
  static absl::StatusOr<std::unique_ptr<TrainerBuffers>> Map(
      const canzona::v1::RegisterRequest& request,
      absl::Span<const int64_t> fragment_numel, const Options& options);

  ~TrainerBuffers();
  TrainerBuffers(const TrainerBuffers&) = delete;
  // Keeps the CUDA IPC mappings and the opened event open for good rather
  // than closing them at destruction: the rank's device work that reads
  // them did not finish (a stream stuck behind a trainer's event), and
  // would read unmapped memory, an illegal address that breaks every rank
  // on the GPU, once it ran.
  void AbandonMappings();
  TrainerBuffers& operator=(const TrainerBuffers&) = delete;

  int count() const { return static_cast<int>(param_.size()); }
  void* param(int j) const { return param_[j]; }
  void* grad(int j) const { return grad_[j]; }
  DType dtype(int j) const { return dtype_[j]; }
  // Some parameter is not fp32: the daemon keeps fp32 master weights.
  bool mixed_precision() const { return mixed_precision_; }
  // Bytes of trainer memory mapped (shm objects whole, IPC ranges).
  int64_t mapped_bytes() const { return mapped_bytes_; }
  // After the trainer died without removing its shared-memory objects'
  // names: removes those that still name the objects mapped here, so that
  // their memory goes with this mapping (SharedMemory::RemoveNameIfOurs).
  // Returns the first failure; tries every object.
  absl::Status RemoveShmNames() const;
  // Device memory of `device()` (CUDA IPC), else host shared memory.
  bool on_device() const { return on_device_; }
  // The trainer's stream waits for the daemon's "parameters written"
  // events (RegisterRequest.params_events; CUDA IPC buffers only).
  bool waits_for_params_events() const { return params_events_; }
  int device() const { return device_; }

  // Makes what `copier` does next see the trainer's final gradients: a
  // stream wait for the trainer's event (`on_device`: device staging with
  // no NCCL work after it on the copier's stream) or a host wait, polled
  // until the step timeout; nothing when the trainer exported no event.
  absl::Status WaitGradients(StagingCopier& copier, bool on_device) const;
  // The trainer's "gradients written" event, opened (null: none).
  void* grad_event() const { return grad_event_; }
  // How long a host wait for grad_event() lasts (then DEADLINE_EXCEEDED).
  absl::Duration event_timeout() const { return event_timeout_; }
  // Whether the buffers and events were opened through real CUDA (not a
  // test's fake): only then may real CUDA calls use the opened event.
  bool opened_by_cuda() const { return opener_ == RealCudaIpcOpener(); }
  // Whether the data plane's collectives can work on trainer memory in
  // place: host staging (Gloo) over shared memory, device staging (NCCL)
  // over the trainer's CUDA IPC memory.
  bool Addressable(bool device_staging) const {
    return device_staging == on_device_;
  }
  // The start of parameters `js`' gradient (or parameter) buffers when they
  // lie back to back in that order and share one dtype, i.e. a bucket the
  // trainer laid out in bucket order (Megatron's grad buffer, canzona.torch);
  // null otherwise.
  const void* Run(absl::Span<const int> js, bool grads) const;

  // The trainer memory the buffers cover, as the fewest ranges: buffers
  // back to back (a bucket laid out in order) merge into one, so a run of
  // them is one range to the range checks (Backend::RegisterMemory).
  struct MemoryRange {
    const void* begin;
    int64_t bytes;
  };
  std::vector<MemoryRange> MemoryRanges() const;
  // The shared-memory objects mapped whole (page-aligned; none for CUDA
  // IPC buffers): what the NCCL plane page-locks for its copies.
  std::vector<MemoryRange> SharedMemoryMappings() const;

  // Whether copies between the buffers and staging go through the IPC
  // layer (device memory, host staging) rather than the copier.
  bool ThroughHost(bool device_staging) const {
    return on_device_ && !device_staging;
  }
  // `n` elements of trainer memory `src` in parameter j's dtype (j's
  // buffer, or a run starting at it whose buffers share its dtype) into
  // staging `dst` as `as` (widened exactly, or a plain copy in the
  // trainer's dtype), and staging `src` of `from` back into trainer memory
  // `dst` (rounded to nearest even into parameter j's dtype). On the
  // copier's stream with device staging. Through the host (ThroughHost):
  // one synchronous IPC copy, straight into / out of staging when the
  // dtypes match, else through `scratch` (at least n elements of j's
  // dtype: INTERNAL when smaller; unused in every other case).
  absl::Status Read(const void* src, int j, int64_t n, DType as, void* dst,
                    StagingCopier& copier, bool device_staging,
                    absl::Span<char> scratch) const;
  absl::Status Write(DType from, const void* src, int j, int64_t n, void* dst,
                     StagingCopier& copier, bool device_staging,
                     absl::Span<char> scratch) const;
  // Parameter j changed in the trainer (`n` elements of trainer memory
  // `src` in its dtype): each of its fp32 `masters` in staging that no
  // longer rounds to the trainer's value takes it (StagingCopier::
  // ReloadMasters), the others keep their bits. Read's paths and `scratch`.
  absl::Status ReloadMasters(const void* src, int j, int64_t n, float* masters,
                             StagingCopier& copier, bool device_staging,
                             absl::Span<char> scratch) const;

 private:
  TrainerBuffers() = default;
  // `scratch` when it holds `bytes` (INTERNAL naming `what`, the method,
  // otherwise).
  static absl::StatusOr<char*> Scratch(absl::string_view what,
                                       absl::Span<char> scratch, int64_t bytes);
  // Through the host: `bytes` of trainer device memory `src` into
  // `scratch` with one IPC copy, counted by `what` (the method) where the
  // scratch is pageable; the scratch's start.
  absl::StatusOr<const char*> CopyToScratch(absl::string_view what,
                                            const void* src, int64_t bytes,
                                            StagingCopier& copier,
                                            absl::Span<char> scratch) const;
  // Counts an IPC copy by `what` whose host side [host, host + bytes) the
  // runtime sees as pageable on `copier` (StagingCopier::pageable_copies).
  void CountIfPageable(absl::string_view what, const void* host, int64_t bytes,
                       StagingCopier& copier) const;
  // The buffer `ref` of `numel` elements of `dtype` (`where` names it in
  // errors).
  absl::StatusOr<void*> MapOne(const std::string& job_id,
                               const std::string& where,
                               const canzona::v1::BufferRef& ref, int64_t numel,
                               DType dtype, const Options& options);

  std::vector<SharedMemory> shm_;
  std::vector<CudaIpcRegistry::Mapping> ipc_;
  std::vector<void*> param_, grad_;  // per parameter, request order
  std::vector<DType> dtype_;
  std::vector<int64_t> numel_;
  bool mixed_precision_ = false;
  int64_t mapped_bytes_ = 0;
  bool on_device_ = false;
  int device_ = 0;
  CudaIpcOpener* opener_ = nullptr;
  void* grad_event_ = nullptr;  // the trainer's "gradients written" event
  absl::Duration event_timeout_ = absl::InfiniteDuration();
  bool params_events_ = false;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_TRAINER_BUFFERS_H_
