// libFuzzer target over the optimizer service's request decoding and
// validation, run against a real Engine (CreateEngine over an
// InMemoryKvStore, POSIX shm buffers, the cpu backend, Gloo for multi-rank
// jobs) with tiny register / step timeouts and small limits.
//
// Input layout (tests/fuzz/fuzz_requests.h): one selector byte, then either a
// binary canzona.v1 message parsed with ParseFromArray (Register, Step,
// GetPlan, Deregister, GetStatus) or, for the structured kind, bytes that a
// FuzzedDataProvider turns into whole jobs (layouts, groups and settings,
// parameters, buffer references into real shm objects, then steps, plans,
// status and deregistrations), so validation deeper than proto parsing and
// the registered paths (planning, setup, the step) are reached.
//
// Every call is checked: each callback runs exactly once (the engine is shut
// down and destroyed at the end of every input, so calls still pending must
// have finished by then), and every status code is one a client may see for
// that call; anything else aborts. Sanitizer reports abort too.
//
//   canzona_request_fuzzer -runs=20000 corpus/ seeds/
//
// Requests that reach known engine bugs (KnownEngineBug(), StepWouldSpin(),
// each naming its bug) can be skipped with CANZONA_FUZZ_KNOWN_BUGS=0; the
// bugs listed are fixed, so by default nothing is skipped and the repro
// inputs (make_seeds --repros) check the fixes. CANZONA_FUZZ_STATS=1 prints the
// calls per status code at exit, CANZONA_FUZZ_DUMP=1 every Register request.
//
// The pieces: fuzz_checks.h (what every call is held to), fuzz_fixture.h
// (the shm objects inputs point at), fuzz_daemon.h (one engine per input),
// structured_input.h (the structured kind), known_bugs.h; this file runs the
// raw kinds.
//
// Thread-safety: libFuzzer calls LLVMFuzzerTestOneInput from one thread;
// engine callbacks run on the engine's worker threads and only touch the
// Tracker (synchronized).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "canzona/v1/optimizer_service.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/engine/engine.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_checks.h"
#include "tests/fuzz/fuzz_daemon.h"
#include "tests/fuzz/fuzz_fixture.h"
#include "tests/fuzz/fuzz_requests.h"
#include "tests/fuzz/known_bugs.h"
#include "tests/fuzz/structured_input.h"

namespace canzona::fuzz {
namespace {

// The raw kinds: the payload is one message.
void RunRaw(InputKind kind, const uint8_t* data, size_t size) {
  Tracker tracker;
  {
    Daemon daemon;
    Engine& engine = daemon.engine();
    const int n = static_cast<int>(size);
    if (kind == InputKind::kRegister) {
      v1::RegisterRequest request;
      if (!request.ParseFromArray(data, n)) return;
      Rewrite(&request);
      if (KnownEngineBug(request)) return;
      if (RegisterAndWait(tracker, engine, request) == Code::kOk) {
        // A registered job: its plan, status and a step (DP1 x TP1 jobs
        // are the only ones one Register completes).
        v1::GetPlanRequest plan;
        plan.set_job_id(request.job_id());
        GetPlanChecked(engine, plan);
        if (!StepWouldSpin(request)) {
          v1::StepRequest step;
          step.set_job_id(request.job_id());
          *step.mutable_rank() = request.rank();
          step.set_step(1);
          auto [callback, slot] = tracker.Track<v1::StepResponse>(Call::kStep);
          engine.Step(step, std::move(callback));
          tracker.WaitAll();
        }
        GetStatusChecked(engine);
      }
    } else {
      // Step, GetPlan, Deregister and GetStatus meet the fixture job.
      const v1::RegisterRequest fixture_job =
          FixtureRegister(ProcessFixture().job_id);
      if (RegisterAndWait(tracker, engine, fixture_job) != Code::kOk) {
        Die("the fixture job did not register");
      }
      switch (kind) {
        case InputKind::kStep: {
          v1::StepRequest request;
          if (!request.ParseFromArray(data, n)) return;
          Rewrite(request.mutable_job_id());
          auto [callback, slot] = tracker.Track<v1::StepResponse>(Call::kStep);
          engine.Step(request, std::move(callback));
          tracker.WaitAll();
          break;
        }
        case InputKind::kGetPlan: {
          v1::GetPlanRequest request;
          if (!request.ParseFromArray(data, n)) return;
          Rewrite(request.mutable_job_id());
          GetPlanChecked(engine, request);
          break;
        }
        case InputKind::kDeregister: {
          v1::DeregisterRequest request;
          if (!request.ParseFromArray(data, n)) return;
          Rewrite(request.mutable_job_id());
          if (KnownEngineBug(request, fixture_job.layout())) return;
          DeregisterChecked(engine, request);
          break;
        }
        case InputKind::kGetStatus: {
          v1::GetStatusRequest request;
          if (!request.ParseFromArray(data, n)) return;
          GetStatusChecked(engine);
          break;
        }
        default:
          break;
      }
    }
  }  // the daemon shuts down: pending calls finish with UNAVAILABLE
  tracker.CheckAllCalledOnce();
}

bool EnvIs(const char* name, const char* value) {
  const char* set = std::getenv(name);
  return set != nullptr && std::string(set) == value;
}

}  // namespace
}  // namespace canzona::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  using namespace canzona;
  using namespace canzona::fuzz;
  // Rejections log a line each; millions of them would only slow the run.
  spdlog::set_level(spdlog::level::off);
  SetCpuBlasThreads(1);
  CreateFixture();
  if (EnvIs("CANZONA_FUZZ_STATS", "1")) std::atexit(PrintStats);
  SetSkipKnownBugs(EnvIs("CANZONA_FUZZ_KNOWN_BUGS", "0"));
  SetDumpRequests(EnvIs("CANZONA_FUZZ_DUMP", "1"));
  // Invalid UTF-8 in string fields is logged by protobuf on every such
  // input: noise, the parse result is what the fuzzer checks.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace canzona::fuzz;
  if (size < 1) return 0;
  ProcessFixture().Reset();
  const auto kind = static_cast<InputKind>(data[0] % kInputKinds);
  if (kind == InputKind::kStructured) {
    RunStructured(data + 1, size - 1);
  } else {
    RunRaw(kind, data + 1, size - 1);
  }
  return 0;
}
