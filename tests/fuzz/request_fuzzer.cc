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
// Thread-safety: libFuzzer calls LLVMFuzzerTestOneInput from one thread;
// engine callbacks run on the engine's worker threads and only touch the
// Tracker (synchronized).
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/shared_memory/shared_memory.h"
#include "server/control/kv_store.h"
#include "server/engine/engine.h"
#include "server/engine/engine_impl.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_requests.h"

namespace canzona::fuzz {
namespace {

namespace v1 = ::canzona::v1;
using Code = absl::StatusCode;

// Bounds of one input: the engine's waits are short so that an input that
// registers only part of a job (and times out) stays cheap; a callback that
// has not run after kCallbackLimit is a hang.
constexpr absl::Duration kRegisterTimeout = absl::Milliseconds(100);
constexpr absl::Duration kStepTimeout = absl::Milliseconds(250);
constexpr absl::Duration kCallbackLimit = absl::Seconds(60);
// Small limits, so that inputs reach the RESOURCE_EXHAUSTED paths.
constexpr int kMaxJobs = 2;
constexpr int kMaxParameters = 16;
constexpr int64_t kMaxBytesPerJob = 3 * kShmBytes;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "request_fuzzer: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

enum class Call {
  kRegister,
  kStep,
  kGetPlan,
  kDeregister,
  kGradReady,
  kWaitParams
};

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
// objects, disagreement with the job, peers that never come (DEADLINE_EXCEEDED), jobs failed
// by another rank (ABORTED), shutdown (UNAVAILABLE). INTERNAL or UNKNOWN
// means the daemon broke its own invariants on client input: a bug.
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

// Calls per (call, code) over the run, printed at exit when
// CANZONA_FUZZ_STATS=1: shows how deep the inputs get (how many register
// and step OK) next to libFuzzer's coverage numbers.
constexpr int kCalls = 6;
constexpr int kCodes = 17;
std::atomic<int64_t> call_stats[kCalls][kCodes];

// CANZONA_FUZZ_DUMP=1: every Register request to stderr (triage of a
// crash input: run the fuzzer on that one file).
bool dump_requests = false;

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
  void WaitAll() {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(this, &Tracker::AllCalled),
                              kCallbackLimit)) {
      Die(absl::StrCat("a callback was not called within ",
                       absl::FormatDuration(kCallbackLimit)));
    }
  }

  // After the engine is gone: every callback ran exactly once.
  void CheckAllCalledOnce() {
    absl::MutexLock lock(&mu_);
    for (const auto& slot : slots_) {
      if (slot->calls != 1) {
        Die(absl::StrCat(CallName(slot->call), " callback called ", slot->calls,
                         " times by the end of the input"));
      }
    }
  }

 private:
  bool AllCalled() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (const auto& slot : slots_) {
      if (slot->calls == 0) return false;
    }
    return true;
  }
  static void CheckResponse(const v1::RegisterResponse& r) {
    if (r.plan_digest().empty()) Die("Register OK without a plan digest");
    if (r.owned_parameters() < 0 || r.state_bytes() < 0) {
      Die("Register OK with negative counts");
    }
  }
  static void CheckResponse(const v1::StepResponse& r) {
    if (!(r.seconds().total() >= 0)) Die("Step OK with a negative total time");
    if (!(r.seconds().dp_comm() >= 0 && r.seconds().dp_comm_exposed() >= 0)) {
      Die("Step OK with a negative DP communication time");
    }
  }
  static void CheckResponse(const v1::GradReadyResponse&) {}
  static void CheckResponse(const v1::WaitParamsResponse& r) {
    if (!(r.waited_seconds() >= 0)) Die("WaitParams OK with a negative wait");
  }

  absl::Mutex mu_;
  std::vector<std::shared_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
};

// The shm objects of the fixture job's ranks, created once per process and
// zeroed before every input (inputs must not depend on earlier ones).
struct Fixture {
  std::string job_id;
  std::vector<SharedMemory> shm;
  // A child that exited at startup: a trainer that is gone.
  pid_t exited_pid = 0;

