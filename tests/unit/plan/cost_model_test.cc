#include "server/plan/cost_model.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::plan {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

TEST(CostModelTest, MuonFlopsFollowDesign) {
  CostModel model;
  // 8 x 32: s = 8, l = 32, 5 steps of 2 s^2 l + 2 s^3 + 2 s^2 l.
  const ParamWork w = model.Work(OptimizerKind::kMuon, {8, 32});
  EXPECT_DOUBLE_EQ(w.flops, 5 * (2.0 * 64 * 32 + 2.0 * 512 + 2.0 * 64 * 32));
  // Transposition does not matter.
  EXPECT_DOUBLE_EQ(model.Work(OptimizerKind::kMuon, {32, 8}).flops, w.flops);
  EXPECT_FALSE(model.calibrated());
  EXPECT_DOUBLE_EQ(model.Objective(w), w.flops);
}

TEST(CostModelTest, MuonCostFollowsTheChosenNewtonSchulzAlgorithm) {
  // Qwen3-32B's MLP matrix: auto picks gram, whose cost (TF32 s x s products
  // counted twice on the nominal cuda rates) is under 0.9x the standard's.
  CostModel model;
  const std::vector<int64_t> mlp = {25600, 5120};
  const ParamWork w = model.Work(OptimizerKind::kMuon, mlp);
  EXPECT_EQ(w.ns_algorithm, NsAlgorithm::kGram);
  EXPECT_DOUBLE_EQ(w.gemm_flops, GramNsCost(25600, 5120, 5, 2.0));
  const double standard = StandardNsFlops(25600, 5120, 5);
  EXPECT_LT(w.gemm_flops, 0.9 * standard);
  EXPECT_EQ(model.Work(OptimizerKind::kMuon, {5120, 25600}).ns_algorithm,
            NsAlgorithm::kGram);
  // A cpu rates file: fp32 everywhere, about 0.6x the standard's flops.
  auto cpu = ParseRates(nlohmann::json{{"backend", "cpu"},
                                       {"gemm_gflops", 100.0},
                                       {"ns_gflops", 50.0},
                                       {"eigh_gflops", 10.0},
                                       {"adamw_gbps", 20.0}});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const ParamWork c = CostModel(CostModelOptions{}, *cpu).Work(
      OptimizerKind::kMuon, mlp);
  EXPECT_EQ(c.ns_algorithm, NsAlgorithm::kGram);
  EXPECT_DOUBLE_EQ(c.gemm_flops, GramNsCost(25600, 5120, 5, 1.0));
  EXPECT_NEAR(c.gemm_flops / standard, 68.0 / 110.0, 1e-12);
  EXPECT_DOUBLE_EQ(c.seconds, c.gemm_flops / 50e9 + 24.0 * 25600 * 5120 / 20e9);
  // Square and small matrices keep the standard iteration.
  EXPECT_EQ(model.Work(OptimizerKind::kMuon, {5120, 5120}).ns_algorithm,
            NsAlgorithm::kStandard);
  EXPECT_EQ(model.Work(OptimizerKind::kMuon, {1024, 8192}).ns_algorithm,
            NsAlgorithm::kStandard);
  // ns_algorithm=standard: the standard flops whatever the shape.
  CostModelOptions options;
  options.muon_ns_algorithm = NsAlgorithm::kStandard;
  const ParamWork s = CostModel(options, std::nullopt).Work(
      OptimizerKind::kMuon, mlp);
  EXPECT_EQ(s.ns_algorithm, NsAlgorithm::kStandard);
  EXPECT_DOUBLE_EQ(s.gemm_flops, standard);
}

TEST(CostModelTest, AdamWIsTenPerElement) {
  CostModel model;
  EXPECT_DOUBLE_EQ(model.Work(OptimizerKind::kAdamW, {100, 3}).flops, 3000);
  EXPECT_DOUBLE_EQ(model.StateBytes(OptimizerKind::kAdamW, {10}, DType::kFloat32), 80);
  EXPECT_DOUBLE_EQ(model.StateBytes(OptimizerKind::kAdamW, {10}, DType::kBFloat16), 120);
}

TEST(CostModelTest, CalibratedRatesGiveSeconds) {
  auto rates = ParseRates(nlohmann::json{{"backend", "cpu"},
                                         {"gemm_gflops", 100.0},
                                         {"ns_gflops", 50.0},
                                         {"eigh_gflops", 10.0},
                                         {"adamw_gbps", 20.0}});
  ASSERT_TRUE(rates.ok()) << rates.status();
  CostModel model(CostModelOptions{}, *rates);
  EXPECT_TRUE(model.calibrated());
  const ParamWork w = model.Work(OptimizerKind::kAdamW, {1000});
  EXPECT_DOUBLE_EQ(w.seconds, 28000 / 20e9);
  EXPECT_DOUBLE_EQ(model.Objective(w), w.seconds);
  const ParamWork m = model.Work(OptimizerKind::kMuon, {64, 64});
  EXPECT_DOUBLE_EQ(m.seconds, m.gemm_flops / 50e9 + 24 * 4096 / 20e9);
}

TEST(CostModelTest, BadRatesNameTheKey) {
  EXPECT_THAT(ParseRates(nlohmann::json{{"gemm_gflops", 1.0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ns_gflops")));
  EXPECT_THAT(ParseRates(nlohmann::json{{"gemm_gflops", 1.0},
                                        {"ns_gflops", -1.0},
                                        {"eigh_gflops", 1.0},
                                        {"adamw_gbps", 1.0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ns_gflops")));
  EXPECT_THAT(LoadRatesFile("/nonexistent/rates.json"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rates")));
  EXPECT_THAT(ParseOptimizerKind("sgd"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sgd")));
}

TEST(CostModelTest, ShampooAndSoapArePositive) {
  CostModel model;
  EXPECT_GT(model.Work(OptimizerKind::kShampoo, {4096, 1024}).eigen_flops, 0);
  EXPECT_GT(model.Work(OptimizerKind::kSoap, {4096, 1024}).gemm_flops, 0);
  // SOAP skips sides above max_precond_dim.
  const ParamWork big = model.Work(OptimizerKind::kSoap, {151936, 16});
  EXPECT_DOUBLE_EQ(big.gemm_flops, 6.0 * 151936 * 16 * 16);
}

}  // namespace
}  // namespace canzona::plan
