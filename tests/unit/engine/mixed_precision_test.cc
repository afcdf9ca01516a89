// Mixed precision through the Engine: bf16 / fp16 trainer buffers, fp32
// master weights in the daemon. On exact-sum gradients every strategy and
// DP x TP layout equals the single-process reference on fp32 masters,
// rounded once (bitwise in the dtype); a reference without masters (the
// parameters rounded after every step) is caught; random gradients stay
// within one ulp of the dtype; what the data plane cannot do is refused.
#include <map>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/dtype.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/single_threaded_blas.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::IsOk;
using ::canzona::testing::IsOkAndHolds;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kSteps = 5;

JobConfig MixedConfig(const std::string& stem, int dp, int tp,
                      const std::string& strategy, DType dtype, bool exact) {
  JobConfig c = MakeJobConfig(stem, dp, tp, strategy);
  c.dtype = dtype;
  c.exact = exact;
  c.seed = static_cast<uint64_t>(dp * 100 + tp * 10 + 7);
  return c;
}

using Layout = std::tuple<int, int>;  // dp, tp

class MixedPrecisionEquivalenceTest
    : public ::testing::TestWithParam<std::tuple<DType, Layout, std::string>> {
};

TEST_P(MixedPrecisionEquivalenceTest, BitwiseEqualToMasterWeightReference) {
  const auto& [dtype, layout, strategy] = GetParam();
  const auto [dp, tp] = layout;
  Cluster cluster;
  JobRun run(MixedConfig("mp", dp, tp, strategy, dtype, /*exact=*/true));
  ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                /*deregister=*/false));
  for (int g = 0; g < run.config().world(); ++g) {
    EXPECT_EQ(run.registered[g].plan_digest(), run.registered[0].plan_digest());
    const v1::StepResponse& last = run.responses[g].back();
    EXPECT_FALSE(last.skipped_nonfinite());
    EXPECT_GT(last.grad_norm(), 0);
    EXPECT_GT(last.update_rms(), 0);
  }
  // Without master weights (rounding after every step) the parameters
  // drift from the reference: the comparison must see it.
  ASSERT_OK_AND_ASSIGN(Params rounded, Reference(run.config(), kSteps, {}, "",
                                                 /*round_each_step=*/true));
  EXPECT_THAT(run.Compare(rounded, /*bitwise=*/true), Not(IsOk()));
  EXPECT_OK(run.Deregister(cluster));
}

std::string MixedName(
    const ::testing::TestParamInfo<MixedPrecisionEquivalenceTest::ParamType>&
        info) {
  const auto& [dtype, layout, strategy] = info.param;
  return absl::StrCat(DTypeName(dtype), "_dp", std::get<0>(layout), "tp",
                      std::get<1>(layout), "_", strategy);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MixedPrecisionEquivalenceTest,
    ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(Layout{1, 1}, Layout{2, 1},
                                         Layout{4, 1}, Layout{1, 2},
                                         Layout{2, 2}),
                       ::testing::Values("sc", "layerwise", "start_anchored",
                                         "alpha", "cost")),
    MixedName);

TEST(MixedPrecisionTest, RandomGradientsWithinOneUlpOfTheReference) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Cluster cluster;
    JobRun run(MixedConfig("mp-rnd", 2, 2, "cost", dtype, /*exact=*/false));
    // Tolerance 0 besides the one ulp Compare allows in mixed precision.
    EXPECT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/false,
                                  /*deregister=*/true, /*tolerance=*/0));
  }
}

