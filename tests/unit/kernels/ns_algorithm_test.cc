// The shape rule of kernels/ns_algorithm.h: which Newton-Schulz iteration
// `auto` runs, and the flop counts it compares.
#include "kernels/ns_algorithm.h"

#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace canzona {
namespace {

TEST(NsAlgorithmTest, FlopCountsFollowTheFormulas) {
  // s = 4, l = 10, 5 steps.
  EXPECT_DOUBLE_EQ(StandardNsFlops(4, 10, 5), 5 * (4.0 * 16 * 10 + 2 * 64));
  EXPECT_DOUBLE_EQ(StandardNsFlops(10, 4, 5), StandardNsFlops(4, 10, 5));
  // Segments of 2, then 3 steps: each 4 s^2 l + (8 c - 6) s^3.
  EXPECT_DOUBLE_EQ(GramNsCost(4, 10, 5), 2 * 4.0 * 16 * 10 + (10 + 18) * 64);
  EXPECT_DOUBLE_EQ(GramNsCost(4, 10, 1), 4.0 * 16 * 10 + 2 * 64);
  EXPECT_DOUBLE_EQ(GramNsCost(4, 10, 2), 4.0 * 16 * 10 + 10 * 64);
  EXPECT_DOUBLE_EQ(GramNsCost(4, 10, 3), 2 * 4.0 * 16 * 10 + (10 + 2) * 64);
  EXPECT_DOUBLE_EQ(GramNsCost(4, 10, 5, 2.0),
                   2 * 4.0 * 16 * 10 + 2 * (10 + 18) * 64);
  EXPECT_DOUBLE_EQ(GramNsCost(4, 10, 0), 0.0);
}

TEST(NsAlgorithmTest, SegmentsRestartAfterTwoThenEveryThree) {
  EXPECT_EQ(GramSegmentEnd(0, 5), 2);
  EXPECT_EQ(GramSegmentEnd(2, 5), 5);
  EXPECT_EQ(GramSegmentEnd(0, 1), 1);
  EXPECT_EQ(GramSegmentEnd(2, 7), 5);
  EXPECT_EQ(GramSegmentEnd(5, 7), 7);
}

TEST(NsAlgorithmTest, GramCostsAboutHalfOnLongMatrices) {
  // Issue 31's H200 shape (an unrestarted Gram measured 2.16x NS5): with
  // the restart, 110 s^3 of standard against 68 s^3.
  const double ratio =
      StandardNsFlops(25600, 5120, 5) / GramNsCost(25600, 5120, 5);
  EXPECT_NEAR(ratio, 110.0 / 68.0, 1e-12);
}

TEST(NsAlgorithmTest, AutoPicksGramOnlyWhereItWins) {
  constexpr NsAlgorithm kAuto = NsAlgorithm::kAuto;
  // Long matrices with a side >= 2048: gram, both orientations.
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 25600, 5120, 5), NsAlgorithm::kGram);
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 5120, 25600, 5), NsAlgorithm::kGram);
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 12288, 4096, 5), NsAlgorithm::kGram);
  // 8192 x 5120 saves only 3%: under the margin.
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 8192, 5120, 5), NsAlgorithm::kStandard);
  // Square: gram costs more.
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 4096, 4096, 5), NsAlgorithm::kStandard);
  // 1024 rows: fewer flops but measured slower (small s x s products).
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 1024, 8192, 5), NsAlgorithm::kStandard);
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 2047, 20000, 5), NsAlgorithm::kStandard);
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 2048, 20000, 5), NsAlgorithm::kGram);
  // No steps: nothing to save.
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 25600, 5120, 0), NsAlgorithm::kStandard);
  // TF32 s x s products (cuda bf16) cost twice: 12288 x 4096 no longer pays.
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 12288, 4096, 5, 2.0),
            NsAlgorithm::kStandard);
  EXPECT_EQ(ResolveNsAlgorithm(kAuto, 25600, 5120, 5, 2.0), NsAlgorithm::kGram);
  // An explicit choice is kept whatever the shape.
  EXPECT_EQ(ResolveNsAlgorithm(NsAlgorithm::kGram, 8, 8, 5),
            NsAlgorithm::kGram);
  EXPECT_EQ(ResolveNsAlgorithm(NsAlgorithm::kStandard, 25600, 5120, 5),
            NsAlgorithm::kStandard);
}

TEST(NsAlgorithmTest, BackendsWeighTheirSmallProducts) {
  NewtonSchulzSpec spec;
  spec.coefficients.assign(5, {3.4445f, -4.7750f, 2.0315f});
  spec.algorithm = NsAlgorithm::kAuto;
  // fp32 on either backend: weight 1, gram on 12288 x 4096.
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCpu, 12288, 4096),
            NsAlgorithm::kGram);
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCuda, 12288, 4096),
            NsAlgorithm::kGram);
  spec.precision = NsPrecision::kBfloat16;
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCuda, 12288, 4096),
            NsAlgorithm::kStandard);
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCuda, 25600, 5120),
            NsAlgorithm::kGram);
  // The cpu has no small-GEMM penalty: gram wherever its flops win
  // (2560 x 512: 1.62x predicted, 1.55-1.77x measured), never where they
  // lose (512 x 512: 0.83x); cuda keeps the standard iteration below 2048.
  spec.precision = NsPrecision::kFloat32;
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCpu, 2560, 512),
            NsAlgorithm::kGram);
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCpu, 512, 2560),
            NsAlgorithm::kGram);
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCpu, 512, 512),
            NsAlgorithm::kStandard);
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCuda, 2560, 512),
            NsAlgorithm::kStandard);
  spec.algorithm = NsAlgorithm::kStandard;
  EXPECT_EQ(ResolvedNsAlgorithm(spec, BackendKind::kCpu, 2560, 512),
            NsAlgorithm::kStandard);
}

TEST(NsAlgorithmTest, Names) {
  EXPECT_STREQ(NsAlgorithmName(NsAlgorithm::kStandard), "standard");
  EXPECT_STREQ(NsAlgorithmName(NsAlgorithm::kGram), "gram");
  EXPECT_STREQ(NsAlgorithmName(NsAlgorithm::kAuto), "auto");
}

}  // namespace
}  // namespace canzona
