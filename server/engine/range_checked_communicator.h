// RangeCheckedCommunicator: wraps a rank's communicator and checks every
// buffer range a collective is given against the rank's staging memory
// (the staging backend's allocations and the trainer memory registered
// with it; kernels/allocation_registry.h) before the collective runs.
//
// Why: NCCL reads and writes exactly what the counts say, and a range that
// runs past its buffer corrupts or faults only on a GPU; Gloo on host
// memory hides it. Device staging (NCCL): every range inside one
// allocation; host staging (Gloo, one-rank groups): no range may leave an
// allocation or run into one. A violation is INVALID_ARGUMENT naming the
// collective, the buffer, the range and the allocation, and nothing is
// sent.
//
//   auto checked = std::make_unique<RangeCheckedCommunicator>(
//       std::move(nccl), &staging->allocations(), /*device=*/true);
//
// Thread-safety: as Communicator (one thread at a time; Abort from any).
#ifndef CANZONA_SERVER_ENGINE_RANGE_CHECKED_COMMUNICATOR_H_
#define CANZONA_SERVER_ENGINE_RANGE_CHECKED_COMMUNICATOR_H_

#include <cstdint>
#include <memory>

#include "kernels/allocation_registry.h"
#include "server/comm/communicator.h"

namespace canzona {

class RangeCheckedCommunicator final : public Communicator {
 public:
  // `staging` must outlive the communicator.
  RangeCheckedCommunicator(std::unique_ptr<Communicator> inner,
                           const AllocationRegistry* staging, bool device);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status ReduceScatterVTyped(DType dtype, const void* send,
                                   absl::Span<const int64_t> counts,
                                   void* recv) override;
  absl::Status AllGatherVTyped(DType dtype, const void* send,
                               absl::Span<const int64_t> counts,
                               void* recv) override;
  absl::Status AllToAllV(const float* send,
                         absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts) override;
  absl::Status AllReduce(float* data, int64_t count) override;
  absl::Status Broadcast(float* data, int64_t count, int root) override;
  absl::Status Barrier() override { return inner_->Barrier(); }
  void Abort() override { inner_->Abort(); }

  Communicator* inner() const { return inner_.get(); }

  // AllToAllV's checks alone, for the all-to-alls the NCCL TP lane
  // enqueues on the inner communicator directly (StreamTpLane).
  absl::Status CheckAllToAll(const float* send,
                             absl::Span<const int64_t> send_counts,
                             const float* recv,
                             absl::Span<const int64_t> recv_counts) const;

 private:
  // `elements` of `dtype` at `p` (what: the collective, arg: the buffer).
  absl::Status Check(absl::string_view what, absl::string_view arg,
                     const void* p, int64_t elements, DType dtype) const;
  // counts[rank()], or 0 when counts is too short (the inner communicator
  // reports that).
  int64_t Mine(absl::Span<const int64_t> counts) const;

  const std::unique_ptr<Communicator> inner_;
  const AllocationRegistry& staging_;
  const bool device_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANGE_CHECKED_COMMUNICATOR_H_
