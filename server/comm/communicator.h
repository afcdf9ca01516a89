// The data-plane communicator of one process group: the collectives the
// distributed step (server/DESIGN.md section 4) runs between the daemons'
// device workers, on float32 buffers given as pointer + element count.
//
// Implementations: Gloo over TCP for host memory (gloo_communicator.h), NCCL
// on device memory, each operation on a CUDA stream (nccl_communicator.h,
// over the NcclApi seam of nccl_api.h), and an in-process fake for tests of
// the layers above (fake_communicator.h). The interface is pointer + count
// based and names no transport type, so the engine is written once against
// it.
//
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> dp,
//       CreateGlooCommunicator(&store, "job/a/gen/0/dp/0", rank, size, {}));
//   // Rank r receives the sum over ranks of the r-th slice.
//   CANZONA_RETURN_IF_ERROR(dp->ReduceScatterV(grads, slice_counts, owned));
//   ...
//   CANZONA_RETURN_IF_ERROR(dp->AllGatherV(owned, slice_counts, params));
//
// ReduceScatterV and AllGatherV also move bf16 / fp16 elements (their
// typed forms; DESIGN.md section 5.1: mixed-precision trainers reduce
// gradients and gather parameters in their own dtype, half the bytes).
// 16-bit sums are accumulated in fp32 in rank order and rounded once
// (Gloo, the fake), or reduced natively (NCCL).
//
// Semantics shared by every implementation:
//  - Every rank of the group calls the same operations in the same order
//    with the same counts (per-peer counts of AllToAllV mirrored: what rank
//    i sends to j is what j expects from i). The plan digest check before
//    the first step is what makes this true; a disagreement is a
//    programming error (the fake reports it; Gloo may not).
//  - Counts are element counts; zero counts are allowed, and a pointer may
//    be null when it addresses zero elements.
//  - Invalid arguments return INVALID_ARGUMENT naming the field before any
//    communication; the communicator stays usable.
//  - A peer that does not take part within the timeout yields
//    DEADLINE_EXCEEDED, a peer whose connection breaks (process died,
//    Abort) yields UNAVAILABLE; both name the operation. After such a
//    failure, or after Abort(), the communicator is unusable (the transport
//    state of a half-finished collective cannot be trusted, as with NCCL):
//    every later call returns FAILED_PRECONDITION; create a new one.
//
// Thread-safety: a Communicator is used by one thread at a time (its device
// worker); only Abort() may be called from another thread.
#ifndef CANZONA_SERVER_COMM_COMMUNICATOR_H_
#define CANZONA_SERVER_COMM_COMMUNICATOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/base/dtype.h"

namespace canzona {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Sum-reduce-scatter with uneven slices: `send` holds sum(counts) elements
  // laid out as size() contiguous slices in rank order; rank r receives into
  // `recv` (counts[r] elements) the element-wise sum over all ranks of
  // slice r. `recv` may alias `send` (in-place).
  absl::Status ReduceScatterV(const float* send,
                              absl::Span<const int64_t> counts, float* recv) {
    return ReduceScatterVTyped(DType::kFloat32, send, counts, recv);
  }
  // The same on elements of `dtype` (send and recv alike).
  virtual absl::Status ReduceScatterVTyped(DType dtype, const void* send,
                                           absl::Span<const int64_t> counts,
                                           void* recv) = 0;

  // All-gather with uneven slices: rank r contributes counts[r] elements
  // from `send`; every rank receives all slices, concatenated in rank order,
  // into `recv` (sum(counts) elements). `send` may equal
  // recv + (offset of slice rank()) (in-place).
  absl::Status AllGatherV(const float* send, absl::Span<const int64_t> counts,
                          float* recv) {
    return AllGatherVTyped(DType::kFloat32, send, counts, recv);
  }
  // The same on elements of `dtype`.
  virtual absl::Status AllGatherVTyped(DType dtype, const void* send,
                                       absl::Span<const int64_t> counts,
                                       void* recv) = 0;

  // Personalized all-to-all: `send` holds size() contiguous slices in rank
  // order, send_counts[j] elements for rank j; `recv` receives
  // recv_counts[i] elements from rank i, contiguous in rank order.
  // send_counts[rank()] must equal recv_counts[rank()]. No aliasing.
  virtual absl::Status AllToAllV(const float* send,
                                 absl::Span<const int64_t> send_counts,
                                 float* recv,
                                 absl::Span<const int64_t> recv_counts) = 0;

  // In-place sum all-reduce of `count` elements.
  virtual absl::Status AllReduce(float* data, int64_t count) = 0;

  // Copies `count` elements of `root`'s `data` into every rank's `data`.
  virtual absl::Status Broadcast(float* data, int64_t count, int root) = 0;

  // Returns when every rank has entered the barrier.
  virtual absl::Status Barrier() = 0;

  // Breaks the communicator on purpose (shutdown, a failed step): every
  // later call here returns FAILED_PRECONDITION. Where the transport tells
  // peers (Gloo: closed connections), those blocked in a collective with
  // this rank fail promptly with UNAVAILABLE instead of waiting for their
  // timeout; NCCL tells none (NcclCommunicator), so there they fail at
  // their timeout. Idempotent; callable from any thread. A call
  // blocked on this rank at that moment returns at the latest when its
  // timeout expires.
  virtual void Abort() = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_COMMUNICATOR_H_
