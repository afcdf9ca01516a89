#include "kernels/cuda/gram_newton_schulz.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/ns_algorithm.h"

namespace canzona::cuda_internal {
namespace {

using cuda_kernels::LaunchConfig;
using cuda_kernels::NsElement;

// The five float32 s x s buffers, then Q in bf16 for the final product.
struct GramLayout {
  size_t r = 0, z = 0, q = 0, q_next = 0, rz = 0, q_bf16 = 0, total = 0;
};

GramLayout MakeGramLayout(NsPrecision precision, int64_t batch, int64_t n) {
  const size_t f32 = WorkspaceRoundUp(static_cast<size_t>(batch * n * n) * 4);
  GramLayout l;
  size_t off = 0;
  for (size_t* region : {&l.r, &l.z, &l.q, &l.q_next, &l.rz}) {
    *region = off;
    off += f32;
  }
  l.q_bf16 = off;
  if (precision == NsPrecision::kBfloat16) {
    off += WorkspaceRoundUp(static_cast<size_t>(batch * n * n) * 2);
  }
  l.total = off;
  return l;
}

// Row-major C = alpha A B + beta C for `batch` n x n float32 matrices. A
// row-major matrix read column-major is its transpose, so the column-major
// call computes C^T = B^T A^T: operands swapped, nothing transposed.
// tf32: TF32 tensor cores on float32 operands (the bf16 precision's choice).
absl::Status SmallProducts(const NsContext& ctx, bool tf32, int64_t batch,
                           int64_t n, float alpha, const float* a,
                           const float* b, float beta, float* c) {
  const int64_t s = n * n;
  CANZONA_CUDA_RETURN_IF_ERROR(cublasGemmStridedBatchedEx_64(
      ctx.cublas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, b, CUDA_R_32F, n,
      s, a, CUDA_R_32F, n, s, &beta, c, CUDA_R_32F, n, s, batch,
      tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status CopyDevice(const NsContext& ctx, const float* src, int64_t count,
                        float* dst) {
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * sizeof(float),
                      cudaMemcpyDeviceToDevice, ctx.stream));
  return absl::OkStatus();
}

}  // namespace

size_t GramWorkspaceBytes(NsPrecision precision, int64_t batch, int64_t n) {
  return MakeGramLayout(precision, batch, n).total;
}

absl::Status RunGramSteps(const NsContext& ctx, const NewtonSchulzSpec& spec,
                          int64_t batch, int64_t n, int64_t m, void*& x,
                          void*& other, void* workspace) {
  const bool bf16 = spec.precision == NsPrecision::kBfloat16;
  const GramLayout layout = MakeGramLayout(spec.precision, batch, n);
  char* base = static_cast<char*>(workspace);
  const LaunchConfig cfg{ctx.stream, ctx.num_sms};
  const int64_t sx = n * m;
  const int64_t sa = n * n;
  const int64_t all = batch * sa;
  const float one = 1.0f, zero = 0.0f;
  const int64_t steps = static_cast<int64_t>(spec.coefficients.size());
  for (int64_t first = 0; first < steps;) {
    const int64_t end = GramSegmentEnd(first, steps);
    auto* r = reinterpret_cast<float*>(base + layout.r);
    auto* z = reinterpret_cast<float*>(base + layout.z);
    auto* q = reinterpret_cast<float*>(base + layout.q);
    auto* q_next = reinterpret_cast<float*>(base + layout.q_next);
    auto* rz = reinterpret_cast<float*>(base + layout.rz);

    // R = X X^T; as in newton_schulz.cc, row-major X (n x m) is
    // column-major X' (m x n) and R' = X'^T X' is R itself (symmetric).
    if (!bf16 && batch == 1) {
      // One matrix: SYRK's half of the flops (cuBLAS has no batched SYRK).
      CANZONA_CUDA_RETURN_IF_ERROR(
          cublasSsyrk_64(ctx.cublas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T, n, m,
                         &one, static_cast<const float*>(x), m, &zero, r, n));
      CANZONA_CUDA_RETURN_IF_ERROR(
          cuda_kernels::MirrorUpperToLower(cfg, 1, n, r, n, sa));
    } else {
      // bf16 operands, float32 output and accumulation.
      const cudaDataType_t xt = bf16 ? CUDA_R_16BF : CUDA_R_32F;
      CANZONA_CUDA_RETURN_IF_ERROR(cublasGemmStridedBatchedEx_64(
          ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, m, &one, x, xt, m, sx, x,
          xt, m, sx, &zero, r, CUDA_R_32F, n, sa, batch, CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
    }

    for (int64_t step = first; step < end; ++step) {
      const auto& [a, b, c] = spec.coefficients[step];
      // Z = b R + c R R (cuBLAS's C may not alias an input: Z starts as R).
      CANZONA_RETURN_IF_ERROR(CopyDevice(ctx, r, all, z));
      CANZONA_RETURN_IF_ERROR(
          SmallProducts(ctx, bf16, batch, n, c, r, r, b, z));
      if (step == first) {
        // Q = a I + Z: Q starts as I, so no product; one launch for the
        // batch (the same float32 sums as adding a to Z's diagonal).
        CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::NsScaleAddIdentity(
            cfg, batch, n, 1.0f, a, cuda_kernels::NsElement::kFloat32, z, q));
      } else {
        // Q <- a Q + Z Q.
        CANZONA_RETURN_IF_ERROR(CopyDevice(ctx, q, all, q_next));
        CANZONA_RETURN_IF_ERROR(
            SmallProducts(ctx, bf16, batch, n, 1.0f, z, q, a, q_next));
        std::swap(q, q_next);
      }
      if (step + 1 == end) break;  // R is not needed after the segment
      // R <- P R P: RZ = a R + R Z, then R = a RZ + Z RZ.
      CANZONA_RETURN_IF_ERROR(CopyDevice(ctx, r, all, rz));
      CANZONA_RETURN_IF_ERROR(
          SmallProducts(ctx, bf16, batch, n, 1.0f, r, z, a, rz));
      CANZONA_RETURN_IF_ERROR(CopyDevice(ctx, rz, all, r));
      CANZONA_RETURN_IF_ERROR(
          SmallProducts(ctx, bf16, batch, n, 1.0f, z, rz, a, r));
    }

    // X <- Q X; column-major: X_next' (m x n) = X' (m x n) Q' (n x n).
    const void* q_operand = q;
    if (bf16) {
      void* q_bf16 = base + layout.q_bf16;
      CANZONA_CUDA_RETURN_IF_ERROR(
          cuda_kernels::NsLoad(cfg, 1, batch * n, n, false, q, nullptr,
                               NsElement::kBfloat16, q_bf16));
      q_operand = q_bf16;
    }
    CANZONA_RETURN_IF_ERROR(NsBatchedGemm(ctx, bf16, CUBLAS_OP_N, CUBLAS_OP_N,
                                          m, n, n, 1.0f, x, m, sx, q_operand, n,
                                          sa, 0.0f, other, m, sx, batch));
    std::swap(x, other);
    first = end;
  }
  return absl::OkStatus();
}

}  // namespace canzona::cuda_internal