  void Reset() {
    for (SharedMemory& s : shm) std::memset(s.data(), 0, s.size());
  }
};

Fixture* fixture = nullptr;

void DestroyFixture() {
  delete fixture;  // unlinks the shm objects
  fixture = nullptr;
}

// A finding kills the process without running atexit handlers, which
// would leave the fixture's shm objects in /dev/shm. A forked janitor waits
// for this process to go (its end of a pipe reads EOF) and unlinks them.
void StartShmJanitor(const std::vector<std::string>& names) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) Die("pipe2");
  const pid_t janitor = ::fork();
  if (janitor < 0) Die("fork");
  if (janitor == 0) {
    ::close(fds[1]);
    char byte;
    while (true) {
      const ssize_t n = ::read(fds[0], &byte, 1);
      if (n == 0 || (n < 0 && errno != EINTR)) break;
    }
    for (const std::string& name : names) ::shm_unlink(name.c_str());
    ::_exit(0);
  }
  ::close(fds[0]);  // fds[1] stays open until this process is gone
}

// Rewrites the seeds' placeholder job "fz" and buffers "/canzona.fz.*" to
// this process's fixture.
void Rewrite(std::string* s) {
  if (*s == kPlaceholderJob) {
    *s = fixture->job_id;
    return;
  }
  const std::string prefix = absl::StrCat("/canzona.", kPlaceholderJob, ".");
  if (s->rfind(prefix, 0) == 0) {
    *s = absl::StrCat("/canzona.", fixture->job_id, ".",
                      s->substr(prefix.size()));
  }
}

void Rewrite(v1::RegisterRequest* r) {
  Rewrite(r->mutable_job_id());
  for (v1::Parameter& p : *r->mutable_parameters()) {
    for (v1::BufferRef* ref : {p.mutable_param(), p.mutable_grad()}) {
      if (ref->has_shm()) Rewrite(ref->mutable_shm()->mutable_name());
    }
  }
}

// What the daemon can receive: gRPC parses requests with protobuf, whose
// proto3 parser rejects string fields that are not valid UTF-8 before the
// engine sees them. Structured inputs build messages directly, so they are
// passed through the same parse and dropped when it fails.
bool Deliverable(const google::protobuf::Message& m) {
  std::string bytes;
  if (!m.SerializeToString(&bytes)) return false;
  std::unique_ptr<google::protobuf::Message> copy(m.New());
  return copy->ParseFromString(bytes);
}

// ---------------------------------------------------------------------------
// Known engine bugs (server/engine/engine_impl.cc, server/optim): inputs
// that reach a reported, unfixed bug are skipped so that the fuzzer keeps
// looking for new problems. Every bug listed below is fixed now (layout and
// shape bounds, group names, Deregister coordinates, ns_steps <= 100), so
// skipping is off and the fuzzer checks the fixes; CANZONA_FUZZ_KNOWN_BUGS=0
// turns it back on while a new bug awaits its fix.
bool skip_known_bugs = false;

bool MulOverflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

bool KnownEngineBug(const v1::RegisterRequest& r) {
  if (!skip_known_bugs) return false;
  // Prepare() multiplies layout.pp * dp * tp in int: signed overflow.
  const v1::WorldLayout& l = r.layout();
  if (l.pp() >= 1 && l.dp() >= 1 && l.tp() >= 1) {
    int64_t world = 0;
    if (MulOverflows(int64_t{l.pp()} * l.dp(), l.tp(), &world) ||
        world > INT_MAX) {
      return true;
    }
  }
  // Prepare() rejects '|' and newlines in parameter names but not in group
  // names, which the canonical parameter lines ("name|shape|split|group",
  // one per line) carry too: EnsurePlan() then parses a cut group name and
  // job.configs.at() throws std::out_of_range on the worker thread
  // (std::terminate: the daemon dies).
  for (const v1::OptimizerGroup& g : r.groups()) {
    if (g.name().find_first_of("|\n") != std::string::npos) return true;
  }
  for (const v1::Parameter& p : r.parameters()) {
    if (p.group().find_first_of("|\n") != std::string::npos) return true;
  }
  // Prepare() takes NumElements() of the shape unchecked (signed overflow
  // for large dimensions; past 2^62 elements the byte count wraps and a
  // zero-byte buffer passes the size check).
  for (const v1::Parameter& p : r.parameters()) {
    int64_t numel = 1;
    for (int64_t d : p.shape()) {
      if (d < 1) break;  // rejected before the product is taken
      if (MulOverflows(numel, d, &numel) ||
          numel > std::numeric_limits<int64_t>::max() / 4) {
        return true;
      }
    }
  }
  return false;
}

