// The Engine end to end in one process: two engines ("two daemons") sharing
// an in-memory control plane, trainer ranks as threads over POSIX shm.
#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/engine/engine_impl.h"
#include "server/metrics/registry.h"
#include "tests/matchers/exposed_samples.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/single_threaded_blas.h"

// OpenBLAS (the cpu backend) spins its own thread pool per call; with up to
// eight device workers in this process on a 2-core machine that spinning
// doubles the test's time, so each worker runs BLAS single-threaded here.

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kSteps = 5;

JobConfig MakeConfig(const std::string& stem, int dp, int tp,
                     const std::string& strategy, bool megatron, bool exact) {
  JobConfig c = MakeJobConfig(stem, dp, tp, strategy,
                              megatron ? MegatronModel() : HfModel());
  c.exact = exact;
  c.seed = static_cast<uint64_t>(dp * 100 + tp * 10 + (megatron ? 1 : 2));
  return c;
}

// ---------------------------------------------------------------------------
// Equivalence with the single-process reference.

using Layout = std::tuple<int, int>;  // dp, tp

class EngineEquivalenceTest
    : public ::testing::TestWithParam<std::tuple<Layout, std::string, bool>> {};

TEST_P(EngineEquivalenceTest, BitwiseEqualToWholeMatrixReference) {
  const auto& [layout, strategy, megatron] = GetParam();
  const auto [dp, tp] = layout;
  Cluster cluster;
  JobRun run(MakeConfig("eq", dp, tp, strategy, megatron, /*exact=*/true));
  ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                /*deregister=*/false));

  // Every rank agreed on the plan; the step reports sane statistics.
  for (int g = 0; g < run.config().world(); ++g) {
    EXPECT_EQ(run.registered[g].plan_digest(), run.registered[0].plan_digest());
    ASSERT_EQ(run.responses[g].size(), static_cast<size_t>(kSteps));
    const v1::StepResponse& last = run.responses[g].back();
    EXPECT_FALSE(last.skipped_nonfinite());
    EXPECT_GT(last.grad_norm(), 0);
    EXPECT_DOUBLE_EQ(last.grad_norm(), run.responses[0].back().grad_norm());
    EXPECT_GT(last.update_rms(), 0);
    EXPECT_GT(last.seconds().total(), 0);
  }
  // The negative control: orthogonalizing a TP fragment instead of the
  // whole matrix must be caught by the same comparison.
  if (tp > 1) {
    const std::string name = megatron ? "decoder.layers.0.mlp.linear_fc2.weight"
                                      : "model.layers.0.mlp.down_proj.weight";
    ASSERT_OK_AND_ASSIGN(Params wrong,
                         Reference(run.config(), kSteps, {}, name));
    EXPECT_THAT(run.Compare(wrong, /*bitwise=*/true),
                StatusIs(absl::StatusCode::kInternal, HasSubstr(name)));
    EXPECT_THAT(run.Compare(wrong, /*bitwise=*/false), Not(IsOk()));
  }
  EXPECT_OK(run.Deregister(cluster));
  EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0);
  EXPECT_EQ(cluster.engines[1]->GetStatus().jobs_size(), 0);
}

std::string EquivalenceName(
    const ::testing::TestParamInfo<EngineEquivalenceTest::ParamType>& info) {
  const auto& [layout, strategy, megatron] = info.param;
  return absl::StrCat("dp", std::get<0>(layout), "tp", std::get<1>(layout), "_",
                      strategy, megatron ? "_megatron" : "_hf");
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EngineEquivalenceTest,
    ::testing::Combine(
        ::testing::Values(Layout{1, 1}, Layout{2, 1}, Layout{4, 1},
                          Layout{1, 2}, Layout{2, 2}, Layout{1, 4}),
        ::testing::Values("sc", "layerwise", "start_anchored", "alpha", "cost"),
        ::testing::Bool()),
    EquivalenceName);

class EngineRandomGradTest : public ::testing::TestWithParam<Layout> {};

