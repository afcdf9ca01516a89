// Checkpoints and failures with real canzonad processes: resume after every
// daemon is restarted as a fresh process (same and another layout), crash
// safety of SaveCheckpoint under kill -9, and a daemon killed mid-step.
// The trainer ranks are threads of this test talking to the daemons with
// the C++ client over their unix sockets.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "server/checkpoint/checkpoint.h"
#include "tests/integration/daemons.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using engine_test::JobConfig;
using engine_test::JobRun;
using engine_test::MegatronModel;
using engine_test::Params;
using engine_test::Reference;
using engine_test::TrainerRank;
using ::testing::AnyOf;
using ::testing::HasSubstr;

JobConfig Config(const std::string& stem, int dp, int tp,
                 const std::string& strategy) {
  JobConfig config;
  config.job_id = engine_test::UniqueJobId(stem);
  config.dp = dp;
  config.tp = tp;
  config.strategy = strategy;
  config.params = MegatronModel();  // Muon, AdamW, Shampoo and SOAP
  config.layout_free_grads = true;
  return config;
}

v1::RankCoordinates Coords(const TrainerRank& rank) {
  v1::RankCoordinates c;
  c.set_dp_rank(rank.dp_rank());
  c.set_tp_rank(rank.tp_rank());
  return c;
}

// The job's trainer ranks (shm buffers from JobRun) with one client each.
class Trainers {
 public:
  explicit Trainers(JobConfig config) : run_(std::move(config)) {}

  absl::Status Connect(const Daemons& daemons, int64_t state_part_bytes = 0) {
    CANZONA_RETURN_IF_ERROR(run_.Init());
    Client::Options options;
    if (state_part_bytes > 0) options.state_part_bytes = state_part_bytes;
    options.job_token = run_.config().token;
    options.step_timeout = absl::Seconds(60);
    options.register_timeout = absl::Seconds(60);
    for (auto& rank : run_.ranks()) {
      CANZONA_ASSIGN_OR_RETURN(
          auto client,
          Client::Connect(daemons.Target(rank->engine_index()), options));
      clients_.push_back(std::move(client));
    }
    return absl::OkStatus();
  }

  // `call` for the ranks `which` selects (all by default), on threads.
  absl::Status ForAll(
      const std::function<absl::Status(TrainerRank&, Client&)>& call,
      const std::function<bool(const TrainerRank&)>& which = nullptr) {
    std::vector<absl::Status> status(run_.ranks().size());
    std::vector<std::thread> threads;
    for (size_t g = 0; g < run_.ranks().size(); ++g) {
      if (which && !which(*run_.ranks()[g])) continue;
      threads.emplace_back([&, g] {
        status[g] = call(*run_.ranks()[g], *clients_[g]);
      });
    }
    for (auto& t : threads) t.join();
    for (size_t g = 0; g < status.size(); ++g) {
      if (!status[g].ok()) {
        return absl::Status(status[g].code(), absl::StrCat("rank ", g, ": ",
                                                           status[g].message()));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Register() {
    return ForAll([](TrainerRank& rank, Client& client) {
      return client.Register(rank.MakeRegister()).status();
    });
  }
  absl::Status Steps(int first, int last) {
    return ForAll([&](TrainerRank& rank, Client& client) {
      for (int s = first; s <= last; ++s) {
        rank.WriteGrads(s);
        CANZONA_RETURN_IF_ERROR(client.Step(rank.MakeStep(s)).status());
      }
      return absl::OkStatus();
    });
  }
  absl::Status Save(const std::string& dir) {
    return ForAll([&](TrainerRank& rank, Client& client) {
      return client.SaveCheckpoint(rank.config().job_id, Coords(rank), dir)
          .status();
    });
  }
  absl::Status Load(const std::string& dir) {
    return ForAll([&](TrainerRank& rank, Client& client) {
      return client.LoadCheckpoint(rank.config().job_id, Coords(rank), dir)
          .status();
    });
  }

  JobRun& run() { return run_; }

 private:
  JobRun run_;
  std::vector<std::unique_ptr<Client>> clients_;
};

std::string TempDir(const std::string& stem) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/", stem, "_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                       start)
      .count();
}

struct ResumeCase {
  std::string name;
  int dp, tp;
  std::string strategy;
};

class ResumeTest : public ::testing::TestWithParam<ResumeCase> {};

// 10 steps, save, stop both daemons, start two fresh daemon processes,
// register (same job id: the control plane is new), load, 10 more steps:
// every rank equals the uninterrupted 20-step reference bitwise.
TEST_P(ResumeTest, FreshDaemonProcessesResumeBitwise) {
  const ResumeCase& c = GetParam();
  const std::string dir = TempDir("resume_" + c.name) + "/step-10";
  const JobConfig first = Config("xresume", 2, 2, "cost");
  Params params;
  {
    Daemons daemons;
    Trainers trainers(first);
    ASSERT_OK(trainers.Connect(daemons));
    ASSERT_OK(trainers.Register());
    ASSERT_OK(trainers.Steps(1, 10));
    ASSERT_OK(trainers.Save(dir));
    params = trainers.run().GatherParams();
  }  // SIGTERM: both daemons exit
  JobConfig second = Config("unused", c.dp, c.tp, c.strategy);
  second.job_id = first.job_id;
  Daemons daemons;
  Trainers trainers(second);
  ASSERT_OK(trainers.Connect(daemons));
  ASSERT_OK(trainers.Register());
  ASSERT_OK(trainers.Load(dir));
  for (auto& rank : trainers.run().ranks()) rank->SetParams(params);
  ASSERT_OK(trainers.Steps(11, 20));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(first, 20, {}));
  EXPECT_OK(trainers.run().Compare(reference, /*bitwise=*/true));
}

