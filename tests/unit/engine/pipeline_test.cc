// Pipeline parallelism end to end: PP2 and PP4 jobs (every stage its own
// parameter list and plan, on two daemons) train bitwise like the
// single-process reference, with the gradient norm and clipping taken over
// every stage.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

constexpr int kSteps = 4;

// MegatronModel (or MuonModel) cut into `pp` stages in order: the
// embedding with the first, the final norm and output layer with the last.
std::vector<ModelParam> Staged(int pp, bool muon_only = false) {
  std::vector<ModelParam> model = muon_only ? MuonModel() : MegatronModel();
  const int count = static_cast<int>(model.size());
  for (int i = 0; i < count; ++i) model[i].stage = i * pp / count;
  return model;
}

class PipelineTest
    : public ::testing::TestWithParam<std::tuple<int, int, int, bool>> {};

TEST_P(PipelineTest, EqualsTheSingleProcessReference) {
  const auto [pp, dp, tp, clip] = GetParam();
  Cluster cluster;
  // With clipping, Muon and AdamW: the factor comes from a float world sum
  // (the reference's is double), and SOAP's eigenbases of a few steps'
  // gradients turn with its last bits (its single-stage tests compare it
  // bitwise without clipping, as the cases without clipping here do).
  JobConfig config =
      MakeJobConfig("pipe", dp, tp, "cost", Staged(pp, /*muon_only=*/clip));
  config.pp = pp;
  config.layout_free_grads = false;
  // Clip hard enough that every step clips (the norm spans every stage).
  if (clip) {
    config.exact = false;
    config.max_grad_norm = 0.5 * ReferenceGradNorm(config, 1);
  }
  JobRun run(config);
  // The clip factor comes from the float world sum of the stages' squared
  // norms (the reference sums in double): within 1e-5 then, as the
  // single-stage clipping tests; bitwise without clipping.
  ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/!clip,
                                /*deregister=*/false, 1e-5f));
  // Every rank of every stage reports the job-wide norm and clips by it.
  for (int s = 1; s <= kSteps; ++s) {
    const double norm = ReferenceGradNorm(config, s);
    const double factor =
        clip ? std::min(1.0, config.max_grad_norm / (norm + 1e-6)) : 1.0;
    for (const auto& rank : run.responses) {
      EXPECT_NEAR(rank[s - 1].grad_norm(), norm, 1e-5 * norm) << "step " << s;
      EXPECT_NEAR(rank[s - 1].clip_factor(), factor, 1e-5 * factor)
          << "step " << s;
    }
  }
  if (clip) EXPECT_LT(run.responses[0][0].clip_factor(), 1.0);
  ASSERT_OK(run.Deregister(cluster));
}

INSTANTIATE_TEST_SUITE_P(Layouts, PipelineTest,
                         ::testing::Values(std::make_tuple(2, 1, 1, false),
                                           std::make_tuple(2, 2, 1, false),
                                           std::make_tuple(2, 2, 2, false),
                                           std::make_tuple(4, 1, 1, false),
                                           std::make_tuple(2, 2, 1, true),
                                           std::make_tuple(2, 1, 2, true),
                                           std::make_tuple(4, 1, 1, true)),
                         [](const auto& info) {
                           return absl::StrCat(
                               "pp", std::get<0>(info.param), "_dp",
                               std::get<1>(info.param), "_tp",
                               std::get<2>(info.param),
                               std::get<3>(info.param) ? "_clip" : "");
                         });

TEST(PipelineTest, WithoutTheOtherStagesNormTheClipDiffers) {
  // Negative control: a reference that clips each stage by its own norm.
  JobConfig config =
      MakeJobConfig("pipe-control", 1, 1, "cost", Staged(2, true));
  config.pp = 2;
  config.exact = false;
  config.max_grad_norm = 0.5 * ReferenceGradNorm(config, 1);
  Cluster cluster;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 2));
  JobConfig first_stage = config;
  first_stage.pp = 1;
  first_stage.params.clear();
  for (const ModelParam& p : config.params) {
    if (p.stage == 0) first_stage.params.push_back(p);
  }
  ASSERT_OK_AND_ASSIGN(Params alone, Reference(first_stage, 2, {}));
  ASSERT_OK_AND_ASSIGN(Params whole, Reference(config, 2, {}));
  // The run matches the job-wide clip, not the stage's own.
  const Params got = run.GatherParams();
  double own = 0, job_wide = 0;
  for (const auto& [name, values] : alone) {
    for (size_t e = 0; e < values.size(); ++e) {
      own = std::max(own, double{std::fabs(got.at(name)[e] - values[e])});
      job_wide = std::max(
          job_wide, double{std::fabs(got.at(name)[e] - whole.at(name)[e])});
    }
  }
  EXPECT_LT(job_wide, 1e-6);
  EXPECT_GT(own, 100 * job_wide + 1e-6);
  ASSERT_OK(run.Deregister(cluster));
}

}  // namespace
}  // namespace canzona::engine_test