TEST_P(EngineRandomGradTest, WithinOneInAMillionOfReference) {
  const auto [dp, tp] = GetParam();
  for (const char* strategy : {"sc", "cost"}) {
    Cluster cluster;
    JobRun run(MakeConfig("rnd", dp, tp, strategy, /*megatron=*/true,
                          /*exact=*/false));
    EXPECT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/false,
                                  /*deregister=*/true))
        << strategy;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineRandomGradTest,
                         ::testing::Values(Layout{4, 1}, Layout{2, 2},
                                           Layout{1, 4}),
                         [](const auto& info) {
                           return absl::StrCat("dp", std::get<0>(info.param),
                                               "tp", std::get<1>(info.param));
                         });

// Settings a trainer schedules between steps (StepRequest.settings: Muon's
// momentum warm-up, weight decay and beta schedules) reach every rule of
// their group for their step only, wherever it runs (DP-owned, TP-owned,
// batched MoE experts): the steps equal a reference stepping with the same
// schedule, and not one without it (the negative control).
TEST(EngineTest, ScheduledSettingsApplyToTheirStepOnly) {
  for (const auto& [dp, tp, moe] :
       {std::tuple{2, 2, false}, std::tuple{1, 2, true}}) {
    SCOPED_TRACE(absl::StrCat("DP", dp, " x TP", tp, moe ? ", MoE" : ""));
    Cluster cluster;
    JobConfig config =
        moe ? MakeJobConfig("sched-moe", dp, tp, "cost", MoeModel(4))
            : MakeConfig("sched", dp, tp, "cost", true, /*exact=*/true);
    config.step_settings[2] = {
        {"muon", {{"momentum", 0.8}, {"weight_decay", 0.1}}},
        {"adamw", {{"beta1", 0.8}, {"weight_decay", 0.05}}},
        {"soap", {{"beta2", 0.9}, {"eps", 1e-6}}},
        {"shampoo", {{"beta1", 0.7}, {"weight_decay", 0.02}}}};
    config.step_settings[3] = {{"muon", {{"momentum", 0.85}}}};
    JobRun run(config);
    ASSERT_OK(RunMatchesReference(cluster, run, 4, /*bitwise=*/true,
                                  /*deregister=*/false));
    JobConfig unscheduled = config;
    unscheduled.step_settings.clear();
    ASSERT_OK_AND_ASSIGN(Params without, Reference(unscheduled, 4, {}));
    EXPECT_THAT(run.Compare(without, /*bitwise=*/false), Not(IsOk()));
    EXPECT_OK(run.Deregister(cluster));
  }
}

// Convolution filters (out, in, kh, kw) in Muon, Shampoo and SOAP groups
// step as the matrices (out, in * kh * kw) wherever they run: whole on
// their DP owner, or rebuilt from TP fragments split along out or in.
// Stacked experts (E, rows, cols) step as E matrices.
TEST(EngineTest, ConvolutionFiltersAndStackedExpertsStepAsTheirMatrices) {
  for (const auto& [dp, tp] : {std::pair{2, 2}, std::pair{1, 2}}) {
    SCOPED_TRACE(absl::StrCat("DP", dp, " x TP", tp));
    Cluster cluster;
    JobConfig config = MakeJobConfig("conv", dp, tp, "cost", ConvModel());
    config.exact = true;
    JobRun run(config);
    EXPECT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                  /*deregister=*/true));
  }
}

// ---------------------------------------------------------------------------
// Non-finite gradients.

TEST(EngineTest, NanOnOneRankSkipsTheStepEverywhere) {
  Cluster cluster;
  JobConfig config = MakeConfig("nan", 2, 2, "cost", true, true);
  config.nan_step = 3;
  config.nan_global_rank = 3;  // dp 1, tp 1
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, kSteps));
  for (int g = 0; g < config.world(); ++g) {
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(run.responses[g][s].skipped_nonfinite(), s == 2)
          << "rank " << g << " step " << s + 1;
    }
  }
  // Parameters and optimizer state untouched by step 3: steps 4 and 5 land
  // exactly where a run without step 3 does.
  ASSERT_OK_AND_ASSIGN(Params ref, Reference(config, kSteps, {3}));
  EXPECT_OK(run.Compare(ref, /*bitwise=*/true));
  EXPECT_OK(run.Deregister(cluster));
}

