// What the request fuzzer (request_fuzzer.cc) and its seed generator
// (make_seeds.cc) agree on: the layout of a fuzz input and the requests of
// the fixture job.
//
// A fuzz input is one selector byte followed by a payload:
//   selector % kInputKinds picks the InputKind; for the raw kinds the
//   payload is a binary canzona.v1 message (ParseFromArray), for
//   kStructured it feeds a FuzzedDataProvider that builds whole jobs.
//
// Seeds and raw inputs name the fixture job "fz" and its buffers
// "/canzona.fz.<rank>.0"; the fuzzer rewrites that placeholder to a
// per-process id (POSIX shm names are machine-global, and two fuzzers may
// run at once), so a seed that registers a valid job stays valid.
//
// Thread-safety: plain functions and constants.
#ifndef CANZONA_TESTS_FUZZ_FUZZ_REQUESTS_H_
#define CANZONA_TESTS_FUZZ_FUZZ_REQUESTS_H_

#include <cstdint>
#include <string>

#include "canzona/v1/optimizer_service.pb.h"

namespace canzona::fuzz {

enum class InputKind : uint8_t {
  kRegister = 0,    // RegisterRequest
  kStep = 1,        // StepRequest against the registered fixture job
  kGetPlan = 2,     // GetPlanRequest against the fixture job
  kDeregister = 3,  // DeregisterRequest against the fixture job
  kGetStatus = 4,   // GetStatusRequest (no fields), fixture job present
  kStructured = 5,  // FuzzedDataProvider: whole jobs, steps, queries
};
inline constexpr int kInputKinds = 6;

// The fixture job's placeholder id and the token every daemon requires.
inline constexpr char kPlaceholderJob[] = "fz";
inline constexpr char kToken[] = "fuzz-token";
// Each rank r of the fixture owns one shm object "/canzona.<job>.<r>.0" of
// kShmBytes; at most kMaxRanks ranks.
inline constexpr int kMaxRanks = 4;
inline constexpr uint64_t kShmBytes = 64 * 1024;

// A valid DP1 x TP1 registration of `job_id` (Muon matrix + AdamW vector)
// whose buffers lie in "/canzona.<job_id>.0.0".
canzona::v1::RegisterRequest FixtureRegister(const std::string& job_id);

// Selector byte + the message's binary encoding.
std::string Encode(InputKind kind, const google::protobuf::Message& message);

}  // namespace canzona::fuzz

#endif  // CANZONA_TESTS_FUZZ_FUZZ_REQUESTS_H_
