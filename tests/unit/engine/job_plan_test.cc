// The job plan alone: the canonical parameter line and the plan built
// from the stages' lists.
#include "server/engine/job_plan.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(JobPlanTest, CanonicalLineRoundTripsWithTheLocalShape) {
  v1::Parameter p;
  p.set_name("decoder.layers.0.mlp.linear_fc2.weight");
  p.add_shape(64);
  p.add_shape(128);
  p.set_tp_split_dim(1);
  p.set_group("muon");
  const std::string line = CanonicalParam(p);
  EXPECT_EQ(line, "decoder.layers.0.mlp.linear_fc2.weight|64,128|1|muon");
  ASSERT_OK_AND_ASSIGN(ParamMeta m, ParseParamLine(line, /*stage=*/1, 4));
  EXPECT_EQ(m.name, p.name());
  EXPECT_THAT(m.shape, ElementsAre(64, 128));
  EXPECT_THAT(m.local_shape, ElementsAre(64, 32));
  EXPECT_EQ(m.split, 1);
  EXPECT_EQ(m.stage, 1);
  EXPECT_EQ(m.numel, 64 * 128);
  EXPECT_EQ(m.fragment_numel, 64 * 32);
  ASSERT_OK_AND_ASSIGN(ParamMeta v, ParseParamLine("norm|64|-1|adamw", 0, 4));
  EXPECT_EQ(v.fragment_numel, 64);
}

// Mixed precision: the line carries a bf16 / fp16 dtype (all ranks agree on
// it with the rest of the line); fp32 lines stay as before (plan digests
// of fp32 jobs unchanged); the planner counts the dtype's bytes.
TEST(JobPlanTest, DtypeTravelsInTheLineAndThePlanCountsIt) {
  v1::Parameter p;
  p.set_name("w");
  p.add_shape(64);
  p.add_shape(32);
  p.set_tp_split_dim(-1);
  p.set_group("muon");
  p.set_dtype(v1::DTYPE_FLOAT32);
  EXPECT_EQ(CanonicalParam(p), "w|64,32|-1|muon");
  p.set_dtype(v1::DTYPE_BFLOAT16);
  EXPECT_EQ(CanonicalParam(p), "w|64,32|-1|muon|bf16");
  ASSERT_OK_AND_ASSIGN(ParamMeta m, ParseParamLine(CanonicalParam(p), 0, 1));
  EXPECT_EQ(m.dtype, DType::kBFloat16);
  p.set_dtype(v1::DTYPE_FLOAT16);
  ASSERT_OK_AND_ASSIGN(m, ParseParamLine(CanonicalParam(p), 0, 1));
  EXPECT_EQ(m.dtype, DType::kFloat16);

  JobConfig config = MakeJobConfig("plan-dtype", 2, 1, "cost");
  ASSERT_OK_AND_ASSIGN(RankSpec fp32, SpecOf(config, 0));
  config.dtype = DType::kBFloat16;
  ASSERT_OK_AND_ASSIGN(RankSpec bf16, SpecOf(config, 0));
  EXPECT_NE(fp32.plist, bf16.plist);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> a,
                       BuildJobPlan(fp32.settings, {fp32.plist}));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> b,
                       BuildJobPlan(bf16.settings, {bf16.plist}));
  // fp32 master weights on top of the state: more memory per rank; half
  // the bytes per element on the DP links.
  EXPECT_GT(b->plan.memory_max_bytes, a->plan.memory_max_bytes);
  for (const ParamMeta& meta : b->params) {
    EXPECT_EQ(meta.dtype, DType::kBFloat16) << meta.name;
  }
}

TEST(JobPlanTest, MalformedLinesAreInternalErrors) {
  for (const char* line :
       {"a|1,2|0", "a|1,x|0|g", "a|4|z|g", "", "a|4|-1|g|fp8"}) {
    EXPECT_THAT(ParseParamLine(line, 0, 1),
                StatusIs(absl::StatusCode::kInternal))
        << line;
  }
}

TEST(JobPlanTest, BuildsThePlanFromTheStagesLists) {
  const JobConfig config = MakeJobConfig("plan", /*dp=*/2, /*tp=*/2, "cost");
  ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, 0));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> jp,
                       BuildJobPlan(spec.settings, {spec.plist}));
  ASSERT_EQ(jp->params.size(), config.params.size());
  EXPECT_THAT(jp->stage_first, ElementsAre(0));
  int64_t total = 0;
  for (size_t i = 0; i < config.params.size(); ++i) {
    EXPECT_EQ(jp->params[i].name, config.params[i].name);
    total += jp->params[i].numel;
  }
  EXPECT_EQ(jp->total_numel, total);
  EXPECT_EQ(jp->plan.dp_owner.size(), config.params.size());
  EXPECT_FALSE(jp->plan.digest.empty());
  // Deterministic: the same inputs give the same plan on every daemon.
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> again,
                       BuildJobPlan(spec.settings, {spec.plist}));
  EXPECT_EQ(again->plan.digest, jp->plan.digest);
  // Two stages: indices continue, stage_first marks the second.
  JobSettings two = spec.settings;
  two.layout.set_pp(2);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> staged,
                       BuildJobPlan(two, {spec.plist, "extra|64,64|-1|muon"}));
  EXPECT_THAT(staged->stage_first, ElementsAre(0, config.params.size()));
  EXPECT_EQ(staged->params.back().stage, 1);
}

TEST(JobPlanTest, UnknownGroupAndPlannerRejection) {
  const JobConfig config = MakeJobConfig("plan", 1, 2, "cost");
  ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, 0));
  EXPECT_THAT(BuildJobPlan(spec.settings, {"w|64,64|0|nope"}),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("'nope'")));
  // TP 2 cannot split 63 rows: the planner refuses the job.
  EXPECT_THAT(
      BuildJobPlan(spec.settings, {"w|63,64|0|muon"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("planner: ")));
}

}  // namespace
}  // namespace canzona::engine_test
