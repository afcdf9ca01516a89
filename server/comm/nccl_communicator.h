// The GPU data plane: a Communicator over NCCL on device pointers, with every
// operation enqueued on one CUDA stream and waited for with a deadline.
//
//   CANZONA_ASSIGN_OR_RETURN(NcclApi* api, RealNcclApi());
//   NcclOptions options;                          // 30 s, default cost model
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> dp,
//       CreateNcclCommunicator(&kv_store, "job/a/gen/0/dp/0", api,
//                              {.rank = r, .device = 0, .stream = stream},
//                              size, options));
//   CANZONA_RETURN_IF_ERROR(dp->ReduceScatterV(d_grads, counts, d_owned));
//
// Creation: rank 0 of the group calls ncclGetUniqueId and publishes the id
// (hex) under "<group_prefix>/nccl_unique_id" in the control-plane KvStore;
// the other ranks wait for that key up to `options.timeout`
// (DEADLINE_EXCEEDED naming it). Then each rank calls ncclCommInitRank on its
// device; CreateNcclCommunicators does this for several local ranks of one
// process (one per device) inside ncclGroupStart/End, as NCCL requires when
// one thread initializes several ranks. The prefix must be unique per
// incarnation of a group (include a generation).
//
// Mapping (all sums; counts are float32 elements; zero counts are skipped;
// an operation with nothing to move returns OK without calling NCCL, which
// is consistent because every rank passes the same counts):
//  - ReduceScatterV, even counts: one ncclReduceScatter. Uneven counts, per
//    call, by `options.chooser` (default ChooseUneven with `options.cost`):
//      kPerRoot: ncclGroupStart; ncclReduce(send + offset(r), counts[r],
//                root r) for every r with counts[r] > 0; ncclGroupEnd.
//      kPadded:  copy slice r of `send` to staging + r * max(counts) for
//                every r, one ncclReduceScatter of max(counts) (in place in
//                the staging buffer), copy this rank's slice to `recv`.
//  - AllGatherV, even counts: one ncclAllGather. Uneven:
//      kPerRoot: grouped ncclBroadcast from every root r with counts[r] > 0
//                into recv + offset(r).
//      kPadded:  copy `send` to staging + rank * max, one ncclAllGather of
//                max (in place), copy every slice out to recv + offset(r).
//  - AllToAllV: ncclSend / ncclRecv for every peer with a nonzero count in
//    one ncclGroupStart/End; this rank's own slice by cudaMemcpyAsync.
//  - AllReduce: ncclAllReduce in place. Broadcast: ncclBroadcast in place.
//    Barrier: ncclAllReduce of one float in the scratch buffer.
//  - An output that overlaps the input other than in NCCL's in-place layout
//    (`recv == send` for ReduceScatterV: NCCL's in-place is recv == send +
//    offset(rank)) goes through the scratch buffer and a device copy.
// The staging / scratch buffer is one device allocation owned by the
// communicator, grown only when an operation needs more than it holds (so
// never per call in steady state), freed at destruction.
//
// Waiting: after enqueueing, the communicator records a CUDA event on its
// stream and polls cudaEventQuery and ncclCommGetAsyncError (spinning
// briefly, then sleeping up to 1 ms between polls) until the event
// completes. An asynchronous NCCL error yields UNAVAILABLE with NCCL's
// message; no completion within `options.timeout` aborts the NCCL
// communicator (ncclCommAbort) and yields DEADLINE_EXCEEDED; a failed
// enqueue (an NCCL or CUDA call's error, growing the scratch buffer
// included) returns that error. All name the operation, abort the NCCL
// communicator, and make every later call return FAILED_PRECONDITION. Abort()
// from another thread calls ncclCommAbort under the communicator's mutex (the
// worker holds it only while it calls into NCCL / CUDA, not while it
// sleeps), so a waiting call returns UNAVAILABLE at its next poll.
//
// Limits (blocking NCCL communicators, NCCL's default): ncclCommInitRank
// and an enqueue that sets up connections lazily block inside NCCL until
// the peers arrive; the timeout bounds the id rendezvous and the completion
// of enqueued work, not those blocking calls. Abort() waits for the mutex,
// i.e. for such a blocking call to return.
//
// Thread-safety: see Communicator (one thread at a time; Abort from any).
#ifndef CANZONA_SERVER_COMM_NCCL_COMMUNICATOR_H_
#define CANZONA_SERVER_COMM_NCCL_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/comm/communicator.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"