// Each rank's state through the C++ client (ExportState, then ImportState
// into a job of fresh daemon processes), moved in parts of 1000 bytes both
// ways: the next steps equal the uninterrupted reference bitwise.
TEST(StateExportClientTest, StateInPartsResumesInFreshDaemons) {
  const JobConfig first = Config("xstate", 2, 2, "cost");
  std::vector<v1::ExportStateResponse> exported(first.world());
  Params params;
  {
    Daemons daemons;
    Trainers trainers(first);
    ASSERT_OK(trainers.Connect(daemons, /*state_part_bytes=*/1000));
    ASSERT_OK(trainers.Register());
    ASSERT_OK(trainers.Steps(1, 5));
    ASSERT_OK(trainers.ForAll([&](TrainerRank& rank, Client& client) {
      CANZONA_ASSIGN_OR_RETURN(exported[rank.global()],
                               client.ExportState(first.job_id, Coords(rank)));
      return absl::OkStatus();
    }));
    params = trainers.run().GatherParams();
  }
  for (const v1::ExportStateResponse& e : exported) {
    ASSERT_GT(e.total_bytes(), 3000);
    ASSERT_EQ(static_cast<int64_t>(e.state().size()), e.total_bytes());
  }
  Daemons daemons;
  Trainers trainers(first);
  ASSERT_OK(trainers.Connect(daemons, /*state_part_bytes=*/1000));
  ASSERT_OK(trainers.Register());
  ASSERT_OK(trainers.ForAll([&](TrainerRank& rank, Client& client) {
    const v1::ExportStateResponse& e = exported[rank.global()];
    v1::ImportStateRequest request;
    request.set_job_id(first.job_id);
    *request.mutable_rank() = Coords(rank);
    request.set_state(e.state());
    request.set_step(e.step());
    request.set_plan_digest(e.plan_digest());
    CANZONA_ASSIGN_OR_RETURN(v1::ImportStateResponse r,
                             client.ImportState(request));
    if (r.records() == 0 || r.received_bytes() != e.total_bytes()) {
      return absl::InternalError(absl::StrCat("imported ", r.records(),
                                              " records, ", r.received_bytes(),
                                              " bytes"));
    }
    return absl::OkStatus();
  }));
  for (auto& rank : trainers.run().ranks()) rank->SetParams(params);
  ASSERT_OK(trainers.Steps(6, 8));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(first, 8, {}));
  EXPECT_OK(trainers.run().Compare(reference, /*bitwise=*/true));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ResumeTest,
    ::testing::Values(ResumeCase{"same", 2, 2, "cost"},
                      ResumeCase{"dp4", 4, 1, "alpha"},
                      ResumeCase{"tp4", 1, 4, "layerwise"}),
    [](const auto& info) { return info.param.name; });

