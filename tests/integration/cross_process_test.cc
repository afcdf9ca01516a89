// Two canzonad processes ("two nodes") on loopback and one trainer process
// per rank talking to them through the C++ client: after 5 steps every
// rank's parameters equal the single-process reference (update rules on
// whole matrices with the DP-averaged gradients), bitwise on exact-sum
// gradients. A killed trainer makes its peers fail within the timeout while
// the daemons keep serving.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemons.h"
#include "tests/integration/trainer_process.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona {
namespace {

using engine_test::HfModel;
using engine_test::JobConfig;
using engine_test::MegatronModel;
using engine_test::TrainerRank;

// Child exit codes, so the parent can tell what went wrong.
enum ChildExit {
  kOk = 0,
  kConnect = 10,
  kRegister,
  kStep,
  kMismatch,
  kExpectFail
};

// The trainer process of one rank: registers, runs `steps` steps, and
// checks its own parameter buffers against the reference.
enum class Mode { kNormal, kDieAfterRegister, kExpectStepFailure };

[[noreturn]] void RunTrainer(const Daemons& daemons, const JobConfig& config,
                             int global, int steps, Mode mode) {
  const bool expect_step_failure = mode == Mode::kExpectStepFailure;
  auto owned = std::make_unique<engine_test::TrainerRank>(config, global);
  engine_test::TrainerRank& rank = *owned;
  if (!rank.Init().ok()) ExitTrainer(owned, kConnect);
  Client::Options options;
  options.job_token = config.token;
  options.step_timeout = absl::Seconds(60);
  auto client = Client::Connect(daemons.Target(rank.engine_index()), options);
  if (!client.ok()) ExitTrainer(owned, kConnect);
  auto registered = (*client)->Register(rank.MakeRegister());
  if (!registered.ok()) {
    std::fprintf(stderr, "rank %d register: %s\n", global,
                 std::string(registered.status().message()).c_str());
    ExitTrainer(owned, kRegister);
  }
  // A trainer that crashes: no Step, no Deregister, connection gone.
  if (mode == Mode::kDieAfterRegister) ExitTrainer(owned, kOk);
  for (int s = 1; s <= steps; ++s) {
    rank.WriteGrads(s);
    auto step = (*client)->Step(rank.MakeStep(s));
    if (!step.ok()) {
      std::fprintf(stderr, "rank %d step %d: %s\n", global, s,
                   std::string(step.status().message()).c_str());
      ExitTrainer(owned, expect_step_failure ? kExpectFail : kStep);
    }
  }
  if (expect_step_failure) ExitTrainer(owned, kStep);
  auto reference = engine_test::Reference(config, steps, {});
  if (!reference.ok()) ExitTrainer(owned, kMismatch);
  for (size_t i = 0; i < config.params.size(); ++i) {
    const auto& p = config.params[i];
    if (!rank.Holds(p)) continue;  // another pipeline stage's
    if (rank.ParamBuffer(static_cast<int>(i)) !=
        rank.Shard(p, reference->at(p.name))) {
      std::fprintf(stderr, "rank %d: %s differs from the reference\n", global,
                   p.name.c_str());
      ExitTrainer(owned, kMismatch);
    }
  }
  (void)(*client)->Deregister(config.job_id, rank.MakeStep(1).rank());
  ExitTrainer(owned, kOk);
}

std::vector<pid_t> StartTrainers(const Daemons& daemons,
                                 const JobConfig& config, int steps,
                                 int killed_rank = -1) {
  std::vector<pid_t> pids;
  for (int g = 0; g < config.world(); ++g) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (g == killed_rank) {
        RunTrainer(daemons, config, g, steps, Mode::kDieAfterRegister);
      }
      RunTrainer(daemons, config, g, steps,
                 killed_rank >= 0 ? Mode::kExpectStepFailure : Mode::kNormal);
    }
    pids.push_back(pid);
  }
  return pids;
}

// canzonactl's stdout and stderr.
std::string RunCanzonactl(const std::string& args) {
  const std::string out =
      absl::StrCat(::testing::TempDir(), "/canzonactl_", getpid(), ".out");
  const std::string command =
      absl::StrCat(CANZONACTL_PATH, " ", args, " >", out, " 2>&1");
  EXPECT_EQ(std::system(command.c_str()), 0) << command << "\n"
                                             << ReadFile(out);
  return ReadFile(out);
}

using Case =
    std::tuple<int, int, std::string, std::string>;  // dp tp layout strategy

class CrossProcessTest : public ::testing::TestWithParam<Case> {};

TEST_P(CrossProcessTest, EveryRankEqualsTheSingleProcessReferenceBitwise) {
  const auto& [dp, tp, layout, strategy] = GetParam();
  Daemons daemons;
  JobConfig config;
  config.job_id = engine_test::UniqueJobId("xp");
  config.dp = dp;
  config.tp = tp;
  config.strategy = strategy;
  config.params = layout == "megatron" ? MegatronModel() : HfModel();
  config.exact = true;
  std::vector<pid_t> pids = StartTrainers(daemons, config, 5);
  for (size_t g = 0; g < pids.size(); ++g) {
    EXPECT_EQ(WaitExit(pids[g]), kOk) << "rank " << g;
  }
  EXPECT_TRUE(daemons.Alive());
}

