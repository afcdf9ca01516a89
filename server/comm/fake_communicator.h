// An in-process fake of a process group for tests of the layers above (the
// step engine): `size` Communicators sharing memory, driven from `size`
// threads, with the exact semantics of the real ones (same argument checks,
// same sums in rank order, same "a failure breaks the group" rule), plus
// what a test needs to look inside:
//  - a record of every call per rank (op name, counts, root), to assert the
//    call sequence a step issued;
//  - failure injection: the next call of an op on a rank returns a given
//    Status; its peers in that call fail with UNAVAILABLE naming the rank,
//    as they would on a real transport, and the group is broken after;
//  - cross-rank checks a real transport cannot afford: ranks that call
//    different ops or disagree on counts get FAILED_PRECONDITION saying so.
//
//   FakeCommunicatorGroup group(2);
//   group.InjectFailure(1, "AllGatherV", absl::UnavailableError("link down"));
//   std::thread t1([&] { RunStep(group.communicator(1)); });
//   RunStep(group.communicator(0));
//   t1.join();
//   EXPECT_EQ(group.calls(0)[0].op, "ReduceScatterV");
//
// Thread-safety: each Communicator is driven by one thread at a time, as
// the interface says; the group's own methods (InjectFailure, calls) are
// thread-safe. Communicators handed out by TakeCommunicator() share the
// group's state and may outlive the group object.
#ifndef CANZONA_SERVER_COMM_FAKE_COMMUNICATOR_H_
#define CANZONA_SERVER_COMM_FAKE_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/base/dtype.h"
#include "server/comm/communicator.h"

namespace canzona {

// One call as a rank issued it (after argument checks passed or failed).
struct FakeCommCall {
  std::string op;                    // "ReduceScatterV", "AllReduce", ...
  std::vector<int64_t> counts;       // counts / send_counts / {count}; {} for
                                     // Barrier
  std::vector<int64_t> recv_counts;  // AllToAllV only
  int root = -1;                     // Broadcast only
  // ReduceScatterV / AllGatherV: the element type (others are fp32).
  DType dtype = DType::kFloat32;
  absl::Status status;  // what the call returned
};

namespace fake_comm_internal {
struct GroupState;
}  // namespace fake_comm_internal

class FakeCommunicatorGroup {
 public:
  // `timeout` bounds how long a rank waits for its peers in one call
  // (DEADLINE_EXCEEDED after, like the Gloo context timeout).
  explicit FakeCommunicatorGroup(int size,
                                 absl::Duration timeout = absl::Seconds(30));
  ~FakeCommunicatorGroup();

  int size() const;
  // The communicator of `rank`, owned by the group (null once taken).
  Communicator* communicator(int rank);
  // Transfers ownership of rank's communicator (for code that owns one).
  std::unique_ptr<Communicator> TakeCommunicator(int rank);

  // The next call of `op` on `rank` returns `status` (not OK) without
  // touching any buffer; see the file comment for its peers.
  void InjectFailure(int rank, const std::string& op, absl::Status status);

  // Every call `rank` made, in order.
  std::vector<FakeCommCall> calls(int rank) const;

 private:
  std::shared_ptr<fake_comm_internal::GroupState> state_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_FAKE_COMMUNICATOR_H_
