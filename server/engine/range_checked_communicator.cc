#include "server/engine/range_checked_communicator.h"

#include <utility>

#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

int64_t Total(absl::Span<const int64_t> counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c > 0 ? c : 0;
  return total;
}

}  // namespace

RangeCheckedCommunicator::RangeCheckedCommunicator(
    std::unique_ptr<Communicator> inner, const AllocationRegistry* staging,
    bool device)
    : inner_(std::move(inner)), staging_(*staging), device_(device) {}

absl::Status RangeCheckedCommunicator::Check(absl::string_view what,
                                             absl::string_view arg,
                                             const void* p, int64_t elements,
                                             DType dtype) const {
  const int64_t bytes = elements * DTypeBytes(dtype);
  return device_ ? staging_.CheckInside(what, arg, p, bytes)
                 : staging_.CheckContained(what, arg, p, bytes);
}

int64_t RangeCheckedCommunicator::Mine(absl::Span<const int64_t> counts) const {
  const int r = rank();
  return r >= 0 && r < static_cast<int>(counts.size()) ? counts[r] : 0;
}

absl::Status RangeCheckedCommunicator::ReduceScatterVTyped(
    DType dtype, const void* send, absl::Span<const int64_t> counts,
    void* recv) {
  constexpr absl::string_view kWhat = "ReduceScatterV";
  CANZONA_RETURN_IF_ERROR(Check(kWhat, "send", send, Total(counts), dtype));
  CANZONA_RETURN_IF_ERROR(Check(kWhat, "recv", recv, Mine(counts), dtype));
  return inner_->ReduceScatterVTyped(dtype, send, counts, recv);
}

absl::Status RangeCheckedCommunicator::AllGatherVTyped(
    DType dtype, const void* send, absl::Span<const int64_t> counts,
    void* recv) {
  constexpr absl::string_view kWhat = "AllGatherV";
  CANZONA_RETURN_IF_ERROR(Check(kWhat, "send", send, Mine(counts), dtype));
  CANZONA_RETURN_IF_ERROR(Check(kWhat, "recv", recv, Total(counts), dtype));
  return inner_->AllGatherVTyped(dtype, send, counts, recv);
}

absl::Status RangeCheckedCommunicator::CheckAllToAll(
    const float* send, absl::Span<const int64_t> send_counts, const float* recv,
    absl::Span<const int64_t> recv_counts) const {
  constexpr absl::string_view kWhat = "AllToAllV";
  CANZONA_RETURN_IF_ERROR(
      Check(kWhat, "send", send, Total(send_counts), DType::kFloat32));
  return Check(kWhat, "recv", recv, Total(recv_counts), DType::kFloat32);
}

absl::Status RangeCheckedCommunicator::AllToAllV(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts) {
  CANZONA_RETURN_IF_ERROR(CheckAllToAll(send, send_counts, recv, recv_counts));
  return inner_->AllToAllV(send, send_counts, recv, recv_counts);
}

absl::Status RangeCheckedCommunicator::AllReduce(float* data, int64_t count) {
  CANZONA_RETURN_IF_ERROR(
      Check("AllReduce", "data", data, count, DType::kFloat32));
  return inner_->AllReduce(data, count);
}

absl::Status RangeCheckedCommunicator::Broadcast(float* data, int64_t count,
                                                 int root) {
  CANZONA_RETURN_IF_ERROR(
      Check("Broadcast", "data", data, count, DType::kFloat32));
  return inner_->Broadcast(data, count, root);
}

}  // namespace canzona
