// kernels/symmetric_tiles.h: which tiles the symmetric products of a
// Newton-Schulz step take, and the operand offsets the cuda backend's bf16
// iteration hands cuBLAS, run here through column-major sgemm with the same
// transposes and leading dimensions, against float64 products.
#include "kernels/symmetric_tiles.h"

#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::RandomNormal;

TEST(SymmetricTilesTest, TilesAreWholeAlignedAndAtLeastTheMinimum) {
  struct Case {
    int64_t n, side, per_side;
  };
  for (const Case& c :
       {Case{1024, 1024, 1}, Case{1536, 1536, 1}, Case{2048, 1024, 2},
        Case{2050, 2050, 1}, Case{3072, 1024, 3}, Case{4096, 1024, 4},
        Case{5120, 1024, 5}, Case{6144, 1024, 6}, Case{8192, 1024, 8},
        Case{16384, 2048, 8}, Case{25600, 3200, 8}}) {
    const SymmetricTiles tiles = ChooseSymmetricTiles(c.n);
    EXPECT_EQ(tiles.side, c.side) << c.n;
    EXPECT_EQ(tiles.per_side, c.per_side) << c.n;
    EXPECT_EQ(tiles.tiled(), c.per_side > 1) << c.n;
  }
  EXPECT_EQ(ChooseSymmetricTiles(4096).count(), 10);
  EXPECT_DOUBLE_EQ(ChooseSymmetricTiles(4096).flop_fraction(), 0.625);
  EXPECT_DOUBLE_EQ(ChooseSymmetricTiles(1024).flop_fraction(), 1.0);
}

TEST(SymmetricTilesTest, EachLowerTileOnce) {
  for (int64_t k = 1; k <= kSymmetricMaxPerSide; ++k) {
    const SymmetricTiles tiles{64, k};
    std::set<std::pair<int64_t, int64_t>> seen;
    for (int64_t t = 0; t < tiles.count(); ++t) {
      int64_t r = -1, c = -1;
      SymmetricTileAt(t, &r, &c);
      EXPECT_GE(r, c) << "k " << k << " t " << t;
      EXPECT_GE(c, 0);
      EXPECT_LT(r, k);
      EXPECT_TRUE(seen.insert({r, c}).second) << "k " << k << " t " << t;
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), k * (k + 1) / 2);
  }
}

constexpr float kUnwritten = std::numeric_limits<float>::quiet_NaN();

// Column-major element (i, j) of an n x n buffer lies in a lower tile.
bool InLowerTile(int64_t i, int64_t j, int64_t side) {
  return i / side >= j / side;
}

// The strict upper tiles from the lower ones, column-major: what the cuda
// kernel's row-major upper-to-lower copy leaves there (it also rewrites the
// diagonal tiles' upper halves from their lower ones, which a tile product
// of X X^T or A A computes symmetric up to rounding anyway).
void Mirror(int64_t n, int64_t side, std::vector<float>& m) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      if (!InLowerTile(i, j, side)) m[i + j * n] = m[j + i * n];
    }
  }
}

// X X^T of X (n x l row-major, i.e. column-major X' l x n) by the tiles of
// GramTileOperands: only the lower tiles are written, and they hold the
// float64 product's values.
TEST(SymmetricTilesTest, GramTilesComputeTheLowerTilesOfXXt) {
  const int64_t side = 8, k = 3, n = side * k, l = 40;
  const std::vector<float> x = RandomNormal(n * l, 7);
  std::vector<float> a(n * n, kUnwritten);
  const SymmetricTiles tiles{side, k};
  for (int64_t t = 0; t < tiles.count(); ++t) {
    const TileOperands op = GramTileOperands(t, side, n, l);
    cblas_sgemm(CblasColMajor, CblasTrans, CblasNoTrans, side, side, l, 1.0f,
                x.data() + op.a, l, x.data() + op.b, l, 0.0f, a.data() + op.c,
                n);
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      const float got = a[i + j * n];
      if (!InLowerTile(i, j, side)) {
        EXPECT_TRUE(std::isnan(got)) << i << "," << j << " written";
        continue;
      }
      // Column-major A'(i, j) = sum_p X'(p, i) X'(p, j) = (X X^T)(i, j).
      double want = 0;
      for (int64_t p = 0; p < l; ++p) {
        want += static_cast<double>(x[i * l + p]) * x[j * l + p];
      }
      EXPECT_NEAR(got, want, 1e-4 * (1 + std::fabs(want))) << i << "," << j;
    }
  }
  Mirror(n, side, a);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(a[i + j * n], a[j + i * n]);
    }
  }
}

// B = a I + b A, then B += c A A by the tiles of SquareTileOperands (beta 1,
// as the step runs them), mirrored: the float64 a I + b A + c A A.
TEST(SymmetricTilesTest, SquareTilesAddCAaToTheLowerTiles) {
  const int64_t side = 16, k = 4, n = side * k;
  const float ca = 3.4445f, cb = -4.7750f, cc = 2.0315f;
  std::vector<float> sym = RandomNormal(n * n, 8);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < j; ++i) sym[i + j * n] = sym[j + i * n];
  }
  std::vector<float> b(n * n);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      b[i + j * n] = cb * sym[i + j * n] + (i == j ? ca : 0.0f);
    }
  }
  const std::vector<float> before = b;
  const SymmetricTiles tiles{side, k};
  for (int64_t t = 0; t < tiles.count(); ++t) {
    const TileOperands op = SquareTileOperands(t, side, n);
    cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, side, side, n, cc,
                sym.data() + op.a, n, sym.data() + op.b, n, 1.0f,
                b.data() + op.c, n);
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      if (!InLowerTile(i, j, side)) {
        EXPECT_EQ(b[i + j * n], before[i + j * n]) << i << "," << j;
      }
    }
  }
  Mirror(n, side, b);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      double aa = 0;
      for (int64_t p = 0; p < n; ++p) {
        aa += static_cast<double>(sym[i + p * n]) * sym[p + j * n];
      }
      const double want = (i == j ? ca : 0.0) +
                          static_cast<double>(cb) * sym[i + j * n] +
                          static_cast<double>(cc) * aa;
      EXPECT_NEAR(b[i + j * n], want, 1e-4 * (1 + std::fabs(want)))
          << i << "," << j;
    }
  }
}

}  // namespace
}  // namespace canzona
