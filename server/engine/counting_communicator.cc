#include "server/engine/counting_communicator.h"

#include <utility>

#include "kernels/base/status_macros.h"

namespace canzona {

CountingCommunicator::CountingCommunicator(std::unique_ptr<Communicator> inner,
                                           const CanzonaMetrics& m,
                                           const std::string& job,
                                           const std::string& rank)
    : inner_(std::move(inner)),
      reduce_scatter_(
          m.comm_sent_bytes_total->Shared({job, rank, "reduce_scatter"})),
      all_gather_(m.comm_sent_bytes_total->Shared({job, rank, "all_gather"})),
      all_reduce_(m.comm_sent_bytes_total->Shared({job, rank, "all_reduce"})),
      all_to_all_(
          m.comm_sent_bytes_total->Shared({job, rank, "tp_all_to_all"})) {}

absl::Status CountingCommunicator::ReduceScatterVTyped(
    DType dtype, const void* send, absl::Span<const int64_t> counts,
    void* recv) {
  CANZONA_RETURN_IF_ERROR(
      inner_->ReduceScatterVTyped(dtype, send, counts, recv));
  reduce_scatter_->Increment(Bytes(Others(counts), dtype));
  return absl::OkStatus();
}

absl::Status CountingCommunicator::AllGatherVTyped(
    DType dtype, const void* send, absl::Span<const int64_t> counts,
    void* recv) {
  CANZONA_RETURN_IF_ERROR(inner_->AllGatherVTyped(dtype, send, counts, recv));
  if (rank() < static_cast<int>(counts.size())) {
    all_gather_->Increment(Bytes(counts[rank()] * (size() - 1), dtype));
  }
  return absl::OkStatus();
}

absl::Status CountingCommunicator::AllToAllV(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts) {
  CANZONA_RETURN_IF_ERROR(
      inner_->AllToAllV(send, send_counts, recv, recv_counts));
  CountAllToAll(send_counts);
  return absl::OkStatus();
}

absl::Status CountingCommunicator::AllReduce(float* data, int64_t count) {
  CANZONA_RETURN_IF_ERROR(inner_->AllReduce(data, count));
  const int n = size();
  if (n > 1) all_reduce_->Increment(2.0 * (n - 1) / n * Bytes(count));
  return absl::OkStatus();
}

void CountingCommunicator::CountAllToAll(
    absl::Span<const int64_t> send_counts) {
  all_to_all_->Increment(Bytes(Others(send_counts)));
}

int64_t CountingCommunicator::Others(absl::Span<const int64_t> counts) const {
  int64_t total = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (static_cast<int>(j) != rank()) total += counts[j];
  }
  return total;
}

}  // namespace canzona
