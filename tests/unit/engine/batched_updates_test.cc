// Batched DP-owned updates (update_batches.h): same-shape Muon matrices (MoE
// experts) step in one batched Newton-Schulz, and one group's AdamW tensors
// in one AdamWStepMany, bitwise equal to one update per matrix on the cpu
// backend, single process or distributed.
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "server/engine/rank_layout.h"
#include "server/engine/update_batches.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

using ::testing::SizeIs;

constexpr int kSteps = 4;

TEST(BatchLocalUpdatesTest, ExpertsOfOneShapeShareABatch) {
  JobConfig config = MakeJobConfig("batches", 1, 1, "cost", MoeModel(6, 2));
  ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, 0));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> jp,
                       BuildJobPlan(spec.settings, {spec.plist}));
  ASSERT_OK_AND_ASSIGN(RankLayout layout,
                       LayoutRank(*jp, spec.settings, spec.coords));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu,
                       CreateBackend(BackendKind::kCpu));
  std::map<int, std::unique_ptr<UpdateRule>> rules;
  for (int i : layout.stage_params) {
    const ParamMeta& m = jp->params[i];
    ASSERT_OK_AND_ASSIGN(
        rules[i], UpdateRule::Create(spec.settings.configs.at(m.group), m.shape,
                                     cpu.get()));
  }
  OwnedBuffers owned;
  owned.param_at.assign(jp->params.size(), nullptr);
  owned.grad_at.assign(jp->params.size(), nullptr);

  const std::vector<UpdateBatch> batched =
      BatchDpOwnedUpdates(*jp, layout, rules, owned, {});
  // Per layer: one batch of 6 fc1, one of 6 fc2 ... and the two layers'
  // experts of one shape join (same group and shape): 12 + 12. The AdamW
  // tensors (embedding, norms) of one group share one batch whatever their
  // shapes (one AdamWStepMany).
  std::map<std::vector<int64_t>, size_t> largest;
  std::set<int> seen;
  int adamw_tensors = 0;
  for (int i : layout.stage_params) {
    adamw_tensors += jp->params[i].group == "adamw" ? 1 : 0;
  }
  ASSERT_GE(adamw_tensors, 2);
  int adamw_batches = 0;
  for (const UpdateBatch& b : batched) {
    const ParamMeta& first = jp->params[b.params[0]];
    const bool adamw = first.group == "adamw";
    if (adamw) {
      ++adamw_batches;
      EXPECT_THAT(b.params, SizeIs(adamw_tensors));
      EXPECT_EQ(b.rules[0]->config().kind, OptimizerKind::kAdamW);
    } else {
      largest[first.shape] = std::max(largest[first.shape], b.params.size());
    }
    for (int i : b.params) {
      EXPECT_TRUE(seen.insert(i).second) << "twice: " << i;
      if (!adamw) EXPECT_EQ(jp->params[i].shape, first.shape);
      // linear_qkv [128, 64] (muon) and the embedding [128, 64] (adamw)
      // do not mix.
      EXPECT_EQ(jp->params[i].group, first.group);
    }
  }
  EXPECT_EQ(adamw_batches, 1);
  EXPECT_EQ(seen.size(), layout.stage_params.size());
  EXPECT_EQ(largest[(std::vector<int64_t>{64, 32})], 12u);
  // Disabled: one update per tensor.
  for (const UpdateBatch& b :
       BatchDpOwnedUpdates(*jp, layout, rules, owned, {.enabled = false})) {
    EXPECT_THAT(b.params, SizeIs(1));
  }
  // Capped at one expert's worth: one update per matrix; the small AdamW
  // tensors still share batches within the cap, the embedding alone.
  const int64_t cap = 64 * 32;
  for (const UpdateBatch& b :
       BatchDpOwnedUpdates(*jp, layout, rules, owned, {.max_elements = cap})) {
    if (b.rules[0]->config().kind == OptimizerKind::kAdamW) {
      EXPECT_TRUE(b.params.size() == 1 || b.elements <= cap) << b.elements;
    } else {
      EXPECT_THAT(b.params, SizeIs(1));
    }
  }
}

class BatchedEqualsPerMatrixTest
    : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(BatchedEqualsPerMatrixTest, BitwiseAgainstTheReference) {
  const auto [dp, tp] = GetParam();
  Params results[2];
  int64_t buffers[2] = {0, 0};
  for (bool batch : {false, true}) {
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr,
                    nullptr, batch);
    JobRun run(MakeJobConfig("moe", dp, tp, "cost", MoeModel(8)));
    // The single-process reference updates one matrix at a time.
    ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                  /*deregister=*/false))
        << "batch " << batch;
    results[batch] = run.GatherParams();
    for (const auto& r : run.registered) buffers[batch] += r.buffer_bytes();
    // The update RMS counts every member of a batch too.
    for (const auto& rank : run.responses) {
      EXPECT_GT(rank.back().update_rms(), 0);
    }
    ASSERT_OK(run.Deregister(cluster));
  }
  EXPECT_EQ(results[0], results[1]);
  // Batching keeps no old values (Muon queues its update's size as it
  // applies it): at most the batched Newton-Schulz workspace is more.
  EXPECT_GE(buffers[1], buffers[0]);
}

INSTANTIATE_TEST_SUITE_P(Layouts, BatchedEqualsPerMatrixTest,
                         ::testing::Values(std::make_pair(1, 1),
                                           std::make_pair(2, 1),
                                           std::make_pair(2, 2)),
                         [](const auto& info) {
                           return "dp" + std::to_string(info.param.first) +
                                  "_tp" + std::to_string(info.param.second);
                         });

}  // namespace
}  // namespace canzona::engine_test