// Pipeline parallelism across processes: PP2 x DP2, each stage its own
// parameter list and plan, the stages' ranks spread over both daemons.
TEST(CrossProcessPipelineTest, TwoStagesEqualTheSingleProcessReference) {
  Daemons daemons;
  JobConfig config;
  config.job_id = engine_test::UniqueJobId("xp-pp");
  config.pp = 2;
  config.dp = 2;
  config.params = MegatronModel();
  const int count = static_cast<int>(config.params.size());
  for (int i = 0; i < count; ++i) config.params[i].stage = 2 * i / count;
  std::vector<pid_t> pids = StartTrainers(daemons, config, 4);
  for (size_t g = 0; g < pids.size(); ++g) {
    EXPECT_EQ(WaitExit(pids[g]), kOk) << "rank " << g;
  }
  EXPECT_TRUE(daemons.Alive());
}

// Every DP x TP up to four ranks under every strategy, the two layouts
// alternating so that each layout meets every layout size and strategy.
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  const std::pair<int, int> sizes[] = {{1, 1}, {2, 1}, {4, 1},
                                       {1, 2}, {2, 2}, {1, 4}};
  const char* strategies[] = {"sc", "layerwise", "start_anchored", "alpha",
                              "cost"};
  int i = 0;
  for (const auto& [dp, tp] : sizes) {
    for (const char* strategy : strategies) {
      cases.emplace_back(dp, tp, i++ % 2 == 0 ? "megatron" : "hf", strategy);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, CrossProcessTest,
                         ::testing::ValuesIn(AllCases()), [](const auto& info) {
                           return absl::StrCat("dp", std::get<0>(info.param),
                                               "tp", std::get<1>(info.param),
                                               "_", std::get<2>(info.param),
                                               "_", std::get<3>(info.param));
                         });

// grpc.health.v1.Health/Check on the coordinator's TCP port answers
// SERVING (what Kubernetes probes ask). Run in a child process: this test
// process forks trainers and must not hold gRPC state itself.
TEST(CrossProcessHealthTest, DaemonAnswersTheGrpcHealthCheck) {
  Daemons daemons;
  const pid_t child = ::fork();
  if (child == 0) {
    auto channel =
        grpc::CreateChannel(daemons.Tcp(), grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    // HealthCheckRequest{service: ""} is the empty message.
    grpc::Slice empty;
    grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, "/grpc.health.v1.Health/Check",
                   grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status status) { done.set_value(status); });
    grpc::Status status = done.get_future().get();
    std::vector<grpc::Slice> slices;
    if (!status.ok() || !response.Dump(&slices).ok()) ::_exit(1);
    std::string bytes;
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    // HealthCheckResponse{status: SERVING (1)}: field 1, varint 1.
    ::_exit(bytes == std::string("\x08\x01", 2) ? 0 : 2);
  }
  EXPECT_EQ(WaitExit(child), 0);
}

TEST(CrossProcessFailureTest, KilledTrainerFailsItsPeersWithinTheTimeout) {
  Daemons daemons(/*step_timeout_s=*/3);
  JobConfig config;
  config.job_id = engine_test::UniqueJobId("xkill");
  config.dp = 2;
  config.tp = 1;
  config.params = HfModel();
  const auto start = std::chrono::steady_clock::now();
  std::vector<pid_t> pids =
      StartTrainers(daemons, config, 3, /*killed_rank=*/1);
  EXPECT_EQ(WaitExit(pids[1]), kOk);          // registered, then died
  EXPECT_EQ(WaitExit(pids[0]), kExpectFail);  // its step failed, no hang
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_LT(seconds, 30.0);
  // The daemons keep serving: canzonactl sees the failed job and its plan...
  EXPECT_TRUE(daemons.Alive());
  const std::string status =
      RunCanzonactl("status --target " + daemons.Target(0));
  EXPECT_THAT(status, ::testing::HasSubstr(config.job_id));
  EXPECT_THAT(status, ::testing::HasSubstr("failed"));
  const std::string plan = RunCanzonactl(absl::StrCat(
      "plan --target ", daemons.Target(1), " --job ", config.job_id));
  EXPECT_THAT(plan, ::testing::HasSubstr("strategy cost"));
  EXPECT_THAT(plan, ::testing::HasSubstr("digest"));
  // ... and a new job runs to completion.
  JobConfig next = config;
  next.job_id = engine_test::UniqueJobId("xafter");
  std::vector<pid_t> after = StartTrainers(daemons, next, 3);
  for (pid_t pid : after) EXPECT_EQ(WaitExit(pid), kOk);
}

}  // namespace
}  // namespace canzona