// Muon's ns_steps has no upper bound (server/optim/optimizer_config.cc):
// each step builds a table of ns_steps coefficient triples
// (NewtonSchulzSpecFor, server/optim/update_rule.cc), so a huge value
// exhausts memory or throws std::length_error on the worker (terminate),
// and a merely large one spins. Steps of such jobs are not issued
// (registration still is).
bool StepWouldSpin(const v1::RegisterRequest& r) {
  if (!skip_known_bugs) return false;
  for (const v1::OptimizerGroup& g : r.groups()) {
    for (const v1::Setting& s : g.settings()) {
      if (s.key() != "ns_steps") continue;
      char* end = nullptr;
      const double v = std::strtod(s.value().c_str(), &end);
      if (!(v <= 64)) return true;
    }
  }
  return false;
}

// Deregister() computes the global rank from the request's coordinates
// before checking them against the layout: signed overflow.
bool KnownEngineBug(const v1::DeregisterRequest& r,
                    const v1::WorldLayout& layout) {
  if (!skip_known_bugs) return false;
  auto fits = [](int64_t v) { return v >= INT_MIN && v <= INT_MAX; };
  const v1::RankCoordinates& c = r.rank();
  const int64_t a = int64_t{c.pp_rank()} * layout.dp();
  const int64_t b = a + c.dp_rank();
  const int64_t d = b * layout.tp();  // |b| < 2^32, |tp| < 2^31: no overflow
  return !fits(a) || !fits(b) || !fits(d) || !fits(d + c.tp_rank());
}

// ---------------------------------------------------------------------------

// One daemon per input: a fresh control plane and engine, shut down and
// destroyed at the end (every pending call must then have finished).
class Daemon {
 public:
  Daemon() {
    EngineOptions options;
    options.control = &kv_;
    options.daemon_id = "fuzz";
    options.register_timeout = kRegisterTimeout;
    options.step_timeout = kStepTimeout;
    options.required_token = kToken;
    options.max_jobs = kMaxJobs;
    options.max_parameters_per_job = kMaxParameters;
    options.max_bytes_per_job = kMaxBytesPerJob;
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        CreateEngine(std::move(options));
    if (!engine.ok()) Die(engine.status().ToString());
    engine_ = *std::move(engine);
  }
  ~Daemon() {
    engine_->Shutdown();
    engine_.reset();
  }
  Engine& engine() { return *engine_; }

 private:
  InMemoryKvStore kv_;  // outlives the engine
  std::unique_ptr<Engine> engine_;
};

// Registers `request` and waits; returns the code.
Code RegisterAndWait(Tracker& tracker, Engine& engine,
                     const v1::RegisterRequest& request,
                     const PeerInfo& peer = {}) {
  auto [callback, slot] = tracker.Track<v1::RegisterResponse>(Call::kRegister);
  Dump(request);
  engine.Register(request, peer, std::move(callback));
  tracker.WaitAll();
  return slot->code;
}

void GetPlanChecked(Engine& engine, const v1::GetPlanRequest& request) {
  absl::StatusOr<v1::GetPlanResponse> plan = engine.GetPlan(request);
  CheckStatus(Call::kGetPlan, plan.status());
  if (plan.ok() && (plan->digest().empty() || plan->plan_json().empty())) {
    Die("GetPlan OK without a plan");
  }
}

void GetStatusChecked(Engine& engine) {
  v1::GetStatusResponse status = engine.GetStatus();
  for (const v1::JobStatus& job : status.jobs()) {
    if (job.job_id().empty()) Die("GetStatus: a job without an id");
  }
}

