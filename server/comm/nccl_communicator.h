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
// (DEADLINE_EXCEEDED naming it). Then each rank initializes a non-blocking
// NCCL communicator (ncclCommInitRankConfig, blocking = 0) on its device and
// waits, again up to `options.timeout`, for the initialization to finish
// (DEADLINE_EXCEEDED naming the rank when a peer never arrives; the
// communicator is aborted). CreateNcclCommunicators does this for several
// local ranks of one process (one per device) inside ncclGroupStart/End, as
// NCCL requires when one thread initializes several ranks. The prefix must be
// unique per incarnation of a group (include a generation).
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
// The staging / scratch buffer is one device allocation of
// max(options.scratch_floats, 1) floats made at creation and freed at
// destruction; it never grows. An operation that needs more (padded:
// size * max(counts); staged: this rank's count) fails FAILED_PRECONDITION
// naming the need and the reservation, without allocating: cudaFree in a
// step synchronizes the device while other communicators' kernels may wait
// for peers that wait for this one (a multi-communicator deadlock), and a
// size that was not planned is a caller's bug, not a reason to allocate.
//
// Waiting: every NCCL call (or group) is followed by polling
// ncclCommGetAsyncError until the communicator leaves ncclInProgress: a
// non-blocking communicator connects lazily and launches its kernels on an
// NCCL thread, so nothing that depends on the work (a copy of its result,
// the completion event) is enqueued on the stream before then. After the
// last enqueue the communicator records a CUDA event on its stream and polls
// cudaEventQuery and ncclCommGetAsyncError until the event completes. Both
// waits spin briefly, then sleep up to 1 ms between polls, and share one
// deadline, `options.timeout` from the start of the operation, so a dead or
// never-arriving peer fails the operation within the timeout from the first
// collective on: an asynchronous NCCL error yields UNAVAILABLE with NCCL's
// message; no progress by the deadline yields DEADLINE_EXCEEDED; a failed
// call (an NCCL or CUDA call's error, too little scratch included) returns
// that error. All name the operation, abort the NCCL communicator
// (ncclCommAbort), and make every later call return FAILED_PRECONDITION.
//
// Abort: the communicator's mutex is held only while the operating thread
// makes NCCL calls on the communicator (one call, one group, or one poll),
// none of which blocks on a non-blocking communicator, and never while a
// wait sleeps. Abort() from another thread takes it, calls ncclCommAbort
// (which also stops NCCL's work in progress and its launch threads) and
// returns; the waiting call returns UNAVAILABLE at its next poll.
// ncclCommAbort runs under the mutex because it frees the NCCL communicator
// that the polls use.
//
// Teardown: ncclCommFinalize (polled until finished, up to `options.timeout`,
// else aborted), then ncclCommDestroy; nothing but freeing once aborted.
// Communicators of several local ranks torn down together go through
// DestroyNcclCommunicators, which finalizes them inside one
// ncclGroupStart/End before destroying each.
//
// Limits (non-blocking communicators): every NCCL call hands its launch to
// an NCCL thread and is polled for, which adds latency per collective (not
// yet measured on a GPU). Abort() waits (for the mutex) until the operating
// thread's current NCCL call or poll returns, then for ncclCommAbort itself.
// Destruction may wait up to `options.timeout` for ncclCommFinalize. A
// communicator handed to Create that was initialized blocking keeps NCCL's
// blocking calls (a lazy connect then blocks inside the call, under the
// mutex); everything this file creates is non-blocking (and creation
// refuses NCCL_COMM_BLOCKING=1 in the environment, which would override
// that). On NCCL, Abort() ends this rank's work only: ncclCommAbort tells
// no peer, so a peer blocked in a collective with it fails at its own
// timeout (the step timeout), not at once as on Gloo, whose closed
// connections wake it.
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
#include "server/comm/nccl_uneven.h"
#include "server/control/kv_store.h"

