// What every call the request fuzzer makes is held to: the status codes a
// client may see from that call, each callback run exactly once, no hang,
// and responses that make sense. Anything else is a finding: Die() aborts
// the process, so that libFuzzer saves the input.
//
// Thread-safety: CheckStatus and the Tracker's callbacks run on the engine's
// worker threads (the counters are atomic, the Tracker is synchronized);
// SetDumpRequests is called once, before the first input.
#ifndef CANZONA_TESTS_FUZZ_FUZZ_CHECKS_H_
#define CANZONA_TESTS_FUZZ_FUZZ_CHECKS_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/engine.h"

namespace canzona::fuzz {

using Code = absl::StatusCode;

// A callback that has not run after this long is a hang.
inline constexpr absl::Duration kCallbackLimit = absl::Seconds(60);

[[noreturn]] void Die(const std::string& what);

enum class Call {
  kRegister,
  kStep,
  kGetPlan,
  kDeregister,
  kGradReady,
  kWaitParams
};

const char* CallName(Call call);

// Whether a client may see `code` from `call`.
bool ExpectedCode(Call call, Code code);

// Dies on a code ExpectedCode refuses; counts the call for PrintStats.
void CheckStatus(Call call, const absl::Status& status);

// The calls per (call, code) so far, to stderr (CANZONA_FUZZ_STATS=1, at
// exit).
void PrintStats();

// CANZONA_FUZZ_DUMP=1: Dump() writes every Register request to stderr.
void SetDumpRequests(bool on);
void Dump(const google::protobuf::Message& m);

// What the daemon can receive: gRPC parses requests with protobuf, whose
// proto3 parser rejects string fields that are not valid UTF-8 before the
// engine sees them. Structured inputs build messages directly, so they are
// passed through the same parse and dropped when it fails.
bool Deliverable(const google::protobuf::Message& m);

// Counts the calls of every callback handed to the engine.
class Tracker {
 public:
  struct Slot {
    Call call = Call::kRegister;
    int calls = 0;
    Code code = Code::kUnknown;
  };

  // A callback that records its call in the returned slot (read it after
  // WaitAll) and aborts on a second call or an unexpected code.
  template <typename T>
  std::pair<Callback<T>, std::shared_ptr<const Slot>> Track(Call call) {
    auto slot = std::make_shared<Slot>();
    slot->call = call;
    {
      absl::MutexLock lock(&mu_);
      slots_.push_back(slot);
    }
    Callback<T> callback = [this, slot](absl::StatusOr<T> result) {
      CheckStatus(slot->call, result.status());
      if (result.ok()) CheckResponse(*result);
      absl::MutexLock lock(&mu_);
      if (++slot->calls > 1) {
        Die(absl::StrCat(CallName(slot->call), " callback called ", slot->calls,
                         " times"));
      }
      slot->code = result.status().code();
    };
    return {std::move(callback), slot};
  }

  // Waits until every tracked callback has run; a hang aborts.
  void WaitAll();

  // After the engine is gone: every callback ran exactly once.
  void CheckAllCalledOnce();

 private:
  bool AllCalled() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Responses that make sense (no plan without a digest, no negative time).
  static void CheckResponse(const v1::RegisterResponse& r);
  static void CheckResponse(const v1::StepResponse& r);
  static void CheckResponse(const v1::GradReadyResponse& r);
  static void CheckResponse(const v1::WaitParamsResponse& r);

  absl::Mutex mu_;
  std::vector<std::shared_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona::fuzz

#endif  // CANZONA_TESTS_FUZZ_FUZZ_CHECKS_H_
