// CountingCommunicator: wraps a rank's communicator and counts the bytes
// the rank sends into canzona_comm_sent_bytes_total (conventions in
// server/metrics/README.md): the elements it sends to the other ranks for
// reduce-scatter, all-gather (in their dtype) and all-to-all, and a ring's 2
// (n-1)/n of the buffer for all-reduce. Broadcast and Barrier (setup only) are
// not counted.
//
//   auto counting = std::make_unique<CountingCommunicator>(
//       std::move(gloo), CanzonaMetrics::Register(registry), "job1", "3");
//
// Thread-safety: as Communicator (one thread at a time; Abort from any);
// the counters are atomic.
#ifndef CANZONA_SERVER_ENGINE_COUNTING_COMMUNICATOR_H_
#define CANZONA_SERVER_ENGINE_COUNTING_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "server/comm/communicator.h"
#include "server/metrics/canzona_metrics.h"

namespace canzona {

class CountingCommunicator final : public Communicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner,
                       const CanzonaMetrics& metrics, const std::string& job,
                       const std::string& rank);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  // The float forms stay visible beside the typed overrides.
  using Communicator::AllGatherV;
  using Communicator::ReduceScatterV;
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
  absl::Status Broadcast(float* data, int64_t count, int root) override {
    return inner_->Broadcast(data, count, root);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  void Abort() override { inner_->Abort(); }

  // For an all-to-all enqueued on the inner NCCL communicator directly.
  void CountAllToAll(absl::Span<const int64_t> send_counts);

 private:
  static double Bytes(int64_t elements, DType dtype = DType::kFloat32) {
    return static_cast<double>(elements) * DTypeBytes(dtype);
  }
  // Elements of `counts` addressed to the other ranks.
  int64_t Others(absl::Span<const int64_t> counts) const;

  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<Counter> reduce_scatter_;
  std::shared_ptr<Counter> all_gather_;
  std::shared_ptr<Counter> all_reduce_;
  std::shared_ptr<Counter> all_to_all_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_COUNTING_COMMUNICATOR_H_
