// The symmetric products of a Newton-Schulz step, one triangle of tiles at a
// time. A = X X^T and A A are symmetric, so only the tiles on and below the
// diagonal need computing: with k tiles per side that is k (k + 1) / 2 of
// k^2 tile products, (k + 1) / 2k of the flops (0.625 at k = 4), and the
// strict upper tiles are then copied from the lower ones (an n^2 pass).
// cuBLAS has no bf16 SYRK, so the cuda backend's bf16 iteration computes the
// tiles as one pointer-array batched GEMM (kernels/cuda/newton_schulz.cc);
// the offsets below are what it hands cuBLAS, and the cpu tests run the same
// offsets through column-major sgemm (tests/unit/kernels/
// symmetric_tiles_test.cc), so both read one definition.
//
// Conventions (cuBLAS's column-major view of the row-major buffers, as in
// newton_schulz.cc): X is the short side n by the long side l, row-major,
// i.e. column-major X' (l x n, leading dimension l); A and B are n x n,
// leading dimension n. Tile (r, c) with r >= c covers rows [r t, r t + t)
// and columns [c t, c t + t) of the column-major result, t the tile side.
//
//   X X^T, tile (r, c):  C = X'_r^T X'_c     GEMM (T, N), m = n = t, k = l,
//                        lda = ldb = l, ldc = n
//   A A,   tile (r, c):  C += alpha A'_{r,:} A'_{:,c}
//                                            GEMM (N, N), m = n = t, k = n,
//                                            lda = ldb = ldc = n
//
// Header-only and dependency-free, host and device (nvcc compiles the
// pointer kernel from it).
//
// Thread-safety: pure functions.
#ifndef CANZONA_KERNELS_SYMMETRIC_TILES_H_
#define CANZONA_KERNELS_SYMMETRIC_TILES_H_

#include <cstdint>

#if defined(__CUDACC__)
#define CANZONA_HOST_DEVICE __host__ __device__
#else
#define CANZONA_HOST_DEVICE
#endif

namespace canzona {

// Smallest tile side worth it: issue 31's H200 measurements had symmetric
// GEMM kernels losing below ~2048 rows, where small products run slowly, so
// the first split is of a 2048 side into two 1024 tiles.
inline constexpr int64_t kSymmetricMinTile = 1024;
// Tiles stay multiples of this (tensor-core-friendly offsets and sizes).
inline constexpr int64_t kSymmetricTileAlign = 64;
// More tiles save little more ((k + 1) / 2k tends to 1/2) and run smaller.
inline constexpr int64_t kSymmetricMaxPerSide = 8;

struct SymmetricTiles {
  int64_t side = 0;      // t
  int64_t per_side = 1;  // k; 1: no tiling, the full product
  bool tiled() const { return per_side > 1; }
  int64_t count() const { return per_side * (per_side + 1) / 2; }
  // Flops of the tiles over the full product's.
  double flop_fraction() const {
    return static_cast<double>(per_side + 1) / (2.0 * per_side);
  }
};

// The most tiles per side for an n x n symmetric product such that each
// tile is a whole, aligned kSymmetricMinTile or more; per_side 1 where n
// splits no such way.
inline SymmetricTiles ChooseSymmetricTiles(int64_t n) {
  for (int64_t k = kSymmetricMaxPerSide; k >= 2; --k) {
    if (n % k != 0) continue;
    const int64_t t = n / k;
    if (t >= kSymmetricMinTile && t % kSymmetricTileAlign == 0) {
      return {t, k};
    }
  }
  return {n, 1};
}

// Tile index t in [0, count) -> (r, c), r >= c, row by row:
// t = r (r + 1) / 2 + c.
CANZONA_HOST_DEVICE inline void SymmetricTileAt(int64_t t, int64_t* r,
                                                int64_t* c) {
  int64_t row = 0;
  while ((row + 1) * (row + 2) / 2 <= t) ++row;
  *r = row;
  *c = t - row * (row + 1) / 2;
}

// Element offsets of one tile product's operands and result.
struct TileOperands {
  int64_t a = 0, b = 0, c = 0;
};

// Tile t of X X^T (X short side n, long side l; tile side `side`).
CANZONA_HOST_DEVICE inline TileOperands GramTileOperands(int64_t t,
                                                         int64_t side,
                                                         int64_t n, int64_t l) {
  int64_t r = 0, c = 0;
  SymmetricTileAt(t, &r, &c);
  return {r * side * l, c * side * l, r * side + c * side * n};
}

// Tile t of A A (A n x n symmetric; tile side `side`).
CANZONA_HOST_DEVICE inline TileOperands SquareTileOperands(int64_t t,
                                                           int64_t side,
                                                           int64_t n) {
  int64_t r = 0, c = 0;
  SymmetricTileAt(t, &r, &c);
  return {r * side, c * side * n, r * side + c * side * n};
}

}  // namespace canzona

#endif  // CANZONA_KERNELS_SYMMETRIC_TILES_H_
