// Overlap with the trainer (GradReady / async Step / WaitParams) and
// hierarchical sharding (shard_group_size) through the Engine: both must
// leave every parameter bitwise equal to the single-process reference
// (exact-sum gradients), for every optimizer (the model has Muon, AdamW,
// Shampoo and SOAP groups), strategy and layout.
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/single_threaded_blas.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int kSteps = 4;

JobConfig Config(const std::string& stem, int dp, int tp,
                 const std::string& strategy, int shard_group_size) {
  JobConfig c = MakeJobConfig(stem, dp, tp, strategy);
  c.shard_group_size = shard_group_size;
  c.seed = static_cast<uint64_t>(dp * 100 + tp * 10 + shard_group_size);
  return c;
}

void ExpectCommTimes(const JobRun& run) {
  for (const auto& rank : run.responses) {
    for (const v1::StepResponse& r : rank) {
      EXPECT_GE(r.seconds().dp_comm(), 0);
      EXPECT_GE(r.seconds().dp_comm_exposed(), 0);
    }
  }
}

// ---------------------------------------------------------------------------

using Layout = std::tuple<int, int>;  // dp, tp

class OverlapTest
    : public ::testing::TestWithParam<std::tuple<Layout, std::string, bool>> {};

TEST_P(OverlapTest, BitwiseEqualToThePlainStep) {
  const auto& [layout, strategy, shuffled] = GetParam();
  const JobConfig config =
      Config("overlap", std::get<0>(layout), std::get<1>(layout), strategy, 0);
  Cluster cluster;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_GT(run.registered[0].buckets_size(), 1) << "the model spans buckets";
  ASSERT_OK(run.RunStepsOverlapped(cluster, 1, kSteps, shuffled, 7));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, kSteps, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ExpectCommTimes(run);
  // The plain step after overlapped ones continues the same sequence.
  ASSERT_OK(run.RunSteps(cluster, kSteps + 1, kSteps + 1));
  ASSERT_OK_AND_ASSIGN(reference, Reference(config, kSteps + 1, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  EXPECT_OK(run.Deregister(cluster));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, OverlapTest,
    ::testing::Combine(
        ::testing::Values(Layout{2, 1}, Layout{2, 2}, Layout{4, 1}),
        ::testing::Values("sc", "layerwise", "start_anchored", "alpha", "cost"),
        ::testing::Bool()),
    [](const auto& info) {
      const Layout& layout = std::get<0>(info.param);
      return absl::StrCat("dp", std::get<0>(layout), "tp", std::get<1>(layout),
                          "_", std::get<1>(info.param),
                          std::get<2>(info.param) ? "_shuffled" : "_backward");
    });

// ---------------------------------------------------------------------------

class HierarchicalTest : public ::testing::TestWithParam<
                             std::tuple<Layout, int, std::string, bool>> {};

TEST_P(HierarchicalTest, BitwiseEqualToFlatSharding) {
  const auto& [layout, S, strategy, overlap] = GetParam();
  const JobConfig config =
      Config("hier", std::get<0>(layout), std::get<1>(layout), strategy, S);
  Cluster cluster;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  if (overlap) {
    ASSERT_OK(run.RunStepsOverlapped(cluster, 1, kSteps, false, 3));
  } else {
    ASSERT_OK(run.RunSteps(cluster, 1, kSteps));
  }
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, kSteps, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ExpectCommTimes(run);

  // State: each shard group holds one whole copy, so the job holds dp / S
  // copies where flat sharding holds one.
  JobConfig flat_config = config;
  flat_config.job_id = UniqueJobId("hier-flat");
  flat_config.shard_group_size = 0;
  JobRun flat(flat_config);
  ASSERT_OK(flat.Init());
  ASSERT_OK(flat.RegisterAll(cluster));
  int64_t hier_bytes = 0, flat_bytes = 0;
  for (const auto& r : run.registered) hier_bytes += r.state_bytes();
  for (const auto& r : flat.registered) flat_bytes += r.state_bytes();
  EXPECT_EQ(hier_bytes, flat_bytes * (config.dp / S));
  EXPECT_OK(run.Deregister(cluster));
  EXPECT_OK(flat.Deregister(cluster));
}

INSTANTIATE_TEST_SUITE_P(
    Groups, HierarchicalTest,
    ::testing::Combine(::testing::Values(Layout{4, 1}, Layout{4, 2}),
                       ::testing::Values(1, 2),
                       ::testing::Values("start_anchored", "alpha", "cost"),
                       ::testing::Bool()),
    [](const auto& info) {
      const Layout& layout = std::get<0>(info.param);
      return absl::StrCat("dp", std::get<0>(layout), "tp", std::get<1>(layout),
                          "_s", std::get<1>(info.param), "_",
                          std::get<2>(info.param),
                          std::get<3>(info.param) ? "_overlap" : "_plain");
    });

// ---------------------------------------------------------------------------
// Bad input: a clear status naming the field, no state change.

v1::GradReadyRequest GradReady(const TrainerRank& rank, int64_t step,
                               std::vector<int> buckets) {
  v1::GradReadyRequest r;
  r.set_job_id(rank.config().job_id);
  *r.mutable_rank() = rank.MakeStep(step).rank();
  r.set_step(step);
  for (int b : buckets) r.add_buckets(b);
  return r;
}

v1::WaitParamsRequest WaitParams(const TrainerRank& rank, int64_t step,
                                 int bucket) {
  v1::WaitParamsRequest r;
  r.set_job_id(rank.config().job_id);
  *r.mutable_rank() = rank.MakeStep(step).rank();
  r.set_step(step);
  r.set_bucket(bucket);
  return r;
}

TEST(OverlapErrorsTest, BadEventsAreRejectedWithoutChangingState) {
  const JobConfig config = Config("overlap-bad", 2, 1, "cost", 0);
  Cluster cluster;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 2));
  TrainerRank& r0 = *run.ranks()[0];
  Engine& engine = *cluster.engines[r0.engine_index()];
  const int buckets = run.registered[0].buckets_size();
  auto grad_ready = [&](const v1::GradReadyRequest& request) {
    Result<v1::GradReadyResponse> done;
    engine.GradReady(request, done.callback());
    return done.Get().status();
  };
  auto wait_params = [&](const v1::WaitParamsRequest& request) {
    Result<v1::WaitParamsResponse> done;
    engine.WaitParams(request, done.callback());
    return done.Get().status();
  };
  EXPECT_THAT(
      grad_ready(GradReady(r0, 3, {0, buckets})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("buckets[1]")));
  EXPECT_THAT(
      grad_ready(GradReady(r0, 3, {-1})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("buckets[0]")));
  EXPECT_THAT(grad_ready(GradReady(r0, 2, {0})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("next step, 3")));
  EXPECT_THAT(grad_ready(GradReady(r0, 5, {0})),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(wait_params(WaitParams(r0, 3, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("the last is 2")));
  EXPECT_THAT(
      wait_params(WaitParams(r0, 2, buckets)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket")));
  EXPECT_THAT(wait_params(WaitParams(r0, 2, -2)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  v1::WaitParamsRequest unknown = WaitParams(r0, 2, 0);
  unknown.set_job_id("no-such-job");
  EXPECT_THAT(wait_params(unknown), StatusIs(absl::StatusCode::kNotFound));
  // Done steps answer at once.
  EXPECT_OK(wait_params(WaitParams(r0, 1, -1)));
  EXPECT_OK(wait_params(WaitParams(r0, 2, 0)));
  // Nothing changed: the job steps on, equal to the reference.
  ASSERT_OK(run.RunStepsOverlapped(cluster, 3, 4, false, 1));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 4, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
}

TEST(OverlapErrorsTest, BadShardGroupSizeIsInvalidArgument) {
  Cluster cluster;
  for (const auto& [S, strategy, what] :
       std::vector<std::tuple<int, std::string, std::string>>{
           {3, "cost", "must divide dp 4"},
           {-1, "cost", "must divide dp 4"},
           {8, "cost", "must divide dp 4"},
           {2, "sc", "bucket-sliced"},
           {2, "layerwise", "bucket-sliced"}}) {
    JobRun run(Config("hier-bad", 4, 1, strategy, S));
    ASSERT_OK(run.Init());
    Result<v1::RegisterResponse> done;
    cluster.engines[0]->Register(run.ranks()[0]->MakeRegister(), PeerInfo{},
                                 done.callback());
    const absl::StatusOr<v1::RegisterResponse> got = done.Get();
    EXPECT_THAT(got, StatusIs(absl::StatusCode::kInvalidArgument,
                              HasSubstr("shard_group_size")))
        << "S = " << S << " " << strategy;
    EXPECT_THAT(got,
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
  }
  EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0);
}

// A rank that leaves right after its last step (here: while its own
// all-gathers are still queued) must not cut off its peers' last
// collective: Deregister lets the rank's communicators linger, so the
// peer's parameters still arrive, equal to the reference.
TEST(OverlapErrorsTest, PeersFinishTheLastStepWhenARankLeavesAtOnce) {
  // DP4: ranks 0 and 1 share engine 0, so rank 1's leaving also fails
  // the job on the daemon rank 0 asks.
  const JobConfig config = Config("overlap-leave", 4, 1, "cost", 0);
  Cluster cluster;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 2));
  for (int round = 0; round < 3; ++round) {
    const int k = 3 + round;
    std::vector<Result<v1::StepResponse>> steps(config.world());
    for (auto& rank : run.ranks()) {
      rank->WriteGrads(k);
      v1::StepRequest step = rank->MakeStep(k);
      step.set_async_params(true);
      cluster.engines[rank->engine_index()]->Step(
          step, steps[rank->global()].callback());
    }
    for (auto& s : steps) ASSERT_OK(s.Get().status());
    if (round < 2) {
      for (auto& rank : run.ranks()) {
        Result<v1::WaitParamsResponse> waited;
        cluster.engines[rank->engine_index()]->WaitParams(
            WaitParams(*rank, k, -1), waited.callback());
        ASSERT_OK(waited.Get().status());
      }
      continue;
    }
    // Last step: rank 1 leaves at once, rank 0 waits for its parameters.
    ASSERT_EQ(run.ranks()[1]->engine_index(), run.ranks()[0]->engine_index());
    TrainerRank& r1 = *run.ranks()[1];
    v1::DeregisterRequest leave;
    leave.set_job_id(config.job_id);
    leave.set_job_token(config.token);
    *leave.mutable_rank() = r1.MakeStep(k).rank();
    ASSERT_OK(cluster.engines[r1.engine_index()]->Deregister(leave));
    TrainerRank& r0 = *run.ranks()[0];
    Result<v1::WaitParamsResponse> waited;
    cluster.engines[r0.engine_index()]->WaitParams(WaitParams(r0, k, -1),
                                                   waited.callback());
    ASSERT_OK(waited.Get().status());
  }
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 5, {}));
  const std::vector<float> want = run.ranks()[0]->Shard(
      config.params[0], reference.at(config.params[0].name));
  EXPECT_EQ(run.ranks()[0]->ParamBuffer(0), want);
  for (size_t i = 0; i < config.params.size(); ++i) {
    EXPECT_EQ(run.ranks()[0]->ParamBuffer(static_cast<int>(i)),
              run.ranks()[0]->Shard(config.params[i],
                                    reference.at(config.params[i].name)))
        << config.params[i].name;
  }
}

// A failed job wakes a WaitParams that waits on it.
TEST(OverlapErrorsTest, WaitParamsEndsWhenTheJobFails) {
  Cluster cluster(absl::Seconds(2));
  JobRun run(Config("overlap-fail", 2, 1, "cost", 0));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  // Only rank 0 steps (async): its all-gathers never complete.
  TrainerRank& r0 = *run.ranks()[0];
  Engine& engine = *cluster.engines[r0.engine_index()];
  r0.WriteGrads(1);
  v1::StepRequest step = r0.MakeStep(1);
  step.set_async_params(true);
  Result<v1::StepResponse> stepped;
  engine.Step(step, stepped.callback());
  Result<v1::WaitParamsResponse> waited;
  engine.WaitParams(WaitParams(r0, 1, -1), waited.callback());
  EXPECT_FALSE(stepped.Get().ok());
  EXPECT_FALSE(waited.Get().ok());
}

}  // namespace
}  // namespace canzona::engine_test