void DeregisterChecked(Engine& engine, const v1::DeregisterRequest& request) {
  CheckStatus(Call::kDeregister, engine.Deregister(request));
}

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
      const v1::RegisterRequest fixture_job = FixtureRegister(fixture->job_id);
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

// ---------------------------------------------------------------------------
// The structured kind. Every choice has a valid default, taken when the
// provider's bytes run out (it then returns the smallest value, so choice 0
// is always the default) and most of the time otherwise; mutations (a wrong
// value, arbitrary bytes) come with probability about 1/16 per choice. An
// empty payload is a valid DP1 x TP1 job that registers and steps.

class Structured {
 public:
  Structured(const uint8_t* data, size_t size) : fdp_(data, size) {}

  void Run() {
    Tracker tracker;
    {
      Daemon daemon;
      Run(tracker, daemon.engine());
    }
    tracker.CheckAllCalledOnce();
  }

 private:
  // True about once in 16 choices (never once the bytes are used up).
  bool Mutate() { return fdp_.ConsumeIntegralInRange<int>(0, 15) == 15; }
  // `valid` unless mutated; then one of `others` or arbitrary bytes.
  std::string Text(const std::string& valid,
                   std::initializer_list<const char* const> others) {
    if (!Mutate()) return valid;
    if (fdp_.ConsumeBool()) return fdp_.ConsumeRandomLengthString(24);
    return fdp_.PickValueInArray<const char*>(others);
  }
  // One of `choices`; the first when the bytes are used up.
  template <typename T>
  T Pick(std::initializer_list<const T> choices) {
    return fdp_.PickValueInArray<T>(choices);
  }
  // A count in [0, max] whose default (bytes used up) is `dflt`.
  int Count(int dflt, int max) {
    return (fdp_.ConsumeIntegralInRange<int>(0, max) + dflt) % (max + 1);
  }
  double Number(double valid) {
    if (!Mutate()) return valid;
    return Pick<double>({0.0, 0.5, 1.0, 1e-3, -1.0, 1e30,
                         std::numeric_limits<double>::quiet_NaN(),
                         std::numeric_limits<double>::infinity()});
  }

  void BuildGroups(v1::RegisterRequest* r) {
    static constexpr const char* kKinds[] = {"muon", "adamw", "shampoo",
                                             "soap"};
    const int n = Count(2, 4);  // muon + adamw by default
    for (int i = 0; i < n; ++i) {
      v1::OptimizerGroup* g = r->add_groups();
      const char* kind = kKinds[i];
      g->set_name(Text(kind, {"", "g", "muon"}));
      g->set_optimizer(Text(kind, {"sgd", "", "MUON", "adamw"}));
      const int settings = Count(0, 3);
      for (int s = 0; s < settings; ++s) {
        v1::Setting* kv = g->add_settings();
        kv->set_key(Pick<const char*>({"lr",
                                       "weight_decay",
                                       "eps",
                                       "momentum",
                                       "nesterov",
                                       "ns_steps",
                                       "ns_coefficients",
                                       "scale",
                                       "ns_precision",
                                       "ns_algorithm",
                                       "beta1",
                                       "beta2",
                                       "epsilon",
                                       "max_preconditioner_dim",
                                       "precondition_frequency",
                                       "start_preconditioning_step",
                                       "grafting",
                                       "grafting_beta2",
                                       "grafting_epsilon",
                                       "shampoo_beta",
                                       "max_precond_dim",
                                       "normalize_grads",
                                       "correct_bias",
                                       "bogus",
                                       ""}));
        kv->set_value(Text(Pick<const char*>({"0.01",
                                              "0",
                                              "1",
                                              "2",
                                              "0.5",
                                              "0.999",
                                              "1e-3",
                                              "3",
                                              "true",
                                              "false",
                                              "simple",
                                              "quintic",
                                              "polar_express",
                                              "spectral",
                                              "match_rms_adamw",
                                              "fp32",
                                              "bf16",
                                              "auto",
                                              "standard",
                                              "gram",
                                              "adam",
                                              "adagrad",
                                              "none",
                                              "-1"}),
                           {"nan", "inf", "-0", "1e400", "",
                            "9223372036854775807", "1e-400", "0x10", " 1"}));
      }
    }
  }

