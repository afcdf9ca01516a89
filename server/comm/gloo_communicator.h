// The CPU data plane: a Communicator over Gloo's TCP transport, rendezvoused
// through our control-plane KvStore.
//
//   GlooOptions options;                      // loopback, 30 s timeout
//   options.hostname = "10.0.0.7";            // this node's data address
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
//       CreateGlooCommunicator(&kv_store, "job/a/gen/0/dp/0", rank, size,
//                              options));
//
// Creation blocks until every rank of the group has called it with the same
// `group_prefix` (or the timeout passes: DEADLINE_EXCEEDED naming the
// missing rank's key). The prefix must be unique per incarnation of a group
// (include a generation): a later group reading an earlier one's addresses
// would try to connect to dead sockets.
//
// Collectives: ReduceScatterV sends each rank its slice of every peer's
// buffer (Gloo point-to-point, in rounds of GlooReduceScatterChunk
// elements so the received copies stay a fraction of a bucket) and sums
// them in rank order (Debian's Gloo snapshot 5b14351 offers only
// ReduceScatterHalvingDoubling, which hangs for some uneven counts and is
// limited to int counts; see gloo_communicator.cc). AllGatherV, AllToAllV,
// AllReduce, Broadcast and Barrier map to gloo::allgatherv, alltoallv,
// allreduce, broadcast and barrier. Every call uses a fresh Gloo tag so
// consecutive collectives never match each other's messages. Gloo's
// exceptions never leave this library: they become absl::Status.
//
// Process-wide effect: the first creation sets SIGPIPE to SIG_IGN if it is
// at its default. Gloo writes with writev(2), which raises SIGPIPE when a
// peer died; ignored, that write fails with EPIPE and the call returns
// UNAVAILABLE instead of the process being killed.
//
// Thread-safety: see Communicator (one thread at a time; Abort from any).
// Each communicator owns a Gloo TCP device (one epoll thread).
#ifndef CANZONA_SERVER_COMM_GLOO_COMMUNICATOR_H_
#define CANZONA_SERVER_COMM_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/base/dtype.h"
#include "server/comm/communicator.h"
#include "server/control/kv_store.h"

namespace canzona {

struct GlooOptions {
  // Address (name or literal) the TCP device binds to; peers connect to it.
  std::string hostname = "127.0.0.1";
  // Network interface to bind to instead of `hostname` when non-empty.
  std::string iface;
  // Bounds the rendezvous and every collective (Gloo's context timeout).
  absl::Duration timeout = absl::Seconds(30);
};

// Elements of each slice one round of ReduceScatterV moves: the received
// copies (size() x chunk elements of `dtype`) hold about a quarter of the
// bucket (sum(counts)), between 1 and 256 MiB. The engine counts them in
// its memory report.
int64_t GlooReduceScatterChunk(absl::Span<const int64_t> counts, DType dtype);

// `store` must outlive the call (not the communicator: it is only used for
// the rendezvous).
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    KvStore* store, const std::string& group_prefix, int rank, int size,
    const GlooOptions& options);

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_GLOO_COMMUNICATOR_H_
