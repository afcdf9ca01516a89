#include "server/comm/fake_communicator.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/base/status_macros.h"
#include "server/comm/comm_args.h"

namespace canzona {
namespace fake_comm_internal {

// One rank's side of the call in flight.
struct Entry {
  FakeCommCall call;
  const void* send = nullptr;  // send / data (inputs)
  void* out = nullptr;         // recv / data (outputs)
};

// The rendezvous all communicators of a group share. A call is a "round":
// phase 1, every rank deposits its Entry; the last to arrive checks that
// the ranks agree; phase 2, each rank computes its output from the others'
// inputs into private memory; once all have read (so in-place buffers are
// no longer needed by anyone) each writes its output and leaves; the last
// to leave opens the next round.
struct GroupState {
  GroupState(int size, absl::Duration timeout)
      : size(size),
        timeout(timeout),
        entries(size),
        observed_break(size),
        calls(size) {}

  const int size;
  const absl::Duration timeout;

  absl::Mutex mu;
  absl::CondVar cv;
  int64_t round ABSL_GUARDED_BY(mu) = 0;
  int arrived ABSL_GUARDED_BY(mu) = 0;
  int computed ABSL_GUARDED_BY(mu) = 0;
  int left ABSL_GUARDED_BY(mu) = 0;
  absl::Status verdict ABSL_GUARDED_BY(mu);  // of the current round
  std::vector<Entry> entries ABSL_GUARDED_BY(mu);
  // Why the group is broken (OK while it works), and whether each rank has
  // already returned an error for it: the first call that hits a break
  // reports it (UNAVAILABLE, as a peer failure surfaces on a transport);
  // later calls return FAILED_PRECONDITION, as the Gloo communicator does.
  absl::Status broken ABSL_GUARDED_BY(mu);
  std::vector<bool> observed_break ABSL_GUARDED_BY(mu);
  std::map<std::pair<int, std::string>, absl::Status> injected
      ABSL_GUARDED_BY(mu);
  std::vector<std::vector<FakeCommCall>> calls ABSL_GUARDED_BY(mu);

  void Break(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (broken.ok()) broken = std::move(why);
    cv.SignalAll();
  }
};

}  // namespace fake_comm_internal

namespace {

using fake_comm_internal::Entry;
using fake_comm_internal::GroupState;

std::string Describe(const FakeCommCall& call) {
  std::string s =
      absl::StrCat(call.op, "(counts=[", absl::StrJoin(call.counts, ","), "]");
  if (call.op == "AllToAllV") {
    absl::StrAppend(&s, ", recv_counts=[", absl::StrJoin(call.recv_counts, ","),
                    "]");
  }
  if (call.op == "Broadcast") absl::StrAppend(&s, ", root=", call.root);
  if (call.dtype != DType::kFloat32) {
    absl::StrAppend(&s, ", dtype=", DTypeName(call.dtype));
  }
  return s + ")";
}

// Do the ranks' calls of one round fit together? (Gloo cannot check this
// cheaply; the fake can, and a test learns more from a clear message.)
absl::Status CheckAgreement(const std::vector<Entry>& entries) {
  const FakeCommCall& first = entries[0].call;
  for (size_t r = 1; r < entries.size(); ++r) {
    const FakeCommCall& other = entries[r].call;
    bool same = other.op == first.op;
    if (same && first.op != "AllToAllV") {
      same = other.counts == first.counts && other.root == first.root &&
             other.dtype == first.dtype;
    }
    if (!same) {
      return absl::FailedPreconditionError(
          absl::StrCat("ranks disagree: rank 0 called ", Describe(first),
                       ", rank ", r, " called ", Describe(other)));
    }
  }
  if (first.op == "AllToAllV") {
    for (size_t i = 0; i < entries.size(); ++i) {
      for (size_t j = 0; j < entries.size(); ++j) {
        if (entries[i].call.counts[j] != entries[j].call.recv_counts[i]) {
          return absl::FailedPreconditionError(
              absl::StrCat("AllToAllV: rank ", i, " sends ",
                           entries[i].call.counts[j], " elements to rank ", j,
                           " which expects ", entries[j].call.recv_counts[i]));
        }
      }
    }
  }
  return absl::OkStatus();
}

// Rank `rank`'s output of the round as bytes, computed from everyone's
// inputs in the same order as the Gloo communicator (sums in rank order).
std::vector<char> Compute(const std::vector<Entry>& e, int rank) {
  const FakeCommCall& call = e[rank].call;
  const int size = static_cast<int>(e.size());
  const int64_t unit = DTypeBytes(call.dtype);
  auto at = [&](int q, int64_t element) {
    return static_cast<const char*>(e[q].send) + element * unit;
  };
  std::vector<char> out;
  auto append = [&](const char* from, int64_t elements) {
    out.insert(out.end(), from, from + elements * unit);
  };
  if (call.op == "ReduceScatterV" || call.op == "AllReduce") {
    const bool scatter = call.op == "ReduceScatterV";
    const int64_t n = scatter ? call.counts[rank] : call.counts[0];
    const int64_t off = scatter ? comm_args::Offset(call.counts, rank) : 0;
    std::vector<const void*> parts(size);
    for (int q = 0; q < size; ++q) parts[q] = at(q, off);
    out.resize(n * unit);
    comm_args::SumInRankOrder(call.dtype, parts, n, out.data());
  } else if (call.op == "AllGatherV") {
    for (int q = 0; q < size; ++q) append(at(q, 0), call.counts[q]);
  } else if (call.op == "AllToAllV") {
    for (int q = 0; q < size; ++q) {
      append(at(q, comm_args::Offset(e[q].call.counts, rank)),
             call.recv_counts[q]);
    }
  } else if (call.op == "Broadcast") {
    append(at(call.root, 0), call.counts[0]);
  }
  return out;
}

class FakeCommunicator : public Communicator {
 public:
  FakeCommunicator(std::shared_ptr<GroupState> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }

  // The float forms stay visible beside the typed overrides.
  using Communicator::AllGatherV;
  using Communicator::ReduceScatterV;
  absl::Status ReduceScatterVTyped(DType dtype, const void* send,
                                   absl::Span<const int64_t> counts,
                                   void* recv) override {
    FakeCommCall call{"ReduceScatterV", {counts.begin(), counts.end()}};
    call.dtype = dtype;
    return Call(std::move(call), send, recv, [&] {
      return comm_args::CheckReduceScatterV(rank_, size(), send, counts, recv);
    });
  }

  absl::Status AllGatherVTyped(DType dtype, const void* send,
                               absl::Span<const int64_t> counts,
                               void* recv) override {
    FakeCommCall call{"AllGatherV", {counts.begin(), counts.end()}};
    call.dtype = dtype;
    return Call(std::move(call), send, recv, [&] {
      return comm_args::CheckAllGatherV(rank_, size(), send, counts, recv);
    });
  }

  absl::Status AllToAllV(const float* send,
                         absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts) override {
    FakeCommCall call{"AllToAllV",
                      {send_counts.begin(), send_counts.end()},
                      {recv_counts.begin(), recv_counts.end()}};
    return Call(std::move(call), send, recv, [&] {
      return comm_args::CheckAllToAllV(rank_, size(), send, send_counts, recv,
                                       recv_counts);
    });
  }

  absl::Status AllReduce(float* data, int64_t count) override {
    FakeCommCall call{"AllReduce", {count}};
    return Call(std::move(call), data, data,
                [&] { return comm_args::CheckAllReduce(data, count); });
  }

  absl::Status Broadcast(float* data, int64_t count, int root) override {
    FakeCommCall call{"Broadcast", {count}};
    call.root = root;
    return Call(std::move(call), data, data, [&] {
      return comm_args::CheckBroadcast(size(), data, count, root);
    });
  }

  absl::Status Barrier() override {
    return Call(FakeCommCall{"Barrier"}, nullptr, nullptr,
                [] { return absl::OkStatus(); });
  }

  void Abort() override {
    absl::MutexLock lock(&state_->mu);
    if (state_->broken.ok()) {
      state_->Break(
          absl::UnavailableError(absl::StrCat("rank ", rank_, " aborted")));
    }
    // Its own later calls are FAILED_PRECONDITION, not the first report.
    state_->observed_break[rank_] = true;
  }

 private:
  template <typename CheckFn>
  absl::Status Call(FakeCommCall call, const void* in, void* out,
                    CheckFn&& check) {
    const std::string op = call.op;
    absl::Status status = Run(call, in, out, check);
    if (!status.ok()) {
      status = absl::Status(
          status.code(),
          absl::StrCat(op, " on rank ", rank_, " of a fake group (size ",
                       size(), "): ", status.message()));
    }
    call.status = status;
    absl::MutexLock lock(&state_->mu);
    state_->calls[rank_].push_back(std::move(call));
    return status;
  }