namespace canzona {

struct NcclOptions {
  // Bounds the unique-id rendezvous, the initialization, every operation
  // (from its start to its completion) and the finalization.
  absl::Duration timeout = absl::Seconds(30);
  NcclCostModel cost;
  // Empty: ChooseUneven(counts, cost).
  NcclUnevenChooser chooser;
  // Scratch reserved at creation (floats; at least 1, for Barrier): the
  // largest padded collective (size * max slice) and the largest staged
  // overlap the owner will run. It never grows (see the file comment).
  int64_t scratch_floats = 0;
};

// One rank of the group hosted by this process.
struct NcclLocalRank {
  int rank = 0;
  int device = 0;
  NcclStream stream = nullptr;  // the device worker's stream
};

// Owns one NCCL communicator, a CUDA event and the scratch buffer on
// `local.device`; operations come from one thread at a time (the device
// worker), Abort from any.
class NcclCommunicator : public Communicator {
 public:
  // Waits (up to options.timeout) until `comm`'s initialization has finished,
  // then takes ownership of it (an NCCL communicator of `size` ranks in which
  // this process is `local.rank`, on `local.device`): finalized and destroyed
  // (or aborted once broken) with the communicator. Reserves the scratch
  // buffer. `api` must outlive it. INVALID_ARGUMENT for a null api / comm, a
  // rank outside [0, size) or a bad option; DEADLINE_EXCEEDED when the
  // initialization does not finish. On failure the caller keeps `comm`.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      NcclApi* api, NcclComm comm, const NcclLocalRank& local, int size,
      const NcclOptions& options);

  // Finalizes (waiting up to options.timeout, else aborts) and destroys the
  // NCCL communicator unless it was aborted, then frees the scratch buffer
  // and the event. No operation may be running.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return local_.rank; }
  int size() const override { return size_; }
  int device() const { return local_.device; }

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
  absl::Status Broadcast(float* data, int64_t count, int root) override;
  absl::Status Barrier() override;
  void Abort() override;

  // The asynchronous form for callers that order work on the stream with
  // events (the engine's micro-group pipeline): validates and enqueues the
  // all-to-all and returns once NCCL has put it on the stream (the
  // non-blocking launch finished, within options.timeout), without waiting
  // for its completion; its completion and errors arrive with the next
  // waiting call or Flush(). A failure breaks the communicator as above.
  absl::Status EnqueueAllToAll(const float* send,
                               absl::Span<const int64_t> send_counts,
                               float* recv,
                               absl::Span<const int64_t> recv_counts);
  // Waits (deadline, asynchronous errors) for everything enqueued on the
  // stream so far, this communicator's operations and others'.
  absl::Status Flush();
  NcclStream stream() const { return local_.stream; }

  // Bytes of the staging / scratch buffer (for tests and metrics).
  int64_t scratch_bytes() const;

 private:
  friend absl::Status DestroyNcclCommunicators(
      std::vector<std::unique_ptr<Communicator>> comms);

  NcclCommunicator(NcclApi* api, NcclComm comm, NcclEvent event, float* scratch,
                   int64_t scratch_floats, const NcclLocalRank& local, int size,
                   const NcclOptions& options);

  // Finalizes `comms` together (grouped when several), waits for each, then
  // destroys each; aborts those whose finalization fails. Leaves every
  // communicator without its NCCL communicator. Returns the first failure.
  static absl::Status FinalizeAndDestroy(
      absl::Span<NcclCommunicator* const> comms);