  // The parameters (common to every rank); the buffers come per rank.
  void BuildParameters(v1::RegisterRequest* r) {
    int n = Count(3, 6);
    if (Mutate() && Mutate()) n = kMaxParameters + 1;
    for (int i = 0; i < n; ++i) {
      v1::Parameter* p = r->add_parameters();
      p->set_name(Text(absl::StrCat("p", i), {"", "a|b", "a\nb", "p0"}));
      // Matrices first (the default groups: muon, then adamw for vectors).
      const int dims = Pick<int>({2, 1, 2, 3, 0});
      for (int d = 0; d < dims; ++d) {
        p->add_shape(Mutate() ? fdp_.ConsumeIntegral<int64_t>()
                              : Pick<int64_t>({8, 4, 16, 2, 1, 3, 6, 0, -1}));
      }
      p->set_dtype(
          Mutate() ? Pick<v1::DType>({v1::DTYPE_BFLOAT16, v1::DTYPE_UNSPECIFIED,
                                      v1::DTYPE_FLOAT16})
                   : v1::DTYPE_FLOAT32);
      p->set_tp_split_dim(Pick<int>({-1, 0, 1, -1, 2, -2}));
      const std::string group =
          r->groups_size() == 0
              ? "muon"
              : r->groups(dims == 2 ? 0 : std::min(1, r->groups_size() - 1))
                    .name();
      p->set_group(Text(Mutate() && r->groups_size() > 0
                            ? r->groups(fdp_.ConsumeIntegralInRange<int>(
                                            0, r->groups_size() - 1))
                                  .name()
                            : group,
                        {"nope", ""}));
    }
  }

  // This rank's buffer references: packed into its own shm object, with
  // occasional wrong objects, offsets, sizes and kinds.
  void BuildBuffers(v1::RegisterRequest* r, int rank_index, int tp) {
    uint64_t cursor = 0;
    for (v1::Parameter& p : *r->mutable_parameters()) {
      uint64_t numel = 1;
      for (int d = 0; d < p.shape_size(); ++d) {
        int64_t dim = p.shape(d);
        if (d == p.tp_split_dim() && tp > 0 && dim > 0) dim /= tp;
        numel *= static_cast<uint64_t>(dim);
      }
      const uint64_t bytes = numel * sizeof(float);
      for (v1::BufferRef* ref : {p.mutable_param(), p.mutable_grad()}) {
        v1::ShmBufferRef* shm = ref->mutable_shm();
        shm->set_name(ShmName(fixture->job_id, rank_index, 0));
        shm->set_offset(cursor);
        shm->set_bytes(bytes);
        cursor += bytes;
        if (!Mutate()) continue;
        switch (fdp_.ConsumeIntegralInRange<int>(0, 8)) {
          case 0:
            ref->Clear();  // no buffer
            break;
          case 1:
            ref->mutable_cuda_ipc()->set_bytes(bytes);
            break;
          case 2:  // another rank's object (or this one's)
            shm->set_name(
                ShmName(fixture->job_id,
                        fdp_.ConsumeIntegralInRange<int>(0, kMaxRanks - 1), 0));
            break;
          case 3:
            shm->set_name(Pick<const char*>(
                {"/canzona.fz.0.1", "", "/canzona.other.0.0", "/canzona.fz.x.0",
                 "canzona.fz.0.0", "/canzona.fz.0"}));
            Rewrite(shm->mutable_name());
            break;
          case 4:
            shm->set_offset(fdp_.ConsumeIntegral<uint64_t>());
            break;
          case 5:
            shm->set_bytes(fdp_.ConsumeIntegral<uint64_t>());
            break;
          case 6:
            shm->set_offset(shm->offset() + 2);  // misaligned
            break;
          case 7:  // the same range as the previous buffer (aliasing)
            shm->set_offset(shm->offset() >= bytes ? shm->offset() - bytes : 0);
            break;
          case 8:  // well-formed, longer than NAME_MAX (ENAMETOOLONG)
            shm->set_name(absl::StrCat("/canzona.", fixture->job_id, ".0.",
                                       std::string(300, '0')));
            break;
        }
      }
    }
  }

