// Argument checks shared by every Communicator implementation, so that the
// Gloo communicator, the fake and (later) NCCL reject the same calls with
// the same INVALID_ARGUMENT messages (the fake's tests then speak for all).
//
//   CANZONA_RETURN_IF_ERROR(
//       comm_args::CheckReduceScatterV(rank(), size(), send, counts, recv));
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_COMM_COMM_ARGS_H_
#define CANZONA_SERVER_COMM_COMM_ARGS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/base/dtype.h"

namespace canzona::comm_args {

// Sum of `counts` (callers validate first: no negatives).
int64_t Total(absl::Span<const int64_t> counts);
// Elements before slice `index`.
int64_t Offset(absl::Span<const int64_t> counts, int index);

// `out` (n elements of `dtype`) = the sum of `parts` (each n elements of
// `dtype`) in rank order, accumulated in fp32 and rounded once for 16-bit
// types: how the Gloo communicator and the fake reduce, so that both give
// the same bits. `out` must not overlap the parts.
void SumInRankOrder(DType dtype, absl::Span<const void* const> parts, int64_t n,
                    void* out);

absl::Status CheckReduceScatterV(int rank, int size, const void* send,
                                 absl::Span<const int64_t> counts,
                                 const void* recv);
absl::Status CheckAllGatherV(int rank, int size, const void* send,
                             absl::Span<const int64_t> counts,
                             const void* recv);
absl::Status CheckAllToAllV(int rank, int size, const float* send,
                            absl::Span<const int64_t> send_counts,
                            const float* recv,
                            absl::Span<const int64_t> recv_counts);
absl::Status CheckAllReduce(const float* data, int64_t count);
absl::Status CheckBroadcast(int size, const float* data, int64_t count,
                            int root);

}  // namespace canzona::comm_args

#endif  // CANZONA_SERVER_COMM_COMM_ARGS_H_