// kill -9 one daemon at several points of a SaveCheckpoint: the previous
// checkpoint always opens (every checksum verified) and the interrupted one
// is either complete or not a checkpoint at all, never a damaged one.
TEST(CheckpointCrashTest, KillDuringSaveNeverDamagesCheckpoints) {
  const std::string root = TempDir("crash");
  int complete = 0, absent = 0;
  const std::vector<int> delays_us = {0, 500, 1000, 2000, 4000, 8000, 16000};
  for (size_t k = 0; k < delays_us.size(); ++k) {
    SCOPED_TRACE(absl::StrCat("delay ", delays_us[k], " us"));
    Daemons daemons(/*step_timeout_s=*/5, {"--checkpoint-timeout", "5"});
    Trainers trainers(Config("xcrash", 2, 2, "cost"));
    ASSERT_OK(trainers.Connect(daemons));
    ASSERT_OK(trainers.Register());
    ASSERT_OK(trainers.Steps(1, 2));
    const std::string prev = absl::StrCat(root, "/prev", k);
    const std::string next = absl::StrCat(root, "/next", k);
    ASSERT_OK(trainers.Save(prev));
    ASSERT_OK(trainers.Steps(3, 3));
    const auto start = std::chrono::steady_clock::now();
    std::thread saver([&] { (void)trainers.Save(next); });
    std::this_thread::sleep_for(std::chrono::microseconds(delays_us[k]));
    daemons.Kill(static_cast<int>(k % 2));  // the committer, then the other
    saver.join();  // the survivors answer, no hang
    EXPECT_LT(Since(start), 15.0);
    EXPECT_OK(CheckpointReader::Open(prev).status());
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
        CheckpointReader::Open(next);
    if (reader.ok()) {
      ++complete;
      EXPECT_EQ((*reader)->manifest().step, 3);
    } else {
      ++absent;
      EXPECT_THAT(reader.status().code(),
                  AnyOf(absl::StatusCode::kNotFound,
                        absl::StatusCode::kFailedPrecondition))
          << reader.status();
      EXPECT_THAT(reader.status().message(), HasSubstr("no complete manifest"));
    }
  }
  std::printf("kill -9 during save: %d complete, %d not a checkpoint\n",
              complete, absent);
}

// A daemon killed mid-step: the ranks on the surviving daemon get
// UNAVAILABLE or ABORTED within the step timeout, the survivor keeps
// serving, and the job comes back (a new incarnation on the survivor and a
// restarted daemon) from its last checkpoint, bitwise.
TEST(DaemonFailureTest, KilledDaemonFailsStepsPromptlyAndTheJobResumes) {
  const double step_timeout_s = 4;
  Daemons daemons(step_timeout_s, {"--checkpoint-timeout", "5"});
  const JobConfig config = Config("xdkill", 2, 2, "cost");
  const std::string dir = TempDir("dkill") + "/step-3";
  Params params;
  {
    Trainers trainers(config);
    ASSERT_OK(trainers.Connect(daemons));
    ASSERT_OK(trainers.Register());
    ASSERT_OK(trainers.Steps(1, 3));
    ASSERT_OK(trainers.Save(dir));
    params = trainers.run().GatherParams();
    // Ranks 0 and 1 (daemon A) step while daemon B dies under them.
    const auto start = std::chrono::steady_clock::now();
    std::thread killer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      daemons.Kill(1);
    });
    std::vector<absl::Status> results(2);
    absl::Status all = trainers.ForAll(
        [&](TrainerRank& rank, Client& client) {
          rank.WriteGrads(4);
          results[rank.global()] = client.Step(rank.MakeStep(4)).status();
          return absl::OkStatus();
        },
        [](const TrainerRank& rank) { return rank.engine_index() == 0; });
    killer.join();
    const double seconds = Since(start);
    EXPECT_LT(seconds, step_timeout_s + 2) << "no hang";
    for (const absl::Status& s : results) {
      EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable,
                                  absl::StatusCode::kAborted))
          << s;
    }
    std::printf("step after kill -9 of a peer daemon: %s in %.2f s\n",
                results[0].ToString().c_str(), seconds);
    // The survivor keeps serving and reports the failed job; its ranks
    // leave.
    ASSERT_OK_AND_ASSIGN(
        auto ctl, Client::Connect(daemons.Target(0), Client::Options()));
    ASSERT_OK_AND_ASSIGN(v1::GetStatusResponse status, ctl->GetStatus());
    ASSERT_EQ(status.jobs_size(), 1);
    EXPECT_THAT(status.jobs(0).state(), HasSubstr("failed"));
    EXPECT_OK(trainers.ForAll(
        [&](TrainerRank& rank, Client& client) {
          return client.Deregister(config.job_id, Coords(rank));
        },
        [](const TrainerRank& rank) { return rank.engine_index() == 0; }));
  }
  daemons.StartB();
  JobConfig again = config;
  again.job_id = engine_test::UniqueJobId("xdkill-again");
  Trainers trainers(again);
  ASSERT_OK(trainers.Connect(daemons));
  ASSERT_OK(trainers.Register());
  ASSERT_OK(trainers.Load(dir));
  for (auto& rank : trainers.run().ranks()) rank->SetParams(params);
  ASSERT_OK(trainers.Steps(4, 6));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 6, {}));
  EXPECT_OK(trainers.run().Compare(reference, /*bitwise=*/true));
}

}  // namespace
}  // namespace canzona
