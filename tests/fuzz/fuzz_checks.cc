#include "tests/fuzz/fuzz_checks.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"

namespace canzona::fuzz {
namespace {

// Calls per (call, code) over the run: how deep the inputs get (how many
// register and step OK), next to libFuzzer's coverage numbers.
constexpr int kCalls = 6;
constexpr int kCodes = 17;
std::atomic<int64_t> call_stats[kCalls][kCodes];

// Triage of a crash input: run the fuzzer on that one file with
// CANZONA_FUZZ_DUMP=1.
bool dump_requests = false;

}  // namespace

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "request_fuzzer: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

const char* CallName(Call call) {
  switch (call) {
    case Call::kRegister:
      return "Register";
    case Call::kStep:
      return "Step";
    case Call::kGetPlan:
      return "GetPlan";
    case Call::kDeregister:
      return "Deregister";
    case Call::kGradReady:
      return "GradReady";
    case Call::kWaitParams:
      return "WaitParams";
  }
  return "?";
}

// The codes a client may get from each call (engine.h; server/README.md,
// "canzonad"; the proto's comments): bad input, auth, limits, missing shm
// objects, disagreement with the job, peers that never come
// (DEADLINE_EXCEEDED), jobs failed by another rank (ABORTED), shutdown
// (UNAVAILABLE). INTERNAL or UNKNOWN means the daemon broke its own invariants
// on client input: a bug.
bool ExpectedCode(Call call, Code code) {
  switch (call) {
    case Call::kRegister:
      switch (code) {
        case Code::kOk:
        case Code::kInvalidArgument:
        case Code::kUnauthenticated:
        case Code::kResourceExhausted:
        case Code::kNotFound:
        case Code::kPermissionDenied:
        case Code::kFailedPrecondition:
        case Code::kAlreadyExists:
        case Code::kDeadlineExceeded:
        case Code::kAborted:
        case Code::kUnavailable:
          return true;
        default:
          return false;
      }
    case Call::kStep:
      switch (code) {
        case Code::kOk:
        case Code::kInvalidArgument:
        case Code::kNotFound:
        case Code::kFailedPrecondition:
        case Code::kDeadlineExceeded:
        case Code::kAborted:
        case Code::kUnavailable:
          return true;
        default:
          return false;
      }
    case Call::kGetPlan:
      return code == Code::kOk || code == Code::kNotFound ||
             code == Code::kFailedPrecondition;
    case Call::kDeregister:
      return code == Code::kOk || code == Code::kNotFound ||
             code == Code::kUnauthenticated || code == Code::kUnavailable;
    case Call::kGradReady:
      return code == Code::kOk || code == Code::kInvalidArgument ||
             code == Code::kNotFound || code == Code::kFailedPrecondition ||
             code == Code::kUnavailable;
    case Call::kWaitParams:
      // Besides bad input: the step's job failed (ABORTED), its
      // collectives timed out or the daemon went away.
      return code == Code::kOk || code == Code::kInvalidArgument ||
             code == Code::kNotFound || code == Code::kFailedPrecondition ||
             code == Code::kAborted || code == Code::kDeadlineExceeded ||
             code == Code::kUnavailable;
  }
  return false;
}

void SetDumpRequests(bool on) { dump_requests = on; }

void Dump(const google::protobuf::Message& m) {
  if (dump_requests) {
    std::fprintf(stderr, "request_fuzzer: %s %s\n",
                 m.GetDescriptor()->name().c_str(),
                 m.ShortDebugString().c_str());
  }
}

void PrintStats() {
  for (int c = 0; c < kCalls; ++c) {
    std::string line;
    for (int k = 0; k < kCodes; ++k) {
      const int64_t n = call_stats[c][k].load();
      if (n == 0) continue;
      absl::StrAppend(&line, " ",
                      absl::StatusCodeToString(static_cast<Code>(k)), "=", n);
    }
    std::fprintf(stderr, "request_fuzzer: %-10s%s\n",
                 CallName(static_cast<Call>(c)), line.c_str());
  }
}

void CheckStatus(Call call, const absl::Status& status) {
  if (!ExpectedCode(call, status.code())) {
    Die(absl::StrCat(CallName(call),
                     " returned an unexpected code: ", status.ToString()));
  }
  const int code = static_cast<int>(status.code());
  if (code >= 0 && code < kCodes) {
    call_stats[static_cast<int>(call)][code].fetch_add(1);
  }
}

bool Deliverable(const google::protobuf::Message& m) {
  std::string bytes;
  if (!m.SerializeToString(&bytes)) return false;
  std::unique_ptr<google::protobuf::Message> copy(m.New());
  return copy->ParseFromString(bytes);
}

void Tracker::WaitAll() {
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithTimeout(absl::Condition(this, &Tracker::AllCalled),
                            kCallbackLimit)) {
    Die(absl::StrCat("a callback was not called within ",
                     absl::FormatDuration(kCallbackLimit)));
  }
}

void Tracker::CheckAllCalledOnce() {
  absl::MutexLock lock(&mu_);
  for (const auto& slot : slots_) {
    if (slot->calls != 1) {
      Die(absl::StrCat(CallName(slot->call), " callback called ", slot->calls,
                       " times by the end of the input"));
    }
  }
}

bool Tracker::AllCalled() const {
  for (const auto& slot : slots_) {
    if (slot->calls == 0) return false;
  }
  return true;
}

void Tracker::CheckResponse(const v1::RegisterResponse& r) {
  if (r.plan_digest().empty()) Die("Register OK without a plan digest");
  if (r.owned_parameters() < 0 || r.state_bytes() < 0) {
    Die("Register OK with negative counts");
  }
}

void Tracker::CheckResponse(const v1::StepResponse& r) {
  if (!(r.seconds().total() >= 0)) Die("Step OK with a negative total time");
  if (!(r.seconds().dp_comm() >= 0 && r.seconds().dp_comm_exposed() >= 0)) {
    Die("Step OK with a negative DP communication time");
  }
}

void Tracker::CheckResponse(const v1::GradReadyResponse&) {}

void Tracker::CheckResponse(const v1::WaitParamsResponse& r) {
  if (!(r.waited_seconds() >= 0)) Die("WaitParams OK with a negative wait");
}

}  // namespace canzona::fuzz
