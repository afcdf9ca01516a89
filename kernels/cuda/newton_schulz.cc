#include "kernels/cuda/newton_schulz.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/types/span.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/gram_newton_schulz.h"
#include "kernels/symmetric_tiles.h"

namespace canzona::cuda_internal {
namespace {

using cuda_kernels::LaunchConfig;
using cuda_kernels::NsElement;

// Byte offsets of the workspace regions, each 256-byte aligned (cuBLAS
// prefers aligned operands; the norm kernel reads float4).
// The Gram iteration's s x s buffers take the place of A and B.
// `tiles`: the bf16 standard iteration's symmetric products by tiles
// (kernels/symmetric_tiles.h), whose pointer arrays take `pointers`.
struct Layout {
  size_t x0 = 0, x1 = 0, a = 0, b = 0, partials = 0, denom = 0, pointers = 0,
         total = 0;
  int parts = 1;
  SymmetricTiles tiles;
};

// Where the standard iteration computes its symmetric products by tiles:
// bf16 (float32 runs SYRK instead, below), asked for, and a short side that
// splits into whole tiles of kSymmetricMinTile or more.
SymmetricTiles TilesFor(bool symmetric, const NewtonSchulzSpec& spec,
                        NsAlgorithm algorithm, int64_t n) {
  if (algorithm != NsAlgorithm::kStandard || !symmetric ||
      spec.precision != NsPrecision::kBfloat16) {
    return {n, 1};
  }
  return ChooseSymmetricTiles(n);
}

// `symmetric`: the spec's symmetric_products where the context allows it.
Layout MakeLayout(bool symmetric, const NewtonSchulzSpec& spec,
                  NsAlgorithm algorithm, int64_t batch, int64_t rows,
                  int64_t cols) {
  const NsPrecision precision = spec.precision;
  const size_t elem = precision == NsPrecision::kBfloat16 ? 2 : 4;
  const int64_t n = rows < cols ? rows : cols;
  const size_t x_bytes =
      WorkspaceRoundUp(static_cast<size_t>(batch * rows * cols) * elem);
  const size_t a_bytes =
      WorkspaceRoundUp(static_cast<size_t>(batch * n * n) * elem);
  Layout l;
  l.parts = cuda_kernels::NsNormParts(rows * cols);
  size_t off = 0;
  l.x0 = off;
  off += x_bytes;
  l.x1 = off;
  off += x_bytes;
  l.a = off;
  if (algorithm == NsAlgorithm::kGram) {
    off += WorkspaceRoundUp(GramWorkspaceBytes(precision, batch, n));
    l.b = l.a;
  } else {
    off += a_bytes;
    l.b = off;
    off += a_bytes;
  }
  l.partials = off;
  off +=
      WorkspaceRoundUp(static_cast<size_t>(batch) * l.parts * sizeof(double));
  l.denom = off;
  off += WorkspaceRoundUp(static_cast<size_t>(batch) * sizeof(float));
  l.tiles = TilesFor(symmetric, spec, algorithm, n);
  l.pointers = off;
  if (l.tiles.tiled()) {
    off += WorkspaceRoundUp(static_cast<size_t>(9 * batch * l.tiles.count()) *
                            sizeof(void*));
  }
  l.total = off;
  return l;
}

// For each of `batch` float32 matrices: C = alpha op(S) op(S)^T + beta C
// (column-major, n x n, leading dimension n, matrices n * n apart; S is
// n x k for CUBLAS_OP_N, k x n for CUBLAS_OP_T, with leading dimension
// lds, matrices stride_s apart). SYRK writes the lower triangle (the
// row-major upper one), which the mirror copies onto the other: cuBLAS has
// no batched SYRK, so one call per matrix.
absl::Status SyrkMirrored(const NsContext& ctx, cublasOperation_t trans,
                          int64_t batch, int64_t n, int64_t k, float alpha,
                          const float* s, int64_t lds, int64_t stride_s,
                          float beta, float* c) {
  for (int64_t i = 0; i < batch; ++i) {
    CANZONA_CUDA_RETURN_IF_ERROR(
        cublasSsyrk_64(ctx.cublas, CUBLAS_FILL_MODE_LOWER, trans, n, k, &alpha,
                       s + i * stride_s, lds, &beta, c + i * n * n, n));
  }
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::MirrorUpperToLower(
      {ctx.stream, ctx.num_sms}, batch, n, c, n, n * n));
  return absl::OkStatus();
}

}  // namespace

