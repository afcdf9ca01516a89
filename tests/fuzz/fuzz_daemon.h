// One daemon per fuzz input (a fresh control plane and engine with short
// waits and small limits), and the checked calls the raw and structured
// inputs make on it.
//
// Thread-safety: a Daemon and its calls belong to libFuzzer's thread; the
// engine runs callbacks on its own workers (tests/fuzz/fuzz_checks.h).
#ifndef CANZONA_TESTS_FUZZ_FUZZ_DAEMON_H_
#define CANZONA_TESTS_FUZZ_FUZZ_DAEMON_H_

#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/control/kv_store.h"
#include "server/engine/engine.h"
#include "tests/fuzz/fuzz_checks.h"
#include "tests/fuzz/fuzz_requests.h"

namespace canzona::fuzz {

// The engine's waits are short, so that an input that registers only part
// of a job (and times out) stays cheap.
inline constexpr absl::Duration kRegisterTimeout = absl::Milliseconds(100);
inline constexpr absl::Duration kStepTimeout = absl::Milliseconds(250);
// Small limits, so that inputs reach the RESOURCE_EXHAUSTED paths.
inline constexpr int kMaxJobs = 2;
inline constexpr int kMaxParameters = 16;
inline constexpr int64_t kMaxBytesPerJob = 3 * kShmBytes;

// Shut down and destroyed at the end of the input: every pending call must
// then have finished.
class Daemon {
 public:
  Daemon();
  ~Daemon();
  Engine& engine() { return *engine_; }

 private:
  InMemoryKvStore kv_;  // outlives the engine
  std::unique_ptr<Engine> engine_;
};

// Registers `request` and waits; returns the code.
Code RegisterAndWait(Tracker& tracker, Engine& engine,
                     const v1::RegisterRequest& request,
                     const PeerInfo& peer = {});

void GetPlanChecked(Engine& engine, const v1::GetPlanRequest& request);
void GetStatusChecked(Engine& engine);
void DeregisterChecked(Engine& engine, const v1::DeregisterRequest& request);

}  // namespace canzona::fuzz

#endif  // CANZONA_TESTS_FUZZ_FUZZ_DAEMON_H_