  // FAILED_PRECONDITION naming `op` once broken or aborted.
  absl::Status Usable(const char* op) const ABSL_LOCKS_EXCLUDED(mu_);
  // Usable, then makes the device current.
  absl::Status Begin(const char* op) ABSL_LOCKS_EXCLUDED(mu_);
  // Begin, `enqueue` (the operation's NCCL / CUDA calls, given the
  // operation's deadline), an event on the stream, then the wait for it.
  // Any failure breaks the communicator and is returned prefixed with `op`.
  absl::Status Run(const char* op,
                   const std::function<absl::Status(absl::Time)>& enqueue)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `call` (one NCCL call or group, given the NCCL communicator) under the
  // mutex, then polls until NCCL has finished it (no longer in progress),
  // the mutex released between polls. UNAVAILABLE once aborted.
  absl::Status CallNccl(absl::Time deadline,
                        const std::function<absl::Status(NcclComm)>& call)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Polls the event recorded on the stream until it completes.
  absl::Status AwaitEvent(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks the communicator broken by `failure` (kept if already broken:
  // every later call returns FAILED_PRECONDITION quoting the first cause),
  // aborts the NCCL communicator and returns `failure`.
  absl::Status Break(absl::Status failure) ABSL_LOCKS_EXCLUDED(mu_);
  // Break and Abort: records `why` unless already broken, then
  // ncclCommAbort (once).
  void AbortLocked(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The scratch buffer if `elements` of `unit` bytes fit in it, else
  // FAILED_PRECONDITION naming `what`, the need and the reservation.
  absl::StatusOr<char*> ScratchFor(int64_t elements, int64_t unit,
                                   const char* what) const;
  NcclUneven Choose(absl::Span<const int64_t> counts) const;

  absl::Status EnqueueReduceScatterV(DType element, const char* send,
                                     absl::Span<const int64_t> counts,
                                     char* recv, absl::Time deadline);
  absl::Status EnqueueAllGatherV(DType element, const char* send,
                                 absl::Span<const int64_t> counts, char* recv,
                                 absl::Time deadline);
  absl::Status EnqueueAllToAllV(const float* send,
                                absl::Span<const int64_t> send_counts,
                                float* recv,
                                absl::Span<const int64_t> recv_counts,
                                absl::Time deadline);
  // ncclGroupStart, `body`, ncclGroupEnd (also after a failed body).
  absl::Status Group(const std::function<absl::Status()>& body);

  NcclApi* const api_;
  const NcclLocalRank local_;
  const int size_;
  const NcclOptions options_;
  // Used only by the thread running operations (and the destructor).
  const NcclEvent event_;
  float* const scratch_;
  const int64_t scratch_floats_;

  // Held around each single NCCL call on comm_ and by Abort(), never while
  // waiting (see the file comment).
  mutable absl::Mutex mu_;
  NcclComm comm_ ABSL_GUARDED_BY(mu_);  // null once aborted or destroyed
  // Why later calls fail (OK while usable).
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// Rendezvous through `store`, non-blocking ncclCommInitRankConfig and the
// wait for it, for one rank of a group of `size` (see the file comment).
// `store` and `api` must outlive the call; `api` must outlive the
// communicator.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    KvStore* store, const std::string& group_prefix, NcclApi* api,
    const NcclLocalRank& local, int size, const NcclOptions& options);

// The same for several ranks of the group hosted by this process (distinct
// ranks, normally distinct devices): one id rendezvous, then every
// initialization inside one ncclGroupStart/End. Returns the communicators
// in the order of `locals`; tear them down with DestroyNcclCommunicators.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>>
CreateNcclCommunicators(KvStore* store, const std::string& group_prefix,
                        NcclApi* api, absl::Span<const NcclLocalRank> locals,
                        int size, const NcclOptions& options);

// Destroys communicators of this process together, the way one thread must
// tear down several local ranks' NCCL communicators: ncclCommFinalize of every
// usable one inside one ncclGroupStart/End, a wait for each (up to its
// options.timeout; one that does not finish is aborted), ncclCommDestroy of
// each, then the rest of each communicator. Aborted or broken ones are just
// freed. Every element must be an NcclCommunicator over one NcclApi (else
// INVALID_ARGUMENT, and each is destroyed on its own); null elements are
// skipped. Returns the first failure; every communicator is gone on return.
absl::Status DestroyNcclCommunicators(
    std::vector<std::unique_ptr<Communicator>> comms);

// The KvStore key under which rank 0 publishes the group's unique id.
std::string NcclUniqueIdKey(const std::string& group_prefix);

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_NCCL_COMMUNICATOR_H_