  // Reports a break this rank has not reported yet; otherwise says the
  // communicator is unusable.
  absl::Status BrokenStatus(GroupState& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    if (!s.observed_break[rank_]) {
      s.observed_break[rank_] = true;
      return absl::UnavailableError(
          absl::StrCat("the group broke: ", s.broken.ToString()));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "communicator is unusable after an earlier failure or Abort; create a "
        "new one: ",
        s.broken.ToString()));
  }

  template <typename CheckFn>
  absl::Status Run(const FakeCommCall& call, const void* in, void* out,
                   CheckFn&& check) {
    GroupState& s = *state_;
    const absl::Time deadline = absl::Now() + s.timeout;
    absl::MutexLock lock(&s.mu);
    if (!s.broken.ok()) return BrokenStatus(s);
    CANZONA_RETURN_IF_ERROR(check());
    auto injected = s.injected.find({rank_, call.op});
    if (injected != s.injected.end()) {
      absl::Status status = std::move(injected->second);
      s.injected.erase(injected);
      s.observed_break[rank_] = true;
      s.Break(absl::UnavailableError(absl::StrCat(
          "rank ", rank_, " failed in ", call.op, ": ", status.ToString())));
      return status;
    }
    // Wait for the previous round to empty (a fast rank may get here
    // while slow ones are still copying out their results).
    while (s.round != my_round_ && s.broken.ok()) {
      if (s.cv.WaitWithDeadline(&s.mu, deadline)) return TimedOut(s, call);
    }
    if (!s.broken.ok()) return BrokenStatus(s);

    // Phase 1: arrive.
    s.entries[rank_] = Entry{call, in, out};
    if (++s.arrived == s.size) {
      s.verdict = CheckAgreement(s.entries);
      if (!s.verdict.ok()) s.Break(s.verdict);
      s.cv.SignalAll();
    }
    while (s.arrived < s.size && s.broken.ok()) {
      if (s.cv.WaitWithDeadline(&s.mu, deadline)) return TimedOut(s, call);
    }
    if (s.arrived < s.size) return BrokenStatus(s);  // broke while waiting
    if (!s.verdict.ok()) {
      s.observed_break[rank_] = true;
      return s.verdict;
    }

    // Phase 2: read everyone's inputs, then write once all have read.
    std::vector<char> result = Compute(s.entries, rank_);
    if (++s.computed == s.size) s.cv.SignalAll();
    while (s.computed < s.size) {
      // All ranks are inside this round, so this wait is short; the
      // deadline only guards against a bug here.
      if (s.cv.WaitWithDeadline(&s.mu, deadline)) return TimedOut(s, call);
    }
    if (!result.empty()) {
      std::memcpy(out, result.data(), result.size());
    }
    ++my_round_;
    if (++s.left == s.size) {
      ++s.round;
      s.arrived = s.computed = s.left = 0;
      s.cv.SignalAll();
    }
    return absl::OkStatus();
  }

  absl::Status TimedOut(GroupState& s, const FakeCommCall& call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    absl::Status status = absl::DeadlineExceededError(
        absl::StrCat("timed out after ", absl::FormatDuration(s.timeout),
                     " waiting for the other ranks to call ", call.op));
    s.observed_break[rank_] = true;
    s.Break(status);
    return status;
  }

  const std::shared_ptr<GroupState> state_;
  const int rank_;
  int64_t my_round_ = 0;  // rounds this rank completed
};

}  // namespace

FakeCommunicatorGroup::FakeCommunicatorGroup(int size, absl::Duration timeout)
    : state_(std::make_shared<GroupState>(size, timeout)) {
  for (int r = 0; r < size; ++r) {
    comms_.push_back(std::make_unique<FakeCommunicator>(state_, r));
  }
}

FakeCommunicatorGroup::~FakeCommunicatorGroup() = default;

int FakeCommunicatorGroup::size() const { return state_->size; }

Communicator* FakeCommunicatorGroup::communicator(int rank) {
  return comms_[rank].get();
}

std::unique_ptr<Communicator> FakeCommunicatorGroup::TakeCommunicator(
    int rank) {
  return std::move(comms_[rank]);
}

void FakeCommunicatorGroup::InjectFailure(int rank, const std::string& op,
                                          absl::Status status) {
  absl::MutexLock lock(&state_->mu);
  state_->injected[{rank, op}] = std::move(status);
}

std::vector<FakeCommCall> FakeCommunicatorGroup::calls(int rank) const {
  absl::MutexLock lock(&state_->mu);
  return state_->calls[rank];
}

}  // namespace canzona