// ---------------------------------------------------------------------------
// Bad input: code, message, no state change, and a good Step still works.

absl::Status RegisterSync(Engine& engine, const v1::RegisterRequest& request) {
  Result<v1::RegisterResponse> r;
  engine.Register(request, PeerInfo{}, r.callback());
  return r.Get().status();
}

absl::StatusOr<v1::StepResponse> StepSync(Engine& engine,
                                          const v1::StepRequest& request) {
  Result<v1::StepResponse> r;
  engine.Step(request, r.callback());
  return r.Get();
}

// Steps every rank of `run` through `step` concurrently.
absl::Status StepAll(Cluster& cluster, JobRun& run, int step) {
  std::vector<absl::Status> status(run.ranks().size());
  std::vector<std::thread> threads;
  for (size_t g = 0; g < run.ranks().size(); ++g) {
    threads.emplace_back([&, g] {
      TrainerRank& rank = *run.ranks()[g];
      rank.WriteGrads(step);
      status[g] =
          StepSync(*cluster.engines[rank.engine_index()], rank.MakeStep(step))
              .status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : status) CANZONA_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// A setup that fails after the rank's communicators exist (bf16
// Newton-Schulz on the cpu backend, refused by the rules) fails the job with
// the reason, and the job's failure aborts nothing that setup already
// freed: the daemon once crashed here (an abort through a dangling
// communicator). A good job then registers and steps on the same engines.
TEST(EngineTest, SetupFailingAfterItsCommunicatorsLeavesTheEngineServing) {
  Cluster cluster;
  JobConfig bad = MakeJobConfig("setup-fails", 2, 1, "cost");
  bad.muon_ns_precision = "bf16";
  JobRun failing(bad);
  ASSERT_OK(failing.Init());
  EXPECT_THAT(failing.RegisterAll(cluster),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ns_precision: bf16 needs the cuda backend")));
  const JobConfig good = MakeJobConfig("after-failed-setup", 2, 1, "cost");
  JobRun run(good);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(good, 2, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

// Deregister answering OK means the rank has left: the same job id
// registers again at once (a trainer's next optimizer, a restarted loop)
// and steps afresh. Before, the departure reached the control plane only
// at the watcher's next round (200 ms later), and the new rank met its own
// old claim: ALREADY_EXISTS "is already registered".
TEST(EngineTest, AJobIdRegistersAgainRightAfterItsRanksLeft) {
  Cluster cluster;
  const JobConfig config = MakeJobConfig("registers-again", 1, 1, "cost");
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 2, {}));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// A Step that names the rank's last accepted step again (the trainer's
// wait was interrupted: Ctrl-C in a notebook; or its answer was lost) gets
// that step's own answer, once it completes, and the step runs once. Before,
// it was "step out of order", and the trainer could never catch up.
TEST(EngineTest, AStepCalledAgainGetsItsAnswerAndRunsOnce) {
  Cluster cluster;
  const JobConfig config = MakeJobConfig("repeated", 2, 1, "cost");
  ASSERT_OK_AND_ASSIGN(Params two, Reference(config, 2, {}));
  ASSERT_OK_AND_ASSIGN(Params three, Reference(config, 3, {}));
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunSteps(cluster, 1, 1));
  TrainerRank& first = *run.ranks()[0];
  TrainerRank& second = *run.ranks()[1];
  Engine& first_engine = *cluster.engines[first.engine_index()];
  Engine& second_engine = *cluster.engines[second.engine_index()];
  first.WriteGrads(2);
  second.WriteGrads(2);
  // Rank 0's step 2 waits for rank 1; its repeat arrives meanwhile.
  Result<v1::StepResponse> original, repeat;
  first_engine.Step(first.MakeStep(2), original.callback());
  first_engine.Step(first.MakeStep(2), repeat.callback());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_OK(StepSync(second_engine, second.MakeStep(2)).status());
  ASSERT_OK_AND_ASSIGN(v1::StepResponse answer, original.Get());
  ASSERT_OK_AND_ASSIGN(v1::StepResponse again, repeat.Get());
  EXPECT_GT(answer.grad_norm(), 0);
  EXPECT_EQ(again.SerializeAsString(), answer.SerializeAsString());
  // After it completed: answered at once, the same.
  ASSERT_OK_AND_ASSIGN(v1::StepResponse later,
                       StepSync(first_engine, first.MakeStep(2)));
  EXPECT_EQ(later.SerializeAsString(), answer.SerializeAsString());
  EXPECT_OK(run.Compare(two, /*bitwise=*/true));
  // Only the last step repeats; an earlier one is out of order.
  EXPECT_THAT(
      StepSync(first_engine, first.MakeStep(1)),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("expected step 3"), HasSubstr("got 1"))));
  ASSERT_OK(run.RunSteps(cluster, 3, 3));
  EXPECT_OK(run.Compare(three, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

// A repeat waiting for a step that fails (a peer never steps) fails too,
// naming the job's failure, instead of waiting forever.
TEST(EngineTest, AStepCalledAgainFailsWithItsStep) {
  Cluster cluster(absl::Seconds(1));
  JobRun run(MakeJobConfig("repeated-fails", 2, 1, "cost"));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunSteps(cluster, 1, 1));
  TrainerRank& first = *run.ranks()[0];
  Engine& engine = *cluster.engines[first.engine_index()];
  first.WriteGrads(2);
  Result<v1::StepResponse> original, repeat;
  engine.Step(first.MakeStep(2), original.callback());
  engine.Step(first.MakeStep(2), repeat.callback());
  EXPECT_FALSE(original.Get().ok());
  EXPECT_THAT(repeat.Get(),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("step 2 did not complete: job failed: ")));
  EXPECT_THAT(
      StepSync(engine, first.MakeStep(2)),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("job failed")));
}

// A job's series stay in /metrics while it runs and for the retention
// after its last rank left the daemon (Prometheus scrapes its last values),
// then go; another job's stay. Without this a long-running daemon's
// exposition grows with every job it ever served.
TEST(EngineTest, AJobsSeriesLeaveMetricsAfterTheRetention) {
  constexpr absl::Duration kRetention = absl::Seconds(1);
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr, nullptr,
                  true, false, false, kRetention);
  const JobConfig first = MakeJobConfig("series-a", 2, 1, "cost");
  const JobConfig second = MakeJobConfig("series-b", 2, 1, "cost");
  JobRun a(first), b(second);
  for (JobRun* run : {&a, &b}) {
    ASSERT_OK(run->Init());
    ASSERT_OK(run->RegisterAll(cluster));
    ASSERT_OK(run->RunSteps(cluster, 1, 1));
  }
  // Samples of `job` on the daemons, found by their job label.
  auto series = [&](const JobConfig& job) {
    const std::string label = absl::StrCat("job=\"", job.job_id, "\"");
    int n = 0;
    for (const MetricsRegistry& metrics : cluster.metrics) {
      for (const auto& [sample, value] : ExposedSamples(metrics.Expose())) {
        if (absl::StrContains(sample, label)) ++n;
      }
    }
    return n;
  };
  const int b_series = series(second);
  EXPECT_GT(series(first), 20);
  EXPECT_EQ(series(first), b_series);
  const absl::Time left = absl::Now();
  ASSERT_OK(a.Deregister(cluster));
  const int right_after = series(first);
  if (absl::Now() < left + kRetention) EXPECT_EQ(right_after, b_series);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (series(first) > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(series(first), 0);
  EXPECT_EQ(series(second), b_series);
  ASSERT_OK(b.Deregister(cluster));
}

TEST(EngineTest, BadInputIsRejectedWithoutChangingState) {
  Cluster cluster;
  // dp 2 x tp 2: ranks 0, 1 on engine 0, ranks 2, 3 on engine 1.
  JobRun run(MakeConfig("bad", 2, 2, "cost", true, true));
  ASSERT_OK(run.Init());
  auto& ranks = run.ranks();
  Engine& a = *cluster.engines[0];
  Engine& b = *cluster.engines[1];

  // Unknown job.
  EXPECT_THAT(
      StepSync(a, ranks[0]->MakeStep(1)),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr(run.config().job_id)));

  // Register ranks 0 and 2; the job is incomplete.
  Result<v1::RegisterResponse> r0, r1, r2, r3;
  a.Register(ranks[0]->MakeRegister(), PeerInfo{}, r0.callback());
  b.Register(ranks[2]->MakeRegister(), PeerInfo{}, r2.callback());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_THAT(
      StepSync(a, ranks[0]->MakeStep(1)),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not ready")));

  // Parameter list disagreeing: on the same engine (local check) and on the
  // other engine (control-plane check).
  {
    v1::RegisterRequest bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(2)->set_shape(0, 64);  // same numel: buffers fit
    bad.mutable_parameters(2)->set_shape(1, 128);
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kFailedPrecondition,
                 AllOf(HasSubstr("parameters[2]"), HasSubstr("linear_qkv"))));
    bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(7)->set_name("renamed");
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kFailedPrecondition,
                 AllOf(HasSubstr("parameters[7]"), HasSubstr("renamed"))));
    v1::RegisterRequest swapped = ranks[3]->MakeRegister();
    swapped.mutable_parameters()->SwapElements(3, 4);
    EXPECT_THAT(RegisterSync(b, swapped),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("parameters[3]")));
    v1::RegisterRequest regroup = ranks[3]->MakeRegister();
    regroup.mutable_parameters(5)->set_group("muon");
    EXPECT_THAT(RegisterSync(b, regroup),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("parameters[5]")));
  }
  // Wrong token, on the engine holding the job and on the other one.
  {
    v1::RegisterRequest bad = ranks[1]->MakeRegister();
    bad.set_job_token("wrong");
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("job_token")));
    v1::RegisterRequest bad3 = ranks[3]->MakeRegister();
    bad3.set_job_token("wrong");
    EXPECT_THAT(
        RegisterSync(b, bad3),
        StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("job_token")));
  }
  // Buffer too small, bad shm names, dtype, split.
  {
    v1::RegisterRequest bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(4)->mutable_grad()->mutable_shm()->set_bytes(4);
    EXPECT_THAT(RegisterSync(a, bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("buffer too small"),
                               HasSubstr("k_layernorm"))));
    bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(0)->mutable_param()->mutable_shm()->set_name(
        "/etc/passwd");
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr("parameters[0]"), HasSubstr("shm.name"))));
    bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(0)->mutable_param()->mutable_shm()->set_name(
        "/canzona.someone-else.0.0");
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shm.name")));
    bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(1)->mutable_param()->mutable_shm()->set_offset(
        1 << 30);
    EXPECT_THAT(RegisterSync(a, bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("parameters[1]")));
    bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(1)->set_dtype(v1::DTYPE_BFLOAT16);
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr("parameters[1]"), HasSubstr("dtype"))));
    bad = ranks[1]->MakeRegister();
    bad.mutable_parameters(1)->set_tp_split_dim(2);
    EXPECT_THAT(RegisterSync(a, bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("tp_split_dim")));
    bad = ranks[1]->MakeRegister();
    bad.mutable_groups(0)->add_settings()->set_key("no_such_key");
    bad.mutable_groups(0)->mutable_settings(0)->set_value("1");
    EXPECT_THAT(
        RegisterSync(a, bad),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("groups[0]")));
  }

  // The good registrations complete the job.
  a.Register(ranks[1]->MakeRegister(), PeerInfo{}, r1.callback());
  b.Register(ranks[3]->MakeRegister(), PeerInfo{}, r3.callback());
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse reg0, r0.Get());
  ASSERT_OK(r1.Get().status());
  ASSERT_OK(r2.Get().status());
  ASSERT_OK(r3.Get().status());
  ASSERT_OK(StepAll(cluster, run, 1));

  // Duplicate rank, locally and on the other engine.
  EXPECT_THAT(
      RegisterSync(a, ranks[0]->MakeRegister()),
      StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("dp 0, tp 0")));
  EXPECT_THAT(
      RegisterSync(b, ranks[0]->MakeRegister()),
      StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("dp 0, tp 0")));
  // Step out of order, a rank not on this engine, an unknown group lr.
  EXPECT_THAT(
      StepSync(a, ranks[0]->MakeStep(3)),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("expected step 2"), HasSubstr("got 3"))));
  EXPECT_THAT(
      StepSync(a, ranks[0]->MakeStep(0)),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("got 0")));
  EXPECT_THAT(
      StepSync(a, ranks[2]->MakeStep(2)),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("not registered")));
  {
    v1::StepRequest bad = ranks[0]->MakeStep(2);
    (*bad.mutable_lr())["nope"] = 0.1;
    EXPECT_THAT(StepSync(a, bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("nope")));
  }
  // Scheduled settings: an unknown group, a setting fixed at Register, a
  // value out of Register's range, and not a number.
  for (const auto& [group, key, value, message] :
       {std::tuple{"nope", "momentum", 0.9, "settings['nope']: unknown group"},
        std::tuple{"muon", "ns_steps", 3.0,
                   "settings['muon']: setting ns_steps: muon does not change "
                   "it between steps (it may change momentum, weight_decay"},
        std::tuple{"muon", "momentum", 1.5,
                   "settings['muon']: setting momentum: bad value"},
        std::tuple{"adamw", "beta2", std::nan(""),
                   "settings['adamw']: setting beta2: bad value \"nan\""}}) {
    v1::StepRequest bad = ranks[0]->MakeStep(2);
    (*(*bad.mutable_settings())[group].mutable_values())[key] = value;
    EXPECT_THAT(StepSync(a, bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr(message)));
  }
  EXPECT_THAT(a.GetPlan(v1::GetPlanRequest()),
              StatusIs(absl::StatusCode::kNotFound));

  // Good steps still work and land exactly on the reference: nothing above
  // changed any state.
  for (int s = 2; s <= kSteps; ++s) ASSERT_OK(StepAll(cluster, run, s));
  ASSERT_OK_AND_ASSIGN(Params ref, Reference(run.config(), kSteps, {}));
  EXPECT_OK(run.Compare(ref, /*bitwise=*/true));

  // Status and plan.
  v1::GetStatusResponse status = a.GetStatus();
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).state(), "ready");
  EXPECT_EQ(status.jobs(0).registered_ranks(), 4);
  ASSERT_EQ(status.jobs(0).local_ranks_size(), 2);
  EXPECT_EQ(status.jobs(0).local_ranks(0).steps_done(), kSteps);
  EXPECT_GT(status.jobs(0).local_ranks(0).last_step_seconds().total(), 0);
  v1::GetPlanRequest plan_request;
  plan_request.set_job_id(run.config().job_id);
  ASSERT_OK_AND_ASSIGN(v1::GetPlanResponse plan, b.GetPlan(plan_request));
  EXPECT_EQ(plan.digest(), reg0.plan_digest());
  EXPECT_THAT(plan.plan_json(), HasSubstr("\"assignment\""));
  EXPECT_THAT(plan.plan_json(), HasSubstr(plan.digest()));

  // Deregister with a wrong token fails; then everyone leaves.
  v1::DeregisterRequest dr;
  dr.set_job_id(run.config().job_id);
  dr.set_job_token("wrong");
  EXPECT_THAT(a.Deregister(dr), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_OK(run.Deregister(cluster));
  EXPECT_EQ(a.GetStatus().jobs_size(), 0);
}