  void Run(Tracker& tracker, Engine& engine) {
    v1::RegisterRequest base;
    base.set_job_id(Text(fixture->job_id, {"", "bad id", "x", "fz"}));
    base.set_job_token(Text(kToken, {"", "wrong"}));
    v1::WorldLayout* l = base.mutable_layout();
    l->set_pp(Mutate() ? Pick<int>({0, 2, -1, 1000, INT_MAX}) : 1);
    l->set_dp(Pick<int>({1, 2, 1, 2, 4, 3, 0, -1}));
    l->set_tp(Pick<int>({1, 2, 2, 1, 4, 3, 0, -1}));
    base.set_strategy(Text(Pick<const char*>({"", "cost", "alpha", "sc",
                                              "layerwise", "start_anchored"}),
                           {"best", "COST", " "}));
    base.set_alpha(Number(Pick<double>({0.0, 1.0, 0.5})));
    base.set_bucket_size(Mutate()
                             ? Pick<int64_t>({-5, int64_t{1} << 40, INT64_MAX})
                             : Pick<int64_t>({0, 64, 1, 16, 1000}));
    // Hierarchical sharding, derived from choices already made so that the
    // bytes of existing seeds keep their meaning: valid S = 2 for DP 4 with
    // bucket size 16, an invalid S for DP 3 with bucket size 64.
    if (l->dp() == 4 && base.bucket_size() == 16) base.set_shard_group_size(2);
    if (l->dp() == 3 && base.bucket_size() == 64) base.set_shard_group_size(2);
    BuildGroups(&base);
    BuildParameters(&base);

    const int64_t world = int64_t{l->pp()} * l->dp() * l->tp();
    const bool valid_layout = l->pp() >= 1 && l->dp() >= 1 && l->tp() >= 1;
    int ranks = 1;
    if (valid_layout && world <= kMaxRanks) {
      ranks = Mutate()
                  ? fdp_.ConsumeIntegralInRange<int>(1, static_cast<int>(world))
                  : static_cast<int>(world);
    }
    const int tp = std::max(l->tp(), 1), dp = std::max(l->dp(), 1);
    // Who calls: no credentials (TCP), or a uid (the shm owner check) and
    // a pid the engine watches: this process, or one that has exited (the
    // engine then releases the rank by itself, racing the calls below).
    PeerInfo peer;
    peer.address = "fuzz";
    if (Mutate()) {
      peer.uid = fdp_.ConsumeBool() ? ::geteuid() : ::geteuid() + 1;
    }
    if (Mutate()) {
      peer.pid = Pick<pid_t>({::getpid(), fixture->exited_pid, 0, -1});
    }

    // Every rank's Register, posted together (a job's ranks register
    // concurrently), then waited for.
    std::vector<v1::RegisterRequest> requests;
    for (int i = 0; i < ranks; ++i) {
      v1::RegisterRequest r = base;
      v1::RankCoordinates* c = r.mutable_rank();
      c->set_tp_rank(i % tp);
      c->set_dp_rank((i / tp) % dp);
      c->set_pp_rank(i / (tp * dp));
      if (Mutate()) c->set_dp_rank(Pick<int>({-1, 0, 1, 5, INT_MAX}));
      if (Mutate()) c->set_tp_rank(Pick<int>({0, 1, -1, 4, INT_MIN}));
      BuildBuffers(&r, i, l->tp());
      if (KnownEngineBug(r) || !Deliverable(r)) return;
      requests.push_back(std::move(r));
    }
    std::vector<std::shared_ptr<const Tracker::Slot>> slots;
    for (const v1::RegisterRequest& r : requests) {
      auto [callback, slot] =
          tracker.Track<v1::RegisterResponse>(Call::kRegister);
      Dump(r);
      engine.Register(r, peer, std::move(callback));
      slots.push_back(slot);
    }
    tracker.WaitAll();
    std::vector<const v1::RegisterRequest*> registered;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (slots[i]->code == Code::kOk) registered.push_back(&requests[i]);
    }
    const bool can_step = !StepWouldSpin(base);