// A trainer that changes its bf16 / fp16 parameters between steps
// (model.load_state_dict, a re-init) lists them in StepRequest
// reload_params: the daemon takes their values as the masters. Unlisted,
// the next step writes the older masters over them (what every step did
// before reload_params existed). An lr-0 step leaves the masters as they
// are, so what the trainer holds after it is what the masters were.
TEST(MixedPrecisionTest, ParametersTheTrainerChangedBecomeTheMasters) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Cluster cluster;
    JobRun run(MixedConfig("mp-reload", 2, 2, "cost", dtype, /*exact=*/true));
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    const int all =
        run.config().world() * static_cast<int>(run.config().params.size());
    EXPECT_THAT(StepAfterLoadingParams(cluster, run, 3, /*reload=*/false),
                IsOkAndHolds(0));
    EXPECT_THAT(StepAfterLoadingParams(cluster, run, 4, /*reload=*/true),
                IsOkAndHolds(all));
    // An index outside the rank's parameters is refused, naming it.
    TrainerRank& first = *run.ranks()[0];
    v1::StepRequest bad = first.MakeStep(5);
    bad.add_reload_params(static_cast<int>(run.config().params.size()));
    Result<v1::StepResponse> refused;
    cluster.engines[first.engine_index()]->Step(bad, refused.callback());
    EXPECT_THAT(refused.Get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("reload_params[0]")));
    EXPECT_OK(run.Deregister(cluster));
  }
}

// A trainer that writes into its parameters the values they hold already
// (the model's own checkpoint loaded after the optimizer's, an EMA swap
// swapped back, a clamp's untouched elements) lists them as changed, yet
// the masters keep their fp32 bits: only an element whose value no longer
// is its master's rounding takes the trainer's. Reloading every parameter
// at every step of 3..5 must give the uninterrupted run's masters bitwise;
// taking the trainer's rounded values instead drops the masters' low bits
// at each reload, which the comparison sees.
TEST(MixedPrecisionTest, ReloadedParametersThatRoundToTheirMastersKeepThem) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Cluster cluster;
    JobRun run(MixedConfig("mp-keep", 2, 2, "cost", dtype, /*exact=*/true));
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    const std::vector<ModelParam>& params = run.config().params;
    ASSERT_OK(run.RunSteps(cluster, 3, kSteps,
                           [&](const TrainerRank& rank, v1::StepRequest& r) {
                             ReloadEveryHeldParam(params, rank, r);
                           }));
    ASSERT_OK_AND_ASSIGN(Params ref, Reference(run.config(), kSteps, {}));
    EXPECT_OK(run.Compare(ref, /*bitwise=*/true));
    EXPECT_OK(run.Deregister(cluster));
  }
}

TEST(MixedPrecisionTest, BuffersSizedForAnotherDtypeAreRefusedNamingIt) {
  Cluster cluster;
  JobConfig config = MixedConfig("mp-size", 1, 1, "cost", DType::kBFloat16,
                                 /*exact=*/true);
  JobRun run(config);
  ASSERT_OK(run.Init());
  TrainerRank& rank = *run.ranks()[0];
  v1::RegisterRequest bad = rank.MakeRegister();
  // The trainer says fp32 over buffers holding bf16 elements.
  bad.mutable_parameters(2)->set_dtype(v1::DTYPE_FLOAT32);
  Result<v1::RegisterResponse> refused;
  cluster.engines[0]->Register(bad, PeerInfo{}, refused.callback());
  EXPECT_THAT(refused.Get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                      AllOf(HasSubstr("parameters[2]"),
                                            HasSubstr("dtype fp32"))));
  bad = rank.MakeRegister();
  bad.mutable_parameters(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  Result<v1::RegisterResponse> unspecified;
  cluster.engines[0]->Register(bad, PeerInfo{}, unspecified.callback());
  EXPECT_THAT(unspecified.Get(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("parameters[0]"), HasSubstr(".dtype"))));
  // Nothing changed: the same rank registers and steps as it should.
  EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0);
  ASSERT_OK(run.RunAll(cluster, 2));
  ASSERT_OK_AND_ASSIGN(Params ref, Reference(run.config(), 2, {}));
  EXPECT_OK(run.Compare(ref, /*bitwise=*/true));
}

TEST(MixedPrecisionTest, TheNcclDataPlaneRefusesBf16NamingTheDtype) {
  FakeNcclApi::Options options;
  options.simulate_data = true;
  FakeNcclApi nccl(options);
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr, &nccl);
  JobRun run(MixedConfig("mp-nccl", 1, 1, "cost", DType::kBFloat16,
                         /*exact=*/true));
  ASSERT_OK(run.Init());
  EXPECT_THAT(run.RegisterAll(cluster),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("dtype"), HasSubstr("--comm gloo"))));
}

}  // namespace
}  // namespace canzona::engine_test
