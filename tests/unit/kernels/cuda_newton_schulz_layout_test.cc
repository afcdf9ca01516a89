// The cuda Newton-Schulz workspace, which needs no device: the bf16 standard
// iteration takes its symmetric products by tiles (kernels/symmetric_tiles.h)
// exactly where the short side splits, which shows as the nine pointer
// arrays in its workspace. Without this check a tile rule that stopped
// tiling would leave the GPU test comparing full products with themselves.
#include <algorithm>
#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/newton_schulz.h"
#include "kernels/symmetric_tiles.h"

namespace canzona::cuda_internal {
namespace {

NewtonSchulzSpec Spec(NsPrecision precision, bool symmetric) {
  NewtonSchulzSpec spec;
  spec.coefficients = {{3.4445f, -4.7750f, 2.0315f}};
  spec.precision = precision;
  spec.symmetric_products = symmetric;
  return spec;
}

// Bytes the tiled layout adds over full products for batch x rows x cols.
int64_t TileBytes(const NsContext& ctx, NsPrecision precision,
                  NsAlgorithm algorithm, int64_t batch, int64_t rows,
                  int64_t cols) {
  const auto bytes = [&](bool symmetric) {
    return static_cast<int64_t>(NewtonSchulzWorkspaceBytes(
        ctx, Spec(precision, symmetric), algorithm, batch, rows, cols));
  };
  return bytes(true) - bytes(false);
}

TEST(CudaNewtonSchulzLayoutTest, Bfloat16TilesTakeNinePointerArrays) {
  const NsContext ctx;
  constexpr auto kBf16 = NsPrecision::kBfloat16;
  constexpr auto kStandard = NsAlgorithm::kStandard;
  struct Case {
    int64_t batch, rows, cols, tiles;  // tiles: 0 where none
  };
  for (const Case& c : {Case{1, 4096, 4096, 10}, Case{1, 12288, 4096, 10},
                        Case{3, 2048, 6144, 3}, Case{2, 5120, 25600, 15},
                        Case{1, 1024, 3072, 0}, Case{4, 1024, 1024, 0},
                        Case{1, 2050, 4100, 0}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.batch << "x" << c.rows << "x" << c.cols);
    EXPECT_EQ(ChooseSymmetricTiles(std::min(c.rows, c.cols)).count(),
              c.tiles == 0 ? 1 : c.tiles);
    const int64_t want =
        c.tiles == 0
            ? 0
            : static_cast<int64_t>(WorkspaceRoundUp(
                  static_cast<size_t>(9 * c.batch * c.tiles) * sizeof(void*)));
    EXPECT_EQ(TileBytes(ctx, kBf16, kStandard, c.batch, c.rows, c.cols), want);
  }
}

TEST(CudaNewtonSchulzLayoutTest, OnlyBfloat16StandardStepsTakeTiles) {
  const NsContext ctx;
  // float32 runs SYRK, Gram has no such products, and the context can
  // refuse them (CANZONA_NS_SYMMETRIC=0).
  EXPECT_EQ(TileBytes(ctx, NsPrecision::kFloat32, NsAlgorithm::kStandard, 1,
                      4096, 4096),
            0);
  EXPECT_EQ(TileBytes(ctx, NsPrecision::kBfloat16, NsAlgorithm::kGram, 1, 4096,
                      12288),
            0);
  NsContext refusing;
  refusing.symmetric_products = false;
  EXPECT_EQ(TileBytes(refusing, NsPrecision::kBfloat16, NsAlgorithm::kStandard,
                      1, 4096, 4096),
            0);
}

}  // namespace
}  // namespace canzona::cuda_internal