    int64_t next_step = 1;
    const int ops = Count(3, 8);
    for (int op = 0; op < ops; ++op) {
      switch (Pick<int>({0, 0, 6, 1, 2, 3, 4, 5})) {
        case 0: {  // every registered rank steps
          if (!can_step) break;
          v1::StepRequest step;
          step.set_job_id(base.job_id());
          step.set_step(Mutate() ? Pick<int64_t>({0, -1, next_step + 1,
                                                  INT64_MAX, INT64_MIN})
                                 : next_step);
          if (Mutate()) step.set_grad_scale(Number(0.5));
          const int lrs = Count(0, 2);
          for (int i = 0; i < lrs; ++i) {
            (*step.mutable_lr())[Text("muon", {"adamw", "soap", "nope", ""})] =
                Number(0.01);
          }
          // Scheduled settings: valid keys and values, others, unknown
          // groups (StepRequest.settings).
          const int scheduled = Count(0, 2);
          for (int i = 0; i < scheduled; ++i) {
            v1::ScheduledSettings& values = (*step.mutable_settings())[Text(
                "muon", {"adamw", "soap", "shampoo", "nope", ""})];
            (*values.mutable_values())[Text(
                "momentum", {"weight_decay", "beta1", "eps", "epsilon",
                             "ns_steps", "lr", ""})] = Number(0.5);
          }
          if (!Deliverable(step)) break;
          // Even steps overlap (no extra bytes consumed): GradReady of a
          // valid and an out-of-range bucket, an async Step, WaitParams.
          const bool overlap = next_step % 2 == 0;
          step.set_async_params(overlap);
          for (const v1::RegisterRequest* r : registered) {
            if (!overlap) continue;
            v1::GradReadyRequest ready;
            ready.set_job_id(step.job_id());
            *ready.mutable_rank() = r->rank();
            ready.set_step(step.step());
            ready.add_buckets(0);
            auto [callback, slot] =
                tracker.Track<v1::GradReadyResponse>(Call::kGradReady);
            engine.GradReady(ready, std::move(callback));
            ready.add_buckets(1 << 20);
            auto [bad, bad_slot] =
                tracker.Track<v1::GradReadyResponse>(Call::kGradReady);
            engine.GradReady(ready, std::move(bad));
          }
          for (const v1::RegisterRequest* r : registered) {
            *step.mutable_rank() = r->rank();
            auto [callback, slot] =
                tracker.Track<v1::StepResponse>(Call::kStep);
            engine.Step(step, std::move(callback));
          }
          tracker.WaitAll();
          for (const v1::RegisterRequest* r : registered) {
            if (!overlap) continue;
            v1::WaitParamsRequest wait;
            wait.set_job_id(step.job_id());
            *wait.mutable_rank() = r->rank();
            wait.set_step(step.step());
            wait.set_bucket(-1);
            auto [callback, slot] =
                tracker.Track<v1::WaitParamsResponse>(Call::kWaitParams);
            engine.WaitParams(wait, std::move(callback));
          }
          tracker.WaitAll();
          ++next_step;
          break;
        }
        case 1: {  // one rank, any coordinates and step
          if (!can_step) break;
          v1::StepRequest step;
          step.set_job_id(base.job_id());
          step.mutable_rank()->set_pp_rank(Pick<int>({0, 1, -1}));
          step.mutable_rank()->set_dp_rank(Pick<int>({0, 1, 2, -1}));
          step.mutable_rank()->set_tp_rank(Pick<int>({0, 1, 3, INT_MAX}));
          step.set_step(Pick<int64_t>({next_step, 0, 1, 2, -1}));
          auto [callback, slot] = tracker.Track<v1::StepResponse>(Call::kStep);
          engine.Step(step, std::move(callback));
          tracker.WaitAll();
          break;
        }
        case 2: {
          v1::GetPlanRequest plan;
          plan.set_job_id(Text(base.job_id(), {"", "nope"}));
          if (!Deliverable(plan)) break;
          GetPlanChecked(engine, plan);
          break;
        }
        case 3:
          GetStatusChecked(engine);
          break;
        case 4: {
          v1::DeregisterRequest request;
          request.set_job_id(base.job_id());
          request.set_job_token(Text(kToken, {"wrong", ""}));
          if (!registered.empty() && !Mutate()) {
            *request.mutable_rank() =
                registered[fdp_.ConsumeIntegralInRange<size_t>(
                               0, registered.size() - 1)]
                    ->rank();
          } else {
            request.mutable_rank()->set_dp_rank(Pick<int>({0, 1, -1, 7}));
            request.mutable_rank()->set_pp_rank(Pick<int>({0, INT_MAX}));
          }
          if (KnownEngineBug(request, base.layout()) || !Deliverable(request)) {
            break;
          }
          DeregisterChecked(engine, request);
          break;
        }
        case 5: {  // a rank registers again
          if (requests.empty()) break;
          const v1::RegisterRequest& again =
              requests[fdp_.ConsumeIntegralInRange<size_t>(
                  0, requests.size() - 1)];
          RegisterAndWait(tracker, engine, again, peer);
          break;
        }
        case 6: {  // arbitrary bytes into a buffer (NaN, inf, denormals)
          SharedMemory& shm =
              fixture->shm[fdp_.ConsumeIntegralInRange<int>(0, kMaxRanks - 1)];
          const size_t at =
              fdp_.ConsumeIntegralInRange<size_t>(0, shm.size() - 1);
          const std::string bytes = fdp_.ConsumeRandomLengthString(64);
          std::memcpy(static_cast<char*>(shm.data()) + at, bytes.data(),
                      std::min(bytes.size(), shm.size() - at));
          break;
        }
      }
    }
  }

  FuzzedDataProvider fdp_;
};

}  // namespace
}  // namespace canzona::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  using namespace canzona;
  using namespace canzona::fuzz;
  // Rejections log a line each; millions of them would only slow the run.
  spdlog::set_level(spdlog::level::off);
  SetCpuBlasThreads(1);
  fixture = new Fixture;
  fixture->job_id = absl::StrCat(kPlaceholderJob, ::getpid());
  for (int r = 0; r < kMaxRanks; ++r) {
    absl::StatusOr<SharedMemory> shm =
        SharedMemory::Create(ShmName(fixture->job_id, r, 0), kShmBytes);
    if (!shm.ok()) Die(shm.status().ToString());
    fixture->shm.push_back(*std::move(shm));
  }
  std::vector<std::string> names;
  for (const SharedMemory& shm : fixture->shm) names.push_back(shm.name());
  StartShmJanitor(names);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  if (child < 0 || ::waitpid(child, nullptr, 0) != child) Die("fork");
  fixture->exited_pid = child;
  std::atexit(DestroyFixture);
  if (const char* stats = std::getenv("CANZONA_FUZZ_STATS");
      stats != nullptr && std::string(stats) == "1") {
    std::atexit(PrintStats);
  }
  if (const char* known = std::getenv("CANZONA_FUZZ_KNOWN_BUGS");
      known != nullptr) {
    skip_known_bugs = std::string(known) == "0";
  }
  if (const char* dump = std::getenv("CANZONA_FUZZ_DUMP");
      dump != nullptr && std::string(dump) == "1") {
    dump_requests = true;
  }
  // Invalid UTF-8 in string fields is logged by protobuf on every such
  // input: noise, the parse result is what the fuzzer checks.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace canzona::fuzz;
  if (size < 1) return 0;
  fixture->Reset();
  const auto kind = static_cast<InputKind>(data[0] % kInputKinds);
  if (kind == InputKind::kStructured) {
    Structured(data + 1, size - 1).Run();
  } else {
    RunRaw(kind, data + 1, size - 1);
  }
  return 0;
}