// ---------------------------------------------------------------------------
// Failures.

TEST(EngineTest, RankThatNeverStepsFailsPeersWithinTheTimeout) {
  const absl::Duration timeout = absl::Seconds(2);
  Cluster cluster(timeout);
  JobRun run(MakeConfig("dead", 4, 1, "cost", false, true));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 1));
  auto& ranks = run.ranks();
  // Ranks 0, 1 (engine 0) and 2 (engine 1) step; rank 3 never does.
  const auto start = std::chrono::steady_clock::now();
  std::vector<absl::Status> status(3);
  std::vector<std::thread> threads;
  for (int g = 0; g < 3; ++g) {
    threads.emplace_back([&, g] {
      ranks[g]->WriteGrads(2);
      status[g] = StepSync(*cluster.engines[ranks[g]->engine_index()],
                           ranks[g]->MakeStep(2))
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  for (int g = 0; g < 3; ++g) {
    EXPECT_THAT(status[g], AnyOf(StatusIs(absl::StatusCode::kUnavailable),
                                 StatusIs(absl::StatusCode::kDeadlineExceeded),
                                 StatusIs(absl::StatusCode::kAborted)))
        << "rank " << g;
  }
  EXPECT_LT(seconds, 2 * absl::ToDoubleSeconds(timeout) + 2);
  // The job is failed; later calls say so.
  EXPECT_THAT(
      StepSync(*cluster.engines[1], ranks[3]->MakeStep(2)),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("job failed")));
  EXPECT_THAT(cluster.engines[0]->GetStatus().jobs(0).state(),
              HasSubstr("failed"));

  // The engines keep serving another job.
  JobRun other(MakeConfig("alive", 2, 1, "layerwise", true, true));
  EXPECT_OK(RunMatchesReference(cluster, other, 2, /*bitwise=*/true,
                                /*deregister=*/true));
  EXPECT_OK(run.Deregister(cluster));
}

TEST(EngineTest, ShutdownFailsPendingCallsWithUnavailable) {
  Cluster cluster;
  JobRun run(MakeConfig("shut", 2, 1, "cost", true, true));
  ASSERT_OK(run.Init());
  // Rank 0 registers; rank 1 never does: Register is pending at shutdown.
  Result<v1::RegisterResponse> r0;
  cluster.engines[0]->Register(run.ranks()[0]->MakeRegister(), PeerInfo{},
                               r0.callback());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  cluster.engines[0]->Shutdown();
  EXPECT_THAT(r0.Get(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(StepSync(*cluster.engines[0], run.ranks()[0]->MakeStep(1)),
              StatusIs(absl::StatusCode::kUnavailable));
}

// State and scratch are allocated at registration and on the first
// steps (lazily sized workspaces); after that a step allocates nothing
// from the backend. Muon, AdamW, Shampoo and SOAP with preconditioner
// refreshes (every 2 steps) inside the counted window; DP2 x TP2 so the
// micro groups and the bucket pipeline run too.
TEST(EngineTest, SteadyStateStepsAllocateNothing) {
  Cluster cluster;
  JobRun run(MakeConfig("alloc", 2, 2, "cost", true, true));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 3));
  const int64_t before = BackendAllocationCount();
  ASSERT_OK(run.RunStepsOverlapped(cluster, 4, 6, false, 5));
  ASSERT_OK(run.RunSteps(cluster, 7, 9));
  EXPECT_EQ(BackendAllocationCount(), before);
}

TEST(EngineTest, LimitsAreResourceExhausted) {
  InMemoryKvStore kv;
  EngineOptions options;
  options.control = &kv;
  options.max_parameters_per_job = 3;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Engine> engine, CreateEngine(options));
  JobRun run(MakeConfig("limit", 1, 1, "cost", true, true));
  ASSERT_OK(run.Init());
  EXPECT_THAT(
      RegisterSync(*engine, run.ranks()[0]->MakeRegister()),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("parameters")));
  EXPECT_THAT(
      CreateEngine(EngineOptions{}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("control")));
}

}  // namespace
}  // namespace canzona::engine_test