absl::Status NsBatchedGemm(const NsContext& ctx, bool bf16,
                           cublasOperation_t ta, cublasOperation_t tb,
                           int64_t m, int64_t n, int64_t k, float alpha,
                           const void* a, int64_t lda, int64_t stride_a,
                           const void* b, int64_t ldb, int64_t stride_b,
                           float beta, void* c, int64_t ldc, int64_t stride_c,
                           int64_t batch) {
  if (bf16) {
    CANZONA_CUDA_RETURN_IF_ERROR(cublasGemmStridedBatchedEx_64(
        ctx.cublas, ta, tb, m, n, k, &alpha, a, CUDA_R_16BF, lda, stride_a, b,
        CUDA_R_16BF, ldb, stride_b, &beta, c, CUDA_R_16BF, ldc, stride_c, batch,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSgemmStridedBatched_64(
      ctx.cublas, ta, tb, m, n, k, &alpha, static_cast<const float*>(a), lda,
      stride_a, static_cast<const float*>(b), ldb, stride_b, &beta,
      static_cast<float*>(c), ldc, stride_c, batch));
  return absl::OkStatus();
}

size_t NewtonSchulzWorkspaceBytes(const NsContext& ctx,
                                  const NewtonSchulzSpec& spec,
                                  NsAlgorithm algorithm, int64_t batch,
                                  int64_t rows, int64_t cols) {
  return MakeLayout(SymmetricProducts(ctx, spec), spec, algorithm, batch, rows,
                    cols)
      .total;
}

absl::Status RunNewtonSchulz(const NsContext& ctx, const NewtonSchulzSpec& spec,
                             NsAlgorithm algorithm, int64_t batch, int64_t rows,
                             int64_t cols, const float* input, float* output,
                             void* workspace) {
  const bool bf16 = spec.precision == NsPrecision::kBfloat16;
  const NsElement elem = bf16 ? NsElement::kBfloat16 : NsElement::kFloat32;
  // Wide orientation: X is n x m with n <= m, so the Gram matrix A is the
  // small n x n one.
  const bool transpose = rows > cols;
  const int64_t n = transpose ? cols : rows;
  const int64_t m = transpose ? rows : cols;
  const bool symmetric = SymmetricProducts(ctx, spec);
  const Layout layout =
      MakeLayout(symmetric, spec, algorithm, batch, rows, cols);
  char* base = static_cast<char*>(workspace);
  void* x = base + layout.x0;
  void* x_next = base + layout.x1;
  void* a = base + layout.a;
  void* b = base + layout.b;
  auto* partials = reinterpret_cast<double*>(base + layout.partials);
  auto* denom = reinterpret_cast<float*>(base + layout.denom);
  const LaunchConfig cfg{ctx.stream, ctx.num_sms};

  // X = input / (norm_scale * ||input||_F + eps), per matrix, on the device;
  // the division is fused into the conversion / transposition pass.
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::NsSumSquares(
      cfg, batch, rows * cols, input, layout.parts, partials));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::NsDenominators(cfg, batch, layout.parts, partials,
                                   spec.norm_scale, spec.norm_eps, denom));
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::NsLoad(
      cfg, batch, rows, cols, transpose, input, denom, elem, x));

  // Row-major X (n x m) is column-major X' = X^T (m x n, ld m), and a
  // row-major buffer read column-major is the transpose. In column-major:
  //   A' = X'^T X' = X X^T             (n x n; its row-major view is A^T)
  //   B' = a I + b A' + c A' A'        (row-major view: a I + b A + c A A)
  //   X'_next = X' B'                  (row-major view: B X)
  // so every product is exactly the row-major one. A' and A' A' are
  // symmetric: where spec.symmetric_products lets it, one triangle is
  // computed (SYRK in float32, the lower tiles in bf16) and mirrored.
  const int64_t sx = n * m;
  const int64_t sa = n * n;
  // float32 only: cuBLAS has no batched SYRK, so SYRK (half the flops) pays
  // off per matrix when the matrices are big or few; otherwise one batched
  // GEMM launch wins. Untuned threshold (~512^3 multiply-adds).
  const bool use_syrk =
      !bf16 && symmetric && (batch == 1 || n * n * m >= (int64_t{1} << 27));
  if (algorithm == NsAlgorithm::kGram) {
    // The whole iteration (gram_newton_schulz.h); x ends on the result.
    CANZONA_RETURN_IF_ERROR(RunGramSteps(ctx, spec, batch, n, m, x, x_next, a));
  }
  const auto standard_steps = algorithm == NsAlgorithm::kGram
                                  ? absl::Span<const std::array<float, 3>>()
                                  : absl::MakeConstSpan(spec.coefficients);
  // bf16 by tiles: one pointer-array batched GEMM per symmetric product over
  // the lower tiles of every matrix (kernels/symmetric_tiles.h), the arrays
  // written once per call for both of X's buffers.
  const SymmetricTiles& tiles = layout.tiles;
  const int64_t entries = batch * tiles.count();
  void** pointers = reinterpret_cast<void**>(base + layout.pointers);
  if (tiles.tiled() && !standard_steps.empty()) {
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::NsSymmetricTilePointers(
        cfg, batch, n, m, tiles.side, tiles.count(), elem, base + layout.x0,
        base + layout.x1, a, b, pointers));
  }
  // The tile products: C_t = alpha op(A_t) op(B_t) + beta C_t over the
  // arrays starting at `set` (3 arrays of `entries`).
  auto tile_gemm = [&](int set, cublasOperation_t ta, int64_t k, int64_t lda,
                       float alpha, float beta) -> absl::Status {
    void** at = pointers + 3 * set * entries;
    CANZONA_CUDA_RETURN_IF_ERROR(cublasGemmBatchedEx_64(
        ctx.cublas, ta, CUBLAS_OP_N, tiles.side, tiles.side, k, &alpha, at,
        CUDA_R_16BF, lda, at + entries, CUDA_R_16BF, lda, &beta,
        at + 2 * entries, CUDA_R_16BF, n, entries, CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  };
  bool x_is_x0 = true;
  for (const auto& [ca, cb, cc] : standard_steps) {
    // A = X X^T, both triangles: the tiles of A A read whole rows of A.
    if (tiles.tiled()) {
      CANZONA_RETURN_IF_ERROR(
          tile_gemm(x_is_x0 ? 0 : 1, CUBLAS_OP_T, m, m, 1.0f, 0.0f));
      CANZONA_CUDA_RETURN_IF_ERROR(
          cuda_kernels::NsMirrorUpperToLower(cfg, batch, n, elem, a));
    } else if (use_syrk) {
      CANZONA_RETURN_IF_ERROR(SyrkMirrored(ctx, CUBLAS_OP_T, batch, n, m, 1.0f,
                                           static_cast<const float*>(x), m, sx,
                                           0.0f, static_cast<float*>(a)));
    } else {
      CANZONA_RETURN_IF_ERROR(NsBatchedGemm(ctx, bf16, CUBLAS_OP_T, CUBLAS_OP_N,
                                            n, n, m, 1.0f, x, m, sx, x, m, sx,
                                            0.0f, a, n, sa, batch));
    }
    // B = a I + b A + c A A, so that X_next = B X has no "a X" term: cuBLAS
    // forbids C aliasing an input, so that term needed a copy of X per step
    // (by arithmetic, not measured: 12 MB moved against 15 GFLOP on a
    // 1024 x 3072 bf16 matrix, an eighth of the step at an H200's rates),
    // where a I + b A is one pass over the n x n A. The error against
    // float64 is the copy's (server/DESIGN.md 3.1).
    CANZONA_CUDA_RETURN_IF_ERROR(
        cuda_kernels::NsScaleAddIdentity(cfg, batch, n, cb, ca, elem, a, b));
    // A is symmetric (mirrored), so A A = A A^T: one triangle onto the
    // symmetric a I + b A, then mirrored.
    if (tiles.tiled()) {
      CANZONA_RETURN_IF_ERROR(tile_gemm(2, CUBLAS_OP_N, n, n, cc, 1.0f));
      CANZONA_CUDA_RETURN_IF_ERROR(
          cuda_kernels::NsMirrorUpperToLower(cfg, batch, n, elem, b));
    } else if (use_syrk) {
      CANZONA_RETURN_IF_ERROR(SyrkMirrored(ctx, CUBLAS_OP_N, batch, n, n, cc,
                                           static_cast<const float*>(a), n, sa,
                                           1.0f, static_cast<float*>(b)));
    } else {
      CANZONA_RETURN_IF_ERROR(NsBatchedGemm(ctx, bf16, CUBLAS_OP_N, CUBLAS_OP_N,
                                            n, n, n, cc, a, n, sa, a, n, sa,
                                            1.0f, b, n, sa, batch));
    }
    CANZONA_RETURN_IF_ERROR(NsBatchedGemm(ctx, bf16, CUBLAS_OP_N, CUBLAS_OP_N,
                                          m, n, n, 1.0f, x, m, sx, b, n, sa,
                                          0.0f, x_next, m, sx, batch));
    std::swap(x, x_next);
    x_is_x0 = !x_is_x0;
  }

  // Back to float32 (and to rows x cols when we transposed).
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::NsStore(cfg, batch, n, m, transpose, elem, x, output));
  return absl::OkStatus();
}

}  // namespace canzona::cuda_internal
