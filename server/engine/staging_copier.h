// How one thread of a rank moves bytes into, out of and within its staging
// buffers, in order with the communicators that thread drives.
//
// Two data planes share the engine's step code through this interface:
//  - host (Gloo): staging is host memory; Copy is a memcpy, done on return.
//  - device (NCCL): staging is the rank's GPU memory; Copy enqueues a
//    cudaMemcpyAsync (cudaMemcpyDefault: a trainer's CUDA IPC buffer or
//    shared memory on the other side) on the copier's stream, the stream
//    the thread's NCCL communicators run on, so a copy and the collective
//    after it need no host wait between them.
//
//   std::unique_ptr<StagingCopier> c = ...;
//   CANZONA_RETURN_IF_ERROR(c->WaitEvent(trainer_backward_done));
//   CANZONA_RETURN_IF_ERROR(c->Copy(staging, trainer_grads, bytes));
//   CANZONA_RETURN_IF_ERROR(dp->ReduceScatterV(staging, counts, mine));
//   CANZONA_RETURN_IF_ERROR(c->Finish());   // before the host reads, or
//   CANZONA_RETURN_IF_ERROR(c->HandTo(compute_stream));  // the device
//
// Every range is checked against the staging backend's allocations and the
// memory registered with it (kernels/allocation_registry.h): a copy's sides
// each lie inside one allocation or outside all of them (a host <-> device
// copy); a device conversion, a kernel, reads and writes inside them only.
// A violation is INVALID_ARGUMENT naming the copier's method, the side and
// the allocation, before anything is enqueued.
//
// Thread-safety: one thread at a time (like the communicators it serves).
#ifndef CANZONA_SERVER_ENGINE_STAGING_COPIER_H_
#define CANZONA_SERVER_ENGINE_STAGING_COPIER_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/allocation_registry.h"
#include "kernels/base/dtype.h"
#include "server/comm/communicator.h"
#include "server/comm/nccl_api.h"

namespace canzona {

class StagingCopier {
 public:
  virtual ~StagingCopier() = default;

  // Copies (host) or enqueues the copy of (device) `bytes`; zero is a no-op.
  virtual absl::Status Copy(void* dst, const void* src, int64_t bytes) = 0;
  // `n` elements of `from` as `to` (widened exactly, or rounded to nearest
  // even; a plain copy when equal), in the same order as Copy. Mixed
  // precision: trainer bf16 / fp16 values into fp32 staging and back.
  virtual absl::Status Convert(DType from, const void* src, DType to, void* dst,
                               int64_t n) = 0;
  // Mixed precision, parameters the trainer changed: each of `n` fp32
  // `masters` (staging) whose rounding to `dtype` is not the trainer's
  // value at `values` any more takes that value (kernels/base/dtype.h's
  // ReloadMasters), in the same order as Copy.
  virtual absl::Status ReloadMasters(DType dtype, const void* values,
                                     float* masters, int64_t n) = 0;
  // Work enqueued later waits on the device for `event` (a cudaEvent_t the
  // trainer recorded after backward). Device copiers only.
  virtual absl::Status WaitEvent(NcclEvent event) = 0;
  // Returns once `event` completed (polled on the host, bounded by the
  // copier's timeout: DEADLINE_EXCEEDED naming `what`), so that nothing
  // enqueued later depends on it on the device. For events another process
  // may never complete (a trainer's, or a snapshot of one) ahead of NCCL
  // work: NCCL's abort synchronizes with everything enqueued before its
  // kernels. Device copiers only.
  virtual absl::Status AwaitEvent(NcclEvent event, absl::string_view what) = 0;
  // Records `event` (a "parameters written" event the daemon exported,
  // ExportedEvents) after everything enqueued so far, in place of Finish's
  // host wait: the trainer's stream waits for it on the device. Device
  // copiers only.
  virtual absl::Status RecordEvent(NcclEvent event) = 0;
  // Returns once everything enqueued so far (copies and the collectives on
  // the same stream) is complete: DEADLINE_EXCEEDED past the timeout.
  virtual absl::Status Finish() = 0;
  // Hands what was enqueued so far to another thread's stream without a
  // host wait: work enqueued on `stream` from here on runs after it (an
  // event `stream` waits for on the device). A null `stream` (a backend
  // that finishes each call before returning) gets Finish's wait instead.
  // Host copiers: nothing is in flight.
  virtual absl::Status HandTo(NcclStream stream) = 0;
  // The reverse: work enqueued here from here on runs after what `stream`
  // (not null) holds now. Device copiers only.
  virtual absl::Status TakeFrom(NcclStream stream) = 0;
  // The stream to create this thread's NCCL communicators on (null: host).
  virtual NcclStream stream() const = 0;
  // How many times the host waited for this copier's work (Finish, and
  // HandTo with a null stream); any thread may read it.
  virtual int64_t host_waits() const = 0;
  // Checks one side of a copy the caller makes itself, as Copy checks its
  // sides (inside one staging allocation or outside them all): a CUDA IPC
  // copy between a trainer's device memory and host staging, which goes
  // through the IPC layer rather than the copier.
  virtual absl::Status CheckCopySide(absl::string_view what,
                                     absl::string_view side, const void* p,
                                     int64_t bytes) const = 0;

  // Copies between the host and a GPU so far whose host side was pageable
  // (kernels/pageable_copies.h): a device copier's own Copy calls (the
  // runtime says, NcclApi::HostPageable), and the copies the rank made
  // itself through a trainer's CUDA IPC buffers (TrainerBuffers), counted
  // here with NotePageableCopy. Any thread may read it
  // (StepResponse.pageable_copies).
  int64_t pageable_copies() const {
    return pageable_copies_.load(std::memory_order_relaxed);
  }
  // Counts one such copy by `what` of `bytes` with its host side at
  // `host`: here and process-wide (CountPageableCopy).
  void NotePageableCopy(absl::string_view what, const void* host,
                        int64_t bytes);

 private:
  std::atomic<int64_t> pageable_copies_{0};
};

// `staging` (the staging backend's allocations, Backend::allocations())
// must outlive the copier.
std::unique_ptr<StagingCopier> CreateHostStagingCopier(
    const AllocationRegistry* staging);

// A copier with its own non-blocking stream on `device`; `api` and
// `staging` must outlive it.
absl::StatusOr<std::unique_ptr<StagingCopier>> CreateDeviceStagingCopier(
    NcclApi* api, int device, absl::Duration timeout,
    const AllocationRegistry* staging);

class PinnedHostFloats;  // pinned_host_memory.h

// values <- their sum over `comm`, through the copier's staging: `values`
// to `host`, to `staged`, the all-reduce on the copier's stream, and back,
// with one wait (Finish, bounded by the copier's timeout) at the end.
// `staged`: values.size() floats of staging; `host`: at least as many host
// floats, page-locked beside a GPU, so that no copy waits inside the
// driver; abandoned when the wait fails (the copy into them may still
// run). The step's world sums and the uneven calibration's.
absl::Status SumThroughStaging(StagingCopier& copier, Communicator& comm,
                               float* staged, PinnedHostFloats& host,
                               absl::Span<float> values);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_STAGING_COPIER_H_