namespace canzona {

// The link as the uneven-count chooser sees it: each collective NCCL runs
// costs `launch_us` of latency (launch + protocol steps; several collectives
// in one group still pay it each) and moves bytes at `bytes_per_us`. Set
// from measurements (e.g. nccl-tests' small- and large-message times) or
// configuration; the defaults are a conservative inter-node link.
struct NcclCostModel {
  double launch_us = 15.0;
  double bytes_per_us = 25000.0;  // 25 GB/s
};

enum class NcclUneven {
  kPerRoot,  // grouped ncclReduce / ncclBroadcast, one per nonzero slice
  kPadded,   // one ncclReduceScatter / ncclAllGather of max(counts) each
};

const char* NcclUnevenName(NcclUneven strategy);

// Chooses how to run a ReduceScatterV / AllGatherV with uneven `counts`
// (float32 elements). With P = number of nonzero counts, M = max(counts),
// N = counts.size() and pad_bytes = 4 * (N * M - sum(counts)):
//
//   kPadded  iff  P >= 2 and pad_bytes / bytes_per_us < (P - 1) * launch_us
//
// i.e. the time the padding moves over the link is less than the latency
// of the P - 1 collectives it saves (per-root costs P * launch + sum * 4 /
// bw, padded costs launch + N * M * 4 / bw). The device-local staging
// copies of the padded plan run at memory bandwidth and are not counted.
// Ties and a non-positive bytes_per_us pick kPerRoot. Pure.
NcclUneven ChooseUneven(absl::Span<const int64_t> counts,
                        const NcclCostModel& cost);

// Per-call strategy for uneven counts (the engine may decide per bucket,
// e.g. from measured times); must return the same on every rank for the
// same counts.
using NcclUnevenChooser =
    std::function<NcclUneven(absl::Span<const int64_t> counts)>;

struct NcclOptions {
  // Bounds the unique-id rendezvous and the completion of every operation.
  absl::Duration timeout = absl::Seconds(30);
  NcclCostModel cost;
  // Empty: ChooseUneven(counts, cost).
  NcclUnevenChooser chooser;
  // Scratch allocated at creation (floats): the largest padded collective
  // (size * max slice) the owner will run, so that no step allocates.
  int64_t scratch_floats = 0;
};

// One rank of the group hosted by this process.
struct NcclLocalRank {
  int rank = 0;
  int device = 0;
  NcclStream stream = nullptr;  // the device worker's stream
};

class NcclCommunicator : public Communicator {
 public:
  // Takes ownership of `comm` (an initialized NCCL communicator of `size`
  // ranks in which this process is `local.rank`, on `local.device`):
  // destroyed (or aborted once broken) with the communicator. `api` must
  // outlive it. INVALID_ARGUMENT for a null api / comm or a rank outside
  // [0, size).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      NcclApi* api, NcclComm comm, const NcclLocalRank& local, int size,
      const NcclOptions& options);

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return local_.rank; }
  int size() const override { return size_; }
  int device() const { return local_.device; }

  absl::Status ReduceScatterV(const float* send,
                              absl::Span<const int64_t> counts,
                              float* recv) override;
  absl::Status AllGatherV(const float* send, absl::Span<const int64_t> counts,
                          float* recv) override;
  absl::Status AllToAllV(const float* send,
                         absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts) override;
  absl::Status AllReduce(float* data, int64_t count) override;
  absl::Status Broadcast(float* data, int64_t count, int root) override;
  absl::Status Barrier() override;
  void Abort() override;

  // The asynchronous form for callers that order work on the stream with
  // events (the engine's micro-group pipeline): validates and enqueues the
  // all-to-all and returns without waiting; its completion and errors
  // arrive with the next waiting call or Flush(). A failed enqueue breaks
  // the communicator as above.
  absl::Status EnqueueAllToAll(const float* send,
                               absl::Span<const int64_t> send_counts,
                               float* recv,
                               absl::Span<const int64_t> recv_counts);
  // Waits (deadline, asynchronous errors) for everything enqueued on the
  // stream so far, this communicator's operations and others'.
  absl::Status Flush();
  NcclStream stream() const { return local_.stream; }

  // Bytes of the staging / scratch buffer now (for tests and metrics).
  int64_t scratch_bytes() const;

 private:
  NcclCommunicator(NcclApi* api, NcclComm comm, NcclEvent event,
                   const NcclLocalRank& local, int size,
                   const NcclOptions& options);

  // FAILED_PRECONDITION naming `op` once broken or aborted.
  absl::Status Usable(const char* op) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status UsableLocked(const char* op) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UsableLocked, then makes the device current.
  absl::Status BeginLocked(const char* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `enqueue` (NCCL / CUDA calls on the stream) under the mutex, then
  // waits for the stream's work with the deadline. A failed enqueue or wait
  // breaks the communicator.
  absl::Status Run(const char* op,
                   const std::function<absl::Status()>& enqueue);
  absl::Status WaitLocked(const char* op, absl::Time deadline, bool* done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the communicator broken by `failure` (every later call returns
  // FAILED_PRECONDITION quoting it), aborts the NCCL communicator and
  // returns `failure`.
  absl::Status BreakLocked(absl::Status failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Scratch of at least `floats` elements (grown, never shrunk).
  absl::StatusOr<float*> ScratchLocked(int64_t floats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  NcclUneven Choose(absl::Span<const int64_t> counts) const;

  absl::Status EnqueueReduceScatterV(const float* send,
                                     absl::Span<const int64_t> counts,
                                     float* recv)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueAllGatherV(const float* send,
                                 absl::Span<const int64_t> counts, float* recv)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueAllToAllV(const float* send,
                                absl::Span<const int64_t> send_counts,
                                float* recv,
                                absl::Span<const int64_t> recv_counts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ncclGroupStart, `body`, ncclGroupEnd (also after a failed body).
  absl::Status GroupLocked(const std::function<absl::Status()>& body)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  NcclApi* const api_;
  const NcclLocalRank local_;
  const int size_;
  const NcclOptions options_;

  mutable absl::Mutex mu_;
  NcclComm comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  NcclEvent event_ ABSL_GUARDED_BY(mu_);
  float* scratch_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t scratch_floats_ ABSL_GUARDED_BY(mu_) = 0;
  // Why later calls fail (OK while usable).
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// Rendezvous through `store` and ncclCommInitRank for one rank of a group of
// `size` (see the file comment). `store` and `api` must outlive the call;
// `api` must outlive the communicator.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    KvStore* store, const std::string& group_prefix, NcclApi* api,
    const NcclLocalRank& local, int size, const NcclOptions& options);

// The same for several ranks of the group hosted by this process (distinct
// ranks, normally distinct devices): one id rendezvous, then every
// ncclCommInitRank inside one ncclGroupStart/End. Returns the communicators
// in the order of `locals`.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>>
CreateNcclCommunicators(KvStore* store, const std::string& group_prefix,
                        NcclApi* api, absl::Span<const NcclLocalRank> locals,
                        int size, const NcclOptions& options);

// The KvStore key under which rank 0 publishes the group's unique id.
std::string NcclUniqueIdKey(const std::string& group_prefix);

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_NCCL_COMMUNICATOR_H_
